r"""Part of pass 1 (trace) — ``as_strided`` that only restates a dense layout becomes a view, and
layer-norm gradients are computed from a contiguous ``grad_out``, so the joint graph is the same
on every device and every op in it has a sharding strategy.

Pooling to one element (``nn.AdaptiveAvgPool1d(1)``: Swin's classifier head) traces to a mean
followed by ``as_strided_`` onto the strides the pooling kernel would give, and its backward to
autograd's scatter into a fresh zero buffer::

    m = mean(x, [-1, -2], keepdim=True)                    (4, 32, 1, 1)
    as_strided_(m, (4, 32, 1, 1), (32, 1, 32, 32))         strides of size-one dims only
    ...
    buf = new_zeros(g, [128]); copy_(as_strided(buf, (4, 32), (32, 1)), g)
    grad = as_strided(buf, (4, 32, 1, 1), (32, 1, 1, 1))   every element of buf, in order

Neither has a DTensor strategy (``as_strided`` reads storage, which a shard does not hold), and
the scatter writes in place into a view, which a plan may not convert. Both are the identity on
values, so:

* ``as_strided(x, size, stride)`` and ``as_strided_`` with ``size == x.shape``, ``x``'s storage
  offset and ``x``'s strides on every dim longer than one read ``x`` itself;
* a zero buffer written whole by one ``copy_(as_strided(buf, ...), g)`` through a dense
  row-major view of all of it, and read afterwards only through such views, is
  ``view(clone(g, contiguous), size)`` at each read.

``native_layer_norm_backward`` gives ``grad_input`` the strides of ``grad_out`` on ``meta`` and
contiguous ones on CPU and CUDA. Where ``grad_out`` is not contiguous (Swin transposes it) the
gradient's later reshapes then trace to ``clone`` + ``view`` on ``meta`` and to ``view`` on CPU
(the plan made on ``meta`` is refused at run time), and DTensor's meta-based propagation refuses
the ``view`` of a gradient the CPU kernel made. While the step is traced,
:func:`contiguous_norm_grads` hands every layer-norm backward a contiguous ``grad_out`` (one
``clone`` in the graph where it is not), so every kernel returns a contiguous gradient.

Contract: :func:`dense_layouts` runs in place on the joint graph before
:func:`autoplan.passes.trace._clean_graph`; the graph computes the same values; new nodes copy
the metadata (module, phase, autograd sequence) of the node they replace, with their own ``val``.
:func:`contiguous_norm_grads` is entered inside ``make_fx`` around the step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_AS_STRIDED = (aten.as_strided.default, aten.as_strided_.default)
_ZEROS = (aten.new_zeros.default, aten.zeros.default)


class _ContiguousNormGrads(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is aten.native_layer_norm_backward.default and not args[0].is_contiguous():
            args = (args[0].contiguous(), *args[1:])
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def contiguous_norm_grads() -> Iterator[None]:
    """Every ``native_layer_norm_backward`` run inside reads a contiguous ``grad_out`` (module
    docstring); other ops pass through unchanged."""
    with _ContiguousNormGrads():
        yield


def dense_layouts(gm: fx.GraphModule) -> int:
    """Rewrite ``as_strided`` that restates a dense layout and the zero-buffer scatter of the
    module docstring in ``gm``, in place; returns how many nodes were rewritten (``0``: the graph
    is untouched)."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _ZEROS:
            rewritten += _scatter_as_copy(gm, node)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _AS_STRIDED and _restates_layout(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten


def _val(node: object) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _strided_args(node: fx.Node) -> tuple[list[int], list[int], int | None]:
    """``(size, stride, storage_offset)`` of an ``as_strided`` call (offset ``None``: the input's)."""
    args: list[Any] = [*node.args, None, None][:4]
    offset = node.kwargs.get("storage_offset", args[3])
    return list(args[1]), list(args[2]), offset


def _restates_layout(node: fx.Node) -> bool:
    """``as_strided(x, ...)`` that reads exactly ``x``'s elements in ``x``'s order."""
    x = _val(node.args[0])
    if x is None:
        return False
    size, stride, offset = _strided_args(node)
    if size != list(x.shape) or offset not in (None, x.storage_offset()):
        return False
    return all(n == 1 or s == xs for n, s, xs in zip(size, stride, x.stride(), strict=True))


def _row_major(size: list[int], stride: list[int]) -> bool:
    """``stride`` is the row-major stride of ``size`` on every dim longer than one."""
    expect = 1
    for n, s in reversed(list(zip(size, stride, strict=True))):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def _whole_dense_view(node: fx.Node, buf: fx.Node, numel: int) -> bool:
    if node.op != "call_function" or node.target is not aten.as_strided.default or node.args[0] is not buf:
        return False
    size, stride, offset = _strided_args(node)
    return offset in (None, 0) and math.prod(size) == numel and _row_major(size, stride)


def _scatter_as_copy(gm: fx.GraphModule, buf: fx.Node) -> int:
    """The zero-buffer scatter of the module docstring at ``buf``; returns the nodes rewritten."""
    val = _val(buf)
    if val is None or not val.is_contiguous() or val.storage_offset() != 0:
        return 0
    views = list(buf.users)
    if not views or not all(_whole_dense_view(v, buf, val.numel()) for v in views):
        return 0
    written = [v for v in views if any(u.target is aten.copy_.default for u in v.users)]
    if len(written) != 1 or len(written[0].users) != 1:
        return 0
    target = written[0]
    copy = next(iter(target.users))
    src = copy.args[1]
    src_val = _val(src)
    if (
        copy.args[0] is not target
        or copy.users
        or src_val is None
        or list(src_val.shape) != _strided_args(target)[0]
        or src_val.dtype != val.dtype
    ):
        return 0
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    reads = [v for v in views if v is not target]
    if any(order[r] < order[copy] for r in reads):
        return 0  # a read of the zeros before the write
    graph = gm.graph
    with graph.inserting_after(copy):
        flat = graph.call_function(aten.clone.default, (src,), {"memory_format": torch.contiguous_format})
    flat.meta = {k: v for k, v in copy.meta.items() if k != "val"}
    flat.meta["val"] = aten.clone.default(src_val, memory_format=torch.contiguous_format)
    for read in reads:
        size = _strided_args(read)[0]
        with graph.inserting_before(read):
            viewed = graph.call_function(aten.view.default, (flat, size))
        viewed.meta = {k: v for k, v in read.meta.items() if k != "val"}
        viewed.meta["val"] = aten.view.default(flat.meta["val"], size)
        read.replace_all_uses_with(viewed)
        graph.erase_node(read)
    for dead in (copy, target, buf):
        graph.erase_node(dead)
    return 1 + len(reads)
