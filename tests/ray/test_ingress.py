"""The ingress without a cluster: routing text, the merged exposition, /health, and what a replica
death before or after the first byte does (a fake Serve handle stands in for the replicas)."""

from __future__ import annotations

import json

import pytest

ray = pytest.importorskip("ray")

from fastapi.testclient import TestClient  # noqa: E402

from segserve.entrypoints.ray_serve.board import merge  # noqa: E402
from segserve.entrypoints.ray_serve.ingress import Ingress, routing_text  # noqa: E402


def test_routing_text():
    assert routing_text(b'{"prompt": "abc"}') == "abc"
    assert routing_text(b'{"prompt": ["abc"]}') == "abc"
    assert routing_text(b'{"prompt": [1, 2]}') == chr(0xE001) + chr(0xE002)
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user",
                                                             "content": [{"type": "text", "text": "U"}]}]}
    assert routing_text(json.dumps(chat).encode()) == "system\nS\nuser\nU\n"
    assert routing_text(b"{not json") == routing_text(b"[1]") == routing_text(b"") == ""


def test_merge_groups_families_and_labels_every_sample():
    a = ('# HELP vllm:x X\n# TYPE vllm:x gauge\nvllm:x{model_name="m"} 1.0\n'
         '# HELP vllm:y_total Y\n# TYPE vllm:y_total counter\nvllm:y_total 2.0\n')
    b = '# HELP vllm:x X\n# TYPE vllm:x gauge\nvllm:x{model_name="m"} 3.0\n'
    assert merge({"r1": a, "r2": b}).splitlines() == [
        "# HELP vllm:x X", "# TYPE vllm:x gauge",
        'vllm:x{replica="r1",model_name="m"} 1.0', 'vllm:x{replica="r2",model_name="m"} 3.0',
        "# HELP vllm:y_total Y", "# TYPE vllm:y_total counter", 'vllm:y_total{replica="r1"} 2.0',
    ]


START = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}


def _body(data: bytes, more: bool) -> dict:
    return {"type": "http.response.body", "body": data, "more_body": more}


class FakeGen:
    """A DeploymentResponseGenerator replaying ``items`` (an exception item is raised)."""

    def __init__(self, items):
        self.items, self.cancelled = list(items), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


class FakeHandle:
    def __init__(self, answers):
        self.answers, self.calls = list(answers), []
        self.http = self

    def options(self, **_):
        return self

    def remote(self, text, request):
        self.calls.append(text)
        return self.answers.pop(0)


def _client(answers, running=2) -> tuple[TestClient, FakeHandle]:
    handle = FakeHandle(answers)
    return TestClient(Ingress(handle, lambda: (running, 2), board=None).app()), handle


def _died():
    return ray.exceptions.ActorDiedError()


def test_replica_dead_before_first_byte_is_retried():
    ok = FakeGen([START, _body(b"data: 1\n\n", True), _body(b"data: [DONE]\n\n", False)])
    client, handle = _client([FakeGen([START, _died()]), ok])
    r = client.post("/v1/completions", json={"prompt": "p"})
    assert r.status_code == 200 and r.text == "data: 1\n\ndata: [DONE]\n\n"
    assert handle.calls == ["p", "p"]
    assert "segserve:replica_retries_total 1.0" in _own_metrics(client)


def test_replica_dead_mid_stream_ends_with_an_error_event():
    client, _ = _client([FakeGen([START, _body(b"data: 1\n\n", True), _died()])])
    r = client.post("/v1/completions", json={"prompt": "p", "stream": True})
    events = [e[len("data: "):] for e in r.text.split("\n\n") if e]
    assert r.status_code == 200 and events[0] == "1" and events[-1] == "[DONE]"
    assert json.loads(events[1])["error"]["code"] == "replica_died"


def test_every_replica_dead_is_503():
    client, handle = _client([FakeGen([_died()]) for _ in range(3)])
    r = client.post("/v1/completions", json={"prompt": "p"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "replica_died" and len(handle.calls) == 3


def test_health_reflects_replicas():
    client, _ = _client([], running=1)
    assert client.get("/health").json() == {"replicas_running": 1, "replicas_target": 2}
    client, _ = _client([], running=0)
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["error"]["message"] == "no replica is running (0 of 2)"


def _own_metrics(client: TestClient) -> str:
    from prometheus_client import generate_latest

    # /metrics also needs the board; the ingress's own counters are in its registry.
    return generate_latest(client.app.state.ingress.registry).decode()


def test_router_flag_picks_the_serve_router():
    from segserve.entrypoints.ray_serve import launch, routers
    from segserve.entrypoints.ray_serve.settings import ScaleOut

    def config(name: str):
        return launch.router_config(ScaleOut(2, 1, name, 4, 0.5, None, available_cpus=4))

    assert config("power_of_two") is None  # Serve's default router
    path = "segserve.entrypoints.ray_serve.routers."
    assert config("round_robin").request_router_class == path + routers.RoundRobinRouter.__name__
    affinity = config("prefix_affinity")
    assert affinity.request_router_class == path + routers.PrefixAffinityRouter.__name__
    assert affinity.request_router_kwargs == {"imbalanced_threshold": 4, "match_rate_threshold": 0.5}
