"""Typed errors for users of autoplan.

They live at the bottom of the dependency chain (``cost_models`` <- ``passes`` <- ``autoplan``)
so every layer can raise them; ``autoplan.errors`` re-exports them as the public API.

Every message names what failed, the values involved and what to change. The CLI prints the
message on one line and exits with code 2. Values quoted from user input go through
``autoplan.cost_models.echo.clip`` (bounded length).
"""

from __future__ import annotations

from autoplan.cost_models.echo import clip_message


class PlanError(ValueError):
    """Base class of every error autoplan raises for bad user input or an impossible request.

    A message longer than ``autoplan.cost_models.echo.MAX_MESSAGE_CHARS`` is cut in the middle, so no input
    (a huge value quoted from a file) makes an unbounded message."""

    def __init__(self, *args: object) -> None:
        if args and isinstance(args[0], str):
            args = (clip_message(args[0]), *args[1:])
        super().__init__(*args)


class ClusterSpecError(PlanError):
    """A cluster description (preset string, constructor arguments or file) is malformed."""


class UnknownDeviceError(ClusterSpecError):
    """A device name is not in the hardware catalog."""


class UnsupportedModelError(PlanError):
    """The model cannot be traced or contains something the planner cannot handle."""


class InfeasiblePlanError(PlanError):
    """No sharding plan satisfies the constraints (usually per-device memory)."""


class PlanFileError(PlanError):
    """A plan file is malformed, of an unknown version, or does not match this model/cluster."""


class PlanMismatchError(PlanFileError):
    """A plan is applied to a different model, input shapes or world size than it was made for."""


class CheckpointError(PlanError):
    """A checkpoint cannot be read or does not fit the model, plan or optimizer it is loaded into."""


class CorruptCheckpointError(CheckpointError):
    """A complete checkpoint's files are damaged (truncated, overwritten, unreadable index): a
    resume falls back to the previous complete checkpoint."""


class ProfileError(PlanError):
    """A profile database is unreadable, of an unknown format, measured on another device or
    software stack, or profiling was asked for on a device this machine does not have."""


class ConfigError(PlanError):
    """A parallel configuration (degrees, micro-batches, schedule, ...) is invalid or does not fit
    the model, cluster or global batch."""


class NotPlannedError(PlanError, AttributeError):
    """An attribute of a deferred model (``parallelize`` without ``example_inputs``) is asked for
    before its first call planned it. Also an ``AttributeError``, so ``hasattr(pmodel, name)`` is
    ``False`` and ``getattr(pmodel, name, default)`` gives the default (as for any object without
    the attribute: ``torch.compile`` and other wrappers probe attributes that way)."""


class NonFiniteLossError(PlanError):
    """A training step's loss is NaN or infinite: training stops before that step's optimizer
    step (``autoplan run`` exits 2 with one line naming the step) unless told to train on
    (``--allow-nonfinite``, ``allow_nonfinite=True``)."""
