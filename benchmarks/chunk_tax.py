"""Chunking tax: prefill throughput of long prompts computed in chunks vs in one step.

Each prompt (``--prompt-lens``) runs alone on a fresh engine, generating one token, at a token
budget of ``--budget`` (chunked) and of the prompt length (unchunked); the two settings alternate
``--repeats`` times so that drift in machine load hits both. Figure: chunked over unchunked prefill
tokens/s, median over repeats and lengths pooled (goal >= 0.95). The tax has two parts (seed 003):
smaller GEMMs per step, and each chunk re-reading the cached KV of the chunks before it.

    .venv/bin/python benchmarks/chunk_tax.py        # 4,096-token prompts, budget 512, 2 repeats
"""

from __future__ import annotations

import statistics
import sys

from segserve.bench import experiment as ex


def prefill_rate(loaded, args, length: int, budget: int, seed: int) -> tuple[float, int]:
    """(prompt tokens per second, steps) of one ``length``-token prompt at ``budget``."""
    from segserve import LLMEngine

    engine = LLMEngine(
        model=loaded, max_num_batched_tokens=budget, block_size=16, num_kv_blocks=-(-length // 16) + 2,
        max_num_seqs=1, enable_prefix_caching=False, seed=args.seed,
    )
    st = ex.Stepper(engine)
    st.add("p", ex.random_ids(length, loaded.config.vocab_size, seed), 1)
    st.run()
    return length / st.timeline.ttft("p"), len(st.timeline.steps)


def plot(rows: list[dict], path: str) -> None:
    fig, ax = ex.new_figure()
    for setting in ("unchunked", "chunked"):
        pts = [(r["length"], r["tok_s"]) for r in rows if r["setting"] == setting]
        xs, ys = zip(*pts, strict=True)
        ax.scatter(xs, ys, label=setting, s=30)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill tokens/s")
    ax.set_title("Prefill throughput, chunked vs one step")
    ax.legend()
    ex.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = ex.common_args(__doc__.splitlines()[0], "chunk_tax")
    p.add_argument("--prompt-lens", default="4096", help="comma-separated prompt lengths, tokens")
    p.add_argument("--budget", type=int, default=512, help="chunked token budget")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.prompt_lens.split(",") if x]
    if not lengths or min(lengths) < 1 or args.repeats < 1:
        p.error(f"need lengths >= 1 and --repeats >= 1, got {args.prompt_lens!r} and {args.repeats}")
    loaded = ex.load(args)
    rows = []
    for rep in range(args.repeats):
        for length in lengths:
            order = [("chunked", args.budget), ("unchunked", length)]
            for setting, budget in order if rep % 2 else order[::-1]:
                rate, steps = prefill_rate(loaded, args, length, budget, args.seed + rep)
                rows.append({"repeat": rep, "length": length, "setting": setting, "budget": budget,
                             "tok_s": rate, "steps": steps})
    med = {
        s: statistics.median(r["tok_s"] for r in rows if r["setting"] == s) for s in ("chunked", "unchunked")
    }
    ratio = med["chunked"] / med["unchunked"]
    plot(rows, args.png)
    line = (
        f"chunk_tax: prefill of {args.prompt_lens}-token prompts at budget {args.budget} "
        f"{med['chunked']:,.0f} tok/s vs unchunked {med['unchunked']:,.0f} tok/s (median of "
        f"{args.repeats}) = {ratio:.3f} (goal >= 0.95); load {ex.load_1min():.2f}"
    )
    record = {"settings": vars(args), "rows": rows, "median_tok_s": med,
              "ratios": {"chunked_over_unchunked": ratio}, "goal": {"chunked_over_unchunked": 0.95}}
    ex.finish(args, "chunk_tax", record, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
