"""autoplan: automatic parallelism planning and sharded-program generation for PyTorch.

cluster = autoplan.Cluster.preset("2x8xH100")
plan = autoplan.plan(model, cluster, example_inputs=(ids,), loss_fn=..., example_targets=(ids,))
print(plan.summary()); plan.save("plan.json")
pmodel = autoplan.parallelize(model, cluster, example_inputs=(ids,), loss_fn=..., plan=plan)
"""

__version__ = "0.1.0"

from autoplan.api import parallelize, plan  # noqa: E402
from autoplan.config import ParallelConfig  # noqa: E402
from autoplan.errors import (  # noqa: E402
    ClusterSpecError,
    ConfigError,
    InfeasiblePlanError,
    PlanError,
    PlanFileError,
    PlanMismatchError,
    UnknownDeviceError,
    UnsupportedModelError,
)
from autoplan.joint import TrainingEstimate, estimate  # noqa: E402
from autoplan.parallel import ParallelModel  # noqa: E402
from autoplan.plan import Plan  # noqa: E402
from autoplan.workload import Workload  # noqa: E402
from cost_models.cluster import Cluster  # noqa: E402
from cost_models.hardware import DeviceSpec  # noqa: E402

__all__ = [
    "Cluster",
    "ClusterSpecError",
    "ConfigError",
    "DeviceSpec",
    "InfeasiblePlanError",
    "ParallelConfig",
    "ParallelModel",
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
