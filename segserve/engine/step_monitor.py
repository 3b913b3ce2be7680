"""Live step-model error: every engine step's predicted time against its measured time.

``LLMEngine.step`` calls ``begin`` right after scheduling (when request state still describes the
step) and ``end`` with the step's wall time. ``begin`` reduces the step to the step model's feature
sums in a few integer operations per request; ``end`` stores predicted / actual in a fixed ring of
the last ``window`` steps (an ``array('d')``, allocated once). Every ``window`` steps the median of
``|predicted / actual - 1|`` over the ring is computed and, above ``threshold`` (20 %), logged as a
warning: the profile no longer describes the machine (load, another CPU, a changed engine). The
warning is logged when the error crosses the limit, then at most every ``repeat_s`` (10 min) while it
stays above, and an info line when it comes back within (on a loaded machine the same warning every
window flooded the log).
``gathered_kv`` is not computed live (it needs the segment plan over the block tables, the one
costly feature); it counts as 0, which the compiled CPU kernels' decodes never gather anyway.
Torch-free.
"""

from __future__ import annotations

import logging
import math
import time
from array import array
from collections.abc import Callable

from segserve.core.request import is_decode
from segserve.simulator.step_model import (
    FEATURES,
    SMALL_STEP_ROWS,
    LinearStepModel,
    RequestSlice,
    StepComposition,
    StepTimeModel,
)

logger = logging.getLogger("segserve")

DEFAULT_WINDOW = 200
DEFAULT_THRESHOLD = 0.2
DEFAULT_REPEAT_S = 600.0


class StepErrorMonitor:
    """Predicted/actual step times of the last ``window`` steps of one engine.

    Args:
        model: the step-time model whose error is watched.
        window: ring size, steps; also how often the median is checked.
        threshold: median ``|predicted / actual - 1|`` above which a warning is logged.
        source: how the profile is named in the warning.
        repeat_s: seconds between warnings while the error stays above ``threshold``.
        clock: the time source, seconds (``time.monotonic``).

    Attributes:
        num_steps: steps measured so far.
        last_ratio: predicted / actual of the latest step (NaN before the first).
        last_median_error: the median error at the latest check (NaN before the first).
    """

    def __init__(
        self,
        model: StepTimeModel,
        window: int = DEFAULT_WINDOW,
        threshold: float = DEFAULT_THRESHOLD,
        source: str = "",
        repeat_s: float = DEFAULT_REPEAT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window < 1 or not threshold > 0 or not repeat_s >= 0:
            raise ValueError(
                f"window must be >= 1, threshold > 0 and repeat_s >= 0, got {window}, {threshold}, {repeat_s}"
            )
        self.model = model
        self.window = window
        self.threshold = threshold
        self.source = source or getattr(model, "source", "")
        # A linear model is a dot product with these; any other model gets a StepComposition.
        linear = isinstance(model, LinearStepModel)
        self._coef = tuple(model.coefficients.get(f, 0.0) for f in FEATURES) if linear else None
        self.ratios = array("d", [math.nan]) * window
        self.num_steps = 0
        self.last_ratio = math.nan
        self.last_predicted = math.nan
        self.last_median_error = math.nan
        self._predicted = math.nan
        self.repeat_s = repeat_s
        self._clock = clock
        self._warned_at: float | None = None  # the last warning's clock time; None while within the limit

    def begin(self, scheduler, so, priors: dict[str, int]) -> None:
        """Predict the step ``so`` (``priors``: its ``num_prior_tokens()``), read after ``schedule()``."""
        if self._coef is None:
            self._predicted = self.model.predict(_composition(scheduler, so, priors))
            return
        attn = ctx = 0.0
        sampled = 0
        requests = scheduler.requests
        for rid, n in so.num_scheduled_tokens.items():
            req, prior = requests[rid], priors[rid]
            if prior + n >= req.num_tokens:
                sampled += 1
            if is_decode(prior, req.num_prompt_tokens, req.num_tokens):
                ctx += prior + 1
            else:
                attn += n * (prior + (n + 1) / 2)
        c, padded = self._coef, so.total_num_scheduled_tokens_padded
        self._predicted = (
            c[0] + c[1] * padded + c[2] * sampled + c[3] * len(so.num_scheduled_tokens) + c[4] * attn
            + c[5] * ctx + c[7] * (padded > SMALL_STEP_ROWS)
        )

    def end(self, seconds: float) -> None:
        """Record the measured wall time of the step ``begin`` predicted."""
        if not seconds > 0 or math.isnan(self._predicted):
            return
        ratio = self._predicted / seconds
        self.ratios[self.num_steps % self.window] = ratio
        self.num_steps += 1
        self.last_ratio, self.last_predicted = ratio, self._predicted
        self._predicted = math.nan
        if self.num_steps % self.window == 0:
            self._check()

    def median_error(self) -> float:
        """Median ``|predicted / actual - 1|`` over the ring (NaN when empty)."""
        errs = sorted(abs(r - 1) for r in self.ratios if not math.isnan(r))
        if not errs:
            return math.nan
        mid = len(errs) // 2
        return errs[mid] if len(errs) % 2 else (errs[mid - 1] + errs[mid]) / 2

    def _check(self) -> None:
        err = self.last_median_error = self.median_error()
        if not err > self.threshold:
            if self._warned_at is not None:
                logger.info("step-time model back within %.0f%% (median error %.0f%% over the last %d steps)",
                            100 * self.threshold, 100 * err, self.window)
                self._warned_at = None
            return
        now = self._clock()
        if self._warned_at is None or now - self._warned_at >= self.repeat_s:
            self._warned_at = now
            ratios = sorted(r for r in self.ratios if not math.isnan(r))
            logger.warning(
                "step-time model off by a median %.0f%% over the last %d steps (predicted/actual median "
                "%.2f, above the %.0f%% limit): the profile (%s) no longer describes this machine or its "
                "load; recalibrate with `segserve profile --quick` when the machine is quiet",
                100 * err, len(ratios), ratios[len(ratios) // 2], 100 * self.threshold, self.source,
            )


def _composition(scheduler, so, priors: dict[str, int]) -> StepComposition:
    slices = []
    for rid, n in so.num_scheduled_tokens.items():
        req, prior = scheduler.requests[rid], priors[rid]
        slices.append(RequestSlice(
            prior, n, is_decode(prior, req.num_prompt_tokens, req.num_tokens), prior + n >= req.num_tokens
        ))
    return StepComposition(tuple(slices), so.total_num_scheduled_tokens_padded)
