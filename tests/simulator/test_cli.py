"""``segserve simulate``, ``tune`` and ``profile --roofline`` on tiny cases; the package imports
without torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from segserve.entrypoints.cli import main
from segserve.simulator.step_model import LinearStepModel, save_profile

TINY = ["--synthetic", "30", "--rate", "4", "--input-len", "300", "--output-len", "12", "--prefix-len", "0"]


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "prof.json"
    save_profile(LinearStepModel({"step": 0.01, "padded_tokens": 1e-4, "decode_ctx": 1e-6}), path)
    return str(path)


def test_simulate_writes_json_trace_and_plot(tmp_path, profile, capsys):
    out, trace, png = tmp_path / "r.json", tmp_path / "t.json", tmp_path / "p.png"
    rc = main(
        [
            "simulate",
            *TINY,
            "--profile",
            profile,
            "--max-num-batched-tokens",
            "256",
            "--slo",
            "itl_p99=50ms",
            "--output-json",
            str(out),
            "--chrome-trace",
            str(trace),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["summary"]["completed"] == 30 and result["summary"]["total_output_tokens"] == 360
    assert result["settings"]["max_num_batched_tokens"] == 256
    assert result["summary"]["request_goodput"] > 0
    events = json.loads(trace.read_text())["traceEvents"]
    assert len([e for e in events if e["ph"] == "X"]) == result["steps"]["num_steps"]
    assert png.stat().st_size > 10_000
    assert capsys.readouterr().out.startswith("[simulate] completed=30 failed=0")


def test_simulate_settles_max_model_len_from_the_workload_or_the_flag():
    from segserve.entrypoints.cli import build_parser
    from segserve.simulator.cli import build_config, load_workload

    parser = build_parser()
    args = parser.parse_args(["simulate", *TINY, "--max-num-partial-prefills", "2"])
    cfg = build_config(args, load_workload(args))
    assert cfg.scheduler.max_model_len == 312  # 300 + 12: the longest request
    assert cfg.scheduler.max_num_partial_prefills == 2
    args = parser.parse_args(["simulate", *TINY, "--max-model-len", "100000"])
    assert build_config(args, load_workload(args)).scheduler.max_model_len == 100000  # no model to exceed


def test_tune_picks_a_feasible_setting(tmp_path, profile, capsys):
    out = tmp_path / "tune.json"
    rc = main(
        [
            "tune",
            *TINY,
            "--profile",
            profile,
            "--slo",
            "itl_p99=40ms",
            "--budgets",
            "64,512",
            "--policies",
            "decode_first,prefill_first",
            "--caps",
            "0,128",
            "--output-json",
            str(out),
            "--plot",
            str(tmp_path / "tune.png"),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 6  # cap 128 is skipped for budget 64
    best = data["best"]
    assert best["meets_slo"] and best["p99_itl_ms"] <= 40
    top = max(r["request_goodput"] for r in data["rows"] if r["meets_slo"])
    near = [r for r in data["rows"] if r["meets_slo"] and r["request_goodput"] >= 0.99 * top]
    assert best["p99_itl_ms"] == min(r["p99_itl_ms"] for r in near)  # one SLO: the most room under it
    assert "[tune] best of 6" in capsys.readouterr().out


def test_tune_reports_no_feasible_setting(profile, capsys):
    rc = main(["tune", *TINY, "--profile", profile, "--slo", "itl_p99=1ms", "--budgets", "64"])
    assert rc == 1 and "no setting of 2 meets itl_p99=1ms" in capsys.readouterr().out


def test_profile_roofline(tmp_path):
    out = tmp_path / "h100.json"
    assert main(["profile", "--roofline", "h100", "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "roofline" and data["model"]["name"] == "Llama-3.1-8B"
    assert data["flops"] == pytest.approx(0.5 * 989e12)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["simulate", "--max-num-batched-tokens", "64"], "give --trace FILE or --synthetic N"),
        (["tune", *TINY, "--slo", "itl_p99=5ms", "--budgets", "0"], "--budgets needs integers >= 1, got '0'"),
        (["tune", *TINY, "--slo", "itl_p99=5ms", "--budgets", "x"], "--budgets must be comma-separated"),
        (["tune", *TINY, "--slo", "speed=5"], "SLO 'speed=5'"),
        (["simulate", *TINY, "--num-replicas", "0"], "num_replicas must be >= 1, got 0"),
        (["tune", *TINY, "--slo", "itl_p99=5ms", "--disaggregated", "1:1"],
         "--disaggregated is for simulate"),
        (["tune", *TINY, "--slo", "itl_p99=5ms", "--num-replicas", "2", "--verify-real"],
         "needs --num-replicas 1, got 2"),
        (["simulate", "--synthetic", "0"], "--synthetic must be >= 1, got 0"),
        (["simulate", *TINY, "--output-len", "0"], "--output-len must be >= 1, got 0"),
        (["simulate", *TINY, "--max-input-len", "0"], "--max-input-len must be >= 1, got 0"),
        (["simulate", *TINY, "--prefix-len", "100"], "--prefix-len 100 shares nothing"),
        (["profile", "--from-samples", "/nonexistent.json", "--output", "/tmp/x.json"],
         "--from-samples /nonexistent.json: not a samples file"),
        (["profile", "--from-samples", "/tmp/same.json", "--output", "/tmp/same.json"],
         "would overwrite the --from-samples file"),
    ],
)
def test_bad_cli_input(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_simulator_imports_without_torch_or_numpy():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import segserve.simulator.cluster, segserve.simulator.metrics, segserve.simulator.report\n"
        "import segserve.simulator.tune, segserve.simulator.cli, segserve.simulator.profile\n"
        "import segserve.simulator.replay, segserve.simulator.fit\n"
        "from segserve.simulator.cli import register\n"
        "from segserve.entrypoints.cli import main\n"
        "assert main(['simulate', '--synthetic', '5', '--input-len', '50', '--output-len', '3']) == 0\n"
        "loaded = [m for m in ('torch', 'numpy', 'matplotlib') if sys.modules.get(m) is not None]\n"
        "assert not loaded, loaded\n"
        "print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip().endswith("ok"), result.stderr


def test_simulate_disaggregated(tmp_path, profile):
    out = tmp_path / "d.json"
    argv = ["simulate", *TINY, "--profile", profile, "--disaggregated", "1:2", "--output-json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["summary"]["completed"] == 30 and result["summary"]["transfers_dropped"] == 0.0
    assert result["settings"]["disaggregated"] == "1:2"
    # 300-token prompts: 288 tokens of fp32 SmolLM2 KV (46,080 B/token) over 50 GB/s.
    assert result["summary"]["mean_transfer_ms"] == pytest.approx(288 * 46080 / 50e9 * 1000)


def test_bad_disaggregated_flag(capsys):
    assert main(["simulate", *TINY, "--disaggregated", "2-6"]) == 2
    assert "--disaggregated must be P:D replica counts like 2:6, got '2-6'" in capsys.readouterr().err


def test_profile_from_malformed_samples_names_the_row(tmp_path, capsys):
    good = {"seconds": 0.05, "padded": 1, "slices": [[10, 1, True, True]]}
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"samples": [good] * 8 + [{"seconds": 0.1, "slices": []}], "model": {}}))
    assert main(["profile", "--from-samples", str(path), "--output", str(tmp_path / "p.json")]) == 2
    assert "sample row 8 is malformed (KeyError" in capsys.readouterr().err
    # Old files (no "gathered" key) still load, with a note that the feature is fitted as 0.
    path.write_text(json.dumps({"samples": [good] * 8, "model": {}}))
    assert main(["profile", "--from-samples", str(path), "--output", str(tmp_path / "p.json")]) == 0
    assert "predate the gathered_kv feature" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "nan", "lots"])
def test_kv_cache_memory_error_names_the_flag_in_gib(value, capsys):
    # Regression: the error reported "kv_cache_memory_bytes ... got -1073741824" for --kv-cache-memory -1.
    with pytest.raises(SystemExit) as exc:
        main(["simulate", *TINY, "--kv-cache-memory", value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "argument --kv-cache-memory: must be a" in err and "GiB" in err


@pytest.mark.parametrize(
    ("flags", "hint"),
    [
        (["--output-len", "1"], "(p99_itl_ms undefined: no request generated 2+ tokens)"),
        (["--output-len", "4", "--max-model-len", "100"], "(every request was rejected in every setting: 3 "),
    ],
)
def test_tune_says_why_nothing_can_be_feasible(flags, hint, profile, capsys):
    argv = ["tune", "--synthetic", "3", "--input-len", "500", "--prefix-len", "0", "--profile", profile,
            "--slo", "itl_p99=1s", "--budgets", "64", "--caps", "0", *flags]
    assert main(argv) == 1
    assert hint in capsys.readouterr().out


def test_simulate_says_why_requests_were_rejected(profile, capsys):
    """A new user's trial (2026-12-05): prompts longer than max_model_len gave `completed=0 failed=3` and
    nan metrics with no reason."""
    argv = ["simulate", "--synthetic", "3", "--rate", "4", "--input-len", "400", "--output-len", "12",
            "--prefix-len", "0", "--max-model-len", "256", "--max-num-batched-tokens", "256",
            "--profile", profile]
    assert main(argv) == 0
    line = capsys.readouterr().out
    assert "completed=0 failed=3" in line and "; first rejection: " in line
    assert "256" in line.split("rejection")[1]
