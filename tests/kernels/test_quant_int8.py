"""The integer-activation GGUF kernel (csrc/segserve_quant_vnni.c, ``quant.linear(..., int8=True)``).

Two oracles:

- an emulation in PyTorch of what the kernel computes: each 32-value block of the (prologue's) input
  row rounded to 16-bit fixed point, ``q1 = round_half_even(x * float32(127 / amax))``, the remainder
  ``float32(x - s q1)`` (``s = float32(amax / 127)``, one rounding as the FMA) rounded to ``q2 =
  round(r * float32(32512 / amax))`` saturated to int8, the value ``(256 q1 + q2) * s / 256``; times
  the exact dequantized weights (``gguf.quants.dequantize``), summed in float64. The kernel's integer
  sums are exact, so it differs from this only by float32 rounding of the block scales and the sum over
  blocks: within ``1e-5 * sum |x_q w|`` (the float32 bound used for the float kernel in test_quant.py)
  plus one bfloat16 ulp for bfloat16 outputs;
- dequantize-then-matmul on the exact x: the rounding moves each input by at most one step
  (``amax_b / 32512`` in block ``b``; half a step but where a remainder saturates), so an output is
  within ``sum_b amax_b / 32512 * sum_{k in b} |w_k|`` of it (plus the float32 bound above): what the
  integer path gives up, stated per output, 128 times less than 8-bit activations would.

Shapes: block counts odd and even (an odd last block is paired with zeros), weight rows not a multiple
of the tile, 1-8 rows and 13.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/kernels, for test_quant's helpers
from test_quant import BF16_REL, SUM_REL, _eager_prologue, gguf_reference, random_blocks  # noqa: E402

from segserve.kernels import build, quant  # noqa: E402
from segserve.kernels.switch import env_on  # noqa: E402

VNNI = all(f in build._cpu_flags() for f in (*build.REQUIRED_CPU_FLAGS, "avx512_vnni"))
needs_vnni = pytest.mark.skipif(not VNNI, reason="CPU lacks AVX-512 VNNI")
QTYPES = ("Q4_0", "Q4_1", "Q8_0")


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """``(M, K)`` float32 -> the values the kernel multiplies: ``(256 q1 + q2) * s / 256`` per block of 32."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    live = amax > 0
    inv = torch.where(live, 127.0 / amax, torch.zeros_like(amax))  # float32, as the kernel
    inv2 = torch.where(live, 32512.0 / amax, torch.zeros_like(amax))
    s = amax / 127  # float32
    q1 = (blocks * inv).round()  # half to even, as vcvtps2dq
    r = (blocks.double() - s.double() * q1.double()).float()  # the FMA's one rounding
    q2 = (r * inv2).round().clamp(-128, 127)  # vpmovsdb saturates
    return ((256 * q1.double() + q2.double()) * (s.double() / 256)).reshape(x.shape)


def int8_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``(M, N)``: ``sum_b amax_b / 32512 * sum_{k in b} |w_k|``, the most the rounding moves an output."""
    m, k = x.shape
    amax = x.float().abs().reshape(m, k // 32, 32).amax(-1).double()  # (M, nb)
    wsum = w.double().abs().reshape(w.shape[0], k // 32, 32).sum(-1)  # (N, nb)
    return (amax / 32512) @ wsum.T


def check(got: torch.Tensor, x: torch.Tensor, w, bf16_out: bool = False) -> None:
    """``got`` ``(M, N)`` = the int8 kernel's ``x @ dequantize(w).T``, checked against both oracles."""
    wd = gguf_reference(w).double()
    xq, xd = int8_rows(x), x.double()
    emulated = xq @ wd.T
    abs_sum = xq.abs() @ wd.abs().T
    rtol = BF16_REL if bf16_out else 0.0
    err = (got.double() - emulated).abs()
    limit = SUM_REL * abs_sum + rtol * emulated.abs()
    assert (err <= limit).all(), f"off the int8 emulation by {(err - limit).max().item():.3g}"
    exact = xd @ wd.T
    limit = int8_bound(x, wd) + SUM_REL * (xd.abs() @ wd.abs().T) + rtol * exact.abs()
    err = (got.double() - exact).abs()
    assert (err <= limit).all(), f"off dequantize-then-matmul beyond the bound by {(err - limit).max():.3g}"


@needs_vnni
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n,k", [(1, 32), (5, 96), (37, 160), (130, 64), (9, 224), (17, 1088)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 13])
def test_int8_linear_matches_its_emulation_and_the_stated_bound(qtype, n, k, m):
    w = random_blocks(qtype, n, k, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    check(quant.linear(x, w, int8=True), x, w)


@needs_vnni
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("prologue", [None, "rmsnorm", "silu_mul"])
def test_int8_prologues_bias_residual_and_bfloat16(qtype, prologue):
    n, k, m = 21, 160, 3
    w = random_blocks(qtype, n, k, seed=7)
    wd = gguf_reference(w).double()
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(m, 2 * k if prologue == "silu_mul" else k, generator=g).to(dtype)
        norm = (torch.rand(k, generator=g) + 0.5).to(dtype) if prologue == "rmsnorm" else None
        bias = torch.randn(n, generator=g).to(dtype)
        residual = torch.randn(m, n, generator=g).to(dtype)
        start = residual.clone()
        quant.linear(x, w, bias, prologue=prologue, norm_weight=norm, eps=1e-5, residual=residual, int8=True)
        xin = _eager_prologue(x, prologue, norm)  # (m, k) in dtype, as the kernel's prologue rounds
        product = (residual.double() - start.double() - bias.double()).to(torch.float32)
        # bfloat16: the product, the bias add and the residual add are each rounded once (3 ulps).
        if dtype == torch.float32:
            check(product, xin, w)
        else:
            got, xq = residual.double(), int8_rows(xin)
            want = start.double() + bias.double() + xq @ wd.T
            scale = start.double().abs() + bias.double().abs() + xq.abs() @ wd.abs().T
            assert ((got - want).abs() <= 3 * BF16_REL * scale + 1e-6).all()


@needs_vnni
def test_a_block_of_zeros_contributes_nothing_and_the_logits_shape_is_float32():
    w = random_blocks("Q4_1", 11, 96, seed=2)
    x = torch.zeros(2, 96)
    x[1, 40:50] = torch.linspace(-3, 3, 10)  # row 0: every block zero; row 1: blocks 0 and 2 zero
    x = x.bfloat16().float()  # the values the bfloat16 input holds
    got = quant.linear(x.bfloat16(), w, out_dtype=torch.float32, int8=True)
    assert got.dtype == torch.float32
    assert torch.equal(got[0], torch.zeros(11))
    check(got, x, w, bf16_out=True)  # a bfloat16 step rounds its products to bfloat16, logits too


@needs_vnni
def test_one_row_4bit_products_take_the_integer_path_by_default_and_the_rest_stay_float():
    """The default rule (quant.int8_formats): on for one-row Q4_0 / Q4_1 products, float for Q8_0 and
    for several rows; the switch off gives the float kernels' results bit for bit."""
    if "SEGSERVE_QUANT_INT8" not in os.environ:
        assert quant.int8_enabled() and env_on("SEGSERVE_QUANT_INT8")
    old = quant.set_int8(True)
    try:
        assert quant.int8_formats(1) == (1 << 2) | (1 << 3)  # ggml ids: Q4_0 = 2, Q4_1 = 3
        assert quant.int8_formats(2) == 0 and quant.int8_formats(64) == 0
        g = torch.Generator().manual_seed(0)
        for qtype, rows, integer in (("Q4_1", 1, True), ("Q4_0", 1, True), ("Q8_0", 1, False),
                                     ("Q4_1", 4, False)):
            w = random_blocks(qtype, 37, 160, seed=5)
            x = torch.randn(rows, 160, generator=g)
            on = quant.linear(x, w)
            assert torch.equal(on, quant.linear(x, w, int8=integer)), (qtype, rows)
            assert not torch.equal(quant.linear(x, w, int8=True), quant.linear(x, w, int8=False))
        quant.set_int8(False)
        assert not quant.int8_enabled() and quant.int8_formats(1) == 0
        w = random_blocks("Q4_1", 37, 160, seed=5)
        x = torch.randn(1, 160, generator=g)
        assert torch.equal(quant.linear(x, w), quant.linear(x, w, int8=False))
    finally:
        quant.set_int8(old)


def test_int8_refused_by_name_where_the_library_lacks_vnni(monkeypatch):
    monkeypatch.setattr(quant, "int8_built", lambda: False)
    assert not quant.int8_enabled()
    w = random_blocks("Q8_0", 4, 32)
    with pytest.raises(ValueError, match="AVX-512 VNNI"):
        quant.linear(torch.randn(1, 32), w, int8=True)
