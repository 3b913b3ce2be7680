"""Workloads for the simulator: trace files, re-timing, synthetic arrivals, prompts with shared prefixes.

A ``TraceRequest`` carries an arrival time (seconds from the start), a prompt length, an output
length and optionally Mooncake ``hash_ids`` (one id per 512-token prefix block: equal ids mean an
identical, reusable block; Qin et al., FAST 2025). ``prompt_token_ids`` turns those into token ids so
that equal hash ids give equal token blocks, which is all the prefix cache needs to find them.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

HASH_BLOCK_TOKENS = 512  # Mooncake traces: tokens per hash id


@dataclass(frozen=True)
class TraceRequest:
    """One request of a workload.

    Attributes:
        arrival: seconds since the start of the workload.
        input_len: prompt tokens (>= 1).
        output_len: tokens to generate (>= 1; replayed with ``ignore_eos`` and ``max_tokens``).
        hash_ids: Mooncake prefix-block ids, or None for a prompt that shares nothing.
    """

    arrival: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(
                f"input_len and output_len must be >= 1, got {self.input_len}, {self.output_len}"
            )
        if self.arrival < 0 or not math.isfinite(self.arrival):
            raise ValueError(f"arrival must be a finite time >= 0 s, got {self.arrival}")


def load_trace(path: str | Path, limit: int | None = None, offset: int = 0) -> list[TraceRequest]:
    """Read an Azure LLM trace CSV or a Mooncake JSONL (by extension), arrivals rebased to 0.

    Rows with 0 output tokens are kept with 1 (a request always samples its first token).
    ``offset``/``limit`` select a slice (in file order) before rebasing.

    Raises:
        ValueError: an unknown extension, or an empty selection.
    """
    path = Path(path)
    if path.suffix == ".csv":
        rows = _read_azure(path, offset, limit)
    elif path.suffix in (".jsonl", ".json"):
        rows = _read_mooncake(path, offset, limit)
    else:
        raise ValueError(f"trace {path} must be .csv (Azure) or .jsonl (Mooncake), got {path.suffix!r}")
    if not rows:
        raise ValueError(f"trace {path} has no requests in [offset={offset}, limit={limit}]")
    t0 = min(r.arrival for r in rows)
    return sorted((replace(r, arrival=r.arrival - t0) for r in rows), key=lambda r: r.arrival)


def _window(offset: int, limit: int | None):
    if offset < 0 or (limit is not None and limit < 1):
        raise ValueError(f"offset must be >= 0 and limit >= 1, got {offset}, {limit}")
    return offset, (None if limit is None else offset + limit)


def _read_azure(path: Path, offset: int, limit: int | None) -> list[TraceRequest]:
    start, stop = _window(offset, limit)
    out = []
    with open(path, newline="", encoding="utf-8") as f:
        for i, row in enumerate(csv.DictReader(f)):
            if i < start:
                continue
            if stop is not None and i >= stop:
                break
            ts = datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp()
            out.append(
                TraceRequest(ts, max(1, int(row["ContextTokens"])), max(1, int(row["GeneratedTokens"])))
            )
    return out


def _read_mooncake(path: Path, offset: int, limit: int | None) -> list[TraceRequest]:
    start, stop = _window(offset, limit)
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i < start:
                continue
            if stop is not None and i >= stop:
                break
            d = json.loads(line)
            out.append(
                TraceRequest(
                    d["timestamp"] / 1000.0,
                    max(1, d["input_length"]),
                    max(1, d["output_length"]),
                    tuple(d.get("hash_ids") or ()) or None,
                )
            )
    return out


def retime(
    requests: list[TraceRequest], rate: float | None = None, burstiness: float = 1.0, seed: int = 0
) -> list[TraceRequest]:
    """New arrival times at ``rate`` requests/s (gamma inter-arrivals of shape ``burstiness``;
    1.0 is Poisson, as in vLLM ``bench serve --burstiness``), keeping order and lengths.
    ``rate=None`` sends everything at time 0.

    Raises:
        ValueError: rate or burstiness <= 0.
    """
    if rate is not None and rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    rng, t, out = random.Random(seed), 0.0, []
    for r in requests:
        out.append(replace(r, arrival=t))
        if rate is not None:
            # Gamma with shape k and scale 1/(k * rate) has mean 1/rate.
            t += rng.gammavariate(burstiness, 1.0 / (burstiness * rate))
    return out


def scale_lengths(requests: list[TraceRequest], max_input: int, max_output: int) -> list[TraceRequest]:
    """Clip prompt and output lengths (e.g. to a small model's context); hash ids are trimmed to match."""
    out = []
    for r in requests:
        n = min(r.input_len, max_input)
        ids = None if r.hash_ids is None else r.hash_ids[: math.ceil(n / HASH_BLOCK_TOKENS)]
        out.append(replace(r, input_len=n, output_len=min(r.output_len, max_output), hash_ids=ids))
    return out


def synthetic(
    num_requests: int,
    rate: float | None,
    input_len: int,
    output_len: int,
    burstiness: float = 1.0,
    prefix_len: int = 0,
    length_jitter: float = 0.0,
    seed: int = 0,
) -> list[TraceRequest]:
    """``num_requests`` requests with Poisson/gamma arrivals; all share a ``prefix_len``-token prefix
    (rounded down to whole hash blocks). ``length_jitter`` draws lengths uniformly in
    ``[len * (1 - j), len * (1 + j)]``.

    Raises:
        ValueError: num_requests < 1, jitter outside [0, 1), prefix not shorter than the input.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not 0 <= length_jitter < 1:
        raise ValueError(f"length_jitter must be in [0, 1), got {length_jitter}")
    if prefix_len >= input_len * (1 - length_jitter):
        raise ValueError(f"prefix_len={prefix_len} must be shorter than every input (input_len={input_len})")
    rng = random.Random(seed)
    shared = prefix_len // HASH_BLOCK_TOKENS
    reqs, next_id = [], shared

    def jitter(n: int) -> int:
        return max(1, round(n * rng.uniform(1 - length_jitter, 1 + length_jitter)))

    for _ in range(num_requests):
        n_in = jitter(input_len)
        own = math.ceil(n_in / HASH_BLOCK_TOKENS) - shared
        reqs.append(
            TraceRequest(
                0.0, n_in, jitter(output_len), tuple(range(shared)) + tuple(range(next_id, next_id + own))
            )
        )
        next_id += own
    return retime(reqs, rate, burstiness, seed)


def prompt_token_ids(req: TraceRequest, index: int, vocab_size: int | None = None) -> list[int]:
    """Token ids for a request: hash block ``h`` always gives the same 512 ids, so equal ``hash_ids``
    prefixes are equal token prefixes; a request without hash ids gets ids no other request shares.

    With ``vocab_size`` None, ids are ``range(h * 512, (h + 1) * 512)`` (fast; the scheduler never
    checks the vocabulary). With a vocabulary, each block is drawn from ``random.Random(h)`` in
    ``[0, vocab_size)`` for a real model.
    """
    ids = req.hash_ids
    if ids is None:
        # Disjoint from every trace's hash ids (those are small non-negative ints).
        ids = tuple(-(index + 1) * 100_000 - b for b in range(math.ceil(req.input_len / HASH_BLOCK_TOKENS)))
    tokens: list[int] = []
    for h in ids:
        if len(tokens) >= req.input_len:
            break
        tokens.extend(_block(h, vocab_size))
    while len(tokens) < req.input_len:  # trace rows whose hash ids cover fewer tokens than input_len
        tokens.extend(_block(-(index + 1) * 100_000 - 99_999 + len(tokens) // HASH_BLOCK_TOKENS, vocab_size))
    return tokens[: req.input_len]


def _block(h: int, vocab_size: int | None) -> list[int]:
    if vocab_size is None:
        return list(range(h * HASH_BLOCK_TOKENS, (h + 1) * HASH_BLOCK_TOKENS))
    rng = random.Random(h)
    return [rng.randrange(vocab_size) for _ in range(HASH_BLOCK_TOKENS)]
