"""The engine on the real SmolLM2, float32 greedy, against transformers on the same GGUF weights:
same token ids under every chunking budget, prefix-cache state, batch mix and preemption."""

from __future__ import annotations

import contextlib

import pytest
import torch

from segserve import LLMEngine, SamplingParams
from segserve.entrypoints.cli import default_document
from segserve.kernels import cpu as cpu_kernels

from .conftest import NUM_TOKENS, finish_all, requires_model

pytestmark = [pytest.mark.slow, requires_model]

GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=20)
SEEDED = SamplingParams(
    temperature=0.8, top_p=0.95, top_k=50, seed=1234, max_tokens=NUM_TOKENS, ignore_eos=True
)
# Max |logprob difference| of the first token's top-20 vs transformers (log-softmax of fp32 logits).
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def prompts(smollm) -> list[list[int]]:
    tok = smollm.tokenizer
    doc = default_document()
    chat = tok.apply_chat_template(
        [{"role": "user", "content": f"{doc}\n\nWhat does this license say about patents?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    texts = [
        "The capital of France is",
        "def fibonacci(n):\n    ",
        doc[:1800],
        "Chunked prefill splits a long prompt into pieces so that decodes keep flowing.",
    ]
    ids = [tok.encode(t) for t in texts] + [tok.encode(chat, add_special_tokens=False)]
    assert len(ids[-1]) > 2000 and len(ids[2]) > 300
    return ids


def engine(smollm, **kwargs) -> LLMEngine:
    kwargs.setdefault("num_kv_blocks", 1024)
    return LLMEngine(model=smollm, **kwargs)


def run_all(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> dict[str, list]:
    """Add all prompts at once, step to completion with integrity checks; request id -> output."""
    for i, p in enumerate(prompts):
        eng.add_request(f"p{i}", p, params)
    outs = {}
    steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                outs[out.request_id] = out
        eng.check_integrity()
        steps += 1
    assert eng.scheduler.kv_cache_manager.pool.num_free_blocks == eng.num_kv_blocks - 1
    return {rid: outs[rid] for rid in sorted(outs)}


def assert_matches_hf(outs, prompts, hf_greedy) -> None:
    for i, p in enumerate(prompts):
        ref_ids, ref_logits = hf_greedy(p)
        got = outs[f"p{i}"].outputs[0]
        assert got.token_ids == ref_ids, f"prompt {i} ({len(p)} tokens)"
        ref_logprobs = torch.log_softmax(ref_logits, dim=-1)
        first = got.logprobs[0]
        assert len(first) >= 20
        diffs = [abs(lp - ref_logprobs[t].item()) for t, lp in first.items()]
        assert max(diffs) < LOGPROB_TOL, f"prompt {i}: logprob diff {max(diffs):.2e}"


@pytest.mark.parametrize(
    "settings",
    [
        dict(),  # default: budget 512, segmented attention
        dict(max_num_batched_tokens=4096),  # chunking off: every prompt in one step
        # Small and odd, unaligned chunks, and the reference attention: the 2,000-token chat prompt is
        # left out (~35 more 64-token steps, ~120 more 17-token ones, a pure-PyTorch attention over it)
        # for nothing the 356-token document prompt does not already cross: chunk boundaries inside
        # blocks, priors over several blocks. Long priors over several segments: default, seg1024, eager.
        dict(max_num_batched_tokens=64, num_prompts=4),
        dict(max_num_batched_tokens=17, num_batched_tokens_buckets=(17,), num_prompts=4),
        dict(attention_backend="reference", max_num_batched_tokens=256, num_prompts=4),
        dict(kv_segment_size=1024, block_size=64, max_num_batched_tokens=300),
        dict(eager=True),  # the compiled CPU kernels switched off: PyTorch ops only
    ],
    ids=["default", "unchunked", "budget64", "budget17", "reference", "seg1024-bs64", "eager"],
)
def test_greedy_matches_transformers(smollm, prompts, hf_greedy, settings):
    settings = dict(settings)
    prompts = prompts[: settings.pop("num_prompts", len(prompts))]
    with cpu_kernels.disabled() if settings.pop("eager", False) else contextlib.nullcontext():
        outs = run_all(engine(smollm, **settings), prompts)
    assert_matches_hf(outs, prompts, hf_greedy)


def test_warm_prefix_cache_run_equals_cold_run(smollm, prompts, hf_greedy):
    eng = engine(smollm)
    cold = run_all(eng, prompts)
    warm = run_all(eng, prompts)
    for rid in cold:
        assert warm[rid].outputs[0].token_ids == cold[rid].outputs[0].token_ids
        assert cold[rid].num_cached_tokens == 0
    assert warm["p4"].num_cached_tokens >= len(prompts[4]) - 16
    assert_matches_hf(warm, prompts, hf_greedy)


def test_one_step_mixes_full_hit_partial_hit_miss_and_decodes(smollm, prompts, hf_greedy):
    eng = engine(smollm, max_num_batched_tokens=4096)
    doc_prompt, short = prompts[4], prompts[0]
    run_all(eng, [doc_prompt])  # cache the long document prompt
    eng.add_request("decoding", prompts[1], GREEDY)
    eng.step()  # its prefill; it decodes from now on
    partial = doc_prompt[:1000] + prompts[3]
    eng.add_request("full", doc_prompt, GREEDY)
    eng.add_request("partial", partial, GREEDY)
    eng.add_request("miss", short, GREEDY)
    seen = []
    eng.schedule_observers.append(seen.append)
    outs = finish_all(eng)
    mixed = seen[0]
    assert mixed.num_scheduled_tokens["decoding"] == 1
    computed = {r.req_id: r.num_computed_tokens for r in mixed.scheduled_new_reqs}
    block = eng.config.cache.block_size
    assert computed == {
        "full": (len(doc_prompt) - 1) // block * block,
        "partial": 1000 // block * block,
        "miss": 0,
    }
    expected = {"full": doc_prompt, "partial": partial, "miss": short, "decoding": prompts[1]}
    for rid, p in expected.items():
        assert outs[rid].outputs[0].token_ids == hf_greedy(p)[0], rid


def test_preemption_on_a_small_pool_keeps_greedy_output(smollm, prompts, hf_greedy):
    # 3 x 300-token prompts (~19 blocks each) + 12 tokens on a pool of 45 usable blocks of 16.
    doc_ids = prompts[2]
    trio = [doc_ids[:300], doc_ids[100:400], doc_ids[200:500]]
    eng = engine(smollm, num_kv_blocks=46, max_num_batched_tokens=512, enable_prefix_caching=False)
    outs = run_all(eng, trio)
    assert eng.scheduler.make_stats().num_preemptions >= 1
    for i, p in enumerate(trio):
        assert outs[f"p{i}"].outputs[0].token_ids == hf_greedy(p)[0]


def test_seeded_sampling_is_the_same_across_chunking_caching_and_batching(smollm, prompts):
    subset = [prompts[0], prompts[2], prompts[3]]
    base = run_all(engine(smollm), subset, SEEDED)
    variants = [
        dict(max_num_batched_tokens=17, num_batched_tokens_buckets=(17,)),
        dict(max_num_batched_tokens=4096, attention_backend="reference"),
        dict(num_kv_blocks=40, enable_prefix_caching=False),  # forces preemption
    ]
    for settings in variants:
        outs = run_all(engine(smollm, **settings), subset, SEEDED)
        for rid in base:
            assert outs[rid].outputs[0].token_ids == base[rid].outputs[0].token_ids, settings
    alone = run_all(engine(smollm), [subset[1]], SEEDED)
    assert alone["p0"].outputs[0].token_ids == base["p1"].outputs[0].token_ids
    # and sampling is not greedy in disguise
    greedy = run_all(engine(smollm), subset, GREEDY)
    assert any(greedy[r].outputs[0].token_ids != base[r].outputs[0].token_ids for r in base)
