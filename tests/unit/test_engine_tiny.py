"""The whole engine on tiny random checkpoints (seconds, no real model): a Hugging Face directory and a
GGUF file both load through ``LLM(model=path)`` and generate what ``transformers`` generates."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for model_fixtures
from model_fixtures import save_tiny_hf_dir, tiny_hf_model, train_tiny_tokenizer, write_tiny_gguf  # noqa: E402

from segserve import LLM, SamplingParams  # noqa: E402

PROMPTS = [
    [5, 17, 42, 99, 100, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    [3, 4, 5],
    list(range(30, 70)),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = tiny_hf_model(vocab_size=300, tie=False)
    tok = train_tiny_tokenizer(300)
    root = tmp_path_factory.mktemp("tiny")
    save_tiny_hf_dir(root / "hf", hf, tok)
    write_tiny_gguf(root / "tiny.gguf", hf, tok)
    return hf, root


def hf_greedy(hf, prompt: list[int], n: int = 10) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("budget", [5, 64])
def test_tiny_checkpoint_generates_like_transformers(tiny, fmt, budget):
    hf, root = tiny
    path = root / "hf" if fmt == "hf" else root / "tiny.gguf"
    llm = LLM(model=str(path), num_kv_blocks=64, max_num_batched_tokens=budget, max_model_len=128)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt)
    llm.llm_engine.check_integrity()


def test_tiny_warm_prefix_run_equals_cold(tiny):
    hf, root = tiny
    llm = LLM(
        model=str(root / "hf"), num_kv_blocks=64, max_num_batched_tokens=16, max_model_len=128, block_size=4
    )
    cold = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    warm = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in cold] == [0, 0, 0]
    assert [o.num_cached_tokens for o in warm] == [16, 0, 36]  # whole blocks, last token recomputed
    assert [o.outputs[0].token_ids for o in warm] == [o.outputs[0].token_ids for o in cold]


def test_engine_settings_are_checked(tiny):
    _, root = tiny
    with pytest.raises(ValueError, match="max_model_len=4096 exceeds the model's context length 128"):
        LLM(model=str(root / "hf"), max_model_len=4096)
    with pytest.raises(ValueError, match="kv_segment_size must be one of"):
        LLM(model=str(root / "hf"), kv_segment_size=300)
    with pytest.raises(ValueError, match="must be a multiple of block_size=1024"):
        LLM(model=str(root / "hf"), block_size=1024, kv_segment_size=512)
    with pytest.raises(ValueError, match="largest num_batched_tokens_buckets entry 64 is below"):
        LLM(model=str(root / "hf"), num_batched_tokens_buckets=[16, 64], max_num_batched_tokens=128)
    with pytest.raises(ValueError, match="strictly increasing"):
        LLM(model=str(root / "hf"), num_batched_tokens_buckets=[64, 16], max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLM(model=str(root / "hf"), dtype="float16")
    with pytest.raises(ValueError, match="attention_backend must be"):
        LLM(model=str(root / "hf"), attention_backend="flash")


def test_engine_builds_through_engine_args_the_same_from_keywords_and_flags(tiny):
    # The tiny model: 2 layers x 2 KV heads x 16 dims, float32: 512 bytes a token, 2,048 a 4-token block.
    from segserve import LLMEngine
    from segserve.engine_args import EngineArgs
    from segserve.entrypoints.cli import build_parser

    _, root = tiny
    path = str(root / "hf")
    keywords = LLMEngine(
        path, block_size=4, max_num_seqs=3, max_model_len=64, max_num_partial_prefills=2,
        scheduling_policy="prefill_first",
    )  # fmt: skip
    argv = ["generate", "--model", path, "--block-size", "4", "--max-num-seqs", "3", "--max-model-len", "64",
            "--max-num-partial-prefills", "2", "--scheduling-policy", "prefill_first"]
    flags = LLMEngine.from_engine_args(EngineArgs.from_cli_args(build_parser().parse_args(argv)))
    assert flags.config == keywords.config
    assert keywords.config.scheduler.max_num_partial_prefills == 2
    assert keywords.num_kv_blocks == flags.num_kv_blocks == 3 * 16 + 1  # 3 rows of 64 / 4 blocks, + null
    # max_model_len unset: the model's 128, lowered to what the pool holds (10.99 blocks of memory: 10 of
    # 4 tokens, + null); given, it must fit.
    sized = LLMEngine(keywords.loaded, block_size=4, kv_cache_memory_bytes=11 * 2048 - 1)
    assert sized.max_model_len == 40 and sized.num_kv_blocks == 11
    fits = LLMEngine(keywords.loaded, block_size=4, kv_cache_memory_bytes=11 * 2048 - 1, max_model_len=40)
    assert fits.config == sized.config
    with pytest.raises(ValueError, match=r"^max_model_len=41 does not fit the KV cache, which holds 40 "
                                         r"tokens \(10 blocks of 4\).*\(num_kv_blocks >= 12.* max_model_len "
                                         r"<= 40, or max_model_len -1 \(auto"):
        LLMEngine(keywords.loaded, block_size=4, kv_cache_memory_bytes=11 * 2048 - 1, max_model_len=41)
    # malloc.prefault for the first large step: the budget (LLMEngine's default, 512) x the model's
    # activation bytes a token (under 1 MB for this model), in 16 MiB pieces: one.
    from segserve import malloc
    from segserve.models.llama import step_activation_bytes_per_token
    per_token = step_activation_bytes_per_token(sized.loaded.config, torch.float32)
    assert sized.config.scheduler.max_num_batched_tokens == 512 and 0 < 512 * per_token <= 16 << 20
    assert sized.prefaulted_bytes == (16 << 20 if malloc.applied else 0)
    with pytest.raises(TypeError, match="max_num_batched_token"):
        LLMEngine(keywords.loaded, max_num_batched_token=64)


def test_engine_settings_fail_before_the_model_loads(monkeypatch):
    import segserve.engine.llm_engine as llm_engine

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the settings were checked")

    monkeypatch.setattr(llm_engine, "load_model", no_load)
    with pytest.raises(ValueError, match="max_num_partial_prefills must be >= 1, got 0"):
        llm_engine.LLMEngine(max_num_partial_prefills=0)
    with pytest.raises(ValueError, match="attention_backend must be 'segmented' or 'reference'"):
        llm_engine.LLMEngine(attention_backend="flash")
    with pytest.raises(AssertionError, match="the model loaded"):
        llm_engine.LLMEngine(max_model_len=10**9)  # only the model knows its context length


def test_a_failing_step_aborts_its_requests_and_the_engine_keeps_serving(tiny, monkeypatch):
    hf, root = tiny
    llm = LLM(model=str(root / "hf"), num_kv_blocks=64, max_model_len=128)
    engine = llm.llm_engine
    engine.add_request("doomed", PROMPTS[0], GREEDY)
    real = engine.runner.execute_model

    def boom(so, grammar=None):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(engine.runner, "execute_model", boom)
    with pytest.raises(RuntimeError, match="kernel failed"):
        engine.step()
    monkeypatch.setattr(engine.runner, "execute_model", real)
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    assert engine.scheduler.kv_cache_manager.pool.num_free_blocks == 63
    assert engine.scheduler.kv_cache_manager.pool.cached == {}  # nothing registered for unwritten KV
    out = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, PROMPTS[0])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=float("nan")), "temperature must be a finite number, got nan"),
        (dict(temperature=float("inf")), "temperature must be a finite number, got inf"),
        (dict(temperature="0.5"), "temperature must be a finite number, got '0.5'"),
        (dict(top_p=float("nan")), "top_p must be a finite number"),
        (dict(logprobs=True), "logprobs must be an int, got True"),
        (dict(n=True), "n must be an int, got True"),
        (dict(max_tokens=True), "max_tokens must be an int, got True"),
        (dict(max_tokens=2.5), "max_tokens must be an int, got 2.5"),
        (dict(stop=5), "stop must be a string or a list of strings, got 5"),
        (dict(stop_token_ids=[True]), "stop_token_ids must be non-negative ints"),
    ],
)
def test_sampling_params_reject_nan_bools_and_wrong_types(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([1.0, 2.0], "prompt token id 1.0 is not an int"),
        ([1, None], "prompt token id None is not an int"),
        ([True, False], "prompt token id True is not an int"),
        (None, "a prompt must be a string, a list of token ids or a dict, got NoneType"),
        (5, "a prompt must be a string, a list of token ids or a dict, got int"),
    ],
)
def test_bad_prompt_types_get_clear_errors(tiny, prompt, message):
    _, root = tiny
    llm = LLM(model=str(root / "hf"), num_kv_blocks=64, max_model_len=128)
    with pytest.raises(ValueError, match=message):
        llm.llm_engine.add_request("x", prompt, GREEDY)
    with pytest.raises(ValueError, match=r"stop_token_ids entry 305 is outside the vocabulary \[0, 300\)"):
        llm.llm_engine.add_request("y", [1, 2], SamplingParams(stop_token_ids=[305]))
    import numpy as np

    out = llm.generate(
        [np.array([5, 6, 7]).tolist(), [np.int64(5), np.int64(6), np.int64(7)]], GREEDY, use_tqdm=False
    )
    assert out[0].outputs[0].token_ids == out[1].outputs[0].token_ids
    assert not llm.llm_engine.has_unfinished_requests()
    # LLM.generate given no prompt list at all names the type, as add_request does (was: "'NoneType'
    # object is not iterable", a README-only trial, 2026-12-06), and queues nothing.
    if prompt is None or isinstance(prompt, int):
        with pytest.raises(ValueError, match=message):
            llm.generate(prompt, GREEDY, use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()


def test_n_gt_1_child_id_collision_names_the_request_and_harms_nothing(tiny):
    # Regression: with "1_x" already running, adding "x" with n=2 failed with "'1_x' is already in use",
    # naming an id the caller never passed, after half-adding the request.
    _, root = tiny
    engine = LLM(model=str(root / "hf"), num_kv_blocks=64, max_model_len=128).llm_engine
    engine.add_request("1_x", PROMPTS[0], GREEDY)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match=r"request id 'x' with n=2 needs the internal id '1_x'"):
        engine.add_request("x", PROMPTS[1], params)
    assert sorted(engine.scheduler.requests) == ["1_x"]
    engine.add_request("y", PROMPTS[1], params)  # a free id with n=2 works
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    assert sorted(outs) == ["1_x", "y"] and len(outs["y"].outputs) == 2
    engine.check_integrity()


def test_offline_llm_defaults_to_vllm_cpus_offline_budget(tiny):
    """``LLM(...)`` without a budget takes 4,096 (vLLM-CPU's offline default), with the default
    buckets up to it (steps above 64 rows unpadded: a 300-token step runs 300 rows, not 320); a given
    budget wins; given buckets below 4,096 cap it at their largest."""
    _, root = tiny
    llm = LLM(model=str(root / "hf"), num_kv_blocks=64, max_model_len=128)
    sched = llm.llm_engine.config.scheduler
    assert sched.max_num_batched_tokens == 4096
    assert sched.num_batched_tokens_buckets[-1] == 4096 and sched.padded_num_tokens(300) == 300
    assert [sched.padded_num_tokens(t) for t in (3, 33, 64, 65, 4096)] == [4, 48, 64, 65, 4096]
    assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # it runs
    small = dict(model=str(root / "hf"), num_kv_blocks=64, max_model_len=128)
    explicit = LLM(**small, max_num_batched_tokens=48)
    assert explicit.llm_engine.config.scheduler.max_num_batched_tokens == 48
    capped = LLM(**small, num_batched_tokens_buckets=[8, 64])
    assert capped.llm_engine.config.scheduler.max_num_batched_tokens == 64


def test_a_prompt_that_waits_for_a_shared_prefix_generates_like_transformers(tiny):
    # b shares a's first 24 tokens (6 blocks of 4) and arrives with it; a's chunks are capped at 8 of a
    # 16-token budget, so b had room beside a but waits for a's blocks instead: it is served all 24 from
    # the cache, and both generate what transformers does.
    hf, root = tiny
    llm = LLM(model=str(root / "hf"), num_kv_blocks=64, max_num_batched_tokens=16, max_model_len=128,
              block_size=4, long_prefill_token_threshold=8)
    shared = list(range(100, 124))
    prompts = [shared + [5, 6, 7], shared + [8, 9]]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 24]
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt)
    llm.llm_engine.check_integrity()


def test_prompt_logprobs_of_a_preempted_request_are_sent_once(tiny):
    # 9 blocks of 4 cannot hold both 20-token prompts and their outputs: one is preempted and recomputed.
    # Each prompt still gets one entry per position (None first), equal to its run alone within 1e-4;
    # before the fix the recomputed positions were sent again (32 entries for 20 tokens).
    hf, root = tiny
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, prompt_logprobs=1)
    prompts = [list(range(10, 30)), list(range(40, 60))]
    llm = LLM(model=str(root / "hf"), num_kv_blocks=9, block_size=4, max_num_batched_tokens=16,
              max_model_len=32, enable_prefix_caching=False)  # what 8 blocks hold: 30 tokens a request
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert llm.llm_engine.scheduler.make_stats().num_preemptions >= 1
    alone = LLM(model=str(root / "hf"), num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
                max_model_len=128, enable_prefix_caching=False)
    for prompt, out in zip(prompts, outs, strict=True):
        ref = alone.generate([prompt], sp, use_tqdm=False)[0]
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for got, want in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True):
            assert list(got) == list(want)
            # float32; the two runs split the prompts into different chunks (summation order): ~2e-6 seen
            assert all(abs(got[t].logprob - want[t].logprob) < 1e-4 for t in want)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    llm.llm_engine.check_integrity()


def test_offline_chat_takes_the_servers_message_shapes_and_vllms_keywords(tiny):
    """A fresh user's trial (2026-12-05): ``LLM.chat`` lacked vLLM's ``continue_final_message``,
    ``chat_template``, ``chat_template_kwargs`` and ``tools``, and a message without ``content`` (which
    the server takes) failed inside the template with a jinja error."""
    _, root = tiny
    llm = LLM(model=str(root / "hf"), num_kv_blocks=64, max_model_len=128)
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    plain = llm.chat([{"role": "user", "content": ""}], sp, use_tqdm=False)[0]
    absent = llm.chat([{"role": "user"}], sp, use_tqdm=False)[0]
    assert absent.prompt_token_ids == plain.prompt_token_ids
    two = [{"type": "text", "text": "the "}, {"type": "text", "text": "cat"}]
    parts = llm.chat([{"role": "user", "content": two}], sp, use_tqdm=False)[0]
    assert parts.prompt_token_ids == llm.chat([{"role": "user", "content": "the \ncat"}], sp,  # vLLM's join
                                              use_tqdm=False)[0].prompt_token_ids
    tok = llm.get_tokenizer()
    own = "{% for m in messages %}{{ m['content'] }}|{% endfor %}{{ suffix }}"
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    out = llm.chat(turns, sp, use_tqdm=False, chat_template=own, chat_template_kwargs={"suffix": "!"})[0]
    assert out.prompt_token_ids == tok.encode("a|b|!", add_special_tokens=False)
    assert out.prompt == "a|b|!"  # the rendered text, as vLLM's (a second trial: None)
    tools = [{"type": "function", "function": {"name": "cat", "parameters": {"type": "object"}}}]
    name_of_tool = "{{ tools[0]['function']['name'] }}"
    named = llm.chat(turns, sp, use_tqdm=False, chat_template=name_of_tool, tools=tools)
    assert named[0].prompt_token_ids == tok.encode("cat", add_special_tokens=False)
    opened = llm.chat([{"role": "user", "content": "the"}, {"role": "assistant", "content": "cat sat"}], sp,
                      use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert tok.decode(opened.prompt_token_ids).endswith("cat sat")  # no end of turn after it
    # No conversation at all: named as messages, not prompts (a new user's trial, 2026-12-05).
    with pytest.raises(ValueError, match=r"^no messages given: chat\(\) takes a conversation"):
        llm.chat([], sp, use_tqdm=False)
    # chat_template_kwargs win over the keywords (vLLM merges them last); a second trial's TypeError.
    unopened = llm.chat(turns, sp, use_tqdm=False, chat_template_kwargs={"add_generation_prompt": False})[0]
    assert unopened.prompt_token_ids == llm.chat(turns, sp, use_tqdm=False,
                                                 add_generation_prompt=False)[0].prompt_token_ids
    for bad, words in (([{"role": "user", "content": 5}], r"messages\[0\].content must be a string"),
                       ([{"role": 5, "content": "a"}], r"messages\[0\].role must be a string, got 5"),
                       ([{"content": "a"}], r"messages\[0\].role must be a string, got None")):
        with pytest.raises(ValueError, match=words):
            llm.chat(bad, sp)
    with pytest.raises(ValueError, match="continue_final_message=True needs add_generation_prompt=False"):
        llm.chat([{"role": "user", "content": "a"}], sp, continue_final_message=True)
    with pytest.raises(ValueError, match=r"messages\[0\].content: only text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], sp)
    with pytest.raises(ValueError, match="chat_template_content_format='openai' is not supported"):
        llm.chat([{"role": "user", "content": "a"}], sp, chat_template_content_format="openai")
    assert llm.llm_engine.get_num_unfinished_requests() == 0


def test_a_prompt_must_leave_room_for_one_output_token_offline_too(tiny):
    """vLLM 0.32's input processor refuses a prompt of exactly max_model_len tokens; offline segserve ran
    it and returned a token past the limit (a new user's trial, 2026-12-05: the server refused it)."""
    _, root = tiny
    llm = LLM(model=str(root / "hf"), num_kv_blocks=64, max_model_len=128)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with pytest.raises(ValueError, match=r"^prompt has 128 tokens; with at least 1 output token that is more "
                                         r"than max_model_len=128$"):
        llm.generate({"prompt_token_ids": [5] * 128}, sp, use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [5] * 127}, sp, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    assert not llm.llm_engine.has_unfinished_requests()
    llm.llm_engine.check_integrity()
