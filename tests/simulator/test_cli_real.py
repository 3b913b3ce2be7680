"""``segserve simulate`` / ``tune`` flags that reach the real engine or the scheduler config, on a tiny
random model (no downloads, a few seconds of real time)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from segserve.entrypoints.cli import main  # noqa: E402
from segserve.simulator.step_model import LinearStepModel, save_profile  # noqa: E402
from tests.model_fixtures import save_tiny_hf_dir, tiny_hf_model, train_tiny_tokenizer  # noqa: E402

SMALL = ["--synthetic", "6", "--rate", "20", "--input-len", "60", "--output-len", "4", "--prefix-len", "0",
         "--max-model-len", "128", "--num-kv-blocks", "64"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_hf_dir(path, tiny_hf_model("llama"), train_tiny_tokenizer())
    return str(path)


def _profile(tmp_path, step_s: float) -> str:
    path = tmp_path / "prof.json"
    save_profile(LinearStepModel({"step": step_s, "padded_tokens": step_s / 100}), path)
    return str(path)


def test_simulate_passes_attention_cost_tokens_to_the_scheduler(tmp_path):
    # Regression: the simulator's config dropped --attention-cost-tokens, so it simulated the token
    # budget alone while the real engine charged attention cost.
    args = ["simulate", "--synthetic", "3", "--rate", "1", "--input-len", "3000", "--output-len", "2",
            "--prefix-len", "0", "--max-num-batched-tokens", "512", "--profile", _profile(tmp_path, 0.01)]
    runs = {}
    for k in (0, 1024):
        out = tmp_path / f"k{k}.json"
        assert main([*args, "--attention-cost-tokens", str(k), "--output-json", str(out)]) == 0
        runs[k] = json.loads(out.read_text())
    assert runs[1024]["settings"]["attention_cost_tokens"] == 1024
    assert runs[0]["settings"]["attention_cost_tokens"] == 0
    # 3 prompts of 3,000 tokens: 6 full 512-token chunks each (+ 1 decode step each) without the cost
    # budget; with K = 1,024 the chunks after the first shrink, so there are more steps.
    assert runs[0]["steps"]["num_steps"] < runs[1024]["steps"]["num_steps"]


def test_tune_verify_real_runs_the_recommendation_on_the_engine(tmp_path, tiny_dir, capsys):
    out = tmp_path / "tune.json"
    rc = main(["tune", *SMALL, "--model", tiny_dir, "--profile", _profile(tmp_path, 0.002),
               "--slo", "ttft_p99=30s,itl_p99=10s", "--budgets", "32,64", "--policies", "decode_first",
               "--caps", "0", "--verify-real", "--output-json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["settings"]["attention_cost_tokens"] == 0 and data["settings"]["profile"]["kind"] == "linear"
    assert data["best"]["max_num_batched_tokens"] in (32, 64)
    real = data["real"]
    assert real["completed"] == 6 and real["failed"] == 0 and real["total_output_tokens"] == 24
    assert real["meets_slo"] is True
    assert "[tune] on the real engine: meets ttft_p99=30s,itl_p99=10s" in capsys.readouterr().out


def test_tune_verify_real_reports_a_miss_with_exit_status_3(tmp_path, tiny_dir, capsys):
    # A profile that believes in 1-microsecond steps recommends a setting for an SLO no real step
    # can meet (every token within 0.01 ms); the real run must say so, not echo the simulation.
    out = tmp_path / "tune.json"
    rc = main(["tune", *SMALL, "--model", tiny_dir, "--profile", _profile(tmp_path, 1e-6),
               "--slo", "itl_p99=0.01ms", "--budgets", "64", "--policies", "decode_first", "--caps", "0",
               "--verify-real", "--output-json", str(out)])
    assert rc == 3  # not 2, which means bad input
    data = json.loads(out.read_text())
    assert data["best"]["meets_slo"] is True and data["real"]["meets_slo"] is False
    assert data["real"]["p99_itl_ms"] > 0.01
    assert "[tune] on the real engine: MISSES itl_p99=0.01ms" in capsys.readouterr().out


def test_tune_keeps_the_simulated_rows_when_the_real_run_cannot_start(tmp_path, capsys):
    out = tmp_path / "tune.json"
    rc = main(["tune", *SMALL, "--model", str(tmp_path / "nope.gguf"), "--profile", _profile(tmp_path, 0.002),
               "--slo", "ttft_p99=30s", "--budgets", "64", "--policies", "decode_first", "--caps", "0",
               "--verify-real", "--output-json", str(out)])
    assert rc == 2 and "nope.gguf" in capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["best"]["max_num_batched_tokens"] == 64 and "real" not in data
