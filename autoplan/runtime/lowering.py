"""Lowering: the generated DTensor program becomes a program over each rank's local tensors, with
every collective an explicit issue node and a wait node placed where the plan says.

Why this design (issue #19, "priced = executed")
------------------------------------------------
The program :mod:`autoplan.runtime.codegen` generates is a traced *joint* forward-backward graph
over DTensors: it has no ``nn.Module`` hooks for DDP's reducer or FSDP2's ``fully_shard`` to
attach to, and running it eagerly through DTensor costs ~40 µs of sharding propagation per op
and makes every collective blocking. So the engine's own machinery is used one level down:

1. **Trace through DTensor** (:func:`lower_to_local`): ``make_fx`` in fake mode runs the DTensor
   program once on fake local tensors; DTensor's dispatch (sharding propagation, local shapes,
   ``redistribute``) executes at trace time only, and what is recorded is the per-rank program
   of local ``aten`` ops plus torch's *functional collectives* (``_c10d_functional.*``, the ops
   ``torch.compile`` emits for DTensor), each followed by its ``wait_tensor``. This is how
   ``torch.compile`` lowers DTensor programs (AOTAutograd traces subclass dispatch the same way).
2. **Place the waits** (:func:`sink_waits`): each ``wait_tensor`` (and the local reshaping that
   only depends on it) is moved to right before the first op that reads its result. The issue
   stays where code generation put it, which is the
   :class:`~autoplan.passes.comm_order.CommSchedule` the planner prices: gradient buckets
   issued as their last gradient appears and waited for before the optimizer step (DDP),
   parameter all-gathers issued a block ahead (FSDP2's prefetch), tensor-parallel conversions
   issued right after their producer. Functional collectives run asynchronously on NCCL's and
   gloo's own threads/streams, so everything between an issue and its wait overlaps.

The DTensor program stays the reference: ``ParallelModel.forward_backward(check=True)`` runs it
op by op and checks every placement. The lowered program computes the same ``aten`` ops on the
same local values, so its numbers are identical (the equivalence tests run the lowered program).
``torch.compile`` of the lowered program was not chosen as the default: on CPU ranks it needs a
C++ toolchain and tens of seconds per stage program, and the lowered program already removes the
per-op dispatch cost that compile would remove.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.experimental import implicit_replication
from torch.fx.experimental.proxy_tensor import make_fx

from autoplan.cost_models.comm_schedule import DEFAULT_POLICY
from autoplan.passes.random_ops import is_random
from autoplan.runtime.collectives import segment_layout

WAIT = torch.ops._c10d_functional.wait_tensor.default
COLLECTIVE_NAMESPACE = "_c10d_functional"


@dataclass(frozen=True, slots=True)
class Layout:
    """How a rank's local tensor is a DTensor: mesh, placements, global shape and stride, and the
    DTensor spec they make (kept so that wrapping a step's outputs builds no spec)."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    spec: DTensorSpec = field(compare=False)

    @staticmethod
    def of(x: DTensor) -> Layout:
        return Layout(x.device_mesh, tuple(x.placements), x.shape, tuple(x.stride()), x._spec)

    def wrap(self, local: torch.Tensor) -> DTensor:
        """``local`` as this layout's DTensor (differentiable: ``DTensor.from_local``)."""
        return segment_layout(
            DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride)
        )

    def wrap_no_grad(self, local: torch.Tensor) -> DTensor:
        """``local`` as this layout's DTensor outside autograd (a step's outputs: gradients and
        the detached loss). As FSDP2 wraps its sharded gradients (``_from_local_no_grad``): the
        DTensor constructor on the kept spec, without ``from_local``'s autograd function and
        spec construction, ~3x cheaper per tensor."""
        return DTensor(local, self.spec, requires_grad=False)


def _unwrap(x: Any) -> Any:
    return x.to_local() if isinstance(x, DTensor) else x


@dataclass(frozen=True, slots=True)
class LocalProgram:
    """A lowered program: ``graph_module`` takes and returns local tensors; calling the
    :class:`LocalProgram` takes and returns DTensors laid out as the DTensor program's."""

    graph_module: fx.GraphModule
    output_layouts: tuple[Layout | None, ...]
    """Per output, the DTensor it was (``None``: a plain value)."""

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        """Run on DTensors (or their local tensors) outside autograd; outputs as DTensors."""
        with torch.no_grad():
            outs = self.graph_module(*[_unwrap(a) for a in args])
        return tuple(
            lay.wrap_no_grad(o) if lay is not None else o for o, lay in zip(outs, self.output_layouts, strict=True)
        )

    def run_boxed(self, local_args: list[Any]) -> list[Any]:
        """Run on local tensors outside autograd; outputs stay local (the caller knows their
        layouts: :attr:`output_layouts`). The arguments come in a list the program empties as it
        starts (AOTAutograd's boxed calling convention): an argument the caller holds no other
        reference to is freed at its last use in the program, as eager autograd frees a saved
        tensor once its backward node ran, not when the whole program returns."""
        with torch.no_grad():
            return list(boxed_twin(self.graph_module)(local_args))

    @property
    def code(self) -> str:
        return self.graph_module.code

    def collectives(self) -> list[tuple[int, int]]:
        """(issue position, wait position) of every collective, in program order (for review and
        tests: the distance is what can overlap)."""
        nodes = list(self.graph_module.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        return [
            (pos[n.args[0]], pos[n])
            for n in nodes
            if n.op == "call_function" and n.target is WAIT and isinstance(n.args[0], fx.Node)
        ]


_BOXED_TWINS: weakref.WeakKeyDictionary[fx.GraphModule, fx.GraphModule] = weakref.WeakKeyDictionary()


def boxed_twin(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm``'s program called with one list of arguments that it empties before its first op
    (``torch.fx``'s boxed code generation, as AOTAutograd calls compiled backwards): the program's
    own code drops each value after its last use, so an argument is freed there unless the
    caller still holds it. Built once per program (the twin shares ``gm``'s attributes)."""
    twin = _BOXED_TWINS.get(gm)
    if twin is None:
        graph = fx.Graph()
        graph.output(graph.graph_copy(gm.graph, {}))
        graph.set_codegen(fx.graph._BoxedCodeGen())
        twin = _BOXED_TWINS[gm] = fx.GraphModule(gm, graph)
    return twin


def local_shard(t: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor:
    """This rank's shard of a global tensor ``t`` (the same on every rank), as
    ``distribute_tensor(t, mesh, placements, src_data_rank=None).to_local()`` holds it (DTensor's
    uneven split: ``compute_local_shape_and_global_offset``), without building a DTensor: a
    narrow per sharded dim. Placements other than ``R``/``S(d)`` go through DTensor itself."""
    if not all(type(p) in (Shard, Replicate) for p in placements):  # e.g. S(d)/k: DTensor's own split
        return distribute_tensor(t, mesh, list(placements), src_data_rank=None).to_local()
    shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, list(placements))
    for dim, (size, start) in enumerate(zip(shape, offset, strict=True)):
        if size != t.shape[dim]:
            t = t.narrow(dim, start, size)
    return t.contiguous()


def lower_to_local(program: Callable[..., Sequence[Any]], example_args: Sequence[Any]) -> LocalProgram:
    """Trace ``program`` (run on ``example_args``: DTensors and plain values, as the caller will
    run it) through DTensor into a program over local tensors, and place its waits.

    The trace runs on fake tensors: no compute, no communication (every rank traces its own
    program; ranks do not need to trace at the same time)."""
    layouts = [Layout.of(a) if isinstance(a, DTensor) else None for a in example_args]
    out_layouts: list[Layout | None] = []

    def local_step(*locals_: Any) -> list[Any]:
        args = [lay.wrap(x) if lay is not None else x for x, lay in zip(locals_, layouts, strict=True)]
        with implicit_replication():
            outs = program(*args)
        out_layouts.clear()
        out_layouts.extend(Layout.of(o) if isinstance(o, DTensor) else None for o in outs)
        return [_unwrap(o) for o in outs]

    with torch.no_grad():
        gm = make_fx(local_step, tracing_mode="fake")(*[_unwrap(a) for a in example_args])
    drop_identity_views(gm)
    sink_waits(gm)
    bound_reduce_scatters(gm)
    return LocalProgram(graph_module=gm, output_layouts=tuple(out_layouts))


_IDENTITY_CANDIDATES = (
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.detach.default,
)


def drop_identity_views(gm: fx.GraphModule) -> int:
    """Remove views that change nothing (same shape and strides as their input: DTensor's
    dispatch leaves many, e.g. ``view(x, [256])`` of a ``[256]`` tensor, and ``detach``/``alias``,
    no-ops in a program run without autograd); their readers read the input. The lowered program
    is run by Python op by op, and each call costs ~2-5 µs of dispatch on CPU (a quarter of a
    GPT-2 step's ~800 nodes were such views). Returns how many were removed."""
    removed = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in _IDENTITY_CANDIDATES:
            continue
        src = n.args[0]
        out, val = n.meta.get("val"), src.meta.get("val") if isinstance(src, fx.Node) else None
        if not isinstance(out, torch.Tensor) or not isinstance(val, torch.Tensor):
            continue
        if out.shape == val.shape and out.stride() == val.stride() and out.storage_offset() == val.storage_offset():
            n.replace_all_uses_with(src)
            gm.graph.erase_node(n)
            removed += 1
    gm.graph.lint()
    gm.recompile()
    return removed


def _is_collective(n: fx.Node) -> bool:
    target = n.target
    return (
        n.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and target.namespace == COLLECTIVE_NAMESPACE
        and target is not WAIT
    )


def _wait_chain(wait: fx.Node, nodes: list[fx.Node], pos: dict[fx.Node, int], *, before: int) -> list[fx.Node]:
    """``wait`` and the pure ops after it that read it (or the chain) and otherwise only values
    placed before position ``before``: what can move together with the wait."""
    chain, in_chain = [wait], {wait}
    for n in nodes[pos[wait] + 1 :]:
        if n.op != "call_function" or _is_collective(n) or n.target is WAIT or is_random(n.target):
            continue  # (a random op stays where it is: moved, it would draw other numbers)
        ins = n.all_input_nodes
        if any(a in in_chain for a in ins) and all(a in in_chain or pos[a] < before for a in ins):
            chain.append(n)
            in_chain.add(n)
    return chain


def sink_waits(gm: fx.GraphModule) -> int:
    """Move every ``wait_tensor``, with the ops that depend only on it and on values that existed
    before its collective was issued, to right before the first other op that reads them.
    Returns how many waits moved. Only pure ops move (the traced program is functional); a
    random op never does (the order of the draws is the single-device model's)."""
    graph = gm.graph
    moved = 0
    for wait in [n for n in graph.nodes if n.op == "call_function" and n.target is WAIT]:
        issue = wait.args[0]
        if not isinstance(issue, fx.Node):
            continue
        nodes = list(graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        issue_pos = pos[issue]
        # the reshaping after the wait: ops all of whose inputs are chain nodes or older than the issue
        chain = _wait_chain(wait, nodes, pos, before=issue_pos)
        in_chain = set(chain)
        users = [u for c in chain for u in c.users if u not in in_chain]
        if not users:
            continue
        first = min(users, key=lambda u: pos[u])
        if pos[first] <= pos[chain[-1]] + 1 and all(pos[c] < pos[first] for c in chain):
            # already adjacent to its first reader
            gap = [n for n in nodes[pos[wait] + 1 : pos[first]] if n not in in_chain]
            if not gap:
                continue
        for c in chain:
            first.prepend(c)
        moved += 1
    graph.lint()
    gm.recompile()
    return moved


@dataclass(frozen=True, slots=True)
class DeferredWaits:
    """A lowered program cut in two at its output waits (:func:`defer_output_waits`): ``issue``
    runs the program up to issuing its last collectives and returns its outputs with the
    ``slots`` that the waits produce left ``None``, then the values ``finish`` reads; ``finish``
    waits for those collectives and returns the ``slots``' values."""

    issue: fx.GraphModule
    finish: fx.GraphModule
    slots: tuple[int, ...]
    num_outputs: int

    def run_issue(self, *local_args: Any) -> tuple[list[Any], list[Any]]:
        """(the outputs, ``None`` at :attr:`slots`; what :meth:`run_finish` takes)."""
        return self.run_issue_boxed(list(local_args))

    def run_issue_boxed(self, local_args: list[Any]) -> tuple[list[Any], list[Any]]:
        """:meth:`run_issue` taking its arguments in a list it empties (:meth:`LocalProgram.run_boxed`)."""
        with torch.no_grad():
            outs = list(boxed_twin(self.issue)(local_args))
        return outs[: self.num_outputs], outs[self.num_outputs :]

    def run_finish(self, pending: Sequence[Any]) -> dict[int, Any]:
        """Wait for the collectives ``issue`` left in flight: output slot -> its value."""
        with torch.no_grad():
            return dict(zip(self.slots, self.finish(*pending), strict=True))


def defer_output_waits(gm: fx.GraphModule, slots: Sequence[int]) -> DeferredWaits | None:
    """Cut the program at the waits whose results only output ``slots`` read (a backward's
    gradient buckets, waited for at its end): those waits and the pure ops that depend on them
    (and only feed those slots) move to a second program, so the first returns with its last
    collectives still in flight, as DDP and FSDP2 leave their last gradient reductions to be
    waited for before the optimizer step, not before the pipeline hands the input gradient on.
    Only waits after the program's last issue move (an earlier one bounds the reduce-scatters in
    flight, :func:`bound_reduce_scatters`). ``None`` when no wait qualifies."""
    nodes = list(gm.graph.nodes)
    output = next(n for n in nodes if n.op == "output")
    out_args = list(output.args[0])
    wanted = set(slots)
    slot_uses: dict[fx.Node, set[int]] = {}
    for i, a in enumerate(out_args):
        if isinstance(a, fx.Node):
            slot_uses.setdefault(a, set()).add(i)
    # only waits after the last issue (an earlier one bounds the buckets in flight,
    # bound_reduce_scatters), and the ops that read them
    last_issue = max((i for i, n in enumerate(nodes) if _is_collective(n)), default=-1)
    after_wait: set[fx.Node] = set()
    for n in nodes[last_issue + 1 :]:
        if n.op == "call_function" and (n.target is WAIT or any(a in after_wait for a in n.all_input_nodes)):
            after_wait.add(n)
    tail: set[fx.Node] = set()
    for n in reversed(nodes[last_issue + 1 :]):
        if n not in after_wait or _is_collective(n) or is_random(n.target):
            continue
        users = [u for u in n.users if u is not output]
        if all(u in tail for u in users) and (output not in n.users or slot_uses[n] <= wanted):
            tail.add(n)
    moved = [i for i, a in enumerate(out_args) if isinstance(a, fx.Node) and a in tail]
    if not moved:
        return None
    order = [n for n in nodes if n in tail]
    boundary = list(dict.fromkeys(a for n in order for a in n.all_input_nodes if a not in tail))
    first = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        if n.op != "output" and n not in tail:
            env[n] = first.node_copy(n, lambda x: env[x])
    kept = [None if i in moved else (env[a] if isinstance(a, fx.Node) else a) for i, a in enumerate(out_args)]
    first.output((*kept, *(env[b] for b in boundary)))
    second = fx.Graph()
    env2: dict[fx.Node, fx.Node] = {}
    for k, b in enumerate(boundary):
        env2[b] = second.placeholder(f"pending_{k}")
        env2[b].meta = dict(b.meta)
    for n in order:
        env2[n] = second.node_copy(n, lambda x: env2[x])
    second.output(tuple(env2[out_args[i]] for i in moved))
    return DeferredWaits(
        issue=fx.GraphModule(gm, first),
        finish=fx.GraphModule(gm, second),
        slots=tuple(moved),
        num_outputs=len(out_args),
    )


REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default


def bound_reduce_scatters(gm: fx.GraphModule, in_flight: int = DEFAULT_POLICY.reduce_scatters_in_flight) -> int:
    """After :func:`sink_waits`: the wait of the ``k``-th reduce-scatter (with the ops that depend
    only on it) moves to right before the issue of the ``k + in_flight``-th when it sat later, so
    at most ``in_flight`` full-size gradient buckets are alive (a gradient's bucket is freed when
    its reduce-scatter is waited for). Returns how many waits moved."""
    graph = gm.graph
    issues = [n for n in graph.nodes if n.op == "call_function" and n.target is REDUCE_SCATTER]
    moved = 0
    for k, issue in enumerate(issues[: len(issues) - in_flight]):
        waits = [u for u in issue.users if u.target is WAIT]
        if len(waits) != 1:
            continue
        nodes = list(graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        limit = issues[k + in_flight]
        wait = waits[0]
        if pos[wait] < pos[limit]:
            continue
        # the wait and what depends only on it and on values older than the limit
        for c in _wait_chain(wait, nodes, pos, before=pos[limit]):
            limit.prepend(c)
        moved += 1
    graph.lint()
    gm.recompile()
    return moved
