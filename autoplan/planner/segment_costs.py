r"""Pass — segment costs: the solved intra-operator plan, summed per layer segment.

Contract
--------
Input: the traced joint graph of ONE micro-batch, its :class:`~autoplan.passes.layers.Layering`, the
:class:`~autoplan.passes.costing.CostProblem` built for a stage mesh, and the ILP's chosen strategies.
Output: :class:`~autoplan.cost_models.step.SegmentCost` per segment (prologue, each block,
epilogue) and the bytes that cross each cut between consecutive segments — the plain numbers
:func:`autoplan.cost_models.step.evaluate` composes into stages for the pipeline search
(``autoplan.planner.search``)::

    fwd_s[k]   = sum_{v fwd op in k} t[v, s_v] + sum_{e into a fwd op of k} c[e, p_e, q_e]
    bwd_s[k]   = the same over backward ops
    bwd_weight_s[k] = the part of bwd_s no earlier segment's backward depends on (weight gradients)
    grad_sync_s[k] = sum_{p trainable param of k} c[grad(p) -> p] (once per step, not per micro-batch)
    saved_bytes[k] = sum_{storage a: born by a fwd op of k, read by a bwd op} b[a, s]
    cut_bytes[k]   = sum_{value born in segments <= k, read by a fwd op in segments > k} b[a, s]

A parameter read by several segments (tied embedding) is counted in the first one. All times
are per micro-batch on one device of the stage mesh, except ``grad_sync_s`` and
``optimizer_s`` (per step). Bytes are local (after sharding on the stage mesh).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.fx as fx

from autoplan.cost_models.compute import is_matmul, op_flops
from autoplan.cost_models.step import SegmentCost, SegmentCosts
from autoplan.passes import liveness
from autoplan.passes.costing import CostProblem, Edge
from autoplan.passes.layers import Layering
from autoplan.passes.placement import local_numel
from autoplan.passes.strategies import ValueRef, resolve_value, tensor_args


@runtime_checkable
class SegmentCostOracle(Protocol):
    """The per-segment costs the joint search (:func:`autoplan.planner.search.search`) prices its
    candidates with, keyed by ``(tp, microbatch_size)``, from an oracle that can compute many keys
    at once and tell which are in. :class:`~autoplan.planner.segment_model.SegmentCostModel`
    implements it; a plain ``Callable[[int, int], SegmentCosts]`` serves the search too (each key
    then computed when first asked for, nothing ahead)."""

    __slots__ = ()

    def __call__(self, tp: int, microbatch_size: int) -> SegmentCosts:
        """The costs of one micro-batch of ``microbatch_size`` samples on a tensor-parallel group
        of ``tp`` devices, computed now unless :meth:`ready`."""
        ...

    def ready(self, tp: int, microbatch_size: int) -> bool:
        """Whether ``self(tp, microbatch_size)`` answers without computing anything more."""
        ...

    def prefetch(self, keys: Iterable[tuple[int, int]], *, while_waiting: Callable[[], bool] | None = None) -> None:
        """Compute the costs of every key in ``keys`` now (in any order, in parallel where it can),
        so that later calls are :meth:`ready`. While it waits for results it calls
        ``while_waiting()`` (the search lays out the candidates whose costs are ready), between
        results, until that returns False. The costs are those ``self(tp, microbatch_size)``
        would give."""
        ...


def _chosen_specs(problem: CostProblem, choice: Mapping[str, int], edge: Edge) -> float:
    src = choice[edge.producer.node]
    dst_node = edge.consumer
    p = next((spec for spec, idx in edge.src_groups.items() if src in idx), None)
    if dst_node in choice:
        q = next((spec for spec, idx in edge.dst_groups.items() if choice[dst_node] in idx), None)
    else:
        q = next(iter(edge.dst_groups))
    if p is None or q is None:
        return 0.0
    return edge.cost_s.get((p, q), 0.0)


def segment_costs(
    gm: fx.GraphModule,
    layering: Layering,
    problem: CostProblem,
    choice: Mapping[str, int],
    *,
    param_nodes: Sequence[str],
    trainable_param_nodes: Sequence[str],
    optimizer: str,
) -> SegmentCosts:
    """Sum the chosen plan's costs per segment (see the module docstring). ``param_nodes`` are
    every parameter placeholder, ``trainable_param_nodes`` those the step returns a gradient for."""
    nseg = layering.num_segments
    seg_of = dict(layering.segment_of)
    for p, segs in layering.param_segments.items():
        seg_of[p] = segs[0]
    nodes = {n.name: n for n in gm.graph.nodes}
    phase = {n.name: n.meta.get("autoplan.phase") for n in gm.graph.nodes}
    mesh_shape = problem.cluster.mesh_shape

    fwd = [0.0] * nseg
    bwd = [0.0] * nseg
    bwd_w = [0.0] * nseg
    fwd_comm = [0.0] * nseg
    bwd_comm = [0.0] * nseg
    selective = [0.0] * nseg
    grad_sync = [0.0] * nseg
    opt = [0.0] * nseg
    numel = [0] * nseg
    trainable_numel = [0] * nseg
    trainable = set(trainable_param_nodes)
    itemsize = [4] * nseg
    flops = [0.0] * nseg

    # backward ops on the input-gradient path: those an earlier segment's backward waits for
    feeds_earlier: dict[str, bool] = {}
    for n in reversed(list(gm.graph.nodes)):
        if phase.get(n.name) != "bwd" or n.name not in seg_of:
            continue
        k = seg_of[n.name]
        feeds_earlier[n.name] = any(
            phase.get(u.name) == "bwd" and u.name in seg_of and (seg_of[u.name] < k or feeds_earlier.get(u.name, False))
            for u in n.users
        )

    for name, times in problem.node_time_s.items():
        if name not in choice or name not in seg_of:
            continue
        k, t = seg_of[name], times[choice[name]]
        node = nodes[name]
        if node.op == "placeholder":
            if name in param_nodes:
                opt[k] += t
                val = node.meta["val"]
                spec = problem.table.nodes[name].strategies[choice[name]].output_specs[0]
                local = local_numel(spec, val.shape, mesh_shape)
                numel[k] += local
                trainable_numel[k] += local if name in trainable else 0
                itemsize[k] = val.element_size()
            continue
        ins = [a.meta["val"] for a in tensor_args(node)]
        out = node.meta.get("val")
        outs = [v for v in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(v, torch.Tensor)]
        flops[k] += op_flops(node.target, ins, outs)
        if phase[name] == "fwd":
            fwd[k] += t
            if not is_matmul(node.target):
                selective[k] += t
        else:
            bwd[k] += t
            if not feeds_earlier.get(name, False):
                bwd_w[k] += t

    for e in problem.edges:
        c = _chosen_specs(problem, choice, e)
        if not c:
            continue
        if e.arg_index == -1 and e.consumer in seg_of:  # gradient -> parameter layout
            grad_sync[seg_of[e.consumer]] += c
        elif e.consumer in seg_of:
            k = seg_of[e.consumer]
            if phase.get(e.consumer) == "fwd":
                fwd[k] += c
                fwd_comm[k] += c
            else:
                bwd[k] += c
                bwd_comm[k] += c
                if not feeds_earlier.get(e.consumer, False):
                    bwd_w[k] += c

    # activations: storages born in the forward and read by the backward; values crossing cuts
    live = liveness.analyze(gm, list(trainable_param_nodes))
    saved = [0.0] * nseg
    saved_mm = [0.0] * nseg
    inputs = [0.0] * nseg
    cut = [0.0] * max(nseg - 1, 0)

    def local_bytes(ref: ValueRef) -> float:
        storage = live.storage_of.get(ref, ref)
        sizes = problem.value_bytes.get(storage)
        if sizes is None or storage.node not in choice:
            return 0.0
        return sizes[choice[storage.node]]

    counted: set[ValueRef] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or phase[n.name] != "fwd" or n.name not in seg_of:
            continue
        k = seg_of[n.name]
        readers = list(n.users)
        if any(phase.get(u.name) == "bwd" for u in readers):
            storage = live.storage_of.get(resolve_value(n), resolve_value(n))
            if storage not in counted:
                counted.add(storage)
                b = local_bytes(storage)
                saved[k] += b
                if is_matmul(nodes[storage.node].target):
                    saved_mm[k] += b
        later = [seg_of[u.name] for u in readers if phase.get(u.name) == "fwd" and seg_of.get(u.name, k) > k]
        if later:
            b = local_bytes(resolve_value(n))
            for j in range(k, max(later)):
                cut[j] += b
            for j in sorted(set(later)):
                inputs[j] += b

    return SegmentCosts(
        segments=tuple(
            SegmentCost(
                fwd_s=fwd[k],
                bwd_s=bwd[k],
                bwd_weight_s=bwd_w[k],
                fwd_comm_s=fwd_comm[k],
                bwd_comm_s=bwd_comm[k],
                selective_recompute_s=selective[k],
                grad_sync_s=grad_sync[k],
                optimizer_s=opt[k],
                param_numel=numel[k],
                trainable_numel=trainable_numel[k],
                param_itemsize=itemsize[k],
                saved_bytes=saved[k],
                saved_matmul_bytes=saved_mm[k],
                input_bytes=inputs[k],
                flops=flops[k],
            )
            for k in range(nseg)
        ),
        cut_bytes=tuple(cut),
        optimizer=optimizer,
    )
