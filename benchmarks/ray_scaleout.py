"""Scale-out on Ray Serve: prefix_affinity vs round_robin on 2 replicas x 1 CPU, and 1 x 2 vs 2 x 1,
each beside the simulator's prediction for the same requests (same token ids, same rule, same knobs).

Workload: ``--groups`` groups of ``--per-group`` requests in a fixed random order, Poisson arrivals at
``--rate`` req/s; a request is its group's ``--prefix-blocks`` x 512-token prefix (hash blocks, the
simulator's unit) plus a 64-token suffix of its own, ``--output-len`` tokens out (ignore_eos). Each
replica's KV pool (``--kv-blocks``) holds only some of the groups' prefixes (checked at start), so
where a group lands decides its hit rate. Every setting runs on one local Ray cluster (2 CPUs), each
replica warmed up by one request of its own first (its hits and queries are subtracted).

Reported per setting: cluster prefix-cache hit rate (cached / prompt tokens, from each response's
usage, cross-checked against the replicas' ``vllm:prefix_cache_*`` counters), TTFT p50/p99 (client
side, streamed), and the same three from the simulator, plus how many requests the simulator routed
to the same replica as the deployment did and got the same cached tokens for (replicas matched by
order of first use). The simulator's step model per setting is this machine's cached profile for that
thread count (``OMP_NUM_THREADS=K segserve profile --quick``) when there is one, else the built-in
2-thread one (said in the output), or ``--profile`` for all.

    .venv/bin/python benchmarks/ray_scaleout.py            # ~8 minutes; say the load (uptime) with it

Prints one line, writes ``results/ray_scaleout.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import threading
import time
from pathlib import Path

SUFFIX = 64
HASH_BLOCK = 512  # tokens per hash block (segserve.simulator.workload.HASH_BLOCK_TOKENS)
SETTINGS = (("prefix_affinity", 2, 1), ("round_robin", 2, 1), ("prefix_affinity", 1, 2))
CLUSTER_CPUS = 2


def workload(args) -> list:
    """The trace, in arrival order (hash ids: the group's prefix blocks, then one of its own)."""
    from segserve.simulator.workload import TraceRequest

    rng = random.Random(args.seed)
    order = [g for g in range(args.groups) for _ in range(args.per_group)]
    rng.shuffle(order)
    reqs, t = [], 0.0
    for k, g in enumerate(order):
        t += rng.expovariate(args.rate)
        prefix = tuple(1000 * g + b for b in range(args.prefix_blocks))
        reqs.append(TraceRequest(t, args.prefix_blocks * HASH_BLOCK + SUFFIX, args.output_len,
                                 prefix + (10**6 + k,)))
    return reqs


def check_sizes(args, block_size: int = 16) -> None:
    """SystemExit unless one replica's pool holds at least one group's request but not every prefix."""
    prefix_blocks = args.prefix_blocks * HASH_BLOCK // block_size
    request_blocks = -(-(args.prefix_blocks * HASH_BLOCK + SUFFIX + args.output_len) // block_size)
    usable = args.kv_blocks - 1  # block 0 is the null block
    if usable < request_blocks:
        raise SystemExit(f"--kv-blocks {args.kv_blocks}: one request needs {request_blocks} blocks + null")
    if usable >= args.groups * prefix_blocks:
        raise SystemExit(f"--kv-blocks {args.kv_blocks}: all {args.groups} prefixes ({args.groups} x "
                         f"{prefix_blocks} blocks) fit one replica; the workload would not test routing")


def engine_args(args, model: str | None):
    from segserve.engine_args import EngineArgs

    return EngineArgs(model=model, block_size=16, num_kv_blocks=args.kv_blocks, max_model_len=2048,
                      max_num_batched_tokens=args.budget, max_num_seqs=16)


def step_model(args, threads: int):
    """(step model, where it came from) for replicas of ``threads`` threads."""
    from segserve.simulator.calibration import choose_profile, machine_fingerprint

    fp = None if args.profile else dataclasses.replace(machine_fingerprint(args.model), threads=threads)
    choice = choose_profile(fp, given=args.profile)
    return choice.model, choice.line


def simulate(args, reqs, router: str, replicas: int, threads: int) -> dict:
    from segserve.simulator.cluster import simulate as sim

    model, source = step_model(args, threads)
    cfg = engine_args(args, None).create_engine_config(2048)
    res = sim(reqs, cfg, args.kv_blocks, model, replicas, router,
              imbalanced_threshold=args.imbalanced_threshold, match_rate_threshold=args.match_rate_threshold)
    per = [{"ttft_s": r.token_times[0] - r.arrival if r.token_times else None, "replica": r.replica,
            "cached_tokens": r.num_cached_tokens, "prompt_tokens": r.input_len} for r in res.requests]
    return {**summarize(per), "counter_hit_rate": res.prefix_hit_rate, "profile": source, "requests": per}


def summarize(per: list[dict]) -> dict:
    """Hit rate (cached / prompt tokens) and TTFT p50/p99 of per-request rows."""
    from segserve.simulator.metrics import percentile

    ttfts = [r["ttft_s"] for r in per if r["ttft_s"] is not None]
    prompt = sum(r["prompt_tokens"] for r in per)
    return {"hit_rate": sum(r["cached_tokens"] for r in per) / prompt if prompt else 0.0,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99)}


def agreement(real: list[dict], sim: list[dict]) -> dict:
    """Requests (trace order) that real and simulated runs sent to the same replica, replicas of each
    named by order of first use, and that got the same cached tokens."""
    def canonical(rows):
        names: dict = {}
        return [names.setdefault(r["replica"], len(names)) for r in rows]

    same = [a == b for a, b in zip(canonical(real), canonical(sim), strict=True)]
    cached = [a["cached_tokens"] == b["cached_tokens"] for a, b in zip(real, sim, strict=True)]
    first = next((i for i, s in enumerate(same) if not s), None)
    return {"same_replica": sum(same), "same_cached_tokens": sum(cached), "of": len(same),
            "first_routing_difference": first}


async def _send(base: str, reqs, prompts) -> list[dict]:
    import httpx

    async def one(client, req, ids) -> dict:
        await asyncio.sleep(max(0.0, req.arrival - (time.monotonic() - t0)))
        body = {"model": "m", "prompt": ids, "max_tokens": req.output_len, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        sent, ttft, usage = time.monotonic(), None, None
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            replica = r.headers["x-segserve-replica"]
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if ttft is None and event.get("choices"):
                    ttft = time.monotonic() - sent
                usage = event.get("usage") or usage
        if ttft is None or usage is None:
            raise RuntimeError(f"no token or no usage for a request to {replica}")
        return {"ttft_s": ttft, "replica": replica, "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}

    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        return list(await asyncio.gather(*(one(client, q, p) for q, p in zip(reqs, prompts, strict=True))))


def counters(base: str) -> dict[str, float]:
    """Cluster totals of the prefix-cache counters, summed over the replicas' series on /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    sums = {"vllm:prefix_cache_hits_total": 0.0, "vllm:prefix_cache_queries_total": 0.0}
    for f in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=60).text):
        for s in f.samples:
            if s.name in sums:
                sums[s.name] += s.value
    return sums


def warm_up(base: str, replicas: int, vocab: int, seed: int) -> None:
    """One request of its own per replica (the first steps of an engine pay one-time costs); the
    routers send sequential unmatched requests to each replica in turn."""
    rng, seen = random.Random(seed), set()
    for _ in range(4 * replicas):
        prompt = [rng.randrange(vocab) for _ in range(HASH_BLOCK + SUFFIX)]
        seen.add(asyncio.run(_send(base, [_Now()], [prompt]))[0]["replica"])
        if len(seen) == replicas:
            return
    raise RuntimeError(f"warm-up reached {len(seen)} of {replicas} replicas")


@dataclasses.dataclass
class _Now:
    arrival: float = 0.0
    output_len: int = 4


def measure(args, reqs, prompts, router: str, replicas: int, cpus: int, vocab: int, index: int) -> dict:
    import ray
    import uvicorn
    from ray import serve

    from segserve.entrypoints.openai.api_server import bind_socket
    from segserve.entrypoints.ray_serve import launch
    from segserve.entrypoints.ray_serve.ingress import Ingress
    from segserve.entrypoints.ray_serve.settings import ScaleOut

    scale = ScaleOut(replicas, cpus, router, args.imbalanced_threshold, args.match_rate_threshold, None,
                     CLUSTER_CPUS)
    spec = launch.ReplicaSpec(engine_args(args, args.model), ["m"], 256, 10.0, "given", 16)
    app_name = f"bench-{index}"  # one request router per deployment and process: a new app each
    t0 = time.monotonic()
    handle, board = launch.deploy(scale, spec, app_name)
    deploy_s = time.monotonic() - t0
    app = Ingress(handle, lambda: launch.replica_counts(replicas, app_name), board).app()
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        warm_up(base, replicas, vocab, args.seed + 1 + index)
        time.sleep(2.5)  # replicas push metrics every second
        before, t1 = counters(base), time.monotonic()
        per = asyncio.run(_send(base, reqs, prompts))
        load_s = time.monotonic() - t1
        time.sleep(2.5)
        after = counters(base)
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
        serve.delete(app_name)
        ray.kill(board)
    q = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    return {**summarize(per), "counter_hit_rate": hits / q if q else 0.0, "deploy_s": deploy_s,
            "load_s": load_s, "requests": per}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=5)
    ap.add_argument("--prefix-blocks", type=int, default=1, help="512-token blocks of each group's prefix")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--rate", type=float, default=0.6, help="Poisson arrivals, requests/s")
    ap.add_argument("--kv-blocks", type=int, default=1 + 5 * 32,
                    help="per replica, 16 tokens each (default: room for 5 of the 8 prefixes)")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--imbalanced-threshold", type=float, default=16)
    ap.add_argument("--match-rate-threshold", type=float, default=0.1)
    ap.add_argument("--profile", default=None, help="step-time profile JSON for every simulated setting")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def summary_line(rows: list[dict], load: float) -> str:
    aff, rr, single = rows
    r, s = (lambda k: [x["real"][k] for x in rows]), (lambda k: [x["simulated"][k] for x in rows])
    agree = [x["agreement"] for x in rows]
    return (
        f"ray_scaleout: 2x1 prefix_affinity / round_robin / 1x2: hit rate "
        f"{'/'.join(f'{v:.2f}' for v in r('hit_rate'))} (sim {'/'.join(f'{v:.2f}' for v in s('hit_rate'))}), "
        f"TTFT p50 {'/'.join(f'{v:.2f}' for v in r('ttft_p50_s'))} s "
        f"(sim {'/'.join(f'{v:.2f}' for v in s('ttft_p50_s'))}), "
        f"p99 {'/'.join(f'{v:.2f}' for v in r('ttft_p99_s'))} s "
        f"(sim {'/'.join(f'{v:.2f}' for v in s('ttft_p99_s'))}); "
        f"routed as simulated {'/'.join(str(a['same_replica']) for a in agree)} of {agree[0]['of']}; "
        f"affinity/rr TTFT p50 {rr['real']['ttft_p50_s'] / aff['real']['ttft_p50_s']:.2f}x, "
        f"1x2/2x1 {single['real']['ttft_p50_s'] / aff['real']['ttft_p50_s']:.2f}x; load {load:.1f}"
    )


def main() -> None:
    args = parse_args()
    check_sizes(args)
    from segserve.entrypoints.ray_serve import launch
    from segserve.entrypoints.ray_serve.settings import ScaleOut
    from segserve.models.loader import load_model
    from segserve.simulator.workload import prompt_token_ids

    vocab = load_model(args.model).config.vocab_size
    reqs = workload(args)
    prompts = [prompt_token_ids(r, i, vocab) for i, r in enumerate(reqs)]
    load0, t0 = os.getloadavg(), time.monotonic()
    started = launch.start_ray(ScaleOut(1, 1, "round_robin", 16, 0.1, None, CLUSTER_CPUS), CLUSTER_CPUS)
    rows = []
    try:
        for i, (router, replicas, cpus) in enumerate(SETTINGS):
            real = measure(args, reqs, prompts, router, replicas, cpus, vocab, i)
            sim = simulate(args, reqs, router, replicas, cpus)
            rows.append({"router": router, "replicas": replicas, "cpus_per_replica": cpus, "real": real,
                         "simulated": sim, "agreement": agreement(real["requests"], sim["requests"]),
                         "loadavg_after": os.getloadavg()})
    finally:
        launch.stop(started, None)
    line = summary_line(rows, os.getloadavg()[0])
    print(line)
    Path("results").mkdir(exist_ok=True)
    Path("results/ray_scaleout.json").write_text(json.dumps({
        "args": vars(args), "summary": line, "rows": rows, "loadavg_before": load0,
        "loadavg_after": os.getloadavg(), "wall_s": time.monotonic() - t0}, indent=1))


if __name__ == "__main__":
    main()
