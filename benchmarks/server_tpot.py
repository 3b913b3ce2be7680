"""Batch-1 TPOT through ``segserve serve`` against the same engine offline, interleaved in one run.

Issue 12 asks for the server's batch-1 TPOT within 1.1x of offline. Timings minutes apart on this shared
host differ by more than that, so this runs both in one invocation, alternating request by request:
each ``--server NAME=FLAGS`` starts one ``segserve serve`` process (the model and dtype given here,
``FLAGS`` added; several servers give an A/B of server builds or settings), and ``offline`` is an
``LLMEngine`` with the same engine settings in this process, stepped by hand. Every round sends each
variant one greedy request (a fresh ``--prompt-len``-token prompt, ``--output-len`` tokens,
``ignore_eos``) and takes its TPOT the way a client sees it: (last token - first token) / (n - 1). For
a server it also reads ``/metrics`` before and after: the engine loop's busy, step and model seconds per
token, so the gap splits into "the step got slower" and "time between steps".

Why the server is slower shows in the threads' scheduler counters (``/proc/<pid>/task/<tid>``), per
token: how often the event loop's thread went to sleep (``loop_wakes``: each wake takes a core from the
kernels' two OpenMP threads), and how long the engine's threads sat runnable but off a core
(``engine_wait_ms``) and how often they were preempted (``engine_preempted``). ``--burn PERIOD:MS`` adds
the variant ``offline_burn``: offline again, beside a process that wakes every PERIOD ms and burns MS ms
of CPU, a stand-in for the loop and the client with a known cost; its ``burner_cpu_ms`` against its TPOT
over ``offline``'s says how many ms a token one ms of someone else's CPU costs a two-thread team that
meets at ~150 barriers a step (about 2 here: docs/perf.md "Twentieth session").

Prints one line per round and per variant the median and minimum TPOT and its ratio to offline, and
writes ``--out`` (JSON). Quote the load average (``uptime``) with the figures. Example:
``python benchmarks/server_tpot.py --rounds 6 --server main=`` (one server, default flags).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = Path.home() / ".cache" / "segserve" / "baselines" / "smollm2-135m-instruct-q4_1-f32"
LOOP_COUNTERS = ("segserve:engine_busy_seconds", "segserve:engine_step_seconds",
                 "segserve:model_execute_seconds")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="GGUF file or HF directory")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--server", action="append", default=[], metavar="NAME=FLAGS",
                   help="a server variant: extra `segserve serve` flags (repeatable; default: one, no "
                   "flags); "
                   "NAME@TREE runs that checkout's segserve (e.g. main@/work/main)")
    p.add_argument("--no-offline", action="store_true", help="servers only (an A/B of server variants)")
    p.add_argument("--burn", type=burn_spec, default=None, metavar="PERIOD:MS",
                   help="add offline_burn: offline beside a process burning MS ms of CPU every PERIOD ms")
    p.add_argument("--clients", default="stdlib", help="comma list of stdlib,httpx: each server is timed "
                   "through each (the client shares the cores: its cost per token shows in the TPOT)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--budget", type=int, default=256, help="--max-num-batched-tokens of both sides")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "server_tpot.json")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.output_len < 2 or args.prompt_len < 1:
        p.error("--rounds >= 1, --output-len >= 2 and --prompt-len >= 1 are needed")
    args.server = args.server or ["server="]
    for spec in args.server:
        if "=" not in spec:
            p.error(f"--server takes NAME=FLAGS, got {spec!r}")
    return args


def burn_spec(text: str) -> tuple[float, float]:
    """``PERIOD:MS`` -> (period, burn) in ms; 0 < burn < period."""
    try:
        period, burn = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--burn takes PERIOD:MS (ms), got {text!r}") from None
    if not 0 < burn < period:
        raise argparse.ArgumentTypeError(f"--burn needs 0 < MS < PERIOD, got {text!r}")
    return period, burn


def prompt_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


# ---- the servers ------------------------------------------------------------------------------------


def start_server(name: str, flags: str, port: int, args: argparse.Namespace, log_dir: Path):
    """``NAME@TREE`` runs the server from another checkout's source (an A/B of server builds)."""
    root = Path(name.split("@", 1)[1]) if "@" in name else ROOT
    cmd = [sys.executable, "-m", "segserve.entrypoints.cli", "serve", "--model", args.model, "--dtype",
           args.dtype, "--port", str(port), "--served-model-name", "smol", "--max-num-batched-tokens",
           str(args.budget), *shlex.split(flags)]
    log = open(log_dir / f"server_tpot_{name.split('@')[0]}.log", "w")  # noqa: SIM115 - closed when the server stops
    path = str(root)
    env = os.environ | {"PYTHONPATH": path}
    # cwd too: ``python -m`` puts the working directory ahead of PYTHONPATH on sys.path, so without it
    # every variant would run this checkout's segserve.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=path,
                            start_new_session=True)
    return proc, log, cmd


def wait_ready(proc, base: str, timeout_s: float = 600.0) -> None:
    import httpx

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{base} did not answer within {timeout_s:.0f} s")


def loop_counters(base: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics", timeout=30).text
    out = {f.name: sum(s.value for s in f.samples) for f in text_string_to_metric_families(text)
           if f.name in LOOP_COUNTERS}
    return {k.removeprefix("segserve:"): v for k, v in out.items()}


def read_thread(pid: int, tid: int | str) -> tuple[int, int, int, int] | None:
    """One thread's (ns on a core, ns runnable off a core, voluntary, involuntary context switches) from
    ``/proc/<pid>/task/<tid>/{schedstat,status}``; None when the thread has gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            run_ns, wait_ns = (int(x) for x in f.read().split()[:2])
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            status = f.read()
    except (OSError, ValueError):
        return None
    switches = dict(line.split(":") for line in status.splitlines() if line.endswith(tuple("0123456789"))
                    and "ctxt_switches" in line)
    return (run_ns, wait_ns, int(switches.get("voluntary_ctxt_switches", 0)),
            int(switches.get("nonvoluntary_ctxt_switches", 0)))


def thread_counters(pid: int) -> dict[int, tuple[int, int, int, int]]:
    """:func:`read_thread` of every thread of ``pid`` (empty off Linux)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    out = {}
    for tid in tids:
        got = read_thread(pid, tid)
        if got is not None:
            out[int(tid)] = got
    return out


def sched_per_token(before: dict, after: dict, pid: int, tokens: int, loop: bool) -> dict[str, float]:
    """Per token, from two :func:`thread_counters` snapshots: the engine's threads (those that ran > 1
    ms, the loop's thread excluded when ``loop``) runnable-but-waiting ms and preemptions; with ``loop``
    the CPU ms (on-core time, from ``schedstat``) and wakes of ``pid``'s main thread (the server's event
    loop: HTTP, SSE encoding)."""
    out = {"engine_wait_ms_per_token": 0.0, "engine_preempted_per_token": 0.0}
    for tid, b in after.items():
        a = before.get(tid)
        if a is None or (loop and tid == pid) or b[0] - a[0] < 1_000_000:
            continue
        out["engine_wait_ms_per_token"] += (b[1] - a[1]) / 1e6 / tokens
        out["engine_preempted_per_token"] += (b[3] - a[3]) / tokens
    if loop and pid in after and pid in before:
        out["server_loop_cpu_ms_per_token"] = (after[pid][0] - before[pid][0]) / 1e6 / tokens
        out["loop_wakes_per_token"] = (after[pid][2] - before[pid][2]) / tokens
    return out


def server_request(base: str, ids: list[int], n: int, client: str = "stdlib", pid: int | None = None) -> dict:
    """One streamed request through ``client`` (``stdlib``: ``http.client``, no event loop; ``httpx``:
    the asyncio client of ``segserve bench serve``); TPOT, the server's loop counters and this
    process's CPU time (the client's), per token."""
    import httpx

    from segserve.bench import serve_client as sc

    body = {"model": "smol", "prompt": ids, "max_tokens": n, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    url = f"{base}/v1/completions"

    async def with_httpx() -> sc.RequestTiming:
        timing = sc.RequestTiming(0.0, len(ids))
        async with httpx.AsyncClient(timeout=600.0) as c:
            await sc._stream_one(c, url, body, timing, time.perf_counter())
        return timing

    before, cpu0 = loop_counters(base), sum(os.times()[:2])
    threads0 = thread_counters(pid) if pid is not None else {}
    timing = asyncio.run(with_httpx()) if client == "httpx" else sc.stream_one_blocking(url, body,
                                                                                          time.perf_counter())
    threads1 = thread_counters(pid) if pid is not None else {}
    cpu1 = sum(os.times()[:2])
    after = loop_counters(base)
    if not timing.ok or len(timing.chunk_times) < 2:
        raise RuntimeError(f"streamed request failed: {timing.error}")
    times = timing.chunk_times
    per_token = {k: 1000.0 * (after[k] - before[k]) / len(times) for k in after}
    return {"tpot_ms": 1000.0 * (times[-1] - times[0]) / (len(times) - 1), "tokens": len(times),
            "client_cpu_ms_per_token": 1000.0 * (cpu1 - cpu0) / len(times),
            **{f"{k}_ms_per_token": v for k, v in per_token.items()},
            **(sched_per_token(threads0, threads1, pid, len(times), loop=True) if pid is not None else {})}


# ---- offline -------------------------------------------------------------------------------------------


def offline_engine(args: argparse.Namespace):
    from segserve import LLMEngine
    from segserve.engine_args import EngineArgs

    return LLMEngine.from_engine_args(EngineArgs(model=args.model, dtype=args.dtype,
                                                 max_num_batched_tokens=args.budget))


def offline_request(engine, ids: list[int], n: int, rid: str) -> dict:
    from segserve import SamplingParams

    engine.add_request(rid, {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=n,
                                                                       ignore_eos=True))
    times, seen = [], 0
    step0, threads0 = engine.step_seconds, thread_counters(os.getpid())
    while engine.has_unfinished_requests():
        for out in engine.step():
            got = len(out.outputs[0].token_ids)
            times += [time.perf_counter()] * (got - seen)
            seen = got
    threads1 = thread_counters(os.getpid())
    return {"tpot_ms": 1000.0 * (times[-1] - times[0]) / (len(times) - 1), "tokens": len(times),
            "engine_step_seconds_ms_per_token": 1000.0 * (engine.step_seconds - step0) / len(times),
            **sched_per_token(threads0, threads1, os.getpid(), len(times), loop=False)}


_BURNER = """
import sys, time
period, burn = float(sys.argv[1]) / 1000, float(sys.argv[2]) / 1000
t = time.perf_counter()
while True:
    t += period
    time.sleep(max(0.0, t - time.perf_counter()))
    end = time.perf_counter() + burn
    while time.perf_counter() < end:
        pass
"""


def burned_request(engine, ids: list[int], n: int, rid: str, burn: tuple[float, float]) -> dict:
    """:func:`offline_request` beside a burner process (``burn`` = (period, ms)); adds the burner's CPU
    ms per token."""
    proc = subprocess.Popen([sys.executable, "-c", _BURNER, str(burn[0]), str(burn[1])])
    try:
        time.sleep(0.2)  # the interpreter's start-up is not part of the burn
        cpu0 = sum(c[0] for c in thread_counters(proc.pid).values())
        res = offline_request(engine, ids, n, rid)
        cpu1 = sum(c[0] for c in thread_counters(proc.pid).values())
    finally:
        proc.kill()
        proc.wait()
    return res | {"burner_cpu_ms_per_token": (cpu1 - cpu0) / 1e6 / res["tokens"]}


# ---- the run ---------------------------------------------------------------------------------------------


def summarize(rows: dict[str, list[dict]]) -> dict[str, dict]:
    out = {}
    for name, runs in rows.items():
        tpots = [r["tpot_ms"] for r in runs]
        out[name] = {"median_tpot_ms": statistics.median(tpots), "min_tpot_ms": min(tpots)}
        for key in runs[0]:
            if key.endswith("_per_token"):
                out[name]["median_" + key] = statistics.median(r[key] for r in runs)
    base = out.get("offline")
    if base:
        for v in out.values():
            v["median_vs_offline"] = v["median_tpot_ms"] / base["median_tpot_ms"]
            v["min_vs_offline"] = v["min_tpot_ms"] / base["min_tpot_ms"]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    servers = {}
    try:
        for k, spec in enumerate(args.server):
            full, flags = spec.split("=", 1)
            name = full.split("@", 1)[0]
            port = 8600 + k + (os.getpid() % 200) * 4
            started = start_server(full, flags, port, args, args.out.parent)
            servers[name] = (*started, f"http://127.0.0.1:{port}")
        for _, (proc, _, _, base) in servers.items():
            wait_ready(proc, base)
        engine = None if args.no_offline else offline_engine(args)
        clients = args.clients.split(",")
        variants = [f"{s}/{c}" if len(clients) > 1 else s for s in servers for c in clients]
        variants += [] if engine is None else ["offline"] + (["offline_burn"] if args.burn else [])
        where = {v: (v.split("/")[0], v.split("/")[1] if "/" in v else clients[0]) for v in variants}
        rows: dict[str, list[dict]] = {v: [] for v in variants}
        warm = prompt_ids(args.seed + 99, args.prompt_len)
        for v in variants:  # one untimed request each: first-call costs in no figure
            if v.startswith("offline"):
                offline_request(engine, warm, 4, f"warm-{v}")
            else:
                server_request(servers[where[v][0]][3], warm, 4, where[v][1])
        loads = [os.getloadavg()[0]]
        for r in range(args.rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            for v in order:
                ids = prompt_ids(args.seed + 1000 * r + variants.index(v), args.prompt_len)
                if v == "offline":
                    res = offline_request(engine, ids, args.output_len, f"r{r}")
                elif v == "offline_burn":
                    res = burned_request(engine, ids, args.output_len, f"b{r}", args.burn)
                else:
                    proc, base = servers[where[v][0]][0], servers[where[v][0]][3]
                    res = server_request(base, ids, args.output_len, where[v][1], proc.pid)
                rows[v].append(res)
            loads.append(os.getloadavg()[0])
            print(f"round {r}: " + ", ".join(f"{v} {rows[v][-1]['tpot_ms']:.1f}" for v in variants)
                  + f" ms (load {loads[-1]:.2f})", flush=True)
        summary = summarize(rows)
        for v, s in summary.items():
            extra = "".join(f", {k.removeprefix('median_').removesuffix('_per_token')} {x:.2f}"
                            for k, x in s.items() if k.endswith("_per_token"))
            ratio = f" = {s['median_vs_offline']:.3f}x offline (min {s['min_vs_offline']:.3f}x)" \
                if "median_vs_offline" in s else ""
            print(f"{v}: TPOT median {s['median_tpot_ms']:.2f} ms, min {s['min_tpot_ms']:.2f}{ratio}"
                  f" [ms/token{extra}]")
        args.out.write_text(json.dumps({"args": {k: str(x) for k, x in vars(args).items()},
                                        "servers": {v: s[2] for v, s in servers.items()},
                                        "loads": loads, "rows": rows, "summary": summary}, indent=1) + "\n")
    finally:
        for proc, log, _, _ in servers.values():
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
