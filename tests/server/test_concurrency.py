"""Many clients at once on the tiny model: shared prefixes, a client that leaves mid-stream, a bounded
load test whose counts must match ``/metrics``."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.server.checks import concurrent_shared_prefixes
from tests.server.harness import SERVED_NAME, metric, run_load, scrape, summarize


def test_16_concurrent_streams_with_shared_prefixes(tiny_server, tiny_offline):
    handle, _ = tiny_server
    prefix = "The quick brown fox jumps over the lazy dog. Paged attention keeps the cache in blocks;"
    suffixes = [f" chunk {i} prefill" for i in range(12)] + [" decodes", " split", " a long prompt", " x"]
    lengths = [3 + (5 * i) % 17 for i in range(16)]
    usages = concurrent_shared_prefixes(handle, tiny_offline, prefix, suffixes, lengths)
    assert len(usages) == 16


def _stream_then_leave(handle, body, seen: list | None = None) -> float | None:
    """Read 3 SSE events, check the request holds blocks, leave; seconds until its blocks are back.

    None when the request already held no blocks while its client was still reading; the caller retries
    once, so a real leak still fails the test. ``seen`` gets what the client read then and whether the
    engine still had a request, for the failure message.

    The line iterator is held across the check: a ``for line in r.iter_lines(): ... break`` drops it at
    the ``break``, and closing that generator closes httpcore's stream and with it the connection, so the
    client did leave before the check and the server's abort raced it (the old flake, ~1 in 30 suite
    runs, twice in a row in one run on 2026-12-05: "a disconnect the client did not send").
    """
    with httpx.Client(base_url=handle.base_url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            got = []
            lines = r.iter_lines()  # held until the check below (see the docstring)
            for line in lines:
                if line.startswith("data: "):
                    got.append(line)
                if len(got) == 3:
                    break
            if handle.usable_blocks - handle.free_blocks() == 0:
                if seen is not None:  # what the client read, and whether the engine still has the request
                    running = handle.on_engine(lambda: handle.engine.engine.has_unfinished_requests())
                    seen.append((r.status_code, got, handle.free_blocks(), handle.usable_blocks, running))
                return None
            lines.close()  # now leave: closes the stream, and the connection with it
    left = time.monotonic()
    while handle.free_blocks() != handle.usable_blocks and time.monotonic() - left < 1.0:
        time.sleep(0.01)
    return time.monotonic() - left


def test_disconnect_mid_stream_frees_blocks_within_1s(tiny_server):
    handle, throttle = tiny_server
    before = scrape(handle.base_url)
    body = {"model": SERVED_NAME, "prompt": "The quick brown fox jumps over the lazy dog.", "max_tokens": 90,
            "temperature": 0, "ignore_eos": True, "stream": True}
    throttle.delay_s = 0.1  # ~9 s for 90 tokens: the client leaves long before the end
    seen: list = []
    try:
        freed_after = _stream_then_leave(handle, body, seen)
        attempts = 1
        if freed_after is None:
            handle.assert_idle_and_clean()
            freed_after, attempts = _stream_then_leave(handle, body, seen), 2
    finally:
        throttle.delay_s = 0.0
    assert freed_after is not None, f"the request held no blocks while its client was reading (twice): {seen}"
    assert freed_after < 1.0, f"blocks still held {freed_after:.2f} s after the client left"
    handle.assert_idle_and_clean()
    after = scrape(handle.base_url)
    aborted = ("vllm:request_success_total", "abort")
    assert metric(after, aborted[0], finished_reason=aborted[1]) == attempts + metric(
        before, aborted[0], finished_reason=aborted[1])
    # The server keeps serving.
    r = httpx.post(f"{handle.base_url}/v1/completions", json={**body, "stream": False, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_disconnect_while_waiting_for_a_whole_response_aborts(tiny_server):
    handle, throttle = tiny_server
    body = {"model": SERVED_NAME, "prompt": "The lazy dog", "max_tokens": 90, "temperature": 0,
            "ignore_eos": True}
    throttle.delay_s = 0.1
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=0.5)
        left = time.monotonic()
        while handle.free_blocks() != handle.usable_blocks and time.monotonic() - left < 1.0:
            time.sleep(0.01)
        freed_after = time.monotonic() - left
    finally:
        throttle.delay_s = 0.0
    assert freed_after < 1.0, f"blocks still held {freed_after:.2f} s after the client left"
    handle.assert_idle_and_clean()


def test_load_200_requests_concurrency_16_and_metrics_match(tiny_server):
    handle, _ = tiny_server
    before = scrape(handle.base_url)
    t0 = time.perf_counter()
    results = asyncio.run(run_load(handle.base_url, SERVED_NAME, num_requests=200, concurrency=16,
                                   timeout_s=120))
    summary = summarize(results, time.perf_counter() - t0)
    print("load:", summary)
    assert summary["requests"] == 200 and summary["errors"] == 0, summary
    assert all(r.done_marker for r in results if r.streamed)
    assert all(r.completion_tokens == (2, 4, 8)[i % 3] for i, r in enumerate(results))  # ignore_eos
    assert summary["cached_tokens"] > 0
    handle.assert_idle_and_clean()
    after = scrape(handle.base_url)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("vllm:request_success_total", finished_reason="length") == 200
    assert delta("vllm:generation_tokens_total") == sum(r.completion_tokens for r in results)
    assert delta("vllm:prompt_tokens_total") == sum(r.prompt_tokens for r in results)
    assert delta("vllm:prefix_cache_queries_total") == sum(r.prompt_tokens for r in results)
    assert delta("vllm:prefix_cache_hits_total") == sum(r.cached_tokens for r in results)
    for hist in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert delta(f"vllm:{hist}_seconds_count") == 200
    # One inter-token gap per token after the first.
    assert delta("vllm:inter_token_latency_seconds_count") == sum(r.completion_tokens - 1 for r in results)
    # Per finished request: token counts and phase times (vLLM's names, labels model_name + engine).
    prompt, completion = sum(r.prompt_tokens for r in results), sum(r.completion_tokens for r in results)
    assert delta("vllm:request_prompt_tokens_count") == 200
    assert delta("vllm:request_prompt_tokens_sum") == prompt
    assert delta("vllm:request_generation_tokens_sum") == completion
    for phase in ("prefill", "decode", "inference"):
        assert delta(f"vllm:request_{phase}_time_seconds_count") == 200
    # vLLM 0.32's other per-request figures: mean time per output token, prompt tokens computed, n, the
    # longest completion; cached prompt tokens as a counter.
    cached = sum(r.cached_tokens for r in results)
    assert delta("vllm:request_time_per_output_token_seconds_count") == 200
    assert delta("vllm:request_prefill_kv_computed_tokens_sum") == prompt - cached
    assert delta("vllm:prompt_tokens_cached_total") == cached
    assert delta("vllm:request_params_n_sum") == delta("vllm:request_params_n_count") == 200
    assert delta("vllm:request_max_num_generation_tokens_sum") == completion
    assert delta("vllm:request_params_max_tokens_sum") == completion  # ignore_eos: each ran to max_tokens
    for reason in ("capacity", "deferred"):
        assert metric(after, "vllm:num_requests_waiting_by_reason", reason=reason) == 0
    # Every step's prompt tokens computed (cache hits are not) plus its generated tokens.
    cached = sum(r.cached_tokens for r in results)
    assert delta("vllm:iteration_tokens_total_sum") == prompt - cached + completion
    edges = sorted(float(dict(k[1])["le"]) for k in after if k[0] == "vllm:request_prompt_tokens_bucket")
    assert edges == [1, 2, 5, 10, 20, 50, 100, float("inf")]  # vLLM's 1-2-5 buckets to max_model_len 128
    phase_edges = sorted(float(dict(k[1])["le"]) for k in after
                         if k[0] == "vllm:request_prefill_time_seconds_bucket")
    assert phase_edges[:3] == [0.3, 0.5, 0.8] and phase_edges[-2:] == [7680.0, float("inf")]
    assert metric(after, "vllm:num_requests_running") == metric(after, "vllm:num_requests_waiting") == 0
    assert metric(after, "vllm:kv_cache_usage_perc") == 0


def test_a_request_of_n_completions_counts_as_n_requests(tiny_server):
    """Regression (a fresh user's trial, 2026-12-05): n=2 counted once in vllm:request_success and the
    per-request histograms, and its prompt once; vLLM runs each completion as a request of its own and
    counts n of each."""
    handle, _ = tiny_server
    before = scrape(handle.base_url)
    body = {"model": SERVED_NAME, "prompt": "The quick brown fox", "max_tokens": 4, "n": 3,
            "temperature": 1.0, "seed": 7, "ignore_eos": True}
    r = httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 12
    handle.assert_idle_and_clean()
    after = scrape(handle.base_url)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:prompt_tokens_total") == 3 * usage["prompt_tokens"]
    assert delta("vllm:generation_tokens_total") == 12
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds"):
        assert delta(f"vllm:{hist}_count") == 3, hist
    assert delta("vllm:request_prompt_tokens_sum") == 3 * usage["prompt_tokens"]
    assert delta("vllm:request_generation_tokens_sum") == 12
    assert delta("vllm:inter_token_latency_seconds_count") == 3 * 3  # each completion's gaps
    assert delta("vllm:request_time_per_output_token_seconds_count") == 3
    assert delta("vllm:request_prefill_kv_computed_tokens_count") == 3
    # Per request (vLLM's parent): its n, and the most tokens one completion generated.
    assert delta("vllm:request_params_n_count") == 1 and delta("vllm:request_params_n_sum") == 3
    assert delta("vllm:request_max_num_generation_tokens_sum") == 4
    assert delta("vllm:request_params_max_tokens_count") == 3
    assert delta("vllm:request_params_max_tokens_sum") == 12


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_of_n_completions_carries_one_choice_a_chunk(tiny_server, path):
    """vLLM streams each choice's delta in a chunk of its own; a fresh user's trial (2026-12-05) saw both
    choices of n=2 in one chunk. Joined per index, the deltas equal the whole response's choices."""
    from tests.server.harness import sse_events

    handle, _ = tiny_server
    body = {"model": SERVED_NAME, "max_tokens": 5, "n": 2, "temperature": 0, "ignore_eos": True}
    body |= ({"prompt": "The quick brown fox"} if "chat" not in path
             else {"messages": [{"role": "user", "content": "The quick brown fox"}]})
    whole = httpx.post(f"{handle.base_url}{path}", json=body, timeout=60).json()
    with httpx.stream("POST", f"{handle.base_url}{path}", json={**body, "stream": True}, timeout=60) as r:
        events = sse_events(list(r.iter_lines()))
    chunks = [e for e in events if isinstance(e, dict)]
    assert chunks and all(len(e["choices"]) == 1 for e in chunks)
    text = {0: "", 1: ""}
    for e in chunks:
        choice = e["choices"][0]
        text[choice["index"]] += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    want = [c.get("text", (c.get("message") or {}).get("content")) for c in whole["choices"]]
    assert [text[0], text[1]] == want


def test_a_chat_stream_sends_no_empty_role_chunk_for_a_choice_still_in_prefill():
    """Regression (a second trial, 2026-12-05): at a small budget the two completions of n=2 can reach their
    first token in different steps, and the later one got a chunk of role and empty content at the
    earlier one's first token. The role comes with each choice's own first token."""
    import json
    from types import SimpleNamespace

    from segserve.entrypoints.openai.serving_chat import _chat_events
    from segserve.outputs import CompletionOutput, RequestOutput

    def out(second: list[int], finished: bool = False) -> RequestOutput:
        reason = "length" if finished else None
        return RequestOutput("r", None, [1, 2], None, [
            CompletionOutput(0, "ab"[: len(second) + 1], [5, 6][: len(second) + 1], finish_reason=reason),
            CompletionOutput(1, "xy"[: len(second)], second, finish_reason=reason)], finished)

    async def outputs():
        for o in (out([]), out([7]), out([7, 8], finished=True)):
            yield 0, o

    async def run() -> list[dict]:
        req = SimpleNamespace(continuous_usage=False, include_usage=False)
        events = _chat_events(None, outputs(), "r", "m", None, req, SimpleNamespace(mode="none"))
        return [json.loads(e.removeprefix("data: ")) async for e in events]

    chunks = [c["choices"][0] for c in asyncio.run(run())]
    got = [(c["index"], c["delta"].get("role"), c["delta"].get("content"), c["finish_reason"])
           for c in chunks]
    assert got == [(0, "assistant", "a", None), (0, None, "b", None), (1, "assistant", "x", None),
                   (0, None, None, "length"), (1, None, "y", "length")]
    # A delta carries only what it sets, as vLLM (``exclude_unset``) and OpenAI send it: no
    # ``"role": null`` or ``"tool_calls": null`` in every chunk (a new user's trial, 2026-12-05).
    assert [c["delta"] for c in chunks] == [{"role": "assistant", "content": "a"}, {"content": "b"},
                                            {"role": "assistant", "content": "x"}, {}, {"content": "y"}]


def test_chat_text_parts_reach_the_template_joined_by_newlines(tiny_server):
    """vLLM's "string" content format joins text parts with newlines (a second trial: they were joined
    with nothing)."""
    handle, _ = tiny_server
    parts = {"model": SERVED_NAME, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    joined = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "a\nb"}]}
    tokens = [httpx.post(f"{handle.base_url}/tokenize", json=b).json()["tokens"] for b in (parts, joined)]
    assert tokens[0] == tokens[1]


def test_max_tokens_not_sent_counts_as_the_room_left(tiny_server):
    """vllm:request_params_max_tokens of a request without max_tokens: max_model_len - prompt, the value
    vLLM's server fills in (a second trial: such requests were left out)."""
    handle, _ = tiny_server
    before = scrape(handle.base_url)
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
            "stop_token_ids": list(range(300))}  # every token stops it: one token
    r = httpx.post(f"{handle.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    prompt = r.json()["usage"]["prompt_tokens"]
    after = scrape(handle.base_url)
    assert metric(after, "vllm:request_params_max_tokens_sum") - metric(
        before, "vllm:request_params_max_tokens_sum") == 128 - prompt
