"""Step-time models: predict one engine step's duration (seconds) from the step's composition.

Two kinds, both saved as a JSON "hardware profile" (``{"kind": "linear" | "roofline", ...}``):

- ``LinearStepModel``: a weighted sum of features fitted to measured steps of this engine
  (``segserve profile``). The features follow the step's cost structure: weight GEMMs scale with the
  padded token rows, the LM head with the sampled rows, causal attention of a prefill chunk of ``c``
  tokens over ``p`` cached tokens with ``c * (p + (c + 1) / 2)`` query-key pairs, a decode with its
  context length, plus per-request and per-step overheads (Python, metadata, kernel launches), and
  ``eager_step``, the extra fixed cost of a step of more than ``SMALL_STEP_ROWS`` padded rows: those
  leave the compiled small-row kernels for the model's eager forward (per-op dispatch, oneDNN GEMMs),
  so on 2 cores step time jumps between 8 and 9 decodes (``docs/simulator.md``) and is not linear in
  the batch across that edge.
- ``RooflineStepModel``: an analytic bound for hardware we do not have: the larger of compute time
  (FLOPs / achieved FLOP/s) and memory time (weights + KV bytes / achieved bandwidth), plus a fixed
  overhead (Williams et al., "Roofline", CACM 2009; the 2 FLOPs per parameter per token rule from
  Kaplan et al., 2020).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

FEATURES = (
    "step", "padded_tokens", "sampled", "requests", "prefill_attn", "decode_ctx", "gathered_kv", "eager_step",
)
# Steps of at most this many padded rows run the compiled small-row kernels (``MAX_SMALL_ROWS`` of
# ``segserve.kernels.cpu`` for float32 and bfloat16); larger ones the model's eager forward.
SMALL_STEP_ROWS = 8


@dataclass(frozen=True)
class RequestSlice:
    """One request's part of a step.

    Attributes:
        prior: tokens already in its KV cache before the step (prefix hits included), tokens.
        chunk: tokens computed for it this step (1 for a decode), tokens.
        is_decode: True when it generates (one token past its prompt), False for prompt/recompute work.
        samples: True when the step samples a token for it (its chunk reaches its last token).
    """

    prior: int
    chunk: int
    is_decode: bool
    samples: bool


@dataclass(frozen=True)
class StepComposition:
    """What one step computes.

    Attributes:
        slices: one entry per scheduled request, in scheduling order.
        padded_tokens: rows of the padded batch (the padding bucket), tokens.
        gathered_tokens: cached tokens the attention kernel copies out of non-consecutive blocks
            in each layer (``segmented_gather_tokens``); 0 when unknown.
        stack_rows: rows up to which a decode-only step runs the one-call compiled decode stack
            (``CpuStep.decode_stack_rows``: 64 for a float32 GGUF-block model, else ``SMALL_STEP_ROWS``);
            such a step pays no ``eager_step``.
    """

    slices: tuple[RequestSlice, ...]
    padded_tokens: int
    gathered_tokens: int = 0
    stack_rows: int = SMALL_STEP_ROWS

    @property
    def num_tokens(self) -> int:
        return sum(s.chunk for s in self.slices)

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.slices if s.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.chunk for s in self.slices if not s.is_decode)

    @property
    def decode_context(self) -> int:
        """Tokens the decodes attend to, their own included (``prior + 1`` each, summed), tokens."""
        return sum(s.prior + 1 for s in self.slices if s.is_decode)

    @property
    def compiled_decode(self) -> bool:
        """Whether the step is decodes only (one token each) on a compiled path, not ``eager``: the
        steps ``LinearStepModel.stack_base`` describes."""
        return not self.eager and all(s.is_decode and s.chunk == 1 for s in self.slices)

    @property
    def eager(self) -> bool:
        """Whether the step leaves the compiled small-row paths: more than ``SMALL_STEP_ROWS`` padded
        rows, unless it is decodes only within ``stack_rows``."""
        if self.padded_tokens <= SMALL_STEP_ROWS:
            return False
        decode_only = all(s.is_decode and s.chunk == 1 for s in self.slices)
        return not (decode_only and self.padded_tokens <= self.stack_rows)

    def features(self) -> tuple[float, ...]:
        """The ``FEATURES`` vector: (1, padded rows, sampled rows, requests, prefill q-k pairs,
        decode context tokens, gathered KV tokens, 1 if the step is ``eager``)."""
        attn = sum(s.chunk * (s.prior + (s.chunk + 1) / 2) for s in self.slices if not s.is_decode)
        ctx = self.decode_context
        sampled = sum(1 for s in self.slices if s.samples)
        return (
            1.0, float(self.padded_tokens), float(sampled), float(len(self.slices)), attn, float(ctx),
            float(self.gathered_tokens), float(self.eager),
        )


class StepTimeModel(Protocol):
    """Anything that predicts a step's duration and describes itself as JSON."""

    def predict(self, comp: StepComposition) -> float: ...

    def to_dict(self) -> dict: ...


@dataclass(frozen=True)
class ModelShape:
    """Shape of the served model, enough for KV sizing and roofline FLOPs.

    Attributes:
        name: for reports.
        num_params: parameters (embedding included when tied), count.
        num_layers, num_heads, num_kv_heads, head_dim: transformer geometry.
        dtype_bytes: bytes per weight and KV element (4 float32, 2 bfloat16).
    """

    name: str = "SmolLM2-135M-Instruct"
    num_params: float = 134.5e6
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    dtype_bytes: int = 4

    def __post_init__(self) -> None:
        for name in ("num_params", "num_layers", "num_heads", "num_kv_heads", "head_dim", "dtype_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model {name} must be > 0, got {getattr(self, name)}")

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers: ``2 * L * Hkv * D * bytes``."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


def _seconds_ok(value) -> bool:
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    return numeric and math.isfinite(value) and value >= 0


@dataclass(frozen=True)
class LinearStepModel:
    """``duration = sum(coef[f] * feature[f])`` over ``FEATURES`` (seconds).

    Attributes:
        coefficients: feature name -> seconds per unit (missing names count as 0).
        model: the model the profile was measured with (KV sizing).
        source: where the numbers came from (free text for reports).
        decode_gathers: whether the measured engine's decodes gathered their KV (the eager segmented
            kernel) or read it in place (the compiled CPU kernels); the simulator counts
            ``gathered_kv`` the same way.
        decode_stack_rows: the measured engine's ``stack_rows`` (see ``StepComposition``); the
            simulator builds its compositions with it.
        stack_base: padded rows -> seconds of a ``compiled_decode`` step of that many rows before its
            context; such a step takes ``stack_base[rows] + stack_ctx * context tokens`` instead of
            the feature sum. On 2 cores a decode step's cost is not linear in its rows (2026-12-02,
            Zen 4, Q4_1 blocks: 1 and 2 rows ~13 ms, 4 rows ~20, 8 ~40, 64 ~230), which one
            per-row coefficient shared with prefill tokens cannot follow; padded row counts not in
            the table (and every profile without one) use the feature sum.
        stack_ctx: seconds per context token (prior + 1, summed over the rows) of such a step.
    """

    coefficients: dict[str, float]
    model: ModelShape = field(default_factory=ModelShape)
    source: str = ""
    decode_gathers: bool = True
    decode_stack_rows: int = SMALL_STEP_ROWS
    stack_base: dict[int, float] = field(default_factory=dict)
    stack_ctx: float = 0.0

    def __post_init__(self) -> None:
        unknown = set(self.coefficients) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown step-model features {sorted(unknown)}; known: {FEATURES}")
        for name, value in self.coefficients.items():
            # A negative or NaN coefficient would predict negative or NaN step durations downstream.
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"step-model coefficient {name}={value!r} must be a finite number >= 0")
        if not isinstance(self.decode_stack_rows, int) or self.decode_stack_rows < SMALL_STEP_ROWS:
            raise ValueError(
                f"decode_stack_rows={self.decode_stack_rows!r} must be an integer >= {SMALL_STEP_ROWS}"
            )
        top = self.decode_stack_rows
        for rows, seconds in self.stack_base.items():
            if not isinstance(rows, int) or isinstance(rows, bool) or not 1 <= rows <= top:
                raise ValueError(f"stack_base rows {rows!r} must be an integer in [1, {top}]")
            if not _seconds_ok(seconds):
                raise ValueError(f"stack_base[{rows}]={seconds!r} must be a finite number of seconds >= 0")
        if not _seconds_ok(self.stack_ctx):
            raise ValueError(f"stack_ctx={self.stack_ctx!r} must be a finite number >= 0")

    def predict(self, comp: StepComposition) -> float:
        base = self.stack_base.get(comp.padded_tokens) if self.stack_base and comp.compiled_decode else None
        if base is not None:
            return base + self.stack_ctx * comp.decode_context
        return sum(self.coefficients.get(n, 0.0) * x for n, x in zip(FEATURES, comp.features(), strict=True))

    def to_dict(self) -> dict:
        return {
            "kind": "linear",
            "coefficients": dict(self.coefficients),
            "model": asdict(self.model),
            "source": self.source,
            "decode_gathers": self.decode_gathers,
            "decode_stack_rows": self.decode_stack_rows,
            "stack_base": {str(rows): seconds for rows, seconds in sorted(self.stack_base.items())},
            "stack_ctx": self.stack_ctx,
        }


@dataclass(frozen=True)
class RooflineStepModel:
    """Analytic step time on hardware given by peak figures (seconds).

    Attributes:
        model: the served model.
        flops: achievable dense FLOP/s (peak times an efficiency, e.g. 0.5 * 989e12 for H100 bf16).
        bandwidth: achievable memory bandwidth, bytes/s.
        overhead: fixed per-step time (scheduling, launches), seconds.
        per_request: per scheduled request time (metadata), seconds.
        source: free text.
    """

    model: ModelShape
    flops: float
    bandwidth: float
    overhead: float = 2e-3
    per_request: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        if self.flops <= 0 or self.bandwidth <= 0:
            raise ValueError(f"flops and bandwidth must be > 0, got {self.flops}, {self.bandwidth}")
        if self.overhead < 0 or self.per_request < 0:
            raise ValueError(
                f"overhead and per_request must be >= 0, got {self.overhead}, {self.per_request}"
            )

    def predict(self, comp: StepComposition) -> float:
        m = self.model
        _, padded, _, nreq, attn_pairs, ctx, *_ = comp.features()
        # QK^T and PV: 2 matmuls x 2 FLOPs per multiply-add, per query head and layer.
        attn_flops = 4 * m.num_layers * m.num_heads * m.head_dim * (attn_pairs + ctx)
        compute = (2 * m.num_params * padded + attn_flops) / self.flops
        kv_read = sum(s.prior + s.chunk for s in comp.slices) * m.kv_bytes_per_token
        memory = (m.num_params * m.dtype_bytes + kv_read) / self.bandwidth
        return max(compute, memory) + self.overhead + self.per_request * nreq

    def to_dict(self) -> dict:
        return {
            "kind": "roofline",
            "model": asdict(self.model),
            "flops": self.flops,
            "bandwidth": self.bandwidth,
            "overhead": self.overhead,
            "per_request": self.per_request,
            "source": self.source,
        }


# Published dense bf16 peaks and HBM bandwidth (NVIDIA H100 SXM and H200 datasheets).
HARDWARE = {
    "h100": {"flops": 989e12, "bandwidth": 3.35e12},
    "h200": {"flops": 989e12, "bandwidth": 4.8e12},
    "a100": {"flops": 312e12, "bandwidth": 2.0e12},
}
# Llama-3.1-8B: 8.03 B parameters, 32 layers, 32 query heads, 8 KV heads, head_dim 128.
LLAMA_8B = ModelShape("Llama-3.1-8B", 8.03e9, 32, 32, 8, 128, 2)


def roofline_profile(
    hardware: str, model: ModelShape = LLAMA_8B, mfu: float = 0.5, mbu: float = 0.8, overhead: float = 2e-3
) -> RooflineStepModel:
    """A roofline model for a named GPU (``HARDWARE``) at the given compute/bandwidth utilisations.

    Raises:
        ValueError: unknown hardware name, or a utilisation outside (0, 1].
    """
    if hardware not in HARDWARE:
        raise ValueError(f"unknown hardware {hardware!r}; known: {sorted(HARDWARE)}")
    if not (0 < mfu <= 1 and 0 < mbu <= 1):
        raise ValueError(f"mfu and mbu must be in (0, 1], got {mfu}, {mbu}")
    hw = HARDWARE[hardware]
    return RooflineStepModel(
        model,
        hw["flops"] * mfu,
        hw["bandwidth"] * mbu,
        overhead,
        source=f"roofline {hardware} mfu={mfu} mbu={mbu}",
    )


def model_from_dict(data: dict) -> StepTimeModel:
    """Build a step model from its JSON form. Raises ValueError on an unknown ``kind``."""
    kind = data.get("kind")
    shape = ModelShape(**data["model"]) if "model" in data else ModelShape()
    if kind == "linear":
        return LinearStepModel(
            dict(data["coefficients"]), shape, data.get("source", ""), bool(data.get("decode_gathers", True)),
            int(data.get("decode_stack_rows", SMALL_STEP_ROWS)), _stack_base(data.get("stack_base", {})),
            data.get("stack_ctx", 0.0),
        )
    if kind == "roofline":
        return RooflineStepModel(
            shape,
            data["flops"],
            data["bandwidth"],
            data.get("overhead", 2e-3),
            data.get("per_request", 0.0),
            data.get("source", ""),
        )
    raise ValueError(f"profile kind must be 'linear' or 'roofline', got {kind!r}")


def _stack_base(data) -> dict[int, float]:
    """``stack_base`` from JSON (row counts are object keys, so strings there)."""
    if not isinstance(data, dict):
        raise ValueError(f"stack_base must be an object of row count -> seconds, got {data!r}")
    out = {}
    for key, seconds in data.items():
        if not str(key).isdigit():
            raise ValueError(f"stack_base row count {key!r} is not a positive integer")
        out[int(key)] = seconds
    return out


def load_profile(path: str | Path) -> StepTimeModel:
    """Read a JSON hardware profile (``segserve profile`` output, or hand-written roofline)."""
    with open(path, encoding="utf-8") as f:
        return model_from_dict(json.load(f))


def save_profile(model: StepTimeModel, path: str | Path, extra: dict | None = None) -> None:
    """Write ``model.to_dict()`` (plus ``extra`` keys, e.g. fit residuals) as JSON."""
    data = model.to_dict() | (extra or {})
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


# The machine DEFAULT_CPU_MODEL was measured on (named in the warning when it stands in for a profile
# of the machine at hand; README "Performance").
BUILTIN_MACHINE = (
    "AMD EPYC Zen 4, 2 cores / 2 threads, SmolLM2-135M-Instruct.Q4_1.gguf float32, kernels on, block 16, "
    "segment 512 (idle, 2026-11-30)"
)

# This engine on the 2-core CPU (float32, 2 threads, idle, compiled CPU kernels): the fit to a real
# replay of Azure-conv traffic, docs/profiles/cpu_2core_fp32_replay_compiled.json (which predicted a
# held-out slice within 10 % on throughput, medians and p99s, docs/simulator.md). Used when no profile
# is given; ``segserve profile`` measures the machine at hand. (The eager engine's replay fit, without
# the kernels, is docs/profiles/cpu_2core_fp32_replay.json.)
DEFAULT_CPU_MODEL = LinearStepModel(
    {
        "step": 1.67e-2,
        "padded_tokens": 1.27e-3,
        "sampled": 1.75e-3,
        "requests": 0.0,
        "prefill_attn": 9.1e-7,
        "decode_ctx": 2.0e-6,
        "gathered_kv": 4.65e-5,
    },
    source="built-in: docs/profiles/cpu_2core_fp32_replay_compiled.json (2-core CPU, float32)",
    decode_gathers=False,
)
