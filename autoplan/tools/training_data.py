"""What ``autoplan run`` trains on, step by step (the ranks, ``autoplan/tools/worker.py``), and the
checks of its data options (before launch too, ``autoplan/tools/run.py``).

Step ``k`` (counted from 0 over the whole run) is, by the workload's data:

* ``Workload.dataset``, map-style (``B`` the global batch, ``n = len(dataset) // B`` steps per
  pass): pass ``p = k // n``, its rows ``order_p[(k % n) * B : (k % n + 1) * B]``, ``order_p`` the
  indices in order or, shuffled, ``randperm(len(dataset), seed=data_seed + p)``
  (:class:`~autoplan.runtime.data.ShardedLoader` with ``set_epoch(p)``);
* ``Workload.dataset``, an ``IterableDataset``: the next ``B`` samples of the stream, which is
  read again from its start (``set_epoch(p)`` first, if it has that method) when a pass ends;
* no dataset: ``Workload.batches(k)``, or the example batch.

Each rank materialises only its rows of a dataset's step; ``--compare`` gets the same step's whole
global batch for the single-device model from the same read of the data.

Bad data (a sample of another shape or dtype than the plan's, an exception from the dataset or
its stream) is a :class:`PlanError` of the loader naming the sample; only the ranks that read
that sample see it, so with a dataset the ranks agree on every step before training on it (one
1-element all-reduce over gloo per step): a rank's error is raised on every rank, and
``autoplan run`` prints one line and exits 2 instead of the other ranks failing in a collective.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

from autoplan.cost_models.errors import PlanError
from autoplan.runtime.checkpoint import ParallelizedModel
from autoplan.runtime.data import LocalBatch, ShardedLoader
from autoplan.workload import Workload

Batch = tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]
"""A global batch: ``(inputs, targets)``."""
Step = tuple[int, LocalBatch | None, Batch | None]
"""``(k, local, batch)``: :meth:`TrainingData.steps`."""


def data_options(wl: Workload, *, shuffle: bool | None, data_seed: int | None, seed: int) -> tuple[bool, int]:
    """``--shuffle``/``--no-shuffle`` (``None``: the workload's :attr:`~Workload.shuffle`) and
    ``--data-seed`` (``None``: ``--seed``) -> ``(shuffle, data seed)``, or :class:`PlanError`
    naming the fix."""
    shuffled = wl.shuffle if shuffle is None else shuffle
    if shuffled and wl.dataset is None:
        raise PlanError(
            "--shuffle reorders Workload.dataset, and the workload has none (it trains on its example batch or "
            "batches=): give the Workload a dataset= or drop --shuffle"
        )
    if shuffled and isinstance(wl.dataset, IterableDataset):
        raise PlanError(
            f"--shuffle reorders a map-style dataset by index; Workload.dataset is a {type(wl.dataset).__name__}, an "
            "IterableDataset: shuffle its stream itself (its set_epoch(epoch) is called every pass) or drop --shuffle"
        )
    if data_seed is not None and not shuffled:
        raise PlanError(
            "--data-seed seeds the shuffled order, but the data is not shuffled: add --shuffle (or "
            "Workload(shuffle=True)) or drop --data-seed"
        )
    return shuffled, seed if data_seed is None else data_seed


class TrainingData:
    """The steps of one run (module docstring) for this rank of ``pm``; ``compare``: each step's
    global batch too (the single-device model of ``--compare``)."""

    def __init__(self, wl: Workload, pm: ParallelizedModel, *, shuffle: bool, data_seed: int, compare: bool) -> None:
        self.wl = wl
        self.compare = compare
        self.shuffle = shuffle
        self.data_seed = data_seed
        self.loader: ShardedLoader | None = None
        if wl.dataset is not None:
            self.loader = pm.data_loader(wl.dataset, shuffle=shuffle, seed=data_seed)

    def describe(self) -> str:
        """One line for the log: the dataset, the steps per pass, and what rank 0 keeps of a step."""
        loader = self.loader
        assert loader is not None, "describe() tells about Workload.dataset"
        size = loader.layout.global_batch_size
        if loader.is_stream:
            what = f"data: a stream ({type(loader.dataset).__name__}), {size} samples per step, read again each pass"
        else:
            what = f"data: {len(loader.dataset)} samples, {len(loader)} steps per pass"  # type: ignore[arg-type]
            if self.shuffle:
                what += f", reshuffled each pass (data seed {self.data_seed})"
        return f"{what}; rank 0 loads {len(loader.layout.rows(0))} of {size} rows of input 0 per step"

    def steps(self, start: int = 0) -> Iterator[Step]:
        """``(k, local, batch)`` for the steps ``k`` of the run in order: ``local`` this rank's
        rows of a dataset's step (``None`` before ``start``, and without a dataset), ``batch``
        the global batch (without a dataset always; with one under ``compare`` only). Steps
        before ``start`` (a resumed run) come only when the single-device model must catch up
        (``compare``) or a stream must be read through to ``start``."""
        if self.loader is None:
            for k in itertools.count(0 if self.compare else start):
                yield k, None, self._batch(k)
        elif not self.loader.is_stream:
            yield from _agreed(self._indexed_steps(self.loader, start))
        else:
            yield from _agreed(self._stream_steps(self.loader, start))

    def _batch(self, k: int) -> Batch:
        wl = self.wl
        return (wl.example_inputs, wl.example_targets) if wl.batches is None else wl.batches(k)

    def _indexed_steps(self, loader: ShardedLoader, start: int) -> Iterator[Step]:
        per_pass = len(loader)
        for k in itertools.count(0 if self.compare else start):
            loader.set_epoch(k // per_pass)
            local = loader.batch(k % per_pass) if k >= start else None
            yield k, local, loader.global_batch(k % per_pass) if self.compare else None

    def _stream_steps(self, loader: ShardedLoader, start: int) -> Iterator[Step]:
        k = 0
        for epoch in itertools.count():
            loader.set_epoch(epoch)
            passes = loader.with_global_batches() if self.compare else ((b, None) for b in loader)
            for local, batch in passes:
                yield k, local if k >= start else None, batch
                k += 1


def _agreed(steps: Iterator[Step]) -> Iterator[Step]:
    """``steps`` once every rank of the job has loaded each: a :class:`PlanError` loading a step
    on one rank (the ranks that read a bad sample) is raised on every rank: a rank that failed
    raises its own, the others the lowest failing rank's (its type and message) (module docstring). Outside a job of several ranks: ``steps``."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield from steps
        return
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    """A CPU flag per step: no device synchronisation on a CUDA job."""
    while True:
        error: PlanError | None = None
        try:
            item = next(steps)
        except StopIteration:
            return
        except PlanError as exc:
            error = exc
        failed = torch.tensor([0 if error is None else 1])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
        if failed.item():
            errors: list[tuple[type[PlanError], str] | None] = [None] * dist.get_world_size(group)
            dist.all_gather_object(errors, None if error is None else (type(error), str(error)), group=group)
            if error is not None:
                raise error
            kind, message = next(e for e in errors if e is not None)
            raise kind(message)
        yield item
