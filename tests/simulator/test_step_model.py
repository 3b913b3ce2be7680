"""Step-time models: features, the roofline figures, JSON round trips and bad input."""

from __future__ import annotations

import json

import pytest

from segserve.simulator.step_model import (
    LLAMA_8B,
    LinearStepModel,
    ModelShape,
    RequestSlice,
    RooflineStepModel,
    StepComposition,
    load_profile,
    roofline_profile,
    save_profile,
)

MIXED = StepComposition(
    (RequestSlice(100, 1, True, True), RequestSlice(300, 1, True, True), RequestSlice(512, 64, False, False)),
    padded_tokens=128,
)


def test_features_of_a_mixed_step():
    # prefill q-k pairs: 64 * (512 + 65/2) = 34,848; decode context: 101 + 301.
    assert MIXED.features() == (1.0, 128.0, 2.0, 3.0, 34848.0, 402.0, 0.0, 1.0)
    assert (MIXED.num_tokens, MIXED.num_decodes, MIXED.num_prefill_tokens) == (66, 2, 64)


def test_linear_prediction():
    m = LinearStepModel({"step": 0.01, "padded_tokens": 1e-3, "decode_ctx": 1e-6})
    assert m.predict(MIXED) == pytest.approx(0.01 + 0.128 + 402e-6)


def test_roofline_decode_is_bandwidth_bound_on_h100():
    m = roofline_profile("h100", LLAMA_8B, mfu=0.5, mbu=0.8, overhead=0.0)
    decode = StepComposition(tuple(RequestSlice(1000, 1, True, True) for _ in range(8)), 8)
    weights = LLAMA_8B.num_params * 2
    kv = 8 * 1001 * LLAMA_8B.kv_bytes_per_token  # 131,072 bytes per token
    assert LLAMA_8B.kv_bytes_per_token == 131072
    assert m.predict(decode) == pytest.approx((weights + kv) / (3.35e12 * 0.8))


def test_roofline_big_prefill_is_compute_bound():
    m = RooflineStepModel(LLAMA_8B, flops=500e12, bandwidth=3e12, overhead=0.001)
    step = StepComposition((RequestSlice(0, 4096, False, True),), 4096)
    attn = 4 * 32 * 32 * 128 * 4096 * (4096 + 1) / 2
    assert m.predict(step) == pytest.approx((2 * 8.03e9 * 4096 + attn) / 500e12 + 0.001)


@pytest.mark.parametrize(
    "model",
    [LinearStepModel({"step": 0.5, "sampled": 1e-3}, ModelShape(name="x"), "test"), roofline_profile("h200")],
)
def test_profile_json_round_trip(tmp_path, model):
    path = tmp_path / "p.json"
    save_profile(model, path, {"fit": {"n": 3}})
    assert json.loads(path.read_text())["fit"] == {"n": 3}
    assert load_profile(path).predict(MIXED) == pytest.approx(model.predict(MIXED))


def test_bad_profiles(tmp_path):
    with pytest.raises(ValueError, match="unknown step-model features \\['gpu'\\]"):
        LinearStepModel({"gpu": 1.0})
    with pytest.raises(ValueError, match="unknown hardware 'tpu'"):
        roofline_profile("tpu")
    with pytest.raises(ValueError, match="mfu and mbu must be in \\(0, 1\\], got 1.5, 0.8"):
        roofline_profile("h100", mfu=1.5)
    with pytest.raises(ValueError, match="flops and bandwidth must be > 0, got 0, 1"):
        RooflineStepModel(LLAMA_8B, 0, 1)
    with pytest.raises(ValueError, match="overhead and per_request must be >= 0"):
        RooflineStepModel(LLAMA_8B, 1, 1, overhead=-1)
    with pytest.raises(ValueError, match="model num_layers must be > 0, got 0"):
        ModelShape(num_layers=0)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"kind": "magic"}))
    with pytest.raises(ValueError, match="profile kind must be 'linear' or 'roofline', got 'magic'"):
        load_profile(path)


@pytest.mark.parametrize("value", [-1e-3, float("nan"), float("inf")])
def test_linear_model_rejects_negative_or_non_finite_coefficients(value):
    # A hand-edited profile with a negative coefficient simulated negative TTFTs before.
    message = f"step-model coefficient step={value!r} must be a finite number >= 0"
    with pytest.raises(ValueError, match=message):
        LinearStepModel({"step": value})
