"""The batch's grammar bitmask and the sampler step that applies it to the logits.

A bitmask row holds one bit per vocabulary token (``ceil(V / 32)`` int32 words, bit ``v % 32`` of word
``v // 32``; xgrammar's layout): 1 = allowed. The engine fills one row per constrained request due
to sample (``segserve.structured_output.manager``); here the rows are matched to the logits rows and
applied in one call of xgrammar's CPU kernel, which sets every disallowed logit to ``-inf``. No
Python loop touches the vocabulary. vLLM applies its grammar bitmask at the same point: after the
logits, before sampling, so logprobs are those of the constrained distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GrammarBitmask:
    """The grammar constraint of one step.

    Attributes:
        req_ids: the constrained requests that sample this step, one per bitmask row.
        bitmask: ``(len(req_ids), ceil(V / 32))`` int32 on CPU, xgrammar's bit layout.
    """

    req_ids: tuple[str, ...]
    bitmask: torch.Tensor

    def __post_init__(self) -> None:
        if self.bitmask.dim() != 2 or self.bitmask.shape[0] != len(self.req_ids):
            raise ValueError(f"bitmask must be ({len(self.req_ids)}, W), got {tuple(self.bitmask.shape)}")
        if self.bitmask.dtype != torch.int32:
            raise ValueError(f"bitmask must be int32, got {self.bitmask.dtype}")


def apply_grammar_bitmask(
    logits: torch.Tensor, row_req_ids: list[str], grammar: GrammarBitmask | None
) -> None:
    """In place: set the logits of tokens the grammar forbids to ``-inf``.

    Args:
        logits: ``(N, V)`` float32 logits of the rows being sampled.
        row_req_ids: the request of each logits row (N ids).
        grammar: the step's bitmask; ``None`` or rows of requests not in ``row_req_ids`` change nothing.

    Raises:
        ValueError: the bitmask is narrower than ``ceil(V / 32)`` words.
    """
    if grammar is None or not grammar.req_ids:
        return
    where = {rid: i for i, rid in enumerate(row_req_ids)}
    pairs = [(where[rid], src) for src, rid in enumerate(grammar.req_ids) if rid in where]
    if not pairs:
        return
    vocab = logits.shape[1]
    if grammar.bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"bitmask has {grammar.bitmask.shape[1]} words, fewer than V={vocab} tokens need")
    rows = torch.tensor([dst for dst, _ in pairs])
    src = torch.tensor([src for _, src in pairs])
    # (N, W), -1 = every bit set = all allowed: rows of unconstrained requests stay as they are.
    # index_copy_, not ``full[rows] = ...``: list-indexed assignment took ~50 ms for 16 rows here.
    full = torch.full((logits.shape[0], grammar.bitmask.shape[1]), -1, dtype=torch.int32)
    full.index_copy_(0, rows, grammar.bitmask.index_select(0, src))
    import xgrammar as xgr  # only steps with a constrained request pay for the import

    backend = "cpu" if logits.device.type == "cpu" else "auto"
    xgr.apply_token_bitmask_inplace(logits, full, vocab_size=vocab, indices=rows.tolist(), backend=backend)
