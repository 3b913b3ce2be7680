"""Calibration fidelity (issue 18's done-when): after ``segserve profile --quick`` on this machine, do
the simulator and the real engine agree on held-out trace slices?

Three slices of ``azure2023_conv.csv`` are drawn with a fixed seed from rows no shipped profile was
fitted on (the shipped replay fits used rows 6000-6059; the grid profile, synthetic requests). Each is
simulated with this machine's cached profile and replayed on the real engine in the same process
(``segserve simulate --compare-real``: arrivals re-timed at ``--rate``, prompts clipped to
``--max-input-len``, outputs to ``--max-output-len``, budget ``--max-num-batched-tokens``). The table
is sim / real for throughput and median and p99 TTFT, ITL, TPOT (goal: medians and throughput within
10 %, p99s within 20 %). A benchmark, not a timed test: on a loaded machine the real side drifts.

    .venv/bin/python benchmarks/calib_fidelity.py                  # calibrate, then 3 x 40 requests
    .venv/bin/python benchmarks/calib_fidelity.py --no-calibrate   # use the cached profile as it is
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

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


def run_slice(args, offset: int, out: Path) -> dict:
    from segserve.entrypoints.cli import main

    argv = [
        "simulate", "--trace", str(args.trace), "--offset", str(offset), "--limit", str(args.limit),
        "--rate", str(args.rate), "--max-input-len", str(args.max_input_len),
        "--max-output-len", str(args.max_output_len), "--max-num-batched-tokens", str(args.budget),
        "--compare-real", "--output-json", str(out),
    ] + (["--profile", args.profile] if args.profile else [])
    load = os.getloadavg()[0]
    if main(argv) != 0:
        raise SystemExit(f"simulate failed on slice {offset}")
    return json.loads(out.read_text()) | {"load_average": [load, os.getloadavg()[0]]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=str(TRACE.resolve()))
    p.add_argument("--limit", type=int, default=40, help="requests per slice")
    p.add_argument("--slices", type=int, default=3)
    p.add_argument("--seed", type=int, default=18)
    p.add_argument("--rate", type=float, default=0.5)
    p.add_argument("--max-input-len", type=int, default=512)
    p.add_argument("--max-output-len", type=int, default=64)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--no-calibrate", action="store_true", help="use the cached profile (or --profile)")
    p.add_argument("--profile", default=None, help="a profile file instead of this machine's cached one")
    p.add_argument("--output", default="results/calib_fidelity.json")
    args = p.parse_args()
    from segserve.entrypoints.cli import main as cli

    if not args.no_calibrate and not args.profile and cli(["profile", "--quick"]) != 0:
        return 1
    with open(args.trace, encoding="utf-8") as f:
        rows = sum(1 for _ in f) - 1
    offsets = held_out_offsets(rows, args.limit, args.slices, args.seed)
    print(f"[fidelity] held-out slices (seed {args.seed}): rows " + ", ".join(
        f"{o}-{o + args.limit - 1}" for o in offsets), flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for off in offsets:
            results[off] = run_slice(args, off, Path(tmp) / f"{off}.json")
    print(table(results))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"offsets": offsets, "args": vars(args), "results": results},
                                            indent=2) + "\n", encoding="utf-8")
    print(f"[fidelity] wrote {args.output}")
    return 0


def table(results: dict) -> str:
    """sim / real per metric and slice, with the simulated and measured values."""
    head = "| metric | " + " | ".join(f"rows {o}+ sim / real (sim, real)" for o in results) + " | goal |"
    lines = [head, "|---" * (len(results) + 2) + "|"]
    for m in METRICS:
        goal = "±20 %" if m.startswith("p99") else "±10 %"
        cells = []
        for res in results.values():
            sim, real = res["summary"].get(m), res["real"].get(m)
            ratio = res["sim_over_real"].get(m)
            cells.append("n/a" if ratio is None else f"{ratio:.3f} ({sim:.4g}, {real:.4g})")
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {goal} |")
    steps = [f"{r['steps']['mean_step_time_ms'] / r['real']['mean_step_time_ms']:.3f}"
             for r in results.values() if "mean_step_time_ms" in r.get("real", {})]
    if steps:
        lines.append("| mean step time | " + " | ".join(steps) + " | |")
    loads = [f"{r['load_average'][0]:.1f} -> {r['load_average'][1]:.1f}" for r in results.values()]
    lines.append("| 1-min load average | " + " | ".join(loads) + " | |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
