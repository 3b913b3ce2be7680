"""Checks shared by the tiny-model tests and the real-model (slow) tests."""

from __future__ import annotations

import asyncio

import httpx

from segserve import SamplingParams
from tests.server.harness import SERVED_NAME, ServerHandle


def openai_client(handle: ServerHandle):
    """The official client, pointed at the test server (no retries: a test must see the first answer)."""
    import openai

    return openai.OpenAI(base_url=f"{handle.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def completion_parity(handle: ServerHandle, offline, prompt: str, max_tokens: int) -> str:
    """Streamed text == non-streamed text == offline ``LLM.generate`` for one greedy prompt; usage
    agrees with the offline token counts. Returns the text."""
    client = openai_client(handle)
    kw = dict(model=SERVED_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    ref = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert whole.choices[0].text == ref.outputs[0].text
    assert streamed == ref.outputs[0].text
    assert whole.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert chunks[-2].choices[0].finish_reason == ref.outputs[0].finish_reason
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens,
                                                              whole.usage.completion_tokens)
    # The second request finds the first one's whole blocks (all but the last prompt token).
    block = handle.engine.engine.config.cache.block_size
    cached = (len(ref.prompt_token_ids) - 1) // block * block
    assert usage.prompt_tokens_details.cached_tokens == cached
    assert whole.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert whole.usage.completion_tokens == len(ref.outputs[0].token_ids)
    return streamed


def chat_parity(handle: ServerHandle, offline, messages: list[dict], max_tokens: int) -> str:
    """As ``completion_parity`` for ``/v1/chat/completions`` against ``LLM.chat``."""
    client = openai_client(handle)
    kw = dict(model=SERVED_NAME, messages=messages, max_tokens=max_tokens, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == streamed == ref.outputs[0].text
    assert whole.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert whole.usage.prompt_tokens == len(ref.prompt_token_ids)
    return streamed


async def _stream_completion(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[str, dict]:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    text, usage = [], None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                import json

                event = json.loads(line[6:])
                text += [c["text"] for c in event["choices"]]
                usage = event["usage"] or usage
    return "".join(text), usage


def concurrent_shared_prefixes(handle: ServerHandle, offline, prefix: str, suffixes: list[str],
                               lengths: list[int]) -> list[dict]:
    """Warm the prefix with one request, then stream one request per suffix at once; each greedy text
    equals offline, and each reports at least the shared whole blocks as cached. Returns the usages."""
    prompts = [prefix + s for s in suffixes]
    refs = offline.generate(prompts, [SamplingParams(temperature=0, max_tokens=n) for n in lengths],
                            use_tqdm=False)
    warm_ids = offline.llm_engine.tokenize(prefix)[1]

    async def go() -> list[tuple[str, dict]]:
        async with httpx.AsyncClient(base_url=handle.base_url, timeout=300) as client:
            await _stream_completion(client, prefix, 1)
            return list(await asyncio.gather(*(_stream_completion(client, p, n)
                                               for p, n in zip(prompts, lengths, strict=True))))

    results = asyncio.run(go())
    block = handle.engine.engine.config.cache.block_size
    for (text, usage), ref in zip(results, refs, strict=True):
        assert text == ref.outputs[0].text
        common = _common_prefix(warm_ids, ref.prompt_token_ids)
        shared_blocks = min(common, len(warm_ids) - 1, len(ref.prompt_token_ids) - 1) // block
        assert shared_blocks > 0, "test prompts must share at least one whole block"
        assert usage["prompt_tokens_details"]["cached_tokens"] >= shared_blocks * block
        assert usage["completion_tokens"] == len(ref.outputs[0].token_ids)
    handle.assert_idle_and_clean()
    return [u for _, u in results]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
