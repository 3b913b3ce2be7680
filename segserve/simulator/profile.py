"""``segserve profile``: measure this engine's step times over a grid of compositions and fit a model.

Each scenario builds an ``LLMEngine`` on the shared loaded model, adds requests with chosen lengths
and times every ``engine.step()``; the step's composition is read from the real scheduler's output
(an ``LLMEngine.schedule_observers`` hook captures it), so the samples are exactly the simulator's
features of steps the engine really ran. Scenarios cover prefill chunks under several budgets and
priors, decode batches of several sizes and contexts, and mixed steps. ``--quick`` (``measure_quick``,
``calibrate_quick``) reaches the same kinds of shapes on one engine through prefix caching, in about
a tenth of the time; ``segserve.simulator.calibration`` caches its fit per machine. torch is imported
here only, lazily, by the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from segserve.simulator.drift import drift_warning, reference_drift
from segserve.simulator.step_model import SMALL_STEP_ROWS, StepComposition


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
    from segserve.simulator.replay import step_composer
    from segserve.simulator.workload import TraceRequest, prompt_token_ids

    engine = LLMEngine(
        model=loaded, max_num_batched_tokens=sc.budget, num_kv_blocks=num_kv_blocks, max_num_seqs=64
    )
    vocab = loaded.config.vocab_size
    prompt = prompt_token_ids(TraceRequest(0, sc.prompt_len, 1, (seed,)), 0, vocab)
    params = SamplingParams(temperature=0.0, max_tokens=sc.max_tokens, ignore_eos=True)
    captured: list[StepComposition] = []
    compose = step_composer(engine)
    engine.schedule_observers.append(lambda out: captured.append(compose(out)))
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


def model_shape_of(loaded, dtype_bytes: int = 4) -> dict:
    """``ModelShape`` fields of a loaded model (``dtype_bytes`` per weight and KV element)."""
    c = loaded.config
    # Weights kept in GGUF blocks (``qweight`` buffers) count as the values they hold, not their bytes.
    blocks = [m.quant_weight.shape for m in loaded.model.modules() if hasattr(m, "quant_weight")]
    params = sum(p.numel() for p in loaded.model.parameters()) + sum(n * k for n, k in blocks)
    return dict(
        name=loaded.name,
        num_params=float(params),
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        dtype_bytes=dtype_bytes,
    )


def samples_to_json(samples: list[tuple[StepComposition, float]]) -> list[dict]:
    """Samples as JSON rows: ``{"seconds", "padded", "gathered", "slices": [[prior, chunk, is_decode,
    samples]], "stack_rows"}``."""
    return [
        {
            "seconds": t,
            "padded": c.padded_tokens,
            "gathered": c.gathered_tokens,
            "slices": [[s.prior, s.chunk, s.is_decode, s.samples] for s in c.slices],
            "stack_rows": c.stack_rows,
        }
        for c, t in samples
    ]


def samples_from_json(rows: list[dict]) -> list[tuple[StepComposition, float]]:
    """Inverse of ``samples_to_json`` (files written before ``gathered`` existed read it as 0, before
    ``stack_rows`` as ``SMALL_STEP_ROWS``).

    Raises:
        ValueError: a row that is not ``{"seconds", "padded", "slices": [[prior, chunk, is_decode,
            samples], ...]}``, naming its index.
    """
    from segserve.simulator.step_model import RequestSlice

    out = []
    for i, r in enumerate(rows):
        try:
            slices = tuple(RequestSlice(int(a), int(b), bool(c), bool(d)) for a, b, c, d in r["slices"])
            comp = StepComposition(
                slices, int(r["padded"]), int(r.get("gathered", 0)), int(r.get("stack_rows", SMALL_STEP_ROWS))
            )
            out.append((comp, float(r["seconds"])))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"sample row {i} is malformed ({type(e).__name__}: {e}); expected "
                '{"seconds": s, "padded": n, "slices": [[prior, chunk, is_decode, samples], ...]}'
            ) from None
    return out


# ---- segserve profile --quick ------------------------------------------------------------------------
#
# One engine (budget QUICK_BUDGET) and prefix caching make every shape cheap to reach: a base document
# is computed once, and a request whose prompt is ``base[:P] + c fresh tokens`` computes exactly a chunk
# of ``c`` at prior ``P``; ``b`` requests of ``base[:C] + 1 token`` then decode together at context ``C``
# without paying ``b * C`` tokens of prefill. Their decodes read the same shared prefix blocks, which
# stay warmer in the CPU caches than ``b`` distinct contexts would, so the distinct probe adds what a
# served batch looks like: 8 prompts of their own (their prefill is the probe's main cost), decoding
# with staggered lengths so the batch shrinks from 8 to 1, with fresh chunks scheduled beside them
# (mixed steps over distinct decodes, the kind of step a chunked-prefill server runs most under load).
# A reference request timed at the start, middle and end tells whether the machine kept one speed.

QUICK_BUDGET = 512
QUICK_BASE_LEN = 2048
QUICK_CHUNKS = (16, 48, 128, 256, 400, 512)
QUICK_CHUNK_PRIORS = (0, 1024, 2048)
QUICK_DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
QUICK_DECODE_CONTEXTS = (128, 1024, 2048)
QUICK_DECODE_STEPS = 3
# Distinct prompts (3,072 tokens; prefilled together: chunks of mixed sizes); each decodes 2 steps
# longer than the one before, so every batch of 8 .. 1 distinct contexts runs 2 steps.
QUICK_DISTINCT = (160, 224, 288, 352, 416, 480, 544, 608)
# When the distinct batch is down to ``b`` decodes, a prompt ``base[:prior] + chunk fresh tokens``
# arrives: one mixed step of a ``chunk`` at ``prior`` beside ``b`` distinct decodes.
QUICK_DISTINCT_MIXED = ((8, 0, 250), (6, 256, 250), (4, 1024, 128), (2, 0, 400))
QUICK_MIXED = ((2, 700), (32, 700))  # b decodes at shared context 1024 while a fresh prompt arrives
QUICK_REFERENCE = 256  # fresh tokens of the reference request (1 prefill step + 3 decodes)


class _Prober:
    """Runs batches of requests on one engine and keeps (composition, seconds) of every step."""

    def __init__(self, engine, seed: int) -> None:
        import random

        from segserve.simulator.replay import step_composer

        self.engine = engine
        self.rng = random.Random(seed)
        self.vocab = engine.loaded.config.vocab_size
        self.samples: list[tuple[StepComposition, float]] = []
        self._captured: list[StepComposition] = []
        self._ids = 0
        compose = step_composer(engine)
        engine.schedule_observers.append(lambda out: self._captured.append(compose(out)))

    def fresh(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def add(self, prompts: list[list[int]], max_tokens: int) -> list[str]:
        from segserve import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        ids = []
        for p in prompts:
            self._ids += 1
            ids.append(self.engine.add_request(f"p{self._ids}", p, params))
        return ids

    def step(self, keep: bool = True) -> None:
        t = time.perf_counter()
        self.engine.step()
        if keep:
            self.samples.append((self._captured[-1], time.perf_counter() - t))

    def run(self, prompts: list[list[int]], max_tokens: int, keep: bool = True) -> None:
        self.add(prompts, max_tokens)
        while self.engine.has_unfinished_requests():
            self.step(keep)

    def mixed(self, decodes: list[list[int]], late: list[int]) -> None:
        """``decodes`` start decoding, then ``late`` arrives and is chunked beside them; the decodes
        are aborted once it is done."""
        ids = self.add(decodes, max_tokens=10_000)
        reqs = self.engine.scheduler.requests
        while any(reqs[i].is_prefill for i in ids):
            self.step()
        (late_id,) = self.add([late], max_tokens=1)
        while late_id in reqs:
            self.step()
        self.engine.abort_request(ids)

    def distinct(self, prompts: list[list[int]], lates: dict[int, list[int]]) -> None:
        """``prompts`` prefill together, then decode with staggered lengths (request ``i`` makes
        ``len(prompts) + 2 i`` tokens: the first ones decode beside the later ones' chunks and still
        have 2 steps left when all are in); when ``b`` of them are left, ``lates[b]`` (if any) arrives
        for one token."""
        ids = [self.add([p], max_tokens=len(prompts) + 2 * i)[0] for i, p in enumerate(prompts)]
        reqs = self.engine.scheduler.requests
        while any(reqs[i].is_prefill for i in ids if i in reqs):
            self.step()
        pending = dict(lates)
        while self.engine.has_unfinished_requests():
            late = pending.pop(sum(1 for i in ids if i in reqs), None)
            if late is not None:
                self.add([late], max_tokens=1)
            self.step()

    def reference(self) -> float:
        """Seconds of the reference request (fresh tokens each time: the same work, no cache hit)."""
        n = len(self.samples)
        self.run([self.fresh(QUICK_REFERENCE)], max_tokens=1 + QUICK_DECODE_STEPS)
        return sum(t for _, t in self.samples[n:])


def measure_quick(loaded, block_size: int = 16, kv_segment_size: int = 512, log=print, seed: int = 18):
    """The ``--quick`` probes on ``loaded`` (~13k prefill tokens, ~170 steps, about 60 s on 2 idle
    cores with the default model). Returns a ``QuickSamples``."""
    from segserve import LLMEngine
    from segserve.simulator.replay import engine_decodes_gather

    dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")  # the engine's must match
    engine = LLMEngine(
        model=loaded, dtype=dtype, max_num_batched_tokens=QUICK_BUDGET, num_kv_blocks=1200, max_num_seqs=64,
        block_size=block_size, kv_segment_size=kv_segment_size,
    )
    pr = _Prober(engine, seed)
    pr.run([pr.fresh(64)], max_tokens=4, keep=False)  # warm-up: first steps pay one-time allocations
    references = [pr.reference()]
    base = pr.fresh(QUICK_BASE_LEN)
    t = time.perf_counter()
    pr.run([base], max_tokens=1)
    for prior in QUICK_CHUNK_PRIORS:
        for c in QUICK_CHUNKS:
            pr.run([base[:prior] + pr.fresh(c)], max_tokens=1)
    log(f"[profile] chunks: {len(pr.samples)} steps in {time.perf_counter() - t:.1f} s")
    t, n = time.perf_counter(), len(pr.samples)
    for ctx in QUICK_DECODE_CONTEXTS:
        for b in QUICK_DECODE_BATCHES:
            pr.run([base[:ctx] + pr.fresh(1) for _ in range(b)], max_tokens=1 + QUICK_DECODE_STEPS)
    log(f"[profile] shared-context decodes: {len(pr.samples) - n} steps in {time.perf_counter() - t:.1f} s")
    references.append(pr.reference())
    t, n = time.perf_counter(), len(pr.samples)
    lates = {b: base[:prior] + pr.fresh(c) for b, prior, c in QUICK_DISTINCT_MIXED}
    pr.distinct([pr.fresh(length) for length in QUICK_DISTINCT], lates)
    for b, late in QUICK_MIXED:
        pr.mixed([base[:1024] + pr.fresh(1) for _ in range(b)], pr.fresh(late))
    log(f"[profile] distinct and mixed: {len(pr.samples) - n} steps in {time.perf_counter() - t:.1f} s")
    references.append(pr.reference())
    return QuickSamples(pr.samples, engine_decodes_gather(engine), tuple(references))


@dataclass(frozen=True)
class QuickSamples:
    """What ``measure_quick`` measured.

    Attributes:
        samples: (composition, seconds) of every kept step, the reference requests' included.
        decode_gathers: the engine's ``engine_decodes_gather`` (how ``gathered_kv`` was counted).
        reference_seconds: the reference request's time at the start, middle and end, seconds.
    """

    samples: list[tuple[StepComposition, float]]
    decode_gathers: bool
    reference_seconds: tuple[float, ...]


def calibrate_quick(fp, log=print, samples_out: list | None = None):
    """Load ``fp``'s model in its dtype, run ``measure_quick`` with its block and segment sizes, fit;
    warn (``drift.drift_warning``) when the reference request's times disagree by more than 30 %.

    Args:
        samples_out: if given, the measured (composition, seconds) samples are appended to it.

    Returns:
        (the fitted ``LinearStepModel``, fit statistics with ``by_kind`` errors, ``seconds``,
        ``reference_ms`` (start, middle, end) and ``reference_drift`` (max / min - 1)).
    """
    import torch

    from segserve.kernels import cpu as cpu_kernels
    from segserve.models.loader import load_model
    from segserve.simulator.fit import fit_linear
    from segserve.simulator.step_model import ModelShape

    t0, load0 = time.perf_counter(), _load_average()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[fp.dtype]
    loaded = load_model(fp.model, dtype=dtype)
    log(f"[profile] loaded {loaded.name} {fp.dtype} in {time.perf_counter() - t0:.1f} s")
    if cpu_kernels.enabled() != fp.kernels:
        log(f"[profile] warning: the kernels are {'on' if cpu_kernels.enabled() else 'off'}, the fingerprint "
            f"expected {'on' if fp.kernels else 'off'} ({cpu_kernels.unavailable_reason()})")
    measured = measure_quick(loaded, fp.block_size, fp.kv_segment_size, log)
    samples = measured.samples
    if samples_out is not None:
        samples_out.extend(samples)
    shape = ModelShape(**model_shape_of(loaded, dtype_bytes=dtype.itemsize))
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    source = f"segserve profile --quick ({len(samples)} steps, {when}, {fp.cpu_model})"
    fitted, stats = fit_linear(
        samples, model=shape, source=source, decode_gathers=measured.decode_gathers, decode_table=True
    )
    stats["by_kind"] = errors_by_kind(fitted, samples)
    stats["reference_ms"] = [1000 * t for t in measured.reference_seconds]
    stats["reference_drift"] = reference_drift(measured.reference_seconds)
    warning = drift_warning(measured.reference_seconds)
    if warning:
        log(f"[profile] warning: {warning}")
    stats["seconds"] = time.perf_counter() - t0
    stats["load_average"] = [load0, _load_average()]
    if max(stats["load_average"]) > fp.cpu_count:
        log(f"[profile] warning: the machine was busy (1-minute load {load0:.1f} -> {_load_average():.1f} on "
            f"{fp.cpu_count} CPUs): this profile describes it under that load; recalibrate when it is quiet")
    return fitted, stats


def _load_average() -> float:
    import os

    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def errors_by_kind(model, samples: list[tuple[StepComposition, float]]) -> dict[str, dict[str, float]]:
    """Mean signed and mean absolute relative error of ``model`` per kind of step: ``decode b=N``
    (decode-only steps of N requests, to show whether decode cost is linear in the batch), ``prefill``
    (no decode) and ``mixed``."""
    groups: dict[str, list[float]] = {}
    for comp, seconds in samples:
        d = comp.num_decodes
        kind = "prefill" if d == 0 else f"decode b={d}" if d == len(comp.slices) else "mixed"
        groups.setdefault(kind, []).append(model.predict(comp) / seconds - 1)
    return {
        k: {"n": len(v), "mean_rel_err": sum(v) / len(v), "mean_abs_rel_err": sum(map(abs, v)) / len(v)}
        for k, v in sorted(groups.items(), key=lambda kv: _kind_order(kv[0]))
    }


def _kind_order(kind: str) -> tuple[int, int]:
    if kind.startswith("decode b="):
        return (1, int(kind.split("=")[1]))
    return (0 if kind == "prefill" else 2, 0)
