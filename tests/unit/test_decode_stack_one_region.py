"""The one-region decode stack equals the per-kernel compiled path bit for bit.

``sg_decode_stack`` runs a whole decode step inside one OpenMP parallel region, its kernels sharing the
team through worksharing loops; ``forward_small`` calls the same kernels one entry point at a time
(``sg_linear``, ``sg_rope``, ``sg_write_kv``, ``sg_decode_attention``, each opening its own region).
Every output element is computed by the same code in the same order either way, so hidden states and
KV caches must be equal exactly (``torch.equal``), for float32 and bfloat16 weights and for GGUF Q4_1 /
Q8_0 blocks (with float and, where the CPU has VNNI, int8 activations). Tiny models: 2 layers, hidden 64,
4 query / 2 KV heads of dim 16; a step of three decodes over interleaved blocks plus one padding row.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for model_fixtures
from model_fixtures import (  # noqa: E402
    new_caches,
    save_tiny_hf_dir,
    tiny_hf_model,
    train_tiny_tokenizer,
    write_tiny_gguf,
)

from segserve.attention.metadata import build_attention_metadata  # noqa: E402
from segserve.kernels import build, quant  # noqa: E402
from segserve.kernels import cpu as cpu_kernels  # noqa: E402
from segserve.models.loader import load_model  # noqa: E402
from segserve.worker.cpu_step import CpuStep  # noqa: E402

pytestmark = pytest.mark.skipif(
    not all(f in build._cpu_flags() for f in build.REQUIRED_CPU_FLAGS), reason="CPU lacks AVX-512 BF16"
)
BLOCK = 4
PROMPTS = [list(range(10, 23)), list(range(40, 45)), list(range(60, 90))]  # 13, 5, 30 tokens
ROWS = [[1, 4, 7, 9], [2, 5], [3, 6, 8, 10, 11, 12, 13, 14]]  # interleaved, room for one more token each


# More decodes than the stack's OWN_MERGE_ROWS (8): its attention merge is shared by the threads then.
MANY_PROMPTS = [list(range(100 + 7 * i, 100 + 7 * i + 3 + i)) for i in range(10)]  # 3 .. 12 tokens
MANY_ROWS = [[1 + 4 * i, 2 + 4 * i, 3 + 4 * i, 4 + 4 * i] for i in range(10)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny Hugging Face directory and the same model as Q4_1 and Q8_0 GGUF files."""
    root = tmp_path_factory.mktemp("one_region")
    hf, tok = tiny_hf_model(), train_tiny_tokenizer()
    save_tiny_hf_dir(root / "hf", hf, tok)
    out = {"hf": root / "hf"}
    for qtype in ("Q4_1", "Q8_0"):
        out[qtype] = root / f"tiny-{qtype}.gguf"
        write_tiny_gguf(out[qtype], hf, tok, qtype=qtype)
    return out


@torch.inference_mode()
def _prefilled(model, prompts, rows) -> list[torch.Tensor]:
    """New caches holding each prompt's K/V in its block-table row, written by the eager model."""
    caches = new_caches(model, 64, BLOCK)
    with cpu_kernels.disabled():
        for prompt, row in zip(prompts, rows, strict=True):
            md = build_attention_metadata([len(prompt)], [0], [row], BLOCK, 16, 512)
            model(torch.tensor(prompt), torch.arange(len(prompt)), caches, md)
    return caches


@torch.inference_mode()
def _step(model, one_region: bool, monkeypatch, prompts=PROMPTS, rows=ROWS
          ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Prefill the prompts eagerly, then one decode step of the requests plus a padding row, through
    the decode stack (``one_region``) or through ``forward_small`` layer by layer."""
    caches = _prefilled(model, prompts, rows)
    priors = [len(p) for p in prompts]
    n = len(prompts)
    md = build_attention_metadata([1] * n, priors, rows, BLOCK, 16, 512, num_padded_tokens=n + 1)
    runs = []
    with monkeypatch.context() as m:
        if one_region:
            real = cpu_kernels.DecodeStack.run
            m.setattr(
                cpu_kernels.DecodeStack, "run", lambda self, *a, **k: runs.append(1) or real(self, *a, **k)
            )
        else:
            m.setattr(CpuStep, "decode_stack", lambda self, *a, **k: None)
            # More rows than 8 would go to forward_chunk's GEMMs: keep them on the per-kernel path.
            m.setitem(cpu_kernels.MAX_SMALL_ROWS, model.activation_dtype, max(8, n + 1))
        old = cpu_kernels.set_enabled(True)
        try:
            ids = torch.tensor([7 + i for i in range(n)] + [0])
            h = CpuStep(model).forward(ids, torch.tensor([*priors, 0]), caches, md)
        finally:
            cpu_kernels.set_enabled(old)
    assert runs == ([1] if one_region else [])  # each run took the path it names
    return h, caches


def _assert_same(model, monkeypatch, prompts=PROMPTS, rows=ROWS) -> None:
    n = len(prompts)
    h_stack, caches_stack = _step(model, True, monkeypatch, prompts, rows)
    h_layers, caches_layers = _step(model, False, monkeypatch, prompts, rows)
    assert torch.equal(h_stack[:n], h_layers[:n])
    assert all(torch.equal(a, b) for a, b in zip(caches_stack, caches_layers, strict=True))
    assert h_stack[:n].abs().sum() > 0  # a real result, not two empty ones


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_stack_equals_the_per_kernel_path_bitwise(files, dtype, monkeypatch) -> None:
    _assert_same(load_model(files["hf"], dtype=dtype).model, monkeypatch)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_stack_equals_the_per_kernel_path_bitwise(files, qtype, dtype, int8, monkeypatch) -> None:
    if int8 and not quant.int8_built():
        pytest.skip("this CPU or build lacks the AVX-512 VNNI kernel")
    model = load_model(files[qtype], dtype=dtype).model
    assert any(isinstance(getattr(m, "quant_weight", None), quant.QuantWeight) for m in model.modules())
    old = quant.set_int8(int8)
    try:
        _assert_same(model, monkeypatch)
    finally:
        quant.set_int8(old)


def test_stack_timing_fills_every_phase_of_every_layer_and_stops_when_unset(files, monkeypatch) -> None:
    model = load_model(files["Q4_1"], dtype=torch.float32).model
    buf = torch.zeros(len(model.layers), len(cpu_kernels.STACK_PHASES), dtype=torch.int64)
    cpu_kernels.stack_timing(buf)
    try:
        h, _ = _step(model, True, monkeypatch)
    finally:
        cpu_kernels.stack_timing(None)
    assert (buf > 0).all(), buf
    assert (buf < 10**9).all(), buf  # nanoseconds of a tiny step's phase, not garbage
    timed = buf.clone()
    h_again, _ = _step(model, True, monkeypatch)
    assert torch.equal(buf, timed)  # off: nothing more added
    assert torch.equal(h[:3], h_again[:3])  # timing changes no result
    short = torch.zeros(1, len(cpu_kernels.STACK_PHASES), dtype=torch.int64)  # fewer rows than layers
    cpu_kernels.stack_timing(short)
    try:
        _step(model, True, monkeypatch)
    finally:
        cpu_kernels.stack_timing(None)
    assert (short > 0).all()
    with pytest.raises(ValueError, match="int64"):
        cpu_kernels.stack_timing(torch.zeros(2, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\(layers, 5\)"):
        cpu_kernels.stack_timing(torch.zeros(2, 6, dtype=torch.int64))


@pytest.fixture(scope="module")
def files_d64(tmp_path_factory):
    """A tiny model with head dim 64 (hidden 256, 4 query heads), whose RoPE takes the vector loop
    (head dims that are a multiple of 32; the other fixtures' 16 take the scalar one), dense and Q4_1."""
    root = tmp_path_factory.mktemp("one_region_d64")
    hf, tok = tiny_hf_model(hidden_size=256), train_tiny_tokenizer()
    save_tiny_hf_dir(root / "hf", hf, tok)
    write_tiny_gguf(root / "tiny-Q4_1.gguf", hf, tok, qtype="Q4_1")
    return {"hf": root / "hf", "Q4_1": root / "tiny-Q4_1.gguf"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dim_64_stack_equals_the_per_kernel_path_bitwise(files_d64, dtype, monkeypatch) -> None:
    """RoPE and the KV write inside the stack's attention items (vector RoPE loop) give the bits of
    the separate RoPE pass and KV write."""
    for kind in ("hf", "Q4_1"):
        _assert_same(load_model(files_d64[kind], dtype=dtype).model, monkeypatch)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_more_decodes_than_own_merge_rows_equal_the_per_kernel_path(files, qtype, monkeypatch) -> None:
    """Ten decodes (block models take the stack up to 64 rows): the shared attention merge path."""
    model = load_model(files[qtype], dtype=torch.float32).model
    _assert_same(model, monkeypatch, MANY_PROMPTS, MANY_ROWS)


@pytest.mark.parametrize("source", ["hf", "Q4_1"])
def test_stack_barriers_hold_with_more_threads_than_cores(files, source, monkeypatch) -> None:
    # segserve_team_sync.h's adaptive barrier: with more threads than cores some waits outlast the spin
    # budget and sleep on the futex (and shrink the budget); every step must still equal the per-kernel
    # path, whose regions use libgomp's own barriers.
    model = load_model(files[source], dtype=torch.float32).model
    old = torch.get_num_threads()
    torch.set_num_threads((os.cpu_count() or 2) + 1)
    try:
        h_layers, _ = _step(model, False, monkeypatch)
        for _ in range(5):
            h_stack, _ = _step(model, True, monkeypatch)
            assert torch.equal(h_stack[:3], h_layers[:3])
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("source, dtype", [("hf", torch.float32), ("hf", torch.bfloat16),
                                           ("Q4_1", torch.float32), ("Q8_0", torch.float32),
                                           ("Q4_1", torch.bfloat16)])
def test_the_stacks_own_head_gives_the_lm_heads_logits_bitwise(files, source, dtype) -> None:
    # A decode-stack step computes the final norm and the logits in its own call (StackHead): they must
    # be the bits add_rmsnorm_ and compute_logits give for the same step's layers.
    model = load_model(files[source], dtype=dtype).model
    caches = _prefilled(model, PROMPTS, ROWS)
    priors = [len(p) for p in PROMPTS]
    md = build_attention_metadata([1, 1, 1], priors, ROWS, BLOCK, 16, 512)
    ids, pos = torch.tensor([7, 8, 9]), torch.tensor(priors)
    old = cpu_kernels.set_enabled(True)
    try:
        step = CpuStep(model)
        saved = [c.clone() for c in caches]
        again = [c.clone() for c in caches]
        hidden = step.forward(ids, pos, caches, md)
        assert step._step_logits is not None and step._step_logits[0] is hidden  # the head ran in the call
        fused = step.logits_of(hidden, [2, 0])
        assert step._step_logits is None  # read once
        # Every row in order (a batch of decodes): the step's own buffer, the same bits.
        all_rows = step.logits_of(step.forward(ids, pos, again, md), [0, 1, 2])
        assert torch.equal(all_rows[[2, 0]], fused)
        step._stack_head = lambda rows, dtype: None  # the same step with the head in its own calls
        plain_hidden = step.forward(ids, pos, saved, md)
        want = step.logits_of(plain_hidden, [2, 0])
    finally:
        cpu_kernels.set_enabled(old)
    assert torch.equal(hidden, plain_hidden)
    assert fused.shape == (2, model.config.vocab_size) and fused.dtype == torch.float32
    assert torch.equal(fused, want)
    assert torch.equal(fused, step.compute_logits(hidden[[2, 0]]))


def test_a_bad_stack_head_is_refused_by_name(files) -> None:
    model = load_model(files["hf"], dtype=torch.float32).model
    caches = new_caches(model, 64, BLOCK)
    step = CpuStep(model)
    md = build_attention_metadata([1], [0], [[1]], BLOCK, 16, 512)
    stack = step.decode_stack(torch.tensor([3]), caches, md)
    assert stack is not None
    h, cos, sin = torch.zeros(1, 64), *model.rope_at(torch.tensor([0]))
    args = (caches, h, cos, sin, md.slot_mapping, md.block_table, md.seq_lens.long(), 512, 0.25)
    w, vocab = model.lm_head_weight, model.lm_head_weight.shape[0]
    good = dict(norm_weight=model.norm.weight, weight=w, hidden=torch.empty(1, 64),
                logits=torch.empty(1, vocab))
    for field, bad, match in (
        ("logits", torch.empty(1, vocab, dtype=torch.bfloat16), "head logits"),
        ("hidden", torch.empty(2, 64), "head hidden"),
        ("norm_weight", torch.ones(32), "head norm_weight"),
        ("weight", w[:, :32].contiguous(), "head weight"),
    ):
        head = cpu_kernels.StackHead(**(good | {field: bad}))
        with pytest.raises(ValueError, match=match):
            stack.run(*args, head=head)
    assert caches[0].abs().sum() == 0  # refused before anything was written
