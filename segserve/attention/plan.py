"""The segment/gather plan of segmented attention, in plain ints and lists (no torch).

One statement of which cached KV each request's attention walks and how the walk is cut into calls,
read by the segmented backend (``segserve.attention.segmented``, which turns it into tensors once per
step) and by the simulator (``segserve.simulator.replica``, which charges the tokens it copies).
Units: tokens unless named blocks; block ids index the paged cache, 0 is the null block.

Segments (seed 000, "Partial KV Segment Handling"): a request with ``prior`` cached tokens walks them
in segments of ``kv_segment_size`` tokens starting at ``0, seg, 2 seg, ...``; segment ``start`` holds
``min(seg, prior - start)`` valid tokens, so only the last can be partial (:func:`num_kv_segments`).
Partial results merge by log-sum-exp (``segserve.attention.segment_walk`` states it plainly).

Chunks (query length > 1): the causal part over the step's own tokens is one call; the prior's
segments go in batches of :func:`segments_per_call` segments (:func:`chunk_batches`), each batch's
blocks read in place when they are one run of consecutive ids (:func:`consecutive_run`), else copied.

Decodes (query length 1): a decode's own K/V is written to the cache before attention, so it walks
``prior + 1`` tokens and has no separate causal part. Decodes are sorted longest walk first (stable:
ties keep batch order, :func:`decode_order`); segment ``start`` is computed for the prefix of them that
reaches into it, every one read over the blocks of the longest in that prefix (the rest masked), in
calls of at most ``max_gather_tokens`` read tokens (:func:`decode_calls`). A call whose request-major
block ids (null-padded to the call's width) form one run is read in place; any other is copied.

The compiled C decode path (``segserve.kernels.cpu.decode_attention`` and ``DecodeStack``) uses none
of the decode calls: it walks every decode's blocks in place through the block table, one work item
per (decode, KV head, segment), so it copies nothing. Its segments are not always ``kv_segment_size``:
it caps the segment at the block table's width, then, when few decodes over short contexts would leave
cores idle, halves it (rounding up, not below 64 tokens) until there are at least two work items per
OpenMP thread (``sum(cdiv(len, seg)) * Hkv >= 2 * threads``). The split changes only the order of the
sums; the log-sum-exp merge gives the same softmax attention.

:func:`gathered_tokens` is what this plan copies per layer: exact for the decodes; for a chunk, the
whole prior is charged unless it is one run. That is exact when the prior fits one batch, an upper
bound otherwise (batches are checked one by one, and their size depends on the model's head shape,
which a step's token counts do not carry).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from segserve.config import cdiv

# Bounds on one batched call: tokens read (about 25 MB per K or V in float32 for 3 KV heads of dim
# 64), and float32 elements of the per-segment partial outputs (S x Hq x Tq x D) a chunk holds before
# they are combined. Large enough to amortise per-call overhead, small enough to stay in memory.
MAX_GATHER_TOKENS = 32768
MAX_PARTIAL_ELEMENTS = 1 << 23


def num_kv_segments(prior_tokens: int, kv_segment_size: int) -> tuple[int, int]:
    """Split a prior of ``prior_tokens`` cached tokens into ``kv_segment_size`` segments.

    Seed 000, "Partial KV Segment Handling": 3584 prior tokens in segments of 1024 are 3 full segments
    and a partial one holding 512 valid tokens (the kernel masks the rest of it).

    Returns:
        (full segments, valid tokens in the trailing partial segment — 0 when there is none).

    Raises:
        ValueError: when ``prior_tokens < 0`` or ``kv_segment_size < 1``.
    """
    if prior_tokens < 0 or kv_segment_size < 1:
        raise ValueError(
            f"need prior_tokens >= 0 and kv_segment_size >= 1, got {prior_tokens}, {kv_segment_size}"
        )
    return prior_tokens // kv_segment_size, prior_tokens % kv_segment_size


def segments_per_call(
    seg: int, query_elements: int, max_gather_tokens: int, max_partial_elements: int
) -> int:
    """Prior segments one chunk call covers: at least 1, at most ``max_gather_tokens // seg`` (tokens
    read) and ``max_partial_elements // query_elements`` (partial outputs held, one query's worth
    ``Hq * Tq * D`` elements per segment)."""
    return max(1, min(max_gather_tokens // seg, max_partial_elements // query_elements))


def chunk_batches(prior: int, seg: int, per_call: int) -> list[tuple[int, int]]:
    """Token ranges ``[start, end)`` of a chunk's prior, ``per_call`` segments each (the last may be
    shorter and end mid-segment); empty for ``prior == 0``."""
    step = per_call * seg
    return [(start, min(prior, start + step)) for start in range(0, prior, step)]


def consecutive_run(rows: Sequence[Sequence[int]], first_block: int, blocks: int) -> int | None:
    """First id when blocks ``[first_block, first_block + blocks)`` of every row, request-major (a
    row ending early padded with the null block 0), are one run of consecutive ascending ids; else None.

    The pool hands out blocks in free-queue order, so a request that allocated without others
    interleaving (any batch-1 request, most prefill chunks) holds runs; reading those through a view
    skips the copy that dominates long-context decode steps. Rows are only sliced, so a lazy sequence
    is read only where looked at; the check stops at the first break, which under serving traffic is
    almost always within the first two rows.
    """
    run = expect = None
    for row in rows:
        part = list(row[first_block : first_block + blocks])
        if len(part) < blocks:
            part += [0] * (blocks - len(part))
        if expect is None:
            run = expect = part[0]
        if part != list(range(expect, expect + blocks)):
            return None
        expect += blocks
    return run


@dataclass(frozen=True)
class DecodeCall:
    """One batched read + attention: sorted decodes ``[first, last)`` over the segment at ``start``.

    Attributes:
        start: first token of the segment.
        first, last: positions in the sorted decode order (:func:`decode_order`).
        first_block: ``start // block_size``, the segment's first block-table column.
        blocks: blocks read per decode (those of the longest decode in the segment).
        valid: valid tokens of each decode in the call (``min(seg, walk - start)``), longest first.
        run: first block id when the call's request-major block ids are one consecutive run (read in
            place), else None (copied).
    """

    start: int
    first: int
    last: int
    first_block: int
    blocks: int
    valid: tuple[int, ...]
    run: int | None


def decode_order(query_lens: Sequence[int], priors: Sequence[int]) -> tuple[list[int], list[int]]:
    """The step's decodes (query length 1) longest prior first, ties in batch order.

    Returns:
        (request indices, tokens each walks: ``prior + 1``, its own token already cached).
    """
    order = sorted((i for i, n in enumerate(query_lens) if n == 1), key=lambda i: -priors[i])
    return order, [priors[i] + 1 for i in order]


def decode_calls(
    walks: Sequence[int],
    rows: Sequence[Sequence[int]],
    block_size: int,
    seg: int,
    max_gather_tokens: int = MAX_GATHER_TOKENS,
) -> list[DecodeCall]:
    """Every decode call of a step, segment by segment.

    Args:
        walks: tokens each decode walks, sorted longest first (:func:`decode_order`).
        rows: each decode's block ids, same order (see :func:`consecutive_run`).
        block_size: tokens per block; seg: ``kv_segment_size``, a multiple of it.
        max_gather_tokens: most tokens one call reads (at least one decode per call).
    """
    calls = []
    for start in range(0, walks[0] if walks else 0, seg):
        valid = [min(seg, n - start) for n in walks if n > start]  # a prefix, as walks are sorted
        blocks, first_block = cdiv(valid[0], block_size), start // block_size
        per_call = max(1, max_gather_tokens // (blocks * block_size))
        for first in range(0, len(valid), per_call):
            last = min(first + per_call, len(valid))
            run = consecutive_run(rows[first:last], first_block, blocks)
            calls.append(DecodeCall(start, first, last, first_block, blocks, tuple(valid[first:last]), run))
    return calls


def gathered_tokens(
    query_lens: Sequence[int],
    priors: Sequence[int],
    rows: Sequence[Sequence[int]],
    block_size: int,
    seg: int,
    decodes_gather: bool = True,
    max_gather_tokens: int = MAX_GATHER_TOKENS,
    chunks_gather: bool = True,
) -> int:
    """Cached tokens (whole blocks) the segmented backend copies per layer in a step.

    Args:
        query_lens, priors: per request, tokens computed this step and tokens cached before it.
        rows: per request, its block ids, same order (see :func:`consecutive_run`).
        block_size: tokens per block; seg: ``kv_segment_size``.
        decodes_gather: False for the compiled CPU kernels, whose decodes read every block in place
            (only chunks copy then).
        max_gather_tokens: the backend's bound on one decode call.
        chunks_gather: False where the compiled chunk kernel (``segserve.kernels.chunk_attention``) takes
            the chunks, reading their priors in place too (then nothing is copied at all).

    Returns:
        Tokens copied: exact for decodes, an upper bound for a chunk whose prior spans several
        batches (see the module docstring).
    """
    gathered = 0
    order, walks = decode_order(query_lens, priors)
    if order and decodes_gather:
        calls = decode_calls(walks, [rows[i] for i in order], block_size, seg, max_gather_tokens)
        gathered += sum((c.last - c.first) * c.blocks * block_size for c in calls if c.run is None)
    for n, prior, row in zip(query_lens, priors, rows, strict=True):
        if chunks_gather and n > 1 and prior > 0:
            blocks = cdiv(prior, block_size)
            if consecutive_run([row], 0, blocks) is None:
                gathered += blocks * block_size
    return gathered
