"""Least-squares fit of ``LinearStepModel`` coefficients to measured steps.

Rows are weighted by 1/duration, so the fit minimises relative error: a 40 ms decode step and a 2 s
prefill step count alike (plain least squares would fit the long steps and ignore the decodes that
set inter-token latency). Coefficients must be physical (>= 0): a negative one is clamped to 0 by
dropping its feature and refitting, one feature at a time (an active-set method after Lawson and
Hanson's NNLS, 1974, simplified). numpy is imported here only.

With ``decode_table=True`` the decode-only steps on a compiled path get a table of their own as well
(``LinearStepModel.stack_base``: one intercept per padded row count seen at least ``MIN_TABLE_SAMPLES``
times, and one shared cost per context token), fitted on those steps alone in the same weighted,
non-negative way, refitted once without the steps whose relative error exceeds both ``OUTLIER_FACTOR``
times the median and ``OUTLIER_FLOOR`` (a slow phase of the host during calibration, not the step's
cost); the features are then fitted to the steps the table does not cover.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from segserve.simulator.step_model import (
    FEATURES,
    SMALL_STEP_ROWS,
    LinearStepModel,
    ModelShape,
    StepComposition,
)


def fit_linear(
    samples: Sequence[tuple[StepComposition, float]],
    features: Sequence[str] = FEATURES,
    model: ModelShape | None = None,
    source: str = "fit",
    decode_gathers: bool = True,
    decode_table: bool = False,
) -> tuple[LinearStepModel, dict[str, float]]:
    """Fit coefficients over ``features`` to (composition, seconds) samples; ``decode_gathers`` (how
    the samples' engine counted ``gathered_kv``, see ``engine_decodes_gather``) is kept in the model,
    and so is the samples' ``stack_rows`` (as ``decode_stack_rows``); ``decode_table`` adds the
    decode-only table (module docstring).

    Returns:
        (model, fit statistics: ``n``, ``mean_abs_rel_err``, ``p90_abs_rel_err``, ``max_abs_rel_err``).

    Raises:
        ValueError: fewer samples than features, a duration that is not finite and > 0, or an unknown
            feature name.
    """
    import numpy as np

    unknown = set(features) - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown features {sorted(unknown)}; known: {FEATURES}")
    if len(samples) < len(features):
        raise ValueError(
            f"need at least {len(features)} samples to fit {len(features)} features, got {len(samples)}"
        )
    cols = [FEATURES.index(f) for f in features]
    x = np.array([[c.features()[i] for i in cols] for c, _ in samples], dtype=np.float64)
    y = np.array([t for _, t in samples], dtype=np.float64)
    bad = ~np.isfinite(y) | (y <= 0)
    if bad.any():
        raise ValueError(f"step durations must be finite and > 0 s, got {float(y[bad][0])}")
    base, ctx = _fit_stack(samples) if decode_table else ({}, 0.0)
    # The features fit the steps the table leaves to them (all, when too few are left).
    rest = np.array([not (c.compiled_decode and c.padded_tokens in base) for c, _ in samples])
    rest = rest if rest.sum() >= len(features) else np.ones(len(samples), dtype=bool)
    full = {f: float(c) for f, c in zip(features, _nonnegative(x[rest], y[rest]), strict=True)}
    # The samples' engine decides which steps were eager; the simulator must build its steps alike.
    stack_rows = max((c.stack_rows for c, _ in samples), default=SMALL_STEP_ROWS)
    fitted = LinearStepModel(full, model or ModelShape(), source, decode_gathers, stack_rows, base, ctx)
    rel = np.abs(np.array([fitted.predict(c) for c, _ in samples]) - y) / y
    stats = {
        "n": float(len(y)),
        "mean_abs_rel_err": float(rel.mean()),
        "p90_abs_rel_err": float(np.percentile(rel, 90)),
        "max_abs_rel_err": float(rel.max()),
    }
    return fitted, stats


MIN_TABLE_SAMPLES = 2  # a padded row count needs this many decode-only steps to get an intercept
OUTLIER_FACTOR = 4.0
OUTLIER_FLOOR = 0.25  # relative error below which no step counts as an outlier


def _fit_stack(samples: Sequence[tuple[StepComposition, float]]) -> tuple[dict[int, float], float]:
    """``stack_base`` and ``stack_ctx`` from the ``compiled_decode`` samples; ``({}, 0.0)`` when
    there are none to fit."""
    import numpy as np

    steps = [(c, t) for c, t in samples if c.compiled_decode]
    counts = Counter(c.padded_tokens for c, _ in steps)
    rows = sorted(r for r, n in counts.items() if n >= MIN_TABLE_SAMPLES)
    steps = [(c, t) for c, t in steps if c.padded_tokens in rows]
    if not rows or len(steps) < len(rows) + 1:
        return {}, 0.0
    x = np.array([[float(c.padded_tokens == r) for r in rows] + [c.decode_context] for c, _ in steps])
    y = np.array([t for _, t in steps])
    keep = np.ones(len(y), dtype=bool)
    for _ in range(2):  # the fit, then once more without the outliers of the first
        coef = _nonnegative(x[keep], y[keep])
        rel = np.abs(x @ coef - y) / y
        limit = max(OUTLIER_FACTOR * float(np.median(rel)), OUTLIER_FLOOR)
        if (rel <= limit).all():
            break
        keep = rel <= limit
        if any(not (keep & (x[:, j] == 1)).any() for j in range(len(rows))):
            break  # dropping them would leave a row count without samples: keep the first fit
    return {r: float(v) for r, v in zip(rows, coef[:-1], strict=True)}, float(coef[-1])


def _nonnegative(x, y):
    """``_weighted_lstsq`` with the active-set clamp of ``fit_linear``: every coefficient >= 0."""
    import numpy as np

    active = list(range(x.shape[1]))
    while True:
        coef = _weighted_lstsq(x[:, active], y)
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    full = np.zeros(x.shape[1])
    full[active] = np.maximum(coef, 0.0)
    return full


def _weighted_lstsq(x, y):
    import numpy as np

    w = 1.0 / y
    # Scale columns to unit norm so features of very different magnitude condition well.
    scale = np.linalg.norm(x * w[:, None], axis=0)
    scale[scale == 0] = 1.0
    coef, *_ = np.linalg.lstsq(x * w[:, None] / scale, y * w, rcond=None)
    return coef / scale
