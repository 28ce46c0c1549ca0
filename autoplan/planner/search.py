r"""Pass — pipeline search: stages x schedule x micro-batches x recomputation x ZeRO, with the
intra-operator ILP inside.

Each configuration ``c`` is priced by :func:`autoplan.cost_models.step.evaluate` (the
formulation of its step time ``T(c)`` and per-stage memory ``M_k`` is in that module's docstring)
over the per-segment costs of the intra-operator ILP (:mod:`autoplan.planner.segment_costs`).

Heterogeneous sub-meshes (Alpa's stage-to-mesh assignment, restricted to data parallelism):
stage ``k`` may get ``d_k * tp`` devices with ``sum_k d_k = pp * dp`` and splits each micro-batch
of ``S = dp * b`` samples ``d_k`` ways (``d_k | S``); its times are those of ``S / d_k`` samples,
its gradient synchronisation and ZeRO sharding run over ``d_k``, and a cut is sent by ``d_k``
ranks to ``d_{k+1}`` (the busiest link carries ``1 / min(d_k, d_{k+1})`` of it). Boundaries and
degrees together minimise the slowest stage (:func:`hetero_split`, a dynamic program over
stages x segments x devices); the candidate keeps it when the full evaluation is faster.

The outer search enumerates every ``c`` (pp | world, tp | devices per node, b with
``B % (dp b) == 0``, schedules, v (:func:`virtual_stage_counts`), recompute, ZeRO) and, per ``c``, the stage boundaries that
minimise the slowest stage (min-max contiguous partition by dynamic programming) next to the
uniform split; the recomputation may differ per stage (the least that fits); a ``c`` that does
not fit is priced again with sharded gradient accumulation (ZeRO >= 2, several micro-batches:
``sharded_grad_accumulation``, ``1 / dp`` of the summed gradients held for ``m`` times the
reductions), then with its optimizer state in host memory (``offload_optimizer``); neither
ever makes a step faster, so each is tried only there. It returns the
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.config import (
    RECOMPUTE,
    SCHEDULES,
    ParallelConfig,
    Recompute,
    Schedule,
    context_parallel_problem,
    schedule_problem,
)
from autoplan.cost_models.errors import ConfigError, InfeasiblePlanError
from autoplan.cost_models.step import SegmentCosts, TrainingEstimate, evaluate, uniform_starts
from autoplan.planner.segment_costs import BoundedSegmentCostOracle, SegmentCostOracle

SegmentCostFn = Callable[..., SegmentCosts]
"""``(tp, microbatch_size[, cp]) -> SegmentCosts`` of one micro-batch on a tensor-parallel group
(``cp x tp`` with context parallelism; ``cp`` is passed only when above 1)."""


def cost_key(c: ParallelConfig) -> tuple[int, ...]:
    """The arguments of :data:`SegmentCostFn` that price ``c``'s micro-batches."""
    if c.sequence_parallel:
        return (c.tp, c.microbatch_size, c.cp, 1)  # the 4th: sequence_parallel (SegmentCostModel keys)
    return (c.tp, c.microbatch_size) if c.cp == 1 else (c.tp, c.microbatch_size, c.cp)


@dataclass(slots=True)
class SearchSpace:
    """What the outer search may choose (defaults: everything)."""

    schedules: tuple[Schedule, ...] = SCHEDULES
    virtual_stages: tuple[int, ...] | None = None
    """Model chunks per rank tried for ``interleaved-1f1b``; ``None``: those of
    :func:`virtual_stage_counts` for each pp, micro-batch count and depth."""
    recompute: tuple[Recompute, ...] = RECOMPUTE
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    offload_optimizer: tuple[bool, ...] = (False, True)
    """Optimizer state in device memory (False) or host memory (True). Offloading only adds time
    (:func:`autoplan.cost_models.step.offload_time_s`), so a configuration is priced with it only
    where it does not fit without it (:func:`search`), and never on a device that is its own host
    (``DeviceSpec.host_link_GBps`` is ``None``: nothing leaves its memory)."""
    microbatch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    context_parallel: tuple[bool, ...] = (False, True)
    """No context-parallel axis (False) or one beside tensor parallelism (True: every
    ``ParallelConfig.cp > 1`` with ``tp > 1`` whose ``cp * tp`` ranks fit in a node, or whose ``tp``
    is a whole node, and whose ``2 * cp`` divides the tokens of a sample), the latter for samples of at
    least :attr:`context_parallel_min_tokens` tokens (:func:`candidates`)."""
    context_parallel_min_tokens: int = 8192
    """Shortest sample the search tries a ``cp`` axis for. A pruning rule, not a cost: each ``cp``
    adds an ILP per micro-batch size and ``tp``, and below it the ``tp`` axis's own split of the
    sequence (one axis, inside a node) already reaches the degrees that pay at such lengths
    (measured: at 131,072 tokens on 8 H100, Llama 3 8B's best ``cp x tp`` is priced 2.2 % slower
    than ``tp=4`` alone)."""
    sharded_grad_accumulation: tuple[bool, ...] = (False, True)
    """ZeRO >= 2 candidates with several micro-batches: the gradients summed raw over the
    micro-batches and reduced in the last one's backward (False), or reduce-scattered in every
    micro-batch's backward into sharded accumulators (True, ``ParallelConfig.sharded_grad_accumulation``).
    The latter holds ``1 / dp`` of the summed gradients and runs ``m`` times the reductions, so it
    never makes a step faster: it is priced only where a configuration does not fit without it,
    before offloading the optimizer state (:func:`first_fitting`)."""
    expert_parallel: tuple[bool, ...] = (False, True)
    """Routed experts replicated over the data-parallel group (False) or split over groups of
    ``ep`` of its ranks (True: every ``ParallelConfig.ep > 1`` dividing both ``dp`` and the
    model's experts), the latter where ``tp == 1`` (:func:`candidates`)."""
    sequence_parallel: tuple[bool, ...] = (True,)
    """Tensor-parallel candidates (``tp > 1``) priced with Megatron sequence parallelism (True,
    ``ParallelConfig.sequence_parallel``) and/or without it (False). Only True by default: every
    Megatron-LM/NeMo recipe with tensor parallelism runs it (it moves the bytes of the
    all-reduces it replaces, as an all-gather and a reduce-scatter, and holds the activations
    outside the matmuls split), and each value adds an ILP per ``tp`` and micro-batch size."""
    balanced_stages: bool = True
    per_stage_recompute: bool = True
    hetero_stages: bool = True
    """Also give stages sub-meshes of different sizes (:func:`hetero_layout`)."""
    fixed: ParallelConfig | None = None
    """Only this configuration (as :meth:`ParallelConfig.canonical` writes it); the search then
    places its stage boundaries."""


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
        return uniform_starts(n, num_stages)
    starts, j = [], n
    for k in range(num_stages, 0, -1):
        i = arg[k][j]
        starts.append(i)
        j = i
    return tuple(reversed(starts))


# --- the outer search -------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


MIN_BUBBLE_GAIN = 0.01
"""The least share of the ideal step a larger chunk count must still be able to remove
(:func:`virtual_stage_counts`); plan quality is judged at 0.99 of the best step
(``benchmarks/plan_quality.py``), so a count that can gain less is not worth its evaluation."""


def virtual_stage_counts(*, pp: int, num_microbatches: int, num_blocks: int) -> tuple[int, ...]:
    """Chunk counts ``v >= 2`` the search tries for ``interleaved-1f1b`` on ``pp`` ranks.

    With ``p = pp``, ``m = num_microbatches`` and uniform chunks, interleaving leaves the bubble
    ``(p - 1) / (v m)`` of the ideal step ``m v (f + B)`` (Narayanan et al., "Efficient
    Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC 2021, sec. 2.2.1;
    :mod:`autoplan.cost_models.schedule`), while every extra chunk adds two transfers per
    micro-batch. So ``v`` is tried when ``p v <= num_blocks`` (every stage holds a block, the
    stage split's rule) and

    * ``v`` is 2 or 4, the counts the search always tried (any depth: the minimum-maximum split
      evens out the blocks), or
    * any other ``v``: ``p v`` divides ``num_blocks`` (every chunk holds ``num_blocks / (p v)`` blocks,
      the rule of Megatron-LM's interleaved schedule, ``num_layers % (pp * v) == 0``) and the
      largest count ``u < v`` tried still leaves a bubble ``(p - 1) / (u m)`` of at least
      :data:`MIN_BUBBLE_GAIN`: no ``v > u`` can remove more than that share of the step.

    torch's ScheduleInterleaved1F1B puts no bound on ``v``; its micro-batch rule is
    :func:`~autoplan.cost_models.config.schedule_problem`'s."""
    out: list[int] = []
    for v in range(2, num_blocks // pp + 1):
        if v in (2, 4):
            out.append(v)
        elif num_blocks % (pp * v) == 0 and (pp - 1) / (out[-1] * num_microbatches) >= MIN_BUBBLE_GAIN:
            out.append(v)
    return tuple(out)


def _context_degrees(cluster: Cluster, *, replicas: int, tp: int, space: SearchSpace, tokens: int) -> list[int]:
    """The ``cp`` degrees :func:`candidates` tries beside ``tp`` (``replicas``: the stage's
    ranks over ``tp``; see :attr:`SearchSpace.context_parallel`)."""
    out = [1] if False in space.context_parallel else []
    if True not in space.context_parallel or tp == 1 or tokens < space.context_parallel_min_tokens:
        return out
    return out + [
        cp for cp in _divisors(replicas)
        if cp > 1 and context_parallel_problem(cp, tp, devices_per_node=cluster.devices_per_node, tokens=tokens) is None
    ]  # fmt: skip


def candidates(
    cluster: Cluster,
    *,
    num_blocks: int,
    global_batch_size: int,
    space: SearchSpace,
    experts: int = 0,
    tokens_per_sample: int = 1,
) -> list[ParallelConfig]:
    """Every configuration of the search space that divides the cluster and the batch (and, for a
    model with ``experts`` routed experts per MoE layer, the expert-parallel degrees ``ep``
    dividing both ``dp`` and the experts; for samples of ``tokens_per_sample`` tokens, the
    context-parallel degrees of :func:`_context_degrees`)."""
    world = cluster.world_size
    out = []
    for pp, tp in itertools.product(_divisors(world), _divisors(world)):
        if pp > max(num_blocks, 1) or world % (pp * tp) or cluster.devices_per_node % tp:
            continue  # (tp divides a node: tensor parallelism stays inside one)
        for cp in _context_degrees(cluster, replicas=world // (pp * tp), tp=tp, space=space, tokens=tokens_per_sample):
            out += _configs(space, pp=pp, tp=tp, cp=cp, dp=world // (pp * tp * cp), num_blocks=num_blocks,
                            global_batch_size=global_batch_size, experts=experts)  # fmt: skip
    return out


def _configs(
    space: SearchSpace, *, pp: int, tp: int, cp: int, dp: int, num_blocks: int, global_batch_size: int, experts: int
) -> list[ParallelConfig]:
    """:func:`candidates` for one ``(pp, tp, cp)``: micro-batches, schedules, recomputation,
    ZeRO and expert parallelism."""
    out = []
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
                    counts = space.virtual_stages
                    if counts is None:
                        counts = virtual_stage_counts(pp=pp, num_microbatches=m, num_blocks=num_blocks)
                    scheds += [
                        (sch, v)
                        for v in counts
                        if pp * v <= num_blocks
                        and schedule_problem(sch, pp=pp, num_microbatches=m, virtual_stages=v) is None
                    ]
                else:
                    scheds.append((sch, 1))
        eps = [1] if False in space.expert_parallel or cp > 1 else []
        if True in space.expert_parallel and tp == 1 and cp == 1 and experts:
            eps += [ep for ep in _divisors(dp) if ep > 1 and experts % ep == 0]
        sps = [sp for sp in space.sequence_parallel if tp > 1 or not sp] or [False]
        for (sch, v), rec, z, ep, sp in itertools.product(scheds, space.recompute, space.zero_stages, eps, sps):
            if dp * cp == 1 and z > 0:
                continue  # nothing to shard over (ZeRO shards over dp x cp: cost_models.step._DpGroups)
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
                    ep=ep,
                    cp=cp,
                    sequence_parallel=sp,
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
) -> TrainingEstimate:
    """The best stage split (uniform, or balanced by the min-max partition) and per-stage
    recomputation (the least per stage that fits) for ``cand``."""
    nseg = len(costs.segments)
    nstages = cand.pp * cand.virtual_stages
    splits = {uniform_starts(nseg, nstages)}
    if space.balanced_stages and nstages > 1:
        splits.add(_balanced_starts([s.fwd_s + s.bwd_s for s in costs.segments], nstages))
    best: TrainingEstimate | None = None
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
            per_rank = list(est.memory_per_device_bytes)
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
        if best is None or estimate_order(est) < estimate_order(best):
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
) -> TrainingEstimate | None:
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


def offload_choices(space: SearchSpace, cluster: Cluster) -> list[bool]:
    """The ``offload_optimizer`` values to try, in order: the space's, without offloading on a
    device that is its own host (``host_link_GBps`` is ``None``); ``space.fixed``'s alone."""
    if space.fixed is not None:
        return [space.fixed.offload_optimizer]
    offloads = [o for o in space.offload_optimizer if not o or cluster.device.host_link_GBps is not None]
    if not space.offload_optimizer:
        raise ConfigError("SearchSpace.offload_optimizer is empty: give (False,), (True,) or (False, True)")
    return offloads or [False]


def accumulation_choices(space: SearchSpace, cand: ParallelConfig) -> list[bool]:
    """The ``sharded_grad_accumulation`` values to try for ``cand``, in order: the space's where
    ``cand`` accumulates micro-batches under ZeRO >= 2 with its reductions in the backward (False
    first: sharded accumulation only adds communication), else False; ``space.fixed``'s alone."""
    if space.fixed is not None:
        return [space.fixed.sharded_grad_accumulation]
    if not space.sharded_grad_accumulation:
        raise ConfigError("SearchSpace.sharded_grad_accumulation is empty: give (False,), (True,) or (False, True)")
    if cand.zero_stage < 2 or cand.num_microbatches == 1 or (cand.pp > 1 and cand.schedule == "zero-bubble"):
        return [False]
    return sorted(space.sharded_grad_accumulation)


def first_fitting(
    cand: ParallelConfig,
    offloads: Sequence[bool],
    place: Callable[[ParallelConfig], TrainingEstimate],
    accumulations: Sequence[bool] = (False,),
) -> TrainingEstimate:
    """``place(cand)`` with the first of ``offloads`` x ``accumulations`` (sharded gradient
    accumulation, :func:`accumulation_choices`) that fits, else the least memory-hungry of them.
    Both only add time (offloading the optimizer state: :func:`autoplan.cost_models.step.offload_time_s`;
    sharded accumulation: ``m`` times the gradient reductions), so each is tried only where the
    configuration does not fit without it, sharded accumulation first (its reductions overlap the
    backward; the offloaded step does not)."""
    best: TrainingEstimate | None = None
    for offload in offloads if cand.ep == 1 else [False]:  # (ParallelConfig: ep > 1 keeps it on the device)
        for sharded in accumulations:
            est = place(dataclasses.replace(cand, offload_optimizer=offload, sharded_grad_accumulation=sharded))
            if best is None or estimate_order(est) < estimate_order(best):
                best = est
            if best.feasible:
                return best
    assert best is not None, "offload_choices and accumulation_choices return at least one value"
    return best


def estimate_order(e: TrainingEstimate) -> tuple[bool, float]:
    """The search's order of estimates: those that fit by step time, then the others by memory."""
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
    experts: int = 0,
) -> tuple[TrainingEstimate, list[TrainingEstimate]]:
    """The fastest feasible configuration, and every evaluated one (best layout each).

    ``cost_fn(tp, b)`` gives the segment costs of one micro-batch of ``b`` samples on a
    tensor-parallel group of ``tp`` (memoised here); a :class:`~autoplan.planner.segment_costs.SegmentCostOracle`
    is asked to prefetch every key the candidates need first (a bounded one: those that can win,
    :class:`_KeyBounds`), the ready ones laid out while it solves. ``expand_to_blocks`` prices a model with
    that many identical blocks from a trace with fewer (:func:`expand_blocks`). ``experts``: the
    model's routed experts per MoE layer (0: none), for expert-parallel candidates."""
    space = space or SearchSpace()
    blocks = expand_to_blocks or num_blocks
    cache: dict[tuple[int, ...], SegmentCosts] = {}

    def costs(*key: int) -> SegmentCosts:
        if key not in cache:
            c = cost_fn(*key)
            cache[key] = expand_blocks(c, blocks) if expand_to_blocks else c
        return cache[key]

    splits: dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]] | None] = {}
    offloads = offload_choices(space, cluster)

    def layout(cand: ParallelConfig, cost_at: SegmentCostFn) -> TrainingEstimate:
        return first_fitting(cand, offloads, lambda c: placed(c, cost_at), accumulation_choices(space, cand))

    def placed(cand: ParallelConfig, cost_at: SegmentCostFn) -> TrainingEstimate:
        """The best layout of ``cand``: :func:`best_layout`, or :func:`hetero_layout` if faster."""
        est = best_layout(
            cand,
            cost_at(*cost_key(cand)),
            cluster,
            space=space,
            precision=precision,
            tokens_per_sample=tokens_per_sample,
        )
        if space.hetero_stages and cand.ep == 1 and cand.cp == 1:  # (ParallelConfig: one dp degree under ep, cp)
            alt = hetero_layout(
                cand,
                functools.partial(cost_at, cand.tp),
                cluster,
                space=space,
                precision=precision,
                tokens_per_sample=tokens_per_sample,
                memo=splits,
            )  # fmt: skip
            if alt is not None and estimate_order(alt) < estimate_order(est):
                est = alt
        return est

    todo = [
        c
        for c in candidates(
            cluster, num_blocks=blocks, global_batch_size=global_batch_size, space=space, experts=experts,
            tokens_per_sample=tokens_per_sample,
        )  # fmt: skip
        if space.fixed is None
        or c == dataclasses.replace(space.fixed, offload_optimizer=False, sharded_grad_accumulation=False)
    ]
    early: dict[int, TrainingEstimate] = {}
    unsolved: dict[int, float] = {}  # candidates of the keys never solved: their bounds (_KeyBounds)
    if isinstance(cost_fn, SegmentCostOracle):  # solves many (tp, b) at once, laying out those in meanwhile
        unsolved = _prefetch(cost_fn, todo, _EarlyLayouts(todo, cost_fn.ready, costs, layout, early),
                             bounded=expand_to_blocks is None)  # fmt: skip
    # best-first: a candidate whose compute alone exceeds the best step found cannot win
    bounds = [unsolved[i] if i in unsolved else lower_bound_s(c, costs(*cost_key(c))) for i, c in enumerate(todo)]
    results = []
    best_s = float("inf")
    for bound, i in sorted(zip(bounds, range(len(todo)), strict=True), key=lambda bi: bi[0]):
        if bound > best_s:
            break
        assert i not in unsolved, "an unsolved key's candidates come after a faster step (_KeyBounds)"
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
            f"no configuration fits in {least.capacity_bytes / 2**30:.3g} GiB per device: the least memory-hungry "
            f"({_describe(least.config)}) needs {least.peak_memory_bytes / 2**30:.3g} GiB; use more devices, "
            "a smaller global batch or a device with more memory"
        )
    return min(feasible, key=lambda r: r.step_time_s), results


def _prefetch(
    cost_fn: SegmentCostOracle, todo: Sequence[ParallelConfig], layouts: _EarlyLayouts, *, bounded: bool
) -> dict[int, float]:
    """Have ``cost_fn`` compute the keys of ``todo`` (``layouts`` laying out candidates meanwhile),
    without the keys :class:`_KeyBounds` finds no candidate of can be evaluated where ``cost_fn``
    bounds work and ``bounded`` (its costs are the search's own, not expanded); the candidates
    of the keys left unsolved (by index into ``todo``) with their bounds."""
    keys = {cost_key(c) for c in todo}
    if not bounded or not isinstance(cost_fn, BoundedSegmentCostOracle):
        cost_fn.prefetch(keys, while_waiting=layouts)
        return {}
    key_bounds = _KeyBounds(todo, cost_fn.work_lower_bound_s, layouts)
    cost_fn.prefetch(keys, while_waiting=layouts, skip=key_bounds.skip, priority=key_bounds.priority)
    pruned = {k for k in keys if not cost_fn.ready(*k)}
    assert all(key_bounds.skip(k) for k in pruned), "prefetch leaves out only the keys skip names"
    return {i: key_bounds.candidate_bound(c) for i, c in enumerate(todo) if cost_key(c) in pruned}


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
        ready: Callable[..., bool],
        costs: SegmentCostFn,
        layout: Callable[[ParallelConfig, SegmentCostFn], TrainingEstimate],
        early: dict[int, TrainingEstimate],
    ) -> None:
        self.todo, self.ready, self.costs, self.layout, self.early = todo, ready, costs, layout, early
        self.waiting: dict[tuple[int, ...], list[int]] = {}
        for i, c in enumerate(todo):
            self.waiting.setdefault(cost_key(c), []).append(i)
        self.heap: list[tuple[float, int]] = []
        self.best_s = float("inf")
        self.proven_s = float("inf")
        """The fastest feasible step laid out whose candidate's :func:`lower_bound_s` is at most
        that step (:class:`_KeyBounds` prunes against it)."""

    def _cost_if_ready(self, *key: int) -> SegmentCosts:
        if not self.ready(*key):
            raise _NotReady
        return self.costs(*key)

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
                if bound <= est.step_time_s:
                    self.proven_s = min(self.proven_s, est.step_time_s)
            return True
        return False


class _KeyBounds:
    """The segment-cost keys :func:`search` needs, for a
    :class:`~autoplan.planner.segment_costs.BoundedSegmentCostOracle`'s ``prefetch`` (``skip``,
    ``priority``): a key none of whose candidates the best-first loop can reach is never solved.

    With ``W(k)`` the oracle's ``work_lower_bound_s`` of key ``k`` (at most the forward and
    backward sum of its costs), every candidate ``c`` of ``k`` has the bound
    ``L0(c) = m W(k) / pp <= lower_bound_s(c)`` without its costs. Key ``k`` is skipped once
    ``L0(c) > G`` for all of its candidates, where ``G`` is the step of a feasible candidate ``g``
    laid out early with ``lower_bound_s(g) <= G`` (:attr:`_EarlyLayouts.proven_s`; it only
    decreases, so a skipped key stays skipped). The loop then sorts the candidates of the keys left
    unsolved by ``L0`` and evaluates the same candidates, in the same order, as with every key
    solved: it stops at the first candidate whose bound exceeds the best step so far, ``g``
    comes before every such ``c`` in either order (its bound is at most ``G < L0(c) <=
    lower_bound_s(c)``), so the loop stops at ``c`` or before in both, and the candidates
    before that point are the same ones with the same bounds. ``priority(k)``: the least ``L0``
    of ``k``'s candidates (solve the promising keys first, so ``G`` is found early)."""

    def __init__(
        self,
        todo: Sequence[ParallelConfig],
        work_bound: Callable[..., float],
        layouts: _EarlyLayouts,
    ) -> None:
        self.work_bound, self.layouts = work_bound, layouts
        self.of_key: dict[tuple[int, ...], list[ParallelConfig]] = {}
        for c in todo:
            self.of_key.setdefault(cost_key(c), []).append(c)
        self._work: dict[tuple[int, ...], float] = {}
        self._least: dict[tuple[int, ...], float] = {}

    def candidate_bound(self, cand: ParallelConfig) -> float:
        """``L0(cand)``: :func:`lower_bound_s` with the work bound for the work."""
        key = cost_key(cand)
        if key not in self._work:
            self._work[key] = self.work_bound(*key)
        return cand.num_microbatches * self._work[key] / cand.pp

    def priority(self, key: tuple[int, ...]) -> float:
        if key not in self._least:
            self._least[key] = min(self.candidate_bound(c) for c in self.of_key[key])
        return self._least[key]

    def skip(self, key: tuple[int, ...]) -> bool:
        return self.priority(key) > self.layouts.proven_s


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
        f"{' offload=optimizer' if c.offload_optimizer else ''}{f' ep={c.ep}' if c.ep > 1 else ''}"
        f"{' grads=sharded' if c.sharded_grad_accumulation else ''}"
    )


__all__ = [
    "SearchSpace",
    "accumulation_choices",
    "best_layout",
    "candidates",
    "estimate_order",
    "expand_blocks",
    "first_fitting",
    "hetero_layout",
    "hetero_split",
    "lower_bound_s",
    "offload_choices",
    "search",
    "virtual_stage_counts",
]
