"""The redistributions a chosen placement implies: every producer value whose placement differs
from what a consumer argument (or the step's output: the replicated loss, each gradient in its
parameter's placement) needs, with the chain of single-axis steps that converts it
(:func:`autoplan.cost_models.comm.plan_transition`).

Contract
--------
Input: the traced joint graph and an assignment ``node name -> Strategy``.
Output: the :class:`Redistribution` list, in graph order (:func:`edge_redistributions`); the
planner prices exactly this list (overlap, liveness) and the generated program
(:mod:`autoplan.runtime.codegen`) contains exactly these conversions. A plan that would convert a
tensor an op writes into is refused (:func:`check_no_converted_writes`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.fx as fx

from autoplan.cost_models.comm import TransitionStep, bucket_kind, plan_transition
from autoplan.cost_models.errors import PlanError
from autoplan.passes.placement import Spec, replicated, spec_str
from autoplan.passes.strategies import Strategy, ValueRef, resolve_value, tensor_args
from autoplan.passes.trace import TracedProgram, param_node_name, writes_an_argument, written_tensor_args

OUTPUT = "<output>"


@dataclass(frozen=True, slots=True)
class Redistribution:
    """One producer value converted for one consumer argument."""

    producer: ValueRef
    consumer: str
    """Consumer node name, ``<output>`` for the loss, or ``p_<param>`` for a gradient."""
    arg_index: int
    src: Spec
    dst: Spec
    steps: tuple[TransitionStep, ...]
    bucket: str | None = None
    """Gradient reductions with the same key run as one coalesced all-reduce per step."""

    def __str__(self) -> str:
        steps = " ".join(str(s) for s in self.steps)
        return f"{self.producer} -> {self.consumer}[{self.arg_index}]: {spec_str(self.src)}->{spec_str(self.dst)} ({steps})"


def _output_spec(assignment: Mapping[str, Strategy], ref: ValueRef, mesh_ndim: int) -> Spec:
    strat = assignment.get(ref.node)
    if strat is None:
        return replicated(mesh_ndim)
    spec = strat.output_specs[ref.index]
    assert spec is not None, ref
    return spec


def edge_redistributions(
    traced: TracedProgram, assignment: Mapping[str, Strategy], mesh_ndim: int
) -> list[Redistribution]:
    """Every transition the planned program performs, in graph order."""
    out: list[Redistribution] = []
    gm = traced.graph_module
    for node in gm.graph.nodes:
        if node.name not in assignment or node.op != "call_function":
            continue
        strat = assignment[node.name]
        for i, a in enumerate(tensor_args(node)):
            ref = resolve_value(a)
            src, dst = _output_spec(assignment, ref, mesh_ndim), strat.input_specs[i]
            if src != dst:
                out.append(Redistribution(ref, node.name, i, src, dst, plan_transition(src, dst)))
    output = next(n for n in gm.graph.nodes if n.op == "output")
    loss, *grads = output.args[0]
    rep = replicated(mesh_ndim)
    ref = resolve_value(loss)
    src = _output_spec(assignment, ref, mesh_ndim)
    if src != rep:
        out.append(Redistribution(ref, OUTPUT, -1, src, rep, plan_transition(src, rep)))
    for pname, g in zip(traced.trainable_names, grads, strict=True):
        pnode = param_node_name(pname)
        ref = resolve_value(g)
        src, dst = _output_spec(assignment, ref, mesh_ndim), assignment[pnode].output_specs[0]
        assert dst is not None
        if src != dst:
            steps = plan_transition(src, dst)
            kind = bucket_kind(steps)
            # members of one bucket share the collective: an all-reduce bucket the whole
            # transition, a reduce-scatter bucket the source layout and axis (the shard dims differ)
            bucket = (
                f"grad:{spec_str(src)}->{spec_str(dst)}"
                if kind == "all_reduce"
                else f"grad-rs:{spec_str(src)}@{steps[0].axis}"
                if kind == "reduce_scatter"
                else None
            )
            out.append(Redistribution(ref, pnode, -1, src, dst, steps, bucket))
    check_no_converted_writes(gm, out)
    return out


def _is_view(node: fx.Node) -> bool:
    """``node`` returns a view of its first argument (``slice``, ``view``, ``t``, ...)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    return len(returns) == 1 and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def check_no_converted_writes(gm: fx.GraphModule, redistributions: list[Redistribution]) -> None:
    """Refuse a plan that converts a tensor an op writes into (``copy_``, ``mul_``, ...), or the
    input of a view chain it writes through: a conversion makes a new tensor, the write would land
    in it and be lost while later readers see the unwritten original."""
    converted = {(r.consumer, r.arg_index): r for r in redistributions}
    for node in gm.graph.nodes:
        if not writes_an_argument(node):
            continue
        for i in written_tensor_args(node):
            consumer, index, arg = node, i, tensor_args(node)[i]
            while True:
                r = converted.get((consumer.name, index))
                if r is not None:
                    raise PlanError(
                        f"{node.name} ({node.target}) writes into {arg.name}, but the plan feeds {consumer.name} a "
                        f"converted copy of {r.producer} ({spec_str(r.src)} -> {spec_str(r.dst)}): the write would "
                        "be lost; re-plan the model with this autoplan (its trace makes in-place writes functional), "
                        "or write out of place in the model (torch.cat instead of copy_ into slices of a buffer)"
                    )
                if not _is_view(arg):
                    break
                consumer, index, arg = arg, 0, tensor_args(arg)[0]
