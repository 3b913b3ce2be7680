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

from segserve.attention.metadata import build_attention_metadata  # noqa: E402
from segserve.kernels import build  # noqa: E402
from segserve.kernels import cpu as cpu_kernels  # noqa: E402
from segserve.models.loader import load_model  # noqa: E402
from segserve.worker.cpu_step import CpuStep  # noqa: E402

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
def _step(model, query_lens: list[int], kernels: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A step after each request's 6-token prefill: ``query_lens`` tokens each (at priors 6), run by
    ``CpuStep`` and by the model's own forward from the same cache -> (CpuStep's, eager hidden)."""
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
        got = CpuStep(model).forward(ids, positions, caches, md)
    finally:
        cpu_kernels.set_enabled(old)
    with cpu_kernels.disabled():
        want = model(ids, positions, eager_caches, md)
    return got, want


@pytest.mark.parametrize(
    "query_lens, kernels, expected",
    [
        ([1, 1, 1], True, {"stack": 1, "linear": 0, "rope_": 0, "rows": 0}),  # decodes: one call in all
        ([1, 4], True, {"stack": 0, "linear": 8, "rope_": 2, "rows": 0}),  # 5 rows: 4 linears + a rope_ each
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
    assert calls == {"stack": 0, "linear": 8, "rope_": 2, "rows": 0}
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_wrong_number_of_caches_raises_on_every_path(tiny_dir) -> None:
    model = load_model(tiny_dir, dtype=torch.float32).model
    caches = new_caches(model, 8, BLOCK)[:1]
    for q in (1, 12):
        md = build_attention_metadata([q], [0], [[1, 2, 3]], BLOCK, 3, 8)
        with pytest.raises(ValueError, match="got 1 KV caches for 2 layers"):
            CpuStep(model).forward(torch.arange(q), torch.arange(q), caches, md)
