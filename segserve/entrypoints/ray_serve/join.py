"""Joining a running Ray cluster (``--ray-address``): fail fast, in one line naming the flag.

``ray.init(address=...)`` on its own makes three cases slow or obscure, each handled here before or
around it (checked against the pinned Ray 2.60):

* a loopback address (``127.0.0.1:6379``) is rewritten by Ray to this machine's outward IP, where a
  cluster started in single-machine mode (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, every service on
  127.0.0.1) does not listen: Ray then retries for about 40 s per attempt, 20 attempts. When the
  outward IP does not answer on that port and loopback does, this process joins in single-machine
  mode too (its node address is then 127.0.0.1, as that cluster's raylet's is);
* a port that accepts TCP but is no Ray GCS (no gRPC): refused after ``GRPC_PROBE_S``;
* a cluster with Ray token authentication joined without ``RAY_AUTH_MODE=token`` (Ray never sends
  the local token to an explicit address on its own): refused with what to set.

Connection attempts are capped at one (``RAY_gcs_server_port_wait_time_s``, unless set), since the
probes above already waited for the GCS.
"""

from __future__ import annotations

import os
import socket

GRPC_PROBE_S = 3.0
_LOCALHOSTS = ("127.0.0.1", "localhost", "::1")


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of ``host:port`` (an optional ``ray://`` dropped). Raises ValueError naming the flag."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not host or not 0 < number < 65536:
        raise ValueError(f"--ray-address must be HOST:PORT (the GCS of a running cluster), got {address!r}")
    return host.strip("[]"), number


def tcp_open(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether something accepts a TCP connection at ``host:port``."""
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def check_listening(address: str, timeout_s: float = 5.0) -> tuple[str, int]:
    """(host, port) of ``address``; ValueError naming the flag when it is malformed or nothing listens."""
    host, port = split_address(address)
    if not tcp_open(host, port, timeout_s):
        raise ValueError(f"--ray-address {address}: unreachable (nothing accepts connections at "
                         f"{host}:{port})")
    return host, port


def needs_single_machine_mode(host: str, port: int) -> bool:
    """True for a loopback ``host`` whose cluster does not answer on this machine's outward IP (Ray
    would dial that one: ``resolve_ip_for_localhost``)."""
    if host not in _LOCALHOSTS:
        return False
    from ray._private.services import node_ip_address_from_perspective

    return not tcp_open(node_ip_address_from_perspective(), port)


def check_grpc(address: str, host: str, port: int, timeout_s: float = GRPC_PROBE_S) -> None:
    """ValueError naming the flag when ``host:port`` does not speak gRPC (it is no Ray GCS)."""
    import grpc

    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    channel = grpc.insecure_channel(target)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        raise ValueError(f"--ray-address {address}: something listens there but it is not a Ray cluster "
                         f"(no gRPC answer in {timeout_s:.0f} s)") from None
    finally:
        channel.close()


def join_error(address: str, exc: BaseException) -> ValueError:
    """The one-line error for a failed ``ray.init(address=...)``."""
    chain, e = [], exc
    while e is not None and len(chain) < 8:
        chain.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    text = "\n".join(chain)
    if "InvalidAuthToken" in text or "AuthenticationError" in text or "authentication token" in text.lower():
        return ValueError(
            f"--ray-address {address}: the cluster uses Ray token authentication and refused this process: "
            "set RAY_AUTH_MODE=token and give the cluster's token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or "
            "~/.ray/auth_token)")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ValueError(f"--ray-address {address}: cannot join the cluster: {first}")


def join(address: str) -> None:
    """``ray.init`` on the cluster at ``address`` (see the module docstring).

    Raises:
        ValueError: one line naming ``--ray-address``: a malformed address, nothing listening, no Ray
            there, refused authentication, or any other failure to join.
    """
    host, port = check_listening(address)
    check_grpc(address, host, port)
    import ray
    from ray._private import ray_constants

    if needs_single_machine_mode(host, port):
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        ray_constants.ENABLE_RAY_CLUSTER = False
    attempts = "RAY_gcs_server_port_wait_time_s"
    preset = os.environ.get(attempts)
    os.environ.setdefault(attempts, "1")
    try:
        ray.init(address=f"{host}:{port}", log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError, ray.exceptions.RayError) as exc:
        raise join_error(address, exc) from None
    finally:
        if preset is None:
            os.environ.pop(attempts, None)
