"""``autoplan calibrate``: time the collectives of a cluster and save them as a cluster profile.

    autoplan calibrate --cluster 2xCPU --out cpu2.yaml          # starts torchrun on this machine
    autoplan plan my_models.py:build --cluster cpu2.yaml --out plan.json
    autoplan calibrate --from-profile trace.json --plan plan.json --out cpu2-fitted.yaml

``--from-profile`` reads a ``torch.profiler`` Chrome trace (``record_shapes=True``, ``prof.step()``
after every step) of a few steps of the plan and fits the compute numbers of the plan cluster's
device to it (``autoplan.cost_models.trace_calibration``): the matmul rate, the memory bandwidth
and the per-op overhead; the links stay the plan cluster's. A trace of another plan is refused.

On one machine the command launches ``python -m torch.distributed.run --nproc-per-node WORLD``
with this same command line; every rank joins a gloo (CPU device) or NCCL (GPU device) group,
builds the cluster's ``DeviceMesh`` and times every mesh axis, kind and message size of the
``Sweep`` (``autoplan.runtime.collective_bench``: how a collective is run and timed). The launcher
then fits the samples (``autoplan.cost_models.calibration``), prints measured and fitted times, and
writes the profile atomically.

The command also measures how much slower compute runs while a collective runs beside it
(``comm_compute_slowdown`` in the profile's ``calibration`` and device). A profile of the local
machine (``NxCPU``, the default 1-D mesh) is also stored in the cache that plans for ``NxCPU``
read (``autoplan.cost_models.calibration.local_cluster``); ``autoplan plan --cluster NxCPU`` runs
the ``--quick`` sweep once when none is cached (``autoplan.tools.local_links``).

A multi-node cluster cannot be calibrated from one machine. Run the same command under torchrun
on every node instead; rank 0 then fits and writes ``--out`` on its node::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint NODE0:29500 \\
        -m autoplan.tools.cli calibrate --cluster 2x8xH100 --out h100x16.yaml
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoplan.cost_models.cluster import Cluster, current_device_model
from autoplan.cost_models.files import refuse_overwriting_inputs
from autoplan.planner.plan import Plan
from autoplan.tools import common, console, launch

if TYPE_CHECKING:  # autoplan.cost_models.calibration imports torch: loaded when the command runs
    from autoplan.cost_models.calibration import Sample, Sweep
    from autoplan.cost_models.trace_calibration import TraceCalibration


def add_parser(subparsers: Any) -> None:  # argparse._SubParsersAction has no public type
    """Register ``autoplan calibrate`` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "calibrate", help="measure collectives on this machine and write a cluster profile (YAML)"
    )
    p.add_argument(
        "--cluster",
        help="preset like 2xCPU or 8xH100, or a cluster YAML/JSON file (required unless --from-profile)",
    )
    p.add_argument(
        "--from-profile",
        metavar="TRACE",
        help="fit the device's compute numbers to a torch.profiler Chrome trace of a few steps of --plan instead",
    )
    p.add_argument("--plan", help="with --from-profile: the plan file the traced run executed")
    p.add_argument("--mesh", help="logical mesh shape, e.g. 2,2 (default: nodes x devices)")
    p.add_argument("--out", "-o", default="cluster.yaml", help="profile to write (.yaml/.yml/.json)")
    p.add_argument("--min-bytes", type=int, help="smallest message, bytes (default 4096)")
    p.add_argument("--max-bytes", type=int, help="largest message, bytes (default 16 MiB = 16777216)")
    p.add_argument("--repetitions", type=int, help="timed calls per size; their mean is kept (default 15)")
    p.add_argument("--warmup", type=int, help="untimed calls per size (default 3)")
    p.add_argument(
        "--compute-gap-s",
        type=float,
        help="busy compute before each timed call, seconds, as in a training step (default 0.005 on CPU, 0 on GPU)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="the short sweep `autoplan plan` runs for an uncalibrated NxCPU (4 KiB-16 MiB, steps of 8, 6 calls)",
    )
    p.add_argument("--master-port", type=int, help="torchrun port on 127.0.0.1 (default: a free port)")
    p.add_argument("--quiet", "-q", action="store_true", help="print only the final summary line")
    p.add_argument("--samples-out", help=argparse.SUPPRESS)  # launcher <- rank 0 hand-over
    p.set_defaults(func=cmd_calibrate)


_SWEEP_OPTIONS: tuple[str, ...] = ("min_bytes", "max_bytes", "repetitions", "warmup", "compute_gap_s")


def cmd_calibrate(args: argparse.Namespace) -> int:
    # the calibration model and torch: loaded when the command runs, not at CLI start-up
    import torch

    from autoplan.cost_models.calibration import QUICK_SWEEP, CalibrationError, Sample, Sweep

    if args.from_profile is not None or args.plan is not None:
        return _from_profile(args)
    if args.cluster is None:
        raise CalibrationError("calibrate needs --cluster (the cluster to measure) or --from-profile TRACE --plan PLAN")
    # the cluster to calibrate: a file's old links and calibration are dropped (they are redone)
    cluster = common.cluster_from_args(args.cluster, args.mesh, recalibrate=True)
    options = {name: getattr(args, name) for name in _SWEEP_OPTIONS if getattr(args, name) is not None}
    sweep = dataclasses.replace(QUICK_SWEEP, **options) if args.quick else Sweep(**options)
    out = Path(args.out)
    if out.suffix.lower() not in (".yaml", ".yml", ".json"):
        raise CalibrationError(f"--out '{out}' has extension {out.suffix!r}; use .yaml, .yml or .json")
    if not out.parent.is_dir():
        raise CalibrationError(f"--out '{out}': directory '{out.parent}' does not exist")
    refuse_overwriting_inputs(out, {"cluster file": args.cluster}, error=CalibrationError)
    if cluster.world_size < 2:
        raise CalibrationError(f"cluster {cluster} has one device and no link to measure; use 2 devices or more")
    if _launched_by_torchrun():
        return _rank_main(args, cluster, sweep)
    if cluster.num_nodes > 1:
        raise CalibrationError(
            f"cluster {cluster} spans {cluster.num_nodes} nodes and one machine cannot calibrate it: run "
            f"`torchrun --nnodes {cluster.num_nodes} --nproc-per-node {cluster.devices_per_node} "
            "--rdzv-backend c10d --rdzv-endpoint NODE0:29500 -m autoplan.tools.cli calibrate ...` on every node"
        )
    if cluster.backend == "nccl" and torch.cuda.device_count() < cluster.world_size:
        raise CalibrationError(
            f"cluster {cluster} needs {cluster.world_size} GPUs but this machine has {torch.cuda.device_count()}; "
            "calibrate on the target machine"
        )
    with tempfile.TemporaryDirectory(prefix="autoplan-calibrate-") as tmp:
        samples_path = Path(tmp) / "samples.json"
        if not args.quiet:
            print(
                f"calibrating {cluster} on {cluster.world_size} {cluster.backend} ranks ...",
                file=console.stdout(),
                flush=True,
            )
        rc = _launch(
            _rank_arguments(args),
            world_size=cluster.world_size,
            samples_path=samples_path,
            verbose=bool(getattr(args, "verbose", False)),
            master_port=args.master_port,
            stdout=console.subprocess_stdout(),
        )
        if rc != 0 or not samples_path.is_file():
            raise CalibrationError(
                f"calibration ranks failed (torchrun exit code {rc}); see their output above, add -v for details"
            )
        data = json.loads(samples_path.read_text(encoding="utf-8"))
    samples = [Sample(**s) for s in data["samples"]]
    _finish(
        cluster,
        samples,
        device_model=data["device_model"],
        slowdown=data["comm_compute_slowdown"],
        out=out,
        quiet=args.quiet,
    )
    return 0


# --- From a profiler trace -------------------------------------------------------------------------


def _from_profile(args: argparse.Namespace) -> int:
    """``calibrate --from-profile TRACE --plan PLAN [--out CLUSTER]``: fit the plan cluster's device
    to the trace (``autoplan.cost_models.trace_calibration``), print the fit and write the profile
    atomically (nothing is written when the trace is refused)."""
    from autoplan.cost_models.calibration import CalibrationError

    if args.from_profile is None or args.plan is None:
        raise CalibrationError(
            "calibrate --from-profile TRACE needs --plan PLAN.json (the plan the traced run executed), and --plan needs --from-profile"
        )
    ignored = [f"--{n.replace('_', '-')}" for n in ("cluster", "mesh", *_SWEEP_OPTIONS) if getattr(args, n) is not None]
    if ignored or args.quick:
        raise CalibrationError(
            f"calibrate --from-profile takes its cluster from --plan; drop {', '.join(ignored or ['--quick'])}"
        )
    out = Path(args.out)
    if out.suffix.lower() not in (".yaml", ".yml", ".json"):
        raise CalibrationError(f"--out '{out}' has extension {out.suffix!r}; use .yaml, .yml or .json")
    if not out.parent.is_dir():
        raise CalibrationError(f"--out '{out}': directory '{out.parent}' does not exist")
    refuse_overwriting_inputs(out, {"trace": args.from_profile, "plan file": args.plan}, error=CalibrationError)
    result = calibrate_from_profile(args.from_profile, args.plan, out=out)
    from autoplan.cost_models.trace_calibration import fit_table

    fit = result.fit
    if not args.quiet:
        print(fit_table(result), file=console.stdout())
        print(f"wrote {out}", file=console.stdout())
    print(
        f"calibrate: from_profile={Path(args.from_profile).name} steps={fit.num_steps} ops={fit.num_ops} "
        f"op_err_median={fit.op_err_median:.1%} op_overhead_us={fit.op_overhead_us:g} out={out}",
        file=console.stdout(),
    )
    return 0


def calibrate_from_profile(
    trace: str | os.PathLike[str], plan: str | os.PathLike[str] | Plan, *, out: str | os.PathLike[str] | None = None
) -> TraceCalibration:
    """Fit the device of ``plan``'s cluster (a ``Plan`` or a plan file) to the profiler trace
    ``trace`` of a few of its steps and, with ``out``, write the cluster profile atomically.
    Raises ``TraceCalibrationError`` (``TraceMismatchError``: a trace of another plan)."""
    from autoplan.cost_models.trace_calibration import calibrate_from_trace

    loaded = plan if isinstance(plan, Plan) else Plan.load(plan)
    what = "the plan" if isinstance(plan, Plan) else f"plan {Path(plan).name}"
    return calibrate_from_trace(
        trace,
        cluster=loaded.cluster,
        plan_ops=[str(node["op"]) for node in loaded.nodes.values()],
        plan_collectives=loaded.step_collective_counts(),
        plan_fingerprint=loaded.fingerprint,
        modelled_comm_s=loaded.estimate.exposed_comm_s,
        out=out,
        what=what,
    )


# --- Launcher --------------------------------------------------------------------------------------


def _launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def _rank_arguments(args: argparse.Namespace) -> list[str]:
    """The ``calibrate`` command line the ranks run: this one's cluster, mesh, sweep and output."""
    return [
        "calibrate",
        "--cluster",
        args.cluster,
        "--out",
        args.out,
        *(["--quick"] if args.quick else []),
        *(
            arg
            for name in _SWEEP_OPTIONS
            if getattr(args, name) is not None
            for arg in (f"--{name.replace('_', '-')}", str(getattr(args, name)))
        ),
        *(["--mesh", args.mesh] if args.mesh else []),
    ]


def _launch(
    rank_arguments: list[str],
    *,
    world_size: int,
    samples_path: Path,
    verbose: bool,
    master_port: int | None,
    stdout: int | None,
) -> int:
    """Run ``autoplan <rank_arguments> --samples-out samples_path`` on ``world_size`` local ranks
    under torchrun; return its exit code."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(world_size),
        "--nnodes",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(launch.master_port(master_port)),
        "-m",
        "autoplan.tools.cli",
        *(["--verbose"] if verbose else []),
        *rank_arguments,
        "--samples-out",
        str(samples_path),
    ]
    env = launch.rank_environment(verbose=verbose)
    return launch.call_torchrun(cmd, env=env, stdout=stdout)


def _finish(
    cluster: Cluster, samples: Sequence[Sample], *, device_model: str, slowdown: float, out: Path, quiet: bool
) -> None:
    """Fit, write the profile (and cache it when it is the local machine's), print the table
    (unless ``quiet``) and the summary line."""
    from autoplan.cost_models import calibration  # torch: see cmd_calibrate

    profile = calibration.build_profile(cluster, samples, device_model=device_model, comm_compute_slowdown=slowdown)
    calibration.write_profile(profile, out)
    cached = ""
    if calibration.is_local_cpu(cluster) and cluster.mesh_ndim == 1:
        cached_path = calibration.cache_profile(profile)  # None (with a warning): not cached, --out is written
        cached = f" cached={cached_path}" if cached_path is not None else ""
    if not quiet:
        print(format_table(profile, samples), file=console.stdout())
        print(f"compute beside a collective: {slowdown:+.1%} (comm_compute_slowdown)", file=console.stdout())
        print(f"wrote {out}", file=console.stdout())
    assert profile.calibration is not None
    axes = ",".join(f"{name}({profile.mesh_shape[i]})" for i, name in enumerate(profile.mesh_axis_names))
    print(
        f"calibrate: axes={axes} fit_err_median={profile.calibration.fit_err_median:.1%} "
        f"comm_compute_slowdown={slowdown:+.3f} samples={len(samples)} out={out}{cached}",
        file=console.stdout(),
    )


def format_table(profile: Cluster, samples: Sequence[Sample]) -> str:
    """Measured and fitted time per axis, kind and size, with each fit's numbers."""
    from autoplan.cost_models.calibration import fitted_time_s  # torch: see cmd_calibrate

    lines = []
    for axis in profile.mesh_axis_names:
        if axis not in profile.links:
            continue
        link = profile.links[axis]
        n = profile.mesh_shape[profile.axis_index(axis)]
        lines.append(f"axis {axis} ({n} ranks): joint fit {link}")
        lines.append(f"  {'kind':<15} {'bytes':>10} {'measured_us':>12} {'fitted_us':>10} {'err':>7}")
        for kind, fit in link.collectives.items():
            for s in (s for s in samples if s.axis == axis and s.kind == kind):
                t = fitted_time_s(s, fit, backend=profile.backend)
                err = (t - s.time_s) / s.time_s
                lines.append(f"  {kind:<15} {s.nbytes:>10} {s.time_s * 1e6:>12.1f} {t * 1e6:>10.1f} {err:>+7.1%}")
            lines.append(f"  {kind} fit: {fit} (median error {fit.fit_err:.1%})")
    return "\n".join(lines)


# --- On a rank ------------------------------------------------------------------------------------


def _rank_main(args: argparse.Namespace, cluster: Cluster, sweep: Sweep) -> int:
    """This process is one rank under torchrun: time the collectives with the others; rank 0
    hands the samples to the launcher (``--samples-out``) or, run by hand on every node, fits
    and writes the profile itself."""
    # the collective benchmark runs torch.distributed: loaded on the ranks only
    from autoplan.runtime.collective_bench import measure_on_ranks

    rank, samples, slowdown = measure_on_ranks(cluster, sweep, verbose=bool(getattr(args, "verbose", False)))
    if rank != 0:
        return 0
    device_model = current_device_model(cluster.backend) or "unknown"
    if args.samples_out:
        payload = {
            "samples": [dataclasses.asdict(s) for s in samples],
            "device_model": device_model,
            "comm_compute_slowdown": slowdown,
        }
        Path(args.samples_out).write_text(json.dumps(payload), encoding="utf-8")
        return 0
    _finish(cluster, samples, device_model=device_model, slowdown=slowdown, out=Path(args.out), quiet=args.quiet)
    return 0
