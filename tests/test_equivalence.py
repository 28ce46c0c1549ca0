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

import copy
import dataclasses
import fnmatch
import functools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist

import autoplan
from autoplan.passes.trace import param_node_name, trace_training_step
from tests import models
from tests.dist_utils import run_ranks

REL_TOL = 1e-5
NUM_STEPS = 3

_MATMULS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")
_VIEW_LIKE = (
    "aten.t.default",
    "aten.view.default",
    "aten._unsafe_view.default",
    "aten.transpose.int",
    "aten.permute.default",
    "aten.expand.default",
    "aten.clone.default",
)


@dataclass(frozen=True, kw_only=True)
class Case:
    """One equivalence run: a model, a cluster, the pins that force the plan, an optimizer."""

    name: str
    build_model: Callable[[], torch.nn.Module]
    make_batch: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    """``make_batch(seed=...) -> (input, target)``; step ``k`` uses ``seed=k + 1``."""
    loss_fn: Callable[..., torch.Tensor]
    num_devices: int
    mesh_shape: tuple[int, ...] | None = None
    """``None``: the preset's 1-D mesh."""
    compute_slowdown: float = 1.0
    """Divide the CPU preset's peak FLOP/s and memory bandwidth by this (see the module docstring)."""
    pins: Mapping[str, str]
    optimizer: str
    """``"adam"`` or ``"sgd_momentum"``: what the plan is costed for and what both sides run."""
    lr: float


def cpu_cluster(num_devices: int, *, mesh_shape: tuple[int, ...] | None, compute_slowdown: float) -> autoplan.Cluster:
    """The ``<num_devices>xCPU`` preset, its compute ``compute_slowdown`` times slower."""
    cluster = autoplan.Cluster.preset(f"{num_devices}xCPU", mesh_shape=mesh_shape)
    if compute_slowdown == 1.0:
        return cluster
    cpu = cluster.device
    slow = dataclasses.replace(
        cpu,
        peak_flops={k: v / compute_slowdown for k, v in cpu.peak_flops.items()},
        mem_bw_GBps=cpu.mem_bw_GBps / compute_slowdown,
        sources=(*cpu.sources, f"tests: compute {compute_slowdown:g}x slower than the CPU preset"),
    )
    return dataclasses.replace(cluster, device=slow)


def _make_optimizer(case: Case, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if case.optimizer == "adam":
        return torch.optim.Adam(params, lr=case.lr)
    if case.optimizer == "sgd_momentum":
        return torch.optim.SGD(params, lr=case.lr, momentum=0.9)
    raise ValueError(f"unknown optimizer {case.optimizer!r}")


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (absolute error if b is all zeros)."""
    a, b = a.detach().double(), b.detach().double()
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff / denom if denom > 0 else diff


def forward_matmuls(case: Case, plan: autoplan.Plan) -> list[dict[str, Any]]:
    """The plan's layout of every forward mm/addmm/bmm: its output spec and, when one argument is
    a parameter (directly or through transposes/views), that parameter and the argument's spec."""
    x, y = case.make_batch(seed=1)
    traced = trace_training_step(case.build_model(), (x,), loss_fn=case.loss_fn, example_targets=(y,))
    fqn_of = {param_node_name(n): n for n in traced.param_names}
    rows = []
    for node in traced.graph_module.graph.nodes:
        if str(node.target) not in _MATMULS or node.meta.get("autoplan.phase") != "fwd":
            continue
        layout = plan.nodes[node.name]
        row = {"node": node.name, "out": tuple(layout["out"][0]), "weight": None, "weight_spec": None}
        for i, arg in enumerate(node.args):  # every mm/addmm/bmm argument is a tensor
            src = arg
            while isinstance(src, torch.fx.Node) and str(src.target) in _VIEW_LIKE:
                src = src.args[0]
            if isinstance(src, torch.fx.Node) and src.name in fqn_of:
                row["weight"], row["weight_spec"] = fqn_of[src.name], tuple(layout["in"][i])
        rows.append(row)
    return rows


def _plan_key(plan: autoplan.Plan) -> str:
    d = plan.to_dict()
    return json.dumps({k: d[k] for k in ("placements", "nodes", "collectives")}, sort_keys=True)


def train_sharded_and_reference(rank: int, world_size: int, case: Case) -> dict[str, Any]:
    """Rank body: 3 steps on the parallelized model and on the single-device reference."""
    model = case.build_model()
    reference = copy.deepcopy(model)
    x, y = case.make_batch(seed=1)
    cluster = cpu_cluster(case.num_devices, mesh_shape=case.mesh_shape, compute_slowdown=case.compute_slowdown)
    pm = autoplan.parallelize(
        model,
        cluster,
        example_inputs=(x,),
        loss_fn=case.loss_fn,
        example_targets=(y,),
        pins=dict(case.pins),
        optimizer=case.optimizer,
    )
    # All ranks must run one plan: a disagreement should fail here, not hang in a collective.
    keys: list[str | None] = [None] * world_size
    dist.all_gather_object(keys, _plan_key(pm.plan))
    assert all(k == keys[0] for k in keys), f"ranks planned differently: {[hash(k) for k in keys]}"

    opt = _make_optimizer(case, list(pm.parameters()))
    ref_opt = _make_optimizer(case, list(reference.parameters()))
    losses, ref_losses = [], []
    for step in range(NUM_STEPS):
        x, y = case.make_batch(seed=step + 1)
        loss = pm.forward_backward(x, targets=(y,), check=True)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())

        ref_loss = case.loss_fn(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())

    full = pm.full_parameters()
    ref_params = dict(reference.named_parameters())
    result: dict[str, Any] = {
        "rank": rank,
        "losses": losses,
        "ref_losses": ref_losses,
        "param_rel_err": {n: _rel_err(full[n], ref_params[n]) for n in full},
        "ref_param_names": sorted(ref_params),
    }
    if rank == 0:
        result["plan"] = pm.plan
        result["forward_matmuls"] = forward_matmuls(case, pm.plan)
    return result


def run_case(case: Case, *, timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Run ``case`` on its ranks; return the per-rank results (rank 0 adds the plan) and print
    the plan and the measured errors."""
    results = run_ranks(train_sharded_and_reference, case.num_devices, case, timeout_s=timeout_s)
    plan = results[0]["plan"]
    worst_loss = max(abs(a - b) / abs(b) for r in results for a, b in zip(r["losses"], r["ref_losses"], strict=True))
    worst_name, worst_param = max(((n, e) for r in results for n, e in r["param_rel_err"].items()), key=lambda t: t[1])
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


def assert_trains_like_reference(results: Sequence[Mapping[str, Any]]) -> None:
    """On every rank: equal losses at every step, equal parameters after the last step."""
    for r in results:
        assert set(r["param_rel_err"]) == set(r["ref_param_names"]), "sharded and reference parameter sets differ"
        for step, (loss, ref_loss) in enumerate(zip(r["losses"], r["ref_losses"], strict=True)):
            assert math.isfinite(loss)
            assert loss == pytest.approx(ref_loss, rel=REL_TOL), (
                f"rank {r['rank']} step {step}: loss {loss} != {ref_loss}"
            )
        bad = {n: e for n, e in r["param_rel_err"].items() if not e <= REL_TOL}
        assert not bad, f"rank {r['rank']}: parameters differ from the reference after {NUM_STEPS} steps: {bad}"


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
        build_model=models.mlp,
        # 64 rows: with 8 the (8, 16) batch is smaller than the (32, 16) weight and the planner
        # rightly prefers gathering the batch to all-reducing the weight gradient.
        make_batch=functools.partial(models.mlp_batch, batch=64),
        loss_fn=models.mse_loss,
        num_devices=2,
        compute_slowdown=1e5,
        pins={"input_0": "S(0)", "target_0": "S(0)", "*.weight": "R", "*.bias": "R"},
        optimizer="adam",
        lr=1e-2,
    )
    results = run_case(case)

    assert_layers_split_batch(results[0], axis=0)
    assert all(spec == ("R",) for spec in results[0]["plan"].param_specs.values())
    assert_trains_like_reference(results)


def test_mlp_tensor_parallel_on_2_ranks_trains_like_single_device():
    # torch Linear weight is (out, in): the first layer column-parallel (S(0)), the second
    # row-parallel (S(1)), so the hidden activation stays sharded between them.
    case = Case(
        name="mlp-tp-2",
        build_model=models.mlp,
        make_batch=models.mlp_batch,
        loss_fn=models.mse_loss,
        num_devices=2,
        compute_slowdown=1e5,
        pins={"input_0": "R", "0.weight": "S(0)", "2.weight": "S(1)"},
        optimizer="adam",
        lr=1e-2,
    )
    results = run_case(case)

    assert results[0]["plan"].input_specs[0] == ("R",)
    assert_layers_use_sharded_weights(results[0], axis=0, weights=["0.weight", "2.weight"])
    assert_trains_like_reference(results)


# --- GPT-2 tiny (SGD with momentum) --------------------------------------------------------------

GPT2_TP_PINS = {
    # HF Conv1D weight is (in, out): column-parallel is S(1), row-parallel S(0).
    "*mlp.c_fc.weight": "S(1)",
    "*mlp.c_proj.weight": "S(0)",
    "*attn.c_attn.weight": "S(1)",
    "*attn.c_proj.weight": "S(0)",
}


def test_gpt2_data_parallel_on_4_ranks_trains_like_single_device():
    case = Case(
        name="gpt2-dp-4",
        build_model=models.gpt2_tiny,
        make_batch=models.token_batch,
        loss_fn=models.lm_loss,
        num_devices=4,
        compute_slowdown=1e5,
        pins={"input_0": "S(0)", "target_0": "S(0)", "transformer.*": "R"},
        optimizer="sgd_momentum",
        lr=0.1,
    )
    results = run_case(case)

    assert_layers_split_batch(results[0], axis=0)
    assert_trains_like_reference(results)


def test_gpt2_data_x_tensor_parallel_on_2x2_mesh_trains_like_single_device():
    case = Case(
        name="gpt2-dp-x-tp-2x2",
        build_model=models.gpt2_tiny,
        make_batch=models.token_batch,
        loss_fn=models.lm_loss,
        num_devices=4,
        mesh_shape=(2, 2),
        compute_slowdown=3.0,
        pins={"input_0": "S(0),R", "target_0": "S(0),R"} | {k: f"R,{v}" for k, v in GPT2_TP_PINS.items()},
        optimizer="sgd_momentum",
        lr=0.1,
    )
    results = run_case(case)

    assert_layers_split_batch(results[0], axis=0)
    assert results[0]["plan"].input_specs[0][1] == "R"
    assert_layers_use_sharded_weights(results[0], axis=1, weights=["*mlp.c_fc.weight", "*mlp.c_proj.weight"])
    assert_trains_like_reference(results)


# --- Llama tiny with grouped-query attention (SGD with momentum) ---------------------------------

LLAMA_TP_PINS = {
    # torch Linear weight is (out, in): q/k/v/gate/up column-parallel S(0), o/down row-parallel S(1).
    # 4 query heads and 2 key/value heads split evenly over 2 tensor-parallel ranks.
    "*.q_proj.weight": "S(0)",
    "*.k_proj.weight": "S(0)",
    "*.v_proj.weight": "S(0)",
    "*.gate_proj.weight": "S(0)",
    "*.up_proj.weight": "S(0)",
    "*.o_proj.weight": "S(1)",
    "*.down_proj.weight": "S(1)",
}
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
        build_model=models.llama_tiny,
        make_batch=models.token_batch,
        loss_fn=models.lm_loss,
        num_devices=2,
        pins={"input_0": "R", "target_0": "R"} | LLAMA_TP_PINS,
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


def test_llama_gqa_data_x_tensor_parallel_on_2x2_mesh_trains_like_single_device():
    case = Case(
        name="llama-gqa-dp-x-tp-2x2",
        build_model=models.llama_tiny,
        make_batch=models.token_batch,
        loss_fn=models.lm_loss,
        num_devices=4,
        mesh_shape=(2, 2),
        compute_slowdown=3.0,
        pins={"input_0": "S(0),R", "target_0": "S(0),R"} | {k: f"R,{v}" for k, v in LLAMA_TP_PINS.items()},
        optimizer="sgd_momentum",
        lr=0.1,
    )
    results = run_case(case, timeout_s=900)

    assert_layers_split_batch(results[0], axis=0)
    assert results[0]["plan"].input_specs[0][1] == "R"
    assert_layers_use_sharded_weights(results[0], axis=1, weights=LLAMA_SHARDED_MATMULS)
    assert_trains_like_reference(results)
