"""Argument checks shared by every tpu_dist transport: placement, shapes and split sizes.

Local checks raise before anything moves. What one rank cannot see alone -- that what it sends
to a peer is what that peer expects from it -- is checked by `check_exchange_table` on every
rank's sizes, gathered once per all-to-all: every rank reaches the same verdict and raises the
same error, so a mismatch can neither hang a rank nor deliver data to the wrong place.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from torchtpu import dtypes

_DTYPES = tuple(sorted(dtypes.SUPPORTED, key=str))
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}


def placement(collective: str, tensors: Sequence[torch.Tensor], serves_cpu: bool) -> torch.device:
    """The one device all of a call's tensors are on (`cpu`, or one `tpu:i`)."""
    if not tensors:
        raise ValueError(f"tpu_dist {collective}: no tensors given")
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise RuntimeError(
                f"tpu_dist {collective}: all tensors of one call must be on one device, found "
                f"{device} and {t.device}"
            )
    if device.type == "cpu" and not serves_cpu:
        raise RuntimeError(
            f"tpu_dist {collective}: got a cpu tensor, but this process group serves tpu "
            f"tensors only. Move the tensor to the tpu device, or create the group with "
            f"backend='cpu:gloo,tpu:tpu_dist' to run cpu tensors on gloo."
        )
    if device.type not in ("cpu", "tpu"):
        raise RuntimeError(f"tpu_dist {collective}: tensors on {device} are not supported (tpu or cpu only)")
    return device


def same_dtype(collective: str, tensors: Sequence[torch.Tensor]) -> None:
    first = tensors[0].dtype
    for t in tensors:
        if t.dtype != first:
            raise ValueError(f"tpu_dist {collective}: tensors must share one dtype, found {first} and {t.dtype}")


def list_length(collective: str, name: str, tensors: Sequence[torch.Tensor], world: int) -> None:
    if len(tensors) != world:
        raise ValueError(
            f"tpu_dist {collective}: {name} has {len(tensors)} tensors, expected one per rank ({world})"
        )


def same_count(collective: str, name: str, tensors: Sequence[torch.Tensor], other_name: str,
               others: Sequence[torch.Tensor]) -> None:
    """A coalesced call pairs each tensor of one list with the tensor of the other at its place."""
    if len(tensors) != len(others):
        raise ValueError(
            f"tpu_dist {collective}: {len(tensors)} {name} for {len(others)} {other_name}, expected as many"
        )


def same_shapes(collective: str, name: str, tensors: Sequence[torch.Tensor], like: torch.Tensor, like_name: str) -> None:
    for i, t in enumerate(tensors):
        if t.shape != like.shape:
            raise ValueError(
                f"tpu_dist {collective}: {name}[{i}] has shape {tuple(t.shape)}, but {like_name} "
                f"has shape {tuple(like.shape)}"
            )


def one_per_rank(collective: str, name: str, lists: Sequence[Sequence[torch.Tensor]], likes: Sequence[torch.Tensor],
                 like_name: str, world: int) -> None:
    """Each list holds one tensor per rank, shaped like its counterpart in `likes`."""
    if len(lists) != len(likes):
        raise ValueError(f"tpu_dist {collective}: {len(lists)} lists of {name} for {len(likes)} tensors")
    for tensors, like in zip(lists, likes):
        list_length(collective, name, tensors, world)
        same_shapes(collective, name, tensors, like, like_name)


def single(collective: str, name: str, tensors: Sequence[torch.Tensor]) -> None:
    """A rooted collective (reduce, gather, scatter) moves one tensor a call, as gloo's and NCCL's do."""
    if len(tensors) != 1:
        raise ValueError(f"tpu_dist {collective}: {name} holds {len(tensors)} tensors, expected one")


def rooted_lists(collective: str, name: str, lists: Sequence[Sequence[torch.Tensor]], like: torch.Tensor,
                 like_name: str, is_root: bool, world: int) -> None:
    """The list only the root rank passes (gather's outputs, scatter's inputs): there, one tensor
    per rank shaped like `like`; on every other rank, nothing."""
    if is_root:
        one_per_rank(collective, name, lists, [like], like_name, world)
    elif any(len(tensors) for tensors in lists):
        raise ValueError(f"tpu_dist {collective}: only the root rank passes {name}")


def world_multiple(collective: str, big: torch.Tensor, big_name: str, small: torch.Tensor, small_name: str, world: int) -> None:
    """`big` holds one `small` per rank."""
    if big.numel() != world * small.numel():
        raise ValueError(
            f"tpu_dist {collective}: {big_name} has {big.numel()} elements, expected {world} ranks x "
            f"{small.numel()} elements of {small_name} = {world * small.numel()}"
        )


def root_rank(collective: str, root: int, world: int) -> None:
    if not 0 <= root < world:
        raise ValueError(f"tpu_dist {collective}: rank {root} is not in this group of {world} ranks")


def split_sizes(collective: str, splits_name: str, t: torch.Tensor, t_name: str, splits: Sequence[int], world: int) -> list[int]:
    """Rows (along dim 0) of `t` per rank: `splits` checked, or an even split when it is empty."""
    if t.dim() == 0:
        raise ValueError(f"tpu_dist {collective}: the {t_name} must have a dim 0 to split")
    rows = t.shape[0]
    if len(splits) == 0:
        if rows % world:
            raise ValueError(
                f"tpu_dist {collective}: {splits_name} is empty (even split), but dim 0 of the "
                f"{t_name} ({rows} rows) does not divide by {world} ranks"
            )
        return [rows // world] * world
    splits = [int(s) for s in splits]
    if len(splits) != world:
        raise ValueError(
            f"tpu_dist {collective}: {splits_name} has {len(splits)} entries, expected one per rank ({world})"
        )
    if any(s < 0 for s in splits):
        raise ValueError(f"tpu_dist {collective}: {splits_name} {splits} has negative sizes")
    if sum(splits) != rows:
        raise ValueError(
            f"tpu_dist {collective}: {splits_name} {splits} sum to {sum(splits)} rows, but dim 0 of "
            f"the {t_name} has {rows} rows"
        )
    return splits


def contiguous(collective: str, tensors: Sequence[torch.Tensor]) -> None:
    """Cpu tensors travel as they lie in memory: each must be one contiguous block."""
    for i, t in enumerate(tensors):
        if not t.is_contiguous():
            raise ValueError(
                f"tpu_dist {collective}: cpu tensor {i} of the call is not contiguous (stride "
                f"{t.stride()} for shape {tuple(t.shape)}); pass .contiguous() tensors"
            )


def row_shapes(collective: str, output: torch.Tensor, input: torch.Tensor) -> None:
    if output.shape[1:] != input.shape[1:]:
        raise ValueError(
            f"tpu_dist {collective}: input rows have shape {tuple(input.shape[1:])} but output rows "
            f"have shape {tuple(output.shape[1:])}"
        )


# --- what ranks exchange before an all-to-all ---------------------------------------------------


def exchange_values(send: Sequence[int], recv: Sequence[int], row_numel: int, dtype: torch.dtype) -> tuple[int, ...]:
    """This rank's entry of the exchange table: sizes sent to / expected from each rank, the
    number of elements per size unit, and the dtype."""
    return (*send, *recv, row_numel, _DTYPE_CODES[dtype])


@dataclass(frozen=True)
class ExchangeSizes:
    """The sizes of an all-to-all that every rank agreed on."""

    send: np.ndarray  # [world, world]: units (rows or elements) rank i sends to rank j
    row_numel: int  # elements per unit
    dtype: torch.dtype

    def splits(self, rank: int) -> tuple[list[int], list[int]]:
        """`rank`'s (input, output) split sizes (computed once: a guess serves many calls)."""
        splits = self._splits.get(rank)
        if splits is None:
            splits = self._splits[rank] = (self.send[rank].tolist(), self.send[:, rank].tolist())
        return splits

    @functools.cached_property
    def _splits(self) -> dict[int, tuple[list[int], list[int]]]:
        return {}


def check_exchange_table(collective: str, table: np.ndarray, unit: str, send_name: str, recv_name: str) -> ExchangeSizes:
    """The agreed sizes; raises unless every rank sends each peer exactly what that peer expects.

    `table[i]` is rank i's `exchange_values`. Every rank checks the same table in the same order,
    so all ranks raise the same error.
    """
    world = table.shape[0]
    codes = table[:, 2 * world + 1]
    if len(set(codes.tolist())) > 1:
        found = ", ".join(f"rank {r}: {_DTYPES[c]}" for r, c in enumerate(codes.tolist()))
        raise ValueError(f"tpu_dist {collective}: ranks disagree on the dtype ({found})")
    row_numels = table[:, 2 * world]
    if len(set(row_numels.tolist())) > 1:
        found = ", ".join(f"rank {r}: {n}" for r, n in enumerate(row_numels.tolist()))
        raise ValueError(f"tpu_dist {collective}: ranks disagree on the elements per row ({found})")
    sends, recvs = table[:, :world], table[:, world:2 * world]
    bad = np.argwhere(sends != recvs.T)
    if len(bad):
        shown = [
            f"rank {i} sends {sends[i, j]} {unit} to rank {j} ({send_name}[{j}]) but rank {j} "
            f"expects {recvs[j, i]} from rank {i} ({recv_name}[{i}])"
            for i, j in bad[:4].tolist()
        ]
        more = f"; and {len(bad) - 4} more" if len(bad) > 4 else ""
        raise ValueError(f"tpu_dist {collective}: ranks disagree on sizes: " + "; ".join(shown) + more)
    return ExchangeSizes(sends.copy(), int(row_numels[0]), _DTYPES[int(codes[0])])


def row_numel(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:])
