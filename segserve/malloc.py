"""Keep glibc's malloc from handing a step's large buffers back to the kernel, so the next step does not
fault them in again.

A prefill step allocates its activations per layer (a 4,096-token bfloat16 step: the qkv output 7.9 MB,
gate|up 25 MB, ...) and frees them a few milliseconds later. glibc serves such sizes with ``mmap`` and
returns them with ``munmap`` on free (its dynamic mmap threshold starts at 128 KiB and only rises to the
size of a freed block), and trims the heap's free top back to the kernel above 128 KiB; either way the
next step touches fresh pages, each a minor fault that the kernel zero-fills (in a virtual machine, through
the hypervisor's page tables too). Measured on the AMX Xeon (2 threads, bfloat16 export of SmolLM2-135M,
4,096-token prompts at budget 4,096 after a 512-token warm-up, fresh processes alternating, four rounds,
2026-12-04, load ~1.5): the third prefill of a process 1,313-1,374 ms with 23,000-32,000 minor faults by
default, 1,239-1,279 ms with 0 faults with the thresholds below (~5 %); the first prefill faults its
buffers in either way (1,406-1,487 ms). TCMalloc, which vLLM's CPU guide preloads for the same reason,
gave the same steady state here.

:func:`configure` fixes ``M_MMAP_THRESHOLD`` at :data:`MMAP_THRESHOLD` (glibc's largest; it also turns
off the dynamic threshold) and ``M_TRIM_THRESHOLD`` at :data:`TRIM_THRESHOLD` through ``mallopt``. The
price: freed memory below those sizes stays in the process for reuse (its peak working set), as with
TCMalloc. It does nothing when the user chose (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_TOP_PAD_`` or ``MALLOC_MMAP_MAX_`` set, or ``glibc.malloc.*`` in ``GLIBC_TUNABLES``), off glibc,
or with ``SEGSERVE_MALLOC=0``. Importing ``segserve`` calls it.

:func:`prefault` then gives the first large step the same: the engine touches its budget's worth of
activation memory at start-up (``LLMEngine.prefaulted_bytes``; 96 MiB for SmolLM2-135M in bfloat16 at
the offline budget of 4,096 tokens, ~60 ms here), which the heap keeps. Measured (AMX Xeon, 4,096-token
prompts after a 512-token warm-up, four in a process): with prefault 1,050-1,087 ms and at most 166
faults each; with the thresholds alone the first took 1,119-1,225 ms with ~15,000 faults and a later one
another ~5,400; with neither every one faulted 25,000-49,000 pages (1,182-1,268 ms).
"""

from __future__ import annotations

import ctypes
import os
import platform

from segserve.kernels.switch import env_on

# mallopt's parameter numbers (glibc malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # bytes: glibc's ceiling for it on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 512 << 20  # bytes of free heap top kept before trimming
_USER_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

# What configure() set, {"mmap_threshold": bytes, "trim_threshold": bytes}, or None when it left malloc as
# it was.
applied: dict[str, int] | None = None


def configure() -> dict[str, int] | None:
    """Set glibc's mmap and trim thresholds for this process unless the user chose (module docstring);
    returns what was set (also kept in :data:`applied`), or None when malloc was left as it was."""
    global applied
    if (not env_on("SEGSERVE_MALLOC") or any(v in os.environ for v in _USER_VARS)
            or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")):
        return None
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt  # a preloaded allocator's own mallopt when there is one
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return None
    applied = {"mmap_threshold": MMAP_THRESHOLD, "trim_threshold": TRIM_THRESHOLD}
    return applied


# Pieces in which prefault() touches memory: below MMAP_THRESHOLD, so they come from the heap and
# stay there when freed (a larger piece would be mmap'd and unmapped again).
PREFAULT_PIECE = 16 << 20
# The most prefault() touches: more would leave a free heap top above TRIM_THRESHOLD, which glibc
# hands back to the kernel on the last free.
PREFAULT_MAX = TRIM_THRESHOLD // 2


def prefault(nbytes: int) -> int:
    """Touch ``nbytes`` (rounded up to :data:`PREFAULT_PIECE`, at most :data:`PREFAULT_MAX`) of malloc's
    heap and free them again, so that a first large step carves its activations out of pages the
    process already has, instead of faulting them in one by one while it runs. Only when
    :func:`configure` applied its thresholds (else the heap's top would be trimmed on free and the pages
    returned). Returns the bytes touched (0 when it did nothing).

    Why: on the AMX Xeon (a virtual machine: a minor fault costs ~10 us there) the first 4,096-token
    bfloat16 prefill of a process faulted ~15,000 pages in (~60 MB) and took ~1.2 s where later ones
    took ~1.05 s; a second one still faulted ~5,000. Touching the memory at start-up costs the same
    faults, once, before any request (vLLM warms its engine up at start-up for the same reason).

    Raises:
        ValueError: when ``nbytes`` is negative.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if applied is None or nbytes == 0:
        return 0
    libc = ctypes.CDLL(None)
    libc.malloc.argtypes, libc.malloc.restype = (ctypes.c_size_t,), ctypes.c_void_p
    libc.free.argtypes, libc.free.restype = (ctypes.c_void_p,), None
    libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
    libc.memset.restype = ctypes.c_void_p
    pieces = []
    try:
        for _ in range(-(-min(nbytes, PREFAULT_MAX) // PREFAULT_PIECE)):
            p = libc.malloc(PREFAULT_PIECE)
            if not p:
                break
            libc.memset(p, 0, PREFAULT_PIECE)
            pieces.append(p)
    finally:
        for p in reversed(pieces):
            libc.free(p)
    return len(pieces) * PREFAULT_PIECE
