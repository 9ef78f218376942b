"""The SparseCore API across processes, as on a TPU pod where every host runs one process.

Two spawned processes of two CPU devices each join one JAX runtime (gloo collectives between
them) and drive a 4-device engine: each preprocesses and feeds only its own share of every global
batch (the samples of its devices), looks up and trains a few steps (row-wise Adagrad on a stack
of two tables, SGD on a third). The parent checks each process's activations against the NumPy
combiner model, and the tables and slots both processes gather against a single-process run of
the same global batches on 4 devices and against the NumPy optimizer models. Bad per-process
batches must raise the single-process `ValueError`s before any collective; a bad batch on one
process must end the job with its error while the other waits in a collective. No torch here:
`sparsecore` must run without it.
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import pathlib
import re
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sparsecore import optimizers as opt
from sparsecore.api import SparseCoreEmbedding
from sparsecore.layout import StackGroup, stack_tables
from sparsecore.preprocess import RaggedIds, preprocess
from sparsecore.spec import FeatureSpec, TableSpec
from sparsecore.topology import Topology
from test_numerics import TOLERANCE, Setup, numpy_training, pooled_model, random_grads, random_ids, samples

PROCESSES = 2
DEVICES_PER_PROCESS = 2
DEVICES = PROCESSES * DEVICES_PER_PROCESS
STEPS = 3
SEED = 5
TIMEOUT = 120.0
"""Seconds the processes of a test get in all (they take ~8 s on 2 cores): then they are killed."""

ROW_WISE = opt.RowWiseAdagrad(learning_rate=0.2, epsilon=1e-6)
SGD = opt.SGD(learning_rate=0.3)
TABLES = [
    TableSpec("a", 50, 8, combiner="sum", optimizer=ROW_WISE),
    TableSpec("b", 300, 8, combiner="sum", optimizer=ROW_WISE),
    TableSpec("c", 80, 8, combiner="mean", optimizer=SGD),
]
FEATURES = [
    FeatureSpec("fa", TABLES[0], 32),
    FeatureSpec("fb", TABLES[1], 32),
    FeatureSpec("fc", TABLES[2], 32),
    FeatureSpec("sequence", TABLES[1], 16, max_sequence_length=4),
]
WEIGHTED = {"fc"}


def make_engine(topology: Topology) -> SparseCoreEmbedding:
    stacks = stack_tables(FEATURES, topology, [StackGroup(("a", "b"), name="ab")])
    return SparseCoreEmbedding(stacks, topology, entry_chunk=64, row_chunk=32)


def global_steps() -> list[tuple[dict[str, RaggedIds], dict[str, np.ndarray]]]:
    """Every step's global batch and activation gradients, the same in every process."""
    rng = np.random.default_rng(SEED)
    return [
        ({f.name: random_ids(rng, f, f.name in WEIGHTED, 6) for f in FEATURES}, random_grads(rng, FEATURES))
        for _ in range(STEPS)
    ]


def host_share(ids: RaggedIds, rank: int) -> RaggedIds:
    """Process `rank`'s samples of a global batch: the contiguous block its devices' SparseCores
    hold (the mesh orders devices by process)."""
    per_process = len(ids.lengths) // PROCESSES
    lo, hi = rank * per_process, (rank + 1) * per_process
    offsets = np.concatenate([[0], np.cumsum(ids.lengths)])
    values = slice(offsets[lo], offsets[hi])
    weights = None if ids.weights is None else ids.weights[values]
    return RaggedIds(ids.values[values], lengths=ids.lengths[lo:hi], weights=weights)


def local_rows(array: jax.Array) -> np.ndarray:
    """This process's rows of a global array sharded over its first axis, in order."""
    shards = sorted(array.addressable_shards, key=lambda shard: shard.index[0].start)
    return np.concatenate([np.asarray(shard.data) for shard in shards])


# ----------------------------------------------------------------------------- the processes


def train_share(rank: int) -> dict[str, np.ndarray]:
    """In process `rank`: the bad batches, then a lookup of the first batch and STEPS updates,
    feeding this process's share of every batch and gradient. Returns the initial tables, this
    process's activation rows and the final tables and slots (gathered from all processes)."""
    topology = Topology.cpu(DEVICES, 2, local_device_count=DEVICES_PER_PROCESS)
    engine = make_engine(topology)
    stacks = tuple(engine.stacks.values())
    steps = global_steps()
    share = {name: host_share(ids, rank) for name, ids in steps[0][0].items()}
    check_bad_batches(engine, share, steps[0][0])

    tables, slots = engine.init(jax.random.key(SEED))
    results = {f"initial/{name}": value for name, value in engine.unstack_tables(tables).items()}
    activations = engine.lookup(tables, engine.put_batch(preprocess(stacks, share, topology)))
    results.update({f"activation/{name}": local_rows(value) for name, value in activations.items()})
    sharding = NamedSharding(engine.mesh, P(engine.axis))
    for inputs, grads in steps:
        own = {name: host_share(ids, rank) for name, ids in inputs.items()}
        batch = engine.put_batch(preprocess(stacks, own, topology))
        per_process = {name: np.split(grad, PROCESSES)[rank] for name, grad in grads.items()}
        local_grads = {
            name: jax.make_array_from_process_local_data(sharding, grad, grads[name].shape)
            for name, grad in per_process.items()
        }
        tables, slots = engine.update(tables, slots, batch, local_grads)
    results.update({f"table/{name}": value for name, value in engine.unstack_tables(tables).items()})
    for table, values in engine.unstack_slots(slots).items():
        results.update({f"slot/{table}/{slot}": value for slot, value in values.items()})
    results["step"] = np.asarray(slots["ab"]["step"].addressable_data(0))
    return results


def check_bad_batches(engine: SparseCoreEmbedding, share: dict[str, RaggedIds], whole: dict[str, RaggedIds]) -> None:
    """Each process's own bad batch raises what a single process raises, before any collective:
    an id out of range, buffers packed for all devices on one host, a corrupted row pointer."""
    stacks = tuple(engine.stacks.values())
    bad = dict(share, fa=dataclasses.replace(share["fa"], values=share["fa"].values.copy()))
    bad["fa"].values[-1] = 50
    with pytest.raises(ValueError, match=r"feature 'fa': id 50 .* outside the vocabulary \[0, 50\) of table 'a'"):
        preprocess(stacks, bad, engine.topology)
    whole_host = preprocess(stacks, whole, Topology.cpu(DEVICES, 2))
    expected = r"stack 'ab': row_pointers has shape \(4, 16\), the compiled kernels expect \(2, 16\)"
    with pytest.raises(ValueError, match=expected):
        engine.put_batch(whole_host)
    packed = preprocess(stacks, share, engine.topology)
    row_pointers = packed["c"].row_pointers.copy()
    row_pointers[1, 0] = engine.geometries["c"].segment_size + 8
    corrupted = dict(packed, c=dataclasses.replace(packed["c"], row_pointers=row_pointers))
    with pytest.raises(ValueError, match=r"stack 'c': local device 1, SparseCore 0, partition 0: row pointers give"):
        engine.put_batch(corrupted)


def feed_one_bad_batch(rank: int) -> dict[str, np.ndarray]:
    """In process `rank`: process 1 feeds buffers packed for all 4 devices, process 0 its own
    share, then both look up (process 0 then waits for process 1 in the lookup's collectives)."""
    topology = Topology.cpu(DEVICES, 2, local_device_count=DEVICES_PER_PROCESS)
    engine = make_engine(topology)
    stacks = tuple(engine.stacks.values())
    inputs = global_steps()[0][0]
    if rank == 1:
        packed = preprocess(stacks, inputs, Topology.cpu(DEVICES, 2))
    else:
        packed = preprocess(stacks, {name: host_share(ids, rank) for name, ids in inputs.items()}, topology)
    tables, _ = engine.init(jax.random.key(SEED))
    return {name: local_rows(value) for name, value in engine.lookup(tables, packed).items()}


def _process_entry(fn: Callable[[int], dict[str, np.ndarray]], rank: int, port: int, out: str) -> None:
    """A spawned process: join the 2-process JAX runtime, run `fn(rank)` and save its arrays to
    `out/<rank>.npz`, or its traceback to `out/<rank>.error`."""
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=PROCESSES,
            process_id=rank,
            initialization_timeout=int(TIMEOUT),
        )
        assert (jax.process_count(), jax.local_device_count()) == (PROCESSES, DEVICES_PER_PROCESS)
        results = fn(rank)
        jax.distributed.shutdown()
        np.savez(os.path.join(out, f"{rank}.npz"), **results)
    except BaseException:
        with open(os.path.join(out, f"{rank}.error"), "w") as error:
            error.write(traceback.format_exc())
        # Exit at once: a normal exit shuts the JAX runtime down, which waits for the other
        # process, and that one may be waiting for this one in a collective.
        os._exit(1)


def run_processes(fn: Callable[[int], dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """`fn(rank)` in each of PROCESSES spawned processes of DEVICES_PER_PROCESS devices; their
    results by rank. A process that fails fails the test with its traceback at once (the others
    are killed: they may wait for it in a collective); all are killed at TIMEOUT."""
    out = tempfile.mkdtemp(prefix="sparsecore-multiprocess-")
    context = multiprocessing.get_context("spawn")
    # A spawned process starts with this environment, so its XLA_FLAGS hold before it imports jax.
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+\s*", "", os.environ.get("XLA_FLAGS", ""))
    environment = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS} {flags}".strip()}
    port = free_port()
    with mock.patch.dict(os.environ, environment):
        processes = [
            context.Process(target=_process_entry, args=(fn, rank, port, out), name=f"sparsecore-{rank}")
            for rank in range(PROCESSES)
        ]
        for process in processes:
            process.start()
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            failed = [rank for rank, p in enumerate(processes) if p.exitcode not in (None, 0)]
            if failed:
                # A process that raised, rather than one JAX aborted when the other died.
                errors = [pathlib.Path(out, f"{rank}.error") for rank in failed]
                rank, error = next(((r, e) for r, e in zip(failed, errors) if e.exists()), (failed[0], None))
                reason = error.read_text() if error else "no traceback (killed?)"
                raise AssertionError(f"process {rank} exited with {processes[rank].exitcode}:\n{reason}")
            if all(p.exitcode == 0 for p in processes):
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"{PROCESSES} processes did not finish within {TIMEOUT} s")
            processes[0].join(0.2)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(5)
    return [dict(np.load(os.path.join(out, f"{rank}.npz"))) for rank in range(PROCESSES)]


def free_port() -> int:
    """A TCP port free on this host now, for the coordinator (`stand_in.free_port` imports torch)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- the test


def single_process_run() -> tuple[Setup, dict[str, np.ndarray], dict[str, dict[str, np.ndarray]]]:
    """The same global batches and gradients on 4 devices of this process: its setup, final
    tables and slots."""
    topology = Topology.cpu(DEVICES, 2)
    setup = Setup(make_engine(topology), FEATURES, topology)
    engine = setup.engine
    tables, slots = engine.init(jax.random.key(SEED))
    for inputs, grads in global_steps():
        batch = engine.put_batch(setup.packed(inputs))
        tables, slots = engine.update(tables, slots, batch, {k: jnp.asarray(v) for k, v in grads.items()})
    return setup, engine.unstack_tables(tables), engine.unstack_slots(slots)


def assert_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    np.testing.assert_allclose(got, want, rtol=TOLERANCE, atol=TOLERANCE, err_msg=what)


@pytest.mark.slow
def test_each_process_feeds_its_share_and_trains_like_one_process():
    results = run_processes(train_share)
    history = global_steps()
    inputs = history[0][0]
    initial = {t.name: results[0][f"initial/{t.name}"] for t in TABLES}

    for rank, result in enumerate(results):
        for feature in FEATURES:
            values, ids = initial[feature.table.name], inputs[feature.name]
            if feature.is_sequence:
                want = np.zeros(feature.output_shape, np.float32)
                for b, (rows, _) in enumerate(samples(ids)):
                    want[b, : len(rows)] = values[rows]
            else:
                want = pooled_model(values, ids, feature.table.combiner.value)
            np.testing.assert_allclose(
                result[f"activation/{feature.name}"], np.split(want, PROCESSES)[rank], rtol=1e-5, atol=1e-6,
                err_msg=f"process {rank}, feature {feature.name}",
            )
        assert float(result["step"]) == STEPS

    setup, tables, slots = single_process_run()
    assert sorted(slots) == ["a", "b"] and all("accumulator" in s for s in slots.values())
    for spec, names in ((ROW_WISE, ("a", "b")), (SGD, ("c",))):
        features = [f for f in FEATURES if f.table.name in names]
        model_tables, model_slots = numpy_training(
            spec, dataclasses.replace(setup, features=features), {n: initial[n] for n in names}, history
        )
        for name in names:
            assert np.abs(tables[name] - initial[name]).max() > 0, f"table {name} did not train"
            for rank, result in enumerate(results):
                np.testing.assert_array_equal(result[f"initial/{name}"], initial[name])
                assert_close(result[f"table/{name}"], tables[name], f"process {rank}, table {name}")
                assert_close(result[f"table/{name}"], model_tables[name], f"process {rank}, table {name} (model)")
                for slot, want in slots.get(name, {}).items():
                    got = result[f"slot/{name}/{slot}"]
                    assert_close(got, want, f"process {rank}, table {name}, slot {slot}")
                    assert_close(got, model_slots[name][slot], f"process {rank}, table {name}, slot {slot} (model)")


@pytest.mark.slow
def test_a_bad_batch_on_one_process_fails_the_job_with_its_error():
    """The process that fed the bad batch raises `put_batch`'s error; the other, left waiting in
    a collective, does not keep the job (here: the test) from ending with that error."""
    start = time.monotonic()
    expected = r"process 1 exited with 1:[\s\S]*ValueError: stack 'ab': row_pointers has shape \(4, 16\)"
    with pytest.raises(AssertionError, match=expected):
        run_processes(feed_one_bad_batch)
    assert time.monotonic() - start < TIMEOUT / 2
