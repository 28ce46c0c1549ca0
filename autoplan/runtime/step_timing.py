"""Measure a planned training step for real: step time and peak live tensor bytes per rank.

Used to check the cost model against the hardware (``benchmarks/cost_model_accuracy.py``, the
memory tests). Memory is counted at the tensor level, not from process RSS: a
:class:`LiveTensorBytes` dispatch mode sees every op the step runs (DTensor ops, and the local
collectives inside ``redistribute``), follows the storage of every tensor they return and
releases it when the last tensor object on that storage dies. The peak is the bytes of the
persistent state (parameters, optimizer state, buffers) plus the largest amount of new storage
alive at once.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autoplan.runtime.parallel import ParallelModel


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding the data: a DTensor's local shard, a functional collective's
    result (``AsyncCollectiveTensor.elem``), or ``t`` itself."""
    while True:
        if isinstance(t, DTensor):
            t = t._local_tensor  # noqa: SLF001
        elif type(t) is not torch.Tensor and isinstance(getattr(t, "elem", None), torch.Tensor):
            t = t.elem  # type: ignore[attr-defined]
        else:
            return t


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    """(data pointer, bytes) of the storage behind ``t``; (0, 0) for tensors without one."""
    try:
        storage = _local(t).untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return 0, 0


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (local shards of DTensors)."""
    seen: dict[int, int] = {}
    for t in tensors:
        ptr, nbytes = _storage_key(t)
        seen[ptr] = max(seen.get(ptr, 0), nbytes)
    return sum(seen.values())


class LiveTensorBytes(TorchDispatchMode):
    """Tracks the bytes of storages created while active (see the module docstring).

    Storages of ``known`` tensors (the persistent state, the caller's inputs) are never counted.
    """

    def __init__(self, known: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._known = {_storage_key(t)[0] for t in known}
        self._refs: dict[int, list[int]] = {}  # data_ptr -> [nbytes, live tensor objects]
        self.current_bytes = 0
        self.peak_bytes = 0

    def _release(self, ptr: int) -> None:
        entry = self._refs.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current_bytes -= entry[0]
            del self._refs[ptr]

    def _track(self, t: torch.Tensor) -> None:
        local = _local(t)
        ptr, nbytes = _storage_key(local)
        if ptr == 0 or ptr in self._known:
            return
        entry = self._refs.get(ptr)
        if entry is None:
            entry = self._refs[ptr] = [nbytes, 0]
            self.current_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        entry[1] += 1
        weakref.finalize(local, self._release, ptr)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class StepMeasurement:
    """One rank's measurement of a training step (forward, backward and optimizer step)."""

    step_time_s: float
    """Median wall time of a step over the timed steps (ranks synchronised after each step)."""
    step_times_s: tuple[float, ...]
    peak_bytes: int
    """Persistent state plus the peak of new live storage during one step."""
    persistent_bytes: int
    """Parameters, optimizer state and buffers (local shards)."""


def _optimizer_state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def measure_training_step(
    pm: ParallelModel,
    opt: torch.optim.Optimizer,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor] = (),
    *,
    warmup: int = 2,
    steps: int = 5,
) -> StepMeasurement:
    """Time ``steps`` training steps after ``warmup`` (which also creates the optimizer state),
    then run one more step under :class:`LiveTensorBytes`. Call on every rank."""

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        pm.forward_backward(*inputs, targets=targets)
        opt.step()

    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    opt.zero_grad(set_to_none=True)
    state = [p.detach() for p in pm.parameters()] + _optimizer_state(opt) + list(pm.sharded_buffers())
    persistent = storage_bytes(state)
    with LiveTensorBytes(known=[*state, *inputs, *targets]) as tracker:
        pm.forward_backward(*inputs, targets=targets)
        opt.step()
    return StepMeasurement(
        step_time_s=statistics.median(times),
        step_times_s=tuple(times),
        peak_bytes=persistent + tracker.peak_bytes,
        persistent_bytes=persistent,
    )
