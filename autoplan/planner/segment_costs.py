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
    selective_recompute_s[k] = sum_{v fwd op in k, v in R} t[v, s_v] + sum_{e into v, re-run} c[e, p_e, q_e]
    selective_kept_bytes[k] = sum_{storage a of a value in K, first in k} b[a, s]
    selective_recomputed_bytes[k] = the storages of saved_bytes[k] not among those of K
    selective_bwd_transient_bytes[k] = max_{bwd op i of k} T(i) + G_k(i) - F_k(i) + sum_{a re-created, f(a) <= i <= l(a)} b[a, s]
    full_recompute_s, full_kept_bytes, full_recomputed_bytes, full_bwd_transient_bytes: the same
                   under the ``full`` policy
    input_bytes[k] = sum_{value born in segments < k, read by a fwd op of k} b[a, s]
    shared_input_bytes[k] = the part of input_bytes[k] also read by other later segments
    cut_bytes[k]   = sum_{value born in segments <= k, read by a fwd op in segments > k} b[a, s]
    fwd_transient_bytes[k] = max_{fwd op i of k} T(i)      bwd_transient_bytes[k] = max_{bwd op i of k} T(i) + G_k(i) - F_k(i)
    F_k(i) = sum_{saved storage a of segments <= k, last read before i} b[a, s]   (each recomputation
             policy: of its kept storages; the backward frees what it has read, _freed_by_backward)
    G_k(i) = sum_{parameter gradient storage a born by a bwd op of k at or before i} b[a, s]
    T(i) = sum_{storage a alive at i, a not saved, not a parameter gradient} b[a, s]

``K`` (kept) and ``R`` (re-run) are recomputation's partition of the forward under each policy
(:func:`autoplan.passes.recompute.joint_recompute_partition`, the rule the pipeline runtime
executes); a conversion into an op of ``R`` is re-run with it unless the policy keeps it
converted. A re-created storage ``a`` lives from ``f(a)`` to its last reader ``l(a)``: the runtime
re-runs an op right before its first backward reader or before the re-run op that needs it,
whichever comes first, so ``f(a)`` = min(first backward reader of ``a``, ``f`` of the re-run ops
reading ``a``) (under ``full`` a block's first backward op re-creates nearly all of it). ``T(i)`` is the liveness timeline of the step (:func:`autoplan.passes.liveness.transient_timeline`,
the lifetimes the ILP's plan is priced with) without the saved activations (``saved_bytes``,
counted per micro-batch in flight) and the parameter gradients (counted with the parameters):
what a segment's forward or backward allocates on top of them, e.g. the fp32 logits-sized
gradients of the loss's log-softmax backward. ``G_k(i)``: the parameter gradients segment ``k``'s
own backward has made by op ``i``, which the memory model does not yet count as held there
(:func:`autoplan.cost_models.memory.stage_memory_parts` holds a segment's gradients from the end
of its backward: counting them all at its transient peak over-counted the gradients made after it). A value read by several later segments (a causal
mask, rotary tables) is stored once: saved once, in the segment that makes it, crossing each cut
once, and ``shared_input_bytes`` lets a recomputed stage keep it once
(:func:`autoplan.cost_models.memory.stage_memory_parts`).

A parameter read by several segments (tied embedding) is counted in the first one, and in the
``tied_param_numel`` of the later ones (a pipeline stage that holds only a later one keeps its own
copy, as :mod:`autoplan.runtime.pipeline` does). All times
are per micro-batch on one device of the stage mesh, except ``grad_sync_s`` and
``optimizer_s`` (per step). Bytes are local (after sharding on the stage mesh).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.fx as fx

from autoplan.cost_models.comm import plan_transition
from autoplan.cost_models.compute import cost_key, op_flops
from autoplan.cost_models.memory import device_kind
from autoplan.cost_models.step import SegmentCost, SegmentCosts
from autoplan.passes import liveness
from autoplan.passes.costing import CostProblem, Edge
from autoplan.passes.layers import Layering
from autoplan.passes.liveness import is_view_op
from autoplan.passes.moe import MOE_OPS, expert_weights, moe_exchanges, moe_routing
from autoplan.passes.placement import Spec, local_numel
from autoplan.passes.recompute import POLICIES, Policy, RecomputePartition, communicates, joint_recompute_partition
from autoplan.passes.ring_attention import RingCost
from autoplan.passes.strategies import ValueRef, resolve_value, tensor_args


@runtime_checkable
class SegmentCostOracle(Protocol):
    """The per-segment costs the joint search (:func:`autoplan.planner.search.search`) prices its
    candidates with, keyed by ``(tp, microbatch_size)``, from an oracle that can compute many keys
    at once and tell which are in. :class:`~autoplan.planner.segment_model.SegmentCostModel`
    implements it; a plain callable serves the search too (each key then computed when first
    asked for, nothing ahead), called as ``costs(tp, microbatch_size)`` and, for a ``cp`` axis or
    sequence parallelism, ``costs(tp, microbatch_size, cp[, 1])`` (:func:`autoplan.planner.search.cost_key`)."""

    __slots__ = ()

    def __call__(self, tp: int, microbatch_size: int, cp: int = 1, sequence_parallel: bool | int = False) -> SegmentCosts:
        """The costs of one micro-batch of ``microbatch_size`` samples on a tensor-parallel group
        of ``tp`` devices (the ``cp x tp`` mesh of ``ParallelConfig.cp``), computed now unless
        :meth:`ready`."""
        ...

    def ready(self, tp: int, microbatch_size: int, cp: int = 1, sequence_parallel: bool | int = False) -> bool:
        """Whether ``self(tp, microbatch_size, cp, sequence_parallel)`` answers without computing anything more."""
        ...

    def prefetch(self, keys: Iterable[tuple[int, ...]], *, while_waiting: Callable[[], bool] | None = None) -> None:
        """Compute the costs of every key in ``keys`` (``(tp, microbatch_size[, cp[, sequence_parallel]])``) now (in any order, in parallel where it can),
        so that later calls are :meth:`ready`. While it waits for results it calls
        ``while_waiting()`` (the search lays out the candidates whose costs are ready), between
        results, until that returns False. The costs are those ``self(tp, microbatch_size)``
        would give."""
        ...


@runtime_checkable
class BoundedSegmentCostOracle(SegmentCostOracle, Protocol):
    """A :class:`SegmentCostOracle` that also bounds a key's work without computing it, and whose
    :meth:`prefetch` leaves out the keys the search no longer needs: the search then never
    computes the costs of a key none of whose candidates can be evaluated
    (:func:`autoplan.planner.search.search`)."""

    __slots__ = ()

    def work_lower_bound_s(
        self, tp: int, microbatch_size: int, cp: int = 1, sequence_parallel: bool | int = False
    ) -> float:
        """A time that ``sum(s.fwd_s + s.bwd_s for s in self(tp, microbatch_size, ...).segments)``
        is not below (0: nothing known), computed without the costs."""
        ...

    def prefetch(
        self,
        keys: Iterable[tuple[int, ...]],
        *,
        while_waiting: Callable[[], bool] | None = None,
        skip: Callable[[tuple[int, ...]], bool] | None = None,
        priority: Callable[[tuple[int, ...]], float] | None = None,
    ) -> None:
        """:meth:`SegmentCostOracle.prefetch`, without the keys ``skip`` says are no longer needed
        (asked as results come in; once True for a key it stays True: such a key may be left
        not ready), the keys of the smallest ``priority`` first."""
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
    every parameter placeholder, ``trainable_param_nodes`` those the step returns a gradient for.

    Phases, each adding to the same per-segment sums in this order: node times
    (:func:`_add_node_times`), conversions (:func:`_add_conversions`), activations
    (:func:`_add_activations`)."""
    seg_of = dict(layering.segment_of)
    for p, segs in layering.param_segments.items():
        seg_of[p] = segs[0]
    phase = {n.name: n.meta.get("autoplan.phase") for n in gm.graph.nodes}
    sums = _Sums.zeros(layering.num_segments)
    feeds_earlier = _feeds_earlier(gm, phase, seg_of)
    parts = {policy: _recompute_partition(gm, layering, problem, choice, policy) for policy in POLICIES}
    _add_node_times(
        sums, gm, problem, choice, seg_of, phase, feeds_earlier, param_nodes=param_nodes,
        trainable=set(trainable_param_nodes), param_segments=layering.param_segments, partitions=parts,
    )  # fmt: skip
    _add_conversions(sums, problem, choice, seg_of, phase, feeds_earlier, parts)
    _add_activations(sums, gm, problem, choice, seg_of, phase, trainable_param_nodes, parts)
    return sums.costs(optimizer)


@dataclass(frozen=True, slots=True)
class _Ring:
    """Ring attention transfers summed over a segment's ops of one phase."""

    exposed_s: float = 0.0
    total_s: float = 0.0
    bytes: float = 0.0
    messages: int = 0

    def plus(self, ring: RingCost) -> _Ring:
        return _Ring(self.exposed_s + ring.exposed_s, self.total_s + ring.total_s, self.bytes + ring.bytes,
                     self.messages + ring.count)  # fmt: skip


@dataclass(slots=True)
class _Sums:
    """The per-segment sums :func:`segment_costs` accumulates (one entry per segment; ``cut`` one
    per cut between consecutive segments)."""

    fwd: list[float]
    bwd: list[float]
    bwd_w: list[float]
    fwd_comm: list[float]
    bwd_comm: list[float]
    a2a_s: dict[str, list[float]]
    """Per phase (``fwd``, ``bwd``): the part of ``*_comm`` spent in MoE ops' all-to-alls."""
    a2a_bytes: dict[str, list[float]]
    a2a_count: list[int]
    """All-to-alls of the forward (the backward runs as many)."""
    ring: dict[str, list[_Ring]]
    """Per phase: the ring attention transfers of the segment's ops."""
    moe: dict[str, list[float]]
    """Per phase: the MoE expert ops' time without their all-to-alls."""
    moe_ops: list[int]
    routed: list[float]
    experts: list[int]
    expert_numel: list[int]
    expert_trainable: list[int]
    redo_s: dict[Policy, list[float]]
    """Per policy: the forward time its backward re-runs."""
    grad_sync: list[float]
    grad_sync_bytes: list[float]
    """Per segment: the bytes of its gradients the stage mesh converts (``grad_sync``'s tensors)."""
    opt: list[float]
    numel: list[int]
    trainable_numel: list[int]
    itemsize: list[int]
    flops: list[float]
    saved: list[float]
    kept: dict[Policy, list[float]]
    recreated: dict[Policy, list[float]]
    redo_transient: dict[Policy, list[float]]
    """Per policy: the backward's transient peak with the re-created storages."""
    inputs: list[float]
    shared_inputs: list[float]
    tied_numel: list[int]
    tied_trainable: list[int]
    tied_owner: list[int]
    fwd_transient: list[float]
    bwd_transient: list[float]
    cut: list[float]

    @classmethod
    def zeros(cls, nseg: int) -> _Sums:
        return cls(
            fwd=[0.0] * nseg, bwd=[0.0] * nseg, bwd_w=[0.0] * nseg, fwd_comm=[0.0] * nseg, bwd_comm=[0.0] * nseg,
            a2a_s={"fwd": [0.0] * nseg, "bwd": [0.0] * nseg}, a2a_bytes={"fwd": [0.0] * nseg, "bwd": [0.0] * nseg},
            a2a_count=[0] * nseg, ring={"fwd": [_Ring()] * nseg, "bwd": [_Ring()] * nseg},
            moe={"fwd": [0.0] * nseg, "bwd": [0.0] * nseg}, moe_ops=[0] * nseg,
            routed=[0.0] * nseg, experts=[0] * nseg, expert_numel=[0] * nseg, expert_trainable=[0] * nseg,
            redo_s={p: [0.0] * nseg for p in POLICIES}, grad_sync=[0.0] * nseg, grad_sync_bytes=[0.0] * nseg, opt=[0.0] * nseg, numel=[0] * nseg,
            trainable_numel=[0] * nseg, itemsize=[4] * nseg, flops=[0.0] * nseg, saved=[0.0] * nseg,
            kept={p: [0.0] * nseg for p in POLICIES}, recreated={p: [0.0] * nseg for p in POLICIES},
            redo_transient={p: [0.0] * nseg for p in POLICIES}, inputs=[0.0] * nseg, shared_inputs=[0.0] * nseg, tied_numel=[0] * nseg,
            tied_trainable=[0] * nseg, tied_owner=[-1] * nseg, fwd_transient=[0.0] * nseg,
            bwd_transient=[0.0] * nseg, cut=[0.0] * max(nseg - 1, 0),
        )  # fmt: skip

    def costs(self, optimizer: str) -> SegmentCosts:
        return SegmentCosts(
            segments=tuple(
                SegmentCost(
                    fwd_s=self.fwd[k],
                    bwd_s=self.bwd[k],
                    bwd_weight_s=self.bwd_w[k],
                    fwd_comm_s=self.fwd_comm[k],
                    bwd_comm_s=self.bwd_comm[k],
                    selective_recompute_s=self.redo_s["selective"][k],
                    full_recompute_s=self.redo_s["full"][k],
                    grad_sync_s=self.grad_sync[k],
                    grad_sync_bytes=self.grad_sync_bytes[k],
                    optimizer_s=self.opt[k],
                    param_numel=self.numel[k],
                    trainable_numel=self.trainable_numel[k],
                    param_itemsize=self.itemsize[k],
                    saved_bytes=self.saved[k],
                    selective_kept_bytes=self.kept["selective"][k],
                    selective_recomputed_bytes=self.recreated["selective"][k],
                    selective_bwd_transient_bytes=self.redo_transient["selective"][k],
                    full_kept_bytes=self.kept["full"][k],
                    full_recomputed_bytes=self.recreated["full"][k],
                    full_bwd_transient_bytes=self.redo_transient["full"][k],
                    input_bytes=self.inputs[k],
                    shared_input_bytes=self.shared_inputs[k],
                    tied_param_numel=self.tied_numel[k],
                    tied_trainable_numel=self.tied_trainable[k],
                    tied_param_owner=self.tied_owner[k],
                    fwd_transient_bytes=self.fwd_transient[k],
                    bwd_transient_bytes=self.bwd_transient[k],
                    flops=self.flops[k],
                    fwd_all_to_all_s=self.a2a_s["fwd"][k],
                    bwd_all_to_all_s=self.a2a_s["bwd"][k],
                    all_to_alls=self.a2a_count[k],
                    fwd_all_to_all_bytes=self.a2a_bytes["fwd"][k],
                    bwd_all_to_all_bytes=self.a2a_bytes["bwd"][k],
                    moe_fwd_s=self.moe["fwd"][k],
                    moe_bwd_s=self.moe["bwd"][k],
                    moe_ops=self.moe_ops[k],
                    fwd_ring_s=self.ring["fwd"][k].exposed_s,
                    bwd_ring_s=self.ring["bwd"][k].exposed_s,
                    fwd_ring_total_s=self.ring["fwd"][k].total_s,
                    bwd_ring_total_s=self.ring["bwd"][k].total_s,
                    fwd_ring_bytes=self.ring["fwd"][k].bytes,
                    bwd_ring_bytes=self.ring["bwd"][k].bytes,
                    fwd_ring_messages=self.ring["fwd"][k].messages,
                    bwd_ring_messages=self.ring["bwd"][k].messages,
                    moe_routed_bytes=self.routed[k],
                    experts=self.experts[k],
                    expert_numel=self.expert_numel[k],
                    expert_trainable_numel=self.expert_trainable[k],
                )
                for k in range(len(self.fwd))
            ),
            cut_bytes=tuple(self.cut),
            optimizer=optimizer,
        )


def _feeds_earlier(gm: fx.GraphModule, phase: Mapping[str, object], seg_of: Mapping[str, int]) -> dict[str, bool]:
    """Backward ops on the input-gradient path: those an earlier segment's backward waits for."""
    feeds_earlier: dict[str, bool] = {}
    for n in reversed(list(gm.graph.nodes)):
        if phase.get(n.name) != "bwd" or n.name not in seg_of:
            continue
        k = seg_of[n.name]
        feeds_earlier[n.name] = any(
            phase.get(u.name) == "bwd" and u.name in seg_of and (seg_of[u.name] < k or feeds_earlier.get(u.name, False))
            for u in n.users
        )
    return feeds_earlier


def _add_node_times(
    sums: _Sums,
    gm: fx.GraphModule,
    problem: CostProblem,
    choice: Mapping[str, int],
    seg_of: Mapping[str, int],
    phase: Mapping[str, object],
    feeds_earlier: Mapping[str, bool],
    *,
    param_nodes: Sequence[str],
    trainable: set[str],
    param_segments: Mapping[str, tuple[int, ...]],
    partitions: Mapping[Policy, RecomputePartition],
) -> None:
    """Each chosen node's time: operators into forward / backward (and FLOPs; those of each
    policy's ``R`` into its ``*_recompute_s`` too),
    parameters into the optimizer step (and their local elements; a parameter read by later
    segments too, a tied embedding, into their ``tied_*`` fields: a pipeline stage without its
    first reader keeps a copy)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    mesh_shape = problem.cluster.mesh_shape
    expert_params = {w.name for n in gm.graph.nodes if n.target in MOE_OPS for w in expert_weights(n)}
    for name, times in problem.node_time_s.items():
        if name not in choice or name not in seg_of:
            continue
        k, t = seg_of[name], times[choice[name]]
        node = nodes[name]
        if node.op == "placeholder":
            if name in param_nodes:
                sums.opt[k] += t
                val = node.meta["val"]
                spec = problem.table.nodes[name].strategies[choice[name]].output_specs[0]
                local = local_numel(spec, val.shape, mesh_shape)
                sums.numel[k] += local
                sums.trainable_numel[k] += local if name in trainable else 0
                if name in expert_params:
                    sums.expert_numel[k] += local
                    sums.expert_trainable[k] += local if name in trainable else 0
                sums.itemsize[k] = val.element_size()
                for j in sorted(set(param_segments.get(name, ())) - {k}):
                    sums.tied_numel[j] += local
                    sums.tied_trainable[j] += local if name in trainable else 0
                    sums.tied_owner[j] = k
            continue
        ins = [a.meta["val"] for a in tensor_args(node)]
        out = node.meta.get("val")
        outs = [v for v in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(v, torch.Tensor)]
        sums.flops[k] += op_flops(cost_key(node.target, node.args, node.kwargs), ins, outs)
        # an expert-parallel op's all-to-alls (inside its time) count as the segment's communication
        strategy = problem.table.nodes[name].strategies[choice[name]]
        exchange = moe_exchanges(node, strategy.input_specs, problem.cluster)
        in_op = exchange.time_s if exchange is not None else 0.0
        ring = problem.ring_costs.get(name, [None] * (choice[name] + 1))[choice[name]]
        if ring is not None:  # ring attention: what it waits for is communication, the rest runs beside it
            side = "fwd" if phase[name] == "fwd" else "bwd"
            in_op += ring.exposed_s
            sums.ring[side][k] = sums.ring[side][k].plus(ring)
        if node.target in MOE_OPS:
            side = "fwd" if phase[name] == "fwd" else "bwd"
            sums.moe[side][k] += t - in_op
            if side == "fwd":
                routed, experts = moe_routing(node, strategy.input_specs, problem.cluster.mesh_shape)
                sums.moe_ops[k] += 1
                sums.routed[k] += routed
                sums.experts[k] = max(sums.experts[k], experts)
            if exchange is not None:
                sums.a2a_s[side][k] += exchange.time_s
                sums.a2a_bytes[side][k] += exchange.bytes
                sums.a2a_count[k] += exchange.count if side == "fwd" else 0
        if phase[name] == "fwd":
            sums.fwd[k] += t
            sums.fwd_comm[k] += in_op
            for policy, part in partitions.items():
                if name in part.recomputed_ops:
                    sums.redo_s[policy][k] += t
        else:
            sums.bwd[k] += t
            sums.bwd_comm[k] += in_op
            if not feeds_earlier.get(name, False):
                sums.bwd_w[k] += t


def _add_conversions(
    sums: _Sums,
    problem: CostProblem,
    choice: Mapping[str, int],
    seg_of: Mapping[str, int],
    phase: Mapping[str, object],
    feeds_earlier: Mapping[str, bool],
    partitions: Mapping[Policy, RecomputePartition],
) -> None:
    """Each chosen conversion's time: gradient synchronisation, or the consumer's forward /
    backward communication (a forward one into an op a policy re-runs, unless the policy keeps it
    converted, into its ``*_recompute_s`` too)."""
    rerun = {p: (part.recomputed_ops, set(part.kept_conversions)) for p, part in partitions.items()}
    for e in problem.edges:
        c = _chosen_specs(problem, choice, e)
        if not c:
            continue
        if e.arg_index == -1 and e.consumer in seg_of:  # gradient -> parameter layout
            sums.grad_sync[seg_of[e.consumer]] += c
            sums.grad_sync_bytes[seg_of[e.consumer]] += e.full_bytes
        elif e.consumer in seg_of:
            k = seg_of[e.consumer]
            if phase.get(e.consumer) == "fwd":
                sums.fwd[k] += c
                sums.fwd_comm[k] += c
                for policy, (ops, kept) in rerun.items():
                    if e.consumer in ops and (e.consumer, e.arg_index) not in kept:
                        sums.redo_s[policy][k] += c
            else:
                sums.bwd[k] += c
                sums.bwd_comm[k] += c
                if not feeds_earlier.get(e.consumer, False):
                    sums.bwd_w[k] += c


def _add_activations(
    sums: _Sums,
    gm: fx.GraphModule,
    problem: CostProblem,
    choice: Mapping[str, int],
    seg_of: Mapping[str, int],
    phase: Mapping[str, object],
    trainable_param_nodes: Sequence[str],
    partitions: Mapping[Policy, RecomputePartition],
) -> None:
    """Activations: storages born in the forward and read by the backward (and each
    recomputation policy's share of them, :func:`_add_recompute_bytes`); values crossing cuts;
    each segment's transient peaks (the module docstring's ``T``)."""
    live = liveness.analyze(gm, list(trainable_param_nodes))

    def local_bytes(ref: ValueRef) -> float:
        storage = live.storage_of.get(ref, ref)
        sizes = problem.value_bytes.get(storage)
        if sizes is None or storage.node not in choice:
            return 0.0
        return sizes[choice[storage.node]]

    counted: dict[ValueRef, int] = {}  # saved storage -> the segment it is counted in
    for n in gm.graph.nodes:
        if n.op != "call_function" or phase[n.name] != "fwd" or n.name not in seg_of:
            continue
        k = seg_of[n.name]
        readers = list(n.users)
        if any(phase.get(u.name) == "bwd" for u in readers):
            storage = live.storage_of.get(resolve_value(n), resolve_value(n))
            if storage not in counted:
                counted[storage] = k
                sums.saved[k] += local_bytes(storage)
        later = sorted({seg_of[u.name] for u in readers if phase.get(u.name) == "fwd" and seg_of.get(u.name, k) > k})
        if later:
            b = local_bytes(resolve_value(n))
            for j in range(k, later[-1]):
                sums.cut[j] += b  # once per cut, however many later segments read it
            for j in later:
                sums.inputs[j] += b
                if len(later) > 1:
                    sums.shared_inputs[j] += b
    kept_by: dict[Policy, dict[ValueRef, int]] = {}
    recreated = {
        policy: _add_recompute_bytes(
            sums, policy, part, counted, seg_of, lambda v: live.storage_of.get(v, v), local_bytes,
            kept_by.setdefault(policy, {}),
        )
        for policy, part in partitions.items()
    }
    for policy, part in partitions.items():
        _add_kept_conversions(sums, gm, problem, choice, policy, part, seg_of)
    grads = {live.storage_of[g] for g in live.grads.values()}
    partials = _tied_gradient_partials(gm, live, seg_of, phase)
    excluded = set(counted) | grads | partials
    timeline = _with_own_gradients(
        _with_conversions(liveness.transient_timeline(live, local_bytes, excluded=excluded), gm, live, problem, choice,
                          local_bytes, excluded),
        gm, live, grads, local_bytes, seg_of, phase,
    )  # fmt: skip
    nseg = len(sums.bwd_transient)
    freed = _freed_by_backward(counted, live, local_bytes, nseg)
    for n in gm.graph.nodes:
        k = seg_of.get(n.name)
        if n.op != "call_function" or k is None:
            continue
        i = live.position[n.name]
        if phase[n.name] == "fwd":
            sums.fwd_transient[k] = max(sums.fwd_transient[k], timeline[i])
        else:
            sums.bwd_transient[k] = max(sums.bwd_transient[k], timeline[i] - freed(i, k))
    for policy, part in partitions.items():
        peaks = sums.redo_transient[policy]
        _add_recompute_bwd_transient(peaks, gm, live, timeline, part, recreated[policy], local_bytes, seg_of, phase,
                                     _freed_by_backward(kept_by[policy], live, local_bytes, nseg))  # fmt: skip


def _tied_gradient_partials(
    gm: fx.GraphModule, live: liveness.Liveness, seg_of: Mapping[str, int], phase: Mapping[str, object]
) -> set[ValueRef]:
    """The storages a segment's backward adds into the gradient of a parameter another segment
    holds (a tied embedding: the lm_head's ``mm`` summed into the embedding's gradient in the
    embedding's backward), left out of ``T(i)``: they are gradients, alive from the reader's
    backward to the owner's, and priced as the reader's ``tied_trainable_numel``
    (:func:`autoplan.cost_models.memory.stage_memory_parts`: held through the backward of the
    segments between on a stage holding both, the stage's own copy's gradient on a stage
    holding only the reader). Counted in ``T`` they sat in every segment's backward between, on
    stages that do not hold them (measured, ``benchmarks/memory_peak.py`` pp2: the first stage
    priced 1 MiB, the tied lm_head's gradient, above its peak)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    out: set[ValueRef] = set()
    for g in live.grads.values():
        final = live.storage_of[g]
        owner = seg_of.get(final.node)
        stack = [final.node]
        while stack:  # the chain of adds summing the contributions
            node = nodes[stack.pop()]
            if node.target is not torch.ops.aten.add.Tensor:
                continue
            for a in node.all_input_nodes:
                storage = live.storage_of.get(resolve_value(a), resolve_value(a))
                if phase.get(storage.node) != "bwd":
                    continue
                if seg_of.get(storage.node, owner) != owner:
                    out.add(storage)
                else:
                    stack.append(storage.node)
    return out


def _freed_by_backward(
    kept: Mapping[ValueRef, int], live: liveness.Liveness, local_bytes: Callable[[ValueRef], float], nseg: int
) -> Callable[[int, int], float]:
    """``F_k(i)``: of the activations a micro-batch keeps (``kept``: storage -> the segment it is
    counted in), the bytes of segments ``<= k`` already freed at backward op ``i`` of segment
    ``k`` (each storage after its last reader: the runtime's backward drops what it has read,
    :meth:`~autoplan.runtime.lowering.LocalProgram.run_boxed`). The memory model holds segment
    ``k``'s and the earlier segments' activations through ``k``'s backward and frees the later
    segments' (``K_j``, :func:`autoplan.cost_models.memory.stage_memory_parts`); ``F_k`` is what
    ``k``'s own backward has released by ``i``, so its transient peak is measured against them."""
    by_segment: list[list[tuple[int, float]]] = [[] for _ in range(nseg)]
    for storage, k in kept.items():
        last = live.last_use.get(storage)
        b = local_bytes(storage)
        if last is not None and b > 0 and 0 <= k < nseg:
            by_segment[k].append((last, b))
    lasts: list[list[int]] = []
    sums: list[list[float]] = []
    merged: list[tuple[int, float]] = []
    for k in range(nseg):  # segments <= k, by last use, with running sums
        merged = sorted(merged + by_segment[k])
        lasts.append([last for last, _ in merged])
        sums.append([0.0, *itertools.accumulate(b for _, b in merged)])

    def freed(i: int, k: int) -> float:
        return sums[k][bisect.bisect_left(lasts[k], i)]

    return freed


def _with_conversions(
    timeline: Sequence[float],
    gm: fx.GraphModule,
    live: liveness.Liveness,
    problem: CostProblem,
    choice: Mapping[str, int],
    local_bytes: Callable[[ValueRef], float],
    excluded: set[ValueRef],
) -> list[float]:
    """``T(i)`` plus, at each op ``i`` whose operands the chosen plan converts, the converted
    copies beside the op's output and, before it, the largest conversion's running buffers
    (:func:`autoplan.passes.liveness.conversion_bytes`: a step's output beside its input,
    gloo's flat copies, the chunk-cat of a gather on an inner dim). Without them a plan that
    gathers sharded log-probabilities to run the loss replicated was priced at its shards alone
    (measured, ``benchmarks/memory_peak.py`` cp2_tp2_sp on 0.4 GB/s links: 10.8 MiB of the
    gathers' buffers at the step's peak, priced 0)."""
    specs = _converted_specs(problem, choice)
    if not specs:
        return list(timeline)
    mesh_shape, kind = problem.cluster.mesh_shape, device_kind(problem.cluster.device)
    nodes = {n.name: n for n in gm.graph.nodes}
    held: dict[int, float] = {}
    running: dict[int, float] = {}
    for (consumer, i), (p, q) in specs.items():
        pos = live.position.get(consumer)
        if pos is None:
            continue
        h, peak = liveness.conversion_bytes(p, q, tensor_args(nodes[consumer])[i].meta["val"], mesh_shape, kind)
        held[pos] = held.get(pos, 0.0) + h
        running[pos] = max(running.get(pos, 0.0), peak - h)
    made: dict[int, float] = {}  # bytes T(i) counts of the storages op i allocates: born after its conversions ran
    for storage, born in live.births().items():
        if born in held and storage not in excluded:
            made[born] = made.get(born, 0.0) + local_bytes(storage)
    out = list(timeline)
    for pos, h in held.items():
        out[pos] += h + max(0.0, running[pos] - made.get(pos, 0.0))
    return out


def _with_own_gradients(
    timeline: Sequence[float],
    gm: fx.GraphModule,
    live: liveness.Liveness,
    grads: set[ValueRef],
    local_bytes: Callable[[ValueRef], float],
    seg_of: Mapping[str, int],
    phase: Mapping[str, object],
) -> list[float]:
    """``T(i)`` plus, at a backward op ``i`` of segment ``k``, the parameter gradients segment
    ``k``'s backward has made by ``i`` (module docstring): they are alive from their birth to the
    step's end, but the memory model counts a segment's gradients as held only once its backward
    is over (:func:`autoplan.cost_models.memory.stage_memory_parts`), so the peak inside that
    backward sees the ones made so far, not all of them."""
    births: dict[int, list[tuple[int, float]]] = {}
    for storage, born in live.births().items():
        k = seg_of.get(storage.node)
        if storage in grads and k is not None:
            births.setdefault(k, []).append((born, local_bytes(storage)))
    made = {k: sorted(v) for k, v in births.items()}
    out = list(timeline)
    for n in gm.graph.nodes:
        k = seg_of.get(n.name)
        if n.op != "call_function" or k is None or phase.get(n.name) == "fwd" or k not in made:
            continue
        i = live.position[n.name]
        out[i] += sum(b for born, b in made[k] if born <= i)
    return out


def _add_recompute_bwd_transient(
    peaks: list[float],
    gm: fx.GraphModule,
    live: liveness.Liveness,
    timeline: Sequence[float],
    part: RecomputePartition,
    recreated: set[ValueRef],
    local_bytes: Callable[[ValueRef], float],
    seg_of: Mapping[str, int],
    phase: Mapping[str, object],
    freed: Callable[[int, int], float],
) -> None:
    """Each segment's backward peak under one recomputation policy (``peaks``): ``T(i)`` plus
    the re-created storages alive at ``i``, each from ``f(a)`` to its last reader (module
    docstring; an alias such as autograd's early ``detach`` reads where its own readers do, as the
    runtime places it), less the policy's kept storages freed by then (``freed``,
    :func:`_freed_by_backward`)."""

    def first_read(u: fx.Node) -> int:
        if is_view_op(u.target) and u.users:
            return min(first_read(w) for w in u.users)
        return live.position.get(u.name, live.end)

    rerun = set(part.recomputed)
    made: dict[fx.Node, int] = {}  # re-run op -> where the runtime re-runs it
    for n in reversed(part.recomputed):
        reads = [first_read(u) for u in n.users if phase.get(u.name) == "bwd"]
        made[n] = min([*reads, *(made[u] for u in n.users if u in rerun)], default=live.end)
    first: dict[ValueRef, int] = {}
    for n, when in made.items():
        storage = live.storage_of.get(resolve_value(n), resolve_value(n))
        if storage in recreated:
            first[storage] = min(first.get(storage, live.end), when)
    extra = [0.0] * (live.end + 2)
    for storage, born in first.items():
        extra[born] += local_bytes(storage)
        extra[max(born, live.last_use.get(storage, born)) + 1] -= local_bytes(storage)
    alive = list(itertools.accumulate(extra))
    for n in gm.graph.nodes:
        k = seg_of.get(n.name)
        if n.op == "call_function" and k is not None and phase[n.name] != "fwd":
            i = live.position[n.name]
            peaks[k] = max(peaks[k], timeline[i] + alive[i] - freed(i, k))


def _add_recompute_bytes(
    sums: _Sums,
    policy: Policy,
    part: RecomputePartition,
    saved: Mapping[ValueRef, int],
    seg_of: Mapping[str, int],
    storage_of: Callable[[ValueRef], ValueRef],
    local_bytes: Callable[[ValueRef], float],
    kept: dict[ValueRef, int],
) -> set[ValueRef]:
    """One recomputation policy's activations: the storages of the kept values ``K``, each once, in
    the segment of its first kept value (a kept placeholder: of its first reader; placeholders
    hold no activation bytes; filled into ``kept``: storage -> segment), and the ``saved``
    storages (storage -> segment) not among them, re-created in the backward (returned)."""
    for v in part.kept:
        k = seg_of.get(v.name)
        if k is None:
            k = min((seg_of[u.name] for u in v.users if u.name in seg_of), default=None)
        storage = storage_of(resolve_value(v))
        if k is None or storage in kept:
            continue
        kept[storage] = k
        sums.kept[policy][k] += local_bytes(storage)
    recreated = {storage for storage in saved if storage not in kept}
    for storage in recreated:
        sums.recreated[policy][saved[storage]] += local_bytes(storage)
    return recreated


def _converted_specs(problem: CostProblem, choice: Mapping[str, int]) -> dict[tuple[str, int], tuple[Spec, Spec]]:
    """(consumer, tensor-argument index) -> the chosen (producer, required) specs of its edge, where
    they differ (a conversion code generation inserts)."""
    out: dict[tuple[str, int], tuple[Spec, Spec]] = {}
    for e in problem.edges:
        if e.arg_index < 0 or e.producer.node not in choice:
            continue
        p, q = e.src_spec(choice[e.producer.node]), e.dst_spec(choice.get(e.consumer))
        if p != q:
            out[(e.consumer, e.arg_index)] = (p, q)
    return out


def _recompute_partition(
    gm: fx.GraphModule, layering: Layering, problem: CostProblem, choice: Mapping[str, int], policy: Policy
) -> RecomputePartition:
    """Recomputation's ``K`` and ``R`` under ``policy`` for the chosen plan
    (:func:`autoplan.passes.recompute.joint_recompute_partition`): under ``selective`` an input
    reaching a re-run op through a communicating conversion is kept converted."""
    mesh_shape = problem.cluster.mesh_shape
    specs = _converted_specs(problem, choice)

    def converted(v: fx.Node, i: int) -> bool:
        pq = specs.get((v.name, i))
        return pq is not None and any(communicates(st.kind, st.axis, mesh_shape) for st in plan_transition(*pq))

    return joint_recompute_partition(
        gm, layering.segment_of, mesh_shape=mesh_shape, policy=policy, converted=converted
    )


def _add_kept_conversions(
    sums: _Sums,
    gm: fx.GraphModule,
    problem: CostProblem,
    choice: Mapping[str, int],
    policy: Policy,
    part: RecomputePartition,
    seg_of: Mapping[str, int],
) -> None:
    """The inputs ``policy`` keeps as a communicating conversion made them: each
    conversion's local bytes in its consumer's layout, in the consumer's segment (one
    conversion per consumer, as code generation emits them)."""
    if not part.kept_conversions:
        return
    nodes = {n.name: n for n in gm.graph.nodes}
    specs = _converted_specs(problem, choice)
    for consumer, i in part.kept_conversions:
        val = tensor_args(nodes[consumer])[i].meta["val"]
        _, q = specs[(consumer, i)]
        sums.kept[policy][seg_of[consumer]] += liveness.local_bytes(q, val, problem.cluster.mesh_shape)
