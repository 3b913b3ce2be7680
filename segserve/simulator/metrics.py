"""Benchmark metrics under the names vLLM's ``bench serve`` uses (and ``segserve bench serve``).

Per request: TTFT = first token time - arrival; ITL = gaps between consecutive tokens; TPOT =
(last token - first token) / (output tokens - 1); E2EL = last token - arrival. Aggregates are
``mean_*_ms``, ``median_*_ms``, ``std_*_ms`` and ``p99_*_ms`` (linear-interpolated percentiles, as
numpy's default). Goodput counts requests per second that meet every per-request SLO (vLLM's
``--goodput``: ttft against TTFT, tpot and itl against the request's TPOT, e2el against E2EL).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from segserve.simulator.replica import RequestRecord, StepRecord

SLO_METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_STATS = ("mean", "median", "p50", "p90", "p99")


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class SLO:
    """One target: ``stat`` (mean, median/p50, p90, p99) of ``metric`` (ttft, tpot, itl, e2el) <= seconds."""

    metric: str
    stat: str
    seconds: float

    @property
    def key(self) -> str:
        """The summary key it reads, e.g. ``p99_itl_ms``."""
        stat = "median" if self.stat == "p50" else self.stat
        return f"{stat}_{self.metric}_ms"


def parse_slo(text: str) -> list[SLO]:
    """Parse ``"itl_p99=50ms,ttft_p99=2s"`` (units ms or s).

    Raises:
        ValueError: an unknown metric or statistic, a missing unit, a value that is not a finite number
            > 0, naming the item.
    """
    slos = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = item.partition("=")
        metric, _, stat = name.strip().partition("_")
        if metric not in SLO_METRICS or stat not in SLO_STATS:
            raise ValueError(
                f"SLO {item!r}: expected <{'|'.join(SLO_METRICS)}>_<{'|'.join(SLO_STATS)}>=<value>"
            )
        value = value.strip()
        if value.endswith("ms"):
            number, scale = value[:-2], 1e-3
        elif value.endswith("s"):
            number, scale = value[:-1], 1.0
        else:
            raise ValueError(f"SLO {item!r}: the value needs a unit, ms or s (e.g. 50ms, 2s)")
        try:
            seconds = float(number) * scale
        except ValueError:
            raise ValueError(f"SLO {item!r}: {number!r} is not a number") from None
        if not math.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"SLO {item!r}: the value must be a finite number > 0")
        slos.append(SLO(metric, stat, seconds))
    if not slos:
        raise ValueError(f"no SLO in {text!r}")
    return slos


def _tpot(r: RequestRecord) -> float | None:
    n = len(r.token_times)
    return (r.token_times[-1] - r.token_times[0]) / (n - 1) if n > 1 else None


def latency_stats(name: str, seconds: list[float]) -> dict[str, float]:
    """``{mean,median,std,p90,p99}_{name}_ms`` of latencies given in seconds (vLLM ``bench serve`` keys);
    NaN for an empty list. Shared by the simulator and ``segserve bench serve``."""
    ms = [x * 1000.0 for x in seconds]
    return {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else math.nan,
        f"median_{name}_ms": percentile(ms, 50),
        f"std_{name}_ms": statistics.pstdev(ms) if ms else math.nan,
        f"p90_{name}_ms": percentile(ms, 90),
        f"p99_{name}_ms": percentile(ms, 99),
    }


def meets_request_slos(r: RequestRecord, slos: list[SLO]) -> bool:
    """Per-request SLO check for goodput (see the module docstring)."""
    values = {"ttft": r.token_times[0] - r.arrival, "e2el": r.token_times[-1] - r.arrival}
    tpot = _tpot(r)
    values["tpot"] = values["itl"] = 0.0 if tpot is None else tpot
    return all(values[s.metric] <= s.seconds for s in slos)


def summarize(requests: list[RequestRecord], slos: list[SLO] | None = None) -> dict[str, float]:
    """vLLM ``bench serve`` result fields for finished requests (rejected ones count as failed)."""
    done = [r for r in requests if r.finished]
    start = min((r.arrival for r in requests), default=0.0)
    end = max((r.token_times[-1] for r in done), default=start)
    duration = end - start
    out_tokens = sum(len(r.token_times) for r in done)
    in_tokens = sum(r.input_len for r in done)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    result = {
        "duration": duration,
        "completed": len(done),
        "failed": len(requests) - len(done),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
    }
    if slos:
        result["request_goodput"] = per_s(sum(meets_request_slos(r, slos) for r in done))
    itls = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    result |= latency_stats("ttft", [r.token_times[0] - r.arrival for r in done])
    result |= latency_stats("tpot", [t for t in map(_tpot, done) if t is not None])
    result |= latency_stats("itl", itls)
    result |= latency_stats("e2el", [r.token_times[-1] - r.arrival for r in done])
    result["num_preemptions"] = sum(r.num_preemptions for r in requests)
    return result


def step_summary(steps: list[StepRecord]) -> dict[str, float]:
    """Step-time, batch-size and KV-usage distributions over the run."""
    dur = [s.duration * 1000.0 for s in steps]
    reqs = [float(s.num_requests) for s in steps]
    toks = [float(s.num_tokens) for s in steps]
    kv = [s.kv_usage for s in steps]
    out = {"num_steps": len(steps)}
    for name, xs in (
        ("step_time_ms", dur),
        ("batch_requests", reqs),
        ("batch_tokens", toks),
        ("kv_usage", kv),
    ):
        out[f"mean_{name}"] = statistics.fmean(xs) if xs else math.nan
        out[f"median_{name}"] = percentile(xs, 50)
        out[f"p99_{name}"] = percentile(xs, 99)
        out[f"max_{name}"] = max(xs, default=math.nan)
    return out


def slo_met(summary: dict[str, float], slos: list[SLO]) -> bool:
    """True when every aggregate SLO holds (a NaN metric never meets one)."""
    return all(summary.get(s.key, math.nan) <= s.seconds * 1000.0 for s in slos)
