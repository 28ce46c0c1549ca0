"""Lightning: plan and shard a model inside ``ModelParallelStrategy``.

Lightning's ``ModelParallelStrategy(parallelize_fn=...)`` (``lightning.fabric.strategies``) starts
the process group, builds a device mesh ``(data_parallel, tensor_parallel)`` over the ranks and calls
``parallelize_fn(module, device_mesh)`` in ``fabric.setup_module``. :func:`parallelize_fn` makes that
function: it plans the module on the mesh's shape (its axes of more than one rank, named as Lightning
names them) with the example batch and returns the :class:`~autoplan.runtime.parallel.ParallelModel`
(an ``nn.Module``, as the strategy requires; planning waits for no first call, so there is no
``DeferredModel`` here)::

    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy
    from autoplan.integrations.lightning import parallelize_fn

    strategy = ModelParallelStrategy(parallelize_fn(example_inputs=(ids,), loss_fn=lm_loss, example_targets=(labels,)))
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)   # under torchrun
    fabric.launch()
    model = fabric.setup_module(model)          # rank 0 plans; every rank builds its program
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-4))
    for ids, labels in batches:                 # the same global batch on every rank
        loss = model(ids, targets=(labels,))    # forward and backward of the planned step
        fabric.backward(loss)                   # (the gradients are already in .grad)
        opt.step(); opt.zero_grad()

Lightning's ``Trainer`` (``lightning.pytorch``) with ``ModelParallelStrategy()`` calls the
``LightningModule``'s ``configure_model`` hook with the mesh in ``self.device_mesh``: plan there
and keep the planned model in the module's place, then ``training_step`` returns its loss, which
Lightning back-propagates (``examples/lightning_trainer.py``)::

    def configure_model(self):
        self.model = parallelize_fn(example_inputs=(ids,), loss_fn=lm_loss, example_targets=(ids,))(self.model, self.device_mesh)

    def training_step(self, ids, batch_idx):
        return self.model(ids, targets=(ids,))

``fabric.setup_module`` returns Fabric's wrapper, whose ``.module`` is the module *before* planning
(Fabric keeps the original): its weights never train. Reach the trained model with
:func:`parallel_model` (``parallel_model(model).full_parameters()``, ``.state_dict()``,
checkpoints).

The program takes the *global* batch on every rank and keeps its own shard (as
:meth:`ParallelModel.forward` does everywhere): load data without Lightning's distributed sampler
(``fabric.setup_dataloaders(loader, use_distributed_sampler=False)``), or with
``model.data_loader(dataset)``, which yields each rank's shard. The model's ``forward`` is the
training step (loss out); evaluate with the module the plan was made from, or plan an evaluation
step separately.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from autoplan.api import parallelize
from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.errors import ConfigError
from autoplan.passes.trace import LossFn
from autoplan.planner.ilp import Pins, ProfileChoice
from autoplan.planner.mesh import as_cluster
from autoplan.planner.plan import Plan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def mesh_cluster(device_mesh: DeviceMesh, cluster: Cluster | str | None = None) -> Cluster:
    """The cluster autoplan plans on for Lightning's ``device_mesh``: ``cluster`` (a preset like
    ``"1x8xH100"`` or a :class:`Cluster`, needed on GPUs: the mesh does not say which device it
    is), else the mesh's ranks as CPU ranks (gloo), with the mesh's shape and axis names. An axis
    of one rank (Lightning's ``data_parallel`` on one node, by default) is left out: it splits
    nothing."""
    world = device_mesh.size()
    if cluster is None:
        if device_mesh.device_type != "cpu":
            raise ConfigError(
                f"the device mesh is on {device_mesh.device_type!r}: pass cluster= naming the devices "
                f"(e.g. parallelize_fn(..., cluster='1x{world}xH100')); only CPU ranks are found alone"
            )
        cluster = f"{world}xCPU"
    base = as_cluster(cluster)
    if base.world_size != world:
        raise ConfigError(
            f"cluster {base} has {base.world_size} devices but the strategy's mesh has {world} ranks: "
            f"pass a cluster of {world} devices"
        )
    names = device_mesh.mesh_dim_names or tuple(f"mesh{i}" for i in range(device_mesh.ndim))
    axes = [(int(n), name) for n, name in zip(device_mesh.shape, names, strict=True) if n > 1] or [(1, names[-1])]
    return base.group(
        num_nodes=base.num_nodes, devices_per_node=base.devices_per_node,
        mesh_shape=tuple(n for n, _ in axes), mesh_axis_names=tuple(name for _, name in axes),
    )  # fmt: skip


def parallelize_fn(
    *,
    example_inputs: Sequence[torch.Tensor],
    loss_fn: LossFn | None = None,
    example_targets: Sequence[torch.Tensor] = (),
    cluster: Cluster | str | None = None,
    plan: Plan | None = None,
    optimizer: str = "adam",
    pins: Pins | None = None,
    profile: ProfileChoice = "auto",
) -> Callable[[torch.nn.Module, DeviceMesh], torch.nn.Module]:
    """A ``parallelize_fn`` for Lightning's ``ModelParallelStrategy``: ``fn(module, device_mesh)``
    runs :func:`autoplan.parallelize` of ``module`` on :func:`mesh_cluster` of the mesh with these
    arguments (a given ``plan`` must be for that cluster's devices) and returns the
    :class:`~autoplan.runtime.parallel.ParallelModel`. ``example_inputs`` / ``example_targets``:
    one global batch, as the loop will pass them."""

    def fn(module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        on = plan.cluster if plan is not None else mesh_cluster(device_mesh, cluster)
        return parallelize(
            module, on, example_inputs=example_inputs, loss_fn=loss_fn, example_targets=example_targets,
            plan=plan, optimizer=optimizer, pins=pins, profile=profile,
        )  # fmt: skip

    return fn


def parallel_model(module: torch.nn.Module) -> torch.nn.Module:
    """The autoplan model inside Fabric's wrapper of it (``fabric.setup_module``'s result): the
    :class:`~autoplan.runtime.parallel.ParallelModel` :func:`parallelize_fn` returned, whose
    parameters train. Fabric's ``wrapper.module`` is the module before planning instead. A module
    that is not Fabric's wrapper is returned as it is."""
    forward_module = getattr(module, "_forward_module", None)  # lightning.fabric.wrappers._FabricModule
    return forward_module if isinstance(forward_module, torch.nn.Module) else module


__all__ = ["mesh_cluster", "parallel_model", "parallelize_fn"]
