"""The real engine, replaying a workload, makes the simulator's scheduling decisions step for step
(a tiny random model, so no downloads and a few seconds)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from segserve.simulator.cluster import simulate  # noqa: E402
from segserve.simulator.metrics import summarize  # noqa: E402
from segserve.simulator.replay import replay  # noqa: E402
from segserve.simulator.workload import TraceRequest  # noqa: E402
from tests.model_fixtures import save_tiny_hf_dir, tiny_hf_model, train_tiny_tokenizer  # noqa: E402
from tests.simulator.helpers import ONE_SECOND_STEPS  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_hf_dir(path, tiny_hf_model("llama"), train_tiny_tokenizer())
    return str(path)


def _shape(c):
    return (c.num_tokens, c.padded_tokens, c.num_decodes, c.num_prefill_tokens, len(c.slices))


@pytest.mark.parametrize("policy", ["decode_first", "prefill_first"])
def test_real_engine_steps_match_the_simulation(tiny_dir, policy):
    from segserve import LLMEngine

    engine = LLMEngine(
        tiny_dir, max_num_batched_tokens=32, num_kv_blocks=40, max_model_len=128, scheduling_policy=policy
    )
    reqs = [
        TraceRequest(0.0, 50, 5),
        TraceRequest(0.0, 30, 8),
        TraceRequest(0.0, 70, 3),
        TraceRequest(0.0, 9, 6),
    ]
    records, samples = replay(engine, reqs)
    sim = simulate(reqs, engine.config, engine.num_kv_blocks, ONE_SECOND_STEPS, check=True)
    simulated = [
        (s.num_tokens, s.padded_tokens, s.num_decodes, s.num_prefill_tokens, s.num_requests)
        for s in sim.steps
    ]
    assert [_shape(c) for c, _ in samples] == simulated
    assert all(t > 0 for _, t in samples)
    assert [len(r.token_times) for r in records] == [5, 8, 3, 6]
    real = summarize(records)
    assert real["completed"] == 4 and real["total_output_tokens"] == 22
    engine.check_integrity()
