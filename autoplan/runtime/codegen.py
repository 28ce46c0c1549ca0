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
With ``accumulated_grad_inputs`` the program takes, after the traced step's arguments, one more
per trainable parameter with a gradient (:data:`ACCUMULATED_GRAD_META` names its FQN): that
gradient summed over earlier micro-batches, in the producer's placement; ``g + acc`` is emitted
right before the gradient's conversion (the last micro-batch of a step, as Megatron's gradient
buffer feeds its buckets).
A random op that draws by position (dropout's ``bernoulli_``, ``rand_like``, ...) runs through
:func:`autoplan.runtime.random_ops.global_draw`: every rank draws the global tensor, as one device
does, and keeps its shard (issue #46).

:func:`autoplan.passes.redistribute.edge_redistributions` lists those same transitions as data;
the planner prices exactly this list and the program contains exactly these calls, nothing else.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.fx.node import Argument
from torch.utils import _pytree as pytree

from autoplan.cost_models.comm import TransitionStep, bucket_kind
from autoplan.cost_models.comm_schedule import DEFAULT_POLICY, OverlapPolicy
from autoplan.passes.attention import RING_OPS, with_cp_group
from autoplan.passes.comm_order import START, CommSchedule, schedule_collectives
from autoplan.passes.layers import Layering, find_layers
from autoplan.passes.moe import MOE_OPS, with_ep_group
from autoplan.passes.placement import Spec
from autoplan.passes.random_ops import draws_by_position
from autoplan.passes.recompute import OP_META, TRANSITION_META
from autoplan.passes.redistribute import OUTPUT, Redistribution, edge_redistributions
from autoplan.passes.stages import ACCUMULATED_GRAD_META, stage_of_segment
from autoplan.passes.strategies import Strategy, resolve_value, tensor_args
from autoplan.passes.trace import TracedProgram, param_node_name
from autoplan.runtime import collectives as runtime
from autoplan.runtime.random_ops import global_draw


@dataclass(frozen=True, slots=True)
class GeneratedProgram:
    graph_module: fx.GraphModule
    redistributions: tuple[Redistribution, ...]
    schedule: CommSchedule
    """Where each redistribution is issued and waited for (what the planner prices)."""


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
        if isinstance(st.dst, _StridedShard) and st.kind == "shard":
            kwargs["dim"], kwargs["segments"] = st.dst.dim, st.dst.split_factor
        if st.kind == "to_partial" and isinstance(st.dst, Partial) and st.dst.reduce_op != "sum":
            kwargs["reduce_op"] = st.dst.reduce_op
        x = graph.create_node("call_function", STEP_FN[st.kind], (x,), kwargs, name=f"{st.kind}_{axis_names[st.axis]}")
        x.meta[TRANSITION_META] = (st.kind, st.axis)
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
    layering: Layering | None = None,
    policy: OverlapPolicy = DEFAULT_POLICY,
    accumulated_grad_inputs: bool = False,
    stage_starts: Sequence[int] | None = None,
    deferred_grads: frozenset[str] = frozenset(),
) -> GeneratedProgram:
    """Build the per-rank program (see the module docstring).

    ``defer_grad_conversions=True`` returns every parameter gradient as its producer made it (no
    conversion, no bucket): the caller runs the gradient :class:`Redistribution` steps itself,
    e.g. once after accumulating micro-batches (exact: every step is linear).
    ``accumulated_grad_inputs=True`` adds the trailing arguments of the earlier micro-batches'
    summed raw gradients, added to each gradient before its conversion (module docstring).
    ``stage_starts``: the program will be cut into these pipeline stages
    (:func:`~autoplan.passes.stages.split_stages`): no prefetch window and no gradient bucket
    spans two of them. ``deferred_grads``: FQNs whose gradients stay raw even when the others are
    converted (a parameter tied across stages: the caller converts each stage's copy after the
    schedule); they take no accumulated-gradient argument."""
    src_gm = traced.graph_module
    redistributions = edge_redistributions(traced, assignment, len(axis_names))
    if layering is None:
        layering = find_layers(traced)
    schedule = schedule_collectives(
        src_gm,
        redistributions,
        layering.segment_of,
        mesh_shape=tuple(mesh.shape) if mesh is not None else (),
        policy=policy,
        stage_of_segment=None if stage_starts is None else stage_of_segment(layering, stage_starts),
        deferred_grads=frozenset(param_node_name(f) for f in deferred_grads),
    )
    emit = _ProgramEmitter(
        traced,
        assignment,
        redistributions,
        schedule,
        fallback_nodes=fallback_nodes,
        axis_names=axis_names,
        device=device,
        defer_grad_conversions=defer_grad_conversions,
        accumulated_grad_inputs=accumulated_grad_inputs,
        mesh=mesh,
        deferred_grads=deferred_grads,
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
    return GeneratedProgram(graph_module=gm, redistributions=tuple(redistributions), schedule=schedule)


class _ProgramEmitter:
    """Builds the generated graph node by node, in the traced program's order: each node is
    copied (:meth:`copy`) or emitted with its converted arguments (:meth:`planned_op`); after each
    node, the conversions the :class:`~autoplan.passes.comm_order.CommSchedule` issues there are
    emitted (:meth:`_issue`); the output gets the converted loss and gradients (:meth:`output`)."""

    def __init__(
        self,
        traced: TracedProgram,
        assignment: Mapping[str, Strategy],
        redistributions: list[Redistribution],
        schedule: CommSchedule,
        *,
        fallback_nodes: frozenset[str],
        axis_names: tuple[str, ...],
        device: torch.device,
        defer_grad_conversions: bool,
        accumulated_grad_inputs: bool = False,
        mesh: DeviceMesh | None = None,
        deferred_grads: frozenset[str] = frozenset(),
    ) -> None:
        self.traced = traced
        self.deferred = frozenset(i for i, f in enumerate(traced.trainable_names) if f in deferred_grads)
        """Trainable parameter indices whose gradients leave raw (``generate_program(deferred_grads=)``)."""
        self.mesh = mesh
        self.assignment = assignment
        self.redistributions = redistributions
        self.by_edge = {(r.consumer, r.arg_index): r for r in redistributions}
        self.schedule = schedule
        self.issue_after = schedule.issued_after()
        self.fallback_nodes = fallback_nodes
        self.axis_names = axis_names
        self.device = device
        self.defer_grad_conversions = defer_grad_conversions
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.mesh_node: fx.Node | None = None
        self.node_by_name = {n.name: n for n in traced.graph_module.graph.nodes}
        output_node = next(n for n in traced.graph_module.graph.nodes if n.op == "output")
        self.grad_nodes: list[fx.Node] = list(output_node.args[0][1:])
        self.grad_index = {param_node_name(p): i for i, p in enumerate(traced.trainable_names)}
        self.converted: dict[tuple[str, int], fx.Node] = {}
        """(consumer, argument index) -> the argument converted at its issue point."""
        self.converted_grads: dict[int, fx.Node] = {}
        """Trainable parameter index -> its gradient converted at its issue point."""
        self.converted_loss: fx.Node | None = None
        self.started = False
        self.accumulated_grad_inputs = accumulated_grad_inputs
        self.accumulated: dict[int, fx.Node] = {}
        """Trainable parameter index -> the placeholder of its gradient summed over earlier micro-batches."""
        self.summed_grads: dict[int, fx.Node] = {}
        """Trainable parameter index -> ``g + acc`` (emitted once, before the gradient's conversion)."""

    def _grad(self, i: int) -> fx.Node:
        """Trainable parameter ``i``'s gradient as its conversion reads it: the producer's value,
        plus the earlier micro-batches' sum where the program takes it."""
        if i not in self.accumulated:
            return self.env[self.grad_nodes[i]]
        if i not in self.summed_grads:
            self.summed_grads[i] = self.graph.call_function(
                torch.ops.aten.add.Tensor, (self.env[self.grad_nodes[i]], self.accumulated[i])
            )
        return self.summed_grads[i]

    def _add_accumulated_placeholders(self) -> None:
        """After the traced step's arguments: one per trainable parameter with a gradient."""
        fqns = self.traced.trainable_names
        for i, g in enumerate(self.grad_nodes):
            if isinstance(g, fx.Node) and i not in self.deferred:
                ph = self.graph.placeholder(f"acc_{param_node_name(fqns[i])}")
                ph.meta[ACCUMULATED_GRAD_META] = fqns[i]
                self.accumulated[i] = ph

    def _needs_replicate(self, a: fx.Node) -> bool:
        """A constant (plain tensor, same on every rank) that a consumer needs converted."""
        return resolve_value(a).node not in self.assignment and not _is_dtensor_input(a)

    def _issue(self, name: str) -> None:
        """Emit the conversions the schedule issues right after node ``name``."""
        for slot in self.issue_after.get(name, ()):
            r = self.redistributions[slot.index]
            if r.consumer == OUTPUT:
                self.converted_loss = _emit_steps(
                    self.graph, self.env[self.node_by_name[slot.issue_after]], r.steps, self.axis_names
                )
            elif r.arg_index >= 0 and slot.bucket is not None:
                self._emit_gather(self.schedule.buckets[slot.bucket])
            elif r.arg_index >= 0:
                a = tensor_args(self.node_by_name[r.consumer])[r.arg_index]
                if not self._needs_replicate(a):  # (constants are wrapped and converted at the consumer)
                    self.converted[(r.consumer, r.arg_index)] = _emit_steps(
                        self.graph, self.env[a], r.steps, self.axis_names
                    )
            elif not self.defer_grad_conversions:
                if slot.bucket is None:
                    i = self.grad_index[r.consumer]
                    if i not in self.deferred:
                        self.converted_grads[i] = _emit_steps(self.graph, self._grad(i), r.steps, self.axis_names)
                else:
                    self._emit_bucket(self.schedule.buckets[slot.bucket])

    def _emit_bucket(self, members: tuple[int, ...]) -> None:
        """One coalesced all-reduce per step of the members' (common) transition, or one coalesced
        reduce-scatter (:func:`~autoplan.cost_models.comm.bucket_kind`)."""
        idx = [self.grad_index[self.redistributions[m].consumer] for m in members]
        group = [self._grad(i) for i in idx]
        first = self.redistributions[members[0]].steps
        if bucket_kind(first) == "reduce_scatter":
            dims = []
            for m in members:
                dst = self.redistributions[m].steps[0].dst
                assert isinstance(dst, Shard)
                dims.append(dst.dim)
            red = self.graph.create_node(
                "call_function",
                runtime.reduce_scatter_coalesced,
                (tuple(group),),
                {"axis": first[0].axis, "dims": tuple(dims)},
                name=f"reduce_scatter_coalesced_{self.axis_names[first[0].axis]}",
            )
            for j, i in enumerate(idx):
                self.converted_grads[i] = self.graph.call_function(operator.getitem, (red, j))
            return
        for st in first:
            red = self.graph.create_node(
                "call_function",
                runtime.all_reduce_coalesced,
                (tuple(group),),
                {"axis": st.axis},
                name=f"all_reduce_coalesced_{self.axis_names[st.axis]}",
            )
            group = [self.graph.call_function(operator.getitem, (red, j)) for j in range(len(idx))]
        for i, reduced in zip(idx, group, strict=True):
            self.converted_grads[i] = reduced

    def _emit_gather(self, members: tuple[int, ...]) -> None:
        """A block's parameter gathers (one mesh axis) as one coalesced all-gather."""
        rs = [self.redistributions[m] for m in members]
        args = [tensor_args(self.node_by_name[r.consumer])[r.arg_index] for r in rs]
        axis = rs[0].steps[0].axis
        red = self.graph.create_node(
            "call_function",
            runtime.all_gather_coalesced,
            (tuple(self.env[a] for a in args),),
            {"axis": axis},
            name=f"all_gather_coalesced_{self.axis_names[axis]}",
        )
        red.meta[TRANSITION_META] = ("all_gather", axis)
        for j, r in enumerate(rs):
            self.converted[(r.consumer, r.arg_index)] = self.graph.call_function(operator.getitem, (red, j))

    def _start(self, node: fx.Node) -> None:
        if not self.started and node.op != "placeholder":
            self.started = True
            if self.accumulated_grad_inputs:
                self._add_accumulated_placeholders()
            self._issue(START)

    def copy(self, node: fx.Node) -> None:
        """A placeholder, constant, ``getitem`` or unplanned op: copied as it is (on ``device``)."""
        self._start(node)
        new = self.graph.node_copy(node, lambda n: self.env[n])
        if node.op == "call_function":
            new.kwargs = _fix_device(dict(new.kwargs), self.device)
        self.env[node] = new
        self._issue(node.name)

    def planned_op(self, node: fx.Node) -> None:
        """A planned op: its arguments converted to the placements its strategy needs, then the op
        (run on the replicated values for a fallback node), tagged with its output placements."""
        self._start(node)
        graph, env = self.graph, self.env
        converted: list[fx.Node] = []
        for i, a in enumerate(tensor_args(node)):
            r = self.by_edge.get((node.name, i))
            x = env[a]
            if (node.name, i) in self.converted:
                x = self.converted[(node.name, i)]
            elif r is not None:
                if self._needs_replicate(a):
                    # a constant (plain tensor, same on every rank) needed sharded: wrap, then slice
                    if self.mesh_node is None:
                        self.mesh_node = graph.get_attr("device_mesh")
                    x = graph.create_node(
                        "call_function", runtime.replicate, (x, self.mesh_node), {}, name=f"{a.name}_replicated"
                    )
                x = _emit_steps(graph, x, r.steps, self.axis_names)
            converted.append(x)
        new_args = _replace_tensor_args(node.args, iter(converted), env)
        if node.target in MOE_OPS:  # the plan's expert-parallel group, written into the op
            if self.mesh is None:
                raise ValueError(f"{node.name}: a mixture-of-experts op needs the mesh: pass mesh= to generate_program")
            new_args = with_ep_group(node, tuple(new_args), self.assignment[node.name].input_specs, self.mesh)
        if node.target in RING_OPS:  # the plan's context-parallel group, where attention runs a ring
            new_args = with_cp_group(node, tuple(new_args), self.assignment[node.name].input_specs, self.mesh)
        new_kwargs = _fix_device(dict(fx.node.map_arg(node.kwargs, lambda n: env[n])), self.device)
        if node.name in self.fallback_nodes:
            op = cast(Argument, node.target)  # an OpOverload: fx passes a callable argument through as it is
            new = graph.create_node(
                "call_function", runtime.replicated_call, (op, *new_args), new_kwargs, name=node.name
            )
        elif draws_by_position(node.target):  # the single-device draw, this rank's part kept
            op = cast(Argument, node.target)
            new = graph.create_node("call_function", global_draw, (op, *new_args), new_kwargs, name=node.name)
        else:
            new = graph.create_node("call_function", node.target, tuple(new_args), new_kwargs, name=node.name)
        new.meta = dict(node.meta)
        new.meta[OP_META] = node.target  # the op runtime.replicated_call or global_draw runs
        strat = self.assignment[node.name]
        new.meta["autoplan.output_specs"] = strat.output_specs
        env[node] = new
        self._issue(node.name)

    def output(self, node: fx.Node) -> None:
        """The output: the loss and each gradient as converted at their issue points."""
        loss, *grads = cast("tuple[fx.Node, ...]", node.args[0])
        new_loss = self.converted_loss if self.converted_loss is not None else self.env[loss]
        new_grads = [self.converted_grads[i] if i in self.converted_grads else self._grad(i) for i in range(len(grads))]
        self.graph.output((new_loss, *new_grads))


def expected_output_placements(gm: fx.GraphModule) -> dict[str, Spec]:
    """Planned output spec of every op node of a generated program (for checked execution)."""
    out = {}
    for n in gm.graph.nodes:
        specs = n.meta.get("autoplan.output_specs")
        if specs and specs[0] is not None:
            out[n.name] = specs[0]
    return out
