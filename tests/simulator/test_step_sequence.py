"""The simulator makes the real scheduler's decisions: same step sequences as driving it directly."""

from __future__ import annotations

import pytest

from segserve.core.request import Request
from segserve.core.scheduler import Scheduler
from segserve.sampling_params import SamplingParams
from segserve.simulator.cluster import simulate
from segserve.simulator.replica import Replica, fake_runner_output
from segserve.simulator.workload import TraceRequest, prompt_token_ids
from tests.simulator.helpers import ONE_SECOND_STEPS, config


def _direct(cfg, reqs: list[TraceRequest]) -> list[dict[str, int]]:
    """Drive the scheduler by hand, adding each request before the first step that starts at or after
    its arrival (steps take 1 s, the first starts at 0)."""
    sched = Scheduler(cfg, cfg.cache.num_kv_blocks)
    pending = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival)
    seq, t = [], 0.0
    while pending or sched.has_unfinished_requests():
        if not sched.has_unfinished_requests() and reqs[pending[0]].arrival > t:
            t = reqs[pending[0]].arrival
        while pending and reqs[pending[0]].arrival <= t:
            i = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=reqs[i].output_len, ignore_eos=True)
            sched.add_request(Request(f"r{i}", prompt_token_ids(reqs[i], i), params, eos_token_id=None))
        out = sched.schedule()
        sched.update_from_output(out, fake_runner_output(sched, out))
        sched.check_integrity()
        seq.append(dict(out.num_scheduled_tokens))
        t += 1.0
    return seq


def _simulated(cfg, reqs: list[TraceRequest]) -> list[dict[str, int]]:
    replica = Replica(cfg, cfg.cache.num_kv_blocks, ONE_SECOND_STEPS, check=True)
    replica.keep_outputs = True
    pending = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival)
    while pending or replica.busy:
        while pending and (reqs[pending[0]].arrival <= replica.clock or not replica.busy):
            i = pending.pop(0)
            replica.add(reqs[i], i, reqs[i].arrival)
        replica.step()
    return [dict(o.num_scheduled_tokens) for o in replica.outputs_log]


def test_hand_computed_chunked_prefill_sequence():
    # Budget 8: A's 10-token prompt takes 8 then 2 tokens; B (5 tokens) fills the second step.
    reqs = [TraceRequest(0.0, 10, 3), TraceRequest(0.0, 5, 2)]
    res = simulate(reqs, config(budget=8), 64, ONE_SECOND_STEPS, check=True)
    a, b = res.requests
    assert [s.num_tokens for s in res.steps] == [8, 7, 2, 1]
    assert a.token_times == [2.0, 3.0, 4.0] and b.token_times == [2.0, 3.0]
    assert a.first_scheduled == 0.0 and b.first_scheduled == 1.0
    assert _simulated(config(budget=8), reqs) == [
        {"r0": 8},
        {"r0": 2, "r1": 5},
        {"r0": 1, "r1": 1},
        {"r0": 1},
    ]


CASES = {
    "chunked": (dict(budget=16), [(0, 40, 5), (0, 23, 7), (0, 9, 3)]),
    "staggered_arrivals": (dict(budget=12), [(0, 30, 4), (2.5, 17, 6), (3.0, 5, 2), (20.0, 8, 3)]),
    "prefill_first": (dict(budget=16, policy="prefill_first"), [(0, 20, 6), (1.5, 30, 3), (2.0, 7, 5)]),
    "long_prefill_cap": (dict(budget=32, long_prefill_token_threshold=8), [(0, 50, 3), (0, 12, 4)]),
    # 12 usable blocks of 4 tokens: three growing requests cannot all fit, so the newest is preempted.
    "preemption": (dict(budget=32, num_blocks=13), [(0, 14, 12), (0, 14, 12), (0, 14, 12)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_decisions_as_driving_the_scheduler(name):
    kwargs, rows = CASES[name]
    reqs = [TraceRequest(float(t), n_in, n_out) for t, n_in, n_out in rows]
    assert _simulated(config(**kwargs), reqs) == _direct(config(**kwargs), reqs)


def test_preemption_is_recorded():
    reqs = [TraceRequest(0.0, 14, 12) for _ in range(3)]
    res = simulate(reqs, config(budget=32, num_blocks=13), 13, ONE_SECOND_STEPS, check=True)
    assert sum(r.num_preemptions for r in res.requests) >= 1
    assert sum(s.num_preempted for s in res.steps) == sum(r.num_preemptions for r in res.requests)
    assert all(len(r.token_times) == 12 for r in res.requests)


def test_shared_prefix_hits_the_cache():
    # Two requests with the same first hash block: the second, arriving after the first's prefill,
    # gets that whole 512-token block from the prefix cache.
    reqs = [TraceRequest(0.0, 600, 2, (5, 6)), TraceRequest(50.0, 700, 2, (5, 9))]
    res = simulate(
        reqs,
        config(budget=256, block_size=16, num_blocks=200, max_model_len=2048),
        200,
        ONE_SECOND_STEPS,
        check=True,
    )
    assert [r.num_cached_tokens for r in res.requests] == [0, 512]
    assert res.prefix_hit_rate == pytest.approx(512 / 1300)


def test_idle_gap_jumps_the_clock():
    reqs = [TraceRequest(0.0, 4, 1), TraceRequest(100.0, 4, 2)]
    res = simulate(reqs, config(), 64, ONE_SECOND_STEPS)
    assert res.requests[1].token_times == [101.0, 102.0]
    assert [s.start for s in res.steps] == [0.0, 100.0, 101.0]


def test_request_too_long_is_rejected_not_raised():
    reqs = [TraceRequest(0.0, 300, 2), TraceRequest(0.0, 10, 2)]
    res = simulate(reqs, config(max_model_len=256), 64, ONE_SECOND_STEPS)
    assert "max_model_len=256" in res.requests[0].error
    assert res.requests[1].finished and not res.requests[0].finished


def test_bad_replica_count():
    with pytest.raises(ValueError, match="num_replicas must be >= 1, got 0"):
        simulate([TraceRequest(0.0, 4, 1)], config(), 64, ONE_SECOND_STEPS, num_replicas=0)


def test_output_cut_by_max_model_len_counts_as_completed():
    from segserve.simulator.metrics import summarize

    res = simulate(
        [TraceRequest(0.0, 250, 20)], config(max_model_len=256, num_blocks=100), 100, ONE_SECOND_STEPS
    )
    (rec,) = res.requests
    assert len(rec.token_times) == 6 and rec.finish_reason == "length"
    assert summarize(res.requests)["completed"] == 1
