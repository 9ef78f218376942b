"""The strict (and debug) eager executor: each ATen call runs as its own cached XLA program.

Programs are keyed by `opcall.encode`'s key -- op, tensor geometries and dtypes, static
arguments, precision mode, device -- and jitted once per key. Execution is asynchronous (PJRT
dispatch returns at once; values materialise when the host reads them). In `debug` mode every
call blocks until its result is ready, so a runtime error surfaces at the line that caused it.

Buffers of the storages a call mutates are donated: an in-place op updates device memory without
a copy, as PyTorch's in-place ops do.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from torchtpu import counters, out_of_memory, runtime
from torchtpu.exec import checks, fast_dispatch, modes, opcall
from torchtpu.sharding import is_sharded, replicated
from torchtpu.storage import DeviceBuffer, whole_tensor


@dataclass
class Executable:
    program: opcall.Program
    jitted: Callable[..., Any]
    n_written: int
    n_new: int
    sharded: bool  # reads buffers spread over a mesh: XLA's SPMD partitioner places outputs
    all_inputs: bool  # every storage of the call is an input (none is uninitialised)


_cache: dict[tuple, Executable] = {}


def clear_cache() -> None:
    _cache.clear()
    opcall.clear_plans()
    fast_dispatch.clear()


def _compile(call: opcall.Call) -> Executable:
    import jax
    from jax.sharding import SingleDeviceSharding

    program = opcall.program_for(call)
    donate = tuple(pos for pos, storage in enumerate(program.inputs) if storage in program.written)
    sharded = any(spec.sharded for spec in call.storages)
    if sharded:
        jitted = jax.jit(program.fn, donate_argnums=donate)
    else:
        device = runtime.jax_device(call.device)
        jitted = jax.jit(program.fn, donate_argnums=donate, out_shardings=SingleDeviceSharding(device))
    counters.count("eager_programs")
    counters.count_op("eager_programs_by_op", str(call.key[0]))
    _note_compile(call.key)
    all_inputs = program.inputs == tuple(range(len(call.buffers)))
    exe = Executable(program, jitted, len(program.written), len(program.new), sharded, all_inputs)
    _cache[call.key] = exe
    return exe


_keys_by_op: dict[Any, list[tuple]] = {}


def log_recompiles() -> bool:
    return os.environ.get("TORCHTPU_LOG_RECOMPILES", "0") not in ("", "0")


def _note_compile(key: tuple) -> None:
    """With TORCHTPU_LOG_RECOMPILES=1, say why an op (or compiled graph) compiles again."""
    previous = _keys_by_op.setdefault(key[0], [])
    if previous and log_recompiles():
        print(f"[torchtpu] strict: recompiling {key[0]}: {opcall.describe_key_difference(key, previous[-1])}",
              file=sys.stderr)
    previous.append(key)
    del previous[:-8]


def run(call: opcall.Inputs) -> Any:
    """Run one encoded call now (strict/debug modes) and return its Python result."""
    plan = call.plan
    exe = plan.executable if plan is not None else None
    if exe is None:
        exe = _cache.get(call.key)
        compiled_now = exe is None
        if compiled_now:
            start = time.perf_counter()
            exe = _compile(call)
        if plan is not None:
            plan.executable = exe
    else:
        compiled_now = False
    if not compiled_now:
        counters.count("eager_cache_hits")
    buffers = call.buffers
    program = exe.program
    try:
        if exe.sharded:
            inputs = [buffers[i].value for i in program.inputs]
            inputs = [v if buffers[i].sharded else replicated(v) for i, v in zip(program.inputs, inputs)]
            outs = exe.jitted(*inputs, *call.dynamic)
        elif exe.all_inputs:
            outs = exe.jitted(*[buffer.value for buffer in buffers], *call.dynamic)
        else:
            outs = exe.jitted(*[buffers[i].value for i in program.inputs], *call.dynamic)
    except RuntimeError as error:
        out_of_memory.reraise(error)
    if compiled_now:
        counters.add_time("eager_compile", time.perf_counter() - start)
    if modes.current() == "debug":
        import jax

        jax.block_until_ready(outs)
    return finish(call, program, outs, exe.sharded)


def finish(call: opcall.Inputs, program: opcall.Program, outs, sharded: bool = False) -> Any:
    """Install a program's outputs: replace mutated buffers, wrap new tensors, read host values."""
    buffers = call.buffers
    written = program.written
    for i, storage in enumerate(written):
        buffers[storage].value = outs[i]
        if sharded:
            buffers[storage].sharded = is_sharded(outs[i])
    device = call.device
    new = []
    for position, spec in enumerate(program.new, len(written)):
        buffer = DeviceBuffer(spec.dtype, spec.numel, device, outs[position])
        if sharded:
            buffer.sharded = is_sharded(buffer.value)
        new.append(whole_tensor(buffer, spec.sizes, spec.strides))
    n_checks = len(program.checks)
    end = len(outs) - n_checks
    if n_checks:
        checks.add(outs[end:], program.checks)
        if modes.current() == "debug":
            checks.raise_pending()
    start = len(written) + len(program.new)
    host = [np.asarray(v).item() for v in outs[start:end]] if end > start else []
    result = program.result
    if result[0] == "new":
        return new[result[1]]
    return opcall.assemble(result, call, new, host)
