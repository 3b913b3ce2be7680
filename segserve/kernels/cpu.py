"""PyTorch-facing wrappers of the compiled CPU kernels (``csrc/segserve_cpu.c``).

Each wrapper checks what the C code relies on for memory safety (dtype, device, shapes, strides) and
raises ``ValueError`` naming the bad value; whether to use a kernel at all is decided by the callers
through :func:`enabled` and the ``supports_*`` helpers, which never raise.

Switches: ``SEGSERVE_CPU_KERNELS=0`` in the environment turns the kernels off for the process;
:func:`set_enabled` does it at run time (benchmarks ablate with it in one process).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from segserve.kernels import build
from segserve.kernels.gguf_blocks import QuantWeight
from segserve.kernels.switch import Switch

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# The C code's head-shape limits (MAX_D, MAX_G in csrc/segserve_cpu.c).
MAX_HEAD_DIM = 256
MAX_QUERY_HEADS_PER_KV_HEAD = 16
_PROLOGUES = {None: 0, "rmsnorm": 1, "silu_mul": 2}

# Most rows a step may have to take the compiled small-batch path (the one-call decode step, or the
# fused per-layer linears). Measured on the engine (benchmarks/bench_decode.py, 2 threads, idle):
# float32 batch 16 per-op with oneDNN 66.2 ms vs one call 69.6 ms, so 8 (where the call wins: 30.4 vs
# 57.0 ms at 4); bfloat16 batch 4 one call 16.9 vs 23.0 ms, batch 8 27.0 vs 29.2 ms, so 8, although
# oneDNN's bf16 GEMM alone beats the compiled one from 4 rows (bench_gemv: 9.0 vs 11.7 ms at M=4): the
# ~200 eager ops a step saves weigh more.
MAX_SMALL_ROWS = {torch.float32: 8, torch.bfloat16: 8}
# Most rows a decode-only step of a model with GGUF-block projections may have to run as one call
# (``DecodeStack``) instead of per-layer GEMMs (``forward_chunk``); models without blocks keep
# MAX_SMALL_ROWS. The float32 block kernel takes any row count (tiles of 8 rows). Measured per step,
# interleaved in one process (benchmarks/ab_decode_steps.py --mode rows: steps alternating between the
# paths, 200-token contexts, 2 threads, load average 5.7-6.7): Q4_1 float32 b=16 stack 286 vs
# forward_chunk 414 ms median (252 vs 366 min), b=32 439 vs 566 (345 vs 443); the bfloat16 export
# (dense) at b=16 lost, 143 vs 108 ms on AMX, so bfloat16 stays at 8.
MAX_DECODE_STACK_ROWS_BLOCKS = {torch.float32: 64, torch.bfloat16: 8}
# Most rows a decode-only step of a dense model may have to run as one call with its projections as tile
# products of the packed weights (``DecodeStack`` given tile weights, ``run(tiles=...)``): the C products
# take up to 4 row tiles of 16. On AMX, measured per step, interleaved in one process
# (benchmarks/profile_bf16_decode.py --mode ab, table in docs/perf.md): the stack beats forward_chunk at
# every batch of 9-64 rows (and, from 2 rows, the stack's own vdpbf16ps register tiles:
# cpu_step.AMX_STACK_MIN_ROWS). Without AMX (vdpbf16ps tiles over the same packed weights, from
# cpu_step.TILE_STACK_MIN_ROWS rows): see there.
MAX_DECODE_STACK_ROWS_TILES = {torch.bfloat16: 64}
# Most rows a decode-only step of a dense model without tile copies may have to run as one call, its
# projections as the compiled register tiles (each weight tile streamed once for all rows). Measured per
# step, interleaved in one process (the bf16 export, 200-token prompts, 2 threads, AMD EPYC Zen 4, no AMX,
# load 1.1, 2026-12-02): stack vs forward_chunk's oneDNN GEMMs 45.0 vs 58.4 ms at 16 rows, 73.2 vs 109.3
# at 32, 155.6 vs 197.7 at 64, so 64 in bfloat16; float32 stays at 8 (66.2 vs 69.6 ms at 16 rows, above).
MAX_DECODE_STACK_ROWS_DENSE = {torch.float32: 8, torch.bfloat16: 64}

# The projections the decode stack may take as GGUF blocks (segserve_quant.c).
_PROJECTIONS = ("qkv", "o", "gate_up", "down")

_switch = Switch("SEGSERVE_CPU_KERNELS")
_lib = None

# The argument structs of the C entry points (``sg_*_args`` in csrc/segserve_cpu.c), field for field in
# the C order (ctypes pads as the C compiler does), so the wrappers fill them by name. ``size`` is set
# to the struct's ``SIZE`` (its ctypes size); the C side refuses any other size with ERR_LAYOUT, and
# tests/kernels/test_c_interface.py compares every field's name and type with the C source.
_P = ctypes.c_void_p
_I = ctypes.c_int32
_L = ctypes.c_int64
_F = ctypes.c_float


def _sized(cls: type[ctypes.Structure]) -> type[ctypes.Structure]:
    """Give an argument struct its ``SIZE``: its size in bytes, what its ``size`` field must hold."""
    cls.SIZE = ctypes.sizeof(cls)
    return cls


@_sized
class _LinearArgs(ctypes.Structure):
    """``sg_linear_args`` (its fields are documented in the C source)."""

    _fields_ = [
        ("size", _L), ("dt", _I), ("ydt", _I), ("M", _L), ("N", _L), ("K", _L), ("x", _P), ("ldx", _L),
        ("prologue", _I), ("norm_w", _P), ("eps", _F), ("w", _P), ("bias", _P), ("y", _P), ("ldy", _L),
        ("accumulate", _I), ("wqt", _I), ("xq8", _I),
    ]


@_sized
class _RopeArgs(ctypes.Structure):
    """``sg_rope_args`` (its fields are documented in the C source)."""

    _fields_ = [
        ("size", _L), ("dt", _I), ("T", _L), ("H", _L), ("D", _L), ("x", _P), ("row_stride", _L),
        ("cos", _P), ("ssin", _P),
    ]


@_sized
class _WriteKVArgs(ctypes.Structure):
    """``sg_write_kv_args`` (its fields are documented in the C source)."""

    _fields_ = [
        ("size", _L), ("dt", _I), ("n", _L), ("width", _L), ("k", _P), ("ldk", _L), ("v", _P), ("ldv", _L),
        ("cache", _P), ("num_slots", _L), ("slot_mapping", _P),
    ]


@_sized
class _DecodeAttentionArgs(ctypes.Structure):
    """``sg_decode_attention_args`` (its fields are documented in the C source)."""

    _fields_ = [
        ("size", _L), ("dt", _I), ("n", _L), ("Hq", _L), ("Hkv", _L), ("D", _L), ("q", _P), ("ldq", _L),
        ("out", _P), ("T", _L), ("rows", _P), ("cache", _P), ("num_blocks", _L), ("block_size", _L),
        ("block_table", _P), ("B", _L), ("ld_bt", _L), ("reqs", _P), ("lens", _P), ("seg", _L),
        ("scale", _F),
    ]


@_sized
class _Layer(ctypes.Structure):
    """``sg_layer`` (its fields are documented in the C source)."""

    _fields_ = [
        *[(name, _P) for name in ("ln1", "qkv", "qkv_bias", "o", "ln2", "gate_up", "down", "kv_cache")],
        *[(name, _I) for name in ("qkv_wqt", "o_wqt", "gate_up_wqt", "down_wqt")],
        *[(name, _P) for name in ("qkv_tiles", "o_tiles", "gate_up_tiles", "down_tiles")],
    ]


@_sized
class _DecodeStackArgs(ctypes.Structure):
    """``sg_decode_stack_args`` (its fields are documented in the C source)."""

    _fields_ = [
        ("size", _L), ("layer_size", _L), ("dt", _I), ("num_layers", _L), ("layers", ctypes.POINTER(_Layer)),
        ("M", _L), ("H", _L), ("I", _L), ("Hq", _L), ("Hkv", _L), ("D", _L), ("eps", _F), ("h", _P),
        ("cos", _P), ("ssin", _P), ("num_blocks", _L), ("block_size", _L), ("n", _L), ("slot_mapping", _P),
        ("rows", _P), ("block_table", _P), ("ld_bt", _L), ("reqs", _P), ("lens", _P), ("seg", _L),
        ("scale", _F), ("xq8", _I), ("tiles", _I), ("final_norm", _P), ("lm_w", _P), ("lm_wqt", _I),
        ("vocab", _L), ("hidden", _P), ("logits", _P),
    ]


@_sized
class _RowsArgs(ctypes.Structure):
    """``sg_rows_args``."""

    _fields_ = [
        ("size", _L), ("dt", _I), ("op", _I), ("M", _L), ("K", _L), ("h", _P), ("ldh", _L), ("add", _P),
        ("ldadd", _L), ("norm_w", _P), ("eps", _F), ("out", _P), ("ldout", _L),
    ]


_ARGS = {
    "sg_linear": _LinearArgs, "sg_rope": _RopeArgs, "sg_write_kv": _WriteKVArgs,
    "sg_decode_attention": _DecodeAttentionArgs, "sg_decode_stack": _DecodeStackArgs, "sg_rows": _RowsArgs,
}
_ERRORS = {-1: "unsupported shape", -2: "out of memory", -3: "row index outside the batch",
           -4: "block id outside the cache",
           -5: "argument struct of another size (the library and cpu.py disagree on its layout)"}


def typed(lib, args: dict[str, type]):
    """``lib`` with each named entry point typed ``int fn(const args *)`` (its struct's ``ctypes``
    mirror), once: the other kernel modules' ``_library`` call it on this library. None stays None."""
    if lib is not None and getattr(lib, next(iter(args))).argtypes is None:
        for name, struct in args.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = [ctypes.POINTER(struct)], ctypes.c_int
    return lib


def _library():
    global _lib
    if _lib is None:
        _lib = typed(build.load(), _ARGS)
    return _lib


def enabled() -> bool:
    """True when the kernels are switched on and built for this machine (builds on first call)."""
    return _switch.on and _library() is not None


def set_enabled(flag: bool) -> bool:
    """Switch the kernels on or off for this process; returns the previous setting."""
    return _switch.set(flag)


def disabled():
    """``with disabled():`` runs the eager PyTorch path (for ablations and oracle comparisons)."""
    return _switch.off()


def unavailable_reason() -> str | None:
    """Why the kernels are off: the environment switch, the CPU, or the build (None when on)."""
    if not _switch.on:
        return _switch.off_reason()
    return None if _library() is not None else build.unavailable_reason()


def _check(rc: int, name: str) -> None:
    if rc:
        raise RuntimeError(f"{name} failed: {_ERRORS.get(rc, rc)}")


def _dtype_code(t: torch.Tensor, what: str) -> int:
    code = _DTYPES.get(t.dtype)
    if code is None or t.device.type != "cpu":
        raise ValueError(f"{what} must be a float32 or bfloat16 CPU tensor, got {t.dtype} on {t.device}")
    return code


def _on_cpu(**tensors: torch.Tensor | None) -> None:
    """Every given tensor lives in CPU memory (a meta or CUDA tensor's pointer is not one C can read)."""
    for name, t in tensors.items():
        if t is not None and t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor, got one on {t.device}")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of two tensors intersect."""
    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True)) if t.numel() else -1
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def supports_linear(weight: torch.Tensor) -> bool:
    """Whether :func:`linear` takes this ``(N, K)`` weight (float32/bfloat16 CPU, contiguous, K a
    multiple of 32, N of 4)."""
    return (
        weight.dtype in _DTYPES and weight.device.type == "cpu" and weight.dim() == 2
        and weight.is_contiguous() and weight.shape[1] % 32 == 0 and weight.shape[0] % 4 == 0
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    prologue: str | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``prologue(x) @ weight.T + bias`` for a few rows, streaming ``weight`` once for all of them.

    Args:
        x: ``(M, K)`` (``(M, 2K)`` for ``silu_mul``: gate then up), the weight's dtype; rows may be
            strided but each row contiguous.
        weight: ``(N, K)``, see :func:`supports_linear`. bias: ``(N,)`` or None.
        prologue: None; ``"rmsnorm"`` (``norm_weight * x / sqrt(mean(x^2) + eps)``, HF's
            LlamaRMSNorm with its roundings); ``"silu_mul"`` (``silu(gate) * up``, SwiGLU).
        residual: ``(M, N)`` contiguous, updated in place as ``residual += result`` (the product
            rounded to the dtype first, like ``h.add_(linear(x))``) and returned.
        out_dtype: dtype of a new output (default the weight's); float32 for logits.

    Returns:
        ``(M, N)``: ``residual`` when given, else a new tensor.

    Raises:
        ValueError: on a dtype, device or shape the kernel does not take (named with the limit).
    """
    dt = _dtype_code(weight, "weight")
    if not supports_linear(weight):
        raise ValueError(f"weight {tuple(weight.shape)} must be contiguous with K % 32 == 0 and N % 4 == 0")
    if prologue not in _PROLOGUES:
        raise ValueError(f"prologue must be 'rmsnorm', 'silu_mul' or None, got {prologue!r}")
    if norm_weight is not None and prologue != "rmsnorm":
        raise ValueError("norm_weight is only used with prologue='rmsnorm'")
    if residual is not None and out_dtype is not None:
        raise ValueError("out_dtype is for a new output; a residual is updated in its own dtype")
    _on_cpu(x=x, norm_weight=norm_weight, bias=bias, residual=residual)
    n, k = weight.shape
    width = 2 * k if prologue == "silu_mul" else k
    if x.dtype != weight.dtype or x.dim() != 2 or x.shape[1] != width or x.stride(1) != 1:
        raise ValueError(
            f"x must be (M, {width}) {weight.dtype} with contiguous rows, got {tuple(x.shape)} {x.dtype}"
        )
    m = x.shape[0]
    if prologue == "rmsnorm" and (
        norm_weight is None or norm_weight.shape != (k,) or norm_weight.dtype != x.dtype
        or not norm_weight.is_contiguous()
    ):
        raise ValueError(f"rmsnorm needs a contiguous ({k},) {x.dtype} norm_weight")
    if bias is not None and (bias.shape != (n,) or bias.dtype != weight.dtype or not bias.is_contiguous()):
        raise ValueError(f"bias must be ({n},) {weight.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if residual is not None:
        if residual.shape != (m, n) or not residual.is_contiguous():
            raise ValueError(f"residual must be a contiguous ({m}, {n}) tensor, got {tuple(residual.shape)}")
        if prologue is None and _overlap(residual, x):  # the kernel would read x while writing it
            raise ValueError("residual must not overlap x (write the product to a new tensor first)")
        y = residual
    else:
        y = torch.empty(m, n, dtype=out_dtype or weight.dtype)
    ydt = _dtype_code(y, "output")
    if m == 0:
        return y
    rc = _library().sg_linear(_LinearArgs(
        size=_LinearArgs.SIZE, dt=dt, ydt=ydt, M=m, N=n, K=k, x=x.data_ptr(), ldx=x.stride(0),
        prologue=_PROLOGUES[prologue], norm_w=None if norm_weight is None else norm_weight.data_ptr(),
        eps=eps, w=weight.data_ptr(), bias=None if bias is None else bias.data_ptr(), y=y.data_ptr(),
        ldy=n, accumulate=residual is not None,
    ))
    _check(rc, "sg_linear")
    return y


def rope_(x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate the first ``num_heads`` heads of each row of ``x`` in place (rotate-half RoPE).

    Args:
        x: ``(T, W)``, rows contiguous, ``W >= num_heads * head_dim`` (a fused QKV output: Q and K
            heads first).
        cos, sin: ``(T, head_dim)`` float32 contiguous, rows of ``segserve.models.llama.rope_table``
            (``sin`` signed: first half negated). Rounded to ``x``'s dtype before use, as the eager path
            does.

    Raises:
        ValueError: on mismatched shapes, dtypes or strides.
    """
    dt = _dtype_code(x, "x")
    t = x.shape[0]
    too_narrow = x.dim() != 2 or x.shape[1] < num_heads * head_dim
    overlapping = t > 1 and x.stride(0) < num_heads * head_dim  # rows would be rotated twice
    if too_narrow or overlapping or x.stride(1) != 1 or head_dim % 2 or head_dim > 1024:
        raise ValueError(f"x {tuple(x.shape)} cannot hold {num_heads} heads of even dim {head_dim} <= 1024")
    _on_cpu(cos=cos, sin=sin)
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dtype != torch.float32 or table.shape != (t, head_dim) or not table.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 ({t}, {head_dim}), got {tuple(table.shape)}")
    rc = _library().sg_rope(_RopeArgs(
        size=_RopeArgs.SIZE, dt=dt, T=t, H=num_heads, D=head_dim, x=x.data_ptr(), row_stride=x.stride(0),
        cos=cos.data_ptr(), ssin=sin.data_ptr(),
    ))
    _check(rc, "sg_rope")


def _rows_operand(t: torch.Tensor, name: str, rows: int, width: int, dtype: torch.dtype) -> None:
    if t.dtype != dtype or t.dim() != 2 or t.shape[0] != rows or t.shape[1] < width or t.stride(1) != 1:
        raise ValueError(
            f"{name} must be ({rows}, >= {width}) {dtype} with contiguous rows, got {tuple(t.shape)} "
            f"{t.dtype} strides {t.stride()}"
        )
    _on_cpu(**{name: t})


def add_rmsnorm_(
    h: torch.Tensor, weight: torch.Tensor, eps: float, add: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``h += add`` (in place, rounded to h's dtype) then ``out = RMSNorm(h) * weight``, one pass per row.

    What the eager ``h.add_(add)`` then ``RMSNorm`` compute, rounded at the same points (the norm's sum
    in another order): the residual add of a layer fused with the next norm, for prefill chunks.

    Args:
        h: ``(M, K)`` float32 or bfloat16, rows contiguous, K a multiple of 16.
        weight: ``(K,)`` the norm's weight, same dtype.
        eps: the norm's epsilon.
        add: ``(M, K)`` same dtype, or None (no add).
        out: ``(M, K)`` result buffer, or None (a new tensor).

    Returns:
        ``out``.

    Raises:
        ValueError: on other dtypes, shapes or strides, or ``out`` overlapping ``h`` or ``add``.
    """
    dt = _dtype_code(h, "h")
    m, k = h.shape if h.dim() == 2 else (0, 0)
    if m < 1 or k < 16 or k % 16:
        raise ValueError(f"h must be (M >= 1, K) with K a positive multiple of 16, got {tuple(h.shape)}")
    _rows_operand(h, "h", m, k, h.dtype)
    if weight.dtype != h.dtype or weight.shape != (k,) or not weight.is_contiguous():
        raise ValueError(
            f"weight must be contiguous ({k},) {h.dtype}, got {tuple(weight.shape)} {weight.dtype}"
        )
    _on_cpu(weight=weight)
    if add is not None:
        _rows_operand(add, "add", m, k, h.dtype)
    out = torch.empty(m, k, dtype=h.dtype) if out is None else out
    _rows_operand(out, "out", m, k, h.dtype)
    if _overlap(out, h) or (add is not None and _overlap(out, add)):
        raise ValueError("out must not overlap h or add")
    rc = _library().sg_rows(_RowsArgs(
        size=_RowsArgs.SIZE, dt=dt, op=1, M=m, K=k, h=h.data_ptr(), ldh=h.stride(0),
        add=None if add is None else add.data_ptr(), ldadd=0 if add is None else add.stride(0),
        norm_w=weight.data_ptr(), eps=eps, out=out.data_ptr(), ldout=out.stride(0),
    ))
    _check(rc, "sg_rows")
    return out


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ``(M, 2I)`` = ``[gate | up]`` -> ``(M, I)``, rounded as the eager
    ``F.silu(gate).mul_(up)`` rounds (SiLU within ~1 ulp: a polynomial exp), one pass per row.

    Raises:
        ValueError: on other dtypes, an odd or non-multiple-of-32 width, strides, or an overlapping ``out``.
    """
    dt = _dtype_code(gate_up, "gate_up")
    if gate_up.dim() != 2 or gate_up.shape[0] < 1 or gate_up.shape[1] % 32:
        raise ValueError(f"gate_up must be (M >= 1, 2I) with 2I a multiple of 32, got {tuple(gate_up.shape)}")
    m, i = gate_up.shape[0], gate_up.shape[1] // 2
    _rows_operand(gate_up, "gate_up", m, 2 * i, gate_up.dtype)
    out = torch.empty(m, i, dtype=gate_up.dtype) if out is None else out
    _rows_operand(out, "out", m, i, gate_up.dtype)
    if _overlap(out, gate_up):
        raise ValueError("out must not overlap gate_up")
    rc = _library().sg_rows(_RowsArgs(
        size=_RowsArgs.SIZE, dt=dt, op=2, M=m, K=i, h=gate_up.data_ptr(), ldh=gate_up.stride(0), add=None,
        ldadd=0, norm_w=None, eps=0.0, out=out.data_ptr(), ldout=out.stride(0),
    ))
    _check(rc, "sg_rows")
    return out


def _head_dim_fits(d: int) -> bool:
    return d % 16 == 0 and 0 < d <= MAX_HEAD_DIM


def _heads_fit(num_heads: int, num_kv_heads: int) -> bool:
    return num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_QUERY_HEADS_PER_KV_HEAD


def supports_cache(kv_cache: torch.Tensor, dtype: torch.dtype, num_heads: int | None = None) -> bool:
    """Whether the C KV-cache kernels take this ``[2, num_blocks, block_size, Hkv, D]`` cache for
    activations of ``dtype`` (same dtype, CPU, contiguous, D a multiple of 16 up to 256) and, when
    given, ``num_heads`` query heads (a multiple of Hkv, at most 16 per KV head)."""
    ok = (
        kv_cache.dtype == dtype and dtype in _DTYPES and kv_cache.device.type == "cpu"
        and kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.is_contiguous()
        and kv_cache.shape[3] >= 1 and _head_dim_fits(kv_cache.shape[4])
    )
    return ok and (num_heads is None or _heads_fit(num_heads, kv_cache.shape[3]))


def _check_cache(kv_cache: torch.Tensor) -> int:
    """The cache's dtype code; ValueError unless it is a contiguous ``[2, blocks, block_size, Hkv, D]``
    CPU tensor (the layout the C code indexes)."""
    dt = _dtype_code(kv_cache, "kv_cache")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or not kv_cache.is_contiguous() or kv_cache.numel() == 0:
        raise ValueError(
            f"kv_cache must be a contiguous [2, num_blocks, block_size, Hkv, D] tensor, got shape "
            f"{tuple(kv_cache.shape)} strides {kv_cache.stride()}"
        )
    return dt


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store rows ``[:len(slot_mapping)]`` of ``k``, ``v`` (``[T, Hkv, D]``, each row contiguous, the
    cache's dtype) at their slots of ``kv_cache`` (see :func:`supports_cache`).

    Raises:
        ValueError: on a shape or dtype mismatch, or a slot outside ``[0, num_blocks * block_size)``.
    """
    dt = _check_cache(kv_cache)
    _, num_blocks, block_size, hkv, d = kv_cache.shape
    _on_cpu(k=k, v=v, slot_mapping=slot_mapping)
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping must be 1-D int32/int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )
    n = slot_mapping.shape[0]
    for name, t in (("k", k), ("v", v)):
        if t.dtype != kv_cache.dtype or t.dim() != 3 or t.shape[1:] != (hkv, d) or t.shape[0] < n \
                or t.stride(2) != 1 or t.stride(1) != d:
            raise ValueError(
                f"{name} must be [>= {n}, {hkv}, {d}] {kv_cache.dtype} rows, got {tuple(t.shape)}"
            )
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
    slots = slots.contiguous()
    rc = _library().sg_write_kv(_WriteKVArgs(
        size=_WriteKVArgs.SIZE, dt=dt, n=n, width=hkv * d, k=k.data_ptr(), ldk=k.stride(0), v=v.data_ptr(),
        ldv=v.stride(0), cache=kv_cache.data_ptr(), num_slots=num_blocks * block_size,
        slot_mapping=slots.data_ptr(),
    ))
    if rc == -1:
        raise ValueError(f"a slot in slot_mapping is outside [0, {num_blocks * block_size})")
    _check(rc, "sg_write_kv")


def decode_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    rows: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    reqs: torch.Tensor,
    lens: torch.Tensor,
    kv_segment_size: int,
    scale: float,
) -> None:
    """Decode attention through the block table, in place, segment by segment (split-KV + LSE merge).

    Args:
        q: ``[T, Hq, D]``, the cache's dtype, heads contiguous within a row (a view of a fused QKV
            output is fine). out: ``[T, Hq, D]`` contiguous, same dtype. Decode ``j`` reads
            ``q[rows[j]]`` and writes ``out[rows[j]]`` (other rows untouched).
        rows, reqs, lens: ``(n,)`` int64: batch row, block-table row, and tokens to attend (its own
            token included, already written to the cache) of each decode.
        kv_cache: ``[2, num_blocks, block_size, Hkv, D]`` (see :func:`supports_cache`).
        block_table: ``[B, max_blocks_per_seq]`` int32 contiguous.
        kv_segment_size: the most tokens per segment (one work item per decode, KV head and segment;
            with a bfloat16 cache and at least 4 segments per thread, e.g. 8 short decodes on two
            threads, per decode and segment for all KV heads, reading each token's row once: the same
            values).
            The C code splits segments below it when the contexts are short: it halves the segment,
            down to 64 tokens, until there are two work items per thread, so that a few short decodes
            still give every core work (one 300-token decode with 2 KV heads is 2 items at 512, 4 at
            256). The partials merge by log-sum-exp, exact in real arithmetic for any split, so the
            split changes only float32 summation order: two splits agree within 1e-6 in float32 and
            within one ulp in bfloat16 (the segmented eager backend always uses ``kv_segment_size``).
        scale: softmax scale, usually ``D ** -0.5``.

    Raises:
        ValueError: on a shape or dtype mismatch or a length outside ``[1, max_blocks * block_size]``.
        RuntimeError: when the library refuses the call (out of memory, or a library built for
            another layout of the argument struct).
    """
    dt = _check_cache(kv_cache)
    _, num_blocks, block_size, hkv, d = kv_cache.shape
    _on_cpu(q=q, out=out, rows=rows, block_table=block_table, reqs=reqs, lens=lens)
    if q.dim() != 3 or kv_segment_size < 1:
        raise ValueError(
            f"q must be [T, Hq, D] and kv_segment_size >= 1, got {tuple(q.shape)}, {kv_segment_size}"
        )
    hq = q.shape[1]
    n = rows.shape[0]
    for name, t in (("q", q), ("out", out)):
        if t.dtype != kv_cache.dtype or t.dim() != 3 or t.shape[1:] != (hq, d) or t.stride(2) != 1 \
                or t.stride(1) != d or (t is out and not t.is_contiguous()):
            raise ValueError(f"{name} must be [T, {hq}, {d}] {kv_cache.dtype} rows, got {tuple(t.shape)}")
    if out.shape[0] != q.shape[0]:
        raise ValueError(f"out has {out.shape[0]} rows, q {q.shape[0]}")
    if not _heads_fit(hq, hkv):
        raise ValueError(f"{hq} query heads over {hkv} KV heads: need a multiple, at most 16 per KV head")
    if block_table.dtype != torch.int32 or not block_table.is_contiguous() or block_table.dim() != 2:
        raise ValueError("block_table must be a contiguous 2-D int32 tensor")
    for name, t in (("rows", rows), ("reqs", reqs), ("lens", lens)):
        if t.dtype != torch.int64 or t.shape != (n,) or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous ({n},) int64 tensor")
    if n == 0:
        return
    rc = _library().sg_decode_attention(_DecodeAttentionArgs(
        size=_DecodeAttentionArgs.SIZE, dt=dt, n=n, Hq=hq, Hkv=hkv, D=d, q=q.data_ptr(), ldq=q.stride(0),
        out=out.data_ptr(), T=q.shape[0], rows=rows.data_ptr(), cache=kv_cache.data_ptr(),
        num_blocks=num_blocks, block_size=block_size, block_table=block_table.data_ptr(),
        B=block_table.shape[0], ld_bt=block_table.shape[1], reqs=reqs.data_ptr(), lens=lens.data_ptr(),
        seg=kv_segment_size, scale=scale,
    ))
    _raise_decode_error(rc, q.shape[0], block_table, block_size, num_blocks)
    _check(rc, "sg_decode_attention")


def _raise_decode_error(
    rc: int, rows: int, block_table: torch.Tensor, block_size: int, num_blocks: int
) -> None:
    """The ValueError for a decode the C checks refused (nothing was read or written)."""
    if rc == -1:
        raise ValueError(f"a decode length is outside [1, {block_table.shape[1] * block_size}]")
    if rc == -3:
        raise ValueError(f"a decode's row is outside [0, {rows}) or its table row outside "
                         f"[0, {block_table.shape[0]})")
    if rc == -4:
        raise ValueError(f"a decode walks a block id outside [1, {num_blocks}) (0 is the null block)")


@dataclass(frozen=True)
class StackHead:
    """What :meth:`DecodeStack.run` computes after the layers when given one: the final norm's
    ``norm_weight`` ``(H,)``, the LM head's ``weight`` ``(vocab, H)`` (a tensor or GGUF blocks), and the
    outputs ``hidden`` ``(M, H)`` (the normed rows) and ``logits`` ``(M, vocab)`` float32."""

    norm_weight: torch.Tensor
    weight: torch.Tensor | QuantWeight
    hidden: torch.Tensor
    logits: torch.Tensor


class DecodeStack:
    """Every layer's weights as ``sg_decode_stack`` reads them: pointers, built once per model (with the
    step's argument struct, of which :meth:`run` sets only the step's own fields), dtype and cache shape
    (the weights are held, so they outlive the pointers). The KV caches are not held: :meth:`run` takes
    the step's caches and points at them, so a dropped engine's caches are freed.

    Args:
        layers: per layer ``(ln1 (H,), qkv (Nqkv, H), qkv_bias (Nqkv,) or None, o (H, Hq D), ln2 (H,),
            gate_up (2 I, H), down (H, I), kv_cache [2, num_blocks, block_size, Hkv, D])``; each projection
            a tensor or GGUF blocks (``QuantWeight``, run by ``csrc/segserve_quant.c``); the tensors all one
            dtype, contiguous (the caches give the shape every later step's caches must have).
            ``Nqkv = (Hq + 2 Hkv) D``.
        num_heads, num_kv_heads, head_dim: Hq, Hkv, D. eps: RMSNorm epsilon.
        tile_weights: optional, per layer ``(qkv, o, gate_up, down)`` in ``amx.pack``'s tile layout (dense
            bfloat16 layers only), which :meth:`run` with ``tiles`` multiplies on AMX tiles or vdpbf16ps
            register tiles.

    Raises:
        ValueError: naming the first tensor whose dtype, layout or shape does not fit.
    """

    def __init__(self, layers: list[tuple], num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 tile_weights: list[tuple[torch.Tensor, ...]] | None = None):
        if not layers or num_heads < 1 or num_kv_heads < 1 or head_dim < 1:
            raise ValueError(
                f"need at least one layer and positive head counts, got {len(layers)} layers, "
                f"{num_heads} heads, {num_kv_heads} KV heads, head_dim {head_dim}"
            )
        ln1, qkv, _, _, _, gate_up, _, cache = layers[0]
        self.dtype = ln1.dtype  # the projections may be GGUF blocks (QuantWeight), the norms never
        self.hidden, self.inter = qkv.shape[1], gate_up.shape[0] // 2
        self.heads, self.kv_heads, self.head_dim, self.eps = num_heads, num_kv_heads, head_dim, eps
        _check_cache(cache)
        if cache.shape[3:] != (num_kv_heads, head_dim):  # the C code indexes the cache by these
            raise ValueError(
                f"kv_cache {tuple(cache.shape)} must be "
                f"[2, num_blocks, block_size, {num_kv_heads}, {head_dim}]"
            )
        self.cache_shape = tuple(cache.shape)
        h, i, nqkv = self.hidden, self.inter, (num_heads + 2 * num_kv_heads) * head_dim
        shapes = (
            (h,), (nqkv, h), (nqkv,), (h, num_heads * head_dim), (h,), (2 * i, h), (h, i), self.cache_shape
        )
        names = ("ln1", "qkv", "qkv_bias", "o", "ln2", "gate_up", "down", "kv_cache")
        for n, layer in enumerate(layers):
            for name, t, shape in zip(names, layer, shapes, strict=True):
                if t is None and name == "qkv_bias":
                    continue
                if isinstance(t, QuantWeight) and name in _PROJECTIONS:
                    if t.shape != shape or t.data.device.type != "cpu":
                        raise ValueError(f"layer {n} {name}: need {shape} blocks on CPU, got {t.shape}")
                    continue
                fits = t.dtype == self.dtype and t.device.type == "cpu" and t.is_contiguous()
                if not fits or t.shape != shape:
                    raise ValueError(
                        f"layer {n} {name}: need contiguous {shape} {self.dtype} on CPU, got "
                        f"{tuple(t.shape)} {t.dtype} on {t.device}"
                    )
        _dtype_code(ln1, "weights")
        if h % 32 or i % 32 or not _head_dim_fits(head_dim) or not _heads_fit(num_heads, num_kv_heads):
            raise ValueError(
                f"hidden {h} and intermediate {i} must be multiples of 32, head_dim {head_dim} a multiple of "
                f"16 up to 256, and {num_heads} heads at most 16 per each of {num_kv_heads} KV heads"
            )
        self._weights = [layer[:7] for layer in layers]
        self.tiled = tile_weights is not None
        if self.tiled:
            self._check_tile_weights(layers, tile_weights)

        def pointer(t: torch.Tensor | QuantWeight | None) -> int | None:
            return None if t is None else (t.data if isinstance(t, QuantWeight) else t).data_ptr()

        def fmt(t: torch.Tensor | QuantWeight) -> int:
            return t.wqt if isinstance(t, QuantWeight) else 0  # 0: WQT_DENSE, plain dt values

        packed = tile_weights or [(None,) * 4] * len(layers)
        self._tile_weights = tile_weights
        self._array = (_Layer * len(layers))(*[
            _Layer(*[pointer(t) for t in layer[:7]], None, *[fmt(layer[i]) for i in (1, 3, 5, 6)],
                   *[pointer(t) for t in tiles])
            for layer, tiles in zip(layers, packed, strict=True)
        ])
        self._arange = torch.arange(0)
        # What every step shares, filled once; run() sets the step's own fields.
        _, num_blocks, block_size, _, _ = self.cache_shape
        self._args = _DecodeStackArgs(
            size=_DecodeStackArgs.SIZE, layer_size=_Layer.SIZE, dt=_DTYPES[self.dtype],
            num_layers=len(layers), layers=self._array, H=h, I=i, Hq=num_heads, Hkv=num_kv_heads,
            D=head_dim, eps=eps, num_blocks=num_blocks, block_size=block_size,
        )

    def _check_tile_weights(self, layers: list[tuple], tile_weights: list[tuple[torch.Tensor, ...]]) -> None:
        """Each tile copy is ``amx.pack``'s ``(N/16, K/32, 16, 32)`` bfloat16 tensor of its layer's dense
        bfloat16 projection."""
        if self.dtype != torch.bfloat16 or len(tile_weights) != len(layers):
            raise ValueError(f"tile_weights: need one (qkv, o, gate_up, down) per layer ({len(layers)}) of a "
                             f"bfloat16 stack, got {len(tile_weights)} for {self.dtype}")
        for n, (layer, tiles) in enumerate(zip(layers, tile_weights, strict=True)):
            for name, w, t in zip(_PROJECTIONS, (layer[1], layer[3], layer[5], layer[6]), tiles, strict=True):
                rows, cols = w.shape
                want = (rows // 16, cols // 32, 16, 32)
                if isinstance(w, QuantWeight) or rows % 16 or cols % 32 or t.dtype != torch.bfloat16 \
                        or tuple(t.shape) != want or not t.is_contiguous() or t.device.type != "cpu":
                    raise ValueError(
                        f"layer {n} {name}: tile weight must be amx.pack's contiguous {want} bfloat16 CPU "
                        f"tensor of a dense ({rows}, {cols}) weight, got {tuple(t.shape)} {t.dtype}"
                    )

    def _check_head(self, head: StackHead, m: int, tiles: str | None) -> None:
        """ValueError unless ``head`` fits a step of ``m`` rows (see :meth:`run`)."""
        w, h = head.weight, self.hidden
        if tiles is not None:
            raise ValueError(f"head is not taken with tiles={tiles!r}")
        if isinstance(w, QuantWeight):
            if w.shape[1] != h or w.data.device.type != "cpu":
                raise ValueError(f"head weight: need (vocab, {h}) blocks on CPU, got {w.shape}")
        elif w.dim() != 2 or w.shape[1] != h or w.dtype != self.dtype or not supports_linear(w):
            raise ValueError(f"head weight: need a contiguous (vocab, {h}) {self.dtype} CPU tensor, vocab a "
                             f"multiple of 4, got {tuple(w.shape)} {w.dtype}")
        nw = head.norm_weight
        if nw.dtype != self.dtype or nw.shape != (h,) or not nw.is_contiguous() or nw.device.type != "cpu":
            raise ValueError(f"head norm_weight must be a contiguous ({h},) {self.dtype} CPU tensor")
        for name, t, dtype, shape in (("hidden", head.hidden, self.dtype, (m, h)),
                                      ("logits", head.logits, torch.float32, (m, w.shape[0]))):
            if t.dtype != dtype or t.shape != shape or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"head {name} must be a contiguous {shape} {dtype} CPU tensor, got "
                                 f"{tuple(t.shape)} {t.dtype}")

    def run(
        self,
        kv_caches: list[torch.Tensor],
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        lens: torch.Tensor,
        kv_segment_size: int,
        scale: float,
        int8_formats: int = 0,
        tiles: str | None = None,
        head: StackHead | None = None,
    ) -> torch.Tensor:
        """One decode-only step through every layer, ``h`` ``(M, H)`` updated in place and returned;
        ``kv_caches`` one per layer, each of the shape the stack was built for. ``int8_formats``: a mask
        (bit ``wqt`` set, ``quant.int8_formats``) of the GGUF formats whose projections take integer
        activations (``quant.linear``'s ``int8``; the caller checks the library has that kernel).
        ``tiles``: the projections as tile products of the
        stack's ``tile_weights`` (up to ``MAX_DECODE_STACK_ROWS_TILES`` rows): ``"amx"`` on AMX tiles (the
        caller checks ``amx.available()``), the same bits as ``forward_chunk`` over ``amx.linear``;
        ``"vdpbf16ps"`` on AVX-512 BF16 register tiles, the same bits as over ``bf16gemm.linear``.
        ``head`` (not with ``tiles``): after the layers, in the same call, ``head.hidden`` ``(M, H)`` =
        RMSNorm(h) * ``head.norm_weight`` (``add_rmsnorm_``'s bits) and ``head.logits`` ``(M, vocab)``
        float32 = ``hidden @ head.weight.T`` (``linear`` / ``quant.linear`` with a float32 output, bit
        for bit; ``head.weight`` a ``(vocab, H)`` tensor of h's dtype or GGUF blocks).

        Rows ``0..n-1`` are the decodes (row ``j`` is block-table row ``j``), ``n = len(lens)``; the
        rest are padding. ``cos``/``sin`` ``(M, D)`` float32 RoPE rows; ``slot_mapping`` ``(n,)``
        int64; ``block_table`` ``[>= n, max_blocks]`` int32 contiguous; ``lens`` ``(n,)`` int64 tokens
        each decode attends to (its own included).

        Raises:
            ValueError: on a shape or dtype mismatch, or a slot or length out of range (nothing is
                written then); ``tiles`` not one of those names, or without tile weights, or beyond
                ``MAX_DECODE_STACK_ROWS_TILES`` rows.
        """
        m, n = h.shape[0], lens.shape[0]
        if tiles not in _STACK_TILES:
            names = sorted(k for k in _STACK_TILES if k)
            raise ValueError(f"tiles must be one of {names} or None, got {tiles!r}")
        most = MAX_DECODE_STACK_ROWS_TILES[torch.bfloat16]
        if tiles is not None and (not self.tiled or m > most):
            raise ValueError(f"tiles={tiles!r} needs a stack built with tile_weights and at most {most} "
                             f"rows, got {m} rows ({'with' if self.tiled else 'without'} tile weights)")
        if len(kv_caches) != len(self._array):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self._array)} layers")
        for i, kv in enumerate(kv_caches):
            if kv.shape != self.cache_shape or kv.dtype != self.dtype or kv.device.type != "cpu" \
                    or not kv.is_contiguous():
                raise ValueError(
                    f"kv_caches[{i}] must be a contiguous {self.cache_shape} {self.dtype} CPU tensor"
                )
            self._array[i].kv_cache = kv.data_ptr()
        _on_cpu(h=h, cos=cos, sin=sin, slot_mapping=slot_mapping, block_table=block_table, lens=lens)
        if kv_segment_size < 1:
            raise ValueError(f"kv_segment_size must be >= 1, got {kv_segment_size}")
        if h.dtype != self.dtype or h.shape != (m, self.hidden) or not h.is_contiguous():
            raise ValueError(f"h must be contiguous (M, {self.hidden}) {self.dtype}, got {tuple(h.shape)}")
        for name, t in (("cos", cos), ("sin", sin)):
            if t.dtype != torch.float32 or t.shape != (m, self.head_dim) or not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous float32 ({m}, {self.head_dim})")
        for name, t in (("slot_mapping", slot_mapping), ("lens", lens)):
            if t.dtype != torch.int64 or t.shape != (n,) or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous ({n},) int64 tensor")
        if block_table.dtype != torch.int32 or not block_table.is_contiguous() or block_table.dim() != 2 \
                or block_table.shape[0] < n or n > m:
            raise ValueError(f"block_table must be contiguous int32 [>= {n}, blocks] and n <= {m} rows")
        if self._arange.shape[0] < n:
            self._arange = torch.arange(max(n, 2 * self._arange.shape[0]))
        _, num_blocks, block_size, _, _ = self.cache_shape
        a = self._args
        a.M, a.h, a.cos, a.ssin, a.n = m, h.data_ptr(), cos.data_ptr(), sin.data_ptr(), n
        a.slot_mapping, a.rows = slot_mapping.data_ptr(), self._arange.data_ptr()
        a.reqs = a.rows  # decode j is batch row j and block-table row j
        a.block_table, a.ld_bt, a.lens = block_table.data_ptr(), block_table.shape[1], lens.data_ptr()
        a.seg, a.scale, a.xq8, a.tiles = kv_segment_size, scale, int8_formats, _STACK_TILES[tiles]
        a.final_norm = a.lm_w = a.hidden = a.logits = None
        a.lm_wqt, a.vocab = 0, 0
        if head is not None:
            self._check_head(head, m, tiles)
            w = head.weight
            a.final_norm, a.hidden = head.norm_weight.data_ptr(), head.hidden.data_ptr()
            a.logits = head.logits.data_ptr()
            a.lm_w = (w.data if isinstance(w, QuantWeight) else w).data_ptr()
            a.lm_wqt = w.wqt if isinstance(w, QuantWeight) else 0
            a.vocab = w.shape[0]
        rc = _library().sg_decode_stack(a)
        if rc == -1:
            raise ValueError(
                f"a slot is outside [0, {num_blocks * block_size}) or a length outside "
                f"[1, {block_table.shape[1] * block_size}]"
            )
        _raise_decode_error(rc, m, block_table, block_size, num_blocks)
        _check(rc, "sg_decode_stack")
        return h


STACK_PHASES = ("qkv", "attention", "o", "gate_up", "down")
# DecodeStack.run's ``tiles`` -> sg_decode_stack_args.tiles (TILES_* in csrc/segserve_cpu.c).
_STACK_TILES = {None: 0, "amx": 1, "vdpbf16ps": 2}


def stack_timing(buf: torch.Tensor | None) -> None:
    """Profiling hook: while ``buf`` is set, each :meth:`DecodeStack.run` of this thread adds to
    ``buf[l, p]`` the nanoseconds its first OpenMP thread spent in phase ``p`` of layer ``l`` (layers
    beyond ``buf``'s rows are not timed), in the
    order of :data:`STACK_PHASES` (norm + QKV, attention with its RoPE and KV write, O,
    norm + gate|up, SiLU + down), each up to the end of its closing barrier (waiting for the other
    thread counts). On the tile path (``DecodeStack.run`` with ``tiles``) RoPE and the KV write are a
    pass of their own after QKV and count in its phase, and the SiLU gate in gate|up's (its epilogue).

    Args:
        buf: ``(layers, len(STACK_PHASES))`` contiguous int64 CPU tensor, zeroed by the caller and
            held by it while set; ``None`` turns the hook off.

    Raises:
        ValueError: ``buf`` is not such a tensor.
    """
    lib = _library()
    if lib is None:
        raise ValueError(f"the compiled kernels are unavailable: {unavailable_reason()}")
    lib.sg_stack_timing.argtypes, lib.sg_stack_timing.restype = [_P, _L], None
    if buf is None:
        lib.sg_stack_timing(None, 0)
        return
    if buf.dtype != torch.int64 or buf.dim() != 2 or buf.shape[1] != len(STACK_PHASES) \
            or not buf.is_contiguous() or buf.device.type != "cpu":
        raise ValueError(f"buf must be a contiguous (layers, {len(STACK_PHASES)}) int64 CPU tensor, got "
                         f"{tuple(buf.shape)} {buf.dtype}")
    lib.sg_stack_timing(buf.data_ptr(), buf.shape[0])
