"""A failing engine step ends every open request with a clear 503 (with ``Retry-After``; the cause in
the log, not in the answer) and turns /health to 503; nothing hangs."""

from __future__ import annotations

import httpx

from tests.server.harness import SERVED_NAME, running_server


def test_step_failure_answers_503_and_health_fails(tiny_loaded, caplog):
    from segserve import LLMEngine

    engine = LLMEngine(tiny_loaded, block_size=8, num_kv_blocks=64)

    def broken_step():
        raise RuntimeError("simulated kernel failure")

    engine.step = broken_step
    with running_server(engine) as (handle, _):
        assert httpx.get(f"{handle.base_url}/health").status_code == 200
        body = {"model": SERVED_NAME, "prompt": "The quick brown fox", "max_tokens": 4}
        r = httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        # The cause is internal: it goes to the log, not to the client.
        assert r.json()["error"]["message"] == "the engine loop is not running (see the server log)"
        assert "simulated kernel failure" in caplog.text
        again = httpx.post(f"{handle.base_url}/v1/completions", json={**body, "stream": True}, timeout=10)
        assert again.status_code == 503 and again.json()["error"]["code"] == "engine_dead"
        health = httpx.get(f"{handle.base_url}/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert "simulated" not in health.text and health.headers["retry-after"] == "1"
