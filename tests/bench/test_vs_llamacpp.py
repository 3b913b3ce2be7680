"""benchmarks/vs_llamacpp.py without llama.cpp: reading ``llama-bench -o json`` output."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import vs_llamacpp  # noqa: E402


def test_llama_bench_json_gives_pp512_and_tg128():
    entries = [
        {"model_type": "llama ?B Q4_1", "n_prompt": 512, "n_gen": 0, "avg_ts": 1234.5, "stddev_ts": 3.0},
        {"model_type": "llama ?B Q4_1", "n_prompt": 0, "n_gen": 128, "avg_ts": 91.25, "stddev_ts": 0.5},
    ]
    assert vs_llamacpp.parse_llama_bench(json.dumps(entries)) == {"pp512": 1234.5, "tg128": 91.25}


def test_goals_are_the_issues():
    assert vs_llamacpp.GOALS == {"tg128": 1.2, "pp512": 1.0}
    assert vs_llamacpp.WEIGHT_GOAL_MB == 120.0


def test_steal_text_gives_percentages_and_a_question_mark_where_unknown():
    assert vs_llamacpp.steal_text([0.0, 0.034, None, 0.125]) == "0 / 3 / ? / 12 %"
