"""Replay a workload on the real engine, in-process, with arrivals by timestamp (the fidelity check).

Requests are added when the wall clock passes their arrival (``arrival_time`` is the trace time, so
TTFT includes any wait for the step in flight, as a server would see); when the engine is idle the
loop sleeps until the next arrival. Each output token is stamped when ``step()`` returns it. The
result is the simulator's own ``RequestRecord`` list, so both sides go through the same ``summarize``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from segserve.simulator.replica import RequestRecord, composition
from segserve.simulator.step_model import SMALL_STEP_ROWS, StepComposition
from segserve.simulator.workload import TraceRequest, prompt_token_ids

if TYPE_CHECKING:
    from segserve.core.scheduler_output import SchedulerOutput


def engine_decodes_gather(engine) -> bool:
    """Whether ``engine``'s decode attention gathers KV out of non-consecutive blocks (the eager
    segmented kernel) rather than reading it in place (the compiled CPU kernels): how the samples it
    yields count ``gathered_kv``."""
    from segserve.kernels import cpu as cpu_kernels

    cache = engine.runner.kv_caches[0]
    return not (cpu_kernels.enabled() and cpu_kernels.supports_cache(cache, cache.dtype))


def engine_chunks_gather(engine) -> bool:
    """Whether ``engine``'s chunks (query length > 1) gather their prior blocks (the SDPA chunk path)
    rather than the compiled chunk kernel reading them in place (it takes bfloat16 and float32 caches
    of the head shapes ``chunk_attention.supports`` names, unless switched off): how the samples it
    yields count ``gathered_kv``."""
    import torch

    from segserve.kernels import chunk_attention
    from segserve.kernels import cpu as cpu_kernels

    cache = engine.runner.kv_caches[0]
    heads = engine.loaded.config.num_attention_heads
    q = torch.empty(1, heads, cache.shape[4], dtype=cache.dtype)  # one query row: only its shape is read
    return not (cpu_kernels.enabled() and chunk_attention.supports(q, cache))


def engine_stack_rows(engine) -> int:
    """``StepComposition.stack_rows`` for ``engine``: the rows up to which its decode-only steps run
    the one-call compiled stack (``CpuStep.decode_stack_rows``), at least ``SMALL_STEP_ROWS``; just
    that when the compiled kernels are off (then the step-size edge is the eager forward's)."""
    from segserve.kernels import cpu as cpu_kernels

    if not cpu_kernels.enabled():
        return SMALL_STEP_ROWS
    return max(SMALL_STEP_ROWS, engine.runner.cpu_step.decode_stack_rows())


def step_composer(engine) -> Callable[[SchedulerOutput], StepComposition]:
    """``composition`` of each of ``engine``'s steps, read after ``schedule()`` (a schedule observer's
    body), with how its kernels gather and stack (:func:`engine_decodes_gather`,
    :func:`engine_stack_rows`, :func:`engine_chunks_gather`) asked once, here."""
    gathers, stack_rows, chunk_gathers = (
        engine_decodes_gather(engine), engine_stack_rows(engine), engine_chunks_gather(engine)
    )
    return lambda out: composition(engine.scheduler, out, gathers, stack_rows, chunk_gathers)


def replay(
    engine, requests: list[TraceRequest], log=None
) -> tuple[list[RequestRecord], list[tuple[StepComposition, float]]]:
    """Run ``requests`` on ``engine`` (an ``LLMEngine``) in real time.

    Returns:
        (one record per request in order, each step's composition and wall duration in seconds; the
        latter are calibration samples for ``fit_linear``, like ``segserve profile``'s).
    """
    from segserve import SamplingParams

    vocab = engine.loaded.config.vocab_size
    prompts = [prompt_token_ids(r, i, vocab) for i, r in enumerate(requests)]
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    records = [RequestRecord(f"r{i}", r.arrival, r.input_len, r.output_len) for i, r in enumerate(requests)]
    seen: dict[str, int] = {}
    step_times: list[float] = []
    compositions: list[StepComposition] = []

    compose = step_composer(engine)

    def observe(out) -> None:
        compositions.append(compose(out))

    engine.schedule_observers.append(observe)
    t0, pos = time.monotonic(), 0
    while pos < len(order) or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while pos < len(order) and requests[order[pos]].arrival <= now:
            i = order[pos]
            params = SamplingParams(temperature=0.0, max_tokens=requests[i].output_len, ignore_eos=True)
            engine.add_request(f"r{i}", prompts[i], params, arrival_time=t0 + requests[i].arrival)
            pos += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, requests[order[pos]].arrival - now))
            continue
        start = time.monotonic()
        outs = engine.step()
        end = time.monotonic()
        step_times.append(end - start)
        for out in outs:
            rec = records[int(out.request_id[1:])]
            n = len(out.outputs[0].token_ids)
            rec.token_times.extend([end - t0] * (n - seen.get(out.request_id, 0)))
            seen[out.request_id] = n
            rec.num_cached_tokens = out.num_cached_tokens
            rec.finish_reason = out.outputs[0].finish_reason
        if log and len(step_times) % 200 == 0:
            log(f"[replay] {len(step_times)} steps, {pos}/{len(order)} arrived, t={end - t0:.1f} s")
    engine.schedule_observers.remove(observe)
    return records, list(zip(compositions, step_times, strict=True))
