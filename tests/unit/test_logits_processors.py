"""The batched logits step (penalties, logit bias, allowed token ids, bad words) against hand-computed
values with vLLM 0.32's definitions; rows that asked for nothing are untouched."""

from __future__ import annotations

import pytest
import torch

from segserve.sampling_params import SamplingParams
from segserve.worker.logits_processors import LogitsRow, apply_logits_processors

BASE = [[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]]  # one row, V = 6


def _run(params: SamplingParams, prompt: list[int], output: list[int], base=BASE) -> list[float]:
    logits = torch.tensor(base * 2)  # row 0 processed, row 1 a bystander
    apply_logits_processors(logits, [0], [LogitsRow(params, prompt, output)])
    assert logits[1].tolist() == base[0], "a row that asked for nothing changed"
    return logits[0].tolist()


def test_repetition_penalty_counts_prompt_and_output_and_divides_positive_logits():
    got = _run(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[3])
    # seen: 0 (2.0 -> 1.0), 1 (-1.0 -> -2.0), 3 (3.0 -> 1.5); others unchanged
    assert got == [1.0, -2.0, 0.5, 1.5, -2.0, 1.0]


def test_frequency_and_presence_count_output_only():
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    got = _run(params, prompt=[2, 2, 2], output=[3, 3, 5])
    # token 3 twice: 3 - 2*0.5 - 0.25 = 1.75; token 5 once: 1 - 0.5 - 0.25 = 0.25; prompt token 2 untouched
    assert got == pytest.approx([2.0, -1.0, 0.5, 1.75, -2.0, 0.25])


def test_negative_penalties_reward_repeats():
    got = _run(SamplingParams(frequency_penalty=-1.0), prompt=[], output=[4])
    assert got == pytest.approx([2.0, -1.0, 0.5, 3.0, -1.0, 1.0])


def test_logit_bias_is_added_and_clamped_to_100():
    params = SamplingParams(logit_bias={"1": 5.0, 4: -500})
    assert params.logit_bias == {1: 5.0, 4: -100.0}
    assert _run(params, [0], []) == [2.0, 4.0, 0.5, 3.0, -102.0, 1.0]


def test_allowed_token_ids_ban_every_other_token():
    got = _run(SamplingParams(allowed_token_ids=[2, 5]), [0], [])
    inf = float("-inf")
    assert got == [inf, inf, 0.5, inf, inf, 1.0]


def test_bad_words_single_token_always_multi_token_after_its_prefix():
    params = SamplingParams(bad_words=["x"])
    params.bad_words_token_ids = [[3], [1, 2, 5]]
    inf = float("-inf")
    # output does not end with [1, 2]: only the one-token word is banned
    assert _run(params, [0], [1, 4]) == [2.0, -1.0, 0.5, inf, -2.0, 1.0]
    assert _run(params, [0], [4, 1, 2]) == [2.0, -1.0, 0.5, inf, -2.0, inf]


def test_order_is_bias_then_penalty_as_vllm():
    # bias +2 makes token 1's logit positive (1.0), then the repetition penalty halves it
    got = _run(SamplingParams(logit_bias={1: 2.0}, repetition_penalty=2.0), prompt=[1], output=[])
    assert got[1] == pytest.approx(0.5)


@pytest.mark.parametrize("kwargs,words", [
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5"),
    (dict(frequency_penalty=-2.01), "frequency_penalty must be in [-2, 2], got -2.01"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be in (0, 2], got 0.0"),
    (dict(repetition_penalty=2.5), "repetition_penalty must be in (0, 2], got 2.5"),
    (dict(logit_bias={"a": 1.0}), "logit_bias token id must be a non-negative int, got 'a'"),
    (dict(logit_bias={3: float("nan")}), "logit_bias value for token 3 must be a finite number"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids token id must be a non-negative int, got -1"),
    (dict(bad_words=[""]), "bad_words must be a list of non-empty strings"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output must be a bool, got 1"),
])
def test_bad_values_name_the_field_and_the_limit(kwargs, words):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert words in str(err.value)


def test_greedy_sampling_follows_the_processed_logits_and_logprobs_stay_raw():
    from segserve.worker.sampler import sample

    raw = torch.tensor(BASE)
    processed = raw.clone()
    params = SamplingParams(temperature=0, logprobs=1, logit_bias={4: 100.0})
    apply_logits_processors(processed, [0], [LogitsRow(params, [0], [])])
    out = sample(processed, [params], [None], [0], logprob_logits=raw)
    assert out.token_ids == [4]
    expected = torch.log_softmax(raw, dim=-1)[0]
    assert out.logprobs[0][0] == (4, pytest.approx(float(expected[4])), 6)  # raw rank: the least likely
    assert out.logprobs[0][1] == (3, pytest.approx(float(expected[3])), 1)


def test_penalties_equal_vllms_dense_formula_on_random_rows():
    """The gathered (sparse) penalties against vLLM's dense (R, V) form, 8 random rows."""
    gen = torch.Generator().manual_seed(5)
    vocab, rows = 500, 8
    logits = torch.randn(rows, vocab, generator=gen) * 3
    inputs = []
    for i in range(rows):
        prompt = torch.randint(0, vocab, (40,), generator=gen).tolist()
        output = torch.randint(0, vocab, (i * 5,), generator=gen).tolist()
        params = SamplingParams(repetition_penalty=0.5 + 0.2 * i, frequency_penalty=0.3 * (i % 3) - 0.3,
                                presence_penalty=0.25 * (i % 2))
        inputs.append(LogitsRow(params, prompt, output))
    got = logits.clone()
    apply_logits_processors(got, list(range(rows)), inputs)
    for i, x in enumerate(inputs):
        counts = torch.bincount(torch.tensor(x.output_token_ids, dtype=torch.long), minlength=vocab).float()
        seen = (torch.bincount(torch.tensor(x.prompt_token_ids), minlength=vocab) > 0) | (counts > 0)
        p = x.params
        pen = torch.where(seen, torch.tensor(p.repetition_penalty), torch.tensor(1.0))
        ref = logits[i] * torch.where(logits[i] > 0, 1.0 / pen, pen)
        ref = ref - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        assert torch.allclose(got[i], ref, atol=1e-6), i
