"""The AMX GEMM's RoPE + KV-write epilogue (``amx.linear(..., rope_kv=RopeKV(...))``) against the passes it
replaces: the plain product, then ``cpu.rope_`` over its Q and K heads, then ``cpu.write_kv`` of its K and
V rows. Same bits in the output and in every cache slot, for ragged row counts (one row, a partial row
tile, an overlapping last tile, row chunks), head dims 32 / 64 / 128, with and without a bias, padding
rows without a slot; bad input refused naming the value, with nothing written.
"""

from __future__ import annotations

import pytest
import torch

from segserve.kernels import amx
from segserve.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(
    not amx.available(), reason=f"AMX GEMM unavailable: {amx.unavailable_reason()}"
)

BLOCK, BLOCKS = 16, 80


def _tables(positions: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) float32 rows as ``rope_table`` makes them (first half of sin negated)."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    f = positions.float()[:, None] * inv[None]
    f = torch.cat([f, f], 1)
    sin = f.sin()
    sin[:, : d // 2] *= -1
    return f.cos().contiguous(), sin.contiguous()


def _case(m: int, hq: int, hkv: int, d: int, n_slots: int, bias: bool, k: int = 96, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    n = (hq + 2 * hkv) * d
    w = (torch.randn(n, k, generator=gen) * 0.1).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    b = (torch.randn(n, generator=gen) * 0.1).bfloat16() if bias else None
    cos, sin = _tables(torch.randint(0, 4000, (m,), generator=gen), d)
    slots = torch.randperm(BLOCKS * BLOCK, generator=gen)[:n_slots].long()
    return amx.pack(w), x, b, n, k, cos, sin, slots


def _cache(hkv: int, d: int) -> torch.Tensor:
    return torch.full((2, BLOCKS, BLOCK, hkv, d), 0.5, dtype=torch.bfloat16)


@pytest.mark.parametrize("m, hq, hkv, d, n_slots, bias", [
    (1, 9, 3, 64, 1, False),
    (5, 9, 3, 64, 3, True),  # rows 3, 4 are padding: rotated, no slot
    (16, 4, 2, 32, 16, False),
    (33, 9, 3, 64, 33, True),
    (300, 4, 1, 128, 290, True),
    (530, 14, 2, 64, 530, False),
], ids=["one-row", "padding", "d32", "ragged", "d128", "chunks"])
def test_rope_kv_equals_the_product_then_rope_then_write_kv(m, hq, hkv, d, n_slots, bias) -> None:
    packed, x, b, n, k, cos, sin, slots = _case(m, hq, hkv, d, n_slots, bias)
    want = amx.linear(x, packed, n, k, b)
    cpu_kernels.rope_(want, hq + hkv, d, cos, sin)
    heads = want.view(m, hq + 2 * hkv, d)
    want_cache = _cache(hkv, d)
    cpu_kernels.write_kv(want_cache, heads[:, hq:hq + hkv], heads[:, hq + hkv:], slots)

    got_cache = _cache(hkv, d)
    rope = amx.RopeKV(hq, hkv, d, cos.bfloat16(), sin.bfloat16(), got_cache, slots)
    got = amx.linear(x, packed, n, k, b, rope_kv=rope)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(got_cache.view(torch.int16), want_cache.view(torch.int16))


def test_a_slot_outside_the_cache_is_refused_and_nothing_is_written() -> None:
    packed, x, b, n, k, cos, sin, slots = _case(20, 9, 3, 64, 20, False)
    slots[7] = BLOCKS * BLOCK  # one past the last slot
    cache = _cache(3, 64)
    rope = amx.RopeKV(9, 3, 64, cos.bfloat16(), sin.bfloat16(), cache, slots)
    with pytest.raises(ValueError, match=rf"outside \[0, {BLOCKS * BLOCK}\)"):
        amx.linear(x, packed, n, k, b, rope_kv=rope)
    assert torch.equal(cache, _cache(3, 64))


@pytest.mark.parametrize("change, match", [
    (dict(cos="float32"), r"rope_kv.cos must be contiguous bfloat16 \(20, 64\)"),
    (dict(num_heads=8), r"n = \(num_heads \+ 2 num_kv_heads\) head_dim"),
    (dict(head_dim=48), r"head_dim a multiple of 32"),
    (dict(slot_mapping="int32"), r"rope_kv.slot_mapping must be contiguous 1-D int64 of at most 20 rows"),
    (dict(slot_mapping="too_many"), r"of at most 20 rows, got \(21,\)"),
    (dict(kv_cache="float32"), r"rope_kv.kv_cache must be a contiguous \[2, blocks, block_size, 3, 64\]"),
])
def test_bad_rope_kv_fields_are_refused_naming_them(change, match) -> None:
    packed, x, b, n, k, cos, sin, slots = _case(20, 9, 3, 64, 20, False)
    fields = dict(num_heads=9, num_kv_heads=3, head_dim=64, cos=cos.bfloat16(), sin=sin.bfloat16(),
                  kv_cache=_cache(3, 64), slot_mapping=slots)
    for name, value in change.items():
        if value == "float32":
            fields[name] = fields[name].float()
        elif value == "int32":
            fields[name] = fields[name].int()
        elif value == "too_many":
            fields[name] = torch.arange(21)
        else:
            fields[name] = value
    with pytest.raises(ValueError, match=match):
        amx.linear(x, packed, n, k, b, rope_kv=amx.RopeKV(**fields))


def test_rope_kv_does_not_combine_with_another_epilogue() -> None:
    packed, x, b, n, k, cos, sin, slots = _case(4, 9, 3, 64, 4, False)
    rope = amx.RopeKV(9, 3, 64, cos.bfloat16(), sin.bfloat16(), _cache(3, 64), slots)
    with pytest.raises(ValueError, match="rope_kv takes a plain bfloat16 output"):
        amx.linear(x, packed, n, k, b, rope_kv=rope, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="rope_kv takes a plain bfloat16 output"):
        amx.linear(x, packed, n, k, b, rope_kv=rope, residual=torch.zeros(4, n, dtype=torch.bfloat16))
