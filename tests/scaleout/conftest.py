"""One local Ray cluster per module; the tiny random Llama of the server tests, saved to disk so that
replica processes can load it; a deployment per router, served by an in-process uvicorn ingress."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

ray = pytest.importorskip("ray")
from ray import cloudpickle  # noqa: E402

from segserve.engine_args import EngineArgs  # noqa: E402
from segserve.entrypoints.ray_serve import launch  # noqa: E402
from segserve.entrypoints.ray_serve.ingress import Ingress  # noqa: E402
from segserve.entrypoints.ray_serve.settings import ScaleOut  # noqa: E402
from tests.server.conftest import TINY_ENGINE  # noqa: E402
from tests.server.harness import SERVED_NAME  # noqa: E402

NUM_REPLICAS = 2
STEP_DELAY_S = 0.02


class StepDelay:
    """Step observer sleeping after each step with output, so that tests can act mid-request on a
    tiny model whose steps take milliseconds (shipped to the replicas by value, see below)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def on_step(self, info) -> None:
        if info.outputs:
            time.sleep(self.delay_s)

    def on_add(self, request_id: str, params) -> None:
        pass

    def on_abort(self, request_id: str) -> None:
        pass


# Replica processes need not import the tests package: StepDelay travels by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from tests.model_fixtures import save_tiny_hf_dir, tiny_hf_model, train_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny_llama_ray")
    save_tiny_hf_dir(path, tiny_hf_model(), train_tiny_tokenizer())
    return str(path)


def scale_for(router: str) -> ScaleOut:
    # Logical CPUs: a 2-core CI machine still places 2 one-CPU replicas (the cluster gets 4).
    return ScaleOut(NUM_REPLICAS, 1, router, 16, 0.1, None, available_cpus=4)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local cluster (loopback only, no dashboard), stopped after the module."""
    started = launch.start_ray(scale_for("round_robin"), num_cpus=4)
    yield
    launch.stop(started, None)


@contextmanager
def deployed(tiny_dir: str, router: str) -> Iterator[tuple[str, object]]:
    """(base URL, app name) of 2 replicas behind an ingress on 127.0.0.1 and a free port."""
    import uvicorn

    from segserve.entrypoints.openai.api_server import bind_socket

    scale = scale_for(router)
    spec = launch.ReplicaSpec(EngineArgs(model=tiny_dir, **TINY_ENGINE), [SERVED_NAME], 256, 5.0, "given",
                              TINY_ENGINE["max_num_seqs"], observers=(StepDelay(STEP_DELAY_S),))
    app_name = f"segserve-{router}"
    handle, board = launch.deploy(scale, spec, app_name)
    app = Ingress(handle, lambda: launch.replica_counts(NUM_REPLICAS, app_name), board).app()
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app_name
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
        from ray import serve

        serve.delete(app_name)
        ray.kill(board)
