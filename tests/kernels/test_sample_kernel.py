"""The compiled sampler (csrc/segserve_sample.c) against the PyTorch path of segserve/worker/sampler.py.

Oracle: the PyTorch filters (``_filtered_probs``, themselves checked against a full-sort reference in
tests/unit/test_sampler.py) and inverse transform sampling over their float64 cumulative sums. The kept
token sets must be equal; given the same uniform both must draw the same token: the two sums differ only
by rounding (~1e-16 relative), so a uniform that lands between their two boundaries has a chance of
~1e-13 a draw, and the draws here are fixed by seeds.
"""

from __future__ import annotations

import pytest
import torch

from segserve.kernels import build
from segserve.kernels import cpu as cpu_kernels
from segserve.kernels import sample as sample_kernels
from segserve.sampling_params import SamplingParams
from segserve.worker.sampler import _filtered_probs, draw

pytestmark = pytest.mark.skipif(not all(f in build._cpu_flags() for f in build.REQUIRED_CPU_FLAGS),
                                reason="CPU lacks AVX-512F / AVX-512 BF16")

PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.5, top_k=40, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.3, top_k=1),
    SamplingParams(temperature=2.0, top_k=2000),  # past the small-k buffer: every logit is a candidate
    SamplingParams(temperature=1.0, top_p=0.999),
]


def _kernel(logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor,
            kept: torch.Tensor | None = None) -> list[int]:
    return sample_kernels.sample_rows(logits, [p.temperature for p in params], [p.top_k for p in params],
                                      [p.top_p for p in params], [p.min_p for p in params], u, kept)


def _torch_draw(logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> list[int]:
    with cpu_kernels.disabled():
        return draw(logits, params, u)


def _rows(vocab: int, seed: int) -> torch.Tensor:
    """(len(PARAMS), vocab) logits: random rows, and a flat one whose nucleus is most of the vocabulary."""
    logits = torch.randn(len(PARAMS), vocab, generator=torch.Generator().manual_seed(seed)) * 3.0
    logits[-1] = torch.linspace(0.0, 0.5, vocab)
    return logits


@pytest.mark.parametrize("vocab", [5, 1003, 4096, 49152])
def test_kernel_keeps_and_draws_what_the_pytorch_path_does(vocab: int) -> None:
    logits = _rows(vocab, seed=vocab)
    kept = torch.empty_like(logits)
    gen = torch.Generator().manual_seed(1)
    for _ in range(40):
        u = torch.rand(len(PARAMS), dtype=torch.float64, generator=gen)
        assert _kernel(logits, PARAMS, u, kept) == _torch_draw(logits, PARAMS, u)
    reference = _filtered_probs(logits, PARAMS)
    assert torch.equal(kept > 0, reference > 0)
    # Unnormalized weights: the top token's is 1, the others its probability ratio to the top one.
    top = reference.amax(dim=-1, keepdim=True)
    assert torch.allclose(kept, torch.where(reference > 0, reference / top, 0.0), rtol=1e-5, atol=0)
    assert kept[0].count_nonzero() == vocab  # no filter: nothing dropped


def test_draws_walk_every_block_and_strided_rows_read_the_same() -> None:
    """u spread over [0, 1) on a flat row lands in each 1,024-token block; a row view of a wider tensor
    (stride > V) draws as its contiguous copy does."""
    vocab = 5000
    wide = torch.zeros(3, vocab + 37)
    rows = wide[:, :vocab]
    params = [SamplingParams(temperature=1.0)] * 3
    for j in range(20):
        u = torch.tensor([j / 20, (j + 0.5) / 20, 0.999999], dtype=torch.float64)
        got = _kernel(rows, params, u)
        assert got == _kernel(rows.contiguous(), params, u)
        # a uniform row: token floor(u V), up to the float sum's rounding at a boundary
        assert [abs(t - int(x * vocab)) <= 1 for t, x in zip(got, u.tolist(), strict=True)] == [True] * 3


def test_masked_logits_are_never_drawn() -> None:
    logits = torch.full((4, 100), float("-inf"))
    logits[0, 37] = 0.0  # one allowed token: every u gives it
    logits[1, ::2] = 1.0  # the even tokens allowed
    logits[2, 5] = float("nan")  # a NaN and -inf everywhere else: nothing kept, argmax's rule (index 0)
    logits[3, 9] = float("inf")  # +inf wins outright, as argmax would
    params = [SamplingParams(temperature=1.0)] * 4
    for u0 in (0.0, 0.5, 1.0 - 2.0**-53):
        u = torch.full((4,), u0, dtype=torch.float64)
        got = _kernel(logits, params, u)
        assert got[0] == 37 and got[1] % 2 == 0 and got[2:] == [0, 9]
        assert _torch_draw(logits[:2], params[:2], u[:2])[0] == 37


def test_ties_at_the_top_k_floor_stay_and_top_p_ties_go_in_index_order() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0], [0.0] * 6])
    kept = torch.empty_like(logits)
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.5)]
    _kernel(logits, params, torch.zeros(2, dtype=torch.float64), kept)
    # top-2 keeps 3.0 and every 2.0 (ties at the k-th stay); a uniform top-p 0.5 over 6 keeps the first
    # three: the mass before each is 0, 1/6, 2/6 < 1/2, then 3/6 is not below it.
    assert (kept > 0).tolist() == [[True, False, True, True, True, False], [True] * 3 + [False] * 3]


def test_empirical_distribution_of_a_filtered_row() -> None:
    n = 20_000
    base = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    params = SamplingParams(temperature=1.0, top_k=4, top_p=0.9)
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    got = _kernel(base.expand(n, 6).contiguous(), [params] * n, u)
    freq = torch.bincount(torch.tensor(got), minlength=6).double() / n
    expected = _filtered_probs(base.unsqueeze(0), [params])[0].double()
    expected /= expected.sum()
    assert expected[3] == 0 and expected[4] == 0  # top-p dropped the fourth (top-k the last two)
    # binomial standard error at most sqrt(0.25 / 20000) = 0.0035; 0.02 is ~5.7 sigma
    assert torch.allclose(freq, expected, atol=0.02), (freq, expected)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("temperature", 0.0, "temperature or uniform"),
    ("u", 1.0, "temperature or uniform"),
    ("u", -0.1, "temperature or uniform"),
])
def test_the_kernel_refuses_a_zero_temperature_or_a_uniform_outside_0_1(field, value, message) -> None:
    logits = torch.zeros(2, 8)
    temps, u = [1.0, 1.0], torch.tensor([0.5, 0.5], dtype=torch.float64)
    if field == "temperature":
        temps[1] = value
    else:
        u[1] = value
    with pytest.raises(RuntimeError, match=message):
        sample_kernels.sample_rows(logits, temps, [0, 0], [1.0, 1.0], [0.0, 0.0], u)


def test_the_wrapper_names_a_bad_argument() -> None:
    u = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="float32"):
        sample_kernels.sample_rows(torch.zeros(2, 8, dtype=torch.bfloat16), [1.0] * 2, [0] * 2, [1.0] * 2,
                                   [0.0] * 2, u)
    with pytest.raises(ValueError, match="contiguous columns"):
        sample_kernels.sample_rows(torch.zeros(8, 2).t(), [1.0] * 2, [0] * 2, [1.0] * 2, [0.0] * 2, u)
    with pytest.raises(ValueError, match="top_p has 1 values for 2 rows"):
        sample_kernels.sample_rows(torch.zeros(2, 8), [1.0] * 2, [0] * 2, [1.0], [0.0] * 2, u)
    with pytest.raises(ValueError, match=r"u must be \(2,\) contiguous float64"):
        sample_kernels.sample_rows(torch.zeros(2, 8), [1.0] * 2, [0] * 2, [1.0] * 2, [0.0] * 2,
                                   torch.zeros(2))
