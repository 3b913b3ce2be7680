"""The whole engine on tiny random checkpoints (seconds, no real model): a Hugging Face directory and a
GGUF file both load through ``LLM(model=path)`` and generate what ``transformers`` generates."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for model_fixtures
from model_fixtures import save_tiny_hf_dir, tiny_hf_model, train_tiny_tokenizer, write_tiny_gguf  # noqa: E402

from segserve import LLM, SamplingParams  # noqa: E402

PROMPTS = [
    [5, 17, 42, 99, 100, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    [3, 4, 5],
    list(range(30, 70)),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = tiny_hf_model(vocab_size=300, tie=False)
    tok = train_tiny_tokenizer(300)
    root = tmp_path_factory.mktemp("tiny")
    save_tiny_hf_dir(root / "hf", hf, tok)
    write_tiny_gguf(root / "tiny.gguf", hf, tok)
    return hf, root


def hf_greedy(hf, prompt: list[int], n: int = 10) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("budget", [5, 64])
def test_tiny_checkpoint_generates_like_transformers(tiny, fmt, budget):
    hf, root = tiny
    path = root / "hf" if fmt == "hf" else root / "tiny.gguf"
    llm = LLM(model=str(path), num_kv_blocks=64, max_num_batched_tokens=budget, max_model_len=128)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt)
    llm.llm_engine.check_integrity()


def test_tiny_warm_prefix_run_equals_cold(tiny):
    hf, root = tiny
    llm = LLM(model=str(root / "hf"), num_kv_blocks=64, max_num_batched_tokens=16, max_model_len=128,
              block_size=4)
    cold = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    warm = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in cold] == [0, 0, 0]
    assert [o.num_cached_tokens for o in warm] == [16, 0, 36]  # whole blocks, last token recomputed
    assert [o.outputs[0].token_ids for o in warm] == [o.outputs[0].token_ids for o in cold]


def test_engine_settings_are_checked(tiny):
    _, root = tiny
    with pytest.raises(ValueError, match="max_model_len=4096 exceeds the model's context length 128"):
        LLM(model=str(root / "hf"), max_model_len=4096)
    with pytest.raises(ValueError, match="kv_segment_size must be one of"):
        LLM(model=str(root / "hf"), kv_segment_size=300)
    with pytest.raises(ValueError, match="must be a multiple of block_size=1024"):
        LLM(model=str(root / "hf"), block_size=1024, kv_segment_size=512)
    with pytest.raises(ValueError, match="largest num_batched_tokens_buckets entry 64 is below"):
        LLM(model=str(root / "hf"), num_batched_tokens_buckets=[16, 64], max_num_batched_tokens=128)
    with pytest.raises(ValueError, match="strictly increasing"):
        LLM(model=str(root / "hf"), num_batched_tokens_buckets=[64, 16], max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLM(model=str(root / "hf"), dtype="float16")
    with pytest.raises(ValueError, match="attention_backend must be"):
        LLM(model=str(root / "hf"), attention_backend="flash")
