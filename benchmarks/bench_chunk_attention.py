"""Chunk (prefill) attention: the compiled kernel (bfloat16: its AMX form, or its AVX-512 BF16 form on CPUs
without AMX; float32: its AVX-512F form: ``chunk_attention.kind(dtype)``) against the SDPA path, in one
process.

Two measurements, variants alternating rep by rep (the machine is shared and noisy), medians reported:

* ``attention``: one layer's segmented-backend call (K/V write + attention) for a late chunk of
  ``--chunk`` tokens after ``--prior`` cached ones (SmolLM2-135M's heads: 9 query, 3 KV, dim 64;
  bfloat16; blocks of 16, one request's consecutive blocks as the pool hands them out), times
  ``--layers``: the attention time of one engine step. ``sdpa`` is the same backend with only the
  chunk kernel switched off (decodes and K/V writes stay compiled). ``--dtype`` (default bfloat16)
  is the dtype of q and the cache.
* ``prefill``: the engine's whole prefill of one ``--prompt-len``-token prompt in ``--dtype`` under a
  ``--budget``-token step budget (``max_tokens=1``, greedy), and the time of its last chunk's step.

``--prior 0 --chunk 4096 --budget 4096`` makes the attention part the attention of the one-step prefill.
Prints one summary line; writes JSON to ``--out`` with the CPU model, the kernel's form and load average.
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


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    names = [ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")]
    return names[0] if names else "unknown"


def attention_case(prior: int, chunk: int, block_size: int = 16, seg: int = 512, dtype=torch.bfloat16):
    """(backend call args) for one late chunk: q/k/v of the chunk, a cache holding the prior, metadata;
    ``dtype`` for q/k/v and the cache."""
    from segserve.attention.metadata import build_attention_metadata

    gen = torch.Generator().manual_seed(0)
    hq, hkv, d = 9, 3, 64
    blocks = -(-(prior + chunk) // block_size)
    md = build_attention_metadata([chunk], [prior], [list(range(1, blocks + 1))], block_size, blocks + 1, seg)
    cache = torch.randn(2, blocks + 1, block_size, hkv, d, generator=gen).to(dtype)
    qkv = torch.randn(chunk, hq + 2 * hkv, d, generator=gen).to(dtype)  # as the model's fused output
    q, k, v = qkv.split((hq, hkv, hkv), dim=1)
    return q, k, v, cache, md, d**-0.5


def attention_ms(case, layers: int, use_kernel: bool) -> float:
    """Wall ms of ``layers`` backend calls (a fresh backend, so the first builds the step plan)."""
    from segserve.attention.segmented import SegmentedAttentionBackend
    from segserve.kernels import chunk_attention

    backend = SegmentedAttentionBackend()
    old = chunk_attention.set_enabled(use_kernel)
    try:
        start = time.perf_counter()
        for _ in range(layers):
            backend.forward(*case)
        return (time.perf_counter() - start) * 1e3
    finally:
        chunk_attention.set_enabled(old)


def prefill_s(loaded, prompt: list[int], budget: int, use_kernel: bool, dtype: str = "bfloat16"
              ) -> tuple[float, float]:
    """(seconds of the whole prefill, ms of its last step) of one request in a fresh ``dtype`` engine."""
    from segserve.engine.llm_engine import LLMEngine
    from segserve.kernels import chunk_attention
    from segserve.sampling_params import SamplingParams

    engine = LLMEngine(model=loaded, dtype=dtype, max_num_batched_tokens=budget, max_model_len=8192)
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    old = chunk_attention.set_enabled(use_kernel)
    try:
        steps = []
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        return time.perf_counter() - start, steps[-1] * 1e3
    finally:
        chunk_attention.set_enabled(old)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prior", type=int, default=3584, help="cached tokens before the measured chunk")
    parser.add_argument("--chunk", type=int, default=512, help="tokens of the measured chunk")
    parser.add_argument("--layers", type=int, default=30, help="backend calls per measured step")
    parser.add_argument("--prompt-len", type=int, default=4096, help="prompt of the prefill run (0: skip)")
    parser.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens of the prefill run")
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions (median)")
    parser.add_argument("--prefill-reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="dtype of q, the cache and the prefill's engine")
    parser.add_argument("--out", default="results/bench_chunk_attention.json")
    return parser.parse_args()


def main() -> None:
    from segserve.kernels import chunk_attention

    args = parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    if not chunk_attention.available(dtype):
        raise SystemExit(f"the chunk attention kernel is unavailable here for {args.dtype} (switched off, or "
                         f"kernels off)")
    load_before = os.getloadavg()[0]
    case = attention_case(args.prior, args.chunk, dtype=dtype)
    attention_ms(case, 2, True), attention_ms(case, 2, False)  # warm-up (build, first-touch)
    att = {"kernel": [], "sdpa": []}
    for _ in range(args.reps):
        att["kernel"].append(attention_ms(case, args.layers, True))
        att["sdpa"].append(attention_ms(case, args.layers, False))
    att_ms = {k: statistics.median(v) for k, v in att.items()}
    flops = 4 * 9 * 64 * args.chunk * (args.prior + (args.chunk + 1) / 2) * args.layers  # QK^T + PV, causal
    result = {
        "cpu": cpu_model(), "kind": chunk_attention.kind(dtype), "dtype": args.dtype, "threads": args.threads,
        "prior": args.prior, "chunk": args.chunk,
        "layers": args.layers, "attention_ms": att_ms, "attention_samples_ms": att,
        "attention_speedup": att_ms["sdpa"] / att_ms["kernel"],
        "attention_gflops": {k: flops / v / 1e6 for k, v in att_ms.items()},
    }
    summary = (
        f"chunk attention ({args.dtype}), {args.chunk} after {args.prior} x {args.layers} layers: "
        f"{result['kind']} {att_ms['kernel']:.0f} ms ({result['attention_gflops']['kernel']:.0f} GFLOP/s), "
        f"sdpa {att_ms['sdpa']:.0f} ms ({result['attention_speedup']:.2f}x)"
    )
    if args.prompt_len:
        from segserve.models.loader import load_model

        loaded = load_model(None, dtype=dtype)
        prompt = [100 + (i * 7919) % 40000 for i in range(args.prompt_len)]
        prefill_s(loaded, prompt[:600], args.budget, True, args.dtype)  # warm-up
        runs = {"kernel": [], "sdpa": []}
        for _ in range(args.prefill_reps):
            runs["kernel"].append(prefill_s(loaded, prompt, args.budget, True, args.dtype))
            runs["sdpa"].append(prefill_s(loaded, prompt, args.budget, False, args.dtype))
        total = {k: statistics.median(s for s, _ in v) for k, v in runs.items()}
        last = {k: statistics.median(ms for _, ms in v) for k, v in runs.items()}
        result.update({
            "prompt_len": args.prompt_len, "budget": args.budget, "prefill_s": total, "last_step_ms": last,
            "prefill_tok_s": {k: args.prompt_len / v for k, v in total.items()},
            "prefill_speedup": total["sdpa"] / total["kernel"], "prefill_samples": runs,
        })
        summary += (
            f"; prefill {args.prompt_len} tokens: kernel {total['kernel']:.2f} s "
            f"({args.prompt_len / total['kernel']:.0f} tok/s), sdpa {total['sdpa']:.2f} s "
            f"({args.prompt_len / total['sdpa']:.0f} tok/s, {result['prefill_speedup']:.2f}x); "
            f"last chunk step {last['kernel']:.0f} vs {last['sdpa']:.0f} ms"
        )
    result["loadavg"] = [load_before, os.getloadavg()[0]]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{summary}; {result['cpu']}, load {load_before:.1f}; -> {args.out}")


if __name__ == "__main__":
    main()
