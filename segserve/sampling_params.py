"""Sampling parameters with vLLM's names, defaults and meanings (pure Python)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
MAX_N = 128
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to pick each next token of a request.

    Attributes (vLLM's defaults):
        n: completions per prompt (1..128).
        temperature: softmax temperature, >= 0; below 1e-5 means greedy.
        top_p: nucleus mass in (0, 1]; 1 disables.
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: drop tokens whose probability is below ``min_p`` x the top probability, in [0, 1].
        seed: per-request seed in [-2^63, 2^63 - 1]; the same seed gives the same tokens whatever the
            chunking, batching or prefix-cache state.
        max_tokens: most tokens to generate (>= 1); ``None`` means up to ``max_model_len``.
        min_tokens: EOS and stop token ids are ignored until this many tokens were generated.
        stop: strings that end generation; the matched string is left out of the text.
        stop_token_ids: token ids that end generation (the id is kept in ``token_ids``).
        ignore_eos: keep generating past EOS.
        logprobs: number of top logprobs to return per generated token (0..20), besides the sampled one.
        prompt_logprobs: number of top logprobs per prompt token (0..20).
        skip_special_tokens: leave special tokens out of the text.

    Raises:
        ValueError: naming the field and its allowed range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    stop_strings: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        for name in ("n", "top_k", "min_tokens", "max_tokens", "logprobs", "prompt_logprobs", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or (value is not None and not isinstance(value, int)):
                raise ValueError(f"{name} must be an int, got {value!r}")
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an int in [1, {MAX_N}], got {self.n!r}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or >= 1, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an int in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            # vLLM bounds seeds to a signed 64-bit int; wider ones would wrap onto other seeds.
            bits = self.seed.bit_length()
            shown = self.seed if bits <= 128 else f"an integer of {bits} bits"
            raise ValueError(f"seed must be in [-2^63, 2^63 - 1], got {shown}")
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        self.stop_strings = tuple(stop)
        ids = list(self.stop_token_ids or [])
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        self.stop_token_ids = ids
        if self.temperature < SAMPLING_EPS:
            # Greedy: the filters cannot change the argmax, so drop them (as vLLM does).
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax of the logits."""
        return self.temperature < SAMPLING_EPS
