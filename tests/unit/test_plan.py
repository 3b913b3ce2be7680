"""``segserve.attention.plan``: the one segment/gather plan the segmented kernel and the simulator share.

Plain ints and lists: exact segments, exact calls (which decodes, which blocks, read in place or
copied), exact gathered tokens. That the backend runs exactly these calls is pinned in
tests/kernels/test_attention.py; that the simulator's count equals the kernel's copies on a real
replay, in tests/simulator/test_replay.py.
"""

from __future__ import annotations

import pytest
from core_helpers import output_without

from segserve.attention import plan
from segserve.attention.plan import DecodeCall


def test_plan_imports_without_torch_or_numpy() -> None:
    assert output_without(("torch", "numpy"), "import segserve.attention.plan\nprint('ok')") == "ok"


@pytest.mark.parametrize(
    "prior,seg,expected", [(3584, 1024, (3, 512)), (4096, 1024, (4, 0)), (0, 512, (0, 0)), (1, 4096, (0, 1))]
)
def test_num_kv_segments(prior: int, seg: int, expected: tuple[int, int]) -> None:
    assert plan.num_kv_segments(prior, seg) == expected


def test_num_kv_segments_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="need prior_tokens >= 0 and kv_segment_size >= 1, got -1, 512"):
        plan.num_kv_segments(-1, 512)
    with pytest.raises(ValueError, match="got 10, 0"):
        plan.num_kv_segments(10, 0)


def test_chunk_batches_and_segments_per_call() -> None:
    # Seed 000's partial example in batches of 2 segments: [0, 2048) then the last full one + 512.
    assert plan.chunk_batches(3584, 1024, 2) == [(0, 2048), (2048, 3584)]
    assert plan.chunk_batches(4096, 1024, 4) == [(0, 4096)]
    assert plan.chunk_batches(0, 1024, 4) == []
    # Bounded by tokens read (32768 // 512 = 64), by partial outputs (2**23 // (9 * 2048 * 64) = 7),
    # and never below one segment.
    assert plan.segments_per_call(512, 9 * 16 * 64, plan.MAX_GATHER_TOKENS, plan.MAX_PARTIAL_ELEMENTS) == 64
    assert plan.segments_per_call(512, 9 * 2048 * 64, plan.MAX_GATHER_TOKENS, plan.MAX_PARTIAL_ELEMENTS) == 7
    assert plan.segments_per_call(4096, 10**9, 1024, 1) == 1


def test_consecutive_run() -> None:
    assert plan.consecutive_run([[5, 6, 7]], 0, 3) == 5
    assert plan.consecutive_run([[5, 6], [7, 8]], 0, 2) == 5  # request-major ids run on
    assert plan.consecutive_run([[5, 7], [6, 8]], 0, 2) is None
    assert plan.consecutive_run([[1, 3, 9, 10]], 2, 2) == 9  # a window of the row
    assert plan.consecutive_run([(4, 5, 6)], 0, 3) == 4  # any sequence rows
    assert plan.consecutive_run([[9]], 0, 2) is None  # padded with the null block: 9, 0
    assert plan.consecutive_run([[3, 4], [0]], 0, 2) is None


def test_decode_order_is_longest_prior_first_ties_in_batch_order() -> None:
    # Chunks (query length > 1) are not decodes; equal priors keep their batch order.
    assert plan.decode_order([1, 5, 1, 1, 1], [7, 900, 30, 7, 0]) == ([2, 0, 3, 4], [31, 8, 8, 1])
    assert plan.decode_order([3], [10]) == ([], [])


def test_decode_calls_cover_the_prefix_of_decodes_reaching_each_segment() -> None:
    # Walks 41 and 20 in segments of 32 tokens (2 blocks of 16): segment 0 for both, over 2 blocks
    # each (20 valid of 32 for the shorter, masked); segment 32 for the longer alone, 1 block (9 valid).
    rows = [[1, 3, 9], [2, 4]]
    assert plan.decode_calls([41, 20], rows, 16, 32) == [
        DecodeCall(start=0, first=0, last=2, first_block=0, blocks=2, valid=(32, 20), run=None),
        DecodeCall(start=32, first=0, last=1, first_block=2, blocks=1, valid=(9,), run=9),
    ]


def test_decode_calls_split_at_max_gather_tokens() -> None:
    # Three walks of 40 in segments of 32: 2 blocks per decode in segment 0, 1 in segment 32. With at
    # most 64 tokens a call: 2 decodes a call in segment 0 (2 x 32), all 3 in segment 32 (3 x 16).
    rows = [[1, 2, 3], [6, 7, 4], [8, 9, 5]]
    assert plan.decode_calls([40, 40, 40], rows, 16, 32, max_gather_tokens=64) == [
        DecodeCall(0, 0, 2, 0, 2, (32, 32), run=None),  # 1, 2 | 6, 7
        DecodeCall(0, 2, 3, 0, 2, (32,), run=8),  # 8, 9
        DecodeCall(32, 0, 3, 2, 1, (8, 8, 8), run=3),  # 3 | 4 | 5
    ]
    # At least one decode a call, however small the bound.
    assert [(c.first, c.last) for c in plan.decode_calls([40, 40], rows[:2], 16, 32, 1)] == [
        (0, 1), (1, 2), (0, 1), (1, 2)
    ]
    assert plan.decode_calls([], [], 16, 32) == []


def test_gathered_tokens_by_hand() -> None:
    dec = (1,)  # query length of a decode
    # One decode over consecutive blocks: read in place.
    assert plan.gathered_tokens(dec, [40], [[5, 6, 7]], 16, 512) == 0
    # Two decodes whose request-major ids happen to run on (5, 6 | 7, 8): in place; interleaved: both
    # requests' 2 blocks copied (2 x 2 x 16).
    assert plan.gathered_tokens([1, 1], [20, 20], [[5, 6], [7, 8]], 16, 512) == 0
    assert plan.gathered_tokens([1, 1], [20, 20], [[5, 7], [6, 8]], 16, 512) == 64
    # Segment 32 tokens (2 blocks): the longer decode (walk 41: blocks 0-2) reaches the second
    # segment alone, where its one block (id 9) is in place; the first segment of both (walks 41 and
    # 20) gathers 2 x 2 blocks; the shorter row is padded with the null block to the longest's width.
    assert plan.gathered_tokens([1, 1], [40, 19], [[1, 3, 9], [2, 4]], 16, 32) == 64
    # ... unless the decodes read in place (the compiled kernel): nothing then.
    assert plan.gathered_tokens([1, 1], [40, 19], [[1, 3, 9], [2, 4]], 16, 32, decodes_gather=False) == 0
    # A prefill chunk copies its prior blocks unless consecutive; a first chunk (prior 0) reads none.
    assert plan.gathered_tokens([16], [48], [[3, 4, 5, 6]], 16, 512) == 0
    assert plan.gathered_tokens([16], [48], [[3, 8, 5, 6]], 16, 512) == 48
    assert plan.gathered_tokens([16], [48], [[3, 8, 5, 6]], 16, 512, decodes_gather=False) == 48
    # ... unless the compiled chunk kernel takes the chunks (it reads their priors in place); decodes
    # still gather unless their kernel reads in place too (the decode's first segment, blocks 1 and 3).
    assert plan.gathered_tokens([16], [48], [[3, 8, 5, 6]], 16, 512, chunks_gather=False) == 0
    rows = [[3, 8, 5, 6], [1, 3, 9]]
    assert plan.gathered_tokens([16, 1], [48, 40], rows, 16, 32, chunks_gather=False) == 32
    assert plan.gathered_tokens([64], [0], [[9, 2, 4, 1]], 16, 512) == 0
