"""Shared pieces of the experiment scripts in ``benchmarks/``: an in-process step loop that stamps
every output token, latency statistics, and the one-line/JSON/PNG output every script ends with.

Times are ``time.perf_counter`` seconds since the loop's start; a token's time is the end of the
step that produced it (what a streaming client would see, less HTTP). ITL is the gap between a
request's consecutive tokens; TTFT is first token time minus the time the request was added.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from segserve.simulator.metrics import percentile


@dataclass
class Timeline:
    """What one run saw.

    Attributes:
        added: request id -> time it was added, s.
        token_times: request id -> end time of the step that produced each output token, s.
        steps: (start, duration, prompt tokens computed) of each step, s and tokens.
        cached: request id -> prompt tokens served from the prefix cache.
    """

    added: dict[str, float] = field(default_factory=dict)
    token_times: dict[str, list[float]] = field(default_factory=dict)
    steps: list[tuple[float, float, int]] = field(default_factory=list)
    cached: dict[str, int] = field(default_factory=dict)

    def ttft(self, rid: str) -> float:
        return self.token_times[rid][0] - self.added[rid]

    def gaps(self, rid: str) -> list[tuple[float, float]]:
        """(token time, gap since the previous token) for each token after the first, s."""
        times = self.token_times[rid]
        return [(b, b - a) for a, b in zip(times, times[1:], strict=False)]

    def itls(self, rids: list[str]) -> list[float]:
        """Inter-token gaps of ``rids`` pooled, s."""
        return [gap for r in rids for _, gap in self.gaps(r)]

    def prefill_steps_since(self, t: float) -> int:
        """Steps started at or after ``t`` that computed prompt tokens."""
        return sum(1 for start, _, prompt in self.steps if prompt and start >= t)

    def step_durations(self) -> list[float]:
        return [d for _, d, _ in self.steps]


class Stepper:
    """Drives an ``LLMEngine`` step by step and fills a ``Timeline``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.timeline = Timeline()
        self.t0 = time.perf_counter()
        self._seen: dict[str, int] = {}

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, rid: str, prompt_ids: list[int], max_tokens: int) -> None:
        """Queue a greedy request that generates exactly ``max_tokens`` tokens (``ignore_eos``)."""
        from segserve import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(rid, prompt_ids, params)
        self.timeline.added[rid] = self.now()
        self.timeline.token_times[rid] = []

    def step(self) -> None:
        sched = self.engine.scheduler
        before = sched.make_stats().num_prompt_tokens_computed
        start = self.now()
        outs = self.engine.step()
        end = self.now()
        prompt_tokens = sched.make_stats().num_prompt_tokens_computed - before
        self.timeline.steps.append((start, end - start, prompt_tokens))
        for out in outs:
            n = len(out.outputs[0].token_ids)
            new = n - self._seen.get(out.request_id, 0)
            self.timeline.token_times[out.request_id].extend([end] * new)
            self._seen[out.request_id] = n
            self.timeline.cached[out.request_id] = out.num_cached_tokens

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Step until ``until()`` is true, or until the engine is idle."""
        while self.engine.has_unfinished_requests() and not (until and until()):
            self.step()

    def replay(self, requests: list[tuple[str, list[int], int, float]]) -> None:
        """Add each ``(id, prompt ids, max_tokens, arrival s)`` once the clock passes its arrival
        (checked between steps, as a server's engine loop would), stepping until all finish."""
        pending = sorted(requests, key=lambda r: r[3])
        while pending or self.engine.has_unfinished_requests():
            while pending and pending[0][3] <= self.now():
                rid, ids, max_tokens, _ = pending.pop(0)
                self.add(rid, ids, max_tokens)
            if self.engine.has_unfinished_requests():
                self.step()
            elif pending:
                time.sleep(max(0.0, pending[0][3] - self.now()))


def latency_stats(seconds: list[float]) -> dict[str, float]:
    """p50, p99, max and mean of latencies, in ms."""
    ms = [s * 1000.0 for s in seconds]
    return {
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
        "max_ms": max(ms, default=float("nan")),
        "mean_ms": sum(ms) / len(ms) if ms else float("nan"),
        "n": len(ms),
    }


def common_args(description: str, name: str) -> argparse.ArgumentParser:
    """Flags every experiment has: model, dtype, threads, output paths."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=None, help="GGUF or HF dir (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=f"results/{name}.json", help="where the JSON record goes")
    p.add_argument("--png", default=f"docs/{name}.png", help="where the plot goes")
    return p


def load(args: argparse.Namespace) -> Any:
    """The model once, shared by every engine of the experiment, warmed up (``warm_up``)."""
    import torch

    from segserve.engine.llm_engine import resolve_dtype
    from segserve.models.loader import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=resolve_dtype(args.dtype))
    warm_up(loaded)
    return loaded


def warm_up(loaded: Any, prompt_len: int = 1024) -> None:
    """One untimed request (a ``prompt_len``-token prompt in 512-token chunks, then 4 decodes) so
    that first-call costs (allocator growth, thread pool start, kernel selection) land in no
    measured run. The model's context caps ``prompt_len``."""
    from segserve import LLMEngine

    n = min(prompt_len, loaded.config.max_position_embeddings - 8)
    engine = LLMEngine(model=loaded, block_size=16, num_kv_blocks=-(-(n + 8) // 16) + 2, max_num_seqs=1)
    st = Stepper(engine)
    st.add("warmup", random_ids(n, loaded.config.vocab_size, 12345), 4)
    st.run()


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    """``n`` seeded token ids in ``[17, vocab)`` (SmolLM2's special tokens are below 17)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(17, vocab) for _ in range(n)]


def finish(args: argparse.Namespace, name: str, record: dict, line: str) -> None:
    """Save the JSON record (with machine load), print the one summary line."""
    from segserve.bench.cli import machine

    record = {"experiment": name, "machine": machine(), **record}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    print(line, flush=True)


def new_figure(ncols: int = 1, width: float = 6.4) -> tuple[Any, Any]:
    """A matplotlib figure on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=(width * ncols, 4.2))


def save_figure(fig: Any, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)


def load_1min() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None
