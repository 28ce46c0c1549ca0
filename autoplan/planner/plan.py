"""The plan: a plain, versioned, JSON-serialisable decision, made before anything runs.

A :class:`Plan` says, for one traced model and one cluster, which placement every parameter,
input and operator gets, which collectives that implies (and their estimated cost), and what
the step is estimated to cost in time and memory. It is saved as JSON (never pickled) with the
model's graph fingerprint and the cluster, so it cannot silently be applied to another model or
world size.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoplan.cost_models.cluster import COLLECTIVE_KINDS, LOCAL_KINDS, Cluster
from autoplan.cost_models.comm_schedule import CommRow, CommTotals
from autoplan.cost_models.config import PRECISIONS, RECOMPUTE, ParallelConfig, field_name_problem, unexecutable_fields
from autoplan.cost_models.echo import clip, clip_text, terminal_safe
from autoplan.cost_models.errors import ClusterSpecError, PlanFileError, PlanMismatchError
from autoplan.cost_models.files import (
    MAX_PLAN_FILE_BYTES,
    InputLimitError,
    atomic_write,
    parse_json,
    read_limited,
)
from autoplan.cost_models.memory import OPTIMIZERS
from autoplan.cost_models.step_parts import StepParts
from autoplan.cost_models.version import __version__
from autoplan.passes.explain import NodeExplanation
from autoplan.passes.kv_rows import KVGroupRows, layout_text, layouts_from_json, layouts_to_json
from autoplan.passes.plan_text import param_node_name, spec_text

if TYPE_CHECKING:  # loading, checking and printing a plan needs no torch (`autoplan show` starts fast)
    import torch

    from autoplan.passes.strategies import Strategy, StrategyTable
    from autoplan.passes.trace import TracedProgram

PLAN_FORMAT = "autoplan.plan"
PLAN_VERSION = 2
GiB = 1024**3
MiB = 1024**2
_ESTIMATE_OPTIONAL = ("bubble_s", "mfu", "tokens_per_s")
"""Estimate fields written only when set (plans made with a global batch)."""
_SOLVER_KEYS = ("status", "objective_s", "num_variables", "num_constraints")
WALL_CLOCK_KEYS = ("solve_time_s", "plan_time_s")
"""Solver fields measured in wall-clock seconds: kept on the in-memory plan, written to the file
only on request (``save(..., timings=True)``), so two runs give byte-identical plan files."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveRecord:
    """One redistribution in the plan: a producer value converted for one consumer."""

    producer: str
    consumer: str
    arg_index: int
    src: tuple[str, ...]
    dst: tuple[str, ...]
    steps: tuple[tuple[str, int], ...]
    """(kind, mesh axis) per single-axis step, e.g. ``("all_gather", 1)``."""
    time_s: float
    bucket: str | None = None
    """Coalesced gradient reductions share a bucket: one collective per step for the bucket."""
    overlappable: bool = False
    """Issued ahead of its first use, so it can run during compute (a gradient reduction during
    the backward); operand conversions and end-of-step buckets cannot."""
    exposed_s: float | None = None
    """Seconds the compute stream waits for it, queueing behind earlier collectives included
    (``None`` in plans from before overlap modelling; see :func:`exposed_within_own_time`)."""
    issue_s: float | None = None
    """When the step replay (:mod:`autoplan.passes.overlap`) starts it on the communication
    stream, in seconds from the step's start (``None`` in plans from before it was recorded)."""
    finish_s: float | None = None
    """When it finishes there; the compute stream's wait for it ends then."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "bucket": self.bucket,
            "producer": self.producer,
            "consumer": self.consumer,
            "arg_index": self.arg_index,
            "src": list(self.src),
            "dst": list(self.dst),
            "steps": [list(s) for s in self.steps],
            "time_s": self.time_s,
            "overlappable": self.overlappable,
            "exposed_s": self.exposed_s,
            "issue_s": self.issue_s,
            "finish_s": self.finish_s,
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> CollectiveRecord:
        return CollectiveRecord(
            producer=d["producer"],
            consumer=d["consumer"],
            arg_index=int(d["arg_index"]),
            src=tuple(d["src"]),
            dst=tuple(d["dst"]),
            steps=tuple((str(k), int(a)) for k, a in d["steps"]),
            time_s=float(d["time_s"]),
            bucket=d.get("bucket"),
            overlappable=bool(d.get("overlappable", False)),
            exposed_s=None if d.get("exposed_s") is None else float(d["exposed_s"]),
            issue_s=None if d.get("issue_s") is None else float(d["issue_s"]),
            finish_s=None if d.get("finish_s") is None else float(d["finish_s"]),
        )


def exposed_within_own_time(collectives: Sequence[CollectiveRecord]) -> tuple[float, ...]:
    """Seconds the step waits for each collective, at most the collective's own time, adding up
    to the same total as the records' ``exposed_s``.

    The step replay (:mod:`autoplan.passes.overlap`) charges a blocking conversion with the whole
    wait of the compute stream, queueing included: when the one communication stream is still busy
    with gradient reductions issued earlier, the compute stream really waits for *them* (they were
    not hidden), and the conversion's ``exposed_s`` exceeds its own ``time_s`` (so does a gradient
    bucket's, charged to its first member for all of them). That excess is moved to the other
    members of its bucket, then to the asynchronous (``overlappable``) collectives issued before it, latest first, each up to
    the part of its time not yet exposed, then to the later ones. Records with ``exposed_s is
    None`` (plans from before overlap modelling) are all exposed. An excess no asynchronous
    collective can carry stays where it is (and :class:`~autoplan.cost_models.comm_schedule.CommRow`
    rejects it: a replay bug, not a rounding)."""
    raw = [c.time_s if c.exposed_s is None else max(0.0, c.exposed_s) for c in collectives]
    out = [min(r, c.time_s) for r, c in zip(raw, collectives, strict=True)]
    # who can carry a wait: asynchronous collectives, and every member of a bucket (one collective)
    room = [
        c.time_s - o if c.overlappable or c.bucket is not None else 0.0 for c, o in zip(collectives, out, strict=True)
    ]
    members: dict[str, list[int]] = {}
    for j, c in enumerate(collectives):
        if c.bucket is not None:
            members.setdefault(c.bucket, []).append(j)
    for j, c in enumerate(collectives):
        excess = raw[j] - out[j]
        if excess <= 0.0:
            continue
        same = members[c.bucket] if c.bucket is not None else []
        for k in (*same, *range(j - 1, -1, -1), *range(j + 1, len(collectives))):
            give = min(excess, room[k])
            out[k] += give
            room[k] -= give
            excess -= give
            if excess <= 0.0:
                break
        out[j] += max(excess, 0.0)
    return tuple(out)


def comm_totals(
    collectives: Sequence[CollectiveRecord],
    axis_names: Sequence[str],
    step_costs: Sequence[Sequence[tuple[float, float]]] | None = None,
) -> CommTotals:
    """The step's communication per kind and mesh axis from the plan's redistributions, when those
    are the whole step (a plan on a fixed mesh: one program, every op of it once).

    ``step_costs[j]`` gives ``(bytes, seconds)`` of each collective step of ``collectives[j]``
    (the steps of kind in ``COLLECTIVE_KINDS``, in order): a record's time and exposure are split
    over its steps in proportion to the seconds (evenly without ``step_costs``, bytes then 0).
    Exposure is :func:`exposed_within_own_time`. Members of one gradient bucket are one collective
    (counted once); local steps (``shard``, ``to_partial``) move no data and get no row."""
    exposed = exposed_within_own_time(collectives)
    rows: list[CommRow] = []
    seen: set[tuple[str, str, int]] = set()
    for j, c in enumerate(collectives):
        steps = [(kind, axis) for kind, axis in c.steps if kind in COLLECTIVE_KINDS]
        if not steps:
            continue
        costs = list(step_costs[j]) if step_costs is not None else [(0.0, 1.0)] * len(steps)
        if len(costs) != len(steps):
            raise ValueError(f"{c.producer} -> {c.consumer}: {len(costs)} step costs for {len(steps)} collective steps")
        weight = sum(t for _, t in costs)
        for (kind, axis), (nbytes, t) in zip(steps, costs, strict=True):
            share = t / weight if weight > 0 else 1.0 / len(steps)
            first = c.bucket is None or (c.bucket, kind, axis) not in seen
            if c.bucket is not None:
                seen.add((c.bucket, kind, axis))
            rows.append(
                CommRow(
                    kind=kind,
                    axis=axis_names[axis],
                    count=int(first),
                    bytes=nbytes,
                    total_s=c.time_s * share,
                    exposed_s=exposed[j] * share,
                )
            )
    return CommTotals.merge(rows)


@dataclass(frozen=True, kw_only=True, slots=True)
class Estimate:
    """Estimated cost of one training step on one device."""

    step_time_s: float
    compute_s: float
    comm_s: float
    memory_bytes: Mapping[str, float]
    """Peak bytes per device (``total``) and its parts at the peak: params, optimizer, buffers,
    inputs, grads, activations (live activations and collective buffers)."""
    capacity_bytes: float
    memory_peak_at: str = ""
    """Node of the generated program at which the peak occurs (``<optimizer>``: optimizer step)."""
    compute_sources: Mapping[str, int] = field(default_factory=dict)
    """How many op timings came from the profile database (``profiled``) and from the
    analytic roofline (``analytic``)."""
    exposed_comm_s: float | None = None
    """Communication time not hidden behind compute (``None``: no overlap modelled, all exposed)."""
    bubble_s: float | None = None
    """Pipeline bubble (plans made with a global batch; ``None`` otherwise)."""
    mfu: float | None = None
    """Model FLOPs utilisation (plans made with a global batch)."""
    tokens_per_s: float | None = None
    memory_per_device_bytes: tuple[float, ...] = ()
    """Peak bytes per device of each pipeline rank (plans made with a global batch)."""
    comm: CommTotals = CommTotals()
    """The whole step's communication per kind and mesh axis (every block, micro-batch, bucket
    and pipeline transfer), rows summing to ``comm_s`` and ``exposed_comm_s``; empty in plan
    files written before it was recorded."""
    step_parts: StepParts | None = None
    """The step in parts that add up to ``step_time_s`` (the joint search's
    :class:`~autoplan.cost_models.step.StepParts`); ``None`` for a per-operator plan, whose parts
    follow from the fields (:attr:`parts`), and in global-batch plan files written before it
    was recorded."""

    @property
    def parts(self) -> StepParts | None:
        """The step in parts that add up to ``step_time_s``, each >= 0: what every review output
        prints. A per-operator plan's are its compute stream's (compute and its waits,
        :meth:`StepParts.of_program`); ``None`` for a global-batch plan file that did not record them."""
        if self.step_parts is not None:
            return self.step_parts
        if self.bubble_s is None:  # a per-operator plan: step = compute + the compute stream's waits
            exposed = self.exposed_comm_s if self.exposed_comm_s is not None else self.comm_s
            return StepParts.of_program(step_time_s=self.step_time_s, exposed_comm_s=exposed)
        return None

    def memory_parts(self) -> dict[str, float]:
        """The peak's parts by name, as every review output lists them: the recorded parts in
        :data:`MEMORY_PARTS` order (others after them, sorted), with ``other`` for what they leave
        of ``total`` (an interleaved rank's other stages), so the parts add up to the peak."""
        mem = self.memory_bytes
        names = [k for k in MEMORY_PARTS if k in mem] + sorted(k for k in mem if k not in (*MEMORY_PARTS, "total"))
        parts = {k: mem[k] for k in names}
        rest = mem["total"] - sum(parts.values())
        if rest > 1e-9 * max(mem["total"], 1.0):
            parts["other"] = rest
        return parts


MEMORY_PARTS = ("params", "weights", "grads", "optimizer", "buffers", "inputs", "activations", "transient", "allocator")
"""The order review outputs list memory parts in: the per-operator plan's liveness parts
(:mod:`autoplan.passes.liveness`: params, grads, optimizer, buffers, inputs, activations) and
the joint search's stage parts (:func:`autoplan.cost_models.memory.stage_memory_parts`: weights,
grads, optimizer, activations, transient, allocator); a plan holds one set or the other."""


def bytes_text(n: float) -> str:
    """Bytes in the unit that suits them (``2.06 GiB``, ``514.5 KiB``), as review outputs print them."""
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:.2f} MiB"
    return f"{n / 1024:.1f} KiB"


def step_parts_text(estimate: Estimate) -> str:
    """``step X ms = compute ... + exposed communication ...`` of the estimate's parts (with the
    note on the communication rows where they differ), or the step alone where the plan file
    records no parts."""
    parts = estimate.parts
    if parts is None:
        return (
            f"{estimate.step_time_s * 1e3:.3f} ms (not broken down in this plan file, written before autoplan "
            "recorded the parts: re-plan with `autoplan plan`)"
        )
    text = f"{estimate.step_time_s * 1e3:.3f} ms = " + " + ".join(f"{k} {v * 1e3:.3f} ms" for k, v in parts.rows())
    note = parts.comm_note(estimate.comm.exposed_s) if estimate.comm.rows else ""
    return text + (f" ({note})" if note else "")


def _expert_parallel_on(node: Mapping[str, Any], axis: int) -> bool:
    """Whether a plan's node record is a MoE op splitting both its tokens and its experts on
    ``axis``: :func:`autoplan.passes.moe.ep_axes`'s rule read on the recorded spec strings (this
    module stays torch-free for the review commands; ``passes.moe`` registers torch ops)."""
    op = node.get("op", "")
    if not op.startswith("autoplan.moe_experts"):
        return False
    first = 1 if "backward" in op else 0
    specs = node.get("in", [])
    return len(specs) > first + 4 and all(str(specs[i][axis]).startswith("S(") for i in (first, first + 4))


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineLayout:
    """How a plan made for a global batch splits the model and the cluster (``plan.config`` has
    the degrees). The placements of the plan are those of one stage's program: the joint graph
    of one micro-batch (``microbatch_size * dp`` samples) on the stage mesh ``(dp, tp)``."""

    stage_starts: tuple[int, ...]
    """First segment of each stage (``autoplan.passes.layers``: 0 prologue, 1..L blocks, L+1 epilogue)."""
    stage_recompute: tuple[str, ...]
    segment_names: tuple[str, ...]
    stage_mesh_shape: tuple[int, ...]
    stage_axis_names: tuple[str, ...]
    global_batch_size: int
    precision: str
    block_list: str = ""
    """FQN of the model's list of repeated blocks (``autoplan.passes.depth``)."""
    traced_blocks: int = 0
    """Blocks of the program the placements are for: when fewer than the model's, the last
    one stands for all the others (``autoplan.passes.expand``); 0 = the full depth."""
    master_weights: bool = True
    """Priced with fp32 master weights and states (the model was given in fp32 for a bf16 plan);
    False: priced as the model kept in the plan's dtype, which the runtime then requires
    (:func:`autoplan.runtime.precision.check_model_precision`)."""

    @property
    def reduced(self) -> bool:
        return 0 < self.traced_blocks < len(self.segment_names) - 2

    def stage_segments(self) -> list[tuple[str, ...]]:
        bounds = [*self.stage_starts, len(self.segment_names)]
        return [tuple(self.segment_names[bounds[k] : bounds[k + 1]]) for k in range(len(self.stage_starts))]

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage_starts": list(self.stage_starts),
            "stage_recompute": list(self.stage_recompute),
            "segment_names": list(self.segment_names),
            "stage_mesh_shape": list(self.stage_mesh_shape),
            "stage_axis_names": list(self.stage_axis_names),
            "global_batch_size": self.global_batch_size,
            "precision": self.precision,
            "block_list": self.block_list,
            "traced_blocks": self.traced_blocks,
            "master_weights": self.master_weights,
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> PipelineLayout:
        return PipelineLayout(
            stage_starts=tuple(int(x) for x in d["stage_starts"]),
            stage_recompute=tuple(str(x) for x in d["stage_recompute"]),
            segment_names=tuple(str(x) for x in d["segment_names"]),
            stage_mesh_shape=tuple(int(x) for x in d["stage_mesh_shape"]),
            stage_axis_names=tuple(str(x) for x in d["stage_axis_names"]),
            global_batch_size=int(d["global_batch_size"]),
            precision=str(d["precision"]),
            block_list=str(d.get("block_list", "")),
            traced_blocks=int(d.get("traced_blocks", 0)),
            master_weights=_flag(d.get("master_weights", True), "pipeline.master_weights"),
        )


def _flag(value: object, name: str) -> bool:
    """A plan file's boolean field (``ValueError`` naming it otherwise: ``"no"`` is not False)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} {clip(value)} must be true or false")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class ConfigOption:
    """A configuration the joint search priced: the fastest layout of one combination of degrees
    (``dp``, ``tp``, ``pp``, ``ep``), or the least memory-hungry where none fits."""

    config: ParallelConfig
    step_time_s: float
    compute_s: float
    exposed_comm_s: float
    bubble_s: float
    peak_memory_bytes: float
    feasible: bool
    parts: StepParts | None = None
    """The step in parts that add up to ``step_time_s`` (``None`` in plan files written before
    they were recorded)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "step_time_s": self.step_time_s,
            "compute_s": self.compute_s,
            "exposed_comm_s": self.exposed_comm_s,
            "bubble_s": self.bubble_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "feasible": self.feasible,
            **({"step_parts": self.parts.to_dict()} if self.parts is not None else {}),
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> ConfigOption:
        return ConfigOption(
            config=ParallelConfig.from_dict(dict(d["config"])),
            step_time_s=float(d["step_time_s"]),
            compute_s=float(d["compute_s"]),
            exposed_comm_s=float(d["exposed_comm_s"]),
            bubble_s=float(d["bubble_s"]),
            peak_memory_bytes=float(d["peak_memory_bytes"]),
            feasible=bool(d["feasible"]),
            parts=StepParts.from_dict(d["step_parts"]) if d.get("step_parts") is not None else None,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A sharding plan for one model on one cluster (see the module docstring)."""

    fingerprint: str
    """Graph fingerprint of the traced training step the plan was made for."""
    cluster: Cluster
    optimizer: str
    param_names: tuple[str, ...]
    input_specs: tuple[tuple[str, ...], ...]
    target_specs: tuple[tuple[str, ...], ...]
    param_specs: Mapping[str, tuple[str, ...]]
    nodes: Mapping[str, Mapping[str, Any]]
    """node name -> {"op", "out": [spec per output or None], "in": [spec per tensor arg]}."""
    fallback_ops: Mapping[str, str]
    collectives: tuple[CollectiveRecord, ...]
    estimate: Estimate
    solver: Mapping[str, Any]
    versions: Mapping[str, str] = field(default_factory=dict)
    config: ParallelConfig | None = None
    """Degrees and knobs chosen by the joint search (plans made with a global batch)."""
    pipeline: PipelineLayout | None = None
    alternatives: Mapping[str, NodeExplanation] = field(default_factory=dict)
    """Per node with a choice: the chosen strategy and the next cheapest, each priced with the rest
    of the plan fixed (:mod:`autoplan.passes.explain`); read by ``autoplan explain``."""
    configurations: tuple[ConfigOption, ...] = ()
    """Plans made with a global batch: what the joint search weighed, the chosen configuration first,
    then the best of each other combination of degrees it priced, fastest first (those that fit
    before those that do not); read by ``autoplan explain`` without ``--op``/``--param``."""
    param_layouts: Mapping[str, KVGroupRows] = field(default_factory=dict)
    """Parameters the program keeps in another layout than the model's, which their placements
    are of (``TracedProgram.param_layouts``: a fused grouped-query QKV projection grouped by
    key/value head, :mod:`autoplan.passes.kv_groups`); saved as ``placements.param_layouts``."""
    workload: str = ""
    """``FILE.py:FUNCTION`` the CLI built the model from (empty for plans made from Python): lets
    ``autoplan export-onnx`` and ``autoplan explain`` find the model again."""

    # -- views ------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.cluster.world_size

    def strategy_of(self, node: str) -> Strategy:
        from autoplan.passes.placement import parse_spec
        from autoplan.passes.strategies import Strategy

        d = self.nodes[node]
        outs = tuple(parse_spec(s) if s is not None else None for s in d["out"])
        ins = tuple(parse_spec(s) for s in d["in"])
        return Strategy(output_specs=outs, input_specs=ins)

    def assignment(self) -> dict[str, Strategy]:
        """node name -> chosen strategy, placeholders included (buffers and constants are ``R``)."""
        from autoplan.passes.placement import parse_spec
        from autoplan.passes.strategies import Strategy

        out = {name: self.strategy_of(name) for name in self.nodes}
        for name in self.param_names:
            out[param_node_name(name)] = Strategy((parse_spec(self.param_specs[name]),), ())
        for i, s in enumerate(self.input_specs):
            out[f"input_{i}"] = Strategy((parse_spec(s),), ())
        for i, s in enumerate(self.target_specs):
            out[f"target_{i}"] = Strategy((parse_spec(s),), ())
        return out

    def step_collective_counts(self) -> dict[str, int]:
        """Collectives of each kind the whole step runs (``estimate.comm``), else those of the
        plan's program (:meth:`collective_counts`)."""
        if not self.estimate.comm.rows:
            return self.collective_counts()
        counts: dict[str, int] = {}
        for r in self.estimate.comm.rows:
            counts[r.kind] = counts.get(r.kind, 0) + r.count
        return dict(sorted(counts.items()))

    def collective_counts(self) -> dict[str, int]:
        """Number of collectives of each kind the plan's program runs once (local steps excluded):
        the whole step on a fixed mesh; one stage program for one micro-batch of a pipeline plan
        (the whole step's are in ``estimate.comm``)."""
        counts: dict[str, int] = {}
        seen_buckets: set[str] = set()
        for c in self.collectives:
            if c.bucket is not None:
                if c.bucket in seen_buckets:
                    continue
                seen_buckets.add(c.bucket)
            for kind, _axis in c.steps:
                if kind in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all"):
                    counts[kind] = counts.get(kind, 0) + 1
        return dict(sorted(counts.items()))

    @property
    def placement_axis_names(self) -> tuple[str, ...]:
        """Names of the mesh axes the placements and collective steps index: the stage mesh's
        (``dp``, ``tp``) for pipeline plans, the cluster's otherwise."""
        return self.pipeline.stage_axis_names if self.pipeline is not None else self.cluster.mesh_axis_names

    def parallelism(self) -> dict[str, str]:
        """Per mesh axis (:attr:`placement_axis_names`), what the plan does along it: ``data``
        (the batch is split, so gradients are reduced over the axis), ``context`` (attention runs
        head-parallel and all-to-alls convert its inputs or output between heads and sequence:
        the sequence is split around it, DeepSpeed-Ulysses' layout; or attention splits the
        sequence itself, ring attention; always on the ``cp`` axis of ``ParallelConfig.cp``, whose
        gradient reductions are partial sums over the sequence, not a split batch), ``tensor/param-sharded``
        (parameters are split), ``expert`` (MoE layers split their tokens and experts over it and
        exchange the routed tokens with all-to-all inside the op), a combination, or ``replicated``."""
        out = {}
        for axis, name in enumerate(self.placement_axis_names):
            grads_reduced = any(
                c.consumer.startswith("p_")
                and any(a == axis and k in ("all_reduce", "reduce_scatter") for k, a in c.steps)
                for c in self.collectives
            )
            params_sharded = sum(1 for s in self.param_specs.values() if s[axis] != "R")
            head_parallel = any(
                d["op"] == "autoplan.sdpa.default" and d["out"] and d["out"][0] and d["out"][0][axis] == "S(1)"
                for d in self.nodes.values()
            )
            all_to_all = any(k == "all_to_all" and a == axis for c in self.collectives for k, a in c.steps)
            ring = any(
                d["op"] == "autoplan.sdpa.default" and d["in"] and d["in"][0] and d["in"][0][axis] == "S(2)"
                for d in self.nodes.values()
            )
            sequence_axis = name == "cp"  # ParallelConfig.cp's axis: the sequence split, however attention runs
            kinds = []
            if grads_reduced and not sequence_axis:
                kinds.append("data")
            if (head_parallel and all_to_all) or ring or sequence_axis:
                kinds.append("context")
            if any(_expert_parallel_on(d, axis) for d in self.nodes.values()):
                kinds.append("expert")
            if params_sharded:
                kinds.append(f"tensor/param-sharded ({params_sharded}/{len(self.param_specs)} params)")
            out[name] = " + ".join(kinds) if kinds else "replicated"
        return out

    def summary(self) -> str:
        """Readable multi-line summary for review before anything runs (terminal-safe: control
        characters of names are shown as escapes)."""
        c, e = self.cluster, self.estimate
        mem = e.memory_bytes
        lines = [
            f"autoplan plan {self.fingerprint} for {c} ({c.device.name}, {c.world_size} devices)",
            *(
                [
                    f"  configuration: {self.config}",
                    f"  throughput: {e.tokens_per_s or 0:,.0f} tokens/s, MFU {e.mfu or 0:.1%}",
                ]
                if self.config is not None
                else []
            ),
            f"  estimated step: {step_parts_text(e)}",
            f"  communication: {e.comm_s * 1e3:.3f} ms"
            + (f", of which exposed {e.exposed_comm_s * 1e3:.3f} ms" if e.exposed_comm_s is not None else ""),
            *(
                [
                    "  communication per kind and axis (ms, exposed): "
                    + ", ".join(
                        f"{r.kind}@{r.axis} {r.total_s * 1e3:.3f} ({r.exposed_s * 1e3:.3f})" for r in e.comm.rows
                    )
                ]
                if e.comm.rows
                else []
            ),
            "  op times: "
            + (
                f"{e.compute_sources.get('profiled', 0)} profiled, {e.compute_sources.get('analytic', 0)} analytic"
                if e.compute_sources
                else "analytic"
            )
            + f"; links: {c.links_source}",
            f"  peak memory per device: {bytes_text(mem['total'])} of {bytes_text(e.capacity_bytes)}"
            f"{f' at {e.memory_peak_at}' if e.memory_peak_at else ''} ("
            + ", ".join(f"{k} {bytes_text(v)}" for k, v in e.memory_parts().items())
            + ")",
            f"  solver: {self.solver['status']} "
            f"({self.solver['num_variables']} variables, {self.solver['num_constraints']} constraints)",
            (
                "  mesh axes: "
                + ", ".join(
                    f"{name}={size}: {kind}"
                    for (name, kind), size in zip(self.parallelism().items(), c.mesh_shape, strict=True)
                )
                if self.pipeline is None
                else "  stages: "
                + "; ".join(
                    f"{k}: {segs[0]}..{segs[-1]} (recompute {rc})"
                    for k, (segs, rc) in enumerate(
                        zip(self.pipeline.stage_segments(), self.pipeline.stage_recompute, strict=True)
                    )
                )
                + f"; each on a stage mesh {dict(zip(self.pipeline.stage_axis_names, self.pipeline.stage_mesh_shape, strict=True))}"
            ),
            "  inputs: " + ", ".join(spec_text(s) for s in self.input_specs),
            (
                "  collectives per step: "
                + (", ".join(f"{k} x{v}" for k, v in self.step_collective_counts().items()) or "none")
                + ("" if self.pipeline is None or self.estimate.comm.rows else " (one stage program, one micro-batch)")
            ),
        ]
        if self.fallback_ops:
            lines.append(
                "  replicated fallback ops (no DTensor strategy): " + ", ".join(sorted(set(self.fallback_ops.values())))
            )
        lines.append("  parameters:")
        width = max((len(n) for n in self.param_names), default=10)
        for name in self.param_names:
            grouped = "  (rows grouped by key/value head)" if name in self.param_layouts else ""
            lines.append(f"    {name:<{width}}  {spec_text(self.param_specs[name])}{grouped}")
        return terminal_safe("\n".join(lines))  # names from a plan file never drive the terminal

    # -- checks -----------------------------------------------------------------------------
    def check_applies_to(self, *, fingerprint: str, world_size: int) -> None:
        if world_size != self.world_size:
            raise PlanMismatchError(
                f"plan is for {self.world_size} devices ({self.cluster}) but the job has {world_size} ranks: "
                f"launch with --nproc-per-node matching the plan, or re-plan for {world_size} devices"
            )
        if fingerprint != self.fingerprint:
            raise PlanMismatchError(
                f"plan was made for a different model or input shapes (graph fingerprint {self.fingerprint}, "
                f"this model traces to {fingerprint}): re-plan with `autoplan plan` for this model"
            )

    def check_fits(self, traced: TracedProgram, *, table: StrategyTable | None = None) -> None:
        """Every entry of the plan names a value of ``traced`` and fits its shape: one placement
        list per parameter of the model and no other, one per input and target, one entry per
        operator the program runs with one placement list per tensor output and argument, shard
        dims within each tensor's rank, placeholders only ``R``/``S(d)``, replicated fallback ops.
        With ``table`` (``autoplan.passes.strategies`` on the plan's mesh) every placeholder and operator
        must also have one of the strategies enumerated for it: a hand edit can pair placements an
        operator cannot run, and the program would then train wrongly.
        A plan whose fingerprint matches can still fail this when it was edited by hand; raises
        :class:`PlanMismatchError` naming the first entry that does not fit (before any rank starts)."""
        problem = _misfit(self, traced)
        if problem is None and table is not None:
            problem = _unlisted_strategy(self, table)
        if problem is not None:
            raise PlanMismatchError(
                f"plan entry {problem}: the plan does not fit this model (edited by hand?); undo the edit "
                "or re-plan with `autoplan plan`"
            )

    # -- serialisation ----------------------------------------------------------------------
    def to_dict(self, *, timings: bool = False) -> dict[str, Any]:
        e = self.estimate
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "fingerprint": self.fingerprint,
            "cluster": self.cluster.to_dict(),
            "optimizer": self.optimizer,
            "param_names": list(self.param_names),
            "placements": {
                "inputs": [list(s) for s in self.input_specs],
                "targets": [list(s) for s in self.target_specs],
                "params": {n: list(self.param_specs[n]) for n in self.param_names},
                **({"param_layouts": layouts_to_json(self.param_layouts)} if self.param_layouts else {}),
            },
            "estimate": {
                "step_time_s": e.step_time_s,
                "compute_s": e.compute_s,
                "comm_s": e.comm_s,
                "memory_bytes": dict(e.memory_bytes),
                "capacity_bytes": e.capacity_bytes,
                "memory_peak_at": e.memory_peak_at,
                "compute_sources": dict(e.compute_sources),
                "exposed_comm_s": e.exposed_comm_s,
                "comm": e.comm.to_list(),
                **({"step_parts": e.parts.to_dict()} if e.parts is not None else {}),
                **{k: getattr(e, k) for k in _ESTIMATE_OPTIONAL if getattr(e, k) is not None},
                **({"memory_per_device_bytes": list(e.memory_per_device_bytes)} if e.memory_per_device_bytes else {}),
            },
            **({"config": self.config.to_dict()} if self.config is not None else {}),
            **({"pipeline": self.pipeline.to_dict()} if self.pipeline is not None else {}),
            "solver": {k: v for k, v in self.solver.items() if timings or k not in WALL_CLOCK_KEYS},
            "fallback_ops": dict(self.fallback_ops),
            "collectives": [c.to_dict() for c in self.collectives],
            "nodes": {n: {"op": d["op"], "out": d["out"], "in": d["in"]} for n, d in self.nodes.items()},
            "alternatives": {n: x.to_dict() for n, x in self.alternatives.items()},
            **({"configurations": [c.to_dict() for c in self.configurations]} if self.configurations else {}),
            "versions": dict(self.versions),
            **({"workload": self.workload} if self.workload else {}),
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any], *, where: str = "plan") -> Plan:
        if not isinstance(d, Mapping) or d.get("format") != PLAN_FORMAT:
            raise PlanFileError(f'{where} is not an autoplan plan (missing "format": "{PLAN_FORMAT}")')
        if d.get("version") != PLAN_VERSION:
            raise PlanFileError(
                f"{where} has plan version {clip(d.get('version'))}; this autoplan reads version {PLAN_VERSION}: re-plan with this version"
            )
        if "optimizer" in d and d["optimizer"] not in OPTIMIZERS:
            raise PlanFileError(
                f"{where} names unknown optimizer {str(d.get('optimizer'))[:40]!r}: known are "
                f"{', '.join(OPTIMIZERS)}; re-plan with one of them (--optimizer)"
            )
        config_problem = field_name_problem(d["config"]) if isinstance(d.get("config"), Mapping) else None
        if config_problem:
            raise PlanFileError(f"{where}: config: {config_problem}: re-plan with this version of autoplan")
        try:
            cluster = Cluster.from_dict(d["cluster"], where=f"{where} (cluster)")
            est = d["estimate"]
            plan = Plan(
                fingerprint=str(d["fingerprint"]),
                cluster=cluster,
                optimizer=str(d["optimizer"]),
                param_names=tuple(d["param_names"]),
                input_specs=tuple(tuple(s) for s in d["placements"]["inputs"]),
                target_specs=tuple(tuple(s) for s in d["placements"]["targets"]),
                param_specs={k: tuple(v) for k, v in d["placements"]["params"].items()},
                param_layouts=layouts_from_json(d["placements"].get("param_layouts", {})),
                nodes={k: dict(v) for k, v in d["nodes"].items()},
                fallback_ops=dict(d["fallback_ops"]),
                collectives=tuple(CollectiveRecord.from_dict(c) for c in d["collectives"]),
                estimate=Estimate(
                    step_time_s=float(est["step_time_s"]),
                    compute_s=float(est["compute_s"]),
                    comm_s=float(est["comm_s"]),
                    memory_bytes={k: float(v) for k, v in est["memory_bytes"].items()},
                    capacity_bytes=float(est["capacity_bytes"]),
                    memory_peak_at=str(est.get("memory_peak_at", "")),
                    compute_sources={k: int(v) for k, v in est.get("compute_sources", {}).items()},
                    exposed_comm_s=None if est.get("exposed_comm_s") is None else float(est["exposed_comm_s"]),
                    bubble_s=None if est.get("bubble_s") is None else float(est["bubble_s"]),
                    mfu=None if est.get("mfu") is None else float(est["mfu"]),
                    tokens_per_s=None if est.get("tokens_per_s") is None else float(est["tokens_per_s"]),
                    memory_per_device_bytes=tuple(float(x) for x in est.get("memory_per_device_bytes", ())),
                    comm=CommTotals(tuple(_comm_row(r) for r in est.get("comm", ()))),
                    step_parts=StepParts.from_dict(est["step_parts"]) if est.get("step_parts") is not None else None,
                ),
                config=ParallelConfig.from_dict(dict(d["config"])) if d.get("config") is not None else None,
                pipeline=PipelineLayout.from_dict(d["pipeline"]) if d.get("pipeline") is not None else None,
                solver=dict(d["solver"]),
                versions=dict(d.get("versions", {})),
                alternatives={str(n): NodeExplanation.from_dict(x) for n, x in d.get("alternatives", {}).items()},
                configurations=tuple(ConfigOption.from_dict(c) for c in d.get("configurations", ())),
                workload=str(d.get("workload", "")),
            )
            _check_plan_values(plan)
        except ClusterSpecError as exc:
            raise PlanFileError(str(exc)) from exc
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PlanFileError(
                f"{where} is malformed ({type(exc).__name__}: {clip_text(str(exc))}): fix that entry or re-create "
                "it with `autoplan plan`"
            ) from exc
        _check_executable(plan, where)
        return plan

    def digest(self) -> str:
        """SHA-256 (hex) of the plan's content as saved without wall-clock timings, read back
        (``1`` and ``1.0`` are one number) and with keys sorted: equal plans give equal digests,
        whether made here, loaded, or saved with ``timings``."""
        as_read = Plan.from_dict(json.loads(json.dumps(self.to_dict(timings=False)))).to_dict(timings=False)
        text = json.dumps(as_read, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def save(self, path: str | os.PathLike[str], *, timings: bool = False) -> None:
        """Write the plan as JSON, atomically (a temporary file renamed into place). Without
        ``timings`` the file holds no wall-clock values: the same inputs give the same bytes."""
        text = json.dumps(self.to_dict(timings=timings), indent=1, sort_keys=False) + "\n"
        atomic_write(path, text, what="plan file")

    @staticmethod
    def load(path: str | os.PathLike[str]) -> Plan:
        """Read a plan file: at most ``MAX_PLAN_FILE_BYTES``, nesting and numbers within Python's
        JSON limits (``autoplan.cost_models.files``); every problem is a one-line :class:`PlanFileError`."""
        path = Path(path)
        try:
            text = read_limited(path, max_bytes=MAX_PLAN_FILE_BYTES).decode("utf-8")
        except InputLimitError as exc:
            raise PlanFileError(f"plan file {clip(str(path))} {exc}: it is not a plan; check the path") from None
        except FileNotFoundError:
            raise PlanFileError(
                f"plan file {str(path)!r} does not exist: check the path or write it with `autoplan plan ... --out`"
            ) from None
        except UnicodeDecodeError as exc:
            raise PlanFileError(
                f"plan file {str(path)!r} is not a UTF-8 JSON file ({exc.reason} at byte {exc.start}): "
                "re-create it with `autoplan plan`"
            ) from exc
        except OSError as exc:
            raise PlanFileError(f"cannot read plan file {str(path)!r}: {exc.strerror}: check the path") from exc
        try:
            data = parse_json(text)
        except json.JSONDecodeError as exc:
            raise PlanFileError(
                f"plan file {str(path)!r} is not valid JSON (line {exc.lineno}: {exc.msg}); it may be truncated: re-create it with `autoplan plan`"
            ) from exc
        except InputLimitError as exc:
            raise PlanFileError(
                f"plan file {clip(str(path))} {exc}: it is not a plan written by autoplan; re-create it with `autoplan plan`"
            ) from None
        return Plan.from_dict(data, where=f"plan file {str(path)!r}")


def _check_executable(plan: Plan, where: str) -> None:
    """A plan's configuration must be one the runtime runs (``unexecutable_fields``): a ZeRO stage
    it does not run would train as another while the plan reports it."""
    bad = unexecutable_fields(plan.config) if plan.config is not None else []
    if bad:
        fields = "; ".join(f"config.{name} is {value} (runs: {runs})" for name, value, runs in bad)
        raise PlanFileError(
            f"{where}: {fields}: autoplan prices this configuration (autoplan.estimate) but cannot run it; "
            "set the field to a value that runs or re-plan with `autoplan plan`"
        )


def _comm_row(d: Mapping[str, Any]) -> CommRow:
    return CommRow(
        kind=str(d["kind"]),
        axis=str(d["axis"]),
        count=int(d["count"]),
        bytes=float(d["bytes"]),
        total_s=float(d["total_s"]),
        exposed_s=float(d["exposed_s"]),
    )


def _check_plan_values(plan: Plan) -> None:
    """Every placement parses and has one entry per mesh axis, and the fields ``summary()``
    formats are there with the right types (raises KeyError/TypeError/ValueError, which
    :meth:`Plan.from_dict` reports as a malformed file)."""
    ndim = len(plan.pipeline.stage_mesh_shape) if plan.pipeline is not None else plan.cluster.mesh_ndim

    def check(spec: object, what: str) -> None:
        if isinstance(spec, str) or not isinstance(spec, (list, tuple)):
            raise TypeError(f"{what} must be a list of placements, got {clip(spec)}")
        spec_text(spec)  # every placement parses
        if len(spec) != ndim:
            raise ValueError(f"{what} has {len(spec)} placement(s) for a {ndim}-axis mesh")

    for n, d in plan.nodes.items():
        for key in ("out", "in"):
            if isinstance(d[key], str) or not isinstance(d[key], (list, tuple)):
                raise TypeError(f"nodes[{clip(n)}].{key} must be a list of placement lists, got {clip(d[key])}")
        for i, spec in enumerate(d["out"]):
            if spec is not None:
                check(spec, f"nodes[{clip(n)}].out[{i}]")
        for i, spec in enumerate(d["in"]):
            check(spec, f"nodes[{clip(n)}].in[{i}]")
    if len(set(plan.param_names)) != len(plan.param_names) or set(plan.param_specs) != set(plan.param_names):
        odd = sorted(set(plan.param_names).symmetric_difference(plan.param_specs)) or ["(a name listed twice)"]
        raise ValueError(
            f"param_names and placements.params must name the same parameters once each; {clip(odd[0])} differs"
        )
    for n in plan.param_names:
        check(plan.param_specs[n], f"placements.params[{clip(n)}]")
    for n in plan.param_layouts:
        if n not in plan.param_specs:
            raise ValueError(f"placements.param_layouts names {clip(n)}, which placements.params does not")
    for i, spec in enumerate(plan.input_specs + plan.target_specs):
        check(spec, f"placements.inputs/targets[{i}]")
    for j, c in enumerate(plan.collectives):
        check(list(c.src), f"collectives[{j}].src")
        check(list(c.dst), f"collectives[{j}].dst")
        for kind, axis in c.steps:
            if kind not in COLLECTIVE_KINDS | LOCAL_KINDS:
                raise ValueError(
                    f"collectives[{j}] has a step of unknown kind {clip(kind)}; "
                    f"known: {', '.join(sorted(COLLECTIVE_KINDS | LOCAL_KINDS))}"
                )
            if not 0 <= axis < ndim:
                raise ValueError(
                    f"collectives[{j}] ({clip(c.producer)} -> {clip(c.consumer)}) has a step {kind} on mesh axis "
                    f"{clip(axis)} but the mesh has {ndim} axis/axes (0..{ndim - 1})"
                )
    _check_pipeline_layout(plan)
    missing = [k for k in _SOLVER_KEYS if k not in plan.solver]
    if missing:
        raise KeyError(f"solver.{missing[0]}")
    for k in ("num_variables", "num_constraints", *(w for w in WALL_CLOCK_KEYS if w in plan.solver)):
        if isinstance(plan.solver[k], bool) or not isinstance(plan.solver[k], (int, float)):
            raise TypeError(f"solver.{k} must be a number, got {clip(plan.solver[k])}")
    if "total" not in plan.estimate.memory_bytes:
        raise KeyError("estimate.memory_bytes.total")
    for what, step_s, parts in (
        ("estimate", plan.estimate.step_time_s, plan.estimate.step_parts),
        *((f"configurations[{k}]", c.step_time_s, c.parts) for k, c in enumerate(plan.configurations)),
    ):
        if parts is not None and abs(parts.total_s - step_s) > 1e-6 * max(abs(step_s), 1e-9):
            raise ValueError(f"{what}.step_parts add up to {parts.total_s!r} s, not to its step_time_s {step_s!r} s")
    bad_ops = {n: op for n, op in plan.fallback_ops.items() if not isinstance(op, str)}
    if bad_ops:
        raise TypeError(f"fallback_ops must map node names to op names, got {clip(bad_ops)}")


def _misfit(plan: Plan, traced: TracedProgram) -> str | None:
    """The first entry of ``plan`` that does not fit ``traced`` (see :meth:`Plan.check_fits`)."""
    import difflib

    import torch
    from torch.distributed.tensor import Replicate, Shard

    from autoplan.passes.placement import is_segment_shard, parse_spec, shard_dim, spec_str
    from autoplan.passes.strategies import tensor_args

    nodes = {n.name: n for n in traced.graph_module.graph.nodes}

    def rank_problem(spec: Sequence[str], val: object, *, placeholder: bool = False) -> str | None:
        if not isinstance(val, torch.Tensor):
            return "is for a value that is not a tensor"
        for p in parse_spec(spec):
            if placeholder and not (isinstance(p, (Replicate, Shard)) or is_segment_shard(p)):
                return f"is {spec_str(parse_spec(spec))}: an input or parameter is R, S(d) or S(d)/k on each axis"
            d = shard_dim(p)
            if d is not None and d >= val.dim():
                return f"shards dim {d} of a {val.dim()}-D tensor {tuple(val.shape)}"
        return None

    model_params = set(traced.param_names)
    for name in plan.param_names:
        if name not in model_params:
            close = difflib.get_close_matches(name, traced.param_names, n=3, cutoff=0) if len(name) < 1000 else []
            return f"placements.params[{clip(name)}] names no parameter of this model (close: {', '.join(close)})"
    missing = [n for n in traced.param_names if n not in plan.param_specs]
    if missing:
        return f"placements.params has no placement for the model's parameter {clip(missing[0])}"
    for name in traced.param_names:
        planned, read = plan.param_layouts.get(name), traced.param_layouts.get(name)
        if planned != read:
            return (
                f"the plan's placement of {clip(name)} is of its rows {layout_text(planned)}, but the program reads "
                f"them {layout_text(read)}: re-plan the model with this version of autoplan"
            )
    for name in plan.param_names:
        problem = rank_problem(plan.param_specs[name], nodes[param_node_name(name)].meta.get("val"), placeholder=True)
        if problem:
            return f"placements.params[{clip(name)}] {problem}"
    for kind, specs, count in (
        ("inputs", plan.input_specs, traced.num_inputs),
        ("targets", plan.target_specs, traced.num_targets),
    ):
        if len(specs) != count:
            return f"placements.{kind} has {len(specs)} placement list(s) but the model takes {count} {kind}"
        for i, spec in enumerate(specs):
            problem = rank_problem(spec, nodes[f"{kind[:-1]}_{i}"].meta.get("val"), placeholder=True)
            if problem:
                return f"placements.{kind}[{i}] {problem}"
    for name, d in plan.nodes.items():
        node = nodes.get(name)
        if node is None or node.op != "call_function" or str(node.target) != d["op"]:
            found = "no such node" if node is None else f"the node is {node.op} {clip(str(node.target))}"
            return f"nodes[{clip(name)}] (op {clip(d['op'])}) is not an operator of this model's program ({found})"
        val = node.meta.get("val")
        outs = list(val) if isinstance(val, (tuple, list)) else [val]
        args = tensor_args(node)
        if len(d["out"]) != len(outs) or len(d["in"]) != len(args):
            return (
                f"nodes[{clip(name)}] has {len(d['out'])} output and {len(d['in'])} argument placement list(s); "
                f"{clip(d['op'])} here has {len(outs)} output(s) and {len(args)} tensor argument(s)"
            )
        for i, (spec, v) in enumerate(zip(d["out"], outs, strict=True)):
            if (spec is None) != (not isinstance(v, torch.Tensor)):
                return f"nodes[{clip(name)}].out[{i}] is {'null' if spec is None else 'a placement'} for a " + (
                    "tensor" if isinstance(v, torch.Tensor) else "non-tensor output"
                )
            problem = None if spec is None else rank_problem(spec, v)
            if problem:
                return f"nodes[{clip(name)}].out[{i}] {problem}"
        for i, (spec, a) in enumerate(zip(d["in"], args, strict=True)):
            problem = rank_problem(spec, a.meta.get("val"))
            if problem:
                return f"nodes[{clip(name)}].in[{i}] {problem}"
    for name, op in plan.fallback_ops.items():
        d = plan.nodes.get(name)
        if d is None:
            return f"fallback_ops[{clip(name)}] ({clip(op)}) names no node of the plan"
        if any(p != "R" for spec in [*d["out"], *d["in"]] if spec is not None for p in spec):
            return f"nodes[{clip(name)}] runs replicated (fallback_ops) but its placements are not all R"
    unplanned = _unplanned_operator(traced, plan.nodes)
    if unplanned is not None:
        return (
            f"nodes has no entry for the operator {clip(unplanned.name)} ({clip(str(unplanned.target))}) of this model"
        )
    return None


def _unlisted_strategy(plan: Plan, table: StrategyTable) -> str | None:
    """The first placeholder or operator of ``plan`` whose placements are not among the
    strategies ``table`` enumerates for it (what the solver chooses from)."""
    for name, strategy in plan.assignment().items():
        ns = table.nodes.get(name)
        if ns is not None and strategy not in ns.strategies:
            where = f"nodes[{clip(name)}]" if name in plan.nodes else f"placeholder {clip(name)}"
            return (
                f"{where}: {strategy} is not a way to run {clip(plan.nodes[name]['op']) if name in plan.nodes else 'it'} "
                f"on mesh {table.mesh_shape} (it has {len(ns.strategies)}, e.g. {ns.strategies[0]})"
            )
    return None


def _unplanned_operator(traced: TracedProgram, planned: Mapping[str, Any]) -> torch.fx.Node | None:
    """The first operator of ``traced`` that computes on a placeholder's value (so the strategy
    table of ``autoplan.passes.strategies`` gives it placements) but has no entry in ``planned``."""
    import operator

    from autoplan.passes.strategies import resolve_value, tensor_args

    depends: set[str] = set()
    for node in traced.graph_module.graph.nodes:
        if node.op == "placeholder":
            depends.add(node.name)
        elif node.op == "call_function" and node.target is not operator.getitem:
            if any(resolve_value(a).node in depends for a in tensor_args(node)):
                depends.add(node.name)
                if node.name not in planned:
                    return node
    return None


def _check_pipeline_layout(plan: Plan) -> None:
    """A plan made for a global batch has both ``config`` and ``pipeline``, and they agree: one
    start and one recompute mode per stage, starts rising from segment 0 inside the model's
    segments, a stage mesh of ``dp * cp * tp`` devices and ``config`` filling the cluster."""
    cfg, layout = plan.config, plan.pipeline
    if cfg is None and layout is None:
        return
    if cfg is None or layout is None:
        raise KeyError("config" if cfg is None else "pipeline")
    starts, num_segments = layout.stage_starts, len(layout.segment_names)
    if len(starts) != cfg.num_stages:
        raise ValueError(
            f"pipeline.stage_starts has {len(starts)} stage(s) but config has pp*virtual_stages = {cfg.num_stages}"
        )
    if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= num_segments:
        raise ValueError(
            f"pipeline.stage_starts {clip(list(starts))} must rise from 0 and stay below the {num_segments} "
            "segments of pipeline.segment_names"
        )
    if len(layout.stage_recompute) != len(starts) or any(r not in RECOMPUTE for r in layout.stage_recompute):
        raise ValueError(
            f"pipeline.stage_recompute {clip(list(layout.stage_recompute))} must give one of "
            f"{', '.join(RECOMPUTE)} for each of the {len(starts)} stage(s)"
        )
    if len(layout.stage_axis_names) != len(layout.stage_mesh_shape) or math.prod(layout.stage_mesh_shape) != (
        cfg.dp * cfg.ranks_per_replica
    ):
        raise ValueError(
            f"pipeline.stage_mesh_shape {clip(list(layout.stage_mesh_shape))} with axes "
            f"{clip(list(layout.stage_axis_names))} must be one named axis per size, {cfg.dp * cfg.ranks_per_replica} "
            f"devices (config dp*cp*tp = {cfg.dp}*{cfg.cp}*{cfg.tp})"
        )
    if (layout.stage_mesh_shape, layout.stage_axis_names) != cfg.stage_mesh():
        shape, names = cfg.stage_mesh()
        raise ValueError(
            f"pipeline.stage_mesh_shape {clip(list(layout.stage_mesh_shape))} with axes "
            f"{clip(list(layout.stage_axis_names))} is not the stage mesh of config {cfg}: {list(shape)} with axes "
            f"{list(names)}"
        )
    if cfg.world_size != plan.world_size:
        raise ValueError(f"config ({cfg}) uses {cfg.world_size} devices but the cluster has {plan.world_size}")
    if layout.global_batch_size != cfg.global_batch_size:
        raise ValueError(
            f"pipeline.global_batch_size {clip(layout.global_batch_size)} is not config's "
            f"dp*microbatch_size*num_microbatches = {cfg.global_batch_size}"
        )
    if not 0 <= layout.traced_blocks <= num_segments - 2:
        raise ValueError(
            f"pipeline.traced_blocks {clip(layout.traced_blocks)} must be 0..{num_segments - 2} (the model's blocks)"
        )
    if layout.precision not in PRECISIONS:
        raise ValueError(f"pipeline.precision {clip(layout.precision)} must be one of {', '.join(PRECISIONS)}")


def software_versions() -> dict[str, str]:
    import torch  # heavy: plan.py is loaded without torch by the review commands

    return {"autoplan": __version__, "torch": torch.__version__}
