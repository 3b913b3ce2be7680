"""What ``LLM.generate`` and ``LLMEngine.step`` return, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


class Logprob(float):
    """One token's logprob, shaped like vLLM's ``Logprob`` (``.logprob``, ``.rank``,
    ``.decoded_token``) while staying the float it is, so ``lps[tok]`` still reads as a number.

    Args:
        logprob: natural-log probability under the model's raw logits.
        rank: how many tokens are at least as likely (1 = the most likely).
        decoded_token: the token's text alone.
    """

    rank: int | None
    decoded_token: str | None

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        obj = super().__new__(cls, logprob)
        obj.rank, obj.decoded_token = rank, decoded_token
        return obj

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


# One position's logprobs: token id -> Logprob, the chosen token first, then the top-k.
Logprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One completion of a request (``n`` of them per request).

    Attributes:
        index: completion index in [0, n).
        text: generated text so far (cumulative, stop string excluded).
        token_ids: generated token ids so far.
        cumulative_logprob: sum of the sampled tokens' logprobs when ``logprobs`` was requested.
        logprobs: per generated token, {token_id: Logprob} for the sampled token and the top-k.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"``, ``"error"`` (its output constraint admitted
            no next token: no output satisfies it) or None while running.
        stop_reason: the stop string or stop token id that ended it, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Per-request timing, seconds on ``time.monotonic``'s clock, and prefill step count.

    Attributes:
        arrival_time: when the request was added.
        first_scheduled_time: when its first chunk was scheduled.
        first_token_time: when its first output token was produced.
        last_token_time: when its latest output token was produced.
        finished_time: when it finished.
        num_prefill_steps: engine steps that computed part of its prompt.
        num_decode_tokens: output tokens after the first.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prefill_steps: int = 0
    num_decode_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Output tokens after the first, per second after the first (the first token is prefill's)."""
        if not self.num_decode_tokens or self.last_token_time is None or self.first_token_time is None:
            return None
        span = self.last_token_time - self.first_token_time
        return self.num_decode_tokens / span if span > 0 else None


@dataclass
class RequestOutput:
    """The state of one request after a step (or at the end of ``generate``).

    Attributes:
        request_id: the request's id.
        prompt: the prompt text (None when token ids were given).
        prompt_token_ids: the prompt's token ids.
        prompt_logprobs: per prompt position, {token_id: Logprob} (None for the first position), or
            None when not requested.
        outputs: the completions.
        finished: all completions finished.
        num_cached_tokens: prompt tokens served from the prefix cache.
        metrics: timing of the request.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[Logprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)
