"""Attention backends by name: the segmented kernel (the product) and the reference (the oracle)."""

from __future__ import annotations

from typing import Protocol

import torch

from segserve.attention.metadata import AttentionMetadata
from segserve.attention.reference import ReferenceAttentionBackend
from segserve.attention.segmented import SegmentedAttentionBackend


class AttentionBackend(Protocol):
    """What a model layer calls: write the step's K/V into the cache, then attend.

    ``forward(q [T_padded, Hq, D], k [T_padded, Hkv, D], v [T_padded, Hkv, D],
    kv_cache [2, num_blocks, block_size, Hkv, D], metadata, scale, kv_written=False) -> [T_padded, Hq, D]``
    in q's dtype, padding rows zero. ``kv_written``: the step's K/V rows are in the cache already (a
    fused projection wrote them there: ``amx.RopeKV``), so the backend does not write them again.
    """

    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        kv_written: bool = False,
    ) -> torch.Tensor: ...


_BACKENDS: dict[str, type] = {
    ReferenceAttentionBackend.name: ReferenceAttentionBackend,
    SegmentedAttentionBackend.name: SegmentedAttentionBackend,
}


def get_attention_backend(name: str) -> AttentionBackend:
    """A fresh backend instance for ``name`` (``"segmented"`` or ``"reference"``).

    Raises:
        ValueError: for an unknown name, listing the choices.
    """
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; choices: {sorted(_BACKENDS)}") from None
