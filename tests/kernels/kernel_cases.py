"""Builders for kernel tests: a paged cache holding random priors, and a contiguous SDPA oracle."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from segserve.attention.kv_store import write_kv
from segserve.attention.metadata import AttentionMetadata, build_attention_metadata
from segserve.attention.segment_walk import segment_walk
from segserve.kernels import chunk_attention as ca

torch.set_num_threads(2)


@dataclass
class Case:
    """One step's attention inputs.

    Attributes:
        q, k, v: ``[T_padded, H, D]`` (q: Hq heads, k/v: Hkv heads).
        cache: ``[2, num_blocks, block_size, Hkv, D]``; block 0 zero, every other slot random (so a
            kernel reading an unmasked stale slot gives a wrong answer).
        metadata: built from shuffled, non-contiguous block ids (never 0).
        scale: softmax scale, ``D ** -0.5``.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cache: torch.Tensor
    metadata: AttentionMetadata
    scale: float


def make_case(
    query_lens: list[int],
    priors: list[int],
    *,
    block_size: int,
    seg: int,
    heads: tuple[int, int] = (9, 3),
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    pad: int = 0,
    seed: int = 0,
    consecutive_blocks: bool = False,
) -> Case:
    """A step whose requests own shuffled blocks (or, with ``consecutive_blocks``, ascending runs of
    ids, as a pool hands them to requests that allocate alone); ``pad`` extra rows of random padding
    queries."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    needed = [-(-(p + n) // block_size) for p, n in zip(priors, query_lens, strict=True)]
    num_blocks = sum(needed) + 5  # spare blocks that no request owns
    order = torch.arange(num_blocks) if consecutive_blocks else torch.randperm(num_blocks, generator=gen)
    ids = (order + 1).tolist()
    rows, used = [], 0
    for n in needed:
        rows.append(ids[used : used + n])
        used += n
    tokens = sum(query_lens)
    metadata = build_attention_metadata(
        query_lens, priors, rows, block_size, max(needed, default=0) + 3, seg, num_padded_tokens=tokens + pad
    )
    cache = torch.randn(2, num_blocks + 1, block_size, hkv, head_dim, generator=gen).to(dtype)
    cache[:, 0] = 0
    rows_total = tokens + pad
    q = torch.randn(rows_total, hq, head_dim, generator=gen).to(dtype)
    k = torch.randn(rows_total, hkv, head_dim, generator=gen).to(dtype)
    v = torch.randn(rows_total, hkv, head_dim, generator=gen).to(dtype)
    return Case(q, k, v, cache, metadata, head_dim**-0.5)


def chunk_tensors(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``chunk_attention``'s ``(starts, query_lens, priors, reqs)`` for every request of the case (all
    taken as chunks, whatever their length): ``(n,)`` int64 each."""
    md = case.metadata
    qsl = md.query_start_loc_cpu
    starts = torch.tensor(qsl[:-1], dtype=torch.int64)
    lens = torch.tensor([qsl[i + 1] - qsl[i] for i in range(md.num_reqs)], dtype=torch.int64)
    priors = torch.tensor(md.prior_tokens_cpu, dtype=torch.int64)
    return starts, lens, priors, torch.arange(md.num_reqs, dtype=torch.int64)


def contiguous_prior(cache: torch.Tensor, row: list[int], prior: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's prior K, V ``[prior, Hkv, D]`` read slot by slot from the cache (no block gather)."""
    block_size = cache.shape[2]
    flat = cache.flatten(1, 2)  # (2, slots, Hkv, D)
    slots = [row[t // block_size] * block_size + t % block_size for t in range(prior)]
    index = torch.tensor(slots, dtype=torch.long)
    return flat[0, index], flat[1, index]


def sdpa_oracle(case: Case, cache_before: torch.Tensor) -> torch.Tensor:
    """Plain SDPA per request on contiguous float32 K/V (prior + active), GQA by repeating K/V.

    Returns ``[T_padded, Hq, D]`` float32 with zero padding rows.
    """
    md = case.metadata
    out = torch.zeros(case.q.shape, dtype=torch.float32)
    qsl = md.query_start_loc_cpu
    for i, prior in enumerate(md.prior_tokens_cpu):
        r0, r1 = qsl[i], qsl[i + 1]
        row = md.block_table[i].tolist()
        pk, pv = contiguous_prior(cache_before, row, prior)
        keys = torch.cat([pk, case.k[r0:r1]]).float()  # (S, Hkv, D)
        values = torch.cat([pv, case.v[r0:r1]]).float()  # (S, Hkv, D)
        group = case.q.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)[None]  # (1, Hq, S, D)
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)[None]  # (1, Hq, S, D)
        query = case.q[r0:r1].float().transpose(0, 1)[None]  # (1, Hq, Tq, D)
        visible = torch.ones(r1 - r0, prior + r1 - r0, dtype=torch.bool).tril(diagonal=prior)
        o = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=case.scale)
        out[r0:r1] = o[0].transpose(0, 1)
    return out


def walk_oracle(case: Case, cache: torch.Tensor) -> torch.Tensor:
    """:func:`segment_walk` per request over ``cache`` (which must hold every prior token; the step's
    own K/V come from ``case``): ``[T_padded, Hq, D]`` float32 with zero padding rows."""
    md = case.metadata
    out = torch.zeros(case.q.shape, dtype=torch.float32)
    qsl = md.query_start_loc_cpu
    for i, prior in enumerate(md.prior_tokens_cpu):
        r0, r1 = qsl[i], qsl[i + 1]
        out[r0:r1] = segment_walk(
            case.q[r0:r1], case.k[r0:r1], case.v[r0:r1], cache, md.block_table[i], prior,
            md.kv_segment_size, case.scale,
        )
    return out


def at_thread_counts(run, *counts: int) -> list:
    """``run()`` once at each of ``counts`` torch / OpenMP thread counts (in order), the caller's count
    restored after: the kernels' same-bits-at-any-thread-count tests."""
    old = torch.get_num_threads()
    try:
        out = []
        for n in counts:
            torch.set_num_threads(n)
            out.append(run())
        return out
    finally:
        torch.set_num_threads(old)


def assert_other_requests_untouched(case: Case) -> None:
    """The chunk kernel on ``case`` (two requests of 20 and 30 tokens) into an output filled with 7:
    the first request's rows, whose queries are not passed, keep it; the second's are all written."""
    md = case.metadata
    write_kv(case.cache, case.k, case.v, md.slot_mapping)
    out = torch.full_like(case.q, 7.0)
    starts, lens, priors, reqs = (t[1:] for t in chunk_tensors(case))
    ca.chunk_attention(case.q, out, case.cache, md.block_table, starts, lens, priors, reqs, 512, case.scale)
    assert torch.all(out[:20] == 7.0)
    assert not torch.any(out[20:50] == 7.0)

