"""Stall: does one long prefill stall every running generation?

``--num-decoding`` requests are decoding when a ``--long-prompt-len``-token prompt arrives. The
inter-token latency (ITL) of the decoding requests is measured with the prompt computed in chunks
under a ``--chunk-budget`` token budget, and unchunked (budget = prompt + decodes, so the whole
prompt runs in one step, as without chunked prefill). Figure: p99 and max ITL, chunked over
unchunked (goal <= 0.2). Both runs share the model and run in this process, one after the other.

    .venv/bin/python benchmarks/stall.py            # 8 decoding, 4,096-token prompt, budget 256
"""

from __future__ import annotations

import sys

from segserve.bench import experiment as ex


def run_one(loaded, args, budget: int) -> dict:
    """One setting: the decoding requests, warm steps, then the long prompt; returns ITL stats."""
    from segserve import LLMEngine

    n, block = args.num_decoding, 16
    chunks = -(-args.long_prompt_len // max(1, args.chunk_budget - n))
    max_tokens = args.warm_steps + chunks + 8
    need = n * (args.decode_prompt_len + max_tokens) + args.long_prompt_len + 1
    engine = LLMEngine(
        model=loaded, max_num_batched_tokens=budget, block_size=block,
        num_kv_blocks=-(-need // block) + n + 2, max_num_seqs=n + 1, seed=args.seed,
    )
    vocab = loaded.config.vocab_size
    st = ex.Stepper(engine)
    ids = [f"d{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        st.add(rid, ex.random_ids(args.decode_prompt_len, vocab, args.seed + i), max_tokens)
    st.run(until=lambda: all(st.timeline.token_times[r] for r in ids))
    for _ in range(args.warm_steps):
        st.step()
    st.add("long", ex.random_ids(args.long_prompt_len, vocab, args.seed + 1000), 1)
    st.run()
    tl = st.timeline
    arrival = tl.added["long"]
    return {
        "budget": budget, "itl": ex.latency_stats(tl.itls(ids)), "long_ttft_s": tl.ttft("long"),
        "long_prefill_steps": tl.prefill_steps_since(arrival),
        "points": [(t - arrival, gap) for r in ids for t, gap in tl.gaps(r)],
    }


def plot(results: dict, path: str) -> None:
    fig, ax = ex.new_figure()
    for label, res in results.items():
        xs, ys = zip(*res["points"], strict=True)
        ax.scatter(xs, [y * 1000 for y in ys], s=10, label=f"{label} (budget {res['budget']})")
    ax.set_yscale("log")
    ax.set_xlabel("token time, s since the long prompt arrived")
    ax.set_ylabel("inter-token latency, ms")
    ax.set_title("ITL of the decoding requests while a long prompt is prefilled")
    ax.legend()
    ex.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = ex.common_args(__doc__.splitlines()[0], "stall")
    p.add_argument("--num-decoding", type=int, default=8)
    p.add_argument("--decode-prompt-len", type=int, default=128)
    p.add_argument("--long-prompt-len", type=int, default=4096)
    p.add_argument("--chunk-budget", type=int, default=256)
    p.add_argument("--warm-steps", type=int, default=4, help="decode steps before the prompt arrives")
    args = p.parse_args(argv)
    if args.chunk_budget <= args.num_decoding:
        p.error(f"--chunk-budget ({args.chunk_budget}) must exceed --num-decoding ({args.num_decoding})")
    loaded = ex.load(args)
    results = {
        "chunked": run_one(loaded, args, args.chunk_budget),
        "unchunked": run_one(loaded, args, args.long_prompt_len + args.num_decoding),
    }
    c, u = results["chunked"]["itl"], results["unchunked"]["itl"]
    ratios = {"p99_itl": c["p99_ms"] / u["p99_ms"], "max_itl": c["max_ms"] / u["max_ms"]}
    plot(results, args.png)
    line = (
        f"stall: {args.num_decoding} decoding + a {args.long_prompt_len}-token prompt: p99 ITL chunked "
        f"(budget {args.chunk_budget}) {c['p99_ms']:,.0f} ms vs unchunked {u['p99_ms']:,.0f} ms = "
        f"{ratios['p99_itl']:.3f} (goal <= 0.2); max ITL {c['max_ms']:,.0f} vs {u['max_ms']:,.0f} ms = "
        f"{ratios['max_itl']:.3f}; long prompt TTFT {results['chunked']['long_ttft_s']:.1f} s vs "
        f"{results['unchunked']['long_ttft_s']:.1f} s; load {ex.load_1min():.2f}"
    )
    record = {"settings": vars(args), "results": results, "ratios": ratios, "goal": {"p99_itl": 0.2}}
    ex.finish(args, "stall", record, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
