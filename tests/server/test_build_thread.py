"""``segserve serve`` builds its engine (and calibrates) off the main thread, so that the only OpenMP
worker pool left in the process is the engine thread's (``serve.off_the_main_thread`` says why: a
main-thread pool beside it slowed every engine step ~20 % on the AMX Xeon)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from segserve.entrypoints.serve import off_the_main_thread


def test_it_returns_the_result_from_another_thread() -> None:
    got = off_the_main_thread(lambda a, b: (a + b, threading.current_thread().name), 2, 3)
    assert got == (5, "segserve-build_0")


def test_it_reraises_the_error_in_the_caller() -> None:
    def boom() -> None:
        raise ValueError("bad model path: /nope")

    with pytest.raises(ValueError, match="bad model path: /nope"):
        off_the_main_thread(boom)


# A torch parallel region (a 2-thread matmul) run in the main thread leaves libgomp's worker thread behind;
# run through the helper, the worker leaves with the helper thread (asynchronously: the count is read
# for up to 2 s). Prints the process's smallest thread count seen.
PROBE = """
import os, time, torch
from segserve.entrypoints.serve import off_the_main_thread
torch.set_num_threads(2)
work = lambda: (torch.randn(256, 256) @ torch.randn(256, 256)).sum().item()
{call}
seen = []
for _ in range(40):
    seen.append(len(os.listdir("/proc/self/task")))
    time.sleep(0.05)
print(min(seen))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/task")
def test_no_openmp_pool_stays_with_the_main_thread() -> None:
    def threads(call: str) -> int:
        out = subprocess.run([sys.executable, "-c", PROBE.format(call=call)], capture_output=True, text=True,
                             check=True)
        return int(out.stdout.split()[-1])

    in_main, helped = threads("work()"), threads("off_the_main_thread(work)")
    assert helped == in_main - 1  # the main thread's pool worker is the one thread less
