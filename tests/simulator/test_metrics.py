"""Metric names and values on hand-made timelines; SLO parsing."""

from __future__ import annotations

import math

import pytest

from segserve.simulator.metrics import SLO, parse_slo, percentile, slo_met, summarize
from segserve.simulator.replica import RequestRecord


def _records() -> list[RequestRecord]:
    a = RequestRecord("a", 0.0, 100, 3, token_times=[1.0, 1.5, 2.5])
    b = RequestRecord("b", 1.0, 50, 2, token_times=[4.0, 4.1])
    bad = RequestRecord("c", 2.0, 10**6, 2, error="too long")
    return [a, b, bad]


def test_summary_values():
    s = summarize(_records(), parse_slo("ttft_p99=2s,tpot_p99=200ms"))
    assert (s["completed"], s["failed"], s["duration"]) == (2, 1, 4.1)
    assert s["request_throughput"] == pytest.approx(2 / 4.1)
    assert s["output_throughput"] == pytest.approx(5 / 4.1)
    assert s["total_token_throughput"] == pytest.approx(155 / 4.1)
    assert s["mean_ttft_ms"] == pytest.approx(2000.0)  # TTFTs 1 s and 3 s
    assert s["median_itl_ms"] == pytest.approx(500.0)  # ITLs 0.5, 1.0, 0.1 s
    assert s["mean_tpot_ms"] == pytest.approx((750 + 100) / 2)
    assert s["p99_e2el_ms"] == pytest.approx(2500 + 0.99 * 600)
    # a: TTFT 1 s ok, TPOT 750 ms too slow; b: TTFT 3 s too slow -> nobody meets both.
    assert s["request_goodput"] == 0.0
    assert summarize(_records(), parse_slo("ttft_p99=4s,tpot_p99=1s"))["request_goodput"] == pytest.approx(
        2 / 4.1
    )


def test_percentile_interpolates():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([10.0], 99) == 10.0
    assert math.isnan(percentile([], 50))


def test_parse_slo():
    assert parse_slo("itl_p99=50ms, ttft_p99=2s") == [SLO("itl", "p99", 0.05), SLO("ttft", "p99", 2.0)]
    assert SLO("ttft", "p50", 1.0).key == "median_ttft_ms"
    for text, msg in [
        ("latency_p99=5ms", "expected <ttft\\|tpot\\|itl\\|e2el>_<mean"),
        ("itl_p95=5ms", "expected"),
        ("itl_p99=5", "the value needs a unit, ms or s"),
        ("itl_p99=0ms", "the value must be a finite number > 0"),
        ("itl_p99=nanms", "'itl_p99=nanms': the value must be a finite number > 0"),
        ("ttft_p99=infs", "the value must be a finite number > 0"),
        ("itl_p99=abcms", "SLO 'itl_p99=abcms': 'abc' is not a number"),
        ("", "no SLO in ''"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse_slo(text)


def test_slo_met_on_aggregates():
    s = {"p99_itl_ms": 40.0, "p99_ttft_ms": 2500.0}
    assert slo_met(s, parse_slo("itl_p99=50ms"))
    assert not slo_met(s, parse_slo("itl_p99=50ms,ttft_p99=2s"))
    assert not slo_met({"p99_itl_ms": math.nan}, parse_slo("itl_p99=50ms"))


def test_tune_breaks_a_goodput_tie_by_the_widest_slo_margin():
    # The real tune run that missed on the engine: five settings served every request (goodput 0.440-
    # 0.441 req/s) and the highest goodput belonged to the one with 2 % of room under p99 ITL 400 ms.
    from segserve.simulator.tune import choose_best, slo_margin

    slos = parse_slo("itl_p99=400ms,ttft_p99=3s")

    def row(budget, policy, goodput, itl, ttft):
        return {"max_num_batched_tokens": budget, "policy": policy, "request_goodput": goodput,
                "p99_itl_ms": itl, "p99_ttft_ms": ttft, "meets_slo": itl <= 400 and ttft <= 3000}

    rows = [row(64, "decode_first", 0.4400, 147, 1844), row(128, "decode_first", 0.4400, 233, 1695),
            row(128, "prefill_first", 0.4410, 392, 1851), row(256, "decode_first", 0.4410, 432, 1602),
            row(512, "decode_first", 0.3000, 100, 100)]
    assert slo_margin(rows[1], slos) == pytest.approx(min(167 / 400, 1305 / 3000))
    best = choose_best(rows, slos)
    assert (best["max_num_batched_tokens"], best["policy"]) == (128, "decode_first")  # 42 % room
    rows.append(row(32, "decode_first", 0.5, 399, 2999))  # clearly more goodput wins despite no room
    assert choose_best(rows, slos)["max_num_batched_tokens"] == 32
    assert choose_best([r | {"meets_slo": False} for r in rows], slos) is None
