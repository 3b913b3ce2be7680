"""OpenMP's idle-thread spinning against machine load: segserve's step times under each wait setting.

Each setting (``GOMP_SPINCOUNT`` / ``OMP_WAIT_POLICY``, fixed when libgomp starts) runs in a fresh
process that loads the default model, then times (a) the 256-token chunk steps of one 2,176-token
prompt (budget 256, no prefix caching) and (b) batch-1 decode steps after a 256-token prompt; both
are whole ``LLMEngine.step()`` calls. ``--load N`` starts N busy-loop processes for the whole run, so
the engine shares the cores as it does with a benchmark client or an HTTP event loop beside it.
Settings alternate round by round (interleaved), so drifting load hits all alike; medians over rounds
are reported, with the baseline (libgomp's default) in the same invocation.

Prints one summary line; writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {
    "default": {},
    "spin1000": {"GOMP_SPINCOUNT": "1000"},
    "spin3000": {"GOMP_SPINCOUNT": "3000"},
    "spin10000": {"GOMP_SPINCOUNT": "10000"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    # Threads pinned one per core (what vLLM-CPU does with VLLM_CPU_OMP_THREADS_BIND).
    "spin1000_bound": {"GOMP_SPINCOUNT": "1000", "OMP_PROC_BIND": "close", "OMP_PLACES": "cores"},
}

CHILD = r"""
import json, random, sys, time
from segserve import LLMEngine, SamplingParams
dtype = sys.argv[1]
eng = LLMEngine(dtype=dtype, max_num_batched_tokens=256, max_model_len=4096, enable_prefix_caching=False)
rng = random.Random(0)
prompt = [rng.randrange(100, 40000) for _ in range(2176)]
def steps(prompt, n):
    sp = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0)
    eng.add_request("r", {"prompt_token_ids": prompt}, sp)
    ts = []
    while eng.has_unfinished_requests():
        s = time.perf_counter(); eng.step(); ts.append(time.perf_counter() - s)
    return ts
steps(prompt[:300], 4)  # warm-up
chunk = steps(prompt, 1)[:-1]  # the 256-token chunk steps (the last is the 128-token tail)
decode = steps(prompt[:256], 33)[1:]
print(json.dumps({"chunk_ms": 1000 * sorted(chunk)[len(chunk) // 2],
                  "decode_ms": 1000 * sorted(decode)[len(decode) // 2]}))
"""


def _burn() -> None:
    while True:
        pass


def run_child(setting: dict[str, str], dtype: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY",
                                                              "OMP_PROC_BIND", "OMP_PLACES")}
    # segserve's own default must not mask the libgomp default being measured as the baseline.
    env |= setting or {"GOMP_SPINCOUNT": "300000"}
    out = subprocess.run([sys.executable, "-c", CHILD, dtype], env=env, capture_output=True, text=True,
                         timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def lscpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")),
                platform.processor())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--load", type=int, default=0, help="busy-loop processes running beside the engine")
    p.add_argument("--settings", default="default,spin1000,spin10000,passive",
                   help=f"of {','.join(SETTINGS)}")
    p.add_argument("--out", type=Path, default=Path("results/omp_spin.json"))
    args = p.parse_args()
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        p.error(f"--settings: unknown {unknown}; choose from {list(SETTINGS)}")
    burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(args.load)]
    for b in burners:
        b.start()
    loads, samples = [os.getloadavg()[0]], {n: [] for n in names}
    try:
        for _ in range(args.rounds):
            for n in names:
                samples[n].append(run_child(SETTINGS[n], args.dtype))
                loads.append(os.getloadavg()[0])
    finally:
        for b in burners:
            b.terminate()
    keys = ("chunk_ms", "decode_ms")
    med = {n: {k: statistics.median(s[k] for s in samples[n]) for k in keys} for n in names}
    base = med.get("default")
    record = {
        "cpu": lscpu_model(), "dtype": args.dtype, "load_procs": args.load, "loadavg_1m": loads,
        "settings": {n: SETTINGS[n] or "libgomp default (GOMP_SPINCOUNT=300000)" for n in names},
        "samples": samples, "median": med, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    parts = []
    for n in names:
        m = med[n]
        ratio = ""
        if base:
            ratio = f" ({base['chunk_ms'] / m['chunk_ms']:.2f}x / {base['decode_ms'] / m['decode_ms']:.2f}x)"
        parts.append(f"{n} chunk {m['chunk_ms']:.0f} ms decode {m['decode_ms']:.1f} ms{ratio}")
    head = f"omp_spin {args.dtype} load+{args.load} (loadavg {min(loads):.1f}-{max(loads):.1f})"
    print(f"{head}: " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
