"""The ingress: one FastAPI app in the ``segserve serve`` process that forwards every request to an
``EngineReplica`` through a Serve handle (whose request router picks the replica) and relays the
replica's answer byte for byte, so routes, streaming and error shapes are the single server's.

Its own routes: ``GET /health`` (200 while at least one replica runs, with the counts; 503 in
OpenAI's error shape when none does) and ``GET /metrics`` (every replica's metrics, ``replica`` label
added, then the ingress's counters ``segserve:replica_retries`` and ``segserve:replica_lost_streams``).
A replica that dies before the first byte of its answer reached the client is retried on another
(``MAX_ATTEMPTS`` in all); one that dies later ends a stream with an error event and ``[DONE]``.
A client that disconnects cancels the replica call, which aborts the request there.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from segserve.entrypoints.ray_serve.asgi_bridge import HttpRequest
from segserve.entrypoints.ray_serve.board import merge

log = logging.getLogger("segserve")
MAX_ATTEMPTS = 3
_REPLICA_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


def error_body(status: int, message: str, type_: str, code: str) -> JSONResponse:
    """An error in OpenAI's shape (the single server's ``ApiError.response``)."""
    info = {"message": message, "type": type_, "param": None, "code": code}
    return JSONResponse({"error": info}, status_code=status)


def routing_text(body: bytes) -> str:
    """The text the prefix router matches: a completion's prompt, or a chat's messages as
    ``role\\ncontent\\n`` each; empty when the body is not such JSON (the replica answers the error)."""
    try:
        req = json.loads(body) if body else None
    except ValueError:
        return ""
    if not isinstance(req, dict):
        return ""
    if isinstance(req.get("messages"), list):
        return "".join(f"{m.get('role')}\n{_content(m.get('content'))}\n" for m in req["messages"]
                       if isinstance(m, dict))
    prompt = req.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list):  # token ids: one "character" per id keeps whole-block matching
        return "".join(chr(0xE000 + (t % 6000)) for t in prompt if isinstance(t, int))
    return prompt if isinstance(prompt, str) else ""


def _content(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


class Ingress:
    """Forwards to the replicas behind ``handle`` (a Serve ``DeploymentHandle`` of ``EngineReplica``).

    Args:
        handle: the deployment's handle.
        status: ``() -> (running, target)`` replica counts (blocking; run in a thread).
        board: the metrics board actor.
    """

    def __init__(self, handle, status, board) -> None:
        self.handle = handle.options(stream=True)
        self.status = status
        self.board = board
        self.registry = CollectorRegistry()
        self.retries = Counter("segserve:replica_retries", "Requests sent again because their replica "
                               "died before the first byte of its answer", registry=self.registry)
        self.lost = Counter("segserve:replica_lost_streams", "Answers cut because their replica died "
                            "after the first byte", registry=self.registry)

    def app(self) -> FastAPI:
        app = FastAPI(title="segserve OpenAI-compatible server (Ray Serve replicas)")
        app.state.ingress = self

        @app.get("/health")
        async def health() -> Response:
            running, target = await asyncio.to_thread(self.status)
            body = {"replicas_running": running, "replicas_target": target}
            if running:
                return JSONResponse(body)
            return error_body(503, f"no replica is running ({running} of {target})", "server_error",
                              "no_replica")

        @app.get("/metrics")
        async def metrics() -> Response:
            texts = await self.board.fresh.remote()
            own = generate_latest(self.registry).decode()
            return Response(merge(texts) + own, media_type=CONTENT_TYPE_LATEST)

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
        async def forward(raw: Request, path: str) -> Response:
            return await self.forward(raw)

        return app

    async def forward(self, raw: Request) -> Response:
        body = await raw.body()
        req = HttpRequest(raw.method, raw.url.path, raw.url.query.encode(),
                          tuple((k.lower(), v) for k, v in raw.headers.raw), body)
        text = routing_text(body)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            gen = self.handle.http.remote(text, req)
            try:
                start, first = await _until_first_body(gen, raw)
            except _REPLICA_GONE as exc:
                gen.cancel()
                self.retries.inc()
                log.warning("replica lost before answering (attempt %d of %d): %s", attempt, MAX_ATTEMPTS,
                            type(exc).__name__)
                continue
            except asyncio.CancelledError:
                gen.cancel()
                raise
            if start is None:  # the client left first
                gen.cancel()
                return Response(status_code=499)
            headers = {k.decode(): v.decode() for k, v in start.get("headers", [])
                       if k.lower() not in (b"content-length", b"transfer-encoding")}
            if not first.get("more_body", False):
                return Response(first.get("body", b""), status_code=start["status"], headers=headers)
            media = headers.pop("content-type", None)
            return StreamingResponse(_relay(gen, first, media, self.lost), status_code=start["status"],
                                     headers=headers, media_type=media)
        return error_body(503, f"every replica tried ({MAX_ATTEMPTS}) died before answering", "server_error",
                          "replica_died")


async def _until_first_body(gen, raw: Request) -> tuple[dict | None, dict | None]:
    """(start message, first body message) of a replica's answer, or (None, None) when the client
    disconnects first. Raises what the replica call raised."""
    gone = asyncio.ensure_future(_disconnected(raw))
    try:
        start = None
        while True:
            nxt = asyncio.ensure_future(gen.__anext__())
            done, _ = await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:
                nxt.cancel()
                return None, None
            message = nxt.result()
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body" and (message.get("body") or
                                                              not message.get("more_body", False)):
                return start, message
    finally:
        gone.cancel()


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _relay(gen, first: dict, media: str | None, lost: Counter) -> AsyncIterator[bytes]:
    """The body: the first chunk, then the rest; a replica lost mid-stream ends an event stream with an
    error event and ``[DONE]``. Closing this iterator (client gone) cancels the replica call."""
    try:
        yield first.get("body", b"")
        async for message in gen:
            if message["type"] == "http.response.body":
                yield message.get("body", b"")
                if not message.get("more_body", False):
                    return
    except _REPLICA_GONE as exc:
        lost.inc()
        log.warning("replica lost mid-stream: %s", type(exc).__name__)
        if media and media.startswith("text/event-stream"):
            err = {"error": {"message": f"the replica serving this request died: {type(exc).__name__}",
                             "type": "server_error", "param": None, "code": "replica_died"}}
            yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
    finally:
        gen.cancel()
