"""Sharded training checkpoints that survive a killed rank and load under any plan.

Layout of a checkpoint root ``DIR`` (``autoplan run --checkpoint-dir DIR``)::

    DIR/step_4/            complete: written by every rank, then renamed by rank 0
        .metadata          torch.distributed.checkpoint (DCP) index
        __0_0.distcp ...   each rank's shards
        COMPLETE           JSON: step, optimizer, world size and mesh it was saved under, and
                           the size and CRC-32 of every file above
    DIR/step_6.tmp/        being written (or abandoned by a killed rank): never loaded

Links inside ``DIR`` are never followed: a ``step_<n>`` or ``step_<n>.tmp`` that is a symbolic
link is skipped when resuming and, when saving, the link itself is removed (never its target).

Saving is collective: every rank writes its own shards into ``step_<n>.tmp`` with ``dcp.save``;
after a barrier the ranks checksum the files (each a share of them), rank 0 writes ``COMPLETE``
and renames the directory to ``step_<n>``, so a checkpoint that some rank did not finish never
carries the final name.

A complete checkpoint whose files were damaged later (a truncated shard or index, bytes
overwritten on disk) is skipped with a warning naming it, and the run resumes from the previous
complete one (:func:`find_latest` checks the index and file sizes in one process before any rank
starts; :func:`resume` checks the CRC-32s, a share per rank, and falls back on any load failure);
with no usable checkpoint left it is a :class:`CheckpointError`. The index (``.metadata``, a
pickle) is read by :class:`_IndexUnpickler`, which resolves only the classes a DCP index is made
of: a crafted index that would run code when unpickled is refused as corrupted.

The state dict is keyed by the *original model's* parameter FQNs, not by the parallelized
module's attribute names, so it does not depend on the plan::

    model.<fqn>                 parameter (DTensor in the plan's placement; a fused grouped-query
                                QKV projection grouped by key/value head, as ``COMPLETE`` records
                                under ``param_layouts``: autoplan.passes.kv_groups)
    buffer.<fqn>                persistent buffer (a replicated DTensor; ``persistent=False`` ones
                                are not saved, as ``model.state_dict()`` leaves them out)
    optim.<fqn>.<state>         optimizer state (Adam ``step``/``exp_avg``/``exp_avg_sq``, SGD ``momentum_buffer``)
    train.step                  number of finished optimizer steps (the data position for ``Workload.batches``)
    train.rng                   CPU RNG state of rank 0 (restored on every rank)

DCP reshards DTensors on load, so a checkpoint saved under one plan (data parallel on 2 ranks)
loads under another (tensor parallel, another mesh or world size, a pipeline). A parameter tied
across pipeline stages is saved once (from its first stage) and loaded into every copy.
"""

from __future__ import annotations

import json
import logging
import pickle
import re
import shutil
import warnings
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autoplan.cost_models.errors import CheckpointError, CorruptCheckpointError
from autoplan.passes.kv_rows import KVGroupRows, layout_text, layouts_from_json, layouts_to_json, to_model
from autoplan.planner.plan import Plan
from autoplan.runtime.parallel import ParallelModel
from autoplan.runtime.pipeline import PipelineModel

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
COMPLETE_MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)$")

ParallelizedModel = ParallelModel | PipelineModel


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A complete checkpoint directory and the number of optimizer steps it holds."""

    path: Path
    step: int
    optimizer: str
    files: tuple[tuple[str, int, int], ...] = ()
    """``(name, bytes, crc32)`` of every file the save wrote (empty in a checkpoint saved before
    autoplan recorded them)."""
    param_layouts: Mapping[str, KVGroupRows] = field(default_factory=dict)
    """FQN -> the layout a parameter (and its optimizer state) is stored in where it is not the
    model's (a fused grouped-query QKV projection grouped by key/value head,
    :mod:`autoplan.passes.kv_groups`); :func:`read_full_parameters` gives the model's layout back."""

    def __str__(self) -> str:
        return f"{self.path} (step {self.step})"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step}"


def _read_marker(path: Path) -> Checkpoint:
    """The ``COMPLETE`` marker of ``path``; raises CheckpointError if absent or malformed."""
    marker = path / COMPLETE_MARKER
    try:
        data = json.loads(marker.read_text())
        if data["version"] != FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint {path} has format version {data['version']}, this autoplan reads {FORMAT_VERSION}"
            )
        files = tuple(
            (str(name), int(entry["bytes"]), int(entry["crc32"])) for name, entry in data.get("files", {}).items()
        )
        layouts = layouts_from_json(data.get("param_layouts", {}))
        return Checkpoint(
            path=path, step=int(data["step"]), optimizer=str(data["optimizer"]), files=files, param_layouts=layouts
        )
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint {path} is incomplete (no {COMPLETE_MARKER} marker)") from exc
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint {path} has an unreadable {COMPLETE_MARKER} marker: {exc}") from exc


def _complete(root: Path) -> list[Checkpoint]:
    """The complete checkpoints under ``root``, newest first. Directories without a valid
    ``COMPLETE`` marker (a save interrupted by a killed rank) are skipped with a warning."""
    if not root.is_dir():
        return []
    candidates = []
    for entry in root.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and entry.is_symlink():  # links in the root are never followed (save replaces them)
            logger.warning("%s is a symbolic link, not a checkpoint: skipping it", entry)
        elif m and entry.is_dir():
            candidates.append((int(m.group(1)), entry))
    complete = []
    for step, path in sorted(candidates, reverse=True):
        try:
            ckpt = _read_marker(path)
        except CheckpointError as exc:
            logger.warning("%s: skipping it", exc)
            continue
        if ckpt.step != step:
            logger.warning("checkpoint %s has a marker for step %d: skipping it", path, ckpt.step)
            continue
        complete.append(ckpt)
    return complete


def find_latest(root: str | Path) -> Checkpoint | None:
    """The newest complete checkpoint under ``root`` whose index reads and whose files have the
    sizes the save wrote (None if there is no complete checkpoint). One that is damaged is
    skipped with a warning naming it; if every complete one is damaged: CheckpointError (naming
    the newest, without the warnings)."""
    damaged: list[CorruptCheckpointError] = []
    for ckpt in _complete(Path(root)):
        try:
            _check_files(ckpt, _read_metadata(ckpt))
        except CorruptCheckpointError as exc:
            damaged.append(exc)
            continue
        for skipped in damaged:
            logger.warning("%s: skipping it", skipped)
        return ckpt
    if damaged:
        raise _none_usable(Path(root), damaged)
    return None


def _none_usable(root: Path, damaged: list[CorruptCheckpointError]) -> CheckpointError:
    return CheckpointError(
        f"no usable checkpoint in {root}: {damaged[0]}"
        f"{f' (and {len(damaged) - 1} older damaged one(s))' if len(damaged) > 1 else ''}: "
        "restore the files, delete the damaged step_* directories to start from scratch, or use another --checkpoint-dir"
    )


def _corrupt(ckpt: Checkpoint, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"checkpoint {ckpt.path} is corrupted ({what})")


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles a DCP index (``.metadata``) resolving only the classes one is made of (the
    ``torch.distributed.checkpoint`` metadata dataclasses, ``torch.Size``, dtypes and layouts,
    paths): any other global, such as a ``__reduce__`` naming ``os.system``, is refused before
    anything is called."""

    _ALLOWED = {
        "torch.distributed.checkpoint.metadata": frozenset(
            {
                "Metadata",
                "MetadataIndex",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            }
        ),
        "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
        "torch.serialization": frozenset({"_get_layout"}),  # a layout by name
        "torch": frozenset({"Size"}),
        "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}),
        "collections": frozenset({"OrderedDict"}),
    }

    def find_class(self, module: str, name: str) -> Any:
        allowed = name in self._ALLOWED.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"it names {module[:80]}.{name[:80]}, which no checkpoint index holds")
        return super().find_class(module, name)


def _read_index(directory: Path) -> Metadata:
    """The DCP index of ``directory``, read by :class:`_IndexUnpickler` (raises on a damaged
    or foreign file)."""
    with open(directory / ".metadata", "rb") as f:
        metadata = _IndexUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not a checkpoint index")
    return metadata


class _IndexReader(dcp.FileSystemReader):
    """DCP's file reader with the index read by :class:`_IndexUnpickler` (DCP's own unpickles it
    with the full unpickler)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = _read_index(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _read_metadata(ckpt: Checkpoint) -> Metadata:
    try:
        return _read_index(ckpt.path)
    except Exception as exc:  # noqa: BLE001 - a damaged pickle raises anything; report the directory
        raise _corrupt(ckpt, f"index .metadata: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}") from exc


def _check_files(ckpt: Checkpoint, metadata: Metadata) -> None:
    """Every file of ``ckpt`` has the size the save wrote, and every shard the index names ends
    inside its file (one ``stat`` per file: a truncated shard or index fails here)."""
    sizes: dict[str, int] = {}

    def size_of(name: str) -> int:
        if name not in sizes:
            if Path(name).name != name or name in ("", ".", ".."):
                raise _corrupt(ckpt, f"its index names a file outside the directory, {name[:80]!r}")
            try:
                sizes[name] = (ckpt.path / name).stat().st_size
            except OSError as exc:
                raise _corrupt(ckpt, f"{name} cannot be read: {exc.strerror}") from exc
        return sizes[name]

    for name, size, _crc in ckpt.files:
        if size_of(name) != size:
            raise _corrupt(ckpt, f"{name} has {size_of(name)} bytes, the save wrote {size}")
    try:
        extents = [(str(info.relative_path), int(info.offset) + int(info.length), key.fqn)
                   for key, info in dict(metadata.storage_data).items()]  # fmt: skip
    except (AttributeError, TypeError, ValueError) as exc:
        raise _corrupt(ckpt, f"index .metadata has malformed storage entries: {exc}") from exc
    for name, end, fqn in extents:
        if size_of(name) < end:
            raise _corrupt(ckpt, f"{name} has {size_of(name)} bytes, the index reads {fqn} up to byte {end}")


def _digest(path: Path) -> tuple[int, int]:
    """``(bytes, CRC-32)`` of the file at ``path``."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def _check_checksums(ckpt: Checkpoint, rank: int, world_size: int) -> None:
    """The files ``rank`` checks (every ``world_size``-th one) have the CRC-32 the save recorded."""
    for name, size, crc in ckpt.files[rank::world_size]:
        try:
            got = _digest(ckpt.path / name)
        except OSError as exc:
            raise _corrupt(ckpt, f"{name} cannot be read: {exc.strerror}") from exc
        if got != (size, crc):
            raise _corrupt(ckpt, f"{name} does not match the CRC-32 recorded when it was saved")


def _checksum_files(directory: Path) -> dict[str, dict[str, int]]:
    """Name -> ``{"bytes", "crc32"}`` of every file in ``directory`` (collective: each rank
    reads a share of the files)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    names = sorted(p.name for p in directory.iterdir() if p.is_file())
    mine = {name: _digest(directory / name) for name in names[rank::world_size]}
    gathered: list[dict[str, tuple[int, int]] | None] = [None] * world_size
    dist.all_gather_object(gathered, mine)
    merged = {name: value for part in gathered if part is not None for name, value in part.items()}
    return {name: {"bytes": size, "crc32": crc} for name, (size, crc) in sorted(merged.items())}


def _verified_index(ckpt: Checkpoint) -> Metadata:
    """``ckpt``'s index after every rank checked its files (collective; sizes, then a share of
    the CRC-32s per rank). Raises CorruptCheckpointError on every rank if any rank found damage,
    so that all of them fall back together."""
    metadata: Metadata | None = None
    problem: str | None = None
    try:
        metadata = _read_metadata(ckpt)
        _check_files(ckpt, metadata)
        _check_checksums(ckpt, dist.get_rank(), dist.get_world_size())
    except CorruptCheckpointError as exc:
        problem = str(exc)
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    found = [p for p in problems if p is not None]
    if found:
        raise CorruptCheckpointError(found[0])
    assert metadata is not None
    return metadata


def check_compatible(ckpt: Checkpoint, plan: Plan, param_shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Cheap check, before any rank starts, that ``ckpt`` is readable and holds every
    parameter of ``plan``'s model, with the shapes ``param_shapes`` (FQN -> shape), state for
    its optimizer, and the fused QKV projections in the layout the plan's program keeps them in."""
    if ckpt.optimizer != plan.optimizer:
        raise CheckpointError(
            f"checkpoint {ckpt.path} holds {ckpt.optimizer} state but the plan trains with {plan.optimizer}: "
            f"re-plan with --optimizer {ckpt.optimizer} or use another --checkpoint-dir"
        )
    entries = _read_metadata(ckpt).state_dict_metadata
    missing = [n for n in plan.param_names if f"model.{n}" not in entries]
    if missing:
        raise CheckpointError(
            f"checkpoint {ckpt.path} has no parameter {', '.join(missing[:3])}"
            f"{f' (+{len(missing) - 3} more)' if len(missing) > 3 else ''}: it was saved for another model"
        )
    for fqn, shape in param_shapes.items():
        _check_shape(ckpt, f"model.{fqn}", entries.get(f"model.{fqn}"), tuple(shape))
    _check_layouts(ckpt, plan.param_layouts, plan.param_names)  # the blocks the plan was traced with


def _check_shape(ckpt: Checkpoint, key: str, meta: object, shape: tuple[int, ...]) -> None:
    if isinstance(meta, TensorStorageMetadata) and tuple(meta.size) != shape:
        raise CheckpointError(
            f"checkpoint {ckpt.path}: {key} has shape {tuple(meta.size)}, the model has {shape}: "
            "it was saved for another model"
        )


# --- state dict ------------------------------------------------------------------------------------


def _materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazily built state (one step with zero gradients and lr 0, which
    leaves the parameters unchanged) so that DCP can load into it in place."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        if p.requires_grad:  # a frozen parameter gets no state (as in training), even if listed
            p.grad = torch.zeros_like(p)
    lrs = [group["lr"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)


def _owned_buffers(model: ParallelizedModel) -> dict[str, DTensor]:
    """FQN -> the persistent buffers the model's programs read (``owned_buffers``; a model
    without that method checkpoints none)."""
    owned = getattr(model, "owned_buffers", None)
    return dict(owned()) if callable(owned) else {}


def _state_dict(
    params: Mapping[str, torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    rng: torch.Tensor,
    step: int,
    buffers: Mapping[str, torch.Tensor],
) -> dict[str, Any]:
    """The flat, plan-independent state dict (see the module docstring); its tensors share
    storage with the parameters, buffers and optimizer state, so ``dcp.load`` restores them in place."""
    sd: dict[str, Any] = {}
    for fqn, p in params.items():
        sd[f"model.{fqn}"] = p.detach()
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                sd[f"optim.{fqn}.{key}"] = value
    for fqn, b in buffers.items():
        sd[f"buffer.{fqn}"] = b
    sd["train.step"] = torch.tensor(step, dtype=torch.int64)
    sd["train.rng"] = rng
    return sd


def _plain_layout(sd: dict[str, Any]) -> dict[str, DTensor]:
    """Replace every entry of ``sd`` sharded segment by segment (``S(d)/k``, DTensor's
    ``_StridedShard``: a fused projection split by heads) by a copy sharded plainly on the same
    dim, and return the originals by key. DCP records a rank's local shard as one contiguous chunk
    of the global tensor, which a strided shard is not ("overlapping chunks"); the plain layout
    also keeps the checkpoint independent of how a plan splits a fused weight."""
    originals: dict[str, DTensor] = {}
    for key, value in sd.items():
        if isinstance(value, DTensor) and any(isinstance(p, _StridedShard) for p in value.placements):
            plain = [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in value.placements]
            originals[key] = value
            sd[key] = value.redistribute(value.device_mesh, plain)
    return originals


def _rank0_rng_state() -> torch.Tensor:
    box = [torch.get_rng_state()]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# --- save / load -----------------------------------------------------------------------------------


def save(
    root: str | Path, step: int, model: ParallelizedModel, optimizer: torch.optim.Optimizer, *, plan: Plan
) -> Path:
    """Write ``root/step_<step>`` (collective: call on every rank). Returns its path."""
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        _remove_entry(tmp)  # left by a rank killed during an earlier save (or a planted link)
    dist.barrier()
    sd = _state_dict(model.owned_parameters(), optimizer, _rank0_rng_state(), step, _owned_buffers(model))
    _plain_layout(sd)
    dcp.save(sd, checkpoint_id=str(tmp))
    dist.barrier()
    files = _checksum_files(tmp)
    if rank == 0:
        marker = {
            "version": FORMAT_VERSION,
            "step": step,
            "optimizer": plan.optimizer,
            "world_size": plan.world_size,
            "mesh_shape": list(plan.cluster.mesh_shape),
            "plan_fingerprint": plan.fingerprint,
            "param_layouts": layouts_to_json(model.param_layouts),
            "files": files,
        }
        (tmp / COMPLETE_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        _remove_entry(final)
        tmp.rename(final)
    dist.barrier()
    return final


def _remove_entry(path: Path) -> None:
    """Remove ``path`` from the checkpoint root without following it: a symlink (or a file) is
    unlinked itself, never its target; a real directory is removed with its contents."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def resume(
    root: str | Path, model: ParallelizedModel, optimizer: torch.optim.Optimizer
) -> tuple[Checkpoint, int] | None:
    """Load the newest complete checkpoint under ``root`` that loads (collective): a damaged one
    is skipped with a warning naming it and the previous complete one is tried. Returns it and
    its number of finished steps; None if ``root`` holds no complete checkpoint; CheckpointError
    if every complete one is damaged."""
    box = [_complete(Path(root)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)  # every rank tries the same ones, in the same order
    complete = box[0]
    assert complete is not None
    damaged: list[CorruptCheckpointError] = []
    for ckpt in complete:
        try:
            step = load(ckpt, model, optimizer)
        except CorruptCheckpointError as exc:
            damaged.append(exc)
            continue
        for skipped in damaged if dist.get_rank() == 0 else []:
            logger.warning("%s: skipping it", skipped)
        return ckpt, step
    if damaged:
        raise _none_usable(Path(root), damaged)
    return None


def load(ckpt: Checkpoint, model: ParallelizedModel, optimizer: torch.optim.Optimizer) -> int:
    """Restore parameters, persistent buffers, optimizer state and the RNG from ``ckpt`` in place (collective),
    resharding to this model's placements. Returns the number of finished steps. Damaged files
    raise CorruptCheckpointError on every rank."""
    metadata = _verified_index(ckpt)
    _materialize_optimizer_state(optimizer)
    params: dict[str, torch.nn.Parameter] = {}
    for fqn, _stage, p in model.parameter_copies():
        params.setdefault(fqn, p)
    _check_layouts(ckpt, model.param_layouts, params)
    entries = metadata.state_dict_metadata
    # a checkpoint written before buffers were saved keeps the model's own buffers
    buffers = {fqn: b for fqn, b in _owned_buffers(model).items() if f"buffer.{fqn}" in entries}
    sd = _state_dict(params, optimizer, torch.get_rng_state(), 0, buffers)
    for key, value in sd.items():
        meta = entries.get(key)
        if meta is None:
            raise CheckpointError(
                f"checkpoint {ckpt.path} has no entry {key!r}: it was saved for another model or optimizer"
            )
        if key.startswith(("model.", "optim.", "buffer.")):
            _check_shape(ckpt, key, meta, tuple(value.shape))
    segmented = _plain_layout(sd)
    _load_state_dict(ckpt, sd, no_dist=False)
    for key, original in segmented.items():
        _copy_into(original, sd[key])
    # other local copies of a tied parameter (and their optimizer state) get the loaded values
    for fqn, _stage, p in model.parameter_copies():
        src = params[fqn]
        if p is src:
            continue
        _copy_into(p.detach(), src.detach())
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                _copy_into(value, optimizer.state[src][key])
    torch.set_rng_state(sd["train.rng"])
    return int(sd["train.step"])


def _check_layouts(ckpt: Checkpoint, layouts: Mapping[str, KVGroupRows], params: Iterable[str]) -> None:
    """The checkpoint stores each of ``params`` in the layout this program keeps it in (a checkpoint
    written before autoplan grouped a fused grouped-query QKV projection by key/value head holds it
    in the model's row order: loading it in place would scramble the heads)."""
    for fqn in params:
        saved, wanted = ckpt.param_layouts.get(fqn), layouts.get(fqn)
        if saved != wanted:
            raise CheckpointError(
                f"checkpoint {ckpt.path} stores {fqn} with its rows {layout_text(saved)}, this program keeps them {layout_text(wanted)}: "
                "resume it with the autoplan version that wrote it, or start without --checkpoint-dir and "
                "load its full parameters (autoplan.runtime.checkpoint.read_full_parameters) into the model"
            )


def _load_state_dict(ckpt: Checkpoint, sd: dict[str, Any], *, no_dist: bool) -> None:
    """``dcp.load`` with the index read by :class:`_IndexReader`; any failure is a
    CorruptCheckpointError (DCP raises ``CheckpointException``, a ``BaseException``, when a rank
    fails, on every rank)."""
    try:
        dcp.load(sd, storage_reader=_IndexReader(ckpt.path), no_dist=no_dist)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - report the directory, not DCP's traceback
        first = (str(exc).splitlines() or [""])[0]
        raise _corrupt(ckpt, f"loading failed: {type(exc).__name__}: {first}") from exc


@torch.no_grad()
def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` in ``dst``'s placement (copies of a tied parameter may be sharded differently)."""
    if isinstance(dst, DTensor) and isinstance(src, DTensor):
        dst.to_local().copy_(src.redistribute(dst.device_mesh, dst.placements).to_local())
    else:
        dst.copy_(src)


def read_full_parameters(path: str | Path) -> dict[str, torch.Tensor]:
    """Every parameter of a checkpoint as a full tensor by FQN in the model's own layout, read in
    this process (no process group needed): for inspection, export or tests."""
    ckpt = _read_marker(Path(path))
    metadata = _read_metadata(ckpt)
    _check_files(ckpt, metadata)
    _check_checksums(ckpt, 0, 1)
    sd: dict[str, Any] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            sd[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        _load_state_dict(ckpt, sd, no_dist=True)
    full = {key.removeprefix("model."): t for key, t in sd.items()}
    return {fqn: to_model(ckpt.param_layouts, fqn, t) for fqn, t in full.items()}
