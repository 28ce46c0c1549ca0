"""Batch norm in training mode, written out in reductions the planner can split over the batch.

``aten._native_batch_norm_legit_functional`` (batch norm with running statistics, after
``torch.export`` functionalizes the module's in-place update of them) and
``aten._native_batch_norm_legit.no_stats`` (``track_running_stats=False``) are single kernels
with no sharding strategy: a plan could only run them replicated, which gathers a CNN's
activations at every norm. The trace replaces them by their definition (``N`` the elements per
channel, the sums over every dim but the channel dim ``1``)::

    mean = sum(x) / N                         (1, C, 1, ...)
    var  = sum((x - mean)^2) / N              biased, as the kernel normalises with
    y    = (x - mean) * rsqrt(var + eps) * weight + bias
    running_mean <- momentum * mean + (1 - momentum) * running_mean
    running_var  <- momentum * var * N / (N - 1) + (1 - momentum) * running_var

With the batch split over ranks, each ``sum`` is a partial sum on every rank and the plan
all-reduces it (``P -> R``, priced like every other edge by the cost model), which is what
``torch.nn.SyncBatchNorm`` does: every rank normalises with the statistics of the whole batch,
so the loss, the gradients and the running statistics are those of one device. (The ILP weighs
this against the other layouts DTensor's rules give, e.g. the channels split across ranks, the
activation converted by an all-to-all, which small CPU test models take where it is cheaper.) Autograd of the
written-out form is the backward: its reductions of the gradient (``sum(grad)``,
``sum(grad * (x - mean))`` over the batch) are again partial sums that the plan all-reduces,
as SyncBatchNorm's backward all-reduces its two.

The running statistics are buffers the step writes (``copy_`` into the buffer after the
forward; ``num_batches_tracked`` too): the generated program writes them in place on every
rank, where they are replicated; a pipeline stage updates them once per micro-batch (each
normalised by its own statistics, as one device accumulating gradients does). Batch norm in eval
mode (``aten._native_batch_norm_legit_no_training``) reads the running statistics and stays one op.
The statistics are computed in fp32 for fp16/bf16 inputs, as the kernels do; ``momentum=None``
(a cumulative average, ``1 / num_batches_tracked`` read as a Python number) cannot be traced:
:func:`check_batch_norm_momentum` says so before the export would stop on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autoplan.cost_models.errors import UnsupportedModelError

aten = torch.ops.aten


def _batch_norm_training(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    momentum: float,
    eps: float,
) -> tuple[torch.Tensor | None, ...]:
    """``(y, save_mean, save_rstd, new_running_mean, new_running_var)`` of batch norm in
    training mode over ``x`` (N, C, ...), as the module docstring writes it out."""
    dims = [0, *range(2, x.dim())]
    num_channels = x.shape[1]
    n = x.numel() // num_channels
    h = x.to(torch.float32) if x.dtype in (torch.float16, torch.bfloat16) else x
    mean = torch.sum(h, dims, keepdim=True) / n  # (1, C, 1, ...)
    centered = h - mean
    var = torch.sum(centered * centered, dims, keepdim=True) / n
    rstd = torch.rsqrt(var + eps)
    y = centered * rstd
    channel_shape = [1, num_channels] + [1] * (x.dim() - 2)
    if weight is not None:
        y = y * weight.view(channel_shape)
    if bias is not None:
        y = y + bias.view(channel_shape)
    save_mean, save_rstd = mean.view(num_channels), rstd.view(num_channels)
    new_mean = new_var = None
    if running_mean is not None:
        new_mean = (momentum * save_mean + (1 - momentum) * running_mean).to(running_mean.dtype)
    if running_var is not None:
        unbiased = var.view(num_channels) * (n / max(n - 1, 1))
        new_var = (momentum * unbiased + (1 - momentum) * running_var).to(running_var.dtype)
    return y.to(x.dtype), save_mean, save_rstd, new_mean, new_var


def _legit_functional(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    training: bool,
    momentum: float,
    eps: float,
) -> Any:
    """``aten._native_batch_norm_legit_functional``: with running statistics."""
    if not training:
        return NotImplemented  # the kernel reads the running statistics: nothing to reduce
    return _batch_norm_training(x, weight, bias, running_mean, running_var, momentum, eps)


def _legit_no_stats(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
) -> Any:
    """``aten._native_batch_norm_legit.no_stats``: ``track_running_stats=False``."""
    if not training:
        return NotImplemented
    return _batch_norm_training(x, weight, bias, None, None, momentum, eps)[:3]


BATCH_NORM_DECOMPOSITIONS: dict[torch._ops.OpOverload, Callable[..., Any]] = {
    aten._native_batch_norm_legit_functional.default: _legit_functional,
    aten._native_batch_norm_legit.no_stats: _legit_no_stats,
}
"""The decomposition table ``ExportedProgram.run_decompositions`` applies in the trace."""


def is_training_batch_norm(node: torch.fx.Node) -> bool:
    """``node`` is a batch norm in training mode as ``torch.export`` records it
    (``aten.batch_norm(x, weight, bias, running_mean, running_var, training, ...)``)."""
    if node.op != "call_function" or node.target is not aten.batch_norm.default:
        return False
    return bool(node.args[5] if len(node.args) > 5 else node.kwargs.get("training", False))


def check_batch_norm_momentum(model: torch.nn.Module) -> None:
    """Raise :class:`UnsupportedModelError` for a batch norm in training mode with
    ``momentum=None``: its cumulative average reads ``1 / num_batches_tracked`` as a Python
    number, which ``torch.export`` cannot trace (it would stop on a data-dependent value)."""
    cumulative = [
        f"{type(m).__name__} {name or '(the model)'}"
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training and m.momentum is None
        and m.track_running_stats
    ]  # fmt: skip
    if cumulative:
        shown = ", ".join(cumulative[:3]) + (f" (+{len(cumulative) - 3} more)" if len(cumulative) > 3 else "")
        raise UnsupportedModelError(
            f"batch norm in training mode with momentum=None ({shown}) keeps a cumulative average of its "
            "statistics, weighted by 1 / num_batches_tracked read as a Python number, which a traced training step "
            "cannot do; give it a momentum (momentum=0.1 is the default) or build it with track_running_stats=False"
        )
