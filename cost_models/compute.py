"""Compute cost: FLOPs and bytes per aten op, and a roofline time estimate.

Formulas are registered per op family (one small function each), so adding an op never touches
the solver::

    mm(M,K)x(K,N)      flops = 2*M*K*N                     (one multiply + one add per MAC)
    addmm              flops = 2*M*K*N + M*N
    bmm(B,M,K)x(B,K,N) flops = 2*B*M*K*N
    anything else      flops = numel(output)               (elementwise-like; memory bound)

    bytes  = sum(bytes of tensor inputs) + sum(bytes of tensor outputs)
    time_s = max(flops / (peak_flops * MATMUL_EFFICIENCY), bytes / (mem_bw * MEMORY_EFFICIENCY))
             + kernel overhead

The efficiencies are deliberately simple, shape-independent constants here; measured
(profiled) times replace them where a profile exists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from math import prod

import torch

from cost_models.hardware import DeviceSpec

aten = torch.ops.aten

MATMUL_EFFICIENCY = 0.7
"""Fraction of peak FLOP/s a large, well-shaped matmul reaches (typical cuBLAS/oneDNN)."""
MEMORY_EFFICIENCY = 0.8
"""Fraction of peak memory bandwidth a streaming kernel reaches."""
GPU_KERNEL_OVERHEAD_US = 4.0
"""Launch + tail latency of one GPU kernel, order of magnitude from CUDA launch benchmarks."""
CPU_OP_OVERHEAD_US = 10.0
"""Per-op dispatch overhead of eager PyTorch on CPU (DTensor dispatch adds more)."""

FlopFn = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], float]
_FLOP_REGISTRY: dict[object, FlopFn] = {}


def register_flops(*ops: object) -> Callable[[FlopFn], FlopFn]:
    def deco(fn: FlopFn) -> FlopFn:
        for op in ops:
            _FLOP_REGISTRY[op] = fn
        return fn

    return deco


@register_flops(aten.mm.default)
def _mm_flops(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> float:
    (m, k), n = inputs[0].shape, inputs[1].shape[1]
    return 2.0 * m * k * n


@register_flops(aten.addmm.default)
def _addmm_flops(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> float:
    (m, k), n = inputs[1].shape, inputs[2].shape[1]
    return 2.0 * m * k * n + m * n


@register_flops(aten.bmm.default)
def _bmm_flops(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> float:
    b, m, k = inputs[0].shape
    n = inputs[1].shape[2]
    return 2.0 * b * m * k * n


def is_matmul(op: object) -> bool:
    return op in _FLOP_REGISTRY


def op_flops(op: object, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> float:
    fn = _FLOP_REGISTRY.get(op)
    if fn is not None:
        return fn(inputs, outputs)
    return float(sum(t.numel() for t in outputs))


def tensor_bytes(t: torch.Tensor) -> int:
    return prod(t.shape) * t.element_size()


def op_bytes(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> float:
    return float(sum(tensor_bytes(t) for t in inputs) + sum(tensor_bytes(t) for t in outputs))


def op_overhead_s(device: DeviceSpec) -> float:
    return (CPU_OP_OVERHEAD_US if device.name == "CPU" else GPU_KERNEL_OVERHEAD_US) * 1e-6


def roofline_time_s(
    op: object,
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    device: DeviceSpec,
    *,
    work_divisor: int = 1,
) -> float:
    """Estimated time of ``op`` on ``device`` when its work is split ``work_divisor`` ways."""
    dtype = outputs[0].dtype if outputs else torch.float32
    flops = op_flops(op, inputs, outputs) / work_divisor
    nbytes = op_bytes(inputs, outputs) / work_divisor
    compute_s = flops / (device.peak_flops_for(dtype) * (MATMUL_EFFICIENCY if is_matmul(op) else 1.0))
    memory_s = nbytes / (device.mem_bw_GBps * 1e9 * MEMORY_EFFICIENCY)
    return max(compute_s, memory_s) + op_overhead_s(device)
