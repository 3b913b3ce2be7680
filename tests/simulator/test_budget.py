"""``--max-num-batched-tokens auto``: the exact budget a synthetic profile gives, and every bad value
of the new flags failing at start-up with the flag and the limit named."""

from __future__ import annotations

import math

import pytest

from segserve.entrypoints.cli import build_parser, main
from segserve.simulator.budget import (
    AUTO_CONTEXT,
    AUTO_DECODES,
    attention_cost_for,
    auto_attention_cost,
    auto_budget,
    settle_budget,
    sized_step,
)
from segserve.simulator.step_model import LinearStepModel

# 10 ms a step + 1 ms a padded row: a budget B costs 10 + bucket(B) ms (buckets: 16, 32, 48, 64, then
# every count: steps above 64 rows are not padded).
ROWS = LinearStepModel({"step": 0.010, "padded_tokens": 0.001})


@pytest.mark.parametrize(
    "target_s, budget",
    [
        (0.2, 176),  # 176 -> 186 ms; 192 -> 202 ms
        (0.266, 256),
        (0.5, 480),  # 496 -> 506 ms
        (1.0, 976),  # 976 -> 986 ms; 992 -> 1002 ms
        (0.03, 16),  # 26 ms; 32 -> 42 ms
        (0.001, 16),  # nothing fits: one block
    ],
)
def test_auto_budget_is_the_largest_block_multiple_whose_step_fits(target_s, budget):
    choice = auto_budget(ROWS, target_s, block_size=16, max_num_seqs=64, max_model_len=8192)
    assert choice.budget == budget and choice.auto
    assert f"auto = {budget}" in choice.line


def test_the_default_target_is_fourteen_decode_steps_of_the_profile():
    """``--target-itl-ms auto``: 14 x the predicted step of 8 decodes at 256 tokens of context alone. On
    ROWS (10 ms a step + 1 ms a padded row): 8 decodes 18 ms -> a 252 ms target -> budget 240."""
    from segserve.simulator.budget import (
        AUTO_ITL_DECODE_STEPS,
        DEFAULT_TARGET_ITL_MS,
        auto_target_s,
        decode_step,
    )

    assert DEFAULT_TARGET_ITL_MS == "auto" and AUTO_ITL_DECODE_STEPS == 14
    step = decode_step(256, 8192)
    assert len(step.slices) == 8 and step.padded_tokens == 8
    assert all(s.prior == 256 and s.chunk == 1 and s.is_decode for s in step.slices)
    assert math.isclose(auto_target_s(ROWS, 256, 8192), 14 * (0.010 + 8 * 0.001))  # 252 ms
    choice = auto_budget(ROWS, "auto", 16, 256, 8192)
    assert choice.budget == 240 and math.isclose(choice.target_s, 0.252)  # 240 -> 250 ms; 256 -> 266 ms
    assert "--target-itl-ms 252 (auto: 14 x the predicted step of 8 decodes alone)" in choice.line
    assert settle_budget("auto", ROWS, "auto", 16, 256, 8192).budget == 240
    # max_num_seqs below 8: the decodes that can run (2 -> 14 x 12 ms = 168 ms -> 144 rows, 154 ms).
    assert math.isclose(auto_target_s(ROWS, 2, 8192), 0.168)
    assert auto_budget(ROWS, "auto", 16, 2, 8192).budget == 144


def test_a_profile_without_a_decode_step_takes_the_fallback_target():
    from segserve.simulator.budget import FALLBACK_TARGET_ITL_MS, auto_target_s

    zero = LinearStepModel({"padded_tokens": 0.0})
    assert auto_target_s(zero, 256, 8192) == FALLBACK_TARGET_ITL_MS / 1000 == 0.5


def test_auto_attention_cost_is_the_row_cost_over_the_attention_cost():
    """K = the cost of a padded row / the cost of one unit of chunk attention (the break-even K;
    ``ATTENTION_COST_SLACK`` 1): a bfloat16 profile (0.455 ms a row, 2.06e-7 s per unit) gives ~2,200;
    without an attention term there is none."""
    from segserve.simulator.budget import ATTENTION_COST_SLACK

    assert ATTENTION_COST_SLACK == 1
    model = LinearStepModel({"step": 0.020, "padded_tokens": 0.000455, "prefill_attn": 2.06e-7})
    assert auto_attention_cost(model) == 2209  # round(0.000455 / 2.06e-7)
    choice = auto_budget(model, 0.4, 16, 256, 8192)
    assert choice.attention_cost_tokens == 2209 and "attention cost K = 2209 tokens" in choice.line
    assert auto_attention_cost(ROWS) == 0 and auto_budget(ROWS, 0.4, 16, 256, 8192).attention_cost_tokens == 0
    # segserve serve: not given, auto with an automatic budget and off with a given one; auto takes K
    # from an automatic budget; a number wins.
    given = settle_budget(512, model, 400, 16, 256, 8192)
    assert (attention_cost_for("auto", choice), attention_cost_for(0, choice)) == (2209, 0)
    assert (attention_cost_for(None, choice), attention_cost_for(None, given)) == (2209, 0)
    assert attention_cost_for(1000, given) == 1000
    with pytest.raises(ValueError, match=r"--attention-cost-tokens auto is sized with "
                       r"--max-num-batched-tokens auto, not with a given budget \(512\)"):
        attention_cost_for("auto", given)
    parse = build_parser().parse_args
    assert parse(["serve"]).attention_cost_tokens is None and parse(["generate"]).attention_cost_tokens == 0
    assert parse(["serve", "--attention-cost-tokens", "AUTO"]).attention_cost_tokens == "auto"


@pytest.mark.parametrize("bad", ["-1", "outo", "1.5"])
def test_a_bad_attention_cost_fails_at_parse_naming_the_flag(bad, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--attention-cost-tokens", bad])
    err = capsys.readouterr().err
    assert "--attention-cost-tokens" in err and "must be an integer >= 0 or 'auto'" in err and bad in err


def test_attention_cost_auto_is_refused_outside_serve():
    from segserve.engine_args import EngineArgs

    args = build_parser().parse_args(["generate", "--attention-cost-tokens", "auto"])
    with pytest.raises(ValueError, match="--attention-cost-tokens auto is sized from the step profile by "
                       "`segserve serve`"):
        EngineArgs.from_cli_args(args)


def test_auto_budget_counts_decodes_and_the_chunk_attention():
    model = LinearStepModel(
        {"step": 0.010, "padded_tokens": 0.001, "sampled": 0.002, "decode_ctx": 1e-6, "prefill_attn": 1e-7}
    )
    step = sized_step(128, max_num_seqs=64, max_model_len=8192)
    assert step.num_decodes == AUTO_DECODES and step.num_prefill_tokens == 128 - AUTO_DECODES
    chunk = 128 - AUTO_DECODES
    expected = (0.010 + 0.128 + AUTO_DECODES * (0.002 + (AUTO_CONTEXT + 1) * 1e-6)
                + chunk * (AUTO_CONTEXT + (chunk + 1) / 2) * 1e-7)
    assert math.isclose(model.predict(step), expected)
    # 8 x 2 ms of LM head + 2 ms of context + 4.9 ms of attention: 128 (161 ms) fits 0.17 s, 256 not.
    assert auto_budget(model, 0.17, 16, 64, 8192).budget == 128
    # Fewer running sequences allowed than AUTO_DECODES: the step has only that many decodes.
    assert sized_step(64, max_num_seqs=2, max_model_len=8192).num_decodes == 2
    # Small max_model_len bounds the budget and the context.
    assert auto_budget(ROWS, 10.0, 16, 64, max_model_len=100).budget == 96


def test_a_given_budget_wins_and_must_hold_a_block():
    assert settle_budget(512, ROWS, 250, 16, 64, 8192).budget == 512
    assert settle_budget("auto", ROWS, 200, 16, 64, 8192).budget == 176
    with pytest.raises(ValueError, match=r"--max-num-batched-tokens 8 is below the block size 16 \(--block"):
        settle_budget(8, ROWS, 250, 16, 64, 8192)


BUDGET_ERROR = "argument --max-num-batched-tokens: must be an integer >= 1 or 'auto'"


TARGET_ERROR = "argument --target-itl-ms: must be 'auto' or a number of milliseconds > 0"


@pytest.mark.parametrize("command", ["serve", "simulate"])
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-num-batched-tokens", "atuo"], BUDGET_ERROR),
        (["--max-num-batched-tokens", "0"], BUDGET_ERROR),
        (["--target-itl-ms", "0"], TARGET_ERROR),
        (["--target-itl-ms", "-5"], TARGET_ERROR),
        (["--target-itl-ms", "nan"], TARGET_ERROR),
        (["--target-itl-ms", "atuo"], TARGET_ERROR),
    ],
)
def test_bad_flag_values_fail_at_start_up_naming_the_flag_and_the_limit(command, flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([command, *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_budget_below_the_block_size_fails_before_any_model_loads(capsys):
    assert main(["serve", "--max-num-batched-tokens", "8", "--block-size", "16"]) == 2
    assert "--max-num-batched-tokens 8 is below the block size 16" in capsys.readouterr().err
    tiny = ["--synthetic", "3", "--input-len", "64", "--output-len", "4", "--rate", "1"]
    assert main(["simulate", *tiny, "--max-num-batched-tokens", "16", "--block-size", "32"]) == 2
    assert "below the block size 32" in capsys.readouterr().err


def test_serve_defaults_to_auto_and_offline_commands_keep_512(capsys):
    args = build_parser().parse_args(["serve"])
    assert args.max_num_batched_tokens == "auto" and args.target_itl_ms == "auto"
    assert build_parser().parse_args(["serve", "--target-itl-ms", "250"]).target_itl_ms == 250.0
    assert build_parser().parse_args(["generate"]).max_num_batched_tokens == 512
    assert main(["generate", "--max-num-batched-tokens", "auto", "--prompt", "hi"]) == 2
    assert "give a number here" in capsys.readouterr().err


def test_simulate_sizes_auto_from_the_profile(tmp_path, capsys):
    import json

    from segserve.simulator.step_model import save_profile

    prof = tmp_path / "p.json"
    save_profile(ROWS, prof)
    out = tmp_path / "r.json"
    tiny = ["--synthetic", "5", "--input-len", "300", "--output-len", "4", "--rate", "1"]
    rc = main(["simulate", *tiny, "--profile", str(prof), "--max-num-batched-tokens", "auto",
               "--target-itl-ms", "200", "--output-json", str(out)])
    assert rc == 0
    assert json.loads(out.read_text())["settings"]["max_num_batched_tokens"] == 176
    assert "[simulate] max_num_batched_tokens auto = 176" in capsys.readouterr().err


@pytest.mark.parametrize("length", ["auto", "-1"])
def test_max_model_len_auto_leaves_the_automatic_budget_as_without_the_flag(length):
    """Regression (a second trial, 2026-12-05): `serve --max-model-len auto` passed -1 as the search's
    cap, and the automatic budget came out at its floor, 16 tokens (352 without the flag)."""
    from types import SimpleNamespace

    from segserve.entrypoints.serve import settle_budget as serve_settle

    choice = SimpleNamespace(model=ROWS)
    parser = build_parser()
    unset = parser.parse_args(["serve", "--max-num-batched-tokens", "auto"])
    auto = parser.parse_args(["serve", "--max-num-batched-tokens", "auto", "--max-model-len", length])
    assert auto.max_model_len == -1
    assert serve_settle(auto, choice).budget == serve_settle(unset, choice).budget > 16


def test_simulate_takes_max_model_len_auto_as_the_workloads_longest(capsys):
    """Regression (the same trial): `segserve simulate --max-model-len auto` failed with "max_model_len must
    be >= 2, got -1"; as without the flag, the longest request stands in for the model's length."""
    flags = ["simulate", "--synthetic", "5", "--input-len", "200", "--output-len", "8", "--max-model-len"]
    assert main([*flags, "auto"]) == 0
    assert "max_model_len must be" not in capsys.readouterr().err
