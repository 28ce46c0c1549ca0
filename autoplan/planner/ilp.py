"""The intra-operator plan of one traced step on one mesh: strategies, pins, costs, the ILP,
then the chosen program's collectives, overlap and memory, as a :class:`~autoplan.planner.plan.Plan`
(:func:`plan_traced`); the profile database it prices with (:func:`open_profile`) and the
pre-launch check of a hand-edited plan (:func:`check_plan_fits`)."""

from __future__ import annotations

import fnmatch
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.comm import link_time_s, overlaps_compute, step_bytes, transition_cost_s
from autoplan.cost_models.comm_schedule import CommRow, CommTotals
from autoplan.cost_models.compute import concurrent_compute_factor
from autoplan.cost_models.errors import PlanError
from autoplan.cost_models.memory import device_kind, mesh_groups, nvlink_multicast, tensor_bytes, usable_memory_bytes
from autoplan.cost_models.profile_db import DeviceKey, ProfileDB, default_db_path
from autoplan.passes import liveness, pass_order
from autoplan.passes.comm_order import CommSchedule
from autoplan.passes.costing import CostProblem
from autoplan.passes.liveness import MemoryEstimate
from autoplan.passes.moe import moe_exchanges
from autoplan.passes.overlap import StepSchedule
from autoplan.passes.placement import parse_spec, pin_admits, spec_str, spec_strs
from autoplan.passes.redistribute import Redistribution
from autoplan.passes.strategies import NodeStrategies, Strategy, StrategyTable, ValueRef
from autoplan.passes.trace import TracedProgram, param_node_name
from autoplan.planner import progress
from autoplan.planner.mesh import planning_mesh, stage_cluster
from autoplan.planner.plan import CollectiveRecord, Estimate, Plan, comm_totals, software_versions
from autoplan.planner.solver import ShardingILP, Solution, SolverOptions

log = logging.getLogger(__name__)

Pins = Mapping[str, str | Sequence[str]]


def _placeholder_of(traced: TracedProgram, pattern: str) -> list[str]:
    """Placeholders a pin names: ``input_<i>`` / ``target_<i>`` exactly, parameters by FQN glob."""
    if pattern in {f"input_{i}" for i in range(traced.num_inputs)} | {f"target_{i}" for i in range(traced.num_targets)}:
        return [pattern]
    return [param_node_name(n) for n in traced.param_names if fnmatch.fnmatchcase(n, pattern)]


def apply_pins(table: StrategyTable, traced: TracedProgram, pins: Pins) -> None:
    """Restrict pinned placeholders (params by FQN glob, ``input_<i>``, ``target_<i>``) to one spec
    (a pinned ``S(d)`` also keeps ``S(d)/k``, the same column split of a fused projection taken
    segment by segment: :func:`~autoplan.passes.placement.pin_admits`)."""
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
            keep = tuple(s for s in ns.strategies if pin_admits(spec, s.output_specs[0]))
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
    mesh_cluster = plan.cluster if plan.config is None else stage_cluster(plan.cluster, plan.config)
    plan.check_fits(traced)  # names, counts and ranks first: a table of a misfit plan means nothing
    with planning_mesh(mesh_cluster) as mesh:
        table = pass_order.STRATEGIES(traced, mesh)
    plan.check_fits(traced, table=table)


ProfileChoice = ProfileDB | str | os.PathLike[str] | None


def open_profile(cluster: Cluster, profile: ProfileChoice = "auto") -> ProfileDB | None:
    """The profile database planning for ``cluster`` uses.

    ``"auto"``: the database ``autoplan profile`` wrote for this machine's device, if the
    cluster is made of that device (a CPU cluster planned on a CPU, read at the ranks' thread
    count, :meth:`DeviceKey.cpu_ranks`; a GPU cluster planned on a machine with that GPU) and the
    file exists; else none (analytic times). A path: that file,
    whatever machine measured it (plan a GPU cluster from a laptop with a profile taken on the
    GPU). ``None``: analytic times only."""
    if profile is None or isinstance(profile, ProfileDB):
        return profile
    if profile != "auto":
        return ProfileDB.load(profile)
    if cluster.device.name == "CPU":
        key = DeviceKey.cpu_ranks()
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
    ``adjust`` may rewrite the cost problem before the ILP (e.g. repeated blocks' multiplicity).

    Phases: price the strategies (:func:`_price`), solve the ILP, then analyse the chosen program
    (its collectives :func:`_collective_times`, overlap, memory :func:`_peak_memory`) into the plan."""
    t0 = time.perf_counter()
    layering = pass_order.LAYERS(traced)  # (the communication order's prefetch windows)
    table, problem = _price(
        traced, cluster, mesh=mesh, optimizer=optimizer, pins=pins, profile=profile, restrict=restrict, adjust=adjust
    )
    progress.step(f"solving the placement ILP ({sum(len(t) for t in problem.node_time_s.values()):,} choices)")
    solution = ShardingILP(problem, SolverOptions(time_limit_s=time_limit_s, backend=solver)).solve()
    assignment = {name: table.nodes[name].strategies[s] for name, s in solution.choice.items()}

    redistributions = pass_order.REDISTRIBUTE(traced, assignment, cluster.mesh_ndim)
    order = pass_order.COMM_ORDER(
        traced.graph_module,
        redistributions,
        layering.segment_of,
        mesh_shape=cluster.mesh_shape,
    )
    times_s = _collective_times(traced, redistributions, order, cluster)
    chosen_time_s = {n: problem.node_time_s[n][s] for n, s in solution.choice.items()}
    schedule = pass_order.OVERLAP(
        traced.graph_module,
        chosen_time_s,
        redistributions,
        times_s,
        schedule=order,
        param_nodes=[param_node_name(n) for n in traced.param_names],
        device_overlaps=overlaps_compute(cluster.device),
        compute_slowdown=concurrent_compute_factor(cluster.device) - 1.0,
    )
    memory = _peak_memory(traced, assignment, redistributions, cluster, optimizer)
    records = _collective_records(redistributions, times_s, schedule, order)
    in_op = _in_op_exchanges(traced, assignment, cluster) + _ring_transfers(problem, solution.choice, cluster)
    in_op_exposed_s = sum(r.exposed_s for r in in_op)  # inside the ops' times: compute to communication
    estimate = Estimate(
        step_time_s=schedule.step_time_s,
        compute_s=schedule.compute_s - in_op_exposed_s,
        comm_s=schedule.comm_s + sum(r.total_s for r in in_op),
        exposed_comm_s=schedule.exposed_comm_s + in_op_exposed_s,
        compute_sources=_compute_sources(traced, table, problem, solution),
        memory_bytes=memory.as_dict(),
        memory_peak_at=memory.peak_at,
        capacity_bytes=usable_memory_bytes(
            cluster.device.mem_capacity_bytes, device_kind(cluster.device),
            mesh_groups(cluster.mesh_shape, cluster.devices_per_node), multicast=nvlink_multicast(cluster.device),
        ),  # fmt: skip
        comm=CommTotals.merge(
            (*comm_totals(records, cluster.mesh_axis_names, _step_costs(traced, redistributions, cluster)).rows, *in_op)
        ),
    )
    plan = Plan(
        fingerprint=traced.fingerprint,
        cluster=cluster,
        optimizer=optimizer,
        param_names=traced.param_names,
        input_specs=tuple(tuple(spec_strs(assignment[f"input_{i}"].output_specs[0])) for i in range(traced.num_inputs)),
        target_specs=tuple(
            tuple(spec_strs(assignment[f"target_{i}"].output_specs[0])) for i in range(traced.num_targets)
        ),
        param_specs={n: tuple(spec_strs(assignment[param_node_name(n)].output_specs[0])) for n in traced.param_names},
        param_layouts=dict(traced.param_layouts),
        nodes=_node_records(traced, table, assignment),
        fallback_ops=dict(table.fallback_ops),
        collectives=records,
        estimate=estimate,
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
        alternatives=pass_order.EXPLAIN(problem, solution.choice),
        versions=software_versions(),
    )
    log.info("plan %s: %s", plan.fingerprint, plan.parallelism())
    return plan


def _price(
    traced: TracedProgram,
    cluster: Cluster,
    *,
    mesh: DeviceMesh,
    optimizer: str,
    pins: Pins | None,
    profile: ProfileDB | None,
    restrict: Callable[[StrategyTable, TracedProgram], None] | None,
    adjust: Callable[[CostProblem], CostProblem] | None,
) -> tuple[StrategyTable, CostProblem]:
    """The strategy table (pinned, restricted) and the cost problem the ILP solves."""
    progress.step(f"placement strategies for {len(traced.graph_module.graph.nodes)} nodes")
    table = pass_order.STRATEGIES(traced, mesh)
    apply_pins(table, traced, pins or {})
    if restrict is not None:
        restrict(table, traced)
    progress.step("pricing strategies and conversions")
    problem = pass_order.COSTING(traced, table, cluster, optimizer=optimizer, profile=profile)
    if adjust is not None:
        problem = adjust(problem)
    return table, problem


def _collective_times(
    traced: TracedProgram, redistributions: Sequence[Redistribution], order: CommSchedule, cluster: Cluster
) -> list[float]:
    """Seconds of each redistribution; a gradient bucket (``order.buckets``) pays its latency
    once, on its first member."""
    node_by_name = {n.name: n for n in traced.graph_module.graph.nodes}
    times_s = []
    for r, slot in zip(redistributions, order.slots, strict=True):
        nbytes = _value_bytes(node_by_name, r.producer)
        bucketed = slot.bucket is not None
        t = transition_cost_s(r.src, r.dst, nbytes, cluster, include_latency=not bucketed)
        if slot.bucket is not None and order.buckets[slot.bucket][0] == slot.index:
            t += transition_cost_s(r.src, r.dst, 0, cluster)  # the bucket's latency, paid once
        times_s.append(t)
    return times_s


def _in_op_exchanges(traced: TracedProgram, assignment: Mapping[str, Strategy], cluster: Cluster) -> list[CommRow]:
    """The all-to-alls expert-parallel MoE ops run inside (:func:`autoplan.passes.moe.moe_exchanges`):
    priced in the ops' times, blocking (exposed), one row per op."""
    rows = []
    for node in traced.graph_module.graph.nodes:
        strategy = assignment.get(node.name)
        exchange = moe_exchanges(node, strategy.input_specs, cluster) if strategy is not None else None
        if exchange is not None:
            rows.append(
                CommRow(
                    kind="all_to_all",
                    axis=cluster.mesh_axis_names[exchange.axis],
                    count=exchange.count,
                    bytes=exchange.bytes,
                    total_s=exchange.time_s,
                    exposed_s=exchange.time_s,
                )  # fmt: skip
            )
    return rows


def _ring_transfers(problem: CostProblem, choice: Mapping[str, int], cluster: Cluster) -> list[CommRow]:
    """The ring shifts and zigzag moves of the attention ops that run a ring
    (:func:`autoplan.passes.ring_attention.ring_exchange`), one row per op: the exposed part is in
    the op's time, the rest overlaps the op's own blocks."""
    rows = []
    for name, rings in problem.ring_costs.items():
        ring = rings[choice[name]] if name in choice else None
        if ring is not None:
            rows.append(
                CommRow(
                    kind="send_recv",
                    axis=cluster.mesh_axis_names[ring.axis],
                    count=ring.count,
                    bytes=ring.bytes,
                    total_s=ring.total_s,
                    exposed_s=ring.exposed_s,
                )  # fmt: skip
            )
    return rows


def _step_costs(
    traced: TracedProgram, redistributions: Sequence[Redistribution], cluster: Cluster
) -> list[list[tuple[float, float]]]:
    """``(bytes, seconds)`` of each collective step of every redistribution, priced as
    :func:`~autoplan.cost_models.comm.transition_cost_s` prices the whole (the plan's per kind
    and mesh axis account splits a multi-step conversion by these)."""
    node_by_name = {n.name: n for n in traced.graph_module.graph.nodes}
    out = []
    for r in redistributions:
        full_bytes = _value_bytes(node_by_name, r.producer)
        cur, costs = list(r.src), []
        for step in r.steps:
            if step.is_collective:
                nbytes = step_bytes(step, cur, full_bytes, cluster.mesh_shape)
                link = cluster.axis_link(step.axis)
                t = link_time_s(step.kind, nbytes, cluster.mesh_shape[step.axis], link, backend=cluster.backend)
                costs.append((nbytes, t))
            cur[step.axis] = step.dst
        out.append(costs)
    return out


def _collective_records(
    redistributions: Sequence[Redistribution], times_s: Sequence[float], schedule: StepSchedule, order: CommSchedule
) -> tuple[CollectiveRecord, ...]:
    """The plan's record of each redistribution: layouts, steps, time and how much is exposed;
    ``bucket`` names the coalesced all-reduce the program runs it in (``<transition>#<n>``)."""
    return tuple(
        CollectiveRecord(
            producer=str(r.producer),
            consumer=r.consumer,
            arg_index=r.arg_index,
            src=tuple(spec_strs(r.src)),
            dst=tuple(spec_strs(r.dst)),
            steps=tuple((s.kind, s.axis) for s in r.steps),
            time_s=t,
            bucket=f"{r.bucket or 'gather'}#{slot.bucket}" if slot.bucket is not None else None,
            overlappable=sc.overlappable,
            exposed_s=sc.exposed_s,
            issue_s=sc.issue_s,
            finish_s=sc.finish_s,
        )
        for r, t, sc, slot in zip(redistributions, times_s, schedule.collectives, order.slots, strict=True)
    )


def _peak_memory(
    traced: TracedProgram,
    assignment: Mapping[str, Strategy],
    redistributions: Sequence[Redistribution],
    cluster: Cluster,
    optimizer: str,
) -> MemoryEstimate:
    """Peak bytes per device of the chosen program (:mod:`autoplan.passes.liveness`)."""
    gm = traced.graph_module
    return pass_order.LIVENESS(
        gm,
        liveness.analyze(gm, [param_node_name(n) for n in traced.trainable_names]),
        assignment,
        redistributions,
        mesh_shape=cluster.mesh_shape,
        optimizer=optimizer,
        param_nodes=[param_node_name(n) for n in traced.param_names],
        device_kind=device_kind(cluster.device),
    )


def _compute_sources(
    traced: TracedProgram, table: StrategyTable, problem: CostProblem, solution: Solution
) -> dict[str, int]:
    """How many of the chosen node times were measured (profile) and how many are analytic."""
    profiled = sum(problem.node_time_profiled[n][s] for n, s in solution.choice.items())
    frozen = {param_node_name(n) for n in traced.frozen_names}  # no optimizer step to time
    timed = sum(1 for n in solution.choice if table.nodes[n].kind in ("op", "fallback", "param") and n not in frozen)
    return {"profiled": profiled, "analytic": timed - profiled}


def _node_records(
    traced: TracedProgram, table: StrategyTable, assignment: Mapping[str, Strategy]
) -> dict[str, dict[str, object]]:
    """The plan's entry of each operator node: its target and chosen output and input layouts."""
    node_by_name = {n.name: n for n in traced.graph_module.graph.nodes}
    nodes: dict[str, dict[str, object]] = {}
    for name, strat in assignment.items():
        ns = table.nodes[name]
        if ns.kind in ("op", "fallback"):
            nodes[name] = {
                "op": str(node_by_name[name].target),
                "out": [spec_strs(s) if s is not None else None for s in strat.output_specs],
                "in": [spec_strs(s) for s in strat.input_specs],
            }
    return nodes


def _value_bytes(node_by_name: Mapping[str, torch.fx.Node], ref: ValueRef) -> int:
    val = node_by_name[ref.node].meta["val"]
    return tensor_bytes(val[ref.index] if isinstance(val, (tuple, list)) else val)
