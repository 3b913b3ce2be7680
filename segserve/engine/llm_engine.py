"""``LLMEngine``: the step loop that wires tokenizer, scheduler, model runner and output processor.

Shaped like vLLM's ``LLMEngine``: ``add_request``, ``step() -> list[RequestOutput]``,
``abort_request``, ``has_unfinished_requests``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import numbers
import time
from collections.abc import Callable
from typing import Any

import torch

from segserve import malloc
from segserve.attention.backends import AttentionBackend, get_attention_backend
from segserve.config import fit_max_model_len, num_kv_blocks_for
from segserve.core.request import Request, RequestStatus
from segserve.core.scheduler import Scheduler
from segserve.core.scheduler_output import SchedulerOutput
from segserve.engine.grammar_gate import GrammarGate
from segserve.engine.output_processor import OutputProcessor, child_request_id
from segserve.engine.step_monitor import StepErrorMonitor
from segserve.engine_args import EngineArgs, given_max_model_len
from segserve.models.llama import kv_cache_bytes_per_token, step_activation_bytes_per_token
from segserve.models.loader import LoadedModel, load_model
from segserve.outputs import RequestOutput
from segserve.sampling_params import SamplingParams
from segserve.worker.model_runner import ModelRunner
from segserve.worker.sampler import mix_seed

logger = logging.getLogger("segserve")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# A prompt is a string, a list of token ids, or a dict with "prompt" or "prompt_token_ids" (vLLM).
PromptType = str | list[int] | dict[str, Any]


def _load(
    model: str | LoadedModel | None, dtype: torch.dtype, backend: AttentionBackend,
    quantization: str | None = None,
) -> LoadedModel:
    """``model`` loaded in ``dtype``, or as given when already loaded (ValueError if in another dtype,
    or if ``quantization`` asks for what it is not: ``"none"`` of a model with quantized layers,
    ``"gguf"`` of one without)."""
    if not isinstance(model, LoadedModel):
        return load_model(model, dtype=dtype, attn_backend=backend, quantization=quantization)
    loaded_dtype = next(model.model.parameters()).dtype
    if loaded_dtype != dtype:
        raise ValueError(f"the loaded model is {loaded_dtype}, not {dtype}")
    quantized = any(hasattr(m, "qweight") for m in model.model.modules())
    if (quantization == "none" and quantized) or (quantization == "gguf" and not quantized):
        state = "has" if quantized else "has no"
        raise ValueError(f"the loaded model {state} GGUF-quantized layers; quantization={quantization!r} "
                         "cannot change that (load it again)")
    return model


def resolve_dtype(dtype: str | torch.dtype, model: str | LoadedModel | None = None) -> torch.dtype:
    """``"float32"``/``"bfloat16"`` (or the torch dtype) -> torch dtype; ``"auto"``: the checkpoint's
    (``auto_dtype(model)``). ValueError otherwise."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype == "auto":
        return auto_dtype(model)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES) + ['auto']}, got {dtype!r}")
    return DTYPES[dtype]


def auto_dtype(model: str | LoadedModel | None) -> torch.dtype:
    """vLLM's ``--dtype auto`` on CPU: the checkpoint's dtype where segserve runs it.

    A loaded model keeps its dtype; a Hugging Face directory's ``torch_dtype`` (or ``dtype``) of
    bfloat16 gives bfloat16, and float16 also bfloat16 (there is no float16 CPU path; vLLM-CPU does
    the same); anything else, and GGUF files (quantized blocks dequantize to float), float32.
    """
    import json
    from pathlib import Path

    if isinstance(model, LoadedModel):
        return next(model.model.parameters()).dtype
    config = Path(model) / "config.json" if model is not None else None
    if config is None or not config.is_file():
        return torch.float32
    meta = json.loads(config.read_text())
    name = meta.get("torch_dtype") or meta.get("dtype")
    return torch.bfloat16 if name in ("bfloat16", "float16") else torch.float32


def prompt_type_error(prompt: object) -> ValueError:
    """The error for a prompt of a type no entry point takes, naming that type."""
    kind = type(prompt).__name__
    return ValueError(f"a prompt must be a string, a list of token ids or a dict, got {kind}")


class LLMEngine:
    """The offline/online engine core loop.

    ``LLMEngine(model=..., dtype=..., ...)`` takes ``EngineArgs``' fields as keywords (same names
    and defaults; ``segserve.engine_args.EngineArgs`` documents each); ``from_engine_args`` takes
    them built. Either way the settings are checked before the model loads, then
    ``EngineArgs.create_engine_config`` makes ``self.config`` with ``max_model_len`` settled
    against the model's context length, and the KV pool is sized from it
    (``config.num_kv_blocks_for``).

    Raises:
        ValueError: on any invalid setting, naming it and the allowed range.
        TypeError: for a keyword that is not an ``EngineArgs`` field.
    """

    def __init__(self, model: str | LoadedModel | None = None, **kwargs: Any) -> None:
        args = EngineArgs(model=model, **kwargs)
        torch_dtype = resolve_dtype(args.dtype, args.model)
        args.check()
        backend = get_attention_backend(args.attention_backend)
        t0 = time.perf_counter()
        self.loaded = _load(args.model, torch_dtype, backend, args.quantization)
        self.load_seconds = time.perf_counter() - t0
        for layer in self.loaded.model.layers:
            layer.self_attn.attn_backend = backend
        model_config = self.loaded.config
        self.config = args.create_engine_config(model_config.max_position_embeddings)
        self.tokenizer = self.loaded.tokenizer
        self.eos_token_id = self.loaded.eos_token_ids[0] if self.loaded.eos_token_ids else None
        bytes_per_token = kv_cache_bytes_per_token(model_config, torch_dtype)
        self.num_kv_blocks = num_kv_blocks_for(self.config, bytes_per_token)
        # Not given (or -1): the model's length, lowered to what the cache holds; given: it must fit.
        fitted = fit_max_model_len(self.config, self.num_kv_blocks,
                                   auto=given_max_model_len(args.max_model_len) is None)
        if fitted is not self.config:
            logger.warning("max_model_len lowered from %d to %d tokens: what the KV cache (%d blocks of %d) "
                           "holds", self.config.scheduler.max_model_len, fitted.scheduler.max_model_len,
                           self.num_kv_blocks - 1, self.config.cache.block_size)
        self.config = fitted
        self.scheduler = Scheduler(self.config, self.num_kv_blocks)
        self.runner = ModelRunner(
            self.loaded.model,
            self.config,
            self.num_kv_blocks,
            model_config.num_key_value_heads,
            model_config.head_dim,
            model_config.num_hidden_layers,
            torch_dtype,
            self.eos_token_id,
            args.seed,
        )
        # The first large step's activations from pages the process already has (malloc.prefault).
        per_token = step_activation_bytes_per_token(model_config, torch_dtype)
        self.prefaulted_bytes = malloc.prefault(self.config.scheduler.max_num_batched_tokens * per_token)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.step_count = 0
        # Seconds spent in ``runner.execute_model`` (forward and sampling) over every step, and in
        # whole steps (plus scheduling, output processing, detokenization): what a server adds
        # around the model shows as the difference (``segserve:model_execute_seconds``).
        self.model_seconds = 0.0
        self.step_seconds = 0.0
        # Called with each step's SchedulerOutput right after scheduling, while request state still
        # matches it (profilers and tests read the step's composition here).
        self.schedule_observers: list[Callable[[SchedulerOutput], None]] = []
        # Set by the server (``segserve serve``): compares each step's time with the step profile's
        # prediction (``segserve.engine.step_monitor``); None costs nothing.
        self.step_monitor: StepErrorMonitor | None = None
        # Structured output, made on the first constrained request (xgrammar's tokenizer tables).
        self._grammar_gate: GrammarGate | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        """The engine ``args`` describe (the CLI's and the server's way in).

        Raises:
            ValueError: as ``LLMEngine(...)``.
        """
        # Not dataclasses.asdict: it would deep-copy a LoadedModel given as ``model``.
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)})

    # ---- requests ------------------------------------------------------------------------------

    def tokenize(self, prompt: PromptType, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of a prompt; ValueError for an empty or invalid one. A dict
        with ``prompt_token_ids`` and a ``prompt`` string (the text they were made from, e.g. a rendered
        chat) reports that text and is not tokenized again. ``add_special_tokens``: a text prompt gets the
        tokenizer's special tokens (e.g. a GGUF's BOS when it asks for one), as ``tokenizer.encode`` and
        vLLM's completions do by default; token ids are taken as given either way."""
        text = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text = prompt["prompt"] if isinstance(prompt.get("prompt"), str) else None
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(
                    f"a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}"
                )
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty (0 characters); at least 1 token is needed")
            try:
                return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            except TypeError as exc:  # looked into only on failure: a scan per request would cost O(chars)
                bad = next((i for i, ch in enumerate(prompt) if "\ud800" <= ch <= "\udfff"), None)
                if bad is not None:  # a lone surrogate (JSON allows "\ud800"): not text, and not encodable
                    raise ValueError(f"prompt holds a lone UTF-16 surrogate U+{ord(prompt[bad]):04X} at "
                                     f"character {bad}, which is not valid Unicode text") from None
                raise ValueError(f"prompt text cannot be tokenized: {exc}") from None
        if not isinstance(prompt, (list, tuple)):
            raise prompt_type_error(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty (0 tokens); at least 1 token is needed")
        vocab = self.loaded.config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise ValueError(f"prompt token id {t!r} is not an int")
            if not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab})")
        return text, [int(t) for t in ids]

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request (``n`` completions). Returns its id.

        Raises:
            ValueError: empty prompt, token id (or ``top_k``) outside the vocabulary, a prompt that leaves
                no room for one output token within ``max_model_len`` (vLLM's rule; the scheduler's own
                check, used by the simulator and the seed's examples, takes a prompt of exactly
                ``max_model_len``), one longer than the KV cache holds, duplicate id. Nothing is queued
                then.
        """
        params = self._check_token_fields(sampling_params or SamplingParams())
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.output_processor.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, prompt_ids = self.tokenize(prompt)
        if len(prompt_ids) >= self.max_model_len:  # vLLM 0.32's rule (its input processor): room for 1 token
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; with at least 1 output token that is "
                             f"more than max_model_len={self.max_model_len}")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        child_ids = [child_request_id(request_id, i, params.n) for i in range(params.n)]
        taken = [cid for cid in child_ids if cid != request_id and self._holds(cid)]
        if taken:
            raise ValueError(
                f"request id {request_id!r} with n={params.n} needs the internal id {taken[0]!r} for "
                "one of its completions, and a running request already uses it; choose another id"
            )
        core_params, salt = self._with_extra_eos(params), cache_salt
        requests = [
            Request(cid, prompt_ids, self._child_params(core_params, i), self.eos_token_id, arrival, salt)
            for i, cid in enumerate(child_ids)
        ]
        if params.structured_outputs is not None:
            for req in requests:
                self.scheduler.check_request(req)
            self.grammar_gate.hold(requests, params.structured_outputs)
        else:
            self._add_to_scheduler(requests)
        state = self.output_processor.make_state(request_id, text, prompt_ids, params, arrival)
        self.output_processor.add(state, child_ids)
        return request_id

    def _add_to_scheduler(self, requests: list[Request]) -> None:
        added = []
        try:
            for req in requests:
                self.scheduler.add_request(req)
                added.append(req.request_id)
        except ValueError:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise

    def _holds(self, child_id: str) -> bool:
        gate = self._grammar_gate
        return child_id in self.scheduler.requests or (gate is not None and child_id in gate)

    @property
    def grammar_gate(self) -> GrammarGate:
        """Structured output's state (compiled grammars, waiting requests, matchers); made on first use."""
        if self._grammar_gate is None:
            vocab = self.loaded.config.vocab_size
            self._grammar_gate = GrammarGate(self.tokenizer, vocab, list(self.loaded.eos_token_ids))
        return self._grammar_gate

    def _check_token_fields(self, params: SamplingParams) -> SamplingParams:
        """Token ids of the parameters checked against the vocabulary; ``bad_words`` tokenized.

        Raises:
            ValueError: naming the field, the id and the vocabulary range.
        """
        vocab = self.loaded.config.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids),
                          ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("logit_bias", list(params.logit_bias or ()))):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name} entry {bad[0]} is outside the vocabulary [0, {vocab})")
        if params.top_k > vocab:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or in [1, {vocab}] (the vocabulary size), "
                             f"got {params.top_k}")
        if params.bad_words and params.bad_words_token_ids is None:
            params = dataclasses.replace(params, bad_words_token_ids=self._bad_words_ids(params.bad_words))
        return params

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Token ids of each bad word without leading spaces and, when it tokenizes to as many tokens
        and starts differently, with one leading space (the form it takes mid-sentence) -- vLLM's rule."""
        out: list[list[int]] = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            for ids in (plain, spaced):
                if ids and ids not in out:
                    if ids is spaced and plain and (len(ids) != len(plain) or ids[0] == plain[0]):
                        continue
                    out.append(ids)
        return out

    @staticmethod
    def _child_params(params: SamplingParams, index: int) -> SamplingParams:
        """Completion ``index``'s parameters: n=1, and a seed of its own so completions differ."""
        seed = params.seed
        if seed is not None and index > 0:
            seed = mix_seed(seed, -1 - index)
            seed -= 2**64 if seed >= 2**63 else 0  # the same 64 bits as a signed seed (its valid range)
        return dataclasses.replace(params, n=1, seed=seed)

    def _with_extra_eos(self, params: SamplingParams) -> SamplingParams:
        """Models with several EOS ids (Llama 3's generation config): the ones after the first stop
        generation like stop token ids, unless ``ignore_eos`` (vLLM does the same)."""
        extra = [t for t in self.loaded.eos_token_ids[1:] if t not in params.stop_token_ids]
        if not extra or params.ignore_eos:
            return params
        return dataclasses.replace(params, stop_token_ids=list(params.stop_token_ids) + extra)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests now and free their KV blocks; unknown ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            children = self.output_processor.abort(rid)
            self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
            if self._grammar_gate is not None:
                self._grammar_gate.abort(children)

    def has_unfinished_requests(self) -> bool:
        gate = self._grammar_gate
        return self.scheduler.has_unfinished_requests() or (gate is not None and bool(gate.awaiting))

    @property
    def num_awaiting_grammar(self) -> int:
        """Requests (completions) waiting outside the scheduler for their grammar to compile."""
        return 0 if self._grammar_gate is None else len(self._grammar_gate.awaiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.states)

    # ---- the step --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, and return the requests that progressed this step."""
        t0 = time.perf_counter()
        gate = self._grammar_gate
        failed = gate.admit_ready(self.scheduler) if gate is not None else []
        so = self.scheduler.schedule()
        for observe in self.schedule_observers:
            observe(so)
        now = time.monotonic()
        priors = so.num_prior_tokens()
        monitor = self.step_monitor
        if monitor is not None:
            monitor.begin(self.scheduler, so, priors)
        for rid, prior in priors.items():
            had_prompt_tokens = prior < self.scheduler.requests[rid].num_prompt_tokens
            self.output_processor.record_scheduled(rid, had_prompt_tokens, now)
        try:
            grammar = gate.bitmask(so, self.scheduler) if gate is not None else None
            t_model = time.perf_counter()
            runner_output = self.runner.execute_model(so, grammar)
            self.model_seconds += time.perf_counter() - t_model
        except Exception:
            self._fail_step(so)
            raise
        core_outputs = self.scheduler.update_from_output(so, runner_output)
        if gate is not None:
            core_outputs = failed + gate.after_step(runner_output, core_outputs, self.scheduler)
        outputs, stop_hits = self.output_processor.process(core_outputs)
        if stop_hits:
            self.scheduler.finish_requests(stop_hits, RequestStatus.FINISHED_STOPPED)
        self.step_count += 1
        elapsed = time.perf_counter() - t0
        self.step_seconds += elapsed
        if monitor is not None:
            monitor.end(elapsed)
        return outputs

    def _fail_step(self, so) -> None:
        """A step raised: its requests' state advanced without results, so abort them (their blocks
        go back to the pool) and let the engine go on serving everything else."""
        parents = {
            self.output_processor.child_to_parent.get(cid, (None,))[0] for cid in so.num_scheduled_tokens
        }
        parents.discard(None)
        for rid in parents:
            logger.error("request %s aborted: the step that computed it raised", rid)
        self.abort_request(sorted(parents))
        orphans = [cid for cid in so.num_scheduled_tokens if cid in self.scheduler.requests]
        self.scheduler.finish_requests(orphans, RequestStatus.FINISHED_ABORTED)
        for cid in so.num_scheduled_tokens:
            self.runner.requests.pop(cid, None)

    def check_integrity(self) -> None:
        """Scheduler and KV cache invariants (AssertionError when broken)."""
        self.scheduler.check_integrity()

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def kv_cache_tokens(self) -> int:
        """Tokens the KV pool holds (null block excluded)."""
        return (self.num_kv_blocks - 1) * self.config.cache.block_size

    def describe(self) -> str:
        """One line of the engine's settings, for logs."""
        s, c, a = self.config.scheduler, self.config.cache, self.config.attention
        return (
            f"model={self.loaded.name} blocks={self.num_kv_blocks}x{c.block_size} "
            f"({self.kv_cache_tokens()} tokens) budget={s.max_num_batched_tokens} "
            f"max_num_seqs={s.max_num_seqs} max_model_len={s.max_model_len} "
            f"prefix_caching={c.enable_prefix_caching} "
            f"attention={a.backend}/{a.kv_segment_size}"
        )
