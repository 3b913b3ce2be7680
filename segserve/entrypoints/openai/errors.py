"""Errors of the OpenAI-compatible server, answered in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

A 503 (the request may succeed later) carries ``Retry-After``; a 500 carries a generic message and an
id that the log repeats beside the traceback, never the exception itself; every body is ASCII JSON, so
an error that quotes a client's lone surrogate still encodes.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from segserve.engine.async_engine import EngineDeadError, ShuttingDownError
from segserve.entrypoints.openai import protocol as p

logger = logging.getLogger("segserve")


@dataclass
class ApiError(Exception):
    """An error answered in OpenAI's shape with an HTTP status."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None

    def response(self) -> JSONResponse:
        info = p.ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        headers = dict(self.headers or {})
        if self.status == 503:
            headers.setdefault("Retry-After", str(RETRY_AFTER_S))
        return AsciiJSONResponse(p.ErrorResponse(error=info).model_dump(), status_code=self.status,
                                 headers=headers)


# Seconds a client told 503 waits before retrying: about one waiting request's time in the queue.
RETRY_AFTER_S = 1


class AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error message that quotes a client's lone
    surrogate still encodes (UTF-8 cannot), so an error never turns into a 500."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def bad_request(message: str, param: str | None = None) -> ApiError:
    """400 naming the request field ``param``."""
    return ApiError(400, message, param=param)


def engine_error(exc: EngineDeadError) -> ApiError:
    """503 for a request the engine cannot run: shutting down, or its loop died (details in the log)."""
    if isinstance(exc, ShuttingDownError):
        return ApiError(503, f"the server is shutting down: {exc}", type="server_error", code="shutting_down")
    return ApiError(503, "the engine loop is not running (see the server log)", type="server_error",
                    code="engine_dead")


def internal_error(exc: BaseException) -> ApiError:
    """500 with a generic message and an id; the id and the traceback go to the log, never to the client."""
    error_id = uuid.uuid4().hex[:16]
    logger.error("internal error %s", error_id, exc_info=exc)
    return ApiError(500, f"internal server error (id {error_id}; the server log has the details)",
                    type="server_error", code="internal_error")
