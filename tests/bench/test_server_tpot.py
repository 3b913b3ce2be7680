"""benchmarks/server_tpot.py's scheduler counters, burner spec and summary (no server, no engine)."""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import server_tpot as st  # noqa: E402


def test_a_burn_is_a_period_and_a_shorter_burn_in_ms() -> None:
    assert st.burn_spec("15:0.8") == (15.0, 0.8)
    for bad in ("15", "15:x", "0.8:15", "15:0", "15:15"):
        with pytest.raises(argparse.ArgumentTypeError, match="--burn"):
            st.burn_spec(bad)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="Linux /proc")
def test_the_counters_of_this_process_threads_read_from_proc() -> None:
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)
    worker.start()
    try:
        got = st.thread_counters(os.getpid())
        assert os.getpid() in got and len(got) >= 2
        run_ns, wait_ns, voluntary, involuntary = got[os.getpid()]
        assert run_ns > 0 and wait_ns >= 0 and voluntary >= 0 and involuntary >= 0
        assert st.read_thread(os.getpid(), 2**31 - 1) is None  # no such thread
    finally:
        stop.set()
        worker.join()
    assert st.thread_counters(2**31 - 1) == {}  # no such process


def test_per_token_counters_leave_out_idle_threads_and_the_loop() -> None:
    pid = 100
    before = {100: (0, 0, 10, 0), 101: (0, 0, 0, 0), 102: (0, 0, 0, 0), 103: (0, 0, 0, 0)}
    after = {100: (5_000_000, 900_000, 50, 1),  # the loop: 40 wakes
             101: (20_000_000, 2_000_000, 7, 3),  # engine thread
             102: (18_000_000, 1_000_000, 9, 5),  # its OpenMP worker
             103: (500_000, 4_000_000, 2, 2),  # ran < 1 ms: left out
             104: (9_000_000, 9_000_000, 9, 9)}  # started during the request: left out
    got = st.sched_per_token(before, after, pid, tokens=10, loop=True)
    assert got == {"engine_wait_ms_per_token": pytest.approx(0.3), "engine_preempted_per_token": 0.8,
                   "server_loop_cpu_ms_per_token": 0.5, "loop_wakes_per_token": 4.0}
    offline = st.sched_per_token(before, after, pid, tokens=10, loop=False)  # the main thread is the engine's
    assert offline == {"engine_wait_ms_per_token": pytest.approx(0.39), "engine_preempted_per_token": 0.9}


def test_the_summary_takes_medians_of_every_per_token_figure() -> None:
    rows = {"offline": [{"tpot_ms": 10.0, "engine_preempted_per_token": 0.1},
                        {"tpot_ms": 12.0, "engine_preempted_per_token": 0.3},
                        {"tpot_ms": 11.0, "engine_preempted_per_token": 0.2}],
            "offline_burn": [{"tpot_ms": 13.0, "burner_cpu_ms_per_token": 0.6},
                             {"tpot_ms": 12.1, "burner_cpu_ms_per_token": 0.5},
                             {"tpot_ms": 14.0, "burner_cpu_ms_per_token": 0.7}]}
    got = st.summarize(rows)
    assert got["offline"]["median_engine_preempted_per_token"] == 0.2
    assert got["offline_burn"]["median_burner_cpu_ms_per_token"] == 0.6
    assert got["offline_burn"]["median_vs_offline"] == pytest.approx(13.0 / 11.0)
    assert got["offline_burn"]["min_vs_offline"] == pytest.approx(12.1 / 10.0)
