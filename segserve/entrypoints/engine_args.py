"""Engine flags under vLLM's names, shared by every CLI subcommand."""

from __future__ import annotations

import argparse
import math
from typing import Any


def _gib(text: str) -> float:
    """``--kv-cache-memory``: a finite number of GiB > 0 (the error names the flag and its unit)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of GiB, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of GiB > 0, got {text}")
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--model``, ``--dtype`` and the scheduler/cache/attention flags to ``parser``."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument(
        "--num-kv-blocks", type=int, default=None, help="KV blocks (default: from --kv-cache-memory)"
    )
    g.add_argument("--kv-cache-memory", type=_gib, default=2.0, help="KV cache budget, GiB")
    g.add_argument("--max-model-len", type=int, default=None, help="tokens per request (default: model's)")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="per-step token budget")
    g.add_argument("--max-num-seqs", type=int, default=64, help="running requests at once")
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse shared prefixes",
    )
    g.add_argument(
        "--long-prefill-token-threshold", type=int, default=0, help="chunk cap per request (0: none)"
    )
    g.add_argument("--kv-segment-size", type=int, default=512, choices=[512, 1024, 2048, 4096])
    g.add_argument("--attention-backend", default="segmented", choices=["segmented", "reference"])
    g.add_argument("--scheduling-policy", default="decode_first", choices=["decode_first", "prefill_first"])
    g.add_argument(
        "--attention-cost-tokens",
        type=int,
        default=0,
        help="charge chunks n + n*(prior+n)/K against a per-step cost budget (K; 0: token budget only)",
    )
    g.add_argument("--seed", type=int, default=0)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``LLMEngine`` keyword arguments from parsed flags."""
    return dict(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=int(args.kv_cache_memory * 1024**3),
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=args.enable_prefix_caching,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        kv_segment_size=args.kv_segment_size,
        attention_backend=args.attention_backend,
        scheduling_policy=args.scheduling_policy,
        seed=args.seed,
        attention_cost_tokens=args.attention_cost_tokens,
    )
