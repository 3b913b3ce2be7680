"""The decode-only table of the step model (issue 18): decode steps on a compiled path cost a per-row-count
intercept plus a per-context-token cost, which the shared feature sum cannot follow when the cost is
not linear in the rows (measured on 2 Zen 4 cores: 1 and 2 rows cost the same)."""

from __future__ import annotations

import random

import pytest

from segserve.simulator.fit import fit_linear
from segserve.simulator.step_model import LinearStepModel, RequestSlice, StepComposition, model_from_dict

# Seconds of a compiled decode-only step by padded rows, before its context: flat from 1 to 2 rows.
TABLE = {1: 0.0130, 2: 0.0131, 4: 0.0190, 8: 0.0400, 16: 0.0700, 32: 0.1200, 64: 0.2000}
CTX = 2e-6  # seconds per context token
GENERIC = LinearStepModel({"step": 0.01, "padded_tokens": 1.5e-3, "prefill_attn": 8e-7, "eager_step": 0.02})


def decode_step(rows: int, padded: int, prior: int) -> StepComposition:
    return StepComposition(tuple(RequestSlice(prior + i, 1, True, True) for i in range(rows)), padded, 0, 64)


def chunk_step(chunk: int, prior: int) -> StepComposition:
    return StepComposition((RequestSlice(prior, chunk, False, True),), chunk, 0, 64)


def true_seconds(comp: StepComposition) -> float:
    if comp.compiled_decode:
        return TABLE[comp.padded_tokens] + CTX * sum(s.prior + 1 for s in comp.slices)
    return GENERIC.predict(comp)


def samples(seed: int = 0) -> list[tuple[StepComposition, float]]:
    rng = random.Random(seed)
    out = []
    for rows in (1, 2, 3, 4, 5, 8, 16, 32, 64):
        padded = 1 << (rows - 1).bit_length()
        for prior in (128, 1024, 2048):
            out.append(decode_step(rows, padded, prior + rng.randrange(8)))
    out += [chunk_step(c, p) for c in (16, 64, 128, 256) for p in (0, 512, 1024)]
    return [(c, true_seconds(c)) for c in out]


def test_the_table_is_recovered_exactly_from_noiseless_steps():
    fitted, stats = fit_linear(samples(), decode_table=True)
    assert fitted.stack_base == pytest.approx(TABLE, rel=1e-6)
    assert fitted.stack_ctx == pytest.approx(CTX, rel=1e-6)
    assert stats["max_abs_rel_err"] < 1e-6


def test_without_the_table_the_flat_rows_cannot_be_fitted():
    fitted, stats = fit_linear(samples())
    assert fitted.stack_base == {} and fitted.stack_ctx == 0.0
    assert stats["max_abs_rel_err"] > 0.2  # one per-row slope for 1..64 decode rows and the chunks


def test_a_slow_outlier_does_not_move_the_table():
    data = samples()
    comp, seconds = data[0]  # one 1-row decode measured during a slow phase of the host
    data[0] = (comp, 3 * seconds)
    fitted, _ = fit_linear(data, decode_table=True)
    assert fitted.stack_base[1] == pytest.approx(TABLE[1], rel=1e-6)
    assert fitted.stack_ctx == pytest.approx(CTX, rel=1e-6)


def test_row_counts_seen_once_are_left_to_the_feature_sum():
    data = [s for s in samples() if not (s[0].compiled_decode and s[0].padded_tokens == 64)]
    data.append((decode_step(64, 64, 100), 0.2))
    fitted, _ = fit_linear(data, decode_table=True)
    assert 64 not in fitted.stack_base and set(fitted.stack_base) == {1, 2, 4, 8, 16, 32}
    comp = decode_step(64, 64, 100)
    assert fitted.predict(comp) == pytest.approx(
        LinearStepModel(fitted.coefficients, decode_stack_rows=64).predict(comp)
    )


def test_only_compiled_decode_steps_use_the_table():
    model = LinearStepModel(GENERIC.coefficients, decode_stack_rows=64, stack_base=dict(TABLE), stack_ctx=CTX)
    assert model.predict(decode_step(3, 4, 100)) == pytest.approx(TABLE[4] + CTX * (101 + 102 + 103))
    mixed = StepComposition(decode_step(3, 4, 100).slices + (RequestSlice(0, 20, False, True),), 23, 0, 64)
    eager = StepComposition(decode_step(65, 65, 100).slices, 65, 0, 64)
    for comp in (chunk_step(64, 0), mixed, eager):
        assert not comp.compiled_decode
        assert model.predict(comp) == pytest.approx(GENERIC.predict(comp))


def test_the_table_survives_json_and_old_profiles_read_without_one():
    model = LinearStepModel(GENERIC.coefficients, decode_stack_rows=64, stack_base=dict(TABLE), stack_ctx=CTX)
    data = model.to_dict()
    assert data["stack_base"]["2"] == TABLE[2]
    again = model_from_dict(data)
    assert again.stack_base == TABLE and again.stack_ctx == CTX
    del data["stack_base"], data["stack_ctx"]
    old = model_from_dict(data)
    comp = decode_step(2, 2, 500)
    assert old.stack_base == {} and old.predict(comp) == pytest.approx(GENERIC.predict(comp))


@pytest.mark.parametrize(
    ("table", "ctx", "match"),
    [
        ({1: -0.01}, 0.0, r"stack_base\[1\]=-0.01 must be a finite number of seconds >= 0"),
        ({128: 0.01}, 0.0, r"stack_base rows 128 must be an integer in \[1, 64\]"),
        ({1: float("nan")}, 0.0, r"stack_base\[1\]=nan"),
        ({}, -1e-6, r"stack_ctx=-1e-06 must be a finite number >= 0"),
    ],
)
def test_bad_tables_are_refused(table, ctx, match):
    with pytest.raises(ValueError, match=match):
        LinearStepModel({}, decode_stack_rows=64, stack_base=table, stack_ctx=ctx)


def test_a_bad_table_in_json_is_refused():
    data = LinearStepModel({}, decode_stack_rows=64).to_dict() | {"stack_base": {"two": 0.01}}
    with pytest.raises(ValueError, match="stack_base row count 'two' is not a positive integer"):
        model_from_dict(data)
