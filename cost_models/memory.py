"""Memory per device: parameters, gradients, optimizer state and saved activations.

Bytes per parameter element on one device, for a parameter stored with ``storage_factor`` shards
(Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
SC 2020, section 3.1; fp32 training, so no separate master copy)::

    param  = itemsize                       (4 for fp32)
    grad   = itemsize                       (gradients live in the parameter's layout)
    adam   = 2 * 4                          (exp_avg and exp_avg_sq, fp32)
    sgd    = 4 with momentum, 0 without

Activations saved for backward are forward values read by the backward; each costs its local
bytes (``P`` keeps a full-size buffer). This issue's model sums them (an upper bound of the
peak); lifetimes and the exact peak are the memory model's next step.
"""

from __future__ import annotations

from typing import Literal

OptimizerName = Literal["adam", "adamw", "sgd", "sgd_momentum"]

OPTIMIZER_STATE_BYTES_PER_ELEMENT: dict[str, int] = {
    "adam": 8,  # exp_avg + exp_avg_sq in fp32
    "adamw": 8,
    "sgd_momentum": 4,  # momentum buffer
    "sgd": 0,
}

OPTIMIZER_STEP_BYTES_PER_ELEMENT: dict[str, int] = {
    # bytes read + written per element by one optimizer step (fp32): param r/w, grad r, states r/w
    "adam": 4 * 2 + 4 + 8 * 2,
    "adamw": 4 * 2 + 4 + 8 * 2,
    "sgd_momentum": 4 * 2 + 4 + 4 * 2,
    "sgd": 4 * 2 + 4,
}


OPTIMIZERS: tuple[str, ...] = tuple(OPTIMIZER_STATE_BYTES_PER_ELEMENT)
"""Optimizer names the memory and time model knows."""


def param_training_bytes_by_part(numel: int, itemsize: int, optimizer: str) -> dict[str, int]:
    """Bytes of ``numel`` parameter elements split into ``params``, ``grads`` and ``optimizer``."""
    return {
        "params": numel * itemsize,
        "grads": numel * itemsize,
        "optimizer": numel * OPTIMIZER_STATE_BYTES_PER_ELEMENT[optimizer],
    }


def param_training_bytes(numel: int, itemsize: int, optimizer: str) -> int:
    """Bytes of one (unsharded) parameter with its gradient and optimizer state."""
    return sum(param_training_bytes_by_part(numel, itemsize, optimizer).values())


def optimizer_temp_bytes(optimizer: str, max_param_bytes: float, total_param_bytes: float, device_kind: str) -> float:
    """Temporary bytes one optimizer step allocates on top of parameters, gradients and states.

    ``torch.optim`` uses its single-tensor loop on CPU and the foreach (multi-tensor) kernels on
    CUDA (``torch.optim.optimizer._default_to_fused_or_foreach``). Adam's step computes
    ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)``: single-tensor, the
    ``sqrt`` and the division's result briefly coexist (two temporaries of the parameter's size);
    foreach, ``_foreach_sqrt`` allocates one per parameter, all at once, then divides in place.
    SGD with or without momentum updates in place::

        adam, adamw   single-tensor: 2 * max_param_bytes      foreach: total_param_bytes
        sgd*          0
    """
    if optimizer in ("adam", "adamw"):
        return float(total_param_bytes if device_kind == "cuda" else 2 * max_param_bytes)
    return 0.0
