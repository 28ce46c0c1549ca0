"""Mixture-of-experts: routed experts as one op (``passes/moe.py``) and expert parallelism.

The op must compute what transformers computes (any ``experts_implementation``), its strategies
must run equal to one device, and the planner must reach the all-to-all (expert-parallel) layout
where it is the cheapest. Multi-rank cases run three optimizer steps in fp32 against the
single-device model (``tests.harness``: 1e-5).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import pytest
import torch

import autoplan
from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.config import ParallelConfig
from autoplan.passes import pass_order
from autoplan.passes.layers import find_layers
from autoplan.passes.moe import MOE_OPS, UNDECIDED, ep_axes, moe_comm_time_s, moe_exchanges, planning_args
from autoplan.passes.placement import parse_spec
from autoplan.passes.trace import param_node_name
from autoplan.planner.mesh import planning_mesh
from autoplan.planner.segment_costs import _add_node_times, _Sums
from tests import zoo
from tests.harness import (
    Case,
    SeededBatches,
    assert_trains_like_reference,
    cpu_cluster,
    run_case,
    run_ranks,
    train_planned_lm,
)

_EXPERTS = {"*.experts.gate_up_proj": "S(0)", "*.experts.down_proj": "S(0)"}


def _hf_experts(implementation: str) -> torch.nn.Module:
    model = zoo.mixtral_tiny(seed=3, experts_implementation=implementation)
    return model.model.layers[0].mlp.experts


def _routing(n: int = 24, k: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g, requires_grad=True)
    idx = torch.stack([torch.randperm(zoo.MOE_EXPERTS, generator=g)[:k] for _ in range(n)])
    w = torch.rand(n, k, generator=g).softmax(-1).requires_grad_()
    return x, idx, w


def test_op_computes_what_transformers_computes_forward_and_backward():
    """``autoplan::moe_experts`` against transformers' ``batched_mm`` implementation on the same
    weights and routing: output and the gradients of x, routing weights and both expert weights."""
    hf = _hf_experts("batched_mm")
    x, idx, w = _routing()
    ids = torch.arange(zoo.MOE_EXPERTS)
    ours = torch.ops.autoplan.moe_experts(x, idx, w, ids, hf.gate_up_proj, hf.down_proj, "silu", "")
    theirs = hf(x, idx, w)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(ours)
    inputs = (x, w, hf.gate_up_proj, hf.down_proj)
    grads_ours = torch.autograd.grad(ours, inputs, g)
    grads_theirs = torch.autograd.grad(theirs, inputs, g)
    for a, b in zip(grads_ours, grads_theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_experts_split_partial_sums_add_up_to_the_whole():
    """The ``experts`` strategy's local kernel: each half of the experts gives a partial sum (and
    partial gradients); together they are the whole op, and the expert gradients are disjoint."""
    hf = _hf_experts("batched_mm")
    x, idx, w = _routing(seed=1)
    gu, down = hf.gate_up_proj.detach(), hf.down_proj.detach()
    ids = torch.arange(zoo.MOE_EXPERTS)
    g = torch.randn(x.shape[0], 32)
    whole = torch.ops.autoplan.moe_experts_backward(g, x, idx, w, ids, gu, down, "silu", "")
    halves = [slice(0, 2), slice(2, 4)]
    parts = [torch.ops.autoplan.moe_experts_backward(g, x, idx, w, ids[h], gu[h], down[h], "silu", "") for h in halves]
    torch.testing.assert_close(parts[0][0] + parts[1][0], whole[0])
    torch.testing.assert_close(parts[0][1] + parts[1][1], whole[1])
    torch.testing.assert_close(torch.cat([p[2] for p in parts]), whole[2])
    torch.testing.assert_close(torch.cat([p[3] for p in parts]), whole[3])
    y = [torch.ops.autoplan.moe_experts(x, idx, w, ids[h], gu[h], down[h], "silu", "") for h in halves]
    torch.testing.assert_close(y[0] + y[1], torch.ops.autoplan.moe_experts(x, idx, w, ids, gu, down, "silu", ""))


def test_an_undecided_expert_parallel_axis_never_runs():
    hf = _hf_experts("batched_mm")
    x, idx, w = _routing()
    with pytest.raises(RuntimeError, match="undecided expert-parallel axis"):
        torch.ops.autoplan.moe_experts(x, idx, w, torch.arange(4), hf.gate_up_proj, hf.down_proj, "silu", UNDECIDED)
    args = (1, 2, "silu", "")
    assert planning_args(torch.ops.autoplan.moe_experts.default, args) == (1, 2, "silu", UNDECIDED)
    assert planning_args(torch.ops.aten.mm.default, args) == args


@pytest.mark.parametrize(
    "build",
    [
        functools.partial(zoo.mixtral_tiny, experts_implementation="eager"),
        functools.partial(zoo.mixtral_tiny, experts_implementation="batched_mm"),
        zoo.qwen2_moe_tiny,
    ],
    ids=["mixtral-eager", "mixtral-batched_mm", "qwen2_moe-shared-expert"],
)
def test_every_experts_implementation_traces_to_one_op_per_layer(build):
    """transformers' eager loop (data-dependent: not traceable before) and ``batched_mm`` (an
    ``(N*k, 2I, H)`` gather of the weights) both become one forward and one backward op per layer;
    no op touches the stacked expert weights but these."""
    x, y = zoo.token_batch(batch=2, seq=8)
    traced = pass_order.TRACE(build(), (x,), loss_fn=zoo.lm_loss, example_targets=(y,))
    nodes = list(traced.graph_module.graph.nodes)
    moe = [n for n in nodes if n.op == "call_function" and n.target in MOE_OPS]
    assert len(moe) == 4, [str(n.target) for n in moe]  # 2 layers x (forward, backward)
    expert_params = [n for n in nodes if n.op == "placeholder" and "experts" in n.name]
    assert len(expert_params) == 4
    for p in expert_params:
        assert {u.target for u in p.users} <= MOE_OPS, (p.name, [str(u.target) for u in p.users])


def _switch_case(
    name: str, *, preset: str, mesh_shape: tuple[int, ...] | None, pins: Mapping[str, str], compute_slowdown: float = 0.02
) -> Case:
    """Top-1 routing (Switch Transformer) over 4 experts of 512, 2,048 tokens of hidden 128, on a
    device 50x faster than this CPU beside the same links: about a GPU cluster's ratio of compute
    to communication (100 GFLOP/s x 50 per 2 GB/s here, 2,500 FLOP per byte; an H100 about
    2,000 per byte of NVLink). The all-to-all layout is then the cheapest for the experts on an
    axis of 4 (on 2 ranks the all-gather dispatcher moves fewer bytes)."""
    return Case(
        name=name,
        build_model=functools.partial(zoo.mixtral_tiny, top_k=1, hidden=128, expert_hidden=512),
        batches=SeededBatches(zoo.token_batch, {"batch": 32, "seq": 64}),
        loss_fn=zoo.lm_loss,
        preset=preset,
        mesh_shape=mesh_shape,
        compute_slowdown=compute_slowdown,
        pins=pins,
        profile=None,
        optimizer="sgd_momentum",
        lr=0.1,
    )


def _moe_layouts(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [d for d in result["plan"].nodes.values() if d["op"].startswith("autoplan.moe_experts")]


@pytest.mark.slow  # (CI runs the expert-parallel dispatch in test_experts_split_over_the_data_parallel_group_...)
def test_experts_split_over_4_ranks_with_all_to_all_train_like_single_device():
    case = _switch_case(
        "switch-ep-4", preset="4xCPU", mesh_shape=None, pins={"input_0": "S(0)", "target_0": "S(0)"} | _EXPERTS
    )
    results = run_case(case, timeout_s=600)

    layouts = _moe_layouts(results[0])
    assert len(layouts) == 4
    for d in layouts:  # tokens and experts split on the axis: the all-to-all dispatcher
        assert all(spec == ["S(0)"] for spec in d["in"]), d
    assert_trains_like_reference(results)


@pytest.mark.slow
def test_expert_x_tensor_parallel_on_2x2_mesh_trains_like_single_device():
    """Axis 0 splits the batch; axis 1 splits the experts and runs attention tensor-parallel
    (Megatron pins; the ILP may still split a layer's batch there instead of its heads) over the
    same two ranks (MoE parallel folding). On an axis of 2 the ILP picks the all-gather dispatcher
    (tokens whole, experts split, partial sums) or the all-to-all, whichever it prices lower."""
    pins = {"input_0": "S(0),R", "target_0": "S(0),R"} | {k: f"R,{v}" for k, v in _EXPERTS.items()}
    pins |= {f"*.self_attn.{p}_proj.weight": "R,S(0)" for p in "qkv"} | {"*.self_attn.o_proj.weight": "R,S(1)"}
    # a device 10x faster than this CPU: attention's compute is then worth splitting by heads
    case = _switch_case("switch-ep-x-tp-2x2", preset="4xCPU", mesh_shape=(2, 2), pins=pins, compute_slowdown=0.1)
    results = run_case(case, timeout_s=900)

    for d in _moe_layouts(results[0]):
        gate_up = d["in"][5 if "backward" in d["op"] else 4]
        assert gate_up[1] == "S(0)", d  # the experts split on axis 1
    attention = [d for d in results[0]["plan"].nodes.values() if d["op"] == "autoplan.sdpa.default"]
    assert len(attention) == 2 and all(d["out"][0][0] == "S(0)" for d in attention), attention  # batch on axis 0
    assert any(d["out"][0][1] == "S(1)" for d in attention), attention  # heads split on axis 1 (the ILP's choice per layer)
    assert_trains_like_reference(results)


@pytest.mark.slow
def test_shared_expert_model_trains_like_single_device_with_experts_split():
    """Qwen2-MoE (routed experts plus a gated shared expert) with its routed experts split over 2 ranks."""
    case = dataclasses.replace(
        _switch_case("qwen2-moe-2", preset="2xCPU", mesh_shape=None, pins={"input_0": "S(0)", "target_0": "S(0)"}),
        build_model=zoo.qwen2_moe_tiny,
        pins={"input_0": "S(0)", "target_0": "S(0)"} | _EXPERTS,
        batches=SeededBatches(zoo.token_batch, {"batch": 8, "seq": 16}),
    )
    results = run_case(case, timeout_s=600)

    assert len(_moe_layouts(results[0])) == 4
    assert_trains_like_reference(results)


def test_expert_parallel_all_to_alls_are_the_segments_communication():
    """The all-to-alls an expert-parallel op runs inside its time are listed as its segment's
    communication (what the estimate's rows show, ``redistribute@tp``), forward and backward, each
    exactly the op's priced exchange; other strategies of the op add none."""
    x, y = zoo.token_batch(batch=4, seq=16)
    traced = pass_order.TRACE(zoo.mixtral_tiny(top_k=1), (x,), loss_fn=zoo.lm_loss, example_targets=(y,))
    cluster = Cluster.preset("1x4xH100")
    with planning_mesh(cluster) as mesh:
        table = pass_order.STRATEGIES(traced, mesh)
        problem = pass_order.COSTING(traced, table, cluster, optimizer="adam")
    gm, layering = traced.graph_module, find_layers(traced)
    nodes = {n.name: n for n in gm.graph.nodes}
    phase = {n.name: n.meta.get("autoplan.phase") for n in gm.graph.nodes}
    params = [param_node_name(p) for p in traced.param_names]

    def comm_sums(expert_parallel: bool) -> tuple[list[float], list[float], list[float], list[float]]:
        choice = {}
        for name, ns in table.nodes.items():
            pick = 0
            if nodes[name].op == "call_function" and nodes[name].target in MOE_OPS:
                backward = "backward" in name
                pick = next(i for i, s in enumerate(ns.strategies)
                            if bool(ep_axes(s.input_specs, backward=backward)) == expert_parallel)  # fmt: skip
            choice[name] = pick
        sums = _Sums.zeros(layering.num_segments)
        _add_node_times(sums, gm, problem, choice, dict(layering.segment_of), phase, {}, param_nodes=params,
                        trainable=set(params), param_segments=layering.param_segments, partitions={})  # fmt: skip
        expected_f, expected_b = [0.0] * layering.num_segments, [0.0] * layering.num_segments
        for name, i in choice.items():
            node = nodes[name]
            if node.op == "call_function" and node.target in MOE_OPS:
                t = moe_comm_time_s(node, table.nodes[name].strategies[i].input_specs, cluster)
                (expected_f if phase[name] == "fwd" else expected_b)[layering.segment_of[name]] += t
        # the all-to-alls are also counted apart (their own row, all_to_all@tp), three per op
        assert sums.a2a_s["fwd"] == pytest.approx(expected_f) and sums.a2a_s["bwd"] == pytest.approx(expected_b)
        moe_fwd = [sum(1 for n, s in layering.segment_of.items() if s == k and phase[n] == "fwd"
                       and nodes[n].op == "call_function" and nodes[n].target in MOE_OPS)
                   for k in range(layering.num_segments)]  # fmt: skip
        assert sums.a2a_count == [3 * c if expert_parallel else 0 for c in moe_fwd]
        return sums.fwd_comm, sums.bwd_comm, expected_f, expected_b

    fwd, bwd, expected_f, expected_b = comm_sums(expert_parallel=True)
    assert sum(expected_f) > 0 and sum(expected_b) > 0
    assert fwd == pytest.approx(expected_f) and bwd == pytest.approx(expected_b)
    fwd, bwd, _, _ = comm_sums(expert_parallel=False)
    assert sum(fwd) == 0 and sum(bwd) == 0


@pytest.mark.slow
def test_a_fixed_mesh_plan_lists_the_in_op_all_to_alls_as_exposed_communication():
    """A plan on a fixed mesh with the experts expert-parallel: each MoE op's in-op all-to-alls
    are an ``all_to_all`` row on its axis (exactly the exchanges priced in the op's time), moved
    from compute to exposed communication; the step time is the same sum."""
    x, y = zoo.token_batch(batch=32, seq=64)
    cluster = cpu_cluster("4xCPU", compute_slowdown=0.02)  # _switch_case's: the all-to-all is the cheapest
    build = functools.partial(zoo.mixtral_tiny, top_k=1, hidden=128, expert_hidden=512)
    plan = autoplan.plan(build(), cluster, example_inputs=(x,), loss_fn=zoo.lm_loss,
                         example_targets=(y,), profile=None, pins={"input_0": "S(0)", "target_0": "S(0)"} | _EXPERTS)  # fmt: skip
    traced = pass_order.TRACE(build(), (x,), loss_fn=zoo.lm_loss, example_targets=(y,))
    expected = 0.0
    for node in traced.graph_module.graph.nodes:
        if node.op == "call_function" and node.target in MOE_OPS:
            specs = [parse_spec(spec) for spec in plan.nodes[node.name]["in"]]
            exchange = moe_exchanges(node, specs, cluster)
            assert exchange is not None, plan.nodes[node.name]  # pinned: expert parallel
            expected += exchange.time_s
    e = plan.estimate
    (row,) = [r for r in e.comm.rows if r.kind == "all_to_all"]
    assert row.total_s == pytest.approx(expected) and row.exposed_s == row.total_s
    assert row.count == 3 * 4  # 2 layers, forward and backward, three exchanges each
    assert e.comm.total_s == pytest.approx(e.comm_s)
    assert e.comm.exposed_s == pytest.approx(e.exposed_comm_s)
    assert e.step_time_s == pytest.approx(e.compute_s + e.exposed_comm_s)


def _train_planned(rank: int, world_size: int, plan_json: str) -> dict[str, Any]:  # noqa: ARG001
    return train_planned_lm(plan_json, zoo.mixtral_tiny(seed=5, top_k=2), SeededBatches(zoo.token_batch, {"batch": 8, "seq": 16}))


@pytest.mark.parametrize(
    ("dp", "ep", "zero_stage", "pp"),
    [
        (2, 2, 0, 1),
        pytest.param(2, 2, 3, 1, marks=pytest.mark.slow),
        (4, 2, 0, 1),
        pytest.param(4, 2, 3, 1, marks=pytest.mark.slow),
        pytest.param(4, 2, 0, 2, marks=pytest.mark.slow),
    ],
    ids=["ep=dp=2", "ep=dp=2-zero3", "dp=4-ep=2", "dp=4-ep=2-zero3", "pp=2-dp=4-ep=2"],
)
def test_experts_split_over_the_data_parallel_group_train_like_single_device(
    dp: int, ep: int, zero_stage: int, pp: int
):
    """A global-batch plan with the experts split over groups of ``ep`` ranks of ``dp``: every MoE
    op runs expert-parallel on the expert axis, each rank holding 4 / ep of the 4 experts of every
    layer (never gathered there), and it trains like one device.

    ``ep == dp == 2`` (two micro-batches accumulated): one axis, ``dp``; the experts' gradients
    are complete on their rank. ``dp = 4, ep = 2``: the mesh's axes are ``dp`` (2 replicas of each
    expert shard) and ``ep`` (2 consecutive ranks); the batch is split over both, the dense
    gradients are reduced over both and the experts' over ``dp`` only (ZeRO-3 shards them there
    and gathers them before the op). ``pp = 2``: each of the two 1F1B stages on its own ``dp x ep``
    mesh of 4 ranks (8 in all)."""
    import json

    m = max(pp, 4 // dp)
    cfg = ParallelConfig(dp=dp, pp=pp, microbatch_size=8 // (dp * m), num_microbatches=m, zero_stage=zero_stage,
                         ep=ep, schedule="1f1b")  # fmt: skip
    x, y = SeededBatches(zoo.token_batch, {"batch": 8, "seq": 16})(0)
    plan = autoplan.plan(zoo.mixtral_tiny(seed=5, top_k=2), f"1x{dp * pp}xCPU", example_inputs=(x,),
                         loss_fn=zoo.lm_loss, example_targets=(y,), optimizer="sgd_momentum", global_batch_size=8,
                         config=cfg)  # fmt: skip
    assert plan.config == cfg
    split = ep < dp
    assert plan.pipeline is not None
    assert plan.pipeline.stage_axis_names == (("dp", "ep") if split else ("dp",))
    batch = ["S(0)"] * (2 if split else 1)
    for d in _moe_layouts({"plan": plan}):
        first = 1 if "backward" in d["op"] else 0
        assert d["in"][first] == batch and d["in"][first + 4] == ["R", "S(0)"][-len(batch) :], d  # tokens, experts
    experts = {n: list(p) for n, p in plan.param_specs.items() if "experts" in n}
    assert len(experts) == 4 and all(p[-1] == "S(0)" for p in experts.values()), experts
    if zero_stage == 0:
        assert all(p == ["R", "S(0)"][-len(batch) :] for p in experts.values()), experts
    elif split:
        assert all(p[0].startswith("S(") for p in experts.values()), experts  # ZeRO-3 over the replicas
    rows = {(r.kind, r.axis) for r in plan.estimate.comm.rows}
    assert ("all_to_all", "ep" if split else "dp") in rows, rows
    if split:
        if zero_stage == 0:
            assert plan.parallelism()["dp"] == "data"
        assert plan.parallelism()["ep"].startswith("data + expert"), plan.parallelism()
    elif zero_stage == 0:
        assert plan.parallelism() == {"dp": "data + expert + tensor/param-sharded (4/21 params)"}
    results = run_ranks(_train_planned, dp * pp, json.dumps(plan.to_dict()), timeout_s=900)
    assert_trains_like_reference(results, rel_tol=1e-5, atol=1e-6)


def _resume_planned(rank: int, world_size: int, plan_json: str, root: str) -> dict[str, Any]:  # noqa: ARG001
    """Three steps uninterrupted, saving after the second; then a model of other weights loads that
    checkpoint and runs the third step: its loss and parameters must be the same bits."""
    import json

    from autoplan.runtime import checkpoint

    plan = autoplan.Plan.from_dict(json.loads(plan_json))
    batches = SeededBatches(zoo.token_batch, {"batch": 8, "seq": 16})

    def parallel(seed: int) -> tuple[Any, torch.optim.Optimizer]:
        x, y = batches(0)
        pm = autoplan.parallelize(zoo.mixtral_tiny(seed=seed, top_k=2), plan.cluster, example_inputs=(x,),
                                  loss_fn=zoo.lm_loss, example_targets=(y,), plan=plan)  # fmt: skip
        return pm, pm.make_optimizer(lr=0.1)

    def step(pm: Any, opt: torch.optim.Optimizer, k: int) -> float:
        x, y = batches(k)
        loss = pm.forward_backward(x, targets=(y,)).item()
        opt.step()
        opt.zero_grad()
        return loss

    pm, opt = parallel(5)
    losses = [step(pm, opt, k) for k in range(2)]
    checkpoint.save(root, 2, pm, opt, plan=plan)
    losses.append(step(pm, opt, 2))
    resumed, resumed_opt = parallel(6)
    ckpt = checkpoint.find_latest(root)
    assert ckpt is not None
    assert checkpoint.load(ckpt, resumed, resumed_opt) == 2
    return {
        "losses": losses, "resumed_loss": step(resumed, resumed_opt, 2),
        "params": {n: p.detach() for n, p in pm.full_parameters().items()},
        "resumed_params": {n: p.detach() for n, p in resumed.full_parameters().items()},
    }  # fmt: skip


@pytest.mark.slow
def test_a_checkpoint_on_the_dp_x_ep_mesh_resumes_bit_identically(tmp_path):
    """``dp = 4, ep = 2``, ZeRO-3 (parameters and optimizer state sharded over both axes, the
    experts over the expert groups and their replicas): DCP saves and restores every shard; a model
    that starts from other weights and loads the checkpoint runs the next step with the same loss
    and parameters, bit for bit."""
    import json

    cfg = ParallelConfig(dp=4, microbatch_size=2, num_microbatches=1, zero_stage=3, ep=2)
    x, y = SeededBatches(zoo.token_batch, {"batch": 8, "seq": 16})(0)
    plan = autoplan.plan(zoo.mixtral_tiny(seed=5, top_k=2), "1x4xCPU", example_inputs=(x,), loss_fn=zoo.lm_loss,
                         example_targets=(y,), optimizer="sgd_momentum", global_batch_size=8, config=cfg)  # fmt: skip
    results = run_ranks(_resume_planned, 4, json.dumps(plan.to_dict()), str(tmp_path / "ckpt"), timeout_s=900)

    for r in results:
        assert r["resumed_loss"] == r["losses"][2], (r["resumed_loss"], r["losses"])
        assert r["params"].keys() == r["resumed_params"].keys()
        for name, p in r["params"].items():
            assert torch.equal(p, r["resumed_params"][name]), name


def _two_models(rank: int, world_size: int, plan_json: str) -> list[float]:  # noqa: ARG001
    import json

    plan = autoplan.Plan.from_dict(json.loads(plan_json))
    x, y = SeededBatches(zoo.token_batch, {"batch": 8, "seq": 16})(0)
    losses = []
    for _ in range(2):
        pm = autoplan.parallelize(zoo.mixtral_tiny(seed=5, top_k=2), plan.cluster, example_inputs=(x,),
                                  loss_fn=zoo.lm_loss, example_targets=(y,), plan=plan)  # fmt: skip
        losses.append(pm.forward_backward(x, targets=(y,)).item())
    return losses


def test_a_second_expert_parallel_model_in_the_same_process_runs():
    """Two models parallelized one after the other in one process (an evaluation copy, a restart
    from a checkpoint) on a ``dp x ep`` mesh: each such mesh creates process groups of its own
    (a 1-D mesh over every rank reuses the world's), and DTensor's sharding cache can hand
    the second program specs on the first mesh. The MoE op finds its expert-parallel axis by the
    group's ranks, not its name (it used to find none: "Sharding propagation failed" on the second
    model's first step). Both give the same loss."""
    import json

    cfg = ParallelConfig(dp=4, microbatch_size=2, num_microbatches=1, ep=2)  # a 2-D mesh: groups of its own
    x, y = SeededBatches(zoo.token_batch, {"batch": 8, "seq": 16})(0)
    plan = autoplan.plan(zoo.mixtral_tiny(seed=5, top_k=2), "1x4xCPU", example_inputs=(x,), loss_fn=zoo.lm_loss,
                         example_targets=(y,), optimizer="sgd_momentum", global_batch_size=8, config=cfg)  # fmt: skip
    results = run_ranks(_two_models, 4, json.dumps(plan.to_dict()), timeout_s=600)

    for first, second in results:
        assert first == second


def test_assert_plan_tells_degrees_from_the_stage_axes_of_the_same_name():
    """A plan with ``dp = 4, ep = 2`` has stage axes named ``dp`` and ``ep``, and configuration
    degrees of the same names: an integer asks the degree, a string the axis's kind (an integer
    used to be taken as an axis kind and raise ``ValueError``)."""
    from autoplan.testing import assert_plan

    cfg = ParallelConfig(dp=4, microbatch_size=2, num_microbatches=1, ep=2)
    x, y = SeededBatches(zoo.token_batch, {"batch": 8, "seq": 16})(0)
    plan = autoplan.plan(zoo.mixtral_tiny(seed=5, top_k=2), "1x4xCPU", example_inputs=(x,), loss_fn=zoo.lm_loss,
                         example_targets=(y,), optimizer="sgd_momentum", global_batch_size=8, config=cfg)  # fmt: skip

    assert_plan(plan, parallelism={"dp": 4, "ep": 2, "pp": 1})
    assert_plan(plan, parallelism={"dp": "data"})
    with pytest.raises(AssertionError) as info:
        assert_plan(plan, parallelism={"ep": 4, "dp": "tensor"})
    assert "ep=2 in dp=4 tp=1 pp=1 mbs=2x1 recompute=none zero=0 ep=2, expected ep=4" in str(info.value)
    assert "mesh axis 'dp' is data, expected tensor" in str(info.value)
