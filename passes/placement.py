"""Placement vocabulary shared by the solver, the plan file and the generated program.

A *placement* says how one tensor is laid out along one mesh axis: ``R`` (replicated),
``S(d)`` (sharded along tensor dim ``d``), ``P`` (partial sums still to be reduced) or
``P(avg)`` (partial values still to be averaged, e.g. a mean loss over a sharded batch), and
``S(d)/k``: dim ``d`` cut into ``k`` equal segments, each segment sharded, so a rank holds its
shard of every segment (DTensor's ``_StridedShard(d, split_factor=k)``; the layout of a fused
q/k/v or gate/up projection split by heads, :mod:`autoplan.passes.segments`). A *spec*
is one placement per mesh axis, written ``S(0)R`` in logs and ``["S(0)", "R"]`` in plan files.

These are thin, terse views over ``torch.distributed.tensor`` placements, which stay the
source of truth at run time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autoplan.passes.plan_text import parse_placement_text, segment_count

Spec = tuple[Placement, ...]
"""One placement per mesh axis."""


def shard_dim(p: Placement) -> int | None:
    """The tensor dim ``p`` splits (``S(d)`` and ``S(d)/k`` alike), ``None`` for ``R`` and ``P``."""
    return p.dim if isinstance(p, (Shard, _StridedShard)) else None


def is_segment_shard(p: Placement) -> bool:
    """True for ``S(d)/k`` (a sharded dim made of ``k`` segments sharded one by one)."""
    return isinstance(p, _StridedShard)


def placement_str(p: Placement) -> str:
    """Terse text of one placement: ``R``, ``S(0)``, ``S(0)/3`` or ``P``."""
    if type(p) is Replicate:
        return "R"
    if type(p) is Shard:
        return f"S({p.dim})"
    if type(p) is _StridedShard:
        return f"S({p.dim})/{p.split_factor}"
    if type(p) is Partial and p.reduce_op == "sum":
        return "P"
    if type(p) is Partial and p.reduce_op == "avg":
        return "P(avg)"
    raise ValueError(f"placement {p!r} is outside autoplan's vocabulary (R, S(d), S(d)/k, P, P(avg))")


def parse_placement(text: str) -> Placement:
    """Inverse of :func:`placement_str` (the syntax is :func:`autoplan.passes.plan_text.parse_placement_text`'s)."""
    kind, dim = parse_placement_text(text)
    if kind == "S":
        assert dim is not None
        k = segment_count(text)
        return Shard(dim) if k == 1 else _StridedShard(dim, split_factor=k)
    if kind == "R":
        return Replicate()
    return Partial("sum" if kind == "P" else "avg")


def spec_strs(spec: Sequence[Placement]) -> list[str]:
    return [placement_str(p) for p in spec]


def parse_spec(texts: Sequence[str]) -> Spec:
    return tuple(parse_placement(t) for t in texts)


def spec_str(spec: Sequence[Placement]) -> str:
    """``S(0)R`` style text used in logs, summaries and node names."""
    return "".join(placement_str(p) for p in spec)


def is_supported(p: Placement) -> bool:
    """True for the placements the planner reasons about (no masked variants)."""
    return type(p) in (Replicate, Shard, _StridedShard) or (type(p) is Partial and p.reduce_op in ("sum", "avg"))


def pin_admits(pinned: Sequence[Placement], spec: Sequence[Placement] | None) -> bool:
    """A pin keeps ``spec``: equal, or the pin's ``S(d)`` is ``S(d)/k`` in ``spec`` (a pinned
    column-parallel fused projection may be split by segments: its storage is split the same)."""
    return spec is not None and len(pinned) == len(spec) and all(
        p == q or (type(p) is Shard and is_segment_shard(q) and shard_dim(q) == p.dim)
        for p, q in zip(pinned, spec, strict=True)
    )


def shard_factor(spec: Sequence[Placement], mesh_shape: Sequence[int]) -> int:
    """How many pieces the data is split into (product of axes that are not ``R``)."""
    n = 1
    for p, size in zip(spec, mesh_shape, strict=True):
        if not isinstance(p, Replicate):
            n *= size
    return n


def storage_factor(spec: Sequence[Placement], mesh_shape: Sequence[int]) -> int:
    """How many pieces the *storage* is split into: only ``S`` divides bytes, ``P`` keeps a
    full-size buffer on every device."""
    n = 1
    for p, size in zip(spec, mesh_shape, strict=True):
        if shard_dim(p) is not None:
            n *= size
    return n


def is_shardable(spec: Sequence[Placement], shape: Sequence[int], mesh_shape: Sequence[int]) -> bool:
    """Every sharded dim must give each device at least one element; ``S(d)/k`` needs ``k`` equal
    segments that divide evenly (by the product of the axes sharding ``d``), and no other
    placement on ``d`` (a segment shard nested in another shard is not planned)."""
    per_dim: dict[int, int] = {}
    segments: dict[int, int] = {}
    for p, size in zip(spec, mesh_shape, strict=True):
        d = shard_dim(p)
        if d is None:
            continue
        if d >= len(shape) or d < 0:
            return False
        per_dim[d] = per_dim.get(d, 1) * size
        if isinstance(p, _StridedShard):
            segments[d] = int(p.split_factor)
    for d, k in segments.items():
        if sum(shard_dim(p) == d for p in spec) > 1 or shape[d] % (k * per_dim[d]):
            return False
    return all(shape[d] >= n for d, n in per_dim.items())


def local_shape(spec: Sequence[Placement], shape: Sequence[int], mesh_shape: Sequence[int]) -> list[int]:
    """The shape held per device (ceil division for uneven shards)."""
    sizes = list(shape)
    for p, size in zip(spec, mesh_shape, strict=True):
        d = shard_dim(p)
        if d is not None:
            sizes[d] = -(-sizes[d] // size)
    return sizes


def local_numel(spec: Sequence[Placement], shape: Sequence[int], mesh_shape: Sequence[int]) -> int:
    """Elements held per device (ceil division for uneven shards)."""
    return math.prod(local_shape(spec, shape, mesh_shape))


def replicated(ndim_mesh: int) -> Spec:
    return tuple(Replicate() for _ in range(ndim_mesh))


def mesh_axes_of_group(mesh: Any, group_name: str) -> frozenset[int]:
    """The axes of ``mesh`` (a ``DeviceMesh``) whose process group holds the ranks of the group
    named ``group_name``: the axis an op running its own collectives (expert-parallel MoE, ring
    attention) was generated for. Ranks, not names: DTensor's sharding cache (keyed by specs whose
    meshes compare by shape and ranks) can hand a program traced on a new mesh the specs of an
    earlier equal mesh, whose groups have other names (a second model parallelized in the same
    process on a mesh of several axes)."""
    ranks = dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(group_name))  # type: ignore[arg-type]
    return frozenset(d for d in range(mesh.ndim) if dist.get_process_group_ranks(mesh.get_group(d)) == ranks)
