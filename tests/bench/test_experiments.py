"""Each experiment script in ``benchmarks/`` runs on a tiny random Llama, prints one line, writes
valid JSON with the counts its settings imply, and a PNG; bad settings exit with a message."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(name: str, tiny_model_dir, tmp_path, capsys, *flags: str) -> dict:
    out_json, out_png = tmp_path / f"{name}.json", tmp_path / f"{name}.png"
    argv = ["--model", str(tiny_model_dir), "--json", str(out_json), "--png", str(out_png), *flags]
    assert _script(name).main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{name}:")
    assert out_png.read_bytes()[:8] == PNG_MAGIC
    record = json.loads(out_json.read_text())
    assert record["experiment"] == name and record["machine"]["cores"] >= 1
    return record


def test_stall(tiny_model_dir, tmp_path, capsys):
    rec = _run("stall", tiny_model_dir, tmp_path, capsys, "--num-decoding", "3", "--decode-prompt-len", "8",
               "--long-prompt-len", "64", "--chunk-budget", "16", "--warm-steps", "2")
    chunked, unchunked = rec["results"]["chunked"], rec["results"]["unchunked"]
    # max_tokens = warm steps + ceil(64 / (16 - 3)) + 8 = 15: 14 gaps for each of 3 requests.
    assert chunked["itl"]["n"] == unchunked["itl"]["n"] == 3 * 14
    assert (chunked["long_prefill_steps"], unchunked["long_prefill_steps"]) == (5, 1)
    assert (chunked["budget"], unchunked["budget"]) == (16, 67)
    assert rec["ratios"]["p99_itl"] == pytest.approx(chunked["itl"]["p99_ms"] / unchunked["itl"]["p99_ms"])


def test_prefix(tiny_model_dir, tmp_path, capsys):
    rec = _run("prefix", tiny_model_dir, tmp_path, capsys, "--prefix-len", "64", "--suffix-len", "8",
               "--budget", "32", "--repeats", "2")
    res = rec["results"]
    assert res["warm_cached_tokens"] == [64, 64] and res["cold_cached_tokens"] == [0, 0]
    assert len(res["cold_ttft_s"]) == len(res["warm_ttft_s"]) == 2


def test_chunk_tax(tiny_model_dir, tmp_path, capsys):
    rec = _run("chunk_tax", tiny_model_dir, tmp_path, capsys, "--prompt-lens", "48,100", "--budget", "16",
               "--repeats", "2")
    steps = {(r["length"], r["setting"]): r["steps"] for r in rec["rows"]}
    assert steps == {(48, "chunked"): 3, (48, "unchunked"): 1, (100, "chunked"): 7, (100, "unchunked"): 1}
    assert len(rec["rows"]) == 8 and rec["ratios"]["chunked_over_unchunked"] > 0


def test_knob(tiny_model_dir, tmp_path, capsys):
    rec = _run("knob", tiny_model_dir, tmp_path, capsys, "--dataset", "azure-conv", "--num-prompts", "3",
               "--length-scale", "0.1", "--output-cap", "3", "--request-rate", "50", "--budgets", "16,64",
               "--policies", "decode_first", "--attention-cost-tokens", "0,64")
    runs = rec["runs"]
    assert [(r["budget"], r["attention_cost_tokens"]) for r in runs] == [(16, 0), (64, 0), (16, 64), (64, 64)]
    assert all(r["ttft"]["n"] == 3 and r["step_max_over_median"] >= 1.0 for r in runs)
    assert set(rec["ratios_to_first_run"]) == {"decode_first/16", "decode_first/64", "decode_first/16/K64",
                                               "decode_first/64/K64"}


def test_knob_plot_from_merges_runs_and_refuses_what_does_not_compare(tiny_model_dir, tmp_path, capsys):
    knob = _script("knob")
    common = ["--model", str(tiny_model_dir), "--dataset", "azure-conv", "--num-prompts", "2",
              "--length-scale", "0.1", "--output-cap", "2", "--request-rate", "50",
              "--policies", "decode_first"]
    for name, budgets in (("a", "16"), ("b", "64")):
        assert knob.main([*common, "--budgets", budgets, "--json", str(tmp_path / f"{name}.json"),
                          "--png", str(tmp_path / f"{name}.png")]) == 0
    capsys.readouterr()
    a, b, merged = (str(tmp_path / f"{n}.json") for n in ("a", "b", "m"))
    assert knob.main(["--plot-from", a, b, "--json", merged, "--png", str(tmp_path / "m.png")]) == 0
    assert "(merged)" in capsys.readouterr().out
    rec = json.loads(Path(merged).read_text())
    assert [r["budget"] for r in rec["runs"]] == [16, 64] and rec["merged_from"] == [a, b]
    assert [s["budgets"] for s in rec["settings"]] == ["16", "64"]  # the sources' settings, not the re-plot's
    other = json.loads(Path(b).read_text()) | {"workload": {"something": "else"}}
    (tmp_path / "other.json").write_text(json.dumps(other))
    (tmp_path / "junk.json").write_text("not json")
    for argv, message in [
        ([a, a], "setting decode_first/16 appears in more than one run"),
        ([a, str(tmp_path / "other.json")], "measured another workload"),
        ([str(tmp_path / "junk.json")], "not a knob.py record (JSONDecodeError"),
    ]:
        with pytest.raises(SystemExit) as exc:
            knob.main(["--plot-from", *argv, "--json", str(tmp_path / "x.json"),
                       "--png", str(tmp_path / "x.png")])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit):  # without its own outputs it would overwrite the committed knob run
        knob.main(["--plot-from", a])
    assert "needs its own --json and --png" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "flags", "message"),
    [
        ("stall", ["--num-decoding", "8", "--chunk-budget", "8"], "--chunk-budget (8) must exceed"),
        ("prefix", ["--repeats", "0"], "--repeats must be >= 1, got 0"),
        ("chunk_tax", ["--prompt-lens", "0"], "need lengths >= 1"),
        ("knob", ["--output-cap", "0"], "--output-cap must be >= 1, got 0"),
    ],
)
def test_bad_settings_exit_with_a_message(name, flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        _script(name).main(flags)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cost_budget_sim(tmp_path, capsys):
    out = tmp_path / "cbs.json"
    assert _script("cost_budget_sim").main(["--num-prompts", "6", "--costs", "1024", "--json", str(out)]) == 0
    assert capsys.readouterr().out.startswith("cost_budget_sim: budget 512")
    rec = json.loads(out.read_text())
    assert [r["attention_cost_tokens"] for r in rec["runs"]] == [0, 1024]
    assert set(rec["ratios"]["1024"]) == {"step_max_over_median", "p99_ttft_ms", "p99_itl_ms"}


def test_structured(tiny_model_dir, tmp_path, capsys):
    rec = _run("structured", tiny_model_dir, tmp_path, capsys, "--concurrency", "4", "--max-tokens", "12",
               "--rounds", "2", "--delay-repeats", "2", "--budget", "256")
    res = rec["results"]
    assert len(res["rounds"]) == 2 and all(len(r["counts"]) == 4 for r in res["rounds"])
    # Greedy: both rounds generate the same tokens; each side of a round generated them all.
    assert res["rounds"][0]["counts"] == res["rounds"][1]["counts"]
    assert all(1 <= n <= 12 for n in res["rounds"][0]["counts"])
    assert len(res["delays"]["cold_s"]) == len(res["delays"]["cached_s"]) == 2
    rounds = res["rounds"]
    for r in rounds:
        assert r["constrained_tok_s"] == pytest.approx(r["tokens"] / r["constrained_s"])
    median = lambda key: (rounds[0][key] + rounds[1][key]) / 2  # noqa: E731 - median of two
    assert rec["ratios"]["constrained_over_unconstrained_tok_s"] == pytest.approx(
        median("constrained_tok_s") / median("unconstrained_tok_s"))
