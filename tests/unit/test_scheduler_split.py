"""The scheduler's vLLM v1 split (build the output, then ``_update_after_schedule``), the priors the
output carries, the one definition of a decode, and ``make_stats()``."""

from __future__ import annotations

import pytest
from core_helpers import make_request, make_scheduler, step

from segserve.core.request import is_decode
from segserve.core.scheduler_stats import SchedulerStats


@pytest.mark.parametrize(
    "computed, prompt, tokens, expected",
    [
        (0, 8, 8, False),  # a fresh prompt
        (7, 8, 8, False),  # its last prompt token: still prompt work
        (8, 8, 9, True),  # one generated token to compute: a decode
        (8, 8, 13, False),  # resumed after preemption, recomputing 5 outputs past its prompt
        (12, 8, 13, True),  # ... down to its last token
    ],
)
def test_a_decode_is_one_token_left_past_the_prompt(computed, prompt, tokens, expected):
    assert is_decode(computed, prompt, tokens) is expected


def test_the_output_carries_each_requests_prior_and_the_requests_advance_by_their_tokens():
    sched = make_scheduler(num_blocks=100, block_size=4, budget=64)
    sched.add_request(make_request("a", list(range(10)), max_tokens=2))
    assert step(sched).num_prior_tokens() == {"a": 0}
    step(sched)  # a's last token
    # b shares a's first 8 tokens (2 full blocks): sent in full with 8 computed, then c from 0.
    sched.add_request(make_request("b", list(range(10)) + [50, 51], max_tokens=2))
    sched.add_request(make_request("c", list(range(200, 203)), max_tokens=5))
    out = sched.schedule()
    assert [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs] == [("b", 8), ("c", 0)]
    assert out.num_prior_tokens() == {"b": 8, "c": 0}
    assert out.num_scheduled_tokens == {"b": 4, "c": 3}
    assert {r.request_id: r.num_computed_tokens for r in sched.running} == {"b": 12, "c": 3}
    sched.check_integrity(out)


def test_building_the_output_changes_no_request_state(monkeypatch):
    sched = make_scheduler(num_blocks=100, block_size=4, budget=8)
    sched.add_request(make_request("a", list(range(10)), max_tokens=3))
    step(sched)  # a: 8 of 10 prompt tokens
    step(sched)  # a: the last 2, samples; its token is pending for the runner
    a = sched.requests["a"]
    pending = {rid: list(t) for rid, t in sched._pending_tokens.items()}
    monkeypatch.setattr(sched, "_update_after_schedule", lambda out: None)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.scheduled_cached_reqs[0].new_token_ids == (7,)
    assert a.num_computed_tokens == 10 and sched._pending_tokens == pending == {"a": [7]}
    with pytest.raises(AssertionError, match=r"a: 10 computed tokens, but the step scheduled 1 after 10"):
        sched.check_integrity(out)
    monkeypatch.undo()
    sched._update_after_schedule(out)
    assert a.num_computed_tokens == 11 and sched._pending_tokens == {}
    sched.check_integrity(out)


def test_check_integrity_catches_runner_bookkeeping_out_of_sync():
    sched = make_scheduler(num_blocks=100, block_size=4, budget=8)
    sched.add_request(make_request("a", list(range(6)), max_tokens=3))
    sched.add_request(make_request("b", list(range(100, 110)), max_tokens=3))
    step(sched)  # a: 6 tokens (samples), b: 2 of 10; both are held by the runner now
    sched.check_integrity()
    sched._in_runner.add("ghost")
    with pytest.raises(AssertionError, match="runner holds non-running"):
        sched.check_integrity()
    sched._in_runner.discard("ghost")
    sched._finished_since_last_step.add("a")
    with pytest.raises(AssertionError, match="both held by the runner and finished"):
        sched.check_integrity()


def test_decodes_go_first_and_a_last_prompt_token_is_prompt_work():
    # Deliberate change: a running request with one *prompt* token left used to be ordered with the
    # decodes (it wanted one token); it is prompt work, so it now follows them.
    sched = make_scheduler(num_blocks=100, block_size=4, budget=24, long_prefill_token_threshold=16)
    sched.add_request(make_request("a", list(range(17)), max_tokens=3))
    sched.add_request(make_request("b", list(range(100, 108)), max_tokens=3))
    assert list(step(sched).num_scheduled_tokens.items()) == [("a", 16), ("b", 8)]
    out = step(sched)
    assert list(out.num_scheduled_tokens.items()) == [("b", 1), ("a", 1)]
    assert [(c.req_id, c.new_block_ids) for c in out.scheduled_cached_reqs] == [("b", (7,)), ("a", (8,))]
    assert list(step(sched).num_scheduled_tokens.items()) == [("a", 1), ("b", 1)]  # both decode


def test_make_stats_is_one_snapshot_of_queues_usage_and_counters():
    sched = make_scheduler(num_blocks=101, block_size=4, budget=64)
    sched.add_request(make_request("a", list(range(10)), max_tokens=2))
    step(sched)
    step(sched)
    sched.add_request(make_request("b", list(range(10)) + [50, 51], max_tokens=2))
    sched.add_request(make_request("c", list(range(200, 203)), max_tokens=5))
    sched.schedule()
    stats = sched.make_stats()
    assert isinstance(stats, SchedulerStats)
    assert (stats.num_running, stats.num_waiting, stats.num_preemptions, stats.num_steps) == (2, 0, 0, 3)
    assert stats.num_prompt_tokens_computed == 10 + 4 + 3  # b's 8 hit tokens are not computed
    assert stats.kv_cache_usage == pytest.approx(4 / 100)  # b's 3 blocks and c's 1 of 100 usable
    assert (stats.prefix_cache.requests, stats.prefix_cache.queries, stats.prefix_cache.hits) == (3, 25, 8)
    sched.add_request(make_request("d", list(range(10)), max_tokens=2))
    sched.schedule()
    assert stats.prefix_cache.requests == 3 and stats.num_steps == 3  # a snapshot: it did not move
    assert sched.make_stats().prefix_cache.requests == 4
