"""Replay a workload on the real engine, in-process, with arrivals by timestamp (the fidelity check).

Requests are added when the wall clock passes their arrival (``arrival_time`` is the trace time, so
TTFT includes any wait for the step in flight, as a server would see); when the engine is idle the
loop sleeps until the next arrival. Each output token is stamped when ``step()`` returns it. The
result is the simulator's own ``RequestRecord`` list, so both sides go through the same ``summarize``.
"""

from __future__ import annotations

import time

from segserve.simulator.replica import RequestRecord, composition
from segserve.simulator.step_model import SMALL_STEP_ROWS, StepComposition
from segserve.simulator.workload import TraceRequest, prompt_token_ids


def engine_decodes_gather(engine) -> bool:
    """Whether ``engine``'s decode attention gathers KV out of non-consecutive blocks (the eager
    segmented kernel) rather than reading it in place (the compiled CPU kernels): how the samples it
    yields count ``gathered_kv``."""
    from segserve.kernels import cpu as cpu_kernels

    cache = engine.runner.kv_caches[0]
    return not (cpu_kernels.enabled() and cpu_kernels.supports_cache(cache, cache.dtype))


def engine_stack_rows(engine) -> int:
    """``StepComposition.stack_rows`` for ``engine``: the rows up to which its decode-only steps run
    the one-call compiled stack (``CpuStep.decode_stack_rows``), at least ``SMALL_STEP_ROWS``; just
    that when the compiled kernels are off (then the step-size edge is the eager forward's)."""
    from segserve.kernels import cpu as cpu_kernels

    if not cpu_kernels.enabled():
        return SMALL_STEP_ROWS
    return max(SMALL_STEP_ROWS, engine.runner.cpu_step.decode_stack_rows())


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

    gathers, stack_rows = engine_decodes_gather(engine), engine_stack_rows(engine)

    def observe(out) -> None:
        compositions.append(composition(engine.scheduler, out, gathers, stack_rows))

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
