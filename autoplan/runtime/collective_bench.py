"""Timing the collectives of a cluster on its ranks (the measurement behind ``autoplan calibrate``).

Every rank joins a gloo (CPU device) or NCCL (GPU device) group, builds the cluster's
``DeviceMesh`` and, for every mesh axis, kind and message size of the ``Sweep``, times the
``autoplan.runtime.collectives`` call the generated program makes on a DTensor (so DTensor's Python
overhead is part of the fitted latency; send/recv uses ``torch.distributed.batch_isend_irecv`` on
the axis group). Each timing is the slowest rank's, after warm-up calls and a barrier, and a sample
is the mean of the repetitions (a step pays the expected time, waits for a late rank included,
not the typical one). Fitting the samples is ``autoplan.cost_models.calibration``'s job; the
command around this is ``autoplan/tools/calibrate.py``.

It also measures how much a collective slows the compute running beside it on the same ranks
(:func:`measure_comm_compute_slowdown`): on CPU ranks gloo's threads take cores from the
matmuls; on a GPU NCCL's kernels take SMs and memory bandwidth from them.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autoplan.cost_models.calibration import CalibrationError, Sample, Sweep, sample_time_s
from autoplan.cost_models.cluster import COMM_KINDS, Cluster, CommKind
from autoplan.runtime import collectives as runtime
from autoplan.runtime.teardown import destroy_process_groups

logger = logging.getLogger(__name__)


def measure_on_ranks(cluster: Cluster, sweep: Sweep, *, verbose: bool = False) -> tuple[int, list[Sample], float]:
    """On a rank started by torchrun: join the process group, time ``sweep`` on the cluster's
    mesh (:func:`measure`) and the compute slowdown beside a collective
    (:func:`measure_comm_compute_slowdown`), and tear the groups down. Returns this rank's
    number, the samples and the slowdown (the same on every rank). ``verbose``: keep DTensor's
    per-rank warnings."""
    backend = cluster.backend
    device_type = "cuda" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        torch.set_num_threads(1)
    if not verbose:
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
        slowdown = measure_comm_compute_slowdown(
            torch.device(device_type, torch.cuda.current_device() if backend == "nccl" else None)
        )
        rank = dist.get_rank()
    except BaseException:
        destroy_process_groups(failed=True)
        raise
    destroy_process_groups()  # released now, not during interpreter exit (autoplan/runtime/teardown.py)
    return rank, samples, slowdown


SLOWDOWN_MATMUL_S = 0.1
"""Length of the matmul loop the slowdown is measured on, seconds (alone): long against the
scheduler's time slices on a shared machine (on the 2-core VM at load average 6, 20 ms loops gave
single-repetition ratios from 0.20 to 8.4, 100 ms loops from 0.29 to 3.2), short enough for a
quick calibration (5 repetitions: ~1.5 s)."""

SLOWDOWN_MATMUL_SIZE = {"cpu": 256, "cuda": 4096}
"""Side of the square fp32 matmul of the loop. CPU: 256 (0.25 MiB a matrix: out of L1/L2, so the
loop meets the memory traffic the collective's copies compete for; 128 would stay in cache).
CUDA: 4096 (a matmul of ~1 ms that fills every SM, as a training step's GEMMs do; a small one
would leave SMs free for NCCL's kernels and hide the contention)."""

SLOWDOWN_ALL_REDUCE_BYTES = {"cpu": 4 * 1024 * 1024, "cuda": 64 * 1024 * 1024}
"""Message of each all-reduce run beside the loop: bandwidth-bound on the device's links (gloo
loopback from ~1 MiB, NVLink from tens of MiB), so the collective moves data the whole time
instead of waiting on latency."""


def measure_comm_compute_slowdown(device: torch.device, *, repetitions: int = 5) -> float:
    """``t(matmuls while all-reduces run) / t(matmuls alone) - 1`` on this machine (collective:
    every rank of the world group calls it); the mean over ranks of each rank's median ratio.

    A repetition times a fixed matmul loop alone, then the same loop right after issuing enough
    asynchronous all-reduces (``async_op=True``) of :data:`SLOWDOWN_ALL_REDUCE_BYTES` to outlast it
    (sized from a timed all-reduce), and waits for them after the loop. Alone and beside
    alternate, so a slow phase of the machine hits both; the median of the ratios drops the
    repetitions a neighbour's load spike hit on one side only. Matrix sizes:
    :data:`SLOWDOWN_MATMUL_SIZE`. Untested on GPUs (the project's machines have one GPU at most)."""
    side = SLOWDOWN_MATMUL_SIZE[device.type]
    a = torch.rand(side, side, device=device)
    buf = torch.zeros(SLOWDOWN_ALL_REDUCE_BYTES[device.type] // 4, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(fn: Callable[[], None]) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    def ten_matmuls() -> None:
        for _ in range(10):
            a @ a

    per_mm_s = timed(ten_matmuls) / 10
    count = torch.tensor([max(1, round(SLOWDOWN_MATMUL_S / max(per_mm_s, 1e-7)))], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)  # every rank runs the same loop
    num_mm = int(count.item())

    def loop() -> None:
        for _ in range(num_mm):
            a @ a

    dist.all_reduce(buf)  # warm-up: connect and allocate
    one_s = torch.tensor([timed(lambda: dist.all_reduce(buf))], device=device)
    dist.all_reduce(one_s, op=dist.ReduceOp.MAX)
    num_ar = max(1, math.ceil(1.5 * SLOWDOWN_MATMUL_S / max(float(one_s.item()), 1e-6)))
    bufs = [buf.clone() for _ in range(min(num_ar, 4))]  # in-flight messages in distinct buffers, memory bounded
    ratios = []
    outlasted = 0  # repetitions whose collectives were still running when the loop ended
    for _ in range(repetitions):
        dist.barrier()
        alone_s = timed(loop)
        dist.barrier()
        works = [dist.all_reduce(bufs[i % len(bufs)], async_op=True) for i in range(num_ar)]
        beside_s = timed(loop)
        outlasted += not works[-1].is_completed()
        for work in works:
            work.wait()
        ratios.append(beside_s / alone_s)
    logger.debug(
        "compute beside / alone per repetition: %s; collectives outlasted the loop in %d of %d",
        ", ".join(f"{r:.2f}" for r in ratios),
        outlasted,
        repetitions,
    )
    slowdown = torch.tensor([statistics.median(ratios) - 1.0], dtype=torch.float64, device=device)
    dist.all_reduce(slowdown)
    mean = float(slowdown.item()) / dist.get_world_size()
    logger.info("compute beside a collective: %+.1f%% (%d matmuls, %d all-reduces)", 100 * mean, num_mm, num_ar)
    return mean


def measure(mesh: Any, cluster: Cluster, sweep: Sweep) -> list[Sample]:
    """Time every (axis, kind, size) of ``sweep`` on ``mesh`` (collective: every rank calls it).

    Returns the same samples on every rank: per repetition the slowest rank's time, then the
    mean over repetitions."""
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
