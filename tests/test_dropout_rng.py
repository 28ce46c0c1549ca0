"""Random ops under sharding draw exactly the single-device values (issue #46, first item).

A sharded random op (dropout's ``bernoulli_``, ``rand_like``, ``native_dropout``, ...) used to
run on each rank's local shard from the rank's default generator, and every rank is seeded
alike: rows ``i`` and ``i + B/2`` of a batch split over 2 ranks were kept or dropped together,
and the program did not train like the single-device model. The program now draws the global
tensor on every rank from the same generator state, as the single-device model does, and keeps
its shard (:mod:`autoplan.runtime.random_ops`), so:

* the dropout mask is the single-device mask bit for bit, under batch (``S(0)`` input), tensor
  (column-parallel ``fc1``: the dropout's input split on its hidden dim) and sequence sharding
  (``S(1)`` of a ``(B, T, C)`` input), in the lowered program and in checked (DTensor) execution;
* the generator is left where the single-device step leaves it (same draws, same order);
* rows on different data-parallel ranks are not correlated (they are different rows of one draw);
* random ops whose draws read their input's values run replicated (the strategies' rule);
* a configuration plan of one stage and one micro-batch draws the single-device masks too, and
  the stages of a pipeline draw independent masks from streams of their own, leaving the default
  generator alike on every rank (:class:`autoplan.runtime.random_ops.StageRandomStream`).

The model reveals its mask: ``fc2(dropout(fc1(x)) * probe)`` with a ``probe`` parameter of the
dropout's shape, whose gradient ``dropout(h) * (dL/d(out) fc2.W)`` is zero exactly where the mask
dropped (the other factors are nonzero almost surely).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import autoplan
from autoplan.cost_models.config import ParallelConfig
from autoplan.passes.random_ops import DRAWS_BY_POSITION
from autoplan.passes.strategies import build_strategy_table
from autoplan.passes.trace import trace_training_step
from autoplan.planner.mesh import planning_mesh
from tests.harness import cpu_cluster, run_ranks

C, H = 8, 64
P_DROP = 0.5
STEP_SEED = 1234


class DropoutProbe(nn.Module):
    """``fc2(dropout(fc1(x)) * probe)`` on ``x (B, T, C)``; ``probe (B, T, H)`` reveals the mask."""

    def __init__(self, batch: int, seq: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(C, H)
        self.drop = nn.Dropout(P_DROP)
        self.probe = nn.Parameter(torch.ones(batch, seq, H))
        self.fc2 = nn.Linear(H, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(self.fc1(x)) * self.probe)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum()


def _batch(batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(batch, seq, C, generator=g), torch.randn(batch, seq, C, generator=g)


@dataclass(frozen=True)
class Layout:
    """A sharding of the probe on 2 ranks: the pins, the batch shape, and the placement the
    dropout's random op then runs in (asserted from the plan)."""

    pins: Mapping[str, str]
    batch: int
    seq: int
    dropout_spec: str


LAYOUTS = {
    # the batch split: every op computes on its rank's samples
    "batch": Layout({"input_0": "S(0)", "target_0": "S(0)", "probe": "S(0)", "fc*": "R"}, 4, 8, "S(0)"),
    # column-parallel fc1, row-parallel fc2 (one token, so no rows to split instead): the dropout's
    # input is split on its hidden dim
    "tensor": Layout(
        {"input_0": "R", "target_0": "R", "fc1.weight": "S(0)", "fc1.bias": "S(0)", "fc2.weight": "S(1)",
         "fc2.bias": "R", "probe": "S(2)"},
        1, 1, "S(2)",
    ),
    # the sequence split (context parallelism's layout): every op computes on its rank's tokens
    "sequence": Layout({"input_0": "S(1)", "target_0": "S(1)", "probe": "S(1)", "fc*": "R"}, 1, 8, "S(1)"),
}  # fmt: skip


def _random_node_specs(plan: autoplan.Plan) -> list[str]:
    return [spec for d in plan.nodes.values() if d["op"] == "aten.bernoulli_.float" for spec in d["out"][0]]


def _mask_step(rank: int, world_size: int, layout: Layout) -> dict[str, Any]:  # noqa: ARG001
    """On a rank: one step of the parallelized probe (lowered program, then checked DTensor
    execution) and of the single-device model, each from the same generator state; the probe's
    full gradients, the losses and the generator states after each step."""
    torch.manual_seed(0)
    model = DropoutProbe(layout.batch, layout.seq)
    reference = copy.deepcopy(model)
    x, y = _batch(layout.batch, layout.seq)
    pm = autoplan.parallelize(
        model, cpu_cluster("2xCPU", compute_slowdown=1000.0), example_inputs=(x,), loss_fn=_loss,
        example_targets=(y,), pins=dict(layout.pins), optimizer="sgd", profile=None,
    )  # fmt: skip
    params = dict(pm.named_sharded_parameters())
    out: dict[str, Any] = {"plan": pm.plan if rank == 0 else None}
    for mode, check in (("lowered", False), ("checked", True)):
        torch.manual_seed(STEP_SEED)
        loss = pm.forward_backward(x, targets=(y,), check=check)
        out[f"{mode}_rng"] = torch.get_rng_state()
        grad = params["probe"].grad
        out[f"{mode}_probe_grad"] = grad.full_tensor() if isinstance(grad, DTensor) else grad
        out[f"{mode}_loss"] = float(loss)
    torch.manual_seed(STEP_SEED)
    ref_loss = _loss(reference(x), y)
    out["ref_rng"] = torch.get_rng_state()
    ref_loss.backward()
    out["ref_probe_grad"] = reference.probe.grad
    out["ref_loss"] = ref_loss.item()
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dropout_mask_is_the_single_device_mask_bit_for_bit(layout: str) -> None:
    """On both ranks, after one step from one seed: the probe's zero pattern (the mask) equals the
    single-device one element for element, the generator state too, and the loss and the probe's
    gradient agree to rounding, in the lowered program and in checked execution."""
    results = run_ranks(_mask_step, 2, LAYOUTS[layout], timeout_s=120.0)
    plan = results[0]["plan"]
    assert _random_node_specs(plan) == [LAYOUTS[layout].dropout_spec], _random_node_specs(plan)
    for r in results:
        ref_mask = r["ref_probe_grad"] != 0
        assert 0.3 < ref_mask.float().mean() < 0.7  # a real dropout mask (p = 0.5)
        for mode in ("lowered", "checked"):
            mask = r[f"{mode}_probe_grad"] != 0
            assert torch.equal(mask, ref_mask), (
                f"{layout}/{mode}: {int((mask != ref_mask).sum())} of {mask.numel()} mask elements differ"
            )
            assert torch.equal(r[f"{mode}_rng"], r["ref_rng"]), f"{layout}/{mode}: the step drew other numbers"
            assert r[f"{mode}_loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
            torch.testing.assert_close(r[f"{mode}_probe_grad"], r["ref_probe_grad"], rtol=1e-5, atol=1e-6)


def test_rows_on_different_data_parallel_ranks_draw_different_masks() -> None:
    """The two halves of the batch (rank 0's samples and rank 1's) are different parts of one
    draw: about half of their ``B/2 * T * H = 1024`` mask elements agree, as for independent masks
    (before, all of them did: both ranks drew their shard from the same generator state)."""
    layout = LAYOUTS["batch"]
    results = run_ranks(_mask_step, 2, layout, timeout_s=120.0)
    half = layout.batch // 2
    for r in results:
        mask = r["lowered_probe_grad"] != 0  # (B, T, H)
        agree = (mask[:half] == mask[half:]).float().mean().item()
        assert 0.3 < agree < 0.7, f"samples i and i + {half} agree on {agree:.0%} of their mask"


def test_random_ops_drawn_by_position_run_sharded_and_others_run_replicated() -> None:
    """Strategies (:mod:`autoplan.passes.random_ops`): an op whose draws depend only on the
    tensor's shape (``bernoulli_``) keeps DTensor's sharded strategies, output in its input's
    placement; one whose draws read the input's values (``bernoulli`` of a probability tensor)
    runs replicated, so the planner prices the gather it needs."""

    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(C, H)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            return nn.functional.dropout(h, P_DROP) * torch.bernoulli(torch.sigmoid(h))

    x, y = torch.randn(4, 8, C), torch.randn(4, 8, H)
    traced = trace_training_step(Both(), (x,), loss_fn=_loss, example_targets=(y,))
    with planning_mesh(cpu_cluster("2xCPU")) as mesh:
        table = build_strategy_table(traced, mesh)
    by_op: dict[str, list[Any]] = {}
    for n in traced.graph_module.graph.nodes:
        if n.op == "call_function" and n.name in table.nodes:
            by_op.setdefault(str(n.target), []).append(table.nodes[n.name])
    assert torch.ops.aten.bernoulli_.float in DRAWS_BY_POSITION
    (drop,) = by_op["aten.bernoulli_.float"]
    assert drop.strategies and all(s.input_specs == s.output_specs for s in drop.strategies), drop.strategies
    assert any(isinstance(s.output_specs[0][0], Shard) for s in drop.strategies), drop.strategies
    assert all(type(p) in (Replicate, Shard) for s in drop.strategies for p in s.output_specs[0])
    (sample,) = by_op["aten.bernoulli.default"]
    assert [s.input_specs for s in sample.strategies] == [((Replicate(),),)], sample.strategies


# --- pipelines: plans with a configuration (autoplan.runtime.pipeline) ----------------------------


class ProbeBlock(nn.Module):
    """``x + dropout(fc(x)) * probe`` on ``x (B, T, C)``; ``probe (1, T, C)`` broadcasts over the
    batch (the joint search traces other batch sizes), so with one sample its gradient is zero
    exactly where this block's mask dropped."""

    def __init__(self, seq: int) -> None:
        super().__init__()
        self.fc = nn.Linear(C, C)
        self.drop = nn.Dropout(P_DROP)
        self.probe = nn.Parameter(torch.ones(1, seq, C))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc(x)) * self.probe


class ProbeStack(nn.Module):
    """Two :class:`ProbeBlock` (their dropouts draw tensors of one shape): one per pipeline stage."""

    def __init__(self, seq: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ProbeBlock(seq) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


PIPE_SEQ = 32


def _probe_grads(pm: Any) -> dict[str, torch.Tensor]:
    """The full gradients of the probes of this rank's stages (collective over the stage mesh)."""
    grads = {}
    for name, p in pm.owned_parameters().items():
        if name.endswith("probe"):
            grads[name] = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            p.grad = None
    return grads


def _pipeline_step(rank: int, world_size: int, plan_json: str, batch: int) -> dict[str, Any]:  # noqa: ARG001
    """On a rank: one step of the planned pipeline and of the single-device model from one seed
    (the pipeline's twice: the default generator's state decides its masks); the probe gradients
    of this rank's stages, the losses, and the default generator's state after each step."""
    plan = autoplan.Plan.from_dict(json.loads(plan_json))
    torch.manual_seed(0)
    model = ProbeStack(PIPE_SEQ)
    reference = copy.deepcopy(model)
    x, y = _batch(batch, PIPE_SEQ)
    pm = autoplan.parallelize(model, plan.cluster, example_inputs=(x,), loss_fn=_loss, example_targets=(y,), plan=plan)
    runs = []
    for _ in range(2):
        torch.manual_seed(STEP_SEED)
        loss = float(pm.forward_backward(x, targets=(y,)))
        runs.append((loss, torch.get_rng_state(), _probe_grads(pm)))
    torch.manual_seed(STEP_SEED)
    ref_loss = _loss(reference(x), y)
    ref_rng = torch.get_rng_state()
    ref_loss.backward()
    torch.manual_seed(STEP_SEED)
    torch.empty((), dtype=torch.int64).random_()  # what a pipeline of several stages draws per step
    return {
        "probe_grads": runs[0][2], "again": runs[1][2], "loss": runs[0][0],
        "ref_probe_grads": {n: p.grad for n, p in reference.named_parameters() if n.endswith("probe")},
        "ref_loss": ref_loss.item(), "rng": runs[0][1], "ref_rng": ref_rng, "one_draw_rng": torch.get_rng_state(),
    }  # fmt: skip


def _pipeline_plan(cfg: ParallelConfig, batch: int) -> str:
    x, y = _batch(batch, PIPE_SEQ)
    plan = autoplan.plan(
        ProbeStack(PIPE_SEQ), f"1x{cfg.world_size}xCPU", example_inputs=(x,), loss_fn=_loss, example_targets=(y,),
        optimizer="sgd", global_batch_size=batch, config=cfg,
    )  # fmt: skip
    return json.dumps(plan.to_dict())


def test_one_stage_data_parallel_pipeline_draws_the_single_device_masks() -> None:
    """A configuration plan of one stage and one micro-batch (``PipelineModel``, dp=2) draws
    from the default generator exactly what the single-device step draws."""
    cfg = ParallelConfig(dp=2, microbatch_size=1, num_microbatches=1)
    results = run_ranks(_pipeline_step, 2, _pipeline_plan(cfg, 2), 2, timeout_s=120.0)
    for r in results:
        assert torch.equal(r["rng"], r["ref_rng"]), "the step drew other numbers than the single-device step"
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
        for name, g in r["probe_grads"].items():
            assert torch.equal(g != 0, r["ref_probe_grads"][name] != 0), name
            torch.testing.assert_close(g, r["ref_probe_grads"][name], rtol=1e-5, atol=1e-6)


def test_pipeline_stages_draw_independent_masks_seeded_by_the_default_generator() -> None:
    """Two stages (pp=2, one block each, the same dropout shape; two micro-batches of one
    sample): each stage draws from a stream of its own (``StageRandomStream``). A probe gradient,
    summed over the micro-batches, is zero where both masks dropped (p = 1/4); the two blocks'
    zero patterns agree on about 5/8 of their elements, as independent masks do (before, both
    stages drew from the one shared state: the patterns were equal). The step takes one draw of
    the default generator on every rank (the streams' seed), so the ranks stay alike and a step
    from the same state (a resumed checkpoint) draws the same masks."""
    cfg = ParallelConfig(pp=2, microbatch_size=1, num_microbatches=2, schedule="gpipe")
    results = run_ranks(_pipeline_step, 2, _pipeline_plan(cfg, 2), 2, timeout_s=120.0)
    dropped = {name: g == 0 for r in results for name, g in r["probe_grads"].items()}
    assert sorted(dropped) == ["blocks.0.probe", "blocks.1.probe"], sorted(dropped)
    for d in dropped.values():
        assert 0.1 < d.float().mean() < 0.4, d.float().mean()
    agree = (dropped["blocks.0.probe"] == dropped["blocks.1.probe"]).float().mean().item()
    assert 0.45 < agree < 0.8, f"the stages' masks agree on {agree:.0%} of their elements"
    for r in results:
        assert torch.equal(r["rng"], r["one_draw_rng"]), "the step took other draws of the default generator"
        for name, g in r["probe_grads"].items():
            assert torch.equal(g, r["again"][name]), f"{name}: the same starting state drew another mask"
