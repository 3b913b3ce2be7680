"""``segserve bench serve``: metrics from hand-made timings, goodput parsing, arrivals, and the client
against a stub SSE server (httpx mock transport) and against segserve's own server."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from segserve.bench import serve_client as sc
from segserve.bench.workloads import BenchRequest


def test_summary_of_hand_made_timings_uses_vllm_names_and_values():
    a = sc.RequestTiming(sent=0.0, prompt_tokens=10, chunk_times=[0.1, 0.2, 0.4], output_tokens=3, done=0.4)
    b = sc.RequestTiming(sent=0.5, prompt_tokens=20, chunk_times=[0.8], output_tokens=1, done=0.8)
    bad = sc.RequestTiming(sent=0.6, prompt_tokens=5, error="HTTP 400: too long")
    r = sc.summarize([a, b, bad], duration=2.0, goodput={"ttft": 200.0})
    assert (r["completed"], r["failed"]) == (2, 1)
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (30, 4)
    assert r["request_throughput"] == 1.0 and r["output_throughput"] == 2.0
    assert r["total_token_throughput"] == 17.0
    assert r["mean_ttft_ms"] == pytest.approx(200.0) and r["median_ttft_ms"] == pytest.approx(200.0)
    assert r["mean_tpot_ms"] == pytest.approx(150.0)  # (0.4 - 0.1) / 2, only a has > 1 token
    assert r["mean_itl_ms"] == pytest.approx(150.0) and r["p99_itl_ms"] == pytest.approx(199.0)
    assert r["mean_e2el_ms"] == pytest.approx(350.0)
    assert r["request_goodput"] == 0.5  # a's TTFT 100 ms meets 200 ms; b's 300 ms does not
    assert r["errors"] == ["HTTP 400: too long"]


def test_goodput_parses_vllm_form():
    parsed = sc.parse_goodput(["ttft:500", "tpot:50", "e2el:2000"])
    assert parsed == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    assert sc.parse_goodput(None) == {}


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("ttft=500", "expected METRIC:MS"),
        ("itl:50", "expected METRIC:MS"),
        ("ttft:fast", "'fast' is not a number"),
        ("tpot:0", "must be a finite number > 0 ms"),
        ("tpot:inf", "must be a finite number > 0 ms"),
    ],
)
def test_bad_goodput_items_are_named(item, message):
    with pytest.raises(ValueError, match=message):
        sc.parse_goodput([item])


def test_poisson_arrivals_have_the_asked_mean_rate():
    times = sc.arrival_times(4000, request_rate=4.0, seed=1)
    assert times[0] == 0.0 and times == sorted(times)
    assert times[-1] / 3999 == pytest.approx(0.25, rel=0.05)
    assert sc.arrival_times(3, float("inf")) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="request_rate must be > 0 requests/s .* got 0"):
        sc.arrival_times(3, 0.0)
    with pytest.raises(ValueError, match="burstiness must be > 0, got -1"):
        sc.arrival_times(3, 1.0, burstiness=-1)


def _stub_transport(gap_s: float = 0.01) -> httpx.MockTransport:
    """An OpenAI-style server: one SSE text chunk per token every ``gap_s``, a usage chunk, [DONE];
    prompts over 50 tokens get HTTP 400."""

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "stub"}]})
        body = json.loads(request.content)
        if len(body["prompt"]) > 50 or body["model"] != "stub":
            return httpx.Response(400, json={"error": {"message": "prompt too long"}})

        async def events():
            for _ in range(body["max_tokens"]):
                await asyncio.sleep(gap_s)
                yield f'data: {json.dumps({"choices": [{"index": 0, "text": "x"}]})}\n\n'.encode()
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
            yield f'data: {json.dumps({"choices": [], "usage": usage})}\n\n'.encode()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=events(), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def test_client_against_a_stub_server_counts_tokens_and_failures():
    reqs = [BenchRequest(tuple(range(20, 30)), 4), BenchRequest(tuple(range(20, 90)), 3),
            BenchRequest(tuple(range(20, 25)), 6)]
    sends = sc.arrival_times(3, 50.0, seed=0)
    timings, duration = asyncio.run(
        sc.run_serve("http://stub", reqs, sends, transport=_stub_transport(), progress=False)
    )
    r = sc.summarize(timings, duration, {"ttft": 10_000})
    assert (r["completed"], r["failed"], r["total_output_tokens"], r["total_input_tokens"]) == (2, 1, 10, 15)
    assert [len(t.chunk_times) for t in timings] == [4, 0, 6]
    assert "HTTP 400" in timings[1].error
    assert r["median_itl_ms"] >= 10.0  # the stub sleeps 10 ms between chunks
    assert r["request_goodput"] == pytest.approx(2 / duration)
    assert math.isclose(r["request_throughput"], 2 / duration)


def _chunked_sse_handler():
    """An ``http.server`` handler class: the stub above as a real HTTP/1.1 server with chunked SSE
    (the second delta is empty)."""
    import http.server
    import time as _time

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet test output
            pass

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if len(body["prompt"]) > 50:
                err = b'{"error": {"message": "prompt too long"}}'
                self.send_response(400)
                self.send_header("Content-Length", str(len(err)))
                self.end_headers()
                self.wfile.write(err)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for k in range(body["max_tokens"]):
                _time.sleep(0.01)
                text = "" if k == 1 else "x"  # an empty delta is no token arrival
                self._chunk(f'data: {json.dumps({"choices": [{"index": 0, "text": text}]})}\n\n'.encode())
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
            self._chunk(f'data: {json.dumps({"choices": [], "usage": usage})}\n\n'.encode())
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")

    return Handler


def test_blocking_client_times_chunked_sse_and_records_errors():
    import http.server
    import threading
    import time

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _chunked_sse_handler())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/completions"
    try:
        t0 = time.perf_counter()
        t = sc.stream_one_blocking(url, {"prompt": list(range(10)), "max_tokens": 5}, t0)
        assert t.ok and t.error is None
        assert (len(t.chunk_times), t.output_tokens, t.prompt_tokens) == (4, 5, 10)  # usage wins
        # The server sleeps 10 ms before each later chunk, so the last cannot arrive before 30 ms after the
        # request; a single gap may look shorter (a chunk read late, the next on time: a CI run under
        # load saw 7.7 ms), so the gaps are checked as a whole.
        assert t.chunk_times[-1] >= 0.03 and len(t.itls) == 3 and all(g >= 0 for g in t.itls)
        assert sum(t.itls) == pytest.approx(t.chunk_times[-1] - t.chunk_times[0])
        assert t.done >= t.chunk_times[-1]
        bad = sc.stream_one_blocking(url, {"prompt": list(range(60)), "max_tokens": 2}, t0)
        assert not bad.ok and bad.error == 'HTTP 400: {"error": {"message": "prompt too long"}}'
    finally:
        server.shutdown()
        server.server_close()
    gone = sc.stream_one_blocking(url, {"prompt": [1], "max_tokens": 2}, time.perf_counter(), timeout_s=5)
    assert not gone.ok and gone.error.startswith("ConnectionRefusedError")


def test_an_unreachable_or_malformed_base_url_is_one_line_naming_it():
    """A new user's trial (2026-12-05): `--base-url notaurl` and a closed port printed httpx tracebacks."""
    reqs, sends = [BenchRequest(tuple(range(20, 30)), 2)], [0.0]
    for url in ("notaurl", "http://127.0.0.1:1", "http://127.0.0.1:99999"):  # the last: an OverflowError
        with pytest.raises(ValueError, match=rf"--base-url {url}: GET /v1/models failed"):
            asyncio.run(sc.run_serve(url, reqs, sends, progress=False, timeout_s=5))


def test_the_summary_line_gives_the_first_failure():
    """A new user's trial: `--model nope` printed "0 ok, 1 failed" and nan metrics with no reason."""
    reqs, sends = [BenchRequest(tuple(range(20, 30)), 2)], [0.0]
    timings, duration = asyncio.run(
        sc.run_serve("http://stub", reqs, sends, model="nope", transport=_stub_transport(), progress=False)
    )
    line = sc.summary_line(sc.summarize(timings, duration))
    assert "0 ok, 1 failed" in line and "; first error: HTTP 400: " in line and "prompt too long" in line


def test_max_concurrency_below_one_is_refused(capsys):
    from segserve.entrypoints.cli import main

    assert main(["bench", "serve", "--max-concurrency", "0", "--num-prompts", "1"]) == 2
    assert "--max-concurrency must be >= 1 (omit it for no limit), got 0" in capsys.readouterr().err
