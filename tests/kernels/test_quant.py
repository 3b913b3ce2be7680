"""The GGUF block-weight kernels (csrc/segserve_quant.c) against dequantize-then-matmul.

Oracle: ``gguf.quants.dequantize`` (gguf-py, independent of segserve) for the weights, then PyTorch ops.
Tolerances: dequantization is bitwise (float32: the values are exact; bfloat16: PyTorch's rounding of
them). Products differ from ``F.linear`` on the dequantized weight in float32 summation order only, so
each output is within 1e-5 of ``sum_k |x_k w_k|`` (the float32 dot-product error bound, ``K 2**-24``
of that sum, for K <= 160); bfloat16 outputs are that float32 product rounded once, so additionally
within one bfloat16 ulp (2**-7 relative); with a bfloat16 prologue, within 2**-8 of that sum more (an
input element may round one ulp apart from eager's: the norm sums in another order).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from segserve.kernels import build, quant
from segserve.kernels.gguf_blocks import FORMATS, QuantWeight, dequantize_torch, row_bytes
from segserve.models.llama import RMSNorm

CPU_READY = all(flag in build._cpu_flags() for flag in build.REQUIRED_CPU_FLAGS)
needs_cpu = pytest.mark.skipif(not CPU_READY, reason="CPU lacks AVX-512F / AVX-512 BF16")
QTYPES = sorted(FORMATS)
SUM_REL = 1e-5
BF16_REL = 2**-7


def assert_product_close(got: torch.Tensor, want: torch.Tensor, abs_sum: torch.Tensor, rtol: float = 0.0,
                         sum_rel: float = SUM_REL):
    """``|got - want| <= sum_rel * abs_sum + rtol * |want|`` elementwise (``abs_sum`` = ``|x| @ |W|^T``)."""
    err = (got.float() - want).abs()
    limit = sum_rel * abs_sum + rtol * want.abs()
    worst = (err - limit).max().item()
    assert worst <= 0, f"error exceeds the bound by {worst:.3g} (max error {err.max().item():.3g})"


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> QuantWeight:
    """``(n, k)`` blocks of random bytes with finite random fp16 scales (``d`` ~ 0.05, ``m`` ~ 0.1)."""
    gen = np.random.default_rng(seed)
    nb, bb = k // 32, FORMATS[qtype][1]
    raw = gen.integers(0, 256, size=(n, nb, bb), dtype=np.uint8)
    raw[..., 0:2] = (gen.standard_normal((n, nb, 1)) * 0.05).astype(np.float16).view(np.uint8)
    if qtype == "Q4_1":
        raw[..., 2:4] = (gen.standard_normal((n, nb, 1)) * 0.1).astype(np.float16).view(np.uint8)
    return QuantWeight(torch.from_numpy(raw.reshape(n, nb * bb)), qtype, k)


def gguf_reference(w: QuantWeight) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(w.data.numpy(), GGMLQuantizationType[w.qtype])
    return torch.from_numpy(np.ascontiguousarray(values.reshape(w.shape)))


@pytest.mark.parametrize("qtype", QTYPES)
def test_torch_dequantizer_equals_gguf_bit_for_bit(qtype):
    w = random_blocks(qtype, 7, 96)
    assert torch.equal(dequantize_torch(w), gguf_reference(w))
    assert torch.equal(dequantize_torch(w, torch.bfloat16), gguf_reference(w).bfloat16())


@needs_cpu
@pytest.mark.parametrize("qtype", QTYPES)
def test_compiled_dequantizer_equals_gguf_bit_for_bit(qtype):
    w = random_blocks(qtype, 37, 160, seed=1)
    ref = gguf_reference(w)
    assert torch.equal(quant.dequantize(w), ref)
    assert torch.equal(quant.dequantize(w, torch.bfloat16), ref.bfloat16())
    rows = torch.tensor([36, 0, 5, 5], dtype=torch.int64)
    assert torch.equal(quant.dequantize(w, rows=rows), ref[rows])
    assert torch.equal(quant.dequantize(w, start=3, count=4), ref[3:7])


def _eager_prologue(x: torch.Tensor, prologue: str | None, norm: torch.Tensor | None) -> torch.Tensor:
    if prologue == "rmsnorm":
        m = RMSNorm(x.shape[1], 1e-5)
        m.weight.data = norm
        return m(x)
    if prologue == "silu_mul":
        gate, up = x.chunk(2, dim=1)
        return F.silu(gate).mul_(up)
    return x


@needs_cpu
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(1, 32), (5, 96), (37, 160), (130, 64)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 13])
def test_linear_equals_dequantize_then_matmul(qtype, dtype, n, k, m):
    """Every row count's register tile (1-8, and 13 = a tile of 8 then one of 5), N not a multiple of
    any tile width, K of 1 to 5 blocks."""
    w = random_blocks(qtype, n, k, seed=n + k + m)
    ref_w = gguf_reference(w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    got = quant.linear(x, w, int8=False)  # the float kernel (test_quant_int8.py: the integer one)
    assert got.dtype == dtype and got.shape == (m, n)
    want = F.linear(x.float(), ref_w)
    abs_sum = F.linear(x.float().abs(), ref_w.abs())
    assert_product_close(got, want, abs_sum, 0.0 if dtype == torch.float32 else BF16_REL)


@needs_cpu
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prologue", [None, "rmsnorm", "silu_mul"])
def test_linear_prologues_bias_and_residual(qtype, dtype, prologue):
    n, k, m = 45, 96, 3
    w = random_blocks(qtype, n, k, seed=7)
    ref_w = gguf_reference(w)
    width = 2 * k if prologue == "silu_mul" else k
    x = torch.randn(m, width, generator=torch.Generator().manual_seed(1)).to(dtype)
    norm = (1 + 0.1 * torch.randn(k)).to(dtype) if prologue == "rmsnorm" else None
    bias = torch.randn(n).to(dtype)
    residual = torch.randn(m, n).to(dtype)
    start = residual.clone()
    xin = _eager_prologue(x, prologue, norm)  # in dtype, rounded as the model rounds
    product = F.linear(xin.float(), ref_w) + bias.float()
    abs_sum = F.linear(xin.float().abs(), ref_w.abs())
    got = quant.linear(x, w, bias, prologue=prologue, norm_weight=norm, eps=1e-5, residual=residual,
                       int8=False)
    assert got is residual
    if dtype == torch.float32:
        assert_product_close(got - start, product, abs_sum)
        return
    # bfloat16: the product rounded, then the sum rounded, each within half an ulp of its value; and the
    # prologue's rows may round an element one ulp (2**-8 relative) apart from eager's where its norm
    # sums in another order, which moves the product by up to 2**-8 of sum |x_k w_k|.
    sum_rel = SUM_REL + (2**-8 if prologue else 0.0)
    err = (got.float() - (start.float() + product)).abs()
    limit = sum_rel * abs_sum + 2**-8 * (product.abs() + (start.float() + product).abs())
    assert (err <= limit).all(), f"error exceeds the bound by {(err - limit).max().item():.3g}"


@needs_cpu
def test_linear_logits_in_float32_from_bfloat16_rows():
    w = random_blocks("Q8_0", 300, 64, seed=3)
    x = torch.randn(2, 64).bfloat16()
    got = quant.linear(x, w, out_dtype=torch.float32, int8=False)
    assert got.dtype == torch.float32
    # Rounded to bfloat16 first, as cpu.linear and the model's compute_logits (F.linear, then .float()).
    assert torch.equal(got, got.bfloat16().float())
    ref = gguf_reference(w)
    assert_product_close(got, F.linear(x.float(), ref), F.linear(x.float().abs(), ref.abs()), BF16_REL)


@needs_cpu
def test_bad_input_is_named_and_writes_nothing():
    w = random_blocks("Q4_1", 10, 64)
    with pytest.raises(ValueError, match=r"x must be \(M, 64\)"):
        quant.linear(torch.randn(2, 96), w)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        quant.linear(torch.randn(2, 64).half(), w)
    with pytest.raises(ValueError, match=r"bias must be \(10,\)"):
        quant.linear(torch.randn(2, 64), w, torch.randn(9))
    out = torch.full((3, 64), 7.0)
    with pytest.raises(ValueError, match=r"a row id is outside \[0, 10\)"):
        quant.dequantize(w, rows=torch.tensor([0, 10, 1]), out=out)
    assert torch.equal(out, torch.full((3, 64), 7.0))  # checked before anything was written
    with pytest.raises(ValueError, match=r"rows \[8, 12\) are outside \[0, 10\)"):
        quant.dequantize(w, start=8, count=4)


def test_quant_weight_refuses_data_that_does_not_fit_its_format():
    with pytest.raises(ValueError, match=r"Q4_1 data for 64 values per row must be \(N, 40\) uint8"):
        QuantWeight(torch.zeros(3, 36, dtype=torch.uint8), "Q4_1", 64)
    with pytest.raises(ValueError, match="whole blocks of 32 values; got 48"):
        row_bytes("Q8_0", 48)
    with pytest.raises(ValueError, match="'Q6_K' is not one of"):
        row_bytes("Q6_K", 256)
