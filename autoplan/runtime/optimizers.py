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
``autoplan.cost_models.memory.optimizer_temp_bytes``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from autoplan.cost_models.errors import PlanError
from autoplan.cost_models.memory import OPTIMIZERS


def make_torch_optimizer(name: str, params: Sequence[torch.nn.Parameter], **kwargs: Any) -> torch.optim.Optimizer:
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


__all__ = ["make_torch_optimizer"]
