"""The local machine's links, measured before planning: ``autoplan plan --cluster NxCPU`` (and
every command that plans) calls :func:`ensure_local_calibration` first, which measures the quick
sweep (``autoplan.cost_models.calibration.QUICK_SWEEP``) on ``N`` gloo ranks forked from this
process when no profile of this machine is cached, and caches it where
``autoplan.cost_models.calibration.local_cluster`` reads it. ``autoplan calibrate`` (the full
sweep, ``autoplan/tools/calibrate.py``) writes the same cache."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from autoplan.cost_models.cluster import Cluster, current_device_model
from autoplan.tools import launch

if TYPE_CHECKING:  # autoplan.cost_models.calibration imports torch: loaded when a command plans
    from autoplan.cost_models.calibration import Sample, Sweep

logger = logging.getLogger(__name__)


def ensure_local_calibration(cluster: Cluster, *, quiet: bool = False) -> None:
    """Before planning for the local machine (``NxCPU``): if no usable profile of it is cached
    and ``$AUTOPLAN_LOCAL_LINKS`` is ``auto``, measure one (the ``--quick`` sweep on ``N`` ranks
    forked from this process, :func:`_measure_forked`) and cache it. A cached file that cannot be
    read or holds implausible measurements is ignored with a warning
    (``autoplan.cost_models.calibration.load_cached_profile``) and measured again. Inside a
    torchrun job, when the cache folder cannot be written (a warning names it: the measurement
    could not be kept) or when the measurement fails, nothing is cached and the plan uses the
    measured default (with a warning)."""
    from autoplan.cost_models import calibration  # imports torch: loaded when a command plans, not at start-up

    if calibration.local_links_mode() != "auto" or not calibration.is_local_cpu(cluster):
        return
    if "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ:
        return
    if calibration.load_cached_profile(cluster.world_size) is not None or calibration.profile_cache_dir() is None:
        return
    path = calibration.cached_profile_path(cluster.world_size)
    spec = f"{cluster.world_size}xCPU"
    t0 = time.perf_counter()
    if not quiet:
        print(f"autoplan: measuring the links of {spec} once (cached in {path}) ...", file=sys.stderr, flush=True)
    base = Cluster.preset(spec)
    measured = _measure_forked(base, calibration.QUICK_SWEEP)
    if measured is None:
        return
    samples, slowdown = measured
    device_model = current_device_model("gloo") or "unknown"
    try:
        profile = calibration.build_profile(base, samples, device_model=device_model, comm_compute_slowdown=slowdown)
    except calibration.CalibrationError as exc:  # e.g. noise hid every bandwidth term: keep the default
        logger.warning("%s: the plan uses the measured default; run `autoplan calibrate --cluster %s`", exc, spec)
        return
    if calibration.cache_profile(profile) is None:  # warned there: the plan uses the measured default
        return
    if not quiet:
        print(
            f"autoplan: {spec} measured in {time.perf_counter() - t0:.1f} s: {profile.links['intra']}, compute "
            f"beside a collective {slowdown:+.0%} (catalog: {base.catalog_link(spans_nodes=False)})",
            file=sys.stderr,
        )


FORKED_TIMEOUT_S = 300.0
"""Longest wait for the forked calibration ranks (a quick sweep takes seconds; a hung rendezvous
must not hang planning)."""


def _measure_forked(cluster: Cluster, sweep: Sweep) -> tuple[list[Sample], float] | None:
    """Time ``sweep`` and the compute slowdown on ``cluster.world_size`` gloo ranks forked from
    this process; ``None`` (with a warning) if a rank fails or time runs out.

    Forked, not launched through torchrun: the children inherit the imported torch and autoplan,
    which saves each rank's start-up (~2 s of CPU per process, most of a quick calibration's
    time on a 2-core machine). Forking is safe here because this process has not started torch's
    intra-op threads or any process group yet (it has not planned)."""
    import multiprocessing

    from autoplan.runtime.collective_bench import measure_on_ranks  # torch.distributed: loaded when measuring

    try:
        ctx = multiprocessing.get_context("fork")
    except ValueError:  # no fork on this platform (Windows): measure with `autoplan calibrate` instead
        logger.warning(
            "cannot fork calibration ranks here: the plan uses the measured default; run `autoplan calibrate "
            "--cluster %dxCPU` once to measure this machine",
            cluster.world_size,
        )
        return None
    results = ctx.SimpleQueue()
    port = launch.free_port()
    ranks = [
        ctx.Process(target=_forked_rank, args=(measure_on_ranks, cluster, sweep, rank, port, results), daemon=True)
        for rank in range(cluster.world_size)
    ]
    for proc in ranks:
        proc.start()
    deadline = time.monotonic() + FORKED_TIMEOUT_S
    for proc in ranks:
        proc.join(max(0.0, deadline - time.monotonic()))
    failed = [(rank, proc.exitcode) for rank, proc in enumerate(ranks) if proc.exitcode != 0]
    for proc in ranks:
        if proc.is_alive():
            proc.terminate()
            proc.join()
    if failed or results.empty():
        logger.warning(
            "measuring %s failed (rank, exit code: %s): the plan uses the measured default; run `autoplan "
            "calibrate --cluster %dxCPU -v` to see why",
            cluster,
            failed,
            cluster.world_size,
        )
        return None
    return results.get()


def _forked_rank(measure: Any, cluster: Cluster, sweep: Sweep, rank: int, port: int, results: Any) -> None:
    """One forked calibration rank: rendezvous through the environment, measure, rank 0 reports."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(cluster.world_size),
    )
    got_rank, samples, slowdown = measure(cluster, sweep)
    if got_rank == 0:
        results.put((samples, slowdown))
