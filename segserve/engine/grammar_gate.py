"""``GrammarGate``: the engine's side of structured output. Holds constrained requests outside the
scheduler until their grammar has compiled, builds each step's grammar bitmask, and advances the
matchers with the sampled tokens.

vLLM keeps such requests in the scheduler's waiting queue with status ``WAITING_FOR_FSM``; here they
wait beside it, so ``segserve.core`` knows nothing of grammars and a waiting grammar never blocks the
queue head: requests that arrive later, unconstrained or with a cached grammar, are scheduled first.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from segserve.core.request import Request, RequestStatus
from segserve.core.scheduler import EngineCoreOutput, Scheduler
from segserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from segserve.structured_output.params import StructuredOutputsParams
from segserve.worker.grammar_mask import GrammarBitmask

logger = logging.getLogger("segserve")

# How long an otherwise idle step waits for a compiling grammar before returning, seconds.
IDLE_WAIT_S = 0.05


class GrammarGate:
    """Constrained requests between ``add_request`` and the scheduler, and their matchers after.

    Args:
        tokenizer: the engine's tokenizer.
        vocab_size: logits width, tokens.
        stop_token_ids: the model's EOS ids (a complete grammar allows only these).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        from segserve.structured_output.manager import StructuredOutputManager

        self.manager = StructuredOutputManager(tokenizer, vocab_size, stop_token_ids)
        self.awaiting: dict[str, tuple[Request, Future]] = {}

    def hold(self, requests: list[Request], params: StructuredOutputsParams) -> None:
        """Start (or reuse) the compilation of ``params`` and hold ``requests`` until it is done.

        Raises:
            ValueError: invalid or unsupported constraint; nothing is held then.
        """
        future = self.manager.submit(params)
        for request in requests:
            self.awaiting[request.request_id] = (request, future)

    def admit_ready(self, scheduler: Scheduler) -> list[EngineCoreOutput]:
        """Move requests whose grammar is ready into the scheduler (in arrival order).

        Returns an aborted output for each request whose compilation failed (logged).
        """
        if self.awaiting and not scheduler.has_unfinished_requests():
            # Nothing else to step: sleep on the compile thread instead of spinning empty steps.
            wait({f for _, f in self.awaiting.values()}, timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        failed = []
        for rid, (request, future) in list(self.awaiting.items()):
            if not future.done():
                continue
            del self.awaiting[rid]
            if future.exception() is not None:
                logger.error("request %s: grammar compilation failed: %r", rid, future.exception())
                failed.append(EngineCoreOutput(req_id=rid, new_token_ids=[], finish_reason="abort"))
                continue
            self.manager.add_request(rid, future.result())
            scheduler.add_request(request)
        return failed

    def bitmask(self, so: SchedulerOutput, scheduler: Scheduler) -> GrammarBitmask | None:
        """The step's grammar bitmask: a row per constrained request whose step ends at its last token
        (it samples; a partial prefill chunk or a recompute short of the end does not)."""
        if not self.manager.matchers:
            return None
        due = [
            rid
            for rid in so.num_scheduled_tokens
            if rid in self.manager.matchers
            and scheduler.requests[rid].num_computed_tokens == scheduler.requests[rid].num_tokens
        ]
        return self.manager.grammar_bitmask(due)

    def after_step(
        self, runner_output: ModelRunnerOutput, outputs: list[EngineCoreOutput], scheduler: Scheduler
    ) -> list[EngineCoreOutput]:
        """Advance the matchers by the sampled tokens; returns ``outputs`` with a finish reason on each
        request whose token the grammar rejected (ended now: ``stop`` if its grammar was complete,
        else ``error``, vLLM's reason for a grammar that rejects: it admitted no token, so no output
        satisfies it) or whose grammar ended on a stop token that ``min_tokens`` kept from ending
        the request (``stop``: the output is complete; only ``ignore_eos`` goes on past a grammar);
        forgets the matchers of requests no longer in the scheduler."""
        rejected, terminated = self.manager.accept(runner_output.sampled_token_ids)
        ended = dict(rejected)  # req_id -> its grammar is complete
        unfinished = {o.req_id for o in outputs if o.finish_reason is None}
        for rid in terminated:
            if rid in unfinished and not scheduler.requests[rid].sampling_params.ignore_eos:
                ended[rid] = True
        for rid, complete in ended.items():
            status = RequestStatus.FINISHED_STOPPED if complete else RequestStatus.FINISHED_ERROR
            scheduler.finish_requests([rid], status)
        if ended:
            outputs = [
                dataclasses.replace(o, finish_reason="stop" if ended[o.req_id] else "error")
                if o.req_id in ended and o.finish_reason is None
                else o
                for o in outputs
            ]
        self.manager.remove([rid for rid in self.manager.matchers if rid not in scheduler.requests])
        return outputs

    def abort(self, req_ids: list[str]) -> None:
        """Drop waiting requests (their compilation goes on: the grammar stays cached)."""
        for rid in req_ids:
            self.awaiting.pop(rid, None)
        self.manager.remove(req_ids)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.awaiting
