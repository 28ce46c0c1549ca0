"""CLI start-up: commands that do not plan or train import no torch.

``autoplan --help``, ``autoplan <cmd> --help`` for every subcommand, and the review commands
(``show``, ``show --json``, ``explain --op/--param``, ``diff``, ``report``) on existing plan files
run each in a fresh interpreter (``python -c`` calling ``autoplan.tools.cli.main``), which then reports
the heavy modules it has loaded: there must be none. Importing torch costs seconds (a review
command then takes 4-5 s instead of well under one). Each command's output is also checked
against the same function called in this (torch-loaded) process, so the torch-free path prints
the same bytes.

Two plan files are made once per module: an ILP plan of the ``mlp`` on 2 CPU ranks and a
global-batch pipeline plan of ``gpt2_4_layers`` (``tests.zoo.ilp_and_pipeline_plans``). The
times are measured by ``benchmarks/cli_startup.py``, never here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.planner.plan import Plan
from autoplan.tools import report
from autoplan.tools.cli import build_parser
from autoplan.tools.review import diff_plans, diff_text, explain, explain_text, show_text
from tests import zoo

REPO_ROOT = Path(__file__).resolve().parent.parent
HEAVY_MODULES = ("torch", "numpy", "sympy", "transformers", "highspy", "scipy", "pulp")
"""Modules a command that only reads a plan file (or prints help) has no use for."""
SUBPROCESS_TIMEOUT_S = 120
_MARK = "autoplan-startup-heavy-modules: "
_PROBE = f"""
import json, sys
from autoplan.tools.cli import main
rc = main(sys.argv[1:])
print({_MARK!r} + json.dumps(sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules)), file=sys.stderr)
sys.exit(rc)
"""


def run_probe(*args: str) -> tuple[int, str, list[str]]:
    """``autoplan ARGS`` in a fresh interpreter: (exit code, stdout, heavy modules it imported)."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    marks = [line for line in proc.stderr.splitlines() if line.startswith(_MARK)]
    assert marks, f"autoplan {' '.join(args)} did not finish: {proc.stderr[-2000:]}"
    return proc.returncode, proc.stdout, json.loads(marks[-1][len(_MARK) :])


def subcommands() -> list[str]:
    parser = build_parser()
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(actions) == 1
    return sorted(actions[0].choices)


@pytest.fixture(scope="module")
def plan_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("startup")
    out = {}
    for kind, plan in zoo.ilp_and_pipeline_plans().items():
        out[kind] = tmp / f"{kind}.json"
        plan.save(out[kind])
    return out


def test_subcommands_are_listed():
    assert {"plan", "show", "explain", "diff", "report", "run"} <= set(subcommands())


@pytest.mark.parametrize("command", [[], *([cmd] for cmd in subcommands())], ids=lambda c: " ".join(c) or "autoplan")
def test_help_imports_no_torch(command: list[str]):
    rc, out, heavy = run_probe(*command, "--help")
    assert rc == 0
    assert out.startswith("usage: autoplan")
    assert heavy == []


@pytest.mark.parametrize("kind", ["ilp", "pipeline"])
def test_show_imports_no_torch(plan_files: dict[str, Path], kind: str):
    rc, out, heavy = run_probe("show", str(plan_files[kind]))
    assert (rc, heavy) == (0, [])
    assert out == show_text(Plan.load(plan_files[kind]))


@pytest.mark.parametrize("kind", ["ilp", "pipeline"])
def test_show_json_imports_no_torch(plan_files: dict[str, Path], kind: str):
    rc, out, heavy = run_probe("show", "--json", str(plan_files[kind]))
    assert (rc, heavy) == (0, [])
    assert json.loads(out) == json.loads(plan_files[kind].read_text())


@pytest.mark.parametrize("kind", ["ilp", "pipeline"])
def test_explain_op_imports_no_torch(plan_files: dict[str, Path], kind: str):
    plan = Plan.load(plan_files[kind])
    op = next(n for n, x in plan.alternatives.items() if x.alternatives and n in plan.nodes)
    rc, out, heavy = run_probe("explain", str(plan_files[kind]), "--op", op)
    assert (rc, heavy) == (0, [])
    assert out == explain_text(explain(plan, op=op))
    assert "chosen" in out


@pytest.mark.parametrize("kind", ["ilp", "pipeline"])
def test_explain_param_json_imports_no_torch(plan_files: dict[str, Path], kind: str):
    plan = Plan.load(plan_files[kind])
    param = plan.param_names[0]
    rc, out, heavy = run_probe("explain", str(plan_files[kind]), "--param", param, "--json")
    assert (rc, heavy) == (0, [])
    assert json.loads(out) == explain(plan, param=param).to_dict()


def test_diff_imports_no_torch(plan_files: dict[str, Path]):
    rc, out, heavy = run_probe("diff", str(plan_files["ilp"]), str(plan_files["pipeline"]))
    assert (rc, heavy) == (0, [])
    a, b = Plan.load(plan_files["ilp"]), Plan.load(plan_files["pipeline"])
    assert out == diff_text(diff_plans(a, b), limit=20)


@pytest.mark.parametrize("kind", ["ilp", "pipeline"])
def test_report_imports_no_torch(plan_files: dict[str, Path], kind: str, tmp_path: Path):
    html = tmp_path / f"{kind}.html"
    rc, out, heavy = run_probe("report", str(plan_files[kind]), "-o", str(html))
    assert (rc, heavy) == (0, [])
    assert out == f"wrote {html}\n"
    assert html.read_text(encoding="utf-8") == report.render_html(Plan.load(plan_files[kind]))


@pytest.mark.slow
def test_autoplan_plan_stays_the_planning_function_after_the_plan_module_is_imported():
    """The exports are lazy, and ``autoplan/planner/plan.py`` (torch-free, loaded first by the review
    commands) shares its name with the function ``autoplan.plan``: the function must win."""
    code = (
        "import autoplan\n"
        "from autoplan.planner.plan import Plan\n"
        "assert autoplan.Plan is Plan\n"
        "assert callable(autoplan.plan) and autoplan.plan.__module__ == 'autoplan.api', autoplan.plan\n"
        "from autoplan import plan\n"
        "assert plan is autoplan.plan\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_bad_plan_file_is_refused_without_torch(tmp_path: Path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "autoplan.plan", "version": 1}', encoding="utf-8")
    rc, out, heavy = run_probe("show", str(bad))
    assert (rc, out, heavy) == (2, "", [])
