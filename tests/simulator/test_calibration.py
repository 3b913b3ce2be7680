"""Per-machine step profiles: the fingerprint, the cache (bad, truncated, stale and foreign files are
refused with their path named), which profile each command picks, and ``profile --quick`` itself
(on a tiny model with a 4k context)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from segserve.simulator import calibration as cal
from segserve.simulator.step_model import BUILTIN_MACHINE, DEFAULT_CPU_MODEL, LinearStepModel

MODEL = LinearStepModel({"step": 0.02, "padded_tokens": 1e-3}, source="test fit")


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"x" * 1000)
    return path


@pytest.fixture
def fp(model_file, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return cal.machine_fingerprint(model_file, "float32", 16, 512)


def stand_in(calls):
    def calibrator(fp):
        calls.append(fp)
        return MODEL, {"n": 10.0, "mean_abs_rel_err": 0.05}

    return calibrator


def test_fingerprint_names_the_machine_model_and_settings(fp, model_file, monkeypatch):
    assert fp.cpu_model == cal.cpu_model_name() and fp.cpu_model
    assert fp.model == str(model_file.resolve()) and fp.model_bytes == 1000
    assert (fp.dtype, fp.block_size, fp.kv_segment_size) == ("float32", 16, 512)
    assert len(fp.kernel_source) == 16 and fp.cpu_count >= 1 and fp.threads >= 1
    assert fp.key() == cal.machine_fingerprint(model_file, "float32", 16, 512).key()
    # Each setting a profile depends on changes the key.
    others = [
        cal.machine_fingerprint(model_file, "bfloat16", 16, 512),
        cal.machine_fingerprint(model_file, "float32", 32, 512),
        cal.machine_fingerprint(model_file, "float32", 16, 1024),
    ]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    others.append(cal.machine_fingerprint(model_file, "float32", 16, 512))
    monkeypatch.setenv("SEGSERVE_CPU_KERNELS", "0")
    off = cal.machine_fingerprint(model_file, "float32", 16, 512)
    assert off.kernels is False and off.threads == 1
    model_file.write_bytes(b"x" * 1001)
    others.append(cal.machine_fingerprint(model_file, "float32", 16, 512))
    assert len({fp.key(), off.key(), *(o.key() for o in others)}) == len(others) + 2
    diff = fp.differences(dataclasses.asdict(off))
    expected = {"threads", "kernels"} if fp.kernels else {"threads"}
    assert {d.split(":")[0] for d in diff} == expected
    assert f"threads: 1 != {fp.threads}" in diff
    # libgomp's idle-wait setting as well: a short step's time depends on it.
    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    spin = cal.machine_fingerprint(model_file, "float32", 16, 512)
    assert spin.omp_wait.startswith("GOMP_SPINCOUNT=123")
    assert {d.split(":")[0] for d in spin.differences(dataclasses.asdict(off))} == {"omp_wait", "model_bytes"}


def test_fingerprint_of_a_missing_model_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        cal.machine_fingerprint(tmp_path / "nope.gguf")


def test_a_cached_profile_of_this_machine_is_used_and_named(fp, empty_profile_cache):
    path = cal.save_cached(MODEL, fp, {"mean_abs_rel_err": 0.04})
    assert path == cal.profile_path(fp) and path.parent == empty_profile_cache
    choice = cal.choose_profile(fp)
    assert choice.origin == "cached" and choice.model == MODEL and choice.warning is None
    assert str(path) in choice.line and "4.0%" in choice.line
    # A cache file is also a plain --profile file.
    assert cal.choose_profile(fp, given=str(path)).model == MODEL


def test_without_a_profile_the_built_in_is_used_with_a_warning_naming_its_machine(fp):
    choice = cal.choose_profile(fp)
    assert choice.origin == "built-in" and choice.model is DEFAULT_CPU_MODEL
    assert BUILTIN_MACHINE in choice.warning and "segserve profile --quick" in choice.warning
    assert BUILTIN_MACHINE in choice.line


def test_a_profile_of_another_fingerprint_is_not_used_silently(fp, tmp_path):
    other = dataclasses.replace(fp, cpu_model="Some Other CPU")
    other_path = cal.save_cached(LinearStepModel({"step": 9.0}), other, {})
    # Looked up by this machine's key: the other machine's file is not picked up at all.
    choice = cal.choose_profile(fp)
    assert choice.origin == "built-in" and choice.warning
    # Copied to this machine's key (or the key collides): refused, naming the file and the difference.
    cal.profile_path(fp).write_text(other_path.read_text())
    with pytest.raises(cal.ProfileError) as e:
        cal.choose_profile(fp)
    msg = str(e.value)
    assert str(cal.profile_path(fp)) in msg and "Some Other CPU" in msg and "--calibrate" in msg
    # Given explicitly with --profile: used, with a warning that says whose it is.
    given = cal.choose_profile(fp, given=str(other_path))
    assert given.origin == "given" and given.model.coefficients["step"] == 9.0
    assert "another machine" in given.warning and "Some Other CPU" in given.warning


@pytest.mark.parametrize(
    "content, why",
    [
        ('{"kind": "linear", "coeff', "truncated"),
        ("[1, 2]", "not a profile"),
        ("STALE", "schema version"),
        ("NOFP", "no machine fingerprint"),
        ("BADCOEF", "not a valid step profile"),
    ],
)
def test_bad_truncated_or_stale_files_are_refused_with_the_path_then_recalibrated(fp, content, why):
    path = cal.profile_path(fp)
    good = cal.save_cached(MODEL, fp, {})
    data = json.loads(good.read_text())
    if content == "STALE":
        content = json.dumps(data | {"schema_version": cal.SCHEMA_VERSION - 1})
    elif content == "NOFP":
        content = json.dumps({k: v for k, v in data.items() if k != "fingerprint"})
    elif content == "BADCOEF":
        content = json.dumps(data | {"coefficients": {"step": -1.0}})
    path.write_text(content)
    with pytest.raises(cal.ProfileError, match=why) as e:
        cal.choose_profile(fp)
    assert str(path) in str(e.value)
    calls = []
    choice = cal.choose_profile(fp, calibrate=True, calibrator=stand_in(calls))
    assert calls == [fp] and choice.origin == "calibrated" and "replaced" in choice.line
    assert cal.choose_profile(fp).origin == "cached"  # the replacement is whole and current


def test_calibrate_measures_once_and_caches(fp):
    calls = []
    first = cal.choose_profile(fp, calibrate=True, calibrator=stand_in(calls))
    assert first.origin == "calibrated" and first.model == MODEL and len(calls) == 1
    again = cal.choose_profile(fp, calibrate=True, calibrator=stand_in(calls))
    assert again.origin == "cached" and len(calls) == 1


def test_simulate_says_which_profile_it_uses(capsys, monkeypatch, tmp_path):
    from segserve.entrypoints.cli import main

    tiny = ["--synthetic", "5", "--rate", "4", "--input-len", "64", "--output-len", "4"]
    assert main(["simulate", *tiny]) == 0
    err = capsys.readouterr().err
    assert "[simulate] step profile: built-in" in err and f"measured on {BUILTIN_MACHINE}" in err
    fp = cal.fingerprint_for_args(_parsed(["simulate", *tiny]))
    if fp is None:
        pytest.skip("the default model is not installed: nothing to fingerprint")
    path = cal.save_cached(MODEL, fp, {})
    assert main(["simulate", *tiny]) == 0
    err = capsys.readouterr().err
    assert f"[simulate] step profile: {path}" in err and "warning" not in err


def _parsed(argv):
    from segserve.entrypoints.cli import build_parser

    return build_parser().parse_args(argv)


def test_profile_quick_calibrates_and_caches_a_real_engine(capsys, empty_profile_cache, tmp_path):
    """Every quick probe on a real engine, end to end. A tiny model with a 4k context (every probe's
    shape, a few seconds): the default model runs the same code in ~40 s on 2 idle cores (its
    fidelity is ``benchmarks/calib_fidelity.py``'s business, not a test's)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for model_fixtures
    from model_fixtures import save_tiny_hf_dir, tiny_hf_model, train_tiny_tokenizer

    from segserve.entrypoints.cli import main

    hf = tiny_hf_model()
    hf.config.max_position_embeddings = 4096
    model_dir = tmp_path / "tiny4k"
    save_tiny_hf_dir(model_dir, hf, train_tiny_tokenizer())
    assert main(["profile", "--quick", "--model", str(model_dir)]) == 0
    out = capsys.readouterr().out
    assert "fit error: mean |rel err|" in out and "by kind of step" in out
    (path,) = empty_profile_cache.glob("*.json")
    fp = cal.machine_fingerprint(str(model_dir))
    model, data = cal.read_cached(path, fp)
    assert path == cal.profile_path(fp) and data["fit"]["n"] >= 100
    assert model.coefficients["padded_tokens"] > 0
    # The reference request ran at the start, middle and end, and its spread is recorded.
    assert "reference request (start / middle / end): " in out
    ref = data["fit"]["reference_ms"]
    assert len(ref) == 3 and min(ref) > 0
    assert data["fit"]["reference_drift"] == pytest.approx(max(ref) / min(ref) - 1)


def test_profile_quick_prints_the_fit_error_and_caches(model_file, monkeypatch, capsys, tmp_path):
    from segserve.entrypoints.cli import main
    from segserve.simulator import profile

    by_kind = {"prefill": {"n": 47, "mean_rel_err": -0.02, "mean_abs_rel_err": 0.04},
               "decode b=8": {"n": 9, "mean_rel_err": 0.06, "mean_abs_rel_err": 0.06}}
    stats = {"n": 126.0, "mean_abs_rel_err": 0.05, "p90_abs_rel_err": 0.1, "max_abs_rel_err": 0.3,
             "seconds": 41.0, "by_kind": by_kind}
    monkeypatch.setattr(profile, "calibrate_quick", lambda fp, **kw: (MODEL, stats))
    copy = tmp_path / "copy.json"
    assert main(["profile", "--quick", "--model", str(model_file), "--output", str(copy)]) == 0
    out = capsys.readouterr().out
    assert "fit error: mean |rel err| 5.0%, p90 10.0%, max 30.0%" in out
    assert "prefill -2% (n=47), decode b=8 +6% (n=9)" in out
    fp = cal.machine_fingerprint(model_file)
    assert f"wrote {cal.profile_path(fp)} and {copy}" in out
    assert cal.choose_profile(fp).origin == "cached"
    given = cal.choose_profile(fp, given=str(copy))
    assert given.origin == "given" and given.warning is None
    assert main(["profile"]) == 2 and "give --output FILE" in capsys.readouterr().err


def test_quick_probes_run_the_engine_in_the_loaded_models_dtype(monkeypatch):
    # Regression: `profile --quick --dtype bfloat16` built its engine in the default float32 and failed
    # with "the loaded model is torch.bfloat16, not torch.float32".
    import torch

    import segserve
    from segserve.simulator import profile

    seen = {}

    class Stop(Exception):
        pass

    def fake_engine(**kwargs):
        seen.update(kwargs)
        raise Stop

    class Loaded:
        model = torch.nn.Linear(2, 2).to(torch.bfloat16)

    monkeypatch.setattr(segserve, "LLMEngine", fake_engine)
    with pytest.raises(Stop):
        profile.measure_quick(Loaded(), log=lambda *_: None)
    assert seen["dtype"] == "bfloat16"


def test_profile_quick_writes_its_samples_and_reference_times(model_file, monkeypatch, capsys, tmp_path):
    # Regression: `profile --quick --samples-out F` accepted the flag and wrote nothing.
    from segserve.entrypoints.cli import main
    from segserve.simulator import profile
    from segserve.simulator.step_model import RequestSlice, StepComposition

    step = StepComposition((RequestSlice(100, 1, True, True), RequestSlice(0, 250, False, True)), 256)
    stats = {"n": 1.0, "mean_abs_rel_err": 0.05, "p90_abs_rel_err": 0.1, "max_abs_rel_err": 0.3,
             "seconds": 41.0, "by_kind": {}, "reference_ms": [610.0, 980.0, 620.0], "reference_drift": 0.607}

    def fake(fp, samples_out=None):
        samples_out.append((step, 0.75))
        return MODEL, stats

    monkeypatch.setattr(profile, "calibrate_quick", fake)
    out_file = tmp_path / "quick-samples.json"
    assert main(["profile", "--quick", "--model", str(model_file), "--samples-out", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "reference request (start / middle / end): 610 / 980 / 620 ms, 61% apart" in out
    assert f"samples in {out_file}" in out
    data = json.loads(out_file.read_text())
    assert profile.samples_from_json(data["samples"]) == [(step, 0.75)]
    assert data["model"]["name"] == MODEL.model.name and data["decode_gathers"] is MODEL.decode_gathers
    # The file is --from-samples' format: it refits offline.
    refit = tmp_path / "refit.json"
    assert main(["profile", "--from-samples", str(out_file), "--output", str(refit)]) == 2  # 1 < 8 samples
    assert "need at least" in capsys.readouterr().err
