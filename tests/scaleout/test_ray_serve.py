"""segserve behind Ray Serve: 2 replicas of the tiny model, one local cluster for the module.

Equality with in-process ``LLM.generate`` (chat and completions, streamed and not), both replicas
serving, prefix groups kept on one replica each under ``prefix_affinity`` (not under
``round_robin``), a killed replica losing no request that had not started streaming, a client
disconnect aborting on the replica, and the merged ``/metrics`` / ``/health``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from tests.scaleout.conftest import NUM_REPLICAS, deployed
from tests.server.harness import SERVED_NAME, sse_events

pytestmark = [pytest.mark.ray, pytest.mark.slow]

WORDS = ("quick brown fox jumps over the lazy dog paged attention keeps cache blocks chunked prefill "
         "splits long prompt pieces share step decodes").split()


def group_prompts(num_groups: int = 4, per_group: int = 8) -> list[tuple[int, str]]:
    """(group, prompt): groups differ from their first character on and share 3 whole 64-character
    blocks; requests of a group differ only after them. In a fixed random order."""
    out = []
    for i in range(per_group):
        for g in range(num_groups):
            prefix = f"g{g} " + " ".join(WORDS[(g * 3 + j) % len(WORDS)] for j in range(40))
            out.append((g, f"{prefix[:192]} q{i}"))
    random.Random(0).shuffle(out)
    return out


def _completion(base: str, prompt: str, max_tokens: int = 6, **extra) -> httpx.Response:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=120)


def _stream_lines(base: str, route: str, body: dict) -> tuple[httpx.Response, list[str]]:
    with httpx.stream("POST", f"{base}{route}", json={**body, "stream": True}, timeout=120) as r:
        return r, list(r.iter_lines())


@pytest.fixture(scope="module")
def affinity(ray_cluster, tiny_dir):
    with deployed(tiny_dir, "prefix_affinity") as (base, _):
        yield base


@pytest.fixture(scope="module")
def offline(tiny_dir):
    from segserve import LLM
    from tests.server.conftest import TINY_ENGINE

    return LLM(tiny_dir, **TINY_ENGINE)


def test_outputs_equal_in_process_generate(affinity, offline):
    from segserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = "The quick brown fox jumps over the lazy dog."
    messages = [{"role": "user", "content": "Paged attention keeps the cache in blocks."}]
    want = offline.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    want_chat = offline.chat(messages, params, use_tqdm=False)[0].outputs[0]

    r = _completion(affinity, prompt, 8)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text
    assert r.json()["usage"]["completion_tokens"] == len(want.token_ids) == 8
    body = {"model": SERVED_NAME, "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{affinity}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want_chat.text

    completion = {**body, "prompt": prompt}
    del completion["messages"]
    r, lines = _stream_lines(affinity, "/v1/completions", completion)
    events = sse_events(lines)
    assert r.headers["content-type"].startswith("text/event-stream") and events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want.text
    r, lines = _stream_lines(affinity, "/v1/chat/completions", body)
    events = sse_events(lines)
    first = {k: v for k, v in events[0]["choices"][0]["delta"].items() if v is not None}
    assert first == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[1:-1])
    assert text == want_chat.text and events[-1] == "[DONE]"


def test_error_shapes_are_the_single_servers(affinity):
    r = httpx.post(f"{affinity}/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = _completion(affinity, "x", max_tokens=500)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(f"{affinity}/v1/completions", content=b"{not json", timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("malformed JSON body")
    models = httpx.get(f"{affinity}/v1/models", timeout=60).json()
    assert [m["id"] for m in models["data"]] == [SERVED_NAME]


def test_prefix_groups_stay_on_one_replica_each(affinity):
    seen: dict[int, set[str]] = {}
    cached: dict[int, list[int]] = {}
    for g, prompt in group_prompts():
        r = _completion(affinity, prompt, 2)
        assert r.status_code == 200
        seen.setdefault(g, set()).add(r.headers["x-segserve-replica"])
        cached.setdefault(g, []).append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert all(len(s) == 1 for s in seen.values()), seen
    assert len(set().union(*seen.values())) == NUM_REPLICAS  # new groups spread over both replicas
    # After each group's first request, its replica holds the shared blocks: every later one hits.
    assert all(c[0] == 0 and min(c[1:]) > 0 for c in cached.values()), cached


def test_metrics_carry_replica_label_and_health_counts(affinity):
    from prometheus_client.parser import text_string_to_metric_families

    _completion(affinity, "count me", 3)
    time.sleep(2.5)  # replicas push every second
    text = httpx.get(f"{affinity}/metrics", timeout=60).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    running = families["vllm:num_requests_running"].samples
    assert len({s.labels["replica"] for s in running}) == NUM_REPLICAS
    assert all(s.labels["model_name"] == SERVED_NAME for s in running)
    ok = [s for s in families["vllm:request_success"].samples
          if s.name == "vllm:request_success_total" and s.labels["finished_reason"] == "length"]
    assert sum(s.value for s in ok) >= 1
    h = httpx.get(f"{affinity}/health", timeout=60)
    assert h.status_code == 200 and h.json() == {"replicas_running": 2, "replicas_target": 2}


def test_client_disconnect_aborts_on_the_replica(affinity):
    from prometheus_client.parser import text_string_to_metric_families

    def aborts() -> float:
        text = httpx.get(f"{affinity}/metrics", timeout=60).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "vllm:request_success_total" and s.labels.get("finished_reason") == "abort")

    before = aborts()
    body = {"model": SERVED_NAME, "prompt": "The quick brown fox", "max_tokens": 100, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{affinity}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200  # 100 tokens at STEP_DELAY_S each: 2 s; we leave after 3 chunks
        for i, _ in enumerate(r.iter_lines()):
            if i >= 2:
                break
    deadline = time.monotonic() + 20
    while aborts() <= before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert aborts() == before + 1


def test_round_robin_splits_groups_and_a_killed_replica_loses_no_unstarted_request(ray_cluster, tiny_dir):
    with deployed(tiny_dir, "round_robin") as (base, app_name):
        seen: dict[int, set[str]] = {}
        for g, prompt in group_prompts():
            r = _completion(base, prompt, 2)
            seen.setdefault(g, set()).add(r.headers["x-segserve-replica"])
        assert all(len(s) == NUM_REPLICAS for s in seen.values()), seen
        _kill_during_burst(base, app_name)


def _replica_actor_names(app_name: str) -> list[str]:
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(f"SERVE_REPLICA::{app_name}#EngineReplica#"))


async def _burst(base: str, n: int, started: asyncio.Event) -> list[dict]:
    """``n`` completions at once (even ones streamed); ``started`` is set at the first streamed chunk."""

    async def one(i: int, client: httpx.AsyncClient) -> dict:
        body = {"model": SERVED_NAME, "prompt": f"burst {i}", "max_tokens": 80, "temperature": 0,
                "ignore_eos": True, "stream": i % 2 == 0}
        if i % 2:
            r = await client.post("/v1/completions", json=body)
            return {"status": r.status_code, "streamed": False, "complete": r.status_code == 200}
        events = []
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for x in r.aiter_lines():
                if x.startswith("data: "):
                    events.append(json.loads(x[6:]) if x != "data: [DONE]" else "[DONE]")
                    started.set()
        chunks = [e for e in events if isinstance(e, dict) and "choices" in e]
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        done = bool(chunks) and chunks[-1]["choices"][0]["finish_reason"] == "length"
        return {"status": r.status_code, "streamed": True, "complete": done and not errors,
                "chunks_before_error": len(chunks), "errors": errors}

    async with httpx.AsyncClient(base_url=base, timeout=180) as client:
        return list(await asyncio.gather(*(one(i, client) for i in range(n))))


def _kill_during_burst(base: str, app_name: str) -> None:
    import ray

    victim = _replica_actor_names(app_name)[0]

    async def run() -> list[dict]:
        started = asyncio.Event()
        task = asyncio.ensure_future(_burst(base, 16, started))
        # Round robin gave the victim half of the burst; the engine batches them, so once one stream
        # has its first chunk, the victim's requests are in flight too (80 tokens take >= 1.6 s).
        await asyncio.wait_for(started.wait(), 60)
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        return await task

    results = asyncio.run(run())
    text = httpx.get(f"{base}/metrics", timeout=60).text
    hit = sum(float(line.split()[-1]) for line in text.splitlines()
              if line.startswith(("segserve:replica_retries_total", "segserve:replica_lost_streams_total")))
    assert hit >= 1, "the killed replica served nothing in flight: the test did not test"
    assert all(r["status"] == 200 for r in results), results
    # Non-streamed requests send nothing before they finish: the ingress retried every lost one.
    assert all(r["complete"] for r in results if not r["streamed"]), results
    # A lost stream had started (its chunks reached the client) and ends with the replica_died event.
    for r in results:
        if r["streamed"] and not r["complete"]:
            assert r["chunks_before_error"] >= 1 and r["errors"][0]["error"]["code"] == "replica_died"
    assert all(_completion(base, f"after {i}", 3).status_code == 200 for i in range(4))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        h = httpx.get(f"{base}/health", timeout=30).json()
        if h["replicas_running"] == NUM_REPLICAS and victim not in _replica_actor_names(app_name):
            break
        time.sleep(1)
    assert h["replicas_running"] == NUM_REPLICAS and victim not in _replica_actor_names(app_name)
