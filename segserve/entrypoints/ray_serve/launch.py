"""Start (or join) Ray, deploy the replicas, serve the ingress, and stop everything on exit.

::

    client ──HTTP──▶ ingress (this process: uvicorn + FastAPI, ingress.py)
                       │ Serve handle; its request router picks a replica (routers.py)
                       ▼
              EngineReplica × N (Ray Serve deployment, replica.py): LLMEngine + the OpenAI app
                       │ Prometheus text every second
                       ▼
              MetricsBoard actor (board.py) ──▶ ingress /metrics (replica label)

A local cluster starts with the dashboard off, usage stats off and every Ray service on 127.0.0.1
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: Ray's single-machine mode, which binds loopback only), in
its own temp dir; on exit (Ctrl-C, SIGTERM) this process deletes the app, shuts Serve down and stops
the cluster it started (a joined cluster keeps running; the app and the board are removed, and Serve
when this process started it there and no other app is left; ``join.py`` joins it).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from segserve.entrypoints.ray_serve import join
from segserve.entrypoints.ray_serve.settings import ScaleOut

log = logging.getLogger("segserve")
APP_NAME = "segserve"
DEPLOYMENT = "EngineReplica"
# Session dirs (logs, sockets) of the local clusters this process started, removed by ``stop``.
_LOCAL_TEMP_DIRS: list[str] = []


def start_ray(scale: ScaleOut, num_cpus: int | None = None) -> bool:
    """``ray.init`` a local cluster (True) or join ``scale.ray_address`` (False).

    Raises:
        ValueError: ``--ray-address`` cannot be reached (one line naming the flag).
    """
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if scale.ray_address is None:
        # Ray's single-machine mode: the node address is 127.0.0.1, so every service binds loopback.
        # The variable reaches Ray's daemons and workers; the constant covers a Ray imported earlier.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    from ray._private import ray_constants

    if scale.ray_address is None:
        ray_constants.ENABLE_RAY_CLUSTER = False
        _LOCAL_TEMP_DIRS.append(tempfile.mkdtemp(prefix="segserve-ray-"))
        ray.init(address="local", include_dashboard=False, num_cpus=num_cpus or scale.available_cpus,
                 log_to_driver=False, configure_logging=False, _temp_dir=_LOCAL_TEMP_DIRS[-1])
        return True
    join.join(scale.ray_address)
    return False


@dataclass(frozen=True)
class ReplicaSpec:
    """What each replica is built from (``EngineReplica``'s arguments) and how Serve places it."""

    engine_args: object
    served_model_names: list[str] | None
    max_waiting_requests: int
    log_interval_s: float
    budget_source: str
    max_num_seqs: int
    observers: tuple = ()
    server_options: dict | None = None  # make_server's keyword settings


def router_config(scale: ScaleOut):
    """Serve's ``RequestRouterConfig`` for ``--router`` (None: Serve's power-of-two default)."""
    from ray.serve.config import RequestRouterConfig

    from segserve.entrypoints.ray_serve import routers

    if scale.router == "prefix_affinity":
        return RequestRouterConfig(request_router_class=routers.PrefixAffinityRouter, request_router_kwargs={
            "imbalanced_threshold": scale.imbalanced_threshold,
            "match_rate_threshold": scale.match_rate_threshold})
    if scale.router == "round_robin":
        return RequestRouterConfig(request_router_class=routers.RoundRobinRouter)
    return None


def deploy(scale: ScaleOut, spec: ReplicaSpec, app_name: str = APP_NAME):
    """Start Serve (no HTTP proxy: the ingress is this process), the board and the replicas as app
    ``app_name``; returns (handle, board) once every replica is up. A process keeps one request
    router per deployment, so another router needs another app name."""
    from ray import serve

    from segserve.entrypoints.ray_serve.board import MetricsBoard
    from segserve.entrypoints.ray_serve.replica import EngineReplica

    serve.start(proxy_location="Disabled")
    board = MetricsBoard.options(name=f"{app_name}-metrics-board", get_if_exists=True).remote()
    threads = str(scale.replica_cpus)
    options = dict(
        name=DEPLOYMENT, num_replicas=scale.num_replicas,
        # A batching engine wants every request it can queue: Serve's default of 5 would starve it.
        max_ongoing_requests=spec.max_num_seqs + spec.max_waiting_requests,
        ray_actor_options={"num_cpus": scale.replica_cpus, "runtime_env": {"env_vars": {
            "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}}},
        health_check_period_s=2, health_check_timeout_s=30, graceful_shutdown_timeout_s=5,
    )
    rc = router_config(scale)
    if rc is not None:
        options["request_router_config"] = rc
    app = serve.deployment(EngineReplica).options(**options).bind(
        spec.engine_args, spec.served_model_names, spec.max_waiting_requests, spec.log_interval_s,
        spec.budget_source, scale.replica_cpus, board, spec.observers, scale.ray_address is None,
        spec.server_options)
    handle = serve.run(app, name=app_name, route_prefix=None)
    return handle, board


def replica_counts(target: int, app_name: str = APP_NAME) -> tuple[int, int]:
    """(running, target) replicas of the deployment, from Serve's status."""
    from ray import serve

    try:
        dep = serve.status().applications[app_name].deployments[DEPLOYMENT]
    except KeyError:
        return 0, target
    return dep.replica_states.get("RUNNING", 0), target


def serve_running() -> bool:
    """Whether Serve's controller runs on the connected cluster (read from its named actors)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    return any(a["name"] == SERVE_CONTROLLER_NAME and a.get("namespace") == SERVE_NAMESPACE
               for a in ray.util.list_named_actors(all_namespaces=True))


def check_app_free(address: str, app_name: str = APP_NAME) -> None:
    """ValueError naming ``--ray-address`` when the joined cluster already runs an app of that name:
    deploying would replace another ingress's replicas, and stopping would delete them."""
    from ray import serve

    if serve_running() and app_name in serve.status().applications:
        raise ValueError(f"--ray-address {address}: the cluster already runs a Serve app named {app_name!r} "
                         "(another segserve serve?); stop that one first")


def stop(started_cluster: bool, board, started_serve: bool = False) -> None:
    """Delete the app and the board; shut Serve down when we started it and no other app is left on
    it, and stop the local cluster when we started that (a joined cluster is left as we found it)."""
    import ray
    from ray import serve

    try:
        if started_cluster:
            serve.shutdown()
        elif serve_running():
            serve.delete(APP_NAME)
            if started_serve and not serve.status().applications:
                serve.shutdown()
        if board is not None:
            ray.kill(board)
    finally:
        ray.shutdown()
        while started_cluster and _LOCAL_TEMP_DIRS:
            shutil.rmtree(_LOCAL_TEMP_DIRS.pop(), ignore_errors=True)


@dataclass
class Deployment:
    """A running scale-out: the Serve handle, the metrics board and the ingress app over them."""

    handle: object
    board: object
    app: object


@contextmanager
def serve_replicas(scale: ScaleOut, spec: ReplicaSpec, num_cpus: int | None = None) -> Iterator[Deployment]:
    """The Python way in: Ray started (or joined), the replicas deployed and the ingress app built;
    everything stopped on exit. ``num_cpus``: a local cluster's CPUs (default: the machine's)."""
    from segserve.entrypoints.ray_serve.ingress import Ingress

    started, board = start_ray(scale, num_cpus), None
    started_serve = started or not serve_running()
    if not started:
        try:
            check_app_free(scale.ray_address)
        except ValueError:
            import ray

            ray.shutdown()
            raise
    try:
        handle, board = deploy(scale, spec)
        log.info("%d replicas x %d CPUs, router %s", scale.num_replicas, scale.replica_cpus, scale.router)
        ingress = Ingress(handle, lambda: replica_counts(scale.num_replicas), board)
        yield Deployment(handle, board, ingress.app())
    finally:
        stop(started, board, started_serve)


def run_cluster(args: argparse.Namespace, budget_source: str) -> int:
    """``segserve serve`` with Ray Serve replicas: deploy, serve the ingress until a signal, stop."""
    import uvicorn

    from segserve.engine_args import EngineArgs
    from segserve.entrypoints.openai.api_server import bind_socket
    from segserve.entrypoints.openai.limits import BodyLimit

    scale = ScaleOut.from_cli_args(args)
    sock = bind_socket(args.host, args.port)  # a taken port fails before Ray starts
    engine_args = EngineArgs.from_cli_args(args)
    options = {"max_request_body_bytes": args.max_request_body_bytes,
               "cache_salt_by_api_key": args.cache_salt_by_api_key,
               "api_key": args.api_key or os.environ.get("SEGSERVE_API_KEY") or None}
    spec = ReplicaSpec(engine_args, args.served_model_name, args.max_waiting_requests, args.log_interval,
                       budget_source, engine_args.max_num_seqs, server_options=options)
    try:
        with serve_replicas(scale, spec) as dep:
            # SIGTERM stops like Ctrl-C (uvicorn re-raises what it caught once it has stopped; Ray's
            # own handler, installed by ray.init, would exit with status 15), then serve_replicas
            # cleans up.
            signal.signal(signal.SIGTERM, signal.default_int_handler)
            log.info("serving on http://%s:%d", *sock.getsockname()[:2])
            # The ingress reads whole bodies: it keeps the replicas' body limit (413 unread).
            app = BodyLimit(dep.app, args.max_request_body_bytes)
            # In-flight requests get --shutdown-grace-period; then uvicorn cancels them, which
            # cancels their replica calls, which aborts them on the replicas.
            grace = args.shutdown_grace_period
            config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=grace)
            uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return 0
