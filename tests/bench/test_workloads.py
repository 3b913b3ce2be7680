"""Benchmark workloads: seeded, exact lengths, clipped to the context, shared Mooncake prefixes."""

from __future__ import annotations

from importlib import resources

import pytest

from segserve.bench.workloads import BenchRequest, make_workload


def _make(kind: str, n: int = 8, **kw):
    kw.setdefault("vocab_size", 49_152)
    kw.setdefault("max_model_len", 8192)
    return make_workload(kind, n, **kw)


def test_random_workload_is_seeded_with_jittered_lengths():
    a = _make("random", input_len=100, output_len=20, range_ratio=0.5, seed=3)
    b = _make("random", input_len=100, output_len=20, range_ratio=0.5, seed=3)
    c = _make("random", input_len=100, output_len=20, range_ratio=0.5, seed=4)
    assert a.requests == b.requests and a.requests != c.requests
    lens = [len(r.prompt_token_ids) for r in a.requests]
    assert all(50 <= n <= 150 for n in lens) and len(set(lens)) > 1
    assert all(17 <= t < 49_152 for r in a.requests for t in r.prompt_token_ids)


def test_fixed_lengths_without_range_ratio():
    w = _make("random", n=5, input_len=64, output_len=7)
    assert [len(r.prompt_token_ids) for r in w.requests] == [64] * 5
    assert w.num_prompt_tokens == 320 and w.num_output_tokens == 35


def test_text_workload_uses_the_tokenizer_on_real_text():
    class Chars:  # one token per character: ids are the text's code points
        def encode(self, text: str) -> list[int]:
            return [ord(ch) for ch in text]

    w = _make("text", n=3, input_len=40, output_len=4, tokenizer=Chars())
    license_text = resources.files("segserve").joinpath("data/apache-2.0.txt").read_text()
    texts = ["".join(chr(t) for t in r.prompt_token_ids) for r in w.requests]
    assert all(len(t) == 40 and t in license_text * 2 for t in texts)
    assert len(set(texts)) == 3
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        _make("text", n=1)


def test_azure_trace_keeps_arrivals_and_clips_to_the_context():
    w = _make("azure-code", n=20, max_model_len=1024)
    arrivals = [r.arrival for r in w.requests]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and arrivals[-1] > 0
    assert max(len(r.prompt_token_ids) + r.output_len for r in w.requests) == 1024  # 4,808 clipped
    assert len(w.requests[0].prompt_token_ids) == 1024 - 10  # first row: 4,808 prompt, 10 output


def test_mooncake_shared_hash_ids_give_equal_token_prefixes():
    # Rows 0 and 1 of mooncake_conversation share hash id 0 (one 512-token block), then differ.
    w = _make("mooncake-conv", n=2)
    a, b = (r.prompt_token_ids for r in w.requests)
    assert a[:512] == b[:512] and a[512:1024] != b[512:1024]
    assert (len(a), len(b)) == (6758, 7322)
    half = _make("mooncake-conv", n=2, length_scale=0.5)
    a2, b2 = (r.prompt_token_ids for r in half.requests)
    assert (len(a2), len(b2)) == (3379, 3661)
    assert a2[:256] == b2[:256] and a2[256:512] != b2[256:512]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "nope"}, "workload kind must be one of"),
        ({"n": 0}, "num_requests must be >= 1, got 0"),
        ({"input_len": 0}, "input_len and output_len must be >= 1, got 0, 128"),
        ({"range_ratio": 1.0}, r"range_ratio must be in \[0, 1\), got 1.0"),
        ({"input_len": 9000}, "a request needs 9128 tokens, more than max_model_len=8192"),
        ({"kind": "azure-conv", "length_scale": 0}, "length_scale must be > 0, got 0"),
        ({"kind": "azure-conv", "trace_dir": "/nonexistent"}, "trace file /nonexistent/azure2023_conv.csv"),
    ],
)
def test_bad_workload_settings_are_named(kwargs, message):
    kind = kwargs.pop("kind", "random")
    n = kwargs.pop("n", 2)
    with pytest.raises(ValueError, match=message):
        _make(kind, n, **kwargs)


def test_a_request_needs_a_prompt_and_an_output():
    with pytest.raises(ValueError, match="got 0 and 5"):
        BenchRequest((), 5)
    with pytest.raises(ValueError, match="got 2 and 0"):
        BenchRequest((1, 2), 0)
