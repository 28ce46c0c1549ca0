"""Profile database: measured op times on one device, stored as JSON (never pickle).

A database file holds the times measured by ``autoplan profile`` on one machine, keyed by the
strings of :func:`autoplan.runtime.op_timing.op_key` and :func:`autoplan.runtime.op_timing.optimizer_key`. A time is
only valid on the device and software it was measured with, so every file carries a
:class:`DeviceKey` header, and the default file name is a short hash of that header::

    <cache>/profiles/<kind>-v<VERSION>-<sha256(header)[:12]>.json
    <cache> = $AUTOPLAN_CACHE_DIR | $XDG_CACHE_HOME/autoplan | ~/.cache/autoplan

    {"format": "autoplan-profile-db", "version": 4,
     "device": {"kind": "cpu", "name": "AMD EPYC", "torch_version": "2.13.0", "cuda_version": null,
                "num_threads": 2},
     "time_s": {"aten.mm.default(f32[512,128], f32[128,384])": 4.1e-05, ...}}

CPU times depend on the number of intra-op threads torch uses (``torch.get_num_threads()``,
set by ``OMP_NUM_THREADS``), so the header records it: a profile taken with 16 threads is not
used by a process running with 1 (``autoplan run`` starts its CPU ranks with
``OMP_NUM_THREADS=1`` unless the variable is set).

Writes are atomic (temporary file + ``os.replace``) and deterministic (sorted keys): loading
and saving again gives the same bytes. A corrupted file is reported, never silently replaced.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from autoplan.cost_models.echo import clip
from autoplan.cost_models.errors import ProfileError
from autoplan.cost_models.files import InputLimitError, MiB, atomic_write, parse_json, read_limited

log = logging.getLogger(__name__)

FORMAT = "autoplan-profile-db"
VERSION = 4
"""Schema version of the file; bump when keys or the layout change meaning. Version 4: an op key
times the op's local computation as the lowered program runs it (traced through DTensor by
``autoplan.runtime.lowering.lower_to_local``, timed on local tensors, no DTensor dispatch);
version 3 timed it through DTensor, dispatch included; versions 3 and up take CPU op times
interleaved, in program order (``autoplan.runtime.op_timing.INTERLEAVE_KEYS``); version 2
timed each key in a tight loop with inputs spilled from the cache
(``autoplan.runtime.op_timing.COLD_FOOTPRINT_BYTES``); version 1 timed them warm. The default file name
carries the version, so a file of an older version is left where it is and a new one is
started; loading one by path fails, saying to re-run ``autoplan profile``."""
MAX_PROFILE_FILE_BYTES = 256 * MiB
"""Largest profile database read (a Llama-3-70B profile holds a few hundred keys of ~300 bytes)."""

DeviceKind = Literal["cpu", "cuda"]
DEVICE_KINDS: tuple[str, ...] = ("cpu", "cuda")

_FIX = "re-run `autoplan profile` on this machine or pass --profile-db with another file"

MAX_OP_TIME_S = 3600.0
"""Longest time one operator of one training step may take in a database (an hour: any real
measurement is far below). A larger entry (``1e300``) is a damaged or hand-edited file; priced,
it would make every plan look infeasible to the solver."""


def default_cache_dir() -> Path:
    """``$AUTOPLAN_CACHE_DIR``, else ``$XDG_CACHE_HOME/autoplan``, else ``~/.cache/autoplan``."""
    if os.environ.get("AUTOPLAN_CACHE_DIR"):
        return Path(os.environ["AUTOPLAN_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "autoplan"
    return Path.home() / ".cache" / "autoplan"


_UNUSABLE_CACHE_DIRS: set[Path] = set()
"""Cache folders :func:`cache_subdir` has warned about in this process (one warning each)."""


def cache_subdir(name: str) -> Path | None:
    """``<cache>/<name>`` (:func:`default_cache_dir`), created if missing, or ``None`` when it cannot
    be (``$AUTOPLAN_CACHE_DIR`` names a regular file, a folder without write permission, a full
    disk), after one warning per cache folder and process naming it. The caches (calibrated
    links, plans) are an optimisation: a command that cannot store one goes on without it."""
    root = default_cache_dir()
    folder = root / name
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(f"no write permission in '{folder}'")
    except OSError as exc:
        if root not in _UNUSABLE_CACHE_DIRS:
            _UNUSABLE_CACHE_DIRS.add(root)
            reason = exc.strerror if isinstance(exc.strerror, str) else str(exc)
            log.warning(
                "cannot use the cache folder %s (%s): going on without the cache (nothing is stored there); "
                "point AUTOPLAN_CACHE_DIR at a writable folder",
                clip(str(root)),
                reason,
            )
        return None
    return folder


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceKey:
    """What a measured time depends on besides the op: the device and the software stack."""

    kind: DeviceKind
    """``"cpu"`` or ``"cuda"``."""
    name: str
    """CPU model (``/proc/cpuinfo``) or GPU name (``torch.cuda.get_device_name``)."""
    torch_version: str
    """``torch.__version__``."""
    cuda_version: str | None
    """``torch.version.cuda`` for CUDA profiles, ``None`` on CPU."""
    num_threads: int | None
    """``torch.get_num_threads()`` for CPU profiles (intra-op threads), ``None`` on CUDA."""

    def __str__(self) -> str:
        plural = "" if self.num_threads == 1 else "s"
        extra = f"CUDA {self.cuda_version}" if self.kind == "cuda" else f"{self.num_threads} thread{plural}"
        return f"{self.kind} {self.name!r}, torch {self.torch_version}, {extra}"

    @classmethod
    def current(cls, kind: str) -> DeviceKey:
        """The key of this process on ``kind`` (raises ProfileError if the device is missing)."""
        if kind not in DEVICE_KINDS:
            raise ProfileError(f"device {kind!r} cannot be profiled: use one of {', '.join(DEVICE_KINDS)}")
        if kind == "cuda":
            if not torch.cuda.is_available():
                raise ProfileError(
                    f"--device cuda needs a CUDA GPU but torch {torch.__version__} sees none "
                    f"(CUDA build: {torch.version.cuda}): run on a GPU machine or use --device cpu"
                )
            return cls(
                kind="cuda",
                name=torch.cuda.get_device_name(),
                torch_version=torch.__version__,
                cuda_version=torch.version.cuda,
                num_threads=None,
            )
        return cls(
            kind="cpu",
            name=_cpu_name(),
            torch_version=torch.__version__,
            cuda_version=None,
            num_threads=torch.get_num_threads(),
        )

    @classmethod
    def cpu_ranks(cls) -> DeviceKey:
        """The key of a CPU training rank on this machine: this CPU and torch, with the intra-op
        threads a rank runs with (:func:`cpu_rank_threads`), whatever this process uses. Planning
        for CPU ranks reads this profile and ``autoplan profile`` times with these threads."""
        return dataclasses.replace(cls.current("cpu"), num_threads=cpu_rank_threads())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object, *, where: str) -> DeviceKey:
        fields = ("kind", "name", "torch_version", "cuda_version", "num_threads")
        if not isinstance(data, Mapping) or set(data) != set(fields):
            raise ProfileError(f"{where} has a malformed device header {data!r}: expected keys {', '.join(fields)}")
        key = cls(**{f: data[f] for f in fields})
        well_typed = (
            key.kind in DEVICE_KINDS
            and isinstance(key.name, str)
            and isinstance(key.torch_version, str)
            and isinstance(key.cuda_version, (str, type(None)))
            and isinstance(key.num_threads, (int, type(None)))
        )
        if not well_typed:
            raise ProfileError(
                f"{where} has a malformed device header {data!r}: delete it and re-run `autoplan profile`"
            )
        return key

    def digest(self) -> str:
        """Short stable hash of the header (12 hex chars), used in the default file name."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def file_name(self) -> str:
        return f"{self.kind}-v{VERSION}-{self.digest()}.json"


def cpu_rank_threads() -> int:
    """Intra-op threads of a CPU training rank: ``OMP_NUM_THREADS`` when it is a positive integer,
    else 1, what ``torchrun`` and ``autoplan run`` give each CPU rank when the variable is unset.
    Profiling with more (torch's default is one per core) times ops under a thread count the
    ranks never use; several such processes on one machine oversubscribe its cores and time the
    OS scheduler (measured on 2 cores, 2 processes x 2 threads: every matmul ~16 ms, 5-10x slow)."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def default_db_path(device: DeviceKey, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """``<cache>/profiles/<kind>-v<version>-<hash>.json`` for ``device``."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "profiles" / device.file_name()


def _check_time(key: object, time_s: object, *, where: str) -> float:
    if not isinstance(key, str) or not key:
        raise ProfileError(f"{where} has an entry with a non-string key {key!r}: delete the file and re-profile")
    if isinstance(time_s, bool) or not isinstance(time_s, (int, float)):
        raise ProfileError(
            f"{where} has an invalid time {str(time_s)[:40]!r} for {key[:200]!r} (expected seconds, a number): "
            "delete the file and re-profile"
        )
    huge_int = isinstance(time_s, int) and time_s.bit_length() > 53  # math.isfinite would overflow
    if huge_int or not (math.isfinite(time_s) and 0 <= time_s <= MAX_OP_TIME_S):
        shown = f"an integer of {time_s.bit_length()} bits" if isinstance(time_s, int) and huge_int else f"{time_s:g} s"
        raise ProfileError(
            f"{where} has an absurd time, {shown}, for {key[:200]!r} (expected finite seconds in "
            f"0..{MAX_OP_TIME_S:g}): delete the file and re-profile"
        )
    return float(time_s)


class ProfileDB:
    """Measured seconds per op key for one :class:`DeviceKey`, backed by one JSON file."""

    __slots__ = ("_times_s", "device", "path")

    def __init__(self, path: str | os.PathLike[str], device: DeviceKey, times_s: Mapping[str, float] | None = None):
        self.path = Path(path)
        self.device = device
        self._times_s: dict[str, float] = {}
        for key, t in (times_s or {}).items():
            self.record(key, t)

    def __repr__(self) -> str:
        return f"ProfileDB(path={str(self.path)!r}, device={self.device!r}, entries={len(self)})"

    def __len__(self) -> int:
        return len(self._times_s)

    def __contains__(self, key: object) -> bool:
        return key in self._times_s

    def __iter__(self) -> Iterator[str]:
        return iter(self._times_s)

    def lookup(self, key: str) -> float | None:
        """Measured seconds of ``key``, or ``None`` if it was never profiled here."""
        return self._times_s.get(key)

    def record(self, key: str, time_s: float) -> None:
        """Store (or overwrite) the measured seconds of ``key``."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"profile key must be a non-empty string, got {key!r}")
        if not math.isfinite(time_s) or time_s < 0:
            raise ValueError(f"profiled time of {key!r} must be finite seconds >= 0, got {time_s!r}")
        self._times_s[key] = float(time_s)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "device": self.device.to_dict(), "time_s": dict(self._times_s)}

    def save(self) -> Path:
        """Write the file atomically (temp file in the same folder + ``os.replace``)."""
        text = json.dumps(self.to_dict(), sort_keys=True, indent=1) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, text, what="profile database", error=None)
        log.info("saved %d profiled times to %s", len(self), self.path)
        return self.path

    @classmethod
    def load(cls, path: str | os.PathLike[str], expect: DeviceKey | None = None) -> ProfileDB:
        """Read ``path``; with ``expect``, refuse a file measured on another device or software."""
        path = Path(path)
        where = f"profile database {path}"
        try:
            text = read_limited(path, max_bytes=MAX_PROFILE_FILE_BYTES).decode("utf-8")
        except InputLimitError as exc:
            raise ProfileError(f"{where} {exc}: pass the file `autoplan profile` wrote (--profile-db)") from None
        except FileNotFoundError:
            raise ProfileError(
                f"{where} does not exist: create it with `autoplan profile ... --profile-db {path}` or check the path"
            ) from None
        except UnicodeDecodeError as exc:
            raise ProfileError(
                f"{where} is not a UTF-8 JSON file ({exc.reason} at byte {exc.start}): delete it to re-profile "
                "or pass --profile-db"
            ) from exc
        except OSError as exc:
            raise ProfileError(
                f"cannot read {where}: {exc.strerror}; fix its permissions or pass --profile-db with another file"
            ) from exc
        try:
            data = parse_json(text)
        except InputLimitError as exc:
            raise ProfileError(f"{where} {exc}: delete it to re-profile or pass --profile-db") from None
        except json.JSONDecodeError as exc:
            raise ProfileError(
                f"{where} is not valid JSON ({exc.msg} at line {exc.lineno}): delete it to re-profile or pass --profile-db"
            ) from exc
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = clip(data.get("format")) if isinstance(data, dict) else type(data).__name__
            raise ProfileError(
                f"{where} is not an autoplan profile database (format {found}, expected {FORMAT!r}): "
                "pass the file `autoplan profile` wrote"
            )
        if data.get("version") != VERSION:
            raise ProfileError(
                f"{where} has schema version {clip(data.get('version'))}, this autoplan reads version {VERSION}: "
                "delete it and re-run `autoplan profile`"
            )
        device = DeviceKey.from_dict(data.get("device"), where=where)
        if expect is not None and device != expect:
            fix = _FIX
            if device.num_threads != expect.num_threads and device == dataclasses.replace(
                expect, num_threads=device.num_threads
            ):
                fix = f"set OMP_NUM_THREADS={device.num_threads} to use it, or {_FIX}"
            raise ProfileError(f"{where} was measured on {device}, but this machine is {expect}: {fix}")
        times = data.get("time_s")
        if not isinstance(times, dict):
            raise ProfileError(f"{where} has no 'time_s' mapping: delete it and re-run `autoplan profile`")
        checked = {k: _check_time(k, t, where=where) for k, t in times.items()}
        db = cls(path, device)
        db._times_s = checked
        return db

    @classmethod
    def open_for_current_device(cls, device: str = "cpu", cache_dir: str | os.PathLike[str] | None = None) -> ProfileDB:
        """This machine's database for ``device`` (``"cpu"``/``"cuda"``): loaded if it exists, else empty."""
        key = DeviceKey.current(device)
        path = default_db_path(key, cache_dir)
        if path.exists():
            return cls.load(path, expect=key)
        return cls(path, key)

    @classmethod
    def open_path(cls, path: str | os.PathLike[str], device: str = "cpu") -> ProfileDB:
        """The database at an explicit ``path`` (``--profile-db``), checked against this machine;
        empty if the file does not exist yet."""
        key = DeviceKey.current(device)
        if Path(path).exists():
            return cls.load(path, expect=key)
        return cls(path, key)
