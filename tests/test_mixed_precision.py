"""Mixed precision (issue #21 item 3, ``autoplan/runtime/precision.py``): a plan made with
``precision="bf16"`` trains a model given in fp32 with fp32 master weights and the bf16 step the
plan priced; a model given in bf16 trains in bf16 as before; other combinations are refused.

The reference is one device doing the same mixed-precision arithmetic: fp32 master weights; each
step a bf16 copy of them computes the loss and the gradients, which are cast to fp32 for
clipping and AdamW on the masters. The parallel step sums in another order (its traced joint
graph: one attention op, the loss as a sum over the batch shards), and bf16 sums in another order
round differently, so the comparison is in bf16 units (2^-7 is bf16's relative spacing at the
bottom of a binade, twice its unit roundoff):

* gradients of the first step: ``||g - g_ref|| / ||g_ref|| <= 2^-7`` per parameter (measured on
  ``llama_tiny``: 5.0e-3 with ZeRO-3, pinned weights or 2 stages, 5.4e-3 with 2 micro-batches;
  two bf16 formulations of the eager model itself, HF's SDPA and eager attention, differ by
  7.7e-3), and over all of a rank's parameters nearer the bf16 reference than the fp32 step's
  gradients (3.0-3.5e-3 against 5.3-5.6e-3): the step computes in bf16;
* losses: the first within ``2^-7`` relative (the step computes the loss in bf16: one spacing),
  the later ones within ``2^-6`` (measured: two spacings at step 1, the parameters having moved
  apart as below);
* the clipping norms: within ``2^-9`` relative (measured 2.7e-4: the norm averages the
  elements' rounding);
* parameters after ``STEPS`` AdamW steps: ``||p - p_ref|| / ||p_ref|| <= PARAM_TOL`` = 2.0e-2
  (measured 1.09e-2, 1.15e-2 with 2 micro-batches; 1.61e-2 on ``v_proj`` in the micro-batch /
  pipeline / sharded-weights test since grouped-query attention runs with its key/value heads
  unrepeated, ``enable_gqa``, where the reference repeats them: the key/value gradients are
  summed over each group in another order; Adam turns rounding-level differences of
  near-zero gradients into lr-sized updates, as ``tests/test_equivalence.py`` notes for fp32),
  and fp32 training ends further away (2.8e-2), so the bound still tells bf16 from fp32.

Exact where the arithmetic is the same: the model given in bf16 runs the same bf16 program, so its
loss and gradients equal the fp32-master model's bit for bit (those cast to bf16).
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autoplan
from autoplan.passes.layers import find_layers
from autoplan.passes.trace import trace_training_step
from autoplan.planner.ilp import plan_traced
from autoplan.planner.mesh import planning_mesh
from autoplan.planner.plan import Plan
from autoplan.planner.tracing import prepare_for_precision
from autoplan.runtime import checkpoint
from autoplan.runtime.pipeline import build_pipeline
from autoplan.runtime.precision import check_model_precision
from tests import zoo
from tests.harness import cpu_cluster, rel_err, run_ranks
from tests.test_bad_inputs import fake_job

STEPS, LR, WD, MAX_NORM = 4, 3e-3, 0.1, 1.0
BF16_SPACING = 2.0**-7
PARAM_TOL = 2.0e-2
"""Parameters after STEPS AdamW steps (measured: see the module docstring)."""
CLUSTER = cpu_cluster("2xCPU", compute_slowdown=1e5)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Every step trains on this batch, so the loss goes down."""
    return zoo.token_batch(seed=1)


def _bf16_plan(**config: Any) -> Plan:
    ids, labels = _batch()
    cfg = autoplan.ParallelConfig(**({"pp": 1} | config))
    return autoplan.plan(zoo.llama_tiny(), CLUSTER, example_inputs=(ids,), loss_fn=zoo.lm_loss,
                         example_targets=(labels,), config=cfg, global_batch_size=ids.shape[0], precision="bf16",
                         optimizer="adamw", profile=None)  # fmt: skip


@pytest.fixture(scope="module")
def zero3_plan() -> Plan:
    """dp=2 with ZeRO-3: fp32 masters sharded, the bf16 copies all-gathered, gradients reduce-scattered."""
    return _bf16_plan(dp=2, tp=1, microbatch_size=4, num_microbatches=1, zero_stage=3)


# --- the reference: one device, the same mixed-precision arithmetic ---------------------------------


@functools.cache
def reference(compute_dtype: torch.dtype) -> dict[str, Any]:
    """STEPS steps of the fp32 master model, each computed by a ``compute_dtype`` copy of it
    (computed once per dtype: the results are only read)."""
    model = zoo.llama_tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    ids, labels = _batch()
    losses, norms, first_grads = [], [], {}
    for step in range(STEPS):
        compute = copy.deepcopy(model).to(compute_dtype)
        loss = zoo.lm_loss(compute(ids), labels)
        loss.backward()
        for (name, p), c in zip(model.named_parameters(), compute.parameters(), strict=True):
            p.grad = c.grad.to(torch.float32)
            if step == 0:
                first_grads[name] = p.grad.clone()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "grads": first_grads, "params": dict(model.named_parameters())}


# --- the parallel side ------------------------------------------------------------------------------


def _train(pm: Any, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The loop of the reference on the parallel model: ``forward_backward`` at the first step,
    ``loss = pm(...)``, ``loss.backward()`` after; the global-norm clipping; ``opt``."""
    ids, labels = _batch()
    losses, norms, first_grads = [], [], {}
    for step in range(STEPS):
        if step == 0:
            loss = pm.forward_backward(ids, targets=(labels,))
            first_grads = {n: p.grad.full_tensor() for n, p in pm.owned_parameters().items()}
        else:
            loss = pm(ids, targets=(labels,))
            loss.backward()
        norms.append(float(pm.clip_grad_norm_(MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {
        "losses": losses,
        "norms": norms,
        "grads": first_grads,
        "params": {n: p.detach() for n, p in pm.full_parameters().items()},
        "param_dtypes": sorted({str(p.dtype) for p in pm.parameters()}),
        "grad_dtypes": sorted({str(g.dtype) for g in first_grads.values()}),
        "state_dtypes": sorted({str(v.dtype) for v in pm.state_dict().values()}),
        "optimizer_state_dtypes": sorted(
            {str(t.dtype) for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()}
        ),
    }


def _parallelized(model: torch.nn.Module, plan: Plan) -> Any:
    ids, labels = _batch()
    return autoplan.parallelize(model, plan.cluster, example_inputs=(ids,), loss_fn=zoo.lm_loss,
                                example_targets=(labels,), plan=plan)  # fmt: skip


def _checkpoint_round_trip(pm: Any, opt: torch.optim.Optimizer, plan: Plan, root: str) -> bool:
    """Save, overwrite the parameters, load: the fp32 masters come back bit for bit."""
    saved = {n: t.clone() for n, t in pm.full_parameters().items()}
    checkpoint.save(root, STEPS, pm, opt, plan=plan)
    pm.load_state_dict({n: torch.zeros_like(t) for n, t in saved.items()})
    ckpt = checkpoint.find_latest(root)
    assert ckpt is not None
    checkpoint.load(ckpt, pm, opt)
    return all(torch.equal(saved[n], t) for n, t in pm.full_parameters().items())


def _mixed_rank(rank: int, world_size: int, plan: Plan, root: str) -> dict[str, Any]:  # noqa: ARG001
    pm = _parallelized(zoo.llama_tiny(), plan)
    opt = pm.make_optimizer(lr=LR, weight_decay=WD)
    result = _train(pm, opt)
    result["checkpoint_round_trip"] = _checkpoint_round_trip(pm, opt, plan, root)
    # the model given in bf16: the same bf16 program, its own bf16 parameters and gradients
    pure = _parallelized(zoo.llama_tiny().to(torch.bfloat16), plan)
    ids, labels = _batch()
    pure_loss = pure.forward_backward(ids, targets=(labels,))
    pure_grads = {n: p.grad.full_tensor() for n, p in pure.owned_parameters().items()}
    result["pure_bf16"] = {
        "param_dtypes": sorted({str(p.dtype) for p in pure.parameters()}),
        "grad_dtypes": sorted({str(g.dtype) for g in pure_grads.values()}),
        "same_loss": float(pure_loss) == result["losses"][0],
        "same_grads": all(torch.equal(g, result["grads"][n].to(torch.bfloat16)) for n, g in pure_grads.items()),
    }
    return result


def _flat(tensors: dict[str, torch.Tensor], names: Any) -> torch.Tensor:
    return torch.cat([tensors[n].flatten() for n in sorted(names)])


def check_against_reference(results: list[dict[str, Any]]) -> None:
    """The module docstring's comparison, on every rank."""
    bf16, fp32 = reference(torch.bfloat16), reference(torch.float32)
    for r in results:
        assert r["param_dtypes"] == r["grad_dtypes"] == r["state_dtypes"] == ["torch.float32"], r
        assert r["optimizer_state_dtypes"] == ["torch.float32"], r
        errors = {n: rel_err(g, bf16["grads"][n]) for n, g in r["grads"].items()}
        assert max(errors.values()) <= BF16_SPACING, errors
        mine = r["grads"].keys()  # a pipeline rank's stages only
        g = _flat(r["grads"], mine)
        assert rel_err(g, _flat(bf16["grads"], mine)) < rel_err(g, _flat(fp32["grads"], mine))
        torch.testing.assert_close(r["losses"][0], bf16["losses"][0], rtol=BF16_SPACING, atol=0)
        torch.testing.assert_close(r["losses"], bf16["losses"], rtol=2 * BF16_SPACING, atol=0)
        torch.testing.assert_close(r["norms"], bf16["norms"], rtol=BF16_SPACING / 4, atol=0)
        assert r["losses"][-1] < r["losses"][0] - 4 * BF16_SPACING * r["losses"][0], r["losses"]  # it trains
        errors = {n: rel_err(p, bf16["params"][n]) for n, p in r["params"].items()}
        fp32_gap = max(rel_err(fp32["params"][n], bf16["params"][n]) for n in errors)
        assert max(errors.values()) <= PARAM_TOL < fp32_gap, (errors, fp32_gap)


@pytest.mark.slow
def test_bf16_plan_trains_an_fp32_model_with_fp32_master_weights_like_the_mixed_precision_reference(
    zero3_plan: Plan, tmp_path: Path
) -> None:
    results = run_ranks(_mixed_rank, 2, zero3_plan, str(tmp_path / "ckpt"))
    check_against_reference(results)
    for r in results:
        assert r["checkpoint_round_trip"]
        assert r["pure_bf16"] == {
            "param_dtypes": ["torch.bfloat16"],
            "grad_dtypes": ["torch.bfloat16"],
            "same_loss": True,
            "same_grads": True,
        }, r["pure_bf16"]
    saved = checkpoint.read_full_parameters(tmp_path / "ckpt" / f"step_{STEPS}")
    assert {t.dtype for t in saved.values()} == {torch.float32}


# --- slow: gradient accumulation over micro-batches, and Megatron-sharded weights --------------------

TP_PINS = {"input_0": "R", "target_0": "R"} | zoo.LLAMA_TP_PINS


def _sharded_weights_plan() -> str:
    """The bf16 step on 2 devices with the weights pinned to Megatron's column/row split (the
    joint search takes no pins), as JSON. The ILP then gathers the weights and splits the batch
    (51 all-gathers, the weight gradients reduce-scattered), so the masters are sharded on both
    dims and the embedding by rows, while the arithmetic is the data-parallel one."""
    ids, labels = _batch()
    step_model, inputs, targets = prepare_for_precision(zoo.llama_tiny(), (ids,), (labels,), "bf16")
    traced = trace_training_step(step_model, inputs, loss_fn=zoo.lm_loss, example_targets=targets)
    with planning_mesh(CLUSTER) as mesh:
        plan = plan_traced(traced, CLUSTER, mesh=mesh, pins=TP_PINS, optimizer="adamw")
    return json.dumps(plan.to_dict())


def _one_stage_pipeline(model: torch.nn.Module, plan_json: str) -> Any:
    """``model`` (fp32) as a one-stage pipeline running the bf16 step (the pieces ``parallelize``
    assembles for a global-batch plan, called directly: the program's dtypes alone switch the
    stages to mixed precision)."""
    ids, labels = _batch()
    step_model, inputs, targets = prepare_for_precision(model, (ids,), (labels,), "bf16")
    traced = trace_training_step(step_model, inputs, loss_fn=zoo.lm_loss, example_targets=targets)
    plan = Plan.from_dict(json.loads(plan_json))
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "tp"))
    return build_pipeline(
        model, traced, plan.assignment(), find_layers(traced), stage_starts=[0], mesh=mesh, axis_names=("tp",),
        schedule="gpipe", num_microbatches=1, fallback_nodes=frozenset(plan.fallback_ops), device=torch.device("cpu"),
        optimizer="adamw",
    )  # fmt: skip


def _slow_rank(
    rank: int,  # noqa: ARG001
    world_size: int,  # noqa: ARG001
    microbatch_plan: Plan,
    pipeline_plan: Plan,
    sharded_plan_json: str,
) -> dict[str, Any]:
    out = {}
    for name, pm in (
        ("microbatches", _parallelized(zoo.llama_tiny(), microbatch_plan)),
        ("pipeline", _parallelized(zoo.llama_tiny(), pipeline_plan)),
        ("sharded_weights", _one_stage_pipeline(zoo.llama_tiny(), sharded_plan_json)),
    ):
        out[name] = _train(pm, torch.optim.AdamW(pm.parameters(), lr=LR, weight_decay=WD))
    return out


@pytest.mark.slow
def test_bf16_microbatches_pipeline_and_sharded_weights_train_like_the_mixed_precision_reference() -> None:
    """dp=2 with 2 micro-batches of 2 (bf16 gradients summed over them, all-reduced in bf16, the
    average taken in fp32); a 2-stage 1F1B pipeline (bf16 activations between the stages, the
    loss broadcast as fp32); the weights pinned to Megatron's split (fp32 masters sharded by rows
    and columns, their bf16 copies cast shard by shard). Each with ``torch.optim.AdamW`` over
    ``pmodel.parameters()``."""
    microbatch_plan = _bf16_plan(dp=2, tp=1, microbatch_size=2, num_microbatches=2, zero_stage=0)
    pipeline_plan = _bf16_plan(dp=1, tp=1, pp=2, microbatch_size=4, num_microbatches=2, schedule="1f1b")
    results = run_ranks(_slow_rank, 2, microbatch_plan, pipeline_plan, _sharded_weights_plan())
    for case in ("microbatches", "pipeline", "sharded_weights"):
        check_against_reference([r[case] for r in results])


# --- what is refused, and the copy the step is traced from -------------------------------------------


def _llama(dtype: torch.dtype) -> torch.nn.Module:
    return zoo.llama_tiny().to(dtype)


@pytest.mark.parametrize(
    ("dtype", "precision", "offload", "message"),
    [
        (torch.float16, "bf16", False, "is torch.float16 but the plan computes in bf16: give the model in float32 "
         r"\(model.float\(\): fp32 master weights, bf16 compute\) or in bfloat16, or re-plan with precision='fp16'"),
        (torch.float32, "fp16", False, "is torch.float32 but the plan computes in fp16: fp16 with fp32 master weights "
         "needs loss scaling, which autoplan does not run: re-plan with precision='bf16'"),
        (torch.bfloat16, "fp32", False, r"is torch.bfloat16 but the plan computes in fp32: convert the model with "
         r"model.float\(\), or re-plan with precision='bf16'"),
        (torch.float32, "bf16", True, r"is torch.float32 but the plan offloads the optimizer with bf16 weights on the device and their fp32 master "
         r"copies in host memory: convert the model with model.to\(torch.bfloat16\)"),
    ],
    ids=["fp16_model_bf16_plan", "fp32_model_fp16_plan", "bf16_model_fp32_plan", "fp32_model_offloaded_bf16_plan"],
)  # fmt: skip
def test_a_model_whose_dtype_cannot_run_the_plans_precision_is_refused_naming_the_fix(
    dtype: torch.dtype, precision: str, offload: bool, message: str
) -> None:
    with pytest.raises(autoplan.PlanMismatchError, match=r"parameter 'model.embed_tokens.weight' " + message):
        check_model_precision(_llama(dtype), precision, offload_optimizer=offload)


def test_a_plan_priced_without_master_weights_refuses_an_fp32_model_and_runs_a_bf16_one() -> None:
    """A bf16 plan made for the model in bf16 prices no fp32 masters (``pipeline.master_weights``
    false in the plan file): an fp32 model would hold them, so it is refused naming both fixes."""
    ids, labels = _batch()
    plan = autoplan.plan(zoo.llama_tiny().to(torch.bfloat16), CLUSTER, example_inputs=(ids,), loss_fn=zoo.lm_loss,
                         example_targets=(labels,), config=autoplan.ParallelConfig(dp=2, pp=1, microbatch_size=4, num_microbatches=1), global_batch_size=ids.shape[0],
                         precision="bf16", optimizer="adamw", profile=None)  # fmt: skip
    assert plan.pipeline is not None and plan.pipeline.master_weights is False
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))).pipeline.master_weights is False
    layout = plan.pipeline
    check_model_precision(_llama(torch.bfloat16), "bf16", offload_optimizer=False, master_weights=layout.master_weights)
    with pytest.raises(autoplan.PlanMismatchError, match=r"made for the model in bf16, priced without fp32 master "
                       r"weights: convert the model with model.to\(torch.bfloat16\), or re-plan with the model in "
                       r"torch.float32"):  # fmt: skip
        check_model_precision(_llama(torch.float32), "bf16", offload_optimizer=False, master_weights=False)
    assert _bf16_plan(dp=2, microbatch_size=4, num_microbatches=1).pipeline.master_weights is True  # the fp32 model's


def test_fp32_bf16_or_mixed_parameters_run_a_bf16_plan() -> None:
    frozen_base = _llama(torch.float32)
    for name, p in frozen_base.named_parameters():
        if "mlp" not in name:  # a bf16 frozen base under fp32 trained weights
            p.requires_grad_(False)
            p.data = p.data.to(torch.bfloat16)
    for model, offload in ((_llama(torch.float32), False), (_llama(torch.bfloat16), True), (frozen_base, False)):
        check_model_precision(model, "bf16", offload_optimizer=offload)


@pytest.mark.slow
def test_parallelize_refuses_an_fp16_model_for_a_bf16_plan_before_tracing(zero3_plan: Plan) -> None:
    with fake_job(2), pytest.raises(autoplan.PlanMismatchError, match="is torch.float16 but the plan computes in bf16"):
        _parallelized(_llama(torch.float16), zero3_plan)


def test_a_precision_without_a_global_batch_is_a_config_error_not_ignored() -> None:
    ids, labels = _batch()
    with pytest.raises(
        autoplan.ConfigError, match=r"precision='bf16' needs global_batch_size= \(--global-batch-size\)"
    ):
        autoplan.plan(zoo.llama_tiny(), CLUSTER, example_inputs=(ids,), loss_fn=zoo.lm_loss,
                      example_targets=(labels,), precision="bf16")  # fmt: skip


def test_the_bf16_step_is_traced_from_the_copy_deepcopy_and_to_make() -> None:
    """``prepare_for_precision`` makes the parameters in bf16 directly (no fp32 duplicate of the
    model), and the copy is the one ``copy.deepcopy(model).to(torch.bfloat16)`` makes: values,
    ``requires_grad``, buffers and the tied embedding alike; the user's model is untouched."""
    model = zoo.gpt2_tiny()  # lm_head.weight is transformer.wte.weight
    model.transformer.h[0].ln_1.weight.requires_grad_(False)
    ids, labels = _batch()
    copied, inputs, targets = prepare_for_precision(model, (ids, torch.ones(2)), (labels,), "bf16")
    expected = copy.deepcopy(model).to(torch.bfloat16)
    assert copied.lm_head.weight is copied.transformer.wte.weight
    for (name, p), (_, q) in zip(copied.named_parameters(), expected.named_parameters(), strict=True):
        assert isinstance(p, torch.nn.Parameter) and p.dtype == torch.bfloat16 and p.requires_grad == q.requires_grad
        assert torch.equal(p, q), name
    for (name, b), (_, c) in zip(copied.named_buffers(), expected.named_buffers(), strict=True):
        assert b.dtype == c.dtype and torch.equal(b, c), name
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert [t.dtype for t in (*inputs, *targets)] == [torch.int64, torch.bfloat16, torch.int64]
