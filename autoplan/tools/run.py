"""``autoplan run``: train a workload with a plan under torchrun, on this machine or on several nodes.

    autoplan run my_models.py:build --plan plan.json --steps 10
    autoplan run my_models.py:build --cluster 2xCPU --steps 10        # plans first
    autoplan run my_models.py:build --plan plan.json --nnodes 2 --rdzv-endpoint node1:29400  # on each node

Everything a rank would otherwise find out late is checked here first, in this order: the
options (the nodes among them, :mod:`autoplan.tools.nodes`), where the ranks write
(``--checkpoint-dir``, ``--save-final``) and the torchrun port; then, before planning, the data
options (``--shuffle``, ``--data-seed``) against the workload's dataset, the batch, ``--nproc``
and the ranks per node against the workload and the cluster; then that the rendezvous host of
several nodes resolves; then the plan (loaded
and checked against the model, or made); then the checkpoint to resume from. Only then is
``python -m torch.distributed.run ... -m autoplan.tools.worker`` launched, one rank per device of
the plan on one node, or ``--nproc-per-node`` ranks on each of ``--nnodes`` nodes joined by
torchrun's c10d rendezvous.

On several nodes each node runs the same command; without ``--plan`` each node plans for itself,
and the ranks check at start-up that they all hold the same plan (its digest, all-gathered in
``autoplan/tools/worker.py``) before building anything: the planner is deterministic for the same
inputs, but a node with other measured op times, links or versions plans otherwise, and one
program per rank from two plans would not add up to one model. A mismatch stops every node with
one error line (plan once and give every node ``--plan``).

Bad input found in the ranks (that mismatch, a checkpoint no rank can load) comes back through a
file the ranks write before exiting 0 (``--bad-input-file``): a non-zero exit is a crash to
torchrun, which would print its failure report and, under ``--max-restarts``, start the ranks
again on the same bad input. This command then prints the one line and exits 2. A NaN or
infinite loss is reported that way too, naming its step, before that step's optimizer step and
checkpoint (``--allow-nonfinite``: a warning at the first one, and training goes on).
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from autoplan.cost_models.errors import PlanError, PlanMismatchError
from autoplan.cost_models.files import refuse_overwriting_inputs
from autoplan.planner.plan import Plan
from autoplan.tools import common, console, launch, nodes
from autoplan.tools.nodes import Nodes

DEFAULT_MASTER_PORT = 29533
WORKER_MODULE = "autoplan.tools.worker"
"""The rank entry point torchrun starts (``python -m``)."""
BAD_INPUT_FILE = "bad_input.txt"
"""Where the ranks of one node report bad input found after launch (in this command's temporary directory)."""


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
    p.add_argument(
        "--shuffle",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reshuffle the workload's map-style dataset every pass, the same order on every rank "
        "(default: Workload.shuffle)",
    )
    p.add_argument(
        "--data-seed",
        type=common.seed,
        metavar="N",
        help="seed of the shuffled order (pass p uses N + p; default: --seed)",
    )
    p.add_argument("--show-code", action="store_true", help="print the generated per-rank program")
    p.add_argument(
        "--master-port",
        type=common.port,
        help=f"torchrun port on 127.0.0.1 of a one-node run, refused if in use (default: {DEFAULT_MASTER_PORT}, "
        "or a free port if that is taken)",
    )
    nodes.add_arguments(p)
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
    p.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="train on past a NaN or infinite loss (a warning names the first step); default: stop there with exit 2",
    )
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    layout, master_port = _check_options(args)
    _check_before_planning(args, layout)
    layout.check_endpoint_resolves()  # before planning, which may take long
    with tempfile.TemporaryDirectory(prefix="autoplan-", ignore_cleanup_errors=True) as tmpdir:
        if args.plan is not None:
            plan = _load_checked_plan(args, layout)
            plan_path = args.plan
        else:
            plan = common.make_plan(args)
            plan_path = os.path.join(tmpdir, "plan.json")
            plan.save(plan_path)
        nproc_per_node = layout.ranks_per_node(plan.world_size, what="the plan")
        if args.checkpoint_dir is not None:
            _check_resumable(args, plan)
        if not args.quiet:
            print(plan.summary(), file=console.stdout(), flush=True)
            if layout.num_nodes > 1:
                print(f"{layout}: {nproc_per_node} local ranks", file=console.stdout(), flush=True)
                _note_other_layout(plan, layout.num_nodes, nproc_per_node)
        bad_input = Path(tmpdir, BAD_INPUT_FILE)
        join_timeout_s = launch.join_timeout_s(os.environ)

        def command(port: int | None) -> list[str]:
            rendezvous = layout.torchrun_args(
                nproc_per_node=nproc_per_node, master_port=port, join_timeout_s=join_timeout_s
            )
            return _torchrun_command(args, plan_path, rendezvous, bad_input)

        # a port autoplan picked may be taken before torchrun binds it: then another (launch.py)
        picked = master_port is not None and args.master_port is None
        rc = launch.call_torchrun(
            command(master_port),
            retry_port=(master_port, command) if picked and master_port is not None else None,
            rendezvous=layout.rendezvous(join_timeout_s),
            env={**_rank_environment(args), **layout.torchrun_env()},
            stdout=console.subprocess_stdout(),
        )
        if bad_input.exists():  # the ranks found bad input (module docstring)
            raise PlanError(bad_input.read_text(encoding="utf-8").strip())
    return common.EXIT_BAD_INPUT if rc == common.EXIT_BAD_INPUT else rc


def _check_options(args: argparse.Namespace) -> tuple[Nodes, int | None]:
    """Check the options, the nodes, where the ranks write and their port, before any planning
    or training; returns the nodes and the torchrun port of a one-node run (``None`` on several
    nodes: they meet at the rendezvous endpoint)."""
    if args.plan is None and args.cluster is None:
        raise PlanError("autoplan run needs --plan plan.json or --cluster SPEC to plan first")
    layout = nodes.nodes_from_args(args, os.environ)
    launch.collective_timeout_s(os.environ)  # the ranks read it: malformed, it is named here
    launch.join_timeout_s(os.environ)
    if args.save_final is not None:
        refuse_overwriting_inputs(args.save_final, common.planning_inputs(args), option="--save-final")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise PlanError(f"--checkpoint-every {args.checkpoint_every}: give a number of steps >= 1")
    if args.checkpoint_every is not None and args.checkpoint_dir is None:
        raise PlanError("--checkpoint-every needs --checkpoint-dir DIR to write the checkpoints into")
    if args.checkpoint_dir is not None:
        real_checkpoint_dir(args.checkpoint_dir)  # a symlink loop is named here, not after training
    if args.checkpoint_dir is not None and Path(args.checkpoint_dir).is_file():
        raise PlanError(f"--checkpoint-dir {args.checkpoint_dir!r} is a file: give a directory (made if missing)")
    if args.max_restarts < 0:
        raise PlanError(f"--max-restarts {args.max_restarts}: give a number >= 0")
    if args.checkpoint_dir is not None:
        _check_writable("--checkpoint-dir", Path(real_checkpoint_dir(args.checkpoint_dir)), is_dir=True)
    if args.save_final is not None:
        _check_writable("--save-final", Path(args.save_final), is_dir=False)
    if layout.num_nodes > 1:
        return layout, None
    return layout, launch.master_port(args.master_port, default=DEFAULT_MASTER_PORT)


def _check_before_planning(args: argparse.Namespace, layout: Nodes) -> None:
    """``--shuffle``/``--data-seed`` against the workload's dataset; without ``--plan``:
    ``--global-batch-size``, ``--nproc`` and the ranks per node against the workload and the
    cluster, before planning, which may take long."""
    # the workload loader imports torch: loaded when the command runs, not at CLI start-up
    from autoplan.tools.loader import build_workload

    if args.shuffle is not None or args.data_seed is not None:  # the workload's dataset decides
        from autoplan.tools.training_data import data_options

        wl = build_workload(args.target, device="meta", seed=args.seed)
        data_options(wl, shuffle=args.shuffle, data_seed=args.data_seed, seed=args.seed)
    if args.plan is None and args.global_batch_size is not None:  # the ranks train on the workload's batch
        inputs = build_workload(args.target, device="meta", seed=args.seed).example_inputs
        batch = int(inputs[0].shape[0]) if inputs and inputs[0].dim() else 0
        if batch != args.global_batch_size:
            raise PlanMismatchError(
                f"--global-batch-size {args.global_batch_size} does not match the {batch} samples of the workload's "
                f"inputs, which `autoplan run` trains on: give --global-batch-size {batch} or change the workload"
            )
    if args.plan is None:
        cluster = common.cluster_from_args(args.cluster, args.mesh)
        layout.ranks_per_node(cluster.world_size, what=f"--cluster {args.cluster}")
        if args.nproc is not None and args.nproc != cluster.world_size:
            raise PlanMismatchError(
                f"--nproc {args.nproc} does not match the {cluster.world_size} devices of --cluster {args.cluster}: "
                f"drop --nproc or plan for a cluster of {args.nproc} devices"
            )


def _load_checked_plan(args: argparse.Namespace, layout: Nodes) -> Plan:
    """``--plan``, checked against ``--nproc``, the nodes and the model before any rank is
    launched (a meta trace is cheap)."""
    # the tracer, the planner and the workload loader import torch: loaded when the command runs
    from autoplan.passes.trace import trace_training_step
    from autoplan.planner.ilp import check_plan_fits
    from autoplan.planner.tracing import trace_for_plan
    from autoplan.runtime.precision import check_model_precision
    from autoplan.tools.loader import build_workload

    plan = Plan.load(args.plan)
    if args.nproc is not None and args.nproc != plan.world_size:
        raise PlanMismatchError(
            f"--nproc {args.nproc} does not match the plan's {plan.world_size} devices: "
            f"drop --nproc or re-plan for {args.nproc} devices"
        )
    layout.ranks_per_node(plan.world_size, what="the plan")
    wl = build_workload(args.target, device="meta", seed=args.seed)
    if plan.config is not None:  # a plan for a global batch is made for one micro-batch's step
        if plan.pipeline is not None:  # its precision: the model's dtypes must run it
            check_model_precision(
                wl.model, plan.pipeline.precision, offload_optimizer=plan.config.offload_optimizer,
                master_weights=plan.pipeline.master_weights,
            )  # fmt: skip
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


def _torchrun_command(args: argparse.Namespace, plan_path: str, rendezvous: list[str], bad_input: Path) -> list[str]:
    """``python -m torch.distributed.run RENDEZVOUS ... -m autoplan.tools.worker TARGET --plan ...``:
    this node's local ranks (``rendezvous``: :meth:`Nodes.torchrun_args`)."""
    restarts = ["--max-restarts", str(args.max_restarts)] if args.max_restarts else []
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *rendezvous,
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
        "--bad-input-file",
        str(bad_input),
    ]
    if args.compare:
        cmd.append("--compare")
    if args.shuffle is not None:
        cmd.append("--shuffle" if args.shuffle else "--no-shuffle")
    if args.data_seed is not None:
        cmd += ["--data-seed", str(args.data_seed)]
    if args.show_code:
        cmd.append("--show-code")
    if args.checkpoint_dir is not None:
        cmd += ["--checkpoint-dir", real_checkpoint_dir(args.checkpoint_dir)]
    if args.checkpoint_every is not None:
        cmd += ["--checkpoint-every", str(args.checkpoint_every)]
    if args.save_final is not None:
        cmd += ["--save-final", os.path.abspath(args.save_final)]
    if args.allow_nonfinite:
        cmd.append("--allow-nonfinite")
    return cmd


def real_checkpoint_dir(path: str) -> str:
    """``--checkpoint-dir`` with its symlinks resolved (the ranks write, and the probe checks,
    the real directory); PlanError when a link loops or cannot be resolved."""
    try:
        real = str(Path(path).resolve(strict=False))  # a loop: RuntimeError (Python < 3.13)
        os.stat(real)  # a loop left unresolved (Python >= 3.13): ELOOP
    except FileNotFoundError:
        return real  # made by the ranks
    except (OSError, RuntimeError) as exc:
        if isinstance(exc, OSError) and exc.errno != errno.ELOOP:
            return real  # not a link problem: the write probe names it
        raise PlanError(
            f"--checkpoint-dir {path[:200]!r} is a symlink loop (or passes through one): give a real directory"
        ) from None
    return real


def _note_other_layout(plan: Plan, num_nodes: int, nproc_per_node: int) -> None:
    """A plan priced for another split into nodes runs the same numbers, but its link prices
    (within a node, between nodes) are not those of the run: say so on stderr."""
    cluster = plan.cluster
    if (cluster.num_nodes, cluster.devices_per_node) != (num_nodes, nproc_per_node):
        print(
            f"autoplan: the plan was priced for {cluster.num_nodes} node(s) of {cluster.devices_per_node} devices and "
            f"runs on {num_nodes} nodes of {nproc_per_node}: same results, other link costs; plan for "
            f"{num_nodes}x{nproc_per_node}x{cluster.device.name} "
            "to price the links between nodes",
            file=sys.stderr,
            flush=True,
        )


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
