"""Test harness for the OpenAI-compatible server: an in-process uvicorn on 127.0.0.1 and a free port,
helpers that run code on the engine thread, a Prometheus scraper and a bounded load generator.

The load generator also runs from the command line against any server:
``python -m tests.server.harness --base-url http://127.0.0.1:8000 --requests 200 --concurrency 16``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

SERVED_NAME = "test-model"


@dataclass
class ServerHandle:
    """A running server: its URL, the async engine and the engine it drives."""

    base_url: str
    engine: Any  # AsyncLLMEngine
    app: Any = None  # the FastAPI app (``app.state.serving``: its OpenAIServing)

    def on_engine(self, fn, timeout_s: float = 30.0):
        """Run ``fn()`` on the engine thread (the only thread allowed to touch the engine)."""
        return self.engine.call(fn).result(timeout_s)

    def free_blocks(self) -> int:
        return self.on_engine(lambda: self.engine.engine.scheduler.kv_cache_manager.pool.num_free_blocks)

    @property
    def usable_blocks(self) -> int:
        return self.engine.engine.num_kv_blocks - 1

    def assert_idle_and_clean(self) -> None:
        """No request left, invariants hold, every block back in the pool."""
        eng = self.engine.engine

        def check() -> tuple[bool, int]:
            eng.check_integrity()
            return eng.has_unfinished_requests(), eng.scheduler.kv_cache_manager.pool.num_free_blocks

        unfinished, free = self.on_engine(check)
        assert not unfinished, "requests left in the engine"
        assert free == self.usable_blocks, f"{self.usable_blocks - free} blocks leaked"


class Throttle:
    """Step observer that sleeps ``delay_s`` after each step with output, so a test can act mid-request
    on a tiny model whose steps take milliseconds."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s

    def on_step(self, info) -> None:
        if info.outputs and self.delay_s:
            time.sleep(self.delay_s)

    def on_add(self, request_id: str, params) -> None:
        pass

    def on_abort(self, request_id: str) -> None:
        pass


@contextmanager
def running_server(llm_engine, max_waiting_requests: int = 256,
                   **server_kw: Any) -> Iterator[tuple[ServerHandle, Throttle]]:
    """Start the app in a uvicorn thread on 127.0.0.1 and a free port; stop everything on exit.
    ``server_kw`` go to ``make_server`` (``api_key``, ``max_request_body_bytes``,
    ``cache_salt_by_api_key``, ``tool_parser``)."""
    import uvicorn

    from segserve.entrypoints.openai.api_server import bind_socket, make_server

    app, engine = make_server(llm_engine, [SERVED_NAME], max_waiting_requests, log_interval_s=5.0,
                              **server_kw)
    throttle = Throttle()
    engine.observers.append(throttle)
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.02)
    assert server.started, "server did not start within 30 s"
    host, port = sock.getsockname()[:2]
    try:
        yield ServerHandle(f"http://{host}:{port}", engine, app), throttle
    finally:
        server.should_exit = True
        thread.join(15)
        engine.shutdown()
        sock.close()
        # Finalize this server's leftovers (closed event loop, transports) now: a socket finalized
        # later could close a reused file descriptor of the next server's connection.
        gc.collect()


def scrape(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` parsed by ``prometheus_client``'s parser: (sample name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def metric(samples: dict, name: str, **labels: str) -> float:
    """One sample's value (0 when absent, as a counter that never moved)."""
    key = (name, tuple(sorted({"model_name": SERVED_NAME, "engine": "0", **labels}.items())))
    return samples.get(key, 0.0)


def sse_events(lines: list[str]) -> list[Any]:
    """Decoded ``data:`` payloads of an SSE body (``[DONE]`` kept as the string)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---- load generator ----------------------------------------------------------------------------------


@dataclass
class LoadResult:
    """One request of a load run: HTTP status, usage, client-side timings (seconds)."""

    status: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    streamed: bool = False
    ttft: float | None = None  # streaming only: request sent -> first text chunk
    latency: float | None = None  # request sent -> response complete
    itls: list[float] = field(default_factory=list)  # streaming only: gaps between text chunks
    error: str | None = None
    done_marker: bool = False


async def _one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
               stream: bool) -> LoadResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if stream:  # stream_options without stream is a 400 (as in vLLM)
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    if not stream:
        r = await client.post("/v1/completions", json=body)
        if r.status_code != 200:
            return LoadResult(r.status_code, error=r.json()["error"]["message"])
        u = r.json()["usage"]
        return LoadResult(200, u["prompt_tokens"], u["completion_tokens"],
                          u["prompt_tokens_details"]["cached_tokens"], latency=time.perf_counter() - t0)
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return LoadResult(r.status_code, error=r.json()["error"]["message"])
        res, last = LoadResult(200, streamed=True), None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter()
            if line == "data: [DONE]":
                res.done_marker = True
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                u = event["usage"]
                res.prompt_tokens, res.completion_tokens = u["prompt_tokens"], u["completion_tokens"]
                res.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
            elif event.get("choices"):
                if last is None:
                    res.ttft = now - t0
                else:
                    res.itls.append(now - last)
                last = now
        res.latency = time.perf_counter() - t0
        return res


def load_prompts(num: int, num_prefixes: int = 4) -> list[str]:
    """``num`` prompts in ``num_prefixes`` groups sharing a long prefix, each with its own suffix."""
    words = ("quick brown fox jumps over the lazy dog paged attention keeps cache blocks chunked prefill "
             "splits long prompt pieces share step decodes").split()
    prefixes = [" ".join(words[(i + j) % len(words)] for j in range(24)) for i in range(num_prefixes)]
    return [f"{prefixes[i % num_prefixes]} request {i}: {words[i % len(words)]}" for i in range(num)]


async def run_load(base_url: str, model: str, num_requests: int = 200, concurrency: int = 16,
                   max_tokens: tuple[int, ...] = (2, 4, 8), timeout_s: float = 300.0) -> list[LoadResult]:
    """Send ``num_requests`` completions, ``concurrency`` at a time (half streaming); stops by itself
    (every request has ``timeout_s``)."""
    prompts = load_prompts(num_requests)
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:

        async def task(i: int) -> LoadResult:
            async with sem:
                return await _one(client, model, prompts[i], max_tokens[i % len(max_tokens)], i % 2 == 0)

        return list(await asyncio.gather(*(task(i) for i in range(num_requests))))


def summarize(results: list[LoadResult], wall_s: float) -> dict[str, Any]:
    """Counts, errors and medians (milliseconds) of a load run."""
    ok = [r for r in results if r.status == 200]
    ttfts = [r.ttft for r in ok if r.streamed and r.ttft is not None]
    itls = [x for r in ok for x in r.itls]
    return {
        "requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
        "error_statuses": sorted({r.status for r in results if r.status != 200}),
        "completion_tokens": sum(r.completion_tokens for r in ok),
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "ttft_median_ms": 1000 * statistics.median(ttfts) if ttfts else None,
        "itl_median_ms": 1000 * statistics.median(itls) if itls else None,
        "wall_s": wall_s,
        "output_tok_per_s": sum(r.completion_tokens for r in ok) / wall_s if wall_s else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description="bounded load test against an OpenAI-compatible server")
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="default: the first of /v1/models")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--json", default=None, help="write the summary here")
    args = ap.parse_args()
    model = args.model or httpx.get(f"{args.base_url}/v1/models").json()["data"][0]["id"]
    t0 = time.perf_counter()
    results = asyncio.run(run_load(args.base_url, model, args.requests, args.concurrency))
    summary = summarize(results, time.perf_counter() - t0)
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
