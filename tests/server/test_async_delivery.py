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


class _Out:
    """A stand-in ``RequestOutput``: what ``OutputStream`` reads of one is ``finished``."""

    def __init__(self, n: int, finished: bool = False) -> None:
        self.n, self.finished = n, finished


class _Owner:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def test_a_listened_stream_signals_once_until_taken_and_hands_over_each_output() -> None:
    """Outputs that wait are handed over oldest first, one a take, the listener called again while more
    wait: a streamed response then sends a chunk per step (vLLM's), where it coalesced every waiting
    output into the newest and sent two tokens in one chunk (a fresh user's trial, 2026-12-05)."""
    async def run() -> None:
        stream = async_engine.OutputStream(_Owner(), "r", asyncio.get_running_loop())
        stream.put(_Out(1))
        calls: list[int] = []
        stream.listen(lambda: calls.append(len(calls)))
        assert calls == [0]  # an output already waited
        stream.put(_Out(2))
        assert calls == [0]  # not taken since the last signal
        assert stream.take_nowait().n == 1 and calls == [0, 1]  # output 2 still waits: signalled again
        assert stream.take_nowait().n == 2 and calls == [0, 1]
        assert stream.take_nowait() is None and calls == [0, 1]
        stream.put(_Out(3, finished=True))
        assert calls == [0, 1, 2]
        assert stream.take_nowait().n == 3 and stream.finished
        stream.abort_if_unfinished()  # finished: nothing to abort
        assert stream.owner.aborted == []

    asyncio.run(run())


def test_a_reader_far_behind_gets_the_backlog_coalesced() -> None:
    """Past MAX_PENDING_OUTPUTS waiting, the older outputs are coalesced into a newer one (each is
    cumulative): a slow reader holds at most that many outputs, and catches up."""
    async def run() -> None:
        stream = async_engine.OutputStream(_Owner(), "r", asyncio.get_running_loop())
        stream.listen(lambda: None)
        limit = async_engine.MAX_PENDING_OUTPUTS
        for n in range(1, limit + 7):  # limit + 6 outputs wait
            stream.put(_Out(n))
        taken = [stream.take_nowait().n for _ in range(limit)]
        assert taken == list(range(7, limit + 7)) and stream.take_nowait() is None
        # The iterator takes the same way.
        for n in (1, 2):
            stream.put(_Out(n, finished=n == 2))
        assert [out.n async for out in stream] == [1, 2]

    asyncio.run(run())


def test_a_stream_ended_by_an_exception_raises_it_on_take() -> None:
    """The outputs queued before the exception are taken first, then the exception is raised."""
    async def run() -> None:
        stream = async_engine.OutputStream(_Owner(), "r", asyncio.get_running_loop())
        stream.listen(lambda: None)
        stream.put(_Out(1))
        stream.put(async_engine.EngineDeadError("gone"))
        assert stream.take_nowait().n == 1 and not stream.finished
        try:
            stream.take_nowait()
        except async_engine.EngineDeadError as exc:
            assert str(exc) == "gone" and stream.finished
        else:
            raise AssertionError("the stream's exception was not raised")

    asyncio.run(run())


def test_the_server_reads_its_streams_with_no_relay_task(tiny_loaded, tiny_offline):
    """``until_disconnected`` runs beside one task only, the disconnect watcher: the streams wake it
    directly (a relay task per stream cost the event loop a second wake-up per token)."""
    from segserve.entrypoints.openai.serving import until_disconnected

    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in tiny_offline.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    engine = AsyncLLMEngine(LLMEngine(tiny_loaded, **TINY_ENGINE))
    engine.start()

    class Connected:
        async def receive(self) -> dict:
            await asyncio.Event().wait()  # the client never leaves

    async def run() -> tuple[list[list[int]], list[int]]:
        streams = [await engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
                   for i, p in enumerate(prompts)]
        finals: list[list[int]] = [[], []]
        tasks_seen = []
        async for i, out in until_disconnected(streams, Connected()):
            finals[i] = list(out.outputs[0].token_ids)
            tasks_seen.append(len(asyncio.all_tasks()))
        return finals, tasks_seen

    try:
        finals, tasks_seen = asyncio.run(run())
    finally:
        engine.shutdown()
    assert finals == expected
    assert set(tasks_seen) == {2}  # this coroutine's task and the watcher


def test_the_hand_over_signals_the_engine_after_the_readers_turn() -> None:
    """The engine thread waits (bounded) for the loop's hand-over before its next step, so the loop's
    per-token work does not run inside the kernels (docs/perf.md, "Twenty-third session"). The signal
    comes after the hand-over and HANDOFF_HOPS more turns of the loop: a reader woken by the hand-over
    has taken its output by then."""
    async def run() -> None:
        loop = asyncio.get_running_loop()
        stream = async_engine.OutputStream(_Owner(), "r", loop)
        got: list[int] = []
        woken = asyncio.Event()
        stream.listen(woken.set)

        async def reader() -> None:
            await woken.wait()
            got.append(stream.take_nowait().n)

        task = asyncio.ensure_future(reader())
        await asyncio.sleep(0)  # the reader waits
        done = threading.Event()
        async_engine._put_all([(stream, _Out(1))], done)
        assert not done.is_set() and got == []  # not before the reader's turn
        for _ in range(async_engine.HANDOFF_HOPS + 1):
            await asyncio.sleep(0)
        assert done.is_set() and got == [1]
        await task

    asyncio.run(run())
    assert 0 < async_engine.HANDOFF_WAIT_S <= 0.001  # bounded: a busy loop cannot hold the engine up


def test_only_steps_of_a_few_outputs_wait_for_the_hand_over(monkeypatch) -> None:
    """A step of 32 streams waited up to HANDOFF_WAIT_S each step for a hand-over that takes longer
    (the loop's time outside the model rose from ~3 % to 8 %); only steps of at most
    HANDOFF_MAX_OUTPUTS outputs pass an event to wait on."""
    posted: list[object] = []

    class Loop:
        def call_soon_threadsafe(self, fn, items, done):
            posted.append(done)

    class Stream:
        loop = Loop()

    def step_with(n: int) -> object:
        eng = AsyncLLMEngine.__new__(AsyncLLMEngine)  # only what _step reads
        outs = [_Out(i) for i in range(n)]
        for i, o in enumerate(outs):
            o.request_id, o.outputs = f"r{i}", []
        eng.engine = type("E", (), {"step": lambda self: outs})()
        eng._generated, eng.observers = {}, []
        eng._streams = {f"r{i}": Stream() for i in range(n)}
        posted.clear()
        eng._step()
        return posted[0]

    assert isinstance(step_with(async_engine.HANDOFF_MAX_OUTPUTS), threading.Event)
    assert step_with(async_engine.HANDOFF_MAX_OUTPUTS + 1) is None
