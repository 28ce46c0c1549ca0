"""Functions the generated per-rank program calls: one explicit collective per mesh axis.

Each function changes the placement of exactly one mesh axis of a DTensor; the name says which
collective runs (``all_gather``, ``all_reduce``, ``reduce_scatter``, ``all_to_all``) or that the
step is local (``shard``, ``to_partial``). They are thin wrappers over
``DTensor.redistribute`` so that NCCL, gloo and fake process groups all work unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils import _pytree as pytree

Finish = Callable[[], list[torch.Tensor]]
"""Waits for an issued flat collective and returns its per-tensor results."""


def segment_layout(x: Any) -> Any:
    """``x`` with its ``S(d)/k`` placements read as a data layout, what autoplan plans: DTensor
    2.13 gives ``_StridedShard`` two meanings, told apart by its spec's
    ``use_strided_shard_as_shard_order``. Its view rules make the layout (``False``: a shard of
    the heads in ``(B, H, T, D) -> (B * H, T, D)``), while ``from_local``, ``distribute_tensor``
    and ``redistribute`` to raw placements default to a shard *order* (``True``). An op whose
    inputs mix the two matches none of its strategies and DTensor gathers them all (BLOOM's
    ``baddbmm`` of a sharded ALiBi bias and view-sharded heads did), so every DTensor the runtime
    makes goes through here. Returns ``x`` itself (its spec replaced when needed)."""
    if not isinstance(x, DTensor):
        return x
    spec = x._spec
    if spec.use_strided_shard_as_shard_order and any(isinstance(p, _StridedShard) for p in spec.placements):
        x._spec = DTensorSpec(
            spec.mesh, spec.placements, tensor_meta=spec.tensor_meta, use_strided_shard_as_shard_order=False
        )
    return x


def _move(x: DTensor, axis: int, dst: Placement) -> DTensor:
    if not isinstance(x, DTensor):
        raise TypeError(f"expected a DTensor, got {type(x).__name__}")
    placements = list(x.placements)
    placements[axis] = dst
    return segment_layout(x.redistribute(x.device_mesh, placements))


def replicate(x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """A plain tensor computed identically on every rank (a constant) as a replicated DTensor."""
    return DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)


def all_gather(x: DTensor, axis: int) -> DTensor:
    """``S(d) -> R`` (or ``S(d)/k -> R``: DTensor re-joins each segment's shards) on ``axis``."""
    return _move(x, axis, Replicate())


def all_reduce(x: DTensor, axis: int) -> DTensor:
    """``P -> R`` on ``axis``."""
    return _move(x, axis, Replicate())


def reduce_scatter(x: DTensor, axis: int, dim: int) -> DTensor:
    """``P -> S(dim)`` on ``axis``."""
    return _move(x, axis, Shard(dim))


def all_to_all(x: DTensor, axis: int, dim: int) -> DTensor:
    """``S(d) -> S(dim)`` on ``axis``. DTensor leaves an uneven split's local shard padded and
    non-contiguous (e.g. (2, 5) with stride (6, 1)), which a following ``view`` rejects: the
    result is re-wrapped around a contiguous copy (found by tests/test_fuzz_equivalence.py)."""
    out = _move(x, axis, Shard(dim))
    local = out.to_local()
    if local.is_contiguous():
        return out
    return segment_layout(
        DTensor.from_local(
            local.contiguous(), out.device_mesh, out.placements, run_check=False, shape=out.shape, stride=out.stride()
        )
    )


def shard(x: DTensor, axis: int, dim: int, segments: int = 1) -> DTensor:
    """``R -> S(dim)`` on ``axis`` (``R -> S(dim)/segments``: this rank's slice of each of the
    ``segments`` equal segments of ``dim``): local slices, no communication."""
    return _move(x, axis, Shard(dim) if segments == 1 else _StridedShard(dim, split_factor=segments))


def to_partial(x: DTensor, axis: int, reduce_op: str = "sum") -> DTensor:
    """``R -> P`` on ``axis``: local, no communication. For a sum, rank 0 of the axis keeps the
    value and the others hold zeros; for an average every rank keeps the value."""
    if not isinstance(x, DTensor) or not isinstance(x.placements[axis], Replicate):
        raise TypeError("to_partial expects a DTensor replicated on that axis")
    placements = list(x.placements)
    placements[axis] = Partial(reduce_op)
    local = x.to_local()
    if reduce_op == "sum" and x.device_mesh.get_local_rank(axis) != 0:
        local = torch.zeros_like(local)
    return segment_layout(
        DTensor.from_local(local, x.device_mesh, placements, run_check=False, shape=x.shape, stride=x.stride())
    )


def all_reduce_coalesced(xs: tuple[DTensor, ...], axis: int) -> tuple[DTensor, ...]:
    """``P -> R`` on ``axis`` for several tensors with one flat all-reduce (gradient bucketing):
    :func:`start_all_reduce_flat` on their local tensors, each result a view into the reduced buffer."""
    first = xs[0]
    mesh = first.device_mesh
    partial = first.placements[axis]
    if not isinstance(partial, Partial) or any(x.placements[axis] != partial for x in xs):
        raise TypeError("all_reduce_coalesced expects tensors with the same Partial placement on that axis")
    if partial.reduce_op not in ("sum", "avg"):
        raise TypeError(f"all_reduce_coalesced supports sum and avg partials, got {partial.reduce_op!r}")
    pieces = start_all_reduce_flat([x.to_local() for x in xs], mesh.get_group(axis), average=partial.reduce_op == "avg")()
    out = []
    for x, piece in zip(xs, pieces, strict=True):
        placements = list(x.placements)
        placements[axis] = Replicate()
        out.append(segment_layout(DTensor.from_local(piece, mesh, placements, run_check=False, shape=x.shape, stride=x.stride())))
    return tuple(out)


def start_all_reduce_flat(locals_: list[torch.Tensor], group: Any, *, average: bool) -> Finish:
    """Issue the sum (``average``: mean) of each local tensor over ``group`` as one flat
    all-reduce; the returned ``finish()`` waits for it and gives the results. The tensors are
    concatenated into one fresh buffer, reduced in place (one copy, as DDP's bucket:
    ``funcol.all_reduce`` would clone it first), and each result is a view into it.

    A functional collective: everything between the issue and ``finish()`` overlaps it. In the
    lowered program the wait then moves to where a result is first read (the optimizer step,
    :mod:`autoplan.runtime.lowering`); run eagerly, several buckets are issued before the first
    is finished (:class:`~autoplan.runtime.pipeline.PipelineModel`)."""
    flat = torch.cat([t.reshape(-1) for t in locals_])
    issued = torch.ops._c10d_functional.all_reduce_(flat, "sum", funcol._resolve_group_name(group))  # (gloo has no AVG)
    shapes = [t.shape for t in locals_]

    def finish() -> list[torch.Tensor]:
        done = torch.ops._c10d_functional.wait_tensor(issued)
        if average:
            done = done / dist.get_world_size(group)
        out, offset = [], 0
        for shape in shapes:
            numel = math.prod(shape)
            out.append(done[offset : offset + numel].view(shape))
            offset += numel
        return out

    return finish


def all_gather_coalesced(xs: tuple[DTensor, ...], axis: int) -> tuple[DTensor, ...]:
    """``S(d_i) -> R`` on ``axis`` for several tensors with one flat all-gather (FSDP2's per-block
    parameter gather). Each local shard is padded to its dim's ``ceil(size / n)`` rows (DTensor's
    uneven split leaves the last ranks shorter), flattened and concatenated; the gathered buffer
    is cut back per rank and tensor and re-joined along each tensor's dim. Asynchronous: the wait
    sits where a gathered tensor is first read (:mod:`autoplan.runtime.lowering`)."""
    mesh = xs[0].device_mesh
    n = mesh.size(axis)
    dims, padded = [], []
    for x in xs:
        p = x.placements[axis]
        if not isinstance(p, Shard):
            raise TypeError(f"all_gather_coalesced expects tensors sharded on axis {axis}, got {x.placements}")
        local = x.to_local()
        chunk = -(-x.shape[p.dim] // n)
        if local.shape[p.dim] < chunk:  # an uneven split's short shard
            pad = [0, 0] * (local.ndim - 1 - p.dim) + [0, chunk - local.shape[p.dim]]
            local = torch.nn.functional.pad(local, pad)
        dims.append(p.dim)
        padded.append(local)
    flat = torch.cat([t.reshape(-1) for t in padded])
    gathered = funcol.all_gather_single(flat, 0, mesh.get_group(axis)).view(n, -1)
    out = []
    offset = 0
    for x, t, dim in zip(xs, padded, dims, strict=True):
        pieces = gathered[:, offset : offset + t.numel()]
        offset += t.numel()
        full = torch.cat([pieces[r].view(t.shape) for r in range(n)], dim=dim).narrow(dim, 0, x.shape[dim])
        placements = list(x.placements)
        placements[axis] = Replicate()
        out.append(segment_layout(DTensor.from_local(full.contiguous(), mesh, placements, run_check=False, shape=x.shape, stride=x.stride())))
    return tuple(out)


def reduce_scatter_coalesced(xs: tuple[DTensor, ...], axis: int, dims: tuple[int, ...]) -> tuple[DTensor, ...]:
    """``P -> S(dims[i])`` on ``axis`` for several tensors with one flat reduce-scatter (FSDP2's
    per-bucket gradient reduce-scatter): :func:`start_reduce_scatter_flat` on their local tensors."""
    mesh = xs[0].device_mesh
    partial = xs[0].placements[axis]
    if not isinstance(partial, Partial) or any(x.placements[axis] != partial for x in xs):
        raise TypeError("reduce_scatter_coalesced expects tensors with the same Partial placement on that axis")
    if partial.reduce_op not in ("sum", "avg"):
        raise TypeError(f"reduce_scatter_coalesced supports sum and avg partials, got {partial.reduce_op!r}")
    if len(dims) != len(xs):
        raise TypeError(f"reduce_scatter_coalesced needs one shard dim per tensor, got {len(dims)} for {len(xs)}")
    pieces = start_reduce_scatter_flat(
        [x.to_local() for x in xs], dims, mesh.get_group(axis), mesh.get_local_rank(axis),
        average=partial.reduce_op == "avg",
    )()
    out = []
    for x, dim, piece in zip(xs, dims, pieces, strict=True):
        placements = list(x.placements)
        placements[axis] = Shard(dim)
        out.append(segment_layout(DTensor.from_local(piece, mesh, placements, run_check=False, shape=x.shape, stride=x.stride())))
    return tuple(out)


def start_reduce_scatter_flat(
    locals_: list[torch.Tensor], dims: tuple[int, ...], group: Any, coord: int, *, average: bool
) -> Finish:
    """Issue, as one flat reduce-scatter, this rank's (``coord`` in ``group``) shard of the sum
    (``average``: mean) over ``group`` of each local tensor, split along ``dims[i]`` as DTensor
    splits ``S(dims[i])`` (uneven: the last ranks shorter or empty); the returned ``finish()``
    waits for it and gives the shards. Each tensor is padded along its dim to ``n`` equal chunks
    of ``ceil(size / n)`` rows; row ``r`` of the ``(n, -1)`` buffer holds every tensor's chunk
    ``r``, flattened. After the reduce-scatter a rank cuts its row back per tensor and narrows
    each piece to its own (possibly short or empty) shard. Asynchronous like
    :func:`start_all_reduce_flat`."""
    n = dist.get_world_size(group)
    rows, chunks = [], []
    for local, dim in zip(locals_, dims, strict=True):
        size = local.shape[dim]
        chunk = -(-size // n)
        short = chunk * n - size
        if short:
            local = torch.nn.functional.pad(local, [0, 0] * (local.ndim - 1 - dim) + [0, short])
        rows.append(torch.stack([c.reshape(-1) for c in local.split(chunk, dim=dim)]))
        chunks.append((chunk, local.shape, size))
    flat = torch.cat(rows, dim=1).reshape(-1)
    issued = torch.ops._c10d_functional.reduce_scatter_tensor(flat, "sum", n, funcol._resolve_group_name(group))

    def finish() -> list[torch.Tensor]:
        mine = torch.ops._c10d_functional.wait_tensor(issued)
        if average:  # (gloo has no AVG)
            mine = mine / n
        out = []
        offset = 0
        for dim, (chunk, padded_shape, size) in zip(dims, chunks, strict=True):
            shape = list(padded_shape)
            shape[dim] = chunk
            numel = math.prod(shape)
            piece = mine[offset : offset + numel].view(shape)
            offset += numel
            keep = max(0, min(chunk, size - coord * chunk))
            out.append(piece.narrow(dim, 0, keep).contiguous())
        return out

    return finish


def replicated_call(op: Any, *args: Any, **kwargs: Any) -> Any:
    """Run an op that has no DTensor strategy on replicated inputs; outputs are replicated DTensors."""
    mesh = None

    def unwrap(a: Any) -> Any:
        nonlocal mesh
        if isinstance(a, DTensor):
            assert all(isinstance(p, Replicate) for p in a.placements), a.placements
            mesh = a.device_mesh
            return a.to_local()
        return a

    args, kwargs = pytree.tree_map(unwrap, (args, kwargs))
    out = op(*args, **kwargs)
    if mesh is None:
        return out
    rep = [Replicate()] * mesh.ndim

    def wrap(t: Any) -> Any:
        return DTensor.from_local(t, mesh, rep, run_check=False) if isinstance(t, torch.Tensor) else t

    return pytree.tree_map(wrap, out)
