"""``segserve serve`` scale-out flags: bad ones fail at start-up with one line naming the flag (no Ray
started, no model loaded); SIGTERM stops Ray and every replica it started."""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from segserve.entrypoints.cli import main
from segserve.entrypoints.ray_serve.settings import machine_cpus


@pytest.mark.parametrize("flags, message", [
    (["--num-replicas", "0"], "error: --num-replicas must be >= 1, got 0"),
    (["--num-replicas", "2", "--replica-cpus", "0"], "error: --replica-cpus must be >= 1, got 0"),
    (["--num-replicas", "2", "--replica-cpus", "4096"],
     f"error: --replica-cpus 4096 x --num-replicas 2 = 8192 CPUs, more than this machine's {machine_cpus()}"),
    (["--num-replicas", "2", "--router-match-rate-threshold", "2"],
     "error: --router-match-rate-threshold must be in [0, 1], got 2.0"),
    (["--ray-address", "127.0.0.1:1"], "error: --ray-address 127.0.0.1:1: unreachable ("),
])
def test_bad_flags_fail_in_one_line(flags, message, capsys):
    t0 = time.monotonic()
    assert main(["serve", "--max-num-batched-tokens", "256", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err
    assert time.monotonic() - t0 < 10


def _alive(pids: list[int]) -> list[int]:
    import psutil

    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def _listening_addresses(pids: list[int]) -> set[str]:
    import psutil

    out = set()
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out |= {c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN}
    return out


@pytest.mark.ray
@pytest.mark.slow
def test_sigterm_stops_ray_and_replicas(tiny_dir):
    pytest.importorskip("ray")
    # The cluster's session dir lands here; short, as Ray's socket paths must fit 107 bytes.
    tmp = tempfile.mkdtemp(prefix="ssig-", dir="/tmp")
    try:
        _serve_then_sigterm(tiny_dir, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _serve_then_sigterm(tiny_dir: str, tmp: str) -> None:
    env = {**os.environ, "TMPDIR": tmp}
    cmd = [sys.executable, "-m", "segserve.entrypoints.cli", "serve", "--model", tiny_dir, "--port", "0",
           "--num-replicas", "2", "--replica-cpus", "1", "--max-num-batched-tokens", "256",
           "--max-model-len", "128", "--num-kv-blocks", "65"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, family = [], []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "serving on http://" in line or not line:
                break
        assert any("serving on http://" in x for x in lines), "".join(lines)
        import psutil

        # Ray's daemons, its workers (the replicas among them) and the ingress: all under this process.
        family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert len(family) >= 5, family  # gcs_server, raylet, controller, 2 replicas, ...
        addrs = _listening_addresses(family)
        assert addrs and all(_loopback(a) for a in addrs), addrs  # every Ray service on loopback only
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(lines) + proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 30
    while _alive(family) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _alive(family) == []


def test_one_replica_needs_no_ray():
    code = ("import sys; from segserve.entrypoints.cli import build_parser; "
            "from segserve.entrypoints.ray_serve.settings import wants_ray; "
            "a = build_parser().parse_args(['serve']); "
            "print(wants_ray(a), a.num_replicas, 'ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "1", "False"]
    code2 = code.replace("['serve']", "['serve', '--num-replicas', '2']")
    two = subprocess.run([sys.executable, "-c", code2], capture_output=True, text=True, check=True).stdout
    assert two.split() == ["True", "2", "False"]  # flags parsed, Ray still not imported
