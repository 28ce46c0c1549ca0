"""What the CLI plans and runs: a model with its example batch and loss.

A *build function* (``my_models.py:build``) returns a :class:`Workload`. It is called on the
``meta`` device to plan (no weights allocated) and on the real device, with the same seed on
every rank, to run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


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
