"""The generated program's random ops: a sharded random op draws exactly the single-device values.

Every rank is seeded alike (the single-device model and the program are compared from the same
seed), so a random op run on each rank's local shard would draw the same numbers on every rank
for different elements (issue #46: rows ``i`` and ``i + B/2`` kept or dropped together). An op of
:data:`autoplan.passes.random_ops.DRAWS_BY_POSITION` (dropout's ``bernoulli_``, ``rand_like``,
``native_dropout``, ...) runs instead through :func:`global_draw`, which code generation emits in
its place (:mod:`autoplan.runtime.codegen`)::

    full  = empty_strided(global shape, global stride)     # the tensor one device would draw into
    full[this rank's part] = local                         # only for an op that reads its input's values
    out   = op(full, ...)                                  # the single-device draw, the same on every rank
    local = this rank's part of out                        # a narrow per sharded dim (_own_part)

Each rank takes exactly the draws the single-device op takes, in program order, so the generator
stays in step with the single-device model's, and the lowered program
(:mod:`autoplan.runtime.lowering`) records the same sequence on local tensors (the global shape
and this rank's offsets are constants of its trace).

What it costs: each rank draws the whole tensor and holds it while the op runs (``k`` times the
shard's draws and bytes for an op split ``k`` ways; neither is priced by the cost models yet).
On CUDA a Philox offset per shard spares the full draw (DTensor's ``OffsetBasedRNGTracker``), but
it gives each shard distinct numbers, not the single-device ones, and CPU's ``mt19937`` has no
offset to move: :mod:`autoplan.passes.random_ops` has the details.

Recomputation never re-runs a random op (:mod:`autoplan.passes.recompute` keeps its output), so a
recomputed block sees the mask its forward drew.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.utils import _pytree as pytree

from autoplan.passes.random_ops import writes_self
from autoplan.runtime.collectives import segment_layout

READS_VALUES = frozenset({torch.ops.aten.native_dropout.default})
"""Ops of ``DRAWS_BY_POSITION`` whose output reads the input's values (the others overwrite them
or only take their shape): this rank's values are written into its part of the global tensor."""


def _own_part(full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor:
    """This rank's part of the global tensor ``full`` (``R``/``S(d)`` placements) as a view: a
    narrow per sharded dim, split as DTensor splits (``Shard._local_shard_size_and_offset``, mesh
    axes left to right). Computed from the rank's mesh coordinate in plain integers, so a trace
    (:func:`~autoplan.runtime.lowering.lower_to_local`) records the narrows with constant offsets."""
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank is not in the mesh"
    size, start = list(full.shape), [0] * full.ndim
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            size[p.dim], offset = p._local_shard_size_and_offset(size[p.dim], mesh.size(axis), coordinate[axis])
            start[p.dim] += int(offset)
    for dim in range(full.ndim):
        if size[dim] != full.shape[dim]:
            full = full.narrow(dim, start[dim], size[dim])
    return full


def global_draw(op: torch._ops.OpOverload, x: Any, *args: Any, **kwargs: Any) -> Any:
    """``op(x, *args, **kwargs)`` for an op of ``DRAWS_BY_POSITION``, each element of the result
    drawn as one device draws it (module docstring): on a sharded DTensor ``x`` every rank draws
    the global tensor and keeps its part; outputs in ``x``'s placements (an in-place op writes
    ``x``'s local tensor and returns ``x``). A plain tensor, or one replicated everywhere, is drawn
    as it is."""
    if not isinstance(x, DTensor):
        return op(x, *args, **kwargs)
    mesh, placements = x.device_mesh, tuple(x.placements)
    local = x.to_local()
    if all(isinstance(p, Replicate) for p in placements):
        out = op(local, *args, **kwargs)
        return x if writes_self(op) else pytree.tree_map(lambda t: _as_dtensor(t, t, mesh, placements), out)
    assert all(type(p) in (Shard, Replicate) for p in placements), (
        f"{op} on {placements}: random ops run in R/S(d) only (autoplan.passes.random_ops)"
    )
    full = torch.empty_strided(x.shape, x.stride(), dtype=local.dtype, device=local.device)
    if op in READS_VALUES:
        _own_part(full, mesh, placements).copy_(local)
    out = op(full, *args, **kwargs)
    if writes_self(op):
        local.copy_(_own_part(full, mesh, placements))
        return x
    return pytree.tree_map(lambda t: _as_dtensor(_own_part(t, mesh, placements).contiguous(), t, mesh, placements), out)


def _as_dtensor(local: Any, full: Any, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> Any:
    """``local`` (this rank's part of the global ``full``) as a DTensor in ``placements``; a
    non-tensor output as it is."""
    if not isinstance(local, torch.Tensor):
        return local
    return segment_layout(
        DTensor.from_local(local, mesh, list(placements), run_check=False, shape=full.shape, stride=full.stride())
    )


class StageRandomStream:
    """The generator state one pipeline stage's random ops draw from (issue #46): swapped into
    the device's default generator while the stage's programs run (:meth:`drawing`), and out again.

    Without it every stage would draw from the state all ranks share at the start of a step, so
    the first dropout of stage 1 would take the very numbers stage 0's first dropout took (a
    correlated mask), and the ranks' default generators would part after the first step (each
    stage took other draws). With it the stages' draws are independent of each other, the ranks
    of one stage draw alike (one seed, one schedule: their shards are parts of one draw), and the
    default generator advances by one draw per step on every rank (:func:`step_seed`, from which
    each stage's state for the step is seeded with its index: :meth:`start_step`), so a
    checkpoint's RNG state resumes the masks too. A pipeline of several stages therefore does not
    draw the single-device model's numbers (nor does a step of several micro-batches: each draws
    its own micro-batch); one stage with one micro-batch draws exactly them, from the default
    generator (no stream)."""

    def __init__(self, device: torch.device, stage: int) -> None:
        self.device = device
        self.stage = stage
        self.default = _default_generator(device)
        self.state: torch.Tensor | None = None
        """This step's state (:meth:`start_step`), advanced by the stage's draws."""

    def start_step(self, seed: int) -> None:
        """Seed this step's state from the step's ``seed`` (:func:`step_seed`) and the stage index."""
        digest = hashlib.sha256(f"autoplan stage {self.stage} of step seed {seed}".encode()).digest()
        gen = torch.Generator(device=self.device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        self.state = gen.get_state()

    @contextlib.contextmanager
    def drawing(self) -> Iterator[None]:
        """Within: the default generator holds this stage's state (and advances it)."""
        if self.state is None:
            raise AssertionError(f"stage {self.stage}: a program ran before the step seeded its random stream")
        saved = self.default.get_state()
        self.default.set_state(self.state)
        try:
            yield
        finally:
            self.state = self.default.get_state()
            self.default.set_state(saved)


def step_seed(device: torch.device) -> int:
    """One draw of ``device``'s default generator (the same on every rank seeded alike): the seed
    of a pipeline step's stage streams (:meth:`StageRandomStream.start_step`)."""
    return int(torch.empty((), dtype=torch.int64, device=device).random_(generator=_default_generator(device)))


def _default_generator(device: torch.device) -> torch.Generator:
    """The generator random ops on ``device`` draw from when given none."""
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device.type)
    return module.default_generators[device.index if device.index is not None else module.current_device()]
