"""Offline driver of ``benchmarks/vs_vllm.py``: one engine, one dtype, several workloads, one process.

Run by ``vs_vllm.py`` (never by hand, though it works): with the vLLM virtualenv's interpreter for
``--engine vllm`` (it imports ``vllm`` only) and with segserve's interpreter for ``--engine segserve``
(it imports ``segserve`` only), so neither engine's packages touch the other's and each process has
both cores to itself. It imports nothing from this repository besides the engine, so the vLLM venv
needs no segserve.

Input (``--spec``, JSON): ``{"model": HF dir, "dtype": ..., "engine_kwargs": {...}, "warmup": ids,
"workloads": {name: {"kind": "prefill" | "batch" | "decode", ...}}}`` where every prompt is a list of
token ids. Output (``--out``, JSON): ``{name: result}``, rewritten after each workload, plus
``_engine`` (version and the configuration the engine reports). Every request is greedy with
``ignore_eos``, so both engines compute exactly the tokens asked for, unless a workload gives
``"sampling"``: ``SamplingParams`` fields both engines share (``temperature``, ``top_p``, ``top_k``,
``min_p``), still with ``ignore_eos``.

- ``prefill``: ``{"prompts": {label: [ids of each repeat]}}``: each prompt alone with ``max_tokens=1``;
  the wall time of ``generate`` is the offline time to first token; tok/s = prompt tokens / median time.
- ``batch``: ``{"sets": [[ids...], ...], "output_len": n}``: each set all at once, set after set; output
  and total tok/s of the median time (the sets hold equal token counts).
- ``decode``: ``{"sets": [batch of ids, ...], "output_len": n}``: a warm-up batch, then per repeat a
  batch with ``max_tokens=1`` and another with ``max_tokens=n``; decode tok/s = batch x (n - 1) /
  (t_n - t_1): the tokens a user receives per second after the first, end to end (scheduling,
  sampling, detokenizing included).

Prompts are never reused within a run (the prefix cache of either engine would skip their prefill).

``--lines`` keeps the engine loaded and answers requests read from stdin, one JSON line each (see
``serve_lines``): ``vs_vllm.py`` runs both engines' drivers this way side by side and alternates their
requests, so both engines' figures come from the same minutes of a shared host.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any


def make_engine(engine: str, spec: dict) -> tuple[Any, Any, dict]:
    """(LLM, SamplingParams class, description) of ``engine`` on ``spec['model']``."""
    kwargs = dict(spec.get("engine_kwargs") or {})
    if engine == "vllm":
        import vllm

        llm = vllm.LLM(model=spec["model"], dtype=spec["dtype"], **kwargs)
        cfg = llm.llm_engine.vllm_config
        sched = cfg.scheduler_config
        info = {"version": vllm.__version__, "max_num_batched_tokens": sched.max_num_batched_tokens,
                "max_num_seqs": sched.max_num_seqs, "enable_chunked_prefill": sched.enable_chunked_prefill,
                "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
                "block_size": cfg.cache_config.block_size, "kwargs": kwargs}
        return llm, vllm.SamplingParams, info
    import segserve

    llm = segserve.LLM(model=spec["model"], dtype=spec["dtype"], **kwargs)
    describe = llm.llm_engine.describe()
    return llm, segserve.SamplingParams, {"version": getattr(segserve, "__version__", None),
                                          "describe": describe, "kwargs": kwargs}


def timed(llm: Any, sp_cls: Any, prompts: list[list[int]], max_tokens: int, sampling: dict | None = None
          ) -> tuple[float, list]:
    """Seconds of one ``generate`` call over ``prompts`` (greedy unless ``sampling`` says otherwise,
    ``ignore_eos``), and its outputs."""
    params = sp_cls(**({"temperature": 0.0} | (sampling or {})), max_tokens=max_tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": list(p)} for p in prompts]
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    return time.perf_counter() - t0, outs


def output_tokens(outs: list) -> int:
    return sum(len(o.outputs[0].token_ids) for o in outs)


def run_prefill(llm: Any, sp_cls: Any, w: dict) -> dict:
    out = {}
    for label, per_repeat in w["prompts"].items():
        times = [timed(llm, sp_cls, [ids], 1)[0] for ids in per_repeat]
        t = statistics.median(times)
        n = len(per_repeat[0])
        out[label] = {"prompt_tokens": n, "seconds": times, "tok_s": n / t}
    return out


def run_batch(llm: Any, sp_cls: Any, w: dict) -> dict:
    """Each of ``sets`` generated as one batch, in turn; rates from the median time (the sets hold the
    same token counts), each set's seconds kept."""
    sets = w["sets"]
    runs = [timed(llm, sp_cls, prompts, w["output_len"], w.get("sampling")) for prompts in sets]
    seconds = statistics.median(t for t, _ in runs)
    outs = runs[0][1]
    prompt_tokens = sum(len(p) for p in sets[0])
    gen = output_tokens(outs)
    return {"requests": len(outs), "prompt_tokens": prompt_tokens, "output_tokens": gen, "seconds": seconds,
            "seconds_each": [t for t, _ in runs], "output_tok_s": gen / seconds,
            "total_tok_s": (prompt_tokens + gen) / seconds,
            "first_tokens": list(outs[0].outputs[0].token_ids[:16])}


def first_and_full(llm: Any, sp_cls: Any, one: list[list[int]], full: list[list[int]], n: int
                   ) -> tuple[float, float, list]:
    """t_1 (``one`` with ``max_tokens=1``), t_n (``full`` with ``max_tokens=n``) and the full run's
    outputs. Distinct prompts for the two, so neither hits the prefix cache and t_n - t_1 is n - 1
    decode steps."""
    t1, _ = timed(llm, sp_cls, one, 1)
    tn, outs = timed(llm, sp_cls, full, n)
    assert output_tokens(outs) == len(full) * n, "an engine stopped early despite ignore_eos"
    return t1, tn, outs


def run_decode(llm: Any, sp_cls: Any, w: dict) -> dict:
    """``sets[0]`` warms the batch shape up; then per repeat one set with ``max_tokens=1`` and
    another with ``max_tokens=n``: distinct prompts, so neither call hits the prefix cache."""
    n, sets = w["output_len"], w["sets"]
    timed(llm, sp_cls, sets[0], 2)
    firsts, fulls, rates = [], [], []
    for one, full in zip(sets[1::2], sets[2::2], strict=True):
        t1, tn, outs = first_and_full(llm, sp_cls, one, full, n)
        firsts.append(t1)
        fulls.append(tn)
        rates.append(len(full) * (n - 1) / (tn - t1))
    rate = statistics.median(rates)
    return {"batch": len(sets[0]), "output_len": n, "ttft_s": firsts, "seconds": fulls, "rates": rates,
            "decode_tok_s": rate, "tpot_ms": 1000.0 * len(sets[0]) / rate,
            "first_tokens": list(outs[0].outputs[0].token_ids[:16])}


RUNNERS = {"prefill": run_prefill, "batch": run_batch, "decode": run_decode}


def protocol_stream() -> Any:
    """The stream ``--lines`` answers on: the process's stdout as it was, while file descriptor 1 is
    pointed at stderr, so that what the engines print (vLLM logs to stdout, also from its engine-core
    process, which inherits the descriptor) cannot interleave with the answers."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


def serve_lines(llm: Any, sp_cls: Any, info: dict, out: Any) -> None:
    """``--lines``: ``{"ready": true, "engine": info}`` once loaded, then one answer per stdin line:
    ``{"workload": spec}`` (one workload of the kinds above, one repeat or several) gets that runner's
    result; ``{"one": ids, "full": ids, "output_len": n}`` (one batch-1 decode: two distinct prompts, as
    ``run_decode``'s sets) gets ``{"tpot_ms": (t_n - t_1) / (n - 1), "cached_tokens": the full run's
    prefix-cache hits}``. ``vs_vllm.py`` alternates these between the two engines' drivers, and the
    decodes with requests to segserve's server, so the figures it compares come from the same minutes
    of this shared host, not from runs minutes apart."""
    import sys

    out.write(json.dumps({"ready": True, "engine": info}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        if "workload" in req:
            w = req["workload"]
            out.write(json.dumps(RUNNERS[w["kind"]](llm, sp_cls, w)) + "\n")
            continue
        n = req["output_len"]
        t1, tn, outs = first_and_full(llm, sp_cls, [req["one"]], [req["full"]], n)
        cached = sum(getattr(o, "num_cached_tokens", 0) or 0 for o in outs)
        out.write(json.dumps({"tpot_ms": 1000.0 * (tn - t1) / (n - 1), "cached_tokens": cached}) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["vllm", "segserve"], required=True)
    p.add_argument("--spec", required=True, help="JSON file: model, dtype, engine_kwargs, workloads")
    p.add_argument("--out", help="JSON file the results go to (required without --lines)")
    p.add_argument("--lines", action="store_true", help="answer workload and batch-1 decode requests "
                   "read from stdin (serve_lines) instead of running the spec's workloads")
    args = p.parse_args(argv)
    if not args.lines and not args.out:
        p.error("--out is required without --lines")
    spec = json.loads(Path(args.spec).read_text())
    out_stream = protocol_stream() if args.lines else None
    t0 = time.perf_counter()
    llm, sp_cls, info = make_engine(args.engine, spec)
    startup_s = time.perf_counter() - t0
    timed(llm, sp_cls, [spec.get("warmup") or list(range(100, 612))], 4)  # first-call costs: in no figure
    if args.lines:
        serve_lines(llm, sp_cls, info | {"startup_s": startup_s}, out_stream)
        return 0
    results: dict[str, Any] = {"_engine": info | {"startup_s": startup_s}}
    for name, w in spec["workloads"].items():
        before = list(os.getloadavg())
        results[name] = RUNNERS[w["kind"]](llm, sp_cls, w) | {"load_before": before,
                                                             "load_after": list(os.getloadavg())}
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
        print(f"driver {args.engine} {spec['dtype']} {name}: done", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
