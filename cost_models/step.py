r"""The training step of one configuration: per-stage time and memory, composed into the step.

Input: a :class:`~autoplan.cost_models.config.ParallelConfig`, the :class:`SegmentCosts` of its
micro-batch on its tensor-parallel group (the intra-operator ILP summed per layer segment by
:mod:`autoplan.planner.segment_costs`) and the cluster. Output: a :class:`TrainingEstimate`. The
joint search (:mod:`autoplan.planner.search`) and ``autoplan.estimate`` price every configuration
with :func:`evaluate`.

Formulation
-----------
The device mesh is ``(pp, dp, tp)`` in Megatron's rank order (tp fastest, pp slowest), so a
tensor-parallel group is ``tp`` consecutive ranks of one node, a data-parallel group has stride
``tp`` and pipeline neighbours are ``dp * tp`` ranks apart. A configuration ``c`` fixes the
degrees, the micro-batch size ``b`` (per data-parallel replica), the number of micro-batches
``m`` (``B = dp * b * m``), the schedule with ``v`` virtual stages, recomputation and ZeRO stage.
Stages are contiguous ranges of segments (:mod:`autoplan.passes.layers`: prologue, blocks, epilogue).

Inside a stage, the per-operator sharding is the ILP of :mod:`autoplan.planner.solver` solved on the
tensor-parallel group for one micro-batch of ``b`` samples (data parallelism splits the batch
evenly and adds only the gradient synchronisation, priced here), and summed per segment by
:mod:`autoplan.planner.segment_costs`. For stage ``k`` with segments ``K``::

    F_k = sum_{j in K} fwd_s[j]
    B_k = sum_{j in K} bwd_s[j] + R_k        R_k = 0 | sum selective_recompute_s | F_k   (recompute)
    A_k = sum_{j in K} a_j                   a_j = saved_bytes | saved_matmul + input | input
    S_k = P_k w + T_k (g + o)                P_k parameter elements, T_k of them trainable (not
                                             frozen); w, g, o bytes per element of weights, grads
                                             and optimizer state (autoplan.cost_models.memory, by precision
                                             and optimizer)
          / dp on the parts ZeRO shards       (1: o, 2: o + g, 3: o + g + w)
    ZeRO-3: F_k, B_k += the parameter all-gather of the stage per micro-batch; where compute and
          communication overlap, max(F_k, gather) + the gather of one segment (prefetch)
    M_k = S_k + inflight_k(schedule, m, v) * A_k + T_k  <=  capacity          (memory)

with ``T_k`` the transient of recomputing one segment (full recompute) and the ZeRO-3 gather
buffer (:func:`autoplan.cost_models.memory.stage_memory_parts`). The step time is the pipeline
makespan of :mod:`autoplan.cost_models.schedule` over the ``(F_k, B_k)`` with point-to-point
transfers of ``cut_bytes`` between stages, plus per stage the exposed gradient synchronisation
(all-reduce over dp, or reduce-scatter + per micro-batch all-gathers for ZeRO-3; on devices that
overlap communication the part hidden behind the last micro-batch's backward is not counted) and
the optimizer step::

    T(c) = makespan(F, B, m, schedule, p2p) + max_k (exposed_sync_k + opt_k / dp^[zero>=1])

Heterogeneous sub-meshes (``c.stage_dp``): stage ``k`` gets ``d_k * tp`` devices and splits each
micro-batch of ``S = dp * b`` samples ``d_k`` ways (``d_k | S``); its times are those of ``S / d_k``
samples, its gradient synchronisation and ZeRO sharding run over ``d_k``, and a cut is sent by
``d_k`` ranks to ``d_{k+1}`` (the busiest link carries ``1 / min(d_k, d_{k+1})`` of it).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autoplan.cost_models.cluster import Cluster, LinkSpec
from autoplan.cost_models.comm import link_time_s, overlaps_compute
from autoplan.cost_models.config import ParallelConfig
from autoplan.cost_models.errors import ConfigError
from autoplan.cost_models.memory import ElementBytes, precision_bytes, stage_memory_parts
from autoplan.cost_models.schedule import StageTimes, fast_step_time, inflight_microbatches

# --- input: costs per layer segment ------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class SegmentCost:
    """One segment's share of a micro-batch's step on one device (computed by
    :mod:`autoplan.planner.segment_costs`, whose docstring gives the formulas)."""

    fwd_s: float
    bwd_s: float
    bwd_weight_s: float
    """Part of ``bwd_s`` that only weight gradients need (no earlier segment waits for it): the
    W of zero-bubble schedules."""
    fwd_comm_s: float
    """Part of ``fwd_s`` spent in collectives (tensor/sequence parallel conversions)."""
    bwd_comm_s: float
    selective_recompute_s: float
    """Forward time of the non-matmul ops (what selective recomputation runs again)."""
    grad_sync_s: float
    """Gradient conversions of the segment's parameters, once per step."""
    optimizer_s: float
    param_numel: int
    """Local parameter elements (after tensor-parallel sharding), frozen ones included."""
    trainable_numel: int
    """The part of ``param_numel`` that is trained (has a gradient and optimizer state)."""
    param_itemsize: int
    saved_bytes: float
    """Activations saved for the backward, per micro-batch."""
    saved_matmul_bytes: float
    """Part of ``saved_bytes`` produced by matmul-family ops (kept by selective recompute)."""
    input_bytes: float
    """Bytes of the values entering the segment from earlier ones (kept by full recompute)."""
    flops: float
    """Forward + backward FLOPs of the segment's ops for the whole (unsharded) micro-batch."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SegmentCosts:
    segments: tuple[SegmentCost, ...]
    cut_bytes: tuple[float, ...]
    """``cut_bytes[k]``: activation bytes per micro-batch crossing the cut after segment ``k``."""
    optimizer: str
    """The optimizer ``optimizer_s`` was priced for; its state's bytes per trainable element
    come from the same name (:func:`autoplan.cost_models.memory.precision_bytes`)."""


# --- output ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class StageEstimate:
    segments: tuple[int, int]
    """``[first, last)`` segment indices of the stage."""
    rank: int
    """Pipeline rank holding the stage."""
    fwd_s: float
    bwd_s: float
    recompute: str
    memory_bytes: float
    memory_parts: dict[str, float]
    dp: int = 1
    """Data-parallel degree of the stage's sub-mesh (``stage_dp``; else the configuration's dp)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingEstimate:
    """Estimated training step of one configuration on a cluster (per device where it says):
    what ``autoplan.estimate`` returns and what the joint search compares, with the per-stage
    detail in ``stages``."""

    config: ParallelConfig
    step_time_s: float
    compute_s: float
    """Busy compute of the slowest pipeline rank (forward, backward, recomputation)."""
    exposed_comm_s: float
    """Communication not hidden behind compute: tensor-parallel collectives, exposed gradient
    synchronisation, pipeline point-to-point."""
    bubble_s: float
    """Idle time of the pipeline schedule (0 without pipeline parallelism)."""
    optimizer_s: float
    memory_per_device_bytes: tuple[float, ...]
    """Peak bytes per device of each pipeline rank (devices of one rank are alike; interleaving
    puts several stages on a rank)."""
    capacity_bytes: float
    tokens_per_s: float
    mfu: float
    """Model FLOPs utilisation: model FLOPs per step / (step time x devices x peak FLOP/s)."""
    feasible: bool
    precision: str
    num_blocks: int
    """Repeated blocks of the model priced (segments: prologue, the blocks, epilogue)."""
    stages: tuple[StageEstimate, ...]
    """Per pipeline stage: segments, rank, times, recomputation and memory by part."""
    p2p_exposed_s: float
    """Pipeline point-to-point time not hidden by the schedule (part of ``exposed_comm_s``)."""
    flops_per_step: float

    @property
    def peak_memory_bytes(self) -> float:
        """Largest per-device memory over the pipeline ranks."""
        return max(self.memory_per_device_bytes)

    @property
    def memory_parts_bytes(self) -> tuple[dict[str, float], ...]:
        """Per pipeline stage: weights, grads, optimizer, activations, transient."""
        return tuple(dict(st.memory_parts) for st in self.stages)

    @property
    def stage_starts(self) -> tuple[int, ...]:
        """First segment of each stage (segment 0 = prologue, 1..L = blocks, L+1 = epilogue)."""
        return tuple(s.segments[0] for s in self.stages)

    @property
    def stage_recompute(self) -> tuple[str, ...]:
        return tuple(st.recompute for st in self.stages)

    def to_dict(self) -> dict[str, Any]:
        """The estimate as plain values (``autoplan estimate --json``): the fields a user reads,
        per-stage memory and layout instead of the stage objects."""
        return {
            "config": self.config.to_dict(),
            "step_time_s": self.step_time_s,
            "compute_s": self.compute_s,
            "exposed_comm_s": self.exposed_comm_s,
            "bubble_s": self.bubble_s,
            "optimizer_s": self.optimizer_s,
            "memory_per_device_bytes": self.memory_per_device_bytes,
            "memory_parts_bytes": self.memory_parts_bytes,
            "capacity_bytes": self.capacity_bytes,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "stage_starts": self.stage_starts,
            "stage_recompute": self.stage_recompute,
            "feasible": self.feasible,
            "precision": self.precision,
            "num_blocks": self.num_blocks,
        }

    def summary(self) -> str:
        gib = 2**30
        lines = [
            f"config: {self.config}",
            f"step time {self.step_time_s * 1e3:.1f} ms = compute {self.compute_s * 1e3:.1f} ms "
            f"+ exposed comm {self.exposed_comm_s * 1e3:.1f} ms + bubble {self.bubble_s * 1e3:.1f} ms "
            f"+ optimizer {self.optimizer_s * 1e3:.1f} ms (parts overlap)",
            f"throughput {self.tokens_per_s:,.0f} tokens/s, MFU {self.mfu:.1%}",
            f"peak memory per device {self.peak_memory_bytes / gib:.2f} GiB of {self.capacity_bytes / gib:.1f} GiB"
            + ("" if self.feasible else "  (DOES NOT FIT)"),
        ]
        if self.config.pp > 1:
            lines.append(f"stages start at segments {list(self.stage_starts)}, recompute {list(self.stage_recompute)}")
        return "\n".join(lines)


# --- topology ---------------------------------------------------------------------------------


def group_link(cluster: Cluster, *, stride: int, size: int) -> LinkSpec:
    """Link of a group of ``size`` ranks ``stride`` apart: network if it leaves a node."""
    spans = cluster.num_nodes > 1 and stride * size > cluster.devices_per_node
    if not spans and "intra" in cluster.links:
        return cluster.links["intra"]
    if spans and "inter" in cluster.links:
        return cluster.links["inter"]
    return cluster.catalog_link(spans_nodes=spans)


def tp_cluster(cluster: Cluster, tp: int) -> Cluster:
    """The tensor-parallel group as a one-node cluster (keeps a calibrated intra-node link)."""
    links = {"intra": cluster.links["intra"]} if "intra" in cluster.links and tp > 1 else {}
    return Cluster(
        num_nodes=1, devices_per_node=tp, device=cluster.device, links=links, calibration=cluster.calibration
    )


# --- precision --------------------------------------------------------------------------------


def precision_dtype(precision: str) -> str:
    return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[precision]


def precision_opt_factor(precision: str) -> float:
    """Optimizer step bytes relative to fp32 training (mixed precision also writes the bf16 copy)."""
    return 1.0 if precision == "fp32" else 1.1


# --- one stage --------------------------------------------------------------------------------


def uniform_starts(num_segments: int, num_stages: int) -> tuple[int, ...]:
    """Megatron's split: blocks divided evenly; the prologue joins the first stage and the
    epilogue the last."""
    num_blocks = num_segments - 2
    per, extra = divmod(num_blocks, num_stages)
    starts, at = [0], 1
    for k in range(num_stages - 1):
        at += per + (1 if k < extra else 0)
        starts.append(at)
    return tuple(starts)


def recompute_parts(seg: SegmentCost, recompute: str) -> tuple[float, float, float]:
    """(extra backward time, saved bytes per micro-batch, transient bytes) of one segment."""
    if recompute == "none":
        return 0.0, seg.saved_bytes, 0.0
    if recompute == "selective":
        kept = min(seg.saved_bytes, seg.saved_matmul_bytes + seg.input_bytes)
        return seg.selective_recompute_s, kept, seg.saved_bytes - kept
    return seg.fwd_s, min(seg.saved_bytes, seg.input_bytes), seg.saved_bytes


@dataclass(frozen=True, slots=True)
class _StagePrice:
    """One stage's share of :func:`evaluate`: its times for the schedule, its estimate (memory
    included), and what the step adds after the pipeline drains."""

    times: StageTimes
    estimate: StageEstimate
    sync_exposed_s: float
    """Gradient synchronisation not hidden behind the last backward, plus ZeRO 1-2's all-gather."""
    optimizer_s: float
    tp_comm_s: float
    """Tensor-parallel collectives of one micro-batch (forward + backward)."""


def _data_parallel_comm(
    config: ParallelConfig,
    part: Sequence[SegmentCost],
    cluster: Cluster,
    *,
    dp: int,
    bpe: ElementBytes,
    fwd: float,
    bwd: float,
) -> tuple[float, float, float, float]:
    """``(fwd, bwd, sync, after)`` of a stage over ``dp`` replicas: the forward and backward with
    ZeRO-3's per micro-batch parameter all-gathers, the gradient synchronisation, and the
    communication after the optimizer step (ZeRO 1-2's all-gather of the updated weights)."""
    if dp == 1:
        return fwd, bwd, 0.0, 0.0
    dp_link = group_link(cluster, stride=config.tp, size=dp)
    backend = cluster.backend
    z = config.zero_stage
    numel = sum(s.param_numel for s in part)
    trained = sum(s.trainable_numel for s in part)  # frozen parameters: weights only
    grad_bytes = trained * bpe.grads
    after = 0.0  # communication after the optimizer step (cannot hide behind the backward)
    # collectives take full-size byte counts (autoplan.cost_models.comm's ring convention)
    if z == 0:
        sync = link_time_s("all_reduce", grad_bytes, dp, dp_link, backend=backend)
    else:  # gradients reduce-scattered; ZeRO 1-2 all-gather the updated weights after the step
        sync = link_time_s("reduce_scatter", grad_bytes, dp, dp_link, backend=backend)
        if z < 3:  # the updated (trainable) weights
            after = link_time_s("all_gather", trained * bpe.weights, dp, dp_link, backend=backend)
    if z >= 3:  # parameters all-gathered before each micro-batch's forward and backward
        ag = link_time_s("all_gather", numel * bpe.weights, dp, dp_link, backend=backend)
        if overlaps_compute(cluster.device):
            # prefetching hides a segment's gather behind the previous segment's compute;
            # the first segment's gather of each pass has nothing to hide behind
            first = max((s.param_numel for s in part), default=0) * bpe.weights
            ag_first = link_time_s("all_gather", first, dp, dp_link, backend=backend)
            fwd, bwd = max(fwd, ag) + ag_first, max(bwd, ag) + ag_first
        else:
            fwd, bwd = fwd + ag, bwd + ag
    return fwd, bwd, sync, after


def _inflight(config: ParallelConfig, rank: int) -> int:
    """Micro-batches whose activations a stage on pipeline rank ``rank`` holds at once."""
    if config.pp == 1:
        return 1  # gradient accumulation: one micro-batch in flight at a time
    inflight = inflight_microbatches(
        config.pipeline_schedule, rank, config.pp, config.num_microbatches, config.virtual_stages
    )
    if config.virtual_stages > 1:
        inflight = math.ceil(inflight / config.virtual_stages)
    return inflight


def _price_stage(
    config: ParallelConfig,
    part: Sequence[SegmentCost],
    cluster: Cluster,
    *,
    stage: int,
    segments: tuple[int, int],
    recompute: str,
    bpe: ElementBytes,
    precision: str,
) -> _StagePrice:
    """Times, memory and data-parallel communication of stage ``stage`` (segments ``part``)."""
    rank = stage % config.pp
    dp = config.dp_of(rank)
    fwd = sum(s.fwd_s for s in part)
    extra = saved = transient = 0.0
    for s in part:
        e, a, t = recompute_parts(s, recompute)
        extra, saved, transient = extra + e, saved + a, max(transient, t)
    bwd = sum(s.bwd_s for s in part) + extra
    fwd, bwd, sync, after = _data_parallel_comm(config, part, cluster, dp=dp, bpe=bpe, fwd=fwd, bwd=bwd)
    last_bwd = sum(s.bwd_s for s in part)
    z = config.zero_stage
    parts = stage_memory_parts(
        param_numel=sum(s.param_numel for s in part),
        trainable_numel=sum(s.trainable_numel for s in part),
        largest_segment_numel=max((s.param_numel for s in part), default=0),
        element=bpe,
        zero_stage=z,
        dp=dp,
        saved_bytes=saved,
        inflight=_inflight(config, rank),
        transient_bytes=transient,
    )
    # W = the weight-gradient-only ops of the stage (plus recomputation lands in B)
    w_s = min(bwd, sum(s.bwd_weight_s for s in part))
    return _StagePrice(
        times=StageTimes(fwd_s=fwd, bwd_input_s=bwd - w_s, bwd_weight_s=w_s),
        estimate=StageEstimate(
            segments=segments,
            rank=rank,
            fwd_s=fwd,
            bwd_s=bwd,
            recompute=recompute,
            memory_bytes=sum(parts.values()),
            memory_parts=parts,
            dp=dp,
        ),
        sync_exposed_s=(max(0.0, sync - last_bwd) if overlaps_compute(cluster.device) else sync) + after,
        optimizer_s=sum(s.optimizer_s for s in part) * (precision_opt_factor(precision)) / (dp if z >= 1 else 1),
        tp_comm_s=sum(s.fwd_comm_s + s.bwd_comm_s for s in part),
    )


# --- the step ---------------------------------------------------------------------------------


def _p2p_s(
    config: ParallelConfig, costs: SegmentCosts, cluster: Cluster, cut: int, stage: int, offsets: list[int]
) -> float:
    """Send of the activations crossing ``cut`` from ``stage`` to the next one: the micro-batch
    (``dp`` replicas' worth) goes from the ``d_k`` replicas of one stage to the ``d_k+1`` of
    the next, so the busiest link carries ``1 / min(d_k, d_k+1)`` of it (uniform: each
    replica sends its own ``b`` samples). The link is the network when the two stages'
    devices (``offsets``: first device of each pipeline rank) are not on one node."""
    a, b = stage % config.pp, (stage + 1) % config.pp
    total = costs.cut_bytes[cut] * config.dp
    lo, hi = min(offsets[a], offsets[b]), max(offsets[a + 1], offsets[b + 1]) - 1
    dpn = cluster.devices_per_node
    spans = cluster.num_nodes > 1 and lo // dpn != hi // dpn
    link = cluster.links.get("inter" if spans else "intra") or cluster.catalog_link(spans_nodes=spans)
    share = total / min(config.dp_of(a), config.dp_of(b))
    return link_time_s("send_recv", share, 2, link, backend=cluster.backend)


def _pipeline_times(
    config: ParallelConfig,
    costs: SegmentCosts,
    cluster: Cluster,
    priced: Sequence[_StagePrice],
    bounds: Sequence[int],
) -> tuple[float, float, float, float]:
    """``(makespan, busiest rank's compute, bubble, exposed p2p)`` of the schedule over the stages."""
    m = config.num_microbatches
    # first device of each stage's sub-mesh (Megatron order; stage sub-meshes are contiguous)
    offsets = list(itertools.accumulate((config.dp_of(k % config.pp) * config.tp for k in range(config.pp)), initial=0))
    p2p = [_p2p_s(config, costs, cluster, bounds[k + 1] - 1, k, offsets) for k in range(len(priced) - 1)]
    busy = [0.0] * config.pp
    for p in priced:
        busy[p.estimate.rank] += m * (p.estimate.fwd_s + p.estimate.bwd_s)
    if config.pp == 1:
        return max(busy), max(busy), 0.0, 0.0
    stage_times = [p.times for p in priced]
    schedule, pp, v = config.pipeline_schedule, config.pp, config.virtual_stages
    makespan = fast_step_time(stage_times, schedule, m, num_ranks=pp, p2p_s=p2p, virtual_stages=v)
    free_p2p = fast_step_time(stage_times, schedule, m, num_ranks=pp, p2p_s=0.0, virtual_stages=v)
    return makespan, max(busy), max(0.0, free_p2p - max(busy)), max(0.0, makespan - free_p2p)


def evaluate(
    config: ParallelConfig,
    costs: SegmentCosts,
    cluster: Cluster,
    *,
    stage_starts: Sequence[int] | None = None,
    stage_recompute: Sequence[str] | None = None,
    precision: str = "fp32",
    tokens_per_sample: int = 1,
    stage_costs: Sequence[SegmentCosts] | None = None,
    memory_only: bool = False,
) -> TrainingEstimate:
    """Step time and memory of ``config`` with ``costs`` of its (tp, microbatch size)
    (``memory_only``: the memory and feasibility only, the times left at 0 — the search's
    per-stage recomputation choice needs nothing else).

    With heterogeneous sub-meshes (``config.stage_dp``), ``stage_costs[k]`` are the segment costs
    of stage ``k``'s per-device micro-batch (``dp * microbatch_size / stage_dp[k]`` samples)."""
    segs = costs.segments
    nstages = config.pp * config.virtual_stages
    if nstages > len(segs) - 2 and nstages > 1:
        raise ConfigError(f"{nstages} pipeline stages but the model has {len(segs) - 2} blocks: use fewer stages")
    if config.stage_dp is not None and (len(config.stage_dp) != nstages or stage_costs is None):
        raise ConfigError(f"stage_dp needs one degree per stage ({nstages}) and the costs of each stage")
    starts = tuple(stage_starts) if stage_starts is not None else uniform_starts(len(segs), nstages)
    bounds = [*starts, len(segs)]
    rec = list(stage_recompute) if stage_recompute is not None else [config.recompute] * nstages
    bpe = precision_bytes(costs.optimizer, precision)  # bytes per element: weights, grads, optimizer
    priced = [
        _price_stage(
            config,
            (stage_costs[k].segments if stage_costs is not None else segs)[bounds[k] : bounds[k + 1]],
            cluster,
            stage=k,
            segments=(bounds[k], bounds[k + 1]),
            recompute=rec[k],
            bpe=bpe,
            precision=precision,
        )
        for k in range(nstages)
    ]
    stages = tuple(p.estimate for p in priced)
    # memory per pipeline rank: the sum of its stages (interleaving puts v stages on a rank)
    per_rank = [0.0] * config.pp
    for st in stages:
        per_rank[st.rank] += st.memory_bytes
    capacity = float(cluster.device.mem_capacity_bytes)
    peak = max(per_rank)
    if memory_only:
        return TrainingEstimate(
            config=config, step_time_s=0.0, compute_s=0.0, exposed_comm_s=0.0, bubble_s=0.0, optimizer_s=0.0,
            memory_per_device_bytes=tuple(per_rank), capacity_bytes=capacity, tokens_per_s=0.0, mfu=0.0,
            feasible=peak <= capacity, precision=precision, num_blocks=len(segs) - 2, stages=stages,
            p2p_exposed_s=0.0, flops_per_step=0.0,
        )  # fmt: skip
    makespan, compute, bubble, p2p_exposed = _pipeline_times(config, costs, cluster, priced, bounds)
    step = makespan + max(p.sync_exposed_s + p.optimizer_s for p in priced)
    m = config.num_microbatches
    flops = sum(s.flops for s in segs) * m * config.dp
    peak_flops = cluster.device.peak_flops_for(precision_dtype(precision)) * cluster.world_size
    return TrainingEstimate(
        config=config,
        step_time_s=step,
        compute_s=compute,
        exposed_comm_s=m * max(0.0, *(p.tp_comm_s for p in priced))
        + max(p.sync_exposed_s for p in priced)
        + p2p_exposed,
        bubble_s=bubble,
        optimizer_s=max(p.optimizer_s for p in priced),
        memory_per_device_bytes=tuple(per_rank),
        capacity_bytes=capacity,
        tokens_per_s=config.dp * config.microbatch_size * m * tokens_per_sample / step if step > 0 else 0.0,
        mfu=flops / (step * peak_flops) if step > 0 else 0.0,
        feasible=peak <= capacity,
        precision=precision,
        num_blocks=len(segs) - 2,
        stages=stages,
        p2p_exposed_s=p2p_exposed,
        flops_per_step=flops,
    )


__all__ = [
    "SegmentCost",
    "SegmentCosts",
    "StageEstimate",
    "TrainingEstimate",
    "evaluate",
    "group_link",
    "recompute_parts",
    "tp_cluster",
    "uniform_starts",
]
