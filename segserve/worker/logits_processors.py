"""Per-request logits processing for one batch, before temperature and sampling: allowed token ids,
bad words, logit bias, then repetition / frequency / presence penalties.

The order and the definitions are vLLM 0.32's (``Sampler.apply_logits_processors``): the
repetition penalty (CTRL, Keskar et al. 2019) counts the prompt and the output, the frequency and
presence penalties (OpenAI's definition) count the output only. Everything is a tensor operation
over the rows that asked; Python loops run over requests and bad words, never over the vocabulary.
A grammar bitmask step (structured output) sits beside this one as another in-place pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from segserve.sampling_params import SamplingParams


@dataclass
class LogitsRow:
    """What the processors need of one batch row.

    Attributes:
        params: the row's sampling parameters (``needs_logits_processing`` is True).
        prompt_token_ids: the prompt, token ids.
        output_token_ids: tokens generated so far, token ids.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def apply_logits_processors(logits: torch.Tensor, rows: list[int], inputs: list[LogitsRow]) -> None:
    """In place: apply each listed row's token filters, bias and penalties.

    Args:
        logits: (N, V) float32 logits of the batch.
        rows: indices into ``logits`` of the rows to process, one per entry of ``inputs``.
        inputs: what each of those rows asked for.

    Raises:
        ValueError: when ``rows`` and ``inputs`` differ in length.
    """
    if len(rows) != len(inputs):
        raise ValueError(f"{len(rows)} rows but {len(inputs)} inputs")
    if not rows:
        return
    vocab = logits.shape[1]
    _allowed_token_ids(logits, rows, inputs, vocab)
    _bad_words(logits, rows, inputs)
    _logit_bias(logits, rows, inputs)
    _penalties(logits, rows, inputs, vocab)


def _allowed_token_ids(logits: torch.Tensor, rows: list[int], inputs: list[LogitsRow], vocab: int) -> None:
    picked = [(r, x.params.allowed_token_ids) for r, x in zip(rows, inputs, strict=True)
              if x.params.allowed_token_ids is not None]
    if not picked:
        return
    banned = torch.ones(len(picked), vocab, dtype=torch.bool)  # (Ra, V)
    for i, (_, ids) in enumerate(picked):
        banned[i, ids] = False
    idx = torch.tensor([r for r, _ in picked])
    logits[idx] = logits[idx].masked_fill(banned, float("-inf"))


def _bad_words(logits: torch.Tensor, rows: list[int], inputs: list[LogitsRow]) -> None:
    """Ban a one-token bad word always, a longer one's last token when the output ends with the rest."""
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    for r, x in zip(rows, inputs, strict=True):
        for word in x.params.bad_words_token_ids or ():
            prefix = word[:-1]
            if not prefix or x.output_token_ids[len(x.output_token_ids) - len(prefix):] == prefix:
                ban_rows.append(r)
                ban_ids.append(word[-1])
    if ban_rows:
        logits[ban_rows, ban_ids] = float("-inf")


def _logit_bias(logits: torch.Tensor, rows: list[int], inputs: list[LogitsRow]) -> None:
    r_idx, t_idx, values = [], [], []
    for r, x in zip(rows, inputs, strict=True):
        for token, bias in (x.params.logit_bias or {}).items():
            r_idx.append(r)
            t_idx.append(token)
            values.append(bias)
    if r_idx:
        logits.index_put_((torch.tensor(r_idx), torch.tensor(t_idx)), torch.tensor(values), accumulate=True)


def _penalties(logits: torch.Tensor, rows: list[int], inputs: list[LogitsRow], vocab: int) -> None:
    picked = [(r, x) for r, x in zip(rows, inputs, strict=True) if _has_penalty(x.params)]
    if not picked:
        return
    idx = torch.tensor([r for r, _ in picked])
    sub = logits[idx]  # (Rp, V)
    out_counts = _bin_counts([x.output_token_ids for _, x in picked], vocab)  # (Rp, V)
    seen = (_bin_counts([x.prompt_token_ids for _, x in picked], vocab) > 0) | (out_counts > 0)
    rep = torch.tensor([x.params.repetition_penalty for _, x in picked]).unsqueeze(1)  # (Rp, 1)
    rep = torch.where(seen, rep, 1.0)  # (Rp, V)
    sub = sub * torch.where(sub > 0, 1.0 / rep, rep)
    freq = torch.tensor([x.params.frequency_penalty for _, x in picked]).unsqueeze(1)  # (Rp, 1)
    pres = torch.tensor([x.params.presence_penalty for _, x in picked]).unsqueeze(1)  # (Rp, 1)
    sub = sub - freq * out_counts - pres * (out_counts > 0)
    logits[idx] = sub


def _has_penalty(params: SamplingParams) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0)


def _bin_counts(token_lists: list[list[int]], vocab: int) -> torch.Tensor:
    """(R, V) float counts of each token id per list; padding goes to a spare column, then dropped."""
    width = max((len(t) for t in token_lists), default=0)
    ids = torch.full((len(token_lists), width), vocab, dtype=torch.long)  # (R, L), pad = vocab
    for i, t in enumerate(token_lists):
        if t:
            ids[i, : len(t)] = torch.tensor(t)
    counts = torch.zeros(len(token_lists), vocab + 1)
    counts.scatter_add_(1, ids, torch.ones(ids.shape))
    return counts[:, :vocab]
