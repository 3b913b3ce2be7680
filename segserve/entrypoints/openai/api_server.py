"""The FastAPI app of the OpenAI-compatible server and the glue that starts it.

Routes: ``GET /health``, ``GET /metrics``, ``GET /version``, ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /tokenize``, ``POST /detokenize``.
With an API key, every ``/v1/*`` route wants ``Authorization: Bearer KEY`` (401 otherwise).
Every error, including a malformed body and an unknown route, is answered in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``; client input never causes a 500, and an
unexpected internal error is a 500 with a generic message and an id that the log repeats next to the
traceback. ``/openapi.json`` documents the status codes actually sent (``openapi.py``).
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from segserve.engine.async_engine import AsyncLLMEngine
from segserve.entrypoints.openai import openapi
from segserve.entrypoints.openai import protocol as p
from segserve.entrypoints.openai import tokenize as tk
from segserve.entrypoints.openai.errors import ApiError, internal_error
from segserve.entrypoints.openai.limits import DEFAULT_MAX_BODY_BYTES, BodyLimit, printable, quote
from segserve.entrypoints.openai.metrics import EngineMetrics, StatLogger
from segserve.entrypoints.openai.serving import OpenAIServing, leading_name
from segserve.entrypoints.openai.serving_chat import create_chat_completion
from segserve.entrypoints.openai.serving_completion import create_completion

logger = logging.getLogger("segserve")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) of pydantic's complaint about the first bad field of a body. A field of
    several accepted types (``prompt``) gets one complaint per type; the one that got furthest into
    the value says best what is wrong (``prompt: [[false]]`` -> ``prompt.0.0`` is not an integer)."""
    errors = exc.errors()
    err = errors[0]
    if err.get("type") == "json_invalid":
        return f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}", None
    if err.get("type") == "missing" and tuple(err.get("loc", ())) == ("body",):
        return "the request body is empty: a JSON object is expected", None
    same_field = [e for e in errors if tuple(e.get("loc", ()))[:2] == tuple(err.get("loc", ()))[:2]]
    # Deepest first; at equal depth the member that expected the value's own kind (prompt: [1.5] is a
    # bad token id, not a bad string).
    err = max(same_field, key=lambda e: (len(e.get("loc", ())), _expects_its_kind(e)))
    loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _is_union_tag(x)]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    if err.get("type") == "value_error":  # our validators' ValueError: its text names value and limit
        message = str(err.get("ctx", {}).get("error", err.get("msg")))
        first = leading_name(message)
        if param is None:  # a check across fields starts with the field it blames (min_tokens=5 ...)
            param = first if isinstance(exc.body, dict) and first in exc.body else None
        # Our messages start with the field's name ("temperature must be ..."): no second one before it.
        named = bool(loc) and first == loc[-1]
        return (f"{where}: {message}" if loc and not named else message), param
    return f"{where}: {err.get('msg')} (got {quote(err.get('input'))})", param


def _expects_its_kind(err: dict) -> bool:
    """Whether pydantic's complaint comes from a type of the kind of the value it got: a number (or
    boolean) refused by an integer, float or boolean type, a string by a string type."""
    value, kind = err.get("input"), str(err.get("type", ""))
    if isinstance(value, bool | int | float):
        return kind.startswith(("int", "float", "bool"))
    return isinstance(value, str) and kind.startswith("string")


def _is_union_tag(part: object) -> bool:
    """True for the member names pydantic puts in an error's location (``str``, ``list[int]``,
    ``TextPart``), which are no part of the client's field path."""
    return isinstance(part, str) and (part[:1].isupper() or "[" in part
                                      or part in {"str", "int", "float", "bool", "list", "dict"})


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        kind = request.headers.get("content-type", "")
        if not isinstance(exc.body, dict) and "json" not in kind.lower():
            # FastAPI reads a body as JSON only when the header says so (curl -d sends a form type).
            return ApiError(400, f"the body must be a JSON object sent with Content-Type: application/json, "
                                 f"got Content-Type: {printable(kind, 80) or '(none)'}").response()
        message, param = _validation_message(exc)
        return ApiError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            # FastAPI's words when json.loads of the body raised: not UTF-8 (UnicodeDecodeError), or nested
            # past Python's recursion limit (RecursionError, ~500 levels: a trial's finding)
            if isinstance(exc.__cause__, RecursionError):
                return ApiError(400, "malformed body: JSON nested too deeply to parse").response()
            return ApiError(400, "malformed body: not valid UTF-8 JSON").response()
        # exc.headers carries Allow on a 405.
        return ApiError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        return internal_error(exc).response()


def _install_api_key(app: FastAPI, api_key: str) -> None:
    """Bearer-token check on ``/v1/*`` (vLLM's ``--api-key``), answered in OpenAI's error shape."""
    import hmac

    expected = f"Bearer {api_key}"

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if request.url.path.startswith("/v1") and request.method != "OPTIONS":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), expected.encode()):
                return ApiError(401, "Incorrect API key provided (send Authorization: Bearer <key>)",
                                code="invalid_api_key").response()
        return await call_next(request)


def build_app(engine: AsyncLLMEngine, served_model_names: list[str], metrics: EngineMetrics,
              max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES, cache_salt_by_api_key: bool = False,
              api_key: str | None = None, tool_parser: str | None = None) -> FastAPI:
    """The app over a started ``engine``; ``metrics`` must be one of the engine's observers.

    Args:
        max_request_body_bytes: larger request bodies get 413 before they are parsed.
        cache_salt_by_api_key: salt every request's prefix cache by its API key (``serving.tenant_salt``).
        api_key: required as a Bearer token on ``/v1/*`` when set.
        tool_parser: the tool-call parser (e.g. ``"hermes"``) that enables ``tool_choice: "auto"``.

    Raises:
        ValueError: ``max_request_body_bytes`` < 1.
    """
    app = FastAPI(title="segserve OpenAI-compatible server")
    app.add_middleware(BodyLimit, max_bytes=max_request_body_bytes)
    serving = OpenAIServing(engine, served_model_names, salt_by_api_key=cache_salt_by_api_key,
                            tool_parser=tool_parser)
    app.state.serving = serving
    _install_error_handlers(app)
    if api_key:
        _install_api_key(app, api_key)

    @app.get("/health", response_class=Response, responses=openapi.HEALTH)
    async def health() -> Response:
        if engine.is_running:
            return Response(status_code=200)
        return ApiError(503, "the engine loop is not running (see the server log)", type="server_error",
                        code="engine_dead").response()

    @app.get("/metrics", response_class=Response, responses=openapi.METRICS)
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version", responses=openapi.VERSION)
    async def version() -> dict:
        from segserve import __version__

        return {"version": __version__}

    @app.get("/v1/models", response_model=p.ModelList, responses=openapi.MODELS)
    async def models() -> p.ModelList:
        root = engine.engine.loaded.name
        return p.ModelList(data=[p.ModelCard(id=name, root=root, max_model_len=serving.max_model_len,
                                             permission=[p.model_permission()])
                                 for name in served_model_names])

    @app.post("/tokenize", responses=openapi.tokenizer_route(tk.TokenizeResponse))
    async def tokenize(body: tk.TokenizeRequest) -> tk.TokenizeResponse:
        return await tk.tokenize(serving, body)

    @app.post("/detokenize", responses=openapi.tokenizer_route(tk.DetokenizeResponse))
    async def detokenize(body: tk.DetokenizeRequest) -> tk.DetokenizeResponse:
        return await tk.detokenize(serving, body)

    @app.post("/v1/completions", response_model=None, responses=openapi.generation(p.CompletionResponse))
    async def completions(body: p.CompletionRequest, raw: Request) -> Any:
        return await create_completion(serving, body, raw)

    @app.post("/v1/chat/completions", response_model=None,
              responses=openapi.generation(p.ChatCompletionResponse, p.ChatCompletionChunk))
    async def chat(body: p.ChatCompletionRequest, raw: Request) -> Any:
        return await create_chat_completion(serving, body, raw)

    openapi.install(app)
    return app


def make_server(
    llm_engine,
    served_model_names: list[str] | None = None,
    max_waiting_requests: int = 256,
    log_interval_s: float = 10.0,
    budget_source: str = "given",
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    cache_salt_by_api_key: bool = False,
    api_key: str | None = None,
    tool_parser: str | None = None,
) -> tuple[FastAPI, AsyncLLMEngine]:
    """Wrap an ``LLMEngine`` in a started ``AsyncLLMEngine`` (metrics + log line) and build the app.

    Args:
        llm_engine: the engine; from now on only the engine thread touches it.
        served_model_names: names accepted as ``model`` (default: the model's name).
        max_waiting_requests: bound on the waiting queue; beyond it requests get 503.
        log_interval_s: period of the stats log line, seconds.
        budget_source: ``"auto"`` when the step budget was sized from the step profile (the label of
            ``segserve:max_num_batched_tokens``), else ``"given"``.
        max_request_body_bytes, cache_salt_by_api_key: as ``build_app``.
        api_key: Bearer token required on ``/v1/*`` (None: open).
        tool_parser: the tool-call parser of ``tool_choice: "auto"`` (``--enable-auto-tool-choice
            --tool-call-parser hermes``); None refuses ``auto``.

    Raises:
        ValueError: an unknown ``tool_parser``.
    """
    from segserve.entrypoints.openai.tool_calls import TOOL_CALL_PARSERS

    if tool_parser is not None and tool_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_parser must be one of {list(TOOL_CALL_PARSERS)}, got {tool_parser!r}")
    names = served_model_names or [llm_engine.loaded.name]
    # xgrammar's tables of the vocabulary (~1 s for 49k tokens): built now, not on the engine thread
    # when the first constrained request arrives (every stream would stall for it).
    llm_engine.grammar_gate  # noqa: B018 - the property builds it
    metrics = EngineMetrics(names[0], max_model_len=llm_engine.max_model_len)
    metrics.describe_engine(llm_engine, budget_source)
    engine = AsyncLLMEngine(llm_engine, max_waiting_requests, observers=(metrics, StatLogger(log_interval_s)))
    metrics.watch_loop(engine)
    engine.start()
    app = build_app(engine, names, metrics, max_request_body_bytes, cache_salt_by_api_key, api_key,
                    tool_parser)
    return app, engine


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: a free one, read back with ``getsockname()``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock
