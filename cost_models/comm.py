"""Communication cost: collectives and the placement transitions that need them.

Ring algorithms on one mesh axis of ``n`` ranks, link bandwidth ``bw`` (bytes/s, per device,
one direction) and per-hop latency ``lat`` (Thakur, Rabenseifner & Gropp, "Optimization of
Collective Communication Operations in MPICH", IJHPCA 2005)::

    all_gather(B_out)     = (n-1)/n * B_out / bw + (n-1) * lat
    reduce_scatter(B_in)  = (n-1)/n * B_in  / bw + (n-1) * lat
    all_reduce(B)         = 2 (n-1)/n * B   / bw + 2 (n-1) * lat   (reduce_scatter + all_gather)
    all_to_all(B_local)   = (n-1)/n * B_local / bw + (n-1) * lat
    send_recv(B)          =             B   / bw +         lat     (point to point, one message)

All-reduce may also run as NCCL's double binary tree (Sanders, Speck & Träff, "Two-tree
algorithms for full bandwidth broadcast, reduction and scan", Parallel Computing 2009; NVIDIA,
"Massively Scale Your Deep Learning Training with NCCL 2.4", 2019): a pipelined reduce up and
broadcast down ``ceil(log2 n)`` levels, each byte crossing a link twice::

    all_reduce_tree(B)    = 2 * B / bw + 2 * ceil(log2 n) * lat

``algorithm="auto"`` prices an all-reduce at the cheaper of ring and tree (NCCL's tuner picks per
call the same way); gloo only has the ring, so CPU clusters use ``"ring"``. Every formula is
``latency_steps * lat + bytes_factor * B / bw`` (:func:`collective_terms`), which is the family
``autoplan.cost_models.calibration`` fits: a link may carry fitted ``(bw, lat)`` per kind
(``LinkSpec.collectives``), always in the *ring* convention, and those replace the link's generic
numbers for that kind (:func:`link_time_s`). A fitted all-reduce already contains whatever
algorithm the library chose, so it is never re-priced as a tree.

On CPU ranks gloo has no all_to_all: DTensor all-gathers the axis and keeps its chunk, so an
all_to_all of ``B_local`` costs ``all_gather(n * B_local)`` there (:func:`effective_collective`).

A *transition* converts a tensor from one spec (placement per mesh axis) to another, one axis
at a time; :func:`plan_transition` gives the exact sequence of single-axis steps that the
generated program executes, so the planner pays for precisely the collectives that run::

    S(d) -> R     all_gather        P -> R     all_reduce       R -> S(d)  local chunk (free)
    S(d) -> S(e)  all_to_all        P -> S(d)  reduce_scatter   R -> P     local (free)

Axes sharding the same tensor dim are nested (axis 0 outermost, as in DTensor); before an axis
changes to or from ``S(d)``, inner axes sharded on ``d`` are gathered first and re-sharded
afterwards.

A segment shard ``S(d)/k`` (DTensor's ``_StridedShard``: dim ``d`` as ``k`` equal segments, each
sharded) moves like ``S(d)`` with one difference: no all_to_all into or out of it (the segments
interleave, so a chunk exchange does not produce the other layout); it is all-gathered to ``R``
first (same bytes as ``S(d) -> R``), and ``R -> S(d)/k`` is a local slice of each segment::

    S(d)/k -> R   all_gather         R -> S(d)/k   local slices (free)      P -> S(d)/k   all_reduce, slices
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autoplan.cost_models.cluster import (
    COLLECTIVE_KINDS,
    COMM_KINDS,
    LOCAL_KINDS,
    Backend,
    Cluster,
    CommKind,
    LinkSpec,
    StepKind,
)
from autoplan.cost_models.hardware import DeviceSpec

Algorithm = Literal["ring", "tree", "auto"]

__all__ = [
    "COLLECTIVE_KINDS",
    "COMM_KINDS",
    "Algorithm",
    "CommKind",
    "LOCAL_KINDS",
    "StepKind",
    "TransitionStep",
    "collective_terms",
    "collective_time_s",
    "effective_collective",
    "bucket_kind",
    "is_coalescable",
    "link_time_s",
    "plan_transition",
    "step_bytes",
    "transition_cost_s",
]


@dataclass(frozen=True, slots=True)
class TransitionStep:
    """Change the placement of one mesh axis."""

    kind: StepKind
    axis: int
    src: Placement
    dst: Placement

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVE_KINDS

    def __str__(self) -> str:
        return f"{self.kind}@{self.axis}"


def collective_terms(kind: str, num_ranks: int, *, algorithm: Literal["ring", "tree"] = "ring") -> tuple[float, float]:
    """``(latency_steps, bytes_factor)`` of one collective: its time is
    ``latency_steps * lat + bytes_factor * nbytes / bw`` (formulas in the module docstring).

    ``(0, 0)`` for a single rank or a local step kind; ``algorithm="tree"`` exists for all_reduce only."""
    if kind in LOCAL_KINDS:
        return 0.0, 0.0
    if kind not in COMM_KINDS:
        raise ValueError(f"unknown communication kind {kind!r}; use one of {', '.join(COMM_KINDS)}")
    if algorithm == "tree" and kind != "all_reduce":
        raise ValueError(f"algorithm='tree' is defined for all_reduce only, not {kind!r}; use 'ring' or 'auto'")
    n = num_ranks
    if n <= 1:
        return 0.0, 0.0
    if kind == "send_recv":
        return 1.0, 1.0
    if kind == "all_reduce":
        if algorithm == "tree":
            return 2.0 * math.ceil(math.log2(n)), 2.0
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    return float(n - 1), (n - 1) / n


def collective_time_s(
    kind: str,
    nbytes: float,
    num_ranks: int,
    bw_GBps: float,
    latency_us: float,
    *,
    algorithm: Algorithm = "auto",
) -> float:
    """Time of one collective (see module docstring); ``nbytes`` per its convention.

    ``algorithm`` matters for all_reduce only: "ring", "tree", or "auto" = the faster of the two.
    Local step kinds ("shard", "to_partial") and a single rank cost 0."""
    if algorithm == "auto":
        candidates: tuple[Literal["ring", "tree"], ...] = ("ring", "tree") if kind == "all_reduce" else ("ring",)
    else:
        candidates = (algorithm,)
    bw = bw_GBps * 1e9
    lat = latency_us * 1e-6
    times = []
    for algo in candidates:
        latency_steps, bytes_factor = collective_terms(kind, num_ranks, algorithm=algo)
        times.append(latency_steps * lat + (bytes_factor * nbytes / bw if bytes_factor else 0.0))
    return min(times)


ROUTING_IMBALANCE = 1.25
"""Rows the busiest expert shard receives, relative to the mean, as priced: the capacity factor
Switch Transformer trains with (Fedus et al. 2021, "Switch Transformers", Sec. 2.2: 1.25) and
GShard's load-balancing bound (Lepikhin et al. 2020). Routing is dropless here (no row is
dropped whatever the imbalance); the factor only prices the slowest rank."""


def expert_exchange_bytes(routed_bytes: float, experts: int, *, backward: bool) -> tuple[float, float, float]:
    """Bytes one rank sends in each all-to-all of an expert-parallel MoE op, in the order
    :mod:`autoplan.passes.moe`'s dispatch runs them: the per-expert row counts (int64), the routed
    rows out, the results back. ``routed_bytes``: the rank's routed rows (its tokens times top-k
    times a row's bytes), the busiest rank's at :data:`ROUTING_IMBALANCE` times the mean; the
    backward sends rows with their output gradients and gets input gradients with expert outputs
    back (twice the bytes)."""
    rows = routed_bytes * ROUTING_IMBALANCE * (2 if backward else 1)
    return (8.0 * experts, rows, rows)


def expert_exchange_s(routed_bytes: float, experts: int, num_ranks: int, link: LinkSpec, *, backward: bool) -> float:
    """Time of :func:`expert_exchange_bytes`'s all-to-alls over ``num_ranks`` ranks on ``link``
    (ring convention, ``all_to_all_single`` on every backend)."""
    fit = link.params("all_to_all")
    return sum(
        collective_time_s("all_to_all", b, num_ranks, fit.bw_GBps, fit.latency_us, algorithm="ring")
        for b in expert_exchange_bytes(routed_bytes, experts, backward=backward)
    )


def effective_collective(kind: str, nbytes: float, num_ranks: int, *, backend: Backend) -> tuple[str, float]:
    """The collective that really runs for ``kind`` on ``backend``, and its payload: gloo has no
    all_to_all, so DTensor all-gathers ``num_ranks * nbytes`` and keeps its chunk."""
    if kind == "all_to_all" and backend == "gloo":
        return "all_gather", nbytes * num_ranks
    return kind, nbytes


@functools.lru_cache(maxsize=1 << 16)
def link_time_s(
    kind: str,
    nbytes: float,
    num_ranks: int,
    link: LinkSpec,
    *,
    backend: Backend,
    algorithm: Algorithm | None = None,
    include_latency: bool = True,
) -> float:
    """Time of one ``kind`` message of ``nbytes`` over ``num_ranks`` ranks on ``link``.

    A kind with calibrated parameters on the link is priced with them in the ring convention it
    was fitted in; otherwise the link's generic numbers and ``algorithm`` apply (default: "auto"
    on NCCL, "ring" on gloo). ``include_latency=False`` gives the bandwidth term only.
    Memoised: the pipeline search prices the same few messages for thousands of candidates."""
    params = link.params(kind)
    run_kind, run_bytes = effective_collective(kind, nbytes, num_ranks, backend=backend)
    if kind in link.collectives:
        algo: Algorithm = "ring"
    else:
        algo = algorithm if algorithm is not None else ("ring" if backend == "gloo" else "auto")
    latency_us = params.latency_us if include_latency else 0.0
    return collective_time_s(run_kind, run_bytes, num_ranks, params.bw_GBps, latency_us, algorithm=algo)


def _step(kind: StepKind, axis: int, src: Placement, dst: Placement) -> TransitionStep:
    return TransitionStep(kind=kind, axis=axis, src=src, dst=dst)


def plan_transition(src: Sequence[Placement], dst: Sequence[Placement]) -> tuple[TransitionStep, ...]:
    """Single-axis steps turning ``src`` into ``dst`` (see the module docstring for the rules).
    Memoised by the placements and their types (the costing pass asks for the same few pairs on
    thousands of edges)."""
    return _planned_transition(_typed(src), _typed(dst))


def _typed(spec: Sequence[Placement]) -> tuple[tuple[type, Placement], ...]:
    """``spec`` as a memo key: each placement with its type (a rule below tells ``Shard`` from a
    ``_StridedShard`` of the same dim by type)."""
    return tuple((type(p), p) for p in spec)


@functools.lru_cache(maxsize=1 << 16)
def _planned_transition(
    src_typed: tuple[tuple[type, Placement], ...], dst_typed: tuple[tuple[type, Placement], ...]
) -> tuple[TransitionStep, ...]:
    src = [p for _, p in src_typed]
    dst = [p for _, p in dst_typed]
    cur = list(src)
    n = len(cur)
    steps: list[TransitionStep] = []
    R = Replicate()

    def shard_dim(p: Placement) -> int | None:
        return p.dim if isinstance(p, (Shard, _StridedShard)) else None

    def unshard_inner(axis: int, dim: int) -> None:
        for j in range(n - 1, axis, -1):
            if shard_dim(cur[j]) == dim:
                steps.append(_step("all_gather", j, cur[j], R))
                cur[j] = R

    def sharded_elsewhere(axis: int, dim: int) -> bool:
        return any(shard_dim(cur[j]) == dim for j in range(n) if j != axis)

    # 1. leave shardings that must change, innermost axis first
    for i in reversed(range(n)):
        p, q = cur[i], dst[i]
        p_dim = shard_dim(p)
        if p_dim is not None and p != q:
            unshard_inner(i, p_dim)
            if type(p) is Shard and type(q) is Shard and not sharded_elsewhere(i, q.dim):
                steps.append(_step("all_to_all", i, p, q))
                cur[i] = q
            else:
                steps.append(_step("all_gather", i, p, R))
                cur[i] = R
    # 2. reduce partial sums
    for i in range(n):
        p, q = cur[i], dst[i]
        if isinstance(p, Partial) and p != q:
            if type(q) is Shard and not sharded_elsewhere(i, q.dim):
                unshard_inner(i, q.dim)
                steps.append(_step("reduce_scatter", i, p, q))
                cur[i] = q
            else:
                steps.append(_step("all_reduce", i, p, R))
                cur[i] = R
    # 3. local re-layouts from replicated, outermost axis first
    for i in range(n):
        p, q = cur[i], dst[i]
        if p == q:
            continue
        assert isinstance(p, Replicate), (src, dst, cur)
        q_dim = shard_dim(q)
        if q_dim is not None:
            unshard_inner(i, q_dim)
            steps.append(_step("shard", i, p, q))
        else:
            steps.append(_step("to_partial", i, p, q))
        cur[i] = q
    # axes gathered by unshard_inner in step 3 are re-sharded by later iterations; re-check
    for i in range(n):
        if cur[i] != dst[i]:
            assert isinstance(cur[i], Replicate), (src, dst, cur)
            steps.append(
                _step("shard", i, cur[i], dst[i])
                if shard_dim(dst[i]) is not None
                else _step("to_partial", i, cur[i], dst[i])
            )
            cur[i] = dst[i]
    return tuple(steps)


def _local_bytes(spec: Sequence[Placement], full_bytes: float, mesh_shape: Sequence[int]) -> float:
    return full_bytes / _local_divisor(spec, mesh_shape)


def _local_divisor(spec: Sequence[Placement], mesh_shape: Sequence[int]) -> int:
    """How many pieces ``spec`` splits a tensor's bytes into: the product of its sharded axes."""
    div = 1
    for p, size in zip(spec, mesh_shape, strict=True):
        if isinstance(p, (Shard, _StridedShard)):
            div *= size
    return div


def step_bytes(
    step: TransitionStep, before: Sequence[Placement], full_bytes: float, mesh_shape: Sequence[int]
) -> float:
    """Payload of one step in the convention of :func:`collective_time_s`."""
    after = list(before)
    after[step.axis] = step.dst
    if step.kind == "all_gather":
        return _local_bytes(after, full_bytes, mesh_shape)
    if step.kind == "reduce_scatter":
        return _local_bytes(before, full_bytes, mesh_shape)
    if step.kind == "all_reduce":
        return _local_bytes(before, full_bytes, mesh_shape)
    if step.kind == "all_to_all":
        return _local_bytes(before, full_bytes, mesh_shape)
    return 0.0


def bucket_kind(steps: Sequence[TransitionStep]) -> str | None:
    """How the generated program coalesces a gradient reduction with others, or ``None``.

    ``"all_reduce"``: made only of all-reduces, one flat all-reduce per bucket and mesh axis (DDP's
    buckets). ``"reduce_scatter"``: one reduce-scatter (a ZeRO-3/FSDP gradient), one flat
    reduce-scatter per bucket (FSDP2's per-block reduce-scatter). Either way the per-message
    latency is paid once per bucket, not once per tensor."""
    if steps and all(s.kind == "all_reduce" for s in steps):
        return "all_reduce"
    if len(steps) == 1 and steps[0].kind == "reduce_scatter":
        return "reduce_scatter"
    return None


def is_coalescable(steps: Sequence[TransitionStep]) -> bool:
    """Whether a gradient reduction joins a bucket (:func:`bucket_kind`)."""
    return bucket_kind(steps) is not None


def transition_cost_s(
    src: Sequence[Placement],
    dst: Sequence[Placement],
    full_bytes: float,
    cluster: Cluster,
    *,
    include_latency: bool = True,
    algorithm: Algorithm | None = None,
) -> float:
    """Time to convert a tensor of ``full_bytes`` (global size) from ``src`` to ``dst``.

    Each collective step is priced by :func:`link_time_s` on its axis's link (calibrated numbers
    when the cluster has them). ``include_latency=False`` gives the bandwidth term only (for
    coalesced gradient reductions; with ``algorithm="auto"`` the bandwidth and the latency of a
    bucket are then each priced at their cheaper algorithm, a slight underestimate of NCCL)."""
    if tuple(src) == tuple(dst):
        return 0.0
    mesh_shape = cluster.mesh_shape
    total = 0.0
    for kind, axis, divisor in _collective_payloads(_typed(src), _typed(dst), tuple(mesh_shape)):
        total += link_time_s(
            kind,
            full_bytes / divisor,  # step_bytes: the local bytes of the step's payload
            mesh_shape[axis],
            cluster.axis_link(axis),
            backend=cluster.backend,
            algorithm=algorithm,
            include_latency=include_latency,
        )
    return total


@functools.lru_cache(maxsize=1 << 16)
def _collective_payloads(
    src_typed: tuple[tuple[type, Placement], ...],
    dst_typed: tuple[tuple[type, Placement], ...],
    mesh_shape: tuple[int, ...],
) -> tuple[tuple[StepKind, int, int], ...]:
    """The collective steps of :func:`plan_transition` as ``(kind, axis, divisor)``: each step's
    payload (:func:`step_bytes`) is ``full_bytes / divisor``, the divisor being the product of the
    axes that shard the layout it is measured in (:func:`_local_divisor`). Memoised: a
    transition's price is these steps priced at each tensor's bytes."""
    cur = [p for _, p in src_typed]
    out = []
    for step in _planned_transition(src_typed, dst_typed):
        if step.is_collective:
            after = list(cur)
            after[step.axis] = step.dst
            out.append((step.kind, step.axis, _local_divisor(after if step.kind == "all_gather" else cur, mesh_shape)))
        cur[step.axis] = step.dst
    return tuple(out)


def overlaps_compute(device: DeviceSpec) -> bool:
    """Whether collectives on this device run beside compute.

    GPUs: NCCL kernels run on their own stream and SMs while compute kernels continue (the
    overlap DDP and FSDP rely on). CPU ranks: gloo's ring reduction runs on the same cores the
    rank computes on, so an asynchronous collective only delays the compute it would hide behind;
    the CPU model treats every collective as exposed."""
    return device.name != "CPU"
