"""Bounded dynamism: dimensions that vary between calls, padded up to a few bucket sizes.

A batch size or a sequence length that changes every step would compile a new XLA program for
every size. `bounded(x, dim)` declares such a dimension: it moves `x` to the device in storage
padded along `dim` up to a bucket (a power of two by default, or the smallest of the user's
sizes that fits) and returns a tensor of `x`'s true shape viewing the front of that storage.
`torch.compile(..., backend="tpu")` then runs the captured graph at the bucket size: the
dimension is symbolic in the graph, every bounded tensor is read whole from its padded storage,
and each op that would mix pad entries into real results is masked (`torchtpu.exec.bucketing`),
so results equal the unpadded computation. One program serves every size of a bucket.

Bounded dimensions live in captured code: an eager op on a bounded tensor sees (and compiles
for) its true shape. A compiled region runs through the current eager mode, so in `defer` mode
the region's programs fuse with the eager optimizer step around them.

    x = torchtpu.bounded(features, dim=0, device="tpu")   # features: CPU, any batch size
    y = torchtpu.bounded(labels, dim=0, device="tpu")
    loss = compiled_step(x, y)                              # <= one program per bucket
"""

from __future__ import annotations

import bisect
import weakref
from typing import Iterable, Sequence

import torch

from torchtpu import storage


class Buckets:
    """The sizes a bounded dimension is padded up to: powers of two, or the given sizes."""

    def __init__(self, sizes: Iterable[int] | None = None, *, max_size: int | None = None) -> None:
        if sizes is None:
            self.sizes: tuple[int, ...] | None = None
        else:
            self.sizes = tuple(sorted({int(s) for s in sizes}))
            if not self.sizes or self.sizes[0] < 1:
                raise ValueError(f"bucket sizes must be positive integers, got {tuple(sizes)}")
        self.max_size = max_size if max_size is not None else (self.sizes[-1] if self.sizes else None)

    def bucket(self, size: int) -> int:
        """The smallest bucket holding `size` entries."""
        if size < 1:
            raise ValueError(f"a bounded dimension needs at least one entry, got size {size}")
        if self.max_size is not None and size > self.max_size:
            raise ValueError(f"bounded dimension of size {size} exceeds its bound {self.max_size}")
        if self.sizes is None:
            return 1 << (size - 1).bit_length()
        return self.sizes[bisect.bisect_left(self.sizes, size)]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Buckets) and (self.sizes, self.max_size) == (other.sizes, other.max_size)

    def __hash__(self) -> int:
        return hash((self.sizes, self.max_size))

    def __repr__(self) -> str:
        sizes = "powers of two" if self.sizes is None else list(self.sizes)
        return f"Buckets({sizes}, max_size={self.max_size})"


# Device buffers holding padded layouts: buffer -> {axis of the tensors viewing it: Buckets}.
_marks: "weakref.WeakKeyDictionary[storage.DeviceBuffer, dict[int, Buckets]]" = weakref.WeakKeyDictionary()


def bounds_of(t: torch.Tensor) -> dict[int, Buckets]:
    """The bounded axes of a `tpu` tensor (empty for an ordinary tensor)."""
    if t.device.type != "tpu":
        return {}
    return _marks.get(storage.buffer_of(t), {})


def mark(t: torch.Tensor, axes: dict[int, Buckets]) -> None:
    """Record that `t`'s storage holds `t` padded along `axes` (for graphs that produce one)."""
    _marks[storage.buffer_of(t)] = dict(axes)
    import torch._dynamo

    for axis in axes:
        torch._dynamo.mark_dynamic(t, axis)


def pad(x: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """`x` padded to `sizes` (each at least `x`'s), its pad entries repeating the first entry
    along each padded axis (see `bounded`)."""
    for d, size in enumerate(sizes):
        extra = size - x.shape[d]
        if extra:
            fill = x.narrow(d, 0, 1).expand(*[extra if i == d else -1 for i in range(x.dim())])
            x = torch.cat([x, fill], dim=d)
    return x


def bounded(
    x: torch.Tensor,
    dim: int | Sequence[int] = 0,
    buckets: Buckets | Sequence[int] | None = None,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """`x` on a `tpu` device, with `dim` declared bounded: stored padded up to its bucket.

    `x` must be a CPU tensor (the padding is written on the host, so no program is compiled for
    its true size); `device` defaults to the current `tpu` device. Pad entries repeat the first
    entry along `dim`, so values computed on them stay as finite and as in-range (ids, targets)
    as real ones; masks keep them out of every result.
    """
    if x.device.type != "cpu":
        raise ValueError(
            f"torchtpu.bounded pads on the host: pass the CPU tensor (got one on {x.device}), "
            "it is moved to `device` already padded"
        )
    if x.requires_grad:
        raise ValueError("torchtpu.bounded takes data, not a tensor that requires grad")
    policy = buckets if isinstance(buckets, Buckets) else Buckets(buckets)
    dims = sorted({d % x.dim() for d in ((dim,) if isinstance(dim, int) else dim)})
    padded = pad(x.contiguous(), [policy.bucket(size) if d in dims else size for d, size in enumerate(x.shape)])
    target = torch.device(device) if device is not None else torch.device("tpu")
    if target.type != "tpu":
        raise ValueError(f"torchtpu.bounded places tensors on a tpu device, not {target}")
    on_device = padded.to(target)
    view = storage.new_tensor(storage.buffer_of(on_device), tuple(x.shape), tuple(on_device.stride()))
    mark(view, {d: policy for d in dims})
    return view


__all__ = ["Buckets", "bounded", "bounds_of"]
