"""Golden snapshots: the plan file and the generated per-rank program of three small models, byte
for byte, so that an unintended change in either shows up as a diff in review.

Cases (every plan made by ``autoplan plan ... --no-profile`` run in this process from the
repository root, plan cache off, analytic op times):

* ``mlp.4xcpu``: ``tests/cli_models.py:mlp`` on ``4xCPU`` (the per-operator ILP, one mesh axis);
* ``gpt2_tiny.2x2``: ``examples/hf_models.py:gpt2_tiny`` on ``4xCPU --mesh 2,2`` (two mesh axes);
* ``gpt2_tiny.pipeline_4xcpu``: the same model, ``--global-batch-size 16 --config
  dp=2,tp=1,pp=2,microbatch_size=2,num_microbatches=4,schedule=1f1b`` (a 2-stage 1F1B pipeline).

Files: ``tests/golden/plans/<case>.plan.json`` and ``tests/golden/code/<case>.rank<r>.py.txt``
(``autoplan.parallelize(..., plan=plan).code`` of rank 0, and of the last rank for the pipeline,
built on a fake process group of 4 ranks as ``benchmarks/plan_identity.py`` does; no communication
happens while generating). The ``.txt`` suffix keeps generated code out of ruff and pytest.

Machine independence: the target is given relative to the repository root, so the plan's
``workload`` field holds no absolute path. The plan's ``versions`` field is *normalised*: every
value but autoplan's own becomes ``"<normalised>"`` (the keys stay, so recording a new software
version is still a diff); torch and transformers themselves are pinned by ``constraints.txt``,
and a local build tag such as ``+cpu`` must not fail the test. Nothing else is rewritten.

After an intended change, regenerate the snapshots and review the diff::

    AUTOPLAN_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py
"""

from __future__ import annotations

import contextlib
import difflib
import io
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import autoplan
from autoplan.testing import generated_program
from autoplan.tools.cli import main as autoplan_main

ROOT = Path(__file__).resolve().parent.parent
GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
PLANS_DIR = GOLDEN_DIR / "plans"
CODE_DIR = GOLDEN_DIR / "code"
UPDATE_GOLDEN = os.environ.get("AUTOPLAN_UPDATE_GOLDEN") == "1"
WORLD_SIZE = 4
NORMALISED = "<normalised>"
MAX_DIFF_LINES = 200


@dataclass(frozen=True)
class GoldenCase:
    """One snapshot case: ``autoplan plan TARGET ARGS`` and the ranks whose program is recorded."""

    name: str
    target: str  # relative to the repository root
    args: tuple[str, ...]
    mesh_shape: tuple[int, ...] | None
    code_ranks: tuple[int, ...]

    def plan_file(self) -> Path:
        return PLANS_DIR / f"{self.name}.plan.json"

    def code_file(self, rank: int) -> Path:
        return CODE_DIR / f"{self.name}.rank{rank}.py.txt"


MLP = "tests/cli_models.py:mlp"
GPT2 = "examples/hf_models.py:gpt2_tiny"
PIPELINE_CONFIG = "dp=2,tp=1,pp=2,microbatch_size=2,num_microbatches=4,schedule=1f1b"
CASES = (
    GoldenCase("mlp.4xcpu", MLP, ("--cluster", "4xCPU"), None, (0,)),
    GoldenCase("gpt2_tiny.2x2", GPT2, ("--cluster", "4xCPU", "--mesh", "2,2"), (2, 2), (0,)),
    GoldenCase(
        "gpt2_tiny.pipeline_4xcpu",
        GPT2,
        ("--cluster", "4xCPU", "--global-batch-size", "16", "--config", PIPELINE_CONFIG),
        None,
        (0, WORLD_SIZE - 1),
    ),
)
GOLDEN_FILES = [path for case in CASES for path in (case.plan_file(), *map(case.code_file, case.code_ranks))]


# --- normalisation ------------------------------------------------------------------------------

_VERSIONS_BLOCK = re.compile(r'\n "versions": \{\n(?P<body>(?:  "[^"\n]*": "[^"\n]*",?\n)*) \}')
_VERSION_ENTRY = re.compile(r'(?P<key>"[^"\n]*"): "[^"\n]*"')


def normalise_versions(plan_text: str) -> str:
    """The plan file's text with every ``versions`` value but autoplan's replaced by ``<normalised>``."""
    blocks = list(_VERSIONS_BLOCK.finditer(plan_text))
    assert len(blocks) == 1, "the plan file has no (or more than one) top-level 'versions' block to normalise"

    def entry(match: re.Match[str]) -> str:
        key = match.group("key")
        return match.group(0) if key == '"autoplan"' else f'{key}: "{NORMALISED}"'

    body = blocks[0].group("body")
    start, end = blocks[0].span("body")
    return plan_text[:start] + _VERSION_ENTRY.sub(entry, body) + plan_text[end:]


def test_normalise_versions_keeps_autoplan_and_the_keys():
    text = '{\n "a": 1,\n "versions": {\n  "autoplan": "0.1.0",\n  "torch": "2.13.0+cpu"\n },\n "workload": "x"\n}\n'
    assert normalise_versions(text) == text.replace("2.13.0+cpu", NORMALISED)
    with pytest.raises(AssertionError):
        normalise_versions('{\n "a": 1\n}\n')


# --- producing the files ------------------------------------------------------------------------


@contextlib.contextmanager
def _at_repository_root() -> Iterator[None]:
    """cwd = repository root, plan cache off, stdout captured; all restored after."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        mp.setenv("AUTOPLAN_NO_PLAN_CACHE", "1")
        mp.setenv("TRANSFORMERS_VERBOSITY", "error")
        with contextlib.redirect_stdout(io.StringIO()):
            yield


def plan_text(case: GoldenCase, out: Path) -> str:
    """``autoplan plan`` of the case, in this process; the plan file's text, versions normalised."""
    with _at_repository_root():
        rc = autoplan_main(["plan", case.target, *case.args, "--no-profile", "-q", "--out", str(out)])
    assert rc == 0, f"autoplan plan {case.target} {' '.join(case.args)} exited {rc}"
    return normalise_versions(out.read_text(encoding="utf-8"))


def rank_code(case: GoldenCase, plan_file: Path, rank: int) -> str:
    """The program ``autoplan.parallelize`` generates for ``rank`` on a fake process group."""
    from autoplan.tools.loader import build_workload

    plan = autoplan.Plan.load(str(plan_file))
    cluster = autoplan.Cluster.preset("4xCPU", mesh_shape=case.mesh_shape) if case.mesh_shape else None
    cluster = cluster or autoplan.Cluster.preset("4xCPU")
    assert cluster.world_size == WORLD_SIZE
    with _at_repository_root():
        return generated_program(build_workload(case.target, device="cpu"), cluster, plan, rank=rank)


@pytest.fixture(scope="module")
def produced(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, str]:
    """Every golden file's current content, by its path under ``tests/golden``."""
    tmp = tmp_path_factory.mktemp("golden")
    files: dict[Path, str] = {}
    for case in CASES:
        plan_file = tmp / case.plan_file().name
        files[case.plan_file()] = plan_text(case, plan_file)
        for rank in case.code_ranks:
            files[case.code_file(rank)] = rank_code(case, plan_file, rank)
    return files


# --- the comparison -----------------------------------------------------------------------------


def _diff(expected: str, actual: str, path: Path) -> str:
    name = str(path.relative_to(ROOT))
    lines = list(
        difflib.unified_diff(
            expected.splitlines(keepends=True), actual.splitlines(keepends=True), f"{name} (golden)", f"{name} (now)"
        )
    )
    more = f"\n... {len(lines) - MAX_DIFF_LINES} more diff lines" if len(lines) > MAX_DIFF_LINES else ""
    return "".join(lines[:MAX_DIFF_LINES]) + more


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=[p.name for p in GOLDEN_FILES])
def test_output_matches_the_golden_snapshot(produced, path):
    """Regenerate with ``AUTOPLAN_UPDATE_GOLDEN=1`` (see the module docstring)."""
    actual = produced[path].encode("utf-8")
    if UPDATE_GOLDEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(actual)
    assert path.exists(), f"{path} is missing: run with AUTOPLAN_UPDATE_GOLDEN=1 to create it"

    expected = path.read_bytes()
    if actual != expected:
        pytest.fail(
            f"{path.relative_to(ROOT)} differs from the output now (AUTOPLAN_UPDATE_GOLDEN=1 rewrites it after an "
            f"intended change):\n{_diff(expected.decode('utf-8', 'replace'), produced[path], path)}",
            pytrace=False,
        )


def test_the_golden_folders_hold_only_the_snapshots_of_the_cases():
    held = {p for folder in (PLANS_DIR, CODE_DIR) if folder.is_dir() for p in folder.iterdir()}
    assert held == set(GOLDEN_FILES), (
        f"stray: {sorted(str(p) for p in held - set(GOLDEN_FILES))}, "
        f"missing: {sorted(str(p) for p in set(GOLDEN_FILES) - held)}"
    )


def test_the_plan_snapshots_hold_the_repository_relative_workload(produced):
    for case in CASES:
        assert f'\n "workload": "{case.target}"\n' in produced[case.plan_file()]
        assert str(ROOT) not in produced[case.plan_file()]
