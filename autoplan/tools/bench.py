"""``autoplan bench``: plan a suite of cases and compare the plans with a baseline (for CI).

    autoplan bench benchmarks/suite.yaml --out results.json
    autoplan bench benchmarks/suite.yaml --baseline benchmarks/suite_baseline.json --tolerance 2%

**Suite file** (YAML, read with ``yaml.safe_load`` within bounds: ``autoplan.cost_models.files.parse_yaml``):
``cases``, a list of mappings, and optional ``defaults`` merged under every case. A case has

* ``name`` (unique) and ``model``: ``FILE.py:FUNCTION`` returning an ``autoplan.Workload`` (a
  relative path is looked up next to the suite file, then in the working directory) or
  ``package.module:FUNCTION``;
* ``cluster``: preset (``4xCPU``, ``2x8xH100``) or cluster file (looked up like ``model``), and
  optional ``mesh`` (``2,2``);
* optional ``global_batch_size``, ``precision``, ``optimizer``, ``config`` (the syntax of
  ``autoplan plan --config``: ``dp=2,tp=2,pp=2,microbatch_size=1,num_microbatches=8``),
  ``time_limit_s`` and ``profile`` (``none``, the default: analytic op times, the same on every
  machine; ``auto``: this machine's profile database; or a database file).

Every case is planned exactly as ``autoplan plan`` would (its command line is built and parsed by
the CLI's own parser), with the plan cache off, and gives one row of the results.

**Results file** (JSON, ``"format": "autoplan.bench"``, ``"version": 1``): per case the
estimated step time, MFU and tokens/s (plans for a global batch), peak memory per device (bytes
and fraction of capacity), the graph fingerprint, the *plan digest* (a hash of the decisions:
placements, configuration, stages; a changed decision shows even when its estimate is equal),
the solver status and gap, and the planning wall time. Keys are written in a fixed order;
``plan_time_s`` is the only field that differs between two runs on the same software.

**Comparison** (``--baseline``): a case *regresses* when its estimated step time or peak memory
per device grew by more than ``--tolerance``; a baseline case missing from the suite or failing to
plan also fails. Planning time is flagged when it grew more than ``PLAN_TIME_FLAG_RATIO`` times,
and fails only past ``--max-plan-time-ratio``. Exit code 0: no failure; 1: a failure (the last
line names the cases); 2: bad input (one line ``autoplan: error: ...``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TextIO

from autoplan.cost_models.config import PRECISIONS
from autoplan.cost_models.echo import clip
from autoplan.cost_models.errors import PlanError, PlanFileError
from autoplan.cost_models.files import (
    MAX_CLUSTER_FILE_BYTES,
    MAX_PLAN_FILE_BYTES,
    InputLimitError,
    atomic_write,
    parse_json,
    parse_yaml,
    read_limited,
    refuse_overwriting_inputs,
)
from autoplan.cost_models.memory import OPTIMIZERS
from autoplan.planner.plan import Plan, software_versions
from autoplan.tools import common, console, planning

log = logging.getLogger(__name__)

RESULTS_FORMAT = "autoplan.bench"
RESULTS_VERSION = 1
EXIT_OK, EXIT_FAILED = 0, 1
PLAN_TIME_FLAG_RATIO = 1.5
"""Planning this many times slower than the baseline is flagged (never failing on its own:
wall-clock time depends on the machine and its load)."""
CASE_FIELDS = (
    "name",
    "model",
    "cluster",
    "mesh",
    "global_batch_size",
    "precision",
    "optimizer",
    "config",
    "time_limit_s",
    "profile",
)
_NO_PLAN_CACHE_ENV = "AUTOPLAN_NO_PLAN_CACHE"


class SuiteError(PlanFileError):
    """A benchmark suite or results file is missing or malformed."""


# -- the suite ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One benchmark case: what ``autoplan plan`` is asked to plan."""

    name: str
    model: str
    """``FILE.py:FUNCTION`` as written in the suite (results carry this, not the resolved path)."""
    target: str
    """``model`` with its file resolved to an absolute path (what is planned)."""
    cluster: str
    """Preset, or a cluster file resolved to an absolute path."""
    mesh: str | None = None
    """Logical mesh shape like ``2,2`` (``None``: the cluster's)."""
    global_batch_size: int | None = None
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    optimizer: str | None = None
    """``None``: the workload's optimizer."""
    config: str | None = None
    """Fixed configuration in ``--config`` syntax (needs ``global_batch_size``)."""
    time_limit_s: float = 120.0
    profile: str = "none"
    """``none`` (analytic op times), ``auto`` or a profile database file."""
    spec: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The case's fields but its name, as written in the suite (defaults merged), recorded in the
    results: a baseline row made from another definition is reported."""

    def plan_argv(self) -> list[str]:
        """The ``autoplan plan`` command line of this case."""
        argv = ["plan", self.target, "--cluster", self.cluster, "--out", os.devnull]
        argv += ["--precision", self.precision, "--time-limit", repr(float(self.time_limit_s))]
        if self.mesh is not None:
            argv += ["--mesh", self.mesh]
        if self.global_batch_size is not None:
            argv += ["--global-batch-size", str(self.global_batch_size)]
        if self.optimizer is not None:
            argv += ["--optimizer", self.optimizer]
        if self.config is not None:
            argv += ["--config", self.config]
        if self.profile == "none":
            argv.append("--no-profile")
        elif self.profile != "auto":
            argv += ["--profile-db", self.profile]
        return argv


def _read_text(path: Path, what: str, *, max_bytes: int) -> str:
    try:
        return read_limited(path, max_bytes=max_bytes).decode("utf-8")
    except InputLimitError as exc:
        raise SuiteError(f"{what} {clip(str(path))} {exc}: check the path") from None
    except FileNotFoundError:
        raise SuiteError(f"{what} {str(path)!r} does not exist: check the path") from None
    except UnicodeDecodeError as exc:
        raise SuiteError(f"{what} {str(path)!r} is not a UTF-8 text file ({exc.reason} at byte {exc.start})") from exc
    except OSError as exc:
        raise SuiteError(f"cannot read {what} {str(path)!r}: {exc.strerror}") from exc


def _resolve(path_text: str, suite_dir: Path) -> Path | None:
    """``path_text`` next to the suite file, else in the working directory (``None``: neither)."""
    for base in (suite_dir, Path.cwd()):
        candidate = (base / path_text).resolve()
        if candidate.is_file():
            return candidate
    return None


class _CaseReader:
    """Validates one case's fields; every error names the suite file, the case and the field."""

    def __init__(self, where: str, case: str, values: Mapping[str, Any], suite_dir: Path) -> None:
        self.where, self.case, self.values, self.suite_dir = where, case, values, suite_dir

    def error(self, field: str, message: str) -> SuiteError:
        return SuiteError(f"{self.where}: case {self.case}: field {field!r}: {message}")

    def text(self, field: str, *, required: bool = False) -> str | None:
        value = self.values.get(field)
        if value is None:
            if required:
                raise SuiteError(f"{self.where}: case {self.case}: field {field!r} is missing: add it")
            return None
        if not isinstance(value, str) or not value.strip():
            raise self.error(field, f"expected a non-empty string, got {value!r}")
        return value.strip()

    def model(self) -> str:
        model = self.text("model", required=True)
        assert model is not None
        where, sep, func = model.rpartition(":")
        if not sep or not where or not func:
            raise self.error("model", f"{model!r} is malformed: expected FILE.py:FUNCTION or package.module:FUNCTION")
        if not where.endswith(".py"):
            return model
        path = _resolve(where, self.suite_dir)
        if path is None:
            raise self.error(
                "model",
                f"file {where!r} does not exist (looked in {str(self.suite_dir)!r} and {str(Path.cwd())!r}): "
                "check the path",
            )
        return f"{path}:{func}"

    def cluster(self, mesh: str | None) -> str:
        spec = self.text("cluster", required=True)
        assert spec is not None
        if Path(spec).suffix.lower() in (".yaml", ".yml", ".json"):
            path = _resolve(spec, self.suite_dir)
            if path is None:
                raise self.error("cluster", f"cluster file {spec!r} does not exist: check the path")
            spec = str(path)
        try:
            common.cluster_from_args(spec, mesh)
        except PlanError as exc:
            raise self.error("cluster" if mesh is None else "cluster/mesh", str(exc)) from exc
        return spec

    def mesh(self) -> str | None:
        value = self.values.get("mesh")
        if value is None:
            return None
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            value = ",".join(str(v) for v in value)
        if not isinstance(value, str) or not all(p.strip().isdigit() and int(p) > 0 for p in value.split(",")):
            raise self.error("mesh", f"expected sizes like '2,2' or [2, 2], got {value!r}")
        return ",".join(p.strip() for p in value.split(","))

    def positive(self, field: str, kind: type) -> Any:
        value = self.values.get(field)
        if value is None:
            return None
        numeric = (int,) if kind is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, numeric) or not 0 < value < math.inf:
            raise self.error(field, f"expected a positive {'integer' if kind is int else 'number'}, got {value!r}")
        return value

    def choice(self, field: str, choices: Sequence[str]) -> str | None:
        value = self.values.get(field)
        if value is not None and value not in choices:
            raise self.error(field, f"expected one of {', '.join(choices)}, got {value!r}")
        return value

    def config(self, global_batch_size: int | None) -> str | None:
        value = self.values.get("config")
        if value is None:
            return None
        if isinstance(value, Mapping):
            value = ",".join(f"{k}={'/'.join(map(str, v)) if isinstance(v, list) else v}" for k, v in value.items())
        if not isinstance(value, str):
            raise self.error("config", f"expected KEY=VALUE,... like 'dp=2,pp=2,num_microbatches=4', got {value!r}")
        if global_batch_size is None:
            raise self.error("config", "a configuration splits a global batch: add global_batch_size")
        try:
            common.config_from_text(value)
        except PlanError as exc:
            raise self.error("config", str(exc)) from exc
        return value

    def profile(self) -> str:
        value = self.text("profile") or "none"
        if value in ("none", "auto"):
            return value
        path = _resolve(value, self.suite_dir)
        if path is None:
            raise self.error("profile", f"expected none, auto or a profile database file; {value!r} does not exist")
        return str(path)


def load_suite(path: str | os.PathLike[str]) -> list[Case]:
    """The cases of a suite file, every field checked (:class:`SuiteError` names the case and field)."""
    import yaml  # only for its error type; not loaded at CLI start-up (parse_yaml loads it)

    path = Path(path)
    where = f"suite file {str(path)!r}"
    try:
        doc = parse_yaml(_read_text(path, "suite file", max_bytes=MAX_CLUSTER_FILE_BYTES))
    except InputLimitError as exc:
        raise SuiteError(f"{where} {exc}: write each case out") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise SuiteError(f"{where} is not valid YAML{at}: {problem}") from exc
    if not isinstance(doc, Mapping) or not isinstance(doc.get("cases"), list) or not doc["cases"]:
        raise SuiteError(f"{where} must be a mapping with a non-empty list 'cases:' of cases")
    unknown = sorted(set(doc) - {"cases", "defaults"})
    if unknown:
        raise SuiteError(f"{where}: unknown top-level key {unknown[0]!r}: use 'cases' and 'defaults'")
    defaults = doc.get("defaults") or {}
    if not isinstance(defaults, Mapping):
        raise SuiteError(f"{where}: 'defaults' must be a mapping of case fields, got {defaults!r}")
    cases: list[Case] = []
    for i, raw in enumerate(doc["cases"]):
        label = f"#{i + 1}"
        if not isinstance(raw, Mapping):
            raise SuiteError(f"{where}: case {label} must be a mapping of fields, got {raw!r}")
        if isinstance(raw.get("name"), str) and raw["name"].strip():
            label = repr(raw["name"].strip())
        values = {**defaults, **raw}
        for key in values:
            if key not in CASE_FIELDS:
                raise SuiteError(f"{where}: case {label}: unknown field {key!r}: use {', '.join(CASE_FIELDS)}")
        r = _CaseReader(where, label, values, path.resolve().parent)
        name = r.text("name", required=True)
        assert name is not None
        if any(c.name == name for c in cases):
            raise r.error("name", f"{name!r} is used by another case: give every case its own name")
        target = r.model()
        mesh = r.mesh()
        global_batch_size = r.positive("global_batch_size", int)
        cases.append(
            Case(
                name=name,
                model=str(values["model"]).strip(),
                target=target,
                cluster=r.cluster(mesh),
                mesh=mesh,
                global_batch_size=global_batch_size,
                precision=r.choice("precision", PRECISIONS) or "fp32",  # type: ignore[arg-type]
                optimizer=r.choice("optimizer", tuple(OPTIMIZERS)),
                config=r.config(global_batch_size),
                time_limit_s=r.positive("time_limit_s", float) or 120.0,
                profile=r.profile(),
                spec={k: values[k] for k in CASE_FIELDS[1:] if values.get(k) is not None},
            )
        )
    return cases


# -- planning ----------------------------------------------------------------------------------


@contextlib.contextmanager
def plan_cache_disabled() -> Iterator[None]:
    """``AUTOPLAN_NO_PLAN_CACHE=1`` for the duration (every case is really planned), restored after."""
    old = os.environ.get(_NO_PLAN_CACHE_ENV)
    os.environ[_NO_PLAN_CACHE_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(_NO_PLAN_CACHE_ENV, None)
        else:
            os.environ[_NO_PLAN_CACHE_ENV] = old


def plan_digest(plan: Plan) -> str:
    """16 hex digits of SHA-256 over what the plan decides (placements of inputs, targets,
    parameters and every operator, fallback ops, configuration, stage layout), not over its
    estimates: equal estimates from a different decision give another digest."""
    d = plan.to_dict()
    decision = {k: d.get(k) for k in ("optimizer", "placements", "nodes", "fallback_ops", "config", "pipeline")}
    return hashlib.sha256(json.dumps(decision, sort_keys=True).encode()).hexdigest()[:16]


def _decision(plan: Plan) -> str:
    """Terse view of the decision: the configuration, or what each mesh axis does."""
    if plan.config is not None:
        return str(plan.config)
    kinds = []
    for axis, kind in plan.parallelism().items():
        short = "+".join(k.split("/")[0].split(" ")[0] for k in kind.split(" + "))
        kinds.append(f"{axis}={short.replace('replicated', 'R')}")
    return " ".join(kinds)


def case_result(case: Case, plan: Plan, plan_time_s: float) -> dict[str, Any]:
    """One row of the results (fixed key order; ``plan_time_s`` is the only wall-clock value)."""
    e = plan.estimate
    peak = float(e.memory_bytes["total"])
    return {
        "name": case.name,
        "case": dict(case.spec),
        "status": "ok",
        "step_time_s": e.step_time_s,
        "mfu": e.mfu,
        "tokens_per_s": e.tokens_per_s,
        "peak_memory_bytes": peak,
        "capacity_bytes": e.capacity_bytes,
        "memory_fraction": peak / e.capacity_bytes if e.capacity_bytes else None,
        "fingerprint": plan.fingerprint,
        "plan_digest": plan_digest(plan),
        "decision": _decision(plan),
        "solver": {"status": plan.solver.get("status"), "gap": plan.solver.get("gap")},
        "plan_time_s": round(plan_time_s, 3),
    }


def _plan_parser() -> argparse.ArgumentParser:
    """The parser of ``autoplan plan`` (and ``estimate``), as the CLI registers them."""
    parser = common.BadInputParser(prog="autoplan")
    planning.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def run_case(case: Case) -> dict[str, Any]:
    """Plan ``case`` as ``autoplan plan`` does (plan cache off); a :class:`PlanError` while
    planning is recorded in the row (``"status": "error"``), not raised."""
    args = _plan_parser().parse_args(case.plan_argv())
    t0 = time.perf_counter()
    try:
        with plan_cache_disabled():
            plan = common.make_plan(args)
    except PlanError as exc:
        log.info("case %s failed to plan: %s", case.name, exc)
        return {
            "name": case.name,
            "case": dict(case.spec),
            "status": "error",
            "error": str(exc),
            "plan_time_s": round(time.perf_counter() - t0, 3),
        }
    return case_result(case, plan, time.perf_counter() - t0)


def run_suite(cases: Sequence[Case], *, suite_name: str, progress: TextIO | None = None) -> dict[str, Any]:
    """Plan every case; the results document (see the module docstring)."""
    rows = []
    for case in cases:
        if progress is not None:
            print(f"planning {case.name} ...", file=progress, flush=True)
        rows.append(run_case(case))
    return {
        "format": RESULTS_FORMAT,
        "version": RESULTS_VERSION,
        "suite": suite_name,
        "versions": software_versions(),
        "cases": rows,
    }


def load_results(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A results file written by ``autoplan bench --out`` (checked: format, version, case rows)."""
    path = Path(path)
    where = f"results file {str(path)!r}"
    try:
        doc = parse_json(_read_text(path, "results file", max_bytes=MAX_PLAN_FILE_BYTES))
    except InputLimitError as exc:
        raise SuiteError(f"{where} {exc}: re-create it with --out") from None
    except json.JSONDecodeError as exc:
        raise SuiteError(f"{where} is not valid JSON (line {exc.lineno}: {exc.msg}): re-create it with --out") from exc
    if not isinstance(doc, dict) or doc.get("format") != RESULTS_FORMAT:
        raise SuiteError(f'{where} is not an autoplan bench results file (missing "format": "{RESULTS_FORMAT}")')
    if doc.get("version") != RESULTS_VERSION:
        raise SuiteError(
            f"{where} has version {doc.get('version')!r}; this autoplan reads version {RESULTS_VERSION}: "
            "re-create it with `autoplan bench --out`"
        )
    rows = doc.get("cases")
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("name"), str) for r in rows):
        raise SuiteError(f"{where}: 'cases' must be a list of rows with a 'name'")
    for r in rows:
        if r.get("status") == "ok":
            for key in ("step_time_s", "peak_memory_bytes"):
                if isinstance(r.get(key), bool) or not isinstance(r.get(key), (int, float)):
                    raise SuiteError(f"{where}: case {r['name']!r}: {key!r} must be a number, got {r.get(key)!r}")
    return doc


def write_results(results: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Write the results atomically (a temporary file renamed into place)."""
    atomic_write(path, json.dumps(results, indent=1) + "\n", what="results file", error=SuiteError)


# -- comparison --------------------------------------------------------------------------------

Verdict = Literal["ok", "regressed", "failed", "missing", "new"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CaseComparison:
    """One case against its baseline row."""

    name: str
    verdict: Verdict
    changes: tuple[str, ...]
    """Readable changes, e.g. ``step time 0.593 ms -> 0.652 ms (+10.0%, worse)``."""
    reasons: tuple[str, ...] = ()
    """Why the case fails (empty unless ``verdict`` is ``regressed``, ``failed`` or ``missing``)."""

    def __str__(self) -> str:
        head = {"ok": "ok", "regressed": "REGRESSED", "failed": "FAILED", "missing": "MISSING", "new": "new"}
        why = f" ({', '.join(self.reasons)})" if self.reasons else ""
        return f"  {self.name}: {head[self.verdict]}{why}" + (": " + "; ".join(self.changes) if self.changes else "")


def _relative(old: float, new: float) -> float:
    if old == new:
        return 0.0
    return (new - old) / abs(old) if old else math.inf


def _change(what: str, old: float, new: float, fmt: Callable[[float], str], *, lower_is_better: bool = True) -> str:
    rel = _relative(old, new)
    if rel == 0.0:
        return f"{what} {fmt(new)} (same)"
    better = (rel < 0) == lower_is_better
    return f"{what} {fmt(old)} -> {fmt(new)} ({rel:+.2%}, {'better' if better else 'worse'})"


def compare_case(
    row: Mapping[str, Any], base: Mapping[str, Any], *, tolerance: float, max_plan_time_ratio: float | None
) -> CaseComparison:
    """Compare one results row with its baseline row (see the module docstring for the rules)."""
    name = row["name"]
    if row.get("status") != "ok":
        return CaseComparison(name=name, verdict="failed", changes=(), reasons=(f"failed to plan: {row.get('error')}",))
    if base.get("status") != "ok":
        return CaseComparison(name=name, verdict="ok", changes=("plans now; failed in the baseline",))
    changes = [
        _change("step time", base["step_time_s"], row["step_time_s"], _ms),
        _change("peak memory", base["peak_memory_bytes"], row["peak_memory_bytes"], _bytes),
    ]
    if base.get("mfu") is not None and row.get("mfu") is not None:
        changes.append(_change("MFU", base["mfu"], row["mfu"], "{:.2%}".format, lower_is_better=False))
    changes.append(
        "placements changed"
        + (f" ({base.get('decision')} -> {row.get('decision')})" if base.get("decision") != row.get("decision") else "")
        if base.get("plan_digest") != row.get("plan_digest")
        else "placements unchanged"
    )
    if base.get("fingerprint") != row.get("fingerprint"):
        changes.append("model graph changed (new fingerprint)")
    if base.get("case") is not None and base.get("case") != row.get("case"):
        changes.append("case definition changed")
    reasons = []
    for what, key in (("step time", "step_time_s"), ("peak memory", "peak_memory_bytes")):
        rel = _relative(float(base[key]), float(row[key]))
        if rel > tolerance:
            reasons.append(f"{what} +{rel:.1%} > {tolerance:.1%}")
    old_t, new_t = base.get("plan_time_s"), row.get("plan_time_s")
    if isinstance(old_t, (int, float)) and isinstance(new_t, (int, float)) and old_t > 0:
        ratio = new_t / old_t
        flag = ""
        if max_plan_time_ratio is not None and ratio > max_plan_time_ratio:
            reasons.append(f"planning time x{ratio:.2f} > x{max_plan_time_ratio:g}")
            flag = ", too slow"
        elif ratio > PLAN_TIME_FLAG_RATIO:
            flag = ", flagged: slower"
        changes.append(f"plan time {old_t:.2f} s -> {new_t:.2f} s (x{ratio:.2f}{flag})")
    verdict: Verdict = "regressed" if reasons else "ok"
    return CaseComparison(name=name, verdict=verdict, changes=tuple(changes), reasons=tuple(reasons))


def compare(
    results: Mapping[str, Any],
    baseline: Mapping[str, Any],
    *,
    tolerance: float,
    max_plan_time_ratio: float | None = None,
) -> list[CaseComparison]:
    """Every results row against the baseline row of the same name; baseline rows with no
    results row come last as ``missing``; results rows with no baseline row are ``new``."""
    base_rows = {r["name"]: r for r in baseline["cases"]}
    out = []
    for row in results["cases"]:
        base = base_rows.get(row["name"])
        if base is None:
            failed = row.get("status") != "ok"
            out.append(
                CaseComparison(
                    name=row["name"],
                    verdict="failed" if failed else "new",
                    changes=() if failed else ("no baseline row (add it by re-writing the baseline)",),
                    reasons=(f"failed to plan: {row.get('error')}",) if failed else (),
                )
            )
        else:
            out.append(compare_case(row, base, tolerance=tolerance, max_plan_time_ratio=max_plan_time_ratio))
    names = {r["name"] for r in results["cases"]}
    for name in base_rows:
        if name not in names:
            out.append(
                CaseComparison(
                    name=name, verdict="missing", changes=(), reasons=("in the baseline but not in the results",)
                )
            )
    return out


# -- output ------------------------------------------------------------------------------------

_COLUMNS = ("case", "step time", "MFU", "tokens/s", "peak mem/device", "of capacity", "decision", "solver", "plan s")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g} ms"


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def format_table(results: Mapping[str, Any]) -> str:
    """One row per case; a case that failed to plan shows its error."""
    rows = []
    for r in results["cases"]:
        if r.get("status") != "ok":
            rows.append(
                (r["name"], "FAILED", "", "", "", "", str(r.get("error", ""))[:80], "", f"{r['plan_time_s']:.2f}")
            )
            continue
        gap = r["solver"].get("gap")
        rows.append(
            (
                r["name"],
                _ms(r["step_time_s"]),
                f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-",
                f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") is not None else "-",
                _bytes(r["peak_memory_bytes"]),
                f"{r['memory_fraction']:.3%}" if r.get("memory_fraction") is not None else "-",
                r["decision"],
                f"{r['solver']['status']}" + (f" gap {gap:.2%}" if gap else ""),
                f"{r['plan_time_s']:.2f}",
            )
        )
    widths = [max(len(str(row[i])) for row in (_COLUMNS, *rows)) for i in range(len(_COLUMNS))]
    lines = ["  ".join(f"{cell:<{w}}" for cell, w in zip(row, widths)).rstrip() for row in (_COLUMNS, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _tolerance(text: str) -> float:
    """``2%`` or ``0.02`` -> 0.02 (argparse ``type=``)."""
    t = text.strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a fraction like 0.02 or a percentage like 2%, got {text!r}"
        ) from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a fraction in [0, 1) like 0.02 or a percentage like 2%, got {text!r}"
        )
    return value


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a ratio like 2 (twice as slow), got {text!r}") from None
    if not 1 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a ratio >= 1 like 2 (twice as slow), got {text!r}")
    return value


def cmd_bench(args: argparse.Namespace) -> int:
    if args.out:
        refuse_overwriting_inputs(args.out, {"suite file": args.suite, "baseline": args.baseline}, error=SuiteError)
    cases = load_suite(args.suite)
    baseline = load_results(args.baseline) if args.baseline else None
    if args.out and not Path(args.out).resolve().parent.is_dir():  # found out before planning, not after
        raise SuiteError(
            f"--out {args.out!r}: directory {str(Path(args.out).parent)!r} does not exist: create it first"
        )
    human = sys.stderr if args.json else console.stdout()  # with --json, stdout holds only the results
    progress = sys.stderr if sys.stderr.isatty() and not args.quiet else None
    results = run_suite(cases, suite_name=Path(args.suite).name, progress=progress)
    if args.out:
        write_results(results, args.out)
    if args.json:
        print(json.dumps(results, indent=1), file=console.stdout())
    if not args.quiet:
        print(format_table(results), file=human)
        if args.out:
            print(f"wrote {args.out}", file=human)
    failing: list[str] = []
    if baseline is None:
        failing = [f"{r['name']} (failed to plan: {r.get('error')})" for r in results["cases"] if r["status"] != "ok"]
    else:
        comparisons = compare(results, baseline, tolerance=args.tolerance, max_plan_time_ratio=args.max_plan_time_ratio)
        if not args.quiet:
            print(f"against {args.baseline} (tolerance {args.tolerance:.1%}):", file=human)
        for c in comparisons:
            if not args.quiet or c.reasons:
                print(str(c), file=human)
            if c.reasons:
                failing.append(f"{c.name} ({', '.join(c.reasons)})")
    if failing:
        print(
            f"autoplan bench: {len(failing)} of {len(results['cases'])} case(s) failed: " + "; ".join(failing),
            file=human,
        )
        return EXIT_FAILED
    if not args.quiet:
        print(f"autoplan bench: {len(results['cases'])} case(s) ok", file=human)
    return EXIT_OK


def add_parser(subparsers: Any) -> None:  # argparse._SubParsersAction has no public type
    """Register ``autoplan bench`` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "bench",
        help="plan a suite of cases and compare step time and memory with a baseline (CI)",
        description="Plan every case of a suite file (YAML) as `autoplan plan` would, print one row per case, "
        "write the results (JSON) and, with --baseline, exit 1 when a case's estimated step time or peak "
        "memory per device got worse by more than --tolerance, or a baseline case is missing or fails to plan.",
    )
    p.add_argument(
        "suite", help="suite file (YAML): cases with name, model, cluster, ... (see autoplan/tools/bench.py)"
    )
    p.add_argument("--out", "-o", help="results file to write (JSON); use it as a later --baseline")
    p.add_argument("--baseline", help="results file of an earlier run to compare with")
    p.add_argument(
        "--tolerance",
        type=_tolerance,
        default=0.02,
        help="allowed growth of step time and peak memory, as 2%% or 0.02 (default 2%%)",
    )
    p.add_argument(
        "--max-plan-time-ratio",
        type=_ratio,
        metavar="RATIO",
        help="also fail when a case plans more than RATIO times slower than in the baseline "
        f"(default: only flag it past x{PLAN_TIME_FLAG_RATIO:g})",
    )
    p.add_argument("--quiet", "-q", action="store_true", help="print only failures")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout (the rest on stderr)")
    p.set_defaults(func=cmd_bench)
