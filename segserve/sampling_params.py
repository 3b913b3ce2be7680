"""Sampling parameters with vLLM's names, defaults and meanings (pure Python)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from segserve.structured_output.params import StructuredOutputsParams

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
MAX_N = 128
MAX_LOGPROBS = 20
# Every stop string is searched for after every token (~1 us each here, on the engine thread, so a step
# of every request waits): 64 cost ~85 us a token; 100,000 (a 1 MB request body) cost 0.1 s a token and
# slowed every other stream ~30x. vLLM sets no limit; OpenAI's API takes 4.
MAX_STOP_STRINGS = 64


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
        stop: strings that end generation (at most 64); the matched string is left out of the text.
        stop_token_ids: token ids that end generation (the id is kept in ``token_ids``).
        ignore_eos: keep generating past EOS.
        logprobs: number of top logprobs to return per generated token (0..20), besides the sampled one.
        prompt_logprobs: number of top logprobs per prompt token (0..20).
        presence_penalty: subtracted from the logit of every token already generated, in [-2, 2].
        frequency_penalty: subtracted once per earlier occurrence in the generated tokens, in [-2, 2].
        repetition_penalty: tokens seen in the prompt or the output have positive logits divided by it
            and negative ones multiplied by it (CTRL, Keskar et al. 2019), in (0, 2]; 1 disables.
        logit_bias: token id -> value added to its logit; values are clamped to [-100, 100] (vLLM).
        allowed_token_ids: when given, every other token is banned (non-empty).
        bad_words: words never generated: a word of one token is banned outright, the last token of a
            longer one is banned when the output ends with the rest (vLLM's rule).
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        skip_special_tokens: leave special tokens out of the text.
        spaces_between_special_tokens: with special tokens kept in the text, ``True`` (vLLM's default)
            decodes as the tokenizer does; ``False`` writes added tokens as their exact content with no
            space around them (Hugging Face slow tokenizers' meaning of the flag).
        structured_outputs: constrain the output to a JSON schema, regex, choice or grammar
            (``StructuredOutputsParams``); each of ``n`` completions follows it.

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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine from ``bad_words`` with its tokenizer (vLLM's ``_bad_words_token_ids``).
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    stop_strings: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        for name in ("n", "top_k", "min_tokens", "max_tokens", "logprobs", "prompt_logprobs", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or (value is not None and not isinstance(value, int)):
                raise ValueError(f"{name} must be an int, got {value!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
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
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop holds {len(stop)} strings, more than the limit of {MAX_STOP_STRINGS}")
        self.stop_strings = tuple(stop)
        ids = list(self.stop_token_ids or [])
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        self.stop_token_ids = ids
        self._check_logits_fields()
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}")
        if self.temperature < SAMPLING_EPS:
            # Greedy: the filters cannot change the argmax, so drop them (as vLLM does).
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _check_logits_fields(self) -> None:
        """Penalties, bias and token filters (vLLM 0.32's ranges); ids are checked against the
        vocabulary by the engine, which knows it."""
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            self.logit_bias = {_token_id("logit_bias", k): _bias(k, v) for k, v in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids:
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {ids!r}")
            self.allowed_token_ids = [_token_id("allowed_token_ids", t) for t in ids]
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, (list, tuple)) or any(not isinstance(w, str) or not w for w in words):
                raise ValueError(f"bad_words must be a list of non-empty strings, got {words!r}")
            self.bad_words = list(words)
        for name in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def needs_logits_processing(self) -> bool:
        """True when any penalty, bias or token filter changes this request's logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.allowed_token_ids is not None or self.bad_words)

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax of the logits."""
        return self.temperature < SAMPLING_EPS


def _token_id(field_name: str, value: object) -> int:
    """A token id given as an int or a decimal string (JSON object keys are strings)."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{field_name} token id must be a non-negative int, got {value!r}")
    return value


def _bias(key: object, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"logit_bias value for token {key!r} must be a finite number, got {value!r}")
    return min(100.0, max(-100.0, float(value)))
