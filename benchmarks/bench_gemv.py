"""The weight products of one SmolLM2-135M decode step (121 GEMVs at M rows) in several forms.

Shapes: per layer the fused q/k/v (960 x 576), o (576 x 576), fused gate/up (3,072 x 576) and down
(576 x 1,536), 30 layers, plus the 49,152 x 576 LM head; random weights. Forms: ``F.linear`` in
float32 and bfloat16, ``torch.mv`` (M = 1 only), oneDNN pre-packed bfloat16
and float32 (``segserve.models.packed_linear``), MKL pre-packed float32 (``torch.ops.mkl._mkl_linear``),
and segserve's compiled small-batch linear in both dtypes (``segserve.kernels.cpu.linear``, when built).
Forms alternate rep by rep; min and median ms of a whole step, and the weight bytes streamed per
second at the min. Prints one summary line; writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from segserve.kernels import cpu as cpu_kernels
from segserve.models.packed_linear import pack_weight, packed_linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def forms(rows: int) -> tuple[dict[str, Callable[[], object]], dict[str, int]]:
    """Callables running all of ``SHAPES`` once, and the weight bytes each one streams."""
    torch.manual_seed(0)
    w32 = [torch.randn(s) * 0.02 for s in SHAPES]
    w16 = [w.bfloat16() for w in w32]
    x32 = {k: torch.randn(rows, k) for k in {s[1] for s in SHAPES}}
    x16 = {k: v.bfloat16() for k, v in x32.items()}
    fns = {
        "f32_linear": lambda: [F.linear(x32[w.shape[1]], w) for w in w32],
        "bf16_linear": lambda: [F.linear(x16[w.shape[1]], w) for w in w16],
    }
    if rows == 1:
        fns["f32_mv"] = lambda: [torch.mv(w, x32[w.shape[1]][0]) for w in w32]
        fns["bf16_mv"] = lambda: [torch.mv(w, x16[w.shape[1]][0]) for w in w16]
    for name, weights, xs in (("bf16_packed", w16, x16), ("f32_packed", w32, x32)):
        packed = [pack_weight(w) for w in weights]
        if all(p is not None for p in packed):
            pairs = list(zip(packed, SHAPES, strict=True))
            fns[name] = lambda pairs=pairs, xs=xs: [packed_linear(xs[s[1]], p, None) for p, s in pairs]
    if cpu_kernels.enabled():
        fns["f32_compiled"] = lambda: [cpu_kernels.linear(x32[w.shape[1]], w) for w in w32]
        fns["bf16_compiled"] = lambda: [cpu_kernels.linear(x16[w.shape[1]], w) for w in w16]
    try:
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in w32]
        fns["f32_mkl_packed"] = lambda: [
            torch.ops.mkl._mkl_linear(x32[w.shape[1]], p, w, None, rows)
            for p, w in zip(mkl, w32, strict=True)
        ]
    except (AttributeError, RuntimeError):
        pass
    n = sum(w.numel() for w in w32)
    return fns, {k: n * (2 if k.startswith("bf16") else 4) for k in fns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1, help="M, rows per product (decoding sequences)")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default="results/bench_gemv.json")
    args = parser.parse_args()
    if min(args.rows, args.reps, args.threads) < 1:
        parser.error("--rows, --reps and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    fns, nbytes = forms(args.rows)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(args.reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    summary = {
        k: {"min_ms": min(v), "median_ms": statistics.median(v), "gb_s_at_min": nbytes[k] / min(v) / 1e6}
        for k, v in times.items()
    }
    result = {"rows": args.rows, "threads": args.threads, "loadavg": os.getloadavg()[0], "forms": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    base = summary["bf16_linear"]["min_ms"]
    print(
        f"gemv M={args.rows} threads={args.threads}: "
        + ", ".join(f"{k} {v['min_ms']:.1f} ms ({base / v['min_ms']:.2f}x)" for k, v in summary.items())
        + " (x: speed vs bf16_linear)"
        + f"; load {result['loadavg']:.1f} -> {args.out}"
    )


if __name__ == "__main__":
    main()
