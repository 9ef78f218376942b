"""PrefetchingLoader: items prepared ahead on a worker in order, at most `depth` waiting; worker
errors raised in the loop where the item would have been; a clean stop; time spent waiting."""

from __future__ import annotations

import threading
import time

import pytest

from embeddings import PrefetchingLoader


def test_yields_prepared_items_in_order_and_stops():
    loader = PrefetchingLoader(range(10), lambda x: x * x, depth=3)
    assert list(loader) == [x * x for x in range(10)]
    assert loader.batches == 10 and not loader._worker.is_alive()
    assert list(loader) == []


def test_prepares_at_most_depth_ahead():
    prepared = []

    def prepare(x):
        prepared.append(x)
        return x

    loader = PrefetchingLoader(range(100), prepare, depth=2)
    time.sleep(0.5)
    # depth items wait in the queue and one more is held by the blocked worker.
    assert len(prepared) <= 3
    assert next(loader) == 0
    loader.close()
    assert not loader._worker.is_alive()


def test_worker_errors_are_raised_in_the_loop_in_place():
    def prepare(x):
        if x == 3:
            raise ValueError("feature 'f': id 99 is outside the vocabulary")
        return x

    loader = PrefetchingLoader(range(10), prepare, depth=2)
    got = []
    with pytest.raises(ValueError, match="id 99 is outside"):
        for item in loader:
            got.append(item)
    assert got == [0, 1, 2]
    assert not loader._worker.is_alive()


def test_errors_of_the_source_are_raised_too():
    def source():
        yield 1
        raise RuntimeError("reader failed")

    with pytest.raises(RuntimeError, match="reader failed"):
        list(PrefetchingLoader(source(), lambda x: x))


def test_close_stops_an_endless_source_and_reports_waiting():
    slow = threading.Event()

    def prepare(x):
        slow.wait(0.05)
        return x

    def endless():
        n = 0
        while True:
            yield n
            n += 1

    with PrefetchingLoader(endless(), prepare, depth=2) as loader:
        first = [next(loader) for _ in range(3)]
    assert first == [0, 1, 2]
    assert not loader._worker.is_alive()
    assert loader.waited_seconds > 0.0


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="depth must be at least 1, got 0"):
        PrefetchingLoader([], lambda x: x, depth=0)
