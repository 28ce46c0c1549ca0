"""Memory per device: parameters, gradients, optimizer state and saved activations.

One model of the bytes a parameter element costs, used by every memory estimate (the
per-operator ILP and its plan, the joint search, ``autoplan.estimate`` and the review tools that
print them). By optimizer and training precision (Rajbhandari et al., "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", SC 2020, section 3.1)::

    weights    = w                                 w = 4 (fp32), 2 (bf16, fp16)
    gradients  = w                                 (gradients live in the parameter's layout)
    optimizer  = 4 * states(optimizer) + master    fp32 states: adam, adamw 2 (exp_avg, exp_avg_sq),
                                                   sgd_momentum 1 (momentum_buffer), sgd 0;
                                                   master = 4 (fp32 copy) when w < 4, else 0

so fp32 Adam costs 4 + 4 + 8 bytes, mixed-precision Adam 2 + 2 + 12 (the paper's K = 12), fp32
SGD 4 + 4 + 0. A frozen parameter (``requires_grad=False``) is never updated: weights only.

Activations saved for backward are forward values read by the backward; each costs its local
bytes (elements x item size, :func:`tensor_bytes` at full size; ``P`` keeps a full-size buffer).
Two measures use these rules: the per-operator peak of the ILP and its plan
(:mod:`autoplan.passes.liveness` times the values' lifetimes) and the per-stage memory of the
joint search and ``autoplan.estimate`` (:func:`stage_memory_parts`, summed per pipeline rank by
:mod:`autoplan.cost_models.step`).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # annotations only: this module stays torch-free (plan review tools load it)
    import torch

OptimizerName = Literal["adam", "adamw", "sgd", "sgd_momentum"]

OPTIMIZER_STATES: dict[str, int] = {
    "adam": 2,  # exp_avg, exp_avg_sq
    "adamw": 2,
    "sgd_momentum": 1,  # momentum_buffer
    "sgd": 0,
}
"""fp32 tensors of the parameter's shape the optimizer keeps (``torch.optim`` state)."""

STATE_ITEMSIZE = 4
"""Bytes per element of an optimizer state and of the master copy (fp32)."""

PRECISION_ITEMSIZE: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of weights and gradients by training precision (bf16, fp16: mixed precision)."""

OPTIMIZERS: tuple[str, ...] = tuple(OPTIMIZER_STATES)
"""Optimizer names the memory and time model knows."""


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a full-size (unsharded) tensor: its elements times its dtype's item size, the rule
    every activation and transfer byte count uses (:mod:`autoplan.passes.liveness`, the
    communication edges of :mod:`autoplan.passes.costing`, :mod:`autoplan.cost_models.compute`)."""
    return prod(t.shape) * t.element_size()


@dataclass(frozen=True, slots=True)
class ElementBytes:
    """Bytes one parameter element costs for its weights, gradient and optimizer state."""

    weights: int
    grads: int
    optimizer: int

    def __str__(self) -> str:
        return f"{self.weights}+{self.grads}+{self.optimizer} B"


def element_bytes(optimizer: str, itemsize: int, *, trainable: bool = True) -> ElementBytes:
    """The module docstring's formula for a parameter stored with ``itemsize`` bytes per element."""
    if not trainable:
        return ElementBytes(weights=itemsize, grads=0, optimizer=0)
    master = STATE_ITEMSIZE if itemsize < STATE_ITEMSIZE else 0
    return ElementBytes(
        weights=itemsize, grads=itemsize, optimizer=STATE_ITEMSIZE * OPTIMIZER_STATES[optimizer] + master
    )


def precision_bytes(optimizer: str, precision: str) -> ElementBytes:
    """:func:`element_bytes` of a parameter trained in ``precision`` (``fp32``, ``bf16``, ``fp16``)."""
    return element_bytes(optimizer, PRECISION_ITEMSIZE[precision])


OPTIMIZER_STATE_BYTES_PER_ELEMENT: dict[str, int] = {name: element_bytes(name, 4).optimizer for name in OPTIMIZERS}
"""Optimizer state of one fp32 parameter element: adam 8, adamw 8, sgd_momentum 4, sgd 0."""

OPTIMIZER_STEP_BYTES_PER_ELEMENT: dict[str, int] = {
    # bytes read + written per element by one fp32 optimizer step: param r/w, grad r, states r/w
    name: 4 * 2 + 4 + OPTIMIZER_STATE_BYTES_PER_ELEMENT[name] * 2
    for name in OPTIMIZERS
}


def param_training_bytes_by_part(
    numel: int, itemsize: int, optimizer: str, *, trainable: bool = True
) -> dict[str, int]:
    """Bytes of ``numel`` parameter elements split into ``params``, ``grads`` and ``optimizer``
    (:func:`element_bytes`; a frozen parameter, ``trainable=False``, has weights only)."""
    b = element_bytes(optimizer, itemsize, trainable=trainable)
    return {"params": numel * b.weights, "grads": numel * b.grads, "optimizer": numel * b.optimizer}


def param_training_bytes(numel: int, itemsize: int, optimizer: str) -> int:
    """Bytes of one (unsharded) trainable parameter with its gradient and optimizer state."""
    return sum(param_training_bytes_by_part(numel, itemsize, optimizer).values())


def stage_memory_parts(
    *,
    param_numel: int,
    trainable_numel: int,
    largest_segment_numel: int,
    element: ElementBytes,
    zero_stage: int,
    dp: int,
    saved_bytes: float,
    inflight: int,
    transient_bytes: float,
) -> dict[str, float]:
    """Bytes per device of one pipeline stage (:mod:`autoplan.cost_models.step`), by part::

        weights     = P w     / dp if zero_stage >= 3         P parameter elements, T trainable;
        grads       = T g     / dp if zero_stage >= 2         w, g, o: ``element`` (bytes per
        optimizer   = T o     / dp if zero_stage >= 1         element, :func:`precision_bytes`)
        activations = inflight * saved_bytes                  (micro-batches in flight x A_k)
        transient   = transient_bytes + (2 P_max w if zero_stage >= 3)

    ``transient_bytes`` is what recomputing one segment allocates; ZeRO-3 adds twice the
    all-gathered parameters of the largest segment (``largest_segment_numel`` = P_max)."""
    w, g, o = (
        float(param_numel * element.weights),
        float(trainable_numel * element.grads),
        float(trainable_numel * element.optimizer),
    )
    o = o / dp if zero_stage >= 1 else o
    g = g / dp if zero_stage >= 2 else g
    gather = 0.0
    if zero_stage >= 3:
        w = w / dp
        gather = 2 * largest_segment_numel * element.weights
    return {
        "weights": w,
        "grads": g,
        "optimizer": o,
        "activations": inflight * saved_bytes,
        "transient": transient_bytes + gather,
    }


def optimizer_temp_bytes(optimizer: str, max_param_bytes: float, total_param_bytes: float, device_kind: str) -> float:
    """Temporary bytes one optimizer step allocates on top of parameters, gradients and states.

    The runtime builds every optimizer with ``foreach=True`` on every device
    (``autoplan.runtime.optimizers.make_torch_optimizer``), so the step runs torch's multi-tensor
    kernels, which materialise whole lists of intermediates: one tensor per parameter of a
    (device, dtype) group, all alive at once. In ``torch.optim.adam._multi_tensor_adam`` (torch
    2.13, default arguments: not capturable, no amsgrad, a float beta2) the only list allocated is
    ``exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)``, then divided and offset in place and
    consumed by ``_foreach_addcdiv_`` (one parameter-sized temporary per parameter: the group's
    parameter bytes). Adam's coupled weight decay (``_foreach_add(grads, params)``) allocates a
    list of the same size, deleted (``del device_grads``) before the square root, so the two never
    coexist; AdamW decays in place. ``_multi_tensor_sgd`` updates in place (momentum buffers are
    state). One dtype group holds every trained parameter; with several groups a list outlives
    its group by one ``_foreach_sqrt`` call, bounded by the total::

        adam, adamw   total_param_bytes   (the single-tensor loop, foreach=False, kept 2 * max_param_bytes)
        sgd*          0

    ``max_param_bytes`` and ``device_kind`` are what the single-tensor loop's price depended on;
    both paths are priced alike on CPU and CUDA now.
    """
    del max_param_bytes, device_kind  # the foreach price depends on neither (docstring)
    if optimizer in ("adam", "adamw"):
        return float(total_param_bytes)
    return 0.0
