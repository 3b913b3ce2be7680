"""Reference attention backend: gather each request's whole K/V from the paged cache, attend with a mask.

Slow on purpose (one request at a time, the full prior materialised, K/V repeated for GQA): it is the
oracle the segmented kernel is tested against, so it favours being obviously right.
"""

from __future__ import annotations

import torch

from segserve.attention.kv_store import gather_kv, write_kv
from segserve.attention.metadata import AttentionMetadata


class ReferenceAttentionBackend:
    """Masked attention per request over K/V read back from the cache through its block table."""

    name = "reference"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        kv_written: bool = False,
    ) -> torch.Tensor:
        """Write the step's K/V to the cache (unless ``kv_written``: they are there already), then attend
        each request's queries to its prior + itself.

        Args:
            q: ``[T_padded, Hq, D]`` queries of the step's active tokens (RoPE applied).
            k, v: ``[T_padded, Hkv, D]``; ``Hq`` is a multiple of ``Hkv``.
            kv_cache: ``[2, num_blocks, block_size, Hkv, D]``, written in place at ``slot_mapping``.
            metadata: the step's attention metadata.
            scale: softmax scale (usually ``D ** -0.5``).

        Returns:
            ``[T_padded, Hq, D]`` in q's dtype; padding rows are zeros. Computed in float32.
        """
        if not kv_written:
            write_kv(kv_cache, k, v, metadata.slot_mapping)
        out = torch.zeros_like(q)
        qsl = metadata.query_start_loc_cpu
        for i, prior in enumerate(metadata.prior_tokens_cpu):
            r0, r1 = qsl[i], qsl[i + 1]
            if r1 > r0:
                out[r0:r1] = self._attend_one(q[r0:r1], kv_cache, metadata.block_table[i], prior, scale)
        return out

    @staticmethod
    def _attend_one(
        q: torch.Tensor, kv_cache: torch.Tensor, block_row: torch.Tensor, prior: int, scale: float
    ) -> torch.Tensor:
        """Queries ``[Tq, Hq, D]`` at positions ``prior ..`` over cached tokens ``0 .. prior + Tq - 1``."""
        tq, hq, _ = q.shape
        k, v = gather_kv(kv_cache, block_row, 0, prior + tq)  # (S, Hkv, D), S = prior + Tq
        group = hq // k.shape[1]
        k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # (Hq, S, D)
        v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)  # (Hq, S, D)
        scores = torch.matmul(q.float().transpose(0, 1), k.transpose(1, 2)) * scale  # (Hq, Tq, S)
        q_pos = torch.arange(prior, prior + tq, device=q.device)
        k_pos = torch.arange(prior + tq, device=q.device)
        visible = k_pos[None, :] <= q_pos[:, None]  # (Tq, S): the prior and the causal part
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        return torch.matmul(probs, v).transpose(0, 1).to(q.dtype)  # (Tq, Hq, D)
