"""Calibration fidelity (issue 18's done-when): after ``segserve profile --quick`` on this machine, do
the simulator and the real engine agree on held-out trace slices?

Three slices of ``azure2023_conv.csv`` are drawn with a fixed seed from rows no shipped profile was
fitted on (the shipped replay fits used rows 6000-6059; the grid profile, synthetic requests). Each is
simulated with this machine's cached profile and replayed on the real engine in the same process
(``segserve simulate --compare-real``: arrivals re-timed at ``--rate``, prompts clipped to
``--max-input-len``, outputs to ``--max-output-len``, budget ``--max-num-batched-tokens``). The table
is sim / real for throughput and median and p99 TTFT, ITL, TPOT (goal: medians and throughput within
10 %, p99s within 20 %). A benchmark, not a timed test: on a loaded machine the real side drifts.

Each slice is replayed on the real engine ``--repeats`` times back to back (default 2), and the table
prints real / real (each later run over the first) beside sim / real: the machine's own noise floor.
Where real / real falls outside the goal's bounds, no simulator can be shown to meet the goal on that
machine, and the last lines of the table say so.

    .venv/bin/python benchmarks/calib_fidelity.py                  # calibrate, then 3 slices x 40 x 2 runs
    .venv/bin/python benchmarks/calib_fidelity.py --no-calibrate   # use the cached profile as it is
    .venv/bin/python benchmarks/calib_fidelity.py --slices 1 --limit 20 --repeats 2   # a ~3 min check
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

from segserve.bench.host import cpu_times, steal_share

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "traces" / "azure2023_conv.csv"
FITTED_ROWS = range(6000, 6060)  # docs/profiles/cpu_2core_fp32_replay*.json were fitted on these
METRICS = (
    "request_throughput", "output_throughput", "median_ttft_ms", "median_itl_ms", "median_tpot_ms",
    "p99_ttft_ms", "p99_itl_ms", "p99_tpot_ms", "p99_e2el_ms",
)


def held_out_offsets(num_rows: int, limit: int, count: int, seed: int) -> list[int]:
    """``count`` disjoint slices of ``limit`` rows avoiding ``FITTED_ROWS``, drawn with ``seed``."""
    rng, chosen = random.Random(seed), []
    while len(chosen) < count:
        off = rng.randrange(0, num_rows - limit)
        span = range(off, off + limit)
        clash = [c for c in chosen if off < c + limit and c < off + limit]
        if not clash and not (span.start < FITTED_ROWS.stop and FITTED_ROWS.start < span.stop):
            chosen.append(off)
    return sorted(chosen)


def goal_of(metric: str) -> float:
    """The allowed relative error of ``metric``: 0.20 for p99s, 0.10 for throughput and medians."""
    return 0.20 if metric.startswith("p99") else 0.10


def real_over_real(runs: list[dict]) -> dict[str, list[float]]:
    """Per metric, each later real run's value over the first run's (the machine's noise floor)."""
    first = runs[0]["real"]
    return {
        m: [r["real"][m] / first[m] for r in runs[1:] if first.get(m) and r["real"].get(m) is not None]
        for m in METRICS
    }


def noise_verdict(results: dict[int, list[dict]]) -> list[str]:
    """Lines naming each metric whose real / real spread exceeds the goal's bound on some slice."""
    lines = []
    for m in METRICS:
        worst = max((abs(x - 1) for runs in results.values() for x in real_over_real(runs)[m]), default=0.0)
        if worst > goal_of(m):
            lines.append(f"{m}: the real engine differs from itself by up to {worst:.0%} between "
                         f"back-to-back runs of one slice, beyond the goal's ±{goal_of(m):.0%}")
    return lines


def run_slice(args, offset: int, out: Path) -> dict:
    from segserve.entrypoints.cli import main

    argv = [
        "simulate", "--trace", str(args.trace), "--offset", str(offset), "--limit", str(args.limit),
        "--rate", str(args.rate), "--max-input-len", str(args.max_input_len),
        "--max-output-len", str(args.max_output_len), "--max-num-batched-tokens", str(args.budget),
        "--compare-real", "--output-json", str(out),
    ] + (["--profile", args.profile] if args.profile else [])
    load, ticks = os.getloadavg()[0], cpu_times()
    if main(argv) != 0:
        raise SystemExit(f"simulate failed on slice {offset}")
    return json.loads(out.read_text()) | {"load_average": [load, os.getloadavg()[0]],
                                          "steal": steal_share(ticks, cpu_times())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=str(TRACE.resolve()))
    p.add_argument("--limit", type=int, default=40, help="requests per slice")
    p.add_argument("--slices", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2,
                   help="real replays of each slice, back to back (>= 1; 2 or more print real / real)")
    p.add_argument("--seed", type=int, default=18)
    p.add_argument("--rate", type=float, default=0.5)
    p.add_argument("--max-input-len", type=int, default=512)
    p.add_argument("--max-output-len", type=int, default=64)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--no-calibrate", action="store_true", help="use the cached profile (or --profile)")
    p.add_argument("--profile", default=None, help="a profile file instead of this machine's cached one")
    p.add_argument("--output", default="results/calib_fidelity.json")
    args = p.parse_args()
    for name in ("limit", "slices", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    from segserve.entrypoints.cli import main as cli

    if not args.no_calibrate and not args.profile and cli(["profile", "--quick"]) != 0:
        return 1
    with open(args.trace, encoding="utf-8") as f:
        rows = sum(1 for _ in f) - 1
    offsets = held_out_offsets(rows, args.limit, args.slices, args.seed)
    print(f"[fidelity] held-out slices (seed {args.seed}): rows " + ", ".join(
        f"{o}-{o + args.limit - 1}" for o in offsets), flush=True)
    results: dict[int, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for off in offsets:
            results[off] = [run_slice(args, off, Path(tmp) / f"{off}-{k}.json") for k in range(args.repeats)]
    print(table(results))
    for line in noise_verdict(results):
        print(f"[fidelity] noise floor: {line}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"offsets": offsets, "args": vars(args), "results": results},
                                            indent=2) + "\n", encoding="utf-8")
    print(f"[fidelity] wrote {args.output}")
    return 0


def table(results: dict[int, list[dict]]) -> str:
    """Per metric and slice: sim / real (over the first real run, with the simulated and real values)
    and real / real (each later run over the first)."""
    head = "| metric | " + " | ".join(f"rows {o}+ sim / real (sim, real) | real / real" for o in results)
    lines = [head + " | goal |", "|---" * (2 * len(results) + 2) + "|"]
    for m in METRICS:
        cells = []
        for runs in results.values():
            first = runs[0]
            sim, real, ratio = first["summary"].get(m), first["real"].get(m), first["sim_over_real"].get(m)
            cells.append("n/a" if ratio is None else f"{ratio:.3f} ({sim:.4g}, {real:.4g})")
            cells.append(" / ".join(f"{x:.3f}" for x in real_over_real(runs)[m]) or "-")
        lines.append(f"| {m} | " + " | ".join(cells) + f" | ±{goal_of(m):.0%} |")
    steps = []
    for runs in results.values():
        first = runs[0]
        real_ms = [r["real"].get("mean_step_time_ms") for r in runs]
        if None in real_ms:
            steps += ["n/a", "n/a"]
            continue
        steps.append(f"{first['steps']['mean_step_time_ms'] / real_ms[0]:.3f}")
        steps.append(" / ".join(f"{x / real_ms[0]:.3f}" for x in real_ms[1:]) or "-")
    lines.append("| mean step time | " + " | ".join(steps) + " | |")
    loads = []
    for runs in results.values():
        loads += ["; ".join(f"{r['load_average'][0]:.1f} -> {r['load_average'][1]:.1f}" for r in runs), ""]
    lines.append("| 1-min load average (each run) | " + " | ".join(loads) + " | |")
    steals = []
    for runs in results.values():
        steals += ["; ".join("?" if r.get("steal") is None else f"{100 * r['steal']:.1f}" for r in runs), ""]
    lines.append("| host steal, % of CPU time (each run) | " + " | ".join(steals) + " | |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
