"""Per-request block tables over the block pool, prefix-cache lookup and incremental allocation.

Interface after vLLM v1's ``KVCacheManager`` (seed 000, "Block Allocation"): ``allocate_slots``
allocates only the delta between the blocks a request needs for ``computed + new`` tokens and the
blocks it holds, and returns ``None`` with no side effect when the pool cannot serve it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from segserve.config import cdiv
from segserve.core.block_pool import BlockPool, KVCacheBlock
from segserve.core.kv_cache_utils import BlockHash, extend_block_hashes
from segserve.core.request import Request


@dataclass(frozen=True)
class KVCacheBlocks:
    """An ordered group of blocks (a request's prefix hits, or the blocks newly allocated to it)."""

    blocks: tuple[KVCacheBlock, ...] = ()

    def get_block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    def __len__(self) -> int:
        return len(self.blocks)


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups, in tokens: ``queries`` prompt tokens looked up, ``hits`` served."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class KVCacheManager:
    """Blocks held by each request.

    Args:
        num_blocks: pool size including the null block.
        block_size: tokens per block.
        max_model_len: most tokens of one request (bounds a block-table row).
        enable_caching: prefix caching on or off.
    """

    num_blocks: int
    block_size: int
    max_model_len: int
    enable_caching: bool = True
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        self.pool = BlockPool(self.num_blocks, self.enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's leading blocks are already registered in the hash table.
        self.num_cached_blocks: dict[str, int] = {}

    @property
    def usage(self) -> float:
        """Fraction of usable KV blocks held by requests, in [0, 1]."""
        return self.pool.usage

    @property
    def max_blocks_per_seq(self) -> int:
        return cdiv(self.max_model_len, self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of the request, in whole blocks.

        The hit is capped at ``num_tokens - 1`` tokens so the last token is recomputed (its logits are
        needed). A request that wants prompt logprobs gets no hit (as in vLLM): the logits of cached
        positions are never computed. Returns (hit blocks, hit tokens), tokens a multiple of
        ``block_size``.
        """
        hits = []
        for key in self.hittable_hashes(request):
            block = self.pool.get_cached_block(key)
            if block is None:
                break
            hits.append(block)
        return KVCacheBlocks(tuple(hits)), len(hits) * self.block_size

    def hittable_hashes(self, request: Request) -> list[BlockHash]:
        """The keys a prefix-cache lookup of the request may hit, in order: its full blocks' chained
        hashes (``request.block_hashes``, extended to all its tokens) up to ``num_tokens - 1`` tokens, so
        the last token is recomputed (its logits are needed); empty when it may hit none (caching off,
        or the request wants prompt logprobs: see :meth:`get_computed_blocks`)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt)
        return request.block_hashes[: (request.num_tokens - 1) // self.block_size]

    def record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count an admitted request's lookup in the prefix-cache stats (once per request, so a
        request that waits several steps for room, or is preempted and resumed, counts once)."""
        if self.enable_caching and request.num_preemptions == 0:
            self.stats.requests += 1
            self.stats.queries += request.num_tokens
            self.stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
    ) -> KVCacheBlocks | None:
        """Give the request slots for ``num_new_tokens`` more tokens this step.

        Args:
            request: the request; ``request.num_computed_tokens`` tokens are already in its blocks.
            num_new_tokens: tokens to compute this step (>= 1).
            num_new_computed_tokens: prefix-hit tokens being claimed now (block-aligned).
            new_computed_blocks: the prefix-hit blocks from ``get_computed_blocks``.

        Returns:
            The newly allocated blocks (prefix-hit blocks excluded), or None when the pool cannot
            serve the request; None changes nothing.

        Raises:
            ValueError: when ``num_new_tokens`` < 1 or the request would exceed ``max_model_len``.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        hit_blocks = new_computed_blocks.blocks if new_computed_blocks else ()
        held = self.req_to_blocks.get(request.request_id, [])
        num_tokens_need_slot = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if num_tokens_need_slot > self.max_model_len:
            raise ValueError(
                f"request {request.request_id}: {num_tokens_need_slot} tokens exceed "
                f"max_model_len={self.max_model_len}"
            )
        num_new_blocks = cdiv(num_tokens_need_slot, self.block_size) - len(held) - len(hit_blocks)
        # Hit blocks sitting in the free queue are revived, so they consume free blocks too.
        num_revived = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if max(num_new_blocks, 0) + num_revived > self.pool.num_free_blocks:
            return None
        self.pool.touch(hit_blocks)
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        blocks.extend(hit_blocks)
        if hit_blocks:
            self.num_cached_blocks[request.request_id] = len(blocks)
        new_blocks = self.pool.get_new_blocks(max(num_new_blocks, 0))
        assert new_blocks is not None  # checked above
        blocks.extend(new_blocks)
        return KVCacheBlocks(tuple(new_blocks))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks whose KV is now written (up to ``num_computed_tokens``).

        Called after a step ran, so no hash can point to KV that was never written.
        """
        if not self.enable_caching:
            return
        rid = request.request_id
        start = self.num_cached_blocks.get(rid, 0)
        end = num_computed_tokens // self.block_size
        if end <= start:
            return
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt)
        blocks = self.req_to_blocks[rid]
        for i in range(start, end):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[rid] = end

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (so its last blocks are evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (only when no request holds blocks). Returns success."""
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Assert pool invariants and that each block's ref count equals the rows holding it."""
        self.pool.check_integrity()
        holders: dict[int, int] = {}
        for rid, blocks in self.req_to_blocks.items():
            assert len(blocks) <= self.max_blocks_per_seq, f"{rid} holds more than a row of blocks"
            for block in blocks:
                assert not block.is_null, f"{rid} holds the null block"
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for block in self.pool.blocks[1:]:
            assert block.ref_cnt == holders.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt={block.ref_cnt}, held by {holders.get(block.block_id, 0)}"
            )
        in_use = sum(1 for b in self.pool.blocks[1:] if b.ref_cnt > 0)
        assert self.pool.num_free_blocks + in_use + 1 == self.num_blocks, "free + in use + null != total"
