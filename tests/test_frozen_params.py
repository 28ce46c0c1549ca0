"""Frozen parameters (``requires_grad=False``) stay frozen under every plan.

A frozen parameter is still a parameter: it is placed by the plan (sharded or replicated), read by
the program and saved in checkpoints. But it is not trained, exactly as in the single-device
model: the traced step returns no gradient for it (so no backward op computes one and no
collective reduces one), the optimizer keeps no state for it, and the memory model counts its
weights only (no gradient, no optimizer state).

Multi-process cases train on 2 gloo CPU ranks and compare with the single-device model, on every
rank: the loss at every step and every trainable parameter after the last step within
``REL_TOL`` (fp32), every frozen parameter bit-identical to its initial value, no ``.grad`` and
no optimizer state on a frozen parameter.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoplan
from autoplan.api import plan as make_plan
from autoplan.cost_models.config import ParallelConfig
from autoplan.passes.trace import trace_training_step
from tests import zoo
from tests.harness import NUM_STEPS, REL_TOL, assert_trains_like_reference, cpu_cluster, run_ranks, train_both

VOCAB, DIM, HIDDEN, SEQ = 16, 8, 32, 8


def sinusoidal_table(num_positions: int, dim: int) -> torch.Tensor:
    """The fixed position table of "Attention Is All You Need": sin on even, cos on odd dims."""
    pos = torch.arange(num_positions, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(num_positions, dim)
    table[:, 0::2], table[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
    return table


class FrozenEmbeddingLM(nn.Module):
    """A frozen token embedding and a frozen sinusoidal position table (a ``Parameter``), then a
    trainable MLP head: ``logits = fc2(gelu(fc1(tok[ids] + pos)))``."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.tok.weight.requires_grad_(False)
        self.pos = nn.Parameter(sinusoidal_table(SEQ, DIM), requires_grad=False)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.tok(ids) + self.pos)))


FROZEN = ("tok.weight", "pos")
TRAINABLE = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def frozen_lm(seed: int = 0) -> FrozenEmbeddingLM:
    torch.manual_seed(seed)
    return FrozenEmbeddingLM()


def lm_batch(batch: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, SEQ), generator=g), torch.randint(0, VOCAB, (batch, SEQ), generator=g)


token_loss = zoo.cross_entropy_mean


def numel(model: nn.Module, names: tuple[str, ...]) -> int:
    params = dict(model.named_parameters())
    return sum(params[n].numel() for n in names)


# --- one process: the traced step and the memory model -------------------------------------------


def test_traced_step_has_no_gradient_output_and_no_backward_op_for_frozen_parameters():
    model = frozen_lm()
    ids, labels = lm_batch()
    traced = trace_training_step(model, (ids,), loss_fn=token_loss, example_targets=(labels,))

    assert traced.param_names == ("pos", "tok.weight", *TRAINABLE)  # still placeholders, still planned
    out = next(n for n in traced.graph_module.graph.nodes if n.op == "output")
    _, *grads = out.args[0]
    assert len(grads) == len(TRAINABLE)
    # the single-device backward computes no embedding gradient: neither does the traced step
    ops = {str(n.target) for n in traced.graph_module.graph.nodes if n.op == "call_function"}
    assert "aten.embedding_dense_backward.default" not in ops
    assert traced.trainable_names == TRAINABLE  # the gradients' order


def test_frozen_parameter_unused_by_the_loss_is_not_an_error():
    class WithUnusedFrozen(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 8)
            self.spare = nn.Parameter(torch.ones(4), requires_grad=False)  # read by nothing

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    traced = trace_training_step(WithUnusedFrozen(), (torch.randn(8, 16),), loss_fn=lambda out: out.square().mean())
    assert traced.param_names == ("spare", "lin.weight", "lin.bias")  # own parameters before submodules
    assert traced.trainable_names == ("lin.weight", "lin.bias")


def test_plan_memory_counts_weights_of_frozen_parameters_but_no_gradient_or_optimizer_state():
    model = frozen_lm()
    ids, labels = lm_batch()
    # everything replicated, so each device holds whole tensors and the bytes are exact:
    #   params    = 4 B x every element          (fp32 weights, frozen ones included)
    #   optimizer = 8 B x trainable elements     (Adam: exp_avg + exp_avg_sq in fp32)
    #   grads     = 4 B x trainable elements     (at the optimizer step every gradient exists)
    plan = make_plan(
        model, "2xCPU", example_inputs=(ids,), loss_fn=token_loss, example_targets=(labels,),
        optimizer="adam", pins={"*": "R", "input_0": "S(0)", "target_0": "S(0)"},
    )  # fmt: skip
    mem = plan.estimate.memory_bytes
    all_numel, trainable = numel(model, FROZEN + TRAINABLE), numel(model, TRAINABLE)
    assert mem["params"] == 4 * all_numel
    assert mem["optimizer"] == 8 * trainable
    # no collective carries a frozen parameter's gradient
    assert not [c for c in plan.collectives if c.consumer in ("p_tok_weight", "p_pos")]
    assert {c.consumer for c in plan.collectives if c.arg_index == -1} <= {
        f"p_{n.replace('.', '_')}" for n in TRAINABLE
    }


def test_joint_estimate_counts_weights_of_frozen_parameters_but_no_gradient_or_optimizer_state():
    model = zoo.gpt2_tiny()
    frozen = ("transformer.wte.weight", "transformer.wpe.weight")  # wte is tied to lm_head
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    ids, labels = zoo.token_batch(batch=4)
    est = autoplan.estimate(
        model, "2xCPU", (ids,), loss_fn=zoo.lm_loss, example_targets=(labels,), global_batch_size=4,
        config=ParallelConfig(dp=2, tp=1, pp=1, microbatch_size=2, num_microbatches=1), optimizer="adam",
    )  # fmt: skip
    all_numel = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable < all_numel
    (parts,) = est.memory_parts_bytes
    # fp32 Adam, ZeRO 0: weights 4 B x all elements, gradients 4 B and Adam's two states 8 B x trainable
    assert parts["weights"] == 4 * all_numel
    assert 0 <= parts["grads"] <= 4 * trainable  # those alive at the peak (memory.stage_memory_parts; none where it peaks at the loss backward)
    assert parts["optimizer"] == 8 * trainable


def test_freezing_a_parameter_changes_the_plan_cache_key():
    from autoplan.cost_models.cluster import Cluster
    from autoplan.planner import plan_cache

    ids, labels = lm_batch()
    cluster, options = Cluster.preset("2xCPU"), {"global_batch_size": 16}

    def key(model: nn.Module) -> str:
        return plan_cache.plan_key(model, (ids,), (labels,), token_loss, cluster, options, None)

    model = frozen_lm()
    before = key(model)
    model.fc1.weight.requires_grad_(False)  # another traced step: a cached plan must not be reused
    assert key(model) != before
    model.fc1.weight.requires_grad_(True)
    assert key(model) == before


def test_resuming_creates_no_optimizer_state_for_a_frozen_parameter():
    from autoplan.runtime.checkpoint import _materialize_optimizer_state

    trained, frozen = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4), requires_grad=False)
    opt = torch.optim.AdamW([trained, frozen], lr=1e-2)  # a hand-made optimizer may list both
    before = frozen.detach().clone()
    _materialize_optimizer_state(opt)  # what checkpoint.load does before DCP fills the state in
    assert trained in opt.state and frozen not in opt.state
    assert torch.equal(frozen.detach(), before) and frozen.grad is None


# --- 2 ranks: training ------------------------------------------------------------------------------


def train_frozen_lm(rank: int, world_size: int, optimizer: str, pins: dict[str, str]) -> dict[str, Any]:
    """Rank body: NUM_STEPS steps of the parallelized model and of the single-device reference."""
    model = frozen_lm()
    reference = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = lm_batch(seed=1)
    pm = autoplan.parallelize(
        model, cpu_cluster(f"{world_size}xCPU", compute_slowdown=1e5), example_inputs=(x,),
        loss_fn=token_loss, example_targets=(y,), optimizer=optimizer, pins=pins,
    )  # fmt: skip
    opt = pm.make_optimizer(lr=1e-2)
    sharded = dict(pm.named_sharded_parameters())
    frozen_grads: list[str] = []
    result = train_both(
        pm,
        reference,
        batches=lambda step: tuple((t,) for t in lm_batch(seed=step + 1)),
        loss_fn=token_loss,
        opt=opt,
        ref_opt=type(opt)(reference.parameters(), **opt.defaults),
        num_steps=NUM_STEPS,
        after_backward=lambda: frozen_grads.extend(n for n in FROZEN if sharded[n].grad is not None),
    )
    return result | {
        "initial": initial,
        "frozen_grads": frozen_grads,
        "frozen_state": [n for n in FROZEN if sharded[n] in opt.state],
        "frozen_requires_grad": [n for n in FROZEN if sharded[n].requires_grad],
        "frozen_collectives": [r.consumer for r in pm.redistributions if r.consumer in ("p_tok_weight", "p_pos")],
        "param_specs": dict(pm.plan.param_specs),
    }


def assert_frozen_and_trained_like_reference(results: list[dict[str, Any]]) -> None:
    assert_trains_like_reference(results, rel_tol=REL_TOL, atol=1e-7, loss_atol=0.0)
    for rank, r in enumerate(results):
        for name in FROZEN:
            assert torch.equal(r["params"][name], r["initial"][name]), f"rank {rank}: frozen {name} changed"
            assert torch.equal(r["ref_params"][name], r["initial"][name])
        for name in TRAINABLE:
            assert not torch.equal(r["params"][name], r["initial"][name]), f"rank {rank}: {name} was not trained"
        assert r["frozen_grads"] == [], f"rank {rank}: frozen parameters got a gradient: {r['frozen_grads']}"
        assert r["frozen_state"] == [], f"rank {rank}: optimizer state for frozen {r['frozen_state']}"
        assert r["frozen_requires_grad"] == []
        assert r["frozen_collectives"] == []


@pytest.mark.slow  # about 35 s on 2 shared CPU cores; the single-process tests above run in CI
def test_frozen_embedding_and_position_table_stay_bit_identical_under_data_parallel_adam():
    # data parallel: the batch split, every weight replicated; the trainable gradients are
    # all-reduced, the frozen ones do not exist
    pins = {"input_0": "S(0)", "target_0": "S(0)", "*": "R"}
    results = run_ranks(train_frozen_lm, 2, "adam", pins, timeout_s=600)
    assert all(spec == ("R",) for spec in results[0]["param_specs"].values())
    assert_frozen_and_trained_like_reference(results)


# --- 2 ranks: a pipeline ------------------------------------------------------------------------------

PIPE_BATCH, PIPE_MICROBATCHES = 8, 4
PIPE_FROZEN = ("transformer.wte.weight", "transformer.wpe.weight")
"""GPT-2's token embedding (tied to ``lm_head``: a frozen parameter held by the first and the last
stage) and its learned position table."""


def frozen_gpt2() -> nn.Module:
    model = zoo.gpt2_tiny(num_layers=4)
    for name in PIPE_FROZEN:
        model.get_parameter(name).requires_grad_(False)
    return model


def train_frozen_gpt2_pipeline(rank: int, world_size: int, plan_json: str) -> dict[str, Any]:
    """SGD with momentum, not Adam: GPT-2's attention key bias has an analytically zero gradient
    whose rounding noise Adam amplifies (tests/test_pipeline_equivalence.py)."""
    plan = autoplan.Plan.from_dict(json.loads(plan_json))
    model = frozen_gpt2()
    reference = copy.deepcopy(model)
    initial = {n: model.get_parameter(n).detach().clone() for n in PIPE_FROZEN}
    ids, labels = zoo.token_batch(batch=PIPE_BATCH, seed=1)
    pm = autoplan.parallelize(
        model, plan.cluster, example_inputs=(ids,), loss_fn=zoo.lm_loss, example_targets=(labels,), plan=plan
    )
    opt = pm.make_optimizer(lr=0.1)
    frozen_copies = [
        p for st in pm.stage_modules for n, p in zip(st.program.param_names, st.params, strict=True) if n in PIPE_FROZEN
    ]
    frozen_grads: list[int] = []
    result = train_both(
        pm,
        reference,
        batches=lambda step: tuple((t,) for t in zoo.token_batch(batch=PIPE_BATCH, seed=step + 1)),
        loss_fn=zoo.lm_loss,
        opt=opt,
        ref_opt=torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9),
        num_steps=NUM_STEPS,
        check=False,
        after_backward=lambda: frozen_grads.append(sum(p.grad is not None for p in frozen_copies)),
    )
    return result | {
        "initial": initial,
        "frozen_copies": len(frozen_copies),
        "frozen_grads": sum(frozen_grads),
        "frozen_state": sum(p in opt.state for p in frozen_copies),
    }


@pytest.mark.slow
def test_frozen_tied_embedding_stays_bit_identical_in_a_two_stage_pipeline():
    config = ParallelConfig(
        dp=1, tp=1, pp=2, microbatch_size=PIPE_BATCH // PIPE_MICROBATCHES, num_microbatches=PIPE_MICROBATCHES,
        schedule="1f1b",
    )  # fmt: skip
    ids, labels = zoo.token_batch(batch=PIPE_BATCH, seed=1)
    plan = make_plan(
        frozen_gpt2(), "1x2xCPU", example_inputs=(ids,), loss_fn=zoo.lm_loss, example_targets=(labels,),
        optimizer="sgd_momentum", global_batch_size=PIPE_BATCH, config=config,
    )  # fmt: skip
    assert plan.config == config
    results = run_ranks(train_frozen_gpt2_pipeline, 2, json.dumps(plan.to_dict()), timeout_s=900)
    assert sum(r["frozen_copies"] for r in results) >= 3  # wte on both stages, wpe on the first
    assert_trains_like_reference(results, rel_tol=REL_TOL, atol=1e-6)
    for rank, r in enumerate(results):
        for name in PIPE_FROZEN:
            assert torch.equal(r["params"][name], r["initial"][name]), f"rank {rank}: frozen {name} changed"
        assert r["frozen_grads"] == 0 and r["frozen_state"] == 0
