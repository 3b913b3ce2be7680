"""The AMX bfloat16 GEMM (segserve/kernels/amx.py) against a float32 reference of the same bf16 inputs.

Tolerance: the kernel multiplies bf16 pairs exactly and sums in float32, so it differs from the float32
reference (``x.float() @ w.float().T``) only in summation order and the final rounding: a bfloat16 output
is within one bfloat16 ulp of the reference, a float32 output within ``K * 2**-24 * (|x| @ |w|.T)`` (the
float32 summation bound, twice: ours and the reference's). The epilogues are checked against the eager
ops applied to the kernel's own plain output: the residual add bitwise, the SiLU gate within one bf16
ulp (its exp is a polynomial within ~1 ulp of PyTorch's).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from segserve.kernels import amx
from segserve.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(
    not amx.available(), reason=f"AMX GEMM unavailable: {amx.unavailable_reason()}"
)

# SmolLM2-135M's projections (N, K): fused qkv, o, fused gate|up, down.
MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
ROWS = [1, 15, 16, 17, 100, 512, 2050]


def _inputs(m: int, n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (0.05 * torch.randn(n, k, generator=gen)).bfloat16()
    return x, w


def _bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """One bfloat16 ulp at each |v| (8 significant bits), at least that of the smallest normal."""
    e = torch.floor(torch.log2(v.abs().clamp_min(2.0**-126)))
    return torch.exp2(e - 7)


def _summation_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return 2 * x.shape[1] * 2.0**-24 * (x.float().abs() @ w.float().abs().T)


@pytest.mark.parametrize("n, k", MODEL_SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_bf16_output_within_one_ulp_of_the_float32_reference(m: int, n: int, k: int) -> None:
    x, w = _inputs(m, n, k)
    ref = x.float() @ w.float().T
    packed = amx.pack(w)
    got = amx.linear(x, packed, n, k)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    diff = (got.float() - ref).abs()
    assert (diff <= _bf16_ulp(ref) + _summation_bound(x, w)).all(), diff.max()


@pytest.mark.parametrize("n, k", MODEL_SHAPES)
@pytest.mark.parametrize("m", [1, 17, 512])
def test_float32_output_within_summation_order(m: int, n: int, k: int) -> None:
    x, w = _inputs(m, n, k, seed=1)
    ref = x.float() @ w.float().T
    got = amx.linear(x, amx.pack(w), n, k, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    assert ((got - ref).abs() <= _summation_bound(x, w)).all()


def test_bias_and_strided_rows() -> None:
    m, n, k = 37, 96, 128
    x, w = _inputs(m, n, k, seed=2)
    wide = torch.zeros(m, k + 64, dtype=torch.bfloat16)
    wide[:, 16:16 + k] = x
    xs = wide[:, 16:16 + k]  # rows of stride k + 64
    bias = torch.randn(n).bfloat16()
    ref = x.float() @ w.float().T + bias.float()
    got = amx.linear(xs, amx.pack(w), n, k, bias)
    assert ((got.float() - ref).abs() <= _bf16_ulp(ref) + _summation_bound(x, w)).all()


@pytest.mark.parametrize("epilogue", ["plain", "bias", "residual", "silu_mul", "float32"])
@pytest.mark.parametrize("n, k", [(960, 576), (3072, 576), (576, 1536), (96, 64)])
def test_every_row_equals_the_same_row_computed_alone(epilogue: str, n: int, k: int) -> None:
    """Each output row is the same whatever rows share the call: the stores of one microkernel are
    deferred into the next one's K loop (and across panels, cache chunks and the last, overlapping
    row tile), so a store dropped, doubled or sent to the wrong row would show here bitwise. Each
    row's products are summed in the same K order in any tiling, hence exact equality."""
    m = 2050  # 128 row tiles + an overlapping last one; 2050 = 1 + 17 + 2032 splits below
    x, w = _inputs(m, n, k, seed=6)
    w = w * 20 if epilogue == "silu_mul" else w
    packed = amx.pack(w)
    bias = torch.randn(n).bfloat16() if epilogue == "bias" else None
    h = torch.randn(m, n).bfloat16()

    def run(rows: slice) -> torch.Tensor:
        if epilogue == "residual":
            return amx.linear(x[rows], packed, n, k, residual=h[rows].clone())
        return amx.linear(x[rows], packed, n, k, bias, silu_mul=epilogue == "silu_mul",
                          out_dtype=torch.float32 if epilogue == "float32" else torch.bfloat16)

    whole = run(slice(0, m))
    parts = torch.cat([run(slice(0, 1)), run(slice(1, 18)), run(slice(18, m))])
    assert torch.equal(whole, parts)
    assert torch.equal(whole[5:6], run(slice(5, 6)))
    if epilogue == "residual":  # and it did add to h's rows
        plain = amx.linear(x, packed, n, k)
        assert torch.equal(whole, h.clone().add_(plain))


@pytest.mark.parametrize("m", [3, 16, 45, 300])
def test_residual_epilogue_is_the_eager_add_of_the_plain_output(m: int) -> None:
    n, k = 576, 576
    x, w = _inputs(m, n, k, seed=3)
    packed = amx.pack(w)
    h = torch.randn(m, n).bfloat16()
    want = h.clone().add_(amx.linear(x, packed, n, k))
    got = amx.linear(x, packed, n, k, residual=h)
    assert got is h
    assert torch.equal(got, want)


@pytest.mark.parametrize("m", [5, 16, 33, 300])
def test_silu_mul_epilogue_is_the_eager_gate_of_the_plain_output(m: int) -> None:
    inter, k = 1536, 576
    x, w = _inputs(m, 2 * inter, k, seed=4)
    w = w * 20  # gate values over a few units, where SiLU bends
    packed = amx.pack(w)
    gate, up = amx.linear(x, packed, 2 * inter, k).split(inter, dim=-1)
    want = F.silu(gate).mul_(up)
    got = amx.linear(x, packed, 2 * inter, k, silu_mul=True)
    assert got.shape == (m, inter)
    assert ((got.float() - want.float()).abs() <= _bf16_ulp(want.float())).all()


def test_pack_is_the_documented_tile_layout() -> None:
    n, k = 32, 64
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k).bfloat16()
    packed = amx.pack(w)
    assert packed.shape == (n // 16, k // 32, 16, 32)
    nb, ks, r, c = 1, 1, 5, 7  # tile (nb, ks), row r (K pair), output column c
    assert packed[nb, ks, r, 2 * c] == w[nb * 16 + c, ks * 32 + 2 * r]
    assert packed[nb, ks, r, 2 * c + 1] == w[nb * 16 + c, ks * 32 + 2 * r + 1]


@pytest.mark.parametrize("n, k, pad", [(32, 64, 0), (960, 576, 0), (48, 96, 40), (3072, 576, 0)])
def test_pack_equals_the_layout_everywhere(n: int, k: int, pad: int) -> None:
    """Every value of the vectorised pack (a 32-bit 16 x 16 transpose per tile) against the layout
    written as a torch permutation, row-strided weights included (``pad`` extra columns)."""
    wide = torch.randn(n, k + pad, generator=torch.Generator().manual_seed(9)).bfloat16()
    w = wide[:, :k]
    want = w.reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).reshape(n // 16, k // 32, 16, 32)
    assert torch.equal(amx.pack(w), want)


@pytest.mark.parametrize("shape", [(40, 576), (576, 48), (0, 64)])
def test_pack_refuses_shapes_it_cannot_tile(shape) -> None:
    with pytest.raises(ValueError, match=r"N % 16 == 0 and K % 32 == 0"):
        amx.pack(torch.zeros(shape, dtype=torch.bfloat16))


def test_pack_refuses_other_dtypes_and_strided_rows() -> None:
    with pytest.raises(ValueError, match="bfloat16"):
        amx.pack(torch.zeros(32, 64))
    with pytest.raises(ValueError, match="strides"):
        amx.pack(torch.zeros(64, 32, dtype=torch.bfloat16).T)


def test_linear_refuses_bad_inputs_naming_them() -> None:
    n, k = 64, 96
    x, w = _inputs(4, n, k)
    packed = amx.pack(w)
    bad = [
        (dict(x=x.float()), "x must be"),
        (dict(x=x[:, :64]), r"x must be \(M >= 1, 96\)"),
        (dict(x=x[:0]), "M >= 1"),
        (dict(x=torch.zeros(k, 4, dtype=torch.bfloat16).T), "contiguous rows"),
        (dict(packed=packed.reshape(-1)), "packed must be"),
        (dict(n=32), "packed must be"),
        (dict(bias=torch.zeros(n)), r"bias must be a contiguous \(64,\) bfloat16"),
        (dict(residual=torch.zeros(4, n)), r"residual must be a contiguous \(4, 64\) bfloat16"),
        (dict(silu_mul=True, residual=torch.zeros(4, n, dtype=torch.bfloat16)), "cannot be combined"),
        (dict(out_dtype=torch.float16), "out_dtype"),
        (dict(out_dtype=torch.float32, silu_mul=True), "out_dtype"),
    ]
    for change, message in bad:
        kw = dict(x=x, packed=packed, n=n, k=k) | change
        args = (kw.pop("x"), kw.pop("packed"), kw.pop("n"), kw.pop("k"))
        with pytest.raises(ValueError, match=message):
            amx.linear(*args, **kw)
    with pytest.raises(ValueError, match="silu_mul needs n = 2 I"):
        w48 = _inputs(1, 48, k)[1]
        amx.linear(x, amx.pack(w48), 48, k, silu_mul=True)


def test_switch_and_peak() -> None:
    amx.peak(10, 1)
    with pytest.raises(ValueError, match="iters and threads"):
        amx.peak(0, 1)
    old = amx.set_enabled(False)
    try:
        assert not amx.available() and "switched off" in amx.unavailable_reason()
    finally:
        amx.set_enabled(old)
    assert amx.available() and amx.unavailable_reason() is None
    with cpu_kernels.disabled():
        assert not amx.available()
