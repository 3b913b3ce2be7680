"""The ``--quick`` calibration's distinct-context probe (on a tiny real engine) and its slow-phase
check (``segserve.simulator.drift``, pure Python)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from segserve.simulator.drift import drift_warning, reference_drift

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for model_fixtures


def test_reference_drift_is_the_spread_of_the_times():
    assert reference_drift([0.5, 0.5]) == 0.0
    assert reference_drift([0.40, 0.52, 0.44]) == pytest.approx(0.30)


def test_a_steady_calibration_gets_no_warning():
    assert drift_warning([0.600, 0.650, 0.620]) is None  # 8 % apart
    assert drift_warning([0.600, 0.770, 0.700]) is None  # 28 %: under the 30 % bound


def test_a_slow_phase_is_named_with_its_figures():
    warning = drift_warning([0.300, 0.910, 0.310])
    assert warning is not None
    assert "300 / 910 / 310 ms" in warning and "203% apart, more than 30%" in warning
    assert "segserve profile --quick" in warning
    # A tighter tolerance flags what the default lets through.
    assert drift_warning([0.600, 0.650], tolerance=0.05) is not None


@pytest.mark.parametrize(
    ("times", "message"),
    [
        ([0.5], "at least 2 reference times"),
        ([], "at least 2 reference times"),
        ([0.5, 0.0], "finite and > 0 s, got 0.0"),
        ([0.5, -1.0], "got -1.0"),
        ([0.5, math.nan], "got nan"),
        ([0.5, math.inf], "got inf"),
    ],
)
def test_bad_reference_times_are_refused(times, message):
    with pytest.raises(ValueError, match=message):
        reference_drift(times)


@pytest.mark.parametrize("tolerance", [0.0, -0.3, math.nan])
def test_a_tolerance_that_is_not_positive_is_refused(tolerance):
    with pytest.raises(ValueError, match="drift tolerance must be > 0"):
        drift_warning([0.5, 0.6], tolerance=tolerance)


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    import torch
    from model_fixtures import save_tiny_hf_dir, tiny_hf_model, train_tiny_tokenizer

    from segserve import LLMEngine
    from segserve.models.loader import load_model

    path = tmp_path_factory.mktemp("tiny")
    hf = tiny_hf_model("llama")
    hf.config.max_position_embeddings = 1024  # the reference request's 256 tokens + decodes
    save_tiny_hf_dir(path, hf, train_tiny_tokenizer())
    loaded = load_model(str(path), dtype=torch.float32)
    return LLMEngine(model=loaded, dtype="float32", max_num_batched_tokens=64, num_kv_blocks=128,
                     max_num_seqs=16, block_size=4)


def test_distinct_probe_decodes_every_batch_of_distinct_contexts_and_mixes_lates_in(tiny_engine):
    from segserve.simulator.profile import _Prober

    pr = _Prober(tiny_engine, seed=3)
    prompts = [pr.fresh(n) for n in (10, 14, 18, 22)]
    pr.distinct(prompts, {4: pr.fresh(20), 2: pr.fresh(9)})
    assert not tiny_engine.has_unfinished_requests()
    decode_only = [c for c, _ in pr.samples if c.slices and c.num_decodes == len(c.slices)]
    # Request i makes 4 + 2 i tokens: every batch of 4 .. 1 decodes runs, each slice its own context.
    assert {c.num_decodes for c in decode_only} == {1, 2, 3, 4}
    for c in decode_only:
        priors = [s.prior for s in c.slices]
        assert len(set(priors)) == len(priors), priors
    mixed = [c for c, _ in pr.samples if 0 < c.num_decodes < len(c.slices)]
    # Each late prompt is one chunk (it fits the budget beside the decodes), scheduled beside exactly
    # the number of distinct decodes it was keyed on.
    lates = [(c.num_decodes, c.num_prefill_tokens) for c in mixed if c.num_prefill_tokens in (20, 9)]
    assert (4, 20) in lates and (2, 9) in lates


def test_reference_request_is_the_same_work_each_time(tiny_engine):
    from segserve.simulator.profile import QUICK_DECODE_STEPS, QUICK_REFERENCE, _Prober

    pr = _Prober(tiny_engine, seed=4)
    first = pr.reference()
    shapes = [[(s.prior, s.chunk, s.is_decode) for s in c.slices] for c, _ in pr.samples]
    second = pr.reference()
    assert first > 0 and second > 0
    again = [[(s.prior, s.chunk, s.is_decode) for s in c.slices] for c, _ in pr.samples[len(shapes):]]
    # Fresh tokens each time: no prefix hit, so the second reference computes the same shapes.
    assert again == shapes
    prefill = sum(chunk for step in shapes for (_, chunk, dec) in step if not dec)
    assert prefill == QUICK_REFERENCE
    assert sum(1 for step in shapes if all(dec for (_, _, dec) in step)) == QUICK_DECODE_STEPS
