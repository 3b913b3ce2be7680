"""``segserve simulate``, ``segserve tune`` and ``segserve profile``.

Imports stay light: the simulator is pure Python; ``profile`` and ``simulate --compare-real`` load
the engine (torch) inside the command only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from segserve.engine_args import EngineArgs, given_max_model_len
from segserve.routing.prefix_affinity import add_affinity_args
from segserve.simulator.budget import add_budget_args

ROOFLINE_MODELS = ("llama-8b", "smollm2-135m")


def register(subparsers) -> None:
    """Add the three subcommands to ``segserve``'s subparsers."""
    sim = subparsers.add_parser(
        "simulate", help="simulate continuous batching of a workload (no model needed)"
    )
    _workload_args(sim)
    _sim_args(sim)
    sim.add_argument("--slo", default=None, help="SLOs for goodput, e.g. itl_p99=50ms,ttft_p99=2s")
    sim.add_argument("--output-json", default=None, help="write the results here")
    sim.add_argument("--chrome-trace", default=None, help="write a chrome://tracing JSON of the steps here")
    sim.add_argument("--plot", default=None, help="write a PNG of KV usage, queues, step times, batch sizes")
    sim.add_argument(
        "--compare-real",
        action="store_true",
        help="also replay the workload on the real engine in-process and print both",
    )
    sim.add_argument(
        "--real-samples-out",
        default=None,
        help="with --compare-real: write the real steps as samples for profile --from-samples",
    )
    sim.set_defaults(func=run_simulate)

    tun = subparsers.add_parser("tune", help="search budget x policy x long-prefill cap for the best goodput")
    _workload_args(tun)
    _sim_args(tun)
    tun.add_argument("--slo", required=True, help="e.g. itl_p99=50ms,ttft_p99=2s")
    tun.add_argument("--budgets", default="128,256,512,1024,2048", help="max_num_batched_tokens values")
    tun.add_argument("--policies", default="decode_first,prefill_first")
    tun.add_argument("--caps", default="0,256", help="long_prefill_token_threshold values (0: none)")
    tun.add_argument("--output-json", default=None)
    tun.add_argument("--plot", default=None, help="write the goodput/SLO curves as a PNG here")
    tun.add_argument(
        "--verify-real",
        action="store_true",
        help="run the recommended setting on the real engine (in-process, real time) and check the SLO; "
        "exit status 3 when it misses there",
    )
    tun.set_defaults(func=run_tune)

    prof = subparsers.add_parser("profile", help="measure this engine's step times and fit a step-time model")
    prof.add_argument(
        "--quick", action="store_true",
        help="a calibration of about a minute (idle 2 cores), cached for this machine where simulate, tune "
        "and serve find it",
    )
    prof.add_argument("--output", default=None, help="profile JSON to write (required without --quick)")
    prof.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M)")
    prof.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="--quick: dtype")
    prof.add_argument("--block-size", type=int, default=16, help="--quick: KV block size")
    prof.add_argument("--kv-segment-size", type=int, default=512, help="--quick: segment size")
    prof.add_argument("--samples-out", default=None, help="also write the raw measured steps here")
    prof.add_argument(
        "--from-samples", default=None, help="refit from a --samples-out file, measuring nothing"
    )
    prof.add_argument("--roofline", default=None, help="write an analytic profile for h100/h200/a100 instead")
    prof.add_argument("--roofline-model", default="llama-8b", choices=ROOFLINE_MODELS)
    prof.add_argument("--mfu", type=float, default=0.5, help="roofline: achieved fraction of peak FLOP/s")
    prof.add_argument("--mbu", type=float, default=0.8, help="roofline: achieved fraction of peak bandwidth")
    prof.set_defaults(func=run_profile)


def _workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--trace", default=None, help="Azure .csv or Mooncake .jsonl trace")
    g.add_argument("--offset", type=int, default=0, help="first trace row to use")
    g.add_argument("--limit", type=int, default=None, help="trace rows to use")
    g.add_argument("--rate", type=float, default=None, help="re-time arrivals at this many requests/s")
    g.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of re-timed arrivals (1: Poisson)"
    )
    g.add_argument("--synthetic", type=int, default=None, help="N synthetic requests instead of a trace")
    g.add_argument("--input-len", type=int, default=1024)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        help="shared prefix of synthetic prompts, tokens (whole 512-token blocks: rounded down)",
    )
    g.add_argument("--max-input-len", type=int, default=None, help="clip prompts to this many tokens")
    g.add_argument("--max-output-len", type=int, default=None, help="clip outputs to this many tokens")


def _sim_args(p: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(p)
    add_budget_args(p)
    g = p.add_argument_group("simulation")
    g.add_argument(
        "--profile", default=None,
        help="step-time profile JSON (default: this machine's cached one, else the built-in, with a warning)",
    )
    g.add_argument(
        "--calibrate", action="store_true",
        help="no usable cached profile for this machine: measure one now (profile --quick) and cache it",
    )
    g.add_argument("--num-replicas", type=int, default=1)
    g.add_argument(
        "--router", default="round_robin", choices=["round_robin", "least_loaded", "prefix_affinity"]
    )
    add_affinity_args(g)
    g.add_argument(
        "--disaggregated",
        default=None,
        metavar="P:D",
        help="P prefill and D decode replicas instead of --num-replicas (simulate only)",
    )
    g.add_argument("--link-bandwidth", type=float, default=50.0, help="KV link for --disaggregated, GB/s")


def load_workload(args: argparse.Namespace):
    """The workload the flags describe. Raises ValueError when neither --trace nor --synthetic is given."""
    from segserve.simulator import workload as wl

    for flag in ("synthetic", "input_len", "output_len", "limit", "max_input_len", "max_output_len"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.offset < 0:
        raise ValueError(f"--offset must be >= 0, got {args.offset}")
    if args.synthetic and 0 < args.prefix_len < wl.HASH_BLOCK_TOKENS:
        raise ValueError(
            f"--prefix-len {args.prefix_len} shares nothing: prefixes are whole {wl.HASH_BLOCK_TOKENS}-token "
            "blocks (use 0 or >= 512)"
        )
    if args.synthetic:
        reqs = wl.synthetic(
            args.synthetic,
            args.rate,
            args.input_len,
            args.output_len,
            args.burstiness,
            args.prefix_len,
            seed=args.seed,
        )
    elif args.trace:
        reqs = wl.load_trace(args.trace, args.limit, args.offset)
        if args.rate is not None:
            reqs = wl.retime(reqs, args.rate, args.burstiness, args.seed)
    else:
        raise ValueError("give --trace FILE or --synthetic N")
    if args.max_input_len or args.max_output_len:
        reqs = wl.scale_lengths(reqs, args.max_input_len or 1 << 62, args.max_output_len or 1 << 62)
    return reqs


def build_config(args: argparse.Namespace, reqs):
    """EngineConfig from the engine flags; max_model_len defaults to the longest request.

    The simulated model has no context length of its own: ``--max-model-len`` when given, else the
    longest request (at least 2 tokens), stands in for it.
    """
    longest = max(r.input_len + r.output_len for r in reqs)
    given = given_max_model_len(args.max_model_len)
    return EngineArgs.from_cli_args(args).create_engine_config(given or max(longest, 2))


def _step_model(args: argparse.Namespace, command: str):
    """The step model the flags select (``calibration.choose_profile``); says which on stderr, and
    settles ``--max-num-batched-tokens auto`` from it."""
    from segserve.simulator.budget import settle_budget
    from segserve.simulator.calibration import choose_profile, fingerprint_for_args

    choice = choose_profile(fingerprint_for_args(args), args.profile, args.calibrate)
    print(f"[{command}] {choice.line}", file=sys.stderr)
    if choice.warning:
        print(f"[{command}] warning: {choice.warning}", file=sys.stderr)
    if args.max_num_batched_tokens == "auto" or command == "simulate":
        budget = settle_budget(
            args.max_num_batched_tokens, choice.model, args.target_itl_ms, args.block_size, args.max_num_seqs,
            given_max_model_len(args.max_model_len) or 8192,
        )
        if budget.auto:
            print(f"[{command}] {budget.line}", file=sys.stderr)
        args.max_num_batched_tokens = budget.budget
    return choice.model


def _kv_blocks(step_model):
    """Pool size of a configuration, as the engine would choose it for the profile's model."""
    from segserve.config import num_kv_blocks_for

    return lambda cfg: num_kv_blocks_for(cfg, step_model.model.kv_bytes_per_token)


def _finite(d: dict) -> dict:
    """JSON has no NaN: NaN and inf become None."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def run_simulate(args: argparse.Namespace) -> int:
    from segserve.simulator.cluster import simulate
    from segserve.simulator.metrics import parse_slo, step_summary, summarize

    reqs = load_workload(args)
    model = _step_model(args, "simulate")
    cfg = build_config(args, reqs)
    num_blocks = _kv_blocks(model)(cfg)
    slos = parse_slo(args.slo) if args.slo else None
    extra = {}
    if args.disaggregated:
        res, extra = _simulate_disagg(args, reqs, cfg, num_blocks, model)
    else:
        res = simulate(reqs, cfg, num_blocks, model, args.num_replicas, args.router,
                       imbalanced_threshold=args.router_imbalanced_threshold,
                       match_rate_threshold=args.router_match_rate_threshold)
    summary = summarize(res.requests, slos) | extra
    result = {
        "settings": _settings(cfg, num_blocks, args, model),
        "summary": _finite(summary),
        "steps": _finite(step_summary(res.steps)),
        "prefix_hit_rate": res.prefix_hit_rate,
        "kv_usage_over_time": _downsample([(s.start, s.kv_usage) for s in res.steps], 500),
    }
    if args.compare_real:
        result["real"] = _finite(_run_real(args, reqs, cfg, num_blocks, slos))
        result["sim_over_real"] = _ratios(result["summary"], result["real"])
    _write_outputs(args, result, res.steps)
    print(_line(summary, res))
    return 0


def _simulate_disagg(args, reqs, cfg, num_blocks, model):
    from segserve.simulator.disagg import DisaggConfig, simulate_disaggregated

    p, _, d = args.disaggregated.partition(":")
    if not (p.isdigit() and d.isdigit()):
        raise ValueError(f"--disaggregated must be P:D replica counts like 2:6, got {args.disaggregated!r}")
    disagg = DisaggConfig(int(p), int(d), args.link_bandwidth * 1e9, model.model.kv_bytes_per_token)
    return simulate_disaggregated(reqs, cfg, num_blocks, model, disagg)


def _settings(cfg, num_blocks, args, model) -> dict:
    s = cfg.scheduler
    return {
        "max_num_batched_tokens": s.max_num_batched_tokens,
        "policy": s.policy,
        "long_prefill_token_threshold": s.long_prefill_token_threshold,
        "attention_cost_tokens": s.attention_cost_tokens,
        "max_num_seqs": s.max_num_seqs,
        "max_model_len": s.max_model_len,
        "block_size": cfg.cache.block_size,
        "num_kv_blocks": num_blocks,
        "enable_prefix_caching": cfg.cache.enable_prefix_caching,
        "num_replicas": args.num_replicas,
        "router": args.router,
        "router_imbalanced_threshold": args.router_imbalanced_threshold,
        "router_match_rate_threshold": args.router_match_rate_threshold,
        "disaggregated": args.disaggregated,
        "link_bandwidth_gbs": args.link_bandwidth,
        "profile": model.to_dict(),
    }


def _downsample(points: list, n: int) -> list:
    step = max(1, len(points) // n)
    return points[::step]


def _line(summary: dict, res) -> str:
    line = (
        f"[simulate] completed={summary['completed']} failed={summary['failed']} "
        f"duration={summary['duration']:.1f}s req/s={summary['request_throughput']:.3f} "
        f"out tok/s={summary['output_throughput']:.1f} ttft median/p99={summary['median_ttft_ms']:.0f}/"
        f"{summary['p99_ttft_ms']:.0f}ms itl median/p99={summary['median_itl_ms']:.1f}/"
        f"{summary['p99_itl_ms']:.1f}ms preemptions={summary['num_preemptions']} steps={len(res.steps)}"
    )
    first = next((r.error for r in res.requests if r.error), None)
    return line + (f"; first rejection: {first}" if first else "")


def _write_outputs(args, result: dict, steps) -> None:
    from segserve.simulator.report import plot_run, write_chrome_trace

    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    if args.chrome_trace:
        write_chrome_trace(steps, args.chrome_trace)
    if args.plot:
        plot_run(steps, args.plot)


def _run_real(args, reqs, cfg, num_blocks, slos) -> dict:
    """The same workload on the real engine (in-process, real time); its ``summarize`` dict."""
    from dataclasses import replace

    from segserve import LLMEngine
    from segserve.simulator.metrics import summarize
    from segserve.simulator.replay import replay

    engine_args = replace(
        EngineArgs.from_cli_args(args), num_kv_blocks=num_blocks, max_model_len=cfg.scheduler.max_model_len
    )
    engine = LLMEngine.from_engine_args(engine_args)
    _warm_up(engine)
    records, samples = replay(engine, reqs, log=lambda m: print(m, file=sys.stderr))
    if args.real_samples_out:
        from segserve.simulator.profile import model_shape_of, samples_to_json
        from segserve.simulator.replay import engine_decodes_gather

        data = {"samples": samples_to_json(samples), "model": model_shape_of(engine.loaded),
                "decode_gathers": engine_decodes_gather(engine)}
        Path(args.real_samples_out).write_text(json.dumps(data), encoding="utf-8")
    summary = summarize(records, slos)
    summary["num_preemptions"] = engine.scheduler.make_stats().num_preemptions
    summary["num_steps"] = len(samples)
    summary["mean_step_time_ms"] = 1000 * sum(t for _, t in samples) / max(len(samples), 1)
    return summary


def _warm_up(engine) -> None:
    """One short request first: the first steps of a fresh engine pay one-time allocation costs."""
    from segserve import SamplingParams

    n = max(1, min(300, engine.max_model_len - 4))
    engine.add_request("warmup", list(range(100, 100 + n)), SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def _ratios(sim: dict, real: dict) -> dict:
    return {k: sim[k] / real[k] for k in sim if isinstance(sim.get(k), float) and real.get(k)}


def run_tune(args: argparse.Namespace) -> int:
    from segserve.simulator.metrics import parse_slo
    from segserve.simulator.report import plot_tune
    from segserve.simulator.tune import settings, tune

    if args.disaggregated:
        raise ValueError("tune searches colocated replicas; --disaggregated is for simulate only")
    if args.verify_real and args.num_replicas != 1:
        raise ValueError(
            f"--verify-real runs one real engine, so it needs --num-replicas 1, got {args.num_replicas}"
        )
    reqs = load_workload(args)
    slos = parse_slo(args.slo)
    grid = settings(_ints(args.budgets, "--budgets"), args.policies.split(","), _ints(args.caps, "--caps", 0))
    model = _step_model(args, "tune")
    base = build_config(args, reqs)
    blocks = _kv_blocks(model)
    best, rows = tune(reqs, base, blocks, model, slos, grid, args.num_replicas, args.router)
    out = {
        "slo": args.slo,
        "settings": _settings(base, blocks(base), args, model),
        "best": best and _finite(best),
        "rows": [_finite(r) for r in rows],
    }
    # Written now, so the simulated rows survive a real run that fails (a bad --model, say).
    _write_json(args.output_json, out)
    if args.plot:
        plot_tune(rows, args.plot, [s.key for s in slos])
    if best is None:
        print(f"[tune] no setting of {len(rows)} meets {args.slo}" + _why_infeasible(rows, slos))
        return 1
    print(
        f"[tune] best of {len(rows)}: max_num_batched_tokens={best['max_num_batched_tokens']} "
        f"policy={best['policy']} long_prefill_token_threshold={best['long_prefill_token_threshold']} "
        f"goodput={best['request_goodput']:.3f} req/s " + " ".join(f"{s.key}={best[s.key]:.1f}" for s in slos)
    )
    status = 0
    if args.verify_real:
        real = _verify_real(args, reqs, base, blocks, slos, best)
        out["real"] = _finite(real)
        met = real["meets_slo"]
        print(
            f"[tune] on the real engine: {'meets' if met else 'MISSES'} {args.slo}: "
            + " ".join(f"{s.key}={real[s.key]:.1f}" for s in slos)
            + f" goodput={real['request_goodput']:.3f} req/s"
        )
        status = 0 if met else VERIFY_MISSED
        _write_json(args.output_json, out)
    return status


def _why_infeasible(rows: list[dict], slos) -> str:
    """A hint when no setting could have met the SLO whatever its latencies."""
    if all(r["completed"] == 0 for r in rows):
        return (
            f" (every request was rejected in every setting: {rows[0]['failed']} longer than "
            "max_model_len or the KV pool)"
        )
    undefined = [s.key for s in slos if all(math.isnan(r.get(s.key, math.nan)) for r in rows)]
    if undefined:
        return f" ({', '.join(undefined)} undefined: no request generated 2+ tokens)"
    return ""


# Exit status of ``tune --verify-real`` when the recommendation misses its SLO on the real engine
# (1: nothing feasible in simulation; 2: bad input, as argparse uses).
VERIFY_MISSED = 3


def _verify_real(args, reqs, base, blocks, slos, best: dict) -> dict:
    """Replay the workload on the real engine with ``best``'s setting; its summary + ``meets_slo``."""
    from segserve.simulator.metrics import slo_met

    chosen = argparse.Namespace(**vars(args))
    chosen.max_num_batched_tokens = best["max_num_batched_tokens"]
    chosen.scheduling_policy = best["policy"]
    chosen.long_prefill_token_threshold = best["long_prefill_token_threshold"]
    chosen.real_samples_out = None
    cfg = build_config(chosen, reqs)
    real = _run_real(chosen, reqs, cfg, blocks(cfg), slos)
    real["meets_slo"] = slo_met(real, slos) and real["failed"] == 0
    return real


def _write_json(path: str | None, data: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _ints(text: str, flag: str, minimum: int = 1) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < minimum:
        raise ValueError(f"{flag} needs integers >= {minimum}, got {text!r}")
    return vals


def run_profile(args: argparse.Namespace) -> int:
    from segserve.simulator.step_model import LLAMA_8B, ModelShape, roofline_profile, save_profile

    if args.roofline:
        shape = LLAMA_8B if args.roofline_model == "llama-8b" else ModelShape(dtype_bytes=2)
        save_profile(roofline_profile(args.roofline, shape, args.mfu, args.mbu), args.output)
        print(f"[profile] wrote roofline profile {args.roofline}/{shape.name} to {args.output}")
        return 0
    if args.quick:
        return _run_profile_quick(args)
    if not args.output:
        raise ValueError("give --output FILE (or --quick, which caches the profile for this machine)")
    from segserve.simulator.fit import fit_linear
    from segserve.simulator.profile import measure, model_shape_of, samples_from_json, samples_to_json

    if args.from_samples:
        if Path(args.output).resolve() == Path(args.from_samples).resolve():
            raise ValueError(f"--output {args.output} would overwrite the --from-samples file; pick another")
        try:
            data = json.loads(Path(args.from_samples).read_text(encoding="utf-8"))
            rows, shape = data["samples"], ModelShape(**data["model"])
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(
                f"--from-samples {args.from_samples}: not a samples file from --samples-out or "
                f"--real-samples-out ({type(e).__name__}: {e})"
            ) from None
        samples = samples_from_json(rows)
        decode_gathers = bool(data.get("decode_gathers", True))  # files before the compiled kernels: True
        if rows and not any("gathered" in r for r in rows):
            print("[profile] note: these samples predate the gathered_kv feature; it is fitted as 0",
                  file=sys.stderr)
    else:
        from segserve.kernels import cpu as cpu_kernels
        from segserve.models.loader import load_model

        loaded = load_model(args.model)
        samples, shape = measure(loaded), ModelShape(**model_shape_of(loaded))
        decode_gathers = not cpu_kernels.enabled()  # the measuring engines' float32 CPU caches
        if args.samples_out:
            data = {"samples": samples_to_json(samples), "model": asdict_shape(shape),
                    "decode_gathers": decode_gathers}
            Path(args.samples_out).write_text(json.dumps(data), encoding="utf-8")
    source = f"segserve profile ({len(samples)} steps)"
    fitted, stats = fit_linear(
        samples, model=shape, source=source, decode_gathers=decode_gathers, decode_table=True
    )
    save_profile(fitted, args.output, {"fit": stats})
    print(
        f"[profile] {len(samples)} steps, mean |rel err| {stats['mean_abs_rel_err']:.3f}, "
        f"p90 {stats['p90_abs_rel_err']:.3f}; wrote {args.output}"
    )
    return 0


def _run_profile_quick(args: argparse.Namespace) -> int:
    """``profile --quick``: measure, fit, print the fit's error (overall and per kind of step), cache."""
    from segserve.simulator.calibration import machine_fingerprint, profile_path, save_cached
    from segserve.simulator.profile import calibrate_quick, samples_to_json

    if args.from_samples or args.roofline:
        raise ValueError("--quick measures this machine: not with --from-samples or --roofline")
    fp = machine_fingerprint(args.model, args.dtype, args.block_size, args.kv_segment_size)
    print(f"[profile] quick calibration of {fp.describe()}", flush=True)
    samples: list = []
    fitted, stats = calibrate_quick(fp, samples_out=samples)
    path = save_cached(fitted, fp, stats, profile_path(fp))
    if args.samples_out:  # the --from-samples format, so the calibration can be refitted offline
        data = {"samples": samples_to_json(samples), "model": asdict_shape(fitted.model),
                "decode_gathers": fitted.decode_gathers}
        Path(args.samples_out).write_text(json.dumps(data), encoding="utf-8")
    if args.output:
        save_cached(fitted, fp, stats, Path(args.output))  # the same file: --profile checks it too
    kinds = ", ".join(
        f"{k} {v['mean_rel_err']:+.0%} (n={v['n']})" for k, v in stats["by_kind"].items()
    )
    print(
        f"[profile] {int(stats['n'])} steps in {stats['seconds']:.0f} s; fit error: mean |rel err| "
        f"{stats['mean_abs_rel_err']:.1%}, p90 {stats['p90_abs_rel_err']:.1%}, "
        f"max {stats['max_abs_rel_err']:.1%}"
    )
    print(f"[profile] mean signed error by kind of step: {kinds}")
    if "reference_ms" in stats:
        print("[profile] reference request (start / middle / end): "
              + " / ".join(f"{t:.0f}" for t in stats["reference_ms"])
              + f" ms, {stats['reference_drift']:.0%} apart")
    print(f"[profile] wrote {path}" + (f" and {args.output}" if args.output else "")
          + (f"; samples in {args.samples_out}" if args.samples_out else ""))
    return 0


def asdict_shape(shape) -> dict:
    from dataclasses import asdict

    return asdict(shape)
