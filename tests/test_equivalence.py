"""Numerical equivalence: a parallelized model trains exactly like the single-device model.

Each test builds the same seeded model on every CPU rank, keeps a deep copy as the single-device
reference, parallelizes the original with pins that force the layout under test (data, tensor,
or data x tensor parallel), then runs three training steps on both:

    sharded:   loss = pm.forward_backward(x, targets=(y,), check=True); opt.step(); opt.zero_grad()
    reference: loss = loss_fn(ref(x), y); loss.backward(); ref_opt.step(); ref_opt.zero_grad()

and requires, on every rank,
  * equal losses at every step:            |loss - ref_loss| <= 1e-5 * |ref_loss|
  * equal parameters after the last step:  ||full(p) - p_ref|| / ||p_ref|| <= 1e-5 for every p.

``check=True`` also asserts every op output has the placement the plan gave it.

The plan is what the test name says
-----------------------------------
Pins fix only placeholders (parameters, inputs, targets); the ILP picks every op in between by
cost. With the ``NxCPU`` preset numbers the tiny test models are so cheap to compute that the
optimum often undoes a pin at once: a batch pinned ``S(0)`` is all-gathered at the first op and
the whole step runs replicated, or a row-parallel weight is all-gathered before its matmul. Cases
whose layout the preset optimum undoes run on the preset with compute made ``compute_slowdown``
times slower (peak FLOP/s and memory bandwidth divided, links unchanged), which makes splitting
the work pay for its communication. Each test asserts the resulting layout of the forward
matmuls (``assert_layers_split_batch``, ``assert_layers_use_sharded_weights``) before it checks
numbers.

Attention is not head-parallel in any plan: the decomposed attention multiplies
``(B * H, T, D)`` views, and a ``(B, H, T, D)`` tensor sharded on ``H`` cannot be viewed as a
sharded ``B * H`` dim, so the planner gathers the heads (and the row-parallel ``o_proj`` /
``attn.c_proj`` weight) before the attention matmuls; GPT-2's fused ``c_attn`` weight is gathered
too (a column split of its ``3 * C`` outputs would not align with q/k/v). The tensor-parallel assertions therefore
name the projections that really run sharded: q/k/v and the MLP for Llama, the MLP for GPT-2.

Optimizers: Adam for the MLP; SGD with momentum for the Hugging Face models. Adam's update is
m / sqrt(v), which normalises the gradient's magnitude away: a parameter whose exact gradient is
zero but which numerically gets ~1e-9 of rounding noise (e.g. the attention key bias: softmax is
invariant to a shift shared by all keys, so its gradient vanishes analytically) receives updates
of size ~lr from that noise, with a sign that depends on the summation order. A sharded program
sums in a different order than the single-device one, so no tolerance would hold for those
parameters. SGD scales the update by the gradient itself, so errors stay at rounding level.

Run with ``-s`` to print the plan, the per-step losses and the worst errors of each case.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

import autoplan
from autoplan.passes.trace import trace_training_step
from tests import zoo
from tests.harness import Case, SeededBatches, assert_trains_like_reference, forward_matmul_operands, param_errors
from tests.harness import run_case as run_on_ranks


def forward_matmuls(case: Case, plan: autoplan.Plan) -> list[dict[str, Any]]:
    """The plan's layout of every forward mm/addmm/bmm: its output spec and, when one argument is
    a parameter (directly or through transposes/views), that parameter and the argument's spec."""
    x, y = case.batches(0)
    traced = trace_training_step(case.build_model(), (x,), loss_fn=case.loss_fn, example_targets=(y,))
    rows = []
    for node, operands in forward_matmul_operands(traced):
        layout = plan.nodes[node.name]
        row = {"node": node.name, "out": tuple(layout["out"][0]), "weight": None, "weight_spec": None}
        for i, fqn, _ in operands:
            if fqn is not None:
                row["weight"], row["weight_spec"] = fqn, tuple(layout["in"][i])
        rows.append(row)
    return rows


def run_case(case: Case, *, timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Run ``case`` on its ranks (``tests.harness.run_case``); rank 0's result adds the layout
    of the forward matmuls. Prints the plan and the measured errors."""
    results = run_on_ranks(case, timeout_s=timeout_s)
    plan = results[0]["plan"]
    results[0]["forward_matmuls"] = forward_matmuls(case, plan)
    worst_loss = max(abs(a - b) / abs(b) for r in results for a, b in zip(r["losses"], r["ref_losses"], strict=True))
    worst_name, worst_param = max(((n, e) for r in results for n, e in param_errors(r).items()), key=lambda t: t[1])
    print(
        f"\n[{case.name}] {plan.cluster}: {plan.parallelism()}, collectives {plan.collective_counts()}, "
        f"solver {plan.solver['status']}\n"
        + "".join(
            f"  {m['node']}: out {m['out']} weight {m['weight']} {m['weight_spec']}\n"
            for m in results[0]["forward_matmuls"]
        )
        + f"  losses {results[0]['losses']}\n"
        f"  max rel loss err {worst_loss:.3e}, max rel param err {worst_param:.3e} ({worst_name})"
    )
    return results


def _layers(result: Mapping[str, Any], patterns: Sequence[str]) -> list[dict[str, Any]]:
    rows = [
        m
        for m in result["forward_matmuls"]
        if m["weight"] and any(fnmatch.fnmatchcase(m["weight"], p) for p in patterns)
    ]
    assert rows, f"no forward matmul multiplies a parameter matching {patterns}"
    return rows


def assert_layers_split_batch(result: Mapping[str, Any], *, axis: int, weights: Sequence[str] = ("*",)) -> None:
    """Data parallel on mesh ``axis``: the batch is pinned split there and every forward matmul
    with a parameter matching ``weights`` computes on a batch shard (output ``S(0)``: linear
    layers see ``(B * T, C)``, so dim 0 is the batch) instead of a gathered batch."""
    plan = result["plan"]
    assert plan.input_specs[0][axis] == "S(0)", plan.input_specs
    assert plan.target_specs[0][axis] == "S(0)", plan.target_specs
    gathered = {m["weight"]: m["out"] for m in _layers(result, weights) if m["out"][axis] != "S(0)"}
    assert not gathered, f"layers computing on the whole batch along mesh axis {axis}: {gathered}"


def assert_layers_use_sharded_weights(result: Mapping[str, Any], *, axis: int, weights: Sequence[str]) -> None:
    """Tensor parallel on mesh ``axis``: every forward matmul with a parameter matching
    ``weights`` multiplies by its local weight shard (``S(d)`` on ``axis``), not a gathered copy."""
    plan = result["plan"]
    for pattern in weights:
        assert any(fnmatch.fnmatchcase(n, pattern) for n in plan.param_specs), f"no parameter matches {pattern!r}"
    not_sharded = {
        m["weight"]: m["weight_spec"] for m in _layers(result, weights) if not m["weight_spec"][axis].startswith("S(")
    }
    assert not not_sharded, f"weights gathered along mesh axis {axis} before their matmul: {not_sharded}"


# --- MLP (Adam) ----------------------------------------------------------------------------------


def test_mlp_data_parallel_on_2_ranks_trains_like_single_device():
    case = Case(
        name="mlp-dp-2",
        build_model=zoo.mlp,
        # 64 rows: with 8 the (8, 16) batch is smaller than the (32, 16) weight and the planner
        # rightly prefers gathering the batch to all-reducing the weight gradient.
        batches=SeededBatches(zoo.mlp_batch, {"batch": 64}),
        loss_fn=zoo.mse_loss,
        preset="2xCPU",
        compute_slowdown=1e5,
        pins={"input_0": "S(0)", "target_0": "S(0)", "*.weight": "R", "*.bias": "R"},
        optimizer="adam",
        lr=1e-2,
    )
    results = run_case(case)

    assert_layers_split_batch(results[0], axis=0)
    assert all(spec == ("R",) for spec in results[0]["plan"].param_specs.values())
    assert_trains_like_reference(results)


@pytest.mark.slow
def test_mlp_tensor_parallel_on_2_ranks_trains_like_single_device():
    # torch Linear weight is (out, in): the first layer column-parallel (S(0)), the second
    # row-parallel (S(1)), so the hidden activation stays sharded between them.
    case = Case(
        name="mlp-tp-2",
        build_model=zoo.mlp,
        batches=SeededBatches(zoo.mlp_batch),
        loss_fn=zoo.mse_loss,
        preset="2xCPU",
        compute_slowdown=1e5,
        pins={"input_0": "R", "0.weight": "S(0)", "2.weight": "S(1)"},
        optimizer="adam",
        lr=1e-2,
    )
    results = run_case(case)

    assert results[0]["plan"].input_specs[0] == ("R",)
    # the first layer runs column-parallel; the second may run row-parallel, or batch-parallel on
    # its gathered weight (an all_to_all of the hidden activation, the weight gradient then joins
    # the one reduce-scatter bucket), whichever the cost model prices lower: both split its compute
    assert_layers_use_sharded_weights(results[0], axis=0, weights=["0.weight"])
    assert results[0]["plan"].param_specs["2.weight"] == ("S(1)",)
    assert_trains_like_reference(results)


# --- GPT-2 tiny (SGD with momentum) --------------------------------------------------------------


@pytest.mark.slow
def test_gpt2_data_parallel_on_4_ranks_trains_like_single_device():
    case = Case(
        name="gpt2-dp-4",
        build_model=zoo.gpt2_tiny,
        batches=SeededBatches(zoo.token_batch),
        loss_fn=zoo.lm_loss,
        preset="4xCPU",
        compute_slowdown=1e5,
        pins={"input_0": "S(0)", "target_0": "S(0)", "transformer.*": "R"},
        optimizer="sgd_momentum",
        lr=0.1,
    )
    results = run_case(case)

    assert_layers_split_batch(results[0], axis=0)
    assert_trains_like_reference(results)


@pytest.mark.slow  # (CI keeps the Llama GQA 2x2 case below and the GPT-2 2x2 golden program)
def test_gpt2_data_x_tensor_parallel_on_2x2_mesh_trains_like_single_device():
    case = Case(
        name="gpt2-dp-x-tp-2x2",
        build_model=zoo.gpt2_tiny,
        batches=SeededBatches(zoo.token_batch),
        loss_fn=zoo.lm_loss,
        preset="4xCPU",
        mesh_shape=(2, 2),
        compute_slowdown=3.0,
        pins={"input_0": "S(0),R", "target_0": "S(0),R"} | {k: f"R,{v}" for k, v in zoo.GPT2_TP_PINS.items()},
        optimizer="sgd_momentum",
        lr=0.1,
    )
    results = run_case(case)

    assert_layers_split_batch(results[0], axis=0)
    assert results[0]["plan"].input_specs[0][1] == "R"
    assert_layers_use_sharded_weights(results[0], axis=1, weights=["*mlp.c_fc.weight", "*mlp.c_proj.weight"])
    assert_trains_like_reference(results)


# --- Llama tiny with grouped-query attention (SGD with momentum) ---------------------------------

LLAMA_SHARDED_MATMULS = [
    "*.q_proj.weight",
    "*.k_proj.weight",
    "*.v_proj.weight",
    "*.gate_proj.weight",
    "*.up_proj.weight",
    "*.down_proj.weight",
]
"""The pinned weights the forward multiplies sharded (o_proj: see the module docstring)."""


def test_llama_gqa_tensor_parallel_on_2_ranks_trains_like_single_device():
    case = Case(
        name="llama-gqa-tp-2",
        build_model=zoo.llama_tiny,
        batches=SeededBatches(zoo.token_batch),
        loss_fn=zoo.lm_loss,
        preset="2xCPU",
        pins={"input_0": "R", "target_0": "R"} | zoo.LLAMA_TP_PINS,
        optimizer="sgd_momentum",
        lr=0.1,
    )
    results = run_case(case)

    assert results[0]["plan"].input_specs[0] == ("R",)
    assert_layers_use_sharded_weights(results[0], axis=0, weights=LLAMA_SHARDED_MATMULS)
    # attention itself runs head-parallel: each rank attends over its own 2 query / 1 key-value heads
    attention = {n: d for n, d in results[0]["plan"].nodes.items() if d["op"] == "autoplan.sdpa.default"}
    assert len(attention) == 2 and all(d["out"] == [["S(1)"]] for d in attention.values()), attention
    assert_trains_like_reference(results)


@pytest.mark.slow
def test_llama_gqa_data_x_tensor_parallel_on_2x2_mesh_trains_like_single_device():
    case = Case(
        name="llama-gqa-dp-x-tp-2x2",
        build_model=zoo.llama_tiny,
        batches=SeededBatches(zoo.token_batch),
        loss_fn=zoo.lm_loss,
        preset="4xCPU",
        mesh_shape=(2, 2),
        compute_slowdown=3.0,
        pins={"input_0": "S(0),R", "target_0": "S(0),R"} | {k: f"R,{v}" for k, v in zoo.LLAMA_TP_PINS.items()},
        optimizer="sgd_momentum",
        lr=0.1,
    )
    results = run_case(case, timeout_s=900)

    assert_layers_split_batch(results[0], axis=0)
    assert results[0]["plan"].input_specs[0][1] == "R"
    assert_layers_use_sharded_weights(results[0], axis=1, weights=LLAMA_SHARDED_MATMULS)
    assert_trains_like_reference(results)
