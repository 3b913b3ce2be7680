"""Llama-family decoder over a paged KV cache: Llama 2/3, SmolLM2, Mistral-style and Qwen2 (q/k/v bias).

One step runs the active tokens of every scheduled request as one flat batch of ``T`` rows (no batch
dimension, no padding between requests). Each layer projects Q/K/V, rotates Q/K by absolute position,
and hands them to the attention backend, which writes K/V into the layer's cache and attends to the
cached prefix plus causally within the step. Weights use Hugging Face's layout after two fusions done
by the loader: ``qkv_proj = cat(q_proj, k_proj, v_proj)`` and ``gate_up_proj = cat(gate_proj, up_proj)``.

Architecture facts (Touvron et al. 2023, "Llama 2"; HF ``modeling_llama``): pre-norm RMSNorm, rotary
position embedding in the rotate-half convention, grouped-query attention, SwiGLU MLP
``down(silu(gate(x)) * up(x))``, optionally tied input/output embeddings.

This file is the model in plain PyTorch ops. How a step runs on a given machine is the model runner's
choice (``segserve.worker.cpu_step``): it may pass an in-place rotary op to :meth:`LlamaForCausalLM.forward`,
or run the layers itself from the modules here (``layers``, their projections and norms, ``rope_at``,
``norm``, ``lm_head_weight``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from segserve.attention.backends import AttentionBackend
from segserve.attention.metadata import AttentionMetadata
from segserve.kernels.gguf_blocks import QuantWeight
from segserve.models.packed_linear import PackedLinear
from segserve.models.quant_linear import QuantEmbedding, QuantLinear, quantized_matmul

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

# ``rope_inplace(x, num_heads, head_dim, cos, sin)``: rotate the first ``num_heads`` heads of each row of
# ``x`` ``(T, W)`` in place, with ``cos``/``sin`` ``(T, D)`` float32 rows of ``rope_table`` rounded to
# ``x``'s dtype, as ``apply_rope`` would. The runner passes a compiled one; the model has none of its own.
RopeInplace = Callable[[torch.Tensor, int, int, torch.Tensor, torch.Tensor], None]


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


def step_activation_bytes_per_token(config: LlamaConfig, dtype: torch.dtype) -> int:
    """Bytes a step's activations take per batched token at their peak within a layer (an estimate
    for ``malloc.prefault``): the residual stream and its norm, the fused QKV output, the attention
    output and the o projection (``8 H``), Q, K and V twice (``2 (Hq + 2 Hkv) D``) and the gate|up
    output with its SiLU product (``3 I``), in ``dtype``. SmolLM2-135M in bfloat16: 22,272 bytes, where
    the first 4,096-token steps of a process faulted in ~21,000 pages (~86 MB, 21 KB a token)."""
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    return (8 * config.hidden_size + 2 * qkv + 3 * config.intermediate_size) * dtype.itemsize


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
        metadata: AttentionMetadata, rope_inplace: RopeInplace | None = None,
    ) -> torch.Tensor:
        """``x`` ``(T, H)`` -> ``(T, H)``; the rest as :meth:`attend` takes them."""
        return self.o_proj(self.attend(self.qkv_proj(x), cos, sin, kv_cache, metadata, rope_inplace))

    def attend(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
        metadata: AttentionMetadata, rope_inplace: RopeInplace | None = None,
    ) -> torch.Tensor:
        """Fused projections ``qkv`` ``(T, (Hq + 2 Hkv) D)`` -> attention output ``(T, Hq D)``.

        ``cos``/``sin`` are rows of ``rope_table`` as :meth:`LlamaForCausalLM.rope_at` gives them:
        ``(T, D)`` float32 for ``rope_inplace`` (which rotates ``qkv`` in place, see ``RopeInplace``),
        else ``(T, 1, D)`` in the activation dtype for ``apply_rope``.
        """
        t = qkv.shape[0]
        hq, hkv = self.num_heads, self.num_kv_heads
        # Q and K heads are adjacent in the fused output, so one rotation covers both.
        if rope_inplace is not None:
            rope_inplace(qkv, hq + hkv, self.head_dim, cos, sin)
            return self.attend_rotated(qkv, kv_cache, metadata, kv_written=False)
        qkv = qkv.view(t, hq + 2 * hkv, self.head_dim)  # (T, Hq + 2 Hkv, D)
        q, k = apply_rope(qkv[:, : hq + hkv], cos, sin).split((hq, hkv), dim=1)  # (T, Hq|Hkv, D)
        v = qkv[:, hq + hkv :]  # (T, Hkv, D)
        out = self.attn_backend.forward(q, k, v, kv_cache, metadata, self.scale)  # (T, Hq, D)
        return out.reshape(t, hq * self.head_dim)

    def attend_rotated(self, qkv: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                       kv_written: bool = True) -> torch.Tensor:
        """:meth:`attend` for ``qkv`` ``(T, (Hq + 2 Hkv) D)`` already rotated; ``kv_written``: its K/V rows
        are already in ``kv_cache`` at ``metadata.slot_mapping`` (the fused projection of ``amx.RopeKV``),
        else the backend writes them."""
        t, hq, hkv = qkv.shape[0], self.num_heads, self.num_kv_heads
        q, k, v = qkv.view(t, hq + 2 * hkv, self.head_dim).split((hq, hkv, hkv), dim=1)
        out = self.attn_backend.forward(q, k, v, kv_cache, metadata, self.scale, kv_written=kv_written)
        return out.reshape(t, hq * self.head_dim)  # (T, Hq D)


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
        metadata: AttentionMetadata, rope_inplace: RopeInplace | None = None,
    ) -> torch.Tensor:
        """``h`` ``(T, H)``, the step's own residual stream (never a view of a weight), updated in place
        and returned; ``cos``/``sin`` and ``rope_inplace`` as :meth:`LlamaAttention.attend` takes them."""
        h.add_(self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, metadata, rope_inplace))
        return h.add_(self.mlp(self.post_attention_layernorm(h)))


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

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata, rope_inplace: RopeInplace | None = None,
    ) -> torch.Tensor:
        """Run the active tokens through every layer.

        Args:
            input_ids: ``(T,)`` int64 token ids (T may include padding rows).
            positions: ``(T,)`` int64 absolute positions, each ``< max_position_embeddings``.
            kv_caches: one tensor per layer, in the backend's layout.
            metadata: the step's attention metadata.
            rope_inplace: rotates Q/K inside each layer's fused projection output (see ``RopeInplace``);
                None rotates out of place with ``apply_rope``.

        Returns:
            ``(T, H)`` hidden states after the final norm.

        Raises:
            ValueError: when ``len(kv_caches)`` is not the number of layers.
        """
        self.check_kv_caches(kv_caches)
        h = self.embed_tokens(input_ids)  # (T, H)
        # Shared by all layers: (T, D) float32 for rope_inplace, else (T, 1, D) in h's dtype.
        cos, sin = self.rope_at(positions, None if rope_inplace is not None else h.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h = layer(h, cos, sin, kv_cache, metadata, rope_inplace)
        return self.norm(h)

    def check_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Raises ValueError unless there is one KV cache per layer."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The ``(vocab, H)`` output matrix: the embedding's when the checkpoint ties them (for a head
        kept in a GGUF block format, see :attr:`quantized_lm_head`; this then raises AttributeError)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def quantized_lm_head(self) -> QuantWeight | None:
        """The output matrix's blocks when it is kept quantized (``QuantLinear`` / ``QuantEmbedding``),
        else None."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return head.quant_weight if isinstance(head, (QuantLinear, QuantEmbedding)) else None

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype of the hidden states (the final norm's weight's: quantized layers have no float
        weight to ask)."""
        return self.norm.weight.dtype

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(N, H)`` hidden states -> ``(N, vocab)`` float32 logits (matmul in the weight dtype)."""
        quantized = self.quantized_lm_head
        if quantized is not None:
            return quantized_matmul(hidden, quantized, out_dtype=torch.float32)
        return F.linear(hidden, self.lm_head_weight).float()

    def rope_at(
        self, positions: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the RoPE table at ``positions`` ``(T,)``: ``(cos, signed_sin)``, each ``(T, D)``
        float32 when ``dtype`` is None (for a ``RopeInplace``, which rounds them itself), else
        ``(T, 1, D)`` in ``dtype`` (for ``apply_rope``)."""
        if self._rope is None or self._rope[0].device != positions.device:
            self._rope = rope_table(self.config, positions.device)
        cos, sin = self._rope
        if dtype is None:
            return cos[positions], sin[positions]
        return cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype)
