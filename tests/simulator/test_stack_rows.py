"""The step model follows the engine's decode-stack routing: a decode-only step of up to
``stack_rows`` rows (64 for a float32 GGUF-block model, whose block kernel takes the whole step in one
call) pays no ``eager_step``; anything else above ``SMALL_STEP_ROWS`` rows does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for model_fixtures

from segserve.simulator.fit import fit_linear  # noqa: E402
from segserve.simulator.profile import samples_from_json, samples_to_json  # noqa: E402
from segserve.simulator.step_model import (  # noqa: E402
    FEATURES,
    SMALL_STEP_ROWS,
    LinearStepModel,
    RequestSlice,
    StepComposition,
    model_from_dict,
)

EAGER = FEATURES.index("eager_step")


def decodes(n: int, stack_rows: int = SMALL_STEP_ROWS, chunk: int = 0) -> StepComposition:
    slices = tuple(RequestSlice(100, 1, True, True) for _ in range(n))
    if chunk:
        slices += (RequestSlice(0, chunk, False, True),)
    return StepComposition(slices, n + chunk, 0, stack_rows)


@pytest.mark.parametrize(
    ("comp", "eager"),
    [
        (decodes(8), False),  # within the small-row kernels whatever the stack takes
        (decodes(9), True),  # a dense model's stack stops at 8
        (decodes(16, stack_rows=64), False),  # a float32 block model's stack takes it
        (decodes(64, stack_rows=64), False),
        (decodes(65, stack_rows=64), True),
        (decodes(12, stack_rows=64, chunk=20), True),  # a chunk beside decodes: forward_chunk
    ],
)
def test_eager_step_follows_the_stack_limit(comp, eager):
    assert comp.eager is eager
    assert comp.features()[EAGER] == float(eager)


def test_the_profile_keeps_the_samples_stack_limit_and_predicts_with_it():
    samples = [(decodes(b, stack_rows=64), 0.01 + 0.002 * b) for b in (1, 2, 4, 8, 16, 32, 64)]
    samples += [(decodes(4, 64, chunk=c), 0.05 + 0.001 * c) for c in (16, 64, 128, 256)]
    fitted, _ = fit_linear(samples)
    assert fitted.decode_stack_rows == 64
    again = model_from_dict(fitted.to_dict())
    assert again.decode_stack_rows == 64
    # A profile file from before the field reads as the dense limit.
    old = fitted.to_dict()
    del old["decode_stack_rows"]
    assert model_from_dict(old).decode_stack_rows == SMALL_STEP_ROWS


def test_samples_files_carry_the_stack_limit():
    rows = samples_to_json([(decodes(16, stack_rows=64), 0.03)])
    assert rows[0]["stack_rows"] == 64
    ((comp, seconds),) = samples_from_json(rows)
    assert (comp.stack_rows, comp.eager, seconds) == (64, False, 0.03)
    del rows[0]["stack_rows"]  # a file written before the field
    assert samples_from_json(rows)[0][0].stack_rows == SMALL_STEP_ROWS


@pytest.mark.parametrize("bad", [4, 0, -1, 8.5])
def test_a_stack_limit_below_the_small_rows_is_refused(bad):
    with pytest.raises(ValueError, match=f"decode_stack_rows={bad!r} must be an integer >= 8"):
        LinearStepModel({"step": 0.01}, decode_stack_rows=bad)


def test_the_engine_reports_its_stack_limit(tmp_path):
    import torch
    from model_fixtures import tiny_hf_model, train_tiny_tokenizer, write_tiny_gguf

    from segserve import LLMEngine
    from segserve.kernels import cpu as cpu_kernels
    from segserve.models.loader import load_model
    from segserve.simulator.replay import engine_stack_rows

    if not cpu_kernels.enabled():
        pytest.skip(f"compiled kernels unavailable: {cpu_kernels.unavailable_reason()}")
    path = tmp_path / "tiny-Q4_1.gguf"
    write_tiny_gguf(path, tiny_hf_model(), train_tiny_tokenizer(), qtype="Q4_1")
    for dtype, rows in ((torch.float32, 64), (torch.bfloat16, SMALL_STEP_ROWS)):
        engine = LLMEngine(model=load_model(str(path), dtype=dtype), dtype=str(dtype)[6:], num_kv_blocks=16,
                           block_size=4)
        assert engine_stack_rows(engine) == rows


def test_a_dense_bfloat16_engine_with_tile_copies_reports_the_tile_stack_limit(tmp_path):
    import torch
    from model_fixtures import save_tiny_hf_dir, tiny_hf_model, train_tiny_tokenizer

    from segserve import LLMEngine
    from segserve.kernels import amx, bf16gemm
    from segserve.kernels import cpu as cpu_kernels
    from segserve.models.loader import load_model
    from segserve.simulator.replay import engine_stack_rows

    if not amx.available() and not bf16gemm.available():
        pytest.skip("no tile GEMM (AMX or AVX-512 BF16) here")
    save_tiny_hf_dir(tmp_path, tiny_hf_model(), train_tiny_tokenizer())
    rows = {}
    for dtype in (torch.float32, torch.bfloat16):
        engine = LLMEngine(model=load_model(str(tmp_path), dtype=dtype), dtype=str(dtype)[6:],
                           num_kv_blocks=16, block_size=4)
        rows[dtype] = engine_stack_rows(engine)
    assert rows == {torch.float32: SMALL_STEP_ROWS, torch.bfloat16: 64}
    assert cpu_kernels.MAX_DECODE_STACK_ROWS_TILES[torch.bfloat16] == 64
    with amx.disabled(), bf16gemm.disabled():  # the per-row register tiles' limit
        assert engine_stack_rows(engine) == cpu_kernels.MAX_DECODE_STACK_ROWS_DENSE[torch.bfloat16]
    with cpu_kernels.disabled():  # the eager forward: the simulator follows
        assert engine_stack_rows(engine) == SMALL_STEP_ROWS
