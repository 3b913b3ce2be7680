"""Prometheus metrics and the periodic log line, both fed by the engine thread after every step.

Metric names are vLLM's (``vllm:`` prefix, ``model_name`` label) so dashboards and load generators
written for vLLM read them unchanged: ``vllm:num_requests_running``/``waiting``,
``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_queries``/``hits`` (tokens),
``vllm:num_preemptions``, ``vllm:prompt_tokens``/``vllm:generation_tokens``,
``vllm:request_success`` (by ``finished_reason``) and the histograms
``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
``vllm:e2e_request_latency_seconds``, ``vllm:request_queue_time_seconds``; per finished request
``vllm:request_prompt_tokens`` / ``vllm:request_generation_tokens`` (1-2-5 buckets up to
``max_model_len``) and ``vllm:request_prefill_time_seconds`` (first scheduled to first token),
``vllm:request_decode_time_seconds`` (first to last token), ``vllm:request_inference_time_seconds``
(first scheduled to last token), with vLLM 0.32's request-latency buckets,
``vllm:request_time_per_output_token_seconds`` (decode time over the tokens after the first),
``vllm:request_prefill_kv_computed_tokens`` (prompt tokens not served by the prefix cache), and per
request (all completions) ``vllm:request_params_n`` and ``vllm:request_max_num_generation_tokens``, per
completion ``vllm:request_params_max_tokens``; the counter ``vllm:prompt_tokens_cached``; the gauge
``vllm:num_requests_waiting_by_reason`` (``capacity``; ``deferred``: waiting for a grammar, counted in
``vllm:num_requests_waiting`` too, as vLLM does); per step
``vllm:iteration_tokens_total`` (prompt tokens computed plus tokens generated). A request of ``n``
completions counts as ``n`` requests (successes, prompts, latencies), as vLLM, whose engine runs each
completion as a request. Every metric carries
vLLM v1's labels ``model_name`` and ``engine`` (``"0"``: one engine). Counters carry the ``_total``
suffix in the exposition, as ``prometheus_client`` writes them.

segserve's own, under ``segserve:``: ``segserve:max_num_batched_tokens`` (the step budget, label
``source`` = ``auto`` or ``given``) beside vLLM's ``vllm:cache_config_info`` (an info gauge of 1 whose
labels are the cache settings), and the step model's live error when the engine has a
``step_monitor``: the histogram ``segserve:step_time_predicted_over_actual`` (one observation per
step: predicted / measured step time) and the gauge ``segserve:step_time_prediction_median_error``
(median ``|predicted / actual - 1|`` over the monitor's last window). Where the engine loop's time
goes, read at scrape time (``watch_loop``): the counters ``segserve:engine_busy_seconds`` (wall time
of loop iterations that stepped: queued commands, the step, these observers),
``segserve:engine_step_seconds`` (inside ``LLMEngine.step``) and ``segserve:model_execute_seconds``
(inside the model runner: forward and sampling); ``1 - model / busy`` over an interval is the share of
the loop spent outside the model (issue 12's lean-server check: ``benchmarks/vs_vllm.py``'s
``server_overhead``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from segserve.core.scheduler_stats import SchedulerStats
from segserve.engine.async_engine import StepInfo
from segserve.outputs import RequestOutput

logger = logging.getLogger("segserve")

# Bucket edges, seconds: CPU serving spans milliseconds (a decode) to minutes (a long prompt queued).
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 20.0, 40.0, 80.0, 160.0)
# Predicted / actual step time: 1 is a perfect prediction; 0.8-1.25 is within the 20 % warning line.
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 4.0)
# vLLM 0.32's edges for the per-request phase times (seconds) and the per-step token counts.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
ENGINE_INDEX = "0"


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """vLLM's ``build_1_2_5_buckets``: 1, 2, 5, 10, 20, 50, ... up to ``max_value`` inclusive."""
    out, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(out)
            out.append(value)
        exponent += 1


class EngineMetrics:
    """Prometheus collectors for one served model, registered in their own registry.

    Args:
        model_name: value of the ``model_name`` label (the served model name).
        registry: where to register; a fresh ``CollectorRegistry`` by default, so several servers in
            one process (tests) do not collide.
        max_model_len: top of the per-request token-count buckets, tokens.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 max_model_len: int = 2**20) -> None:
        self.registry = registry or CollectorRegistry()
        self.max_model_len = max_model_len
        self.labels = {"model_name": model_name, "engine": ENGINE_INDEX}
        self._children: dict[int, object] = {}  # id(metric) -> its child for ``labels`` (``_of``)
        r, names = self.registry, ["model_name", "engine"]
        self.names = names
        self.running = Gauge("vllm:num_requests_running", "Requests running", names, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting (for room, or for their grammar)",
                             names, registry=r)
        by_reason = Gauge("vllm:num_requests_waiting_by_reason", "Waiting requests by reason: capacity (for "
                          "room in the batch or the KV cache), deferred (for their grammar to compile)",
                          names + ["reason"], registry=r)
        self._waiting_capacity = by_reason.labels(**self.labels, reason="capacity")
        self._waiting_deferred = by_reason.labels(**self.labels, reason="deferred")
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = 100%)", names, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the "
                                      "prefix cache", names, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens served by the prefix cache",
                                   names, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions", names, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of requests that produced "
                                     "output", names, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", names, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests", names + ["finished_reason"],
                               registry=r)
        self.ttft = self._hist("vllm:time_to_first_token_seconds", "Time to first token")
        self.itl = self._hist("vllm:inter_token_latency_seconds", "Time between output tokens")
        self.e2e = self._hist("vllm:e2e_request_latency_seconds", "Arrival to finish")
        self.queue_time = self._hist("vllm:request_queue_time_seconds", "Arrival to first scheduled")
        tokens = buckets_1_2_5(max_model_len)
        self.request_prompt = self._hist("vllm:request_prompt_tokens", "Prompt tokens per finished request",
                                         tokens)
        self.request_generation = self._hist("vllm:request_generation_tokens", "Generated tokens per "
                                             "finished request", tokens)
        self.prefill_time = self._hist("vllm:request_prefill_time_seconds", "First scheduled to first token",
                                       REQUEST_LATENCY_BUCKETS)
        self.decode_time = self._hist("vllm:request_decode_time_seconds", "First to last token",
                                      REQUEST_LATENCY_BUCKETS)
        self.inference_time = self._hist("vllm:request_inference_time_seconds", "First scheduled to last "
                                         "token", REQUEST_LATENCY_BUCKETS)
        self.request_tpot = self._hist("vllm:request_time_per_output_token_seconds", "Mean time per output "
                                       "token after the first, per finished request")
        self.params_max_tokens = self._hist("vllm:request_params_max_tokens", "The max_tokens request "
                                            "parameter, per finished request", tokens)
        self.params_n = self._hist("vllm:request_params_n", "The n request parameter",
                                   REQUEST_PARAMS_N_BUCKETS)
        self.max_generation = self._hist("vllm:request_max_num_generation_tokens", "Most tokens one "
                                         "completion of a request generated", tokens)
        self.prefill_kv_computed = self._hist("vllm:request_prefill_kv_computed_tokens", "Prompt tokens "
                                              "computed (not served by the prefix cache), per finished "
                                              "request", tokens)
        self.prompt_cached = Counter("vllm:prompt_tokens_cached", "Prompt tokens served by the prefix cache, "
                                     "per request", names, registry=r)
        self.iteration_tokens = self._hist("vllm:iteration_tokens_total", "Prompt plus generated tokens per "
                                           "engine step", ITERATION_TOKEN_BUCKETS)
        self._last_prompt_computed = 0
        self.budget = Gauge("segserve:max_num_batched_tokens", "Per-step token budget (source: auto or "
                            "given)", names + ["source"], registry=r)
        cache_labels = ["block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks"]
        self.cache_info = Gauge("vllm:cache_config_info", "Cache settings (labels; value 1)",
                                names + cache_labels, registry=r)
        self.step_ratio = Histogram("segserve:step_time_predicted_over_actual", "Step-time model's "
                                    "predicted / measured step time", names, buckets=RATIO_BUCKETS,
                                    registry=r)
        self.step_error = Gauge("segserve:step_time_prediction_median_error", "Median |predicted / actual "
                                "- 1| of step times over the last window", names, registry=r)
        self._monitored_steps = 0
        self._last_prefix = (0, 0)
        self._last_preemptions = 0
        # Request id -> per completion: tokens seen, and the time of its latest (inter-token latency).
        self._seen: dict[str, list[int]] = {}
        self._last_token: dict[str, list[float]] = {}
        self._max_tokens: dict[str, int | None] = {}  # request id -> its max_tokens (on_add)

    def _of(self, metric):
        """``metric``'s child for this model's labels, looked up once: ``labels()`` checks and locks on
        every call, and the engine thread updates a dozen metrics per step."""
        child = self._children.get(id(metric))
        if child is None:
            child = self._children[id(metric)] = metric.labels(**self.labels)
        return child

    def _hist(self, name: str, doc: str, buckets: tuple = LATENCY_BUCKETS) -> Histogram:
        return Histogram(name, doc, self.names, buckets=buckets, registry=self.registry)

    def describe_engine(self, engine, budget_source: str = "given") -> None:
        """Export the engine's settings (once, at start-up): the step budget and the cache settings."""
        cfg = engine.config
        self.budget.labels(**self.labels, source=budget_source).set(cfg.scheduler.max_num_batched_tokens)
        dtype = str(next(engine.loaded.model.parameters()).dtype).removeprefix("torch.")
        self.cache_info.labels(
            **self.labels, block_size=str(cfg.cache.block_size), cache_dtype=dtype,
            enable_prefix_caching=str(cfg.cache.enable_prefix_caching),
            num_gpu_blocks=str(engine.num_kv_blocks),
        ).set(1)

    def watch_loop(self, engine) -> None:
        """Export ``engine``'s (an ``AsyncLLMEngine``) loop, step and model seconds at scrape time."""
        self.registry.register(_LoopTimeCollector(engine, self.labels))

    def on_step(self, info: StepInfo) -> None:
        """Update gauges and counters from one step (engine thread)."""
        self._step_error(info.engine.step_monitor)
        stats = info.engine.scheduler.make_stats()
        self._of(self.running).set(stats.num_running)
        # vLLM counts requests waiting for their grammar as waiting ("deferred"); segserve holds them
        # beside the scheduler (GrammarGate).
        deferred = info.engine.num_awaiting_grammar
        self._of(self.waiting).set(stats.num_waiting + deferred)
        self._waiting_capacity.set(stats.num_waiting)
        self._waiting_deferred.set(deferred)
        self._of(self.kv_usage).set(stats.kv_cache_usage)
        self._cache_and_preemption_deltas(stats)
        computed = stats.num_prompt_tokens_computed
        step_tokens = computed - self._last_prompt_computed + sum(info.new_tokens.values())
        self._last_prompt_computed = computed
        if step_tokens > 0:
            self._of(self.iteration_tokens).observe(step_tokens)
        for out in info.outputs:
            self._request_step(out, info.new_tokens.get(out.request_id, 0), info.now)

    def _step_error(self, monitor) -> None:
        """The monitor's latest ratio, once per measured step (idle calls observe nothing)."""
        if monitor is None or monitor.num_steps == self._monitored_steps:
            return
        self._monitored_steps = monitor.num_steps
        self._of(self.step_ratio).observe(monitor.last_ratio)
        if monitor.num_steps % monitor.window == 0:
            self._of(self.step_error).set(monitor.last_median_error)

    def _cache_and_preemption_deltas(self, stats: SchedulerStats) -> None:
        queries, hits = stats.prefix_cache.queries, stats.prefix_cache.hits
        self._of(self.prefix_queries).inc(queries - self._last_prefix[0])
        self._of(self.prefix_hits).inc(hits - self._last_prefix[1])
        self._last_prefix = (queries, hits)
        preemptions = stats.num_preemptions
        self._of(self.preemptions).inc(preemptions - self._last_preemptions)
        self._last_preemptions = preemptions

    def _request_step(self, out: RequestOutput, new_tokens: int, now: float) -> None:
        """One request's progress in a step. Each of its ``n`` completions counts as a request, as in
        vLLM, whose engine runs each as a request of its own: its own prompt, first token, gaps between
        its tokens, finish."""
        m = out.metrics
        n = len(out.outputs)
        seen = self._seen.setdefault(out.request_id, [0] * n)  # tokens so far, per completion
        last = self._last_token.setdefault(out.request_id, [0.0] * n)  # time of its latest token
        self._of(self.generation_tokens).inc(new_tokens)
        for c in out.outputs:
            got = len(c.token_ids) - seen[c.index]
            if got <= 0:
                continue
            if seen[c.index] == 0:
                self._of(self.prompt_tokens).inc(len(out.prompt_token_ids))
                self._of(self.prompt_cached).inc(out.num_cached_tokens)
                if m is not None and m.ttft is not None:  # completion 0's is the request's own
                    self._of(self.ttft).observe(m.ttft if c.index == 0 else now - m.arrival_time)
                if m is not None and m.time_in_queue is not None:
                    self._of(self.queue_time).observe(m.time_in_queue)
            else:
                self._of(self.itl).observe(now - last[c.index])
            seen[c.index] += got
            last[c.index] = now
        if out.finished:
            self._seen.pop(out.request_id, None)
            self._last_token.pop(out.request_id, None)
            # Not given: the room left, as vLLM's server fills it in (max_model_len - prompt).
            max_tokens = self._max_tokens.pop(out.request_id, None) or self.max_model_len - len(
                out.prompt_token_ids)
            self._observe(self.params_max_tokens, max_tokens, n)
            for c in out.outputs:
                self.success.labels(**self.labels, finished_reason=c.finish_reason or "abort").inc()
            if m is not None and m.finished_time is not None:
                self._observe(self.e2e, m.finished_time - m.arrival_time, n)
            self._finished_request(out)

    def _observe(self, metric, value: float, times: int) -> None:
        child = self._of(metric)
        for _ in range(times):
            child.observe(value)

    def _finished_request(self, out: RequestOutput) -> None:
        """Per-request token counts and phase times (vLLM's ``FinishedRequestStats``), one a completion."""
        m = out.metrics
        n = len(out.outputs)
        self._observe(self.request_prompt, len(out.prompt_token_ids), n)
        self._observe(self.prefill_kv_computed, len(out.prompt_token_ids) - out.num_cached_tokens, n)
        for c in out.outputs:
            self._of(self.request_generation).observe(len(c.token_ids))
        self._of(self.params_n).observe(n)  # per request, as vLLM's parent requests
        self._of(self.max_generation).observe(max(len(c.token_ids) for c in out.outputs))
        if m is None or m.first_scheduled_time is None or m.first_token_time is None:
            return
        last = m.last_token_time if m.last_token_time is not None else m.first_token_time
        decode = last - m.first_token_time
        self._observe(self.prefill_time, m.first_token_time - m.first_scheduled_time, n)
        self._observe(self.decode_time, decode, n)
        self._observe(self.inference_time, last - m.first_scheduled_time, n)
        for c in out.outputs:  # vLLM's mean_time_per_output_token: 0 for a single token
            after_first = len(c.token_ids) - 1
            self._of(self.request_tpot).observe(decode / after_first if after_first > 0 else 0.0)

    def on_add(self, request_id: str, params) -> None:
        """Note the request's ``max_tokens`` for ``vllm:request_params_max_tokens`` (engine thread)."""
        self._max_tokens[request_id] = params.max_tokens

    def on_abort(self, request_id: str) -> None:
        """An aborted request sends no final output: count it (each completion once it has output) and
        drop its state (engine thread)."""
        self._last_token.pop(request_id, None)
        self._max_tokens.pop(request_id, None)
        n = len(self._seen.pop(request_id, [0]))
        self.success.labels(**self.labels, finished_reason="abort").inc(n)


class _LoopTimeCollector(Collector):
    """The three time counters of ``EngineMetrics.watch_loop``, read from the live engine: plain float
    attributes written by the engine thread, so a scrape costs the engine nothing."""

    COUNTERS = (
        ("segserve:engine_busy_seconds", "Wall time of engine-loop iterations that ran a step", "busy"),
        ("segserve:engine_step_seconds", "Time inside LLMEngine.step", "step"),
        ("segserve:model_execute_seconds", "Time inside the model runner (forward and sampling)", "model"),
    )

    def __init__(self, engine, labels: dict[str, str]) -> None:
        self.engine = engine
        self.labels = labels

    def collect(self):
        values = {"busy": self.engine.busy_seconds, "step": self.engine.engine.step_seconds,
                  "model": self.engine.engine.model_seconds}
        for name, doc, key in self.COUNTERS:
            family = CounterMetricFamily(name, doc, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), values[key])
            yield family


@dataclass
class StatLogger:
    """Logs one vLLM-style line every ``interval_s`` seconds while the engine has or had work.

    ``Avg prompt throughput: P tokens/s, Avg generation throughput: G tokens/s, Running: R reqs,
    Waiting: W reqs, KV cache usage: U%, Prefix cache hit rate: H%`` (throughputs over the interval,
    the hit rate since start, in tokens).
    """

    interval_s: float = 10.0
    _last_time: float | None = None
    _last_prompt: int = 0
    _generated: int = 0

    def on_add(self, request_id: str, params) -> None:
        """Nothing to note: the line has no per-request state."""

    def on_abort(self, request_id: str) -> None:
        """Nothing to forget: the line has no per-request state."""

    def on_step(self, info: StepInfo) -> None:
        self._generated += sum(info.new_tokens.values())
        if self._last_time is None:
            self._last_time = info.now
            return
        elapsed = info.now - self._last_time
        if elapsed < self.interval_s:
            return
        stats = info.engine.scheduler.make_stats()
        prompt = stats.num_prompt_tokens_computed
        if prompt == self._last_prompt and not self._generated and not info.engine.has_unfinished_requests():
            self._last_time = info.now  # idle: say nothing, as vLLM does
            return
        line = self.line(stats, (prompt - self._last_prompt) / elapsed, self._generated / elapsed)
        logger.info(line)
        self._last_time, self._last_prompt, self._generated = info.now, prompt, 0

    @staticmethod
    def line(stats: SchedulerStats, prompt_tps: float, gen_tps: float) -> str:
        """The log line for a scheduler snapshot and the interval's throughputs (tokens/s)."""
        return (
            f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, Avg generation throughput: {gen_tps:.1f} "
            f"tokens/s, Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, KV cache "
            f"usage: {100 * stats.kv_cache_usage:.1f}%, Prefix cache hit rate: "
            f"{100 * stats.prefix_cache.hit_rate:.1f}%"
        )
