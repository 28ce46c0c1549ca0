"""One memory model for every optimizer (:mod:`autoplan.cost_models.memory`), used everywhere.

Bytes per parameter element (ZeRO, Rajbhandari et al. 2020, section 3.1)::

    weights = gradients = w                       w = 4 (fp32), 2 (bf16, fp16)
    optimizer = 4 * states + master               states: sgd 0, sgd_momentum 1, adam / adamw 2
                                                  master = 4 (fp32 copy) when w < 4, else 0

so in fp32 the optimizer state of sgd : sgd_momentum : adam is 0 : 4 : 8 bytes (0 : 1 : 2 fp32
states), and in mixed precision 4 : 8 : 12. The joint search (``autoplan.estimate``, plans made
for a global batch) and the per-operator ILP (plans without one) price the same bytes, and a
plan's memory breakdown is the estimate's.
"""

from __future__ import annotations

import pytest
import torch

import autoplan
from autoplan.api import plan as make_plan
from autoplan.cost_models.config import ParallelConfig
from autoplan.cost_models.memory import OPTIMIZERS, _optimizer_bytes, element_bytes, precision_bytes
from tests import zoo

STATES = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}
CONFIG = ParallelConfig(dp=2, tp=1, pp=1, microbatch_size=2, num_microbatches=1)
BATCH = 4


def test_memory_model_table_restates_the_formula():
    assert set(OPTIMIZERS) == set(STATES)
    for name, states in STATES.items():
        fp32 = precision_bytes(name, "fp32")
        assert (fp32.weights, fp32.grads, fp32.optimizer) == (4, 4, 4 * states)
        for mixed in ("bf16", "fp16"):
            b = precision_bytes(name, mixed)
            assert (b.weights, b.grads, b.optimizer) == (2, 2, 4 * states + 4)  # + the fp32 master copy
        frozen = element_bytes(name, 4, trainable=False)
        assert (frozen.weights, frozen.grads, frozen.optimizer) == (4, 0, 0)
    assert precision_bytes("adam", "bf16").optimizer == 12  # the ZeRO paper's K for mixed-precision Adam


def _estimate(optimizer: str, precision: str = "fp32", model: torch.nn.Module | None = None) -> autoplan.TrainingEstimate:
    ids, labels = zoo.token_batch(batch=BATCH)
    return autoplan.estimate(
        model if model is not None else zoo.gpt2_tiny(), "2xCPU", (ids,), loss_fn=zoo.lm_loss, example_targets=(labels,),
        global_batch_size=BATCH, config=CONFIG, optimizer=optimizer, precision=precision,
    )  # fmt: skip


def test_estimate_prices_optimizer_state_by_optimizer_zero_one_two_fp32_states():
    numel = sum(p.numel() for p in zoo.gpt2_tiny().parameters())
    parts = {name: _estimate(name).memory_parts_bytes[0] for name in ("sgd", "sgd_momentum", "adam")}
    # data parallel, ZeRO 0: every device holds every element; optimizer = 4 B x states x elements
    assert parts["sgd"]["optimizer"] == 0
    assert parts["sgd_momentum"]["optimizer"] == 4 * numel
    assert parts["adam"]["optimizer"] == 8 * numel  # Adam's price is what it was
    # weights do not depend on the optimizer; gradients: those alive at the peak (all of them at
    # the optimizer step, those of the later segments in a backward: memory.stage_memory_parts)
    assert len({p["weights"] for p in parts.values()}) == 1
    assert parts["adam"]["weights"] == 4 * numel
    assert all(0 <= p["grads"] <= 4 * numel for p in parts.values())  # alive at the peak


def test_mixed_precision_estimate_adds_the_fp32_master_copy_to_every_optimizer():
    numel = sum(p.numel() for p in zoo.gpt2_tiny().parameters())
    parts = _estimate("sgd", precision="bf16").memory_parts_bytes[0]
    # bf16 weights and gradients, fp32 master copy, no state: 2 + 2 + (0 + 4) bytes per element
    assert (parts["weights"], parts["optimizer"]) == (2 * numel, 4 * numel)
    assert 0 <= parts["grads"] <= 2 * numel  # those alive at the peak (memory.stage_memory_parts)


def test_a_model_given_in_bf16_is_priced_without_master_weights_and_with_bf16_states():
    """A bf16 plan of a model given in bf16 trains it as it is (autoplan.runtime.precision): no
    fp32 master, and ``torch.optim.Adam`` makes its two states ``zeros_like`` the bf16
    parameters: 2 B x 2 per element where the fp32 model's plan holds 4 + 4 x 2."""
    numel = sum(p.numel() for p in zoo.gpt2_tiny().parameters())
    mixed = _estimate("adam", precision="bf16").memory_parts_bytes[0]
    pure = _estimate("adam", precision="bf16", model=zoo.gpt2_tiny().to(torch.bfloat16)).memory_parts_bytes[0]
    assert (mixed["weights"], mixed["optimizer"]) == (2 * numel, 12 * numel)
    assert (pure["weights"], pure["optimizer"]) == (2 * numel, 4 * numel)
    # the optimizer step's foreach temporaries (Adam's sqrt of exp_avg_sq) are in the states' dtype
    kw = dict(trainable=1000, largest_trained=1000, shards=1, device_kind="cpu", offload=False, host_is_device=False)
    assert _optimizer_bytes(element_bytes("adam", 2, master_weights=False), **kw) == (4000, 2000)
    assert _optimizer_bytes(element_bytes("adam", 2), **kw) == (12000, 4000)


@pytest.mark.slow
def test_plans_report_the_optimizer_bytes_of_the_estimate():
    ids, labels = zoo.token_batch(batch=BATCH)
    est = _estimate("sgd_momentum")
    # the joint search's plan carries the estimate's breakdown for its worst stage
    joint = make_plan(
        zoo.gpt2_tiny(), "2xCPU", example_inputs=(ids,), loss_fn=zoo.lm_loss, example_targets=(labels,),
        optimizer="sgd_momentum", global_batch_size=BATCH, config=CONFIG,
    )  # fmt: skip
    assert joint.estimate.memory_bytes == pytest.approx({**est.memory_parts_bytes[0], "total": est.peak_memory_bytes})
    # the per-operator ILP's plan (no global batch), parameters replicated as under data parallelism,
    # prices the same optimizer state per element
    ilp = make_plan(
        zoo.gpt2_tiny(), "2xCPU", example_inputs=(ids,), loss_fn=zoo.lm_loss, example_targets=(labels,),
        optimizer="sgd_momentum", pins={"transformer.*": "R", "input_0": "S(0)", "target_0": "S(0)"},
    )  # fmt: skip
    assert ilp.estimate.memory_bytes["optimizer"] == est.memory_parts_bytes[0]["optimizer"]
    assert ilp.estimate.memory_bytes["params"] == est.memory_parts_bytes[0]["weights"]
