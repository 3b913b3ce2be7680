"""oneDNN-packed linear layers: bfloat16 bitwise ``F.linear``, float32 within summation-order error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from segserve.models.packed_linear import PackedLinear, pack_weight, packing_available

needs_onednn = pytest.mark.skipif(not packing_available(), reason="torch built without oneDNN")


def _layer(dtype: torch.dtype, bias: bool) -> PackedLinear:
    torch.manual_seed(0)
    layer = PackedLinear(96, 160, bias=bias)
    return layer.to(dtype)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bf16_matches_f_linear_bitwise(rows: int, bias: bool) -> None:
    layer = _layer(torch.bfloat16, bias)
    x = torch.randn(rows, 96).bfloat16()
    expected = F.linear(x, layer.weight, layer.bias)
    assert layer.pack() and layer.is_packed
    got = layer(x)
    assert got.shape == (rows, 160) and got.dtype == torch.bfloat16
    assert torch.equal(got, expected)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 17])
def test_packed_float32_matches_f_linear_within_rounding(rows: int) -> None:
    # oneDNN and MKL sum the 96 products in different orders: agreement to float32 rounding
    # (|x| ~ 1, 96 terms: a few ulps of the result), not bitwise.
    layer = _layer(torch.float32, bias=True)
    x = torch.randn(rows, 96)
    expected = F.linear(x, layer.weight, layer.bias)
    assert layer.pack() and layer.is_packed
    got = layer(x)
    assert got.shape == (rows, 160) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_other_dtypes_are_not_packed_and_dtype_mismatch_falls_back() -> None:
    layer = _layer(torch.float64, bias=True)
    assert not layer.pack() and not layer.is_packed
    assert pack_weight(layer.weight) is None
    x = torch.randn(2, 96, dtype=torch.float64)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@needs_onednn
def test_repack_after_weight_change_and_unpack() -> None:
    layer = _layer(torch.bfloat16, bias=False)
    x = torch.randn(2, 96).bfloat16()
    layer.pack()
    with torch.no_grad():
        layer.weight.mul_(2)
    stale = layer(x)  # the documented hazard: the packed copy still holds the old weight
    assert not torch.equal(stale, F.linear(x, layer.weight))
    layer.pack()
    assert torch.equal(layer(x), F.linear(x, layer.weight))
    layer.unpack()
    assert not layer.is_packed and torch.equal(layer(x), F.linear(x, layer.weight))


@needs_onednn
def test_runner_prepack_counts_and_keeps_logits(monkeypatch) -> None:
    from segserve.attention.backends import get_attention_backend
    from segserve.kernels import cpu as cpu_kernels
    from segserve.models.llama import LlamaConfig, LlamaForCausalLM
    from segserve.worker import cpu_step
    from segserve.worker.cpu_step import CpuStep

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, get_attention_backend("segmented"))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    model = model.bfloat16()
    step = CpuStep(model)
    packed_calls = []
    real = cpu_step.packed_linear
    monkeypatch.setattr(cpu_step, "packed_linear", lambda *a: packed_calls.append(1) or real(*a))
    monkeypatch.setattr(cpu_kernels._switch, "on", False)  # else the compiled small-row head takes 3 rows
    hidden = torch.randn(3, 32).bfloat16()
    before = model.compute_logits(hidden)
    assert step.prepack() == 2 * 4 + 1  # 4 projections per layer + the tied LM head
    assert all(m.is_packed for m in model.modules() if hasattr(m, "is_packed"))
    after = step.compute_logits(hidden)
    assert packed_calls == [1]  # the packed head took it, bitwise F.linear's
    assert after.dtype == torch.float32 and torch.equal(before, after)
    step.unpack()
    assert not any(m.is_packed for m in model.modules() if hasattr(m, "is_packed"))
    assert torch.equal(step.compute_logits(hidden), before) and packed_calls == [1]
    model = model.float()
    before = model.compute_logits(hidden.float())
    assert step.prepack() == 2 * 4 + 1  # float32 packs too
    torch.testing.assert_close(step.compute_logits(hidden.float()), before, rtol=1e-5, atol=1e-5)
    assert packed_calls == [1, 1]
    model.double()
    assert step.prepack() == 0
