"""Selective and full recomputation, priced = executed (issue #20 item 4, :mod:`autoplan.passes.recompute`).

* The rule on a GPT-2 stage: the forward keeps matmul outputs and block inputs, fewer bytes than
  without recomputation and more than full recomputation; the backward re-runs no matmul, no
  collective and no random op, and exactly the ops the pricing counts
  (:func:`~autoplan.passes.recompute.joint_recompute_partition`, read by
  :mod:`autoplan.planner.segment_costs`).
* The pricing on a traced GPT-2 block, restated per Korthikanti et al. 2022.
* Full recomputation per block: the same rule under policy ``full`` keeps fewer bytes than
  selective and re-runs the matmuls, as priced; a dp=2 plan trains like the single device.
* Equivalence: selectively recomputed plans (pp=2 with 1F1B and zero-bubble, pp=1 with dp=2 or
  tp=2) on 2
  gloo CPU ranks train like the single-device model (loss and parameters after 3 SGD-with-momentum
  steps, fp32, ``rel_tol=1e-5, atol=1e-6``).
"""

from __future__ import annotations

import copy
import json
import operator

import pytest
import torch
import torch.fx as fx
from torch import nn

from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.compute import is_matmul
from autoplan.passes.layers import find_layers
from autoplan.passes.liveness import is_view_op
from autoplan.passes.recompute import (
    OP_META,
    TRANSITION_META,
    communicates,
    joint_recompute_partition,
    recompute_stage_program,
    stage_recompute_partition,
)
from autoplan.passes.redistribute import edge_redistributions
from autoplan.passes.stages import RECOMPUTED_META, StageProgram, split_backward, split_stages
from autoplan.passes.trace import trace_training_step
from autoplan.planner.ilp import plan_traced
from autoplan.planner.mesh import as_cluster, planning_mesh
from autoplan.planner.segment_model import SegmentCostModel
from autoplan.runtime.codegen import generate_program
from tests import zoo
from tests.harness import SeededBatches, assert_trains_like_reference, run_ranks, train_both
from tests.test_pipeline_equivalence import PipeCase, _plan_json, _split, train_pipeline_and_reference

# --- the rule on a stage program (one process) -----------------------------------------------------


def _base(v: fx.Node) -> fx.Node:
    """The node whose storage ``v`` lives in (through views and the getitems of a split)."""
    while True:
        if v.op == "call_function" and is_view_op(v.target):
            v = v.args[0]  # type: ignore[assignment]
        elif v.op == "call_function" and v.target is operator.getitem and "split" in str(v.args[0].target):  # type: ignore[union-attr]
            v = v.args[0].args[0]  # type: ignore[union-attr,assignment]
        else:
            return v


def _bytes(values: list[fx.Node]) -> int:
    """Bytes of the distinct storages behind ``values`` (global shapes, the traced values)."""
    bases = {_base(v) for v in values}
    total = 0
    for b in bases:
        vals = b.meta["val"] if isinstance(b.meta.get("val"), (tuple, list)) else [b.meta.get("val")]
        total += sum(t.numel() * t.element_size() for t in vals if isinstance(t, torch.Tensor))
    return total


def _returned_for_backward(st: StageProgram) -> list[fx.Node]:
    out = next(n for n in st.forward.graph.nodes if n.op == "output").args[0]
    return [o for o in out[len(st.outputs) :] if isinstance(o, fx.Node)]  # type: ignore[index]


MESH = (2,)
"""The stage mesh of ``_split``: the ``2xCPU`` preset, data parallel."""


@pytest.fixture(scope="module")
def gpt2_split():
    traced, _, split, plan = _split("gpt2", [0, 3])
    return traced, find_layers(traced), split, plan


def test_selective_stage_keeps_fewer_bytes_than_none_and_more_than_full(gpt2_split) -> None:
    _, layering, split, _ = gpt2_split
    for st in split.stages:
        last = st.index == len(split.stages) - 1
        sel = recompute_stage_program(st, layering.segment_of, last=last, mesh_shape=MESH)
        none_bytes = _bytes(_returned_for_backward(st))
        sel_bytes = _bytes(_returned_for_backward(sel))
        inputs = [n for n in st.forward.graph.nodes if n.op == "placeholder"][
            len(st.param_names) + len(st.buffer_names) :
        ]
        full_bytes = _bytes(inputs)  # full recomputation keeps the stage's inputs
        assert full_bytes < sel_bytes < none_bytes, (full_bytes, sel_bytes, none_bytes)
        # the forward returns exactly the kept values, the backward takes them in its place
        assert [v.name for v in _returned_for_backward(sel)] == list(sel.saved)
        assert sel.outputs == st.outputs and sel.input_grads == st.input_grads


def test_selective_backward_reruns_no_matmul_collective_or_random_op_and_what_the_pricing_counts(
    gpt2_split,
) -> None:
    traced, layering, split, plan = gpt2_split
    rerun: set[str] = set()
    for st in split.stages:
        sel = recompute_stage_program(st, layering.segment_of, last=st.index == len(split.stages) - 1, mesh_shape=MESH)
        ops = [n for n in sel.backward.graph.nodes if n.meta.get(RECOMPUTED_META)]
        assert ops, "a GPT-2 stage re-runs its norms, GeLUs and residual adds"
        for n in ops:
            op = n.meta.get(OP_META, n.target)
            assert not is_matmul(op), n.name
            kind, axis = n.meta.get(TRANSITION_META, ("shard", 0))
            assert not communicates(kind, axis, MESH), f"{n.name}: a collective re-run"
            assert torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()), n.name
        rerun |= {n.name for n in ops if n.op == "call_function"}
        part = stage_recompute_partition(
            st, layering.segment_of, last=st.index == len(split.stages) - 1, mesh_shape=MESH
        )
        assert rerun >= part.recomputed_ops
    kinds = {str(n.target) for n in traced.graph_module.graph.nodes if n.name in rerun}
    assert {"aten.native_layer_norm.default", "aten.tanh.default", "aten.add.Tensor"} <= kinds
    # the pricing sums the forward time of exactly these ops (segment_costs' selective_recompute_s),
    # an input arriving through a communicating conversion kept converted (the loss's summed pair)
    steps = {(r.consumer, r.arg_index): r.steps for r in edge_redistributions(traced, plan.assignment(), 1)}

    def converted(v: fx.Node, i: int) -> bool:
        return any(communicates(st.kind, st.axis, MESH) for st in steps.get((v.name, i), ()))

    priced = joint_recompute_partition(traced.graph_module, layering.segment_of, mesh_shape=MESH, converted=converted)
    assert priced.recomputed_ops == rerun


def test_under_megatron_pins_the_kept_all_reduces_are_what_the_pricing_keeps() -> None:
    """GPT-2 with Megatron tensor parallelism (and the sequence-parallel conversions the solver
    picks) on a stage mesh of 2: the runtime keeps the results of the collectives that feed
    re-run ops, the pricing keeps the same inputs as converted (its conversions are edges:
    ``converted`` from the plan's redistributions), and both re-run the same ops."""
    net = zoo.gpt2_tiny(num_layers=4)
    ids, labels = zoo.token_batch(batch=2)
    traced = trace_training_step(net, (ids,), loss_fn=zoo.lm_loss, example_targets=(labels,))
    layering = find_layers(traced)
    cluster = Cluster.preset("2xCPU")
    pins = {"input_0": "R", "target_0": "R"} | zoo.GPT2_TP_PINS
    with planning_mesh(cluster) as mesh:
        plan = plan_traced(traced, cluster, mesh=mesh, pins=pins)
        gen = generate_program(
            traced, plan.assignment(), fallback_nodes=frozenset(plan.fallback_ops), axis_names=cluster.mesh_axis_names,
            device=torch.device("cpu"), mesh=mesh, defer_grad_conversions=True,
        )  # fmt: skip
    (stage,) = split_stages(gen.graph_module, traced, layering, plan.assignment(), stage_starts=[0], mesh_ndim=1).stages
    executed = stage_recompute_partition(stage, layering.segment_of, last=True, mesh_shape=MESH)
    collectives = [v for v in executed.kept if TRANSITION_META in v.meta]
    assert collectives, "the all-reduces/reduce-scatters after the row-parallel matmuls are kept"
    steps = {(r.consumer, r.arg_index): r.steps for r in edge_redistributions(traced, plan.assignment(), 1)}

    def converted(v: fx.Node, i: int) -> bool:
        return any(communicates(st.kind, st.axis, MESH) for st in steps.get((v.name, i), ()))

    priced = joint_recompute_partition(traced.graph_module, layering.segment_of, mesh_shape=MESH, converted=converted)
    assert priced.recomputed_ops == executed.recomputed_ops
    assert priced.kept_conversions


def test_zero_bubble_split_runs_the_recomputation_in_b(gpt2_split) -> None:
    """split_backward of a selective backward: every re-run op in B (the step model prices it
    there), each op in exactly one of B and W."""
    _, layering, split, _ = gpt2_split
    st = split.stages[1]
    sel = recompute_stage_program(st, layering.segment_of, last=True, mesh_shape=MESH)
    b, w = split_backward(sel.backward, sum(1 for v in sel.input_grads if v is not None))
    rerun = {n.name for n in sel.backward.graph.nodes if n.meta.get(RECOMPUTED_META)}
    b_ops = {n.name for n in b.graph.nodes if n.op == "call_function"}
    w_ops = {n.name for n in w.graph.nodes if n.op == "call_function"}
    assert rerun <= b_ops and not rerun & w_ops and not b_ops & w_ops


def test_full_recompute_reruns_the_matmuls_and_keeps_only_block_inputs(gpt2_split) -> None:
    """Policy ``full`` on the GPT-2 stages: the forward returns fewer bytes than selective's,
    the backward re-runs the matmuls too (one block at a time), and exactly the ops the pricing
    counts for ``full_recompute_s``."""
    traced, layering, split, plan = gpt2_split
    rerun: set[str] = set()
    for st in split.stages:
        last = st.index == len(split.stages) - 1
        sel = recompute_stage_program(st, layering.segment_of, last=last, mesh_shape=MESH)
        full = recompute_stage_program(st, layering.segment_of, last=last, mesh_shape=MESH, policy="full")
        assert _bytes(_returned_for_backward(full)) < _bytes(_returned_for_backward(sel))
        ops = [n for n in full.backward.graph.nodes if n.meta.get(RECOMPUTED_META)]
        assert any(is_matmul(n.meta.get(OP_META, n.target)) for n in ops), "full re-runs the matmuls"
        # conversions code generation inserted are nodes here, edges in the traced graph the
        # pricing reads (their time goes into full_recompute_s with their re-run consumer)
        rerun |= {n.name for n in ops if n.op == "call_function" and TRANSITION_META not in n.meta}
        assert full.outputs == st.outputs and full.input_grads == st.input_grads
    priced = joint_recompute_partition(traced.graph_module, layering.segment_of, mesh_shape=MESH, policy="full")
    assert priced.recomputed_ops == rerun


# --- the pricing on a traced block -------------------------------------------------------------------

SEQ, BATCH, HIDDEN, HEADS, VOCAB = 64, 2, 128, 4, 512


@pytest.fixture(scope="module")
def gpt2_block_costs():  # noqa: ANN201 - the SegmentCosts of one micro-batch
    """The priced 2-block GPT-2 of the block tests below (fp32, no dropout, exact GeLU)."""
    torch.manual_seed(0)
    model = zoo.gpt2_lm(layers=2, hidden=HIDDEN, heads=HEADS, vocab=VOCAB, positions=SEQ)
    for block in model.transformer.h:
        block.mlp.act = nn.GELU()
    ids = torch.randint(0, VOCAB, (1, SEQ))
    return SegmentCostModel(model, (ids,), zoo.lm_loss, (ids,), as_cluster("1xCPU"), optimizer="sgd", workers=1)(
        1, BATCH
    )


def test_selective_block_keeps_its_matmul_outputs_and_its_output(gpt2_block_costs) -> None:
    """A GPT-2 block (fp32, no dropout, exact GeLU as in tests/test_memory_peak_model.py) keeps
    10 s*b*h floats under selective recomputation: QKV projection 3, attention output 1 (the fused
    attention recomputes its softmax itself, the core Korthikanti et al. 2022 sec. 4.2 re-run),
    output projection 1 (re-running the first residual add needs it), MLP up-projection 4 (the
    GeLU's input), the block's output 1 (the second residual add, the next block's input; the
    down-projection is not needed). Without recomputation it keeps 16
    (tests/test_memory_peak_model.py); re-created in the backward: both LayerNorm outputs 2, the
    attention output's re-layout 1, the first residual add 1, the GeLU output 4 (plus the
    LayerNorm statistics, b*s floats each). The re-run ops' forward time is the extra backward."""
    sbh_fp32 = SEQ * BATCH * HIDDEN * 4
    for block in gpt2_block_costs.segments[1:-1]:
        assert block.saved_bytes == pytest.approx(16 * sbh_fp32, rel=0.02)
        assert block.selective_kept_bytes == pytest.approx(10 * sbh_fp32, rel=0.01)
        assert block.selective_recomputed_bytes == pytest.approx(8 * sbh_fp32, rel=0.02)
        # re-created as the backward reaches them and freed after their last reader: never all at once
        recreated_at_peak = block.selective_bwd_transient_bytes - block.bwd_transient_bytes
        assert 0 < recreated_at_peak < block.selective_recomputed_bytes
        assert 0 < block.selective_recompute_s < block.fwd_s


def test_full_block_keeps_fewer_bytes_than_selective_and_none_and_reruns_its_matmuls(gpt2_block_costs) -> None:
    """Per block segment of the priced GPT-2 (the block of the test above): ``full`` keeps the
    block's output (the next block's input, 1 s*b*h) < selective's 10 < none's 16; it re-creates
    the rest in the backward, never all blocks at once, and its re-run time includes the
    matmuls: more than selective's, at most the whole forward."""
    sbh_fp32 = SEQ * BATCH * HIDDEN * 4
    for block in gpt2_block_costs.segments[1:-1]:
        assert block.full_kept_bytes < block.selective_kept_bytes < block.saved_bytes
        assert block.full_kept_bytes == pytest.approx(1 * sbh_fp32, rel=0.01)
        assert block.full_recomputed_bytes == pytest.approx(block.saved_bytes - block.full_kept_bytes, rel=0.02)
        recreated_at_peak = block.full_bwd_transient_bytes - block.bwd_transient_bytes
        assert block.selective_bwd_transient_bytes < block.full_bwd_transient_bytes
        # never every segment's at once (the epilogue's logits-sized values live until the tied
        # lm_head's weight gradient, late in the backward, as under selective)
        assert 0 < recreated_at_peak < sum(s.full_recomputed_bytes for s in gpt2_block_costs.segments)
        assert block.selective_recompute_s < block.full_recompute_s <= block.fwd_s


# --- equivalence on 2 gloo CPU ranks ---------------------------------------------------------------

GLOBAL_BATCH, NUM_LAYERS = 8, 4
_batch = SeededBatches(zoo.token_batch, {"batch": GLOBAL_BATCH})


def _train(rank: int, world_size: int, plan_json: str, recompute: str = "selective") -> dict[str, object]:  # noqa: ARG001
    import autoplan

    plan = autoplan.Plan.from_dict(json.loads(plan_json))
    model = zoo.gpt2_tiny(num_layers=NUM_LAYERS)
    reference = copy.deepcopy(model)
    ids, labels = _batch(0)
    pm = autoplan.parallelize(
        model, plan.cluster, example_inputs=(ids,), loss_fn=zoo.lm_loss, example_targets=(labels,), plan=plan
    )
    assert all(r == recompute for r in plan.pipeline.stage_recompute)  # type: ignore[union-attr]
    return train_both(
        pm,
        reference,
        batches=lambda step: tuple((t,) for t in _batch(step)),  # type: ignore[arg-type,return-value]
        loss_fn=zoo.lm_loss,
        opt=pm.make_optimizer(lr=0.1),
        ref_opt=torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9),
        check=False,
    )


@pytest.mark.parametrize(
    ("dp", "tp", "pp", "num_microbatches", "schedule"),
    [
        (1, 1, 2, 4, "1f1b"),
        pytest.param(2, 1, 1, 1, "1f1b", marks=pytest.mark.slow),
        pytest.param(1, 1, 2, 4, "zero-bubble", marks=pytest.mark.slow),
    ],
)
def test_selective_recompute_trains_like_single_device(
    dp: int, tp: int, pp: int, num_microbatches: int, schedule: str
) -> None:
    import autoplan
    from autoplan.cost_models.config import ParallelConfig

    cfg = ParallelConfig(dp=dp, tp=tp, pp=pp, microbatch_size=GLOBAL_BATCH // (num_microbatches * dp),
                         num_microbatches=num_microbatches, schedule=schedule, recompute="selective")  # type: ignore[arg-type]  # fmt: skip
    ids, labels = _batch(0)
    plan = autoplan.plan(
        zoo.gpt2_tiny(num_layers=NUM_LAYERS), "1x2xCPU", example_inputs=(ids,), loss_fn=zoo.lm_loss,
        example_targets=(labels,), optimizer="sgd_momentum", global_batch_size=GLOBAL_BATCH, config=cfg,
    )  # fmt: skip
    assert plan.config == cfg and plan.estimate.memory_per_device_bytes
    results = run_ranks(_train, 2, json.dumps(plan.to_dict()), timeout_s=600)
    assert_trains_like_reference(results, rel_tol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_full_recompute_per_block_trains_like_single_device() -> None:
    """dp=2, one stage, full recomputation per block: every block keeps its input, its backward
    re-runs the block's forward (matmuls included) one block at a time."""
    import autoplan
    from autoplan.cost_models.config import ParallelConfig

    cfg = ParallelConfig(dp=2, tp=1, pp=1, microbatch_size=GLOBAL_BATCH // 2, num_microbatches=1, recompute="full")
    ids, labels = _batch(0)
    plan = autoplan.plan(
        zoo.gpt2_tiny(num_layers=NUM_LAYERS), "1x2xCPU", example_inputs=(ids,), loss_fn=zoo.lm_loss,
        example_targets=(labels,), optimizer="sgd_momentum", global_batch_size=GLOBAL_BATCH, config=cfg,
    )  # fmt: skip
    assert plan.config == cfg
    results = run_ranks(_train, 2, json.dumps(plan.to_dict()), "full", timeout_s=600)
    assert_trains_like_reference(results, rel_tol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_selective_recompute_under_megatron_tensor_parallelism_trains_like_single_device() -> None:
    """GPT-2 with Megatron pins on a stage mesh of 2 (pp=1, GPipe over 4 micro-batches): the
    all-reduces after the row-parallel matmuls communicate, so the backward keeps their results
    and re-runs the residual adds and LayerNorms from them."""
    case = PipeCase(model="gpt2", layout="tp", schedule="gpipe", pp=1, stage_size=2, recompute="selective")
    results = run_ranks(train_pipeline_and_reference, 2, case, _plan_json(case), timeout_s=600)
    assert_trains_like_reference(results, rel_tol=1e-5, atol=1e-6)


# --- measured peak memory on 2 gloo CPU ranks ------------------------------------------------------

MEMORY_CONFIGS = {
    r: {"dp": 1, "tp": 1, "pp": 2, "microbatch_size": 1, "num_microbatches": 8, "schedule": "gpipe", "recompute": r}
    for r in ("none", "selective", "full")
}
"""GPipe keeps all 8 micro-batches' activations before the first backward and plain SGD has no
optimizer state: the activations set the peak (with Adam the optimizer step does, the same for
every recomputation)."""


def _measure_peaks(rank: int, world_size: int, plans: dict[str, str]) -> dict[str, tuple[float, float]]:  # noqa: ARG001
    import autoplan
    from benchmarks.memory_peak import BATCH, SEQ, VOCAB, measure, predicted

    ids, labels = zoo.token_batch(batch=BATCH, seq=SEQ, seed=1, vocab=VOCAB)
    out = {}
    for name, plan_json in plans.items():
        plan = autoplan.Plan.from_dict(json.loads(plan_json))
        out[name] = (float(measure(plan, ids, labels)), predicted(plan, rank))
    return out


@pytest.mark.slow
def test_selective_peak_lies_between_full_and_none_as_priced() -> None:
    """benchmarks/memory_peak.py's GPT-2 (4 layers, hidden 128) and its measurement (torch.profiler
    memory events over one step; plain SGD), pp=2 GPipe with 8 micro-batches in flight: on both pipeline
    ranks the measured peak of selective recomputation lies strictly between full recomputation's
    and none's, and the predicted peak is within 10% of the measured one."""
    import autoplan
    from autoplan.cost_models.config import ParallelConfig
    from benchmarks.memory_peak import BATCH, CLUSTER, SEQ, VOCAB, build_model

    ids, labels = zoo.token_batch(batch=BATCH, seq=SEQ, seed=1, vocab=VOCAB)
    plans = {
        name: json.dumps(
            autoplan.plan(
                build_model(),
                CLUSTER,
                example_inputs=(ids,),
                loss_fn=zoo.lm_loss,
                example_targets=(labels,),
                optimizer="sgd",
                global_batch_size=BATCH,
                config=ParallelConfig(**cfg),  # type: ignore[arg-type]
            ).to_dict()
        )
        for name, cfg in MEMORY_CONFIGS.items()
    }
    results = run_ranks(_measure_peaks, 2, plans, timeout_s=900)
    for rank, peaks in enumerate(results):
        (none, _), (sel, sel_predicted), (full, _) = peaks["none"], peaks["selective"], peaks["full"]
        print(f"rank {rank}: " + ", ".join(f"{k} measured {m / 2**20:.2f} MiB predicted {p / 2**20:.2f} ({p / m - 1:+.1%})"
                                           for k, (m, p) in peaks.items()))  # fmt: skip
        assert full < sel < none
        assert sel_predicted == pytest.approx(sel, rel=0.10)
