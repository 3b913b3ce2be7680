"""Turns a ``SchedulerOutput`` into tensors, runs the model, samples: one call per engine step.

The runner keeps a copy of each scheduled request's tokens and block-table row (sent in full the
first time, as deltas afterwards), so per-step work is proportional to the scheduled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from segserve.attention.metadata import AttentionMetadata, build_attention_metadata
from segserve.config import EngineConfig
from segserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from segserve.sampling_params import SamplingParams
from segserve.worker.cpu_step import CpuStep
from segserve.worker.grammar_mask import GrammarBitmask, apply_grammar_bitmask
from segserve.worker.logits_processors import LogitsRow, apply_logits_processors
from segserve.worker.sampler import compute_logprobs, sample


@dataclass
class RunnerRequest:
    """The runner's view of one request.

    Attributes:
        token_ids: prompt + output tokens known so far.
        num_prompt_tokens: prompt length (tokens).
        block_ids: its block-table row (append-only).
        num_computed_tokens: tokens in the KV cache before the current step.
        sampling_params: how to sample.
        eos_token_id: masked while fewer than ``min_tokens`` were generated.
    """

    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    eos_token_id: int | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class ModelRunner:
    """Owns the model, the paged KV cache (one tensor per layer) and per-request runner state; its
    ``cpu_step`` (``segserve.worker.cpu_step.CpuStep``) chooses how each step and the LM head run.

    Args:
        model: a ``segserve.models.llama.LlamaForCausalLM``.
        config: engine configuration.
        num_kv_blocks: blocks per layer, including the null block 0.
        num_kv_heads, head_dim: KV cache geometry.
        num_layers: layers (one cache tensor each).
        dtype: cache dtype (the model's).
        eos_token_id: masked for ``min_tokens``.
        seed: seeds the generator of requests that give no seed.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig,
        num_kv_blocks: int,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int,
        dtype: torch.dtype,
        eos_token_id: int | None,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.config = config
        self.cpu_step = CpuStep(model)
        # CPU float32/bfloat16: reorder weights for oneDNN once (1.8-2.6x faster GEMVs at M = 1-2
        # than F.linear; docs/perf.md). A no-op on other devices.
        self.cpu_step.prepack()
        self.block_size = config.cache.block_size
        self.max_blocks_per_seq = config.max_blocks_per_seq
        shape = (2, num_kv_blocks, self.block_size, num_kv_heads, head_dim)
        # Zeros, not empty: masked scores multiply cached values, and 0 * NaN garbage would be NaN.
        self.kv_caches = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.eos_token_id = eos_token_id
        self.generator = torch.Generator().manual_seed(seed)
        self.requests: dict[str, RunnerRequest] = {}

    def _update_states(self, so: SchedulerOutput) -> list[str]:
        """Apply the scheduler's deltas; returns the batch order (cached requests, then new ones)."""
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(rid, None)
        for c in so.scheduled_cached_reqs:
            state = self.requests[c.req_id]
            state.token_ids.extend(c.new_token_ids)
            state.block_ids.extend(c.new_block_ids)
            state.num_computed_tokens = c.num_computed_tokens
        for n in so.scheduled_new_reqs:
            self.requests[n.req_id] = RunnerRequest(
                token_ids=list(n.prompt_token_ids) + list(n.output_token_ids),
                num_prompt_tokens=len(n.prompt_token_ids),
                block_ids=list(n.block_ids),
                num_computed_tokens=n.num_computed_tokens,
                sampling_params=n.sampling_params,
                eos_token_id=self.eos_token_id,
            )
        return [c.req_id for c in so.scheduled_cached_reqs] + [n.req_id for n in so.scheduled_new_reqs]

    def _prepare_inputs(
        self, so: SchedulerOutput, order: list[str]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids and positions ``[T_padded]`` and the step's attention metadata."""
        query_lens = [so.num_scheduled_tokens[rid] for rid in order]
        priors = [self.requests[rid].num_computed_tokens for rid in order]
        padded = so.total_num_scheduled_tokens_padded
        input_ids = np.zeros(padded, dtype=np.int64)
        positions = np.zeros(padded, dtype=np.int64)
        start = 0
        for rid, q, p in zip(order, query_lens, priors, strict=False):
            input_ids[start : start + q] = self.requests[rid].token_ids[p : p + q]
            positions[start : start + q] = np.arange(p, p + q)
            start += q
        metadata = build_attention_metadata(
            query_lens,
            priors,
            [self.requests[rid].block_ids for rid in order],
            self.block_size,
            self.max_blocks_per_seq,
            self.config.attention.kv_segment_size,
            num_padded_tokens=padded,
        )
        return torch.from_numpy(input_ids), torch.from_numpy(positions), metadata

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, grammar: GrammarBitmask | None = None) -> ModelRunnerOutput:
        """Run one step. Returns sampled tokens for requests whose last scheduled token is their last.

        ``grammar``: the step's structured-output bitmask (rows of constrained requests), or None.
        """
        order = self._update_states(so)
        if not order:
            return ModelRunnerOutput(sampled_token_ids={})
        input_ids, positions, metadata = self._prepare_inputs(so, order)
        ends = metadata.query_start_loc_cpu[1:]
        due = [
            i
            for i, rid in enumerate(order)
            if self.requests[rid].num_computed_tokens + so.num_scheduled_tokens[rid]
            == len(self.requests[rid].token_ids)
        ]
        last_rows = [ends[i] - 1 for i in due]
        # Only the sampled rows' hidden states are read unless a request scores its prompt this step.
        scores_prompt = any(self.requests[rid].sampling_params.prompt_logprobs is not None for rid in order)
        hidden = self.cpu_step.forward(
            input_ids, positions, self.kv_caches, metadata, logits_rows=None if scores_prompt else last_rows
        )  # (T_padded, hidden)
        prompt_logprobs = self._prompt_logprobs(hidden, order, so, metadata)
        sampled, logprobs = {}, {}
        if due:
            logits = self.cpu_step.logits_of(hidden, last_rows)  # (N, V) float32
            rids = [order[i] for i in due]
            states = [self.requests[rid] for rid in rids]
            # Logprobs are those of the model's raw logits, before any processing (vLLM's default
            # logprobs mode "raw_logprobs").
            wants_logprobs = any(s.sampling_params.logprobs is not None for s in states)
            raw = logits.clone() if wants_logprobs else None
            held_back = self._mask_stop_tokens(logits, states, keep=grammar is not None)
            self._process_logits(logits, states)
            apply_grammar_bitmask(logits, rids, grammar)
            if grammar is not None and held_back:
                self._let_grammar_end(logits, rids, grammar, held_back)
            out = sample(
                logits,
                [s.sampling_params for s in states],
                [s.sampling_params.seed for s in states],
                [s.num_output_tokens for s in states],
                self.generator,
                logprob_logits=raw,
            )
            for row, (rid, token) in enumerate(zip(rids, out.token_ids, strict=False)):
                sampled[rid] = [token]
                if out.logprobs is not None and states[row].sampling_params.logprobs is not None:
                    logprobs[rid] = [out.logprobs[row]]
        return ModelRunnerOutput(
            sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=prompt_logprobs
        )

    def _mask_stop_tokens(self, logits: torch.Tensor, states: list[RunnerRequest], keep: bool = False
                          ) -> dict[int, tuple[list[int], torch.Tensor]]:
        """Forbid EOS and stop ids while a request has generated fewer than ``min_tokens`` (vLLM).

        Returns, with ``keep`` (a grammar constrains the step), row -> (the banned token ids, their
        logits before the ban) for ``_let_grammar_end``; otherwise nothing is copied and it is empty.
        """
        held_back = {}
        for row, s in enumerate(states):
            params = s.sampling_params
            if s.num_output_tokens >= params.min_tokens:
                continue
            banned = list(params.stop_token_ids)
            if s.eos_token_id is not None and not params.ignore_eos:
                banned.append(s.eos_token_id)
            if banned:
                if keep:
                    held_back[row] = (banned, logits[row, banned].clone())
                logits[row, banned] = float("-inf")
        return held_back

    @staticmethod
    def _let_grammar_end(logits: torch.Tensor, rids: list[str], grammar: GrammarBitmask,
                         held_back: dict[int, tuple[list[int], torch.Tensor]]) -> None:
        """A complete grammar may allow nothing but a stop token that ``min_tokens`` banned: every
        logit of the row is then -inf and the sampler would emit token 0, outside the grammar. The
        grammar wins there (its output is complete): the banned tokens it allows come back."""
        dead = [row for row in held_back if torch.isneginf(logits[row]).all()]
        for row in dead:
            banned, values = held_back[row]
            logits[row, banned] = values
        if dead:
            apply_grammar_bitmask(logits, rids, grammar)

    @staticmethod
    def _process_logits(logits: torch.Tensor, states: list[RunnerRequest]) -> None:
        """Penalties, logit bias and token filters of the rows that asked (one batched pass)."""
        rows = [i for i, s in enumerate(states) if s.sampling_params.needs_logits_processing]
        inputs = [
            LogitsRow(
                states[i].sampling_params,
                states[i].token_ids[: states[i].num_prompt_tokens],
                states[i].token_ids[states[i].num_prompt_tokens :],
            )
            for i in rows
        ]
        apply_logits_processors(logits, rows, inputs)

    def _prompt_logprobs(
        self, hidden: torch.Tensor, order: list[str], so: SchedulerOutput, metadata: AttentionMetadata
    ) -> dict[str, list[list[tuple[int, float, int]]]]:
        """Logprobs of each next prompt token for the prompt positions computed this step.

        Position ``j``'s logits score prompt token ``j + 1``; the last prompt position scores the
        first output token and is left out (vLLM's convention).
        """
        result = {}
        for i, rid in enumerate(order):
            state = self.requests[rid]
            k = state.sampling_params.prompt_logprobs
            if k is None:
                continue
            first = state.num_computed_tokens
            last = min(first + so.num_scheduled_tokens[rid], state.num_prompt_tokens - 1)
            if last <= first:
                result[rid] = []
                continue
            start = metadata.query_start_loc_cpu[i]
            logits = self.cpu_step.compute_logits(hidden[start : start + last - first])
            result[rid] = compute_logprobs(logits, state.token_ids[first + 1 : last + 1], k)
        return result
