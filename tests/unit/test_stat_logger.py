"""The periodic log line reads one scheduler snapshot (``Scheduler.make_stats()``)."""

from __future__ import annotations

from segserve.core.kv_cache_manager import PrefixCacheStats
from segserve.core.scheduler_stats import SchedulerStats
from segserve.entrypoints.openai.metrics import StatLogger


def test_log_line_from_a_snapshot():
    stats = SchedulerStats(
        num_running=3,
        num_waiting=2,
        kv_cache_usage=0.125,
        num_preemptions=1,
        num_prompt_tokens_computed=900,
        num_steps=40,
        prefix_cache=PrefixCacheStats(requests=4, queries=1000, hits=250),
    )
    assert StatLogger.line(stats, 12.34, 5.0) == (
        "Avg prompt throughput: 12.3 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 3 reqs, "
        "Waiting: 2 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 25.0%"
    )
