"""Compile the C sources in ``csrc/`` into one library on first use and cache it.

The kernels are plain C (no PyTorch headers), so a build takes about a second with the system C
compiler. The library is compiled for this machine (``-march=native``) and cached under
``$SEGSERVE_KERNEL_DIR`` (default ``~/.cache/segserve/kernels``), keyed by a hash of the source, the
flags (with :func:`defines`, which tune it for the CPU's vendor), the compiler's version and the CPU's
feature flags, so a changed source or another CPU rebuilds. Nothing is downloaded.

When the CPU lacks AVX-512F or AVX-512 BF16, or no compiler works, :func:`load` returns None with the
reason in :func:`unavailable_reason` and segserve runs its eager PyTorch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from segserve.kernels.switch import env_on

CSRC = Path(__file__).parent / "csrc"
# Every ``.c`` file in csrc/ goes into the one library (sorted, so the build key is stable); the
# headers they include are hashed with them, so editing a header rebuilds too.
SOURCES = tuple(sorted(CSRC.glob("*.c")))
HEADERS = tuple(sorted(CSRC.glob("*.h")))
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
REQUIRED_CPU_FLAGS = ("avx512f", "avx512_bf16")
ABI_VERSION = 13
SYMBOLS = (
    "sg_abi_version", "sg_linear", "sg_rope", "sg_write_kv", "sg_decode_attention", "sg_decode_stack",
    "sg_rows", "sg_amx_probe", "sg_amx_pack", "sg_amx_linear", "sg_amx_peak",
    "sg_chunk_attention", "sg_qdequant", "sg_quant_int8_built", "sg_f32gemm", "sg_amx_rows_linear",
    "sg_stack_timing", "sg_bf16gemm", "sg_bf16gemm_peak", "sg_sample",
    "sg_logprobs",
)

_loaded: ctypes.CDLL | None = None
_reason: str | None = None
_tried = False


def cache_dir() -> Path:
    """Where built libraries go: ``$SEGSERVE_KERNEL_DIR`` or ``~/.cache/segserve/kernels``."""
    env = os.environ.get("SEGSERVE_KERNEL_DIR")
    return Path(env) if env else Path.home() / ".cache" / "segserve" / "kernels"


def _cpuinfo(field: str) -> str:
    """The first ``field : value`` line's value in ``/proc/cpuinfo`` ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_flags() -> set[str]:
    return set(_cpuinfo("flags").split())


def cpu_vendor() -> str:
    """``/proc/cpuinfo``'s ``vendor_id`` (``AuthenticAMD``, ``GenuineIntel``), or "" where it says none."""
    return _cpuinfo("vendor_id")


def defines(vendor: str | None = None) -> tuple[str, ...]:
    """The ``-D`` flags that tune the build for this CPU (``vendor``: :func:`cpu_vendor` when None):
    ``SG_STREAM_NTA`` picks the weight streams' prefetch hint, non-temporal on AMD only (why:
    ``csrc/segserve_simd.h``)."""
    vendor = cpu_vendor() if vendor is None else vendor
    return (f"-DSG_STREAM_NTA={int(vendor == 'AuthenticAMD')}",)


def _compiler() -> str:
    return os.environ.get("CC", "gcc")


def switched_on_by_env() -> bool:
    """``SEGSERVE_CPU_KERNELS`` is unset or not one of 0/false/off/no (the process-wide default)."""
    return env_on("SEGSERVE_CPU_KERNELS")


def _source_parts() -> list[bytes]:
    """Each C source's and header's name and bytes, in a fixed order: what the library is built from."""
    return [f.name.encode() + f.read_bytes() for f in (*SOURCES, *HEADERS)]


def source_hash() -> str:
    """SHA-256 (first 16 hex digits) of every C source and header: what a step profile measured with
    the kernels depends on (torch-free; builds nothing)."""
    key = hashlib.sha256()
    for part in _source_parts():
        key.update(part)
    return key.hexdigest()[:16]


def expected_available() -> bool:
    """Whether :func:`load` can be expected to succeed here (the CPU's flags and a compiler on PATH),
    judged without building or importing torch; the step-profile fingerprint uses it."""
    if not switched_on_by_env():
        return False
    flags = _cpu_flags()
    cpu_ok = platform.machine() in ("x86_64", "AMD64") and all(f in flags for f in REQUIRED_CPU_FLAGS)
    return cpu_ok and shutil.which(_compiler().split()[0]) is not None


def _digest_path(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _intact(target: Path) -> bool:
    """Whether ``target`` is the library a build wrote: its SHA-256 matches the digest written beside
    it. Loading a truncated or foreign file could crash the process (SIGBUS), so anything else is
    rebuilt."""
    try:
        digest = _digest_path(target).read_text().strip()
        return hashlib.sha256(target.read_bytes()).hexdigest() == digest
    except OSError:
        return False


def _compile_and_link(cc: str, objs: Path, out: str, sources: tuple[Path, ...] | None = None,
                      extra_flags: tuple[str, ...] = ()) -> None:
    """Compile every source to an object in ``objs``, all at once (one compiler per source, so a
    build takes the slowest file's time on a multi-core machine rather than the sum: ~12 s instead of
    ~29 s here), then link them into ``out``. ``sources`` (default :data:`SOURCES`; a variant's, same file
    names, the headers found in ``csrc``) and ``extra_flags`` build a variant
    (``benchmarks/ab_kernel_builds.py``).

    Raises:
        RuntimeError: a compiler or the linker failed (its exit status and the end of its stderr).
    """
    compile_flags = [f for f in FLAGS if f != "-shared"] + list(defines()) + [f"-I{CSRC}", *extra_flags]
    jobs = []
    for src in SOURCES if sources is None else sources:
        obj = objs / (src.stem + ".o")
        cmd = [cc, *compile_flags, "-c", str(src), "-o", str(obj)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        jobs.append((src, obj, proc))
    failures = []
    for src, _, proc in jobs:
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            failures.append(f"{src.name}: timed out after 120 s")
            continue
        if proc.returncode:
            failures.append(f"{src.name} ({proc.returncode}): {err.strip()[-2000:]}")
    if failures:
        raise RuntimeError(f"{cc} failed: " + "; ".join(failures))
    proc = subprocess.run(
        [cc, *FLAGS, *(str(o) for _, o, _ in jobs), "-o", out, "-lm"],
        capture_output=True, text=True, timeout=120,
    )
    if proc.returncode:
        raise RuntimeError(f"{cc} failed ({proc.returncode}) linking: {proc.stderr.strip()[-2000:]}")


def _build(target: Path, cc: str) -> None:
    """Compile into a temporary file beside ``target``, then rename (the digest first): concurrent
    builders never see a half-written library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=target.parent) as objs:
            _compile_and_link(cc, Path(objs), tmp)
        digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
        fd2, tmp_digest = tempfile.mkstemp(suffix=".sha256", dir=target.parent)
        with os.fdopen(fd2, "w") as f:
            f.write(digest)
        os.replace(tmp_digest, _digest_path(target))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> ctypes.CDLL | None:
    """The compiled library (built now if needed), or None when it cannot be had on this machine.

    Import ``torch`` first (this module's callers do): the library's OpenMP runtime is then the one
    PyTorch already loaded (same soname), so both share one thread pool instead of two competing.
    """
    global _loaded, _reason, _tried
    if _tried:
        return _loaded
    _tried = True
    flags = _cpu_flags()
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in flags]
    if platform.machine() not in ("x86_64", "AMD64") or missing:
        _reason = f"CPU lacks {', '.join(missing) or 'x86-64'} (needed: {', '.join(REQUIRED_CPU_FLAGS)})"
        return None
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        _reason = f"no C compiler ({cc}): {e}"
        return None
    key = hashlib.sha256()
    for part in (*_source_parts(), " ".join(FLAGS + defines()), version, " ".join(sorted(flags))):
        key.update(part if isinstance(part, bytes) else part.encode())
    target = cache_dir() / f"segserve_cpu_{key.hexdigest()[:16]}.so"
    try:
        if not _intact(target):
            _build(target, cc)
        lib = ctypes.CDLL(str(target))
        for name in SYMBOLS:
            getattr(lib, name)
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
        _reason = f"could not build or load {', '.join(f.name for f in SOURCES)} ({target}): {e}"
        return None
    if lib.sg_abi_version() != ABI_VERSION:
        _reason = f"{target} has ABI {lib.sg_abi_version()}, expected {ABI_VERSION}"
        return None
    _loaded = lib
    return lib


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (None when it loaded or was not tried)."""
    return _reason
