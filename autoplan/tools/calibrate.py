"""``autoplan calibrate``: time the collectives of a cluster and save them as a cluster profile.

    autoplan calibrate --cluster 2xCPU --out cpu2.yaml          # starts torchrun on this machine
    autoplan plan my_models.py:build --cluster cpu2.yaml --out plan.json

On one machine the command launches ``python -m torch.distributed.run --nproc-per-node WORLD``
with this same command line; every rank joins a gloo (CPU device) or NCCL (GPU device) group,
builds the cluster's ``DeviceMesh`` and, for every mesh axis, kind and message size of the
``Sweep``, times the ``autoplan.runtime.collectives`` call the generated program makes on a DTensor (so
DTensor's Python overhead is part of the fitted latency; send/recv uses
``torch.distributed.batch_isend_irecv`` on the axis group). Each timing is the slowest rank's,
after warm-up calls and a barrier, and a sample is the mean of the repetitions (a step pays the
expected time, waits for a late rank included, not the typical one). The launcher
then fits the samples (``autoplan.cost_models.calibration``), prints measured and fitted times, and
writes the profile atomically.

A multi-node cluster cannot be calibrated from one machine. Run the same command under torchrun
on every node instead; rank 0 then fits and writes ``--out`` on its node::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint NODE0:29500 \\
        -m autoplan.tools.cli calibrate --cluster 2x8xH100 --out h100x16.yaml
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoplan.tools import console, launch

if TYPE_CHECKING:  # torch and the cost models load when the command runs, not when the CLI starts
    import torch

    from autoplan.cost_models.calibration import Sample, Sweep
    from autoplan.cost_models.cluster import Cluster, CommKind

logger = logging.getLogger(__name__)

EXIT_BAD_INPUT = 2


def add_parser(subparsers: Any) -> None:  # argparse._SubParsersAction has no public type
    """Register ``autoplan calibrate`` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "calibrate", help="measure collectives on this machine and write a cluster profile (YAML)"
    )
    p.add_argument("--cluster", required=True, help="preset like 2xCPU or 8xH100, or a cluster YAML/JSON file")
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
    p.add_argument("--master-port", type=int, help="torchrun port on 127.0.0.1 (default: a free port)")
    p.add_argument("--quiet", "-q", action="store_true", help="print only the final summary line")
    p.add_argument("--samples-out", help=argparse.SUPPRESS)  # launcher <- rank 0 hand-over
    p.set_defaults(func=cmd_calibrate)


_SWEEP_OPTIONS: tuple[str, ...] = ("min_bytes", "max_bytes", "repetitions", "warmup", "compute_gap_s")


def cmd_calibrate(args: argparse.Namespace) -> int:
    from autoplan.cost_models.calibration import CalibrationError, Sample, Sweep
    from autoplan.cost_models.files import refuse_overwriting_inputs

    cluster = _target_cluster(args.cluster, args.mesh)
    sweep = Sweep(**{name: getattr(args, name) for name in _SWEEP_OPTIONS if getattr(args, name) is not None})
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
    import torch

    if cluster.backend == "nccl" and torch.cuda.device_count() < cluster.world_size:
        raise CalibrationError(
            f"cluster {cluster} needs {cluster.world_size} GPUs but this machine has {torch.cuda.device_count()}; "
            "calibrate on the target machine"
        )
    with tempfile.TemporaryDirectory(prefix="autoplan-calibrate-") as tmp:
        samples_path = Path(tmp) / "samples.json"
        rc = _launch(args, cluster, samples_path)
        if rc != 0 or not samples_path.is_file():
            raise CalibrationError(
                f"calibration ranks failed (torchrun exit code {rc}); see their output above, add -v for details"
            )
        data = json.loads(samples_path.read_text(encoding="utf-8"))
    samples = [Sample(**s) for s in data["samples"]]
    _finish(cluster, samples, device_model=data["device_model"], out=out, quiet=args.quiet)
    return 0


# --- Launcher --------------------------------------------------------------------------------------


def _target_cluster(spec: str, mesh: str | None) -> Cluster:
    """The cluster to calibrate; a file's old links and calibration are dropped (they are redone)."""
    from autoplan.tools.cli import _cluster  # the CLI's --cluster/--mesh parsing (cli imports this module)

    cluster: Cluster = _cluster(spec, mesh, recalibrate=True)
    return cluster


def _launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def _launch(args: argparse.Namespace, cluster: Cluster, samples_path: Path) -> int:
    """Run this command on ``cluster.world_size`` local ranks under torchrun; return its exit code."""
    verbose = bool(getattr(args, "verbose", False))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(cluster.world_size),
        "--nnodes",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(launch.master_port(args.master_port)),
        "-m",
        "autoplan.tools.cli",
        *(["--verbose"] if verbose else []),
        "calibrate",
        "--cluster",
        args.cluster,
        "--out",
        args.out,
        *(
            arg
            for name in _SWEEP_OPTIONS
            if getattr(args, name) is not None
            for arg in (f"--{name.replace('_', '-')}", str(getattr(args, name)))
        ),
        "--samples-out",
        str(samples_path),
        *(["--mesh", args.mesh] if args.mesh else []),
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if not verbose:
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        env.setdefault("LOGLEVEL", "ERROR")
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if not args.quiet:
        print(
            f"calibrating {cluster} on {cluster.world_size} {cluster.backend} ranks ...",
            file=console.stdout(),
            flush=True,
        )
    return launch.call_torchrun(cmd, env=env, stdout=console.subprocess_stdout())


def _finish(cluster: Cluster, samples: Sequence[Sample], *, device_model: str, out: Path, quiet: bool) -> None:
    """Fit, write the profile, print the table (unless ``quiet``) and the summary line."""
    from autoplan.cost_models.calibration import build_profile, write_profile

    profile = build_profile(cluster, samples, device_model=device_model)
    write_profile(profile, out)
    if not quiet:
        print(format_table(profile, samples), file=console.stdout())
        print(f"wrote {out}", file=console.stdout())
    assert profile.calibration is not None
    axes = ",".join(f"{name}({profile.mesh_shape[i]})" for i, name in enumerate(profile.mesh_axis_names))
    print(
        f"calibrate: axes={axes} fit_err_median={profile.calibration.fit_err_median:.1%} "
        f"samples={len(samples)} out={out}",
        file=console.stdout(),
    )


def format_table(profile: Cluster, samples: Sequence[Sample]) -> str:
    """Measured and fitted time per axis, kind and size, with each fit's numbers."""
    from autoplan.cost_models.calibration import fitted_time_s

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


# --- Per-rank measurement --------------------------------------------------------------------------


def _rank_main(args: argparse.Namespace, cluster: Cluster, sweep: Sweep) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autoplan.cost_models.calibration import CalibrationError
    from autoplan.cost_models.cluster import current_device_model
    from autoplan.runtime.teardown import destroy_process_groups

    backend = cluster.backend
    device_type = "cuda" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        torch.set_num_threads(1)
    if not getattr(args, "verbose", False):
        # DTensor warns once per rank that gloo all_to_all falls back to all_gather: that is what we time
        logging.getLogger("torch.distributed.tensor._collective_utils").setLevel(logging.ERROR)
    dist.init_process_group(backend)
    try:
        if dist.get_world_size() != cluster.world_size:
            raise CalibrationError(
                f"torchrun started {dist.get_world_size()} ranks but cluster {cluster} has {cluster.world_size} "
                "devices; match --nnodes x --nproc-per-node to the cluster"
            )
        mesh = init_device_mesh(device_type, cluster.mesh_shape, mesh_dim_names=cluster.mesh_axis_names)
        samples = measure(mesh, cluster, sweep)
        rank = dist.get_rank()
    except BaseException:
        destroy_process_groups(failed=True)
        raise
    destroy_process_groups()  # released now, not during interpreter exit (autoplan/runtime/teardown.py)
    if rank != 0:
        return 0
    device_model = current_device_model(backend) or "unknown"
    if args.samples_out:
        payload = {"samples": [dataclasses.asdict(s) for s in samples], "device_model": device_model}
        Path(args.samples_out).write_text(json.dumps(payload), encoding="utf-8")
        return 0
    _finish(cluster, samples, device_model=device_model, out=Path(args.out), quiet=args.quiet)
    return 0


def measure(mesh: Any, cluster: Cluster, sweep: Sweep) -> list[Sample]:
    """Time every (axis, kind, size) of ``sweep`` on ``mesh`` (collective: every rank calls it).

    Returns the same samples on every rank: per repetition the slowest rank's time, then the
    mean over repetitions."""
    import torch
    import torch.distributed as dist

    from autoplan.cost_models.calibration import Sample, sample_time_s

    device = torch.device("cuda", torch.cuda.current_device()) if cluster.backend == "nccl" else torch.device("cpu")
    points: list[tuple[str, CommKind, int, int]] = []
    rows: list[list[float]] = []
    for axis, (name, size) in enumerate(zip(cluster.mesh_axis_names, cluster.mesh_shape, strict=True)):
        if size < 2:
            continue
        for kind in sweep.kinds:
            logger.info("timing %s on axis %s", kind, name)
            for nbytes in sweep.sizes_bytes():
                payload, op = _make_op(kind, nbytes, mesh, axis, device)
                rows.append(_time_s(op, sweep, device))
                points.append((name, kind, size, payload))
    times = torch.tensor(rows, dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    means = [sample_time_s(row) for row in times.cpu().tolist()]
    return [
        Sample(axis=name, kind=kind, num_ranks=size, nbytes=payload, time_s=t)
        for (name, kind, size, payload), t in zip(points, means, strict=True)
    ]


def _compute_burst(device: torch.device, gap_s: float) -> Callable[[], None]:
    """A fixed amount of matmul work taking about ``gap_s`` on this rank (sized once, so every
    rank runs the same work and arrives at the collective with the skew real compute has)."""
    import torch

    if gap_s <= 0 or device.type == "cuda":
        return lambda: None
    a = torch.rand(128, 128)
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    per_mm_s = (time.perf_counter() - t0) / 20
    count = max(1, round(gap_s / max(per_mm_s, 1e-7)))

    def burst() -> None:
        for _ in range(count):
            a @ a

    return burst


def _time_s(op: Callable[[], None], sweep: Sweep, device: torch.device) -> list[float]:
    import torch
    import torch.distributed as dist

    gap_s = sweep.compute_gap_s if sweep.compute_gap_s is not None else (0.0 if device.type == "cuda" else 0.005)
    burst = _compute_burst(device, gap_s)
    for _ in range(sweep.warmup):
        op()
    times = []
    for _ in range(sweep.repetitions):
        dist.barrier()
        burst()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        op()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def _make_op(kind: str, nbytes: int, mesh: Any, axis: int, device: torch.device) -> tuple[int, Callable[[], None]]:
    """A call that runs ``kind`` of about ``nbytes`` on mesh axis ``axis`` as the generated
    program would, and its exact payload in the convention of ``collective_time_s``."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from autoplan.cost_models.cluster import COMM_KINDS
    from autoplan.runtime import collectives as runtime

    assert kind in COMM_KINDS, kind
    n = mesh.size(axis)
    elem = 4  # float32

    def placements(p: Any) -> list[Any]:
        out: list[Any] = [Replicate()] * mesh.ndim
        out[axis] = p
        return out

    def wait(x: DTensor) -> None:
        local = x.to_local()
        if isinstance(local, funcol.AsyncCollectiveTensor):
            local.wait()

    numel = max(n, nbytes // elem // n * n)  # a multiple of n elements
    if kind == "all_reduce":  # P -> R, payload B
        x = DTensor.from_local(torch.ones(numel, device=device), mesh, placements(Partial()), run_check=False)
        return numel * elem, lambda: wait(runtime.all_reduce(x, axis))
    if kind == "reduce_scatter":  # P -> S(0), payload B_in
        x = DTensor.from_local(torch.ones(numel, device=device), mesh, placements(Partial()), run_check=False)
        return numel * elem, lambda: wait(runtime.reduce_scatter(x, axis, 0))
    if kind == "all_gather":  # S(0) -> R, payload B_out
        local = torch.ones(numel // n, device=device)
        x = DTensor.from_local(
            local, mesh, placements(Shard(0)), run_check=False, shape=torch.Size((numel,)), stride=(1,)
        )
        return numel * elem, lambda: wait(runtime.all_gather(x, axis))
    if kind == "all_to_all":  # S(0) -> S(1) of a (n*rows, cols) tensor, payload B_local
        cols = 64 * n
        rows = max(1, nbytes // (elem * cols))
        x = DTensor.from_local(
            torch.ones(rows, cols, device=device),
            mesh,
            placements(Shard(0)),
            run_check=False,
            shape=torch.Size((rows * n, cols)),
            stride=(cols, 1),
        )
        return rows * cols * elem, lambda: wait(runtime.all_to_all(x, axis, 1))
    # send_recv: every rank of the axis sends B to the next one and receives B from the previous
    group = mesh.get_group(axis)
    ranks = dist.get_process_group_ranks(group)
    i = ranks.index(dist.get_rank())
    send, recv = torch.ones(numel, device=device), torch.empty(numel, device=device)

    def p2p() -> None:
        ops = [
            dist.P2POp(dist.isend, send, ranks[(i + 1) % n], group),
            dist.P2POp(dist.irecv, recv, ranks[(i - 1) % n], group),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return numel * elem, p2p
