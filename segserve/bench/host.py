"""How busy the host was while a benchmark ran: the share of CPU time a hypervisor stole.

On a shared VM the load average does not show the slow phases that make identical runs differ by
2-3x: the guest's own load stays near 1 while the host gives its virtual CPUs less time. Linux counts
that time as *steal* (the 8th field of the ``cpu`` line of ``/proc/stat``, in clock ticks), which is
what ``vmstat``'s ``st`` column shows. A benchmark snapshots :func:`cpu_times` before and after a
run and records :func:`steal_share` beside the load average, so a figure can be read with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")


@dataclass(frozen=True)
class CpuTimes:
    """The ``cpu`` line of ``/proc/stat`` summed over all CPUs, in clock ticks since boot.

    Attributes:
        total: user + nice + system + idle + iowait + irq + softirq + steal (guest time is already
            inside user and nice, so it is not added again).
        steal: ticks the hypervisor ran something else while a virtual CPU wanted to run.
    """

    total: int
    steal: int


def parse_cpu_line(text: str) -> CpuTimes:
    """The aggregate ``cpu`` line of ``/proc/stat``'s ``text``.

    Raises:
        ValueError: no ``cpu`` line, or one with fewer than the 8 fields that include steal.
    """
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            if len(fields) < 9:
                raise ValueError(f"/proc/stat's cpu line has {len(fields) - 1} fields, need >= 8: {line!r}")
            ticks = [int(f) for f in fields[1:9]]
            return CpuTimes(total=sum(ticks), steal=ticks[7])
    raise ValueError("/proc/stat has no aggregate 'cpu' line")


def cpu_times(path: Path = PROC_STAT) -> CpuTimes | None:
    """A snapshot of the host's CPU time, or None where ``/proc/stat`` cannot be read (not Linux)."""
    try:
        return parse_cpu_line(path.read_text())
    except (OSError, ValueError):
        return None


def steal_share(before: CpuTimes | None, after: CpuTimes | None) -> float | None:
    """Stolen ticks over all ticks between two snapshots (0..1), or None when either is missing or
    no tick passed."""
    if before is None or after is None or after.total <= before.total:
        return None
    return (after.steal - before.steal) / (after.total - before.total)
