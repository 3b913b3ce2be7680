"""Bench fixtures: a tiny random Llama (2 layers, vocab 300, context 128) loaded once."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A saved tiny random Llama directory (HF layout, trained BPE tokenizer)."""
    from tests.model_fixtures import save_tiny_hf_dir, tiny_hf_model, train_tiny_tokenizer

    path = tmp_path_factory.mktemp("bench_tiny_llama")
    save_tiny_hf_dir(path, tiny_hf_model(), train_tiny_tokenizer())
    return path


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir):
    from segserve.models.loader import load_model

    return load_model(str(tiny_model_dir))
