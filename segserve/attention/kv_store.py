"""The paged KV cache of one layer: layout, writes through a slot mapping, reads through a block table.

Layout (one tensor per layer)::

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]   # index 0 = K, 1 = V

Block 0 is the null block: it never holds real data, and unused block-table columns point at it.
Token ``t`` of a request lives in slot ``block_table[t // block_size] * block_size + t % block_size``.
"""

from __future__ import annotations

import torch

from segserve.kernels import cpu as cpu_kernels


def new_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Allocate one layer's KV cache, zero-filled.

    Zeros rather than ``torch.empty`` because the segmented kernel's batched decode path reads whole
    blocks and masks the slots past each request's prior; masking multiplies them by 0, which is only
    harmless when they are finite.

    Returns:
        ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor of ``dtype``.

    Raises:
        ValueError: when ``num_blocks < 2`` (block 0 is the null block) or a dimension is < 1.
    """
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
    if min(block_size, num_kv_heads, head_dim) < 1:
        raise ValueError(f"bad cache shape: block_size={block_size}, heads={num_kv_heads}, dim={head_dim}")
    return torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the K/V of the step's real rows in their cache slots.

    Args:
        kv_cache: ``[2, num_blocks, block_size, Hkv, D]``, contiguous; written in place.
        k, v: ``[T_padded, Hkv, D]``; only the first ``len(slot_mapping)`` rows are written (padding
            rows write nowhere). Cast to the cache dtype.
        slot_mapping: ``[T]`` int64, slot (``block_id * block_size + offset``) of each real row.

    Raises:
        ValueError: when ``slot_mapping`` has more rows than ``k``.
    """
    num_real = slot_mapping.shape[0]
    if num_real > k.shape[0]:
        raise ValueError(f"slot_mapping has {num_real} rows but k has only {k.shape[0]}")
    if num_real == 0:
        return
    rows_fit = all(t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v))
    compiled = cpu_kernels.enabled() and cpu_kernels.supports_cache(kv_cache, k.dtype)
    if rows_fit and k.dtype == v.dtype and compiled:
        cpu_kernels.write_kv(kv_cache, k, v, slot_mapping)  # one call for K and V, no casts
        return
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)  # (2, slots, Hkv, D)
    slots = slot_mapping.to(device=kv_cache.device, dtype=torch.long)
    flat[0].index_copy_(0, slots, k[:num_real].to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, v[:num_real].to(kv_cache.dtype))


def gather_kv(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, start: int, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read ``num_tokens`` consecutive tokens of one request, starting at token ``start``.

    Args:
        kv_cache: ``[2, num_blocks, block_size, Hkv, D]``.
        block_ids: ``[max_blocks_per_seq]`` the request's block-table row.
        start: first token position; must be a multiple of ``block_size``.
        num_tokens: tokens to read (``>= 0``).

    Returns:
        (k, v), each ``[num_tokens, Hkv, D]`` in the cache dtype; copies, never aliasing the cache.

    Raises:
        ValueError: when ``start`` is not block-aligned or the range runs past the row.
    """
    block_size = kv_cache.shape[2]
    if start % block_size:
        raise ValueError(f"start={start} is not a multiple of block_size={block_size}")
    first = start // block_size
    count = -(-num_tokens // block_size)
    if first + count > block_ids.shape[0]:
        raise ValueError(
            f"tokens [{start}, {start + num_tokens}) run past the {block_ids.shape[0]}-block row"
        )
    ids = block_ids[first : first + count].to(device=kv_cache.device)
    shape = (count * block_size, *kv_cache.shape[3:])
    k = kv_cache[0].index_select(0, ids).view(shape)[:num_tokens]  # (num_tokens, Hkv, D)
    v = kv_cache[1].index_select(0, ids).view(shape)[:num_tokens]  # (num_tokens, Hkv, D)
    return k, v
