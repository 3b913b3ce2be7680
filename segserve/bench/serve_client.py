"""Online benchmark client for any OpenAI-compatible ``/v1/completions`` endpoint.

Requests are sent at Poisson arrivals of ``request_rate`` per second (gamma inter-arrival times of
shape ``burstiness``, 1.0 being Poisson, as vLLM ``bench serve`` does), streamed with ``httpx``, and
timed on the client: TTFT = first text chunk - send time; ITL = gaps between text chunks; TPOT =
(latency - TTFT) / (output tokens - 1); E2EL = latency. Prompts go as token ids with
``ignore_eos`` (a vLLM extension segserve's server accepts) so output lengths are exact; output
tokens are read from the final ``usage`` chunk (``stream_options.include_usage``) when the server
sends one, else counted as text chunks.

Results use vLLM ``bench serve``'s names (``request_throughput``, ``output_throughput``,
``total_token_throughput``, ``{mean,median,std,p99}_{ttft,tpot,itl,e2el}_ms``, ``request_goodput``).
Goodput (Zhong et al., DistServe, OSDI 2024; vLLM ``--goodput``): completed requests per second whose
TTFT, TPOT and E2EL each meet the given limit in milliseconds.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from segserve.bench.workloads import BenchRequest
from segserve.simulator.metrics import latency_stats

GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestTiming:
    """What the client saw of one request (seconds on ``time.perf_counter``'s clock).

    Attributes:
        sent: when the request was sent, s since the benchmark start.
        prompt_tokens: prompt length, tokens.
        chunk_times: arrival time of each text chunk, s since the benchmark start.
        output_tokens: tokens generated (from ``usage``, else the number of text chunks).
        done: arrival of the end of the stream, s since the start (None while running).
        error: why it failed, or None.
    """

    sent: float
    prompt_tokens: int
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    done: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.done is not None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def latency(self) -> float:
        assert self.done is not None
        return self.done - self.sent

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds, vLLM's form).

    Raises:
        ValueError: an item without ``:``, a metric outside ttft/tpot/e2el, or a value that is not a
            number > 0 — naming the item.
    """
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput item {item!r}: expected METRIC:MS with METRIC in {GOODPUT_METRICS}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput item {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"--goodput item {item!r}: the limit must be a finite number > 0 ms")
        slos[name] = ms
    return slos


def arrival_times(num: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (s from the start) at ``request_rate`` per second; ``inf`` sends all at 0.

    Raises:
        ValueError: ``request_rate`` or ``burstiness`` not > 0.
    """
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 requests/s (inf: all at once), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(num):
        out.append(t)
        # Gamma(k, 1 / (k * rate)) has mean 1 / rate; k = 1 is the exponential (Poisson arrivals).
        t += rng.gammavariate(burstiness, 1.0 / (burstiness * request_rate))
    return out


async def _stream_one(client: Any, url: str, body: dict, timing: RequestTiming, t0: float) -> None:
    """POST one streaming completion and fill ``timing`` (errors are recorded, not raised)."""
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                timing.error = f"HTTP {resp.status_code}: {text[:200]}"
                return
            async for line in resp.aiter_lines():
                if line.startswith("data:") and not _record_event(line[5:].strip(), timing, t0):
                    break
            timing.output_tokens = timing.output_tokens or len(timing.chunk_times)
            timing.done = time.perf_counter() - t0
            if not timing.chunk_times:
                timing.error = f"HTTP 200 without a streamed token ({resp.headers.get('content-type')})"
    except Exception as exc:  # a failed request is a result of the benchmark, not a crash
        timing.error = f"{type(exc).__name__}: {exc}"


def _record_event(data: str, timing: RequestTiming, t0: float) -> bool:
    """Take one SSE ``data:`` payload into ``timing``; False at ``[DONE]``."""
    if data == "[DONE]":
        return False
    event = json.loads(data)
    choices = event.get("choices") or []
    if choices and choices[0].get("text"):
        timing.chunk_times.append(time.perf_counter() - t0)
    usage = event.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        timing.output_tokens = usage["completion_tokens"]
    return True


def stream_one_blocking(url: str, body: dict, t0: float, timeout_s: float = 600.0) -> RequestTiming:
    """POST one streaming completion with the standard library's ``http.client``, no event loop, and
    time it like ``_stream_one`` (sent at ``t0``). For one stream alone (batch-1 TPOT): on a 2-core
    machine the client shares the engine's cores, and ``httpx``'s asyncio client spends ~2 ms of CPU a
    token there (``benchmarks/server_tpot.py``), which the server's TPOT would then carry.

    Errors are recorded in the result, not raised.
    """
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    timing = RequestTiming(time.perf_counter() - t0, len(body.get("prompt") or ()))
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
    try:
        conn.request("POST", parts.path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            timing.error = f"HTTP {resp.status}: {resp.read().decode(errors='replace')[:200]}"
            return timing
        for raw in iter(resp.readline, b""):
            if raw.startswith(b"data:") and not _record_event(raw[5:].strip().decode(), timing, t0):
                break
        timing.output_tokens = timing.output_tokens or len(timing.chunk_times)
        timing.done = time.perf_counter() - t0
    except Exception as exc:  # a failed request is a result of the benchmark, not a crash
        timing.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return timing


def completion_body(model: str, prompt_token_ids: Sequence[int], max_tokens: int) -> dict:
    """The benchmark's streamed ``/v1/completions`` request: token ids in, greedy, exactly
    ``max_tokens`` tokens (``ignore_eos``), a final usage chunk (vLLM ``bench serve``'s request)."""
    return {"model": model, "prompt": list(prompt_token_ids), "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}


async def run_serve(
    base_url: str,
    requests: list[BenchRequest],
    sends: list[float],
    model: str | None = None,
    max_concurrency: int | None = None,
    transport: Any = None,
    progress: bool = True,
    timeout_s: float = 600.0,
) -> tuple[list[RequestTiming], float]:
    """Send ``requests[i]`` at ``sends[i]`` seconds; returns (timings, benchmark duration in s).

    ``model`` None asks ``GET /v1/models`` for the first served model. ``transport`` is an httpx
    transport (tests pass a mock one).

    Raises:
        ValueError: ``base_url`` is not a URL or does not answer (before any request is sent).
    """
    import httpx
    from tqdm import tqdm

    base = base_url.rstrip("/")
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with httpx.AsyncClient(transport=transport, timeout=timeout_s) as client:
        try:  # the server's models: the name to send, and whether it answers at all
            models = await client.get(f"{base}/v1/models")
            models.raise_for_status()
            served = [m["id"] for m in models.json()["data"]]
        except Exception as exc:  # noqa: BLE001 - any failure of this probe (a port past 65535 comes as an
            # ExceptionGroup of an OverflowError, a JSON list as a TypeError) is the URL's, said in one line
            raise ValueError(f"--base-url {base_url}: GET /v1/models failed: {exc}") from None
        if model is None and not served:
            raise ValueError(f"--base-url {base_url}: the server lists no model")
        model = served[0] if model is None else model
        bar = tqdm(total=len(requests), desc="bench serve", unit="req", disable=not progress)
        t0 = time.perf_counter()
        timings = [RequestTiming(s, len(r.prompt_token_ids)) for r, s in zip(requests, sends, strict=True)]

        async def send(req: BenchRequest, timing: RequestTiming) -> None:
            await asyncio.sleep(max(0.0, timing.sent - (time.perf_counter() - t0)))
            body = completion_body(model, req.prompt_token_ids, req.output_len)
            if limit is None:
                await _stream_one(client, f"{base}/v1/completions", body, timing, t0)
            else:
                async with limit:
                    await _stream_one(client, f"{base}/v1/completions", body, timing, t0)
            bar.update(1)

        await asyncio.gather(*(send(r, t) for r, t in zip(requests, timings, strict=True)))
        duration = time.perf_counter() - t0
        bar.close()
    return timings, duration


def summarize(timings: list[RequestTiming], duration: float, goodput: dict[str, float] | None = None) -> dict:
    """vLLM ``bench serve`` result fields from the client's timings (see the module docstring)."""
    ok = [t for t in timings if t.ok]
    out_tokens = sum(t.output_tokens for t in ok)
    in_tokens = sum(t.prompt_tokens for t in ok)
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(timings) - len(ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else math.nan,
        "output_throughput": out_tokens / duration if duration else math.nan,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else math.nan,
    }
    if goodput:
        good = sum(_meets(t, goodput) for t in ok)
        result["request_goodput"] = good / duration if duration else math.nan
    result |= latency_stats("ttft", [t.ttft for t in ok])
    result |= latency_stats("tpot", [t.tpot for t in ok if t.tpot is not None])
    result |= latency_stats("itl", [x for t in ok for x in t.itls])
    result |= latency_stats("e2el", [t.latency for t in ok])
    result["errors"] = sorted({t.error for t in timings if t.error})[:5]
    return result


def _meets(t: RequestTiming, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": t.ttft, "tpot": t.tpot or 0.0, "e2el": t.latency}
    return all(values[k] * 1000.0 <= ms for k, ms in slos_ms.items())


def summary_line(result: dict) -> str:
    """The one line ``segserve bench serve`` prints."""
    line = (
        f"bench serve: {result['completed']} ok, {result['failed']} failed in {result['duration']:.1f} s: "
        f"{result['request_throughput']:.2f} req/s, output {result['output_throughput']:.1f} tok/s, "
        f"total {result['total_token_throughput']:.1f} tok/s; TTFT mean/median/p99 "
        f"{result['mean_ttft_ms']:.0f}/{result['median_ttft_ms']:.0f}/{result['p99_ttft_ms']:.0f} ms, "
        f"TPOT {result['mean_tpot_ms']:.1f}/{result['median_tpot_ms']:.1f}/{result['p99_tpot_ms']:.1f} ms, "
        f"ITL {result['mean_itl_ms']:.1f}/{result['median_itl_ms']:.1f}/{result['p99_itl_ms']:.1f} ms"
    )
    if "request_goodput" in result:
        line += f"; goodput {result['request_goodput']:.2f} req/s"
    if result["failed"] and result.get("errors"):
        line += f"; first error: {result['errors'][0]}"
    return line
