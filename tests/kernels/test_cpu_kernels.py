"""The compiled CPU kernels (segserve/kernels) against the eager PyTorch ops they replace.

Tolerances: float32 linears agree with ``F.linear`` within 1e-5 (summation order only; observed
<= 2e-6); bfloat16 linears within one bfloat16 ulp of the float32 product of the same inputs (rtol
2**-7), RMSNorm and RoPE are bitwise the eager result in float32 (RoPE also in bfloat16). Attention
uses the tolerances of test_attention.py against the same SDPA oracle and the seed's segment walk.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import make_case, sdpa_oracle, walk_oracle

from segserve.attention.kv_store import write_kv
from segserve.attention.segmented import SegmentedAttentionBackend
from segserve.kernels import build
from segserve.kernels import cpu as cpu_kernels
from segserve.models.llama import LlamaConfig, RMSNorm, apply_rope, rope_table

FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
BF16_ULP = {"atol": 1e-3, "rtol": 2**-7}
ATTN_BF16_TOL = {"atol": 2e-2, "rtol": 0.0}
CPU_READY = all(flag in build._cpu_flags() for flag in build.REQUIRED_CPU_FLAGS)

pytestmark = pytest.mark.skipif(not CPU_READY, reason="CPU lacks AVX-512F / AVX-512 BF16")


@pytest.fixture(autouse=True)
def kernels_on():
    old = cpu_kernels.set_enabled(True)
    yield
    cpu_kernels.set_enabled(old)


def test_kernels_build_and_load_on_this_cpu() -> None:
    assert cpu_kernels.enabled(), cpu_kernels.unavailable_reason()
    with cpu_kernels.disabled():
        assert not cpu_kernels.enabled()
        assert "switched off" in cpu_kernels.unavailable_reason()
    assert cpu_kernels.enabled()


# --- linear ---------------------------------------------------------------------------------------


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (0.05 * torch.randn(n, k, generator=gen)).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    return x, w, b


@pytest.mark.parametrize("m", [1, 3, 4, 5, 8])
def test_linear_float32_matches_f_linear(m: int) -> None:
    x, w, b = _inputs(m, 964, 576, torch.float32, seed=m)
    torch.testing.assert_close(cpu_kernels.linear(x, w, b), F.linear(x, w, b), **FP32_TOL)
    torch.testing.assert_close(cpu_kernels.linear(x, w), F.linear(x, w), **FP32_TOL)


@pytest.mark.parametrize("m", [1, 2, 5])
def test_linear_bfloat16_within_one_ulp_of_the_float32_product(m: int) -> None:
    x, w, b = _inputs(m, 512, 1536, torch.bfloat16, seed=m)
    y = cpu_kernels.linear(x, w, b)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float(), b.float()), **BF16_ULP)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_prologue_is_the_eager_norm_then_the_linear(dtype: torch.dtype) -> None:
    x, w, _ = _inputs(3, 256, 576, dtype, seed=4)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = (1 + 0.1 * torch.randn(576)).to(dtype)
    y = cpu_kernels.linear(x, w, prologue="rmsnorm", norm_weight=norm.weight.data, eps=1e-5)
    with torch.no_grad():
        ref = F.linear(norm(x).float(), w.float())
    # bfloat16: a normed input may round to the neighbouring value (norm summation order)
    tol = FP32_TOL if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2**-6}
    torch.testing.assert_close(y.float(), ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_prologue_with_residual_add_is_swiglu_down_plus_h(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    gate_up = torch.randn(2, 2 * 96, generator=gen).to(dtype)
    w = (0.1 * torch.randn(64, 96, generator=gen)).to(dtype)
    h = torch.randn(2, 64, generator=gen).to(dtype)
    h0 = h.clone()
    out = cpu_kernels.linear(gate_up, w, prologue="silu_mul", residual=h)
    assert out is h
    gate, up = gate_up.split(96, dim=-1)
    ref = h0 + F.linear(F.silu(gate) * up, w)  # the eager rounding points: silu, mul, linear, add
    torch.testing.assert_close(h.float(), ref.float(), **(FP32_TOL if dtype == torch.float32 else BF16_ULP))


def test_float32_logits_of_a_bfloat16_linear_are_its_rounded_products() -> None:
    x, w, _ = _inputs(2, 300, 64, torch.bfloat16, seed=6)
    logits = cpu_kernels.linear(x, w, out_dtype=torch.float32)
    assert logits.dtype == torch.float32
    # Rounded to bf16 first, as F.linear(x, w).float() is.
    assert torch.equal(logits, logits.to(torch.bfloat16).float())
    torch.testing.assert_close(logits, F.linear(x.float(), w.float()), **BF16_ULP)


def test_linear_rejects_what_the_kernel_cannot_take() -> None:
    x, w, _ = _inputs(2, 64, 64, torch.float32)
    with pytest.raises(ValueError, match=r"K % 32 == 0 and N % 4 == 0"):
        cpu_kernels.linear(x[:, :40].contiguous(), w[:, :40].contiguous())
    with pytest.raises(ValueError, match=r"x must be \(M, 64\) torch.float32"):
        cpu_kernels.linear(x.to(torch.bfloat16), w)
    with pytest.raises(ValueError, match=r"x must be \(M, 128\)"):
        cpu_kernels.linear(x, w, prologue="silu_mul")
    with pytest.raises(ValueError, match=r"rmsnorm needs a contiguous \(64,\)"):
        cpu_kernels.linear(x, w, prologue="rmsnorm")
    with pytest.raises(ValueError, match=r"residual must be a contiguous \(2, 64\)"):
        cpu_kernels.linear(x, w, residual=torch.zeros(3, 64))
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU tensor, got torch.float16"):
        cpu_kernels.linear(x.half(), w.half())
    assert not cpu_kernels.supports_linear(w[:, :40])  # callers ask first; this never raises


# --- RoPE and KV writes ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_is_bitwise_the_eager_rotation(dtype: torch.dtype) -> None:
    cfg = LlamaConfig(vocab_size=8, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    cos, sin = rope_table(cfg)
    pos = torch.tensor([0, 1, 77, 4095, 2048])
    qkv = torch.randn(5, 8 * 64, generator=torch.Generator().manual_seed(7)).to(dtype)  # 4 q, 2 k, 2 v heads
    ref = apply_rope(qkv.view(5, 8, 64)[:, :6], cos[pos][:, None].to(dtype), sin[pos][:, None].to(dtype))
    x = qkv.clone()
    cpu_kernels.rope_(x, 6, 64, cos[pos], sin[pos])
    assert torch.equal(x.view(5, 8, 64)[:, :6], ref)
    assert torch.equal(x.view(5, 8, 64)[:, 6:], qkv.view(5, 8, 64)[:, 6:])  # V heads untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 48, 96, 128])  # 48: not a multiple of 32, the scalar loop
def test_rope_many_rows_bitwise_with_subnormals_and_extremes(dtype: torch.dtype, head_dim: int) -> None:
    """The vector loop (head dims a multiple of 32), over enough rows for the threaded loop, equals the
    eager rotation bit for bit, subnormal and huge inputs included (vcvtneps2bf16 would flush the
    former)."""
    cfg = LlamaConfig(vocab_size=8, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                      max_position_embeddings=8192)
    cos, sin = rope_table(cfg)
    t = 37
    pos = torch.randint(0, 8192, (t,), generator=torch.Generator().manual_seed(3))
    qkv = torch.randn(t, 8 * head_dim, generator=torch.Generator().manual_seed(8))
    qkv[0, :head_dim] = 1e-39  # float32 subnormals, which bfloat16 keeps too
    qkv[1, :head_dim] = -3e38
    qkv[2, : 2 * head_dim] *= 1e-36  # products land among the subnormals
    qkv = qkv.to(dtype)
    c, s = cos[pos][:, None].to(dtype), sin[pos][:, None].to(dtype)
    ref = apply_rope(qkv.view(t, 8, head_dim)[:, :6], c, s)
    x = qkv.clone()
    cpu_kernels.rope_(x, 6, head_dim, cos[pos], sin[pos])
    got = x.view(t, 8, head_dim)[:, :6]
    assert torch.equal(got, ref)
    assert (got[2] != 0).any() and (got[2].abs() < 1.2e-38).any()  # subnormal results survived
    assert torch.equal(x.view(t, 8, head_dim)[:, 6:], qkv.view(t, 8, head_dim)[:, 6:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_the_eager_index_copy(dtype: torch.dtype) -> None:
    case = make_case([5, 1, 3], [0, 17, 40], block_size=16, seg=512, pad=2, seed=8, dtype=dtype)
    compiled, eager = case.cache.clone(), case.cache.clone()
    write_kv(compiled, case.k, case.v, case.metadata.slot_mapping)
    with cpu_kernels.disabled():
        write_kv(eager, case.k, case.v, case.metadata.slot_mapping)
    assert torch.equal(compiled, eager)
    assert not torch.equal(compiled, case.cache)


def test_write_kv_with_a_bad_slot_raises_and_writes_nothing() -> None:
    case = make_case([4], [0], block_size=16, seg=512, seed=9)
    cache = case.cache.clone()
    slots = case.metadata.slot_mapping.clone()
    slots[2] = cache.shape[1] * cache.shape[2]  # one past the last slot
    limit = cache.shape[1] * cache.shape[2]
    with pytest.raises(ValueError, match=rf"outside \[0, {limit}\)"):
        cpu_kernels.write_kv(cache, case.k, case.v, slots)
    assert torch.equal(cache, case.cache)  # rows 0-1 (valid slots) were not written either


# --- decode attention -----------------------------------------------------------------------------

SEGMENTS_AND_BLOCKS = [(512, 16), (1024, 64), (2048, 128), (4096, 16)]


def _mixed(seg: int, block_size: int) -> tuple[list[int], list[int]]:
    """Decodes and chunks over empty, exact-segment, partial-segment, block-unaligned and short priors."""
    priors = [0, 2 * seg, seg + seg // 2, seg + 3 * block_size + 5, block_size + 1]
    return [1, 7] * len(priors), [p for p in priors for _ in (0, 1)]


@pytest.mark.parametrize("seg,block_size", SEGMENTS_AND_BLOCKS)
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((4, 1), 32), ((16, 1), 128)])
def test_backend_with_compiled_decodes_matches_sdpa(seg, block_size, heads, head_dim) -> None:
    query_lens, priors = _mixed(seg, block_size)
    case = make_case(query_lens, priors, block_size=block_size, seg=seg, heads=heads, head_dim=head_dim,
                     pad=3, seed=seg + block_size)
    cache = case.cache.clone()
    out = SegmentedAttentionBackend().forward(case.q, case.k, case.v, cache, case.metadata, case.scale)
    t = case.metadata.num_actual_tokens
    torch.testing.assert_close(out, sdpa_oracle(case, case.cache), **FP32_TOL)
    assert torch.count_nonzero(out[t:]) == 0  # padding rows


@pytest.mark.parametrize("priors", [[700], [2100, 900, 40], [40, 2100, 900]])
def test_decode_only_steps_bfloat16_match_sdpa(priors: list[int]) -> None:
    case = make_case([1] * len(priors), priors, block_size=16, seg=512, dtype=torch.bfloat16, seed=10)
    out = SegmentedAttentionBackend().forward(case.q, case.k, case.v, case.cache.clone(), case.metadata,
                                              case.scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), sdpa_oracle(case, case.cache), **ATTN_BF16_TOL)


def test_compiled_decodes_equal_the_eager_kernel_on_the_seed_example() -> None:
    """Seed 000, "Partial KV Segment Handling": a prior of 3584 in segments of 1024 (3 full + 512)."""
    case = make_case([1], [3584], block_size=128, seg=1024, seed=11)
    compiled = SegmentedAttentionBackend().forward(case.q, case.k, case.v, case.cache.clone(), case.metadata,
                                                   case.scale)
    with cpu_kernels.disabled():
        eager = SegmentedAttentionBackend().forward(case.q, case.k, case.v, case.cache.clone(), case.metadata,
                                                    case.scale)
    torch.testing.assert_close(compiled, eager, **FP32_TOL)


@pytest.mark.parametrize("seg,block_size", [(512, 16), (2048, 128)])
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((4, 1), 32)], ids=["gqa-3", "mqa"])
def test_compiled_backend_and_c_decode_kernel_agree_with_segment_walk(seg, block_size, heads, head_dim):
    """Priors 0, an exact multiple of the segment, a partial last segment, block-unaligned and short
    (``_mixed``): the backend with the compiled decodes, and ``decode_attention`` alone on the decodes,
    equal the seed's walk within FP32_TOL."""
    query_lens, priors = _mixed(seg, block_size)
    case = make_case(query_lens, priors, block_size=block_size, seg=seg, heads=heads, head_dim=head_dim,
                     pad=3, seed=seg + heads[1])
    walk = walk_oracle(case, case.cache)
    cache = case.cache.clone()
    out = SegmentedAttentionBackend().forward(case.q, case.k, case.v, cache, case.metadata, case.scale)
    torch.testing.assert_close(out, walk, **FP32_TOL)
    md = case.metadata
    decodes = [i for i, n in enumerate(query_lens) if n == 1]
    rows = torch.tensor([md.query_start_loc_cpu[i] for i in decodes])
    direct = torch.zeros_like(case.q)
    cpu_kernels.decode_attention(case.q, direct, rows, cache, md.block_table, torch.tensor(decodes),
                                 torch.tensor([priors[i] + 1 for i in decodes]), seg, case.scale)
    torch.testing.assert_close(direct[rows], walk[rows], **FP32_TOL)


@pytest.mark.parametrize("priors", [[0], [130, 40]])
def test_c_decode_kernel_splitting_short_segments_agrees_with_segment_walk(priors: list[int]) -> None:
    """Few decodes over short contexts: the C code halves the 512-token segment (down to 64 tokens)
    to keep threads busy; the answer is still the walk in 512-token segments."""
    case = make_case([1] * len(priors), priors, block_size=16, seg=512, heads=(4, 1), head_dim=32, seed=15)
    cache = case.cache.clone()
    write_kv(cache, case.k, case.v, case.metadata.slot_mapping)
    n = len(priors)
    out = torch.zeros_like(case.q)
    cpu_kernels.decode_attention(case.q, out, torch.arange(n), cache, case.metadata.block_table,
                                 torch.arange(n), case.metadata.seq_lens.long(), 512, case.scale)
    torch.testing.assert_close(out, walk_oracle(case, case.cache), **FP32_TOL)


def test_decode_attention_rejects_a_length_past_the_block_table() -> None:
    case = make_case([1], [40], block_size=16, seg=512, seed=12)
    md = case.metadata
    out = torch.zeros_like(case.q)
    too_long = md.block_table.shape[1] * 16 + 1
    args = (case.q, out, torch.tensor([0]), case.cache, md.block_table, torch.tensor([0]))
    with pytest.raises(ValueError, match=rf"outside \[1, {too_long - 1}\]"):
        cpu_kernels.decode_attention(*args, torch.tensor([too_long]), 512, case.scale)
    with pytest.raises(ValueError, match=r"outside \[1, "):
        cpu_kernels.decode_attention(*args, torch.tensor([0]), 512, case.scale)
    with pytest.raises(ValueError, match="block_table must be a contiguous 2-D int32"):
        cpu_kernels.decode_attention(*args[:4], md.block_table.long(), args[5], torch.tensor([41]), 512, 1.0)
    with pytest.raises(ValueError, match=r"row is outside \[0, 1\) or its table row outside \[0, 1\)"):
        cpu_kernels.decode_attention(case.q, out, torch.tensor([1]), *args[3:5], torch.tensor([0]),
                                     torch.tensor([41]), 512, 1.0)
    with pytest.raises(ValueError, match=r"row is outside"):
        cpu_kernels.decode_attention(*args[:5], torch.tensor([3]), torch.tensor([41]), 512, 1.0)
    table = md.block_table.clone()
    table[0, 1] = case.cache.shape[1]  # one past the last block: would read past the cache
    with pytest.raises(ValueError, match=rf"block id outside \[1, {case.cache.shape[1]}\)"):
        cpu_kernels.decode_attention(*args[:4], table, args[5], torch.tensor([41]), 512, 1.0)
    assert torch.count_nonzero(out) == 0


# --- build ----------------------------------------------------------------------------------------


def _probe(env: dict[str, str]) -> str:
    code = ("import torch\nfrom segserve.kernels import cpu\n"
            "print(cpu.enabled(), cpu.unavailable_reason())")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def _copy_of_this_process_library(dest: Path) -> Path:
    """The kernel library this process loaded, with its digest, copied into ``dest``: a probe pointed
    there finds it intact and builds nothing (a build takes ~25 s here)."""
    assert cpu_kernels.enabled(), cpu_kernels.unavailable_reason()
    src = Path(build._loaded._name)
    lib = dest / src.name
    lib.write_bytes(src.read_bytes())
    build._digest_path(lib).write_bytes(build._digest_path(src).read_bytes())
    return lib


def test_an_intact_cached_library_is_loaded_as_is_and_a_missing_compiler_falls_back(tmp_path: Path) -> None:
    lib = _copy_of_this_process_library(tmp_path)
    before = lib.stat().st_mtime_ns
    assert _probe({"SEGSERVE_KERNEL_DIR": str(tmp_path)}) == "True None"
    assert lib.stat().st_mtime_ns == before and len(list(tmp_path.glob("segserve_cpu_*.so"))) == 1
    out = _probe({"SEGSERVE_KERNEL_DIR": str(tmp_path / "other"), "CC": "/nonexistent/cc"})
    assert out.startswith("False no C compiler (/nonexistent/cc)")
    assert _probe({"SEGSERVE_CPU_KERNELS": "0"}).startswith("False switched off")


# --- bad input found by a fresh user (each once read or wrote outside a tensor, or crashed) ----------


def test_caches_the_c_code_cannot_index_are_refused() -> None:
    one_half = torch.zeros(4 * 16 * 16 + 4096)[:1024].view(1, 4, 16, 1, 16)  # no V half: V writes overran
    expanded = torch.zeros(16).view(1, 1, 1, 1, 16).expand(2, 4, 16, 1, 16)  # stride 0
    permuted = torch.zeros(2, 4, 16, 16, 2).transpose(3, 4)  # [2, 4, 16, 2, 16], heads interleaved
    for cache in (one_half, expanded, permuted):
        hkv = cache.shape[3]
        k = v = torch.ones(1, hkv, 16)
        with pytest.raises(ValueError, match=r"kv_cache must be a contiguous \[2, num_blocks"):
            cpu_kernels.write_kv(cache, k, v, torch.tensor([3]))
        q = torch.zeros(1, hkv, 16)
        table = torch.tensor([[1]], dtype=torch.int32)
        with pytest.raises(ValueError, match=r"kv_cache must be a contiguous \[2, num_blocks"):
            cpu_kernels.decode_attention(q, q.clone(), torch.tensor([0]), cache, table, torch.tensor([0]),
                                         torch.tensor([4]), 512, 1.0)
    assert not cpu_kernels.supports_cache(one_half, torch.float32)
    assert not cpu_kernels.supports_cache(torch.zeros(2, 4, 16, 1, 16), torch.float32, num_heads=17)


def test_a_huge_segment_size_is_bounded_by_the_longest_decode() -> None:
    case = make_case([1] * 4, [47] * 4, block_size=16, seg=512, heads=(4, 1), seed=13)
    md = case.metadata
    args = (case.q, torch.tensor([0, 1, 2, 3]), case.cache, md.block_table, torch.arange(4),
            md.seq_lens.long())
    normal, huge = torch.zeros_like(case.q), torch.zeros_like(case.q)
    cpu_kernels.decode_attention(args[0], normal, *args[1:], 512, case.scale)
    cpu_kernels.decode_attention(args[0], huge, *args[1:], 2**62, case.scale)  # overflowed a malloc size
    assert torch.equal(normal, huge)
    with pytest.raises(ValueError, match="kv_segment_size >= 1, got .*, 0"):
        cpu_kernels.decode_attention(args[0], huge, *args[1:], 0, case.scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_does_not_depend_on_the_split(dtype: torch.dtype) -> None:
    """Segments of 64 .. 1024 tokens (and the C code's own halving below them) against one segment per
    decode: the log-sum-exp merge is exact, so only float32 summation order moves. Observed 2.6e-7 in
    float32 (outputs up to 0.7) and a relative 0.0072 in bfloat16 (one ulp is 2**-8 .. 2**-7)."""
    case = make_case([1, 1, 1], [1500, 700, 64], block_size=16, seg=512, dtype=dtype, seed=15)
    md = case.metadata
    tol = {"atol": 1e-6, "rtol": 0.0} if dtype == torch.float32 else {"atol": 1e-6, "rtol": 2**-7}

    def attend(seg: int) -> torch.Tensor:
        out = torch.zeros_like(case.q)
        rows = torch.arange(3)
        lens = md.seq_lens.long()
        cpu_kernels.decode_attention(case.q, out, rows, case.cache, md.block_table, rows, lens, seg,
                                     case.scale)
        return out

    whole = attend(4096)
    for seg in (64, 100, 333, 512, 1024):
        split = attend(seg)
        if dtype == torch.float32:
            assert not torch.equal(split, whole)  # the split did move the summation order
        torch.testing.assert_close(split, whole, **tol)


@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((8, 2), 128), ((24, 8), 32), ((48, 3), 32)],
                         ids=["g3-d64", "g4-d128", "g3-d32-8kv", "48-heads"])
def test_many_bfloat16_decodes_equal_the_same_decodes_one_by_one(heads, head_dim) -> None:
    """40 decodes (120+ work items: enough on up to 10 threads for the C code to give a segment's KV
    heads to one thread) read a bfloat16 cache a row of all heads at a time (segment_rows_bf16); one
    decode alone reads it head by head (segment_partial). The same products in the same order, so the
    same bits, for G and D with a compiled case and without (D = 32), and past MAX_ROW_HEADS (48 query
    heads: head by head in both). kv_segment_size 64 keeps the split the same for one decode as for 40."""
    gen = torch.Generator().manual_seed(23)
    priors = torch.randint(0, 300, (40,), generator=gen).tolist()
    case = make_case([1] * 40, priors, block_size=16, seg=64, heads=heads, head_dim=head_dim,
                     dtype=torch.bfloat16, seed=24)
    md = case.metadata
    write_kv(case.cache, case.k, case.v, md.slot_mapping)
    lens, rows = md.seq_lens.long(), torch.arange(40)
    batch = torch.zeros_like(case.q)
    cpu_kernels.decode_attention(case.q, batch, rows, case.cache, md.block_table, rows, lens, 64, case.scale)
    alone = torch.zeros_like(case.q)
    for j in range(40):
        one = rows[j : j + 1]
        cpu_kernels.decode_attention(case.q, alone, one, case.cache, md.block_table, one, lens[j : j + 1], 64,
                                     case.scale)
    assert torch.equal(batch, alone)
    torch.testing.assert_close(batch.float(), sdpa_oracle(case, case.cache).float(), **ATTN_BF16_TOL)


@pytest.mark.parametrize("prior", [256, 600, 40])
def test_one_decode_split_into_equal_segments_equals_sdpa(prior: int) -> None:
    """A single decode's context is cut into equal segments (257 tokens: 129 + 128, not 256 + 1):
    float32 within summation order of SDPA on the same cache, for lengths that split and one that
    does not."""
    case = make_case([1], [prior], block_size=16, seg=512, seed=21)
    md = case.metadata
    before = case.cache.clone()
    cpu_kernels.write_kv(case.cache, case.k, case.v, md.slot_mapping)  # the decode's own token
    out = torch.zeros_like(case.q)
    rows = torch.arange(1)
    cpu_kernels.decode_attention(case.q, out, rows, case.cache, md.block_table, rows, md.seq_lens.long(), 512,
                                 case.scale)
    torch.testing.assert_close(out, sdpa_oracle(case, before), **FP32_TOL)


def test_more_than_16_query_heads_per_kv_head_fall_back_to_the_eager_kernel() -> None:
    case = make_case([1, 5], [40, 20], block_size=16, seg=512, heads=(32, 1), head_dim=16, seed=14)
    out = SegmentedAttentionBackend().forward(case.q, case.k, case.v, case.cache.clone(), case.metadata,
                                              case.scale)
    torch.testing.assert_close(out, sdpa_oracle(case, case.cache), **FP32_TOL)


def test_decode_stack_refuses_a_cache_of_another_head_shape() -> None:
    h, i = 64, 96
    layer = (torch.ones(h), torch.zeros(128, h), None, torch.zeros(h, 64), torch.ones(h),
             torch.zeros(2 * i, h), torch.zeros(h, i), torch.zeros(2, 8, 16, 1, 16))
    with pytest.raises(ValueError, match=r"must be \[2, num_blocks, block_size, 2, 16\]"):
        cpu_kernels.DecodeStack([layer], 4, 2, 16, 1e-5)
    with pytest.raises(ValueError, match="at least one layer"):
        cpu_kernels.DecodeStack([], 4, 2, 16, 1e-5)


def test_tensors_c_cannot_read_and_aliasing_are_refused() -> None:
    x, w, _ = _inputs(2, 64, 64, torch.float32)
    meta = torch.empty(2, 64, device="meta")
    with pytest.raises(ValueError, match="x must be a CPU tensor, got one on meta"):
        cpu_kernels.linear(meta, w)
    with pytest.raises(ValueError, match="norm_weight must be a CPU tensor"):
        cpu_kernels.linear(x, w, prologue="rmsnorm", norm_weight=torch.empty(64, device="meta"))
    with pytest.raises(ValueError, match="cos must be a CPU tensor"):
        cpu_kernels.rope_(x, 4, 16, torch.empty(2, 16, device="meta"), torch.zeros(2, 16))
    h = torch.randn(2, 64)
    with pytest.raises(ValueError, match="residual must not overlap x"):
        cpu_kernels.linear(h, w, residual=h)  # read while written: silently wrong before
    with pytest.raises(ValueError, match="cannot hold"):
        cpu_kernels.rope_(torch.randn(1, 64).expand(3, 64), 4, 16, torch.ones(3, 16), torch.zeros(3, 16))
    with pytest.raises(ValueError, match="prologue must be 'rmsnorm', 'silu_mul' or None, got 'gelu'"):
        cpu_kernels.linear(x, w, prologue="gelu")
    with pytest.raises(ValueError, match="norm_weight is only used with prologue='rmsnorm'"):
        cpu_kernels.linear(torch.randn(2, 128), w, prologue="silu_mul", norm_weight=torch.ones(64))
    with pytest.raises(ValueError, match="out_dtype is for a new output"):
        cpu_kernels.linear(x, w, residual=torch.zeros(2, 64), out_dtype=torch.float32)
    cache = torch.zeros(2, 4, 16, 1, 16)
    with pytest.raises(ValueError, match="slot_mapping must be 1-D int32/int64, got .* torch.float32"):
        cpu_kernels.write_kv(cache, torch.ones(1, 1, 16), torch.ones(1, 1, 16), torch.tensor([3.9]))
    assert torch.count_nonzero(cache) == 0


def test_a_damaged_cached_library_is_rebuilt_in_the_cache_dir(tmp_path: Path) -> None:
    lib = _copy_of_this_process_library(tmp_path)
    good = lib.read_bytes()
    lib.write_bytes(good[:5000])  # truncated: loading it crashed the process with SIGBUS
    assert _probe({"SEGSERVE_KERNEL_DIR": str(tmp_path)}) == "True None"  # one build, into tmp_path
    assert lib.read_bytes() == good
    lib.write_bytes(Path("/bin/true").read_bytes())  # a foreign library: no kernels in it
    assert not build._intact(lib)  # what sent the truncated file to a rebuild: this one would follow it
    lib.write_bytes(good)
    assert build._intact(lib)
