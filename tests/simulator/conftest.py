"""Every simulator test gets an empty profile cache of its own: a profile cached on the machine that
runs the tests must not change what they simulate."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def empty_profile_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SEGSERVE_CACHE_DIR", str(tmp_path / "segserve-cache"))
    return tmp_path / "segserve-cache" / "profiles"
