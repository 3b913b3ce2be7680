"""The scheduler's decision for one step: the typed boundary between ``core`` and the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from segserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen (first schedule, or resumed after preemption).

    Attributes:
        req_id: request id.
        prompt_token_ids: the prompt, token ids.
        output_token_ids: tokens generated before a preemption (empty for a fresh request); their
            KV is recomputed like prompt tokens.
        sampling_params: how to sample.
        block_ids: the request's whole block-table row so far (prefix hits first, then new blocks).
        num_computed_tokens: tokens in its KV cache before this step (its prior): the prefix-cache
            hits claimed when it was admitted, block-aligned (0 without a hit).
    """

    req_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    block_ids: tuple[int, ...]
    num_computed_tokens: int


@dataclass(frozen=True)
class CachedRequestData:
    """A request the runner already holds, continuing a prefill or decoding.

    Attributes:
        req_id: request id.
        new_token_ids: tokens appended since the runner last saw the request (the token sampled
            last step), to be fed as input now.
        new_block_ids: block ids appended to its block-table row this step (append-only).
        num_computed_tokens: tokens in its KV cache before this step (its prior).
    """

    req_id: str
    new_token_ids: tuple[int, ...]
    new_block_ids: tuple[int, ...]
    num_computed_tokens: int


@dataclass(frozen=True)
class SchedulerOutput:
    """What to compute in one step.

    Rows of the step's token batch are laid out request by request in the order of
    ``scheduled_cached_reqs`` then ``scheduled_new_reqs``; padding rows follow the last request.

    Attributes:
        scheduled_new_reqs: requests sent to the runner in full.
        scheduled_cached_reqs: requests the runner holds, with their deltas.
        num_scheduled_tokens: req_id -> active tokens computed this step.
        num_scheduled_tokens_padded: req_id -> rows it occupies in the padded batch: its active
            tokens, plus, for the last request, the step's padding up to the bucket (seed 000,
            "Scheduler Output"; with one request this is its count padded to the bucket).
        total_num_scheduled_tokens: sum of ``num_scheduled_tokens``.
        total_num_scheduled_tokens_padded: smallest bucket >= the total.
        preempted_req_ids: requests whose blocks were freed this step (runner drops their state).
        finished_req_ids: requests finished or aborted since the last step (runner drops state).
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    num_scheduled_tokens_padded: dict[str, int]
    total_num_scheduled_tokens: int
    total_num_scheduled_tokens_padded: int
    preempted_req_ids: frozenset[str] = field(default_factory=frozenset)
    finished_req_ids: frozenset[str] = field(default_factory=frozenset)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    def num_prior_tokens(self) -> dict[str, int]:
        """req_id -> tokens in its KV cache before this step (the ``num_computed_tokens`` of its
        new or cached request data), in batch order. ``schedule()`` has already advanced the
        requests themselves, so this is where a reader of the step finds where each one started."""
        priors = {c.req_id: c.num_computed_tokens for c in self.scheduled_cached_reqs}
        priors.update((n.req_id, n.num_computed_tokens) for n in self.scheduled_new_reqs)
        return priors


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What the runner hands back after a step.

    Attributes:
        sampled_token_ids: req_id -> tokens sampled this step (one, or none for a partial prefill).
        logprobs: req_id -> per sampled token, a list of (token_id, logprob, rank): the sampled token
            first, then the top-k (``SamplingParams.logprobs``). Absent when not requested.
        prompt_logprobs: req_id -> for the prompt positions computed this step, the same pairs for
            the actual next prompt token then the top-k. Absent when not requested.
    """

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[list[tuple[int, float, int]]]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[list[tuple[int, float, int]]]] = field(default_factory=dict)
