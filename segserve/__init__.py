"""segserve: an LLM inference engine built around prefill processing.

``LLM``, ``LLMEngine`` and the outputs load torch, so they are imported lazily: ``segserve.core``
(scheduler, KV cache manager) stays importable without torch. Importing it first sets OpenMP's spin
count for the process (``segserve.openmp``), before torch starts its thread pool, and glibc malloc's
thresholds so a step's large buffers are reused rather than faulted in again (``segserve.malloc``).
"""

from segserve import malloc, openmp

openmp.configure()
malloc.configure()

from segserve.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "Logprob", "__version__"]

_LAZY = {
    "LLM": "segserve.engine.llm",
    "LLMEngine": "segserve.engine.llm_engine",
    "RequestOutput": "segserve.outputs",
    "CompletionOutput": "segserve.outputs",
    "Logprob": "segserve.outputs",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'segserve' has no attribute {name!r}")
