"""``AsyncLLMEngine``: one background thread steps an ``LLMEngine``; asyncio callers get a stream each.

``LLMEngine`` is not thread-safe, so every call into it (``add_request``, ``abort_request``, ``step``,
inspection for tests) runs on the engine thread: callers enqueue a command and the thread runs the
queued commands between steps. Outputs travel back through ``loop.call_soon_threadsafe`` (one call per
step and event loop) into the caller's ``asyncio.Queue``, so HTTP handlers never wait on a step. The
shape follows vLLM's ``AsyncLLM.generate`` (an async iterator of cumulative ``RequestOutput`` per
request; leaving the iterator early aborts the request).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from segserve.engine.llm_engine import LLMEngine, PromptType
from segserve.outputs import RequestOutput
from segserve.sampling_params import SamplingParams

logger = logging.getLogger("segserve")

# After handing a step's outputs to the event loop(s), the engine thread waits (GIL released) until the
# loop has run the hand-over and HANDOFF_HOPS more turns, at most HANDOFF_WAIT_S, before the next step.
# Without it the loop's per-token work (~0.2-0.3 ms of Python: the SSE chunk) ran while the next step's
# kernels held both cores, preempting one of their threads (docs/perf.md, "Twenty-third session": strace
# of the two threads). Batch-1 TPOT through the server vs offline, two runs of `python
# benchmarks/server_tpot.py --rounds 8|10 --server prev@<worktree>= --server now=`: 1.043 / 1.046 ->
# 1.013 / 1.020, loop wakes a token 5.2 / 4.1 -> 3.0 / 2.0; under `vllm bench serve`'s random workload
# (48 requests at 1.5 req/s) TTFT and ITL p50 within the runs' spread. Only steps that hand over at
# most HANDOFF_MAX_OUTPUTS outputs wait: with 32 streams the wait took the engine loop's time outside
# the model from ~3 % to 8.0 % of its steps (vs_vllm.py's server_overhead, s23c), where their kernels'
# preemption matters less than the wait.
HANDOFF_WAIT_S = 0.0005
HANDOFF_HOPS = 2
HANDOFF_MAX_OUTPUTS = 4
T = TypeVar("T")


class QueueFullError(RuntimeError):
    """The bounded waiting queue holds ``max_waiting_requests`` requests; the new one was refused."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped (an exception in ``step`` or a shutdown); no request can proceed."""


class ShuttingDownError(EngineDeadError):
    """The server is shutting down: its grace period ended and every request left was aborted."""


@dataclass(frozen=True)
class StepInfo:
    """What one engine step did, handed to step observers on the engine thread.

    Attributes:
        outputs: the requests that progressed (cumulative outputs, as ``LLMEngine.step`` returns).
        new_tokens: request id -> tokens generated this step, summed over its completions.
        now: ``time.monotonic()`` right after the step, seconds.
        engine: the engine (observers may read its scheduler stats; they must not mutate it).
    """

    outputs: list[RequestOutput]
    new_tokens: dict[str, int]
    now: float
    engine: LLMEngine


class StepObserver(Protocol):
    """Called on the engine thread after every step (metrics, the periodic log line)."""

    def on_step(self, info: StepInfo) -> None: ...

    def on_add(self, request_id: str, params: SamplingParams) -> None:
        """A request was accepted (its parameters, e.g. for ``vllm:request_params_max_tokens``)."""

    def on_abort(self, request_id: str) -> None:
        """A live request was aborted (it will send no final output)."""


# Most outputs a stream hands over one by one once its reader fell behind: past this many waiting, the
# older ones are coalesced into the newest (each is cumulative), so a slow reader costs at most this many
# outputs of memory. Up to it, every step's output reaches the reader, and a streamed response sends a
# chunk per step as vLLM's does when its server keeps up; with the kernels' threads on both cores the event
# loop lagged a step now and then even for one client, and two tokens went out in one chunk (a fresh
# user's trial, 2026-12-05).
MAX_PENDING_OUTPUTS = 4


class OutputStream:
    """One request's outputs, an async iterator of cumulative ``RequestOutput`` (ends when finished).

    Outputs that pile up while the reader is busy are handed over oldest first; beyond
    ``MAX_PENDING_OUTPUTS`` waiting, the older ones are coalesced (each is cumulative), so a slow reader
    costs bounded memory. ``abort_if_unfinished`` stops the request in the engine.
    A reader of several streams at once registers a callback with :meth:`listen` and takes outputs
    with :meth:`take_nowait` instead of iterating: the event loop then wakes that reader directly, one
    hop per token rather than a relay task's two (the server's per-token loop work shares the cores
    with the model's threads: docs/perf.md "Twentieth session").
    """

    def __init__(self, owner: AsyncLLMEngine, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.owner = owner
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self._listener: Callable[[], None] | None = None
        self._signalled = False  # the listener was called and the reader has not taken since

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        return self._next(await self.queue.get())

    def put(self, item: RequestOutput | BaseException) -> None:
        """On the loop's thread: queue an output, or the exception that ends the stream; call the
        listener unless it was called since the reader last took."""
        self.queue.put_nowait(item)
        if self._listener is not None and not self._signalled:
            self._signalled = True
            self._listener()

    def listen(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` on the loop's thread whenever an output waits (once until
        :meth:`take_nowait`); at once when outputs already wait."""
        self._listener = listener
        if not self.queue.empty():
            self._signalled = True
            listener()

    def take_nowait(self) -> RequestOutput | None:
        """The oldest waiting output (coalesced into a newer one when more than ``MAX_PENDING_OUTPUTS``
        wait), or None when none waits; the listener is called again when more wait.

        Raises:
            BaseException: the one that ended the stream (``EngineDeadError``, a step's failure)."""
        self._signalled = False
        if self.queue.empty():
            return None
        out = self._next(self.queue.get_nowait())
        if not self.queue.empty() and self._listener is not None:  # the rest: the reader's next turns
            self._signalled = True
            self._listener()
        return out

    def _next(self, item: RequestOutput | BaseException) -> RequestOutput:
        """``item`` (the oldest waiting), or past a backlog of ``MAX_PENDING_OUTPUTS`` a newer one."""
        while self.queue.qsize() >= MAX_PENDING_OUTPUTS and not isinstance(item, BaseException):
            item = self.queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def abort_if_unfinished(self) -> None:
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)


class AsyncLLMEngine:
    """Drive ``engine`` from a background thread; serve many concurrent asyncio callers.

    Args:
        engine: the engine to drive; from now on only the engine thread touches it.
        max_waiting_requests: bound on the scheduler's waiting queue (requests, counting each of
            ``n`` completions); a request arriving when it is full raises ``QueueFullError``.
        observers: called after every step on the engine thread.
        idle_poll_s: how long the idle thread sleeps between checks when nothing is queued, seconds.

    Raises:
        ValueError: ``max_waiting_requests`` < 1.
    """

    def __init__(
        self,
        engine: LLMEngine,
        max_waiting_requests: int = 256,
        observers: tuple[StepObserver, ...] = (),
        idle_poll_s: float = 0.5,
    ) -> None:
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.observers = list(observers)
        self.idle_poll_s = idle_poll_s
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            queue.SimpleQueue()
        )
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, OutputStream] = {}  # owned by the engine thread
        self._generated: dict[str, int] = {}  # request id -> tokens seen so far (engine thread)
        self._thread: threading.Thread | None = None
        self.dead: BaseException | None = None
        # Wall seconds of engine-loop iterations that ran a step (queued commands, the step, the
        # observers); against ``engine.model_seconds`` it gives the time spent outside the model.
        self.busy_seconds = 0.0
        self._closing: ShuttingDownError | None = None  # set by abort_all (engine thread)

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="segserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the thread after its current step; open streams end with ``EngineDeadError``."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    # ---- calls from any thread -------------------------------------------------------------------

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn()`` on the engine thread between steps; its result or exception lands in the future."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self.dead is not None or self._stop.is_set():
            fut.set_exception(EngineDeadError(f"the engine loop has stopped: {self.dead!r}"))
            return fut
        self._commands.put((fn, fut))
        self._wake.set()
        if self.dead is not None:  # the loop died after the check above: nobody else will drain
            self._run_commands_failed(EngineDeadError(f"the engine loop has stopped: {self.dead!r}"))
        return fut

    async def run(self, fn: Callable[[], T]) -> T:
        """Await ``fn()`` run on the engine thread (e.g. ``engine.check_integrity``)."""
        return await asyncio.wrap_future(self.call(fn))

    def abort_all(self, reason: str) -> concurrent.futures.Future[int]:
        """Abort every request and refuse new ones (the end of a shutdown's grace period): each open
        stream ends with ``ShuttingDownError(reason)``; their blocks are freed. The future holds how
        many requests were aborted."""
        return self.call(lambda: self._abort_all_now(ShuttingDownError(reason)))

    def abort(self, request_id: str) -> None:
        """Abort a request (its blocks are freed before the next step); does not wait."""
        self.call(lambda: self._abort_now(request_id))

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          cache_salt: str | None = None) -> OutputStream:
        """Add a request; returns its stream once the engine thread accepted it. ``cache_salt`` enters
        the hash of its first KV block, so requests with different salts never share cached blocks.

        Raises:
            ValueError: invalid prompt or parameters (from ``LLMEngine.add_request``); nothing queued.
            QueueFullError: the waiting queue is full; nothing queued.
            EngineDeadError: the engine loop stopped.
        """
        stream = OutputStream(self, request_id, asyncio.get_running_loop())
        try:
            await self.run(lambda: self._add_now(request_id, prompt, params, stream, cache_salt))
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may still run after the caller left
            raise
        return stream

    async def generate(
        self, request_id: str, prompt: PromptType, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """``add_request`` and yield its cumulative outputs until it finishes (vLLM's ``generate``).

        Leaving early (``break``, cancellation) aborts the request. Raises as ``add_request`` does.
        """
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort_if_unfinished()

    # ---- the engine thread -------------------------------------------------------------------------

    def _add_now(
        self, request_id: str, prompt: PromptType, params: SamplingParams, stream: OutputStream,
        cache_salt: str | None = None,
    ) -> None:
        if self._closing is not None:
            raise self._closing
        # Requests waiting for their grammar count as waiting: the bound holds for them too.
        waiting = len(self.engine.scheduler.waiting) + self.engine.num_awaiting_grammar
        if waiting + params.n > self.max_waiting_requests:
            raise QueueFullError(
                f"server busy: the waiting queue holds {waiting} requests and this one adds {params.n}, "
                f"above max_waiting_requests={self.max_waiting_requests}; retry later"
            )
        self.engine.add_request(request_id, prompt, params, cache_salt=cache_salt)
        self._streams[request_id] = stream
        self._generated[request_id] = 0
        for observer in self.observers:
            observer.on_add(request_id, params)

    def _abort_now(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is None:
            return  # finished or never added
        self.engine.abort_request(request_id)
        logger.info("aborted request %s", request_id)
        self._generated.pop(request_id, None)
        for observer in self.observers:
            observer.on_abort(request_id)

    def _abort_all_now(self, error: ShuttingDownError) -> int:
        self._closing = error
        ids = list(self._streams)
        for rid in ids:
            self._deliver(rid, error, last=True)
            self.engine.abort_request(rid)
            self._generated.pop(rid, None)
            for observer in self.observers:
                observer.on_abort(rid)
        if ids:
            logger.info("shutdown: aborted %d requests", len(ids))
        return len(ids)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.clear()
                t0 = time.perf_counter()
                self._run_commands()
                if self.engine.has_unfinished_requests():
                    self._step()
                    self.busy_seconds += time.perf_counter() - t0
                else:
                    self._wake.wait(self.idle_poll_s)
                    self._idle()
        except BaseException as exc:  # noqa: BLE001 - any failure ends every stream, then is logged
            logger.exception("engine loop failed")
            self.dead = exc
        self.dead = self.dead or EngineDeadError("the engine loop was shut down")
        self._fail_all(self.dead)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - handed to the caller through the future
                fut.set_exception(exc)

    def _step(self) -> None:
        outputs = self.engine.step()
        now = time.monotonic()
        new_tokens = {}
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[OutputStream, RequestOutput]]] = {}
        for out in outputs:
            total = sum(len(c.token_ids) for c in out.outputs)
            new_tokens[out.request_id] = total - self._generated.get(out.request_id, 0)
            self._generated[out.request_id] = total
            if out.finished:
                self._generated.pop(out.request_id, None)
            stream = self._stream_of(out.request_id, out.finished)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, out))
        # One hand-over per event loop and step, not per stream: each wakes the loop's thread, which
        # then competes with this thread for the GIL and with the kernels' threads for the cores.
        done = threading.Event() if by_loop and len(outputs) <= HANDOFF_MAX_OUTPUTS else None
        for loop, items in by_loop.items():
            self._post(loop, items, done)
        if done is not None:
            done.wait(HANDOFF_WAIT_S)
        info = StepInfo(outputs, new_tokens, now, self.engine)
        for observer in self.observers:
            observer.on_step(info)

    def _idle(self) -> None:
        """Observers also hear about idle periods (the log line keeps its cadence)."""
        info = StepInfo([], {}, time.monotonic(), self.engine)
        for observer in self.observers:
            observer.on_step(info)

    def _stream_of(self, request_id: str, last: bool) -> OutputStream | None:
        """The request's open stream (forgotten when ``last``), or None if it has none."""
        return self._streams.pop(request_id, None) if last else self._streams.get(request_id)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException, last: bool) -> None:
        stream = self._stream_of(request_id, last)
        if stream is not None:
            self._post(stream.loop, [(stream, item)])

    def _post(self, loop: asyncio.AbstractEventLoop,
              items: list[tuple[OutputStream, RequestOutput | BaseException]],
              done: threading.Event | None = None) -> None:
        """Queue ``items`` into their streams on ``loop``, in one call from this thread."""
        try:
            loop.call_soon_threadsafe(_put_all, items, done)
        except RuntimeError:  # the caller's event loop is closed: nobody will read these requests
            for stream, _ in items:
                self.engine.abort_request(stream.request_id)
                self._streams.pop(stream.request_id, None)

    def _fail_all(self, exc: BaseException) -> None:
        error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(f"engine loop failed: {exc!r}")
        for rid in list(self._streams):
            self._deliver(rid, error, last=True)
        self._run_commands_failed(error)

    def _run_commands_failed(self, error: EngineDeadError) -> None:
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                fut.set_exception(error)


def _put_all(items: list[tuple[OutputStream, RequestOutput | BaseException]],
             done: threading.Event | None = None) -> None:
    """On the streams' event loop: hand each output to its stream."""
    for stream, item in items:
        stream.put(item)
    if done is not None:
        asyncio.get_running_loop().call_soon(_set_later, done, HANDOFF_HOPS)


def _set_later(done: threading.Event, hops: int) -> None:
    if hops <= 0:
        done.set()
    else:
        asyncio.get_running_loop().call_soon(_set_later, done, hops - 1)
