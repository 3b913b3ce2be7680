"""The float32 form of the compiled chunk attention (``chunk_attention.kind(torch.float32) == "avx512f"``:
AVX-512F FMAs, float32 P, an exp2 to ~1 ulp) against float32 SDPA on the same float32 inputs, against a
float64 oracle, and the segmented backend using it for float32 caches; then the shapes it refuses.

Tolerance: nothing is rounded below float32, so on unit-normal q, K, V (outputs of magnitude up to ~1) the
error is float32 rounding. Observed max |err| against float32 SDPA over these cases: 7e-7 (mean 2.5e-8);
bound 2e-6 (mean 1e-7). The bfloat16 form's bound (tests/kernels/test_chunk_attention.py) is 2e-2: a
kernel that rounded P or the output to bfloat16 (mean error ~5e-5) fails every check here. The float32
engine's parity with transformers (tests/e2e/test_engine_parity.py, logprobs within 1e-4 after 30
layers, a 2,000-token prompt prefilled in 512-token chunks) runs through this form too.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import (
    assert_other_requests_untouched,
    at_thread_counts,
    chunk_tensors,
    contiguous_prior,
    make_case,
    sdpa_oracle,
)

from segserve.attention.kv_store import write_kv
from segserve.attention.segmented import SegmentedAttentionBackend
from segserve.kernels import chunk_attention as ca
from segserve.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(
    not ca.available(torch.float32),
    reason=f"chunk attention unavailable: {cpu_kernels.unavailable_reason() or 'switched off'}",
)
MAX_ABS_ERR = 2e-6
MEAN_ABS_ERR = 1e-7


def _case(query_lens, priors, *, block_size=16, seg=512, heads=(9, 3), head_dim=64, seed=0, pad=0):
    return make_case(query_lens, priors, block_size=block_size, seg=seg, heads=heads, head_dim=head_dim,
                     dtype=torch.float32, seed=seed, pad=pad)


def _run_kernel(case, seg: int | None = None) -> torch.Tensor:
    """The kernel's ``[T_padded, Hq, D]`` float32 output (rows it does not write stay 0), the step's K/V
    written to the cache first."""
    md = case.metadata
    write_kv(case.cache, case.k, case.v, md.slot_mapping)
    out = torch.zeros_like(case.q)
    ca.chunk_attention(case.q, out, case.cache, md.block_table, *chunk_tensors(case),
                       seg or md.kv_segment_size, case.scale)
    return out


def _check(query_lens, priors, **kwargs) -> torch.Tensor:
    case = _case(query_lens, priors, **kwargs)
    expect = sdpa_oracle(case, case.cache.clone())
    got = _run_kernel(case)
    assert got.dtype == torch.float32
    err = (got - expect).abs()
    assert err.max() <= MAX_ABS_ERR, (err.max().item(), query_lens, priors)
    assert err.mean() <= MEAN_ABS_ERR, (err.mean().item(), query_lens, priors)
    return err


def _oracle64(case, cache_before: torch.Tensor) -> torch.Tensor:
    """sdpa_oracle's attention in float64: ``[T_padded, Hq, D]`` float64, padding rows 0."""
    md = case.metadata
    out = torch.zeros(case.q.shape, dtype=torch.float64)
    qsl = md.query_start_loc_cpu
    for i, prior in enumerate(md.prior_tokens_cpu):
        r0, r1 = qsl[i], qsl[i + 1]
        pk, pv = contiguous_prior(cache_before, md.block_table[i].tolist(), prior)
        group = case.q.shape[1] // pk.shape[1]
        keys = torch.cat([pk, case.k[r0:r1]]).double().repeat_interleave(group, 1).transpose(0, 1)[None]
        values = torch.cat([pv, case.v[r0:r1]]).double().repeat_interleave(group, 1).transpose(0, 1)[None]
        query = case.q[r0:r1].double().transpose(0, 1)[None]
        visible = torch.ones(r1 - r0, prior + r1 - r0, dtype=torch.bool).tril(diagonal=prior)
        o = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=case.scale)
        out[r0:r1] = o[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("qlen", [1, 15, 16, 17, 129, 256, 257, 512])
@pytest.mark.parametrize("prior", [0, 37, 512, 1536])
def test_one_chunk_matches_float32_sdpa(prior: int, qlen: int) -> None:
    """Priors of none, of part of a block, of one whole segment and of three; query lengths across the
    16-row tiles, the 32-key padding and the 256-token work items (a chunk of one token too)."""
    _check([qlen], [prior], seed=prior + qlen)


def test_several_chunks_in_one_call_over_many_small_segments() -> None:
    _check([17, 64, 1, 100], [1000, 0, 5, 513], seg=512, seed=1)
    _check([300, 1, 45, 128], [1100, 17, 0, 512], seg=128, seed=2)


@pytest.mark.parametrize(("block_size", "seg"), [(4, 512), (32, 1024), (16, 64)])
def test_other_block_and_segment_sizes(block_size: int, seg: int) -> None:
    """Priors over several segments with a partial last one, blocks smaller and larger than 16."""
    _check([33, 70], [1300, 512], block_size=block_size, seg=seg, seed=3)


@pytest.mark.parametrize(
    ("heads", "head_dim"),
    [((4, 4), 64), ((8, 2), 128), ((6, 2), 32), ((16, 1), 96), ((4, 2), 16), ((3, 1), 48), ((2, 2), 80),
     ((2, 1), 112)],
)
def test_other_head_shapes(heads: tuple[int, int], head_dim: int) -> None:
    """Dims of one to eight 16-dim vectors (odd multiples of 16 end the P V blocks with one vector) and
    GQA groups of 1 to 16 query heads."""
    _check([40, 7], [70, 300], heads=heads, head_dim=head_dim, seed=4)


def test_ragged_chunks_past_a_work_item() -> None:
    """One token past a 256-token work item, past two, and a short chunk, after priors that are not
    multiples of the block (16) or of the key block (128)."""
    _check([257, 513, 3], [45, 1029, 130], seed=5)


@pytest.mark.parametrize(("query_lens", "priors", "seed"), [([512], [1536], 0), ([300, 40], [700, 2000], 1)])
def test_error_is_that_of_float32_sdpa_against_float64(query_lens, priors, seed) -> None:
    """Against a float64 oracle the kernel's mean error is within 3x float32 SDPA's own (observed 1.2-1.9x),
    its max under 1e-6 (observed 3.8e-7); rounding the float64 output to bfloat16 alone errs ~2000x more."""
    case = _case(query_lens, priors, seed=seed)
    before = case.cache.clone()
    exact = _oracle64(case, before)
    sdpa_err = (sdpa_oracle(case, before).double() - exact).abs()
    err = (_run_kernel(case).double() - exact).abs()
    assert err.mean() <= 3 * sdpa_err.mean(), (err.mean().item(), sdpa_err.mean().item())
    assert err.max() <= 1e-6
    assert (exact.bfloat16().double() - exact).abs().mean() > 100 * err.mean()


def _scaled_keys(kind: str):
    """A case whose later keys are larger: ``"rising"``, the prior's keys scaled 1x (position 0) to 6x (its
    end); ``"jump"``, keys 40x larger from position 512 on."""
    if kind == "rising":
        case = _case([300], [1500], seed=7)
        for i, b in enumerate(case.metadata.block_table[0].tolist()[: 1500 // 16]):
            case.cache[0, b] *= 1.0 + 5.0 * i * 16 / 1500
    else:
        case = _case([64], [1024], seed=3)
        case.cache[0, case.metadata.block_table[0].tolist()[512 // 16 : 1024 // 16]] *= 40
    return case


@pytest.mark.parametrize("kind", ["rising", "jump"])
def test_keys_growing_along_the_walk_move_the_running_max(kind: str) -> None:
    """Later blocks' scores exceed the running max by far more than the rescaling slack (2^8), also in
    blocks that take the one-pass softmax (P = 2^x would overflow to inf were a moving row not redone).
    Larger scores make any float32 softmax less exact (float32 SDPA errs up to 3.3e-5 here against
    float64), so the bound is float32 SDPA's own error: the kernel's max and mean within 2x of it
    (observed 1.0-1.1x)."""
    case = _scaled_keys(kind)
    before = case.cache.clone()
    exact = _oracle64(case, before)
    sdpa_err = (sdpa_oracle(case, before).double() - exact).abs()
    got = _run_kernel(case)
    assert torch.isfinite(got).all()
    err = (got.double() - exact).abs()
    assert err.max() <= 2 * sdpa_err.max(), (err.max().item(), sdpa_err.max().item())
    assert err.mean() <= 2 * sdpa_err.mean(), (err.mean().item(), sdpa_err.mean().item())


def test_segment_size_changes_only_rounding() -> None:
    case = _case([200], [1100], seed=4)
    a = _run_kernel(case, seg=512)
    b = _run_kernel(case, seg=64)
    assert (a - b).abs().max() <= 1e-6


def test_rows_of_other_requests_are_untouched() -> None:
    case = _case([20, 30], [10, 40])
    assert_other_requests_untouched(case)


def test_a_long_chunk_equals_its_rows_attended_16_at_a_time_bitwise() -> None:
    """A row's sums run in one order whatever work item (query tile, register block) it falls in."""
    qlen = 1100
    case = _case([qlen], [1000], seed=6)
    whole = _run_kernel(case)
    md = case.metadata
    pieces = torch.zeros_like(case.q)
    for r0 in range(0, qlen, 16):
        n = min(16, qlen - r0)
        ca.chunk_attention(case.q, pieces, case.cache, md.block_table, torch.tensor([r0]), torch.tensor([n]),
                           torch.tensor([1000 + r0]), torch.tensor([0]), 512, case.scale)
    assert torch.equal(whole[:qlen], pieces[:qlen])
    assert torch.count_nonzero(whole[:qlen]) > 0


@pytest.mark.parametrize(
    ("query_lens", "priors"), [([600, 37, 257], [300, 1029, 0]), ([1100], [0]), ([40], [70])]
)
def test_one_and_two_threads_give_the_same_bits(query_lens: list[int], priors: list[int]) -> None:
    case = _case(query_lens, priors, seed=8)
    one, two = at_thread_counts(lambda: _run_kernel(case), 1, 2)
    n = sum(query_lens)
    assert torch.equal(one[:n], two[:n])
    assert torch.count_nonzero(one[:n]) > 0


def test_backend_uses_it_for_float32_and_matches_its_sdpa_path(monkeypatch) -> None:
    """The segmented backend on a float32 cache: a mixed step (chunks, decodes, padding rows) goes
    through the kernel once (counted) and matches the same backend with the chunk kernel off (SDPA
    chunks, which never call it)."""
    calls = []
    kernel = ca.chunk_attention

    def counted(q, *args, **kwargs):
        calls.append(q.dtype)
        return kernel(q, *args, **kwargs)

    monkeypatch.setattr(ca, "chunk_attention", counted)
    case = _case([300, 1, 45, 1], [700, 90, 0, 2000], pad=3)
    md = case.metadata
    fast = SegmentedAttentionBackend().forward(case.q, case.k, case.v, case.cache.clone(), md, case.scale)
    assert calls == [torch.float32]
    with ca.disabled():
        slow = SegmentedAttentionBackend().forward(case.q, case.k, case.v, case.cache.clone(), md, case.scale)
    assert calls == [torch.float32]
    assert fast.dtype == torch.float32
    err = (fast - slow).abs()
    assert err.max() <= MAX_ABS_ERR and err.mean() <= MEAN_ABS_ERR, (err.max().item(), err.mean().item())
    assert torch.all(fast[-3:] == 0)  # padding rows


def test_exp2_is_accurate_to_about_one_ulp() -> None:
    """The float32 softmax's exp2 (degree-6 polynomial on [0, 1), scaled by 2^floor(x)): within 1.5 float32
    ulps of float64's 2^x over the range the softmax feeds it (observed ~1.06), exact at integers, and 0
    for the running max's start value (-1e30). The bfloat16 form's exp2 errs by tens of ulps: it would
    fail this bound."""
    x = torch.cat([torch.linspace(-120.0, 8.0, 200_003), torch.rand(50_000) - 0.5, torch.rand(50_000) * 8])
    want = torch.exp2(x.double())
    ulp = (torch.nextafter(want.float(), torch.tensor(float("inf"))) - want.float()).double()

    def ulps(y):
        return ((y.double() - want).abs() / ulp).max().item()

    assert ulps(ca._exp2(x, torch.float32)) <= 1.5
    assert ulps(ca._exp2(x, torch.bfloat16)) > 10
    ints = torch.arange(-60, 9, dtype=torch.float32)
    assert torch.equal(ca._exp2(ints, torch.float32), torch.exp2(ints))
    assert torch.equal(ca._exp2(torch.tensor([-1e30, -1e30 - 3.0]), torch.float32), torch.zeros(2))


def test_form_and_switch() -> None:
    """float32 runs the AVX-512F form whatever the AVX-512 BF16 form's switch says; the kernel's own
    switch turns it off (supports() then refuses, and the backend keeps SDPA); other dtypes have none."""
    case = _case([20], [10])
    assert ca.kind(torch.float32) == "avx512f" and ca.supports(case.q, case.cache)
    old = ca.set_avx512_enabled(False)
    try:
        assert ca.kind(torch.float32) == "avx512f"
    finally:
        ca.set_avx512_enabled(old)
    with ca.disabled():
        assert ca.kind(torch.float32) is None and not ca.supports(case.q, case.cache)
    assert ca.kind(torch.float16) is None and ca.kind(torch.float64) is None


@pytest.mark.parametrize(
    ("heads", "head_dim", "q_dtype", "cache_dtype"),
    [
        ((4, 2), 8, torch.float32, torch.float32),  # D not a multiple of 16
        ((4, 2), 24, torch.float32, torch.float32),
        ((4, 2), 144, torch.float32, torch.float32),  # D past 128
        ((17, 1), 64, torch.float32, torch.float32),  # 17 query heads per KV head
        ((4, 2), 64, torch.float16, torch.float16),
        ((4, 2), 64, torch.float64, torch.float64),
        ((4, 2), 64, torch.float32, torch.bfloat16),  # q and cache of different dtypes
        ((4, 2), 48, torch.bfloat16, torch.bfloat16),  # 48: float32's multiple of 16, not bfloat16's 32
    ],
)
def test_shapes_it_does_not_take_are_refused(heads, head_dim, q_dtype, cache_dtype) -> None:
    """supports() is False (the backend keeps SDPA) and chunk_attention raises ValueError naming the limits,
    writing nothing."""
    case = _case([20], [10], heads=heads, head_dim=head_dim)
    q, cache = case.q.to(q_dtype), case.cache.to(cache_dtype)
    assert not ca.supports(q, cache)
    out = torch.zeros_like(q)
    with pytest.raises(ValueError, match=r"D % 16 == 0 \(float32\), D <= 128, Hq a multiple of Hkv up to 16"):
        ca.chunk_attention(q, out, cache, case.metadata.block_table, *chunk_tensors(case), 512, case.scale)
    assert torch.count_nonzero(out) == 0


def test_the_library_refuses_float32_with_another_isa_or_head_dim() -> None:
    """The C entry point's own checks (the wrapper's are above): dt float32 with a bfloat16 isa, or a head
    dim not a multiple of 16, or an unknown dt, is CA_ERR_SHAPE (-1), with nothing written."""
    case = _case([20], [10], heads=(2, 1), head_dim=64)
    md = case.metadata
    write_kv(case.cache, case.k, case.v, md.slot_mapping)
    out = torch.zeros_like(case.q)
    keep = chunk_tensors(case)
    starts, lens, priors, reqs = keep

    def call(**over):
        fields = dict(
            size=ca._ChunkAttentionArgs.SIZE, dt=2, isa=3, n=1, Hq=2, Hkv=1, D=64, q=case.q.data_ptr(),
            ldq=case.q.stride(0), out=out.data_ptr(), T=case.q.shape[0], starts=starts.data_ptr(),
            qlens=lens.data_ptr(), priors=priors.data_ptr(), reqs=reqs.data_ptr(),
            cache=case.cache.data_ptr(), num_blocks=case.cache.shape[1], block_size=16,
            block_table=md.block_table.data_ptr(), B=1, ld_bt=md.block_table.shape[1], seg=512,
            scale=case.scale,
        )
        fields.update(over)
        return ca._library().sg_chunk_attention(ctypes.byref(ca._ChunkAttentionArgs(**fields)))

    for over in (dict(isa=1), dict(isa=2), dict(dt=1, isa=3), dict(D=56), dict(dt=3)):
        assert call(**over) == -1, over
    assert torch.count_nonzero(out) == 0
    assert call() == 0 and torch.count_nonzero(out[:20]) > 0  # the same arguments, as they should be
