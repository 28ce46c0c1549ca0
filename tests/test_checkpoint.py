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
import os
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata

import autoplan
from autoplan import ParallelConfig
from autoplan.errors import CheckpointError, CorruptCheckpointError
from autoplan.runtime import checkpoint
from autoplan.tools.loader import build_workload
from tests.harness import free_port
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
@pytest.mark.slow
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


@pytest.mark.slow
def test_only_checkpoint_corrupted_is_one_error_line_naming_the_directory(uninterrupted, plans, tmp_path):
    ckpt_dir, _ = uninterrupted
    broken = tmp_path / "ckpt"
    shutil.copytree(ckpt_dir / "step_6", broken / "step_6")
    metadata = broken / "step_6" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:100])  # truncated after the marker was written

    result = run_cli(
        tmp_path, "run", target("mlp"), "--plan", str(plans["data-parallel"]), "--steps", "8", "--checkpoint-dir", str(broken),
        "--master-port", str(free_port()), "-q",
    )  # fmt: skip

    assert_bad_input(result, "no usable checkpoint", str(broken / "step_6"), "corrupted", "delete the damaged")
    assert result.stdout == ""  # no rank was started


@pytest.mark.slow
def test_damaged_newest_checkpoints_fall_back_to_the_previous_complete_one(uninterrupted, plans, tmp_path):
    """step_6 has a truncated index (found before launch), step_4 a shard with overwritten bytes
    (its size is right: the ranks find it by its CRC-32, each checking a share of the files):
    both are named and skipped, the run resumes from step_2 and ends as the uninterrupted run."""
    ckpt_dir, _ = uninterrupted
    broken = tmp_path / "ckpt"
    shutil.copytree(ckpt_dir, broken)
    _truncate(broken / "step_6" / ".metadata")
    _overwrite_middle(broken / "step_4" / "__1_0.distcp")

    final, output, wall_s = train(tmp_path, plans["data-parallel"], broken, 4)
    print(f"resume past two damaged checkpoints, 2 steps: {wall_s:.1f} s")

    assert f"checkpoint {broken / 'step_6'} is corrupted (index .metadata" in output
    assert f"checkpoint {broken / 'step_4'} is corrupted (__1_0.distcp does not match the CRC-32" in output
    assert "Traceback" not in output
    assert f"resumed from checkpoint {broken / 'step_2'} (step 2)" in output
    assert [line.split()[1] for line in step_lines(output)] == ["3", "4"]
    expected = checkpoint.read_full_parameters(ckpt_dir / "step_4")
    for name, value in expected.items():
        assert torch.equal(final[name], value), name


@pytest.mark.slow
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
            empty_index = Metadata(state_dict_metadata={}, storage_data={})
            (tmp_path / name / ".metadata").write_bytes(pickle.dumps(empty_index))

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


# --- damaged checkpoints and crafted indexes (in this process, one gloo rank: no torchrun) ---------


@pytest.fixture(scope="module")
def one_rank_checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """``mlp`` with Adam on a one-rank gloo group in this process, checkpointed after steps 1
    and 2: ``(checkpoint dir, parallel model, optimizer, {step: parameters after it})``. The
    group lives for the module (the damaged-checkpoint tests resume into this model)."""
    from autoplan.api import parallelize
    from autoplan.api import plan as make_plan_for

    root = tmp_path_factory.mktemp("one_rank") / "ckpt"
    wl = build_workload(target("mlp"), device="cpu")
    plan = make_plan_for(
        wl.model, "1xCPU", example_inputs=wl.example_inputs, loss_fn=wl.loss_fn,
        example_targets=wl.example_targets, optimizer="adam", profile=None,
    )  # fmt: skip
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        pm = parallelize(
            wl.model, plan.cluster, example_inputs=wl.example_inputs, loss_fn=wl.loss_fn,
            example_targets=wl.example_targets, plan=plan,
        )  # fmt: skip
        opt = pm.make_optimizer(lr=1e-2)
        params = {}
        for step in (1, 2):
            pm.forward_backward(*wl.example_inputs, targets=tuple(wl.example_targets))
            opt.step()
            opt.zero_grad()
            checkpoint.save(root, step, pm, opt, plan=plan)
            params[step] = {n: t.clone() for n, t in pm.full_parameters().items()}
        yield root, pm, opt, params
    finally:
        dist.destroy_process_group()


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _overwrite_middle(path: Path) -> None:
    """Flip bytes in the middle of the file, keeping its size (tensor data: DCP loads it silently)."""
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 16):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "shard truncated": ("__0_0.distcp", _truncate),
    "index truncated": (".metadata", _truncate),
    "shard bytes overwritten": ("__0_0.distcp", _overwrite_middle),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_newest_checkpoint_resumes_from_the_previous_one_naming_it(
    damage, one_rank_checkpoints, tmp_path, caplog
):
    root, pm, opt, params = one_rank_checkpoints
    shutil.copytree(root, tmp_path / "ckpt")
    name, spoil = DAMAGE[damage]
    spoil(tmp_path / "ckpt" / "step_2" / name)

    with caplog.at_level("WARNING", logger="autoplan.runtime.checkpoint"):
        resumed = checkpoint.resume(tmp_path / "ckpt", pm, opt)

    assert resumed is not None
    ckpt, step = resumed
    assert ckpt.path == tmp_path / "ckpt" / "step_1" and step == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and f"{tmp_path / 'ckpt' / 'step_2'} is corrupted" in warnings[0], warnings
    assert name in warnings[0] and warnings[0].endswith("skipping it")
    for fqn, value in pm.full_parameters().items():  # the parameters of step 1, not step 2
        assert torch.equal(value, params[1][fqn]), fqn
    if damage != "shard bytes overwritten":  # a size check finds it before any rank starts
        assert checkpoint.find_latest(tmp_path / "ckpt").path == tmp_path / "ckpt" / "step_1"


def test_every_checkpoint_damaged_is_one_checkpoint_error(one_rank_checkpoints, tmp_path):
    root, pm, opt, _ = one_rank_checkpoints
    shutil.copytree(root, tmp_path / "ckpt")
    _overwrite_middle(tmp_path / "ckpt" / "step_2" / "__0_0.distcp")
    _truncate(tmp_path / "ckpt" / "step_1" / "__0_0.distcp")

    with pytest.raises(CheckpointError, match=r"no usable checkpoint in .*ckpt: checkpoint .*step_2 is corrupted"):
        checkpoint.resume(tmp_path / "ckpt", pm, opt)
    _truncate(tmp_path / "ckpt" / "step_2" / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=r"step_2 is corrupted .*\(and 1 older damaged one"):
        checkpoint.find_latest(tmp_path / "ckpt")


class _Marker:
    """Unpickled by a full unpickler, creates the file ``path`` (what a crafted index could run)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_crafted_index_is_refused_without_running_it(one_rank_checkpoints, tmp_path):
    root, _, _, _ = one_rank_checkpoints
    shutil.copytree(root, tmp_path / "ckpt")
    ran = tmp_path / "index-code-ran"
    (tmp_path / "ckpt" / "step_2" / ".metadata").write_bytes(pickle.dumps(_Marker(ran)))

    latest = checkpoint.find_latest(tmp_path / "ckpt")  # skips step_2 and resumes from step_1
    with pytest.raises(CorruptCheckpointError, match=r"step_2 is corrupted .*names posix\.system"):
        checkpoint.read_full_parameters(tmp_path / "ckpt" / "step_2")

    assert latest is not None and latest.path == tmp_path / "ckpt" / "step_1"
    assert not ran.exists()
    pickle.loads(pickle.dumps(_Marker(ran)))  # the same bytes under the full unpickler do run
    assert ran.exists()
