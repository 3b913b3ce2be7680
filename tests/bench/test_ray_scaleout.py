"""benchmarks/ray_scaleout.py without Ray: the workload, its size check and the real-vs-simulated
comparison it reports."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import ray_scaleout  # noqa: E402


def test_default_workload_is_the_issues():
    args = ray_scaleout.parse_args([])
    ray_scaleout.check_sizes(args)  # one request fits a replica, the 8 prefixes do not
    reqs = ray_scaleout.workload(args)
    assert len(reqs) == 8 * 5 and all(r.input_len == 512 + 64 and r.output_len == 16 for r in reqs)
    groups = [r.hash_ids[0] // 1000 for r in reqs]
    assert sorted(groups) == sorted(list(range(8)) * 5) and groups != sorted(groups)  # random order
    assert len({r.hash_ids[1] for r in reqs}) == 40  # each suffix its own
    assert all(a.arrival < b.arrival for a, b in zip(reqs, reqs[1:], strict=False))


@pytest.mark.parametrize("kv_blocks, message", [
    (1 + 8 * 32, "--kv-blocks 257: all 8 prefixes (8 x 32 blocks) fit one replica"),
    (37, "--kv-blocks 37: one request needs 37 blocks + null"),
])
def test_sizes_that_would_not_test_routing_are_refused(kv_blocks, message):
    args = ray_scaleout.parse_args(["--kv-blocks", str(kv_blocks)])
    with pytest.raises(SystemExit, match=re.escape(message)):
        ray_scaleout.check_sizes(args)
    ray_scaleout.check_sizes(ray_scaleout.parse_args(["--kv-blocks", "256"]))  # one block short: fine


def test_agreement_names_replicas_by_first_use():
    real = [{"replica": "zz", "cached_tokens": 0}, {"replica": "aa", "cached_tokens": 0},
            {"replica": "zz", "cached_tokens": 512}, {"replica": "aa", "cached_tokens": 0}]
    sim = [{"replica": 1, "cached_tokens": 0}, {"replica": 0, "cached_tokens": 0},
           {"replica": 1, "cached_tokens": 512}, {"replica": 1, "cached_tokens": 512}]
    assert ray_scaleout.agreement(real, sim) == {
        "same_replica": 3, "same_cached_tokens": 3, "of": 4, "first_routing_difference": 3}


def test_summarize_hit_rate_is_cached_over_prompt_tokens():
    rows = [{"ttft_s": 1.0, "prompt_tokens": 576, "cached_tokens": 0},
            {"ttft_s": 3.0, "prompt_tokens": 576, "cached_tokens": 512},
            {"ttft_s": None, "prompt_tokens": 576, "cached_tokens": 512}]
    got = ray_scaleout.summarize(rows)
    assert got["hit_rate"] == pytest.approx(1024 / 1728)
    assert got["ttft_p50_s"] == pytest.approx(2.0) and got["ttft_p99_s"] == pytest.approx(2.98)
