"""A real server process for the shutdown tests: the tiny model at ``argv[1]``, each engine step
slowed to ``argv[3]`` seconds (so a generation outlives the grace period), served by the same
``shutdown.serve`` that ``segserve serve`` runs, with the grace period ``argv[2]``. Prints
``PORT <n>`` once listening; exits as ``segserve serve`` does (``exit_now``)."""

from __future__ import annotations

import logging
import sys
import time


class _SlowSteps:
    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def on_step(self, info) -> None:
        if info.outputs:
            time.sleep(self.delay_s)

    def on_add(self, request_id: str, params) -> None:
        pass

    def on_abort(self, request_id: str) -> None:
        pass


def main() -> None:
    from segserve import LLMEngine
    from segserve.entrypoints.openai.api_server import bind_socket, make_server
    from segserve.entrypoints.openai.shutdown import exit_now, serve
    from segserve.models.loader import load_model
    from tests.server.conftest import TINY_ENGINE
    from tests.server.harness import SERVED_NAME

    model_dir, grace_s, step_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(message)s")
    app, engine = make_server(LLMEngine(load_model(model_dir), **TINY_ENGINE), [SERVED_NAME])
    engine.observers.append(_SlowSteps(step_s))
    sock = bind_socket("127.0.0.1", 0)
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    serve(app, sock, engine, grace_s, log_level="warning")
    exit_now(0)


if __name__ == "__main__":
    main()
