"""benchmarks/profile_prefill.py's timers: a call timed under a name is not timed again inside itself, and
the fused chunk path's attention (``attend_rotated``, called without ``attend`` when the AMX QKV GEMM
rotates and writes the KV) is timed under the attention key. Before both, a profile of a bfloat16 prefill
on an AMX CPU put the attention into "chunk path other" and reported "rope+kv write+plan" as minus the
attention kernel's time (2026-12-06, AMX Xeon)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import profile_prefill as pp  # noqa: E402

from segserve.models import llama  # noqa: E402


class _Calls:
    def outer(self, n: int) -> int:
        return self.inner(n) + 1

    def inner(self, n: int) -> int:
        return n


def test_a_call_nested_under_the_same_name_is_counted_once(monkeypatch) -> None:
    t = pp.Timers()
    monkeypatch.setattr(_Calls, "outer", _Calls.outer)  # undone after the test
    monkeypatch.setattr(_Calls, "inner", _Calls.inner)
    t.wrap(_Calls, "outer", lambda a, k: ("both", 1.0))
    t.wrap(_Calls, "inner", lambda a, k: ("both", 10.0))
    calls = _Calls()
    assert calls.outer(3) == 4  # off: not counted
    t.on = True
    assert calls.outer(3) == 4  # outer counted; the inner call inside it is not
    assert calls.inner(5) == 5  # inner alone counted
    assert t.flops["both"] == 11.0
    assert t.seconds["both"] > 0 and not t.active


def test_install_times_attend_rotated_under_the_attention_key(monkeypatch) -> None:
    import itertools

    import torch

    from segserve.kernels import amx, bf16gemm, chunk_attention
    from segserve.kernels import cpu as cpu_kernels
    from segserve.worker import cpu_step, model_runner

    patched = [(amx, "linear"), (bf16gemm, "linear"), (cpu_kernels, "add_rmsnorm_"),
               (cpu_kernels, "silu_mul"), (chunk_attention, "chunk_attention"), (cpu_step, "forward_chunk"),
               (torch.nn.Embedding, "forward"), (cpu_step.CpuStep, "compute_logits"),
               (model_runner, "sample"),
               (model_runner.ModelRunner, "execute_model"), (model_runner.ModelRunner, "_prepare_inputs")]
    for owner, attr in patched:  # install's patches are undone after the test
        monkeypatch.setattr(owner, attr, getattr(owner, attr))
    # Stand-ins with the real call structure: attend calls attend_rotated (the unfused path); the fused
    # path calls attend_rotated alone.
    monkeypatch.setattr(llama.LlamaAttention, "attend", lambda self: self.attend_rotated() + 1)
    monkeypatch.setattr(llama.LlamaAttention, "attend_rotated", lambda self: 1)
    t = pp.Timers()
    pp.install(t)
    clock = itertools.count()
    monkeypatch.setattr(pp.time, "perf_counter", lambda: float(next(clock)))  # each reading one "second"
    attn = object.__new__(llama.LlamaAttention)
    t.on = True
    assert attn.attend_rotated() == 1  # the fused path: 1 s
    assert attn.attend() == 2  # the unfused path: 1 s (its nested attend_rotated not timed again)
    assert t.seconds == {"attend (rope+kv+attn)": 2.0}
