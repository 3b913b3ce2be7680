"""segserve.bench.host: the hypervisor's steal time from /proc/stat, with fixture text."""

from __future__ import annotations

import pytest

from segserve.bench.host import CpuTimes, cpu_times, parse_cpu_line, steal_share

# user nice system idle iowait irq softirq steal guest guest_nice
STAT = """cpu  7155036 3050698 491267 4507375 15629 0 20516 679310 11 12
cpu0 3573544 1506010 242024 2277244 9754 0 9412 341501 0 0
intr 1 2 3
"""


def test_the_aggregate_line_sums_eight_fields_and_leaves_guest_time_out():
    t = parse_cpu_line(STAT)
    ticks = (7155036, 3050698, 491267, 4507375, 15629, 0, 20516, 679310)
    assert t == CpuTimes(total=sum(ticks), steal=679310)


def test_steal_share_is_stolen_ticks_over_all_ticks_between_snapshots():
    assert steal_share(CpuTimes(1000, 10), CpuTimes(1400, 70)) == pytest.approx(0.15)
    assert steal_share(CpuTimes(1000, 10), CpuTimes(1000, 10)) is None  # no tick passed
    assert steal_share(None, CpuTimes(1, 0)) is None


def test_a_cpu_line_without_the_steal_field_is_refused_with_its_field_count():
    with pytest.raises(ValueError, match="has 4 fields, need >= 8"):
        parse_cpu_line("cpu  1 2 3 4\n")
    with pytest.raises(ValueError, match="no aggregate 'cpu' line"):
        parse_cpu_line("cpu0 1 2 3 4 5 6 7 8\n")


def test_an_unreadable_stat_file_gives_none(tmp_path):
    assert cpu_times(tmp_path / "missing") is None
    (tmp_path / "stat").write_text("cpu  1 2\n")
    assert cpu_times(tmp_path / "stat") is None
