"""Calibrate the compute model from a measured step: a ``torch.profiler`` trace of a planned run.

``autoplan calibrate --from-profile TRACE --plan PLAN.json`` (``autoplan/tools/calibrate.py``)
reads the Chrome/Kineto JSON trace (``prof.export_chrome_trace``, or the ``.json.gz`` of
``tensorboard_trace_handler``) that ``torch.profiler.profile(record_shapes=True, schedule=...)``
wrote for a few training steps of the plan, maps its events back to the plan, fits the device
numbers the compute model prices ops with (:mod:`autoplan.cost_models.compute`) and writes a
cluster file whose device carries them, so that plans and estimates of *other* configurations
on the same hardware are priced with what this one measured.

Reading (:func:`read_trace`). A step is a ``ProfilerStep#N`` annotation (``prof.step()`` after
every step); its thread is the training thread. Inside a step every ``cpu_op`` event that no
other ``cpu_op`` encloses is a *top-level op*: what the generated program called (``aten::addmm``
with ``record_shapes`` carries its input shapes, dtypes and scalar arguments). Top-level ops
named like a collective (``_c10d_functional::*``, ``c10d::*``, ``nccl:*``, ``gloo:*``,
``record_param_comms``) are communication (their time is the collective's exposed time, waits
included); ops inside an ``Optimizer.step#`` / ``Optimizer.zero_grad#`` annotation are the
optimizer's. The rest are the program's ops. On CPU ranks an op's time is its event's; in a GPU
trace (device events of category ``kernel``/``gpu_memcpy``/``gpu_memset``) it is the time of the
kernels whose ``External id`` is the op's or that of an op it calls (the host only queues them).

Mapping (:func:`match_plan`). A plan node of op ``aten.addmm.default`` runs as one top-level
``aten::addmm``; per step and op name the first ``min(plan nodes, events)`` events are *mapped*,
the others are the runtime's glue (a bucket's ``cat``, a ``view`` the lowering adds). A trace is
refused (:class:`TraceMismatchError`) when it is not a step of this plan: another world size,
fewer than :data:`MIN_MATCHED_FRACTION` of the plan's kernel nodes found in a step, another count
of matmul ops, or other collectives per step than the plan's (``Plan.step_collective_counts``).

Fit (:func:`fit_compute`). Each mapped op ``i`` is priced as :func:`compute.roofline_time_s`
prices it, from its recorded shapes (its outputs by running it on ``meta`` tensors)::

    r_i(a, W) = max(F_i / (peak * a * g_i)  if a matmul,   F_i / peak_vector,   B_i / W)
    t_i ~ r_i(a, W) + o_op

with ``g_i`` the shape term of ``matmul_efficiency`` (the curve at asymptote 1), ``a`` the matmul
asymptote (``DeviceSpec.matmul_peak_fraction`` of the op's dtype; ``peak_flops`` is raised when
the measured rate exceeds it), ``W = mem_bw_GBps * MEMORY_EFFICIENCY`` the effective memory
bandwidth. ``(a, W)`` minimise the squared error of the mapped ops' times over a log grid of
three decades, refined twice around its best point (the intercept ``o_op`` in closed form), so the big ops, which make the step, weigh most. The
per-op overhead the device then carries (``DeviceSpec.op_overhead_us``) is everything of the
step's compute that the rooflines do not explain, per plan node::

    o = (median over steps of (wall - optimizer) - communication - sum_i r_i) / nodes of the plan

(the program's interpreter time between ops and the glue included), so that the plan's own step
is priced as measured and another plan pays the same per node. ``communication`` is the exposed
communication the plan's estimate prices when it is given (``Plan.estimate.exposed_comm_s``: the
ranks' waits for each other beyond it, which the communication model does not price, are then
paid per node too), else the trace's. Only what the trace determines is
fitted: ``a`` from at least :data:`MIN_FIT_OPS` matmul ops, ``W`` from as many memory-bound ops,
``o`` always; the links, the optimizer and ``comm_compute_slowdown`` keep the plan cluster's
numbers. Fit quality: the median relative error of the mapped ops of at least
:data:`REPORT_MIN_OP_US` microseconds, per kind (matmul / other), and their summed time predicted
against measured.
"""

from __future__ import annotations

import ast
import dataclasses
import datetime
import gzip
import json
import math
import os
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from autoplan.cost_models.calibration import CalibrationError, write_profile
from autoplan.cost_models.cluster import CalibrationInfo, Cluster, current_device_model
from autoplan.cost_models.compute import (
    _BYTES_REGISTRY,
    _FLOP_REGISTRY,
    MEMORY_EFFICIENCY,
    _no_kernel_cost,
    cost_key,
    gemms_efficiency,
    is_matmul,
    matmul_asymptote,
    matmul_shapes,
    op_bytes,
    op_flops,
    op_overhead_s,
)
from autoplan.cost_models.echo import clip
from autoplan.cost_models.hardware import DeviceSpec, _dtype_key

MIN_MATCHED_FRACTION = 0.9
"""Fraction of a plan's kernel nodes (ops that move data) a step must show for the trace to be
one of the plan's steps."""
MIN_FIT_OPS = 3
"""Ops of a kind (matmul, memory-bound) needed to fit that kind's number."""
REPORT_MIN_OP_US = 20.0
"""Ops shorter than this are left out of the reported relative errors (timer resolution and
dispatch noise); they still enter the fit."""
MAX_TRACE_BYTES = 2**31
"""Largest trace file read (2 GiB)."""

COLLECTIVE_PREFIXES = ("_c10d_functional::", "c10d::", "c10d_functional::", "nccl:", "gloo:", "record_param_comms")
OPTIMIZER_PREFIXES = ("Optimizer.step#", "Optimizer.zero_grad#")
KERNEL_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
"""Device events of a GPU trace (their ``External id`` names the op that launched them)."""
_COLLECTIVE_KINDS = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "allreduce_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "alltoall_base_": "all_to_all",
}
"""Issuing collective op (name after ``::``) -> communication kind; waits and barriers are left out."""
_DTYPES = {
    "float": torch.float32,
    "double": torch.float64,
    "c10::Half": torch.float16,
    "c10::BFloat16": torch.bfloat16,
    "long int": torch.int64,
    "int": torch.int32,
    "short int": torch.int16,
    "signed char": torch.int8,
    "unsigned char": torch.uint8,
    "bool": torch.bool,
    "c10::Float8_e4m3fn": torch.float8_e4m3fn,
    "c10::Float8_e5m2": torch.float8_e5m2,
}
"""Kineto's ``Input type`` of a tensor -> dtype."""


class TraceCalibrationError(CalibrationError):
    """A profiler trace cannot be read or fitted (not a trace, no steps, no shapes)."""


class TraceMismatchError(TraceCalibrationError):
    """The trace is not of a step of the given plan."""


# --- reading ----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceOp:
    """One top-level op of a step: ``name`` (``aten::addmm``), its recorded arguments, seconds."""

    name: str
    dims: tuple[Any, ...]
    types: tuple[str, ...]
    concrete: tuple[str, ...]
    strides: tuple[Any, ...]
    time_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceStep:
    """One ``ProfilerStep#N`` of the training thread."""

    wall_s: float
    ops: tuple[TraceOp, ...]
    comm_s: float
    """Top-level collective, wait and barrier ops: exposed communication."""
    optimizer_s: float
    """``Optimizer.step#`` and ``Optimizer.zero_grad#`` annotations."""
    collectives: Mapping[str, int]
    """Collectives issued per kind."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileTrace:
    """What :func:`read_trace` keeps of a trace."""

    path: str
    steps: tuple[TraceStep, ...]
    world_size: int | None
    rank: int | None
    backend: str | None
    record_shapes: bool


def _load_json(path: Path) -> Any:
    where = f"trace {clip(str(path))}"
    try:
        size = path.stat().st_size
        if size > MAX_TRACE_BYTES:
            raise TraceCalibrationError(f"{where} is {size} bytes, more than {MAX_TRACE_BYTES}: profile fewer steps")
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        return json.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        raise TraceCalibrationError(f"{where} does not exist: check the path") from None
    except IsADirectoryError:
        raise TraceCalibrationError(f"{where} is a directory: give the trace's .json file") from None
    except (OSError, EOFError) as exc:
        raise TraceCalibrationError(f"cannot read {where}: {exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise TraceCalibrationError(
            f"{where} is not a JSON profiler trace ({type(exc).__name__}); write one with "
            "torch.profiler.profile(...).export_chrome_trace(PATH)"
        ) from None


def read_trace(path: str | os.PathLike[str]) -> ProfileTrace:
    """Read a Chrome/Kineto trace: its ``ProfilerStep#N`` steps on the training thread and the
    world it ran in (``distributedInfo``); see the module docstring."""
    path = Path(path)
    data = _load_json(path)
    events = data.get("traceEvents") if isinstance(data, Mapping) else data if isinstance(data, list) else None
    if not isinstance(events, list):
        raise TraceCalibrationError(
            f"trace {clip(str(path))} has no traceEvents: it is not a torch.profiler Chrome trace"
        )
    complete = [e for e in events if isinstance(e, Mapping) and e.get("ph") == "X" and _has_times(e)]
    marks = sorted((e for e in complete if str(e.get("name", "")).startswith("ProfilerStep#")), key=lambda e: e["ts"])
    if not marks:
        raise TraceCalibrationError(
            f"trace {clip(str(path))} has no ProfilerStep#N events: profile with "
            "torch.profiler.profile(schedule=torch.profiler.schedule(...)) and call prof.step() after every step"
        )
    info = data.get("distributedInfo") if isinstance(data, Mapping) else None
    info = info if isinstance(info, Mapping) else {}
    by_thread: dict[Any, list[Mapping[str, Any]]] = {}
    for e in complete:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    kernel_s: dict[Any, float] = {}
    for e in complete:  # a GPU trace: device kernels, linked to the op that launched them
        if e.get("cat") in KERNEL_CATEGORIES and _external_id(e) is not None:
            kernel_s[_external_id(e)] = kernel_s.get(_external_id(e), 0.0) + float(e["dur"]) * 1e-6
    steps = []
    for mark in marks:
        thread = by_thread[(mark.get("pid"), mark.get("tid"))]
        start, end = float(mark["ts"]), float(mark["ts"]) + float(mark["dur"])
        inside = [e for e in thread if e is not mark and start <= float(e["ts"]) and float(e["ts"]) + float(e["dur"]) <= end]
        steps.append(_step(inside, wall_s=float(mark["dur"]) * 1e-6, kernel_s=kernel_s))
    record_shapes = bool(data.get("record_shapes", True)) if isinstance(data, Mapping) else True
    return ProfileTrace(
        path=str(path),
        steps=tuple(steps),
        world_size=_int_or_none(info.get("world_size")),
        rank=_int_or_none(info.get("rank")),
        backend=str(info["backend"]) if "backend" in info else None,
        record_shapes=record_shapes,
    )


def _has_times(e: Mapping[str, Any]) -> bool:
    return isinstance(e.get("ts"), (int, float)) and isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _step(
    inside: list[Mapping[str, Any]], *, wall_s: float, kernel_s: Mapping[Any, float] | None = None
) -> TraceStep:
    """Top-level ops, communication and optimizer time of one step's events (one thread). With
    ``kernel_s`` (device kernel seconds per ``External id``: a GPU trace) an op's time is that of
    the kernels it and the ops it calls launched, not its time on the host."""
    inside = sorted(inside, key=lambda e: (float(e["ts"]), -float(e["dur"])))
    stack: list[Mapping[str, Any]] = []
    tops: list[tuple[Mapping[str, Any], list[Any]]] = []  # top-level op, External ids under it
    comm_s = optimizer_s = 0.0
    collectives: Counter[str] = Counter()
    for e in inside:
        while stack and float(e["ts"]) >= float(stack[-1]["ts"]) + float(stack[-1]["dur"]):
            stack.pop()
        name = str(e.get("name", ""))
        in_optimizer = any(str(s.get("name", "")).startswith(OPTIMIZER_PREFIXES) for s in stack)
        enclosing = [s for s in stack if s.get("cat") == "cpu_op"]
        if name.startswith(OPTIMIZER_PREFIXES) and not in_optimizer:
            optimizer_s += float(e["dur"]) * 1e-6
        elif e.get("cat") == "cpu_op" and not in_optimizer and not enclosing:
            if name.startswith(COLLECTIVE_PREFIXES):
                comm_s += _seconds(e, [_external_id(e)], kernel_s)
                kind = _COLLECTIVE_KINDS.get(name.split("::")[-1])
                if kind is not None:
                    collectives[kind] += 1
            else:
                tops.append((e, [_external_id(e)]))
        elif enclosing and tops and tops[-1][0] is enclosing[0]:
            tops[-1][1].append(_external_id(e))
        stack.append(e)
    ops = tuple(_trace_op(e, _seconds(e, ids, kernel_s)) for e, ids in tops)
    return TraceStep(wall_s=wall_s, ops=ops, comm_s=comm_s, optimizer_s=optimizer_s, collectives=dict(collectives))


def _external_id(e: Mapping[str, Any]) -> Any:
    args = e.get("args")
    return args.get("External id") if isinstance(args, Mapping) else None


def _seconds(e: Mapping[str, Any], ids: list[Any], kernel_s: Mapping[Any, float] | None) -> float:
    if not kernel_s:
        return float(e["dur"]) * 1e-6
    return sum(kernel_s.get(i, 0.0) for i in ids if i is not None)


def _trace_op(e: Mapping[str, Any], time_s: float) -> TraceOp:
    args = e.get("args") if isinstance(e.get("args"), Mapping) else {}
    assert isinstance(args, Mapping)

    def field(name: str) -> tuple[Any, ...]:
        value = args.get(name, ())
        return tuple(value) if isinstance(value, list) else ()

    return TraceOp(
        name=str(e["name"]),
        dims=field("Input Dims"),
        types=tuple(str(t) for t in field("Input type")),
        concrete=tuple(str(c) for c in field("Concrete Inputs")),
        strides=field("Input Strides"),
        time_s=time_s,
    )


# --- mapping ----------------------------------------------------------------------------------


def event_name(op: str) -> str:
    """The profiler's name of a plan node's op: ``aten.addmm.default`` -> ``aten::addmm``."""
    parts = op.split(".")
    return "::".join(parts[:2]) if len(parts) >= 2 else op


@dataclass(frozen=True, kw_only=True, slots=True)
class MappedOp:
    """A trace op mapped to a plan node's op, with what the cost model needs of it."""

    op: TraceOp
    key: str
    """Cost-registry key (``cost_key``) the op is priced under."""
    flops: float
    nbytes: float
    dtype: torch.dtype
    gemms: tuple[Any, ...]
    """The GEMMs it runs (``compute.matmul_shapes``); empty: not a matmul."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceMatch:
    """The trace's steps mapped to a plan (:func:`match_plan`)."""

    mapped: tuple[tuple[MappedOp, ...], ...]
    """Per step, the mapped ops."""
    num_plan_nodes: int
    matched_fraction: float
    """Smallest fraction over steps of the plan's kernel nodes found."""


def _no_kernel(op: str) -> bool:
    return _FLOP_REGISTRY.get(op) is _no_kernel_cost and _BYTES_REGISTRY.get(op) is _no_kernel_cost


def match_plan(
    trace: ProfileTrace,
    *,
    plan_ops: Sequence[str],
    plan_collectives: Mapping[str, int],
    world_size: int,
    what: str = "the plan",
) -> TraceMatch:
    """Map ``trace``'s steps to a plan whose nodes run ``plan_ops`` (qualified op names, one per
    node) and whose step issues ``plan_collectives``; raise :class:`TraceMismatchError` naming the
    difference when the trace is not of that plan (module docstring)."""
    fix = f"profile a run of {what}, or give the plan the trace was recorded with"
    if trace.world_size is not None and trace.world_size != world_size:
        raise TraceMismatchError(
            f"the trace ran on {trace.world_size} ranks but {what} is for {world_size}; {fix}"
        )
    if not trace.record_shapes or not any(op.dims for step in trace.steps for op in step.ops):
        raise TraceCalibrationError(
            "the trace has no input shapes: profile with torch.profiler.profile(record_shapes=True, ...)"
        )
    by_name: dict[str, list[str]] = {}
    for op in plan_ops:
        by_name.setdefault(event_name(op), []).append(op)
    kernel_nodes = Counter(event_name(op) for op in plan_ops if not _no_kernel(op))
    mapped_steps = []
    fractions = []
    for number, step in enumerate(trace.steps, start=1):
        counts = Counter(op.name for op in step.ops)
        found = sum(min(n, counts.get(name, 0)) for name, n in kernel_nodes.items())
        fraction = found / max(1, sum(kernel_nodes.values()))
        fractions.append(fraction)
        if fraction < MIN_MATCHED_FRACTION:
            missing = sorted(kernel_nodes, key=lambda name: counts.get(name, 0) - kernel_nodes[name])[:3]
            detail = ", ".join(f"{name} {counts.get(name, 0)}/{kernel_nodes[name]}" for name in missing)
            raise TraceMismatchError(
                f"step {number} of the trace runs {fraction:.0%} of the ops of {what} (events/nodes: {detail}); {fix}"
            )
        _check_matmuls(number, counts, plan_ops, what, fix)
        collectives = {k: v for k, v in step.collectives.items() if v}
        expected = _as_run(plan_collectives, trace.backend)
        if collectives != expected:
            raise TraceMismatchError(
                f"step {number} of the trace issues collectives {_counts_text(collectives)} but {what} issues "
                f"{_counts_text(expected)} per step; {fix}"
            )
        mapped_steps.append(_mapped_ops(step, by_name))
    return TraceMatch(mapped=tuple(mapped_steps), num_plan_nodes=len(plan_ops), matched_fraction=min(fractions))


def _check_matmuls(number: int, counts: Mapping[str, int], plan_ops: Sequence[str], what: str, fix: str) -> None:
    matmuls = Counter(event_name(op) for op in plan_ops if is_matmul(op))
    for name, n in sorted(matmuls.items()):
        if counts.get(name, 0) != n:
            raise TraceMismatchError(
                f"step {number} of the trace runs {counts.get(name, 0)} {name} but {what} has {n}; {fix}"
            )


def _as_run(counts: Mapping[str, int], backend: str | None) -> dict[str, int]:
    """The collectives a step issues for a plan's ``counts`` on ``backend``: gloo has no
    all-to-all, and torch runs it as an all-gather (``comm.effective_collective``)."""
    out = {k: v for k, v in counts.items() if v}
    if backend == "gloo" and "all_to_all" in out:
        out["all_gather"] = out.get("all_gather", 0) + out.pop("all_to_all")
    return out


def _counts_text(counts: Mapping[str, int]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) + "}" if counts else "none"


def _mapped_ops(step: TraceStep, by_name: Mapping[str, list[str]]) -> tuple[MappedOp, ...]:
    left = {name: len(ops) for name, ops in by_name.items()}
    out = []
    for op in step.ops:
        if left.get(op.name, 0) <= 0:
            continue
        left[op.name] -= 1
        out.append(_costed(op, tuple(sorted(set(by_name[op.name])))))
    return tuple(out)


_COSTED: dict[tuple[Any, ...], tuple[str, float, float, torch.dtype, tuple[Any, ...]]] = {}


def _costed(op: TraceOp, overloads: tuple[str, ...]) -> MappedOp:
    """``op`` priced as the cost model prices its plan node: inputs from the recorded shapes,
    outputs by running the op on meta tensors (the first of the plan's overloads that accepts
    the arguments; an op that runs on none is priced as elementwise on its largest input)."""
    sig = (op.name, repr(op.dims), op.types, op.concrete, repr(op.strides), overloads)
    cached = _COSTED.get(sig)
    if cached is None:
        cached = _cost_signature(op, overloads)
        _COSTED[sig] = cached
    key, flops, nbytes, dtype, gemms = cached
    return MappedOp(op=op, key=key, flops=flops, nbytes=nbytes, dtype=dtype, gemms=gemms)


def _shape_terms(ops: Sequence[MappedOp], device: DeviceSpec) -> list[float | None]:
    """Per op, the shape term of its matmul efficiency on ``device`` (``gemms_efficiency`` with
    the asymptote set to 1), ``None`` for an op that is not a matmul."""
    units: dict[str, DeviceSpec] = {}
    out: list[float | None] = []
    for m in ops:
        if not m.gemms or m.flops <= 0:
            out.append(None)
            continue
        key = _dtype_key(m.dtype)
        if key not in units:
            fractions = {**(device.matmul_peak_fraction or {}), key: 1.0}
            units[key] = device.with_overrides({"matmul_peak_fraction": fractions}, where="unit")
        out.append(gemms_efficiency(m.gemms, units[key], m.dtype))
    return out


def _cost_signature(op: TraceOp, overloads: tuple[str, ...]) -> tuple[str, float, float, torch.dtype, tuple[Any, ...]]:
    args = _meta_args(op)
    tensors = [a for a in _flat(args) if isinstance(a, torch.Tensor)]
    for overload in overloads:
        target = _resolve(overload)
        if target is None:
            continue
        try:
            with torch.no_grad():
                result = target(*args)
        except Exception:  # noqa: BLE001 - any failure: try the next overload, then the fallback
            continue
        outs = [t for t in _flat(result) if isinstance(t, torch.Tensor)]
        key = cost_key(overload, args, {})
        return _cost_of(key, tensors, outs)
    largest = max(tensors, key=lambda t: t.numel(), default=None)
    return _cost_of(overloads[0], tensors, [] if largest is None else [largest])


def _cost_of(
    key: str, ins: list[torch.Tensor], outs: list[torch.Tensor]
) -> tuple[str, float, float, torch.dtype, tuple[Any, ...]]:
    dtype = outs[0].dtype if outs else torch.float32
    flops, nbytes = op_flops(key, ins, outs), op_bytes(key, ins, outs)
    return key, flops, nbytes, dtype, matmul_shapes(key, ins, outs)


def _resolve(overload: str) -> Any:
    parts = overload.split("[", 1)[0].split(".")
    if len(parts) != 3:
        return None
    ns, name, over = parts
    try:
        return getattr(getattr(getattr(torch.ops, ns), name), over)
    except (AttributeError, RuntimeError):
        return None


def _flat(value: object) -> list[object]:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flat(v)]
    return [value]


def _meta_args(op: TraceOp) -> list[object]:
    args: list[object] = []
    for i, kind in enumerate(op.types):
        dims = op.dims[i] if i < len(op.dims) else []
        strides = op.strides[i] if i < len(op.strides) else []
        concrete = op.concrete[i] if i < len(op.concrete) else ""
        if kind in _DTYPES:
            args.append(_meta_tensor(dims, strides, _DTYPES[kind]))
        elif kind == "TensorList":
            args.append([_meta_tensor(d, s, torch.float32) for d, s in zip(dims, _pad(strides, len(dims)), strict=True)])
        elif kind in ("Scalar", "ScalarList"):
            args.append(_scalar(concrete))
        else:
            args.append(None)
    return args


def _pad(strides: object, n: int) -> list[object]:
    items = list(strides) if isinstance(strides, list) else []
    return items + [[]] * (n - len(items))


def _meta_tensor(dims: object, strides: object, dtype: torch.dtype) -> torch.Tensor:
    shape = [int(d) for d in dims] if isinstance(dims, list) else []
    stride = [int(s) for s in strides] if isinstance(strides, list) and len(strides) == len(shape) else None
    if stride is not None:
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return torch.empty(shape, dtype=dtype, device="meta")


def _scalar(text: str) -> object:
    if text in ("True", "False"):
        return text == "True"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None


# --- fitting ----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ComputeFit:
    """The device numbers fitted to a trace, and how well they explain it."""

    matmul_rate_flops: Mapping[str, float]
    """Fitted large-matmul rate, FLOP/s, per dtype name with enough matmul ops (empty: not fitted)."""
    effective_mem_bw_GBps: float | None
    """Fitted ``mem_bw_GBps * MEMORY_EFFICIENCY``; ``None``: not fitted."""
    op_overhead_us: float
    """Fixed time per plan node, microseconds."""
    num_steps: int
    num_ops: int
    """Mapped ops over all steps."""
    matched_fraction: float
    op_err_median: float
    """Median relative error of the mapped ops of at least ``REPORT_MIN_OP_US``."""
    matmul_err_median: float | None
    other_err_median: float | None
    ops_predicted_s: float
    """Summed fitted times of the mapped ops (intercept included), mean per step."""
    ops_measured_s: float
    step_wall_s: float
    """Median wall time of the trace's steps."""
    comm_s: float
    """Mean exposed communication per step (top-level collective, wait and barrier ops)."""
    optimizer_s: float
    """Mean optimizer time per step."""
    unexplained_s: float
    """Time per step the rooflines (and the communication) leave to the per-node overhead."""
    modelled_comm_s: float | None = None
    """The plan's modelled exposed communication the fit took in place of the trace's."""


def fit_compute(
    match: TraceMatch, device: DeviceSpec, *, steps: Sequence[TraceStep], modelled_comm_s: float | None = None
) -> ComputeFit:
    """Fit ``(a, W, o)`` of the module docstring to the mapped ops of ``match`` (priced on
    ``device``, the plan's), with ``steps`` the trace's steps. ``modelled_comm_s``: the exposed
    communication the plan's estimate prices; the overhead then absorbs what the trace's
    communication takes beyond it (the ranks' waits for each other), so that the plan's own step
    is priced as measured. ``None``: the trace's communication is taken as measured."""
    ops, t, per_step = _typical_ops(match)
    if not ops:
        raise TraceCalibrationError("no event of the trace maps to a node of the plan: nothing to fit")
    utils = _shape_terms(ops, device)
    is_mm = np.array([u is not None for u in utils])
    mm_unit = np.array(
        [m.flops / (device.peak_flops_for(m.dtype) * u) if u else 0.0 for m, u in zip(ops, utils, strict=True)]
    )  # matmul compute time at asymptote 1
    vector = np.array(
        [
            0.0 if u else m.flops / min(device.peak_flops_for(m.dtype), device.peak_flops_for("float32"))
            for m, u in zip(ops, utils, strict=True)
        ]
    )
    nbytes = np.array([m.nbytes for m in ops])
    a0 = matmul_asymptote(device, torch.float32)
    w0 = device.mem_bw_GBps * 1e9 * MEMORY_EFFICIENCY
    fit_a = int(is_mm.sum()) >= MIN_FIT_OPS
    memory_bound = (~is_mm) & (nbytes / w0 >= vector) & (nbytes > 0)
    fit_w = int(memory_bound.sum()) >= MIN_FIT_OPS
    best = (math.inf, a0, w0, 0.0)
    span = 1.5  # decades either side, then twice around the best point at finer steps
    for _ in range(3):
        a_grid = best[1] * np.logspace(-span, span, 61) if fit_a else np.array([a0])
        w_grid = best[2] * np.logspace(-span, span, 61) if fit_w else np.array([w0])
        for a in a_grid:
            compute = np.maximum(mm_unit / a, vector)
            for w in w_grid:
                r = np.maximum(compute, nbytes / w)
                o = max(0.0, float(np.mean(t - r)))
                sse = float(np.sum((t - r - o) ** 2))
                if sse < best[0]:
                    best = (sse, float(a), float(w), o)
        span /= 20
    _, a, w, o_op = best
    fitted = np.maximum(np.maximum(mm_unit / a, vector), nbytes / w)
    roofline_s = float(np.sum(fitted)) * per_step
    comm_s = statistics.median(s.comm_s for s in steps) if modelled_comm_s is None else modelled_comm_s
    unexplained = statistics.median(step.wall_s - step.optimizer_s for step in steps) - comm_s - roofline_s
    overhead = max(0.0, unexplained) / max(1, match.num_plan_nodes)
    errs = np.abs(fitted + o_op - t) / np.maximum(t, 1e-12)
    shown = t >= REPORT_MIN_OP_US * 1e-6
    n_steps = len(match.mapped)
    dtypes = sorted({_dtype_key(m.dtype) for m, u in zip(ops, utils, strict=True) if u is not None})
    return ComputeFit(
        matmul_rate_flops={d: _sig(a * device.peak_flops_for(d)) for d in dtypes} if fit_a else {},
        effective_mem_bw_GBps=_sig(w / 1e9) if fit_w else None,
        op_overhead_us=_sig(overhead * 1e6),
        num_steps=n_steps,
        num_ops=sum(len(s) for s in match.mapped),
        matched_fraction=match.matched_fraction,
        op_err_median=_median(errs[shown]) or _median(errs) or 0.0,
        matmul_err_median=_median(errs[shown & is_mm]),
        other_err_median=_median(errs[shown & ~is_mm]),
        ops_predicted_s=float(np.sum(fitted + o_op)) * per_step,
        ops_measured_s=float(np.sum(t)) * per_step,
        step_wall_s=statistics.median(s.wall_s for s in steps),
        comm_s=statistics.median(s.comm_s for s in steps),
        optimizer_s=statistics.median(s.optimizer_s for s in steps),
        unexplained_s=unexplained,
        modelled_comm_s=modelled_comm_s,
    )


def _typical_ops(match: TraceMatch) -> tuple[list[MappedOp], np.ndarray, float]:
    """The ops to fit and their times: when every step maps the same ops in the same order (a
    step of a fixed program), each op once with its median time over the steps (a busy spell in
    one step does not pull the fit); otherwise every mapped op of every step. The third value
    turns a sum over the ops returned into one per step."""
    first = match.mapped[0] if match.mapped else ()
    same = all([m.key for m in step] == [m.key for m in first] for step in match.mapped)
    if same and len(match.mapped) > 1:
        times = np.median(np.array([[m.op.time_s for m in step] for step in match.mapped]), axis=0)
        return list(first), times, 1.0
    ops = [m for step in match.mapped for m in step]
    return ops, np.array([m.op.time_s for m in ops]), 1.0 / max(1, len(match.mapped))


def _median(values: np.ndarray) -> float | None:
    return float(np.median(values)) if values.size else None


def fitted_device(device: DeviceSpec, fit: ComputeFit, *, origin: str) -> DeviceSpec:
    """``device`` with the fitted numbers: ``matmul_peak_fraction`` of each fitted dtype (and its
    ``peak_flops`` raised to the rate where the rate exceeds it), ``mem_bw_GBps`` from the
    effective bandwidth, ``op_overhead_us``."""
    overrides: dict[str, Any] = {"op_overhead_us": fit.op_overhead_us}
    fractions = dict(device.matmul_peak_fraction or {})
    peaks: dict[str, float] = {}
    for dtype, rate in fit.matmul_rate_flops.items():
        peak = device.peak_flops_for(dtype)
        if rate > peak:
            peaks[dtype] = rate
        fractions[dtype] = _sig(min(1.0, rate / peak))
    if fit.matmul_rate_flops:
        overrides["matmul_peak_fraction"] = fractions
    if peaks:
        overrides["peak_flops"] = peaks
    if fit.effective_mem_bw_GBps is not None:
        overrides["mem_bw_GBps"] = _sig(fit.effective_mem_bw_GBps / MEMORY_EFFICIENCY)
    return device.with_overrides(overrides, origin=origin)


def fitted_fields(fit: ComputeFit) -> list[str]:
    """The device fields a fit sets."""
    names = ["matmul_peak_fraction"] if fit.matmul_rate_flops else []
    names += ["mem_bw_GBps"] if fit.effective_mem_bw_GBps is not None else []
    return [*names, "op_overhead_us"]


def build_trace_profile(
    cluster: Cluster, fit: ComputeFit, *, plan_fingerprint: str, trace_name: str, date: str | None = None
) -> Cluster:
    """``cluster`` (the plan's) with its device's compute numbers fitted and the fit recorded in
    its ``calibration`` (a record of origin ``trace`` when it had none)."""
    date = date or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    origin = f"autoplan calibrate --from-profile {trace_name} (plan {plan_fingerprint}), {date}"
    device = fitted_device(cluster.device, fit, origin=origin)
    record: dict[str, Any] = {
        "source": "profiler trace",
        "trace": trace_name,
        "plan": plan_fingerprint,
        "date": date,
        "steps": fit.num_steps,
        "ops": fit.num_ops,
        "fitted": ",".join(fitted_fields(fit)),
        "op_err_median": _sig(fit.op_err_median),
        "ops_predicted_ms": _sig(fit.ops_predicted_s * 1e3),
        "ops_measured_ms": _sig(fit.ops_measured_s * 1e3),
        "step_ms": _sig(fit.step_wall_s * 1e3),
    }
    info = cluster.calibration
    if info is None:
        info = CalibrationInfo(
            device=cluster.device.name,
            device_model=_device_model(cluster),
            torch_version=str(torch.__version__),
            backend=cluster.backend,
            world_size=cluster.world_size,
            date=date,
            num_samples=fit.num_ops,
            fit_err_median=_sig(fit.op_err_median),
            origin="trace",
            compute=record,
        )
    else:
        info = dataclasses.replace(info, compute=record)
    return dataclasses.replace(cluster, device=device, calibration=info)


def _device_model(cluster: Cluster) -> str:
    return current_device_model(cluster.backend) or "unknown"


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceCalibration:
    """Outcome of :func:`calibrate_from_trace`."""

    profile: Cluster
    fit: ComputeFit
    trace: ProfileTrace
    previous: DeviceSpec
    """The plan cluster's device (before the fit)."""
    num_plan_nodes: int


def calibrate_from_trace(
    trace_path: str | os.PathLike[str],
    *,
    cluster: Cluster,
    plan_ops: Sequence[str],
    plan_collectives: Mapping[str, int],
    plan_fingerprint: str,
    modelled_comm_s: float | None = None,
    out: str | os.PathLike[str] | None = None,
    what: str = "the plan",
) -> TraceCalibration:
    """Read, map, fit and (with ``out``) write the profile atomically: the whole of ``autoplan
    calibrate --from-profile`` but the command line. Raises :class:`TraceCalibrationError`
    (:class:`TraceMismatchError` for a trace of another plan); nothing is written then."""
    trace = read_trace(trace_path)
    match = match_plan(
        trace, plan_ops=plan_ops, plan_collectives=plan_collectives, world_size=cluster.world_size, what=what
    )
    fit = fit_compute(match, cluster.device, steps=trace.steps, modelled_comm_s=modelled_comm_s)
    profile = build_trace_profile(cluster, fit, plan_fingerprint=plan_fingerprint, trace_name=Path(trace_path).name)
    if out is not None:
        write_profile(profile, out)
    return TraceCalibration(
        profile=profile, fit=fit, trace=trace, previous=cluster.device, num_plan_nodes=match.num_plan_nodes
    )


def fit_table(result: TraceCalibration) -> str:
    """The fitted numbers against the plan cluster's, and the fit's errors."""
    fit, old, new = result.fit, result.previous, result.profile.device
    lines = [f"{'device number':<28} {'before':>12} {'fitted':>12}"]
    for dtype in fit.matmul_rate_flops:
        before = old.peak_flops_for(dtype) * matmul_asymptote(old, dtype)
        after = new.peak_flops_for(dtype) * matmul_asymptote(new, dtype)
        lines.append(f"{'matmul GFLOP/s (' + dtype + ')':<28} {before / 1e9:>12.2f} {after / 1e9:>12.2f}")
    if fit.effective_mem_bw_GBps is not None:
        lines.append(f"{'mem_bw_GBps':<28} {old.mem_bw_GBps:>12.2f} {new.mem_bw_GBps:>12.2f}")
    lines.append(f"{'op_overhead_us':<28} {op_overhead_s(old) * 1e6:>12.2f} {new.op_overhead_us or 0.0:>12.2f}")
    lines.append(
        f"mapped {fit.num_ops} ops over {fit.num_steps} steps ({fit.matched_fraction:.0%} of the plan's kernel nodes); "
        f"op error median {fit.op_err_median:.1%} (matmul {_pct(fit.matmul_err_median)}, other {_pct(fit.other_err_median)}); "
        f"ops {fit.ops_predicted_s * 1e3:.1f} ms fitted vs {fit.ops_measured_s * 1e3:.1f} ms measured per step"
    )
    modelled = "" if fit.modelled_comm_s is None else f" (the plan prices {fit.modelled_comm_s * 1e3:.1f} ms exposed)"
    lines.append(
        f"step {fit.step_wall_s * 1e3:.1f} ms = communication {fit.comm_s * 1e3:.1f}{modelled} + optimizer "
        f"{fit.optimizer_s * 1e3:.1f} + compute {(fit.step_wall_s - fit.comm_s - fit.optimizer_s) * 1e3:.1f} ms; "
        f"{fit.unexplained_s * 1e3:.1f} ms beyond the rooflines and the priced communication: the per-node overhead "
        f"over {result.num_plan_nodes} nodes"
    )
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.1%}"


def _sig(x: float, digits: int = 4) -> float:
    if x == 0.0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - math.floor(math.log10(abs(x))))
