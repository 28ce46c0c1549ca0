"""``autoplan export-onnx``: the traced training step as ONNX, carrying the plan as ONNX's own
multi-device sharding annotations (IR version 10, onnx >= 1.16).

    autoplan export-onnx plan.json -o model.onnx        # the model from plan.workload
    autoplan export-onnx plan.json -o model.onnx --model my_models.py:build

Graph
-----
One ONNX node per ``call_function`` node of the trace the plan was made for (``getitem`` nodes
become the outputs of their producer), with the FX node's name, so every plan node is one ONNX
node. Common aten ops become standard ONNX ops (``_STANDARD``: MatMul, Gemm, Add, Mul, Reshape,
Transpose, Softmax, LayerNormalization, Gather, ReduceSum, ...) when their semantics match
exactly; every other op, or one called with arguments ONNX cannot express, is a node of the
custom domain ``org.pytorch.<namespace>`` (``org.pytorch.aten``) with ``op_type`` = the overload
name (``addmm.default``), the tensor arguments as inputs in the aten order and the other
arguments as attributes named as in the aten schema. Parameters, buffers, inputs and targets
are typed graph inputs, no weights (a model on ``meta`` exports; a 70B model costs kilobytes);
the graph outputs are ``(loss, *grads)``; every value has its shape and dtype in ``value_info``.

Annotations
-----------
``ModelProto.configuration`` holds one :class:`DeviceConfigurationProto` (all cluster devices,
rank ``r`` named ``node<n>/<device>:<local>``). Each plan node has one
``NodeDeviceConfigurationProto`` whose ``sharding_spec`` lists its outputs (node output order)
then its tensor arguments (the plan's ``in`` order, which is the aten argument order).
Graph inputs are annotated, as the proto intends, by their consumers' sharding specs.

A spec maps to a ``ShardingSpecProto`` the way ``torch.distributed.tensor`` lays data out: the
mesh axes with ``S(d)`` split tensor dim ``d`` into ``num_shards`` = the product of their sizes
(a ``ShardedDimProto``, dims in increasing order), the first such mesh axis outermost; shards
are numbered row-major over the sharded dims; ``device[s]`` holds shard ``s``: a device id, or
the key ``-(s+1)`` of ``index_to_device_group_map`` when several devices hold the same shard (the
mesh axes that do not shard the tensor). ``S(0),R`` on a 2x2 mesh: ``sharded_dim [{axis 0,
num_shards 2}]``, ``device [-1, -2]``, groups ``-1: [0, 1]``, ``-2: [2, 3]``. Device ids are
ranks of the cluster mesh, row-major; for pipeline plans the placements are on the stage mesh
``(dp, tp)`` and stage ``k`` runs on ranks ``(k % pp) * dp * tp + ...`` (``NodeDeviceConfiguration
Proto.pipeline_stage`` = the stage of the node's segment, :mod:`autoplan.passes.layers`).

What the ONNX form cannot carry: ``P`` / ``P(avg)`` (no partial values in ONNX's sharding
formalism: they are written as replicated, which is where the partial buffers live) and ``S(d)``
along a mesh axis of size 1 (no shard count tells the axis apart). For those sharding specs
the node gets ``metadata_props["autoplan.spec.<k>"]`` = the full autoplan spec (``k`` = index
in its ``sharding_spec`` list); :func:`read_shardings` checks that it agrees with the ONNX
spec. A graph input whose own placement differs from what its consumers ask for (a collective
converts it) has ``ValueInfoProto.metadata_props["autoplan.spec"]``. ``ModelProto.metadata_props``
holds the fingerprint, cluster, mesh, the mesh of the specs, configuration and pipeline layout.

Validity
--------
:func:`check_model` runs ``onnx.checker.check_model(model, full_check=True)``: structure, opset
imports, and strict type and shape inference of every standard node against the declared
``value_info``. ONNX skips inference errors in a graph with ops it has no schema for, so
:func:`custom_op_schemas` registers a schema (heterogeneous variadic inputs/outputs, optional
attributes) for each custom op for the duration of the check, and the standard ops are really
checked.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import operator
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor import Replicate, Shard

from autoplan.cost_models.errors import PlanError
from autoplan.cost_models.files import atomic_write, refuse_overwriting_inputs
from autoplan.passes.layers import Layering, find_layers
from autoplan.passes.placement import Spec, parse_spec, spec_strs
from autoplan.passes.stages import stage_of_segment
from autoplan.passes.strategies import tensor_args
from autoplan.passes.trace import TracedProgram, param_node_name, trace_training_step
from autoplan.planner.plan import Plan
from autoplan.planner.tracing import trace_for_plan
from autoplan.tools import console
from autoplan.tools.loader import build_workload, target_file

if TYPE_CHECKING:
    import onnx

log = logging.getLogger(__name__)

IR_VERSION = 10
"""First IR version with the multi-device fields (onnx 1.16)."""
OPSET = 21
"""Default-domain opset (onnx 1.16; Gelu needs 20, ReduceMean with an axes input 18)."""
CUSTOM_DOMAIN_PREFIX = "org.pytorch."
CUSTOM_OPSET = 1
SPEC_KEY = "autoplan.spec"
INSTALL_HINT = 'pip install "onnx>=1.16"'


class OnnxMissingError(PlanError):
    """The optional ``onnx`` package is not installed (or too old for sharding annotations)."""


def _onnx() -> Any:
    try:
        import onnx
    except ImportError:
        raise OnnxMissingError(f"exporting to ONNX needs the onnx package: {INSTALL_HINT}") from None
    if not hasattr(onnx, "NodeDeviceConfigurationProto"):
        raise OnnxMissingError(
            f"onnx {onnx.__version__} has no multi-device annotations (added in 1.16): {INSTALL_HINT}"
        )
    return onnx


# --- dtypes and attributes -----------------------------------------------------------------------

_DTYPES = {
    torch.float32: 1, torch.uint8: 2, torch.int8: 3, torch.int16: 5, torch.int32: 6, torch.int64: 7,
    torch.bool: 9, torch.float16: 10, torch.float64: 11, torch.bfloat16: 16,
}  # fmt: skip
"""torch dtype -> ``onnx.TensorProto.DataType`` (numbers from ``onnx.proto``; onnx is imported lazily)."""


def _elem_type(dtype: torch.dtype) -> int:
    if dtype not in _DTYPES:
        raise PlanError(f"dtype {dtype} has no ONNX element type: export models using {sorted(map(str, _DTYPES))}")
    return _DTYPES[dtype]


def _attribute(name: str, value: Any) -> Any:
    """An ONNX attribute for a non-tensor aten argument (``None``: leave it out)."""
    helper = _onnx().helper
    if value is None:
        return None
    if isinstance(value, bool):
        return helper.make_attribute(name, int(value))
    if isinstance(value, (int, float, str)):
        return helper.make_attribute(name, value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, bool)) for v in value):
        return helper.make_attribute(name, [int(v) for v in value], attr_type=_onnx().AttributeProto.INTS)
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value):
        return helper.make_attribute(name, [float(v) for v in value], attr_type=_onnx().AttributeProto.FLOATS)
    return helper.make_attribute(name, str(value))


# --- translation context ---------------------------------------------------------------------------


@dataclass(slots=True)
class _Ctx:
    """Names of FX values in the ONNX graph and the tiny constants the translations add."""

    values: dict[str, list[str]] = field(default_factory=dict)
    """FX node name -> ONNX value name per output."""
    initializers: list[Any] = field(default_factory=list)

    def value(self, node: fx.Node) -> str:
        if node.op == "call_function" and node.target is operator.getitem:
            parent, idx = node.args
            assert isinstance(parent, fx.Node) and isinstance(idx, int)
            return self.values[parent.name][idx]
        return self.values[node.name][0]

    def const(self, name: str, dtype: torch.dtype, dims: Sequence[int], vals: Sequence[Any]) -> str:
        self.initializers.append(_onnx().helper.make_tensor(name, _elem_type(dtype), list(dims), list(vals)))
        return name


def _out_dtype(node: fx.Node) -> torch.dtype:
    val = node.meta["val"]
    return (val[0] if isinstance(val, (tuple, list)) else val).dtype


def _is_tensor(a: Any) -> bool:
    return isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)


# --- standard ops: one small function per aten op; None = no exact ONNX equivalent ----------------

Translation = tuple[str, list[str], dict[str, Any]]
"""(ONNX op_type, input names, attributes)."""
Translator = Callable[[fx.Node, tuple[Any, ...], Mapping[str, Any], _Ctx], Translation | None]
"""(node, its args, its kwargs, context) -> the standard node, or None for the custom-domain node."""

aten = torch.ops.aten
_STANDARD: dict[Any, Translator] = {}


def _register(*targets: Any) -> Callable[[Translator], Translator]:
    def deco(fn: Translator) -> Translator:
        for t in targets:
            _STANDARD[t] = fn
        return fn

    return deco


def _usable(node: fx.Node, a: Any) -> bool:
    """A tensor of the output dtype or a Python number (made a scalar constant of that dtype)."""
    if _is_tensor(a):
        return bool(a.meta["val"].dtype == _out_dtype(node))
    return isinstance(a, (int, float)) and not isinstance(a, bool)


def _operand(node: fx.Node, a: Any, k: int, ctx: _Ctx) -> str:
    return ctx.value(a) if _is_tensor(a) else ctx.const(f"{node.name}.arg{k}", _out_dtype(node), [], [a])


def _simple(op_type: str, nargs: int) -> Translator:
    def translate(node: fx.Node, args: tuple[Any, ...], kw: Mapping[str, Any], ctx: _Ctx) -> Translation | None:
        if kw.get("alpha", 1) != 1 or kw.get("rounding_mode") is not None:
            return None
        if len(args) != nargs or not all(_usable(node, a) for a in args):
            return None
        return op_type, [_operand(node, a, k, ctx) for k, a in enumerate(args)], {}

    return translate


for _targets, _op, _n in (
    ((aten.add.Tensor, aten.add.Scalar), "Add", 2),
    ((aten.sub.Tensor, aten.sub.Scalar), "Sub", 2),
    ((aten.mul.Tensor, aten.mul.Scalar), "Mul", 2),
    ((aten.div.Tensor, aten.div.Scalar), "Div", 2),
    ((aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor), "Pow", 2),
    ((aten.mm.default, aten.bmm.default, aten.matmul.default), "MatMul", 2),
    ((aten.relu.default,), "Relu", 1),
    ((aten.tanh.default,), "Tanh", 1),
    ((aten.sigmoid.default,), "Sigmoid", 1),
    ((aten.neg.default,), "Neg", 1),
    ((aten.exp.default,), "Exp", 1),
    ((aten.sqrt.default,), "Sqrt", 1),
    ((aten.clone.default, aten.alias.default, aten.detach.default), "Identity", 1),
):
    _register(*_targets)(_simple(_op, _n))


@_register(aten.addmm.default)
def _addmm(node: fx.Node, args: tuple[Any, ...], kw: Mapping[str, Any], ctx: _Ctx) -> Translation | None:
    bias, a, b = args[:3]
    if not all(_is_tensor(x) for x in (bias, a, b)) or len(args) > 3:
        return None
    alpha, beta = float(kw.get("alpha", 1)), float(kw.get("beta", 1))
    return "Gemm", [ctx.value(a), ctx.value(b), ctx.value(bias)], {"alpha": alpha, "beta": beta}


def _perm(ndim: int, swap: tuple[int, int] | None = None) -> list[int]:
    perm = list(range(ndim))
    if swap is not None:
        i, j = (d % ndim for d in swap)
        perm[i], perm[j] = perm[j], perm[i]
    return perm


@_register(aten.t.default, aten.transpose.int, aten.permute.default)
def _transpose(node: fx.Node, args: tuple[Any, ...], kw: Mapping[str, Any], ctx: _Ctx) -> Translation | None:
    x = args[0]
    assert isinstance(x, fx.Node)
    ndim = x.meta["val"].dim()
    if node.target is aten.t.default:
        perm = _perm(ndim)[::-1]
    elif node.target is aten.transpose.int:
        perm = _perm(ndim, (int(args[1]), int(args[2])))
    else:
        perm = [int(d) % ndim for d in args[1]]
    return "Transpose", [ctx.value(x)], {"perm": perm}


@_register(aten.view.default, aten.reshape.default, aten._unsafe_view.default)
def _reshape(node: fx.Node, args: tuple[Any, ...], kw: Mapping[str, Any], ctx: _Ctx) -> Translation | None:
    x, shape = args[0], list(node.meta["val"].shape)
    assert isinstance(x, fx.Node)
    return "Reshape", [ctx.value(x), ctx.const(f"{node.name}.shape", torch.int64, [len(shape)], shape)], {}


@_register(aten.gelu.default)
def _gelu(node: fx.Node, args: tuple[Any, ...], kw: Mapping[str, Any], ctx: _Ctx) -> Translation | None:
    x = args[0]
    assert isinstance(x, fx.Node)
    return "Gelu", [ctx.value(x)], {"approximate": str(kw.get("approximate", "none"))}


@_register(aten._softmax.default, aten._log_softmax.default)
def _softmax(node: fx.Node, args: tuple[Any, ...], kw: Mapping[str, Any], ctx: _Ctx) -> Translation | None:
    x, dim, half_to_float = args
    if half_to_float or not isinstance(x, fx.Node):
        return None
    op = "Softmax" if node.target is aten._softmax.default else "LogSoftmax"
    return op, [ctx.value(x)], {"axis": int(dim)}


@_register(aten.cat.default)
def _cat(node: fx.Node, args: tuple[Any, ...], kw: Mapping[str, Any], ctx: _Ctx) -> Translation | None:
    tensors, dim = args[0], args[1] if len(args) > 1 else 0
    dtype = _out_dtype(node)
    if not all(_is_tensor(t) and t.meta["val"].dtype == dtype for t in tensors):
        return None
    return "Concat", [ctx.value(t) for t in tensors], {"axis": int(dim)}


@_register(aten.embedding.default)
def _embedding(node: fx.Node, args: tuple[Any, ...], kw: Mapping[str, Any], ctx: _Ctx) -> Translation | None:
    weight, ids = args[:2]
    if args[2:] or kw or not (_is_tensor(weight) and _is_tensor(ids)):
        return None  # padding_idx / scale_grad_by_freq only change the backward, keep them visible
    return "Gather", [ctx.value(weight), ctx.value(ids)], {"axis": 0}


@_register(aten.sum.dim_IntList, aten.mean.dim)
def _reduce(node: fx.Node, args: tuple[Any, ...], kw: Mapping[str, Any], ctx: _Ctx) -> Translation | None:
    x, dims = args[0], args[1] if len(args) > 1 else None
    keepdim = bool(args[2]) if len(args) > 2 else bool(kw.get("keepdim", False))
    if not _is_tensor(x) or kw.get("dtype") is not None or x.meta["val"].dtype != _out_dtype(node):
        return None
    assert isinstance(x, fx.Node)
    ins = [ctx.value(x)]
    if dims:
        ins.append(ctx.const(f"{node.name}.axes", torch.int64, [len(dims)], [int(d) for d in dims]))
    op = "ReduceSum" if node.target is aten.sum.dim_IntList else "ReduceMean"
    return op, ins, {"keepdims": int(keepdim)}


@_register(aten._to_copy.default)
def _cast(node: fx.Node, args: tuple[Any, ...], kw: Mapping[str, Any], ctx: _Ctx) -> Translation | None:
    x = args[0]
    if not _is_tensor(x) or set(kw) - {"dtype", "device", "layout"}:
        return None
    assert isinstance(x, fx.Node)
    return "Cast", [ctx.value(x)], {"to": _elem_type(_out_dtype(node))}


@_register(aten.native_layer_norm.default)
def _layer_norm(node: fx.Node, args: tuple[Any, ...], kw: Mapping[str, Any], ctx: _Ctx) -> Translation | None:
    x, normalized_shape, weight, bias, eps = args
    if not (_is_tensor(x) and _is_tensor(weight) and _is_tensor(bias)) or _out_dtype(node) != torch.float32:
        return None
    ins = [ctx.value(x), ctx.value(weight), ctx.value(bias)]
    return "LayerNormalization", ins, {"axis": -len(normalized_shape), "epsilon": float(eps)}


def _custom(node: fx.Node, ctx: _Ctx) -> tuple[str, str, list[str], list[Any]]:
    """(domain, op_type, inputs, attributes) of the custom-domain node for ``node``."""
    target = node.target
    assert isinstance(target, torch._ops.OpOverload), target
    namespace, name = target._schema.name.split("::")
    attrs = []
    for arg, value in zip(target._schema.arguments, [*node.args, *([None] * len(target._schema.arguments))]):
        value = node.kwargs.get(arg.name, value)
        if arg.name == "device":  # where the trace ran (meta or CPU): the plan says where ops run
            continue
        if not any(isinstance(v, fx.Node) for v in pytree.tree_leaves(value)):
            attr = _attribute(arg.name, value)
        elif isinstance(value, (list, tuple)) and any(v is None for v in value):  # e.g. index's [None, idx]
            attr = _attribute(f"{arg.name}_is_tensor", [int(isinstance(v, fx.Node)) for v in value])
        else:
            continue
        if attr is not None:
            attrs.append(attr)
    extra = [a for a in pytree.tree_leaves(node.kwargs) if _is_tensor(a)]
    inputs = [ctx.value(a) for a in [*tensor_args(node), *extra]]
    op_type = f"{name}.{target._overloadname}"
    return CUSTOM_DOMAIN_PREFIX + namespace, op_type, inputs, attrs


# --- placements -> ShardingSpecProto ------------------------------------------------------------


def _coords(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for size in mesh_shape:
        out = [(*c, i) for c in out for i in range(size)]
    return out


def _sharded_dims(spec: Spec, mesh_shape: Sequence[int]) -> dict[int, list[int]]:
    """Tensor dim -> the mesh axes (size > 1) that split it, outermost first."""
    dims: dict[int, list[int]] = {}
    for axis, p in enumerate(spec):
        if isinstance(p, Shard) and mesh_shape[axis] > 1:
            dims.setdefault(p.dim, []).append(axis)
    return dict(sorted(dims.items()))


def _shard_of_device(spec: Spec, mesh_shape: Sequence[int]) -> tuple[list[tuple[int, int]], list[int]]:
    """``([(dim, num_shards)], shard index of each device of the mesh, row-major)``."""
    dims = _sharded_dims(spec, mesh_shape)
    sizes = [(d, math.prod(mesh_shape[a] for a in axes)) for d, axes in dims.items()]
    shards = []
    for c in _coords(mesh_shape):
        s = 0
        for (_, n), axes in zip(sizes, dims.values(), strict=True):
            i = 0
            for a in axes:
                i = i * mesh_shape[a] + c[a]
            s = s * n + i
        shards.append(s)
    return sizes, shards


def _expressible(spec: Spec, mesh_shape: Sequence[int]) -> Spec:
    """What the ONNX form keeps of ``spec``: partial values and shards along size-1 axes as ``R``."""
    return tuple(p if isinstance(p, Shard) and mesh_shape[a] > 1 else Replicate() for a, p in enumerate(spec))


def sharding_spec(
    tensor_name: str, spec: Spec, shape: Sequence[int], mesh_shape: Sequence[int], device_base: int = 0
) -> Any:
    """The ``ShardingSpecProto`` of ``tensor_name`` (global ``shape``) placed ``spec`` on a mesh
    of ``mesh_shape`` whose ranks start at ``device_base`` (see the module docstring)."""
    onnx = _onnx()
    sizes, shards = _shard_of_device(spec, mesh_shape)
    proto = onnx.ShardingSpecProto(tensor_name=tensor_name)
    holders: dict[int, list[int]] = {}
    for rank, s in enumerate(shards):
        holders.setdefault(s, []).append(device_base + rank)
    for s in range(math.prod(n for _, n in sizes)):
        if len(holders[s]) == 1:
            proto.device.append(holders[s][0])
        else:
            proto.device.append(-(s + 1))
            proto.index_to_device_group_map.append(onnx.IntIntListEntryProto(key=-(s + 1), value=holders[s]))
    for d, n in sizes:
        dim = proto.sharded_dim.add(axis=d)
        dim.simple_sharding.add(dim_value=int(shape[d]), num_shards=n)
    return proto


def decode_sharding_spec(proto: Any, mesh_shape: Sequence[int]) -> tuple[str, ...]:
    """The autoplan spec of a ``ShardingSpecProto`` (inverse of :func:`sharding_spec` up to
    :func:`_expressible`); raises ``ValueError`` for a layout that is not a mesh placement."""
    size = math.prod(mesh_shape)
    groups = {e.key: list(e.value) for e in proto.index_to_device_group_map}
    shard_of: dict[int, int] = {}
    for s, entry in enumerate(proto.device):
        for dev in groups.get(entry, [entry]):
            shard_of[dev % size] = s
    dims = [(int(d.axis), math.prod(x.num_shards for x in d.simple_sharding)) for d in proto.sharded_dim]
    coords = _coords(mesh_shape)
    if sorted(shard_of) != list(range(size)):
        raise ValueError(f"sharding of {proto.tensor_name!r} does not cover the {size} devices of the mesh once")

    def index(rank: int) -> list[int]:
        s, out = shard_of[rank], []
        for _, n in reversed(dims):
            out.append(s % n)
            s //= n
        return out[::-1]

    placements = []
    for axis in range(len(mesh_shape)):
        moved = [r for r, c in enumerate(coords) if c[axis] == 1]  # neighbour along the axis of rank r - stride
        stride = math.prod(mesh_shape[axis + 1 :])
        changed = {k for r in moved for k, (a, b) in enumerate(zip(index(r), index(r - stride))) if a != b}
        if len(changed) > 1:
            raise ValueError(f"sharding of {proto.tensor_name!r}: mesh axis {axis} splits several tensor dims")
        placements.append(f"S({dims[changed.pop()][0]})" if changed else "R")
    spec = parse_spec(placements)
    _, expect = _shard_of_device(spec, mesh_shape)
    if [s for _, s in sorted(shard_of.items())] != expect:
        raise ValueError(f"sharding of {proto.tensor_name!r} is not a placement on mesh {tuple(mesh_shape)}")
    return tuple(placements)


# --- the model --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class _Layout:
    """Where the plan's specs live: their mesh, and the first rank of each node's stage."""

    config_name: str
    spec_mesh: tuple[int, ...]
    stage_of: Mapping[str, int]
    """Node name -> pipeline stage (pipeline plans only)."""
    pp: int

    def base(self, node: str) -> int:
        return (self.stage_of.get(node, 0) % self.pp) * math.prod(self.spec_mesh)


def _stage_map(plan: Plan, traced: TracedProgram) -> tuple[dict[str, int], dict[str, str]]:
    """Node -> pipeline stage of its segment, and node -> the blocks it stands for (the last
    traced block of a depth-reduced plan)."""
    layout = plan.pipeline
    assert layout is not None
    layering = find_layers(traced)
    num_full = len(layout.segment_names) - 2
    kept = layering.num_blocks
    full_depth = Layering(block_prefix=layering.block_prefix, num_blocks=num_full, segment_of={}, param_segments={})
    stage = stage_of_segment(full_depth, layout.stage_starts)  # reads only the number of segments
    stages, stands = {}, {}
    for name, seg in layering.segment_of.items():
        full_seg = seg if seg <= kept else seg + num_full - kept
        stages[name] = stage(full_seg)
        if layout.reduced and seg == kept:
            stands[name] = f"{layout.segment_names[kept]}..{layout.segment_names[num_full]}"
    return stages, stands


def to_onnx(plan: Plan, traced: TracedProgram) -> onnx.ModelProto:
    """The traced step ``traced`` (the plan's trace: same fingerprint) as an annotated ONNX model."""
    onnx = _onnx()
    helper = onnx.helper
    if traced.fingerprint != plan.fingerprint:
        raise PlanError(
            f"the plan is for graph fingerprint {plan.fingerprint} but the model traces to {traced.fingerprint}: "
            "export with the model the plan was made for (--model FILE.py:FUNCTION)"
        )
    c = plan.cluster
    stage_of, stands = _stage_map(plan, traced) if plan.pipeline is not None else ({}, {})
    layout = _Layout(
        config_name=f"autoplan/{c}",
        spec_mesh=tuple(plan.pipeline.stage_mesh_shape) if plan.pipeline is not None else tuple(c.mesh_shape),
        stage_of=stage_of,
        pp=plan.config.pp if plan.config is not None else 1,
    )
    assignment = plan.assignment()
    ctx = _Ctx()
    gm = traced.graph_module
    inputs, nodes, value_info, domains = [], [], [], {}
    consumers: dict[str, list[tuple[str, Spec]]] = {}  # placeholder -> (node, in spec) per use

    def info(name: str, val: Any) -> Any:
        return helper.make_tensor_value_info(name, _elem_type(val.dtype), list(val.shape))

    for n in gm.graph.nodes:
        if n.op == "placeholder":
            ctx.values[n.name] = [n.name]
            inputs.append(info(n.name, n.meta["val"]))
        elif n.op == "get_attr":
            raise PlanError(f"the traced step holds a constant tensor ({n.name}); ONNX export does not support it")
        elif n.op == "call_function" and n.target is not operator.getitem:
            val = n.meta["val"]
            vals = list(val) if isinstance(val, (tuple, list)) else [val]
            ctx.values[n.name] = [n.name] if len(vals) == 1 else [f"{n.name}.{i}" for i in range(len(vals))]
            translate = _STANDARD.get(n.target)
            std = translate(n, tuple(n.args), n.kwargs, ctx) if translate is not None else None
            if std is not None:
                op_type, ins, attrs = std
                proto = helper.make_node(op_type, ins, ctx.values[n.name], name=n.name, **attrs)
            else:
                domain, op_type, ins, attr_protos = _custom(n, ctx)
                domains[domain] = CUSTOM_OPSET
                proto = helper.make_node(op_type, ins, ctx.values[n.name], name=n.name, domain=domain)
                proto.attribute.extend(attr_protos)
            proto.doc_string = str(n.target)
            for out, v in zip(ctx.values[n.name], vals, strict=True):
                if isinstance(v, torch.Tensor):
                    value_info.append(info(out, v))
            if n.name in plan.nodes:
                _annotate(proto, n, plan.nodes[n.name], ctx, layout)
                if n.name in stands:
                    proto.metadata_props.add(key="autoplan.stands_for", value=stands[n.name])
                for a, spec in zip(tensor_args(n), plan.strategy_of(n.name).input_specs, strict=True):
                    if a.op == "placeholder":
                        consumers.setdefault(a.name, []).append((n.name, spec))
            nodes.append(proto)

    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    out_names = list(dict.fromkeys(ctx.value(a) for a in out_node.args[0] if isinstance(a, fx.Node)))
    outputs = [vi for vi in value_info if vi.name in out_names]
    outputs.sort(key=lambda vi: out_names.index(vi.name))
    for vi in inputs:  # a placeholder's own placement, where its consumers do not state it
        strategy = assignment.get(vi.name)
        if strategy is None:  # buffers: replicated, as their consumers say
            continue
        own = strategy.output_specs[0]
        uses = consumers.get(vi.name, [])
        if not uses or any(s != own for _, s in uses):
            vi.metadata_props.add(key=SPEC_KEY, value=",".join(spec_strs(own)))
    graph = helper.make_graph(
        nodes,
        f"autoplan_step_{plan.fingerprint}",
        inputs,
        outputs,
        initializer=ctx.initializers,
        value_info=[vi for vi in value_info if vi.name not in out_names],
    )
    opsets = [helper.make_opsetid("", OPSET), *(helper.make_opsetid(d, v) for d, v in sorted(domains.items()))]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="autoplan", ir_version=IR_VERSION)
    dev_names = [f"node{r // c.devices_per_node}/{c.device.name}:{r % c.devices_per_node}" for r in range(c.world_size)]
    model.configuration.add(name=layout.config_name, num_devices=c.world_size, device=dev_names)
    meta = {
        "autoplan.fingerprint": plan.fingerprint,
        "autoplan.cluster": json.dumps(c.to_dict(), sort_keys=True),
        "autoplan.mesh_shape": ",".join(map(str, c.mesh_shape)),
        "autoplan.mesh_axis_names": ",".join(c.mesh_axis_names),
        "autoplan.spec_mesh_shape": ",".join(map(str, layout.spec_mesh)),
        "autoplan.workload": plan.workload,
        **({"autoplan.config": json.dumps(plan.config.to_dict())} if plan.config is not None else {}),
        **({"autoplan.pipeline": json.dumps(plan.pipeline.to_dict())} if plan.pipeline is not None else {}),
    }
    helper.set_model_props(model, meta)
    return model


def _annotate(proto: Any, n: fx.Node, entry: Mapping[str, Any], ctx: _Ctx, layout: _Layout) -> None:
    """Add the node's ``NodeDeviceConfigurationProto``: outputs, then tensor arguments."""
    onnx = _onnx()
    cfg = onnx.NodeDeviceConfigurationProto(configuration_id=layout.config_name)
    if n.name in layout.stage_of:
        cfg.pipeline_stage = layout.stage_of[n.name]
    val = n.meta["val"]
    vals = list(val) if isinstance(val, (tuple, list)) else [val]
    tensors = [(out, v, s) for out, v, s in zip(ctx.values[n.name], vals, entry["out"], strict=True) if s is not None]
    tensors += [(ctx.value(a), a.meta["val"], s) for a, s in zip(tensor_args(n), entry["in"], strict=True)]
    base = layout.base(n.name)
    for k, (name, v, texts) in enumerate(tensors):
        spec = parse_spec(texts)
        cfg.sharding_spec.append(sharding_spec(name, spec, v.shape, layout.spec_mesh, base))
        if _expressible(spec, layout.spec_mesh) != spec:
            proto.metadata_props.add(key=f"{SPEC_KEY}.{k}", value=",".join(texts))
    proto.device_configurations.append(cfg)


# --- reading the annotations back ---------------------------------------------------------------------


def _props(entries: Any) -> dict[str, str]:
    return {e.key: e.value for e in entries}


def _node_specs(node: Any, mesh: Sequence[int]) -> list[tuple[str, tuple[str, ...]]]:
    """(tensor name, spec) per sharding spec of a node, metadata overrides applied and checked."""
    props = _props(node.metadata_props)
    out = []
    for cfg in node.device_configurations:
        for k, ss in enumerate(cfg.sharding_spec):
            spec = decode_sharding_spec(ss, mesh)
            full = props.get(f"{SPEC_KEY}.{k}")
            if full is not None:
                if spec_strs(_expressible(parse_spec(full.split(",")), mesh)) != list(spec):
                    raise ValueError(f"node {node.name}: {SPEC_KEY}.{k}={full} disagrees with its ONNX sharding {spec}")
                spec = tuple(full.split(","))
            out.append((ss.tensor_name, spec))
    return out


def read_shardings(model: onnx.ModelProto) -> dict[str, tuple[str, ...]]:
    """The placements an exported model carries, keyed like :func:`plan_shardings`:
    ``<node>.out<i>`` / ``<node>.in<i>`` per annotated node and the graph input's name per
    placed graph input (``p_<fqn>``, ``input_<i>``, ``target_<i>``, buffers)."""
    mesh = tuple(int(x) for x in _props(model.metadata_props)["autoplan.spec_mesh_shape"].split(","))
    out: dict[str, tuple[str, ...]] = {}
    first_use: dict[str, tuple[str, ...]] = {}
    for node in model.graph.node:
        if not node.device_configurations:
            continue
        specs = _node_specs(node, mesh)
        outputs = [(t, s) for t, s in specs if t in node.output]
        for t, s in outputs:
            out[f"{node.name}.out{list(node.output).index(t)}"] = s
        for i, (t, s) in enumerate(specs[len(outputs) :]):
            out[f"{node.name}.in{i}"] = s
            first_use.setdefault(t, s)
    for vi in model.graph.input:
        own = _props(vi.metadata_props).get(SPEC_KEY)
        if own is not None:
            out[vi.name] = tuple(own.split(","))
        elif vi.name in first_use:
            out[vi.name] = first_use[vi.name]
    return out


def plan_shardings(plan: Plan) -> dict[str, tuple[str, ...]]:
    """The plan's placements keyed as :func:`read_shardings` reads them (``null`` outputs left out)."""
    out: dict[str, tuple[str, ...]] = {}
    for name, entry in plan.nodes.items():
        for i, s in enumerate(entry["out"]):
            if s is not None:
                out[f"{name}.out{i}"] = tuple(s)
        for i, s in enumerate(entry["in"]):
            out[f"{name}.in{i}"] = tuple(s)
    for fqn in plan.param_names:
        out[param_node_name(fqn)] = tuple(plan.param_specs[fqn])
    out.update({f"input_{i}": tuple(s) for i, s in enumerate(plan.input_specs)})
    out.update({f"target_{i}": tuple(s) for i, s in enumerate(plan.target_specs)})
    return out


# --- checking and writing -------------------------------------------------------------------------------

_ANY_TENSOR = [f"tensor({t})" for t in ("float", "float16", "bfloat16", "double", "int64", "int32", "int16", "int8", "uint8", "bool")]  # fmt: skip


def custom_op_schemas(model: onnx.ModelProto) -> list[Any]:
    """An ``OpSchema`` per custom-domain op of ``model``: any tensors in and out, its attributes
    optional (no shape inference: the declared ``value_info`` stands)."""
    onnx = _onnx()
    schema_cls = onnx.defs.OpSchema
    variadic = schema_cls.FormalParameterOption.Variadic
    attrs: dict[tuple[str, str], dict[str, Any]] = {}
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            seen = attrs.setdefault((node.domain, node.op_type), {})
            for a in node.attribute:
                seen[a.name] = schema_cls.AttrType(a.type)
    return [
        schema_cls(
            op_type,
            domain,
            CUSTOM_OPSET,
            inputs=[
                schema_cls.FormalParameter("inputs", "T", param_option=variadic, is_homogeneous=False, min_arity=0)
            ],
            outputs=[
                schema_cls.FormalParameter("outputs", "T", param_option=variadic, is_homogeneous=False, min_arity=0)
            ],
            type_constraints=[("T", _ANY_TENSOR, "any tensor")],
            attributes=[schema_cls.Attribute(name, t, "", required=False) for name, t in sorted(a.items())],
        )
        for (domain, op_type), a in sorted(attrs.items())
    ]


@contextlib.contextmanager
def _registered(schemas: Sequence[Any]) -> Iterator[None]:
    defs = _onnx().defs
    done = []
    try:
        for s in schemas:
            if not defs.has(s.name, s.domain):
                defs.register_schema(s)
                done.append(s)
        yield
    finally:
        for s in done:
            defs.deregister_schema(s.name, s.since_version, s.domain)


def check_model(model: onnx.ModelProto) -> None:
    """``onnx.checker.check_model(model, full_check=True)`` with the custom ops' schemas
    registered meanwhile, so strict shape inference checks every standard node."""
    with _registered(custom_op_schemas(model)):
        _onnx().checker.check_model(model, full_check=True)


def export_onnx(plan: Plan, traced: TracedProgram, path: str | os.PathLike[str]) -> onnx.ModelProto:
    """Build, check and write (atomically) the annotated model; returns it."""
    model = to_onnx(plan, traced)
    check_model(model)
    atomic_write(path, model.SerializeToString(), what="ONNX model")
    return model


def trace_plan_model(plan: Plan, target: str, *, seed: int = 0) -> TracedProgram:
    """Build ``target`` (``FILE.py:FUNCTION``) on ``meta`` and trace the step the plan is for
    (:func:`autoplan.planner.tracing.trace_for_plan` for plans made with a global batch)."""
    wl = build_workload(target, device="meta", seed=seed)
    if plan.config is not None:
        return trace_for_plan(plan, wl.model, wl.example_inputs, wl.example_targets, wl.loss_fn)
    return trace_training_step(wl.model, wl.example_inputs, loss_fn=wl.loss_fn, example_targets=wl.example_targets)


# --- command line -------------------------------------------------------------------------------------


def cmd_export_onnx(args: argparse.Namespace) -> int:
    _onnx()  # fail on a missing onnx before tracing
    plan = Plan.load(args.plan)
    target = args.model or plan.workload
    if not target:
        raise PlanError(f"plan file {args.plan!r} does not say which model it is for: pass --model FILE.py:FUNCTION")
    refuse_overwriting_inputs(args.out, {"plan file": args.plan, "model file": target_file(target)})
    model = export_onnx(plan, trace_plan_model(plan, target, seed=args.seed), args.out)
    if not args.quiet:
        num_annotated = sum(1 for n in model.graph.node if n.device_configurations)
        size = Path(args.out).stat().st_size
        print(
            f"wrote {args.out} ({len(model.graph.node)} nodes, {num_annotated} annotated, {size:,} bytes)",
            file=console.stdout(),
        )
    return 0
