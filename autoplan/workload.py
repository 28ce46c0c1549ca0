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
    dataset: Dataset[Any] | IterableDataset[Any] | None = None
    """Optional dataset of ``(*inputs, *targets)`` samples (each shaped like one row of the example
    batch) that ``autoplan run`` trains from instead of ``batches``, in passes (a partial last
    batch of a pass is dropped): a map-style ``Dataset`` (``__getitem__`` and ``__len__``) gives
    step ``k`` of a pass the rows ``order[k*B : (k+1)*B]``, ``B`` the example batch's size and
    ``order`` the indices in order or, with :attr:`shuffle`, reshuffled every pass; an
    ``IterableDataset`` gives it the next ``B`` samples of its stream, read again from the start
    for the next pass (told the pass by its ``set_epoch(epoch)`` method, if it has one). Each rank
    keeps only the rows its program reads (:meth:`~autoplan.runtime.parallel.ParallelModel.data_loader`)."""
    shuffle: bool = False
    """``autoplan run`` reshuffles a map-style :attr:`dataset` every pass (the same order on every
    rank, seeded by ``--data-seed``, default ``--seed``); ``--shuffle``/``--no-shuffle`` override it."""

    def __post_init__(self) -> None:
        if self.dataset is None:
            if self.shuffle:
                raise PlanError("Workload(shuffle=True) reorders Workload.dataset, which is not set: give dataset=")
            return
        if self.batches is not None:
            raise PlanError(
                "the Workload sets both batches= and dataset=: keep one (the training data of autoplan run)"
            )
        if isinstance(self.dataset, IterableDataset):
            if self.shuffle:
                raise PlanError(
                    f"Workload(shuffle=True) reorders a map-style dataset by index; {type(self.dataset).__name__} is an "
                    "IterableDataset: shuffle its stream itself (its set_epoch(epoch) is called every pass) or drop shuffle"
                )
            return
        if not hasattr(type(self.dataset), "__len__"):
            raise PlanError(
                f"Workload.dataset is a {type(self.dataset).__name__}; autoplan run reads a map-style dataset by index: "
                "give a torch Dataset with __getitem__ and __len__ (e.g. TensorDataset), an IterableDataset, or batches="
            )
