"""Turns the scheduler's per-step token outputs into ``RequestOutput``s: detokenization, stop strings,
logprobs, ``n > 1`` fan-in and per-request timing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from segserve.core.scheduler import EngineCoreOutput
from segserve.engine.detokenizer import IncrementalDetokenizer
from segserve.outputs import CompletionOutput, Logprob, Logprobs, RequestMetrics, RequestOutput
from segserve.sampling_params import SamplingParams


def child_request_id(request_id: str, index: int, n: int) -> str:
    """The scheduler-level id of completion ``index`` (vLLM's ``"{index}_{request_id}"`` for n > 1)."""
    return request_id if n == 1 else f"{index}_{request_id}"


@dataclass
class _Completion:
    index: int
    detokenizer: IncrementalDetokenizer
    want_logprobs: bool
    # Keep the text of a stop token id (or EOS) that ends the completion (vLLM's include_stop_str_in_output
    # covers both stop strings and stop tokens).
    keep_stop_token_text: bool = False
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.released_text,  # never a possible stop string's start
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob if self.want_logprobs else None,
            logprobs=list(self.logprobs) if self.want_logprobs else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass
class RequestState:
    """Everything the engine tracks for one user request across its ``n`` completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[_Completion]
    metrics: RequestMetrics
    prompt_logprobs: list[Logprobs | None] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            outputs=[c.to_output() for c in self.completions],
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
        )


class OutputProcessor:
    """Holds the ``RequestState`` of every unfinished request, keyed by child id."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.child_to_parent: dict[str, tuple[str, int]] = {}

    def add(self, state: RequestState, child_ids: list[str]) -> None:
        self.states[state.request_id] = state
        for index, cid in enumerate(child_ids):
            self.child_to_parent[cid] = (state.request_id, index)

    def make_state(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival: float,
    ) -> RequestState:
        completions = [
            _Completion(
                index=i,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop_strings,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                    min_tokens=params.min_tokens,
                ),
                want_logprobs=params.logprobs is not None,
                keep_stop_token_text=params.include_stop_str_in_output,
            )
            for i in range(params.n)
        ]
        return RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_ids,
            params=params,
            completions=completions,
            metrics=RequestMetrics(arrival_time=arrival),
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
        )

    def record_scheduled(self, child_id: str, had_prompt_tokens: bool, now: float) -> None:
        """Note that a step scheduled this completion (timing and prefill-step count)."""
        parent = self.child_to_parent.get(child_id)
        if parent is None:
            return
        state, index = self.states[parent[0]], parent[1]
        if state.metrics.first_scheduled_time is None:
            state.metrics.first_scheduled_time = now
        if had_prompt_tokens and index == 0:
            state.metrics.num_prefill_steps += 1

    def process(
        self, core_outputs: list[EngineCoreOutput], now: float | None = None
    ) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's outputs. Returns (outputs of touched requests, child ids that hit a stop
        string and must be finished in the scheduler).
        """
        now = time.monotonic() if now is None else now
        touched: dict[str, RequestState] = {}
        stop_hits: list[str] = []
        for out in core_outputs:
            parent = self.child_to_parent.get(out.req_id)
            if parent is None:
                continue
            state = self.states[parent[0]]
            completion = state.completions[parent[1]]
            state.num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs and state.prompt_logprobs is not None and parent[1] == 0:
                state.prompt_logprobs.extend(self._position(entries) for entries in out.prompt_logprobs)
            if out.new_token_ids:
                self._append_tokens(state, completion, out, now)
                if completion.detokenizer.stop_string_hit is not None and completion.finish_reason is None:
                    completion.finish_reason = "stop"
                    completion.stop_reason = completion.detokenizer.stop_string_hit
                    stop_hits.append(out.req_id)
            if out.finish_reason is not None and completion.finish_reason is None:
                completion.finish_reason = out.finish_reason
                completion.stop_reason = out.stop_reason
                completion.detokenizer.flush()
            touched[state.request_id] = state
        results = []
        for state in touched.values():
            if state.finished:
                state.metrics.finished_time = now
                self._drop(state)
            results.append(state.to_output())
        return results, stop_hits

    def _append_tokens(self, state: RequestState, completion: _Completion, out: EngineCoreOutput, now: float):
        completion.token_ids.extend(out.new_token_ids)
        text_ids = out.new_token_ids
        if out.finish_reason == "stop" and not completion.keep_stop_token_text:
            # The scheduler stops on token ids (EOS, stop_token_ids): vLLM's detokenizer leaves the last
            # one out of the text ("stop_terminated"); the token stays in token_ids.
            text_ids = text_ids[:-1]
        completion.detokenizer.update(text_ids)
        if completion.want_logprobs and out.logprobs:
            for entries in out.logprobs:
                completion.logprobs.append(self._position(entries))
                completion.cumulative_logprob += entries[0][1]
        if completion.index == 0:
            metrics = state.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                metrics.num_decode_tokens += len(out.new_token_ids) - 1
            else:
                metrics.num_decode_tokens += len(out.new_token_ids)
            metrics.last_token_time = now

    def _position(self, entries: list[tuple[int, float, int]]) -> Logprobs:
        """One position's (id, logprob, rank) entries as {id: Logprob}, the chosen token first."""
        return {t: Logprob(lp, rank, self.tokenizer.decode([t])) for t, lp, rank in entries}

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns the child ids to abort in the scheduler."""
        state = self.states.get(request_id)
        if state is None:
            return []
        n = len(state.completions)
        children = [child_request_id(request_id, i, n) for i in range(n)]
        self._drop(state)
        return children

    def _drop(self, state: RequestState) -> None:
        n = len(state.completions)
        for i in range(n):
            self.child_to_parent.pop(child_request_id(state.request_id, i, n), None)
        self.states.pop(state.request_id, None)
