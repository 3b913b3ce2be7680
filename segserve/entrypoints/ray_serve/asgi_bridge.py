"""Run one HTTP request through an in-process ASGI app and hand back its ASGI messages as they come.

Each replica serves requests through ``segserve.entrypoints.openai``'s own FastAPI app, so routes,
streaming, validation and error shapes are exactly those of ``segserve serve``. The caller leaving
(the ingress's client disconnected, or the replica's generator closed) is told to the app as
``http.disconnect``, which aborts the request and frees its KV blocks as in the single server.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

# After a disconnect, the app has this long to unwind (abort the request) before it is cancelled.
DISCONNECT_GRACE_S = 2.0


@dataclass(frozen=True)
class HttpRequest:
    """What the ingress forwards: method, path, raw query string, headers (lower-case names) and body."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes

    def scope(self) -> dict[str, Any]:
        return {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": self.method, "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
            "query_string": self.query, "root_path": "", "headers": list(self.headers),
            "server": ("127.0.0.1", 0), "client": ("127.0.0.1", 0),
        }


async def asgi_messages(app, request: HttpRequest) -> AsyncIterator[dict[str, Any]]:
    """Yield ``http.response.start`` then each ``http.response.body`` message of ``app``'s answer.

    Raises whatever the app raised (FastAPI turns handler errors into responses first)."""
    out: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await out.put(message)

    task = asyncio.ensure_future(app(request.scope(), receive, send))
    task.add_done_callback(lambda _: out.put_nowait(None))
    try:
        while (message := await out.get()) is not None:
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                break
        if task.done() and task.exception() is not None:
            raise task.exception()
    finally:
        if not task.done():
            gone.set()
            asyncio.get_running_loop().call_later(DISCONNECT_GRACE_S, task.cancel)
