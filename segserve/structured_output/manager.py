"""``StructuredOutputManager``: compiled grammars (cached by constraint, compiled off the step loop) and
one xgrammar matcher per constrained request.

Shaped after vLLM v1's ``StructuredOutputManager``: a request's grammar compiles on a background
thread while the request waits outside the scheduler and every other request keeps stepping
(``LLMEngine`` admits it once ``ready``); each step the manager fills a bitmask row for every
constrained request due to sample, and after the step it advances each matcher by the token the
request accepted. A matcher only ever sees sampled tokens, so preemption (which recomputes tokens
already accepted) and chunked prefill (whose partial chunks sample nothing) leave it right as it is.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar as xgr

from segserve.structured_output.grammar import build_grammar
from segserve.structured_output.params import StructuredOutputsParams
from segserve.worker.grammar_mask import GrammarBitmask

logger = logging.getLogger("segserve")

# Compiled grammars kept (LRU): a JSON schema's compiled masks take ~0.1-1 MB for a 49k vocabulary.
MAX_CACHED_GRAMMARS = 256


class StructuredOutputManager:
    """Grammar compilation and per-request matchers for one engine.

    Args:
        tokenizer: the engine's ``transformers`` tokenizer.
        vocab_size: the model's vocabulary (logits width), tokens; may exceed the tokenizer's.
        stop_token_ids: ids that end a completed grammar (the model's EOS ids).
        max_cached: compiled grammars kept, least recently used dropped first.

    Raises:
        ValueError: ``max_cached`` < 1.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        max_cached: int = MAX_CACHED_GRAMMARS,
    ) -> None:
        if max_cached < 1:
            raise ValueError(f"max_cached must be >= 1, got {max_cached}")
        self.vocab_size = vocab_size
        self.max_cached = max_cached
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=min(8, os.cpu_count() or 1))
        # One worker: compilations queue behind each other instead of taking every core from the steps.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="segserve-grammar")
        self._compiled: OrderedDict[tuple, Future] = OrderedDict()
        self.matchers: dict[str, xgr.GrammarMatcher] = {}
        self.num_compiled = 0  # compilations started (cache misses)

    # ---- grammars ----------------------------------------------------------------------------------

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar of ``params``: the cached one, or a compilation started now.

        Validation runs here, on the caller's thread; only compilation runs in the background.

        Raises:
            ValueError: the constraint is invalid or unsupported (see ``build_grammar``).
        """
        key = params.cache_key()
        future = self._compiled.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._compiled.move_to_end(key)
            return future
        grammar = build_grammar(params)
        future = self._executor.submit(self.compiler.compile_grammar, grammar)
        self.num_compiled += 1
        self._compiled[key] = future
        while len(self._compiled) > self.max_cached:
            self._compiled.popitem(last=False)
        return future

    # ---- matchers ----------------------------------------------------------------------------------

    def add_request(self, req_id: str, compiled: xgr.CompiledGrammar) -> None:
        """Start a matcher for ``req_id`` at the beginning of its grammar."""
        self.matchers[req_id] = xgr.GrammarMatcher(compiled)

    def remove(self, req_ids: list[str] | set[str]) -> None:
        """Forget the matchers of finished or aborted requests (unknown ids are ignored)."""
        for rid in req_ids:
            self.matchers.pop(rid, None)

    def grammar_bitmask(self, due_req_ids: list[str]) -> GrammarBitmask | None:
        """The bitmask rows of the constrained requests among ``due_req_ids`` (those sampling this step).

        A terminated matcher (its grammar ended and it accepted a stop token; the request goes on only
        with ``ignore_eos``) constrains nothing, as in vLLM. Returns None when no row is constrained.
        """
        rids = [rid for rid in due_req_ids if rid in self.matchers and not self.matchers[rid].is_terminated()]
        if not rids:
            return None
        bitmask = xgr.allocate_token_bitmask(len(rids), self.vocab_size)  # (R, W) int32, all allowed
        for row, rid in enumerate(rids):
            self.matchers[rid].fill_next_token_bitmask(bitmask, row)
        return GrammarBitmask(tuple(rids), bitmask)

    def accept(self, sampled: dict[str, list[int]]) -> tuple[dict[str, bool], list[str]]:
        """Advance each constrained request's matcher by its sampled tokens.

        Returns:
            rejected: req_id -> grammar complete, for each request whose token the grammar rejected
                (it should not happen: the bitmask allowed the token); the caller ends the request.
            terminated: the requests whose grammar accepted its final stop token this step.
        """
        rejected, terminated = {}, []
        for rid, tokens in sampled.items():
            matcher = self.matchers.get(rid)
            if matcher is None:
                continue
            for token in tokens:
                if matcher.is_terminated():
                    break
                if not matcher.accept_token(token):
                    logger.warning("request %s: token %d is outside its grammar; ending it", rid, token)
                    rejected[rid] = matcher.is_completed()
                    break
                if matcher.is_terminated():
                    terminated.append(rid)
        return rejected, terminated

    def shutdown(self) -> None:
        """Stop the compile thread (pending compilations are cancelled)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
