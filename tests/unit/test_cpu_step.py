"""``CpuStep`` picks each step's path by its shape, and every path equals the model's eager forward.

A tiny random Llama checkpoint (2 layers, hidden 64, 4 query / 2 KV heads of dim 16) in float32: the
kernel calls of one step are counted (``DecodeStack.run``, the compiled ``linear``, the in-place ``rope_``)
and its hidden states compared with ``LlamaForCausalLM.forward`` from the same cache, within 1e-5
(summation order; observed up to 4e-6).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for model_fixtures
from model_fixtures import new_caches, save_tiny_hf_dir, tiny_hf_model, train_tiny_tokenizer  # noqa: E402

from segserve import LLM, SamplingParams  # noqa: E402
from segserve.attention.metadata import build_attention_metadata  # noqa: E402
from segserve.kernels import amx, bf16gemm, build  # noqa: E402
from segserve.kernels import cpu as cpu_kernels  # noqa: E402
from segserve.models.loader import load_model  # noqa: E402
from segserve.worker import cpu_step  # noqa: E402
from segserve.worker.cpu_step import AMX_MIN_ROWS, CpuStep  # noqa: E402

pytestmark = pytest.mark.skipif(
    not all(f in build._cpu_flags() for f in build.REQUIRED_CPU_FLAGS), reason="CPU lacks AVX-512 BF16"
)
BLOCK = 4


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_tiny_hf_dir(path, tiny_hf_model("llama"), train_tiny_tokenizer())
    return path


@pytest.fixture
def calls(monkeypatch):
    """Counts of the kernel calls a step makes, by name."""
    counts = {"stack": 0, "linear": 0, "rope_": 0, "rows": 0}
    for owner, name, key in ((cpu_kernels.DecodeStack, "run", "stack"), (cpu_kernels, "linear", "linear"),
                             (cpu_kernels, "rope_", "rope_"), (cpu_kernels, "add_rmsnorm_", "rows"),
                             (cpu_kernels, "silu_mul", "rows")):
        real = getattr(owner, name)

        def spy(*a, real=real, key=key, **kw):
            counts[key] += 1
            return real(*a, **kw)

        monkeypatch.setattr(owner, name, spy)
    return counts


@torch.inference_mode()
def _step(
    model, query_lens: list[int], kernels: bool, prepack: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """A step after each request's 6-token prefill: ``query_lens`` tokens each (at priors 6), run by
    ``CpuStep`` (pre-packed first if ``prepack``) and by the model's own forward from the same cache
    -> (CpuStep's, eager hidden)."""
    n = len(query_lens)
    rows = [[1 + 4 * r + i for i in range(4)] for r in range(n)]  # room for 16 tokens each
    caches = new_caches(model, 4 * n + 1, BLOCK)
    with cpu_kernels.disabled():
        for row in rows:
            prefill = build_attention_metadata([6], [0], [row], BLOCK, 4, 8)
            model(torch.arange(6), torch.arange(6), caches, prefill)
    md = build_attention_metadata(query_lens, [6] * n, rows, BLOCK, 4, 8)
    ids = torch.cat([torch.arange(20, 20 + q) for q in query_lens])
    positions = torch.cat([torch.arange(6, 6 + q) for q in query_lens])
    eager_caches = [c.clone() for c in caches]
    old = cpu_kernels.set_enabled(kernels)
    try:
        step = CpuStep(model)
        if prepack:
            step.prepack()
        got = step.forward(ids, positions, caches, md)
    finally:
        cpu_kernels.set_enabled(old)
    with cpu_kernels.disabled():
        want = model(ids, positions, eager_caches, md)
    return got, want


@pytest.mark.parametrize(
    "query_lens, kernels, expected",
    [
        # decodes: one call in all (the final norm and the LM head inside it)
        ([1, 1, 1], True, {"stack": 1, "linear": 0, "rope_": 0, "rows": 0}),
        ([1, 4], True, {"stack": 0, "linear": 8, "rope_": 2, "rows": 1}),  # 5 rows: 4 linears + a rope_ each
        # 12 rows: oneDNN GEMMs; per layer rope_ and 3 row passes (add+norm twice, SiLU gate), + the first
        # layer's norm alone (the last layer's second add+norm is the final norm).
        ([1, 8, 3], True, {"stack": 0, "linear": 0, "rope_": 2, "rows": 7}),
        ([1, 1, 1], False, {"stack": 0, "linear": 0, "rope_": 0, "rows": 0}),  # kernels off: the eager model
    ],
    ids=["decode-stack", "small", "large", "eager"],
)
def test_each_step_takes_its_path_and_equals_eager(tiny_dir, calls, query_lens, kernels, expected) -> None:
    model = load_model(tiny_dir, dtype=torch.float32).model
    got, want = _step(model, query_lens, kernels)
    assert calls == expected
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_reference_backend_decodes_take_the_per_layer_path(tiny_dir, calls) -> None:
    # The one-call step computes the segmented backend's attention itself: not over another backend.
    model = load_model(tiny_dir, dtype=torch.float32, attn_backend="reference").model
    got, want = _step(model, [1, 1, 1], True)
    assert calls == {"stack": 0, "linear": 8, "rope_": 2, "rows": 1}
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_wrong_number_of_caches_raises_on_every_path(tiny_dir) -> None:
    model = load_model(tiny_dir, dtype=torch.float32).model
    caches = new_caches(model, 8, BLOCK)[:1]
    for q in (1, 12):
        md = build_attention_metadata([q], [0], [[1, 2, 3]], BLOCK, 3, 8)
        with pytest.raises(ValueError, match="got 1 KV caches for 2 layers"):
            CpuStep(model).forward(torch.arange(q), torch.arange(q), caches, md)


needs_amx = pytest.mark.skipif(
    not amx.available(), reason=f"AMX GEMM unavailable: {amx.unavailable_reason()}"
)


@pytest.fixture
def amx_calls(monkeypatch):
    """How many times a step calls the AMX GEMM."""
    counts = {"amx": 0}
    real = amx.linear

    def spy(*a, **kw):
        counts["amx"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(amx, "linear", spy)
    return counts


@needs_amx
@pytest.mark.parametrize(
    "query_lens, dtype, expected",
    [
        ([1, 8, 3], torch.bfloat16, 8),  # 12 rows: 4 AMX GEMMs per layer
        ([AMX_MIN_ROWS], torch.bfloat16, 8),  # the threshold itself
        ([1, 4, 3], torch.bfloat16, 0),  # 8 rows: the compiled small-batch linears
        ([1, 8, 3], torch.float32, 0),  # float32: oneDNN
    ],
    ids=["bf16-12", "bf16-threshold", "bf16-8", "fp32-12"],
)
def test_large_bf16_steps_take_the_amx_gemm_and_equal_eager(
    tiny_dir, calls, amx_calls, query_lens, dtype, expected
) -> None:
    model = load_model(tiny_dir, dtype=dtype).model
    got, want = _step(model, query_lens, True, prepack=True)
    assert amx_calls["amx"] == expected
    if expected:  # per layer rope_ and 2 add+norm passes, + the first norm and the final one; the SiLU
        # gate is fused into the gate/up GEMM, so no silu_mul pass
        assert calls["linear"] == 0 and calls["rope_"] == 2 and calls["rows"] == 5
    # bfloat16: the eager GEMM (oneDNN) and the AMX one may round a product to neighbouring bf16 values.
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 0}
    torch.testing.assert_close(got, want, **tol)


@needs_amx
def test_prepack_keeps_one_packed_copy_of_the_bf16_projections(tiny_dir) -> None:
    model = load_model(tiny_dir, dtype=torch.bfloat16).model
    step = CpuStep(model)
    step.prepack()
    assert step._tile_weights is not None and len(step._tile_weights) == 2
    projections = [m for ly in model.layers for m in (ly.self_attn.qkv_proj, ly.self_attn.o_proj,
                                                         ly.mlp.gate_up_proj, ly.mlp.down_proj)]
    assert not any(m.is_packed for m in projections)  # AMX serves every step oneDNN would have
    old = amx.set_enabled(False)
    try:
        step.prepack()  # AMX off: bf16gemm's register tiles read the same layout; the head goes to oneDNN
        assert len(step._tile_weights) == 2 and not any(m.is_packed for m in projections)
        assert step._tile_lm_head is None
        old_bf16 = bf16gemm.set_enabled(False)
        try:
            step.prepack()  # no tile GEMM at all: back to oneDNN copies
            assert step._tile_weights is None and all(m.is_packed for m in projections)
        finally:
            bf16gemm.set_enabled(old_bf16)
    finally:
        amx.set_enabled(old)
    step.unpack()
    assert step._tile_weights is None


@needs_amx
def test_amx_prefill_gives_the_greedy_tokens_of_the_onednn_path(tiny_dir, amx_calls) -> None:
    prompts = [list(range(5, 45)), list(range(100, 123))]  # prefill steps of 40 and 23 rows
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for on in (True, False):
        old = amx.set_enabled(on)
        try:
            llm = LLM(model=str(tiny_dir), dtype="bfloat16", num_kv_blocks=64, max_num_batched_tokens=64,
                      max_model_len=128)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        finally:
            amx.set_enabled(old)
        tokens[on] = [o.outputs[0].token_ids for o in outs]
    assert amx_calls["amx"] > 0
    assert tokens[True] == tokens[False]


@pytest.fixture(scope="module")
def wide_head_dir(tmp_path_factory):
    """The tiny Llama with 32-wide heads (hidden 128, 4 heads): what the fused RoPE + KV write takes."""
    path = tmp_path_factory.mktemp("llama_d32")
    save_tiny_hf_dir(path, tiny_hf_model("llama", hidden_size=128), train_tiny_tokenizer())
    return path


@needs_amx
def test_large_bf16_steps_rotate_and_write_kv_in_the_qkv_gemm_with_the_same_bits(
    wide_head_dir, calls, monkeypatch
) -> None:
    """A 12-row bfloat16 step of a model with 32-wide heads: RoPE and the KV write happen in the QKV GEMM's
    stores (no rope_ pass), and the hidden states and every cache equal those of the separate passes."""
    model = load_model(wide_head_dir, dtype=torch.bfloat16).model
    query_lens = [1, 8, 3]
    n = len(query_lens)
    rows = [[1 + 4 * r + i for i in range(4)] for r in range(n)]
    md = build_attention_metadata(query_lens, [6] * n, rows, BLOCK, 4, 8)
    ids = torch.cat([torch.arange(20, 20 + q) for q in query_lens])
    positions = torch.cat([torch.arange(6, 6 + q) for q in query_lens])
    base = new_caches(model, 4 * n + 1, BLOCK)
    with cpu_kernels.disabled():
        for row in rows:
            prefill = build_attention_metadata([6], [0], [row], BLOCK, 4, 8)
            model(torch.arange(6), torch.arange(6), base, prefill)
    step = CpuStep(model)
    step.prepack()
    results = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(cpu_step, "rope_kv_tables", lambda *a: None)
        caches = [c.clone() for c in base]
        calls["rope_"] = 0
        with torch.inference_mode():
            results[fused] = (step.forward(ids, positions, caches, md), caches, calls["rope_"])
    (got, got_caches, fused_ropes), (want, want_caches, ropes) = results[True], results[False]
    assert (fused_ropes, ropes) == (0, 2)  # one rope_ pass a layer without the fused epilogue
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    for g, w in zip(got_caches, want_caches, strict=True):
        assert torch.equal(g.view(torch.int16), w.view(torch.int16))
