"""``EngineReplica``: one segserve engine and its OpenAI app inside a Ray Serve replica.

Serve calls ``http`` (a streaming method) once per forwarded request; its first argument is the
routing text the request routers read (``routers.py``). ``check_health`` fails when the engine loop
died, so Serve replaces the replica. A thread pushes the replica's Prometheus text to the metrics board
every ``METRICS_PUSH_S`` seconds, from where the ingress's ``/metrics`` serves every replica's.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from segserve.entrypoints.ray_serve.asgi_bridge import HttpRequest, asgi_messages

log = logging.getLogger("segserve")
METRICS_PUSH_S = 1.0


class EngineReplica:
    """A replica: loads the model, starts the engine thread and builds the app (``make_server``).

    Args:
        engine_args: ``EngineArgs`` of the engine (the model path included).
        served_model_names, max_waiting_requests, log_interval_s, budget_source, server_options: as
            ``make_server`` (``server_options``: its keyword settings, e.g. ``max_request_body_bytes``).
        threads: torch intra-op threads (the replica's reserved CPUs).
        board: the metrics board actor (``board.MetricsBoard``), or None.
        observers: extra step observers for the engine thread (``StepObserver``; tests slow steps down).
        loopback_only: a local cluster: bind Serve's per-replica gRPC server to 127.0.0.1.
    """

    def __init__(self, engine_args, served_model_names: list[str] | None, max_waiting_requests: int,
                 log_interval_s: float, budget_source: str, threads: int, board=None,
                 observers: tuple = (), loopback_only: bool = False, server_options: dict | None = None,
                 ) -> None:
        import torch

        from segserve import LLMEngine
        from segserve.entrypoints.openai.api_server import make_server
        from segserve.entrypoints.openai.metrics import EngineMetrics
        from segserve.entrypoints.serve import off_the_main_thread

        torch.set_num_threads(threads)  # threads started later take it too (the engine thread)
        if loopback_only:
            _serve_grpc_on_loopback()
        self.replica_id = serve.get_replica_context().replica_id.unique_id

        # Built in a helper thread, as `segserve serve` does (serve.off_the_main_thread says why: an
        # OpenMP pool left with the building thread slowed every step of the engine thread ~20 %).
        llm_engine = off_the_main_thread(LLMEngine.from_engine_args, engine_args)
        self.app, self.engine = make_server(llm_engine, served_model_names, max_waiting_requests,
                                            log_interval_s, budget_source, **(server_options or {}))
        self.engine.observers.extend(observers)
        self.metrics = next(o for o in self.engine.observers if isinstance(o, EngineMetrics))
        self.board, self._stop = board, threading.Event()
        if board is not None:
            threading.Thread(target=self._push_metrics, name="segserve-metrics-push", daemon=True).start()
        log.info("replica %s (pid %d, %d threads): %s", self.replica_id, os.getpid(), threads,
                 llm_engine.describe())

    async def http(self, routing_text: str, request: HttpRequest) -> AsyncIterator[dict[str, Any]]:
        """The app's ASGI messages for ``request``; the start message gains ``x-segserve-replica``."""
        async for message in asgi_messages(self.app, request):
            if message["type"] == "http.response.start":
                tag = (b"x-segserve-replica", self.replica_id.encode())
                headers = [*message.get("headers", []), tag]
                message = {**message, "headers": headers}
            yield message

    def check_health(self) -> None:
        """Serve's health probe: raises when the engine loop is not running (Serve then restarts us)."""
        if not self.engine.is_running:
            raise RuntimeError(f"engine loop is not running: {self.engine.dead!r}")

    def _push_metrics(self) -> None:
        from prometheus_client import generate_latest

        while not self._stop.wait(METRICS_PUSH_S):
            try:
                self.board.put.remote(self.replica_id, generate_latest(self.metrics.registry).decode())
            except ray.exceptions.RayError:  # board gone (shutdown): stop pushing
                return

    def __del__(self) -> None:
        self._stop.set()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout_s=5.0)


def _serve_grpc_on_loopback() -> None:
    """Serve 2.60 starts an inter-deployment gRPC server in every replica, after the user class is
    built, on ``[::]:0`` (all interfaces, no setting); a local cluster's replica binds it to loopback.
    Private API, checked against the pinned Ray: a renamed hook fails here, loudly."""
    from ray.serve._private import replica as serve_replica

    original = serve_replica.add_port_to_grpc_server

    def loopback(server, address: str) -> int:
        return original(server, address.replace("[::]", "127.0.0.1", 1))

    serve_replica.add_port_to_grpc_server = loopback
