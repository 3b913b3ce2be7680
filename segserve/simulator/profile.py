"""``segserve profile``: measure this engine's step times over a grid of compositions and fit a model.

Each scenario builds an ``LLMEngine`` on the shared loaded model, adds requests with chosen lengths
and times every ``engine.step()``; the step's composition is read from the real scheduler's output
(an ``LLMEngine.schedule_observers`` hook captures it), so the samples are exactly the simulator's
features of steps the engine really ran. Scenarios cover prefill chunks under several budgets and
priors, decode batches of several sizes and contexts, and mixed steps. torch is imported here only,
lazily, by the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from segserve.simulator.replica import composition
from segserve.simulator.step_model import StepComposition


@dataclass(frozen=True)
class Scenario:
    """Requests to run on one engine: ``prompt_len`` tokens, ``max_tokens`` outputs, ``count``
    requests sharing the prompt (added after the first finished its prefill, so they hit the cache),
    optionally a ``late_prompt_len`` prompt added after ``late_after`` steps (mixed steps)."""

    budget: int
    prompt_len: int
    max_tokens: int
    count: int = 1
    late_prompt_len: int = 0
    late_after: int = 2


# A few minutes on 2 cores: prefill chunks at priors up to 4k, decode batches 1-48 at 256-2k context.
DEFAULT_GRID = (
    Scenario(128, 768, 1),
    Scenario(512, 2560, 1),
    Scenario(1024, 1024, 1),
    Scenario(256, 256, 6, count=1),
    Scenario(256, 256, 6, count=8),
    Scenario(256, 256, 6, count=32),
    Scenario(1024, 2048, 6, count=4),
    Scenario(1024, 2048, 6, count=16),
    Scenario(512, 512, 10, count=12, late_prompt_len=1500),
    Scenario(256, 1024, 10, count=24, late_prompt_len=700),
)


def run_scenario(
    loaded, sc: Scenario, seed: int, num_kv_blocks: int = 400
) -> list[tuple[StepComposition, float]]:
    """Run one scenario on a fresh engine; returns (composition, seconds) per step."""
    from segserve import LLMEngine, SamplingParams
    from segserve.simulator.replay import engine_decodes_gather
    from segserve.simulator.workload import TraceRequest, prompt_token_ids

    engine = LLMEngine(
        model=loaded, max_num_batched_tokens=sc.budget, num_kv_blocks=num_kv_blocks, max_num_seqs=64
    )
    vocab = loaded.config.vocab_size
    prompt = prompt_token_ids(TraceRequest(0, sc.prompt_len, 1, (seed,)), 0, vocab)
    params = SamplingParams(temperature=0.0, max_tokens=sc.max_tokens, ignore_eos=True)
    captured: list[StepComposition] = []
    gathers = engine_decodes_gather(engine)
    engine.schedule_observers.append(lambda out: captured.append(composition(engine.scheduler, out, gathers)))
    samples: list[tuple[StepComposition, float]] = []

    def step() -> None:
        t = time.perf_counter()
        engine.step()
        samples.append((captured[-1], time.perf_counter() - t))

    engine.add_request("a0", prompt, params)
    first = engine.scheduler.requests["a0"]
    while first.is_prefill:
        step()
    for i in range(1, sc.count):
        engine.add_request(f"a{i}", prompt, params)
    n = 0
    while engine.has_unfinished_requests():
        if n == sc.late_after and sc.late_prompt_len:
            late = prompt_token_ids(TraceRequest(0, sc.late_prompt_len, 1, (seed + 1,)), 0, vocab)
            engine.add_request("late", late, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        step()
        n += 1
    return samples


def measure(loaded, grid=DEFAULT_GRID, log=print) -> list[tuple[StepComposition, float]]:
    """Warm up, then run every scenario on the loaded model; returns all samples."""
    run_scenario(loaded, Scenario(256, 300, 3, count=2), seed=10_000)  # warm-up, discarded
    samples = []
    for i, sc in enumerate(grid):
        t = time.perf_counter()
        got = run_scenario(loaded, sc, seed=1000 * (i + 1))
        samples.extend(got)
        log(f"[profile] {sc}: {len(got)} steps in {time.perf_counter() - t:.1f} s")
    return samples


def model_shape_of(loaded) -> dict:
    """``ModelShape`` fields of a loaded model (float32)."""
    c = loaded.config
    params = sum(p.numel() for p in loaded.model.parameters())
    return dict(
        name=loaded.name,
        num_params=float(params),
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        dtype_bytes=4,
    )


def samples_to_json(samples: list[tuple[StepComposition, float]]) -> list[dict]:
    """Samples as JSON rows: ``{"seconds", "padded", "gathered", "slices": [[prior, chunk, is_decode,
    samples]]}``."""
    return [
        {
            "seconds": t,
            "padded": c.padded_tokens,
            "gathered": c.gathered_tokens,
            "slices": [[s.prior, s.chunk, s.is_decode, s.samples] for s in c.slices],
        }
        for c, t in samples
    ]


def samples_from_json(rows: list[dict]) -> list[tuple[StepComposition, float]]:
    """Inverse of ``samples_to_json`` (files written before ``gathered`` existed read it as 0).

    Raises:
        ValueError: a row that is not ``{"seconds", "padded", "slices": [[prior, chunk, is_decode,
            samples], ...]}``, naming its index.
    """
    from segserve.simulator.step_model import RequestSlice

    out = []
    for i, r in enumerate(rows):
        try:
            slices = tuple(RequestSlice(int(a), int(b), bool(c), bool(d)) for a, b, c, d in r["slices"])
            comp = StepComposition(slices, int(r["padded"]), int(r.get("gathered", 0)))
            out.append((comp, float(r["seconds"])))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"sample row {i} is malformed ({type(e).__name__}: {e}); expected "
                '{"seconds": s, "padded": n, "slices": [[prior, chunk, is_decode, samples], ...]}'
            ) from None
    return out
