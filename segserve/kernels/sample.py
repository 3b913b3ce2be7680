"""PyTorch-facing wrappers of the compiled sampler (``csrc/segserve_sample.c``): :func:`sample_rows`
(temperature, top-k, top-p and min-p over each row of float32 logits, then one draw by an exponential
race whose per-token noise is a hash of the row's key and the token id) and :func:`logprobs_rows` (a
token's logprob and rank and the top-k logprobs of each row), in a few vector passes a row instead of
the PyTorch path's softmax, random generator and sort.

Whether to use it is the caller's choice (``segserve.worker.sampler``, when :func:`enabled`); it is on
whenever the compiled kernels are (``SEGSERVE_CPU_KERNELS``).
"""

from __future__ import annotations

import ctypes

import torch

from segserve.kernels import cpu as cpu_kernels

_P = ctypes.c_void_p
_L = ctypes.c_int64

_ERRORS = {-1: "unsupported shape, token id or a temperature <= 0", -2: "out of memory",
           -5: "argument struct of another size (the library and sample.py disagree on its layout)"}


@cpu_kernels._sized
class _SampleArgs(ctypes.Structure):
    """``sg_sample_args``."""

    _fields_ = [
        ("size", _L), ("n", _L), ("V", _L), ("logits", _P), ("ld", _L), ("temperature", _P), ("top_k", _P),
        ("top_p", _P), ("min_p", _P), ("key", _P), ("out", _P), ("kept", _P),
    ]


@cpu_kernels._sized
class _LogprobsArgs(ctypes.Structure):
    """``sg_logprobs_args``."""

    _fields_ = [
        ("size", _L), ("n", _L), ("V", _L), ("logits", _P), ("ld", _L), ("token", _P), ("k", _L),
        ("logprob", _P), ("rank", _P), ("top_logprob", _P), ("top_id", _P),
    ]


_ARGS = {"sg_sample": _SampleArgs, "sg_logprobs": _LogprobsArgs}
_ERR_VALUE = -3


def _library():
    """The compiled library with this kernel's entry point typed, or None."""
    return cpu_kernels.typed(cpu_kernels._library(), _ARGS)


def _check_logits(logits: torch.Tensor) -> tuple[int, int]:
    """``(R, V)`` of float32 CPU logits with contiguous columns.

    Raises:
        ValueError: another dtype, device or rank, an empty side, or strided columns."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2:
        raise ValueError(f"logits must be a (R, V) float32 CPU tensor, got {logits.dtype} "
                         f"{tuple(logits.shape)} on {logits.device}")
    r, v = logits.shape
    if r < 1 or v < 1 or logits.stride(1) != 1:
        raise ValueError(f"logits must have R >= 1 rows of V >= 1 contiguous columns, got "
                         f"{tuple(logits.shape)} with strides {logits.stride()}")
    return r, v


def enabled() -> bool:
    """True when the compiled kernels are on and built for this machine."""
    return cpu_kernels.enabled()


def sample_rows(
    logits: torch.Tensor,
    temperature: list[float],
    top_k: list[int],
    top_p: list[float],
    min_p: list[float],
    key: torch.Tensor,
    kept: torch.Tensor | None = None,
) -> list[int]:
    """One token per row of ``(R, V)`` float32 logits (rows may be strided, columns contiguous).

    Per row: logits below the top-k-th largest go (ties stay; ``top_k`` 0 or >= V is off); weights
    ``exp((l - max) / T)``; tokens outside the top-p nucleus go (a token stays when the mass before it
    in descending order is below ``top_p``, vLLM's rule; 1 is off); tokens whose probability is below
    ``min_p`` times the top one go (0 is off); then the kept token with the largest ``w / E``, ``E =
    -log U`` and ``U`` the hash of (``key``, token id) of ``segserve.worker.sampler.race_noise`` (the
    exponential race: token i wins with probability ``w_i / sum w``). A row with a NaN logit, or with
    nothing kept (every logit -inf), gives ``argmax``'s answer (the first NaN, else the first maximum).

    Args:
        logits: (R, V) float32 CPU logits.
        temperature, top_k, top_p, min_p: R values each; temperatures > 0 (greedy rows are argmax).
        key: (R,) int64: each row's noise key (its randomness).
        kept: optional (R, V) float32 contiguous output of each row's kept weights (0 where filtered;
            unnormalized, the top token's weight 1), for tests.

    Returns:
        R token ids.

    Raises:
        ValueError: on a dtype, shape or stride the kernel does not take, or list lengths other than R.
        RuntimeError: the kernel refused (a temperature <= 0).
    """
    r, v = _check_logits(logits)
    lists = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}
    for name, values in lists.items():
        if len(values) != r:
            raise ValueError(f"{name} has {len(values)} values for {r} rows")
    if key.dtype != torch.int64 or key.shape != (r,) or not key.is_contiguous():
        raise ValueError(f"key must be ({r},) contiguous int64, got {key.dtype} {tuple(key.shape)}")
    if kept is not None and (kept.dtype != torch.float32 or kept.shape != (r, v) or not kept.is_contiguous()):
        raise ValueError(f"kept must be ({r}, {v}) contiguous float32, got {kept.dtype} {tuple(kept.shape)}")
    temps = torch.tensor(temperature, dtype=torch.float32)
    ks = torch.tensor(top_k, dtype=torch.int32)
    ps = torch.tensor(top_p, dtype=torch.float32)
    mins = torch.tensor(min_p, dtype=torch.float32)
    out = torch.empty(r, dtype=torch.int64)
    rc = _library().sg_sample(_SampleArgs(
        size=_SampleArgs.SIZE, n=r, V=v, logits=logits.data_ptr(), ld=logits.stride(0),
        temperature=temps.data_ptr(), top_k=ks.data_ptr(), top_p=ps.data_ptr(), min_p=mins.data_ptr(),
        key=key.data_ptr(), out=out.data_ptr(), kept=None if kept is None else kept.data_ptr(),
    ))
    if rc:
        raise RuntimeError(f"sg_sample failed: {_ERRORS.get(rc, rc)}")
    return out.tolist()


def logprobs_rows(logits: torch.Tensor, tokens: list[int], k: int
                  ) -> tuple[list[float], list[int], torch.Tensor, torch.Tensor] | None:
    """Each row's ``log_softmax`` at ``tokens[r]``, that token's rank (how many logits are >= its own:
    1 is the most likely) and the ``k`` largest logprobs with their ids (descending; ties: lower id
    first), for ``(R, V)`` float32 logits. Each logprob is rounded once from ``l - log Z`` in double (the
    sum of exponentials in double, exp a polynomial within ~1 ulp): within 1 float32 ulp plus 2.4e-7 of
    a float64 ``log_softmax``.

    Returns:
        (R logprobs, R ranks, (R, k) top logprobs, (R, k) int64 top ids), or None when a row holds a
        NaN or +inf logit (``log_softmax`` is NaN there; the caller's PyTorch path answers).

    Raises:
        ValueError: a dtype, shape or stride the kernel does not take, a token outside [0, V), k outside
            [0, V], or ``len(tokens) != R``.
    """
    r, v = _check_logits(logits)
    if len(tokens) != r:
        raise ValueError(f"tokens has {len(tokens)} values for {r} rows")
    if not 0 <= k <= v:
        raise ValueError(f"k must be in [0, {v}], got {k}")
    bad = next((t for t in tokens if not 0 <= t < v), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {v})")
    token = torch.tensor(tokens, dtype=torch.int64)
    lp = torch.empty(r, dtype=torch.float32)
    rank = torch.empty(r, dtype=torch.int64)
    top_lp = torch.empty(r, k, dtype=torch.float32)
    top_id = torch.empty(r, k, dtype=torch.int64)
    rc = _library().sg_logprobs(_LogprobsArgs(
        size=_LogprobsArgs.SIZE, n=r, V=v, logits=logits.data_ptr(), ld=logits.stride(0),
        token=token.data_ptr(), k=k, logprob=lp.data_ptr(), rank=rank.data_ptr(),
        top_logprob=top_lp.data_ptr(), top_id=top_id.data_ptr(),
    ))
    if rc == _ERR_VALUE:
        return None
    if rc:
        raise RuntimeError(f"sg_logprobs failed: {_ERRORS.get(rc, rc)}")
    return lp.tolist(), rank.tolist(), top_lp, top_id
