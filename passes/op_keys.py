"""Profile keys: the name of one local computation of the training step, whatever node or
strategy it comes from. The cost model looks op times up by these keys
(:mod:`autoplan.passes.costing`); the on-device profiler (:mod:`autoplan.runtime.op_timing`) times
each distinct key once and stores it in the :class:`~autoplan.cost_models.profile_db.ProfileDB`.

::

    op_key        = "<op>(<args with each tensor as its rank-0 local shard>)"
                    e.g. "aten.addmm.default(f32[384], f32[512,128], f32[128,384])"
    optimizer_key = "optim.<name>(<local param>)"          e.g. "optim.adam(f32[64,128])"

The key grammar (dtype abbreviations, layouts, local shapes) is described in
:mod:`autoplan.runtime.op_timing`.
"""

from __future__ import annotations

import logging
import operator
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.fx as fx

from autoplan.passes.moe import MOE_OPS
from autoplan.passes.placement import Spec, shard_dim
from autoplan.passes.strategies import Strategy, tensor_args

log = logging.getLogger(__name__)

_DTYPE_ABBR = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
}


def _dtype_abbr(dtype: torch.dtype) -> str:
    return _DTYPE_ABBR.get(dtype) or str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class TensorArg:
    """A tensor argument of a node as traced (global shape and layout)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    order: tuple[int, ...]
    """Dims from the largest stride to the smallest (identity when contiguous)."""
    broadcast: tuple[int, ...]
    """Dims of size > 1 with stride 0 (an ``expand``)."""
    layout: str
    """``""`` when contiguous, else ``@<order>`` and ``b<broadcast dims>``."""

    @classmethod
    def of(cls, val: torch.Tensor) -> TensorArg:
        shape, stride = tuple(int(s) for s in val.shape), tuple(int(s) for s in val.stride())
        if val.is_contiguous():
            return cls(shape, stride, val.dtype, tuple(range(len(shape))), (), "")
        order = tuple(sorted(range(len(shape)), key=lambda d: (-stride[d], d)))
        broadcast = tuple(d for d in range(len(shape)) if stride[d] == 0 and shape[d] > 1)
        layout = "@" + "".join(str(d) for d in order) + ("b" + "".join(str(d) for d in broadcast) if broadcast else "")
        return cls(shape, stride, val.dtype, order, broadcast, layout)


@dataclass(frozen=True, slots=True)
class OpTemplate:
    """What a node's key is made of: text around each positional tensor argument."""

    op: str
    pieces: tuple[str, ...]
    """``len(args) + 1`` text pieces; the key is ``op(pieces[0] t0 pieces[1] t1 ... pieces[-1])``."""
    args: tuple[TensorArg, ...]


class _Slot:
    def __repr__(self) -> str:
        return "\x00"


_SLOT = _Slot()
_TEMPLATES: weakref.WeakKeyDictionary[fx.Node, OpTemplate | None] = weakref.WeakKeyDictionary()


def _op_name(target: object) -> str:
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"


def _global_text(val: torch.Tensor) -> str:
    arg = TensorArg.of(val)
    return f"{_dtype_abbr(arg.dtype)}[{','.join(map(str, arg.shape))}]{arg.layout}"


class _Text:
    """An argument rendered by its text (``repr`` returns it verbatim)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _build_template(node: fx.Node) -> OpTemplate | None:
    if node.op != "call_function" or node.target is operator.getitem or node.target in MOE_OPS:
        return None  # MoE ops: their work depends on the routing, which random inputs do not show
    targs = tensor_args(node)

    def positional(n: fx.Node) -> Any:  # stands in for an fx Argument
        val = n.meta.get("val")
        return _SLOT if isinstance(val, torch.Tensor) else _Text(repr(val))

    def keyword(n: fx.Node) -> Any:  # tensor kwargs only occur on replicated fallback ops
        val = n.meta.get("val")
        return _Text(_global_text(val)) if isinstance(val, torch.Tensor) else _Text(repr(val))

    args_text = ", ".join(repr(a) for a in fx.node.map_arg(node.args, positional))
    kwargs = fx.node.map_arg(node.kwargs, keyword)
    kw_text = ", ".join(f"{k}={kwargs[k]!r}" for k in sorted(kwargs) if k != "device")
    text = args_text + ("; " + kw_text if kw_text else "")
    pieces = tuple(text.split("\x00"))
    if len(pieces) != len(targs) + 1:  # a tensor inside an argument tensor_args does not see
        log.debug("no profile key for %s: %d tensor slots, %d tensor args", node.name, len(pieces) - 1, len(targs))
        return None
    return OpTemplate(op=_op_name(node.target), pieces=pieces, args=tuple(TensorArg.of(a.meta["val"]) for a in targs))


def op_template(node: fx.Node) -> OpTemplate | None:
    try:
        return _TEMPLATES[node]
    except KeyError:
        tmpl = _TEMPLATES[node] = _build_template(node)
        return tmpl


@lru_cache(maxsize=1 << 16)
def local_shard_shape(shape: tuple[int, ...], spec: Spec, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Rank 0's shard of a tensor of ``shape`` placed as ``spec`` (DTensor's ``torch.chunk`` rule:
    ``ceil(size / n)`` per ``S(d)`` axis, nested in mesh-axis order; ``R``/``P`` keep the size)."""
    sizes = list(shape)
    for p, n in zip(spec, mesh_shape, strict=True):
        d = shard_dim(p)
        if d is not None:
            sizes[d] = -(-sizes[d] // n)
    return tuple(sizes)


@lru_cache(maxsize=1 << 16)
def _local_text(arg: TensorArg, spec: Spec, mesh_shape: tuple[int, ...]) -> str:
    return f"{_dtype_abbr(arg.dtype)}[{','.join(map(str, local_shard_shape(arg.shape, spec, mesh_shape)))}]{arg.layout}"


def op_key(node: fx.Node, strategy: Strategy, mesh_shape: Sequence[int]) -> str | None:
    """The profile key of ``node`` run with ``strategy`` on a mesh of ``mesh_shape``.

    ``None`` for nodes that are not timed (placeholders, ``getitem``, the output). The text
    around the tensors is computed once per node; local shapes are cached.
    """
    tmpl = op_template(node)
    if tmpl is None:
        return None
    if len(strategy.input_specs) != len(tmpl.args):
        raise ValueError(f"{node.name}: strategy has {len(strategy.input_specs)} input specs for {len(tmpl.args)} args")
    mesh = tuple(mesh_shape)
    parts = [tmpl.op, "(", tmpl.pieces[0]]
    for arg, spec, piece in zip(tmpl.args, strategy.input_specs, tmpl.pieces[1:], strict=True):
        parts.append(_local_text(arg, spec, mesh))
        parts.append(piece)
    parts.append(")")
    return "".join(parts)


def optimizer_key(optimizer_name: str, local_shape: Sequence[int], dtype: torch.dtype) -> str:
    """The profile key of one optimizer step over a parameter shard of ``local_shape``."""
    return f"optim.{optimizer_name}({_dtype_abbr(dtype)}[{','.join(str(int(s)) for s in local_shape)}])"
