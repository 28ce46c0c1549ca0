"""Calibration: fit measured collective timings to the communication model, save a cluster profile.

``autoplan calibrate`` (``autoplan/tools/calibrate.py``) times every kind of :data:`COMM_KINDS` on
every mesh axis for the message sizes of a :class:`Sweep`, through the same ``autoplan.runtime.collectives``
calls the generated program makes. This module turns those :class:`Sample` s into link numbers.

Model. Every kind ``k`` on an axis of ``n`` ranks is priced by ``autoplan.cost_models.comm`` as::

    t(B) = a_k(n) * lat + b_k(n) * B / bw          (a_k, b_k) = collective_terms(k, n, "ring")

e.g. ring all_reduce ``a = 2(n-1)``, ``b = 2(n-1)/n``; send_recv ``a = b = 1``. On gloo an
all_to_all of ``B`` runs as an all_gather of ``n*B`` (``effective_collective``), and it is fitted
in that convention, so the fit and the planner price the same thing.

Fit. With ``x1 = a_k(n)``, ``x2 = b_k(n) * B`` the model is linear in ``(lat, 1/bw)``. Sizes span
three decades, so the fit minimises *relative* residuals::

    min over lat, inv_bw   sum_i ((x1_i * lat + x2_i * inv_bw - t_i) / t_i)^2

(ordinary least squares on rows divided by ``t_i``). A negative latency is not physical: it is
clamped to 0 and ``inv_bw`` refitted alone; a non-positive ``inv_bw`` (time does not grow with
size) is an error that asks for larger messages. Each link gets one fit per kind plus a joint fit
over all kinds (its generic ``bw_GBps``/``latency_us``). Fit quality is the median relative error
``|fitted - measured| / measured``. A profile's device takes the measured numbers too (the joint fit
of its widest intra-/inter-node axis as ``intra_node_*``/``inter_node_*``), so clusters derived
from it (a pipeline stage's, a tensor-parallel group's) price the measured links.

The local machine. ``NxCPU`` (one node of CPU ranks, no links given) is this machine: it is priced
from a profile measured once and cached (:func:`local_cluster`), like the op profile database::

    <cache>/clusters/cpu<N>-v<VERSION>-<sha256(MachineKey)[:12]>.yaml     (what `autoplan calibrate` writes)
    <cache> = $AUTOPLAN_CACHE_DIR | $XDG_CACHE_HOME/autoplan | ~/.cache/autoplan

keyed by the machine (:class:`MachineKey`: host name, CPU model, core count, torch version) and
``N``. ``autoplan plan`` measures a missing one first (:data:`QUICK_SWEEP`, a few seconds). Only
what a calibration measures is read back from the cache: the link and the compute slowdown (the
device is the preset's), each checked against the ranges a measurement can give
(:data:`PLAUSIBLE_BW_GBPS`, :data:`PLAUSIBLE_LATENCY_US`, :data:`PLAUSIBLE_COMM_COMPUTE_SLOWDOWN`);
an unreadable or implausible file is ignored with a warning and measured again. A fit outside
those ranges is refused when it is made (:func:`fit_links`). The cache is an optimisation: a
cache folder that cannot be written (``$AUTOPLAN_CACHE_DIR`` a regular file) is a warning, and
the plan goes on without it. Where
none is cached and none can be measured (a library call, a process inside a job) the links are
:data:`DEFAULT_CPU_LINK`, measured once on a reference machine of this class, and the cluster's
``calibration.origin`` is ``"default"`` (a warning says so). ``AUTOPLAN_LOCAL_LINKS`` overrides:
``auto`` (default) as above; ``default``: always the measured default (deterministic, no cache
read, nothing launched); ``catalog``: the catalog's CPU numbers (the test suite's setting, so that
plans stay what the golden snapshots hold).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import math
import os
import platform
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import torch
import yaml

from autoplan.cost_models.cluster import (
    COMM_KINDS,
    Backend,
    CalibrationInfo,
    Cluster,
    CollectiveFit,
    CommKind,
    LinkSpec,
    current_device_model,
)
from autoplan.cost_models.comm import collective_terms, effective_collective, link_time_s
from autoplan.cost_models.echo import clip_message
from autoplan.cost_models.errors import ConfigError, PlanError
from autoplan.cost_models.files import atomic_write
from autoplan.cost_models.hardware import DeviceSpec
from autoplan.cost_models.profile_db import cache_subdir, default_cache_dir

logger = logging.getLogger(__name__)

KiB = 1024
MiB = 1024 * KiB


class CalibrationError(PlanError):
    """A calibration cannot run (bad sweep, cluster this machine cannot host) or its timings
    cannot be fitted."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Sweep:
    """Message sizes and repetitions of a calibration run."""

    min_bytes: int = 4 * KiB
    """Smallest message, bytes (4 KiB: latency-bound on every interconnect we model)."""
    max_bytes: int = 16 * MiB
    """Largest message, bytes (16 MiB: bandwidth-bound on NVLink, ~2/3 of peak per nccl-tests)."""
    size_factor: int = 2
    """Ratio of consecutive message sizes (2: every power of two from ``min_bytes``)."""
    kinds: tuple[CommKind, ...] = COMM_KINDS
    """Communication kinds to time."""
    warmup: int = 3
    """Untimed calls per (kind, size) before timing (first calls allocate and connect)."""
    repetitions: int = 15
    """Timed calls per (kind, size); the sample is their mean: a training step pays each
    collective's expected time, and on shared CPU cores that includes the occasional long wait
    for a rank that arrives late (measured in a GPT-2 step on 2 gloo ranks: a 1 KiB all-gather
    has a median of 0.68 ms but a mean of 1.2 ms; fitting medians priced the plans' collectives
    40% low)."""
    compute_gap_s: float | None = None
    """Busy compute every rank runs between the barrier and each timed call, seconds: a
    collective is timed as a training step meets it, right after compute. On CPU ranks this
    matters (the gloo threads wait for a core the compute threads held, and the ranks arrive
    with the skew of real work); CUDA kernels are asynchronous, so there it is 0. ``None``:
    5 ms for gloo, 0 for NCCL."""

    def __post_init__(self) -> None:
        for name in ("min_bytes", "max_bytes", "repetitions", "size_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise CalibrationError(f"sweep {name} must be a positive integer, got {value!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise CalibrationError(f"sweep warmup must be a non-negative integer, got {self.warmup!r}")
        if self.size_factor < 2:
            raise CalibrationError(f"sweep size_factor must be at least 2, got {self.size_factor!r}")
        if self.max_bytes < self.size_factor * self.min_bytes:
            raise CalibrationError(
                f"sweep max_bytes={self.max_bytes} must be at least {self.size_factor} times "
                f"min_bytes={self.min_bytes}: the fit needs two sizes or more; raise --max-bytes"
            )
        if self.compute_gap_s is not None and not 0 <= self.compute_gap_s <= 1:
            raise CalibrationError(f"sweep compute_gap_s must be in [0, 1] seconds, got {self.compute_gap_s!r}")
        unknown = [kind for kind in self.kinds if kind not in COMM_KINDS]
        if unknown or not self.kinds:
            raise CalibrationError(f"sweep kinds {list(self.kinds)!r} must be non-empty, from {', '.join(COMM_KINDS)}")

    def sizes_bytes(self) -> tuple[int, ...]:
        """``min_bytes, f*min_bytes, f*f*min_bytes, ...`` up to ``max_bytes`` (``f = size_factor``)."""
        sizes = []
        size = self.min_bytes
        while size <= self.max_bytes:
            sizes.append(size)
            size *= self.size_factor
        return tuple(sizes)


QUICK_SWEEP = Sweep(max_bytes=16 * MiB, size_factor=8, warmup=1, repetitions=6)
"""The sweep ``autoplan plan`` runs when the local machine has no cached profile: 4 KiB to 16 MiB
in steps of 8 (five sizes a kind over three and a half decades: the fit needs latency- and
bandwidth-bound points; below 16 MiB a busy 2-core machine's millisecond latency noise can hide
the bandwidth term of send/recv), 6 timed calls each: 175 calls instead of the default's 1,170."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Sample:
    """One measured point: ``kind`` of ``nbytes`` on mesh axis ``axis`` of ``num_ranks`` ranks."""

    axis: str
    """Mesh axis name."""
    kind: CommKind
    """Communication kind."""
    num_ranks: int
    """Size of the mesh axis."""
    nbytes: int
    """Payload in the convention of ``autoplan.cost_models.comm.collective_time_s`` for ``kind``."""
    time_s: float
    """Mean over repetitions of the slowest rank's time, seconds."""

    def __str__(self) -> str:
        return f"{self.kind}@{self.axis}[{self.nbytes}B]={self.time_s * 1e6:.1f}us"


def sample_time_s(repetition_times_s: Sequence[float]) -> float:
    """The time a sample records for its timed repetitions (each the slowest rank's): their mean,
    the expected cost a training step pays (see :attr:`Sweep.repetitions`), not the median, which
    drops the waits for a late rank that a step really has."""
    if not repetition_times_s:
        raise CalibrationError("a calibration sample needs at least one timed repetition")
    return statistics.fmean(repetition_times_s)


def _regressors(sample: Sample, backend: Backend) -> tuple[float, float]:
    """``(x1, x2)`` with ``time = x1 * lat_s + x2 * inv_bw_s_per_byte`` (ring convention)."""
    kind, nbytes = effective_collective(sample.kind, sample.nbytes, sample.num_ranks, backend=backend)
    latency_steps, bytes_factor = collective_terms(kind, sample.num_ranks, algorithm="ring")
    return latency_steps, bytes_factor * nbytes


def fit_samples(samples: Sequence[Sample], *, backend: Backend) -> CollectiveFit:
    """Least-squares ``(bw_GBps, latency_us)`` of ``samples`` (see the module docstring), with
    ``fit_err`` the median relative error."""
    if len({s.nbytes for s in samples}) < 2:
        raise CalibrationError(f"cannot fit {len(samples)} samples of fewer than 2 message sizes; raise --max-bytes")
    if any(not s.time_s > 0 for s in samples):
        raise CalibrationError(f"sample times must be positive, got {[str(s) for s in samples if not s.time_s > 0]}")
    rows = [(x1 / s.time_s, x2 / s.time_s) for s in samples for x1, x2 in [_regressors(s, backend)]]
    s11 = sum(a * a for a, _ in rows)
    s12 = sum(a * b for a, b in rows)
    s22 = sum(b * b for _, b in rows)
    r1 = sum(a for a, _ in rows)
    r2 = sum(b for _, b in rows)
    det = s11 * s22 - s12 * s12
    lat_s, inv_bw = 0.0, r2 / s22
    if det > 1e-12 * s11 * s22:
        lat_s = (r1 * s22 - r2 * s12) / det
        inv_bw = (s11 * r2 - s12 * r1) / det
    if lat_s < 0.0:  # not physical: clamp and refit the bandwidth alone
        lat_s, inv_bw = 0.0, r2 / s22
    if not inv_bw > 0.0:
        first = samples[0]
        raise CalibrationError(
            f"{first.kind} on axis {first.axis!r}: time does not grow with message size between "
            f"{min(s.nbytes for s in samples)} and {max(s.nbytes for s in samples)} bytes, so no bandwidth "
            "can be fitted; raise --max-bytes or calibrate on an idle machine"
        )
    fit = CollectiveFit(bw_GBps=_sig(1.0 / inv_bw / 1e9), latency_us=_sig(lat_s * 1e6))
    errors = [_rel_err(fitted_time_s(s, fit, backend=backend), s.time_s) for s in samples]
    return dataclasses.replace(fit, fit_err=_sig(statistics.median(errors)))


def fitted_time_s(sample: Sample, fit: CollectiveFit, *, backend: Backend) -> float:
    """Time ``fit`` predicts for ``sample`` (the formula ``autoplan.cost_models.comm`` prices with)."""
    link = LinkSpec(bw_GBps=fit.bw_GBps, latency_us=fit.latency_us, spans_nodes=False, collectives={})
    return link_time_s(sample.kind, sample.nbytes, sample.num_ranks, link, backend=backend, algorithm="ring")


def fit_links(cluster: Cluster, samples: Sequence[Sample]) -> dict[str, LinkSpec]:
    """One calibrated link per mesh axis that has samples: a fit per kind plus a joint fit. A
    kind whose time does not grow with size (noise hides its bandwidth) is left out with a
    warning and priced with the joint fit; a joint fit that fails is an error."""
    links = {}
    for axis in cluster.mesh_axis_names:
        on_axis = [s for s in samples if s.axis == axis]
        if not on_axis:
            continue
        kinds = [kind for kind in COMM_KINDS if any(s.kind == kind for s in on_axis)]
        joint = fit_samples(on_axis, backend=cluster.backend)
        problem = implausible_fit(joint.bw_GBps, joint.latency_us)
        if problem is not None:
            raise CalibrationError(
                f"the joint fit of axis {axis!r} is implausible ({problem}): calibrate on an idle machine"
            )
        collectives: dict[str, CollectiveFit] = {}
        for kind in kinds:
            try:
                fit = fit_samples([s for s in on_axis if s.kind == kind], backend=cluster.backend)
                problem = implausible_fit(fit.bw_GBps, fit.latency_us)
                if problem is not None:
                    raise CalibrationError(f"{kind} on axis {axis!r}: the fit is implausible ({problem})")
                collectives[kind] = fit
            except CalibrationError as exc:  # the joint fit prices this kind instead
                logger.warning("%s; %s is priced with the joint fit of axis %r", exc, kind, axis)
        links[axis] = LinkSpec(
            bw_GBps=joint.bw_GBps,
            latency_us=joint.latency_us,
            spans_nodes=cluster.axis_spans_nodes(axis),
            collectives=collectives,
        )
    unknown = sorted({s.axis for s in samples} - set(cluster.mesh_axis_names))
    if unknown:
        raise CalibrationError(f"samples name axes {', '.join(unknown)} not in the mesh {cluster.mesh_axis_names}")
    return links


def sample_errors(cluster: Cluster, samples: Sequence[Sample]) -> list[float]:
    """Relative error of each sample under its axis's fit for its kind (``cluster`` calibrated)."""
    return [
        _rel_err(fitted_time_s(s, cluster.axis_link(s.axis).params(s.kind), backend=cluster.backend), s.time_s)
        for s in samples
    ]


def build_profile(
    cluster: Cluster,
    samples: Sequence[Sample],
    *,
    device_model: str,
    torch_version: str | None = None,
    date: str | None = None,
    comm_compute_slowdown: float | None = None,
) -> Cluster:
    """``cluster`` with links fitted to ``samples``, its device's link numbers (and
    ``comm_compute_slowdown``, when measured) set to the measured ones, and a ``calibration`` record.

    ``torch_version`` defaults to this process's, ``date`` to now (UTC, ISO-8601)."""
    if not samples:
        raise CalibrationError(f"no samples to fit for {cluster}: every mesh axis has size 1")
    base = dataclasses.replace(cluster, links={}, calibration=None)
    links = fit_links(base, samples)
    date = date or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    device = measured_device(base, links, comm_compute_slowdown, origin=f"autoplan calibrate on {device_model}, {date}")
    calibrated = dataclasses.replace(base, device=device, links=links)
    info = CalibrationInfo(
        device=cluster.device.name,
        device_model=device_model,
        torch_version=torch_version or torch.__version__,
        backend=cluster.backend,
        world_size=cluster.world_size,
        date=date,
        num_samples=len(samples),
        fit_err_median=_sig(statistics.median(sample_errors(calibrated, samples))),
        comm_compute_slowdown=None if comm_compute_slowdown is None else _sig(max(0.0, comm_compute_slowdown)),
    )
    return dataclasses.replace(calibrated, calibration=info)


MAX_DEVICE_SLOWDOWN = 0.99
"""Largest ``DeviceSpec.comm_compute_slowdown`` a measurement sets (the field takes [0, 1))."""

PLAUSIBLE_BW_GBPS = (1e-3, 1e4)
"""Range of a fitted link bandwidth, GB/s, that a calibration can have measured (inclusive).
1 MB/s is far below the slowest link of a cluster autoplan plans for (the local loopback's gloo
fits 0.38-1.8 GB/s on the reference 2-core VM, even at load average 11; 10GbE is 1.25 GB/s);
10 TB/s is above the fastest (NVLink 5: 1.8 TB/s per GPU). A fit outside this range is noise
(a kind whose time barely grows with size) or a damaged cache, and would price every collective
as free or as taking days."""

PLAUSIBLE_LATENCY_US = (0.0, 1e5)
"""Range of a fitted per-step latency, microseconds (inclusive). 0 is a clamped fit
(:func:`fit_samples`); 100 ms is 12x the slowest fit seen on the reference 2-core VM under load
(7.9 ms at load average 11, :data:`DEFAULT_CPU_LINK`) and 5 orders of magnitude above NVLink. A
cached ``latency_us: 1e12`` priced a CPU plan at 23 days per step."""

PLAUSIBLE_COMM_COMPUTE_SLOWDOWN = (0.0, 10.0)
"""Range of a measured ``comm_compute_slowdown`` (inclusive): compute beside a collective from
as fast as alone (negative measurements are recorded as 0) to 11 times slower. Eight runs on the
reference VM at load 6-7 gave -16% to +99% (:data:`DEFAULT_CPU_COMM_COMPUTE_SLOWDOWN`); the
device is priced with at most :data:`MAX_DEVICE_SLOWDOWN`."""


def implausible_fit(bw_GBps: float, latency_us: float) -> str | None:
    """Why a fitted ``(bw_GBps, latency_us)`` cannot have been measured (outside
    :data:`PLAUSIBLE_BW_GBPS` or :data:`PLAUSIBLE_LATENCY_US`), or ``None`` if it can."""
    (bw_lo, bw_hi), (lat_lo, lat_hi) = PLAUSIBLE_BW_GBPS, PLAUSIBLE_LATENCY_US
    if not bw_lo <= bw_GBps <= bw_hi:
        return f"bandwidth {bw_GBps:g} GB/s is outside the plausible {bw_lo:g}..{bw_hi:g} GB/s"
    if not lat_lo <= latency_us <= lat_hi:
        return f"latency {latency_us:g} us is outside the plausible {lat_lo:g}..{lat_hi:g} us"
    return None


def implausible_link(link: LinkSpec) -> str | None:
    """Why ``link`` (its joint fit or one kind's) cannot have been measured, or ``None``."""
    fits = [("joint fit", link.bw_GBps, link.latency_us)]
    fits += [(f"{kind} fit", fit.bw_GBps, fit.latency_us) for kind, fit in link.collectives.items()]
    for what, bw_GBps, latency_us in fits:
        problem = implausible_fit(bw_GBps, latency_us)
        if problem is not None:
            return f"{what}: {problem}"
    return None


def measured_device(
    cluster: Cluster, links: dict[str, LinkSpec], comm_compute_slowdown: float | None, *, origin: str
) -> DeviceSpec:
    """``cluster.device`` with its intra-/inter-node numbers replaced by the joint fit of the
    widest measured axis of each kind, and ``comm_compute_slowdown`` when measured (capped at
    :data:`MAX_DEVICE_SLOWDOWN`). ``origin`` is cited in the device's sources."""
    overrides: dict[str, float] = {}
    for prefix, spans in (("intra_node", False), ("inter_node", True)):
        measured = [name for name in links if links[name].spans_nodes == spans]
        if measured:
            widest = max(measured, key=lambda name: cluster.mesh_shape[cluster.axis_index(name)])
            overrides[f"{prefix}_bw_GBps"] = links[widest].bw_GBps
            overrides[f"{prefix}_latency_us"] = links[widest].latency_us
    if comm_compute_slowdown is not None:
        slowdown = _sig(max(0.0, comm_compute_slowdown))
        if slowdown > MAX_DEVICE_SLOWDOWN:
            logger.warning(
                "compute ran %.0f%% slower beside a collective (a busy machine?); the device is priced with %.0f%%, "
                "the most DeviceSpec.comm_compute_slowdown takes: re-run `autoplan calibrate` on a quieter machine",
                100 * slowdown,
                100 * MAX_DEVICE_SLOWDOWN,
            )
            slowdown = MAX_DEVICE_SLOWDOWN
        overrides["comm_compute_slowdown"] = slowdown
    return cluster.device.with_overrides(overrides, origin=origin) if overrides else cluster.device


def write_profile(cluster: Cluster, path: str | os.PathLike[str]) -> Path:
    """Write ``cluster`` (a profile from :func:`build_profile`) to ``path`` atomically: YAML for
    .yaml/.yml, JSON for .json. A failed write leaves any previous file untouched."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise CalibrationError(f"profile '{path}' has extension {suffix!r}; use .yaml, .yml or .json")
    if not path.parent.is_dir():
        raise CalibrationError(f"cannot write profile '{path}': directory '{path.parent}' does not exist")
    data = cluster.to_dict()
    if suffix == ".json":
        text = json.dumps(data, indent=1) + "\n"
    else:
        header = "# Cluster profile written by `autoplan calibrate`; load it with Cluster.from_file or --cluster.\n"
        text = header + yaml.safe_dump(data, sort_keys=False)
    atomic_write(path, text, what="cluster profile", error=None)
    return path


# --- The local machine ------------------------------------------------------------------------

LocalLinks = Literal["auto", "default", "catalog"]
LOCAL_LINKS_ENV = "AUTOPLAN_LOCAL_LINKS"
"""Environment variable choosing how the local machine's links are priced (module docstring)."""

PROFILE_CACHE_VERSION = 1
"""Version in the cached profiles' names; bump when what a profile measures changes meaning."""


def local_links_mode() -> LocalLinks:
    """``$AUTOPLAN_LOCAL_LINKS`` (``auto`` when unset or empty)."""
    value = os.environ.get(LOCAL_LINKS_ENV, "").strip().lower() or "auto"
    if value not in get_args(LocalLinks):
        raise ConfigError(
            f"{LOCAL_LINKS_ENV}={value!r} is not one of {', '.join(get_args(LocalLinks))}: "
            "auto (cached calibration of this machine), default (the measured default) or catalog"
        )
    return value  # type: ignore[return-value]  # checked against LocalLinks above


@dataclass(frozen=True, kw_only=True, slots=True)
class MachineKey:
    """What the local machine's links depend on: the host, its CPUs and the torch build."""

    hostname: str
    """``platform.node()``."""
    cpu_model: str
    """The CPU model (``current_device_model("gloo")``)."""
    num_cpus: int
    """CPU cores this process may run on (``os.sched_getaffinity``, else ``os.cpu_count``)."""
    torch_version: str
    """``torch.__version__``."""

    @classmethod
    def current(cls) -> MachineKey:
        try:
            num_cpus = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            num_cpus = os.cpu_count() or 1
        return cls(
            hostname=platform.node() or "unknown host",
            cpu_model=current_device_model("gloo") or "unknown CPU",
            num_cpus=num_cpus,
            torch_version=str(torch.__version__),
        )

    def digest(self) -> str:
        """Short stable hash (12 hex characters) of the key, used in the cached profile's name."""
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def cached_profile_path(
    world_size: int, *, machine: MachineKey | None = None, cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """``<cache>/clusters/cpu<N>-v<version>-<hash>.yaml``: where this machine's profile of
    ``world_size`` gloo ranks is cached."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = machine or MachineKey.current()
    return root / "clusters" / f"cpu{world_size}-v{PROFILE_CACHE_VERSION}-{key.digest()}.yaml"


def profile_cache_dir() -> Path | None:
    """``<cache>/clusters``, created if missing, or ``None`` (with one warning naming the cache
    folder) when it cannot be: see :func:`autoplan.cost_models.profile_db.cache_subdir`."""
    return cache_subdir("clusters")


def cache_profile(profile: Cluster) -> Path | None:
    """Store ``profile`` (of the local machine's default 1-D mesh) where :func:`local_cluster`
    finds it (atomically: a failed write leaves the previous file); returns the path, or ``None``
    with a warning when it is not stored: the cache folder cannot be used
    (:func:`autoplan.cost_models.profile_db.cache_subdir`), the write fails, or the profile is one
    :func:`load_cached_profile` would refuse (:func:`cached_profile_problem`)."""
    problem = cached_profile_problem(profile, profile.world_size)
    if problem is not None:
        logger.warning("not caching the calibration of %s: %s", profile, problem)
        return None
    if profile_cache_dir() is None:  # warned there
        return None
    path = cached_profile_path(profile.world_size)
    try:
        return write_profile(profile, path)
    except OSError as exc:
        logger.warning("could not write the cached calibration '%s' (%s): it is measured again next time", path, exc)
        return None


def is_local_cpu(cluster: Cluster) -> bool:
    """True for the local machine as a preset names it: one node of at least two CPU ranks with
    no links or calibration of its own (``NxCPU``, any mesh)."""
    return (
        cluster.device.name == "CPU"
        and cluster.num_nodes == 1
        and cluster.world_size > 1
        and not cluster.links
        and cluster.calibration is None
    )


def cached_profile_problem(profile: Cluster, world_size: int) -> str | None:
    """Why ``profile`` is not a calibration of ``world_size`` local CPU ranks that could have been
    measured (its links outside :data:`PLAUSIBLE_BW_GBPS` / :data:`PLAUSIBLE_LATENCY_US`, its
    slowdown outside :data:`PLAUSIBLE_COMM_COMPUTE_SLOWDOWN`, another rank count, mesh or
    backend), or ``None``. Only what a calibration measures is checked: the rest of a cached
    profile is never read (:func:`load_cached_profile`)."""
    info = profile.calibration
    if info is None or info.origin != "measured" or info.device != "CPU" or info.backend != "gloo":
        return "it has no calibration record of measured gloo CPU ranks"
    if info.world_size != world_size or profile.world_size != world_size or profile.num_nodes != 1:
        return f"it is not a calibration of {world_size} CPU ranks on one node"
    if set(profile.links) != {"intra"}:
        return f"it has links {sorted(profile.links)}, not the one link 'intra' of a 1-D mesh"
    problem = implausible_link(profile.links["intra"])
    if problem is not None:
        return f"its link's {problem}"
    lo, hi = PLAUSIBLE_COMM_COMPUTE_SLOWDOWN
    slowdown = info.comm_compute_slowdown
    if slowdown is not None and not lo <= slowdown <= hi:
        return f"its comm_compute_slowdown {slowdown:g} is outside the plausible {lo:g}..{hi:g}"
    return None


_WARNED_CACHED_PROFILES: set[tuple[str, int, int]] = set()
"""(path, mtime, size) of the cached profiles :func:`load_cached_profile` has warned about in this
process: ``autoplan plan`` reads the cache before measuring and again when it prices the cluster."""


def load_cached_profile(world_size: int) -> Cluster | None:
    """This machine's cached profile of ``world_size`` ranks, or ``None`` if there is none or it
    cannot be used. Only what a calibration measures is taken from the file: the link and the
    compute slowdown (with the calibration record); the device is the ``NxCPU`` preset's, so a
    cache claiming another memory capacity or peak FLOP/s changes nothing. A file that cannot be
    read, or whose measurements are implausible (:func:`cached_profile_problem`), is ignored with
    a warning naming it; ``autoplan plan`` then measures again and replaces it
    (``autoplan.tools.local_links``)."""
    path = cached_profile_path(world_size)
    if not path.is_file():
        return None
    try:
        cached = Cluster.from_file(path)
        problem = cached_profile_problem(cached, world_size)
    except (PlanError, OSError) as exc:  # ClusterSpecError: unreadable, malformed, another machine
        cached, problem = None, " ".join(str(exc).split())
    if cached is None or problem is not None:
        try:
            stat = path.stat()
            seen = (str(path), stat.st_mtime_ns, stat.st_size)
        except OSError:
            seen = (str(path), 0, 0)
        if seen not in _WARNED_CACHED_PROFILES:
            _WARNED_CACHED_PROFILES.add(seen)
            logger.warning(
                "%s",
                clip_message(
                    f"ignoring the cached calibration '{path}' ({problem}): it can be deleted; "
                    f"`autoplan plan --cluster {world_size}xCPU` measures the links again and replaces it"
                ),
            )
        return None
    info = cached.calibration
    assert info is not None  # cached_profile_problem checked it
    base = Cluster.preset(f"{world_size}xCPU")
    links = {"intra": dataclasses.replace(cached.links["intra"], spans_nodes=False)}
    slowdown = None if info.comm_compute_slowdown is None else min(info.comm_compute_slowdown, MAX_DEVICE_SLOWDOWN)
    device = measured_device(base, links, slowdown, origin=f"autoplan calibrate on {info.device_model}, {info.date}")
    return dataclasses.replace(base, device=device, links=links, calibration=info)


DEFAULT_CPU_LINK = LinkSpec(bw_GBps=0.7239, latency_us=1970.0, spans_nodes=False, collectives={})
"""The local machine's link when no calibration of it is cached: measured, not assumed.

Source: the joint fit of ``autoplan calibrate --cluster 2xCPU`` (default sweep, 65 samples, median
fit error 28%) on the reference machine of this project's sessions, a 2-core AMD EPYC VM, torch
2.13.0+cpu, gloo, one thread per rank, 2026-11-24 17:22 UTC at load average 1.8 (other jobs ran
beside it: at load 8-11 the same command fitted 5.6-7.9 ms and 0.38-0.43 GB/s, so this is the
quieter end). Per-kind fits of that run (GB/s, us): all_reduce 1.249/2344, all_gather
0.5597/1703, reduce_scatter 0.5741/4238, all_to_all 0.3828/1124, send_recv 1.84/6630; noisy
enough that the default prices every kind with the joint fit. The catalog's 30 us / 2 GB/s
(``hardware.py``, an assumption) are 65x too fast in latency on these ranks."""

DEFAULT_CPU_COMM_COMPUTE_SLOWDOWN = 0.33
"""Compute slowdown beside a collective on the reference machine
(``autoplan.runtime.collective_bench.measure_comm_compute_slowdown`` on 2 gloo ranks, 100 ms
matmul loops): eight runs on 2026-11-24 17:53-17:54 UTC at load average 6-7 gave -16%, +13%, +23%,
+27%, +40%, +55%, +92% and +99%; their median, rounded. Two ranks of one compute thread and
one busy gloo thread each on 2 cores leave compute about half the cores while a collective
runs, so tens of percent is expected; the spread is the other jobs on the machine."""

DEFAULT_CPU_REFERENCE = CalibrationInfo(
    device="CPU",
    device_model="AMD EPYC",
    torch_version="2.13.0+cpu",
    backend="gloo",
    world_size=2,
    date="2026-11-24T17:22:14+00:00",
    num_samples=65,
    fit_err_median=0.2816,
    comm_compute_slowdown=DEFAULT_CPU_COMM_COMPUTE_SLOWDOWN,
    origin="default",
)
"""Where :data:`DEFAULT_CPU_LINK` was measured: the ``calibration`` record of a default cluster
(with its own world size)."""


def default_cpu_profile(world_size: int) -> Cluster:
    """The 1-D profile of ``world_size`` local CPU ranks made of the measured default
    (:data:`DEFAULT_CPU_LINK`), recorded with ``origin="default"``."""
    base = Cluster.preset(f"{world_size}xCPU")
    links = {"intra": DEFAULT_CPU_LINK}
    reference = DEFAULT_CPU_REFERENCE
    origin = f"the measured default of autoplan.cost_models.calibration ({reference.device_model}, {reference.date})"
    device = measured_device(base, links, reference.comm_compute_slowdown, origin=origin)
    info = dataclasses.replace(reference, world_size=world_size)
    return dataclasses.replace(base, device=device, links=links, calibration=info)


def on_mesh(profile: Cluster, cluster: Cluster) -> Cluster:
    """``cluster`` (local CPU ranks, any mesh) priced with the 1-D ``profile`` of its ranks: every
    mesh axis gets the profile's link (every axis runs over the same loopback), the device and
    the calibration record are the profile's."""
    (link,) = profile.links.values()
    links = {name: link for name, size in zip(cluster.mesh_axis_names, cluster.mesh_shape, strict=True) if size > 1}
    return dataclasses.replace(cluster, device=profile.device, links=links, calibration=profile.calibration)


def local_cluster(cluster: Cluster) -> Cluster:
    """``cluster`` with the local machine's measured links when it is the local machine
    (:func:`is_local_cpu`), else ``cluster`` unchanged (see the module docstring for
    ``$AUTOPLAN_LOCAL_LINKS``). Without a cached profile the measured default is used and a
    warning says so; this function never launches a measurement (``autoplan plan`` does, first)."""
    mode = local_links_mode()
    if mode == "catalog" or not is_local_cpu(cluster):
        return cluster
    profile = load_cached_profile(cluster.world_size) if mode == "auto" else None
    if profile is None:
        profile = default_cpu_profile(cluster.world_size)
        if mode == "auto":
            logger.warning(
                "%s: no calibration of this machine is cached (%s), so its links are the measured default "
                "%s (%s); run `autoplan calibrate --cluster %dxCPU` or `autoplan plan` once to measure them",
                cluster,
                cached_profile_path(cluster.world_size),
                DEFAULT_CPU_LINK,
                DEFAULT_CPU_REFERENCE.device_model,
                cluster.world_size,
            )
    return on_mesh(profile, cluster)


def _rel_err(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured


def _sig(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits, so a profile's YAML stays readable and
    loading it gives back exactly the numbers in memory."""
    if x == 0.0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - math.floor(math.log10(abs(x))))
