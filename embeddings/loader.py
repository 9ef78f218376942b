"""A prefetching loader: the next batches are prepared on a background thread while the current
one trains.

`PrefetchingLoader(source, prepare, depth)` pulls items from `source`, runs `prepare` on each (e.g.
a module's `prepare`, which preprocesses the KJT and moves the buffers to `tpu`) on one worker
thread, and keeps at most `depth` prepared items in a queue. Iterating yields them in order. An
exception in the worker (in `source` or in `prepare`) is raised in the training loop, where the
failed item would have been; `close()` (or leaving a `with` block, or exhausting the loader)
stops the worker and joins it. `waited_seconds` is the time the loop spent waiting for a batch:
near zero when preparation keeps up.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

__all__ = ["PrefetchingLoader"]

S = TypeVar("S")
T = TypeVar("T")

_END = object()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class PrefetchingLoader(Generic[S, T]):
    """Prepare items of `source` ahead on a worker thread, at most `depth` at a time."""

    def __init__(self, source: Iterable[S], prepare: Callable[[S], T], depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"PrefetchingLoader: depth must be at least 1, got {depth}")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self.waited_seconds = 0.0
        """Seconds the consumer spent blocked on the queue."""
        self.batches = 0
        """Items handed to the consumer."""
        self._worker = threading.Thread(
            target=self._run, args=(iter(source), prepare), name="PrefetchingLoader", daemon=True
        )
        self._worker.start()

    def _run(self, source: Iterator[S], prepare: Callable[[S], T]) -> None:
        try:
            for item in source:
                if self._stop.is_set():
                    return
                self._put(prepare(item))
            self._put(_END)
        except BaseException as error:  # handed to the consumer, which re-raises it
            self._put(_Failure(error))

    def _put(self, item: object) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        start = time.perf_counter()
        item = self._queue.get()
        self.waited_seconds += time.perf_counter() - start
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        self.batches += 1
        return item

    def close(self) -> None:
        """Stop the worker (dropping prepared items not yet taken) and wait for it to exit."""
        self._done = True
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._worker.join()

    def __enter__(self) -> PrefetchingLoader[S, T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
