"""Where a long bfloat16 prefill's time goes: per op kind, as fractions of the engine's steps (issue 12).

Prefills one prompt (``--prompt-len``, default 4,096) through ``LLM.generate`` at each ``--budgets`` entry
(default: the offline ``LLM``'s own default, then 4,096) and times, with ``time.perf_counter`` around
each call (no profiler: the compiled kernels are ctypes calls it would not see), the pieces of
``CpuStep``'s chunk path: every tile GEMM (AMX, or ``bf16gemm`` without AMX) by weight shape (with its
GFLOP/s), oneDNN GEMMs, attention (RoPE + KV write + chunk attention; where the AMX QKV GEMM rotates
and writes the KV in its stores, as bfloat16 chunk steps do on AMX, those two are inside "gemm qkv"),
the fused residual-add + RMSNorm passes, the SiLU gate when it is not fused, the embedding, the LM head
and sampling; what is left of each step's wall time is Python,
scheduling and input building. Padding waste is the padded rows' share of the step's rows. Then the
register-only peak of the tile GEMM that runs (``amx.peak``, else ``bf16gemm.peak``) on the same
threads, for the GEMMs' share of it.

    PYTHONPATH=. python benchmarks/profile_prefill.py [--model DIR] [--budgets 0,4096] [--repeats 2]

Prints one table per budget and writes ``--out`` (JSON) with the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

from segserve import LLM, SamplingParams
from segserve.kernels import amx, bf16gemm, chunk_attention
from segserve.kernels import cpu as cpu_kernels
from segserve.worker import cpu_step, model_runner

DEFAULT_MODEL = Path.home() / ".cache" / "segserve" / "baselines" / "smollm2-135m-instruct-q4_1-f32"
NAMES = {(960, 576): "qkv", (576, 576): "o", (3072, 576): "gate_up", (576, 1536): "down"}


class Timers:
    """Seconds and flops per op kind, summed over the calls made while :attr:`on`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.flops: dict[str, float] = defaultdict(float)
        self.rows = self.padded_rows = 0
        self.on = False
        self.active: set[str] = set()  # names whose timed call is running (a nested one is not timed again)

    def wrap(self, owner, attr: str, kind) -> None:
        """Replace ``owner.attr`` by a timed call; ``kind(args, kwargs)`` -> (name, flops)."""
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            name, flops = kind(args, kwargs)
            if name in self.active:  # inside a call already timed under this name
                return fn(*args, **kwargs)
            self.active.add(name)
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                self.active.discard(name)
            self.seconds[name] += time.perf_counter() - t0
            self.flops[name] += flops
            return out

        setattr(owner, attr, timed)

    @contextmanager
    def span(self, name: str):
        """``with t.span(name):`` adds the block's seconds to ``name``."""
        t0 = time.perf_counter()
        yield
        self.seconds[name] += time.perf_counter() - t0


def amx_kind(args, kwargs):
    x, _, n, k = args[:4]
    return f"gemm {NAMES.get((n, k), f'{n}x{k}')}", 2.0 * x.shape[0] * n * k


def install(t: Timers) -> None:
    """Time the chunk path's pieces where ``cpu_step`` and the model call them."""
    t.wrap(amx, "linear", amx_kind)
    t.wrap(bf16gemm, "linear", amx_kind)
    t.wrap(cpu_kernels, "add_rmsnorm_", lambda a, k: ("add+rmsnorm", 0.0))
    t.wrap(cpu_kernels, "silu_mul", lambda a, k: ("silu_mul (unfused)", 0.0))
    t.wrap(chunk_attention, "chunk_attention", lambda a, k: ("attention kernel", 0.0))
    orig_forward = cpu_step.forward_chunk

    def forward_chunk(model, input_ids, *rest, **kw):
        if t.on:
            t.padded_rows += input_ids.shape[0]
        with t.span("_chunk forward"):
            return orig_forward(model, input_ids, *rest, **kw)

    cpu_step.forward_chunk = forward_chunk
    # attend = RoPE + KV write + the attention backend (whose kernel is timed apart above).
    from segserve.models import llama

    t.wrap(llama.LlamaAttention, "attend", lambda a, k: ("attend (rope+kv+attn)", 0.0))
    # The fused chunk path (AMX QKV GEMM with RoPE and the KV write in its stores) calls attend_rotated
    # directly; attend calls it too, so it is timed only outside attend (one key for both).
    t.wrap(llama.LlamaAttention, "attend_rotated", lambda a, k: ("attend (rope+kv+attn)", 0.0))
    t.wrap(torch.nn.Embedding, "forward", lambda a, k: ("embedding", 0.0))
    t.wrap(cpu_step.CpuStep, "compute_logits",
           lambda a, k: ("lm head", 2.0 * a[1].shape[0] * a[1].shape[1] * a[0].model.config.vocab_size))
    t.wrap(model_runner, "sample", lambda a, k: ("sampling", 0.0))
    t.wrap(model_runner.ModelRunner, "execute_model", lambda a, k: ("_execute_model", 0.0))
    t.wrap(model_runner.ModelRunner, "_prepare_inputs", lambda a, k: ("prepare inputs", 0.0))


def peak_gflops(threads: int) -> float:
    """Best of 30 short runs of the register-only microkernel of the tile GEMM that runs here (AMX's,
    else bf16gemm's), GFLOP/s over ``threads``; NaN when neither runs."""
    kernel = amx if amx.available() else bf16gemm if bf16gemm.available() else None
    if kernel is None:
        return float("nan")
    # ~3 ms a run at 2 threads: 20,000 rounds (0.07 ms) measured mostly the team's wake-up and
    # reported half the 2-thread peak (464 against 926 GFLOP/s on Zen 4).
    iters, best = 1_000_000, 0.0
    for _ in range(30):
        t0 = time.perf_counter()
        kernel.peak(iters, threads)
        dt = time.perf_counter() - t0
        best = max(best, threads * iters * kernel.PEAK_FLOPS_PER_ITER / dt / 1e9)
    return best


def run(llm: LLM, prompt_len: int, repeats: int, t: Timers, seed: int, prompts: int = 1) -> list[float]:
    """Wall seconds of each of ``repeats`` cold prefills of ``prompt_len`` fresh tokens, in ``prompts``
    prompts of (near) equal length sent together (the offline workload's steps hold several)."""
    times = []
    for r in range(repeats):
        g = torch.Generator().manual_seed(seed + r)
        ids = torch.randint(100, 40000, (prompt_len,), generator=g).tolist()
        cuts = [prompt_len * i // prompts for i in range(prompts + 1)]
        batch = [{"prompt_token_ids": ids[a:b]} for a, b in zip(cuts, cuts[1:], strict=False)]
        t.on = True
        t0 = time.perf_counter()
        llm.generate(batch, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        times.append(time.perf_counter() - t0)
        t.on = False
    return times


def report(t: Timers, walls: list[float], prompt_len: int, peak: float) -> dict:
    """Print and return each op kind's seconds per prompt, share of the wall time and GFLOP/s."""
    repeats, total = len(walls), t.seconds.get("_execute_model", 0.0)
    wall = sum(walls) / repeats  # shares are of the summed wall time, which the timers also sum over
    rows = {}
    print(f"  wall {wall:.3f} s/prompt ({prompt_len / wall:.0f} tok/s; runs {[round(w, 2) for w in walls]}); "
          f"execute_model {total / repeats:.3f} s")
    gemm = sum(v for k, v in t.seconds.items() if k.startswith("gemm"))
    inside = {k: v for k, v in t.seconds.items() if not k.startswith("_")}
    attend = inside.pop("attend (rope+kv+attn)", 0.0)
    kern = inside.get("attention kernel", 0.0)
    inside["rope+kv write+plan"] = attend - kern
    fwd = t.seconds.get("_chunk forward", 0.0)
    inside["chunk path other"] = fwd - gemm - attend - sum(
        v for k, v in inside.items() if k in ("add+rmsnorm", "silu_mul (unfused)", "embedding"))
    inside["python/scheduler/other"] = wall * repeats - t.seconds.get("_chunk forward", 0.0) - sum(
        inside.get(k, 0.0) for k in ("lm head", "sampling", "prepare inputs"))
    for name, sec in sorted(inside.items(), key=lambda kv: -kv[1]):
        share = sec / (wall * repeats)
        gf = t.flops.get(name, 0.0) / sec / 1e9 if sec > 0 and t.flops.get(name) else None
        rows[name] = {"seconds_per_prompt": sec / repeats, "share": share, "gflops": gf}
        extra = f"  {gf:7.0f} GFLOP/s ({gf / peak:4.0%} of peak)" if gf else ""
        print(f"  {name:28s} {sec / repeats * 1000:8.1f} ms  {share:6.1%}{extra}")
    if gemm:
        gf = sum(v for k, v in t.flops.items() if k.startswith("gemm")) / gemm / 1e9
        share = gemm / (wall * repeats)
        print(f"  all GEMMs: {share:.1%} of wall, {gf:.0f} GFLOP/s = {gf / peak:.0%} of peak")
        rows["_all_gemms"] = {"share": gemm / (wall * repeats), "gflops": gf}
    waste = 1 - prompt_len * repeats / t.padded_rows if t.padded_rows else 0.0
    print(f"  padding waste: {waste:.1%} of chunk rows")
    rows["_padding_waste"] = waste
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--budgets", default="0,4096", help="comma list; 0 = the LLM's default")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompts", type=int, default=1,
                   help="the --prompt-len tokens split into this many prompts, sent together")
    p.add_argument("--out", default="results/profile_prefill.json")
    args = p.parse_args(argv)
    if not 1 <= args.prompts <= args.prompt_len:
        p.error(f"--prompts must be in [1, --prompt-len], got {args.prompts}")
    threads = torch.get_num_threads()
    result = {"load_before": os.getloadavg(), "threads": threads, "budgets": {}}
    peak = peak_gflops(threads)
    kind = "AMX" if amx.available() else "vdpbf16ps" if bf16gemm.available() else "no tile GEMM"
    print(f"{kind} register peak, {threads} threads: {peak:.0f} GFLOP/s; load {os.getloadavg()}")
    t = Timers()
    install(t)
    for b in (int(x) for x in args.budgets.split(",")):
        kw = {} if b == 0 else {"max_num_batched_tokens": b}
        llm = LLM(args.model, dtype=args.dtype, max_model_len=max(8192, args.prompt_len + 16), **kw)
        budget = llm.llm_engine.config.scheduler.max_num_batched_tokens
        run(llm, 512, 1, t, seed=99)  # warm-up, not counted
        t.seconds.clear()
        t.flops.clear()
        t.padded_rows = 0
        walls = run(llm, args.prompt_len, args.repeats, t, seed=1, prompts=args.prompts)
        print(f"budget {budget}:")
        result["budgets"][budget] = report(t, walls, args.prompt_len, peak) | {"wall_s": walls}
        del llm
    result["peak_gflops"] = peak
    result["load_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"load after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
