"""The public pipeline: trace -> strategies -> cost -> solve -> plan, then apply.

``plan()`` decides and returns a :class:`~autoplan.planner.plan.Plan` (no process group needed: a fake
one stands in for big clusters). ``parallelize()`` applies a plan inside a ``torchrun`` job and
returns a :class:`ParallelModel` that trains exactly like the single-device model.
"""

from __future__ import annotations

import contextlib
import fnmatch
import gc
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.comm import overlaps_compute, transition_cost_s
from autoplan.cost_models.compute import tensor_bytes
from autoplan.cost_models.config import PRECISIONS, ParallelConfig
from autoplan.cost_models.errors import ClusterSpecError, ConfigError, PlanError, PlanMismatchError
from autoplan.cost_models.memory import OPTIMIZERS
from autoplan.cost_models.profile_db import DeviceKey, ProfileDB, default_db_path
from autoplan.passes import liveness
from autoplan.passes.costing import CostProblem, build_cost_problem
from autoplan.passes.explain import explain_choices
from autoplan.passes.overlap import schedule_step
from autoplan.passes.placement import parse_spec, spec_str, spec_strs
from autoplan.passes.strategies import NodeStrategies, StrategyTable, ValueRef, build_strategy_table
from autoplan.passes.trace import LossFn, TracedProgram, param_node_name, trace_training_step
from autoplan.planner import progress
from autoplan.planner.plan import CollectiveRecord, Estimate, Plan, software_versions
from autoplan.planner.solver import ShardingILP, SolverOptions
from autoplan.runtime.codegen import edge_redistributions, generate_program
from autoplan.runtime.parallel import ParallelModel
from autoplan.runtime.pipeline import PipelineModel

log = logging.getLogger(__name__)

Pins = Mapping[str, str | Sequence[str]]


def _as_cluster(cluster: Cluster | str) -> Cluster:
    if isinstance(cluster, str):
        return Cluster.preset(cluster)
    if not isinstance(cluster, Cluster):
        raise ClusterSpecError(
            f"cluster must be an autoplan.Cluster or a preset string like '4xCPU' or '2x8xH100', "
            f"got {type(cluster).__name__} {cluster!r}"
        )
    return cluster


@contextlib.contextmanager
def planning_mesh(cluster: Cluster, *, device_type: str = "cpu") -> Iterator[DeviceMesh]:
    """A DeviceMesh of the cluster's shape for strategy enumeration.

    Inside a job of the right size the real mesh is used; otherwise a fake process group of
    ``cluster.world_size`` ranks is created for the duration (nothing is communicated).
    ``device_type="cuda"`` gives a mesh whose DTensors live on the GPU (``autoplan profile``).
    """
    if dist.is_initialized():
        if dist.get_world_size() != cluster.world_size:
            raise PlanMismatchError(
                f"cannot plan for {cluster.world_size} devices inside a {dist.get_world_size()}-rank job: "
                "plan outside torchrun (autoplan plan ...) or use a cluster of the job's size"
            )
        yield init_device_mesh(device_type, cluster.mesh_shape, mesh_dim_names=cluster.mesh_axis_names)
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cluster.world_size)
    try:
        yield init_device_mesh(device_type, cluster.mesh_shape, mesh_dim_names=cluster.mesh_axis_names)
    finally:
        dist.destroy_process_group()


def _placeholder_of(traced: TracedProgram, pattern: str) -> list[str]:
    """Placeholders a pin names: ``input_<i>`` / ``target_<i>`` exactly, parameters by FQN glob."""
    if pattern in {f"input_{i}" for i in range(traced.num_inputs)} | {f"target_{i}" for i in range(traced.num_targets)}:
        return [pattern]
    return [param_node_name(n) for n in traced.param_names if fnmatch.fnmatchcase(n, pattern)]


def _apply_pins(table: StrategyTable, traced: TracedProgram, pins: Pins) -> None:
    """Restrict pinned placeholders (params by FQN glob, ``input_<i>``, ``target_<i>``) to one spec."""
    ndim = len(table.mesh_shape)
    example = ",".join(["R"] * ndim)
    for pattern, value in pins.items():
        if isinstance(value, str):
            texts = [t.strip() for t in value.split(",")]
        elif isinstance(value, Sequence) and all(isinstance(t, str) for t in value):
            texts = list(value)
        else:
            raise PlanError(
                f"pin {pattern!r}: expected a placement string like {example!r} or a list of placements, got {value!r}"
            )
        try:
            spec = parse_spec(texts)
        except ValueError as exc:
            raise PlanError(f"pin {pattern!r}: {exc}") from exc
        if len(spec) != ndim:
            raise PlanError(
                f"pin {pattern!r} gives {len(spec)} placements but the mesh has {ndim} axes {table.mesh_shape}: "
                f"give one placement per mesh axis, like {example!r}"
            )
        matched = _placeholder_of(traced, pattern)
        if not matched:
            raise PlanError(
                f"pin {pattern!r} matches no parameter or input; parameters look like {traced.param_names[0]!r}, "
                "inputs like 'input_0'"
            )
        for node in matched:
            ns = table.nodes[node]
            keep = tuple(s for s in ns.strategies if s.output_specs[0] == spec)
            if not keep:
                shape = tuple(_node_shape(traced, node))
                raise PlanError(
                    f"pin {pattern!r}: {spec_str(spec)} is not a valid layout for {node} of shape {shape} on mesh "
                    f"{table.mesh_shape} (a sharded dim must exist and hold at least one element per device): "
                    f"pin another dim, 'R', or use a larger size"
                )
            table.nodes[node] = NodeStrategies(node=ns.node, kind=ns.kind, strategies=keep, inputs=ns.inputs)


def _node_shape(traced: TracedProgram, name: str) -> Sequence[int]:
    node = next(n for n in traced.graph_module.graph.nodes if n.name == name)
    val = node.meta.get("val")
    return val.shape if isinstance(val, torch.Tensor) else ()


def check_plan_fits(plan: Plan, traced: TracedProgram) -> None:
    """The pre-launch check of ``autoplan run --plan`` (once, before any rank starts):
    :meth:`Plan.check_fits` with the strategy table of ``traced`` on the plan's mesh (the stage
    mesh for a plan made for a global batch), built on a fake process group, so a hand edit that
    pairs placements an operator cannot run is named instead of training wrongly."""
    from autoplan.planner.joint import stage_cluster

    mesh_cluster = plan.cluster if plan.config is None else stage_cluster(plan.cluster, plan.config)
    plan.check_fits(traced)  # names, counts and ranks first: a table of a misfit plan means nothing
    with planning_mesh(mesh_cluster) as mesh:
        table = build_strategy_table(traced, mesh)
    plan.check_fits(traced, table=table)


ProfileChoice = ProfileDB | str | os.PathLike[str] | None


def open_profile(cluster: Cluster, profile: ProfileChoice = "auto") -> ProfileDB | None:
    """The profile database planning for ``cluster`` uses.

    ``"auto"``: the database ``autoplan profile`` wrote for this machine's device, if the
    cluster is made of that device (a CPU cluster planned on a CPU; a GPU cluster planned on a
    machine with that GPU) and the file exists; else none (analytic times). A path: that file,
    whatever machine measured it (plan a GPU cluster from a laptop with a profile taken on the
    GPU). ``None``: analytic times only."""
    if profile is None or isinstance(profile, ProfileDB):
        return profile
    if profile != "auto":
        return ProfileDB.load(profile)
    if cluster.device.name == "CPU":
        key = DeviceKey.current("cpu")
    elif torch.cuda.is_available() and cluster.device.name.lower() in torch.cuda.get_device_name().lower():
        key = DeviceKey.current("cuda")
    else:
        return None
    path = default_db_path(key)
    return ProfileDB.load(path, expect=key) if path.exists() else None


def plan_traced(
    traced: TracedProgram,
    cluster: Cluster,
    *,
    mesh: DeviceMesh,
    optimizer: str = "adam",
    pins: Pins | None = None,
    time_limit_s: float = 120.0,
    solver: str = "auto",
    profile: ProfileDB | None = None,
    restrict: Callable[[StrategyTable, TracedProgram], None] | None = None,
    adjust: Callable[[CostProblem], CostProblem] | None = None,
) -> Plan:
    """Plan an already traced training step on ``mesh`` (the cluster's shape); op times come
    from ``profile`` where it has them (see :func:`open_profile`). ``restrict`` may remove
    strategies from the table after the pins (e.g. the data-parallel layout a configuration fixes);
    ``adjust`` may rewrite the cost problem before the ILP (e.g. repeated blocks' multiplicity)."""
    t0 = time.perf_counter()
    progress.step(f"placement strategies for {len(traced.graph_module.graph.nodes)} nodes")
    table = build_strategy_table(traced, mesh)
    _apply_pins(table, traced, pins or {})
    if restrict is not None:
        restrict(table, traced)
    progress.step("pricing strategies and conversions")
    problem = build_cost_problem(traced, table, cluster, optimizer=optimizer, profile=profile)
    if adjust is not None:
        problem = adjust(problem)
    progress.step(f"solving the placement ILP ({sum(len(t) for t in problem.node_time_s.values()):,} choices)")
    solution = ShardingILP(problem, SolverOptions(time_limit_s=time_limit_s, backend=solver)).solve()
    assignment = {name: table.nodes[name].strategies[s] for name, s in solution.choice.items()}

    gm = traced.graph_module
    node_by_name = {n.name: n for n in gm.graph.nodes}
    redistributions = edge_redistributions(traced, assignment, cluster.mesh_ndim)
    times_s = []
    buckets_seen: set[str] = set()
    for r in redistributions:
        nbytes = _value_bytes(node_by_name, r.producer)
        t = transition_cost_s(r.src, r.dst, nbytes, cluster, include_latency=r.bucket is None)
        if r.bucket is not None and r.bucket not in buckets_seen:
            buckets_seen.add(r.bucket)
            t += transition_cost_s(r.src, r.dst, 0, cluster)  # the bucket's latency, paid once
        times_s.append(t)
    chosen_time_s = {n: problem.node_time_s[n][s] for n, s in solution.choice.items()}
    schedule = schedule_step(
        gm,
        chosen_time_s,
        redistributions,
        times_s,
        param_nodes=[param_node_name(n) for n in traced.param_names],
        device_overlaps=overlaps_compute(cluster.device),
    )
    collectives = tuple(
        CollectiveRecord(
            producer=str(r.producer),
            consumer=r.consumer,
            arg_index=r.arg_index,
            src=tuple(spec_strs(r.src)),
            dst=tuple(spec_strs(r.dst)),
            steps=tuple((s.kind, s.axis) for s in r.steps),
            time_s=t,
            bucket=r.bucket,
            overlappable=sc.overlappable,
            exposed_s=sc.exposed_s,
        )
        for r, t, sc in zip(redistributions, times_s, schedule.collectives, strict=True)
    )
    profiled = sum(problem.node_time_profiled[n][s] for n, s in solution.choice.items())
    frozen = {param_node_name(n) for n in traced.frozen_names}  # no optimizer step to time
    timed = sum(1 for n in solution.choice if table.nodes[n].kind in ("op", "fallback", "param") and n not in frozen)
    param_nodes = [param_node_name(n) for n in traced.param_names]
    memory = liveness.peak_memory(
        gm,
        liveness.analyze(gm, [param_node_name(n) for n in traced.trainable_names]),
        assignment,
        redistributions,
        mesh_shape=cluster.mesh_shape,
        optimizer=optimizer,
        param_nodes=param_nodes,
        device_kind="cpu" if cluster.device.name == "CPU" else "cuda",
    )
    nodes = {}
    for name, strat in assignment.items():
        ns = table.nodes[name]
        if ns.kind in ("op", "fallback"):
            nodes[name] = {
                "op": str(node_by_name[name].target),
                "out": [spec_strs(s) if s is not None else None for s in strat.output_specs],
                "in": [spec_strs(s) for s in strat.input_specs],
            }
    param_specs = {n: tuple(spec_strs(assignment[param_node_name(n)].output_specs[0])) for n in traced.param_names}
    plan = Plan(
        fingerprint=traced.fingerprint,
        cluster=cluster,
        optimizer=optimizer,
        param_names=traced.param_names,
        input_specs=tuple(tuple(spec_strs(assignment[f"input_{i}"].output_specs[0])) for i in range(traced.num_inputs)),
        target_specs=tuple(
            tuple(spec_strs(assignment[f"target_{i}"].output_specs[0])) for i in range(traced.num_targets)
        ),
        param_specs=param_specs,
        nodes=nodes,
        fallback_ops=dict(table.fallback_ops),
        collectives=collectives,
        estimate=Estimate(
            step_time_s=schedule.step_time_s,
            compute_s=schedule.compute_s,
            comm_s=schedule.comm_s,
            exposed_comm_s=schedule.exposed_comm_s,
            compute_sources={"profiled": profiled, "analytic": timed - profiled},
            memory_bytes=memory.as_dict(),
            memory_peak_at=memory.peak_at,
            capacity_bytes=float(cluster.device.mem_capacity_bytes),
        ),
        solver={
            "status": solution.status,
            "method": solution.method,
            "gap": solution.gap,
            "objective_s": solution.objective_s,
            "solve_time_s": round(solution.solve_time_s, 3),
            "num_variables": solution.num_variables,
            "num_constraints": solution.num_constraints,
            "plan_time_s": round(time.perf_counter() - t0 + traced.trace_time_s, 3),
        },
        alternatives=explain_choices(problem, solution.choice),
        versions=software_versions(),
    )
    log.info("plan %s: %s", plan.fingerprint, plan.parallelism())
    return plan


def _value_bytes(node_by_name: Mapping[str, torch.fx.Node], ref: ValueRef) -> int:
    val = node_by_name[ref.node].meta["val"]
    return tensor_bytes(val[ref.index] if isinstance(val, (tuple, list)) else val)


def _check_optimizer(optimizer: str) -> None:
    if optimizer not in OPTIMIZERS:
        raise PlanError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)}")


def _check_time_limit(time_limit_s: float) -> None:
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or not 0 < time_limit_s < math.inf:
        raise PlanError(f"time_limit_s must be a positive number of seconds, got {time_limit_s!r}: e.g. 120")


GC_GEN0_THRESHOLD = 100_000
"""Allocations between two young-generation garbage collections while planning (Python's default
is 700). Tracing and the ILPs allocate millions of short-lived objects next to a large live
model graph; each default collection cascade rescanned that graph and took 15-20% of the
planning time of Llama-3-8B (measured: 19.3 s -> 17.0 s end to end)."""


@contextlib.contextmanager
def _few_gc_passes() -> Iterator[None]:
    """Collect garbage less often while planning (:data:`GC_GEN0_THRESHOLD`; older generations
    every 50 and 1000 young collections); the caller's thresholds are restored afterwards."""
    old = gc.get_threshold()
    gc.set_threshold(max(old[0], GC_GEN0_THRESHOLD), max(old[1], 50), max(old[2], 1000))
    try:
        yield
    finally:
        gc.set_threshold(*old)


def plan(
    model: torch.nn.Module,
    cluster: Cluster | str,
    *,
    example_inputs: Sequence[torch.Tensor],
    loss_fn: LossFn | None = None,
    example_targets: Sequence[torch.Tensor] = (),
    optimizer: str = "adam",
    pins: Pins | None = None,
    time_limit_s: float = 120.0,
    solver: str = "auto",
    profile: ProfileChoice = "auto",
    global_batch_size: int | None = None,
    precision: str = "fp32",
    config: ParallelConfig | None = None,
    reduce_repeated: bool = True,
) -> Plan:
    """Plan data/tensor/sequence/parameter sharding of one training step of ``model``.

    With ``global_batch_size`` the plan comes from the joint search (:mod:`autoplan.planner.joint`):
    data/tensor/pipeline degrees, micro-batches, schedule, recomputation and ZeRO stage, with
    the per-operator ILP inside each stage; ``plan.config`` holds the chosen configuration and
    ``example_inputs`` only give the per-sample shapes. ``config`` fixes the configuration
    (degrees, micro-batches, schedule, recomputation, ZeRO); the search then places the stages.
    These plans trace two of the model's repeated blocks and solve one for all of them
    (``reduce_repeated``; :mod:`autoplan.passes.depth`); ``parallelize`` repeats the placements on every block.

    ``model`` may live on the ``meta`` device. ``loss_fn(output, *example_targets)`` must return
    a scalar (omit it if the model returns its loss). ``pins`` fixes placements, e.g.
    ``{"layers.*.mlp.up.weight": "R,S(0)", "input_0": "S(0),R"}``. ``solver`` is ``"auto"``
    (HiGHS when installed, else PuLP's bundled CBC), ``"highs"`` or ``"cbc"``. ``profile``
    chooses measured op times (:func:`open_profile`); the plan's estimate says how many it used.
    """
    with _few_gc_passes():
        cluster = _as_cluster(cluster)
        _check_optimizer(optimizer)
        _check_time_limit(time_limit_s)
        if precision not in PRECISIONS:
            raise ConfigError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
        if global_batch_size is not None:
            from autoplan.planner.joint import plan_for_batch

            if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
                raise ConfigError(
                    f"global_batch_size must be a positive integer (samples per optimizer step), got {global_batch_size!r}"
                )
            return plan_for_batch(
                model, cluster, example_inputs=example_inputs, loss_fn=loss_fn, example_targets=example_targets,
                global_batch_size=global_batch_size, precision=precision, optimizer=optimizer,
                profile=open_profile(cluster, profile), time_limit_s=time_limit_s, solver=solver, config=config,
                reduce_repeated=reduce_repeated,
            )  # fmt: skip
        if config is not None:
            raise ConfigError(
                "config= needs global_batch_size= (the configuration splits a global batch): pass both, or neither"
            )
        progress.step("tracing the model (torch.export)")
        traced = trace_training_step(model, example_inputs, loss_fn=loss_fn, example_targets=example_targets)
        db = open_profile(cluster, profile)
        with planning_mesh(cluster) as mesh:
            return plan_traced(
                traced,
                cluster,
                mesh=mesh,
                optimizer=optimizer,
                pins=pins,
                time_limit_s=time_limit_s,
                solver=solver,
                profile=db,
            )


def _plan_on_rank0(
    traced: TracedProgram,
    cluster: Cluster,
    *,
    mesh: DeviceMesh,
    device: torch.device,
    optimizer: str,
    pins: Pins | None,
    profile: ProfileChoice,
) -> Plan:
    """Rank 0 solves; every rank receives the same plan as JSON bytes (so all ranks run one plan)."""
    import json

    payload = b""
    if dist.get_rank() == 0:
        try:
            payload = json.dumps(
                plan_traced(
                    traced, cluster, mesh=mesh, optimizer=optimizer, pins=pins, profile=open_profile(cluster, profile)
                ).to_dict()
            ).encode()
        except PlanError as exc:
            payload = json.dumps({"error": str(exc), "type": type(exc).__name__}).encode()
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == 0:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buf, src=0)
    data = json.loads(buf.cpu().numpy().tobytes().decode())
    if "error" in data:
        import autoplan.errors as errors

        raise getattr(errors, data["type"], PlanError)(data["error"])
    return Plan.from_dict(data)


def _runtime_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _parallelize_pipeline(
    model: torch.nn.Module,
    plan: Plan,
    inputs: tuple[torch.Tensor, ...],
    targets: tuple[torch.Tensor, ...],
    loss_fn: LossFn | None,
    device: torch.device,
) -> PipelineModel:
    """A plan made for a global batch: stages of one micro-batch's program, run by a
    ``torch.distributed.pipelining`` schedule (:mod:`autoplan.runtime.pipeline`)."""
    from autoplan.passes.layers import find_layers
    from autoplan.planner.joint import trace_for_plan
    from autoplan.runtime.pipeline import build_pipeline

    cfg, layout = plan.config, plan.pipeline
    assert cfg is not None and layout is not None
    planned = trace_for_plan(plan, model, inputs, targets, loss_fn)
    plan.check_applies_to(fingerprint=planned.fingerprint, world_size=dist.get_world_size())
    plan.check_fits(planned)
    traced, assignment = planned, plan.assignment()
    if layout.reduced:
        # placements of the program traced with fewer blocks: repeat its last block's
        # placements on every later block of the full program (autoplan.passes.expand)
        from autoplan.passes.expand import expand_assignment
        from autoplan.planner.joint import trace_microbatch

        traced = trace_microbatch(model, inputs, targets, loss_fn, cfg.microbatch_size * cfg.dp)
        assignment = expand_assignment(
            assignment, (planned, find_layers(planned)), (traced, find_layers(traced)), block_list=layout.block_list
        )
    layering = find_layers(traced)
    mesh = init_device_mesh(
        device.type, (cfg.pp, *layout.stage_mesh_shape), mesh_dim_names=("pp", *layout.stage_axis_names)
    )
    return build_pipeline(
        model,
        traced,
        assignment,
        layering,
        stage_starts=layout.stage_starts,
        mesh=mesh,
        axis_names=layout.stage_axis_names,
        schedule="gpipe" if cfg.pp == 1 else cfg.schedule,  # type: ignore[arg-type]
        num_microbatches=cfg.num_microbatches,
        virtual_stages=cfg.virtual_stages,
        fallback_nodes=frozenset(plan.fallback_ops),
        device=device,
        optimizer=plan.optimizer,
        stage_recompute=layout.stage_recompute,
    )


def parallelize(
    model: torch.nn.Module,
    cluster: Cluster | str,
    *,
    example_inputs: Sequence[torch.Tensor],
    loss_fn: LossFn | None = None,
    example_targets: Sequence[torch.Tensor] = (),
    plan: Plan | None = None,
    optimizer: str = "adam",
    pins: Pins | None = None,
    profile: ProfileChoice = "auto",
) -> ParallelModel | PipelineModel:
    """Apply ``plan`` (or plan now) to ``model`` inside a ``torchrun`` job.

    A plan made with a global batch (``plan.config`` set) runs as a pipeline of stages
    (:class:`~autoplan.runtime.pipeline.PipelineModel`, pipeline degree 1 included: micro-batches then
    accumulate gradients); ``example_inputs`` are then the global batch.

    Every rank must build the same model with the same weights. Returns a
    :class:`~autoplan.runtime.parallel.ParallelModel` whose parameters are DTensors in the planned
    placements and whose ``program`` is the generated per-rank step.
    """
    if cluster is not None or plan is None:  # with a plan, the plan's cluster is used
        cluster = _as_cluster(cluster)
    if not dist.is_initialized():
        raise PlanMismatchError(
            "parallelize() needs a process group: run under torchrun (autoplan run ...) "
            "or call torch.distributed.init_process_group first"
        )
    world = dist.get_world_size()
    if plan is not None:
        cluster = plan.cluster
    if world != cluster.world_size:
        raise PlanMismatchError(
            f"the job has {world} ranks but the {'plan' if plan else 'cluster'} is for {cluster.world_size} devices "
            f"({cluster}): launch with --nproc-per-node={cluster.world_size} or re-plan"
        )
    device = _runtime_device()
    model = model.to(device)
    inputs = tuple(t.to(device) for t in example_inputs)
    targets = tuple(t.to(device) for t in example_targets)
    if plan is not None and plan.config is not None:
        return _parallelize_pipeline(model, plan, inputs, targets, loss_fn, device)
    traced = trace_training_step(model, inputs, loss_fn=loss_fn, example_targets=targets)
    mesh = init_device_mesh(device.type, cluster.mesh_shape, mesh_dim_names=cluster.mesh_axis_names)
    if plan is None:
        _check_optimizer(optimizer)
        plan = _plan_on_rank0(
            traced, cluster, mesh=mesh, device=device, optimizer=optimizer, pins=pins, profile=profile
        )
    plan.check_applies_to(fingerprint=traced.fingerprint, world_size=world)
    plan.check_fits(traced)
    program = generate_program(
        traced,
        plan.assignment(),
        fallback_nodes=frozenset(plan.fallback_ops),
        axis_names=cluster.mesh_axis_names,
        device=device,
        mesh=mesh,
    )
    return ParallelModel(model=model, traced=traced, plan=plan, program=program, mesh=mesh, device=device)
