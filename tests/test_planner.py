"""Planner choices on fake meshes (no hardware): what it picks and why, and its bad-input errors."""

from __future__ import annotations

import pytest
import torch

import autoplan
from tests import zoo

pytest.importorskip("transformers")


def _gpt2(n_embd: int, n_layer: int, batch: int, seq: int, vocab: int = 1024):
    """``zoo.gpt2_lm`` with 32 heads (as in ``benchmarks/planning_time.py``) and ``(batch, seq)`` token ids, on ``meta``."""
    with torch.device("meta"):
        model = zoo.gpt2_lm(layers=n_layer, hidden=n_embd, heads=32, vocab=vocab, positions=seq)
        ids = torch.randint(0, vocab, (batch, seq))
    return model, ids


def _block_matrices(plan: autoplan.Plan) -> dict[str, tuple[str, ...]]:
    return {
        n: s for n, s in plan.param_specs.items() if ".h." in n and n.endswith("weight") and ("attn" in n or "mlp" in n)
    }


@pytest.fixture(scope="module")
def big_transformer_plan() -> autoplan.Plan:
    # 3 layers of width 12288: 3 * 12 * 12288^2 = 5.4e9 parameters. Under pure data parallelism
    # each H100 would hold weights + grads + 2 Adam states = 16 B/param = 87 GB > 80 GB.
    model, ids = _gpt2(12288, 3, batch=64, seq=256)
    return autoplan.plan(model, "8x8xH100", example_inputs=(ids,), loss_fn=zoo.lm_loss, example_targets=(ids,))


def test_big_transformer_does_not_fit_under_pure_data_parallelism() -> None:
    model, ids = _gpt2(12288, 3, batch=64, seq=256)
    pins = {"*": "R,R", "input_0": "S(0),S(0)", "target_0": "S(0),S(0)"}
    with pytest.raises(autoplan.InfeasiblePlanError, match=r"GiB per device"):
        autoplan.plan(model, "8x8xH100", example_inputs=(ids,), loss_fn=zoo.lm_loss, example_targets=(ids,), pins=pins)


def test_solver_picks_tensor_parallel_inside_node_and_data_parallel_across_nodes(big_transformer_plan) -> None:
    plan = big_transformer_plan
    assert plan.cluster.mesh_axis_names == ("inter", "intra")
    # data parallel across nodes: gradients are reduced over the inter-node axis, and the batch
    # is not split within a node
    assert plan.parallelism()["inter"].startswith("data"), plan.parallelism()
    assert plan.input_specs[0][1] == "R"
    # tensor parallel inside a node: every attention/MLP weight matrix is sharded on the NVLink axis
    matrices = _block_matrices(plan)
    assert matrices and all(spec[1].startswith("S(") for spec in matrices.values()), matrices
    assert plan.estimate.memory_bytes["total"] <= plan.estimate.capacity_bytes


def test_solver_picks_pure_data_parallel_for_a_small_model() -> None:
    model, ids = _gpt2(256, 2, batch=256, seq=128)
    plan = autoplan.plan(model, "8x8xH100", example_inputs=(ids,), loss_fn=zoo.lm_loss, example_targets=(ids,))
    assert plan.parallelism() == {"inter": "data", "intra": "data"}
    assert all(spec == ("R", "R") for spec in plan.param_specs.values()), plan.param_specs
    # data parallelism communicates only gradient (and loss) all-reduces
    assert set(plan.collective_counts()) == {"all_reduce"}


def test_planning_for_1024_devices_works_on_a_fake_process_group() -> None:
    model, ids = _gpt2(1024, 1, batch=1024, seq=64)
    plan = autoplan.plan(model, "128x8xH100", example_inputs=(ids,), loss_fn=zoo.lm_loss, example_targets=(ids,))
    assert plan.world_size == 1024
    assert plan.cluster.mesh_shape == (128, 8)
    assert plan.input_specs[0][0] == "S(0)"


def test_plan_lists_ops_without_dtensor_strategy_as_replicated_fallback() -> None:
    class Renorm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).renorm(2, 0, 1.0)  # aten.renorm has no DTensor rule

    model = Renorm()
    x = torch.randn(8, 16)
    plan = autoplan.plan(model, "2xCPU", example_inputs=(x,), loss_fn=lambda out: out.square().mean())
    assert "aten.renorm.default" in plan.fallback_ops.values()
    node = next(n for n, op in plan.fallback_ops.items() if op == "aten.renorm.default")
    assert plan.nodes[node]["out"] == [["R"]]
    assert "renorm" in plan.summary()


def test_infeasible_plan_names_needed_and_available_memory() -> None:
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(32768, 32768) for _ in range(4)])
        x = torch.randn(8, 32768)
    with pytest.raises(autoplan.InfeasiblePlanError) as info:
        autoplan.plan(model, "2xCPU", example_inputs=(x,), loss_fn=lambda out: out.mean())
    msg = str(info.value)
    assert "GiB" in msg and "2 devices" in msg and "\n" not in msg


@pytest.mark.slow
def test_cbc_and_highs_find_the_same_optimum() -> None:
    model, ids = _gpt2(256, 1, batch=64, seq=32)
    kwargs = dict(example_inputs=(ids,), loss_fn=zoo.lm_loss, example_targets=(ids,))
    highs = autoplan.plan(model, "2x4xH100", solver="highs", **kwargs)
    cbc = autoplan.plan(model, "2x4xH100", solver="cbc", **kwargs)
    assert cbc.solver["status"] == highs.solver["status"] == "Optimal"
    # both stop at a relative MIP gap of 1e-4 (their default), so optima agree to that tolerance
    assert cbc.solver["objective_s"] == pytest.approx(highs.solver["objective_s"], rel=2e-4)
