"""Drive the real scheduler without a model: a fake runner that samples a fixed token when due."""

from __future__ import annotations

from segserve.config import AttentionConfig, CacheConfig, EngineConfig, SchedulerConfig
from segserve.core.request import Request
from segserve.core.scheduler import Scheduler
from segserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from segserve.sampling_params import SamplingParams


def make_scheduler(
    num_blocks: int,
    block_size: int = 16,
    budget: int = 1024,
    max_model_len: int = 4096,
    prefix_caching: bool = True,
    segment: int = 512,
    **sched_kwargs,
) -> Scheduler:
    config = EngineConfig(
        cache=CacheConfig(
            block_size=block_size, num_kv_blocks=num_blocks, enable_prefix_caching=prefix_caching
        ),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_model_len=max_model_len, **sched_kwargs),
        attention=AttentionConfig(kv_segment_size=segment),
    )
    return Scheduler(config, num_blocks)


def make_request(rid: str, tokens: list[int], max_tokens: int = 4, **params) -> Request:
    return Request(
        rid, tokens, SamplingParams(temperature=0.0, max_tokens=max_tokens, **params), eos_token_id=None
    )


def fake_runner_output(scheduler: Scheduler, out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """Sample ``token`` for every request whose scheduled tokens reach its last token."""
    sampled = {}
    for rid in out.num_scheduled_tokens:
        req = scheduler.requests[rid]
        if req.num_computed_tokens >= req.num_tokens:  # already advanced by schedule()
            sampled[rid] = [token]
    return ModelRunnerOutput(sampled_token_ids=sampled)


def step(scheduler: Scheduler, token: int = 7) -> SchedulerOutput:
    """One schedule + update, with ``check_integrity()`` after each half."""
    out = scheduler.schedule()
    scheduler.check_integrity(out)
    scheduler.update_from_output(out, fake_runner_output(scheduler, out, token))
    scheduler.check_integrity(out)
    return out


def output_without(blocked: tuple[str, ...], code: str) -> str:
    """Stdout of ``code`` run in a fresh interpreter where importing any of ``blocked`` fails (a module
    meant to stay torch-free must import and work there); stderr in the assertion message."""
    import subprocess
    import sys

    prelude = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
    result = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()
