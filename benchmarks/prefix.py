"""Prefix: time to first token of a request whose long prefix is in the prefix cache, vs cold.

Each repeat: a request with prefix A fills the cache; then a request with a never-seen prefix B
(cold) and a request with prefix A and a new suffix (warm) are timed, one at a time on an idle
engine. Figure: median warm TTFT over median cold TTFT (goal <= 0.1).

    .venv/bin/python benchmarks/prefix.py           # 3,000-token prefix, 64-token suffix, 3 repeats
"""

from __future__ import annotations

import statistics
import sys

from segserve.bench import experiment as ex


def measure(loaded, args) -> dict:
    from segserve import LLMEngine

    total = args.prefix_len + args.suffix_len
    blocks = 3 * -(-total // 16) * args.repeats + 8
    engine = LLMEngine(
        model=loaded, max_num_batched_tokens=args.budget, block_size=16, num_kv_blocks=blocks,
        seed=args.seed,
    )
    vocab = loaded.config.vocab_size
    st = ex.Stepper(engine)
    cold, warm, cached = [], [], []
    for rep in range(args.repeats):
        seed = args.seed + 10 * rep
        prefix_a, prefix_b = (ex.random_ids(args.prefix_len, vocab, seed + k) for k in (1, 2))
        suffix_1, suffix_2 = (ex.random_ids(args.suffix_len, vocab, seed + k) for k in (3, 4))
        for rid, ids in ((f"fill{rep}", prefix_a + suffix_1), (f"cold{rep}", prefix_b + suffix_2),
                         (f"warm{rep}", prefix_a + suffix_2)):
            st.add(rid, ids, 1)
            st.run()
        cold.append(st.timeline.ttft(f"cold{rep}"))
        warm.append(st.timeline.ttft(f"warm{rep}"))
        cached.append(st.timeline.cached[f"warm{rep}"])
    return {"cold_ttft_s": cold, "warm_ttft_s": warm, "warm_cached_tokens": cached,
            "cold_cached_tokens": [st.timeline.cached[f"cold{r}"] for r in range(args.repeats)]}


def plot(res: dict, path: str) -> None:
    fig, ax = ex.new_figure()
    n = len(res["cold_ttft_s"])
    xs = range(n)
    ax.bar([x - 0.2 for x in xs], res["cold_ttft_s"], width=0.4, label="cold (prefix computed)")
    ax.bar([x + 0.2 for x in xs], res["warm_ttft_s"], width=0.4, label="warm (prefix cached)")
    ax.set_yscale("log")
    ax.set_xticks(list(xs), [f"repeat {i + 1}" for i in xs])
    ax.set_ylabel("time to first token, s")
    ax.set_title("TTFT with the prefix in the cache vs cold")
    ax.legend()
    ex.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = ex.common_args(__doc__.splitlines()[0], "prefix")
    p.add_argument("--prefix-len", type=int, default=3000)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    res = measure(ex.load(args), args)
    cold, warm = statistics.median(res["cold_ttft_s"]), statistics.median(res["warm_ttft_s"])
    ratio = warm / cold
    plot(res, args.png)
    line = (
        f"prefix: TTFT with a {args.prefix_len}-token cached prefix + {args.suffix_len} new tokens "
        f"{warm * 1000:,.0f} ms vs cold {cold * 1000:,.0f} ms (median of {args.repeats}) = {ratio:.3f} "
        f"(goal <= 0.1); cached tokens {res['warm_cached_tokens'][0]}; load {ex.load_1min():.2f}"
    )
    record = {"settings": vars(args), "results": res, "ratios": {"warm_over_cold_ttft": ratio},
              "goal": {"warm_over_cold_ttft": 0.1}}
    ex.finish(args, "prefix", record, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
