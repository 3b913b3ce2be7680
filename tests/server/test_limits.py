"""Limits checked before work (issue 17, item 1): a body above ``--max-request-body-bytes`` is a 413 in
OpenAI's shape without being read, a text prompt that cannot fit ``max_model_len`` is refused without
tokenizing it, errors quote at most a short prefix of a bad value, tokenizing runs off the event loop,
and memory returns to its baseline after a burst of refused giant bodies."""

from __future__ import annotations

import json
import threading
import time

import httpx
import psutil
import pytest

from tests.server.harness import SERVED_NAME, running_server

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
JSON = {"content-type": "application/json"}
LIMIT = 1_000_000  # bytes: the body limit of the small-limit server below


def _giant_body(n_chars: int = 20_000_000) -> bytes:
    return json.dumps({"model": SERVED_NAME, "prompt": "a" * n_chars, "max_tokens": 2}).encode()


def _good(base_url: str) -> None:
    good = httpx.post(base_url + CMPL, json={"model": SERVED_NAME, "prompt": "The quick brown fox",
                                             "max_tokens": 2, "temperature": 0})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


def test_20mb_body_is_413_within_a_second_and_memory_returns_to_baseline(tiny_server):
    handle, _ = tiny_server
    body = _giant_body()
    proc = psutil.Process()
    _good(handle.base_url)  # warm: the first request allocates the app's own buffers
    baseline = proc.memory_info().rss
    for _ in range(10):
        t0 = time.perf_counter()
        r = httpx.post(handle.base_url + CMPL, content=body, headers=JSON, timeout=30)
        elapsed = time.perf_counter() - t0
        assert r.status_code == 413, r.text
        assert elapsed < 1.0, f"refusing a 20 MB body took {elapsed:.2f} s"
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "request_too_large"
        assert error["message"] == (f"request body is {len(body)} bytes, above the limit of 8388608 bytes "
                                    "(--max-request-body-bytes)")
    grown = proc.memory_info().rss - baseline
    assert grown < 100 * 2**20, f"resident memory grew {grown / 2**20:.0f} MiB over 10 refused bodies"
    _good(handle.base_url)
    handle.assert_idle_and_clean()


@pytest.fixture(scope="module")
def small_limit_server(tiny_loaded):
    from segserve import LLMEngine
    from tests.server.conftest import TINY_ENGINE

    with running_server(LLMEngine(tiny_loaded, **TINY_ENGINE), max_request_body_bytes=LIMIT) as hs:
        yield hs


def test_body_limit_flag_and_chunked_body_without_length(small_limit_server):
    handle, _ = small_limit_server
    over = _giant_body(LIMIT)  # a few bytes above the limit once wrapped in JSON
    r = httpx.post(handle.base_url + CMPL, content=over, headers=JSON)
    assert r.status_code == 413 and f"above the limit of {LIMIT} bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the server counts what arrives and stops reading at the limit
        for _ in range(50):
            yield b" " * 100_000

    r = httpx.post(handle.base_url + CMPL, content=chunks(), headers=JSON)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["message"] == (f"request body is more than {LIMIT} bytes, above the limit of "
                                            f"{LIMIT} bytes (--max-request-body-bytes)")
    # A body just under the limit is read and answered on its merits.
    under = json.dumps({"model": SERVED_NAME, "prompt": "hi", "max_tokens": 2, "user": "u" * (LIMIT - 200)})
    assert len(under) < LIMIT
    r = httpx.post(handle.base_url + CMPL, content=under.encode(), headers=JSON)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    handle.assert_idle_and_clean()


def test_prompt_too_long_in_characters_is_refused_without_tokenizing(tiny_server):
    handle, _ = tiny_server
    serving_llm = handle.engine.engine
    bound = 2 * 128 * max(len(t) for t in serving_llm.tokenizer.get_vocab())
    calls = []
    original = serving_llm.tokenizer.encode

    def counting_encode(text, *a, **kw):
        calls.append(len(text))
        return original(text, *a, **kw)

    serving_llm.tokenizer.encode = counting_encode
    try:
        for path, body, param in [
            (CMPL, {"model": SERVED_NAME, "prompt": "a" * (bound + 1)}, "prompt"),
            (CMPL, {"model": SERVED_NAME, "prompt": ["a" * 4_000_000]}, "prompt"),
            (CHAT, {"model": SERVED_NAME, "messages": [{"role": "user", "content": "b" * 4_000_000}]},
             "messages"),
        ]:
            t0 = time.perf_counter()
            r = httpx.post(handle.base_url + path, json=body, timeout=30)
            assert time.perf_counter() - t0 < 1.0
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == param
            assert "maximum context length is 128 tokens" in error["message"]
            assert f"more than any text of 128 tokens can have ({bound})" in error["message"]
        assert calls == [], "a prompt beyond the character bound was tokenized"
    finally:
        serving_llm.tokenizer.encode = original
    _good(handle.base_url)


def test_a_client_waiting_for_100_continue_gets_413_without_sending_the_body(tiny_server):
    import socket

    handle, _ = tiny_server
    host, port = handle.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 20000000\r\nExpect: 100-continue\r\n\r\n")
        answer = b""
        while b"--max-request-body-bytes" not in answer:
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 "), answer
    assert b"request body is 20000000 bytes, above the limit of 8388608 bytes" in answer
    _good(handle.base_url)


@pytest.fixture(scope="module")
def large_limit_server(tiny_loaded):
    from segserve import LLMEngine
    from tests.server.conftest import TINY_ENGINE

    with running_server(LLMEngine(tiny_loaded, **TINY_ENGINE), max_request_body_bytes=64 * 2**20) as hs:
        yield hs


def test_giant_prompts_under_a_raised_body_limit_are_refused_without_ratcheting_memory(large_limit_server):
    """With the body limit raised above 20 MB, the body is parsed and the character bound refuses it:
    quickly, and memory does not ratchet from one refused request to the next."""
    handle, _ = large_limit_server
    bodies = [_giant_body(), json.dumps({"model": SERVED_NAME, "messages": [
        {"role": "user", "content": "a" * 20_000_000}]}).encode()]
    proc = psutil.Process()
    warm = None
    for i in range(10):
        t0 = time.perf_counter()
        r = httpx.post(handle.base_url + (CMPL, CHAT)[i % 2], content=bodies[i % 2], headers=JSON, timeout=60)
        elapsed = time.perf_counter() - t0
        assert elapsed < 10.0, f"refusing a 20 MB prompt took {elapsed:.1f} s"  # ~0.5 s at load 10
        assert r.status_code == 400 and "characters, more than any text of 128 tokens" in r.text
        if i == 1:  # both routes have allocated their buffers once
            warm = proc.memory_info().rss
    ratchet = proc.memory_info().rss - warm
    # Issue 17's bound (100 MB): the defect grew 1.2-2.7 GB per request. This is the whole pytest
    # process, so allocator arenas of earlier tests move it by tens of MiB (57 MiB seen in a full run).
    assert ratchet < 100 * 2**20, f"resident memory grew {ratchet / 2**20:.0f} MiB over 8 more refusals"
    _good(handle.base_url)


def test_errors_quote_only_a_short_prefix_of_the_bad_value(tiny_server):
    handle, _ = tiny_server
    cases = [
        {"model": SERVED_NAME, "prompt": "hi", "temperature": "x" * 500_000},
        {"model": SERVED_NAME, "prompt": "hi", "stop": {"k": "v" * 500_000}},
        {"model": "m" * 500_000, "prompt": "hi"},
        {"model": SERVED_NAME, "prompt": "hi", "seed": 10**5000},
        {"model": SERVED_NAME, "prompt": "hi", "stop": ["s" * 500_000, ""]},  # the engine's own check
    ]
    for body in cases:
        raw = json.dumps(body).encode() if "seed" not in body else (
            b'{"model": "test-model", "prompt": "hi", "seed": 1' + b"0" * 5000 + b"}")
        r = httpx.post(handle.base_url + CMPL, content=raw, headers=JSON)
        assert r.status_code in (400, 404), r.text
        assert len(r.content) < 500, f"error body of {len(r.content)} bytes"
    r = httpx.post(handle.base_url + CMPL, json=cases[0])
    assert r.json()["error"]["message"] == ("temperature: Input should be a valid number "
                                            f"(got '{'x' * 40}... (500000 characters)')")
    _good(handle.base_url)


def test_lone_surrogate_in_model_is_404_not_500(tiny_server):
    handle, _ = tiny_server
    raw = b'{"model": "\\ud800", "prompt": "hi"}'
    r = httpx.post(handle.base_url + CMPL, content=raw, headers=JSON)
    assert r.status_code == 404, r.text
    message = r.json()["error"]["message"]
    assert message == "The model `\\ud800` does not exist; this server serves ['test-model']"
    raw = b'{"model": "test-model", "messages": [{"role": "\\udfff", "content": "\\ud800"}]}'
    r = httpx.post(handle.base_url + CHAT, content=raw, headers=JSON)
    assert r.status_code in (200, 400), r.text
    _good(handle.base_url)


def test_tokenizing_runs_off_the_event_loop(tiny_server):
    """While one request tokenizes for 1.5 s, /health and another request are answered. A long prompt:
    those of at most INLINE_PROMPT_CHARS characters are tokenized on the loop (they take well under a
    millisecond; test_routes_cli checks where each goes)."""
    from segserve.entrypoints.openai.serving import INLINE_PROMPT_CHARS

    long_prompt = "SLOW prompt" + " x" * (INLINE_PROMPT_CHARS // 2)
    handle, _ = tiny_server
    serving_llm = handle.engine.engine
    original = serving_llm.tokenizer.encode
    started = threading.Event()

    def slow_encode(text, *a, **kw):
        if text.startswith("SLOW"):
            started.set()
            time.sleep(1.5)
        return original(text, *a, **kw)

    serving_llm.tokenizer.encode = slow_encode
    try:
        slow = threading.Thread(target=lambda: httpx.post(
            handle.base_url + CMPL, json={"model": SERVED_NAME, "prompt": long_prompt, "max_tokens": 1},
            timeout=30))
        slow.start()
        assert started.wait(10)
        t0 = time.perf_counter()
        assert httpx.get(handle.base_url + "/health").status_code == 200
        assert time.perf_counter() - t0 < 0.5
        slow.join(30)
    finally:
        serving_llm.tokenizer.encode = original
