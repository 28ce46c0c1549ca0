"""No silent wrong results at the runtime's seams (issue #46):

* a single-device state dict with buffers loads under ``strict=True`` (buffers, a tied tensor's
  other names) and the loss is the single-device model's; persistent buffers are in
  ``state_dict()`` and round-trip through a checkpoint, ``persistent=False`` ones stay out;
* an optimizer built over the original module's parameters (before a deferred model's first
  call) is refused at its first step, naming the fix;
* a plan file whose configuration the runtime cannot run (``zero_stage: 2``) is refused when
  loaded, naming the field and the values that run;
* ``autoplan run`` stops at the first non-finite loss with exit 2 naming the step, unless
  ``--allow-nonfinite``.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import autoplan
from autoplan.errors import NonFiniteLossError, PlanFileError
from autoplan.runtime import checkpoint
from autoplan.runtime.training import check_finite_loss
from tests import zoo
from tests.harness import cpu_cluster, free_port, run_ranks
from tests.test_cli import assert_bad_input, run_cli, target


class Buffered(nn.Module):
    """A persistent buffer the forward multiplies by, a non-persistent one it adds, and the output
    layer registered under a second name (``alias``: a single-device state dict holds both)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)
        self.alias = self.out
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))
        self.register_buffer("shift", torch.zeros(4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)) * self.scale) + self.shift


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def _buffers_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:  # noqa: ARG001
    x, t = _batch()
    model = Buffered()
    reference = copy.deepcopy(model)
    pm = autoplan.parallelize(model, cpu_cluster("2xCPU"), example_inputs=(x,), loss_fn=mse, example_targets=(t,),
                              profile=None)  # fmt: skip
    sd = reference.state_dict()  # single device: parameters, alias.*, the persistent buffer
    sd["scale"] = torch.linspace(2.0, -1.0, 16)
    reference.load_state_dict(sd)
    keys = pm.load_state_dict(sd)  # strict
    loaded = float(pm.forward_backward(x, targets=(t,)))
    opt = pm.make_optimizer(lr=0.0)  # a step that leaves the parameters as they are, with optimizer state
    opt.step()
    opt.zero_grad()
    checkpoint.save(root, 1, pm, opt, plan=pm.plan)
    pm.load_state_dict({"scale": torch.ones(16)}, strict=False)
    changed = float(pm.forward_backward(x, targets=(t,)))
    resumed = checkpoint.resume(root, pm, opt)
    try:
        pm.load_state_dict({**sd, "shift": torch.ones(4)})
        non_persistent = "loaded"
    except autoplan.PlanError as exc:
        non_persistent = str(exc)
    return {
        "incompatible": (list(keys.missing_keys), list(keys.unexpected_keys)),
        "loss": loaded,
        "ref_loss": float(mse(reference(x), t)),
        "changed": changed,
        "resumed_step": None if resumed is None else resumed[1],
        "after_resume": float(pm.forward_backward(x, targets=(t,))),
        "state_dict_keys": sorted(pm.state_dict()),
        "non_persistent": non_persistent,
    }


def test_single_device_state_dict_with_buffers_loads_strictly_trains_like_one_device_and_checkpoints(tmp_path):
    results = run_ranks(_buffers_rank, 2, str(tmp_path / "ckpt"))
    for r in results:
        assert r["incompatible"] == ([], [])
        assert math.isclose(r["loss"], r["ref_loss"], rel_tol=1e-6), r
        assert not math.isclose(r["changed"], r["ref_loss"], rel_tol=1e-3), r  # the buffer matters
        assert r["resumed_step"] == 1
        assert math.isclose(r["after_resume"], r["ref_loss"], rel_tol=1e-6), r  # the checkpoint held the buffer
        assert r["state_dict_keys"] == ["inp.bias", "inp.weight", "out.bias", "out.weight", "scale"]
        assert "unexpected ['shift']" in r["non_persistent"]  # persistent=False stays out, as torch does


def _module_optimizer_rank(rank: int, world_size: int) -> dict[str, Any]:  # noqa: ARG001
    x, t = _batch()
    model = Buffered()
    pm = autoplan.parallelize(model, cpu_cluster("2xCPU"), loss_fn=mse, profile=None)  # deferred
    stale = torch.optim.SGD(model.parameters(), lr=0.1)  # before the first call: the module's own parameters
    pm(x, targets=(t,)).backward()
    before = [p.detach().full_tensor().clone() for p in pm.parameters()]
    try:
        stale.step()
        refused = ""
    except autoplan.PlanError as exc:
        refused = str(exc)
    untouched = all(torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, pm.parameters(), strict=True))
    good = torch.optim.SGD(pm.parameters(), lr=0.1)
    good.step()  # over the parallelized model's parameters: trains
    trained = not all(torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, pm.parameters(), strict=True))
    mse(model(x), t).backward()  # training the module itself (a single-device reference) is the user's business
    stale.step()
    return {"refused": refused, "untouched": untouched, "trained": trained}


def test_optimizer_over_the_module_built_before_a_deferred_first_call_is_refused_at_its_first_step():
    for r in run_ranks(_module_optimizer_rank, 2):
        assert "holds 4 parameter(s) of the module given to autoplan.parallelize" in r["refused"], r
        assert "build it after the first call, over pmodel.parameters(), or with pmodel.make_optimizer" in r["refused"]
        assert r["untouched"] and r["trained"], r


# --- plans the runtime cannot run -----------------------------------------------------------------


@pytest.fixture(scope="module")
def joint_plan_dict() -> dict[str, Any]:
    """``cli_mlp`` planned for a global batch with dp=2, ZeRO 0 (a plan the runtime runs)."""
    wl = zoo.on_meta(zoo.cli_mlp)
    batch = int(wl.example_inputs[0].shape[0])
    config = autoplan.ParallelConfig(dp=2, microbatch_size=batch // 2, num_microbatches=1)
    plan = zoo.plan_workload(wl, global_batch_size=batch, config=config, profile=None)
    return json.loads(json.dumps(plan.to_dict()))


@pytest.mark.parametrize("stage", [1, 2])
def test_plan_file_with_a_zero_stage_that_does_not_run_is_refused_naming_the_field(stage, joint_plan_dict, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**joint_plan_dict, "config": {**joint_plan_dict["config"], "zero_stage": stage}}))
    with pytest.raises(PlanFileError, match=rf"config\.zero_stage is {stage} \(runs: 0 or 3\)"):
        autoplan.Plan.load(path)
    path.write_text(json.dumps(joint_plan_dict))
    assert autoplan.Plan.load(path).config.zero_stage == 0  # type: ignore[union-attr]


# --- a non-finite loss ----------------------------------------------------------------------------


def test_check_finite_loss_names_the_step_or_reports_when_allowed():
    assert check_finite_loss(torch.tensor(1.5), 1)
    with pytest.raises(NonFiniteLossError, match=r"step 7: the loss is inf .*--allow-nonfinite"):
        check_finite_loss(torch.tensor(float("inf")), 7)
    assert not check_finite_loss(torch.tensor(float("nan")), 7, allow_nonfinite=True)


def test_run_stops_at_the_first_nonfinite_loss_with_one_line_and_exit_2(tmp_path: Path):
    """``mlp_nonfinite``'s second step has a NaN target: no third step, nothing saved."""
    final = tmp_path / "final.pt"
    result = run_cli(
        tmp_path, "run", target("mlp_nonfinite"), "--cluster", "2xCPU", "--steps", "3", "-q",
        "--save-final", str(final), "--master-port", str(free_port()), timeout_s=240,
    )  # fmt: skip
    assert_bad_input(result, "step 2: the loss is nan", "--allow-nonfinite")
    assert [line.split()[:2] for line in result.stdout.splitlines() if line.startswith("step")] == [["step", "1"]]
    assert not final.exists()


@pytest.mark.slow
def test_run_with_allow_nonfinite_trains_on_after_one_warning(tmp_path: Path):
    result = run_cli(
        tmp_path, "run", target("mlp_nonfinite"), "--cluster", "2xCPU", "--steps", "3", "-q", "--allow-nonfinite",
        "--master-port", str(free_port()), timeout_s=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert len([line for line in result.stdout.splitlines() if line.startswith("step")]) == 3
    warnings = [line for line in result.stderr.splitlines() if "not finite" in line]
    assert warnings == ["autoplan: warning: step 2: the loss is nan (not finite); training on (--allow-nonfinite)"]
