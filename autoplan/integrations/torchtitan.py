"""torchtitan: plan a torchtitan model on the device mesh of its ``ParallelDims``.

torchtitan's trainer (``torchtitan/train.py``) sizes its parallelism with ``ParallelDims``
(``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, ``pp``, ``ep`` over ``world_size`` ranks), builds
the world mesh from it (``parallel_dims.world_mesh``; earlier ``parallel_dims.build_mesh(device_type)``),
and hands the model to the model's ``parallelize_fn(model, parallel_dims, job_config)``
(``torchtitan/models/llama3/infra/parallelize.py``: ``parallelize_llama`` applies TP and FSDP2 in
place and returns the model). :func:`parallelize_fn` makes a function of that signature which plans
the model on that mesh instead (its axes of more than one rank, with torchtitan's names) and returns
the :class:`~autoplan.runtime.parallel.ParallelModel`::

    from autoplan.integrations.torchtitan import parallelize_fn

    parallelize = parallelize_fn(example_inputs=(tokens,), loss_fn=cross_entropy_loss, example_targets=(labels,))
    model = parallelize(model, parallel_dims, job_config)   # rank 0 plans; every rank builds its program
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for tokens, labels in batches:                          # the same global batch on every rank
        loss = model(tokens, targets=(labels,))             # forward and backward of the planned step
        loss.backward()                                     # (the gradients are already in .grad)
        optimizer.step(); optimizer.zero_grad()

What differs from torchtitan's own ``parallelize_fn``: the returned model's ``forward`` is the whole
training step (the loss out, the loss function given here), not the logits, so torchtitan's
``Trainer.train_step``/``forward_backward_step`` (``pred = model(inputs)``, ``loss =
self.loss_fn(pred, labels)``) is replaced by the loop above; the program reads the *global* batch
on every rank (torchtitan's data loader gives each data-parallel rank its own rows: load the
global batch, or use ``model.data_loader``); and the mesh decides only the devices and axes: the
plan picks per operator what runs data, tensor or sequence parallel on them, so ``dp_shard`` is not
FSDP unless the plan says so. Pipeline parallelism (``pp > 1``) is planned by autoplan's joint search
(:func:`autoplan.parallelize` with ``global_batch_size=``), not on a given mesh: refused here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.errors import ConfigError
from autoplan.integrations import lightning
from autoplan.passes.trace import LossFn
from autoplan.planner.ilp import Pins, ProfileChoice
from autoplan.planner.plan import Plan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def world_mesh(parallel_dims: Any) -> DeviceMesh:
    """The device mesh of torchtitan's ``parallel_dims``: its ``world_mesh`` (torchtitan since
    2025), else ``build_mesh()`` (earlier releases take the device type), else ``parallel_dims``
    itself when it is a ``DeviceMesh``; ConfigError for anything else, and for ``pp > 1``."""
    from torch.distributed.device_mesh import DeviceMesh

    if getattr(parallel_dims, "pp", 1) > 1:
        raise ConfigError(
            f"parallel_dims has pp={parallel_dims.pp}: autoplan plans pipeline stages itself; plan the model "
            "with autoplan.parallelize(model, cluster, global_batch_size=..., config=ParallelConfig(pp=...)) "
            "instead of on torchtitan's mesh"
        )
    if isinstance(parallel_dims, DeviceMesh):
        return parallel_dims
    mesh = getattr(parallel_dims, "world_mesh", None)
    if isinstance(mesh, DeviceMesh):
        return mesh
    build = getattr(parallel_dims, "build_mesh", None)
    if callable(build):
        try:
            built = build()
        except TypeError:  # torchtitan before 2025: build_mesh(device_type)
            built = build("cuda" if torch.cuda.is_available() else "cpu")
        if isinstance(built, DeviceMesh):
            return built
    raise ConfigError(
        f"{type(parallel_dims).__name__} is not torchtitan's ParallelDims (no world_mesh or build_mesh) nor a "
        "DeviceMesh: pass the trainer's parallel_dims or its world mesh"
    )


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
) -> Callable[..., torch.nn.Module]:
    """A ``parallelize_fn`` in torchtitan's form: ``fn(model, parallel_dims, job_config=None)``
    runs :func:`autoplan.parallelize` of ``model`` on the cluster of :func:`world_mesh` of
    ``parallel_dims`` (:func:`autoplan.integrations.lightning.parallelize_fn` on that mesh:
    ``cluster`` names the devices on GPUs) with these arguments and returns the
    :class:`~autoplan.runtime.parallel.ParallelModel`. ``job_config`` is accepted for the
    signature and not read: what it configures (FSDP, TP, compile, activation checkpointing) the
    plan decides. ``example_inputs`` / ``example_targets``: one global batch, as the loop will
    pass them."""

    on_mesh = lightning.parallelize_fn(
        example_inputs=example_inputs, loss_fn=loss_fn, example_targets=example_targets, cluster=cluster, plan=plan,
        optimizer=optimizer, pins=pins, profile=profile,
    )  # fmt: skip

    def fn(model: torch.nn.Module, parallel_dims: Any, job_config: Any = None) -> torch.nn.Module:  # noqa: ARG001
        return on_mesh(model, world_mesh(parallel_dims))

    return fn


__all__ = ["parallelize_fn", "world_mesh"]
