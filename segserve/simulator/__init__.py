"""A discrete-event simulator of segserve's continuous batching, driven by segserve's own scheduler.

The simulator runs the real ``segserve.core.scheduler.Scheduler`` and ``KVCacheManager`` (the same
code the engine runs, not a copy) against a step-time model instead of a model runner: each step it
calls ``schedule()``, predicts the step's duration from its composition, advances a virtual clock,
fakes the sampled tokens and calls ``update_from_output()``. Nothing in this package imports torch;
numpy (fitting) and matplotlib (plots) are imported lazily where needed. Design after Vidur
(Agrawal et al., "Vidur: A Large-Scale Simulation Framework for LLM Inference", MLSys 2024), which
also drives a scheduler against profiled per-operation times; here the profile is a whole-step model.
"""
