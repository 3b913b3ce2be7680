"""``add_rmsnorm_`` and ``silu_mul``, the row kernels between a prefill chunk's GEMMs, against eager.

Tolerances: the residual add is bitwise eager's ``h.add_``; the SiLU gate bitwise eager's in bfloat16
(its polynomial exp is within ~1 ulp of PyTorch's in float32: 2e-6 relative); RMSNorm's float32 statistic
is summed in another order, so float32 results agree within 1e-6 relative and bfloat16 ones within one
bfloat16 ulp, bfloat16 equal on all but a few elements (observed 0 of 172,800 on random rows, 0.02 % on a real
model's activations).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from segserve.kernels import build
from segserve.kernels import cpu as cpu_kernels
from segserve.models.llama import RMSNorm

pytestmark = pytest.mark.skipif(
    not all(f in build._cpu_flags() for f in build.REQUIRED_CPU_FLAGS), reason="CPU lacks AVX-512 BF16"
)
TOL = {torch.float32: {"atol": 1e-6, "rtol": 1e-6}, torch.bfloat16: {"atol": 0.0, "rtol": 2**-7}}


def _eager_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(h.shape[1], eps).to(h.dtype)
    norm.weight.data.copy_(weight)
    with torch.no_grad():
        return norm(h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 9, 300])
@pytest.mark.parametrize("with_add", [False, True], ids=["norm", "add+norm"])
def test_add_rmsnorm_is_the_eager_add_then_norm(dtype, rows, with_add) -> None:
    g = torch.Generator().manual_seed(rows)
    h = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    add = torch.randn(rows, 576, generator=g).to(dtype) if with_add else None
    weight = (torch.rand(576, generator=g) + 0.5).to(dtype)
    want_h = h.clone() if add is None else h.clone().add_(add)
    want = _eager_norm(want_h, weight, 1e-5)
    got = cpu_kernels.add_rmsnorm_(h, weight, 1e-5, add=add)
    assert torch.equal(h, want_h)  # the add, in place, bitwise
    torch.testing.assert_close(got, want, **TOL[dtype])
    if dtype == torch.bfloat16:
        assert (got != want).float().mean().item() <= 0.01


def test_add_rmsnorm_writes_into_out_with_row_strides() -> None:
    h = torch.randn(4, 80)[:, :64]  # rows 80 apart
    out = torch.empty(4, 96)[:, 16:80]
    weight = torch.rand(64) + 0.5
    want = _eager_norm(h.clone(), weight, 1e-6)
    assert cpu_kernels.add_rmsnorm_(h, weight, 1e-6, out=out) is out
    torch.testing.assert_close(out, want, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 17, 512])
def test_silu_mul_is_the_eager_gate(dtype, rows) -> None:
    gate_up = (torch.randn(rows, 3072, generator=torch.Generator().manual_seed(rows)) * 2).to(dtype)
    gate, up = gate_up.split(1536, dim=-1)
    want = F.silu(gate).mul_(up)
    got = cpu_kernels.silu_mul(gate_up)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=2e-6)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: cpu_kernels.add_rmsnorm_(torch.randn(2, 24), torch.ones(24), 1e-5),
         r"multiple of 16.*\(2, 24\)"),
        (lambda: cpu_kernels.add_rmsnorm_(torch.randn(2, 32), torch.ones(16), 1e-5),
         r"weight must be .*\(32,\)"),
        (lambda: cpu_kernels.add_rmsnorm_(torch.randn(2, 32), torch.ones(32), 1e-5, add=torch.randn(3, 32)),
         r"add must be \(2, >= 32\)"),
        (lambda: cpu_kernels.add_rmsnorm_(
            torch.randn(2, 32), torch.ones(32), 1e-5, add=torch.randn(2, 32, dtype=torch.bfloat16)
        ), r"add must be .*float32"),
        (lambda: cpu_kernels.add_rmsnorm_(torch.randn(2, 32).t(), torch.ones(2), 1e-5), r"multiple of 16"),
        (lambda: cpu_kernels.silu_mul(torch.randn(2, 48)), r"multiple of 32.*\(2, 48\)"),
        (lambda: cpu_kernels.silu_mul(torch.randn(2, 64).half()), r"float32 or bfloat16"),
    ],
    ids=["width", "weight", "add-rows", "add-dtype", "transposed", "gate-width", "half"],
)
def test_bad_operands_raise_naming_them(call, message) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_out_may_not_alias_its_input() -> None:
    h = torch.randn(2, 32)
    with pytest.raises(ValueError, match="overlap"):
        cpu_kernels.add_rmsnorm_(h, torch.ones(32), 1e-5, out=h)
    gate_up = torch.randn(2, 64)
    with pytest.raises(ValueError, match="overlap"):
        cpu_kernels.silu_mul(gate_up, out=gate_up[:, :32])
