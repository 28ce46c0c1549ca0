r"""Pass — rebatch: the traced step of a larger micro-batch, derived from two traces instead of
a third ``torch.export``.

Contract
--------
Input: two :class:`~autoplan.passes.trace.TracedProgram`\ s of the same model and loss at micro-batch
sizes :math:`b_1 < b_2` (both :math:`\ge 2`: a batch of one traces differently, e.g. a ``slice``
where larger batches ``expand``), and a target size :math:`b`.

Output: the :class:`TracedProgram` :func:`~autoplan.passes.trace.trace_training_step` would give at
:math:`b`, or ``None`` when it cannot be derived safely (the caller then traces). The two traces
must be the same program up to integers: same nodes, names, ops and wiring, and every
argument and placeholder dimension that differs is an integer :math:`v(b_1) \ne v(b_2)` with an
integral linear extrapolation::

    v(b) = v(b_1) + (v(b_2) - v(b_1)) (b - b_1) / (b_2 - b_1)

(view and expand sizes, flattened batch x sequence lengths, the element counts a mean
divides by). Any other difference (a float, a changed op) returns ``None``. Every node's
``meta["val"]`` is then recomputed by running its op at the new shapes (on ``meta`` tensors,
wrapped as fake tensors on the trace's device; on fake tensors where an op has no meta
kernel): an extrapolated size that does not fit its op fails there and also returns ``None``;
the gradients must keep their parameters' shapes and the loss must stay a scalar.

Why: tracing (export + the joint graph) costs about a second per micro-batch size on a
two-block Llama; the derivation costs one pass of shape functions over the graph (0.08 s on
Llama-3-8B's). The planner's per-(tensor-parallel degree, micro-batch) costs need 4-5 sizes
(:mod:`autoplan.planner.segment_model`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from autoplan.passes.trace import TracedProgram, graph_fingerprint

log = logging.getLogger(__name__)

MIN_BASE_BATCH = 2
"""Smallest micro-batch a base trace may have (a batch of one traces to another graph)."""


class _NotDerivable(Exception):
    """The two traces differ in more than extrapolatable integers."""


class _Ref:
    """A graph-node argument, by name, as a pytree leaf (compared by name across the traces)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Ref) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


def _leaves(node: fx.Node) -> tuple[list[Any], pytree.TreeSpec]:
    return pytree.tree_flatten(fx.node.map_arg((node.args, node.kwargs), lambda n: _Ref(n.name)))  # type: ignore[arg-type, return-value]


def _extrapolate(v1: Any, v2: Any, b1: int, b2: int, b: int) -> Any:
    if v1 == v2 and type(v1) is type(v2):
        return v2
    if type(v1) is not int or type(v2) is not int:  # floats, bools, dtypes...: not derivable
        raise _NotDerivable(f"{v1!r} -> {v2!r}")
    num = (v2 - v1) * (b - b1)
    if num % (b2 - b1):
        raise _NotDerivable(f"{v1} -> {v2} is not integral at batch {b}")
    return v1 + num // (b2 - b1)


def _substitute(node: fx.Node, new_leaves: list[Any], spec: pytree.TreeSpec, env: dict[str, fx.Node]) -> None:
    def back(x: Any) -> Any:
        return env[x.name] if isinstance(x, _Ref) else x

    args, kwargs = pytree.tree_unflatten([back(v) for v in new_leaves], spec)
    node.args, node.kwargs = tuple(args), dict(kwargs)


def rebatch(first: TracedProgram, second: TracedProgram, b1: int, b2: int, batch: int) -> TracedProgram | None:
    """The step at micro-batch ``batch`` from traces at ``b1`` and ``b2`` (module docstring)."""
    if not MIN_BASE_BATCH <= b1 < b2 or batch < 1:
        raise ValueError(f"need {MIN_BASE_BATCH} <= b1 < b2 and batch >= 1, got b1={b1}, b2={b2}, batch={batch}")
    t0 = time.perf_counter()
    try:
        gm = _derive_graph(first.graph_module, second.graph_module, b1, b2, batch)
        _propagate(gm, first.graph_module, second.graph_module, b1, b2, batch)
        _check_outputs(gm, second.graph_module)
    except _NotDerivable as exc:
        log.info("micro-batch %d not derived from %d and %d (%s): tracing it", batch, b1, b2, exc)
        return None
    dt = time.perf_counter() - t0
    log.info("derived the step of micro-batch %d from %d and %d in %.2fs", batch, b1, b2, dt)
    return dataclasses.replace(second, graph_module=gm, fingerprint=graph_fingerprint(gm), trace_time_s=dt)


def _derive_graph(gm1: fx.GraphModule, gm2: fx.GraphModule, b1: int, b2: int, batch: int) -> fx.GraphModule:
    """A copy of ``gm2`` with every differing integer argument extrapolated to ``batch``."""
    nodes1, nodes2 = list(gm1.graph.nodes), list(gm2.graph.nodes)
    if len(nodes1) != len(nodes2):
        raise _NotDerivable(f"{len(nodes1)} nodes against {len(nodes2)}")
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for n1, n2 in zip(nodes1, nodes2, strict=True):
        if (n1.name, n1.op, n1.target) != (n2.name, n2.op, n2.target):
            raise _NotDerivable(f"node {n1.name} ({n1.target}) against {n2.name} ({n2.target})")
        leaves1, spec1 = _leaves(n1)
        leaves2, spec2 = _leaves(n2)
        if spec1 != spec2 or len(leaves1) != len(leaves2):
            raise _NotDerivable(f"arguments of {n1.name} differ in structure")
        new = graph.node_copy(n2, lambda a: env[a.name])
        new.meta = {k: v for k, v in n2.meta.items() if k not in ("val", "tensor_meta")}
        values = [_extrapolate(v1, v2, b1, b2, batch) for v1, v2 in zip(leaves1, leaves2, strict=True)]
        if values != leaves2:
            _substitute(new, values, spec2, env)
        env[n2.name] = new
    return fx.GraphModule(gm2, graph)


def _placeholder_shape(
    v1: torch.Tensor, v2: torch.Tensor, b1: int, b2: int, batch: int
) -> tuple[list[int], tuple[int, ...]]:
    """Shape and stride of a placeholder at ``batch`` (only contiguous ones may be resized)."""
    if v1.dim() != v2.dim() or v1.dtype != v2.dtype:
        raise _NotDerivable("a placeholder changes rank or dtype")
    shape = [_extrapolate(s1, s2, b1, b2, batch) for s1, s2 in zip(v1.shape, v2.shape, strict=True)]
    if shape == list(v2.shape):
        return shape, v2.stride()
    if not v2.is_contiguous():
        raise _NotDerivable("a resized placeholder is not contiguous")
    return shape, torch.empty(shape, device="meta").stride()


def _propagate(gm: fx.GraphModule, gm1: fx.GraphModule, gm2: fx.GraphModule, b1: int, b2: int, batch: int) -> None:
    r"""``meta["val"]`` of every node, running each op at the new sizes (module docstring).

    The ops run on ``meta`` tensors (their shape functions, about 7x faster than fake-tensor
    dispatch) and the results are wrapped as fake tensors on the trace's device, like the
    traced values. An op that has no meta kernel or rejects the new sizes there is run
    again, with the whole graph, on fake tensors (:class:`_OnFake`), which decides."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # constants (get_attr) are real tensors
    try:
        vals = _run(gm, gm1, gm2, b1, b2, batch, _OnMeta())
    except _NotDerivable:
        raise
    except Exception as exc:  # noqa: BLE001 - no meta kernel, or sizes the op rejects
        log.debug("meta propagation stopped (%s): propagating on fake tensors", exc)
        vals = _run(gm, gm1, gm2, b1, b2, batch, _OnFake(mode))
    else:
        device = _trace_device(gm2)
        convert = mode.fake_tensor_converter.from_meta_and_device

        def fake(v: Any) -> Any:
            return convert(mode, v, device) if isinstance(v, torch.Tensor) and v.is_meta else v

        vals = {node: v if node.op == "get_attr" else pytree.tree_map(fake, v) for node, v in vals.items()}
    for node, val in vals.items():
        node.meta["val"] = val


def _trace_device(gm: fx.GraphModule) -> torch.device:
    for node in gm.graph.find_nodes(op="placeholder"):
        if isinstance(node.meta.get("val"), torch.Tensor):
            return node.meta["val"].device
    return torch.device("meta")


class _OnMeta:
    """Runs ops through their meta kernels; factory ops and constants are moved to ``meta``."""

    def empty(self, shape: list[int], stride: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(shape, stride, dtype=like.dtype, device="meta")

    def constant(self, val: Any) -> Any:
        return val.to("meta") if isinstance(val, torch.Tensor) else val

    def __call__(self, target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if "device" in kwargs:
            kwargs = {**kwargs, "device": torch.device("meta")}
        out = target(*args, **kwargs)
        return pytree.tree_map(lambda v: v.to("meta") if isinstance(v, torch.Tensor) and not v.is_meta else v, out)


class _OnFake:
    """Runs ops under a fake-tensor mode; an op that rejects the sizes is not derivable."""

    def __init__(self, mode: FakeTensorMode) -> None:
        self.mode = mode

    def empty(self, shape: list[int], stride: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        with self.mode:
            return torch.empty_strided(shape, stride, dtype=like.dtype, device=like.device)

    def constant(self, val: Any) -> Any:
        return val  # real tensors: allowed as non-fake inputs

    def __call__(self, target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            with self.mode:
                return target(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - an extrapolated size the op rejects
            raise _NotDerivable(f"{target} fails at the new sizes: {exc}") from None


def _run(
    gm: fx.GraphModule, gm1: fx.GraphModule, gm2: fx.GraphModule, b1: int, b2: int, batch: int, run: _OnMeta | _OnFake
) -> dict[fx.Node, Any]:
    """Every node's value at ``batch``: placeholders resized, then each op run by ``run``."""
    vals1 = {n.name: n.meta.get("val") for n in gm1.graph.nodes}
    env: dict[fx.Node, Any] = {}  # what the ops run on
    vals: dict[fx.Node, Any] = {}  # what the nodes record
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            old = gm2.graph.find_nodes(op="placeholder", target=node.target)[0].meta["val"]
            shape, stride = _placeholder_shape(vals1[node.name], old, b1, b2, batch)
            env[node] = vals[node] = run.empty(shape, stride, old)
        elif node.op == "get_attr":
            vals[node] = getattr(gm, str(node.target))
            env[node] = run.constant(vals[node])
        elif node.op == "call_function":
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
            env[node] = vals[node] = run(node.target, args, kwargs)
        elif node.op != "output":
            raise _NotDerivable(f"unexpected node kind {node.op}")
    return vals


def _check_outputs(gm: fx.GraphModule, reference: fx.GraphModule) -> None:
    """The loss stays a scalar and every gradient keeps its parameter's shape."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    ref = next(n for n in reference.graph.nodes if n.op == "output")
    for new, old in zip(out.args[0], ref.args[0], strict=True):
        nv, ov = new.meta.get("val"), old.meta.get("val")
        if not isinstance(nv, torch.Tensor) or not isinstance(ov, torch.Tensor):
            raise _NotDerivable(f"output {new.name} is not a tensor")
        if old is ref.args[0][0]:
            if nv.dim() != 0:
                raise _NotDerivable("the loss is no longer a scalar")
        elif tuple(nv.shape) != tuple(ov.shape) or nv.dtype != ov.dtype:
            raise _NotDerivable(f"gradient {new.name} changes shape {tuple(ov.shape)} -> {tuple(nv.shape)}")


__all__ = ["MIN_BASE_BATCH", "rebatch"]
