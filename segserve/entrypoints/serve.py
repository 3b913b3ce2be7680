"""``segserve serve``: the OpenAI-compatible HTTP server (flags under vLLM's names)."""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

from segserve.engine_args import DefaultsHelpFormatter, EngineArgs, check_cli_args
from segserve.entrypoints.openai.limits import DEFAULT_GRACE_S, DEFAULT_MAX_BODY_BYTES
from segserve.entrypoints.ray_serve import settings as scale_out
from segserve.simulator import budget
from segserve.simulator.budget import AUTO, add_budget_args

T = TypeVar("T")

log = logging.getLogger("segserve")


def default_served_names(file_name: str, model_arg: str | None) -> list[str]:
    """The names a server answers to without ``--served-model-name``: the model file's name (reported),
    and the model argument as given, which is what vLLM serves a path as (``serve ./dir`` answers
    ``"model": "./dir"``), so that clients written for vLLM keep working."""
    return [file_name] + ([model_arg] if model_arg and model_arg != file_name else [])


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``serve`` subcommand."""
    srv = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/...)",
                                formatter_class=DefaultsHelpFormatter)
    srv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                     help="GGUF file or HF directory, as vLLM's `serve MODEL` (same as --model)")
    EngineArgs.add_cli_args(srv)
    srv.add_argument(
        "--api-key", default=None,
        help="require `Authorization: Bearer KEY` on /v1/* (default: $SEGSERVE_API_KEY; else none)",
    )
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=int, default=8000,
                     help="TCP port to listen on, bound before the model loads; 0 picks a free one")
    srv.add_argument(
        "--served-model-name", nargs="+", default=None,
        help="model name(s) clients send as `model` (default: the model file's name, and MODEL as given)",
    )
    srv.add_argument(
        "--max-waiting-requests", type=int, default=256,
        help="bound on the waiting queue; requests beyond it get HTTP 503",
    )
    srv.add_argument("--log-interval", type=float, default=10.0, help="seconds between stats log lines")
    srv.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help='allow tool_choice "auto": the model\'s tool calls are parsed with --tool-call-parser',
    )
    srv.add_argument(
        "--tool-call-parser", choices=["hermes"], default=None,
        help="how tool calls are read from the output under tool_choice auto "
        "(hermes: <tool_call>{json}</tool_call>)",
    )
    srv.add_argument(
        "--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get HTTP 413 before they are read or parsed (default: 8 MiB)",
    )
    srv.add_argument(
        "--shutdown-grace-period", type=float, default=DEFAULT_GRACE_S,
        help="seconds in-flight requests may run after SIGTERM/SIGINT before they are aborted; the "
        "server then exits 0",
    )
    srv.add_argument(
        "--cache-salt-by-api-key", action="store_true",
        help="salt every request's prefix cache with a digest of its API key (Authorization: Bearer), so "
        "clients with different keys never share cached blocks and cannot probe each other's prompts "
        "through usage.prompt_tokens_details.cached_tokens",
    )
    add_budget_args(srv)
    srv.add_argument(
        "--profile", default=None,
        help="step-time profile JSON for the auto budget and the live step-error metrics (default: this "
        "machine's cached one, else the built-in, with a warning)",
    )
    srv.add_argument(
        "--calibrate", action="store_true",
        help="no usable cached profile for this machine: measure one at start-up (about a minute on 2 idle "
        "cores; profile --quick) and cache it",
    )
    scale_out.add_cli_args(srv)
    # The server sizes its budget for --target-itl-ms; offline use (LLM, generate) keeps 512.
    # --attention-cost-tokens not given: ``auto`` (K sized with the automatic budget) when the budget is
    # automatic, 0 (off) with a given one (``budget.attention_cost_for``).
    srv.set_defaults(func=run_serve, max_num_batched_tokens=AUTO, attention_cost_tokens=None)


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, start the engine thread and serve until SIGTERM/SIGINT; then shut down within
    ``--shutdown-grace-period`` and exit the process with status 0 (``shutdown.exit_now``)."""
    from segserve import LLMEngine
    from segserve.engine.step_monitor import StepErrorMonitor
    from segserve.entrypoints.openai.api_server import make_server
    from segserve.entrypoints.openai.shutdown import exit_now, serve

    if args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be >= 1, got {args.max_waiting_requests}")
    if args.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got {args.max_request_body_bytes}")
    if not args.log_interval > 0:  # also NaN; a line every 0 s would be a line every step
        raise ValueError(f"--log-interval must be > 0 seconds, got {args.log_interval}")
    if not args.shutdown_grace_period >= 0:
        raise ValueError(f"--shutdown-grace-period must be >= 0 seconds, got {args.shutdown_grace_period}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together (vLLM's rule)")
    use_ray = scale_out.wants_ray(args)
    if use_ray:
        scale_out.ScaleOut.from_cli_args(args).check_reachable()  # bad flags fail before any model work
    resolve_model_arg(args)
    # The port first, as vLLM binds it before building its engine: a taken one fails now, not after
    # the model has loaded (and clients that connect during the load wait in the backlog).
    sock = None if use_ray else listening_socket(args.host, args.port)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(message)s")
    t0 = time.perf_counter()
    auto = args.max_num_batched_tokens == AUTO
    given = None if auto else settle_budget(args, None)  # a bad number fails before any calibration
    if given is not None and args.attention_cost_tokens == AUTO:
        budget.attention_cost_for(AUTO, given)  # raises, naming both flags, before any model work
    choice = off_the_main_thread(_step_profile, args)  # --calibrate runs the model
    settled = given or settle_budget(args, choice)
    args.max_num_batched_tokens = settled.budget
    args.attention_cost_tokens = budget.attention_cost_for(args.attention_cost_tokens, settled)
    if use_ray:
        from segserve.entrypoints.ray_serve.launch import run_cluster

        return run_cluster(args, budget_source="auto" if auto else "given")
    llm_engine = off_the_main_thread(LLMEngine.from_engine_args, EngineArgs.from_cli_args(args))
    log.info("loaded in %.1f s: %s", time.perf_counter() - t0, llm_engine.describe())
    if choice is not None:
        source = choice.line.removeprefix("step profile: ")
        llm_engine.step_monitor = StepErrorMonitor(choice.model, source=source)
    app, engine = make_server(
        llm_engine, args.served_model_name or default_served_names(llm_engine.loaded.name, args.model),
        args.max_waiting_requests, args.log_interval,
        budget_source="auto" if auto else "given", max_request_body_bytes=args.max_request_body_bytes,
        cache_salt_by_api_key=args.cache_salt_by_api_key,
        api_key=args.api_key or os.environ.get("SEGSERVE_API_KEY") or None,
        tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
    )
    log.info("serving on http://%s:%d", *sock.getsockname()[:2])
    serve(app, sock, engine, args.shutdown_grace_period)
    exit_now(0)
    return 0  # not reached


def listening_socket(host: str, port: int) -> socket.socket:
    """``api_server.bind_socket(host, port)``, its failure named by the flags.

    Raises:
        OSError: the address cannot be bound (in use, not this machine's, a privileged port).
    """
    from segserve.entrypoints.openai.api_server import bind_socket

    try:
        return bind_socket(host, port)
    except OSError as exc:
        reason = (exc.strerror or str(exc)).lower()
        raise OSError(exc.errno, f"--host {host} --port {port}: {reason} (another server there? pick another "
                      f"--port, or 0 for a free one)") from None


def off_the_main_thread(fn: Callable[..., T], *fn_args: Any) -> T:
    """``fn(*fn_args)`` run in a thread of its own, joined; its result, or its exception re-raised here.

    Why: the server steps its engine in the engine thread, and libgomp keeps one pool of OpenMP workers
    per thread that ever opened a parallel region. When the main thread had built the model (packing,
    a warm-up step, calibration), its idle pool stayed beside the engine thread's, and every step of
    the engine thread ran slower: on the AMX Xeon (2 threads, bfloat16 export, batch-1 decode, the same
    engine stepped in a second thread) 13.5-13.8 ms a step when built in the main thread against
    11.3-11.5 ms when built in a thread that then exited (its pool goes with it), 10.4-11.0 ms with
    build and steps in one thread. A helper thread's workers leave with it, so the engine thread's pool
    is the process's only one (leaving the ``with`` joins it)."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="segserve-build") as worker:
        return worker.submit(fn, *fn_args).result()


def resolve_model_arg(args: argparse.Namespace) -> None:
    """``serve MODEL`` and ``--model`` name the same thing; both given and different is an error.
    The engine flags and the model path are checked here (``engine_args.check_cli_args``), and ``--dtype
    auto`` becomes the checkpoint's dtype, so the step profile is looked up for it."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    check_cli_args(args)  # before the step profile and the model: a bad flag fails in a second
    if args.dtype == "auto":
        from segserve.engine.llm_engine import auto_dtype

        args.dtype = str(auto_dtype(args.model)).removeprefix("torch.")


def _step_profile(args: argparse.Namespace):
    """The step profile (``calibration.choose_profile``), logged in one line. With ``auto`` its errors
    stop the start-up; with a given budget the profile only feeds the live error metrics, so an unusable
    cache file is logged and the metrics go without (None)."""
    from segserve.simulator.calibration import ProfileError, choose_profile, fingerprint_for_args

    try:
        choice = choose_profile(fingerprint_for_args(args), args.profile, args.calibrate)
    except ProfileError as e:
        if args.max_num_batched_tokens == AUTO:
            raise
        log.warning("no step-error metrics: %s", e)
        return None
    log.info("%s", choice.line)
    if choice.warning:
        log.warning("%s", choice.warning)
    return choice


def settle_budget(args: argparse.Namespace, choice):
    """``--max-num-batched-tokens``: a number (at least one block) or ``auto`` from the profile; logged.
    The model's context length is not known before it loads: without --max-model-len the search runs
    to ``AUTO_MAX_BUDGET``, its cap anyway."""
    from segserve.engine_args import given_max_model_len
    from segserve.simulator import budget

    settled = budget.settle_budget(
        args.max_num_batched_tokens, choice and choice.model, args.target_itl_ms, args.block_size,
        args.max_num_seqs, given_max_model_len(args.max_model_len) or budget.AUTO_MAX_BUDGET,
    )
    log.info("%s", settled.line)
    return settled
