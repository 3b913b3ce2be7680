"""Token sampling for one engine step: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Randomness is the exponential race, a form of the Gumbel-max trick: with ``q_v ~ Exp(1)`` independent
per token, ``argmax_v p_v / q_v`` is distributed as ``p`` (the least of independent exponentials of rates
``p_v`` falls on ``v`` with probability ``p_v``). vLLM samples the same way. The noise is not drawn from a
generator but hashed: ``q_v = -log U(key, v)`` (:func:`race_noise`), so each token's noise depends on the
row's 64-bit key and its id alone. A seeded row's key comes from ``(seed, output_index)``, so its token
does not depend on the batch it sits in, its row, how the prompt was chunked, or preemption; and since
every token has noise of its own, logits that move by a rounding error (the same request in another
batch shape) change the token only where two tokens nearly tie. Unseeded rows take their keys from the
engine's generator.

The filters and the race run in the compiled kernel (``segserve.kernels.sample``: a few vector passes a
row, no sort) where the kernels are on, else here in PyTorch and numpy; both keep the same tokens and
hash the same noise, so they draw the same token but where two nearly tie.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from segserve.kernels import sample as sample_kernel
from segserve.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15
# Top-p looks for the nucleus among this many most likely tokens before sorting the vocabulary.
TOP_P_CANDIDATES = 512


@dataclass
class SamplerOutput:
    """What the sampler returns for a batch of N rows.

    Attributes:
        token_ids: the sampled token id of each row, length N.
        logprobs: per row, the sampled token's ``(id, logprob, rank)`` first, then the top
            ``params.logprobs`` ones by descending logprob (natural log of the raw
            softmax of the logits); an empty list for a row that did not ask; ``None`` when no row asked.
    """

    token_ids: list[int]
    logprobs: list[list[tuple[int, float, int]]] | None = None


def mix_seed(seed: int, output_index: int) -> int:
    """Mix a request seed and an output index into one 64-bit generator seed.

    Uses the splitmix64 finalizer (Steele, Lea, Flood, "Fast splittable pseudorandom number
    generators", 2014) so that neighbouring (seed, index) pairs give unrelated streams.
    """
    x = ((seed & _MASK64) ^ ((output_index + 1) * _GOLDEN64)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int | None],
    output_indices: list[int],
    generator: torch.Generator | None = None,
    logprob_logits: torch.Tensor | None = None,
) -> SamplerOutput:
    """Pick one token per row.

    Args:
        logits: (N, V) float32 logits; row i belongs to a request sampled with ``params[i]``.
        params: N sampling parameters.
        seeds: N per-request seeds; ``None`` rows draw from ``generator``.
        output_indices: N counts of tokens the row's completion has generated so far.
        generator: engine-wide generator for unseeded rows; ``None`` means torch's default.
        logprob_logits: (N, V) logits the returned logprobs come from (the model's raw logits when
            ``logits`` were processed); ``None`` means ``logits``.

    Returns:
        SamplerOutput with N token ids and, if any row asked, logprobs.

    Raises:
        ValueError: when the list lengths differ from N or logits is not 2-D.
    """
    n = _check_batch(logits, params, seeds, output_indices)
    logits = logits.float()
    drawn_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not drawn_rows:
        token_ids = greedy_ids(logits)  # (N,) -- no softmax, no sort
    else:
        token_ids = [0] * n
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        if greedy_rows:
            for i, tok in zip(greedy_rows, greedy_ids(logits[greedy_rows]), strict=True):
                token_ids[i] = tok
        sub = logits if len(drawn_rows) == n else logits[drawn_rows]  # (R, V)
        keys = noise_keys([seeds[i] for i in drawn_rows], [output_indices[i] for i in drawn_rows], generator)
        drawn = draw(sub, [params[i] for i in drawn_rows], keys)
        for i, tok in zip(drawn_rows, drawn, strict=True):
            token_ids[i] = tok
    source = logits if logprob_logits is None else logprob_logits.float()
    return SamplerOutput(token_ids=token_ids, logprobs=_row_logprobs(source, params, token_ids, n))


def noise_keys(seeds: list[int | None], output_indices: list[int], generator: torch.Generator | None
               ) -> torch.Tensor:
    """(R,) int64 noise keys, one a sampled row: a seeded row's is ``mix_seed(seed, index)`` (as a signed
    64-bit value), the others come from ``generator`` (torch's default generator when None)."""
    keys = torch.empty(len(seeds), dtype=torch.int64)  # (R,)
    unseeded = [i for i, s in enumerate(seeds) if s is None]
    if unseeded:
        keys[unseeded] = torch.randint(-2**63, 2**63 - 1, (len(unseeded),), dtype=torch.int64,
                                       generator=generator)
    for i, seed in enumerate(seeds):
        if seed is not None:
            key = mix_seed(seed, output_indices[i])
            keys[i] = key - 2**64 if key >= 2**63 else key
    return keys


def _mix32(x: np.ndarray) -> np.ndarray:
    """Wellons' "lowbias32" integer mixer on uint32 arrays (wrapping arithmetic)."""
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def race_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """(R, V) float32 ``Exp(1)`` noise of the race: ``-log U`` with ``U = ((x >> 9) + 0.5) / 2**23`` and
    ``x = mix32(mix32(v ^ k0) + k1)`` for token ``v`` and the key's low and high 32 bits ``k0, k1``
    (``csrc/segserve_sample.c`` computes the same bits)."""
    k = keys.numpy().astype(np.uint64)  # (R,), two's complement
    k0 = (k & np.uint64(0xFFFFFFFF)).astype(np.uint32)[:, None]  # (R, 1)
    k1 = (k >> np.uint64(32)).astype(np.uint32)[:, None]  # (R, 1)
    x = _mix32(np.arange(vocab, dtype=np.uint32)[None, :] ^ k0)  # (R, V)
    x = _mix32(x + k1)
    u = (x >> np.uint32(9)).astype(np.float32) * np.float32(2.0**-23) + np.float32(2.0**-24)
    return torch.from_numpy(-np.log(u))


def draw(logits: torch.Tensor, params: list[SamplingParams], keys: torch.Tensor) -> list[int]:
    """One token per row of ``(R, V)`` float32 logits with its sampling parameters (temperature > 0)
    and noise key ``keys[r]`` (``(R,)`` int64): the filters of :func:`_filtered_probs`, then the race
    ``argmax p / race_noise`` (lowest id on ties). A row with a NaN logit, or with nothing kept (every
    logit -inf), gives ``argmax``'s answer (the first NaN, else the first maximum). The compiled kernel
    when the kernels are on, else PyTorch."""
    if sample_kernel.enabled():
        return sample_kernel.sample_rows(
            logits if logits.stride(1) == 1 else logits.contiguous(), [p.temperature for p in params],
            [p.top_k for p in params], [p.top_p for p in params], [p.min_p for p in params], keys)
    probs = _filtered_probs(logits, params)  # (R, V)
    drawn = (probs / race_noise(keys, probs.shape[1])).nan_to_num_(nan=-1.0).argmax(dim=-1).tolist()
    empty = (~(probs > 0).any(dim=-1)).nonzero().squeeze(1).tolist()  # nothing kept: argmax's answer
    for r in empty:
        drawn[r] = greedy_ids(logits[r:r + 1])[0]
    return drawn


def greedy_ids(logits: torch.Tensor) -> list[int]:
    """Each row's argmax of ``(N, V)`` logits, the first maximum on ties and the first NaN if a row has
    one (``torch.argmax``'s rule, which numpy's argmax shares). A float32 CPU tensor goes through numpy:
    torch's argmax of one 49,152-logit row took ~200 us here (its reduction wakes the thread pool),
    numpy's single pass ~10 us, per decoded token."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def compute_logprobs(
    logits: torch.Tensor, token_ids: list[int], top_k: int
) -> list[list[tuple[int, float, int]]]:
    """Logprobs of given tokens plus each row's top-k, from the raw log-softmax of the logits.

    Also used for prompt logprobs: pass the logits of prompt positions and the actual next tokens.
    The compiled kernel when the kernels are on (``sample_kernel.logprobs_rows``: each logprob rounded
    once from a double log Z, within 1 float32 ulp plus 2.4e-7 of a float64 log-softmax; ranks counted
    on the logits; 64 rows of 49,152 in ~2 ms where PyTorch took ~40 here), else PyTorch; a row with a
    NaN or +inf logit takes PyTorch's path.

    Args:
        logits: (N, V) logits.
        token_ids: N token ids, one per row.
        top_k: how many top (id, logprob) pairs to add per row, >= 0.

    Returns:
        N lists of ``(token id, logprob, rank)``: ``token_ids[i]`` first, then the ``top_k`` most likely
        by descending logprob (ranks 1..top_k; ties: the lower id first in the kernel). A rank counts
        the tokens at least as likely (vLLM's).

    Raises:
        ValueError: when ``len(token_ids)`` differs from N or ``top_k`` is negative.
    """
    if logits.dim() != 2 or len(token_ids) != logits.shape[0]:
        raise ValueError(f"need (N, V) logits and N token ids, got {tuple(logits.shape)}, {len(token_ids)}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    logits = logits.float()
    k = min(top_k, logits.shape[1])
    if sample_kernel.enabled() and logits.device.type == "cpu" and logits.shape[0] > 0:
        rows = logits if logits.stride(1) == 1 else logits.contiguous()
        got = sample_kernel.logprobs_rows(rows, token_ids, k)
        if got is not None:  # None: a row with a NaN or +inf logit, which log_softmax below answers
            chosen, ranks, top_vals, top_ids = got
            return _logprob_rows(token_ids, chosen, ranks, top_ids.tolist(), top_vals.tolist())
    logp = torch.log_softmax(logits, dim=-1)  # (N, V)
    ids = torch.tensor(token_ids, dtype=torch.long).unsqueeze(1)  # (N, 1)
    chosen_t = logp.gather(1, ids)  # (N, 1)
    # vLLM's rank: how many tokens are at least as likely as the chosen one (1 = the most likely)
    ranks = (logp >= chosen_t).sum(dim=-1).tolist()  # (N,)
    chosen = chosen_t.squeeze(1).tolist()  # (N,)
    top_vals, top_ids = logp.topk(k, dim=-1)  # (N, k), descending
    return _logprob_rows(token_ids, chosen, ranks, top_ids.tolist(), top_vals.tolist())


def _logprob_rows(token_ids: list[int], chosen: list[float], ranks: list[int], top_ids: list[list[int]],
                  top_vals: list[list[float]]) -> list[list[tuple[int, float, int]]]:
    """``compute_logprobs``' rows from its per-row figures."""
    rows: list[list[tuple[int, float, int]]] = []
    for tok, lp, rank, t_ids, t_vals in zip(token_ids, chosen, ranks, top_ids, top_vals, strict=True):
        rows.append([(tok, lp, rank), *((t, v, r + 1) for r, (t, v) in enumerate(zip(t_ids, t_vals,
                                                                                        strict=True)))])
    return rows


def _check_batch(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int | None], output_indices: list[int]
) -> int:
    if logits.dim() != 2:
        raise ValueError(f"logits must be (N, V), got shape {tuple(logits.shape)}")
    n = logits.shape[0]
    if not len(params) == len(seeds) == len(output_indices) == n:
        raise ValueError(
            f"{n} logit rows but {len(params)} params, {len(seeds)} seeds, {len(output_indices)} indices"
        )
    return n


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k on logits, softmax, then top-p and min-p on the probabilities.

    Args:
        logits: (R, V) logits of the sampled (non-greedy) rows.
        params: R sampling parameters.

    Returns:
        (R, V) probabilities with filtered-out tokens at exactly 0 (not renormalized after top-p and
        min-p; the draw does not need it).
    """
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)  # (R, 1)
    scaled = logits / temps  # (R, V)
    vocab = scaled.shape[1]
    _apply_top_k(scaled, [p.top_k if 0 < p.top_k < vocab else 0 for p in params])
    probs = torch.softmax(scaled, dim=-1)  # (R, V)
    _apply_top_p(probs, [p.top_p for p in params])
    _apply_min_p(probs, [p.min_p for p in params])
    return probs


def _apply_top_k(scaled: torch.Tensor, top_ks: list[int]) -> None:
    """In place: set logits below each row's k-th largest to -inf (ties at the k-th are kept)."""
    rows = [i for i, k in enumerate(top_ks) if k > 0]
    if not rows:
        return
    sub = scaled[rows]  # (Rk, V)
    ks = torch.tensor([top_ks[i] for i in rows]).unsqueeze(1)  # (Rk, 1)
    top_vals, _ = sub.topk(int(ks.max()), dim=-1)  # (Rk, kmax), descending
    kth = top_vals.gather(1, ks - 1)  # (Rk, 1)
    scaled[rows] = sub.masked_fill(sub < kth, float("-inf"))


def _apply_top_p(probs: torch.Tensor, top_ps: list[float]) -> None:
    """In place: keep the smallest set of most likely tokens whose mass reaches top_p (at least one).

    A token survives when the mass of the tokens sorted before it is below ``top_p`` (vLLM's rule); the
    most likely one always does; equal probabilities are in id order (the compiled kernel's rule).
    Only rows with ``top_p < 1`` are touched. A full-vocabulary sort costs ~28 ms for 16 x 49,152
    rows on 2 cores, so the nucleus is first looked for among the top ``TOP_P_CANDIDATES`` tokens
    (same cumulative sums, so the same result); rows whose nucleus is larger fall back to the sort.
    """
    rows = [i for i, p in enumerate(top_ps) if p < 1.0]
    if not rows:
        return
    sub = probs[rows]  # (Rp, V)
    limit = torch.tensor([top_ps[i] for i in rows], dtype=probs.dtype).unsqueeze(1)  # (Rp, 1)
    top_vals, top_ids = sub.topk(min(TOP_P_CANDIDATES, sub.shape[1]), dim=-1)  # (Rp, K), descending
    # Equal probabilities in id order (topk leaves their order open): the compiled kernel's tie rule.
    top_ids, by_id = top_ids.sort(dim=-1)
    top_vals, by_value = top_vals.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    top_ids = top_ids.gather(1, by_value)
    mass = top_vals.cumsum(dim=-1)  # (Rp, K)
    drop = mass - top_vals >= limit  # (Rp, K)
    drop[:, 0] = False  # the top token stays even when top_p rounds to 0 in float32 (1e-46), as in vLLM
    kept = torch.zeros_like(sub).scatter_(1, top_ids, top_vals.masked_fill(drop, 0.0))
    uncovered = (mass[:, -1:] < limit).squeeze(1).nonzero().squeeze(1).tolist()
    if uncovered:
        kept[uncovered] = _top_p_by_sort(sub[uncovered], limit[uncovered])
    probs[rows] = kept


def _top_p_by_sort(probs: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """(R, V) probabilities with tokens outside each row's nucleus zeroed; ``limit`` is (R, 1)."""
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)  # (R, V), equal ones in id order
    drop = sorted_p.cumsum(dim=-1) - sorted_p >= limit  # (R, V): the mass before each token reaches top_p
    drop[:, 0] = False
    return probs.scatter(1, order, sorted_p.masked_fill(drop, 0.0))


def _apply_min_p(probs: torch.Tensor, min_ps: list[float]) -> None:
    """In place: zero tokens whose probability is below min_p times the row's top probability."""
    rows = [i for i, m in enumerate(min_ps) if m > 0.0]
    if not rows:
        return
    sub = probs[rows]  # (Rm, V)
    scale = torch.tensor([min_ps[i] for i in rows], dtype=probs.dtype).unsqueeze(1)  # (Rm, 1)
    threshold = sub.amax(dim=-1, keepdim=True) * scale  # (Rm, 1)
    probs[rows] = sub.masked_fill(sub < threshold, 0.0)


def _row_logprobs(
    logits: torch.Tensor, params: list[SamplingParams], token_ids: list[int], n: int
) -> list[list[tuple[int, float, int]]] | None:
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    top_k = max(params[i].logprobs or 0 for i in rows)
    computed = compute_logprobs(logits[rows], [token_ids[i] for i in rows], top_k)
    out: list[list[tuple[int, float, int]]] = [[] for _ in range(n)]
    for i, row in zip(rows, computed, strict=True):
        out[i] = row[: 1 + (params[i].logprobs or 0)]
    return out
