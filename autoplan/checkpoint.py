"""Sharded training checkpoints that survive a killed rank and load under any plan.

Layout of a checkpoint root ``DIR`` (``autoplan run --checkpoint-dir DIR``)::

    DIR/step_4/            complete: written by every rank, then renamed by rank 0
        .metadata          torch.distributed.checkpoint (DCP) index
        __0_0.distcp ...   each rank's shards
        COMPLETE           JSON: step, optimizer, world size and mesh it was saved under
    DIR/step_6.tmp/        being written (or abandoned by a killed rank): never loaded

Saving is collective: every rank writes its own shards into ``step_<n>.tmp`` with ``dcp.save``;
after a barrier rank 0 writes ``COMPLETE`` and renames the directory to ``step_<n>``, so a
checkpoint that some rank did not finish never carries the final name.

The state dict is keyed by the *original model's* parameter FQNs, not by the parallelized
module's attribute names, so it does not depend on the plan::

    model.<fqn>                 parameter (DTensor in the plan's placement)
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
import re
import shutil
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from autoplan.parallel import ParallelModel
from autoplan.pipeline import PipelineModel, StageModule
from autoplan.plan import Plan
from cost_models.errors import CheckpointError

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
        return Checkpoint(path=path, step=int(data["step"]), optimizer=str(data["optimizer"]))
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint {path} is incomplete (no {COMPLETE_MARKER} marker)") from exc
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {path} has an unreadable {COMPLETE_MARKER} marker: {exc}") from exc


def find_latest(root: str | Path) -> Checkpoint | None:
    """The newest complete checkpoint under ``root`` (None if there is none). Directories
    without a valid ``COMPLETE`` marker (a save interrupted by a killed rank) are skipped
    with a warning."""
    root = Path(root)
    if not root.is_dir():
        return None
    candidates = []
    for entry in root.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and entry.is_dir():
            candidates.append((int(m.group(1)), entry))
    for step, path in sorted(candidates, reverse=True):
        try:
            ckpt = _read_marker(path)
        except CheckpointError as exc:
            logger.warning("%s: skipping it", exc)
            continue
        if ckpt.step != step:
            logger.warning("checkpoint %s has a marker for step %d: skipping it", path, ckpt.step)
            continue
        return ckpt
    return None


def _read_metadata(ckpt: Checkpoint) -> Metadata:
    try:
        return dcp.FileSystemReader(str(ckpt.path)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any unreadable index is reported with the directory
        raise CheckpointError(
            f"checkpoint {ckpt.path} is corrupted ({type(exc).__name__}: {exc}): "
            "delete the directory to resume from an older checkpoint"
        ) from exc


def check_compatible(ckpt: Checkpoint, plan: Plan, param_shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Cheap check, before any rank starts, that ``ckpt`` is readable and holds every
    parameter of ``plan``'s model, with the shapes ``param_shapes`` (FQN -> shape), and state
    for its optimizer."""
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


def _check_shape(ckpt: Checkpoint, key: str, meta: object, shape: tuple[int, ...]) -> None:
    if isinstance(meta, TensorStorageMetadata) and tuple(meta.size) != shape:
        raise CheckpointError(
            f"checkpoint {ckpt.path}: {key} has shape {tuple(meta.size)}, the model has {shape}: "
            "it was saved for another model"
        )


# --- state dict ------------------------------------------------------------------------------------


def _parameter_copies(model: ParallelizedModel) -> Iterator[tuple[str, int, torch.nn.Parameter]]:
    """``(fqn, stage, parameter)`` of every parameter this rank holds; a pipeline rank may hold
    several copies of a tied parameter (one per stage)."""
    if isinstance(model, PipelineModel):
        for st in model.stage_modules:
            assert isinstance(st, StageModule)
            for fqn, p in zip(st.program.param_names, st.params, strict=True):
                yield fqn, st.program.index, p
    else:
        for fqn, p in model.named_sharded_parameters():
            yield fqn, 0, p


def _owned(model: ParallelizedModel) -> dict[str, torch.nn.Parameter]:
    """FQN -> the copy this rank saves: a parameter tied across pipeline stages is saved only
    from the lowest stage holding it (its copies may be sharded differently)."""
    copies = list(_parameter_copies(model))
    first: dict[str, int] = {}
    for fqn, stage, _ in copies:
        first[fqn] = min(stage, first.get(fqn, stage))
    if isinstance(model, PipelineModel):
        gathered: list[dict[str, int] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, first)
        for other in gathered:
            assert other is not None
            for fqn, stage in other.items():
                first[fqn] = min(stage, first.get(fqn, stage))
    out: dict[str, torch.nn.Parameter] = {}
    for fqn, stage, p in copies:
        if stage == first[fqn]:
            out.setdefault(fqn, p)
    return out


def _materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazily built state (one step with zero gradients and lr 0, which
    leaves the parameters unchanged) so that DCP can load into it in place."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
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


def _state_dict(
    params: Mapping[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer, rng: torch.Tensor, step: int
) -> dict[str, Any]:
    """The flat, plan-independent state dict (see the module docstring); its tensors share
    storage with the parameters and optimizer state, so ``dcp.load`` restores them in place."""
    sd: dict[str, Any] = {}
    for fqn, p in params.items():
        sd[f"model.{fqn}"] = p.detach()
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                sd[f"optim.{fqn}.{key}"] = value
    sd["train.step"] = torch.tensor(step, dtype=torch.int64)
    sd["train.rng"] = rng
    return sd


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
        shutil.rmtree(tmp, ignore_errors=True)  # left by a rank killed during an earlier save
    dist.barrier()
    sd = _state_dict(_owned(model), optimizer, _rank0_rng_state(), step)
    dcp.save(sd, checkpoint_id=str(tmp))
    dist.barrier()
    if rank == 0:
        marker = {
            "version": FORMAT_VERSION,
            "step": step,
            "optimizer": plan.optimizer,
            "world_size": plan.world_size,
            "mesh_shape": list(plan.cluster.mesh_shape),
            "plan_fingerprint": plan.fingerprint,
        }
        (tmp / COMPLETE_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    dist.barrier()
    return final


def load(ckpt: Checkpoint, model: ParallelizedModel, optimizer: torch.optim.Optimizer) -> int:
    """Restore parameters, optimizer state and the RNG from ``ckpt`` in place (collective),
    resharding to this model's placements. Returns the number of finished steps."""
    metadata = _read_metadata(ckpt)
    _materialize_optimizer_state(optimizer)
    params: dict[str, torch.nn.Parameter] = {}
    for fqn, _stage, p in _parameter_copies(model):
        params.setdefault(fqn, p)
    sd = _state_dict(params, optimizer, torch.get_rng_state(), 0)
    for key, value in sd.items():
        meta = metadata.state_dict_metadata.get(key)
        if meta is None:
            raise CheckpointError(
                f"checkpoint {ckpt.path} has no entry {key!r}: it was saved for another model or optimizer"
            )
        if key.startswith(("model.", "optim.")):
            _check_shape(ckpt, key, meta, tuple(value.shape))
    try:
        dcp.load(sd, checkpoint_id=str(ckpt.path))
    except Exception as exc:  # noqa: BLE001 - DCP wraps every rank's failure; report the directory
        raise CheckpointError(
            f"checkpoint {ckpt.path} cannot be loaded ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}): "
            "delete the directory to resume from an older checkpoint"
        ) from exc
    # other local copies of a tied parameter (and their optimizer state) get the loaded values
    for fqn, _stage, p in _parameter_copies(model):
        src = params[fqn]
        if p is src:
            continue
        _copy_into(p.detach(), src.detach())
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                _copy_into(value, optimizer.state[src][key])
    torch.set_rng_state(sd["train.rng"])
    return int(sd["train.step"])


@torch.no_grad()
def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` in ``dst``'s placement (copies of a tied parameter may be sharded differently)."""
    if isinstance(dst, DTensor) and isinstance(src, DTensor):
        dst.to_local().copy_(src.redistribute(dst.device_mesh, dst.placements).to_local())
    else:
        dst.copy_(src)


def read_full_parameters(path: str | Path) -> dict[str, torch.Tensor]:
    """Every parameter of a checkpoint as a full tensor by FQN, read in this process (no
    process group needed): for inspection, export or tests."""
    ckpt = _read_marker(Path(path))
    metadata = _read_metadata(ckpt)
    sd: dict[str, Any] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            sd[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(sd, checkpoint_id=str(ckpt.path), no_dist=True)
    return {key.removeprefix("model."): t for key, t in sd.items()}
