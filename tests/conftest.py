"""Test-session set-up shared by every test package.

The CPU stand-in for TPU chips is JAX's CPU platform with several virtual devices. The device
count must be fixed before the JAX runtime starts, so it is set here, before any test imports jax.
Each test session (and each pytest-xdist worker) gets its own device-lock directory: concurrent
sessions behave as separate hosts, while processes spawned by one session still contend for its
devices as they would on a TPU.
"""
import gc
import os
import sys
import tempfile

import pytest

import stand_in  # tests/ is on sys.path (rootdir conftest)
from torchtpu.runtime import stand_in_pool_size

STAND_IN_DEVICES = 8
os.environ.setdefault("XLA_FLAGS", stand_in.xla_flags(STAND_IN_DEVICES))
# XLA:CPU's thread pool, sized before any test starts JAX (sparsecore's tests do, without torchtpu).
os.environ.setdefault("NPROC", str(stand_in_pool_size(STAND_IN_DEVICES)))
os.environ.setdefault("TORCHTPU_NUM_DEVICES", "4")
if "PYTEST_XDIST_WORKER" in os.environ:
    # Each pytest-xdist worker is a host of its own (it holds its devices for the whole run).
    os.environ["TORCHTPU_LOCK_DIR"] = tempfile.mkdtemp(prefix=f"torchtpu-locks-{os.environ['PYTEST_XDIST_WORKER']}-")
else:
    os.environ.setdefault("TORCHTPU_LOCK_DIR", tempfile.mkdtemp(prefix="torchtpu-locks-"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files holding slow tests run first, each file's tests in their order. pytest-xdist hands
    whole files to its workers in collection order (`--no-loadscope-reorder`, as `.ci/dev test`
    runs it): were the few long multi-process files last -- xdist's own order, by number of
    tests, puts them there -- one worker would still run them long after the other finished."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop the programs a test module compiled once it is done. One process runs many modules;
    without this it would keep every XLA executable of all of them alive (their memory and their
    code mappings, which the kernel caps per process: the serial suite once segfaulted in an XLA
    compile near its end)."""
    yield
    torchtpu = sys.modules.get("torchtpu")
    if torchtpu is not None:
        torchtpu.clear_caches()
        gc.collect()


@pytest.fixture
def failing_compiler(tmp_path, monkeypatch):
    """`$CXX` set to a compiler that writes part of its output, then fails with "undefined
    reference to foo" (as a failed link can): what a failed build must clean up after."""
    compiler = tmp_path / "failing-c++"
    compiler.write_text('#!/bin/sh\nwhile [ "$1" != -o ]; do shift; done\necho partial > "$2"\n'
                        'echo "undefined reference to foo" >&2\nexit 1\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    return compiler
