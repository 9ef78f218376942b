"""All-to-all exchanges as point-to-point messages, on gloo groups of their own.

An all-to-all here is up to two exchanges: every rank's sizes (`exchange.SizeExchange`, skipped
while a guess holds), and the data. Run as gloo collectives, each waits for one of gloo's worker
threads, and the two compete for them and for the host's cores: on 2 cores at world size 2, a
1 MiB all-to-all took ~1.3 ms with the size gather running beside it against ~0.6 ms alone.
Point-to-point messages need no worker: the calling thread posts them and gloo's transport
threads move them (the same gloo transport that gloo's own all-to-all uses).

Messages are matched by tag. Every rank makes its exchanges in the same order (as it makes its
collectives), so numbering them gives every exchange the same tag on every rank, and messages of
two exchanges in flight never meet. Tags come in three sequences, each numbered on its own: one
for the exchanges of data, one for the rows of sizes, whose receives are posted one agreement
ahead (`exchange`), and one for the notices a rank sends when its call differs from a guess,
numbered per pair of ranks and parity (`exchange`) -- however they interleave, each message meets
its own receive. The groups are the exchanges' own, so no user point-to-point message (whose tag
may be any number) meets them either.

Each direction has a group of its own: messages from a lower rank to a higher one travel on one
gloo group, messages the other way on another. Gloo's tcp transport gives each pair of ranks one
connection per group, under a lock of the pair; on one connection a rank's outgoing bytes wait
for its incoming ones and the other way round. Two groups move both at once: at world size 2 on
2 cores, point-to-point exchanges of cpu tensors took ~8-12% less time at 16 and 64 MiB, ~3-5% at
4 MiB, and about the same at 1 MiB; tpu all-to-alls went from 0.67-0.85x gloo to 0.76-0.88x at
1 MiB and from 0.87-0.98x to 0.95-1.10x at 16 and 64 MiB (0.77-0.92x and ~1.1x with the receives
posted first, below). Every message from one rank to another -- data, rows, notices -- takes its
direction's group, so they arrive in the order they were sent (see `exchange`).

Both groups share one gloo device, so one transport thread moves both connections, as one thread
moves gloo's own all-to-all (a group per device had two; a group's worker threads, which run
collectives, are idle here: the calling thread posts every message). Each tpu_dist group then
has six threads in gloo instead of nine. Per call at world size 2 on 2 cores, alternating with a
device per group in one run (mean time per call, ratio against gloo; 11 runs of all_to_all_single
at 1 MiB, into the same and into new outputs): better in 8 (0.97-1.08x against 0.83-0.92x in the
quieter runs), worse in 3 (by 0.04-0.13). 4-16 MiB about the same (1.07-1.16x); 64 MiB
1.01-1.03x against 1.13-1.17x, where a second thread paid. At world size 4 (two processes a
core; one run) 1 MiB went from 0.77x to 1.02x.

An exchange sends every peer one message, an empty one for an empty region, so that whatever a
rank sent a peer before its exchange has arrived once the peer has its message (see `exchange`).

Gloo marks a point-to-point message complete only once it was waited on, so an exchange that is
never waited on stays in flight; `HostTransport` keeps its buffers until it is.
"""

from __future__ import annotations

import ctypes
import functools
import os
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from torchtpu.distributed.work import WorkList

_TAGS = 1 << 29  # tags per sequence: gloo's tags are C ints, and there are three sequences

DATA, ROWS, NOTICES = 0, 1, 2  # the tag sequences


class Pairwise:
    """Exchanges between the ranks of one process group, over gloo groups made for them: one for
    messages to higher ranks, one for messages to lower ranks."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        devices = _devices()  # both groups on one device: one transport thread (module docstring)
        upward, downward = (_group_on(devices, dist.PrefixStore(f"pairwise-{direction}/", store), rank, size, timeout)
                            for direction in ("up", "down"))
        # The group of the messages from this rank to each rank, and from each rank to this one.
        self._to = [upward if rank < peer else downward for peer in range(size)]
        self._from = [upward if peer < rank else downward for peer in range(size)]
        self._upward, self._downward = upward, downward
        self._rank = rank
        self._size = size
        self._next_tags = [0, 0]

    @property
    def groups(self) -> tuple[dist.ProcessGroupGloo, dist.ProcessGroupGloo]:
        """The gloo groups: of messages to higher ranks, and to lower ranks."""
        return self._upward, self._downward

    def tag(self, sequence: int) -> int:
        """The next tag of `sequence` (`DATA` or `ROWS`)."""
        number = self._next_tags[sequence]
        self._next_tags[sequence] = (number + 1) % _TAGS
        return tag_of(sequence, number)

    def send(self, inputs: Sequence[torch.Tensor], tag: int) -> WorkList:
        """Send `inputs[j]` to every other rank j."""
        return WorkList([self.send_to(inputs[j], j, tag) for j in self.peers])

    def receive(self, outputs: Sequence[torch.Tensor], tag: int) -> WorkList:
        """Receive `outputs[i]` from every other rank i."""
        return WorkList([self.receive_from(outputs[i], i, tag) for i in self.peers])

    def send_to(self, input: torch.Tensor, destination: int, tag: int) -> dist.Work:
        """Send `input` to rank `destination`."""
        return self._to[destination].send([input], destination, tag)

    def receive_from(self, output: torch.Tensor, source: int, tag: int) -> dist.Work:
        """Receive `output` from rank `source`."""
        return self._from[source].recv([output], source, tag)

    @functools.cached_property
    def peers(self) -> list[int]:
        """The other ranks, starting after this one (so that rank 0 is not everyone's first)."""
        return [(self._rank + step) % self._size for step in range(1, self._size)]

    def exchange(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> WorkList:
        """Send `inputs[j]` to rank j and receive `outputs[i]` from rank i, for every other rank;
        copy `inputs[rank]` into `outputs[rank]`.

        Host tensors, contiguous. Every rank must call this in the same order as every other,
        each receiving from each peer exactly as many bytes as that peer sends it -- the callers
        make sure of it: gloo aborts or waits forever otherwise. Every peer gets a message, empty
        for an empty region (see the module docstring)."""
        tag = self.tag(DATA)
        messages = []
        to, from_ = self._to, self._from
        # Every rank starts with a different peer (as gloo's own all-to-all does), so rank 0
        # is not everyone's first; and posts its receive before its send, so that the peer
        # learns at once that it may send. With a group per direction, receives first measured
        # 0.77-0.92x gloo against 0.73-0.80x at 1 MiB, 1.12-1.22x against 1.01-1.08x at 4 MiB
        # (on one group for both directions, sends first had been faster: ~0.6 ms against
        # ~1.3-2 ms at 1 MiB).
        for step in range(1, self._size):
            source, destination = (self._rank - step) % self._size, (self._rank + step) % self._size
            messages.append(from_[source].recv([outputs[source]], source, tag))
            messages.append(to[destination].send([inputs[destination]], destination, tag))
        copy_bytes(outputs[self._rank], inputs[self._rank])
        return WorkList(messages)


def _devices() -> list:
    """The gloo devices a group of this process gets, as `dist.ProcessGroupGloo(store, rank, size,
    timeout)` makes them: one per interface named in GLOO_SOCKET_IFNAME, else the default one
    (which reads GLOO_DEVICE_TRANSPORT)."""
    interfaces = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if len(interfaces) > 1:
        return [dist.ProcessGroupGloo.create_device(interface=name) for name in interfaces.split(",")]
    return [dist.ProcessGroupGloo.create_default_device()]


def _group_on(devices: list, store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroupGloo:
    """A gloo group on `devices`, with one worker thread: its messages are posted by the caller."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = devices
    options._timeout = timeout
    options._threads = 1
    return dist.ProcessGroupGloo(store, rank, size, options)


def tag_of(sequence: int, number: int) -> int:
    """The tag numbered `number` (modulo the sequence's length) in `sequence`."""
    return sequence * _TAGS + number % _TAGS


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy contiguous `src` into contiguous `dst` (as many bytes) with one memcpy, without the
    GIL (PyTorch's parallel copy stalls when the host's cores are busy, e.g. with the other ranks
    of a collective; NumPy's costs ~10 us a call more to set up)."""
    nbytes = dst.numel() * dst.element_size()
    if nbytes:  # an empty tensor's address may be null
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
