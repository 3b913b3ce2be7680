"""The engine's live step-model error: the monitor's prediction equals the step model's on the same
step, its ring holds the last window, and a median error above 20 % is logged."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

from segserve.engine.step_monitor import StepErrorMonitor
from segserve.simulator.step_model import LinearStepModel, RequestSlice, StepComposition

MODEL = LinearStepModel(
    {"step": 0.01, "padded_tokens": 1e-3, "sampled": 2e-3, "requests": 5e-4, "prefill_attn": 1e-7,
     "decode_ctx": 1e-6, "eager_step": 0.02}
)


def fake_step():
    """Two decodes (contexts 100 and 40), a mid-prompt chunk of 30 after 64, a last chunk of 10 after 0."""
    req = lambda prompt, tokens: SimpleNamespace(num_prompt_tokens=prompt, num_tokens=tokens)  # noqa: E731
    requests = {"d1": req(50, 101), "d2": req(30, 41), "c1": req(200, 200), "c2": req(10, 10)}
    so = SimpleNamespace(num_scheduled_tokens={"d1": 1, "d2": 1, "c1": 30, "c2": 10},
                         total_num_scheduled_tokens_padded=64)
    priors = {"d1": 100, "d2": 40, "c1": 64, "c2": 0}
    comp = StepComposition(
        (RequestSlice(100, 1, True, True), RequestSlice(40, 1, True, True),
         RequestSlice(64, 30, False, False), RequestSlice(0, 10, False, True)),
        64,
    )
    return SimpleNamespace(requests=requests), so, priors, comp


def test_prediction_equals_the_step_model_on_the_same_step():
    scheduler, so, priors, comp = fake_step()
    mon = StepErrorMonitor(MODEL, window=4)
    mon.begin(scheduler, so, priors)
    mon.end(0.1)
    assert math.isclose(mon.last_predicted, MODEL.predict(comp))
    assert math.isclose(mon.last_ratio, MODEL.predict(comp) / 0.1) and mon.num_steps == 1


def test_ring_keeps_the_last_window_and_warns_when_the_median_is_off(caplog):
    scheduler, so, priors, comp = fake_step()
    predicted = MODEL.predict(comp)
    mon = StepErrorMonitor(MODEL, window=4, source="test profile")
    with caplog.at_level(logging.WARNING, logger="segserve"):
        for _ in range(4):  # within 10 %: no warning
            mon.begin(scheduler, so, priors)
            mon.end(predicted / 1.1)
        assert not caplog.records and math.isclose(mon.last_median_error, 0.1)
        for _ in range(4):  # steps take twice as long as predicted
            mon.begin(scheduler, so, priors)
            mon.end(2 * predicted)
    assert math.isclose(mon.median_error(), 0.5) and mon.num_steps == 8 and len(mon.ratios) == 4
    (rec,) = caplog.records
    assert "off by a median 50%" in rec.getMessage() and "test profile" in rec.getMessage()


def test_a_step_without_begin_is_not_recorded():
    mon = StepErrorMonitor(MODEL, window=4)
    mon.end(0.1)
    assert mon.num_steps == 0 and math.isnan(mon.median_error())


def test_a_lasting_error_is_warned_once_then_at_most_every_repeat_interval(caplog):
    """A new user's server on a loaded machine logged the same ~400-character warning every 200 steps
    (24 times in 9 minutes). Now: once when the median error crosses the limit, again only after
    ``repeat_s`` while it stays above, and once more (info) when it comes back within the limit, after
    which a new crossing warns at once."""
    scheduler, so, priors, comp = fake_step()
    predicted = MODEL.predict(comp)
    now = [1000.0]
    mon = StepErrorMonitor(MODEL, window=4, repeat_s=600.0, clock=lambda: now[0])

    def windows(n: int, actual: float) -> None:
        for _ in range(n * 4):
            mon.begin(scheduler, so, priors)
            mon.end(actual)
            now[0] += 1.0  # a step a second: a window every 4 s

    with caplog.at_level(logging.INFO, logger="segserve"):
        windows(30, 2 * predicted)  # 120 s off by 50 %: one warning
        assert [r.levelno for r in caplog.records] == [logging.WARNING]
        windows(130, 2 * predicted)  # past 600 s since the warning: a second one
        assert [r.levelno for r in caplog.records] == [logging.WARNING] * 2
        windows(2, predicted)  # back within the limit: one info line
        windows(2, 2 * predicted)  # off again: warned at once
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.WARNING, logging.WARNING, logging.INFO, logging.WARNING]
    assert "back within" in caplog.records[2].getMessage()
