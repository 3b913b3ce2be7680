"""Where a batch-1 decode step on GGUF blocks spends its time: end to end, the compiled one-call layer
stack, the LM head, each projection kind alone, and what is left (engine, sampler, detokenizer).

Runs the default model (Q4_1 SmolLM2) or ``--model FILE`` with ``--dtype``, one request decoding
``--tokens`` tokens after an 8-token prompt. The stack and LM head are timed by wrapping the runner's
``CpuStep`` calls during that generation; each projection kind is timed alone with ``quant.linear`` on
layer 0's weights (one row, median of many calls, less the median of a call on a one-block weight: the
wrapper's own cost) and multiplied by the layer count; attention, RoPE and the KV write are the stack's
time minus its projections. ``--int8`` runs with the int8-activation kernels (``SEGSERVE_QUANT_INT8``).
Also prints the bandwidth floor: bytes of weights read per token over a measured copy bandwidth
(``bench_decode.measure_bandwidth_gbs``).
Prints one line per part and writes ``results/profile_quant_decode.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import measure_bandwidth_gbs  # noqa: E402

from segserve import LLM, SamplingParams  # noqa: E402
from segserve.kernels import quant  # noqa: E402


def _timed_calls(fn, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls (after 3 warm-ups)."""
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _wrap(obj, name: str, sink: list[float]) -> None:
    inner = getattr(obj, name)

    def timed(*a, **k):
        t0 = time.perf_counter()
        out = inner(*a, **k)
        sink.append(time.perf_counter() - t0)
        return out

    setattr(obj, name, timed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--int8", action="store_true", help="int8 activations (quant.set_int8)")
    p.add_argument("--out", default="results/profile_quant_decode.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    quant.set_int8(args.int8)
    kw = {} if args.model is None else {"model": args.model}
    llm = LLM(dtype=args.dtype, max_model_len=1024, kv_cache_memory_bytes=256 << 20,
              enable_prefix_caching=False, **kw)
    step = llm.llm_engine.runner.cpu_step
    prompt = [1, 504, 3458, 282, 4649, 314, 253, 216]

    def gen(n: int) -> float:
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=n,
                                                                     ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t0

    gen(4)
    t1, tn = statistics.median(gen(1) for _ in range(3)), None
    fwd, head = [], []
    _wrap(step, "forward", fwd)
    _wrap(step, "compute_logits", head)
    tn = gen(args.tokens + 1)
    per_tok = (tn - t1) / args.tokens
    fwd_ms, head_ms = statistics.median(fwd[1:]) * 1e3, statistics.median(head[1:]) * 1e3

    model = step.model
    dt = model.activation_dtype
    layer = model.layers[0]
    kinds = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
             "down": layer.mlp.down_proj}
    lin = {}
    w0 = kinds["o"].quant_weight
    tiny = type(w0)(w0.data[:1, : w0.data.shape[1] // (w0.shape[1] // 32)].contiguous(), w0.qtype, 32)
    x0 = torch.randn(1, 32, dtype=dt)
    call = _timed_calls(lambda: quant.linear(x0, tiny), 300)
    for name, mod in kinds.items():
        w = mod.quant_weight
        x = torch.randn(1, w.shape[1], dtype=dt)
        lin[name] = (_timed_calls(lambda w=w, x=x: quant.linear(x, w), 300) - call) * 1e3 * len(model.layers)
    lin_ms = sum(lin.values())
    wbytes = sum(m.quant_weight.nbytes for lay in model.layers for m in (
        lay.self_attn.qkv_proj, lay.self_attn.o_proj, lay.mlp.gate_up_proj, lay.mlp.down_proj))
    head_bytes = model.quantized_lm_head.nbytes
    bw = measure_bandwidth_gbs()
    rep = {
        "dtype": args.dtype, "int8": quant.int8_enabled(), "load": os.getloadavg()[0],
        "decode_tok_s": 1 / per_tok,
        "step_ms": per_tok * 1e3, "stack_and_embed_ms": fwd_ms, "lm_head_ms": head_ms,
        "linears_ms": lin, "attention_rope_kv_ms": fwd_ms - lin_ms,
        "engine_overhead_ms": per_tok * 1e3 - fwd_ms - head_ms,
        "weight_bytes_per_token": wbytes + head_bytes, "copy_gb_s": bw,
        "bandwidth_floor_ms": (wbytes + head_bytes) / bw / 1e6,
    }
    for k, v in rep.items():
        print(f"{k}: {v if not isinstance(v, float) else round(v, 3)}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rep, indent=1))


if __name__ == "__main__":
    main()
