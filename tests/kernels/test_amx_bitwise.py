"""The AMX GEMM's outputs bit for bit against digests of the kernel's outputs before its 2026-12-02
rework (the staged stores and the dynamic work items of issue 12): every output element is summed in
the same K order in any tiling (one tile product per 32-wide K step, in order), and the epilogues round
at the same points, so a schedule change must not move a single bit. The inputs are integer patterns
(no random generator, so the digests do not depend on torch's RNG); the shapes cover the model's four
projections, odd column-block counts, every epilogue, and ragged row counts (one row, a partial row
tile, an overlapping last tile, several row chunks), at 1 and 2 threads.

Regenerate (only for an intended numerics change, with the old kernel): ``DIGESTS`` printed by
``python tests/kernels/test_amx_bitwise.py``.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from segserve.kernels import amx

pytestmark = pytest.mark.skipif(
    not amx.available(), reason=f"AMX GEMM unavailable: {amx.unavailable_reason()}"
)

# (name, N, K, epilogue, bias, out dtype)
CASES = [
    ("qkv", 960, 576, None, False, torch.bfloat16),
    ("qkv_bias", 960, 576, None, True, torch.bfloat16),
    ("qkv_f32", 960, 576, None, True, torch.float32),
    ("o_res", 576, 576, "residual", False, torch.bfloat16),
    ("gate_up", 3072, 576, "silu_mul", False, torch.bfloat16),
    ("gate_up_bias", 3072, 576, "silu_mul", True, torch.bfloat16),
    ("down_res", 576, 1536, "residual", True, torch.bfloat16),
    ("odd_blocks", 80, 96, None, True, torch.bfloat16),
    ("odd_blocks_res", 80, 96, "residual", False, torch.bfloat16),
    ("odd_units_silu", 96, 64, "silu_mul", True, torch.bfloat16),
]
ROWS = [1, 7, 16, 17, 45, 530, 2050]


def _pattern(rows: int, cols: int, a: int, b: int, mod: int, scale: float) -> torch.Tensor:
    i = torch.arange(rows).unsqueeze(1)
    j = torch.arange(cols).unsqueeze(0)
    return (((i * a + j * b) % mod - mod // 2).float() * scale).bfloat16()


def _run(name: str, n: int, k: int, epilogue: str | None, bias: bool, dtype: torch.dtype,
         m: int) -> torch.Tensor:
    x = _pattern(m, k, 131, 71, 251, 1 / 64)
    w = _pattern(n, k, 37, 113, 241, 1 / 100 if epilogue == "silu_mul" else 1 / 2048)
    b = _pattern(1, n, 0, 29, 61, 1 / 16)[0] if bias else None
    packed = amx.pack(w)
    if epilogue == "residual":
        return amx.linear(x, packed, n, k, b, residual=_pattern(m, n, 17, 3, 101, 1 / 32))
    return amx.linear(x, packed, n, k, b, silu_mul=epilogue == "silu_mul", out_dtype=dtype)


def _digest(y: torch.Tensor) -> str:
    bits = y.view(torch.int16 if y.dtype == torch.bfloat16 else torch.int32)
    return hashlib.sha256(bits.contiguous().numpy().tobytes()).hexdigest()[:16]


DIGESTS = {  # main's kernel at f388638 (queued stores, a static column split)
    ('qkv', 1): '356d1ce45c17e5ee',
    ('qkv', 7): '618aee97a278c1f0',
    ('qkv', 16): '0562c5422724fa2f',
    ('qkv', 17): '8a658ef59b3c494c',
    ('qkv', 45): 'ec3c47c2ae5bd0d3',
    ('qkv', 530): '5659597717094cb9',
    ('qkv', 2050): '0155ee143f28c578',
    ('qkv_bias', 1): '56697ad2e517365a',
    ('qkv_bias', 7): 'a749d32d1a574389',
    ('qkv_bias', 16): '1bf9d3b1f5c17c46',
    ('qkv_bias', 17): 'f0d78bec4c6613a0',
    ('qkv_bias', 45): '061dad72f02f7a45',
    ('qkv_bias', 530): '57de1ce1e492ad7b',
    ('qkv_bias', 2050): '33e0ae6ce1ae0a5b',
    ('qkv_f32', 1): '8197ef62e8e1b821',
    ('qkv_f32', 7): 'f104de60d15134d2',
    ('qkv_f32', 16): '5a9c82a3998f1079',
    ('qkv_f32', 17): '666b10e5825dd535',
    ('qkv_f32', 45): 'f0a576025d9aaaad',
    ('qkv_f32', 530): '6ac574787fe8b73c',
    ('qkv_f32', 2050): '26a94912dc370431',
    ('o_res', 1): '71845fe5cb8d460a',
    ('o_res', 7): '9289108ff81e2f73',
    ('o_res', 16): '74be3d97e88d0175',
    ('o_res', 17): '7bfe3478ebbf6443',
    ('o_res', 45): '4cb20a64fbef3a1c',
    ('o_res', 530): 'a0c60f8fb9fcf449',
    ('o_res', 2050): 'a3b05fc74a41fdcd',
    ('gate_up', 1): 'e41ec282ecf2eeb8',
    ('gate_up', 7): '6ac09e948e5d4396',
    ('gate_up', 16): '2ab30c19c5ebf034',
    ('gate_up', 17): '5ee07812e26ce442',
    ('gate_up', 45): 'a094949c2d45cd9e',
    ('gate_up', 530): '2694c7346585e1f7',
    ('gate_up', 2050): '3f07d23b025be789',
    ('gate_up_bias', 1): '63babf029c723cd5',
    ('gate_up_bias', 7): '36c4b9f92a2cc715',
    ('gate_up_bias', 16): '3d6dd89b5efb4d7c',
    ('gate_up_bias', 17): '589bb922c9387b64',
    ('gate_up_bias', 45): 'c58809ae28a63ed3',
    ('gate_up_bias', 530): '3a0de683f930deb4',
    ('gate_up_bias', 2050): 'b17a214838accf69',
    ('down_res', 1): '02eb6b2a4341d29d',
    ('down_res', 7): '8dc98126ff55a597',
    ('down_res', 16): '7d0f93f6cb215fb2',
    ('down_res', 17): '8b26ad9e9834ce37',
    ('down_res', 45): '6c40980777dc81ca',
    ('down_res', 530): '6eca5eef1966fcca',
    ('down_res', 2050): '9cc96ddddbc6649a',
    ('odd_blocks', 1): '0958b7124b680783',
    ('odd_blocks', 7): '7e7a75a18cc4fc68',
    ('odd_blocks', 16): '7b89871ea54ec5ab',
    ('odd_blocks', 17): '93744fcd9022b19d',
    ('odd_blocks', 45): '396a499c2c020e5f',
    ('odd_blocks', 530): 'd0f6c4018ebfaebe',
    ('odd_blocks', 2050): 'af6c1e1b7fcfbbfd',
    ('odd_blocks_res', 1): 'f3febb85171229c9',
    ('odd_blocks_res', 7): '08679003c415dbe8',
    ('odd_blocks_res', 16): '143c93c6740566c7',
    ('odd_blocks_res', 17): 'd2908e83ed0ac2e8',
    ('odd_blocks_res', 45): 'c691e40a985ededf',
    ('odd_blocks_res', 530): 'db763f6afcec07a1',
    ('odd_blocks_res', 2050): 'b1f2d3ce6da35a42',
    ('odd_units_silu', 1): '24921793bf980241',
    ('odd_units_silu', 7): 'f421ee47254c2be9',
    ('odd_units_silu', 16): '5f0d8f986a9f6990',
    ('odd_units_silu', 17): 'bf65810dbfe1b16e',
    ('odd_units_silu', 45): 'a6c3d861f4b2c477',
    ('odd_units_silu', 530): 'd0e14b53648bfde0',
    ('odd_units_silu', 2050): '74b91c05da6bd0e2',
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_output_bits_equal_the_kernel_before_the_rework(case, m: int, threads: int) -> None:
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _digest(_run(*case, m))
    finally:
        torch.set_num_threads(old)
    assert got == DIGESTS[(case[0], m)]


if __name__ == "__main__":
    for case in CASES:
        for m in ROWS:
            print(f"    ({case[0]!r}, {m}): {_digest(_run(*case, m))!r},")


EVERY_GATE_VALUE = "f5280a9579a38b7e"  # main's kernel at f388638 (exp + divide per gate)


def _every_gate_value() -> torch.Tensor:
    """silu_mul over one-hot rows: gate[m, c] = the bfloat16 of bits m * 1024 + c (every finite value;
    infinities and NaNs, whose products with the one-hot zeros would be NaN, replaced by 0), up = 1."""
    m, inter, k = 64, 1024, 64
    bits = torch.arange(m * inter, dtype=torch.int32).reshape(m, inter)
    bits = torch.where((bits & 0x7F80) == 0x7F80, 0, bits)
    gate = bits.to(torch.int16).view(torch.bfloat16).T  # (inter, m): gate weight column m is row m's values
    w = torch.zeros(2 * inter, k, dtype=torch.bfloat16)
    w[:inter, :m] = gate
    w[inter:, :m] = 1.0
    x = torch.eye(m, k, dtype=torch.bfloat16)
    return amx.linear(x, amx.pack(w), 2 * inter, k, silu_mul=True)


def test_silu_gate_bits_equal_the_kernel_before_the_rework_on_every_bfloat16_gate() -> None:
    assert _digest(_every_gate_value()) == EVERY_GATE_VALUE


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", CASES[:7], ids=[c[0] for c in CASES[:7]])
def test_strided_x_gives_the_contiguous_bits(case, threads: int) -> None:
    """x as a column slice of wider rows whose other columns are NaN, over several row chunks: the
    prefetch look-ahead (the thread's next rows of x, the item's rows of y) runs past row M and over the
    padding, and the tile loads must still read only the K columns of each row."""
    name, n, k, epilogue, bias, dtype = case
    m = 2050
    x = _pattern(m, k, 131, 71, 251, 1 / 64)
    wide = torch.full((m, k + 96), float("nan"), dtype=torch.bfloat16)
    wide[:, 32:32 + k] = x
    w = _pattern(n, k, 37, 113, 241, 1 / 100 if epilogue == "silu_mul" else 1 / 2048)
    b = _pattern(1, n, 0, 29, 61, 1 / 16)[0] if bias else None
    packed = amx.pack(w)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        xs = wide[:, 32:32 + k]
        if epilogue == "residual":
            y = amx.linear(xs, packed, n, k, b, residual=_pattern(m, n, 17, 3, 101, 1 / 32))
        else:
            y = amx.linear(xs, packed, n, k, b, silu_mul=epilogue == "silu_mul", out_dtype=dtype)
    finally:
        torch.set_num_threads(old)
    assert _digest(y) == DIGESTS[(name, m)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", [1, 16, 17, 32, 33, 45, 48, 49, 64])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (80, 96), (48, 64)])
def test_the_team_product_equals_the_tile_gemm_bitwise(n: int, k: int, m: int, threads: int) -> None:
    """amx.rows_linear runs the decode stack's team product (segserve_amx_team.c): from 17 rows it takes
    two column blocks at a time (2 x 2 register blocks, a last odd block alone: N = 80 and 48 have 5 and
    3 blocks), in two passes above 32 rows. Same bits as amx.linear, whose digests are pinned above."""
    x = _pattern(m, k, 131, 71, 251, 1 / 64)
    w = _pattern(n, k, 37, 113, 241, 1 / 2048)
    packed = amx.pack(w)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = amx.rows_linear(x, packed, n, k)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(got.view(torch.int16), amx.linear(x, packed, n, k).view(torch.int16))
