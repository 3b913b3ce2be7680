"""A request's token-level state as the scheduler sees it."""

from __future__ import annotations

import enum
import time

from segserve.core.kv_cache_utils import BlockHash
from segserve.sampling_params import SamplingParams


def is_decode(num_computed_tokens: int, num_prompt_tokens: int, num_tokens: int) -> bool:
    """segserve's one definition of a decode: the request's only token left to compute is past its
    prompt, so its step is a query of length 1 that samples the next token.

    Used by the scheduler (decodes first; never refused for attention cost) and the simulator (a
    decode slice). A prompt chunk, and a resumed request recomputing its outputs (past its prompt but
    several tokens short), are not decodes. The segmented attention kernel runs every 1-token query
    on its decode path, decodes and 1-token chunks alike: for attention the two are the same.

    Args:
        num_computed_tokens: tokens in the KV cache before the step (the prior), tokens.
        num_prompt_tokens: prompt length, tokens.
        num_tokens: prompt plus generated tokens, tokens.
    """
    return num_prompt_tokens <= num_computed_tokens == num_tokens - 1


class RequestStatus(enum.Enum):
    """Lifecycle of a request; the ``FINISHED_*`` members carry its finish reason."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH_CAPPED = "length"
    FINISHED_ABORTED = "abort"
    # vLLM's FINISHED_ERROR: the request cannot go on (its output constraint admits no next token).
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        """vLLM's ``finish_reason`` (``"stop"``, ``"length"``, ``"abort"``, ``"error"``) or ``None``."""
        return self.value if self.is_finished else None


class Request:
    """One sequence being generated.

    ``num_computed_tokens`` counts the tokens whose KV is in the cache (prefix-cache hits included);
    it catches up with ``num_tokens`` under the per-step budget. The token due next is sampled when a
    step brings ``num_computed_tokens`` to ``num_tokens``; a partial prefill chunk samples nothing.

    Attributes:
        prompt_token_ids: the prompt, token ids.
        output_token_ids: generated token ids so far.
        num_cached_tokens: prompt tokens served from the prefix cache when first scheduled (tokens).
        block_hashes: chained hashes of the request's full blocks, in order (see ``kv_cache_utils``).
        cache_salt: extra key mixed into the first block's hash; requests with different salts never
            share cached blocks.
        num_preemptions: times this request was preempted (recomputed from scratch afterwards).
        num_prompt_logprobs_sent: prompt positions whose prompt-logprob entries went out (a preempted
            request recomputes its prompt; those positions are not sent again).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty (0 tokens); at least 1 is needed")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.status = RequestStatus.WAITING
        self.block_hashes: list[BlockHash] = []
        self.num_preemptions = 0
        self.num_prompt_logprobs_sent = 0
        self.stop_reason: int | str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_prefill(self) -> bool:
        """True while prompt tokens remain to be computed (seed 000, "Request State Tracking")."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_decode(self) -> bool:
        """True when its next step is a decode (see :func:`is_decode`); read before the step."""
        return is_decode(self.num_computed_tokens, self.num_prompt_tokens, self.num_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
