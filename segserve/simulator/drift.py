"""Did the machine keep one speed through a calibration? (``segserve profile --quick``'s check.)

A shared or throttled host can run identical steps several times slower for tens of seconds at a
time (on the 2-core development machine, 2026-12-01: a 16-row float32 decode step took ~100 ms in most
rounds and 300-360 ms in others, same process, nothing else running). A calibration that lands in such
a phase fits the phase, not the machine. So the quick calibration times one fixed reference request
(the same shapes, fresh tokens) at its start, middle and end; when those disagree by more than
``DRIFT_TOLERANCE`` the fit is kept but flagged. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

DRIFT_TOLERANCE = 0.30  # max / min of the reference times above 1.3: a slow phase touched the run


def reference_drift(seconds: Sequence[float]) -> float:
    """Spread of the reference request's times: ``max / min - 1`` (0.0 for a steady machine).

    Raises:
        ValueError: fewer than 2 times, or a time that is not finite and > 0 s (naming it).
    """
    if len(seconds) < 2:
        raise ValueError(f"need at least 2 reference times to compare, got {len(seconds)}")
    for t in seconds:
        if not t > 0 or t == float("inf"):
            raise ValueError(f"reference times must be finite and > 0 s, got {t!r}")
    return max(seconds) / min(seconds) - 1


def drift_warning(seconds: Sequence[float], tolerance: float = DRIFT_TOLERANCE) -> str | None:
    """A one-line warning naming the reference times when their spread exceeds ``tolerance``
    (a fraction, 0.3 = 30 %), else None.

    Raises:
        ValueError: as ``reference_drift``, or a tolerance that is not > 0.
    """
    if not tolerance > 0:
        raise ValueError(f"drift tolerance must be > 0, got {tolerance!r}")
    spread = reference_drift(seconds)
    if spread <= tolerance:
        return None
    times = " / ".join(f"{1000 * t:.0f}" for t in seconds)
    return (
        f"the reference request took {times} ms at the start / middle / end of the calibration "
        f"({spread:.0%} apart, more than {tolerance:.0%}): the machine changed speed while it was "
        "measured (a slow phase or other load), so this profile mixes two speeds; recalibrate "
        "(`segserve profile --quick`) when the machine is steady"
    )
