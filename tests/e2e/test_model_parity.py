"""The real SmolLM2-135M-Instruct GGUF: segserve (float32) against transformers loading the same file.

Tolerance: logits within 1e-4 max abs over every position of a ~100-token prompt (logits reach ~35).
Measured: 0.0 one-shot with the segmented backend, ~5e-5 chunked or with the reference backend
(attention summation order). Tokenizer: ids and serialized form equal to transformers'. Slow:
transformers needs ~13 s to load the GGUF.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for model_fixtures

from model_fixtures import hf_logits, run_chunked  # noqa: E402

from segserve.models.loader import default_model_path, load_model  # noqa: E402

pytestmark = pytest.mark.slow

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based inks and a wooden press adapted from wine making. "
    "Within fifty years presses had spread to more than two hundred cities across Europe, and the "
    "price of books fell so far that ordinary merchants could afford them. Historians still argue "
    "about how much the new technology caused the Reformation, the scientific revolution and the "
    "rise of vernacular literature in the centuries that followed."
)
TOL = 1e-4


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def ours(gguf_path):
    torch.set_num_threads(2)
    return load_model(gguf_path, dtype=torch.float32, attn_backend="segmented")


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )


# ``hf_model`` (transformers on the same GGUF, float32) is the session fixture of conftest.py.


@pytest.fixture(scope="module")
def prompt_ids(ours) -> list[int]:
    ids = ours.tokenizer(TEXT).input_ids
    assert 90 <= len(ids) <= 110
    return ids


def test_config_matches_smollm2(ours):
    c = ours.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads) == (30, 576, 9)
    assert c.num_key_value_heads == 3
    assert (c.head_dim, c.vocab_size, c.rope_theta, c.tie_word_embeddings) == (64, 49152, 100000.0, True)
    assert ours.eos_token_ids == [2] and ours.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"


def test_logits_match_transformers(ours, hf_model, prompt_ids):
    ref = hf_logits(hf_model, prompt_ids)
    got = run_chunked(ours.model, prompt_ids, [len(prompt_ids)], block_size=16)
    assert (got - ref).abs().max().item() < TOL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_chunked_logits_match_transformers(ours, hf_model, prompt_ids):
    """Odd, non-block-aligned chunks over a paged cache walked in 2-block segments."""
    n = len(prompt_ids)
    got = run_chunked(ours.model, prompt_ids, [37, 29, n - 66], block_size=16, kv_segment_size=32)
    assert (got - hf_logits(hf_model, prompt_ids)).abs().max().item() < TOL


STRINGS = [
    TEXT,
    "Héllo wörld! Ça va? 日本語のテキスト, 한국어, русский текст, emoji 🤖🚀 and math ∑ x² ≤ ∞.",
    "def f(x):\n\treturn x ** 2  # tabs, spaces   and\r\nCRLF 1234567 3.14159",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.mark.parametrize("text", STRINGS, ids=["prose", "unicode", "code", "special"])
def test_tokenizer_ids_match_transformers(ours, hf_tokenizer, text):
    ids = ours.tokenizer(text).input_ids
    assert ids == hf_tokenizer(text).input_ids
    assert ours.tokenizer.decode(ids) == hf_tokenizer.decode(ids) == text


def test_tokenizer_serializes_like_transformers(ours, hf_tokenizer):
    ours_json = json.loads(ours.tokenizer.backend_tokenizer.to_str())
    assert ours_json == json.loads(hf_tokenizer.backend_tokenizer.to_str())
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours.tokenizer, attr) == getattr(hf_tokenizer, attr)


@pytest.mark.parametrize("with_system", [False, True])
def test_chat_template_renders_like_transformers(ours, hf_tokenizer, with_system):
    msgs = [
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another?"},
    ]
    if with_system:
        msgs.insert(0, {"role": "system", "content": "Be brief."})
    ours_text = ours.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.chat_template == hf_tokenizer.chat_template
    assert ours_text == hf_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours_text.endswith("<|im_start|>assistant\n")
