"""Attention-cost-weighted budget (``attention_cost_tokens``): exact chunk splits, decodes never
refused for cost, progress when one token costs more than the budget, refunds on preemption."""

from __future__ import annotations

import pytest
from core_helpers import make_request, make_scheduler, step

from segserve.config import SchedulerConfig


def _scaled_cost(n: int, prior: int, k: int) -> int:
    """K x cost of an n-token chunk after ``prior`` tokens: n * K + n * (prior + n)."""
    return n * k + n * (prior + n)


def test_config_cost_budget_is_the_cost_of_a_full_first_chunk():
    config = SchedulerConfig(max_num_batched_tokens=512, attention_cost_tokens=1024)
    assert config.max_num_batched_cost == 768.0
    assert SchedulerConfig(max_num_batched_tokens=512).max_num_batched_cost is None


def test_negative_attention_cost_tokens_is_rejected_with_its_value():
    with pytest.raises(ValueError, match=r"attention_cost_tokens must be >= 0 .* got -1"):
        SchedulerConfig(attention_cost_tokens=-1)


def test_chunks_of_a_long_prompt_shrink_as_the_cache_grows():
    sched = make_scheduler(num_blocks=400, budget=512, attention_cost_tokens=1024)
    sched.add_request(make_request("a", list(range(2048))))
    chunks = [step(sched).num_scheduled_tokens["a"] for _ in range(6)]
    assert chunks == [512, 405, 344, 303, 274, 210]
    # Each chunk is the largest that fits 768 token-equivalents (x K = 786,432): 405 fits, 406 not.
    budget = 512 * 1024 + 512 * 512
    assert _scaled_cost(405, 512, 1024) <= budget < _scaled_cost(406, 512, 1024)
    assert _scaled_cost(344, 917, 1024) <= budget < _scaled_cost(345, 917, 1024)


def test_token_budget_alone_gives_equal_chunks():
    sched = make_scheduler(num_blocks=400, budget=512)
    sched.add_request(make_request("a", list(range(2048))))
    assert [step(sched).num_scheduled_tokens["a"] for _ in range(4)] == [512, 512, 512, 512]


def test_decodes_are_charged_and_the_chunk_gets_what_is_left():
    sched = make_scheduler(num_blocks=400, budget=64, attention_cost_tokens=256)
    for i in range(2):
        sched.add_request(make_request(f"d{i}", list(range(i * 1000, i * 1000 + 200)), max_tokens=50))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running) or sched.waiting:
        step(sched)
    sched.add_request(make_request("p", list(range(5000, 5300))))
    splits = [step(sched).num_scheduled_tokens for _ in range(3)]
    assert splits == [{"d0": 1, "d1": 1, "p": 61}, {"d0": 1, "d1": 1, "p": 52}, {"d0": 1, "d1": 1, "p": 47}]


def test_decode_cost_can_hold_back_a_prefill():
    # B = 8 tokens, K = 4: 24 token-equivalents per step; a decode at p cached tokens costs 1 + (p + 1) / 4.
    sched = make_scheduler(num_blocks=400, budget=8, attention_cost_tokens=4, block_size=4)
    for i in range(6):
        sched.add_request(make_request(f"d{i}", list(range(i * 1000, i * 1000 + 8)), max_tokens=100))
    firsts = [step(sched).num_scheduled_tokens for _ in range(3)]
    assert firsts == [{"d0": 8}, {"d0": 1, "d1": 7}, {"d0": 1, "d1": 1, "d2": 6}]
    for _ in range(6):
        step(sched)
    decoding = [r for r in sched.running if r.num_computed_tokens >= r.num_prompt_tokens]
    assert [r.request_id for r in decoding] == ["d0", "d1", "d2", "d3", "d4"]
    assert sum(1 + (r.num_computed_tokens + 1) / 4 for r in decoding) == 22.25
    out = step(sched)
    # The decodes leave 1.75 of 24; one more token of d5 (4 cached) costs 1 + 5 / 4 = 2.25, so d5,
    # mid-prefill, waits although 3 tokens are left.
    assert out.num_scheduled_tokens == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "d4": 1}
    assert sched.requests["d5"].num_computed_tokens == 4


def test_a_decode_over_the_whole_cost_budget_still_runs():
    # B = 2, K = 1: 6 token-equivalents; a decode after 40 tokens costs 1 + 41 = 42.
    sched = make_scheduler(num_blocks=40, block_size=4, budget=2, attention_cost_tokens=1)
    sched.add_request(make_request("a", list(range(40)), max_tokens=3))
    chunks = []
    while sched.has_unfinished_requests():
        chunks.append(step(sched).num_scheduled_tokens["a"])
    # A first chunk of 2, then 1 token per step (the empty-step floor), then the two decodes.
    assert chunks == [2] + [1] * 38 + [1, 1]
    assert sched.requests == {}


def test_an_empty_step_always_computes_one_token():
    # B = 4, K = 1: 20 token-equivalents; past ~20 cached tokens one token costs more than that.
    sched = make_scheduler(num_blocks=40, block_size=4, budget=4, attention_cost_tokens=1)
    sched.add_request(make_request("a", list(range(30)), max_tokens=1))
    chunks = []
    while sched.has_unfinished_requests():
        chunks.append(step(sched).num_scheduled_tokens["a"])
    assert chunks[:5] == [4, 2, 2, 1, 1]
    assert _scaled_cost(1, 29, 1) > 4 * 1 + 4 * 4  # the last token alone is over budget, yet it ran
    assert sum(chunks) == 30 and len(chunks) == 25


def test_preemption_refunds_the_victims_cost():
    # 7 usable blocks of 4 tokens; "a" (12 tokens) and "b" (12 tokens) both decode until "a" needs
    # a block: "b" is preempted (after being scheduled) and its token and cost come back.
    sched = make_scheduler(num_blocks=8, block_size=4, budget=32, attention_cost_tokens=64)
    sched.add_request(make_request("a", list(range(12)), max_tokens=16))
    sched.add_request(make_request("b", list(range(100, 112)), max_tokens=16))
    outs = [step(sched) for _ in range(8)]
    preempted = [o for o in outs if o.preempted_req_ids]
    assert preempted and preempted[0].preempted_req_ids == {"b"}
    assert preempted[0].num_scheduled_tokens == {"a": 1}


def test_a_resumed_request_recomputing_its_outputs_is_charged_as_a_prefill():
    # B = 8, K = 1: 72 token-equivalents (x K) per step. "new" (16-token prompt, blocks of 8) is
    # preempted after 9 tokens; when it comes back its first prompt block is a prefix hit and it
    # recomputes 8 prompt and 9 output tokens alone in its steps. Once past its prompt it still
    # computes several tokens a step: cost-capped like any chunk, not waved through as a decode.
    sched = make_scheduler(num_blocks=8, block_size=8, budget=8, attention_cost_tokens=1)
    sched.add_request(make_request("old", list(range(16)), max_tokens=30))
    sched.add_request(make_request("new", list(range(100, 116)), max_tokens=12))
    resumed = None
    while resumed is None:
        out = step(sched)
        resumed = next((r for r in out.scheduled_new_reqs if r.output_token_ids), None)
    assert (resumed.req_id, resumed.num_computed_tokens, len(resumed.output_token_ids)) == ("new", 8, 9)
    chunks, priors = [out.num_scheduled_tokens["new"]], [8]
    while sched.requests["new"].num_computed_tokens < 25:
        priors.append(sched.requests["new"].num_computed_tokens)
        chunks.append(step(sched).num_scheduled_tokens["new"])
    # Before the fix the chunk after 17 tokens got all 8 tokens left in the budget (cost 8 + 8 * 25
    # = 208 of 72): [5, 4, 8].
    assert chunks == [5, 4, 3, 3, 2]
    assert priors == [8, 13, 17, 20, 23]
    assert all(_scaled_cost(n, p, 1) <= 8 * 1 + 8 * 8 for n, p in zip(chunks, priors, strict=True))
    assert [step(sched).num_scheduled_tokens["new"] for _ in range(2)] == [1, 1]  # decodes again
