"""Per-machine step profiles: what a step's time depends on (the fingerprint), a cache of profiles
fitted on this machine, and the one rule by which ``simulate``, ``tune`` and the server pick one.

A profile measured on one machine predicts another only by luck: CPUs of the same kind differ and
the kernels, dtype and model change every coefficient. So ``segserve profile --quick`` (or
``--calibrate`` on the other commands) writes its fit to ``<cache>/profiles/<key>.json``, where the
cache is ``$SEGSERVE_CACHE_DIR`` or ``~/.cache/segserve`` and ``key`` hashes the ``Fingerprint``:
CPU model name, CPU count and threads, model file (path and size), dtype, compiled kernels on/off and
their source hash, block size and ``kv_segment_size`` (the gather plan and the chunk attention walk
depend on both). A file at that path is used only when it parses, has this ``SCHEMA_VERSION`` and
carries this very fingerprint; anything else is refused with its path named (``--calibrate``
replaces it). With no file, the built-in profile is used with a warning naming the machine it was
measured on. Torch-free: the fingerprint reads ``/proc/cpuinfo``, the environment and file sizes.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from segserve.simulator.step_model import (
    BUILTIN_MACHINE,
    DEFAULT_CPU_MODEL,
    LinearStepModel,
    StepTimeModel,
    model_from_dict,
)

# Bumped when the cached file's layout or the step model's features change: older files are refused.
SCHEMA_VERSION = 4  # 2: distinct-context and mixed probes, reference timing (issue 18); 3: decode_stack_rows;
# 4: the decode-only table (stack_base, stack_ctx)


class ProfileError(ValueError):
    """A cached or given profile file that cannot be used (the message names the file and why)."""


def cache_dir() -> Path:
    """Where machine profiles live: ``$SEGSERVE_CACHE_DIR/profiles`` or ``~/.cache/segserve/profiles``."""
    env = os.environ.get("SEGSERVE_CACHE_DIR")
    return (Path(env) if env else Path.home() / ".cache" / "segserve") / "profiles"


@dataclass(frozen=True)
class Fingerprint:
    """Everything a step profile's coefficients depend on.

    Attributes:
        cpu_model: the CPU's model name (``/proc/cpuinfo``), e.g. ``AMD EPYC 9R14``.
        cpu_count: CPUs this process may run on.
        threads: compute threads (``OMP_NUM_THREADS`` when set, else ``cpu_count``: torch's default).
        model: resolved path of the model file or directory.
        model_bytes: its size (a directory: the sum of its files), bytes.
        dtype: ``float32`` or ``bfloat16``.
        kernels: whether the compiled CPU kernels run (``SEGSERVE_CPU_KERNELS``, CPU flags, compiler).
        kernel_source: hash of the kernels' C sources (``segserve.kernels.build.source_hash``).
        block_size: KV block size, tokens.
        kv_segment_size: the segmented kernel's segment, tokens.
        omp_wait: libgomp's idle-wait setting (``segserve.openmp.wait_setting``): how long its threads
            spin between a step's parallel regions changes a short step's time by ~25 % here.
    """

    cpu_model: str
    cpu_count: int
    threads: int
    model: str
    model_bytes: int
    dtype: str
    kernels: bool
    kernel_source: str
    block_size: int
    kv_segment_size: int
    omp_wait: str

    def key(self) -> str:
        """16 hex digits of SHA-256 over the fields: the cache file's name."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        """One short line for logs."""
        return (
            f"{self.cpu_model}, {self.cpu_count} CPUs / {self.threads} threads, {Path(self.model).name} "
            f"{self.dtype}, kernels {'on' if self.kernels else 'off'}, block {self.block_size}, "
            f"segment {self.kv_segment_size}"
        )

    def differences(self, other: dict) -> list[str]:
        """``field: theirs != ours`` for every field where ``other`` (a fingerprint's dict) differs."""
        return [
            f"{f.name}: {other.get(f.name)!r} != {getattr(self, f.name)!r}"
            for f in fields(self)
            if other.get(f.name) != getattr(self, f.name)
        ]


def cpu_model_name() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _threads(cpu_count: int) -> int:
    text = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else cpu_count


def _model_identity(model: str | Path | None) -> tuple[str, int]:
    from segserve.model_files import default_model_path

    path = (default_model_path() if model is None else Path(model)).resolve()
    if path.is_dir():
        return str(path), sum(p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file())
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such model file or directory")
    return str(path), path.stat().st_size


def machine_fingerprint(
    model: str | Path | None = None, dtype: str = "float32", block_size: int = 16, kv_segment_size: int = 512
) -> Fingerprint:
    """This machine's fingerprint for ``model`` (None: the default SmolLM2 GGUF) and the settings.

    Raises:
        FileNotFoundError: the model path does not exist (or the default model is not installed).
    """
    from segserve import openmp
    from segserve.kernels import build

    path, size = _model_identity(model)
    count = _cpu_count()
    return Fingerprint(
        cpu_model_name(), count, _threads(count), path, size, str(dtype), build.expected_available(),
        build.source_hash(), block_size, kv_segment_size, openmp.wait_setting(),
    )


def profile_path(fp: Fingerprint) -> Path:
    """The cache file of ``fp``."""
    return cache_dir() / f"{fp.key()}.json"


def save_cached(model: LinearStepModel, fp: Fingerprint, fit: dict, path: Path | None = None) -> Path:
    """Write ``model`` with ``fp``, the fit statistics and the schema version to the cache (atomically:
    a crash leaves the old file or none, never half a file). Returns the path."""
    path = path or profile_path(fp)
    data = model.to_dict() | {
        "schema_version": SCHEMA_VERSION,
        "fingerprint": asdict(fp),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "fit": fit,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".json.tmp", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def read_cached(path: Path, fp: Fingerprint) -> tuple[StepTimeModel, dict]:
    """The profile in ``path`` and its JSON, if it is a whole cache file of this schema and ``fp``.

    Raises:
        ProfileError: unreadable or truncated JSON, another schema version, no or another
            fingerprint (the differing fields named), or a profile the step model rejects.
    """
    data = _read_json(path)
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ProfileError(
            f"{path}: schema version {version!r}, this segserve reads {SCHEMA_VERSION} (stale)"
        )
    theirs = data.get("fingerprint")
    if not isinstance(theirs, dict):
        raise ProfileError(f"{path}: no machine fingerprint")
    diff = fp.differences(theirs)
    if diff:
        raise ProfileError(f"{path}: measured on another machine or setup ({'; '.join(diff)})")
    return _model(path, data), data


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProfileError(f"{path}: not a readable profile ({type(e).__name__}: {e}); truncated?") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: not a profile (a JSON {type(data).__name__}, not an object)")
    return data


def _model(path: Path, data: dict) -> StepTimeModel:
    try:
        return model_from_dict(data)
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(f"{path}: not a valid step profile ({type(e).__name__}: {e})") from None


@dataclass(frozen=True)
class ProfileChoice:
    """The step model a command uses and why.

    Attributes:
        model: the step-time model.
        origin: ``"given"`` (``--profile``), ``"cached"``, ``"calibrated"`` (made now) or ``"built-in"``.
        path: its file (None for the built-in).
        line: one line saying which profile is used (every command prints or logs it).
        warning: set when the profile is not this machine's (built-in, or a given file of another one).
    """

    model: StepTimeModel
    origin: str
    path: Path | None
    line: str
    warning: str | None = None


# Measures this machine and returns (fitted model, fit statistics); ``segserve.simulator.profile``
# has the real one (``calibrate_quick``), tests pass a stand-in.
Calibrator = Callable[[Fingerprint], tuple[LinearStepModel, dict]]


def choose_profile(
    fp: Fingerprint | None,
    given: str | None = None,
    calibrate: bool = False,
    calibrator: Calibrator | None = None,
) -> ProfileChoice:
    """The profile to use on the machine ``fp`` describes (None: it could not be fingerprinted, e.g.
    a simulation on a machine without the model).

    ``given`` (a ``--profile`` file) wins; a cache file among its keys is checked against ``fp`` and
    used with a warning when it is another machine's. Else this machine's cache file, if whole and
    current. Else, with ``calibrate``, ``calibrator`` measures now and the result is cached (also
    replacing a bad or stale file). Else the built-in profile, with a warning naming its machine.

    Raises:
        ProfileError: the given file is unusable, or this machine's cache file is bad or stale and
            ``calibrate`` is off (the message says how to replace it).
    """
    if given:
        return _given(Path(given), fp)
    if fp is None:
        if calibrate:
            raise ProfileError("--calibrate needs the model to measure, and it cannot be found here")
        return _builtin("no model here to fingerprint this machine by")
    path = profile_path(fp)
    if path.exists():
        try:
            model, data = read_cached(path, fp)
            return ProfileChoice(model, "cached", path, f"step profile: {path} ({_summary(data)})")
        except ProfileError as e:
            if not calibrate:
                raise ProfileError(f"{e}; refusing it: rerun with --calibrate to measure this machine "
                                   "and replace it, or delete the file") from None
            return _calibrate(fp, path, calibrator, f"replaced {path.name}: {e}")
    if calibrate:
        return _calibrate(fp, path, calibrator, "none cached")
    return _builtin(f"no step profile for this machine ({fp.describe()}) in {cache_dir()}")


def _builtin(why: str) -> ProfileChoice:
    warning = (
        f"{why}: using the built-in one, measured on {BUILTIN_MACHINE}; its predictions may be off by 2x "
        "here. Run `segserve profile --quick` (about a minute on 2 idle cores) or pass --calibrate"
    )
    line = f"step profile: built-in ({BUILTIN_MACHINE})"
    return ProfileChoice(DEFAULT_CPU_MODEL, "built-in", None, line, warning)


def _given(path: Path, fp: Fingerprint | None) -> ProfileChoice:
    data = _read_json(path)
    model = _model(path, data)
    theirs = data.get("fingerprint")
    if fp is None and isinstance(theirs, dict):
        line = f"step profile: {path} (given; {_summary(data)})"
        return ProfileChoice(model, "given", path, line, f"{path} cannot be checked against this machine")
    if not isinstance(theirs, dict):
        line = f"step profile: {path} (given; no fingerprint, machine unknown)"
        return ProfileChoice(model, "given", path, line)
    diff = fp.differences(theirs)
    line = f"step profile: {path} (given; {_summary(data)})"
    if data.get("schema_version") != SCHEMA_VERSION:
        diff.append(f"schema_version: {data.get('schema_version')!r} != {SCHEMA_VERSION}")
    if not diff:
        return ProfileChoice(model, "given", path, line)
    warning = f"{path} was measured on another machine or setup ({'; '.join(diff)}); using it as given"
    return ProfileChoice(model, "given", path, line, warning)


def _calibrate(fp: Fingerprint, path: Path, calibrator: Calibrator | None, why: str) -> ProfileChoice:
    if calibrator is None:
        from segserve.simulator.profile import calibrate_quick as calibrator
    t0 = time.perf_counter()
    model, fit = calibrator(fp)
    save_cached(model, fp, fit, path)
    return ProfileChoice(
        model, "calibrated", path,
        f"step profile: {path} (calibrated now in {time.perf_counter() - t0:.0f} s, {why}; "
        f"fit mean |rel err| {fit.get('mean_abs_rel_err', float('nan')):.1%})",
    )


def _summary(data: dict) -> str:
    fit = data.get("fit") or {}
    err = fit.get("mean_abs_rel_err")
    theirs = data.get("fingerprint") or {}
    return (
        f"{theirs.get('cpu_model', '?')}, made {data.get('created', '?')}"
        + (f", fit mean |rel err| {err:.1%}" if isinstance(err, (int, float)) else "")
    )


def fingerprint_for_args(args) -> Fingerprint | None:
    """The fingerprint of the engine flags ``args`` describe (``--model``, ``--dtype``, ``--block-size``,
    ``--kv-segment-size``); None when the model is not on this machine (simulation needs none)."""
    try:
        return machine_fingerprint(args.model, args.dtype, args.block_size, args.kv_segment_size)
    except FileNotFoundError:
        return None
