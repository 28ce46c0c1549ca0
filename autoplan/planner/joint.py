"""The joint search as a public API: ``autoplan.estimate`` (what-if) and the pipeline planner.

    est = autoplan.estimate(model, "4x8xH100", example_inputs=(ids,), loss_fn=lm_loss,
                            example_targets=(ids,), global_batch_size=512, precision="bf16",
                            config=autoplan.ParallelConfig(dp=8, tp=4, pp=1, microbatch_size=2,
                                                           num_microbatches=32))
    print(est.summary())

Both the what-if estimate and the planner's search price a configuration with the same function
(:func:`autoplan.cost_models.step.evaluate`) over the same per-segment costs: the intra-operator ILP
solved for one micro-batch on the tensor-parallel group (:mod:`autoplan.planner.segment_costs`), so the
planner's choice can be compared number for number with a hand-written configuration.

``example_inputs`` give the per-sample shapes; their batch dimension (dim 0) is resized to each
micro-batch size the search tries (:mod:`autoplan.planner.tracing`); the per-segment costs come from
:class:`~autoplan.planner.segment_model.SegmentCostModel`. The plan of the chosen configuration
(:func:`plan_for_batch`) solves one stage's placements with :func:`autoplan.planner.ilp.plan_traced`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Mapping, Sequence

import torch
from torch.distributed.tensor import Replicate, Shard

from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.config import (
    EXECUTABLE_RECOMPUTE,
    EXECUTABLE_ZERO_STAGES,
    SCHEDULES,
    ParallelConfig,
    context_parallel_problem,
    unexecutable_fields,
)
from autoplan.cost_models.errors import ConfigError, PlanError
from autoplan.cost_models.memory import keeps_master_weights
from autoplan.cost_models.profile_db import ProfileDB
from autoplan.cost_models.step import TrainingEstimate, evaluate
from autoplan.passes import pass_order
from autoplan.passes.costing import CostProblem
from autoplan.passes.expand import block_multiplicity, twins
from autoplan.passes.layers import Layering
from autoplan.passes.moe import MOE_OPS, ep_axes, expert_weights, is_moe_backward
from autoplan.passes.rebatch import MIN_BASE_BATCH
from autoplan.passes.strategies import NodeStrategies, Strategy, StrategyTable
from autoplan.passes.trace import LossFn, TracedProgram
from autoplan.planner import plan_cache, progress
from autoplan.planner.ilp import plan_traced
from autoplan.planner.mesh import (
    as_cluster,
    context_parallel_axis,
    data_parallel_axes,
    gradient_values,
    planning_mesh,
    restrict_context_parallel,
    restrict_sequence_parallel,
    stage_cluster,
    tensor_parallel_axis,
    value_rank,
)
from autoplan.planner.plan import ConfigOption, Estimate, PipelineLayout, Plan
from autoplan.planner.search import SearchSpace, cost_key, estimate_order, search
from autoplan.planner.segment_model import SegmentCostModel, memory_tie_break
from autoplan.planner.tracing import plan_forward_fingerprint, prepare_for_precision, trace_repeated

log = logging.getLogger(__name__)


def _tokens_per_sample(example_inputs: Sequence[torch.Tensor]) -> int:
    first = example_inputs[0]
    return int(first.shape[1]) if first.dim() >= 2 and not first.is_floating_point() else 1


def _check_config(
    config: ParallelConfig, cluster: Cluster, num_blocks: int, global_batch_size: int, *, experts: int, tokens: int
) -> None:
    config.check_against(
        world_size=cluster.world_size,
        devices_per_node=cluster.devices_per_node,
        num_blocks=num_blocks,
        global_batch_size=global_batch_size,
    )
    problem = context_parallel_problem(config.cp, config.tp, devices_per_node=cluster.devices_per_node, tokens=tokens)
    if problem:
        raise ConfigError(problem)
    if config.ep > 1 and (experts == 0 or experts % config.ep):
        have = f"{experts} routed experts per layer" if experts else "no routed experts (no MoE layer)"
        raise ConfigError(
            f"ep={config.ep} splits each MoE layer's experts {config.ep} ways but the model has {have}: use ep=1"
        )


def estimate(
    model: torch.nn.Module,
    cluster: Cluster | str,
    example_inputs: Sequence[torch.Tensor],
    *,
    config: ParallelConfig,
    global_batch_size: int,
    loss_fn: LossFn | None = None,
    example_targets: Sequence[torch.Tensor] = (),
    precision: str = "fp32",
    optimizer: str = "adam",
    profile: ProfileDB | None = None,
) -> TrainingEstimate:
    """Price a hand-written configuration with the planner's cost model (see the module docstring)."""
    cluster = as_cluster(cluster)
    master = _master_weights(model, precision)
    model, inputs, targets = prepare_for_precision(model, example_inputs, example_targets, precision)
    costs = SegmentCostModel(
        model, inputs, loss_fn, targets, cluster, optimizer=optimizer, profile=profile, master_weights=master
    )
    costs._traced(config.microbatch_size)  # noqa: SLF001 - learn the number of blocks before any ILP
    _check_config(
        config, cluster, costs.num_blocks, global_batch_size, experts=costs.routed_experts(),
        tokens=_tokens_per_sample(inputs),
    )  # fmt: skip
    seg = costs(*cost_key(config))
    samples = config.dp * config.microbatch_size
    stage_costs = [costs(config.tp, samples // d) for d in config.stage_dp] if config.stage_dp else None
    return evaluate(
        config.canonical(), seg, cluster, precision=precision, tokens_per_sample=_tokens_per_sample(inputs),
        stage_costs=stage_costs,
    )  # fmt: skip


def search_config(
    model: torch.nn.Module,
    cluster: Cluster | str,
    example_inputs: Sequence[torch.Tensor],
    *,
    global_batch_size: int,
    loss_fn: LossFn | None = None,
    example_targets: Sequence[torch.Tensor] = (),
    precision: str = "fp32",
    optimizer: str = "adam",
    profile: ProfileDB | None = None,
    space: SearchSpace | None = None,
    config: ParallelConfig | None = None,
    reduce_repeated: bool = True,
) -> tuple[TrainingEstimate, list[TrainingEstimate]]:
    """The planner's joint search: the fastest configuration that fits, and every one it priced
    (``config``: only that configuration, its stage boundaries searched)."""
    best, every, _ = _search(
        model, cluster, example_inputs, global_batch_size=global_batch_size, loss_fn=loss_fn,
        example_targets=example_targets, precision=precision, optimizer=optimizer, profile=profile, space=space,
        config=config, reduce_repeated=reduce_repeated,
    )  # fmt: skip
    return best, every


def _search(
    model: torch.nn.Module,
    cluster: Cluster | str,
    example_inputs: Sequence[torch.Tensor],
    *,
    global_batch_size: int,
    loss_fn: LossFn | None,
    example_targets: Sequence[torch.Tensor],
    precision: str,
    optimizer: str,
    profile: ProfileDB | None,
    space: SearchSpace | None,
    config: ParallelConfig | None,
    reduce_repeated: bool,
) -> tuple[TrainingEstimate, list[TrainingEstimate], SegmentCostModel]:
    """:func:`search_config`, and the cost model it priced with (its traces serve the stage ILP)."""
    cluster = as_cluster(cluster)
    if global_batch_size < 1:
        raise ConfigError(f"global_batch_size must be a positive integer, got {global_batch_size!r}")
    master = _master_weights(model, precision)
    model, inputs, targets = prepare_for_precision(model, example_inputs, example_targets, precision)
    costs = SegmentCostModel(
        model, inputs, loss_fn, targets, cluster, optimizer=optimizer, profile=profile,
        reduce_repeated=reduce_repeated, extrapolate_batch=reduce_repeated, master_weights=master,
    )  # fmt: skip
    costs._traced(MIN_BASE_BATCH)  # noqa: SLF001 - learn the number of blocks (and a base, autoplan.passes.rebatch)
    if config is not None:
        _check_config(
            config, cluster, costs.num_blocks, global_batch_size, experts=costs.routed_experts(),
            tokens=_tokens_per_sample(inputs),
        )  # fmt: skip
        if config.stage_dp is not None:
            raise ConfigError("a config with stage_dp fixes the stages: price it with autoplan.estimate")
        space = _space_for(config)
    progress.step(f"searching degrees, stages, schedules for {cluster.world_size} devices")
    best, every = search(
        costs,
        cluster,
        num_blocks=costs.num_blocks,
        global_batch_size=global_batch_size,
        space=space,
        precision=precision,
        tokens_per_sample=_tokens_per_sample(inputs),
        experts=costs.routed_experts(),
    )
    return best, every, costs


__all__ = ["SegmentCostModel", "estimate", "plan_for_batch", "search_config"]


# --- plans made with a global batch -------------------------------------------------------------


def _master_weights(model: torch.nn.Module, precision: str) -> bool:
    """Whether the step of ``model`` in ``precision`` keeps fp32 master weights (:func:`keeps_master_weights`
    over its trained floating-point parameters): the plan is priced, recorded
    (:attr:`PipelineLayout.master_weights`) and checked at run time with it."""
    return keeps_master_weights(
        (p.element_size() for p in model.parameters() if p.requires_grad and p.is_floating_point()), precision
    )


def _restrict_for_config(table: StrategyTable, traced: TracedProgram, config: ParallelConfig) -> None:
    """Data parallelism as the search priced it: inputs and targets split along the batch on the
    ``dp`` axis; parameters replicated on ``dp`` (ZeRO 0-2) or sharded on it (ZeRO 3, where the
    shape allows); every op reads a parameter whole on ``dp`` (FSDP: gathered before use, never
    used as a shard) and never reads a value computed from the batch gathered whole on ``dp``
    (weight gradients are reduced, not made from gathered activations). Where an op has no such
    strategy it keeps all of its own.

    Without the last two rules the stage ILP may run a ZeRO-3 (or a sliced replicated) weight as a
    tensor-parallel shard over the ``dp`` axis and gather the activations instead (measured on 2
    CPU ranks, GPT-2-shaped: 36 activation all-gathers and 8 all-reduces over the whole batch on
    every rank), a program the search priced as data parallelism; tensor parallelism is the ``tp``
    axis's job, which the search prices separately. A ``cp`` axis splits the sequence
    (:func:`~autoplan.planner.mesh.restrict_context_parallel`, the rule the search's ILPs follow).
    ``sequence_parallel``: the ``tp`` axis holds the non-matmul activations split
    (:func:`~autoplan.planner.mesh.restrict_sequence_parallel`, as the search's ILPs priced it).
    A stage of one device runs every op replicated (the strategy table keeps only ``R`` on an
    axis of one device)."""
    cp_axis = context_parallel_axis(config)
    if cp_axis is not None:
        restrict_context_parallel(
            table, gradient_values(traced.graph_module.graph), axis=cp_axis, zero3=config.zero_stage >= 3
        )
    tp_axis = tensor_parallel_axis(config)
    if config.sequence_parallel and tp_axis is not None:
        restrict_sequence_parallel(table, traced.graph_module.graph, axis=tp_axis)
    if config.dp == 1:
        return
    dp_axes = data_parallel_axes(config)
    ep_axis = dp_axes[-1]  # ParallelConfig.stage_mesh: the ep axis last (one axis when ep is 1 or dp)
    fx_nodes = {n.name: n for n in traced.graph_module.graph.nodes}
    experts = _expert_parallel_on(table, fx_nodes, ep_axis) if config.ep > 1 else set()
    params = {name for name, ns in table.nodes.items() if ns.kind == "param"} - experts
    # values computed from the batch: activations, their gradients, weight gradients
    data = {name for name, ns in table.nodes.items() if ns.kind in ("input", "target")}
    for name, ns in list(table.nodes.items()):
        if ns.kind not in ("op", "fallback"):
            continue
        if any(ref.node in data for ref in ns.inputs):
            data.add(name)

        def allowed(s: Strategy, ns: NodeStrategies = ns) -> bool:
            for spec, ref in zip(s.input_specs, ns.inputs, strict=True):
                for axis in dp_axes:
                    placement = spec[axis]
                    whole = ref.node in params or (ref.node in experts and axis != ep_axis)
                    if whole and not isinstance(placement, Replicate):
                        return False  # a weight used as a shard of a dp axis (an expert: of its replicas' axis)
                    if ref.node in data and isinstance(placement, Replicate) and value_rank(fx_nodes.get(ref.node)) > 0:
                        return False  # a batch-split value gathered whole on every dp rank
            return True

        keep = tuple(s for s in ns.strategies if allowed(s))
        if keep and len(keep) < len(ns.strategies):
            table.nodes[name] = NodeStrategies(node=ns.node, kind=ns.kind, strategies=keep, inputs=ns.inputs)
    stored = Shard if config.zero_stage >= 3 else Replicate  # a parameter on a dp axis: ZeRO-3 or whole
    for name, ns in list(table.nodes.items()):
        if ns.kind not in ("param", "input"):
            continue
        if name in experts:
            axes = [a for a in dp_axes if a != ep_axis]
            keep = tuple(
                s for s in ns.strategies
                if s.output_specs[0][ep_axis] == Shard(0) and all(isinstance(s.output_specs[0][a], stored) for a in axes)
            )  # fmt: skip
        elif name.startswith("p_"):
            keep = tuple(s for s in ns.strategies if all(isinstance(s.output_specs[0][a], stored) for a in dp_axes))
        elif name.startswith(("input_", "target_")):
            keep = tuple(s for s in ns.strategies if all(s.output_specs[0][a] == Shard(0) for a in dp_axes))
        else:
            continue
        if keep:
            table.nodes[name] = NodeStrategies(node=ns.node, kind=ns.kind, strategies=keep, inputs=ns.inputs)


EXECUTABLE_SPACE = SearchSpace(
    schedules=SCHEDULES,
    recompute=EXECUTABLE_RECOMPUTE,
    zero_stages=EXECUTABLE_ZERO_STAGES,
    hetero_stages=False,
)
"""What ``autoplan.parallelize`` can run today: plans are searched in this space (the what-if
:func:`estimate` and :func:`search_config` also price ZeRO 1-2 and stages on sub-meshes of
different sizes)."""


def _expert_parallel_on(table: StrategyTable, fx_nodes: Mapping[str, torch.fx.Node], ep_axis: int) -> set[str]:
    """``ParallelConfig.ep > 1``: every MoE op keeps only its strategies that run expert
    parallelism on the ``ep_axis`` (``dp``, or ``ep`` when smaller than dp: tokens and experts
    split there, the all-to-all dispatch of :mod:`autoplan.passes.moe`); returns the expert
    weights they read, which the caller keeps split along the experts on that axis (never
    gathered there: the rule for other parameters)."""
    weights: set[str] = set()
    for name, ns in list(table.nodes.items()):
        node = fx_nodes.get(name)
        if node is None or node.target not in MOE_OPS:
            continue
        backward = is_moe_backward(node.target)
        keep = tuple(s for s in ns.strategies if ep_axes(s.input_specs, backward=backward) == [ep_axis])
        if not keep:
            raise PlanError(f"{name}: no expert-parallel strategy on the expert-parallel axis; plan with ep=1")
        table.nodes[name] = NodeStrategies(node=ns.node, kind=ns.kind, strategies=keep, inputs=ns.inputs)
        weights |= {w.name for w in expert_weights(node)}
    return weights


def _check_executable(config: ParallelConfig) -> None:
    bad = [f"{name}={value}" for name, value, _ in unexecutable_fields(config)]  # the one rule: cost_models/config.py
    if bad:
        raise ConfigError(
            f"{', '.join(bad)} can be estimated (autoplan.estimate) but not run yet: plan with schedule in "
            f"{EXECUTABLE_SPACE.schedules}, recompute in {EXECUTABLE_SPACE.recompute}, zero_stage in "
            f"{EXECUTABLE_SPACE.zero_stages} and without stage_dp"
        )


def _space_for(config: ParallelConfig) -> SearchSpace:
    """A search space holding exactly ``config`` (stage boundaries still searched)."""
    schedule = config.schedule if config.pp > 1 else "none"
    return SearchSpace(
        schedules=(schedule,),
        virtual_stages=(config.virtual_stages,),
        recompute=(config.recompute,),
        zero_stages=(config.zero_stage,),
        offload_optimizer=(config.offload_optimizer,),
        sharded_grad_accumulation=(config.sharded_grad_accumulation,),
        expert_parallel=(config.ep > 1,),
        context_parallel=(config.cp > 1,),
        sequence_parallel=(config.sequence_parallel,),
        context_parallel_min_tokens=0,
        microbatch_sizes=(config.microbatch_size,),
        per_stage_recompute=False,
        hetero_stages=False,
        fixed=config.canonical(),
    )


def plan_for_batch(
    model: torch.nn.Module,
    cluster: Cluster,
    *,
    example_inputs: Sequence[torch.Tensor],
    loss_fn: LossFn | None,
    example_targets: Sequence[torch.Tensor],
    global_batch_size: int,
    precision: str = "fp32",
    optimizer: str = "adam",
    profile: ProfileDB | None = None,
    space: SearchSpace | None = None,
    time_limit_s: float = 120.0,
    solver: str = "auto",
    config: ParallelConfig | None = None,
    reduce_repeated: bool = True,
) -> Plan:
    """The joint search, then the placements of one stage's program for the chosen config.
    ``config`` fixes the degrees and knobs (the search then only places the stage boundaries).
    The search covers what the runtime executes (:data:`EXECUTABLE_SPACE`) unless ``space`` says
    otherwise. ``reduce_repeated``: plan on two traced blocks standing for all of them
    (:mod:`autoplan.passes.depth`, :mod:`autoplan.passes.expand`); False traces and solves the full depth."""
    if config is not None:
        _check_executable(config)
    space = space or EXECUTABLE_SPACE
    t0 = time.perf_counter()
    options = {
        "global_batch_size": global_batch_size, "precision": precision, "optimizer": optimizer, "space": repr(space),
        "time_limit_s": time_limit_s, "solver": solver, "config": config.to_dict() if config else None,
        "reduce_repeated": reduce_repeated,
    }  # fmt: skip
    key = plan_cache.plan_key(model, example_inputs, example_targets, loss_fn, cluster, options, profile)
    cached = _cached_plan(key, model, example_inputs, example_targets, loss_fn)
    if cached is not None:
        return cached
    best, every, costs = _search(
        model, cluster, example_inputs, global_batch_size=global_batch_size, loss_fn=loss_fn,
        example_targets=example_targets, precision=precision, optimizer=optimizer, profile=profile, space=space,
        config=config, reduce_repeated=reduce_repeated,
    )  # fmt: skip
    cfg = best.config
    traced, layering, num_blocks = _stage_program(costs, cfg, loss_fn, reduce_repeated=reduce_repeated)
    reduction: dict[str, int] = {}
    sub = stage_cluster(cluster, cfg)
    with planning_mesh(sub) as mesh:
        stage = plan_traced(
            traced, sub, mesh=mesh, optimizer=optimizer, time_limit_s=time_limit_s, solver=solver, profile=profile,
            restrict=lambda table, tr: _restrict_for_config(table, tr, cfg),
            adjust=functools.partial(_full_depth, traced=traced, layering=layering, num_blocks=num_blocks,
                                     reduction=reduction),
        )  # fmt: skip
    stage_shape, stage_names = cfg.stage_mesh()
    layout = PipelineLayout(
        stage_starts=best.stage_starts,
        stage_recompute=best.stage_recompute,
        segment_names=("prologue", *(f"{layering.block_prefix}.{i}" for i in range(num_blocks)), "epilogue"),
        stage_mesh_shape=stage_shape,
        stage_axis_names=stage_names,
        global_batch_size=global_batch_size,
        precision=precision,
        block_list=layering.block_prefix,
        traced_blocks=layering.num_blocks,
        master_weights=costs.master_weights,
    )
    solver_info = {
        **stage.solver, "plan_time_s": round(time.perf_counter() - t0, 3), "reduction": reduction,
        "configurations_priced": len(every),
    }  # fmt: skip
    result = dataclasses.replace(
        stage, cluster=cluster, estimate=_stage_estimate(best, stage), config=cfg, pipeline=layout, solver=solver_info,
        configurations=weighed_configurations(best, every),
    )  # fmt: skip
    if plan_cache.enabled():
        forward = plan_forward_fingerprint(result, model, example_inputs, example_targets, loss_fn)
        plan_cache.store(key, plan_cache.CacheEntry(plan=result, forward_fingerprint=forward))
    return result


def _cached_plan(
    key: str,
    model: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    example_targets: Sequence[torch.Tensor],
    loss_fn: LossFn | None,
) -> Plan | None:
    """The plan cache's entry for ``key`` if the model still exports to the graph it was made for."""
    cached = plan_cache.load(key)
    if cached is None or cached.plan.config is None or cached.plan.pipeline is None:
        return None
    # the key sees the forward of every module class, not the helpers they call: the entry
    # counts only if the model still exports to the graph the plan was made for
    now = plan_forward_fingerprint(cached.plan, model, example_inputs, example_targets, loss_fn)
    if now == cached.forward_fingerprint:
        log.info("plan cache hit (forward fingerprint %s)", now)
        return cached.plan
    log.info("stale plan cache entry (forward %s, now %s): re-planning", cached.forward_fingerprint, now)
    return None


def _stage_program(
    costs: SegmentCostModel, cfg: ParallelConfig, loss_fn: LossFn | None, *, reduce_repeated: bool
) -> tuple[TracedProgram, Layering, int]:
    """The program of one stage's micro-batch (``dp * microbatch_size`` samples), its layering and
    the model's number of blocks.

    The repeated blocks are traced once (autoplan.passes.depth) and solved with the copies'
    variables shared (autoplan.passes.expand). It must be the graph parallelize traces
    (trace_for_plan): from 2 samples on, the cost model's derived traces are that graph exactly
    (autoplan.passes.rebatch); one sample is traced on its own."""
    samples = cfg.microbatch_size * cfg.dp
    if samples >= MIN_BASE_BATCH:
        traced, layering = costs._traced(samples)  # noqa: SLF001
        return traced, layering, costs.num_blocks
    return trace_repeated(
        costs.model, costs.example_inputs, costs.example_targets, loss_fn, samples, reduce=reduce_repeated
    )


def _full_depth(
    problem: CostProblem, *, traced: TracedProgram, layering: Layering, num_blocks: int, reduction: dict[str, int]
) -> CostProblem:
    """The stage ILP's ``adjust``: the traced blocks stand for all ``num_blocks``
    (autoplan.passes.expand), with the memory tie-break; memory is the outer search's constraint.
    Records in ``reduction`` the decision variables (one per node and strategy) and edges, solved
    vs standing for."""
    mult = block_multiplicity(layering, num_blocks)
    twin = twins(traced.graph_module, layering)
    reduction.update(
        traced_blocks=layering.num_blocks,
        num_blocks=num_blocks,
        nodes=len(problem.node_time_s),
        nodes_full_depth=sum(mult.get(n, 1) for n in problem.node_time_s),
        x_variables=sum(len(t) for t in problem.node_time_s.values()),
        x_variables_full_depth=sum(len(t) * mult.get(n, 1) for n, t in problem.node_time_s.items()),
        edges=len(problem.edges),
        edges_full_depth=sum(mult.get(e.consumer, 1) for e in problem.edges),
    )
    problem = pass_order.EXPAND(memory_tie_break(problem), mult, twin)
    return dataclasses.replace(problem, capacity_bytes=float("inf"), memory_points=[])


MAX_CONFIGURATIONS = 12
"""Combinations of degrees a plan records (:func:`weighed_configurations`)."""


def weighed_configurations(best: TrainingEstimate, every: Sequence[TrainingEstimate]) -> tuple[ConfigOption, ...]:
    """``best`` and, per other combination of degrees (``dp, cp, tp, pp, ep``) among ``every``
    configuration the search priced, its fastest that fits (else its least memory-hungry): those
    that fit by step time, then the others by memory, at most :data:`MAX_CONFIGURATIONS` in all."""

    def degrees(e: TrainingEstimate) -> tuple[int, ...]:
        return (e.config.dp, e.config.cp, e.config.tp, e.config.pp, e.config.ep)

    best_of: dict[tuple[int, ...], TrainingEstimate] = {}
    for e in every:
        k = degrees(e)
        if k != degrees(best) and (k not in best_of or estimate_order(e) < estimate_order(best_of[k])):
            best_of[k] = e
    others = sorted(best_of.values(), key=estimate_order)
    return tuple(
        ConfigOption(
            config=e.config, step_time_s=e.step_time_s, compute_s=e.compute_s, exposed_comm_s=e.exposed_comm_s,
            bubble_s=e.bubble_s, peak_memory_bytes=e.peak_memory_bytes, feasible=e.feasible, parts=e.parts,
        )  # fmt: skip
        for e in (best, *others)[:MAX_CONFIGURATIONS]
    )


def _stage_estimate(best: TrainingEstimate, stage: Plan) -> Estimate:
    """The plan's estimate: the search's numbers for the whole pipeline, memory of its fullest
    stage, and the stage ILP's count of profiled op times."""
    worst = max(range(len(best.memory_parts_bytes)), key=lambda k: sum(best.memory_parts_bytes[k].values()))
    parts = dict(best.memory_parts_bytes[worst])
    return Estimate(
        step_time_s=best.step_time_s,
        compute_s=best.compute_s,
        comm_s=best.comm.total_s,
        memory_bytes={**parts, "total": best.peak_memory_bytes},
        capacity_bytes=best.capacity_bytes,
        memory_peak_at=f"stage {worst}",
        compute_sources=stage.estimate.compute_sources,
        exposed_comm_s=best.exposed_comm_s,
        bubble_s=best.bubble_s,
        mfu=best.mfu,
        tokens_per_s=best.tokens_per_s,
        memory_per_device_bytes=best.memory_per_device_bytes,
        comm=best.comm,
        step_parts=best.parts,
    )
