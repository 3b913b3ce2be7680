"""Scale-out on Ray Serve: prefix_affinity vs round_robin on 2 replicas x 1 CPU, and 1 x 2 vs 2 x 1,
each beside the simulator's prediction for the same requests (same token ids, same rule, same knobs).

Workload: ``--groups`` groups of ``--per-group`` requests in a fixed random order, Poisson arrivals at
``--rate`` req/s; a request is its group's ``--prefix-blocks`` x 512-token prefix (hash blocks, the
simulator's unit) plus a 64-token suffix of its own, ``--output-len`` tokens out (ignore_eos). Each
replica's KV pool (``--kv-blocks``) holds only some of the groups' prefixes, so where a group lands
decides its hit rate. Reported per setting: cluster prefix-cache hit rate (tokens, from /metrics of
every replica), TTFT p50/p99 (client side, streamed), and the simulator's hit rate and TTFT p50/p99.

    .venv/bin/python benchmarks/ray_scaleout.py            # run only on an idle machine (uptime < 2)

Prints one line, writes ``results/ray_scaleout.json``. The simulator's step model is ``--profile`` or
the built-in 2-thread one: a 1-thread replica runs slower than it predicts, so compare the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import threading
import time
from pathlib import Path

SUFFIX = 64
SETTINGS = (("prefix_affinity", 2, 1), ("round_robin", 2, 1), ("prefix_affinity", 1, 2))


def workload(args) -> list:
    from segserve.simulator.workload import TraceRequest

    rng = random.Random(args.seed)
    order = [g for g in range(args.groups) for _ in range(args.per_group)]
    rng.shuffle(order)
    reqs, t = [], 0.0
    for k, g in enumerate(order):
        t += rng.expovariate(args.rate)
        prefix = tuple(1000 * g + b for b in range(args.prefix_blocks))
        reqs.append(TraceRequest(t, args.prefix_blocks * 512 + SUFFIX, args.output_len,
                                 prefix + (10**6 + k,)))
    return reqs


def engine_args(args, model: str | None):
    from segserve.engine_args import EngineArgs

    return EngineArgs(model=model, block_size=16, num_kv_blocks=args.kv_blocks, max_model_len=2048,
                      max_num_batched_tokens=args.budget, max_num_seqs=16)


def simulate(args, reqs, router: str, replicas: int) -> dict:
    from segserve.simulator.cluster import simulate as sim
    from segserve.simulator.metrics import percentile
    from segserve.simulator.step_model import DEFAULT_CPU_MODEL, load_profile

    model = load_profile(args.profile) if args.profile else DEFAULT_CPU_MODEL
    cfg = engine_args(args, None).create_engine_config(2048)
    res = sim(reqs, cfg, args.kv_blocks, model, replicas, router,
              imbalanced_threshold=args.imbalanced_threshold, match_rate_threshold=args.match_rate_threshold)
    ttfts = [r.token_times[0] - r.arrival for r in res.requests if r.token_times]
    return {"hit_rate": res.prefix_hit_rate, "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99)}


async def _send(base: str, reqs, prompts) -> list[float]:
    import httpx

    async def one(client, req, ids) -> float:
        await asyncio.sleep(req.arrival - (time.monotonic() - t0))
        body = {"model": "m", "prompt": ids, "max_tokens": req.output_len, "temperature": 0,
                "ignore_eos": True, "stream": True}
        sent = time.monotonic()
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return time.monotonic() - sent
        raise RuntimeError("no token")

    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        return list(await asyncio.gather(*(one(client, q, p) for q, p in zip(reqs, prompts, strict=True))))


def hit_rate(base: str) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    time.sleep(2.5)  # replicas push metrics every second
    sums = {"vllm:prefix_cache_hits_total": 0.0, "vllm:prefix_cache_queries_total": 0.0}
    for f in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=60).text):
        for s in f.samples:
            if s.name in sums:
                sums[s.name] += s.value
    q = sums["vllm:prefix_cache_queries_total"]
    return sums["vllm:prefix_cache_hits_total"] / q if q else 0.0


def measure(args, reqs, prompts, router: str, replicas: int, cpus: int) -> dict:
    import uvicorn

    from segserve.entrypoints.openai.api_server import bind_socket
    from segserve.entrypoints.ray_serve import launch
    from segserve.entrypoints.ray_serve.settings import ScaleOut, machine_cpus
    from segserve.simulator.metrics import percentile

    scale = ScaleOut(replicas, cpus, router, args.imbalanced_threshold, args.match_rate_threshold, None,
                     machine_cpus())
    spec = launch.ReplicaSpec(engine_args(args, args.model), ["m"], 256, 10.0, "given", 16)
    with launch.serve_replicas(scale, spec) as dep:
        sock = bind_socket("127.0.0.1", 0)
        server = uvicorn.Server(uvicorn.Config(dep.app, log_level="warning"))
        threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
        while not server.started:
            time.sleep(0.05)
        base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        ttfts = asyncio.run(_send(base, reqs, prompts))
        rate = hit_rate(base)
        server.should_exit = True
    return {"hit_rate": rate, "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=6)
    ap.add_argument("--prefix-blocks", type=int, default=2, help="512-token blocks of each group's prefix")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--rate", type=float, default=0.5, help="Poisson arrivals, requests/s")
    ap.add_argument("--kv-blocks", type=int, default=1 + 4 * 70, help="per replica (16 tokens each)")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--imbalanced-threshold", type=float, default=16)
    ap.add_argument("--match-rate-threshold", type=float, default=0.1)
    ap.add_argument("--profile", default=None, help="step-time profile JSON for the simulator")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from segserve.models.loader import load_model
    from segserve.simulator.workload import prompt_token_ids

    vocab = load_model(args.model).config.vocab_size
    reqs = workload(args)
    prompts = [prompt_token_ids(r, i, vocab) for i, r in enumerate(reqs)]
    rows = []
    for router, replicas, cpus in SETTINGS:
        real = measure(args, reqs, prompts, router, replicas, cpus)
        sim = simulate(args, reqs, router, replicas)
        rows.append({"router": router, "replicas": replicas, "cpus_per_replica": cpus, "real": real,
                     "simulated": sim})
    aff, rr, single = (r["real"] for r in rows)
    sim_aff, sim_rr = rows[0]["simulated"], rows[1]["simulated"]
    print(f"ray_scaleout: 2x1 prefix_affinity / round_robin: hit rate {aff['hit_rate']:.2f} / "
          f"{rr['hit_rate']:.2f} (sim {sim_aff['hit_rate']:.2f} / {sim_rr['hit_rate']:.2f}), "
          f"TTFT p50 {aff['ttft_p50_s']:.2f} / {rr['ttft_p50_s']:.2f} s, p99 {aff['ttft_p99_s']:.2f} / "
          f"{rr['ttft_p99_s']:.2f} s; 1x2 TTFT p50 {single['ttft_p50_s']:.2f} s; "
          f"load {os.getloadavg()[0]:.1f}")
    Path("results").mkdir(exist_ok=True)
    Path("results/ray_scaleout.json").write_text(json.dumps({"args": vars(args), "rows": rows,
                                                             "loadavg": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
