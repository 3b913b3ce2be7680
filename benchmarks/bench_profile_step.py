"""Profile of one decode step and one prefill step of the engine: top ops and their share of op time.

The decode step: ``--batch`` requests of ``--prompt-len`` tokens each, all decoding (profiled over
``--steps`` steps, reported per step). The prefill step: one fresh request whose prompt fills the
512-token budget in one chunk. ``--no-prepack`` drops the oneDNN weight packing first (the "before"
of docs/perf.md for bfloat16). Wall time per step is reported next to the profiler's op time: the
difference is Python and dispatch overhead the profiler does not attribute to an op.

Prints one summary line; writes JSON (and the tables) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def top_ops(prof, steps: int, limit: int) -> tuple[list[dict], float]:
    """Top ``limit`` ops by self CPU time: name, ms per step, share of all op time; and the total."""
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e3 / steps
    rows = sorted(events, key=lambda e: -e.self_cpu_time_total)[:limit]
    per_step = [e.self_cpu_time_total / 1e3 / steps for e in rows]
    return [
        {"op": e.key, "ms": ms, "share": ms / total, "calls": e.count // steps}
        for e, ms in zip(rows, per_step, strict=True)
    ], total


def profiled_steps(engine, steps: int) -> tuple[list[dict], float, float]:
    """Profile ``steps`` engine steps: (top ops, op ms per step, wall ms per step)."""
    for _ in range(2):  # warm-up outside the profile
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - start) * 1e3 / steps
    ops, total = top_ops(prof, steps, 10)
    return ops, total, wall


def main() -> None:
    from segserve.engine.llm_engine import LLMEngine
    from segserve.models.loader import load_model
    from segserve.sampling_params import SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--batch", type=int, default=1, help="decoding requests")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-prepack", action="store_true")
    parser.add_argument("--out", default="results/bench_profile_step.json")
    args = parser.parse_args()
    if min(args.batch, args.prompt_len, args.steps, args.threads) < 1:
        parser.error("--batch, --prompt-len, --steps and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    loaded = load_model(None, dtype=getattr(torch, args.dtype))
    engine = LLMEngine(model=loaded, dtype=args.dtype, max_num_seqs=max(args.batch, 2))
    if args.no_prepack:
        engine.runner.cpu_step.unpack()
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    for b in range(args.batch):
        engine.add_request(f"d{b}", [100 + b] + [200 + i % 1000 for i in range(args.prompt_len - 1)], params)
    while any(r.is_prefill for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    decode = profiled_steps(engine, args.steps)
    while engine.has_unfinished_requests():
        engine.step()
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for r in range(3):  # 2 warm-ups + 1 profiled, each one 512-token chunk
        engine.add_request(f"p{r}", [300 + r] + [400 + i % 3000 for i in range(511)], one)
    prefill = profiled_steps(engine, 1)
    result = {
        "dtype": args.dtype, "batch": args.batch, "threads": args.threads, "prepack": not args.no_prepack,
        "loadavg": os.getloadavg()[0],
        "decode": {"top_ops": decode[0], "op_ms": decode[1], "wall_ms": decode[2]},
        "prefill_512": {"top_ops": prefill[0], "op_ms": prefill[1], "wall_ms": prefill[2]},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    top = {k: f"{result[k]['top_ops'][0]['op']} {100 * result[k]['top_ops'][0]['share']:.0f}%"
           for k in ("decode", "prefill_512")}
    print(
        f"profile {args.dtype} prepack={not args.no_prepack} threads={args.threads}: "
        f"decode batch {args.batch} {decode[2]:.1f} ms wall ({decode[1]:.1f} ms in ops; "
        f"top {top['decode']}); prefill 512 "
        f"{prefill[2]:.0f} ms wall ({prefill[1]:.0f} ms in ops; top {top['prefill_512']}); "
        f"load {result['loadavg']:.1f} -> {args.out}"
    )


if __name__ == "__main__":
    main()
