"""The compiled whole-step decode path (``DecodeStack``) equals the per-layer eager path.

Tiny random checkpoints (2 layers, hidden 64, 4 query / 2 KV heads of dim 16; Qwen2 adds q/k/v biases)
through the runner's ``CpuStep.forward``: a decode-only step of three requests with interleaved blocks
and one padding row, once with the kernels on (one C call for all layers) and once eager, from the
same cache. Tolerance: float32 hidden states and caches within 1e-5 (summation order; observed ~1.5e-6);
bfloat16 within 5e-2 + 3 % (states of magnitude ~0.5-4: a few bf16 ulps, as the eager path rounds
attention partials to bf16 where the kernel keeps float32, and two layers of N(0, 0.2) weights amplify
that; observed 4.3e-2).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for model_fixtures
from model_fixtures import (  # noqa: E402
    new_caches,
    round_robin_block_rows,
    save_tiny_hf_dir,
    tiny_hf_model,
    train_tiny_tokenizer,
)

from segserve.attention.metadata import build_attention_metadata  # noqa: E402
from segserve.kernels import build  # noqa: E402
from segserve.kernels import cpu as cpu_kernels  # noqa: E402
from segserve.models.loader import load_model  # noqa: E402
from segserve.worker.cpu_step import CpuStep, decode_stack_layers  # noqa: E402

pytestmark = pytest.mark.skipif(
    not all(f in build._cpu_flags() for f in build.REQUIRED_CPU_FLAGS), reason="CPU lacks AVX-512 BF16"
)
BLOCK = 4
PROMPTS = [list(range(10, 23)), list(range(40, 45)), list(range(60, 90))]  # 13, 5, 30 tokens


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_hf_dir(path, tiny_hf_model(request.param), train_tiny_tokenizer())
    return load_model(path, dtype=torch.float32).model


@torch.inference_mode()
def _prefilled(model, rows) -> list[torch.Tensor]:
    caches = new_caches(model, 64, BLOCK)
    with cpu_kernels.disabled():
        for prompt, row in zip(PROMPTS, rows, strict=True):
            md = build_attention_metadata([len(prompt)], [0], [row], BLOCK, 16, 512)
            model(torch.tensor(prompt), torch.arange(len(prompt)), caches, md)
    return caches


@torch.inference_mode()
def _decode_step(model, caches, rows, kernels: bool, n: int, pad: int) -> torch.Tensor:
    """Decodes of the first ``n`` requests plus ``pad`` padding rows."""
    priors = [len(p) for p in PROMPTS[:n]]
    md = build_attention_metadata([1] * n, priors, rows[:n], BLOCK, 16, 512, num_padded_tokens=n + pad)
    ids = torch.tensor([7, 8, 9][:n] + [0] * pad)
    positions = torch.tensor(priors + [0] * pad)
    old = cpu_kernels.set_enabled(kernels)
    try:
        return CpuStep(model).forward(ids, positions, caches, md)
    finally:
        cpu_kernels.set_enabled(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_stack_equals_the_eager_layers(tiny, dtype, monkeypatch) -> None:
    model = tiny.to(dtype)
    try:
        rows = round_robin_block_rows([len(p) for p in PROMPTS], BLOCK)
        caches = _prefilled(model, rows)
        eager_caches = [c.clone() for c in caches]
        runs = []
        real_run = cpu_kernels.DecodeStack.run
        monkeypatch.setattr(
            cpu_kernels.DecodeStack, "run", lambda self, *a, **k: runs.append(1) or real_run(self, *a, **k)
        )
        n, pad = 3, 1
        got = _decode_step(model, caches, rows, True, n, pad)
        want = _decode_step(model, eager_caches, rows, False, n, pad)
        assert runs == [1]  # the kernel path really took the step
        tol = {"atol": 1e-5, "rtol": 0} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 3e-2}
        torch.testing.assert_close(got[:n].float(), want[:n].float(), **tol)
        for a, b in zip(caches, eager_caches, strict=True):
            torch.testing.assert_close(a.float(), b.float(), **tol)
    finally:
        tiny.to(torch.float32)


def _stack_step(model):
    """(the model's DecodeStack, the prefilled caches, the decode step's metadata, h, cos, sin)."""
    rows = round_robin_block_rows([len(p) for p in PROMPTS], BLOCK)
    caches = _prefilled(model, rows)
    md = build_attention_metadata([1, 1, 1], [len(p) for p in PROMPTS], rows, BLOCK, 16, 512)
    stack = CpuStep(model).decode_stack(torch.zeros(3, 64), caches, md)
    assert stack is not None
    return stack, caches, md, torch.randn(3, 64), torch.ones(3, 16), torch.zeros(3, 16)


def test_decode_stack_bad_slot_or_block_raises_and_changes_nothing(tiny) -> None:
    stack, caches, md, h, cos, sin = _stack_step(tiny)
    h0, before = h.clone(), [c.clone() for c in caches]
    bad = md.slot_mapping.clone()
    bad[1] = 64 * BLOCK
    with pytest.raises(ValueError, match=rf"a slot is outside \[0, {64 * BLOCK}\)"):
        stack.run(caches, h, cos, sin, bad, md.block_table, md.seq_lens.long(), 512, 0.25)
    table = md.block_table.clone()
    table[2, 0] = 64  # past the 64-block caches
    with pytest.raises(ValueError, match=r"block id outside \[1, 64\)"):
        stack.run(caches, h, cos, sin, md.slot_mapping, table, md.seq_lens.long(), 512, 0.25)
    assert torch.equal(h, h0)
    assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))


def test_decode_stack_names_a_misshapen_tensor(tiny) -> None:
    caches = new_caches(tiny, 8, BLOCK)
    layers = decode_stack_layers(tiny, caches)
    layers[1] = (*layers[1][:6], layers[1][6].t(), layers[1][7])
    with pytest.raises(ValueError, match=r"layer 1 down: need contiguous \(64, 96\)"):
        cpu_kernels.DecodeStack(layers, 4, 2, 16, 1e-5)


def test_decode_stack_holds_no_cache_and_checks_the_steps_caches(tiny) -> None:
    import gc
    import weakref

    stack, caches, md, h, cos, sin = _stack_step(tiny)
    args = (h, cos, sin, md.slot_mapping, md.block_table, md.seq_lens.long(), 512, 0.25)
    with pytest.raises(ValueError, match=r"kv_caches\[1\] must be a contiguous \(2, 64, 4, 2, 16\)"):
        stack.run([caches[0], caches[1][:, :32]], *args)
    with pytest.raises(ValueError, match="got 1 KV caches for 2 layers"):
        stack.run(caches[:1], *args)
    # A dropped engine's caches are freed: the model's stack does not keep them (2 GB for the default).
    probe = weakref.ref(caches[0])
    del caches
    gc.collect()
    assert probe() is None
