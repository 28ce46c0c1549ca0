"""Start-up time of the ``autoplan`` commands that neither plan nor train.

    python benchmarks/cli_startup.py                       # makes two plans in a temp dir, then times
    python benchmarks/cli_startup.py --plans p.json pp.json --runs 9

Times the real ``autoplan`` entry point (the console script; ``python -m autoplan.tools.cli`` when it is
not installed) in fresh processes: ``autoplan --help``, ``autoplan <cmd> --help`` for every
subcommand, and ``show`` / ``show --json`` / ``explain --op`` / ``explain --param`` / ``diff`` /
``report`` on two existing plan files (an ILP plan of ``examples/hf_models.py:gpt2_tiny`` on 2 CPUs
and a pipeline plan on 4 CPUs, dp=2 pp=2, made first unless ``--plans`` gives them). Each command
runs ``--runs`` times (median and min in seconds); one more run under ``python -c`` reports
whether it imported torch. Targets (issue 17): help < 0.5 s, review < 1.5 s. ``python -c pass``
is printed as the floor: on a loaded machine every number moves with the load, so compare
commands with the floor of the same run. The last line is
``cli_startup: help_max_s=X review_max_s=Y floor_s=Z targets met: yes|no`` (maxima of the medians).

``PYTHONPATH=<another checkout>`` times that checkout's CLI (the processes run in a temp dir, so
the current directory does not shadow it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from autoplan.tools.cli import build_parser  # noqa: E402 - torch-free

HELP_TARGET_S = 0.5
REVIEW_TARGET_S = 1.5
_PROBE = (
    "import sys\n"
    "from autoplan.tools.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "print('autoplan-startup-torch:', 'torch' in sys.modules, file=sys.stderr)\n"
)
_PLANS = {
    "p.json": ("--cluster", "2xCPU"),
    "pp.json": (
        "--cluster", "4xCPU", "--global-batch-size", "16",
        "--config", "dp=2,pp=2,microbatch_size=2,num_microbatches=4,schedule=1f1b",
    ),
}  # fmt: skip


def entry_point() -> list[str]:
    """The console script installed beside this interpreter (not a pyenv shim, which adds its own
    start-up), else the one on PATH, else ``python -m autoplan.tools.cli``."""
    beside = Path(sys.executable).with_name("autoplan")
    script = str(beside) if beside.is_file() else shutil.which("autoplan")
    return [script] if script else [sys.executable, "-m", "autoplan.tools.cli"]


def subcommands() -> list[str]:
    parser = build_parser()
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(actions[0].choices)


def make_plans(tmp: Path) -> tuple[Path, Path]:
    target = f"{REPO_ROOT / 'examples' / 'hf_models.py'}:gpt2_tiny"
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}
    for name, args in _PLANS.items():
        cmd = [*entry_point(), "plan", target, *args, "--out", str(tmp / name), "-q"]
        subprocess.run(cmd, cwd=tmp, env=env, check=True, stdout=subprocess.DEVNULL)
    return tmp / "p.json", tmp / "pp.json"


def review_commands(plan: Path, pipeline_plan: Path, out_dir: Path) -> list[list[str]]:
    data = json.loads(plan.read_text(encoding="utf-8"))
    op = next(n for n, x in data["alternatives"].items() if x.get("alternatives") and n in data["nodes"])
    param = data["param_names"][0]
    p, pp = str(plan), str(pipeline_plan)
    return [
        ["show", p],
        ["show", "--json", p],
        ["show", pp],
        ["explain", p, "--op", op],
        ["explain", p, "--param", param, "--json"],
        ["diff", p, pp],
        ["diff", "--json", p, pp],
        ["report", p, "-o", str(out_dir / "p.html")],
        ["report", pp, "-o", str(out_dir / "pp.html"), "-q"],
    ]


def time_runs(cmd: list[str], *, runs: int, cwd: Path) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return times


def imports_torch(args: list[str], *, cwd: Path) -> bool:
    proc = subprocess.run([sys.executable, "-c", _PROBE, *args], cwd=cwd, capture_output=True, text=True, check=False)
    marks = [line for line in proc.stderr.splitlines() if line.startswith("autoplan-startup-torch:")]
    if proc.returncode != 0 or not marks:
        raise RuntimeError(f"autoplan {' '.join(args)} failed: {proc.stderr[-1000:]}")
    return marks[-1].endswith("True")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="timed runs per command (default 5)")
    parser.add_argument("--plans", nargs=2, metavar=("ILP_PLAN", "PIPELINE_PLAN"), help="existing plan files")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="autoplan-startup-") as tmp_name:
        tmp = Path(tmp_name)
        plan, pipeline_plan = (Path(p).resolve() for p in args.plans) if args.plans else make_plans(tmp)
        entry = entry_point()
        floor = time_runs([sys.executable, "-c", "pass"], runs=args.runs, cwd=tmp)
        cases = [("help", ["--help"])] + [("help", [cmd, "--help"]) for cmd in subcommands()]
        cases += [("review", c) for c in review_commands(plan, pipeline_plan, tmp)]
        rows = []
        for kind, cmd in cases:
            times = time_runs([*entry, *cmd], runs=args.runs, cwd=tmp)
            torch_loaded = imports_torch(cmd, cwd=tmp)
            target = HELP_TARGET_S if kind == "help" else REVIEW_TARGET_S
            shown = " ".join(Path(c).name if os.sep in c else c for c in cmd)
            rows.append((kind, f"autoplan {shown}", statistics.median(times), min(times), torch_loaded, target))

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{os.cpu_count()} CPU cores, load average {load} (a loaded machine: every time moves with the load)")
    print(f"entry point: {' '.join(entry)}; {args.runs} runs per command")
    width = max(len(r[1]) for r in rows)
    print(f"{'command':<{width}}  median s   min s  torch  target s")
    print(f"{'python -c pass (floor)':<{width}}  {statistics.median(floor):8.3f}  {min(floor):6.3f}      -         -")
    for _kind, name, median_s, min_s, torch_loaded, target in rows:
        print(f"{name:<{width}}  {median_s:8.3f}  {min_s:6.3f}  {'y' if torch_loaded else 'n':>5}  {target:8.1f}")
    help_max = max(r[2] for r in rows if r[0] == "help")
    review_max = max(r[2] for r in rows if r[0] == "review")
    met = help_max < HELP_TARGET_S and review_max < REVIEW_TARGET_S
    print(
        f"cli_startup: help_max_s={help_max:.3f} review_max_s={review_max:.3f} "
        f"floor_s={statistics.median(floor):.3f} targets met: {'yes' if met else 'no'}"
    )


if __name__ == "__main__":
    main()
