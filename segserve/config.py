"""Engine configuration: frozen dataclasses of plain numbers, checked in ``__post_init__``.

Nothing here touches torch, a file or a model, so ``segserve.core`` can build and test a scheduler
from these alone.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace

SUPPORTED_KV_SEGMENT_SIZES = (512, 1024, 2048, 4096)
SCHEDULING_POLICIES = ("decode_first", "prefill_first")
# ``--quantization`` (vLLM's flag): None (a GGUF file's Q8_0/Q4_0/Q4_1 tensors run in their block form,
# other types dequantized), "gguf" (the same, refusing a checkpoint that is not GGUF), "none"
# (dequantize every tensor to the model dtype at load, as before issue 16).
QUANTIZATION_CHOICES = (None, "gguf", "none")


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints: the number of ``b``-sized blocks that hold ``a`` items."""
    return -(-a // b)


def default_token_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """Padding buckets for the active-token count of a step.

    Powers of two up to 32, then 48 and 64, then every count up to the budget: a step of more than 64
    rows is not padded. Padded rows are computed like real ones on the CPU (nothing is compiled per
    shape there), so every bucket edge above 64 only wastes work: multiples of 32 there (2026-12-03 to
    -05) cost a step of random length ~6 % (a 129-383-token prompt prefilled in 76.1 vs 81.0 ms on
    average, interleaved in one process, Zen 5, docs/perf.md "Twenty-second session"; multiples of 256
    before them cost a 300-token prefill 25 %). Decode-only steps keep few distinct row counts up to 64
    for the step-time profile's per-row-count intercepts (``simulator.fit``).
    """
    buckets = [1]
    while buckets[-1] < min(32, max_num_batched_tokens):
        buckets.append(buckets[-1] * 2)
    while buckets[-1] < min(64, max_num_batched_tokens):
        buckets.append(buckets[-1] + 16)
    buckets.extend(range(buckets[-1] + 1, max_num_batched_tokens + 1))
    return tuple(buckets)


def default_padded_tokens(num_tokens: int) -> int:
    """The rows a step of ``num_tokens`` >= 1 active tokens runs under the default buckets (whatever the
    budget, once it holds them): ``default_token_buckets(num_tokens)[-1]`` without building the tuple,
    which the automatic budget's search asks once per candidate budget."""
    if num_tokens > 64:
        return num_tokens
    if num_tokens > 32:
        return 48 if num_tokens <= 48 else 64
    return 1 << (num_tokens - 1).bit_length()


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache shape and prefix caching.

    Attributes:
        block_size: tokens per KV block.
        num_kv_blocks: blocks in the pool, including the null block 0 (never handed out). ``None``
            means: size the pool from ``kv_cache_memory_bytes`` once the model shape is known.
        kv_cache_memory_bytes: memory budget for the whole KV cache (all layers, K and V), bytes.
        enable_prefix_caching: reuse full blocks whose chained hash matches.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 2 * 1024**3
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not (1 <= self.block_size <= 4096) or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two in [1, 4096], got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(
                f"num_kv_blocks must be >= 2 (block 0 is the null block), got {self.num_kv_blocks}"
            )
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step budget and admission limits.

    Attributes:
        max_num_batched_tokens: hard cap on tokens computed in one step (decodes + prefill chunks).
        max_num_seqs: cap on requests running at once.
        max_model_len: cap on prompt + generated tokens of one request.
        long_prefill_token_threshold: cap on one request's prefill chunk per step; 0 means no cap
            beyond the budget (vLLM's meaning).
        policy: ``"decode_first"`` (running requests, decodes included, are scheduled before waiting
            prefills: protects inter-token latency) or ``"prefill_first"`` (waiting prompts are
            admitted before running requests: protects time to first token). Seed 003.
        num_batched_tokens_buckets: sorted padding buckets for a step's active tokens; the largest
            must be >= ``max_num_batched_tokens``.
        max_num_partial_prefills: how many requests may be mid-prefill in one step.
        attention_cost_tokens: 0 (off) or K, turning on the attention-cost-weighted budget (seed 003:
            "a chunk late in a long prompt attends over a much longer cache"). A chunk of ``n`` tokens
            after ``p`` computed tokens is charged ``n + n * (p + n) / K`` token-equivalents: its
            linear work plus its attention over at most ``p + n`` keys, K being the context length
            at which one token's attention costs as much as its linear work (for SmolLM2 about
            3,000 by FLOPs: 2 x 106 M non-embedding weights vs 4 x 30 layers x 9 heads x 64 per
            key; less where attention runs below GEMM speed). Each step may spend
            ``max_num_batched_cost``; ``max_num_batched_tokens`` stays a hard cap. Decodes are
            charged but never refused; cost they spend holds prefills back, as tokens do.
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 8192
    long_prefill_token_threshold: int = 0
    policy: str = "decode_first"
    num_batched_tokens_buckets: tuple[int, ...] | None = None
    max_num_partial_prefills: int = 4
    attention_cost_tokens: int = 0

    def __post_init__(self) -> None:
        if self.attention_cost_tokens < 0:
            raise ValueError(
                f"attention_cost_tokens must be >= 0 (0 = token budget only), "
                f"got {self.attention_cost_tokens}"
            )
        if not isinstance(self.max_num_batched_tokens, int) or isinstance(self.max_num_batched_tokens, bool):
            raise ValueError(f"max_num_batched_tokens must be an int (auto is for `segserve serve`), got "
                             f"{self.max_num_batched_tokens!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0 (0 = no cap), got "
                f"{self.long_prefill_token_threshold}"
            )
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")
        if self.max_num_partial_prefills < 1:
            raise ValueError(f"max_num_partial_prefills must be >= 1, got {self.max_num_partial_prefills}")
        if self.num_batched_tokens_buckets is None:
            object.__setattr__(
                self, "num_batched_tokens_buckets", default_token_buckets(self.max_num_batched_tokens)
            )
        buckets = tuple(int(b) for b in self.num_batched_tokens_buckets)
        object.__setattr__(self, "num_batched_tokens_buckets", buckets)
        if not buckets or any(b < 1 for b in buckets):
            raise ValueError(f"num_batched_tokens_buckets must be non-empty positive ints, got {buckets}")
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"num_batched_tokens_buckets must be strictly increasing, got {buckets}")
        if buckets[-1] < self.max_num_batched_tokens:
            raise ValueError(
                f"largest num_batched_tokens_buckets entry {buckets[-1]} is below "
                f"max_num_batched_tokens={self.max_num_batched_tokens}"
            )

    @property
    def chunk_cap(self) -> int:
        """Most prompt tokens one request may compute in one step."""
        if self.long_prefill_token_threshold:
            return min(self.long_prefill_token_threshold, self.max_num_batched_tokens)
        return self.max_num_batched_tokens

    @property
    def max_num_batched_cost(self) -> float | None:
        """Per-step cost budget in token-equivalents, or None when cost weighting is off: the cost of a
        first chunk of the full token budget (``B + B * B / K``), so a prompt's first chunk is never
        cut and later chunks shrink as the cache they attend over grows."""
        if not self.attention_cost_tokens:
            return None
        b = self.max_num_batched_tokens
        return b + b * b / self.attention_cost_tokens

    def padded_num_tokens(self, num_tokens: int) -> int:
        """Smallest bucket >= ``num_tokens``. Raises ValueError when it exceeds the largest bucket."""
        buckets = self.num_batched_tokens_buckets
        i = bisect.bisect_left(buckets, num_tokens)
        if i == len(buckets):
            raise ValueError(f"{num_tokens} tokens exceed the largest bucket {buckets[-1]}")
        return buckets[i]


@dataclass(frozen=True)
class AttentionConfig:
    """Which attention backend runs and how it walks the cached KV.

    Attributes:
        backend: ``"segmented"`` (walks prior KV in ``kv_segment_size`` segments through the block
            table, online softmax) or ``"reference"`` (gathers all KV and masks; obviously correct).
        kv_segment_size: tokens per prior-KV segment; one of 512, 1024, 2048, 4096 and a multiple of
            the block size (seed 000, "Kernel Interface").
    """

    backend: str = "segmented"
    kv_segment_size: int = 512

    def __post_init__(self) -> None:
        if self.backend not in ("segmented", "reference"):
            raise ValueError(f"attention_backend must be 'segmented' or 'reference', got {self.backend!r}")
        if self.kv_segment_size not in SUPPORTED_KV_SEGMENT_SIZES:
            raise ValueError(
                f"kv_segment_size must be one of {SUPPORTED_KV_SEGMENT_SIZES}, got {self.kv_segment_size}"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the model weights."""

    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)

    def __post_init__(self) -> None:
        if self.attention.kv_segment_size % self.cache.block_size:
            raise ValueError(
                f"kv_segment_size={self.attention.kv_segment_size} must be a multiple of "
                f"block_size={self.cache.block_size}"
            )

    @property
    def max_blocks_per_seq(self) -> int:
        """Columns of a block-table row: ``cdiv(max_model_len, block_size)``."""
        return cdiv(self.scheduler.max_model_len, self.cache.block_size)


# ``max_model_len`` -1 (flag value ``auto``): the model's context length, lowered to what the KV cache
# holds (vLLM's -1 / "auto").
AUTO_MAX_MODEL_LEN = -1


def fit_max_model_len(config: EngineConfig, num_kv_blocks: int, auto: bool) -> EngineConfig:
    """``config``, checked against a KV pool of ``num_kv_blocks`` blocks (the null block included).

    A request of ``max_model_len`` tokens must fit the pool, else it could never run (a client that
    omits ``max_tokens`` asks for up to that many): vLLM refuses to start then
    (``check_enough_kv_cache_memory``), and with ``max_model_len`` -1 ("auto") lowers it to what the
    cache holds instead. The engine passes ``auto`` also when no length was given (the model's would
    not fit): vLLM refuses that case too, but a small pool given on purpose (``num_kv_blocks``) is then
    served with the length it can hold, logged, rather than refused.

    Returns:
        ``config`` itself when the pool holds ``max_model_len`` tokens; with ``auto``, a copy whose
        ``max_model_len`` is the pool's capacity, ``(num_kv_blocks - 1) * block_size`` tokens.

    Raises:
        ValueError: the pool holds fewer tokens than ``max_model_len`` (not ``auto``), or fewer than 2;
            naming both and the settings that would fit.
    """
    block_size, max_len = config.cache.block_size, config.scheduler.max_model_len
    capacity = (num_kv_blocks - 1) * block_size
    if capacity >= max_len:
        return config
    if auto and capacity >= 2:
        return replace(config, scheduler=replace(config.scheduler, max_model_len=capacity))
    raise ValueError(
        f"max_model_len={max_len} does not fit the KV cache, which holds {capacity} tokens "
        f"({num_kv_blocks - 1} blocks of {block_size}): a request of max_model_len tokens could never "
        f"run. Give a larger cache (num_kv_blocks >= {cdiv(max_len, block_size) + 1}, or more "
        f"kv_cache_memory), max_model_len <= {capacity}, or max_model_len -1 (auto: the largest that fits)"
    )


def num_kv_blocks_for(config: EngineConfig, kv_bytes_per_token: int) -> int:
    """Blocks in the KV pool, the null block 0 included: ``config.cache.num_kv_blocks`` when set,
    else as many blocks as fit ``kv_cache_memory_bytes``, capped at what ``max_num_seqs`` requests
    of ``max_model_len`` tokens can hold (``max_blocks_per_seq`` each; more could never be used),
    plus the null block.

    Args:
        config: the settled engine configuration (``max_model_len`` known).
        kv_bytes_per_token: K and V bytes one token occupies over all layers (``2 * L * Hkv * D *
            itemsize``), bytes.

    Raises:
        ValueError: when ``kv_cache_memory_bytes`` is below one block.
    """
    cache = config.cache
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    bytes_per_block = kv_bytes_per_token * cache.block_size
    fit = cache.kv_cache_memory_bytes // bytes_per_block
    if fit < 1:
        raise ValueError(
            f"kv_cache_memory_bytes={cache.kv_cache_memory_bytes} is below one block "
            f"({bytes_per_block} bytes)"
        )
    return min(fit, config.scheduler.max_num_seqs * config.max_blocks_per_seq) + 1
