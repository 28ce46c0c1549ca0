"""Pass 3 — costing: put seconds and bytes on every strategy and every edge.

Contract
--------
Input: the traced program, its :class:`~autoplan.passes.strategies.StrategyTable` and a ``Cluster``.
Output: a :class:`CostProblem`, the plain data the ILP is built from:

* ``node_time_s[v][s]``: compute time of node ``v`` under strategy ``s`` (forward and backward
  ops alike, since the graph is the joint training step), plus the optimizer step for
  trainable parameters (a frozen one has none);
* ``persistent_bytes[v][s]``: bytes per device a placeholder keeps for the whole step under
  strategy ``s``: parameter + optimizer state for trainable parameters, the parameter alone for
  frozen ones, the local shard for inputs and buffers;
* ``value_bytes[a][s]``: local bytes of storage ``a`` (:mod:`autoplan.passes.liveness`) when its producer
  runs strategy ``s``; ``grad_bytes[p][s]``: the gradient of trainable parameter ``p`` in layout ``s``;
* ``memory_points``: the positions of the step where the ILP bounds the live bytes, each with
  the storages alive there and the gradients already produced;
* ``edges``: for every (producer value -> consumer argument) the transition time between each
  producer output spec ``p`` and each required input spec ``q`` (``autoplan.cost_models.comm``).
  Gradient outputs are edges to their parameter (the gradient must arrive in the parameter's
  layout: this is the gradient all-reduce / reduce-scatter of data parallelism), and the loss
  must arrive replicated. Gradient all-reduces are coalesced by the generated program
  (``autoplan.cost_models.comm.is_coalescable``), so their edges carry the bandwidth term only; the
  latency of each coalesced collective is added once to the plan's estimate.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.comm import is_coalescable, plan_transition, transition_cost_s
from autoplan.cost_models.compute import cost_key, is_matmul, roofline_time_s
from autoplan.cost_models.hardware import DeviceSpec
from autoplan.cost_models.memory import (
    OPTIMIZER_STEP_BYTES_PER_ELEMENT,
    allocatable_bytes,
    device_kind,
    mesh_groups,
    nvlink_multicast,
    param_training_bytes_by_part,
    tensor_bytes,
)
from autoplan.cost_models.profile_db import ProfileDB
from autoplan.passes import liveness
from autoplan.passes.attention import RING_OPS
from autoplan.passes.moe import MOE_OPS, moe_comm_time_s, moe_time_factor
from autoplan.passes.op_keys import local_shard_shape, op_key, optimizer_key
from autoplan.passes.placement import Spec, local_numel, replicated, storage_factor
from autoplan.passes.ring_attention import RingCost, ring_exchange, ring_size
from autoplan.passes.strategies import (
    Strategy,
    StrategyTable,
    ValueRef,
    input_dependent_nodes,
    resolve_value,
    tensor_args,
)
from autoplan.passes.trace import TracedProgram, param_node_name, written_tensor_args

OUTPUT_CONSUMER = "<output>"
"""Pseudo consumer of the loss (needs ``R``)."""


@dataclass(frozen=True, slots=True)
class PairCosts(Mapping[tuple[Spec, Spec], float]):
    """An edge's transition seconds for every (producer spec, consumer spec) pair, read as the
    mapping ``(p, q) -> seconds`` and stored as a matrix: row ``i`` is ``src[i]`` (the order of
    :attr:`Edge.src_groups`), column ``j`` is ``dst[j]`` (:attr:`Edge.dst_groups`). Not a dict keyed
    by spec pairs: hashing a spec runs torch's ``Placement.__hash__`` in Python per placement, and
    on a ``cp x tp`` mesh the edges of a small Llama have 190k pairs (20 times a 1-D mesh's), built
    here and read again by the ILP (:meth:`ShardingILP.add_edge_constraints`) through ``matrix``."""

    src: tuple[Spec, ...]
    dst: tuple[Spec, ...]
    matrix: tuple[tuple[float, ...], ...]
    """``matrix[i][j]``: seconds to convert ``src[i]`` into ``dst[j]``."""
    _row: dict[Spec, int] = field(init=False, repr=False, compare=False)
    _col: dict[Spec, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        assert len(self.matrix) == len(self.src) and all(len(r) == len(self.dst) for r in self.matrix)
        object.__setattr__(self, "_row", {p: i for i, p in enumerate(self.src)})
        object.__setattr__(self, "_col", {q: j for j, q in enumerate(self.dst)})

    def __getitem__(self, pair: tuple[Spec, Spec]) -> float:
        p, q = pair
        return self.matrix[self._row[p]][self._col[q]]

    def __iter__(self) -> Iterator[tuple[Spec, Spec]]:
        return ((p, q) for p in self.src for q in self.dst)

    def __len__(self) -> int:
        return len(self.src) * len(self.dst)

    def __contains__(self, pair: object) -> bool:
        return isinstance(pair, tuple) and len(pair) == 2 and pair[0] in self._row and pair[1] in self._col

    def all_zero(self) -> bool:
        return all(c == 0.0 for row in self.matrix for c in row)

    def scaled(self, weight: float) -> PairCosts:
        """Every time multiplied by ``weight`` (an edge standing for ``weight`` copies)."""
        return PairCosts(self.src, self.dst, tuple(tuple(c * weight for c in row) for row in self.matrix))


@dataclass(frozen=True, slots=True)
class Edge:
    """Producer value -> one argument of a consumer (or a parameter, for gradients)."""

    producer: ValueRef
    consumer: str
    arg_index: int
    """Index into the consumer's tensor args; -1 for gradient -> parameter and loss -> output."""
    src_groups: dict[Spec, tuple[int, ...]]
    """Producer output spec -> producer strategy indices with that spec."""
    dst_groups: dict[Spec, tuple[int, ...]]
    """Required input spec -> consumer strategy indices requiring it."""
    cost_s: PairCosts
    """Transition time for every (src spec, dst spec) pair."""
    full_bytes: int
    tied: bool = False
    """True when the consumer is a size-preserving single-input op (view, transpose, unary
    elementwise...) that accepts every producer spec as is: it then simply follows its producer.
    Resharding such a value before the op costs exactly what resharding its output costs, so
    the solver loses nothing by moving any conversion to the op's consumers."""

    def __post_init__(self) -> None:
        assert self.cost_s.src == tuple(self.src_groups) and self.cost_s.dst == tuple(self.dst_groups), self

    def src_spec(self, strategy: int) -> Spec:
        """The producer's output spec when it runs ``strategy``."""
        return next(spec for spec, idx in self.src_groups.items() if strategy in idx)

    def dst_spec(self, strategy: int | None) -> Spec:
        """The spec the consumer needs when it runs ``strategy`` (``None``: a consumer outside the
        ILP, such as the loss output or a parameter's gradient slot, with a single requirement)."""
        if strategy is None:
            (q,) = self.dst_groups
            return q
        return next(spec for spec, idx in self.dst_groups.items() if strategy in idx)


@dataclass(frozen=True, slots=True)
class MemoryPoint:
    """A position of the step at which the ILP bounds memory."""

    position: int
    node: str
    storages: tuple[ValueRef, ...]
    """Storages alive at ``position`` (placeholders excluded: they are persistent)."""
    grads_of: tuple[str, ...]
    """Parameter nodes whose gradient exists at ``position``."""


@dataclass(slots=True)
class CostProblem:
    table: StrategyTable
    cluster: Cluster
    node_time_s: dict[str, list[float]] = field(default_factory=dict)
    node_time_profiled: dict[str, list[bool]] = field(default_factory=dict)
    """Per strategy: True if its time was measured (profile database), False if analytic."""
    persistent_bytes: dict[str, list[float]] = field(default_factory=dict)
    value_bytes: dict[ValueRef, list[float]] = field(default_factory=dict)
    grad_bytes: dict[str, list[float]] = field(default_factory=dict)
    memory_points: list[MemoryPoint] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    capacity_bytes: float = 0.0
    ring_costs: dict[str, list[RingCost | None]] = field(default_factory=dict)
    """Per attention node that may run a ring, per strategy: its transfers (the exposed part is in
    ``node_time_s``)."""


def _as_list(val: object) -> list[object]:
    return list(val) if isinstance(val, (tuple, list)) else [val]


def _work_divisor(in_specs: Sequence[Spec], out_specs: Sequence[Spec | None], mesh_shape: Sequence[int]) -> int:
    """Work is split as finely as the most finely *stored* operand or result."""
    specs = [s for s in (*in_specs, *out_specs) if s is not None]
    return max((storage_factor(s, mesh_shape) for s in specs), default=1)


def analytic_time_s(
    node: fx.Node, strategy: Strategy, kind: str, device: DeviceSpec, mesh_shape: Sequence[int], *, optimizer: str
) -> float:
    """Analytic time of ``node`` under ``strategy``: the roofline of the op with its work split as
    finely as its most finely stored operand (:mod:`autoplan.cost_models.compute`); for a trainable
    parameter, its optimizer step (bytes read and written over memory bandwidth); other
    placeholders (frozen parameters included) cost nothing."""
    val = node.meta.get("val")
    if kind == "param":
        local = local_numel(strategy.output_specs[0], val.shape, mesh_shape)
        return local * OPTIMIZER_STEP_BYTES_PER_ELEMENT[optimizer] / (device.mem_bw_GBps * 1e9)
    if kind not in ("op", "fallback"):
        return 0.0
    return _op_times_s(node, [strategy], device, mesh_shape)[0]


def _op_times_s(
    node: fx.Node, strategies: Sequence[Strategy], device: DeviceSpec, mesh_shape: Sequence[int]
) -> list[float]:
    """:func:`analytic_time_s` of an op under each of ``strategies``: its operands are read once
    and its roofline computed once per distinct work divisor."""
    roofline = _op_roofline(node, device)
    by_divisor: dict[int, float] = {}
    times = []
    for s in strategies:
        div = _work_divisor(s.input_specs, s.output_specs, mesh_shape)
        if div not in by_divisor:
            by_divisor[div] = roofline(div)
        times.append(by_divisor[div])
    return times


def _op_roofline(node: fx.Node, device: DeviceSpec) -> Callable[[int], float]:
    """The analytic time of op ``node`` on ``device`` as a function of its work divisor."""
    ins = [a.meta["val"] for a in tensor_args(node)]
    outs = [v for v in _as_list(node.meta.get("val")) if isinstance(v, torch.Tensor)]
    key = cost_key(node.target, node.args, node.kwargs)  # e.g. causal attention: its own formulas
    return lambda div: roofline_time_s(key, ins, outs, device, work_divisor=div)


def op_time_lower_bounds_s(
    traced: TracedProgram, cluster: Cluster, *, profile: ProfileDB | None = None
) -> dict[str, float] | None:
    """Per op node of ``traced``: a time :func:`build_cost_problem` prices none of its strategies
    below on ``cluster``'s mesh, whatever the strategy table (``None`` with a ``profile``: a
    measured time may be below the analytic one). Without building the table::

        lb[v] = min_{d in D} roofline(v, d)     D = the products of any subset of the mesh axes' sizes

    A strategy's analytic time is ``roofline(v, d)`` at its work divisor ``d`` (:func:`_work_divisor`:
    the largest ``storage_factor`` of its specs, a product of the sizes of the axes that shard),
    in ``D``; ring attention adds its exposed shifts to it (:func:`_ring_times`, never negative).
    A MoE op's time also depends on its routing: it is bounded by 0. Placeholders and ops of
    constants (:func:`~autoplan.passes.strategies.input_dependent_nodes`) are not op nodes here."""
    if profile is not None:
        return None
    mesh_shape = cluster.mesh_shape
    divisors = sorted({math.prod(axes) for r in range(len(mesh_shape) + 1) for axes in itertools.combinations(mesh_shape, r)})
    ops = input_dependent_nodes(traced.graph_module)
    out: dict[str, float] = {}
    for node in traced.graph_module.graph.nodes:
        if node.op != "call_function" or node.name not in ops:
            continue
        if node.target in MOE_OPS:
            out[node.name] = 0.0
            continue
        roofline = _op_roofline(node, cluster.device)
        out[node.name] = min(roofline(d) for d in divisors)
    return out


def _ring_times(
    problem: CostProblem, node: fx.Node, strategies: Sequence[Strategy], times: Sequence[float], profiled: Sequence[bool]
) -> list[float]:
    """Attention times with ring attention priced (:mod:`autoplan.passes.ring_attention`): a rank's
    work is ``n`` blocks of its local shape (a profiled time is one block; the analytic time, the
    op's work over its divisor, is all of them), and each ring shift beyond the block it overlaps
    is exposed. Records the transfers in ``problem.ring_costs``."""
    cluster = problem.cluster
    out, rings = [], []
    for t, s, measured in zip(times, strategies, profiled, strict=True):
        n = ring_size(node, s.input_specs, cluster.mesh_shape)
        work_s = t * n if measured else t
        ring = ring_exchange(node, s.input_specs, cluster, step_compute_s=work_s / n) if n > 1 else None
        rings.append(ring)
        out.append(work_s + (ring.exposed_s if ring is not None else 0.0))
    if any(r is not None for r in rings):
        problem.ring_costs[node.name] = rings
    return out


def _profiled_time_s(
    profile: ProfileDB | None, node: fx.Node, strategy: Strategy, kind: str, mesh_shape: Sequence[int], optimizer: str
) -> float | None:
    """Measured time of this (node, strategy) from the profile database, if it has one."""
    if profile is None:
        return None
    if kind == "param":
        val = node.meta["val"]
        local = local_shard_shape(tuple(val.shape), strategy.output_specs[0], tuple(mesh_shape))
        return profile.lookup(optimizer_key(optimizer, local, val.dtype))
    if kind not in ("op", "fallback"):
        return None
    key = op_key(node, strategy, mesh_shape)
    return None if key is None else profile.lookup(key)


def build_cost_problem(
    traced: TracedProgram,
    table: StrategyTable,
    cluster: Cluster,
    *,
    optimizer: str,
    profile: ProfileDB | None = None,
    gradients_reduced_on: tuple[int, ...] = (),
) -> CostProblem:
    """Cost every strategy and edge. Op and optimizer times come from ``profile`` where it has
    the (op, local shape) measured, else from the analytic model (:func:`analytic_time_s`).
    ``gradients_reduced_on``: mesh axes whose gradient reduction the caller prices itself (the
    step model's data-parallel group: :class:`autoplan.cost_models.step._DpGroups` with a
    ``cp`` axis); a gradient's conversion to its parameter's layout is priced on the other axes
    only."""
    gm = traced.graph_module
    mesh_shape = cluster.mesh_shape
    device = cluster.device
    # allocated bytes that fit beside the context and the mesh's communicators
    communicators = mesh_groups(mesh_shape, cluster.devices_per_node)
    capacity = allocatable_bytes(
        device.mem_capacity_bytes, device_kind(device), communicators, multicast=nvlink_multicast(device)
    )
    problem = CostProblem(table=table, cluster=cluster, capacity_bytes=capacity)
    nodes_by_name = {n.name: n for n in gm.graph.nodes}

    frozen = {param_node_name(p) for p in traced.frozen_names}
    for name, ns in table.nodes.items():
        node = nodes_by_name[name]
        if name in frozen:  # never updated: no optimizer step
            problem.node_time_s[name] = [0.0] * len(ns.strategies)
            problem.node_time_profiled[name] = [False] * len(ns.strategies)
            continue
        measured = [_profiled_time_s(profile, node, s, ns.kind, mesh_shape, optimizer) for s in ns.strategies]
        profiled = [t is not None for t in measured]
        if all(profiled):
            times = [t for t in measured if t is not None]
        elif ns.kind in ("op", "fallback"):
            times = [
                m if m is not None else a
                for m, a in zip(measured, _op_times_s(node, ns.strategies, device, mesh_shape), strict=True)
            ]
        else:
            times = [
                m if m is not None else analytic_time_s(node, s, ns.kind, device, mesh_shape, optimizer=optimizer)
                for m, s in zip(measured, ns.strategies, strict=True)
            ]
        if node.op == "call_function" and node.target in MOE_OPS:  # routing imbalance, in-op all-to-alls
            times = [
                t * moe_time_factor(node, s.input_specs) + moe_comm_time_s(node, s.input_specs, cluster)
                for t, s in zip(times, ns.strategies, strict=True)
            ]
        if node.op == "call_function" and node.target in RING_OPS:  # ring attention: exposed shifts
            times = _ring_times(problem, node, ns.strategies, times, profiled)
        problem.node_time_s[name] = times
        problem.node_time_profiled[name] = profiled
    _add_memory(problem, traced, table, optimizer)
    transition = _TransitionCosts(cluster)
    grad_transition = _OnAxes(transition, skipped=gradients_reduced_on) if gradients_reduced_on else transition

    for name, ns in table.nodes.items():
        node = nodes_by_name[name]
        written = set(written_tensor_args(node)) if node.op == "call_function" else set()
        for i, (ref, a) in enumerate(zip(ns.inputs, tensor_args(node), strict=True)):
            dst_groups: dict[Spec, list[int]] = {}
            for si, s in enumerate(ns.strategies):
                dst_groups.setdefault(s.input_specs[i], []).append(si)
            edge = _edge(table, ref, name, i, dst_groups, tensor_bytes(a.meta["val"]), transition)
            if _is_follower(node, ns.kind) and set(edge.src_groups) <= set(edge.dst_groups):
                edge = dataclasses.replace(edge, tied=True)  # it loses nothing by never converting here
            elif i in written and set(edge.src_groups) & set(edge.dst_groups):
                # an op writing into this argument must get the producer's own tensor, never a
                # converted copy (redistribute.check_no_converted_writes): the producer runs a
                # strategy whose output the op takes as it is (explain.follower knows this tie)
                edge = dataclasses.replace(edge, tied=True)
            problem.edges.append(edge)

    out = next(n for n in gm.graph.nodes if n.op == "output")
    loss, *grads = out.args[0]
    rep = replicated(len(mesh_shape))
    problem.edges.append(
        _edge(table, resolve_value(loss), OUTPUT_CONSUMER, -1, {rep: [0]}, tensor_bytes(loss.meta["val"]), transition)
    )
    for pname, g in zip(traced.trainable_names, grads, strict=True):
        pnode = param_node_name(pname)
        ps = table.nodes[pnode]
        groups: dict[Spec, list[int]] = {}
        for si, s in enumerate(ps.strategies):
            groups.setdefault(s.output_specs[0], []).append(si)
        problem.edges.append(
            _edge(table, resolve_value(g), pnode, -1, groups, tensor_bytes(g.meta["val"]), grad_transition, gradient=True)
        )
    return problem


def _is_follower(node: fx.Node, kind: str) -> bool:
    """Single tensor input, same number of elements out as in, not a matmul."""
    if kind != "op":
        return False
    targs = tensor_args(node)
    val = node.meta.get("val")
    if len(targs) != 1 or not isinstance(val, torch.Tensor) or is_matmul(node.target):
        return False
    return targs[0].meta["val"].numel() == val.numel()


@dataclass(slots=True)
class _TransitionCosts:
    """Memoised transition times on one cluster (a model repeats the same few (spec, spec,
    bytes) triples on thousands of edges), by spec number (:meth:`number`): a lookup hashes ints,
    not placements."""

    cluster: Cluster
    _numbers: dict[Spec, int] = field(default_factory=dict)
    _memo: dict[tuple[int, bool], dict[tuple[int, int], float]] = field(default_factory=dict)
    """``(full_bytes, gradient) -> (number of p, number of q) -> seconds``."""

    def number(self, spec: Spec) -> int:
        """A number per distinct spec (equal specs, one number)."""
        return self._numbers.setdefault(spec, len(self._numbers))

    def __call__(self, p: Spec, q: Spec, full_bytes: int, gradient: bool) -> float:
        return self.matrix((p,), (q,), full_bytes, gradient)[0][0]

    def matrix(
        self, src: Sequence[Spec], dst: Sequence[Spec], full_bytes: int, gradient: bool
    ) -> tuple[tuple[float, ...], ...]:
        """``[[time of p -> q for q in dst] for p in src]`` (:class:`PairCosts`)."""
        memo = self._memo.setdefault((full_bytes, gradient), {})
        cols = [(q, self.number(q)) for q in dst]
        rows = []
        for p in src:
            i = self.number(p)
            row = []
            for q, j in cols:
                cost = memo.get((i, j))
                if cost is None:
                    latency = not (gradient and is_coalescable(plan_transition(p, q)))
                    cost = memo[i, j] = transition_cost_s(p, q, full_bytes, self.cluster, include_latency=latency)
                row.append(cost)
            rows.append(tuple(row))
        return tuple(rows)


@dataclass(frozen=True, slots=True)
class _OnAxes:
    """A conversion's time with the ``skipped`` mesh axes left as the destination has them."""

    transition: _TransitionCosts
    skipped: tuple[int, ...]

    def __call__(self, p: Spec, q: Spec, full_bytes: int, gradient: bool) -> float:
        p = tuple(q[i] if i in self.skipped else x for i, x in enumerate(p))
        return self.transition(p, q, full_bytes, gradient)

    def matrix(
        self, src: Sequence[Spec], dst: Sequence[Spec], full_bytes: int, gradient: bool
    ) -> tuple[tuple[float, ...], ...]:
        return tuple(tuple(self(p, q, full_bytes, gradient) for q in dst) for p in src)


def _edge(
    table: StrategyTable,
    ref: ValueRef,
    consumer: str,
    arg_index: int,
    dst_groups: dict[Spec, list[int]],
    full_bytes: int,
    transition: _TransitionCosts | _OnAxes,
    *,
    gradient: bool = False,
) -> Edge:
    src_groups: dict[Spec, list[int]] = {}
    for si, s in enumerate(table.nodes[ref.node].strategies):
        spec = s.output_specs[ref.index]
        assert spec is not None, (ref, consumer)
        src_groups.setdefault(spec, []).append(si)
    src, dst = tuple(src_groups), tuple(dst_groups)
    cost = PairCosts(src, dst, transition.matrix(src, dst, full_bytes, gradient))
    return Edge(
        producer=ref,
        consumer=consumer,
        arg_index=arg_index,
        src_groups={k: tuple(v) for k, v in src_groups.items()},
        dst_groups={k: tuple(v) for k, v in dst_groups.items()},
        cost_s=cost,
        full_bytes=full_bytes,
    )


def _add_memory(problem: CostProblem, traced: TracedProgram, table: StrategyTable, optimizer: str) -> None:
    """Bytes per strategy and the memory checkpoints of :mod:`autoplan.passes.liveness`."""
    mesh_shape = table.mesh_shape
    trainable = [param_node_name(p) for p in traced.trainable_names]
    live = liveness.analyze(traced.graph_module, trainable)
    for name, ns in table.nodes.items():
        if ns.kind not in ("param", "input", "target", "buffer"):
            continue
        val = live.value_shape[ValueRef(name)]
        sizes = []
        for s in ns.strategies:
            local = local_numel(s.output_specs[0], val.shape, mesh_shape)
            if ns.kind == "param":
                parts = param_training_bytes_by_part(local, val.element_size(), optimizer, trainable=name in live.grads)
                sizes.append(float(parts["params"] + parts["optimizer"]))
            else:
                sizes.append(float(local * val.element_size()))
        problem.persistent_bytes[name] = sizes
        if name in live.grads:  # a trainable parameter's gradient, counted from its birth (memory_points)
            problem.grad_bytes[name] = [
                float(local_numel(s.output_specs[0], val.shape, mesh_shape) * val.element_size()) for s in ns.strategies
            ]
    for storage in live.births():
        ns = table.nodes.get(storage.node)
        if ns is None:  # a constant or an op outside the table: replicated, same for every plan
            continue
        t = live.value_shape[storage]
        problem.value_bytes[storage] = [
            float(liveness.local_bytes(s.output_specs[storage.index], t, mesh_shape)) for s in ns.strategies
        ]
    names = {i: n for n, i in live.position.items()}
    grad_born = live.grad_births()
    for pos in liveness.memory_checkpoints(live):
        storages = tuple(s for s in liveness.live_at(live, pos) if s in problem.value_bytes)
        grads = tuple(p for p, born in grad_born.items() if born <= pos)
        problem.memory_points.append(MemoryPoint(position=pos, node=names[pos], storages=storages, grads_of=grads))
