"""The demo's first question (a ~2,300-token chat prompt), segserve vs Hugging Face ``generate`` in one run.

Measures TTFT (prompt in, first token out) and decode tokens/s (tokens after the first, over the time
after the first) for both, greedy float32, same GGUF weights. Prints one summary line, saves JSON.

    .venv/bin/python benchmarks/demo_vs_hf.py [--max-tokens 64] [--out results/demo_vs_hf.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def segserve_run(prompt_ids: list[int], max_tokens: int, budget: int) -> dict:
    from segserve import LLMEngine, SamplingParams

    engine = LLMEngine(max_num_batched_tokens=budget)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("warmup", prompt_ids[:64], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("q", prompt_ids, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                m = out.metrics
                return {
                    "ttft_s": m.ttft,
                    "decode_tok_s": m.decode_tokens_per_s,
                    "prefill_steps": m.num_prefill_steps,
                    "tokens": out.outputs[0].token_ids,
                }
    raise RuntimeError("request did not finish")


def hf_run(prompt_ids: list[int], max_tokens: int) -> dict:
    from segserve.bench.throughput import load_hf_model

    model = load_hf_model(None, "float32")
    ids = torch.tensor([prompt_ids])
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:, :64], max_new_tokens=2, **kwargs)  # warm-up
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kwargs)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_tokens, **kwargs)
        total = time.perf_counter() - t0
    decode_s = total - ttft  # the same prefill is inside the full run
    return {
        "ttft_s": ttft,
        "decode_tok_s": (max_tokens - 1) / decode_s,
        "tokens": out[0, len(prompt_ids) :].tolist(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--budget", type=int, default=512, help="segserve max_num_batched_tokens")
    parser.add_argument("--out", default="results/demo_vs_hf.json")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    import gguf

    from segserve.entrypoints.cli import DEFAULT_QUESTIONS, default_document
    from segserve.models.loader import default_model_path, tokenizer_from_gguf

    path = default_model_path()
    tokenizer = tokenizer_from_gguf(gguf.GGUFReader(str(path)), path)
    content = f"Read this document.\n\n{default_document()}\n\nQuestion: {DEFAULT_QUESTIONS[0]}"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    ours = segserve_run(prompt_ids, args.max_tokens, args.budget)
    theirs = hf_run(prompt_ids, args.max_tokens)
    result = {
        "prompt_tokens": len(prompt_ids),
        "max_tokens": args.max_tokens,
        "segserve": {k: v for k, v in ours.items() if k != "tokens"},
        "transformers": {k: v for k, v in theirs.items() if k != "tokens"},
        "same_tokens": ours["tokens"] == theirs["tokens"],
        "ttft_ratio_hf_over_segserve": theirs["ttft_s"] / ours["ttft_s"],
        "decode_ratio_segserve_over_hf": ours["decode_tok_s"] / theirs["decode_tok_s"],
        "threads": torch.get_num_threads(),
        "load_avg_1m": os.getloadavg()[0],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(
        f"demo prompt {len(prompt_ids)} tok: TTFT segserve {ours['ttft_s']:.2f}s vs transformers "
        f"{theirs['ttft_s']:.2f}s ({result['ttft_ratio_hf_over_segserve']:.2f}x faster); decode segserve "
        f"{ours['decode_tok_s']:.1f} tok/s vs {theirs['decode_tok_s']:.1f} "
        f"({result['decode_ratio_segserve_over_hf']:.2f}x); same greedy tokens: {result['same_tokens']}"
    )


if __name__ == "__main__":
    main()
