"""The cluster a plan targets: node/device counts, the device type and the logical device mesh.

Ranks are laid out row-major over the hierarchy, ``rank = node * devices_per_node + local``, and
the logical mesh is laid out row-major over ranks. So the last mesh axes vary fastest: they must
exactly tile the devices of one node (some trailing axes multiply to ``devices_per_node``), and
the leading axes then step across nodes. That makes every axis either purely intra-node (NVLink
numbers) or purely inter-node (network numbers), which is what ``Cluster.axis_link`` reports.

A cluster comes from the constructor, a preset string (``Cluster.preset("2x8xH100")``) or a
YAML/JSON file (``Cluster.from_file``)::

    num_nodes: 2
    devices_per_node: 8
    device: H100                  # or {name: H100, overrides: {inter_node_bw_GBps: 25}}
    mesh_shape: [2, 8]            # optional
    mesh_axis_names: [dp, tp]     # optional

A *cluster profile* written by ``autoplan calibrate`` adds measured links per mesh axis name
(they replace the catalog numbers in ``Cluster.axis_link``) and where they were measured::

    links:
      intra:
        bw_GBps: 1.9                  # joint fit over every kind below
        latency_us: 41.0
        collectives:                  # optional, per kind: the fit of that collective alone
          all_reduce: {bw_GBps: 2.1, latency_us: 38.5, fit_err: 0.04}
    calibration:
      device: CPU                     # catalog name; must equal the device above
      device_model: AMD EPYC          # what the OS/driver calls the hardware measured
      torch_version: 2.13.0
      backend: gloo
      world_size: 2
      date: '2025-01-31T12:00:00+00:00'
      num_samples: 65
      fit_err_median: 0.05            # median |fitted - measured| / measured
      comm_compute_slowdown: 0.4      # optional: compute time beside a collective / alone - 1
      origin: default                 # optional: only for the measured default (see below)

The local machine (``NxCPU``: one node of CPU ranks) is priced from such a profile, measured
once and cached (``autoplan.cost_models.calibration.local_cluster``); where none is cached the
links are a default measured on a reference machine of this class, and the record says
``origin: default`` (a profile ``autoplan calibrate`` wrote has no ``origin`` key).

Fitted numbers are in the ring convention of ``autoplan.cost_models.comm`` (see its docstring). A profile
measured with another torch version, backend or device than this machine's is rejected by
``Cluster.from_file`` unless ``check_versions=False`` (see ``check_calibration_matches``).

Every malformed description raises ``ClusterSpecError`` with a one-line message.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import platform
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from autoplan.cost_models.echo import clip
from autoplan.cost_models.errors import ClusterSpecError
from autoplan.cost_models.files import MAX_CLUSTER_FILE_BYTES, InputLimitError, parse_json, parse_yaml, read_limited
from autoplan.cost_models.hardware import DEVICE_CATALOG, DeviceSpec, _ReadOnlyMapping, get_device_spec

if TYPE_CHECKING:  # clusters are read from plan files by the review commands, without torch or yaml
    import yaml

logger = logging.getLogger(__name__)

CLUSTER_KEYS: tuple[str, ...] = (
    "num_nodes",
    "devices_per_node",
    "device",
    "mesh_shape",
    "mesh_axis_names",
    "links",
    "calibration",
)
"""Keys of a cluster description (``to_dict`` output and cluster files)."""

_REQUIRED_KEYS: tuple[str, ...] = ("num_nodes", "devices_per_node", "device")

MAX_WORLD_SIZE = 1_048_576
"""Most devices a cluster may have (2**20; the largest training clusters have ~10**5 GPUs). A
bound, so that a typo like ``1000000000xH100`` is an error instead of hours of planning and an
out-of-memory crash."""

_PRESET_RE = re.compile(r"^(?:(\d+)x)?(\d+)x([a-z][a-z0-9_.-]*)$", re.IGNORECASE)

CommKind = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"]
COMM_KINDS: tuple[CommKind, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
"""Communication kinds priced by ``autoplan.cost_models.comm`` and measured by ``autoplan calibrate``."""
StepKind = Literal["all_gather", "all_reduce", "reduce_scatter", "all_to_all", "shard", "to_partial"]
"""Kinds of the single-axis steps of a placement transition (``autoplan.cost_models.comm.plan_transition``;
plan files list them per collective)."""
COLLECTIVE_KINDS: frozenset[str] = frozenset({"all_gather", "all_reduce", "reduce_scatter", "all_to_all"})
"""Step kinds of a placement transition that communicate."""
LOCAL_KINDS: frozenset[str] = frozenset({"shard", "to_partial"})
"""Step kinds of a placement transition that are local (cost nothing on the network)."""

Backend = Literal["gloo", "nccl"]
CalibrationOrigin = Literal["measured", "default", "trace"]
"""Where a cluster's links come from: ``measured`` by ``autoplan calibrate`` on the machine
described, the ``default`` measured once on a reference machine of its class, or ``trace``: only
the device's compute numbers were fitted (``autoplan calibrate --from-profile``, see the record's
``compute``) and the links are those of the cluster the trace's plan was made for."""
_LINK_KEYS: tuple[str, ...] = ("bw_GBps", "latency_us", "collectives")
_FIT_KEYS: tuple[str, ...] = ("bw_GBps", "latency_us", "fit_err")
_RECALIBRATE = "re-run `autoplan calibrate` on the target machine"


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveFit:
    """Measured parameters of one collective kind on one link, in the ring convention of
    ``autoplan.cost_models.comm.collective_time_s`` (fitted by ``autoplan.cost_models.calibration``)."""

    bw_GBps: float
    """Fitted bandwidth, GB/s (1e9 bytes/s), in the convention of the kind's ring formula."""
    latency_us: float
    """Fitted per-step latency, microseconds (0 when the fit was clamped)."""
    fit_err: float | None = None
    """Median relative error |fitted - measured| / measured of the fit; ``None`` if unknown."""

    def __post_init__(self) -> None:
        _check_link_numbers(self.bw_GBps, self.latency_us, "collective fit")
        if self.fit_err is not None:
            object.__setattr__(self, "fit_err", _non_negative_float(self.fit_err, "fit_err"))

    def __str__(self) -> str:
        return f"{self.bw_GBps:.4g}GB/s {self.latency_us:.4g}us"


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkSpec:
    """The link collectives along one mesh axis run over."""

    bw_GBps: float
    """Per-device unidirectional bandwidth, GB/s (1e9 bytes/s)."""
    latency_us: float
    """Per-message latency of one collective step, microseconds."""
    spans_nodes: bool
    """True if the axis crosses node boundaries (network link), False for an intra-node link."""
    collectives: Mapping[str, CollectiveFit] = field(default_factory=dict)
    """Calibrated parameters per communication kind (keys from ``COMM_KINDS``); a kind present
    here is priced with its own numbers instead of ``bw_GBps``/``latency_us``."""

    def __post_init__(self) -> None:
        _check_link_numbers(self.bw_GBps, self.latency_us, "link")
        if not isinstance(self.collectives, Mapping):
            raise ClusterSpecError(f"link collectives must map a kind to a CollectiveFit, got {clip(self.collectives)}")
        for kind, fit in self.collectives.items():
            if kind not in COMM_KINDS:
                raise ClusterSpecError(f"unknown collective kind {clip(kind)}; known kinds: {', '.join(COMM_KINDS)}")
            if not isinstance(fit, CollectiveFit):
                raise ClusterSpecError(f"collective {clip(kind)} must be a CollectiveFit, got {clip(fit)}")
        ordered = {kind: self.collectives[kind] for kind in COMM_KINDS if kind in self.collectives}
        object.__setattr__(self, "collectives", _ReadOnlyMapping(ordered))

    def params(self, kind: str) -> CollectiveFit:
        """The (bandwidth, latency) to price ``kind`` with: its calibrated fit if the link has one,
        else the link's generic numbers."""
        fit = self.collectives.get(kind)
        return fit if fit is not None else CollectiveFit(bw_GBps=self.bw_GBps, latency_us=self.latency_us)

    @property
    def is_calibrated(self) -> bool:
        """True if at least one collective kind carries measured parameters."""
        return bool(self.collectives)

    def __str__(self) -> str:
        kind = "inter-node" if self.spans_nodes else "intra-node"
        fitted = f" (+{len(self.collectives)} fitted kinds)" if self.collectives else ""
        return f"{kind} {self.bw_GBps:g}GB/s {self.latency_us:g}us{fitted}"


@dataclass(frozen=True, kw_only=True, slots=True)
class CalibrationInfo:
    """Where and how a cluster profile's links were measured (the ``calibration:`` section)."""

    device: str
    """Catalog name of the device calibrated (must equal the cluster's ``device.name``)."""
    device_model: str
    """The hardware the sweep ran on, as the OS or driver names it (``current_device_model``)."""
    torch_version: str
    """``torch.__version__`` of the calibration run."""
    backend: Backend
    """Process-group backend the collectives ran on."""
    world_size: int
    """Number of ranks of the calibration run (equals the cluster's world size)."""
    date: str
    """ISO-8601 timestamp of the run (UTC)."""
    num_samples: int
    """Number of (kind, size) timings the fits were made from."""
    fit_err_median: float
    """Median relative error |fitted - measured| / measured over all samples."""
    comm_compute_slowdown: float | None = None
    """How much slower compute runs while a collective runs beside it on the same ranks:
    ``t(matmuls during an all-reduce) / t(matmuls alone) - 1`` (``autoplan calibrate``, see
    ``autoplan.runtime.collective_bench.measure_comm_compute_slowdown``); ``None`` if not measured."""
    origin: CalibrationOrigin = "measured"
    """``measured``: ``autoplan calibrate`` timed these ranks. ``default``: no calibration of this
    machine was at hand and the links are the default of ``autoplan.cost_models.calibration``, measured on
    the reference machine ``device_model`` on ``date``."""
    compute: Mapping[str, Any] | None = None
    """The fit of the device's compute numbers to a profiler trace of a planned step
    (``autoplan calibrate --from-profile``, ``autoplan.cost_models.trace_calibration``): the plan's
    fingerprint, the steps and ops fitted, the device fields set and the fit's errors; ``None``
    when the compute numbers were not fitted."""

    def __post_init__(self) -> None:
        for name in ("device", "device_model", "torch_version", "date"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ClusterSpecError(f"calibration.{name} must be a non-empty string, got {clip(value)}")
            object.__setattr__(self, name, str(value))  # plain str: torch.__version__ is a subclass
        if self.backend not in ("gloo", "nccl"):
            raise ClusterSpecError(f"calibration.backend must be 'gloo' or 'nccl', got {clip(self.backend)}")
        _check_positive_int(self.world_size, "calibration.world_size")
        _check_positive_int(self.num_samples, "calibration.num_samples")
        object.__setattr__(
            self, "fit_err_median", _non_negative_float(self.fit_err_median, "calibration.fit_err_median")
        )
        if self.comm_compute_slowdown is not None:
            object.__setattr__(
                self,
                "comm_compute_slowdown",
                _non_negative_float(self.comm_compute_slowdown, "calibration.comm_compute_slowdown"),
            )
        if self.origin not in ("measured", "default", "trace"):
            raise ClusterSpecError(
                f"calibration.origin must be 'measured', 'default' or 'trace', got {clip(self.origin)}"
            )
        if self.compute is not None:
            if not isinstance(self.compute, Mapping) or not all(
                isinstance(k, str) and (v is None or isinstance(v, (str, int, float))) for k, v in self.compute.items()
            ):
                raise ClusterSpecError(
                    f"calibration.compute must map names to numbers or strings, got {clip(self.compute)}; {_RECALIBRATE}"
                )
            object.__setattr__(self, "compute", _ReadOnlyMapping(dict(self.compute)))

    def to_dict(self) -> dict[str, Any]:
        """YAML/JSON-serialisable form; ``CalibrationInfo.from_dict`` reads it back. The optional
        keys appear only when set (``origin`` only for the default), so older profiles read the same."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _OPTIONAL_CALIBRATION}
        if self.comm_compute_slowdown is not None:
            out["comm_compute_slowdown"] = self.comm_compute_slowdown
        if self.origin != "measured":
            out["origin"] = self.origin
        if self.compute is not None:
            out["compute"] = dict(self.compute)
        return out

    @classmethod
    def from_dict(cls, data: object) -> CalibrationInfo:
        """Parse the ``calibration:`` section of a cluster profile."""
        names = [f.name for f in dataclasses.fields(cls)]
        required = [name for name in names if name not in _OPTIONAL_CALIBRATION]
        if not isinstance(data, Mapping):
            raise ClusterSpecError(f"calibration must be a mapping with keys {', '.join(names)}, got {clip(data)}")
        unknown = [key for key in data if key not in names]
        missing = [key for key in required if key not in data]
        if unknown or missing:
            what = f"unknown key {clip(unknown[0])}" if unknown else f"missing key {', '.join(missing)}"
            raise ClusterSpecError(f"calibration: {what}; expected keys {', '.join(names)}; {_RECALIBRATE}")
        kwargs: dict[str, Any] = {key: data[key] for key in names if key in data}
        kwargs["date"] = str(kwargs["date"])  # YAML reads an unquoted ISO date as a datetime
        return cls(**kwargs)


_OPTIONAL_CALIBRATION: frozenset[str] = frozenset({"comm_compute_slowdown", "origin", "compute"})
"""Keys of the ``calibration:`` section that older profiles do not have."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """A homogeneous cluster of ``num_nodes`` nodes with ``devices_per_node`` devices each."""

    num_nodes: int
    """Number of nodes (machines)."""
    devices_per_node: int
    """Devices (ranks) per node."""
    device: DeviceSpec  # a catalog name is accepted too and normalised in __post_init__
    """Device type; the constructor also accepts a catalog name such as ``"H100"``."""
    mesh_shape: tuple[int, ...] | None = None
    """Logical device mesh, row-major over ranks. ``None`` picks the default: ``(nodes, devices)``
    named ``("inter", "intra")``, or a 1-D ``(world,)`` mesh when one of the two counts is 1."""
    mesh_axis_names: tuple[str, ...] | None = None
    """One unique name per mesh axis. ``None`` derives them from the hierarchy: "intra" for an
    axis inside a node, "inter" for one across nodes ("intra0", "intra1", ... if several)."""
    links: Mapping[str, LinkSpec] = field(default_factory=dict)
    """Measured links by mesh axis name (from ``autoplan calibrate``); an axis without an entry
    uses the device's catalog numbers. ``spans_nodes`` of each link must match its axis."""
    calibration: CalibrationInfo | None = None
    """Where the ``links`` were measured; ``None`` for catalog-only clusters."""

    def __post_init__(self) -> None:
        fix = ": a cluster has at least 1 node of at least 1 device, e.g. '1x8xH100' or '4xCPU'"
        _check_positive_int(self.num_nodes, "num_nodes", fix)
        _check_positive_int(self.devices_per_node, "devices_per_node", fix)
        if self.num_nodes * self.devices_per_node > MAX_WORLD_SIZE:
            raise ClusterSpecError(
                f"{clip(self.num_nodes)} nodes x {clip(self.devices_per_node)} devices is more than the "
                f"{MAX_WORLD_SIZE:,} devices autoplan plans for: check the counts"
            )
        if isinstance(self.device, str):
            object.__setattr__(self, "device", get_device_spec(self.device))
        elif not isinstance(self.device, DeviceSpec):
            raise ClusterSpecError(
                f"device must be a DeviceSpec or a catalog name like 'H100', got {clip(self.device)}"
            )
        if self.mesh_shape is None:
            shape = self._default_mesh_shape()
        else:
            shape = self._checked_mesh_shape(self.mesh_shape)
        object.__setattr__(self, "mesh_shape", shape)
        if self.mesh_axis_names is None:
            names = self._derived_axis_names()
        else:
            names = self._checked_axis_names(self.mesh_axis_names)
        object.__setattr__(self, "mesh_axis_names", names)
        object.__setattr__(self, "links", self._checked_links(self.links))
        self._check_calibration()

    # --- Validation --------------------------------------------------------------------------

    def _default_mesh_shape(self) -> tuple[int, ...]:
        if self.num_nodes > 1 and self.devices_per_node > 1:
            return (self.num_nodes, self.devices_per_node)
        return (self.world_size,)

    def _checked_mesh_shape(self, mesh_shape: object) -> tuple[int, ...]:
        if isinstance(mesh_shape, (str, bytes)) or not isinstance(mesh_shape, Sequence):
            raise ClusterSpecError(
                f"mesh_shape must be a list of positive integers like [2, 8], got {clip(mesh_shape)}"
            )
        shape = tuple(mesh_shape)
        if not shape or not all(isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in shape):
            raise ClusterSpecError(
                f"mesh_shape must be a non-empty list of positive integers like [2, 8], got {clip(mesh_shape)}"
            )
        hierarchy = f"{self.num_nodes} nodes x {self.devices_per_node} devices"
        if len(shape) > 64 or max(shape) > MAX_WORLD_SIZE:  # no product of huge numbers to compute
            raise ClusterSpecError(
                f"mesh_shape {clip(shape)} does not fit the {self.world_size} devices of the cluster ({hierarchy}); "
                f"use a shape whose product is {self.world_size}"
            )
        if math.prod(shape) != self.world_size:
            raise ClusterSpecError(
                f"mesh_shape {shape} has {math.prod(shape)} devices but the cluster ({hierarchy}) "
                f"has {self.world_size}; use a shape whose product is {self.world_size}"
            )
        if self.num_nodes > 1:
            trailing = [math.prod(shape[i:]) for i in range(len(shape), -1, -1)]
            if self.devices_per_node not in trailing:
                raise ClusterSpecError(
                    f"mesh_shape {shape} splits a node of {hierarchy}: ranks are row-major "
                    f"(rank = node * {self.devices_per_node} + local), so some trailing axes must "
                    f"multiply to exactly devices_per_node={self.devices_per_node} (trailing "
                    f"products here: {', '.join(map(str, trailing[1:]))}); use e.g. "
                    f"{(self.num_nodes, self.devices_per_node)}"
                )
        return shape

    def _checked_axis_names(self, names: object) -> tuple[str, ...]:
        if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
            raise ClusterSpecError(f"mesh_axis_names must be a list of strings like ['dp', 'tp'], got {clip(names)}")
        checked = tuple(names)
        if not all(isinstance(name, str) and name for name in checked):
            raise ClusterSpecError(f"mesh_axis_names must be non-empty strings, got {clip(list(checked))}")
        if len(checked) != len(self.mesh_shape):
            raise ClusterSpecError(
                f"mesh_axis_names {clip(list(checked))} has {len(checked)} names but mesh_shape "
                f"{self.mesh_shape} has {len(self.mesh_shape)} axes; give one name per axis"
            )
        if len(set(checked)) != len(checked):
            raise ClusterSpecError(f"mesh_axis_names {clip(list(checked))} repeats a name; axis names must be unique")
        return checked

    def _checked_links(self, links: object) -> Mapping[str, LinkSpec]:
        if not isinstance(links, Mapping):
            raise ClusterSpecError(f"links must map mesh axis names to LinkSpec, got {clip(links)}")
        for name, link in links.items():
            if name not in self.mesh_axis_names:
                raise ClusterSpecError(
                    f"links has an entry for axis {clip(name)} but the mesh axes are "
                    f"{', '.join(self.mesh_axis_names)}; rename it or {_RECALIBRATE} with this mesh"
                )
            if not isinstance(link, LinkSpec):
                raise ClusterSpecError(f"links[{clip(name)}] must be a LinkSpec, got {clip(link)}")
            if link.spans_nodes != self.axis_spans_nodes(name):
                where = "crosses nodes" if self.axis_spans_nodes(name) else "stays inside a node"
                raise ClusterSpecError(
                    f"links[{clip(name)}] has spans_nodes={link.spans_nodes} but axis {clip(name)} {where}; "
                    "set spans_nodes from Cluster.axis_spans_nodes"
                )
        return _ReadOnlyMapping({name: links[name] for name in self.mesh_axis_names if name in links})

    def _check_calibration(self) -> None:
        info = self.calibration
        if info is None:
            return
        if not isinstance(info, CalibrationInfo):
            raise ClusterSpecError(f"calibration must be a CalibrationInfo, got {clip(info)}")
        if info.device != self.device.name:
            raise ClusterSpecError(
                f"links were calibrated on device {clip(info.device)} but the cluster's device is "
                f"{clip(self.device.name)}; {_RECALIBRATE}"
            )
        if info.world_size < self.world_size:  # fewer: a group of the calibrated ranks (tensor-parallel group, stage)
            raise ClusterSpecError(
                f"links were calibrated on {info.world_size} ranks but the cluster has {self.world_size} "
                f"devices; {_RECALIBRATE} with --cluster of {self.world_size} devices"
            )
        if info.backend != self.backend:
            raise ClusterSpecError(
                f"links were calibrated with backend {clip(info.backend)} but {self.device.name} runs "
                f"{clip(self.backend)}; {_RECALIBRATE}"
            )

    def _derived_axis_names(self) -> tuple[str, ...]:
        kinds = ["inter" if self._axis_crosses_nodes(i) else "intra" for i in range(self.mesh_ndim)]
        seen = {"inter": 0, "intra": 0}
        names = []
        for kind in kinds:
            names.append(kind if kinds.count(kind) == 1 else f"{kind}{seen[kind]}")
            seen[kind] += 1
        return tuple(names)

    def _axis_crosses_nodes(self, axis: int) -> bool:
        # Axis stride in ranks; with a validated mesh it is either a multiple of devices_per_node
        # (the axis steps across nodes) or smaller than it (the axis stays inside a node).
        stride = math.prod(self.mesh_shape[axis + 1 :])
        return self.num_nodes > 1 and stride >= self.devices_per_node

    # --- Queries -----------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Total number of devices (ranks)."""
        return self.num_nodes * self.devices_per_node

    @property
    def mesh_ndim(self) -> int:
        """Number of mesh axes."""
        return len(self.mesh_shape)

    def axis_index(self, axis: int | str) -> int:
        """Non-negative index of a mesh axis given by index (negative allowed) or by name."""
        if isinstance(axis, str):
            if axis not in self.mesh_axis_names:
                raise ClusterSpecError(f"no mesh axis named {clip(axis)}; axes are {', '.join(self.mesh_axis_names)}")
            return self.mesh_axis_names.index(axis)
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise ClusterSpecError(f"mesh axis must be an int or an axis name, got {clip(axis)}")
        if not -self.mesh_ndim <= axis < self.mesh_ndim:
            raise ClusterSpecError(
                f"mesh axis {axis} is out of range for the {self.mesh_ndim}-D mesh {self.mesh_shape}"
            )
        return axis % self.mesh_ndim

    def axis_spans_nodes(self, axis: int | str) -> bool:
        """True if moving along mesh axis ``axis`` crosses node boundaries.

        A size-1 axis is classified by its position in the mesh (it never communicates).
        """
        return self._axis_crosses_nodes(self.axis_index(axis))

    @property
    def backend(self) -> Backend:
        """Process-group backend the generated program runs on: gloo for CPU ranks, else NCCL."""
        return "gloo" if self.device.name == "CPU" else "nccl"

    def axis_link(self, axis: int | str) -> LinkSpec:
        """The link collectives along ``axis`` use: the calibrated link of that axis if the
        cluster has one (see ``links``), else the device's catalog numbers (network if the axis
        spans nodes, intra-node/NVLink otherwise)."""
        name = self.mesh_axis_names[self.axis_index(axis)]
        if name in self.links:
            return self.links[name]
        return self.catalog_link(spans_nodes=self.axis_spans_nodes(axis))

    @property
    def links_source(self) -> str:
        """Where the links' numbers come from, as review output names it: ``catalog numbers``,
        ``calibrated`` (``autoplan calibrate`` on this machine) or ``measured default (...)``."""
        if self.calibration is None:
            return "catalog numbers"
        if self.calibration.origin == "default":
            return f"measured default ({self.calibration.device_model}, {self.calibration.date}; this machine not calibrated)"
        return "calibrated"

    def catalog_link(self, *, spans_nodes: bool) -> LinkSpec:
        """The device's catalog numbers for a network (``spans_nodes``) or intra-node link, at the
        bandwidth NCCL reaches on it (``NCCL_BUS_EFFICIENCY``)."""
        return _catalog_link(self.device, spans_nodes)

    def group(
        self,
        *,
        num_nodes: int,
        devices_per_node: int,
        mesh_shape: Sequence[int] | None = None,
        mesh_axis_names: Sequence[str] | None = None,
    ) -> Cluster:
        """Some of this cluster's devices as a cluster of their own (a pipeline stage, a
        tensor-parallel group) that prices the links this one measured: each of its axes takes
        this cluster's calibrated link of the same span (across nodes, or inside one), per-kind
        fits included, else the catalog's; the calibration record is kept.

        Without the per-kind fits a stage's ILP priced a scalar all-reduce and an all-gather
        with the joint fit while the search's ILPs priced them with their own, and the two chose
        different programs for one configuration (measured, 4 gloo CPU ranks, ``cp=2 x tp=2``:
        the stage gathered the log-probabilities the search kept sharded, 10.8 MiB more at the
        peak than the plan's estimate)."""
        bare = Cluster(
            num_nodes=num_nodes, devices_per_node=devices_per_node, device=self.device,
            mesh_shape=None if mesh_shape is None else tuple(mesh_shape),
            mesh_axis_names=None if mesh_axis_names is None else tuple(mesh_axis_names),
        )  # fmt: skip
        measured = {span: self.measured_link(spans_nodes=span) for span in (False, True)}
        links = {
            name: link for name in bare.mesh_axis_names if (link := measured[bare.axis_spans_nodes(name)]) is not None
        }
        return dataclasses.replace(bare, links=links, calibration=self.calibration)

    def measured_link(self, *, spans_nodes: bool) -> LinkSpec | None:
        """The calibrated link of this cluster's first axis across nodes (``spans_nodes``) or
        inside one, whatever the axes are named (``intra``/``inter``, ``intra0``/``intra1`` of a
        calibrated 2-D mesh, a user's ``dp``/``tp``); ``None`` where no such axis was measured."""
        return next((link for link in self.links.values() if link.spans_nodes == spans_nodes), None)

    def with_mesh(self, mesh_shape: Sequence[int], mesh_axis_names: Sequence[str] | None = None) -> Cluster:
        """The same cluster with another logical mesh (names derived when not given).

        Calibrated links are kept for axes that keep their name, size and node span; the others
        fall back to catalog numbers (logged as a warning)."""
        reshaped = dataclasses.replace(
            self,
            mesh_shape=tuple(mesh_shape),
            mesh_axis_names=None if mesh_axis_names is None else tuple(mesh_axis_names),
            links={},
        )
        sizes = dict(zip(self.mesh_axis_names, self.mesh_shape, strict=True))
        new_sizes = dict(zip(reshaped.mesh_axis_names, reshaped.mesh_shape, strict=True))
        kept = {
            name: link
            for name, link in self.links.items()
            if new_sizes.get(name) == sizes[name] and reshaped.axis_spans_nodes(name) == link.spans_nodes
        }
        dropped = sorted(set(self.links) - set(kept))
        if dropped:
            logger.warning(
                "mesh %s drops the calibrated links of axes %s (their size or name changed); they use catalog "
                "numbers now: re-run `autoplan calibrate --mesh ...` for this mesh",
                reshaped.mesh_shape,
                ", ".join(dropped),
            )
        return dataclasses.replace(reshaped, links=kept) if kept else reshaped

    def __str__(self) -> str:
        names = ",".join(self.mesh_axis_names)
        return f"{self.num_nodes}x{self.devices_per_node}x{self.device.name} mesh={self.mesh_shape}[{names}]"

    # --- Serialisation -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form with the full device numbers, so custom devices round-trip.

        ``links`` and ``calibration`` appear only when the cluster has them."""
        out: dict[str, Any] = {
            "num_nodes": self.num_nodes,
            "devices_per_node": self.devices_per_node,
            "device": self.device.to_dict(),
            "mesh_shape": list(self.mesh_shape),
            "mesh_axis_names": list(self.mesh_axis_names),
        }
        if self.links:
            out["links"] = {name: _link_to_dict(link) for name, link in self.links.items()}
        if self.calibration is not None:
            out["calibration"] = self.calibration.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "cluster description") -> Cluster:
        """Build a cluster from ``to_dict`` output or a parsed cluster file.

        ``device`` is a catalog name, a mapping of every ``DeviceSpec`` field, or
        ``{name: <catalog name>, overrides: {<DeviceSpec field>: value, ...}}``. ``where`` prefixes
        every error message (``from_file`` passes the file name).
        """
        try:
            if not isinstance(data, Mapping):
                raise ClusterSpecError(
                    f"expected a mapping with keys {', '.join(_REQUIRED_KEYS)}, got {type(data).__name__}"
                )
            for key in data:
                if key not in CLUSTER_KEYS:
                    hint = (
                        "; to change device numbers write device: {name: ..., overrides: {...}}"
                        if key == "overrides"
                        else ""
                    )
                    raise ClusterSpecError(
                        f"unknown key {clip(key)}: remove or rename it; known keys: {', '.join(CLUSTER_KEYS)}{hint}"
                    )
            missing = [key for key in _REQUIRED_KEYS if key not in data]
            if missing:
                raise ClusterSpecError(f"missing key {', '.join(missing)}; a cluster needs {', '.join(_REQUIRED_KEYS)}")
            cluster = cls(
                num_nodes=data["num_nodes"],
                devices_per_node=data["devices_per_node"],
                device=_device_from_value(data["device"], origin=where),
                mesh_shape=data.get("mesh_shape"),
                mesh_axis_names=data.get("mesh_axis_names"),
            )
            calibration = data.get("calibration")
            links = data.get("links")
            if links is None and calibration is None:
                return cluster
            return dataclasses.replace(
                cluster,
                links=_links_from_value(links if links is not None else {}, cluster),
                calibration=None if calibration is None else CalibrationInfo.from_dict(calibration),
            )
        except ClusterSpecError as exc:
            raise type(exc)(f"{where}: {exc}") from None

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, check_versions: bool = True) -> Cluster:
        """Read a cluster description or profile from a .yaml/.yml or .json file (see the module
        docstring).

        A profile with a ``calibration:`` section must come from this torch version, backend and
        device (``check_calibration_matches``); ``check_versions=False`` loads it anyway."""
        path = Path(path)
        where = f"cluster file '{path}'"
        suffix = path.suffix.lower()
        if suffix not in (".yaml", ".yml", ".json"):
            raise ClusterSpecError(f"{where} has extension {clip(suffix)}; use .yaml, .yml or .json")
        try:
            text = read_limited(path, max_bytes=MAX_CLUSTER_FILE_BYTES).decode("utf-8")
        except FileNotFoundError:
            raise ClusterSpecError(f"{where} does not exist; check the path or use a preset like '2x8xH100'") from None
        except InputLimitError as exc:
            raise ClusterSpecError(f"{where} {exc}: it is not a cluster file; check the path") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ClusterSpecError(
                f"{where} cannot be read ({_one_line(exc)}); check that it is a UTF-8 text file"
            ) from exc
        try:
            if suffix == ".json":
                try:
                    data = parse_json(text)
                except json.JSONDecodeError as exc:
                    raise ClusterSpecError(
                        f"{where} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); fix the syntax"
                    ) from exc
            else:
                import yaml

                try:
                    data = parse_yaml(text)
                except yaml.YAMLError as exc:
                    raise ClusterSpecError(
                        f"{where} is not valid YAML ({_yaml_error_summary(exc)}); fix the syntax"
                    ) from exc
        except InputLimitError as exc:
            raise ClusterSpecError(f"{where} {exc}: a cluster file is a short mapping; see docs/errors.md") from None
        if data is None:
            raise ClusterSpecError(f"{where} is empty; expected a mapping with keys {', '.join(_REQUIRED_KEYS)}")
        cluster = cls.from_dict(data, where=where)
        if check_versions and cluster.calibration is not None:
            try:
                check_calibration_matches(cluster.calibration)
            except ClusterSpecError as exc:
                raise type(exc)(f"{where}: {exc}") from None
        return cluster

    @classmethod
    def preset(
        cls,
        spec: str,
        *,
        mesh_shape: Sequence[int] | None = None,
        mesh_axis_names: Sequence[str] | None = None,
    ) -> Cluster:
        """Parse "NODESxDEVICESxDEVICE" ("2x8xH100") or "DEVICESxDEVICE" ("4xCPU", one node)."""
        match = _PRESET_RE.match(spec.strip()) if isinstance(spec, str) else None
        if match is None:
            raise ClusterSpecError(
                f"cluster preset {clip(spec)} is malformed: expected NODESxDEVICESxDEVICE like "
                "'2x8xH100' or DEVICESxDEVICE like '4xCPU'"
            )
        num_nodes, devices_per_node, device = match.groups()
        if len(num_nodes or "") + len(devices_per_node) > 12:  # int() of 5,000 digits is refused anyway
            raise ClusterSpecError(
                f"cluster preset {clip(spec)} has more than the {MAX_WORLD_SIZE:,} devices autoplan plans for: "
                "check the counts"
            )
        try:
            return cls(
                num_nodes=int(num_nodes) if num_nodes is not None else 1,
                devices_per_node=int(devices_per_node),
                device=device,  # type: ignore[arg-type]  # a name, normalised by __post_init__
                mesh_shape=None if mesh_shape is None else tuple(mesh_shape),
                mesh_axis_names=None if mesh_axis_names is None else tuple(mesh_axis_names),
            )
        except ClusterSpecError as exc:
            raise type(exc)(f"cluster preset {clip(spec)}: {exc}") from None


# --- Calibration environment -------------------------------------------------------------------------


NCCL_BUS_EFFICIENCY: Mapping[str, tuple[float, float]] = {
    # catalog device -> (intra-node, network) bus bandwidth NCCL reaches / the catalog's line rate
    # A100 NVLink3: ~230 GB/s busbw of 300 (NVIDIA/nccl-tests#149, sjeaugey: 12 links x ~20 GB/s
    # effective with 128 B payloads, "limits it to ~230GB/s"); HDR 200 Gb/s: 24 GB/s of 25 per NIC
    # (NVIDIA/nccl#412, sjeaugey: "24GB/s inter-node")
    "A100-40GB": (230 / 300, 24 / 25),
    "A100-80GB": (230 / 300, 24 / 25),
    # H100/H200 NVLink4: 370 GB/s of the 450 line rate with NCCL's ~20 % protocol overhead
    # (NVIDIA/nccl-tests#212, sjeaugey; ring busbw, NVLink SHARP all-reduces reach more); NDR
    # 400 Gb/s ConnectX-7: "up to 48-49GB/s per NIC" of 50 (NVIDIA/nccl-tests#267, AddyLaddy)
    "H100": (370 / 450, 48.5 / 50),
    "H200": (370 / 450, 48.5 / 50),
    # B200 NVLink5: the same ~20 % protocol overhead assumed (nccl-tests#212; no B200 measurement
    # cited yet); its ConnectX-7 NICs as on H100
    "B200": (0.8, 48.5 / 50),
}
"""Achievable fraction of a GPU's catalog link bandwidth (nccl-tests bus bandwidth at large
sizes); devices not listed (CPU, custom) and bandwidths overridden in a cluster file are used as
they are."""


@functools.lru_cache(maxsize=64)
def _catalog_link(device: DeviceSpec, spans_nodes: bool) -> LinkSpec:
    # the efficiency scales the catalog's line rate; a bandwidth the user overrode is taken as given
    intra_eff, inter_eff = NCCL_BUS_EFFICIENCY.get(device.name, (1.0, 1.0))
    catalog = DEVICE_CATALOG.get(device.name)
    if spans_nodes:
        bw = device.inter_node_bw_GBps
        bw *= inter_eff if catalog is not None and bw == catalog.inter_node_bw_GBps else 1.0
        return LinkSpec(bw_GBps=bw, latency_us=device.inter_node_latency_us, spans_nodes=True)
    bw = device.intra_node_bw_GBps
    bw *= intra_eff if catalog is not None and bw == catalog.intra_node_bw_GBps else 1.0
    return LinkSpec(bw_GBps=bw, latency_us=device.intra_node_latency_us, spans_nodes=False)


def _public_version(version: str) -> str:
    """``"2.13.0+cu128"`` -> ``"2.13.0"``: CPU and CUDA builds of one release run the same Python."""
    return version.split("+", 1)[0]


def current_device_model(backend: Backend) -> str | None:
    """The hardware this process would calibrate with ``backend``: the CUDA device name for
    NCCL (``None`` without a GPU), the CPU model name for gloo."""
    if backend == "nccl":
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip() or platform.machine()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def check_calibration_matches(info: CalibrationInfo) -> None:
    """Raise ``ClusterSpecError`` if ``info`` was measured with another torch version or on other
    hardware than this machine's.

    The torch version compares without the local build tag (``2.13.0+cu128`` == ``2.13.0``). A GPU
    profile loaded on a machine without a GPU is accepted (planning from a login node); a GPU
    profile on another GPU model, or a CPU profile on another CPU model, is not.
    """
    if info.origin == "default":  # measured on the reference machine it names, on purpose
        return
    import torch

    here = _public_version(torch.__version__)
    if _public_version(info.torch_version) != here:
        raise ClusterSpecError(
            f"profile was calibrated with torch {info.torch_version} but this is torch {torch.__version__}; "
            f"{_RECALIBRATE}, or load it with check_versions=False"
        )
    model = current_device_model(info.backend)
    if model is not None and model != info.device_model:
        raise ClusterSpecError(
            f"profile was calibrated on {clip(info.device_model)} ({info.backend}) but this machine has {clip(model)}; "
            f"{_RECALIBRATE}, or load it with check_versions=False"
        )


def _link_to_dict(link: LinkSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"bw_GBps": link.bw_GBps, "latency_us": link.latency_us}
    if link.collectives:
        out["collectives"] = {
            kind: {"bw_GBps": fit.bw_GBps, "latency_us": fit.latency_us}
            | ({} if fit.fit_err is None else {"fit_err": fit.fit_err})
            for kind, fit in link.collectives.items()
        }
    return out


def _links_from_value(value: object, cluster: Cluster) -> dict[str, LinkSpec]:
    """Parse the ``links:`` section; ``spans_nodes`` comes from the cluster's mesh."""
    if not isinstance(value, Mapping):
        raise ClusterSpecError(
            f"links must map mesh axis names ({', '.join(cluster.mesh_axis_names)}) to "
            f"{{bw_GBps, latency_us, collectives}}, got {clip(value)}"
        )
    links = {}
    for name, entry in value.items():
        where = f"links.{name}"
        if name not in cluster.mesh_axis_names:
            raise ClusterSpecError(
                f"{where}: no mesh axis named {clip(name)}; the mesh axes are {', '.join(cluster.mesh_axis_names)}: "
                f"rename it or {_RECALIBRATE} with this mesh"
            )
        _check_section_keys(entry, _LINK_KEYS, where=where, required=("bw_GBps", "latency_us"))
        fits = entry.get("collectives", {})
        if not isinstance(fits, Mapping):
            raise ClusterSpecError(f"{where}.collectives must map a kind ({', '.join(COMM_KINDS)}) to a fit")
        collectives = {}
        for kind, fit in fits.items():
            if kind not in COMM_KINDS:
                raise ClusterSpecError(
                    f"{where}.collectives: unknown kind {clip(kind)}; known kinds: {', '.join(COMM_KINDS)}"
                )
            _check_section_keys(fit, _FIT_KEYS, where=f"{where}.collectives.{kind}", required=_FIT_KEYS[:2])
            try:
                collectives[kind] = CollectiveFit(**fit)
            except ClusterSpecError as exc:
                raise ClusterSpecError(f"{where}.collectives.{kind}: {exc}") from None
        try:
            links[name] = LinkSpec(
                bw_GBps=entry["bw_GBps"],
                latency_us=entry["latency_us"],
                spans_nodes=cluster.axis_spans_nodes(name),
                collectives=collectives,
            )
        except ClusterSpecError as exc:
            raise ClusterSpecError(f"{where}: {exc}") from None
    return links


def _check_section_keys(entry: object, keys: Sequence[str], *, where: str, required: Sequence[str]) -> None:
    if not isinstance(entry, Mapping):
        raise ClusterSpecError(f"{where} must be a mapping with keys {', '.join(keys)}, got {clip(entry)}")
    for key in entry:
        if key not in keys:
            raise ClusterSpecError(f"{where}: unknown key {clip(key)}; known keys: {', '.join(keys)}")
    missing = [key for key in required if key not in entry]
    if missing:
        raise ClusterSpecError(f"{where}: missing key {', '.join(missing)}")


def _check_link_numbers(bw_GBps: object, latency_us: object, what: str) -> None:
    if isinstance(bw_GBps, bool) or not isinstance(bw_GBps, (int, float)) or not 0 < bw_GBps < math.inf:
        raise ClusterSpecError(
            f"{what} bw_GBps must be a positive finite number of GB/s, got {clip(bw_GBps)}; fix it or {_RECALIBRATE}"
        )
    _non_negative_float(latency_us, f"{what} latency_us")


def _non_negative_float(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ClusterSpecError(
            f"{what} must be a non-negative finite number, got {clip(value)}; fix it or {_RECALIBRATE}"
        )
    return float(value)


def _device_from_value(value: object, *, origin: str) -> DeviceSpec:
    """Parse the ``device`` value of a cluster description; ``origin`` is cited for new numbers."""
    if isinstance(value, str):
        return get_device_spec(value)
    if not isinstance(value, Mapping):
        raise ClusterSpecError(
            f"device must be a catalog name like 'H100' or a mapping of DeviceSpec fields, got {clip(value)}"
        )
    if "overrides" in value:
        extra = [key for key in value if key not in ("name", "overrides")]
        if extra or not isinstance(value.get("name"), str):
            raise ClusterSpecError(
                "device with overrides must be {name: <catalog name>, overrides: {...}}, "
                f"got keys {', '.join(map(str, value))}"
            )
        base = get_device_spec(value["name"])
        return base.with_overrides(value["overrides"], where="device.overrides", origin=origin)
    if set(value) == {"name"} and isinstance(value["name"], str):
        return get_device_spec(value["name"])
    return DeviceSpec.from_dict(value, where="device", origin=origin)


def _check_positive_int(value: object, name: str, fix: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ClusterSpecError(f"{name} must be a positive integer, got {clip(value)}{fix}")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _yaml_error_summary(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is not None and problem:
        return f"line {mark.line + 1}, column {mark.column + 1}: {' '.join(problem.split())}"
    return _one_line(exc)
