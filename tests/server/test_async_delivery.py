"""``AsyncLLMEngine`` hands each step's outputs to an event loop in one ``call_soon_threadsafe``: every
such call wakes the loop's thread, which then takes the GIL and a core from the engine's kernels."""

from __future__ import annotations

import asyncio
import threading

from segserve import LLMEngine, SamplingParams
from segserve.engine import async_engine
from segserve.engine.async_engine import AsyncLLMEngine
from tests.server.conftest import TINY_ENGINE


def test_one_hand_over_per_step_carries_every_stream_that_progressed(tiny_loaded, tiny_offline):
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in tiny_offline.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    engine = AsyncLLMEngine(LLMEngine(tiny_loaded, **TINY_ENGINE))
    engine.start()
    hand_overs: list[int] = []  # streams per call that delivered outputs

    async def run() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counting(fn, *args, **kw):
            if fn is async_engine._put_all:
                hand_overs.append(len(args[0]))
            return real(fn, *args, **kw)

        loop.call_soon_threadsafe = counting
        gate = threading.Event()
        engine.call(gate.wait)  # holds the engine thread so that the three requests start together
        adds = [asyncio.ensure_future(engine.add_request(f"r{i}", {"prompt_token_ids": p}, params))
                for i, p in enumerate(prompts)]
        await asyncio.sleep(0.05)
        gate.set()
        streams = await asyncio.gather(*adds)
        finals = []
        for stream in streams:
            async for out in stream:
                last = out
            finals.append(list(last.outputs[0].token_ids))
        return finals

    try:
        assert asyncio.run(run()) == expected
    finally:
        engine.shutdown()
    # Prompts fit one step, then 3 decode steps: 4 steps, each handing all 3 streams over at once.
    assert hand_overs == [3, 3, 3, 3]
