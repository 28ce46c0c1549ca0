"""The ``torch.optim`` optimizer a plan was costed for: one constructor for the flat
(:class:`autoplan.runtime.parallel.ParallelModel`) and the pipelined (:class:`autoplan.runtime.pipeline.PipelineModel`)
runtime. The names are the memory model's (``autoplan.cost_models.memory.OPTIMIZERS``); any other name is
an error, never a silent fallback to another optimizer.

Every optimizer is built with ``foreach=True`` unless the caller passes ``foreach=``. torch picks
the multi-tensor ("foreach") kernels by default only when every parameter is a plain CUDA tensor
(``torch.optim.optimizer._default_to_fused_or_foreach``); over DTensor parameters, and on CPU, it
takes the single-tensor loop, which dispatches each elementwise op once per parameter. The
foreach path dispatches one ``torch._foreach_*`` op per parameter group instead (DTensor
propagates a sharding per op, so this also halves its Python overhead) and computes the same
elementwise formulas in the same order, so the update is bit-for-bit equal on CPU
(``tests/test_optimizer_memory.py`` checks it). What it costs in memory is priced by
``autoplan.cost_models.memory.optimizer_temp_bytes``.

:class:`OffloadedOptimizer` runs the same optimizer on the host (``ParallelConfig.offload_optimizer``),
as ``autoplan.cost_models.step.offload_time_s`` and
``autoplan.cost_models.memory.offload_host_bytes_per_element`` price it.

:func:`refuse_optimizers_of_the_module` makes an optimizer built over the *original* module's
parameters (before ``parallelize``, or before a deferred model's first call) fail at its first
step: the parallelized model trains sharded copies, so that optimizer would step nothing, silently."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autoplan.cost_models.errors import PlanError
from autoplan.cost_models.memory import OPTIMIZERS
from autoplan.runtime.collectives import segment_layout


def make_torch_optimizer(name: str, params: Sequence[torch.Tensor], **kwargs: Any) -> torch.optim.Optimizer:
    """``adam``/``adamw``: Adam/AdamW; ``sgd_momentum``: SGD with momentum 0.9 unless
    ``momentum=`` is given; ``sgd``: plain SGD. ``kwargs`` go to the optimizer (``lr=...``);
    ``foreach`` defaults to ``True`` (the module docstring says why)."""
    kwargs.setdefault("foreach", True)
    if name == "adam":
        return torch.optim.Adam(params, **kwargs)
    if name == "adamw":
        return torch.optim.AdamW(params, **kwargs)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, momentum=kwargs.pop("momentum", 0.9), **kwargs)
    if name == "sgd":
        return torch.optim.SGD(params, **kwargs)
    raise PlanError(
        f"unknown optimizer {str(name)[:40]!r} in the plan: use one of {', '.join(OPTIMIZERS)} (re-plan with one)"
    )


def make_optimizer(
    name: str, params: Sequence[torch.nn.Parameter], *, offload: bool = False, **kwargs: Any
) -> torch.optim.Optimizer:
    """:func:`make_torch_optimizer`, or with ``offload`` an :class:`OffloadedOptimizer` running it
    on the host."""
    if offload:
        return OffloadedOptimizer(name, params, **kwargs)
    return make_torch_optimizer(name, params, **kwargs)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (a DTensor's local tensor; a plain tensor itself)."""
    return t.to_local() if isinstance(t, DTensor) else t


class OffloadedOptimizer(torch.optim.Optimizer):
    """The optimizer ``name`` with its state and fp32 master weights in host memory (ZeRO-Offload's
    placement; ``ParallelConfig.offload_optimizer``). Per parameter ``p`` (this rank's shard of it)
    the host holds the fp32 master ``m``, its fp32 gradient, and, where ``p`` is narrower than
    fp32, a staging copy in ``p``'s dtype (pinned where ``p`` is on CUDA). :meth:`step`::

        grads to host:   staging (or m.grad) <- p.grad      (non_blocking from CUDA, then synchronised)
                         m.grad <- staging                  (bf16/fp16 -> fp32, on the host)
        host step:       the torch optimizer ``name`` over the masters (make_torch_optimizer)
        weights back:    staging <- m;  p <- staging (or p <- m)   (non_blocking to CUDA)

    so no conversion temporary lands on the device, and the device holds no optimizer state.
    ``param_groups`` are over the device parameters (learning-rate schedulers and
    ``zero_grad`` work on them; hyperparameters are handed to the host optimizer at each step);
    ``state[p]`` shows the host state of ``p`` in ``p``'s layout (DTensors sharing the host
    storage, scalars as they are), so ``autoplan.runtime.checkpoint`` saves and loads it in place;
    :meth:`state_dict` / :meth:`load_state_dict` are the host optimizer's (the same keys and
    indices as the optimizer without offload)."""

    def __init__(self, name: str, params: Sequence[torch.nn.Parameter], **kwargs: Any) -> None:
        params = list(params)
        self._device_params = params
        cuda = any(_local(p).is_cuda for p in params)
        self._masters = [_host_copy(_local(p), torch.float32, pin=cuda) for p in params]
        self._staging = [
            _host_copy(_local(p), _local(p).dtype, pin=cuda) if _local(p).dtype != torch.float32 else None
            for p in params
        ]
        self._master_of = {id(p): m for p, m in zip(params, self._masters, strict=True)}
        """Device parameter (by identity) -> its host master (:meth:`master`, :meth:`host_state`)."""
        for m in self._masters:
            m.grad = torch.zeros_like(m)
        self._host = make_torch_optimizer(name, self._masters, **kwargs)
        self._cuda = cuda
        super().__init__(params, dict(self._host.defaults))
        self.state = _HostStateView(self)  # type: ignore[assignment]

    def _sync_hyperparameters(self) -> None:
        for group, host in zip(self.param_groups, self._host.param_groups, strict=True):
            host.update({k: v for k, v in group.items() if k != "params"})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hyperparameters()
        for p, m, stage in zip(self._device_params, self._masters, self._staging, strict=True):
            if p.grad is None:
                m.grad = None
                continue
            if m.grad is None:
                m.grad = torch.zeros_like(m)
            (stage if stage is not None else m.grad).copy_(_local(p.grad), non_blocking=self._cuda)
        if self._cuda:
            torch.cuda.synchronize()  # the non_blocking copies to the host have landed
        for m, stage in zip(self._masters, self._staging, strict=True):
            if stage is not None and m.grad is not None:
                m.grad.copy_(stage)
        self._host.step()
        for p, m, stage in zip(self._device_params, self._masters, self._staging, strict=True):
            if p.grad is None:
                continue
            if stage is not None:
                stage.copy_(m)
            _local(p).copy_(stage if stage is not None else m, non_blocking=self._cuda)
        return loss

    def state_dict(self) -> dict[str, Any]:
        self._sync_hyperparameters()
        return self._host.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self._host.load_state_dict(dict(state_dict))
        for group, host in zip(self.param_groups, self._host.param_groups, strict=True):
            group.update({k: v for k, v in host.items() if k != "params"})

    def host_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """The host optimizer's state of device parameter ``p`` (empty before the first step)."""
        m = self._master_of.get(id(p))
        return {} if m is None else self._host.state.get(m, {})

    def master(self, p: torch.Tensor) -> torch.Tensor:
        """The host's fp32 master copy of device parameter ``p`` (this rank's shard)."""
        return self._master_of[id(p)]


def _host_copy(t: torch.Tensor, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """A host tensor of ``t``'s values in ``dtype``, never sharing ``t``'s storage."""
    out = torch.empty(t.shape, dtype=dtype, device="cpu", pin_memory=pin)
    out.copy_(t.detach())
    return out


class _HostStateView(Mapping[torch.Tensor, dict[str, torch.Tensor]]):
    """``OffloadedOptimizer.state``: device parameter -> its host state, tensors of the
    parameter's shape as DTensors in its layout over the host storage (0-dim ones as they are)."""

    def __init__(self, opt: OffloadedOptimizer) -> None:
        self._opt = opt

    def __getitem__(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self._opt.host_state(p)
        if not state:
            raise KeyError(p)
        return {k: _in_layout_of(v, p) for k, v in state.items()}

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (p for p in self._opt._device_params if self._opt.host_state(p))  # noqa: SLF001

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _in_layout_of(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    if isinstance(p, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0:
        return segment_layout(
            DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
        )
    return value


__all__ = ["OffloadedOptimizer", "make_optimizer", "make_torch_optimizer"]


class _ModuleParameterGuard:
    """A step pre-hook of every ``torch.optim`` optimizer (:func:`refuse_optimizers_of_the_module`).
    Holds only weak references: the module's parameters and the parallelized model die as usual."""

    def __init__(self, module: torch.nn.Module, built: torch.nn.Module) -> None:
        self._module_params: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary(
            {id(p): p for p in module.parameters()}
        )
        self._built = weakref.ref(built)
        self._passed: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        """Optimizers found to train something: checked once, at their first step."""

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:  # noqa: ARG002
        if optimizer in self._passed:
            return
        built = self._built()
        held = [p for group in optimizer.param_groups for p in group["params"]]
        stale = [p for p in held if self._module_params.get(id(p)) is p]
        program = {id(p) for p in built.parameters()} if built is not None else set()
        # an optimizer training the module itself (its own backward left gradients) is the user's
        if not stale or any(id(p) in program for p in held) or any(p.grad is not None for p in stale):
            self._passed.add(optimizer)
            return
        raise PlanError(
            f"the optimizer ({type(optimizer).__name__}) holds {len(stale)} parameter(s) of the module given to "
            "autoplan.parallelize and none of the parallelized model's: that model trains sharded copies, so this "
            "optimizer would step nothing; build it after the first call, over pmodel.parameters(), or with "
            "pmodel.make_optimizer(lr=...)"
        )


def refuse_optimizers_of_the_module(module: torch.nn.Module, built: torch.nn.Module) -> None:
    """From now on, the first ``step()`` of any optimizer holding ``module``'s parameters and none
    of ``built``'s (``built.parameters()``: the parallelized model made from ``module``) raises
    :class:`PlanError` naming the fix, unless those parameters have gradients (the optimizer
    trains ``module`` itself, e.g. as a single-device reference). The hook goes with ``built``."""
    handle = register_optimizer_step_pre_hook(_ModuleParameterGuard(module, built))
    weakref.finalize(built, handle.remove)
