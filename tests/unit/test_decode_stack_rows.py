"""Which decode-only steps of more than ``MAX_SMALL_ROWS`` rows take the one-call decode stack.

A float32 model with GGUF-block projections runs decode-only steps of up to
``MAX_DECODE_STACK_ROWS_BLOCKS[float32]`` rows in one ``DecodeStack`` call (its block kernel takes any
row count), and that equals the per-layer GEMM path (``forward_chunk``) within float32 summation order
(tolerance 1e-5 on states of magnitude ~1; observed ~1e-6). bfloat16 block models and float32 models
without blocks keep ``forward_chunk`` there; dense bfloat16 models take the stack, with tile products of
the packed weights once prepacked (tests/unit/test_decode_stack_tiles.py), else its register tiles. Tiny Q4_1
model: 2 layers, hidden 64, 4 query / 2 KV heads of dim 16; twelve decodes of 5-token prompts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for model_fixtures
from model_fixtures import new_caches, tiny_hf_model, train_tiny_tokenizer, write_tiny_gguf  # noqa: E402

from segserve.attention.metadata import build_attention_metadata  # noqa: E402
from segserve.kernels import build  # noqa: E402
from segserve.kernels import cpu as cpu_kernels  # noqa: E402
from segserve.models.loader import load_model  # noqa: E402
from segserve.worker import cpu_step  # noqa: E402
from segserve.worker.cpu_step import CpuStep  # noqa: E402

pytestmark = pytest.mark.skipif(
    not all(f in build._cpu_flags() for f in build.REQUIRED_CPU_FLAGS), reason="CPU lacks AVX-512 BF16"
)
BLOCK, N = 4, 12
PROMPTS = [[10 + 7 * i + t for t in range(5)] for i in range(N)]
ROWS = [[2 * i + 1, 2 * i + 2] for i in range(N)]  # 6 tokens (prompt + the decode) in 2 blocks each


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("rows") / "tiny-Q4_1.gguf"
    write_tiny_gguf(path, tiny_hf_model(), train_tiny_tokenizer(), qtype="Q4_1")
    return path


@torch.inference_mode()
def _step(model, monkeypatch) -> tuple[torch.Tensor, list[torch.Tensor], list[str]]:
    """Prefill eagerly, then one decode step of the twelve requests; returns the states, the caches and
    which path took the step ("stack" or "chunk")."""
    caches = new_caches(model, 64, BLOCK)
    with cpu_kernels.disabled():
        for prompt, row in zip(PROMPTS, ROWS, strict=True):
            md = build_attention_metadata([len(prompt)], [0], [row], BLOCK, 16, 512)
            model(torch.tensor(prompt), torch.arange(len(prompt)), caches, md)
    md = build_attention_metadata([1] * N, [5] * N, ROWS, BLOCK, 16, 512)
    paths = []
    run, chunk = cpu_kernels.DecodeStack.run, cpu_step.forward_chunk
    with monkeypatch.context() as m:
        m.setattr(cpu_kernels.DecodeStack, "run", lambda s, *a, **k: paths.append("stack") or run(s, *a, **k))
        m.setattr(cpu_step, "forward_chunk", lambda *a, **k: paths.append("chunk") or chunk(*a, **k))
        old = cpu_kernels.set_enabled(True)
        try:
            h = CpuStep(model).forward(torch.arange(100, 100 + N), torch.full((N,), 5), caches, md)
        finally:
            cpu_kernels.set_enabled(old)
    return h, caches, paths


def test_float32_block_decodes_over_eight_rows_take_the_stack_and_equal_the_gemm_path(gguf, monkeypatch):
    limit = cpu_kernels.MAX_DECODE_STACK_ROWS_BLOCKS[torch.float32]
    assert cpu_kernels.MAX_SMALL_ROWS[torch.float32] < N <= limit
    model = load_model(gguf, dtype=torch.float32).model
    got, got_caches, paths = _step(model, monkeypatch)
    assert paths == ["stack"]
    monkeypatch.setitem(cpu_kernels.MAX_DECODE_STACK_ROWS_BLOCKS, torch.float32, 8)
    want, want_caches, paths = _step(model, monkeypatch)
    assert paths == ["chunk"]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for a, b in zip(got_caches, want_caches, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert got.abs().sum() > 0


def test_bfloat16_block_decodes_over_eight_rows_keep_the_gemm_path(gguf, monkeypatch):
    assert cpu_kernels.MAX_DECODE_STACK_ROWS_BLOCKS[torch.bfloat16] < N
    _, _, paths = _step(load_model(gguf, dtype=torch.bfloat16).model, monkeypatch)
    assert paths == ["chunk"]


def _dense(gguf, dtype):
    return load_model(gguf, dtype=dtype, quantization="none").model


def test_dense_bfloat16_decodes_over_eight_rows_take_the_stack_without_amx(gguf, monkeypatch):
    # Without AMX tile copies (AMX off, as on a Zen 4), the stack's register tiles run the projections.
    from segserve.kernels import amx

    limit = cpu_kernels.MAX_DECODE_STACK_ROWS_DENSE[torch.bfloat16]
    assert cpu_kernels.MAX_SMALL_ROWS[torch.bfloat16] < N <= limit
    with amx.disabled():
        model = _dense(gguf, torch.bfloat16)
        got, got_caches, paths = _step(model, monkeypatch)
        assert paths == ["stack"]
        monkeypatch.setitem(cpu_kernels.MAX_DECODE_STACK_ROWS_DENSE, torch.bfloat16, 8)
        want, want_caches, paths = _step(model, monkeypatch)
    assert paths == ["chunk"]
    # Both round every projection, norm and residual add to bfloat16 at the same points; they differ in
    # float32 summation order, which can move a value by one bfloat16 step (2^-7 relative) and that,
    # through the second layer, by a few: states of magnitude ~1, so 0.05 absolute, most values equal.
    torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0)
    assert (got == want).float().mean() > 0.9
    for a, b in zip(got_caches, want_caches, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=0.05, rtol=0)
    assert got.abs().sum() > 0


def test_dense_float32_decodes_over_eight_rows_keep_the_gemm_path(gguf, monkeypatch):
    assert cpu_kernels.MAX_DECODE_STACK_ROWS_DENSE[torch.float32] < N
    _, _, paths = _step(_dense(gguf, torch.float32), monkeypatch)
    assert paths == ["chunk"]
