"""No field of ``ParallelConfig`` is ignored: changing any one of them changes the estimate.

``sequence_parallel`` was once accepted, saved in every global-batch plan and never read (it
was removed, then came back applied with plan version 2: version-1 plans are refused). The check
below would have caught it: every field of the dataclass must be listed in
``VARIANTS`` with a change of that field alone, and :func:`autoplan.estimate` of the changed
configuration must differ from the base one (step time, memory per device or bubble).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterator

import pytest

import autoplan
from autoplan.api import plan as make_plan
from autoplan.cost_models.config import ParallelConfig
from autoplan.cost_models.errors import ConfigError, PlanFileError
from autoplan.planner import joint
from tests.zoo import gpt2_tiny, lm_loss, mixtral_tiny, token_batch

BASE = ParallelConfig(dp=2, tp=2, pp=2, microbatch_size=1, num_microbatches=4, schedule="1f1b")
"""8 devices (1x8xH100), GPT-2 tiny with 4 blocks."""

VARIANTS: dict[str, dict[str, object]] = {
    # field -> the fields to change; exactly the named field differs from BASE (checked below)
    "dp": {"dp": 4},  # 16 devices
    "tp": {"tp": 4},  # 16 devices, tp inside a node of 8
    "pp": {"pp": 4},  # 16 devices
    "microbatch_size": {"microbatch_size": 2},
    "num_microbatches": {"num_microbatches": 8},
    "schedule": {"schedule": "gpipe"},
    "virtual_stages": {"schedule": "interleaved-1f1b", "virtual_stages": 2},
    "recompute": {"recompute": "full"},
    "zero_stage": {"zero_stage": 3},
    "stage_dp": {"stage_dp": (1, 3), "microbatch_size": 3},
    "offload_optimizer": {"offload_optimizer": True},
    "ep": {"ep": 4, "dp": 4, "tp": 1},  # a mixture of experts (MOE_MODEL), experts split over dp
    "cp": {"cp": 2},  # 16 devices, each replica's 8 tokens split over a cp x tp = 2 x 2 mesh
    "sequence_parallel": {"sequence_parallel": True},  # the tp=2 group's norm/residual activations split
    # ZeRO-3 with 4 micro-batches: the summed gradients held sharded, 4 x the reduce-scatters
    "sharded_grad_accumulation": {"sharded_grad_accumulation": True, "zero_stage": 3},
}
"""Where a field needs another to be valid (``virtual_stages`` needs the interleaved schedule,
``stage_dp=(1, 3)`` needs a micro-batch of 3 samples per replica, ``ep`` equals ``dp`` without
tensor parallelism), the comparison base is BASE with that other field changed too, so the
difference is still the named field's alone. ``ep`` is estimated on a mixture of experts
(:data:`MOE_FIELDS`)."""

MOE_FIELDS = {"ep"}
"""Fields estimated on ``tests.zoo.mixtral_tiny`` (4 experts per layer) instead of GPT-2."""


def _comparison_base(field: str) -> ParallelConfig:
    change = {k: v for k, v in VARIANTS[field].items() if k != field}
    return dataclasses.replace(BASE, **change)  # type: ignore[arg-type]


def test_every_config_field_has_an_effect_check() -> None:
    fields = {f.name for f in dataclasses.fields(ParallelConfig)}
    assert fields == set(VARIANTS), (
        f"ParallelConfig fields without an effect check: {sorted(fields - set(VARIANTS))}; "
        f"checks for fields that do not exist: {sorted(set(VARIANTS) - fields)}"
    )


@functools.cache
def _estimate(config: ParallelConfig, *, moe: bool = False) -> tuple[float, tuple[float, ...], float | None]:
    ids, labels = token_batch(batch=4, seq=8)
    cluster = "1x8xH100" if config.world_size == 8 else f"{config.world_size // 8}x8xH100"
    est = autoplan.estimate(
        mixtral_tiny() if moe else gpt2_tiny(num_layers=4),
        cluster,
        (ids,),
        loss_fn=lm_loss,
        example_targets=(labels,),
        global_batch_size=config.global_batch_size,
        config=config,
    )
    return est.step_time_s, tuple(est.memory_per_device_bytes), est.bubble_s


@pytest.fixture(scope="module")
def _one_cost_model_per_cluster() -> Iterator[None]:
    """Every estimate here is of the same model: trace it and solve each (tp, micro-batch) ILP
    once per cluster (the cost model is deterministic), not once per estimate."""
    made: dict[str, joint.SegmentCostModel] = {}
    real = joint.SegmentCostModel

    def shared(model, inputs, loss_fn, targets, cluster, **kw):  # noqa: ANN001, ANN003, ANN202
        key = type(model).__name__ + json.dumps(cluster.to_dict(), sort_keys=True, default=str)
        if key not in made:
            made[key] = real(model, inputs, loss_fn, targets, cluster, **kw)
        return made[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(joint, "SegmentCostModel", shared)
        yield


@pytest.mark.usefixtures("_one_cost_model_per_cluster")
@pytest.mark.parametrize(
    # dp and ep (an MoE trace) with -m slow: the suite's 15-minute budget
    "field", [pytest.param(f, marks=pytest.mark.slow) if f in ("dp", "ep") else f for f in VARIANTS]
)
def test_changing_one_config_field_changes_the_estimate(field: str) -> None:
    base = _comparison_base(field)
    changed = dataclasses.replace(base, **{field: VARIANTS[field][field]})  # type: ignore[arg-type]
    differing = [
        f.name for f in dataclasses.fields(ParallelConfig) if getattr(base, f.name) != getattr(changed, f.name)
    ]
    assert differing == [field]
    moe = field in MOE_FIELDS
    assert _estimate(changed, moe=moe) != _estimate(base, moe=moe), f"ParallelConfig.{field} does not change the estimate"


# --- sequence_parallel: a field again, applied (plan version 2) ----------------------------------


def test_sequence_parallel_is_an_applied_config_field_and_misspelt_keys_are_refused() -> None:
    """Removed once because it was accepted and never applied; now it is applied (the estimate
    changes: ``VARIANTS``), and an unknown key is still refused, named."""
    cfg = ParallelConfig.from_dict({**BASE.to_dict(), "sequence_parallel": True})
    assert cfg.sequence_parallel and cfg.to_dict()["sequence_parallel"] is True
    with pytest.raises(ConfigError, match=r"unknown ParallelConfig field\(s\) 'pipeline_degree'"):
        ParallelConfig.from_dict({**BASE.to_dict(), "pipeline_degree": 2})


def test_a_plan_file_of_version_1_naming_sequence_parallel_is_refused_by_its_version(tmp_path) -> None:  # noqa: ANN001
    """A plan saved while the field was accepted and ignored (every global-batch plan held
    ``"sequence_parallel": true``) is a PlanFileError asking to re-plan, not a plan that now
    claims a layout its placements do not have."""
    ids, labels = token_batch(batch=4, seq=8)
    plan = make_plan(
        gpt2_tiny(num_layers=2),
        "2xCPU",
        example_inputs=(ids,),
        loss_fn=lm_loss,
        example_targets=(labels,),
        global_batch_size=4,
        config=ParallelConfig(dp=2, microbatch_size=2, num_microbatches=1, schedule="none"),
    )
    data = plan.to_dict()
    assert "sequence_parallel" not in data["config"]
    data["config"]["sequence_parallel"] = True
    data["version"] = 1
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=r"old\.json.*plan version 1.*re-plan"):
        autoplan.Plan.load(path)
