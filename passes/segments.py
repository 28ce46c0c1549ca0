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


for _op in SPLIT_OPS:
    _PROP.op_strategy_funcs[_op] = _segment_split_strategy
    _PROP.op_to_scalar_shape_adjuster[_op] = _local_split_sizes
_PROP.op_strategy_funcs[aten.cat.default] = _segment_cat_strategy
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


def segment_counts(gm: fx.GraphModule) -> dict[str, set[tuple[int, int]]]:
    """Placeholder name -> {(size, k)}: the placeholder flows (through views, transposes and the
    weight/bias operand of a matmul) into a split of a dim of ``size`` into ``k`` equal pieces."""
    found: dict[str, set[tuple[int, int]]] = {}
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
        stack, seen = [source], set()
        while stack:
            n = stack.pop()
            if not isinstance(n, fx.Node) or n in seen:
                continue
            seen.add(n)
            if n.op == "placeholder":
                found.setdefault(n.name, set()).add((int(val.shape[dim]), len(sizes)))
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
