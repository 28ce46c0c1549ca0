"""What the CLI plans and runs: a model with its example batch and loss.

A *build function* (``my_models.py:build``) returns a :class:`Workload`. It is called on the
``meta`` device to plan (no weights allocated) and on the real device, with the same seed on
every rank, to run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

from autoplan.cost_models.errors import PlanError


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    model: torch.nn.Module
    """The model to train (``meta`` device is fine for planning)."""
    example_inputs: tuple[torch.Tensor, ...]
    """Positional model inputs of one global batch."""
    loss_fn: Callable[..., torch.Tensor] | None = None
    """``loss_fn(model_output, *example_targets) -> scalar``; None if the model returns its loss."""
    example_targets: tuple[torch.Tensor, ...] = ()
    """Targets passed to ``loss_fn``."""
    optimizer: str = "adam"
    """Optimizer the plan is costed for and ``autoplan run`` trains with
    (``adam``, ``adamw``, ``sgd``, ``sgd_momentum``); ``--optimizer`` overrides it."""
    lr: float = 1e-3
    """Learning rate used by ``autoplan run``."""
    batches: Callable[[int], tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]] | None = field(default=None)
    """Optional ``step -> (inputs, targets)``; by default every step reuses the example batch."""
    dataset: Dataset[Any] | None = None
    """Optional map-style ``Dataset`` of ``(*inputs, *targets)`` samples (each shaped like one row
    of the example batch) that ``autoplan run`` trains from instead of ``batches``: step ``k`` is
    rows ``[k*B, (k+1)*B)``, ``B`` the example batch's size, in order, starting over at the end
    (a partial last batch is dropped); each rank loads only the rows its program reads
    (:meth:`~autoplan.runtime.parallel.ParallelModel.data_loader`)."""

    def __post_init__(self) -> None:
        if self.dataset is None:
            return
        if self.batches is not None:
            raise PlanError(
                "the Workload sets both batches= and dataset=: keep one (the training data of autoplan run)"
            )
        if isinstance(self.dataset, IterableDataset) or not hasattr(type(self.dataset), "__len__"):
            raise PlanError(
                f"Workload.dataset is a {type(self.dataset).__name__}; autoplan run reads step k's rows by index: "
                "give a map-style torch Dataset (__getitem__ and __len__, e.g. TensorDataset) or use batches="
            )
