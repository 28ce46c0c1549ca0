"""``autoplan bench`` (the plan benchmark suite CI runs) and the ``autoplan.testing`` pytest plugin.

The shipped suite (``benchmarks/suite.yaml``) is planned once against its committed baseline;
the comparison rules run on a two-case suite of MLPs that plans in about a second. The plugin
is exercised through ``pytester`` on a user test file.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from autoplan.tools import bench, cli

pytest_plugins = ["pytester"]

REPO_ROOT = Path(__file__).resolve().parent.parent
SUITE = REPO_ROOT / "benchmarks" / "suite.yaml"
BASELINE = REPO_ROOT / "benchmarks" / "suite_baseline.json"
MODELS = REPO_ROOT / "benchmarks" / "suite_models.py"

MLP_SUITE = f"""
cases:
  - name: mlp_4xcpu
    model: {MODELS}:mlp_small
    cluster: 4xCPU
  - name: mlp_wide_8xh100
    model: {MODELS}:mlp_wide
    cluster: 8xH100
"""

Bench = Callable[..., tuple[int, str, str]]


@pytest.fixture
def run_bench(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Bench:
    """``run_bench(*argv) -> (exit code, stdout, stderr)`` of ``autoplan bench ...`` through
    ``cli.main`` (the bad-input contract included). Adds the sub-command to the parser when
    ``cli.build_parser`` does not register it itself."""
    build = cli.build_parser

    def build_with_bench() -> argparse.ArgumentParser:
        parser = build()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        if "bench" not in sub.choices:
            bench.add_parser(sub)
        return parser

    monkeypatch.setattr(cli, "build_parser", build_with_bench)

    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        rc = cli.main(["bench", *argv])
        out, err = capsys.readouterr()
        return rc, out, err

    return run


@pytest.fixture(scope="module")
def mlp_suite(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The two-case MLP suite and its results (the baseline the comparison tests edit)."""
    path = tmp_path_factory.mktemp("suite") / "mlp.yaml"
    path.write_text(MLP_SUITE)
    return path, bench.run_suite(bench.load_suite(path), suite_name=path.name)


def write_baseline(tmp_path: Path, results: dict[str, Any], edit: Callable[[dict[str, Any]], None]) -> Path:
    baseline = copy.deepcopy(results)
    edit(baseline)
    path = tmp_path / "baseline.json"
    bench.write_results(baseline, path)
    return path


def row(results: dict[str, Any], name: str) -> dict[str, Any]:
    return next(r for r in results["cases"] if r["name"] == name)


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


# -- the shipped suite -------------------------------------------------------------------------


@pytest.mark.slow
def test_shipped_suite_passes_against_committed_baseline(run_bench: Bench, tmp_path: Path) -> None:
    out_path = tmp_path / "results.json"
    rc, out, err = run_bench(str(SUITE), "--baseline", str(BASELINE), "--out", str(out_path), "--json")
    assert rc == 0, err
    results = json.loads(out)  # --json: stdout holds only the results, the report goes to stderr
    assert results == json.loads(out_path.read_text())
    names = [r["name"] for r in results["cases"]]
    assert names == [r["name"] for r in bench.load_results(BASELINE)["cases"]]
    assert all(r["status"] == "ok" for r in results["cases"])
    for name in names:
        assert f"  {name}: ok: step time" in err
    assert last_line(err) == f"autoplan bench: {len(names)} case(s) ok"


# -- results -----------------------------------------------------------------------------------


def test_results_are_deterministic_but_for_planning_time(mlp_suite: tuple[Path, dict[str, Any]]) -> None:
    path, first = mlp_suite
    again = bench.run_suite(bench.load_suite(path), suite_name=path.name)
    for results in (first, again):
        for r in results["cases"]:
            assert list(r) == [
                "name", "case", "status", "step_time_s", "mfu", "tokens_per_s", "peak_memory_bytes",
                "capacity_bytes", "memory_fraction", "fingerprint", "plan_digest", "decision", "solver",
                "plan_time_s",
            ]  # fmt: skip
            r.pop("plan_time_s")
    assert json.dumps(first) == json.dumps(again)
    assert row(first, "mlp_wide_8xh100")["decision"] == "intra=tensor"


def test_case_that_fails_to_plan_fails_the_run(run_bench: Bench, tmp_path: Path) -> None:
    (tmp_path / "models.py").write_text(
        "import torch, torch.nn.functional as F\nfrom torch import nn\nimport autoplan\n\n"
        "class Branchy(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.lin = nn.Linear(4, 4)\n\n"
        "    def forward(self, x):\n        return self.lin(x) if x.sum() > 0 else -self.lin(x)\n\n"
        "def build():\n    x = torch.randn(8, 4)\n"
        "    return autoplan.Workload(model=Branchy(), example_inputs=(x,), loss_fn=F.mse_loss, example_targets=(x,))\n"
    )
    suite = tmp_path / "suite.yaml"
    suite.write_text("cases:\n  - {name: branchy, model: models.py:build, cluster: 2xCPU}\n")
    rc, out, _ = run_bench(str(suite))
    assert rc == 1
    assert "FAILED" in out
    assert last_line(out).startswith("autoplan bench: 1 of 1 case(s) failed: branchy (failed to plan: ")


# -- comparison with a baseline ----------------------------------------------------------------


@pytest.mark.parametrize("key", ["step_time_s", "peak_memory_bytes"])
def test_worse_than_tolerance_fails_naming_the_case(
    run_bench: Bench, mlp_suite: tuple[Path, dict[str, Any]], tmp_path: Path, key: str
) -> None:
    suite, results = mlp_suite

    def better_baseline(b: dict[str, Any]) -> None:  # the baseline was 10% better: the run is 11% worse
        row(b, "mlp_wide_8xh100")[key] *= 0.9

    rc, out, _ = run_bench(str(suite), "--baseline", str(write_baseline(tmp_path, results, better_baseline)))
    assert rc == 1
    what = "step time" if key == "step_time_s" else "peak memory"
    assert f"  mlp_wide_8xh100: REGRESSED ({what} +11.1% > 2.0%): " in out
    assert f"{what} " in out and "(+11.11%, worse)" in out
    assert "  mlp_4xcpu: ok: " in out
    assert last_line(out) == f"autoplan bench: 1 of 2 case(s) failed: mlp_wide_8xh100 ({what} +11.1% > 2.0%)"


@pytest.mark.parametrize("tolerance", ["2%", "0.02"])
def test_worse_within_tolerance_passes(
    run_bench: Bench, mlp_suite: tuple[Path, dict[str, Any]], tmp_path: Path, tolerance: str
) -> None:
    suite, results = mlp_suite

    def slightly_better_baseline(b: dict[str, Any]) -> None:
        row(b, "mlp_4xcpu")["step_time_s"] *= 0.99

    baseline = write_baseline(tmp_path, results, slightly_better_baseline)
    rc, out, _ = run_bench(str(suite), "--baseline", str(baseline), "--tolerance", tolerance)
    assert rc == 0
    assert "  mlp_4xcpu: ok: step time 0.5874 ms -> 0.5934 ms (+1.01%, worse)" in out
    assert last_line(out) == "autoplan bench: 2 case(s) ok"


def test_baseline_case_missing_from_results_fails(
    run_bench: Bench, mlp_suite: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    suite, results = mlp_suite

    def extra_case(b: dict[str, Any]) -> None:
        b["cases"].append({**row(b, "mlp_4xcpu"), "name": "retired_case"})

    rc, out, _ = run_bench(str(suite), "--baseline", str(write_baseline(tmp_path, results, extra_case)))
    assert rc == 1
    assert "  retired_case: MISSING (in the baseline but not in the results)" in out
    assert "retired_case (in the baseline but not in the results)" in last_line(out)


def test_changed_placements_are_reported_without_failing(
    run_bench: Bench, mlp_suite: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    suite, results = mlp_suite

    def other_decision(b: dict[str, Any]) -> None:
        row(b, "mlp_wide_8xh100").update(plan_digest="0" * 16, decision="intra=data")

    rc, out, _ = run_bench(str(suite), "--baseline", str(write_baseline(tmp_path, results, other_decision)))
    assert rc == 0
    assert re.search(r"mlp_wide_8xh100: ok: step time [0-9.]+ ms \(same\)", out), out
    assert "placements changed (intra=data -> intra=tensor)" in out


def test_planning_time_fails_only_past_max_ratio(
    run_bench: Bench, mlp_suite: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    suite, results = mlp_suite

    def fast_baseline(b: dict[str, Any]) -> None:
        for r in b["cases"]:
            r["plan_time_s"] = 0.001

    baseline = str(write_baseline(tmp_path, results, fast_baseline))
    rc, out, _ = run_bench(str(suite), "--baseline", baseline)
    assert rc == 0
    assert "flagged: slower" in out
    rc, out, _ = run_bench(str(suite), "--baseline", baseline, "--max-plan-time-ratio", "3", "--quiet")
    assert rc == 1
    assert "planning time x" in last_line(out) and "> x3" in last_line(out)


# -- bad input: exit 2, one line ---------------------------------------------------------------

BAD_SUITES = {
    "bad_yaml": ("cases: [name: a\n", ["is not valid YAML (line 2)"]),
    "no_cases": ("defaults: {cluster: 4xCPU}\n", ["non-empty list 'cases:'"]),
    "unknown_field": (
        f"cases:\n  - {{name: a, model: '{MODELS}:mlp_small', clutser: 4xCPU}}\n",
        ["case 'a': unknown field 'clutser'"],
    ),
    "missing_model": ("cases:\n  - {name: a, cluster: 4xCPU}\n", ["case 'a': field 'model' is missing"]),
    "model_file_missing": (
        "cases:\n  - {name: a, model: nowhere.py:build, cluster: 4xCPU}\n",
        ["case 'a': field 'model': file 'nowhere.py' does not exist"],
    ),
    "bad_precision": (
        f"cases:\n  - {{name: a, model: '{MODELS}:mlp_small', cluster: 4xCPU, precision: fp8}}\n",
        ["case 'a': field 'precision': expected one of fp32, bf16, fp16, got 'fp8'"],
    ),
    "config_without_batch": (
        f"cases:\n  - {{name: a, model: '{MODELS}:mlp_small', cluster: 4xCPU, config: 'dp=2'}}\n",
        ["case 'a': field 'config'", "add global_batch_size"],
    ),
    "bad_cluster": (
        f"cases:\n  - {{name: a, model: '{MODELS}:mlp_small', cluster: 4xTPU}}\n",
        ["case 'a': field 'cluster'"],
    ),
    "duplicate_name": (
        f"cases:\n  - {{name: a, model: '{MODELS}:mlp_small', cluster: 4xCPU}}\n"
        f"  - {{name: a, model: '{MODELS}:mlp_wide', cluster: 4xCPU}}\n",
        ["case 'a': field 'name': 'a' is used by another case"],
    ),
}


def assert_one_error_line(rc: int, out: str, err: str, fragments: list[str]) -> None:
    assert rc == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("autoplan: error: ")
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.mark.parametrize("kind", sorted(BAD_SUITES))
def test_malformed_suite_exits_2_with_one_line(run_bench: Bench, tmp_path: Path, kind: str) -> None:
    text, fragments = BAD_SUITES[kind]
    suite = tmp_path / "suite.yaml"
    suite.write_text(text)
    assert_one_error_line(*run_bench(str(suite)), [str(suite), *fragments])


def test_missing_suite_file_exits_2_naming_it(run_bench: Bench, tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    assert_one_error_line(*run_bench(str(missing)), [f"suite file {str(missing)!r} does not exist"])


def test_bad_baseline_and_tolerance_exit_2(run_bench: Bench, tmp_path: Path) -> None:
    not_results = tmp_path / "plan.json"
    not_results.write_text('{"format": "autoplan.plan"}')
    assert_one_error_line(*run_bench(str(SUITE), "--baseline", str(not_results)), ["not an autoplan bench results"])
    assert_one_error_line(*run_bench(str(SUITE), "--tolerance", "two"), ["--tolerance", "percentage like 2%"])
    assert_one_error_line(*run_bench(str(SUITE), "--tolerance", "150%"), ["--tolerance"])
    no_dir = tmp_path / "missing" / "results.json"
    assert_one_error_line(*run_bench(str(SUITE), "--out", str(no_dir)), ["--out", "does not exist"])


# -- the pytest plugin -------------------------------------------------------------------------

USER_TESTS = """
import torch
import torch.nn.functional as F
from torch import nn

from autoplan.testing import assert_plan


def mlp_and_batch():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        return model, torch.randn(32, 64), torch.randn(32, 64)


def test_plan_meets_expectations(autoplan_plan):
    model, x, y = mlp_and_batch()
    plan = autoplan_plan(model, x, cluster="4xCPU", loss_fn=F.mse_loss, example_targets=(y,))
    assert_plan(plan, max_step_time_s=0.1, max_memory_fraction=0.01, parallelism={"intra": "data"},
                max_collectives={"all_gather": 0})


def test_plan_misses_expectations(autoplan_plan):
    model, x, y = mlp_and_batch()
    plan = autoplan_plan(model, x, loss_fn=F.mse_loss, example_targets=(y,))
    assert_plan(plan, max_step_time_s=1e-6, parallelism={"intra": "tensor", "dp": 4}, max_collectives=0,
                no_fallback_ops=True)
"""


def test_plugin_fixture_plans_and_assert_plan_explains_failures(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest("-p", "autoplan.testing")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "E * AssertionError: plan * for 1x4xCPU * does not meet 5 expectation(s):",
            "E * - estimated step time 0.5934 ms > max_step_time_s 0.001 ms",
            "E * - mesh axis 'intra' is data, expected tensor",
            "E * - parallelism?'dp'?: the plan has no configuration (plan with global_batch_size=... to get one)",
            "E * - 2 op(s) run replicated for lack of a sharding strategy: aten.mse_loss.default, "
            "aten.mse_loss_backward.default",
            "E * - 1 collectives per step > max_collectives 0 (all_reduce x1)",
        ]
    )
