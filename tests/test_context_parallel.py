"""Context parallelism: a long sequence split over ranks trains like the single-device model.

The planner has no separate context-parallel machinery: a mesh axis splits the sequence when the
intra-operator ILP shards the activations' token dim, and attention then runs head-parallel,
the sequence <-> heads conversions being all-to-alls (DeepSpeed-Ulysses' layout; an all-gather
of the projections' input where that is cheaper). Causal attention needs no load balancing in
this layout: each rank attends over the whole sequence for its heads. Where the heads cannot be
split (fewer heads than ranks), attention runs as a ring over the sequence shards
(:mod:`autoplan.passes.ring_attention`, zigzag-balanced under the causal mask). These tests pin the input
and target sequence-sharded (``S(1)`` of ``(B, T)``) and the weights replicated, so the axis can
only split the tokens, and check the layout the plan runs before the numbers (harness: three
steps, fp32, 1e-5).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from typing import Any

import pytest

import autoplan
from autoplan.cost_models.config import ParallelConfig
from autoplan.cost_models.errors import ConfigError
from tests import zoo
from tests.harness import (
    Case,
    SeededBatches,
    assert_trains_like_reference,
    run_case,
    run_ranks,
    train_planned_lm,
)
from tests.test_equivalence import forward_matmuls

_WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOKEN_SHARDED = ("o_proj", "gate_proj", "up_proj", "down_proj")
"""Projections whose forward matmul multiplies this rank's tokens by the whole weight (q/k/v may
instead produce this rank's heads from all tokens: either is a context-parallel layout)."""


def _case(
    name: str, *, preset: str, mesh_shape: tuple[int, ...] | None, batch: int, spec: str, heads: int = 4
) -> Case:
    replicated = "R" if mesh_shape is None else ",".join("R" for _ in mesh_shape)
    return Case(
        name=name,
        build_model=functools.partial(zoo.llama_long_context, heads=heads),
        batches=SeededBatches(zoo.token_batch, {"batch": batch, "seq": zoo.LONG_CONTEXT}),
        loss_fn=zoo.lm_loss,
        preset=preset,
        mesh_shape=mesh_shape,
        pins={"input_0": spec, "target_0": spec} | {f"*.{w}.weight": replicated for w in _WEIGHTS},
        profile=None,
        optimizer="sgd_momentum",
        lr=0.1,
    )


def _assert_context_parallel(case: Case, result: Mapping[str, Any], *, axis: int, weight_spec: str | None = "R") -> None:
    """On mesh axis ``axis``: the token projections split the tokens (``S(0)`` of the flattened
    ``(B*T, H)`` rows; the whole weight on that axis unless ``weight_spec`` is None), attention
    splits the heads, and sequence <-> heads conversions run."""
    plan = result["plan"]
    matmuls = [m for m in forward_matmuls(case, plan) if any(f".{w}." in (m["weight"] or "") for w in TOKEN_SHARDED)]
    assert len(matmuls) == 2 * len(TOKEN_SHARDED), matmuls
    for m in matmuls:
        assert m["out"][axis] == "S(0)" and weight_spec in (None, m["weight_spec"][axis]), m
    attention = [d for d in plan.nodes.values() if d["op"] == "autoplan.sdpa.default"]
    assert len(attention) == 2 and all(d["out"][0][axis] == "S(1)" for d in attention), attention
    steps = {kind for c in plan.collectives for kind, a in c.steps if a == axis}
    assert "all_to_all" in steps, steps
    assert "context" in list(plan.parallelism().values())[axis]  # what summary/explain call the axis


def test_llama_long_sequence_split_over_2_ranks_trains_like_single_device():
    case = _case("llama-cp-2", preset="2xCPU", mesh_shape=None, batch=1, spec="S(1)")
    results = run_case(case, timeout_s=600)

    assert results[0]["plan"].input_specs[0] == ("S(1)",)
    _assert_context_parallel(case, results[0], axis=0)
    assert_trains_like_reference(results)


@pytest.mark.slow
def test_llama_context_x_tensor_parallel_on_2x2_mesh_trains_like_single_device():
    """One sample: its sequence split over mesh axis 0, the weights Megatron-split over axis 1
    (``zoo.LLAMA_TP_PINS``); attention splits its 4 heads over both axes."""
    case = _case("llama-cp-x-tp-2x2", preset="4xCPU", mesh_shape=(2, 2), batch=1, spec="S(1),R")
    case = dataclasses.replace(case, pins=dict(case.pins) | {k: f"R,{v}" for k, v in zoo.LLAMA_TP_PINS.items()})
    results = run_case(case, timeout_s=900)

    assert results[0]["plan"].input_specs[0] == ("S(1)", "R")
    _assert_context_parallel(case, results[0], axis=0, weight_spec=None)
    attention = [d for d in results[0]["plan"].nodes.values() if d["op"] == "autoplan.sdpa.default"]
    assert all(d["out"][0] == ["S(1)", "S(1)"] for d in attention), attention
    assert_trains_like_reference(results)


def _assert_ring(result: Mapping[str, Any], *, axis: int) -> None:
    """Every attention op splits the sequence (``S(2)`` of ``(B, H, T, D)``) on ``axis``, and the
    estimate lists the ring's point-to-point transfers on that axis."""
    plan = result["plan"]
    attention = [d for d in plan.nodes.values() if d["op"].startswith("autoplan.sdpa")]
    assert len(attention) == 4, attention  # 2 layers, forward and backward
    assert all(spec[axis] == "S(2)" for d in attention for spec in d["in"][:3]), attention
    rows = [r for r in plan.estimate.comm.rows if r.kind == "send_recv"]
    assert [r.axis for r in rows] == [plan.placement_axis_names[axis]], plan.estimate.comm.rows
    assert rows[0].count == 2 * (10 + 22), rows  # per layer: the forward's 10 messages, the backward's 22
    assert "context" in list(plan.parallelism().values())[axis]


def test_llama_with_one_head_runs_ring_attention_over_2_ranks_and_trains_like_single_device():
    """One head: no heads to split (Ulysses cannot run), so the sequence axis runs attention as a
    causal ring (zigzag-balanced); replicated attention would compute the whole sequence twice."""
    case = _case("llama-ring-2", preset="2xCPU", mesh_shape=None, batch=1, spec="S(1)", heads=1)
    results = run_case(case, timeout_s=600)

    _assert_ring(results[0], axis=0)
    assert_trains_like_reference(results)


@pytest.mark.slow
def test_ring_attention_x_tensor_parallel_on_2x2_mesh_trains_like_single_device():
    """Two heads, split tensor-parallel over mesh axis 1 (``zoo.LLAMA_TP_PINS``, k/v by heads):
    none left for axis 0, which splits the sequence and runs each rank's head as a ring."""
    case = _case("llama-ring-x-tp-2x2", preset="4xCPU", mesh_shape=(2, 2), batch=1, spec="S(1),R", heads=2)
    case = dataclasses.replace(case, pins=dict(case.pins) | {k: f"R,{v}" for k, v in zoo.LLAMA_TP_PINS.items()})
    results = run_case(case, timeout_s=900)

    _assert_ring(results[0], axis=0)
    attention = [d for d in results[0]["plan"].nodes.values() if d["op"].startswith("autoplan.sdpa")]
    assert all(d["in"][0] == ["S(2)", "S(1)"] for d in attention), attention
    assert_trains_like_reference(results)


# --- a context-parallel axis beside tensor parallelism (ParallelConfig.cp) -------------------------


def _cp_batches(batch: int) -> SeededBatches:
    return SeededBatches(zoo.token_batch, {"batch": batch, "seq": zoo.LONG_CONTEXT})


def _cp_plan(cfg: ParallelConfig, *, heads: int = 4) -> autoplan.Plan:
    x, y = _cp_batches(cfg.global_batch_size)(0)
    return autoplan.plan(
        zoo.llama_long_context(heads=heads), f"1x{cfg.world_size}xCPU", example_inputs=(x,), loss_fn=zoo.lm_loss,
        example_targets=(y,), optimizer="sgd_momentum", global_batch_size=cfg.global_batch_size, config=cfg,
    )  # fmt: skip


def _train_cp_planned(rank: int, world_size: int, plan_json: str, heads: int, batch: int) -> dict[str, Any]:  # noqa: ARG001
    return train_planned_lm(plan_json, zoo.llama_long_context(heads=heads), _cp_batches(batch))


def _assert_sequence_axis(plan: autoplan.Plan) -> None:
    """The ``cp`` axis splits every sample's tokens and holds every parameter whole (ZeRO-3:
    stored sharded over ``dp x cp``, gathered for use); each attention op splits the sequence
    (ring, ``S(2)`` of ``(B, H, T, D)``) or the heads there. The estimate reduces the gradients
    over ``cp`` with ``dp``'s (ZeRO-3: reduce-scatters, and gathers on ``cp`` too)."""
    assert plan.pipeline is not None
    names = plan.pipeline.stage_axis_names
    cp = names.index("cp")
    zero3 = plan.config.zero_stage >= 3
    assert plan.input_specs[0][cp] == "S(1)", plan.input_specs
    assert all(spec[cp].startswith("S(") if zero3 else spec[cp] == "R" for spec in plan.param_specs.values()), (
        plan.param_specs
    )
    kinds = {r.kind for r in plan.estimate.comm.rows if r.axis == "cp"}
    assert kinds == ({"reduce_scatter", "all_gather"} if zero3 else {"all_reduce"}), plan.estimate.comm.rows
    # priced = executed: the program reduces every gradient over cp (the estimate's cp row). A 1-D
    # weight stored S(0) on dp and on cp (ZeRO-3) is all-reduced there after dp's reduce-scatter and
    # sliced (DTensor's nested shard of one dim), priced as a reduce-scatter: a norm weight's bytes.
    reductions = {"reduce_scatter", "all_reduce"} if zero3 else {"all_reduce"}
    grads = [c for c in plan.collectives if c.arg_index == -1 and not c.consumer.startswith("<")]
    on_cp = [c for c in grads if any(kind in reductions and axis == cp for kind, axis in c.steps)]
    assert {c.consumer for c in on_cp} == {f"p_{n.replace('.', '_')}" for n in plan.param_names}, grads
    attention = [d for d in plan.nodes.values() if d["op"].startswith("autoplan.sdpa")]
    assert attention and all(d["in"][0][cp] in ("S(1)", "S(2)") for d in attention), attention
    assert "context" in plan.parallelism()["cp"], plan.parallelism()


@pytest.mark.parametrize(
    ("dp", "zero_stage", "heads", "offload"),
    [
        (1, 0, 4, False),
        (1, 3, 4, False),
        pytest.param(2, 3, 2, False, marks=pytest.mark.slow),
        pytest.param(2, 3, 4, True, marks=pytest.mark.slow),
    ],
    ids=["cp=2-tp=2", "cp=2-tp=2-zero3", "dp=2-cp=2-tp=2-zero3-ring", "dp=2-cp=2-tp=2-zero3-offload"],
)
def test_a_context_parallel_axis_beside_tensor_parallelism_trains_like_single_device(
    dp: int, zero_stage: int, heads: int, offload: bool
):
    """A global-batch plan with ``cp=2, tp=2``: the stage mesh is ``cp x tp`` (``dp x cp x tp``),
    the sequence split on ``cp`` with the weights whole there and the ILP free on ``tp``; it
    trains like one device. With 2 heads split over ``tp`` none are left for ``cp``, whose
    attention then runs as a ring; ZeRO-3 shards the weights over ``dp x cp`` (over ``cp`` alone
    with ``dp=1``), and the optimizer may run on the host (a layout the search offers where
    memory binds)."""
    cfg = ParallelConfig(dp=dp, cp=2, tp=2, microbatch_size=1, zero_stage=zero_stage, offload_optimizer=offload)
    plan = _cp_plan(cfg, heads=heads)
    assert plan.config == cfg
    assert plan.pipeline is not None
    assert plan.pipeline.stage_axis_names == ("dp", "cp", "tp")[-(2 + (dp > 1)) :]
    _assert_sequence_axis(plan)
    assert "cp+tp" in {r.axis for r in plan.estimate.comm.rows}, plan.estimate.comm.rows
    results = run_ranks(
        _train_cp_planned, cfg.world_size, json.dumps(plan.to_dict()), heads, cfg.global_batch_size, timeout_s=900
    )
    assert_trains_like_reference(results)


def test_context_parallelism_beside_tensor_parallelism_is_refused_where_it_cannot_run():
    with pytest.raises(ConfigError, match="needs tp > 1"):
        ParallelConfig(cp=2)
    with pytest.raises(ConfigError, match="2[*]cp divides 1024"):
        _cp_plan(ParallelConfig(cp=3, tp=2))
    # 4 x 4 ranks on nodes of 8: the cp axis would hold 2 ranks in each node, one axis two links
    with pytest.raises(ConfigError, match="use tp=8 .the cp axis then crosses nodes. or cp[*]tp <= 8"):
        ParallelConfig(cp=4, tp=4).check_against(world_size=16, devices_per_node=8, num_blocks=2, global_batch_size=1)
    ParallelConfig(cp=2, tp=8).check_against(world_size=16, devices_per_node=8, num_blocks=2, global_batch_size=1)
