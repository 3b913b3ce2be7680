"""One simulated engine: segserve's real ``Scheduler`` stepped on a virtual clock.

Each ``step()`` does what ``LLMEngine.step()`` does, with the model replaced by a step-time model:
``schedule()``, predict the step's duration from its composition, advance the clock, sample a fixed
token for every request whose scheduled tokens reach its last token (the runner's rule), then
``update_from_output()``. Token times are the end of the step that sampled them, as in the engine,
whose output processor stamps tokens after the model ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from segserve.attention.plan import gathered_tokens
from segserve.config import EngineConfig
from segserve.core.request import Request, is_decode
from segserve.core.scheduler import Scheduler
from segserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from segserve.sampling_params import SamplingParams
from segserve.simulator.step_model import SMALL_STEP_ROWS, RequestSlice, StepComposition, StepTimeModel
from segserve.simulator.workload import TraceRequest, prompt_token_ids

FAKE_TOKEN = 7


@dataclass
class RequestRecord:
    """Timeline of one request, seconds on the simulation clock.

    Attributes:
        req_id: id given to the scheduler.
        arrival: arrival time.
        input_len, output_len: prompt tokens and tokens asked for.
        token_times: end time of the step that produced each output token.
        first_scheduled: start of the first step that computed part of it.
        num_cached_tokens: prompt tokens served from the prefix cache.
        num_preemptions: times it was preempted.
        replica: which replica served it.
        error: why it was rejected (None when it was accepted).
        finish_reason: the scheduler's finish reason once finished (``"length"`` also when
            ``max_model_len`` cut the output short).
    """

    req_id: str
    arrival: float
    input_len: int
    output_len: int
    token_times: list[float] = field(default_factory=list)
    first_scheduled: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    replica: int = 0
    error: str | None = None
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.error is None and (
            self.finish_reason is not None or len(self.token_times) >= self.output_len
        )


@dataclass(frozen=True)
class StepRecord:
    """One simulated step: start time and duration (seconds) and what it computed."""

    replica: int
    start: float
    duration: float
    num_tokens: int
    padded_tokens: int
    num_decodes: int
    num_prefill_tokens: int
    num_requests: int
    num_running: int
    num_waiting: int
    kv_usage: float
    num_preempted: int


def composition(
    scheduler: Scheduler,
    out: SchedulerOutput,
    decodes_gather: bool = True,
    stack_rows: int = SMALL_STEP_ROWS,
    chunks_gather: bool = True,
) -> StepComposition:
    """The step's composition, read after ``schedule()``: each request's prior from ``out``, its
    lengths from the scheduler (tokens are appended only after the step); ``decodes_gather`` and
    ``chunks_gather`` as in :func:`segmented_gather_tokens`; ``stack_rows`` as in ``StepComposition``."""
    slices = []
    priors = out.num_prior_tokens()
    for rid, n in out.num_scheduled_tokens.items():
        req = scheduler.requests[rid]
        prior = priors[rid]
        slices.append(
            RequestSlice(
                prior, n, is_decode(prior, req.num_prompt_tokens, req.num_tokens), prior + n >= req.num_tokens
            )
        )
    held = scheduler.kv_cache_manager.req_to_blocks
    rows = [_BlockIds(held.get(rid, [])) for rid in out.num_scheduled_tokens]
    gathered = segmented_gather_tokens(
        slices, rows, scheduler.block_size, scheduler.config.attention.kv_segment_size, decodes_gather,
        chunks_gather,
    )
    return StepComposition(tuple(slices), out.total_num_scheduled_tokens_padded, gathered, stack_rows)


class _BlockIds(Sequence[int]):
    """A request's block ids, read from its block objects only where sliced (a step's rows are
    mostly never looked at: the plan's in-place check stops at the first break)."""

    def __init__(self, blocks: list) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [b.block_id for b in self.blocks[index]]
        return self.blocks[index].block_id


def segmented_gather_tokens(
    slices: Sequence[RequestSlice],
    block_rows: Sequence[Sequence[int]],
    block_size: int,
    seg: int,
    decodes_gather: bool = True,
    chunks_gather: bool = True,
) -> int:
    """Cached tokens the segmented attention kernel copies per layer in a step with these slices:
    the kernel's own plan (``segserve.attention.plan.gathered_tokens``) over the real block ids, so
    the step-time model can charge the copies.

    Args:
        slices: the step's requests in scheduling order.
        block_rows: each request's block ids (after this step's allocation), same order.
        block_size: tokens per block; seg: ``kv_segment_size`` in tokens.
        decodes_gather: False for an engine with the compiled CPU kernels, whose decode attention reads
            every block in place (only chunks gather then).
        chunks_gather: False for an engine whose chunks the compiled chunk kernel takes (it reads their
            priors in place too): ``segserve.simulator.replay.engine_chunks_gather``.

    Returns:
        Gathered tokens (whole blocks) per layer that attends the step's chunks as chunks: every layer,
        but the last of a many-row step on the compiled kernels, which attends only its sampled rows and
        as decodes (``segserve.worker.cpu_step.last_layer_rows``), copies nothing. The step-time model's
        coefficient for these tokens is fitted on real steps, so it absorbs that layer.
    """
    return gathered_tokens(
        [s.chunk for s in slices], [s.prior for s in slices], block_rows, block_size, seg, decodes_gather,
        chunks_gather=chunks_gather,
    )


def fake_runner_output(scheduler: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
    """``FAKE_TOKEN`` for each request whose scheduled tokens reach its last token, none otherwise."""
    sampled = {}
    priors = out.num_prior_tokens()
    for rid, n in out.num_scheduled_tokens.items():
        if priors[rid] + n >= scheduler.requests[rid].num_tokens:
            sampled[rid] = [FAKE_TOKEN]
    return ModelRunnerOutput(sampled_token_ids=sampled)


class Replica:
    """A scheduler, a KV pool and a clock.

    Args:
        config: the engine configuration to simulate.
        num_kv_blocks: KV blocks including the null block.
        step_model: predicts each step's duration.
        index: replica number (for records).
        check: run ``check_integrity()`` after every step (slow; tests).
    """

    def __init__(
        self,
        config: EngineConfig,
        num_kv_blocks: int,
        step_model: StepTimeModel,
        index: int = 0,
        check: bool = False,
    ) -> None:
        self.scheduler = Scheduler(config, num_kv_blocks)
        self.model = step_model
        self.index = index
        self.check = check
        self.clock = 0.0
        self.records: dict[str, RequestRecord] = {}
        self.steps: list[StepRecord] = []
        self.outputs_log: list[SchedulerOutput] = []
        # Records of the requests that finished in the last step (the disaggregated mode hands them on).
        self.just_finished: list[RequestRecord] = []
        self.keep_outputs = False

    @property
    def busy(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def load(self) -> int:
        """Tokens still to compute or generate over its requests (the least-loaded router's measure)."""
        return sum(
            r.num_prompt_tokens + r.sampling_params.max_tokens - r.num_computed_tokens
            for r in self.scheduler.requests.values()
        )

    def add(
        self, req: TraceRequest, index: int, now: float, token_ids: list[int] | None = None
    ) -> RequestRecord:
        """Queue a trace request arriving at ``now``; a request that can never fit is recorded with
        its error instead of raising."""
        rid = f"r{index}"
        rec = RequestRecord(rid, req.arrival, req.input_len, req.output_len, replica=self.index)
        params = SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=True)
        ids = token_ids if token_ids is not None else prompt_token_ids(req, index)
        idle = not self.busy
        try:
            self.scheduler.add_request(Request(rid, ids, params, eos_token_id=None, arrival_time=now))
        except ValueError as exc:
            rec.error = str(exc)
            return rec
        if idle:  # a busy replica picks the request up at its next step
            self.clock = max(self.clock, now)
        self.records[rid] = rec
        return rec

    def step(self) -> StepRecord:
        """Run one step from ``self.clock``. Raises RuntimeError when requests wait but nothing can run."""
        sched = self.scheduler
        out = sched.schedule()
        if out.is_empty:
            raise RuntimeError(
                f"replica {self.index}: {sched.get_num_unfinished_requests()} requests "
                "unfinished but the scheduler scheduled nothing (KV pool too small?)"
            )
        comp = composition(
            sched, out, getattr(self.model, "decode_gathers", True),
            getattr(self.model, "decode_stack_rows", SMALL_STEP_ROWS),
        )
        start, duration = self.clock, self.model.predict(comp)
        self.clock += duration
        for rid in out.num_scheduled_tokens:
            rec = self.records[rid]
            if rec.first_scheduled is None:
                rec.first_scheduled = start
        stats = sched.make_stats()
        rec_step = StepRecord(
            self.index,
            start,
            duration,
            comp.num_tokens,
            comp.padded_tokens,
            comp.num_decodes,
            comp.num_prefill_tokens,
            len(comp.slices),
            stats.num_running,
            stats.num_waiting,
            stats.kv_cache_usage,
            len(out.preempted_req_ids),
        )
        for rid in out.preempted_req_ids:
            self.records[rid].num_preemptions += 1
        self.just_finished = []
        for o in sched.update_from_output(out, fake_runner_output(sched, out)):
            rec = self.records[o.req_id]
            rec.token_times.extend([self.clock] * len(o.new_token_ids))
            rec.num_cached_tokens = o.num_cached_tokens
            if o.finish_reason is not None:
                rec.finish_reason = o.finish_reason
                self.just_finished.append(rec)
        if self.check:
            sched.check_integrity()
        if self.keep_outputs:
            self.outputs_log.append(out)
        self.steps.append(rec_step)
        return rec_step
