"""Splitting a compiled graph into the pieces a tpu program can run and the nodes it cannot.

AOTAutograd hands the backend whole graphs, and not every node of one belongs in a tpu program:
an op without a lowering, or an op on host tensors (a model that keeps some state on the CPU,
a `.to("cpu")` in the middle of a forward). Inductor splits such graphs by device; so does this
module, with PyTorch's own partitioner (`CapabilityBasedPartitioner`): the largest groups of
nodes that a program can run -- ops with a lowering, all of whose tensors are on `tpu` (0-dim
host tensors may be read, as everywhere) -- become one `CompiledGraph` each, and the other nodes
stay in the outer graph, which runs them as ATen calls where their tensors are: host ops on the
host, ops without a lowering through the tpu eager kernels, copies between devices as copies,
and collectives (`_c10d_functional`, what `torch.distributed`'s functional collectives and
DTensor write into graphs) through their process group, as in eager mode: tpu_dist runs each as
a collective of its own.
A piece whose inputs come from such nodes takes the whole graph's bounded dimensions
(`bucketing.bounded_like`, which the compiler wraps each split graph's call in).
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx
from torch._ops import OpOverload
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from torchtpu.exec import graph as fx_graph

PIECE_PREFIX = "tpu_piece_"


def _tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in torch.utils._pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _host_scalar(t: torch.Tensor) -> bool:
    """A 0-dim host tensor, which a program reads as a runtime value (`opcall.HostRef`)."""
    return t.device.type == "cpu" and t.dim() == 0


def _unlowered(node: torch.fx.Node) -> bool:
    """Whether `node` is an ATen call that no program runs for want of a lowering."""
    return node.op == "call_function" and isinstance(node.target, OpOverload) and not fx_graph.is_lowered(node)


def needs_split(gm: torch.fx.GraphModule) -> bool:
    """Whether `gm` has a node that no program can run: an op without a lowering, or a value
    that is a host tensor other than a 0-dim one."""
    return any(
        _unlowered(node) or any(t.device.type != "tpu" and not _host_scalar(t) for t in _tensors(node.meta.get("val")))
        for node in gm.graph.nodes
    )


def missing_lowerings(gm: torch.fx.GraphModule) -> list[str]:
    """The ops of `gm` that stay out of its programs only for want of a lowering (not the ones
    on host tensors, copies between devices, nor collectives, which their process group runs)."""
    return sorted({str(node.target) for node in gm.graph.nodes
                   if _unlowered(node) and _on_tpu(node) and node.target.namespace != "_c10d_functional"})


def _on_tpu(node: torch.fx.Node) -> bool:
    """Whether `node` makes tpu tensors (at least one) from tpu tensors and 0-dim host ones."""
    inputs = _tensors(torch.fx.node.map_arg((node.args, node.kwargs), lambda arg: arg.meta.get("val")))
    outputs = _tensors(node.meta.get("val"))
    return bool(outputs) and all(t.device.type == "tpu" for t in outputs) and all(
        t.device.type == "tpu" or _host_scalar(t) for t in inputs
    )


def runs_in_program(node: torch.fx.Node) -> bool:
    """Whether a program can run `node` of a graph that is split: an ATen op with a lowering
    whose tensors are on `tpu` (its inputs may include 0-dim host tensors), or a `getitem` of
    such an op's results."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        source = node.args[0]
        return isinstance(source, torch.fx.Node) and runs_in_program(source)
    return isinstance(node.target, OpOverload) and fx_graph.is_lowered(node) and _on_tpu(node)


class _Support(OperatorSupportBase):
    def is_node_supported(self, submodules: Any, node: torch.fx.Node) -> bool:
        return runs_in_program(node)


class _Piece(torch.nn.Module):
    """A group of nodes the outer graph calls as one module, run as one compiled program."""

    def __init__(self, compiled: Callable[..., list]) -> None:
        super().__init__()
        self.compiled = compiled

    def forward(self, *args: Any) -> tuple:
        return tuple(self.compiled(*args))


def split(gm: torch.fx.GraphModule, compile_piece: Callable[[torch.fx.GraphModule], Callable[..., list]]
          ) -> tuple[torch.fx.GraphModule, int]:
    """`gm` with every group of nodes a program can run replaced by a call of
    `compile_piece(group as a graph)`, and how many groups there are."""
    partitions = CapabilityBasedPartitioner(gm, _Support(), allows_single_node_partition=True).propose_partitions()
    outer = fuse_by_partitions(gm, [p.nodes for p in partitions], prefix=PIECE_PREFIX, always_return_tuple=True)
    pieces = 0
    for name, module in list(outer.named_children()):
        if name.startswith(PIECE_PREFIX):
            setattr(outer, name, _Piece(compile_piece(module)))
            pieces += 1
    outer.recompile()
    return outer, pieces
