"""Numerical equivalence: a parallelized model trains exactly like the single-device model.

Each test builds the same seeded model on every CPU rank, keeps a deep copy as the single-device
reference, parallelizes the original with pins that force the layout under test (data, tensor,
or data x tensor parallel), then runs three training steps on both:

    sharded:   loss = pm.forward_backward(x, targets=(y,), check=True); opt.step(); opt.zero_grad()
    reference: loss = loss_fn(ref(x), y); loss.backward(); ref_opt.step(); ref_opt.zero_grad()

and requires, on every rank,
  * equal losses at every step:            |loss - ref_loss| <= 1e-5 * |ref_loss|
  * equal parameters after the last step:  ||full(p) - p_ref|| / ||p_ref|| <= 1e-5 for every p.

``check=True`` also asserts every op output has the placement the plan gave it. Each test first
asserts that the plan really is the parallelism its name states.

Optimizers: Adam for the MLP; SGD with momentum for the Hugging Face models. Adam's update is
m / sqrt(v), which normalises the gradient's magnitude away: a parameter whose exact gradient is
zero but which numerically gets ~1e-9 of rounding noise (e.g. the attention key bias: softmax is
invariant to a shift shared by all keys, so its gradient vanishes analytically) receives updates
of size ~lr from that noise, with a sign that depends on the summation order. A sharded program
sums in a different order than the single-device one, so no tolerance would hold for those
parameters. SGD scales the update by the gradient itself, so errors stay at rounding level.

Run with ``-s`` to print the measured per-step loss errors and the worst parameter error per case.
"""

from __future__ import annotations

import copy
import fnmatch
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import autoplan
import models
from dist_utils import run_ranks

REL_TOL = 1e-5
NUM_STEPS = 3


@dataclass(frozen=True, kw_only=True)
class Case:
    """One equivalence run: a model, a cluster layout, the pins that force the plan, an optimizer."""

    name: str
    build_model: Callable[[], torch.nn.Module]
    make_batch: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    """``make_batch(seed=...) -> (input, target)``; step ``k`` uses ``seed=k + 1``."""
    loss_fn: Callable[..., torch.Tensor]
    preset: str
    mesh_shape: tuple[int, ...] | None
    pins: Mapping[str, str]
    optimizer: str
    """``"adam"`` or ``"sgd_momentum"`` (what the plan is costed for and what both sides run)."""
    lr: float
    optimizer_kwargs: Mapping[str, Any] = field(default_factory=dict)


def _make_optimizer(case: Case, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if case.optimizer == "adam":
        return torch.optim.Adam(params, lr=case.lr, **case.optimizer_kwargs)
    if case.optimizer == "sgd_momentum":
        return torch.optim.SGD(params, lr=case.lr, momentum=0.9, **case.optimizer_kwargs)
    raise ValueError(f"unknown optimizer {case.optimizer!r}")


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (absolute error if b is all zeros)."""
    a, b = a.detach().double(), b.detach().double()
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff / denom if denom > 0 else diff


def train_sharded_and_reference(rank: int, world_size: int, case: Case) -> dict[str, Any]:
    """Rank body: 3 steps on the parallelized model and on the single-device reference."""
    model = case.build_model()
    reference = copy.deepcopy(model)
    x, y = case.make_batch(seed=1)
    cluster = autoplan.Cluster.preset(case.preset, mesh_shape=case.mesh_shape) if case.mesh_shape else autoplan.Cluster.preset(case.preset)
    pm = autoplan.parallelize(
        model,
        cluster,
        example_inputs=(x,),
        loss_fn=case.loss_fn,
        example_targets=(y,),
        pins=dict(case.pins),
        optimizer=case.optimizer,
    )
    opt = _make_optimizer(case, list(pm.parameters()))
    ref_opt = _make_optimizer(case, list(reference.parameters()))

    losses, ref_losses = [], []
    for step in range(NUM_STEPS):
        x, y = case.make_batch(seed=step + 1)
        loss = pm.forward_backward(x, targets=(y,), check=True)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))

        ref_loss = case.loss_fn(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())

    full = pm.full_parameters()
    ref_params = dict(reference.named_parameters())
    return {
        "rank": rank,
        "losses": losses,
        "ref_losses": ref_losses,
        "param_rel_err": {n: _rel_err(full[n], ref_params[n]) for n in full},
        "ref_param_names": sorted(ref_params),
        "param_specs": dict(pm.plan.param_specs),
        "input_specs": pm.plan.input_specs,
        "target_specs": pm.plan.target_specs,
        "parallelism": pm.plan.parallelism(),
        "collectives": pm.plan.collective_counts(),
    }


def run_case(case: Case, world_size: int) -> list[dict[str, Any]]:
    """Run ``case`` on ``world_size`` ranks; return the per-rank results and print the errors."""
    results = run_ranks(train_sharded_and_reference, world_size, case, timeout_s=300)
    worst_loss = max(abs(a - b) / abs(b) for r in results for a, b in zip(r["losses"], r["ref_losses"], strict=True))
    worst_name, worst_param = max(
        ((n, e) for r in results for n, e in r["param_rel_err"].items()), key=lambda item: item[1]
    )
    print(
        f"\n[{case.name}] {world_size} ranks, parallelism={results[0]['parallelism']}, "
        f"collectives={results[0]['collectives']}\n"
        f"  losses={results[0]['losses']}\n"
        f"  max rel loss err={worst_loss:.3e}  max rel param err={worst_param:.3e} ({worst_name})"
    )
    return results


def assert_trains_like_reference(results: list[dict[str, Any]]) -> None:
    """On every rank: equal losses at every step, equal parameters after the last step."""
    for r in results:
        assert set(r["param_rel_err"]) == set(r["ref_param_names"]), "sharded and reference parameter sets differ"
        for step, (loss, ref_loss) in enumerate(zip(r["losses"], r["ref_losses"], strict=True)):
            assert math.isfinite(loss)
            assert loss == pytest.approx(ref_loss, rel=REL_TOL), f"rank {r['rank']} step {step}: loss {loss} != {ref_loss}"
        bad = {n: e for n, e in r["param_rel_err"].items() if not e <= REL_TOL}
        assert not bad, f"rank {r['rank']}: parameters differ from the reference after {NUM_STEPS} steps: {bad}"


def _specs_matching(param_specs: Mapping[str, tuple[str, ...]], pattern: str) -> dict[str, tuple[str, ...]]:
    matched = {n: s for n, s in param_specs.items() if fnmatch.fnmatchcase(n, pattern)}
    assert matched, f"no parameter matches {pattern!r}"
    return matched


def assert_tensor_parallel(result: Mapping[str, Any], patterns: list[str], *, axis: int) -> None:
    """Every parameter matching ``patterns`` is sharded (S(d)) on mesh axis ``axis``."""
    for pattern in patterns:
        for name, spec in _specs_matching(result["param_specs"], pattern).items():
            assert spec[axis].startswith("S("), f"{name} is {spec}, expected sharded on axis {axis}"


def assert_data_parallel(result: Mapping[str, Any], *, axis: int) -> None:
    """The batch (input and target) is split along dim 0 on mesh axis ``axis``."""
    assert result["input_specs"][0][axis] == "S(0)", result["input_specs"]
    assert result["target_specs"][0][axis] == "S(0)", result["target_specs"]


# --- MLP (Adam) ----------------------------------------------------------------------------------


def test_mlp_data_parallel_on_2_ranks_trains_like_single_device():
    case = Case(
        name="mlp-dp-2",
        build_model=models.mlp,
        make_batch=models.mlp_batch,
        loss_fn=models.mse_loss,
        preset="2xCPU",
        mesh_shape=None,
        pins={"input_0": "S(0)", "target_0": "S(0)", "*.weight": "R", "*.bias": "R"},
        optimizer="adam",
        lr=1e-2,
    )
    results = run_case(case, world_size=2)
    result = results[0]

    assert_data_parallel(result, axis=0)
    assert all(spec == ("R",) for spec in result["param_specs"].values()), result["param_specs"]
    assert_trains_like_reference(results)


def test_mlp_tensor_parallel_on_2_ranks_trains_like_single_device():
    # torch Linear weight is (out, in): the first layer column-parallel (S(0)), the second
    # row-parallel (S(1)), so the hidden activation stays sharded between them.
    case = Case(
        name="mlp-tp-2",
        build_model=models.mlp,
        make_batch=models.mlp_batch,
        loss_fn=models.mse_loss,
        preset="2xCPU",
        mesh_shape=None,
        pins={"input_0": "R", "0.weight": "S(0)", "2.weight": "S(1)"},
        optimizer="adam",
        lr=1e-2,
    )
    results = run_case(case, world_size=2)
    result = results[0]

    assert result["input_specs"][0] == ("R",)
    assert result["param_specs"]["0.weight"] == ("S(0)",)
    assert result["param_specs"]["2.weight"] == ("S(1)",)
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
        preset="4xCPU",
        mesh_shape=None,
        pins={"input_0": "S(0)", "target_0": "S(0)"},
        optimizer="sgd_momentum",
        lr=0.1,
    )
    results = run_case(case, world_size=4)
    result = results[0]

    assert_data_parallel(result, axis=0)
    assert_trains_like_reference(results)


def test_gpt2_data_x_tensor_parallel_on_2x2_mesh_trains_like_single_device():
    case = Case(
        name="gpt2-dp-x-tp-2x2",
        build_model=models.gpt2_tiny,
        make_batch=models.token_batch,
        loss_fn=models.lm_loss,
        preset="4xCPU",
        mesh_shape=(2, 2),
        pins={"input_0": "S(0),R", "target_0": "S(0),R"} | {k: f"R,{v}" for k, v in GPT2_TP_PINS.items()},
        optimizer="sgd_momentum",
        lr=0.1,
    )
    results = run_case(case, world_size=4)
    result = results[0]

    assert_data_parallel(result, axis=0)
    assert result["input_specs"][0][1] == "R"
    assert_tensor_parallel(result, list(GPT2_TP_PINS), axis=1)
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


def test_llama_gqa_tensor_parallel_on_2_ranks_trains_like_single_device():
    case = Case(
        name="llama-gqa-tp-2",
        build_model=models.llama_tiny,
        make_batch=models.token_batch,
        loss_fn=models.lm_loss,
        preset="2xCPU",
        mesh_shape=None,
        pins={"input_0": "R", "target_0": "R"} | LLAMA_TP_PINS,
        optimizer="sgd_momentum",
        lr=0.1,
    )
    results = run_case(case, world_size=2)
    result = results[0]

    assert result["input_specs"][0] == ("R",)
    assert_tensor_parallel(result, list(LLAMA_TP_PINS), axis=0)
    assert_trains_like_reference(results)


def test_llama_gqa_data_x_tensor_parallel_on_2x2_mesh_trains_like_single_device():
    case = Case(
        name="llama-gqa-dp-x-tp-2x2",
        build_model=models.llama_tiny,
        make_batch=models.token_batch,
        loss_fn=models.lm_loss,
        preset="4xCPU",
        mesh_shape=(2, 2),
        pins={"input_0": "S(0),R", "target_0": "S(0),R"} | {k: f"R,{v}" for k, v in LLAMA_TP_PINS.items()},
        optimizer="sgd_momentum",
        lr=0.1,
    )
    results = run_case(case, world_size=4)
    result = results[0]

    assert_data_parallel(result, axis=0)
    assert result["input_specs"][0][1] == "R"
    assert_tensor_parallel(result, list(LLAMA_TP_PINS), axis=1)
    assert_trains_like_reference(results)
