"""Small builders shared by the simulator tests."""

from __future__ import annotations

from segserve.config import AttentionConfig, CacheConfig, EngineConfig, SchedulerConfig
from segserve.simulator.step_model import LinearStepModel

ONE_SECOND_STEPS = LinearStepModel({"step": 1.0})


def config(
    budget: int = 64,
    block_size: int = 4,
    num_blocks: int = 64,
    max_model_len: int = 256,
    prefix_caching: bool = True,
    **sched,
) -> EngineConfig:
    return EngineConfig(
        cache=CacheConfig(
            block_size=block_size, num_kv_blocks=num_blocks, enable_prefix_caching=prefix_caching
        ),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_model_len=max_model_len, **sched),
        attention=AttentionConfig(kv_segment_size=512),
    )
