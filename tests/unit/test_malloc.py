"""Importing segserve fixes glibc malloc's mmap and trim thresholds, so a step's large buffers are reused
instead of faulted in again on every step; unless the user chose."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from segserve import malloc

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")

# Per round, three 8 MiB buffers live at once (as a step's activations), filled and freed; prints what
# configure() set and the minor page faults of the last round.
PROBE = """
import resource
import segserve.malloc as m
import segserve
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    bufs = [bytearray(8 << 20) for _ in range(3)]
    for b in bufs:
        b[::4096] = b"x" * (len(b) // 4096)
    del bufs, b
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(m.applied, faults[-1])
"""
_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
         "GLIBC_TUNABLES", "SEGSERVE_MALLOC", "LD_PRELOAD")


def _run(**env: str) -> tuple[str, int]:
    base = {k: v for k, v in os.environ.items() if k not in _VARS}
    out = subprocess.run([sys.executable, "-c", PROBE], env=base | env, capture_output=True, text=True,
                         check=True).stdout.split()
    return " ".join(out[:-1]), int(out[-1])


def test_importing_segserve_keeps_large_buffers_in_the_process() -> None:
    applied, faults = _run()
    assert applied == "{'mmap_threshold': 33554432, 'trim_threshold': 536870912}"
    assert (malloc.MMAP_THRESHOLD, malloc.TRIM_THRESHOLD) == (32 << 20, 512 << 20)
    assert faults < 64  # the buffers' 6,144 pages were already the process's


def test_without_it_every_round_faults_the_buffer_in_again() -> None:
    # What this module fixes: glibc's default trims the freed 24 MiB off the heap's top every round.
    applied, faults = _run(SEGSERVE_MALLOC="0")
    assert applied == "None" and faults >= 6000


@pytest.mark.parametrize("env", [{"MALLOC_TRIM_THRESHOLD_": "131072"}, {"MALLOC_MMAP_THRESHOLD_": "131072"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"}])
def test_the_users_setting_stands(env) -> None:
    applied, _ = _run(**env)
    assert applied == "None"


# A first "step" of three 8 MiB buffers after prefault(PREFAULT) (0: none): prints prefault's result and
# the step's minor page faults.
FIRST_STEP = """
import resource
import segserve.malloc as m
import segserve
done = m.prefault({prefault})
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
bufs = [bytearray(8 << 20) for _ in range(3)]
for b in bufs:
    b[::4096] = b"x" * (len(b) // 4096)
print(done, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _first_step(prefault: int, **env: str) -> tuple[int, int]:
    base = {k: v for k, v in os.environ.items() if k not in _VARS}
    out = subprocess.run([sys.executable, "-c", FIRST_STEP.format(prefault=prefault)], env=base | env,
                         capture_output=True, text=True, check=True).stdout.split()
    return int(out[0]), int(out[1])


def test_prefault_gives_a_first_step_pages_the_process_has() -> None:
    done, faults = _first_step(0)
    assert done == 0 and faults >= 6000  # the buffers' 6,144 pages, faulted in while the step runs
    done, faults = _first_step(40 << 20)
    assert done == 48 << 20  # three 16 MiB pieces
    assert faults < 64


def test_prefault_does_nothing_when_malloc_was_left_alone() -> None:
    assert _first_step(40 << 20, SEGSERVE_MALLOC="0")[0] == 0


def test_prefault_refuses_a_negative_size() -> None:
    with pytest.raises(ValueError, match="nbytes must be >= 0, got -1"):
        malloc.prefault(-1)


def test_prefault_touches_at_most_prefault_max(monkeypatch) -> None:
    # More would leave a free heap top above the trim threshold, handed back on the last free.
    assert malloc.PREFAULT_MAX == malloc.TRIM_THRESHOLD // 2
    monkeypatch.setattr(malloc, "PREFAULT_MAX", 2 * malloc.PREFAULT_PIECE)
    monkeypatch.setattr(malloc, "applied", {"mmap_threshold": malloc.MMAP_THRESHOLD,
                                            "trim_threshold": malloc.TRIM_THRESHOLD})
    assert malloc.prefault(1 << 40) == 2 * malloc.PREFAULT_PIECE
