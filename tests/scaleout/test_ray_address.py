"""``segserve serve --ray-address``: replicas on a cluster someone else started (``ray start --head``
on loopback, with Ray token authentication, in a temp dir), answering the ``openai`` client; on SIGTERM
segserve removes its app, its metrics board and the Serve it started, and leaves the cluster running.
Refused in one line naming the flag: joining without ``RAY_AUTH_MODE=token``, a second ingress on the
same cluster, a port that is no Ray cluster. The cluster is stopped by the ids of its processes
(``ray stop`` would stop every Ray process of this user on the machine)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from segserve.entrypoints.openai.api_server import bind_socket
from tests.scaleout.test_cli import _alive, _listening_addresses, _loopback

REPO = Path(__file__).resolve().parents[2]
SERVED = "tiny-ext"


def _free_port() -> int:
    sock = bind_socket("127.0.0.1", 0)
    try:
        return sock.getsockname()[1]
    finally:
        sock.close()


def _pids_of(temp_dir: str, address: str) -> list[int]:
    """The cluster's processes: every Ray daemon names its session dir on its command line, the Ray
    Client server its GCS address; the agents (renamed by Ray) are children of the raylet."""
    import psutil

    found = set()
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmdline = p.info["cmdline"] or ()
            if any(temp_dir in part or part == f"--address={address}" for part in cmdline):
                found |= {p.info["pid"], *(c.pid for c in p.children(recursive=True))}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return sorted(found)


def _stop_cluster(pids: list[int]) -> None:
    for sig, wait_s in ((signal.SIGTERM, 2), (signal.SIGKILL, 5)):
        for pid in _alive(pids):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while _alive(pids) and time.monotonic() < deadline:
            time.sleep(0.2)


def _cluster_state(address: str, env: dict) -> dict:
    """What a fresh driver (joined as segserve joins) sees: Serve's applications and the named actors."""
    code = ("import json, ray; from segserve.entrypoints.ray_serve.join import join; "
            f"join({address!r}); from ray import serve; "
            "names = sorted(a['name'] for a in ray.util.list_named_actors(all_namespaces=True)); "
            "print('STATE', json.dumps({'apps': sorted(serve.status().applications), 'actors': names}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    line = next((x for x in out.stdout.splitlines() if x.startswith("STATE ")), None)
    assert line is not None, out.stdout + out.stderr
    import json

    return json.loads(line[6:])


@pytest.fixture(scope="module")
def external_cluster():
    """(GCS address, env for segserve, its process ids) of a 2-CPU head node: every service on 127.0.0.1
    (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: Ray's single-machine mode, which segserve's env does
    not carry: segserve must see it for itself) and Ray token authentication, with a token of its own."""
    tmp = tempfile.mkdtemp(prefix="sext-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}, **auth,
           "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    port = _free_port()
    ray_cli = str(Path(sys.executable).with_name("ray"))
    cmd = [ray_cli, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
           "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={tmp}",
           f"--ray-client-server-port={_free_port()}"]
    subprocess.run(cmd, env={**env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}, check=True,
                   capture_output=True, timeout=120)
    address = f"127.0.0.1:{port}"
    pids = _pids_of(tmp, address)
    try:
        yield address, env, pids
    finally:
        _stop_cluster(sorted(set(_pids_of(tmp, address) + pids)))
        shutil.rmtree(tmp, ignore_errors=True)
    assert _alive(pids) == []


def _serve_cmd(tiny_dir: str, address: str) -> list[str]:
    from tests.server.conftest import TINY_ENGINE

    return [sys.executable, "-m", "segserve.entrypoints.cli", "serve", "--model", tiny_dir, "--port", "0",
            "--served-model-name", SERVED, "--num-replicas", "2", "--replica-cpus", "1",
            "--ray-address", address, *(f"--{k.replace('_', '-')}={v}" for k, v in TINY_ENGINE.items())]


def _read_until(proc: subprocess.Popen, text: str, lines: list[str], timeout_s: float) -> None:
    """Read ``proc``'s output into ``lines`` until a line holds ``text``; fail after ``timeout_s`` (a
    join that hangs in Ray's retries must fail the test, not block it)."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    fd, pending = proc.stdout.fileno(), b""  # raw reads: a buffered readline could hide a line from select
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not sel.select(timeout=1.0):
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        *done, pending = (pending + chunk).split(b"\n")
        lines.extend(x.decode(errors="replace") for x in done)
        if any(text in x for x in lines):
            return
    raise AssertionError(f"no {text!r} within {timeout_s} s:\n" + "\n".join(lines))


def _fails_in_one_line(cmd: list[str], env: dict, timeout_s: float = 60) -> str:
    """The one stderr line of a start-up that must fail (exit status 2) within ``timeout_s``."""
    t0 = time.monotonic()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert out.returncode == 2 and lines, (out.returncode, out.stderr)
    assert time.monotonic() - t0 < timeout_s
    return lines[-1]


@pytest.mark.ray
@pytest.mark.slow
def test_serve_joins_an_external_cluster_and_leaves_it_running(tiny_dir, external_cluster):
    import openai

    from segserve import LLM, SamplingParams
    from tests.server.conftest import TINY_ENGINE

    address, env, cluster_pids = external_cluster
    assert len(cluster_pids) >= 2 and all(_loopback(a) for a in _listening_addresses(cluster_pids))
    # Alongside (to share the wait): the same start-up without RAY_AUTH_MODE=token is refused.
    bare = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
    no_token = subprocess.Popen(_serve_cmd(tiny_dir, address), env=bare, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    proc = subprocess.Popen(_serve_cmd(tiny_dir, address), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        _read_until(proc, "serving on http://", lines, timeout_s=240)
        base = next(x for x in lines if "serving on http://" in x).split("serving on ")[1].strip()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        prompt = "The quick brown fox jumps over the lazy dog."
        got = client.completions.create(model=SERVED, prompt=prompt, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        offline = LLM(tiny_dir, **TINY_ENGINE)
        assert got.choices[0].text == offline.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
        assert got.usage.completion_tokens == 6
        messages = [{"role": "user", "content": "hi"}]
        stream = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=5, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                            use_tqdm=False)
        assert text == want[0].outputs[0].text
        _, err = no_token.communicate(timeout=60)
        assert no_token.returncode == 2 and err.strip().splitlines()[-1] == (
            f"error: --ray-address {address}: the cluster uses Ray token authentication and refused this "
            "process: set RAY_AUTH_MODE=token and give the cluster's token (RAY_AUTH_TOKEN, "
            "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"), err
        during = _cluster_state(address, env)
        # A second ingress on the same cluster would replace this one's replicas: refused.
        second = _fails_in_one_line(_serve_cmd(tiny_dir, address), env)
        assert second == (f"error: --ray-address {address}: the cluster already runs a Serve app named "
                          "'segserve' (another segserve serve?); stop that one first")
        assert client.completions.create(model=SERVED, prompt="still", max_tokens=2).usage.completion_tokens
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "\n".join(lines) + proc.stdout.read()
    finally:
        for p in (proc, no_token):
            if p.poll() is None:
                p.kill()
    assert "segserve" in during["apps"] and "segserve-metrics-board" in during["actors"]
    assert len([a for a in during["actors"] if a.startswith("SERVE_REPLICA::segserve#")]) == 2
    assert _alive(cluster_pids) == cluster_pids  # the cluster runs on
    # As found (a fresh cluster): no app, no board, no replica, no Serve controller left behind.
    assert _cluster_state(address, env) == {"apps": [], "actors": []}


@pytest.mark.ray
def test_a_port_that_is_not_ray_fails_in_one_line(capsys):
    from segserve.entrypoints.cli import main

    sock = bind_socket("127.0.0.1", 0)  # accepts TCP (the backlog), never speaks gRPC
    address = f"127.0.0.1:{sock.getsockname()[1]}"
    try:
        t0 = time.monotonic()
        assert main(["serve", "--max-num-batched-tokens", "256", "--num-replicas", "2", "--replica-cpus", "1",
                     "--ray-address", address]) == 2
        assert time.monotonic() - t0 < 15
    finally:
        sock.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --ray-address {address}: something listens there but it is not a Ray cluster "
                   "(no gRPC answer in 3 s)"]
