"""``autoplan run``: train a workload with a plan on local ranks under torchrun.

    autoplan run my_models.py:build --plan plan.json --steps 10
    autoplan run my_models.py:build --cluster 2xCPU --steps 10        # plans first

Everything a rank would otherwise find out late is checked here first, in this order: the
options, where the ranks write (``--checkpoint-dir``, ``--save-final``) and the torchrun port;
then, before planning, the batch and ``--nproc`` against the workload and the cluster; then the
plan (loaded and checked against the model, or made); then the checkpoint to resume from. Only
then is ``python -m torch.distributed.run ... -m autoplan.tools.worker`` launched, one rank per
device of the plan (``autoplan/tools/worker.py``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from autoplan.cost_models.errors import PlanError, PlanMismatchError
from autoplan.cost_models.files import refuse_overwriting_inputs
from autoplan.planner.plan import Plan
from autoplan.tools import common, console, launch

DEFAULT_MASTER_PORT = 29533
WORKER_MODULE = "autoplan.tools.worker"
"""The rank entry point torchrun starts (``python -m``)."""


def add_parser(subparsers: Any) -> None:  # argparse._SubParsersAction has no public type
    """Register ``autoplan run`` on the CLI's subparsers."""
    p = subparsers.add_parser("run", help="train with a plan under torchrun (plans first if --plan is not given)")
    common.add_planning_arguments(p, cluster_required=False)
    p.add_argument("--plan", help="plan file from `autoplan plan`")
    p.add_argument("--steps", type=common.non_negative_int, default=10, help="training steps (from the start)")
    p.add_argument(
        "--nproc",
        type=common.positive_int,
        help="check the plan's (or cluster's) world size against this number of ranks",
    )
    p.add_argument("--compare", action="store_true", help="also train the single-device model and print both losses")
    p.add_argument("--show-code", action="store_true", help="print the generated per-rank program")
    p.add_argument(
        "--master-port",
        type=common.port,
        help=f"torchrun port on 127.0.0.1, refused if in use (default: {DEFAULT_MASTER_PORT}, or a free port if that is taken)",
    )
    p.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="resume from the newest complete checkpoint in DIR (any plan) and save one after the last step",
    )
    p.add_argument("--checkpoint-every", type=int, metavar="N", help="also save a checkpoint every N steps")
    p.add_argument(
        "--max-restarts", type=int, default=0, metavar="K", help="restart all ranks up to K times when one fails"
    )
    p.add_argument("--save-final", metavar="PATH", help="write the full trained parameters (torch.save) to PATH")
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    master_port = _check_options(args)
    _check_before_planning(args)
    tmpdir = None
    if args.plan is not None:
        plan = _load_checked_plan(args)
        plan_path = args.plan
    else:
        plan = common.make_plan(args)
        tmpdir = tempfile.mkdtemp(prefix="autoplan-")
        plan_path = os.path.join(tmpdir, "plan.json")
        plan.save(plan_path)
    if args.checkpoint_dir is not None:
        _check_resumable(args, plan)
    if not args.quiet:
        print(plan.summary(), file=console.stdout(), flush=True)
    try:
        rc = launch.call_torchrun(
            _torchrun_command(args, plan, plan_path, master_port),
            env=_rank_environment(args),
            stdout=console.subprocess_stdout(),
        )
    finally:
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)
    return common.EXIT_BAD_INPUT if rc == common.EXIT_BAD_INPUT else rc


def _check_options(args: argparse.Namespace) -> int:
    """Check the options, where the ranks write and their port, before any planning or
    training; returns the torchrun port."""
    if args.plan is None and args.cluster is None:
        raise PlanError("autoplan run needs --plan plan.json or --cluster SPEC to plan first")
    if args.save_final is not None:
        refuse_overwriting_inputs(args.save_final, common.planning_inputs(args), option="--save-final")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise PlanError(f"--checkpoint-every {args.checkpoint_every}: give a number of steps >= 1")
    if args.checkpoint_every is not None and args.checkpoint_dir is None:
        raise PlanError("--checkpoint-every needs --checkpoint-dir DIR to write the checkpoints into")
    if args.checkpoint_dir is not None and Path(args.checkpoint_dir).is_file():
        raise PlanError(f"--checkpoint-dir {args.checkpoint_dir!r} is a file: give a directory (made if missing)")
    if args.max_restarts < 0:
        raise PlanError(f"--max-restarts {args.max_restarts}: give a number >= 0")
    if args.checkpoint_dir is not None:
        _check_writable("--checkpoint-dir", Path(args.checkpoint_dir), is_dir=True)
    if args.save_final is not None:
        _check_writable("--save-final", Path(args.save_final), is_dir=False)
    return launch.master_port(args.master_port, default=DEFAULT_MASTER_PORT)


def _check_before_planning(args: argparse.Namespace) -> None:
    """Without ``--plan``: ``--global-batch-size`` and ``--nproc`` against the workload and the
    cluster, before planning, which may take long."""
    # the workload loader imports torch: loaded when the command runs, not at CLI start-up
    from autoplan.tools.loader import build_workload

    if args.plan is None and args.global_batch_size is not None:  # the ranks train on the workload's batch
        inputs = build_workload(args.target, device="meta", seed=args.seed).example_inputs
        batch = int(inputs[0].shape[0]) if inputs and inputs[0].dim() else 0
        if batch != args.global_batch_size:
            raise PlanMismatchError(
                f"--global-batch-size {args.global_batch_size} does not match the {batch} samples of the workload's "
                f"inputs, which `autoplan run` trains on: give --global-batch-size {batch} or change the workload"
            )
    if args.plan is None and args.nproc is not None:
        cluster = common.cluster_from_args(args.cluster, args.mesh)
        if args.nproc != cluster.world_size:
            raise PlanMismatchError(
                f"--nproc {args.nproc} does not match the {cluster.world_size} devices of --cluster {args.cluster}: "
                f"drop --nproc or plan for a cluster of {args.nproc} devices"
            )


def _load_checked_plan(args: argparse.Namespace) -> Plan:
    """``--plan``, checked against ``--nproc`` and the model before any rank is launched (a meta
    trace is cheap)."""
    # the tracer, the planner and the workload loader import torch: loaded when the command runs
    from autoplan.passes.trace import trace_training_step
    from autoplan.planner.ilp import check_plan_fits
    from autoplan.planner.tracing import trace_for_plan
    from autoplan.tools.loader import build_workload

    plan = Plan.load(args.plan)
    if args.nproc is not None and args.nproc != plan.world_size:
        raise PlanMismatchError(
            f"--nproc {args.nproc} does not match the plan's {plan.world_size} devices: "
            f"drop --nproc or re-plan for {args.nproc} devices"
        )
    wl = build_workload(args.target, device="meta", seed=args.seed)
    if plan.config is not None:  # a plan for a global batch is made for one micro-batch's step
        traced = trace_for_plan(plan, wl.model, wl.example_inputs, wl.example_targets, wl.loss_fn)
    else:
        traced = trace_training_step(
            wl.model, wl.example_inputs, loss_fn=wl.loss_fn, example_targets=wl.example_targets
        )
    plan.check_applies_to(fingerprint=traced.fingerprint, world_size=plan.world_size)
    check_plan_fits(plan, traced)  # a hand-edited entry is named here, not in every rank
    return plan


def _check_resumable(args: argparse.Namespace, plan: Plan) -> None:
    """A checkpoint in ``--checkpoint-dir`` that cannot be resumed fails here, not in every rank."""
    # checkpoint and the workload loader import torch: loaded when the command runs
    from autoplan.runtime.checkpoint import check_compatible, find_latest
    from autoplan.tools.loader import build_workload

    latest = find_latest(args.checkpoint_dir)
    if latest is not None:
        model = build_workload(args.target, device="meta", seed=args.seed).model
        check_compatible(latest, plan, {n: tuple(p.shape) for n, p in model.named_parameters()})


def _torchrun_command(args: argparse.Namespace, plan: Plan, plan_path: str, master_port: int) -> list[str]:
    """``python -m torch.distributed.run ... -m autoplan.tools.worker TARGET --plan ...``: one
    local rank per device of the plan."""
    restarts = ["--max-restarts", str(args.max_restarts)] if args.max_restarts else []
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(plan.world_size),
        "--nnodes",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(master_port),
        *restarts,
        "-m",
        WORKER_MODULE,
        args.target,
        "--plan",
        plan_path,
        "--steps",
        str(args.steps),
        "--seed",
        str(args.seed),
    ]
    if args.compare:
        cmd.append("--compare")
    if args.show_code:
        cmd.append("--show-code")
    if args.checkpoint_dir is not None:
        cmd += ["--checkpoint-dir", os.path.abspath(args.checkpoint_dir)]
    if args.checkpoint_every is not None:
        cmd += ["--checkpoint-every", str(args.checkpoint_every)]
    if args.save_final is not None:
        cmd += ["--save-final", os.path.abspath(args.save_final)]
    return cmd


def _rank_environment(args: argparse.Namespace) -> dict[str, str]:
    """This process's environment with one thread per CPU rank, quiet libraries (unless
    ``--verbose``) and this checkout's package directory first on ``PYTHONPATH``."""
    env = launch.rank_environment(verbose=args.verbose)
    if not args.verbose:
        env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return env


def _check_writable(option: str, path: Path, *, is_dir: bool) -> None:
    """Refuse (PlanError) an output ``path`` the ranks could not write, before anything runs:
    ``is_dir``, a directory made if missing (its nearest existing ancestor must take a new
    entry); else a file whose directory exists. Writability is probed with a temporary file
    (permission bits do not stop root; a read-only filesystem stops everyone); nothing is left."""
    shown = str(path)[:200]
    try:
        _probe_writable(option, shown, path, is_dir=is_dir)
    except PlanError:
        raise
    except (OSError, ValueError) as exc:  # a name the OS refuses (too long, a NUL byte)
        raise PlanError(f"{option} {shown} cannot be used: {getattr(exc, 'strerror', None) or exc}") from None


def _probe_writable(option: str, shown: str, path: Path, *, is_dir: bool) -> None:
    if not is_dir and path.is_dir():
        raise PlanError(f"{option} {shown} is a directory: give a file name for the trained parameters")
    existing = path if is_dir else path.parent
    if not is_dir and not existing.exists():
        raise PlanError(f"{option} {shown}: directory {str(existing)[:200]} does not exist: create it first")
    while is_dir and not existing.exists() and existing != existing.parent:
        existing = existing.parent  # the directory is made if missing: its ancestor must be writable
    if not existing.is_dir():
        raise PlanError(f"{option} {shown}: {str(existing)[:200]} is not a directory: give a path in a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".autoplan-write-check-")
    except OSError as exc:
        raise PlanError(
            f"{option} {shown} cannot be written ({str(existing)[:200]}: {exc.strerror}): give a writable location"
        ) from None
    os.close(fd)
    os.unlink(probe)
