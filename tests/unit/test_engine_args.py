"""``EngineArgs``, the one builder of ``EngineConfig``, and the one pool-sizing rule (torch-free)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from core_helpers import output_without

from segserve.config import AttentionConfig, CacheConfig, EngineConfig, SchedulerConfig, num_kv_blocks_for
from segserve.engine_args import EngineArgs

# SmolLM2-135M in float32: 2 (K, V) x 30 layers x 3 KV heads x 64 dims x 4 bytes.
SMOL_BYTES_PER_TOKEN = 46080
SMOL_BLOCK_BYTES = SMOL_BYTES_PER_TOKEN * 16


# Every field but num_batched_tokens_buckets (no flag) away from its default.
EVERY_FIELD_SET = EngineArgs(
    model="m.gguf",
    dtype="bfloat16",
    quantization="none",
    block_size=8,
    num_kv_blocks=40,
    kv_cache_memory_bytes=512 * 1024**2,
    max_model_len=1000,
    max_num_batched_tokens=64,
    max_num_seqs=5,
    enable_prefix_caching=False,
    long_prefill_token_threshold=32,
    kv_segment_size=1024,
    attention_backend="reference",
    scheduling_policy="prefill_first",
    max_num_partial_prefills=2,
    attention_cost_tokens=3000,
    seed=9,
)


def parse(argv: list[str]) -> EngineArgs:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return EngineArgs.from_cli_args(parser.parse_args(argv))


def test_max_model_len_is_settled_before_the_scheduler_config():
    assert EngineArgs().create_engine_config(2048).scheduler.max_model_len == 2048
    assert EngineArgs(max_model_len=0).create_engine_config(2048).scheduler.max_model_len == 2048
    cfg = EngineArgs(max_model_len=300).create_engine_config(2048)
    assert cfg.scheduler.max_model_len == 300
    assert cfg.max_blocks_per_seq == 19  # ceil(300 / 16)
    # Settled, not replaced later: a model too short for any request is the scheduler's error.
    with pytest.raises(ValueError, match="max_model_len must be >= 2, got 1"):
        EngineArgs().create_engine_config(1)


def test_max_model_len_above_the_model_names_both():
    with pytest.raises(ValueError, match="^max_model_len=4096 exceeds the model's context length 2048$"):
        EngineArgs(max_model_len=4096).create_engine_config(2048)
    assert EngineArgs(max_model_len=2048).create_engine_config(2048).scheduler.max_model_len == 2048


def test_every_field_reaches_its_config():
    args = dataclasses.replace(EVERY_FIELD_SET, num_batched_tokens_buckets=[8, 64])
    assert args.create_engine_config(4096) == EngineConfig(
        cache=CacheConfig(
            block_size=8, num_kv_blocks=40, kv_cache_memory_bytes=512 * 1024**2, enable_prefix_caching=False
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=64,
            max_num_seqs=5,
            max_model_len=1000,
            long_prefill_token_threshold=32,
            policy="prefill_first",
            num_batched_tokens_buckets=(8, 64),
            max_num_partial_prefills=2,
            attention_cost_tokens=3000,
        ),
        attention=AttentionConfig(backend="reference", kv_segment_size=1024),
    )


def test_defaults_are_the_config_classes_defaults():
    assert EngineArgs().create_engine_config(8192) == EngineConfig()
    # An empty bucket list means the default buckets, as the keyword API always took it.
    buckets = EngineArgs(num_batched_tokens_buckets=[]).create_engine_config(8192).scheduler
    assert buckets.num_batched_tokens_buckets == (1, 2, 4, 8, 16, 32, 48, 64, *range(96, 513, 32))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (EngineArgs(kv_segment_size=300), "kv_segment_size must be one of"),
        (EngineArgs(block_size=1024), "kv_segment_size=512 must be a multiple of block_size=1024"),
        (EngineArgs(max_num_partial_prefills=0), "max_num_partial_prefills must be >= 1, got 0"),
        (EngineArgs(max_model_len=1), "max_model_len must be >= 2, got 1"),
        (EngineArgs(attention_backend="flash"), "attention_backend must be 'segmented' or 'reference'"),
        (EngineArgs(scheduling_policy="fifo"), "policy must be one of"),
        (EngineArgs(num_kv_blocks=1), "num_kv_blocks must be >= 2"),
        # A fresh user's trial: LLM(max_num_batched_tokens="auot") raised TypeError "'<' not supported".
        (EngineArgs(max_num_batched_tokens="auot"),
         r"max_num_batched_tokens must be an int \(auto is for `segserve serve`\), got 'auot'"),
        (EngineArgs(max_num_batched_tokens=1.5), "max_num_batched_tokens must be an int .*, got 1.5"),
    ],
)
def test_check_raises_what_the_builder_raises_without_a_model(args, message):
    with pytest.raises(ValueError, match=message):
        args.check()
    with pytest.raises(ValueError, match=message):
        args.create_engine_config(8192)


def test_check_leaves_the_context_length_to_the_model():
    EngineArgs().check()
    EngineArgs(max_model_len=10**9).check()  # no model yet to exceed


def test_pool_is_what_fits_the_memory_plus_the_null_block():
    cfg = EngineArgs(kv_cache_memory_bytes=11 * SMOL_BLOCK_BYTES - 1).create_engine_config(8192)
    assert num_kv_blocks_for(cfg, SMOL_BYTES_PER_TOKEN) == 11
    # The default budget, 2 GiB: 2912 blocks of 737,280 bytes (64 rows of 512 blocks would be 32,768).
    assert num_kv_blocks_for(EngineArgs().create_engine_config(8192), SMOL_BYTES_PER_TOKEN) == 2913


def test_pool_is_capped_at_max_num_seqs_full_length_rows():
    cfg = EngineArgs(max_num_seqs=3, max_model_len=100).create_engine_config(8192)
    assert num_kv_blocks_for(cfg, SMOL_BYTES_PER_TOKEN) == 3 * 7 + 1  # ceil(100 / 16) = 7 blocks a row


def test_pool_given_in_blocks_is_taken_as_is():
    cfg = EngineArgs(num_kv_blocks=7, kv_cache_memory_bytes=1).create_engine_config(8192)
    assert num_kv_blocks_for(cfg, SMOL_BYTES_PER_TOKEN) == 7


def test_pool_below_one_block_names_the_budget_and_the_block():
    cfg = EngineArgs(kv_cache_memory_bytes=SMOL_BLOCK_BYTES - 1).create_engine_config(8192)
    message = r"^kv_cache_memory_bytes=737279 is below one block \(737280 bytes\)$"
    with pytest.raises(ValueError, match=message):
        num_kv_blocks_for(cfg, SMOL_BYTES_PER_TOKEN)


def test_cli_defaults_are_the_keyword_defaults():
    assert parse([]) == EngineArgs()


def test_cli_flags_build_the_config_the_keywords_build():
    flags = parse(
        [
            "--model", "m.gguf", "--dtype", "bfloat16", "--quantization", "none", "--block-size", "8",
            "--num-kv-blocks", "40",
            "--kv-cache-memory", "0.5", "--max-model-len", "1000", "--max-num-batched-tokens", "64",
            "--max-num-seqs", "5", "--no-enable-prefix-caching", "--long-prefill-token-threshold", "32",
            "--kv-segment-size", "1024", "--attention-backend", "reference",
            "--scheduling-policy", "prefill_first", "--max-num-partial-prefills", "2",
            "--attention-cost-tokens", "3000", "--seed", "9",
        ]
    )  # fmt: skip
    keywords = EVERY_FIELD_SET
    # A new field fails here until it has a flag (or is named as one without).
    names = [f.name for f in dataclasses.fields(EngineArgs)]
    left_at_default = [n for n in names if getattr(keywords, n) == getattr(EngineArgs(), n)]
    assert left_at_default == ["num_batched_tokens_buckets"]
    assert flags == keywords
    assert flags.create_engine_config(2048) == keywords.create_engine_config(2048)
    assert flags.create_engine_config(2048).scheduler.max_num_partial_prefills == 2


def test_kv_cache_memory_flag_names_its_unit(capsys):
    with pytest.raises(SystemExit):
        parse(["--kv-cache-memory", "0"])
    assert "--kv-cache-memory: must be a finite number of GiB > 0, got 0" in capsys.readouterr().err


def test_builder_imports_without_torch():
    code = (
        "from segserve.engine_args import EngineArgs\n"
        "print(EngineArgs(dtype='bfloat16').create_engine_config(64).scheduler.max_model_len)"
    )
    assert output_without(("torch",), code) == "64"


def test_quantization_outside_the_choices_is_refused_before_any_model_loads():
    with pytest.raises(ValueError, match=r"quantization must be one of \[None, 'gguf', 'none'\], got 'awq'"):
        EngineArgs(quantization="awq").check()
    with pytest.raises(SystemExit):
        parse(["--quantization", "awq"])
