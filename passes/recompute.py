r"""Pass — recomputation: what a recomputed forward keeps for its backward, and the backward that
re-creates the rest, under the two policies ``selective`` (issue #20 item 4) and ``full``.

The rule, defined once here, priced by :mod:`autoplan.planner.segment_costs`
(``selective_recompute_s``, ``selective_kept_bytes``, ``selective_bwd_transient_bytes`` and their
``full_*`` twins) and executed by :mod:`autoplan.runtime.pipeline` (:func:`recompute_stage_program`)::

    keeps(v) = v is a placeholder                  (parameter, buffer, program or stage input)
            or op(v) draws random numbers          (torch.Tag.nondeterministic_seeded: a re-run draws others)
            or v is read by a forward op of a later segment   (a block's input, as Megatron keeps it)
            or policy = selective and op(v) is a matmul
                                                   (compute.is_matmul: mm, addmm, bmm, ..., autoplan::sdpa)
            or policy = selective and op(v) is a collective on a mesh axis of more than one device
                                                   (selective never re-runs communication)
    keeps(getitem(x, i)) = keeps(x)

    S = the forward values the backward reads (what ``recompute="none"`` keeps)
    R = the fewest forward ops with   v in S, not keeps(v)             =>  op(v) in R
                                      op in R, a input of op, not keeps(a)  =>  op(a) in R
    K = {v in S : keeps(v)}  u  {a input of an op in R : keeps(a)}       (what the forward keeps)

    extra backward time      = sum_{op in R} t(op)  (+ the conversions into them that are re-run)
    activations per micro-batch = storages of K;  re-created in the backward: storages of S not in K

``full`` is Megatron's and torchtitan's per-block full recomputation: each block keeps its input
(and its random ops' outputs, so a re-run draws the same dropout mask), and its backward re-creates
the block's activations, matmuls included, when it starts (the first value it reads needs nearly
the whole block's forward), one block at a time. It re-runs the block's collectives too, as
Megatron does (the tensor-parallel all-reduces: ``cost_models.step`` prices three forward passes of
them) and as ZeRO-3 must: a kept gathered parameter would keep every block's full weights from
forward to backward, against ``reshard_after_forward`` (the re-run gathers them once more in the
backward; FSDP2 under torchtitan's checkpointing reuses its backward gather instead, which this
runtime does not: :func:`autoplan.cost_models.memory.stage_memory_parts` prices the extra block).

Conversions: in the generated program, a conversion code generation inserts between a producer
and a consumer is a node of its own (``meta["autoplan.transition"]``); one that communicates is
kept like any collective, a local one (``shard``, ``to_partial``, any step on a one-device axis)
is re-run (under ``full`` every conversion is). In the traced graph the pricing reads, the same
conversion is an edge: under ``selective`` an input of an op of ``R`` that arrives through a
communicating conversion is kept in its converted layout (``RecomputePartition.kept_conversions``)
and the walk does not go past it.

The forward returns ``K`` in place of ``S``; the backward runs each op of ``R`` right before its
first reader (so one segment's re-created values live while that segment's backward runs, as
:func:`autoplan.cost_models.memory.segment_activation_bytes` prices; an alias of a re-run value,
such as the ``detach`` autograd records at the start of the backward, moves to its own first
reader). Under ``selective`` the ops of ``R`` are the cheap ones between the matmuls: norms,
activations, residual adds, views, the loss's softmax; under ``full``, a block's whole forward.

Why ``selective`` keeps the attention core and does not re-run it: ``autoplan::sdpa_backward``
(:mod:`autoplan.passes.attention`) recomputes the attention probabilities from q, k and v itself
(FlashAttention), so the ``(B, H, T, S)`` scores, softmax and dropout mask that selective
recomputation re-runs in Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", sec. 4.2: the ``5 a s^2 b`` term) are never stored; its ``(B, H, T, D)``
output is kept like a matmul's (torchtitan's per-op policy saves
``aten._scaled_dot_product_*_attention`` too), which spares re-running the ``4 T S D`` FLOPs per
head for ``B T H D`` bytes. Attention traced as its decomposition (with dropout) keeps its ``bmm``
outputs and re-runs the softmax between them.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx as fx

from autoplan.cost_models.cluster import COLLECTIVE_KINDS
from autoplan.cost_models.compute import is_matmul
from autoplan.passes.liveness import is_view_op
from autoplan.passes.stages import RECOMPUTED_META, StageProgram
from autoplan.passes.strategies import tensor_args

Policy = Literal["selective", "full"]
"""What a recomputed forward keeps (module docstring); ``ParallelConfig.recompute`` minus ``none``."""

POLICIES: tuple[Policy, ...] = ("selective", "full")

OP_META = "autoplan.op"
"""``node.meta`` key on every op of a generated program: the traced op (a fallback node's target
is the runtime's ``replicated_call`` wrapper), so the rule sees the op the pricing sees."""

TRANSITION_META = "autoplan.transition"
"""``node.meta`` key on every conversion code generation inserts (:mod:`autoplan.runtime.codegen`):
``(step kind, mesh axis)``, a coalesced gather the kind of its collective."""


def communicates(kind: str, axis: int, mesh_shape: Sequence[int]) -> bool:
    """Whether a conversion step of ``kind`` on mesh axis ``axis`` moves data between devices
    (``cluster.COLLECTIVE_KINDS``; ``shard`` and ``to_partial`` are local)."""
    return kind in COLLECTIVE_KINDS and mesh_shape[axis] > 1


def keeps_op(n: fx.Node, mesh_shape: Sequence[int], policy: Policy = "selective") -> bool:
    """The op half of ``keeps`` (module docstring): placeholders, random ops and, under
    ``selective``, matmuls and communicating conversions (on a mesh of ``mesh_shape``)."""
    if n.op == "placeholder":
        return True
    if n.op != "call_function":
        return False  # get_attr: a constant, read again for free
    if n.target is operator.getitem:
        parent = n.args[0]
        assert isinstance(parent, fx.Node)
        return keeps_op(parent, mesh_shape, policy)
    transition = n.meta.get(TRANSITION_META)
    if transition is not None:
        kind, axis = transition
        return policy == "selective" and communicates(kind, axis, mesh_shape)
    op = n.meta.get(OP_META, n.target)
    random = torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())
    return random or (policy == "selective" and is_matmul(op))


@dataclass(frozen=True, slots=True)
class RecomputePartition:
    """``K`` and ``R`` of the module docstring under one policy, each in graph order."""

    kept: tuple[fx.Node, ...]
    recomputed: tuple[fx.Node, ...]
    """Forward nodes the backward re-runs (``get_attr`` constants included, read again for free)."""
    kept_conversions: tuple[tuple[str, int], ...] = ()
    """(op of ``R``, tensor-argument index): inputs kept as a communicating conversion made them
    (the traced graph, where conversions are edges; module docstring)."""

    @property
    def recomputed_ops(self) -> frozenset[str]:
        """Names of the re-run operators (what the extra backward time sums)."""
        return frozenset(n.name for n in self.recomputed if n.op == "call_function")


def recompute_partition(
    saved: Sequence[fx.Node],
    *,
    boundary: Set[fx.Node],
    mesh_shape: Sequence[int],
    policy: Policy = "selective",
    converted: Callable[[fx.Node, int], bool] = lambda v, i: False,  # noqa: ARG005
) -> RecomputePartition:
    """``saved`` (S), the values read by a later segment's forward (``boundary``) and the inputs
    arriving through a communicating conversion (``converted(op, tensor-argument index)``: kept
    converted under ``selective``, re-run under ``full``) -> ``K`` and ``R`` (module docstring)."""
    if policy == "full":
        converted = lambda v, i: False  # noqa: ARG005, E731  (full re-runs every conversion)

    def keeps(v: fx.Node) -> bool:
        if v in boundary:
            return True
        if v.op == "call_function" and v.target is operator.getitem:
            parent = v.args[0]
            assert isinstance(parent, fx.Node)
            return keeps(parent)  # a tuple is kept or re-run whole, never returned as one value
        return keeps_op(v, mesh_shape, policy)

    kept: set[fx.Node] = {v for v in saved if keeps(v)}
    kept_conversions: set[tuple[str, int]] = set()
    recomputed: set[fx.Node] = set()
    stack = [v for v in saved if not keeps(v)]
    while stack:
        v = stack.pop()
        if v in recomputed:
            continue
        recomputed.add(v)
        args = tensor_args(v)
        through = [converted(v, i) for i in range(len(args))]
        kept_conversions |= {(v.name, i) for i, c in enumerate(through) if c}
        for a in v.all_input_nodes:
            uses = [c for b, c in zip(args, through, strict=True) if b is a]
            if uses and all(uses):
                continue  # read only through a kept conversion
            if keeps(a):
                kept.add(a)
            elif a not in recomputed:
                stack.append(a)
    if not saved:
        return RecomputePartition(kept=(), recomputed=())
    order = {n: i for i, n in enumerate(saved[0].graph.nodes)}
    return RecomputePartition(
        kept=tuple(sorted(kept, key=order.__getitem__)),
        recomputed=tuple(sorted(recomputed, key=order.__getitem__)),
        kept_conversions=tuple(sorted(kept_conversions)),
    )


def _read_by_later_segment(
    nodes: Sequence[fx.Node], segment_of: Mapping[str, int], is_forward: Callable[[fx.Node], bool]
) -> set[fx.Node]:
    """Forward values some forward op of a later segment reads (a ``getitem`` is in its
    producer's segment, so a tuple is never one of them)."""

    def segment(n: fx.Node) -> int | None:
        while n.op == "call_function" and n.target is operator.getitem:
            n = n.args[0]  # type: ignore[assignment]
        return segment_of.get(n.name)

    out = set()
    for v in nodes:
        k = segment(v)
        if k is None or not is_forward(v):
            continue
        if any(is_forward(u) and (segment(u) or k) > k for u in v.users if u.target is not operator.getitem):
            out.add(v)
    return out


def joint_recompute_partition(
    gm: fx.GraphModule,
    segment_of: Mapping[str, int],
    *,
    mesh_shape: Sequence[int],
    policy: Policy = "selective",
    converted: Callable[[fx.Node, int], bool] = lambda v, i: False,  # noqa: ARG005
) -> RecomputePartition:
    """The rule on the traced joint forward-backward graph (what the pricing reads): forward ops
    carry ``meta["autoplan.phase"] == "fwd"``, and a ``getitem`` is in its producer's phase; a
    constant (no placeholder among its inputs) is not saved: every stage program computes it
    where it is read (both as :func:`autoplan.passes.stages.split_stages` does)."""
    nodes = list(gm.graph.nodes)
    fwd: set[fx.Node] = set()
    for n in nodes:
        if n.op != "call_function":
            continue
        parent = n.args[0] if n.target is operator.getitem else None
        if n.meta.get("autoplan.phase") == "fwd" or (isinstance(parent, fx.Node) and parent in fwd):
            fwd.add(n)
    const: set[fx.Node] = set()  # depends on no placeholder: each stage program computes it where read
    for n in nodes:
        if n.op == "get_attr" or (n.op == "call_function" and all(a in const for a in n.all_input_nodes)):
            const.add(n)
    saved = [
        n
        for n in nodes
        if n in fwd and n not in const and any(u.op == "call_function" and u not in fwd for u in n.users)
    ]
    boundary = _read_by_later_segment(nodes, segment_of, fwd.__contains__)
    return recompute_partition(saved, boundary=boundary, mesh_shape=mesh_shape, policy=policy, converted=converted)


def stage_recompute_partition(
    stage: StageProgram,
    segment_of: Mapping[str, int],
    *,
    last: bool,
    mesh_shape: Sequence[int],
    policy: Policy = "selective",
) -> RecomputePartition:
    """The rule on one pipeline stage's forward program: ``S`` is what it returns for its
    backward, the boundary adds its outputs (a later stage's forward reads them; the last stage's
    output is the loss)."""
    nodes = list(stage.forward.graph.nodes)
    outs = next(n for n in nodes if n.op == "output").args[0]
    assert isinstance(outs, tuple)
    n_out = len(stage.outputs)
    boundary = _read_by_later_segment(nodes, segment_of, lambda n: n.op == "call_function")
    if not last:
        boundary |= {o for o in outs[:n_out] if isinstance(o, fx.Node)}
    saved = [o for o in outs[n_out:] if isinstance(o, fx.Node)]
    return recompute_partition(saved, boundary=boundary, mesh_shape=mesh_shape, policy=policy)


def recompute_stage_program(
    stage: StageProgram,
    segment_of: Mapping[str, int],
    *,
    last: bool,
    mesh_shape: Sequence[int],
    policy: Policy = "selective",
) -> StageProgram:
    """``stage`` with recomputation under ``policy``: the same :class:`StageProgram` contract, its
    forward returning ``(*outputs, *K)`` and its backward taking ``(*params, *buffers, *K,
    *output_grads)`` and re-running ``R`` (module docstring), each op right before its first reader."""
    part = stage_recompute_partition(stage, segment_of, last=last, mesh_shape=mesh_shape, policy=policy)
    fwd_nodes = list(stage.forward.graph.nodes)
    outs = next(n for n in fwd_nodes if n.op == "output").args[0]
    assert isinstance(outs, tuple)
    n_out = len(stage.outputs)
    held = set(fwd_nodes[: len(stage.param_names) + len(stage.buffer_names)])  # the backward reads them itself
    kept = [v for v in part.kept if v not in held]
    forward = _forward_keeping(stage.forward, [*outs[:n_out], *kept])
    backward = _backward_recomputing(stage, part.recomputed, kept=kept, saved=list(outs[n_out:]))
    return dataclasses.replace(stage, forward=forward, backward=backward, saved=tuple(v.name for v in kept))


def _forward_keeping(gm: fx.GraphModule, outputs: Sequence[fx.node.Argument]) -> fx.GraphModule:
    """``gm`` returning ``outputs`` (its own nodes) instead of its outputs."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op != "output":
            env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outputs))
    return fx.GraphModule(gm, graph, class_name="AutoplanStageForward")


def _backward_recomputing(
    stage: StageProgram, recomputed_nodes: Sequence[fx.Node], *, kept: Sequence[fx.Node], saved: Sequence[fx.Node]
) -> fx.GraphModule:
    """The stage's backward reading ``K`` and re-running ``R`` just in time (see
    :func:`recompute_stage_program`)."""
    fwd_ph = [n for n in stage.forward.graph.nodes if n.op == "placeholder"]
    bwd_ph = [n for n in stage.backward.graph.nodes if n.op == "placeholder"]
    n_pb, n_saved = len(stage.param_names) + len(stage.buffer_names), len(saved)
    graph = fx.Graph()
    env_f: dict[fx.Node, fx.Node] = {}  # forward node -> its value in the new backward
    env_b: dict[fx.Node, fx.Node] = {}  # backward node -> its copy
    for f, b in zip(fwd_ph[:n_pb], bwd_ph[:n_pb], strict=True):
        env_b[b] = env_f[f] = graph.node_copy(b)
    for v in kept:
        env_f[v] = graph.placeholder(v.name)
        env_f[v].meta = dict(v.meta)
    for g in bwd_ph[n_pb + n_saved :]:
        env_b[g] = graph.node_copy(g)
    saved_of = dict(zip(bwd_ph[n_pb : n_pb + n_saved], saved, strict=True))
    recomputed = set(recomputed_nodes)
    attrs: dict[str, object] = {}

    def materialize(v: fx.Node) -> fx.Node:
        stack = [v]
        while stack:
            x = stack[-1]
            if x in env_f:
                stack.pop()
                continue
            if x not in recomputed:
                raise AssertionError(f"recomputing backward reads {x.name}, which is neither kept nor recomputed")
            missing = [a for a in x.all_input_nodes if a not in env_f]
            if missing:
                stack.extend(missing)
                continue
            stack.pop()
            if x.op == "get_attr":
                attrs[str(x.target)] = getattr(stage.forward, str(x.target))
            env_f[x] = graph.node_copy(x, env_f.__getitem__)
            env_f[x].meta[RECOMPUTED_META] = True
        return env_f[v]

    deferred: set[fx.Node] = set()

    def emit(n: fx.Node) -> None:
        for a in n.all_input_nodes:
            if a in saved_of and a not in env_b:
                env_b[a] = materialize(saved_of[a])
            elif a in deferred:
                deferred.discard(a)
                emit(a)
        if n.op == "get_attr":
            attrs[str(n.target)] = getattr(stage.backward, str(n.target))
        env_b[n] = graph.node_copy(n, env_b.__getitem__)

    for n in stage.backward.graph.nodes:
        if n.op == "placeholder":
            continue
        if (
            n.op == "call_function"
            and is_view_op(n.target)
            and any(saved_of.get(a) in recomputed for a in n.all_input_nodes)
        ):
            deferred.add(n)  # an alias of a re-run value (autograd's early ``detach``): made where first read
            continue
        emit(n)
    root = torch.nn.Module()
    for name, value in attrs.items():
        setattr(root, name, value)
    gm = fx.GraphModule(root, graph, class_name="AutoplanStageBackward")
    gm.recompile()
    return gm
