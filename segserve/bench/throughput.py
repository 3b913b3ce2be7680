"""Offline throughput: a fixed workload through segserve, and through Hugging Face ``transformers`` in
the same process as the baseline (static batches with left padding; continuous batching with
``generate_batch``'s manager where the installed version has it).

What is counted (design.md, "Measuring"): prompt tokens actually computed (prefix-cache hits are
reported apart, not counted as work), output tokens actually asked for (a static batch that runs
past a request's ``max_tokens`` does not get credit for the extra tokens), wall seconds.

Prefill and decode rates are kept apart. segserve mixes both in one step, so: the prefill rate is
prompt tokens over the time of the steps that computed any prompt token (decodes riding in those
steps included: a lower bound), and the decode rate is tokens over time of the steps that computed
no prompt token. A request's first token comes from a prefill step, so it never counts as decode.
For a static batch, prefill is the time to the batch's first token and decode the rest.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from segserve.bench.workloads import Workload

WARMUP_PROMPT = tuple(range(100, 132))  # one short request before timing: allocator, thread pool


@dataclass
class ThroughputResult:
    """Counts and seconds of one run; rates are derived (``summary``).

    Attributes:
        name: ``segserve``, ``hf-static`` or ``hf-cb``.
        num_requests: requests completed.
        prompt_tokens: prompt tokens computed (cache hits excluded), tokens.
        cached_tokens: prompt tokens served from the prefix cache, tokens.
        output_tokens: output tokens generated that the requests asked for, tokens.
        seconds: wall time of the whole run, s.
        prefill_seconds, decode_seconds: time split as in the module docstring, s (None: not split).
        decode_tokens: tokens generated in decode time (first tokens excluded), tokens.
        extra: implementation notes (batch size, number of steps, ...).
    """

    name: str
    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    seconds: float
    prefill_seconds: float | None = None
    decode_seconds: float | None = None
    decode_tokens: int = 0
    extra: dict[str, Any] | None = None

    def summary(self) -> dict[str, Any]:
        """Counts plus ``requests_per_s``, ``output_tok_s``, ``total_tok_s``, ``prefill_tok_s``,
        ``decode_tok_s`` (None where the time is 0 or not split)."""
        rate = _rate
        return asdict(self) | {
            "requests_per_s": rate(self.num_requests, self.seconds),
            "output_tok_s": rate(self.output_tokens, self.seconds),
            "total_tok_s": rate(self.prompt_tokens + self.output_tokens, self.seconds),
            "prefill_tok_s": rate(self.prompt_tokens, self.prefill_seconds),
            "decode_tok_s": rate(self.decode_tokens, self.decode_seconds),
        }


def _rate(count: float, seconds: float | None) -> float | None:
    return count / seconds if seconds else None


# ---- segserve -------------------------------------------------------------------------------------


@dataclass
class _Tally:
    """Per-step accounting of a segserve run (the prefill/decode split of the module docstring)."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_tokens: int = 0
    decode_tokens: int = 0
    cached_tokens: int = 0
    steps: int = 0
    seen: dict[str, int] = field(default_factory=dict)  # request id -> output tokens so far

    def record(self, seconds: float, prompt_tokens: int, outs: list) -> int:
        """Account one step; returns how many requests finished in it."""
        new = 0
        for out in outs:
            n = len(out.outputs[0].token_ids)
            new += n - self.seen.get(out.request_id, 0)
            self.seen[out.request_id] = n
        if prompt_tokens:
            self.prefill_s += seconds
        else:
            self.decode_s += seconds
            self.decode_tokens += new
        self.prompt_tokens += prompt_tokens
        self.steps += 1
        done = [o for o in outs if o.finished]
        self.cached_tokens += sum(o.num_cached_tokens for o in done)
        return len(done)


def run_segserve(engine: Any, workload: Workload, progress: bool = True) -> ThroughputResult:
    """All requests queued at once, then ``engine.step()`` until done (greedy, ``ignore_eos``).

    Raises:
        ValueError: the engine already has unfinished requests, or a request does not fit it.
    """
    from tqdm import tqdm

    from segserve import SamplingParams

    if engine.has_unfinished_requests():
        raise ValueError("the engine has unfinished requests; run the benchmark on an idle engine")
    _drain(engine, [("warmup", WARMUP_PROMPT, 2)])
    sched, tally = engine.scheduler, _Tally()
    start = time.perf_counter()
    for i, r in enumerate(workload.requests):
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        engine.add_request(f"r{i}", list(r.prompt_token_ids), params)
    with tqdm(total=len(workload.requests), desc="segserve", unit="req", disable=not progress) as bar:
        while engine.has_unfinished_requests():
            before, t0 = sched.make_stats().num_prompt_tokens_computed, time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            bar.update(tally.record(dt, sched.make_stats().num_prompt_tokens_computed - before, outs))
    seconds = time.perf_counter() - start
    return ThroughputResult(
        "segserve", len(workload.requests), tally.prompt_tokens, tally.cached_tokens,
        sum(tally.seen.values()), seconds, tally.prefill_s, tally.decode_s, tally.decode_tokens,
        {"steps": tally.steps, "engine": engine.describe()},
    )


def _drain(engine: Any, jobs: list[tuple[str, tuple[int, ...], int]]) -> None:
    from segserve import SamplingParams

    for rid, ids, n in jobs:
        engine.add_request(rid, list(ids), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


# ---- Hugging Face transformers --------------------------------------------------------------------


def load_hf_model(model_path: str | None, dtype: str = "float32") -> Any:
    """``transformers``' model for a segserve model argument (None: the default SmolLM2 GGUF), dense
    in ``dtype``: the correctness oracle and the speed baseline.

    transformers 5.2x keeps a GGUF file's quantized weights in their blocks and computes through its
    own float32 kernels unless told to dequantize; that model is neither the ``dtype`` oracle the
    parity tests compare with nor a fair baseline, so GGUF weights are dequantized at load (older
    releases always did).
    """
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    from segserve.models.loader import default_model_path

    path = Path(model_path) if model_path else default_model_path()
    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype)}
    if path.suffix == ".gguf":
        try:
            from transformers import GgufConfig
        except ImportError:  # releases without it always dequantize
            pass
        else:
            kwargs["quantization_config"] = GgufConfig(dequantize=True)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    return model.eval()


class _FirstTokenClock:
    """A ``generate`` streamer that notes when the first generated token arrives (the prompt is
    ``put`` first, then each step's tokens)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_time: float | None = None

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_time = time.perf_counter()

    def end(self) -> None:
        pass


def run_hf_static(
    model: Any, workload: Workload, batch_size: int = 16, progress: bool = True
) -> ThroughputResult:
    """Static batches of ``batch_size`` requests in workload order, left-padded, greedy; each batch
    runs until its longest request has its tokens.

    Raises:
        ValueError: ``batch_size`` < 1.
    """
    from tqdm import tqdm

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    reqs = list(workload.requests)
    _hf_generate(model, [WARMUP_PROMPT], 2)
    prefill = decode = 0.0
    start = time.perf_counter()
    for i in tqdm(range(0, len(reqs), batch_size), desc="hf static", unit="batch", disable=not progress):
        batch = reqs[i : i + batch_size]
        p, d = _hf_generate(model, [r.prompt_token_ids for r in batch], max(r.output_len for r in batch))
        prefill, decode = prefill + p, decode + d
    seconds = time.perf_counter() - start
    return ThroughputResult(
        "hf-static", len(reqs), workload.num_prompt_tokens, 0, workload.num_output_tokens, seconds,
        prefill, decode, sum(r.output_len - 1 for r in reqs), {"batch_size": batch_size},
    )


def _hf_generate(model: Any, prompts: list[tuple[int, ...]], max_new: int) -> tuple[float, float]:
    """One left-padded greedy batch; returns (seconds to the first token, seconds after it)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    clock = _FirstTokenClock()
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
            do_sample=False, eos_token_id=None, pad_token_id=0, streamer=clock,
        )
    end = time.perf_counter()
    first = clock.first_token_time or end
    return first - start, end - first


def hf_has_continuous_batching(model: Any) -> bool:
    """Whether the installed ``transformers`` offers ``generate_batch`` (continuous batching)."""
    return hasattr(model, "generate_batch") and hasattr(model, "continuous_batching_context_manager")


def run_hf_continuous(
    model: Any, workload: Workload, max_batch_tokens: int = 512, progress: bool = True
) -> ThroughputResult:
    """``transformers`` continuous batching (the manager behind ``generate_batch``), each request
    with its own ``max_new_tokens``; greedy, no EOS; ``max_batch_tokens`` per step like segserve's
    budget. Not split into prefill and decode.
    """
    from tqdm import tqdm
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    reqs = list(workload.requests)
    config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=2)
    # Its default sizes the cache from free memory (~20 s to set up here); the workload's own need
    # is enough and keeps set-up out of the comparison.
    page = 256
    pages = sum(-(-(len(r.prompt_token_ids) + r.output_len) // page) for r in reqs) + 1
    cb_config = ContinuousBatchingConfig(page_size=page, num_blocks=pages, max_batch_tokens=max_batch_tokens)
    model.generate_batch(
        [list(WARMUP_PROMPT)], generation_config=config, continuous_batching_config=cb_config,
        max_new_tokens=2,
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(r.prompt_token_ids) for r in reqs),
        max_generated_length=max(r.output_len for r in reqs),
        num_requests=len(reqs),
    )
    done: dict[str, Any] = {}
    start = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb_config, block=True, timeout=5,
        workload_hints=hints,
    ) as manager, tqdm(total=len(reqs), desc="hf cb", unit="req", disable=not progress) as bar:
        for i, r in enumerate(reqs):
            manager.add_request(list(r.prompt_token_ids), request_id=f"r{i}", max_new_tokens=r.output_len)
        while len(done) < len(reqs):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done[result.request_id] = result
                bar.update(1)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped early")
    seconds = time.perf_counter() - start
    out_tokens = sum(min(len(done[f"r{i}"].generated_tokens), r.output_len) for i, r in enumerate(reqs))
    return ThroughputResult(
        "hf-cb", len(reqs), workload.num_prompt_tokens, 0, out_tokens, seconds,
        extra={"max_batch_tokens": max_batch_tokens},
    )


# ---- reporting ------------------------------------------------------------------------------------


def ratios(ours: dict[str, Any], baseline: dict[str, Any]) -> dict[str, float | None]:
    """segserve's rate over the baseline's for each rate both have (>1: segserve faster)."""
    keys = ("requests_per_s", "output_tok_s", "total_tok_s", "prefill_tok_s", "decode_tok_s")
    return {k: ours[k] / baseline[k] if ours.get(k) and baseline.get(k) else None for k in keys}


def summary_line(ours: dict[str, Any], baselines: dict[str, dict[str, Any]]) -> str:
    """The one line ``segserve bench throughput`` prints."""

    def fmt(x: float | None, digits: int = 1) -> str:
        return "n/a" if x is None else f"{x:,.{digits}f}"

    line = (
        f"segserve throughput: {ours['num_requests']} requests, {ours['prompt_tokens']:,} prompt tokens "
        f"computed ({ours['cached_tokens']:,} cached), {ours['output_tokens']:,} generated in "
        f"{ours['seconds']:.1f} s: {fmt(ours['requests_per_s'], 2)} req/s, output "
        f"{fmt(ours['output_tok_s'])} tok/s, total {fmt(ours['total_tok_s'])} tok/s, prefill "
        f"{fmt(ours['prefill_tok_s'])} tok/s, decode {fmt(ours['decode_tok_s'])} tok/s"
    )
    for name, base in baselines.items():
        r = ratios(ours, base)
        line += (
            f" | vs {name}: output x{fmt(r['output_tok_s'], 2)}, total x{fmt(r['total_tok_s'], 2)}, "
            f"prefill x{fmt(r['prefill_tok_s'], 2)}, decode x{fmt(r['decode_tok_s'], 2)}"
        )
    return line
