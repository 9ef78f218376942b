"""One ATen call on `tpu` tensors, split into a compile key and runtime inputs.

`encode` reads a call's arguments once: the device buffers it touches (each storage once, however
many tensors view it), the dynamic values (Scalars, 0-dim CPU tensors, the RNG key), and a
hashable key of everything that shapes the compiled program (op, geometry and dtype of each
tensor, static arguments, precision mode, device).

`build` turns a key into a `Program`: a pure function from the storages' flat buffers and the
dynamic values to new flat buffers -- it reads each tensor's region (`torchtpu.strided`), calls
the op's lowering from the registry, and writes results into fresh buffers (functional outputs)
or into the storages the op mutates (in-place and `out=` overloads). The strict executor jits
one Program per key; the deferred executor traces many Programs into one computation.
"""

from __future__ import annotations

import bisect
import itertools
import math
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch
from torch._ops import OpOverload

from torchtpu import dtypes, precision, random as tpu_random, runtime, strided
from torchtpu.ops import registry
from torchtpu.ops.decomps import resize_out
from torchtpu.ops.schema import ArgKind, Signature, functional_arguments, functional_variant, signature
from torchtpu.storage import BUFFER_ATTR, DeviceBuffer, buffer_of, contiguous_strides


class StorageSpec(NamedTuple):
    dtype: torch.dtype
    numel: int
    initialized: bool
    sharded: bool = False


class TensorRef(NamedTuple):
    """A `tpu` tensor argument: which storage it views and how."""

    storage: int
    dtype: torch.dtype
    sizes: tuple[int, ...]
    geometry: strided.Geometry | None  # None: contiguous over its whole storage, same dtype
    # PyTorch's lazy math bits (`x.conj()`, the imaginary part of one): the tensor's value is
    # its memory conjugated / negated. Only the ops PyTorch lets see them (copies, matmuls,
    # views) get such tensors; reads and writes resolve them.
    conj: bool = False
    neg: bool = False


class DynamicOffset(NamedTuple):
    """The storage offset of a view argument, passed as a runtime value (`dynamic[slot]`).

    A view that is one contiguous run of its storage (`strided.is_dense_run`: a row block of a
    matrix, a table in a flat buffer of tables, a `narrow`/`chunk`/`split` piece along the first
    dim) is keyed by its offset until a view of the same sizes and strides turns up at another
    offset; from then on such views take their offset at run time, so that one program serves
    every offset instead of one compiling per offset (per table when a flat buffer of tables is
    initialised table by table, per step of a sliding window). A view seen at one offset only
    keeps the static program, which runs a little faster. The Scalar checks skip these slots
    (`offset_slots`)."""

    slot: int


_MISSING = object()
# (sizes, strides) of dense-run views -> the one offset seen so far, or None once several were.
_offsets_seen: dict[tuple, object] = {}


def _dynamic_offset(dynamic: list, offset: int, sizes: tuple, strides: tuple, learn: bool = True):
    """For a view at a nonzero `offset`: a `DynamicOffset` slot holding it when views of its
    geometry take their offset at run time (see there), else `offset`. The one rule of both
    encodings of a call: `Inputs.tensor` (which learns the offsets it sees) and
    `Encoder._layout` (which only reads them)."""
    geometry = (sizes, strides)
    seen = _offsets_seen.get(geometry, _MISSING)
    if seen is not None:
        if not learn or seen == offset or not strided.is_dense_run(tuple(sizes), tuple(strides)):
            return offset
        if seen is _MISSING:
            _offsets_seen[geometry] = offset
            return offset
        _offsets_seen[geometry] = None
    dynamic.append(offset)
    return DynamicOffset(len(dynamic) - 1)


_offset_slots: dict[tuple, frozenset[int]] = {}


def offset_slots(key: tuple) -> frozenset[int]:
    """The runtime values of an op call key that are storage offsets (`DynamicOffset`)."""
    slots = _offset_slots.get(key)
    if slots is None:
        found = set()

        def visit(enc) -> None:
            if isinstance(enc, TensorRef):
                if enc.geometry is not None and type(enc.geometry.offset) is DynamicOffset:
                    found.add(enc.geometry.offset.slot)
            elif isinstance(enc, tuple):
                for e in enc:
                    visit(e)

        for enc in key[4]:
            visit(enc)
        slots = _offset_slots[key] = frozenset(found)
    return slots


def resolved(ref: "TensorRef", dynamic) -> "TensorRef":
    """`ref` with a runtime offset (`DynamicOffset`) replaced by its traced value."""
    geometry = ref.geometry
    if geometry is not None and type(geometry.offset) is DynamicOffset:
        return ref._replace(geometry=geometry._replace(offset=dynamic[geometry.offset.slot]))
    return ref


class HostRef(NamedTuple):
    """A 0-dim CPU tensor argument (or a wrapped Python number): passed as a runtime value."""

    slot: int
    dtype: torch.dtype
    wrapped: bool


_WRAPPED_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


class ScalarRef(NamedTuple):
    """A Scalar argument passed as a runtime value (its Python type shapes promotion)."""

    slot: int
    type: type


class HostScalarsRef(NamedTuple):
    """A 1-D CPU tensor of per-position Scalars (the `scalars` of `_foreach_addcdiv.Tensor`):
    CPU reads it to the host, so its values are Scalars of the call, one per list position."""

    scalars: tuple  # ScalarRef (dynamic) or number (static), one per element
    dtype: torch.dtype


class NoLowering(Exception):
    """The op (or its functional variant) has no lowering in the registry."""


def _mismatch(op: OpOverload, device: int, other: torch.device) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, "
        f"tpu:{device} and {other}! (in {op})"
    )


def _freeze(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, torch.SymInt):
        return int(value)
    return value


class Inputs:
    """Collects the device buffers (each storage once) and runtime values of some arguments.

    `tensor(t)` and `value(v)` return the hashable reference that stands for the argument in a
    compile key; the buffers and values themselves are what the compiled program is fed.
    """

    __slots__ = ("buffers", "storages", "dynamic", "device", "_seen", "_what")
    # Whether views at a nonzero offset take it as a runtime value (`DynamicOffset`): op calls
    # do; a compiled graph keys its inputs' offsets (its plans assume no runtime values).
    dynamic_offsets = False

    def __init__(self, what: object) -> None:
        self.buffers: list[DeviceBuffer] = []
        self.storages: list[StorageSpec] = []
        self.dynamic: list[Any] = []
        self.device: int | None = None
        self._seen: dict[int, int] = {}
        self._what = what

    def tensor(self, t: torch.Tensor | None):
        if t is None:
            return None
        if not isinstance(t, torch.Tensor):
            # A Python number standing for a tensor ("wrapped number", e.g. `x * 3`).
            self.dynamic.append(t)
            return HostRef(len(self.dynamic) - 1, _WRAPPED_DTYPES[type(t)], True)
        if t.device.type != "tpu":
            if t.dim() == 0 and t.device.type == "cpu":
                self.dynamic.append(t.item())
                return HostRef(len(self.dynamic) - 1, t.dtype, False)
            raise _mismatch(self._what, self.device if self.device is not None else 0, t.device)
        storage = t.untyped_storage()
        buffer = getattr(storage, BUFFER_ATTR, None)
        if buffer is None or buffer.untyped:
            buffer = buffer_of(t)
        if self.device is None:
            self.device = buffer.device
        elif buffer.device != self.device:
            raise _mismatch(self._what, self.device, t.device)
        index = self._seen.get(id(buffer))
        if index is None:
            index = self._seen[id(buffer)] = len(self.buffers)
            self.buffers.append(buffer)
            self.storages.append(StorageSpec(buffer.dtype, buffer.numel, buffer.value is not None, buffer.sharded))
        sizes = tuple(t.shape)
        dtype = t.dtype
        conj, neg = t.is_conj(), t.is_neg()
        if dtype == buffer.dtype and t.storage_offset() == 0 and t.is_contiguous() and (
            math.prod(sizes) == buffer.numel
        ):
            return TensorRef(index, dtype, sizes, None, conj, neg)
        strides = tuple(t.stride())
        offset = t.storage_offset()
        if offset and self.dynamic_offsets:
            offset = _dynamic_offset(self.dynamic, offset, sizes, strides)
        return TensorRef(index, dtype, sizes, strided.Geometry(sizes, strides, offset), conj, neg)

    def value(self, v) -> ScalarRef:
        self.dynamic.append(v)
        return ScalarRef(len(self.dynamic) - 1, type(v))


class Call(Inputs):
    """One ATen call's runtime side: the buffers and values to feed its Program."""

    __slots__ = ("op", "sig", "values", "key", "lowering", "plan", "generator")
    dynamic_offsets = True

    def __init__(self, op: OpOverload, sig: Signature, values: list, lowering) -> None:
        super().__init__(op)
        self.op = op
        self.sig = sig
        self.values = values
        self.lowering = lowering
        self.key: tuple = ()
        self.plan: Plan | None = None
        self.generator: torch.Generator | None = None  # a tpu generator the call draws from

    def build(self) -> "Program":
        return build(self)


def _device_arg(values: list) -> int | None:
    for v in values:
        if isinstance(v, torch.device) and v.type == "tpu":
            return v.index or 0
    return None


def encode(op: OpOverload, args: tuple, kwargs: dict, lowering: registry.Lowering) -> Call:
    """The call's compile key and runtime inputs. `out=` tensors of another shape than the result
    are resized first, and Scalar values are checked as PyTorch checks them (`_validate_values`)."""
    call = _encode(op, args, kwargs, lowering)
    if call.sig.is_out and _resize_outs(call):
        call = _encode(op, args, kwargs, lowering)
    if call.dynamic:
        _validate_values(call)
    if lowering.random:
        call.dynamic.append(tpu_random.next_key_words(call.device, call.generator))
    return call


class Plan:
    """What one argument layout of an op resolves to: its compile key and what the executors
    derive from that key once (the strict executable, the deferred executor's Program and output
    shapes), reused by every later call with the same layout."""

    __slots__ = ("key", "storages", "device", "offsets", "value_classes", "executable", "program", "avals")

    def __init__(self, call: Call) -> None:
        self.key = call.key
        self.offsets = offset_slots(call.key)
        self.storages = tuple(call.storages)
        self.device = call.device
        # Classes of Scalar values this key was checked with (shared with `_validate_values`).
        self.value_classes = _validated.setdefault(call.key, set()) if call.dynamic else None
        self.executable: Any = None
        self.program: Program | None = None
        self.avals: list | None = None


class GeneralEncoding(Exception):
    """The call needs the general encoding (`encode`): a CPU or meta tensor, a storage without
    its element type yet, a sharded storage, an argument of another kind than usual."""


class PlanTable(dict):
    """Layout -> Plan of one op or compiled graph; `clear_plans` empties every table."""


_plan_tables: list["weakref.ref[PlanTable]"] = []


def plan_table() -> PlanTable:
    table = PlanTable()
    _plan_tables[:] = [ref for ref in _plan_tables if ref() is not None]
    _plan_tables.append(weakref.ref(table))
    return table


_NUMBERS = (bool, int, float, complex)


class Encoder:
    """Encodes the calls of one op, remembering each argument layout's compile key.

    The compile key `encode` builds depends on a call's layout only: the precision mode; each
    tensor's storage (which earlier argument shares it), dtype, sizes, strides, offset and math
    bits; each storage's dtype, size, initialisation and device; which Scalars are runtime values
    (and their types); every static value. `encode` reads and checks every argument (devices,
    CPU scalars, index tensors, out= resizing); once it has accepted a layout, later calls with
    that layout are read with one pass over the arguments and go straight to the layout's `Plan`.
    The Scalar value checks (`_validate_values`) still run for every call."""

    def __init__(self, op: OpOverload, lowering: registry.Lowering) -> None:
        self.op = op
        self.lowering = lowering
        self.sig = signature(op)
        dynamic = lowering.dynamic_scalars
        self.args = tuple((arg.kind, dynamic, arg.has_default, arg.default) for arg in self.sig.args)
        # out= calls resize their outputs first (`_resize_outs`): they always take `encode`.
        self.remembers = not self.sig.is_out
        self.plans = plan_table()

    def encode(self, args: tuple, kwargs: dict) -> Call:
        layout = None
        if self.remembers:
            try:
                values = self.sig.normalize(args, kwargs)
                layout, buffers, dynamic = self._layout(values)
                plan = self.plans.get(layout)
            except (GeneralEncoding, TypeError, AttributeError):
                plan = layout = None
            if plan is not None:
                return self._planned(plan, values, buffers, dynamic)
        call = encode(self.op, args, kwargs, self.lowering)
        if layout is not None:
            self._remember(layout, buffers, dynamic, call)
        return call

    def _remember(self, layout: tuple, buffers: list, dynamic: list, call: Call) -> None:
        n_dynamic = len(call.dynamic) - int(self.lowering.random)
        if (
            len(buffers) == len(call.buffers)
            and all(a is b for a, b in zip(buffers, call.buffers))
            and len(dynamic) == n_dynamic
            and not any(spec.sharded for spec in call.storages)
        ):
            call.plan = self.plans[layout] = Plan(call)

    def _planned(self, plan: Plan, values: list, buffers: list, dynamic: list) -> Call:
        call = Call.__new__(Call)
        call.op = self.op
        call.sig = self.sig
        call.values = values
        call.lowering = self.lowering
        call.key = plan.key
        call.plan = plan
        call.buffers = buffers
        call.storages = plan.storages
        call.dynamic = dynamic
        call.device = plan.device
        call.generator = None
        if dynamic:
            kind = values_class(_scalars(dynamic, plan.offsets))
            if kind not in plan.value_classes:
                _run_meta(call)
                plan.value_classes.add(kind)
        if self.lowering.random:
            call.generator = next((v for v in values if _is_tpu_generator(v)), None)
            dynamic.append(tpu_random.next_key_words(plan.device, call.generator))
        return call

    def _layout(self, values: list) -> tuple[tuple, list, list]:
        buffers: list[DeviceBuffer] = []
        seen: dict[int, int] = {}
        dynamic: list = []
        parts = []
        for (kind, dynamic_scalars, has_default, default), v in zip(self.args, values):
            if v is None:
                parts.append(None)
            elif kind is _TENSOR:
                if type(v) in _NUMBERS:
                    parts.append(_runtime_scalar(v, dynamic))  # a wrapped number
                elif v.is_cpu and v.dim() == 0:
                    dynamic.append(v.item())  # a host scalar, as `Inputs.tensor` reads it
                    parts.append(("host", v.dtype))
                else:
                    parts.append(tensor_layout(v, buffers, seen, dynamic))
            elif kind is _STATIC:
                parts.append(None if _is_tpu_generator(v) else _freeze(v) if isinstance(v, (list, tuple)) else v)
            elif kind is _SCALAR:
                if not dynamic_scalars or _is_default(v, has_default, default):
                    parts.append((type(v), v))
                else:
                    parts.append(_runtime_scalar(v, dynamic))
            elif kind is _TENSOR_LIST:
                parts.append(tuple([None if t is None else tensor_layout(t, buffers, seen, dynamic) for t in v]))
            else:  # SCALAR_LIST
                parts.append(tuple([(type(x), x) if not dynamic_scalars or x is None else _runtime_scalar(x, dynamic)
                                    for x in v]))
        if not buffers:
            raise GeneralEncoding  # the device comes from a device argument or the current device
        return (precision.get_mode(), tuple(parts), storages_layout(buffers)), buffers, dynamic


def _runtime_scalar(v, dynamic: list) -> type:
    """A Scalar taken at run time: its value goes to `dynamic`, its type into the layout (as
    `Inputs.value` keys it). Only Python numbers: anything else takes the general encoding."""
    if type(v) not in _NUMBERS:
        raise GeneralEncoding
    dynamic.append(v)
    return type(v)


def _is_default(v, has_default: bool, default) -> bool:
    """Whether a Scalar is left at its default (`alpha=1`): it then stays static in both
    encodings, so that the lowering can skip it."""
    return has_default and v == default and type(v) is type(default)


def tensor_layout(t, buffers: list, seen: dict, dynamic: list | None = None) -> tuple:
    """A `tpu` tensor argument's part of a layout (and its storage's buffer, once per storage);
    with `dynamic`, a qualifying view's offset goes there (`DynamicOffset`), as `encode` does."""
    buffer = getattr(t.untyped_storage(), BUFFER_ATTR, None)
    if buffer is None or buffer.untyped or buffer.sharded:
        raise GeneralEncoding
    index = seen.get(id(buffer))
    if index is None:
        index = seen[id(buffer)] = len(buffers)
        buffers.append(buffer)
    strides = t.stride()
    offset = t.storage_offset()
    if offset and dynamic is not None:
        offset = _dynamic_offset(dynamic, offset, t.shape, strides, learn=False)
    return (index, t.dtype, t.shape, strides, offset, t.is_conj(), t.is_neg())


def storages_layout(buffers: list) -> tuple:
    """The storages' part of a layout: what their StorageSpecs say, and their devices."""
    return tuple([(b.dtype, b.numel, b.value is not None, b.device) for b in buffers])


_TENSOR, _TENSOR_LIST, _SCALAR, _STATIC = ArgKind.TENSOR, ArgKind.TENSOR_LIST, ArgKind.SCALAR, ArgKind.STATIC


def clear_plans() -> None:
    """Forget every remembered layout (their plans hold compiled executables)."""
    for ref in _plan_tables:
        table = ref()
        if table is not None:
            table.clear()


def _encode(op: OpOverload, args: tuple, kwargs: dict, lowering: registry.Lowering) -> Call:
    sig = signature(op)
    values = sig.normalize(args, kwargs)
    call = Call(op, sig, values, lowering)
    tensor = call.tensor
    dynamic_scalars = lowering.dynamic_scalars

    def scalar(v):
        if v is None or not dynamic_scalars or isinstance(v, torch.Tensor):
            return _freeze(v)
        return call.value(v)

    encoded = []
    for arg, v in zip(sig.args, values):
        kind = arg.kind
        if kind is ArgKind.TENSOR:
            if arg.name == "scalars" and _is_host_vector(v):
                encoded.append(HostScalarsRef(tuple(scalar(x) for x in v.tolist()), v.dtype))
            else:
                encoded.append(tensor(v))
        elif kind is ArgKind.TENSOR_LIST:
            if v is not None and arg.name == "indices":
                v = values[len(encoded)] = _indices_on_device(v, call.device)
            encoded.append(None if v is None else tuple(tensor(t) for t in v))
        elif kind is ArgKind.SCALAR:
            encoded.append(_freeze(v) if _is_default(v, arg.has_default, arg.default) else scalar(v))
        elif kind is ArgKind.SCALAR_LIST:
            encoded.append(None if v is None else tuple(scalar(s) for s in v))
        elif _is_tpu_generator(v):
            call.generator = v  # keyed as no generator: one program serves every generator
            encoded.append(None)
        else:
            encoded.append(_freeze(v))
    if call.device is None:
        call.device = _device_arg(values)
        if call.device is None:
            call.device = current_device()
    call.key = (op, precision.get_mode(), call.device, tuple(call.storages), tuple(encoded))
    return call


def _is_tpu_generator(v) -> bool:
    """Whether `v` is a `torch.Generator(device="tpu")`: its calls draw their random key from it
    (`random.next_key_words`) instead of the device's generator. Other generators stay in the key,
    where the random lowerings refuse them."""
    return isinstance(v, torch.Generator) and v.device.type == "tpu"


def _is_host_vector(v) -> bool:
    return isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.dim() == 1


def _run_meta(call: Call) -> tuple[list, Any]:
    """PyTorch's checks of the call: its meta kernel, then the lowering's checks of values that
    PyTorch makes in its CPU kernel only (`Lowering.validate`). Returns the meta arguments as
    the meta kernel left them (an `out=` tensor resized to the result's shape) and its output."""
    meta_args = meta_values(call.key, call.values)
    pos, kw = call.sig.split(meta_args)
    lowering = call.lowering
    meta_out = (lowering.meta if lowering.meta is not None and lowering.op is call.op else call.op)(*pos, **kw)
    validate = lowering.validate
    if validate is not None:
        fpos, fkw = signature(call.lowering.op).split(functional_arguments(call.op, meta_args))
        validate(*fpos, **fkw)
    return meta_args, meta_out


# --- out= resizing -----------------------------------------------------------------------------

_out_layouts: dict[tuple, tuple | None] = {}


def _written_tensors(sig: Signature, values: list) -> list:
    out = []
    for i in sig.written:
        out.extend(values[i] if isinstance(values[i], (list, tuple)) else (values[i],))
    return out


def _resize_outs(call: Call) -> bool:
    """Resize the call's `out=` tensors to the shape (and layout) PyTorch's meta kernel gives
    them, with PyTorch's warning for a non-empty one. True if any was resized."""
    if call.key in _out_layouts:
        layouts = _out_layouts[call.key]
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # resize_out below warns as PyTorch does
            resized = _written_tensors(call.sig, _run_meta(call)[0])
        outs = _written_tensors(call.sig, call.values)
        fits = all(tuple(m.shape) == tuple(o.shape) for m, o in zip(resized, outs))
        layouts = None if fits else tuple((tuple(m.shape), tuple(m.stride())) for m in resized)
        _out_layouts[call.key] = layouts
    if layouts is None:
        return False
    for out, (sizes, strides) in zip(_written_tensors(call.sig, call.values), layouts):
        resize_out(out, sizes, strides)
    return True


# --- Scalars whose values decide whether a call is valid --------------------------------------

# Edges between value classes: each integer dtype's range, the largest finite float16, bfloat16
# and float32, and 0, 1 and 2 (signs, probabilities, exponents).
_EDGES = sorted({
    edge
    for dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
    for edge in (torch.iinfo(dtype).min, torch.iinfo(dtype).max + 1)
} | {
    edge
    for dtype in (torch.float16, torch.bfloat16, torch.float32)
    for edge in (-torch.finfo(dtype).max, torch.finfo(dtype).max)
} | {0, 1, 2})
_MAX_ORDERED = 6


def _value_class(v) -> tuple:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return (type(v), v)
    if v != v:
        return (type(v), "nan")
    integral = isinstance(v, int) or v.is_integer()
    return (type(v), bisect.bisect_right(_EDGES, v), v in (0, 1), integral)


def _scalars(dynamic: list, offsets: frozenset[int]) -> list:
    """A call's runtime values without its storage offsets (`DynamicOffset`): what PyTorch's
    checks of Scalar values see."""
    return [v for slot, v in enumerate(dynamic) if slot not in offsets] if offsets else dynamic


def values_class(values: list) -> tuple:
    """What PyTorch's checks of Scalar values can tell apart: each value's type, sign, range
    (the integer and float dtypes' limits, 0, 1, 2), integrality, and the order between the
    values of a call with few of them (`uniform_(from, to)`, `hardtanh(min_val, max_val)`)."""
    classes = tuple(_value_class(v) for v in values)
    if 1 < len(values) <= _MAX_ORDERED and all(isinstance(v, (int, float)) for v in values):
        classes += tuple((a > b) - (a < b) for a, b in itertools.combinations(values, 2))
    return classes


_validated: dict[tuple, set] = {}


def _validate_values(call: Call) -> None:
    """Run PyTorch's checks again for Scalar values unlike any this call key has seen.

    A compiled program takes Scalars as runtime values, and its meta kernel ran once, with the
    first values: `pow(int_tensor, 2)` is valid, `pow(int_tensor, -1)` raises. Every call's
    values are classed (`values_class`, cheap), and each new class of a key runs the meta
    kernel once with the call's own values."""
    seen = _validated.setdefault(call.key, set())
    kind = values_class(_scalars(call.dynamic, offset_slots(call.key)))
    if kind not in seen:
        _run_meta(call)
        seen.add(kind)


def _indices_on_device(indices, device: int | None) -> list:
    """Advanced-indexing index tensors may live on the CPU (as with CUDA tensors): copy them to
    the indexed tensor's device."""
    from torchtpu.exec import memory

    if device is None:
        return list(indices)
    return [
        memory.from_host(t, device) if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t
        for t in indices
    ]


def current_device() -> int:
    from torchtpu import device as tpu_device

    return tpu_device.current_device()


# --- building Programs -------------------------------------------------------------------------


@dataclass(frozen=True)
class NewTensor:
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype
    numel: int  # storage elements


@dataclass
class Program:
    """A compiled-to-be function of one call's buffers and dynamic values.

    Inputs: the initialized storages' flat buffers (in call order), then the dynamic values.
    Outputs: new flat buffers for the `written` storages, then one per `new` tensor, then host
    values (`host`: outputs that are Python numbers, e.g. `item()`), then one flag per
    device-side check (`checks`, see `torchtpu.exec.checks`).
    """

    fn: Callable[..., Any]
    inputs: tuple[int, ...]  # storage indices passed as buffers
    written: tuple[int, ...]  # storage indices whose buffers the program replaces
    new: tuple[NewTensor, ...]
    result: Any  # template of the Python return value, see `assemble`
    key: tuple
    checks: tuple[str, ...] = ()  # messages of the device-side check flags it returns last


def _meta_tensor(ref: TensorRef) -> torch.Tensor:
    strides = ref.geometry.strides if ref.geometry is not None else contiguous_strides(ref.sizes)
    return torch.empty_strided(ref.sizes, strides, dtype=ref.dtype, device="meta")


def meta_values(call_key: tuple, values: list) -> list:
    """The call's arguments with tensors replaced by meta tensors (for shape/dtype inference)."""
    encoded = call_key[4]

    def conv(enc, v):
        if isinstance(enc, TensorRef):
            return _meta_tensor(enc)
        if isinstance(enc, HostRef):
            if enc.wrapped:
                return v.item() if isinstance(v, torch.Tensor) else v
            return torch.empty((), dtype=enc.dtype, device="meta")
        if isinstance(enc, HostScalarsRef):
            return v  # PyTorch's kernels, the meta one too, read it on the CPU
        if isinstance(enc, tuple) and isinstance(v, (list, tuple)):
            return type(v)(conv(e, x) for e, x in zip(enc, v))
        if isinstance(v, torch.device) and v.type == "tpu":
            return torch.device("meta")
        if _is_tpu_generator(v):
            return None  # the meta kernel draws nothing
        return v

    return [conv(e, v) for e, v in zip(encoded, values)]


def _is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: some permutation of a contiguous layout."""
    if t.numel() <= 1:
        return True
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def strides_like(meta: Any, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a new tensor of `sizes` laid out as PyTorch lays out the result `meta`:
    `meta`'s own where it is dense (a permutation of a contiguous layout) and of these sizes,
    the same order of dimensions at other sizes (a bucket's, which a program runs at), and
    contiguous where `meta` is no dense tensor of that rank with concrete strides."""
    if (
        not isinstance(meta, torch.Tensor)
        or meta.dim() != len(sizes)
        or not all(isinstance(s, int) for s in (*meta.stride(), *meta.shape))
        or not _is_dense(meta)
    ):
        return contiguous_strides(sizes)
    if tuple(meta.shape) == tuple(sizes):
        return tuple(meta.stride())
    # Outermost first: larger strides, and among equal ones (dimensions of size 1) the earlier.
    order = sorted(range(len(sizes)), key=lambda d: (-meta.stride()[d], d))
    strides = [0] * len(sizes)
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= max(sizes[d], 1)
    return tuple(strides)


def _new_tensor_spec(meta: torch.Tensor) -> NewTensor:
    sizes = tuple(meta.shape)
    dtypes.check_supported(meta.dtype)
    return NewTensor(sizes, strides_like(meta, sizes), meta.dtype, max(math.prod(sizes), 0))


def write_new(value, spec: NewTensor):
    """A fresh flat buffer holding `value` in `spec`'s layout."""
    import jax.numpy as jnp

    value = jnp.asarray(value).astype(dtypes.to_jax(spec.dtype))
    _check_shape(value, spec.sizes)
    if spec.strides == contiguous_strides(spec.sizes):
        return value.reshape(-1)
    return strided.write(jnp.zeros(spec.numel, value.dtype), strided.Geometry(spec.sizes, spec.strides, 0), value)


class LoweringError(RuntimeError):
    """A lowering returned a value whose shape disagrees with PyTorch's meta kernel (a bug)."""


def _check_shape(value, sizes) -> None:
    if tuple(value.shape) != tuple(sizes):
        raise LoweringError(
            f"lowering returned shape {tuple(value.shape)}, but PyTorch's meta kernel says {tuple(sizes)}"
        )


def _math_bits(value, ref: TensorRef):
    """`value` conjugated and negated as `ref`'s math bits say (each is its own inverse, so this
    maps memory to value and value to memory alike)."""
    import jax.numpy as jnp

    if ref.conj:
        value = jnp.conj(value)
    return -value if ref.neg else value


def read_tensor(flat, ref: TensorRef):
    if ref.geometry is None:
        return _math_bits(flat.reshape(ref.sizes), ref)
    flat = strided.reinterpret(flat, dtypes.to_jax(ref.dtype))
    return _math_bits(strided.read(flat, ref.geometry), ref)


def storage_values(storages: Sequence[StorageSpec], inputs: tuple[int, ...], flat_inputs: Sequence) -> list:
    """Every storage's flat value inside a program: the program's first arguments are those of
    the storages numbered in `inputs` (the initialised ones); any other storage reads as zeros
    (a never-written `torch.empty` has no buffer)."""
    import jax.numpy as jnp

    values: list[Any] = [None] * len(storages)
    for index, flat in zip(inputs, flat_inputs):
        values[index] = flat
    for index, spec in enumerate(storages):
        if values[index] is None:
            values[index] = jnp.zeros(spec.numel, dtypes.to_jax(spec.dtype))
    return values


def write_tensor(flat, ref: TensorRef, value):
    import jax.numpy as jnp

    value = jnp.asarray(value)
    _check_shape(value, ref.sizes)
    value = _math_bits(value.astype(dtypes.to_jax(ref.dtype)), ref)
    if ref.geometry is None:
        return value.astype(flat.dtype).reshape(-1)
    dtype = dtypes.to_jax(ref.dtype)
    view = strided.reinterpret(flat, dtype)
    out = strided.write(view, ref.geometry, value.astype(dtype))
    return strided.reinterpret(out, flat.dtype) if out.dtype != flat.dtype else out


_programs: dict[tuple, Program] = {}


def program_for(call: Call) -> Program:
    """The Program for `call.key`, built on first use and shared by every executor."""
    program = _programs.get(call.key)
    if program is None:
        program = _programs[call.key] = call.build()
    return program


def build(call: Call) -> Program:
    """Trace-ready Program for `call.key` (runs PyTorch's meta kernel for validation)."""
    op, sig, key = call.op, call.sig, call.key
    mode, device = key[1], key[2]
    storages: tuple[StorageSpec, ...] = key[3]
    encoded: tuple = key[4]
    meta_args, meta_out = _run_meta(call)  # raises PyTorch's own errors for bad shapes and dtypes

    functional = functional_variant(op)
    lowering = registry.get(functional) if functional is not None else None
    if lowering is None:
        raise NoLowering(str(op))
    registry.check_complex(functional, meta_args, meta_out)
    if functional is op:
        fn_meta_args, fn_meta_out = meta_args, meta_out
        fsig = sig
    else:
        fsig = signature(functional)
        fn_meta_args = functional_arguments(op, meta_args)
        fpos, fkw = fsig.split(fn_meta_args)
        fn_meta_out = functional(*fpos, **fkw)

    # Which tensors the op writes, in the order the functional outputs fill them.
    write_refs: list[TensorRef] = []
    for i in sig.written:
        enc = encoded[i]
        write_refs.extend((enc,) if isinstance(enc, TensorRef) else enc)
    written = tuple(dict.fromkeys(r.storage for r in write_refs))

    new: list[NewTensor] = []
    host: list[type] = []
    if sig.written:
        result = _written_result(sig, op)
    else:
        result = _result_template(meta_out, new, host)
    inputs = tuple(i for i, s in enumerate(storages) if s.initialized)
    n_dynamic = len(call.dynamic)
    encoded_f = functional_arguments(op, list(encoded))
    platform = runtime.runtime().platform
    random_op = lowering.random

    def program(*flat_inputs):
        import jax.numpy as jnp

        buffers = storage_values(storages, inputs, flat_inputs)
        dyn = flat_inputs[len(inputs):]

        def value(enc):
            if isinstance(enc, TensorRef):
                return read_tensor(buffers[enc.storage], resolved(enc, dyn))
            if isinstance(enc, HostRef):
                return jnp.asarray(dyn[enc.slot], dtypes.to_jax(enc.dtype))
            if isinstance(enc, ScalarRef):
                return dyn[enc.slot]
            if isinstance(enc, HostScalarsRef):
                return tuple(value(e) for e in enc.scalars)
            if isinstance(enc, tuple):
                return tuple(value(e) for e in enc)
            return enc

        args = [value(e) for e in encoded_f]
        rng = tpu_random.key_from_words(dyn[n_dynamic - 1]) if random_op else None
        ctx = registry.LoweringContext(functional, fn_meta_args, fn_meta_out, mode, platform, rng)
        fpos, fkw = fsig.split(args)
        out = lowering.fn(ctx, *fpos, **fkw)
        check_messages[:] = [message for _, message in ctx.checks]
        flags = tuple(flag for flag, _ in ctx.checks)

        if sig.written:
            flat_out = tuple(_flatten(out))  # a list output fills its tensors one by one
            for ref, val in zip(write_refs, flat_out):
                buffers[ref.storage] = write_tensor(buffers[ref.storage], resolved(ref, dyn), val)
            return tuple(buffers[i] for i in written) + flags
        outs = list(_flatten(out))
        new_flat = [write_new(v, spec) for v, spec in zip(outs[: len(new)], new)]
        return tuple(new_flat) + tuple(outs[len(new):]) + flags

    check_messages: list[str] = []
    _trace_abstractly(program, storages, inputs, call.dynamic)
    return Program(program, inputs, written, tuple(new), result, key, tuple(check_messages))


def _trace_abstractly(fn, storages, inputs, dynamic) -> None:
    """Trace a program once without running it: lowering errors surface at the op's line, and
    what the trace records (its device-side checks) is known before the program runs."""
    import jax

    avals = [jax.ShapeDtypeStruct((storages[i].numel,), dtypes.to_jax(storages[i].dtype)) for i in inputs]
    avals += [jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) for v in dynamic]
    jax.eval_shape(fn, *avals)


def _flatten(out):
    if isinstance(out, (tuple, list)):
        for o in out:
            yield from _flatten(o)
    elif out is not None:
        yield out


def _result_template(meta_out, new: list, host: list):
    """How to assemble a functional op's return value from new tensors and host values."""
    if isinstance(meta_out, torch.Tensor):
        new.append(_new_tensor_spec(meta_out))
        return ("new", len(new) - 1)
    if isinstance(meta_out, (tuple, list)):
        return (type(meta_out).__name__, tuple(_result_template(m, new, host) for m in meta_out))
    if meta_out is None:
        return ("none",)
    host.append(type(meta_out))
    return ("host", len(host) - 1, type(meta_out))


def _written_result(sig: Signature, op: OpOverload):
    returns = op._schema.returns
    if not returns:
        return ("none",)
    outs = [i for i in sig.written]
    if len(returns) == 1:
        return ("arg", outs[0])
    return ("tuple", tuple(("arg", i) for i in outs))


def assemble(template, call: Call, new_tensors: list, host_values: list):
    kind = template[0]
    if kind == "new":
        return new_tensors[template[1]]
    if kind == "arg":
        return call.values[template[1]]
    if kind == "host":
        return template[2](host_values[template[1]])
    if kind == "none":
        return None
    if kind == "const":
        return template[1]
    parts = [assemble(t, call, new_tensors, host_values) for t in template[1]]
    return parts if kind == "list" else tuple(parts)


def describe_key_difference(a: tuple, b: tuple) -> str:
    """What differs between two compile keys of one op or one compiled graph: the precision, the
    device, which argument's shape, dtype or layout, which static value -- for a graph, which
    dynamic size or which bucket of its bounded dimensions."""
    if a[1] != b[1]:
        return f"matmul precision {a[1]} instead of {b[1]}"
    if a[2] != b[2]:
        return f"device tpu:{a[2]} instead of tpu:{b[2]}"
    graph = not isinstance(a[0], OpOverload)
    if graph:
        names = [f"input {i}" for i in range(len(a[4]))]
    else:
        names = [f"argument {arg.name!r}" for arg in signature(a[0]).args]
    for name, x, y in zip(names, a[4], b[4]):
        if x == y:
            continue
        if isinstance(x, TensorRef) and isinstance(y, TensorRef):
            if x.sizes != y.sizes:
                return f"{name} has shape {x.sizes} instead of {y.sizes}"
            if x.dtype != y.dtype:
                return f"{name} has dtype {x.dtype} instead of {y.dtype}"
            return f"{name} has strides/offset {x.geometry} instead of {y.geometry}"
        if graph and isinstance(x, int) and isinstance(y, int):
            return f"{name} (a dynamic size) is {x} instead of {y} (torchtpu.bounded buckets sizes)"
        return f"{name} is {x!r} instead of {y!r}"
    if a[5:] != b[5:]:
        return f"bounded dimensions at buckets {a[5]} instead of {b[5]}"
    if a[3] != b[3]:
        return "the arguments' storages differ in size or initialisation"
    return "no visible difference"
