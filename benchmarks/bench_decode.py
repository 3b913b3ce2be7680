"""P4: batch-1 (or batch-B) decode speed of segserve against ``transformers`` in the same process.

One request of ``--prompt-len`` tokens decodes ``--tokens`` tokens greedily (``ignore_eos``); a decode
step's time is one ``LLMEngine.step()`` after the prefill step, so it includes the whole engine path
(scheduler, runner inputs, model, LM head, sampler, detokenizer). ``transformers`` runs ``generate``
with the same prompt: its per-token decode time is ``(t(N tokens) - t(1 token)) / (N - 1)``.
Variants alternate rep by rep (interleaved), so machine load hits all alike; medians are reported.

Limits (issue 5): the bandwidth limit is batch x memory bandwidth over weight bytes, with the bandwidth
measured in this run (one large tensor copy, read + write bytes) and the nominal 30 GB/s of
/work/shared/baselines.md both reported. ``--no-prepack`` variants show what the oneDNN weight
packing (``segserve.models.packed_linear``) is worth.

Prints one summary line; writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

NOMINAL_BANDWIDTH_GBS = 30.0


def measure_bandwidth_gbs(mib: int = 256, reps: int = 5) -> float:
    """Best of ``reps`` copies of a ``mib`` MiB float32 tensor: (read + write bytes) / seconds / 1e9."""
    src = torch.ones(mib * 2**18)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best / 1e9


def segserve_decode_ms(
    loaded, dtype: str, prompt: list[int], tokens: int, batch: int, prepack: bool, kernels: bool = True
) -> float:
    """Median wall ms of one engine step while ``batch`` requests decode (prefill steps excluded);
    ``kernels=False`` runs with the compiled CPU kernels switched off (the eager PyTorch path)."""
    from segserve.kernels import cpu as cpu_kernels

    old = cpu_kernels.set_enabled(kernels)
    try:
        return _decode_ms(loaded, dtype, prompt, tokens, batch, prepack)
    finally:
        cpu_kernels.set_enabled(old)


def _decode_ms(loaded, dtype: str, prompt: list[int], tokens: int, batch: int, prepack: bool) -> float:
    from segserve.engine.llm_engine import LLMEngine
    from segserve.sampling_params import SamplingParams

    engine = LLMEngine(model=loaded, dtype=dtype, max_num_seqs=max(batch, 1))
    if not prepack:
        engine.runner.cpu_step.unpack()
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for b in range(batch):
        engine.add_request(f"r{b}", [prompt[0] + b, *prompt[1:]], params)
    times = []
    while engine.has_unfinished_requests():
        sched = engine.scheduler
        prefilling = bool(sched.waiting) or any(r.is_prefill for r in sched.running)
        start = time.perf_counter()
        engine.step()
        if not prefilling:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def hf_decode_ms(model, prompt: list[int], tokens: int, batch: int) -> float:
    """``transformers`` ms per decode step: ``(t(tokens) - t(1)) / (tokens - 1)``."""
    ids = torch.tensor([[prompt[0] + b, *prompt[1:]] for b in range(batch)])

    def run(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - start

    return (run(tokens) - run(1)) / (tokens - 1) * 1e3


def load_hf(dtype: torch.dtype):
    """``transformers``' model from the same GGUF, in ``dtype``."""
    from segserve.bench.throughput import load_hf_model

    model = load_hf_model(None, str(dtype).removeprefix("torch."))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--prompt-len", type=int, default=256, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=32, help="decode tokens per repetition")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions (median)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--baseline", choices=("hf", "none"), default="hf")
    parser.add_argument("--ablate-prepack", action="store_true", help="also run without weight packing")
    parser.add_argument(
        "--ablate-kernels", action="store_true", help="also run with the compiled CPU kernels switched off"
    )
    parser.add_argument("--out", default="results/bench_decode.json")
    args = parser.parse_args()
    for name in ("prompt_len", "tokens", "batch", "reps", "threads"):
        if getattr(args, name) < (2 if name == "tokens" else 1):
            parser.error(f"--{name.replace('_', '-')} must be >= {2 if name == 'tokens' else 1}")
    return args


def main() -> None:
    from segserve.models.loader import load_model

    args = parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    loaded = load_model(None, dtype=dtype)
    hf = load_hf(dtype) if args.baseline == "hf" else None
    prompt = [100 + (i * 7919) % 40000 for i in range(args.prompt_len)]
    def ours(prepack: bool, kernels: bool = True):
        return lambda: segserve_decode_ms(
            loaded, args.dtype, prompt, args.tokens, args.batch, prepack, kernels
        )

    variants = {"segserve": ours(True)}
    if args.ablate_kernels:
        variants["segserve_no_kernels"] = ours(True, kernels=False)
    if args.ablate_prepack:
        variants["segserve_no_prepack"] = ours(False, kernels=False)
    if hf is not None:
        variants["hf"] = lambda: hf_decode_ms(hf, prompt, args.tokens, args.batch)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    load_before = os.getloadavg()[0]
    bandwidth = measure_bandwidth_gbs()
    for _ in range(args.reps):
        for name, fn in variants.items():
            samples[name].append(fn())
    ms = {name: statistics.median(v) for name, v in samples.items()}
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    # A step streams every weight once whatever the batch, so the limit scales with the batch
    # (until compute binds, at ~12-14 sequences here: baselines.md).
    limit_tok_s = {
        "measured": args.batch * bandwidth * 1e9 / weight_bytes,
        "nominal": args.batch * NOMINAL_BANDWIDTH_GBS * 1e9 / weight_bytes,
    }
    tok_s = {name: args.batch * 1e3 / v for name, v in ms.items()}
    result = {
        "dtype": args.dtype, "batch": args.batch, "prompt_len": args.prompt_len, "tokens": args.tokens,
        "threads": args.threads, "ms_per_step": ms, "samples_ms": samples, "tok_s": tok_s,
        "weight_bytes": weight_bytes, "bandwidth_gbs_measured": bandwidth, "limit_tok_s": limit_tok_s,
        "fraction_of_limit": {k: tok_s["segserve"] / v for k, v in limit_tok_s.items()},
        "speedup_vs_hf": ms["hf"] / ms["segserve"] if "hf" in ms else None,
        "loadavg": [load_before, os.getloadavg()[0]], "machine": platform.processor() or platform.machine(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    parts = [f"{k} {v:.1f} ms ({tok_s[k]:.1f} tok/s)" for k, v in ms.items()]
    print(
        f"decode {args.dtype} batch {args.batch}: " + ", ".join(parts)
        + (f"; {result['speedup_vs_hf']:.2f}x hf" if hf is not None else "")
        + f"; {100 * result['fraction_of_limit']['measured']:.0f}% of bandwidth limit "
        f"({limit_tok_s['measured']:.0f} tok/s at {bandwidth:.0f} GB/s measured; "
        f"{100 * result['fraction_of_limit']['nominal']:.0f}% of {limit_tok_s['nominal']:.0f} at nominal "
        f"{NOMINAL_BANDWIDTH_GBS:.0f}); load {load_before:.1f}; -> {args.out}"
    )


if __name__ == "__main__":
    main()
