"""``autoplan`` command line: a thin layer over the Python API.

    autoplan plan  my_models.py:build --cluster 4xCPU --out plan.json
    autoplan show  plan.json
    autoplan explain plan.json --op addmm_3           # the alternatives the solver weighed
    autoplan diff  old.json new.json
    autoplan report plan.json -o plan.html            # self-contained HTML review page
    autoplan export-onnx plan.json -o model.onnx      # the model with the plan as ONNX sharding annotations
    autoplan bench benchmarks/suite.yaml --baseline benchmarks/suite_baseline.json   # CI: estimate regressions
    autoplan run   my_models.py:build --plan plan.json --steps 10        # launches torchrun
    autoplan plan  my_models.py:build --cluster 4x8xH100 --global-batch-size 512 --out plan.json
    autoplan estimate my_models.py:build --cluster 4x8xH100 --global-batch-size 512 \\
                   --config dp=8,tp=4,pp=1,microbatch_size=2,num_microbatches=32

Bad input (untraceable model, malformed cluster or plan file, plan for another model or world
size, model that cannot fit) prints one line ``autoplan: error: ...`` and exits with code 2.

Each command lives in its own module, which registers its arguments and handler
(``add_parser``); what the commands share is in :mod:`autoplan.tools.common`. This module only
assembles the parser (:data:`REGISTRATIONS`) and runs the chosen handler under the CLI's
contract: exit codes, one-line errors, Ctrl-C and SIGTERM.

Start-up: the command modules import no torch when loaded; a handler that traces, plans or
trains imports torch when it runs. So ``autoplan --help`` and the review commands (``show``,
``explain``, ``diff``, ``report``) start in well under a second (``tests/test_cli_startup.py``,
``benchmarks/cli_startup.py``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from autoplan.cost_models.echo import terminal_safe
from autoplan.cost_models.errors import PlanError
from autoplan.planner import progress
from autoplan.tools import bench, calibrate, common, console, planning, profile, report, review, run


def _add_export_onnx_parser(subparsers: Any) -> None:  # argparse._SubParsersAction has no public type
    """Register ``autoplan export-onnx`` (``autoplan/tools/export_onnx.py``). Registered here, not
    in its module: that module imports torch when loaded (its op tables are keyed by torch ops),
    and registering a command must not."""
    p = subparsers.add_parser(
        "export-onnx", help="write the traced model as ONNX with the plan as multi-device sharding annotations"
    )
    p.add_argument("plan", help="plan file from `autoplan plan`")
    p.add_argument("--out", "-o", required=True, help="ONNX file to write")
    p.add_argument(
        "--model", metavar="FILE.py:FUNCTION", help="the model the plan is for (default: the plan's workload)"
    )
    p.add_argument("--seed", type=common.seed, default=0, help=argparse.SUPPRESS)
    p.add_argument("--quiet", "-q", action="store_true", help="print nothing on success")
    p.set_defaults(func=_cmd_export_onnx)


def _cmd_export_onnx(args: argparse.Namespace) -> int:
    from autoplan.tools.export_onnx import cmd_export_onnx  # imports torch: loaded when the command runs

    return cmd_export_onnx(args)


REGISTRATIONS: tuple[Callable[[Any], object], ...] = (
    planning.add_parser,  # plan, estimate
    review.add_parser,  # show, explain, diff
    run.add_parser,
    calibrate.add_parser,
    profile.add_parser,
    report.add_parser,
    _add_export_onnx_parser,
    bench.add_parser,
)
"""What registers each command on the subparsers, in ``autoplan --help`` order."""


def build_parser() -> argparse.ArgumentParser:
    """The ``autoplan`` parser with every command registered."""
    parser = common.BadInputParser(prog="autoplan", description="Automatic parallelism planner for PyTorch.")
    parser.add_argument("--verbose", "-v", action="store_true", help="log planner progress")
    sub = parser.add_subparsers(dest="command", required=True)
    for register in REGISTRATIONS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a malformed command line (2, one line printed)
        return exc.code if isinstance(exc.code, int) else common.EXIT_BAD_INPUT
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    if not args.verbose:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    previous_sigterm = _raise_on_sigterm()
    try:
        # a status line on long steps (tracing, solving) when stderr is a terminal; never with
        # --quiet or --json, never in logs or pipes
        # stdout is ours alone: what a library prints (highspy's C++ banner, a print in a
        # dependency) goes to stderr, our output to console.stdout()
        with (
            console.owned_stdout(),
            progress.reporting(enabled=not getattr(args, "quiet", False) and not getattr(args, "json", False)),
        ):
            return args.func(args)
    except PlanError as exc:
        # one line, whatever a quoted name holds (a newline, a terminal escape sequence)
        print(f"autoplan: error: {terminal_safe(' '.join(str(exc).splitlines()))}", file=sys.stderr)
        return common.EXIT_BAD_INPUT
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback (worker processes were stopped on the way out)
        print("autoplan: interrupted", file=sys.stderr)
        return common.EXIT_INTERRUPTED
    except _Terminated:
        print("autoplan: terminated", file=sys.stderr)
        return common.EXIT_TERMINATED
    finally:
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread (like ``KeyboardInterrupt`` for SIGINT) so that
    ``finally`` blocks and ``with`` exits run: worker pools are stopped, temporary files removed."""


def _raise_on_sigterm() -> Any:
    """Make SIGTERM raise :class:`_Terminated`; returns the previous handler (None when this is
    not the main thread, where handlers cannot be set)."""

    def handler(signum: int, frame: object) -> None:
        raise _Terminated

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:
        return None


if __name__ == "__main__":
    sys.exit(main())
