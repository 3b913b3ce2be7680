"""Segmented kernel == reference backend == plain SDPA on contiguous K/V == the seed's segment walk
(``segment_walk``, a second oracle), over random shapes and layouts; the kernel runs its plan exactly.

This file pins the eager PyTorch form of the kernel (its call structure included): the compiled CPU
kernels are switched off for every test here and tested against the same oracle in
test_cpu_kernels.py.

Tolerances: float32 outputs agree within atol = rtol = 1e-5 (observed <= 6e-7). bfloat16 outputs agree
with a float32 oracle on the same bf16-rounded inputs within atol 2e-2: outputs reach |3.5| here, where
one bf16 ulp is 1.6e-2, so the final rounding alone costs up to 7.8e-3 (observed 7.6e-3, the same for
both backends).
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import Case, make_case, sdpa_oracle, walk_oracle

from segserve.attention import plan, segment_walk, segmented
from segserve.attention.backends import get_attention_backend
from segserve.attention.kv_store import gather_kv, write_kv
from segserve.attention.plan import num_kv_segments
from segserve.attention.reference import ReferenceAttentionBackend
from segserve.attention.segmented import (
    SegmentedAttentionBackend,
    attention_with_lse,
    attention_with_lse_math,
    merge_partials,
)
from segserve.kernels import cpu as cpu_kernels

FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
BF16_TOL = {"atol": 2e-2, "rtol": 0.0}
HEADS = (((9, 3), 64), ((4, 1), 32))
SEGMENTS_AND_BLOCKS = [(s, b) for s in (512, 1024, 2048, 4096) for b in (16, 64, 128)]


@pytest.fixture(autouse=True)
def eager_kernel():
    with cpu_kernels.disabled():
        yield


def prior_kinds(seg: int, block_size: int) -> list[int]:
    """Empty, exact multiple of the segment, partial last segment, unaligned to the block, short."""
    return [0, 2 * seg, seg + seg // 2, seg + 3 * block_size + 5, block_size + 1]


def mixed_batch(seg: int, block_size: int, seed: int) -> tuple[list[int], list[int]]:
    """Every prior kind once as a decode and once as a chunk of random length, interleaved."""
    gen = torch.Generator().manual_seed(seed)
    query_lens, priors = [], []
    for prior in prior_kinds(seg, block_size):
        chunk = int(torch.randint(2, 41, (1,), generator=gen))
        query_lens += [1, chunk]
        priors += [prior, prior]
    if seg == 512:
        query_lens.append(600)  # a chunk longer than a segment: query length is not tied to it
        priors.append(seg + 7)
    return query_lens, priors


def run_both(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(segmented out, reference out, segmented's cache after, reference's cache after)."""
    seg_cache, ref_cache = case.cache.clone(), case.cache.clone()
    out_seg = SegmentedAttentionBackend().forward(
        case.q, case.k, case.v, seg_cache, case.metadata, case.scale
    )
    out_ref = ReferenceAttentionBackend().forward(
        case.q, case.k, case.v, ref_cache, case.metadata, case.scale
    )
    return out_seg, out_ref, seg_cache, ref_cache


def assert_cache_written_exactly(case: Case, after: torch.Tensor) -> None:
    """Only the real rows' slots changed, to the rows' K/V; padding wrote nowhere; null block intact."""
    md = case.metadata
    t = md.num_actual_tokens
    expected = case.cache.clone().flatten(1, 2)  # (2, slots, Hkv, D)
    expected[0, md.slot_mapping] = case.k[:t]
    expected[1, md.slot_mapping] = case.v[:t]
    assert torch.equal(after.flatten(1, 2), expected)
    assert torch.count_nonzero(after[:, 0]) == 0


@pytest.mark.parametrize("index", range(len(SEGMENTS_AND_BLOCKS)))
def test_float32_matches_reference_and_sdpa(index: int) -> None:
    seg, block_size = SEGMENTS_AND_BLOCKS[index]
    heads, head_dim = HEADS[index % 2]
    query_lens, priors = mixed_batch(seg, block_size, seed=index)
    case = make_case(
        query_lens, priors, block_size=block_size, seg=seg, heads=heads, head_dim=head_dim, pad=3, seed=index
    )
    oracle = sdpa_oracle(case, case.cache)
    out_seg, out_ref, seg_cache, ref_cache = run_both(case)
    t = case.metadata.num_actual_tokens
    torch.testing.assert_close(out_ref, oracle, **FP32_TOL)
    torch.testing.assert_close(out_seg, oracle, **FP32_TOL)
    assert torch.count_nonzero(out_seg[t:]) == 0 and torch.count_nonzero(out_ref[t:]) == 0
    assert_cache_written_exactly(case, seg_cache)
    assert_cache_written_exactly(case, ref_cache)


@pytest.mark.parametrize("seg,block_size", [(512, 16), (1024, 64), (4096, 128)])
def test_bfloat16_matches_float32_oracle(seg: int, block_size: int) -> None:
    query_lens, priors = mixed_batch(seg, block_size, seed=seg)
    case = make_case(
        query_lens, priors, block_size=block_size, seg=seg, dtype=torch.bfloat16, pad=2, seed=seg
    )
    oracle = sdpa_oracle(case, case.cache)  # float32 math on the bf16 values
    out_seg, out_ref, seg_cache, _ = run_both(case)
    assert out_seg.dtype == torch.bfloat16 and out_ref.dtype == torch.bfloat16
    torch.testing.assert_close(out_seg.float(), oracle, **BF16_TOL)
    torch.testing.assert_close(out_ref.float(), oracle, **BF16_TOL)
    assert torch.count_nonzero(out_seg[case.metadata.num_actual_tokens :]) == 0
    assert_cache_written_exactly(case, seg_cache)


def test_long_chunk_in_batches_of_segments() -> None:
    """A chunk's full segments are batched into calls; smaller bounds mean more calls, same answer."""
    case = make_case([40, 3], [5 * 512 + 300, 4 * 512], block_size=64, seg=512, pad=1, seed=12)
    oracle = sdpa_oracle(case, case.cache)
    for gather_tokens, partial_elements in ((32768, 1 << 23), (1024, 1 << 23), (32768, 1)):
        backend = SegmentedAttentionBackend(
            max_gather_tokens=gather_tokens, max_partial_elements=partial_elements
        )
        out = backend.forward(case.q, case.k, case.v, case.cache.clone(), case.metadata, case.scale)
        torch.testing.assert_close(out, oracle, **FP32_TOL)


def test_many_decodes_split_into_bounded_gathers() -> None:
    gen = torch.Generator().manual_seed(7)
    priors = torch.randint(0, 3000, (24,), generator=gen).tolist()
    case = make_case([1] * 24, priors, block_size=16, seg=512, heads=(4, 1), head_dim=32, pad=8, seed=7)
    oracle = sdpa_oracle(case, case.cache)
    for budget in (32768, 1024, 1):  # one call per segment; several; one decode per call
        backend = SegmentedAttentionBackend(max_gather_tokens=budget)
        out = backend.forward(case.q, case.k, case.v, case.cache.clone(), case.metadata, case.scale)
        torch.testing.assert_close(out, oracle, **FP32_TOL)


def test_layers_share_the_step_plan() -> None:
    """One metadata, two layers (two caches): the plan built on layer 0 must serve layer 1."""
    case = make_case([1, 5, 1], [700, 300, 1], block_size=16, seg=512, seed=3)
    other = make_case([1, 5, 1], [700, 300, 1], block_size=16, seg=512, seed=4)
    backend = SegmentedAttentionBackend()
    for c in (case, other):
        out = backend.forward(c.q, c.k, c.v, c.cache.clone(), case.metadata, c.scale)
        expected = sdpa_oracle(Case(c.q, c.k, c.v, c.cache, case.metadata, c.scale), c.cache)
        torch.testing.assert_close(out, expected, **FP32_TOL)


def test_seed_partial_segment_example_walks_three_full_segments_and_512_tokens(monkeypatch) -> None:
    """Seed 000: prior 3584, segment 1024, block 128 -> 3 full segments + 512 valid tokens."""
    assert num_kv_segments(3584, 1024) == (3, 512)
    calls = []

    def spy(q, k, v, scale, causal=False, mask=None):
        calls.append((k.shape[0], k.shape[2], causal, mask is not None))  # (segments, keys, ...)
        return attention_with_lse(q, k, v, scale, causal, mask)

    monkeypatch.setattr(segmented, "attention_with_lse", spy)
    # A chunk: its causal part, then the 3 full segments in one batched call, then the 512 valid
    # tokens of the partial one. A decode: its own token is already cached, so it walks 3585 tokens:
    # 3 full segments, then 513 valid tokens (5 blocks of 128 read, cut to 513: a lone decode needs
    # no mask; batched decodes of unequal lengths are masked, see the next test).
    chunk = [(1, 16, True, False), (3, 1024, False, False), (1, 512, False, False)]
    decode = [(1, 1024, False, False)] * 3 + [(1, 513, False, False)]
    for query_len, expected in ((16, chunk), (1, decode)):
        calls.clear()
        case = make_case([query_len], [3584], block_size=128, seg=1024, seed=11)
        cache = case.cache.clone()
        out = SegmentedAttentionBackend().forward(case.q, case.k, case.v, cache, case.metadata, case.scale)
        torch.testing.assert_close(out, sdpa_oracle(case, case.cache), **FP32_TOL)
        assert calls == expected


def test_decode_segments_only_cover_requests_whose_prior_reaches_them(monkeypatch) -> None:
    calls = []

    def spy(q, k, v, scale, causal=False, mask=None):
        calls.append((q.shape[0], k.shape[2], mask is not None))
        return attention_with_lse(q, k, v, scale, causal, mask)

    monkeypatch.setattr(segmented, "attention_with_lse", spy)
    case = make_case([1, 1, 1, 1], [5000, 100, 2000, 2047], block_size=16, seg=1024, seed=5)
    cache = case.cache.clone()
    out = SegmentedAttentionBackend().forward(case.q, case.k, case.v, cache, case.metadata, case.scale)
    torch.testing.assert_close(out, sdpa_oracle(case, case.cache), **FP32_TOL)
    # Each decode walks prior + 1 tokens (its own is cached): 5001, 2048, 2001, 101. Calls are
    # (decodes in the call, keys, masked): all 4, then 3, then only the longest, whose last segment
    # holds 905 tokens (57 blocks of 16 read, cut to 905: alone in its call, it needs no mask).
    assert calls == [(4, 1024, True), (3, 1024, True), (1, 1024, False), (1, 1024, False), (1, 905, False)]


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize(
    ("priors", "pad"),
    [
        ([700], 0),  # batch 1: the result is the layer output as it stands (no scatter)
        ([2100, 900, 40], 0),  # already longest-first: also no scatter
        ([40, 2100, 900], 0),  # out of walk order: scattered back to its rows
        ([2100, 900, 40], 3),  # padding rows: must come back as zeros
    ],
)
def test_decode_only_steps_in_any_order_with_and_without_gathers(
    priors: list[int], pad: int, consecutive: bool
) -> None:
    case = make_case([1] * len(priors), priors, block_size=16, seg=512, pad=pad, seed=3,
                     consecutive_blocks=consecutive)
    cache = case.cache.clone()
    out = SegmentedAttentionBackend().forward(case.q, case.k, case.v, cache, case.metadata, case.scale)
    assert out.shape == case.q.shape
    n = len(priors)
    torch.testing.assert_close(out[:n], sdpa_oracle(case, case.cache)[:n], **FP32_TOL)
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))


def test_math_path_matches_cpu_flash_and_the_formula() -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 6, 5, 32, generator=gen)
    k, v = torch.randn(2, 2, 5, 32, generator=gen), torch.randn(2, 2, 5, 32, generator=gen)
    for causal, mask in ((True, None), (False, torch.tensor([0.0, 0, -torch.inf, 0, 0]).expand(2, 1, 1, 5))):
        o_math, lse_math = attention_with_lse_math(q, k, v, 0.3, causal, mask)
        o_flash, lse_flash = attention_with_lse(q, k, v, 0.3, causal, mask)
        scores = q @ k.repeat_interleave(3, dim=1).transpose(-1, -2) * 0.3  # (2, 6, 5, 5)
        if causal:
            scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), -torch.inf)
        else:
            scores = scores + mask
        expected_o = torch.softmax(scores, -1) @ v.repeat_interleave(3, dim=1)
        for o, lse in ((o_math, lse_math), (o_flash, lse_flash)):
            torch.testing.assert_close(o, expected_o, **FP32_TOL)
            torch.testing.assert_close(lse, torch.logsumexp(scores, -1), **FP32_TOL)


def test_backend_on_the_math_path(monkeypatch) -> None:
    """The device-agnostic path (used off CPU) gives the same answers."""
    monkeypatch.setattr(segmented, "_CPU_FLASH", None)
    case = make_case([1, 9, 1, 30], [0, 600, 1100, 17], block_size=64, seg=512, pad=2, seed=9)
    out = SegmentedAttentionBackend().forward(
        case.q, case.k, case.v, case.cache.clone(), case.metadata, case.scale
    )
    torch.testing.assert_close(out, sdpa_oracle(case, case.cache), **FP32_TOL)


def test_merge_partials_equals_attention_over_the_union() -> None:
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 3, 7, 16, generator=gen)
    k, v = torch.randn(1, 3, 50, 16, generator=gen), torch.randn(1, 3, 50, 16, generator=gen)
    o_all, lse_all = attention_with_lse(q, k, v, 0.25)
    acc_o, acc_lse = attention_with_lse(q, k[:, :, :13], v[:, :, :13], 0.25)
    o_rest, lse_rest = attention_with_lse(q, k[:, :, 13:], v[:, :, 13:], 0.25)
    merge_partials(acc_o, acc_lse, o_rest, lse_rest)
    torch.testing.assert_close(acc_o, o_all, **FP32_TOL)
    torch.testing.assert_close(acc_lse, lse_all, **FP32_TOL)


def test_write_kv_writes_real_rows_only() -> None:
    cache = torch.zeros(2, 4, 2, 1, 3)
    k = torch.arange(1.0, 13.0).view(4, 1, 3)  # rows 2 and 3 are padding
    write_kv(cache, k, -k, torch.tensor([5, 2]))
    flat = cache.flatten(1, 2)  # (2, 8 slots, 1, 3)
    assert torch.equal(flat[0, 5], k[0]) and torch.equal(flat[0, 2], k[1])
    assert torch.equal(flat[1, 5], -k[0]) and torch.equal(flat[1, 2], -k[1])
    assert torch.count_nonzero(cache) == 2 * 2 * 3  # the two real rows of K and V, nothing else
    with pytest.raises(ValueError):
        write_kv(cache, k[:1], k[:1], torch.tensor([1, 2]))


def test_gather_kv_follows_the_block_table() -> None:
    cache = torch.arange(2 * 5 * 4, dtype=torch.float32).view(2, 5, 4, 1, 1)
    k, v = gather_kv(cache, torch.tensor([3, 1, 0]), 0, 6)
    assert k.flatten().tolist() == [12, 13, 14, 15, 4, 5]
    assert v.flatten().tolist() == [32, 33, 34, 35, 24, 25]
    with pytest.raises(ValueError):
        gather_kv(cache, torch.tensor([3, 1, 0]), 2, 1)


def test_segment_size_must_be_a_multiple_of_block_size() -> None:
    case = make_case([1, 4], [40, 8], block_size=48, seg=512)
    with pytest.raises(ValueError, match="multiple of block_size"):
        SegmentedAttentionBackend().forward(case.q, case.k, case.v, case.cache, case.metadata, case.scale)


def test_get_attention_backend() -> None:
    assert get_attention_backend("segmented").name == "segmented"
    assert get_attention_backend("reference").name == "reference"
    with pytest.raises(ValueError, match="'flash'.*reference.*segmented"):
        get_attention_backend("flash")


@pytest.mark.parametrize(
    "qlens, priors", [([1], [700]), ([1, 1], [300, 1100]), ([130], [1030]), ([1, 60], [513, 1500])]
)
def test_consecutive_block_ids_read_the_cache_in_place(qlens, priors):
    """Consecutive block ids take the zero-copy view path; results equal the reference backend."""
    from segserve.attention.backends import get_attention_backend
    from segserve.attention.metadata import build_attention_metadata

    torch.manual_seed(3)
    bs, hq, hkv, d = 16, 9, 3, 64
    rows, next_id = [], 1
    for p, q in zip(priors, qlens, strict=True):
        n = -(-(p + q) // bs)
        rows.append(list(range(next_id, next_id + n)))
        next_id += n
    md = build_attention_metadata(qlens, priors, rows, bs, 128, 512)
    cache = torch.randn(2, next_id, bs, hkv, d)
    cache[:, 0] = 0
    t = sum(qlens)
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    ref = get_attention_backend("reference").forward(q, k, v, cache.clone(), md, d**-0.5)
    got = get_attention_backend("segmented").forward(q, k, v, cache.clone(), md, d**-0.5)
    assert (got - ref).abs().max().item() < 1e-5


# --- the seed's segment walk as a second oracle ---------------------------------------------------


@pytest.mark.parametrize("seg,block_size", [(512, 16), (1024, 128)])
@pytest.mark.parametrize("heads", [(9, 3), (4, 1), (4, 4)], ids=["gqa-3", "mqa", "mha"])
def test_segment_walk_agrees_with_sdpa_and_the_segmented_backend(seg, block_size, heads) -> None:
    """Priors 0, an exact multiple of the segment, a partial last segment, block-unaligned and short
    (``prior_kinds``), each as a decode and a chunk; FP32_TOL (observed <= 1e-6)."""
    query_lens, priors = mixed_batch(seg, block_size, seed=seg + heads[1])
    assert {0, 2 * seg, seg + seg // 2} <= set(priors)
    case = make_case(query_lens, priors, block_size=block_size, seg=seg, heads=heads, head_dim=32, pad=2,
                     seed=block_size)
    walk = walk_oracle(case, case.cache)
    torch.testing.assert_close(walk, sdpa_oracle(case, case.cache), **FP32_TOL)
    out = SegmentedAttentionBackend().forward(case.q, case.k, case.v, case.cache.clone(), case.metadata,
                                              case.scale)
    torch.testing.assert_close(out, walk, **FP32_TOL)


@pytest.mark.parametrize(
    "prior,walked",
    [
        (3584, [(0, 1024), (1024, 1024), (2048, 1024), (3072, 512)]),  # seed 000: 3 full + 512 valid
        (4096, [(0, 1024), (1024, 1024), (2048, 1024), (3072, 1024)]),  # exact multiple: no partial
        (0, []),  # nothing cached: the causal part alone
    ],
)
def test_segment_walk_reads_the_seed_segments(monkeypatch, prior, walked) -> None:
    reads = []

    def spy(kv_cache, block_row, start, num_tokens):
        reads.append((start, num_tokens))
        return gather_kv(kv_cache, block_row, start, num_tokens)

    monkeypatch.setattr(segment_walk, "gather_kv", spy)
    case = make_case([4], [prior], block_size=128, seg=1024, heads=(4, 1), head_dim=32, seed=prior)
    out = walk_oracle(case, case.cache)
    assert reads == walked
    torch.testing.assert_close(out, sdpa_oracle(case, case.cache), **FP32_TOL)


# --- the kernel runs the plan ----------------------------------------------------------------------


@pytest.mark.parametrize("consecutive", [False, True], ids=["shuffled", "consecutive"])
def test_backend_runs_the_plan_calls_and_copies_its_gathered_tokens(monkeypatch, consecutive) -> None:
    """Decodes with walks 5001, 2048, 2001, 101 (seg 1024, block 16) and a chunk over a 300-token
    prior: the backend's decode calls are exactly ``plan.decode_calls`` and its copies add up to
    ``plan.gathered_tokens``."""
    ran, copied = [], []
    real_call, real_copy = SegmentedAttentionBackend._decode_call, SegmentedAttentionBackend._copy_blocks

    def spy_call(self, qd, kv_cache, call, scale):
        ran.append(call.plan)
        return real_call(self, qd, kv_cache, call, scale)

    def spy_copy(self, kv_cache, kv_block_ids):
        copied.append(kv_block_ids.shape[0] // 2 * kv_cache.shape[2])
        return real_copy(self, kv_cache, kv_block_ids)

    monkeypatch.setattr(SegmentedAttentionBackend, "_decode_call", spy_call)
    monkeypatch.setattr(SegmentedAttentionBackend, "_copy_blocks", spy_copy)
    query_lens, priors = [1, 1, 5, 1, 1], [5000, 100, 300, 2000, 2047]
    case = make_case(query_lens, priors, block_size=16, seg=1024, heads=(4, 1), head_dim=32, seed=8,
                     consecutive_blocks=consecutive)
    out = SegmentedAttentionBackend().forward(case.q, case.k, case.v, case.cache.clone(), case.metadata,
                                              case.scale)
    torch.testing.assert_close(out, walk_oracle(case, case.cache), **FP32_TOL)
    rows = case.metadata.block_table.tolist()
    order, walks = plan.decode_order(query_lens, priors)
    assert (order, walks) == ([0, 4, 3, 1], [5001, 2048, 2001, 101])
    expected = plan.decode_calls(walks, [rows[i] for i in order], 16, 1024)
    assert ran == expected
    assert [(c.start, c.first, c.last, c.blocks) for c in ran] == [
        (0, 0, 4, 64), (1024, 0, 3, 64), (2048, 0, 1, 64), (3072, 0, 1, 64), (4096, 0, 1, 57)
    ]
    gathered = plan.gathered_tokens(query_lens, priors, rows, 16, 1024)
    # Shuffled: every call copies (4 + 3 + 1 + 1 decodes x 64 blocks, 1 x 57) and the chunk its 19
    # prior blocks, 16 tokens each. Consecutive: each request's blocks follow the previous one's,
    # so everything is read in place except the first segment of the 4 decodes (0 -> 4 -> 3 -> 1 is
    # not the allocation order 0, 1, 3, 4) and the second of 3.
    assert sum(copied) == gathered == (10432 if not consecutive else (4 * 64 + 3 * 64) * 16)
