"""``segserve`` command line: ``segserve generate`` streams answers from the engine."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from importlib import resources

from segserve.engine_args import DefaultsHelpFormatter, EngineArgs, check_cli_args

# Each module defines ``register(subparsers)`` adding its subcommand; imports stay light (no torch).
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "segserve.entrypoints.serve",
    "segserve.simulator.cli",
    "segserve.bench.cli",
)

# Questions the 135M default model answers mostly right (2026-12-05, greedy): it copied the license's
# header for "what does it say about patents?" and got section 6 (trademarks) backwards.
DEFAULT_QUESTIONS = (
    "Who wrote this license, and which version is it?",
    "Can I use software under this license in a commercial product?",
)


def default_document() -> str:
    """The Apache-2.0 license text shipped with the package (about 2,200 tokens)."""
    return resources.files("segserve").joinpath("data/apache-2.0.txt").read_text()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="segserve", description="segserve: prefill-first LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate",
        help="answer questions about a document (or plain prompts), streaming",
        formatter_class=DefaultsHelpFormatter,
    )
    EngineArgs.add_cli_args(gen)
    gen.add_argument(
        "--document", default=None, help="text file the questions are about (default: Apache-2.0)"
    )
    gen.add_argument("--question", action="append", default=None, help="question about the document (repeat)")
    gen.add_argument(
        "--prompt", action="append", default=None, help="plain chat message, no document (repeat)"
    )
    gen.add_argument("--max-tokens", type=int, default=96, help="tokens to generate per answer")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.set_defaults(func=run_generate)
    for module in SUBCOMMAND_MODULES:
        importlib.import_module(module).register(sub)
    for subparser in sub.choices.values():  # its errors print its own usage line
        subparser.set_defaults(subparser=subparser)
    return parser


# vLLM flags a vLLM user may bring that segserve does not take, and why (refused, never ignored: a flag
# that is accepted does what it says). ``LLM()`` takes the GPU ones as keywords and logs that they do
# nothing on the CPU, as vLLM's CPU build does.
VLLM_ONLY_FLAGS = {
    "--gpu-memory-utilization":
        "a vLLM GPU setting (on the CPU the KV cache is sized by --kv-cache-memory-bytes)",
    **dict.fromkeys(("--enforce-eager", "--cuda-graph-sizes", "--max-seq-len-to-capture"),
                    "a vLLM GPU setting (CUDA graphs; segserve's CPU kernels run as they are)"),
    **dict.fromkeys(("--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size",
                     "--disable-custom-all-reduce"),
                    "a vLLM multi-GPU setting (segserve runs one engine a process; "
                    "--num-replicas scales out)"),
    "--swap-space":
        "a vLLM setting for swapping the GPU's KV cache out (segserve's is already in CPU memory)",
    "--trust-remote-code": "segserve runs its own Llama code only, never a checkpoint's",
    "--enable-chunked-prefill": "segserve always chunks prefills (--max-num-batched-tokens: their budget)",
    "--disable-log-requests": "segserve logs no requests (--log-interval sets the stats line)",
}


def _unknown_flags_message(unknown: list[str]) -> str:
    """argparse's complaint, with the reason for each vLLM-only flag among ``unknown``."""
    why = [f"{flag} is {VLLM_ONLY_FLAGS[flag]}" if VLLM_ONLY_FLAGS[flag].startswith("a ") else
           f"{flag}: {VLLM_ONLY_FLAGS[flag]}"
           for flag in dict.fromkeys(u.split("=", 1)[0] for u in unknown) if flag in VLLM_ONLY_FLAGS]
    return "; ".join([f"unrecognized arguments: {' '.join(unknown)}", *why])


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        args.subparser.error(_unknown_flags_message(unknown))
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _messages(args: argparse.Namespace) -> list[list[dict[str, str]]]:
    if args.prompt:
        return [[{"role": "user", "content": p}] for p in args.prompt]
    if args.document:
        with open(args.document, encoding="utf-8") as f:
            doc = f.read()
    else:
        doc = default_document()
    questions = args.question or list(DEFAULT_QUESTIONS)
    return [
        [{"role": "user", "content": f"Read this document.\n\n{doc}\n\nQuestion: {q}"}] for q in questions
    ]


def run_generate(args: argparse.Namespace) -> int:
    """Ask each question in turn (so later ones can reuse the cached document), streaming answers."""
    from segserve import LLMEngine, SamplingParams
    from segserve.engine.llm import chat_prompt_ids

    t0 = time.perf_counter()
    conversations = _messages(args)  # read the document before the model loads: fail fast
    # The sampling flags too are checked before the model loads.
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    check_cli_args(args)
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    print(f"[segserve] loaded in {time.perf_counter() - t0:.1f} s: {engine.describe()}", flush=True)
    for i, messages in enumerate(conversations):
        question = messages[-1]["content"].rsplit("Question: ", 1)[-1]
        print(f"\n### Q{i + 1}: {question}\n", flush=True)
        engine.add_request(f"q{i}", chat_prompt_ids(engine, messages), params)
        final = _stream(engine)
        m = final.metrics
        rate = m.decode_tokens_per_s
        print(
            f"\n[q{i + 1}] prompt_tokens={len(final.prompt_token_ids)} "
            f"cached_tokens={final.num_cached_tokens} "
            f"prefill_steps={m.num_prefill_steps} ttft={m.ttft:.3f}s "
            f"output_tokens={len(final.outputs[0].token_ids)} "
            f"decode={f'{rate:.1f} tok/s' if rate else 'n/a'} finish={final.outputs[0].finish_reason}",
            flush=True,
        )
    engine.check_integrity()
    return 0


def _stream(engine):
    """Step until the single queued request finishes, printing its text as it grows."""
    shown = 0
    while True:
        for out in engine.step():
            text = out.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
            if out.finished:
                return out


if __name__ == "__main__":
    sys.exit(main())
