"""``autoplan profile``: time every distinct op of a workload's training step on this machine.

    autoplan profile examples/hf_models.py:gpt2_tiny --cluster 2xCPU
    autoplan profile my_models.py:build --cluster 1x8xH100 --mesh 2,4 --device cuda

The workload is traced on the ``meta`` device and its strategies are enumerated on a fake mesh of
the cluster's shape; each distinct (op, local shard shapes, dtypes) is then traced through DTensor
to the local ops the lowered program runs, and those are timed on ``--device`` (see
:mod:`autoplan.runtime.op_timing`). Times go to this machine's profile database
(:mod:`autoplan.cost_models.profile_db`; ``--profile-db PATH`` for another file), which later plans read;
keys already in it are not measured again.

CPU times depend on torch's intra-op threads; the database records the count. The profiler
times with the threads a training rank uses (``OMP_NUM_THREADS`` when set, else 1 as under
``torchrun`` and ``autoplan run``; :func:`~autoplan.cost_models.profile_db.cpu_rank_threads`),
and planning for CPU ranks reads the profile of that count.

The summary compares the profiled time of the slowest keys with the analytic roofline the
planner would otherwise use, and ends with one machine-readable line::

    profile: keys=286 matmul_analytic_err_median=85.2%
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.errors import PlanError, ProfileError
from autoplan.cost_models.memory import OPTIMIZERS
from autoplan.tools import common, console

if TYPE_CHECKING:  # these import torch: loaded when the command runs, not at CLI start-up
    from autoplan.cost_models.profile_db import ProfileDB
    from autoplan.passes.strategies import StrategyTable
    from autoplan.passes.trace import TracedProgram
    from autoplan.runtime.op_timing import ProfileReport

log = logging.getLogger(__name__)

_MATMULS = ("aten.mm.default(", "aten.addmm.default(", "aten.bmm.default(")
_TOP = 10
_OP_WIDTH = 96


def add_parser(subparsers: Any) -> argparse.ArgumentParser:  # argparse's private subparsers type
    """Register ``autoplan profile`` on the CLI's subparsers."""
    p = subparsers.add_parser("profile", help="time the ops of a workload on this machine's device")
    p.add_argument("target", help="FILE.py:FUNCTION returning autoplan.Workload")
    p.add_argument("--cluster", required=True, help="cluster whose mesh shape sets the shard shapes, e.g. 4xCPU")
    p.add_argument("--mesh", help="logical mesh shape, e.g. 2,2 (default: nodes x devices)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device to time on (default: cpu)")
    p.add_argument("--profile-db", metavar="PATH", help="database file (default: this machine's file in the cache)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, help="optimizer to time (default: the workload's)")
    p.add_argument(
        "--repeats", type=common.positive_int, default=5, help="timed rounds per op; the median is kept (default: 5)"
    )
    p.add_argument(
        "--warmup", type=common.non_negative_int, default=3, help="untimed calls per op before timing (default: 3)"
    )
    p.add_argument("--seed", type=common.seed, default=0, help="random seed of the model's weights (0..2**63-1)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar, print only the final line")
    p.add_argument(
        "--concurrent",
        type=common.positive_int,
        help="processes timing the same ops at once, as many as the ranks that will share this machine "
        "(default: the cluster's devices per node, capped at the CPU count, for cpu; 1 for cuda)",
    )
    p.set_defaults(func=cmd_profile)
    return p


def cmd_profile(args: argparse.Namespace) -> int:
    """``autoplan profile``: on CPU with the ranks' intra-op threads (restored afterwards: the
    command may run inside a longer-lived process)."""
    if args.device != "cpu":
        return _cmd_profile(args)
    import torch

    from autoplan.cost_models.profile_db import cpu_rank_threads

    before = torch.get_num_threads()
    torch.set_num_threads(cpu_rank_threads())  # time (and key) ops as a training rank runs them
    try:
        return _cmd_profile(args)
    finally:
        torch.set_num_threads(before)


def _cmd_profile(args: argparse.Namespace) -> int:
    # tracing, strategies, the op profiler and the database import torch: loaded when the command runs
    from autoplan.cost_models.profile_db import ProfileDB
    from autoplan.passes.strategies import build_strategy_table
    from autoplan.passes.trace import trace_training_step
    from autoplan.planner.mesh import planning_mesh
    from autoplan.runtime.op_timing import profile_program
    from autoplan.tools.loader import build_workload

    cluster = common.cluster_from_args(args.cluster, args.mesh)
    concurrent = args.concurrent or (min(cluster.devices_per_node, os.cpu_count() or 1) if args.device == "cpu" else 1)
    if concurrent > 1:
        return _profile_concurrently(args, concurrent)
    if args.device == "cpu" and args.concurrent is None:
        _warn_if_busy()
    # open the database first: a missing GPU or a foreign/corrupted file fails before any tracing
    db = (
        ProfileDB.open_path(args.profile_db, args.device)
        if args.profile_db
        else ProfileDB.open_for_current_device(args.device)
    )
    wl = build_workload(args.target, device="meta", seed=args.seed)
    optimizer = args.optimizer or wl.optimizer
    if optimizer not in OPTIMIZERS:
        raise PlanError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    traced = trace_training_step(wl.model, wl.example_inputs, loss_fn=wl.loss_fn, example_targets=wl.example_targets)
    with planning_mesh(cluster, device_type=args.device) as mesh:
        table = build_strategy_table(traced, mesh)
        before = len(db)
        try:
            report = profile_program(
                traced,
                table,
                mesh,
                db,
                device=args.device,
                optimizer=optimizer,
                warmup=args.warmup,
                repeats=args.repeats,
                progress=False if args.quiet else None,
            )
        finally:
            if len(db) != before:
                db.save()  # what was measured is kept even if profiling is interrupted
    if not db.path.exists():
        db.save()  # nothing new, but the database file exists after a successful run
    rows = _comparison(report, traced, table, cluster, optimizer)
    matmul_errs = [abs(err) for _, _, err, op in rows if op.startswith(_MATMULS)]
    median = f"{statistics.median(matmul_errs):.1f}%" if matmul_errs else "n/a"
    if not args.quiet:
        _print_summary(args, db, report, rows, cluster)
    print(f"profile: keys={report.num_keys} matmul_analytic_err_median={median}", file=console.stdout())
    return 0


def _profile_concurrently(args: argparse.Namespace, num_procs: int) -> int:
    """Run ``num_procs`` copies of this command at once, each timing every key into its own
    copy of the database, and keep the median per key: CPU ranks on one machine share caches,
    memory bandwidth and cores, so an op timed alone runs faster than in training (measured on a
    2-core VM: ~25% faster). The copies start from the same database so they time the same keys
    in the same order, side by side."""
    from autoplan.cost_models.profile_db import ProfileDB  # imports torch: see cmd_profile

    target = (
        ProfileDB.open_path(args.profile_db, args.device)
        if args.profile_db
        else ProfileDB.open_for_current_device(args.device)
    )
    with tempfile.TemporaryDirectory(prefix="autoplan-profile-") as tmp:
        parts = [Path(tmp) / f"part{i}.json" for i in range(num_procs)]
        for part in parts:
            if target.path.exists():
                shutil.copyfile(target.path, part)
        base = [sys.executable, "-m", "autoplan.tools.cli", "profile", args.target, "--cluster", args.cluster]
        base += ["--device", args.device, "--repeats", str(args.repeats), "--warmup", str(args.warmup)]
        base += ["--seed", str(args.seed), "--concurrent", "1", "--quiet"]
        base += [
            *(["--mesh", args.mesh] if args.mesh else []),
            *(["--optimizer", args.optimizer] if args.optimizer else []),
        ]
        env = dict(os.environ)
        if args.device == "cpu":
            from autoplan.cost_models.profile_db import cpu_rank_threads

            env["OMP_NUM_THREADS"] = str(cpu_rank_threads())
        procs = [
            subprocess.Popen([*base, "--profile-db", str(part)], stdout=subprocess.PIPE, text=True, env=env)
            for part in parts
        ]
        outputs = [p.communicate()[0] for p in procs]
        if any(p.returncode != 0 for p in procs):
            raise ProfileError(f"a concurrent profiling process failed (exit codes {[p.returncode for p in procs]})")
        dbs = [ProfileDB.load(part) for part in parts]
    measured = 0
    for key in sorted(set().union(*(set(db) for db in dbs))):
        if key in target:
            continue
        times = [t for db in dbs if (t := db.lookup(key)) is not None]
        target.record(key, statistics.median(times))
        measured += 1
    target.save()
    last = outputs[0].strip().splitlines()[-1] if outputs[0].strip() else ""
    if not args.quiet:
        print(
            f"profiled with {num_procs} concurrent processes: {measured} new keys in {target.path}",
            file=console.stdout(),
        )
    print(
        last.replace("profile:", f"profile: concurrent={num_procs}", 1) if last else f"profile: keys={len(target)}",
        file=console.stdout(),
    )
    return 0


def _warn_if_busy() -> None:
    """CPU times of a busy machine are inflated (threads wait for cores other processes hold)."""
    import torch  # heavy: see cmd_profile

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    num_cores = os.cpu_count() or 1
    if load + torch.get_num_threads() > num_cores + 0.5:
        log.warning(
            "load average %.1f on %d cores with %d torch threads: other processes compete for the CPU and "
            "profiled times will be inflated; profile on a quiet machine or lower OMP_NUM_THREADS",
            load,
            num_cores,
            torch.get_num_threads(),
        )


Row = tuple[float, float, float, str]
"""``(profiled_s, analytic_s, err_percent, key)``."""


def _comparison(
    report: ProfileReport, traced: TracedProgram, table: StrategyTable, cluster: Cluster, optimizer: str
) -> list[Row]:
    """``(profiled_s, analytic_s, err_percent, key)`` for every key with a profiled time, slowest first."""
    from autoplan.passes.costing import analytic_time_s  # imports torch: see cmd_profile

    node_by_name = {n.name: n for n in traced.graph_module.graph.nodes}
    rows: list[Row] = []
    for e in report.entries:
        if e.time_s is None:
            continue
        node = node_by_name[e.node]
        strategy = table.nodes[e.node].strategies[e.strategy_index]
        analytic_s = analytic_time_s(node, strategy, e.kind, cluster.device, cluster.mesh_shape, optimizer=optimizer)
        err = (analytic_s - e.time_s) / e.time_s * 100.0 if e.time_s > 0 else float("inf")
        rows.append((e.time_s, analytic_s, err, e.key))
    rows.sort(key=lambda r: -r[0])
    return rows


def _print_summary(
    args: argparse.Namespace, db: ProfileDB, report: ProfileReport, rows: list[Row], cluster: Cluster
) -> None:
    print(f"profile database: {db.path}", file=console.stdout())
    print(f"measured on: {db.device}; shard shapes for {cluster}", file=console.stdout())
    print(
        f"keys: {report.num_keys} ({report.num_measured} measured, {report.num_cached} cached, "
        f"{report.num_failed} failed) in {report.wall_s:.1f}s; the database holds {len(db)} times",
        file=console.stdout(),
    )
    if (cluster.device.name == "CPU") != (args.device == "cpu"):
        print(
            f"note: analytic estimates are for the cluster's {cluster.device.name}, ops ran on {args.device}",
            file=console.stdout(),
        )
    if not rows:
        return
    print(
        f"slowest keys, profiled vs analytic roofline on {cluster.device.name} (err = analytic/profiled - 1):",
        file=console.stdout(),
    )
    print(f"  {'profiled_us':>11} {'analytic_us':>11} {'err':>7}  op", file=console.stdout())
    for profiled_s, analytic_s, err, key in rows[:_TOP]:
        text = key if len(key) <= _OP_WIDTH else key[: _OP_WIDTH - 3] + "..."
        print(f"  {profiled_s * 1e6:11.1f} {analytic_s * 1e6:11.1f} {err:+6.0f}%  {text}", file=console.stdout())
