"""The event loop: requests arrive by timestamp and are routed to replicas that step on their own clocks.

One replica is the plain single-engine simulation. With several, a router picks a replica per
request: ``round_robin``; ``least_loaded`` (fewest tokens left to compute or generate); or
``prefix_affinity``: the rule of ``segserve.routing.prefix_affinity`` that the Ray Serve deployment
(``segserve serve --num-replicas N --router prefix_affinity``) runs, with the same thresholds: the
replica that was sent the longest run of the request's leading Mooncake hash blocks before, among
replicas whose unfinished requests are within ``imbalanced_threshold`` of the least, if it matches at
least ``match_rate_threshold`` of the blocks; else the least-loaded replica (by unfinished requests,
the queue length Serve sees), so one hot prefix, like a shared system prompt, cannot pin all traffic
on one replica.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from segserve.config import EngineConfig
from segserve.routing.prefix_affinity import (
    DEFAULT_IMBALANCED_THRESHOLD,
    DEFAULT_MATCH_RATE_THRESHOLD,
    PrefixAffinity,
    chained_keys,
)
from segserve.simulator.replica import Replica, RequestRecord, StepRecord
from segserve.simulator.step_model import StepTimeModel
from segserve.simulator.workload import TraceRequest, prompt_token_ids

ROUTERS = ("round_robin", "least_loaded", "prefix_affinity")


@dataclass
class SimResult:
    """Everything a run recorded.

    Attributes:
        requests: one record per trace request, in trace order (rejected ones included).
        steps: every step of every replica, in the order they ran.
        config: the simulated engine configuration.
        num_kv_blocks: KV blocks per replica.
        num_replicas: replicas simulated.
        prefix_hit_rate: prompt tokens served from prefix caches / prompt tokens looked up.
    """

    requests: list[RequestRecord]
    steps: list[StepRecord]
    config: EngineConfig
    num_kv_blocks: int
    num_replicas: int
    prefix_hit_rate: float


class Router:
    """Chooses a replica per request (see the module docstring for the policies).

    Args:
        policy: one of ``ROUTERS``.
        num_replicas: replicas to choose from.
        imbalanced_threshold, match_rate_threshold: ``prefix_affinity``'s knobs (``PrefixAffinity``).

    Raises:
        ValueError: an unknown policy name or a bad threshold.
    """

    def __init__(
        self,
        policy: str,
        num_replicas: int,
        imbalanced_threshold: float = DEFAULT_IMBALANCED_THRESHOLD,
        match_rate_threshold: float = DEFAULT_MATCH_RATE_THRESHOLD,
    ) -> None:
        if policy not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {policy!r}")
        self.policy, self.n, self._next = policy, num_replicas, 0
        self.affinity = PrefixAffinity(imbalanced_threshold, match_rate_threshold)

    def pick(self, req: TraceRequest, replicas: list[Replica]) -> Replica:
        if self.policy == "round_robin":
            self._next = (self._next + 1) % self.n
            return replicas[self._next - 1]
        if self.policy == "least_loaded":
            return min(replicas, key=lambda r: (r.load, r.index))
        loads = {r.index: r.scheduler.get_num_unfinished_requests() for r in replicas}
        return replicas[self.affinity.choose(chained_keys(req.hash_ids), loads)]


def simulate(
    requests: list[TraceRequest],
    config: EngineConfig,
    num_kv_blocks: int,
    step_model: StepTimeModel,
    num_replicas: int = 1,
    router: str = "round_robin",
    check: bool = False,
    max_steps: int | None = None,
    imbalanced_threshold: float = DEFAULT_IMBALANCED_THRESHOLD,
    match_rate_threshold: float = DEFAULT_MATCH_RATE_THRESHOLD,
) -> SimResult:
    """Run the workload to completion and return what happened.

    Args:
        requests: the workload, in any order (sorted by arrival here).
        config, num_kv_blocks: each replica's engine configuration and KV pool (blocks, null included).
        step_model: step durations.
        num_replicas, router: scale-out by simulation.
        imbalanced_threshold, match_rate_threshold: the ``prefix_affinity`` router's knobs.
        check: ``check_integrity()`` after every step (tests).
        max_steps: stop after this many steps in total (None: run to completion).

    Raises:
        ValueError: num_replicas < 1 or an unknown router.
        RuntimeError: a replica with unfinished requests schedules nothing.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    replicas = [Replica(config, num_kv_blocks, step_model, i, check) for i in range(num_replicas)]
    route = Router(router, num_replicas, imbalanced_threshold, match_rate_threshold)
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    records: list[RequestRecord | None] = [None] * len(requests)
    steps: list[StepRecord] = []
    pos = 0
    while pos < len(order) or any(r.busy for r in replicas):
        if max_steps is not None and len(steps) >= max_steps:
            break
        arrival = requests[order[pos]].arrival if pos < len(order) else math.inf
        busy = [r for r in replicas if r.busy]
        nxt = min(busy, key=lambda r: (r.clock, r.index)) if busy else None
        if nxt is None or arrival <= nxt.clock:
            i = order[pos]
            req = requests[i]
            records[i] = route.pick(req, replicas).add(req, i, arrival, prompt_token_ids(req, i))
            pos += 1
        else:
            steps.append(nxt.step())
    stats = [r.scheduler.make_stats().prefix_cache for r in replicas]
    queries = sum(s.queries for s in stats)
    hit_rate = sum(s.hits for s in stats) / queries if queries else 0.0
    return SimResult(
        [r for r in records if r is not None], steps, config, num_kv_blocks, num_replicas, hit_rate
    )
