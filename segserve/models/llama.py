"""Llama-family decoder over a paged KV cache: Llama 2/3, SmolLM2, Mistral-style and Qwen2 (q/k/v bias).

One step runs the active tokens of every scheduled request as one flat batch of ``T`` rows (no batch
dimension, no padding between requests). Each layer projects Q/K/V, rotates Q/K by absolute position,
and hands them to the attention backend, which writes K/V into the layer's cache and attends to the
cached prefix plus causally within the step. Weights use Hugging Face's layout after two fusions done
by the loader: ``qkv_proj = cat(q_proj, k_proj, v_proj)`` and ``gate_up_proj = cat(gate_proj, up_proj)``.

Architecture facts (Touvron et al. 2023, "Llama 2"; HF ``modeling_llama``): pre-norm RMSNorm, rotary
position embedding in the rotate-half convention, grouped-query attention, SwiGLU MLP
``down(silu(gate(x)) * up(x))``, optionally tied input/output embeddings.

With the compiled CPU kernels (``segserve.kernels.cpu``, float32/bfloat16 on an AVX-512 CPU) RoPE runs in
place in C for every step, and decode-sized steps (up to ``MAX_SMALL_ROWS`` rows) run each layer as four
compiled linears with the norms, the SiLU gate and the residual adds fused in, plus attention; larger
steps keep oneDNN's GEMMs, where the eager ops are a small share of the time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from segserve.attention.backends import AttentionBackend
from segserve.attention.metadata import AttentionMetadata
from segserve.kernels import cpu as cpu_kernels
from segserve.models.packed_linear import PackedLinear, pack_weight, packed_linear

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent RoPE stretch (``rope_type: "llama3"`` in a HF config).

    Wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are divided by
    ``factor``, shorter than ``.../high_freq_factor`` are kept, and the band between is interpolated
    (Meta's llama-models reference, ``apply_scaling``).
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.factor < 1.0:
            raise ValueError(f"llama3 rope factor must be >= 1, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"llama3 rope needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor}, {self.high_freq_factor}"
            )
        if self.original_max_position_embeddings < 1:
            raise ValueError(
                f"original_max_position_embeddings must be >= 1, got {self.original_max_position_embeddings}"
            )


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and numerics of a Llama-family checkpoint.

    Attributes:
        vocab_size: rows of the embedding and of the LM head.
        hidden_size: model width H.
        intermediate_size: SwiGLU inner width I.
        num_hidden_layers: decoder layers L.
        num_attention_heads: query heads Hq.
        num_key_value_heads: K/V heads Hkv (GQA); divides Hq.
        head_dim: D, per-head width (even, for RoPE's pairs).
        rms_norm_eps: epsilon inside RMSNorm's square root.
        rope_theta: RoPE base.
        max_position_embeddings: positions the RoPE table covers.
        tie_word_embeddings: LM head shares the embedding matrix.
        attention_bias: q/k/v projections have biases (Qwen2); o_proj never does.
        bos_token_id, eos_token_id: from the checkpoint; ``eos_token_id`` is the first when it lists many.
        rope_scaling: ``None`` (plain RoPE) or Llama 3.1 scaling.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    rope_scaling: Llama3RopeScaling | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embedding, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(
                f"rms_norm_eps and rope_theta must be > 0, got {self.rms_norm_eps}, {self.rope_theta}"
            )
        for name in ("bos_token_id", "eos_token_id"):
            tid = getattr(self, name)
            if tid is not None and not 0 <= tid < self.vocab_size:
                raise ValueError(f"{name}={tid} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def q_size(self) -> int:
        """Width of the query projection, ``Hq * D``."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (or value) projection, ``Hkv * D``."""
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> LlamaConfig:
        """Build from a Hugging Face ``config.json`` dict (``model_type`` llama, mistral or qwen2).

        Reads the RoPE base from ``rope_parameters`` (transformers 5) or ``rope_theta`` (4.x).

        Raises:
            ValueError: on an unsupported model type, activation, MLP bias, sliding window, partial
                rotary, or RoPE scaling type other than none/default/llama3.
        """
        model_type = hf.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        _reject_sliding_window(hf, model_type)
        rope_theta, rope_scaling = _rope_from_hf(hf)
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=rope_theta,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 configs carry no attention_bias key: its q/k/v projections always have biases.
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) and eos else (eos if isinstance(eos, int) else None),
            rope_scaling=rope_scaling,
        )


def _reject_sliding_window(hf: dict[str, Any], model_type: str) -> None:
    window = hf.get("sliding_window")
    enabled = hf.get("use_sliding_window", False) if model_type == "qwen2" else window is not None
    if enabled and window is not None and window < hf.get("max_position_embeddings", 2048):
        raise ValueError(f"sliding-window attention (window {window}) is not supported")


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """``(rope_theta, scaling)`` from either transformers 5's ``rope_parameters`` or 4.x keys."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embedding is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type == "llama3":
        return theta, Llama3RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: none, 'llama3')")


def kv_cache_bytes_per_token(config: LlamaConfig, dtype: torch.dtype) -> int:
    """Bytes of K and V one token occupies across all layers: ``2 * L * Hkv * D * itemsize``."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype.itemsize


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies ``theta ** (-2i / D)``, ``(D/2,)`` float32, with Llama 3.1 scaling if set.

    Computed the way HF's ``modeling_rope_utils`` does (int64 arange cast to float32) so the float32
    table matches it bit for bit.
    """
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    old_len = s.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / s.low_freq_factor, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= old_len / s.high_freq_factor) & (wavelen <= old_len / s.low_freq_factor)
    return torch.where(medium, smoothed, scaled)


def rope_table(config: LlamaConfig, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, signed_sin)``, each ``(max_position_embeddings, D)`` float32; row p is position p.

    The half-width frequencies are repeated (``cat(f, f)``) to pair with rotate-half, and the first
    half of ``sin`` is negated so ``apply_rope`` can use a plain roll (see there).
    """
    inv_freq = rope_inv_freq(config).to(device)
    pos = torch.arange(config.max_position_embeddings, device=device, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]  # (P, D/2)
    sin = freqs.sin()
    return torch.cat((freqs, freqs), dim=-1).cos(), torch.cat((-sin, sin), dim=-1)  # (P, D) each


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(T, H, D)`` by ``cos``/``signed_sin`` ``(T, 1, D)`` from ``rope_table``.

    HF's ``x * cos + cat(-x2, x1) * sin`` equals ``x * cos + roll(x, D/2) * cat(-sin, sin)`` bit for
    bit (a sign flip is exact); this form needs one op and one allocation fewer.
    """
    rotated = x.roll(x.shape[-1] // 2, dims=-1).mul_(signed_sin)  # (T, H, D)
    return (x * cos).add_(rotated)


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x**2) + eps)`` with the statistics in float32 (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as HF: normalize in float32, round to the activation dtype, then scale.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class LlamaAttention(nn.Module):
    """Fused QKV projection, RoPE on Q and K, backend attention, output projection."""

    def __init__(self, config: LlamaConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = PackedLinear(
            config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.attention_bias
        )
        self.o_proj = PackedLinear(config.q_size, config.hidden_size, bias=False)
        self.attn_backend = attn_backend

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
        metadata: AttentionMetadata, compiled: bool = False,
    ) -> torch.Tensor:
        """``x`` ``(T, H)`` -> ``(T, H)``; ``cos``/``sin`` as :meth:`attend` takes them."""
        return self.o_proj(self.attend(self.qkv_proj(x), cos, sin, kv_cache, metadata, compiled))

    def attend(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
        metadata: AttentionMetadata, compiled: bool,
    ) -> torch.Tensor:
        """Fused projections ``qkv`` ``(T, (Hq + 2 Hkv) D)`` -> attention output ``(T, Hq D)``.

        ``cos``/``sin`` are rows of ``rope_table``: ``(T, D)`` float32 with ``compiled`` (the C
        kernel rotates ``qkv`` in place), else ``(T, 1, D)`` in the activation dtype.
        """
        t = qkv.shape[0]
        hq, hkv = self.num_heads, self.num_kv_heads
        # Q and K heads are adjacent in the fused output, so one rotation covers both.
        if compiled:
            cpu_kernels.rope_(qkv, hq + hkv, self.head_dim, cos, sin)
            q, k, v = qkv.view(t, hq + 2 * hkv, self.head_dim).split((hq, hkv, hkv), dim=1)
        else:
            qkv = qkv.view(t, hq + 2 * hkv, self.head_dim)  # (T, Hq + 2 Hkv, D)
            q, k = apply_rope(qkv[:, : hq + hkv], cos, sin).split((hq, hkv), dim=1)  # (T, Hq|Hkv, D)
            v = qkv[:, hq + hkv :]  # (T, Hkv, D)
        out = self.attn_backend.forward(q, k, v, kv_cache, metadata, self.scale)  # (T, Hq, D)
        return out.reshape(t, hq * self.head_dim)


class LlamaMLP(nn.Module):
    """SwiGLU with a fused gate/up projection: ``down(silu(gate(x)) * up(x))`` (Shazeer 2020)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = PackedLinear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = PackedLinear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # (T, I) each
        return self.down_proj(F.silu(gate).mul_(up))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: ``h += attn(norm(h)); h += mlp(norm(h))``."""

    def __init__(self, config: LlamaConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, attn_backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
        metadata: AttentionMetadata, compiled: bool = False,
    ) -> torch.Tensor:
        """``h`` ``(T, H)``, the step's own residual stream (never a view of a weight), updated in place."""
        if compiled and h.shape[0] <= cpu_kernels.MAX_SMALL_ROWS[h.dtype]:
            return self._forward_small(h, cos, sin, kv_cache, metadata)
        h.add_(self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, metadata, compiled))
        return h.add_(self.mlp(self.post_attention_layernorm(h)))

    def _forward_small(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The same layer for a few rows, in compiled linears that stream each weight once with the
        norms, the SiLU gate and the residual adds fused in (``h`` contiguous)."""
        attn, mlp, ln1, ln2 = self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm
        qkv = cpu_kernels.linear(
            h, attn.qkv_proj.weight, attn.qkv_proj.bias, prologue="rmsnorm", norm_weight=ln1.weight,
            eps=ln1.eps,
        )  # (T, (Hq + 2 Hkv) D)
        out = attn.attend(qkv, cos, sin, kv_cache, metadata, True)  # (T, Hq D)
        cpu_kernels.linear(out, attn.o_proj.weight, residual=h)  # h += o_proj(out)
        gate_up = cpu_kernels.linear(
            h, mlp.gate_up_proj.weight, prologue="rmsnorm", norm_weight=ln2.weight, eps=ln2.eps
        )  # (T, 2 I)
        return cpu_kernels.linear(gate_up, mlp.down_proj.weight, prologue="silu_mul", residual=h)


class LlamaForCausalLM(nn.Module):
    """The decoder stack plus LM head; parameter names follow HF's with ``model.`` dropped and the
    q/k/v and gate/up projections fused (see ``segserve.models.loader``).

    Args:
        config: the checkpoint's shape.
        attn_backend: a ``segserve.attention.backends.AttentionBackend`` (writes K/V of the real
            rows into the layer's cache, then attends); shared by all layers.
    """

    def __init__(self, config: LlamaConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        # Uninitialised (the loader assigns every weight): Embedding's own normal_ init would cost
        # ~1 s of lazy imports on the meta device, where the loader builds the module.
        self.embed_tokens = nn.Embedding.from_pretrained(torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attn_backend) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else PackedLinear(
            config.hidden_size, config.vocab_size, bias=False
        )
        # Built on first use on the input's device: not a buffer, so the loader can build the module
        # on the meta device and ``.to(dtype)`` never rounds the float32 table.
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self._packed_lm_head: torch.Tensor | None = None
        self._kernel_fit: dict[torch.dtype, bool] = {}  # per dtype: do all weights fit the C kernels
        # The compiled decode step's pointers to every weight and cache, keyed on the caches.
        self._stack: cpu_kernels.DecodeStack | None = None
        self._stack_key: tuple | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Run the active tokens through every layer.

        Args:
            input_ids: ``(T,)`` int64 token ids (T may include padding rows).
            positions: ``(T,)`` int64 absolute positions, each ``< max_position_embeddings``.
            kv_caches: one tensor per layer, in the backend's layout.
            metadata: the step's attention metadata.

        Returns:
            ``(T, H)`` hidden states after the final norm.

        Raises:
            ValueError: when ``len(kv_caches)`` is not the number of layers.
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        h = self.embed_tokens(input_ids)  # (T, H)
        compiled = self._compiled_kernels_fit(h)
        cos, sin = self._rope_at(positions, h.dtype, compiled)  # shared by all layers
        stack = self._decode_stack(h, kv_caches, metadata) if compiled else None
        if stack is not None:  # a decode-only step: every layer in one compiled call
            stack.run(kv_caches, h, cos, sin, metadata.slot_mapping, metadata.block_table,
                      metadata.seq_lens.long(), metadata.kv_segment_size, self.layers[0].self_attn.scale)
            return self.norm(h)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h = layer(h, cos, sin, kv_cache, metadata, compiled)
        return self.norm(h)

    def _decode_stack(
        self, h: torch.Tensor, kv_caches: list[torch.Tensor], metadata: AttentionMetadata
    ) -> cpu_kernels.DecodeStack | None:
        """The compiled whole-step path when this step is decodes only (one row per request, few
        rows) over the segmented backend and caches it takes; else None. Built once per dtype and cache
        shape: it holds the weight tensors, so after replacing one (not editing it in place) call
        :meth:`prepack_weights` again, as for the packed copies."""
        if (
            h.shape[0] > cpu_kernels.MAX_SMALL_ROWS[h.dtype] or metadata.max_query_len != 1
            or metadata.num_actual_tokens != metadata.num_reqs
            or getattr(self.layers[0].self_attn.attn_backend, "name", None) != "segmented"
        ):
            return None
        key = (h.dtype, kv_caches[0].shape, len(kv_caches))
        if self._stack_key != key:
            self._stack_key = key
            self._stack = None
            c = self.config
            if all(cpu_kernels.supports_cache(kv, h.dtype, c.num_attention_heads) for kv in kv_caches):
                try:
                    self._stack = cpu_kernels.DecodeStack(
                        self.decode_stack_layers(kv_caches), c.num_attention_heads, c.num_key_value_heads,
                        c.head_dim, c.rms_norm_eps,
                    )
                except ValueError:  # a shape the whole-step kernel does not take: per-layer path
                    self._stack = None
        return self._stack

    def decode_stack_layers(self, kv_caches: list[torch.Tensor]) -> list[tuple]:
        """Per layer, the tensors ``cpu_kernels.DecodeStack`` reads, in its order: ``(ln1, qkv,
        qkv_bias or None, o, ln2, gate_up, down, kv_cache)``."""
        return [
            tuple(None if t is None else t.detach() for t in (
                ly.input_layernorm.weight, ly.self_attn.qkv_proj.weight, ly.self_attn.qkv_proj.bias,
                ly.self_attn.o_proj.weight, ly.post_attention_layernorm.weight, ly.mlp.gate_up_proj.weight,
                ly.mlp.down_proj.weight, kv,
            ))
            for ly, kv in zip(self.layers, kv_caches, strict=True)
        ]

    def _compiled_kernels_fit(self, h: torch.Tensor) -> bool:
        """Whether this step can use the compiled CPU kernels: switched on and built, CPU activations
        of a supported dtype, and weights of that dtype in shapes the kernels take."""
        if h.dtype not in cpu_kernels.MAX_SMALL_ROWS or h.device.type != "cpu" or not cpu_kernels.enabled():
            return False
        first = self.layers[0]
        if first.self_attn.qkv_proj.weight.dtype != h.dtype:
            return False
        return self._weights_fit_kernels(h.dtype)

    def _weights_fit_kernels(self, dtype: torch.dtype) -> bool:
        fits = self._kernel_fit.get(dtype)
        if fits is None:
            c = self.config
            weights = [m.weight for m in self.modules() if isinstance(m, PackedLinear)]
            fits = c.head_dim <= 1024 and all(
                cpu_kernels.supports_linear(w) and w.dtype == dtype for w in weights
            )
            self._kernel_fit[dtype] = fits
        return fits

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(N, H)`` hidden states -> ``(N, vocab)`` float32 logits (matmul in the weight dtype)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if (
            hidden.dtype == weight.dtype
            and hidden.shape[0] <= cpu_kernels.MAX_SMALL_ROWS.get(hidden.dtype, 0)
            and hidden.device.type == "cpu" and cpu_kernels.supports_linear(weight) and cpu_kernels.enabled()
        ):
            return cpu_kernels.linear(hidden.contiguous(), weight, out_dtype=torch.float32)
        packed = self._packed_lm_head
        if packed is not None and hidden.dtype == weight.dtype == packed.dtype:
            return packed_linear(hidden, packed, None).float()
        return F.linear(hidden, weight).float()

    def prepack_weights(self) -> int:
        """Pre-pack every projection and the LM head for oneDNN (float32 or bfloat16 on CPU; see
        ``segserve.models.packed_linear``). Idempotent; call again after changing weights.

        Costs one extra copy of the packed weights (the plain ones stay for ``state_dict``).
        Returns how many weights are packed (0 for other dtypes or devices, or without oneDNN).
        """
        linears = [m for m in self.modules() if isinstance(m, PackedLinear)]
        count = sum(m.pack() for m in linears)
        self._kernel_fit.clear()  # weights may have changed shape, dtype or layout
        self._stack_key = self._stack = None  # and the compiled decode step holds pointers to them
        if self.lm_head is None:  # tied: the LM head reads the embedding matrix
            self._packed_lm_head = pack_weight(self.embed_tokens.weight)
        else:
            self._packed_lm_head = self.lm_head._packed
        return count + (self.lm_head is None and self._packed_lm_head is not None)

    def _rope_at(
        self, positions: torch.Tensor, dtype: torch.dtype, compiled: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the RoPE table at ``positions``: ``(T, D)`` float32 for the compiled kernel (it
        rounds them itself), else ``(T, 1, D)`` in ``dtype``."""
        if self._rope is None or self._rope[0].device != positions.device:
            self._rope = rope_table(self.config, positions.device)
        cos, sin = self._rope
        if compiled:
            return cos[positions], sin[positions]
        return cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype)
