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


@pytest.mark.parametrize(
    ("compiled", "chunk_kernel"), [(False, False), (True, False), (True, True)],
    ids=["eager", "compiled-kernels-sdpa-chunks", "compiled-kernels"],
)
def test_gathered_kv_tokens_match_the_kernels_copies(tiny_dir, monkeypatch, compiled, chunk_kernel):
    # The simulator's model of the segmented kernel's gathers (``segmented_gather_tokens``) must
    # count exactly the tokens the kernel copies, step by step, on a real replay whose concurrent
    # requests interleave their blocks. The compiled CPU kernels read decode KV in place: only the
    # chunks' prior blocks are copied then, and not in the last layer of a many-row step, which attends
    # only its sampled rows, as decodes (``cpu_step.last_layer_rows``); with the compiled chunk kernel
    # (float32 caches too) the chunks read in place as well, and nothing is copied.
    import torch

    from segserve import LLMEngine
    from segserve.attention import segmented
    from segserve.kernels import chunk_attention
    from segserve.kernels import cpu as cpu_kernels
    from segserve.simulator.replay import engine_chunks_gather, engine_decodes_gather
    from segserve.worker import cpu_step

    if compiled and not cpu_kernels.enabled():
        pytest.skip(f"compiled kernels unavailable: {cpu_kernels.unavailable_reason()}")
    if chunk_kernel and not chunk_attention.available(torch.float32):
        pytest.skip("the float32 chunk kernel is unavailable")
    monkeypatch.setattr(cpu_kernels._switch, "on", compiled)  # restored after the test
    monkeypatch.setattr(chunk_attention._switch, "on", chunk_kernel)

    copied: list[int] = []
    original = segmented.SegmentedAttentionBackend._copy_blocks

    def spy(self, kv_cache, kv_block_ids):  # every call copies: count its tokens
        copied.append(kv_block_ids.shape[0] // 2 * kv_cache.shape[2])
        return original(self, kv_cache, kv_block_ids)

    monkeypatch.setattr(segmented.SegmentedAttentionBackend, "_copy_blocks", spy)
    pruned: list[int] = []  # the steps (1-based) whose last layer ran for its sampled rows alone
    last_layer_rows = cpu_step.last_layer_rows

    def spy_rows(*args):
        pruned.append(len(per_step))
        return last_layer_rows(*args)

    monkeypatch.setattr(cpu_step, "last_layer_rows", spy_rows)
    engine = LLMEngine(tiny_dir, max_num_batched_tokens=24, block_size=4,
                       num_kv_blocks=120, max_model_len=128)
    per_step: list[int] = []
    engine.schedule_observers.append(lambda out: per_step.append(len(copied)))
    # The 100-token prompt is chunked over several steps while the others decode, so the prior blocks
    # of its later chunks interleave with theirs (a chunk gather), as do the decodes' own blocks.
    reqs = [TraceRequest(0.0, 40, 9), TraceRequest(0.0, 21, 12), TraceRequest(0.0, 100, 7),
            TraceRequest(0.0, 5, 10)]
    assert engine_decodes_gather(engine) is not compiled
    assert engine_chunks_gather(engine) is not chunk_kernel
    _, samples = replay(engine, reqs)
    layers = engine.loaded.config.num_hidden_layers
    marks = [*per_step, len(copied)]
    # layers that attended the step's chunks as chunks: all, or all but a pruned last one
    attending = [layers - pruned.count(i + 1) for i in range(len(samples))]
    real = [sum(copied[marks[i] : marks[i + 1]]) for i in range(len(samples))]
    assert [c.gathered_tokens * n for (c, _), n in zip(samples, attending, strict=True)] == real
    assert (sum(real) > 0) is not chunk_kernel  # the case does exercise gathers, where chunks gather
    assert (len(pruned) > 0) is compiled  # and, with the kernels, pruned last layers


def test_segmented_gather_tokens_reads_each_slice_as_the_plan_does():
    # The simulator charges ``segserve.attention.plan.gathered_tokens`` (exact cases in
    # tests/unit/test_plan.py); this pins how a slice's prior and chunk feed it.
    from segserve.simulator.replica import segmented_gather_tokens
    from segserve.simulator.step_model import RequestSlice

    chunk = RequestSlice(48, 16, False, False)  # prior 48: 3 blocks of 16, the second out of order
    assert segmented_gather_tokens([chunk], [[3, 8, 5, 6]], 16, 512) == 48
    decodes = [RequestSlice(40, 1, True, True), RequestSlice(19, 1, True, True)]
    assert segmented_gather_tokens(decodes, [[1, 3, 9], [2, 4]], 16, 32) == 64
    assert segmented_gather_tokens(decodes, [[1, 3, 9], [2, 4]], 16, 32, decodes_gather=False) == 0
    assert segmented_gather_tokens([chunk], [[3, 8, 5, 6]], 16, 512, decodes_gather=False) == 48
    assert segmented_gather_tokens([chunk], [[3, 8, 5, 6]], 16, 512, chunks_gather=False) == 0
