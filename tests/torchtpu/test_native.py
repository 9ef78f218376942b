"""Building torchtpu's C++ libraries (`torchtpu.native`): once, under a lock, and at first
import all at once."""

from __future__ import annotations

import threading
import time

import pytest

from torchtpu import native


@pytest.fixture
def fake_builds(tmp_path, monkeypatch):
    """`native._build` replaced by one that takes 0.3 s and writes the target, recording which
    thread built what; the cache is `tmp_path`, empty."""
    monkeypatch.setenv("TORCHTPU_CACHE_DIR", str(tmp_path))
    built: list[tuple[str, str]] = []
    failing: set[str] = set()

    def build(source, target, python):
        time.sleep(0.3)
        if source.stem in failing:
            raise RuntimeError(f"building {source.name} failed: no compiler")
        built.append((source.stem, threading.current_thread().name))
        target.write_bytes(b"")

    monkeypatch.setattr(native, "_build", build)
    return built, failing


def _wait_for_builds() -> None:
    for thread in threading.enumerate():
        if thread.name.startswith("torchtpu-build-"):
            thread.join()


def test_prebuild_builds_every_library_once_side_by_side(fake_builds):
    built, _ = fake_builds
    start = time.perf_counter()
    native.prebuild()
    for name, python in native.LIBRARIES.items():  # as `load` does: waits for the build under way
        native._build_once(*native._source_and_target(name), python)
    elapsed = time.perf_counter() - start
    assert sorted(name for name, _ in built) == sorted(native.LIBRARIES)
    assert all(thread == f"torchtpu-build-{name}" for name, thread in built)
    assert elapsed < 0.3 * len(native.LIBRARIES) - 0.2, "the builds ran one after another"
    _wait_for_builds()
    native.prebuild()  # all built: nothing to start
    assert not [t for t in threading.enumerate() if t.name.startswith("torchtpu-build-")]
    assert len(built) == len(native.LIBRARIES)


def test_a_build_that_fails_in_prebuild_is_built_and_reported_by_load(fake_builds):
    built, failing = fake_builds
    failing.add("autocast")
    native.prebuild()
    _wait_for_builds()
    assert "autocast" not in [name for name, _ in built]
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
