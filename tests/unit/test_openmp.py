"""segserve sets libgomp's spin count before torch starts, unless the user chose or it is too late."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from segserve import openmp

PROBE = (
    "import os, sys\n{pre}import segserve\n"
    "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))\n"
)


def _run(pre: str = "", **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", PROBE.format(pre=pre)], env=base | env, capture_output=True,
                         text=True, check=True)
    return out.stdout.strip()


def test_importing_segserve_first_sets_the_spin_count() -> None:
    assert _run() == f"{openmp.SPIN_COUNT} None"


@pytest.mark.parametrize(("env", "seen"), [({"GOMP_SPINCOUNT": "300000"}, "300000 None"),
                                           ({"OMP_WAIT_POLICY": "ACTIVE"}, "None ACTIVE")])
def test_the_users_setting_stands(env, seen) -> None:
    assert _run(**env) == seen


def test_after_torch_it_changes_nothing() -> None:
    # libgomp read its settings when torch loaded it; a later change would only mislead.
    assert _run(pre="import torch\n") == "None None"


@pytest.mark.parametrize(("env", "seen"), [({}, "libgomp default"),
                                           ({"GOMP_SPINCOUNT": "10000"}, "GOMP_SPINCOUNT=10000"),
                                           ({"GOMP_SPINCOUNT": "5", "OMP_WAIT_POLICY": "PASSIVE"},
                                            "GOMP_SPINCOUNT=5, OMP_WAIT_POLICY=PASSIVE")])
def test_wait_setting_names_what_libgomp_runs_with(monkeypatch, env, seen) -> None:
    for var in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert openmp.wait_setting() == seen
