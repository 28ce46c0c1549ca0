"""The user's own training loop over a parallelized model (issue #21 item 3).

A generated step program computes the loss *and* the parameter gradients in one run (the joint
forward/backward graph the plan was made for): there is no separate forward whose autograd graph
a later ``loss.backward()`` could walk. Calling the model therefore runs the whole step and
returns the loss as a tensor whose backward *installs* those gradients, so a standard loop reads
as it does on one device::

    pmodel = autoplan.parallelize(model, cluster, example_inputs=(ids,), loss_fn=loss_fn, example_targets=(labels,))
    opt = torch.optim.AdamW(pmodel.parameters(), lr=3e-4)       # any torch.optim optimizer (DTensor parameters)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    for ids, labels in batches:
        loss = pmodel(ids, targets=(labels,))                   # the step's forward and backward run here
        loss.backward()                                         # gradients land in .grad (summed if already there)
        pmodel.clip_grad_norm_(1.0)                             # the global norm over every shard and stage
        opt.step(); sched.step(); opt.zero_grad()
    destroy_process_groups()                                    # autoplan.runtime.teardown: end the rank program

(``torch.nn.utils.clip_grad_norm_`` would count a replicated shard once per rank and miss the
other pipeline stages: :func:`clip_grad_norm_` is the global norm.)

Semantics of the returned loss ``L`` (:func:`loss_installing_grads`): ``L.backward(g)`` adds
``g * dL/dp`` to each trainable parameter's ``.grad`` (DTensors in the parameters' placements),
so scaling the loss scales the gradients and two calls before one ``backward`` each accumulate,
as autograd does. Not supported: a backward through anything computed *from the model's output*
other than the planned loss (the loss function is part of the traced and planned step); under
``torch.no_grad()`` the step still computes gradients and drops them.

State dicts use the model's own parameter names (:func:`sharded_state_dict`): values are the
sharded parameters themselves (DTensors), so ``torch.distributed.checkpoint.save`` /
``load`` work on them in place, and :func:`load_sharded_state_dict` takes full tensors (a
single-device checkpoint) or DTensors. Persistent buffers are in them as on one device (a
buffer registered with ``persistent=False`` is not, as ``torch.nn.Module.state_dict`` leaves
it out), and a tied tensor's other names (:func:`state_dict_aliases`) load into it.

A loop that must not train on a non-finite loss calls :func:`check_finite_loss` before the
optimizer step (``autoplan run`` does; ``--allow-nonfinite`` trains on).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication

from autoplan.cost_models.errors import NonFiniteLossError, PlanError, PlanMismatchError
from autoplan.passes.kv_rows import KVGroupRows, to_stored
from autoplan.runtime.collectives import segment_layout
from autoplan.runtime.lowering import local_shard


class _InstallGrads(torch.autograd.Function):
    """Identity on the loss; its backward adds ``grad_output * grad`` to each parameter's ``.grad``."""

    @staticmethod
    def forward(
        ctx: Any,
        anchor: torch.Tensor,  # noqa: ARG004 - makes the output require grad
        loss: torch.Tensor,
        params: Sequence[torch.nn.Parameter],
        grads: Sequence[torch.Tensor | None],
    ) -> torch.Tensor:
        ctx.params, ctx.grads = list(params), list(grads)
        return loss.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        if ctx.grads is None:
            raise RuntimeError(
                "the loss of a parallelized step was back-propagated twice: call the model again for another step"
            )
        with torch.no_grad(), implicit_replication():
            for p, g in zip(ctx.params, ctx.grads, strict=True):
                if g is None:
                    continue
                scaled = g * grad_output.to(g.dtype)
                p.grad = scaled if p.grad is None else p.grad + scaled
        ctx.params = ctx.grads = None
        return None, None, None, None


COMPILED_CALL_NOTE = (
    "torch.compile of a parallelized model runs its per-rank program eagerly: the program's collectives are "
    "issued and waited where the plan priced them, and TorchDynamo skips it (the call is torch.compiler.disable'd); "
    "the numbers are the eager program's"
)
"""What ``torch.compile(pmodel)`` does, said once per process (:func:`note_compiled_call`)."""

_compiled_call_noted = False


def note_compiled_call() -> None:
    """Warn once that ``torch.compile(pmodel)`` runs the program eagerly (called from a
    parallel model's ``forward`` while TorchDynamo traces it)."""
    global _compiled_call_noted
    if not _compiled_call_noted:
        _compiled_call_noted = True
        import warnings

        warnings.warn(COMPILED_CALL_NOTE, UserWarning, stacklevel=3)


def loss_installing_grads(
    anchor: torch.Tensor,
    loss: torch.Tensor,
    params: Sequence[torch.nn.Parameter],
    before: Sequence[torch.Tensor | None],
) -> torch.Tensor:
    """After a step that left its gradients in ``params``' ``.grad``: put back the gradients
    ``before`` it and return ``loss`` as a tensor whose backward adds the step's (module
    docstring). ``anchor``: a scalar that requires grad, so that the loss does."""
    grads = [p.grad for p in params]
    for p, g in zip(params, before, strict=True):
        p.grad = g
    if not torch.is_grad_enabled():
        return loss.detach()
    return _InstallGrads.apply(anchor, loss, list(params), grads)


def sharded_parameter(
    fqn: str,
    value: torch.Tensor,
    layouts: Mapping[str, KVGroupRows],
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    requires_grad: bool,
    device: torch.device | None = None,
) -> torch.nn.Parameter:
    """The model's parameter ``fqn`` (``value``, the model's layout) as a program keeps it: in the
    layout the program reads it in (``layouts``, :mod:`autoplan.passes.kv_groups`), sharded by
    ``placements`` over ``mesh`` (every rank holds the full value: no communication), frozen
    unless ``requires_grad``."""
    stored = to_stored(layouts, fqn, value.detach())
    if device is not None:
        stored = stored.to(device)
    sharded = distribute_tensor(stored, mesh, list(placements), src_data_rank=None)
    return torch.nn.Parameter(segment_layout(sharded), requires_grad=requires_grad)


def sharded_state_dict(named: Mapping[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """``{fqn: parameter}`` with the model's own names; the values are the sharded parameters,
    detached (they share storage: loading into them in place updates the model)."""
    return {fqn: p.detach() for fqn, p in named.items()}


def batch_norm_mode(model: torch.nn.Module) -> bool | None:
    """The mode ``model``'s batch norms are planned in: ``True`` when one is in training mode (the
    program normalises by batch statistics and updates the running ones), ``False`` when all are
    in eval mode (it reads the running statistics), ``None`` without batch norm."""
    modes = {m.training for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}
    return None if not modes else True in modes


def check_batch_norm_mode(planned: bool | None, training: bool) -> None:
    """Raise :class:`PlanMismatchError` when a parallel model's ``train()``/``eval()`` mode is not
    the one its batch norms were planned in (:func:`batch_norm_mode`): the program is traced for
    one mode, and switching the module would not switch it."""
    if planned is None or planned == training:
        return
    mode, other = ("training", "eval") if planned else ("eval", "training")
    raise PlanMismatchError(
        f"the plan runs batch norm in {mode} mode (the model's mode when it was planned), but the parallel model "
        f"was switched to {other} mode: the program does not change with .train()/.eval(); switch it back, or "
        f"plan the model in {other} mode for those steps (model.{'eval' if planned else 'train'}() before "
        "autoplan.parallelize)"
    )


def persistent_buffer_names(model: torch.nn.Module) -> frozenset[str]:
    """FQNs of ``model``'s buffers that its ``state_dict()`` holds: every buffer not registered
    with ``persistent=False`` (by the names ``named_buffers()`` gives)."""
    names = set()
    for fqn, _ in model.named_buffers():
        owner, _, leaf = fqn.rpartition(".")
        if leaf not in model.get_submodule(owner)._non_persistent_buffers_set:
            names.add(fqn)
    return frozenset(names)


def state_dict_aliases(model: torch.nn.Module) -> dict[str, str]:
    """The other names of a tensor registered under several (a tied embedding and output
    projection): alias -> the name ``named_parameters()`` / ``named_buffers()`` give it. A
    single-device ``state_dict()`` holds every name."""
    aliases: dict[str, str] = {}
    for named in (model.named_parameters, model.named_buffers):
        first: dict[int, str] = {}
        for fqn, t in named(remove_duplicate=False):
            canonical = first.setdefault(id(t), fqn)
            if canonical != fqn:
                aliases[fqn] = canonical
    return aliases


def load_sharded_state_dict(
    named: Mapping[str, torch.nn.Parameter],
    state_dict: Mapping[str, Any],
    *,
    strict: bool = True,
    elsewhere: frozenset[str] = frozenset(),
    layouts: Mapping[str, KVGroupRows] | None = None,
    buffers: Mapping[str, DTensor] | None = None,
    aliases: Mapping[str, str] | None = None,
) -> tuple[list[str], list[str]]:
    """Copy ``state_dict`` (FQN -> a full tensor, or a DTensor in any placement) into the sharded
    parameters ``named`` and the replicated ``buffers`` (the persistent ones: FQN -> DTensor);
    returns the (missing, unexpected) keys. A full tensor is in the model's layout and goes into
    the program's (``layouts``, :mod:`autoplan.passes.kv_groups`); a DTensor is a program's own
    ``state_dict()`` value, already in it. ``aliases``: a tied tensor's other names
    (:func:`state_dict_aliases`), loaded into it unless its own name is given too. ``strict``:
    every parameter and buffer must be given and no other key, except the ``elsewhere`` ones
    (parameters other pipeline ranks hold). Collective when a DTensor on another mesh is given."""
    buffers = buffers or {}
    given = dict(state_dict)
    for alias, canonical in (aliases or {}).items():
        if alias in given:
            value = given.pop(alias)
            given.setdefault(canonical, value)
    expected = set(named) | set(buffers)
    missing = sorted(expected - set(given))
    unexpected = sorted(set(given) - expected - elsewhere)
    if strict and (missing or unexpected):
        raise PlanError(
            f"state dict does not match the model: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}: give the keys of the model's "
            "state_dict() (its parameters and persistent buffers), or load with strict=False to load only the "
            "keys that match"
        )
    with torch.no_grad():
        for fqn, p in named.items():
            if fqn not in given:
                continue
            value, param = given[fqn], p.detach()
            assert isinstance(param, DTensor)
            _check_entry_shape(fqn, value, param, "parameter")
            if isinstance(value, DTensor) and value.device_mesh == param.device_mesh:
                local = value.redistribute(param.device_mesh, param.placements).to_local()
            else:
                full = value.full_tensor() if isinstance(value, DTensor) else to_stored(layouts or {}, fqn, value)
                local = local_shard(full.to(param.device), param.device_mesh, param.placements)
            param.to_local().copy_(local)
        for fqn, buffer in buffers.items():
            if fqn not in given:
                continue
            value = given[fqn]
            _check_entry_shape(fqn, value, buffer, "buffer")
            assert all(pl.is_replicate() for pl in buffer.placements), "the program reads buffers replicated"
            full = value.full_tensor() if isinstance(value, DTensor) else value
            buffer.to_local().copy_(full.to(buffer.device))
    return missing, unexpected


def _check_entry_shape(fqn: str, value: Any, held: torch.Tensor, what: str) -> None:
    if tuple(value.shape) != tuple(held.shape):
        raise PlanError(
            f"state dict entry {fqn!r} has shape {tuple(value.shape)}, the model's {what} "
            f"{tuple(held.shape)}: load a checkpoint of this model"
        )


def check_finite_loss(loss: torch.Tensor | float, step: int, *, allow_nonfinite: bool = False) -> bool:
    """``True`` if ``loss`` (step ``step``, counted from 1) is finite. A non-finite one raises
    :class:`~autoplan.errors.NonFiniteLossError` naming the step, before the optimizer applies its
    gradients (the parameters stay those of the step before); ``allow_nonfinite``: return
    ``False`` instead and train on. Every rank of a step sees the same loss, so all stop together."""
    value = float(loss.detach().float()) if isinstance(loss, torch.Tensor) else float(loss)
    if math.isfinite(value):
        return True
    if allow_nonfinite:
        return False
    raise NonFiniteLossError(
        f"step {step}: the loss is {value} (not finite): stopped before its optimizer step, the parameters are "
        "those after the step before; lower the learning rate or check the data, or pass --allow-nonfinite "
        "(allow_nonfinite=True) to train on"
    )


def clip_grad_norm_(
    owned: Sequence[torch.nn.Parameter],
    copies: Sequence[torch.nn.Parameter],
    max_norm: float,
    *,
    norm_type: float = 2.0,
    group: Any = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over every rank's shards: the norm of all gradients
    of the model, as one device computes it, and every copy's gradient scaled by
    ``min(1, max_norm / (norm + 1e-6))``. Collective over ``group`` (default: every rank).

    ``owned``: the parameters this rank counts (a copy of a parameter tied across pipeline
    stages counted once, on the stage that owns it); ``copies``: every parameter it scales. A
    gradient replicated over mesh axes is counted once per replica group: each rank adds its
    local shard's ``sum |g|^p`` divided by the number of ranks holding the same shard (the
    product of the sizes of the axes its placement replicates), the sum over ranks is the norm's
    ``p``-th power. ``norm_type`` 2 (or any ``p > 0``) or ``inf`` (a max over ranks)."""
    if not (norm_type == float("inf") or norm_type > 0):
        raise PlanError(f"clip_grad_norm_ norm_type={norm_type}: give a positive p or inf")
    grads = [p.grad for p in owned if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad():
        for g in grads:
            local = g.to_local() if isinstance(g, DTensor) else g
            if norm_type == float("inf"):
                total = torch.maximum(total, local.abs().max().to(torch.float64)) if local.numel() else total
            else:
                replicas = 1
                if isinstance(g, DTensor):
                    for size, placement in zip(g.device_mesh.shape, g.placements, strict=True):
                        replicas *= size if placement.is_replicate() else 1
                total = total + local.to(torch.float64).abs().pow(norm_type).sum() / replicas
        op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
        dist.all_reduce(total, op=op, group=group)
        norm = total if norm_type == float("inf") else total.pow(1.0 / norm_type)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in copies:
            if p.grad is not None:
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                local.mul_(coef.to(local.dtype))
    return norm.to(torch.float32)
