"""The ``torch.optim`` optimizer a plan was costed for: one constructor for the flat
(:class:`autoplan.runtime.parallel.ParallelModel`) and the pipelined (:class:`autoplan.runtime.pipeline.PipelineModel`)
runtime. The names are the memory model's (``autoplan.cost_models.memory.OPTIMIZERS``); any other name is
an error, never a silent fallback to another optimizer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from autoplan.cost_models.errors import PlanError
from autoplan.cost_models.memory import OPTIMIZERS


def make_torch_optimizer(name: str, params: Sequence[torch.nn.Parameter], **kwargs: Any) -> torch.optim.Optimizer:
    """``adam``/``adamw``: Adam/AdamW; ``sgd_momentum``: SGD with momentum 0.9 unless
    ``momentum=`` is given; ``sgd``: plain SGD. ``kwargs`` go to the optimizer (``lr=...``)."""
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
