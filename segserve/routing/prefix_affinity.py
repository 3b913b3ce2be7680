"""The prefix-affinity rule: send a request to the replica that was sent the longest run of its leading
prefix blocks, among replicas that are not overloaded; otherwise to the least-loaded replica.

After SGLang's cache-aware router and Ray Serve LLM's ``PrefixCacheAffinityRouter`` (whose two knobs
keep their names here: ``imbalanced_threshold``, ``match_rate_threshold``). One rule, two users: the
Ray Serve request router (``segserve.entrypoints.ray_serve.routers``, keys from prompt text, load =
requests in flight at a replica as Serve counts them) and the simulator (``segserve.simulator.cluster``,
keys from a trace's block hash ids, load = unfinished requests at a replica), so a simulation predicts
what the deployment does.

The rule, per request with prefix keys ``k_1..k_m`` (``k_i`` names the prefix of ``i`` blocks):

1. candidates: replicas whose load is at most the least load + ``imbalanced_threshold``;
2. the candidate with the longest run ``k_1..k_n`` it was sent before wins if ``n / m`` is at least
   ``match_rate_threshold`` (ties: lower load, then fewer remembered keys, then order);
3. otherwise the least-loaded replica overall (ties: fewer remembered keys, i.e. Ray's "smallest
   tenant", then order), which spreads new prefixes over replicas;
4. the chosen replica remembers ``k_1..k_m`` (LRU, at most ``max_keys_per_replica``).

The router remembers what it sent, not what a replica's cache still holds (evictions are not seen).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence

DEFAULT_IMBALANCED_THRESHOLD = 16  # requests in flight
DEFAULT_MATCH_RATE_THRESHOLD = 0.1  # Ray Serve LLM's default
DEFAULT_MAX_KEYS_PER_REPLICA = 100_000
# Prompt text is cut into blocks of this many characters (about 16 tokens of English: one KV block at
# the default block size); only whole blocks become keys, as only whole KV blocks are cached.
TEXT_BLOCK_CHARS = 64


def chained_keys(blocks: Iterable[Hashable]) -> list[int]:
    """One key per prefix ``blocks[:i + 1]``, chained so that equal keys mean equal prefixes."""
    keys, h = [], 0
    for b in blocks:
        h = hash((h, b))
        keys.append(h)
    return keys


def text_keys(text: str, block_chars: int = TEXT_BLOCK_CHARS) -> list[int]:
    """Chained keys of the whole ``block_chars``-character blocks of ``text`` (a partial tail is dropped)."""
    n = len(text) // block_chars
    return chained_keys(text[i * block_chars:(i + 1) * block_chars] for i in range(n))


class PrefixAffinity:
    """The rule above over replicas named by any hashable id (Serve replica ids, simulator indices).

    Args:
        imbalanced_threshold: a replica whose load exceeds the least load by more than this many
            requests is not considered for a prefix match.
        match_rate_threshold: the matched fraction of a request's keys, in [0, 1], below which the
            least-loaded replica is taken instead.
        max_keys_per_replica: keys remembered per replica (least recently routed dropped first).

    Raises:
        ValueError: a negative threshold, a match rate outside [0, 1], or ``max_keys_per_replica`` < 1.
    """

    def __init__(
        self,
        imbalanced_threshold: float = DEFAULT_IMBALANCED_THRESHOLD,
        match_rate_threshold: float = DEFAULT_MATCH_RATE_THRESHOLD,
        max_keys_per_replica: int = DEFAULT_MAX_KEYS_PER_REPLICA,
    ) -> None:
        if not imbalanced_threshold >= 0:
            raise ValueError(f"imbalanced_threshold must be >= 0, got {imbalanced_threshold}")
        if not 0 <= match_rate_threshold <= 1:
            raise ValueError(f"match_rate_threshold must be in [0, 1], got {match_rate_threshold}")
        if max_keys_per_replica < 1:
            raise ValueError(f"max_keys_per_replica must be >= 1, got {max_keys_per_replica}")
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self.max_keys = max_keys_per_replica
        self._seen: dict[Hashable, OrderedDict[int, None]] = {}

    def choose(self, keys: Sequence[int], loads: Mapping[Hashable, float]) -> Hashable:
        """The replica for a request with prefix ``keys`` given each replica's load (in the mapping's
        order, which breaks the last ties); records the choice. Raises ValueError on no replicas."""
        if not loads:
            raise ValueError("no replicas to choose from")
        order = {r: i for i, r in enumerate(loads)}
        least = min(loads.values())
        chosen = None
        if keys:
            limit = least + self.imbalanced_threshold
            scored = [(-self.match_len(keys, r), loads[r], self.num_keys(r), order[r], r)
                      for r in loads if loads[r] <= limit]
            best = min(scored, key=lambda s: s[:4])
            if -best[0] > 0 and -best[0] / len(keys) >= self.match_rate_threshold:
                chosen = best[4]
        if chosen is None:
            chosen = min(loads, key=lambda r: (loads[r], self.num_keys(r), order[r]))
        self.remember(chosen, keys)
        return chosen

    def match_len(self, keys: Sequence[int], replica: Hashable) -> int:
        """How many leading ``keys`` the replica was sent before."""
        seen = self._seen.get(replica, ())
        n = 0
        for k in keys:
            if k not in seen:
                break
            n += 1
        return n

    def num_keys(self, replica: Hashable) -> int:
        return len(self._seen.get(replica, ()))

    def remember(self, replica: Hashable, keys: Sequence[int]) -> None:
        seen = self._seen.setdefault(replica, OrderedDict())
        for k in keys:
            seen[k] = None
            seen.move_to_end(k)
        while len(seen) > self.max_keys:
            seen.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """Drop a replica's memory (it died: its replacement starts with an empty cache)."""
        self._seen.pop(replica, None)


def add_affinity_args(group) -> None:
    """``--router-imbalanced-threshold`` and ``--router-match-rate-threshold`` on an argparse group
    (``segserve serve`` and ``segserve simulate`` share them, so both run the same rule)."""
    group.add_argument(
        "--router-imbalanced-threshold", type=float, default=DEFAULT_IMBALANCED_THRESHOLD,
        help="prefix_affinity: replicas with more than this many requests in flight above the least "
        "loaded one are not considered for a prefix match",
    )
    group.add_argument(
        "--router-match-rate-threshold", type=float, default=DEFAULT_MATCH_RATE_THRESHOLD,
        help="prefix_affinity: below this matched fraction of the prompt's prefix blocks, route to the "
        "least-loaded replica",
    )
