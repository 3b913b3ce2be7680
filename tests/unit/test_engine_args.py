"""``EngineArgs``, the one builder of ``EngineConfig``, and the one pool-sizing rule (torch-free)."""

from __future__ import annotations

import argparse
import dataclasses
import re

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
    assert buckets.num_batched_tokens_buckets == (1, 2, 4, 8, 16, 32, 48, 64, *range(65, 513))
    # The padding of one count under them, as the automatic budget's search takes it.
    from segserve.config import default_padded_tokens, default_token_buckets

    counts = (1, 2, 3, 17, 32, 33, 48, 49, 64, 65, 300, 4096)
    assert [default_padded_tokens(n) for n in counts] == [1, 2, 4, 32, 32, 48, 48, 64, 64, 65, 300, 4096]
    assert all(default_padded_tokens(n) == default_token_buckets(n)[-1] for n in range(1, 200))


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


@pytest.mark.parametrize(("text", "value"), [
    ("4096", 4096), ("4k", 4000), ("4K", 4096), ("2.5k", 2500), ("1m", 10**6), ("1M", 2**20), ("1G", 2**30),
    ("1g", 10**9), ("2Gi", 2 * 2**30), ("2gi", 2 * 2**30)])
def test_counts_take_vllms_human_readable_forms(text, value):
    # vLLM's human_readable_int: lower-case suffixes decimal, upper-case binary (plus our "Gi" forms).
    from segserve.engine_args import human_int

    assert human_int(text) == value


@pytest.mark.parametrize(("text", "message"), [
    ("1.5K", "decimals are not allowed with the binary suffix K in '1.5K'; did you mean 1.5k?"),
    ("1.5", "a count without a unit must be whole, got '1.5'"), ("lots", "expected an integer such as 4000")])
def test_a_count_in_no_such_form_is_refused_naming_it(text, message):
    from segserve.engine_args import human_int

    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
        human_int(text)


def test_max_model_len_and_the_budget_take_vllms_forms(capsys):
    assert parse(["--max-model-len", "1k", "--max-num-batched-tokens", "2K"]) == EngineArgs(
        max_model_len=1000, max_num_batched_tokens=2048)
    assert parse(["--max-model-len", "auto"]).max_model_len == -1
    assert parse(["--max-model-len", "-1"]).max_model_len == -1
    # -1: the model's length (lowered to the cache by the engine), as None.
    assert EngineArgs(max_model_len=-1).create_engine_config(2048).scheduler.max_model_len == 2048
    EngineArgs(max_model_len=-1).check()
    for bad in ("0", "1", "-2", "auot"):
        with pytest.raises(SystemExit):
            parse(["--max-model-len", bad])
        err = capsys.readouterr().err
        want = f"--max-model-len: must be an integer >= 2, -1 or 'auto' (as 8192, 8k or 8K), got '{bad}'"
        assert want in err
    with pytest.raises(SystemExit):
        parse(["--max-num-batched-tokens", "0"])
    err = capsys.readouterr().err
    assert "--max-num-batched-tokens: must be an integer >= 1 or 'auto' (as 2048, 2k or 2K), got '0'" in err
    for name, value in (("max_model_len", "8k"), ("kv_cache_memory_bytes", "1G"), ("num_kv_blocks", 8.0)):
        with pytest.raises(ValueError, match=f"^{name} must be an integer, got {value!r}"):  # a second trial
            EngineArgs(**{name: value}).check()


def test_a_pool_too_small_for_max_model_len_lowers_it_when_not_given_and_refuses_it_when_given():
    from segserve.config import fit_max_model_len

    config = EngineArgs(block_size=16).create_engine_config(8192)
    assert fit_max_model_len(config, 513, auto=False) is config  # 512 blocks of 16: 8,192 tokens
    lowered = fit_max_model_len(config, 8, auto=True)
    assert lowered.scheduler.max_model_len == 112 and lowered.cache == config.cache
    assert dataclasses.replace(lowered.scheduler, max_model_len=8192) == config.scheduler
    with pytest.raises(ValueError, match=r"^max_model_len=8192 does not fit the KV cache, which holds 112 "
                                         r"tokens \(7 blocks of 16\).*num_kv_blocks >= 513"):
        fit_max_model_len(config, 8, auto=False)
    with pytest.raises(ValueError, match="holds 0 tokens"):  # only the null block: nothing fits
        fit_max_model_len(config, 1, auto=True)


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
