"""Issue 16: segserve on GGUF blocks against llama.cpp's ``llama-bench`` on the same files, one run.

For the default Q4_1 SmolLM2 and a Q8_0 copy made here (``llama-quantize --allow-requantize``, so both
engines read the very same Q8_0 file), with ``--threads`` threads each (default 2):

- batch-1 decode, end to end: segserve's ``LLM.generate`` of one request, ``(n - 1) / (t(n) - t(1))``
  tokens/s (the vs_vllm driver's measure: scheduler, model, LM head, sampler, detokenizer), against
  ``llama-bench`` ``tg128`` (128 tokens from an empty context); goal ratio >= 1.2;
- prompt processing of 512 tokens: ``512 / t`` of a 512-token prompt with ``max_tokens=1`` in one step
  (budget 512), against ``pp512``; goal ratio >= 1;
- resident memory after ``LLM()`` with the default model (weights: the bytes of every parameter and
  buffer; goal <= 120 MB), measured in a fresh process, with the process RSS, for the native and the
  dequantized (``quantization="none"``) model and a small KV cache (64 MiB) so the figure is the model's.

llama.cpp is built from the source vendored in the llama-cpp-python 0.3.36 sdist on first use (``pip
download --no-deps --no-binary llama-cpp-python``, cmake, native CPU flags) into
``~/.cache/segserve/baselines/llama.cpp-0.3.36`` (``--cache``): a benchmark tool, never a segserve
dependency, never run in CI. Each engine runs alone, the other idle, in ``--repeats`` rounds of one
repetition each whose order alternates (segserve, llama.cpp, llama.cpp, segserve, ...), so the shared
host's slow phases fall on both; the figures are the medians over the rounds.

segserve runs its defaults: on a CPU with AVX-512 VNNI, batch-1 decode steps on Q4_0 / Q4_1 blocks take
16-bit integer activations (``quant.int8_formats``; the same greedy tokens as the float kernels on the
real prompts of ``benchmarks/int8_accuracy.py``); Q8_0 stays float. ``--float-activations`` adds, per
file, segserve with that path off (``SEGSERVE_QUANT_INT8=0``: the weights-only float kernels throughout),
printed beside the default's.

Prints one summary line per figure and one overall; writes ``results/vs_llamacpp.json`` with the lscpu
model name, the load average around each run, versions and commands.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from segserve.bench.host import cpu_times, steal_share

LLAMA_CPP_PYTHON = "0.3.36"
DEFAULT_CACHE = Path.home() / ".cache" / "segserve" / "baselines" / f"llama.cpp-{LLAMA_CPP_PYTHON}"
GOALS = {"tg128": 1.2, "pp512": 1.0}
WEIGHT_GOAL_MB = 120.0


def load_average() -> float:
    return os.getloadavg()[0]


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return platform.processor()
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "")


# ---------------------------------------------------------------------------------------- llama.cpp


def build_llama_cpp(cache: Path, jobs: int) -> Path:
    """``cache/build/bin`` holding ``llama-bench`` and ``llama-quantize``, built now if missing."""
    bindir = cache / "build" / "bin"
    if (bindir / "llama-bench").is_file() and (bindir / "llama-quantize").is_file():
        return bindir
    cache.mkdir(parents=True, exist_ok=True)
    sdist = next(cache.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"), None)
    if sdist is None:
        # The sdist, not a wheel. ``--no-binary :all:`` would also make pip build the sdist's own build
        # dependencies (scikit-build-core, hatchling, setuptools...) from source just to read its
        # metadata: over 15 minutes here without finishing; naming the one package keeps it an sdist.
        name = "llama-cpp-python"
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", name,
                        f"{name}=={LLAMA_CPP_PYTHON}", "-d", str(cache)], check=True)
        sdist = next(cache.glob("llama_cpp_python-*.tar.gz"))
    src = cache / "src"
    if not src.is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(cache / "extract", filter="data")
        top = next((cache / "extract").iterdir())
        shutil.move(str(top / "vendor" / "llama.cpp"), str(src))
    build = cache / "build"
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DBUILD_SHARED_LIBS=OFF"],
                   check=True)
    targets = ["--target", "llama-bench", "llama-quantize"]
    subprocess.run(["cmake", "--build", str(build), "-j", str(jobs), *targets], check=True)
    return bindir


def make_q8_0(bindir: Path, src: Path, dst: Path) -> Path:
    """``dst``: ``src`` requantized to Q8_0 by llama.cpp (every tensor Q8_0 but the norms), if missing."""
    if not dst.is_file():
        subprocess.run([str(bindir / "llama-quantize"), "--allow-requantize", "--pure", str(src), str(dst),
                        "Q8_0"], check=True, capture_output=True)
    return dst


def parse_llama_bench(text: str) -> dict[str, float]:
    """``{"pp512": tok/s, "tg128": tok/s}`` from ``llama-bench -o json`` output (one entry per test)."""
    out = {}
    for entry in json.loads(text):
        if entry.get("n_prompt", 0) and not entry.get("n_gen", 0):
            out[f"pp{entry['n_prompt']}"] = float(entry["avg_ts"])
        elif entry.get("n_gen", 0) and not entry.get("n_prompt", 0):
            out[f"tg{entry['n_gen']}"] = float(entry["avg_ts"])
    return out


def llama_bench(bindir: Path, model: Path, threads: int, repeats: int) -> dict:
    # --repack 0: with repacking on (the default), this build's AMX path for quantized weights
    # (ggml_backend_amx_mul_mat) crashes with SIGSEGV on the AMX Xeon; the plain CPU path runs.
    cmd = [str(bindir / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", "512", "-n", "128",
           "-r", str(repeats), "--repack", "0", "-o", "json"]
    before = load_average()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return {**parse_llama_bench(proc.stdout), "command": " ".join(cmd), "load_before": before,
            "load_after": load_average()}


# ----------------------------------------------------------------------------------------- segserve


class SegserveRates:
    """segserve's ``tg128`` (end-to-end batch-1 decode) and ``pp512`` on ``model``, one repetition a call.

    The ``LLM`` is built and both step shapes warmed once; ``rep()`` then times one ``tg128`` and one
    ``pp512`` (tok/s each), so the benchmark can alternate it with llama.cpp's repetitions."""

    def __init__(self, model: Path, threads: int, dtype: str, quantization: str | None) -> None:
        import torch

        from segserve import LLM

        torch.set_num_threads(threads)
        self.dtype, self.quantization = dtype, quantization
        self.llm = LLM(model=str(model), dtype=dtype, quantization=quantization, max_num_batched_tokens=512,
                       kv_cache_memory_bytes=256 << 20, max_model_len=1024, enable_prefix_caching=False)
        self.short = [1, 504, 3458, 282, 4649, 314, 253, 216]  # 8 tokens: tg128 starts from an empty context
        self.long = [(17 * i) % 40000 + 100 for i in range(512)]
        self._timed(self.short, 4)
        self._timed(self.long, 1)  # warm-up of both step shapes

    def _timed(self, prompt: list[int], n: int) -> float:
        from segserve import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert len(outs[0].outputs[0].token_ids) == n
        return time.perf_counter() - t0

    def rep(self) -> dict[str, float]:
        t1, tn = self._timed(self.short, 1), self._timed(self.short, 129)
        return {"tg128": 128 / (tn - t1), "pp512": 512 / self._timed(self.long, 1)}


def summarize_reps(reps: list[dict]) -> dict:
    """Each goal's median tok/s over ``reps`` and, as ``<test>_runs``, every repetition's."""
    out = {t: statistics.median(r[t] for r in reps) for t in GOALS}
    return out | {f"{t}_runs": [r[t] for r in reps] for t in GOALS}


def steal_text(shares: list[float | None]) -> str:
    """``shares`` as percentages, e.g. ``"0 / 3 / 12 %"`` (``?`` where /proc/stat was unreadable)."""
    return " / ".join("?" if x is None else f"{100 * x:.0f}" for x in shares) + " %"


def interleaved(ours: SegserveRates, bindir: Path, model: Path, threads: int,
                repeats: int) -> tuple[dict, dict]:
    """``repeats`` rounds of one segserve repetition and one ``llama-bench -r 1``, the order alternating
    round by round (ABBA...), so a slow phase of the shared host falls on both engines alike.

    Returns (segserve, llama.cpp) dicts of medians, the per-round runs, the load around them and each
    run's share of CPU time stolen by the hypervisor (``steal_runs``, see ``segserve.bench.host``)."""
    runs: dict[str, list[dict]] = {"segserve": [], "llama.cpp": []}
    before = load_average()
    for r in range(repeats):
        order = ("segserve", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "segserve")
        for engine in order:
            t0 = cpu_times()
            run = ours.rep() if engine == "segserve" else llama_bench(bindir, model, threads, 1)
            runs[engine].append(run | {"steal": steal_share(t0, cpu_times())})
    after = load_average()
    out = []
    for engine in ("segserve", "llama.cpp"):
        entry = summarize_reps(runs[engine])
        steals = [r["steal"] for r in runs[engine]]
        entry |= {"load_before": before, "load_after": after, "steal_runs": steals}
        out.append(entry)
    out[0] |= {"dtype": ours.dtype, "quantization": ours.quantization}
    out[1]["command"] = runs["llama.cpp"][0]["command"]
    return out[0], out[1]


_MEMORY_PROBE = """
import json, sys, torch
from segserve import LLM
torch.set_num_threads(int(sys.argv[1]))
q = None if sys.argv[2] == "default" else sys.argv[2]
llm = LLM(quantization=q, kv_cache_memory_bytes=64 << 20)
m = llm.llm_engine.loaded.model
weights = sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])
rss = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024
print(json.dumps({"weights_mb": weights / 1e6, "rss_mb": rss / 1e6}))
"""


def memory_after_load(threads: int, quantization: str) -> dict:
    """Weights and RSS of ``LLM()`` (default model) measured in a fresh process."""
    proc = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(threads), quantization],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="rounds, each one rep of both engines")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--jobs", type=int, default=2, help="parallel jobs of the llama.cpp build")
    p.add_argument("--setup-only", action="store_true", help="build llama.cpp and the Q8_0 file, then stop")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--float-activations", action="store_true",
                   help="also time segserve with the integer-activation path off (SEGSERVE_QUANT_INT8=0)")
    p.add_argument("--json", type=Path, default=Path("results/vs_llamacpp.json"))
    args = p.parse_args(argv)

    from segserve.model_files import default_model_path

    bindir = build_llama_cpp(args.cache, args.jobs)
    q4_1 = default_model_path()
    q8_0 = make_q8_0(bindir, q4_1, args.cache / "SmolLM2-135M-Instruct.Q8_0.gguf")
    if args.setup_only:
        print(f"llama.cpp tools in {bindir}; Q8_0 file {q8_0}")
        return 0
    from segserve.kernels import quant

    result: dict = {"cpu": cpu_model(), "threads": args.threads, "llama_cpp_python_sdist": LLAMA_CPP_PYTHON,
                    "python": sys.version.split()[0], "files": {},
                    "integer_activations": quant.int8_formats(1) != 0}
    lines = []
    for label, path in (("Q4_1", q4_1), ("Q8_0", q8_0)):
        ours, theirs = interleaved(SegserveRates(path, args.threads, args.dtype, None), bindir, path,
                                   args.threads, args.repeats)
        entry = {"path": str(path), "segserve": ours, "llama.cpp": theirs}
        for test, goal in GOALS.items():
            ratio = ours[test] / theirs[test]
            entry[f"{test}_ratio"] = ratio
            verdict = "PASS" if ratio >= goal else "FAIL"
            lines.append(f"{label} {test}: segserve {ours[test]:.1f} tok/s vs llama.cpp {theirs[test]:.1f} "
                         f"tok/s = {ratio:.2f}x (goal >= {goal}) {verdict}")
        lines.append(f"{label} host steal per round (share of CPU time, vmstat's st): segserve "
                     f"{steal_text(ours['steal_runs'])}; llama.cpp {steal_text(theirs['steal_runs'])}")
        if args.float_activations:
            previous = quant.set_int8(False)
            try:
                float_rates = SegserveRates(path, args.threads, args.dtype, None)
                reps = [float_rates.rep() for _ in range(args.repeats)]
                floats = entry["segserve_float_activations"] = summarize_reps(reps)
            finally:
                quant.set_int8(previous)
            for test in GOALS:
                lines.append(f"{label} {test} [float activations, SEGSERVE_QUANT_INT8=0]: segserve "
                             f"{floats[test]:.1f} tok/s vs llama.cpp {theirs[test]:.1f} tok/s = "
                             f"{floats[test] / theirs[test]:.2f}x")
        result["files"][label] = entry
    if not args.skip_memory:
        result["memory"] = {q: memory_after_load(args.threads, q) for q in ("default", "none")}
        mem, dense = result["memory"]["default"], result["memory"]["none"]
        verdict = "PASS" if mem["weights_mb"] <= WEIGHT_GOAL_MB else "FAIL"
        lines.append(f"memory after LLM(): weights {mem['weights_mb']:.1f} MB (goal <= {WEIGHT_GOAL_MB:.0f}) "
                     f"{verdict}, RSS {mem['rss_mb']:.0f} MB; dequantized: weights "
                     f"{dense['weights_mb']:.1f} MB, RSS {dense['rss_mb']:.0f} MB")
    for line in lines:
        print(line)
    passed = sum("PASS" in ln for ln in lines)
    goals = sum("PASS" in ln or "FAIL" in ln for ln in lines)
    print(f"vs_llamacpp: {passed}/{goals} goals met ({result['cpu']}, {args.threads} threads, "
          f"{args.dtype})")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
