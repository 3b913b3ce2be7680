"""``segserve bench throughput`` and ``segserve bench serve`` end to end on a tiny random Llama: each
runs, prints one line and writes valid JSON whose counts match the workload."""

from __future__ import annotations

import json

import pytest

from segserve.entrypoints.cli import main

TINY = ["--block-size", "8", "--num-kv-blocks", "129", "--max-num-seqs", "16", "--no-progress"]


def test_bench_throughput_with_hf_baseline_writes_json(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "tp.json"
    argv = ["bench", "throughput", "--model", str(tiny_model_dir), *TINY, "--num-prompts", "3",
            "--input-len", "20", "--output-len", "4", "--baseline", "hf", "--output-json", str(out)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("segserve throughput: 3 requests, 60 prompt tokens")
    record = json.loads(out.read_text())
    ours = record["segserve"]
    assert (ours["num_requests"], ours["prompt_tokens"], ours["output_tokens"]) == (3, 60, 12)
    assert ours["decode_tokens"] <= 9 and ours["seconds"] > 0  # first tokens never count as decode
    static = record["baselines"]["hf-static"]
    assert (static["prompt_tokens"], static["output_tokens"], static["decode_tokens"]) == (60, 12, 9)
    assert set(record["ratios"]["hf-static"]) == {
        "requests_per_s", "output_tok_s", "total_tok_s", "prefill_tok_s", "decode_tok_s"
    }
    from transformers import GenerationMixin

    has_cb = hasattr(GenerationMixin, "generate_batch")  # transformers >= 4.54
    assert ("hf-cb" in record["baselines"]) == has_cb
    if has_cb:
        assert record["baselines"]["hf-cb"]["output_tokens"] == 12
    assert record["workload"]["kind"] == "random" and record["machine"]["cores"] >= 1


def test_bench_throughput_counts_prefix_cache_hits_apart(tiny_model_dir, tmp_path):
    from segserve import LLMEngine
    from segserve.bench.throughput import run_segserve
    from segserve.bench.workloads import BenchRequest, Workload

    shared = tuple(range(20, 52))  # 4 blocks of 8 shared by both prompts
    reqs = (BenchRequest(shared + (60, 61), 2), BenchRequest(shared + (70, 71), 2))
    engine = LLMEngine(str(tiny_model_dir), block_size=8, num_kv_blocks=65, max_num_batched_tokens=34)
    res = run_segserve(engine, Workload("t", reqs, {}), progress=False)
    # The first prompt fills the whole 34-token budget, so the second is admitted a step later and hits.
    assert (res.prompt_tokens, res.cached_tokens, res.output_tokens) == (34 + 2, 32, 4)


def test_bench_throughput_rejects_a_bad_batch_size(tiny_model_dir, capsys):
    argv = ["bench", "throughput", "--model", str(tiny_model_dir), *TINY, "--hf-batch-size", "0"]
    assert main(argv) == 2
    assert "--hf-batch-size must be >= 1, got 0" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_server(tiny_loaded):
    from segserve import LLMEngine
    from tests.server.harness import running_server

    with running_server(LLMEngine(tiny_loaded, block_size=8, num_kv_blocks=129, max_num_seqs=16)) as (h, _):
        yield h


def test_bench_serve_against_segserve_server(tiny_server, tmp_path, capsys):
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--base-url", tiny_server.base_url, "--vocab-size", "300",
            "--max-model-len", "128", "--num-prompts", "4", "--input-len", "16", "--output-len", "5",
            "--request-rate", "40", "--goodput", "ttft:60000", "tpot:60000", "--output-json", str(out),
            "--no-progress"]
    assert main(argv) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("bench serve: 4 ok, 0 failed") and "goodput" in line
    result = json.loads(out.read_text())["result"]
    assert (result["completed"], result["total_input_tokens"], result["total_output_tokens"]) == (4, 64, 20)
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["p99_itl_ms"] >= result["median_itl_ms"] > 0


def test_bench_serve_rejects_a_bad_goodput_item(capsys):
    assert main(["bench", "serve", "--goodput", "itl:5"]) == 2
    assert "--goodput item 'itl:5'" in capsys.readouterr().err
