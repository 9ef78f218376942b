"""DeferAndFuse: eager semantics, fused execution.

In `defer` mode an ATen call is recorded, not run. Its outputs are promises (`Pending`) whose
shape and dtype are known at once (PyTorch's meta kernel ran when the call was recorded, so a
shape or dtype error is raised at the line that caused it). A storage that an op mutates gets a
promise for its new contents; later ops read that promise, so program order -- and with it every
in-place and view semantic of strict mode -- is kept.

When a value is needed (a host read: `.item()`, `.cpu()`, `print`, `torch.save`, a tensor used as
a bool or an index, a data-dependent op; `torch.tpu.synchronize()`; a mode change; or the pending
graph reaching its size cap), everything pending is traced into ONE XLA computation: the ops'
own Programs (the same ones strict mode jits one by one) composed in order. Its outputs are the
promises still referenced by live storages; everything else is an intermediate XLA may fuse away.
Input buffers that no live storage holds any more are donated.

The fused computation is cached by the structure of the pending graph (each op's compile key,
how inputs and outputs are wired, which buffers are donated), so a steady training loop replays
the same executable every step. `TORCHTPU_LOG_RECOMPILES=1` prints, for each new compile, how the
graph differs from the nearest cached one.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import numpy as np

from torchtpu import counters, dtypes, out_of_memory, runtime, strided
from torchtpu.exec import checks, eager, opcall
from torchtpu.storage import DeviceBuffer, whole_tensor

MAX_PENDING_OPS = int(os.environ.get("TORCHTPU_DEFER_MAX_OPS", "1024"))
MIN_LOOP_OPS = 8


class Pending:
    """A promise: output `index` of node `node` of the pending graph."""

    __slots__ = ("graph", "node", "index", "shape", "dtype")

    def __init__(self, graph: "_Graph", node: int, index: int, shape, dtype) -> None:
        self.graph = graph
        self.node = node
        self.index = index
        self.shape = shape
        self.dtype = dtype


@dataclass
class _Node:
    program: opcall.Program
    wiring: tuple  # per program input: ("in", i) or ("node", n, k)
    dynamic: tuple[int, ...]  # indices of this node's dynamic values among the graph inputs


@dataclass
class _Graph:
    nodes: list[_Node] = field(default_factory=list)
    inputs: list[Any] = field(default_factory=list)  # concrete arrays and dynamic values
    input_ids: dict[int, int] = field(default_factory=dict)  # id(array) -> input index
    input_owner: dict[int, Any] = field(default_factory=dict)  # input index -> weakref(buffer)
    owners: list[Any] = field(default_factory=list)  # weakrefs of buffers holding promises
    devices: set = field(default_factory=set)
    # The graph's structure, built as nodes are recorded: (id of the node's Program -- Programs
    # live as long as the process -- its wiring, its dynamic inputs).
    structure: list[tuple] = field(default_factory=list)


class _State:
    """The one pending graph of the process. Not thread-local: PyTorch's autograd engine can run
    backward ops for a device on its own worker thread (in a thread that turned its multithreading
    back on, see `torchtpu.device`), and they belong to the same program order as the forward ops
    that produced their inputs."""

    def __init__(self) -> None:
        self.graph = _Graph()
        self.flushing = False
        self.lock = threading.RLock()
        self.last_key: tuple | None = None  # compile key of the op recorded last
        self.boundary: tuple | None = None  # ... and of the op recorded before this graph began


_state = _State()
# Per graph key: the fused program, and what it returns beside the promises.
_executables: dict[tuple, tuple[Callable[..., Any], _Extras]] = {}
_recent_keys: list[tuple] = []


def clear_cache() -> None:
    """Drop the fused programs (pending work stays pending and compiles again when it runs)."""
    _executables.clear()


def pending_ops() -> int:
    return len(_state.graph.nodes)


def _input(graph: _Graph, array, owner: DeviceBuffer | None) -> int:
    index = graph.input_ids.get(id(array))
    if index is None:
        index = len(graph.inputs)
        graph.inputs.append(array)
        graph.input_ids[id(array)] = index
        if owner is not None:
            graph.input_owner[index] = weakref.ref(owner)
    return index


def record(call: opcall.Call) -> Any:
    """Record one call; return its result with promises in place of values.

    A call on sharded tensors (spread over the mesh) is not fused with single-device work: the
    pending graph runs first, then the call runs on its own."""
    with _state.lock:
        if call.plan is None and any(spec.sharded for spec in call.storages):
            flush("sharded op")
            return eager.run(call)
        return _record(call)


def record_known(plan: opcall.Plan, values: tuple, *buffers: DeviceBuffer) -> list[DeviceBuffer]:
    """Record a plain call (only new tensors out) of a layout recorded before: what the C++ fast
    path does instead of the Python kernel (`fast_dispatch`). `values` are its runtime Scalar
    values, `buffers` its storages' buffers in the order its encoding lists them; returns the
    buffers of its new outputs, which the fast path makes into tensors."""
    call = _KnownCall(plan, values, buffers)
    with _state.lock:
        _, new, host = _append(call)
        _after_record(host)
    return new


class _KnownCall:
    """What `_append` reads of a call, for a call the fast path hands over."""

    __slots__ = ("key", "plan", "buffers", "dynamic", "device")

    def __init__(self, plan: opcall.Plan, values: tuple, buffers: tuple[DeviceBuffer, ...]) -> None:
        self.key = plan.key
        self.plan = plan
        self.buffers = buffers
        self.dynamic = values
        self.device = plan.device


def _record(call: opcall.Call) -> Any:
    program, new, host = _append(call)
    tensors = [whole_tensor(buffer, spec.sizes, spec.strides) for buffer, spec in zip(new, program.new)]
    result = opcall.assemble(program.result, call, tensors, host)
    _after_record(host)
    return result


def _after_record(host: list) -> None:
    """Run the pending graph once it reached its size cap (unless the call just ran it)."""
    if len(_state.graph.nodes) >= MAX_PENDING_OPS and not host:
        flush("size cap")


def _append(call) -> tuple[opcall.Program, list[DeviceBuffer], list]:
    """Append `call` to the pending graph: its Program, its new outputs' buffers (promises) and
    its host values (read at once: the graph runs first)."""
    pending = _state.graph.nodes
    if (
        len(pending) >= MIN_LOOP_OPS
        and call.key == pending[0].program.key
        and (_state.boundary is None or _state.last_key == _state.boundary)
    ):
        # The op that opened the pending graph comes again, after the op that preceded it
        # then: a loop iteration (a training step) is complete. Running it now keeps each fused
        # program one iteration long, so steady loops replay a cached executable instead of
        # compiling ever longer graphs. (Comparing the preceding op too keeps a layer that
        # repeats inside one step, such as a second LayerNorm, from cutting the step in two.)
        flush("loop")
    if not _state.graph.nodes:
        _state.boundary = _state.last_key
    _state.last_key = call.key
    graph = _state.graph
    plan = call.plan
    if plan is None:
        program = opcall.program_for(call)
        shapes = _output_avals(call, program)
    else:
        program = plan.program
        if program is None:
            program = plan.program = opcall.program_for(call)
            plan.avals = _output_avals(call, program)
        shapes = plan.avals
    buffers = call.buffers
    wiring = []
    for storage in program.inputs:
        buffer = buffers[storage]
        value = buffer.value
        if isinstance(value, Pending):
            if value.graph is not graph:
                raise RuntimeError("internal error: a promise from a flushed graph is still referenced")
            wiring.append(("node", value.node, value.index))
        else:
            wiring.append(("in", _input(graph, value, buffer)))
    dynamic = []
    for value in call.dynamic:
        dynamic.append(len(graph.inputs))
        graph.inputs.append(np.asarray(value) if not isinstance(value, np.ndarray) else value)
    node_index = len(graph.nodes)
    node = _Node(program, tuple(wiring), tuple(dynamic))
    graph.nodes.append(node)
    graph.structure.append((id(program), node.wiring, node.dynamic))
    graph.devices.add(call.device)
    counters.count("defer_ops_recorded")

    n_written = len(program.written)
    for i, storage in enumerate(program.written):
        buffer = buffers[storage]
        buffer.value = Pending(graph, node_index, i, *shapes[i])
        graph.owners.append(weakref.ref(buffer))
    new = []
    for j, spec in enumerate(program.new):
        promise = Pending(graph, node_index, n_written + j, *shapes[n_written + j])
        buffer = DeviceBuffer(spec.dtype, spec.numel, call.device, promise)
        graph.owners.append(weakref.ref(buffer))
        new.append(buffer)
    n_host = len(shapes) - n_written - len(program.new) - len(program.checks)
    host = []
    if n_host:
        flush("host value")
        host = [np.asarray(v).item() for v in _host_values(node_index)]
    return program, new, host


_host_results: dict[int, list] = {}


def _host_values(node_index: int) -> list:
    return _host_results.pop(node_index, [])


_avals: dict[tuple, list] = {}


def _output_avals(call: opcall.Call, program: opcall.Program) -> list:
    """(shape, dtype) of each program output, from the storages and tensors it writes."""
    avals = _avals.get(call.key)
    if avals is None:
        avals = []
        storages = call.key[3]
        for storage in program.written:
            spec = storages[storage]
            avals.append(((spec.numel,), dtypes.to_jax(spec.dtype)))
        for spec in program.new:
            avals.append(((spec.numel,), dtypes.to_jax(spec.dtype)))
        n_host = _count_host(program.result)
        avals.extend([((), None)] * n_host)
        avals.extend([((), np.dtype(np.bool_))] * len(program.checks))
        _avals[call.key] = avals
    return avals


def _count_host(template) -> int:
    if template[0] == "host":
        return 1
    if template[0] in ("tuple", "list"):
        return sum(_count_host(t) for t in template[1])
    return 0


def materialize(buffer: DeviceBuffer, reason: str) -> None:
    """Make `buffer.value` concrete (flushing the pending graph if it is a promise)."""
    if isinstance(buffer.value, Pending):
        flush(reason)


def flush(reason: str) -> None:
    """Compile (or reuse) and run everything pending as one XLA computation."""
    with _state.lock:
        graph = _state.graph
        if not graph.nodes or _state.flushing:
            return
        _state.flushing = True
        try:
            _state.graph = _Graph()
            _run(graph, reason)
        finally:
            _state.flushing = False


class _Extras(NamedTuple):
    """What a graph returns beside its promises, which its structure alone decides: host values
    (node, output) and device-side check flags (node, output), and the checks' messages."""

    host_outputs: tuple[tuple[int, int], ...]
    n_checks: int
    check_messages: tuple[str, ...]


def _extras_of(graph: _Graph) -> _Extras:
    host = []
    checks_out = []
    for i, node in enumerate(graph.nodes):
        program = node.program
        first = len(program.written) + len(program.new)
        n_host = _count_host(program.result)
        host.extend((i, first + k) for k in range(n_host))
        checks_out.extend((i, first + n_host + k) for k in range(len(program.checks)))
    messages = tuple(m for node in graph.nodes for m in node.program.checks)
    return _Extras(tuple(host + checks_out), len(checks_out), messages)


def _run(graph: _Graph, reason: str) -> None:
    counters.count("defer_flushes")
    counters.count_op("defer_flush_reasons", reason)
    live: list[tuple[DeviceBuffer, Pending]] = []
    seen: set[int] = set()
    for ref in graph.owners:
        buffer = ref()
        if buffer is None or id(buffer) in seen:
            continue
        value = buffer.value
        if isinstance(value, Pending) and value.graph is graph:
            seen.add(id(buffer))
            live.append((buffer, value))
    if len(graph.devices) > 1:
        raise RuntimeError(
            f"defer mode: one pending graph touches several devices {sorted(graph.devices)}; "
            "flush (torch.tpu.synchronize()) before moving work to another device"
        )
    outputs = tuple(dict.fromkeys((p.node, p.index) for _, p in live))
    donate = _donatable(graph, [p for _, p in live])
    device = next(iter(graph.devices))
    key = (tuple(graph.structure), outputs, donate, device, len(graph.inputs))
    cached = _executables.get(key)
    try:
        if cached is None:
            start = time.perf_counter()
            extras = _extras_of(graph)
            executable = _compile(graph, outputs + extras.host_outputs, donate, device)
            _executables[key] = executable, extras
            counters.count("defer_compiles")
            _log_recompile([node.program.key for node in graph.nodes])
            results = executable(*graph.inputs)
            counters.add_time("defer_compile", time.perf_counter() - start)
        else:
            counters.count("defer_cache_hits")
            executable, extras = cached
            results = executable(*graph.inputs)
    except RuntimeError as error:
        out_of_memory.reraise(error)
    position = {ref: k for k, ref in enumerate(outputs)}
    for buffer, promise in live:
        buffer.value = results[position[(promise.node, promise.index)]]
    n_host = len(extras.host_outputs) - extras.n_checks
    for k, (node_index, _) in enumerate(extras.host_outputs[:n_host]):
        _host_results.setdefault(node_index, []).append(results[len(outputs) + k])
    checks.add(results[len(outputs) + n_host:], extras.check_messages)


def _donatable(graph: _Graph, promises: list[Pending]) -> tuple[int, ...]:
    """Inputs whose buffers no live storage holds any more and that an output of the same shape
    and dtype can reuse (XLA can only donate into a matching output)."""
    wanted: dict[tuple, int] = {}
    for promise in promises:
        aval = (promise.shape, promise.dtype)
        wanted[aval] = wanted.get(aval, 0) + 1
    donate = []
    for index, owner in graph.input_owner.items():
        buffer = owner()
        array = graph.inputs[index]
        if buffer is not None and buffer.value is array:
            continue
        aval = (array.shape, array.dtype)
        if wanted.get(aval, 0) > 0:
            wanted[aval] -= 1
            donate.append(index)
    return tuple(donate)


def _compile(graph: _Graph, outputs: tuple, donate: tuple, device: int):
    import jax
    from jax.sharding import SingleDeviceSharding

    nodes = [(node.program.fn, node.wiring, node.dynamic) for node in graph.nodes]

    def fused(*inputs):
        env: dict[tuple[int, int], Any] = {}
        with strided.one_trace():
            for n, (fn, wiring, dynamic) in enumerate(nodes):
                args = [inputs[w[1]] if w[0] == "in" else env[(w[1], w[2])] for w in wiring]
                args += [inputs[d] for d in dynamic]
                for k, out in enumerate(fn(*args)):
                    env[(n, k)] = out
        return tuple(env[ref] for ref in outputs)

    return jax.jit(
        fused,
        donate_argnums=donate,
        out_shardings=SingleDeviceSharding(runtime.jax_device(device)),
    )


def _log_recompile(program_keys: list[tuple]) -> None:
    if eager.log_recompiles():
        print(f"[torchtpu] defer: compiling a new graph of {len(program_keys)} ops; "
              + describe_difference(program_keys, _recent_keys), file=sys.stderr)
    _recent_keys.append(program_keys)
    del _recent_keys[:-64]


def describe_difference(program_keys: list[tuple], previous: list[list[tuple]]) -> str:
    """How a graph (its ops' compile keys) differs from the most similar earlier one."""
    if not previous:
        return "first graph"

    def distance(other):
        length = abs(len(program_keys) - len(other))
        ops = sum(1 for a, b in zip(program_keys, other) if a[0] != b[0]) + length
        return ops, sum(1 for a, b in zip(program_keys, other) if a != b) + length

    nearest = min(previous, key=distance)
    for position, (a, b) in enumerate(zip(program_keys, nearest)):
        if a == b:
            continue
        if a[0] != b[0]:
            return f"op {position} is {a[0]} where the nearest cached graph has {b[0]}"
        return f"op {position} ({a[0]}): " + opcall.describe_key_difference(a, b)
    if len(nearest) != len(program_keys):
        return f"the nearest cached graph has {len(nearest)} ops instead of {len(program_keys)}"
    return "same ops; different outputs, donation or inputs"
