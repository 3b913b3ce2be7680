"""The metrics board: a small actor where each replica leaves its latest Prometheus text, and
``merge`` that joins them into one exposition with a ``replica`` label on every sample.

A push model because a Serve handle cannot address one replica; an entry older than ``STALE_S``
(its replica died or hangs) is left out, and a restarted replica appears under its new id, so its
counters start a new series as Prometheus expects.
"""

from __future__ import annotations

import time

import ray

STALE_S = 10.0


@ray.remote(num_cpus=0)
class MetricsBoard:
    """replica id -> (time received, Prometheus text)."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[float, str]] = {}

    def put(self, replica_id: str, text: str) -> None:
        self.entries[replica_id] = (time.monotonic(), text)

    def fresh(self, max_age_s: float = STALE_S) -> dict[str, str]:
        now = time.monotonic()
        self.entries = {k: v for k, v in self.entries.items() if now - v[0] <= max_age_s}
        return {k: text for k, (_, text) in sorted(self.entries.items())}


def merge(texts: dict[str, str]) -> str:
    """One exposition from several: each family's ``# HELP``/``# TYPE`` once, then its samples from
    every replica with ``replica="<id>"`` added (the text format wants a family's samples together)."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in texts.items():
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split(" ", 3)[2]
                if line not in headers.setdefault(family, []):
                    headers[family].append(line)
                samples.setdefault(family, [])
            elif line and not line.startswith("#") and family is not None:
                samples[family].append(_with_label(line, "replica", replica))
    out = []
    for family, head in headers.items():
        out.extend(head)
        out.extend(samples[family])
    return "\n".join(out) + "\n"


def _with_label(line: str, name: str, value: str) -> str:
    label = f'{name}="{value}"'
    brace = line.find("{")
    space = line.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        rest = line[brace + 1:]
        return f"{line[:brace + 1]}{label}{'' if rest.startswith('}') else ','}{rest}"
    return f"{line[:space]}{{{label}}}{line[space:]}"
