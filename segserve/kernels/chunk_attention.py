"""Chunk (prefill) attention through the paged KV cache in one compiled call (``csrc/segserve_chunk_attn.c``).

Every chunk of a step (a request computing ``query_len >= 1`` tokens after ``prior`` cached ones) attends
to its prior tokens and causally to its own, whose K/V are already in the cache (the backend writes them
first), read in place through the block table in ``kv_segment_size`` segments with an online softmax:
no gathered copy of the cache, no per-segment dispatch, no log-sum-exp merge in Python. With a bfloat16
cache Q K^T and P V run on AMX tiles (CPUs with AMX-TILE and AMX-BF16) or, on CPUs without AMX, in
AVX-512 BF16 registers (``vdpbf16ps``; every CPU the compiled library loads on has it: ``build.py``'s
``REQUIRED_CPU_FLAGS``) over the same packed K/V blocks and the same softmax. With a float32 cache the
same walk and softmax run with float32 P and the products as AVX-512F FMAs. :func:`kind` says which
form runs for a dtype; with the kernel off :func:`supports` is False and the caller keeps its SDPA path.

Numerics, bfloat16: P is rounded to bfloat16 for the P V product (as PyTorch's CPU flash attention does
for bfloat16); everything else accumulates in float32. Against a float32 oracle on the same bfloat16
inputs the error is that of bfloat16 rounding (see tests/kernels/test_chunk_attention.py).
float32: nothing is rounded below float32 (each product an FMA, P float32, an exp to ~1 ulp); against
float32 SDPA the max error is ~1e-6 on unit-normal inputs (tests/kernels/test_chunk_attention_f32.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from segserve.kernels import amx
from segserve.kernels import cpu as cpu_kernels
from segserve.kernels.switch import Switch

# The C code's limits (CA_MAX_D, CA_MAX_G in csrc/segserve_chunk_attn.c): head dims are multiples of
# HEAD_DIM_MULTIPLE[dtype] up to MAX_HEAD_DIM.
MAX_HEAD_DIM = 128
MAX_QUERY_HEADS_PER_KV_HEAD = 16
HEAD_DIM_MULTIPLE = {torch.bfloat16: 32, torch.float32: 16}
# sg_chunk_attention_args.dt of each dtype (CA_DT_* in the C source).
_DT = {torch.bfloat16: 1, torch.float32: 2}

_P = ctypes.c_void_p
_I = ctypes.c_int32
_L = ctypes.c_int64
_F = ctypes.c_float


class _ChunkAttentionArgs(ctypes.Structure):
    """``sg_chunk_attention_args`` (its fields are documented in the C source)."""

    _fields_ = [
        ("size", _L), ("dt", _I), ("isa", _I), ("n", _L), ("Hq", _L), ("Hkv", _L), ("D", _L), ("q", _P),
        ("ldq", _L), ("out", _P), ("T", _L), ("starts", _P), ("qlens", _P), ("priors", _P), ("reqs", _P),
        ("cache", _P),
        ("num_blocks", _L), ("block_size", _L), ("block_table", _P), ("B", _L), ("ld_bt", _L), ("seg", _L),
        ("scale", _F),
    ]


_ChunkAttentionArgs.SIZE = ctypes.sizeof(_ChunkAttentionArgs)
_ARGS = {"sg_chunk_attention": _ChunkAttentionArgs}
_ERRORS = {-2: "out of memory", -5: "argument struct of another size (the library and "
           "chunk_attention.py disagree on its layout)", -6: "this CPU or kernel gives no AMX tiles",
           -7: "this CPU lacks the form's AVX-512 instructions (BF16, or F for float32)"}
# sg_chunk_attention_args.isa of each kind (CA_ISA_* in the C source).
_ISA = {"amx": 1, "avx512": 2, "avx512f": 3}

_lib = None
# SEGSERVE_CHUNK_ATTENTION=0 turns this kernel off (the SDPA chunk path runs); set_enabled at run time.
_switch = Switch("SEGSERVE_CHUNK_ATTENTION")
# SEGSERVE_CHUNK_ATTENTION_AVX512=0 turns off the AVX-512 BF16 form alone (CPUs without AMX then keep
# the SDPA chunk path); set_avx512_enabled at run time. It does not affect the AMX form.
_avx512_switch = Switch("SEGSERVE_CHUNK_ATTENTION_AVX512")
# Set by forced_avx512(): the AVX-512 BF16 form runs even where AMX is ready.
_avx512_forced = False


def _library():
    """The compiled library with this module's entry point typed, or None (see ``cpu.enabled``)."""
    global _lib
    if _lib is None:
        lib = cpu_kernels._library()
        if lib is None:
            return None
        fn = lib.sg_chunk_attention
        fn.argtypes, fn.restype = [ctypes.POINTER(_ChunkAttentionArgs)], ctypes.c_int
        _lib = lib
    return _lib


def kind(dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Which form :func:`chunk_attention` runs for a ``dtype`` cache. bfloat16: ``"amx"`` where this CPU
    runs AMX bfloat16 tiles (Linux granted the tile state; ``amx.hardware_ready`` asks, whatever the AMX
    GEMM's own switch says), else ``"avx512"`` (AVX-512 BF16 registers) unless that form is switched off.
    float32: ``"avx512f"`` (AVX-512F FMAs; the AVX-512 BF16 form's switch does not touch it). None when
    this kernel or the compiled kernels are off or unavailable, or for another dtype."""
    if dtype not in _DT or not (_switch.on and cpu_kernels.enabled() and _library() is not None):
        return None
    if dtype == torch.float32:
        return "avx512f"
    if amx.hardware_ready() and not _avx512_forced:
        return "amx"
    return "avx512" if _avx512_switch.on else None


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether :func:`chunk_attention` runs here for a ``dtype`` cache (:func:`kind` is not None)."""
    return kind(dtype) is not None


def set_enabled(flag: bool) -> bool:
    """Switch this kernel (both forms) on or off for the process (benchmarks ablate with it); returns the
    old setting."""
    return _switch.set(flag)


def disabled():
    """``with disabled():`` runs the chunks through the SDPA path (the other compiled kernels stay on)."""
    return _switch.off()


def set_avx512_enabled(flag: bool) -> bool:
    """Switch the AVX-512 BF16 form on or off for the process (the AMX form is unaffected); returns the
    old setting."""
    return _avx512_switch.set(flag)


@contextmanager
def forced_avx512() -> Iterator[None]:
    """``with forced_avx512():`` runs the AVX-512 BF16 form where AMX would run too (so tests check it on
    every CPU the library loads on), then restores the previous choice. Not nestable across threads."""
    global _avx512_forced
    old, _avx512_forced = _avx512_forced, True
    try:
        yield
    finally:
        _avx512_forced = old


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether :func:`chunk_attention` takes these queries ``[T, Hq, D]`` and this cache (never raises):
    the kernel is available for their dtype, both are bfloat16 or both float32 on the CPU, the cache is a
    contiguous ``[2, num_blocks, block_size, Hkv, D]`` with ``D`` up to 128, a multiple of 32 (bfloat16)
    or of 16 (float32), ``Hq`` a multiple of ``Hkv`` up to 16 per KV head, and q's heads are contiguous
    within a row. Anything else (float16, D = 8 or 144, 17 query heads per KV head, ...) is refused and
    the caller keeps its SDPA path."""
    if not (q.dim() == 3 and kv_cache.dim() == 5 and kv_cache.shape[0] == 2):
        return False
    hq, d = q.shape[1:]
    hkv = kv_cache.shape[3]
    mult = HEAD_DIM_MULTIPLE.get(q.dtype, 0)
    return (
        q.dtype == kv_cache.dtype and mult > 0 and q.device.type == kv_cache.device.type == "cpu"
        and kv_cache.is_contiguous() and kv_cache.shape[4] == d and d % mult == 0 and 0 < d <= MAX_HEAD_DIM
        and hkv >= 1 and hq % hkv == 0 and hq // hkv <= MAX_QUERY_HEADS_PER_KV_HEAD
        and q.stride(2) == 1 and q.stride(1) == d and available(q.dtype)
    )


def chunk_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    starts: torch.Tensor,
    query_lens: torch.Tensor,
    priors: torch.Tensor,
    reqs: torch.Tensor,
    kv_segment_size: int,
    scale: float,
) -> None:
    """Chunk attention through the block table, into ``out`` in place.

    Args:
        q: ``[T, Hq, D]`` bfloat16 or float32, RoPE applied, heads contiguous within a row (a view of a
            fused QKV output is fine). out: ``[T, Hq, D]`` contiguous, q's dtype; chunk ``i`` writes rows
            ``starts[i] .. starts[i] + query_lens[i] - 1`` (other rows untouched).
        kv_cache: ``[2, num_blocks, block_size, Hkv, D]`` of q's dtype, holding every chunk's prior
            tokens and its own (written before this call). ``D``: a multiple of 32 (bfloat16) or 16
            (float32) up to 128.
        block_table: ``[B, max_blocks_per_seq]`` int32 contiguous.
        starts, query_lens, priors, reqs: ``(n,)`` int64 contiguous: first row, query tokens (>= 1),
            tokens cached before it, and block-table row of each chunk. Chunk ``i``'s query ``t`` sits
            at position ``priors[i] + t`` and sees the keys at positions ``0 .. priors[i] + t``.
        kv_segment_size: tokens per KV segment the walk repacks and softmaxes at a time (>= 1).
        scale: softmax scale, usually ``D ** -0.5``.

    Raises:
        ValueError: on a dtype, device, layout or shape the kernel does not take, a row or length out
            of range, or a block id outside ``[1, num_blocks)`` (named with the limit; nothing written).
        RuntimeError: when the library refuses the call (out of memory, no AMX or AVX-512 BF16, another
            struct layout).
    """
    if not supports(q, kv_cache):
        raise ValueError(
            f"chunk attention takes bfloat16 or float32 CPU q [T, Hq, D] (heads contiguous) and a contiguous "
            f"cache [2, blocks, block_size, Hkv, D] of q's dtype with D % 32 == 0 (bfloat16) or D % 16 == 0 "
            f"(float32), D <= {MAX_HEAD_DIM}, Hq a multiple of Hkv up to {MAX_QUERY_HEADS_PER_KV_HEAD} per "
            f"KV head, with the kernel available; got q {tuple(q.shape)} {q.dtype} strides {q.stride()}, "
            f"cache {tuple(kv_cache.shape)} {kv_cache.dtype} (available: {available(q.dtype)})"
        )
    _, num_blocks, block_size, hkv, d = kv_cache.shape
    t, hq = q.shape[:2]
    cpu_kernels._on_cpu(out=out, block_table=block_table, starts=starts, query_lens=query_lens,
                        priors=priors, reqs=reqs)
    if out.dtype != q.dtype or out.shape != q.shape or not out.is_contiguous():
        raise ValueError(
            f"out must be contiguous {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}"
        )
    if cpu_kernels._overlap(q, out):
        raise ValueError("out must not overlap q")
    if block_table.dtype != torch.int32 or not block_table.is_contiguous() or block_table.dim() != 2:
        raise ValueError(f"block_table must be a contiguous 2-D int32 tensor, got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    n = starts.shape[0] if starts.dim() == 1 else -1
    for name, x in (("starts", starts), ("query_lens", query_lens), ("priors", priors), ("reqs", reqs)):
        if x.dtype != torch.int64 or x.dim() != 1 or x.shape[0] != n or not x.is_contiguous():
            raise ValueError(f"{name} must be a contiguous ({max(n, 0)},) int64 tensor, got {x.dtype} "
                             f"{tuple(x.shape)}")
    if kv_segment_size < 1:
        raise ValueError(f"kv_segment_size must be >= 1, got {kv_segment_size}")
    if n == 0:
        return
    rc = _library().sg_chunk_attention(_ChunkAttentionArgs(
        size=_ChunkAttentionArgs.SIZE, dt=_DT[q.dtype], isa=_ISA[kind(q.dtype)], n=n, Hq=hq, Hkv=hkv, D=d,
        q=q.data_ptr(), ldq=q.stride(0), out=out.data_ptr(), T=t, starts=starts.data_ptr(),
        qlens=query_lens.data_ptr(), priors=priors.data_ptr(), reqs=reqs.data_ptr(),
        cache=kv_cache.data_ptr(), num_blocks=num_blocks, block_size=block_size,
        block_table=block_table.data_ptr(), B=block_table.shape[0], ld_bt=block_table.shape[1],
        seg=kv_segment_size, scale=scale,
    ))
    if rc == -1:
        raise ValueError(f"a chunk has query_len < 1, prior < 0, or prior + query_len past the block table's "
                         f"{block_table.shape[1] * block_size} tokens")
    if rc == -3:
        raise ValueError(
            f"a chunk's rows run outside [0, {t}) or its table row outside [0, {block_table.shape[0]})"
        )
    if rc == -4:
        raise ValueError(f"a chunk walks a block id outside [1, {num_blocks}) (0 is the null block)")
    if rc:
        raise RuntimeError(f"sg_chunk_attention failed: {_ERRORS.get(rc, rc)}")


def _exp2(x: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The kernel's own ``2^x`` (its softmax's exp) for a ``dtype`` cache (bfloat16: shared by the AMX
    and AVX-512 BF16 forms; float32: the float32 form's, to ~1 ulp) on a float32 CPU tensor, for tests
    that bound its error (``sg_chunk_attention_exp2``). Needs the kernel available for ``dtype``; raises
    RuntimeError otherwise."""
    if not available(dtype):
        raise RuntimeError(f"chunk attention for {dtype} is unavailable on this machine")
    x = x.detach().to(torch.float32).contiguous()
    y = torch.empty_like(x)
    fn = _library().sg_chunk_attention_exp2
    fn.argtypes, fn.restype = [_P, _P, _L, _I], None
    fn(x.data_ptr(), y.data_ptr(), x.numel(), int(dtype == torch.float32))
    return y
