"""Bounded shutdown of the server on SIGTERM or SIGINT.

On the first signal the server stops accepting connections and closes idle ones (uvicorn's own
shutdown), and in-flight requests get ``grace_s`` seconds to finish. Then every request still in the
engine is aborted: a streaming client gets an error event and ``[DONE]``, a waiting client a 503, so
nobody hangs. Half a second later uvicorn cancels what is left (e.g. a client that sent half a request
and stalled), the caller shuts the engine down, and the process exits 0: the signal is handled, not
re-raised as uvicorn does (which skipped the engine's shutdown and exited 143). A second SIGINT or
SIGTERM exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from segserve.entrypoints.openai.limits import DEFAULT_GRACE_S

if TYPE_CHECKING:
    from segserve.engine.async_engine import AsyncLLMEngine

log = logging.getLogger("segserve")
# Between aborting the engine's requests and cancelling the connections still open: time for the
# aborted streams to send their last event.
_CANCEL_AFTER_ABORT_S = 0.5


class GracefulServer(uvicorn.Server):
    """A uvicorn server whose shutdown is bounded by ``grace_s`` and ends with exit status 0.

    Args:
        config: uvicorn's config (its ``timeout_graceful_shutdown`` is set from ``grace_s``).
        engine: the async engine whose requests are aborted when the grace period ends.
        grace_s: seconds in-flight requests may still run after the signal.

    Raises:
        ValueError: ``grace_s`` < 0.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine,
                 grace_s: float = DEFAULT_GRACE_S) -> None:
        if grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        config.timeout_graceful_shutdown = grace_s + _CANCEL_AFTER_ABORT_S
        super().__init__(config)
        self.engine = engine
        self.grace_s = grace_s
        self.signalled = threading.Event()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Unlike uvicorn's, records no signal to re-raise after the server stops (that killed the
        # process before the engine's shutdown, with status 128 + signal).
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True
        self.signalled.set()

    async def shutdown(self, sockets=None) -> None:
        log.info("shutting down: in-flight requests have %.1f s to finish", self.grace_s)
        abort = asyncio.ensure_future(self._abort_after_grace())
        try:
            await super().shutdown(sockets)
        finally:
            abort.cancel()

    async def _abort_after_grace(self) -> None:
        await asyncio.sleep(self.grace_s)
        try:
            count = await asyncio.wrap_future(self.engine.abort_all("the grace period after the stop signal "
                                                                    "ended; the request was aborted"))
        except Exception:  # noqa: BLE001 - a dead engine has no request left to abort
            return
        log.info("grace period over: aborted %d requests", count)


def serve(app, sock, engine: AsyncLLMEngine, grace_s: float, log_level: str = "info") -> None:
    """Serve ``app`` on the listening ``sock`` until SIGTERM/SIGINT, then shut down within the grace
    period and shut the engine down. Returns normally (the caller exits 0)."""
    server = GracefulServer(uvicorn.Config(app, log_level=log_level), engine, grace_s)
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
    if server.signalled.is_set():
        log.info("stopped after a signal (SIGTERM/SIGINT); engine shut down")



def exit_now(status: int = 0) -> None:
    """End the process with ``status`` once the server and the engine are shut down: logs and standard
    streams are flushed, then the interpreter's teardown is skipped. Unloading torch and transformers
    takes 1-3 s on a busy machine, which would push the exit past the grace period a supervisor
    allows; nothing is left to save by then."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be written anyway
            pass
    os._exit(status)
