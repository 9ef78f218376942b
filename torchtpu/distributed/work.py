"""The Work object of tpu_dist collectives: what `async_op=True` returns and DDP's hooks wait on.

A transport launches a collective and hands back how to complete it: wait for gloo and move the
host results into the tpu outputs (host transport), or block until XLA has produced them (XLA
transport). `wait()` runs that once; a failure is kept and raised again by later waits.

Futures: `get_future()` completes the work on the calling thread and returns a completed future.
The executors keep pending work per thread (DeferAndFuse records ops into the current thread's
graph), so writing results -- and running the callbacks DDP chains onto the future, which run
tpu ops -- must not happen on gloo's worker threads.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist


class CollectiveError(RuntimeError):
    """A collective failed in transit: a peer's error, a closed connection or a time-out."""


class TpuWork(dist.Work):
    """A launched collective on tpu tensors; `complete(timeout)` finishes it."""

    __slots__ = ("_source_rank_of", "_collective", "_rank", "_complete", "_result", "_lock", "_error")

    def __init__(
        self,
        collective: str,
        rank: int,
        complete: Callable[[timedelta | None], None],
        result: Sequence[torch.Tensor],
        source_rank: Callable[[], int] | None = None,
    ) -> None:
        super().__init__()
        self._source_rank_of = source_rank
        self._collective = collective
        self._rank = rank
        self._complete: Callable[[timedelta | None], None] | None = complete
        self._result = list(result)
        self._lock = threading.Lock()
        self._error: CollectiveError | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._complete is not None:
                try:
                    self._complete(timeout)
                except Exception as error:
                    self._error = CollectiveError(
                        f"tpu_dist {self._collective} failed on rank {self._rank}: {error}"
                    )
                    self._complete = None
                    raise self._error from error
                self._complete = None  # also drops the host buffers it holds
        return True

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        try:
            self.wait()
        except CollectiveError as error:
            return _failed_future(error)
        future.set_result(self._result)
        return future

    def is_completed(self) -> bool:
        return self._complete is None

    def is_success(self) -> bool:
        return self._complete is None and self._error is None

    def exception(self) -> CollectiveError | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        return self._result

    def _source_rank(self) -> int:
        """The sender of a receive from any source (after `wait()`)."""
        if self._source_rank_of is None:
            raise RuntimeError(f"tpu_dist {self._collective}: only a receive from any source has a source rank")
        return self._source_rank_of()

    source_rank = _source_rank


class WorkList:
    """Works waited on as one, within one time-out: the messages of an exchange (`pairwise`),
    the collectives of a coalesced call.

    Not a `dist.Work`: only tpu_dist waits on it (making a `dist.Work` costs a few us a call).
    Complete once each work is: gloo marks a point-to-point message complete only once it was
    waited on."""

    __slots__ = ("_works",)

    def __init__(self, works: list) -> None:
        self._works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        while self._works:
            if deadline is None:
                self._works[0].wait()
            else:
                self._works[0].wait(timedelta(seconds=max(deadline - time.monotonic(), 0.0)))
            self._works.pop(0)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def _failed_future(error: CollectiveError) -> torch.futures.Future:
    """A future completed with `error` as an error, for C++ consumers too.

    (`Future.set_exception` stores the exception as the future's value and raises it only in
    Python's `wait()`; DDP's reducer would read it as a result.) A callback that raises marks
    the future that `then` returns as failed, which both languages see."""

    def fail(_: torch.futures.Future) -> None:
        raise error

    source: torch.futures.Future = torch.futures.Future()
    failed = source.then(fail)
    source.set_result(None)
    return failed
