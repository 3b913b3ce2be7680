"""The scale-out flags of ``segserve serve`` and their start-up checks (no Ray imported here).

One replica (``--num-replicas 1``, the default) with no ``--ray-address`` is the plain in-process
server and needs no Ray; anything else goes through Ray Serve (``launch.run_cluster``).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from segserve.routing.prefix_affinity import PrefixAffinity, add_affinity_args

ROUTERS = ("prefix_affinity", "power_of_two", "round_robin")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--num-replicas``, ``--replica-cpus``, ``--router`` (+ its thresholds) and ``--ray-address``."""
    g = parser.add_argument_group("scale-out (Ray Serve; needs pip install 'segserve[ray]')")
    g.add_argument("--num-replicas", type=int, default=1,
                   help="engine replicas; above 1 they run as Ray Serve deployments behind this endpoint")
    g.add_argument("--replica-cpus", type=int, default=None,
                   help="CPUs per replica (Ray reserves them; torch/OpenMP threads = this); default: "
                   "the machine's CPUs divided by --num-replicas")
    g.add_argument("--router", default="prefix_affinity", choices=ROUTERS,
                   help="how requests are spread over replicas")
    add_affinity_args(g)
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (host:port of its GCS) instead of starting a local one")


def wants_ray(args: argparse.Namespace) -> bool:
    """True when the flags ask for Ray Serve (more than one replica, or a cluster to join)."""
    return args.num_replicas != 1 or args.ray_address is not None


def machine_cpus() -> int:
    """CPUs this process may run on (the affinity mask, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class ScaleOut:
    """Checked scale-out settings.

    Attributes:
        num_replicas: engine replicas (>= 1).
        replica_cpus: CPUs reserved per replica and its torch/OpenMP thread count (>= 1).
        router: one of ``ROUTERS``.
        imbalanced_threshold, match_rate_threshold: ``prefix_affinity``'s knobs.
        ray_address: a cluster to join, or None to start a local one.
        available_cpus: CPUs of this machine; a local cluster must fit the replicas in them.

    Raises:
        ValueError: naming the flag: fewer than one replica or CPU, more CPUs than a local cluster
            has, or a bad threshold.
    """

    num_replicas: int
    replica_cpus: int
    router: str
    imbalanced_threshold: float
    match_rate_threshold: float
    ray_address: str | None
    available_cpus: int

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"--num-replicas must be >= 1, got {self.num_replicas}")
        if self.replica_cpus < 1:
            raise ValueError(f"--replica-cpus must be >= 1, got {self.replica_cpus}")
        need = self.num_replicas * self.replica_cpus
        if self.ray_address is None and need > self.available_cpus:
            raise ValueError(
                f"--replica-cpus {self.replica_cpus} x --num-replicas {self.num_replicas} = {need} CPUs, "
                f"more than this machine's {self.available_cpus}"
            )
        if self.router not in ROUTERS:
            raise ValueError(f"--router must be one of {ROUTERS}, got {self.router!r}")
        try:
            PrefixAffinity(self.imbalanced_threshold, self.match_rate_threshold)
        except ValueError as exc:
            raise ValueError(f"--router-{str(exc).replace('_', '-')}") from None

    def check_reachable(self, timeout_s: float = 5.0) -> None:
        """ValueError naming ``--ray-address`` when it is malformed, nothing listens there or what listens
        speaks no gRPC (before any model work; ``join.join`` checks the rest when it joins)."""
        from segserve.entrypoints.ray_serve.join import check_grpc, check_listening

        if self.ray_address is not None:
            check_grpc(self.ray_address, *check_listening(self.ray_address, timeout_s))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ScaleOut:
        cpus = machine_cpus()
        per = args.replica_cpus
        if per is None:
            per = max(1, cpus // max(args.num_replicas, 1))
        return cls(args.num_replicas, per, args.router, args.router_imbalanced_threshold,
                   args.router_match_rate_threshold, args.ray_address, cpus)
