"""Batch norm in training mode: traced, planned data parallel, trained like one device.

The trace writes batch norm out in batch sums (:mod:`autoplan.passes.batch_norm`), so a plan that
splits the batch all-reduces the statistics as ``SyncBatchNorm`` does, and writes the running
statistics into the replicated buffers in place. Convolutions are priced as implicit GEMMs
(``cost_models/compute.py``), so the planner can see that splitting a CNN's batch pays.

Multi-process cases train on 2 gloo CPU ranks with the batch split (pinned ``S(0)``, every
parameter replicated: data parallelism) beside the single-device model and require, on every rank,
the loss at every step and every parameter after the last step within ``REL_TOL`` (fp32), and
every running statistic (``running_mean``, ``running_var``, ``num_batches_tracked``) within
``REL_TOL`` of the single-device model's. The convolutions and linears before a norm have no
bias: the norm subtracts the batch mean, so that bias's gradient is zero up to rounding, and Adam
turns rounding noise into steps of size ``lr`` (tests/test_equivalence.py's docstring).

A pipeline of micro-batches normalises each micro-batch by its own statistics and updates the
running statistics once per micro-batch; its reference is one device accumulating the gradients
of the same micro-batches. ``-m slow`` runs the other models (BatchNorm1d with and without running
statistics, BatchNorm3d, a ResNet-18-shaped CNN on 2 and 4 ranks), the pipeline with its
checkpoint round trip, and the full-width ResNet-18 plan on 8 H100.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoplan
from autoplan import ParallelConfig
from autoplan.cost_models.compute import op_flops
from autoplan.errors import PlanMismatchError
from autoplan.passes.trace import trace_training_step
from autoplan.runtime import checkpoint
from tests.harness import (
    REL_TOL,
    assert_trains_like_reference,
    cpu_cluster,
    reference_optimizer,
    rel_err,
    run_ranks,
    train_both,
)

NUM_STEPS = 4
DATA_PARALLEL = {"input_0": "S(0)", "target_0": "S(0)", "*.weight": "R", "*.bias": "R"}


def two_layer_cnn(channels: int = 8) -> nn.Module:
    """Conv2d + BatchNorm2d twice, then a linear classifier over 10 classes (8 x 8 images)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(),
        nn.Flatten(), nn.Linear(channels * 8 * 8, 10),
    )  # fmt: skip


def batch_norm_mlp(**norm_kwargs: Any) -> nn.Module:
    """Linear + BatchNorm1d + ReLU + Linear (16 -> 32 -> 8)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32, bias=False), nn.BatchNorm1d(32, **norm_kwargs), nn.ReLU(), nn.Linear(32, 8))


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 conv + batch norm, a 1x1 conv + batch norm shortcut where the
    shape changes (He et al. 2015, torchvision's ``resnet.BasicBlock``)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


def resnet18_shaped(width: int = 8) -> nn.Module:
    """ResNet-18's layout (stem conv + batch norm + max pool, four stages of two basic blocks,
    average pool, classifier) at ``width`` channels in the first stage (64 in ResNet-18)."""
    torch.manual_seed(0)
    widths = [width, 2 * width, 4 * width, 8 * width]
    layers: list[nn.Module] = [
        nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
    ]  # fmt: skip
    c_in = width
    for stage, c_out in enumerate(widths):
        layers += [BasicBlock(c_in, c_out, 1 if stage == 0 else 2), BasicBlock(c_out, c_out, 1)]
        c_in = c_out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, 10)]
    return nn.Sequential(*layers)


def resnet_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step + 1)
    return torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)


def volume_cnn() -> nn.Module:
    """Conv3d + BatchNorm3d, then a linear classifier over 10 classes (4 x 4 x 4 volumes)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv3d(2, 4, 3, padding=1, bias=False), nn.BatchNorm3d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 64, 10)
    )


def volume_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step + 1)
    return torch.randn(8, 2, 4, 4, 4, generator=g), torch.randint(0, 10, (8,), generator=g)


def image_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step + 1)
    return torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)


def vector_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step + 1)
    return torch.randn(16, 16, generator=g), torch.randn(16, 8, generator=g)


MODELS = {
    "cnn": (two_layer_cnn, image_batch, F.cross_entropy),
    "mlp": (batch_norm_mlp, vector_batch, F.mse_loss),
    "mlp_no_running_stats": (lambda: batch_norm_mlp(track_running_stats=False), vector_batch, F.mse_loss),
    "resnet18": (resnet18_shaped, resnet_batch, F.cross_entropy),
    "cnn3d": (volume_cnn, volume_batch, F.cross_entropy),
}


# --- trace and plan (one process) -----------------------------------------------------------------


def test_training_batch_norm_traces_as_batch_sums_writing_its_running_statistics_in_place() -> None:
    model = two_layer_cnn()
    x, y = image_batch(0)
    traced = trace_training_step(model, (x,), loss_fn=F.cross_entropy, example_targets=(y,))
    nodes = list(traced.graph_module.graph.nodes)
    assert not [n for n in nodes if "batch_norm" in str(n.target)]
    written = {n.args[0].name for n in nodes if n.target is torch.ops.aten.copy_.default}
    assert written == {f"b_{i}_{s}" for i in (1, 4) for s in ("running_mean", "running_var", "num_batches_tracked")}
    batch_sums = [n for n in nodes if n.target is torch.ops.aten.sum.dim_IntList and n.args[1] == [0, 2, 3]]
    assert len(batch_sums) >= 4  # mean and variance of each norm (and the backward's)
    assert int(model[1].num_batches_tracked) == 0, "tracing must not update the model's own buffers"
    assert torch.equal(model[1].running_mean, torch.zeros(8))


def test_convolution_flops_are_two_per_multiply_accumulate_of_its_implicit_gemm() -> None:
    # y (N=4, C_out=6, 5, 5) of x (4, C_in=8, 7, 7) by a 3x3 kernel in 2 groups:
    # 2 * N * prod(out) * C_out * (C_in / g) * prod(kernel) = 2 * 4 * 25 * 6 * 4 * 9
    x, w = torch.empty(4, 8, 7, 7, device="meta"), torch.empty(6, 4, 3, 3, device="meta")
    y = torch.empty(4, 6, 5, 5, device="meta")
    assert op_flops(torch.ops.aten.convolution.default, [x, w], [y]) == 2 * 4 * 25 * 6 * 4 * 9
    # backward: grad_input and grad_weight are each one such GEMM; grad_bias none
    grads = [torch.empty_like(x), torch.empty_like(w), torch.empty(6, device="meta")]
    assert op_flops(torch.ops.aten.convolution_backward.default, [y, x, w], grads) == 2 * (2 * 4 * 25 * 6 * 4 * 9)
    assert op_flops(torch.ops.aten.convolution_backward.default, [y, x, w], grads[1:]) == 2 * 4 * 25 * 6 * 4 * 9


def test_planner_splits_the_batch_of_a_batch_norm_cnn_and_all_reduces_its_statistics() -> None:
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    model = nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )  # fmt: skip
    plan = autoplan.plan(
        model, "2xH100", example_inputs=(x,), loss_fn=F.cross_entropy, example_targets=(y,), profile=None
    )
    assert plan.input_specs == (("S(0)",),), plan.summary()
    d = plan.to_dict()
    # each norm's mean and variance: batch sums, partial on each rank, all-reduced (SyncBatchNorm's)
    for total, stat in (("sum_1", "div"), ("sum_2", "div_1"), ("sum_3", "div_2"), ("sum_4", "div_3")):
        assert d["nodes"][total]["in"] == [["S(0)"]] and d["nodes"][total]["out"] == [["P"]], d["nodes"][total]
        assert [c["steps"] for c in d["collectives"] if c["producer"] == stat] == [[["all_reduce", 0]]], stat


@pytest.mark.slow
def test_planner_runs_resnet18_data_parallel_on_8_gpus_with_only_all_reduces() -> None:
    with torch.device("meta"):
        model = resnet18_shaped(64)  # ResNet-18's widths: 64, 128, 256, 512
    x, y = torch.randn(256, 3, 64, 64, device="meta"), torch.randint(0, 10, (256,), device="meta")
    plan = autoplan.plan(
        model, "8xH100", example_inputs=(x,), loss_fn=F.cross_entropy, example_targets=(y,), profile=None
    )
    d = plan.to_dict()
    assert plan.input_specs == (("S(0)",),), plan.summary()
    assert all(p == ["R"] for p in d["placements"]["params"].values()), plan.summary()
    kinds = {step[0] for c in d["collectives"] for step in c["steps"]}
    assert kinds <= {"shard", "all_reduce", "to_partial"}, kinds
    # 20 norms, each: mean and variance forward, the two gradient sums backward (a reduction may be
    # shared by the bucketed gradients, so at least), plus the gradients' buckets
    stats = [c for c in d["collectives"] if c["bucket"] is None and c["steps"] == [["all_reduce", 0]]]
    assert len(stats) >= 4 * 20, len(stats)


# --- trained on 2 ranks ------------------------------------------------------------------------------


def train_data_parallel(rank: int, world_size: int, name: str, optimizer: str, check: bool) -> dict[str, Any]:
    """Rank body: ``MODELS[name]`` planned data parallel, trained beside one device (``check``:
    through the DTensor program, every placement checked, else the lowered program that runs);
    adds the running statistics of both sides."""
    build, batches, loss_fn = MODELS[name]
    model = build()
    reference = copy.deepcopy(model)
    x, y = batches(0)
    pm = autoplan.parallelize(
        model, cpu_cluster(f"{world_size}xCPU", compute_slowdown=1e5), example_inputs=(x,), loss_fn=loss_fn,
        example_targets=(y,), pins=DATA_PARALLEL, optimizer=optimizer, profile=None,
    )  # fmt: skip
    result = train_both(
        pm, reference, batches=lambda step: ((batches(step)[0],), (batches(step)[1],)), loss_fn=loss_fn,
        opt=pm.make_optimizer(lr=0.05), ref_opt=reference_optimizer(optimizer, list(reference.parameters()), 0.05),
        num_steps=NUM_STEPS, check=check,
    )  # fmt: skip
    x, y = batches(0)
    pm.eval()  # the program normalises by batch statistics: eval() cannot switch it
    try:
        pm.forward_backward(x, targets=(y,))
        switched = "ran"
    except PlanMismatchError as exc:
        switched = str(exc)
    pm.train()
    return result | {
        "after_eval": switched,
        "input_specs": pm.plan.input_specs,
        "buffers": {n: b.full_tensor() for n, b in pm.owned_buffers().items()},
        "ref_buffers": {n: b.detach().clone() for n, b in reference.named_buffers()},
    }


def assert_running_statistics_equal(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        assert set(r["buffers"]) == set(r["ref_buffers"]), rank
        errors = {n: rel_err(b.double(), r["ref_buffers"][n].double()) for n, b in r["buffers"].items()}
        bad = {n: e for n, e in errors.items() if not e <= REL_TOL}
        assert not bad, f"rank {rank}: running statistics differ from one device: {bad}"


def test_batch_norm_cnn_trains_data_parallel_like_one_device_with_its_running_statistics() -> None:
    results = run_ranks(train_data_parallel, 2, "cnn", "adam", False)
    assert results[0]["input_specs"] == (("S(0)",),)
    assert results[0]["after_eval"].startswith("the plan runs batch norm in training mode"), results[0]["after_eval"]
    assert_trains_like_reference(results)
    assert_running_statistics_equal(results)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "optimizer"),
    [
        ("mlp", "sgd_momentum"),
        ("mlp_no_running_stats", "adam"),
        ("cnn", "sgd"),
        ("resnet18", "sgd_momentum"),
        ("cnn3d", "adam"),
    ],
)
def test_batch_norm_models_train_data_parallel_like_one_device_every_placement_checked(
    name: str, optimizer: str
) -> None:
    results = run_ranks(train_data_parallel, 2, name, optimizer, True)
    assert_trains_like_reference(results)
    assert_running_statistics_equal(results)


@pytest.mark.slow
def test_resnet18_shaped_cnn_trains_data_parallel_on_4_ranks_like_one_device() -> None:
    results = run_ranks(train_data_parallel, 4, "resnet18", "sgd_momentum", False)
    assert results[0]["input_specs"] == (("S(0)",),)
    assert_trains_like_reference(results)
    assert_running_statistics_equal(results)


# --- micro-batches, pipeline stages and checkpoints -------------------------------------------------


def train_pipeline_then_checkpoint(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Rank body: the CNN planned as two pipeline stages of two micro-batches of 8, trained beside
    one device that accumulates the gradients of the same two micro-batches (batch statistics are
    per micro-batch, on one device as in the pipeline: two running-statistic updates per step);
    then saved, and loaded into a fresh pipeline of the same plan."""
    loss_fn = F.cross_entropy
    model = two_layer_cnn()
    reference = copy.deepcopy(model)
    fresh = copy.deepcopy(model)
    x, y = image_batch(0)
    config = ParallelConfig(pp=2, microbatch_size=8, num_microbatches=2)
    kwargs: dict[str, Any] = {"example_targets": (y,), "optimizer": "sgd", "profile": None, "global_batch_size": 16}
    pm = autoplan.parallelize(model, "2xCPU", example_inputs=(x,), loss_fn=loss_fn, config=config, **kwargs)
    opt, ref_opt = pm.make_optimizer(lr=0.05), reference_optimizer("sgd", list(reference.parameters()), 0.05)
    losses, ref_losses = [], []
    for step in range(NUM_STEPS):
        x, y = image_batch(step)
        losses.append(pm.forward_backward(x, targets=(y,)).item())
        opt.step()
        opt.zero_grad()
        ref_loss = 0.0
        for k in range(2):
            part = loss_fn(reference(x[8 * k : 8 * (k + 1)]), y[8 * k : 8 * (k + 1)]) / 2
            part.backward()
            ref_loss += part.item()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss)
    checkpoint.save(root, NUM_STEPS, pm, opt, plan=pm.plan)
    loaded = autoplan.parallelize(
        fresh, "2xCPU", example_inputs=(x,), loss_fn=loss_fn, example_targets=(y,), plan=pm.plan, profile=None
    )
    latest = checkpoint.find_latest(root)
    assert latest is not None
    checkpoint.load(latest, loaded, loaded.make_optimizer(lr=0.05))
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "params": {n: p.detach() for n, p in pm.full_parameters().items()},
        "ref_params": {n: p.detach() for n, p in reference.named_parameters()},
        "buffers": {n: b.full_tensor() for n, b in pm.owned_buffers().items()},
        "ref_buffers": {n: b.detach().clone() for n, b in reference.named_buffers() if n in pm.owned_buffers()},
        "loaded_buffers": {n: b.full_tensor() for n, b in loaded.owned_buffers().items()},
    }


@pytest.mark.slow
def test_pipelined_micro_batches_update_running_statistics_like_accumulation_and_checkpoint_them(
    tmp_path: Path,
) -> None:
    results = run_ranks(train_pipeline_then_checkpoint, 2, str(tmp_path / "ckpt"))
    assert_trains_like_reference(results)
    assert_running_statistics_equal(results)
    held = [set(r["buffers"]) for r in results]
    assert held[0] | held[1] == {
        f"{i}.{s}" for i in (1, 4) for s in ("running_mean", "running_var", "num_batches_tracked")
    }
    for r in results:
        counts = {n: int(b) for n, b in r["buffers"].items() if n.endswith("num_batches_tracked")}
        assert set(counts.values()) <= {2 * NUM_STEPS}, counts  # one update per micro-batch
        for n, b in r["buffers"].items():
            assert torch.equal(r["loaded_buffers"][n], b), n
