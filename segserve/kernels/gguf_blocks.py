"""GGUF block-quantized weights as segserve keeps them: :class:`QuantWeight`, and a plain PyTorch
dequantizer (the fallback where the compiled kernels are off, and the engines' path for large steps
without them).

Formats (ggml's ``ggml-common.h``; 32 values per block, a row's blocks contiguous, rows contiguous):

======  ==============================  ================================  =====
type    block                           value ``i`` (``i < 32``)          bytes
======  ==============================  ================================  =====
Q8_0    fp16 ``d``, int8 ``q[32]``      ``d * q[i]``                      34
Q4_0    fp16 ``d``, uint8 ``qs[16]``    ``d * (nib(i) - 8)``              18
Q4_1    fp16 ``d``, fp16 ``m``, ``qs``  ``d * nib(i) + m``                20
======  ==============================  ================================  =====

``nib(i)`` is the low nibble of ``qs[i]`` for ``i < 16`` and the high nibble of ``qs[i - 16]`` above. The
products ``d * q`` are exact in float32 (11 + 8 significand bits), so these dequantizers give
``gguf.quants.dequantize``'s values bit for bit (tests/kernels/test_quant.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_VALUES = 32
# GGUF type name -> (ggml type id, bytes per block). The id is what the C code switches on.
FORMATS = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of ``k`` values in ``qtype`` (``k`` a positive multiple of 32).

    Raises:
        ValueError: on another type or a ``k`` that is not a positive multiple of 32.
    """
    if qtype not in FORMATS:
        raise ValueError(f"quantized type {qtype!r} is not one of {sorted(FORMATS)}")
    if k < BLOCK_VALUES or k % BLOCK_VALUES:
        raise ValueError(f"a {qtype} row holds whole blocks of 32 values; got {k} values")
    return k // BLOCK_VALUES * FORMATS[qtype][1]


@dataclass(frozen=True)
class QuantWeight:
    """A ``(N, K)`` weight in a GGUF block format, as stored in the file (no float copy).

    Attributes:
        data: ``(N, K / 32 * block_bytes)`` uint8, contiguous CPU tensor.
        qtype: ``"Q8_0"``, ``"Q4_0"`` or ``"Q4_1"``.
        in_features: K.

    Raises:
        ValueError: on another type, a K the format cannot hold, or ``data`` of the wrong dtype,
            device, layout or row size (the message names the value and what was expected).
    """

    data: torch.Tensor
    qtype: str
    in_features: int

    def __post_init__(self) -> None:
        want = row_bytes(self.qtype, self.in_features)
        d = self.data
        on_host = d.device.type in ("cpu", "meta")
        if d.dtype != torch.uint8 or d.dim() != 2 or d.shape[1] != want or not on_host:
            raise ValueError(
                f"{self.qtype} data for {self.in_features} values per row must be (N, {want}) uint8 on the "
                f"CPU, got {tuple(d.shape)} {d.dtype} on {d.device}"
            )
        if d.device.type == "cpu" and not d.is_contiguous():
            raise ValueError("quantized weight data must be contiguous")

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)``: the dequantized weight's shape."""
        return (self.data.shape[0], self.in_features)

    @property
    def wqt(self) -> int:
        """ggml's type id of the format (what the C kernels take)."""
        return FORMATS[self.qtype][0]

    @property
    def nbytes(self) -> int:
        """Bytes of the block data."""
        return self.data.numel()


def dequantize_torch(w: QuantWeight, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """``(n, K)`` values of ``w`` (all rows, or the int64 ``rows``) in ``dtype``, in plain PyTorch ops:
    exact in float32 (see the module docstring), then rounded to ``dtype``."""
    data = w.data if rows is None else w.data[rows]
    n, nb = data.shape[0], w.in_features // BLOCK_VALUES
    blocks = data.reshape(n, nb, FORMATS[w.qtype][1])
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # (n, nb, 1)
    if w.qtype == "Q8_0":
        vals = d * blocks[..., 2:].contiguous().view(torch.int8).float()
    else:
        qs = blocks[..., 4:] if w.qtype == "Q4_1" else blocks[..., 2:]
        nib = torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()  # (n, nb, 32)
        if w.qtype == "Q4_0":
            vals = d * (nib - 8)
        else:
            vals = torch.addcmul(blocks[..., 2:4].contiguous().view(torch.float16).float(), d, nib)
    return vals.reshape(n, w.in_features).to(dtype)
