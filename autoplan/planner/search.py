r"""Pass — pipeline search: stages x schedule x micro-batches x recomputation x ZeRO, with the
intra-operator ILP inside.

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
buffer. The step time is the pipeline makespan of :mod:`autoplan.cost_models.schedule` over the
``(F_k, B_k)`` with point-to-point transfers of ``cut_bytes`` between stages, plus per stage the
exposed gradient synchronisation (all-reduce over dp, or reduce-scatter + per micro-batch
all-gathers for ZeRO-3; on devices that overlap communication the part hidden behind the last
micro-batch's backward is not counted) and the optimizer step::

    T(c) = makespan(F, B, m, schedule, p2p) + max_k (exposed_sync_k + opt_k / dp^[zero>=1])

Heterogeneous sub-meshes (Alpa's stage-to-mesh assignment, restricted to data parallelism):
stage ``k`` may get ``d_k * tp`` devices with ``sum_k d_k = pp * dp`` and splits each micro-batch
of ``S = dp * b`` samples ``d_k`` ways (``d_k | S``); its times are those of ``S / d_k`` samples,
its gradient synchronisation and ZeRO sharding run over ``d_k``, and a cut is sent by ``d_k``
ranks to ``d_{k+1}`` (the busiest link carries ``1 / min(d_k, d_{k+1})`` of it). Boundaries and
degrees together minimise the slowest stage (:func:`hetero_split`, a dynamic program over
stages x segments x devices); the candidate keeps it when the full evaluation is faster.

The outer search enumerates every ``c`` (pp | world, tp | devices per node, b with
``B % (dp b) == 0``, schedules, v, recompute, ZeRO) and, per ``c``, the stage boundaries that
minimise the slowest stage (min-max contiguous partition by dynamic programming) next to the
uniform split; the recomputation may differ per stage (the least that fits). It returns the
feasible ``c`` with the smallest ``T(c)``, visiting candidates by increasing lower bound
``m * sum_j (fwd_s[j] + bwd_s[j]) / pp`` and stopping once the bound exceeds the best step
found. ILP solves are memoised per (tp, b): the search calls :func:`SegmentCostFn` once per
distinct pair.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autoplan.cost_models.cluster import Cluster, LinkSpec
from autoplan.cost_models.comm import link_time_s, overlaps_compute
from autoplan.cost_models.config import RECOMPUTE, SCHEDULES, ParallelConfig, Recompute, Schedule, schedule_problem
from autoplan.cost_models.errors import ConfigError, InfeasiblePlanError
from autoplan.cost_models.memory import precision_bytes
from autoplan.cost_models.schedule import StageTimes, fast_step_time, inflight_microbatches
from autoplan.planner.segment_costs import SegmentCost, SegmentCostOracle, SegmentCosts

SegmentCostFn = Callable[[int, int], SegmentCosts]
"""``(tp, microbatch_size) -> SegmentCosts`` of one micro-batch on a tensor-parallel group."""


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
class PipelineEstimate:
    config: ParallelConfig
    stages: tuple[StageEstimate, ...]
    step_time_s: float
    compute_s: float
    """Busy compute time of the slowest pipeline rank (forward + backward + recompute)."""
    bubble_s: float
    p2p_exposed_s: float
    exposed_comm_s: float
    """Tensor-parallel collectives inside the stages + exposed gradient sync + p2p."""
    optimizer_s: float
    memory_per_rank_bytes: tuple[float, ...]
    """Per pipeline rank: the memory of its stages (interleaving puts several on a rank)."""
    peak_memory_bytes: float
    """Largest per-device memory over the pipeline ranks."""
    capacity_bytes: float
    flops_per_step: float
    mfu: float
    tokens_per_s: float
    feasible: bool
    note: str = ""

    @property
    def stage_starts(self) -> tuple[int, ...]:
        return tuple(s.segments[0] for s in self.stages)


@dataclass(slots=True)
class SearchSpace:
    """What the outer search may choose (defaults: everything)."""

    schedules: tuple[Schedule, ...] = SCHEDULES
    virtual_stages: tuple[int, ...] = (2, 4)
    recompute: tuple[Recompute, ...] = RECOMPUTE
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    microbatch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    balanced_stages: bool = True
    per_stage_recompute: bool = True
    hetero_stages: bool = True
    """Also give stages sub-meshes of different sizes (:func:`hetero_layout`)."""
    fixed: ParallelConfig | None = None
    """Only this configuration (as :meth:`ParallelConfig.canonical` writes it); the search then
    places its stage boundaries."""


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


# --- composing one configuration --------------------------------------------------------------


def expand_blocks(costs: SegmentCosts, num_blocks: int) -> SegmentCosts:
    """Costs of the same model with ``num_blocks`` identical blocks, from a trace with fewer:
    the last traced block stands for every block (the first one may differ: it reads the
    prologue's outputs), prologue and epilogue stay."""
    traced_blocks = len(costs.segments) - 2
    if traced_blocks == num_blocks:
        return costs
    if traced_blocks < 1:
        raise ConfigError("the model has no repeated blocks to expand")
    segs = list(costs.segments)
    block = segs[-2]
    blocks = (
        segs[1:-1] + [block] * (num_blocks - traced_blocks) if num_blocks > traced_blocks else segs[1 : 1 + num_blocks]
    )
    cuts = list(costs.cut_bytes)
    mid_cut = cuts[-2] if len(cuts) >= 2 else cuts[0]
    new_cuts = [cuts[0]] + [mid_cut] * (num_blocks - 1) + [cuts[-1]]
    return dataclasses.replace(costs, segments=(segs[0], *blocks, segs[-1]), cut_bytes=tuple(new_cuts))


def _uniform_starts(num_segments: int, num_stages: int) -> tuple[int, ...]:
    """Megatron's split: blocks divided evenly; the prologue joins the first stage and the
    epilogue the last."""
    num_blocks = num_segments - 2
    per, extra = divmod(num_blocks, num_stages)
    starts, at = [0], 1
    for k in range(num_stages - 1):
        at += per + (1 if k < extra else 0)
        starts.append(at)
    return tuple(starts)


def _balanced_starts(weights: Sequence[float], num_stages: int) -> tuple[int, ...]:
    """Contiguous split of ``weights`` into ``num_stages`` non-empty parts minimising the largest
    part (dynamic programming, O(n^2 k)); each stage holds at least one block. Memoised: the
    search asks for the same (segment times, stages) once per schedule and micro-batch count."""
    return _balanced_starts_cached(tuple(weights), num_stages)


@functools.lru_cache(maxsize=4096)
def _balanced_starts_cached(weights: tuple[float, ...], num_stages: int) -> tuple[int, ...]:
    n = len(weights)
    prefix = [0.0, *itertools.accumulate(weights)]
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    arg = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                # stage k covers [i, j); every stage needs a block: not only prologue or epilogue
                if (i == 0 and j == 1) or (i == n - 1 and j == n):
                    continue
                cost = max(best[k - 1][i], prefix[j] - prefix[i])
                if cost < best[k][j]:
                    best[k][j], arg[k][j] = cost, i
    if best[num_stages][n] == inf:
        return _uniform_starts(n, num_stages)
    starts, j = [], n
    for k in range(num_stages, 0, -1):
        i = arg[k][j]
        starts.append(i)
        j = i
    return tuple(reversed(starts))


def _recompute_parts(seg: SegmentCost, recompute: str) -> tuple[float, float, float]:
    """(extra backward time, saved bytes per micro-batch, transient bytes) of one segment."""
    if recompute == "none":
        return 0.0, seg.saved_bytes, 0.0
    if recompute == "selective":
        kept = min(seg.saved_bytes, seg.saved_matmul_bytes + seg.input_bytes)
        return seg.selective_recompute_s, kept, seg.saved_bytes - kept
    return seg.fwd_s, min(seg.saved_bytes, seg.input_bytes), seg.saved_bytes


def evaluate(
    cand: ParallelConfig,
    costs: SegmentCosts,
    cluster: Cluster,
    *,
    stage_starts: Sequence[int] | None = None,
    stage_recompute: Sequence[str] | None = None,
    precision: str = "fp32",
    tokens_per_sample: int = 1,
    stage_costs: Sequence[SegmentCosts] | None = None,
    memory_only: bool = False,
) -> PipelineEstimate:
    """Step time and memory of ``cand`` with ``costs`` of its (tp, microbatch size)
    (``memory_only``: the memory and feasibility only, the times left at 0 — the search's
    per-stage recomputation choice needs nothing else).

    With heterogeneous sub-meshes (``cand.stage_dp``), ``stage_costs[k]`` are the segment costs
    of stage ``k``'s per-device micro-batch (``dp * microbatch_size / stage_dp[k]`` samples)."""
    segs = costs.segments
    nstages = cand.pp * cand.virtual_stages
    if nstages > len(segs) - 2 and nstages > 1:
        raise ConfigError(f"{nstages} pipeline stages but the model has {len(segs) - 2} blocks: use fewer stages")
    if cand.stage_dp is not None and (len(cand.stage_dp) != nstages or stage_costs is None):
        raise ConfigError(f"stage_dp needs one degree per stage ({nstages}) and the costs of each stage")
    starts = tuple(stage_starts) if stage_starts is not None else _uniform_starts(len(segs), nstages)
    bounds = [*starts, len(segs)]
    rec = list(stage_recompute) if stage_recompute is not None else [cand.recompute] * nstages
    bpe = precision_bytes(costs.optimizer, precision)  # bytes per element: weights, grads, optimizer
    m = cand.num_microbatches
    device = cluster.device
    overlap = overlaps_compute(device)
    backend = cluster.backend
    # first device of each stage's sub-mesh (Megatron order; stage sub-meshes are contiguous)
    offsets = list(itertools.accumulate((cand.dp_of(k % cand.pp) * cand.tp for k in range(cand.pp)), initial=0))

    stage_times: list[StageTimes] = []
    stages: list[StageEstimate] = []
    sync_exposed: list[float] = []
    opt_s: list[float] = []
    tp_comm = 0.0
    for k in range(nstages):
        dp = cand.dp_of(k % cand.pp)
        dp_link = group_link(cluster, stride=cand.tp, size=dp)
        part = (stage_costs[k].segments if stage_costs is not None else segs)[bounds[k] : bounds[k + 1]]
        fwd = sum(s.fwd_s for s in part)
        extra = saved = transient = 0.0
        for s in part:
            e, a, t = _recompute_parts(s, rec[k])
            extra, saved, transient = extra + e, saved + a, max(transient, t)
        bwd = sum(s.bwd_s for s in part) + extra
        tp_comm = max(tp_comm, sum(s.fwd_comm_s + s.bwd_comm_s for s in part))
        numel = sum(s.param_numel for s in part)
        trained = sum(s.trainable_numel for s in part)  # frozen parameters: weights only
        w, g, o = float(numel * bpe.weights), float(trained * bpe.grads), float(trained * bpe.optimizer)
        z = cand.zero_stage
        o = o / dp if z >= 1 else o
        g = g / dp if z >= 2 else g
        gather = 0.0
        if z >= 3:
            w = w / dp
            gather = 2 * max((s.param_numel for s in part), default=0) * bpe.weights
        grad_bytes = trained * bpe.grads
        after = 0.0  # communication after the optimizer step (cannot hide behind the backward)
        if dp > 1:
            # collectives take full-size byte counts (autoplan.cost_models.comm's ring convention)
            if z == 0:
                sync = link_time_s("all_reduce", grad_bytes, dp, dp_link, backend=backend)
            else:  # gradients reduce-scattered; ZeRO 1-2 all-gather the updated weights after the step
                sync = link_time_s("reduce_scatter", grad_bytes, dp, dp_link, backend=backend)
                if z < 3:  # the updated (trainable) weights
                    after = link_time_s("all_gather", trained * bpe.weights, dp, dp_link, backend=backend)
            if z >= 3:  # parameters all-gathered before each micro-batch's forward and backward
                ag = link_time_s("all_gather", numel * bpe.weights, dp, dp_link, backend=backend)
                if overlap:
                    # prefetching hides a segment's gather behind the previous segment's compute;
                    # the first segment's gather of each pass has nothing to hide behind
                    first = max((s.param_numel for s in part), default=0) * bpe.weights
                    ag_first = link_time_s("all_gather", first, dp, dp_link, backend=backend)
                    fwd, bwd = max(fwd, ag) + ag_first, max(bwd, ag) + ag_first
                else:
                    fwd, bwd = fwd + ag, bwd + ag
        else:
            sync = 0.0
        last_bwd = sum(s.bwd_s for s in part)
        sync_exposed.append((max(0.0, sync - last_bwd) if overlap else sync) + after)
        opt_s.append(sum(s.optimizer_s for s in part) * (precision_opt_factor(precision)) / (dp if z >= 1 else 1))
        rank = k % cand.pp
        inflight = inflight_microbatches(cand.pipeline_schedule, rank, cand.pp, m, cand.virtual_stages)
        if cand.pp == 1:
            inflight = 1  # gradient accumulation: one micro-batch in flight at a time
        if cand.virtual_stages > 1:
            inflight = math.ceil(inflight / cand.virtual_stages)
        parts = {
            "weights": w,
            "grads": g,
            "optimizer": o,
            "activations": inflight * saved,
            "transient": transient + gather,
        }
        # W = the weight-gradient-only ops of the stage (plus recomputation lands in B)
        w_s = min(bwd, sum(s.bwd_weight_s for s in part))
        stage_times.append(StageTimes(fwd_s=fwd, bwd_input_s=bwd - w_s, bwd_weight_s=w_s))
        stages.append(
            StageEstimate(
                segments=(bounds[k], bounds[k + 1]),
                rank=rank,
                fwd_s=fwd,
                bwd_s=bwd,
                recompute=rec[k],
                memory_bytes=sum(parts.values()),
                memory_parts=parts,
                dp=dp,
            )
        )
    # memory per pipeline rank: the sum of its stages (interleaving puts v stages on a rank)
    per_rank = [0.0] * cand.pp
    for st in stages:
        per_rank[st.rank] += st.memory_bytes
    capacity = float(device.mem_capacity_bytes)
    if memory_only:
        return PipelineEstimate(
            config=cand, stages=tuple(stages), step_time_s=0.0, compute_s=0.0, bubble_s=0.0, p2p_exposed_s=0.0,
            exposed_comm_s=0.0, optimizer_s=0.0, memory_per_rank_bytes=tuple(per_rank),
            peak_memory_bytes=max(per_rank), capacity_bytes=capacity, flops_per_step=0.0, mfu=0.0,
            tokens_per_s=0.0, feasible=max(per_rank) <= capacity,
        )  # fmt: skip
    p2p = [_p2p_s(cand, costs, cluster, bounds[k + 1] - 1, k, offsets) for k in range(nstages - 1)]
    busy = [0.0] * cand.pp
    for st in stages:
        busy[st.rank] += m * (st.fwd_s + st.bwd_s)
    if cand.pp > 1:
        kw = {"num_ranks": cand.pp, "virtual_stages": cand.virtual_stages}
        makespan = fast_step_time(stage_times, cand.pipeline_schedule, m, p2p_s=p2p, **kw)
        free_p2p = fast_step_time(stage_times, cand.pipeline_schedule, m, p2p_s=0.0, **kw)
        bubble = max(0.0, free_p2p - max(busy))
        p2p_exposed = max(0.0, makespan - free_p2p)
    else:
        makespan, bubble, p2p_exposed = max(busy), 0.0, 0.0
    tail = max(se + o for se, o in zip(sync_exposed, opt_s, strict=True))
    step = makespan + tail
    flops = sum(s.flops for s in segs) * m * cand.dp
    peak_flops = device.peak_flops_for(precision_dtype(precision)) * cluster.world_size
    peak = max(per_rank)
    return PipelineEstimate(
        config=cand,
        stages=tuple(stages),
        step_time_s=step,
        compute_s=max(busy),
        bubble_s=bubble,
        p2p_exposed_s=p2p_exposed,
        exposed_comm_s=m * tp_comm + max(sync_exposed) + p2p_exposed,
        optimizer_s=max(opt_s),
        memory_per_rank_bytes=tuple(per_rank),
        peak_memory_bytes=peak,
        capacity_bytes=capacity,
        flops_per_step=flops,
        mfu=flops / (step * peak_flops) if step > 0 else 0.0,
        tokens_per_s=cand.dp * cand.microbatch_size * m * tokens_per_sample / step if step > 0 else 0.0,
        feasible=peak <= capacity,
    )


def precision_dtype(precision: str) -> str:
    return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[precision]


def precision_opt_factor(precision: str) -> float:
    """Optimizer step bytes relative to fp32 training (mixed precision also writes the bf16 copy)."""
    return 1.0 if precision == "fp32" else 1.1


def _p2p_s(
    cand: ParallelConfig, costs: SegmentCosts, cluster: Cluster, cut: int, stage: int, offsets: list[int]
) -> float:
    """Send of the activations crossing ``cut`` from ``stage`` to the next one: the micro-batch
    (``dp`` replicas' worth) goes from the ``d_k`` replicas of one stage to the ``d_k+1`` of
    the next, so the busiest link carries ``1 / min(d_k, d_k+1)`` of it (uniform: each
    replica sends its own ``b`` samples). The link is the network when the two stages'
    devices (``offsets``: first device of each pipeline rank) are not on one node."""
    a, b = stage % cand.pp, (stage + 1) % cand.pp
    total = costs.cut_bytes[cut] * cand.dp
    lo, hi = min(offsets[a], offsets[b]), max(offsets[a + 1], offsets[b + 1]) - 1
    dpn = cluster.devices_per_node
    spans = cluster.num_nodes > 1 and lo // dpn != hi // dpn
    link = cluster.links.get("inter" if spans else "intra") or cluster.catalog_link(spans_nodes=spans)
    share = total / min(cand.dp_of(a), cand.dp_of(b))
    return link_time_s("send_recv", share, 2, link, backend=cluster.backend)


# --- the outer search -------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    cluster: Cluster, *, num_blocks: int, global_batch_size: int, space: SearchSpace
) -> list[ParallelConfig]:
    """Every configuration of the search space that divides the cluster and the batch."""
    world = cluster.world_size
    out = []
    for pp in _divisors(world):
        if pp > max(num_blocks, 1):
            continue
        for tp in _divisors(world // pp):
            if tp > cluster.devices_per_node or cluster.devices_per_node % tp:
                continue
            dp = world // (pp * tp)
            for b in space.microbatch_sizes:
                if global_batch_size % (dp * b):
                    continue
                m = global_batch_size // (dp * b)
                if pp > 1 and m < pp:
                    continue  # fewer micro-batches than stages: the pipeline never fills
                scheds: list[tuple[Schedule, int]] = []
                if pp == 1:
                    scheds = [("1f1b", 1)]  # no pipeline: ParallelConfig.canonical's spelling
                else:
                    for sch in space.schedules:
                        if sch == "interleaved-1f1b":
                            scheds += [
                                (sch, v)
                                for v in space.virtual_stages
                                if pp * v <= num_blocks
                                and schedule_problem(sch, pp=pp, num_microbatches=m, virtual_stages=v) is None
                            ]
                        else:
                            scheds.append((sch, 1))
                for (sch, v), rec, z in itertools.product(scheds, space.recompute, space.zero_stages):
                    if dp == 1 and z > 0:
                        continue  # nothing to shard over
                    out.append(
                        ParallelConfig(
                            dp=dp,
                            tp=tp,
                            pp=pp,
                            microbatch_size=b,
                            num_microbatches=m,
                            schedule=sch,
                            virtual_stages=v,
                            recompute=rec,
                            zero_stage=z,
                        )  # fmt: skip
                    )
    return out


def best_layout(
    cand: ParallelConfig,
    costs: SegmentCosts,
    cluster: Cluster,
    *,
    space: SearchSpace,
    precision: str,
    tokens_per_sample: int,
) -> PipelineEstimate:
    """The best stage split (uniform, or balanced by the min-max partition) and per-stage
    recomputation (the least per stage that fits) for ``cand``."""
    nseg = len(costs.segments)
    nstages = cand.pp * cand.virtual_stages
    splits = {_uniform_starts(nseg, nstages)}
    if space.balanced_stages and nstages > 1:
        splits.add(_balanced_starts([s.fwd_s + s.bwd_s for s in costs.segments], nstages))
    best: PipelineEstimate | None = None
    for starts in sorted(splits):
        est = evaluate(
            cand, costs, cluster, stage_starts=starts, precision=precision, tokens_per_sample=tokens_per_sample
        )
        if space.per_stage_recompute and cand.recompute != "none" and nstages > 1 and est.feasible:
            # the least recomputation per stage that still fits, cheapest first; a stage's memory
            # depends on its own level only, so each trial changes one rank's total
            order = ["none", "selective", "full"]
            levels = order[: order.index(cand.recompute) + 1]
            stage_mem = {
                level: [
                    st.memory_bytes
                    for st in evaluate(
                        cand, costs, cluster, stage_starts=starts, stage_recompute=[level] * nstages,
                        precision=precision, tokens_per_sample=tokens_per_sample, memory_only=True,
                    ).stages
                ]
                for level in levels
            }  # fmt: skip
            per_rank = list(est.memory_per_rank_bytes)
            rec: list[str] = [cand.recompute] * nstages
            for k in range(nstages):
                r = k % cand.pp
                for level in levels:
                    trial = per_rank[r] - stage_mem[rec[k]][k] + stage_mem[level][k]
                    if trial <= est.capacity_bytes:
                        per_rank[r], rec[k] = trial, level
                        break
            if rec != [cand.recompute] * nstages:
                mixed = evaluate(
                    cand, costs, cluster, stage_starts=starts, stage_recompute=rec,
                    precision=precision, tokens_per_sample=tokens_per_sample,
                )  # fmt: skip
                est = mixed if mixed.feasible else est  # (rounding of the running totals)
        if best is None or _key(est) < _key(best):
            best = est
    assert best is not None
    return best


HETERO_MAX_TRANSITIONS = 5_000_000
"""Largest dynamic program :func:`hetero_split` runs (stages x segments^2 x units x degrees; about
0.25 s on one core at the bound); beyond it (hundreds of devices and layers) the per-segment
balancing of the uniform split is already fine-grained."""


def hetero_split(
    weights_for: Callable[[int], Sequence[float]],
    *,
    num_segments: int,
    num_stages: int,
    units: int,
    degrees: Sequence[int],
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Stage boundaries and per-stage data-parallel degrees minimising the slowest stage.

    ``weights_for(d)`` is the time of each segment on a stage of degree ``d``; the degrees sum
    to ``units`` (the cluster's tensor-parallel groups). Dynamic program over (stages, segments
    covered, units used)::

        best[k][j][u] = min_{i < j, d} max(best[k-1][i][u-d], sum_{i<=s<j} w_d[s])

    Returns ``(stage_starts, stage_dp)`` or ``None`` when the program exceeds
    :data:`HETERO_MAX_TRANSITIONS` or nothing fits."""
    n = num_segments
    if num_stages * n * n * units * len(degrees) > HETERO_MAX_TRANSITIONS or not degrees:
        return None
    prefix = {d: [0.0, *itertools.accumulate(weights_for(d))] for d in degrees}
    # best[k][j]: units used -> (slowest stage, (previous boundary, degree)) over k stages, j segments
    best: list[list[dict[int, tuple[float, tuple[int, int]]]]] = [
        [{} for _ in range(n + 1)] for _ in range(num_stages + 1)
    ]
    best[0][0][0] = (0.0, (0, 0))
    for k in range(1, num_stages + 1):
        for j in range(k, n + 1):
            here = best[k][j]
            for i in range(k - 1, j):
                if (i == 0 and j == 1) or (i == n - 1 and j == n):
                    continue  # every stage holds a block
                for u0, (prev, _) in best[k - 1][i].items():
                    for d in degrees:
                        u = u0 + d
                        if u > units:
                            continue
                        cost = max(prev, prefix[d][j] - prefix[d][i])
                        if u not in here or cost < here[u][0]:
                            here[u] = (cost, (i, d))
    if units not in best[num_stages][n]:
        return None
    starts: list[int] = []
    dps: list[int] = []
    j, u = n, units
    for k in range(num_stages, 0, -1):
        i, d = best[k][j][u][1]
        starts.append(i)
        dps.append(d)
        j, u = i, u - d
    return tuple(reversed(starts)), tuple(reversed(dps))


def hetero_layout(
    cand: ParallelConfig,
    cost_at: Callable[[int], SegmentCosts],
    cluster: Cluster,
    *,
    space: SearchSpace,
    precision: str,
    tokens_per_sample: int,
    memo: dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]] | None] | None = None,
) -> PipelineEstimate | None:
    """``cand`` with sub-meshes of different sizes per stage: a heavy stage gets more
    data-parallel replicas (and a light one fewer) instead of leaving the pipeline unbalanced.

    ``cost_at(b)`` are the segment costs of ``b`` samples per device on ``cand.tp``. A stage of
    degree ``d`` splits each micro-batch of ``S = dp * microbatch_size`` samples ``d`` ways, so
    ``d`` ranges over the divisors of ``S`` whose share is a micro-batch size of the space.
    ``None`` when no split differs from the uniform one or the program is too large. ``memo``
    keeps the split per (tp, pp, dp, microbatch size) across the candidates that share them."""
    if cand.pp < 2 or cand.virtual_stages > 1:
        return None
    samples = cand.dp * cand.microbatch_size
    units = cluster.world_size // cand.tp
    degrees = [d for d in _divisors(samples) if samples // d in space.microbatch_sizes and d <= units]
    first = cost_at(cand.microbatch_size)
    key = (cand.tp, cand.pp, cand.dp, cand.microbatch_size)
    if memo is not None and key in memo:
        split = memo[key]
    else:
        split = hetero_split(
            lambda d: [sg.fwd_s + sg.bwd_s for sg in cost_at(samples // d).segments],
            num_segments=len(first.segments),
            num_stages=cand.pp,
            units=units,
            degrees=degrees,
        )
        if memo is not None:
            memo[key] = split
    if split is None or all(d == cand.dp for d in split[1]):
        return None
    starts, stage_dp = split
    hetero = dataclasses.replace(cand, stage_dp=stage_dp)
    return evaluate(
        hetero,
        first,
        cluster,
        stage_starts=starts,
        precision=precision,
        tokens_per_sample=tokens_per_sample,
        stage_costs=[cost_at(samples // d) for d in stage_dp],
    )


def _key(e: PipelineEstimate) -> tuple[bool, float]:
    return (not e.feasible, e.step_time_s if e.feasible else e.peak_memory_bytes)


def search(
    cost_fn: SegmentCostFn | SegmentCostOracle,
    cluster: Cluster,
    *,
    num_blocks: int,
    global_batch_size: int,
    space: SearchSpace | None = None,
    precision: str = "fp32",
    tokens_per_sample: int = 1,
    expand_to_blocks: int | None = None,
) -> tuple[PipelineEstimate, list[PipelineEstimate]]:
    """The fastest feasible configuration, and every evaluated one (best layout each).

    ``cost_fn(tp, b)`` gives the segment costs of one micro-batch of ``b`` samples on a
    tensor-parallel group of ``tp`` (memoised here); a
    :class:`~autoplan.planner.segment_costs.SegmentCostOracle` is asked to prefetch every key the
    candidates need first, the ready ones laid out while it solves. ``expand_to_blocks`` prices a model with
    that many identical blocks from a trace with fewer (:func:`expand_blocks`)."""
    space = space or SearchSpace()
    blocks = expand_to_blocks or num_blocks
    cache: dict[tuple[int, int], SegmentCosts] = {}

    def costs(tp: int, b: int) -> SegmentCosts:
        if (tp, b) not in cache:
            c = cost_fn(tp, b)
            cache[(tp, b)] = expand_blocks(c, blocks) if expand_to_blocks else c
        return cache[(tp, b)]

    splits: dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]] | None] = {}

    def layout(cand: ParallelConfig, cost_at: SegmentCostFn) -> PipelineEstimate:
        """The best layout of ``cand``: :func:`best_layout`, or :func:`hetero_layout` if faster."""
        est = best_layout(
            cand,
            cost_at(cand.tp, cand.microbatch_size),
            cluster,
            space=space,
            precision=precision,
            tokens_per_sample=tokens_per_sample,
        )
        if space.hetero_stages:
            alt = hetero_layout(
                cand,
                functools.partial(cost_at, cand.tp),
                cluster,
                space=space,
                precision=precision,
                tokens_per_sample=tokens_per_sample,
                memo=splits,
            )  # fmt: skip
            if alt is not None and _key(alt) < _key(est):
                est = alt
        return est

    todo = [
        c
        for c in candidates(cluster, num_blocks=blocks, global_batch_size=global_batch_size, space=space)
        if space.fixed is None or c == space.fixed
    ]
    early: dict[int, PipelineEstimate] = {}
    if isinstance(cost_fn, SegmentCostOracle):  # solves many (tp, b) at once (in parallel)
        keys = {(c.tp, c.microbatch_size) for c in todo}
        # lay out the candidates whose costs are in while the others are being solved
        cost_fn.prefetch(keys, while_waiting=_EarlyLayouts(todo, cost_fn.ready, costs, layout, early))
    # best-first: a candidate whose compute alone exceeds the best step found cannot win
    bounds = [lower_bound_s(c, costs(c.tp, c.microbatch_size)) for c in todo]
    results = []
    best_s = float("inf")
    for bound, i in sorted(zip(bounds, range(len(todo)), strict=True), key=lambda bi: bi[0]):
        if bound > best_s:
            break
        est = early.pop(i) if i in early else layout(todo[i], costs)
        results.append(est)
        if est.feasible:
            best_s = min(best_s, est.step_time_s)
    if not results:
        raise ConfigError(
            f"no configuration divides the cluster ({cluster.world_size} devices) and the global batch "
            f"({global_batch_size}): use a global batch divisible by the data-parallel degree"
        )
    feasible = [r for r in results if r.feasible]
    if not feasible:
        least = min(results, key=lambda r: r.peak_memory_bytes)
        raise InfeasiblePlanError(
            f"no configuration fits in {least.capacity_bytes / 2**30:.1f} GiB per device: the least memory-hungry "
            f"({_describe(least.config)}) needs {least.peak_memory_bytes / 2**30:.1f} GiB; use more devices, "
            "a smaller global batch or a device with more memory"
        )
    return min(feasible, key=lambda r: r.step_time_s), results


class _NotReady(Exception):
    """The costs of this (tp, micro-batch) are still being solved."""


class _EarlyLayouts:
    """:func:`search`'s work while its cost model solves (``prefetch(keys, while_waiting=...)``):
    each call lays out one candidate whose costs are in, and returns False when there is none.

    A pure speed-up: the layouts go to ``early`` (by index into ``todo``), which :func:`search`'s
    best-first loop takes instead of computing them, so the search's result and the list of
    candidates it evaluated are exactly those without it. Candidates are taken by increasing
    lower bound among the ready ones; one whose bound exceeds a feasible step already laid out
    is skipped, as the loop will prune it too (every candidate with a smaller bound comes
    first there, and that step is among them or beaten by one). A candidate that needs
    costs not yet in (a heterogeneous split over other micro-batch sizes) is left to the loop."""

    def __init__(
        self,
        todo: Sequence[ParallelConfig],
        ready: Callable[[int, int], bool],
        costs: SegmentCostFn,
        layout: Callable[[ParallelConfig, SegmentCostFn], PipelineEstimate],
        early: dict[int, PipelineEstimate],
    ) -> None:
        self.todo, self.ready, self.costs, self.layout, self.early = todo, ready, costs, layout, early
        self.waiting: dict[tuple[int, int], list[int]] = {}
        for i, c in enumerate(todo):
            self.waiting.setdefault((c.tp, c.microbatch_size), []).append(i)
        self.heap: list[tuple[float, int]] = []
        self.best_s = float("inf")

    def _cost_if_ready(self, tp: int, b: int) -> SegmentCosts:
        if not self.ready(tp, b):
            raise _NotReady
        return self.costs(tp, b)

    def __call__(self) -> bool:
        for key in [k for k in self.waiting if self.ready(*k)]:
            costs = self.costs(*key)
            for i in self.waiting.pop(key):
                heapq.heappush(self.heap, (lower_bound_s(self.todo[i], costs), i))
        while self.heap:
            bound, i = heapq.heappop(self.heap)
            if bound > self.best_s:
                self.heap.clear()  # every later one is pruned too
                break
            try:
                est = self.layout(self.todo[i], self._cost_if_ready)
            except _NotReady:
                continue
            self.early[i] = est
            if est.feasible:
                self.best_s = min(self.best_s, est.step_time_s)
            return True
        return False


def lower_bound_s(cand: ParallelConfig, costs: SegmentCosts) -> float:
    """A step time no layout of ``cand`` beats: its forward and backward work spread evenly over
    the pipeline ranks, with no bubble, recomputation, communication or optimizer
    (:func:`evaluate` adds only non-negative terms to this for uniform stages)."""
    work = sum(s.fwd_s + s.bwd_s for s in costs.segments)
    return cand.num_microbatches * work / cand.pp


def _describe(c: ParallelConfig) -> str:
    return (
        f"dp={c.dp} tp={c.tp} pp={c.pp} mbs={c.microbatch_size}x{c.num_microbatches} "
        f"{c.schedule if c.pp > 1 else 'none'}"
        f"{f'(v={c.virtual_stages})' if c.virtual_stages > 1 else ''} recompute={c.recompute} zero={c.zero_stage}"
    )


__all__ = [
    "PipelineEstimate",
    "SearchSpace",
    "StageEstimate",
    "best_layout",
    "candidates",
    "evaluate",
    "expand_blocks",
    "hetero_layout",
    "hetero_split",
    "lower_bound_s",
    "search",
]
