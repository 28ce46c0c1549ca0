"""Pipeline-parallel plans train like the single-device model (autoplan.runtime.pipeline, autoplan.passes.stages).

Multi-process cases: 4 gloo CPU ranks as a (pp=2) x (stage mesh of 2) mesh, a 4-layer GPT-2 or
Llama, 3 SGD-with-momentum steps (not Adam: the attention key bias has an analytically zero
gradient, and Adam turns its summation-order noise into lr-sized updates; see
tests/test_equivalence.py) on a global batch of 8 split into 4 micro-batches. The per-op sharding is
planned for one micro-batch on the stage mesh with pins forcing data parallelism ("dp") or
Megatron tensor parallelism ("tp"). Required on every rank: the loss at every step and every
parameter after the last step equal the single-device fp32 run
(elementwise, ``tests.harness.assert_trains_like_reference(rel_tol=1e-5, atol=1e-6)``).

Single-process cases check the stage split itself: every op in exactly one stage program,
boundary values, pass-through of values that skip stages, tied-parameter copies.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from autoplan.cost_models.cluster import Cluster
from autoplan.passes.layers import find_layers
from autoplan.passes.stages import split_stages
from autoplan.passes.trace import TracedProgram, trace_training_step
from autoplan.planner.ilp import plan_traced
from autoplan.planner.mesh import planning_mesh
from autoplan.runtime.codegen import generate_program
from tests import zoo
from tests.harness import (
    NUM_STEPS,
    SeededBatches,
    assert_trains_like_reference,
    cpu_cluster,
    run_ranks,
    train_both,
)
from tests.test_fused_projections import PHI3_TP_PINS, phi3_tiny

GLOBAL_BATCH = 8
NUM_MICROBATCHES = 4
NUM_LAYERS = 4

GPT2_TP_PINS = {"input_0": "R", "target_0": "R"} | zoo.GPT2_TP_PINS
LLAMA_TP_PINS = {"input_0": "R", "target_0": "R"} | zoo.LLAMA_TP_PINS
DP_PINS = {"input_0": "S(0)", "target_0": "S(0)", "*": "R"}


def _gpt2_wide(num_layers: int = NUM_LAYERS) -> torch.nn.Module:
    """GPT-2 of width 128 (``zoo.gpt2_lm``, seeded): ~3 MiB of fp32 gradients, several buckets."""
    torch.manual_seed(0)
    return zoo.gpt2_lm(layers=num_layers, hidden=128, heads=4, vocab=zoo.VOCAB, positions=zoo.MAX_POSITIONS).eval()


BUILDERS: dict[str, Callable[..., torch.nn.Module]] = {
    "gpt2": zoo.gpt2_tiny,
    "llama": zoo.llama_tiny,
    "gpt2_wide": _gpt2_wide,
    "phi3": phi3_tiny,  # 4 query heads sharing 2 key/value heads, fused qkv_proj (autoplan.passes.kv_groups)
}
PINS: dict[tuple[str, str], Mapping[str, str]] = {
    ("gpt2", "dp"): DP_PINS,
    ("llama", "dp"): DP_PINS,
    ("gpt2", "tp"): GPT2_TP_PINS,
    ("llama", "tp"): LLAMA_TP_PINS,
    ("phi3", "tp"): {"input_0": "R", "target_0": "R"} | PHI3_TP_PINS,
}


@dataclass(frozen=True, kw_only=True)
class PipeCase:
    model: str
    """``gpt2`` or ``llama``."""
    layout: str
    """``dp`` or ``tp`` on the stage mesh."""
    schedule: str
    virtual_stages: int = 1
    pp: int = 2
    stage_size: int = 2
    recompute: str = "none"
    """Every stage's recomputation (``none``, ``selective``, ``full``)."""


def _stage_starts(num_segments: int, num_stages: int) -> list[int]:
    """Blocks spread evenly; the prologue joins the first stage, the epilogue the last."""
    num_blocks = num_segments - 2
    per = num_blocks // num_stages
    return [0] + [1 + per * k for k in range(1, num_stages)]


_batch = SeededBatches(zoo.token_batch, {"batch": GLOBAL_BATCH})
"""Step ``k``'s global batch (seed ``k + 1``)."""


def train_pipeline_and_reference(rank: int, world_size: int, case: PipeCase, plan_json: str) -> dict[str, object]:
    import json

    from autoplan.planner.plan import Plan
    from autoplan.runtime.pipeline import build_pipeline

    model = BUILDERS[case.model](num_layers=NUM_LAYERS)
    reference = copy.deepcopy(model)
    ids, labels = _batch(0)
    mb = GLOBAL_BATCH // NUM_MICROBATCHES
    traced = trace_training_step(model, (ids[:mb],), loss_fn=zoo.lm_loss, example_targets=(labels[:mb],))
    layering = find_layers(traced)
    mesh = init_device_mesh("cpu", (case.pp, case.stage_size), mesh_dim_names=("pp", "x"))
    plan = Plan.from_dict(json.loads(plan_json))  # one plan for every rank, as `autoplan run` does
    num_stages = case.pp * case.virtual_stages
    pm = build_pipeline(
        model,
        traced,
        plan.assignment(),
        layering,
        stage_starts=_stage_starts(layering.num_segments, num_stages),
        mesh=mesh,
        axis_names=("x",),
        schedule=case.schedule,  # type: ignore[arg-type]
        num_microbatches=NUM_MICROBATCHES,
        virtual_stages=case.virtual_stages,
        fallback_nodes=frozenset(plan.fallback_ops),
        device=torch.device("cpu"),
        optimizer="sgd_momentum",
        stage_recompute=[case.recompute] * num_stages,
    )
    return _train_both(pm, reference)


def _train_both(pm: Any, reference: torch.nn.Module) -> dict[str, object]:
    """NUM_STEPS SGD-with-momentum steps of the pipeline and of the single-device reference."""
    return train_both(
        pm,
        reference,
        batches=lambda step: tuple((t,) for t in _batch(step)),
        loss_fn=zoo.lm_loss,
        opt=pm.make_optimizer(lr=0.1),
        ref_opt=torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9),
        num_steps=NUM_STEPS,
        check=False,
    )


def _plan_json(case: PipeCase) -> str:
    import json

    model = BUILDERS[case.model](num_layers=NUM_LAYERS)
    ids, labels = _batch(0)
    mb = GLOBAL_BATCH // NUM_MICROBATCHES
    traced = trace_training_step(model, (ids[:mb],), loss_fn=zoo.lm_loss, example_targets=(labels[:mb],))
    cluster = cpu_cluster(f"{case.stage_size}xCPU", compute_slowdown=1e5)  # a pinned split is not undone
    with planning_mesh(cluster) as mesh:
        plan = plan_traced(
            traced, cluster, mesh=mesh, pins=dict(PINS[case.model, case.layout]), optimizer="sgd_momentum"
        )
    return json.dumps(plan.to_dict())


def run_pipeline_case(case: PipeCase) -> None:
    results = run_ranks(train_pipeline_and_reference, case.pp * case.stage_size, case, _plan_json(case), timeout_s=600)
    assert_trains_like_reference(results, rel_tol=1e-5, atol=1e-6)


# --- multi-process equivalence -------------------------------------------------------------------


@pytest.mark.slow  # the public-path test below runs gpt2 pp2 x dp2 with 1f1b in CI
def test_gpt2_pp2_x_dp2_1f1b_trains_like_single_device():
    run_pipeline_case(PipeCase(model="gpt2", layout="dp", schedule="1f1b"))


@pytest.mark.slow
def test_llama_pp2_x_tp2_gpipe_trains_like_single_device():
    run_pipeline_case(PipeCase(model="llama", layout="tp", schedule="gpipe"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "layout", "schedule", "virtual_stages"),
    [
        ("gpt2", "dp", "gpipe", 1),
        ("gpt2", "tp", "gpipe", 1),
        ("gpt2", "tp", "1f1b", 1),
        ("llama", "dp", "gpipe", 1),
        ("llama", "dp", "1f1b", 1),
        ("llama", "tp", "1f1b", 1),
        ("gpt2", "dp", "interleaved-1f1b", 2),
        ("llama", "tp", "interleaved-1f1b", 2),
        ("gpt2", "dp", "zero-bubble", 1),
        ("llama", "tp", "zero-bubble", 1),
    ],
)
def test_pipeline_trains_like_single_device(model: str, layout: str, schedule: str, virtual_stages: int) -> None:
    run_pipeline_case(PipeCase(model=model, layout=layout, schedule=schedule, virtual_stages=virtual_stages))


def weighted_lm_loss(out: Any, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Two loss targets: next-token cross entropy (labels ``(B, T)`` int64) weighted per token
    (``(B, T)`` float)."""
    per_token = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), reduction="none")
    return (per_token * weights.flatten()).mean()


def logits_loss(out: Any) -> torch.Tensor:
    """No loss target: the mean squared logit."""
    return out.logits.square().mean()


def _targets_of(num_targets: int, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The loss targets of a batch: none, or the labels and per-token weights ``(labels % 3) / 2``."""
    return () if num_targets == 0 else (labels, (labels % 3).float() / 2)


def _traced_with_targets(model: torch.nn.Module, num_targets: int) -> TracedProgram:
    """One micro-batch's step of ``model`` with the loss of ``num_targets`` targets."""
    ids, labels = _batch(0)
    mb = GLOBAL_BATCH // NUM_MICROBATCHES
    targets = tuple(t[:mb] for t in _targets_of(num_targets, labels))
    return trace_training_step(
        model, (ids[:mb],), loss_fn=weighted_lm_loss if num_targets else logits_loss, example_targets=targets
    )


def _train_with_targets(  # noqa: ARG001
    rank: int, world_size: int, num_targets: int, use_loader: bool, plan_json: str
) -> dict[str, object]:
    """pp=2 GPT-2 (one rank per stage, 1F1B, 4 micro-batches) whose loss reads ``num_targets``
    targets (0 or 2): the last stage feeds them to the loss from the schedule's ``target=``,
    from the global batch or (``use_loader``) from the rows its rank loads."""
    import json

    from torch.utils.data import TensorDataset

    from autoplan.planner.plan import Plan
    from autoplan.runtime.pipeline import build_pipeline

    loss_fn: Callable[..., torch.Tensor] = weighted_lm_loss if num_targets else logits_loss
    model = zoo.gpt2_tiny(num_layers=NUM_LAYERS)
    reference = copy.deepcopy(model)
    traced = _traced_with_targets(model, num_targets)
    layering = find_layers(traced)
    plan = Plan.from_dict(json.loads(plan_json))
    pm = build_pipeline(
        model, traced, plan.assignment(), layering, stage_starts=_stage_starts(layering.num_segments, 2),
        mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "x")), axis_names=("x",), schedule="1f1b",
        num_microbatches=NUM_MICROBATCHES, fallback_nodes=frozenset(plan.fallback_ops), device=torch.device("cpu"),
        optimizer="sgd_momentum",
    )  # fmt: skip

    def batches(step: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        x, y = _batch(step)
        return (x,), _targets_of(num_targets, y)

    local = None
    if use_loader:
        steps = [batches(k) for k in range(NUM_STEPS)]
        fields = [torch.cat([b[0][0] for b in steps])]
        fields += [torch.cat([b[1][i] for b in steps]) for i in range(num_targets)]
        loaded = list(pm.data_loader(TensorDataset(*fields)))
        assert [(len(b.inputs), len(b.targets)) for b in loaded[:1]] == [(1, 0) if rank == 0 else (0, num_targets)]
        local = loaded.__getitem__
    return train_both(
        pm, reference, batches=batches, loss_fn=loss_fn, opt=pm.make_optimizer(lr=0.1),
        ref_opt=torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), check=False, local_batches=local,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("num_targets", "use_loader"),
    # (CI keeps the two-target case; the suite is at its 15-minute budget)
    [pytest.param(0, False, marks=pytest.mark.slow), (2, True)],
)
def test_pipeline_loss_with_no_or_two_targets_trains_like_single_device(num_targets: int, use_loader: bool) -> None:
    """The last stage's loss reads every target from the schedule's ``target=`` (two targets: their
    rows by position; none: one position per micro-batch), global or loaded by the last stage."""
    import json

    traced = _traced_with_targets(zoo.gpt2_tiny(num_layers=NUM_LAYERS), num_targets)
    cluster = Cluster.preset("1xCPU")
    with planning_mesh(cluster) as mesh:
        plan = plan_traced(traced, cluster, mesh=mesh, optimizer="sgd_momentum")
    results = run_ranks(_train_with_targets, 2, num_targets, use_loader, json.dumps(plan.to_dict()), timeout_s=600)
    assert_trains_like_reference(results, rel_tol=1e-5, atol=1e-6)


# --- the stage split (one process) -----------------------------------------------------------------


def _split(  # noqa: ANN202
    model: str, stage_starts: list[int], *, pins: Mapping[str, str] = DP_PINS, in_backward: bool = False
):
    """``model``'s step planned on 2 CPU ranks under ``pins``, generated with raw gradients (or,
    ``in_backward``, converted in each stage's backward, a parameter tied across stages left
    raw, as :func:`autoplan.runtime.pipeline.build_pipeline` generates it) and split."""
    from autoplan.runtime.pipeline import _tied_across_stages

    net = BUILDERS[model](num_layers=NUM_LAYERS)
    ids, labels = zoo.token_batch(batch=2)
    traced = trace_training_step(net, (ids,), loss_fn=zoo.lm_loss, example_targets=(labels,))
    layering = find_layers(traced)
    cluster = Cluster.preset("2xCPU")
    with planning_mesh(cluster) as mesh:
        plan = plan_traced(traced, cluster, mesh=mesh, pins=dict(pins))
        gen = generate_program(
            traced,
            plan.assignment(),
            fallback_nodes=frozenset(plan.fallback_ops),
            axis_names=cluster.mesh_axis_names,
            device=torch.device("cpu"),
            mesh=mesh,
            defer_grad_conversions=not in_backward,
            layering=layering,
            stage_starts=stage_starts,
            deferred_grads=_tied_across_stages(traced, layering, stage_starts),
        )
    split = split_stages(gen.graph_module, traced, layering, plan.assignment(), stage_starts=stage_starts, mesh_ndim=1)
    return traced, gen.graph_module, split, plan


def _ops(gm: torch.fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]


@pytest.mark.parametrize("model", ["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def test_every_op_runs_in_exactly_one_stage_program(model: str) -> None:
    _, gen, split, _ = _split(model, [0, 3])
    seen: dict[str, int] = {}
    for st in split.stages:
        for gm in (st.forward, st.backward):
            for name in _ops(gm):
                if name not in split.stage_of:
                    continue  # a constant (recomputed where read) or a tied-gradient partial sum
                assert name not in seen, f"{name} in stage {seen[name]} and {st.index}"
                assert split.stage_of[name] == st.index
                seen[name] = st.index
    missing = {n for n in _ops(gen) if n in split.stage_of} - set(seen)
    assert not missing, missing


ZERO3_PINS = {"input_0": "S(0)", "target_0": "S(0)", "*": "S(0)"}


def _calls(gm: torch.fx.GraphModule, targets: tuple[Any, ...]) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


def test_each_stage_program_reduces_its_own_gradients() -> None:
    """Data parallelism, gradients converted in the backward, split into two stages: each stage's
    backward program holds gradient buckets (DDP all-reduces) of its own parameters only, together
    every trained parameter but the tied embedding, which both stages return raw (converted after
    the schedule); no forward program holds one (every op's reads are checked by the split)."""
    from autoplan.runtime import collectives

    traced, _, split, _ = _split("gpt2_wide", [0, 3], in_backward=True)
    converted: set[str] = set()
    for st in split.stages:
        assert not _calls(st.forward, (collectives.all_reduce_coalesced,))
        buckets = _calls(st.backward, (collectives.all_reduce_coalesced,))
        assert buckets, st.index
        members = {a.name for b in buckets for a in b.args[0]}
        mine = {fqn for fqn, v in st.param_grads if fqn != "transformer.wte.weight"}
        assert 0 < len(members) <= len(mine), st.index  # (the rest convert alone, e.g. a layer norm's)
        converted |= mine
    assert split.tied_params == {"transformer.wte.weight": (0, 1)}
    assert converted == set(traced.trainable_names) - {"transformer.wte.weight"}


def test_each_stage_program_gathers_its_parameters_one_block_ahead() -> None:
    """Parameters sharded on the data-parallel axis, split into two stages: every stage's forward
    and backward gather their blocks' parameters in coalesced all-gathers (FSDP2's per-block
    gather, prefetched a block ahead within the stage: the split checks that each lands in the
    stage that reads it)."""
    from autoplan.runtime import collectives

    _, _, split, _ = _split("gpt2_wide", [0, 3], pins=ZERO3_PINS, in_backward=True)
    for st in split.stages:
        for gm in (st.forward, st.backward):
            assert _calls(gm, (collectives.all_gather_coalesced,)), st.index


def test_boundary_values_and_gradients_pair_up() -> None:
    _, _, split, _ = _split("gpt2", [0, 3])
    first, second = split.stages
    assert [v.name for v in first.outputs] == [v.name for v in second.inputs]
    assert [v.name for v in first.inputs] == ["input_0"] and first.targets == ()
    assert [v.name for v in second.targets] == ["target_0"]  # the labels enter the last stage only
    # the residual stream crosses with its gradient; values made from the token ids without one
    hidden = [v for v in first.outputs if v.requires_grad]
    assert len(hidden) == 1 and hidden[0].shape == (2, 16, 32)
    grads = [g for g in first.output_grads if g is not None]
    assert len(grads) == 1 and grads[0].shape == hidden[0].shape
    assert [g.name if g else None for g in second.input_grads] == [g.name if g else None for g in first.output_grads]
    assert len(second.outputs) == 1 and second.outputs[0].shape == ()  # the loss


def test_values_that_skip_stages_are_passed_through() -> None:
    _, _, split, _ = _split("llama", [0, 2, 3, 4])
    # rotary cos/sin are made in the prologue and read by every block: each stage passes them on
    rotary = {v.name for v in split.stages[0].outputs if v.shape == (1, 16, 8)}
    assert len(rotary) == 2
    for st in split.stages[1:-1]:
        assert rotary <= {v.name for v in st.inputs} and rotary <= {v.name for v in st.outputs}
    assert rotary <= {v.name for v in split.stages[-1].inputs}
    # the labels enter the last stage, where the loss reads them: no stage sends them on
    assert [v.name for v in split.stages[-1].targets] == ["target_0"]
    assert all(v.name != "target_0" for st in split.stages for v in (*st.inputs, *st.outputs))
    assert all(st.targets == () for st in split.stages[:-1])


def test_tied_embedding_gets_a_copy_and_a_partial_gradient_per_stage() -> None:
    _, _, split, _ = _split("gpt2", [0, 2, 3, 4])
    assert split.tied_params == {"transformer.wte.weight": (0, 3)}
    for s in (0, 3):
        st = split.stages[s]
        assert "transformer.wte.weight" in st.param_names
        assert "transformer.wte.weight" in dict(st.param_grads)
    assert all("transformer.wte.weight" not in st.param_names for st in split.stages[1:3])


# --- the public path: autoplan.plan(global_batch_size=, config=) -> autoplan.parallelize ------------


def _train_public(
    rank: int, world_size: int, model_name: str, config: object, plan_json: str, num_layers: int = NUM_LAYERS
) -> dict[str, object]:
    import autoplan

    plan = autoplan.Plan.from_dict(__import__("json").loads(plan_json))
    model = BUILDERS[model_name](num_layers=num_layers)
    reference = copy.deepcopy(model)
    ids, labels = _batch(0)
    pm = autoplan.parallelize(
        model, plan.cluster, example_inputs=(ids,), loss_fn=zoo.lm_loss, example_targets=(labels,), plan=plan
    )
    return _train_both(pm, reference)


@pytest.mark.parametrize(
    ("model_name", "tp", "dp", "schedule", "zero_stage", "recompute"),
    [
        pytest.param("gpt2", 1, 2, "1f1b", 0, "none", marks=pytest.mark.slow),
        pytest.param("llama", 2, 1, "gpipe", 0, "none", marks=pytest.mark.slow),
        pytest.param("gpt2", 1, 2, "1f1b", 3, "full", marks=pytest.mark.slow),
        pytest.param("gpt2", 2, 2, "1f1b", 0, "none", marks=pytest.mark.slow, id="gpt2-pp2xdp2xtp2-8-ranks"),
    ],
)
def test_planned_pipeline_runs_like_single_device(
    model_name: str, tp: int, dp: int, schedule: str, zero_stage: int, recompute: str
) -> None:
    """autoplan.plan with a global batch and a fixed pp=2 configuration, applied by
    autoplan.parallelize on 4 ranks, trains like the single-device model."""
    import json

    import autoplan
    from autoplan.cost_models.config import ParallelConfig

    cfg = ParallelConfig(dp=dp, tp=tp, pp=2, microbatch_size=GLOBAL_BATCH // (NUM_MICROBATCHES * dp),
                         num_microbatches=NUM_MICROBATCHES, schedule=schedule, zero_stage=zero_stage,
                         recompute=recompute)  # type: ignore[arg-type]  # fmt: skip
    ids, labels = _batch(0)
    world = 2 * dp * tp
    plan = autoplan.plan(
        BUILDERS[model_name](num_layers=NUM_LAYERS), f"1x{world}xCPU", example_inputs=(ids,), loss_fn=zoo.lm_loss,
        example_targets=(labels,), optimizer="sgd_momentum", global_batch_size=GLOBAL_BATCH, config=cfg,
    )  # fmt: skip
    assert plan.config == cfg and plan.pipeline is not None and len(plan.pipeline.stage_starts) == 2
    # planned on 2 traced blocks (autoplan.passes.depth), the later blocks take block 1's placements
    assert plan.pipeline.traced_blocks == 2 and len(plan.pipeline.segment_names) == NUM_LAYERS + 2
    results = run_ranks(_train_public, world, model_name, cfg, json.dumps(plan.to_dict()), timeout_s=900)
    assert_trains_like_reference(results, rel_tol=1e-5, atol=1e-6)


def _own_stage_after_a_step(model_name: str, plan_json: str) -> Any:
    """This rank's only stage of ``plan_json`` (one per pipeline rank) applied to a fresh model,
    after one step (its programs lowered)."""
    import autoplan

    plan = autoplan.Plan.from_dict(__import__("json").loads(plan_json))
    pm = autoplan.parallelize(
        BUILDERS[model_name](num_layers=NUM_LAYERS), plan.cluster, example_inputs=(_batch(0)[0],), loss_fn=zoo.lm_loss,
        example_targets=(_batch(0)[1],), plan=plan,
    )  # fmt: skip
    pm.forward_backward(*_batch(0)[:1], targets=_batch(0)[1:])
    (stage,) = pm._stages
    return stage


def _train_public_bounded(
    rank: int, world_size: int, model_name: str, config: object, plan_json: str
) -> dict[str, object]:
    """:func:`_train_public`, plus where the stage's backward program waits for its reduce-scatters."""
    from autoplan.runtime.lowering import REDUCE_SCATTER, WAIT

    out = _train_public(rank, world_size, model_name, config, plan_json)
    stage = _own_stage_after_a_step(model_name, plan_json)
    nodes = list(stage.lowered["backward"].graph_module.graph.nodes)
    issues = [i for i, n in enumerate(nodes) if n.target is REDUCE_SCATTER]
    waits = [i for i, n in enumerate(nodes) if n.target is WAIT and n.args[0].target is REDUCE_SCATTER]
    # most unwaited reduce-scatters at any point of the program
    out["in_flight"] = max(sum(1 for i in issues if i <= at) - sum(1 for w in waits if w <= at) for at in issues)
    out["reduce_scatters"] = len(issues)
    return out


@pytest.mark.slow
def test_single_stage_zero3_reduce_scatters_in_the_backward_two_in_flight() -> None:
    """A one-stage one-micro-batch ZeRO-3 plan (dp=2) reduce-scatters its gradient buckets inside
    the backward program, at most two unwaited (FSDP2's bound; the memory model's
    ``reduced_in_backward``), and trains like the single-device model."""
    import json

    import autoplan
    from autoplan.cost_models.config import ParallelConfig

    cfg = ParallelConfig(dp=2, tp=1, pp=1, microbatch_size=GLOBAL_BATCH // 2, num_microbatches=1, zero_stage=3)
    ids, labels = _batch(0)
    plan = autoplan.plan(
        BUILDERS["gpt2"](num_layers=NUM_LAYERS), "1x2xCPU", example_inputs=(ids,), loss_fn=zoo.lm_loss,
        example_targets=(labels,), optimizer="sgd_momentum", global_batch_size=GLOBAL_BATCH, config=cfg,
    )  # fmt: skip
    results = run_ranks(_train_public_bounded, 2, "gpt2", cfg, json.dumps(plan.to_dict()), timeout_s=900)
    assert_trains_like_reference(results, rel_tol=1e-5, atol=1e-6)
    for r in results:  # (this tiny model's gradients fill one bucket: the bound is tested in test_collectives)
        assert r["reduce_scatters"] >= 1 and 1 <= r["in_flight"] <= 2, r


def _train_public_last_backward(
    rank: int, world_size: int, model_name: str, config: object, plan_json: str
) -> dict[str, object]:
    """:func:`_train_public`, plus where the last micro-batch's lowered backward issues its
    gradient collectives and runs its last matrix product, and which waits it leaves to after
    the schedule (:func:`autoplan.runtime.lowering.defer_output_waits`)."""
    from autoplan.runtime.lowering import REDUCE_SCATTER, WAIT

    # the flat gradient-bucket collectives (autoplan.runtime.collectives: DDP's in-place all-reduce,
    # FSDP2's reduce-scatter); the backward's other conversions run DTensor's out-of-place all_reduce
    buckets = (torch.ops._c10d_functional.all_reduce_.default, REDUCE_SCATTER)
    out = _train_public(rank, world_size, model_name, config, plan_json)
    stage = _own_stage_after_a_step(model_name, plan_json)
    program = stage.lowered["last_backward"]
    nodes = list(program.graph_module.graph.nodes)
    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default)
    out["last_matmul"] = max(i for i, n in enumerate(nodes) if n.target in matmuls)
    out["issues"] = [issue for issue, _ in program.collectives() if nodes[issue].target in buckets]
    earlier = stage.lowered["backward"].graph_module.graph.nodes
    out["earlier_buckets"] = sum(1 for n in earlier if n.target in buckets)
    cut = stage._waits["last_backward"]
    out["waits_after_schedule"] = 0 if cut is None else sum(1 for n in cut.finish.graph.nodes if n.target is WAIT)
    out["waits_in_issue"] = (
        0 if cut is None else sum(1 for n in cut.issue.graph.nodes if n.target is WAIT and n.args[0].target in buckets)
    )
    out["bucket_issues"] = len(out["issues"])
    return out


@pytest.mark.parametrize(
    ("pp", "zero_stage", "num_microbatches"),
    [
        # all with -m slow (CI trains a pipeline in test_pipeline_loss_with_no_or_two_targets_...)
        pytest.param(1, 0, 2, marks=pytest.mark.slow),
        pytest.param(1, 3, 2, marks=pytest.mark.slow),
        pytest.param(1, 0, 4, marks=pytest.mark.slow),
        pytest.param(1, 3, 4, marks=pytest.mark.slow),
        pytest.param(2, 0, 4, marks=pytest.mark.slow),
        pytest.param(2, 3, 4, marks=pytest.mark.slow),
    ],
)
def test_accumulating_microbatches_reduce_in_each_stages_last_backward(
    pp: int, zero_stage: int, num_microbatches: int
) -> None:
    """dp=2, one or two pipeline stages, several micro-batches: the earlier micro-batches keep
    their raw gradients, each stage's last one's backward adds their sum and issues its gradient
    buckets (DDP all-reduces for ZeRO-0, FSDP2 reduce-scatters for ZeRO-3) before its last matrix
    product, overlapping the rest of the backward as the step model prices
    (``gradients_reduced_in_backward``), and returns with its last buckets in flight (waited for
    after the schedule, before the optimizer: the input gradient is sent without waiting for
    them); the pipeline trains like the single-device model. A GPT-2 of width 128: 3 MiB of
    gradients, several buckets (the first closes at 1 MiB); with two stages its tied embedding is
    reduced after the schedule."""
    import json

    import autoplan
    from autoplan.cost_models.config import ParallelConfig

    cfg = ParallelConfig(dp=2, tp=1, pp=pp, microbatch_size=GLOBAL_BATCH // (2 * num_microbatches),
                         num_microbatches=num_microbatches, zero_stage=zero_stage)  # fmt: skip
    ids, labels = _batch(0)
    plan = autoplan.plan(
        BUILDERS["gpt2_wide"](num_layers=NUM_LAYERS), f"1x{2 * pp}xCPU", example_inputs=(ids,), loss_fn=zoo.lm_loss,
        example_targets=(labels,), optimizer="sgd_momentum", global_batch_size=GLOBAL_BATCH, config=cfg,
    )  # fmt: skip
    assert plan.config == cfg
    results = run_ranks(
        _train_public_last_backward, 2 * pp, "gpt2_wide", cfg, json.dumps(plan.to_dict()), timeout_s=900
    )
    assert_trains_like_reference(results, rel_tol=1e-5, atol=1e-6)
    for r in results:
        issues = r["issues"]
        assert isinstance(issues, list) and issues, r
        assert r["earlier_buckets"] == 0, r  # the earlier micro-batches keep raw gradients
        assert min(issues) < r["last_matmul"], r
        # the last bucket(s) are waited for after the schedule; ZeRO-3 waits for the others in
        # the backward (at most two reduce-scatters in flight), ZeRO-0 for none of them
        assert r["waits_after_schedule"] >= 1, r
        if zero_stage == 0:
            assert r["waits_in_issue"] == 0, r


def test_grouped_query_fused_qkv_in_a_tensor_parallel_stage_trains_like_single_device() -> None:
    """Phi-3's grouped-query fused QKV, kept grouped by key/value head (autoplan.passes.kv_groups),
    in a pipeline stage on a 2-rank tensor-parallel stage mesh (1F1B, 4 micro-batches): the stage
    keeps the grouped rows, shards them by whole groups, and its ``full_parameters`` (which the
    comparison reads) give the model's rows back."""
    run_pipeline_case(PipeCase(model="phi3", layout="tp", schedule="1f1b", pp=1, stage_size=2))


@pytest.mark.slow  # 12-25 s of 2 ranks
def test_single_stage_tensor_parallel_gathers_stay_in_the_forward() -> None:
    """One stage on a 2-rank stage mesh (Megatron TP pins, GPipe): the parameter gathers of a
    block are one coalesced collective whose results the backward also reads; the stage split
    saves its getitems, not the tuple (the backward once read fake tensors from the forward's
    lowering and failed)."""
    run_pipeline_case(PipeCase(model="llama", layout="tp", schedule="gpipe", pp=1, stage_size=2))


@pytest.mark.slow  # 25-45 s of 2 ranks, with the v=2 interleaved cases above (the suite is near its 15-minute budget)
def test_interleaved_pipeline_with_six_chunks_per_rank_runs_like_single_device() -> None:
    """A 12-layer GPT-2 planned by autoplan.plan with a fixed pp=2 interleaved-1f1b
    configuration of v=6 chunks per rank (12 stages of one block each, the prologue joining the
    first and the epilogue the last) trains like the single-device model on 2 ranks."""
    import json

    import autoplan
    from autoplan.cost_models.config import ParallelConfig

    num_layers, v = 12, 6
    cfg = ParallelConfig(pp=2, microbatch_size=GLOBAL_BATCH // NUM_MICROBATCHES, num_microbatches=NUM_MICROBATCHES,
                         schedule="interleaved-1f1b", virtual_stages=v)  # fmt: skip
    ids, labels = _batch(0)
    plan = autoplan.plan(
        BUILDERS["gpt2"](num_layers=num_layers), "1x2xCPU", example_inputs=(ids,), loss_fn=zoo.lm_loss,
        example_targets=(labels,), optimizer="sgd_momentum", global_batch_size=GLOBAL_BATCH, config=cfg,
    )  # fmt: skip
    assert plan.config == cfg and plan.pipeline is not None
    assert len(plan.pipeline.stage_starts) == 2 * v and len(plan.pipeline.segment_names) == num_layers + 2
    results = run_ranks(_train_public, 2, "gpt2", cfg, json.dumps(plan.to_dict()), num_layers, timeout_s=900)
    assert_trains_like_reference(results, rel_tol=1e-5, atol=1e-6)


def test_backward_splits_into_input_and_weight_gradient_programs() -> None:
    """Zero-bubble's B and W: every backward op in exactly one of them, the input gradients all in
    B, and B then W computes what the whole backward computes (plain tensors on one process)."""
    from autoplan.passes.stages import split_backward

    def step(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, g: torch.Tensor):  # noqa: ANN202
        h = torch.tanh(x @ w1)  # the forward's saved values: x, h, w1, w2
        gy = g @ w2.t()
        gh = gy * (1 - h * h)
        return gh @ w1.t(), x.t() @ gh, h.t() @ g  # (input grad, grad w1, grad w2)

    gm = torch.fx.symbolic_trace(step)
    b, w = split_backward(gm, num_input_grads=1)
    ops = set(_ops(gm))
    b_ops, w_ops = set(_ops(b)), set(_ops(w))
    assert b_ops | w_ops == ops and not b_ops & w_ops
    assert "matmul_2" in b_ops and {"matmul_3", "matmul_4"} <= w_ops  # dW matmuls deferred to W
    args = [torch.randn(4, 3), torch.randn(3, 5), torch.randn(5, 6), torch.randn(4, 6)]
    full = gm(*args)
    in_grad, *carry = b(*args)
    torch.testing.assert_close(in_grad, full[0], rtol=0, atol=0)
    for got, want in zip(w(*carry), full[1:], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
