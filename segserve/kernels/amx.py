"""PyTorch-facing wrappers of the AMX bfloat16 GEMM (``csrc/segserve_amx.c``).

:func:`available` says whether this process can run it (the compiled kernels are on and built, the CPU
has AMX-BF16 and Linux granted the tile permission); :func:`pack` makes the weight copy it streams and
:func:`linear` runs it. The wrappers check what the C code relies on for memory safety and raise
``ValueError`` naming the bad value and the limit; whether to use the kernel at all is the caller's
choice (``segserve.worker.cpu_step``).

Switch: ``SEGSERVE_AMX=0`` turns it off for the process; :func:`set_enabled` at run time (benchmarks
alternate with it in one process).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from segserve.kernels import cpu as cpu_kernels
from segserve.kernels.switch import Switch

_P = ctypes.c_void_p
_I = ctypes.c_int32
_L = ctypes.c_int64

_EPILOGUES = {None: 0, "residual": 1, "silu_mul": 2, "rope_kv": 3}
_ERRORS = {-1: "unsupported shape",
           -5: "argument struct of another size (the library and amx.py disagree on its layout)",
           -6: "AMX not available in this process"}
# Flops of one round of sg_amx_peak's loop: 4 tile products of 16 x 16 x 32 multiply-adds.
PEAK_FLOPS_PER_ITER = 4 * 16 * 16 * 32 * 2

_switch = Switch("SEGSERVE_AMX")
_probed: bool | None = None


@cpu_kernels._sized
class _ProbeArgs(ctypes.Structure):
    """``sg_amx_probe_args``."""

    _fields_ = [("size", _L)]


@cpu_kernels._sized
class _PackArgs(ctypes.Structure):
    """``sg_amx_pack_args`` (its fields are documented in the C source)."""

    _fields_ = [("size", _L), ("N", _L), ("K", _L), ("w", _P), ("ldw", _L), ("packed", _P)]


# The GEMM's fields, shared with ``sg_bf16gemm_args`` (bf16gemm.py), which has them in the same order.
GEMM_FIELDS = [
    ("size", _L), ("M", _L), ("N", _L), ("K", _L), ("x", _P), ("ldx", _L), ("packed", _P), ("bias", _P),
    ("y", _P), ("ldy", _L), ("ydt", _I), ("epilogue", _I),
]


@cpu_kernels._sized
class _LinearArgs(ctypes.Structure):
    """``sg_amx_linear_args`` (its fields are documented in the C source): the GEMM's, then EPI_ROPE_KV's."""

    _fields_ = [
        *GEMM_FIELDS, ("D", _L), ("rope_heads", _L), ("kv_heads", _L), ("cos", _P), ("ssin", _P),
        ("slots", _P), ("n_slots", _L), ("kv_cache", _P), ("num_slots", _L),
    ]


@cpu_kernels._sized
class _PeakArgs(ctypes.Structure):
    """``sg_amx_peak_args``."""

    _fields_ = [("size", _L), ("iters", _L), ("threads", _I)]


@cpu_kernels._sized
class _RowsLinearArgs(ctypes.Structure):
    """``sg_amx_rows_linear_args`` (its fields are documented in ``csrc/segserve_amx_team.c``)."""

    _fields_ = [
        ("size", _L), ("M", _L), ("N", _L), ("K", _L), ("x", _P), ("ldx", _L), ("packed", _P), ("y", _P),
        ("ldy", _L),
    ]


_ARGS = {"sg_amx_probe": _ProbeArgs, "sg_amx_pack": _PackArgs, "sg_amx_linear": _LinearArgs,
         "sg_amx_peak": _PeakArgs, "sg_amx_rows_linear": _RowsLinearArgs}
# Most rows rows_linear takes: 4 row tiles of 16 (csrc/segserve_amx_team.c).
MAX_ROWS_LINEAR = 64


def _library():
    """The compiled library with the AMX entry points' signatures set, or None."""
    return cpu_kernels.typed(cpu_kernels._library(), _ARGS)


def hardware_ready() -> bool:
    """Whether AMX-BF16 runs in this process, whatever the switches say (asked once; the C probe also
    requests Linux's tile permission, which every thread of the process then has)."""
    global _probed
    if _probed is None:
        lib = _library()
        _probed = lib is not None and lib.sg_amx_probe(_ProbeArgs(size=_ProbeArgs.SIZE)) == 1
    return _probed


def available() -> bool:
    """True when the AMX GEMM is switched on and can run in this process (see the module docstring)."""
    return _switch.on and cpu_kernels.enabled() and hardware_ready()


def set_enabled(flag: bool) -> bool:
    """Switch the AMX GEMM on or off for this process; returns the previous setting."""
    return _switch.set(flag)


def disabled():
    """``with disabled():`` runs the projections through oneDNN (the other compiled kernels stay on)."""
    return _switch.off()


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True)."""
    if not _switch.on:
        return _switch.off_reason()
    if not cpu_kernels.enabled():
        return f"compiled kernels off: {cpu_kernels.unavailable_reason()}"
    return None if hardware_ready() else "CPU lacks AMX-BF16/AMX-TILE, or the OS does not grant tile state"


def _check(rc: int, name: str) -> None:
    if rc:
        raise RuntimeError(f"{name} failed: {_ERRORS.get(rc, rc)}")


def supports(weight: torch.Tensor) -> bool:
    """Whether :func:`pack` takes this ``(N, K)`` weight: bfloat16 on the CPU, rows contiguous, N a
    multiple of 16 and K of 32 (never raises)."""
    return (
        weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
        and weight.stride(1) == 1 and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0
        and weight.shape[0] > 0 and weight.shape[1] > 0
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The tile layout of a ``(N, K)`` bfloat16 weight (see ``csrc/segserve_amx.c``): a new
    ``(N/16, K/32, 16, 32)`` bfloat16 tensor, N * K values (one more copy of the weight).

    Raises:
        ValueError: on a weight :func:`supports` refuses (named with the limit).
    """
    if not supports(weight):
        raise ValueError(
            f"weight must be a 2-D bfloat16 CPU tensor with contiguous rows, N % 16 == 0 and K % 32 == 0, "
            f"got {tuple(weight.shape)} {weight.dtype} on {weight.device} strides {weight.stride()}"
        )
    lib = _library()
    if lib is None:
        raise RuntimeError(f"compiled kernels unavailable: {cpu_kernels.unavailable_reason()}")
    n, k = weight.shape
    w = weight.detach()
    packed = torch.empty(n // 16, k // 32, 16, 32, dtype=torch.bfloat16)
    _check(lib.sg_amx_pack(_PackArgs(
        size=_PackArgs.SIZE, N=n, K=k, w=w.data_ptr(), ldw=w.stride(0), packed=packed.data_ptr()
    )), "sg_amx_pack")
    return packed


@dataclass(frozen=True)
class RopeKV:
    """The fused QKV projection's epilogue for :func:`linear`: RoPE of the Q and K heads and the K/V
    write, in the GEMM's stores instead of ``cpu.rope_`` and ``cpu.write_kv`` passes over its output.

    Attributes:
        num_heads, num_kv_heads, head_dim: Hq, Hkv, D; the output columns are ``(Hq + 2 Hkv) D``, Q
            heads then K then V; D a multiple of 32.
        cos, sin: ``(M, D)`` bfloat16 contiguous: the float32 rows ``cpu.rope_`` takes (of
            ``segserve.models.llama.rope_table``; ``sin`` signed, first half negated) rounded to bfloat16,
            as ``rope_`` rounds them before use (``.bfloat16()``); once per step, not per layer.
        kv_cache: the layer's ``[2, num_blocks, block_size, Hkv, D]`` bfloat16 contiguous cache.
        slot_mapping: ``(n,)`` int64 contiguous, the cache slot of rows ``0 .. n - 1`` (``n <= M``;
            later rows are padding and write no cache).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    cos: torch.Tensor
    sin: torch.Tensor
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor

    def check(self, m: int, n: int) -> None:
        """Raise ``ValueError`` naming what does not fit an ``(m, n)`` projection output."""
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if d < 32 or d % 32 or hkv < 1 or hq < 1 or n != (hq + 2 * hkv) * d:
            raise ValueError(f"rope_kv needs n = (num_heads + 2 num_kv_heads) head_dim with head_dim a "
                             f"multiple of 32, got n={n}, heads {hq} / {hkv}, head_dim {d}")
        for name, t in (("cos", self.cos), ("sin", self.sin)):
            if t.dtype != torch.bfloat16 or t.shape != (m, d) or not t.is_contiguous() \
                    or t.device.type != "cpu":
                raise ValueError(f"rope_kv.{name} must be contiguous bfloat16 ({m}, {d}) on the CPU, got "
                                 f"{tuple(t.shape)} {t.dtype}")
        c = self.kv_cache
        if c.dtype != torch.bfloat16 or c.dim() != 5 or c.shape[0] != 2 or c.shape[3:] != (hkv, d) \
                or not c.is_contiguous() or c.device.type != "cpu":
            raise ValueError(f"rope_kv.kv_cache must be a contiguous [2, blocks, block_size, {hkv}, {d}] "
                             f"bfloat16 CPU tensor, got {tuple(c.shape)} {c.dtype}")
        s = self.slot_mapping
        if s.dtype != torch.int64 or s.dim() != 1 or not s.is_contiguous() or s.shape[0] > m \
                or s.device.type != "cpu":
            raise ValueError(f"rope_kv.slot_mapping must be contiguous 1-D int64 of at most {m} rows, got "
                             f"{tuple(s.shape)} {s.dtype}")


def linear_output(
    x: torch.Tensor, packed: torch.Tensor, n: int, k: int, bias: torch.Tensor | None,
    residual: torch.Tensor | None, silu_mul: bool, out_dtype: torch.dtype,
) -> tuple[torch.Tensor, int]:
    """Check :func:`linear`'s arguments (also ``bf16gemm.linear``'s, which takes the same ones) and
    return ``(y, epilogue)``: the tensor the kernel writes (``residual``, or a new ``(M, n)`` /
    ``(M, n/2)`` one) and the C epilogue code.

    Raises:
        ValueError: on a dtype, device, shape or stride the kernels do not take (named with the limit).
    """
    if packed.dtype != torch.bfloat16 or packed.device.type != "cpu" or not packed.is_contiguous() \
            or packed.numel() != n * k or packed.dim() != 4 or packed.shape != (n // 16, k // 32, 16, 32):
        raise ValueError(
            f"packed must be amx.pack's (n/16, k/32, 16, 32) bfloat16 tensor for n={n}, k={k}, got "
            f"{tuple(packed.shape)} {packed.dtype}"
        )
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != k \
            or x.shape[0] < 1 or x.stride(1) != 1 or x.stride(0) < k:
        raise ValueError(
            f"x must be (M >= 1, {k}) bfloat16 on the CPU with contiguous rows, got {tuple(x.shape)} "
            f"{x.dtype} on {x.device} strides {x.stride()}"
        )
    m = x.shape[0]
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (n,) or not bias.is_contiguous()
                             or bias.device.type != "cpu"):
        raise ValueError(f"bias must be a contiguous ({n},) bfloat16 CPU tensor, got {tuple(bias.shape)} "
                         f"{bias.dtype}")
    if silu_mul and residual is not None:
        raise ValueError("silu_mul and residual cannot be combined")
    if silu_mul and n % 32:
        raise ValueError(f"silu_mul needs n = 2 I with I a multiple of 16, got n={n}")
    if out_dtype not in (torch.bfloat16, torch.float32) or (out_dtype != torch.bfloat16
                                                            and (silu_mul or residual is not None)):
        raise ValueError(f"out_dtype must be bfloat16 (or float32 without an epilogue), got {out_dtype}")
    if residual is not None:
        if residual.dtype != torch.bfloat16 or residual.shape != (m, n) or not residual.is_contiguous() \
                or residual.device.type != "cpu":
            raise ValueError(f"residual must be a contiguous ({m}, {n}) bfloat16 CPU tensor, got "
                             f"{tuple(residual.shape)} {residual.dtype}")
        if cpu_kernels._overlap(residual, x):
            raise ValueError("residual must not overlap x")
        y = residual
    else:
        y = torch.empty(m, n // 2 if silu_mul else n, dtype=out_dtype)
    return y, _EPILOGUES["silu_mul" if silu_mul else "residual" if residual is not None else None]


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
    rope_kv: RopeKV | None = None,
) -> torch.Tensor:
    """``x @ W.T (+ bias)`` on AMX tiles for the ``(n, k)`` weight ``W`` that :func:`pack` packed.

    Args:
        x: ``(M, k)`` bfloat16, M >= 1, rows contiguous (a row stride >= k is fine).
        packed: :func:`pack`'s result for ``W``. bias: ``(n,)`` bfloat16 or None.
        residual: ``(M, n)`` contiguous bfloat16, updated in place as ``residual += result`` (the
            product rounded first, like ``h.add_(linear(x))``) and returned.
        silu_mul: ``W`` is a fused ``[gate; up]`` (n = 2 I): returns ``silu(gate) * up`` ``(M, I)``,
            rounded where ``F.silu(gate).mul_(up)`` rounds.
        out_dtype: bfloat16 or float32 for a plain output (the epilogues give bfloat16).
        rope_kv: ``W`` is a fused QKV projection: the result's Q and K heads rotated as ``cpu.rope_``
            rotates them, and its K and V rows written to ``rope_kv.kv_cache`` as ``cpu.write_kv``
            writes them (:class:`RopeKV`); the same bits as those passes after the plain product.

    Returns:
        ``residual`` when given, else a new ``(M, n)`` (``(M, n/2)`` for ``silu_mul``) tensor.

    Raises:
        ValueError: on a dtype, device, shape or stride the kernel does not take (named with the limit),
            or a slot of ``rope_kv.slot_mapping`` outside the cache (nothing written then).
        RuntimeError: when AMX cannot run in this process (check :func:`available` first).
    """
    y, epilogue = linear_output(x, packed, n, k, bias, residual, silu_mul, out_dtype)
    rope = ()
    if rope_kv is not None:
        if epilogue or out_dtype != torch.bfloat16:
            raise ValueError("rope_kv takes a plain bfloat16 output (no residual, no silu_mul)")
        rope_kv.check(x.shape[0], n)
        epilogue, c = _EPILOGUES["rope_kv"], rope_kv.kv_cache
        rope = (rope_kv.head_dim, rope_kv.num_heads + rope_kv.num_kv_heads, rope_kv.num_kv_heads,
                rope_kv.cos.data_ptr(), rope_kv.sin.data_ptr(), rope_kv.slot_mapping.data_ptr(),
                rope_kv.slot_mapping.shape[0], c.data_ptr(), c.shape[1] * c.shape[2])
    lib = _library()
    if lib is None or not hardware_ready():
        raise RuntimeError(f"AMX GEMM unavailable: {unavailable_reason()}")
    rc = lib.sg_amx_linear(_LinearArgs(  # positional: ctypes builds a struct from keywords ~2x slower
        _LinearArgs.SIZE, x.shape[0], n, k, x.data_ptr(), x.stride(0), packed.data_ptr(),
        None if bias is None else bias.data_ptr(), y.data_ptr(), y.stride(0),
        0 if y.dtype == torch.float32 else 1, epilogue, *rope,
    ))
    if rc == -1 and rope:  # linear_output and RopeKV.check passed: only a slot can be out of range
        c = rope_kv.kv_cache
        raise ValueError(f"a slot in rope_kv.slot_mapping is outside [0, {c.shape[1] * c.shape[2]})")
    _check(rc, "sg_amx_linear")
    return y


def rows_linear(x: torch.Tensor, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``x @ W.T`` rounded to bfloat16, a new ``(M, n)`` tensor, for ``M <= MAX_ROWS_LINEAR`` rows: the
    decode stack's AMX product (each 16-column block of the packed ``(n, k)`` weight streamed once, with
    software prefetch, against every row tile), in its own parallel region; the same bits as
    :func:`linear` without a bias. For the LM head of decode steps of 2-64 rows.

    Args:
        x: ``(M, k)`` bfloat16 on the CPU, rows contiguous. packed: :func:`pack`'s result for ``W``.

    Raises:
        ValueError: on a dtype, device, shape or stride it does not take (named with the limit).
        RuntimeError: when AMX cannot run in this process.
    """
    if packed.dtype != torch.bfloat16 or packed.device.type != "cpu" or not packed.is_contiguous() \
            or packed.shape != (n // 16, k // 32, 16, 32) or n % 16 or k % 32:
        raise ValueError(f"packed must be amx.pack's (n/16, k/32, 16, 32) bfloat16 tensor for n={n}, k={k}, "
                         f"got {tuple(packed.shape)} {packed.dtype}")
    m = x.shape[0] if x.dim() == 2 else 0
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != k \
            or not 1 <= m <= MAX_ROWS_LINEAR or x.stride(1) != 1 or x.stride(0) < k:
        raise ValueError(f"x must be (1 .. {MAX_ROWS_LINEAR}, {k}) bfloat16 on the CPU with contiguous rows, "
                         f"got {tuple(x.shape)} {x.dtype} on {x.device}")
    lib = _library()
    if lib is None or not hardware_ready():
        raise RuntimeError(f"AMX unavailable: {unavailable_reason()}")
    y = torch.empty(m, n, dtype=torch.bfloat16)
    _check(lib.sg_amx_rows_linear(_RowsLinearArgs(
        _RowsLinearArgs.SIZE, m, n, k, x.data_ptr(), x.stride(0), packed.data_ptr(), y.data_ptr(), n,
    )), "sg_amx_rows_linear")
    return y


def peak(iters: int, threads: int) -> None:
    """Run the register-only microkernel: ``threads`` x ``iters`` x 4 tile products of 16 x 16 x 32
    multiply-adds, ``threads * iters * PEAK_FLOPS_PER_ITER`` flops; the caller times it."""
    if iters < 1 or threads < 1:
        raise ValueError(f"iters and threads must be >= 1, got {iters}, {threads}")
    lib = _library()
    if lib is None or not hardware_ready():
        raise RuntimeError(f"AMX unavailable: {unavailable_reason()}")
    _check(lib.sg_amx_peak(_PeakArgs(size=_PeakArgs.SIZE, iters=iters, threads=threads)), "sg_amx_peak")


