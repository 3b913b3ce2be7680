"""Decode-only engine steps, two variants interleaved step by step in one process (the host's slow phases
hit both alike): ``--mode rows`` compares decode-only steps of more than 8 rows through the per-layer
GEMMs (``forward_chunk``, A) with the one-call decode stack (B): A caps every ``MAX_DECODE_STACK_ROWS_*``
limit at ``--rows-a`` (8), B keeps the tree's limits or sets them to ``--rows-b``;
``--mode lib --old-lib PATH`` compares another build of the kernel library (A, e.g. main's, which must
have the same ABI) with this tree's (B), both at the old 8-row limit; ``--mode all`` is both changes at
once (A: the old library at 8 rows, B: this tree).

Each batch size ``b`` adds ``b`` requests of distinct 200-token prompts, runs them until every one has
its first token, then times ``2 * --steps`` engine steps in the order ABBAABBA... Prints one line per
batch (median and minimum ms per step of each variant) and writes ``--out`` as JSON. Quote the load
average (``uptime``) with the figures: the comparison is fair under load, the absolute times are not.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
from pathlib import Path

from segserve import LLM, SamplingParams
from segserve.kernels import cpu as cpu_kernels
from segserve.kernels import quant


def _old_library(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    for table in (cpu_kernels._ARGS, quant._ARGS):
        for name, args in table.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = [ctypes.POINTER(args)], ctypes.c_int
    return lib


STACK_LIMITS = ("MAX_DECODE_STACK_ROWS_BLOCKS", "MAX_DECODE_STACK_ROWS_TILES", "MAX_DECODE_STACK_ROWS_DENSE")


def _variant_setter(mode: str, old_lib: str | None, rows_a: int = 8, rows_b: int | None = None):
    """A function that switches the process to variant "A" or "B"."""
    new = cpu_kernels._library()
    limits = {name: dict(getattr(cpu_kernels, name)) for name in STACK_LIMITS}
    quant._library()
    old = _old_library(old_lib) if mode in ("lib", "all") else None

    def set_variant(v: str) -> None:
        if old is not None:
            cpu_kernels._lib = old if v == "A" else new
        big = v == "B" and mode in ("rows", "all")
        for name, table in limits.items():
            for k, tree in table.items():
                getattr(cpu_kernels, name)[k] = (tree if rows_b is None else rows_b) if big else rows_a

    return set_variant


def _time_batch(engine, b: int, steps: int, first_id: int, set_variant) -> dict:
    for i in range(b):
        ids = [(17 * ((first_id + i) * 7 + i) + 3 * t) % 40000 + 100 for t in range(200)]
        params = SamplingParams(max_tokens=2 * steps + 8, ignore_eos=True, temperature=0)
        engine.add_request(f"r{first_id + i}", {"prompt_token_ids": ids}, params)
    started: set[str] = set()
    while len(started) < b:
        started.update(o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids)
    for v in "AB":  # one warm-up step each
        set_variant(v)
        engine.step()
    times: dict[str, list[float]] = {"A": [], "B": []}
    for s in range(2 * steps):
        v = "AB"[(s + s // 2) % 2]
        set_variant(v)
        t0 = time.perf_counter()
        engine.step()
        times[v].append(1e3 * (time.perf_counter() - t0))
    while engine.has_unfinished_requests():
        engine.step()
    return {
        v: {"median_ms": round(statistics.median(x), 2), "min_ms": round(min(x), 2)} for v, x in times.items()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the packaged Q4_1 SmolLM2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batches", default="1,8,16,32")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant and batch")
    p.add_argument("--mode", choices=("rows", "lib", "all"), default="rows")
    p.add_argument("--old-lib", default=None, help="the other build's .so (modes lib and all)")
    p.add_argument("--rows-a", type=int, default=8, help="A's cap on every decode-stack row limit")
    p.add_argument("--rows-b", type=int, default=None,
                   help="B's decode-stack row limit (default: the tree's)")
    p.add_argument("--out", default="results/ab_decode_steps.json")
    a = p.parse_args()
    if a.mode != "rows" and not a.old_lib:
        p.error(f"--mode {a.mode} needs --old-lib")
    llm = LLM(a.model, dtype=a.dtype) if a.model else LLM(dtype=a.dtype)
    if a.rows_a < 1 or (a.rows_b is not None and a.rows_b < 1):
        p.error("--rows-a and --rows-b must be >= 1")
    set_variant = _variant_setter(a.mode, a.old_lib, a.rows_a, a.rows_b)
    result = {"mode": a.mode, "rows_a": a.rows_a, "rows_b": a.rows_b, "dtype": a.dtype,
              "load": os.getloadavg(), "batches": {}}
    first = 0
    for b in (int(x) for x in a.batches.split(",")):
        result["batches"][b] = r = _time_batch(llm.llm_engine, b, a.steps, first, set_variant)
        first += b
        print(f"b={b}: A {r['A']['median_ms']} ms median ({r['A']['min_ms']} min), "
              f"B {r['B']['median_ms']} ({r['B']['min_ms']})", flush=True)
    set_variant("B")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
