"""Every bad request gets the right status and OpenAI's error shape, and the next good request
succeeds; a full waiting queue answers 503 while the engine keeps serving the admitted requests."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.harness import SERVED_NAME, running_server

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
GOOD = {"model": SERVED_NAME, "prompt": "The quick brown fox", "max_tokens": 2, "temperature": 0}
MSGS = [{"role": "user", "content": "hi"}]
LONG = "The quick brown fox jumps over the lazy dog. " * 20  # > 128 tokens of the tiny model

# (path, body or raw bytes, status, param, words the message must contain)
CASES = [
    (CMPL, {**GOOD, "prompt": ""}, 400, "prompt", "empty"),
    (CMPL, {**GOOD, "prompt": []}, 400, "prompt", "empty"),
    (CMPL, {**GOOD, "max_tokens": 0}, 400, "max_tokens", ">= 1 without echo, got 0"),
    (CMPL, {**GOOD, "max_tokens": -5}, 400, "max_tokens", "got -5"),
    (CHAT, {"model": SERVED_NAME, "messages": MSGS, "max_tokens": 0}, 400, "max_tokens", "got 0"),
    (CMPL, {**GOOD, "temperature": -0.5}, 400, "temperature", "temperature must be in [0, 2], got -0.5"),
    (CMPL, {**GOOD, "top_p": 0}, 400, "top_p", "(0, 1], got 0.0"),
    (CMPL, {**GOOD, "top_p": 1.5}, 400, "top_p", "(0, 1], got 1.5"),
    (CHAT, {"model": SERVED_NAME, "messages": MSGS, "top_p": 0}, 400, "top_p", "(0, 1]"),
    (CMPL, {**GOOD, "n": 129}, 400, "n", "[1, 128], got 129"),
    (CMPL, {**GOOD, "n": 0}, 400, "n", "got 0"),
    (CMPL, {**GOOD, "prompt": LONG}, 400, "prompt", "maximum context length is 128"),
    (CMPL, {**GOOD, "max_tokens": 127}, 400, "max_tokens", "maximum context length is 128"),
    (CHAT, {"model": SERVED_NAME, "messages": [{"role": "user", "content": LONG}]}, 400, "messages",
     "maximum context length is 128"),
    (CMPL, b'{"prompt": "hi", ', 400, None, "malformed JSON"),
    (CHAT, b"not json at all", 400, None, "malformed JSON"),
    (CMPL, {"model": SERVED_NAME}, 400, "prompt", "prompt"),
    (CMPL, {**GOOD, "temperature": "hot"}, 400, "temperature", "valid number"),
    (CHAT, {"model": SERVED_NAME, "messages": []}, 400, "messages", "empty"),
    (CMPL, {**GOOD, "prompt": [5, 300]}, 400, "prompt", "outside the vocabulary [0, 300)"),
    (CMPL, {**GOOD, "prompt": ["a", ""]}, 400, "prompt", "empty"),
    (CMPL, {**GOOD, "presence_penalty": 2.5}, 400, "presence_penalty", "[-2, 2], got 2.5"),
    (CMPL, {**GOOD, "model": "gpt-4"}, 404, "model", "`gpt-4` does not exist"),
    (CHAT, {"model": "nope", "messages": MSGS}, 404, "model", "`nope` does not exist"),
    ("/v1/embeddings", {"model": SERVED_NAME, "input": "x"}, 404, None, "Not Found"),
    # A fresh user's trial (2026-12-05): no limit on stop strings, validator text with pydantic's
    # "Value error, " and a second "(got ...)", the chat limit named max_tokens, no param for a check
    # across fields, tokenizer internals for a lone surrogate, no word of UTF-8 for a non-UTF-8 body.
    (CMPL, {**GOOD, "stop": ["zz"] * 65}, 400, "stop", "stop holds 65 strings, more than the limit of 64"),
    (CMPL, {**GOOD, "temperature": 3}, 400, "temperature", "temperature must be in [0, 2], got 3"),
    (CMPL, {**GOOD, "seed": 2**64}, 400, "seed", "seed must be in [-2^63, 2^63 - 1], got"),
    (CHAT, {"model": SERVED_NAME, "messages": MSGS, "max_completion_tokens": -5}, 400,
     "max_completion_tokens", "max_completion_tokens must be an int >= 1, got -5"),
    (CMPL, {**GOOD, "min_tokens": 10, "max_tokens": 2}, 400, "min_tokens",
     "min_tokens=10 must be <= max_tokens=2"),
    (CMPL, b'{"model": "%s", "prompt": "\\ud800 Hi", "max_tokens": 2}' % SERVED_NAME.encode(), 400, "prompt",
     "lone UTF-16 surrogate U+D800 at character 0"),
    (CMPL, b'{"model": "x", "prompt": "\xff\xfe"}', 400, None, "malformed body: not valid UTF-8 JSON"),
    # valid JSON nested past the parser's recursion limit (was "not valid UTF-8 JSON": a trial's finding)
    (CMPL, b'{"model": "x", "prompt": "a", "metadata": ' + b"[" * 3000 + b"]" * 3000 + b"}", 400, None,
     "malformed body: JSON nested too deeply to parse"),
    # an empty body said "body: Field required (got null)" (a fresh user's trial, 2026-12-05)
    (CMPL, b"", 400, None, "the request body is empty: a JSON object is expected"),
    (CHAT, b"", 400, None, "the request body is empty: a JSON object is expected"),
]


def test_a_body_sent_without_the_json_content_type_says_so(tiny_server):
    """curl -d sends application/x-www-form-urlencoded, and FastAPI then reads no JSON: the message named
    pydantic's "valid dictionary" (a fresh user's trial, 2026-12-05), now the header."""
    handle, _ = tiny_server
    r = httpx.post(handle.base_url + CMPL, content=b'{"model": "x", "prompt": "hi"}',
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400
    want = ("the body must be a JSON object sent with Content-Type: application/json, got Content-Type: "
            "application/x-www-form-urlencoded")
    assert r.json()["error"]["message"] == want
    r = httpx.post(handle.base_url + CMPL, content=b'[1, 2]', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "Content-Type" not in r.json()["error"]["message"]  # JSON, not an object


def _post(base_url: str, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(base_url + path, content=body, headers={"content-type": "application/json"})
    return httpx.post(base_url + path, json=body)


@pytest.mark.parametrize("path,body,status,param,words", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_bad_input_answers_in_openai_shape_then_good_request_works(tiny_server, path, body, status,
                                                                    param, words):
    handle, _ = tiny_server
    r = _post(handle.base_url, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"], error
    assert "Value error" not in error["message"] and error["message"].count("got ") <= 1, error
    # The field is named once (a second trial: "temperature: temperature must be in [0, 2], got 3").
    assert param is None or not error["message"].startswith(f"{param}: {param} "), error
    assert error["param"] == param
    good = _post(handle.base_url, CMPL, GOOD)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


def test_full_waiting_queue_answers_503_and_keeps_serving(tiny_loaded):
    """max_num_seqs=1 and a waiting bound of 2: one running, two waiting, the fourth is refused."""
    from segserve import LLMEngine

    engine = LLMEngine(tiny_loaded, block_size=8, num_kv_blocks=64, max_num_seqs=1)
    with running_server(engine, max_waiting_requests=2) as (handle, throttle):
        throttle.delay_s = 0.02
        long_body = {**GOOD, "max_tokens": 40, "ignore_eos": True}
        answers: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda: answers.append(_post(handle.base_url, CMPL, long_body)))
                   for _ in range(3)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        waiting = lambda: len(handle.engine.engine.scheduler.waiting)  # noqa: E731
        deadline = time.monotonic() + 10
        while handle.on_engine(waiting) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert handle.on_engine(waiting) == 2
        refused = _post(handle.base_url, CMPL, GOOD)
        throttle.delay_s = 0.0
        for t in threads:
            t.join(30)
        assert refused.status_code == 503
        error = refused.json()["error"]
        assert "max_waiting_requests=2" in error["message"] and error["code"] == "queue_full"
        assert [a.status_code for a in answers] == [200, 200, 200]
        assert all(a.json()["usage"]["completion_tokens"] == 40 for a in answers)
        assert _post(handle.base_url, CMPL, GOOD).status_code == 200
        handle.assert_idle_and_clean()


def test_a_cache_smaller_than_the_model_length_serves_requests_without_max_tokens(tiny_loaded):
    """Regression (a fresh user's trial, 2026-12-05): with a KV cache smaller than the model's context
    (``--num-kv-blocks 8``) the server started at max_model_len 8192 and refused every chat request
    without ``max_tokens`` (it asked for up to 8192 tokens of cache). The length is now lowered to
    what the cache holds, reported by /v1/models, and such requests run to it."""
    from segserve import LLMEngine

    engine = LLMEngine(tiny_loaded, block_size=8, num_kv_blocks=9)  # 64 tokens; the model's 128
    assert engine.max_model_len == 64
    with running_server(engine) as (handle, _):
        models = httpx.get(f"{handle.base_url}/v1/models").json()["data"]
        assert [m["max_model_len"] for m in models] == [64]
        r = httpx.post(f"{handle.base_url}/v1/chat/completions", timeout=60,
                       json={"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}],
                             "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 64
        handle.assert_idle_and_clean()
