"""The AVX-512 BF16 GEMM (``segserve.kernels.bf16gemm``) against oneDNN on SmolLM2-135M's shapes (issue 12).

1. The measured peak: ``bf16gemm.peak``'s register-only microkernel (24 vdpbf16ps accumulators, no
   loads) on the table's thread count, in many short trials (best = the ceiling, median = what a trial
   got on this shared machine); and again as one more form in every cell's alternation (``peak``), so
   each cell's share of the peak compares trials of the same minutes (the host has slow phases).
2. GFLOP/s of the kernel, oneDNN's pre-packed bf16 GEMM (``PackedLinear``'s, what the engine calls
   without this kernel) and ``F.linear``, for M rows x the model's (N, K): fused qkv (960, 576), o
   (576, 576), fused gate|up (3072, 576; the kernel with its SiLU gate fused, oneDNN plus the compiled
   ``silu_mul`` pass, as the engine runs each), down (576, 1536). Forms alternate trial by trial; each
   trial times enough calls for ~1 ms; best and median over trials.
3. ``--prefill N``: N rounds of one 4,096-token prompt prefilled by the engine in bfloat16 (budget
   ``--budget``, default 4,096), kernel on and off alternating in one process (``CpuStep.prepack`` redone
   at each switch, a fresh random prompt per prefill); median seconds, tok/s and the per-round ratio.

Prints one summary line and writes JSON (``--out``) with the CPU model, the load average and the host's
steal share.

    PYTHONPATH=. python benchmarks/bench_bf16gemm.py [--trials 20] [--rows 16,512,4096] [--prefill 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from segserve.bench import host
from segserve.kernels import bf16gemm
from segserve.kernels import cpu as cpu_kernels
from segserve.models.packed_linear import pack_weight, packed_linear

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")


def measure_peak(threads: int, trials: int) -> dict[str, float]:
    """GFLOP/s of the register-only microkernel: best and median of ``trials`` ~0.5 ms runs."""
    iters = 200
    bf16gemm.peak(iters, threads)
    while True:  # size a trial to ~0.5 ms
        t0 = time.perf_counter()
        bf16gemm.peak(iters, threads)
        if time.perf_counter() - t0 > 5e-4:
            break
        iters *= 2
    rates = []
    for _ in range(trials):
        t0 = time.perf_counter()
        bf16gemm.peak(iters, threads)
        rates.append(threads * iters * bf16gemm.PEAK_FLOPS_PER_ITER / (time.perf_counter() - t0) / 1e9)
    return {"best": max(rates), "median": statistics.median(rates)}


def forms(m: int, shape: str) -> dict[str, Callable[[], object]]:
    """One callable per form for ``(m, K)`` bf16 rows by a random ``(N, K)`` bf16 weight (and ``peak``,
    the register-only microkernel for as many flops, timed among them)."""
    n, k = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    w = (0.05 * torch.randn(n, k, generator=gen)).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    tiles, onednn = bf16gemm.pack(w), pack_weight(w)
    threads = torch.get_num_threads()
    iters = max(1, round(2.0 * m * n * k / threads / bf16gemm.PEAK_FLOPS_PER_ITER))
    peak = {"peak": lambda: bf16gemm.peak(iters, threads)}  # the same flops as the GEMM (rounded)
    if shape == "gate_up":  # the engine's forms: SiLU gate fused, or oneDNN + the compiled gate pass
        return {
            "bf16gemm": lambda: bf16gemm.linear(x, tiles, n, k, silu_mul=True),
            "onednn_packed": lambda: cpu_kernels.silu_mul(packed_linear(x, onednn, None)),
            "f_linear": lambda: cpu_kernels.silu_mul(F.linear(x, w)),
        } | peak
    return {
        "bf16gemm": lambda: bf16gemm.linear(x, tiles, n, k),
        "onednn_packed": lambda: packed_linear(x, onednn, None),
        "f_linear": lambda: F.linear(x, w),
    } | peak


def time_forms(fns: dict[str, Callable[[], object]], flops: float, trials: int) -> dict[str, dict]:
    """Alternating trials of each form: GFLOP/s best and median."""
    calls = {}
    for name, fn in fns.items():
        fn()
        t0 = time.perf_counter()
        fn()
        calls[name] = max(1, int(1e-3 / max(time.perf_counter() - t0, 1e-6)))
    rates: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(trials):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            rates[name].append(flops * calls[name] / (time.perf_counter() - t0) / 1e9)
    return {name: {"best": max(r), "median": statistics.median(r)} for name, r in rates.items()}


def gemm_table(rows: list[int], trials: int) -> list[dict]:
    """Every form at every row count and shape; printed as it goes, with the kernel's share of the peak
    (its best trial over the best of the cell's own peak trials: the same minutes)."""
    results = []
    for m in rows:
        for shape, (n, k) in SHAPES.items():
            r = time_forms(forms(m, shape), 2.0 * m * n * k, trials)
            share = r["bf16gemm"]["best"] / r["peak"]["best"]
            results.append({"M": m, "shape": shape, "N": n, "K": k, **r, "peak_share_best": share})
            cells = "  ".join(f"{f} {v['median']:.0f} ({v['best']:.0f})" for f, v in r.items())
            print(f"  M={m:5d} {shape:8s} {n:5d}x{k:<5d} GFLOP/s median (best): {cells}  "
                  f"kernel best {share:.0%} of peak", flush=True)
    return results


def prefill(rounds: int, budget: int) -> dict[str, list[float]]:
    """Seconds to prefill one 4,096-token prompt in bfloat16, kernel on / off alternating per round."""
    from segserve.engine.llm_engine import LLMEngine
    from segserve.models.loader import load_model
    from segserve.sampling_params import SamplingParams

    engine = LLMEngine(model=load_model(None, dtype=torch.bfloat16), dtype="bfloat16",
                       max_num_batched_tokens=budget, max_model_len=8192)
    step = engine.runner.cpu_step
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {"on": [], "off": []}
    for rep in range(rounds + 1):  # round 0 warms both paths up and is not kept
        for name in (("on", "off") if rep % 2 else ("off", "on")):
            bf16gemm.set_enabled(name == "on")
            step.prepack()
            ids = torch.randint(100, 40000, (4096,), generator=gen).tolist()
            engine.add_request(f"{name}-{rep}", {"prompt_token_ids": ids}, SamplingParams(max_tokens=1))
            t0 = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            if rep:
                times[name].append(time.perf_counter() - t0)
            print(f"  round {rep} {name}: {time.perf_counter() - t0:.2f} s; load {os.getloadavg()[0]:.2f}",
                  flush=True)
    bf16gemm.set_enabled(True)
    step.prepack()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--rows", default="16,512,4096")
    p.add_argument("--prefill", type=int, default=0, help="rounds of the on/off prefill A/B (0: none)")
    p.add_argument("--budget", type=int, default=4096)
    p.add_argument("--out", default="results/bench_bf16gemm.json")
    args = p.parse_args()
    if not bf16gemm.available():
        raise SystemExit(f"bf16 GEMM unavailable: {bf16gemm.unavailable_reason()}")
    load_before, cpu_before = os.getloadavg(), host.cpu_times()
    threads = torch.get_num_threads()
    record: dict = {"cpu": cpu_model(), "torch": torch.__version__, "threads": threads,
                    "load_before": load_before}
    rows = [int(r) for r in args.rows.split(",") if r]
    lines = []
    if rows:
        peak = measure_peak(threads, 20 * args.trials)
        print(f"{threads} threads: vdpbf16ps peak (register-only) {peak['best']:.0f} GFLOP/s best, "
              f"{peak['median']:.0f} median")
        record["peak_gflops"] = peak
        record["gemm"] = gemm_table(rows, args.trials)
        for m in rows:
            at = [r for r in record["gemm"] if r["M"] == m]
            lines.append(f"M={m}: kernel/oneDNN " + "/".join(
                f"{r['bf16gemm']['median'] / r['onednn_packed']['median']:.2f}" for r in at)
                + " (medians), kernel " + "/".join(f"{r['peak_share_best']:.0%}" for r in at)
                + " of peak (best)")
        lines.append(f"peak {peak['best']:.0f} GFLOP/s (first measured); shapes qkv/o/gate_up/down")
    if args.prefill:
        t = prefill(args.prefill, args.budget)
        record["prefill_4096_s"] = t
        ratios = [off / on for on, off in zip(t["on"], t["off"], strict=True)]
        med = {k: statistics.median(v) for k, v in t.items()}
        record["prefill_ratio_per_round"] = ratios
        print(f"prefill 4,096 tokens (bf16, budget {args.budget}, {threads} threads), median s: "
              + ", ".join(f"{k} {v:.2f} ({4096 / v:.0f} tok/s)" for k, v in med.items()))
        lines.append(f"prefill on {4096 / med['on']:.0f} tok/s, off {4096 / med['off']:.0f} tok/s, "
                     f"per-round off/on median {statistics.median(ratios):.2f}x")
    record["load_after"] = os.getloadavg()
    record["steal_share"] = host.steal_share(cpu_before, host.cpu_times())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print("SUMMARY " + "; ".join(lines) + f"; load {load_before[0]:.1f} -> {record['load_after'][0]:.1f}, "
          f"steal {record['steal_share'] or 0:.1%}; {args.out}")


if __name__ == "__main__":
    main()
