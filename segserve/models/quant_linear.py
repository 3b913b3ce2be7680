"""Linear and embedding layers whose weight stays in a GGUF block format (Q8_0, Q4_0, Q4_1).

The loader (``segserve.models.loader``) puts these in place of ``PackedLinear`` / ``nn.Embedding`` for
tensors stored in those formats, so no float copy of the weight is kept (SmolLM2-135M Q4_1: ~95 MB of
blocks instead of 540 MB of float32). Each holds its blocks as a uint8 buffer ``qweight`` ``(N, K / 32 *
block_bytes)`` (so ``state_dict`` and ``load_state_dict(assign=True)`` carry them) and computes:

- a few rows (at most ``SMALL_ROWS[dtype]``): the compiled kernel, which dequantizes in registers
  (``segserve.kernels.quant.linear``); ``segserve.worker.cpu_step`` calls it directly with the fused
  prologues and epilogues;
- more rows in float32: the compiled GEMM that dequantizes the blocks straight into its packed panels
  (``segserve.kernels.f32gemm``; ``SEGSERVE_F32GEMM=0`` turns it off);
- more rows otherwise (bfloat16, or that GEMM off): the weight dequantized into a transient buffer in the
  activation dtype, ``TILE_BYTES`` at most at a time, then PyTorch's GEMM on it (the dequantization reads
  the weight once per step; the GEMM reads the tile from cache M times);
- without the compiled kernels: the same with ``gguf_blocks.dequantize_torch``.

Numerics: the dequantized weights are exact in float32, so in float32 these layers equal the
dequantize-at-load model (``--quantization none``) within summation order; in bfloat16 the large-step
path rounds the weight to bfloat16 exactly as that model's load does, while the few-row kernel keeps the
exact weights and multiplies in float32 (closer to the float32 product than the dequantized bfloat16
model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from segserve.kernels import f32gemm, quant
from segserve.kernels.gguf_blocks import QuantWeight, dequantize_torch, row_bytes

# Rows up to which the register-dequantizing kernel runs (it dequantizes each weight tile once per 8
# rows); above, dequantize-then-GEMM. Measured on a Q4_1 (3072, 576) weight, 2 threads, load 0.4 (AMX
# Xeon, benchmarks/bench_quant_rows.py): float32 kernel vs dequantize+GEMM 0.60 vs 1.70 ms at 16
# rows, 2.28 vs 2.69 at 64, 4.50 vs 3.76 at 128; bfloat16 0.52 vs 0.59 at 12, 0.64 vs 0.59 at 16
# (oneDNN's bf16 GEMM runs on AMX there).
SMALL_ROWS = {torch.float32: 64, torch.bfloat16: 12}
# Most bytes of dequantized weight one large-step call holds at once (the LM head of a 49k vocabulary
# would be 113 MB in float32).
TILE_BYTES = 8 << 20


def _dequantize(
    w: QuantWeight, dtype: torch.dtype, start: int = 0, count: int | None = None
) -> torch.Tensor:
    if quant.enabled():
        return quant.dequantize(w, dtype, start=start, count=count)
    count = w.shape[0] - start if count is None else count
    return dequantize_torch(w, dtype, torch.arange(start, start + count))


def dequantize_weight(w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """The whole ``(N, K)`` weight of ``w`` in ``dtype``, as the large-step path dequantizes it (exact in
    float32, rounded to bfloat16 as the dequantize-at-load model rounds it)."""
    return _dequantize(w, dtype)


def row_kernel_takes(m: int, dtype: torch.dtype) -> bool:
    """Whether :func:`quantized_matmul` runs ``m`` CPU rows of ``dtype`` on the register-dequantizing
    kernel (``quant.linear``): up to ``SMALL_ROWS`` rows, with the block kernels on."""
    return m <= SMALL_ROWS.get(dtype, 8) and quant.enabled()


def quantized_matmul(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None, path_rows: int | None = None) -> torch.Tensor:
    """``x @ dequantize(w).T + bias`` for ``x`` ``(M, K)`` float32/bfloat16 -> ``(M, N)`` in ``out_dtype``
    (default x's); the path by row count as the module docstring says: ``path_rows`` rows (default M),
    so that some rows of a larger product get the bits that product gives them (row results do not
    depend on the other rows within one path)."""
    m, (n, k) = x.shape[0], w.shape
    rows = m if path_rows is None else path_rows
    if row_kernel_takes(rows, x.dtype) and x.device.type == "cpu":
        int8 = None if rows == m else bool(quant.int8_formats(rows) >> w.wqt & 1)
        return quant.linear(x.contiguous(), w, bias, out_dtype=out_dtype, int8=int8)
    if x.dtype == torch.float32 and out_dtype in (None, torch.float32) and f32gemm.enabled():
        return f32gemm.matmul(x.contiguous(), w, bias)  # weight packed from its blocks, no float copy
    out = torch.empty(m, n, dtype=out_dtype or x.dtype)
    step = max(1, TILE_BYTES // (k * x.element_size()))
    for n0 in range(0, n, step):
        cnt = min(step, n - n0)
        tile = _dequantize(w, x.dtype, n0, cnt)  # (cnt, K)
        b = None if bias is None else bias[n0 : n0 + cnt]
        out[:, n0 : n0 + cnt] = F.linear(x, tile, b)
    return out


class QuantLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` ``(out_features, in_features)`` in a GGUF block format.

    Args:
        in_features, out_features: K and N (K a multiple of 32).
        qtype: ``"Q8_0"``, ``"Q4_0"`` or ``"Q4_1"``.
        bias: whether there is a float bias (in the activation dtype).
        device: where the (empty) buffers go; the loader builds on ``"meta"`` and assigns.
    """

    def __init__(self, in_features: int, out_features: int, qtype: str, bias: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features, self.qtype = in_features, out_features, qtype
        width = row_bytes(qtype, in_features)
        self.register_buffer("qweight", torch.empty(out_features, width, dtype=torch.uint8, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    @property
    def quant_weight(self) -> QuantWeight:
        """The blocks as the kernels take them."""
        return QuantWeight(self.qweight, self.qtype, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_matmul(x, self.quant_weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}"


class QuantEmbedding(nn.Module):
    """Token embedding ``(num_embeddings, embedding_dim)`` in a GGUF block format; a lookup dequantizes
    only the rows asked for, into ``dtype`` (the model's activation dtype). When the checkpoint ties
    the LM head to it, :meth:`logits` is the head.

    Raises (forward):
        ValueError: on a token id outside ``[0, num_embeddings)``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, qtype: str, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.qtype = num_embeddings, embedding_dim, qtype
        self.dtype = dtype
        width = row_bytes(qtype, embedding_dim)
        self.register_buffer("qweight", torch.empty(num_embeddings, width, dtype=torch.uint8, device=device))

    @property
    def quant_weight(self) -> QuantWeight:
        """The blocks as the kernels take them."""
        return QuantWeight(self.qweight, self.qtype, self.embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1).long()
        if quant.enabled():  # the kernel checks every id before it writes (two reductions less a step)
            rows = quant.dequantize(self.quant_weight, self.dtype, ids, id_name="token id")
        else:
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
                raise ValueError(f"a token id is outside [0, {self.num_embeddings})")
            rows = dequantize_torch(self.quant_weight, self.dtype, ids)
        return rows.reshape(*input_ids.shape, self.embedding_dim)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(N, H)`` -> ``(N, vocab)`` float32 logits against the embedding matrix (a tied LM head)."""
        return quantized_matmul(hidden, self.quant_weight, out_dtype=torch.float32)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype}"
