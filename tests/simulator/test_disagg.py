"""Disaggregated prefill/decode pools: the transfer delay and the decode side's prefix hit."""

from __future__ import annotations

import pytest

from segserve.simulator.disagg import DisaggConfig, simulate_disaggregated
from segserve.simulator.workload import TraceRequest
from tests.simulator.helpers import ONE_SECOND_STEPS, config

CFG = config(budget=256, block_size=16, num_blocks=100, max_model_len=1024)


def test_one_request_timeline():
    # 100-token prompt: 6 full blocks (96 tokens) cross the link at 96 * 1000 B / 48,000 B/s = 2 s.
    disagg = DisaggConfig(1, 1, link_bandwidth=48_000, kv_bytes_per_token=1000)
    res, stats = simulate_disaggregated([TraceRequest(0.0, 100, 3)], CFG, 100, ONE_SECOND_STEPS, disagg)
    (rec,) = res.requests
    assert stats == {"mean_transfer_ms": pytest.approx(2000.0), "transfers_dropped": 0.0}
    # Prefill step [0, 1), transfer lands at 3, decode steps end at 4, 5, 6.
    assert rec.token_times == [4.0, 5.0, 6.0] and rec.arrival == 0.0
    assert rec.num_cached_tokens == 96 and rec.replica == 1
    assert [(s.replica, s.start, s.num_tokens) for s in res.steps] == [
        (0, 0.0, 100),
        (1, 3.0, 4),
        (1, 4.0, 1),
        (1, 5.0, 1),
    ]


def test_pools_overlap_prefill_and_decode():
    reqs = [TraceRequest(float(i), 200, 20) for i in range(6)]
    disagg = DisaggConfig(1, 2, link_bandwidth=1e12, kv_bytes_per_token=1000)
    res, stats = simulate_disaggregated(reqs, CFG, 100, ONE_SECOND_STEPS, disagg)
    assert all(r.finished and len(r.token_times) == 20 for r in res.requests)
    assert {r.replica for r in res.requests} == {1, 2}
    assert all(s.num_decodes == 0 for s in res.steps if s.replica == 0)
    assert stats["transfers_dropped"] == 0.0


def test_full_decode_pool_drops_the_transfer_and_recomputes():
    # The decode pool has 9 usable blocks; the first request holds 7+ of them while it decodes, so the
    # second's 6 prompt blocks cannot land: it waits and recomputes its prompt on the decode side.
    small = config(budget=256, block_size=16, num_blocks=10, max_model_len=1024)
    disagg = DisaggConfig(1, 1, link_bandwidth=1e12, kv_bytes_per_token=1000)
    reqs = [TraceRequest(0.0, 100, 40), TraceRequest(5.0, 100, 3)]
    res, stats = simulate_disaggregated(reqs, CFG, 100, ONE_SECOND_STEPS, disagg, decode_config=small)
    first, second = res.requests
    assert stats["transfers_dropped"] == 1.0
    assert (first.num_cached_tokens, second.num_cached_tokens) == (96, 0)
    assert first.finished and second.finished and second.token_times[0] > first.token_times[-1]


def test_bad_disagg_config():
    with pytest.raises(ValueError, match="each pool needs >= 1 replica, got 0 prefill, 1 decode"):
        DisaggConfig(0, 1, 1.0, 1)
    with pytest.raises(ValueError, match="link_bandwidth must be > 0 bytes/s, got 0"):
        DisaggConfig(1, 1, 0, 1)
    with pytest.raises(ValueError, match="kv_bytes_per_token must be >= 1, got 0"):
        DisaggConfig(1, 1, 1.0, 0)
