"""What each rank runs in the tpu_dist multi-process tests (see `_dist_harness.run_ranks`).

References: PyTorch's own gloo process group on CPU tensors (a `dist.new_group(backend="gloo")`
next to the tpu_dist group), NumPy models of what an all-to-all must deliver, and for DDP one
process training on the whole batches (the equivalence DDP promises).
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

import torchtpu
from torchtpu.distributed import CollectiveError
from torchtpu.distributed.process_group import TRANSPORT_ENV

DTYPES = (torch.float32, torch.bfloat16, torch.int64)
OPS = {
    "sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT,
}


def _init(backend: str = "cpu:gloo,tpu:tpu_dist") -> None:
    dist.init_process_group(backend)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bit pattern, so NaNs and signed zeros compare exactly."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16)
    return t


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (
        f"{what}: {actual.shape}/{actual.dtype} vs {expected.shape}/{expected.dtype}"
    )
    if not torch.equal(_bits(actual), _bits(expected)):
        raise AssertionError(f"{what}: tpu_dist result differs from gloo\n{actual.cpu()}\n{expected.cpu()}")


def assert_within_an_ulp(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Neighbouring floats at most: their bit patterns (same sign) differ by 0 or 1."""
    a, b = _bits(actual).to(torch.int64), _bits(expected).to(torch.int64)
    if not bool(((a - b).abs() <= 1).all()):
        raise AssertionError(f"{what}: more than one ulp from gloo\n{actual.cpu()}\n{expected.cpu()}")


# --- collectives, compared with gloo on CPU tensors --------------------------------------------


@dataclass
class Case:
    """One run of a collective: on tpu tensors through tpu_dist, or on CPU tensors through gloo."""

    rank: int
    world: int
    device: torch.device
    group: dist.ProcessGroup
    dtype: torch.dtype
    async_op: bool
    pending_inputs: bool  # inputs are results of not-yet-run ops (DeferAndFuse promises)
    small_integers: bool = False  # values any summation order adds up exactly
    inputs: list = field(default_factory=list)  # (tensor, value it must keep)

    def data(self, *shape: int, salt: int = 0) -> torch.Tensor:
        seed = 1000 * self.rank + 17 * salt + DTYPES.index(self.dtype)
        g = torch.Generator().manual_seed(seed)
        if self.small_integers:
            host = torch.randint(-2, 3, shape, generator=g).to(self.dtype)
        elif self.dtype == torch.int64:
            host = torch.randint(-9, 10, shape, generator=g)
        else:
            host = torch.randn(shape, generator=g).to(self.dtype)
        t = host.to(self.device)
        if self.pending_inputs and self.device.type == "tpu":
            t = t.clone()
        self.inputs.append((t, host))
        return t

    def empty(self, *shape: int) -> torch.Tensor:
        """An output, filled with a sentinel on the host (no device program to compile)."""
        return torch.full(shape, -7, dtype=self.dtype).to(self.device)

    def run(self, collective: Callable, *args, **kwargs) -> None:
        work = collective(*args, group=self.group, async_op=self.async_op, **kwargs)
        if self.async_op:
            work.wait()


def _splits(world: int, seed: int) -> np.ndarray:
    """rows[i, j]: rows rank i sends to rank j (zeros included); the same on every rank."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 4, (world, world))
    rows[rng.random((world, world)) < 0.3] = 0
    return rows


def _all_reduce(op):
    def case(c: Case):
        x = c.data(5, 3)
        c.run(dist.all_reduce, x, op=OPS[op])
        return [x], True

    return case


def _reduce_scatter(op):
    def case(c: Case):
        out = c.empty(3, 2)
        c.run(dist.reduce_scatter, out, [c.data(3, 2, salt=j) for j in range(c.world)], op=OPS[op])
        return [out], False

    return case


def _reduce_scatter_tensor(op):
    def case(c: Case):
        out = c.empty(4)
        c.run(dist.reduce_scatter_tensor, out, c.data(4 * c.world), op=OPS[op])
        return [out], False

    return case


def _broadcast(c: Case):
    x = c.data(7)
    c.run(dist.broadcast, x, src=c.world - 1)
    return [x], True


def _all_gather(c: Case):
    outs = [c.empty(4, 2) for _ in range(c.world)]
    c.run(dist.all_gather, outs, c.data(4, 2))
    return outs, False


def _all_gather_into_views(c: Case):
    """Outputs are column views of one tensor; the input is a transposed slice. (gloo on CPU
    reads strided tensors as if they were contiguous, so the reference runs on contiguous
    copies and PyTorch writes the results into the views.)"""
    big = c.empty(5, c.world)
    source = c.data(5, 3).t()[1]
    if c.device.type == "tpu":
        c.run(dist.all_gather, [big[:, j] for j in range(c.world)], source)
    else:
        outs = [c.empty(5) for _ in range(c.world)]
        c.run(dist.all_gather, outs, source.contiguous())
        for j, out in enumerate(outs):
            big[:, j] = out
    return [big], False


def _all_reduce_view(c: Case):
    base = c.data(4, 6)
    view = base.t()[1:4]
    if c.device.type == "tpu":
        c.run(dist.all_reduce, view)
    else:
        dense = view.contiguous()
        c.run(dist.all_reduce, dense)
        view.copy_(dense)
    return [base], True


def _all_gather_into_tensor(c: Case):
    out = c.empty(c.world * 3, 2)
    c.run(dist.all_gather_into_tensor, out, c.data(3, 2))
    return [out], False


def _single_tensor_collectives_of_other_shapes(c: Case):
    """Shapes whose sizes match but not along dim 0 (SyncBatchNorm gathers `[C]` into `[1, world
    * C]`): NCCL and tpu_dist take them; gloo splits along dim 0 and refuses them, so its
    reference runs flat."""
    flat = c.device.type == "cpu"
    gathered = c.empty(c.world * 6) if flat else c.empty(1, c.world * 6)
    c.run(dist.all_gather_into_tensor, gathered, c.data(6) if flat else c.data(2, 3))
    scattered = c.empty(4) if flat else c.empty(2, 2)
    reduced = c.data(4 * c.world, salt=1)
    c.run(dist.reduce_scatter_tensor, scattered, reduced if flat else reduced.view(1, -1), op=dist.ReduceOp.SUM)
    return [gathered.view(1, -1), scattered.view(2, 2)], False


def _all_to_all_single_even(c: Case):
    out = c.empty(2 * c.world, 3)
    c.run(dist.all_to_all_single, out, c.data(2 * c.world, 3))
    return [out], False


def _all_to_all_single_in_place(c: Case):
    """Output and input are one tensor, twice (the second time its buffer is one that XLA
    allocated): every row must arrive as if they were two tensors (the reference runs on two
    CPU tensors; gloo does not promise in-place all-to-all)."""
    x = c.data(2 * c.world, 3)
    for _ in range(2):
        if c.device.type == "tpu":
            c.run(dist.all_to_all_single, x, x)
        else:
            out = c.empty(2 * c.world, 3)
            c.run(dist.all_to_all_single, out, x)
            x.copy_(out)
    return [x], True


def _all_to_all_single_uneven(c: Case):
    rows = _splits(c.world, seed=7)
    out = c.empty(int(rows[:, c.rank].sum()), 2)
    inp = c.data(int(rows[c.rank].sum()), 2)
    c.run(dist.all_to_all_single, out, inp, rows[:, c.rank].tolist(), rows[c.rank].tolist())
    return [out], False


def _all_to_all_single_empty_side(c: Case):
    """TorchRec's sequence all-to-all from a rank that holds no table: rank 0 sends nothing, as
    `[0, 3]`, and every rank receives into a flat output; c10d ignores the row shape of a side
    without rows, and so must tpu_dist."""
    if c.rank == 0:
        inp, send = c.data(0, 3), [0] * c.world
    else:
        inp, send = c.data(3 * c.world), [3] * c.world
    recv = [0] + [3] * (c.world - 1)
    out = c.empty(sum(recv))
    c.run(dist.all_to_all_single, out, inp, recv, send)
    return [out], False


def _all_to_all(c: Case):
    """Equal sizes: gloo's list form hangs on unequal ones (the fuzz test covers those)."""
    outs = [c.empty(3, 2) for _ in range(c.world)]
    c.run(dist.all_to_all, outs, [c.data(3, 2, salt=j) for j in range(c.world)])
    return outs, False


def _send_recv(c: Case):
    """A ring: every rank sends to the next and receives from the previous."""
    out = c.empty(6)
    x = c.data(6)
    nxt, prev = (c.rank + 1) % c.world, (c.rank - 1) % c.world
    if c.async_op:
        works = [dist.isend(x, nxt, group=c.group), dist.irecv(out, prev, group=c.group)]
        for w in works:
            w.wait()
    elif c.rank % 2 == 0:
        dist.send(x, nxt, group=c.group)
        dist.recv(out, prev, group=c.group)
    else:
        dist.recv(out, prev, group=c.group)
        dist.send(x, nxt, group=c.group)
    return [out], False


def _reduce(op):
    def case(c: Case):
        """The root's result is gloo's. Gloo leaves scratch in the other ranks' tensors, tpu_dist
        their values (so its inputs there must be unchanged), so gloo gets copies there."""
        x = c.data(5, 3)
        root = c.world - 1
        c.run(dist.reduce, x if c.device.type == "tpu" or c.rank == root else x.clone(), dst=root, op=OPS[op])
        return ([x], True) if c.rank == root else ([], False)

    return case


def _gather(c: Case):
    outs = [c.empty(3, 2) for _ in range(c.world)] if c.rank == 0 else None
    c.run(dist.gather, c.data(3, 2), outs, dst=0)
    return outs or [], False


def _scatter(c: Case):
    root = c.world - 1
    out = c.empty(3, 2)
    sources = [c.data(3, 2, salt=j) for j in range(c.world)] if c.rank == root else None
    c.run(dist.scatter, out, sources, src=root)
    return [out], False


def _coalesced(c: Case, collective: Callable, *calls: tuple, **kwargs) -> None:
    """`collective(*args, **kwargs)` for each args of `calls`, coalesced into one call of the group."""
    with dist._coalescing_manager(group=c.group, async_ops=c.async_op) as coalesced:
        for args in calls:
            collective(*args, group=c.group, **kwargs)
    if c.async_op:
        coalesced.wait()


def _all_reduce_coalesced(op):
    def case(c: Case):
        xs = [c.data(5, 3), c.data(4, salt=1)]
        _coalesced(c, dist.all_reduce, *((x,) for x in xs), op=OPS[op])
        return xs, True

    return case


def _all_gather_into_tensor_coalesced(c: Case):
    outs = [c.empty(c.world * 3, 2), c.empty(c.world * 5)]
    _coalesced(c, dist.all_gather_into_tensor, (outs[0], c.data(3, 2)), (outs[1], c.data(5, salt=1)))
    return outs, False


def _reduce_scatter_tensor_coalesced(c: Case):
    outs = [c.empty(4), c.empty(2, 3)]
    _coalesced(c, dist.reduce_scatter_tensor, (outs[0], c.data(c.world * 4)), (outs[1], c.data(c.world * 2, 3, salt=1)))
    return outs, False


CASES: dict[str, Callable] = {
    **{f"all_reduce_{op}": _all_reduce(op) for op in OPS},
    **{f"reduce_scatter_{op}": _reduce_scatter(op) for op in OPS},
    **{f"reduce_scatter_tensor_{op}": _reduce_scatter_tensor(op) for op in ("sum", "max")},
    "broadcast": _broadcast,
    "all_gather": _all_gather,
    "all_gather_into_views": _all_gather_into_views,
    "all_reduce_view": _all_reduce_view,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "single_tensor_collectives_of_other_shapes": _single_tensor_collectives_of_other_shapes,
    "all_to_all_single_even": _all_to_all_single_even,
    "all_to_all_single_in_place": _all_to_all_single_in_place,
    "all_to_all_single_uneven": _all_to_all_single_uneven,
    "all_to_all_single_empty_side": _all_to_all_single_empty_side,
    "all_to_all": _all_to_all,
    "send_recv": _send_recv,
    **{f"reduce_{op}": _reduce(op) for op in OPS},
    "gather": _gather,
    "scatter": _scatter,
    **{f"all_reduce_coalesced_{op}": _all_reduce_coalesced(op) for op in ("sum", "max")},
    "all_gather_into_tensor_coalesced": _all_gather_into_tensor_coalesced,
    "reduce_scatter_tensor_coalesced": _reduce_scatter_tensor_coalesced,
}


# Calls that gloo rejects, so tpu_dist must reject them too; any other exception fails the test.
REJECTED = {("all_reduce_avg", torch.int64), ("reduce_scatter_avg", torch.int64), ("reduce_avg", torch.int64)}


def _outcome(case: Callable, c: Case):
    """The case's outputs on the host, or the exception type it raised; inputs it must not change
    are checked to be unchanged."""
    try:
        outputs, in_place = case(c)
    except (RuntimeError, ValueError) as error:
        return type(error).__name__
    if not in_place:
        for t, value in c.inputs:
            assert torch.equal(_bits(t), _bits(value)), f"an input of {case} was modified"
    return [t.detach().cpu() for t in outputs]


def collectives_and_all_to_all(rank: int, world: int, modes: tuple[str, ...], patterns: int) -> None:
    _init()
    torch.tpu.set_device(rank)
    collectives_vs_gloo(rank, world, modes)
    all_to_all_fuzz(rank, world, patterns)
    guessed_all_to_all(rank, world)
    dist.destroy_process_group()


def xla_transport_vs_gloo(rank: int, world: int, patterns: int) -> None:
    """The TPU's transport (XLA collectives between processes), run on the CPU stand-in's
    multi-process JAX runtime: every collective equals gloo on CPU tensors bit for bit (on
    small integers, which XLA's and gloo's different summation orders add up alike), and uneven
    all-to-all delivers every element where the NumPy model says."""
    os.environ[TRANSPORT_ENV] = "xla"
    _init()
    torch.tpu.set_device(rank)
    assert torchtpu.runtime.runtime().process_count == world
    before = torchtpu.metrics()
    # XLA divides by the world size as a multiplication by its reciprocal: AVG within one ulp.
    collectives_vs_gloo(rank, world, ("strict",), small_integers=True,
                        last_bit=frozenset({"all_reduce_avg", "reduce_scatter_avg", "reduce_avg"}))
    all_to_all_fuzz(rank, world, patterns)
    # Its bytes do not all go through gloo, so the group agrees on every all-to-all's sizes.
    after = torchtpu.metrics()
    guesses = [after.get(k, 0) - before.get(k, 0) for k in ("dist_all_to_all_guessed", "dist_all_to_all_guess_missed")]
    assert guesses == [0, 0], f"rank {rank}: an XLA-transport group guessed all-to-all sizes {guesses}"
    dist.destroy_process_group()


def collectives_vs_gloo(rank: int, world: int, modes: tuple[str, ...], small_integers: bool = False,
                        last_bit: frozenset[str] = frozenset()) -> None:
    """Every collective, dtype and sync/async mode on tpu tensors equals gloo on CPU tensors,
    bit for bit (the `last_bit` cases to within a unit in the last place); in the other eager
    modes, with inputs that are pending results. Then CPU tensors through the mixed group
    ("cpu:gloo,tpu:tpu_dist") equal gloo's own group."""
    reference = dist.new_group(backend="gloo")
    device = torch.device("tpu", rank)
    _cpu_through_mixed_group(rank, world, reference, small_integers)
    for mode in modes:
        torchtpu.set_eager_mode(mode)
        for dtype in DTYPES:
            for async_op in (False, True):
                for name, case in CASES.items():
                    pending = mode == "defer"
                    got = _outcome(case, Case(rank, world, device, dist.group.WORLD, dtype, async_op, pending,
                                              small_integers))
                    want = _outcome(case, Case(rank, world, torch.device("cpu"), reference, dtype, async_op, False,
                                               small_integers))
                    what = f"{name} {dtype} async={async_op} mode={mode} rank={rank}"
                    if (name, dtype) in REJECTED:
                        assert isinstance(want, str) and isinstance(got, str), f"{what}: {want} / {got}"
                        continue
                    assert not isinstance(want, str), f"{what}: gloo raised {want}"
                    assert not isinstance(got, str), f"{what}: tpu_dist raised {got}, gloo did not"
                    for i, (a, b) in enumerate(zip(got, want, strict=True)):
                        if name in last_bit and dtype.is_floating_point:
                            assert_within_an_ulp(a, b, f"{what} output {i}")
                        else:
                            assert_same_bits(a, b, f"{what} output {i}")
        dist.barrier()
    torchtpu.set_eager_mode("strict")


def _cpu_through_mixed_group(rank: int, world: int, reference: dist.ProcessGroup, small_integers: bool) -> None:
    """Every collective on CPU tensors through the default group, which serves cpu by gloo,
    gives what gloo's own group gives."""
    cpu = torch.device("cpu")
    for dtype in DTYPES:
        for name, case in CASES.items():
            if (name, dtype) in REJECTED:
                continue
            got = _outcome(case, Case(rank, world, cpu, dist.group.WORLD, dtype, False, False, small_integers))
            want = _outcome(case, Case(rank, world, cpu, reference, dtype, False, False, small_integers))
            what = f"{name} {dtype} on cpu tensors through the mixed group, rank={rank}"
            assert not isinstance(want, str), f"{what}: gloo raised {want}"
            assert not isinstance(got, str), f"{what}: raised {got}"
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                assert_same_bits(a, b, f"{what} output {i}")


# --- uneven all-to-all fuzzing against a NumPy model ----------------------------------------


def _tagged_rows(src: int, rows: np.ndarray, width: int) -> np.ndarray:
    """The rows rank `src` sends: each element names (source, destination, row, column)."""
    blocks = []
    for dst, count in enumerate(rows[src]):
        k = np.arange(count)[:, None]
        col = np.arange(width)[None, :]
        blocks.append(src * 1_000_000 + dst * 10_000 + k * 10 + col)
    return np.concatenate(blocks).astype(np.int64) if blocks else np.zeros((0, width), np.int64)


def _received_rows(rank: int, rows: np.ndarray, width: int) -> np.ndarray:
    """What the NumPy model says rank `rank` receives: each source's block for it, in rank order."""
    return np.concatenate([_tagged_rows(src, rows, width)[rows[src, :rank].sum():][: rows[src, rank]]
                           for src in range(rows.shape[0])])


def all_to_all_fuzz(rank: int, world: int, patterns: int) -> None:
    """Random uneven split patterns (zeros included): every received element is the one the
    NumPy model says, in every dtype, shape and sync/async mode, on tpu tensors and (every
    fifth pattern) on cpu tensors through the mixed group."""
    rng = np.random.default_rng(2024 + world)  # the same patterns on every rank
    for p in range(patterns):
        device = torch.device("cpu") if p % 5 == 4 else torch.device("tpu", rank)
        rows = rng.integers(0, 6, (world, world))
        rows[rng.random((world, world)) < rng.uniform(0.1, 0.6)] = 0
        width = (1, 3)[p % 2]
        dtype = (torch.int64, torch.float32)[(p // 2) % 2]
        mine = _tagged_rows(rank, rows, width)
        expected = _received_rows(rank, rows, width)
        host_in = torch.from_numpy(mine).to(dtype)
        if width == 1:
            host_in, expected = host_in.reshape(-1), expected.reshape(-1)
        received = int(rows[:, rank].sum())
        async_op = p % 3 == 0
        if p % 4 == 3:  # the list form: one tensor per peer
            inputs = [piece.to(device) for piece in host_in.split(rows[rank].tolist())]
            outputs = [torch.empty((int(n), width)[: host_in.dim()], dtype=dtype, device=device)
                       for n in rows[:, rank]]
            work = dist.all_to_all(outputs, inputs, async_op=async_op)
            sent = torch.cat([t.cpu() for t in inputs])
        else:
            inp = host_in.to(device)
            outputs = [torch.empty((received, width)[: host_in.dim()], dtype=dtype, device=device)]
            work = dist.all_to_all_single(outputs[0], inp, rows[:, rank].tolist(), rows[rank].tolist(), async_op=async_op)
            sent = inp.cpu()
        if async_op:
            work.wait()
        got = torch.cat([t.cpu() for t in outputs]).to(torch.int64).numpy()
        assert got.shape == expected.shape and np.array_equal(got, expected), (
            f"pattern {p} rows={rows.tolist()} rank {rank}: got {got.tolist()} expected {expected.tolist()}"
        )
        assert torch.equal(sent, host_in), f"pattern {p}: an input was modified"


def _exchange_and_check(rank: int, rows: np.ndarray, dtype: torch.dtype, device: torch.device, async_op: bool,
                        what: str) -> None:
    """One uneven all_to_all_single of tagged rows (width 2) on `device`, checked element by element."""
    expected = _received_rows(rank, rows, 2)
    inp = torch.from_numpy(_tagged_rows(rank, rows, 2)).to(dtype).to(device)
    out = torch.full((int(rows[:, rank].sum()), 2), -7, dtype=dtype).to(device)
    work = dist.all_to_all_single(out, inp, rows[:, rank].tolist(), rows[rank].tolist(), async_op=async_op)
    if async_op:
        work.wait()
    got = out.cpu().to(torch.int64).numpy()
    assert np.array_equal(got, expected), f"{what} rank {rank}: got {got.tolist()} expected {expected.tolist()}"


def guessed_all_to_all(rank: int, world: int) -> None:
    """Repeated sizes: the data moves on the guessed sizes and nothing else is exchanged unless a
    rank's call differs (see `torchtpu.distributed.exchange`). Every result equals the NumPy
    model when the guess holds, when only some ranks' calls differ from it (the others' exchange
    runs on the guess first), when every rank's call differs, when only rank 0's call differs
    (every other rank learns it from rank 0's notice), also where rank 0 sends a peer nothing
    (the notice then precedes an empty message), on tpu and on cpu tensors; and every rank
    counted the same guesses taken and missed."""
    tpu = torch.device("tpu", rank)
    same = np.full((world, world), 2)
    one_pair = same.copy()
    one_pair[0, world - 1] = 5  # only the calls of ranks 0 and world - 1 change
    own_only = same.copy()
    own_only[0, 0] = 3  # only rank 0's call changes (what it sends itself)
    silent = same.copy()
    silent[0, world - 1] = 0  # rank 0 sends rank world - 1 nothing
    silent_own = silent.copy()
    silent_own[0, 0] = 3
    calls = [  # (rows, dtype, device, async): guess confirmed (+) or missed (-)
        (same, torch.int64, tpu, False), (same, torch.int64, tpu, True),
        (same, torch.int64, tpu, False),  # +
        (same, torch.int64, torch.device("cpu"), True),  # +
        (one_pair, torch.int64, tpu, False),  # -
        (one_pair, torch.int64, tpu, False), (one_pair, torch.int64, tpu, True),  # +
        (same, torch.float32, tpu, False),  # - (every rank's call differs: the dtype)
        (same, torch.float32, tpu, False), (same, torch.float32, torch.device("cpu"), False),  # +
        (own_only, torch.float32, tpu, False),  # - (rank 0's call only)
        (own_only, torch.float32, tpu, False), (own_only, torch.float32, tpu, False),  # +
        (silent, torch.float32, tpu, False),  # -
        (silent, torch.float32, tpu, False), (silent, torch.float32, tpu, False),  # +
        (silent_own, torch.float32, tpu, False),  # - (rank 0's call only; rank world - 1 gets nothing from it)
        (silent_own, torch.float32, tpu, False), (silent_own, torch.float32, tpu, True),  # +
    ]
    before = torchtpu.metrics()
    for i, (rows, dtype, device, async_op) in enumerate(calls):
        _exchange_and_check(rank, rows, dtype, device, async_op, f"guessed call {i}")
    after = torchtpu.metrics()
    counted = [after.get(k, 0) - before.get(k, 0) for k in ("dist_all_to_all_guessed", "dist_all_to_all_guess_missed")]
    assert counted == [7, 5], f"rank {rank}: guesses confirmed/missed {counted}, expected [7, 5]"
    _outputs_stay_in_place(rank, world)
    _exchanges_in_flight_together(rank, world)


def _exchanges_in_flight_together(rank: int, world: int) -> None:
    """Several all-to-alls in flight at once, of different sizes, with user point-to-point
    messages between them, waited on in reverse order: each delivers its own bytes."""
    tpu = torch.device("tpu", rank)
    patterns = [np.full((world, world), n) for n in (3, 1, 4)]
    launched = []
    for k, rows in enumerate(patterns):
        mine = torch.from_numpy(_tagged_rows(rank, rows, 2) + k * 100_000_000)
        out = torch.full((int(rows[:, rank].sum()), 2), -7, dtype=torch.int64).to(tpu)
        work = dist.all_to_all_single(out, mine.to(tpu), rows[:, rank].tolist(), rows[rank].tolist(), async_op=True)
        peer = (rank + 1) % world
        note = dist.isend(torch.full((3,), rank + 10 * k, device=tpu), peer, tag=0)
        heard = torch.empty(3, dtype=torch.int64, device=tpu)
        launched.append((k, rows, out, work, note, dist.irecv(heard, (rank - 1) % world, tag=0), heard))
    for k, rows, out, work, note, hearing, heard in reversed(launched):
        work.wait()
        note.wait()
        hearing.wait()
        expected = _received_rows(rank, rows, 2) + k * 100_000_000
        assert np.array_equal(out.cpu().numpy(), expected), f"rank {rank}: exchange {k} delivered other bytes"
        assert heard.cpu().tolist() == [(rank - 1) % world + 10 * k] * 3, f"rank {rank}: message {k}"


def _outputs_stay_in_place(rank: int, world: int) -> None:
    """Repeated calls on the same tensors write their outputs in their own device buffers every
    time: gloo letting go of a call's host buffers late never makes the next call copy them."""
    from torchtpu.exec import memory

    tpu = torch.device("tpu", rank)
    out, inp = torch.zeros(8 * world).to(tpu), torch.full((8 * world,), float(rank)).to(tpu)
    reduced = torch.ones(1 << 16).to(tpu)

    def both() -> tuple[int, int]:
        dist.all_to_all_single(out, inp)
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
        return memory.to_array(out).unsafe_buffer_pointer(), memory.to_array(reduced).unsafe_buffer_pointer()

    first = both()  # the first claim may copy (the buffers came from the host)
    for i in range(20):
        assert both() == first, f"rank {rank}: call {i} moved an output to another buffer"
    assert torch.equal(out.cpu(), torch.arange(world, dtype=torch.float32).repeat_interleave(8))
    assert torch.equal(reduced.cpu(), torch.ones(1 << 16))


# --- errors -----------------------------------------------------------------------------------


def _raises(error: type, match: str, fn: Callable, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except error as e:
        assert match in str(e), f"expected {match!r} in: {e}"
        return str(e)
    raise AssertionError(f"{fn.__name__} did not raise {error.__name__} ({match})")


def errors(rank: int, world: int) -> None:
    """Bad calls raise clear errors on every rank involved, and the group keeps working."""
    _init()
    torch.tpu.set_device(rank)
    device = torch.device("tpu", rank)

    # Ranks disagree on split sizes: every rank raises the same error, nothing is sent.
    inp = torch.arange(3, device=device)
    out = torch.empty(3 if rank == 0 else 4, dtype=torch.int64, device=device)
    message = _raises(ValueError, "ranks disagree on sizes", dist.all_to_all_single, out, inp,
                      [1, 2] if rank == 0 else [1, 3], [1, 2])
    assert "rank 0 sends 2 rows to rank 1 (input_split_sizes[1]) but rank 1 expects 1 from rank 0" in message, message
    # The same disagreement right after repeated sizes, whose exchange already runs on the guess
    # while sizes are checked: the same error everywhere, and the next exchange is right.
    rows = np.full((world, world), 1)
    for _ in range(2):
        _exchange_and_check(rank, rows, torch.int64, device, False, "before the disagreement")
    _raises(ValueError, "ranks disagree on sizes", dist.all_to_all_single, out, inp,
            [1, 2] if rank == 0 else [1, 3], [1, 2])
    _exchange_and_check(rank, rows, torch.int64, device, False, "after the disagreement")
    # A rank's own sizes that do not add up.
    _raises(ValueError, "sum to 4 rows, but dim 0 of the input has 3", dist.all_to_all_single,
            torch.empty(4, dtype=torch.int64, device=device), inp, [2, 2], [2, 2])
    _raises(ValueError, "does not divide by 2 ranks", dist.all_to_all_single, out, inp)
    # Lists of the wrong length and mismatched shapes.
    _raises(ValueError, "has 1 tensors, expected one per rank (2)", dist.all_gather,
            [torch.empty(3, device=device)], torch.ones(3, device=device))
    _raises(ValueError, "has 5 elements, expected 2 ranks x 3", dist.all_gather_into_tensor,
            torch.empty(5, device=device), torch.ones(3, device=device))
    # Rooted and coalesced calls whose arguments do not fit (each raises before anything moves,
    # so only the rank whose call is wrong makes it).
    group = dist.group.WORLD
    if rank == 0:
        _raises(ValueError, "output_tensors has 1 tensors, expected one per rank (2)", dist.gather,
                torch.ones(3, device=device), [torch.empty(3, device=device)], dst=0)
        _raises(ValueError, "input_tensors[1] has shape (4,), but the output has shape (3,)", dist.scatter,
                torch.empty(3, device=device), [torch.ones(3, device=device), torch.ones(4, device=device)], src=0)
    else:
        _raises(ValueError, "only the root rank passes output_tensors", group.gather,
                [[torch.empty(3, device=device)] * world], [torch.ones(3, device=device)])
    _raises(ValueError, "tensors holds 2 tensors, expected one", group.reduce,
            [torch.ones(2, device=device)] * 2)
    _raises(ValueError, "1 output_tensors for 2 input_tensors, expected as many", group.all_gather_single_coalesced,
            [torch.empty(4, device=device)], [torch.ones(2, device=device)] * 2)
    _raises(ValueError, "an input tensor has 3 elements, expected 2 ranks x 2 elements of its output tensor",
            group.reduce_scatter_single_coalesced, [torch.empty(2, device=device)], [torch.ones(3, device=device)])

    # Cpu tensors whose sizes disagree: the same error everywhere (gloo would wait forever).
    _raises(ValueError, "ranks disagree on sizes", dist.all_to_all, [torch.empty(2), torch.empty(2)],
            [torch.ones(2), torch.ones(1 if rank == 0 else 2)])
    _raises(ValueError, "cpu tensor 0 of the call is not contiguous", dist.all_to_all_single,
            torch.empty(4, 2).t(), torch.ones(2, 4))

    # Tensors on the wrong device.
    other = torch.device("tpu", rank + world)
    _raises(RuntimeError, f"tensors are on {other}, but this process drives {device}", dist.all_reduce,
            torch.ones(2, device=other))
    _raises(RuntimeError, "must be on one device", dist.all_gather_into_tensor,
            torch.empty(4), torch.ones(2, device=device))

    # After all that, the group still works.
    x = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(x)
    assert x.cpu().tolist() == [3.0] * 4

    # A peer that never joins a collective: a clear time-out, no hang.
    short = dist.new_group(backend="tpu_dist", timeout=timedelta(seconds=2))
    if rank == 0:
        start = time.monotonic()
        message = _raises(CollectiveError, "all_reduce failed on rank 0", dist.all_reduce,
                          torch.ones(2, device=device), group=short)
        assert "Timed out waiting 2000ms" in message, message
        assert time.monotonic() - start < 30
    dist.barrier()

    group = dist.group.WORLD
    dist.destroy_process_group()
    _raises(RuntimeError, "this process group was destroyed", group.allreduce, [torch.ones(2, device=device)])


def tpu_only_group(rank: int, world: int) -> None:
    """`init_process_group("tpu_dist")`: cpu tensors are refused, Python objects travel as tpu
    tensors (object collectives pick the group's one device type), barriers work. Destroyed, the
    group lets go of its gloo groups' threads though the caller still holds it."""
    torch.ones(1, device="tpu").cpu()  # the runtime's threads start before the count
    before = threads()
    _init("tpu_dist")
    assert dist.get_backend_config() == "tpu:tpu_dist"
    _raises(RuntimeError, "serves tpu tensors only", dist.all_reduce, torch.ones(2))
    objects = [None] * world
    dist.all_gather_object(objects, {"rank": rank})
    assert objects == [{"rank": r} for r in range(world)], objects
    broadcast = [f"from {rank}"]
    dist.broadcast_object_list(broadcast, src=world - 1)
    assert broadcast == [f"from {world - 1}"], broadcast
    gathered = [None] * world if rank == 0 else None
    dist.gather_object({"rank": rank}, gathered, dst=0)
    assert gathered == ([{"rank": r} for r in range(world)] if rank == 0 else None), gathered
    scattered = [None]
    dist.scatter_object_list(scattered, [f"to {r}" for r in range(world)] if rank == world - 1 else None, src=world - 1)
    assert scattered == [f"to {rank}"], scattered
    dist.barrier()
    group = dist.group.WORLD
    dist.destroy_process_group()
    assert threads() <= before, f"rank {rank}: {threads() - before} threads outlive the group {group}"


def checkpoint_on_a_tpu_only_group(rank: int, world: int, directory: str) -> None:
    """`torch.distributed.checkpoint` with `init_process_group("tpu_dist")`: its planner gathers
    and scatters Python objects, which travel as tpu tensors here. What is loaded into a model
    initialised otherwise is what was saved, bit for bit."""
    import torch.distributed.checkpoint as dcp

    _init("tpu_dist")
    torch.manual_seed(0)
    saved = torch.nn.Linear(4, 3).to("tpu")
    dcp.save({"model": saved.state_dict()}, checkpoint_id=directory)
    torch.manual_seed(1)
    loaded = torch.nn.Linear(4, 3).to("tpu")
    state = {"model": loaded.state_dict()}
    dcp.load(state, checkpoint_id=directory)
    loaded.load_state_dict(state["model"])
    for name, value in saved.state_dict().items():
        assert_same_bits(loaded.state_dict()[name], value, f"{name} on rank {rank}")
    dist.destroy_process_group()


def threads() -> int:
    """The threads of this process (Python's and native ones: gloo's are native), counted after
    a collection, so that no group left to the collector ends its threads mid-count."""
    gc.collect()
    return len(os.listdir("/proc/self/task"))


def init_alone(rank: int, world: int) -> None:
    """Rank 0 of a group of 2 whose peer never starts: init_process_group times out."""
    start = time.monotonic()
    try:
        dist.init_process_group("tpu_dist", world_size=2, rank=0, timeout=timedelta(seconds=3))
    except (RuntimeError, dist.DistError) as error:
        assert time.monotonic() - start < 60, "the time-out was not honoured"
        assert "timed out" in str(error).lower() or "timeout" in str(error).lower(), error
        return
    raise AssertionError("init_process_group returned without its peer")


# --- DDP ----------------------------------------------------------------------------------------


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _batches(world: int, steps: int, per_rank: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(world * per_rank, 8, generator=g), torch.randn(world * per_rank, 4, generator=g))
            for _ in range(steps)]


def _batch_norm_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _train_beside_one_process(rank: int, world: int, model: torch.nn.Module, reference: torch.nn.Module,
                              steps: int, per_rank: int) -> None:
    """SGD on `model` (DDP) with this rank's part of every batch, and on `reference` with the
    whole batches, on this rank's tpu device."""
    device = torch.device("tpu", 0)  # host_per_rank layout: each rank's one device
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in _batches(world, steps, per_rank):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine].to(device)), y[mine].to(device)).backward()
        optimizer.step()
        reference_optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference(x.to(device)), y.to(device)).backward()
        reference_optimizer.step()


def sync_batch_norm_training(rank: int, world: int, modes: tuple[str, ...], steps: int = 5,
                             per_rank: int = 4) -> None:
    """`convert_sync_batchnorm` under DDP over tpu_dist, each rank on its part of every batch,
    equals one process training the plain model (BatchNorm1d) on the whole batches on `tpu`:
    weights, and the running statistics the synchronised norm keeps (its statistics ops are
    torchtpu's compositions, `torchtpu/ops/sync_batch_norm.py`)."""
    _init()
    for mode in modes:
        torchtpu.set_eager_mode(mode)
        synced = torch.nn.SyncBatchNorm.convert_sync_batchnorm(_batch_norm_model()).to("tpu:0")
        model = torch.nn.parallel.DistributedDataParallel(synced)
        reference = _batch_norm_model().to("tpu:0")
        _train_beside_one_process(rank, world, model, reference, steps, per_rank)
        got, expected = model.module.state_dict(), reference.state_dict()
        assert isinstance(model.module[1], torch.nn.SyncBatchNorm)
        for name, value in expected.items():
            torch.testing.assert_close(got[name].cpu(), value.cpu(), msg=lambda m: f"{mode}: {name}: {m}")
    dist.destroy_process_group()


def ddp_training(rank: int, world: int, modes: tuple[str, ...], steps: int = 10, per_rank: int = 4) -> None:
    """DDP over tpu_dist, each rank training on its part of every batch, equals one process
    training the same model on `tpu` on the whole batches (same lowerings and matmul precision,
    so what differs is only what DDP and the backend do), in each eager mode."""
    _init()
    for mode in modes:
        torchtpu.set_eager_mode(mode)
        model = torch.nn.parallel.DistributedDataParallel(_model().to("tpu:0"))
        reference = _model().to("tpu:0")
        _train_beside_one_process(rank, world, model, reference, steps, per_rank)
        initial = _model().state_dict()
        for (name, p), q in zip(model.module.named_parameters(), reference.parameters(), strict=True):
            assert not torch.equal(p.detach().cpu(), initial[name]), f"{mode}: {name} did not train"
            torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(),
                                       msg=lambda m: f"{mode}: {name} after {steps} steps: {m}")
    dist.destroy_process_group()
