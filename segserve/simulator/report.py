"""Run artefacts: the Chrome trace of steps and plots (matplotlib, imported lazily).

The Chrome trace is the Trace Event Format's JSON object form (``{"traceEvents": [...]}``, times in
microseconds): one complete event (``"ph": "X"``) per step on its replica's row, with the step's
composition in ``args``, and counter events (``"ph": "C"``) for KV usage and queue lengths. Open it
in ``chrome://tracing`` or Perfetto.
"""

from __future__ import annotations

import json
from pathlib import Path

from segserve.simulator.replica import StepRecord


def chrome_trace(steps: list[StepRecord]) -> dict:
    """Trace Event Format object for the steps (pid 0, one tid per replica)."""
    events = []
    for i, s in enumerate(steps):
        ts = s.start * 1e6
        name = "decode" if s.num_prefill_tokens == 0 else ("prefill" if s.num_decodes == 0 else "mixed")
        args = {
            "step": i,
            "tokens": s.num_tokens,
            "padded_tokens": s.padded_tokens,
            "decodes": s.num_decodes,
            "prefill_tokens": s.num_prefill_tokens,
            "requests": s.num_requests,
            "preempted": s.num_preempted,
        }
        events.append(
            {
                "name": name,
                "ph": "X",
                "ts": ts,
                "dur": s.duration * 1e6,
                "pid": 0,
                "tid": s.replica,
                "args": args,
            }
        )
        events.append(
            {
                "name": f"replica{s.replica}",
                "ph": "C",
                "ts": ts,
                "pid": 0,
                "args": {"kv_usage": s.kv_usage, "running": s.num_running, "waiting": s.num_waiting},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(steps: list[StepRecord], path: str | Path) -> None:
    Path(path).write_text(json.dumps(chrome_trace(steps)), encoding="utf-8")


def plot_run(steps: list[StepRecord], path: str | Path) -> None:
    """Four panels: KV usage and queue lengths over time, step-time and batch-size histograms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    t = [s.start for s in steps]
    ax[0, 0].plot(t, [s.kv_usage for s in steps], lw=0.8)
    ax[0, 0].set(title="KV cache usage", xlabel="time (s)", ylabel="fraction of blocks")
    ax[0, 1].plot(t, [s.num_running for s in steps], lw=0.8, label="running")
    ax[0, 1].plot(t, [s.num_waiting for s in steps], lw=0.8, label="waiting")
    ax[0, 1].set(title="queues", xlabel="time (s)", ylabel="requests")
    ax[0, 1].legend()
    ax[1, 0].hist([s.duration * 1000 for s in steps], bins=50)
    ax[1, 0].set(title="step time", xlabel="ms", ylabel="steps")
    ax[1, 1].hist([s.num_requests for s in steps], bins=50)
    ax[1, 1].set(title="batch size", xlabel="requests per step", ylabel="steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tune(rows: list[dict], path: str | Path, slo_keys: list[str]) -> None:
    """Goodput and each SLO metric against the budget, one line per (policy, long-prefill cap)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["request_goodput", *slo_keys]
    fig, ax = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    groups = sorted({(r["policy"], r["long_prefill_token_threshold"]) for r in rows})
    for policy, cap in groups:
        pts = sorted(
            (r for r in rows if (r["policy"], r["long_prefill_token_threshold"]) == (policy, cap)),
            key=lambda r: r["max_num_batched_tokens"],
        )
        for a, k in zip(ax[0], keys, strict=True):
            a.plot(
                [r["max_num_batched_tokens"] for r in pts],
                [r[k] for r in pts],
                marker="o",
                label=f"{policy} cap={cap or 'none'}",
            )
    for a, k in zip(ax[0], keys, strict=True):
        a.set(xscale="log", xlabel="max_num_batched_tokens", title=k)
    ax[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
