"""``segserve serve``: the OpenAI-compatible HTTP server (flags under vLLM's names)."""

from __future__ import annotations

import argparse
import logging
import time

from segserve.engine_args import EngineArgs


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``serve`` subcommand."""
    srv = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/...)")
    EngineArgs.add_cli_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument(
        "--served-model-name", nargs="+", default=None,
        help="model name(s) clients send as `model` (default: the model file's name)",
    )
    srv.add_argument(
        "--max-waiting-requests", type=int, default=256,
        help="bound on the waiting queue; requests beyond it get HTTP 503",
    )
    srv.add_argument("--log-interval", type=float, default=10.0, help="seconds between stats log lines")
    srv.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, start the engine thread and serve until interrupted."""
    import uvicorn

    from segserve import LLMEngine
    from segserve.entrypoints.openai.api_server import bind_socket, make_server

    if args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be >= 1, got {args.max_waiting_requests}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(message)s")
    t0 = time.perf_counter()
    llm_engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    log = logging.getLogger("segserve")
    log.info("loaded in %.1f s: %s", time.perf_counter() - t0, llm_engine.describe())
    app, engine = make_server(
        llm_engine, args.served_model_name, args.max_waiting_requests, args.log_interval
    )
    sock = bind_socket(args.host, args.port)
    log.info("serving on http://%s:%d", *sock.getsockname()[:2])
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="info")).run(sockets=[sock])
    finally:
        engine.shutdown()
    return 0
