"""Megatron sequence parallelism on the tensor-parallel axis (``ParallelConfig.sequence_parallel``).

The rule (``autoplan.planner.mesh.restrict_sequence_parallel``): every activation a forward op
makes outside the weight matmuls is split on the ``tp`` axis, so the norm/dropout/residual
regions are held in ``1/tp`` and the ILP converts into and out of the tensor-parallel matmuls
(all-gather, reduce-scatter) instead of all-reducing. The search's ILPs, the stage ILP that
generates the program and the memory of the joint search all follow it; the plan file records
it; the program trains like one device (2 CPU ranks in CI; pipeline stages and a ``cp`` axis with
``-m slow``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import autoplan
from autoplan.cost_models.config import ParallelConfig
from autoplan.cost_models.errors import ConfigError
from tests import zoo
from tests.harness import SeededBatches, assert_trains_like_reference, run_ranks, train_planned_lm

SEQ = 16


def _batches(batch: int, seq: int = SEQ) -> SeededBatches:
    return SeededBatches(zoo.token_batch, {"batch": batch, "seq": seq})


def _model(seq: int = SEQ) -> torch.nn.Module:
    # 4 heads, 2 key/value heads: both split over tp=2; 2 blocks (pp=2 gets one each)
    return zoo.llama_lm(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=zoo.VOCAB, positions=max(seq, 64))


def _plan(cfg: ParallelConfig, *, seq: int = SEQ, device: str = "CPU") -> autoplan.Plan:
    x, y = _batches(cfg.global_batch_size, seq)(0)
    return autoplan.plan(
        _model(seq), f"1x{cfg.world_size}x{device}", example_inputs=(x,), loss_fn=zoo.lm_loss, example_targets=(y,),
        optimizer="sgd_momentum", global_batch_size=cfg.global_batch_size, config=cfg,
    )  # fmt: skip


def test_sequence_parallel_is_a_config_field_that_needs_tensor_parallelism() -> None:
    with pytest.raises(ConfigError, match="sequence_parallel=True needs tp > 1"):
        ParallelConfig(sequence_parallel=True)
    with pytest.raises(ConfigError, match="must be True or False"):
        ParallelConfig(tp=2, sequence_parallel=1)  # type: ignore[arg-type]
    cfg = ParallelConfig(tp=2, sequence_parallel=True)
    assert "sequence_parallel" not in ParallelConfig(tp=2).to_dict()
    assert cfg.to_dict()["sequence_parallel"] is True
    assert ParallelConfig.from_dict(cfg.to_dict()) == cfg
    assert str(cfg).startswith("dp=1 tp=2+sp ")


def test_the_plan_holds_the_norm_and_residual_activations_split_on_tp_and_records_it(tmp_path) -> None:  # noqa: ANN001
    """Without the rule the ILP on this tiny model holds the norms whole on both H100s (a
    replicated region: as fast, since its collectives are latency-bound); with it every one of
    them is split on ``tp``, the plan's estimate holds half the activation bytes at the same step
    time within 1 %, and the plan file keeps the choice (``config.sequence_parallel``), read back
    equal."""
    plain = _plan(ParallelConfig(tp=2, microbatch_size=2), device="H100")
    sp = _plan(ParallelConfig(tp=2, microbatch_size=2, sequence_parallel=True), device="H100")
    norms = [n for n, d in sp.nodes.items() if d["op"] == "autoplan.rms_norm.default"]  # passes/fused_norm.py
    assert len(norms) == 5, norms  # 2 norms per block and the final one
    assert all(sp.nodes[n]["out"][0][-1].startswith("S(") for n in norms), {n: sp.nodes[n] for n in norms}
    assert any(plain.nodes[n]["out"][0][-1] == "R" for n in norms), "the ILP alone already splits them here"
    residual = [n for n, d in sp.nodes.items() if d["op"] == "aten.add.Tensor" and len(d["out"][0]) == 1]
    assert residual and all(sp.nodes[n]["out"][0][-1].startswith("S(") for n in residual)

    def activations(plan: autoplan.Plan) -> float:
        return plan.estimate.memory_bytes["activations"]

    assert activations(sp) < 0.6 * activations(plain)
    assert sp.estimate.step_time_s < 1.01 * plain.estimate.step_time_s
    assert sp.config.sequence_parallel and "sequence_parallel" not in plain.to_dict()["config"]
    path = tmp_path / "sp.json"
    sp.save(path)
    loaded = autoplan.Plan.load(path)
    assert loaded.config == sp.config and json.loads(path.read_text())["config"]["sequence_parallel"] is True


def test_a_version_1_plan_naming_sequence_parallel_is_refused(tmp_path) -> None:  # noqa: ANN001
    """Version-1 plans wrote ``"sequence_parallel": true`` without applying it: read now, the field
    would claim a layout their placements do not have, so the version refuses them."""
    data = _plan(ParallelConfig(tp=2, microbatch_size=2)).to_dict()
    data["version"] = 1
    data["config"]["sequence_parallel"] = True
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    with pytest.raises(autoplan.PlanFileError, match=r"plan version 1.*re-plan"):
        autoplan.Plan.load(path)


def test_the_search_prices_tensor_parallel_candidates_with_sequence_parallelism() -> None:
    x, y = _batches(4)(0)
    plan = autoplan.plan(
        _model(), "1x2xH100", example_inputs=(x,), loss_fn=zoo.lm_loss, example_targets=(y,), global_batch_size=4,
    )  # fmt: skip
    if plan.config.tp > 1:
        assert plan.config.sequence_parallel
    assert all(o.config.sequence_parallel == (o.config.tp > 1) for o in plan.configurations), plan.configurations


def _train(rank: int, world_size: int, plan_json: str, batch: int, seq: int) -> dict[str, Any]:  # noqa: ARG001
    return train_planned_lm(plan_json, _model(seq), _batches(batch, seq))


@pytest.mark.parametrize(
    "cfg",
    [
        ParallelConfig(tp=2, microbatch_size=2, sequence_parallel=True),
        pytest.param(
            ParallelConfig(dp=2, tp=2, microbatch_size=1, zero_stage=3, sequence_parallel=True), marks=pytest.mark.slow
        ),
        pytest.param(
            ParallelConfig(tp=2, pp=2, microbatch_size=1, num_microbatches=2, schedule="gpipe", sequence_parallel=True),
            marks=pytest.mark.slow,
        ),
        pytest.param(ParallelConfig(cp=2, tp=2, microbatch_size=1, sequence_parallel=True), marks=pytest.mark.slow),
    ],
    ids=["tp=2", "dp=2-tp=2-zero3", "tp=2-pp=2", "cp=2-tp=2"],
)
def test_a_sequence_parallel_plan_trains_like_single_device(cfg: ParallelConfig) -> None:
    """3 SGD-momentum steps, fp32: losses and parameters within the harness's 1e-5 of one device."""
    seq = 32 if cfg.cp > 1 else SEQ
    plan = _plan(cfg, seq=seq)
    assert plan.config.sequence_parallel
    results = run_ranks(
        _train, cfg.world_size, json.dumps(plan.to_dict()), cfg.global_batch_size, seq, timeout_s=900
    )  # fmt: skip
    assert_trains_like_reference(results)
