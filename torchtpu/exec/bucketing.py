"""Running a compiled graph at bucket sizes: padding its bounded dimensions and masking the ops
that would mix pad entries into real results.

A graph captured with a bounded dimension (`torchtpu.bounded`) has that dimension as a symbol
(`s0`) in its nodes' fake-tensor shapes. `plan_call` fixes, for one call, each bounded symbol's
true size `n` and bucket `B`: the program is traced at `B` (the bucket is part of its compile
key) while `n` is a runtime input, so one program serves every `n` of a bucket.

Inside the trace every tensor is stored at bucket size; along a bounded axis its first `n`
entries are real (`valid length` = the axis' size expression at the true sizes: `n`, `12*n`)
and the rest are padding. `Padding` keeps that invariant op by op:

- pointwise ops, layout ops that keep each bounded axis outermost in its group (view, permute,
  expand, slices from the front, ...), gathers (`embedding`, `index_select`) and cumulative
  sums act on each entry alone: pad entries never reach real ones, nothing to do;
- reductions over a bounded axis (`sum`, `mean`, `amax`, ...) see pad entries replaced by the
  reduction's identity; `mean` divides by the true count;
- contractions over a bounded axis (`mm`, `bmm`, `addmm`) see both operands' pad entries zeroed;
- softmax over a bounded axis masks pad entries to -inf (and zeroes them in its backward);
- `nll_loss` treats pad targets as `ignore_index`; `layer_norm`'s and `embedding`'s backward
  zero the gradient of pad rows before reducing them into parameter gradients.

A SymInt of the graph carries both values (`SymValue`): sizes (schema `SymInt` arguments) use
the bucket, numbers (`Scalar` and tensor arguments: a mean's divisor) use the true size.
Any other op that reads a bounded axis raises `BucketingError` naming the op and the axis:
bucket-unsafe ops (sorting, `cat` along the axis, batch norm over it, ...) are refused, never
silently mixed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import threading
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np
import torch
from torch._ops import OpOverload

from torchtpu import counters, storage
from torchtpu.bounds import bounds_of, mark, pad
from torchtpu.ops.schema import ArgKind, Signature

aten = torch.ops.aten


class BucketingError(RuntimeError):
    """An op of a bounded graph would mix pad entries into real results."""


class SymValue(NamedTuple):
    """A SymInt of the graph: its value at the buckets (for sizes) and its true value (traced)."""

    bucket: int
    true: Any


def _name(symbol) -> str:
    return symbol.name


def _expr(size) -> Any:
    return size.node.expr if isinstance(size, torch.SymInt) else None


def _evaluate(expr, values: dict) -> Any:
    """A size expression (sums and products of symbols) at the given symbol values."""
    import sympy

    if expr.is_Integer:
        return int(expr)
    if expr.is_Symbol:
        return values[expr]
    if isinstance(expr, (sympy.Add, sympy.Mul)):
        parts = [_evaluate(arg, values) for arg in expr.args]
        combine = operator.add if isinstance(expr, sympy.Add) else operator.mul
        result = parts[0]
        for part in parts[1:]:
            result = combine(result, part)
        return result
    raise BucketingError(f"size expression {expr} is neither a sum nor a product of sizes")


def _static(expr, values: dict) -> int:
    """A size expression at integer symbol values."""
    if expr.is_Symbol:
        return int(values[expr])
    import sympy

    return int(expr.xreplace({s: sympy.Integer(v) for s, v in values.items()}))


# --- one call: true sizes, buckets, padded arguments ------------------------------------------


@dataclasses.dataclass
class CallPlan:
    """One call of a graph with symbolic sizes: each symbol's value, the bounded symbols' buckets
    and true sizes, and the arguments at bucket size."""

    args: list  # tensors viewing their padded storage, SymInts at their bucket
    buckets: dict  # bounded symbol -> bucket
    sizes: dict  # bounded symbol -> true size
    fixed: dict  # every other symbol -> its value in this call
    policies: dict  # bounded symbol -> Buckets
    symints: dict  # argument position -> size expression of a SymInt argument with a bounded symbol

    @functools.cached_property
    def key(self) -> tuple:
        """Every symbol's value at this call's buckets, by name: part of the compile key."""
        return tuple(sorted((s.name, v) for s, v in self.values.items()))

    def sizes_for_trace(self) -> "TraceSizes":
        """What tracing needs (no tensors: a compiled program must not keep this call's args)."""
        return TraceSizes(self.order(), dict(self.buckets), dict(self.fixed), dict(self.symints))

    def true_sizes(self) -> list[np.ndarray]:
        """The runtime inputs of the program: one true size per bounded symbol, in key order."""
        return [np.asarray(self.sizes[s], np.int64) for s in self.order()]

    def order(self) -> list:
        return sorted(self.buckets, key=_name)

    @functools.cached_property
    def values(self) -> dict:
        """Every symbol's value at the buckets (what sizes are traced at)."""
        return {**self.fixed, **self.buckets}

    def unpad(self, out: Any, meta: Any) -> Any:
        """A graph output as the caller sees it: a bounded output becomes a view of its true
        size over the padded storage, marked so that the next bounded graph reads it whole."""
        true_values = {**self.fixed, **self.sizes}
        if isinstance(meta, torch.SymInt) and _expr(meta).free_symbols & self.buckets.keys():
            return _static(_expr(meta), true_values)
        if not isinstance(out, torch.Tensor) or not isinstance(meta, torch.Tensor):
            return out
        axes = {}
        sizes = []
        for axis, size in enumerate(meta.shape):
            expr = _expr(size)
            if expr is not None and expr.free_symbols & self.buckets.keys():
                symbol = next(iter(expr.free_symbols & self.buckets.keys()))
                axes[axis] = self.policies[symbol]
                sizes.append(_static(expr, true_values))
            else:
                sizes.append(out.shape[axis])
        if not axes:
            return out
        view = storage.new_tensor(storage.buffer_of(out), tuple(sizes), tuple(out.stride()), out.storage_offset())
        mark(view, axes)
        return view


class SymbolicInputs:
    """Where a graph's symbols stand among its inputs, read once from its input metas: the SymInt
    inputs, and each tensor input's symbolic axes (the others keep their shapes at any size)."""

    __slots__ = ("symints", "tensors")

    def __init__(self, metas: Sequence[Any]) -> None:
        self.symints = []
        self.tensors = []
        for position, meta in enumerate(metas):
            if isinstance(meta, torch.SymInt):
                self.symints.append((position, _expr(meta)))
            elif isinstance(meta, torch.Tensor):
                axes = tuple((axis, expr) for axis, size in enumerate(meta.shape) if (expr := _expr(size)) is not None)
                if axes:
                    self.tensors.append((position, axes))


def plan_call(inputs: SymbolicInputs, args: Sequence[Any], written: frozenset[int] = frozenset()) -> CallPlan:
    """Bind the symbols of one call of a symbolic graph to this call's sizes, and find the
    bounded ones from the marked storages of its tensor arguments -- or, for a symbol no argument
    of a piece of a split graph marks (its inputs all made by eager ops), from the whole graph's
    call (`bounded_like`); `written`: the positions of the arguments the graph writes in place."""
    policies = _marked_policies(inputs, args)
    sizes: dict = {}
    fixed: dict = {}
    symints: dict = {}
    for position, expr in inputs.symints:
        symints[position] = expr
        if expr.is_Symbol:
            fixed[expr] = int(args[position])
    for position, axes in inputs.tensors:
        arg = args[position]
        if isinstance(arg, torch.Tensor):
            for axis, expr in axes:
                if expr.is_Symbol:
                    fixed[expr] = arg.shape[axis]
    for symbol, policy in _inherited().items():
        if symbol in fixed:
            policies.setdefault(symbol, policy)
    for symbol in policies:
        if symbol not in fixed:
            raise BucketingError(f"the true size of bounded dimension {symbol} is not an input size")
        sizes[symbol] = fixed.pop(symbol)
    buckets = {symbol: policies[symbol].bucket(sizes[symbol]) for symbol in policies}
    symints = {p: e for p, e in symints.items() if e.free_symbols & buckets.keys()}
    plan = CallPlan(list(args), buckets, sizes, fixed, policies, symints)
    for position, expr in symints.items():
        plan.args[position] = _static(expr, plan.values)
    for position, axes in inputs.tensors:
        plan.args[position] = _padded_arg(plan, position, axes, args[position], position in written)
    return plan


def _marked_policies(inputs: SymbolicInputs, args: Sequence[Any]) -> dict:
    """The buckets of each bounded symbol, from the marked storages of the tensor arguments
    (`torchtpu.bounded`, a bounded graph's outputs); two marks of one symbol must agree."""
    policies: dict = {}
    for position, axes in inputs.tensors:
        arg = args[position]
        marks = bounds_of(arg) if isinstance(arg, torch.Tensor) else None
        if not marks:
            continue
        for axis, expr in axes:
            if axis not in marks:
                continue
            for symbol in expr.free_symbols:
                known = policies.setdefault(symbol, marks[axis])
                if known != marks[axis]:
                    raise BucketingError(
                        f"bounded dimension {symbol} is padded to {known} in one input and to "
                        f"{marks[axis]} in input {position}: bound it with the same buckets"
                    )
    return policies


_bounded_calls = threading.local()


def _inherited() -> dict:
    """The bounded symbols of the split graphs being called on this thread (`bounded_like`)."""
    return getattr(_bounded_calls, "policies", {})


@contextlib.contextmanager
def bounded_like(inputs: SymbolicInputs, args: Sequence[Any]) -> Iterator[None]:
    """While a split graph (`split`) runs: its pieces take the graph's bounded symbols as
    bounded too. A piece whose inputs all come from eager ops between pieces (a host op's
    result, moved back) has no marked input of its own; without the graph's word it would
    compile a program for every size instead of every bucket."""
    previous = _inherited()
    _bounded_calls.policies = {**previous, **_marked_policies(inputs, args)}
    try:
        yield
    finally:
        _bounded_calls.policies = previous


def _padded_arg(plan: CallPlan, position: int, axes: tuple, arg: Any, written: bool) -> Any:
    """Tensor argument `position` (symbolic along `axes`) at its bucket sizes: a view of its
    padded storage, or a padded copy where its storage ends at its true size."""
    if not isinstance(arg, torch.Tensor):
        return arg
    padded = list(arg.shape)
    for axis, expr in axes:
        padded[axis] = _static(expr, plan.values)
    padded = tuple(padded)
    if padded == tuple(arg.shape):
        return arg
    buffer = storage.buffer_of(arg)
    end = arg.storage_offset() + sum((s - 1) * st for s, st in zip(padded, arg.stride())) + 1
    if not bounds_of(arg) or end > buffer.numel:
        if written:  # a copy would take the graph's writes
            raise BucketingError(
                f"graph input {position} of shape {tuple(arg.shape)} has a bounded dimension and is "
                f"written in place, but its storage does not hold the padded shape {padded}: create "
                "it with torchtpu.bounded() or take it from a bounded graph's output"
            )
        return _padded_copy(arg, padded)
    return storage.new_tensor(buffer, padded, tuple(arg.stride()), arg.storage_offset())


def _padded_copy(arg: torch.Tensor, padded: tuple[int, ...]) -> torch.Tensor:
    """`arg` copied into a new tensor of the `padded` shape, padded as `torchtpu.bounded` pads:
    for a bounded input whose storage ends at its true size -- made by an eager op, such as a
    host op between two compiled pieces of a split graph (`split`), or passed without
    `torchtpu.bounded()`. Counted in `torchtpu.metrics()["bounded_inputs_copied"]`: one copy a
    call, where inputs made by `torchtpu.bounded()` or a bounded graph cost none."""
    counters.count("bounded_inputs_copied")
    return pad(arg, padded)


# --- inside the trace: masks ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TraceSizes:
    """The static part of a `CallPlan`, which a compiled program may keep."""

    order: list  # bounded symbols, in the order of their true sizes among the runtime inputs
    buckets: dict
    fixed: dict
    symints: dict


Invoke = Callable[[OpOverload, list], Any]  # runs an overload's registry lowering on values


class Padding:
    """The sizes of one traced call of a symbolic graph: each symbol's value (a bounded one's at
    its bucket: the trace's shapes) and the bounded symbols' true sizes (traced values)."""

    def __init__(self, sizes: TraceSizes, true_sizes: Sequence[Any]) -> None:
        import sympy

        self.bounded = frozenset(sizes.buckets)
        self.true = {**sizes.fixed, **dict(zip(sizes.order, true_sizes))}
        self.static = {s: sympy.Integer(v) for s, v in {**sizes.fixed, **sizes.buckets}.items()}
        self.symints = sizes.symints

    def concrete(self, meta: Any) -> Any:
        """Fake-tensor metadata with symbolic sizes -> meta tensors at this trace's sizes."""
        if isinstance(meta, torch.SymInt):
            return int(_expr(meta).xreplace(self.static))
        if isinstance(meta, (list, tuple)):
            return type(meta)(self.concrete(m) for m in meta)
        if not isinstance(meta, torch.Tensor):
            return meta
        layout = (*meta.shape, *meta.stride(), meta.storage_offset())
        if not any(isinstance(v, torch.SymInt) for v in layout):
            return meta
        sizes = tuple(self.concrete(s) for s in meta.shape)
        strides = tuple(self.concrete(s) for s in meta.stride())
        return torch.empty_strided(sizes, strides, dtype=meta.dtype, device="meta")

    def placeholder(self, position: int, value: Any) -> Any:
        expr = self.symints.get(position)
        return SymValue(value, _evaluate(expr, self.true)) if expr is not None else value

    def size_query(self, meta: Any, bucket: int) -> Any:
        expr = _expr(meta)
        if expr is None or not expr.free_symbols & self.bounded:
            return bucket
        return SymValue(bucket, _evaluate(expr, self.true))

    def axes(self, meta: Any) -> dict[int, Any]:
        """The bounded axes of a value (by its fake tensor) -> their valid lengths."""
        if not isinstance(meta, torch.Tensor):
            return {}
        found = {}
        for axis, size in enumerate(meta.shape):
            expr = _expr(size)
            if expr is not None and expr.free_symbols & self.bounded:
                found[axis] = _evaluate(expr, self.true)
        return found

    def masked(self, value, meta, fill, only: Sequence[int] | None = None):
        """`value` with the pad entries of its bounded axes (or of `only` those) set to `fill`."""
        import jax.numpy as jnp

        valid = None
        for axis, length in self.axes(meta).items():
            if only is not None and axis not in only:
                continue
            shape = [1] * value.ndim
            shape[axis] = value.shape[axis]
            inside = jnp.arange(value.shape[axis]).reshape(shape) < length
            valid = inside if valid is None else valid & inside
        if valid is None:
            return value
        return jnp.where(valid, value, jnp.asarray(fill, value.dtype))

    # --- SymInts ----------------------------------------------------------------------------

    @staticmethod
    def python_op(fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        """Python arithmetic on SymInts, on both values."""
        if not any(isinstance(a, SymValue) for a in args):
            return fn(*args)
        buckets = [a.bucket if isinstance(a, SymValue) else a for a in args]
        trues = [a.true if isinstance(a, SymValue) else a for a in args]
        return SymValue(fn(*buckets), fn(*trues))

    @staticmethod
    def resolve(op: OpOverload, sig: Signature, values: list) -> list:
        """SymValues in an op's arguments: the bucket for sizes, the true value for numbers."""

        def pick(value, kind):
            if isinstance(value, SymValue):
                return value.bucket if kind is ArgKind.STATIC or op in _SIZED_BY_SCALARS else value.true
            if isinstance(value, (list, tuple)):
                return type(value)(pick(v, kind) for v in value)
            return value

        return [pick(v, arg.kind) for v, arg in zip(values, sig.args)]

    # --- ops --------------------------------------------------------------------------------

    def call(self, op: OpOverload, values: list, metas: list, out_meta: Any, invoke: Invoke) -> Any:
        """Run `op` on bucket-size values so that real entries get the unpadded results."""
        bounded = [(i, axes) for i, m in enumerate(metas) for axes in [self._axes_of(m)] if axes]
        if not bounded:
            return invoke(op, values)
        rule = _RULES.get(op)
        if rule is not None:
            return rule(self, op, values, metas, out_meta, invoke)
        if torch.Tag.pointwise in op.tags or op in _ENTRYWISE:
            return invoke(op, values)
        position, axes = bounded[0]
        raise BucketingError(
            f"{op} reads argument {position} along its bounded axes {axes} and has no bucketing "
            "rule: padding could mix pad entries into its results. Keep the bounded dimension out "
            "of this op, or compile it without torchtpu.bounded"
        )

    def _axes_of(self, meta: Any) -> list[int]:
        if isinstance(meta, (list, tuple)):
            return sorted({a for m in meta for a in self._axes_of(m)})
        return sorted(self.axes(meta))

    def refuse(self, op: OpOverload, meta: Any, axes, why: str) -> None:
        hit = sorted(set(self.axes(meta)) & set(axes))
        if hit:
            raise BucketingError(f"{op} {why} along bounded axis {hit[0]}: not bucket-safe")


def _dims(ndim: int, dim) -> tuple[int, ...]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else dim
    return tuple(d % max(ndim, 1) for d in dims)


def _extreme(dtype, lowest: bool):
    import jax.numpy as jnp

    if jnp.issubdtype(dtype, jnp.floating):
        return -np.inf if lowest else np.inf
    if dtype == jnp.bool_:
        return not lowest
    info = jnp.iinfo(dtype)
    return info.min if lowest else info.max


def _reduction(identity: Callable[[Any], Any], dim: int | None):
    """A reduction over the axes at argument `dim` (all axes when None or empty): pad entries
    are replaced by its identity first."""

    def rule(self: Padding, op, values, metas, out_meta, invoke):
        meta = metas[0]
        values = list(values)
        values[0] = self.masked(values[0], meta, identity(values[0].dtype),
                                _dims(meta.dim(), None if dim is None else values[dim]))
        return invoke(op, values)

    return rule


_SUM_OF_MEAN = {aten.mean.dim: aten.sum.dim_IntList, aten.mean.default: aten.sum.default}


def _mean(self: Padding, op, values, metas, out_meta, invoke):
    """The sum over the real entries, divided by how many there are."""
    import jax.numpy as jnp

    meta = metas[0]
    dims = _dims(meta.dim(), values[1] if op is aten.mean.dim else None)
    valid = self.axes(meta)
    count = 1
    for d in dims:
        count = count * (valid[d] if d in valid else values[0].shape[d])
    values = list(values)
    values[0] = self.masked(values[0], meta, 0, dims)
    total = invoke(_SUM_OF_MEAN[op], values)
    return total / jnp.asarray(count).astype(total.dtype)


def _contraction(left: int, right: int, first: int):
    """Arguments `first` and `first + 1` contract axis `left` of one with axis `right` of the
    other: a bounded contracted axis gets both operands' pad entries zeroed."""

    def rule(self: Padding, op, values, metas, out_meta, invoke):
        a, b = metas[first], metas[first + 1]
        left_axis, right_axis = left % a.dim(), right % b.dim()
        if left_axis in self.axes(a) or right_axis in self.axes(b):
            values = list(values)
            values[first] = self.masked(values[first], a, 0, (left_axis,))
            values[first + 1] = self.masked(values[first + 1], b, 0, (right_axis,))
        return invoke(op, values)

    return rule


def _softmax(self: Padding, op, values, metas, out_meta, invoke):
    """Softmax over a bounded axis: pad entries are -inf, so they get probability zero."""
    meta = metas[0]
    dim = values[1] % meta.dim()
    if dim in self.axes(meta):
        values = list(values)
        values[0] = self.masked(values[0], meta, -np.inf, (dim,))
    return invoke(op, values)


def _softmax_backward(self: Padding, op, values, metas, out_meta, invoke):
    """(grad, output, dim, dtype): the gradient sums over `dim`; pad entries contribute zero."""
    dim = values[2] % metas[0].dim()
    if dim in self.axes(metas[0]):
        values = list(values)
        values[0] = self.masked(values[0], metas[0], 0, (dim,))
        fill = -np.inf if op is aten._log_softmax_backward_data.default else 0
        values[1] = self.masked(values[1], metas[1], fill, (dim,))
    return invoke(op, values)


def _nll_loss(target: int, ignore_index: int):
    """Pad targets become `ignore_index`: no loss, no weight in the mean, no gradient."""

    def rule(self: Padding, op, values, metas, out_meta, invoke):
        values = list(values)
        values[target] = self.masked(values[target], metas[target], values[ignore_index])
        return invoke(op, values)

    return rule


def _layer_norm(self: Padding, op, values, metas, out_meta, invoke):
    meta = metas[0]
    self.refuse(op, meta, range(meta.dim() - len(values[1]), meta.dim()), "normalizes")
    return invoke(op, values)


def _zero_pad_gradient(self: Padding, op, values, metas, out_meta, invoke):
    """Backward ops that sum the incoming gradient (argument 0) over rows into a parameter's
    gradient: pad rows contribute zero."""
    values = list(values)
    values[0] = self.masked(values[0], metas[0], 0)
    return invoke(op, values)


def _layer_norm_backward(self: Padding, op, values, metas, out_meta, invoke):
    meta = metas[1]
    self.refuse(op, meta, range(meta.dim() - len(values[2]), meta.dim()), "normalizes")
    return _zero_pad_gradient(self, op, values, metas, out_meta, invoke)


def _embedding_backward(self: Padding, op, values, metas, out_meta, invoke):
    if values[4]:
        raise BucketingError(f"{op} with scale_grad_by_freq counts pad ids: not bucket-safe")
    return _zero_pad_gradient(self, op, values, metas, out_meta, invoke)


def _along_dim(position: int, why: str):
    """Ops that are safe unless they act along a bounded axis (the `dim` at `position`)."""

    def rule(self: Padding, op, values, metas, out_meta, invoke):
        tensors = metas[0] if isinstance(metas[0], (list, tuple)) else [metas[0]]
        for meta in tensors:
            if isinstance(meta, torch.Tensor) and meta.dim():
                self.refuse(op, meta, (values[position] % meta.dim(),), why)
        return invoke(op, values)

    return rule


def _fixed_index(position: int, why: str):
    """`slice`/`select` along a bounded axis keep real entries in front only from a fixed,
    non-negative index (and, for slices, with step one)."""

    def rule(self: Padding, op, values, metas, out_meta, invoke):
        meta, dim = metas[0], values[1] % metas[0].dim()
        if dim in self.axes(meta):
            index, given = values[position], metas[position]
            symbolic = isinstance(given, torch.SymInt) and _expr(given).free_symbols & self.bounded
            step = values[4] if op is aten.slice.Tensor else 1
            if symbolic or (index is not None and index < 0) or step != 1:
                raise BucketingError(f"{op} {why} {given} along bounded axis {dim}: not bucket-safe")
        return invoke(op, values)

    return rule


def _reshape(self: Padding, op, values, metas, out_meta, invoke):
    """A reshape keeps real entries in front when each bounded axis is the outermost (non-1)
    axis of its group of merged or split axes, on both sides."""
    result = invoke(op, values)
    before, after = tuple(values[0].shape), tuple(result.shape)
    if 0 in before:
        return result
    sides = ((before, set(self.axes(metas[0]))), (after, set(self.axes(out_meta))))
    for group_in, group_out in _groups(before, after):
        for axes, (shape, bounded) in zip((group_in, group_out), sides):
            inner = [a for a in axes if shape[a] != 1]
            hit = [a for a in inner if a in bounded]
            if hit and (len(hit) > 1 or inner[0] != hit[0]):
                raise BucketingError(
                    f"{op} from {before} to {after} puts bounded axis {hit[0]} inside another axis: "
                    "real entries would not stay in front"
                )
    return result


def _groups(before: Sequence[int], after: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """The axes of a reshape's input and output, in groups of equal total size."""
    groups = []
    i = j = 0
    while i < len(before) or j < len(after):
        group_in, group_out, size_in, size_out = [], [], 1, 1
        if i < len(before):
            group_in.append(i)
            size_in *= before[i]
            i += 1
        if j < len(after):
            group_out.append(j)
            size_out *= after[j]
            j += 1
        while size_in != size_out:
            if size_in < size_out:
                group_in.append(i)
                size_in *= before[i]
                i += 1
            else:
                group_out.append(j)
                size_out *= after[j]
                j += 1
        groups.append((group_in, group_out))
    return groups


def _reads_real_rows(self: Padding, op, values, metas, out_meta, invoke):
    """Gathers read rows by index (indices name real rows only) and prefix sums never read the
    entries after their own: pad entries stay out of real results as they are."""
    return invoke(op, values)


def _zero(dtype) -> int:
    return 0


def _one(dtype) -> int:
    return 1


_RULES: dict[OpOverload, Callable[..., Any]] = {
    aten.sum.dim_IntList: _reduction(_zero, 1),
    aten.sum.default: _reduction(_zero, None),
    aten.prod.dim_int: _reduction(_one, 1),
    aten.amax.default: _reduction(lambda dtype: _extreme(dtype, lowest=True), 1),
    aten.amin.default: _reduction(lambda dtype: _extreme(dtype, lowest=False), 1),
    aten.any.dim: _reduction(lambda dtype: False, 1),
    aten.all.dim: _reduction(lambda dtype: True, 1),
    aten.mean.dim: _mean,
    aten.mean.default: _mean,
    aten.mm.default: _contraction(1, 0, 0),
    aten.bmm.default: _contraction(2, 1, 0),
    aten.addmm.default: _contraction(1, 0, 1),
    aten.baddbmm.default: _contraction(2, 1, 1),
    aten._softmax.default: _softmax,
    aten._log_softmax.default: _softmax,
    aten._softmax_backward_data.default: _softmax_backward,
    aten._log_softmax_backward_data.default: _softmax_backward,
    aten.nll_loss_forward.default: _nll_loss(1, 4),
    aten.nll_loss_backward.default: _nll_loss(2, 5),
    aten.native_layer_norm.default: _layer_norm,
    aten.native_layer_norm_backward.default: _layer_norm_backward,
    aten.embedding_dense_backward.default: _embedding_backward,
    aten.embedding.default: _reads_real_rows,
    aten.index_select.default: _reads_real_rows,
    aten.gather.default: _reads_real_rows,
    aten.cumsum.default: _reads_real_rows,
    aten.cat.default: _along_dim(1, "concatenates"),
    aten.split.Tensor: _along_dim(2, "splits"),
    aten.split_with_sizes.default: _along_dim(2, "splits"),
    aten.slice.Tensor: _fixed_index(2, "starts at"),
    aten.select.int: _fixed_index(2, "selects entry"),
    aten.view.default: _reshape,
    aten._unsafe_view.default: _reshape,
    aten.reshape.default: _reshape,
}

# Entry by entry, with no Tag.pointwise: each output entry reads only the input entries at its
# own position (or none).
_ENTRYWISE = frozenset({
    aten._to_copy.default, aten.clone.default, aten.copy.default, aten.detach.default, aten.alias.default,
    aten.t.default, aten.transpose.int, aten.permute.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default,
    aten.fill.Scalar, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
    aten.empty_like.default, aten.native_dropout.default, aten.bernoulli.p, aten.rand_like.default,
    aten.randn_like.default,
})

# Factories whose output size is given by Scalars: a SymInt there is a size (the bucket).
_SIZED_BY_SCALARS = frozenset({aten.arange.default, aten.arange.start, aten.arange.start_step})
