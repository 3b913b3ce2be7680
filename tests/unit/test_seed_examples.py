"""The worked examples of seed 000 ("Prefill Processing"), as exact tests, block_size=128."""

from __future__ import annotations

from core_helpers import make_request, make_scheduler, step

from segserve.config import EngineConfig


def test_10000_token_prompt_under_2048_budget_takes_5_steps():
    # The seed's configuration: one bucket of 2048 (its "valid: buckets match" example).
    sched = make_scheduler(num_blocks=100, block_size=128, budget=2048, max_model_len=10240, segment=1024,
                           num_batched_tokens_buckets=(2048,))
    sched.add_request(make_request("req_0", list(range(10_000)), max_tokens=1))
    req = sched.requests["req_0"]
    computed, scheduled, padded, priors = [req.num_computed_tokens], [], [], []
    for _ in range(5):
        out = step(sched)
        scheduled.append(out.num_scheduled_tokens["req_0"])
        padded.append(out.num_scheduled_tokens_padded["req_0"])
        priors.append(
            ([r.num_computed_tokens for r in out.scheduled_new_reqs + out.scheduled_cached_reqs])[0]
        )
        computed.append(req.num_computed_tokens)
    assert computed == [0, 2048, 4096, 6144, 8192, 10_000]
    assert scheduled == [2048, 2048, 2048, 2048, 1808]
    assert padded == [2048, 2048, 2048, 2048, 2048]
    # cached_seq_len (prior tokens) per step, as the seed's iterations list them
    assert priors == [0, 2048, 4096, 6144, 8192]
    assert req.output_token_ids == [7] and req.is_finished
    assert not sched.has_unfinished_requests()


def test_10240_token_request_with_4096_token_cached_prefix():
    sched = make_scheduler(num_blocks=100, block_size=128, budget=2048, max_model_len=10240, segment=1024)
    prompt = list(range(10_240))
    # Warm the cache with the first 4096 tokens (32 blocks: ids 1..32), then finish and free them.
    sched.add_request(make_request("warm", prompt[:4096], max_tokens=1))
    step(sched)
    step(sched)
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.pool.free_queue.block_ids()[-32:] == list(range(32, 0, -1))

    sched.add_request(make_request("req_0", prompt, max_tokens=1))
    out = step(sched)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 4096  # prefix hit, block-aligned
    assert out.num_scheduled_tokens == {"req_0": 2048}
    assert list(new.block_ids) == list(range(1, 49))  # 32 cached blocks + 16 fresh ones
    assert sched.requests["req_0"].num_cached_tokens == 4096

    config: EngineConfig = sched.config
    from segserve.attention.metadata import build_attention_metadata

    meta = build_attention_metadata(
        [2048], [4096], [list(new.block_ids)], 128, config.max_blocks_per_seq, 1024
    )
    row = meta.block_table[0].tolist()
    assert len(row) == 80 and row[:48] == list(range(1, 49)) and row[48:] == [0] * 32
    assert meta.prior_tokens_cpu == (4096,) and meta.seq_lens.tolist() == [6144]

    held, priors = [], []
    for _ in range(2):
        out = step(sched)
        (cached,) = out.scheduled_cached_reqs
        priors.append(cached.num_computed_tokens)
        held.append(
            len(sched.kv_cache_manager.get_block_ids("req_0")) if sched.has_unfinished_requests() else 80
        )
        assert len(cached.new_block_ids) == 16
    assert priors == [6144, 8192]
    assert held == [64, 80]
    assert sched.requests.get("req_0") is None  # finished after its last chunk sampled a token


def test_blocks_are_allocated_only_for_the_delta():
    sched = make_scheduler(num_blocks=100, block_size=128, budget=2048, max_model_len=10240, segment=1024)
    sched.add_request(make_request("req_0", list(range(10_240)), max_tokens=1))
    counts = []
    for _ in range(3):
        step(sched)
        counts.append(len(sched.kv_cache_manager.get_block_ids("req_0")))
    assert counts == [16, 32, 48]
