"""Building sparsecore's C++ sources (`sparsecore.native`): a build that fails or was cut short
leaves no partial library behind."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sparsecore import native


def _source(directory: Path, name: str, text: str) -> Path:
    source = directory / f"{name}.cc"
    source.write_text(text)
    return source


def test_a_failed_build_reports_the_compiler_and_leaves_nothing(tmp_path, monkeypatch, failing_compiler):
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPARSECORE_CACHE_DIR", str(cache))
    source = _source(tmp_path, "broken", 'extern "C" int broken();\n')
    with pytest.raises(RuntimeError, match="building broken.cc failed:\n.*undefined reference to foo"):
        native.library(source)
    assert list(cache.iterdir()) == [next(cache.glob("broken-*.lock"))]


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="needs a C++ compiler")
def test_a_build_cut_short_leaves_no_partial_library_behind(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("SPARSECORE_CACHE_DIR", str(cache))
    source = _source(tmp_path, "answer", 'extern "C" int answer() { return 42; }\n')
    library = native.library(source)
    assert library.answer() == 42
    target = next(cache.glob("answer-*.so"))
    target.unlink()  # as before its first build: a killed build left only its partial output
    stale = cache / f"{target.stem}.12345.tmp"
    stale.write_bytes(b"half a library")
    other = cache / "pack-0123456789abcdef.12345.tmp"  # another library's: not this build's
    other.write_bytes(b"")
    native.library.cache_clear()
    assert native.library(source).answer() == 42
    assert target.exists() and not stale.exists() and other.exists()
