"""lm-evaluation-harness (pinned in the ``test`` extra) against the server: its ``local-completions``
backend (echo + logprobs loglikelihoods, batched token-id prompts for ``generate_until``) and its
``hf`` backend score the same tiny local tasks on the same float32 weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.server.harness import SERVED_NAME, running_server

# Imports lm_eval and datasets and runs both backends: ~1 min on 2 busy cores.
pytestmark = pytest.mark.slow
DATA = Path(__file__).parent / "data" / "lm_eval_tiny"
MC_YAML = """task: segserve_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
GEN_YAML = """task: segserve_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["."]
  max_gen_toks: 6
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def lm_eval_tasks(tmp_path_factory):
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local json files only
    pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    (folder / "mc.yaml").write_text(MC_YAML.format(data=DATA))
    (folder / "gen.yaml").write_text(GEN_YAML.format(data=DATA))
    return TaskManager(include_path=str(folder))


@pytest.fixture(scope="module")
def tiny_dir_server(tiny_model_dir):
    from segserve import LLMEngine
    from tests.server.conftest import TINY_ENGINE

    with running_server(LLMEngine(str(tiny_model_dir), **TINY_ENGINE)) as (handle, _):
        yield handle


def _evaluate(task_manager, task: str, model: str, model_args: dict, batch_size: int) -> dict:
    import lm_eval

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task],
                                   task_manager=task_manager, batch_size=batch_size, log_samples=True,
                                   random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                   fewshot_random_seed=0)


def _local_args(handle, tiny_model_dir) -> dict:
    return {"model": SERVED_NAME, "base_url": f"{handle.base_url}/v1/completions",
            "tokenizer": str(tiny_model_dir), "tokenizer_backend": "huggingface", "max_length": 128,
            "num_concurrent": 1, "max_retries": 1, "tokenized_requests": True}


def _loglikelihoods(result: dict, task: str) -> dict[tuple[int, int], float]:
    """(doc id, choice index) -> loglikelihood of that choice's continuation."""
    out = {}
    for sample in result["samples"][task]:
        for j, resp in enumerate(sample["resps"]):
            out[(sample["doc_id"], j)] = float(resp[0][0])
    return out


def test_multiple_choice_loglikelihoods_match_hf_backend(tiny_dir_server, tiny_model_dir, lm_eval_tasks):
    task = "segserve_tiny_mc"
    local = _local_args(tiny_dir_server, tiny_model_dir)
    ours = _evaluate(lm_eval_tasks, task, "local-completions", local, 4)
    hf = _evaluate(lm_eval_tasks, task, "hf", {"pretrained": str(tiny_model_dir), "dtype": "float32",
                                              "device": "cpu"}, 4)
    ll_ours, ll_hf = _loglikelihoods(ours, task), _loglikelihoods(hf, task)
    assert sorted(ll_ours) == sorted(ll_hf) and len(ll_ours) == 21  # 6 questions, 21 choices
    for key, value in ll_hf.items():
        assert ll_ours[key] == pytest.approx(value, abs=1e-4), key
    assert all(v < 0 for v in ll_ours.values())
    assert ours["results"][task]["acc,none"] == hf["results"][task]["acc,none"]
    tiny_dir_server.assert_idle_and_clean()


def test_generate_until_batched_matches_hf_backend(tiny_dir_server, tiny_model_dir, lm_eval_tasks):
    task = "segserve_tiny_gen"
    local = _local_args(tiny_dir_server, tiny_model_dir)
    ours = _evaluate(lm_eval_tasks, task, "local-completions", local, 3)
    hf = _evaluate(lm_eval_tasks, task, "hf", {"pretrained": str(tiny_model_dir), "dtype": "float32",
                                              "device": "cpu"}, 3)
    gen_ours = {s["doc_id"]: s["resps"][0][0] for s in ours["samples"][task]}
    gen_hf = {s["doc_id"]: s["resps"][0][0] for s in hf["samples"][task]}
    assert len(gen_ours) == 5
    assert gen_ours == gen_hf
    assert any(gen_ours.values()), "every generation came back empty"
    tiny_dir_server.assert_idle_and_clean()
