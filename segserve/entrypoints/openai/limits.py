"""Limits the server checks before doing work: the request body size, a prompt's length in characters,
and the size of any client value quoted back in an error message (and the shutdown grace period's
default).

The body limit is an ASGI middleware, so it runs before FastAPI parses JSON: a body whose declared
``Content-Length`` is over the limit is answered 413 without reading it, and a body sent without a
length (chunked) is read only up to the limit. Either way no more than ``max_bytes`` of it is held in
memory.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

QUOTE_CHARS = 40  # longest prefix of a client value quoted in an error message
DEFAULT_MAX_BODY_BYTES = 8 * 2**20
# Seconds in-flight requests may run after SIGTERM/SIGINT (``shutdown.py``); below Kubernetes' default
# 30 s termination grace, so the server finishes its own shutdown before a SIGKILL.
DEFAULT_GRACE_S = 10.0
# Unread body bytes the server discards after a 413, so the client can read the answer instead of
# failing on a closed socket; beyond it the connection is closed.
_DRAIN_BYTES = 64 * 2**20

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def quote(value: Any, limit: int = QUOTE_CHARS) -> str:
    """A short, printable, ASCII description of a client value for an error message.

    Strings are quoted up to ``limit`` characters (lone surrogates and control characters escaped);
    huge numbers, lists and objects are described by their size instead of printed.
    """
    if isinstance(value, str):
        return f"'{printable(value, limit)}'"
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int):
        return str(value) if value.bit_length() <= 128 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} items" if len(value) > 8 else _short(ascii(value), limit)
    if isinstance(value, dict):
        return f"an object with {len(value)} keys"
    return _short(ascii(value), limit)


def printable(text: str, limit: int = QUOTE_CHARS) -> str:
    """``text`` cut to ``limit`` characters (its length said when cut), non-ASCII escaped as ``ascii``
    does, so a lone surrogate or a control character can always be written into a JSON answer."""
    shown = ascii(text[:limit])[1:-1]
    return shown if len(text) <= limit else f"{shown}... ({len(text)} characters)"


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}..."


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """Characters above which a text prompt cannot fit ``max_model_len`` tokens, whatever it says.

    Every token covers at most ``L`` characters of the text, ``L`` the longest vocabulary entry
    (byte-level BPE entries hold one character per byte, so ``L`` bounds bytes, hence characters;
    added tokens such as ``<|im_start|>`` count as their full string), so a text of more than
    ``max_model_len * L`` characters tokenizes to more than ``max_model_len`` tokens. A factor 2 covers
    normalizers that merge characters (NFKC composes a letter and its accent). Checking this bound
    before tokenizing keeps a 20 MB prompt from costing seconds of CPU and gigabytes of memory.
    """
    vocab = tokenizer.get_vocab()
    longest = max((len(t) for t in vocab), default=1)
    return 2 * max_model_len * max(longest, 1)


class BodyLimit:
    """ASGI middleware: a request whose body exceeds ``max_bytes`` gets 413 in OpenAI's error shape.

    The body of every POST is read here (up to the limit) and replayed to the app, so the app never
    sees a partial body; messages after the body (``http.disconnect``) pass through.

    Raises:
        ValueError: ``max_bytes`` < 1.
    """

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            # A client that waits for "100 Continue" never sends the body: answer at once.
            if (_header(scope, b"expect") or "").lower() != "100-continue":
                await _drain(receive, _DRAIN_BYTES)
            await self._refuse(send, f"{int(declared)} bytes")
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([], message, receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _drain(receive, _DRAIN_BYTES, more=message.get("more_body", False))
                await self._refuse(send, f"more than {self.max_bytes} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], None, receive), send)

    async def _refuse(self, send: Send, got: str) -> None:
        error = {"error": {"message": f"request body is {got}, above the limit of {self.max_bytes} bytes "
                           "(--max-request-body-bytes)", "type": "invalid_request_error",
                           "param": None, "code": "request_too_large"}}
        payload = json.dumps(error).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1").strip()
    return None


async def _drain(receive: Receive, budget: int, more: bool = True) -> None:
    """Read and drop up to ``budget`` body bytes (none are kept)."""
    while more and budget > 0:
        message = await receive()
        if message["type"] != "http.request":
            return
        budget -= len(message.get("body", b""))
        more = message.get("more_body", False)


def _replay(messages: list[dict[str, Any]], pending: dict[str, Any] | None, receive: Receive) -> Receive:
    """A ``receive`` that returns ``messages``, then ``pending`` (if any), then the real ones."""
    queue = list(messages) + ([pending] if pending is not None else [])

    async def replayed() -> dict[str, Any]:
        if queue:
            return queue.pop(0)
        return await receive()

    return replayed
