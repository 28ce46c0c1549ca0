"""The plan as a file (Python API): round trip, determinism, malformed files, mismatch checks, pins.

The ``mlp`` of ``tests/cli_models.py`` is planned once for ``2xCPU`` on the meta device.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import autoplan
from autoplan.passes.trace import trace_training_step
from autoplan.planner.plan import CollectiveRecord, comm_totals, exposed_within_own_time
from tests import zoo

SOLVER_TIMING_KEYS = ("solve_time_s", "plan_time_s")
"""Wall-clock fields under "solver": the only parts of a plan that may differ between two runs."""


@pytest.fixture(scope="module")
def mlp_plan() -> autoplan.Plan:
    return zoo.plan_workload(zoo.on_meta(zoo.cli_mlp))


@pytest.fixture()
def plan_dict(mlp_plan) -> dict:
    return json.loads(json.dumps(mlp_plan.to_dict()))


# --- round trip and determinism ------------------------------------------------------------------


def test_save_then_load_gives_an_equal_plan(mlp_plan, tmp_path):
    mlp_plan.save(tmp_path / "plan.json")

    loaded = autoplan.Plan.load(tmp_path / "plan.json")

    assert loaded.to_dict() == mlp_plan.to_dict()
    assert loaded.summary() == mlp_plan.summary()
    assert loaded.world_size == 2


def test_saving_twice_writes_identical_bytes(mlp_plan, tmp_path):
    mlp_plan.save(tmp_path / "a.json")
    mlp_plan.save(tmp_path / "b.json")

    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json"]  # no temporary files left


def test_planning_twice_gives_identical_json_and_timings_only_on_request(mlp_plan):
    again = zoo.plan_workload(zoo.on_meta(zoo.cli_mlp))

    assert json.dumps(mlp_plan.to_dict(), indent=1) == json.dumps(again.to_dict(), indent=1)
    assert set(mlp_plan.to_dict(timings=True)["solver"]) - set(mlp_plan.to_dict()["solver"]) == set(SOLVER_TIMING_KEYS)
    assert set(SOLVER_TIMING_KEYS) <= set(mlp_plan.solver)  # measured, kept in memory


@pytest.mark.parametrize(
    "extra",
    [[], ["--global-batch-size", "8", "--config", "dp=1,pp=2,microbatch_size=2,num_microbatches=4"]],
    ids=["ilp", "pipeline"],
)
@pytest.mark.slow
def test_two_processes_write_byte_identical_plan_files(tmp_path, extra):  # noqa: ANN001
    """Determinism across processes (fixed solver seed, canonical strategy order, no wall-clock
    values in the file); the plan cache is off so both processes really plan."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "AUTOPLAN_NO_PLAN_CACHE": "1"}
    target = f"{Path(__file__).resolve().with_name('cli_models.py')}:gpt2_4_layers"
    outs = []
    for name in ("a.json", "b.json"):
        cmd = [
            sys.executable,
            "-m",
            "autoplan.tools.cli",
            "plan",
            target,
            "--cluster",
            "2xCPU",
            "-o",
            str(tmp_path / name),
            "-q",
        ]
        subprocess.run(cmd + extra, check=True, env=env, cwd=Path(__file__).parent.parent, timeout=600)
        outs.append((tmp_path / name).read_bytes())
    assert outs[0] == outs[1]


# --- malformed plan files --------------------------------------------------------------------------


def test_load_of_truncated_json_names_the_file(mlp_plan, tmp_path):
    path = tmp_path / "truncated_plan.json"
    mlp_plan.save(path)
    text = path.read_text()
    path.write_text(text[: len(text) // 3])

    with pytest.raises(autoplan.PlanFileError, match="truncated_plan.json") as info:
        autoplan.Plan.load(path)
    assert "JSON" in str(info.value)


def _write(tmp_path: Path, name: str, data: object) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_load_of_another_format_names_the_file(plan_dict, tmp_path):
    plan_dict["format"] = "someone.else"
    path = _write(tmp_path, "other_format.json", plan_dict)

    with pytest.raises(autoplan.PlanFileError, match="other_format.json.*autoplan.plan"):
        autoplan.Plan.load(path)


def test_load_of_another_version_names_the_file_and_the_version(plan_dict, tmp_path):
    plan_dict["version"] = 3
    path = _write(tmp_path, "v3_plan.json", plan_dict)

    with pytest.raises(autoplan.PlanFileError, match="v3_plan.json.*version 3"):
        autoplan.Plan.load(path)


@pytest.mark.parametrize("key", ["fingerprint", "cluster", "placements", "estimate", "nodes"])
def test_load_with_a_missing_key_names_the_file_and_the_key(key, plan_dict, tmp_path):
    del plan_dict[key]
    path = _write(tmp_path, "missing_key.json", plan_dict)

    with pytest.raises(autoplan.PlanFileError, match="missing_key.json") as info:
        autoplan.Plan.load(path)
    assert key in str(info.value)


def test_load_of_a_missing_file_names_it(tmp_path):
    with pytest.raises(autoplan.PlanFileError, match="no_such_plan.json"):
        autoplan.Plan.load(tmp_path / "no_such_plan.json")


# --- a plan applies to one model and one world size ---------------------------------------------


def test_plan_for_another_world_size_names_both_sizes(mlp_plan):
    with pytest.raises(autoplan.PlanMismatchError, match=r"2 devices.*\b4\b"):
        mlp_plan.check_applies_to(fingerprint=mlp_plan.fingerprint, world_size=4)


def test_plan_for_another_model_names_both_fingerprints(mlp_plan):
    wide = zoo.on_meta(zoo.cli_mlp_wide)
    other = trace_training_step(
        wide.model, wide.example_inputs, loss_fn=wide.loss_fn, example_targets=wide.example_targets
    ).fingerprint
    assert other != mlp_plan.fingerprint

    with pytest.raises(autoplan.PlanMismatchError) as info:
        mlp_plan.check_applies_to(fingerprint=other, world_size=2)
    assert mlp_plan.fingerprint in str(info.value)
    assert other in str(info.value)


def test_plan_applies_to_its_own_model_and_world_size(mlp_plan):
    mlp_plan.check_applies_to(fingerprint=mlp_plan.fingerprint, world_size=2)


# --- pins ------------------------------------------------------------------------------------------


def test_pinning_input_0_to_batch_sharding_is_obeyed():
    plan = zoo.plan_workload(zoo.on_meta(zoo.cli_mlp), pins={"input_0": "S(0)"})

    assert plan.input_specs[0] == ("S(0)",)


@pytest.mark.parametrize(
    "pins, message",
    [
        ({"no_such_layer.*": "R"}, "matches no parameter or input"),
        ({"input_7": "R"}, "matches no parameter or input"),
        ({"input_0": "S(x)"}, "malformed"),
        ({"input_0": "R,R"}, "2 placements but the mesh has 1 axes"),
    ],
    ids=["unmatched_glob", "unmatched_input", "malformed_spec", "too_many_axes"],
)
def test_bad_pin_raises_plan_error_naming_the_pin(pins, message):
    with pytest.raises(autoplan.PlanError, match=message) as info:
        zoo.plan_workload(zoo.on_meta(zoo.cli_mlp), pins=pins)
    assert repr(next(iter(pins))) in str(info.value)


# --- infeasible ------------------------------------------------------------------------------------


def test_model_that_cannot_fit_raises_infeasible_plan_error_in_gib():
    with pytest.raises(autoplan.InfeasiblePlanError, match="GiB") as info:
        zoo.plan_workload(zoo.on_meta(zoo.huge))
    assert "2 devices" in str(info.value)


# --- communication per kind and axis (issue #19: the review numbers agree with themselves) --------


def _record(kind: str, time_s: float, exposed_s: float, *, overlappable: bool, consumer: str) -> CollectiveRecord:
    return CollectiveRecord(
        producer="x", consumer=consumer, arg_index=0 if not overlappable else -1, src=("S(0)",), dst=("R",),
        steps=((kind, 0),), time_s=time_s, overlappable=overlappable, exposed_s=exposed_s,
    )  # fmt: skip


def test_a_wait_behind_an_earlier_reduction_is_charged_to_that_reduction_not_the_gather():
    # the replay: a 5 ms gradient reduce-scatter is issued, then a 1 ms all-gather is needed at once;
    # the compute stream waits 4 ms for the gather (3 ms of them queued behind the reduce-scatter)
    records = [
        _record("reduce_scatter", 5e-3, 0.0, overlappable=True, consumer="p_w"),
        _record("all_gather", 1e-3, 4e-3, overlappable=False, consumer="mm"),
    ]

    exposed = exposed_within_own_time(records)
    totals = comm_totals(records, ("dp",))

    assert exposed == pytest.approx((3e-3, 1e-3))
    assert [(r.kind, r.total_s, r.exposed_s) for r in totals.rows] == [
        ("all_gather", 1e-3, pytest.approx(1e-3)),
        ("reduce_scatter", 5e-3, pytest.approx(3e-3)),
    ]
    assert totals.exposed_s == pytest.approx(4e-3)  # the replay's wait, all of it


def test_an_exposure_no_collective_can_carry_is_refused_not_clamped():
    records = [_record("all_gather", 1e-3, 4e-3, overlappable=False, consumer="mm")]  # waits for nothing else

    with pytest.raises(ValueError, match="exposed"):
        comm_totals(records, ("dp",))


def test_plan_file_has_the_step_communication_per_kind_and_axis_summing_to_the_estimate():
    gpt2 = zoo.plan_workload(zoo.on_meta(zoo.gpt2_4_layers), autoplan.Cluster.preset("4xCPU", mesh_shape=(2, 2)))
    d = json.loads(json.dumps(gpt2.to_dict()))
    est = d["estimate"]

    assert {r["axis"] for r in est["comm"]} <= {"intra0", "intra1"} and est["comm"]
    assert sum(r["total_s"] for r in est["comm"]) == pytest.approx(est["comm_s"])
    assert sum(r["exposed_s"] for r in est["comm"]) == pytest.approx(est["exposed_comm_s"])
    assert all(0 <= r["exposed_s"] <= r["total_s"] for r in est["comm"])
    assert autoplan.Plan.from_dict(d).estimate.comm == gpt2.estimate.comm


def test_plan_file_without_the_communication_rows_still_loads(plan_dict):
    del plan_dict["estimate"]["comm"]  # written before issue #19

    plan = autoplan.Plan.from_dict(plan_dict)

    assert plan.estimate.comm.rows == ()
    assert plan.estimate.comm_s == plan_dict["estimate"]["comm_s"]


def test_a_communication_row_exposing_more_than_its_total_is_a_malformed_plan_file(plan_dict):
    plan_dict["estimate"]["comm"] = [
        {"kind": "all_gather", "axis": "intra", "count": 1, "bytes": 8.0, "total_s": 1e-3, "exposed_s": 2e-3}
    ]

    with pytest.raises(autoplan.PlanFileError, match="malformed.*exposed"):
        autoplan.Plan.from_dict(plan_dict, where="plan file 'hand_edited.json'")


def test_summary_shows_the_memory_parts_the_estimate_has_and_they_add_up() -> None:
    """The summary's memory line lists the estimate's own parts (a pipeline plan's stage parts,
    the per-operator ILP's liveness parts; ``Estimate.memory_parts``, as ``show``), never a part it
    lacks as 0, and they sum to the peak."""
    import re

    golden = Path(__file__).resolve().parent / "golden" / "plans"
    for name in ("gpt2_tiny.pipeline_4xcpu", "gpt2_tiny.2x2"):
        plan = autoplan.Plan.load(golden / f"{name}.plan.json")
        line = next(x for x in plan.summary().splitlines() if "peak memory per device" in x)
        unit = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
        found = re.findall(r"(\w+) (\d+\.\d+) ([KMG]iB)(?:,|\))", line.split("(", 1)[1])
        shown = {k: float(v) * unit[u] for k, v, u in found}
        parts = {k for k in plan.estimate.memory_bytes if k != "total"}
        assert set(shown) - {"other"} == parts, (name, line)
        total = plan.estimate.memory_bytes["total"]
        slack = sum(0.005 * unit[u] if u != "KiB" else 0.05 * unit[u] for _, _, u in found)  # the printed digits
        assert abs(sum(shown.values()) - total) <= slack, (name, line)
