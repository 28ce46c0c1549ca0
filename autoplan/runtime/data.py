"""Sharded data loading: each rank materialises only the samples its program reads.

The steps (``DistributedSampler``'s rule, computed alike on every rank)::

    order  = randperm(len(dataset), seed + epoch) if shuffle else arange(len(dataset))
    step k = dataset[order[k*B : (k+1)*B]]          B = global batch size; a partial last batch is dropped

The rows a rank keeps of step ``k`` are, per field (the model inputs, then the loss targets), what
:func:`~autoplan.runtime.lowering.local_shard` keeps of the global batch for the field's planned
placement: dim 0 is split by the mesh axes whose placement is ``S(0)``, in axis order, as DTensor
splits it (``torch.chunk``: chunks of ``ceil(n / k)`` rows, the last ones shorter or empty); an
axis placing the field ``R`` or ``S(d)`` with ``d > 0`` keeps the same rows (tensor-parallel peers
load the same samples). ``S(d)`` with ``d > 0`` is cut after collation, as ``local_shard`` cuts it.

Pipelines (``M`` micro-batches of ``mb = B / M`` rows): the schedule cuts the batch into
micro-batches and each stage keeps its shard of each, so a rank keeps the rows ``m * mb + r`` for
``m`` in ``0..M-1`` and ``r`` in its shard of ``mb`` rows; their concatenation is what the schedule
splits into the ``M`` local micro-batches. Only the first stage reads the model inputs and only
the last stage the loss targets (:mod:`autoplan.runtime.pipeline` hands them to the schedule's
``target=``), so first-stage ranks load the inputs, last-stage ranks the targets (a rank holding
both stages both), and the ranks of the stages between load nothing. A rank reads whole samples
of its rows from the dataset and keeps the fields it reads.

An ``IterableDataset`` is read whole by every rank (so all ranks agree on the number of steps);
each keeps, of every ``B`` consecutive samples, the rows above and collates only those. Shuffle
such a stream in the stream itself: one with a ``set_epoch(epoch)`` method (Hugging Face
``datasets``, WebDataset) is told the loader's epoch before each pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.utils.data import Dataset, IterableDataset, default_collate

from autoplan.cost_models.echo import clip_text
from autoplan.cost_models.errors import PlanError, PlanMismatchError
from autoplan.passes.placement import spec_str

Spec = tuple[Placement, ...]


def _rows_kept(num_rows: int, spec: Spec | None, mesh_shape: Sequence[int], coordinate: Sequence[int]) -> range:
    """The rows of a dim 0 of ``num_rows`` this mesh coordinate keeps: DTensor's split over the
    axes placing dim 0 ``S(0)`` (every other axis keeps them all)."""
    if spec is None:
        return range(num_rows)
    dim0: list[Placement] = [p if isinstance(p, Shard) and p.dim == 0 else Replicate() for p in spec]
    (size,), (start,) = _compute_local_shape_and_global_offset((num_rows,), tuple(mesh_shape), list(coordinate), dim0)
    return range(start, start + size)


def check_global_batch_size(planned: int, given: int | None) -> int:
    """The global batch a loader yields: the one the program was traced with (``given`` must
    equal it), or :class:`PlanError`."""
    if given is not None and given != planned:
        raise PlanError(
            f"global_batch_size={given}, but the plan's program was traced for a global batch of {planned} "
            f"samples: pass global_batch_size={planned} or re-plan with a batch of {given}"
        )
    return planned


def _quote(exc: BaseException) -> str:
    """``Type: first line of the message`` of an exception raised by user code (bounded)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {clip_text(lines[0])}" if lines else type(exc).__name__


def _field_name(i: int, num_inputs: int) -> str:
    return f"input {i}" if i < num_inputs else f"target {i - num_inputs}"


FieldSpec = tuple[tuple[int, ...], torch.dtype]
"""A batch field as planned: its shape and dtype."""


def batch_mismatch(
    planned: Sequence[FieldSpec], given: Sequence[torch.Tensor], *, num_inputs: int, shapes: bool = True
) -> str | None:
    """``None`` when every field of ``given`` has its ``planned`` shape (``shapes=False``: any
    shape) and dtype; else what differs, for the first field that does (with what fewer rows
    usually are; the fix is the caller's words). One tuple comparison per field: cheap enough for
    every step."""
    for i, (t, (shape, dtype)) in enumerate(zip(given, planned, strict=False)):
        if shapes and tuple(t.shape) != shape:
            fewer = t.dim() == len(shape) > 0 and t.shape[0] < shape[0] and tuple(t.shape[1:]) == shape[1:]
            hint = " (fewer samples: an epoch's last partial batch? DataLoader(drop_last=True) leaves it out)" if fewer else ""
            return f"{_field_name(i, num_inputs)} has shape {list(t.shape)}; the plan was made for {list(shape)}{hint}"
        if t.dtype != dtype:
            return f"{_field_name(i, num_inputs)} is {t.dtype}; the plan was made for {dtype}"
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchLayout:
    """What one rank's program reads of each global batch: the fields' placements on the mesh
    they are planned on and this rank's coordinate there."""

    global_batch_size: int
    """Samples per step (``B``)."""
    num_microbatches: int = 1
    """Micro-batches the (pipeline) schedule cuts the batch into; 1 for a ``ParallelModel``."""
    mesh_shape: tuple[int, ...]
    """The mesh the specs are on (a pipeline's stage mesh)."""
    coordinate: tuple[int, ...]
    """This rank's coordinate on that mesh."""
    specs: tuple[Spec | None, ...]
    """One placement per mesh axis for each field, the inputs then the targets (``None``: the
    same full tensor on every rank)."""
    num_inputs: int
    """How many of ``specs`` are model inputs (the rest are loss targets)."""
    sample_shapes: tuple[tuple[int, ...], ...]
    """The planned shape of one sample of each field (the field's shape without dim 0)."""
    reads_inputs: bool = True
    """False on pipeline ranks without the first stage: they keep no model input."""
    reads_targets: bool = True
    """False on pipeline ranks without the last stage: they keep no loss target."""

    def __post_init__(self) -> None:
        if self.global_batch_size < 1 or self.global_batch_size % self.num_microbatches:
            raise PlanError(
                f"global batch of {self.global_batch_size} samples does not split into "
                f"{self.num_microbatches} micro-batches: use a multiple of {self.num_microbatches}"
            )
        if len(self.sample_shapes) != len(self.specs) or not 0 <= self.num_inputs <= len(self.specs):
            raise PlanError(
                f"{len(self.specs)} field specs, {len(self.sample_shapes)} sample shapes, {self.num_inputs} inputs"
            )
        for i, spec in enumerate(self.specs):
            if spec is None:
                continue
            if len(spec) != len(self.mesh_shape) or not all(type(p) in (Shard, Replicate) for p in spec):
                raise PlanError(
                    f"{self.field_name(i)} is placed {spec_str(spec)} on a mesh of shape {self.mesh_shape}: the "
                    "sharded loader handles one R or S(d) per mesh axis; feed global batches to forward_backward"
                )

    def field_name(self, i: int) -> str:
        return _field_name(i, self.num_inputs)

    @property
    def num_fields(self) -> int:
        return len(self.specs)

    @property
    def num_targets(self) -> int:
        return len(self.specs) - self.num_inputs

    def reads(self, i: int) -> bool:
        """Whether this rank's program reads field ``i`` (pipelines: inputs on the first stage,
        targets on the last)."""
        return self.reads_inputs if i < self.num_inputs else self.reads_targets

    def rows(self, i: int) -> tuple[int, ...]:
        """Positions in the global batch of the rows of field ``i`` this rank materialises, in the
        order the program reads them (empty when it does not read the field)."""
        if not self.reads(i):
            return ()
        mb = self.global_batch_size // self.num_microbatches
        kept = _rows_kept(mb, self.specs[i], self.mesh_shape, self.coordinate)
        return tuple(m * mb + r for m in range(self.num_microbatches) for r in kept)

    def cut_sample_dims(self, i: int, rows: torch.Tensor) -> torch.Tensor:
        """Field ``i``'s collated rows cut along its ``S(d)``, ``d > 0``, placements (as
        ``local_shard`` cuts the global batch)."""
        spec = self.specs[i]
        if spec is None or not any(isinstance(p, Shard) and p.dim > 0 for p in spec):
            return rows
        mb = self.global_batch_size // self.num_microbatches
        shape, offset = _compute_local_shape_and_global_offset(
            (mb, *rows.shape[1:]), self.mesh_shape, list(self.coordinate), list(spec)
        )
        for dim in range(1, rows.ndim):
            if shape[dim] != rows.shape[dim]:
                rows = rows.narrow(dim, offset[dim], shape[dim])
        return rows.contiguous()


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalBatch:
    """One step's batch as this rank's program reads it: ``forward_backward(batch)`` runs on it
    without cutting it again."""

    inputs: tuple[torch.Tensor, ...]
    """This rank's rows of each model input (``()`` on a pipeline rank without the first stage)."""
    targets: tuple[torch.Tensor, ...]
    """This rank's rows of each loss target (``()`` on a pipeline rank without the last stage)."""
    global_batch_size: int
    step: int
    """Step within the epoch (0-based)."""
    sample_indices: tuple[tuple[int, ...], ...] = field(repr=False)
    """Per field (every field of the layout, read or not), the dataset index (an
    ``IterableDataset``: the stream position) of each row (``()`` for a field this rank does not read)."""

    def __str__(self) -> str:
        shapes = ", ".join(str(list(t.shape)) for t in (*self.inputs, *self.targets)) or "nothing"
        return f"LocalBatch(step {self.step}, {shapes} of {self.global_batch_size})"

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors this rank materialised."""
        return sum(t.numel() * t.element_size() for t in (*self.inputs, *self.targets))


class ShardedLoader:
    """Yields one :class:`LocalBatch` per step from a map-style ``Dataset`` or an
    ``IterableDataset`` (the module docstring gives the order and the rows). ``collate_fn`` turns
    a list of samples into one batched tensor per field (default: ``default_collate``; a sample is
    a tuple ``(*inputs, *targets)`` or, with one field, a tensor)."""

    def __init__(
        self,
        dataset: Dataset[Any] | IterableDataset[Any],
        layout: BatchLayout,
        *,
        shuffle: bool = False,
        seed: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.dataset = dataset
        self.layout = layout
        self.shuffle = shuffle
        self.seed = seed
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self.device = torch.device(device)
        self.epoch = 0
        self._order: tuple[int, torch.Tensor] | None = None
        """``(epoch, order)`` of the last epoch :meth:`order` computed."""
        self._iterable = isinstance(dataset, IterableDataset)
        if self._iterable and shuffle:
            raise PlanError("shuffle=True needs a map-style Dataset: shuffle the IterableDataset's stream itself")
        if not self._iterable:
            num_samples = len(dataset)  # type: ignore[arg-type]
            if num_samples < layout.global_batch_size:
                raise PlanError(self._too_short(num_samples))
        fields = [layout.rows(i) for i in range(layout.num_fields)]
        self._union = tuple(sorted(set().union(*fields)))
        """Rows of the global batch this rank loads (every field's, once)."""
        if any(layout.reads(i) for i in range(layout.num_fields)) and not self._union:
            raise PlanError(
                f"this rank keeps no sample of a global batch of {layout.global_batch_size} "
                f"(mesh {layout.mesh_shape}): use a global batch of at least the data-parallel degree"
            )
        where = {r: k for k, r in enumerate(self._union)}
        self._picks = [None if rows == self._union else torch.tensor([where[r] for r in rows]) for rows in fields]
        """Per field, its rows' positions among :attr:`_union` (``None``: all, in order); a field
        this rank does not read is dropped (:meth:`_assemble`)."""

    def _too_short(self, num_samples: int) -> str:
        if self._iterable and self.epoch > 0:
            return (
                f"the IterableDataset yielded {num_samples} samples in pass {self.epoch + 1}; one step needs a "
                f"global batch of {self.layout.global_batch_size}: make its __iter__ start the stream again each time"
            )
        return (
            f"the dataset has {num_samples} samples; one step needs a global batch of "
            f"{self.layout.global_batch_size}: add samples or plan for a smaller global batch"
        )

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order :meth:`__iter__` yields (shuffled with ``seed + epoch``; an
        ``IterableDataset`` with a ``set_epoch`` method gets it before the pass)."""
        self.epoch = epoch

    @property
    def is_stream(self) -> bool:
        """An ``IterableDataset``: read in order, one pass per iteration, no length."""
        return self._iterable

    def __len__(self) -> int:
        """Steps per epoch (map-style datasets)."""
        if self._iterable:
            raise TypeError("an IterableDataset has no length: iterate the loader")
        return len(self.dataset) // self.layout.global_batch_size  # type: ignore[arg-type]

    def order(self) -> torch.Tensor:
        """This epoch's sample order (the same on every rank)."""
        if self._order is not None and self._order[0] == self.epoch:
            return self._order[1]
        num_samples = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            order = torch.arange(num_samples)
        else:
            order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        self._order = (self.epoch, order)
        return order

    def global_indices(self, step: int, order: torch.Tensor | None = None) -> list[int]:
        """The dataset indices of step ``step``'s whole global batch, in batch order (map-style
        datasets): ``order[step*B : (step+1)*B]``."""
        if self._iterable:
            raise PlanError("an IterableDataset is read in order: iterate the loader instead of calling batch(step)")
        if not 0 <= step < len(self):
            raise PlanError(f"step {step} is not one of this epoch's {len(self)} steps: use 0..{len(self) - 1}")
        order = self.order() if order is None else order
        base = step * self.layout.global_batch_size
        return [int(i) for i in order[base : base + self.layout.global_batch_size]]

    def batch(self, step: int, order: torch.Tensor | None = None) -> LocalBatch:
        """Step ``step`` of this epoch (map-style datasets)."""
        rows = self.global_indices(step, order)
        indices = [rows[r] for r in self._union]
        return self._assemble(step, indices, [self._sample(i) for i in indices])

    def global_batch(self, step: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Step ``step``'s whole global batch, collated, as ``(inputs, targets)``: what one device
        trains on where the ranks load :meth:`batch` (every rank reads every row: for checks)."""
        indices = self.global_indices(step)
        return self._split(self._collate(indices, [self._sample(i) for i in indices], every_field=True))

    def _split(self, collated: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        fields = self._fields(collated)
        return fields[: self.layout.num_inputs], fields[self.layout.num_inputs :]

    def __iter__(self) -> Iterator[LocalBatch]:
        if self._iterable:
            for step, positions, samples in self._iter_stream(keep_all=False):
                yield self._assemble(step, positions, samples)
            return
        order = self.order()
        for step in range(len(self)):
            yield self.batch(step, order)

    def with_global_batches(self) -> Iterator[tuple[LocalBatch, tuple[list[torch.Tensor], list[torch.Tensor]]]]:
        """One pass as :meth:`__iter__`, each step's :class:`LocalBatch` with the whole global batch
        it is cut from, collated as :meth:`global_batch`: what one device trains on, from the
        same read of the data (a stream is read once; ``autoplan run --compare``)."""
        if not self._iterable:
            order = self.order()
            for step in range(len(self)):
                yield self.batch(step, order), self.global_batch(step)
            return
        for step, positions, samples in self._iter_stream(keep_all=True):
            local = self._assemble(step, [positions[r] for r in self._union], [samples[r] for r in self._union])
            yield local, self._split(self._collate(positions, samples, every_field=True))

    def _iter_stream(self, *, keep_all: bool) -> Iterator[tuple[int, list[int], list[Any]]]:
        """One pass over the stream: every ``B`` consecutive samples are one step; yields the
        step, the stream positions and the samples of this rank's rows (``keep_all``: of every
        row). A stream with a ``set_epoch`` method is told :attr:`epoch` first."""
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)
        batch_size, keep = self.layout.global_batch_size, set(self._union)
        step, num_read, kept, positions = 0, 0, [], []
        for position, sample in enumerate(self._read_stream()):
            num_read = position + 1
            if keep_all or position % batch_size in keep:
                kept.append(sample)
                positions.append(position)
            if position % batch_size == batch_size - 1:
                yield step, positions, kept
                step, kept, positions = step + 1, [], []
        if step == 0:
            raise PlanError(self._too_short(num_read))

    def _sample(self, index: int) -> Any:
        """``dataset[index]``; an exception there becomes a :class:`PlanError` quoting it."""
        try:
            return self.dataset[index]
        except PlanError:
            raise
        except Exception as exc:
            raise PlanError(
                f"reading sample {index} of the dataset raised {_quote(exc)}: fix the dataset's __getitem__ "
                f"(or its data) for index {index}"
            ) from exc

    def _read_stream(self) -> Iterator[Any]:
        """The stream's samples; an exception from it becomes a :class:`PlanError` quoting it
        and naming the stream position it was reading."""
        position = 0
        try:
            for sample in cast(Iterable[Any], self.dataset):
                yield sample
                position += 1
        except PlanError:
            raise
        except Exception as exc:
            raise PlanError(
                f"the {type(self.dataset).__name__} raised {_quote(exc)} reading sample {position} of the stream "
                f"(pass {self.epoch + 1}): fix the stream's __iter__ (or its data)"
            ) from exc

    def _check_samples(
        self, indices: Sequence[int], samples: Sequence[Any], *, every_field: bool, shapes: bool
    ) -> None:
        """Every sample's fields (of those this rank keeps; ``every_field``: all) of the planned
        shape (``shapes``) and of one dtype, or :class:`PlanMismatchError` naming the first sample
        that is not (a collated batch hides which sample differs: ``default_collate`` fails on
        another shape and promotes another dtype). Samples that are not tuples of tensors are
        left to ``collate_fn``."""
        layout = self.layout
        dtypes: dict[int, tuple[torch.dtype, int]] = {}
        for index, sample in zip(indices, samples, strict=True):
            fields = (sample,) if isinstance(sample, torch.Tensor) else sample
            if not isinstance(fields, tuple | list) or len(fields) != layout.num_fields:
                return
            for i, f in enumerate(fields):
                if not isinstance(f, torch.Tensor) or not (every_field or layout.reads(i)):
                    continue
                if shapes and tuple(f.shape) != layout.sample_shapes[i]:
                    raise PlanMismatchError(
                        f"sample {index} of the dataset: {layout.field_name(i)} has shape {list(f.shape)}; the plan "
                        f"was made for samples of shape {list(layout.sample_shapes[i])}: make every sample that "
                        "shape (pad or crop it) or re-plan for this one"
                    )
                first = dtypes.setdefault(i, (f.dtype, index))
                if f.dtype != first[0]:
                    raise PlanMismatchError(
                        f"sample {index} of the dataset: {layout.field_name(i)} is {f.dtype}; sample {first[1]}'s is "
                        f"{first[0]}: give every sample's {layout.field_name(i)} the dtype the plan was made for"
                    )

    def _collate(self, indices: Sequence[int], samples: list[Any], *, every_field: bool = False) -> Any:
        """The samples collated and checked (:meth:`_check_samples`: a sample of another shape,
        found when ``collate_fn`` fails, or of another dtype); an exception from ``collate_fn``
        that no sample explains becomes a :class:`PlanError` quoting it."""
        try:
            collated = self.collate_fn(samples)
        except Exception as exc:
            self._check_samples(indices, samples, every_field=every_field, shapes=True)
            shown = f"{indices[0]}..{indices[-1]}" if indices else "none"
            raise PlanError(
                f"collating samples {shown} of the dataset raised {_quote(exc)}: make the samples "
                "(*inputs, *targets) tuples of tensors of the planned shapes or fix collate_fn"
            ) from exc
        self._check_samples(indices, samples, every_field=every_field, shapes=False)
        return collated

    def _fields(self, collated: Any) -> list[torch.Tensor]:
        """A collated batch as one tensor per field (the inputs, then the targets)."""
        layout = self.layout
        fields = [collated] if isinstance(collated, torch.Tensor) else list(collated)
        if len(fields) != layout.num_fields or not all(isinstance(f, torch.Tensor) for f in fields):
            raise PlanError(
                f"a collated batch has {len(fields)} fields; the program reads {layout.num_inputs} input(s) and "
                f"{layout.num_fields - layout.num_inputs} target(s): make samples (*inputs, *targets) tuples of "
                "tensors or pass collate_fn"
            )
        return fields

    def _assemble(self, step: int, indices: Sequence[int], samples: list[Any]) -> LocalBatch:
        """The loaded samples (the rows of :attr:`_union`) -> each field's local tensor."""
        layout = self.layout
        if not self._union:  # a pipeline rank between the first and the last stage
            return LocalBatch(inputs=(), targets=(), global_batch_size=layout.global_batch_size, step=step,
                              sample_indices=((),) * layout.num_fields)  # fmt: skip
        fields = self._fields(self._collate(indices, samples))
        out: list[torch.Tensor | None] = []
        sample_indices: list[tuple[int, ...]] = []
        for i, (f, pick) in enumerate(zip(fields, self._picks, strict=True)):
            if not layout.reads(i):
                out.append(None)
                sample_indices.append(())
                continue
            if tuple(f.shape[1:]) != layout.sample_shapes[i]:
                raise PlanError(
                    f"{layout.field_name(i)} samples have shape {list(f.shape[1:])}; the plan was made for "
                    f"{list(layout.sample_shapes[i])}: make the dataset's samples that shape or re-plan"
                )
            rows = f if pick is None else f.index_select(0, pick)
            out.append(layout.cut_sample_dims(i, rows).to(self.device))
            sample_indices.append(tuple(indices[k] for k in (range(len(indices)) if pick is None else pick.tolist())))
        n = layout.num_inputs
        return LocalBatch(
            inputs=tuple(t for t in out[:n] if t is not None),
            targets=tuple(t for t in out[n:] if t is not None),
            global_batch_size=layout.global_batch_size,
            step=step,
            sample_indices=tuple(sample_indices),
        )
