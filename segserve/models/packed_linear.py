"""Linear layers with an optional oneDNN pre-packed weight (CPU, float32 or bfloat16).

``F.linear`` on CPU sends float32 to MKL's sgemm/sgemv and bfloat16 to oneDNN, which reorders the
plain row-major bfloat16 weight into its blocked layout on every call. Packing the weight once into
oneDNN's layout at load time (what PyTorch's inductor does for frozen CPU graphs with
``torch.ops.mkldnn._reorder_linear_weight`` + ``_linear_pointwise``) pays off for both dtypes,
most of all at the small row counts of decode steps. ``benchmarks/bench_gemv.py --rows M`` over all
121 weights of SmolLM2-135M (streamed from memory, 2 threads, idle machine), ms per pass:

=========  =============  ===========  ===========
rows (M)   F.linear fp32  packed fp32  packed bf16
=========  =============  ===========  ===========
1          44.1           25.3         14.0
2          75.9           31.1         13.7
8          65.3           39.5         13.6
512        832            686          326
=========  =============  ===========  ===========

MKL's sgemm is a poor fit below ~16 rows (M = 2 costs twice M = 1); oneDNN's packed kernel streams
the weight once for all rows. bfloat16 results are bitwise those of ``F.linear`` (the same oneDNN
kernel); float32 results differ from MKL's only in summation order (~1e-6 relative), checked in
tests/unit/test_packed_linear.py and by the float32 parity suite against ``transformers``.

On a CPU with AMX (Intel Sapphire Rapids and later) ``CpuStep.prepack`` packs the bfloat16 projections
for the AMX GEMM (``segserve.kernels.amx``) *instead of* for oneDNN: ``CpuStep`` runs every bfloat16 step
of 9 rows or more on it (``forward_chunk``) and up to 8 rows the compiled small-batch linears read the
plain weight, so a oneDNN copy would never be read and one packed copy does (~212 MB for SmolLM2-135M's
projections; the LM head keeps its oneDNN copy). That holds because the AMX GEMM is as fast as oneDNN's
packed one or faster from 9 rows up (equal within noise on gate/up from 256 rows):
``benchmarks/bench_amx_gemm.py`` (results/bench_amx_gemm.json), median GFLOP/s of 30 alternating trials,
2 threads, shared machine (load ~4), per shape qkv / o / gate_up / down:

=====  =====================  =====================  =====================
rows   AMX                    oneDNN packed          F.linear
=====  =====================  =====================  =====================
9      (a) / (a) / 118 / 162  (a) / (a) / 68 / 73    (a) / (a) / 66 / 75
16     277 / 260 / 198 / 264  106 / 89 / 122 / 115   104 / 85 / 130 / 112
64     345 / 376 / 296 / 329  269 / 259 / 234 / 287  231 / 210 / 225 / 235
256    403 / 416 / 397 / 464  349 / 337 / 404 / 344  360 / 347 / 363 / 310
512    466 / 505 / 435 / 528  428 / 488 / 442 / 436  475 / 533 / 366 / 504
2048   472 / 162 / 181 / 172  484 / 172 / 181 / 148  558 / 174 / 236 / 201
=====  =====================  =====================  =====================

(a) qkv and o at 9 rows: every form's median fell to ~1 GFLOP/s in that run (descheduled trials); the
best trials were AMX 116 / 119, oneDNN 54 / 63. At 8 rows and below the compiled small-batch linear
(53-67 GFLOP/s here) stays: the fused decode step saves more than its GEMMs lose. On one thread AMX
leads oneDNN by 1.4-2.9x at 9 and 16 rows too. From 2,048 rows ``F.linear`` (oneDNN's own blocking of
the plain weight) overtakes both packed forms on some shapes; the engine's default budget (512) keeps
steps below that.
End to end (one 4,096-token bfloat16 prefill at budget 512, AMX on and off alternating in one process,
``bench_amx_gemm.py --prefill``) the difference stayed inside this shared machine's noise: medians 0.88-1.19x
over five 3-5-pair runs at 1 and 2 threads, best runs 1.0-1.3x in AMX's favour (the projections are
~27 % of such a step, attention most of the rest).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def packing_available() -> bool:
    """True when this torch build has oneDNN (mkldnn) and its packed linear ops."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._reorder_linear_weight and torch.ops.mkldnn._linear_pointwise)
    except (AttributeError, RuntimeError):
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN-blocked copy of a ``(out, in)`` float32 or bfloat16 CPU weight; None when it cannot be
    packed (other dtype or device, or no oneDNN). The copy is opaque (``torch._mkldnn`` layout)."""
    if weight.dtype not in PACKABLE_DTYPES or weight.device.type != "cpu" or not packing_available():
        return None
    # The batch-size hint only steers oneDNN's layout choice; any row count works with the result.
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + b`` for ``x`` ``(M, in)`` in the weight's dtype, ``W`` from :func:`pack_weight`
    -> ``(M, out)``."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class PackedLinear(nn.Linear):
    """``nn.Linear`` (same parameters and state-dict names) that uses a packed copy of its weight
    once :meth:`pack` made one (the model runner packs them all, ``segserve.worker.cpu_step``, except
    bfloat16 projections where AMX runs them: see the module docstring). The
    plain ``weight`` stays the source of truth: call :meth:`pack` again after changing it (a stale copy
    would silently compute with the old values)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kwargs) -> None:
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        self._packed: torch.Tensor | None = None

    @property
    def is_packed(self) -> bool:
        return self._packed is not None

    @property
    def packed_weight(self) -> torch.Tensor | None:
        """The packed copy :meth:`pack` made (opaque oneDNN layout), or None."""
        return self._packed

    def pack(self) -> bool:
        """Make (or refresh) the packed copy; returns whether there is one (float32 or bfloat16 CPU
        weights with oneDNN available)."""
        self._packed = pack_weight(self.weight)
        return self._packed is not None

    def unpack(self) -> None:
        """Drop the packed copy (back to ``F.linear``)."""
        self._packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The dtype check also keeps a copy packed before ``model.to(dtype)`` from being used.
        if self._packed is not None and x.dtype == self.weight.dtype == self._packed.dtype:
            return packed_linear(x, self._packed, self.bias)
        return F.linear(x, self.weight, self.bias)
