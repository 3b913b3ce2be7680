"""Structured: output tok/s of concurrent JSON-schema requests vs the same requests unconstrained, and
the first-token delay grammar compilation adds, cold and cached.

Throughput: ``--concurrency`` chat requests (greedy) constrained by one JSON schema run together;
then the same prompts run unconstrained with ``ignore_eos`` and ``max_tokens`` set to the count each
constrained request generated, so both sides generate the same tokens; rounds alternate, the
schema's grammar compiled before the first (its compilation is the second figure). Figure: median
constrained tok/s over median unconstrained tok/s (goal >= 0.9). Delay: one request at a time on
an idle engine, TTFT with a never-seen schema (cold: compiled while the request waits) and with the
same schema again (cached), each minus the TTFT of the same prompt unconstrained. Prefix caching is
off so every request computes its whole prompt.

    .venv/bin/python benchmarks/structured.py      # 16 requests, up to 96 tokens, 2 rounds, 3 delay repeats
"""

from __future__ import annotations

import statistics
import sys
import time

from segserve.bench import experiment as ex

PEOPLE = ["Alice", "Bob", "Chen", "Dana", "Emeka", "Farah", "Goran", "Hana"]
CITIES = ["Paris", "Lagos", "Osaka", "Lima"]


def schema(tag: str = "") -> dict:
    """The benchmark's schema; a distinct ``tag`` gives a never-seen schema (a cache miss)."""
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "city": {"type": "string", "maxLength": 24},
            "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
            f"member{tag}": {"type": "boolean"},
        },
        "required": ["name", "age", "city", "hobbies", f"member{tag}"],
    }


def prompt(i: int) -> list[dict]:
    person, city = PEOPLE[i % len(PEOPLE)], CITIES[i % len(CITIES)]
    text = f"{person} is {20 + 3 * i} years old, lives in {city} and likes chess and hiking. Reply in JSON."
    return [{"role": "user", "content": text}]


def _run(engine, requests: list[tuple[str, list[int], object]]) -> tuple[dict, dict, float]:
    """Add every request at once, step until all finish: (token ids by id, TTFT s by id, wall s)."""
    t0 = time.perf_counter()
    for rid, ids, params in requests:
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
    tokens, ttft = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].token_ids and out.request_id not in ttft:
                ttft[out.request_id] = time.perf_counter() - t0
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return tokens, ttft, time.perf_counter() - t0


def measure(loaded, args) -> dict:
    from segserve import LLMEngine, SamplingParams, StructuredOutputsParams
    from segserve.engine.llm import chat_prompt_ids

    engine = LLMEngine(model=loaded, max_num_batched_tokens=args.budget, enable_prefix_caching=False,
                       max_num_seqs=max(16, args.concurrency), seed=args.seed)
    prompts = [chat_prompt_ids(engine, prompt(i)) for i in range(args.concurrency)]
    so = StructuredOutputsParams(json=schema())
    t0 = time.perf_counter()
    engine.grammar_gate.manager.submit(so).result()
    first_compile_s = time.perf_counter() - t0
    constrained = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured_outputs=so)
    rounds = []
    for r in range(args.rounds):
        reqs = [(f"c{r}-{i}", ids, constrained) for i, ids in enumerate(prompts)]
        tokens, _, wall_c = _run(engine, reqs)
        counts = [len(tokens[f"c{r}-{i}"]) for i in range(len(prompts))]
        free = [(f"u{r}-{i}", ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
                for i, (ids, n) in enumerate(zip(prompts, counts, strict=True))]
        free_tokens, _, wall_u = _run(engine, free)
        assert [len(free_tokens[f"u{r}-{i}"]) for i in range(len(prompts))] == counts
        rounds.append({"tokens": sum(counts), "constrained_s": wall_c, "unconstrained_s": wall_u,
                       "constrained_tok_s": sum(counts) / wall_c, "unconstrained_tok_s": sum(counts) / wall_u,
                       "counts": counts})
    delays = {"cold_s": [], "cached_s": [], "plain_ttft_s": []}
    one = prompts[0]
    for rep in range(args.delay_repeats):
        fresh = StructuredOutputsParams(json=schema(f"_{args.seed}_{rep}_{time.time_ns()}"))
        _, plain, _ = _run(engine, [(f"p{rep}", one, SamplingParams(temperature=0.0, max_tokens=1))])
        for key, rid in (("cold_s", f"cold{rep}"), ("cached_s", f"cached{rep}")):
            _, ttft, _ = _run(engine, [(rid, one, SamplingParams(temperature=0.0, max_tokens=1,
                                                                  structured_outputs=fresh))])
            delays[key].append(ttft[rid] - plain[f"p{rep}"])
        delays["plain_ttft_s"].append(plain[f"p{rep}"])
    engine.check_integrity()
    return {"rounds": rounds, "delays": delays, "first_compile_s": first_compile_s}


def plot(res: dict, path: str) -> None:
    fig, (ax1, ax2) = ex.new_figure(ncols=2, width=4.8)
    xs = range(len(res["rounds"]))
    ax1.bar([x - 0.2 for x in xs], [r["unconstrained_tok_s"] for r in res["rounds"]], width=0.4,
            label="unconstrained")
    ax1.bar([x + 0.2 for x in xs], [r["constrained_tok_s"] for r in res["rounds"]], width=0.4,
            label="JSON schema")
    ax1.set_xticks(list(xs), [f"round {i + 1}" for i in xs])
    ax1.set_ylabel("output tokens/s")
    ax1.legend()
    d = res["delays"]
    medians_ms = [statistics.median(d["cold_s"]) * 1000, statistics.median(d["cached_s"]) * 1000]
    ax2.bar(["cold", "cached"], medians_ms)
    ax2.set_ylabel("added first-token delay, ms (median)")
    ex.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = ex.common_args(__doc__.splitlines()[0], "structured")
    p.add_argument("--concurrency", type=int, default=16, help="requests run together")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--delay-repeats", type=int, default=3)
    args = p.parse_args(argv)
    for name in ("concurrency", "max_tokens", "rounds", "delay_repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    load_before = ex.load_1min()
    res = measure(ex.load(args), args)
    rounds, d = res["rounds"], res["delays"]
    with_grammar = statistics.median(r["constrained_tok_s"] for r in rounds)
    without = statistics.median(r["unconstrained_tok_s"] for r in rounds)
    ratio = with_grammar / without
    cold, cached = statistics.median(d["cold_s"]), statistics.median(d["cached_s"])
    plot(res, args.png)
    line = (
        f"structured: {args.concurrency} JSON-schema requests {with_grammar:.1f} tok/s vs unconstrained "
        f"{without:.1f} = {ratio:.3f}"
        f" (goal >= 0.9; {rounds[0]['tokens']} tokens a round, median of {len(rounds)}); added TTFT cold "
        f"{cold * 1000:,.0f} ms, cached {cached * 1000:,.0f} ms (median of {len(d['cold_s'])}); "
        f"load {load_before:.2f} -> {ex.load_1min():.2f}"
    )
    record = {"settings": vars(args), "results": res, "load_1min_before": load_before,
              "ratios": {"constrained_over_unconstrained_tok_s": ratio},
              "delays_ms": {"cold": cold * 1000, "cached": cached * 1000},
              "goal": {"constrained_over_unconstrained_tok_s": 0.9}}
    ex.finish(args, "structured", record, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
