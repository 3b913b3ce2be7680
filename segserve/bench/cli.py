"""``segserve bench throughput`` and ``segserve bench serve``.

Each prints ONE summary line and writes a JSON record (settings, machine load, results, ratios).
Imports of torch, the engine and ``transformers`` happen inside the commands.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from segserve.bench.workloads import KINDS, Workload, make_workload

DEFAULT_VOCAB = 49_152  # SmolLM2; `bench serve` has no model to ask
DEFAULT_MAX_MODEL_LEN = 8_192


def register(subparsers: Any) -> None:
    """Add ``bench`` with its ``throughput`` and ``serve`` subcommands."""
    from segserve.engine_args import EngineArgs

    bench = subparsers.add_parser("bench", help="benchmarks: offline throughput, online serving")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    tp = sub.add_parser("throughput", help="offline throughput, optionally vs transformers in the same run")
    EngineArgs.add_cli_args(tp)
    _workload_args(tp)
    tp.add_argument("--baseline", choices=["none", "hf"], default="none", help="hf: transformers, same run")
    tp.add_argument("--hf-batch-size", type=int, default=16, help="static batch size of the hf baseline")
    tp.add_argument(
        "--hf-cb", action=argparse.BooleanOptionalAction, default=True,
        help="also run transformers' continuous batching (generate_batch) when installed",
    )
    tp.add_argument("--output-json", default="results/bench_throughput.json")
    tp.set_defaults(func=run_throughput)
    sv = sub.add_parser("serve", help="online client for an OpenAI-compatible server")
    sv.add_argument("--base-url", default="http://127.0.0.1:8000")
    sv.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    _workload_args(sv)
    sv.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB, help="for random token ids")
    sv.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    sv.add_argument("--seed", type=int, default=0)
    sv.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    sv.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of gaps (1: Poisson)")
    sv.add_argument("--max-concurrency", type=int, default=None)
    sv.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS", help="e.g. ttft:500 tpot:50")
    sv.add_argument("--output-json", default="results/bench_serve.json")
    sv.set_defaults(func=run_serve_command)


def _workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=KINDS, default="random")
    g.add_argument("--num-prompts", type=int, default=32)
    g.add_argument("--input-len", type=int, default=512, help="random/text prompt tokens")
    g.add_argument("--output-len", type=int, default=64, help="random/text output tokens")
    g.add_argument("--range-ratio", type=float, default=0.0, help="random/text lengths in len*(1 +- r)")
    g.add_argument("--length-scale", type=float, default=1.0, help="traces: multiply lengths, then clip")
    g.add_argument("--trace-offset", type=int, default=0, help="traces: first row to use")
    g.add_argument("--trace-dir", default=None, help="traces: directory (default ../shared/data/traces)")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


def _workload(args: argparse.Namespace, vocab: int, max_model_len: int, tokenizer: Any) -> Workload:
    return make_workload(
        args.dataset, args.num_prompts, vocab_size=vocab, max_model_len=max_model_len,
        tokenizer=tokenizer, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, length_scale=args.length_scale, seed=args.seed,
        trace_offset=args.trace_offset, trace_dir=args.trace_dir,
    )


def machine() -> dict[str, Any]:
    """Where and under what load a number was measured (1-minute load average, cores)."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "load_1min": load, "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def write_json(path: str, record: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=2, default=str) + "\n")


def run_throughput(args: argparse.Namespace) -> int:
    """Build the engine and the workload, run segserve (and the baselines), print one line."""
    from segserve import LLMEngine
    from segserve.bench import throughput as tp
    from segserve.engine_args import EngineArgs

    if args.hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {args.hf_batch_size}")
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    vocab = engine.loaded.config.vocab_size
    workload = _workload(args, vocab, engine.max_model_len, engine.tokenizer)
    progress = not args.no_progress
    ours = tp.run_segserve(engine, workload, progress).summary()
    baselines: dict[str, dict] = {}
    if args.baseline == "hf":
        del engine  # the KV pool is not needed while transformers runs
        model = tp.load_hf_model(args.model, args.dtype)
        baselines["hf-static"] = tp.run_hf_static(model, workload, args.hf_batch_size, progress).summary()
        if args.hf_cb and tp.hf_has_continuous_batching(model):
            baselines["hf-cb"] = tp.run_hf_continuous(
                model, workload, args.max_num_batched_tokens, progress
            ).summary()
    record = {
        "command": "bench throughput", "workload": workload.settings, "machine": machine(),
        "segserve": ours, "baselines": baselines,
        "ratios": {name: tp.ratios(ours, b) for name, b in baselines.items()},
    }
    write_json(args.output_json, record)
    print(tp.summary_line(ours, baselines), flush=True)
    return 0


def run_serve_command(args: argparse.Namespace) -> int:
    """Send the workload to ``--base-url`` at ``--request-rate``; print one line, save JSON."""
    import asyncio

    from segserve.bench import serve_client as sc

    goodput = sc.parse_goodput(args.goodput)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1 (omit it for no limit), got {args.max_concurrency}")
    tokenizer = _serve_tokenizer() if args.dataset == "text" else None
    workload = _workload(args, args.vocab_size, args.max_model_len, tokenizer)
    reqs = list(workload.requests)
    sends = sc.arrival_times(len(reqs), args.request_rate, args.burstiness, args.seed)
    timings, duration = asyncio.run(
        sc.run_serve(
            args.base_url, reqs, sends, args.model, args.max_concurrency, progress=not args.no_progress
        )
    )
    result = sc.summarize(timings, duration, goodput)
    record = {
        "command": "bench serve", "base_url": args.base_url, "request_rate": args.request_rate,
        "burstiness": args.burstiness, "goodput_slos_ms": goodput, "workload": workload.settings,
        "machine": machine(), "result": result,
    }
    write_json(args.output_json, record)
    print(sc.summary_line(result), flush=True)
    return 0 if result["completed"] else 1


def _serve_tokenizer() -> Any:
    """The default model's tokenizer (for ``--dataset text``), loaded without the weights."""
    from transformers import AutoTokenizer

    from segserve.models.loader import default_model_path

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
