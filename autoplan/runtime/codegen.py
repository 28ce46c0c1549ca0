"""Pass 5 — apply: the plan becomes an executable per-rank program with explicit collectives.

Contract
--------
Input: the traced joint graph and an assignment ``node name -> Strategy`` (from the plan).
Output: a :class:`GeneratedProgram` whose ``graph_module`` has the same signature as the traced
step, runs on DTensors (parameters and inputs in their planned placements) and contains, before
every argument whose producer's placement differs from what the consumer needs, the chain of
single-axis steps of :func:`autoplan.cost_models.comm.plan_transition` as explicit calls
(``all_gather``, ``all_reduce``, ``reduce_scatter``, ``all_to_all``, ``shard``, ``to_partial``).
Gradient all-reduces with the same transition are coalesced into one ``all_reduce_coalesced``
per mesh axis at the end (one flat buffer, as DDP buckets gradients); every other gradient
conversion (e.g. the reduce-scatter of a sharded parameter's gradient) runs right after the
gradient is produced, so its full-size partial is freed at once. A frozen parameter has no
gradient output (``TracedProgram.trainable_names``), so no collective for it either.

:func:`autoplan.passes.redistribute.edge_redistributions` lists those same transitions as data;
the planner prices exactly this list and the program contains exactly these calls, nothing else.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Shard
from torch.fx.node import Argument
from torch.utils import _pytree as pytree

from autoplan.cost_models.comm import TransitionStep
from autoplan.passes.placement import Spec
from autoplan.passes.redistribute import OUTPUT, Redistribution, edge_redistributions
from autoplan.passes.strategies import Strategy, resolve_value, tensor_args
from autoplan.passes.trace import TracedProgram, param_node_name
from autoplan.runtime import collectives as runtime


@dataclass(frozen=True, slots=True)
class GeneratedProgram:
    graph_module: fx.GraphModule
    redistributions: tuple[Redistribution, ...]


STEP_FN: dict[str, Callable[..., Any]] = {
    "all_gather": runtime.all_gather,
    "all_reduce": runtime.all_reduce,
    "reduce_scatter": runtime.reduce_scatter,
    "all_to_all": runtime.all_to_all,
    "shard": runtime.shard,
    "to_partial": runtime.to_partial,
}
"""Transition step kind (:class:`~autoplan.cost_models.comm.TransitionStep`) -> the collective that runs it."""


def _emit_steps(graph: fx.Graph, x: fx.Node, steps: tuple[TransitionStep, ...], axis_names: tuple[str, ...]) -> fx.Node:
    for st in steps:
        kwargs: dict[str, Argument] = {"axis": st.axis}
        if isinstance(st.dst, Shard) and st.kind in ("reduce_scatter", "all_to_all", "shard"):
            kwargs["dim"] = st.dst.dim
        if st.kind == "to_partial" and isinstance(st.dst, Partial) and st.dst.reduce_op != "sum":
            kwargs["reduce_op"] = st.dst.reduce_op
        x = graph.create_node("call_function", STEP_FN[st.kind], (x,), kwargs, name=f"{st.kind}_{axis_names[st.axis]}")
    return x


def _fix_device(kwargs: dict[str, Argument], device: torch.device) -> dict[str, Argument]:
    if "device" in kwargs:
        kwargs = {**kwargs, "device": device}
    return kwargs


def _replace_tensor_args(
    args: tuple[Argument, ...], converted: Iterator[fx.Node], env: Mapping[fx.Node, fx.Node]
) -> tuple[Argument, ...]:
    """``args`` with each tensor node replaced, in flatten order, by the next converted node."""

    def remap(a: object) -> object:
        if isinstance(a, fx.Node):
            return next(converted) if isinstance(a.meta.get("val"), torch.Tensor) else env[a]
        return a

    return pytree.tree_map(remap, args, is_leaf=lambda a: isinstance(a, fx.Node))


def _is_dtensor_input(node: fx.Node) -> bool:
    return node.op == "placeholder"


def generate_program(
    traced: TracedProgram,
    assignment: Mapping[str, Strategy],
    *,
    fallback_nodes: frozenset[str],
    axis_names: tuple[str, ...],
    device: torch.device,
    mesh: DeviceMesh | None = None,
    defer_grad_conversions: bool = False,
) -> GeneratedProgram:
    """Build the per-rank program (see the module docstring).

    ``defer_grad_conversions=True`` returns every parameter gradient as its producer made it (no
    conversion, no bucket): the caller runs the gradient :class:`Redistribution` steps itself,
    e.g. once after accumulating micro-batches (exact: every step is linear)."""
    src_gm = traced.graph_module
    redistributions = edge_redistributions(traced, assignment, len(axis_names))
    emit = _ProgramEmitter(
        traced,
        assignment,
        {(r.consumer, r.arg_index): r for r in redistributions},
        fallback_nodes=fallback_nodes,
        axis_names=axis_names,
        device=device,
        defer_grad_conversions=defer_grad_conversions,
    )
    for node in src_gm.graph.nodes:
        if node.op == "output":
            emit.output(node)
        elif node.op != "call_function" or node.target is operator.getitem or node.name not in assignment:
            emit.copy(node)
        else:
            emit.planned_op(node)
    root = torch.nn.Module()
    for n in emit.graph.nodes:
        if n.op == "get_attr" and n.target != "device_mesh":
            setattr(root, n.target, getattr(src_gm, n.target))
    root.device_mesh = mesh  # type: ignore[assignment]  # read by the program's get_attr
    gm = fx.GraphModule(root, emit.graph, class_name="AutoplanStep")
    gm.recompile()
    return GeneratedProgram(graph_module=gm, redistributions=tuple(redistributions))


class _ProgramEmitter:
    """Builds the generated graph node by node, in the traced program's order: each node is
    copied (:meth:`copy`), emitted with the conversions of its arguments (:meth:`planned_op`), or,
    for the output, with the loss and gradient conversions (:meth:`output`)."""

    def __init__(
        self,
        traced: TracedProgram,
        assignment: Mapping[str, Strategy],
        by_edge: Mapping[tuple[str, int], Redistribution],
        *,
        fallback_nodes: frozenset[str],
        axis_names: tuple[str, ...],
        device: torch.device,
        defer_grad_conversions: bool,
    ) -> None:
        self.traced = traced
        self.assignment = assignment
        self.by_edge = by_edge
        self.fallback_nodes = fallback_nodes
        self.axis_names = axis_names
        self.device = device
        self.defer_grad_conversions = defer_grad_conversions
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.mesh_node: fx.Node | None = None
        # gradients that are not bucketed are converted right after they are produced, so a partial
        # (full-size) gradient is freed at once instead of living to the end of the backward
        output_node = next(n for n in traced.graph_module.graph.nodes if n.op == "output")
        self.grad_conversions: dict[fx.Node, list[tuple[int, Redistribution]]] = {}
        for i, (pname, g) in enumerate(zip(traced.trainable_names, output_node.args[0][1:], strict=True)):
            r = by_edge.get((param_node_name(pname), -1))
            if r is not None and r.bucket is None and not defer_grad_conversions:
                self.grad_conversions.setdefault(g, []).append((i, r))
        self.converted_grads: dict[int, fx.Node] = {}
        """Trainable parameter index -> its gradient converted right after production."""

    def _convert_grads(self, node: fx.Node) -> None:
        for i, r in self.grad_conversions.get(node, ()):
            self.converted_grads[i] = _emit_steps(self.graph, self.env[node], r.steps, self.axis_names)

    def copy(self, node: fx.Node) -> None:
        """A placeholder, constant, ``getitem`` or unplanned op: copied as it is (on ``device``)."""
        new = self.graph.node_copy(node, lambda n: self.env[n])
        if node.op == "call_function":
            new.kwargs = _fix_device(dict(new.kwargs), self.device)
        self.env[node] = new
        self._convert_grads(node)

    def planned_op(self, node: fx.Node) -> None:
        """A planned op: its arguments converted to the placements its strategy needs, then the op
        (run on the replicated values for a fallback node), tagged with its output placements."""
        graph, env = self.graph, self.env
        converted: list[fx.Node] = []
        for i, a in enumerate(tensor_args(node)):
            r = self.by_edge.get((node.name, i))
            x = env[a]
            if r is not None and resolve_value(a).node not in self.assignment and not _is_dtensor_input(a):
                # a constant (plain tensor, same on every rank) needed sharded: wrap, then slice
                if self.mesh_node is None:
                    self.mesh_node = graph.get_attr("device_mesh")
                x = graph.create_node(
                    "call_function", runtime.replicate, (x, self.mesh_node), {}, name=f"{a.name}_replicated"
                )
            converted.append(_emit_steps(graph, x, r.steps, self.axis_names) if r is not None else x)
        new_args = _replace_tensor_args(node.args, iter(converted), env)
        new_kwargs = _fix_device(dict(fx.node.map_arg(node.kwargs, lambda n: env[n])), self.device)
        if node.name in self.fallback_nodes:
            op = cast(Argument, node.target)  # an OpOverload: fx passes a callable argument through as it is
            new = graph.create_node(
                "call_function", runtime.replicated_call, (op, *new_args), new_kwargs, name=node.name
            )
        else:
            new = graph.create_node("call_function", node.target, tuple(new_args), new_kwargs, name=node.name)
        new.meta = dict(node.meta)
        strat = self.assignment[node.name]
        new.meta["autoplan.output_specs"] = strat.output_specs
        env[node] = new
        self._convert_grads(node)

    def output(self, node: fx.Node) -> None:
        """The output: the loss converted to replicated, each gradient converted (already, right
        after production, or here in coalesced all-reduces per bucket)."""
        graph, env, trainable_names = self.graph, self.env, self.traced.trainable_names
        loss, *grads = cast("tuple[fx.Node, ...]", node.args[0])
        new_loss = env[loss]
        r = self.by_edge.get((OUTPUT, -1))
        if r is not None:
            new_loss = _emit_steps(graph, new_loss, r.steps, self.axis_names)
        new_grads: list[fx.Node] = []
        buckets: dict[str, list[int]] = {}
        for i, (pname, g) in enumerate(zip(trainable_names, grads, strict=True)):
            r = self.by_edge.get((param_node_name(pname), -1))
            if r is not None and r.bucket is not None and not self.defer_grad_conversions:
                buckets.setdefault(r.bucket, []).append(i)
            new_grads.append(self.converted_grads.get(i, env[g]))
        for members in buckets.values():
            r = self.by_edge[(param_node_name(trainable_names[members[0]]), -1)]
            group = [new_grads[i] for i in members]
            for st in r.steps:
                red = graph.create_node(
                    "call_function",
                    runtime.all_reduce_coalesced,
                    (tuple(group),),
                    {"axis": st.axis},
                    name=f"all_reduce_coalesced_{self.axis_names[st.axis]}",
                )
                group = [graph.call_function(operator.getitem, (red, j)) for j in range(len(members))]
            for i, reduced in zip(members, group, strict=True):
                new_grads[i] = reduced
        graph.output((new_loss, *new_grads))


def expected_output_placements(gm: fx.GraphModule) -> dict[str, Spec]:
    """Planned output spec of every op node of a generated program (for checked execution)."""
    out = {}
    for n in gm.graph.nodes:
        specs = n.meta.get("autoplan.output_specs")
        if specs and specs[0] is not None:
            out[n.name] = specs[0]
    return out
