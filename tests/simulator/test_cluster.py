"""Replicas behind a router, and a 1,000-request trace end to end."""

from __future__ import annotations

import pytest

from segserve.config import CacheConfig, EngineConfig, SchedulerConfig, num_kv_blocks_for
from segserve.simulator.cluster import Router, simulate
from segserve.simulator.metrics import summarize
from segserve.simulator.step_model import DEFAULT_CPU_MODEL
from segserve.simulator.workload import TraceRequest, load_trace
from tests.simulator.helpers import ONE_SECOND_STEPS, config


def _prefix_groups() -> list[TraceRequest]:
    # Three groups of requests sharing a first 512-token block, interleaved in time.
    return [TraceRequest(float(i), 600, 2, (100 * (i % 3), 1000 + i)) for i in range(9)]


def test_round_robin_alternates():
    res = simulate(
        _prefix_groups(),
        config(budget=256, block_size=16, num_blocks=400, max_model_len=1024),
        400,
        ONE_SECOND_STEPS,
        num_replicas=2,
        router="round_robin",
    )
    assert [r.replica for r in res.requests] == [0, 1, 0, 1, 0, 1, 0, 1, 0]


def test_prefix_affinity_keeps_groups_together_and_hits_more():
    cfg = config(budget=256, block_size=16, num_blocks=400, max_model_len=1024)
    rr = simulate(_prefix_groups(), cfg, 400, ONE_SECOND_STEPS, num_replicas=2, router="round_robin")
    aff = simulate(_prefix_groups(), cfg, 400, ONE_SECOND_STEPS, num_replicas=2, router="prefix_affinity")
    groups: dict[int, set[int]] = {}
    for i, r in enumerate(aff.requests):
        groups.setdefault(i % 3, set()).add(r.replica)
    assert all(len(g) == 1 for g in groups.values())
    # Each group's first request misses; the other six requests hit one 512-token block each.
    assert aff.prefix_hit_rate == pytest.approx(6 * 512 / (9 * 600))
    assert rr.prefix_hit_rate < aff.prefix_hit_rate


def test_least_loaded_spreads_a_burst():
    reqs = [TraceRequest(0.0, 200, 50) for _ in range(6)]
    res = simulate(
        reqs,
        config(budget=256, block_size=16, num_blocks=400, max_model_len=1024),
        400,
        ONE_SECOND_STEPS,
        num_replicas=3,
        router="least_loaded",
    )
    assert sorted(r.replica for r in res.requests) == [0, 0, 1, 1, 2, 2]
    assert len({s.replica for s in res.steps}) == 3


def test_unknown_router():
    with pytest.raises(ValueError, match="router must be one of .* got 'random'"):
        Router("random", 2)


def test_thousand_request_trace():
    reqs = load_trace("/work/shared/data/traces/azure2023_conv.csv", limit=1000)
    cfg = EngineConfig(
        cache=CacheConfig(kv_cache_memory_bytes=4 * 1024**3),
        scheduler=SchedulerConfig(max_num_batched_tokens=1024, max_model_len=8192),
    )
    blocks = num_kv_blocks_for(cfg, DEFAULT_CPU_MODEL.model.kv_bytes_per_token)
    assert blocks == 4 * 1024**3 // (46080 * 16) + 1 == 5826  # what fits; 64 rows of 512 would be more
    res = simulate(reqs, cfg, blocks, DEFAULT_CPU_MODEL, num_replicas=2, router="least_loaded")
    s = summarize(res.requests)
    assert s["completed"] == 1000 and s["failed"] == 0
    assert s["total_output_tokens"] == sum(r.output_len for r in reqs)
    assert sum(s.num_tokens for s in res.steps) >= sum(r.input_len + r.output_len - 1 for r in reqs)


def test_prefix_affinity_does_not_pin_a_hot_system_prompt():
    # Every request starts with block 0 (a shared system prompt): load balance must still spread them,
    # while follow-ups of one conversation (0, 1000 + k, ...) go where their longer prefix went.
    first = [TraceRequest(0.0, 1500, 10, (0, 1000 + k, 2000 + k)) for k in range(4)]
    follow = [TraceRequest(30.0, 2000, 10, (0, 1000 + k, 2000 + k, 3000 + k)) for k in range(4)]
    cfg = config(budget=512, block_size=16, num_blocks=2000, max_model_len=8192)
    res = simulate(first + follow, cfg, 2000, ONE_SECOND_STEPS, num_replicas=2, router="prefix_affinity",
                   imbalanced_threshold=2)
    replicas = [r.replica for r in res.requests]
    # Replica 0 takes the shared block (1 of 3 blocks matched: above the 0.1 match rate) until it
    # holds 3 requests, more than 2 above replica 1's 0.
    assert replicas[:4] == [0, 0, 0, 1]
    assert replicas[4:] == replicas[:4]
    # The first prompt's 1,500 tokens are shared; whole 16-token blocks of them: 1,488.
    assert [r.num_cached_tokens for r in res.requests[4:]] == [1488] * 4
