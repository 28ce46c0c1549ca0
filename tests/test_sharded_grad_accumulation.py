"""Sharded gradient accumulation (``ParallelConfig.sharded_grad_accumulation``, issue #41): under
ZeRO >= 2 with several micro-batches every micro-batch's backward reduce-scatters its own
gradients into sharded accumulators (FSDP2's default) instead of the last one's reducing the raw
sum. The rule is :func:`autoplan.cost_models.comm_schedule.converting_backwards`; pinned here:

* the configuration: only with ZeRO >= 2 and a schedule that reduces in the backward, recorded in
  the config's dict and text only when set, parsed by ``--config``;
* the price: the gradients summed across micro-batches cost ``G = sum_j T'_j g / dp`` (sharded)
  instead of ``R = sum_j T'_j g`` (raw), and the step carries ``m`` times one backward's
  reduce-scatters;
* the search: tried only where a configuration does not fit without it;
* the program: every micro-batch's backward issues its reduce-scatter buckets, and ZeRO-3 on 2
  gloo ranks trains like the single-device model (ZeRO-2 is priced, not executed: the runtime
  runs ZeRO 0 and 3, ``autoplan.planner.joint.EXECUTABLE_SPACE``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.comm_schedule import converting_backwards
from autoplan.cost_models.config import ParallelConfig
from autoplan.cost_models.errors import ConfigError
from autoplan.cost_models.memory import (
    DRIVER_VISIBLE_FRACTION,
    GB,
    GiB,
    mesh_groups,
    non_pytorch_bytes,
    nvlink_multicast,
)
from autoplan.cost_models.step import evaluate
from autoplan.planner.search import SearchSpace, search
from autoplan.tools.common import config_from_text
from tests.harness import assert_trains_like_reference, run_ranks
from tests.test_step_comm import GPU, ONE_NODE, _costs, _row

SHARDED = {"sharded_grad_accumulation": True}


def _zero(stage: int, **kw: object) -> ParallelConfig:
    base = dict(dp=8, tp=1, pp=1, microbatch_size=1, num_microbatches=4, zero_stage=stage)
    return ParallelConfig(**{**base, **kw})  # type: ignore[arg-type]


# --- the configuration ---------------------------------------------------------------------------


def test_sharded_accumulation_needs_zero_2_or_3() -> None:
    for stage in (0, 1):
        with pytest.raises(ConfigError, match=rf"ZeRO >= 2.*zero_stage={stage}: set zero_stage=2 or 3"):
            _zero(stage, **SHARDED)
    assert _zero(2, **SHARDED).sharded_grad_accumulation and _zero(3, **SHARDED).sharded_grad_accumulation


def test_sharded_accumulation_refuses_zero_bubble_which_reduces_after_the_schedule() -> None:
    with pytest.raises(ConfigError, match=r"'zero-bubble' converts the gradients after the schedule"):
        _zero(3, pp=2, dp=4, schedule="zero-bubble", **SHARDED)
    with pytest.raises(ConfigError, match=r"True or False"):
        _zero(3, sharded_grad_accumulation=1)


def test_sharded_accumulation_is_written_only_when_set_and_round_trips() -> None:
    plain, sharded = _zero(3), _zero(3, **SHARDED)
    assert "sharded_grad_accumulation" not in plain.to_dict() and "grads=" not in str(plain)
    assert sharded.to_dict()["sharded_grad_accumulation"] is True
    assert str(sharded).endswith("zero=3 grads=sharded")
    assert ParallelConfig.from_dict(json.loads(json.dumps(sharded.to_dict()))) == sharded
    schema = json.loads((Path(__file__).parents[1] / "docs" / "plan.schema.json").read_text())
    assert schema["properties"]["config"]["properties"]["sharded_grad_accumulation"] == {"type": "boolean"}
    text = "dp=8,microbatch_size=1,num_microbatches=4,zero_stage=3,sharded_grad_accumulation=true"
    assert config_from_text(text) == sharded
    with pytest.raises(ConfigError, match=r"sharded_grad_accumulation='yes': expected true or false"):
        config_from_text(text.replace("=true", "=yes"))


def test_converting_backwards_is_every_micro_batch_only_when_sharded() -> None:
    assert converting_backwards(num_microbatches=4, sharded_grad_accumulation=False) == 1
    assert converting_backwards(num_microbatches=4, sharded_grad_accumulation=True) == 4


# --- the price -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [2, 3])
def test_sharded_accumulation_holds_the_sum_sharded_instead_of_raw(stage: int) -> None:
    """8 segments of P = 4M fp32 elements, dp = 8, m = 4 (synthetic costs of tests.test_step_comm).
    A later micro-batch's backward holds the earlier ones' sum next to its own gradients:

        raw:     R = sum_j T'_j g      = 8 * 4M * 4 B = 128 MB
        sharded: G = sum_j T'_j g / dp = 16 MB

    and nothing else changes at that peak, so the grads part (and the peak before the allocator's
    5 % margin) drops by exactly R - G."""
    costs = _costs()
    raw_total = sum(s.trainable_numel for s in costs.segments) * 4
    plain = evaluate(_zero(stage), costs, ONE_NODE)
    sharded = evaluate(_zero(stage, **SHARDED), costs, ONE_NODE)
    (before,), (after,) = (e.memory_parts_bytes for e in (plain, sharded))
    assert before["grads"] - after["grads"] == pytest.approx(raw_total - raw_total / 8)
    without_margin = [sum(v for k, v in p.items() if k != "allocator") for p in (before, after)]
    assert without_margin[0] - without_margin[1] == pytest.approx(raw_total - raw_total / 8)
    assert sharded.peak_memory_bytes < plain.peak_memory_bytes


def test_one_micro_batch_prices_the_same_program() -> None:
    costs = _costs()
    one = _zero(3, num_microbatches=1)
    assert evaluate(dataclasses.replace(one, **SHARDED), costs, ONE_NODE) == dataclasses.replace(
        evaluate(one, costs, ONE_NODE), config=dataclasses.replace(one, **SHARDED)
    )


@pytest.mark.parametrize("stage", [2, 3])
def test_sharded_accumulation_runs_m_times_the_reduce_scatters(stage: int) -> None:
    """One stage, m = 4: the default reduces once (the last micro-batch's backward, on the sums);
    sharded accumulation reduces in each of the 4 backwards, each as the last one does today:

        count, bytes, total_s (sharded) = m * those of the default's reduce_scatter row
        step (sharded) - step (default) = (m - 1) * (that backward's contention + exposed tail) > 0"""
    costs, m = _costs(), 4
    plain = evaluate(_zero(stage), costs, ONE_NODE)
    sharded = evaluate(_zero(stage, **SHARDED), costs, ONE_NODE)
    once, every = _row(plain, "reduce_scatter"), _row(sharded, "reduce_scatter")
    assert every.count == m * once.count
    assert every.bytes == pytest.approx(m * once.bytes)
    assert every.total_s == pytest.approx(m * once.total_s)
    assert every.exposed_s == pytest.approx(m * once.exposed_s)
    # the default's sync after the schedule is one backward's (contention + tail) + the rest
    assert sharded.step_time_s > plain.step_time_s
    assert sharded.compute_s == pytest.approx(plain.compute_s)


# --- the search ----------------------------------------------------------------------------------


def _capacity_for(usable_bytes: float) -> int:
    """A GPU's marketed capacity whose usable bytes (memory.usable_memory_bytes) are ``usable_bytes``
    for a rank of dp=8 on the node (its one process group, the world's communicator)."""
    outside = non_pytorch_bytes("cuda", mesh_groups((8,), 8), multicast=nvlink_multicast(GPU))
    return int((usable_bytes + outside) / (GiB * DRIVER_VISIBLE_FRACTION) * GB)


def _search(capacity: int) -> tuple[object, list]:  # type: ignore[type-arg]
    device = dataclasses.replace(GPU, mem_capacity_bytes=capacity)
    cluster = Cluster(num_nodes=1, devices_per_node=8, device=device)
    space = SearchSpace(
        schedules=("1f1b",), recompute=("none",), zero_stages=(3,), offload_optimizer=(False,),
        microbatch_sizes=(1,), context_parallel=(False,), expert_parallel=(False,), hetero_stages=False,
    )  # fmt: skip
    costs = _costs()
    return search(lambda *_: costs, cluster, num_blocks=6, global_batch_size=32, space=space)


def test_search_tries_sharded_accumulation_only_where_the_default_does_not_fit() -> None:
    """dp=8 ZeRO-3 with 4 micro-batches: on a device between its two peaks the search prices that
    configuration with sharded accumulation (and any other only where its default does not fit); on a large one it never prices it (it only adds
    reductions)."""
    costs = _costs()
    big = dataclasses.replace(ONE_NODE, device=dataclasses.replace(GPU, mem_capacity_bytes=80 * GB))
    peaks = [evaluate(_zero(3, **kw), costs, big).peak_memory_bytes for kw in ({}, SHARDED)]
    assert peaks[1] < peaks[0]
    _, every = _search(_capacity_for((peaks[0] + peaks[1]) / 2))
    (dp8,) = [e for e in every if e.config.pp == 1 and e.config.tp == 1]
    assert dp8.config == _zero(3, **SHARDED) and dp8.feasible
    for est in every:
        if est.config.sharded_grad_accumulation:  # only after the default did not fit
            device = dataclasses.replace(GPU, mem_capacity_bytes=_capacity_for((peaks[0] + peaks[1]) / 2))
            cluster = dataclasses.replace(ONE_NODE, device=device)
            plain = dataclasses.replace(est.config, sharded_grad_accumulation=False)
            assert not evaluate(plain, costs, cluster, stage_starts=est.stage_starts).feasible
    _, every = _search(80 * GB)
    assert not any(e.config.sharded_grad_accumulation for e in every)


# --- the program ---------------------------------------------------------------------------------

GLOBAL_BATCH = 8


def _train_counting(rank: int, world_size: int, plan_json: str) -> dict[str, object]:  # noqa: ARG001
    """3 SGD-with-momentum steps of the planned model and of the single-device reference
    (tests.test_pipeline_equivalence's public path), counting the backward programs that issue
    gradient buckets (``DeferredWaits.run_issue_boxed``, which ``run_issue`` and the stage's boxed
    calls both go through: a converting program cut at its last waits)
    and the reduce-scatters each holds."""
    from autoplan.runtime.lowering import REDUCE_SCATTER, DeferredWaits
    from tests.test_pipeline_equivalence import _own_stage_after_a_step, _train_public

    calls = []
    issue = DeferredWaits.run_issue_boxed

    def counting(self: DeferredWaits, local_args: list[object]) -> object:
        calls.append(1)
        return issue(self, local_args)

    DeferredWaits.run_issue_boxed = counting  # type: ignore[method-assign]
    try:
        out = _train_public(rank, world_size, "gpt2_wide", None, plan_json)
    finally:
        DeferredWaits.run_issue_boxed = issue  # type: ignore[method-assign]
    out["converting_runs"] = len(calls)
    stage = _own_stage_after_a_step("gpt2_wide", plan_json)
    out["programs"] = sorted(stage.lowered)
    nodes = stage.lowered["backward"].graph_module.graph.nodes
    out["reduce_scatters"] = sum(1 for n in nodes if n.target is REDUCE_SCATTER)
    return out


def _plan_json(config: ParallelConfig, world_size: int = 2) -> str:
    import autoplan
    from tests import zoo
    from tests.test_pipeline_equivalence import BUILDERS, _batch

    ids, labels = _batch(0)
    plan = autoplan.plan(
        BUILDERS["gpt2_wide"](num_layers=4), f"1x{world_size}xCPU", example_inputs=(ids,), loss_fn=zoo.lm_loss,
        example_targets=(labels,), optimizer="sgd_momentum", global_batch_size=GLOBAL_BATCH, config=config,
    )  # fmt: skip
    assert plan.config == config and plan.to_dict()["config"]["sharded_grad_accumulation"] is True
    return json.dumps(plan.to_dict())


@pytest.mark.slow  # ~100 s each on 2 cores (planning, then two ranks training the model and its reference)
@pytest.mark.parametrize(("pp", "num_microbatches"), [(1, 2), (1, 4), (2, 4)])
def test_zero3_sharded_accumulation_reduce_scatters_every_micro_batch_and_trains_like_single_device(
    pp: int, num_microbatches: int
) -> None:
    """dp=2 ZeRO-3, one stage (or two, 1F1B, 4 ranks), m micro-batches of a GPT-2 of width 128
    (3 MiB of gradients, several buckets): the one backward program (no last-micro-batch variant)
    issues its reduce-scatter buckets in each of the m backwards of each of the 3 steps, and loss
    and parameters equal the single-device fp32 run (elementwise within 1e-5). With two stages the
    tied embedding's gradient is still summed raw and reduced after the schedule."""
    cfg = ParallelConfig(dp=2, pp=pp, microbatch_size=GLOBAL_BATCH // (2 * num_microbatches),
                         num_microbatches=num_microbatches, zero_stage=3, **SHARDED)  # fmt: skip
    results = run_ranks(_train_counting, 2 * pp, _plan_json(cfg, 2 * pp), timeout_s=900)
    assert_trains_like_reference(results, rel_tol=1e-5, atol=1e-6)
    for r in results:
        assert r["programs"] == ["backward", "forward"], r  # no "last_backward": every backward converts
        assert isinstance(r["reduce_scatters"], int) and r["reduce_scatters"] >= 2, r
        assert r["converting_runs"] == 3 * num_microbatches, r  # every backward of the 3 steps
