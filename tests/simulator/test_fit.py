"""The least-squares fit recovers known coefficients from synthetic steps."""

from __future__ import annotations

import random

import pytest

from segserve.simulator.fit import fit_linear
from segserve.simulator.step_model import FEATURES, LinearStepModel, RequestSlice, StepComposition

TRUE = {
    "step": 0.02,
    "padded_tokens": 1.5e-3,
    "sampled": 2e-3,
    "requests": 4e-4,
    "prefill_attn": 6e-7,
    "decode_ctx": 2e-6,
    "gathered_kv": 3e-7,
    "eager_step": 0.015,
}


def _random_steps(n: int, seed: int = 0) -> list[StepComposition]:
    rng = random.Random(seed)
    steps = []
    for _ in range(n):
        decodes = [RequestSlice(rng.randrange(10, 3000), 1, True, True) for _ in range(rng.randrange(0, 40))]
        prefills = [
            RequestSlice(rng.choice([0, 512, 2048]), rng.randrange(16, 512), False, rng.random() < 0.5)
            for _ in range(rng.randrange(0 if decodes else 1, 3))
        ]
        slices = tuple(decodes + prefills)
        total = sum(s.chunk for s in slices)
        gathered = rng.choice([0, 16 * rng.randrange(1, 400)])
        steps.append(StepComposition(slices, total + rng.randrange(0, 32), gathered))
    return steps


def test_recovers_exact_coefficients_without_noise():
    truth = LinearStepModel(TRUE)
    samples = [(c, truth.predict(c)) for c in _random_steps(200)]
    fitted, stats = fit_linear(samples)
    for name in FEATURES:
        assert fitted.coefficients[name] == pytest.approx(TRUE[name], rel=1e-6)
    assert stats["max_abs_rel_err"] < 1e-9 and stats["n"] == 200


def test_recovers_coefficients_within_noise():
    truth = LinearStepModel(TRUE)
    rng = random.Random(1)
    samples = [(c, truth.predict(c) * rng.uniform(0.97, 1.03)) for c in _random_steps(400, seed=2)]
    fitted, stats = fit_linear(samples)
    for name in ("step", "padded_tokens", "prefill_attn", "decode_ctx"):
        assert fitted.coefficients[name] == pytest.approx(TRUE[name], rel=0.1), name
    assert 0.005 < stats["mean_abs_rel_err"] < 0.03


def test_negative_coefficient_is_dropped_to_zero():
    # Time depends on padded tokens only; a feature that would fit negative must come out as 0.
    truth = LinearStepModel({"step": 0.01, "padded_tokens": 1e-3})
    samples = [(c, truth.predict(c)) for c in _random_steps(100, seed=3)]
    fitted, _ = fit_linear(samples)
    assert all(v >= 0 for v in fitted.coefficients.values())
    assert fitted.coefficients["padded_tokens"] == pytest.approx(1e-3, rel=1e-6)


def test_bad_input():
    steps = _random_steps(3)
    with pytest.raises(ValueError, match="need at least 8 samples to fit 8 features, got 3"):
        fit_linear([(c, 1.0) for c in steps])
    with pytest.raises(ValueError, match="step durations must be finite and > 0 s, got inf"):
        fit_linear([(c, float("inf")) for c in _random_steps(10)])
    with pytest.raises(ValueError, match="step durations must be finite and > 0 s"):
        fit_linear([(c, 0.0) for c in _random_steps(10)])
    with pytest.raises(ValueError, match="unknown features \\['flops'\\]"):
        fit_linear([(c, 1.0) for c in steps], features=("flops",))
