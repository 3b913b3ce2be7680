"""A snapshot of the scheduler's gauges and counters: what metrics, logs, benchmarks and the
simulator read (``Scheduler.make_stats()``)."""

from __future__ import annotations

from dataclasses import dataclass

from segserve.core.kv_cache_manager import PrefixCacheStats


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's state at one moment; totals count since the scheduler was made.

    Attributes:
        num_running: requests running now.
        num_waiting: requests waiting now (preempted ones included).
        kv_cache_usage: fraction of usable KV blocks (all but the null block) held, in [0, 1].
        num_preemptions: preemptions, total.
        num_prompt_tokens_computed: prompt tokens computed, total (prefix-cache hits excluded; a
            preempted request's recomputed prompt counts again).
        num_steps: steps scheduled, total (empty ones included).
        prefix_cache: the KV cache manager's prefix-cache lookups, total, in tokens (a copy: it does
            not move with the scheduler).
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    num_prompt_tokens_computed: int
    num_steps: int
    prefix_cache: PrefixCacheStats
