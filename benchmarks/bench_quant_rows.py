"""Where the GGUF block-weight linear should leave its register-dequantizing kernel for
dequantize-then-GEMM (``segserve.models.quant_linear.SMALL_ROWS``): both paths timed on one Q4_1
weight of SmolLM2's gate/up shape (3072 x 576) for M = 8 .. 128 rows, float32 and bfloat16, in one
process. Prints one line per dtype (the crossover) and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from segserve.kernels import quant
from segserve.kernels.gguf_blocks import QuantWeight
from segserve.models import quant_linear as ql

ROWS = (8, 12, 16, 24, 32, 64, 96, 128)


def _ms(f, reps: int) -> float:
    f()
    start = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("results/bench_quant_rows.json"))
    args = p.parse_args()
    if not quant.enabled():
        raise SystemExit(f"the quant kernels are off here: {quant.unavailable_reason()}")
    n, k = 3072, 576
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    qw = QuantWeight(torch.from_numpy(q.view(np.uint8).reshape(n, -1)).clone(), "Q4_1", k)
    record = {"load_before": os.getloadavg()[0], "rows": ROWS, "threads": torch.get_num_threads()}
    for dtype in (torch.float32, torch.bfloat16):
        kernel, gemm = [], []
        for m in ROWS:
            x = torch.randn(m, k).to(dtype)
            kernel.append(_ms(lambda x=x: quant.linear(x, qw, None), args.reps))
            old, ql.SMALL_ROWS = ql.SMALL_ROWS, {}
            try:
                gemm.append(_ms(lambda x=x: ql.quantized_matmul(x, qw), args.reps))
            finally:
                ql.SMALL_ROWS = old
        cross = next((m for m, a, b in zip(ROWS, kernel, gemm, strict=True) if b < a), None)
        record[str(dtype)] = {"kernel_ms": kernel, "dequant_gemm_ms": gemm,
                              "first_row_count_gemm_wins": cross}
        print(f"bench_quant_rows {dtype}: dequantize+GEMM wins from {cross} rows "
              f"(kernel / GEMM ms at {ROWS[2]} rows: {kernel[2]:.2f} / {gemm[2]:.2f}); "
              f"SMALL_ROWS = {ql.SMALL_ROWS.get(dtype)}")
    record["load_after"] = os.getloadavg()[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
