"""Public error types of autoplan (defined in ``autoplan.cost_models.errors``, the bottom layer)."""

from autoplan.cost_models.errors import (
    CheckpointError,
    ClusterSpecError,
    ConfigError,
    CorruptCheckpointError,
    InfeasiblePlanError,
    NonFiniteLossError,
    NotPlannedError,
    PlanError,
    PlanFileError,
    PlanMismatchError,
    ProfileError,
    UnknownDeviceError,
    UnsupportedModelError,
)

__all__ = [
    "CheckpointError",
    "ClusterSpecError",
    "ConfigError",
    "CorruptCheckpointError",
    "InfeasiblePlanError",
    "NonFiniteLossError",
    "NotPlannedError",
    "PlanError",
    "PlanFileError",
    "PlanMismatchError",
    "ProfileError",
    "UnknownDeviceError",
    "UnsupportedModelError",
]
