"""PyTorch-facing wrapper of the AVX-512 BF16 GEMM (``csrc/segserve_bf16gemm.c``): vdpbf16ps register
tiles for bfloat16 prefill projections on CPUs without AMX (Zen 4 above all).

It reads the weight in ``amx.pack``'s layout (one zmm row = 16 output columns x one k pair), so one
packed copy serves this kernel and the AMX one: :func:`pack` and :func:`supports` are ``amx.pack`` and
``amx.supports``. :func:`linear` takes ``amx.linear``'s arguments (bias, residual, ``silu_mul`` on a
fused ``[gate; up]`` weight, bfloat16 or float32 output) and rounds where it rounds. Whether to use it
is the caller's choice (``segserve.worker.cpu_step``: where AMX is absent).

Switch: ``SEGSERVE_BF16GEMM=0`` turns it off for the process; :func:`set_enabled` / :func:`disabled` at
run time (benchmarks alternate with it in one process). It is also off whenever the compiled kernels
are (the library is built only on CPUs with AVX-512 BF16).
"""

from __future__ import annotations

import ctypes

import torch

from segserve.kernels import amx
from segserve.kernels import cpu as cpu_kernels
from segserve.kernels.switch import Switch

_P = ctypes.c_void_p
_I = ctypes.c_int32
_L = ctypes.c_int64

_ERRORS = {-1: "unsupported shape",
           -5: "argument struct of another size (the library and bf16gemm.py disagree on its layout)"}
# Flops of one round of sg_bf16gemm_peak's loop: 24 vdpbf16ps of 16 lanes x 2 multiply-adds.
PEAK_FLOPS_PER_ITER = 24 * 16 * 2 * 2

_switch = Switch("SEGSERVE_BF16GEMM")

pack = amx.pack
supports = amx.supports


@cpu_kernels._sized
class _GemmArgs(ctypes.Structure):
    """``sg_bf16gemm_args``: the GEMM fields of ``sg_amx_linear_args``, in the same order
    (``amx.GEMM_FIELDS``; the AMX one adds its RoPE epilogue's)."""

    _fields_ = amx.GEMM_FIELDS


@cpu_kernels._sized
class _PeakArgs(ctypes.Structure):
    """``sg_bf16gemm_peak_args``."""

    _fields_ = [("size", _L), ("iters", _L), ("threads", _I)]


_ARGS = {"sg_bf16gemm": _GemmArgs, "sg_bf16gemm_peak": _PeakArgs}


def _library():
    """The compiled library with this kernel's entry points typed, or None."""
    return cpu_kernels.typed(cpu_kernels._library(), _ARGS)


def available() -> bool:
    """True when this GEMM is switched on and the compiled kernels are on and built."""
    return _switch.on and cpu_kernels.enabled()


def set_enabled(flag: bool) -> bool:
    """Switch this GEMM on or off for this process; returns the previous setting."""
    return _switch.set(flag)


def disabled():
    """``with disabled():`` leaves the projections to oneDNN (the other compiled kernels stay on)."""
    return _switch.off()


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True)."""
    if not _switch.on:
        return _switch.off_reason()
    return None if cpu_kernels.enabled() else f"compiled kernels off: {cpu_kernels.unavailable_reason()}"


def _check(rc: int, name: str) -> None:
    if rc:
        raise RuntimeError(f"{name} failed: {_ERRORS.get(rc, rc)}")


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    k: int,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    silu_mul: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` in vdpbf16ps register tiles for the ``(n, k)`` weight ``W`` that :func:`pack`
    packed; float32 accumulation (k ascending), rounded as ``amx.linear`` rounds.

    Args:
        x: ``(M, k)`` bfloat16, M >= 1, rows contiguous (a row stride >= k is fine).
        packed: :func:`pack`'s ``(n/16, k/32, 16, 32)`` result for ``W``. bias: ``(n,)`` bfloat16 or None.
        residual: ``(M, n)`` contiguous bfloat16, updated in place as ``residual += result`` (the
            product rounded first, like ``h.add_(linear(x))``) and returned.
        silu_mul: ``W`` is a fused ``[gate; up]`` (n = 2 I, I a multiple of 16): returns
            ``silu(gate) * up`` ``(M, I)``, rounded where ``F.silu(gate).mul_(up)`` rounds.
        out_dtype: bfloat16 or float32 for a plain output (the epilogues give bfloat16).

    Returns:
        ``residual`` when given, else a new ``(M, n)`` (``(M, n/2)`` for ``silu_mul``) tensor.

    Raises:
        ValueError: on a dtype, device, shape or stride the kernel does not take (named with the limit).
        RuntimeError: when the compiled kernels are unavailable (check :func:`available` first).
    """
    y, epilogue = amx.linear_output(x, packed, n, k, bias, residual, silu_mul, out_dtype)
    lib = _library()
    if lib is None:
        raise RuntimeError(f"bf16 GEMM unavailable: {cpu_kernels.unavailable_reason()}")
    rc = lib.sg_bf16gemm(_GemmArgs(  # positional: ctypes builds a struct from keywords ~2x slower
        _GemmArgs.SIZE, x.shape[0], n, k, x.data_ptr(), x.stride(0), packed.data_ptr(),
        None if bias is None else bias.data_ptr(), y.data_ptr(), y.stride(0),
        0 if y.dtype == torch.float32 else 1, epilogue,
    ))
    _check(rc, "sg_bf16gemm")
    return y


def peak(iters: int, threads: int) -> None:
    """Run the register-only microkernel: ``threads`` x ``iters`` x 24 vdpbf16ps (zmm),
    ``threads * iters * PEAK_FLOPS_PER_ITER`` flops; the caller times it.

    Raises:
        ValueError: ``iters`` or ``threads`` below 1. RuntimeError: the compiled kernels are unavailable.
    """
    if iters < 1 or threads < 1:
        raise ValueError(f"iters and threads must be >= 1, got {iters}, {threads}")
    lib = _library()
    if lib is None:
        raise RuntimeError(f"bf16 GEMM unavailable: {cpu_kernels.unavailable_reason()}")
    _check(lib.sg_bf16gemm_peak(_PeakArgs(size=_PeakArgs.SIZE, iters=iters, threads=threads)),
           "sg_bf16gemm_peak")
