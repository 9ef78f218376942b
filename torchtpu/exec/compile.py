"""`torch.compile(model, backend="tpu")`: AOTAutograd graphs compiled to XLA.

Dynamo captures the model; AOTAutograd turns it into functional ATen forward and backward graphs
(decomposing what the registry does not lower). Each graph becomes one Program over its inputs'
storages -- the graph's nodes call the same registry lowerings as the eager executors
(`torchtpu.exec.graph`) -- and runs through the current eager executor: strict mode jits it, defer
mode records it as one node of the pending graph, so compiled regions fuse with the eager code
around them. Graph breaks and the optimizer step outside the graph simply run eagerly. A call that
repeats a plain call's layout is run or recorded from C++ (`fast_dispatch.graph_call`).
New outputs are laid out as PyTorch lays out the eager results (their strides, as Inductor keeps
them). Outputs that are inputs as they came in (the forward's saved inputs) are returned as those very
tensors, not copies; an input the graph `copy_`s into (state a backward writes, the parameters a
compiled optimizer step updates) is written in place.

A graph that touches no `tpu` tensor (host code inside a compiled model: TorchRec checking a KJT
that stays on the host) runs as Dynamo captured it, on the CPU, where its tensors are; it is
counted in `torchtpu.metrics()["compiled_graphs_on_host"]`. A graph with nodes no program can run
-- ops on host tensors beside the `tpu` ones, ops without a lowering -- is split (`split`): each
group of the other nodes is compiled, those nodes run eagerly where their tensors are; counted in
`torchtpu.metrics()["compiled_graphs_split"]`, and warned of when an op lacks a lowering.
"""

from __future__ import annotations

import itertools
import math
import warnings
from typing import Any, Sequence

import torch
import torch.fx

from torchtpu import counters, precision, random as tpu_random, runtime
from torchtpu.exec import bucketing, fast_dispatch, opcall, split
from torchtpu.exec import graph as fx_graph
from torchtpu.exec.opcall import HostRef, NewTensor, Program, TensorRef
from torchtpu.ops import decomps, dynamo_prims  # noqa: F401  (the prims Dynamo writes into graphs)

_graph_ids = itertools.count()


def _skip_backend_frames() -> None:
    """Dynamo must not trace the backend's own Python (torchtpu's kernels, JAX) when a compiled
    function runs tpu ops eagerly after a graph break -- except a JAX kernel's call, which is
    the op itself."""
    from torch._dynamo import trace_rules

    from torchtpu.kernels.bridge import JaxKernel

    for module in ("torchtpu", "jax", "jaxlib"):
        trace_rules.add(module)
    JaxKernel.trace_calls_under_dynamo()


_skip_backend_frames()


class GraphCall(opcall.Inputs):
    """One call of a compiled graph, shaped like an op call for the executors.

    With a bucketing plan (`buckets`) the arguments are at bucket size, and the bounded
    dimensions' true sizes are runtime values (after the HostRef values, before the RNG key).
    `plan` is the layout's Plan (as for an op's Call), once the graph has seen the layout."""

    __slots__ = ("graph", "refs", "key", "values", "buckets", "n_sizes", "plan")

    def __init__(self, compiled: "CompiledGraph", args: Sequence[Any],
                 buckets: bucketing.CallPlan | None = None) -> None:
        super().__init__(f"compiled graph {compiled.name}")
        self.graph = compiled
        self.values = list(args)
        self.buckets = buckets
        self.plan = None
        self.refs = tuple(
            self.tensor(a) if isinstance(a, torch.Tensor) else opcall._freeze(a) for a in args
        )
        if self.device is None:
            self.device = opcall.current_device()
        sizes = buckets.true_sizes() if buckets is not None else []
        self.n_sizes = len(sizes)
        self.dynamic.extend(sizes)
        if compiled.random:
            self.dynamic.append(tpu_random.next_key_words(self.device))
        self.key = (compiled.name, precision.get_mode(), self.device, tuple(self.storages), self.refs,
                    buckets.key if buckets is not None else None)

    @classmethod
    def planned(cls, compiled: "CompiledGraph", args: Sequence[Any], plan: opcall.Plan,
                buffers: list, buckets: bucketing.CallPlan | None = None) -> "GraphCall":
        """The call for a layout the graph has seen (at these buckets): its key, storages and
        device from `plan`, its true sizes from `buckets`."""
        call = cls.__new__(cls)
        call.graph = compiled
        call.values = args
        call.buckets = buckets
        sizes = buckets.true_sizes() if buckets is not None else []
        call.n_sizes = len(sizes)
        call.plan = plan
        call.key = plan.key
        call.refs = plan.key[4]
        call.buffers = buffers
        call.storages = plan.storages
        call.device = plan.device
        call.dynamic = sizes + [tpu_random.next_key_words(plan.device)] if compiled.random else sizes
        return call

    def build(self) -> Program:
        return self.graph.program(self)


class CompiledGraph:
    """An AOTAutograd graph (forward or backward) compiled for tpu."""

    def __init__(self, gm: torch.fx.GraphModule, kind: str) -> None:
        self.gm = gm
        self.name = f"{kind}_graph_{next(_graph_ids)}"
        self.random = fx_graph.needs_rng(gm)
        self.aliases = fx_graph.aliased_outputs(gm)
        self.host_written = fx_graph.host_written_inputs(gm)
        self.written = frozenset(fx_graph.written_inputs(gm))
        nodes = list(gm.graph.nodes)
        self.input_metas = [node.meta.get("val") for node in nodes if node.op == "placeholder"]
        output = nodes[-1].args[0]
        self.output_metas = [
            node.meta.get("val") if isinstance(node, torch.fx.Node) else node
            for node in (output if isinstance(output, (list, tuple)) else (output,))
        ]
        self.symbolic_inputs = bucketing.SymbolicInputs(self.input_metas)
        self.symbolic = bool(self.symbolic_inputs.symints or self.symbolic_inputs.tensors)
        self.plans = opcall.plan_table()
        # Calls of known layouts are done from C++ (`fast_dispatch.graph_call`), as op calls are.
        plain = not (self.symbolic or self.host_written)
        self.fast = fast_dispatch.graph_cache() if plain else None

    def __call__(self, *args: Any) -> Any:
        from torchtpu.exec.kernels import submit

        if not self.symbolic:
            key = None
            if self.fast is not None:
                result = fast_dispatch.graph_call(self.fast, args)
                if type(result) is list:  # done from C++
                    return result
                key = result  # bytes: a layout C++ has not seen, which it learns from this call
            call = self._call(args)
            outs = self._write_host_inputs(args, submit(call))
            if key is not None:
                fast_dispatch.learn_graph(self.fast, key, call)
            return outs
        buckets = bucketing.plan_call(self.symbolic_inputs, args, self.written)
        outs = self._write_host_inputs(args, submit(self._call(buckets.args, buckets)))
        for position, argument in self.aliases.items():
            outs[position] = args[argument]
        return [buckets.unpad(out, meta) for out, meta in zip(outs, self.output_metas)]

    def _write_host_inputs(self, args: Sequence[Any], outs: list) -> list:
        """Copy the new values of the CPU inputs the graph writes (its last outputs) into them."""
        if not self.host_written:
            return outs
        count = len(self.host_written)
        for position, value in zip(self.host_written, outs[-count:]):
            args[position].copy_(value)
        return outs[:-count]

    def _call(self, args: Sequence[Any], buckets: bucketing.CallPlan | None = None) -> GraphCall:
        """The graph's call on `args` (at `buckets`' sizes, for a bounded call). As an op's
        Encoder does, each argument layout is encoded in full once; later calls with that layout
        (and buckets) read each argument once and reuse its Plan (compile key, and what the
        executors derived from it)."""
        try:
            layout, buffers = self._layout(args)
        except opcall.GeneralEncoding:
            return GraphCall(self, args, buckets)
        if buckets is not None:
            layout = (layout, buckets.key)
        plan = self.plans.get(layout)
        if plan is not None:
            return GraphCall.planned(self, args, plan, buffers, buckets)
        call = GraphCall(self, args, buckets)
        if (
            len(buffers) == len(call.buffers)
            and all(a is b for a, b in zip(buffers, call.buffers))
            and not any(spec.sharded for spec in call.storages)
        ):
            call.plan = self.plans[layout] = opcall.Plan(call)
        return call

    @staticmethod
    def _layout(args: Sequence[Any]) -> tuple[tuple, list]:
        """What decides a call's compile key: each tpu tensor's storage (which earlier argument
        shares it), dtype and geometry, every other argument's value, the storages, the
        precision mode. Raises GeneralEncoding for arguments only `GraphCall` reads (CPU
        tensors, sharded or untyped storages) and for calls without tpu tensors."""
        buffers: list = []
        seen: dict[int, int] = {}
        parts = []
        for a in args:
            if isinstance(a, torch.Tensor):
                parts.append(opcall.tensor_layout(a, buffers, seen))
            else:
                parts.append((type(a), opcall._freeze(a)))
        if not buffers:
            raise opcall.GeneralEncoding
        return (precision.get_mode(), tuple(parts), opcall.storages_layout(buffers)), buffers

    def program(self, call: GraphCall) -> Program:
        import jax

        storages = call.storages
        refs = call.refs
        inputs = tuple(i for i, spec in enumerate(storages) if spec.initialized)
        mode, platform = call.key[1], runtime.runtime().platform
        gm, random = self.gm, self.random
        n_dynamic = len(call.dynamic)
        trace_sizes = call.buckets.sizes_for_trace() if call.buckets is not None else None
        n_sizes = call.n_sizes

        def values_of(flat_inputs):
            import jax.numpy as jnp

            from torchtpu import dtypes

            buffers = opcall.storage_values(storages, inputs, flat_inputs)
            dyn = flat_inputs[len(inputs):]
            values = []
            for ref in refs:
                if isinstance(ref, TensorRef):
                    values.append(opcall.read_tensor(buffers[ref.storage], ref))
                elif isinstance(ref, HostRef):
                    values.append(jnp.asarray(dyn[ref.slot], dtypes.to_jax(ref.dtype)))
                else:
                    values.append(ref)
            rng = dyn[n_dynamic - 1] if random else None
            sizes = dyn[n_dynamic - n_sizes - int(random):n_dynamic - int(random)]
            padding = bucketing.Padding(trace_sizes, sizes) if trace_sizes is not None else None
            return values, rng, buffers, padding

        check_messages: list[str] = []
        written_inputs: list[int] = []
        host_written = self.host_written

        def run(*flat_inputs):
            values, rng, buffers, padding = values_of(flat_inputs)
            found: list = []
            writes: dict[int, Any] = {}
            outs = fx_graph.interpret(
                gm, values, precision=mode, platform=platform, rng_words=rng, checks=found, writes=writes,
                padding=padding,
            )
            check_messages[:] = [message for _, message in found]
            written_inputs[:] = [i for i in sorted(writes) if i not in host_written]
            written = tuple(
                opcall.write_tensor(buffers[refs[i].storage], refs[i], writes[i]) for i in written_inputs
            )
            outs = list(outs) + [writes[i] for i in host_written]
            return outs, tuple(flag for flag, _ in found), written

        # Output metadata from an abstract trace (shapes are concrete for this key).
        from torchtpu import dtypes as tpu_dtypes

        avals = [
            jax.ShapeDtypeStruct((storages[i].numel,), tpu_dtypes.to_jax(storages[i].dtype))
            for i in inputs
        ] + [jax.ShapeDtypeStruct(getattr(v, "shape", ()), getattr(v, "dtype", None) or type(v))
             for v in call.dynamic]
        abstract, _, _ = jax.eval_shape(run, *avals)
        for i in written_inputs:
            if not isinstance(refs[i], TensorRef):
                raise fx_graph.UnsupportedNode(f"{self.name} copies into input {i}, which is not a tpu tensor")
        written = tuple(refs[i].storage for i in written_inputs)
        new: list[NewTensor] = []
        template = []
        array_positions = []
        metas = [*self.output_metas, *(None for _ in host_written)]
        for position, (out, meta) in enumerate(zip(abstract, metas)):
            if position in self.aliases:
                template.append(("arg", self.aliases[position]))
            elif isinstance(out, jax.ShapeDtypeStruct):
                sizes = tuple(out.shape)
                dtype = tpu_dtypes.from_jax(out.dtype)
                # Laid out as PyTorch lays the result out (eager's strides, as Inductor keeps them).
                new.append(NewTensor(sizes, opcall.strides_like(meta, sizes), dtype, math.prod(sizes)))
                template.append(("new", len(new) - 1))
                array_positions.append(position)
            else:
                template.append(("const", out))

        def program(*flat_inputs):
            outs, flags, written_values = run(*flat_inputs)
            fresh = tuple(opcall.write_new(outs[p], spec) for p, spec in zip(array_positions, new))
            return written_values + fresh + flags

        return Program(program, inputs, written, tuple(new), ("list", tuple(template)), call.key,
                       tuple(check_messages))


def _compiler(kind: str):
    def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]):
        from torch._functorch.aot_autograd import make_boxed_func

        counters.count("compiled_graphs")
        if not split.needs_split(gm):
            return make_boxed_func(CompiledGraph(gm, kind))
        missing = split.missing_lowerings(gm)
        outer, pieces = split.split(gm, lambda piece: CompiledGraph(piece, kind))
        counters.count("compiled_graphs_split")
        if missing:
            warnings.warn(
                f"torch.compile(backend='tpu'): {kind} graph with ops without a tpu lowering "
                f"({', '.join(missing)}); they run eagerly, the rest of the graph as {pieces} "
                "compiled piece(s)",
                stacklevel=2,
            )
        inputs = bucketing.SymbolicInputs([node.meta.get("val") for node in gm.graph.nodes
                                           if node.op == "placeholder"])

        def run_split(*args: Any) -> Any:
            with bucketing.bounded_like(inputs, args):
                return outer.forward(*args)

        return make_boxed_func(run_split)

    return compile_graph


def _touches_tpu(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
    """Whether any input or any value the graph makes is a `tpu` tensor (Dynamo records each
    node's value as `example_value`)."""
    values = [*example_inputs, *(node.meta.get("example_value") for node in gm.graph.nodes)]
    return any(
        isinstance(value, torch.Tensor) and value.device.type == "tpu"
        for value in torch.utils._pytree.tree_leaves(values)
    )


def tpu_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any):
    """The `torch.compile` backend named "tpu"."""
    from torch._dynamo.backends.common import aot_autograd

    if not _touches_tpu(gm, example_inputs):
        counters.count("compiled_graphs_on_host")
        return gm.forward

    backend = aot_autograd(
        fw_compiler=_compiler("forward"),
        bw_compiler=_compiler("backward"),
        inference_compiler=_compiler("inference"),
        decompositions=decomps.for_compile(),
        # In-place updates of graph inputs (a compiled `optimizer.step()` writing parameters
        # and state, BatchNorm's running statistics) stay in the graph as `copy_` into the
        # input, which the graph's program writes itself -- rather than one eager `copy_` per
        # mutated input after the graph (AOTAutograd's default; inductor keeps them too).
        keep_inference_input_mutations=True,
    )
    return backend(gm, example_inputs, **kwargs)
