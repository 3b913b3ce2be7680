"""Least-squares fit of ``LinearStepModel`` coefficients to measured steps.

Rows are weighted by 1/duration, so the fit minimises relative error: a 40 ms decode step and a 2 s
prefill step count alike (plain least squares would fit the long steps and ignore the decodes that
set inter-token latency). Coefficients must be physical (>= 0): a negative one is clamped to 0 by
dropping its feature and refitting, one feature at a time (an active-set method after Lawson and
Hanson's NNLS, 1974, simplified). numpy is imported here only.
"""

from __future__ import annotations

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
) -> tuple[LinearStepModel, dict[str, float]]:
    """Fit coefficients over ``features`` to (composition, seconds) samples; ``decode_gathers`` (how
    the samples' engine counted ``gathered_kv``, see ``engine_decodes_gather``) is kept in the model,
    and so is the samples' ``stack_rows`` (as ``decode_stack_rows``).

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
    active = list(range(len(cols)))
    while True:
        coef = _weighted_lstsq(x[:, active], y)
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    full = dict.fromkeys(features, 0.0)
    for j, c in zip(active, coef, strict=True):
        full[features[j]] = max(float(c), 0.0)
    # The samples' engine decides which steps were eager; the simulator must build its steps alike.
    stack_rows = max((c.stack_rows for c, _ in samples), default=SMALL_STEP_ROWS)
    fitted = LinearStepModel(full, model or ModelShape(), source, decode_gathers, stack_rows)
    rel = np.abs(x @ np.array([full[f] for f in features]) - y) / y
    stats = {
        "n": float(len(y)),
        "mean_abs_rel_err": float(rel.mean()),
        "p90_abs_rel_err": float(np.percentile(rel, 90)),
        "max_abs_rel_err": float(rel.max()),
    }
    return fitted, stats


def _weighted_lstsq(x, y):
    import numpy as np

    w = 1.0 / y
    # Scale columns to unit norm so features of very different magnitude condition well.
    scale = np.linalg.norm(x * w[:, None], axis=0)
    scale[scale == 0] = 1.0
    coef, *_ = np.linalg.lstsq(x * w[:, None] / scale, y * w, rcond=None)
    return coef / scale
