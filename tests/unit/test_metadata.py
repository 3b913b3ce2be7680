"""``build_attention_metadata``: slots and block table against a per-token reference, bad rows."""

from __future__ import annotations

import pytest
import torch

from segserve.attention.metadata import build_attention_metadata

BS = 4


def _reference_slots(query_lens, priors, rows) -> list[int]:
    return [
        row[t // BS] * BS + t % BS
        for q, p, row in zip(query_lens, priors, rows, strict=True)
        for t in range(p, p + q)
    ]


def test_mixed_batch_matches_per_token_reference() -> None:
    query_lens, priors = [1, 7, 1, 3], [9, 0, 2, 5]
    rows = [[5, 2, 9], [11, 12], [3], [7, 8, 1]]  # the last holds one block more than it needs
    md = build_attention_metadata(query_lens, priors, rows, BS, 4, 8, num_padded_tokens=16)
    assert md.slot_mapping.tolist() == _reference_slots(query_lens, priors, rows)
    assert md.slot_mapping.dtype == torch.int64
    assert md.block_table.tolist() == [[5, 2, 9, 0], [11, 12, 0, 0], [3, 0, 0, 0], [7, 8, 1, 0]]
    assert md.query_start_loc_cpu == (0, 1, 8, 9, 12) and md.prior_tokens_cpu == (9, 0, 2, 5)
    assert md.query_lens_cpu == (1, 7, 1, 3) and md.num_reqs == 4
    assert md.seq_lens.tolist() == [10, 7, 3, 8] and md.seq_lens.dtype == torch.int32
    assert (md.num_actual_tokens, md.num_padded_tokens) == (12, 16)
    assert md.max_query_len == 7


def test_empty_batch() -> None:
    md = build_attention_metadata([], [], [], BS, 4, 8)
    assert md.num_actual_tokens == 0 and md.slot_mapping.shape == (0,) and md.block_table.shape == (0, 4)


def test_too_few_blocks_names_the_request() -> None:
    with pytest.raises(ValueError, match=r"request 1: 1 blocks for 6 tokens \(need 2, at most 4\)"):
        build_attention_metadata([1, 2], [0, 4], [[1], [2]], BS, 4, 8)


def test_too_many_blocks_names_the_limit() -> None:
    with pytest.raises(ValueError, match=r"request 0: 5 blocks for 1 tokens \(need 1, at most 4\)"):
        build_attention_metadata([1], [0], [[1, 2, 3, 4, 5]], BS, 4, 8)
