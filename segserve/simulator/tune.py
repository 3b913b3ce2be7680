"""``segserve tune``: search budget x policy x long-prefill cap by simulation for the best goodput
that meets an SLO.

Every setting replays the same workload through the simulator; a setting is feasible when every
aggregate SLO holds (e.g. ``p99_itl_ms <= 50``) and nothing was rejected; among feasible settings the
one with the highest ``request_goodput`` (requests/s meeting the per-request SLOs) wins, ties going
to the smaller budget. Long-prefill caps at or above the budget are skipped (they change nothing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from segserve.config import EngineConfig
from segserve.simulator.cluster import simulate
from segserve.simulator.metrics import SLO, slo_met, summarize
from segserve.simulator.step_model import StepTimeModel
from segserve.simulator.workload import TraceRequest

DEFAULT_BUDGETS = (128, 256, 512, 1024, 2048)
DEFAULT_CAPS = (0, 256)


def settings(
    budgets: Sequence[int], policies: Sequence[str], caps: Sequence[int]
) -> list[tuple[int, str, int]]:
    """The (budget, policy, cap) grid, caps >= budget dropped (0, no cap, is always kept)."""
    return [(b, p, c) for b in budgets for p in policies for c in caps if c == 0 or c < b]


def tune(
    requests: list[TraceRequest],
    base: EngineConfig,
    num_kv_blocks: Callable[[EngineConfig], int],
    step_model: StepTimeModel,
    slos: list[SLO],
    grid: list[tuple[int, str, int]],
    num_replicas: int = 1,
    router: str = "round_robin",
) -> tuple[dict | None, list[dict]]:
    """Simulate each setting of ``grid`` on ``base``.

    Args:
        num_kv_blocks: KV blocks for a configuration (the pool may depend on ``max_num_seqs`` etc.).

    Returns:
        (the best feasible row or None when no setting meets the SLO, every row). A row is the
        ``summarize`` dict plus ``max_num_batched_tokens``, ``policy``,
        ``long_prefill_token_threshold`` and ``meets_slo``.

    Raises:
        ValueError: an empty grid, or a setting the scheduler config rejects.
    """
    if not grid:
        raise ValueError("the tuning grid is empty (no budget, policy or cap given)")
    rows = []
    for budget, policy, cap in grid:
        sched = dataclasses.replace(
            base.scheduler,
            max_num_batched_tokens=budget,
            policy=policy,
            long_prefill_token_threshold=cap,
            num_batched_tokens_buckets=None,
        )
        cfg = dataclasses.replace(base, scheduler=sched)
        res = simulate(requests, cfg, num_kv_blocks(cfg), step_model, num_replicas, router)
        row = summarize(res.requests, slos)
        row |= {"max_num_batched_tokens": budget, "policy": policy, "long_prefill_token_threshold": cap}
        row["meets_slo"] = slo_met(row, slos) and row["failed"] == 0
        rows.append(row)
    return choose_best(rows, slos), rows


# Goodputs within this fraction of the best count as equal: under an arrival-bound workload every
# feasible setting serves the same requests and their goodputs differ only in the third decimal.
GOODPUT_TIE = 0.01


def slo_margin(row: dict, slos: list[SLO]) -> float:
    """The smallest relative room under any SLO: ``min((limit - value) / limit)`` (1.0 with no SLO)."""
    return min(((s.seconds * 1000.0 - row[s.key]) / (s.seconds * 1000.0) for s in slos), default=1.0)


def choose_best(rows: list[dict], slos: list[SLO]) -> dict | None:
    """The feasible row with the highest goodput; among goodputs within ``GOODPUT_TIE`` of it, the one
    with the widest SLO margin (then the smaller budget). The simulator's p99s are within ~10-20 % of
    the engine's (docs/simulator.md), so a setting that meets an SLO by 2 % can miss it on the engine:
    when goodput does not decide, room does."""
    feasible = [r for r in rows if r["meets_slo"]]
    if not feasible:
        return None
    top = max(r["request_goodput"] for r in feasible)
    near = [r for r in feasible if r["request_goodput"] >= (1 - GOODPUT_TIE) * top]
    return max(near, key=lambda r: (slo_margin(r, slos), -r["max_num_batched_tokens"]))
