"""PyTorch-facing wrappers of the GGUF block-weight kernels (``csrc/segserve_quant.c``).

:func:`linear` is ``sg_linear`` with a :class:`~segserve.kernels.gguf_blocks.QuantWeight`: the same
prologues (RMSNorm, SiLU gate) and epilogues (bias, residual add) as ``cpu.linear``, the weight
dequantized 32 values at a time in registers and never stored. :func:`dequantize` writes rows of a
quantized weight out in float32 or bfloat16 (the embedding lookup; the weight tiles of large steps).
Both check what the C code relies on and raise ``ValueError`` naming the bad value.

Switch: ``SEGSERVE_QUANT=0`` turns these kernels off for the process (callers then dequantize with
``gguf_blocks.dequantize_torch`` and use PyTorch's matmuls); :func:`set_enabled` at run time. They are
also off whenever the compiled CPU kernels are (``cpu.enabled``).

Integer activations: on a CPU with AVX-512 VNNI, a one-row product on 4-bit blocks (the batch-1 decode
step's projections) rounds each 32-value block of its input row to 16-bit fixed point (two int8 halves
under a float32 step, each value off by at most amax(block) / 32512) and takes integer dot products with
the blocks (``csrc/segserve_quant_vnni.c``): ~1.2-1.4x the float kernel there, which is bound by widening
nibbles to floats. Q8_0 stays float (its products are bound by memory: the integer path gains nothing,
measured), and so do products of several rows (the float tiles reuse each dequantized block across rows;
the integer kernel re-reads the weights per row). :func:`int8_formats` is that rule;
``SEGSERVE_QUANT_INT8=0`` (or :func:`set_int8`) turns it off: the float path, weights-only exact.
"""

from __future__ import annotations

import ctypes

import torch

from segserve.kernels import cpu as cpu_kernels
from segserve.kernels.gguf_blocks import FORMATS, QuantWeight
from segserve.kernels.switch import Switch

_P = ctypes.c_void_p
_I = ctypes.c_int32
_L = ctypes.c_int64

_switch = Switch("SEGSERVE_QUANT")
_int8_switch = Switch("SEGSERVE_QUANT_INT8")


@cpu_kernels._sized
class _DequantArgs(ctypes.Structure):
    """``sg_qdequant_args`` (its fields are documented in the C source)."""

    _fields_ = [
        ("size", _L), ("wqt", _I), ("ydt", _I), ("N", _L), ("K", _L), ("w", _P), ("n", _L), ("rows", _P),
        ("r0", _L), ("y", _P), ("ldy", _L),
    ]


_ARGS = {"sg_qdequant": _DequantArgs}


def _library():
    return cpu_kernels.typed(cpu_kernels._library(), _ARGS)


def enabled() -> bool:
    """True when these kernels are switched on and the compiled CPU kernels are on and built."""
    return _switch.on and cpu_kernels.enabled() and _library() is not None


def set_enabled(flag: bool) -> bool:
    """Switch these kernels on or off for this process; returns the previous setting."""
    return _switch.set(flag)


def disabled():
    """``with disabled():`` runs the PyTorch dequantize-then-matmul path."""
    return _switch.off()


def int8_built() -> bool:
    """Whether the compiled library has the int8-activation kernel (it was built for AVX-512 VNNI)."""
    lib = _library()
    return lib is not None and bool(lib.sg_quant_int8_built())


def int8_enabled() -> bool:
    """True when :func:`int8_formats` may pick integer activations: ``SEGSERVE_QUANT_INT8`` and
    :func:`set_int8` leave it on (the default), these kernels are on and the library has the VNNI kernel."""
    return _int8_switch.on and enabled() and int8_built()


# Formats whose one-row products take integer activations (ggml type ids: Q4_0, Q4_1).
INT8_FORMATS = (FORMATS["Q4_0"][0], FORMATS["Q4_1"][0])


def int8_formats(rows: int) -> int:
    """Mask of the GGUF formats (bit ``wqt`` set) whose products of ``rows`` input rows take integer
    activations by default: Q4_0 and Q4_1 when ``rows == 1`` and :func:`int8_enabled`, else none (0).
    The decode stack takes the mask as is; :func:`linear` asks it per weight."""
    if rows != 1 or not int8_enabled():
        return 0
    return sum(1 << t for t in INT8_FORMATS)


def set_int8(flag: bool) -> bool:
    """Switch the integer-activation path on or off for this process; returns the previous setting."""
    return _int8_switch.set(flag)


def unavailable_reason() -> str | None:
    """Why these kernels are off: their switch, or the compiled kernels' reason (None when on)."""
    if not _switch.on:
        return _switch.off_reason()
    return cpu_kernels.unavailable_reason()


def _check_weight(w: QuantWeight) -> None:
    if not isinstance(w, QuantWeight) or w.data.device.type != "cpu":
        raise ValueError(f"weight must be a QuantWeight on the CPU, got {type(w).__name__}")


def linear(
    x: torch.Tensor,
    weight: QuantWeight,
    bias: torch.Tensor | None = None,
    *,
    prologue: str | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    int8: bool | None = None,
) -> torch.Tensor:
    """``prologue(x) @ dequantize(weight).T + bias``, streaming the blocks once for all rows.

    Args:
        x: ``(M, K)`` float32 or bfloat16 (``(M, 2K)`` for ``silu_mul``: gate then up), rows contiguous.
        weight: ``(N, K)`` blocks; any N, K a multiple of 32 (the format's own rule).
        bias: ``(N,)`` in x's dtype, or None.
        prologue, norm_weight, eps, residual: as ``cpu.linear`` (``residual`` ``(M, N)`` in x's dtype,
            updated in place as ``residual += result``, the product rounded to the dtype first).
        out_dtype: dtype of a new output (default x's); float32 for logits.
        int8: round ``prologue(x)`` to 16-bit fixed point per 32-value block first and take integer
            dot products (None: as :func:`int8_formats` picks for this weight and row count).

    Numerics: the weights are the exact dequantized values, multiplied with x in float32 (bfloat16
    x widened exactly) and summed in float32; the result rounded to x's dtype as ``F.linear`` would.
    With ``int8``, x is first rounded per block of 32 to ``(256 q1 + q2) * amax / 127 / 256`` (``q1 =
    round(x * 127 / amax)``, ``q2`` the remainder in 256ths of that step, both int8, nearest even), so
    each output moves by at most ``sum over blocks of amax / 32512 * sum |w|`` from the float result
    (one step: half a step but where a remainder saturates at 127). Meant for a few rows (decode
    steps): each float tile of weights is dequantized once per 8 rows; the integer path streams the
    weights once per row.

    Returns:
        ``(M, N)``: ``residual`` when given, else a new tensor.

    Raises:
        ValueError: on a dtype, device, shape or stride the kernel does not take (named with the limit),
            or ``int8=True`` where the library lacks the VNNI kernel.
    """
    _check_weight(weight)
    n, k = weight.shape
    if int8 is None:
        int8 = bool(int8_formats(x.shape[0] if x.dim() == 2 else 0) >> weight.wqt & 1)
    elif int8 and not int8_built():
        raise ValueError("int8=True needs the AVX-512 VNNI kernel, which this CPU or build lacks")
    dt = cpu_kernels._dtype_code(x, "x")
    if prologue not in cpu_kernels._PROLOGUES:
        raise ValueError(f"prologue must be 'rmsnorm', 'silu_mul' or None, got {prologue!r}")
    if norm_weight is not None and prologue != "rmsnorm":
        raise ValueError("norm_weight is only used with prologue='rmsnorm'")
    if residual is not None and out_dtype is not None:
        raise ValueError("out_dtype is for a new output; a residual is updated in its own dtype")
    cpu_kernels._on_cpu(x=x, norm_weight=norm_weight, bias=bias, residual=residual)
    width = 2 * k if prologue == "silu_mul" else k
    if x.dim() != 2 or x.shape[1] != width or x.stride(1) != 1:
        raise ValueError(
            f"x must be (M, {width}) with contiguous rows, got {tuple(x.shape)} strides {x.stride()}"
        )
    m = x.shape[0]
    if prologue == "rmsnorm" and (
        norm_weight is None or norm_weight.shape != (k,) or norm_weight.dtype != x.dtype
        or not norm_weight.is_contiguous()
    ):
        raise ValueError(f"rmsnorm needs a contiguous ({k},) {x.dtype} norm_weight")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError(f"bias must be ({n},) {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if residual is not None:
        if residual.shape != (m, n) or not residual.is_contiguous() or residual.dtype != x.dtype:
            raise ValueError(f"residual must be a contiguous ({m}, {n}) {x.dtype} tensor, got "
                             f"{tuple(residual.shape)} {residual.dtype}")
        if prologue is None and cpu_kernels._overlap(residual, x):
            raise ValueError("residual must not overlap x (write the product to a new tensor first)")
        y = residual
    else:
        y = torch.empty(m, n, dtype=out_dtype or x.dtype)
    ydt = cpu_kernels._dtype_code(y, "output")
    if m == 0:
        return y
    args = cpu_kernels._LinearArgs(
        size=cpu_kernels._LinearArgs.SIZE, dt=dt, ydt=ydt, M=m, N=n, K=k, x=x.data_ptr(), ldx=x.stride(0),
        prologue=cpu_kernels._PROLOGUES[prologue],
        norm_w=None if norm_weight is None else norm_weight.data_ptr(), eps=eps, w=weight.data.data_ptr(),
        bias=None if bias is None else bias.data_ptr(), y=y.data_ptr(), ldy=n,
        accumulate=residual is not None, wqt=weight.wqt, xq8=bool(int8),
    )
    cpu_kernels._check(_library().sg_linear(args), "sg_linear")
    return y


def dequantize(
    weight: QuantWeight, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None,
    *, start: int = 0, count: int | None = None, out: torch.Tensor | None = None, id_name: str = "row id",
) -> torch.Tensor:
    """Rows of ``weight`` as ``(n, K)`` float32 (exact) or bfloat16 (rounded to nearest even).

    Args:
        weight: the blocks.
        dtype: float32 or bfloat16.
        rows: ``(n,)`` int64 row ids (an embedding lookup), or None for ``count`` rows from ``start``
            (default: all rows).
        out: ``(n, K)`` contiguous tensor of ``dtype`` to write into, or None (a new one).
        id_name: what a row id is called in the error (``"token id"`` for an embedding lookup).

    Raises:
        ValueError: on a row id outside ``[0, N)`` (nothing is written), or a bad dtype or shape.
    """
    _check_weight(weight)
    n_rows, k = weight.shape
    if rows is not None:
        cpu_kernels._on_cpu(rows=rows)
        if rows.dim() != 1 or rows.dtype != torch.int64:
            raise ValueError(f"rows must be a 1-D int64 tensor, got {tuple(rows.shape)} {rows.dtype}")
        rows = rows.contiguous()
        n = rows.shape[0]
    else:
        count = n_rows - start if count is None else count
        if start < 0 or count < 0 or start + count > n_rows:
            raise ValueError(f"rows [{start}, {start + count}) are outside [0, {n_rows})")
        n = count
    if out is None:
        out = torch.empty(n, k, dtype=dtype)
    if out.dtype != dtype or out.shape != (n, k) or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(f"out must be a contiguous ({n}, {k}) {dtype} CPU tensor, got {tuple(out.shape)}")
    ydt = cpu_kernels._dtype_code(out, "out")
    rc = _library().sg_qdequant(_DequantArgs(
        size=_DequantArgs.SIZE, wqt=weight.wqt, ydt=ydt, N=n_rows, K=k, w=weight.data.data_ptr(), n=n,
        rows=None if rows is None else rows.data_ptr(), r0=start, y=out.data_ptr(), ldy=k,
    ))
    if rc == -3:
        raise ValueError(f"a {id_name} is outside [0, {n_rows})")
    cpu_kernels._check(rc, "sg_qdequant")
    return out
