r"""Pass — liveness: which values of the training step are alive when, and the peak bytes per device.

Contract
--------
Input: the traced joint graph (nodes in execution order: the generated program runs them in
this order and FX frees every value after its last use). Output:

* :class:`Liveness` — for every tensor value its *storage* (a view aliases the storage of its
  input, so ``t``/``view``/``expand`` of a 1 GiB tensor adds nothing) and the interval of node
  positions during which that storage is alive. The ILP's memory constraint is built from it.
* :func:`peak_memory` — for one chosen assignment, the exact byte timeline of the program that
  :mod:`autoplan.runtime.codegen` generates, including the conversions (temporary buffers of collectives)
  and the optimizer step, and its peak.

Memory model (bytes per device)::

    M(t) = persistent + sum_{storage a alive at t} local_bytes(a)
    persistent = params + optimizer state + buffers + inputs        (local shards; a frozen
                                                                     parameter: no optimizer state)
    local_bytes(a) = numel under the producer's spec (S(d): ceil(n/mesh) along d; R and P: full)
                     x itemsize
    peak = max( max_t M(t),  persistent + grads + optimizer temporaries )   (optimizer step)
           + allocator_margin_bytes(peak)      (CUDA caching allocator; 0 on CPU, cost_models.memory)

Storage lifetimes: a storage is born at its producer's position ``i`` and dies after the last
node reading it or any of its views. Conversions of an operand run just before their consumer
(born at ``i - 1/2``, dead after ``i``); a gradient that is not bucketed is converted right after
its producer (``i + 1/2``, alive to the end: the optimizer reads it); bucketed gradients stay in
their producer's layout until the end, where one flat buffer per bucket is concatenated and
all-reduced in place.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate

from autoplan.cost_models.comm import plan_transition
from autoplan.cost_models.memory import (
    allocator_margin_bytes,
    collective_peak_bytes,
    optimizer_temp_bytes,
    param_training_bytes_by_part,
    tensor_bytes,
)
from autoplan.passes.placement import Spec, local_numel, local_shape, replicated, shard_dim
from autoplan.passes.strategies import Strategy, ValueRef, resolve_value, tensor_args

Storage = ValueRef
"""A storage is named by the value that allocated it."""


def is_view_op(target: object) -> bool:
    """True if the op's first output aliases an input (schema return annotated ``Tensor(a)``)."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    info = schema.returns[0].alias_info
    return info is not None and not info.is_write


def _outputs(node: fx.Node) -> list[tuple[int, torch.Tensor]]:
    val = node.meta.get("val")
    vals = list(val) if isinstance(val, (tuple, list)) else [val]
    return [(i, v) for i, v in enumerate(vals) if isinstance(v, torch.Tensor)]


@dataclass(frozen=True, slots=True)
class Liveness:
    """Storages of the joint graph and their lifetimes (node positions, graph order)."""

    position: Mapping[str, int]
    """Node name -> position in execution order."""
    end: int
    """Position of the graph's output node (gradients and loss are read there)."""
    storage_of: Mapping[ValueRef, Storage]
    """Every tensor value -> the storage it lives in (itself unless it is a view)."""
    placeholders: frozenset[str]
    """Placeholder storages (parameters, buffers, inputs): alive the whole step."""
    last_use: Mapping[Storage, int]
    """Last position reading the storage or a view of it, the output node excluded."""
    value_last_use: Mapping[ValueRef, int]
    """Last position reading a value or a view of it (-1 if only the output reads it)."""
    output_read: frozenset[Storage]
    """Storages the output node reads (the loss and the gradients)."""
    output_values: frozenset[ValueRef]
    """Values the output node reads."""
    grads: Mapping[str, ValueRef]
    """Parameter node name -> its gradient value."""
    value_shape: Mapping[ValueRef, torch.Tensor] = field(repr=False)
    """Every tensor value -> its (fake) tensor, for shapes and dtypes."""

    def births(self) -> dict[Storage, int]:
        """Non-placeholder storages -> birth position, in execution order (a fixed order: the ILP's
        memory constraints list their terms in it, and the solver's tie-breaking depends on that)."""
        return {s: self.position[s.node] for s in self.storages() if s.node not in self.placeholders}

    def storages(self) -> list[Storage]:
        """Every storage once, in execution order (then output index)."""
        return sorted(set(self.storage_of.values()), key=lambda s: (self.position[s.node], s.index))

    def ilp_interval(self, storage: Storage) -> tuple[int, int]:
        """Lifetime the ILP uses: from birth to the last graph use. Gradients leave their
        producer's layout right after production (or stay it, full size, under data
        parallelism); the ILP counts them through the parameter's layout instead
        (:meth:`grad_births`)."""
        born = self.position[storage.node]
        return born, max(born, self.last_use.get(storage, born))

    def grad_births(self) -> dict[str, int]:
        """Parameter node -> position at which its gradient exists."""
        return {p: self.position[self.storage_of[g].node] for p, g in self.grads.items()}


def analyze(gm: fx.GraphModule, trainable_param_nodes: Sequence[str]) -> Liveness:
    """Compute storages and lifetimes of ``gm`` (see the module docstring). The output node
    returns ``(loss, *grads)`` with one gradient per ``trainable_param_nodes``, in that order."""
    nodes = list(gm.graph.nodes)
    position = {n.name: i for i, n in enumerate(nodes)}
    storage_of: dict[ValueRef, Storage] = {}
    values: dict[ValueRef, torch.Tensor] = {}
    placeholders: set[str] = set()
    direct_last: dict[ValueRef, int] = {}
    view_parent: dict[ValueRef, ValueRef] = {}
    output_read: set[Storage] = set()
    output_values: set[ValueRef] = set()
    grads: dict[str, ValueRef] = {}
    for i, n in enumerate(nodes):
        if n.op == "output":
            loss, *gs = n.args[0]
            for g in (loss, *gs):
                output_read.add(storage_of[resolve_value(g)])
                output_values.add(resolve_value(g))
            for p, g in zip(trainable_param_nodes, gs, strict=True):
                grads[p] = resolve_value(g)
            continue
        if n.op == "call_function" and n.target is operator.getitem:
            continue
        if n.op == "placeholder":
            placeholders.add(n.name)
        args = tensor_args(n) if n.op == "call_function" else []
        for a in args:
            direct_last[resolve_value(a)] = i
        view = n.op == "call_function" and is_view_op(n.target) and args
        for idx, v in _outputs(n):
            ref = ValueRef(n.name, idx)
            values[ref] = v
            parent = resolve_value(args[0]) if view else None
            base = storage_of.get(parent) if parent is not None else None
            storage_of[ref] = base if base is not None else ref
            if base is not None and parent is not None:
                view_parent[ref] = parent
    # a value is read as long as any view of it is read (views are created after their parent)
    value_last: dict[ValueRef, int] = {}
    for ref in sorted(values, key=lambda r: -position[r.node]):
        last = max(direct_last.get(ref, -1), value_last.get(ref, -1))
        value_last[ref] = last
        parent = view_parent.get(ref)
        if parent is not None:
            value_last[parent] = max(value_last.get(parent, -1), last)
    last_use = {s: value_last[s] for s in set(storage_of.values()) if value_last.get(s, -1) >= 0}
    return Liveness(
        position=position,
        end=len(nodes) - 1,
        storage_of=storage_of,
        placeholders=frozenset(placeholders),
        last_use=last_use,
        value_last_use=value_last,
        output_read=frozenset(output_read),
        output_values=frozenset(output_values),
        grads=grads,
        value_shape=values,
    )


def local_bytes(spec: Spec | None, t: torch.Tensor, mesh_shape: Sequence[int]) -> int:
    if spec is None:
        return tensor_bytes(t)
    return local_numel(spec, t.shape, mesh_shape) * t.element_size()


def conversion_bytes(
    src: Spec, dst: Spec, t: torch.Tensor, mesh_shape: Sequence[int], device_kind: str
) -> tuple[float, float]:
    """``(held, peak)`` of converting ``t`` from ``src`` to ``dst`` as DTensor's redistribute
    does it (:func:`autoplan.cost_models.comm.plan_transition`'s single-axis steps): ``held``, the
    converted operand's local bytes (alive until its consumer has run); ``peak``, the most bytes
    the conversion has allocated at once, ``held`` included and the operand it converts not: a
    step's output beside the previous step's (its input, freed once the step is done) and the
    collective's buffers (:func:`autoplan.cost_models.memory.collective_peak_bytes`)."""
    cur = list(src)
    prev, peak = 0.0, 0.0
    for st in plan_transition(src, dst):
        before = tuple(cur)
        cur[st.axis] = st.dst
        if mesh_shape[st.axis] == 1:
            continue
        out = float(local_bytes(tuple(cur), t, mesh_shape))
        gathered = tuple(Replicate() if j == st.axis else p for j, p in enumerate(before))
        full = float(local_bytes(gathered, t, mesh_shape))
        dim = shard_dim(st.dst) if st.kind == "reduce_scatter" else shard_dim(st.src)
        relayout = dim is not None and math.prod(local_shape(gathered, t.shape, mesh_shape)[:dim]) > 1
        step = collective_peak_bytes(st.kind, full_bytes=full, out_bytes=out, device_kind=device_kind, relayout=relayout)
        peak = max(peak, prev + step)
        prev = out
    return prev, max(peak, prev)


def memory_checkpoints(live: Liveness, *, max_points: int = 12) -> list[int]:
    """Positions where the ILP bounds memory: the local maxima of the full-size live bytes
    (largest first, at most ``max_points``), the end of the forward and the end of the graph."""
    births = live.births()
    delta = [0] * (live.end + 2)
    for s, born in births.items():
        _, last = live.ilp_interval(s)
        nbytes = tensor_bytes(live.value_shape[s])
        delta[born] += nbytes
        delta[last + 1] -= nbytes
    grad_births = live.grad_births()
    for p, born in grad_births.items():
        delta[born] += tensor_bytes(live.value_shape[ValueRef(p)])
    curve, acc = [], 0
    for d in delta[:-1]:
        acc += d
        curve.append(acc)
    peaks = [
        i
        for i in range(len(curve))
        if curve[i] > 0 and (i == 0 or curve[i] >= curve[i - 1]) and (i == len(curve) - 1 or curve[i] > curve[i + 1])
    ]
    peaks.sort(key=lambda i: -curve[i])
    return sorted(set(peaks[:max_points]) | {live.end})


def live_at(live: Liveness, t: int) -> list[Storage]:
    """Non-placeholder storages the ILP counts as alive at position ``t``."""
    out = []
    for s in live.births():
        lo, hi = live.ilp_interval(s)
        if lo <= t <= hi:
            out.append(s)
    return out


def transient_timeline(
    live: Liveness, nbytes: Callable[[Storage], float], *, excluded: Collection[Storage] = ()
) -> list[float]:
    """Bytes of the non-placeholder storages alive at each node position (``T(i)``, one entry per
    position up to the output node), each storage ``nbytes(storage)`` bytes, the ``excluded``
    ones left out (the joint search's per-segment transients leave out the saved activations and
    the parameter gradients, counted apart: :mod:`autoplan.planner.segment_costs`).

    Lifetimes are those of :func:`peak_memory`: born at the producer's position, alive through
    the last node reading the storage or a view of it; a storage the output reads (the loss, an
    unconverted gradient) stays alive to the end."""
    delta = [0.0] * (live.end + 2)
    skip = set(excluded)
    for s, born in live.births().items():
        if s in skip:
            continue
        b = nbytes(s)
        if not b:
            continue
        last = live.end if s in live.output_read else max(born, live.last_use.get(s, born))
        delta[born] += b
        delta[last + 1] -= b
    curve, acc = [], 0.0
    for d in delta[:-1]:
        acc += d
        curve.append(acc)
    return curve


# ----------------------------------------------------------------------------------------------
# exact timeline of one plan


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryEstimate:
    """Peak bytes per device of one planned training step (see the module docstring)."""

    peak_bytes: float
    peak_at: str
    """Node at which the peak occurs (``<optimizer>`` for the optimizer step)."""
    breakdown: Mapping[str, float]
    """Bytes by category at the peak: params, optimizer, buffers, inputs, grads, activations."""

    def as_dict(self) -> dict[str, float]:
        return {**self.breakdown, "total": self.peak_bytes}


@dataclass(slots=True)
class _Interval:
    start: float
    stop: float
    nbytes: float
    category: str


def peak_memory(
    gm: fx.GraphModule,
    live: Liveness,
    assignment: Mapping[str, Strategy],
    redistributions: Sequence[object],
    *,
    mesh_shape: Sequence[int],
    optimizer: str,
    param_nodes: Sequence[str],
    device_kind: str,
) -> MemoryEstimate:
    """Exact byte timeline of the generated program for ``assignment`` (see the module docstring).

    ``redistributions`` are :class:`autoplan.passes.redistribute.Redistribution` values (duck-typed here to keep
    the dependency one way: apply imports liveness, not the reverse). ``param_nodes`` are every
    parameter, frozen ones included; those with a gradient in ``live.grads`` are trained."""
    spec_of = _spec_lookup(assignment, replicated(len(mesh_shape)))
    params = set(param_nodes)
    fixed = _persistent_bytes(live, spec_of, params, optimizer=optimizer, mesh_shape=mesh_shape)
    conv = _conversions(gm, live, redistributions, spec_of, params, mesh_shape=mesh_shape, device_kind=device_kind)
    intervals = _storage_intervals(
        gm, live, spec_of, conv.converted_after_production, conv.converted_reads, mesh_shape=mesh_shape
    )
    base = sum(fixed.persistent.values())
    best, best_at, best_parts = _timeline_peak(live, base, [*intervals, *conv.intervals], conv.bucketed)
    temp = optimizer_temp_bytes(optimizer, fixed.max_param_local, fixed.trained_param_bytes, device_kind)
    if base + fixed.grads_final + temp > best:
        best, best_at = base + fixed.grads_final + temp, "<optimizer>"
        best_parts = {"grads": fixed.grads_final, "activations": temp}
    margin = allocator_margin_bytes(best, device_kind)
    return MemoryEstimate(
        peak_bytes=best + margin,
        peak_at=best_at,
        breakdown={**fixed.persistent, **best_parts, **({"allocator": margin} if margin else {})},
    )


def _spec_lookup(assignment: Mapping[str, Strategy], rep: Spec) -> Callable[[ValueRef], Spec]:
    """Assignment -> the placement of a value (``rep`` where the assignment gives none)."""

    def spec_of(ref: ValueRef) -> Spec:
        strat = assignment.get(ref.node)
        if strat is None:
            return rep
        spec = strat.output_specs[ref.index] if ref.index < len(strat.output_specs) else None
        return spec if spec is not None else rep

    return spec_of


@dataclass(frozen=True, kw_only=True, slots=True)
class _Persistent:
    persistent: dict[str, float]
    """Bytes alive the whole step: params, optimizer, buffers, inputs."""
    grads_final: float
    """Bytes of the trained parameters' gradients at the optimizer step."""
    max_param_local: int
    """The largest trained parameter shard (the optimizer's temporaries are those of the parameters it updates)."""
    trained_param_bytes: int


def _persistent_bytes(
    live: Liveness,
    spec_of: Callable[[ValueRef], Spec],
    params: set[str],
    *,
    optimizer: str,
    mesh_shape: Sequence[int],
) -> _Persistent:
    """Placeholders -> the bytes alive the whole step by category, and what the optimizer step adds."""
    persistent: dict[str, float] = {"params": 0.0, "optimizer": 0.0, "buffers": 0.0, "inputs": 0.0}
    grads_final = 0.0
    max_param_local = 0
    trained_param_bytes = 0
    for name in live.placeholders:
        val = live.value_shape.get(ValueRef(name))
        if val is None:
            continue
        nbytes = local_bytes(spec_of(ValueRef(name)), val, mesh_shape)
        if name in params:
            numel = nbytes // val.element_size()
            parts = param_training_bytes_by_part(numel, val.element_size(), optimizer, trainable=name in live.grads)
            persistent["params"] += parts["params"]
            persistent["optimizer"] += parts["optimizer"]
            grads_final += parts["grads"]
            if name in live.grads:
                max_param_local = max(max_param_local, nbytes)
                trained_param_bytes += nbytes
        elif name.startswith(("input_", "target_")):
            persistent["inputs"] += nbytes
        else:
            persistent["buffers"] += nbytes
    return _Persistent(
        persistent=persistent,
        grads_final=grads_final,
        max_param_local=max_param_local,
        trained_param_bytes=trained_param_bytes,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class _Conversions:
    intervals: list[_Interval]
    """Temporary buffers of operand conversions and of gradients converted right after production."""
    converted_after_production: set[Storage]
    """Gradient storages converted right after their producer (not bucketed)."""
    converted_reads: set[tuple[Storage, int]]
    """(storage, consumer position) of every operand read through a conversion."""
    bucketed: dict[str, float]
    """Bucket -> bytes of its flat buffer, allocated at the end."""


def _conversions(
    gm: fx.GraphModule,
    live: Liveness,
    redistributions: Sequence[object],
    spec_of: Callable[[ValueRef], Spec],
    params: set[str],
    *,
    mesh_shape: Sequence[int],
    device_kind: str,
) -> _Conversions:
    """Redistributions of the generated program -> the buffers their collectives allocate: an
    operand's converted copy from just before its consumer to its end, and what the conversion
    allocates beyond it while it runs (:func:`conversion_bytes`), at ``i - 1/2`` only."""
    gm_targets = {n.name: n.target for n in gm.graph.nodes}
    converted_after_production: set[Storage] = set()
    bucketed: dict[str, float] = {}
    conversions: list[_Interval] = []
    converted_reads: set[tuple[Storage, int]] = set()
    for r in redistributions:
        consumer, arg_index = r.consumer, r.arg_index  # type: ignore[attr-defined]
        producer, dst, bucket = r.producer, r.dst, r.bucket  # type: ignore[attr-defined]
        val = live.value_shape[producer]
        nbytes = local_bytes(dst, val, mesh_shape)
        if consumer in params and arg_index == -1:
            if bucket is not None:
                bucketed[bucket] = bucketed.get(bucket, 0.0) + local_bytes(spec_of(producer), val, mesh_shape)
            else:
                s = live.storage_of[producer]
                converted_after_production.add(s)
                conversions.append(_Interval(live.position[producer.node] + 0.5, live.end, nbytes, "grads"))
            continue
        if consumer not in live.position:  # the loss -> output conversion: a scalar
            continue
        pos = live.position[consumer]
        converted_reads.add((live.storage_of[producer], pos))
        # a view of a converted operand keeps the conversion's buffer alive
        stop = max(pos, live.value_last_use.get(ValueRef(consumer), pos)) if is_view_op(gm_targets[consumer]) else pos
        conversions.append(_Interval(pos - 0.5, stop, nbytes, "activations"))
        held, peak = conversion_bytes(r.src, dst, val, mesh_shape, device_kind)  # type: ignore[attr-defined]
        if peak > held:
            conversions.append(_Interval(pos - 0.5, pos - 0.5, peak - held, "activations"))
    return _Conversions(
        intervals=conversions,
        converted_after_production=converted_after_production,
        converted_reads=converted_reads,
        bucketed=bucketed,
    )


def _storage_intervals(
    gm: fx.GraphModule,
    live: Liveness,
    spec_of: Callable[[ValueRef], Spec],
    converted_after_production: set[Storage],
    converted_reads: set[tuple[Storage, int]],
    *,
    mesh_shape: Sequence[int],
) -> list[_Interval]:
    """Non-placeholder storages -> their lifetime and local bytes (program outputs read as they
    are stay alive to the end). A storage whose last reader reads it only through a conversion
    dies once converted (at ``i - 1/2``): the program drops it after its last use, the
    conversion, before the consumer allocates its output."""
    direct_reads = _direct_reads(gm, live, converted_reads)
    grad_storages = {live.storage_of[g] for g in live.grads.values()}
    read_as_is = {live.storage_of[v] for v in live.output_values} - converted_after_production
    intervals: list[_Interval] = []
    for s in live.storages():
        if s.node in live.placeholders:
            continue
        born = live.position[s.node]
        last: float = live.last_use.get(s, born)
        if s in read_as_is:
            last = live.end
        elif (s, last) in converted_reads and (s, last) not in direct_reads:
            last -= 0.5
        elif s in converted_after_production:
            last = max(last, born + 0.5)
        category = "grads" if s in grad_storages else "activations"
        intervals.append(_Interval(born, last, local_bytes(spec_of(s), live.value_shape[s], mesh_shape), category))
    return intervals


def _direct_reads(
    gm: fx.GraphModule, live: Liveness, converted_reads: set[tuple[Storage, int]]
) -> set[tuple[Storage, int]]:
    """The (storage, position) pairs of ``converted_reads`` where the consumer also reads the
    storage (or a view of it) as it is, through another operand."""
    out: set[tuple[Storage, int]] = set()
    positions = {pos for _, pos in converted_reads}
    for n in gm.graph.nodes:
        pos = live.position.get(n.name)
        if pos not in positions or n.op != "call_function":
            continue
        storages = [live.storage_of.get(resolve_value(a)) for a in tensor_args(n)]
        for s in storages:
            if s is not None and (s, pos) in converted_reads and storages.count(s) > 1:
                out.add((s, pos))
    return out


def _timeline_peak(
    live: Liveness, base: float, intervals: Sequence[_Interval], bucketed: Mapping[str, float]
) -> tuple[float, str, dict[str, float]]:
    """Intervals over the persistent ``base`` -> the peak of the byte timeline, the node at which
    it occurs and its gradient/activation bytes."""
    events: list[tuple[float, int, float, str]] = []  # (time, 0=alloc/1=free, bytes, category)
    for iv in intervals:
        events.append((iv.start, 0, iv.nbytes, iv.category))
        events.append((iv.stop + 0.25, 1, -iv.nbytes, iv.category))
    # bucketed gradients: one flat buffer per bucket, concatenated and reduced at the end
    for bucket_bytes in bucketed.values():
        events.append((live.end, 0, bucket_bytes, "grads"))
        events.append((live.end + 0.25, 1, -bucket_bytes, "grads"))
    events.sort(key=lambda e: (e[0], e[1]))
    names = {v: k for k, v in live.position.items()}
    cur: dict[str, float] = {"grads": 0.0, "activations": 0.0}
    best: float = base
    best_at, best_parts = "<start>", dict(cur)
    for t, kind, delta, category in events:
        cur[category] += delta
        if kind == 0 and base + sum(cur.values()) > best:
            best, best_parts = base + sum(cur.values()), dict(cur)
            best_at = names.get(int(t + 0.5), "<output>")  # a conversion at i - 1/2 belongs to node i
    return best, best_at, best_parts
