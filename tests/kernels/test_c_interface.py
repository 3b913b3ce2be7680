"""The C entry points' argument structs: cpu.py's ctypes mirrors match the C declarations field for
field, and a struct of another size is refused with ERR_LAYOUT (-5) before anything is read or written.

The declarations are read from the C source (one field per line, as the file writes them), so a field
added, renamed, retyped or reordered on one side only fails here rather than corrupting memory.
"""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from segserve.kernels import amx, bf16gemm, build
from segserve.kernels import chunk_attention as chunk_kernels
from segserve.kernels import cpu as cpu_kernels
from segserve.kernels import f32gemm as f32gemm_kernels
from segserve.kernels import quant as quant_kernels
from segserve.kernels import sample as sample_kernels

CPU_READY = all(flag in build._cpu_flags() for flag in build.REQUIRED_CPU_FLAGS)
ERR_LAYOUT = -5
MIRRORS = {
    "sg_linear_args": cpu_kernels._LinearArgs,
    "sg_rope_args": cpu_kernels._RopeArgs,
    "sg_write_kv_args": cpu_kernels._WriteKVArgs,
    "sg_decode_attention_args": cpu_kernels._DecodeAttentionArgs,
    "sg_layer": cpu_kernels._Layer,
    "sg_decode_stack_args": cpu_kernels._DecodeStackArgs,
    "sg_rows_args": cpu_kernels._RowsArgs,
    "sg_amx_probe_args": amx._ProbeArgs,
    "sg_amx_pack_args": amx._PackArgs,
    "sg_amx_linear_args": amx._LinearArgs,
    "sg_amx_peak_args": amx._PeakArgs,
    "sg_amx_rows_linear_args": amx._RowsLinearArgs,
    "sg_chunk_attention_args": chunk_kernels._ChunkAttentionArgs,
    "sg_qdequant_args": quant_kernels._DequantArgs,
    "sg_f32gemm_args": f32gemm_kernels._GemmArgs,
    "sg_bf16gemm_args": bf16gemm._GemmArgs,
    "sg_bf16gemm_peak_args": bf16gemm._PeakArgs,
    "sg_sample_args": sample_kernels._SampleArgs,
    "sg_logprobs_args": sample_kernels._LogprobsArgs,
}
# Every entry point's argument struct, whichever wrapper module mirrors it.
ENTRY_POINTS = {**cpu_kernels._ARGS, **amx._ARGS, **chunk_kernels._ARGS, **quant_kernels._ARGS,
                **f32gemm_kernels._ARGS, **bf16gemm._ARGS, **sample_kernels._ARGS}
C_TYPES = {"int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32, "float": ctypes.c_float}
needs_cpu = pytest.mark.skipif(not CPU_READY, reason="CPU lacks AVX-512F / AVX-512 BF16")


def _all_sources() -> str:
    """Every C source that goes into the library, concatenated."""
    return "\n".join(f.read_text() for f in build.SOURCES)


def _c_structs() -> dict[str, list[tuple[str, object]]]:
    """``typedef struct {...} name;`` of the C source: name -> [(field, C_TYPES value or "pointer")]."""
    source = _all_sources()
    structs = {}
    for body, name in re.findall(r"typedef struct \{\n(.*?)\n\} (\w+);", source, re.S):
        fields = []
        for line in body.splitlines():
            decl = re.sub(r"/\*.*?\*/", "", line).strip()
            match = re.fullmatch(r"(?:const\s+)?(\w+)\s*(\*?)\s*(\w+);", decl)
            assert match, f"{name}: cannot read {line!r} (one field per line)"
            ctype, pointer, field = match.groups()
            fields.append((field, "pointer" if pointer else C_TYPES[ctype]))
        structs[name] = fields
    return structs


def _py_fields(cls: type[ctypes.Structure]) -> list[tuple[str, object]]:
    def kind(t):
        return "pointer" if t is ctypes.c_void_p or issubclass(t, ctypes._Pointer) else t

    return [(name, kind(t)) for name, t in cls._fields_]


def test_every_ctypes_mirror_has_the_c_structs_fields_in_order() -> None:
    structs = _c_structs()
    assert sorted(structs) == sorted(MIRRORS)
    for name, cls in MIRRORS.items():
        assert _py_fields(cls) == structs[name], name
    assert structs["sg_linear_args"][:3] == [
        ("size", ctypes.c_int64), ("dt", ctypes.c_int32), ("ydt", ctypes.c_int32)
    ]


def test_each_entry_point_takes_its_struct_and_it_starts_with_its_size() -> None:
    declared = r"^(?:AMX_TARGET )?int (sg_\w+)\(const (\w+) \*a\) \{"
    signatures = dict(re.findall(declared, _all_sources(), re.M))
    assert signatures == {name: f"{name}_args" for name in ENTRY_POINTS}
    for name, cls in ENTRY_POINTS.items():
        assert MIRRORS[f"{name}_args"] is cls
        assert cls._fields_[0] == ("size", ctypes.c_int64)
        assert cls.SIZE == ctypes.sizeof(cls)
    assert cpu_kernels._DecodeStackArgs._fields_[1] == ("layer_size", ctypes.c_int64)


@needs_cpu
@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_a_struct_of_another_size_is_refused_by_the_library(name: str) -> None:
    lib, cls = amx._library(), ENTRY_POINTS[name]
    assert lib is not None, cpu_kernels.unavailable_reason()
    assert chunk_kernels._library() is lib  # types sg_chunk_attention's argument (a pointer, not a copy)
    assert quant_kernels._library() is lib  # and sg_qdequant's (untyped: ctypes would pass it by value)
    assert f32gemm_kernels._library() is lib  # and sg_f32gemm's
    assert bf16gemm._library() is lib  # and sg_bf16gemm's
    assert sample_kernels._library() is lib  # and sg_sample's
    for size in (0, cls.SIZE - 8, cls.SIZE + 8):
        args = cls(size=size)
        # One head of dim 16: were the size not checked, the shape checks would answer (-1 or 0)
        # instead of dividing by zero heads.
        for field, value in (("Hq", 1), ("Hkv", 1), ("D", 16)):
            if hasattr(args, field):
                setattr(args, field, value)
        assert getattr(lib, name)(args) == ERR_LAYOUT, (name, size)


@needs_cpu
def test_a_layer_struct_of_another_size_is_refused_by_the_decode_stack() -> None:
    stack_args, layer = cpu_kernels._DecodeStackArgs, cpu_kernels._Layer
    args = stack_args(size=stack_args.SIZE, layer_size=layer.SIZE + 8, Hq=1, Hkv=1, D=16)
    assert cpu_kernels._library().sg_decode_stack(args) == ERR_LAYOUT


def _stack(dtype: torch.dtype = torch.float32):
    """A random 2-layer stack (hidden 64, intermediate 96, 4 query / 2 KV heads of dim 16) and its
    caches ``[2, 20, 4, 2, 16]``."""
    gen = torch.Generator().manual_seed(3)
    h, i, hq, hkv, d = 64, 96, 4, 2, 16

    def rand(*shape):
        return (0.1 * torch.randn(*shape, generator=gen)).to(dtype)

    caches = [rand(2, 20, 4, hkv, d) for _ in range(2)]
    layers = [
        (rand(h), rand((hq + 2 * hkv) * d, h), None, rand(h, hq * d), rand(h), rand(2 * i, h), rand(h, i),
         cache)
        for cache in caches
    ]
    return cpu_kernels.DecodeStack(layers, hq, hkv, d, 1e-5), caches


@needs_cpu
def test_every_wrapper_raises_on_a_layout_mismatch_and_writes_nothing(monkeypatch) -> None:
    """As if cpu.py and the library had been built from different versions of each struct."""
    stack, caches = _stack()
    stack._args.size += 8  # filled once at construction
    for cls in ENTRY_POINTS.values():
        monkeypatch.setattr(cls, "SIZE", cls.SIZE + 8)
    refused = pytest.raises(RuntimeError, match="argument struct of another size")

    x, w, residual = torch.randn(3, 64), torch.randn(32, 64), torch.randn(3, 32)
    before = residual.clone()
    with refused:
        cpu_kernels.linear(x, w, residual=residual)
    assert torch.equal(residual, before)

    qkv = torch.randn(2, 64)
    before = qkv.clone()
    with refused:
        cpu_kernels.rope_(qkv, 2, 16, torch.randn(2, 16), torch.randn(2, 16))
    assert torch.equal(qkv, before)

    cache = torch.zeros(2, 4, 4, 2, 16)
    with refused:
        cpu_kernels.write_kv(cache, torch.ones(1, 2, 16), torch.ones(1, 2, 16), torch.tensor([5]))
    assert torch.count_nonzero(cache) == 0

    q, out, one = torch.randn(1, 4, 16), torch.zeros(1, 4, 16), torch.tensor([0])
    table = torch.tensor([[1, 2]], dtype=torch.int32)
    with refused:
        cpu_kernels.decode_attention(q, out, one, torch.randn(2, 4, 4, 2, 16), table, one, torch.tensor([5]),
                                     512, 0.25)
    assert torch.count_nonzero(out) == 0

    h, add = torch.randn(2, 32), torch.randn(2, 32)
    before = h.clone()
    with refused:
        cpu_kernels.add_rmsnorm_(h, torch.ones(32), 1e-5, add=add)
    assert torch.equal(h, before)

    h = torch.randn(1, 64)
    before, cache_before = h.clone(), [c.clone() for c in caches]
    with refused:
        stack.run(caches, h, torch.randn(1, 16), torch.randn(1, 16), torch.tensor([5]),
                  torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([6]), 512, 0.25)
    assert torch.equal(h, before)
    assert all(torch.equal(a, b) for a, b in zip(caches, cache_before, strict=True))

    if chunk_kernels.available():  # AMX or AVX-512 BF16
        q, out = torch.randn(2, 2, 32).bfloat16(), torch.zeros(2, 2, 32, dtype=torch.bfloat16)
        cache = torch.randn(2, 4, 4, 1, 32).bfloat16()
        one = torch.tensor([0])
        with refused:
            chunk_kernels.chunk_attention(
                q, out, cache, table, one, torch.tensor([2]), torch.tensor([3]), one, 512, 0.25
            )
        assert torch.count_nonzero(out) == 0
