"""How long OpenMP's idle threads spin before they sleep, set for segserve's processes before torch
starts its thread pool.

PyTorch's CPU build runs its intra-op pool, and segserve's compiled kernels, on libgomp. An idle
libgomp thread spins ``GOMP_SPINCOUNT`` rounds at the end of every parallel region (and at barriers)
before it sleeps on a futex; libgomp's default is 300,000 rounds (~3 ms here: a ``pause`` takes ~11 ns
on the AMX Xeon). A chunk step runs ~9 regions per layer with the Python of ``forward_chunk`` between
them (~10-100 us each): a thread that slept by then costs the next region its wake-up (~60 us), so a
256-token step took ~74 ms instead of ~57. Spinning too long is as bad on a shared machine: on 2 cores
a spinning thread holds the core its descheduled peer needs to finish the region.

``SPIN_COUNT`` = 10,000 (~110 us) covers the gaps inside a step. ``benchmarks/omp_spin.py --settings
default,spin1000,spin3000,spin10000 --rounds 3 --load 0|1`` (2026-12-05, AMX Xeon, 256-token chunk
steps of the default model; medians): quiet 85 / 117 / 89 / 84 ms, beside one busy process 249 / 161 /
193 / 244 ms. The bfloat16 export's 256-token step (``benchmarks/profile_prefill.py --prompt-len 256
--budgets 1088``) 73-76 ms at 1,000, 62 at 3,000, 57-59 at 10,000. Until 2026-12-05 this was 1,000,
chosen under load 4-8 from other test runs (the default then took 1.0-4.9 s per chunk step, 1,000 took
0.8-1.5 s); on a machine shared with busy processes set ``GOMP_SPINCOUNT=1000`` or ``OMP_NUM_THREADS=1``
(README, "OpenMP's idle spinning").

:func:`configure` sets ``GOMP_SPINCOUNT`` to :data:`SPIN_COUNT` unless the user already chose (either
variable set) or torch is already imported (the pool reads it once, at start). Importing ``segserve``
calls it.
"""

from __future__ import annotations

import os
import sys

SPIN_COUNT = "10000"
_VARS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def configure() -> str | None:
    """Set ``GOMP_SPINCOUNT`` for this process when nothing chose it yet; returns the value set, or None
    when the user's setting stands or torch is already loaded (too late to matter)."""
    if any(v in os.environ for v in _VARS) or "torch" in sys.modules:
        return None
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return SPIN_COUNT


def wait_setting() -> str:
    """The idle-wait settings this process's libgomp runs with, as one string (``GOMP_SPINCOUNT=10000``;
    both variables when both are set; ``libgomp default`` when neither is): chunk steps' times depend
    on it, so step profiles are cached per setting."""
    chosen = [f"{v}={os.environ[v]}" for v in _VARS if v in os.environ]
    return ", ".join(chosen) or "libgomp default"
