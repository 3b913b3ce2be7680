"""The last layer run for the read rows only (``cpu_step.last_layer_rows``) and its metadata
(``attention.metadata.decode_view``).

A many-row step (``forward_chunk``) given ``logits_rows`` writes every row's K/V in every layer, then runs
the last layer's attention, projections and the final norm on those rows alone. The tiny random Llama
(2 layers, 4 query / 2 KV heads): the kept rows equal the full step's within the dtype's tolerance (a
chunk's row then attends through the decode kernel, another summation order), every cache equals the full
step's bit for bit, and the last layer's projections see only the kept rows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for model_fixtures
from model_fixtures import (  # noqa: E402
    hf_logits,
    new_caches,
    save_tiny_hf_dir,
    tiny_hf_model,
    train_tiny_tokenizer,
    write_tiny_gguf,
)

from segserve import LLM, SamplingParams  # noqa: E402
from segserve.attention.metadata import build_attention_metadata, decode_view  # noqa: E402
from segserve.kernels import build  # noqa: E402
from segserve.kernels import cpu as cpu_kernels  # noqa: E402
from segserve.models.loader import load_model  # noqa: E402
from segserve.worker import cpu_step  # noqa: E402
from segserve.worker.cpu_step import CpuStep  # noqa: E402

needs_kernels = pytest.mark.skipif(
    not all(f in build._cpu_flags() for f in build.REQUIRED_CPU_FLAGS), reason="CPU lacks AVX-512 BF16"
)
BLOCK = 4


def test_decode_view_makes_each_row_a_decode_at_its_position() -> None:
    # A decode at prior 7, a 5-token chunk from 0, a 3-token chunk at prior 4: rows 0 | 1-5 | 6-8.
    md = build_attention_metadata([1, 5, 3], [7, 0, 4], [[1, 2], [3, 4], [5, 6]], BLOCK, 4, 8)
    view = decode_view(md, [0, 5, 8, 3])
    assert view.prior_tokens_cpu == (7, 4, 6, 2)
    assert view.seq_lens.tolist() == [8, 5, 7, 3]
    assert view.block_table.tolist() == [[1, 2, 0, 0], [3, 4, 0, 0], [5, 6, 0, 0], [3, 4, 0, 0]]
    # slot = block * 4 + offset: position 7 of [1, 2] -> 2*4+3; 4 of [3, 4] -> 4*4+0; 6 of [5, 6] -> 6*4+2
    assert view.slot_mapping.tolist() == [11, 16, 26, 14]
    assert view.query_start_loc_cpu == (0, 1, 2, 3, 4)
    assert (view.num_actual_tokens, view.num_padded_tokens, view.max_query_len) == (4, 4, 1)
    assert (view.block_size, view.kv_segment_size) == (BLOCK, 8)
    empty = decode_view(md, [])
    assert (empty.num_actual_tokens, empty.query_start_loc_cpu, empty.block_table.shape) == (0, (0,), (0, 4))


@pytest.mark.parametrize("rows", [[9], [-1], [0, 12]])
def test_decode_view_refuses_a_row_outside_the_step(rows) -> None:
    md = build_attention_metadata([1, 5, 3], [7, 0, 4], [[1, 2], [3, 4], [5, 6]], BLOCK, 4, 8,
                                  num_padded_tokens=16)  # padding rows 9-15 are not real rows either
    bad = next(r for r in rows if not 0 <= r < 9)
    with pytest.raises(ValueError, match=rf"row {bad} is not a real row of the step \(0 <= row < 9\)"):
        decode_view(md, rows)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny Llama with 32-wide heads (hidden 128): on an AMX CPU its bfloat16 QKV GEMM also rotates
    and writes the KV in its stores (the fused branch of ``last_layer_rows``)."""
    path = tmp_path_factory.mktemp("llama_rows")
    save_tiny_hf_dir(path, tiny_hf_model("llama", hidden_size=128), train_tiny_tokenizer())
    return path


def _mixed_step(model, logits_rows, padded: int | None = None, query_lens=(1, 8, 3)):
    """A step of ``query_lens`` tokens after a 6-token prefill each (by default 12 rows: a decode, an
    8-token chunk, a 3-token chunk) from the same caches twice: full, and with ``logits_rows`` -> (full
    hidden, full caches, kept hidden, kept caches, the rows each projection of the step saw)."""
    n = len(query_lens)
    total = sum(query_lens)
    rows = [[1 + 4 * r + i for i in range(4)] for r in range(n)]
    base = new_caches(model, 4 * n + 1, BLOCK)
    with cpu_kernels.disabled():
        for row in rows:
            prefill = build_attention_metadata([6], [0], [row], BLOCK, 4, 8)
            model(torch.arange(6), torch.arange(6), base, prefill)
    md = build_attention_metadata(query_lens, [6] * n, rows, BLOCK, 4, 8, num_padded_tokens=padded)
    ids = torch.cat([torch.arange(20, 20 + q) for q in query_lens])
    positions = torch.cat([torch.arange(6, 6 + q) for q in query_lens])
    if padded is not None:
        ids = torch.cat([ids, torch.zeros(padded - total, dtype=torch.long)])
        positions = torch.cat([positions, torch.zeros(padded - total, dtype=torch.long)])
    step = CpuStep(model)
    step.prepack()
    results = []
    for keep in (None, logits_rows):
        caches = [c.clone() for c in base]
        seen = []
        real = cpu_step._project

        def spy(linear, x, *a, real=real, seen=seen, **kw):
            seen.append(x.shape[0])
            return real(linear, x, *a, **kw)

        real_amx = cpu_step.amx.linear

        def spy_fused(x, *a, real_amx=real_amx, seen=seen, **kw):
            if kw.get("rope_kv") is not None:  # the AMX QKV GEMM that rotates and writes the KV itself
                seen.append(x.shape[0])
            return real_amx(x, *a, **kw)

        cpu_step._project, cpu_step.amx.linear = spy, spy_fused
        try:
            with torch.inference_mode():
                hidden = step.forward(ids, positions, caches, md, logits_rows=keep).clone()
        finally:
            cpu_step._project, cpu_step.amx.linear = real, real_amx
        results.append((hidden, caches, seen))
    (full, full_caches, _), (kept, kept_caches, seen) = results
    return full, full_caches, kept, kept_caches, seen


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [None, 16])
def test_the_last_layer_runs_the_kept_rows_and_writes_every_rows_kv(tiny_dir, dtype, padded) -> None:
    model = load_model(tiny_dir, dtype=dtype).model
    keep = [0, 8, 11]  # the decode, the 8-token chunk's last row, the 3-token chunk's last row
    full, full_caches, kept, kept_caches, seen = _mixed_step(model, keep, padded)
    rows = padded or 12
    # Layer 0: qkv, o, gate_up, down on every row; the last layer: qkv on every row, the rest on 3 rows.
    assert seen == [rows] * 4 + [rows, 3, 3, 3]
    for g, w in zip(kept_caches, full_caches, strict=True):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    # The chunks' rows attend through the decode kernel in the kept step: another summation order.
    tol = {"atol": 3e-2, "rtol": 3e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 0}
    torch.testing.assert_close(kept[keep], full[keep], **tol)
    # The decode's row takes the decode kernel in both steps, and the projections treat rows alike.
    assert torch.equal(kept[0], full[0])


@pytest.fixture(scope="module")
def q4_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_q4") / "tiny-Q4_1.gguf"
    write_tiny_gguf(path, tiny_hf_model("llama", hidden_size=128), train_tiny_tokenizer(), qtype="Q4_1")
    return path


@needs_kernels
@pytest.mark.parametrize("keep", [[15], [0, 10, 15]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_block_projections_of_the_kept_rows_take_the_steps_kernel(q4_path, keep, dtype) -> None:
    """A Q4_1 weight picks its kernel by row count. The kept rows take the one the whole step takes: a
    lone row must not take the integer-activation product of a lone decode (its inputs rounded per block:
    the first token's logprobs of a 356-token prompt moved by 7e-4 against transformers' 1e-4 tolerance in
    tests/e2e/test_engine_parity.py, budget 17), nor, in bfloat16, the exact-weight row kernel where the
    step's GEMM rounds the weights to bfloat16 (the decode row would then differ from the full step's)."""
    model = load_model(q4_path, dtype=dtype).model
    # 16 rows: above the bfloat16 row kernel's 12, so that step dequantizes to bfloat16 tiles
    full, full_caches, kept, kept_caches, _ = _mixed_step(model, keep, query_lens=(1, 10, 5))
    for g, w in zip(kept_caches, full_caches, strict=True):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    tol = {"atol": 3e-2, "rtol": 3e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 0}
    torch.testing.assert_close(kept[keep], full[keep], **tol)
    if 0 in keep:  # the decode's row: the same attention kernel and the same products in both steps
        assert torch.equal(kept[0], full[0])


@needs_kernels
def test_no_kept_rows_still_writes_every_rows_kv(tiny_dir) -> None:
    model = load_model(tiny_dir, dtype=torch.bfloat16).model
    _, full_caches, _, kept_caches, seen = _mixed_step(model, [])
    assert seen == [12] * 4 + [12]  # the last layer's QKV projection alone
    for g, w in zip(kept_caches, full_caches, strict=True):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


@needs_kernels
@pytest.mark.parametrize("rows", [[12], [-1], [3, 16]])
def test_a_logits_row_outside_the_step_is_refused_before_anything_is_written(tiny_dir, rows) -> None:
    model = load_model(tiny_dir, dtype=torch.float32).model
    md = build_attention_metadata([4, 8], [0, 0], [[1], [2, 3]], BLOCK, 4, 8)
    caches = new_caches(model, 4, BLOCK)
    bad = next(r for r in rows if not 0 <= r < 12)
    message = rf"logits row {bad} is not a real row of the step \(0 <= row < 12\)"
    with pytest.raises(ValueError, match=message):
        CpuStep(model).forward(torch.arange(12), torch.cat([torch.arange(4), torch.arange(8)]), caches, md,
                               logits_rows=rows)
    assert all(not c.any() for c in caches)


@needs_kernels
def test_prompt_logprobs_and_greedy_tokens_equal_transformers_with_the_last_layer_pruned(tiny_dir) -> None:
    """Two 12-token prompts in one 24-row step (the many-row path), one scoring its prompt: the runner
    keeps every row for that step, and the other request's tokens come from its kept row alone."""
    hf = tiny_hf_model("llama", hidden_size=128)
    prompts = [list(range(10, 22)), list(range(40, 52))]
    llm = LLM(model=str(tiny_dir), dtype="float32", num_kv_blocks=32, max_num_batched_tokens=64,
              max_model_len=64)
    scored = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for params in ([scored, plain], [plain, plain]):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs, strict=True):
            tokens = list(prompt)
            for _ in range(4):
                tokens.append(int(hf_logits(hf, tokens)[-1].argmax()))
            assert list(out.outputs[0].token_ids) == tokens[len(prompt):]
        want = torch.log_softmax(hf_logits(hf, prompts[0]), dim=-1)
        if params[0] is scored:
            got = [next(iter(pos.values())).logprob for pos in outs[0].prompt_logprobs[1:]]
            expected = [float(want[j, prompts[0][j + 1]]) for j in range(len(prompts[0]) - 1)]
            assert got == pytest.approx(expected, abs=1e-4)
