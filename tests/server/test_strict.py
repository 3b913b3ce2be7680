"""OpenAI's and vLLM's typing rules (issue 17, item 4) and errors that say the truth (item 5).

null means the default for every optional field; booleans are not numbers and numbers are not
booleans; vLLM's ranges (64-bit seeds, ``top_k`` -1 or within the vocabulary, finite ``temperature``
in [0, 2]); ``stream_options`` only with ``stream``; a never-servable request is a 400; 503s carry
``Retry-After``; 405s keep ``Allow``; one rule at the ``max_model_len`` boundary."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.harness import SERVED_NAME, running_server

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
GOOD = {"model": SERVED_NAME, "prompt": "The quick brown fox", "max_tokens": 3, "temperature": 0}
GOOD_CHAT = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
             "temperature": 0}
JSON = {"content-type": "application/json"}

NULLABLE_DEFAULTS_CMPL = ["n", "stream", "echo", "presence_penalty", "frequency_penalty", "logprobs",
                          "min_tokens", "ignore_eos", "temperature", "top_p", "top_k", "min_p", "seed",
                          "stop", "stop_token_ids", "stream_options", "best_of", "user", "model",
                          "cache_salt"]
NULLABLE_DEFAULTS_CHAT = ["n", "stream", "logprobs", "top_logprobs", "presence_penalty", "min_tokens",
                          "max_completion_tokens", "ignore_eos", "temperature", "seed"]


def _ids(handle, body: dict, path: str = CMPL) -> tuple[str, int]:
    r = httpx.post(handle.base_url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice.get("text", choice.get("message", {}).get("content"))
    return text, r.json()["usage"]["completion_tokens"]


def test_null_means_default_for_every_optional_field(tiny_server):
    """Each field sent as null gives the same answer as the field left out (seeded, so a null
    temperature, i.e. 1, samples the same tokens both times)."""
    handle, _ = tiny_server
    routes = ((CMPL, GOOD, NULLABLE_DEFAULTS_CMPL), (CHAT, GOOD_CHAT, NULLABLE_DEFAULTS_CHAT))
    for path, good, fields in routes:
        for field in fields:
            base = {k: v for k, v in {**good, "seed": 11}.items() if k != field}
            assert _ids(handle, {**base, field: None}, path) == _ids(handle, base, path), field
    # A non-nullable field's default applies: n null -> 1 choice, stream null -> a JSON answer.
    r = httpx.post(handle.base_url + CMPL, json={**GOOD, "n": None, "stream": None})
    assert r.headers["content-type"] == "application/json" and len(r.json()["choices"]) == 1
    # max_tokens keeps vLLM's meaning of null: as many tokens as fit (ignore_eos: all of them).
    r = httpx.post(handle.base_url + CMPL, json={**GOOD, "max_tokens": None, "ignore_eos": True})
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 128


# (body changes, param, words the message must contain)
TYPE_CASES = [
    ({"max_tokens": True}, "max_tokens", "valid integer"),
    ({"n": True}, "n", "valid integer"),
    ({"n": 1.0}, "n", "valid integer"),
    ({"seed": False}, "seed", "valid integer"),
    ({"top_k": True}, "top_k", "valid integer"),
    ({"temperature": True}, "temperature", "valid number"),
    ({"top_p": False}, "top_p", "valid number"),
    ({"stream": 1}, "stream", "valid boolean"),
    ({"echo": 0}, "echo", "valid boolean"),
    ({"ignore_eos": "true"}, "ignore_eos", "valid boolean"),
    ({"prompt": [[False]]}, "prompt", "valid"),
    ({"prompt": [True, 5]}, "prompt", "valid"),
    ({"stop_token_ids": [True]}, "stop_token_ids", "valid integer"),
    ({"prompt": 5}, "prompt", "valid"),
]

RANGE_CASES = [
    ({"seed": 2**64}, "seed", "seed must be in [-2^63, 2^63 - 1], got 18446744073709551616"),
    ({"seed": 2**63}, "seed", "seed must be in [-2^63, 2^63 - 1]"),
    ({"seed": -(2**63) - 1}, "seed", "seed must be in [-2^63, 2^63 - 1]"),
    ({"top_k": 2**63}, "top_k", "in [1, 300] (the vocabulary size)"),
    ({"top_k": 301}, "top_k", "in [1, 300] (the vocabulary size), got 301"),
    ({"top_k": -2}, "top_k", "got -2"),
    ({"temperature": 1e308}, "temperature", "temperature must be in [0, 2], got 1e+308"),
    ({"temperature": 2.5}, "temperature", "temperature must be in [0, 2], got 2.5"),
    # the value as sent, not rounded to 6 digits ("got 2": a new user's trial, session 25)
    ({"temperature": 2.0000001}, "temperature", "temperature must be in [0, 2], got 2.0000001"),
    ({"stream_options": {"include_usage": True}}, "stream_options",
     "stream_options can only be set when stream is true"),
    ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options", "only be set when"),
    ({"cache_salt": ""}, "cache_salt", "cache_salt must be a non-empty string"),
]


@pytest.mark.parametrize("change,param,words", TYPE_CASES + RANGE_CASES,
                         ids=[f"{i}" for i in range(len(TYPE_CASES + RANGE_CASES))])
def test_strict_types_and_vllm_ranges(tiny_server, change, param, words):
    handle, _ = tiny_server
    r = httpx.post(handle.base_url + CMPL, json={**GOOD, **change})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert _ids(handle, GOOD)[1] == 3


def test_infinite_numbers_are_refused(tiny_server):
    handle, _ = tiny_server
    for raw in (b'{"model": "test-model", "prompt": "hi", "temperature": 1e400}',
                b'{"model": "test-model", "prompt": "hi", "top_p": NaN}'):
        r = httpx.post(handle.base_url + CMPL, content=raw, headers=JSON)
        assert r.status_code == 400, r.text


def test_range_limits_themselves_are_accepted(tiny_server):
    handle, _ = tiny_server
    for change in ({"seed": 2**63 - 1, "temperature": 2.0}, {"seed": -(2**63), "temperature": 1.0},
                   {"top_k": 300, "temperature": 1.0, "seed": 7}, {"top_k": -1},
                   {"stream": True, "stream_options": {"include_usage": True}}):
        r = httpx.post(handle.base_url + CMPL, json={**GOOD, **change})
        assert r.status_code == 200, (change, r.text)


def test_distinct_seeds_beyond_64_bits_no_longer_wrap(tiny_server):
    """Seeds s and s + 2^64 used to draw the same text; the second is now refused."""
    handle, _ = tiny_server
    body = {**GOOD, "temperature": 1.0, "max_tokens": 8}
    assert httpx.post(handle.base_url + CMPL, json={**body, "seed": 5}).status_code == 200
    assert httpx.post(handle.base_url + CMPL, json={**body, "seed": 5 + 2**64}).status_code == 400


def test_max_model_len_boundary_has_one_rule(tiny_server, tiny_offline):
    """A prompt of exactly max_model_len tokens leaves no room for a token: refused whatever
    max_tokens is; one token shorter is served with max_tokens 1 or null."""
    handle, _ = tiny_server
    full = [5] * 128
    for max_tokens in (None, 1):
        r = httpx.post(handle.base_url + CMPL, json={**GOOD, "prompt": full, "max_tokens": max_tokens})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "prompt"
        assert r.json()["error"]["message"] == ("This model's maximum context length is 128 tokens; the "
                                                "prompt has 128 tokens, which leaves no room for the "
                                                "completion (at least 1 token)")
    for max_tokens in (None, 1):
        r = httpx.post(handle.base_url + CMPL, json={**GOOD, "prompt": full[:-1], "max_tokens": max_tokens,
                                                     "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    r = httpx.post(handle.base_url + CMPL, json={**GOOD, "prompt": full[:-1], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    handle.assert_idle_and_clean()


def test_405_keeps_allow_header(tiny_server):
    handle, _ = tiny_server
    for method, path, allow in (("GET", CMPL, "POST"), ("DELETE", CHAT, "POST"), ("POST", "/health", "GET")):
        r = httpx.request(method, handle.base_url + path)
        assert r.status_code == 405 and r.headers["allow"] == allow
        assert r.json()["error"]["message"] == "Method Not Allowed"


def test_n_above_the_waiting_queue_is_400_and_a_full_queue_503_has_retry_after(tiny_loaded):
    from segserve import LLMEngine

    engine = LLMEngine(tiny_loaded, block_size=8, num_kv_blocks=64, max_num_seqs=1)
    with running_server(engine, max_waiting_requests=2) as (handle, throttle):
        r = httpx.post(handle.base_url + CMPL, json={**GOOD, "n": 3})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {
            "message": "n=3 can never be served: it is above the waiting-queue capacity "
                       "max_waiting_requests=2", "type": "invalid_request_error", "param": "n", "code": None}
        assert "retry-after" not in r.headers
        throttle.delay_s = 0.02
        long_body = {**GOOD, "max_tokens": 40, "ignore_eos": True}
        threads = [threading.Thread(target=lambda: httpx.post(handle.base_url + CMPL, json=long_body,
                                                              timeout=60)) for _ in range(3)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        waiting = lambda: len(handle.engine.engine.scheduler.waiting)  # noqa: E731
        deadline = time.monotonic() + 10
        while handle.on_engine(waiting) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = httpx.post(handle.base_url + CMPL, json={**GOOD, "n": 2})
        throttle.delay_s = 0.0
        for t in threads:
            t.join(60)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "queue_full"
        # n above max_num_seqs=1 is servable (the completions run one after another): not refused.
        r = httpx.post(handle.base_url + CMPL, json={**GOOD, "n": 2, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1]
        assert r.json()["usage"]["completion_tokens"] == 6
        handle.assert_idle_and_clean()


def test_validation_messages_name_the_field_path_and_the_value(tiny_server):
    handle, _ = tiny_server
    cases = [
        (CMPL, {**GOOD, "prompt": [[False]]}, "prompt",
         "prompt.0.0: Input should be a valid integer (got false)"),
        # A fresh user's trial (2026-12-05): a number in a prompt's list was named as a bad string (the
        # list[str] member's complaint); the token-id member's says what the client meant.
        (CMPL, {**GOOD, "prompt": [1.5, 2]}, "prompt",
         "prompt.0: Input should be a valid integer (got 1.5)"),
        (CMPL, {**GOOD, "prompt": [True, 2]}, "prompt",
         "prompt.0: Input should be a valid integer (got true)"),
        (CMPL, {**GOOD, "prompt": ["a", 3]}, "prompt", "prompt.1: Input should be a valid string (got 3)"),
        (CMPL, {**GOOD, "stop": 5}, "stop", "stop: Input should be a valid string (got 5)"),
        (CMPL, {**GOOD, "stream": True, "stream_options": {"include_usage": 1}}, "stream_options",
         "stream_options.include_usage: Input should be a valid boolean (got 1)"),
        (CHAT, {**GOOD_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "text": "a"}]}]},
         "messages", "messages[0].content: content part type 'image_url' is not supported (only 'text')"),
    ]
    for path, body, param, message in cases:
        r = httpx.post(handle.base_url + path, json=body)
        assert r.status_code == 400
        assert r.json()["error"]["param"] == param and r.json()["error"]["message"] == message
