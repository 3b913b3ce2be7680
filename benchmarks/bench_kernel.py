"""Kernel benchmark: one prefill chunk over a long prior through the paged cache vs contiguous SDPA.

Case P6: one request, 512 queries at positions 4096..4607 attending to 4,096 cached tokens plus
causally to themselves; 9 query heads, 3 KV heads, head_dim 64, float32; block ids shuffled. In the
same run and on the same data:

* ``segmented`` and ``reference`` backends (``forward``: writes the chunk's K/V, then attends);
* ``sdpa_4096``: ``scaled_dot_product_attention`` of the 512 queries over the 4,096 prior keys laid out
  contiguously, no mask (the target's yardstick: less work than the real thing, so a strict baseline);
* ``sdpa_same_result``: SDPA over contiguous prior + active keys with the prior/causal mask, which
  computes exactly what the backends compute.

Also a decode case (16 decodes over 384 prior tokens each) against batched contiguous SDPA.
Timings are medians of interleaved repetitions. Prints one summary line; writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from segserve.attention.metadata import AttentionMetadata, build_attention_metadata
from segserve.attention.reference import ReferenceAttentionBackend
from segserve.attention.segmented import SegmentedAttentionBackend


def build_paged(
    query_lens: list[int], priors: list[int], args: argparse.Namespace, seed: int
) -> tuple[dict, AttentionMetadata]:
    """Random q/k/v, a cache holding the priors in shuffled blocks, and the step's metadata."""
    gen = torch.Generator().manual_seed(seed)
    bs = args.block_size
    needed = [-(-(p + q) // bs) for p, q in zip(priors, query_lens, strict=True)]
    ids = (torch.randperm(sum(needed), generator=gen) + 1).tolist()
    rows = [ids[sum(needed[:i]) : sum(needed[: i + 1])] for i in range(len(needed))]
    md = build_attention_metadata(query_lens, priors, rows, bs, max(needed), args.seg)
    t = sum(query_lens)
    dtype = getattr(torch, args.dtype)
    data = {
        "cache": torch.randn(2, sum(needed) + 1, bs, args.kv_heads, args.head_dim, generator=gen).to(dtype),
        "q": torch.randn(t, args.q_heads, args.head_dim, generator=gen).to(dtype),
        "k": torch.randn(t, args.kv_heads, args.head_dim, generator=gen).to(dtype),
        "v": torch.randn(t, args.kv_heads, args.head_dim, generator=gen).to(dtype),
    }
    data["cache"][:, 0] = 0
    return data, md


def contiguous_kv(data: dict, md: AttentionMetadata, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request i's prior + active K, V as contiguous ``[1, Hkv, S, D]`` tensors."""
    bs = data["cache"].shape[2]
    prior, row = md.prior_tokens_cpu[i], md.block_table[i].long()
    pos = torch.arange(prior)
    slots = row[pos // bs] * bs + pos % bs
    flat = data["cache"].flatten(1, 2)  # (2, slots, Hkv, D)
    r0, r1 = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
    k = torch.cat([flat[0, slots], data["k"][r0:r1]]).transpose(0, 1)[None].contiguous()
    v = torch.cat([flat[1, slots], data["v"][r0:r1]]).transpose(0, 1)[None].contiguous()
    return k, v


def time_interleaved(fns: dict[str, Callable[[], object]], reps: dict[str, int]) -> dict[str, list[float]]:
    """Run each function once to warm up, then round-robin; milliseconds per call."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for r in range(max(reps.values())):
        for name, fn in fns.items():
            if r < reps[name]:
                start = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - start) * 1e3)
    return times


def prefill_case(args: argparse.Namespace) -> dict:
    """P6: the chunk through both backends vs contiguous SDPA; returns medians and errors."""
    data, md = build_paged([args.queries], [args.prior], args, seed=0)
    scale = args.head_dim**-0.5
    k_all, v_all = contiguous_kv(data, md, 0)
    q4 = data["q"].transpose(0, 1)[None].contiguous()  # (1, Hq, Tq, D)
    visible = torch.ones(args.queries, args.prior + args.queries, dtype=torch.bool).tril(args.prior)
    seg_backend, ref_backend = SegmentedAttentionBackend(), ReferenceAttentionBackend()

    def run(backend):
        return lambda: backend.forward(data["q"], data["k"], data["v"], data["cache"], md, scale)

    fns = {
        "segmented": run(seg_backend),
        "reference": run(ref_backend),
        "sdpa_4096": lambda: F.scaled_dot_product_attention(
            q4, k_all[:, :, : args.prior], v_all[:, :, : args.prior], scale=scale, enable_gqa=True
        ),
        "sdpa_same_result": lambda: F.scaled_dot_product_attention(
            q4, k_all, v_all, attn_mask=visible, scale=scale, enable_gqa=True
        ),
    }
    times = time_interleaved(fns, {**dict.fromkeys(fns, args.reps), "reference": max(1, args.reps // 3)})
    expected = fns["sdpa_same_result"]()[0].transpose(0, 1)
    errors = {
        name: (fns[name]().float() - expected.float()).abs().max().item()
        for name in ("segmented", "reference")
    }
    medians = {n: statistics.median(t) for n, t in times.items()}
    return {"ms": medians, "samples_ms": times, "max_abs_err": errors}


def decode_case(args: argparse.Namespace) -> dict:
    """16 decodes over 384 prior tokens each: batched segmented decode vs batched contiguous SDPA."""
    n, prior = 16, 384
    data, md = build_paged([1] * n, [prior] * n, args, seed=1)
    scale = args.head_dim**-0.5
    kv = [contiguous_kv(data, md, i) for i in range(n)]
    k_all, v_all = torch.cat([k for k, _ in kv]), torch.cat([v for _, v in kv])  # (n, Hkv, S, D)
    q4 = data["q"][:, :, None]  # (n, Hq, 1, D)
    backend = SegmentedAttentionBackend()
    fns = {
        "segmented": lambda: backend.forward(data["q"], data["k"], data["v"], data["cache"], md, scale),
        "sdpa": lambda: F.scaled_dot_product_attention(q4, k_all, v_all, scale=scale, enable_gqa=True),
    }
    times = time_interleaved(fns, dict.fromkeys(fns, 5 * args.reps))
    err = (fns["segmented"]().float() - fns["sdpa"]()[:, :, 0].float()).abs().max().item()
    return {"ms": {k: statistics.median(t) for k, t in times.items()}, "max_abs_err": err}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="results/bench_kernel.json", help="JSON output path")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per kernel (median)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seg", type=int, default=512, help="kv_segment_size")
    parser.add_argument("--queries", type=int, default=512)
    parser.add_argument("--prior", type=int, default=4096)
    parser.add_argument("--q-heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    prefill, decode = prefill_case(args), decode_case(args)
    ms = prefill["ms"]
    ratio = ms["segmented"] / ms["sdpa_4096"]
    result = {
        "case": vars(args),
        "prefill": prefill,
        "ratio_segmented_vs_sdpa_4096": ratio,
        "ratio_segmented_vs_sdpa_same_result": ms["segmented"] / ms["sdpa_same_result"],
        "decode": decode,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    err = max(prefill["max_abs_err"].values())
    print(
        f"P6 {args.queries}q x {args.prior} prior (seg {args.seg}, block {args.block_size}, {args.dtype}, "
        f"{args.threads} thr): segmented {ms['segmented']:.1f} ms, reference {ms['reference']:.1f} ms, "
        f"SDPA contiguous {ms['sdpa_4096']:.1f} ms (masked same-result {ms['sdpa_same_result']:.1f} ms) "
        f"-> ratio {ratio:.2f}x (target <= 1.5x); decode 16x384: segmented "
        f"{decode['ms']['segmented']:.2f} ms vs SDPA {decode['ms']['sdpa']:.2f} ms; "
        f"max err {err:.1e}"
    )


if __name__ == "__main__":
    main()
