"""Builds of the compiled kernel library, A/B in one engine: prompts prefilled by an ``LLM`` whose library
is swapped between prompts, variants in turn, so the host's slow phases hit all of them alike.

Each ``--variant NAME=DIR`` compiles this tree's ``segserve/kernels/csrc`` with the ``.c`` files found in
``DIR`` in place of the tree's (``NAME=`` alone: the tree as it is; ``NAME=DIR:-DX=1`` adds compiler
flags), with the flags and ``-D`` defines of ``segserve.kernels.build``, into a temporary directory, and
loads it next to the engine's own. The variants must share the tree's argument structs (their layout is
what ``segserve.kernels`` passes). Every round prefills one fresh ``--prompt-len``-token prompt per
variant (``max_tokens=1``, bfloat16, prefix caching off); prints each variant's median and its ratio to
the first, and writes ``--out`` (JSON, with ``lscpu``'s model name and the load average). Why in the
engine: a kernel harness that allocates a fresh output per call can page-fault where the engine does not
(docs/perf.md, "Eighteenth session"), and one whose data stays warm in cache can rank prefetches
backwards.

    python benchmarks/ab_kernel_builds.py --variant main= --variant old=/tmp/old_csrc --rounds 6
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from segserve import LLM, SamplingParams  # noqa: E402
from segserve.kernels import amx, bf16gemm, build, chunk_attention, f32gemm, quant  # noqa: E402
from segserve.kernels import cpu as cpu_kernels  # noqa: E402
from segserve.simulator.calibration import cpu_model_name  # noqa: E402

DEFAULT_MODEL = Path.home() / ".cache" / "segserve" / "baselines" / "smollm2-135m-instruct-q4_1-f32"
TABLES = (cpu_kernels._ARGS, amx._ARGS, bf16gemm._ARGS, chunk_attention._ARGS, f32gemm._ARGS, quant._ARGS)


def parse_variant(spec: str) -> tuple[str, Path | None, list[str]]:
    """``NAME=[DIR][:FLAGS]`` -> (name, replacement source directory or None, extra compiler flags)."""
    if "=" not in spec:
        raise SystemExit(f"--variant {spec!r}: expected NAME=[DIR][:FLAGS]")
    name, rest = spec.split("=", 1)
    where, _, flags = rest.partition(":")
    src = Path(where) if where else None
    if src is not None and not src.is_dir():
        raise SystemExit(f"--variant {spec!r}: {src} is not a directory")
    return name, src, shlex.split(flags)


def compile_variant(src: Path | None, flags: list[str], out: Path) -> None:
    """This tree's sources (those in ``src`` replacing theirs) compiled and linked into ``out`` by the
    library's own build step."""
    sources = tuple(src / f.name if src is not None and (src / f.name).is_file() else f
                    for f in build.SOURCES)
    with tempfile.TemporaryDirectory(dir=out.parent) as objs:
        build._compile_and_link(build._compiler(), Path(objs), str(out), sources, tuple(flags))


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for table in TABLES:
        lib = cpu_kernels.typed(lib, table)
    return lib


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", action="append", required=True, metavar="NAME=[DIR][:FLAGS]")
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="the bfloat16 export (HF directory) or GGUF")
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "ab_kernel_builds.json")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.prompt_len < 1:
        p.error("--rounds and --prompt-len must be >= 1")
    variants = [parse_variant(v) for v in args.variant]
    if len({v[0] for v in variants}) != len(variants):
        p.error("variant names must differ")
    load_before = os.getloadavg()
    libs = {}
    with tempfile.TemporaryDirectory(prefix="ab_kernel_builds_") as tmp:
        for name, src, flags in variants:
            out = Path(tmp) / f"lib_{name}.so"
            compile_variant(src, flags, out)
            libs[name] = load(out)
        llm = LLM(args.model, dtype="bfloat16", seed=0, enable_prefix_caching=False)
        params = SamplingParams(temperature=0.0, max_tokens=1)
        rng = random.Random(0)

        def prompt() -> dict:
            return {"prompt_token_ids": [rng.randrange(17, 49152) for _ in range(args.prompt_len)]}

        times: dict[str, list[float]] = {name: [] for name in libs}
        for lib in libs.values():  # a warm-up prompt each
            cpu_kernels._lib = lib
            llm.generate([prompt()], params, use_tqdm=False)
        for _ in range(args.rounds):
            for name, lib in libs.items():
                cpu_kernels._lib = lib
                one = prompt()
                t0 = time.perf_counter()
                llm.generate([one], params, use_tqdm=False)
                times[name].append(time.perf_counter() - t0)
    first = statistics.median(next(iter(times.values())))
    rows = {name: {"median_s": statistics.median(ts), "runs_s": ts,
                   "ratio_to_first": statistics.median(ts) / first} for name, ts in times.items()}
    summary = "; ".join(f"{n} {r['median_s']:.3f} s ({r['ratio_to_first']:.3f}x)" for n, r in rows.items())
    print(f"ab_kernel_builds: {args.prompt_len}-token prefill, median of {args.rounds}: {summary}; "
          f"load {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"cpu": cpu_model_name(), "prompt_len": args.prompt_len, "rounds": args.rounds,
              "variants": {n: {"src": str(s) if s else None, "flags": f} for n, s, f in variants},
              "results": rows, "load_before": load_before, "load_after": os.getloadavg()}
    args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
