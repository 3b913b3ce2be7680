"""Linear layers with an optional oneDNN pre-packed bfloat16 weight (CPU).

``F.linear`` with a bfloat16 weight on CPU goes through oneDNN, which reorders the plain row-major
weight into its blocked layout on every call. For a decode step (M = 1..16 rows) that reorder is
about as expensive as the product itself: measured here for a 3,072 x 576 weight at M = 1, 0.15 ms
with ``F.linear`` against 0.07 ms with the weight reordered once (``benchmarks/bench_decode.py``,
docs/perf.md). Packing once at load time is what PyTorch's inductor does for frozen CPU graphs
(``torch.ops.mkldnn._reorder_linear_weight`` + ``_linear_pointwise``); the results are bitwise the
same as ``F.linear`` (same oneDNN kernel, same accumulation order), checked in tests/unit.

Float32 weights are left alone: MKL's packed sgemm was only faster at the packed row count and
changes the summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def packing_available() -> bool:
    """True when this torch build has oneDNN (mkldnn) and its packed linear ops."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._reorder_linear_weight and torch.ops.mkldnn._linear_pointwise)
    except (AttributeError, RuntimeError):
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN-blocked copy of a ``(out, in)`` bfloat16 CPU weight; None when it cannot be packed
    (other dtype or device, or no oneDNN). The copy is opaque (``torch._mkldnn`` layout)."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or not packing_available():
        return None
    # The batch-size hint only steers oneDNN's layout choice; any row count works with the result.
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + b`` for ``x`` ``(M, in)`` bfloat16 with ``W`` from :func:`pack_weight` -> ``(M, out)``."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class PackedLinear(nn.Linear):
    """``nn.Linear`` (same parameters and state-dict names) that uses a packed copy of its weight
    once :meth:`pack` made one. The plain ``weight`` stays the source of truth: call :meth:`pack`
    again after changing it (a stale copy would silently compute with the old values)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kwargs) -> None:
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        self._packed: torch.Tensor | None = None

    @property
    def is_packed(self) -> bool:
        return self._packed is not None

    def pack(self) -> bool:
        """Make (or refresh) the packed copy; returns whether there is one (bfloat16 CPU weights)."""
        self._packed = pack_weight(self.weight)
        return self._packed is not None

    def unpack(self) -> None:
        """Drop the packed copy (back to ``F.linear``)."""
        self._packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None and x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16:
            return packed_linear(x, self._packed, self.bias)
        return F.linear(x, self.weight, self.bias)
