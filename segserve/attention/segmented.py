"""Segmented attention over a paged KV cache (seed 000, "Kernel Interface", "Partial KV Segment Handling").

Each request's queries attend to its ``prior_tokens`` cached tokens, walked through its block table in
segments of ``kv_segment_size`` tokens, plus causally to the step's own active tokens. Each piece yields
a normalised partial output and its log-sum-exp; pieces combine by log-sum-exp rescaling, the split-KV
form of the online softmax (Dao et al., FlashAttention, 2022; "Flash-Decoding", 2023).

Beyond the seed's temporary constraints: any query length, any prior length (the last segment may end
mid-block), one prior per request, any block size dividing the segment size. Which segments each call
covers, and which blocks it reads in place, is the torch-free plan in ``segserve.attention.plan``; this
module builds the plan's tensors once per step and runs it.

Two paths:

* chunks (query length > 1): few per step, looped over in Python. The causal part is one call; the
  full prior segments are batched into one call as ``[S, Hkv, seg, D]`` (each segment its own batch
  entry, so its own log-sum-exp), and the partial last segment is one more call over just its valid
  tokens, which is how it is masked. GQA costs no K/V repeat: the query heads of a KV head are folded
  into the query length (``[Hkv, G * Tq, D]``), valid wherever no mask depends on the query position,
  i.e. for the prior segments. Very long priors go in several batches, merged online.
* decodes (query length 1): many per step, batched. A decode's own K/V is in the cache once written,
  so it walks ``prior + 1`` cached tokens and has no separate causal part. Sorted by that length
  (longest first), segment ``s`` is computed for the prefix of decodes that reach into it, so short
  requests do not pay for the longest; an additive mask hides the slots past each one's end in a
  partial segment. A batch of decodes that fits in one segment is one gather and one attention call.

On CPU the per-piece attention is ``aten._scaled_dot_product_flash_attention_for_cpu``, which returns
(output, logsumexp) and accumulates in float32 for bfloat16 inputs; elsewhere a float32 matmul path.
Partial outputs are combined in float32.

With the compiled CPU kernels (``segserve.kernels.cpu``; float32/bfloat16 cache) the decodes take a third
form: one C call per layer walks every decode's blocks in place through the block table, one work
item per (decode, KV head, segment), merged by log-sum-exp. It never gathers, so interleaved blocks
cost nothing extra, and it has no per-segment dispatch; the plan then skips the decode calls.
With them (``segserve.kernels.chunk_attention``), the chunks too are one C call per layer: every
chunk's queries walk their prior and their own tokens in place through the block table,
``kv_segment_size`` tokens at a time with an online softmax; with a bfloat16 cache Q K^T and P V run on
AMX tiles, or in AVX-512 BF16 registers on CPUs without AMX, with a float32 cache in AVX-512F FMAs
(float32 throughout); no gather, no per-segment call, no Python-side merge. Shapes the kernel refuses
(``chunk_attention.supports``), and the kernel switched off (``SEGSERVE_CHUNK_ATTENTION=0``), keep the
SDPA path above.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from segserve.attention.kv_store import write_kv
from segserve.attention.metadata import AttentionMetadata
from segserve.attention.plan import (
    MAX_GATHER_TOKENS,
    MAX_PARTIAL_ELEMENTS,
    DecodeCall,
    chunk_batches,
    consecutive_run,
    decode_order,
    num_kv_segments,
    segments_per_call,
)
from segserve.attention.plan import decode_calls as plan_decode_calls
from segserve.kernels import chunk_attention as chunk_kernels
from segserve.kernels import cpu as cpu_kernels

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool = False,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns the log-sum-exp of each query's scores.

    Args:
        q: ``[B, Hq, Lq, D]``.
        k, v: ``[B, Hk, Lk, D]`` (any strides), ``Hq`` a multiple of ``Hk``; query head ``h`` reads KV
            head ``h // (Hq // Hk)``.
        scale: multiplies ``q @ k^T``.
        causal: query ``i`` sees keys ``j <= i`` (top-left aligned; used with ``Lq == Lk``).
        mask: additive ``[B, 1, 1, Lk]`` (0 or -inf) in q's dtype, or None. Every query must see at
            least one key.

    Returns:
        (output ``[B, Hq, Lq, D]`` in q's dtype on CPU, float32 elsewhere; lse ``[B, Hq, Lq]`` float32).
    """
    if q.device.type == "cpu" and _CPU_FLASH is not None:
        out, lse = _CPU_FLASH(q, k, v, is_causal=causal, attn_mask=mask, scale=scale)
        return out, lse.float()
    return attention_with_lse_math(q, k, v, scale, causal, mask)


def attention_with_lse_math(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool = False,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`attention_with_lse`, in plain float32 matmuls (any device)."""
    b, hq, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    qf = q.float().reshape(b, hk, (hq // hk) * lq, d)  # (B, Hk, G*Lq, D): query group folded
    scores = torch.matmul(qf, k.float().transpose(-1, -2)) * scale  # (B, Hk, G*Lq, Lk)
    if mask is not None:
        scores = scores + mask.float()
    if causal:
        q_pos = torch.arange(qf.shape[2], device=q.device) % lq
        hidden = torch.arange(lk, device=q.device)[None, :] > q_pos[:, None]  # (G*Lq, Lk)
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hk, G*Lq)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float())  # (B, Hk, G*Lq, D)
    return out.reshape(b, hq, lq, d), lse.reshape(b, hq, lq)


def merge_partials(acc_o: torch.Tensor, acc_lse: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold one partial result into a running one, in place (log-sum-exp rescaling).

    With ``L = logaddexp(acc_lse, lse)``: ``acc_o = acc_o * exp(acc_lse - L) + o * exp(lse - L)``, which
    is softmax attention over the union of both key sets (FlashAttention's online softmax, applied to
    normalised partials as in split-KV decoding).

    Args:
        acc_o: ``[..., L, D]`` float32, updated in place (may be a view).
        acc_lse: ``[..., L]`` float32, updated in place; must be finite.
        o: ``[..., L, D]`` any float dtype; lse: ``[..., L]`` float32.
    """
    total = torch.logaddexp(acc_lse, lse)
    # The weights are small ([..., L]); only the two in-place ops below touch [..., L, D].
    acc_o.mul_((acc_lse - total).exp_().unsqueeze(-1))
    acc_o.addcmul_(o, (lse - total).exp_().unsqueeze(-1))
    acc_lse.copy_(total)


def combine_partials(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine partial results over disjoint key sets into one (log-sum-exp rescaling).

    ``out = sum_k o_k * exp(lse_k - L)`` with ``L = logsumexp_k(lse_k)``: the same algebra as
    :func:`merge_partials`, for many parts at once (several segments computed in one batched call).

    Args:
        parts: ``(o [S_k, H, L, D], lse [S_k, H, L] float32)`` pairs; every part's rows are partials
            of the same queries. The tensors are consumed (may be overwritten).

    Returns:
        (o ``[1, H, L, D]`` float32, lse ``[1, H, L]`` float32).
    """
    total = torch.logsumexp(torch.cat([lse for _, lse in parts]), dim=0, keepdim=True)  # (1, H, L)
    out = None
    for o, lse in parts:
        weighted = o.float().mul_((lse - total).exp_().unsqueeze(-1))  # (S_k, H, L, D)
        part = weighted if weighted.shape[0] == 1 else weighted.sum(0, keepdim=True)
        out = part if out is None else out.add_(part)
    return out, total


@dataclass(frozen=True)
class _DecodeCall:
    """A plan call (:class:`~segserve.attention.plan.DecodeCall`) with its tensors.

    ``kv_rows`` ``[2 * (last - first) * blocks]`` are the cache rows to copy (:func:`kv_rows` of the
    blocks, request-major), None when ``plan.run`` says they are read in place. ``mask`` is the
    additive ``[last - first, 1, 1, blocks * block_size]`` mask, None when every slot is valid or when
    the call has one decode, whose K/V are instead cut to its ``tokens`` valid slots (no mask to apply).
    """

    plan: DecodeCall
    kv_rows: torch.Tensor | None
    mask: torch.Tensor | None
    tokens: int


@dataclass(frozen=True)
class _StepPlan:
    """What a step's metadata implies for every layer: built once, reused by all layers."""

    decode_rows: torch.Tensor  # (n_decodes,) int64 batch rows, longest prior first
    decode_reqs: torch.Tensor  # (n_decodes,) int64 block-table rows, same order
    decode_lens: torch.Tensor  # (n_decodes,) int64 cached tokens each walks (prior + its own)
    decode_calls: tuple[_DecodeCall, ...]  # empty when planned for the compiled kernel
    chunks: tuple[int, ...]  # requests with query length > 1
    # (starts, query lens, priors, block-table rows) of the chunks, (n_chunks,) int64 each: the
    # compiled chunk kernel's arguments.
    chunk_args: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    # Every row of the step is a decode and they are already in walk order (batch 1 is): the decode
    # result is the layer's output as it stands, with no scatter into a zeroed buffer.
    decodes_fill_step: bool


class SegmentedAttentionBackend:
    """The product kernel: segment-wise attention over the paged cache, LSE-combined.

    Holds a per-step plan (keyed on the metadata object) and a gather workspace, so an instance serves
    one model (one thread) at a time.
    """

    name = "segmented"

    def __init__(
        self, max_gather_tokens: int = MAX_GATHER_TOKENS, max_partial_elements: int = MAX_PARTIAL_ELEMENTS
    ) -> None:
        self.max_gather_tokens = max_gather_tokens
        self.max_partial_elements = max_partial_elements
        self._plan_key: tuple | None = None
        self._plan: _StepPlan | None = None
        self._workspace: torch.Tensor | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        kv_written: bool = False,
    ) -> torch.Tensor:
        """Write the step's K/V to the cache (unless ``kv_written``: a fused projection wrote them), then
        attend each request to its prior segments + itself.

        Args:
            q: ``[T_padded, Hq, D]`` queries of the step's active tokens (RoPE applied).
            k, v: ``[T_padded, Hkv, D]``; ``Hq`` is a multiple of ``Hkv``.
            kv_cache: ``[2, num_blocks, block_size, Hkv, D]``, written in place at ``slot_mapping``.
            metadata: the step's attention metadata (``kv_segment_size`` a multiple of ``block_size``).
            scale: softmax scale (usually ``D ** -0.5``).

        Returns:
            ``[T_padded, Hq, D]`` in q's dtype; padding rows are zeros.

        Batched decodes read whole blocks and mask the slots past each one's end; masked slots are
        multiplied by 0, so the cache must hold finite values there (allocate it zero-filled, as
        ``kv_store.new_kv_cache`` does).

        Raises:
            ValueError: when ``kv_segment_size`` is not a positive multiple of the cache's block size.
        """
        if not kv_written:
            write_kv(kv_cache, k, v, metadata.slot_mapping)
        compiled = cpu_kernels.enabled() and cpu_kernels.supports_cache(kv_cache, q.dtype, q.shape[1])
        plan = self._step_plan(metadata, kv_cache, compiled)
        if compiled:  # the decodes in one C call (q is already in the cache dtype)
            chunk_kernel = bool(plan.chunks) and chunk_kernels.supports(q, kv_cache)
            if chunk_kernel or not plan.chunks:
                # The kernels write every real row (each is a decode's or a chunk's): only the padding
                # rows must be zeroed, not all of them (a 256-token step: 30 zero-fills of 295 KB; a
                # step the decodes fill, plan.decodes_fill_step, has none).
                out = torch.empty(q.shape, dtype=q.dtype)
                if metadata.num_actual_tokens < q.shape[0]:
                    out[metadata.num_actual_tokens:].zero_()
            else:
                out = torch.zeros(q.shape, dtype=q.dtype)
            cpu_kernels.decode_attention(
                q, out, plan.decode_rows, kv_cache, metadata.block_table, plan.decode_reqs, plan.decode_lens,
                metadata.kv_segment_size, scale,
            )
            if chunk_kernel:  # every chunk in one C call
                chunk_kernels.chunk_attention(
                    q, out, kv_cache, metadata.block_table, *plan.chunk_args, metadata.kv_segment_size, scale
                )
                return out
            return self._chunks_into(out, q, k, v, kv_cache, metadata, plan, scale)
        out_dtype, cdtype = q.dtype, kv_cache.dtype
        q, k, v = q.to(cdtype), k.to(cdtype), v.to(cdtype)
        if plan.decodes_fill_step:
            return self._decode_result(q, kv_cache, plan, scale).view(q.shape).to(out_dtype)
        out = torch.zeros_like(q, dtype=out_dtype)
        if plan.decode_rows.numel():
            result = self._decode_result(q, kv_cache, plan, scale)  # (n, Hkv, G, D) float32
            out.index_copy_(0, plan.decode_rows, result.view(-1, *q.shape[1:]).to(out.dtype))
        return self._chunks_into(out, q, k, v, kv_cache, metadata, plan, scale)

    def _chunks_into(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        plan: _StepPlan,
        scale: float,
    ) -> torch.Tensor:
        """Each chunk's attention into its rows of ``out`` (returned)."""
        qsl, seg = metadata.query_start_loc_cpu, metadata.kv_segment_size
        for i in plan.chunks:
            r0, r1 = qsl[i], qsl[i + 1]
            out[r0:r1] = self._chunk(
                q[r0:r1], k[r0:r1], v[r0:r1], kv_cache, metadata.block_table[i], metadata.prior_tokens_cpu[i],
                seg, scale,
            )
        return out

    # --- chunks (query length > 1) -------------------------------------------------------------------

    def _chunk(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        block_row: torch.Tensor,
        prior: int,
        seg: int,
        scale: float,
    ) -> torch.Tensor:
        """One request: q ``[Tq, Hq, D]``, k/v ``[Tq, Hkv, D]`` -> ``[Tq, Hq, D]`` (float32 or q's dtype).

        Full segments are computed in batches (one attention call over ``[S, Hkv, seg, D]``), each
        batch LSE-combined with the running result: an online softmax over batches of segments.
        """
        tq, hq, d = q.shape
        hkv = k.shape[1]
        qh = q.transpose(0, 1).contiguous().unsqueeze(0)  # (1, Hq, Tq, D)
        o, lse = attention_with_lse(qh, k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale, causal=True)
        # (1, Hq, Tq, ...) with Hq = (Hkv, G) is the folded (1, Hkv, G*Tq, ...) layout as it stands.
        running = (o.reshape(1, hkv, -1, d), lse.reshape(1, hkv, -1))  # (1, Hkv, G*Tq, D), (1, Hkv, G*Tq)
        q_folded = qh.view(1, hkv, -1, d)  # (1, Hkv, G*Tq, D)
        per_call = segments_per_call(seg, qh.numel(), self.max_gather_tokens, self.max_partial_elements)
        for start, end in chunk_batches(prior, seg, per_call):
            running = combine_partials(
                [running, *self._segment_partials(q_folded, kv_cache, block_row, start, end, seg, scale)]
            )
        return running[0].view(hq, tq, d).transpose(0, 1)

    def _segment_partials(
        self,
        q_folded: torch.Tensor,
        kv_cache: torch.Tensor,
        block_row: torch.Tensor,
        start: int,
        end: int,
        seg: int,
        scale: float,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Partials of the segments covering prior tokens ``[start, end)``: the full ones in one call,
        the partial last one (its valid tokens only, which is its mask) in another."""
        block_size = kv_cache.shape[2]
        first = start // block_size
        ids = block_row[first : first - (-(end - start) // block_size)]
        kv = self._gather_blocks(kv_cache, ids)
        kv = kv.flatten(1, 2)  # (2, n_blocks * block_size, Hkv, D)
        hkv, d = kv.shape[2:]
        full, rest = num_kv_segments(end - start, seg)
        parts = []
        if full:
            ks, vs = (kv[i, : full * seg].view(full, seg, hkv, d).transpose(1, 2) for i in (0, 1))
            parts.append(attention_with_lse(q_folded.expand(full, -1, -1, -1), ks, vs, scale))  # (S, ...)
        if rest:
            ks, vs = (kv[i, full * seg : full * seg + rest].transpose(0, 1)[None] for i in (0, 1))
            parts.append(attention_with_lse(q_folded, ks, vs, scale))  # (1, Hkv, rest, D) keys
        return parts

    def _gather_blocks(self, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """K and V of blocks ``block_ids`` ``(n_blocks,)`` as ``[2, n_blocks, block_size, Hkv, D]``: a
        view of the cache when they are consecutive ids (checked per layer, one ``tolist``), else a
        copy (:meth:`_copy_blocks`)."""
        n = block_ids.shape[0]
        run = consecutive_run([block_ids.tolist()], 0, n)
        if run is not None:  # consecutive block ids: the cache itself is the gathered tensor
            return kv_cache[:, run : run + n]  # (2, n_blocks, block_size, Hkv, D) view, no copy
        return self._copy_blocks(kv_cache, kv_rows(block_ids, kv_cache.shape[1]))

    def _copy_blocks(self, kv_cache: torch.Tensor, kv_block_ids: torch.Tensor) -> torch.Tensor:
        """Copy rows ``kv_block_ids`` into a reused workspace -> ``[2, n_blocks, block_size, Hkv, D]``.

        One ``index_select`` over dim 0 gathers K and V together and runs in parallel (a dim-1 select
        over ``[2, num_blocks, ...]`` runs serially, twice as slow for large gathers here). Reusing the
        workspace matters: a fresh multi-megabyte tensor per call costs page faults that take longer
        than the gather itself.
        """
        shape = (2, kv_block_ids.shape[0] // 2, *kv_cache.shape[2:])
        numel = kv_block_ids.shape[0] * kv_cache[0, 0].numel()
        ws = self._workspace
        if ws is None or ws.numel() < numel or ws.dtype != kv_cache.dtype or ws.device != kv_cache.device:
            ws = torch.empty(numel, dtype=kv_cache.dtype, device=kv_cache.device)
            self._workspace = ws
        rows = kv_cache.flatten(0, 1)  # (2 * num_blocks, block_size, Hkv, D)
        torch.index_select(rows, 0, kv_block_ids, out=ws[:numel].view(-1, *kv_cache.shape[2:]))
        return ws[:numel].view(shape)

    # --- decodes (query length 1) --------------------------------------------------------------------

    def _decode_result(
        self, q: torch.Tensor, kv_cache: torch.Tensor, plan: _StepPlan, scale: float
    ) -> torch.Tensor:
        """All decodes of the step at once: ``[n, Hkv, G, D]`` (float32, or q's dtype for a single
        call), row ``j`` for batch row ``plan.decode_rows[j]``.

        A decode's own K/V is already in the cache (slot ``prior``), so its causal part is just one
        more cached token: the walk covers ``prior + 1`` tokens and needs no separate self-attention.
        """
        rows, hkv, calls = plan.decode_rows, kv_cache.shape[3], plan.decode_calls
        n, hq, d = rows.shape[0], q.shape[1], q.shape[2]
        qd = q[:n] if plan.decodes_fill_step else q.index_select(0, rows)
        qd = qd.view(n, hkv, hq // hkv, d)  # (n, Hkv, G, D): the query group as query length
        if len(calls) == 1:  # one segment, one gather: nothing to combine
            return self._decode_call(qd, kv_cache, calls[0], scale)[0]
        result = torch.empty(n, hkv, hq // hkv, d, dtype=torch.float32, device=q.device)
        acc_lse = torch.empty(n, hkv, hq // hkv, dtype=torch.float32, device=q.device)
        for call in calls:
            o, lse = self._decode_call(qd, kv_cache, call, scale)
            part = slice(call.plan.first, call.plan.last)
            if call.plan.start == 0:  # the first segment covers every decode: it opens the walk
                result[part], acc_lse[part] = o, lse
            else:
                merge_partials(result[part], acc_lse[part], o, lse)
        return result

    def _decode_call(
        self, qd: torch.Tensor, kv_cache: torch.Tensor, call: _DecodeCall, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial (output ``[n_call, Hkv, G, D]``, lse ``[n_call, Hkv, G]``) of one decode call."""
        ks, vs = self._gather_decode_call(kv_cache, call)
        return attention_with_lse(qd[call.plan.first : call.plan.last], ks, vs, scale, mask=call.mask)

    def _gather_decode_call(
        self, kv_cache: torch.Tensor, call: _DecodeCall
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of one decode call as ``[n_call, Hkv, blocks * block_size, D]`` views of the workspace."""
        hkv, d = kv_cache.shape[3:]
        c = call.plan
        n_call = c.last - c.first
        if c.run is not None:  # consecutive blocks (known from the plan): the cache itself, no copy
            kv = kv_cache[:, c.run : c.run + n_call * c.blocks]
        else:
            kv = self._copy_blocks(kv_cache, call.kv_rows)
        kv = kv.reshape(2, n_call, -1, hkv, d)[:, :, : call.tokens]  # (2, n, L, Hkv, D)
        return kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # (n_call, Hkv, L, D) each

    # --- per-step plan -------------------------------------------------------------------------------

    def _step_plan(self, metadata: AttentionMetadata, kv_cache: torch.Tensor, compiled: bool) -> _StepPlan:
        """The plan for this step, built on the first layer and reused by the others."""
        # The key holds the metadata object itself, so its id cannot be recycled while cached.
        key = (metadata, kv_cache.dtype, kv_cache.device, kv_cache.shape, compiled)
        if self._plan_key is None or self._plan_key[0] is not metadata or self._plan_key[1:] != key[1:]:
            self._plan = build_step_plan(
                metadata, kv_cache, self.max_gather_tokens, decode_calls=not compiled
            )
            self._plan_key = key
        return self._plan


def kv_rows(block_ids: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Rows of ``kv_cache.flatten(0, 1)`` holding the K blocks, then the V blocks, of ``block_ids``."""
    block_ids = block_ids.long()
    return torch.cat([block_ids, block_ids + num_blocks])


def build_step_plan(
    metadata: AttentionMetadata, kv_cache: torch.Tensor, max_gather_tokens: int, decode_calls: bool = True
) -> _StepPlan:
    """Split the step's requests into batched decodes and looped chunks; plan the decode gathers
    (unless ``decode_calls`` is False: the compiled kernel walks the block table itself).

    Reads only the shape, dtype and device of ``kv_cache``, so one plan serves every layer.

    Raises:
        ValueError: when ``kv_segment_size`` is not a positive multiple of ``block_size``.
    """
    seg, (num_blocks, block_size) = metadata.kv_segment_size, kv_cache.shape[1:3]
    if seg < block_size or seg % block_size:
        raise ValueError(f"kv_segment_size={seg} must be a positive multiple of block_size={block_size}")
    qlens = metadata.query_lens_cpu
    decodes, walk = decode_order(qlens, metadata.prior_tokens_cpu)
    device = metadata.block_table.device
    rows = torch.tensor([metadata.query_start_loc_cpu[i] for i in decodes], dtype=torch.long, device=device)
    reqs = torch.tensor(decodes, dtype=torch.long, device=device)
    calls: list[_DecodeCall] = []
    if decodes and decode_calls:
        # Only the columns the longest walk reaches: one tolist for all the plan's in-place checks.
        table = metadata.block_table.index_select(0, reqs)[:, : -(-walk[0] // block_size)].long()
        for c in plan_decode_calls(walk, table.tolist(), block_size, seg, max_gather_tokens):
            kv = None
            if c.run is None:
                ids = table[c.first : c.last, c.first_block : c.first_block + c.blocks].reshape(-1)
                kv = kv_rows(ids, num_blocks)
            if c.last - c.first == 1:  # one decode: cut its K/V to the valid slots instead of masking
                mask, tokens = None, c.valid[0]
            else:
                width = c.blocks * block_size
                mask, tokens = _tail_mask(c.valid, width, kv_cache.dtype, kv_cache.device), width
            calls.append(_DecodeCall(c, kv, mask, tokens))
    chunks = tuple(i for i, n in enumerate(qlens) if n > 1)
    qsl, priors = metadata.query_start_loc_cpu, metadata.prior_tokens_cpu
    columns = ([qsl[i] for i in chunks], [qlens[i] for i in chunks], [priors[i] for i in chunks], chunks)
    chunk_args = tuple(torch.tensor(c, dtype=torch.long) for c in columns) if chunks else _NO_CHUNKS
    fill = not chunks and len(decodes) == metadata.num_padded_tokens and decodes == sorted(decodes)
    return _StepPlan(
        decode_rows=rows, decode_reqs=reqs, decode_lens=torch.tensor(walk, dtype=torch.long, device=device),
        decode_calls=tuple(calls), chunks=chunks, chunk_args=chunk_args, decodes_fill_step=fill,
    )


# (starts, query lens, priors, block-table rows) of a step without chunks; request i is table row i.
_NO_CHUNKS = tuple(torch.zeros(0, dtype=torch.long) for _ in range(4))


def _tail_mask(valid: list[int], width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """Additive ``[n, 1, 1, width]`` mask hiding slots ``>= valid[r]`` of row r; None when all are valid."""
    if all(n == width for n in valid):
        return None
    hidden = torch.arange(width, device=device)[None, :] >= torch.tensor(valid, device=device)[:, None]
    mask = torch.zeros(len(valid), 1, 1, width, dtype=dtype, device=device)
    return mask.masked_fill_(hidden[:, None, None, :], float("-inf"))
