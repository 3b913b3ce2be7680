"""The compiled float32 GEMM with GGUF block weights (``segserve.kernels.f32gemm``) against the path it
replaces (dequantize tiles to float32, then ``F.linear``), A/B interleaved in one process.

Kernel part: SmolLM2-135M's linear shapes as Q4_1 blocks (K = 576 with N = 960, 576, 3072; K = 1536
with N = 576) at M rows each; per round the two variants alternate (order flipped every round), and
the medians and minima over rounds are reported in GFLOP/s. ``--e2e`` adds prefill of one
``--prompt-tokens`` prompt through ``LLM()`` (the default Q4_1 model, ``max_tokens=1``, prefix caching
off), the two paths alternating per round, in prompt tok/s. Prints one summary line and writes JSON to
``--out`` with the load average before and after.

    python benchmarks/bench_f32gemm.py --rows 256 1024 4096 --rounds 5 --e2e
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from segserve.kernels import f32gemm
from segserve.kernels.gguf_blocks import QuantWeight
from segserve.models.quant_linear import quantized_matmul

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (N, K): qkv, o, gate_up, down
VARIANTS = ("f32gemm", "dequant_linear")


def _q4_1(n: int, k: int) -> QuantWeight:
    w = np.random.default_rng(n + k).standard_normal((n, k)).astype(np.float32) * 0.05
    q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    return QuantWeight(torch.from_numpy(q.view(np.uint8).reshape(n, -1)).clone(), "Q4_1", k)


def _timed(variant: str, f) -> float:
    """Seconds of one call of ``f`` with the f32gemm switch set for ``variant``."""
    old = f32gemm.set_enabled(variant == "f32gemm")
    try:
        start = time.perf_counter()
        f()
        return time.perf_counter() - start
    finally:
        f32gemm.set_enabled(old)


def _interleaved(f, rounds: int, reps: int) -> dict[str, list[float]]:
    """Per variant, the best of ``reps`` calls in each of ``rounds`` rounds (order flipped per round)."""
    for v in VARIANTS:
        _timed(v, f)  # warm-up: packing buffers, page faults, the library
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for v in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            times[v].append(min(_timed(v, f) for _ in range(reps)))
    return times


def _summary(times: list[float], work: float) -> dict[str, float]:
    return {"median": work / statistics.median(times), "min_time_rate": work / min(times),
            "max_time_rate": work / max(times)}


def bench_kernel(rows: list[int], rounds: int, reps: int) -> list[dict]:
    out = []
    for n, k in SHAPES:
        w = _q4_1(n, k)
        for m in rows:
            x = torch.randn(m, k)
            flops = 2.0 * m * n * k
            times = _interleaved(lambda x=x, w=w: quantized_matmul(x, w), rounds, reps)
            rec = {"M": m, "N": n, "K": k}
            for v in VARIANTS:
                rec[v] = {key: val / 1e9 for key, val in _summary(times[v], flops).items()}
            out.append(rec)
            print(f"  M={m:5d} N={n:5d} K={k:5d}  GFLOP/s median f32gemm {rec['f32gemm']['median']:6.1f} "
                  f"vs {rec['dequant_linear']['median']:6.1f}  (best {rec['f32gemm']['min_time_rate']:6.1f} "
                  f"vs {rec['dequant_linear']['min_time_rate']:6.1f})", flush=True)
    return out


def bench_e2e(prompt_tokens: int, rounds: int) -> dict:
    from segserve import LLM, SamplingParams

    llm = LLM(enable_prefix_caching=False, max_num_batched_tokens=prompt_tokens)
    gen = np.random.default_rng(0)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    vocab = 49152

    def run() -> None:
        ids = gen.integers(100, vocab - 100, size=prompt_tokens).tolist()
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)

    times = _interleaved(run, rounds, reps=1)
    return {"prompt_tokens": prompt_tokens,
            **{v: _summary(times[v], float(prompt_tokens)) for v in VARIANTS}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=3, help="calls per round and variant (the best is kept)")
    p.add_argument("--e2e", action="store_true", help="also time prefill through LLM()")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads (default: torch's)")
    p.add_argument("--out", type=Path, default=Path("results/bench_f32gemm.json"))
    args = p.parse_args()
    if not f32gemm.enabled():
        raise SystemExit(f"the f32 GEMM is off here: {f32gemm.unavailable_reason()}")
    if args.threads:
        torch.set_num_threads(args.threads)
    record = {"uptime_before": os.getloadavg(), "threads": torch.get_num_threads()}
    record["kernel"] = bench_kernel(args.rows, args.rounds, args.reps)
    if args.e2e:
        record["e2e"] = bench_e2e(args.prompt_tokens, args.rounds)
    record["uptime_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    ratios = [r["f32gemm"]["median"] / r["dequant_linear"]["median"] for r in record["kernel"]]
    rates = [r["f32gemm"]["median"] for r in record["kernel"]]
    line = (f"bench_f32gemm: f32gemm median GFLOP/s {min(rates):.0f}..{max(rates):.0f}"
            f" ({min(ratios):.2f}x..{max(ratios):.2f}x dequant+F.linear)")
    if args.e2e:
        e = record["e2e"]
        line += (f"; prefill {e['prompt_tokens']} tokens {e['f32gemm']['median']:.0f} vs "
                 f"{e['dequant_linear']['median']:.0f} tok/s")
    print(f"{line}; load {record['uptime_before'][0]:.2f} -> {record['uptime_after'][0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
