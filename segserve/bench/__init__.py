"""Benchmarks: ``segserve bench throughput`` (offline, in-process, with a Hugging Face baseline in the
same run) and ``segserve bench serve`` (an online client for any OpenAI-compatible endpoint).

Nothing here imports torch at module level: the workloads and metrics are plain Python, and the
engine and ``transformers`` are imported inside the functions that run them.
"""
