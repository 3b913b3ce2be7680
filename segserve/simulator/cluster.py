"""The event loop: requests arrive by timestamp and are routed to replicas that step on their own clocks.

One replica is the plain single-engine simulation. With several, a router picks a replica per
request: ``round_robin``; ``least_loaded`` (fewest tokens left to compute or generate); or
``prefix_affinity``: the replica that was sent the longest run of the request's leading Mooncake
hash blocks before, i.e. whose prefix cache most likely holds them (after SGLang's cache-aware
router); ties and requests matching nothing go to the least-loaded replica, and so does a request
whose best match is overloaded (its load above 1.5x the least load plus 4,096 tokens), so one hot
prefix, like a shared system prompt, cannot pin all traffic on one replica. The router remembers
what it sent, not what the replica's cache still holds (evictions are not seen).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from segserve.config import EngineConfig
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

    Raises:
        ValueError: an unknown policy name.
    """

    def __init__(self, policy: str, num_replicas: int) -> None:
        if policy not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {policy!r}")
        self.policy, self.n, self._next = policy, num_replicas, 0
        # Per replica: chained keys of the hash-id prefixes routed to it.
        self._seen: list[set[int]] = [set() for _ in range(num_replicas)]

    def pick(self, req: TraceRequest, replicas: list[Replica]) -> Replica:
        if self.policy == "round_robin":
            self._next = (self._next + 1) % self.n
            return replicas[self._next - 1]
        least = min(replicas, key=lambda r: (r.load, r.index))
        if self.policy == "least_loaded" or not req.hash_ids:
            return least
        keys = _prefix_keys(req.hash_ids)
        best, best_len = least, 0
        for r in replicas:
            n = _match_len(keys, self._seen[r.index])
            if n > best_len or (n == best_len and n > 0 and r.load < best.load):
                best, best_len = r, n
        if best.load > 1.5 * least.load + BALANCE_SLACK_TOKENS:
            best = least
        self._seen[best.index].update(keys)
        return best


BALANCE_SLACK_TOKENS = 4096


def _prefix_keys(hash_ids: tuple[int, ...]) -> list[int]:
    """One key per prefix ``hash_ids[:i + 1]``, chained so equal keys mean equal prefixes."""
    keys, h = [], 0
    for x in hash_ids:
        h = hash((h, x))
        keys.append(h)
    return keys


def _match_len(keys: list[int], seen: set[int]) -> int:
    n = 0
    for k in keys:
        if k not in seen:
            break
        n += 1
    return n


def simulate(
    requests: list[TraceRequest],
    config: EngineConfig,
    num_kv_blocks: int,
    step_model: StepTimeModel,
    num_replicas: int = 1,
    router: str = "round_robin",
    check: bool = False,
    max_steps: int | None = None,
) -> SimResult:
    """Run the workload to completion and return what happened.

    Args:
        requests: the workload, in any order (sorted by arrival here).
        config, num_kv_blocks: each replica's engine configuration and KV pool (blocks, null included).
        step_model: step durations.
        num_replicas, router: scale-out by simulation.
        check: ``check_integrity()`` after every step (tests).
        max_steps: stop after this many steps in total (None: run to completion).

    Raises:
        ValueError: num_replicas < 1 or an unknown router.
        RuntimeError: a replica with unfinished requests schedules nothing.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    replicas = [Replica(config, num_kv_blocks, step_model, i, check) for i in range(num_replicas)]
    route = Router(router, num_replicas)
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
