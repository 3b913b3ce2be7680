"""Request routers on Ray Serve's documented custom-router interface (``ray.serve.request_router``):
``choose_replicas`` returns ranks of replicas, and Serve sends the request to the first replica of
the first rank that has room (``max_ongoing_requests``), probing queue lengths as it goes.

``PrefixAffinityRouter`` runs ``segserve.routing.prefix_affinity.PrefixAffinity`` (the rule the
simulator runs) with load = requests in flight at each replica as Serve counts them (its queue-length
cache, else a probe); the routing text is the first argument of the replica call (``EngineReplica.http``).
Ray's own ``PrefixCacheAffinityRouter`` is not used: its public import path needs vLLM, and it keeps
its tree in a separate actor queried with blocking calls from the routing loop.
``RoundRobinRouter`` cycles over the replicas in id order. ``power_of_two`` is Serve's default router.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from segserve.routing.prefix_affinity import PrefixAffinity, text_keys


def _others_by_load(chosen: RunningReplica, replicas: list[RunningReplica], loads: dict) -> list:
    return sorted((r for r in replicas if r.replica_id != chosen.replica_id),
                  key=lambda r: loads.get(r.replica_id, 0))


class PrefixAffinityRouter(RequestRouter):
    """Longest remembered prompt prefix among replicas within ``imbalanced_threshold`` requests of
    the least loaded (``PrefixAffinity``); the other replicas, least loaded first, as the next rank."""

    def initialize_state(self, imbalanced_threshold: float = 16, match_rate_threshold: float = 0.1) -> None:
        self.rule = PrefixAffinity(imbalanced_threshold, match_rate_threshold)

    async def _loads(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        loads, unknown = {}, []
        for r in replicas:
            n = self._replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if n is None:
                unknown.append(r)
            else:
                loads[r.replica_id] = n
        for r, n in await self._probe_queue_lens(unknown, 0) if unknown else ():
            loads[r.replica_id] = n if n is not None else r.max_ongoing_requests
        return loads

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        text = pending_request.args[0] if pending_request is not None and pending_request.args else ""
        loads = await self._loads(candidate_replicas)
        by_id = {r.replica_id: r for r in candidate_replicas}
        order = {rid: loads.get(rid, 0) for rid in sorted(by_id, key=lambda x: x.unique_id)}
        chosen = by_id[self.rule.choose(text_keys(text) if isinstance(text, str) else [], order)]
        return [[chosen], _others_by_load(chosen, candidate_replicas, loads)]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.rule.forget(replica_id)


class RoundRobinRouter(RequestRouter):
    """Each request to the next replica in id order (the others as fallback rank, in order)."""

    def initialize_state(self) -> None:
        self._next = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        i = self._next % len(ordered)
        self._next += 1
        return [[ordered[i]], ordered[i + 1:] + ordered[:i]]
