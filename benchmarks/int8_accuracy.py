"""Accuracy of the integer-activation GGUF path (``SEGSERVE_QUANT_INT8``, on by default) on the real model.

For the default model (Q4_1 SmolLM2) or ``--model FILE``, in ``--dtype``: greedy output of the demo's
two questions (the Apache-2.0 document, chat template, ``--demo-tokens`` tokens) and of the e2e parity
prompts (tests/e2e/test_engine_parity.py's five, ``--e2e-tokens`` tokens), once with the integer path
off (the float kernels: exact dequantized weights, float32 products) and once on (one-row Q4_0 / Q4_1
products on 16-bit fixed-point activations, ``quant.int8_formats``; Q8_0 files are unaffected).
Reports per prompt whether the greedy tokens are equal, where they first differ, and the max |logit
difference| over the steps both runs share (every step up to the first differing token; logits as the
LM head returns them, float32). Writes ``results/int8_accuracy.json``.

Prefix caching is on so the second run of a prompt reuses the first's KV blocks of the long prompts
(prefill chunks take the dequantize-then-GEMM path, which the switch does not touch): the integer run
recomputes only the prompt's last partial block and the last token, then decodes with it throughout.
Prints one line per prompt and a summary line.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from segserve import LLM, SamplingParams
from segserve.entrypoints.cli import DEFAULT_QUESTIONS, default_document
from segserve.kernels import quant


def prompts(llm: LLM) -> dict[str, list[int]]:
    tok = llm.get_tokenizer()
    doc = default_document()

    def chat(text: str) -> list[int]:
        s = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                    tokenize=False)
        return tok.encode(s, add_special_tokens=False)

    out = {f"demo_q{i + 1}": chat(f"Read this document.\n\n{doc}\n\nQuestion: {q}")
           for i, q in enumerate(DEFAULT_QUESTIONS)}
    texts = ["The capital of France is", "def fibonacci(n):\n    ", doc[:1800],
             "Chunked prefill splits a long prompt into pieces so that decodes keep flowing."]
    out.update({f"e2e_{i}": tok.encode(t) for i, t in enumerate(texts)})
    out["e2e_4"] = chat(f"{doc}\n\nWhat does this license say about patents?")
    return out


def run(llm: LLM, ids: list[int], n: int, int8: bool) -> tuple[list[int], list[torch.Tensor]]:
    step = llm.llm_engine.runner.cpu_step
    logits: list[torch.Tensor] = []
    inner = step.logits_of  # every sampled step's logits, whether the decode stack made them or not

    def recording(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        out = inner(hidden, rows)
        logits.append(out.clone())
        return out

    step.logits_of = recording
    old = quant.set_int8(int8)
    try:
        res = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=n),
                           use_tqdm=False)
    finally:
        quant.set_int8(old)
        step.logits_of = inner
    return list(res[0].outputs[0].token_ids), logits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--demo-tokens", type=int, default=64)
    p.add_argument("--e2e-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="results/int8_accuracy.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not quant.int8_built():
        raise SystemExit("this CPU or build has no AVX-512 VNNI integer-activation kernel")
    kw = {} if args.model is None else {"model": args.model}
    llm = LLM(dtype=args.dtype, enable_prefix_caching=True, **kw)
    report = {"dtype": args.dtype, "model": args.model or "default", "prompts": {}}
    for name, ids in prompts(llm).items():
        n = args.demo_tokens if name.startswith("demo") else args.e2e_tokens
        ref, ref_logits = run(llm, ids, n, int8=False)
        got, got_logits = run(llm, ids, n, int8=True)
        first = next((i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), None)
        shared = len(ref) if first is None else first + 1  # the step that picked the first difference too
        diff = max((a - b).abs().max().item() for a, b in zip(ref_logits[:shared], got_logits[:shared],
                                                              strict=False))
        report["prompts"][name] = {"prompt_tokens": len(ids), "tokens": len(ref), "equal": ref == got,
                                   "first_difference": first, "max_abs_logit_diff": diff}
        print(f"{args.dtype} {name}: {len(ids)} prompt tokens, {len(ref)} generated, "
              f"{'equal' if ref == got else f'first differs at {first}'}, max |logit diff| {diff:.4f}",
              flush=True)
    rows = report["prompts"].values()
    equal = sum(r["equal"] for r in rows)
    worst = max(r["max_abs_logit_diff"] for r in rows)
    print(f"int8_accuracy: {equal}/{len(rows)} prompts with equal greedy tokens, max |logit diff| "
          f"{worst:.4f} ({args.dtype}, {args.model or 'default model'})")
    report["load"] = os.getloadavg()[0]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
