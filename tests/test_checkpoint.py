"""Checkpoints and restarts of ``autoplan run``: a killed rank, a new plan, a broken directory.

Every run trains ``tests/cli_models.py:mlp`` with Adam on 2 gloo ranks through the CLI (as a
subprocess, like ``tests/test_cli.py``). The reference is one uninterrupted 6-step run under a
data-parallel plan with a checkpoint every 2 steps (made once per module); the other runs must end
with its parameters:

* a rank killed after step 3 (``AUTOPLAN_FAULT_AT_STEP=3``, first attempt only): torchrun
  restarts both ranks, they resume from ``step_2`` and finish bit-identical;
* ``step_2`` resumed under a tensor-parallel plan and under a 2-stage pipeline plan: after
  step 4 equal to the reference's ``step_4`` within 1e-5 relative (another summation order);
* a checkpoint directory without its ``COMPLETE`` marker is skipped; one marked complete whose
  index is truncated stops the command with one ``autoplan: error:`` line naming it.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

import autoplan
from autoplan import ParallelConfig, checkpoint
from autoplan.loader import build_workload
from tests.dist_utils import free_port
from tests.test_cli import assert_bad_input, run_cli, target

STEPS = 6
EVERY = 2
DATA_PARALLEL = {"input_0": "S(0)"}
TENSOR_PARALLEL = {"0.weight": "S(0)", "0.bias": "S(0)", "2.weight": "S(1)"}  # Megatron-style column/row
PIPELINE = ParallelConfig(dp=1, pp=2, microbatch_size=2, num_microbatches=4, schedule="1f1b")


def make_plan(
    path: Path, *, optimizer: str = "adam", pins: dict[str, str] | None = None, config: ParallelConfig | None = None
) -> Path:
    """Plan ``mlp`` for 2 CPU ranks in-process (a pipeline plan with ``config``, for the example batch)."""
    wl = build_workload(target("mlp"), device="meta")
    plan = autoplan.plan(
        wl.model, "2xCPU", example_inputs=wl.example_inputs, loss_fn=wl.loss_fn,
        example_targets=wl.example_targets, optimizer=optimizer, pins=pins, profile=None, config=config,
        global_batch_size=None if config is None else wl.example_inputs[0].shape[0],
    )  # fmt: skip
    plan.save(path)
    return path


def train(cwd: Path, plan: Path, ckpt_dir: Path, steps: int, *extra: str) -> tuple[dict[str, torch.Tensor], str, float]:
    """``autoplan run mlp --plan PLAN --checkpoint-dir DIR ...``: final parameters, stdout then
    stderr, wall seconds."""
    final = cwd / "final.pt"
    start = time.perf_counter()
    result = run_cli(
        cwd, "run", target("mlp"), "--plan", str(plan), "--steps", str(steps), "--checkpoint-dir", str(ckpt_dir),
        "--save-final", str(final), "--master-port", str(free_port()), "-q", *extra,
        timeout_s=240,
    )  # fmt: skip
    wall_s = time.perf_counter() - start
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return torch.load(final, weights_only=True), result.stdout + result.stderr, wall_s


def step_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("step ")]


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cwd = tmp_path_factory.mktemp("plans")
    return {
        "data-parallel": make_plan(cwd / "dp.json", pins=DATA_PARALLEL),
        "tensor-parallel": make_plan(cwd / "tp.json", pins=TENSOR_PARALLEL),
        "pipeline": make_plan(cwd / "pp.json", config=PIPELINE),
    }


@pytest.fixture(scope="module")
def uninterrupted(plans: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """6 steps under the data-parallel plan, a checkpoint every 2: (checkpoint dir, final parameters)."""
    cwd = tmp_path_factory.mktemp("uninterrupted")
    final, output, wall_s = train(cwd, plans["data-parallel"], cwd / "ckpt", STEPS, "--checkpoint-every", str(EVERY))
    print(f"uninterrupted {STEPS}-step run: {wall_s:.1f} s")
    assert len(step_lines(output)) == STEPS
    return cwd / "ckpt", final


def test_checkpoints_are_complete_step_dirs_holding_the_trained_parameters(uninterrupted):
    ckpt_dir, final = uninterrupted

    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step_2", "step_4", "step_6"]  # no .tmp left
    marker = json.loads((ckpt_dir / "step_6" / checkpoint.COMPLETE_MARKER).read_text())
    assert marker["step"] == 6 and marker["optimizer"] == "adam" and marker["world_size"] == 2
    saved = checkpoint.read_full_parameters(ckpt_dir / "step_6")
    assert saved.keys() == final.keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}  # the model's FQNs
    for name, value in final.items():
        assert torch.equal(saved[name], value), name


def test_killed_rank_restarts_the_job_from_the_last_checkpoint_with_identical_parameters(
    uninterrupted, plans, tmp_path, monkeypatch
):
    _, expected = uninterrupted
    monkeypatch.setenv("AUTOPLAN_FAULT_AT_STEP", "3")  # rank 1 exits after step 3, before any step_4

    final, output, wall_s = train(
        tmp_path,
        plans["data-parallel"],
        tmp_path / "ckpt",
        STEPS,
        "--checkpoint-every",
        str(EVERY),
        "--max-restarts",
        "1",
    )
    print(f"killed-and-restarted {STEPS}-step run: {wall_s:.1f} s")

    assert "injected fault after step 3" in output
    first_attempt, resumed = output.split(f"resumed from checkpoint {tmp_path / 'ckpt' / 'step_2'} (step 2)")
    assert [line.split()[1] for line in step_lines(first_attempt)][:2] == ["1", "2"]  # rank 0 may die before 3
    assert [line.split()[1] for line in step_lines(resumed)] == ["3", "4", "5", "6"]
    for name, value in expected.items():
        assert torch.equal(final[name], value), name


@pytest.mark.parametrize("new_plan", ["tensor-parallel", "pipeline"])
def test_checkpoint_of_a_data_parallel_plan_resumes_under_another_plan(new_plan, uninterrupted, plans, tmp_path):
    ckpt_dir, _ = uninterrupted
    resume_dir = tmp_path / "ckpt"
    resume_dir.mkdir()
    shutil.copytree(ckpt_dir / "step_2", resume_dir / "step_2")
    (resume_dir / "step_3").mkdir()  # a save interrupted before COMPLETE: must be skipped
    (resume_dir / "step_3" / ".metadata").write_bytes(b"\x80garbage")
    (resume_dir / "step_5.tmp").mkdir()  # a save in progress: never a candidate

    final, output, wall_s = train(tmp_path, plans[new_plan], resume_dir, 4)
    print(f"resume under {new_plan}, 2 steps: {wall_s:.1f} s")

    assert "step_3 is incomplete (no COMPLETE marker): skipping it" in output
    assert f"resumed from checkpoint {resume_dir / 'step_2'} (step 2)" in output
    assert [line.split()[1] for line in step_lines(output)] == ["3", "4"]
    expected = checkpoint.read_full_parameters(ckpt_dir / "step_4")  # 4 uninterrupted data-parallel steps
    for name, value in expected.items():
        torch.testing.assert_close(final[name], value, rtol=1e-5, atol=1e-7, msg=name)
    saved = checkpoint.read_full_parameters(resume_dir / "step_4")  # written in the new plan's layout
    for name, value in final.items():
        assert torch.equal(saved[name], value), name


def test_corrupted_complete_checkpoint_is_one_error_line_naming_the_directory(uninterrupted, plans, tmp_path):
    ckpt_dir, _ = uninterrupted
    broken = tmp_path / "ckpt"
    shutil.copytree(ckpt_dir, broken)
    metadata = broken / "step_6" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:100])  # truncated after the marker was written

    result = run_cli(
        tmp_path, "run", target("mlp"), "--plan", str(plans["data-parallel"]), "--steps", "8", "--checkpoint-dir", str(broken),
        "--master-port", str(free_port()), "-q",
    )  # fmt: skip

    assert_bad_input(result, str(broken / "step_6"), "corrupted", "delete the directory")
    assert result.stdout == ""  # no rank was started


def test_resuming_with_another_optimizer_names_both(uninterrupted, tmp_path):
    ckpt_dir, _ = uninterrupted
    sgd_plan = make_plan(tmp_path / "sgd.json", optimizer="sgd")

    result = run_cli(
        tmp_path, "run", target("mlp"), "--plan", str(sgd_plan), "--steps", "8", "--checkpoint-dir", str(ckpt_dir)
    )

    assert_bad_input(result, "step_6", "adam", "sgd")


def test_find_latest_picks_the_newest_directory_with_a_valid_marker(tmp_path):
    def write(name: str, marker: dict | None) -> None:
        (tmp_path / name).mkdir()
        if marker is not None:
            (tmp_path / name / checkpoint.COMPLETE_MARKER).write_text(json.dumps(marker))

    ok = {"version": checkpoint.FORMAT_VERSION, "optimizer": "adam"}
    write("step_2", ok | {"step": 2})
    write("step_10", ok | {"step": 10})
    write("step_12", None)  # killed before the marker
    write("step_14", ok | {"step": 4})  # marker of another step: a copied directory
    write("step_16.tmp", ok | {"step": 16})  # not renamed yet
    (tmp_path / "step_18").write_text("")  # a file, not a directory

    latest = checkpoint.find_latest(tmp_path)

    assert latest is not None and latest.path == tmp_path / "step_10" and latest.step == 10
    assert checkpoint.find_latest(tmp_path / "missing") is None
