"""Disaggregated prefill and decode pools (Splitwise, ISCA 2024; DistServe, OSDI 2024; Mooncake).

A request goes to a prefill replica, which computes its prompt and samples one token (``max_tokens``
1, the way vLLM's disaggregated-serving proxy drives its prefill instance). Its KV then crosses a link
in ``full prompt blocks * kv_bytes_per_token * block_size / link_bandwidth`` seconds and lands in a
decode replica's prefix cache (blocks written and registered by hash through the KV cache manager's
own ``allocate_slots``/``cache_blocks``/``free``, so they are evictable like any cached block). The
request is then queued on that decode replica, where the scheduler finds its prompt as a prefix hit,
recomputes the last partial block, and generates every output token the client sees; TTFT therefore
includes prefill, transfer and the decode side's first step. When the decode pool has no free blocks
for the transfer, the KV is dropped and the decode replica recomputes the prompt (counted in
``transfers_dropped``).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass

from segserve.config import EngineConfig
from segserve.core.request import Request
from segserve.sampling_params import SamplingParams
from segserve.simulator.cluster import Router, SimResult
from segserve.simulator.replica import Replica, RequestRecord
from segserve.simulator.step_model import StepTimeModel
from segserve.simulator.workload import TraceRequest, prompt_token_ids


@dataclass(frozen=True)
class DisaggConfig:
    """Pool sizes and the KV link.

    Attributes:
        num_prefill, num_decode: replicas in each pool (>= 1).
        link_bandwidth: bytes/s of the prefill-to-decode KV link (e.g. 50e9 for 400 Gb/s RDMA).
        kv_bytes_per_token: K and V bytes of one token over all layers.
    """

    num_prefill: int
    num_decode: int
    link_bandwidth: float
    kv_bytes_per_token: int

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError(
                f"each pool needs >= 1 replica, got {self.num_prefill} prefill, {self.num_decode} decode"
            )
        if self.link_bandwidth <= 0:
            raise ValueError(f"link_bandwidth must be > 0 bytes/s, got {self.link_bandwidth}")
        if self.kv_bytes_per_token < 1:
            raise ValueError(f"kv_bytes_per_token must be >= 1, got {self.kv_bytes_per_token}")


def inject_kv(replica: Replica, rid: str, token_ids: list[int]) -> bool:
    """Write a prompt's full blocks into the replica's prefix cache. Returns False when there is no room."""
    kv = replica.scheduler.kv_cache_manager
    full = len(token_ids) // kv.block_size * kv.block_size
    if full == 0:
        return True
    tmp = Request(f"{rid}-kv", token_ids[:full], SamplingParams(max_tokens=1), eos_token_id=None)
    if kv.allocate_slots(tmp, full) is None:
        return False
    kv.cache_blocks(tmp, full)
    kv.free(tmp)
    return True


def simulate_disaggregated(
    requests: list[TraceRequest],
    config: EngineConfig,
    num_kv_blocks: int,
    step_model: StepTimeModel,
    disagg: DisaggConfig,
    decode_config: EngineConfig | None = None,
) -> tuple[SimResult, dict[str, float]]:
    """Run the workload through a prefill pool and a decode pool.

    ``config``/``num_kv_blocks`` set the prefill replicas; ``decode_config`` (default: the same) the
    decode replicas, whose pool is its ``cache.num_kv_blocks`` when set.

    Returns:
        (result with the decode-side records in trace order and every step, with ``replica`` numbered
        prefill first then decode; transfer statistics: ``mean_transfer_ms``, ``transfers_dropped``).
    """
    pre = [Replica(config, num_kv_blocks, step_model, i) for i in range(disagg.num_prefill)]
    dec_cfg = decode_config or config
    dec_blocks = dec_cfg.cache.num_kv_blocks or num_kv_blocks
    dec = [Replica(dec_cfg, dec_blocks, step_model, disagg.num_prefill + i) for i in range(disagg.num_decode)]
    pre_router, dec_router = Router("least_loaded", len(pre)), Router("least_loaded", len(dec))
    prompts = [prompt_token_ids(r, i) for i, r in enumerate(requests)]
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    transfers: list[tuple[float, int]] = []  # (landing time, request index), a heap
    final: list[RequestRecord | None] = [None] * len(requests)
    steps, transfer_s, dropped, pos = [], [], 0, 0
    while pos < len(order) or transfers or any(r.busy for r in pre + dec):
        arrival = requests[order[pos]].arrival if pos < len(order) else math.inf
        landing = transfers[0][0] if transfers else math.inf
        busy = [r for r in pre + dec if r.busy]
        nxt = min(busy, key=lambda r: (r.clock, r.index)) if busy else None
        t_step = nxt.clock if nxt else math.inf
        if arrival <= min(landing, t_step):
            i = order[pos]
            pos += 1
            one = dataclasses.replace(requests[i], output_len=1)
            rec = pre_router.pick(one, pre).add(one, i, arrival, prompts[i])
            if rec.error:
                final[i] = dataclasses.replace(rec, output_len=requests[i].output_len)
        elif landing <= t_step:
            t, i = heapq.heappop(transfers)
            target = dec_router.pick(requests[i], dec)
            dropped += not inject_kv(target, f"r{i}", prompts[i])
            rec = target.add(requests[i], i, t, prompts[i])
            rec.arrival = requests[i].arrival
            final[i] = rec
        else:
            steps.append(nxt.step())
            if nxt in pre:
                for rec in nxt.just_finished:
                    i = int(rec.req_id[1:])
                    seconds = rec.input_len // config.cache.block_size * config.cache.block_size
                    seconds *= disagg.kv_bytes_per_token / disagg.link_bandwidth
                    transfer_s.append(seconds)
                    heapq.heappush(transfers, (rec.token_times[-1] + seconds, i))
    # The prefill pool's hits are the prefix-cache reuse; the decode pool "hits" every transferred prompt.
    stats = [r.scheduler.make_stats().prefix_cache for r in pre]
    queries = sum(s.queries for s in stats)
    hit = sum(s.hits for s in stats) / queries if queries else 0.0
    result = SimResult(
        [r for r in final if r is not None],
        steps,
        config,
        num_kv_blocks,
        disagg.num_prefill + disagg.num_decode,
        hit,
    )
    mean_ms = 1000 * sum(transfer_s) / len(transfer_s) if transfer_s else 0.0
    return result, {"mean_transfer_ms": mean_ms, "transfers_dropped": float(dropped)}
