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


def test_internal_error_is_a_generic_500_with_an_id_in_the_log(tiny_server, caplog):
    """An unexpected exception in a handler: 500, no repr to the client, the id next to the traceback
    in the log; mid-stream it is an error event, then ``[DONE]``."""
    import re

    from tests.server.harness import sse_events

    handle, _ = tiny_server
    app_serving = handle.app.state.serving
    original = app_serving.check_model

    def broken(name):
        raise RuntimeError("secret internal detail")

    app_serving.check_model = broken
    try:
        r = httpx.post(f"{handle.base_url}/v1/completions", json={"model": SERVED_NAME, "prompt": "hi"})
    finally:
        app_serving.check_model = original
    assert r.status_code == 500
    error = r.json()["error"]
    assert "secret" not in r.text and error["type"] == "server_error" and error["code"] == "internal_error"
    error_id = re.fullmatch(r"internal server error \(id ([0-9a-f]{16}); the server log has the details\)",
                            error["message"]).group(1)
    logged = [rec for rec in caplog.records if error_id in rec.getMessage()]
    assert logged and "secret internal detail" in str(logged[0].exc_info[1])

    import segserve.entrypoints.openai.serving_completion as completion_mod

    original_delta = completion_mod.completion_delta

    def broken_delta(*args):
        raise KeyError("secret stream detail")

    completion_mod.completion_delta = broken_delta
    try:
        body = {"model": SERVED_NAME, "prompt": "hi", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", f"{handle.base_url}/v1/completions", json=body) as s:
            events = sse_events(list(s.iter_lines()))
    finally:
        completion_mod.completion_delta = original_delta
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "internal_error"
    assert "secret" not in str(events)
    handle.assert_idle_and_clean()

