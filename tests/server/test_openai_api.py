"""The official ``openai`` client against the server on a tiny model: streamed == non-streamed ==
offline greedy text, chat and completions, n > 1, models and health."""

from __future__ import annotations

import httpx

from tests.server.checks import chat_parity, completion_parity, openai_client
from tests.server.harness import SERVED_NAME


def test_completions_stream_equals_whole_equals_offline(tiny_server, tiny_offline):
    handle, _ = tiny_server
    text = completion_parity(handle, tiny_offline, "The quick brown fox jumps over", 24)
    assert len(text) > 0
    completion_parity(handle, tiny_offline, "Paged attention keeps the cache", 1)
    handle.assert_idle_and_clean()


def test_chat_stream_equals_whole_equals_offline(tiny_server, tiny_offline):
    handle, _ = tiny_server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "chunked prefill?"}]
    assert len(chat_parity(handle, tiny_offline, messages, 20)) > 0
    handle.assert_idle_and_clean()


def test_n_completions_stream_and_whole_agree(tiny_server):
    handle, _ = tiny_server
    client = openai_client(handle)
    kw = dict(model=SERVED_NAME, prompt="The lazy dog", max_tokens=6, temperature=1.0, seed=7, n=3)
    whole = client.completions.create(**kw)
    streamed = {0: "", 1: "", 2: ""}
    finish = {}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert {c.index: c.text for c in whole.choices} == streamed
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert len(set(streamed.values())) > 1, "seeded completions of one request should differ"
    # Up to 6 tokens each (EOS may come first), at least one each.
    assert 3 <= whole.usage.completion_tokens <= 18


def test_models_and_health(tiny_server):
    handle, _ = tiny_server
    models = openai_client(handle).models.list()
    assert [m.id for m in models.data] == [SERVED_NAME]
    assert models.data[0].max_model_len == 128
    assert httpx.get(f"{handle.base_url}/health").status_code == 200
