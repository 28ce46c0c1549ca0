"""The bad-input catalogue (``docs/errors.md``): one test per row, in the row's order.

Every bad input must raise a typed :class:`autoplan.PlanError` subclass in the Python API with a
one-line message naming the problem and the fix; in the CLI (``autoplan.tools.cli.main``, run in
process) it must return exit code 2 with exactly one stderr line ``autoplan: error: ...``, no
traceback, and no partially written ``--out`` file. The last test checks that plan, profile and
cluster files are read as data only (no pickle, eval or unsafe YAML anywhere in the packages).

Models are the tiny ones of ``tests/zoo.py`` (named ``tests/cli_models.py:...`` on the command line)
on the ``meta`` device and meshes have 2 devices (4 where a mismatch needs it), so the whole file
runs in well under a minute.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch import nn

import autoplan
from autoplan.cost_models.errors import ProfileError
from autoplan.cost_models.profile_db import DeviceKey, ProfileDB, default_db_path
from autoplan.tools.cli import main
from tests import zoo

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS = Path(__file__).resolve().with_name("cli_models.py")
ERROR_PREFIX = "autoplan: error: "

# --- helpers ---------------------------------------------------------------------------------------


def one_line(info: pytest.ExceptionInfo[BaseException], *fragments: str) -> str:
    """The exception's message: one line containing every fragment."""
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def cli(capfd: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    """``autoplan ARGV`` in process: (exit code, stdout, stderr)."""
    rc = main([str(a) for a in argv])
    out, err = capfd.readouterr()
    return rc, out, err


def assert_bad_input(result: tuple[int, str, str], *fragments: str) -> str:
    """Exit code 2, stderr exactly one ``autoplan: error:`` line holding every fragment, no traceback."""
    rc, _out, err = result
    assert rc == 2, f"exit code {rc}\nstderr:\n{err}"
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIX), f"expected one error line, got:\n{err}"
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


def target(name: str) -> str:
    return f"{MODELS}:{name}"


@contextlib.contextmanager
def fake_job(world_size: int) -> Iterator[None]:
    """This process as rank 0 of a ``world_size``-rank job on the fake backend (nothing is sent)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Profiles and plan caches of one test never leak into another."""
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def mlp_plan() -> autoplan.Plan:
    """``zoo.cli_mlp`` planned for 2xCPU (SGD, as its Workload says)."""
    return zoo.plan_workload(zoo.on_meta(zoo.cli_mlp))


@pytest.fixture()
def plan_file(mlp_plan: autoplan.Plan, tmp_path: Path) -> Path:
    path = tmp_path / "plan.json"
    mlp_plan.save(path)
    return path


BAD_TARGETS = """
import torch
import torch.nn.functional as F
from torch import nn

import autoplan

NOT_A_FUNCTION = 3


def wrong_type():
    return nn.Linear(16, 8)


def raises():
    raise FileNotFoundError("data/train.bin")


def _workload(model, inputs, targets=(), loss_fn=F.mse_loss, optimizer="adam"):
    return autoplan.Workload(
        model=model, example_inputs=inputs, loss_fn=loss_fn, example_targets=targets, optimizer=optimizer
    )


def no_inputs():
    return _workload(nn.Linear(16, 8), (), (torch.randn(8, 8),))


def no_loss():
    return _workload(nn.Linear(16, 8), (torch.randn(8, 16),), loss_fn=None)


def missing_targets():
    return _workload(nn.Linear(16, 8), (torch.randn(8, 16),))


def shape_mismatch():
    return _workload(nn.Linear(16, 8), (torch.randn(8, 10),), (torch.randn(8, 8),))


def bad_optimizer():
    return _workload(nn.Linear(16, 8), (torch.randn(8, 16),), (torch.randn(8, 8),), optimizer="lion")


def no_trainable():
    return _workload(nn.Linear(16, 8).requires_grad_(False), (torch.randn(8, 16),), (torch.randn(8, 8),))
"""


@pytest.fixture(scope="module")
def bad_targets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A build-function file with one broken ``FUNCTION`` per way a target can be wrong."""
    path = tmp_path_factory.mktemp("targets") / "bad_targets.py"
    path.write_text(BAD_TARGETS)
    (path.parent / "broken_import.py").write_text("import torch\n\nthis is not python\n")
    return path


# === Python API ====================================================================================

# --- the model ---------------------------------------------------------------------------------------


def test_data_dependent_control_flow_names_the_user_line_and_torch_cond():
    wl = zoo.on_meta(zoo.data_dependent)

    with pytest.raises(autoplan.UnsupportedModelError) as info:
        zoo.plan_workload(wl)

    one_line(info, "torch.export could not trace", "zoo.py:", "if x.sum() > 0", "torch.cond")


def test_model_failing_on_its_example_inputs_asks_to_run_it_eagerly():
    x, y = torch.randn(8, 10), torch.randn(8, 8)  # Linear(16, 8) gets 10 features

    with pytest.raises(autoplan.UnsupportedModelError) as info:
        autoplan.plan(nn.Linear(16, 8), "2xCPU", example_inputs=(x,), loss_fn=F.mse_loss, example_targets=(y,))

    message = one_line(info, "torch.export could not trace", "[8, 10]", "runs eagerly")
    assert "data-dependent" not in message  # not the control-flow advice


def test_model_returning_a_non_scalar_without_loss_fn_asks_for_a_loss():
    with pytest.raises(autoplan.UnsupportedModelError) as info:
        autoplan.plan(nn.Linear(16, 8), "2xCPU", example_inputs=(torch.randn(8, 16),))

    one_line(info, "loss must be a scalar", "shape (8, 8)", "loss_fn=")


def test_loss_fn_missing_its_targets_names_example_targets():
    with pytest.raises(autoplan.UnsupportedModelError) as info:
        autoplan.plan(nn.Linear(16, 8), "2xCPU", example_inputs=(torch.randn(8, 16),), loss_fn=F.mse_loss)

    one_line(info, "loss_fn mse_loss", "'target'", "example_targets")


@pytest.mark.parametrize("inputs", [(), None, torch.randn(8, 16)], ids=["empty", "none", "bare_tensor"])
def test_missing_example_inputs_asks_for_a_tuple_of_tensors(inputs):
    with pytest.raises(autoplan.UnsupportedModelError) as info:
        autoplan.plan(nn.Linear(16, 8), "2xCPU", example_inputs=inputs, loss_fn=lambda out: out.mean())

    one_line(info, "example_inputs is missing", "example_inputs=(")


def test_more_example_inputs_than_forward_takes_is_named():
    x = torch.randn(8, 16)

    with pytest.raises(autoplan.UnsupportedModelError) as info:
        autoplan.plan(nn.Linear(16, 8), "2xCPU", example_inputs=(x, x), loss_fn=lambda out: out.mean())

    one_line(info, "Linear.forward cannot be called with 2", "one example tensor per forward argument")


def test_non_tensor_example_input_asks_to_wrap_it():
    with pytest.raises(autoplan.UnsupportedModelError) as info:
        autoplan.plan(nn.Linear(16, 8), "2xCPU", example_inputs=(3,), loss_fn=lambda out: out.mean())

    one_line(info, "#0 has type int", "torch.tensor")


def test_model_that_is_not_a_module_asks_to_wrap_it():
    with pytest.raises(autoplan.UnsupportedModelError) as info:
        autoplan.plan(lambda x: x, "2xCPU", example_inputs=(torch.randn(8, 16),), loss_fn=lambda out: out.mean())  # type: ignore[arg-type]

    one_line(info, "torch.nn.Module, got function", "wrap")


def test_parameter_without_gradient_asks_to_freeze_it():
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(16, 8), nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    with pytest.raises(autoplan.UnsupportedModelError) as info:
        autoplan.plan(Unused(), "2xCPU", example_inputs=(torch.randn(8, 16),), loss_fn=lambda out: out.mean())

    one_line(info, "'unused.weight'", "requires_grad_(False)")


def test_op_without_dtensor_strategy_is_not_an_error_it_runs_replicated_and_is_listed():
    class Renorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).renorm(2, 0, 1.0)  # aten.renorm has no DTensor strategy

    plan = autoplan.plan(Renorm(), "2xCPU", example_inputs=(torch.randn(8, 16),), loss_fn=lambda out: out.mean())

    (node,) = [n for n, op in plan.fallback_ops.items() if op == "aten.renorm.default"]
    assert plan.nodes[node]["out"] == [["R"]]
    assert "replicated fallback ops (no DTensor strategy): " in plan.summary()


# --- sizes and configurations ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "fix"),
    [("dp", 0, "use 1 for no data parallelism"), ("tp", -1, "use 1"), ("microbatch_size", 0, "samples")],
    ids=["dp_zero", "tp_negative", "microbatch_size_zero"],
)
def test_zero_or_negative_parallel_degree_names_field_and_fix(field, value, fix):
    with pytest.raises(autoplan.ConfigError) as info:
        autoplan.ParallelConfig(**{field: value})

    one_line(info, f"ParallelConfig.{field} must be a positive integer, got {value}", fix)


@pytest.mark.parametrize("global_batch_size", [0, -4])
def test_zero_or_negative_global_batch_size_is_a_config_error(global_batch_size):
    with pytest.raises(autoplan.ConfigError) as info:
        zoo.plan_workload(zoo.on_meta(zoo.cli_mlp), global_batch_size=global_batch_size)

    one_line(info, "global_batch_size must be a positive integer", f"got {global_batch_size}")


def test_global_batch_not_divisible_by_the_configured_split_names_the_product():
    config = autoplan.ParallelConfig(dp=2)  # 2 replicas x 1 sample x 1 micro-batch = 2 != 3

    with pytest.raises(autoplan.ConfigError) as info:
        zoo.plan_workload(zoo.on_meta(zoo.cli_mlp), global_batch_size=3, config=config)

    one_line(info, "= 2*1*1 = 2 but global_batch_size is 3", "make them equal")


def test_batch_smaller_than_the_ranks_a_pin_splits_it_over_names_shape_and_mesh():
    x, y = torch.randn(1, 16), torch.randn(1, 8)  # batch 1 cannot be split over 2 ranks

    with pytest.raises(autoplan.PlanError) as info:
        autoplan.plan(
            nn.Linear(16, 8), "2xCPU", example_inputs=(x,), loss_fn=F.mse_loss, example_targets=(y,),
            pins={"input_0": "S(0)"},
        )  # fmt: skip

    one_line(info, "S(0) is not a valid layout for input_0 of shape (1, 16) on mesh (2,)", "'R'")


def test_config_without_global_batch_size_asks_for_both():
    with pytest.raises(autoplan.ConfigError) as info:
        zoo.plan_workload(zoo.on_meta(zoo.cli_mlp), config=autoplan.ParallelConfig(dp=2))

    one_line(info, "config= needs global_batch_size=")


# --- the cluster -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: autoplan.Cluster.preset("0xH100"),
        lambda: autoplan.Cluster.preset("0x8xH100"),
        lambda: autoplan.Cluster(num_nodes=1, devices_per_node=-2, device="CPU"),
        lambda: autoplan.Cluster.preset("2xCPU", mesh_shape=(0, 2)),
    ],
    ids=["0xH100", "0x8xH100", "negative_devices", "zero_mesh_axis"],
)
def test_zero_or_negative_cluster_sizes_are_cluster_spec_errors(make):
    with pytest.raises(autoplan.ClusterSpecError) as info:
        make()

    one_line(info, "positive integer")


def test_unknown_device_lists_the_catalog():
    with pytest.raises(autoplan.UnknownDeviceError) as info:
        autoplan.Cluster.preset("4xH900")

    one_line(info, "unknown device 'H900'", "H100", "cost_models/hardware.py")


def test_cluster_of_the_wrong_type_names_the_accepted_forms():
    with pytest.raises(autoplan.ClusterSpecError) as info:
        zoo.plan_workload(zoo.on_meta(zoo.cli_mlp), cluster=4)

    one_line(info, "got int 4", "'4xCPU'")


CLUSTER_FILES = {
    "truncated_yaml": ("c.yaml", "num_nodes: 1\ndevices_per_node: 2\ndevice: [CP", "not valid YAML"),
    "tab_indented_yaml": ("c.yaml", "num_nodes: 1\n\tdevices_per_node: 2\ndevice: CPU\n", "not valid YAML"),
    "truncated_json": ("c.json", '{"num_nodes": 1, "devices_per_node": 2, "dev', "not valid JSON"),
    "empty": ("c.yaml", "", "is empty"),
    "not_a_mapping": ("c.yaml", "- 1\n- 2\n", "expected a mapping"),
    "unknown_key": ("c.yaml", "num_nodes: 1\ndevices_per_node: 2\ndevice: CPU\nversion: 2\n", "unknown key 'version'"),
    "zero_devices": ("c.yaml", "num_nodes: 1\ndevices_per_node: 0\ndevice: CPU\n", "positive integer"),
    "unknown_device": ("c.yaml", "num_nodes: 1\ndevices_per_node: 2\ndevice: H900\n", "unknown device 'H900'"),
    "wrong_extension": ("c.txt", "num_nodes: 1\n", "use .yaml, .yml or .json"),
    "not_utf8": ("c.yaml", b"\xff\xfe garbage", "UTF-8"),
    "missing": ("absent.yaml", None, "does not exist"),
}


@pytest.mark.parametrize("case", list(CLUSTER_FILES))
def test_malformed_cluster_file_names_the_file_and_the_problem(case, tmp_path):
    name, content, fragment = CLUSTER_FILES[case]
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)

    with pytest.raises(autoplan.ClusterSpecError) as info:
        autoplan.Cluster.from_file(path)

    one_line(info, name, fragment)


def test_cluster_profile_calibrated_with_another_torch_version_asks_to_recalibrate(tmp_path):
    data = autoplan.Cluster.preset("2xCPU").to_dict()
    data["calibration"] = {
        "device": "CPU", "device_model": "Some CPU", "torch_version": "1.13.1", "backend": "gloo",
        "world_size": 2, "date": "2024-01-01T00:00:00", "num_samples": 10, "fit_err_median": 0.01,
    }  # fmt: skip
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(data))

    with pytest.raises(autoplan.ClusterSpecError) as info:
        autoplan.Cluster.from_file(path)

    one_line(info, "old.yaml", "torch 1.13.1", "autoplan calibrate")


# --- plan files and applying a plan -----------------------------------------------------------------


def _edit_plan(data: dict, case: str) -> dict:
    if case == "wrong_format":
        data["format"] = "someone.else"
    elif case == "wrong_version":
        data["version"] = 99
    elif case == "missing_key":
        del data["fingerprint"]
    elif case == "bad_placement":
        data["placements"]["inputs"] = [["Q"]]
    elif case == "placement_for_another_mesh":
        data["placements"]["inputs"] = [["S(0)", "R"]]  # two placements, the mesh has one axis
    elif case == "bad_cluster":
        data["cluster"]["devices_per_node"] = 0
    return data


PLAN_FILES = {
    "truncated": "not valid JSON",
    "binary": "not a UTF-8 JSON file",
    "wrong_format": 'not an autoplan plan (missing "format": "autoplan.plan")',
    "wrong_version": "version 99",
    "missing_key": "'fingerprint'",
    "bad_placement": "placement 'Q' is malformed",
    "placement_for_another_mesh": "2 placement(s) for a 1-axis mesh",
    "bad_cluster": "devices_per_node must be a positive integer",
    "missing": "does not exist",
}


@pytest.mark.parametrize("case", list(PLAN_FILES))
def test_malformed_plan_file_names_the_file_and_the_problem(case, plan_file):
    text = plan_file.read_text()
    if case == "truncated":
        plan_file.write_text(text[: len(text) // 2])
    elif case == "binary":
        plan_file.write_bytes(b"\x80\x04\x95\x00\x00\x00")  # e.g. the start of a pickle
    elif case == "missing":
        plan_file.unlink()
    else:
        plan_file.write_text(json.dumps(_edit_plan(json.loads(text), case)))

    with pytest.raises(autoplan.PlanFileError) as info:
        autoplan.Plan.load(plan_file)

    one_line(info, "plan.json", PLAN_FILES[case])


def test_plan_for_another_model_at_parallelize_names_both_fingerprints(mlp_plan):
    wide = zoo.cli_mlp_wide()  # same structure, other sizes: another fingerprint

    with fake_job(2), pytest.raises(autoplan.PlanMismatchError) as info:
        autoplan.parallelize(
            wide.model, mlp_plan.cluster, example_inputs=wide.example_inputs, loss_fn=wide.loss_fn,
            example_targets=wide.example_targets, plan=mlp_plan,
        )  # fmt: skip

    one_line(info, mlp_plan.fingerprint, "re-plan")


def test_parallelize_in_a_job_of_another_size_names_both_sizes(mlp_plan):
    wl = zoo.cli_mlp()

    with fake_job(4), pytest.raises(autoplan.PlanMismatchError) as info:
        autoplan.parallelize(
            wl.model, mlp_plan.cluster, example_inputs=wl.example_inputs, loss_fn=wl.loss_fn,
            example_targets=wl.example_targets, plan=mlp_plan,
        )  # fmt: skip

    one_line(info, "the job has 4 ranks but the plan is for 2 devices", "--nproc-per-node=2")


def test_parallelize_without_a_process_group_asks_for_torchrun(mlp_plan):
    wl = zoo.cli_mlp()

    with pytest.raises(autoplan.PlanMismatchError) as info:
        autoplan.parallelize(wl.model, "2xCPU", example_inputs=wl.example_inputs, loss_fn=wl.loss_fn, plan=mlp_plan)

    one_line(info, "needs a process group", "torchrun")


def test_a_plan_given_where_the_cluster_goes_names_plan_and_stays_short(mlp_plan):
    """Once: ``parallelize(model, plan)`` raised a ClusterSpecError whose message held the
    plan's whole repr (248,000 characters)."""
    wl = zoo.cli_mlp()
    with fake_job(2), pytest.raises(autoplan.ClusterSpecError) as info:
        autoplan.parallelize(wl.model, mlp_plan, example_inputs=wl.example_inputs, loss_fn=wl.loss_fn)  # type: ignore[arg-type]
    one_line(info, "got a Plan: pass the plan as plan=", "plan.cluster, plan=plan")
    assert len(str(info.value)) < 300
    with pytest.raises(autoplan.ClusterSpecError) as other:
        autoplan.plan(wl.model, ["x" * 10_000], example_inputs=wl.example_inputs, loss_fn=wl.loss_fn)  # type: ignore[arg-type]
    assert "got list ['xxxx" in str(other.value) and len(str(other.value)) < 300


def test_planning_inside_a_job_of_another_size_names_both_sizes():
    with fake_job(4), pytest.raises(autoplan.PlanMismatchError) as info:
        zoo.plan_workload(zoo.on_meta(zoo.cli_mlp))

    one_line(info, "cannot plan for 2 devices inside a 4-rank job", "outside torchrun")


# --- memory and the solver ------------------------------------------------------------------------------


@pytest.mark.parametrize("global_batch_size", [None, 8], ids=["ilp", "joint_search"])
def test_model_that_cannot_fit_names_the_memory_needed_and_the_fixes(global_batch_size):
    with pytest.raises(autoplan.InfeasiblePlanError) as info:
        zoo.plan_workload(zoo.on_meta(zoo.huge), global_batch_size=global_batch_size)

    one_line(info, "GiB", "devices")


def test_solver_stopped_before_any_feasible_plan_raises_infeasible_plan_error(monkeypatch):
    import dataclasses

    from autoplan.planner import solver

    # HiGHS with no time at all stops before it finds any solution, like a big ILP at its time
    # limit; through the public API a tiny time_limit_s cannot do this (the MIP gets >= 1 s)
    real = solver._solve_highs  # noqa: SLF001

    def no_time(model, options, **kwargs):  # noqa: ANN001, ANN003, ANN202
        return real(model, dataclasses.replace(options, time_limit_s=0.0), **kwargs)

    monkeypatch.setattr(solver, "_solve_highs", no_time)

    with pytest.raises(autoplan.InfeasiblePlanError) as info:
        zoo.plan_workload(zoo.on_meta(zoo.cli_mlp))

    one_line(info, "without a feasible plan", "time limit", "--time-limit")
    assert "GiB" not in str(info.value)  # not mistaken for a memory shortfall


def test_tiny_time_limit_still_gives_a_plan():
    plan = zoo.plan_workload(zoo.on_meta(zoo.cli_mlp), time_limit_s=1e-3)

    assert plan.world_size == 2


@pytest.mark.parametrize("time_limit_s", [0, -1.0, float("nan")])
def test_zero_or_negative_time_limit_is_a_plan_error(time_limit_s):
    with pytest.raises(autoplan.PlanError) as info:
        zoo.plan_workload(zoo.on_meta(zoo.cli_mlp), time_limit_s=time_limit_s)

    one_line(info, "time_limit_s must be a positive number of seconds")


# --- options -----------------------------------------------------------------------------------------------


def test_unknown_optimizer_lists_the_known_ones():
    with pytest.raises(autoplan.PlanError) as info:
        zoo.plan_workload(zoo.on_meta(zoo.cli_mlp), optimizer="lion")

    one_line(info, "unknown optimizer 'lion'", "adamw")


def test_unknown_precision_lists_the_known_ones():
    with pytest.raises(autoplan.ConfigError) as info:
        zoo.plan_workload(zoo.on_meta(zoo.cli_mlp), precision="fp8")

    one_line(info, "unknown precision 'fp8'", "bf16")


def test_unknown_solver_backend_lists_the_known_ones():
    with pytest.raises(autoplan.PlanError) as info:
        zoo.plan_workload(zoo.on_meta(zoo.cli_mlp), solver="gurobi")

    one_line(info, "unknown solver backend 'gurobi'", "'highs'")


@pytest.mark.parametrize(
    ("pins", "fragment"),
    [
        ({"input_0": "Q"}, "placement 'Q' is malformed"),
        ({"input_0": "S(0),R"}, "gives 2 placements but the mesh has 1 axes (2,): give one placement per mesh axis"),
        ({"decoder.*": "R"}, "matches no parameter or input"),
        ({"input_0": 0}, "expected a placement string like 'R'"),
    ],
    ids=["bad_spec", "wrong_axis_count", "no_match", "not_a_string"],
)
def test_malformed_pin_names_the_pin_and_the_expected_form(pins, fragment):
    with pytest.raises(autoplan.PlanError) as info:
        zoo.plan_workload(zoo.on_meta(zoo.cli_mlp), pins=pins)

    one_line(info, f"pin {next(iter(pins))!r}", fragment)


# --- profile databases ---------------------------------------------------------------------------------


PROFILE_FILES = {
    "truncated": ('{"format": "autoplan-profile-db", "vers', "not valid JSON"),
    "wrong_format": (json.dumps({"format": "other"}), "not an autoplan profile database"),
    "wrong_version": (json.dumps({"format": "autoplan-profile-db", "version": 7}), "schema version 7"),
    "bad_header": (
        json.dumps({"format": "autoplan-profile-db", "version": 4, "device": {"kind": "tpu"}}),
        "malformed device header",
    ),
    "not_utf8": (b"\xff\xfe\x00", "not a UTF-8 JSON file"),
    "missing": (None, "does not exist"),
}


@pytest.mark.parametrize("case", list(PROFILE_FILES))
def test_corrupted_profile_database_names_the_file_and_is_left_untouched(case, tmp_path):
    content, fragment = PROFILE_FILES[case]
    path = tmp_path / "db.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)

    with pytest.raises(ProfileError) as info:
        zoo.plan_workload(zoo.on_meta(zoo.cli_mlp), profile=path)

    one_line(info, "db.json", fragment)
    assert (path.read_bytes() if path.exists() else None) == (content.encode() if isinstance(content, str) else content)


def test_profile_database_measured_with_other_threads_suggests_omp_num_threads(tmp_path):
    here = DeviceKey.cpu_ranks()  # the key planning for CPU ranks reads (the ranks' thread count)
    other = DeviceKey(**{**here.to_dict(), "num_threads": here.num_threads + 7})
    ProfileDB(default_db_path(here), other).save()  # this machine's file, written with other threads

    with pytest.raises(ProfileError) as info:
        zoo.plan_workload(zoo.on_meta(zoo.cli_mlp))  # profile="auto" reads this machine's file

    one_line(info, f"OMP_NUM_THREADS={here.num_threads + 7}")


def test_model_without_trainable_parameters_says_there_is_nothing_to_train():
    frozen = nn.Linear(16, 8).requires_grad_(False)

    with pytest.raises(autoplan.UnsupportedModelError) as info:
        autoplan.plan(frozen, "2xCPU", example_inputs=(torch.randn(8, 16),), loss_fn=lambda out: out.mean())

    one_line(info, "no trainable parameters", "all 2 have requires_grad=False", "requires_grad_(True)")


# === command line =====================================================================================


def test_cli_untraceable_model_names_the_line_and_writes_no_file(capfd, tmp_path):
    out = tmp_path / "plan.json"

    result = cli(capfd, "plan", target("data_dependent"), "--cluster", "2xCPU", "--out", out)

    assert_bad_input(result, "zoo.py:", "if x.sum() > 0")
    assert not out.exists()


def test_cli_model_failing_on_its_inputs_prints_one_line_in_a_fresh_process(bad_targets, tmp_path):
    # a subprocess: torch logs the failure through handlers bound to the real stderr at import
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run(
        [sys.executable, "-m", "autoplan.tools.cli", "plan", f"{bad_targets}:shape_mismatch", "--cluster", "2xCPU",
         "--out", str(tmp_path / "plan.json")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip

    assert_bad_input((result.returncode, result.stdout, result.stderr), "[8, 10]", "runs eagerly")
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize(
    ("case", "fragments"),
    [
        ("no_inputs", ("example_inputs is missing",)),
        ("no_loss", ("loss must be a scalar", "no loss_fn given")),
        ("missing_targets", ("loss_fn mse_loss", "example_targets")),
        ("bad_optimizer", ("unknown optimizer 'lion'",)),
        ("no_trainable", ("no trainable parameters",)),
    ],
    ids=["no_inputs", "no_loss", "missing_targets", "bad_optimizer", "no_trainable"],
)
def test_cli_workload_problem_is_one_line(case, fragments, bad_targets, capfd, tmp_path):
    out = tmp_path / "plan.json"

    result = cli(capfd, "plan", f"{bad_targets}:{case}", "--cluster", "2xCPU", "--out", out)

    assert_bad_input(result, *fragments)
    assert not out.exists()


@pytest.mark.parametrize(
    ("name", "fragments"),
    [
        ("missing_file", ("target file 'no_such_models.py' does not exist", "check the path")),
        ("no_colon", ("is malformed: expected FILE.py:FUNCTION",)),
        ("no_such_function", ("has no function 'build'", "def build() -> autoplan.Workload")),
        ("not_a_function", ("'NOT_A_FUNCTION' = a int, not a function",)),
        ("wrong_type", ("returned Linear", "must return autoplan.Workload")),
        ("raises", ("failed while building the model: FileNotFoundError: data/train.bin", "fix the build")),
        ("import_error", ("cannot import", "broken_import.py:3", "fix the error in that file")),
    ],
    ids=["missing_file", "no_colon", "no_such_function", "not_a_function", "wrong_type", "raises", "import_error"],
)
def test_cli_bad_target_is_one_line(name, fragments, bad_targets, capfd, tmp_path):
    spec = {
        "missing_file": "no_such_models.py:build",
        "no_colon": str(bad_targets),
        "no_such_function": f"{bad_targets}:build",
        "not_a_function": f"{bad_targets}:NOT_A_FUNCTION",
        "import_error": f"{bad_targets.parent / 'broken_import.py'}:build",
    }.get(name, f"{bad_targets}:{name}")

    result = cli(capfd, "plan", spec, "--cluster", "2xCPU", "--out", tmp_path / "plan.json")

    assert_bad_input(result, *fragments)
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize(
    ("cluster", "fragments"),
    [
        ("0xH100", ("devices_per_node must be a positive integer, got 0", "'4xCPU'")),
        ("4xH900", ("unknown device 'H900'", "H100")),
        ("2x8", ("is malformed", "2x8xH100")),
    ],
    ids=["0xH100", "4xH900", "2x8"],
)
def test_cli_bad_cluster_preset_is_one_line(cluster, fragments, capfd, tmp_path):
    result = cli(capfd, "plan", target("mlp"), "--cluster", cluster, "--out", tmp_path / "plan.json")

    assert_bad_input(result, *fragments)
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize("case", ["truncated_yaml", "truncated_json", "unknown_key", "missing"])
def test_cli_malformed_cluster_file_is_one_line(case, capfd, tmp_path):
    name, content, fragment = CLUSTER_FILES[case]
    if content is not None:
        (tmp_path / name).write_text(content)

    result = cli(capfd, "plan", target("mlp"), "--cluster", tmp_path / name, "--out", tmp_path / "plan.json")

    assert_bad_input(result, name, fragment)
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize(
    ("mesh", "fragment"),
    [("2,x", "--mesh '2,x' is malformed"), ("3", "has 3 devices but"), ("0,2", "positive integers")],
    ids=["not_int", "wrong_product", "zero_axis"],
)
def test_cli_bad_mesh_is_one_line(mesh, fragment, capfd, tmp_path):
    result = cli(capfd, "plan", target("mlp"), "--cluster", "2xCPU", "--mesh", mesh, "--out", tmp_path / "p.json")

    assert_bad_input(result, fragment)


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--global-batch-size", "0"], ("argument --global-batch-size: expected a positive integer, got 0",)),
        (["--global-batch-size", "abc"], ("expected a positive integer, got 'abc'",)),
        (["--time-limit", "0"], ("argument --time-limit: expected a positive number",)),
        (["--optimizer", "lion"], ("invalid choice: 'lion'", "autoplan plan --help")),
        (["--precision", "fp8"], ("invalid choice: 'fp8'",)),
        (["--no-such-flag"], ("unrecognized arguments: --no-such-flag",)),
    ],
    ids=["batch_zero", "batch_not_int", "time_limit_zero", "optimizer", "precision", "unknown_flag"],
)
def test_cli_malformed_option_is_one_line_not_the_usage_block(args, fragments, capfd, tmp_path):
    result = cli(capfd, "plan", target("mlp"), "--cluster", "2xCPU", "--out", tmp_path / "plan.json", *args)

    assert_bad_input(result, *fragments)
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize("argv", [[], ["bogus"], ["plan", target("mlp")]], ids=["none", "unknown", "missing_args"])
def test_cli_unknown_command_or_missing_arguments_is_one_line(argv, capfd):
    assert_bad_input(cli(capfd, *argv), "see `autoplan")


@pytest.mark.parametrize(
    ("pin", "fragment"),
    [("input_0", "--pin 'input_0' is malformed: expected NAME=SPEC"), ("input_0=Q", "placement 'Q' is malformed")],
    ids=["no_equals", "bad_spec"],
)
def test_cli_malformed_pin_is_one_line(pin, fragment, capfd, tmp_path):
    result = cli(capfd, "plan", target("mlp"), "--cluster", "2xCPU", "--pin", pin, "--out", tmp_path / "plan.json")

    assert_bad_input(result, fragment)
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--global-batch-size", "8", "--config", "dp"], "--config item 'dp' is malformed"),
        (["--global-batch-size", "8", "--config", "pipeline=2"], "--config item 'pipeline=2' is malformed"),
        (["--global-batch-size", "8", "--config", "dp=two"], "--config dp='two': expected an integer"),
        (["--global-batch-size", "8", "--config", "dp=0"], "ParallelConfig.dp must be a positive integer, got 0"),
        (["--global-batch-size", "8", "--config", "schedule=fast"], "unknown schedule 'fast'"),
        (["--config", "dp=2"], "--config needs --global-batch-size N"),
        (["--global-batch-size", "8", "--config", "dp=2,sequence_parallel=1"], "sequence_parallel=True needs tp > 1"),
        (["--global-batch-size", "8", "--config", "tp=2,sequence_parallel=yes"], "sequence_parallel='yes': expected"),
    ],
    ids=["no_value", "unknown_key", "not_int", "zero", "unknown_schedule", "no_batch", "sp_without_tp", "sp_not_bool"],
)
def test_cli_malformed_config_is_one_line(args, fragment, capfd, tmp_path):
    result = cli(capfd, "plan", target("mlp"), "--cluster", "2xCPU", "--out", tmp_path / "plan.json", *args)

    assert_bad_input(result, fragment)
    assert not (tmp_path / "plan.json").exists()


def test_cli_global_batch_not_divisible_by_the_config_is_one_line(capfd, tmp_path):
    result = cli(
        capfd, "plan", target("mlp"), "--cluster", "2xCPU", "--global-batch-size", "3", "--config", "dp=2",
        "--out", tmp_path / "plan.json",
    )  # fmt: skip

    assert_bad_input(result, "= 2*1*1 = 2 but global_batch_size is 3")
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize("command", ["show", "run"])
@pytest.mark.parametrize("case", ["truncated", "wrong_version", "missing"])
def test_cli_malformed_plan_file_is_one_line_and_launches_nothing(case, command, plan_file, capfd):
    text = plan_file.read_text()
    if case == "truncated":
        plan_file.write_text(text[: len(text) // 2])
    elif case == "wrong_version":
        plan_file.write_text(json.dumps(_edit_plan(json.loads(text), case)))
    else:
        plan_file.unlink()
    argv = ["show", plan_file] if command == "show" else ["run", target("mlp"), "--plan", plan_file]

    rc, out, err = cli(capfd, *argv)

    assert_bad_input((rc, out, err), "plan.json", PLAN_FILES[case])
    assert out == ""  # no summary, no torchrun


def test_cli_run_with_a_plan_for_another_model_fails_before_launching(plan_file, mlp_plan, capfd):
    rc, out, err = cli(capfd, "run", target("mlp_wide"), "--plan", plan_file, "--steps", "1")

    assert_bad_input((rc, out, err), mlp_plan.fingerprint, "re-plan")
    assert out == ""


@pytest.mark.parametrize(
    ("source", "fragment"),
    [("plan", "--nproc 4 does not match the plan's 2 devices"), ("cluster", "--nproc 4 does not match the 2 devices")],
    ids=["plan", "cluster"],
)
def test_cli_run_with_nproc_other_than_the_world_size_fails_before_planning(source, fragment, plan_file, capfd):
    where = ["--plan", plan_file] if source == "plan" else ["--cluster", "2xCPU"]

    rc, out, err = cli(capfd, "run", target("mlp"), *where, "--nproc", "4", "--steps", "1")

    assert_bad_input((rc, out, err), fragment)
    assert out == ""


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--cluster", "2xCPU", "--steps", "-1"], "argument --steps: expected an integer >= 0"),
        (["--cluster", "2xCPU", "--checkpoint-every", "0", "--checkpoint-dir", "ckpt"], "--checkpoint-every 0"),
        (["--cluster", "2xCPU", "--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint-dir"),
        (["--cluster", "2xCPU", "--max-restarts", "-1"], "--max-restarts -1"),
        ([], "needs --plan plan.json or --cluster SPEC"),
    ],
    ids=["negative_steps", "checkpoint_every_zero", "checkpoint_every_no_dir", "negative_restarts", "no_plan"],
)
def test_cli_bad_run_options_fail_before_launching(args, fragment, capfd):
    rc, out, err = cli(capfd, "run", target("mlp"), *args)

    assert_bad_input((rc, out, err), fragment)
    assert out == ""


def test_cli_model_that_cannot_fit_leaves_an_existing_out_file_untouched(plan_file, capfd):
    before = plan_file.read_bytes()

    result = cli(capfd, "plan", target("huge"), "--cluster", "2xCPU", "--out", plan_file)

    assert_bad_input(result, "GiB", "add devices")
    assert plan_file.read_bytes() == before
    assert not list(plan_file.parent.glob(".plan.json.*")), "temporary file left next to it"


def test_cli_out_into_a_missing_directory_is_one_line(capfd, tmp_path):
    result = cli(capfd, "plan", target("mlp"), "--cluster", "2xCPU", "--out", tmp_path / "no_such_dir" / "p.json")

    assert_bad_input(result, "no_such_dir", "create the directory")


def test_cli_corrupted_profile_database_is_one_line(capfd, tmp_path):
    db = tmp_path / "db.json"
    db.write_text("{oops")

    result = cli(capfd, "plan", target("mlp"), "--cluster", "2xCPU", "--profile-db", db, "--out", tmp_path / "p.json")

    assert_bad_input(result, "db.json", "not valid JSON")
    assert db.read_text() == "{oops"


def test_cli_estimate_without_config_asks_for_it(capfd):
    result = cli(capfd, "estimate", target("mlp"), "--cluster", "2xCPU")

    assert_bad_input(result, "needs --config KEY=VALUE,... and --global-batch-size N")


# === safety: files are data, never code ====================================================================

SCANNED = ("autoplan", "passes", "cost_models", "examples", "benchmarks")
"""What ships or runs as a user would: no unpickling, no eval, no unsafe YAML in any of it."""
UNSAFE_CALLS = {
    ("yaml", "load"), ("yaml", "load_all"), ("yaml", "unsafe_load"), ("yaml", "full_load"),
    ("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"), ("marshal", "load"), ("marshal", "loads"),
    ("shelve", "open"), ("dill", "load"), ("dill", "loads"),
}  # fmt: skip


def _unsafe_calls(path: Path, *, strict: bool) -> list[str]:
    """``file:line call`` for every unsafe read in ``path``; ``torch.load`` is allowed only with
    ``weights_only=True``, a ``pickle.Unpickler`` subclass only with its own ``find_class``. ``strict``: also pickle/marshal/eval/exec (not for test helpers, which
    pickle their own results between their own processes)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.ClassDef) and strict and any(
            isinstance(b, ast.Attribute) and isinstance(b.value, ast.Name) and (b.value.id, b.attr) == ("pickle", "Unpickler")
            for b in node.bases
        ):  # an unpickler is allowed only with its globals restricted (the pickle docs' recipe)
            if not any(isinstance(f, ast.FunctionDef) and f.name == "find_class" for f in node.body):
                found.append(f"{path}:{node.lineno} pickle.Unpickler subclass without find_class")
            continue
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = None
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            name = (func.value.id, func.attr)
        if name == ("torch", "load"):
            safe = any(
                k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                for k in node.keywords
            )
            if not safe:
                found.append(f"{path}:{node.lineno} torch.load without weights_only=True")
        elif name in UNSAFE_CALLS and (strict or name[0] == "yaml"):
            found.append(f"{path}:{node.lineno} {name[0]}.{name[1]}")
        elif strict and isinstance(func, ast.Name) and func.id in ("eval", "exec"):
            found.append(f"{path}:{node.lineno} {func.id}()")
    return found


def test_no_file_is_read_with_pickle_eval_unsafe_yaml_or_unrestricted_torch_load():
    files = [p for d in SCANNED for p in sorted((REPO_ROOT / d).rglob("*.py"))]
    test_files = sorted((REPO_ROOT / "tests").rglob("*.py"))
    assert len(files) > 30, "the scan found too few files: has the layout changed?"

    found = [f for p in files for f in _unsafe_calls(p, strict=True)]
    found += [f for p in test_files for f in _unsafe_calls(p, strict=False)]

    assert found == [], "unsafe deserialisation:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(dp=8, ep=3), "ep=3 must divide the data-parallel degree dp=8"),
        (dict(dp=2, tp=2, ep=2), "expert parallelism (ep > 1) needs tp=1, no stage_dp and offload_optimizer=False"),
        (dict(dp=2, ep=2, offload_optimizer=True), "set ep=1 or drop the other option"),
        (dict(dp=2, ep=0), "ParallelConfig.ep must be a positive integer, got 0: use 1 for no expert parallelism"),
    ],
    ids=["ep_not_dividing_dp", "ep_with_tp", "ep_with_offload", "ep_zero"],
)
def test_expert_parallel_config_that_cannot_run_names_the_fix(fields, message):
    with pytest.raises(autoplan.ConfigError) as info:
        autoplan.ParallelConfig(**fields)

    one_line(info, message)


def test_expert_parallel_needs_experts_divisible_by_ep():
    """``ep=2`` for a dense model (no routed experts to split) is refused before any ILP."""
    ids, labels = zoo.token_batch(batch=4, seq=8)
    with pytest.raises(autoplan.ConfigError) as info:
        autoplan.estimate(zoo.gpt2_tiny(num_layers=2), "2xCPU", (ids,), loss_fn=zoo.lm_loss, example_targets=(labels,),
                          global_batch_size=4, config=autoplan.ParallelConfig(dp=2, microbatch_size=2, ep=2))  # fmt: skip

    one_line(info, "ep=2 splits each MoE layer's experts 2 ways but the model has no routed experts", "use ep=1")
