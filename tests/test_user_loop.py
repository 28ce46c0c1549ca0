"""The user's own training loop over a parallelized model (issue #21 item 3,
``autoplan/runtime/training.py``): ``loss = pmodel(...)``, ``loss.backward()``, any torch.optim
optimizer with its LR scheduler, ``clip_grad_norm_`` by the global norm across shards, and state
dicts under the model's own parameter names; equal to the same loop on one device."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

import autoplan
from autoplan.errors import NotPlannedError
from autoplan.runtime import training
from autoplan.runtime.data import LocalBatch
from tests import zoo
from tests.harness import RankPool, cpu_cluster, mismatches, run_ranks
from tests.test_bad_inputs import fake_job

STEPS, LR, MAX_NORM = 4, 3e-3, 0.05


def _dataset() -> torch.utils.data.TensorDataset:
    """The loop's batches as one dataset: step k's batch is rows [8k, 8k + 8)."""
    pairs = [zoo.token_batch(seed=step + 1) for step in range(STEPS)]
    return torch.utils.data.TensorDataset(torch.cat([i for i, _ in pairs]), torch.cat([t for _, t in pairs]))


def _standard_loop(
    model: torch.nn.Module, params: list[torch.nn.Parameter], clip: Any, *, loader: Any = None
) -> tuple[list[float], list[float]]:
    """The loop a user writes: AdamW, cosine LR, clipping, ``loss.backward()``; ``clip(params)``
    clips by the global norm and returns it; ``loader``: the parallel model's sharded loader
    (each rank loads only its rows). Returns the losses and the norms."""
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    losses, norms = [], []
    local_batches = iter(loader) if loader is not None else None
    for step in range(STEPS):
        ids, labels = zoo.token_batch(seed=step + 1)
        if local_batches is not None:
            loss = model(next(local_batches))
        elif isinstance(model, autoplan.ParallelModel | autoplan.PipelineModel):
            loss = model(ids, targets=(labels,))
        else:
            loss = zoo.lm_loss(model(ids), labels)
        loss.backward()
        norms.append(float(clip(params)))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, norms


def _pipeline_plan(config: autoplan.ParallelConfig) -> autoplan.Plan:
    """Planned outside the job, as ``autoplan plan`` does (in the job: ``parallelize(global_batch_size=)``)."""
    ids, labels = zoo.token_batch(seed=1)
    return autoplan.plan(zoo.gpt2_tiny(), cpu_cluster("2xCPU", compute_slowdown=1e5), example_inputs=(ids,),
                             loss_fn=zoo.lm_loss, example_targets=(labels,), config=config, global_batch_size=ids.shape[0])  # fmt: skip


def _rank(
    rank: int,
    world_size: int,
    pins: dict[str, str],
    plan: autoplan.Plan | None,
    use_loader: bool = False,  # noqa: ARG001
) -> dict[str, Any]:
    model = zoo.gpt2_tiny()
    reference = copy.deepcopy(model)
    ids, labels = zoo.token_batch(seed=1)
    pm = autoplan.parallelize(model, cpu_cluster("2xCPU", compute_slowdown=1e5), example_inputs=(ids,),
                              loss_fn=zoo.lm_loss, example_targets=(labels,), pins=pins, plan=plan, profile=None)  # fmt: skip
    params = [p for p in pm.parameters() if p.requires_grad]
    loader = pm.data_loader(_dataset()) if use_loader else None
    losses, norms = _standard_loop(pm, params, lambda ps: pm.clip_grad_norm_(MAX_NORM), loader=loader)
    ref_losses, ref_norms = _standard_loop(reference, list(reference.parameters()),
                                lambda ps: torch.nn.utils.clip_grad_norm_(ps, MAX_NORM))  # fmt: skip
    sd = pm.state_dict()
    full = {k: v.full_tensor().clone() for k, v in sd.items()}  # a copy: full_tensor() of an unsharded one is a view
    # a full (single-device) state dict loads back into the shards
    pm.load_state_dict({k: torch.zeros_like(v) for k, v in full.items()}, strict=False)
    zeroed = all(float(v.full_tensor().abs().sum()) == 0 for v in pm.state_dict().values())
    pm.load_state_dict(full, strict=False)
    return {
        "rank": rank,
        "losses": losses,
        "ref_losses": ref_losses,
        "norms": norms,
        "ref_norms": ref_norms,
        "params": {n: p.detach() for n, p in pm.full_parameters().items()},
        "ref_params": {n: p.detach() for n, p in reference.named_parameters()},
        "state_dict_keys": sorted(sd),
        "zeroed_by_load": zeroed,
        "reloaded_equal": all(torch.equal(full[k], v.full_tensor()) for k, v in pm.state_dict().items()),
    }


ADAM_REL_TOL = 3e-5
"""AdamW normalises each element's step to about ``LR``, so fp32 rounding in a gradient computed
in another order (a tensor-parallel shard's sum) reaches the parameters unscaled: on the small
parameters (biases, norm 0.04 after 4 steps) that is 1e-5 of their norm (measured: c_attn.bias
1.18e-5, 2e-7 absolute, on an AMD EPYC 2-core VM; below 1e-5 on the previous one), with losses
equal to every printed digit."""


def _check(results: list[dict[str, Any]], model_keys: set[str]) -> None:
    assert not mismatches(results, rel_tol=ADAM_REL_TOL), mismatches(results, rel_tol=ADAM_REL_TOL)
    for r in results:  # the clipping was active (norm above the threshold) and saw every shard
        torch.testing.assert_close(r["norms"], r["ref_norms"], rtol=1e-5, atol=0)
        assert min(r["ref_norms"]) > MAX_NORM, r["ref_norms"]
    held = set().union(*(r["state_dict_keys"] for r in results))
    assert held == model_keys, held ^ model_keys
    assert all(r["zeroed_by_load"] and r["reloaded_equal"] for r in results)


@pytest.mark.slow
def test_standard_loop_with_adamw_cosine_lr_and_clipping_under_tensor_parallelism_trains_like_single_device() -> None:
    pins = {"input_0": "R", "target_0": "R"} | zoo.GPT2_TP_PINS
    results = run_ranks(_rank, 2, pins, None)
    _check(results, {n for n, _ in zoo.gpt2_tiny().named_parameters()})


@pytest.mark.slow
def test_standard_loop_on_a_two_stage_pipeline_trains_like_single_device() -> None:
    """Clipping sums the squared norms over both stages; the tied embedding counts once. Batches
    come from the sharded loader (``pmodel(batch)``; the first stage loads the inputs, the last the targets)."""
    config = autoplan.ParallelConfig(dp=1, tp=1, pp=2, microbatch_size=4, num_microbatches=2)
    results = run_ranks(_rank, 2, {}, _pipeline_plan(config), True)
    _check(results, {n for n, _ in zoo.gpt2_tiny().named_parameters()})


def test_loss_backward_scales_and_accumulates_like_autograd() -> None:
    """Two calls then one backward of their weighted sum: the gradients add up, scaled."""
    results = run_ranks(_accumulate_rank, 2)
    for r in results:
        assert r["max_rel_err"] < 1e-5, r
        assert not r["no_grad_loss_requires_grad"]


def _accumulate_rank(rank: int, world_size: int) -> dict[str, Any]:  # noqa: ARG001
    model = zoo.gpt2_tiny()
    reference = copy.deepcopy(model)
    (a, la), (b, lb) = zoo.token_batch(seed=1), zoo.token_batch(seed=2)
    pm = autoplan.parallelize(model, cpu_cluster("2xCPU", compute_slowdown=1e5), example_inputs=(a,),
                              loss_fn=zoo.lm_loss, example_targets=(la,), pins={"input_0": "S(0)", "target_0": "S(0)"}, profile=None)  # fmt: skip
    (0.25 * pm(a, targets=(la,)) + 2.0 * pm(b, targets=(lb,))).backward()
    (0.25 * zoo.lm_loss(reference(a), la) + 2.0 * zoo.lm_loss(reference(b), lb)).backward()
    ref = dict(reference.named_parameters())
    err = 0.0
    for n, p in pm.named_sharded_parameters():
        g = p.grad.full_tensor()
        err = max(err, float((g - ref[n].grad).abs().max() / ref[n].grad.abs().max().clamp_min(1e-12)))
    with torch.no_grad():
        loss = pm(a, targets=(la,))
    dist.barrier()
    return {"max_rel_err": err, "no_grad_loss_requires_grad": loss.requires_grad}


# --- deferred planning: parallelize without example_inputs plans at the first call ---------------

DP_PINS = {"input_0": "S(0)", "target_0": "S(0)"}


def _adamw_loop(call: Any, params: Any, first_loss: torch.Tensor | None = None) -> list[float]:
    """AdamW over ``params`` for STEPS steps; ``first_loss``: step 0's loss, computed already."""
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        ids, labels = zoo.token_batch(seed=step + 1)
        loss = first_loss if step == 0 and first_loss is not None else call(ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _first_call_then_adamw(pm: Any, reference: torch.nn.Module) -> dict[str, Any]:
    """A deferred model's first call (it plans on that batch, then runs the step), then AdamW over
    its parameters, and the same loop on ``reference``: losses and full parameters of both."""
    ids, labels = zoo.token_batch(seed=1)
    first = pm(ids, targets=(labels,))
    params = [p for p in pm.parameters() if p.requires_grad]
    return {
        "losses": _adamw_loop(lambda i, t: pm(i, targets=(t,)), params, first),
        "ref_losses": _adamw_loop(lambda i, t: zoo.lm_loss(reference(i), t), reference.parameters()),
        "params": {n: p.detach() for n, p in pm.full_parameters().items()},
        "ref_params": {n: p.detach() for n, p in reference.named_parameters()},
    }


def _deferred_rank(rank: int, world_size: int) -> dict[str, Any]:  # noqa: ARG001
    model = zoo.llama_tiny()  # no attention key bias: Adam would amplify its rounding-noise gradient (test_equivalence)
    reference = copy.deepcopy(model)
    pm = autoplan.parallelize(model, cpu_cluster("2xCPU", compute_slowdown=1e5), loss_fn=zoo.lm_loss, pins=DP_PINS,
                              profile=None)  # fmt: skip
    return _first_call_then_adamw(pm, reference) | {
        "same_parameter_objects": all(a is b for a, b in zip(pm.parameters(), pm.built.parameters(), strict=True)),
        "state_dict_keys": sorted(pm.state_dict()),
        "input_spec": pm.plan.input_specs[0],
    }


@pytest.mark.slow
def test_deferred_parallelize_plans_at_the_first_call_and_trains_like_single_device() -> None:
    """No example_inputs: the first ``pmodel(ids, targets=...)`` plans on its batch and runs the
    step; AdamW built afterwards over ``pmodel.parameters()`` steps that first loss's gradients."""
    results = run_ranks(_deferred_rank, 2)
    assert not mismatches(results), mismatches(results)
    keys = {n for n, _ in zoo.llama_tiny().named_parameters()}
    for r in results:
        assert r["same_parameter_objects"]
        assert set(r["state_dict_keys"]) == keys
        assert r["input_spec"] == ("S(0)",)  # the pinned data-parallel batch


@pytest.mark.parametrize(
    "use",
    [
        lambda pm: pm.parameters(),
        lambda pm: pm.state_dict(),
        lambda pm: pm.data_loader(_dataset()),
        lambda pm: pm.clip_grad_norm_(1.0),
        lambda pm: pm.plan,
    ],
    ids=["parameters", "state_dict", "data_loader", "clip_grad_norm_", "plan"],
)
def test_deferred_model_before_its_first_call_names_the_order(use: Any) -> None:
    with fake_job(2):
        pm = autoplan.parallelize(zoo.gpt2_tiny(), cpu_cluster("2xCPU"), loss_fn=zoo.lm_loss)
        with pytest.raises(autoplan.PlanError, match=r"call pmodel\(inputs, targets=...\) once before building the "
                           r"optimizer, or pass example_inputs= to parallelize"):  # fmt: skip
            use(pm)
        assert not hasattr(pm, "__deepcopy__")  # protocols stay AttributeErrors


def test_deferred_model_before_its_first_call_answers_hasattr_and_getattr_defaults() -> None:
    """Wrappers (``torch.compile``, Lightning, Accelerate) probe attributes with ``hasattr``: before
    the first call an attribute of the built model is absent, not an exception; using it still
    raises the PlanError naming the order, also an AttributeError (NotPlannedError)."""
    with fake_job(2):
        pm = autoplan.parallelize(zoo.gpt2_tiny(), cpu_cluster("2xCPU"), loss_fn=zoo.lm_loss)
        assert not hasattr(pm, "parameters") and not hasattr(pm, "no_such_attribute")
        assert getattr(pm, "plan", None) is None
        with pytest.raises(NotPlannedError, match=r"pmodel.state_dict: the model is not planned yet"):
            pm.state_dict  # noqa: B018 - the attribute access raises
        with pytest.raises(autoplan.PlanError, match="the model is not planned yet"):
            pm.built  # noqa: B018 - the property raises a PlanError (not an AttributeError: no hasattr loop)
        assert isinstance(NotPlannedError("x"), AttributeError)


def test_torch_compile_of_a_parallel_model_runs_its_program_eagerly_and_says_so() -> None:
    """``torch.compile(pmodel)`` (Inductor) gives the eager program's loss and gradients, with
    one warning saying the program runs eagerly (TorchDynamo skips the planned program, whose
    collectives are issued where the plan priced them); before, TorchDynamo failed inside it."""
    training._compiled_call_noted = False
    with fake_job(2):
        ids, labels = zoo.token_batch(seed=1)
        pm = autoplan.parallelize(zoo.gpt2_tiny(), cpu_cluster("2xCPU", compute_slowdown=1e5), example_inputs=(ids,),
                                  loss_fn=zoo.lm_loss, example_targets=(labels,), profile=None)  # fmt: skip
        torch._dynamo.reset()
        with pytest.warns(UserWarning, match="runs its per-rank program eagerly"):
            compiled = torch.compile(pm, backend="inductor")(ids, targets=(labels,))
        compiled.backward()
        grads = [p.grad.full_tensor().clone() for p in pm.parameters() if p.requires_grad]
        pm.zero_grad()
        eager = pm(ids, targets=(labels,))
        eager.backward()
        assert float(compiled.detach()) == float(eager.detach())
        for g, p in zip(grads, [p for p in pm.parameters() if p.requires_grad], strict=True):
            assert torch.equal(g, p.grad.full_tensor())


def test_deferred_model_refuses_a_local_batch_before_it_is_planned() -> None:
    with fake_job(2):
        pm = autoplan.parallelize(zoo.gpt2_tiny(), cpu_cluster("2xCPU"), loss_fn=zoo.lm_loss)
        ids, labels = zoo.token_batch(seed=1)
        batch = LocalBatch(inputs=(ids,), targets=(labels,), global_batch_size=8, step=0, sample_indices=((), ()))
        with pytest.raises(autoplan.PlanError, match="a LocalBatch needs a plan"):
            pm(batch)
        with pytest.raises(autoplan.PlanError, match="example_targets without example_inputs"):
            autoplan.parallelize(zoo.gpt2_tiny(), cpu_cluster("2xCPU"), example_targets=(labels,))


# --- deferred planning of a pipeline: parallelize(global_batch_size=...) runs the joint search in the job ---

PIPELINE_CONFIG = autoplan.ParallelConfig(pp=2, microbatch_size=2, num_microbatches=4, schedule="1f1b")
DATA_PARALLEL_CONFIG = autoplan.ParallelConfig(dp=2, microbatch_size=2, num_microbatches=2)


def _joint_plan(config: autoplan.ParallelConfig) -> dict[str, Any]:
    """The plan ``autoplan.plan`` makes outside any job for the deferred model's first batch."""
    ids, labels = zoo.token_batch(seed=1)
    return autoplan.plan(zoo.llama_tiny(), cpu_cluster("2xCPU"), example_inputs=(ids,), loss_fn=zoo.lm_loss,
                         example_targets=(labels,), global_batch_size=8, config=config, profile=None).to_dict()  # fmt: skip


def _deferred_pipeline_rank(rank: int, world_size: int) -> dict[str, Any]:  # noqa: ARG001
    """pp=2 planned by rank 0 inside the job at the first call, then AdamW like single device."""
    model = zoo.llama_tiny()
    reference = copy.deepcopy(model)
    pm = autoplan.parallelize(model, cpu_cluster("2xCPU"), loss_fn=zoo.lm_loss, global_batch_size=8,
                              config=PIPELINE_CONFIG, profile=None)  # fmt: skip
    before = (isinstance(pm, autoplan.PipelineModel), isinstance(pm, torch.nn.Module))
    return _first_call_then_adamw(pm, reference) | {
        "isinstance_before": before,
        "isinstance_after": (
            isinstance(pm, autoplan.PipelineModel), isinstance(pm, torch.nn.Module),
            isinstance(pm, autoplan.DeferredModel), isinstance(pm, autoplan.ParallelModel),
        ),  # fmt: skip
        "built_type": type(pm.built).__name__,
        "type": type(pm).__name__,
        "plan": pm.plan.to_dict(),
    }


def _eager_data_parallel_rank(rank: int, world_size: int) -> dict[str, Any]:  # noqa: ARG001
    """dp=2 planned by rank 0 inside the job (the stage mesh is the job's size): the plan only."""
    ids, labels = zoo.token_batch(seed=1)
    pm = autoplan.parallelize(zoo.llama_tiny(), cpu_cluster("2xCPU"), example_inputs=(ids,), loss_fn=zoo.lm_loss,
                              example_targets=(labels,), global_batch_size=8, config=DATA_PARALLEL_CONFIG, profile=None)  # fmt: skip
    return {"plan": pm.plan.to_dict(), "type": type(pm).__name__}


def _without_timing(plan: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in plan.items() if k != "solver"}


@pytest.mark.slow
def test_deferred_pipeline_plans_in_the_job_at_the_first_call_and_trains_like_single_device() -> None:
    """``parallelize(loss_fn=..., global_batch_size=8, config=pp=2)`` without example inputs: the
    first call's batch is planned by rank 0 with the joint search (its stage meshes need no
    process group: ``planning_alone``), every rank builds the same pipeline, and AdamW over
    ``pmodel.parameters()`` trains like one device. After that call ``isinstance`` answers as for
    the PipelineModel it became; before it, only as a DeferredModel. The plan equals the one
    ``autoplan.plan`` makes outside the job, for the pipeline and for a dp=2 configuration whose
    stage mesh is the whole job."""
    with RankPool(2, timeout_s=900) as pool:
        results = pool.run(_deferred_pipeline_rank)
        eager = pool.run(_eager_data_parallel_rank)
    assert not mismatches(results), mismatches(results)
    for r in results:
        assert r["isinstance_before"] == (False, False)
        assert r["isinstance_after"] == (True, True, True, False)
        assert (r["built_type"], r["type"]) == ("PipelineModel", "DeferredModel")
        assert _without_timing(r["plan"]) == _without_timing(_joint_plan(PIPELINE_CONFIG))
    assert [r["type"] for r in eager] == ["PipelineModel"] * 2
    assert all(_without_timing(r["plan"]) == _without_timing(_joint_plan(DATA_PARALLEL_CONFIG)) for r in eager)


def test_deferred_global_batch_planning_names_what_does_not_go_with_it() -> None:
    ids, labels = zoo.token_batch(seed=1)  # 8 samples
    with fake_job(2):
        pm = autoplan.parallelize(zoo.gpt2_tiny(), cpu_cluster("2xCPU"), loss_fn=zoo.lm_loss, global_batch_size=4)
        with pytest.raises(autoplan.PlanMismatchError, match="global_batch_size=4 but the batch has 8 samples"):
            pm(ids, targets=(labels,))  # before any planning
        with pytest.raises(autoplan.PlanError, match="pins= fix placements of the per-operator plan"):
            autoplan.parallelize(zoo.gpt2_tiny(), cpu_cluster("2xCPU"), global_batch_size=8, pins=DP_PINS)
        with pytest.raises(autoplan.ConfigError, match="config= needs global_batch_size="):
            autoplan.parallelize(zoo.gpt2_tiny(), cpu_cluster("2xCPU"), config=PIPELINE_CONFIG)
        with pytest.raises(autoplan.ConfigError, match="global_batch_size must be a positive integer"):
            autoplan.parallelize(zoo.gpt2_tiny(), cpu_cluster("2xCPU"), global_batch_size=0)
