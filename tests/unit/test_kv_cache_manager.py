"""Block pool and KV cache manager: exact block ids, ref counts, LRU eviction, prefix hits."""

from __future__ import annotations

import subprocess
import sys

import pytest
from core_helpers import make_request

from segserve.core.block_pool import BlockPool
from segserve.core.kv_cache_manager import KVCacheManager
from segserve.core.kv_cache_utils import BlockHash, hash_block_tokens


def manager(num_blocks=11, block_size=4, caching=True) -> KVCacheManager:
    return KVCacheManager(
        num_blocks=num_blocks, block_size=block_size, max_model_len=64, enable_caching=caching
    )


def run_prefill(kvm: KVCacheManager, req) -> list[int]:
    """Admit ``req`` with its prefix hit, compute its whole prompt, cache its full blocks."""
    hit, num_hit = kvm.get_computed_blocks(req)
    assert kvm.allocate_slots(req, req.num_tokens - num_hit, num_hit, hit) is not None
    kvm.record_lookup(req, num_hit)
    req.num_computed_tokens = req.num_tokens
    kvm.cache_blocks(req, req.num_computed_tokens)
    kvm.check_integrity()
    return kvm.get_block_ids(req.request_id)


def test_null_block_is_never_handed_out():
    pool = BlockPool(4, enable_caching=True)
    assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 3]
    assert pool.get_new_blocks(1) is None
    pool.check_integrity()


def test_free_queue_removes_from_the_middle_in_order():
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(5)
    pool.free_blocks(blocks)  # 1..5 in order
    pool.touch([pool.blocks[3]])
    assert pool.free_queue.block_ids() == [1, 2, 4, 5]
    pool.free_blocks([pool.blocks[3]])
    assert pool.free_queue.block_ids() == [1, 2, 4, 5, 3]
    pool.check_integrity()


def test_shared_prefix_hits_whole_blocks_and_counts_refs():
    kvm = manager()
    a = make_request("a", list(range(10)))  # blocks [0..3] [4..7] + partial [8, 9]
    assert run_prefill(kvm, a) == [1, 2, 3]
    b = make_request("b", list(range(8)) + [50, 51, 52])
    hit, num_hit = kvm.get_computed_blocks(b)
    assert hit.get_block_ids() == [1, 2] and num_hit == 8
    assert kvm.allocate_slots(b, 3, num_hit, hit).get_block_ids() == [4]
    kvm.record_lookup(b, num_hit)
    assert [kvm.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert kvm.stats.queries == 21 and kvm.stats.hits == 8 and kvm.stats.requests == 2
    kvm.check_integrity()


def test_hit_is_capped_so_the_last_token_is_recomputed():
    kvm = manager()
    run_prefill(kvm, make_request("a", list(range(8))))
    hit, num_hit = kvm.get_computed_blocks(make_request("b", list(range(8))))
    assert hit.get_block_ids() == [1] and num_hit == 4  # not 8: the 8th token's logits are needed


def test_freed_blocks_keep_their_hash_and_are_evicted_tail_first_lru():
    kvm = manager(num_blocks=7)
    a = make_request("a", list(range(8)))
    b = make_request("b", list(range(100, 108)))
    assert run_prefill(kvm, a) == [1, 2]
    assert run_prefill(kvm, b) == [3, 4]
    kvm.free(a)
    kvm.free(b)
    # free queue: never-used 5, 6; then a's blocks tail first (2, 1), then b's (4, 3)
    assert kvm.pool.free_queue.block_ids() == [5, 6, 2, 1, 4, 3]
    assert len(kvm.pool.cached) == 4
    # A 12-token request takes 3 blocks from the head: 5, 6 and a's tail block 2 (evicted).
    c = make_request("c", list(range(200, 212)))
    assert run_prefill(kvm, c) == [5, 6, 2]
    assert kvm.pool.blocks[1].block_hash is not None and len(kvm.pool.cached) == 3 + 3
    # a's first block (1) still hits; its second was evicted.
    hit, num_hit = kvm.get_computed_blocks(make_request("a2", list(range(8)) + [1]))
    assert hit.get_block_ids() == [1] and num_hit == 4
    kvm.check_integrity()


def test_allocate_returns_none_without_side_effects():
    kvm = manager(num_blocks=5)
    a = make_request("a", list(range(8)))
    run_prefill(kvm, a)
    kvm.free(a)
    before = (kvm.pool.free_queue.block_ids(), [b.ref_cnt for b in kvm.pool.blocks], dict(kvm.req_to_blocks))
    b = make_request("b", list(range(8)) + list(range(50, 60)))  # hits 2 blocks, needs 3 more: 5 > 4 free
    hit, num_hit = kvm.get_computed_blocks(b)
    assert num_hit == 8
    assert kvm.allocate_slots(b, 10, num_hit, hit) is None
    after = (kvm.pool.free_queue.block_ids(), [b.ref_cnt for b in kvm.pool.blocks], dict(kvm.req_to_blocks))
    assert after == before
    kvm.check_integrity()


def test_cache_salt_and_different_parents_never_share_blocks():
    kvm = manager()
    run_prefill(kvm, make_request("a", list(range(9))))
    salted = make_request("s", list(range(9)))
    salted.cache_salt = "tenant-2"
    assert kvm.get_computed_blocks(salted)[1] == 0
    # Same second-block tokens after a different first block: no hit on block 2.
    other = make_request("o", [99, 1, 2, 3, 4, 5, 6, 7, 8])
    assert kvm.get_computed_blocks(other)[1] == 0
    p1 = hash_block_tokens(None, (0, 1, 2, 3))
    p2 = hash_block_tokens(None, (9, 1, 2, 3))
    assert hash_block_tokens(p1, (4, 5, 6, 7)) != hash_block_tokens(p2, (4, 5, 6, 7))


def test_python_hash_collisions_never_produce_a_wrong_hit(monkeypatch):
    monkeypatch.setattr(BlockHash, "__hash__", lambda self: 0)  # every key collides in the dict
    kvm = manager()
    run_prefill(kvm, make_request("a", list(range(9))))
    run_prefill(kvm, make_request("b", list(range(100, 109))))
    hit, num_hit = kvm.get_computed_blocks(make_request("c", list(range(100, 104)) + [0, 1, 2, 3, 4]))
    assert hit.get_block_ids() == [4] and num_hit == 4  # b's first block only, never a's
    kvm.check_integrity()


def test_prefix_caching_off_never_hits():
    kvm = manager(caching=False)
    run_prefill(kvm, make_request("a", list(range(9))))
    assert kvm.get_computed_blocks(make_request("b", list(range(9))))[1] == 0
    assert kvm.pool.cached == {}


def test_allocate_rejects_bad_counts():
    kvm = manager()
    with pytest.raises(ValueError, match="num_new_tokens must be >= 1, got 0"):
        kvm.allocate_slots(make_request("a", [1]), 0)
    with pytest.raises(ValueError, match="65 tokens exceed max_model_len=64"):
        kvm.allocate_slots(make_request("a", [1]), 65)
    kvm.check_integrity()


def test_core_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import segserve.core.scheduler, segserve.core.kv_cache_manager, segserve.core.block_pool\n"
        "import segserve.config, segserve.sampling_params\n"
        "from segserve import SamplingParams\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "ok", result.stderr
