"""Cache isolation (issue 17, item 7): vLLM's ``cache_salt`` enters the hash of a request's first KV
block, so requests with different salts never share cached blocks; ``--cache-salt-by-api-key`` salts
every request by its API key, so tenants cannot probe each other's prompts through ``cached_tokens``."""

from __future__ import annotations

import httpx
import pytest

from tests.server.harness import SERVED_NAME, running_server

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = "The quick brown fox jumps over the lazy dog near the quiet river bank"


def _cached(handle, body: dict, headers: dict | None = None, path: str = CMPL) -> int:
    r = httpx.post(handle.base_url + path, json=body, headers=headers or {}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _whole_blocks(handle, prompt: str) -> int:
    """Tokens in the whole blocks a warm repeat of ``prompt`` finds (all but the last token's block)."""
    ids = handle.engine.engine.tokenize(prompt)[1]
    block = handle.engine.engine.config.cache.block_size
    return (len(ids) - 1) // block * block


def test_different_cache_salts_never_share_blocks(tiny_server):
    handle, _ = tiny_server
    body = {"model": SERVED_NAME, "prompt": PROMPT + " salted", "max_tokens": 1, "temperature": 0}
    expected = _whole_blocks(handle, body["prompt"])
    assert expected >= 8
    assert _cached(handle, {**body, "cache_salt": "tenant-a"}) == 0
    assert _cached(handle, {**body, "cache_salt": "tenant-b"}) == 0
    assert _cached(handle, body) == 0  # unsalted: another cache again
    assert _cached(handle, {**body, "cache_salt": "tenant-a"}) == expected
    assert _cached(handle, {**body, "cache_salt": "tenant-b"}) == expected
    assert _cached(handle, body) == expected
    chat = {"model": SERVED_NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1}
    assert _cached(handle, {**chat, "cache_salt": "c1"}, path=CHAT) == 0
    assert _cached(handle, {**chat, "cache_salt": "c2"}, path=CHAT) == 0
    assert _cached(handle, {**chat, "cache_salt": "c1"}, path=CHAT) > 0
    handle.assert_idle_and_clean()


@pytest.fixture(scope="module")
def salted_server(tiny_loaded):
    from segserve import LLMEngine
    from tests.server.conftest import TINY_ENGINE

    with running_server(LLMEngine(tiny_loaded, **TINY_ENGINE), cache_salt_by_api_key=True) as hs:
        yield hs


def test_salt_by_api_key_isolates_tenants(salted_server):
    handle, _ = salted_server
    body = {"model": SERVED_NAME, "prompt": PROMPT + " tenants", "max_tokens": 1, "temperature": 0}
    expected = _whole_blocks(handle, body["prompt"])
    alice, bob = {"Authorization": "Bearer key-alice"}, {"Authorization": "Bearer key-bob"}
    assert _cached(handle, body, alice) == 0
    assert _cached(handle, body, bob) == 0  # bob cannot tell that alice sent this prompt
    assert _cached(handle, body) == 0  # nor can a client without a key
    assert _cached(handle, body, alice) == expected
    assert _cached(handle, body, bob) == expected
    # A client's own cache_salt cannot reach another key's cache: it is combined with the key.
    from segserve.entrypoints.openai.serving import tenant_salt

    alice_salt = tenant_salt("Bearer key-alice", None)
    assert _cached(handle, {**body, "cache_salt": alice_salt}, bob) == 0
    assert _cached(handle, {**body, "cache_salt": "x"}, alice) == 0
    assert _cached(handle, {**body, "cache_salt": "x"}, alice) == expected
    handle.assert_idle_and_clean()


def test_tenant_salt_is_a_digest_of_the_key():
    from segserve.entrypoints.openai.serving import tenant_salt

    salt = tenant_salt("Bearer sk-secret", None)
    assert "sk-secret" not in salt and salt.startswith("key:") and len(salt) == 4 + 64
    assert tenant_salt("bearer sk-secret", None) == salt == tenant_salt("Bearer  sk-secret ", None)
    assert tenant_salt("Bearer sk-other", None) != salt
    assert tenant_salt("Bearer sk-secret", "s") == salt + ":s"
    assert tenant_salt(None, None) == tenant_salt("Basic abc", None)  # no bearer key: anonymous
