"""Seed 000's segmented attention for one request, stated plainly: the second oracle of the kernel tests.

The queries of the step's active tokens attend to the request's ``prior`` cached tokens, walked
through its block table in segments of ``kv_segment_size`` (the last one partial: only its valid
tokens), and causally to the step's own tokens; the partial results merge by log-sum-exp. Slow on
purpose (one segment at a time, float32, K/V repeated for GQA); the product kernel
(``segserve.attention.segmented``) batches the same walk as planned in ``segserve.attention.plan``.
"""

from __future__ import annotations

import torch

from segserve.attention.kv_store import gather_kv


def segment_walk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    block_row: torch.Tensor,
    prior: int,
    kv_segment_size: int,
    scale: float,
) -> torch.Tensor:
    """Attention of one request's step, segment by segment.

    Args:
        q: ``[Tq, Hq, D]`` queries at positions ``prior .. prior + Tq - 1``.
        k, v: ``[Tq, Hkv, D]`` the step's own K/V (``Hq`` a multiple of ``Hkv``).
        kv_cache: ``[2, num_blocks, block_size, Hkv, D]`` holding the prior's tokens.
        block_row: ``[max_blocks_per_seq]`` the request's block ids.
        prior: cached tokens before the step; kv_segment_size: tokens per segment; scale: softmax scale.

    Returns:
        ``[Tq, Hq, D]`` float32.

    Raises:
        ValueError: (from ``gather_kv``) when the row holds fewer than ``prior`` tokens' blocks, or a
            segment start is not block-aligned.
    """
    group, tq = q.shape[1] // k.shape[1], q.shape[0]
    qh = q.float().transpose(0, 1)  # (Hq, Tq, D)

    def attend(keys, values, hidden=None):  # keys, values (L, Hkv, D) -> (Hq, Tq, D), (Hq, Tq)
        kh, vh = (t.float().repeat_interleave(group, dim=1).transpose(0, 1) for t in (keys, values))
        scores = qh @ kh.transpose(1, 2) * scale  # (Hq, Tq, L)
        if hidden is not None:
            scores = scores.masked_fill(hidden, float("-inf"))
        return torch.softmax(scores, dim=-1) @ vh, torch.logsumexp(scores, dim=-1)

    o, lse = attend(k, v, torch.ones(tq, tq, dtype=torch.bool).triu(1))  # causal over the step's tokens
    for start in range(0, prior, kv_segment_size):
        valid = min(kv_segment_size, prior - start)  # the last segment may be partial
        o_s, lse_s = attend(*gather_kv(kv_cache, block_row, start, valid))
        total = torch.logaddexp(lse, lse_s)  # merge: softmax over the union of both key sets
        o = o * (lse - total).exp().unsqueeze(-1) + o_s * (lse_s - total).exp().unsqueeze(-1)
        lse = total
    return o.transpose(0, 1)
