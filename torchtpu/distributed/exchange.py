"""Agreeing on all-to-all sizes before data moves, and moving data on guessed sizes.

Gloo aborts the process, or waits forever, when a rank sends a peer more or fewer bytes than the
peer expects. So before an all-to-all every rank's sizes are gathered (each rank sends every
other rank its row of sizes, `pairwise`) and checked (`checks.check_exchange_table`): every rank
reaches the same verdict, and only agreed sizes ever reach gloo.

That gather costs a round trip as long as a small all-to-all itself, and two messages per peer
beside the data (on 2 cores at world size 2 they took the exchange from ~0.55 ms to ~0.85-1.5 ms
at 1 MiB, even moving while the data did). Repeated exchanges of one shape (the pooled embeddings
of every training step, a benchmark) need not pay it: once two consecutive all-to-alls of a group
agreed on the same sizes, the next ones *guess* those sizes and gather nothing. Every rank
exchanges the guessed sizes -- on scratch buffers if its own call differs from the guess, so that
gloo always sees matching sizes -- and a rank whose call differs first sends every peer a *notice*
(`_Notices`). Once every peer's data arrived, a rank has every notice sent to it, so every rank
knows whether any call differed: if none did, the exchange on the guess is the answer; if one did,
every rank gathers the sizes after all and either raises the disagreement (outputs then hold
unspecified data, as after any failed collective) or runs the exchange again with the agreed
sizes, which overwrites every output row. No result is ever taken from a guess that any rank's
call differs from. Every rank decides alike: whether to guess depends only on agreements that
every rank saw. `torchtpu.metrics()` counts guesses confirmed (`dist_all_to_all_guessed`) and
missed (`dist_all_to_all_guess_missed`). On a guess the call returns once its data arrived (its
work is complete), where an agreed exchange returns once it started.

Why a notice sent before the data arrives before it: both travel on the gloo group of their
direction (`pairwise`), whose tcp pair sends every message in the order it was posted, and a
message goes out only once the peer posted its receive and said so (its ready-notices travel in
order too, on the same connection). Each rank posts its receive of a peer's next notice (of each
parity, `_Notices`) when it consumed the last one (at the end of an exchange), before the receives
of any data that notice can precede; so by the time the sender may send that data it has seen the
notice's receive posted, and its notice, sent first, is in the stream ahead of the data. An
exchange sends every peer a message, empty regions included (`pairwise`), so there is always data
to wait for.

Each rank posts the receives of the next gather's rows as soon as it has read the last table, so
a peer's row is written straight into the table when the peer sends it: gloo's rendezvous (the
receiver's notice that it is ready, then the bytes) is not waited on during the call. The rows
have a tag sequence of their own (`pairwise`), so receives posted ahead never meet data.

Before the notices, a guess was confirmed by gathering the sizes anyway while the guessed data
moved (each rank sent its row first, then the data). That kept the round trip off the critical
path but not its messages. The rows did not pay inside the data either (each message its
sender's row, then its region: copies into framed send buffers and out of the received ones):
measured twice at world size 2, as gloo collectives (bus bandwidth against gloo: 0.35-0.74x at
1 MiB, 0.44-0.55x at 4 and 16 MiB) and as point-to-point messages (wall / CPU us per call: 2011 /
1243 framed against 1991 / 1365 at 1 MiB); nor on a gloo group of their own.

Nor did posting a guessed exchange's receives one exchange ahead (into a pooled host buffer that
then became the output's buffer), though plain point-to-point messages gain from it (1 MiB at
world size 2: ~350-480 us a call against ~600-800): per call at 1 MiB it took 1026-1045 us
against 850-950 without (gloo: 611-623), the early receive's own post costing ~275 us.
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from torchtpu import counters
from torchtpu.distributed import checks
from torchtpu.distributed.checks import ExchangeSizes
from torchtpu.distributed.pairwise import NOTICES, ROWS, Pairwise, tag_of
from torchtpu.distributed.work import CollectiveError, WorkList

# `stage(sizes)` stages this rank's buffers for an exchange of `sizes` and returns what starts it.
Stage = Callable[[ExchangeSizes], Callable[[], dist.Work]]


class SizeExchange:
    """The size agreements of one process group's all-to-alls, and the guess they make."""

    def __init__(self, pairwise: Pairwise, rank: int, size: int, guesses: bool) -> None:
        self._pairwise = pairwise
        self._rank = rank
        self._size = size
        # Every rank's row (`checks.exchange_values`: 2 * size + 2 numbers) arrives in its row of
        # this table, into receives posted as soon as the last gather's table was read (after a
        # failed gather, by the next one): a peer's row then goes out the moment it is sent.
        self._rows = torch.empty((size, 2 * size + 2), dtype=torch.int64)
        self._rows_np = self._rows.numpy()
        self._row_of = list(self._rows)
        self._own_row = [self._row_of[rank]] * size
        self._incoming: tuple[int, WorkList] | None = None
        # Only a group that guesses has notices to receive (`guesses`: every rank's bytes go
        # through gloo, so a stand-in exchange can match the guess).
        self._notices = _Notices(pairwise, rank, size) if guesses else None
        self._guessed_exchanges = 0  # numbered alike on every rank: all make the same guesses
        # The table of the last agreement of all_to_all_single (as bytes), and its sizes when the
        # agreement before it was the same: the guess for the next call, and this rank's row in it.
        self._table: bytes | None = None
        self._guess: ExchangeSizes | None = None
        self._guessed_row: tuple[int, ...] | None = None

    def agree(self, collective: str, row: tuple[int, ...], unit: str, send_name: str, recv_name: str) -> ExchangeSizes:
        """Every rank's sizes, checked: `row` is this rank's `checks.exchange_values`."""
        table = self._gathered(collective, self._gather(collective, row))
        return checks.check_exchange_table(collective, table, unit, send_name, recv_name)

    def all_to_all(self, collective: str, row: tuple[int, ...], stage: Stage, unit: str, send_name: str,
                   recv_name: str) -> dist.Work:
        """This rank's part of an exchange, staged by `stage(sizes)`: on the guessed sizes if
        every rank's call matches them, else on agreed sizes (see the module docstring). A group
        made without `guesses` always agrees first."""
        if self._guess is not None:
            guessed = self._exchange_on_guess(collective, row, stage)
            if guessed is not None:
                return guessed
        try:
            table = self._gathered(collective, self._gather(collective, row))
            sizes = checks.check_exchange_table(collective, table, unit, send_name, recv_name)
        except (ValueError, CollectiveError):
            self._table = self._guess = self._guessed_row = None
            raise
        if self._notices is not None:
            gathered = table.tobytes()
            self._guess = sizes if gathered == self._table else None
            self._table, self._guessed_row = gathered, row
        return stage(sizes)()

    def _exchange_on_guess(self, collective: str, row: tuple[int, ...], stage: Stage) -> dist.Work | None:
        """The exchange on the guessed sizes, complete; None if any rank's call differs from the
        guess (every rank then knows it; the outputs are left to the agreed exchange)."""
        guess, notices = self._guess, self._notices
        assert notices is not None, "only a group that guesses makes a guess"
        differs = row != self._guessed_row
        try:
            self._guessed_exchanges += 1
            told = notices.send(self._guessed_exchanges) if differs else None
            work = (self._stand_in(guess) if differs else stage(guess))()
            work.wait()
            if told is not None:
                told.wait()
            noticed = notices.received(self._guessed_exchanges)
        except RuntimeError as error:
            self._table = self._guess = self._guessed_row = None
            if isinstance(error, CollectiveError):
                raise
            raise self._failed(collective, error, "the exchange on guessed sizes") from error
        if differs or noticed:
            counters.count("dist_all_to_all_guess_missed")
            self._guess = None
            return None
        counters.count("dist_all_to_all_guessed")
        return work

    def _gather(self, collective: str, row: tuple[int, ...]) -> tuple[WorkList, WorkList]:
        """Start gathering every rank's `row` into the table: each rank sends every other rank
        its row, into the receives posted for it."""
        try:
            tag, incoming = self._incoming or self._post()
            self._incoming = None
            self._rows_np[self._rank] = row
            return incoming, self._pairwise.send(self._own_row, tag)
        except RuntimeError as error:
            raise self._failed(collective, error) from error

    def _gathered(self, collective: str, pending: tuple[WorkList, WorkList]) -> np.ndarray:
        """The gathered table (a copy: the next gather's receives are posted into the table)."""
        try:
            for work in pending:
                work.wait()
            table = self._rows_np.copy()
            self._incoming = self._post()
        except RuntimeError as error:
            raise self._failed(collective, error) from error
        return table

    def _post(self) -> tuple[int, WorkList]:
        """Post the receives of the next gather's rows: its tag, and the receives."""
        tag = self._pairwise.tag(ROWS)
        return tag, self._pairwise.receive(self._row_of, tag)

    def _failed(self, collective: str, error: RuntimeError, what: str = "exchanging sizes") -> CollectiveError:
        return CollectiveError(f"tpu_dist {collective}: {what} failed on rank {self._rank}: {error}")

    def _stand_in(self, guess: ExchangeSizes) -> Callable[[], WorkList]:
        """This rank's part of the guessed exchange when its own call differs from the guess:
        the guessed bytes, sent from and received into scratch buffers."""
        send, recv = guess.splits(self._rank)
        source = torch.zeros((sum(send), guess.row_numel), dtype=guess.dtype)
        scratch = torch.empty((sum(recv), guess.row_numel), dtype=guess.dtype)
        return functools.partial(self._pairwise.exchange, scratch.split(recv), source.split(send))


class _Notices:
    """Word from a rank to every peer that its call differs from the guess, sent before its data.

    Every rank keeps receives posted for each peer's next notices, into that peer's flags; a
    notice that never comes costs nothing. A guessed exchange's notices land in the flags of its
    parity (`exchange % 2`), read once every peer's data of the exchange arrived, which the
    notices precede (see the module docstring). The next guessed exchange's notice may arrive
    while a rank reads (its sender finished this exchange first), but lands in the other
    parity's flags; the one after it cannot come before this rank has sent its data of the next
    exchange. So no flag is written while it is read, and each holds its own exchange's word.
    Notices are numbered per pair of ranks and parity (the tag sequence `NOTICES`): a sender
    counts those it sent, a receiver those it consumed, and every notice is consumed in the
    exchange it was sent in, so both count alike."""

    def __init__(self, pairwise: Pairwise, rank: int, size: int) -> None:
        self._pairwise = pairwise
        self._notice = torch.ones(1, dtype=torch.int64)
        self._flags = torch.zeros((2, size), dtype=torch.int64)
        self._flags_np = self._flags.numpy()
        self._sent = np.zeros((2, size), dtype=np.int64)
        self._consumed = np.zeros((2, size), dtype=np.int64)
        self._posted = {(parity, peer): self._post(parity, peer) for parity in (0, 1) for peer in pairwise.peers}

    def send(self, exchange: int) -> WorkList:
        """Tell every peer that this rank's call in guessed exchange number `exchange` differs
        from the guess."""
        parity = exchange % 2
        messages = []
        for peer in self._pairwise.peers:
            tag = _notice_tag(parity, self._sent[parity, peer])
            messages.append(self._pairwise.send_to(self._notice, peer, tag))
            self._sent[parity, peer] += 1
        return WorkList(messages)

    def received(self, exchange: int) -> bool:
        """Whether a peer sent a notice in guessed exchange number `exchange` (asked once every
        peer's data of it arrived); the notices received are consumed and the receives of the
        next ones posted."""
        parity = exchange % 2
        senders = [peer for peer, flag in enumerate(self._flags_np[parity].tolist()) if flag]
        for peer in senders:
            self._posted[parity, peer].wait()
            self._flags_np[parity, peer] = 0
            self._consumed[parity, peer] += 1
            self._posted[parity, peer] = self._post(parity, peer)
        return bool(senders)

    def _post(self, parity: int, peer: int) -> dist.Work:
        """Post the receive of `peer`'s next notice of `parity` into its flag."""
        tag = _notice_tag(parity, self._consumed[parity, peer])
        return self._pairwise.receive_from(self._flags[parity, peer : peer + 1], peer, tag)


def _notice_tag(parity: int, number: int) -> int:
    return tag_of(NOTICES, 2 * int(number) + parity)
