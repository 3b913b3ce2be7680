"""PyTorch-facing wrapper of the float32 GEMM with GGUF block weights (``csrc/segserve_f32gemm.c``).

:func:`matmul` is ``x @ dequantize(w).T + bias`` for float32 ``x`` of many rows (prefill chunks, big
batches): the weight is dequantized straight into the GEMM's packed panels, a block at a time, so no
float32 copy of it is made. ``segserve.models.quant_linear.quantized_matmul`` calls it above
``SMALL_ROWS`` rows when :func:`enabled`.

Switch: ``SEGSERVE_F32GEMM=0`` turns it off for the process (large float32 steps then dequantize tiles
and call ``F.linear``); :func:`set_enabled` / :func:`disabled` at run time. It is also off whenever the
GGUF block kernels are (``quant.enabled``).
"""

from __future__ import annotations

import ctypes

import torch

from segserve.kernels import cpu as cpu_kernels
from segserve.kernels import quant
from segserve.kernels.gguf_blocks import QuantWeight
from segserve.kernels.switch import Switch

_P = ctypes.c_void_p
_I = ctypes.c_int32
_L = ctypes.c_int64

_switch = Switch("SEGSERVE_F32GEMM")
_ERRORS = {-1: "unsupported shape or format", -2: "out of memory for the packing buffer",
           -5: "argument struct of another size (the library and f32gemm.py disagree on its layout)"}


@cpu_kernels._sized
class _GemmArgs(ctypes.Structure):
    """``sg_f32gemm_args`` (its fields are documented in the C source)."""

    _fields_ = [
        ("size", _L), ("wqt", _I), ("pad", _I), ("M", _L), ("N", _L), ("K", _L), ("x", _P), ("ldx", _L),
        ("w", _P), ("bias", _P), ("y", _P), ("ldy", _L),
    ]


_ARGS = {"sg_f32gemm": _GemmArgs}


def _library():
    return cpu_kernels.typed(quant._library(), _ARGS)


def enabled() -> bool:
    """True when this GEMM is switched on and the GGUF block kernels are on and built."""
    return _switch.on and quant.enabled() and _library() is not None


def set_enabled(flag: bool) -> bool:
    """Switch this GEMM on or off for this process; returns the previous setting."""
    return _switch.set(flag)


def disabled():
    """``with disabled():`` runs large float32 steps through dequantized tiles and ``F.linear``."""
    return _switch.off()


def unavailable_reason() -> str | None:
    """Why :func:`enabled` is False: this switch, or the block kernels' reason (None when on)."""
    if not _switch.on:
        return _switch.off_reason()
    return quant.unavailable_reason()


def matmul(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(weight).T + bias`` in float32.

    Args:
        x: ``(M, K)`` float32 CPU tensor, rows contiguous and apart (row stride >= K).
        weight: ``(N, K)`` Q4_0 / Q4_1 / Q8_0 blocks.
        bias: ``(N,)`` contiguous float32, or None.
        out: ``(M, N)`` float32 tensor to write into, rows contiguous and apart (row stride >= N), not
            overlapping x; or None.

    Numerics: float32 products of x with the exact dequantized weights, summed in float32 in k order
    within blocks of at most 768 values (the blocks' sums then added in order): equal to
    ``x @ dequantize(weight).T`` up to float32 summation order.

    Returns:
        ``(M, N)`` float32: ``out`` when given, else a new tensor.

    Raises:
        ValueError: on a dtype, device, shape or stride the kernel does not take (named with the limit).
        RuntimeError: when the compiled kernels are unavailable or the kernel reports an error.
    """
    if not isinstance(weight, QuantWeight) or weight.data.device.type != "cpu":
        raise ValueError(f"weight must be a QuantWeight on the CPU, got {type(weight).__name__}")
    n, k = weight.shape
    cpu_kernels._on_cpu(x=x, bias=bias, out=out)
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or (
            x.shape[0] > 1 and x.stride(0) < k):
        raise ValueError(f"x must be (M, {k}) float32 with contiguous rows, got {tuple(x.shape)} {x.dtype} "
                         f"strides {x.stride()}")
    m = x.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous ({n},) float32 tensor, got {tuple(bias.shape)} "
                         f"{bias.dtype}")
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    elif out.shape != (m, n) or out.dtype != torch.float32 or out.stride(1) != 1 or (
            m > 1 and out.stride(0) < n):
        raise ValueError(f"out must be ({m}, {n}) float32 with contiguous rows, got {tuple(out.shape)} "
                         f"{out.dtype}")
    elif cpu_kernels._overlap(out, x):
        raise ValueError("out must not overlap x")
    if m == 0:
        return out
    lib = _library()
    if lib is None:
        raise RuntimeError(f"compiled kernels unavailable: {cpu_kernels.unavailable_reason()}")
    rc = lib.sg_f32gemm(_GemmArgs(
        size=_GemmArgs.SIZE, wqt=weight.wqt, M=m, N=n, K=k, x=x.data_ptr(), ldx=max(x.stride(0), k),
        w=weight.data.data_ptr(), bias=None if bias is None else bias.data_ptr(), y=out.data_ptr(),
        ldy=max(out.stride(0), n),
    ))
    if rc:
        raise RuntimeError(f"sg_f32gemm failed: {_ERRORS.get(rc, rc)}")
    return out
