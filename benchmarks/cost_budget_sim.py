"""Cost-weighted budget in the simulator: the real ``Scheduler`` with the simulator's step-time
model (no model, no torch, seconds to run), so the question "does charging chunks their attention
cost narrow the spread of step times on long prompts?" can be asked without a quiet machine.

A long-prompt trace (Mooncake conversation, clipped to 8,192 tokens) at ``--request-rate`` runs with
the token budget alone and with ``attention_cost_tokens`` = each of ``--costs``. Figure: step time
max / median and p99 TTFT / ITL, each over the token-budget-only run. The step model is the
simulator's (``--profile`` for a measured one, e.g. from ``segserve profile``); this is a model's
answer, to be checked by ``benchmarks/knob.py`` on the real engine.

    .venv/bin/python benchmarks/cost_budget_sim.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def run(args: argparse.Namespace, cost_k: int) -> dict:
    from segserve.config import AttentionConfig, CacheConfig, EngineConfig, SchedulerConfig
    from segserve.simulator import workload as wl
    from segserve.simulator.cluster import simulate
    from segserve.simulator.metrics import step_summary, summarize
    from segserve.simulator.step_model import DEFAULT_CPU_MODEL, load_profile

    reqs = wl.load_trace(args.trace, args.num_prompts)
    reqs = wl.scale_lengths(wl.retime(reqs, args.request_rate, seed=args.seed), 8192 - 512, 512)
    config = EngineConfig(
        cache=CacheConfig(block_size=16, num_kv_blocks=args.num_kv_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.budget, attention_cost_tokens=cost_k),
        attention=AttentionConfig(),
    )
    model = load_profile(args.profile) if args.profile else DEFAULT_CPU_MODEL
    res = simulate(reqs, config, args.num_kv_blocks, model)
    s, steps = summarize(res.requests), step_summary(res.steps)
    return {"attention_cost_tokens": cost_k, "step_max_over_median": steps["max_step_time_ms"]
            / steps["median_step_time_ms"], "p99_ttft_ms": s["p99_ttft_ms"], "p99_itl_ms": s["p99_itl_ms"],
            "median_ttft_ms": s["median_ttft_ms"], "median_itl_ms": s["median_itl_ms"],
            "duration_s": s["duration"], "num_steps": steps["num_steps"]}


def main(argv: list[str] | None = None) -> int:
    from segserve.bench.workloads import TRACE_DIR, TRACE_FILES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=str(TRACE_DIR / TRACE_FILES["mooncake-conv"]))
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--request-rate", type=float, default=0.05, help="requests/s (Poisson)")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--costs", default="1024,2048,4096", help="attention_cost_tokens values to try")
    p.add_argument("--num-kv-blocks", type=int, default=8193)
    p.add_argument("--profile", default=None, help="step-time profile JSON (default: built-in CPU guess)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="results/cost_budget_sim.json")
    args = p.parse_args(argv)
    runs = [run(args, k) for k in [0, *(int(x) for x in args.costs.split(","))]]
    base = runs[0]
    keys = ("step_max_over_median", "p99_ttft_ms", "p99_itl_ms")
    ratios = {str(r["attention_cost_tokens"]): {k: r[k] / base[k] for k in keys} for r in runs[1:]}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"settings": vars(args), "runs": runs, "ratios": ratios}, indent=2))
    parts = [f"K={k}: step max/med x{v['step_max_over_median']:.2f}, p99 TTFT x{v['p99_ttft_ms']:.2f}, "
             f"p99 ITL x{v['p99_itl_ms']:.2f}" for k, v in ratios.items()]
    spread = base["step_max_over_median"]
    head = f"cost_budget_sim: budget {args.budget}, token-only step max/med {spread:.1f}; "
    print(head + "; ".join(parts) + " (simulated, vs token budget only)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
