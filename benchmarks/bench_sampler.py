"""Sampling speed: the compiled draw (``csrc/segserve_sample.c``) against the PyTorch sampler it replaced,
per step and end to end.

``race`` is that replaced path, kept here as the baseline: the PyTorch filters (``_filtered_probs``),
then the exponential race ``argmax p / q`` with one ``q ~ Exp(1)`` per token drawn by torch's generator
(``-log`` of a vocabulary of ``uniform_``). ``pytorch`` is today's PyTorch path (the same filters and
race, the noise hashed from the row's key with numpy: CPUs without the kernels), ``compiled`` the
kernel. Part 1 times ``sample()`` on random
logits of the default model's vocabulary (49,152) at each ``--batches`` size and each setting, the
paths alternating call by call (median of ``--reps``). Part 2 (unless ``--no-e2e``): ``LLM.generate``
of ``--e2e-batch`` prompts of ``--prompt-len`` random tokens to ``--output-len`` tokens with each
setting, the engine's sampler switched between ``race`` and ``compiled`` round by round: output tokens a
second a user receives, and greedy decoding's figure for scale (sampling costs nothing when the ratio
sampled / greedy is 1).

Logprobs too: ``compute_logprobs`` (a token's logprob and rank and the top 5, what ``logprobs`` and
``prompt_logprobs`` return) through the compiled ``sg_logprobs`` against PyTorch's ``log_softmax``,
``>=`` count and ``topk`` (``logprobs_rows`` stubbed to decline), per step at each batch size and end to
end: ``--e2e-batch`` / 16 prompts of 1,024 tokens with ``prompt_logprobs=1`` and ``max_tokens=1`` (the
shape of lm-evaluation-harness's loglikelihood requests), prompt tokens a second.

Prints one summary line; writes ``--out`` (JSON with ``lscpu``'s model name and the load average).
Example: ``python benchmarks/bench_sampler.py --rounds 3``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

from segserve.kernels import cpu as cpu_kernels
from segserve.kernels import sample as sample_kernels
from segserve.sampling_params import SamplingParams
from segserve.worker import sampler

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = Path.home() / ".cache" / "segserve" / "baselines" / "smollm2-135m-instruct-q4_1-f32"
SETTINGS = {
    "t1": {"temperature": 1.0},
    "t0.7_p0.9": {"temperature": 0.7, "top_p": 0.9},
    "t0.8_k50": {"temperature": 0.8, "top_k": 50},
    "t1_minp0.05": {"temperature": 1.0, "min_p": 0.05},
}


def race_draw(logits: torch.Tensor, params: list[SamplingParams], keys: torch.Tensor) -> list[int]:
    """The replaced sampler's draw (``keys`` unused: it drew its noise from torch's generator)."""
    probs = sampler._filtered_probs(logits, params)  # (R, V)
    q = torch.empty_like(probs).uniform_().clamp_min_(torch.finfo(torch.float32).tiny).log_().neg_()
    return (probs / q).argmax(dim=-1).tolist()


def pytorch_draw(logits: torch.Tensor, params: list[SamplingParams], keys: torch.Tensor) -> list[int]:
    with cpu_kernels.disabled():
        return compiled_draw(logits, params, keys)


compiled_draw = sampler.draw
PATHS = {"race": race_draw, "pytorch": pytorch_draw, "compiled": compiled_draw}


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")


def time_steps(batches: list[int], reps: int, vocab: int) -> dict:
    """Median ms of one ``sample()`` call per (batch, setting, path), paths alternating."""
    out: dict = {}
    for n in batches:
        logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(n)) * 3.0
        for name, fields in SETTINGS.items():
            params = [SamplingParams(**fields)] * n
            times: dict[str, list[float]] = {p: [] for p in PATHS}
            for rep in range(reps + 2):
                for path, fn in PATHS.items():
                    sampler.draw = fn
                    start = time.perf_counter()
                    sampler.sample(logits, params, [None] * n, [0] * n)
                    if rep >= 2:  # two warm-up calls
                        times[path].append(1e3 * (time.perf_counter() - start))
            sampler.draw = compiled_draw
            out[f"b{n}/{name}"] = {p: statistics.median(v) for p, v in times.items()}
    return out


class pytorch_logprobs:
    """``with pytorch_logprobs():`` the compiled logprobs decline (``compute_logprobs`` takes PyTorch)."""

    def __enter__(self) -> None:
        self.saved = sample_kernels.logprobs_rows
        sample_kernels.logprobs_rows = lambda *a, **k: None

    def __exit__(self, *exc) -> None:
        sample_kernels.logprobs_rows = self.saved


def time_logprobs(batches: list[int], reps: int, vocab: int) -> dict:
    """Median ms of ``compute_logprobs`` (top 5) per batch and path, paths alternating."""
    out = {}
    for n in batches:
        logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(n)) * 3.0
        tokens = list(range(n))
        times: dict[str, list[float]] = {"pytorch": [], "compiled": []}
        for rep in range(reps + 2):
            for path in times:
                start = time.perf_counter()
                if path == "pytorch":
                    with pytorch_logprobs():
                        sampler.compute_logprobs(logits, tokens, 5)
                else:
                    sampler.compute_logprobs(logits, tokens, 5)
                if rep >= 2:
                    times[path].append(1e3 * (time.perf_counter() - start))
        out[f"b{n}"] = {p: statistics.median(v) for p, v in times.items()}
    return out


def end_to_end(args: argparse.Namespace) -> dict:
    """Output tok/s of ``LLM.generate`` per setting and sampler path, rounds alternating."""
    from segserve import LLM

    llm = LLM(str(args.model), dtype=args.dtype, max_num_seqs=args.e2e_batch)
    vocab = llm.llm_engine.loaded.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()}
               for _ in range(args.e2e_batch)]
    runs = {"greedy": [("compiled", SamplingParams(temperature=0.0, max_tokens=args.output_len,
                                                   ignore_eos=True))]}
    for name, fields in SETTINGS.items():
        sp = SamplingParams(**fields, max_tokens=args.output_len, ignore_eos=True, seed=None)
        runs[name] = [("race", sp), ("compiled", sp)]
    llm.generate(prompts, runs["greedy"][0][1], use_tqdm=False)  # warm-up: first-touch of the KV cache
    tok_s: dict[str, dict[str, list[float]]] = {k: {p: [] for p, _ in v} for k, v in runs.items()}
    for _ in range(args.rounds):
        for name, variants in runs.items():
            for path, sp in variants:
                sampler.draw = PATHS[path]
                start = time.perf_counter()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                elapsed = time.perf_counter() - start
                sampler.draw = compiled_draw
                tok_s[name][path].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
    res = {k: {p: statistics.median(v) for p, v in d.items()} for k, d in tok_s.items()}
    # Prompt logprobs: loglikelihood-shaped requests, compiled vs PyTorch logprobs, rounds alternating.
    n_lp = max(1, args.e2e_batch // 16)
    lp_prompts = [{"prompt_token_ids": torch.randint(0, vocab, (1024,), generator=gen).tolist()}
                  for _ in range(n_lp * (2 * args.rounds + 1))]
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    llm.generate(lp_prompts[:n_lp], sp, use_tqdm=False)  # warm-up
    lp_tok_s: dict[str, list[float]] = {"pytorch": [], "compiled": []}
    for r in range(args.rounds):
        for j, path in enumerate(lp_tok_s):
            batch = lp_prompts[n_lp * (1 + 2 * r + j): n_lp * (2 + 2 * r + j)]  # fresh: no prefix-cache hits
            start = time.perf_counter()
            if path == "pytorch":
                with pytorch_logprobs():
                    llm.generate(batch, sp, use_tqdm=False)
            else:
                llm.generate(batch, sp, use_tqdm=False)
            lp_tok_s[path].append(1024 * n_lp / (time.perf_counter() - start))
    res["prompt_logprobs"] = {p: statistics.median(v) for p, v in lp_tok_s.items()}
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--reps", type=int, default=15, help="part 1: calls per path and setting")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--no-e2e", action="store_true", help="skip part 2 (the engine)")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--e2e-batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="part 2: generate calls per path and setting")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "bench_sampler.json")
    args = p.parse_args(argv)
    if min(args.reps, args.rounds, args.vocab, args.e2e_batch, args.prompt_len, *args.batches) < 1:
        p.error("--batches, --reps, --rounds, --vocab, --e2e-batch and --prompt-len must be >= 1")
    if args.output_len < 2:
        p.error(f"--output-len must be >= 2, got {args.output_len}")
    if not cpu_kernels.enabled():
        p.error(f"the compiled kernels are off here: {cpu_kernels.unavailable_reason()}")
    torch.set_num_threads(os.cpu_count() or 1)
    load0 = os.getloadavg()[0]
    steps = time_steps(args.batches, args.reps, args.vocab)
    logprobs = time_logprobs(args.batches, args.reps, args.vocab)
    e2e = None if args.no_e2e else end_to_end(args)
    record = {"cpu": cpu_model(), "load_before": load0, "load_after": os.getloadavg()[0], "args": {
        k: str(v) for k, v in vars(args).items()}, "step_ms": steps, "logprobs_ms": logprobs,
        "e2e_output_tok_s": e2e}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    big = max(args.batches)
    parts = [f"b{big} {k.split('/')[1]} {v['race']:.2f} -> {v['compiled']:.2f} ms "
             f"({v['race'] / v['compiled']:.0f}x)" for k, v in steps.items() if k.startswith(f"b{big}/")]
    line = "sample() per step, race -> compiled: " + ", ".join(parts)
    lp = logprobs[f"b{big}"]
    line += (f"; compute_logprobs b{big} pytorch -> compiled {lp['pytorch']:.2f} -> {lp['compiled']:.2f} ms "
             f"({lp['pytorch'] / lp['compiled']:.0f}x)")
    if e2e:
        g = e2e["greedy"]["compiled"]
        line += (f"; generate {args.e2e_batch}x{args.output_len} tok/s (greedy {g:.0f}): " + ", ".join(
            f"{k} {v['race']:.0f} -> {v['compiled']:.0f} ({v['compiled'] / v['race']:.2f}x, "
            f"{v['compiled'] / g:.2f} of greedy)" for k, v in e2e.items()
            if k not in ("greedy", "prompt_logprobs")))
        plp = e2e["prompt_logprobs"]
        line += (f"; prompt_logprobs prompt tok/s {plp['pytorch']:.0f} -> {plp['compiled']:.0f} "
                 f"({plp['compiled'] / plp['pytorch']:.2f}x)")
    print(f"{line}; load {load0:.1f}-{record['load_after']:.1f} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
