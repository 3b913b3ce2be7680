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


# Where the project's real request traces lie on its machines (the simulator tests read them there too);
# a clone beside shared/ (CI's) finds them through workloads.TRACE_DIR, ../shared/data/traces.
SHARED_TRACES = "/work/shared/data/traces"


@pytest.fixture(autouse=True)
def traces_of_this_machine(monkeypatch):
    """A clone elsewhere (``git clone . $(mktemp -d)``) has no ../shared: point the workloads' default
    trace directory at the machine's copy when that one exists; without either, the trace tests fail
    naming the missing file."""
    from pathlib import Path

    from segserve.bench import workloads

    if not workloads.TRACE_DIR.is_dir() and Path(SHARED_TRACES).is_dir():
        monkeypatch.setattr(workloads, "TRACE_DIR", Path(SHARED_TRACES))
