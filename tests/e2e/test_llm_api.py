"""The vLLM-shaped offline API on the real model: prompt forms, chat, n > 1, stop rules, outputs."""

from __future__ import annotations

import pytest

from segserve import LLM, SamplingParams
from segserve.engine.llm import LLM as LLMClass

from .conftest import requires_model

pytestmark = [pytest.mark.slow, requires_model]


@pytest.fixture(scope="module")
def llm(smollm) -> LLM:
    return LLMClass(model=smollm, num_kv_blocks=512, max_num_batched_tokens=256)


def test_generate_accepts_strings_token_ids_and_dicts_in_order(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tok = llm.get_tokenizer()
    ids = tok.encode("The capital of France is")
    outs = llm.generate(
        ["The capital of France is", ids, {"prompt_token_ids": ids}, {"prompt": "The capital of France is"}],
        params,
        use_tqdm=False,
    )
    assert [o.request_id for o in outs] == sorted(o.request_id for o in outs) or len(outs) == 4
    first = outs[0].outputs[0].token_ids
    assert all(o.outputs[0].token_ids == first for o in outs)
    assert outs[0].prompt == "The capital of France is" and outs[1].prompt is None
    assert outs[0].prompt_token_ids == ids
    assert outs[0].outputs[0].text == tok.decode(first, skip_special_tokens=True)
    assert outs[0].outputs[0].finish_reason == "length" and outs[0].finished
    single = llm.generate(ids, params, use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == first


def test_chat_applies_the_template(llm):
    outs = llm.chat(
        [{"role": "user", "content": "What is 2+2?"}], SamplingParams(temperature=0, max_tokens=20)
    )
    text = outs[0].outputs[0].text
    assert "4" in text
    prompt_text = llm.get_tokenizer().decode(outs[0].prompt_token_ids)
    assert prompt_text.startswith("<|im_start|>system\n") and prompt_text.endswith("<|im_start|>assistant\n")


def test_n_completions_differ_and_are_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    a = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    b = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1


def test_stop_string_cuts_the_text_and_stop_token_ids_end_generation(llm):
    base = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    text = base.outputs[0].text
    assert " 6" in text
    cut = llm.generate(
        "1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=12, stop=[" 6"]), use_tqdm=False
    )[0]
    assert cut.outputs[0].text == text[: text.index(" 6")]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == " 6"
    stop_id = base.outputs[0].token_ids[2]
    by_id = llm.generate(
        "1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]), use_tqdm=False
    )[0]
    assert by_id.outputs[0].token_ids == base.outputs[0].token_ids[:3]
    assert by_id.outputs[0].stop_reason == stop_id


def test_logprobs_and_metrics_are_filled(llm):
    out = llm.generate(
        "Hello", SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True), use_tqdm=False
    )[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 4
    for tok, lps in zip(comp.token_ids, comp.logprobs, strict=False):
        assert next(iter(lps)) == tok and len(lps) in (2, 3)
        assert max(lps.values()) == lps[tok]  # greedy picks the top logprob
    assert comp.cumulative_logprob == pytest.approx(
        sum(lp[t] for t, lp in zip(comp.token_ids, comp.logprobs, strict=False))
    )
    m = out.metrics
    assert m.ttft is not None and m.ttft > 0 and m.num_prefill_steps == 1 and m.num_decode_tokens == 3


def test_a_bad_prompt_in_a_batch_queues_nothing(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    llm.llm_engine.check_integrity()
