"""The float32 GEMM with GGUF block weights (csrc/segserve_f32gemm.c) against a float64 reference.

Oracle: ``gguf.quants.dequantize`` (gguf-py) for the weights, the product in float64. Tolerance: the
kernel sums each output's K exact-weight products in float32 (at most K + 2 roundings: one per
multiply-add, the add of a second k block, the bias), so it is within ``(K + 2) * 2**-24 * sum_k
|x_k w_k| + 2**-24 * |bias|`` of the exact value (the classic recursive-summation bound); one weight
value misplaced or dropped moves an output by about ``sum / K``, hundreds of times that bound.
"""

from __future__ import annotations

import pytest
import torch
from test_quant import QTYPES, gguf_reference, needs_cpu, random_blocks

from segserve.kernels import f32gemm, quant
from segserve.models import quant_linear

pytestmark = needs_cpu
U = 2.0**-24

# (M, N, K): M ragged against the 6-row tile (65 % 6 = 5, ... 603 % 6 = 3), N against the 16- and
# 64-column tiles and the per-thread split, K one k block (96, 576) or two uneven ones (800 = 416 + 384,
# 1536 = 768 + 768); N = 577 spans several packed column blocks per thread.
SHAPES = [(65, 100, 96), (68, 577, 576), (100, 33, 800), (131, 16, 1536), (603, 161, 576)]


def reference(x: torch.Tensor, w, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact product in float64 and its tolerance (see the module docstring)."""
    wd = gguf_reference(w).double()
    want = x.double() @ wd.T
    tol = (w.shape[1] + 2) * U * (x.double().abs() @ wd.abs().T)
    if bias is not None:
        want += bias.double()
        tol += U * bias.double().abs()
    return want, tol


def assert_within(got: torch.Tensor, want: torch.Tensor, tol: torch.Tensor) -> None:
    excess = ((got.double() - want).abs() - tol).max().item()
    assert excess <= 0, f"error exceeds the bound by {excess:.3g}"


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_equals_the_float64_product_within_the_summation_bound(qtype, m, n, k, with_bias):
    gen = torch.Generator().manual_seed(m * n + k)
    w = random_blocks(qtype, n, k, seed=m + n)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    want, tol = reference(x, w, bias)
    assert_within(f32gemm.matmul(x, w, bias), want, tol)


@pytest.mark.parametrize("n", [577, 100])  # several column blocks per thread; one block (idle owners steal)
def test_thread_count_does_not_change_a_bit(n):
    """Each output's summation order is fixed by K alone, not by which thread computes it."""
    w = random_blocks("Q4_1", n, 576, seed=3)
    x = torch.randn(130, 576, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    got = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            got.append(f32gemm.matmul(x, w))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(got[0], g) for g in got[1:])
    want, tol = reference(x, w, None)
    assert_within(got[0], want, tol)


def test_strided_rows_and_out_are_honoured():
    w = random_blocks("Q8_0", 70, 64, seed=4)
    base = torch.randn(90, 100, generator=torch.Generator().manual_seed(4))
    x = base[:, 10:74]  # row stride 100
    out = torch.full((90, 80), 7.0)
    got = f32gemm.matmul(x, w, out=out[:, :70])
    want, tol = reference(x, w, None)
    assert_within(got, want, tol)
    assert torch.equal(out[:, 70:], torch.full((90, 10), 7.0))  # nothing written past the columns


def test_quantized_matmul_takes_the_gemm_above_small_rows_and_matches_the_old_path(monkeypatch):
    w = random_blocks("Q4_1", 96, 128, seed=5)
    rows = quant_linear.SMALL_ROWS[torch.float32] + 1
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(5))
    bias = torch.randn(96)
    calls = []
    real = f32gemm.matmul
    monkeypatch.setattr(f32gemm, "matmul", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    new = quant_linear.quantized_matmul(x, w, bias)
    with f32gemm.disabled():
        old = quant_linear.quantized_matmul(x, w, bias)
    assert calls == [1]
    want, tol = reference(x, w, bias)
    assert_within(new, want, tol)
    assert_within(old, want, tol)
    small = x[: quant_linear.SMALL_ROWS[torch.float32]]
    quant_linear.quantized_matmul(small, w)
    assert calls == [1]  # a few rows stay on the register-dequantizing kernel


def test_switch_follows_the_block_kernels():
    assert f32gemm.enabled() == quant.enabled()
    with f32gemm.disabled():
        assert not f32gemm.enabled() and "SEGSERVE_F32GEMM" in f32gemm.unavailable_reason()
    with quant.disabled():
        assert not f32gemm.enabled()


@pytest.mark.parametrize("bad,match", [
    (lambda x, w: (x.to(torch.bfloat16), w, None), "float32"),
    (lambda x, w: (x[:, :32], w, None), r"\(M, 64\)"),
    (lambda x, w: (x, w, torch.zeros(3)), "bias"),
    (lambda x, w: (x[:1].expand(70, 64), w, None), "float32 with contiguous rows"),  # rows not apart
])
def test_bad_input_is_named(bad, match):
    w = random_blocks("Q4_0", 8, 64)
    with pytest.raises(ValueError, match=match):
        f32gemm.matmul(*bad(torch.randn(70, 64), w))


def test_out_overlapping_x_is_refused():
    w = random_blocks("Q4_0", 64, 64)
    x = torch.randn(70, 64)
    with pytest.raises(ValueError, match="overlap"):
        f32gemm.matmul(x, w, out=x)
