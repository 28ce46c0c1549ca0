"""A plan cache hit is proven valid: a stale entry is a miss, never a wrong plan.

The cache key covers the ``forward`` bytecode of every module class, not the module-level
helpers ``forward`` calls. Editing such a helper so the graph changes used to return the old
plan (exit 0), which ``run --plan`` then refused (fingerprint mismatch) while re-planning kept
returning it. A hit is now checked against a trace of the step the plan is for: the planned
fingerprint must be the model's, else the entry is re-planned and replaced.
"""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import pytest

from autoplan.api import plan
from autoplan.planner import joint, plan_cache, tracing
from autoplan.planner.plan import Plan
from autoplan.tools.loader import build_workload
from autoplan.workload import Workload

MODEL_FILE = """
import torch
import torch.nn.functional as F
from torch import nn

import autoplan


def act(x):
    return {act_body}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + act(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build():
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    return autoplan.Workload(model=Net(), example_inputs=(x,), loss_fn=F.mse_loss, example_targets=(y,), optimizer="sgd")
"""


def _write(path: Path, act_body: str) -> None:
    path.write_text(textwrap.dedent(MODEL_FILE).format(act_body=act_body))


def _plan(path: Path) -> tuple[Plan, Workload]:
    wl = build_workload(f"{path}:build", device="meta")
    p = plan(
        wl.model, "2xCPU", example_inputs=wl.example_inputs, loss_fn=wl.loss_fn,
        example_targets=wl.example_targets, optimizer=wl.optimizer, global_batch_size=8,
    )  # fmt: skip
    return p, wl


def _fingerprint_of_model(p: Plan, wl: Workload) -> str:
    """What ``parallelize`` / ``run --plan`` trace and compare with the plan's fingerprint."""
    return tracing.trace_for_plan(p, wl.model, wl.example_inputs, wl.example_targets, wl.loss_fn).fingerprint


def test_editing_a_helper_that_forward_calls_misses_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("AUTOPLAN_NO_PLAN_CACHE", raising=False)
    model_file = tmp_path / "model_with_helper.py"
    _write(model_file, "torch.relu(x)")
    first, wl = _plan(model_file)
    assert first.fingerprint == _fingerprint_of_model(first, wl)
    assert len(list((tmp_path / "cache" / "plans").glob("*.json"))) == 1

    _write(model_file, "torch.tanh(torch.relu(x))")  # one op more per block: another graph
    second, wl2 = _plan(model_file)
    assert plan_cache.plan_key(
        wl.model, wl.example_inputs, wl.example_targets, wl.loss_fn, first.cluster, {}, None
    ) == plan_cache.plan_key(wl2.model, wl2.example_inputs, wl2.example_targets, wl2.loss_fn, first.cluster, {}, None)
    assert second.fingerprint == _fingerprint_of_model(second, wl2)
    assert second.fingerprint != first.fingerprint

    # the stale entry was replaced: planning the edited model again is a (valid) hit
    def no_search(*args: object, **kwargs: object) -> None:
        raise AssertionError("re-planned although the cache holds a valid plan")

    monkeypatch.setattr(joint, "_search", no_search)
    t0 = time.perf_counter()
    third, _ = _plan(model_file)
    hit_s = time.perf_counter() - t0
    assert third.to_dict() == second.to_dict()
    print(f"\ncache hit with its trace check: {hit_s:.2f} s")
