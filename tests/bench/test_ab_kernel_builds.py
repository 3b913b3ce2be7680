"""benchmarks/ab_kernel_builds.py's variant specs (no build, no engine)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import ab_kernel_builds as ab  # noqa: E402


def test_a_variant_is_a_name_a_source_directory_and_flags(tmp_path) -> None:
    assert ab.parse_variant("now=") == ("now", None, [])
    assert ab.parse_variant(f"old={tmp_path}") == ("old", tmp_path, [])
    assert ab.parse_variant(f"x={tmp_path}:-DA=1 -DB") == ("x", tmp_path, ["-DA=1", "-DB"])
    assert ab.parse_variant("flags=:-DPAIR_MIN_ROW_TILES=1") == ("flags", None, ["-DPAIR_MIN_ROW_TILES=1"])


def test_a_bad_variant_is_refused_by_name(tmp_path) -> None:
    with pytest.raises(SystemExit, match="expected NAME=\\[DIR\\]\\[:FLAGS\\]"):
        ab.parse_variant("now")
    with pytest.raises(SystemExit, match="is not a directory"):
        ab.parse_variant(f"old={tmp_path / 'missing'}")


def test_the_same_name_twice_is_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        ab.main(["--variant", "a=", "--variant", "a="])
    assert "variant names must differ" in capsys.readouterr().err
