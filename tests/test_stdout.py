"""stdout belongs to autoplan: ``--json`` output parses, and nothing a library prints lands there.

Regression: highspy 1.16 prints a two-line banner to file descriptor 1 from C++ whenever a solver
is constructed (about 16 times in a joint search), so ``autoplan plan --json`` was not JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import test_cli
from tests.test_cli import HF, REPO_ROOT, target

NO_CACHE = {"AUTOPLAN_NO_PLAN_CACHE": "1", "TRANSFORMERS_VERBOSITY": "error"}
"""A cached plan would skip the solver, and with it the output under test."""


def run_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return test_cli.run_cli(cwd, *args, env=NO_CACHE)


def test_plan_json_parses_in_a_fresh_process(tmp_path):
    out = tmp_path / "plan.json"
    r = run_cli(tmp_path, "plan", target("mlp"), "--cluster", "2xCPU", "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    estimate = json.loads(r.stdout)  # the whole of stdout is one JSON document
    assert estimate["step_time_s"] > 0
    assert "HiGHS" not in r.stdout


@pytest.mark.slow
def test_joint_search_plan_json_parses_in_a_fresh_process(tmp_path):
    out = tmp_path / "plan.json"
    r = run_cli(tmp_path, "plan", f"{HF}:gpt2_tiny", "--cluster", "2x8xH100", "--global-batch-size", "32",
                "--out", str(out), "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["step_time_s"] > 0


@pytest.mark.slow
def test_show_json_parses(tmp_path):
    out = tmp_path / "plan.json"
    assert run_cli(tmp_path, "plan", target("mlp"), "--cluster", "2xCPU", "--out", str(out), "-q").returncode == 0
    r = run_cli(tmp_path, "show", str(out), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["cluster"]["devices_per_node"] == 2


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO_ROOT,
        env={**os.environ, **NO_CACHE},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_solver_prints_nothing_to_stdout_from_the_python_api():
    """The banner is discarded where the solver is built, so API users' stdout stays theirs too."""
    r = _run_python(
        """
        from tests import zoo
        zoo.plan_workload(zoo.cli_mlp())
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""


def test_owned_stdout_sends_library_output_to_stderr_and_ours_to_stdout():
    """C-level writes to fd 1, Python prints and child processes inside a command go to stderr;
    what autoplan writes through ``console.stdout()`` goes to the real stdout, in order."""
    r = _run_python(
        """
        import os, subprocess, sys
        from autoplan.tools import console
        print("before")
        with console.owned_stdout():
            os.write(1, b"c-banner\\n")
            print("library print")
            subprocess.call([sys.executable, "-c", "print('child chatter')"])
            print("ours 1", file=console.stdout())
            subprocess.call([sys.executable, "-c", "print('ours from a child')"], stdout=console.subprocess_stdout())
            console.stdout().write("ours 2\\n")
        print("after")
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["before", "ours 1", "ours from a child", "ours 2", "after"]
    assert r.stderr.splitlines() == ["c-banner", "library print", "child chatter"]


def test_planning_a_mixture_of_experts_leaves_stderr_empty(tmp_path):
    """torch.export's functionalization of the MoE op's in-place writes deep-copies the module
    call graph, and torch 2.13 warns (FutureWarning, ``isinstance(treespec, LeafSpec)``) from
    its own code: a user saw two warning lines per plan. Nothing but our own output reaches either
    stream."""
    out = tmp_path / "plan.json"
    r = run_cli(tmp_path, "plan", f"{HF}:mixtral_zoo", "--cluster", "2xCPU", "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["step_time_s"] > 0
    assert r.stderr == ""
