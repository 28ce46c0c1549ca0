"""Repeated-structure reduction (autoplan.passes.depth, autoplan.passes.expand) changes no answer.

For models small enough to solve at full depth:

* the reduced model (first 2 blocks) is the same function's prefix and leaves the original intact;
* the ILP of the reduced program with the copies' variables shared (``scale_problem``) has the
  full program's optimum within 0.5%, and its placements expanded to the full program
  (``expand_assignment``) cost, on the full problem, within 0.5% of the full optimum;
* the per-segment costs of the reduced trace expanded to the full depth equal the full trace's.
"""

from __future__ import annotations

import pytest
import torch

from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.errors import PlanMismatchError
from autoplan.passes.costing import build_cost_problem
from autoplan.passes.depth import find_block_list, reduce_depth
from autoplan.passes.expand import block_multiplicity, expand_assignment, scale_problem, twins
from autoplan.passes.layers import find_layers
from autoplan.passes.strategies import build_strategy_table
from autoplan.passes.trace import param_node_name, trace_training_step
from autoplan.planner.mesh import planning_mesh
from autoplan.planner.search import expand_blocks
from autoplan.planner.segment_costs import segment_costs
from autoplan.planner.solver import ShardingILP, SolverOptions, objective_of
from tests.harness import cpu_cluster
from tests.zoo import gpt2_tiny, llama_tiny, lm_loss, token_batch

NUM_LAYERS = 5


def test_reduce_depth_keeps_the_original_and_shares_parameters():
    model = llama_tiny(num_layers=NUM_LAYERS)
    assert find_block_list(model) == ("model.layers", NUM_LAYERS)
    r = reduce_depth(model)
    assert (r.block_list, r.num_blocks, r.kept, r.reduced) == ("model.layers", NUM_LAYERS, 2, True)
    assert len(model.model.layers) == NUM_LAYERS and len(r.module.model.layers) == 2
    assert r.module.model.layers[1] is model.model.layers[1]
    assert r.module.lm_head.weight is model.lm_head.weight
    # a model with no more blocks than kept comes back as is
    two = gpt2_tiny(num_layers=2)
    assert reduce_depth(two).module is two and not reduce_depth(two).reduced


def _solve(traced, cluster, mesh, num_blocks=None):  # noqa: ANN001, ANN202
    table = build_strategy_table(traced, mesh)
    problem = build_cost_problem(traced, table, cluster, optimizer="adam")
    problem.capacity_bytes, problem.memory_points = float("inf"), []
    lay = find_layers(traced)
    mult = block_multiplicity(lay, num_blocks) if num_blocks else {}
    scaled = scale_problem(problem, mult, twins(traced.graph_module, lay))
    sol = ShardingILP(scaled, SolverOptions(time_limit_s=600)).solve()
    return table, problem, sol


@pytest.mark.slow
@pytest.mark.parametrize("builder", [gpt2_tiny, llama_tiny], ids=["gpt2", "llama"])
def test_shared_block_variables_keep_the_optimum(builder):  # noqa: ANN001
    ids, labels = token_batch()
    model = builder(num_layers=NUM_LAYERS)
    # 4 CPU ranks with compute 1e5x slower, so that splitting the work pays for its
    # communication and the plan is not all-replicated (tests/test_equivalence.py does the same)
    cluster = cpu_cluster("4xCPU", compute_slowdown=1e5)
    full = trace_training_step(model, (ids,), loss_fn=lm_loss, example_targets=(labels,))
    short = trace_training_step(reduce_depth(model).module, (ids,), loss_fn=lm_loss, example_targets=(labels,))
    f_lay, s_lay = find_layers(full), find_layers(short)
    assert (f_lay.num_blocks, s_lay.num_blocks) == (NUM_LAYERS, 2)
    with planning_mesh(cluster) as mesh:
        f_table, f_problem, f_sol = _solve(full, cluster, mesh)
        s_table, _, s_sol = _solve(short, cluster, mesh, NUM_LAYERS)
    # a non-trivial plan: some weights are sharded
    assert any("S(" in str(f_table.nodes[n].strategies[i]) for n, i in f_sol.choice.items() if n.startswith("p_"))
    assert s_sol.objective_s == pytest.approx(f_sol.objective_s, rel=5e-3)
    # the reduced plan applied to every block of the full program
    s_assign = {n: s_table.nodes[n].strategies[i] for n, i in s_sol.choice.items()}
    block_list, _ = find_block_list(model)  # parameters of blocks >= 1 map onto block 1 by name
    expanded = expand_assignment(s_assign, (short, s_lay), (full, f_lay), block_list=block_list)
    choice = {}
    for name, strat in expanded.items():
        if name not in f_table.nodes:
            continue
        strategies = f_table.nodes[name].strategies
        assert strat in strategies, f"{name}: expanded strategy {strat} is not one of the full program's"
        choice[name] = strategies.index(strat)
    assert set(choice) == set(f_sol.choice)
    assert objective_of(f_problem, choice) == pytest.approx(f_sol.objective_s, rel=5e-3)
    assert objective_of(f_problem, f_sol.choice) == pytest.approx(f_sol.objective_s, rel=1e-6)


def test_expanded_segment_costs_equal_the_full_trace():
    """The reduced program's per-segment costs, expanded to the full depth, equal the full
    program's costs under the same plan (the reduced plan repeated on every block). Each side is
    priced with its own trace and cost problem; the plan is shared so that solver ties (equal
    objectives, different vertices) cannot make the comparison fail."""
    ids, labels = token_batch()
    model = gpt2_tiny(num_layers=NUM_LAYERS)
    cluster = Cluster.preset("1x2xA100-80GB")
    full = trace_training_step(model, (ids,), loss_fn=lm_loss, example_targets=(labels,))
    short = trace_training_step(reduce_depth(model).module, (ids,), loss_fn=lm_loss, example_targets=(labels,))
    f_lay, s_lay = find_layers(full), find_layers(short)
    with planning_mesh(cluster) as mesh:
        s_table, s_problem, s_sol = _solve(short, cluster, mesh, NUM_LAYERS)
        f_table = build_strategy_table(full, mesh)
        f_problem = build_cost_problem(full, f_table, cluster, optimizer="adam")
    s_assign = {n: s_table.nodes[n].strategies[i] for n, i in s_sol.choice.items()}
    block_list, _ = find_block_list(model)
    expanded = expand_assignment(s_assign, (short, s_lay), (full, f_lay), block_list=block_list)
    f_choice = {n: f_table.nodes[n].strategies.index(st) for n, st in expanded.items() if n in f_table.nodes}
    full_costs = segment_costs(
        full.graph_module,
        f_lay,
        f_problem,
        f_choice,
        param_nodes=[param_node_name(p) for p in full.param_names],
        trainable_param_nodes=[param_node_name(p) for p in full.trainable_names],
        optimizer="adam",
    )
    short_costs = expand_blocks(
        segment_costs(
            short.graph_module,
            s_lay,
            s_problem,
            s_sol.choice,
            param_nodes=[param_node_name(p) for p in short.param_names],
            trainable_param_nodes=[param_node_name(p) for p in short.trainable_names],
            optimizer="adam",
        ),
        NUM_LAYERS,
    )
    assert len(full_costs.segments) == len(short_costs.segments) == NUM_LAYERS + 2
    for a, b in zip(full_costs.segments, short_costs.segments, strict=True):
        assert b.fwd_s + b.bwd_s == pytest.approx(a.fwd_s + a.bwd_s, rel=1e-6)
        assert b.saved_bytes == pytest.approx(a.saved_bytes, rel=1e-6)
        assert b.param_numel == a.param_numel
    assert short_costs.cut_bytes == pytest.approx(full_costs.cut_bytes, rel=1e-6)


@pytest.mark.slow
def test_expansion_refuses_blocks_that_differ():
    ids, labels = token_batch()
    a = trace_training_step(reduce_depth(gpt2_tiny(num_layers=4)).module, (ids,), loss_fn=lm_loss,
                            example_targets=(labels,))  # fmt: skip
    b = trace_training_step(llama_tiny(num_layers=4), (ids,), loss_fn=lm_loss, example_targets=(labels,))
    with pytest.raises(PlanMismatchError, match="does not match"):
        expand_assignment({}, (a, find_layers(a)), (b, find_layers(b)), block_list="model.layers")


def test_reduced_model_computes_the_prefix():
    torch.manual_seed(0)
    model = gpt2_tiny(num_layers=NUM_LAYERS)
    two = gpt2_tiny(num_layers=2)
    two.load_state_dict({k: v for k, v in model.state_dict().items() if k in two.state_dict()})
    ids, _ = token_batch()
    torch.testing.assert_close(reduce_depth(model).module(ids).logits, two(ids).logits)
