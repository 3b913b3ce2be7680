"""Workloads: trace files, re-timing, synthetic arrivals, prompts from hash ids."""

from __future__ import annotations

import statistics

import pytest

from segserve.simulator.workload import (
    HASH_BLOCK_TOKENS,
    TraceRequest,
    load_trace,
    prompt_token_ids,
    retime,
    scale_lengths,
    synthetic,
)

TRACES = "/work/shared/data/traces"


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_azure_csv(tmp_path):
    path = _write(
        tmp_path,
        "a.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,0\n"
        "2023-11-16 18:15:51.0000000,10,5\n",
    )
    reqs = load_trace(path, limit=2)
    assert [(r.input_len, r.output_len, r.hash_ids) for r in reqs] == [(374, 44, None), (396, 1, None)]
    assert reqs[0].arrival == 0.0 and reqs[1].arrival == pytest.approx(4.314579, abs=1e-6)


def test_mooncake_jsonl_slice(tmp_path):
    rows = [
        '{"timestamp": 1000, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}',
        '{"timestamp": 2500, "input_length": 700, "output_length": 3, "hash_ids": [0, 2]}',
        '{"timestamp": 4000, "input_length": 10, "output_length": 3, "hash_ids": [3]}',
    ]
    reqs = load_trace(_write(tmp_path, "m.jsonl", "\n".join(rows) + "\n"), offset=1)
    assert [(r.arrival, r.input_len, r.hash_ids) for r in reqs] == [(0.0, 700, (0, 2)), (1.5, 10, (3,))]


def test_real_traces_load():
    azure = load_trace(f"{TRACES}/azure2023_code.csv", limit=50)
    mooncake = load_trace(f"{TRACES}/mooncake_conversation.jsonl", limit=50)
    assert len(azure) == len(mooncake) == 50
    assert all(r.hash_ids for r in mooncake) and all(r.hash_ids is None for r in azure)
    assert mooncake[0].input_len == 6758 and mooncake[0].hash_ids[:3] == (0, 1, 2)


def test_bad_trace_input(tmp_path):
    with pytest.raises(ValueError, match="must be .csv \\(Azure\\) or .jsonl \\(Mooncake\\), got '.txt'"):
        load_trace(_write(tmp_path, "t.txt", ""))
    with pytest.raises(ValueError, match="has no requests in \\[offset=5, limit=None\\]"):
        load_trace(
            _write(tmp_path, "e.jsonl", '{"timestamp": 0, "input_length": 3, "output_length": 1}\n'), offset=5
        )
    with pytest.raises(ValueError, match="offset must be >= 0 and limit >= 1, got 0, 0"):
        load_trace(f"{TRACES}/azure2023_code.csv", limit=0)
    with pytest.raises(ValueError, match="input_len and output_len must be >= 1, got 0, 5"):
        TraceRequest(0.0, 0, 5)
    with pytest.raises(ValueError, match="arrival must be a finite time >= 0 s, got -1.0"):
        TraceRequest(-1.0, 3, 5)


def test_retime_rate_and_burstiness():
    reqs = [TraceRequest(0.0, 10, 2)] * 4001
    for burstiness in (1.0, 0.25):
        out = retime(reqs, rate=20.0, burstiness=burstiness, seed=3)
        gaps = [b.arrival - a.arrival for a, b in zip(out, out[1:], strict=False)]
        assert statistics.fmean(gaps) == pytest.approx(0.05, rel=0.1)
        # Gamma inter-arrivals: coefficient of variation = 1 / sqrt(shape).
        assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(burstiness**-0.5, rel=0.1)
    assert {r.arrival for r in retime(reqs[:5], rate=None)} == {0.0}
    with pytest.raises(ValueError, match="rate must be > 0 requests/s, got 0"):
        retime(reqs, rate=0)
    with pytest.raises(ValueError, match="burstiness must be > 0, got -1"):
        retime(reqs, rate=1, burstiness=-1)


def test_synthetic_shared_prefix():
    reqs = synthetic(4, rate=2.0, input_len=1500, output_len=20, prefix_len=1100, seed=1)
    assert [r.hash_ids[:2] for r in reqs] == [(0, 1)] * 4  # 1100 tokens -> 2 whole shared blocks
    own = [r.hash_ids[2:] for r in reqs]
    assert len({h for ids in own for h in ids}) == sum(len(ids) for ids in own)  # never shared
    assert reqs[0].arrival == 0.0 and reqs[-1].arrival > 0
    with pytest.raises(ValueError, match="prefix_len=1500 must be shorter than every input"):
        synthetic(2, None, 1500, 10, prefix_len=1500)
    with pytest.raises(ValueError, match="num_requests must be >= 1, got 0"):
        synthetic(0, None, 10, 10)
    with pytest.raises(ValueError, match="length_jitter must be in \\[0, 1\\), got 1.0"):
        synthetic(2, None, 10, 10, length_jitter=1.0)


@pytest.mark.parametrize("vocab", [None, 49152])
def test_equal_hash_ids_give_equal_token_blocks(vocab):
    a = prompt_token_ids(TraceRequest(0, 1200, 1, (4, 8, 9)), 0, vocab)
    b = prompt_token_ids(TraceRequest(0, 1100, 1, (4, 8, 7)), 1, vocab)
    c = prompt_token_ids(TraceRequest(0, 700, 1, (5, 8)), 2, vocab)
    n = 2 * HASH_BLOCK_TOKENS
    assert len(a) == 1200 and len(b) == 1100 and len(c) == 700
    assert a[:n] == b[:n] and a[n:1100] != b[n:1100]
    assert a[:HASH_BLOCK_TOKENS] != c[:HASH_BLOCK_TOKENS]
    if vocab:
        assert 0 <= min(a) and max(a) < vocab


def test_prompts_without_hash_ids_share_nothing():
    a = prompt_token_ids(TraceRequest(0, 600, 1), 0)
    b = prompt_token_ids(TraceRequest(0, 600, 1), 1)
    assert len(a) == len(b) == 600 and a[:16] != b[:16]


def test_scale_lengths_trims_hash_ids():
    out = scale_lengths([TraceRequest(0.0, 6758, 500, tuple(range(14)))], max_input=1024, max_output=64)
    assert (out[0].input_len, out[0].output_len, out[0].hash_ids) == (1024, 64, (0, 1))
