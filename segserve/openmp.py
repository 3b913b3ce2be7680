"""How long OpenMP's idle threads spin before they sleep, set for segserve's processes before torch
starts its thread pool.

PyTorch's CPU build runs its intra-op pool, and segserve's compiled kernels, on libgomp. By default an
idle libgomp thread spins about 300,000 rounds (up to a millisecond) at every barrier and at the end of
every parallel region before it sleeps. That is the fastest hand-off when the process has the cores
to itself, and a collapse when it does not: on 2 cores, a spinning thread holds a core that its peer,
descheduled in favour of another process (a benchmark client, the HTTP event loop, a test run), needs
to finish the region, so every region waits out scheduler slices. Measured here (2 threads, load 4-8
from other processes, ``/work/ab`` A/B of 256-token bfloat16 chunk steps and batch-1 decode): the
default took 1.0-4.9 s per chunk step and 325 ms per decode step, ``GOMP_SPINCOUNT`` = 1000 or
``OMP_WAIT_POLICY=PASSIVE`` 0.8-1.5 s and 110-128 ms.

:func:`configure` sets ``GOMP_SPINCOUNT`` to :data:`SPIN_COUNT` unless the user already chose (either
variable set) or torch is already imported (the pool reads it once, at start). Importing ``segserve``
calls it.
"""

from __future__ import annotations

import os
import sys

SPIN_COUNT = "1000"
_VARS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def configure() -> str | None:
    """Set ``GOMP_SPINCOUNT`` for this process when nothing chose it yet; returns the value set, or None
    when the user's setting stands or torch is already loaded (too late to matter)."""
    if any(v in os.environ for v in _VARS) or "torch" in sys.modules:
        return None
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return SPIN_COUNT
