"""The scheduler: which requests compute how many tokens in the next step.

There is no prefill phase and no decode phase (vLLM v1's design): each request's
``num_computed_tokens`` catches up with its tokens under one ``max_num_batched_tokens`` budget per
step. A decode (``Request.is_decode``: one token left, past the prompt) costs one token; a prompt
is computed in chunks (seed 003, chunked prefill); with ``attention_cost_tokens`` set, chunks are
also charged their attention cost (see ``_Budget``). With the default ``decode_first`` policy,
running requests are served first (decodes, then continuing prefills) and waiting prompts top up the
budget; ``prefill_first`` admits waiting prompts first. A waiting prompt whose next uncached block a
running prompt is still computing waits for it rather than computing a shared prefix twice
(``_computing_elsewhere``).

As in vLLM v1, ``schedule()`` decides (admission, allocation, preemption), builds the
``SchedulerOutput`` from what it decided, then ``_update_after_schedule()`` advances the requests
(``num_computed_tokens``) and the bookkeeping of what the runner holds.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from segserve.config import EngineConfig, SchedulerConfig, cdiv
from segserve.core.kv_cache_manager import KVCacheBlocks, KVCacheManager, PrefixCacheStats
from segserve.core.kv_cache_utils import BlockHash
from segserve.core.request import Request, RequestStatus
from segserve.core.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from segserve.core.scheduler_stats import SchedulerStats


@dataclass(frozen=True)
class EngineCoreOutput:
    """What one step produced for one request.

    Attributes:
        req_id: request id.
        new_token_ids: tokens sampled this step (empty for a partial prefill chunk).
        finish_reason: ``"stop"``, ``"length"``, ``"abort"``, ``"error"`` or None while running.
        stop_reason: the stop token id that ended the request, if any.
        num_cached_tokens: prompt tokens served from the prefix cache.
        logprobs, prompt_logprobs: as in ``ModelRunnerOutput``, for this request.
    """

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    logprobs: list | None = None
    prompt_logprobs: list | None = None


@dataclass(frozen=True)
class _Scheduled:
    """One request's part of the step being decided.

    Attributes:
        request: the request; its ``num_computed_tokens`` is still the prior (tokens before the
            step) until ``_update_after_schedule``.
        num_new_tokens: tokens it computes this step (>= 1).
        new_blocks: blocks added to its block-table row this step (for a request admitted now,
            the prefix-hit blocks it claimed, then the newly allocated ones).
    """

    request: Request
    num_new_tokens: int
    new_blocks: KVCacheBlocks


class Scheduler:
    """Owns the waiting queue, the running list and the KV cache manager.

    Args:
        config: engine configuration (budget, limits, block size, prefix caching).
        num_kv_blocks: blocks in the KV pool, including the null block.
    """

    def __init__(self, config: EngineConfig, num_kv_blocks: int) -> None:
        self.config = config
        self.sched = config.scheduler
        self.block_size = config.cache.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks=num_kv_blocks,
            block_size=self.block_size,
            max_model_len=self.sched.max_model_len,
            enable_caching=config.cache.enable_prefix_caching,
        )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests the model runner holds state for; the rest are sent in full.
        self._in_runner: set[str] = set()
        self._finished_since_last_step: set[str] = set()
        # Tokens appended since the runner last saw each request (the last sampled token).
        self._pending_tokens: dict[str, list[int]] = {}
        # Totals since start, read through make_stats().
        self._num_preemptions = 0
        self._num_prompt_tokens_computed = 0
        self._num_steps = 0

    # ---- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError when it can never fit (the engine state is unchanged)."""
        self.check_request(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check_request(self, request: Request) -> None:
        """ValueError when ``add_request(request)`` would refuse it (id in use, too long for the model
        or the KV pool); changes nothing. The engine checks a request this way before it waits for
        something outside the scheduler (its grammar) and is added later."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens > self.sched.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens, more than "
                f"max_model_len={self.sched.max_model_len}"
            )
        # Alone, a request must fit the pool at its longest (the last sampled token needs no slot);
        # otherwise it would preempt itself forever once it outgrew the pool.
        usable = (self.kv_cache_manager.num_blocks - 1) * self.block_size
        max_tokens = request.sampling_params.max_tokens or self.sched.max_model_len
        longest = min(request.num_prompt_tokens + max_tokens, self.sched.max_model_len) - 1
        if max(longest, request.num_prompt_tokens) > usable:
            raise ValueError(
                f"request needs up to {max(longest, request.num_prompt_tokens)} tokens of KV cache (prompt "
                f"{request.num_prompt_tokens} + max_tokens {max_tokens}, capped by max_model_len) but the "
                f"cache holds at most {usable} ({self.kv_cache_manager.num_blocks - 1} blocks of "
                f"{self.block_size}); lower max_tokens or max_model_len, or give the cache more memory"
            )

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """End requests (abort, or a stop string found by the detokenizer); frees their blocks.

        Unknown or already finished ids are ignored. Returns the requests ended now.
        """
        assert status.is_finished
        ended = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)
            ended.append(request)
        return ended

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def make_stats(self) -> SchedulerStats:
        """A snapshot of the queues, KV usage and counters: the one way metrics, logs, benchmarks and
        the simulator read the scheduler's counters."""
        prefix = self.kv_cache_manager.stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_preemptions=self._num_preemptions,
            num_prompt_tokens_computed=self._num_prompt_tokens_computed,
            num_steps=self._num_steps,
            prefix_cache=PrefixCacheStats(prefix.requests, prefix.queries, prefix.hits),
        )

    # ---- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide the next step and return it; the scheduled requests' ``num_computed_tokens`` have
        advanced by their scheduled tokens when it returns (their priors are in the output).

        Admits, allocates and preempts (request status, queues and blocks change), builds the
        output from the decision, then ``_update_after_schedule`` advances the requests.
        """
        budget = _Budget.for_step(self.sched)
        preempted: list[Request] = []
        scheduled: list[_Scheduled] = []
        if self.sched.policy == "prefill_first":
            self._schedule_waiting(budget, scheduled)
            self._schedule_running(budget, scheduled, preempted)
        else:
            self._schedule_running(budget, scheduled, preempted)
            if not preempted:
                self._schedule_waiting(budget, scheduled)
        scheduler_output = self._make_output(scheduled, preempted)
        self._update_after_schedule(scheduler_output)
        return scheduler_output

    def _schedule_running(
        self, budget: _Budget, scheduled: list[_Scheduled], preempted: list[Request]
    ) -> None:
        already = {id(s.request) for s in scheduled}
        # Decodes first (one token each), then continuing prefills and recomputes, each group in
        # arrival order (the sort is stable). A request's decode-ness holds for the whole loop: its
        # state advances only after the step is decided (a preempted one is skipped below).
        order = [(r, r.is_decode) for r in self.running if id(r) not in already]
        order.sort(key=lambda entry: not entry[1])
        for request, is_decode in order:
            if request.status != RequestStatus.RUNNING or budget.left == 0:
                continue
            wanted = min(request.num_tokens - request.num_computed_tokens, self.sched.chunk_cap)
            num_new = budget.grant(wanted, request.num_computed_tokens, is_decode)
            if num_new == 0:
                continue
            new_blocks = self._allocate_or_preempt(request, num_new, budget, scheduled, preempted)
            if new_blocks is None:
                continue
            scheduled.append(_Scheduled(request, num_new, new_blocks))
            budget.charge(num_new, request.num_computed_tokens)

    def _allocate_or_preempt(
        self,
        request: Request,
        num_new: int,
        budget: _Budget,
        scheduled: list[_Scheduled],
        preempted: list[Request],
    ) -> KVCacheBlocks | None:
        """Allocate for a running request, preempting the newest running requests until it fits.

        Returns None when the request itself had to be preempted (nothing newer was left to free).
        """
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks
            victim = self.running[-1]
            for i, s in enumerate(scheduled):
                if s.request is victim:  # already scheduled this step: give its tokens back
                    del scheduled[i]
                    budget.refund(s.num_new_tokens, victim.num_computed_tokens)
                    break
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return None

    def _schedule_waiting(self, budget: _Budget, scheduled: list[_Scheduled]) -> None:
        num_partial = sum(
            1 for s in scheduled if s.request.num_computed_tokens + s.num_new_tokens < s.request.num_tokens
        )
        deferred: list[Request] = []
        pending: set[tuple[int, BlockHash]] = set()  # (index, key) of blocks found in flight this step
        while self.waiting and budget.left > 0 and len(self.running) < self.sched.max_num_seqs:
            request = self.waiting[0]
            # A prompt sharing a block already found in flight waits with no lookup of its own: a burst
            # behind one long prefix would otherwise look up every cached block of it for every
            # waiting prompt at every step.
            hashes = self.kv_cache_manager.hittable_hashes(request)
            wait = bool(pending) and self._shares_pending_block(hashes, pending)
            if not wait:
                hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
                in_flight = self._computing_elsewhere(hashes, num_hit)
                if in_flight is not None:
                    pending.add(in_flight)
                    wait = True
            if wait:
                deferred.append(self.waiting.popleft())
                if len(deferred) >= self.sched.max_num_seqs:
                    break  # a burst behind one prefix: look no further this step (O(max_num_seqs) work)
                continue
            remaining = request.num_tokens - num_hit
            # Admission is always cost-capped (is_decode=False), also where a prefix hit leaves a
            # resumed request one token (a decode by definition): kept so the cost budget admits
            # exactly what it admitted before decodes had one definition.
            num_new = budget.grant(min(remaining, self.sched.chunk_cap), num_hit)
            if num_new == 0:
                break
            if num_new < remaining and num_partial >= self.sched.max_num_partial_prefills:
                break
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new, num_hit, hit_blocks)
            if new_blocks is None:
                break
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            self.kv_cache_manager.record_lookup(request, num_hit)
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_hit
            claimed = KVCacheBlocks(hit_blocks.blocks + new_blocks.blocks)
            scheduled.append(_Scheduled(request, num_new, claimed))
            num_partial += num_new < remaining
            budget.charge(num_new, num_hit)
        self.waiting.extendleft(reversed(deferred))  # back in front, in their order

    @staticmethod
    def _shares_pending_block(hashes: list[BlockHash], pending: set[tuple[int, BlockHash]]) -> bool:
        """Whether a prompt whose hittable block keys are ``hashes`` (``KVCacheManager.hittable_hashes``)
        has one of the ``pending`` blocks (index, key), found in flight earlier in this step. The same
        chained key at the same index means the same tokens up to it, so its first uncached block is at
        most that one: it waits as the prompt that found it does (a block of it evicted since then only
        makes the wait one a lookup would have skipped; waiting is always safe)."""
        return any(index < len(hashes) and hashes[index] == key for index, key in pending)

    def _computing_elsewhere(self, hashes: list[BlockHash], num_hit: int) -> tuple[int, BlockHash] | None:
        """Whether the first block of a waiting prompt that the prefix cache does not hold (after
        ``num_hit`` hit tokens; ``hashes`` its hittable block keys, ``KVCacheManager.hittable_hashes``)
        is one a running request is still computing: the same chained hash at the same index (so the
        same tokens up to it), not yet computed there. The request then waits
        (stays in the queue, later ones may go) and finds that block cached a step or a few later,
        instead of computing the shared prefix a second time beside the first: a burst of prompts
        sharing a new system prompt or document computed it once per prompt otherwise. (vLLM 0.32
        registers a chunk's blocks when it schedules the chunk, so a second prompt there finds those
        and computes the rest of the prefix again.) The running request is scheduled every step its
        budget allows, or preempted back to the queue, which ends the wait. Returns that block's
        (index, key), or None when the request need not wait."""
        index = num_hit // self.block_size
        if index >= len(hashes):  # no lookup could hit it
            return None
        key = hashes[index]
        end = (index + 1) * self.block_size
        busy = any(
            len(other.block_hashes) > index and other.block_hashes[index] == key
            and other.num_computed_tokens < end
            for other in self.running
        )
        return (index, key) if busy else None

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks and put it at the front of the waiting queue (recompute later)."""
        self.running.remove(request)
        self._free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.appendleft(request)

    def _free(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self._pending_tokens.pop(request.request_id, None)
        if request.request_id in self._in_runner:
            self._in_runner.discard(request.request_id)
            self._finished_since_last_step.add(request.request_id)
        if request.is_finished:
            self.requests.pop(request.request_id, None)

    def _make_output(self, scheduled: list[_Scheduled], preempted: list[Request]) -> SchedulerOutput:
        """The step's output built from the decision; reads state, changes none (the requests'
        ``num_computed_tokens`` are still their priors, which the request data carries)."""
        new_reqs, cached_reqs, num_tokens = [], [], {}
        for s in scheduled:
            request = s.request
            rid = request.request_id
            num_tokens[rid] = s.num_new_tokens
            if rid in self._in_runner:
                cached_reqs.append(
                    CachedRequestData(
                        req_id=rid,
                        new_token_ids=tuple(self._pending_tokens.get(rid, ())),
                        new_block_ids=tuple(s.new_blocks.get_block_ids()),
                        num_computed_tokens=request.num_computed_tokens,
                    )
                )
            else:
                new_reqs.append(
                    NewRequestData(
                        req_id=rid,
                        prompt_token_ids=tuple(request.prompt_token_ids),
                        output_token_ids=tuple(request.output_token_ids),
                        sampling_params=request.sampling_params,
                        block_ids=tuple(self.kv_cache_manager.get_block_ids(rid)),
                        num_computed_tokens=request.num_computed_tokens,
                    )
                )
        total = sum(num_tokens.values())
        padded = self.sched.padded_num_tokens(total) if total else 0
        num_padded = dict(num_tokens)
        if scheduled:
            # Padding rows sit after the last request's rows in the batch (cached reqs come first).
            last = new_reqs[-1].req_id if new_reqs else cached_reqs[-1].req_id
            num_padded[last] += padded - total
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_tokens,
            num_scheduled_tokens_padded=num_padded,
            total_num_scheduled_tokens=total,
            total_num_scheduled_tokens_padded=padded,
            preempted_req_ids=frozenset(r.request_id for r in preempted),
            finished_req_ids=frozenset(self._finished_since_last_step),
        )

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Advance each scheduled request's ``num_computed_tokens`` by its scheduled tokens (vLLM v1's
        split: the runner computes them next, so the scheduler counts them now) and note what the
        runner will hold: the pending tokens it is sent, the requests it is sent in full, the
        finished ids it is told to drop. Also counts the step and its prompt tokens."""
        for rid, num_new in scheduler_output.num_scheduled_tokens.items():
            request = self.requests[rid]
            prior = request.num_computed_tokens  # the output's prior: nothing moved it since
            prompt_end = min(prior + num_new, request.num_prompt_tokens)
            self._num_prompt_tokens_computed += max(0, prompt_end - prior)
            request.num_computed_tokens = prior + num_new
            self._pending_tokens.pop(rid, None)
        self._in_runner.update(data.req_id for data in scheduler_output.scheduled_new_reqs)
        self._finished_since_last_step = set()
        self._num_steps += 1

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop rules, cache newly full blocks, free finished requests.

        Stop rules (in order): EOS (unless ``ignore_eos``) and ``stop_token_ids``, both only once
        ``min_tokens`` were generated; ``max_tokens``; ``max_model_len``. Stop strings are applied by
        the engine's detokenizer, which calls ``finish_requests``.
        """
        outputs = []
        for rid in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            new_tokens = runner_output.sampled_token_ids.get(rid, [])
            for token in new_tokens:
                request.append_output_token(token)
                self._pending_tokens.setdefault(rid, []).append(token)
                if self._check_stop(request, token):
                    break
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            prompt_logprobs = self._unsent_prompt_logprobs(
                request, runner_output.prompt_logprobs.get(rid), scheduler_output.num_scheduled_tokens[rid]
            )
            if new_tokens or request.is_finished:
                outputs.append(
                    EngineCoreOutput(
                        req_id=rid,
                        new_token_ids=list(new_tokens),
                        finish_reason=request.status.finish_reason,
                        stop_reason=request.stop_reason,
                        num_cached_tokens=request.num_cached_tokens,
                        logprobs=runner_output.logprobs.get(rid),
                        prompt_logprobs=prompt_logprobs,
                    )
                )
            elif prompt_logprobs is not None:
                outputs.append(
                    EngineCoreOutput(
                        req_id=rid,
                        new_token_ids=[],
                        num_cached_tokens=request.num_cached_tokens,
                        prompt_logprobs=prompt_logprobs,
                    )
                )
            if request.is_finished:
                self.running.remove(request)
                self._free(request)
        return outputs

    @staticmethod
    def _unsent_prompt_logprobs(request: Request, entries: list | None, num_scheduled: int) -> list | None:
        """The runner's prompt-logprob entries for this step's positions (``prior`` .. on, one per
        position) less those already sent: a preempted request recomputes its prompt from the start,
        and the positions before ``request.num_prompt_logprobs_sent`` went out before it was preempted
        (the recomputed values are the same). None when the runner sent none."""
        if entries is None:
            return None
        prior = request.num_computed_tokens - num_scheduled  # advanced when the step was scheduled
        skip = min(len(entries), max(0, request.num_prompt_logprobs_sent - prior))
        request.num_prompt_logprobs_sent = max(request.num_prompt_logprobs_sent, prior + len(entries))
        return entries[skip:]

    def _check_stop(self, request: Request, token: int) -> bool:
        params = request.sampling_params
        # The runner masks EOS and stop ids for the first min_tokens tokens; this is the same rule.
        may_stop = request.num_output_tokens > params.min_tokens
        if may_stop and not params.ignore_eos and token == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
        elif may_stop and token in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token
        elif params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        elif request.num_tokens >= self.sched.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return request.is_finished

    # ---- invariants ----------------------------------------------------------------------------

    def check_integrity(self, scheduler_output: SchedulerOutput | None = None) -> None:
        """Assert queue, request and cache invariants (raises AssertionError).

        Args:
            scheduler_output: the last ``schedule()``'s output, to check also that each of its
                requests still running has advanced by exactly its scheduled tokens from the prior
                the output carries.
        """
        self.kv_cache_manager.check_integrity()
        running = {r.request_id for r in self.running}
        waiting = {r.request_id for r in self.waiting}
        assert not running & waiting, f"requests both running and waiting: {running & waiting}"
        assert len(self.running) <= self.sched.max_num_seqs, "more running requests than max_num_seqs"
        assert running | waiting == set(self.requests), "request table out of sync with the queues"
        held = set(self.kv_cache_manager.req_to_blocks)
        assert held <= running, f"blocks held by requests that are not running: {held - running}"
        # What _update_after_schedule notes about the runner: it holds only running requests, has
        # pending tokens only for those, and is never told to drop a request it still holds.
        assert self._in_runner <= running, f"runner holds non-running {self._in_runner - running}"
        pending = set(self._pending_tokens)
        assert pending <= self._in_runner, f"pending tokens for requests not in the runner: {pending}"
        dropped = self._in_runner & self._finished_since_last_step
        assert not dropped, f"requests both held by the runner and finished: {dropped}"
        for request in self.running:
            assert request.status == RequestStatus.RUNNING
            assert request.num_computed_tokens <= request.num_tokens, f"{request.request_id} ran ahead"
            blocks = self.kv_cache_manager.req_to_blocks.get(request.request_id, [])
            assert len(blocks) * self.block_size >= request.num_computed_tokens, (
                f"{request.request_id}: {len(blocks)} blocks, {request.num_computed_tokens} computed tokens"
            )
            assert len(blocks) <= cdiv(request.num_computed_tokens + 1, self.block_size) + cdiv(
                self.sched.max_num_batched_tokens, self.block_size
            )
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert request.num_computed_tokens == 0, f"waiting {request.request_id} has computed tokens"
        if scheduler_output is not None:
            priors = scheduler_output.num_prior_tokens()
            assert priors.keys() == scheduler_output.num_scheduled_tokens.keys(), "request data out of sync"
            for rid, num_new in scheduler_output.num_scheduled_tokens.items():
                request = self.requests.get(rid)
                if request is not None and request.status == RequestStatus.RUNNING:
                    assert request.num_computed_tokens == priors[rid] + num_new, (
                        f"{rid}: {request.num_computed_tokens} computed tokens, but the step scheduled "
                        f"{num_new} after {priors[rid]}"
                    )


@dataclass
class _Budget:
    """What is left of one step's budgets: tokens (``max_num_batched_tokens``, a hard cap) and, with
    ``attention_cost_tokens`` = K > 0, cost (``max_num_batched_cost`` token-equivalents).

    A chunk of ``n`` tokens after ``p`` computed ones costs ``n + n * (p + n) / K`` (see
    ``SchedulerConfig``). Costs are held multiplied by K, ``n * K + n * (p + n)``, so they add and
    subtract exactly in integers.
    """

    left: int
    total: int
    cost_k: int = 0  # K; 0 = token budget only
    cost_left: int = 0  # K x token-equivalents left

    @classmethod
    def for_step(cls, sched: SchedulerConfig) -> _Budget:
        b, k = sched.max_num_batched_tokens, sched.attention_cost_tokens
        return cls(left=b, total=b, cost_k=k, cost_left=b * k + b * b)  # K x (B + B * B / K)

    def grant(self, wanted: int, prior: int, is_decode: bool = False) -> int:
        """Tokens for a request that wants ``wanted`` tokens after ``prior`` computed ones (0: none).

        Capped by the tokens left and, for a prefill or recompute chunk, by the cost left. A decode
        (``is_decode``, as ``Request.is_decode``) is never refused for cost (skipping it would only
        add inter-token latency); a step that has nothing yet gives a chunk at least 1 token, so a
        prompt progresses even where one token of it costs more than the whole budget.
        """
        n = min(wanted, self.left)
        if not self.cost_k or is_decode or n == 0:
            return n
        # Largest m with m * m + m * (K + p) <= cost_left: the root of the quadratic, exact via isqrt.
        b = self.cost_k + prior
        affordable = (math.isqrt(b * b + 4 * max(self.cost_left, 0)) - b) // 2
        floor = 1 if self.left == self.total else 0
        return max(min(n, affordable), floor)

    def charge(self, n: int, prior: int) -> None:
        """Spend ``n`` tokens scheduled after ``prior`` computed ones."""
        self.left -= n
        self.cost_left -= n * self.cost_k + n * (prior + n) if self.cost_k else 0

    def refund(self, n: int, prior: int) -> None:
        """Give back what ``charge(n, prior)`` spent (a scheduled request was preempted)."""
        self.left += n
        self.cost_left += n * self.cost_k + n * (prior + n) if self.cost_k else 0
