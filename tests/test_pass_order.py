"""autoplan.passes.pass_order: the planner runs the graph passes through the one ordered list, in its order."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

import autoplan
from autoplan.passes import pass_order

PLANNER = Path(__file__).resolve().parent.parent / "autoplan" / "planner"
NAMES = [p.name for p in pass_order.PASS_ORDER]


class _Blocks(nn.Module):
    """Four repeated residual blocks between an input and an output layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 16)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(4))
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.layers:
            x = x + block(x)
        return self.out(x)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


@pytest.fixture
def ran(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the passes the planner runs, in the order it runs them."""
    names: list[str] = []
    for entry in pass_order.PASS_ORDER:

        def recording(*args: object, _entry: pass_order.GraphPass = entry, **kwargs: object) -> object:
            names.append(_entry.name)
            return _entry.run(*args, **kwargs)

        monkeypatch.setattr(pass_order, entry.name.upper(), dataclasses.replace(entry, run=recording))
    return names


def test_every_entry_is_the_module_constant_of_its_name_and_names_are_unique() -> None:
    assert len(set(NAMES)) == len(NAMES)
    for entry in pass_order.PASS_ORDER:
        assert getattr(pass_order, entry.name.upper()) is entry
        assert "->" in entry.contract


def test_the_planner_calls_no_pass_function_past_the_list() -> None:
    """A pass function called directly in autoplan/planner would run outside the listed order."""
    functions = {p.run.__name__ for p in pass_order.PASS_ORDER}
    direct = []
    for path in sorted(PLANNER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
                if name in functions:
                    direct.append(f"{path.name}:{node.lineno} {name}")
    assert direct == []


def test_a_plan_runs_the_passes_in_the_listed_order(ran: list[str]) -> None:
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    autoplan.plan(_Blocks(), "2xCPU", example_inputs=(x,), loss_fn=_mse, example_targets=(y,))
    assert ran == [
        "trace", "layers", "strategies", "costing", "redistribute", "comm_order", "overlap", "liveness", "explain"
    ]  # fmt: skip
    assert ran == sorted(ran, key=NAMES.index)


def test_a_plan_for_a_global_batch_ends_with_the_stage_program_in_the_listed_order(
    ran: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The joint search traces and prices several micro-batch sizes first (depth, trace, rebatch,
    layers, then strategies, costing, expand per ILP); the chosen stage's program is solved last."""
    monkeypatch.setenv("AUTOPLAN_WORKERS", "1")  # every ILP in this process, where the passes are recorded
    monkeypatch.setenv("AUTOPLAN_NO_PLAN_CACHE", "1")  # a cache hit would run no pass
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    autoplan.plan(_Blocks(), "2xCPU", example_inputs=(x,), loss_fn=_mse, example_targets=(y,), global_batch_size=8)
    assert ran[0] == "depth"
    ilps = [i for i, name in enumerate(ran) if name == "strategies"]
    assert len(ilps) > 1
    assert all(ran[i : i + 3] == ["strategies", "costing", "expand"] for i in ilps)
    assert ran[-9:] == [
        "layers", "strategies", "costing", "expand", "redistribute", "comm_order", "overlap", "liveness", "explain"
    ]  # fmt: skip
    assert set(ran) == set(NAMES)
