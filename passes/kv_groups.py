"""A fused grouped-query QKV projection stored grouped by key/value head, so tensor parallelism splits it by heads.

Phi-3-style attention with fewer key/value heads ``G`` than query heads ``H`` (grouped-query
attention, ``g = H / G`` query heads per key/value head) computes q, k and v with one matmul of a
fused weight whose rows are ``[q (H*D); k (G*D); v (G*D)]`` and slices its output
(``qkv[..., :H*D]``, ``qkv[..., H*D:(H+G)*D]``, ``qkv[..., (H+G)*D:]``). The three segments differ
in size, so neither a plain shard ``S(0)`` (rank 0 of 2 holds all of q) nor the equal-segment
``S(0)/3`` of :mod:`autoplan.passes.segments` gives a rank its query heads *and* the key/value
heads they read: the planner gathered the weight and ran the attention replicated (2 of Phi-3's 9
forward weight matmuls on a sharded weight, ``benchmarks/tp_sharded_matmuls.py``).

Megatron-Core stores a fused GQA QKV weight grouped by key/value head,
``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` (``q_j``: the ``g`` query heads that read key/value head
``j``; Hugging Face's ``repeat_kv`` and SDPA's ``enable_gqa`` both pair query head ``h`` with
key/value head ``h // g``), and views the fused output as ``(..., G, (g + 2) * D)`` before
splitting it. A plain ``S(0)`` of that layout holds whole groups: rank ``r`` of ``n`` (``n``
divides ``G``) holds query heads ``[r*H/n, (r+1)*H/n)`` and key/value heads ``[r*G/n, (r+1)*G/n)``,
the pairs its attention needs, and DTensor's own view, slice and reshape rules keep every step
local. Falcon-40B and InternLM2 define their fused weights in this layout already.

This pass makes it the *stored* layout of such a parameter; the model's own layout stays what the
user sees.

Contract (:func:`group_fused_qkv`):

* input: the forward graph ``torch.export`` gave (before the joint graph is built, so autograd
  differentiates the rewritten forward);
* match: a parameter ``W`` (and its bias, if any) read only by ``linear(x, W[, b])`` whose output is
  read only by three ``slice`` ops of its last dim, or cut by one ``split_with_sizes`` of its last
  dim read through ``getitem``, into ``(g*G*D, G*D, G*D)`` with
  ``G >= 2`` and ``g >= 2``, each slice read only by views to ``(..., heads, D)`` (``D`` is taken
  from those views);
* rewrite: ``W`` (and ``b``) are read in the stored layout; each slice (or piece) becomes
  ``reshape(slice(view(linear(x, W), (..., G, (g+2)*D)), -1, lo, hi), (..., size))``, the same
  values in the same order as the slice of the model's layout;
* output: FQN -> :class:`~autoplan.passes.kv_rows.KVGroupRows` of every rewritten parameter
  (the type lives in :mod:`autoplan.passes.kv_rows`, which plan files and checkpoints read without torch). The runtime distributes
  ``to_stored(model value)`` and gives ``to_model(...)`` back (``full_parameters``, ``load_state_dict``
  of full tensors, a checkpoint's full read), so the step is exactly the model's.

Left as they are: multi-query attention (``G == 1``: the layout is already grouped and a single
key/value head cannot be split; Falcon-7B), equal segments (``g == 1``: ``S(0)/3`` splits them), and a
weight read anywhere else (a tied weight).
"""

from __future__ import annotations

import itertools
import operator

import torch
import torch.fx as fx

from autoplan.passes.kv_rows import KVGroupRows

aten = torch.ops.aten
_WRAPPER_PREFIX = "model."  # the exported module wraps the user's model as ``model`` (autoplan.passes.trace)


def _shape(node: fx.Node) -> tuple[int, ...] | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return tuple(int(s) for s in val.shape)
    except TypeError:  # a symbolic size: not matched
        return None


def _slice_bounds(node: fx.Node, y: fx.Node, width: int, last: int) -> tuple[int, int] | None:
    """``(start, end)`` of ``slice(y, last dim, start, end)`` with step 1, else ``None``."""
    if node.op != "call_function" or node.target is not aten.slice.Tensor or node.kwargs:
        return None
    args = list(node.args) + [0, None, None, 1][len(node.args) - 1 :]
    _, dim, start, end, step = args[:5]
    if args[0] is not y or dim not in (last, -1) or step != 1:
        return None
    start = 0 if start is None else start
    if not isinstance(start, int) or not (end is None or isinstance(end, int)):
        return None
    end = width if end is None else end
    start, end = (start + width if start < 0 else start), (end + width if end < 0 else end)
    return max(0, min(start, width)), max(0, min(end, width))


def _head_dim(piece: fx.Node) -> int | None:
    """``D`` when every reader of ``piece`` views it as ``(..., heads, D)``, else ``None``."""
    dims = set()
    for user in piece.users:
        shape = _shape(user)
        if user.target is not aten.view.default or shape is None or len(shape) < 2:
            return None
        dims.add(shape[-1])
    return dims.pop() if len(dims) == 1 else None


def _param(node: object) -> str | None:
    """The parameter FQN a ``get_attr`` node reads (read by one op), else ``None``."""
    if not isinstance(node, fx.Node) or node.op != "get_attr" or len(node.users) != 1:
        return None
    target = str(node.target)
    return target.removeprefix(_WRAPPER_PREFIX) if target.startswith(_WRAPPER_PREFIX) else None


def _split_pieces(lin: fx.Node, width: int, last: int) -> list[tuple[fx.Node, int, int]] | None:
    """``(reader, start, end)`` of each piece ``linear`` node ``lin``'s output is cut into along its
    last dim: three ``slice`` readers (Phi-3), or one ``split_with_sizes`` whose three pieces are read
    by ``getitem`` (``qkv.split([q, kv, kv], dim=-1)``); else ``None``."""
    users = list(lin.users)
    if len(users) == 1 and users[0].target is aten.split_with_sizes.default and not users[0].kwargs:
        split = users[0]
        sizes, dim = split.args[1], split.args[2] if len(split.args) > 2 else 0
        if split.args[0] is not lin or dim not in (last, -1) or not isinstance(sizes, (list, tuple)):
            return None
        if not all(isinstance(x, int) for x in sizes):  # a symbolic size: not matched
            return None
        starts = [0, *itertools.accumulate(x for x in sizes if isinstance(x, int))]
        pieces = []
        for user in split.users:
            if user.target is not operator.getitem or not isinstance(user.args[1], int):
                return None
            i = user.args[1]
            pieces.append((user, starts[i], starts[i + 1]))
        return pieces if starts[-1] == width else None
    pieces = []
    for user in users:
        bounds = _slice_bounds(user, lin, width, last)
        if bounds is None:
            return None
        pieces.append((user, *bounds))
    return pieces


def _match(lin: fx.Node) -> tuple[list[str], KVGroupRows, list[tuple[fx.Node, int, int]]] | None:
    """A fused GQA projection at ``linear`` node ``lin`` (module docstring), else ``None``."""
    if lin.op != "call_function" or lin.target is not aten.linear.default or lin.kwargs:
        return None
    params = [_param(a) for a in lin.args[1:]]
    out = _shape(lin)
    if not params or any(p is None for p in params) or out is None or len(out) < 2:
        return None
    width, last = out[-1], len(out) - 1
    pieces = _split_pieces(lin, width, last)
    if pieces is None:
        return None
    pieces.sort(key=lambda p: p[1])
    if len(pieces) != 3 or pieces[0][1] != 0 or pieces[-1][2] != width:
        return None
    if any(a[2] != b[1] for a, b in zip(pieces, pieces[1:], strict=False)):
        return None
    q_rows, k_rows, v_rows = (hi - lo for _, lo, hi in pieces)
    dims = {_head_dim(node) for node, _, _ in pieces}
    if len(dims) != 1 or None in dims or k_rows != v_rows:
        return None
    head = dims.pop()
    assert head is not None
    if head <= 0 or k_rows % head or q_rows % k_rows:
        return None
    kv_heads, per_group = k_rows // head, q_rows // k_rows
    if kv_heads < 2 or per_group < 2:  # MQA (a single key/value head) or equal segments
        return None
    return [p for p in params if p is not None], KVGroupRows(kv_heads, per_group * head, head), pieces


def group_fused_qkv(gm: fx.GraphModule) -> dict[str, KVGroupRows]:
    """Rewrite every fused GQA projection of the exported forward ``gm`` to read its parameters in
    the grouped layout (module docstring); returns FQN -> layout of each such parameter."""
    layouts: dict[str, KVGroupRows] = {}
    graph = gm.graph
    for lin in list(graph.nodes):
        found = _match(lin)
        if found is None:
            continue
        names, rows, pieces = found
        out = _shape(lin)
        assert out is not None
        lead, head = list(out[:-1]), rows.kv_rows_per_group
        group_width = rows.q_rows_per_group + 2 * head
        bounds = (0, rows.q_rows_per_group, rows.q_rows_per_group + head, group_width)
        with graph.inserting_after(lin):
            grouped = graph.call_function(aten.view.default, (lin, [*lead, rows.num_kv_heads, group_width]))
        grouped.meta = {k: v for k, v in lin.meta.items() if k != "val"}
        anchor = grouped
        for i, (piece, lo, hi) in enumerate(pieces):
            with graph.inserting_after(anchor):
                part = graph.call_function(aten.slice.Tensor, (grouped, len(lead) + 1, bounds[i], bounds[i + 1]))
            with graph.inserting_after(part):
                flat = graph.call_function(aten.reshape.default, (part, [*lead, hi - lo]))
            part.meta = flat.meta = {k: v for k, v in piece.meta.items() if k != "val"}
            split = piece.args[0] if piece.target is operator.getitem else None
            piece.replace_all_uses_with(flat)
            graph.erase_node(piece)
            if isinstance(split, fx.Node) and not split.users:  # the split_with_sizes, once its pieces are gone
                graph.erase_node(split)
            anchor = flat
        for name in names:
            layouts[name] = rows
    if layouts:
        graph.lint()
        gm.recompile()
    return layouts
