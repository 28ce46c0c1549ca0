"""Placement vocabulary shared by the solver, the plan file and the generated program.

A *placement* says how one tensor is laid out along one mesh axis: ``R`` (replicated),
``S(d)`` (sharded along tensor dim ``d``), ``P`` (partial sums still to be reduced) or
``P(avg)`` (partial values still to be averaged, e.g. a mean loss over a sharded batch). A *spec*
is one placement per mesh axis, written ``S(0)R`` in logs and ``["S(0)", "R"]`` in plan files.

These are thin, terse views over ``torch.distributed.tensor`` placements, which stay the
source of truth at run time.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from autoplan.passes.plan_text import parse_placement_text

Spec = tuple[Placement, ...]
"""One placement per mesh axis."""


def placement_str(p: Placement) -> str:
    """Terse text of one placement: ``R``, ``S(0)`` or ``P``."""
    if type(p) is Replicate:
        return "R"
    if type(p) is Shard:
        return f"S({p.dim})"
    if type(p) is Partial and p.reduce_op == "sum":
        return "P"
    if type(p) is Partial and p.reduce_op == "avg":
        return "P(avg)"
    raise ValueError(f"placement {p!r} is outside autoplan's vocabulary (R, S(d), P, P(avg))")


def parse_placement(text: str) -> Placement:
    """Inverse of :func:`placement_str` (the syntax is :func:`autoplan.passes.plan_text.parse_placement_text`'s)."""
    kind, dim = parse_placement_text(text)
    if kind == "S":
        assert dim is not None
        return Shard(dim)
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
    """True for the placements the planner reasons about (no strided or masked variants)."""
    return type(p) in (Replicate, Shard) or (type(p) is Partial and p.reduce_op in ("sum", "avg"))


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
        if isinstance(p, Shard):
            n *= size
    return n


def is_shardable(spec: Sequence[Placement], shape: Sequence[int], mesh_shape: Sequence[int]) -> bool:
    """Every sharded dim must give each device at least one element."""
    per_dim: dict[int, int] = {}
    for p, size in zip(spec, mesh_shape, strict=True):
        if isinstance(p, Shard):
            if p.dim >= len(shape) or p.dim < 0:
                return False
            per_dim[p.dim] = per_dim.get(p.dim, 1) * size
    return all(shape[d] >= n for d, n in per_dim.items())


def local_numel(spec: Sequence[Placement], shape: Sequence[int], mesh_shape: Sequence[int]) -> int:
    """Elements held per device (ceil division for uneven shards)."""
    sizes = list(shape)
    for p, size in zip(spec, mesh_shape, strict=True):
        if isinstance(p, Shard):
            sizes[p.dim] = -(-sizes[p.dim] // size)
    n = 1
    for s in sizes:
        n *= s
    return n


def replicated(ndim_mesh: int) -> Spec:
    return tuple(Replicate() for _ in range(ndim_mesh))
