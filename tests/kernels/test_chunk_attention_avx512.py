"""The AVX-512 BF16 form of the compiled chunk attention (``vdpbf16ps`` products, no AMX) against the
reference attention backend (``segserve.attention.reference``) in float32 on the same bfloat16 inputs.

Every test runs the form through ``chunk_attention.forced_avx512()``, so it is checked on every CPU the
compiled library loads on, AMX or not. Tolerance: that of tests/kernels/test_chunk_attention.py (P and the
output rounded to bfloat16: max |err| 2e-2, mean 2e-3 on unit-normal q, K, V).
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import at_thread_counts, chunk_tensors, make_case

from segserve.attention.kv_store import write_kv
from segserve.attention.reference import ReferenceAttentionBackend
from segserve.kernels import chunk_attention as ca
from segserve.kernels import cpu as cpu_kernels

with ca.forced_avx512():
    _READY = ca.available()
pytestmark = pytest.mark.skipif(
    not _READY, reason=f"chunk attention unavailable: {cpu_kernels.unavailable_reason() or 'switched off'}"
)
MAX_ABS_ERR = 2e-2
MEAN_ABS_ERR = 2e-3


@pytest.fixture(autouse=True)
def _avx512_form():
    with ca.forced_avx512():
        yield


def _kernel(case, seg: int) -> torch.Tensor:
    """The kernel's ``[T_padded, Hq, D]`` bfloat16 output (padding rows 0), the step's K/V written first."""
    md = case.metadata
    write_kv(case.cache, case.k, case.v, md.slot_mapping)
    out = torch.zeros_like(case.q)
    ca.chunk_attention(case.q, out, case.cache, md.block_table, *chunk_tensors(case), seg, case.scale)
    return out


def _reference(case) -> torch.Tensor:
    """The reference backend on float32 copies of the case's bfloat16 q, K, V and cache."""
    cache = case.cache.float()  # a copy: the kernel's cache stays as it is
    return ReferenceAttentionBackend().forward(
        case.q.float(), case.k.float(), case.v.float(), cache, case.metadata, case.scale
    )


def _check(query_lens, priors, *, seg=512, block_size=16, heads=(9, 3), head_dim=64, seed=0) -> None:
    case = make_case(query_lens, priors, block_size=block_size, seg=seg, heads=heads, head_dim=head_dim,
                     dtype=torch.bfloat16, seed=seed)
    assert ca.kind() == "avx512"
    expect = _reference(case)
    err = (_kernel(case, seg).float() - expect).abs()
    assert err.max() <= MAX_ABS_ERR, (err.max().item(), query_lens, priors)
    assert err.mean() <= MEAN_ABS_ERR, (err.mean().item(), query_lens, priors)


@pytest.mark.parametrize("qlen", [1, 2, 16, 17, 63, 129, 256, 257, 300])
@pytest.mark.parametrize("prior", [0, 17, 512, 1100])
def test_one_chunk_matches_the_reference(prior: int, qlen: int) -> None:
    """Priors of none, of part of a block, of one whole segment and of three segments (the last partial);
    query lengths across the 16-row tiles, the 32-key padding and the 256-token work items."""
    _check([qlen], [prior], seed=prior + qlen)


def test_a_step_of_chunks_over_many_small_segments_matches_the_reference() -> None:
    """All four priors in one call, walked in segments of 128 (11 for the longest chunk)."""
    _check([300, 1, 45, 128], [1100, 17, 0, 512], seg=128, seed=1)


@pytest.mark.parametrize(("block_size", "seg"), [(4, 512), (32, 1024)])
def test_other_block_and_segment_sizes_match_the_reference(block_size: int, seg: int) -> None:
    _check([70, 33], [1100, 512], seg=seg, block_size=block_size, seed=2)


@pytest.mark.parametrize(("heads", "head_dim"), [((4, 4), 64), ((8, 2), 128), ((6, 2), 32), ((16, 1), 96)])
def test_other_head_shapes_match_the_reference(heads: tuple[int, int], head_dim: int) -> None:
    """Dims of one, two, three and four 32-dim steps (the products' 32- and 64-dim register blocks), and
    GQA groups of 1 to 16 query heads."""
    _check([40, 7], [70, 300], heads=heads, head_dim=head_dim, seed=3)


def test_one_and_two_threads_give_the_same_bits() -> None:
    """A row's pairs are summed in one order whatever its register block or work item."""
    case = make_case([600, 37, 257], [300, 1029, 0], block_size=16, seg=512, dtype=torch.bfloat16, seed=8)
    one, two = at_thread_counts(lambda: _kernel(case, 512), 1, 2)
    assert torch.equal(one, two)
    assert torch.count_nonzero(one) > 0


def test_the_form_is_chosen_and_switched_alone() -> None:
    """Forced (this module's fixture), the form is the AVX-512 one; its switch turns it alone off (where
    AMX is ready the AMX form would run instead), and the kernel's switch turns both off."""
    assert ca.kind() == "avx512"
    old = ca.set_avx512_enabled(False)
    try:
        assert ca.kind() is None
    finally:
        ca.set_avx512_enabled(old)
    with ca.disabled():
        assert ca.kind() is None and not ca.available()
    assert ca.kind() == "avx512"
