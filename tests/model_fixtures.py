"""Helpers for the model tests: a paged-cache prompt runner, tiny checkpoints in both formats.

Imported by ``tests/unit/test_loader.py`` and ``tests/e2e/test_model_parity.py`` (which put this
directory on ``sys.path``; ``conftest.py`` belongs to another module).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from segserve.attention.metadata import build_attention_metadata
from segserve.worker.cpu_step import CpuStep

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TRAIN_TEXT = (
    "The quick brown fox jumps over the lazy dog. Paged attention keeps the cache in blocks; "
    "chunked prefill splits a long prompt into pieces that share a step with decodes. "
)


def new_caches(model: Any, num_blocks: int, block_size: int) -> list[torch.Tensor]:
    """One zeroed ``[2, num_blocks, block_size, Hkv, D]`` cache per layer, in the model's dtype."""
    cfg = model.config
    dtype = model.activation_dtype
    shape = (2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    return [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_hidden_layers)]


@torch.inference_mode()
def round_robin_block_rows(prompt_lens: list[int], block_size: int) -> list[list[int]]:
    """Block-table rows for requests of ``prompt_lens`` tokens with room for one more token each, block
    ids 1, 2, ... dealt round-robin over the requests (as concurrent decodes get them, so no row is
    contiguous); block 0 is left out (the pool's null block)."""
    need = [-(-(n + 1) // block_size) for n in prompt_lens]
    rows, next_id = [[] for _ in prompt_lens], 1
    while any(len(r) < k for r, k in zip(rows, need, strict=True)):
        for r, k in zip(rows, need, strict=True):
            if len(r) < k:
                r.append(next_id)
                next_id += 1
    return rows


def run_chunked(model: Any, token_ids: list[int], chunk_lens: list[int], block_size: int = 4,
                kv_segment_size: int = 512, seed: int = 0) -> torch.Tensor:
    """Feed one prompt through ``model`` in chunks of ``chunk_lens`` tokens over a paged cache whose
    block ids are shuffled; return ``(len(token_ids), vocab)`` float32 logits of every position.
    Steps and logits run as the engine's runner runs them (``CpuStep``: compiled kernels where they fit).

    ``kv_segment_size`` need only be a multiple of ``block_size`` here (the backend's rule), so tiny
    models can walk several segments."""
    assert sum(chunk_lens) == len(token_ids)
    num_needed = -(-len(token_ids) // block_size)
    block_ids = list(range(1, num_needed + 1))
    random.Random(seed).shuffle(block_ids)
    caches = new_caches(model, num_needed + 2, block_size)
    logits, start, step = [], 0, CpuStep(model)
    for q in chunk_lens:
        md = build_attention_metadata([q], [start], [block_ids], block_size, len(block_ids), kv_segment_size)
        ids = torch.tensor(token_ids[start : start + q])
        hidden = step.forward(ids, torch.arange(start, start + q), caches, md)
        logits.append(step.compute_logits(hidden))
        start += q
    return torch.cat(logits)


def train_tiny_tokenizer(vocab_size: int = 300) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` (specials at ids 0-2) trained on a fixed paragraph."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_TRAIN_TEXT] * 20, trainer)
    return tok


def tokenizer_tables(tok: Any) -> tuple[list[str], list[str]]:
    """``(tokens by id, merges as "a b")`` of a trained BPE tokenizer."""
    import json

    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def tiny_hf_model(kind: str = "llama", vocab_size: int = 300, tie: bool = False,
                  rope_parameters: dict | None = None, seed: int = 0, hidden_size: int = 64) -> Any:
    """A 2-layer transformers model (hidden 64 unless given, 4 query / 2 KV heads) with large random
    weights.

    Weights are N(0, 0.2) and norm weights 1 + N(0, 0.1), biases included, so every tensor moves the
    logits by far more than the 1e-4 tolerance (HF's own init leaves biases 0 and norms 1).
    """
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
                  rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 5000.0})
    if kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    return model.eval().float()


@torch.inference_mode()
def hf_logits(hf_model: Any, token_ids: list[int]) -> torch.Tensor:
    """``(T, vocab)`` float32 logits of one unpadded sequence."""
    return hf_model(torch.tensor([token_ids])).logits[0].float()


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What ``convert_hf_to_gguf.py`` does to Q/K rows: ``(H, 2, D/2)`` -> ``(H, D/2, 2)``."""
    rows = w.shape[0]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str:
    """GGUF name of a HF Llama tensor (written independently of the loader's reverse map)."""
    if hf_name in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_HF_TO_GGUF_LAYER[module]}.{kind}"


def write_tiny_gguf(
    path: Path, hf_model: Any, tokenizer: Any, extra_tensors: dict | None = None, add_bos: bool = False,
    qtype: str | None = None, types: dict[str, str] | None = None,
) -> None:
    """Write ``hf_model`` (float32 weights, Q/K permuted as llama.cpp does) and ``tokenizer`` to a GGUF.

    ``qtype`` (e.g. ``"Q4_1"``) stores every 2-D tensor (projections, embedding, LM head) in that GGUF
    type, quantized by gguf-py as llama.cpp's ``llama-quantize`` would (after the Q/K permutation);
    ``types`` maps single GGUF tensor names to a type of their own (``"I32"``: the rounded values as
    int32, a type no weight may have).
    """
    import gguf
    from gguf.quants import quantize

    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    tokens, merges = tokenizer_tables(tokenizer)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, t in {**hf_model.state_dict(), **(extra_tensors or {})}.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        arr = t.detach().float().numpy().copy()
        if ".q_proj." in name:
            arr = llama_cpp_permute(arr, cfg.num_attention_heads)
        elif ".k_proj." in name:
            arr = llama_cpp_permute(arr, cfg.num_key_value_heads)
        gname = gguf_name(name) if name.startswith(("model.", "lm_head")) else name
        kind = (types or {}).get(gname, qtype if arr.ndim == 2 else None)
        if kind == "I32":
            w.add_tensor(gname, np.rint(arr).astype(np.int32))
        elif kind is not None:
            gtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(gname, quantize(arr, gtype), raw_dtype=gtype)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def save_tiny_hf_dir(path: Path, hf_model: Any, tokenizer: Any) -> None:
    """``save_pretrained`` the model (safetensors) and a fast tokenizer with the chat template."""
    from transformers import PreTrainedTokenizerFast

    hf_model.save_pretrained(path)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|im_start|>", eos_token="<|im_end|>",
        unk_token="<|endoftext|>", chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(path)
