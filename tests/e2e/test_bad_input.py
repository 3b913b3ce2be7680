"""Bad input on the real engine: a clear error naming the value and the limit, the engine keeps
serving, no KV block leaks, and nothing cached points to KV that was never written."""

from __future__ import annotations

import pytest

from segserve import LLMEngine, SamplingParams

from .conftest import finish_all, requires_model

pytestmark = [pytest.mark.slow, requires_model]

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def assert_no_leak(eng: LLMEngine) -> None:
    eng.check_integrity()
    assert eng.scheduler.kv_cache_manager.pool.num_free_blocks == eng.num_kv_blocks - 1
    assert not eng.output_processor.states


@pytest.fixture()
def eng(smollm) -> LLMEngine:
    return LLMEngine(model=smollm, num_kv_blocks=256, max_model_len=1024, max_num_batched_tokens=128)


def reference_output(eng: LLMEngine, prompt) -> list[int]:
    eng.add_request("ref", prompt, GREEDY)
    return finish_all(eng)["ref"].outputs[0].token_ids


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("", "prompt is empty"),
        ([], "prompt is empty"),
        ([1, 2, 49152], r"prompt token id 49152 is outside the vocabulary \[0, 49152\)"),
        ([5] * 1025, "prompt has 1025 tokens; with at least 1 output token that is more than "
                     "max_model_len=1024"),
        ([5] * 1024, "prompt has 1024 tokens; with at least 1 output token that is more than "
                     "max_model_len=1024"),
        ({"text": "hi"}, "needs 'prompt' or 'prompt_token_ids'"),
    ],
    ids=["empty-str", "empty-ids", "bad-id", "too-long", "no-room", "bad-dict"],
)
def test_bad_prompt_is_refused_and_the_engine_keeps_serving(eng, prompt, message):
    eng.add_request("good", "Hello, my name is", GREEDY)
    eng.step()
    with pytest.raises(ValueError, match=message):
        eng.add_request("bad", prompt, GREEDY)
    outs = finish_all(eng)
    assert set(outs) == {"good"} and len(outs["good"].outputs[0].token_ids) == 8
    assert_no_leak(eng)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.5), "temperature must be >= 0, got -0.5"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        (dict(top_k=-3), "top_k must be 0 or -1"),
        (dict(min_p=2.0), r"min_p must be in \[0, 1\], got 2.0"),
        (dict(max_tokens=0), "max_tokens must be an int >= 1, got 0"),
        (dict(n=0), r"n must be an int in \[1, 128\], got 0"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens=5 must be <= max_tokens=2"),
        (dict(logprobs=50), r"logprobs must be an int in \[0, 20\], got 50"),
        (dict(stop=[""]), "stop must be non-empty strings"),
        (dict(stop=["x"] * 65), "stop holds 65 strings, more than the limit of 64"),
    ],
)
def test_invalid_sampling_values_name_the_field_and_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_prompt_longer_than_the_budget_is_chunked_not_refused(eng):
    prompt = list(range(1000, 1300))  # 300 tokens, budget 128
    eng.add_request("long", prompt, GREEDY)
    outs = finish_all(eng)
    assert outs["long"].metrics.num_prefill_steps == 3
    assert len(outs["long"].outputs[0].token_ids) == 8
    assert_no_leak(eng)


def test_abort_mid_prefill_then_resend_equals_cold_run(smollm):
    prompt = list(range(2000, 2400))
    cold = reference_output(LLMEngine(model=smollm, num_kv_blocks=256, enable_prefix_caching=False), prompt)
    eng = LLMEngine(model=smollm, num_kv_blocks=256, max_num_batched_tokens=96)
    eng.add_request("a", prompt, GREEDY)
    eng.step()
    eng.step()  # 192 of 400 prompt tokens computed: 12 full blocks written
    eng.abort_request("a")
    assert_no_leak(eng)
    cached = eng.scheduler.kv_cache_manager.pool.cached
    assert len(cached) == 12  # only blocks whose KV was written
    eng.add_request("a", prompt, GREEDY)
    outs = finish_all(eng)
    assert outs["a"].num_cached_tokens == 192
    assert outs["a"].outputs[0].token_ids == cold
    assert_no_leak(eng)


def test_four_requests_on_a_pool_that_barely_fits_one_all_finish(smollm):
    prompts = [list(range(3000 + 500 * i, 3000 + 500 * i + 60)) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    alone = LLMEngine(model=smollm, num_kv_blocks=64, enable_prefix_caching=False)
    expected = []
    for i, p in enumerate(prompts):
        alone.add_request(f"a{i}", p, params)
        expected.append(finish_all(alone)[f"a{i}"].outputs[0].token_ids)
    # 8 usable blocks of 16 = 128 tokens; each request grows to 60 + 40 = 100 tokens (7 blocks), so
    # two admitted requests outgrow the pool at 64 tokens each and the newer one is preempted.
    eng = LLMEngine(model=smollm, num_kv_blocks=9, max_num_batched_tokens=256, enable_prefix_caching=False)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    outs = finish_all(eng)
    assert [outs[f"r{i}"].outputs[0].token_ids for i in range(4)] == expected
    # Only running requests newer than the one needing a block are preempted, and the oldest running
    # request always completes, so request i is preempted at most once per older request: <= 0+1+2+3.
    assert 1 <= eng.scheduler.make_stats().num_preemptions <= 6
    assert_no_leak(eng)


def test_prompt_logprobs_with_a_prefix_cache_hit_equal_cold(smollm):
    prompt = list(range(4000, 4100))
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    cold_eng = LLMEngine(model=smollm, num_kv_blocks=64, enable_prefix_caching=False)
    cold_eng.add_request("c", prompt, params)
    cold = finish_all(cold_eng)["c"]
    eng = LLMEngine(model=smollm, num_kv_blocks=64, max_num_batched_tokens=48)
    eng.add_request("warmup", prompt, GREEDY)
    finish_all(eng)
    eng.add_request("w", prompt, params)
    warm = finish_all(eng)["w"]
    assert warm.prompt_logprobs[0] is None and len(warm.prompt_logprobs) == len(prompt)
    for a, b in zip(cold.prompt_logprobs[1:], warm.prompt_logprobs[1:], strict=False):
        assert a.keys() == b.keys()
        assert max(abs(a[t] - b[t]) for t in a) < 1e-4
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert_no_leak(eng)


def test_abort_of_unknown_and_finished_requests_is_harmless(eng):
    eng.abort_request("nope")
    eng.add_request("x", "Hi", GREEDY)
    finish_all(eng)
    eng.abort_request("x")
    assert_no_leak(eng)


def test_duplicate_request_id_is_refused(eng):
    eng.add_request("x", "Hi", GREEDY)
    with pytest.raises(ValueError, match="request id 'x' is already in use"):
        eng.add_request("x", "Hello", GREEDY)
    finish_all(eng)
    assert_no_leak(eng)
