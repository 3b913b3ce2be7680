"""Issue 13 with the official ``openai`` client on the tiny model: echo and logprobs, list prompts,
chat logprobs, penalties and logit bias, token filters, the chat role with the first output; each
against offline ``LLM.generate`` on the same weights, streamed == non-streamed."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

from segserve import SamplingParams
from tests.server.checks import openai_client
from tests.server.harness import SERVED_NAME

PROMPTS = ["The quick brown fox jumps over", "Paged attention keeps the cache"]


def _offline(tiny_offline, prompt, **kw):
    return tiny_offline.generate([prompt], SamplingParams(temperature=0, **kw), use_tqdm=False)[0]


def _merge_stream(chunks) -> dict[int, dict]:
    """Streamed completions choices concatenated per index (text and the logprobs lists)."""
    merged: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.choices:
            m = merged.setdefault(c.index, {"text": "", "tokens": [], "token_logprobs": [], "text_offset": [],
                                            "finish_reason": None})
            m["text"] += c.text
            if c.logprobs is not None:
                for key in ("tokens", "token_logprobs", "text_offset"):
                    m[key] += getattr(c.logprobs, key)
            m["finish_reason"] = c.finish_reason or m["finish_reason"]
    return merged


def test_echo_logprobs_list_prompt_equal_offline_and_stream(tiny_server, tiny_offline):
    handle, _ = tiny_server
    client = openai_client(handle)
    kw = dict(model=SERVED_NAME, prompt=PROMPTS, echo=True, logprobs=2, max_tokens=3, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1]
    tok = tiny_offline.get_tokenizer()
    for prompt, choice in zip(PROMPTS, whole.choices, strict=True):
        ref = _offline(tiny_offline, prompt, max_tokens=3, logprobs=2, prompt_logprobs=2, ignore_eos=True)
        ids = ref.prompt_token_ids + ref.outputs[0].token_ids
        lp = choice.logprobs
        assert choice.text == prompt + ref.outputs[0].text
        assert lp.tokens == [tok.decode([t]) for t in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        positions = ref.prompt_logprobs[1:] + ref.outputs[0].logprobs
        # the two prompts share the server's steps; offline each runs alone: float32 sums differ slightly
        expected = [pos[t] for pos, t in zip(positions, ids[1:], strict=True)]
        assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-5)
        # the chosen token and the top 2, keyed by text (byte tokens that decode alike collide)
        assert all(1 <= len(top) <= 3 for top in lp.top_logprobs[1:])
        assert [max(top.values()) for top in lp.top_logprobs[1:]] == pytest.approx(
            [max(pos.values()) for pos in positions], abs=1e-5)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert whole.usage.completion_tokens == 6
    assert whole.usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS)
    streamed = _merge_stream(client.completions.create(**kw, stream=True))
    for choice in whole.choices:
        s = streamed[choice.index]
        assert s["text"] == choice.text
        assert (s["tokens"], s["text_offset"]) == (choice.logprobs.tokens, choice.logprobs.text_offset)
        assert s["token_logprobs"][0] is None
        assert s["token_logprobs"][1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=1e-5)
        assert s["finish_reason"] == choice.finish_reason == "length"
    handle.assert_idle_and_clean()


def test_prompt_logprobs_equal_with_a_warm_prefix_cache(tiny_server):
    handle, _ = tiny_server
    client = openai_client(handle)
    prompt = "Chunked prefill splits long prompts into pieces that share the step"
    plain = dict(model=SERVED_NAME, prompt=prompt, max_tokens=1, temperature=0)
    cold = client.completions.create(**plain, echo=True, logprobs=1)
    client.completions.create(**plain)  # warms the cache with the prompt's blocks
    hit = client.completions.create(**plain)
    assert hit.usage.prompt_tokens_details.cached_tokens > 0
    warm = client.completions.create(**plain, echo=True, logprobs=1)
    assert warm.choices[0].logprobs.token_logprobs == cold.choices[0].logprobs.token_logprobs
    # prompt logprobs need every position's logits: like vLLM, such a request skips the cache
    assert warm.usage.prompt_tokens_details.cached_tokens == 0
    handle.assert_idle_and_clean()


def test_echo_with_max_tokens_0_scores_the_prompt_only(tiny_server, tiny_offline):
    handle, _ = tiny_server
    r = openai_client(handle).completions.create(model=SERVED_NAME, prompt=PROMPTS[0], echo=True, logprobs=0,
                                                 max_tokens=0)
    ref = _offline(tiny_offline, PROMPTS[0], max_tokens=1, prompt_logprobs=0)
    c = r.choices[0]
    assert c.text == PROMPTS[0] and c.finish_reason == "length"
    assert len(c.logprobs.tokens) == len(ref.prompt_token_ids)
    assert c.logprobs.token_logprobs[1:] == [pos[t] for pos, t in zip(ref.prompt_logprobs[1:],
                                                                      ref.prompt_token_ids[1:], strict=True)]
    assert all(len(top) == 1 for top in c.logprobs.top_logprobs[1:])
    assert r.usage.completion_tokens == 0
    # Without echo, 0 is refused, and the message says where 0 is allowed (a new user's trial: it read
    # only "max_tokens must be an int >= 1, got 0").
    bad = httpx.post(f"{handle.base_url}/v1/completions",
                     json={"model": SERVED_NAME, "prompt": PROMPTS[0], "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    assert "max_tokens must be >= 1 without echo, got 0" in bad.json()["error"]["message"]


def test_token_id_prompts_with_n_give_prompt_major_choice_order(tiny_server, tiny_offline):
    handle, _ = tiny_server
    tok = tiny_offline.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    r = openai_client(handle).completions.create(model=SERVED_NAME, prompt=ids, max_tokens=4, n=2,
                                                 temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for i in range(len(PROMPTS)):
        ref = _offline(tiny_offline, ids[i], max_tokens=4).outputs[0].text
        assert [r.choices[2 * i].text, r.choices[2 * i + 1].text] == [ref, ref]
    assert r.usage.prompt_tokens == 2 * 0 + sum(len(x) for x in ids)


def test_chat_logprobs_top_3_equal_offline_and_stream(tiny_server, tiny_offline):
    handle, _ = tiny_server
    client = openai_client(handle)
    messages = [{"role": "user", "content": "chunked prefill?"}]
    kw = dict(model=SERVED_NAME, messages=messages, max_tokens=5, temperature=0, logprobs=True,
              top_logprobs=3)
    whole = client.chat.completions.create(**kw)
    ref = tiny_offline.chat(messages, SamplingParams(temperature=0, max_tokens=5, logprobs=3),
                            use_tqdm=False)[0]
    out = ref.outputs[0]
    content = whole.choices[0].logprobs.content
    tok = tiny_offline.get_tokenizer()
    assert [e.token for e in content] == [tok.decode([t]) for t in out.token_ids]
    # within 1e-5: the server's run of the prompt may hit the prefix cache (another summation order)
    expected = [pos[t] for pos, t in zip(out.logprobs, out.token_ids, strict=True)]
    assert [e.logprob for e in content] == pytest.approx(expected, abs=1e-5)
    for e, pos in zip(content, out.logprobs, strict=True):
        best = sorted(pos.values(), reverse=True)[:3]
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(best, abs=1e-5)
        assert e.bytes == list(e.token.encode("utf-8"))
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)


def test_chat_role_comes_with_the_first_token(tiny_server, tiny_offline):
    handle, _ = tiny_server
    messages = [{"role": "user", "content": "Name a prime."}]
    chunks = list(openai_client(handle).chat.completions.create(
        model=SERVED_NAME, messages=messages, max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    ref = tiny_offline.chat(messages, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    with_role = [c for c in chunks if c.choices and c.choices[0].delta.role]
    assert len(with_role) == 1 and chunks[0] is with_role[0]
    first_text = tiny_offline.get_tokenizer().decode(ref.token_ids[:1])
    if first_text and "\ufffd" not in first_text:
        assert chunks[0].choices[0].delta.content == first_text  # no role-only chunk before the prefill
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text


@pytest.mark.parametrize("extra", [
    {"presence_penalty": 1.5}, {"frequency_penalty": 1.0}, {"frequency_penalty": -1.0},
    {"repetition_penalty": 1.8}, {"repetition_penalty": 0.5, "presence_penalty": -0.5},
])
def test_penalties_equal_offline_and_stream(tiny_server, tiny_offline, extra):
    handle, _ = tiny_server
    client = openai_client(handle)
    prompt = "the the the quick quick brown"
    kw = dict(model=SERVED_NAME, prompt=prompt, max_tokens=12, temperature=0)
    body = {k: v for k, v in extra.items() if k != "repetition_penalty"}
    rest = {k: v for k, v in extra.items() if k == "repetition_penalty"}
    whole = client.completions.create(**kw, **body, extra_body={"ignore_eos": True, **rest})
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        **kw, **body, extra_body={"ignore_eos": True, **rest}, stream=True) if c.choices)
    ref = _offline(tiny_offline, prompt, max_tokens=12, ignore_eos=True, **extra).outputs[0]
    plain = _offline(tiny_offline, prompt, max_tokens=12, ignore_eos=True).outputs[0]
    assert whole.choices[0].text == streamed == ref.text
    assert ref.token_ids != plain.token_ids, "the penalty changed nothing: the test cannot fail"


def test_logit_bias_plus_100_forces_a_token_minus_100_bans_it(tiny_server, tiny_offline):
    handle, _ = tiny_server
    client = openai_client(handle)
    prompt = PROMPTS[0]
    plain = _offline(tiny_offline, prompt, max_tokens=6, ignore_eos=True).outputs[0]
    forced = 77
    r = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=6, temperature=0,
                                  logit_bias={str(forced): 100}, logprobs=0, extra_body={"ignore_eos": True})
    tok = tiny_offline.get_tokenizer()
    assert r.choices[0].logprobs.tokens == [tok.decode([forced])] * 6
    first = plain.token_ids[0]
    banned = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=6, temperature=0,
                                       logit_bias={str(first): -100}, extra_body={"ignore_eos": True})
    ref = _offline(tiny_offline, prompt, max_tokens=6, ignore_eos=True, logit_bias={first: -100}).outputs[0]
    assert first not in ref.token_ids
    assert banned.choices[0].text == ref.text != plain.text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=SERVED_NAME, prompt=prompt, max_tokens=6, temperature=0, logit_bias={str(first): -100},
        extra_body={"ignore_eos": True}, stream=True) if c.choices)
    assert streamed == ref.text
    forced_ref = _offline(tiny_offline, prompt, max_tokens=6, ignore_eos=True, logit_bias={forced: 100})
    assert forced_ref.outputs[0].token_ids == [forced] * 6


def test_allowed_token_ids_bad_words_and_special_tokens(tiny_server, tiny_offline):
    handle, _ = tiny_server
    client = openai_client(handle)
    base = dict(model=SERVED_NAME, prompt=PROMPTS[1], max_tokens=5, temperature=0)
    r = client.completions.create(**base, logprobs=0, extra_body={"allowed_token_ids": [40, 41],
                                                                  "ignore_eos": True})
    tok = tiny_offline.get_tokenizer()
    assert set(r.choices[0].logprobs.tokens) <= {tok.decode([40]), tok.decode([41])}
    plain = _offline(tiny_offline, PROMPTS[1], max_tokens=8, ignore_eos=True).outputs[0]
    # a generated token whose text without its leading space is itself one token: banning that word
    # bans the token (vLLM's rule tokenizes the word bare and with one leading space)
    hits = [t for t in plain.token_ids if tok.encode(tok.decode([t]).strip()) == [t]]
    assert hits, "no single-token word in the output: pick another prompt"
    word = tok.decode([hits[0]]).strip()
    r = client.completions.create(**{**base, "max_tokens": 8},
                                  extra_body={"bad_words": [word], "ignore_eos": True})
    ref = _offline(tiny_offline, PROMPTS[1], max_tokens=8, ignore_eos=True, bad_words=[word]).outputs[0]
    assert hits[0] not in ref.token_ids and ref.token_ids != plain.token_ids
    assert r.choices[0].text == ref.text
    # token 1 is the special <|im_start|>: dropped from the text unless skip_special_tokens is false
    special = {"allowed_token_ids": [1], "ignore_eos": True}
    kept = client.completions.create(**{**base, "max_tokens": 2}, extra_body={**special,
                                                                              "skip_special_tokens": False})
    dropped = client.completions.create(**{**base, "max_tokens": 2}, extra_body=special)
    assert kept.choices[0].text == "<|im_start|><|im_start|>" and dropped.choices[0].text == ""
    tight = client.completions.create(**{**base, "max_tokens": 2}, extra_body={
        **special, "skip_special_tokens": False, "spaces_between_special_tokens": False})
    assert tight.choices[0].text == "<|im_start|><|im_start|>"
    handle.assert_idle_and_clean()


def test_include_stop_str_in_output(tiny_server, tiny_offline):
    handle, _ = tiny_server
    plain = _offline(tiny_offline, PROMPTS[0], max_tokens=12, ignore_eos=True).outputs[0].text
    stop = plain[3:5]
    assert stop and plain.find(stop) == 3
    client = openai_client(handle)
    base = dict(model=SERVED_NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop])
    cut = client.completions.create(**base, extra_body={"ignore_eos": True})
    kept = client.completions.create(**base, extra_body={"ignore_eos": True,
                                                         "include_stop_str_in_output": True})
    assert cut.choices[0].text == plain[:3]
    assert kept.choices[0].text == plain[:5]


BAD = [
    ("/v1/completions", {"logit_bias": {"300": 1}}, "logit_bias", "outside the vocabulary [0, 300)"),
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias", "non-negative int, got 'x'"),
    ("/v1/completions", {"logit_bias": {"5": "big"}}, "logit_bias", "valid number"),
    ("/v1/completions", {"logprobs": 21}, "logprobs", "[0, 20], got 21"),
    ("/v1/completions", {"frequency_penalty": -2.5}, "frequency_penalty", "[-2, 2], got -2.5"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty", "(0, 2], got 0"),
    ("/v1/completions", {"repetition_penalty": "high"}, "repetition_penalty", "valid number"),
    ("/v1/completions", {"allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
    ("/v1/completions", {"allowed_token_ids": [999]}, "allowed_token_ids", "outside the vocabulary"),
    ("/v1/completions", {"bad_words": [""]}, "bad_words", "non-empty strings"),
    ("/v1/completions", {"suffix": "end"}, "suffix", "not supported"),
    ("/v1/completions", {"frobnicate": 1}, "frobnicate", "not a field this server knows"),
    ("/v1/completions", {"best_of": 3}, "best_of", "best_of == n"),
    ("/v1/chat/completions", {"top_logprobs": 21, "logprobs": True}, "top_logprobs", "[0, 20], got 21"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions", "use tools"),
    ("/v1/chat/completions", {"guided_regex": "a+"}, "guided_regex", "use structured_outputs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, "messages", "'image_url'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "function_call": {}}]},
     "function_call", "use tool_calls"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "mood": "x"}]},
     "mood", "not a field"),
    ("/v1/completions", {"bad_words": "fox"}, "bad_words", "valid list"),
    ("/v1/completions", {"allowed_token_ids": ["a"]}, "allowed_token_ids", "valid integer"),
    ("/v1/chat/completions", {"store": True}, "store", "False"),
]


@pytest.mark.parametrize("path,extra,param,words", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_new_fields_answer_400_naming_the_field_and_the_server_keeps_serving(tiny_server, path, extra,
                                                                                 param, words):
    handle, _ = tiny_server
    base = ({"prompt": "hi", "max_tokens": 2} if path.endswith("/completions") and "chat" not in path
            else {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    r = httpx.post(handle.base_url + path, json={"model": SERVED_NAME, **base, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    ok = httpx.post(handle.base_url + path, json={"model": SERVED_NAME, **base})
    assert ok.status_code == 200
    handle.assert_idle_and_clean()


def test_request_id_and_the_x_request_id_header_name_the_response(tiny_server):
    """A new user's trial: vLLM 0.32's ``request_id`` was "not a field this server knows". As in vLLM, the
    response's ``id`` is ``cmpl-`` / ``chatcmpl-`` and the ``X-Request-Id`` header if sent, else the
    body's ``request_id``; two requests with one id both run (engine ids stay the server's); an id
    past 1,024 characters is refused (it would be repeated in every chunk)."""
    handle, _ = tiny_server
    url = handle.base_url
    body = {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 2, "request_id": "abc"}
    assert httpx.post(f"{url}/v1/completions", json=body).json()["id"] == "cmpl-abc"
    header = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "trace-9"})
    assert header.json()["id"] == "cmpl-trace-9"
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}) as r:
        ids = {json.loads(line[6:])["id"] for line in r.iter_lines() if line.startswith("data: {")}
    assert ids == {"cmpl-abc"}
    chat = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "request_id": "abc"}
    assert httpx.post(f"{url}/v1/chat/completions", json=chat).json()["id"] == "chatcmpl-abc"
    plain = httpx.post(f"{url}/v1/completions", json={k: v for k, v in body.items() if k != "request_id"})
    assert plain.json()["id"].startswith("cmpl-") and plain.json()["id"] != "cmpl-abc"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # one client id twice at once
        both = list(pool.map(lambda _: httpx.post(f"{url}/v1/completions", json=body | {"max_tokens": 8}),
                             range(2)))
    assert [r.status_code for r in both] == [200, 200] and {r.json()["id"] for r in both} == {"cmpl-abc"}
    long = httpx.post(f"{url}/v1/completions", json=body | {"request_id": "x" * 1025})
    assert long.status_code == 400 and long.json()["error"]["param"] == "request_id"
    assert "1025 characters; at most 1024" in long.json()["error"]["message"]
    handle.assert_idle_and_clean()


def test_add_special_tokens_follows_vllm_on_a_tokenizer_that_adds_bos(tmp_path):
    """A new user's trial: vLLM 0.32's ``add_special_tokens`` was "not a field this server knows". On a
    GGUF whose tokenizer adds BOS: completions add it by default and not with false (token ids are taken
    as given either way); chat adds none beyond the template's by default and BOS on top with true."""
    from segserve import LLMEngine
    from segserve.models.loader import load_model
    from tests.model_fixtures import tiny_hf_model, train_tiny_tokenizer, write_tiny_gguf
    from tests.server.conftest import TINY_ENGINE
    from tests.server.harness import running_server

    write_tiny_gguf(tmp_path / "bos.gguf", tiny_hf_model(), train_tiny_tokenizer(), add_bos=True)
    loaded = load_model(str(tmp_path / "bos.gguf"))
    tok = loaded.tokenizer
    text = "The lazy dog"
    plain = tok.encode(text, add_special_tokens=False)
    assert tok.encode(text) == [tok.bos_token_id, *plain]  # the fixture's tokenizer does add BOS
    with running_server(LLMEngine(loaded, **TINY_ENGINE)) as (handle, _):

        def prompt_tokens(path: str, body: dict) -> int:
            r = httpx.post(handle.base_url + path, json={"model": SERVED_NAME, "max_tokens": 1, **body})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]

        n = len(plain)
        assert prompt_tokens("/v1/completions", {"prompt": text}) == n + 1
        assert prompt_tokens("/v1/completions", {"prompt": text, "add_special_tokens": True}) == n + 1
        assert prompt_tokens("/v1/completions", {"prompt": text, "add_special_tokens": False}) == n
        assert prompt_tokens("/v1/completions", {"prompt": plain, "add_special_tokens": True}) == n
        messages = [{"role": "user", "content": text}]
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        chat = len(tok.encode(rendered, add_special_tokens=False))
        assert prompt_tokens("/v1/chat/completions", {"messages": messages}) == chat
        with_bos = {"messages": messages, "add_special_tokens": True}
        assert prompt_tokens("/v1/chat/completions", with_bos) == chat + 1
        # /tokenize counts what the routes send the engine, under the same rule (vLLM's: the rendered
        # chat encoded with the tokenizer's specials; the template's own BOS text stays).
        for extra, want in (({}, tok.encode(rendered, add_special_tokens=False)),
                            ({"add_special_tokens": True}, tok.encode(rendered))):
            r = httpx.post(handle.base_url + "/tokenize", json={"messages": messages, **extra})
            assert r.json()["tokens"] == want, extra
        assert tok.encode(rendered)[:2] == [tok.bos_token_id] * 2  # the template starts with BOS's text
        r = httpx.post(handle.base_url + "/tokenize", json={"prompt": text, "add_special_tokens": False})
        assert r.json()["tokens"] == plain
        handle.assert_idle_and_clean()


def test_continuous_usage_counts_each_choice_its_own_tokens(tiny_server):
    """A new user's ``n: 3`` stream carried usage summed over the three choices (3, 6, 9 completion
    tokens; the first chunk of choice 0 said 3 after its one token). vLLM 0.32 gives each chunk its own
    choice's tokens so far and its own prompt's tokens (``previous_num_tokens[i]``,
    ``num_prompt_tokens[prompt_idx]``); the final usage chunk sums everything."""
    handle, _ = tiny_server
    client = openai_client(handle)
    opts = {"include_usage": True, "continuous_usage_stats": True}
    prompts = [[5, 6, 7], [5, 6, 7, 8, 9]]
    chunks = list(client.completions.create(model=SERVED_NAME, prompt=prompts, max_tokens=3, n=3,
                                            temperature=1.0, seed=1, stream=True, stream_options=opts,
                                            extra_body={"ignore_eos": True}))
    seen: dict[int, int] = {}
    for c in (c for c in chunks if c.choices):
        (choice,) = c.choices
        seen[choice.index] = seen.get(choice.index, 0) + 1  # one token a step
        assert c.usage.completion_tokens == seen[choice.index], (choice.index, c.usage)
        assert c.usage.prompt_tokens == len(prompts[choice.index // 3])
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    assert seen == {i: 3 for i in range(6)}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 18
    assert chunks[-1].usage.prompt_tokens == 3 + 5
    chat = list(client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "x"}],
                                               max_tokens=2, n=2, temperature=1.0, seed=1, stream=True,
                                               stream_options=opts, extra_body={"ignore_eos": True}))
    tokens: dict[int, int] = {}
    for c in (c for c in chat if c.choices):
        (choice,) = c.choices
        tokens[choice.index] = tokens.get(choice.index, 0) + 1
        assert c.usage.completion_tokens == tokens[choice.index], (choice.index, c.usage)
    assert tokens == {0: 2, 1: 2} and chat[-1].usage.completion_tokens == 4


def test_stream_options_continuous_usage_stats(tiny_server):
    handle, _ = tiny_server
    client = openai_client(handle)
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], max_tokens=5,
                                            temperature=0, stream=True, stream_options=opts,
                                            extra_body={"ignore_eos": True}))
    with_text = [c for c in chunks if c.choices]
    assert all(c.usage is not None for c in with_text)
    counts = [c.usage.completion_tokens for c in with_text]
    assert counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    messages = [{"role": "user", "content": "x"}]
    plain = list(client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=3,
                                                stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain if c.choices) and plain[-1].usage.completion_tokens <= 3
