"""Building torchtpu's C++ libraries (`torchtpu.native`): once, under a lock, and at first
import all at once."""

from __future__ import annotations

import threading

import pytest

from torchtpu import native


class _FakeBuilds:
    """What the fake `native._build` did: the libraries built and the thread that built each;
    which builds fail; and, when `meeting` is set, a barrier every build waits at (so builds made
    one after another break it)."""

    def __init__(self) -> None:
        self.built: list[tuple[str, str]] = []
        self.failing: set[str] = set()
        self.meeting: threading.Barrier | None = None


@pytest.fixture
def fake_builds(tmp_path, monkeypatch):
    """`native._build` replaced by one that writes the target; the cache is `tmp_path`, empty."""
    monkeypatch.setenv("TORCHTPU_CACHE_DIR", str(tmp_path))
    builds = _FakeBuilds()

    def build(source, target, python):
        if builds.meeting is not None:
            builds.meeting.wait(timeout=10)  # BrokenBarrierError unless every build is under way
        if source.stem in builds.failing:
            raise RuntimeError(f"building {source.name} failed: no compiler")
        builds.built.append((source.stem, threading.current_thread().name))
        target.write_bytes(b"")

    monkeypatch.setattr(native, "_build", build)
    return builds


def _wait_for_builds() -> None:
    for thread in threading.enumerate():
        if thread.name.startswith("torchtpu-build-"):
            thread.join()


def test_prebuild_builds_every_library_once_side_by_side(fake_builds):
    fake_builds.meeting = threading.Barrier(len(native.LIBRARIES))  # all builds at once, or none
    native.prebuild()
    for name, python in native.LIBRARIES.items():  # as `load` does: waits for the build under way
        native._build_once(*native._source_and_target(name), python)
    assert sorted(name for name, _ in fake_builds.built) == sorted(native.LIBRARIES)
    assert all(thread == f"torchtpu-build-{name}" for name, thread in fake_builds.built)
    _wait_for_builds()
    native.prebuild()  # all built: nothing to start
    assert not [t for t in threading.enumerate() if t.name.startswith("torchtpu-build-")]
    assert len(fake_builds.built) == len(native.LIBRARIES)


def test_a_build_that_fails_in_prebuild_is_built_and_reported_by_load(fake_builds):
    fake_builds.failing.add("autocast")
    native.prebuild()
    _wait_for_builds()
    assert "autocast" not in [name for name, _ in fake_builds.built]
    with pytest.raises(RuntimeError, match="building autocast.cpp failed: no compiler"):
        native.load("autocast")


def test_a_build_cut_short_leaves_no_partial_library_behind(fake_builds, tmp_path):
    source, target = native._source_and_target("autocast")
    stale = tmp_path / f"{target.stem}.12345.tmp"  # as a process killed while compiling leaves it
    stale.write_bytes(b"half a library")
    other = tmp_path / "device_guard-0123456789abcdef.12345.tmp"  # another library's: not this build's
    other.write_bytes(b"")
    native._build_once(source, target, native.LIBRARIES["autocast"])
    assert target.exists() and not stale.exists() and other.exists()


def test_a_failed_compile_reports_the_compiler_and_leaves_no_partial_library(tmp_path, failing_compiler):
    source, _ = native._source_and_target("autocast")
    target = tmp_path / "autocast-0123456789abcdef.so"
    with pytest.raises(RuntimeError, match="building autocast.cpp failed:\n.*undefined reference to foo"):
        native._build(source, target, native.LIBRARIES["autocast"])
    assert list(tmp_path.iterdir()) == [failing_compiler]
