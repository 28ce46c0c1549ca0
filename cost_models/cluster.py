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

Every malformed description raises ``ClusterSpecError`` with a one-line message.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cost_models.errors import ClusterSpecError
from cost_models.hardware import DeviceSpec, get_device_spec

CLUSTER_KEYS: tuple[str, ...] = (
    "num_nodes",
    "devices_per_node",
    "device",
    "mesh_shape",
    "mesh_axis_names",
)
"""Keys of a cluster description (``to_dict`` output and cluster files)."""

_REQUIRED_KEYS: tuple[str, ...] = ("num_nodes", "devices_per_node", "device")

_PRESET_RE = re.compile(r"^(?:(\d+)x)?(\d+)x([a-z][a-z0-9_.-]*)$", re.IGNORECASE)


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkSpec:
    """The link collectives along one mesh axis run over."""

    bw_GBps: float
    """Per-device unidirectional bandwidth, GB/s (1e9 bytes/s)."""
    latency_us: float
    """Per-message latency of one collective step, microseconds."""
    spans_nodes: bool
    """True if the axis crosses node boundaries (network link), False for an intra-node link."""

    def __str__(self) -> str:
        kind = "inter-node" if self.spans_nodes else "intra-node"
        return f"{kind} {self.bw_GBps:g}GB/s {self.latency_us:g}us"


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

    def __post_init__(self) -> None:
        _check_positive_int(self.num_nodes, "num_nodes")
        _check_positive_int(self.devices_per_node, "devices_per_node")
        if isinstance(self.device, str):
            object.__setattr__(self, "device", get_device_spec(self.device))
        elif not isinstance(self.device, DeviceSpec):
            raise ClusterSpecError(f"device must be a DeviceSpec or a catalog name like 'H100', got {self.device!r}")
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

    # --- Validation --------------------------------------------------------------------------

    def _default_mesh_shape(self) -> tuple[int, ...]:
        if self.num_nodes > 1 and self.devices_per_node > 1:
            return (self.num_nodes, self.devices_per_node)
        return (self.world_size,)

    def _checked_mesh_shape(self, mesh_shape: object) -> tuple[int, ...]:
        if isinstance(mesh_shape, (str, bytes)) or not isinstance(mesh_shape, Sequence):
            raise ClusterSpecError(f"mesh_shape must be a list of positive integers like [2, 8], got {mesh_shape!r}")
        shape = tuple(mesh_shape)
        if not shape or not all(isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in shape):
            raise ClusterSpecError(
                f"mesh_shape must be a non-empty list of positive integers like [2, 8], got {mesh_shape!r}"
            )
        hierarchy = f"{self.num_nodes} nodes x {self.devices_per_node} devices"
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
            raise ClusterSpecError(f"mesh_axis_names must be a list of strings like ['dp', 'tp'], got {names!r}")
        checked = tuple(names)
        if not all(isinstance(name, str) and name for name in checked):
            raise ClusterSpecError(f"mesh_axis_names must be non-empty strings, got {list(checked)!r}")
        if len(checked) != len(self.mesh_shape):
            raise ClusterSpecError(
                f"mesh_axis_names {list(checked)!r} has {len(checked)} names but mesh_shape "
                f"{self.mesh_shape} has {len(self.mesh_shape)} axes; give one name per axis"
            )
        if len(set(checked)) != len(checked):
            raise ClusterSpecError(f"mesh_axis_names {list(checked)!r} repeats a name; axis names must be unique")
        return checked

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
                raise ClusterSpecError(f"no mesh axis named {axis!r}; axes are {', '.join(self.mesh_axis_names)}")
            return self.mesh_axis_names.index(axis)
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise ClusterSpecError(f"mesh axis must be an int or an axis name, got {axis!r}")
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

    def axis_link(self, axis: int | str) -> LinkSpec:
        """The link collectives along ``axis`` use: network numbers if it spans nodes, else
        the intra-node (NVLink) numbers of the device."""
        spans = self.axis_spans_nodes(axis)
        if spans:
            return LinkSpec(
                bw_GBps=self.device.inter_node_bw_GBps,
                latency_us=self.device.inter_node_latency_us,
                spans_nodes=True,
            )
        return LinkSpec(
            bw_GBps=self.device.intra_node_bw_GBps,
            latency_us=self.device.intra_node_latency_us,
            spans_nodes=False,
        )

    def with_mesh(self, mesh_shape: Sequence[int], mesh_axis_names: Sequence[str] | None = None) -> Cluster:
        """The same cluster with another logical mesh (names derived when not given)."""
        return dataclasses.replace(
            self,
            mesh_shape=tuple(mesh_shape),
            mesh_axis_names=None if mesh_axis_names is None else tuple(mesh_axis_names),
        )

    def __str__(self) -> str:
        names = ",".join(self.mesh_axis_names)
        return f"{self.num_nodes}x{self.devices_per_node}x{self.device.name} mesh={self.mesh_shape}[{names}]"

    # --- Serialisation -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form with the full device numbers, so custom devices round-trip."""
        return {
            "num_nodes": self.num_nodes,
            "devices_per_node": self.devices_per_node,
            "device": self.device.to_dict(),
            "mesh_shape": list(self.mesh_shape),
            "mesh_axis_names": list(self.mesh_axis_names),
        }

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
                    raise ClusterSpecError(f"unknown key {key!r}; known keys: {', '.join(CLUSTER_KEYS)}{hint}")
            missing = [key for key in _REQUIRED_KEYS if key not in data]
            if missing:
                raise ClusterSpecError(f"missing key {', '.join(missing)}; a cluster needs {', '.join(_REQUIRED_KEYS)}")
            return cls(
                num_nodes=data["num_nodes"],
                devices_per_node=data["devices_per_node"],
                device=_device_from_value(data["device"], origin=where),
                mesh_shape=data.get("mesh_shape"),
                mesh_axis_names=data.get("mesh_axis_names"),
            )
        except ClusterSpecError as exc:
            raise type(exc)(f"{where}: {exc}") from None

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Cluster:
        """Read a cluster description from a .yaml/.yml or .json file (see the module docstring)."""
        path = Path(path)
        where = f"cluster file '{path}'"
        suffix = path.suffix.lower()
        if suffix not in (".yaml", ".yml", ".json"):
            raise ClusterSpecError(f"{where} has extension {suffix!r}; use .yaml, .yml or .json")
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ClusterSpecError(f"{where} does not exist; check the path or use a preset like '2x8xH100'") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ClusterSpecError(
                f"{where} cannot be read ({_one_line(exc)}); check that it is a UTF-8 text file"
            ) from exc
        if suffix == ".json":
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ClusterSpecError(
                    f"{where} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); fix the syntax"
                ) from exc
        else:
            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise ClusterSpecError(
                    f"{where} is not valid YAML ({_yaml_error_summary(exc)}); fix the syntax"
                ) from exc
        if data is None:
            raise ClusterSpecError(f"{where} is empty; expected a mapping with keys {', '.join(_REQUIRED_KEYS)}")
        return cls.from_dict(data, where=where)

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
                f"cluster preset {spec!r} is malformed: expected NODESxDEVICESxDEVICE like "
                "'2x8xH100' or DEVICESxDEVICE like '4xCPU'"
            )
        num_nodes, devices_per_node, device = match.groups()
        try:
            return cls(
                num_nodes=int(num_nodes) if num_nodes is not None else 1,
                devices_per_node=int(devices_per_node),
                device=device,  # type: ignore[arg-type]  # a name, normalised by __post_init__
                mesh_shape=None if mesh_shape is None else tuple(mesh_shape),
                mesh_axis_names=None if mesh_axis_names is None else tuple(mesh_axis_names),
            )
        except ClusterSpecError as exc:
            raise type(exc)(f"cluster preset {spec!r}: {exc}") from None


def _device_from_value(value: object, *, origin: str) -> DeviceSpec:
    """Parse the ``device`` value of a cluster description; ``origin`` is cited for new numbers."""
    if isinstance(value, str):
        return get_device_spec(value)
    if not isinstance(value, Mapping):
        raise ClusterSpecError(
            f"device must be a catalog name like 'H100' or a mapping of DeviceSpec fields, got {value!r}"
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


def _check_positive_int(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ClusterSpecError(f"{name} must be a positive integer, got {value!r}")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _yaml_error_summary(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is not None and problem:
        return f"line {mark.line + 1}, column {mark.column + 1}: {' '.join(problem.split())}"
    return _one_line(exc)
