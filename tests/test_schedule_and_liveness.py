"""Step schedule (overlap), liveness (views share storage, lifetimes) and the solver's sums."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.fx as fx

from autoplan.cost_models.comm_schedule import DEFAULT_POLICY
from autoplan.cost_models.memory import optimizer_temp_bytes
from autoplan.passes.comm_order import CollectiveSlot, CommSchedule
from autoplan.passes.liveness import analyze, live_at, memory_checkpoints
from autoplan.passes.overlap import schedule_step
from autoplan.passes.redistribute import OUTPUT
from autoplan.passes.strategies import ValueRef
from autoplan.planner.solver import _merge


def _chain(n: int) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("p_w")
    nodes = [x]
    for i in range(n):
        nodes.append(g.call_function(torch.neg, (nodes[-1],), name=f"op{i}"))
    g.output((nodes[-1], nodes[1]))
    return fx.GraphModule(torch.nn.Module(), g)


def _redist(producer: str, consumer: str, arg_index: int, bucket: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(producer=ValueRef(producer), consumer=consumer, arg_index=arg_index, bucket=bucket)


def _order(*slots: tuple[str, str, int | None], buckets: tuple[tuple[int, ...], ...] = ()) -> CommSchedule:
    """A CommSchedule with one (issue after, wait before, bucket) slot per redistribution."""
    return CommSchedule(
        slots=tuple(CollectiveSlot(index=i, issue_after=a, wait_before=w, bucket=b) for i, (a, w, b) in enumerate(slots)),
        buckets=buckets,
        policy=DEFAULT_POLICY,
    )


def test_gradient_reduction_hides_behind_the_rest_of_the_backward_where_the_device_overlaps() -> None:
    gm = _chain(4)  # op0 .. op3, 10 ms each; op0's output is the gradient of p_w
    times = {"op0": 0.010, "op1": 0.010, "op2": 0.010, "op3": 0.010, "p_w": 0.002}
    grad = _redist("op0", "p_w", -1)
    order = _order(("op0", OUTPUT, None))  # issued right after op0, needed by the optimizer step
    # overlap: 25 ms of communication during the 30 ms of op1..op3 -> nothing exposed
    s = schedule_step(gm, times, [grad], [0.025], schedule=order, param_nodes=["p_w"], device_overlaps=True)
    assert s.collectives[0].overlappable and s.exposed_comm_s == pytest.approx(0.0)
    assert s.step_time_s == pytest.approx(0.042)
    assert (s.collectives[0].issue_s, s.collectives[0].finish_s) == pytest.approx((0.010, 0.035))
    # 45 ms of communication: only the 15 ms beyond the remaining compute is exposed
    s = schedule_step(gm, times, [grad], [0.045], schedule=order, param_nodes=["p_w"], device_overlaps=True)
    assert s.collectives[0].exposed_s == pytest.approx(0.015) and s.step_time_s == pytest.approx(0.057)
    # a device that cannot overlap runs it at its issue point: all of it is exposed
    s = schedule_step(gm, times, [grad], [0.025], schedule=order, param_nodes=["p_w"], device_overlaps=False)
    assert not s.collectives[0].overlappable and s.exposed_comm_s == pytest.approx(0.025)


def test_compute_beside_a_collective_runs_slower_by_the_contention_factor() -> None:
    gm = _chain(4)
    times = {"op0": 0.010, "op1": 0.010, "op2": 0.010, "op3": 0.010}
    order = _order(("op0", OUTPUT, None))
    # 15 ms of communication from t=10 ms; compute at half speed meanwhile (slowdown 1.0):
    # op1 takes 20 ms (to t=30 ms, the collective ends at 25 ms: 15 ms wall at half speed = 7.5 ms
    # of work, then 2.5 ms at full speed -> op1 ends at 27.5 ms), op2 and op3 at full speed
    s = schedule_step(
        gm, times, [_redist("op0", "p_w", -1)], [0.015], schedule=order, param_nodes=[], device_overlaps=True,
        compute_slowdown=1.0,
    )  # fmt: skip
    assert s.step_time_s == pytest.approx(0.0475)
    # the contention is compute time (7.5 ms), the collective itself never made compute wait
    assert s.contention_s == pytest.approx(0.0075) and s.compute_s == pytest.approx(0.0475)
    assert s.exposed_comm_s == pytest.approx(0.0) and s.collectives[0].exposed_s == pytest.approx(0.0)


def test_an_operand_conversion_waits_at_its_consumer_and_a_bucket_queues_behind_it() -> None:
    gm = _chain(3)
    times = {"op0": 0.010, "op1": 0.010, "op2": 0.010}
    convs = [_redist("op0", "op1", 0), _redist("op0", "p_w", -1, bucket="grad:P->R")]
    order = _order(("op0", "op1", None), ("op0", OUTPUT, 0), buckets=((1,),))
    s = schedule_step(gm, times, convs, [0.004, 0.006], schedule=order, param_nodes=["p_w"], device_overlaps=True)
    # the conversion is needed by the very next op: exposed; the bucket runs during op1, op2
    assert [c.exposed_s for c in s.collectives] == pytest.approx([0.004, 0.0])
    assert s.step_time_s == pytest.approx(0.034)
    s = schedule_step(gm, times, convs, [0.004, 0.006], schedule=order, param_nodes=["p_w"], device_overlaps=False)
    assert [c.exposed_s for c in s.collectives] == pytest.approx([0.004, 0.006])
    assert s.step_time_s == pytest.approx(0.040)


def test_views_share_their_base_storage_and_extend_its_life() -> None:
    g = fx.Graph()
    p = g.placeholder("p_w")
    a = g.call_function(torch.ops.aten.mul.Tensor, (p, p), name="a")  # new storage
    v = g.call_function(torch.ops.aten.view.default, (a, [4, 4]), name="v")  # a view of a
    b = g.call_function(torch.ops.aten.neg.default, (p,), name="b")
    c = g.call_function(torch.ops.aten.add.Tensor, (v, b), name="c")  # reads a through its view
    g.output((c, b))
    gm = fx.GraphModule(torch.nn.Module(), g)
    shapes = {"p_w": (16,), "a": (16,), "v": (4, 4), "b": (16,), "c": (4, 4)}
    for n in gm.graph.nodes:
        if n.op != "output":
            n.meta["val"] = torch.empty(shapes[n.name], device="meta")
    live = analyze(gm, ["p_w"])
    assert live.storage_of[ValueRef("v")] == ValueRef("a")
    assert live.last_use[ValueRef("a")] == live.position["c"]  # alive until its view is read
    assert ValueRef("a") in live_at(live, live.position["b"])
    assert live.end in memory_checkpoints(live)


def test_adam_step_temporaries() -> None:
    # the runtime runs foreach Adam on every device (make_torch_optimizer): one sqrt per parameter
    # at once -> all parameters' bytes, on CPU as on CUDA; SGD: in place
    assert optimizer_temp_bytes("adam", 100, 1000, "cpu") == 1000
    assert optimizer_temp_bytes("adam", 100, 1000, "cuda") == 1000
    assert optimizer_temp_bytes("sgd_momentum", 100, 1000, "cuda") == 0


def test_repeated_variables_in_a_linear_expression_are_summed() -> None:
    # a node's compute time and an edge cost linear in the same x must add up (PuLP's
    # LpAffineExpression(list) kept only the last coefficient of a repeated variable)
    assert _merge([(0, 1.0), (3, 0.5), (0, 2.0)]) == {0: pytest.approx(3.0), 3: 0.5}
