"""autoplan: automatic parallelism planning and sharded-program generation for PyTorch.

cluster = autoplan.Cluster.preset("2x8xH100")
plan = autoplan.plan(model, cluster, example_inputs=(ids,), loss_fn=..., example_targets=(ids,))
print(plan.summary()); plan.save("plan.json")
pmodel = autoplan.parallelize(model, cluster, example_inputs=(ids,), loss_fn=..., plan=plan)
"""

from typing import TYPE_CHECKING, Any

from autoplan.cost_models.version import __version__ as __version__

# Public names, imported on first use (PEP 562): ``autoplan --help`` and the review commands must
# not pay for importing torch.
_EXPORTS = {
    "parallelize": "autoplan.api",
    "DeferredModel": "autoplan.api",
    "plan": "autoplan.api",
    "ParallelConfig": "autoplan.cost_models.config",
    "ClusterSpecError": "autoplan.errors",
    "ConfigError": "autoplan.errors",
    "InfeasiblePlanError": "autoplan.errors",
    "PlanError": "autoplan.errors",
    "PlanFileError": "autoplan.errors",
    "PlanMismatchError": "autoplan.errors",
    "UnknownDeviceError": "autoplan.errors",
    "UnsupportedModelError": "autoplan.errors",
    "TrainingEstimate": "autoplan.cost_models.step",
    "estimate": "autoplan.api",
    "ParallelModel": "autoplan.runtime.parallel",
    "PipelineModel": "autoplan.runtime.pipeline",
    "Plan": "autoplan.planner.plan",
    "Workload": "autoplan.workload",
    "Cluster": "autoplan.cost_models.cluster",
    "DeviceSpec": "autoplan.cost_models.hardware",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'autoplan' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from autoplan.api import DeferredModel, estimate, parallelize, plan
    from autoplan.cost_models.cluster import Cluster
    from autoplan.cost_models.config import ParallelConfig
    from autoplan.cost_models.hardware import DeviceSpec
    from autoplan.cost_models.step import TrainingEstimate
    from autoplan.errors import (
        ClusterSpecError,
        ConfigError,
        InfeasiblePlanError,
        PlanError,
        PlanFileError,
        PlanMismatchError,
        UnknownDeviceError,
        UnsupportedModelError,
    )
    from autoplan.planner.plan import Plan
    from autoplan.runtime.parallel import ParallelModel
    from autoplan.runtime.pipeline import PipelineModel
    from autoplan.workload import Workload

__all__ = [
    "Cluster",
    "ClusterSpecError",
    "ConfigError",
    "DeferredModel",
    "DeviceSpec",
    "InfeasiblePlanError",
    "ParallelConfig",
    "ParallelModel",
    "PipelineModel",
    "Plan",
    "PlanError",
    "PlanFileError",
    "PlanMismatchError",
    "UnknownDeviceError",
    "TrainingEstimate",
    "UnsupportedModelError",
    "Workload",
    "estimate",
    "parallelize",
    "plan",
]
