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
``|fitted - measured| / measured``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

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
)
from autoplan.cost_models.comm import collective_terms, effective_collective, link_time_s
from autoplan.cost_models.errors import PlanError
from autoplan.cost_models.files import atomic_write

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
        for name in ("min_bytes", "max_bytes", "repetitions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise CalibrationError(f"sweep {name} must be a positive integer, got {value!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise CalibrationError(f"sweep warmup must be a non-negative integer, got {self.warmup!r}")
        if self.max_bytes < 2 * self.min_bytes:
            raise CalibrationError(
                f"sweep max_bytes={self.max_bytes} must be at least twice min_bytes={self.min_bytes}: "
                "the fit needs two sizes or more; raise --max-bytes"
            )
        if self.compute_gap_s is not None and not 0 <= self.compute_gap_s <= 1:
            raise CalibrationError(f"sweep compute_gap_s must be in [0, 1] seconds, got {self.compute_gap_s!r}")
        unknown = [kind for kind in self.kinds if kind not in COMM_KINDS]
        if unknown or not self.kinds:
            raise CalibrationError(f"sweep kinds {list(self.kinds)!r} must be non-empty, from {', '.join(COMM_KINDS)}")

    def sizes_bytes(self) -> tuple[int, ...]:
        """``min_bytes, 2*min_bytes, 4*min_bytes, ...`` up to ``max_bytes``."""
        sizes = []
        size = self.min_bytes
        while size <= self.max_bytes:
            sizes.append(size)
            size *= 2
        return tuple(sizes)


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
    """One calibrated link per mesh axis that has samples: a fit per kind plus a joint fit."""
    links = {}
    for axis in cluster.mesh_axis_names:
        on_axis = [s for s in samples if s.axis == axis]
        if not on_axis:
            continue
        kinds = [kind for kind in COMM_KINDS if any(s.kind == kind for s in on_axis)]
        joint = fit_samples(on_axis, backend=cluster.backend)
        links[axis] = LinkSpec(
            bw_GBps=joint.bw_GBps,
            latency_us=joint.latency_us,
            spans_nodes=cluster.axis_spans_nodes(axis),
            collectives={
                kind: fit_samples([s for s in on_axis if s.kind == kind], backend=cluster.backend) for kind in kinds
            },
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
) -> Cluster:
    """``cluster`` with links fitted to ``samples`` and a ``calibration`` record.

    ``torch_version`` defaults to this process's, ``date`` to now (UTC, ISO-8601)."""
    if not samples:
        raise CalibrationError(f"no samples to fit for {cluster}: every mesh axis has size 1")
    base = dataclasses.replace(cluster, links={}, calibration=None)
    calibrated = dataclasses.replace(base, links=fit_links(base, samples))
    info = CalibrationInfo(
        device=cluster.device.name,
        device_model=device_model,
        torch_version=torch_version or torch.__version__,
        backend=cluster.backend,
        world_size=cluster.world_size,
        date=date or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        num_samples=len(samples),
        fit_err_median=_sig(statistics.median(sample_errors(calibrated, samples))),
    )
    return dataclasses.replace(calibrated, calibration=info)


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


def _rel_err(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured


def _sig(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits, so a profile's YAML stays readable and
    loading it gives back exactly the numbers in memory."""
    if x == 0.0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - math.floor(math.log10(abs(x))))
