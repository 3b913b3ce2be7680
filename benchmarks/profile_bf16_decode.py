"""Where a decode-only step of many rows goes: one captured engine step replayed with timers, and an
interleaved A/B of the routes such a step can take.

The engine (``LLM(--model, dtype=--dtype)``) prefills the largest batch's requests (distinct random
``--prompt-len``-token prompts); for each batch size ``b`` a decode-only step of the first ``b`` (each
decoding its last prompt token again, at a context of ``--prompt-len``; padded to the engine's bucket
as the scheduler pads it) is replayed ``--reps`` times as ``ModelRunner.execute_model`` runs it:
``CpuStep.forward``, ``logits_of`` the rows, ``sample`` (greedy). Every rep rewrites the same
K/V slots with the same values, so it computes the same step.

``--mode profile``: timers around each kernel call of the step (GEMMs per projection and which kernel
ran them, attention, norms, RoPE, KV write, the decode stack, the LM head, sampling); what is left of
the wall time is Python and per-op overhead. ``--mode ab``: the step through ``forward_chunk`` (A, the
route of main for more than 8 bfloat16 rows; at 8 rows or fewer main's decode stack with vdpbf16ps
register tiles) and through the one-call decode stack with AMX tiles (B), alternating ABBA rep by rep;
medians and minima of each. With ``--old-lib PATH`` (another build of the
kernel library, e.g. main's, built with ``SEGSERVE_KERNEL_DIR`` set apart) A also runs on that library,
so A is main as it was; at 8 rows or fewer (the decode stack, whose argument struct changed) A runs
main's route on this tree's library (which differs from main's there only in the decode attention's
bfloat16 score pass). A's LM head is then main's too (oneDNN's packed copy).

Prints one line per batch and writes ``--out`` (JSON). Quote ``uptime``'s load average with the
figures: the host is shared, so only the interleaved comparison is fair under load.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from segserve import LLM, SamplingParams
from segserve.attention import segmented
from segserve.attention.metadata import build_attention_metadata
from segserve.kernels import amx, chunk_attention
from segserve.kernels import cpu as cpu_kernels
from segserve.models import packed_linear as packed_module
from segserve.models.packed_linear import pack_weight
from segserve.worker import cpu_step as cpu_step_module
from segserve.worker.sampler import sample

EXPORT = Path.home() / ".cache/segserve/baselines/smollm2-135m-instruct-q4_1-f32"


class Timers:
    """Seconds and calls per label, and the wrappers that fill them."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, fn, label):
        """``fn`` timed under ``label`` (a string, or a function of the call's arguments)."""
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                name = label if isinstance(label, str) else label(*args, **kwargs)
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1
        return timed


def _projection(n: int, k: int, config) -> str:
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    names = {(q + 2 * kv, h): "qkv", (h, q): "o", (2 * i, h): "gate_up", (h, i): "down"}
    return names.get((n, k), f"{n}x{k}")


def instrument(monkey: list, timers: Timers, config) -> None:
    """Wrap the kernels a step calls; ``monkey`` collects (owner, name, original) to undo."""
    def patch(owner, name, label):
        original = getattr(owner, name)
        monkey.append((owner, name, original))
        setattr(owner, name, timers.wrap(original, label))

    patch(amx, "linear", lambda x, packed, n, k, *a, **kw: f"GEMM {_projection(n, k, config)} (amx.linear)")
    patch(cpu_kernels, "add_rmsnorm_", "add + RMSNorm (sg_rows)")
    patch(cpu_kernels, "silu_mul", "SiLU gate (sg_rows)")
    patch(cpu_kernels, "rope_", "RoPE (sg_rope)")
    patch(segmented, "write_kv", "KV write")
    patch(cpu_kernels, "decode_attention", "decode attention (sg_decode_attention)")
    patch(chunk_attention, "chunk_attention", "chunk attention (sg_chunk_attention)")
    patch(cpu_kernels.DecodeStack, "run", "decode stack (sg_decode_stack)")
    patch(cpu_kernels, "linear", lambda x, w, *a, **kw: f"compiled linear {tuple(w.shape)} (sg_linear)")
    patch(cpu_step_module, "packed_linear", "LM head (oneDNN packed)")
    forward = packed_module.PackedLinear.forward
    patch(packed_module.PackedLinear, "forward",
          lambda self, x: f"GEMM {_projection(self.out_features, self.in_features, config)} (oneDNN)")
    assert packed_module.PackedLinear.forward is not forward


def undo(monkey: list) -> None:
    for owner, name, original in reversed(monkey):
        setattr(owner, name, original)
    monkey.clear()


def prefill(llm: LLM, n: int, prompt_len: int) -> list[str]:
    """Add ``n`` requests of distinct random ``prompt_len``-token prompts and run them until each has
    its first token (they stay running: ``max_tokens`` is large); returns their ids."""
    engine = llm.llm_engine
    gen = torch.Generator().manual_seed(0)
    rids = [f"r{i}" for i in range(n)]
    for rid in rids:
        ids = torch.randint(100, 40000, (prompt_len,), generator=gen).tolist()
        engine.add_request(rid, {"prompt_token_ids": ids},
                           SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0))
    while any(r.is_prefill for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    return rids


def decode_step(llm: LLM, rids: list[str]) -> tuple:
    """``CpuStep.forward``'s arguments for a decode step of the requests ``rids`` (each at its next
    token), padded to the engine's bucket as the scheduler pads it."""
    engine = llm.llm_engine
    runner, config = engine.runner, engine.config
    states = [runner.requests[rid] for rid in rids]
    priors = [len(s.token_ids) - 1 for s in states]
    padded = min(b for b in config.scheduler.num_batched_tokens_buckets if b >= len(rids))
    md = build_attention_metadata(
        [1] * len(rids), priors, [s.block_ids for s in states], runner.block_size,
        runner.max_blocks_per_seq, config.attention.kv_segment_size, num_padded_tokens=padded,
    )
    ids = [s.token_ids[-1] for s in states] + [0] * (padded - len(rids))
    return torch.tensor(ids), torch.tensor(priors + [0] * (padded - len(rids))), runner.kv_caches, md


def run_step(cs, args, params) -> torch.Tensor:
    """The step as ``ModelRunner.execute_model`` runs it: forward, logits of the due rows, sampling."""
    hidden = cs.forward(*args)
    md = args[3]
    ends = md.query_start_loc_cpu[1:]
    logits = cs.logits_of(hidden, [e - 1 for e in ends])
    out = sample(logits, params, [None] * len(params), [1] * len(params), None)
    return torch.tensor(out.token_ids)


def profile(llm: LLM, args, reps: int) -> dict:
    cs, config = llm.llm_engine.runner.cpu_step, llm.llm_engine.runner.model.config
    params = [SamplingParams(temperature=0)] * args[3].num_reqs
    with torch.inference_mode():
        for _ in range(2):
            run_step(cs, args, params)
        timers, monkey = Timers(), []
        instrument(monkey, timers, config)
        sample_timed = timers.wrap(sample, "sampling")
        global_sample = globals()["sample"]
        globals()["sample"] = sample_timed
        phases = torch.zeros(config.num_hidden_layers, len(cpu_kernels.STACK_PHASES), dtype=torch.int64)
        cpu_kernels.stack_timing(phases)  # the stack's first thread's time per phase (none off the stack)
        try:
            walls = []
            for _ in range(reps):
                t0 = time.perf_counter()
                run_step(cs, args, params)
                walls.append(time.perf_counter() - t0)
        finally:
            cpu_kernels.stack_timing(None)
            globals()["sample"] = global_sample
            undo(monkey)
    wall = sum(walls)
    stack = {name: round(float(phases[:, i].sum()) / reps / 1e6, 3)
             for i, name in enumerate(cpu_kernels.STACK_PHASES)}
    parts = {
        k: {"ms": round(1e3 * v / reps, 3), "share": round(v / wall, 4), "calls": timers.calls[k] // reps}
        for k, v in sorted(timers.seconds.items(), key=lambda kv: -kv[1])
    }
    rest = wall - sum(timers.seconds.values())
    parts["Python / other (wall minus the above)"] = {"ms": round(1e3 * rest / reps, 3),
                                                      "share": round(rest / wall, 4), "calls": 0}
    return {"wall_ms_mean": round(1e3 * wall / reps, 2),
            "wall_ms_median": round(1e3 * statistics.median(walls), 2),
            "wall_ms_min": round(1e3 * min(walls), 2), "parts": parts, "stack_phases_ms": stack}


def _old_library(path: str) -> ctypes.CDLL:
    """Another build of the library with the entry points forward_chunk calls typed."""
    lib = ctypes.CDLL(path)
    for table in (cpu_kernels._ARGS, amx._ARGS):
        for name, args in table.items():
            if name != "sg_decode_stack" and hasattr(lib, name):  # the stack's struct changed: not called
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = [ctypes.POINTER(args)], ctypes.c_int
    return lib


def ab(llm: LLM, args, reps: int, set_variant) -> dict:
    cs = llm.llm_engine.runner.cpu_step
    params = [SamplingParams(temperature=0)] * args[3].num_reqs
    times: dict[str, list[float]] = {"A": [], "B": []}
    with torch.inference_mode():
        for v in "AB":
            set_variant(v)
            run_step(cs, args, params)
        for s in range(2 * reps):
            v = "AB"[(s + s // 2) % 2]
            set_variant(v)
            t0 = time.perf_counter()
            run_step(cs, args, params)
            times[v].append(1e3 * (time.perf_counter() - t0))
    set_variant("B")
    return {v: {"median_ms": round(statistics.median(x), 2), "min_ms": round(min(x), 2)}
            for v, x in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(EXPORT), help="default: the float32 export of SmolLM2 (dense)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="8,16,24,32,48,64")
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--reps", type=int, default=10, help="timed reps per batch (per variant with --mode ab)")
    p.add_argument("--mode", choices=("profile", "ab"), default="profile")
    p.add_argument("--route", choices=("stack", "chunk"), default="stack",
                   help="--mode profile: this tree's route, or forward_chunk (main's for > 8 bf16 rows)")
    p.add_argument("--old-lib", default=None, help="--mode ab: variant A's kernel library (e.g. main's)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (LLM's block_size)")
    p.add_argument("--out", default="results/profile_bf16_decode.json")
    a = p.parse_args()
    batches = [int(x) for x in a.batches.split(",")]
    if min(batches) < 1 or a.reps < 1 or a.prompt_len < 1:
        p.error("--batches, --reps and --prompt-len must be >= 1")
    llm = LLM(a.model, dtype=a.dtype, max_num_seqs=max(batches), block_size=a.block_size)
    result = {"mode": a.mode, "route": a.route, "dtype": a.dtype, "model": a.model,
              "threads": torch.get_num_threads(), "load_before": os.getloadavg(), "batches": {}}
    limits = getattr(cpu_kernels, "MAX_DECODE_STACK_ROWS_TILES", None)

    new_lib = cpu_kernels._library()
    amx.hardware_ready()
    old_lib = _old_library(a.old_lib) if a.old_lib else None
    rows_now = [0]
    cs = llm.llm_engine.runner.cpu_step
    heads = {"B": (cs._tile_lm_head, cs._packed_lm_head)}  # A with --old-lib: main's oneDNN-packed head
    heads["A"] = (None, pack_weight(cs.model.lm_head_weight)) if old_lib is not None else heads["B"]

    def set_variant(v: str) -> None:
        if limits is None:
            raise SystemExit("--mode ab needs cpu.MAX_DECODE_STACK_ROWS_TILES (this tree has no tile stack)")
        limits[torch.bfloat16] = 8 if v == "A" else saved
        # A: main's routes at 8 rows or fewer too (the vdpbf16ps register tiles, the compiled LM head).
        cpu_step_module.AMX_STACK_MIN_ROWS = 9 if v == "A" else min_rows
        old = v == "A" and old_lib is not None and rows_now[0] > cpu_kernels.MAX_SMALL_ROWS[torch.bfloat16]
        cpu_kernels._lib = old_lib if old else new_lib
        cs._tile_lm_head, cs._packed_lm_head = heads[v]
    saved = limits[torch.bfloat16] if limits is not None else None
    min_rows = cpu_step_module.AMX_STACK_MIN_ROWS
    if a.route == "chunk" and limits is not None:
        limits[torch.bfloat16] = 8
    rids = prefill(llm, max(batches), a.prompt_len)
    for b in batches:
        step = decode_step(llm, rids[:b])
        rows = rows_now[0] = step[0].shape[0]
        if a.mode == "profile":
            r = profile(llm, step, a.reps)
            top = ", ".join(f"{k} {v['ms']}" for k, v in list(r["parts"].items())[:6])
            phases = ", ".join(f"{k} {v}" for k, v in r["stack_phases_ms"].items())
            print(f"b={b} ({rows} rows): {r['wall_ms_median']} ms median ({r['wall_ms_min']} min); {top}; "
                  f"stack phases (ms): {phases}", flush=True)
        else:
            r = ab(llm, step, a.reps, set_variant)
            print(f"b={b} ({rows} rows): A {r['A']['median_ms']} ms median ({r['A']['min_ms']} min), "
                  f"B {r['B']['median_ms']} ({r['B']['min_ms']})", flush=True)
        result["batches"][b] = {"rows": rows, **r}
    result["load_after"] = os.getloadavg()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
