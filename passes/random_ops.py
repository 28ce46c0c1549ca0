"""Random ops: which ones a sharded program can run so that every element gets exactly the value
the single-device model draws for it (issue #46).

A random op (``torch.Tag.nondeterministic_seeded``: dropout's ``bernoulli_``, ``rand_like``,
``native_dropout``, ...) draws from the device's default generator. Every rank is seeded alike, so
an op run on each rank's local shard draws the *same* numbers on every rank for different
elements: rows ``i`` and ``i + B/2`` of a batch split over 2 ranks get one dropout mask. The rule,
defined here for the strategies (:mod:`autoplan.passes.strategies`) and executed by
:func:`autoplan.runtime.random_ops.global_draw`::

    draws_by_position(op)  <=>  output element i depends only on input element i and on the i-th
                                draw of the generator, and how many draws the op takes, in which
                                order, depends only on the tensor's shape, dtype and layout

    draws_by_position(op):  DTensor's strategies (pointwise: the output in the input's placement)
                            whose placements are all R or S(d); run as: every rank draws the
                            *global* tensor from the generator state all ranks share (the
                            single-device draw, the same on every rank) and keeps its own shard
    other random op:        replicated inputs and outputs only (its draws read the input's values:
                            ``bernoulli`` of a probability tensor, ``multinomial``, ``rrelu``); the
                            planner prices the gathers, and the replicated op draws as one device

Both keep the generator in step with the single-device model: each random op takes exactly the
draws the single-device op takes, in program order, on every rank (the lowering never moves a
random op, :mod:`autoplan.runtime.lowering`; recomputation keeps its output instead of re-running
it, :mod:`autoplan.passes.recompute`). What that guarantees, for ranks seeded alike
(``torch.manual_seed(s)`` on each, as DTensor requires too):

* a program that runs the step once (``ParallelModel``; a pipeline of one stage and one
  micro-batch) draws every element as the single-device step does, bit for bit, and leaves the
  generator where the single-device step leaves it;
* with several micro-batches each draws its micro-batch's tensor (the single-device step draws
  the whole batch's at once: other numbers, the same distribution); with several pipeline stages
  each stage draws from a stream of its own (:class:`autoplan.runtime.random_ops.StageRandomStream`);
* always: the ranks of one stage draw alike, and ranks holding different parts of a tensor hold
  different parts of one draw (no two data-parallel replicas share a mask).

The cost, not priced by the cost models yet: each rank draws and holds the whole tensor
(``k`` times its shard's draws and a transient of the global size, for an op split ``k`` ways).
DTensor's ``OffsetBasedRNGTracker`` avoids the full draw on CUDA by moving each shard's Philox
offset (by the shard's linear index times its size), but it refuses CPU meshes (``mt19937`` has
no offset to move), and what it promises is equal numbers on replicas and distinct numbers on
shards, not the single-device numbers: CUDA's distribution kernels take their Philox
subsequences per thread of the launch grid, not per element offset, so a shard drawn at an
offset is not the slice of the whole tensor's draw (not checked on a GPU here). A sharded program
seeded like the single-device model would then not train like it.
"""

from __future__ import annotations

import torch
import torch.fx as fx

_aten = torch.ops.aten

DRAWS_BY_POSITION: frozenset[torch._ops.OpOverload] = frozenset({
    # in place: the values of ``self`` are overwritten
    _aten.bernoulli_.float, _aten.uniform_.default, _aten.normal_.default, _aten.exponential_.default,
    _aten.geometric_.default, _aten.log_normal_.default, _aten.cauchy_.default,
    _aten.random_.default, getattr(_aten.random_, "from"), _aten.random_.to,
    # functional: a new tensor shaped and laid out like ``self`` (functionalization's forms included)
    _aten.bernoulli.p, _aten.uniform.default, _aten.normal_functional.default, _aten.exponential.default,
    _aten.geometric.default, _aten.log_normal.default, _aten.cauchy.default,
    _aten.random.default, getattr(_aten.random, "from"), _aten.random.to,
    _aten.rand_like.default, _aten.randn_like.default, _aten.randint_like.default, _aten.randint_like.low_dtype,
    # output i = input i * mask i * scale, the mask drawn by position
    _aten.native_dropout.default,
})  # fmt: skip
"""Random ops that :func:`draws_by_position` (module docstring); each has one tensor argument,
``self``, first."""


def is_random(op: object) -> bool:
    """``op`` draws from a generator (``torch.Tag.nondeterministic_seeded``)."""
    return isinstance(op, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in op.tags


def draws(node: fx.Node) -> bool:
    """``node`` runs a random op that draws: :func:`is_random`, and not an attention kernel
    called with ``dropout_p=0`` (tagged random for its dropout, it then draws nothing)."""
    op = node.target
    if not is_random(op):
        return False
    assert isinstance(op, torch._ops.OpOverload)
    for k, a in enumerate(op._schema.arguments):
        if a.name == "dropout_p":
            p = node.args[k] if k < len(node.args) else node.kwargs.get("dropout_p", a.default_value)
            return not (isinstance(p, (int, float)) and p == 0.0)
    return True


def draws_by_position(op: object) -> bool:
    """``op`` is in :data:`DRAWS_BY_POSITION`: a sharded run may draw the global tensor and keep its shard."""
    return op in DRAWS_BY_POSITION


def writes_self(op: torch._ops.OpOverload) -> bool:
    """``op`` overwrites its first argument (``bernoulli_``, ``uniform_``, ...) and returns it."""
    first = op._schema.arguments[0]
    return first.alias_info is not None and first.alias_info.is_write
