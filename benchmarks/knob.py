"""The knob: time to first token against inter-token latency as the token budget and policy change.

A trace (``--dataset``, lengths scaled by ``--length-scale``, outputs capped at ``--output-cap``)
is replayed in real time at ``--request-rate`` requests/s (Poisson, seeded) on the real engine,
once per combination of ``--budgets`` x ``--policies`` x ``--attention-cost-tokens`` (0: token
budget only). Per run: TTFT p50/p99, ITL p50/p99, and the spread of step times (max / median), which
the attention-cost-weighted budget is meant to narrow on long prompts. Figure: p99 TTFT against p99
ITL per setting (the trade-off curve), p50 beside it.

    .venv/bin/python benchmarks/knob.py             # azure-conv, 12 requests at 0.4/s, 6 settings
    .venv/bin/python benchmarks/knob.py --dataset mooncake-conv --num-prompts 8 --length-scale 0.5 \\
        --output-cap 32 --request-rate 0.1 --budgets 128,256,512 --policies decode_first \\
        --attention-cost-tokens 0,1024 --json results/cost_budget.json --png docs/cost_budget.png
    # runs measured in several invocations, plotted together (no measuring):
    .venv/bin/python benchmarks/knob.py --plot-from a.json b.json --json all.json --png all.png
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
from pathlib import Path

from segserve.bench import experiment as ex


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _label(run: dict) -> str:
    """``policy/budget`` plus ``/K<k>`` when the cost budget is on."""
    k = run["attention_cost_tokens"]
    return f"{run['policy']}/{run['budget']}" + (f"/K{k}" if k else "")


def run_setting(loaded, args, requests, budget: int, policy: str, cost_k: int) -> dict:
    from segserve import LLMEngine

    need = sum(len(ids) + n for _, ids, n, _ in requests)
    engine = LLMEngine(
        model=loaded, max_num_batched_tokens=budget, scheduling_policy=policy, attention_cost_tokens=cost_k,
        block_size=16, num_kv_blocks=-(-need // 16) + len(requests) + 2, max_num_seqs=len(requests),
        seed=args.seed,
    )
    st = ex.Stepper(engine)
    st.replay(requests)
    tl = st.timeline
    rids = [r[0] for r in requests]
    steps = tl.step_durations()
    ttft, itl = ex.latency_stats([tl.ttft(r) for r in rids]), ex.latency_stats(tl.itls(rids))
    return {
        "budget": budget, "policy": policy, "attention_cost_tokens": cost_k, "ttft": ttft, "itl": itl,
        "steps": len(steps), "step_max_over_median": max(steps) / statistics.median(steps),
        "step_time": ex.latency_stats(steps), "duration_s": max(t[-1] for t in tl.token_times.values()),
    }


def plot(runs: list[dict], path: str) -> None:
    fig, axes = ex.new_figure(ncols=2)
    runs = sorted(runs, key=lambda r: (r["policy"], r["attention_cost_tokens"], r["budget"]))
    for stat, ax in zip(("p99", "p50"), axes, strict=True):
        keyed = itertools.groupby(runs, key=lambda r: (r["policy"], r["attention_cost_tokens"]))
        for (policy, cost_k), group in keyed:
            group = sorted(group, key=lambda r: r["budget"])
            xs = [r["ttft"][f"{stat}_ms"] / 1000 for r in group]
            ys = [r["itl"][f"{stat}_ms"] for r in group]
            label = policy + (f", cost K={cost_k}" if cost_k else "")
            ax.plot(xs, ys, marker="o", label=label)
            for r, x, y in zip(group, xs, ys, strict=True):
                ax.annotate(str(r["budget"]), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel(f"TTFT {stat}, s")
        ax.set_ylabel(f"ITL {stat}, ms")
        ax.set_title(f"{stat}: each point a token budget")
        ax.legend(fontsize=8)
    ex.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    from segserve.bench.serve_client import arrival_times
    from segserve.bench.workloads import KINDS, make_workload

    p = ex.common_args(__doc__.splitlines()[0], "knob")
    p.add_argument("--dataset", choices=KINDS[2:], default="azure-conv")
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--length-scale", type=float, default=1.0)
    p.add_argument("--output-cap", type=int, default=64, help="clip output lengths, tokens")
    p.add_argument("--request-rate", type=float, default=0.4, help="requests/s (Poisson)")
    p.add_argument("--budgets", default="64,256,1024")
    p.add_argument("--policies", default="decode_first,prefill_first")
    p.add_argument("--attention-cost-tokens", default="0", help="comma list; 0 = token budget only")
    p.add_argument("--plot-from", nargs="+", default=None, metavar="JSON",
                   help="measure nothing: merge the runs of these earlier records, plot and summarize them")
    args = p.parse_args(argv)
    if args.output_cap < 1:
        p.error(f"--output-cap must be >= 1, got {args.output_cap}")
    if args.plot_from:
        if args.json == p.get_default("json") or args.png == p.get_default("png"):
            p.error("--plot-from needs its own --json and --png (the defaults hold the committed knob run)")
        try:
            return _replot(args)
        except ValueError as e:
            p.error(str(e))
    loaded = ex.load(args)
    max_len = min(8192, loaded.config.max_position_embeddings)
    w = make_workload(args.dataset, args.num_prompts, vocab_size=loaded.config.vocab_size,
                      max_model_len=max_len, length_scale=args.length_scale)
    sends = arrival_times(len(w.requests), args.request_rate, seed=args.seed)
    requests = [(f"r{i}", list(r.prompt_token_ids), min(r.output_len, args.output_cap), t)
                for i, (r, t) in enumerate(zip(w.requests, sends, strict=True))]
    settings = list(itertools.product(args.policies.split(","), _ints(args.attention_cost_tokens),
                                      _ints(args.budgets)))
    runs = [run_setting(loaded, args, requests, b, pol, k) for pol, k, b in settings]
    record = {"settings": vars(args), "workload": w.settings, "runs": runs}
    _report(args, record, f"{args.dataset} x{args.num_prompts} at {args.request_rate}/s")
    return 0


def _replot(args) -> int:
    """``--plot-from``: one record, figure and summary line from earlier records' runs.

    Raises:
        ValueError: an unreadable file, a record without runs, records of different workloads, or
            two runs with the same setting.
    """
    records = []
    for path in args.plot_from:
        try:
            rec = json.loads(Path(path).read_text())
            runs = rec["runs"]
            workload, settings = rec["workload"], rec["settings"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a knob.py record ({type(e).__name__}: {e})") from None
        if not runs:
            raise ValueError(f"{path}: the record has no runs")
        records.append((path, rec, workload, settings))
    first_path, _, workload, first = records[0]
    for path, _, other, _ in records[1:]:
        if other != workload:
            raise ValueError(f"{path} measured another workload than {first_path}; runs would not compare")
    runs = [run for _, rec, _, _ in records for run in rec["runs"]]
    labels = [_label(r) for r in runs]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise ValueError(f"setting {dupes[0]} appears in more than one run; merge distinct settings")
    record = {"settings": [s for _, _, _, s in records], "merged_from": args.plot_from, "workload": workload,
              "runs": runs}
    _report(args, record, f"{first['dataset']} x{first['num_prompts']} at {first['request_rate']}/s (merged)")
    return 0


def _report(args, record: dict, what: str) -> None:
    """Plot ``record["runs"]``, add ratios to the first run, print one line and save the record."""
    runs = record["runs"]
    plot(runs, args.png)
    base = runs[0]
    parts = [
        f"{_label(r)}: TTFT p99 {r['ttft']['p99_ms'] / 1000:.1f} s, ITL p99 {r['itl']['p99_ms']:,.0f} ms, "
        f"step max/med {r['step_max_over_median']:.1f}"
        for r in runs
    ]
    line = f"knob: {what}; " + "; ".join(parts) + f"; load {ex.load_1min():.2f}"
    ratios = {
        _label(r): {
            "ttft_p99": r["ttft"]["p99_ms"] / base["ttft"]["p99_ms"],
            "itl_p99": r["itl"]["p99_ms"] / base["itl"]["p99_ms"],
            "step_spread": r["step_max_over_median"] / base["step_max_over_median"],
        }
        for r in runs
    }
    record["ratios_to_first_run"] = ratios
    ex.finish(args, "knob", record, line)


if __name__ == "__main__":
    sys.exit(main())
