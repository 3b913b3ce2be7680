"""``/metrics`` exports the step budget, the cache settings and the step model's live error."""

from __future__ import annotations

import httpx

from segserve.engine.step_monitor import StepErrorMonitor
from segserve.simulator.step_model import LinearStepModel
from tests.server.conftest import TINY_ENGINE
from tests.server.harness import SERVED_NAME, metric, running_server, scrape


def test_metrics_export_budget_cache_info_and_step_error(tiny_loaded):
    from segserve import LLMEngine

    engine = LLMEngine(tiny_loaded, **TINY_ENGINE)
    engine.step_monitor = StepErrorMonitor(LinearStepModel({"step": 1e-3}), window=4)
    with running_server(engine) as (handle, _):
        body = {"model": SERVED_NAME, "prompt": "hello there", "max_tokens": 6, "ignore_eos": True}
        assert httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=30).status_code == 200
        steps = handle.on_engine(lambda: engine.step_monitor.num_steps)
        samples = scrape(handle.base_url)
    assert metric(samples, "segserve:max_num_batched_tokens", source="given") == 256
    info = {"block_size": "8", "cache_dtype": "float32", "enable_prefix_caching": "True",
            "num_gpu_blocks": str(engine.num_kv_blocks)}
    assert metric(samples, "vllm:cache_config_info", **info) == 1
    assert steps >= 6 and metric(samples, "segserve:step_time_predicted_over_actual_count") == steps
    assert metric(samples, "segserve:step_time_prediction_median_error") > 0


def test_metrics_export_loop_step_and_model_seconds(tiny_loaded):
    """The three time counters read the live engine: model <= step <= busy, all > 0 after a request,
    and they equal the engine's own totals (nothing but the engine thread writes them)."""
    from segserve import LLMEngine

    engine = LLMEngine(tiny_loaded, **TINY_ENGINE)
    with running_server(engine) as (handle, _):
        before = scrape(handle.base_url)
        assert metric(before, "segserve:engine_busy_seconds_total") == 0.0
        body = {"model": SERVED_NAME, "prompt": "hello there", "max_tokens": 6, "ignore_eos": True}
        assert httpx.post(f"{handle.base_url}/v1/completions", json=body, timeout=30).status_code == 200
        totals = handle.on_engine(lambda: (engine.model_seconds, engine.step_seconds))
        samples = scrape(handle.base_url)
    busy = metric(samples, "segserve:engine_busy_seconds_total")
    step = metric(samples, "segserve:engine_step_seconds_total")
    model = metric(samples, "segserve:model_execute_seconds_total")
    assert (model, step) == totals
    assert 0 < model <= step <= busy
