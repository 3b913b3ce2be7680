"""The compiled sampler (csrc/segserve_sample.c) against the PyTorch path of segserve/worker/sampler.py.

Oracle: the PyTorch filters (``_filtered_probs``, themselves checked against a full-sort reference in
tests/unit/test_sampler.py) and the race over ``race_noise``'s hashed exponentials. The kept token sets
must be equal, and given the same key both must draw the same token: the two differ only in rounding
(the kernel's weights are the softmax unnormalized, its log a polynomial within ~1 ulp), which can move
a draw only where two tokens' p / q tie to ~1e-7, and the draws here are fixed by seeds.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from segserve.kernels import build
from segserve.kernels import cpu as cpu_kernels
from segserve.kernels import sample as sample_kernels
from segserve.sampling_params import SamplingParams
from segserve.worker.sampler import _filtered_probs, draw, race_noise

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


def _kernel(logits: torch.Tensor, params: list[SamplingParams], keys: torch.Tensor,
            kept: torch.Tensor | None = None) -> list[int]:
    return sample_kernels.sample_rows(logits, [p.temperature for p in params], [p.top_k for p in params],
                                      [p.top_p for p in params], [p.min_p for p in params], keys, kept)


def _torch_draw(logits: torch.Tensor, params: list[SamplingParams], keys: torch.Tensor) -> list[int]:
    with cpu_kernels.disabled():
        return draw(logits, params, keys)


def _keys(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-2**63, 2**63 - 1, (n,), dtype=torch.int64, generator=gen)


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
        keys = _keys(len(PARAMS), gen)
        assert _kernel(logits, PARAMS, keys, kept) == _torch_draw(logits, PARAMS, keys)
    reference = _filtered_probs(logits, PARAMS)
    assert torch.equal(kept > 0, reference > 0)
    # Unnormalized weights: the top token's is 1, the others its probability ratio to the top one.
    top = reference.amax(dim=-1, keepdim=True)
    assert torch.allclose(kept, torch.where(reference > 0, reference / top, 0.0), rtol=1e-5, atol=0)
    assert kept[0].count_nonzero() == vocab  # no filter: nothing dropped


def test_the_kernels_noise_is_race_noise_and_strided_rows_read_the_same() -> None:
    """On a flat row every weight is 1, so the winner is the token of least noise: the kernel must hash
    exactly what ``race_noise`` computes (ties in the 23-bit uniforms go to the lowest id in both). A row
    view of a wider tensor (stride > V) draws as its contiguous copy does."""
    vocab = 5000
    wide = torch.zeros(3, vocab + 37)
    rows = wide[:, :vocab]
    params = [SamplingParams(temperature=1.0)] * 3
    gen = torch.Generator().manual_seed(2)
    for _ in range(20):
        keys = _keys(3, gen)
        got = _kernel(rows, params, keys)
        assert got == _kernel(rows.contiguous(), params, keys)
        assert got == race_noise(keys, vocab).argmin(dim=-1).tolist()
    assert race_noise(torch.tensor([0, -1, 2**62]), 7).shape == (3, 7)


def test_masked_logits_are_never_drawn() -> None:
    logits = torch.full((5, 100), float("-inf"))
    logits[0, 37] = 0.0  # one allowed token: every key gives it
    logits[1, ::2] = 1.0  # the even tokens allowed
    logits[2, 5] = float("nan")  # a NaN and -inf everywhere else: nothing kept, argmax's answer (the NaN)
    logits[3, 9] = float("inf")  # +inf wins outright, as argmax would
    logits[4] = 0.0
    logits[4, 60] = float("nan")  # a NaN among finite logits: argmax's answer too, in both paths
    params = [SamplingParams(temperature=1.0)] * 5
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        keys = _keys(5, gen)
        got = _kernel(logits, params, keys)
        assert got[0] == 37 and got[1] % 2 == 0 and got[2:] == [5, 9, 60]
        assert _torch_draw(logits, params, keys) == got


def test_ties_at_the_top_k_floor_stay_and_top_p_ties_go_in_index_order() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0], [0.0] * 6])
    kept = torch.empty_like(logits)
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.5)]
    _kernel(logits, params, torch.zeros(2, dtype=torch.int64), kept)
    # top-2 keeps 3.0 and every 2.0 (ties at the k-th stay); a uniform top-p 0.5 over 6 keeps the first
    # three: the mass before each is 0, 1/6, 2/6 < 1/2, then 3/6 is not below it.
    assert (kept > 0).tolist() == [[True, False, True, True, True, False], [True] * 3 + [False] * 3]


def test_empirical_distribution_of_a_filtered_row() -> None:
    n = 20_000
    base = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    params = SamplingParams(temperature=1.0, top_k=4, top_p=0.9)
    keys = _keys(n, torch.Generator().manual_seed(5))
    got = _kernel(base.expand(n, 6).contiguous(), [params] * n, keys)
    freq = torch.bincount(torch.tensor(got), minlength=6).double() / n
    expected = _filtered_probs(base.unsqueeze(0), [params])[0].double()
    expected /= expected.sum()
    assert expected[3] == 0 and expected[4] == 0  # top-p dropped the fourth (top-k the last two)
    # binomial standard error at most sqrt(0.25 / 20000) = 0.0035; 0.02 is ~5.7 sigma
    assert torch.allclose(freq, expected, atol=0.02), (freq, expected)


def test_the_kernel_refuses_a_temperature_of_zero() -> None:
    with pytest.raises(RuntimeError, match="a temperature <= 0"):
        sample_kernels.sample_rows(torch.zeros(2, 8), [1.0, 0.0], [0, 0], [1.0, 1.0], [0.0, 0.0],
                                   torch.zeros(2, dtype=torch.int64))


def test_the_wrapper_names_a_bad_argument() -> None:
    u = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="float32"):
        sample_kernels.sample_rows(torch.zeros(2, 8, dtype=torch.bfloat16), [1.0] * 2, [0] * 2, [1.0] * 2,
                                   [0.0] * 2, u)
    with pytest.raises(ValueError, match="contiguous columns"):
        sample_kernels.sample_rows(torch.zeros(8, 2).t(), [1.0] * 2, [0] * 2, [1.0] * 2, [0.0] * 2, u)
    with pytest.raises(ValueError, match="top_p has 1 values for 2 rows"):
        sample_kernels.sample_rows(torch.zeros(2, 8), [1.0] * 2, [0] * 2, [1.0], [0.0] * 2, u)
    with pytest.raises(ValueError, match=r"key must be \(2,\) contiguous int64"):
        sample_kernels.sample_rows(torch.zeros(2, 8), [1.0] * 2, [0] * 2, [1.0] * 2, [0.0] * 2,
                                   torch.zeros(2))


def _ulps(x: torch.Tensor) -> torch.Tensor:
    """float32 spacing at each value of x (float64 tensor of float32 values)."""
    f = x.float()
    return (torch.nextafter(f, torch.full_like(f, float("-inf"))) - f).abs().double()


@pytest.mark.parametrize("vocab", [7, 300, 49152])
def test_logprobs_within_one_ulp_of_a_float64_log_softmax(vocab: int) -> None:
    """Oracle: ``torch.log_softmax`` in float64. The kernel rounds each logprob once from a double log Z
    whose sum of exponentials carries exp's error (a polynomial within ~1 float32 ulp, relative): so
    within 1 ulp of the value plus 2 ulps of 1 (2.4e-7: log Z's error when few tokens share the mass and
    their exp errors do not average out; with 49,152 tokens the error measured 1 ulp)."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen) * 3.0
    logits[2, : vocab // 2] = float("-inf")  # masked tokens (a grammar, a logit bias)
    tokens = torch.randint(0, vocab, (6,), generator=gen).tolist()
    tokens[2] = 0  # a masked token: logprob -inf, every token at least as likely
    k = min(5, vocab)
    chosen, ranks, top_vals, top_ids = sample_kernels.logprobs_rows(logits, tokens, k)
    truth = torch.log_softmax(logits.double(), dim=-1)
    want = truth[torch.arange(6), tokens]
    got = torch.tensor(chosen, dtype=torch.float64)
    finite = want.isfinite()
    tol = _ulps(want[finite]) + 2.4e-7
    assert ((got - want).abs()[finite] <= tol).all(), (got, want)
    assert got[2] == float("-inf") and ranks[2] == vocab
    assert ranks == [int((logits[r] >= logits[r, t]).sum()) for r, t in enumerate(tokens)]
    ref_vals, ref_ids = truth.topk(k, dim=-1)
    live = ref_vals.isfinite()  # vocab 7's masked row has 4 live tokens: then -inf ties, lowest id first
    assert torch.equal(top_ids[live], ref_ids[live])
    assert ((top_vals.double() - ref_vals).abs()[live] <= _ulps(ref_vals[live]) + 2.4e-7).all()
    assert top_ids[~live].tolist() == list(range(int((~live).sum())))
    assert (top_vals[~live] == float("-inf")).all()


def test_logprobs_top_lists_break_ties_by_id_and_take_any_k() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    _, ranks, vals, ids = sample_kernels.logprobs_rows(logits, [2], 2)
    assert ids.tolist() == [[1, 2]] and ranks == [3] and vals[0, 0] == vals[0, 1]
    assert sample_kernels.logprobs_rows(logits, [2], 0)[3].shape == (1, 0)
    wide = torch.randn(2, 300, generator=torch.Generator().manual_seed(1))  # k = V: past the short-list sort
    _, _, vals, ids = sample_kernels.logprobs_rows(wide, [0, 1], 300)
    assert torch.equal(ids, wide.argsort(dim=-1, descending=True))
    assert (vals[:, :-1] >= vals[:, 1:]).all()


def test_logprobs_leave_a_nan_or_inf_row_to_pytorch_and_name_bad_arguments() -> None:
    for bad in (float("nan"), float("inf")):
        logits = torch.zeros(2, 20)
        logits[1, 3] = bad
        assert sample_kernels.logprobs_rows(logits, [0, 0], 2) is None
    logits = torch.zeros(2, 20)
    with pytest.raises(ValueError, match=r"token id 20 is outside the vocabulary \[0, 20\)"):
        sample_kernels.logprobs_rows(logits, [0, 20], 1)
    with pytest.raises(ValueError, match=r"k must be in \[0, 20\], got 21"):
        sample_kernels.logprobs_rows(logits, [0, 1], 21)
    with pytest.raises(ValueError, match="tokens has 1 values for 2 rows"):
        sample_kernels.logprobs_rows(logits, [0], 1)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    vocab=st.integers(1, 200),
    rows=st.integers(1, 4),
    temperature=st.floats(0.05, 5.0),
    top_k=st.integers(-1, 210),
    top_p=st.sampled_from([1.0, 0.999, 0.9, 0.5, 0.1, 1e-46]),
    min_p=st.sampled_from([0.0, 0.01, 0.3, 1.0]),
    masked=st.floats(0.0, 0.9),
    ties=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_any_shape_and_filters_keep_and_draw_as_the_pytorch_path(vocab, rows, temperature, top_k, top_p,
                                                                  min_p, masked, ties, seed) -> None:
    """Property: for any vocabulary size (vector tails included), filter values and share of masked
    logits, the kernel keeps exactly the PyTorch path's tokens and draws its token for the same key.
    Logits come rounded to 0.5 when ``ties`` (many equal values: top-k's tie rule); then top-p is 1 or
    1e-46, because equal probabilities put its boundary exactly on a partial sum, where PyTorch's float32
    sums and the kernel's double ones round apart (found by this test: 1/(2 + 1e-9) is 0.5 in float32).
    The top-p tie order itself: test_ties_at_the_top_k_floor_stay_and_top_p_ties_go_in_index_order."""
    if ties and top_p not in (1.0, 1e-46):
        top_p = 1.0
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 3.0
    if ties:
        logits = (logits * 2).round() / 2
    logits[torch.rand(rows, vocab, generator=gen) < masked] = float("-inf")
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)] * rows
    keys = _keys(rows, gen)
    kept = torch.empty_like(logits)
    got = _kernel(logits, params, keys, kept)
    reference = _filtered_probs(logits, params)
    live = torch.isfinite(logits).any(dim=-1)
    # Probabilities below float32's least normal (a logit ~87 temperatures under the top): the kernel
    # takes exp of those as 0, PyTorch's softmax gives a subnormal; neither can win a draw.
    normal = ((reference >= torch.finfo(torch.float32).tiny) | (reference == 0)) & live.unsqueeze(1)
    assert ((kept > 0) == (reference > 0))[normal].all()
    assert got == _torch_draw(logits, params, keys)
