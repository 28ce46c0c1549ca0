"""Public error types of autoplan (defined in ``cost_models.errors``, the bottom layer)."""

from cost_models.errors import (
    ClusterSpecError,
    InfeasiblePlanError,
    PlanError,
    PlanFileError,
    PlanMismatchError,
    UnknownDeviceError,
    UnsupportedModelError,
)

__all__ = [
    "ClusterSpecError",
    "InfeasiblePlanError",
    "PlanError",
    "PlanFileError",
    "PlanMismatchError",
    "UnknownDeviceError",
    "UnsupportedModelError",
]
