"""Communication cost: collectives and the placement transitions that need them.

Ring algorithms on one mesh axis of ``n`` ranks, link bandwidth ``bw`` (bytes/s, per device,
one direction) and per-hop latency ``lat`` (Thakur, Rabenseifner & Gropp, "Optimization of
Collective Communication Operations in MPICH", IJHPCA 2005)::

    all_gather(B_out)     = (n-1)/n * B_out / bw + (n-1) * lat
    reduce_scatter(B_in)  = (n-1)/n * B_in  / bw + (n-1) * lat
    all_reduce(B)         = 2 (n-1)/n * B   / bw + 2 (n-1) * lat   (reduce_scatter + all_gather)
    all_to_all(B_local)   = (n-1)/n * B_local / bw + (n-1) * lat

A *transition* converts a tensor from one spec (placement per mesh axis) to another, one axis
at a time; :func:`plan_transition` gives the exact sequence of single-axis steps that the
generated program executes, so the planner pays for precisely the collectives that run::

    S(d) -> R     all_gather        P -> R     all_reduce       R -> S(d)  local chunk (free)
    S(d) -> S(e)  all_to_all        P -> S(d)  reduce_scatter   R -> P     local (free)

Axes sharding the same tensor dim are nested (axis 0 outermost, as in DTensor); before an axis
changes to or from ``S(d)``, inner axes sharded on ``d`` are gathered first and re-sharded
afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from cost_models.cluster import Cluster

StepKind = Literal["all_gather", "all_reduce", "reduce_scatter", "all_to_all", "shard", "to_partial"]
COLLECTIVE_KINDS: frozenset[str] = frozenset({"all_gather", "all_reduce", "reduce_scatter", "all_to_all"})


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


def collective_time_s(kind: str, nbytes: float, num_ranks: int, bw_GBps: float, latency_us: float) -> float:
    """Ring-algorithm time of one collective (see module docstring); ``nbytes`` per its convention."""
    if num_ranks <= 1 or kind not in COLLECTIVE_KINDS:
        return 0.0
    n = num_ranks
    bw = bw_GBps * 1e9
    lat = latency_us * 1e-6
    if kind == "all_reduce":
        return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat
    return (n - 1) / n * nbytes / bw + (n - 1) * lat


def _step(kind: StepKind, axis: int, src: Placement, dst: Placement) -> TransitionStep:
    return TransitionStep(kind=kind, axis=axis, src=src, dst=dst)


def plan_transition(src: Sequence[Placement], dst: Sequence[Placement]) -> tuple[TransitionStep, ...]:
    """Single-axis steps turning ``src`` into ``dst`` (see the module docstring for the rules)."""
    cur = list(src)
    n = len(cur)
    steps: list[TransitionStep] = []
    R = Replicate()

    def shard_dim(p: Placement) -> int | None:
        return p.dim if isinstance(p, Shard) else None

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
        if isinstance(p, Shard) and p != q:
            unshard_inner(i, p.dim)
            if isinstance(q, Shard) and not sharded_elsewhere(i, q.dim):
                steps.append(_step("all_to_all", i, p, q))
                cur[i] = q
            else:
                steps.append(_step("all_gather", i, p, R))
                cur[i] = R
    # 2. reduce partial sums
    for i in range(n):
        p, q = cur[i], dst[i]
        if isinstance(p, Partial) and p != q:
            if isinstance(q, Shard) and not sharded_elsewhere(i, q.dim):
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
        if isinstance(q, Shard):
            unshard_inner(i, q.dim)
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
                if isinstance(dst[i], Shard)
                else _step("to_partial", i, cur[i], dst[i])
            )
            cur[i] = dst[i]
    return tuple(steps)


def _local_bytes(spec: Sequence[Placement], full_bytes: float, mesh_shape: Sequence[int]) -> float:
    div = 1
    for p, size in zip(spec, mesh_shape, strict=True):
        if isinstance(p, Shard):
            div *= size
    return full_bytes / div


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


def is_coalescable(steps: Sequence[TransitionStep]) -> bool:
    """Gradient reductions made only of all-reduces are coalesced into one flat all-reduce per
    (mesh axis, partial kind) by the generated program, as DDP buckets gradients: their per-message
    latency is paid once per step, not once per tensor."""
    return bool(steps) and all(s.kind == "all_reduce" for s in steps)


def transition_cost_s(
    src: Sequence[Placement],
    dst: Sequence[Placement],
    full_bytes: float,
    cluster: Cluster,
    *,
    include_latency: bool = True,
) -> float:
    """Time to convert a tensor of ``full_bytes`` (global size) from ``src`` to ``dst``.

    ``include_latency=False`` gives the bandwidth term only (for coalesced gradient reductions)."""
    if tuple(src) == tuple(dst):
        return 0.0
    mesh_shape = cluster.mesh_shape
    cur = list(src)
    total = 0.0
    for step in plan_transition(src, dst):
        if step.is_collective:
            link = cluster.axis_link(step.axis)
            nbytes = step_bytes(step, cur, full_bytes, mesh_shape)
            latency_us = link.latency_us if include_latency else 0.0
            kind = step.kind
            if kind == "all_to_all" and cluster.device.name == "CPU":
                # gloo has no all_to_all: DTensor gathers the whole axis and keeps its chunk
                kind, nbytes = "all_gather", nbytes * mesh_shape[step.axis]
            total += collective_time_s(kind, nbytes, mesh_shape[step.axis], link.bw_GBps, latency_us)
        cur[step.axis] = step.dst
    return total
