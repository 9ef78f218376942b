"""An ATen FX graph as one JAX function, through the lowering registry.

Used by the compiled executor (AOTAutograd's forward and backward graphs). Each `call_function`
node on an ATen overload calls that overload's registered lowering with a context built from the
nodes' fake-tensor metadata (`node.meta["val"]`), exactly as the eager executors do; `getitem`
and Python arithmetic on sizes are evaluated directly. There is no second copy of any op's math
here.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch._ops import OpOverload

from torchtpu import random as tpu_random
from torchtpu.exec.bucketing import Padding, SymValue
from torchtpu.ops import registry
from torchtpu.ops.schema import signature

_PYTHON_TARGETS: dict[Any, Callable[..., Any]] = {
    operator.getitem: operator.getitem,
    operator.add: operator.add,
    operator.sub: operator.sub,
    operator.mul: operator.mul,
    operator.floordiv: operator.floordiv,
    operator.truediv: operator.truediv,
    operator.mod: operator.mod,
    operator.neg: operator.neg,
    operator.eq: operator.eq,
    operator.ne: operator.ne,
    operator.lt: operator.lt,
    operator.le: operator.le,
    operator.gt: operator.gt,
    operator.ge: operator.ge,
}


class UnsupportedNode(NotImplementedError):
    """A graph node the tpu compiler cannot lower."""


def _meta(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        return value.meta.get("val")
    if isinstance(value, (list, tuple)):
        return type(value)(_meta(v) for v in value)
    return value


def is_lowered(node: torch.fx.Node) -> bool:
    """Whether `interpret` can run ATen node `node`: its op has a lowering, or is one of the
    few it evaluates itself (size queries, `copy_` into a graph input)."""
    return registry.get(node.target) is not None or _is_input_copy(node) or _is_size_query(node.target)


def _is_input_copy(node: torch.fx.Node) -> bool:
    """`copy_` into a graph input: the one in-place op AOTAutograd leaves in a graph, for inputs
    whose data the graph mutates (state written during the backward, e.g. by a fused optimizer)."""
    destination = node.args[0] if node.args else None
    return (
        node.target is torch.ops.aten.copy_.default
        and isinstance(destination, torch.fx.Node)
        and destination.op == "placeholder"
    )


def written_inputs(gm: torch.fx.GraphModule) -> dict[int, Any]:
    """The inputs the graph `copy_`s into: position -> the input's metadata."""
    placeholders = {node: i for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    return {
        placeholders[node.args[0]]: node.args[0].meta.get("val")
        for node in gm.graph.nodes
        if node.op == "call_function" and _is_input_copy(node)
    }


def host_written_inputs(gm: torch.fx.GraphModule) -> tuple[int, ...]:
    """Positions of the CPU inputs the graph `copy_`s into (a compiled optimizer's step count,
    a 0-dim CPU tensor): a device program cannot write host memory, so the graph returns their
    new values and the caller copies them in."""
    return tuple(sorted(
        position for position, meta in written_inputs(gm).items()
        if isinstance(meta, torch.Tensor) and meta.device.type == "cpu"
    ))


def aliased_outputs(gm: torch.fx.GraphModule) -> dict[int, int]:
    """Outputs that are graph inputs as they came in (AOTAutograd's forward returns the inputs it
    saves for the backward this way): output position -> input position."""
    placeholders = {node: i for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    output = next(node for node in gm.graph.nodes if node.op == "output")
    results = output.args[0] if isinstance(output.args[0], (list, tuple)) else (output.args[0],)
    return {position: placeholders[value] for position, value in enumerate(results) if value in placeholders}


_SIZE_QUERIES = {
    torch.ops.aten.sym_size.int: lambda x, dim: x.shape[dim],
    torch.ops.aten.sym_stride.int: None,
    torch.ops.aten.sym_numel.default: lambda x: x.size,
    torch.ops.aten.sym_storage_offset.default: None,
}


def _is_size_query(op: OpOverload) -> bool:
    return op in _SIZE_QUERIES


def interpret(
    gm: torch.fx.GraphModule,
    inputs: Sequence[Any],
    *,
    precision: str,
    platform: str,
    rng_words: Any = None,
    checks: list | None = None,
    writes: dict[int, Any] | None = None,
    padding: Padding | None = None,
) -> list[Any]:
    """Evaluate `gm` on JAX values (inside a trace) and return its outputs as a flat list.
    Device-side checks the lowerings state are appended to `checks` as (flag, message); the new
    values of inputs the graph copies into go to `writes`, by input position. A graph with
    symbolic sizes needs `padding`, the sizes of this call: lowerings see metadata at those sizes,
    and bounded dimensions run at bucket size, each op through its bucketing rule."""
    env: dict[torch.fx.Node, Any] = {}
    placeholders = iter(inputs)
    input_position: dict[torch.fx.Node, int] = {}
    rng_base = tpu_random.key_from_words(rng_words) if rng_words is not None else None
    import jax

    def load(arg):
        return torch.fx.node.map_arg(arg, lambda n: env[n])

    outputs: list[Any] = []
    for position, node in enumerate(gm.graph.nodes):
        if node.op == "placeholder":
            env[node] = next(placeholders)
            if padding is not None:
                env[node] = padding.placeholder(len(input_position), env[node])
            input_position[node] = len(input_position)
        elif node.op == "get_attr":
            env[node] = _constant(getattr(gm, node.target))
        elif node.op == "call_function":
            target = node.target
            args, kwargs = load(node.args), load(node.kwargs)
            if target in _PYTHON_TARGETS:
                if padding is not None:
                    env[node] = padding.python_op(_PYTHON_TARGETS[target], args)
                else:
                    env[node] = _PYTHON_TARGETS[target](*args, **kwargs)
            elif isinstance(target, OpOverload) and target in _SIZE_QUERIES:
                query = _SIZE_QUERIES[target]
                if query is None:
                    raise UnsupportedNode(f"{target} (strides are not observable in compiled tpu graphs)")
                env[node] = query(*args, **kwargs)
                if padding is not None:
                    env[node] = padding.size_query(node.meta.get("val"), env[node])
            elif isinstance(target, OpOverload):
                copies_input = _is_input_copy(node)
                if copies_input:
                    if writes is None:
                        raise UnsupportedNode(f"{target} into a graph input (node {node.name})")
                    target = torch.ops.aten.copy.default
                lowering = registry.get(target)
                if lowering is None:
                    raise UnsupportedNode(f"{target} has no tpu lowering (node {node.name})")
                sig = signature(target)
                values = sig.normalize(tuple(args), dict(kwargs))
                meta_args = sig.normalize(tuple(_meta(node.args)), dict(_meta(node.kwargs)))
                meta_out = node.meta.get("val")
                registry.check_complex(target, meta_args, meta_out)
                if padding is not None:
                    meta_args, meta_out = padding.concrete(meta_args), padding.concrete(meta_out)
                rng = jax.random.fold_in(rng_base, position) if lowering.random else None
                if lowering.random and rng_base is None:
                    raise UnsupportedNode(f"{target} needs random numbers but the graph got no key")
                ctx = registry.LoweringContext(target, meta_args, meta_out, precision, platform, rng)
                if padding is None:
                    pos, kw = sig.split(values)
                    env[node] = lowering.fn(ctx, *pos, **kw)
                else:
                    invoke = functools.partial(_invoke, ctx, sig)
                    values = padding.resolve(target, sig, values)
                    symbolic_args = sig.normalize(tuple(_meta(node.args)), dict(_meta(node.kwargs)))
                    env[node] = padding.call(target, values, symbolic_args, node.meta.get("val"), invoke)
                if checks is not None:
                    checks.extend(ctx.checks)
                if copies_input:
                    destination = node.args[0]
                    env[destination] = env[node]
                    writes[input_position[destination]] = env[node]
            else:
                raise UnsupportedNode(f"call_function {target} (node {node.name})")
        elif node.op == "output":
            result = load(node.args[0])
            outputs = list(result) if isinstance(result, (list, tuple)) else [result]
            if padding is not None:
                outputs = [o.bucket if isinstance(o, SymValue) else o for o in outputs]
        else:
            raise UnsupportedNode(f"{node.op} nodes (node {node.name})")
    return outputs


def _invoke(ctx: registry.LoweringContext, sig, op: OpOverload, values: list) -> Any:
    """Run `op`'s lowering on schema-ordered `values` (`op` shares `ctx.op`'s argument list)."""
    if op is not ctx.op:
        ctx = dataclasses.replace(ctx, op=op)
    pos, kw = sig.split(values)
    return registry.get(op).fn(ctx, *pos, **kw)


def needs_rng(gm: torch.fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, OpOverload):
            lowering = registry.get(node.target)
            if lowering is not None and lowering.random:
                return True
    return False


def _constant(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        import jax.numpy as jnp

        from torchtpu.exec import memory

        host = value.detach()
        array = memory.to_numpy(host) if host.device.type == "tpu" else memory.torch_to_numpy(host)
        return jnp.asarray(array)
    return value
