"""The kernel families' on/off switches and the build key's coverage of headers."""

from __future__ import annotations

from pathlib import Path

import pytest

from segserve.kernels import amx, build, chunk_attention
from segserve.kernels import cpu as cpu_kernels
from segserve.kernels.switch import Switch, env_on


@pytest.mark.parametrize(("value", "on"), [(None, True), ("1", True), ("0", False), ("off", False),
                                            (" No ", False), ("false", False), ("yes", True)])
def test_env_on_reads_the_documented_off_words(monkeypatch, value, on) -> None:
    if value is None:
        monkeypatch.delenv("SEGSERVE_TEST_SWITCH", raising=False)
    else:
        monkeypatch.setenv("SEGSERVE_TEST_SWITCH", value)
    assert env_on("SEGSERVE_TEST_SWITCH") is on
    assert Switch("SEGSERVE_TEST_SWITCH").on is on


def test_switch_off_restores_the_previous_setting_even_on_error() -> None:
    s = Switch("SEGSERVE_TEST_SWITCH_UNSET")
    assert s.set(False) is True and s.set(True) is False
    with pytest.raises(RuntimeError), s.off():
        assert not s.on
        raise RuntimeError
    assert s.on
    assert s.off_reason() == "switched off (SEGSERVE_TEST_SWITCH_UNSET=0 or set_enabled(False))"


def test_each_family_switches_alone() -> None:
    # chunk attention asks the AMX hardware probe, not the AMX GEMM's switch: turning the GEMM off
    # leaves the attention kernel as it was.
    before = chunk_attention.available()
    with amx.disabled():
        assert not amx.available()
        assert chunk_attention.available() == before
    with chunk_attention.disabled():
        assert not chunk_attention.available()
    with cpu_kernels.disabled():
        assert not cpu_kernels.enabled() and not amx.available() and not chunk_attention.available()
        reason = cpu_kernels.unavailable_reason()
        assert reason == "switched off (SEGSERVE_CPU_KERNELS=0 or set_enabled(False))"


def test_editing_a_header_changes_the_build_key(tmp_path: Path, monkeypatch) -> None:
    header = tmp_path / "x.h"
    header.write_text("#define A 1\n")
    monkeypatch.setattr(build, "HEADERS", (header,))
    first = build.source_hash()
    header.write_text("#define A 2\n")
    assert build.source_hash() != first
    assert build.CSRC / "segserve_simd.h" in tuple(sorted(build.CSRC.glob("*.h")))


def test_a_failing_source_is_named_and_the_others_still_link(tmp_path, monkeypatch):
    """The sources compile concurrently (one compiler each); a broken one is named with its error."""
    import shutil

    from segserve.kernels import build

    if shutil.which(build._compiler()) is None:
        pytest.skip("no C compiler")
    good, bad = tmp_path / "good.c", tmp_path / "bad.c"
    good.write_text("int sg_good(void) { return 7; }\n")
    bad.write_text("int sg_bad(void) { return missing_name; }\n")
    monkeypatch.setattr(build, "SOURCES", (good, bad))
    objs = tmp_path / "objs"
    objs.mkdir()
    with pytest.raises(RuntimeError, match=r"(?s)failed: bad\.c \(1\): .*missing_name"):
        build._compile_and_link(build._compiler(), objs, str(tmp_path / "lib.so"))
    monkeypatch.setattr(build, "SOURCES", (good,))
    build._compile_and_link(build._compiler(), objs, str(tmp_path / "lib.so"))
    import ctypes

    assert ctypes.CDLL(str(tmp_path / "lib.so")).sg_good() == 7


@pytest.mark.parametrize(
    ("vendor", "flag"),
    [("AuthenticAMD", "-DSG_STREAM_NTA=1"), ("GenuineIntel", "-DSG_STREAM_NTA=0"), ("", "-DSG_STREAM_NTA=0")],
)
def test_the_weight_streams_prefetch_non_temporally_on_amd_only(vendor, flag) -> None:
    # NTA on Intel stalled the streams (segserve_simd.h): Q4_1 batch-1 decode 75-81 vs 121-128 tok/s.
    assert build.defines(vendor) == (flag,)


def test_the_build_compiles_with_this_cpus_defines(tmp_path, monkeypatch) -> None:
    seen = []
    monkeypatch.setattr(build.subprocess, "Popen", lambda cmd, **kw: seen.append(cmd) or _Done())
    monkeypatch.setattr(build.subprocess, "run", lambda cmd, **kw: _Done())
    build._compile_and_link("cc", tmp_path, str(tmp_path / "x.so"))
    assert seen and all(build.defines()[0] in cmd for cmd in seen)


class _Done:
    returncode = 0
    stdout = stderr = ""

    def communicate(self, timeout=None):
        return "", ""
