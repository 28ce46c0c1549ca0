"""The edge costs of a context-parallel segment ILP (the ``cp x tp`` mesh the joint search solves
each cp key on: ``SegmentCostModel._solve``), stored as a matrix per edge
(:class:`autoplan.passes.costing.PairCosts`) and computed once per distinct spec pair: every entry
is still the transition time of its pair, and the ILP reads the matrix in the groups' order."""

from __future__ import annotations

import pytest
import torch

from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.comm import is_coalescable, plan_transition, transition_cost_s
from autoplan.cost_models.step import replica_cluster
from autoplan.passes.costing import OUTPUT_CONSUMER, CostProblem, PairCosts, build_cost_problem
from autoplan.passes.strategies import build_strategy_table
from autoplan.passes.trace import trace_training_step
from autoplan.planner.mesh import gradient_values, planning_mesh, restrict_context_parallel
from autoplan.planner.solver import ShardingILP, objective_of
from tests.zoo import LONG_CONTEXT, llama_long_context, lm_loss, token_batch

CP_AXIS = 0
"""The ``cp`` axis of :func:`replica_cluster`'s ``(cp, tp)`` mesh."""


@pytest.fixture(scope="module")
def cp_problem() -> CostProblem:
    """The segment ILP's problem of one sample (128 tokens) of the long-context Llama on ``cp=2 x tp=2``."""
    ids, labels = token_batch(batch=1, seq=LONG_CONTEXT // 8)
    traced = trace_training_step(llama_long_context(), (ids,), loss_fn=lm_loss, example_targets=(labels,))
    cluster = replica_cluster(Cluster.preset("1x8xH100"), 2, cp=2)
    with planning_mesh(cluster) as mesh:
        table = build_strategy_table(traced, mesh)
        restrict_context_parallel(table, gradient_values(traced.graph_module.graph), axis=CP_AXIS)
        problem = build_cost_problem(traced, table, cluster, optimizer="adam", gradients_reduced_on=(CP_AXIS,))
    problem.capacity_bytes = float("inf")  # as the segment ILP: memory is the outer search's constraint
    problem.memory_points = []
    return problem


def test_every_cp_mesh_edge_cost_is_the_transition_time_of_its_spec_pair(cp_problem: CostProblem) -> None:
    # cost(p -> q) = transition_cost_s(p, q, full bytes), latency left out of a coalesced gradient
    # reduction; a gradient's cp axis is reduced by the step model, so p takes q's placement there
    cluster = cp_problem.cluster
    params = {name for name, ns in cp_problem.table.nodes.items() if ns.kind == "param"}
    reference: dict[tuple, float] = {}  # (p, q, bytes, latency) -> seconds: the memo keyed by specs it replaced
    pairs = 0
    for edge in cp_problem.edges:
        gradient = edge.arg_index == -1 and edge.consumer != OUTPUT_CONSUMER
        assert not gradient or edge.consumer in params
        assert edge.cost_s.src == tuple(edge.src_groups) and edge.cost_s.dst == tuple(edge.dst_groups)
        assert len(edge.cost_s) == len(edge.src_groups) * len(edge.dst_groups)
        for i, p in enumerate(edge.src_groups):
            for j, q in enumerate(edge.dst_groups):
                src = tuple(q[a] if gradient and a == CP_AXIS else x for a, x in enumerate(p))
                latency = not (gradient and is_coalescable(plan_transition(src, q)))
                key = (src, q, edge.full_bytes, latency)
                if key not in reference:
                    reference[key] = transition_cost_s(src, q, edge.full_bytes, cluster, include_latency=latency)
                expected = reference[key]
                assert edge.cost_s[(p, q)] == edge.cost_s.matrix[i][j] == expected, (edge.producer, edge.consumer, p, q)
                pairs += 1
    assert pairs > 50_000  # the 2-D mesh's pairs (1-D: about 9k), so the memo is exercised


def test_cp_mesh_ilp_reports_the_objective_of_the_strategies_it_chose(cp_problem: CostProblem) -> None:
    """The ILP reads each edge's matrix by position, ``objective_of`` by spec pair: a matrix read
    in another order than the groups' would price another conversion than the chosen one."""
    solution = ShardingILP(cp_problem).solve()
    assert solution.status == "Optimal"
    assert objective_of(cp_problem, solution.choice) == pytest.approx(solution.objective_s, rel=1e-9)


def test_pair_costs_read_as_a_mapping_of_spec_pairs() -> None:
    from torch.distributed.tensor import Partial, Replicate, Shard

    r, s0, s1, part = (Replicate(),), (Shard(0),), (Shard(1),), (Partial(),)
    costs = PairCosts((r, part), (s0, s1, r), ((0.0, 0.0, 0.0), (1.0, 2.0, 3.0)))
    assert costs[(part, s1)] == 2.0 and costs.get((part, r)) == 3.0
    assert costs.get((s0, s0), -1.0) == -1.0 and (s0, s0) not in costs and (r, s1) in costs
    assert list(costs) == [(r, s0), (r, s1), (r, r), (part, s0), (part, s1), (part, r)] and len(costs) == 6
    assert costs.scaled(2.0)[(part, r)] == 6.0 and costs.scaled(2.0).src == costs.src
    assert not costs.all_zero() and PairCosts((r,), (r,), ((0.0,),)).all_zero()
    with pytest.raises(KeyError):
        costs[(s1, s0)]
    assert torch.tensor(list(costs.values())).sum().item() == 6.0
