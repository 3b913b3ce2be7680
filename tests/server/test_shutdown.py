"""Bounded shutdown (issue 17, item 2): on SIGTERM/SIGINT the server stops accepting, lets in-flight
requests run for the grace period, then aborts the rest (a streaming client gets an error event and
``[DONE]``), shuts the engine down and exits 0; a client that sent half a request and stalled does not
delay the exit beyond the grace period."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.harness import SERVED_NAME

GRACE_S = 1.5
STEP_S = 0.05  # seconds per engine step: 100 tokens take 5 s, well past the grace period
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from tests.model_fixtures import save_tiny_hf_dir, tiny_hf_model, train_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny_llama_shutdown")
    save_tiny_hf_dir(path, tiny_hf_model(), train_tiny_tokenizer())
    return path


def _start(tiny_dir: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tests.server.slow_step_server", str(tiny_dir),
                             str(GRACE_S), str(STEP_S)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("PORT "), (line, proc.stderr.read() if proc.poll() is not None else "")
    base = f"http://127.0.0.1:{int(line.split()[1])}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("server did not come up")


def _stream(base: str, max_tokens: int, out: dict) -> None:
    body = {"model": SERVED_NAME, "prompt": "The quick brown fox", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    events = []
    try:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    out.setdefault("first", time.monotonic())
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)
    out["events"] = events


def test_sigterm_with_a_stalled_half_request_and_a_long_stream_exits_0_within_grace(tiny_dir):
    proc, base = _start(tiny_dir)
    try:
        long_out, short_out = {}, {}
        long_t = threading.Thread(target=_stream, args=(base, 100, long_out))
        short_t = threading.Thread(target=_stream, args=(base, 6, short_out))
        whole_out: dict = {}

        def whole() -> None:  # a non-streaming long request: it gets a 503 when aborted
            body = {"model": SERVED_NAME, "prompt": "Paged attention", "max_tokens": 100,
                    "ignore_eos": True}
            r = httpx.post(base + "/v1/completions", json=body, timeout=30)
            whole_out.update(status=r.status_code, body=r.json(), retry=r.headers.get("retry-after"))

        whole_t = threading.Thread(target=whole)
        long_t.start()
        short_t.start()
        whole_t.start()
        # Half a request: headers that promise a body, a few bytes of it, then silence.
        port = int(base.rsplit(":", 1)[1])
        stalled = socket.create_connection(("127.0.0.1", port))
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 1000\r\n\r\n{\"model\": ")
        deadline = time.monotonic() + 30
        while "first" not in long_out and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "first" in long_out, long_out
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(GRACE_S + 10)
        elapsed = time.monotonic() - t0
        long_t.join(10)
        short_t.join(10)
        whole_t.join(10)
        stalled.close()
        log = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, log
    assert elapsed <= GRACE_S + 2, f"exit took {elapsed:.2f} s after SIGTERM (grace {GRACE_S} s)"
    assert "stopped after a signal (SIGTERM/SIGINT); engine shut down" in log
    # The short request finished within the grace period, normally.
    short = [json.loads(e) for e in short_out["events"][:-1]]
    assert short_out["events"][-1] == "[DONE]"
    assert short[-1]["choices"][0]["finish_reason"] == "length"
    assert all("error" not in e for e in short)
    # The long one was aborted at the end of the grace period: an error event, then [DONE].
    assert long_out["events"][-1] == "[DONE]", long_out
    error = json.loads(long_out["events"][-2])["error"]
    assert error["code"] == "shutting_down" and error["message"].startswith("the server is shutting down")
    texts = [json.loads(e) for e in long_out["events"][:-2]]
    assert 0 < len(texts) < 100
    assert whole_out["status"] == 503 and whole_out["retry"] == "1"
    assert whole_out["body"]["error"]["code"] == "shutting_down"
    # New connections are refused once the signal arrived.
    with pytest.raises(httpx.ConnectError):
        httpx.get(base + "/health", timeout=2)


def test_sigint_on_an_idle_server_exits_0_at_once(tiny_dir):
    proc, _ = _start(tiny_dir)
    try:
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(10)
        elapsed = time.monotonic() - t0
        log = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, log
    assert elapsed < 2.0
    assert "engine shut down" in log
