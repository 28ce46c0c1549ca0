"""Fused projections split by segments: ``S(d)/k`` through ``split`` and ``cat``.

A fused projection computes several tensors with one matmul and splits its output: GPT-2's
``c_attn`` gives ``[q | k | v]`` (``split(qkv, C, dim=2)``), Phi-3's ``gate_up_proj`` gives
``[gate | up]`` (``chunk(2, dim=-1)``). A column-parallel shard ``S(d)`` of the fused weight holds a
*contiguous* block of the fused outputs (rank 0 of 2: all of q and half of k), so no piece of the
split stays sharded and the planner gathered the weight before the matmul.

Megatron-LM splits a fused QKV by heads instead: each rank holds its heads' rows of q, k *and* v
(Shoeybi et al., "Megatron-LM", arXiv:1909.08053, section 3: "we partition the GEMMs associated
with key (K), query (Q), and value (V) in a column parallel fashion such that the matrix multiply
corresponding to each attention head is done locally on one GPU"; Megatron-Core stores the fused
weight interleaved per head group for this). torchtitan keeps q, k and v as separate weights and
shards each (``ColwiseParallel`` on ``wq``/``wk``/``wv``). Here the fused weight stays as the model
defines it and the layout is a placement, DTensor's ``_StridedShard(d, split_factor=k)``, written
``S(d)/k``: dim ``d`` is read as ``k`` equal segments and every segment is sharded over the axis,
so rank ``r`` of ``n`` holds ``cat(seg_0[r], ..., seg_{k-1}[r])`` (its heads of q, k and v). Its
storage and bytes are those of ``S(d)``; gathering it is one all-gather (DTensor re-joins each
segment's shards); scattering a replicated tensor into it is a local slice of each segment.

Contract (the rules this module adds to DTensor's sharding propagation, for every mesh axis):

* ``split`` / ``split_with_sizes`` into ``k`` equal pieces along ``d``:
  ``S(d)/k -> (S(d), ..., S(d))``; each rank splits its local tensor into ``k`` local pieces (the
  size arguments are rewritten to local sizes, :func:`_local_split_sizes`);
* ``cat`` of ``k`` equally shaped tensors along ``d`` (the backward of that split):
  ``(S(d), ..., S(d)) -> S(d)/k``; the local cat *is* the segment layout;
* ``slice`` (step 1) that is exactly segment ``i`` of ``k`` (Phi-3 slices its fused QKV:
  ``qkv[..., :q]``, ``qkv[..., q:q + kv]``, ``qkv[..., q + kv:]``, equal segments when there are
  as many key/value heads as heads): ``S(d)/k -> S(d)``; and its ``slice_backward``:
  ``S(d) -> S(d)/k`` (the rank's rows of segment ``i``, zeros elsewhere; the pieces' gradients are
  summed pointwise). The bounds are rewritten to local ones (:func:`_local_slice_bounds`);
* DTensor's own rules carry ``S(d)/k`` through transposes, views, ``mm``/``addmm`` (weight and
  bias), sums and pointwise ops; :func:`segment_specs` offers ``S(d)/k`` to the parameters whose
  values flow (through views, transposes and the weight/bias operand of a matmul) into such a split.

Every other placement on the split dim keeps PyTorch's rule (gather, then split). A segment shard
is planned on one mesh axis of a dim at a time (:func:`autoplan.passes.placement.is_shardable`).

Merged dims: eager attention that flattens the heads into the batch of a ``bmm`` (BLOOM:
``(B, H, T, D) -> (B * H, T, D)`` around ``baddbmm``/``bmm``) turns a shard of the heads into
``S(0)/B`` of the flattened dim (DTensor's view rule). :func:`merged_dim_counts` names those
``(size, k)`` so the planner admits that layout on such tensors; DTensor's own ``bmm``/``baddbmm``
and view rules then keep the attention head-parallel, forward and backward.

At run time ``S(d)/k`` is a data layout. DTensor 2.13 also reads ``_StridedShard`` as a shard
*order*; every DTensor the runtime makes is set to the layout reading
(:func:`autoplan.runtime.collectives.segment_layout`, the reading DTensor's view rules give) and
the rules here keep their input's reading.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, StrategyType, TupleStrategy
from torch.distributed.tensor._ops.utils import generate_redistribute_costs, normalize_dim
from torch.distributed.tensor.placement_types import _StridedShard

from autoplan.passes.placement import Spec, is_shardable

aten = torch.ops.aten
SPLIT_OPS = (aten.split.Tensor, aten.split_with_sizes.default)
_PROP = DTensor._op_dispatcher.sharding_propagator
_TORCH_SPLIT = {op: _PROP.op_strategy_funcs[op] for op in SPLIT_OPS}
_TORCH_CAT = _PROP.op_strategy_funcs[aten.cat.default]


def _piece_sizes(size: int, split: int | Sequence[int]) -> list[int]:
    """Sizes of the pieces ``split`` (a piece size or a list of sizes) cuts ``size`` into."""
    if isinstance(split, int):
        return [split] * (size // split) + ([size % split] if size % split else [])
    return [int(s) for s in split]


def _segment_axis(placements: Sequence[object], dim: int) -> int | None:
    """The one mesh axis holding ``S(dim)/k`` when no other axis splits ``dim``, else ``None``."""
    axes = [a for a, p in enumerate(placements) if isinstance(p, (Shard, _StridedShard)) and p.dim == dim]
    if len(axes) == 1 and isinstance(placements[axes[0]], _StridedShard):
        return axes[0]
    return None


def _int_arg(op_schema: OpSchema, index: int, default: int) -> int:
    value = op_schema.args_schema[index] if len(op_schema.args_schema) > index else default
    assert isinstance(value, int), value
    return value


def _split_dim(op_schema: OpSchema, ndim: int) -> int:
    return normalize_dim(_int_arg(op_schema, 2, 0), ndim)


def _segment_split_strategy(op_schema: OpSchema) -> StrategyType:
    """PyTorch's split strategies plus ``S(d)/k -> k x S(d)`` (see the module docstring)."""
    result = _TORCH_SPLIT[op_schema.op](op_schema)
    source = op_schema.args_schema[0]
    assert isinstance(source, OpStrategy) and isinstance(result, OpStrategy)
    dim = _split_dim(op_schema, source.ndim)
    sizes = _piece_sizes(source.shape[dim], op_schema.args_schema[1])  # type: ignore[arg-type]
    for strategy in source.strategies:
        spec = strategy.output_spec
        axis = _segment_axis(spec.placements, dim)
        if axis is None or len(set(sizes)) != 1:
            continue
        segments = spec.placements[axis]
        assert isinstance(segments, _StridedShard)
        if segments.split_factor != len(sizes):
            continue
        out = tuple(Shard(dim) if a == axis else p for a, p in enumerate(spec.placements))
        input_spec = DTensorSpec(
            spec.mesh,
            spec.placements,
            spec.tensor_meta,
            use_strided_shard_as_shard_order=spec.use_strided_shard_as_shard_order,  # as the input reads it
        )
        result.strategies.append(
            OpSpec(
                output_specs=tuple(DTensorSpec(spec.mesh, out) for _ in sizes),  # plain Shard pieces
                input_specs=(input_spec,),
                redistribute_cost=[generate_redistribute_costs(source, input_spec)],
            )
        )
    return result


def _segment_cat_strategy(op_schema: OpSchema) -> StrategyType:
    """PyTorch's cat strategies plus ``k x S(d) -> S(d)/k`` (see the module docstring)."""
    result = _TORCH_CAT(op_schema)
    pieces = op_schema.args_schema[0]
    assert isinstance(pieces, TupleStrategy) and isinstance(result, OpStrategy)
    children = [c for c in pieces.children if isinstance(c, OpStrategy)]
    if len(children) < 2 or len(children) != len(pieces.children):
        return result
    if any(c.shape != children[0].shape for c in children):
        return result
    dim = normalize_dim(_int_arg(op_schema, 1, 0), children[0].ndim)
    seen: set[tuple[object, ...]] = set()
    for strategy in children[0].strategies:
        spec = strategy.output_spec
        axes = [a for a, p in enumerate(spec.placements) if isinstance(p, (Shard, _StridedShard)) and p.dim == dim]
        if len(axes) != 1 or type(spec.placements[axes[0]]) is not Shard or spec.placements in seen:
            continue
        seen.add(spec.placements)
        out = tuple(
            _StridedShard(dim, split_factor=len(children)) if a == axes[0] else p for a, p in enumerate(spec.placements)
        )
        input_specs = tuple(
            DTensorSpec(spec.mesh, spec.placements, tensor_meta=c.strategies[0].output_spec.tensor_meta)
            for c in children
        )
        result.strategies.append(
            OpSpec(
                output_specs=DTensorSpec(spec.mesh, out, use_strided_shard_as_shard_order=False),  # a layout
                input_specs=input_specs,
                redistribute_cost=[
                    generate_redistribute_costs(c, s) for c, s in zip(children, input_specs, strict=True)
                ],
            )
        )
    return result


def _local_split_sizes(input_specs: list[DTensorSpec], schema: OpSchema) -> OpSchema:
    """At run time, a split of an ``S(d)/k`` input cuts the *local* tensor: piece sizes / n."""
    spec = input_specs[0]
    meta = spec.tensor_meta
    assert meta is not None
    dim = _split_dim(schema, len(meta.shape))
    axis = _segment_axis(spec.placements, dim)
    if axis is None:
        return schema
    n = spec.mesh.size(axis)
    args = list(schema.args_schema)
    split = args[1]
    assert isinstance(split, (int, list, tuple)), split
    args[1] = split // n if isinstance(split, int) else [int(s) // n for s in split]
    return OpSchema(schema.op, tuple(args), schema.kwargs_schema)


def _slice_bounds(args: Sequence[object], size: int) -> tuple[int, int] | None:
    """``[start, end)`` of a step-1 ``slice``/``slice_backward`` over a dim of ``size`` (``args``:
    dim, start, end, step), or ``None`` for another step or symbolic bounds."""
    start, end, step = (list(args[1:4]) + [None, None, 1][len(args) - 1 :])[:3]
    start = 0 if start is None else start
    end = size if end is None else end
    if not isinstance(start, int) or not isinstance(end, int) or step != 1:
        return None
    return max(0, min(size, start + size if start < 0 else start)), max(0, min(size, end + size if end < 0 else end))


def _segment_of(bounds: tuple[int, int] | None, size: int) -> int | None:
    """``k`` when ``bounds`` is one of ``k >= 2`` equal segments of a dim of ``size``."""
    if bounds is None:
        return None
    start, end = bounds
    piece = end - start
    if piece <= 0 or size % piece or start % piece or size // piece < 2:
        return None
    return size // piece


def _segment_slice_strategy(op_schema: OpSchema) -> StrategyType:
    """PyTorch's slice strategies plus ``S(d)/k -> S(d)`` for a slice that is exactly one of the
    ``k`` segments (Phi-3's ``qkv[..., :q]``, ``qkv[..., q:q + kv]``, ... of a fused QKV)."""
    result = _TORCH_SLICE(op_schema)
    source = op_schema.args_schema[0]
    assert isinstance(source, OpStrategy) and isinstance(result, OpStrategy)
    args = list(op_schema.args_schema[1:]) or [0]
    dim = normalize_dim(args[0], source.ndim)  # type: ignore[arg-type]
    size = int(source.shape[dim])
    k = _segment_of(_slice_bounds(args, size), size)
    if k is None:
        return result
    for strategy in source.strategies:
        spec = strategy.output_spec
        axis = _segment_axis(spec.placements, dim)
        if axis is None or getattr(spec.placements[axis], "split_factor", None) != k:
            continue
        out = tuple(Shard(dim) if a == axis else p for a, p in enumerate(spec.placements))
        result.strategies.append(
            OpSpec(
                output_specs=DTensorSpec(spec.mesh, out),
                input_specs=(spec,),
                redistribute_cost=[generate_redistribute_costs(source, spec)],
            )
        )
    return result


def _segment_slice_backward_strategy(op_schema: OpSchema) -> StrategyType:
    """PyTorch's ``slice_backward`` strategies plus ``S(d) -> S(d)/k`` when the slice was exactly
    one of ``k`` segments: each rank's gradient is its rows of that segment, zeros elsewhere, which
    is the segment layout (the backward of :func:`_segment_slice_strategy`; the pieces' gradients
    are then summed pointwise)."""
    result = _TORCH_SLICE_BACKWARD(op_schema)
    grad = op_schema.args_schema[0]
    assert isinstance(grad, OpStrategy) and isinstance(result, OpStrategy)
    sizes, *args = op_schema.args_schema[1:]
    if not isinstance(sizes, (list, tuple)) or not all(isinstance(v, int) for v in sizes):
        return result
    dim = normalize_dim(args[0], len(sizes))  # type: ignore[arg-type]
    size = int(sizes[dim])
    k = _segment_of(_slice_bounds(args, size), size)
    if k is None:
        return result
    for strategy in grad.strategies:
        spec = strategy.output_spec
        axes = [a for a, p in enumerate(spec.placements) if isinstance(p, (Shard, _StridedShard)) and p.dim == dim]
        if len(axes) != 1 or type(spec.placements[axes[0]]) is not Shard:
            continue
        out = tuple(_StridedShard(dim, split_factor=k) if a == axes[0] else p for a, p in enumerate(spec.placements))
        result.strategies.append(
            OpSpec(
                output_specs=DTensorSpec(spec.mesh, out, use_strided_shard_as_shard_order=False),  # a layout
                input_specs=(spec,),
                redistribute_cost=[generate_redistribute_costs(grad, spec)],
            )
        )
    return result


def _local_slice_bounds(input_specs: list[DTensorSpec], schema: OpSchema) -> OpSchema:
    """At run time, a segment slice (or its backward) cuts the *local* tensor: its bounds / n (an
    open end stays open). Only the strategies above leave the sliced dim sharded; PyTorch's gather
    it first, and their arguments are left as they are."""
    spec = input_specs[0]
    meta = spec.tensor_meta
    assert meta is not None
    first = 2 if schema.op is aten.slice_backward.default else 1  # index of ``dim``
    args = list(schema.args_schema) + [None] * (first + 3 - len(schema.args_schema))
    dim = normalize_dim(args[first] or 0, len(meta.shape))  # type: ignore[arg-type]
    axes = [a for a, p in enumerate(spec.placements) if isinstance(p, (Shard, _StridedShard)) and p.dim == dim]
    if len(axes) != 1:
        return schema
    n = spec.mesh.size(axes[0])
    start, end = args[first + 1] or 0, args[first + 2]
    assert isinstance(start, int) and start >= 0 and (end is None or isinstance(end, int) and end >= 0), schema
    args[first + 1] = start // n
    args[first + 2] = end if end is None or end >= _OPEN_END else end // n
    return OpSchema(schema.op, tuple(args[: max(len(schema.args_schema), first + 3)]), schema.kwargs_schema)


_OPEN_END = 2**62
"""A slice's end at or past this is "to the end" (``x[..., a:]`` traces as ``end=2**63 - 1``)."""
_TORCH_SLICE = _PROP.op_strategy_funcs[aten.slice.Tensor]
_TORCH_SLICE_BACKWARD = _PROP.op_strategy_funcs[aten.slice_backward.default]

for _op in SPLIT_OPS:
    _PROP.op_strategy_funcs[_op] = _segment_split_strategy
    _PROP.op_to_scalar_shape_adjuster[_op] = _local_split_sizes
_PROP.op_strategy_funcs[aten.cat.default] = _segment_cat_strategy
_PROP.op_strategy_funcs[aten.slice.Tensor] = _segment_slice_strategy
_PROP.op_strategy_funcs[aten.slice_backward.default] = _segment_slice_backward_strategy
for _op in (aten.slice.Tensor, aten.slice_backward.default):
    _PROP.op_to_scalar_shape_adjuster[_op] = _local_slice_bounds
_PROP.propagate_op_sharding.cache.cache_clear()


# --------------------------------------------------------------------------------------------
# which parameters may take S(d)/k

_THROUGH = {
    aten.view.default: (0,),
    aten._unsafe_view.default: (0,),
    aten.reshape.default: (0,),
    aten.clone.default: (0,),
    aten.t.default: (0,),
    aten.transpose.int: (0,),
    aten.mm.default: (1,),  # the output's columns are the right operand's
    aten.addmm.default: (0, 2),  # bias and right operand
}


def _tiling_slices(gm: fx.GraphModule) -> list[tuple[fx.Node, int, int]]:
    """``(source, size, k)`` for every tensor whose step-1 ``slice``s along its last dim cut it
    into exactly ``k >= 2`` equal segments (Phi-3 slices its fused QKV: ``qkv[..., :q]``,
    ``qkv[..., q:q + kv]``, ``qkv[..., q + kv:]``; equal when q, k and v are)."""
    bounds: dict[fx.Node, set[tuple[int, int]]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.slice.Tensor:
            continue
        source = node.args[0]
        val = source.meta.get("val") if isinstance(source, fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.dim() == 0 or not isinstance(val.shape[-1], int):
            continue
        args = list(node.args[1:]) or [0]
        if normalize_dim(int(args[0]), val.dim()) != val.dim() - 1:
            continue
        found = _slice_bounds(args, int(val.shape[-1]))
        if found is not None:
            bounds.setdefault(source, set()).add(found)
    out = []
    for source, pieces in bounds.items():
        size = int(source.meta["val"].shape[-1])
        k = len(pieces)
        if k >= 2 and size % k == 0 and pieces == {(i * size // k, (i + 1) * size // k) for i in range(k)}:
            out.append((source, size, k))
    return out


def segment_counts(gm: fx.GraphModule) -> dict[str, set[tuple[int, int]]]:
    """Placeholder name -> {(size, k)}: the placeholder flows (through views, transposes and the
    weight/bias operand of a matmul) into a split of a dim of ``size`` into ``k`` equal pieces, or
    into ``slice``s that cut a last dim of ``size`` into ``k`` equal segments (every node on the way
    having a dim of that size, so a per-head slice after a view to heads does not count)."""
    found: dict[str, set[tuple[int, int]]] = {}
    cuts: list[tuple[fx.Node, int, int, bool]] = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in SPLIT_OPS:
            continue
        source = node.args[0]
        val = source.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        dim = normalize_dim(int(node.args[2]) if len(node.args) > 2 else 0, val.dim())
        sizes = _piece_sizes(val.shape[dim], node.args[1])
        if len(sizes) < 2 or len(set(sizes)) != 1:
            continue
        cuts.append((source, int(val.shape[dim]), len(sizes), False))
    cuts += [(source, size, k, True) for source, size, k in _tiling_slices(gm)]
    for source, size, k, keep_size in cuts:
        stack: list[object] = [source]
        seen: set[fx.Node] = set()
        while stack:
            n = stack.pop()
            if not isinstance(n, fx.Node) or n in seen:
                continue
            seen.add(n)
            val = n.meta.get("val")
            if keep_size and (not isinstance(val, torch.Tensor) or size not in tuple(val.shape)):
                continue
            if n.op == "placeholder":
                found.setdefault(n.name, set()).add((size, k))
            elif n.op == "call_function" and n.target in _THROUGH:
                stack.extend(n.args[i] for i in _THROUGH[n.target] if i < len(n.args))
    return found


def segment_variants(
    base: Sequence[Spec], shape: Sequence[int], counts: set[tuple[int, int]], mesh_shape: Sequence[int]
) -> list[Spec]:
    """The ``S(d)/k`` specs a placeholder of ``shape`` may take besides ``base`` (its ``R``/``S(d)``
    specs): each spec of ``base`` with one axis ``S(d)`` turned into ``S(d)/k``, for the
    ``(size, k)`` of ``counts`` (:func:`segment_counts`) where dim ``d`` has that size."""
    out: list[Spec] = []
    for spec in base:
        for axis, p in enumerate(spec):
            if type(p) is not Shard:
                continue
            for size, k in sorted(counts):
                if shape[p.dim] != size:
                    continue
                seg = tuple(_StridedShard(p.dim, split_factor=k) if a == axis else q for a, q in enumerate(spec))
                if is_shardable(seg, shape, mesh_shape) and seg not in out:
                    out.append(seg)
    return out


# --------------------------------------------------------------------------------------------
# merged dims: S(d)/k from views that flatten a sharded dim into a larger one

VIEW_OPS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _product(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _merged_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, tuple[int, ...]]]:
    """The dims a view merges into one dim of ``dst``: ``(that dim, its size, the sizes it merges)``
    for every run of several ``src`` dims (size-1 dims dropped) that become one ``dst`` dim."""
    groups: list[tuple[int, int, tuple[int, ...]]] = []
    i = j = 0
    while i < len(src) and j < len(dst):
        a, b, at = [src[i]], [dst[j]], j
        i, j = i + 1, j + 1
        while _product(a) != _product(b):
            if _product(a) < _product(b):
                if i == len(src):
                    return groups
                a.append(src[i])
                i += 1
            else:
                if j == len(dst):
                    return groups
                b.append(dst[j])
                j += 1
        a, b = [x for x in a if x != 1], [x for x in b if x != 1]
        if len(b) == 1 and len(a) > 1:
            groups.append((at, b[0], tuple(a)))
    return groups


_BATCHED_MATMULS = (aten.bmm.default, aten.baddbmm.default)
_TO_BATCHED = (aten.transpose.int, aten.clone.default, aten.expand.default, aten.contiguous.default)


def _feeds_batched_matmul(node: fx.Node) -> bool:
    """``node`` is an operand of ``bmm``/``baddbmm`` (through transposes, clones, expands)."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            if user.target in _BATCHED_MATMULS:
                return True
            if user.target in _TO_BATCHED:
                stack.append(user)
    return False


def merged_dim_counts(gm: fx.GraphModule) -> set[tuple[int, int]]:
    """``{(size, k)}``: a view merges dims ``(s_0, ..., s_m)`` into the batch dim (of ``size``) of
    a ``bmm``/``baddbmm`` operand, and ``k = s_0 * ... * s_{i-1} > 1`` for some ``i``. A shard of
    ``s_i`` (the heads in ``(B, H, T, D) -> (B * H, T, D)``, as BLOOM's eager attention does around
    ``baddbmm``/``bmm``) is then the segment shard ``S(0)/k`` of the merged dim (DTensor's view rule
    makes exactly that), so the batched matmul runs on each rank's heads instead of gathering them.
    Other merges (``(B, T, C) -> (B * T, C)`` before a linear layer) add nothing: their segment
    shards would only enlarge the search."""
    found: set[tuple[int, int]] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in VIEW_OPS:
            continue
        src, dst = node.args[0].meta.get("val"), node.meta.get("val")
        if not isinstance(src, torch.Tensor) or not isinstance(dst, torch.Tensor) or dst.dim() != 3:
            continue
        if not all(isinstance(x, int) for x in (*src.shape, *dst.shape)):
            continue  # a symbolic size: no fixed segment count
        if not _feeds_batched_matmul(node):
            continue
        for dim, size, parts in _merged_groups(tuple(src.shape), tuple(dst.shape)):
            for i in range(1, len(parts)):
                k = _product(parts[:i])
                if dim == 0 and k > 1:
                    found.add((size, k))
    return found
