"""benchmarks/bench_sampler.py's step timings and summary on random logits (no model, no engine)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_sampler as bs  # noqa: E402

from segserve.kernels import cpu as cpu_kernels  # noqa: E402
from segserve.kernels import sample as sample_kernels  # noqa: E402
from segserve.sampling_params import SamplingParams  # noqa: E402
from segserve.worker import sampler  # noqa: E402

needs_kernels = pytest.mark.skipif(not cpu_kernels.enabled(), reason="compiled kernels off here")


@needs_kernels
def test_the_step_part_times_every_path_and_setting_and_restores_the_sampler(tmp_path, capsys) -> None:
    out = tmp_path / "b.json"
    argv = ["--batches", "1", "3", "--reps", "1", "--vocab", "64", "--no-e2e", "--out", str(out)]
    assert bs.main(argv) == 0
    record = json.loads(out.read_text())
    assert sorted(record["step_ms"]) == sorted(f"b{n}/{s}" for n in (1, 3) for s in bs.SETTINGS)
    assert all(set(v) == {"race", "pytorch", "compiled"} for v in record["step_ms"].values())
    assert set(record["logprobs_ms"]) == {"b1", "b3"} and record["e2e_output_tok_s"] is None
    assert "sample() per step, race -> compiled: b3 t1" in capsys.readouterr().out
    assert sampler.draw is bs.compiled_draw  # the benchmark put the engine's draw back


def test_the_baselines_draw_from_the_filtered_tokens() -> None:
    logits = torch.tensor([[0.0, 5.0, float("-inf"), 4.0]])
    params = [SamplingParams(temperature=1.0, top_k=2)]
    keys = torch.zeros(1, dtype=torch.int64)
    assert all(bs.race_draw(logits, params, keys)[0] in (1, 3) for _ in range(20))
    assert bs.pytorch_draw(logits, params, keys)[0] in (1, 3)
    saved = sample_kernels.logprobs_rows
    with bs.pytorch_logprobs():
        assert sample_kernels.logprobs_rows(logits, [1], 1) is None  # declined: PyTorch's path answers
        assert sampler.compute_logprobs(logits, [1], 1)[0][:2] == [(1, pytest.approx(-0.3182, abs=1e-4), 1),
                                                                   (1, pytest.approx(-0.3182, abs=1e-4), 1)]
    assert sample_kernels.logprobs_rows is saved
