"""An optimizer name autoplan does not know is an error wherever it is read, never plain SGD.

A plan file naming ``"lion"`` used to load, and ``make_optimizer`` fell through to
``torch.optim.SGD``: the run trained with another optimizer than the plan says and exited 0.
Now the plan file is refused at load (``PlanFileError`` naming the value and the known names)
and the runtime constructor refuses an unknown name too (a ``Plan`` built in Python skips the
file check).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import autoplan
from autoplan.api import parallelize, plan
from autoplan.cost_models.errors import PlanError, PlanFileError
from autoplan.cost_models.memory import OPTIMIZERS
from autoplan.runtime.optimizers import make_torch_optimizer
from autoplan.tools.cli import main
from tests import zoo
from tests.test_bad_inputs import assert_bad_input, fake_job


@pytest.fixture(scope="module")
def mlp_plan() -> autoplan.Plan:
    wl = zoo.on_meta(zoo.cli_mlp)
    return plan(
        wl.model, "2xCPU", example_inputs=wl.example_inputs, loss_fn=wl.loss_fn,
        example_targets=wl.example_targets, optimizer=wl.optimizer,
    )  # fmt: skip


@pytest.fixture()
def lion_plan_file(mlp_plan: autoplan.Plan, tmp_path: Path) -> Path:
    data = mlp_plan.to_dict()
    data["optimizer"] = "lion"
    path = tmp_path / "lion.json"
    path.write_text(json.dumps(data))
    return path


def test_plan_file_with_an_unknown_optimizer_is_refused_at_load(lion_plan_file: Path) -> None:
    with pytest.raises(PlanFileError) as info:
        autoplan.Plan.load(lion_plan_file)
    message = str(info.value)
    assert "\n" not in message
    assert "lion.json" in message and "'lion'" in message
    assert all(name in message for name in OPTIMIZERS), message
    assert "re-plan" in message


def test_cli_run_of_a_plan_with_an_unknown_optimizer_launches_nothing(
    lion_plan_file: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess

    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"launched {args}")

    monkeypatch.setattr(subprocess, "run", no_launch)
    monkeypatch.setattr(subprocess, "Popen", no_launch)
    rc = main(["run", f"{Path(__file__).resolve().with_name('cli_models.py')}:mlp", "--plan", str(lion_plan_file), "--steps", "1"])
    out, err = capfd.readouterr()
    assert_bad_input((rc, out, err), "unknown optimizer 'lion'", "lion.json")


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_known_optimizer_is_constructed(name: str) -> None:
    params = [torch.nn.Parameter(torch.ones(2))]
    opt = make_torch_optimizer(name, params, lr=0.1)
    expected = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}.get(name, torch.optim.SGD)
    assert type(opt) is expected
    assert opt.defaults.get("momentum", 0.0) == (0.9 if name == "sgd_momentum" else 0.0)


def test_runtime_refuses_an_unknown_optimizer_of_an_in_memory_plan(mlp_plan: autoplan.Plan) -> None:
    wl = zoo.cli_mlp()
    lion = dataclasses.replace(mlp_plan, optimizer="lion")
    with fake_job(2):
        pm = parallelize(
            wl.model, lion.cluster, example_inputs=wl.example_inputs, loss_fn=wl.loss_fn,
            example_targets=wl.example_targets, plan=lion,
        )  # fmt: skip
        with pytest.raises(PlanError, match=r"unknown optimizer 'lion'.*adam, adamw"):
            pm.make_optimizer(lr=0.1)
