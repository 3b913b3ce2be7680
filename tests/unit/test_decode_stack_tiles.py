"""Decode-only bfloat16 steps of 9-64 rows of a dense model run the one-call decode stack with the
projections as tile products of the packed weights (``DecodeStack.run(tiles=...)``): on AMX tiles
(``"amx"``), or without AMX on vdpbf16ps register tiles (``"vdpbf16ps"``, bf16gemm's micro-kernel; the
AMX machine runs it too with AMX switched off). Each equals ``forward_chunk`` over the same tile GEMM
(``amx.linear`` / ``bf16gemm.linear``, the route such steps took before) bit for bit, hidden states and
caches; against the eager model they agree within bfloat16's tolerance (5e-2 + 3 %, as
tests/unit/test_decode_stack.py: two layers of N(0, 0.2) weights amplify the rounding of the attention
partials, which eager rounds to bf16).

Tiny random checkpoints (2 layers, hidden 64, intermediate 96, 4 query / 2 KV heads of dim 16; Qwen2 adds
the q/k/v biases), decodes of distinct 5-20-token prompts over interleaved blocks of 4 tokens, some
steps with padding rows.
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
from segserve.kernels import amx, bf16gemm  # noqa: E402
from segserve.kernels import cpu as cpu_kernels  # noqa: E402
from segserve.models.loader import load_model  # noqa: E402
from segserve.worker import cpu_step  # noqa: E402
from segserve.worker.cpu_step import CpuStep, decode_stack_layers  # noqa: E402

BLOCK, MAX_BLOCKS, NUM_BLOCKS, MOST = 4, 8, 400, 64
PROMPTS = [[(31 * i + 7 * t) % 290 + 5 for t in range(5 + i % 16)] for i in range(MOST)]


@pytest.fixture(params=["amx", "vdpbf16ps"])
def backend(request, monkeypatch):
    """The tile products under test: AMX where it runs; vdpbf16ps with AMX switched off (from 1 row,
    so every step below takes it)."""
    if request.param == "amx":
        if not amx.available():
            pytest.skip(f"no AMX here: {amx.unavailable_reason()}")
        yield "amx"
        return
    if not bf16gemm.available():
        pytest.skip("no AVX-512 BF16 GEMM here")
    monkeypatch.setattr(cpu_step, "TILE_STACK_MIN_ROWS", 1)
    with amx.disabled():
        yield "vdpbf16ps"


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"amx-{request.param}")
    save_tiny_hf_dir(path, tiny_hf_model(request.param), train_tiny_tokenizer())
    return load_model(path, dtype=torch.bfloat16).model


needs_amx = pytest.mark.skipif(not amx.available(), reason=f"no AMX here: {amx.unavailable_reason()}")
ROWS = round_robin_block_rows([len(p) for p in PROMPTS], BLOCK)
assert max(max(r) for r in ROWS) < NUM_BLOCKS


@pytest.fixture(scope="module")
def prefilled(model):
    """The caches after every prompt's eager prefill (one step of 64 chunks)."""
    caches = new_caches(model, NUM_BLOCKS, BLOCK)
    md = build_attention_metadata([len(p) for p in PROMPTS], [0] * MOST, ROWS, BLOCK, MAX_BLOCKS, 512)
    ids = torch.tensor([t for p in PROMPTS for t in p])
    positions = torch.tensor([t for p in PROMPTS for t in range(len(p))])
    with torch.inference_mode(), cpu_kernels.disabled():
        model(ids, positions, caches, md)
    return caches


def _decode_inputs(n: int, pad: int):
    priors = [len(p) for p in PROMPTS[:n]]
    md = build_attention_metadata([1] * n, priors, ROWS[:n], BLOCK, MAX_BLOCKS, 512,
                                  num_padded_tokens=n + pad)
    ids = torch.tensor([(11 * j) % 290 + 3 for j in range(n)] + [0] * pad)
    return ids, torch.tensor(priors + [0] * pad), md


@torch.inference_mode()
def _step(model, caches, n: int, pad: int, monkeypatch, kernels: bool = True):
    """One decode step of the first ``n`` requests plus ``pad`` padding rows, from copies of ``caches``:
    (states, caches after, the routes taken: "stack-amx", "stack-vdpbf16ps", "stack", "chunk-tiles",
    "chunk")."""
    caches = [c.clone() for c in caches]
    routes = []
    run, chunk = cpu_kernels.DecodeStack.run, cpu_step.forward_chunk

    def traced_run(self, *a, **k):
        routes.append(f"stack-{k['tiles']}" if k.get("tiles") else "stack")
        return run(self, *a, **k)

    def traced_chunk(*a, **k):
        tiles = a[5] if len(a) > 5 else k.get("tiles")
        routes.append("chunk" if tiles is None else "chunk-tiles")
        return chunk(*a, **k)

    step = CpuStep(model)
    step.prepack()
    with monkeypatch.context() as m:
        m.setattr(cpu_kernels.DecodeStack, "run", traced_run)
        m.setattr(cpu_step, "forward_chunk", traced_chunk)
        old = cpu_kernels.set_enabled(kernels)
        try:
            ids, positions, md = _decode_inputs(n, pad)
            h = step.forward(ids, positions, caches, md)
        finally:
            cpu_kernels.set_enabled(old)
    return h, caches, routes


def test_stack_timing_fills_every_phase_on_the_tile_path(backend, model, prefilled, monkeypatch):
    buf = torch.zeros(model.config.num_hidden_layers, len(cpu_kernels.STACK_PHASES), dtype=torch.int64)
    cpu_kernels.stack_timing(buf)
    try:
        got, _, routes = _step(model, prefilled, 33, 3, monkeypatch)
    finally:
        cpu_kernels.stack_timing(None)
    assert routes == [f"stack-{backend}"]
    assert (buf > 0).all() and (buf < 10**9).all(), buf  # nanoseconds per phase of a tiny step
    untimed, _, _ = _step(model, prefilled, 33, 3, monkeypatch)
    assert torch.equal(got, untimed)


@pytest.mark.parametrize(
    ("n", "pad"), [(1, 0), (2, 0), (5, 3), (8, 0), (9, 0), (16, 0), (24, 8), (33, 3), (64, 0)]
)
def test_tile_stack_equals_forward_chunk_bitwise(backend, model, prefilled, monkeypatch, n, pad):
    got, got_caches, routes = _step(model, prefilled, n, pad, monkeypatch)
    assert routes == [f"stack-{backend}"]
    step = CpuStep(model)
    step.prepack()
    want_caches = [c.clone() for c in prefilled]
    ids, positions, md = _decode_inputs(n, pad)
    with torch.inference_mode():  # the per-layer route over the same tile GEMM
        want = cpu_step.forward_chunk(model, ids, positions, want_caches, md, step._tile_weights)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_caches, want_caches, strict=True))
    # The step wrote each decode's K and V, and nothing else.
    changed = [(a != b).any(dim=(0, 3, 4)).nonzero().tolist()
               for a, b in zip(got_caches, prefilled, strict=True)]
    slots = sorted([ROWS[j][len(PROMPTS[j]) // BLOCK], len(PROMPTS[j]) % BLOCK] for j in range(n))
    assert all(c == slots for c in changed)
    assert got[:n].float().abs().sum() > 0


@needs_amx
def test_one_row_takes_the_amx_tiles(model, prefilled, monkeypatch):
    assert cpu_step.AMX_STACK_MIN_ROWS == 1  # batch-1 decode too (the constant's comment: 2.5x here)
    _, _, routes = _step(model, prefilled, 1, 0, monkeypatch)
    assert routes == ["stack-amx"]


def test_without_amx_the_tiles_start_at_tile_stack_min_rows(model, prefilled, monkeypatch):
    if not bf16gemm.available():
        pytest.skip("no AVX-512 BF16 GEMM here")
    assert cpu_step.TILE_STACK_MIN_ROWS == 16
    with amx.disabled():
        routes = [_step(model, prefilled, n, 0, monkeypatch)[2][0] for n in (1, 15, 16, 64)]
    assert routes == ["stack", "stack", "stack-vdpbf16ps", "stack-vdpbf16ps"]


@pytest.mark.parametrize(("n", "pad"), [(3, 1), (12, 4), (64, 0)])
def test_tile_stack_agrees_with_the_eager_model(backend, model, prefilled, monkeypatch, n, pad):
    got, got_caches, _ = _step(model, prefilled, n, pad, monkeypatch)
    want, want_caches, routes = _step(model, prefilled, n, pad, monkeypatch, kernels=False)
    assert routes == []
    tol = {"atol": 5e-2, "rtol": 3e-2}
    torch.testing.assert_close(got[:n].float(), want[:n].float(), **tol)
    for a, b in zip(got_caches, want_caches, strict=True):
        torch.testing.assert_close(a.float(), b.float(), **tol)


def test_the_stack_limit_follows_the_tile_copies(backend, model):
    step = CpuStep(model)
    dense = cpu_kernels.MAX_DECODE_STACK_ROWS_DENSE[torch.bfloat16]
    assert step.decode_stack_rows() == dense  # no tile copies yet: the per-row register tiles' limit
    step.prepack()
    assert step.decode_stack_rows() == cpu_kernels.MAX_DECODE_STACK_ROWS_TILES[torch.bfloat16] == 64
    with amx.disabled(), bf16gemm.disabled():
        assert step.decode_stack_rows() == dense


def test_a_bad_slot_is_refused_before_anything_is_written(backend, model, prefilled):
    step = CpuStep(model)
    step.prepack()
    ids, positions, md = _decode_inputs(16, 0)
    caches = [c.clone() for c in prefilled]
    stack = step.decode_stack(ids, caches, md)
    assert stack is not None and stack.tiled
    h = torch.randn(16, 64).to(torch.bfloat16)
    h0 = h.clone()
    cos, sin = torch.ones(16, 16), torch.zeros(16, 16)
    bad = md.slot_mapping.clone()
    bad[5] = NUM_BLOCKS * BLOCK
    with pytest.raises(ValueError, match=rf"a slot is outside \[0, {NUM_BLOCKS * BLOCK}\)"):
        stack.run(caches, h, cos, sin, bad, md.block_table, md.seq_lens.long(), 512, 0.25, tiles=backend)
    assert torch.equal(h, h0)
    assert all(torch.equal(a, b) for a, b in zip(caches, prefilled, strict=True))


def test_tile_rows_and_weights_are_checked(backend, model, prefilled):
    step = CpuStep(model)
    step.prepack()
    layers = decode_stack_layers(model, prefilled)
    plain = cpu_kernels.DecodeStack(layers, 4, 2, 16, 1e-5)
    h, cos, sin = torch.zeros(65, 64, dtype=torch.bfloat16), torch.ones(65, 16), torch.zeros(65, 16)
    md = build_attention_metadata([1] * 65, [5] * 65, [[1, 2]] * 65, BLOCK, MAX_BLOCKS, 512)
    args = (prefilled, h, cos, sin, md.slot_mapping, md.block_table, md.seq_lens.long(), 512, 0.25)
    with pytest.raises(ValueError, match=f"tiles='{backend}' needs a stack built with tile_weights and at "
                                         "most 64 rows"):
        plain.run(*args, tiles=backend)
    tiled = cpu_kernels.DecodeStack(layers, 4, 2, 16, 1e-5, step._tile_weights)
    with pytest.raises(ValueError, match="got 65 rows"):
        tiled.run(*args, tiles=backend)
    with pytest.raises(ValueError, match=r"tiles must be one of \['amx', 'vdpbf16ps'\] or None, got 'avx'"):
        tiled.run(*args, tiles="avx")
    bad = [list(t) for t in step._tile_weights]
    bad[1][3] = bad[1][3].reshape(-1)
    with pytest.raises(ValueError, match=r"layer 1 down: tile weight must be amx.pack's .*\(4, 3, 16, 32"):
        cpu_kernels.DecodeStack(layers, 4, 2, 16, 1e-5, bad)
    with pytest.raises(ValueError, match="need one .* per layer"):
        cpu_kernels.DecodeStack(layers, 4, 2, 16, 1e-5, step._tile_weights[:1])


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def head_model(request, tmp_path_factory):
    """A tiny model whose vocabulary (320) the AMX tiles take (300 is not a multiple of 16)."""
    path = tmp_path_factory.mktemp("amx-head")
    save_tiny_hf_dir(path, tiny_hf_model(vocab_size=320, tie=request.param), train_tiny_tokenizer())
    return load_model(path, dtype=torch.bfloat16).model


@needs_amx
def test_a_vocabulary_the_tiles_do_not_take_keeps_the_onednn_head(model):
    step = CpuStep(model)
    step.prepack()
    assert step._tile_lm_head is None and step._packed_lm_head is not None


@needs_amx
@pytest.mark.parametrize("rows", [1, 2, 9, 32, 33, 64, 65])
def test_the_lm_head_of_many_rows_runs_on_amx_tiles(head_model, rows, monkeypatch):
    model = head_model
    step = CpuStep(model)
    step.prepack()
    assert step._tile_lm_head is not None and step._packed_lm_head is None
    calls = []
    for name in ("rows_linear", "linear"):
        real = getattr(amx, name)
        monkeypatch.setattr(amx, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    hidden = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = step.compute_logits(hidden)
    assert calls == ["rows_linear" if rows <= 32 else "linear"]  # cpu_step.HEAD_ROWS_LINEAR_MAX
    weight = model.lm_head_weight
    assert got.dtype == torch.float32 and torch.equal(got, got.bfloat16().float())  # rounded as the others
    assert torch.equal(got, amx.linear(hidden, amx.pack(weight), *weight.shape).float())
    torch.testing.assert_close(got, model.compute_logits(hidden), atol=2e-2, rtol=1e-2)


@needs_amx
def test_rows_linear_refuses_what_it_does_not_take(head_model):
    packed = amx.pack(head_model.lm_head_weight)
    n, k = head_model.lm_head_weight.shape
    with pytest.raises(ValueError, match=r"x must be \(1 \.\. 64, 64\) bfloat16"):
        amx.rows_linear(torch.zeros(65, k, dtype=torch.bfloat16), packed, n, k)
    with pytest.raises(ValueError, match=r"x must be \(1 \.\. 64, 64\) bfloat16"):
        amx.rows_linear(torch.zeros(4, k), packed, n, k)
    with pytest.raises(ValueError, match=r"packed must be amx.pack's .* tensor for n=16, k=64"):
        amx.rows_linear(torch.zeros(4, k, dtype=torch.bfloat16), packed, 16, k)
