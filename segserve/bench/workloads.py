"""Seeded benchmark workloads: prompts as token ids, output lengths and arrival times.

Kinds (``make_workload(kind=...)``):

- ``random``: token ids drawn uniformly from the vocabulary, lengths uniform in
  ``[len * (1 - range_ratio), len * (1 + range_ratio)]`` (vLLM ``bench``'s random dataset).
- ``text``: windows of real English text (the Apache-2.0 license shipped with the package, tokenized
  by the model's tokenizer), each starting at a seeded offset.
- ``azure-code``, ``azure-conv``: prompt/output lengths and arrival times of the Azure LLM inference
  traces (Patel et al., "Splitwise", ISCA 2024), random token ids.
- ``mooncake-conv``, ``mooncake-synth``: the Mooncake traces (Qin et al., FAST 2025), whose
  ``hash_ids`` name 512-token prefix blocks: equal ids get equal token blocks, so requests share
  prefixes exactly as in the trace.

Trace lengths are multiplied by ``length_scale`` (Mooncake's block size scales with it, so sharing is
kept) and then clipped so that prompt + output fits ``max_model_len`` (8,192 for SmolLM2). Nothing
here imports torch.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from segserve.simulator.workload import HASH_BLOCK_TOKENS, TraceRequest, load_trace

TRACE_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces"
TRACE_FILES = {
    "azure-code": "azure2023_code.csv",
    "azure-conv": "azure2023_conv.csv",
    "mooncake-conv": "mooncake_conversation.jsonl",
    "mooncake-synth": "mooncake_synthetic.jsonl",
}
KINDS = ("random", "text", *TRACE_FILES)
# Token ids below this are special tokens in SmolLM2's vocabulary (0..16); random prompts avoid them.
FIRST_PLAIN_TOKEN = 17


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request.

    Attributes:
        prompt_token_ids: the prompt (>= 1 token).
        output_len: tokens to generate (>= 1; run with ``ignore_eos`` so it is exact).
        arrival: seconds since the start of the workload (0 for offline runs).
    """

    prompt_token_ids: tuple[int, ...]
    output_len: int
    arrival: float = 0.0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids or self.output_len < 1:
            raise ValueError(
                f"a request needs >= 1 prompt token and output_len >= 1, got "
                f"{len(self.prompt_token_ids)} and {self.output_len}"
            )


@dataclass(frozen=True)
class Workload:
    """A named list of requests plus how it was made (for the JSON record)."""

    name: str
    requests: tuple[BenchRequest, ...]
    settings: dict[str, Any]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)


def _jitter(rng: random.Random, n: int, range_ratio: float) -> int:
    return max(1, round(n * rng.uniform(1 - range_ratio, 1 + range_ratio)))


def random_workload(
    num_requests: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[BenchRequest]:
    """Uniform random token ids in ``[17, vocab_size)``; lengths jittered by ``range_ratio``."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        n_in = _jitter(rng, input_len, range_ratio)
        ids = tuple(rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(n_in))
        out.append(BenchRequest(ids, _jitter(rng, output_len, range_ratio)))
    return out


def text_workload(
    num_requests: int,
    input_len: int,
    output_len: int,
    tokenizer: Any,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[BenchRequest]:
    """Windows of the Apache-2.0 license text (repeated to cover ``input_len``), seeded offsets."""
    text = resources.files("segserve").joinpath("data/apache-2.0.txt").read_text()
    corpus = tokenizer.encode(text)
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        n_in = _jitter(rng, input_len, range_ratio)
        start = rng.randrange(len(corpus))
        repeats = math.ceil((start + n_in) / len(corpus))
        ids = tuple((corpus * repeats)[start : start + n_in])
        out.append(BenchRequest(ids, _jitter(rng, output_len, range_ratio)))
    return out


def trace_workload(
    kind: str,
    num_requests: int,
    max_model_len: int,
    vocab_size: int,
    length_scale: float = 1.0,
    offset: int = 0,
    trace_dir: str | Path | None = None,
) -> list[BenchRequest]:
    """The first ``num_requests`` rows (after ``offset``) of a trace, lengths scaled and clipped.

    Raises:
        ValueError: unknown kind, ``length_scale`` <= 0, ``max_model_len`` < 2, or a missing file.
    """
    if kind not in TRACE_FILES:
        raise ValueError(f"trace kind must be one of {sorted(TRACE_FILES)}, got {kind!r}")
    if length_scale <= 0:
        raise ValueError(f"length_scale must be > 0, got {length_scale}")
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    path = Path(trace_dir or TRACE_DIR) / TRACE_FILES[kind]
    if not path.exists():
        raise ValueError(f"trace file {path} does not exist")
    block = max(1, round(HASH_BLOCK_TOKENS * length_scale))
    out = []
    for index, row in enumerate(load_trace(path, limit=num_requests, offset=offset)):
        n_out = min(max(1, round(row.output_len * length_scale)), max_model_len // 2)
        n_in = min(max(1, round(row.input_len * length_scale)), max_model_len - n_out)
        out.append(BenchRequest(_trace_prompt(row, index, n_in, block, vocab_size), n_out, row.arrival))
    return out


def _trace_prompt(row: TraceRequest, index: int, n_in: int, block: int, vocab_size: int) -> tuple[int, ...]:
    """Prompt ids: one seeded ``block``-token run per hash id, then tokens no other request shares."""
    ids: list[int] = []
    for h in row.hash_ids or ():
        if len(ids) >= n_in:
            break
        rng = random.Random(f"hash-{h}")
        ids.extend(rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(block))
    rng = random.Random(f"own-{index}")
    ids.extend(rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(n_in - len(ids)))
    return tuple(ids[:n_in])


def make_workload(
    kind: str,
    num_requests: int,
    *,
    vocab_size: int,
    max_model_len: int,
    tokenizer: Any = None,
    input_len: int = 512,
    output_len: int = 128,
    range_ratio: float = 0.0,
    length_scale: float = 1.0,
    seed: int = 0,
    trace_offset: int = 0,
    trace_dir: str | Path | None = None,
) -> Workload:
    """Build a workload of ``kind`` (see the module docstring); the same arguments give the same ids.
    Traces are read from row ``trace_offset`` on (``seed`` applies to ``random`` and ``text``).

    Raises:
        ValueError: unknown kind, ``num_requests`` < 1, lengths < 1, ``range_ratio`` outside [0, 1),
            a request longer than ``max_model_len``, or ``text`` without a tokenizer.
    """
    if kind not in KINDS:
        raise ValueError(f"workload kind must be one of {KINDS}, got {kind!r}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input_len and output_len must be >= 1, got {input_len}, {output_len}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if kind == "random":
        reqs = random_workload(num_requests, input_len, output_len, vocab_size, range_ratio, seed)
    elif kind == "text":
        if tokenizer is None:
            raise ValueError("the 'text' workload needs the model's tokenizer")
        reqs = text_workload(num_requests, input_len, output_len, tokenizer, range_ratio, seed)
    else:
        reqs = trace_workload(
            kind, num_requests, max_model_len, vocab_size, length_scale, trace_offset, trace_dir
        )
    longest = max(len(r.prompt_token_ids) + r.output_len for r in reqs)
    if longest > max_model_len:
        raise ValueError(f"a request needs {longest} tokens, more than max_model_len={max_model_len}")
    settings = dict(
        kind=kind, num_requests=num_requests, input_len=input_len, output_len=output_len,
        range_ratio=range_ratio, length_scale=length_scale, seed=seed, trace_offset=trace_offset,
    )
    return Workload(kind, tuple(reqs), settings)
