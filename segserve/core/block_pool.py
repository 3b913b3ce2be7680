"""The pool of KV cache blocks: ref counts, an O(1) LRU free queue and the prefix-cache hash table.

Design after vLLM v1's ``BlockPool``/``FreeKVCacheBlockQueue``: a block whose ref count drops to 0 goes
to the tail of the free queue but keeps its hash, so a later request can still hit it; a block is
evicted (its hash dropped) only when it is popped from the head to serve a new allocation.
"""

from __future__ import annotations

from collections.abc import Iterable

from segserve.core.kv_cache_utils import BlockHash

NULL_BLOCK_ID = 0


class KVCacheBlock:
    """One block of ``block_size`` token slots.

    Attributes:
        block_id: index into the per-layer KV cache tensors.
        ref_cnt: requests currently holding the block.
        block_hash: key of the full block's content (set once when cached, cleared on eviction).
        prev_free, next_free: links of the free queue (None when not in it).
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks: pop from the head (least recently freed), append at the tail,
    remove from the middle in O(1) when a prefix hit revives a free block.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block. Raises ValueError when empty."""
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` in O(1). Raises ValueError when it is not in the queue."""
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Free block ids from head (evicted first) to tail."""
        ids, node = [], self._head.next_free
        while node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids

    def contains(self, block: KVCacheBlock) -> bool:
        return block.prev_free is not None


class BlockPool:
    """All blocks of the KV cache; block 0 is the null block and is never handed out.

    Args:
        num_blocks: blocks including the null block (>= 2).
        enable_caching: keep a hash -> blocks table for prefix hits.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.is_null = True
        self.free_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        # key -> {block_id: block}; several blocks may hold the same content when two requests
        # computed it in the same step before either was cached.
        self.cached: dict[BlockHash, dict[int, KVCacheBlock]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks (all but the null block) held by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, key: BlockHash) -> KVCacheBlock | None:
        """A block holding exactly this content and prefix, or None."""
        entry = self.cached.get(key)
        return next(iter(entry.values())) if entry else None

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock] | None:
        """Pop ``num_blocks`` from the free queue head (evicting their hashes), ref count 1 each.

        Returns None, with nothing changed, when fewer are free.
        """
        if num_blocks > self.num_free_blocks:
            return None
        new = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            new.append(block)
        return new

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on prefix-hit blocks, reviving them from the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; blocks reaching 0 join the free queue tail in the given order
        (callers pass a request's blocks tail first, so its last blocks are evicted first).
        """
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, key: BlockHash) -> None:
        """Record that ``block`` holds the full-block content ``key``. A block's hash is set once."""
        if block.block_hash is not None:
            if block.block_hash != key:
                raise ValueError(f"block {block.block_id} is already cached under another hash")
            return
        block.block_hash = key
        self.cached.setdefault(key, {})[block.block_id] = block

    def _evict(self, block: KVCacheBlock) -> None:
        key = block.block_hash
        if key is None:
            return
        entry = self.cached[key]
        del entry[block.block_id]
        if not entry:
            del self.cached[key]
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash. Returns False (and changes nothing) while any block is held."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True

    def check_integrity(self) -> None:
        """Assert the pool's invariants (raises AssertionError naming the broken one)."""
        null = self.null_block
        assert null.ref_cnt == 0 and null.block_hash is None, "null block was used"
        assert not self.free_queue.contains(null), "null block is in the free queue"
        free_ids = self.free_queue.block_ids()
        assert len(free_ids) == self.num_free_blocks == len(set(free_ids)), "free queue count is off"
        for block in self.blocks[1:]:
            in_queue = self.free_queue.contains(block)
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            assert in_queue == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref_cnt={block.ref_cnt} but in free queue={in_queue}"
            )
            if block.block_hash is not None:
                entry = self.cached.get(block.block_hash, {})
                assert entry.get(block.block_id) is block, f"block {block.block_id} hash not in table"
        for key, entry in self.cached.items():
            assert entry, "empty hash entry"
            for block_id, block in entry.items():
                assert block.block_id == block_id and block.block_hash == key, (
                    f"stale hash entry for block {block_id}"
                )
