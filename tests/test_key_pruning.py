"""The joint search leaves out the segment-cost keys it cannot use (``autoplan.planner.search._KeyBounds``):
a key whose every candidate's lower bound, priced without its ILP
(:meth:`SegmentCostModel.work_lower_bound_s`, over
:func:`autoplan.passes.costing.op_time_lower_bounds_s`), exceeds a step already laid out is never
solved. The bounds hold below what the ILPs give, and the search with the prune evaluates exactly
the configurations, in the same order, with the same estimates, as the search without it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.profile_db import DeviceKey, ProfileDB
from autoplan.cost_models.step import SegmentCosts, replica_cluster
from autoplan.passes.costing import build_cost_problem, op_time_lower_bounds_s
from autoplan.passes.strategies import build_strategy_table
from autoplan.passes.trace import trace_training_step
from autoplan.planner.mesh import gradient_values, planning_mesh, restrict_context_parallel
from autoplan.planner.search import SearchSpace, candidates, cost_key, search
from autoplan.planner.segment_costs import BoundedSegmentCostOracle, SegmentCostOracle
from autoplan.planner.segment_model import SegmentCostModel
from tests.zoo import LONG_CONTEXT, gpt2_tiny, llama_long_context, lm_loss, token_batch


def test_an_ops_bound_is_below_the_time_of_each_of_its_strategies_on_a_cp_x_tp_mesh(tmp_path: Path) -> None:
    ids, labels = token_batch(batch=1, seq=LONG_CONTEXT // 8)
    traced = trace_training_step(llama_long_context(), (ids,), loss_fn=lm_loss, example_targets=(labels,))
    cluster = replica_cluster(Cluster.preset("1x8xH100"), 2, cp=2)
    with planning_mesh(cluster) as mesh:
        table = build_strategy_table(traced, mesh)
        restrict_context_parallel(table, gradient_values(traced.graph_module.graph), axis=0)
        problem = build_cost_problem(traced, table, cluster, optimizer="adam", gradients_reduced_on=(0,))
    bounds = op_time_lower_bounds_s(traced, cluster)
    assert bounds is not None
    assert set(bounds) == {name for name, ns in table.nodes.items() if ns.kind in ("op", "fallback")}
    assert all(bounds[name] <= min(problem.node_time_s[name]) for name in bounds)
    # not vacuous: most ops reach their bound with some strategy (ring attention adds its shifts)
    reached = sum(bounds[name] == min(problem.node_time_s[name]) for name in bounds)
    assert reached > 0.9 * len(bounds) and sum(bounds.values()) > 0
    assert op_time_lower_bounds_s(traced, cluster, profile=ProfileDB(tmp_path / "db.json", DeviceKey.current("cpu"))) is None  # a measured time may be lower


@pytest.fixture(scope="module")
def model() -> SegmentCostModel:
    ids, labels = token_batch()
    return SegmentCostModel(gpt2_tiny(num_layers=4), (ids,), lm_loss, (labels,), Cluster.preset("2x4xA100-80GB"),
                            workers=1)  # fmt: skip


def test_a_keys_work_bound_is_below_its_solved_or_scaled_work(model: SegmentCostModel) -> None:
    for key in [(1, 1), (1, 2), (1, 8), (2, 1), (2, 4), (4, 2), (4, 16), (4, 4, 1, True)]:
        costs = model(*key)
        work = sum(s.fwd_s + s.bwd_s for s in costs.segments)
        assert 0 < model.work_lower_bound_s(*key) <= work, key


class _Unbounded(SegmentCostOracle):
    """The same cost model seen as a plain :class:`SegmentCostOracle`: the search solves every key."""

    __slots__ = ("inner",)

    def __init__(self, inner: SegmentCostModel) -> None:
        self.inner = inner

    def __call__(self, tp: int, microbatch_size: int, cp: int = 1, sequence_parallel: bool | int = False) -> SegmentCosts:
        return self.inner(tp, microbatch_size, cp, sequence_parallel)

    def ready(self, tp: int, microbatch_size: int, cp: int = 1, sequence_parallel: bool | int = False) -> bool:
        return self.inner.ready(tp, microbatch_size, cp, sequence_parallel)

    def prefetch(self, keys: Iterable[tuple[int, ...]], *, while_waiting: Callable[[], bool] | None = None) -> None:
        self.inner.prefetch(keys, while_waiting=while_waiting)


def _fresh(workers: int) -> SegmentCostModel:
    ids, labels = token_batch()
    return SegmentCostModel(gpt2_tiny(num_layers=4), (ids,), lm_loss, (labels,), Cluster.preset("2x4xA100-80GB"),
                            workers=workers)  # fmt: skip


def _pruned_and_full(workers: int) -> tuple[list[tuple[int, ...]], tuple, tuple]:
    """The search of 4-layer GPT-2 on 8 A100 with the prune and without; the keys it left unsolved."""
    space = SearchSpace(microbatch_sizes=(1, 2, 4, 8))
    kwargs = {"num_blocks": 4, "global_batch_size": 32, "space": space, "precision": "bf16", "tokens_per_sample": 16}
    bounded, unbounded = _fresh(workers), _fresh(workers)
    assert isinstance(bounded, BoundedSegmentCostOracle)
    pruned = search(bounded, bounded.cluster, **kwargs)
    full = search(_Unbounded(unbounded), bounded.cluster, **kwargs)
    keys = {cost_key(c) for c in candidates(bounded.cluster, num_blocks=4, global_batch_size=32, space=space)}
    assert all(unbounded.ready(*k) for k in keys)
    return sorted(k for k in keys if not bounded.ready(*k)), pruned, full


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_the_search_with_pruned_keys_evaluates_what_the_full_search_evaluates(workers: int) -> None:
    unsolved, (best, every), (full_best, full_every) = _pruned_and_full(workers)
    assert unsolved, "not vacuous: some keys were never solved"
    assert best == full_best
    assert every == full_every  # the same configurations, order and estimates: the plan's alternatives too
