"""The same acceptance as test_modules on other topologies, in spawned stand-in hosts: one
device, and two processes of two devices each (one mesh through JAX's multi-process runtime,
each process feeding its half of every batch). Forward and 10 steps of SGD, Adagrad, row-wise
Adagrad and Adam (each test's two modes taken in turn) equal the fused references within 1e-5; a
sharded checkpoint round-trips."""

from __future__ import annotations

import pytest

import _workers
from _spawn import run_processes


@pytest.mark.slow
def test_one_device_strict_and_compiled():
    run_processes(_workers.train_against_references, 1, 1, 32, ("strict", "compiled"))


@pytest.mark.slow
def test_two_processes_of_two_devices_strict_and_defer():
    run_processes(_workers.train_against_references, 2, 2, 16, ("strict", "defer"))
