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
    B_k = sum_{j in K} bwd_s[j] + R_k        R_k = 0 | sum selective_recompute_s | sum full_recompute_s
    A_k = sum_{j in K} a_j                   a_j = saved_bytes | selective_kept_bytes | full_kept_bytes
                                             (recompute none | selective | full: autoplan.passes.recompute)
    S_k = P_k w + T_k (g + o)                P_k parameter elements, T_k of them trainable (not
                                             frozen); w, g, o bytes per element of weights, grads
                                             and optimizer state (autoplan.cost_models.memory, by precision
                                             and optimizer)
          / dp on the parts ZeRO shards       (1: o, 2: o + g, 3: o + g + w; dp * cp with a cp axis)
    ZeRO-3: F_k, B_k = the passes of the communication schedule below (gathers exposed)
    M_k = S_k + inflight_k(schedule, m, v) * A_k + T_k  <=  capacity          (memory)

with ``T_k`` the transient of one segment's backward with what it re-creates and the ZeRO-3 gather
buffer (:func:`autoplan.cost_models.memory.stage_memory_parts`). The step time is the pipeline
makespan of :mod:`autoplan.cost_models.schedule` over the ``(F_k, B_k)`` with point-to-point
transfers of ``cut_bytes`` between stages, plus per stage what the last micro-batch's gradient
synchronisation adds after its backward (below) and the optimizer step::

    T(c) = makespan(F, B, m, schedule, p2p') + drain + max_r (sum_{k on r} (sync_k + opt_k / dp^[zero>=1]) - slack_r)

With the optimizer state offloaded to host memory (``c.offload_optimizer``), ``opt_k`` is the
host's step and the copies around it, not overlapped with compute (:func:`offload_time_s`)::

    opt_k = n g / L + n s / H + n w / L        n = T'_k / dp^[zero>=1] (the rank's shard)

Communication schedule (what the generated program does: :mod:`autoplan.cost_models.comm_schedule`)
--------------------------------------------------------------------------------------------------
A stage's data-parallel collectives are simulated per pass over its segments ``j`` on two
streams, the compute stream and one link (the dp group's; collectives on it run one at a time in
issue order, so concurrent collectives share it). With ``c_j`` the segment's compute in the pass
(``fwd_s``, or ``bwd_s`` + its recomputation), ``g_j`` the time of its parameter all-gather and
``p`` = ``OverlapPolicy.prefetch_blocks``::

    issue(g_0) = 0,  issue(g_j) = start_{max(j-p, 0)}  (prefetch: issued when block j-p starts)
    done(x)    = max(issue(x), link free) + time(x)    (one link, FIFO)
    start_j    = max(end_{j-1}, done(g_j))             (a block waits for its parameters)
    end_j      = start_j + c_j * (1 + s * busy_j)      (compute slows by s = concurrent_compute_factor - 1
                                                        on the fraction busy_j of the block with the
                                                        link busy: the gathers issued before it and
                                                        the reductions its own backward issues)

so the first gather of every pass is exposed and a later one only where the previous block's
compute is shorter than it. ZeRO-3 gathers every segment's weights (``param_numel * w`` bytes) in
every micro-batch's forward and, with ``reshard_after_forward``, again in its backward (and under
full recomputation once more there: the re-run forward gathers its block's weights itself,
:mod:`autoplan.passes.recompute`).
Where the program reduces gradients in its backward (every schedule but zero-bubble; with
several micro-batches each stage's last one's backward adds the earlier ones' sum before each
bucket: :func:`~autoplan.cost_models.comm_schedule.gradients_reduced_in_backward`, the rule the
runtime follows), segment ``j``'s gradient (``trainable_numel * g`` bytes) is cut into ``ceil(bytes / cap)`` equal
pieces produced evenly over its backward, the pieces are grouped by
:func:`~autoplan.cost_models.comm_schedule.gradient_buckets` in backward order (last segment
first; a bucket holds one stage's gradients), and each bucket (all-reduce for ZeRO 0,
reduce-scatter for ZeRO >= 1; latency per bucket) is issued on the link when its last piece
exists (that fraction of the segment's backward compute done), behind whatever the link already
carries (the backward's own all-gathers). The buckets are waited for after the schedule, before
the optimizer step (the stage hands its input gradient on without waiting for them). Then::

    F_k, B_k  = end of the forward / backward pass without reductions (per micro-batch)
    sync_k    = (end of the last backward with its reductions - B_k)        (contention)
              + max(0, last collective done - end of the last backward)     (the exposed tail)
              + the gradients of parameters tied across stages (one reduction, exposed)
              + ZeRO 1-2's all-gather of the updated weights, per bucket    (after the step)

Sharded gradient accumulation (``c.sharded_grad_accumulation``: ``n_c = m`` converting backwards,
:func:`~autoplan.cost_models.comm_schedule.converting_backwards`; else ``n_c = 1``): every
micro-batch's backward is the reducing pass above and its buckets are waited for before the
stage's next backward, so each adds its contention and its exposed tail, ``n_c`` times the
reductions (and the tensor-parallel gradient conversions) of one backward::

    sync_k    = n_c * (contention + exposed tail) + tied + ZeRO 1-2's gathers
    reductions = n_c * sum over buckets (bytes, time)

(exact for gradient accumulation without a pipeline, whose backwards run back to back; with
``pp > 1`` the earlier micro-batches' tails may hide behind other micro-batches' forwards, which
this over-estimates).

where the tail is the larger of the dp link's and the tp link's: tensor-parallel gradient
conversions (``grad_sync_s``) are issued on their own link when their segment's backward ends.
With several stages on a rank (interleaving) their last backwards run one after the other and
all their buckets are waited for after the schedule, so the rank's contention and tail are
simulated as one pass over its stages' segments (:func:`_rank_in_backward_s`), not summed per
stage. Under zero-bubble the runtime sums each stage's raw gradients over the micro-batches and
converts them after the schedule, and nothing runs beside that:
``sync_k = sum(grad_sync_s) + sum(bucket times) + ZeRO 1-2's gathers``, all exposed. A rank
pays its stages' ``sync_k`` and optimizer steps one after the other, from the end of its part
of the schedule, which is ``slack_r`` before the makespan: the last backwards of stages
``r - 1 .. 0`` and the sends between them, on the final chain (0 under zero-bubble)::

    step = makespan + drain + max over ranks r of  (sum_{k on r} (sync_k + optimizer_k) - slack_r)

Pipeline sends of a stage's output (forward) and input gradient (backward) use the dp link when
both cross nodes or both stay inside one. The send runs on its own communicator beside the dp
collectives queued on the link (NCCL runs communicators' kernels concurrently), so the two share
its bandwidth equally: a send of ``s`` issued with ``b`` of dp collectives queued ends after
``s + min(s, b)``, and they end ``min(s, b)`` later. The schedule's transfer time becomes
``p2p' = p2p + the send's wait``. In the last micro-batch's backward a stage's send shares the
link with its reductions the same way, and its wait delays the last backward of every stage
before it: ``drain = sum_k (that wait of stage k)``. On devices whose collectives
do not run beside compute (CPU ranks, :func:`~autoplan.cost_models.comm.overlaps_compute`) every
collective is exposed: ``F_k = sum c + sum g``, reductions after the backward.

The estimate's :class:`~autoplan.cost_models.comm_schedule.CommTotals` lists, for the pipeline rank
with the most exposed communication, every collective of the step per kind and axis: ZeRO-3
gathers, gradient reductions and ZeRO 1-2 gathers (``dp``, and ``ep`` or ``cp`` where the group
has two axes: :class:`_DpGroups`), tensor-parallel conversions
(``redistribute`` on ``tp``: the per-segment sums keep their time, not their kind or bytes, so
its count is the segment passes that have any and its bytes 0; all exposed, they run in the
compute stream, again in the backward under full recomputation) and
pipeline transfers (``send_recv`` on ``pp``). Exposed is the time the compute stream waits
(the compute slowdown counts as compute); ``exposed_comm_s`` is the rows' sum.

Achievable bandwidth: a dp group that crosses nodes with ``r`` of its ranks on each node drives
``r`` NICs at once (NCCL runs one ring channel per NIC), so its link is
``min(r * network bw, intra-node bw)`` (NVIDIA/nccl#412: more NICs give more bandwidth up to the
NVLink bandwidth; NVIDIA/nccl#812: 192 GB/s all-reduce bus bandwidth across DGX A100 nodes with
8 x 200 Gb/s NICs). The catalog links themselves carry NCCL's measured efficiency
(:mod:`autoplan.cost_models.cluster`).

Heterogeneous sub-meshes (``c.stage_dp``): stage ``k`` gets ``d_k * tp`` devices and splits each
micro-batch of ``S = dp * b`` samples ``d_k`` ways (``d_k | S``); its times are those of ``S / d_k``
samples, its gradient synchronisation and ZeRO sharding run over ``d_k``, and a cut is sent by
``d_k`` ranks to ``d_{k+1}`` (the busiest link carries ``1 / min(d_k, d_{k+1})`` of it).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autoplan.cost_models.cluster import Cluster, LinkSpec
from autoplan.cost_models.comm import (
    ROUTING_IMBALANCE,
    expert_exchange_bytes,
    expert_exchange_s,
    link_time_s,
    overlaps_compute,
)
from autoplan.cost_models.comm_schedule import (
    DEFAULT_POLICY,
    CommRow,
    CommTotals,
    OverlapPolicy,
    converting_backwards,
    gradient_buckets,
    gradients_reduced_in_backward,
)
from autoplan.cost_models.compute import concurrent_compute_factor
from autoplan.cost_models.config import ParallelConfig, context_parallel_problem
from autoplan.cost_models.errors import ConfigError
from autoplan.cost_models.hardware import DeviceSpec
from autoplan.cost_models.memory import (
    OPTIMIZER_STEP_BYTES_PER_ELEMENT,
    STATE_ITEMSIZE,
    BackwardTerms,
    ElementBytes,
    device_kind,
    mesh_groups,
    nvlink_multicast,
    precision_bytes,
    rank_memory_parts,
    segment_activation_bytes,
    stage_backward_terms,
    stage_memory_parts,
    stage_numels,
    usable_memory_bytes,
)
from autoplan.cost_models.schedule import (
    StageTimes,
    backward_states,
    fast_step_time,
    inflight_at_rank_peak,
    inflight_microbatches,
)
from autoplan.cost_models.step_parts import StepParts

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
    """Forward time of the ops selective recomputation re-runs in the backward (``R`` of
    :mod:`autoplan.passes.recompute`: the non-matmul ops between the kept values)."""
    full_recompute_s: float
    """The same under full recomputation (``R`` of the ``full`` policy: the block's forward but its
    random ops, its collectives included)."""
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
    selective_kept_bytes: float
    """Activations selective recomputation keeps from the forward to the backward, per micro-batch:
    the storages of ``K`` of :mod:`autoplan.passes.recompute` (matmul outputs, block inputs)."""
    full_kept_bytes: float
    """The same under full recomputation (the segment's output a later block reads, random-op
    outputs)."""
    input_bytes: float
    """Bytes of the values entering the segment from earlier ones."""
    flops: float
    """Forward + backward FLOPs of the segment's ops for the whole (unsharded) micro-batch."""
    shared_input_bytes: float = 0.0
    """Part of ``input_bytes`` that other later segments read too (a causal mask, rotary tables):
    a stage keeps it once."""
    fwd_transient_bytes: float = 0.0
    """Peak bytes the segment's forward holds on top of the saved activations (per micro-batch)."""
    selective_recomputed_bytes: float = 0.0
    """The storages of ``saved_bytes`` selective recomputation does not keep and re-creates in the
    backward (per micro-batch)."""
    selective_bwd_transient_bytes: float = 0.0
    """``bwd_transient_bytes`` under selective recomputation: with the re-created storages alive,
    each from its first backward reader (or the re-run op needing it, if earlier) to its last (per
    micro-batch)."""
    full_recomputed_bytes: float = 0.0
    """``selective_recomputed_bytes`` under full recomputation."""
    full_bwd_transient_bytes: float = 0.0
    """``selective_bwd_transient_bytes`` under full recomputation."""
    bwd_transient_bytes: float = 0.0
    """Peak bytes the segment's backward holds on top of the saved activations and the parameter
    gradients (activation gradients, the loss's fp32 temporaries), per micro-batch."""
    tied_param_numel: int = 0
    """Local elements of parameters the segment reads that an earlier segment holds (a tied
    embedding read again by the lm_head): a stage without that segment keeps its own copy."""
    tied_trainable_numel: int = 0
    tied_param_owner: int = -1
    """The segment that holds the tied parameters (-1: none)."""
    moe_fwd_s: float = 0.0
    """Part of ``fwd_s`` in MoE expert ops (:mod:`autoplan.passes.moe`), their all-to-alls excluded."""
    moe_bwd_s: float = 0.0
    moe_ops: int = 0
    """MoE expert ops in the segment's forward (one per MoE layer)."""
    moe_routed_bytes: float = 0.0
    """Bytes of the rows those ops route on one device per micro-batch (tokens times top-k times a
    row), summed over the ops."""
    experts: int = 0
    """Routed experts per MoE layer (0: none)."""
    expert_numel: int = 0
    """The routed experts' stacked weights among ``param_numel`` (local on the tensor-parallel
    group): what expert parallelism over the data-parallel group (``ParallelConfig.ep``) splits."""
    expert_trainable_numel: int = 0
    grad_sync_bytes: float = 0.0
    """Bytes of the gradients ``grad_sync_s`` converts on the stage mesh (a parameter replicated on
    the tensor/context-parallel axes gets a partial gradient there, all-reduced once per step in
    the runtime's flat buckets, :mod:`autoplan.runtime.pipeline`), the full tensors' bytes."""
    dp_split_numel: int = 0
    """Elements of ``param_numel`` split over groups of ``ParallelConfig.ep`` ranks of the
    data-parallel group instead of replicated or ZeRO-sharded (the experts under ``ep``, set by
    :func:`expert_parallel_costs`): ``1/ep`` on a device, gathered and reduced over the ``dp /
    ep`` replicas only (:class:`_DpGroups`); with ``ep == dp`` held ``1/dp`` whatever the ZeRO
    stage, never gathered, their gradients never reduced."""
    dp_split_trainable_numel: int = 0
    fwd_all_to_all_s: float = 0.0
    """Part of ``fwd_comm_s`` spent in the all-to-alls expert-parallel MoE ops run inside
    (:func:`autoplan.passes.moe.moe_exchanges`)."""
    bwd_all_to_all_s: float = 0.0
    all_to_alls: int = 0
    """How many all-to-alls the segment's forward runs (its backward runs as many)."""
    fwd_all_to_all_bytes: float = 0.0
    """Bytes the forward's all-to-alls send, per micro-batch."""
    bwd_all_to_all_bytes: float = 0.0
    fwd_ring_s: float = 0.0
    """Part of ``fwd_comm_s`` ring attention waits for (:func:`autoplan.passes.ring_attention.ring_exchange`:
    its shifts beyond the blocks they overlap, its zigzag moves)."""
    bwd_ring_s: float = 0.0
    fwd_ring_total_s: float = 0.0
    """Link time of all of the forward ring's transfers (``fwd_ring_s`` of it exposed)."""
    bwd_ring_total_s: float = 0.0
    fwd_ring_bytes: float = 0.0
    bwd_ring_bytes: float = 0.0
    fwd_ring_messages: int = 0
    """Point-to-point messages of the segment's forward rings (its backward's: ``bwd_ring_messages``)."""
    bwd_ring_messages: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class SegmentCosts:
    segments: tuple[SegmentCost, ...]
    cut_bytes: tuple[float, ...]
    """``cut_bytes[k]``: activation bytes per micro-batch crossing the cut after segment ``k``."""
    optimizer: str
    """The optimizer ``optimizer_s`` was priced for; its state's bytes per trainable element
    come from the same name (:func:`autoplan.cost_models.memory.precision_bytes`)."""
    master_weights: bool = True
    """Below fp32, the optimizer steps fp32 master copies with fp32 states (mixed precision);
    False: the model is kept in the step's dtype, states too
    (:func:`autoplan.cost_models.memory.keeps_master_weights`)."""


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
    """Communication not hidden behind compute (``comm.exposed_s``): tensor-parallel collectives,
    ZeRO-3 gathers and gradient synchronisation the compute stream waits for, pipeline
    point-to-point the schedule does not hide."""
    bubble_s: float
    """Idle time of the pipeline schedule (0 without pipeline parallelism)."""
    optimizer_s: float
    """The optimizer step of the slowest stage (with ``config.offload_optimizer``: the host's step
    and the copies to and from it, :func:`offload_time_s`)."""
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
    comm: CommTotals
    """The whole step's communication per kind and mesh axis (``dp``, ``tp``, ``pp``) of the
    pipeline rank with the most exposed: count, bytes, total and exposed time (module docstring);
    ``exposed_comm_s`` is its exposed sum."""
    parts: StepParts = StepParts(compute_s=0.0, exposed_comm_s=0.0)
    """The step in parts that add up to ``step_time_s`` (:class:`StepParts`, :func:`step_parts`)."""

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
            "step_parts": self.parts.to_dict(),
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
            "comm": self.comm.to_list(),
            "comm_total_s": self.comm.total_s,
        }

    def summary(self) -> str:
        gib = 2**30
        lines = [
            f"config: {self.config}",
            f"step time {self.step_time_s * 1e3:.1f} ms = "
            + " + ".join(f"{name} {t * 1e3:.1f} ms" for name, t in self.parts.rows())
            + (" (the optimizer on the host, with the copies to and from it)" if self.config.offload_optimizer else ""),
            f"throughput {self.tokens_per_s:,.0f} tokens/s, MFU {self.mfu:.1%}",
            f"peak memory per device {self.peak_memory_bytes / gib:.2f} GiB of {self.capacity_bytes / gib:.1f} GiB"
            + ("" if self.feasible else "  (DOES NOT FIT)"),
        ]
        note = self.parts.comm_note(self.comm.exposed_s)
        if note:
            lines.insert(2, f"  ({note})")
        if self.config.pp > 1:
            lines.append(f"stages start at segments {list(self.stage_starts)}, recompute {list(self.stage_recompute)}")
        return "\n".join(lines)


# --- topology ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1 << 12)
def group_link(cluster: Cluster, *, stride: int, size: int) -> LinkSpec:
    """Link of a group of ``size`` ranks ``stride`` apart: network if it leaves a node.

    A catalog network link of a group with ``r = devices_per_node / stride`` ranks on each node
    runs ``r`` NICs at once (NCCL gives each NIC its own ring channel), up to the intra-node
    bandwidth (module docstring); a calibrated link is used as measured."""
    spans = cluster.num_nodes > 1 and stride * size > cluster.devices_per_node
    measured = cluster.measured_link(spans_nodes=spans)
    if measured is not None:
        return measured
    link = cluster.catalog_link(spans_nodes=spans)
    rails = min(size, cluster.devices_per_node // stride) if spans else 1
    if rails > 1:
        intra = cluster.catalog_link(spans_nodes=False)
        bw = min(rails * link.bw_GBps, intra.bw_GBps)
        return LinkSpec(bw_GBps=bw, latency_us=link.latency_us, spans_nodes=True)
    return link


def replica_cluster(cluster: Cluster, tp: int, *, cp: int = 1) -> Cluster:
    """The group one data-parallel replica of a stage places its ops on, as a cluster: the
    tensor-parallel group as one node (keeps a calibrated intra-node link); with context
    parallelism (``ParallelConfig.cp``) the ``cp x tp`` mesh (axes ``cp``, ``tp``): a part of one
    node, or ``cp`` whole nodes when ``tp`` is a node (the ``cp`` axis then crosses them)."""
    if cp == 1:
        return cluster.group(num_nodes=1, devices_per_node=tp)
    n, dpn = cp * tp, cluster.devices_per_node
    problem = context_parallel_problem(cp, tp, devices_per_node=dpn)
    if problem:
        raise ConfigError(problem)
    nodes, per_node = (n // dpn, dpn) if n > dpn else (1, n)
    return cluster.group(num_nodes=nodes, devices_per_node=per_node, mesh_shape=(cp, tp), mesh_axis_names=("cp", "tp"))


# --- precision --------------------------------------------------------------------------------


def precision_dtype(precision: str) -> str:
    return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[precision]


def precision_opt_factor(precision: str) -> float:
    """Optimizer step bytes relative to fp32 training (mixed precision also writes the bf16 copy)."""
    return 1.0 if precision == "fp32" else 1.1


def offload_time_s(device: DeviceSpec, element: ElementBytes, shard_numel: float) -> float:
    """Seconds the optimizer step of ``shard_numel`` trained elements takes with its state in
    host memory (``ParallelConfig.offload_optimizer``; ZeRO-Offload's placement, Ren et al.,
    USENIX ATC 2021), as ``autoplan.runtime.optimizers.OffloadedOptimizer`` runs it: the
    gradients to the host, the step there, the updated weights back, one after the other and
    after the backward (no overlap with compute)::

        offload_s = n g / L  +  n s / H  +  n w / L
        s = OPTIMIZER_STEP_BYTES_PER_ELEMENT[optimizer]              (the fp32 step on the host)
            + (g + 4) + (4 + w)   when w < 4                         (gradient to fp32, master to w)

    ``g``, ``w``: bytes per element of gradients and weights; ``L`` the host link
    (``DeviceSpec.host_link_GBps``), ``H`` host memory (``host_mem_bw_GBps``). A device without a
    host link is its own host (CPU ranks): the copies run in its memory, ``L = mem_bw / 2`` (a
    copy reads and writes), ``H = mem_bw``."""
    link_Bps = (device.host_link_GBps or device.mem_bw_GBps / 2) * 1e9
    host_Bps = (device.host_mem_bw_GBps or device.mem_bw_GBps) * 1e9
    g, w = element.grads, element.weights
    convert = (g + STATE_ITEMSIZE) + (STATE_ITEMSIZE + w) if w < STATE_ITEMSIZE else 0
    step_bytes = OPTIMIZER_STEP_BYTES_PER_ELEMENT[element.optimizer_name] + convert
    return shard_numel * (g + w) / link_Bps + shard_numel * step_bytes / host_Bps


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
        extra_transient = max(0.0, seg.selective_bwd_transient_bytes - seg.bwd_transient_bytes)
        return seg.selective_recompute_s, seg.selective_kept_bytes, extra_transient
    extra_transient = max(0.0, seg.full_bwd_transient_bytes - seg.bwd_transient_bytes)
    return seg.full_recompute_s, seg.full_kept_bytes, extra_transient


# --- the communication schedule of one stage (module docstring) -------------------------------


class _Link:
    """One link: collectives run on it one at a time, in the order they are issued."""

    __slots__ = ("busy", "cursor", "free_s")

    def __init__(self) -> None:
        self.free_s = 0.0
        self.busy: list[tuple[float, float]] = []
        """Busy intervals, in time order (each starts after the previous one ends)."""
        self.cursor = 0
        """First interval that may still overlap the compute stream (its starts only grow)."""

    def run(self, issue_s: float, time_s: float) -> float:
        """Queue a collective of ``time_s`` issued at ``issue_s``; returns when it is done."""
        start = max(issue_s, self.free_s)
        self.free_s = start + time_s
        if time_s > 0.0:
            self.busy.append((start, self.free_s))
        return self.free_s

    def compute_end(self, start_s: float, work_s: float, slow: float) -> float:
        """End of ``work_s`` of compute started at ``start_s``, running ``1 + slow`` times
        slower while the link is busy."""
        if slow <= 0.0 or work_s <= 0.0:
            return start_s + work_s
        t, left, busy = start_s, work_s, self.busy
        while self.cursor < len(busy) and busy[self.cursor][1] <= t:
            self.cursor += 1
        for i in range(self.cursor, len(busy)):
            a, b = busy[i]
            if a > t:  # idle until a
                if left <= a - t:
                    return t + left
                left, t = left - (a - t), a
            if left * (1 + slow) <= b - t:  # busy until b
                return t + left * (1 + slow)
            left, t = left - (b - t) / (1 + slow), b
        return t + left


@dataclass(frozen=True, slots=True)
class _Pass:
    """One forward or backward pass of a stage over its segments (module docstring)."""

    end_s: float
    """When the compute stream finishes the pass."""
    compute_s: float
    """Of which computing (the slowdown included); the rest is waiting for gathers."""
    gather_wait_s: float
    done_s: float
    """When the last collective issued in the pass before its end (gathers, reductions) is done."""
    send_wait_s: float
    """How long the pipeline send at the end of the pass waited behind them on the link."""


def _run_pass(
    compute_s: Sequence[float],
    gather_s: Sequence[float],
    *,
    overlap: bool,
    slow: float,
    prefetch: int,
    reductions: Sequence[tuple[int, float, float]] = (),
    send_s: float = 0.0,
) -> _Pass:
    """Simulate a pass: block ``j`` computes ``compute_s[j]`` after its gather of ``gather_s[j]``
    (0: none); ``reductions`` are ``(block, fraction of its compute, time)`` in issue order, and
    ``send_s`` a pipeline send on the same link at the end (module docstring). Without ``overlap``
    every collective blocks the compute stream."""
    if not overlap or (not reductions and send_s <= 0.0 and not any(gather_s)):
        # every collective blocks the compute stream (or there is none)
        end = sum(compute_s) + sum(gather_s)
        done = end + sum(r[2] for r in reductions)
        return _Pass(end_s=end, compute_s=sum(compute_s), gather_wait_s=sum(gather_s), done_s=done, send_wait_s=0.0)
    link = _Link()
    n = len(compute_s)
    gather_done = [0.0] * n
    issued = 0
    t = waits = 0.0
    r = 0
    for j in range(n):
        while issued < n and issued <= j + prefetch:  # block j's start issues block j+p's gather
            if gather_s[issued] > 0.0:
                gather_done[issued] = link.run(t if issued <= j else max(t, gather_done[j]), gather_s[issued])
            issued += 1
        start = max(t, gather_done[j])
        waits += start - t
        t, done_frac = start, 0.0  # the block's compute up to each reduction's issue, then the rest
        while r < len(reductions) and reductions[r][0] == j:
            t = link.compute_end(t, (reductions[r][1] - done_frac) * compute_s[j], slow)
            done_frac = reductions[r][1]
            link.run(t, reductions[r][2])
            r += 1
        t = link.compute_end(t, (1.0 - done_frac) * compute_s[j], slow)
    # the send shares the link with the collectives still queued on it (module docstring)
    backlog = max(0.0, link.free_s - t)
    send_wait = min(send_s, backlog)
    done = t + backlog + send_wait
    return _Pass(end_s=t, compute_s=t - waits, gather_wait_s=waits, done_s=done, send_wait_s=send_wait)


@dataclass(frozen=True, slots=True)
class _StageComm:
    """A stage's passes with its data-parallel communication (module docstring)."""

    fwd_s: float
    bwd_s: float
    """Per micro-batch forward and backward of the schedule (exposed gathers included)."""
    compute_s: float
    """Per micro-batch compute of the forward and backward (gathers' waits excluded)."""
    sync_s: float
    """What the last micro-batch adds after its backward: contention, the exposed tail of the
    reductions (``in_backward_s``), ZeRO 1-2's gather of the updated weights."""
    in_backward_s: float
    """Of ``sync_s``, what the reductions issued in the last backward add (contention and
    exposed tail; 0 when the gradients are reduced after the schedule)."""
    last_pass: _LastPass | None
    """The last backward's inputs when it reduces gradients (:func:`_rank_in_backward_s`)."""
    send_wait_s: tuple[float, float]
    """Waits of the pipeline sends at the end of the forward and of the backward (steady state)."""
    drain_wait_s: float
    """Wait of the last micro-batch's backward send behind the reductions on a shared link: the
    previous stage's last backward starts that much later."""
    rows: tuple[CommRow, ...]
    """The stage's collectives over the step, on ``dp`` and ``tp``."""


@dataclass(frozen=True, slots=True)
class _LastPass:
    """A stage's last backward as :func:`_run_pass` simulates it: per segment (backward order)
    compute and gather times, its gradient buckets and tensor-parallel gradient conversions."""

    compute_s: tuple[float, ...]
    gather_s: tuple[float, ...]
    reductions: tuple[tuple[int, float, float], ...]
    tp_sync_s: tuple[float, ...]


@functools.lru_cache(maxsize=1 << 12)
def _rank_in_backward_s(passes: tuple[_LastPass, ...], *, overlap: bool, slow: float, prefetch: int) -> float:
    """What a rank's stages' in-backward reductions add after its part of the schedule, with
    several stages on the rank (interleaving): their last backwards run one after the other (the
    highest stage first, as the schedule drains) and every bucket is waited for only after the
    schedule, so the rank's buckets queue on one link beside all of them: simulated as one pass
    over the stages' segments (the other micro-batches' work between them, which hides more, is
    left out: an over-estimate)."""
    compute: list[float] = []
    gather: list[float] = []
    reductions: list[tuple[int, float, float]] = []
    tp_sync: list[float] = []
    for p in passes:
        reductions += [(j + len(compute), frac, t) for j, frac, t in p.reductions]
        compute += p.compute_s
        gather += p.gather_s
        tp_sync += p.tp_sync_s
    bare = _run_pass(compute, gather, overlap=overlap, slow=slow, prefetch=prefetch)
    last = _run_pass(compute, gather, overlap=overlap, slow=slow, prefetch=prefetch, reductions=reductions)
    tail = max(last.done_s - last.end_s, _tp_sync_tail(tp_sync, compute, overlap))
    return (last.end_s - bare.end_s) + tail


def _pieces(nbytes: float, cap: float) -> int:
    return max(1, math.ceil(nbytes / cap)) if cap > 0 else 1


@functools.lru_cache(maxsize=4096)
def _bucket_plan(grad_bytes: tuple[float, ...], policy: OverlapPolicy) -> tuple[tuple[int, float, float], ...]:
    """The gradient buckets of a backward over segments with ``grad_bytes`` (backward order):
    ``(segment, fraction of its backward when the bucket's last piece exists, bytes)`` (module
    docstring). Memoised: the search prices the same stages for many configurations."""
    owner: list[tuple[int, float]] = []
    sizes: list[float] = []
    for j, nbytes in enumerate(grad_bytes):
        if nbytes <= 0:
            continue
        k = _pieces(nbytes, policy.bucket_cap_bytes)
        owner += [(j, (i + 1) / k) for i in range(k)]
        sizes += [nbytes / k] * k
    return tuple((*owner[bucket[-1]], sum(sizes[i] for i in bucket)) for bucket in gradient_buckets(sizes, policy))


def _reductions(
    grad_bytes: Sequence[float], policy: OverlapPolicy, time_of: Callable[[float], float]
) -> tuple[list[tuple[int, float, float]], list[float]]:
    """:func:`_bucket_plan` with each bucket's time (``time_of`` its bytes) instead of its bytes,
    and the buckets' bytes."""
    plan = _bucket_plan(tuple(grad_bytes), policy)
    times: dict[float, float] = {}
    out = []
    for j, frac, nbytes in plan:
        if nbytes not in times:
            times[nbytes] = time_of(nbytes)
        out.append((j, frac, times[nbytes]))
    return out, [b[2] for b in plan]


@dataclass(frozen=True, slots=True)
class _DpGroups:
    """The data-parallel collectives of a stage whose ``dp`` ranks are ``tp`` apart: over one
    group, or over two axes one after the other, as DTensor converts a placement on both
    (full-size bytes ``B``, ring convention; ``r`` ranks on the outer axis, ``k`` on the inner)::

        all_reduce      t_r(B) + t_k(B)
        reduce_scatter  t_r(B) + t_k(B / r)        all_gather  t_k(B / r) + t_r(B)

    The two axes are those of :meth:`ParallelConfig.stage_mesh`:

    * routed experts split over groups of ``1 < ep < dp`` consecutive ranks
      (``ParallelConfig.ep``): axes ``dp`` of ``r = dp / ep`` replicas, ``ep * tp`` apart, and
      ``ep``. The experts' weights and gradients (``1 / ep`` of them on a rank) are gathered and
      reduced over the ``r`` replicas only (:meth:`expert_time_of`; ``None`` with ``ep`` 1 or
      ``dp``: they never leave their rank);
    * context parallelism (``ParallelConfig.cp > 1``): axes ``dp`` of ``r = dp`` replicas,
      ``cp * tp`` apart, and ``cp``, ``tp`` apart. Every parameter is whole on ``cp`` and its
      gradient a partial sum there (each rank saw a part of the sequence), so ZeRO shards and
      the gradients are reduced over the ``dp x cp`` ranks (torchtitan's FSDP over ``dp_shard x
      cp``, Megatron-Core's distributed optimizer over ``dp x cp``)."""

    cluster: Cluster
    tp: int
    dp: int
    ep: int
    cp: int = 1

    @property
    def split(self) -> bool:
        """Whether the routed experts are split over groups smaller than dp (``1 < ep < dp``)."""
        return 1 < self.ep < self.dp

    @property
    def ranks(self) -> int:
        """Ranks of the whole group: ``dp``, times ``cp`` with context parallelism."""
        return self.dp * self.cp

    def _steps(self, kind: str) -> tuple[tuple[str, int, int, float], ...]:
        """``(axis, ranks, stride, share of the bytes)`` of each step of a dense ``kind``
        collective (the class docstring's table); the first is the outer axis (the experts'
        replicas where they are split)."""
        if self.split:
            r, k, inner = self.dp // self.ep, self.ep, "ep"
        elif self.cp > 1:
            r, k, inner = self.dp, self.cp, "cp"
        else:
            return (("dp", self.dp, self.tp, 1.0),)
        if r == 1:
            return ((inner, k, self.tp, 1.0),)
        return ("dp", r, self.tp * k, 1.0), (inner, k, self.tp, 1.0 if kind == "all_reduce" else 1.0 / r)

    def _time(self, kind: str, nbytes: float, ranks: int, stride: int) -> float:
        link = group_link(self.cluster, stride=stride, size=ranks)
        return link_time_s(kind, nbytes, ranks, link, backend=self.cluster.backend)

    def time_of(self, kind: str) -> Callable[[float], float]:
        """Seconds of a ``kind`` collective of the dense parameters over the whole dp group."""
        steps = self._steps(kind)
        return lambda nbytes: sum(self._time(kind, nbytes * share, n, stride) for _, n, stride, share in steps)

    def expert_time_of(self, kind: str) -> Callable[[float], float] | None:
        """Seconds of a ``kind`` collective of the experts' shards over their replicas."""
        if not self.split:
            return None
        _, n, stride, _ = self._steps(kind)[0]
        return lambda nbytes: self._time(kind, nbytes, n, stride)

    def rows(
        self, kind: str, dense: Sequence[float], experts: Sequence[float], *, times: int, total_s: float,
        exposed_s: float,
    ) -> list[CommRow]:
        """The rows of ``times`` runs of ``kind`` collectives of ``dense`` and ``experts`` bytes
        (one per bucket or block; 0: none) that take ``total_s``, ``exposed_s`` of it waited for:
        one row on a group of one axis, else one per axis (each collective of the dense
        parameters runs on both), the times in proportion to each axis's link time."""
        steps = self._steps(kind)
        if len(steps) == 1:
            sizes = [b for b in (*dense, *experts) if b > 0]
            return [CommRow(kind=kind, axis=steps[0][0], count=times * len(sizes), bytes=times * sum(sizes),
                            total_s=total_s, exposed_s=exposed_s)]  # fmt: skip
        per_axis = []  # (axis, sizes, link seconds); the experts' shards on the replicas' axis only
        for j, (axis, n, stride, share) in enumerate(steps):
            sizes = [b * share for b in dense if b > 0] + ([b for b in experts if b > 0] if j == 0 else [])
            per_axis.append((axis, sizes, sum(self._time(kind, b, n, stride) for b in sizes)))
        whole = sum(t for _, _, t in per_axis)
        return [
            CommRow(kind=kind, axis=axis, count=times * len(sizes), bytes=times * sum(sizes),
                    total_s=total_s * t / whole, exposed_s=exposed_s * t / whole)  # fmt: skip
            for axis, sizes, t in per_axis
            if sizes and whole > 0
        ]


@functools.lru_cache(maxsize=1 << 14)
def _stage_comm(
    part: tuple[SegmentCost, ...],
    cluster: Cluster,
    *,
    tp: int,
    dp: int,
    num_microbatches: int,
    zero_stage: int,
    bpe: ElementBytes,
    recompute: str,
    policy: OverlapPolicy,
    send_s: tuple[float, float] = (0.0, 0.0),
    reduced_in_backward: bool = True,
    apart_numel: tuple[int, ...] = (),
    copies_numel: int = 0,
    ep: int = 1,
    cp: int = 1,
    group: str = "tp",
    converting: int = 1,
) -> _StageComm:
    """Simulate the stage's forward and backward passes with ZeRO-3's gathers, and the last
    micro-batch's backward with the gradient reductions (``converting`` of the backwards run
    them, :func:`~autoplan.cost_models.comm_schedule.converting_backwards`: each adds its
    contention and exposed tail, the earlier ones' waited for before the stage's next backward) (``send_s``: the pipeline sends at the
    end of the forward and of the backward when they share the dp link, else 0). Without
    ``reduced_in_backward`` (:func:`~autoplan.cost_models.comm_schedule.gradients_reduced_in_backward`)
    the runtime converts the accumulated gradients after the schedule: every reduction and
    tensor-parallel gradient conversion is exposed, one after the other. ``apart_numel`` (per
    segment, of its ``trainable_numel``) and ``copies_numel`` (the stage's copies of parameters
    tied to another stage): elements whose gradients are reduced after the schedule in any case,
    one collective, exposed. ``ep``: the experts' split, ``cp``: the context-parallel ranks
    that the parameters are reduced and ZeRO-sharded over beside ``dp`` (:class:`_DpGroups`).
    ``tp``: the tensor-parallel degree; the replica's own collectives (on ``cp x tp``) have rows
    named ``group`` (:func:`_tp_rows`). Memoised: the search
    prices the same stage under many schedules. (long: a signature of 20 keyword arguments; the body is one pass over the stage's collectives)"""
    m, n_c = num_microbatches, converting
    assert n_c == 1 or reduced_in_backward, "several converting backwards need the reductions in the backward"
    apart = apart_numel or (0,) * len(part)
    fwd_c = [s.fwd_s for s in part]
    bwd_c = [s.bwd_s + recompute_parts(s, recompute)[0] for s in part][::-1]  # backward order
    overlap = overlaps_compute(cluster.device)
    slow = concurrent_compute_factor(cluster.device) - 1.0 if overlap else 0.0  # compute's slowdown beside comm
    groups = _DpGroups(cluster, tp=tp, dp=dp, ep=ep, cp=cp)
    rows = _tp_rows(part, m=m, recompute=recompute, overlap=overlap, expert_axis="ep" if groups.split else "dp",
                    group=group, converting=n_c)  # fmt: skip
    tp_sync = [s.grad_sync_s for s in part][::-1]
    if groups.ranks == 1:
        fwd = _run_pass(fwd_c, [0.0] * len(part), overlap=overlap, slow=slow, prefetch=policy.prefetch_blocks)
        bwd = _run_pass(bwd_c, [0.0] * len(part), overlap=overlap, slow=slow, prefetch=policy.prefetch_blocks)
        tail = _tp_sync_tail(tp_sync, bwd_c, overlap and reduced_in_backward)
        passed = _LastPass(tuple(bwd_c), (0.0,) * len(part), (), tuple(tp_sync)) if reduced_in_backward else None
        return _StageComm(
            fwd_s=fwd.end_s, bwd_s=bwd.end_s, compute_s=fwd.compute_s + bwd.compute_s, sync_s=n_c * tail,
            in_backward_s=tail if reduced_in_backward else 0.0, last_pass=passed,
            send_wait_s=(0.0, 0.0), drain_wait_s=0.0, rows=tuple(rows),
        )  # fmt: skip
    time_of, z = groups.time_of, zero_stage
    (gather_bytes, gather_e, gather_f), (reductions, bucket_bytes, expert_buckets) = _dp_collectives(
        part, groups, zero_stage=z, bpe=bpe, policy=policy, apart=apart
    )
    regather = recompute == "full"  # the re-run forward gathers its block's weights again
    gather_b = [g * (policy.reshard_after_forward + regather) for g in gather_f[::-1]]
    red_kind = "all_reduce" if z == 0 else "reduce_scatter"
    apart_bytes = (sum(apart) + copies_numel) * bpe.grads
    apart_s = time_of(red_kind)(apart_bytes) if apart_bytes > 0 else 0.0
    pre = policy.prefetch_blocks
    fwd = _run_pass(fwd_c, gather_f, overlap=overlap, slow=slow, prefetch=pre, send_s=send_s[0])
    bwd = _run_pass(bwd_c, gather_b, overlap=overlap, slow=slow, prefetch=pre, send_s=send_s[1])
    if reduced_in_backward:  # the buckets are waited for after the schedule, before the optimizer
        last = _run_pass(
            bwd_c, gather_b, overlap=overlap, slow=slow, prefetch=pre, reductions=reductions, send_s=send_s[1]
        )
        tail = max(last.done_s - last.end_s, _tp_sync_tail(tp_sync, bwd_c, overlap))
    else:  # after the schedule: the tensor-parallel conversions, then the buckets, nothing beside them
        last = bwd
        tail = sum(tp_sync) + sum(r[2] for r in reductions)
    after_rows = _zero12_gathers(part, z, bpe, policy, groups)
    after = sum(r.total_s for r in after_rows)
    # the rows: totals of every collective of the step; exposed = what the compute stream waits
    # for, the gathers' share first (a gather can wait behind a reduction on the link)
    # (n_c of the m backwards are the reducing pass ``last``: its gathers' waits and its tail)
    gathers_total = m * (sum(gather_f) + sum(gather_b))
    reduce_total = n_c * sum(r[2] for r in reductions)
    waited = m * fwd.gather_wait_s + (m - n_c) * bwd.gather_wait_s + n_c * last.gather_wait_s
    gathers_exposed = min(gathers_total, waited)
    in_backward = min(reduce_total, waited - gathers_exposed + n_c * max(0.0, last.done_s - last.end_s))
    reduce_exposed = (in_backward if reduced_in_backward else reduce_total) + apart_s
    reduce_total += apart_s
    if gathers_total > 0:
        passes = 1 + policy.reshard_after_forward + regather
        rows += groups.rows("all_gather", gather_bytes, gather_e, times=m * passes, total_s=gathers_total,
                            exposed_s=gathers_exposed)  # fmt: skip
    if reductions or apart_s > 0:
        rows += groups.rows(red_kind, [*bucket_bytes, apart_bytes], expert_buckets, times=n_c,
                            total_s=reduce_total, exposed_s=reduce_exposed)  # fmt: skip
    rows += after_rows
    return _StageComm(
        fwd_s=fwd.end_s, bwd_s=bwd.end_s, compute_s=fwd.compute_s + bwd.compute_s,
        sync_s=n_c * ((last.end_s - bwd.end_s) + tail) + apart_s + after,
        in_backward_s=(last.end_s - bwd.end_s) + tail if reduced_in_backward else 0.0,
        last_pass=_LastPass(tuple(bwd_c), tuple(gather_b), tuple(reductions), tuple(tp_sync)) if reduced_in_backward else None,
        send_wait_s=(fwd.send_wait_s, bwd.send_wait_s),
        drain_wait_s=last.send_wait_s if reduced_in_backward else 0.0, rows=tuple(rows),
    )  # fmt: skip


def _dp_collectives(
    part: Sequence[SegmentCost], groups: _DpGroups, *, zero_stage: int, bpe: ElementBytes, policy: OverlapPolicy,
    apart: Sequence[int],
) -> tuple[tuple[list[float], list[float], list[float]], tuple[list[tuple[int, float, float]], list[float], list[float]]]:
    """A stage's data-parallel collectives per micro-batch (:func:`_stage_comm`): per segment the
    ZeRO-3 gather bytes of the dense parameters and of the experts' shards and their time; the
    gradient reductions ``(segment, fraction, seconds)`` in backward order with the dense and the
    experts' bucket bytes. Full-size byte counts (:mod:`autoplan.cost_models.comm`'s ring
    convention); the experts' shards (``1/ep`` on a rank) are gathered and reduced over their
    replicas where ``ep < dp`` (their own buckets: another mesh axis, in the order they fill)."""
    z, ep, experts_of = zero_stage, groups.ep, groups.expert_time_of
    gather_bytes = [(s.param_numel - s.dp_split_numel) * bpe.weights if z >= 3 else 0.0 for s in part]
    expert_gather = experts_of("all_gather")
    gather_e = [s.dp_split_numel / ep * bpe.weights if z >= 3 and expert_gather else 0.0 for s in part]
    gather_f = [
        (groups.time_of("all_gather")(b) if b > 0 else 0.0) + (expert_gather(e) if expert_gather and e > 0 else 0.0)
        for b, e in zip(gather_bytes, gather_e, strict=True)
    ]
    red_kind = "all_reduce" if z == 0 else "reduce_scatter"
    grad_bytes = [
        (s.trainable_numel - s.dp_split_trainable_numel - a) * bpe.grads for s, a in zip(part, apart, strict=True)
    ][::-1]
    reductions, bucket_bytes = _reductions(grad_bytes, policy, groups.time_of(red_kind))
    expert_reduce, expert_buckets = experts_of(red_kind), list[float]()
    if expert_reduce is not None:
        grads_e = [s.dp_split_trainable_numel / ep * bpe.grads for s in part][::-1]
        more, expert_buckets = _reductions(grads_e, policy, expert_reduce)
        reductions = sorted(reductions + more, key=lambda r: r[:2])
    return (gather_bytes, gather_e, gather_f), (reductions, bucket_bytes, expert_buckets)


def _zero12_gathers(
    part: Sequence[SegmentCost], zero_stage: int, bpe: ElementBytes, policy: OverlapPolicy, groups: _DpGroups
) -> list[CommRow]:
    """ZeRO 1-2: the updated weights all-gathered after the optimizer step, per bucket, exposed
    (none: another stage, or nothing trained); the experts' shards over their replicas where
    the group is split (:class:`_DpGroups`)."""
    if not 1 <= zero_stage < 3:
        return []
    weights = [float(s.trainable_numel - s.dp_split_trainable_numel) * bpe.weights for s in part]
    buckets, dense = _reductions(weights[::-1], policy, groups.time_of("all_gather"))
    expert_time, shards = groups.expert_time_of("all_gather"), list[float]()
    if expert_time is not None:
        more, shards = _reductions([s.dp_split_trainable_numel / groups.ep * bpe.weights for s in part][::-1],
                                   policy, expert_time)  # fmt: skip
        buckets += more
    if not buckets:
        return []
    total = sum(b[2] for b in buckets)
    return groups.rows("all_gather", dense, shards, times=1, total_s=total, exposed_s=total)


def expert_parallel_costs(costs: SegmentCosts, config: ParallelConfig, cluster: Cluster) -> SegmentCosts:
    """``costs`` (solved on the tensor-parallel group, every expert local) with the routed experts
    split over groups of ``config.ep`` consecutive ranks of the data-parallel group, each rank
    holding ``experts / ep`` of every MoE layer (GShard's expert parallelism; torchtitan's and
    Megatron-Core's ``ep``): per segment with ``n`` MoE ops routing ``r`` bytes,

        a2a_f = n * exchange(r / n, forward)      a2a_b = n * exchange(r / n, backward)
        fwd_s += a2a_f + (imbalance - 1) * moe_fwd_s      bwd_s += a2a_b + (imbalance - 1) * moe_bwd_s
        full_recompute_s += a2a_f + (imbalance - 1) * moe_fwd_s    (the re-run forward exchanges again)

    ``exchange``: :func:`~autoplan.cost_models.comm.expert_exchange_s` on the expert group's link,
    the op's blocking all-to-alls (``*_comm_s`` and the ``all_to_all`` row); ``imbalance``:
    :data:`~autoplan.cost_models.comm.ROUTING_IMBALANCE` (a rank computes the rows routed to its
    experts, the busiest rank sets the time). The experts' weights become ``dp_split_numel``:
    ``1/ep`` of them on a rank, their gradients complete within the group (each rank saw every
    token of its group routed to its experts), so reduced only over the ``dp / ep`` replicas
    (:class:`_DpGroups`; never where ``ep == dp``); under ZeRO 0 the optimizer step updates
    ``1/ep`` of them (ZeRO >= 1 already divides the whole step by dp)."""
    if config.ep == 1:
        return costs
    return _expert_parallel_costs(costs, ep=config.ep, tp=config.tp, zero_stage=config.zero_stage, cluster=cluster)


@functools.lru_cache(maxsize=256)
def _expert_parallel_costs(costs: SegmentCosts, *, ep: int, tp: int, zero_stage: int, cluster: Cluster) -> SegmentCosts:
    """:func:`expert_parallel_costs` of the fields it reads (memoised: the search prices the same
    costs under many schedules and micro-batch counts)."""
    link = group_link(cluster, stride=tp, size=ep)
    segments = []
    for s in costs.segments:
        if not s.moe_ops and not s.expert_numel:
            segments.append(s)
            continue
        per_op = s.moe_routed_bytes / max(s.moe_ops, 1)
        a2a_f, a2a_b = (
            s.moe_ops * expert_exchange_s(per_op, s.experts, ep, link, backward=b) for b in (False, True)
        )
        exchanges = [expert_exchange_bytes(per_op, s.experts, backward=b) for b in (False, True)]
        bytes_f, bytes_b = (s.moe_ops * sum(e) for e in exchanges)
        slow_f, slow_b = (ROUTING_IMBALANCE - 1) * s.moe_fwd_s, (ROUTING_IMBALANCE - 1) * s.moe_bwd_s
        held = s.trainable_numel - s.expert_trainable_numel * (1 - 1 / ep)
        opt = (
            s.optimizer_s * held / s.trainable_numel if zero_stage == 0 and s.trainable_numel else s.optimizer_s
        )
        segments.append(
            dataclasses.replace(
                s,
                fwd_s=s.fwd_s + a2a_f + slow_f,
                bwd_s=s.bwd_s + a2a_b + slow_b,
                fwd_comm_s=s.fwd_comm_s + a2a_f,
                bwd_comm_s=s.bwd_comm_s + a2a_b,
                fwd_all_to_all_s=s.fwd_all_to_all_s + a2a_f,
                bwd_all_to_all_s=s.bwd_all_to_all_s + a2a_b,
                all_to_alls=s.all_to_alls + len(exchanges[0]) * s.moe_ops,
                fwd_all_to_all_bytes=s.fwd_all_to_all_bytes + bytes_f,
                bwd_all_to_all_bytes=s.bwd_all_to_all_bytes + bytes_b,
                full_recompute_s=s.full_recompute_s + a2a_f + slow_f,
                optimizer_s=opt,
                dp_split_numel=s.expert_numel,
                dp_split_trainable_numel=s.expert_trainable_numel,
            )  # fmt: skip
        )
    return dataclasses.replace(costs, segments=tuple(segments))


def _tp_sync_tail(tp_sync: Sequence[float], bwd_c: Sequence[float], overlap: bool) -> float:
    """Exposed part of the tensor-parallel gradient conversions (``grad_sync_s``, backward order):
    each issued on the tp link when its segment's backward ends, waited for before the optimizer."""
    if not overlap:
        return sum(tp_sync)
    link, t = _Link(), 0.0
    for c, g in zip(bwd_c, tp_sync, strict=True):
        t += c
        link.run(t, g)
    return max(0.0, link.free_s - t)


def _per_step(
    part: Sequence[SegmentCost], *, m: int, recompute: str, fwd: Callable[[SegmentCost], float],
    bwd: Callable[[SegmentCost], float],
) -> float:
    """A per-segment forward and backward quantity summed over the step's passes: ``m``
    micro-batches' forwards (twice under full recomputation: the backward re-runs it) and backwards."""
    passes = 3 if recompute == "full" else 2
    return m * sum(fwd(s) * (passes - 1) + bwd(s) for s in part)


def _tp_rows(
    part: Sequence[SegmentCost], *, m: int, recompute: str, overlap: bool, expert_axis: str = "dp", group: str = "tp",
    converting: int = 1,
) -> list[CommRow]:
    """Tensor-parallel conversions of the step: the segments' forward and backward collectives in
    every micro-batch (the forward's again under full recomputation), all in the compute stream,
    and the gradient conversions once per converting backward (``converting``:
    :func:`~autoplan.cost_models.comm_schedule.converting_backwards`; hidden as
    :func:`_tp_sync_tail` says). The all-to-alls of
    expert-parallel MoE ops (inside the op, blocking) get their own row, on ``expert_axis``
    (``dp``, or ``ep`` for groups smaller than dp) where the experts are split over the
    data-parallel group (:func:`expert_parallel_costs`). ``group``: the axis the rows of the
    segments' own collectives name, ``tp``, or ``cp+tp`` when a context-parallel axis shares the
    replica's ILP with it (the segment costs sum both axes' collectives: one row each kind)."""
    passes = 3 if recompute == "full" else 2

    def per_step(fwd: Callable[[SegmentCost], float], bwd: Callable[[SegmentCost], float]) -> float:
        return _per_step(part, m=m, recompute=recompute, fwd=fwd, bwd=bwd)

    a2a_total = per_step(lambda s: s.fwd_all_to_all_s, lambda s: s.bwd_all_to_all_s)
    ring_exposed = per_step(lambda s: s.fwd_ring_s, lambda s: s.bwd_ring_s)
    total = per_step(lambda s: s.fwd_comm_s, lambda s: s.bwd_comm_s) - a2a_total - ring_exposed
    count = m * sum(
        (passes - 1) * (s.fwd_comm_s > s.fwd_all_to_all_s + s.fwd_ring_s)
        + (s.bwd_comm_s > s.bwd_all_to_all_s + s.bwd_ring_s)
        for s in part
    )
    rows = []
    if total > 0:
        rows.append(CommRow(kind="redistribute", axis=group, count=count, bytes=0.0, total_s=total, exposed_s=total))
    ring_total = per_step(lambda s: s.fwd_ring_total_s, lambda s: s.bwd_ring_total_s)
    if ring_total > 0:  # ring attention: its exposed part is in the compute stream, the rest beside its blocks
        rows.append(
            CommRow(kind="send_recv", axis=group, count=int(per_step(lambda s: s.fwd_ring_messages, lambda s: s.bwd_ring_messages)),
                    bytes=per_step(lambda s: s.fwd_ring_bytes, lambda s: s.bwd_ring_bytes), total_s=ring_total,
                    exposed_s=min(ring_exposed, ring_total))  # fmt: skip
        )
    if a2a_total > 0:
        n = m * sum(s.all_to_alls * passes for s in part)
        nbytes = m * sum(s.fwd_all_to_all_bytes * (passes - 1) + s.bwd_all_to_all_bytes for s in part)
        axis = expert_axis if any(s.dp_split_numel for s in part) else group  # expert_parallel_costs: over dp
        rows.append(
            CommRow(kind="all_to_all", axis=axis, count=n, bytes=nbytes, total_s=a2a_total, exposed_s=a2a_total)
        )
    sync = [s.grad_sync_s for s in part][::-1]
    if sum(sync) > 0:
        bwd = [s.bwd_s + recompute_parts(s, recompute)[0] for s in part][::-1]
        exposed = min(sum(sync), _tp_sync_tail(sync, bwd, overlap))
        rows.append(CommRow(kind="redistribute", axis=group, count=converting * sum(1 for g in sync if g > 0),
                            bytes=0.0, total_s=converting * sum(sync), exposed_s=converting * exposed))  # fmt: skip
    return rows


@dataclass(frozen=True, slots=True)
class _StagePrice:
    """One stage's share of :func:`evaluate`: its times for the schedule, its estimate (memory
    included), and what the step adds after the pipeline drains."""

    times: StageTimes
    estimate: StageEstimate
    sync_exposed_s: float
    """What the last micro-batch's gradient synchronisation adds after its backward (contention,
    the exposed tail, ZeRO 1-2's all-gather after the step, tied parameters' reductions)."""
    optimizer_s: float
    compute_s: float
    """Per micro-batch compute of the forward and backward (waits for gathers excluded)."""
    comm: _StageComm | None
    """The stage's simulated communication (``None`` for memory-only estimates)."""
    backward: BackwardTerms | None = None
    """Its backward's terms for the rank's schedule (:func:`rank_memory_parts`; several stages on
    the rank only)."""


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


def _rank_inflight(
    config: ParallelConfig, parts: Sequence[Sequence[SegmentCost]], recompute: Sequence[str]
) -> list[int]:
    """Per stage, the micro-batches it holds at its pipeline rank's activation peak: with
    interleaving (``virtual_stages > 1``) the rank's ``v`` stages hold different counts at that
    moment, weighted by each stage's kept bytes per micro-batch
    (:func:`~autoplan.cost_models.schedule.inflight_at_rank_peak`; at least 1, the stage's own
    backward peak needs one); otherwise :func:`_inflight` (one stage per rank)."""
    nstages = len(parts)
    if config.virtual_stages == 1 or config.pp == 1:
        return [_inflight(config, k % config.pp) for k in range(nstages)]
    out = [1] * nstages
    for rank in range(config.pp):
        mine = list(range(rank, nstages, config.pp))
        kept = [
            sum(segment_activation_bytes(s, recompute[k])[0] for s in parts[k]) for k in mine
        ]  # fmt: skip
        counts = inflight_at_rank_peak(
            config.pipeline_schedule, rank, config.pp, config.num_microbatches, config.virtual_stages, kept
        )
        for k, n in zip(mine, counts, strict=True):
            out[k] = max(1, n)
    return out


@functools.lru_cache(maxsize=1 << 14)
def _stage_memory_parts(**kwargs: Any) -> dict[str, float]:
    """:func:`~autoplan.cost_models.memory.stage_memory_parts`, memoised: the search prices the same
    stage (the same blocks, recomputation, ZeRO and micro-batches in flight) for every schedule,
    split and candidate that has it. The caller copies the dict it returns."""
    return stage_memory_parts(**kwargs)


@functools.lru_cache(maxsize=1 << 14)
def _stage_backward_terms(**kwargs: Any) -> BackwardTerms:
    """:func:`~autoplan.cost_models.memory.stage_backward_terms`, memoised as :func:`_stage_memory_parts`."""
    return stage_backward_terms(**kwargs)


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
    policy: OverlapPolicy,
    send_s: tuple[float, float] = (0.0, 0.0),
    memory_only: bool = False,
    tied: tuple[tuple[int, ...], int] = ((), 0),
    inflight: int | None = None,
) -> _StagePrice:
    """Times, memory and data-parallel communication of stage ``stage`` (segments ``part``;
    ``send_s``: its pipeline sends that share the dp link; ``tied``: its parameters tied to
    another stage, :func:`_tied_apart`; ``inflight``: its micro-batches in flight at its rank's
    peak, :func:`_rank_inflight`, else :func:`_inflight`; :func:`_stage_comm`)."""
    rank = stage % config.pp
    dp = config.dp_of(rank)
    fwd = sum(s.fwd_s for s in part)
    extra = saved = transient = 0.0
    for s in part:
        e, a, t = recompute_parts(s, recompute)
        extra, saved, transient = extra + e, saved + a, max(transient, t)
    bwd = sum(s.bwd_s for s in part) + extra
    comm = None
    in_backward = gradients_reduced_in_backward(
        num_stages=config.pp * config.virtual_stages, num_microbatches=config.num_microbatches,
        schedule=config.schedule,
    )  # fmt: skip
    converting = converting_backwards(
        num_microbatches=config.num_microbatches, sharded_grad_accumulation=config.sharded_grad_accumulation
    )
    if not memory_only:
        comm = _stage_comm(
            tuple(part), cluster, tp=config.tp, dp=dp, num_microbatches=config.num_microbatches,
            zero_stage=config.zero_stage, bpe=bpe, recompute=recompute, policy=policy, send_s=send_s,
            reduced_in_backward=in_backward, apart_numel=tied[0], copies_numel=tied[1], ep=config.ep, cp=config.cp,
            group="cp+tp" if config.cp > 1 else "tp", converting=converting,
        )  # fmt: skip
        fwd, bwd = comm.fwd_s, comm.bwd_s
    z = config.zero_stage
    memory_kwargs: dict[str, Any] = dict(
        segments=tuple(part),
        recompute=recompute,
        element=bpe,
        zero_stage=z,
        dp=dp * config.cp,  # ZeRO shards and the gradients are reduced over dp x cp (_DpGroups)
        ep=config.ep,
        inflight=_inflight(config, rank) if inflight is None else inflight,
        num_microbatches=config.num_microbatches,
        # (first_segment matters only to a segment reading a tied parameter: one memo entry for the rest)
        first_segment=segments[0] if any(s.tied_param_owner >= 0 for s in part) else 0,
        device_kind=device_kind(cluster.device),
        policy=policy,
        reduced_in_backward=in_backward,
        converting_backwards=converting,
        offload_optimizer=config.offload_optimizer,
        host_is_device=cluster.device.host_link_GBps is None,
        last_stage=stage == config.pp * config.virtual_stages - 1,
    )
    parts = _stage_memory_parts(**memory_kwargs)
    # several stages on the rank: its backwards are priced against the schedule (rank_memory_parts)
    backward = _stage_backward_terms(**memory_kwargs) if config.virtual_stages > 1 and config.pp > 1 else None
    parts = dict(parts)  # the estimate's own copy of the memoised parts
    shards = dp * config.cp if z >= 1 else 1
    if config.offload_optimizer:
        optimizer_s = offload_time_s(cluster.device, bpe, stage_numels(part, segments[0])[1] / shards)
    else:
        optimizer_s = sum(s.optimizer_s for s in part) * precision_opt_factor(precision) / shards
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
        sync_exposed_s=comm.sync_s if comm is not None else 0.0,
        optimizer_s=optimizer_s,
        compute_s=comm.compute_s if comm is not None else fwd + bwd,
        comm=comm,
        backward=backward,
    )


# --- the step ---------------------------------------------------------------------------------


def _rank_after(
    config: ParallelConfig, priced: Sequence[_StagePrice], cluster: Cluster, policy: OverlapPolicy,
    p2p_s: Sequence[float],
) -> tuple[list[float], list[float]]:
    """Per pipeline rank, what its step adds after the schedule's makespan, and its optimizer
    time. After its part of the schedule a rank waits for its stages' gradient reductions and
    steps their optimizer, one stage after the other (interleaving puts v stages on a rank; their
    in-backward reductions share one link: :func:`_rank_in_backward_s`). Rank ``r``'s part ends
    before the makespan by its slack, the last backwards of the stages before it on the final
    chain (stages ``r - 1 .. 0``) and the sends between them (not under zero-bubble, whose W
    passes may run there)."""
    after, optimizer = [0.0] * config.pp, [0.0] * config.pp
    overlap = overlaps_compute(cluster.device)
    slow = concurrent_compute_factor(cluster.device) - 1.0 if overlap else 0.0
    for r in range(config.pp):
        mine = sorted((p for p in priced if p.estimate.rank == r), key=lambda p: -p.estimate.segments[0])
        for p in mine:
            after[r] += p.sync_exposed_s + p.optimizer_s
            optimizer[r] += p.optimizer_s
        passes = [p.comm.last_pass for p in mine if p.comm is not None and p.comm.last_pass is not None]
        if len(passes) > 1:  # the stages' in-backward reductions, simulated together
            after[r] += _rank_in_backward_s(
                tuple(passes), overlap=overlap, slow=slow, prefetch=policy.prefetch_blocks
            ) - sum(p.comm.in_backward_s for p in mine if p.comm is not None)
        if config.schedule != "zero-bubble":
            after[r] -= _slack_s(priced, p2p_s, r)  # (rank 0 has none: the step never ends before the makespan)
    return after, optimizer


def _slack_s(priced: Sequence[_StagePrice], p2p_s: Sequence[float], rank: int) -> float:
    """How long before the makespan pipeline rank ``rank``'s part of the schedule ends: the last
    backwards of the stages before it on the final chain and the sends between them (not under
    zero-bubble: :func:`_rank_after`)."""
    return sum(priced[s].estimate.bwd_s + (p2p_s[s] if s < len(p2p_s) else 0.0) for s in range(rank))


def step_parts(
    config: ParallelConfig,
    priced: Sequence[_StagePrice],
    *,
    blocking_s: Sequence[float],
    p2p_s: Sequence[float],
    makespan_s: float,
    bubble_s: float,
    drain_s: float,
    after: Sequence[float],
    optimizer: Sequence[float],
    step_time_s: float,
) -> StepParts:
    """The step ``makespan + drain + max(after)`` of :func:`evaluate` in the parts of
    :class:`StepParts` (its docstring gives the cut). ``blocking_s[k]``: stage ``k``'s collectives
    in the compute stream over the step (part of its compute, :func:`_per_step` of the segments'
    ``fwd_comm_s`` and ``bwd_comm_s``); ``after`` and ``optimizer``: per pipeline rank, from
    :func:`_rank_after`; ``bubble_s``: the schedule's idle time without transfers (:func:`_pipeline_times`)."""
    m, pp = config.num_microbatches, config.pp
    busy, compute, blocking = [0.0] * pp, [0.0] * pp, [0.0] * pp
    for p, b in zip(priced, blocking_s, strict=True):
        busy[p.estimate.rank] += m * (p.estimate.fwd_s + p.estimate.bwd_s)
        compute[p.estimate.rank] += m * p.compute_s
        blocking[p.estimate.rank] += b
    rb = max(range(pp), key=busy.__getitem__)  # the busiest rank: the schedule's critical path
    work = min(compute[rb], busy[rb])
    in_stream = min(blocking[rb], work)
    waits = busy[rb] - work  # its compute stream's waits for gathers
    idle = max(0.0, makespan_s - busy[rb])
    bubble = min(max(bubble_s, 0.0), idle)
    rl = max(range(pp), key=after.__getitem__)  # the rank that finishes last (evaluate's max(after))
    tail = max(0.0, after[rl])
    slack = _slack_s(priced, p2p_s, rl) if config.schedule != "zero-bubble" else 0.0
    sync = after[rl] + slack - optimizer[rl]  # its gradient synchronisation, before its optimizer steps
    sync_tail = min(tail, max(0.0, sync - slack))
    exposed = in_stream + waits + (idle - bubble) + max(0.0, drain_s) + sync_tail
    optimizer_tail = tail - sync_tail
    compute_part = step_time_s - exposed - bubble - optimizer_tail
    assert compute_part >= -1e-9 * max(step_time_s, 1e-12), f"step parts exceed the step: {compute_part}"
    return StepParts(
        compute_s=max(0.0, compute_part), exposed_comm_s=exposed, bubble_s=bubble, optimizer_s=optimizer_tail
    )


@dataclass(frozen=True, slots=True)
class _Transfer:
    """The pipeline send across one cut (per micro-batch and direction)."""

    time_s: float
    bytes: float
    """Bytes over the busiest link."""
    spans_nodes: bool


def _rank_communicators(
    config: ParallelConfig, tied: Sequence[tuple[tuple[int, ...], int]], devices_per_node: int
) -> list[tuple[tuple[tuple[int, int], ...], int]]:
    """Per pipeline rank, the process groups its program runs collectives in (``(ranks, ranks on
    its node)`` each) and the ranks it sends to point to point
    (:func:`autoplan.cost_models.memory.non_pytorch_bytes`): the groups of the device mesh
    ``(pp, *stage mesh)`` (the runtime's, ``autoplan.api``;
    :func:`~autoplan.cost_models.memory.mesh_groups`), the group summing a tied parameter's
    gradients on the pipeline ranks holding a copy (``autoplan.runtime.pipeline``, two ranks: the
    first and the last stage), and the pipeline neighbours: the previous and the next rank (one
    at either end of a non-interleaved pipeline; an interleaved one loops from the last rank back
    to the first)."""
    pp = config.pp
    groups = mesh_groups((pp, *config.stage_mesh()[0]), devices_per_node)
    out = []
    for r in range(pp):
        holds_tied = pp > 1 and any(any(t[0]) or t[1] for k, t in enumerate(tied) if k % pp == r)
        if pp == 1:
            peers = 0
        elif config.virtual_stages > 1:
            peers = min(2, pp - 1)
        else:
            peers = (r > 0) + (r < pp - 1)
        out.append(((*groups, *(((2, 1),) if holds_tied else ())), peers))
    return out


def _tied_apart(segs: Sequence[SegmentCost], bounds: Sequence[int]) -> list[tuple[tuple[int, ...], int]]:
    """Per stage (segments ``bounds[k]:bounds[k+1]``), the parameters tied across stages that its
    gradients hold: per segment the elements of its ``trainable_numel`` another stage also reads,
    and the elements of the copies it holds of another stage's parameters. Their gradients are
    converted after the schedule (:func:`~autoplan.cost_models.comm_schedule.gradients_reduced_in_backward`)."""
    stage_of = [k for k in range(len(bounds) - 1) for _ in range(bounds[k], bounds[k + 1])]
    apart = [[0] * (bounds[k + 1] - bounds[k]) for k in range(len(bounds) - 1)]
    copies = [0] * (len(bounds) - 1)
    for i, s in enumerate(segs):
        owner = s.tied_param_owner
        if 0 <= owner < len(segs) and s.tied_trainable_numel and stage_of[owner] != stage_of[i]:
            k = stage_of[owner]
            copies[stage_of[i]] += s.tied_trainable_numel
            apart[k][owner - bounds[k]] = max(apart[k][owner - bounds[k]], s.tied_trainable_numel)
    return [(tuple(a), c) for a, c in zip(apart, copies, strict=True)]


def _kept_sends(
    config: ParallelConfig, costs: SegmentCosts, bounds: Sequence[int], rank: int
) -> list[tuple[float, float]]:
    """Per stage of pipeline rank ``rank``, the bytes per device of one micro-batch's forward send
    (its output) and backward send (its input's gradient) where the schedule keeps every send
    until the step ends (torch's ``_PipelineScheduleRuntime``: interleaved 1F1B, zero-bubble;
    ``rank_memory_parts``); none for GPipe and 1F1B, which wait for each send soon after it."""
    if config.pipeline_schedule not in ("interleaved-1f1b", "zero-bubble"):
        return []
    nstages = len(bounds) - 1
    dp = config.dp_of(rank)
    return [
        (
            costs.cut_bytes[bounds[k + 1] - 1] * config.dp / dp if k < nstages - 1 else 0.0,
            costs.cut_bytes[bounds[k] - 1] * config.dp / dp if k > 0 else 0.0,
        )
        for k in range(rank, nstages, config.pp)
    ]


def _p2p(
    config: ParallelConfig, costs: SegmentCosts, cluster: Cluster, cut: int, stage: int, offsets: list[int]
) -> _Transfer:
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
    link = cluster.measured_link(spans_nodes=spans) or cluster.catalog_link(spans_nodes=spans)
    share = total / min(config.dp_of(a), config.dp_of(b))
    return _Transfer(
        time_s=link_time_s("send_recv", share, 2, link, backend=cluster.backend), bytes=share, spans_nodes=spans
    )


def _shared_sends(
    config: ParallelConfig, cluster: Cluster, p2p: Sequence[_Transfer], stage: int
) -> tuple[float, float]:
    """Times of the pipeline sends of ``stage`` (its output in the forward, its input gradient in
    the backward) that run on its dp link (both cross nodes or both stay in one), else 0."""
    dp = config.dp_of(stage % config.pp)
    if dp == 1 or not overlaps_compute(cluster.device):
        return 0.0, 0.0
    spans = group_link(cluster, stride=config.ranks_per_replica, size=dp).spans_nodes
    out = p2p[stage].time_s if stage < len(p2p) and p2p[stage].spans_nodes == spans else 0.0
    back = p2p[stage - 1].time_s if stage > 0 and p2p[stage - 1].spans_nodes == spans else 0.0
    return out, back


def _pipeline_times(
    config: ParallelConfig, priced: Sequence[_StagePrice], p2p_s: Sequence[float]
) -> tuple[float, float, float, float]:
    """``(makespan, busiest rank's compute, bubble, exposed p2p)`` of the schedule over the stages
    with transfers of ``p2p_s`` per cut."""
    m = config.num_microbatches
    busy, compute = [0.0] * config.pp, [0.0] * config.pp
    for p in priced:
        busy[p.estimate.rank] += m * (p.estimate.fwd_s + p.estimate.bwd_s)
        compute[p.estimate.rank] += m * p.compute_s
    if config.pp == 1:
        return max(busy), max(compute), 0.0, 0.0
    stage_times = [p.times for p in priced]
    schedule, pp, v = config.pipeline_schedule, config.pp, config.virtual_stages
    makespan = fast_step_time(stage_times, schedule, m, num_ranks=pp, p2p_s=list(p2p_s), virtual_stages=v)
    free_p2p = fast_step_time(stage_times, schedule, m, num_ranks=pp, p2p_s=0.0, virtual_stages=v)
    return makespan, max(compute), max(0.0, free_p2p - max(busy)), max(0.0, makespan - free_p2p)


def _step_comm(
    config: ParallelConfig, priced: Sequence[_StagePrice], p2p: Sequence[_Transfer], p2p_exposed_s: float
) -> CommTotals:
    """The whole step's communication of the pipeline rank with the most exposed: its stages'
    rows and its pipeline sends (each cut is crossed by every micro-batch forward and back)."""
    m = config.num_microbatches
    per_rank: list[list[CommRow]] = [[] for _ in range(config.pp)]
    for p in priced:
        if p.comm is not None:
            per_rank[p.estimate.rank] += p.comm.rows
    for rank, rows in enumerate(per_rank):
        sends = [p2p[k] for k in range(len(p2p)) if k % config.pp == rank] + [
            p2p[k - 1] for k in range(1, len(p2p) + 1) if k % config.pp == rank
        ]
        if sends:
            total = m * sum(t.time_s for t in sends)
            rows.append(CommRow(kind="send_recv", axis="pp", count=m * len(sends), bytes=m * sum(t.bytes for t in sends),
                                total_s=total, exposed_s=min(total, p2p_exposed_s)))  # fmt: skip
    worst = max(range(config.pp), key=lambda r: sum(row.exposed_s for row in per_rank[r]))
    return CommTotals.merge(per_rank[worst])


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
    policy: OverlapPolicy | None = None,
) -> TrainingEstimate:
    """Step time and memory of ``config`` with ``costs`` of its (tp, microbatch size)
    (``memory_only``: the memory and feasibility only, the times left at 0 — the search's
    per-stage recomputation choice needs nothing else).

    With heterogeneous sub-meshes (``config.stage_dp``), ``stage_costs[k]`` are the segment costs
    of stage ``k``'s per-device micro-batch (``dp * microbatch_size / stage_dp[k]`` samples).
    ``policy``: the program's overlap (default :data:`~autoplan.cost_models.comm_schedule.DEFAULT_POLICY`, what the runtime runs).

    (long: one pass over the stages composing time, memory and the communication account of the
    same configuration; the parts are the helpers above)"""
    costs = expert_parallel_costs(costs, config, cluster)
    segs = costs.segments
    nstages = config.pp * config.virtual_stages
    if nstages > len(segs) - 2 and nstages > 1:
        raise ConfigError(f"{nstages} pipeline stages but the model has {len(segs) - 2} blocks: use fewer stages")
    if config.stage_dp is not None and (len(config.stage_dp) != nstages or stage_costs is None):
        raise ConfigError(f"stage_dp needs one degree per stage ({nstages}) and the costs of each stage")
    starts = tuple(stage_starts) if stage_starts is not None else uniform_starts(len(segs), nstages)
    bounds = [*starts, len(segs)]
    rec = list(stage_recompute) if stage_recompute is not None else [config.recompute] * nstages
    bpe = precision_bytes(costs.optimizer, precision, master_weights=costs.master_weights)  # weights, grads, optimizer
    pol = DEFAULT_POLICY if policy is None else policy
    tied = _tied_apart(segs, bounds)
    # first device of each stage's sub-mesh (Megatron order; stage sub-meshes are contiguous)
    offsets = list(
        itertools.accumulate((config.dp_of(k % config.pp) * config.ranks_per_replica for k in range(config.pp)), initial=0)
    )
    p2p = (
        [] if memory_only else [_p2p(config, costs, cluster, bounds[k + 1] - 1, k, offsets) for k in range(nstages - 1)]
    )
    parts = [(stage_costs[k].segments if stage_costs is not None else segs)[bounds[k] : bounds[k + 1]] for k in range(nstages)]
    inflight = _rank_inflight(config, parts, rec)
    priced = [
        _price_stage(
            config,
            parts[k],
            cluster,
            stage=k,
            segments=(bounds[k], bounds[k + 1]),
            recompute=rec[k],
            bpe=bpe,
            precision=precision,
            policy=pol,
            send_s=(0.0, 0.0) if memory_only else _shared_sends(config, cluster, p2p, k),
            memory_only=memory_only,
            tied=tied[k],
            inflight=inflight[k],
        )
        for k in range(nstages)
    ]
    stages = tuple(p.estimate for p in priced)
    # memory per pipeline rank: its stages combined (interleaving puts v stages on a rank)
    kind = device_kind(cluster.device)
    per_rank = [
        sum(rank_memory_parts(
            [st.memory_parts for st in stages if st.rank == r], kind,
            backwards=[b for p in priced if p.estimate.rank == r and (b := p.backward) is not None],
            states=backward_states(config.pipeline_schedule, r, config.pp, config.num_microbatches,
                                   config.virtual_stages) if config.virtual_stages > 1 else (),
            sends=_kept_sends(config, costs, bounds, r),
        ).values())
        for r in range(config.pp)
    ]  # fmt: skip
    multicast = nvlink_multicast(cluster.device)
    room = [
        usable_memory_bytes(cluster.device.mem_capacity_bytes, kind, groups, peers, multicast=multicast)
        for groups, peers in _rank_communicators(config, tied, cluster.devices_per_node)
    ]
    tightest = min(range(config.pp), key=lambda r: room[r] - per_rank[r])
    capacity, peak = room[tightest], per_rank[tightest]
    if memory_only:
        return TrainingEstimate(
            config=config, step_time_s=0.0, compute_s=0.0, exposed_comm_s=0.0, bubble_s=0.0, optimizer_s=0.0,
            memory_per_device_bytes=tuple(per_rank), capacity_bytes=capacity, tokens_per_s=0.0, mfu=0.0,
            feasible=peak <= capacity, precision=precision, num_blocks=len(segs) - 2, stages=stages,
            p2p_exposed_s=0.0, flops_per_step=0.0, comm=CommTotals(),
        )  # fmt: skip
    # a send that shares the dp link waits behind its collectives (the forward's at the sender,
    # the backward's at the receiver of the forward send)
    p2p_s = [
        t.time_s + max(c.send_wait_s[0], d.send_wait_s[1])
        for t, c, d in zip(p2p, (p.comm for p in priced[:-1]), (p.comm for p in priced[1:]), strict=True)
        if c is not None and d is not None
    ]
    makespan, compute, bubble, p2p_exposed = _pipeline_times(config, priced, p2p_s)
    # the last backward sends wait behind the reductions, and each delays the stages before it
    drain = sum(p.comm.drain_wait_s for p in priced if p.comm is not None)
    after, optimizer = _rank_after(config, priced, cluster, pol, p2p_s)
    step = makespan + drain + max(after)
    m = config.num_microbatches
    flops = sum(s.flops for s in segs) * m * config.dp
    peak_flops = cluster.device.peak_flops_for(precision_dtype(precision)) * cluster.world_size
    comm = _step_comm(config, priced, p2p, p2p_exposed + drain)
    blocking = [
        _per_step(parts[k], m=m, recompute=rec[k], fwd=lambda s: s.fwd_comm_s, bwd=lambda s: s.bwd_comm_s)
        for k in range(nstages)
    ]
    step_in_parts = step_parts(
        config, priced, blocking_s=blocking, p2p_s=p2p_s, makespan_s=makespan, bubble_s=bubble, drain_s=drain,
        after=after, optimizer=optimizer, step_time_s=step,
    )  # fmt: skip
    return TrainingEstimate(
        config=config,
        step_time_s=step,
        compute_s=compute,
        exposed_comm_s=comm.exposed_s,
        bubble_s=bubble,
        optimizer_s=max(optimizer),
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
        comm=comm,
        parts=step_in_parts,
    )


__all__ = [
    "SegmentCost",
    "SegmentCosts",
    "StageEstimate",
    "TrainingEstimate",
    "evaluate",
    "group_link",
    "offload_time_s",
    "recompute_parts",
    "replica_cluster",
    "step_parts",
    "uniform_starts",
]
