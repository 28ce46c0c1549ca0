"""Byte-identity of plans and generated programs across a refactor.

    python benchmarks/plan_identity.py --out /tmp/before            # record (quick set)
    python benchmarks/plan_identity.py --out /tmp/after --check /tmp/before
    python benchmarks/plan_identity.py --all --out DIR [--check DIR] # + the large joint searches

Plans every case through the public entry points only (the CLI's ``autoplan plan`` run in this
process, and ``autoplan.plan`` for the benchmark models), so the same script runs unchanged on
both sides of a restructuring. Every plan file is written without timings (the default: the same
inputs give a byte-identical file). For the cases marked ``code`` the generated per-rank program
(``autoplan.parallelize(...).code``) of ranks 0 and the last rank is recorded too, built on a fake
process group of the cluster's size (no communication happens while generating).

Cases: the plan benchmark suite (``benchmarks/suite.yaml``), the examples (``examples/hf_models.py``:
the tiny GPT-2 and Llama on 4 CPU ranks, one and two mesh axes, with and without a global batch,
a fixed pipeline, five zoo architectures) and the joint-search benchmarks
(``benchmarks/planning_time.py``'s GPT-2 cases and, with ``--all``, ``benchmarks/planner_speed.py``'s
8B / 70B / 175B cases and its mid-size cases).

Prints one row per file (``same`` / ``renamed``, equal after the ``--rename`` rules / ``DIFFERS`` / ``new``) and the final line
``plan_identity: cases=N identical=I differ=D missing=M``; exit 1 when ``--check`` finds a difference.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ["AUTOPLAN_NO_PLAN_CACHE"] = "1"

HF = str(ROOT / "examples" / "hf_models.py")
SUITE_DIR = ROOT / "benchmarks"


@dataclass(frozen=True)
class Case:
    """One plan to record: ``cli`` arguments for ``autoplan plan`` (without ``--out``), or an
    ``api`` function returning the plan; ``code`` ranks whose generated program is recorded."""

    name: str
    cli: tuple[str, ...] = ()
    api: Callable[[], object] | None = None
    code_model: str = ""  # FILE.py:FUNCTION built on cpu for parallelize
    code_ranks: tuple[int, ...] = ()
    large: bool = False
    world_size: int = 4
    extra: dict = field(default_factory=dict)


def _suite_cases() -> list[Case]:
    import yaml

    doc = yaml.safe_load((SUITE_DIR / "suite.yaml").read_text())
    out = []
    for raw in doc["cases"]:
        args = [str(SUITE_DIR / raw["model"]), "--cluster", str(raw["cluster"])]
        for key, value in raw.items():
            if key in ("name", "model", "cluster"):
                continue
            args += [f"--{key.replace('_', '-')}", str(value)]
        out.append(Case(name=f"suite.{raw['name']}", cli=tuple(args)))
    return out


def _example_cases() -> list[Case]:
    gpt2, llama = f"{HF}:gpt2_tiny", f"{HF}:llama_tiny"
    cases = [
        Case("examples.gpt2_tiny.4xcpu", (gpt2, "--cluster", "4xCPU"), code_model=gpt2, code_ranks=(0, 3)),
        Case("examples.gpt2_tiny.2x2", (gpt2, "--cluster", "4xCPU", "--mesh", "2,2"), code_model=gpt2, code_ranks=(0, 3)),
        Case("examples.llama_tiny.4xcpu", (llama, "--cluster", "4xCPU"), code_model=llama, code_ranks=(0,)),
        Case("examples.llama_tiny.2x2", (llama, "--cluster", "4xCPU", "--mesh", "2,2"), code_model=llama, code_ranks=(0,)),
        Case("examples.gpt2_tiny.joint_4xcpu", (gpt2, "--cluster", "4xCPU", "--global-batch-size", "16")),
        Case("examples.llama_tiny.joint_2x8xh100", (llama, "--cluster", "2x8xH100", "--global-batch-size", "64", "--precision", "bf16")),
        Case(
            "examples.gpt2_tiny.pipeline_4xcpu",
            (gpt2, "--cluster", "4xCPU", "--global-batch-size", "16",
             "--config", "dp=2,tp=1,pp=2,microbatch_size=2,num_microbatches=4,schedule=1f1b"),
            code_model=gpt2, code_ranks=(0, 3),
        ),  # fmt: skip
        Case(
            "examples.llama_tiny.adam_zero_4xcpu",
            (llama, "--cluster", "4xCPU", "--global-batch-size", "8", "--optimizer", "adamw"),
        ),
    ]
    for arch in ("gpt2", "mixtral", "bert", "t5", "vit"):
        model = f"{HF}:{arch}_zoo"
        cases.append(Case(f"examples.zoo.{arch}", (model, "--cluster", "4xCPU"), code_model=model, code_ranks=(0,)))
    return cases


def _planning_time_cases() -> list[Case]:
    def make(index: int) -> Callable[[], object]:
        def run() -> object:
            import planning_time

            import autoplan

            _, wl, cluster = planning_time.cases()[index]
            return autoplan.plan(
                wl.model, cluster, example_inputs=wl.example_inputs, loss_fn=wl.loss_fn,
                example_targets=wl.example_targets,
            )  # fmt: skip

        return run

    names = ["gpt2_h256_L2_8x8xh100", "gpt2_h12288_L3_8x8xh100", "gpt2_h1024_L1_128x8xh100"]
    return [Case(f"planning_time.{n}", api=make(4 + i)) for i, n in enumerate(names)]


def _planner_speed_cases() -> list[Case]:
    def make(case_name: str) -> Callable[[], object]:
        def run() -> object:
            import planner_speed

            import autoplan

            case = next(c for c in planner_speed.CASES + planner_speed.MID_CASES if c.name == case_name)
            model, ids = planner_speed.build(case)
            return autoplan.plan(
                model, autoplan.Cluster.preset(case.cluster), example_inputs=(ids,), loss_fn=planner_speed.lm_loss,
                example_targets=(ids,), global_batch_size=case.global_batch, precision="bf16",
            )  # fmt: skip

        return run

    mids = [Case(f"planner_speed.{n}", api=make(n)) for n in ("llama-1b-16L", "gpt-350m-24L")]
    larges = [Case(f"planner_speed.{n}", api=make(n), large=True) for n in ("llama3-8b", "llama3-70b", "gpt3-175b")]
    return mids + larges


def all_cases() -> list[Case]:
    return _suite_cases() + _example_cases() + _planning_time_cases() + _planner_speed_cases()


def _quiet() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    return stack


def _plan_case(case: Case, out: Path) -> Path:
    path = out / f"{case.name}.plan.json"
    if case.cli:
        from autoplan.tools.cli import main as cli_main

        with _quiet():
            rc = cli_main(["plan", *case.cli, "--out", str(path)])
        if rc != 0:
            raise RuntimeError(f"{case.name}: autoplan plan exited {rc}")
    else:
        with _quiet():
            plan = case.api()
        plan.save(str(path))  # type: ignore[attr-defined]
    return path


def _code_case(case: Case, plan_path: Path, out: Path) -> list[Path]:
    import autoplan
    from autoplan.testing import generated_program
    from autoplan.tools.loader import build_workload

    plan = autoplan.Plan.load(str(plan_path))
    cluster_arg = case.cli[case.cli.index("--cluster") + 1]
    mesh = tuple(int(x) for x in case.cli[case.cli.index("--mesh") + 1].split(",")) if "--mesh" in case.cli else None
    cluster = autoplan.Cluster.preset(cluster_arg, mesh_shape=mesh) if mesh else autoplan.Cluster.preset(cluster_arg)
    assert cluster.world_size == case.world_size
    paths = []
    for rank in case.code_ranks:
        with _quiet():
            code = generated_program(build_workload(case.code_model, device="cpu"), cluster, plan, rank=rank)
        path = out / f"{case.name}.rank{rank}.py"
        path.write_text(code)
        paths.append(path)
    return paths


def _renamed(text: str, renames: list[str]) -> str:
    for rule in renames:
        old, _, new = rule.partition("=")
        text = text.replace(old, new)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory to write the plans and programs into")
    ap.add_argument("--check", help="baseline directory to compare with")
    ap.add_argument("--all", action="store_true", help="include the large joint-search cases (minutes)")
    ap.add_argument("--only", help="run the cases whose name contains this text")
    ap.add_argument(
        "--rename",
        action="append",
        default=[],
        metavar="OLD=NEW",
        help="a declared rename in generated code (a moved module changes the names FX gives its functions): "
        "the baseline's programs are compared with OLD replaced by NEW, reported as 'renamed'",
    )
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = [c for c in all_cases() if (args.all or not c.large) and (not args.only or args.only in c.name)]
    rows, differ, missing, renamed = [], 0, 0, 0
    for case in cases:
        t0 = time.perf_counter()
        written = [_plan_case(case, out)]
        if case.code_ranks:
            written += _code_case(case, written[0], out)
        for path in written:
            status = "recorded"
            if args.check:
                before = Path(args.check) / path.name
                if not before.exists():
                    status, missing = "new", missing + 1
                elif before.read_bytes() == path.read_bytes():
                    status = "same"
                elif path.suffix == ".py" and _renamed(before.read_text(), args.rename) == path.read_text():
                    status, renamed = "renamed", renamed + 1
                else:
                    status, differ = "DIFFERS", differ + 1
                    diff = difflib.unified_diff(
                        before.read_text().splitlines(), path.read_text().splitlines(), str(before), str(path), n=1
                    )
                    print("\n".join(list(diff)[:40]))
            rows.append((path.name, status, time.perf_counter() - t0))
    width = max(len(r[0]) for r in rows)
    print(f"{'file':<{width}} | status   | case s")
    for name, status, secs in rows:
        print(f"{name:<{width}} | {status:<8} | {secs:6.1f}")
    identical = sum(1 for r in rows if r[1] == "same")
    print(
        f"plan_identity: cases={len(cases)} files={len(rows)} identical={identical} renamed={renamed} "
        f"differ={differ} missing={missing}"
    )
    return 1 if differ or missing else 0


if __name__ == "__main__":
    sys.exit(main())
