"""The compiled chunk attention (``segserve.kernels.chunk_attention``) against SDPA in float32 on the
same bfloat16 inputs, and the segmented backend using it against its SDPA path: the AMX form on CPUs
with AMX, the AVX-512 BF16 form elsewhere (tests/kernels/test_chunk_attention_avx512.py checks that
form on every CPU against the reference backend).

Tolerance: the kernel rounds P to bfloat16 for the P V product and its output to bfloat16, so on
unit-normal q, K, V (outputs of magnitude up to ~1) the error is bfloat16 rounding: the output's own
rounding is up to 2^-9 relative (~4e-3 at 1), P's adds a few 1e-3. Observed max |err| over these cases:
7.8e-3 (mean 4e-4); bound 2e-2, as for PyTorch's own bfloat16 SDPA on the same inputs (observed 7.8e-3).
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (
    assert_other_requests_untouched,
    at_thread_counts,
    chunk_tensors,
    make_case,
    sdpa_oracle,
)

from segserve.attention.kv_store import write_kv
from segserve.attention.segmented import SegmentedAttentionBackend
from segserve.kernels import chunk_attention as ca
from segserve.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(
    not ca.available(),
    reason=f"chunk attention unavailable: {cpu_kernels.unavailable_reason() or 'switched off'}",
)
MAX_ABS_ERR = 2e-2
MEAN_ABS_ERR = 2e-3


def _run_kernel(case, seg: int | None = None) -> torch.Tensor:
    md = case.metadata
    write_kv(case.cache, case.k, case.v, md.slot_mapping)
    out = torch.zeros_like(case.q)
    ca.chunk_attention(case.q, out, case.cache, md.block_table, *chunk_tensors(case),
                       seg or md.kv_segment_size, case.scale)
    return out


def _check(query_lens, priors, *, block_size=16, seg=512, heads=(9, 3), head_dim=64, seed=0):
    case = make_case(query_lens, priors, block_size=block_size, seg=seg, heads=heads, head_dim=head_dim,
                     dtype=torch.bfloat16, seed=seed)
    expect = sdpa_oracle(case, case.cache.clone())
    got = _run_kernel(case).float()
    err = (got - expect).abs()
    assert err.max() <= MAX_ABS_ERR, (err.max().item(), query_lens, priors)
    assert err.mean() <= MEAN_ABS_ERR, (err.mean().item(), query_lens, priors)
    return err


@pytest.mark.parametrize("qlen", [1, 15, 16, 17, 512])
@pytest.mark.parametrize("prior", [0, 37, 1536])
def test_one_chunk_matches_float32_sdpa(qlen: int, prior: int) -> None:
    """Prior 0, one not a multiple of the block size, one spanning three 512-token segments."""
    _check([qlen], [prior])


def test_several_chunks_in_one_call() -> None:
    _check([17, 64, 1, 100], [1000, 0, 5, 513], seg=512)


def test_prior_over_several_segments_with_a_partial_last_one_and_small_blocks() -> None:
    _check([33], [1300], block_size=4, seg=512)
    _check([48], [2100], block_size=32, seg=1024)


@pytest.mark.parametrize(("heads", "head_dim"), [((4, 4), 64), ((8, 2), 128), ((6, 2), 32), ((16, 1), 96)])
def test_other_head_shapes(heads: tuple[int, int], head_dim: int) -> None:
    _check([40, 7], [70, 300], heads=heads, head_dim=head_dim)


def test_scores_growing_along_the_walk_move_the_running_max() -> None:
    """Keys 6x larger in the prior's second half: later blocks' scores exceed the running max by far
    more than the kernel's rescaling slack (2^8), so the running output is rescaled, not overflowed."""
    case = make_case([40], [1000], block_size=16, seg=512, dtype=torch.bfloat16, seed=5)
    row = case.metadata.block_table[0].tolist()
    for b in row[500 // 16 : 1000 // 16]:
        case.cache[0, b] *= 6
    expect = sdpa_oracle(case, case.cache.clone())
    got = _run_kernel(case).float()
    assert (got - expect).abs().max() <= MAX_ABS_ERR


def test_segment_size_changes_only_rounding() -> None:
    case = make_case([200], [1100], block_size=16, seg=512, dtype=torch.bfloat16, seed=4)
    a = _run_kernel(case, seg=512).float()
    b = _run_kernel(case, seg=64).float()
    assert (a - b).abs().max() <= 1.6e-2


def test_rows_of_other_requests_are_untouched() -> None:
    case = make_case([20, 30], [10, 40], block_size=16, seg=512, dtype=torch.bfloat16)
    assert_other_requests_untouched(case)


def test_backend_uses_it_and_matches_its_sdpa_path() -> None:
    """The segmented backend with kernels on (chunks through the C kernel, decodes through the decode
    kernel) against the same backend with kernels off (SDPA), on a mixed step."""
    case = make_case([300, 1, 45, 1], [700, 90, 0, 2000], block_size=16, seg=512, dtype=torch.bfloat16, pad=3)
    md = case.metadata
    fast = SegmentedAttentionBackend().forward(case.q, case.k, case.v, case.cache.clone(), md, case.scale)
    with cpu_kernels.disabled():
        slow = SegmentedAttentionBackend().forward(case.q, case.k, case.v, case.cache.clone(), md, case.scale)
    assert (fast.float() - slow.float()).abs().max() <= MAX_ABS_ERR
    assert torch.all(fast[-3:] == 0)  # padding rows


def test_bad_input_is_refused_with_the_limit_named() -> None:
    case = make_case([20], [10], block_size=16, seg=512, dtype=torch.bfloat16)
    md = case.metadata
    out = torch.zeros_like(case.q)
    args = chunk_tensors(case)
    with pytest.raises(ValueError, match="D % 32 == 0"):
        ca.chunk_attention(case.q.float(), out, case.cache, md.block_table, *args, 512, case.scale)
    with pytest.raises(ValueError, match="int64"):
        ca.chunk_attention(case.q, out, case.cache, md.block_table, args[0].int(), *args[1:], 512, case.scale)
    long = (args[0], args[1], torch.tensor([md.block_table.shape[1] * 16]), args[3])
    with pytest.raises(ValueError, match="past the block table's"):
        ca.chunk_attention(case.q, out, case.cache, md.block_table, *long, 512, case.scale)
    rows = (torch.tensor([5]), *args[1:])
    with pytest.raises(ValueError, match=r"outside \[0, 20\)"):
        ca.chunk_attention(case.q, out, case.cache, md.block_table, *rows, 512, case.scale)
    table = md.block_table.clone()
    table[0, 0] = case.cache.shape[1]
    with pytest.raises(ValueError, match="block id outside"):
        ca.chunk_attention(case.q, out, case.cache, table, *args, 512, case.scale)
    assert torch.count_nonzero(out) == 0
    assert not ca.supports(case.q.half(), case.cache.half())
    assert not ca.supports(case.q.float(), case.cache)  # mixed dtypes


def test_exp2_is_accurate_far_below_bfloat16_rounding() -> None:
    """The softmax's exp2 (degree-4 polynomial on [0, 1), scaled by 2^floor(x)): relative error under
    1e-5 against float64 (bfloat16's unit roundoff is 2^-9 ~ 2e-3; observed 3.0e-6), exact at integers
    (p(0) = 1), and 0 for the running max's start value (-1e30)."""
    x = torch.cat([torch.linspace(-120.0, 8.0, 200_003), torch.rand(50_000) - 0.5])
    got = ca._exp2(x).double()
    want = torch.exp2(x.double())
    assert ((got - want).abs() / want).max() <= 1e-5
    ints = torch.arange(-60, 9, dtype=torch.float32)
    assert torch.equal(ca._exp2(ints), torch.exp2(ints))
    assert torch.equal(ca._exp2(torch.tensor([-1e30, -1e30 - 3.0])), torch.zeros(2))


@pytest.mark.parametrize(("query_lens", "priors", "seed"), [([512], [1536], 0), ([300, 40], [700, 2000], 1)])
def test_error_stays_near_the_output_rounding(query_lens: list[int], priors: list[int], seed: int) -> None:
    """The mean error against the float32 oracle within 1.7x that of rounding the oracle itself to
    bfloat16 (the floor any bfloat16 output has). Observed 1.63x / 1.58x (a degree-3 exp gave the same;
    a degree-2 one, relative error ~2e-3, gives 2.16x / 2.06x)."""
    case = make_case(query_lens, priors, block_size=16, seg=512, dtype=torch.bfloat16, seed=seed)
    expect = sdpa_oracle(case, case.cache.clone())
    got = _run_kernel(case).float()
    floor = (expect.bfloat16().float() - expect).abs().mean()
    assert (got - expect).abs().mean() <= 1.7 * floor


def test_a_long_chunk_equals_its_rows_attended_16_at_a_time_bitwise() -> None:
    """A row's sums run over the same key blocks in the same order whatever work item (query tile of up
    to 256 tokens, each packing its K/V itself) it falls in: a 1,100-token chunk in one call and its rows
    16 at a time (one tile per KV head per call) give the same bits."""
    qlen = 1100
    case = make_case([qlen], [1000], block_size=16, seg=512, dtype=torch.bfloat16, seed=6)
    whole = _run_kernel(case)
    md = case.metadata
    pieces = torch.zeros_like(case.q)
    for r0 in range(0, qlen, 16):
        n = min(16, qlen - r0)
        ca.chunk_attention(case.q, pieces, case.cache, md.block_table, torch.tensor([r0]), torch.tensor([n]),
                           torch.tensor([1000 + r0]), torch.tensor([0]), 512, case.scale)
    assert torch.equal(whole[:qlen], pieces[:qlen])
    assert torch.count_nonzero(whole[:qlen]) > 0


def test_ragged_chunks_past_a_work_item_match_float32_sdpa() -> None:
    """Chunks one token past a 256-token work item (the last item holds one query tile), past two, and a
    short one, after priors that are not multiples of the block (16) or of the key block (128)."""
    _check([257, 513, 3], [45, 1029, 130])


def test_running_max_rising_block_after_block_matches_float32_sdpa() -> None:
    """Keys scaled up along the walk (1x at position 0 to 6x at the end): the running max rises past
    the rescaling slack in many later key blocks, where each row's maximum is taken in the same pass as
    its probabilities and a row that moves is done again."""
    case = make_case([300], [1500], block_size=16, seg=512, dtype=torch.bfloat16, seed=7)
    row = case.metadata.block_table[0].tolist()
    for i, b in enumerate(row[: 1500 // 16]):
        case.cache[0, b] *= 1.0 + 5.0 * i * 16 / 1500
    expect = sdpa_oracle(case, case.cache.clone())
    got = _run_kernel(case).float()
    err = (got - expect).abs()
    assert err.max() <= MAX_ABS_ERR
    assert err.mean() <= MEAN_ABS_ERR


@pytest.mark.parametrize(
    ("query_lens", "priors"), [([600, 37, 257], [300, 1029, 0]), ([1100], [0]), ([40], [70])]
)
def test_one_and_two_threads_give_the_same_bits(query_lens: list[int], priors: list[int]) -> None:
    """Work items split the queries, never a row's keys: 1 and 2 OpenMP threads give the same bits, also
    where they cut a small step into different work items (40 tokens: 32-token items at 1 thread,
    16-token ones at 2)."""
    case = make_case(query_lens, priors, block_size=16, seg=512, dtype=torch.bfloat16, seed=8)
    one, two = at_thread_counts(lambda: _run_kernel(case), 1, 2)
    n = sum(query_lens)
    assert torch.equal(one[:n], two[:n])
    assert torch.count_nonzero(one[:n]) > 0


def test_a_late_key_far_above_the_running_max_moves_it() -> None:
    """Keys from position 512 on have scores ~40x the first ones' (hundreds in log2 units above the
    running max that the first blocks set): a block whose every row sees all its keys takes the one-pass
    softmax, which must still find the rows whose max moves (P = 2^x would overflow float32 to inf
    otherwise) and redo them; the output matches float32 SDPA within the usual bounds."""
    case = make_case([64], [1024], block_size=16, seg=512, heads=(9, 3), head_dim=64, dtype=torch.bfloat16,
                     seed=3)
    row = case.metadata.block_table[0].tolist()
    case.cache[0, row[512 // 16 : 1024 // 16]] *= 40
    expect = sdpa_oracle(case, case.cache.clone())
    got = _run_kernel(case).float()
    assert torch.isfinite(got).all()
    err = (got - expect).abs()
    assert err.max() <= MAX_ABS_ERR and err.mean() <= MEAN_ABS_ERR, (err.max().item(), err.mean().item())
