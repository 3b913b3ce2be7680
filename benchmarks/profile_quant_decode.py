"""Where a batch-1 decode token on GGUF blocks spends its time, end to end: each phase of the compiled
one-call layer stack (norm + QKV, RoPE + KV write, attention, O, norm + gate|up, SiLU + down), the
LM head, sampling, and everything outside the model (scheduler, input building, output processing and
detokenization), with each projection's achieved GB/s against the machine's read bandwidth
(``--read-gbs``, default 29: this host's figure, measured with a compiled streaming loop on a quiet
machine; PyTorch's reductions are too slow to measure it).

Runs the default model (Q4_1 SmolLM2) or ``--model FILE`` (a GGUF file, or a dense model's directory:
the GB/s are then those of its dense weights) with ``--dtype``: one request of a
``--prompt-len``-token prompt decoding ``--tokens`` tokens, greedy, ``--rounds`` times. Inside the stack
the phases come from the library's own clock (``cpu.stack_timing``: its first thread's time per phase,
each up to the end of its closing barrier, so waiting for the other thread counts); the rest from
``time.perf_counter`` around the engine's calls (``scheduler.schedule``, ``runner.execute_model``,
``CpuStep.forward`` / ``compute_logits``, the sampler, ``update_from_output``, the output processor).
Reported per decode token (the prefill step and the first token left out), medians over rounds.
``--float-activations`` turns the default integer-activation path of one-row Q4 products off
(``SEGSERVE_QUANT_INT8=0``).

Prints one line per part and writes ``--out`` as JSON. Quote the load average (printed) with it.
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

from segserve import LLM, SamplingParams  # noqa: E402
from segserve.kernels import cpu as cpu_kernels  # noqa: E402
from segserve.kernels import quant  # noqa: E402
from segserve.worker import model_runner  # noqa: E402


class Timers:
    """Named accumulators of seconds, filled by wrapped callables while ``on``."""

    def __init__(self) -> None:
        self.s: dict[str, float] = {}
        self.on = False

    def wrap(self, obj, attr: str, name: str) -> None:
        inner = getattr(obj, attr)

        def timed(*a, **k):
            if not self.on:
                return inner(*a, **k)
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.s[name] = self.s.get(name, 0.0) + time.perf_counter() - t0

        setattr(obj, attr, timed)


def _weight_bytes(mod) -> int:
    """Bytes a projection streams per step: its GGUF blocks, or its dense weight (a dense model)."""
    q = getattr(mod, "quant_weight", None)
    return q.nbytes if q is not None else mod.weight.numel() * mod.weight.element_size()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--float-activations", action="store_true",
                   help="the float kernels throughout (quant.set_int8(False))")
    p.add_argument("--read-gbs", type=float, default=29.0,
                   help="the machine's read bandwidth, GB/s, that achieved rates are compared with")
    p.add_argument("--out", default="results/profile_quant_decode.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    quant.set_int8(not args.float_activations)
    kw = {} if args.model is None else {"model": args.model}
    llm = LLM(dtype=args.dtype, max_model_len=2048, enable_prefix_caching=False, **kw)
    engine = llm.llm_engine
    runner, step = engine.runner, engine.runner.cpu_step
    model = step.model
    nl = len(model.layers)
    prompt = [(37 * t + 11) % 40000 + 100 for t in range(args.prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens + 1, ignore_eos=True)

    t = Timers()
    t.wrap(engine.scheduler, "schedule", "schedule")
    t.wrap(engine.scheduler, "update_from_output", "update_from_output")
    t.wrap(engine.output_processor, "process", "output_processing")
    t.wrap(runner, "execute_model", "execute_model")
    t.wrap(step, "forward", "forward")
    t.wrap(step, "compute_logits", "lm_head")
    t.wrap(model_runner, "sample", "sample")
    phases = torch.zeros(nl, len(cpu_kernels.STACK_PHASES), dtype=torch.int64)

    rounds = []
    for r in range(args.rounds + 1):  # round 0 warms up
        engine.add_request(f"p{r}", {"prompt_token_ids": prompt}, params)
        engine.step()  # the prefill (and first token): not timed
        t.s.clear()
        phases.zero_()
        cpu_kernels.stack_timing(phases)
        t.on = True
        steps, t0 = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            with_step = time.perf_counter()
            engine.step()
            t.s["step"] = t.s.get("step", 0.0) + time.perf_counter() - with_step
            steps += 1
        wall = time.perf_counter() - t0
        t.on = False
        cpu_kernels.stack_timing(None)
        if r == 0:
            continue
        per = {k: v / steps * 1e3 for k, v in t.s.items()}
        per["wall"] = wall / steps * 1e3
        ph = phases.double().sum(0) / steps / 1e6
        for i, name in enumerate(cpu_kernels.STACK_PHASES):
            per[f"stack_{name}"] = float(ph[i])
        per["stack_total"] = float(ph.sum())
        rounds.append(per)

    for r in rounds:  # a decode-stack step runs its LM head inside forward (StackHead): no call to time
        r.setdefault("lm_head", 0.0)
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    mins = {k: min(r[k] for r in rounds) for k in rounds[0]}
    derived = {
        # embed, RoPE tables, and the final norm and LM head (in the stack's call when fused)
        "forward_outside_stack": med["forward"] - med["stack_total"],
        "runner_rest": med["execute_model"] - med["forward"] - med["lm_head"] - med["sample"],  # inputs
        "engine_rest": med["step"] - med["execute_model"] - med["schedule"] - med["update_from_output"]
        - med["output_processing"],
    }
    layer = model.layers[0]
    mods = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
            "down": layer.mlp.down_proj}
    bw = args.read_gbs
    gbs = {}
    for name, mod in mods.items():
        gbs[name] = _weight_bytes(mod) * nl / (med[f"stack_{name}"] * 1e-3) / 1e9
    head = model.quantized_lm_head
    dense_head = None if head is not None else model.lm_head_weight
    head_bytes = head.nbytes if head is not None else dense_head.numel() * dense_head.element_size()
    if med["lm_head"] > 0:
        gbs["lm_head"] = head_bytes / (med["lm_head"] * 1e-3) / 1e9
    rep = {
        "model": args.model or "default", "dtype": args.dtype,
        "integer_activations": quant.int8_formats(1) != 0,
        "prompt_len": args.prompt_len, "tokens": args.tokens, "rounds": args.rounds,
        "load_avg": os.getloadavg(), "ms_per_token_median": med, "ms_per_token_min": mins,
        "derived_ms": derived, "gb_s": gbs, "read_gb_s": bw,
        "weight_bytes": sum(_weight_bytes(m) for m in mods.values()) * nl + head_bytes,
    }
    print(f"load {os.getloadavg()}  (ms per decode token: median / min over rounds)")
    for k in med:
        print(f"  {k:24s} {med[k]:8.3f} {mins[k]:8.3f}")
    for k, v in derived.items():
        print(f"  {k:24s} {v:8.3f}")
    for k, v in gbs.items():
        print(f"  GB/s {k:19s} {v:8.1f}  ({100 * v / bw:.0f} % of {bw:g} GB/s)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rep, indent=1))


if __name__ == "__main__":
    main()
