"""The official client and 16 concurrent streams against SmolLM2-135M-Instruct (slow: real model)."""

from __future__ import annotations

import pytest

from tests.server.checks import chat_parity, completion_parity, concurrent_shared_prefixes

pytestmark = pytest.mark.slow


def test_smollm_completion_and_chat_parity(smol_server_and_offline):
    handle, offline = smol_server_and_offline
    text = completion_parity(handle, offline, "The capital of France is", 12)
    assert "Paris" in text
    chat_parity(handle, offline, [{"role": "user", "content": "Name three prime numbers."}], 16)
    handle.assert_idle_and_clean()


def test_smollm_16_concurrent_streams_with_shared_prefixes(smol_server_and_offline):
    handle, offline = smol_server_and_offline
    prefix = ("Chunked prefill splits a long prompt into pieces that share each engine step with the "
              "decodes of running requests, and prefix caching lets requests reuse the KV blocks of a "
              "shared prompt prefix. Question:")
    suffixes = [f" What is idea number {i}?" for i in range(12)] + [
        " Why?", " How does it help latency?", " Summarize.", " Give an example."]
    lengths = [4 + (3 * i) % 13 for i in range(16)]
    usages = concurrent_shared_prefixes(handle, offline, prefix, suffixes, lengths)
    # Each stops at its max_tokens or at EOS (each count already equals the offline one).
    assert all(1 <= u["completion_tokens"] <= n for u, n in zip(usages, lengths, strict=True))
