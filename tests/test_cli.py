"""The ``autoplan`` command line, run as a subprocess: plan/show/run and the bad-input contract.

Bad input must end the command with exit code 2 and exactly one stderr line
``autoplan: error: ...`` (no traceback), and must never leave a partially written ``--out`` file.
The build functions live in ``tests/cli_models.py``; every command runs in its own ``tmp_path``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import autoplan
from tests.harness import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS = Path(__file__).resolve().with_name("cli_models.py")
CLI_TIMEOUT_S = 180


def run_cli(
    cwd: Path, *args: str, timeout_s: float = CLI_TIMEOUT_S, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m autoplan.tools.cli ARGS`` in ``cwd`` against this checkout (``env``: extra variables)."""
    env = {**os.environ, **(env or {})}
    env["TRANSFORMERS_VERBOSITY"] = "error"
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.run(
        [sys.executable, "-m", "autoplan.tools.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def target(name: str) -> str:
    return f"{MODELS}:{name}"


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The ``autoplan: error:`` line of a bad-input failure (exit code 2, no traceback)."""
    assert result.returncode == 2, f"exit code {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines, "no error message on stderr"
    assert lines[-1].startswith("autoplan: error: "), result.stderr
    return lines[-1]


def assert_bad_input(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """Exit code 2, stderr is exactly one ``autoplan: error:`` line containing every fragment."""
    line = error_line(result)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{result.stderr}"
    for fragment in fragments:
        assert fragment in line, f"{fragment!r} not in {line!r}"
    return line


@pytest.fixture(scope="module")
def mlp_plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``autoplan plan cli_models.py:mlp --cluster 2xCPU --out plan.json``, made once."""
    cwd = tmp_path_factory.mktemp("mlp_plan")
    result = run_cli(cwd, "plan", target("mlp"), "--cluster", "2xCPU", "--out", "plan.json")
    assert result.returncode == 0, result.stderr
    assert "wrote plan.json" in result.stdout
    return cwd / "plan.json"


@pytest.fixture()
def plan_copy(mlp_plan_file: Path, tmp_path: Path) -> Path:
    """A private copy of the ``mlp`` plan in ``tmp_path``, free to overwrite."""
    return Path(shutil.copy(mlp_plan_file, tmp_path / "plan.json"))


# --- plan / show / --help ------------------------------------------------------------------------


def test_plan_writes_a_plan_file_that_loads_for_two_devices(mlp_plan_file):
    plan = autoplan.Plan.load(mlp_plan_file)

    assert plan.world_size == 2
    assert plan.param_names == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert not list(mlp_plan_file.parent.glob(".plan.json.*")), "temporary file left behind"


def test_show_prints_the_review_tables_with_fingerprint_and_parameter_names(mlp_plan_file, tmp_path):
    from autoplan.tools.review import show_text

    plan = autoplan.Plan.load(mlp_plan_file)

    result = run_cli(tmp_path, "show", str(mlp_plan_file))

    assert result.returncode == 0, result.stderr
    assert result.stdout == show_text(plan)
    for section in ("Mesh", "Time per step", "Memory per device", "Parameter placements", "Collectives per step"):
        assert section in result.stdout
    assert plan.fingerprint in result.stdout
    for name in plan.param_names:
        assert name in result.stdout


@pytest.mark.parametrize(
    "command",
    [
        [],
        *(
            [c]
            for c in (
                "plan",
                "show",
                "explain",
                "diff",
                "run",
                "estimate",
                "report",
                "export-onnx",
                "bench",
                "calibrate",
                "profile",
            )
        ),
    ],
    ids=lambda c: c[0] if c else "top",
)
def test_help_works_for_every_subcommand(command, tmp_path):
    result = run_cli(tmp_path, *command, "--help")

    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: autoplan")
    assert result.stderr == ""


# --- bad input: one line, exit code 2, no output file ------------------------------------------


@pytest.fixture(scope="module")
def untraceable_result(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    cwd = tmp_path_factory.mktemp("untraceable")
    result = run_cli(cwd, "plan", target("data_dependent"), "--cluster", "2xCPU", "--out", "plan.json")
    return result, cwd / "plan.json"


def test_untraceable_model_error_names_the_failing_line_of_the_user_file(untraceable_result):
    result, out = untraceable_result

    line = error_line(result)

    assert "zoo.py" in line  # the model's file (tests/zoo.py), not the target file naming it
    assert "if x.sum() > 0" in line
    assert not out.exists()


def test_untraceable_model_error_is_the_only_stderr_line(untraceable_result):
    result, _out = untraceable_result

    assert_bad_input(result, "zoo.py")


@pytest.mark.parametrize(
    "text",
    [
        # truncated mid flow sequence (-m slow: each case is an interpreter, the suite's budget)
        pytest.param("num_nodes: 1\ndevices_per_node: 2\ndevice: [CP", id="truncated", marks=pytest.mark.slow),
        pytest.param("num_nodes: 1\n\tdevices_per_node: 2\ndevice: CPU\n", id="tab_indent"),  # a tab is not indentation
    ],
)
def test_malformed_cluster_yaml_names_the_file(text, tmp_path):
    (tmp_path / "my_cluster.yaml").write_text(text)

    result = run_cli(tmp_path, "plan", target("mlp"), "--cluster", "my_cluster.yaml", "--out", "plan.json")

    assert_bad_input(result, "my_cluster.yaml", "YAML")
    assert not (tmp_path / "plan.json").exists()


def test_unknown_device_preset_names_the_device(tmp_path):
    result = run_cli(tmp_path, "plan", target("mlp"), "--cluster", "4xTPU9", "--out", "plan.json")

    assert_bad_input(result, "TPU9", "CPU")  # the unknown name, and the known ones
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.slow
def test_malformed_preset_shows_the_expected_format(tmp_path):
    result = run_cli(tmp_path, "plan", target("mlp"), "--cluster", "2x8", "--out", "plan.json")

    assert_bad_input(result, "'2x8'", "2x8xH100")
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.slow
def test_run_with_a_plan_for_another_model_fails_before_launching_ranks(plan_copy, tmp_path):
    fingerprint = autoplan.Plan.load(plan_copy).fingerprint

    result = run_cli(tmp_path, "run", target("mlp_wide"), "--plan", "plan.json", "--steps", "1")

    assert_bad_input(result, fingerprint, "re-plan")
    assert result.stdout == ""  # no summary, no torchrun, no step


@pytest.mark.slow
def test_run_with_nproc_other_than_the_plan_world_size_fails(plan_copy, tmp_path):
    result = run_cli(tmp_path, "run", target("mlp"), "--plan", "plan.json", "--nproc", "4", "--steps", "1")

    assert_bad_input(result, "--nproc 4", "2 devices")
    assert result.stdout == ""


@pytest.mark.parametrize("command", ["show", pytest.param("run", marks=pytest.mark.slow)])
def test_truncated_plan_file_is_reported_as_invalid_json(command, plan_copy, tmp_path):
    text = plan_copy.read_text()
    plan_copy.write_text(text[: len(text) // 2])
    args = ["show", "plan.json"] if command == "show" else ["run", target("mlp"), "--plan", "plan.json", "--steps", "1"]

    result = run_cli(tmp_path, *args)

    assert_bad_input(result, "plan.json", "JSON")
    assert result.stdout == ""


def test_plan_file_with_another_version_asks_to_re_plan(plan_copy, tmp_path):
    data = json.loads(plan_copy.read_text())
    data["version"] = 99
    plan_copy.write_text(json.dumps(data))

    result = run_cli(tmp_path, "show", "plan.json")

    assert_bad_input(result, "plan.json", "version 99", "re-plan")


@pytest.mark.slow
def test_model_that_cannot_fit_reports_gib_and_devices(tmp_path):
    result = run_cli(tmp_path, "plan", target("huge"), "--cluster", "2xCPU", "--out", "plan.json")

    assert_bad_input(result, "GiB", "devices")
    assert not (tmp_path / "plan.json").exists()


def test_missing_target_file_is_named(tmp_path):
    result = run_cli(tmp_path, "plan", "no_such_models.py:mlp", "--cluster", "2xCPU", "--out", "plan.json")

    assert_bad_input(result, "no_such_models.py")
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.slow
def test_missing_target_function_is_named(tmp_path):
    result = run_cli(tmp_path, "plan", target("no_such_build"), "--cluster", "2xCPU", "--out", "plan.json")

    assert_bad_input(result, "no_such_build", "cli_models.py")
    assert not (tmp_path / "plan.json").exists()


def test_failing_plan_leaves_an_existing_out_file_byte_identical(plan_copy, tmp_path):
    before = plan_copy.read_bytes()

    # fails in the solver, the last stage before the file would be written
    result = run_cli(tmp_path, "plan", target("huge"), "--cluster", "2xCPU", "--out", "plan.json")

    assert_bad_input(result, "GiB")
    assert plan_copy.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no temporary file left


@pytest.mark.slow
def test_out_into_a_missing_directory_is_bad_input(tmp_path):
    result = run_cli(tmp_path, "plan", target("mlp"), "--cluster", "2xCPU", "--out", "no_such_dir/plan.json", "-q")

    assert_bad_input(result, "no_such_dir")


def test_plan_file_with_a_malformed_input_placement_is_bad_input(plan_copy, tmp_path):
    data = json.loads(plan_copy.read_text())
    data["placements"]["inputs"] = [["Q"]]
    plan_copy.write_text(json.dumps(data))

    result = run_cli(tmp_path, "show", "plan.json")

    assert_bad_input(result, "plan.json")


# --- run end to end --------------------------------------------------------------------------------


def test_run_trains_two_steps_on_two_ranks_and_compares_with_single_device(tmp_path):
    result = run_cli(
        tmp_path,
        "run", target("mlp"), "--cluster", "2xCPU", "--steps", "2", "--compare",
        "--master-port", str(free_port()),
        timeout_s=300,
    )  # fmt: skip

    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    steps = [line for line in result.stdout.splitlines() if line.startswith("step")]
    assert len(steps) == 2, result.stdout
    assert all("single-device" in line for line in steps)


_DATA_PARALLEL_2XCPU = ("--cluster", "2xCPU", "--pin", "input_0=S(0)", "--pin", "target_0=S(0)")
"""``autoplan run`` options of the dataset workloads' tests: two CPU ranks, the batch split between them."""


@pytest.mark.slow
def test_run_trains_from_the_workloads_dataset_each_rank_loading_its_rows_like_single_device(tmp_path):
    """``Workload.dataset`` (3 global batches): the ranks train from the sharded loader, 4 steps
    start over at the first batch, and ``--compare`` feeds one device the same global batches."""
    result = run_cli(
        tmp_path,
        "run", target("mlp_dataset"), *_DATA_PARALLEL_2XCPU,
        "--steps", "4", "--compare", "--master-port", str(free_port()),
        timeout_s=300,
    )  # fmt: skip

    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "data: 24 samples, 3 steps per pass; rank 0 loads 4 of 8 rows of input 0 per step" in result.stdout
    steps = [line for line in result.stdout.splitlines() if line.startswith("step")]
    assert len(steps) == 4, result.stdout
    losses = [float(line.split()[3]) for line in steps]
    assert losses[0] != losses[1]  # other batches, not the example batch again
    assert all(float(line.split("rel.diff")[1]) <= 1e-5 for line in steps), result.stdout
    final = next(line for line in result.stdout.splitlines() if line.startswith("parameters after 4 steps"))
    assert float(final.rsplit(" ", 1)[1]) <= 1e-5, final


def _steps_equal_single_device(result: subprocess.CompletedProcess[str], num_steps: int) -> list[float]:
    """Exit 0, ``num_steps`` step lines each within 1e-5 of the single-device model, and the
    parameters after them too; returns the losses."""
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    steps = [line for line in result.stdout.splitlines() if line.startswith("step")]
    assert len(steps) == num_steps, result.stdout
    assert all(float(line.split("rel.diff")[1]) <= 1e-5 for line in steps), result.stdout
    final = next(line for line in result.stdout.splitlines() if line.startswith(f"parameters after {num_steps} steps"))
    assert float(final.rsplit(" ", 1)[1]) <= 1e-5, final
    return [float(line.split()[3]) for line in steps]


@pytest.mark.slow
def test_run_reshuffles_the_dataset_each_pass_and_compare_trains_one_device_on_the_same_rows(tmp_path):
    """``--shuffle --data-seed 3``: each pass of the 3 batches in a new order, the same on both
    ranks, and ``--compare``'s single-device model on the same global rows at every step."""
    result = run_cli(
        tmp_path,
        "run", target("mlp_dataset"), *_DATA_PARALLEL_2XCPU,
        "--steps", "4", "--shuffle", "--data-seed", "3", "--compare", "--master-port", str(free_port()),
        timeout_s=300,
    )  # fmt: skip

    assert "data: 24 samples, 3 steps per pass, reshuffled each pass (data seed 3); rank 0 loads 4 of 8" in result.stdout
    _steps_equal_single_device(result, 4)


@pytest.mark.slow
def test_run_trains_from_an_iterable_dataset_read_again_each_pass_like_single_device(tmp_path):
    """``Workload.dataset`` an ``IterableDataset`` of 3 global batches: 4 steps read it a second
    time; each rank keeps its rows, ``--compare`` gets the whole batches of the same read."""
    result = run_cli(
        tmp_path,
        "run", target("mlp_stream"), *_DATA_PARALLEL_2XCPU,
        "--steps", "4", "--compare", "--master-port", str(free_port()),
        timeout_s=300,
    )  # fmt: skip

    assert "data: a stream (SampleStream), 8 samples per step, read again each pass; rank 0 loads 4 of 8" in result.stdout
    losses = _steps_equal_single_device(result, 4)
    assert len(set(losses)) == 4  # other batches, not the example batch again


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp_dataset", "mlp_stream"])
def test_run_resumed_with_compare_catches_one_device_up_on_the_same_rows(model, tmp_path):  # noqa: ANN001
    """2 steps with a checkpoint, then a resumed run to step 5 with ``--compare``: the single-device
    model first trains on steps 1-2's global rows (a stream is read through them), then both
    train steps 3-5 (the second pass from step 4) alike; the indexed dataset reshuffled."""
    shuffle = ("--shuffle", "--data-seed", "7") if model == "mlp_dataset" else ()
    common = (*_DATA_PARALLEL_2XCPU, *shuffle,
              "--checkpoint-dir", str(tmp_path / "ckpt"))  # fmt: skip
    first = run_cli(tmp_path, "run", target(model), *common, "--steps", "2", "--master-port", str(free_port()))
    assert first.returncode == 0, f"stdout:\n{first.stdout}\nstderr:\n{first.stderr}"

    result = run_cli(
        tmp_path, "run", target(model), *common, "--steps", "5", "--compare", "--master-port", str(free_port()),
        timeout_s=300,
    )  # fmt: skip

    assert "resumed from checkpoint" in result.stdout, result.stdout
    steps = [line for line in result.stdout.splitlines() if line.startswith("step")]
    assert [line.split()[1] for line in steps] == ["3", "4", "5"], result.stdout
    assert all(float(line.split("rel.diff")[1]) <= 1e-5 for line in steps), result.stdout
    final = next(line for line in result.stdout.splitlines() if line.startswith("parameters after 5 steps"))
    assert float(final.rsplit(" ", 1)[1]) <= 1e-5, final


@pytest.mark.parametrize(
    ("model", "options", "message"),
    [
        ("mlp", ("--shuffle",), "the workload has none (it trains on its example batch or batches=): give the"),
        # (each case starts an interpreter that loads the model: two with -m slow, the suite's budget)
        pytest.param(
            "mlp_stream", ("--shuffle",), "SampleStream, an IterableDataset: shuffle its stream itself",
            marks=pytest.mark.slow,
        ),
        pytest.param("mlp_dataset", ("--data-seed", "3"), "the data is not shuffled: add --shuffle", marks=pytest.mark.slow),
        ("mlp_dataset", ("--shuffle", "--data-seed", "-1"), "--data-seed: expected an integer seed in 0..2**63-1"),
    ],
    ids=["shuffle_without_dataset", "shuffle_a_stream", "data_seed_unshuffled", "negative_data_seed"],
)
def test_run_bad_data_options_are_one_line_exit_2_before_launching(model, options, message, tmp_path):  # noqa: ANN001
    result = run_cli(tmp_path, "run", target(model), "--cluster", "2xCPU", *options, "--master-port", str(free_port()))

    assert_bad_input(result, message)
    assert "step" not in result.stdout  # no rank was launched


# --- joint search: --global-batch-size, --config, `autoplan estimate` ---------------------------------

HF = str(REPO_ROOT / "examples" / "hf_models.py")


@pytest.mark.slow
def test_estimate_prints_the_breakdown_of_a_hand_written_config(tmp_path):
    r = run_cli(tmp_path, "estimate", f"{HF}:gpt2_tiny", "--cluster", "2x8xH100", "--global-batch-size", "64",
                "--config", "dp=4,tp=2,pp=2,microbatch_size=2,num_microbatches=8,schedule=1f1b", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    est = json.loads(r.stdout)
    assert est["config"]["pp"] == 2 and est["step_time_s"] > 0 and est["bubble_s"] > 0
    assert len(est["memory_per_device_bytes"]) == 2


@pytest.mark.parametrize(
    ("config", "message"),
    [
        # the two checks against the batch and the model run in-process in CI (tests/test_joint_search.py)
        pytest.param(
            "dp=2,pp=2,microbatch_size=3",
            "dp*microbatch_size*num_microbatches = 2*3*1 = 6 but global_batch_size is 16",
            marks=pytest.mark.slow,
        ),
        pytest.param("dp=1,pp=4,num_microbatches=16", "4 stages but the model has 2 blocks", marks=pytest.mark.slow),
        ("dp=2,pipeline=2", "--config item 'pipeline=2' is malformed"),
        ("dp=two", "expected an integer"),
    ],
)
def test_bad_config_is_one_line_exit_2_and_no_file(config, message, tmp_path):  # noqa: ANN001
    out = tmp_path / "plan.json"
    r = run_cli(tmp_path, "plan", f"{HF}:gpt2_tiny", "--cluster", "4xCPU", "--global-batch-size", "16",
                "--config", config, "--out", str(out))  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and message in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


@pytest.mark.slow
def test_plan_for_a_global_batch_writes_config_and_stages(tmp_path):
    out = tmp_path / "plan.json"
    r = run_cli(tmp_path, "plan", f"{HF}:gpt2_tiny", "--cluster", "4xCPU", "--global-batch-size", "16",
                "--config", "dp=2,pp=2,microbatch_size=2,num_microbatches=4,schedule=1f1b", "--out", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr
    plan = autoplan.Plan.load(out)
    assert plan.config is not None and plan.config.pp == 2 and plan.pipeline is not None
    assert "stages: 0: prologue..transformer.h.0" in r.stdout
    r2 = run_cli(tmp_path, "run", f"{HF}:llama_tiny", "--plan", str(out))
    assert r2.returncode == 2 and "different model" in r2.stderr
