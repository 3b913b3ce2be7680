"""Prefix-cache keys of full KV blocks.

A block's key chains its parent's: ``digest = sha256(parent_digest || token ids || extra keys)``
(as vLLM's ``sha256`` prefix-caching hash does). The key stored in the table is the triple
(digest, token ids, extra keys), and Python dicts compare whole keys on a hash match, so a collision
of Python's 64-bit ``hash`` never produces a wrong hit; a wrong parent would need a SHA-256 collision.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import NamedTuple

ROOT_DIGEST = b"segserve-root"


class BlockHash(NamedTuple):
    """Content key of one full block.

    Attributes:
        digest: SHA-256 over the parent's digest, this block's token ids and its extra keys (32 bytes).
        token_ids: the block's ``block_size`` token ids.
        extra_keys: extra keys mixed in (the cache salt, first block only).
    """

    digest: bytes
    token_ids: tuple[int, ...]
    extra_keys: tuple[str, ...]


def hash_block_tokens(
    parent: BlockHash | None, token_ids: tuple[int, ...], extra_keys: tuple[str, ...] = ()
) -> BlockHash:
    """Key of a full block whose prefix is keyed by ``parent`` (None for the first block)."""
    h = hashlib.sha256(parent.digest if parent is not None else ROOT_DIGEST)
    h.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        h.update(b"\x00" + key.encode())
    return BlockHash(h.digest(), token_ids, extra_keys)


def extend_block_hashes(
    block_hashes: list[BlockHash], token_ids: list[int], block_size: int, cache_salt: str | None
) -> None:
    """Append keys for every full block of ``token_ids`` not yet in ``block_hashes`` (in place)."""
    for i in range(len(block_hashes), len(token_ids) // block_size):
        parent = block_hashes[-1] if block_hashes else None
        extra = (cache_salt,) if (i == 0 and cache_salt) else ()
        block_hashes.append(
            hash_block_tokens(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]), extra)
        )
