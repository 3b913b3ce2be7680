"""What ``/openapi.json`` says each route answers: the real response models and the status codes the
server actually sends (a test runs schemathesis against it).

FastAPI declares a 422 for every route with a body; this server answers validation errors with 400 in
OpenAI's error shape, so ``install`` replaces it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from segserve.entrypoints.openai import protocol as p

Responses = dict[int | str, dict[str, Any]]


def _error(description: str) -> dict[str, Any]:
    return {"model": p.ErrorResponse, "description": description}


_UNAVAILABLE = {
    "model": p.ErrorResponse,
    "description": "the waiting queue is full, the server is shutting down or the engine loop stopped; "
    "retry after the `Retry-After` seconds",
    "headers": {"Retry-After": {"description": "seconds to wait before retrying",
                                "schema": {"type": "integer"}}},
}

HEALTH: Responses = {
    200: {"description": "the engine loop is running (empty body)", "content": {}},
    503: {**_UNAVAILABLE, "description": "the engine loop is not running"},
}

METRICS: Responses = {
    200: {"description": "Prometheus text exposition format",
          "content": {"text/plain": {"schema": {"type": "string"}}}},
}

_UNAUTHORIZED = _error("with --api-key: the `Authorization: Bearer` header is missing or wrong")

MODELS: Responses = {200: {"description": "the served models"}, 401: _UNAUTHORIZED}

VERSION: Responses = {200: {"description": 'segserve\'s version, `{"version": "..."}`'}}


def tokenizer_route(response: type[BaseModel]) -> Responses:
    """Responses of ``/tokenize`` and ``/detokenize``: ``response`` as JSON, or an error."""
    return {
        200: {"model": response, "description": f"`{response.__name__}`"},
        400: _error("invalid request: a field of the wrong type, a token id outside the vocabulary"),
        404: _error("the model named in `model` is not served here"),
        413: _error("the request body is above --max-request-body-bytes"),
        500: _error("unexpected internal error; the message carries an id that the server log repeats"),
    }


def _sse_event(model_name: str) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1 reads an event stream's ``schema`` as one event): its data is
    ``[DONE]`` or a JSON ``model_name`` or ``ErrorResponse``."""
    payload = {"anyOf": [{"$ref": f"#/components/schemas/{model_name}"},
                         {"$ref": "#/components/schemas/ErrorResponse"}]}
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"type": "string"},
            "data": {"anyOf": [{"type": "string", "const": "[DONE]"},
                               {"type": "string", "contentMediaType": "application/json",
                                "contentSchema": payload}]},
        },
    }


def generation(response: type[BaseModel], chunk: type[BaseModel] | None = None) -> Responses:
    """Responses of a generation route: ``response`` as JSON, or server-sent events with
    ``stream: true`` (each ``data:`` line one ``chunk``, or ``response`` when ``chunk`` is None; an
    error mid-stream is one ``ErrorResponse`` event; the stream ends with ``data: [DONE]``)."""
    event = (chunk or response).__name__
    return {
        200: {
            "model": response,
            "description": f"`{response.__name__}`; with `stream: true`, server-sent events whose data lines "
            f"are `{event}` objects (an `ErrorResponse` if the request fails mid-stream), then `[DONE]`",
            "content": {"text/event-stream": {"schema": _sse_event(event)}},
        },
        400: _error("invalid request: a field out of range or of the wrong type, a prompt too long for "
                    "max_model_len, malformed JSON"),
        401: _UNAUTHORIZED,
        404: _error("the model named in `model` is not served here"),
        413: _error("the request body is above --max-request-body-bytes"),
        499: _error("the client closed the connection before the answer (not seen by the client)"),
        500: _error("unexpected internal error; the message carries an id that the server log repeats"),
        503: _UNAVAILABLE,
    }


def install(app: FastAPI) -> None:
    """Make ``app.openapi()`` drop FastAPI's 422 (validation errors are 400 here) and list the
    streaming chunk models among the components."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in doc.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = doc.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            for model in (p.ChatCompletionChunk, p.CompletionResponse):
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                for sub, sub_schema in schema.pop("$defs", {}).items():
                    schemas.setdefault(sub, sub_schema)
                schemas.setdefault(model.__name__, schema)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = build  # type: ignore[method-assign]
