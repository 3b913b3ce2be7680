"""The default (Q4_1, float32) model with the compiled float32 GEMM for prefill chunks against the path
it replaced (dequantized tiles and ``F.linear``): the same greedy tokens, first-token logprobs within
1e-4 (the two differ only in float32 summation order)."""

from __future__ import annotations

import pytest
import torch

from segserve import LLMEngine, SamplingParams
from segserve.entrypoints.cli import default_document
from segserve.kernels import f32gemm
from segserve.models.quant_linear import SMALL_ROWS

from .conftest import finish_all, requires_model

pytestmark = [pytest.mark.slow, requires_model]

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=20)


def run(smollm, prompts: list[list[int]]) -> list:
    eng = LLMEngine(model=smollm, num_kv_blocks=512, max_num_batched_tokens=256)
    for i, p in enumerate(prompts):
        eng.add_request(f"p{i}", p, GREEDY)
    outs = finish_all(eng)
    return [outs[f"p{i}"].outputs[0] for i in range(len(prompts))]


def test_greedy_tokens_equal_with_the_gemm_on_and_off(smollm, monkeypatch):
    if not f32gemm.enabled():
        pytest.skip(f"f32gemm off: {f32gemm.unavailable_reason()}")
    tok, doc = smollm.tokenizer, default_document()
    texts = [doc[:1800], doc[2000:2600], "Explain chunked prefill. " * 20]
    prompts = [tok.encode(t) for t in texts]
    assert all(len(p) > SMALL_ROWS[torch.float32] for p in prompts)  # each prefill takes the GEMM
    calls, real = [], f32gemm.matmul
    monkeypatch.setattr(f32gemm, "matmul", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    on = run(smollm, prompts)
    used = len(calls)
    assert used >= 30 * 4  # every layer's linears of at least one chunk
    with f32gemm.disabled():
        off = run(smollm, prompts)
    assert len(calls) == used  # switched off, nothing reaches it
    for i, (a, b) in enumerate(zip(on, off, strict=True)):
        assert a.token_ids == b.token_ids, f"prompt {i}"
        first_a, first_b = a.logprobs[0], b.logprobs[0]
        shared = set(first_a) & set(first_b)
        assert len(shared) >= 15
        assert max(abs(first_a[t] - first_b[t]) for t in shared) < 1e-4, f"prompt {i}"
