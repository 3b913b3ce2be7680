"""Scheduler decisions with exact token counts and block ids (no model; check_integrity every step)."""

from __future__ import annotations

import pytest
from core_helpers import make_request, make_scheduler, step

from segserve.core.request import RequestStatus


def test_three_800_token_prompts_under_1024_budget_get_800_224_0():
    sched = make_scheduler(num_blocks=200, block_size=16, budget=1024)
    for i, base in enumerate((0, 1000, 2000)):
        sched.add_request(make_request(f"r{i}", list(range(base, base + 800))))
    out = step(sched)
    assert out.num_scheduled_tokens == {"r0": 800, "r1": 224}
    assert "r2" not in out.num_scheduled_tokens
    assert out.total_num_scheduled_tokens == 1024 and out.total_num_scheduled_tokens_padded == 1024
    ids = {r.req_id: list(r.block_ids) for r in out.scheduled_new_reqs}
    assert ids == {"r0": list(range(1, 51)), "r1": list(range(51, 65))}
    # Step 2: r0 decodes (1 token, a new block for slot 801), r1 continues (576), r2 tops up (447).
    out = step(sched)
    assert out.num_scheduled_tokens == {"r0": 1, "r1": 576, "r2": 447}
    cached = {c.req_id: list(c.new_block_ids) for c in out.scheduled_cached_reqs}
    assert cached == {"r0": [65], "r1": list(range(66, 102))}
    assert [list(r.block_ids) for r in out.scheduled_new_reqs] == [list(range(102, 130))]
    assert out.scheduled_cached_reqs[0].new_token_ids == (7,)  # r0's first sampled token is its input


def test_decodes_are_scheduled_before_continuing_prefills():
    sched = make_scheduler(num_blocks=200, block_size=16, budget=64, long_prefill_token_threshold=0)
    sched.add_request(make_request("long", list(range(200))))
    step(sched)  # long: 64 tokens
    sched.add_request(make_request("short", list(range(500, 510))))
    out = step(sched)  # long continues with 64 (admitted first), short waits
    assert out.num_scheduled_tokens == {"long": 64}
    out = step(sched)
    assert out.num_scheduled_tokens == {"long": 64}
    out = step(sched)  # long's last 8 tokens, short's 10 prompt tokens
    assert out.num_scheduled_tokens == {"long": 8, "short": 10}
    out = step(sched)  # two decodes
    assert out.num_scheduled_tokens == {"long": 1, "short": 1}


@pytest.mark.parametrize("budget, chunks", [(256, [248, 136]), (512, [384])])
def test_a_384_token_prompt_beside_8_decodes_takes_one_step_at_512_and_two_at_256(budget, chunks):
    """What the server's automatic budget decides for a chat-sized prompt (docs/perf.md): at 256 the
    decodes' 8 tokens leave 248, so the prompt needs a second chunk step (another inter-token gap for
    every stream, and a second step before its first token)."""
    sched = make_scheduler(num_blocks=400, block_size=16, budget=budget)
    for i in range(8):
        sched.add_request(make_request(f"d{i}", list(range(100 * i, 100 * i + 20)), max_tokens=50))
    step(sched)  # the 8 short prompts in one step; they decode from now on
    sched.add_request(make_request("p", list(range(5000, 5384))))
    got = []
    for _ in chunks:
        out = step(sched)
        assert all(out.num_scheduled_tokens[f"d{i}"] == 1 for i in range(8))
        got.append(out.num_scheduled_tokens["p"])
    assert got == chunks
    assert step(sched).num_scheduled_tokens["p"] == 1  # p has its first token: now a decode


def test_with_the_attention_cost_a_long_prompts_late_chunks_shrink_beside_8_decodes():
    """Budget 512 with K = 2,200 (what the server sizes on this machine): the first chunk of a 2,048-
    token prompt beside 8 decodes is the whole 504 tokens left (cost (isqrt(2200^2 + 4 x 1,370,776)
    - 2200) // 2 = 506 allows it); later ones attend over more cached tokens and get fewer."""
    sched = make_scheduler(num_blocks=600, block_size=16, budget=512, attention_cost_tokens=2200)
    for i in range(8):
        sched.add_request(make_request(f"d{i}", list(range(100 * i, 100 * i + 20)), max_tokens=60))
    step(sched)
    sched.add_request(make_request("long", list(range(5000, 7048))))
    chunks = []
    while sum(chunks) < 2048:
        out = step(sched)
        assert all(out.num_scheduled_tokens[f"d{i}"] == 1 for i in range(8))
        chunks.append(out.num_scheduled_tokens["long"])
    # The second: prior 504, cost left 1,370,768 -> (isqrt(2704^2 + 4 x 1,370,768) - 2704) // 2 = 436.
    assert chunks == [504, 436, 388, 353, 325, 42]


def test_long_prefill_threshold_caps_one_requests_chunk():
    sched = make_scheduler(num_blocks=200, budget=256, long_prefill_token_threshold=100)
    sched.add_request(make_request("a", list(range(300))))
    sched.add_request(make_request("b", list(range(1000, 1300))))
    out = step(sched)
    assert out.num_scheduled_tokens == {"a": 100, "b": 100}


def test_prefill_first_admits_waiting_before_running_decodes():
    sched = make_scheduler(num_blocks=200, budget=32, policy="prefill_first")
    sched.add_request(make_request("a", list(range(8)), max_tokens=10))
    step(sched)
    sched.add_request(make_request("b", list(range(100, 140))))
    out = step(sched)
    assert out.num_scheduled_tokens == {"b": 32}  # the decode of "a" waits: TTFT over ITL
    sched2 = make_scheduler(num_blocks=200, budget=32)
    sched2.add_request(make_request("a", list(range(8)), max_tokens=10))
    step(sched2)
    sched2.add_request(make_request("b", list(range(100, 140))))
    assert step(sched2).num_scheduled_tokens == {"a": 1, "b": 31}


def test_max_num_seqs_caps_admission():
    sched = make_scheduler(num_blocks=200, budget=512, max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", list(range(i * 100, i * 100 + 10))))
    out = step(sched)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}


def test_padding_goes_after_the_last_request():
    sched = make_scheduler(num_blocks=200, budget=512, num_batched_tokens_buckets=(8, 64, 512))
    sched.add_request(make_request("a", list(range(30))))
    sched.add_request(make_request("b", list(range(100, 105))))
    out = step(sched)
    assert out.total_num_scheduled_tokens == 35 and out.total_num_scheduled_tokens_padded == 64
    assert out.num_scheduled_tokens_padded == {"a": 30, "b": 34}


def test_preemption_frees_newest_and_requeues_it_at_front():
    # 9 usable blocks of 16: two 60-token prompts (4 blocks each) fit, their decodes do not both fit.
    sched = make_scheduler(num_blocks=10, block_size=16, budget=256)
    sched.add_request(make_request("old", list(range(64)), max_tokens=20))
    sched.add_request(make_request("new", list(range(1000, 1064)), max_tokens=20))
    step(sched)  # 4 + 4 blocks held, 1 free
    out = step(sched)  # both decode: old takes the last free block, new must be preempted
    assert out.preempted_req_ids == {"new"}
    assert out.num_scheduled_tokens == {"old": 1}
    assert sched.waiting[0].request_id == "new"
    assert sched.requests["new"].status == RequestStatus.PREEMPTED
    assert sched.requests["new"].num_computed_tokens == 0
    assert sched.make_stats().num_preemptions == 1
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        step(sched)
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.pool.num_free_blocks == 9


def test_preempted_request_is_resent_in_full_with_its_outputs():
    sched = make_scheduler(num_blocks=10, block_size=16, budget=256, prefix_caching=False)
    sched.add_request(make_request("old", list(range(64)), max_tokens=30))
    sched.add_request(make_request("new", list(range(1000, 1064)), max_tokens=30))
    step(sched)
    step(sched)  # new preempted after generating 1 token
    resent = None
    for _ in range(60):
        out = step(sched)
        for r in out.scheduled_new_reqs:
            if r.req_id == "new":
                resent = r
        if resent:
            break
    assert resent is not None and resent.output_token_ids == (7,)
    assert resent.num_computed_tokens == 0


def test_stop_rules_eos_stop_ids_min_tokens_max_tokens():
    sched = make_scheduler(num_blocks=50)
    req = make_request("a", [1, 2, 3], max_tokens=5, stop_token_ids=[9], min_tokens=1)
    req.eos_token_id = 2
    sched.add_request(req)
    step(sched, token=2)  # EOS as the first token: min_tokens=1 keeps it running
    assert req.status == RequestStatus.RUNNING
    step(sched, token=9)
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == 9
    req2 = make_request("b", [1, 2, 3], max_tokens=2)
    sched.add_request(req2)
    step(sched, token=5)
    step(sched, token=5)
    assert req2.status == RequestStatus.FINISHED_LENGTH_CAPPED and req2.output_token_ids == [5, 5]


def test_max_model_len_ends_generation():
    sched = make_scheduler(num_blocks=50, max_model_len=10)
    req = make_request("a", list(range(8)), max_tokens=100)
    sched.add_request(req)
    for _ in range(5):
        step(sched)
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED and req.num_tokens == 10


def test_abort_mid_prefill_frees_blocks_and_registers_only_computed_blocks():
    sched = make_scheduler(num_blocks=100, block_size=16, budget=64)
    prompt = list(range(200))
    sched.add_request(make_request("a", prompt))
    step(sched)  # 64 tokens computed: 4 full blocks cached
    assert len(sched.kv_cache_manager.pool.cached) == 4
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    sched.check_integrity()
    assert sched.kv_cache_manager.pool.num_free_blocks == 99
    sched.add_request(make_request("a2", prompt))
    out = step(sched)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 64  # only written blocks hit
    assert "a" in out.finished_req_ids


def test_bad_requests_leave_state_unchanged():
    sched = make_scheduler(num_blocks=5, block_size=16, max_model_len=100)
    with pytest.raises(ValueError, match="more than max_model_len=100"):
        sched.add_request(make_request("x", list(range(101))))
    with pytest.raises(ValueError, match="needs up to 68 tokens of KV cache .* holds at most 64"):
        sched.add_request(make_request("y", list(range(65))))
    with pytest.raises(ValueError, match=r"needs up to 99 tokens of KV cache \(prompt 50 \+ max_tokens 50"):
        sched.add_request(make_request("w", list(range(50)), max_tokens=50))
    sched.add_request(make_request("fits", list(range(50)), max_tokens=15))  # 64 slots: just fits
    with pytest.raises(ValueError, match="prompt is empty"):
        make_request("z", [])
    sched.add_request(make_request("ok", list(range(10))))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("ok", list(range(10))))
    step(sched)
    assert set(sched.requests) == {"ok", "fits"}


def test_four_requests_on_a_pool_that_barely_fits_one_all_finish():
    # 8 usable blocks of 16 = 128 tokens; each request grows to 60 + 40 = 100 tokens (7 blocks).
    sched = make_scheduler(num_blocks=9, block_size=16, budget=256)
    reqs = [make_request(f"r{i}", list(range(i * 1000, i * 1000 + 60)), max_tokens=40) for i in range(4)]
    for req in reqs:
        sched.add_request(req)
    steps = 0
    while sched.has_unfinished_requests():
        step(sched)
        steps += 1
        assert steps < 1000
    # Bound: a request is preempted only by an older one that still runs, so each of the 4 can be
    # preempted at most once per older request finishing before it: at most 0+1+2+3 = 6.
    assert 1 <= sched.make_stats().num_preemptions <= 6
    assert [len(r.output_token_ids) for r in reqs] == [40, 40, 40, 40]
    assert reqs[0].num_preemptions == 0
    assert sched.kv_cache_manager.pool.num_free_blocks == 8


def test_prefix_cache_stats_count_each_admitted_request_once():
    # The second request waits two steps for room; its lookup is counted once, when admitted.
    sched = make_scheduler(num_blocks=9, block_size=16, budget=256)
    sched.add_request(make_request("a", list(range(100)), max_tokens=2))
    sched.add_request(make_request("b", list(range(64)) + [7] * 36, max_tokens=2))
    while sched.has_unfinished_requests():
        step(sched)
    stats = sched.make_stats().prefix_cache
    assert (stats.requests, stats.queries, stats.hits) == (2, 200, 64)


def test_a_prompt_waits_for_the_prefix_a_running_prompt_is_computing():
    # a and b share 64 tokens (4 blocks) and arrive together; a request's chunk is capped at 32 of the
    # 64-token budget, so b had room beside a. b waits while a computes the shared blocks, then is
    # admitted with all 4 blocks hit and computes its own 4 tokens: 72 prompt tokens computed in all,
    # where computing the prefix twice (b's chunks beside a's) took 136.
    sched = make_scheduler(num_blocks=40, block_size=16, budget=64, long_prefill_token_threshold=32)
    shared = list(range(100, 164))
    sched.add_request(make_request("a", shared + [1, 2, 3, 4], max_tokens=2))
    sched.add_request(make_request("b", shared + [5, 6, 7, 8], max_tokens=2))
    assert step(sched).num_scheduled_tokens == {"a": 32}
    assert [r.request_id for r in sched.waiting] == ["b"]
    assert step(sched).num_scheduled_tokens == {"a": 32}
    out = step(sched)  # a's last 4 tokens; the shared blocks are cached now, so b goes too
    assert out.num_scheduled_tokens == {"a": 4, "b": 4}
    assert [list(r.block_ids) for r in out.scheduled_new_reqs] == [[1, 2, 3, 4, 6]]
    assert sched.requests["b"].num_cached_tokens == 64
    assert sched.make_stats().num_prompt_tokens_computed == 72


def test_a_waiting_prompt_behind_a_shared_prefix_does_not_hold_back_others():
    # b waits for a's blocks; c (no shared prefix) is admitted past it, and b keeps its place in front.
    sched = make_scheduler(num_blocks=40, block_size=16, budget=48)
    shared = list(range(100, 164))
    sched.add_request(make_request("a", shared + [1], max_tokens=2))
    sched.add_request(make_request("b", shared + [2], max_tokens=2))
    sched.add_request(make_request("c", list(range(500, 520)), max_tokens=2))
    assert step(sched).num_scheduled_tokens == {"a": 48}
    assert step(sched).num_scheduled_tokens == {"a": 17, "c": 20}  # b: block 3 still being computed
    assert [r.request_id for r in sched.waiting] == ["b"]
    out = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "c": 1, "b": 1}
    assert sched.requests["b"].num_cached_tokens == 64


def test_an_aborted_prefix_owner_ends_the_wait():
    sched = make_scheduler(num_blocks=40, block_size=16, budget=32)
    shared = list(range(100, 164))
    sched.add_request(make_request("a", shared + [1], max_tokens=2))
    sched.add_request(make_request("b", shared + [2], max_tokens=2))
    assert step(sched).num_scheduled_tokens == {"a": 32}
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    out = step(sched)  # a's 2 computed blocks are cached; b hits them and computes the rest itself
    assert out.num_scheduled_tokens == {"b": 32}
    assert sched.requests["b"].num_cached_tokens == 32


def test_without_prefix_caching_nothing_waits_for_a_shared_prefix():
    sched = make_scheduler(num_blocks=40, block_size=16, budget=64, prefix_caching=False)
    shared = list(range(100, 164))
    sched.add_request(make_request("a", shared + [1], max_tokens=2))
    sched.add_request(make_request("b", shared + [2], max_tokens=2))
    assert step(sched).num_scheduled_tokens == {"a": 64}
    assert step(sched).num_scheduled_tokens == {"a": 1, "b": 63}


def test_the_scan_past_waiting_prompts_stops_after_max_num_seqs_of_them():
    # b, c, d wait for a's prefix; with max_num_seqs = 3 the scan stops at the third, so e (no shared
    # prefix) is not reached this step; once a's prefix is cached all of them are admitted in order.
    sched = make_scheduler(num_blocks=60, block_size=16, budget=64, long_prefill_token_threshold=32,
                           max_num_seqs=3)
    shared = list(range(100, 164))
    sched.add_request(make_request("a", shared + [1], max_tokens=2))
    for rid, tail in (("b", 2), ("c", 3), ("d", 4)):
        sched.add_request(make_request(rid, shared + [tail], max_tokens=2))
    sched.add_request(make_request("e", list(range(500, 520)), max_tokens=2))
    assert step(sched).num_scheduled_tokens == {"a": 32}
    assert [r.request_id for r in sched.waiting] == ["b", "c", "d", "e"]
    assert step(sched).num_scheduled_tokens == {"a": 32}
    out = step(sched)  # a's last token; the 4 shared blocks are cached: b and c fill max_num_seqs
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1}
    assert [r.request_id for r in sched.waiting] == ["d", "e"]


def test_prompts_behind_a_block_found_in_flight_wait_without_a_lookup_of_their_own():
    # b, c, d share a's prefix: b's lookup finds a's block 2 in flight; c and d match that block's key
    # at the same index and wait with no lookup of their own (one lookup per step for the burst).
    sched = make_scheduler(num_blocks=60, block_size=16, budget=64, long_prefill_token_threshold=32)
    shared = list(range(100, 164))
    sched.add_request(make_request("a", shared + [1], max_tokens=2))
    for rid, tail in (("b", 2), ("c", 3), ("d", 4)):
        sched.add_request(make_request(rid, shared + [tail], max_tokens=2))
    step(sched)  # a admitted (32 tokens); b, c, d wait
    looked_up = []
    lookup = sched.kv_cache_manager.get_computed_blocks
    sched.kv_cache_manager.get_computed_blocks = lambda r: looked_up.append(r.request_id) or lookup(r)
    assert step(sched).num_scheduled_tokens == {"a": 32}
    assert looked_up == ["b"]
    assert [r.request_id for r in sched.waiting] == ["b", "c", "d"]
    out = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1, "d": 1}
    assert [sched.requests[r].num_cached_tokens for r in "bcd"] == [64, 64, 64]
