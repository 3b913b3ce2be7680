"""GGUF Q8_0 / Q4_0 / Q4_1 weights run in their block form (issue 16) on tiny random checkpoints
written with the ``gguf`` package: the native engine equals the dequantize-at-load engine
(``quantization="none"``) token for token in float32 through every path a step can take (the one-call
decode stack, the per-layer small-batch linears at budget 5, the dequantize-then-GEMM large steps at
budget 64, and the eager path with the quantized kernels off), logprobs within 1e-4 on the float
kernels and within 1e-3 where one-row 4-bit products take 16-bit integer activations (the default on a
VNNI CPU; measured up to 4.6e-4 on these models, the float kernels 5.5e-6); a type without a native
kernel is dequantized with one log line; a truncated or mis-typed tensor is named in the error.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for model_fixtures
from model_fixtures import save_tiny_hf_dir, tiny_hf_model, train_tiny_tokenizer, write_tiny_gguf  # noqa: E402

from segserve import LLM, SamplingParams  # noqa: E402
from segserve.kernels import amx, quant  # noqa: E402
from segserve.models.loader import load_model  # noqa: E402
from segserve.models.quant_linear import QuantEmbedding, QuantLinear  # noqa: E402
from segserve.worker import cpu_step  # noqa: E402

PROMPTS = [
    [5, 17, 42, 99, 100, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    [3, 4, 5],
    list(range(30, 70)),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
QTYPES = ("Q8_0", "Q4_0", "Q4_1")
LOGPROB_TOL = 1e-4
INT_LOGPROB_TOL = 1e-3  # one-row Q4_0 / Q4_1 products on 16-bit integer activations (quant.int8_formats)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """``{qtype: path}`` for each format (untied LM head), plus ``"tied"``: Q4_1 with a tied head
    (the embedding is the head, as in SmolLM2), ``"hf"``: the float directory."""
    root = tmp_path_factory.mktemp("quant")
    tok = train_tiny_tokenizer(300)
    hf = tiny_hf_model(vocab_size=300, tie=False)
    out = {}
    for qtype in QTYPES:
        out[qtype] = root / f"tiny-{qtype}.gguf"
        write_tiny_gguf(out[qtype], hf, tok, qtype=qtype)
    out["tied"] = root / "tiny-tied.gguf"
    write_tiny_gguf(out["tied"], tiny_hf_model(vocab_size=300, tie=True, seed=1), tok, qtype="Q4_1")
    save_tiny_hf_dir(root / "hf", hf, tok)
    out["hf"] = root / "hf"
    return out


def run(path: Path, budget: int = 64, **kwargs) -> list:
    llm = LLM(model=str(path), num_kv_blocks=64, max_num_batched_tokens=budget, max_model_len=128, **kwargs)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.llm_engine.check_integrity()
    return outs


def run_alone(path: Path, budget: int = 64) -> list:
    """``run``, one prompt at a time: every decode step has one row (the integer path's steps)."""
    llm = LLM(model=str(path), num_kv_blocks=64, max_num_batched_tokens=budget, max_model_len=128)
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in PROMPTS]
    llm.llm_engine.check_integrity()
    return outs


def assert_same(native: list, dequantized: list, tol: float = LOGPROB_TOL) -> float:
    """Equal greedy tokens and top-3 ranks, each logprob within ``tol``; returns the largest difference."""
    moved = 0.0
    for a, b in zip(native, dequantized, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert list(la) == list(lb)  # the same top tokens in the same order
            for tid in la:
                assert abs(la[tid] - lb[tid]) <= tol, (tid, la[tid], lb[tid])
                moved = max(moved, abs(la[tid] - lb[tid]))
    return moved


def integer_path(qtype: str) -> bool:
    """Whether this file's one-row products take integer activations by default (Q4 projections)."""
    return qtype != "Q8_0" and quant.int8_formats(1) != 0


@pytest.mark.parametrize("qtype", [*QTYPES, "tied"])
def test_native_blocks_generate_what_the_dequantized_model_generates(files, qtype):
    dequantized = run(files[qtype], quantization="none")
    tol = INT_LOGPROB_TOL if integer_path(qtype) else LOGPROB_TOL
    assert_same(run(files[qtype]), dequantized, tol)  # prompts in one chunk each, decodes in one call
    assert_same(run(files[qtype], budget=5), dequantized, tol)  # chunks of <= 5 rows: per-layer linears
    assert_same(run_alone(files[qtype]), dequantized, tol)  # batch-1 decode steps
    old = quant.set_int8(False)  # the float kernels: weights-only, within float32 summation order
    try:
        assert_same(run(files[qtype], budget=5), dequantized)
    finally:
        quant.set_int8(old)
    with quant.disabled():  # SEGSERVE_QUANT=0: PyTorch dequantize-then-matmul
        assert_same(run(files[qtype]), dequantized)


def test_the_loader_keeps_blocks_and_no_float_copy(files):
    loaded = load_model(files["tied"])
    model = loaded.model
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.embed_tokens.qtype == "Q4_1"
    assert model.quantized_lm_head is not None and model.lm_head is None
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            assert isinstance(m, QuantLinear) and m.qtype == "Q4_1"
    # Floats left: the norms only (2 per layer + the final one), 64 values each.
    assert sum(p.numel() for p in model.parameters()) == (2 * 2 + 1) * 64
    # Blocks: 20 bytes per 32 values of every projection and the embedding (300 x 64).
    values = 300 * 64 + 2 * (64 * (64 + 32 + 32) + 64 * 64 + 2 * 96 * 64 + 64 * 96)
    assert sum(b.numel() for b in model.buffers()) == values // 32 * 20
    dense = load_model(files["tied"], quantization="none").model
    assert not any(isinstance(m, (QuantLinear, QuantEmbedding)) for m in dense.modules())


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_an_embedding_lookup_outside_the_vocabulary_is_named_on_both_paths(files, kernel):
    embed = load_model(files["tied"]).model.embed_tokens  # 300 rows
    old = quant.set_enabled(kernel)
    try:
        assert embed(torch.tensor([0, 299])).shape == (2, 64)
        for bad in ([5, 300], [-1]):
            with pytest.raises(ValueError, match=r"a token id is outside \[0, 300\)"):
                embed(torch.tensor(bad))
    finally:
        quant.set_enabled(old)


def test_a_type_without_a_native_kernel_is_dequantized_with_one_note(files, tmp_path, caplog):
    path = tmp_path / "mixed.gguf"
    hf = tiny_hf_model(vocab_size=300, tie=False)
    write_tiny_gguf(path, hf, train_tiny_tokenizer(300), qtype="Q4_1",
                    types={"blk.0.ffn_down.weight": "Q5_0", "blk.1.ffn_down.weight": "Q5_0"})
    with caplog.at_level(logging.INFO, logger="segserve"):
        loaded = load_model(path)
    notes = [r.getMessage() for r in caplog.records if "no native kernel" in r.getMessage()]
    assert notes == ["GGUF type Q5_0 has no native kernel: dequantized to float32 (blk.0.ffn_down.weight "
                     "and 1 more)"]
    assert not isinstance(loaded.model.layers[0].mlp.down_proj, QuantLinear)
    assert isinstance(loaded.model.layers[0].mlp.gate_up_proj, QuantLinear)
    assert_same(run(path), run(path, quantization="none"))


def test_a_truncated_file_names_the_tensor_that_runs_past_its_end(files, tmp_path):
    from gguf import GGUFReader

    last = GGUFReader(files["Q8_0"]).tensors[-1]
    end = last.data_offset + last.n_bytes  # the file may pad after it
    data = files["Q8_0"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: end - 100])  # the last tensor loses its tail
    assert last.name == "output.weight"
    message = (r"tensor 'output\.weight' \(300, 64\) of type Q8_0 needs bytes up to "
               rf"offset {end}, but the file has {end - 100} \(truncated\)")
    with pytest.raises(ValueError, match=message):
        load_model(cut)


def test_a_weight_of_an_integer_type_is_named(tmp_path):
    path = tmp_path / "int.gguf"
    hf = tiny_hf_model(vocab_size=300, tie=False)
    write_tiny_gguf(path, hf, train_tiny_tokenizer(300), qtype="Q4_0", types={"blk.1.attn_v.weight": "I32"})
    with pytest.raises(ValueError, match=r"tensor 'blk\.1\.attn_v\.weight' \(32, 64\) has integer type I32"):
        load_model(path)


def test_an_unknown_type_id_is_named(files, tmp_path):
    """A type id ggml does not have (here 99, patched into the table entry of ``blk.0.attn_q.weight``)."""
    data = bytearray(files["Q4_1"].read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(name) + len(name)  # then n_dims (u32), dims (u64 each), type (u32), offset (u64)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(data[type_at : type_at + 4], "little") == 3  # Q4_1
    data[type_at : type_at + 4] = (99).to_bytes(4, "little")
    bad = tmp_path / "badtype.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.attn_q\.weight' \(64, 64\) has GGML type id 99"):
        load_model(bad)


def test_quantization_choices_are_checked(files):
    with pytest.raises(ValueError, match=r"quantization='gguf' needs a \.gguf file"):
        load_model(files["hf"], quantization="gguf")
    with pytest.raises(ValueError, match=r"quantization must be one of \[None, 'gguf', 'none'\], got 'int8'"):
        load_model(files["Q8_0"], quantization="int8")
    loaded = load_model(files["Q8_0"])
    with pytest.raises(ValueError, match="has GGUF-quantized layers; quantization='none' cannot change that"):
        LLM(model=loaded, quantization="none", num_kv_blocks=16, max_model_len=64)


def test_bfloat16_native_engine_runs_and_stays_near_float32(files):
    """bfloat16 rounds differently from float32 (the native few-row kernel keeps the exact weights and
    multiplies in float32; the dequantized bfloat16 model rounds the weights), so no equality is
    promised; the first token's logprobs stay within bfloat16's noise (0.1) of float32's."""
    f32 = run(files["Q4_1"])
    bf16 = run(files["Q4_1"], dtype="bfloat16")
    for a, b in zip(f32, bf16, strict=True):
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        top = next(iter(first_a))
        assert top in first_b and abs(first_a[top] - first_b[top]) < 0.1
    assert torch.get_default_dtype() == torch.float32


def test_the_simulators_model_shape_counts_block_weights_as_values(files):
    """Regression: ``num_params`` counted parameters only, so a model in blocks had just its norms."""
    from segserve.simulator.profile import model_shape_of

    native, dense = load_model(files["tied"]), load_model(files["tied"], quantization="none")
    assert model_shape_of(native)["num_params"] == model_shape_of(dense)["num_params"] == 300 * 64 + 2 * (
        64 * (64 + 32 + 32) + 64 * 64 + 2 * 96 * 64 + 64 * 96) + 5 * 64


@pytest.mark.skipif(not amx.available(), reason=f"AMX GEMM unavailable: {amx.unavailable_reason()}")
def test_bfloat16_gguf_chunks_run_on_the_amx_gemm_near_the_onednn_path(files, monkeypatch):
    """A bfloat16 GGUF step above quant_linear.SMALL_ROWS rows runs its projections as dequantize,
    pack, AMX GEMM (SiLU gate fused); its hidden states stay within bfloat16's rounding of the
    dequantize-then-oneDNN path (same weights, same rounding points, another summation order), and
    the engine's greedy tokens on it match that path's."""
    loaded = load_model(str(files["Q4_1"]), dtype=torch.bfloat16)
    model = loaded.model
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    calls, real = [], amx.linear
    monkeypatch.setattr(amx, "linear", lambda *a, **k: calls.append(bool(k.get("silu_mul"))) or real(*a, **k))
    layer = model.layers[0]
    gate_up, down = layer.mlp.gate_up_proj, layer.mlp.down_proj
    assert isinstance(gate_up, QuantLinear) and cpu_step.quant_on_tiles(gate_up, x)
    assert not cpu_step.quant_on_tiles(gate_up, x[:12])  # the few-row kernel's rows stay its own
    got = cpu_step._project(gate_up, x, None, silu_mul=True)  # (40, I)
    assert calls == [True]
    ref_gu = gate_up(x)
    ref = torch.nn.functional.silu(ref_gu[:, :96]).mul_(ref_gu[:, 96:])
    tol = 2.0 ** -7 * ref.float().abs() + 1e-2 * ref.float().abs().max()
    assert ((got.float() - ref.float()).abs() <= tol).all()
    out = cpu_step._project(down, got, None)
    assert calls == [True, False]
    ref_down = down(got)
    assert ((out.float() - ref_down.float()).abs() <= 2.0 ** -7 * ref_down.float().abs()
            + 1e-2 * ref_down.float().abs().max()).all()
    monkeypatch.undo()
    on = run(files["Q4_1"], dtype="bfloat16")
    with amx.disabled():
        off = run(files["Q4_1"], dtype="bfloat16")
    for a, b in zip(on, off, strict=True):
        assert a.outputs[0].token_ids[:3] == b.outputs[0].token_ids[:3]


@pytest.mark.skipif(not quant.int8_built(), reason="no AVX-512 VNNI int8 kernel on this CPU")
@pytest.mark.parametrize("qtype", QTYPES)
def test_integer_activations_reach_every_one_row_path_and_stay_near_the_float_path(files, qtype):
    """The default integer path (quant.int8_formats) runs in batch-1 decode steps (the one-call stack
    and its LM head) and the one-row per-layer linears (the last prompt row's head at budget 5): the
    logprobs move for the Q4 formats (it ran) but stay within INT_LOGPROB_TOL of the float kernels' with
    the same tokens; Q8_0 stays on the float kernels bit for bit; switched off, the float results return
    exactly."""
    old = quant.set_int8(False)
    try:
        floats = {budget: run_alone(files[qtype], budget) for budget in (64, 5)}
        quant.set_int8(True)
        for budget, want in floats.items():
            got = run_alone(files[qtype], budget)
            moved = assert_same(got, want, INT_LOGPROB_TOL)
            if qtype == "Q8_0":
                assert moved == 0.0
            else:
                assert moved > 0.0
        quant.set_int8(False)
        assert all(a.outputs[0].logprobs == b.outputs[0].logprobs
                   for a, b in zip(run_alone(files[qtype]), floats[64], strict=True))
    finally:
        quant.set_int8(old)


def test_a_decode_step_does_not_walk_the_models_modules(files):
    """Regression: every step asked whether any projection is in blocks by walking ``model.modules()``
    (0.7-0.9 ms a step at load 6.5, against a ~15 ms batch-1 step); now the answer is kept until
    ``prepack``."""
    llm = LLM(model=str(files["Q4_1"]), num_kv_blocks=64, max_model_len=128)
    llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)
    model = llm.llm_engine.runner.cpu_step.model

    def walked():
        raise AssertionError("model.modules() walked during a step")

    model.modules = walked
    outs = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == GREEDY.max_tokens
