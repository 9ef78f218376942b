"""The eager modes' fast path: repeated op calls done from a C++ kernel (`csrc/fast_dispatch.cpp`).

A strict eager call whose layout an earlier call already compiled spends most of its ~16 us in
Python -- PyTorch's dispatch into the Python kernel, reading the arguments, making the output
tensor -- around a ~4 us call of the jitted executable; a deferred call likewise around its
recording. For every op with a lowering whose arguments the C++ kernel can read (tensors, tensor
lists, numbers, int and Scalar lists, None) and that returns new tensors (or one list of them,
`_foreach_sqrt`) or updates `self` in place (`add_`, `fill_`, `_foreach_add_`), that kernel is
registered for PrivateUse1 and the Python kernel moves to PrivateUse2. The C++ kernel keys each
call by its layout (which storages were ever written included), per eager mode, and its static
values; the numbers that the encoder passes to the program at run time (Scalars, Scalar lists,
Python numbers and 0-dim CPU tensors passed as tensors, `x * 3`: `_argument_codes`) by their types
only. The first call of a key goes to the Python kernel, which encodes and runs (or records) it as
always and notes what it did (`note`); `learn` then tells the C++ kernel whether the call was
*plain* -- one Program of exactly the call's storages, no device-side checks, only new tensors out
(or, for an in-place op, only `self`'s storages written and `self` returned, or nothing for a
list), not random, no runtime values but those numbers -- and if so, later calls with that key are
done from C++, with their own numbers: in strict mode it runs the cached executable on the written
storages' arrays (an in-place call donates `self`'s arrays, and the results become their buffers'
values, as in `eager.finish`), in defer mode it records the call's plan (`deferred.record_known`,
which makes `self`'s buffers promises). Numbers unlike the first call's are checked as the Python
kernel checks them: a call whose values are of a class that PyTorch's checks never passed for the
key (`_fits`; `pow(int_tensor, -1)` after `pow(int_tensor, 2)`) takes the Python kernel, which runs
the checks. So a learning rate, a gradient scale or Adam's bias corrections that change every step
still run from C++. Everything else (the debug mode, views with offsets, sharded or untyped
buffers, errors) takes the Python kernel, which stays the one definition of what an op does.

The view kernels are C++ too where this is installed: a view only changes metadata, which
PyTorch's CPU kernel does for a tpu tensor as well (`install_view`). Compiled graphs' calls take
the same road (`graph_call`): keyed by their arguments' layout, a plain call's executable runs
(strict) or its plan is recorded (defer) from C++ and its outputs are assembled there.

So are the factories `empty.memory_format` and `empty_strided` (and with them `empty_like` and
`new_empty`; `install_factories`): a plain call's tensor, over a new device buffer that holds no
memory until written, is made in C++ in every eager mode (~7 us a call against ~22 through the
Python kernel); any other call -- another memory format, a dtype torchtpu does not support, a
device the Python kernel has not checked yet -- takes their Python kernels (`memory.empty_*`) on
PrivateUse2, which check it.

Without a C++ compiler, or with `TORCHTPU_FAST_DISPATCH=0`, the Python kernels stay on
PrivateUse1: the same results, slower. `torchtpu.metrics()["eager_fast_calls"]` counts the
calls the C++ kernel ran, `["compiled_fast_calls"]` the compiled graphs' calls,
`["factory_fast_calls"]` the tensors the factories made in C++.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import os
import threading
import warnings
from typing import Any

import torch
from torch._ops import OpOverload

from torchtpu import counters, out_of_memory, precision, storage
from torchtpu import random as tpu_random
from torchtpu.exec import modes, opcall
from torchtpu.ops.schema import ArgKind, signature

_library: ctypes.PyDLL | None = None
_tried = False
_SERVED = {"strict": 0, "defer": 1}  # the modes the C++ kernel serves, by its code for them
_KEYED_NUMBERS = (bool, int, float)  # the runtime values the C++ key holds


class _Noted(threading.local):
    """The last call each thread's Python kernels ran: (op, plan, its runtime values, or None
    for a random op, whose values are fresh every call)."""

    call: tuple | None = None


_noted = _Noted()


def enabled() -> bool:
    """Whether the fast path is installed (built and loaded, and not switched off)."""
    global _library, _tried
    if not _tried:
        _tried = True
        if os.environ.get("TORCHTPU_FAST_DISPATCH", "1") not in ("", "0"):
            _library = _load()
    return _library is not None


def _load() -> ctypes.PyDLL | None:
    from torchtpu import native
    from torchtpu.exec import deferred

    try:
        library = native.load("fast_dispatch")
    except (OSError, RuntimeError) as error:
        warnings.warn(
            f"torchtpu could not build its fast dispatch path ({error}); strict eager ops take the "
            "Python path (the same results, ~3x the dispatch cost). Install a C++ compiler (g++) to "
            "lift this.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    library.torchtpu_fast_init.argtypes = [ctypes.py_object] * 6 + [ctypes.c_longlong]
    library.torchtpu_fast_install.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.py_object, ctypes.py_object,
                                              ctypes.c_int]
    library.torchtpu_view_install.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    library.torchtpu_empty_install.argtypes = [ctypes.py_object]
    library.torchtpu_factory_calls.restype = ctypes.c_longlong
    counters.add_source(lambda: {"factory_fast_calls": library.torchtpu_factory_calls()},
                        library.torchtpu_factory_reset_calls)
    library.torchtpu_fast_calls.restype = ctypes.c_longlong
    library.torchtpu_fast_set_precision.argtypes = [ctypes.c_longlong]
    library.torchtpu_fast_set_mode.argtypes = [ctypes.c_int]
    library.torchtpu_fast_init(storage.DeviceBuffer, storage.reserve_addresses, _learn, deferred.record_known,
                               _fits, out_of_memory.as_torch, storage.ADDRESS_CHUNK)
    modes.on_change.append(lambda mode: library.torchtpu_fast_set_mode(_SERVED.get(mode, -1)))
    library.torchtpu_fast_set_mode(_SERVED.get(modes.current(), -1))
    precision.on_change.append(lambda mode: library.torchtpu_fast_set_precision(precision.MODES.index(mode)))
    library.torchtpu_fast_set_precision(precision.MODES.index(precision.get_mode()))
    counters.add_source(lambda: {"eager_fast_calls": library.torchtpu_fast_calls()},
                        library.torchtpu_fast_reset_calls)
    library.torchtpu_graph_cache_new.restype = ctypes.py_object
    library.torchtpu_graph_call.argtypes = [ctypes.py_object, ctypes.py_object]
    library.torchtpu_graph_call.restype = ctypes.py_object
    library.torchtpu_graph_learn.argtypes = [ctypes.py_object] * 3
    library.torchtpu_graph_fast_calls.restype = ctypes.c_longlong
    counters.add_source(lambda: {"compiled_fast_calls": library.torchtpu_graph_fast_calls()},
                        library.torchtpu_graph_reset_calls)
    # The kernels' caches own Python objects: release them while the interpreter still runs (the
    # library's static destructors run after it has finalized, without a thread state).
    atexit.register(library.torchtpu_fast_clear)
    return library


def readable(op: OpOverload) -> bool:
    """Whether the C++ kernel can key `op`'s calls: arguments it reads, and either only new
    tensors out (a list of them too) or an in-place update of `self` (`add_`, `fill_`,
    `_foreach_add_`)."""
    schema = op._schema
    if not all(_readable_type(a.type) for a in schema.arguments):
        return False
    if schema.is_mutable:
        return updates_self(op)
    if returns_list(op):
        return schema.returns[0].alias_info is None
    return bool(schema.returns) and all(
        isinstance(r.type, torch.TensorType) and r.alias_info is None for r in schema.returns
    )


def returns_list(op: OpOverload) -> bool:
    """`op` returns one list of tensors (`_foreach_sqrt`)."""
    returns = op._schema.returns
    return len(returns) == 1 and isinstance(returns[0].type, torch.ListType)


def updates_self(op: OpOverload) -> bool:
    """`op` writes its first argument, named `self`, and nothing else: a tensor that it returns,
    or a tensor list (the `_foreach_*_` ops, which return nothing)."""
    schema = op._schema
    first = schema.arguments[0] if schema.arguments else None
    if first is None or first.name != "self" or first.alias_info is None or not first.alias_info.is_write:
        return False
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments[1:]):
        return False
    if isinstance(first.type, torch.ListType):
        return isinstance(first.type.getElementType(), torch.TensorType) and not schema.returns
    if not isinstance(first.type, torch.TensorType) or len(schema.returns) != 1:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and alias.is_write and set(alias.before_set) == set(first.alias_info.before_set)


def _readable_type(t: Any) -> bool:
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    if isinstance(t, torch.ListType):  # int, Scalar and float lists, tensor lists (not of optional tensors)
        return isinstance(t.getElementType(), (torch.IntType, torch.TensorType, torch.NumberType, torch.FloatType))
    return isinstance(t, (torch.TensorType, torch.IntType, torch.FloatType, torch.BoolType, torch.NumberType))


def install(op: OpOverload, dynamic_scalars: bool) -> None:
    """Put the C++ kernel on PrivateUse1 for `op` (its Python kernel goes to PrivateUse2);
    `dynamic_scalars`: its lowering takes Scalars as runtime values."""
    namespace, name = op.name().split("::")
    codes = _argument_codes(op, dynamic_scalars)
    if _library.torchtpu_fast_install(namespace.encode(), name.encode(), op, codes, int(returns_list(op))) != 0:
        raise RuntimeError(f"installing the fast dispatch kernel of {op} failed")


def _argument_codes(op: OpOverload, dynamic_scalars: bool) -> tuple:
    """How the C++ key reads each argument of `op`, by the encoder's rule for runtime values
    (`opcall.Encoder`): (1, default) a Scalar its program takes at run time, unless it equals its
    default of the same type (None: none); (2, None) a list of such Scalars; (0, None) anything
    else, keyed by its value (Scalars too where the lowering keeps them static). Wrapped numbers
    (`x * 3`) and 0-dim CPU tensors are always runtime values. Should the two ever disagree on a
    call, the runtime values the Python kernel passed differ from the C++ kernel's and it keeps
    that key on the Python kernel."""
    codes = []
    for arg in signature(op).args:
        if dynamic_scalars and arg.kind is ArgKind.SCALAR:
            default = arg.default if arg.has_default and type(arg.default) in _KEYED_NUMBERS else None
            codes.append((1, default))
        elif dynamic_scalars and arg.kind is ArgKind.SCALAR_LIST:
            codes.append((2, None))
        else:
            codes.append((0, None))
    return tuple(codes)


def _fits(classes: set | None, values: tuple) -> bool:
    """Whether PyTorch's checks already passed runtime values of the class of `values` for a
    plan (its `value_classes`): the C++ kernel may then run the call with them."""
    return classes is not None and opcall.values_class(list(values)) in classes


def install_view(op: OpOverload) -> None:
    """Put the C++ view kernel (PyTorch's CPU kernel makes the view) on PrivateUse1 for `op`."""
    namespace, name = op.name().split("::")
    if _library.torchtpu_view_install(namespace.encode(), name.encode()) != 0:
        raise RuntimeError(f"installing the C++ view kernel of {op} failed")


def install_factories() -> None:
    """Put the C++ kernels of `empty.memory_format` and `empty_strided` on PrivateUse1 (their
    Python kernels go to PrivateUse2, which serves the calls they hand on)."""
    from torchtpu import dtypes

    if _library.torchtpu_empty_install(frozenset(dtypes.SUPPORTED)) != 0:
        raise RuntimeError("installing the C++ factory kernels failed")


def note(op: OpOverload, call) -> None:
    """Called by a Python kernel of an installed op after it ran `call`, for `_learn`."""
    _noted.call = (op, call.plan, None if call.lowering.random else tuple(call.dynamic))


def _learn(op: OpOverload, mode_code: int) -> tuple | None:
    """What the C++ kernel may do for the key of `op`'s call that the Python kernel just did, in
    the mode the kernel served it in (`mode_code`, of `_SERVED`): (jitted executable in strict
    mode or the call's plan in defer mode, its runtime values, device, new outputs, the number
    of `self`'s storages it updates in place, the plan's value classes), or None when that call
    was not plain (or the mode changed meanwhile). The runtime values must be numbers the C++
    kernel reads: Scalar arguments, Python numbers and 0-dim CPU tensors passed as tensors (not
    view offsets, which it does not read)."""
    noted, _noted.call = _noted.call, None
    mode = modes.current()
    if noted is None or noted[0] is not op or noted[1] is None or noted[2] is None:
        return None
    if _SERVED.get(mode) != mode_code:
        return None
    values = noted[2]
    if any(type(v) not in _KEYED_NUMBERS for v in values):
        return None
    plan = noted[1]
    if mode == "strict":
        exe = plan.executable
        if exe is None or exe.sharded:  # (its inputs are the storages ever written, in order)
            return None
        runner, program = exe.jitted, exe.program
    else:
        runner, program = plan, plan.program
        if program is None:
            return None
    if program.checks:
        return None
    if op._schema.is_mutable:  # an in-place update of `self`: its storages come first in the key
        written = len(program.written)
        if not written or program.written != tuple(range(written)) or program.new:
            return None
        if program.result != (("arg", 0) if op._schema.returns else ("none",)):
            return None
        return runner, values, plan.device, [], written, plan.value_classes
    n = len(program.new)
    news = tuple(("new", i) for i in range(n))
    if returns_list(op):
        result = ("list", news)
    elif n == len(op._schema.returns):
        result = ("new", 0) if n == 1 else ("tuple", news)
    else:
        return None
    if program.written or program.result != result:
        return None
    return runner, values, plan.device, _new_outputs(program), 0, plan.value_classes


def _new_outputs(program) -> list[tuple]:
    """The geometry of a Program's new tensors, as the C++ kernel reads it (`read_outputs`)."""
    return [(spec.dtype, spec.numel, tuple(spec.sizes), tuple(spec.strides), spec.numel * spec.dtype.itemsize)
            for spec in program.new]


# --- compiled graphs ---------------------------------------------------------------------------


def graph_cache() -> Any:
    """A C++ cache of one compiled graph's known calls (see `graph_call`); None without the fast
    path."""
    return _library.torchtpu_graph_cache_new() if enabled() else None


def graph_call(cache: Any, args: tuple) -> list | bytes | None:
    """A compiled graph's call done from C++ if its layout is known and plain: its result list.
    Otherwise bytes (the call's key, which `learn_graph` takes once the Python path ran the
    call) or None (nothing to learn: another eager mode, arguments C++ does not read, a key
    known not to be plain)."""
    return _library.torchtpu_graph_call(cache, args)


def learn_graph(cache: Any, key: bytes, call) -> None:
    """Tell the C++ cache what the Python path did for the graph call of `key` (a
    `compile.GraphCall`, in the mode `key` was made in): the executable (strict) or plan (defer)
    and how to assemble its result if the call was plain -- one executable not spread over
    devices, no runtime values but a random graph's RNG key (which each call draws, as the
    Python path does: `keys`), no device-side checks, a result of new tensors, arguments passed
    through and constants -- else that the key always takes the Python path."""
    _library.torchtpu_graph_learn(cache, key, _graph_info(call))


def _graph_info(call) -> tuple | None:
    plan, mode = call.plan, modes.current()
    random = call.graph.random
    if plan is None or len(call.dynamic) != int(random):  # its only runtime value: the RNG key
        return None
    if mode == "strict":
        exe = plan.executable
        if exe is None or exe.sharded:
            return None
        runner, program = exe.jitted, exe.program
    elif mode == "defer":
        runner, program = plan, plan.program
        if program is None:
            return None
    else:
        return None
    if program.checks or program.result[0] != "list":
        return None
    kinds = {"new": 0, "arg": 1, "const": 2}
    result = []
    for entry in program.result[1]:
        if entry[0] not in kinds:
            return None
        result.append((kinds[entry[0]], entry[1]))
    keys = functools.partial(tpu_random.next_key_words, plan.device) if random else None
    return runner, plan.device, _new_outputs(program), tuple(program.written), tuple(result), keys


def clear() -> None:
    """Forget every remembered key (with `eager.clear_cache`)."""
    if _library is not None:
        _library.torchtpu_fast_clear()
