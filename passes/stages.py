"""Pass 6 — stages: cut the generated per-rank program into pipeline-stage programs.

Contract
--------
Input: the per-rank program of :func:`autoplan.runtime.codegen.generate_program` built with
``defer_grad_conversions=True`` (parameter gradients leave raw), or converting them in the
backward with windows and buckets cut at ``stage_starts`` (each stage converts its own parameters'
gradients; a parameter tied across stages stays raw, ``deferred_grads``), possibly taking the
earlier micro-batches' summed gradients as trailing arguments (``accumulated_grad_inputs=True``),
the traced step it came from,
its :class:`~autoplan.passes.layers.Layering`, the assignment, and ``stage_starts`` (``stage_starts[k]``
is the first segment of stage ``k``; stages are contiguous segment ranges, ``stage_starts[0] == 0``).

Output: a :class:`StageSplit` with, per stage ``s``, a :class:`StageProgram`:

* ``forward(*params, *buffers, *inputs, *targets) -> (*outputs, *saved)``: ``inputs`` are the
  boundary values of earlier stages this stage or a later one needs (stage 0: the model inputs),
  ``targets`` the loss targets (the last stage only: they enter it directly, from the data the
  last-stage ranks load, and never cross a boundary), ``outputs`` the values later stages need
  (the last stage: the loss), ``saved`` what its own backward reads;
* ``backward(*params, *buffers, *saved, *output_grads, *accumulated) -> (*input_grads, *param_grads)``:
  ``output_grads`` are the gradients of its outputs that later stages produce, ``input_grads``
  the gradients of its inputs (``None`` slots are left out of both signatures), ``param_grads``
  this stage's raw parameter gradients (in the producer's placement; the caller converts them to
  the parameter's placement after the last micro-batch, which is exact because every
  conversion is linear), or, where the program converts them itself, the converted ones;
  ``accumulated`` the program's summed-gradient arguments that this stage's ops read, in
  ``StageProgram.accumulated_grads`` order (none unless ``accumulated_grad_inputs``).

Where each node goes:

* forward ops: the stage of their segment; ``getitem`` follows its producer;
* backward ops that read a forward value or a single-stage parameter ("anchored"): the stage of
  their segment, raised to the latest stage among those forward inputs;
* other backward ops (views of gradients, gradient accumulation): a single-input one runs where
  its consumers are (the latest of their stages), a multi-input one where its inputs all exist
  (the earliest of their stages), so a gradient crosses a stage boundary once, summed;
* collectives inserted before a consumer: the consumer's stage (a gradient conversion the output
  reads: the stage of the parameters it converts); constants (nodes depending on no placeholder)
  are recomputed by every program that reads them;
* model inputs: stage 0; loss targets: the last stage (the loss and everything reading a target
  is in the epilogue, which the last stage holds; an op of an earlier stage reading a target is
  an :class:`UnsupportedModelError`).

A value used ``k`` stages later is passed through the stages between (and its gradient back).
A gradient crossing boundary ``k`` is matched to the boundary value of the same shape and dtype
that needs a gradient; an ambiguous match is an :class:`UnsupportedModelError`. A parameter read
by several stages (a tied embedding) gets a copy on each: the gradient accumulation ``add`` that
joined the stages' contributions is split, each stage returns its own partial gradient, and
the caller sums the copies' gradients across stages (``StageSplit.tied_params``). A frozen
parameter is read like any other but has no gradient (``TracedProgram.trainable_names``): it is
in no stage's ``param_grads``, and a value computed from frozen parameters and inputs alone
crosses a boundary without a gradient.
Checked after the split: every op in exactly one stage program, every value read where it exists.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx as fx

from autoplan.cost_models.errors import PlanError, UnsupportedModelError
from autoplan.passes.layers import Layering
from autoplan.passes.placement import Spec, replicated
from autoplan.passes.strategies import Strategy
from autoplan.passes.trace import TracedProgram, param_node_name

Phase = Literal["fwd", "bwd"]

ACCUMULATED_GRAD_META = "autoplan.accumulated_grad"
"""``node.meta`` key on a generated program's placeholder of a parameter's gradient summed over
earlier micro-batches (``generate_program(accumulated_grad_inputs=True)``): the parameter's FQN.
Such a placeholder is no batch input: the stage whose ops read it takes it in its backward."""

RECOMPUTED_META = "autoplan.recomputed"
"""``node.meta`` key on the forward ops a selectively recomputed backward re-runs
(:mod:`autoplan.passes.recompute`); :func:`split_backward` keeps them in B, where the step model
prices recomputation."""


@dataclass(frozen=True, slots=True)
class ValueInfo:
    """A value crossing a program boundary: enough to rebuild the DTensor from its local shard."""

    name: str
    """Node name in the generated program."""
    spec: Spec | None
    """Placement on the stage mesh; ``None``: a plain tensor, the same on every rank."""
    shape: tuple[int, ...]
    """Global shape."""
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    def __str__(self) -> str:
        return f"{self.name}{list(self.shape)}"


@dataclass(frozen=True, kw_only=True, slots=True)
class StageProgram:
    """The forward and backward programs of one pipeline stage (see the module docstring)."""

    index: int
    param_names: tuple[str, ...]
    """FQNs of the parameters this stage reads (its copies), in placeholder order."""
    buffer_names: tuple[str, ...]
    inputs: tuple[ValueInfo, ...]
    outputs: tuple[ValueInfo, ...]
    saved: tuple[str, ...]
    output_grads: tuple[ValueInfo | None, ...]
    """Per output: the gradient its backward receives (``None``: no gradient flows)."""
    input_grads: tuple[ValueInfo | None, ...]
    """Per input: the gradient its backward returns."""
    targets: tuple[ValueInfo, ...]
    """The loss targets the forward reads after ``inputs`` (the last stage only; no gradient)."""
    param_grads: tuple[tuple[str, ValueInfo], ...]
    """FQN -> raw gradient (partial for a tied parameter), in backward output order."""
    forward: fx.GraphModule
    backward: fx.GraphModule
    accumulated_grads: tuple[str, ...] = ()
    """FQNs whose gradient summed over earlier micro-batches the backward takes after
    ``output_grads`` (:data:`ACCUMULATED_GRAD_META`; empty unless the program has such arguments)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StageSplit:
    stages: tuple[StageProgram, ...]
    tied_params: Mapping[str, tuple[int, ...]]
    """FQN -> the stages holding a copy, for parameters read by more than one stage."""
    stage_of: Mapping[str, int]
    """Generated-program node name -> stage, for every non-constant op."""


def stage_of_segment(layering: Layering, stage_starts: Sequence[int]) -> Callable[[int], int]:
    """Map a segment to its stage; checks ``stage_starts``."""
    n = layering.num_segments
    starts = list(stage_starts)
    if len(starts) > n:
        raise PlanError(
            f"{len(starts)} pipeline stages but the model has only {n} segments (prologue, "
            f"{layering.num_blocks} blocks, epilogue): use at most {n} stages"
        )
    if not starts or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:], strict=False)) or starts[-1] >= n:
        raise PlanError(
            f"stage_starts {starts} must start at 0 and increase strictly below {n} (the number of segments)"
        )
    return lambda seg: max(i for i, s in enumerate(starts) if s <= seg)


def _is_original(n: fx.Node) -> bool:
    return n.op == "call_function" and "autoplan.phase" in n.meta


def split_stages(
    gm: fx.GraphModule,
    traced: TracedProgram,
    layering: Layering,
    assignment: Mapping[str, Strategy],
    *,
    stage_starts: Sequence[int],
    mesh_ndim: int,
) -> StageSplit:
    """Split the generated program ``gm`` into stage programs (see the module docstring)."""
    stage_of_seg = stage_of_segment(layering, stage_starts)
    num_stages = len(stage_starts)
    prog = _read_program(gm, traced)
    param_stages = _layer_param_stages(prog, layering, stage_of_seg)
    removed, tied_leaves = _split_tied_accumulations(prog, traced, param_stages)
    where = _place_forward_and_anchored(prog, layering, stage_of_seg, param_stages, removed, last=num_stages - 1)
    _place_unanchored(prog, traced, param_stages, removed, where, last=num_stages - 1)
    params_of, buffers_of, tied = _params_and_buffers_per_stage(prog, traced, where, removed, num_stages)
    _check_reads(prog, where, removed)
    requires_grad = _requires_grad(prog, traced)
    describe = _Describer(prog, assignment, requires_grad, mesh_ndim=mesh_ndim)
    fwd_out = _forward_boundaries(prog, where, num_stages)
    grad_slot = _gradient_slots(prog, where, fwd_out, requires_grad, num_stages)
    stages = tuple(
        _stage_program(
            gm,
            prog,
            traced,
            where,
            s=s,
            last=num_stages - 1,
            params=params_of[s],
            buffers=buffers_of[s],
            fwd_out=fwd_out,
            grad_slot=grad_slot,
            tied_leaves=tied_leaves,
            describe=describe,
        )
        for s in range(num_stages)
    )
    return StageSplit(
        stages=stages,
        tied_params=tied,
        stage_of={n.name: s for n, s in where.stage.items() if n.op != "placeholder"},
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class _Program:
    """What every phase of :func:`split_stages` reads of the generated program, gathered once."""

    nodes: list[fx.Node]
    output: fx.Node
    loss: fx.Node
    grads: list[fx.Node | None]
    """Per trainable parameter (``TracedProgram.trainable_names`` order): its gradient output."""
    pname_of: dict[str, str]
    """Parameter placeholder name -> FQN."""
    bname_of: dict[str, str]
    """Buffer placeholder name -> FQN."""
    roots: list[fx.Node]
    """The model inputs' placeholders (stage 0 reads them)."""
    targets: list[fx.Node]
    """The loss targets' placeholders (the last stage reads them)."""
    accumulated: list[fx.Node]
    """The placeholders of gradients summed over earlier micro-batches (:data:`ACCUMULATED_GRAD_META`)."""
    ph_by_name: dict[str, fx.Node]
    const: set[fx.Node]
    """Nodes depending on no placeholder: recomputed by every program that reads them."""

    def source(self, a: fx.Node) -> fx.Node:
        """Look through inserted collectives to the value they convert."""
        while a.op == "call_function" and not _is_original(a) and a not in self.const and a.all_input_nodes:
            a = a.all_input_nodes[0]
        return a


@dataclass(frozen=True, slots=True)
class _StageMap:
    """Where each node runs, filled by :func:`_place_forward_and_anchored` then :func:`_place_unanchored`."""

    stage: dict[fx.Node, int]
    phase: dict[fx.Node, Phase]
    anchored: set[fx.Node]
    """Nodes whose stage is fixed by a forward value they read (or that are forward ops)."""
    avail: dict[fx.Node, int]
    """The earliest stage at which the node's value exists."""


def _read_program(gm: fx.GraphModule, traced: TracedProgram) -> _Program:
    """Generated program -> its nodes, loss and gradient outputs, placeholders by kind and constants."""
    nodes = list(gm.graph.nodes)
    output = next(n for n in nodes if n.op == "output")
    loss_node, *grad_nodes = output.args[0]
    pname_of = {param_node_name(f): f for f in traced.param_names}
    bname_of = {"b_" + f.replace(".", "_"): f for f in traced.buffer_names}
    const: set[fx.Node] = set()
    for n in nodes:
        if n.op == "get_attr" or (n.op == "call_function" and all(a in const for a in n.all_input_nodes)):
            const.add(n)
    accumulated = [n for n in nodes if n.op == "placeholder" and ACCUMULATED_GRAD_META in n.meta]
    batch = [
        n
        for n in nodes
        if n.op == "placeholder" and n.name not in pname_of and n.name not in bname_of and n not in accumulated
    ]
    num_inputs = len(batch) - traced.num_targets
    return _Program(
        nodes=nodes,
        output=output,
        loss=loss_node,
        grads=grad_nodes,
        pname_of=pname_of,
        bname_of=bname_of,
        roots=batch[:num_inputs],
        targets=batch[num_inputs:],
        accumulated=accumulated,
        ph_by_name={n.name: n for n in nodes if n.op == "placeholder"},
        const=const,
    )


def param_stages(layering: Layering, stage_of_seg: Callable[[int], int]) -> dict[str, tuple[int, ...]]:
    """Parameter placeholder name -> the stages whose segments read it (several: a parameter tied
    across stages, such as an embedding the last stage reads again)."""
    return {p: tuple(sorted({stage_of_seg(s) for s in segs})) for p, segs in layering.param_segments.items()}


def _layer_param_stages(
    prog: _Program, layering: Layering, stage_of_seg: Callable[[int], int]
) -> dict[str, tuple[int, ...]]:
    """Layering -> per parameter FQN, the stages whose segments read it (a single-stage parameter
    anchors the backward ops that read it)."""
    return {prog.pname_of[p]: st for p, st in param_stages(layering, stage_of_seg).items() if p in prog.pname_of}


def _split_tied_accumulations(
    prog: _Program, traced: TracedProgram, param_stages: Mapping[str, tuple[int, ...]]
) -> tuple[set[fx.Node], dict[str, list[fx.Node]]]:
    """Gradients of parameters read by several stages -> (the gradient-accumulation ``add`` nodes
    and collectives joining the stages' contributions, removed from every program; per FQN the
    contributions, each computed by one stage)."""
    removed: set[fx.Node] = set()
    tied_leaves: dict[str, list[fx.Node]] = {}
    for fqn, g in zip(traced.trainable_names, prog.grads, strict=True):
        if len(param_stages.get(fqn, ())) < 2 or not isinstance(g, fx.Node):
            continue
        leaves: list[fx.Node] = []

        def expand(x: fx.Node, leaves: list[fx.Node] = leaves) -> None:
            if _is_original(x) and x.target is torch.ops.aten.add.Tensor and x.meta["autoplan.phase"] == "bwd":
                removed.add(x)
                for a in x.args[:2]:
                    if isinstance(a, fx.Node):
                        src = prog.source(a)
                        removed.update(_chain(a, src))
                        expand(src)
            else:
                leaves.append(x)

        expand(g)
        tied_leaves[fqn] = leaves
    return removed, tied_leaves


def _place_forward_and_anchored(
    prog: _Program,
    layering: Layering,
    stage_of_seg: Callable[[int], int],
    param_stages: Mapping[str, tuple[int, ...]],
    removed: set[fx.Node],
    *,
    last: int,
) -> _StageMap:
    """Original ops in program order -> the stage of every forward op and anchored backward op,
    and the stage where every other backward value becomes available (the model inputs exist
    in stage 0, the loss targets in the ``last``)."""
    where = _StageMap(stage={}, phase={}, anchored=set(), avail={})
    stage, phase, anchored, avail = where.stage, where.phase, where.anchored, where.avail
    for r in prog.roots:
        stage[r], phase[r] = 0, "fwd"
    for t in prog.targets:
        stage[t], phase[t] = last, "fwd"
    for n in prog.nodes:
        if not _is_original(n) or n in prog.const or n in removed:
            continue
        ph: Phase = n.meta["autoplan.phase"]
        if n.target is operator.getitem:
            parent = n.args[0]
            assert isinstance(parent, fx.Node)
            phase[n], avail[n] = phase[parent], avail[parent]
            if parent in anchored:
                stage[n] = stage[parent]
                anchored.add(n)
            continue
        seg_stage = stage_of_seg(layering.segment_of[n.name])
        phase[n] = ph
        if ph == "fwd":
            stage[n] = avail[n] = seg_stage
            anchored.add(n)
            continue
        fwd_stages: list[int] = []
        bwd_in: list[int] = []
        for a in n.all_input_nodes:
            src = prog.source(a)
            if src in prog.const:
                continue
            if src.name in prog.pname_of:
                ps = param_stages.get(prog.pname_of[src.name], ())
                if len(ps) == 1:
                    fwd_stages.append(ps[0])
            elif src.op == "placeholder":
                if src.name not in prog.bname_of:
                    fwd_stages.append(stage[src])
            elif phase.get(src) == "fwd":
                fwd_stages.append(stage[src])
            else:
                bwd_in.append(avail[src])
        if fwd_stages:
            stage[n] = avail[n] = max(seg_stage, *fwd_stages)
            anchored.add(n)
        else:
            avail[n] = min(bwd_in) if bwd_in else seg_stage
    return where


def _place_unanchored(
    prog: _Program,
    traced: TracedProgram,
    param_stages: Mapping[str, tuple[int, ...]],
    removed: set[fx.Node],
    where: _StageMap,
    *,
    last: int,
) -> None:
    """Completes ``where`` in reverse program order: unanchored backward ops (single input: the
    latest stage of their consumers; several inputs: where they all exist) and inserted
    collectives (their consumer's stage and phase; a gradient conversion the output reads: its
    parameters' stage), then the getitems of unanchored ops."""
    stage, phase = where.stage, where.phase
    param_grad_stage: dict[fx.Node, int] = {}
    for fqn, g in zip(traced.trainable_names, prog.grads, strict=True):
        ps = param_stages.get(fqn, ())
        if isinstance(g, fx.Node) and len(ps) == 1:
            param_grad_stage[g] = ps[0]
    # inserted nodes computed from the backward: a single stage's in-program gradient conversions
    from_bwd: set[fx.Node] = set()
    for n in prog.nodes:
        if not _is_original(n) and any(
            a in from_bwd or (_is_original(a) and a.meta.get("autoplan.phase") == "bwd") for a in n.all_input_nodes
        ):
            from_bwd.add(n)
    for n in reversed(prog.nodes):
        if n.op != "call_function" or n in prog.const or n in removed or n in where.anchored:
            continue
        user_stages = [stage[u] for u in n.users if u in stage]
        if n in param_grad_stage:
            user_stages.append(param_grad_stage[n])
        if not _is_original(n):  # an inserted collective: its consumer's stage and phase
            if n.target is operator.getitem:
                continue  # a coalesced collective's result: resolved below with its parent
            # a coalesced collective's consumers are its getitems' users; it runs where the
            # first of them does (the forward, if any consumer is in the forward)
            consumers = [c for u in n.users for c in (u.users if u.target is operator.getitem else [u])]
            # a gradient conversion (bucket) the output reads: the stage of the parameters it
            # converts (each stage converts its own gradients in its backward)
            grad_stages = {param_grad_stage[x] for x in (n, *n.users) if x in param_grad_stage}
            if prog.output in consumers and n in from_bwd and len(grad_stages) == 1:
                stage[n], phase[n] = grad_stages.pop(), "bwd"
            elif prog.output in consumers:
                stage[n], phase[n] = last, "bwd" if n in from_bwd else "fwd"
            elif n in from_bwd and last == 0:  # (only one stage converts gradients in its program)
                stage[n], phase[n] = last, "bwd"
            else:
                u = min(consumers, key=lambda c: phase[c] != "fwd")
                stage[n], phase[n] = stage[u], phase[u]
            continue
        if n.target is operator.getitem:
            parent = n.args[0]
            assert isinstance(parent, fx.Node)
            continue  # resolved below with its parent
        n_inputs = len({prog.source(a) for a in n.all_input_nodes if prog.source(a) not in prog.const})
        if n_inputs >= 2 or not user_stages:
            stage[n] = where.avail[n]
        else:
            stage[n] = max(user_stages)
        phase[n] = "bwd"
    for n in prog.nodes:  # getitems of unanchored multi-output backward ops and of inserted collectives
        if n.target is operator.getitem and n not in stage and n not in removed:
            parent = n.args[0]
            assert isinstance(parent, fx.Node)
            stage[n], phase[n] = stage[parent], phase[parent]


def _params_and_buffers_per_stage(
    prog: _Program, traced: TracedProgram, where: _StageMap, removed: set[fx.Node], num_stages: int
) -> tuple[list[list[str]], list[list[str]], dict[str, tuple[int, ...]]]:
    """Stage of every op -> per stage the parameter and buffer FQNs its ops read, and the tied
    parameters (read by more than one stage) with their stages."""

    def readers_stages(p: fx.Node) -> set[int]:
        return {where.stage[u] for u in p.users if u in where.stage and u not in removed}

    params_of: list[list[str]] = [[] for _ in range(num_stages)]
    buffers_of: list[list[str]] = [[] for _ in range(num_stages)]
    tied: dict[str, tuple[int, ...]] = {}
    for fqn in traced.param_names:
        ss = sorted(readers_stages(prog.ph_by_name[param_node_name(fqn)]))
        for s in ss:
            params_of[s].append(fqn)
        if len(ss) > 1:
            tied[fqn] = tuple(ss)
    for bname, fqn in prog.bname_of.items():
        for s in sorted(readers_stages(prog.ph_by_name[bname])):
            buffers_of[s].append(fqn)
    return params_of, buffers_of, tied


def _check_reads(prog: _Program, where: _StageMap, removed: set[fx.Node]) -> None:
    """Stage and phase of every op -> raises :class:`UnsupportedModelError` unless every value is
    read where it exists (a forward value at its stage or later, a gradient in the backward of its
    stage or earlier)."""
    stage, phase = where.stage, where.phase
    for n in prog.nodes:
        if n not in stage or n in prog.const:
            continue
        for a in n.all_input_nodes:
            if a in prog.const or a.op == "placeholder" and a not in stage:
                continue
            if a in removed:
                raise UnsupportedModelError(f"{n.name} reads {a.name}, a split gradient accumulation")
            if a in prog.targets and stage[n] < stage[a]:
                raise UnsupportedModelError(
                    f"{n.name} (stage {stage[n]}) reads the loss target {a.name}, which enters the last stage "
                    f"({stage[a]}): read targets only in loss_fn, after the model's last block"
                )
            if phase[a] == "fwd" and stage[n] < stage[a]:
                raise UnsupportedModelError(
                    f"{n.name} (stage {stage[n]}) reads {a.name} of the later stage {stage[a]}: choose other stage starts"
                )
            if phase[a] == "bwd" and (phase[n] == "fwd" or stage[n] > stage[a]):
                raise UnsupportedModelError(
                    f"{n.name} (stage {stage[n]}, {phase[n]}) reads the gradient {a.name} of stage {stage[a]}"
                )


def _requires_grad(prog: _Program, traced: TracedProgram) -> set[fx.Node]:
    """Trainable parameters -> the nodes computed from one of them (the values that need a gradient)."""
    requires_grad: set[fx.Node] = {prog.ph_by_name[param_node_name(f)] for f in traced.trainable_names}
    for n in prog.nodes:
        if n.op == "call_function" and any(a in requires_grad for a in n.all_input_nodes):
            requires_grad.add(n)
    return requires_grad


def _tensor_val(n: fx.Node) -> torch.Tensor:
    """The traced value of a node crossing a stage boundary, which must be a tensor."""
    v = n.meta.get("val")
    if not isinstance(v, torch.Tensor):
        raise UnsupportedModelError(f"{n.name} crosses a stage boundary but is not a tensor")
    return v


class _Describer:
    """Node -> the :class:`ValueInfo` a receiving program rebuilds it from."""

    def __init__(
        self,
        prog: _Program,
        assignment: Mapping[str, Strategy],
        requires_grad: set[fx.Node],
        *,
        mesh_ndim: int,
    ) -> None:
        self.prog = prog
        self.assignment = assignment
        self.requires_grad = requires_grad
        self.mesh_ndim = mesh_ndim

    def spec_of(self, n: fx.Node) -> Spec | None:
        if n.op == "placeholder":
            strat = self.assignment.get(n.name)
            return strat.output_specs[0] if strat is not None else replicated(self.mesh_ndim)
        if n.target is operator.getitem:
            parent, idx = n.args
            assert isinstance(parent, fx.Node) and isinstance(idx, int)
            specs = parent.meta.get("autoplan.output_specs")
            return specs[idx] if specs else None
        specs = n.meta.get("autoplan.output_specs")
        return specs[0] if specs else None

    def __call__(self, n: fx.Node) -> ValueInfo:
        # the loss after its conversion to replicated is the only inserted node that crosses
        src = self.prog.source(n)
        v = _tensor_val(src)
        spec = replicated(self.mesh_ndim) if n is self.prog.loss and src is not n else self.spec_of(n)
        return ValueInfo(
            name=n.name,
            spec=spec,
            shape=tuple(v.shape),
            stride=tuple(v.stride()),
            dtype=v.dtype,
            requires_grad=n in self.requires_grad and v.dtype.is_floating_point,
        )


def _forward_boundaries(prog: _Program, where: _StageMap, num_stages: int) -> list[list[fx.Node]]:
    """Stage of every op -> per boundary ``k`` (stage ``k`` -> ``k + 1``) the forward values
    crossing it: those read by a later stage, passed through every stage in between."""
    fwd_out: list[list[fx.Node]] = [[] for _ in range(num_stages)]
    for x in prog.nodes:
        if x not in where.stage or where.phase[x] != "fwd" or x in prog.const:
            continue
        far = max((where.stage[u] for u in x.users if u in where.stage), default=where.stage[x])
        for k in range(where.stage[x], far):
            fwd_out[k].append(x)
    return fwd_out


def _gradient_slots(
    prog: _Program,
    where: _StageMap,
    fwd_out: Sequence[Sequence[fx.Node]],
    requires_grad: set[fx.Node],
    num_stages: int,
) -> list[dict[fx.Node, fx.Node]]:
    """Boundary values -> per boundary ``k`` the gradient crossing it (stage ``k + 1`` -> ``k``)
    for each boundary value it belongs to (the one value of the same shape and dtype needing a
    gradient; none or several is an :class:`UnsupportedModelError`)."""
    grad_slot: list[dict[fx.Node, fx.Node]] = [{} for _ in range(num_stages)]
    for g in prog.nodes:
        if g not in where.stage or where.phase[g] != "bwd":
            continue
        near = min((where.stage[u] for u in g.users if u in where.stage), default=where.stage[g])
        for k in range(near, where.stage[g]):
            gv = _tensor_val(g)
            cands = [
                v
                for v in fwd_out[k]
                if v in requires_grad
                and tuple(_tensor_val(v).shape) == tuple(gv.shape)
                and _tensor_val(v).dtype == gv.dtype
            ]
            if len(cands) != 1:
                raise UnsupportedModelError(
                    f"the gradient {g.name} {list(gv.shape)} crosses stage boundary {k}|{k + 1} but matches "
                    f"{len(cands)} boundary values ({', '.join(c.name for c in cands) or 'none'}): move the stage start"
                )
            prev = grad_slot[k].get(cands[0])
            if prev is not None and prev is not g:
                raise UnsupportedModelError(
                    f"two gradients ({prev.name}, {g.name}) of boundary value {cands[0].name} cross boundary {k}|{k + 1}"
                )
            grad_slot[k][cands[0]] = g
    return grad_slot


def _stage_param_grads(
    prog: _Program,
    traced: TracedProgram,
    where: _StageMap,
    tied_leaves: Mapping[str, list[fx.Node]],
    s: int,
) -> tuple[list[tuple[str, fx.Node]], dict[str, list[fx.Node]]]:
    """Stage ``s`` -> the parameter gradients its backward returns (FQN, node), and per tied
    parameter the contributions it sums into its partial gradient."""
    pgrads: list[tuple[str, fx.Node]] = []
    extra_adds: dict[str, list[fx.Node]] = {}
    for fqn, g in zip(traced.trainable_names, prog.grads, strict=True):
        if not isinstance(g, fx.Node):
            continue
        if fqn in tied_leaves:
            mine = [leaf for leaf in tied_leaves[fqn] if where.stage[leaf] == s]
            if mine:
                extra_adds[fqn] = mine
                pgrads.append((fqn, mine[0]))
        elif where.stage.get(g) == s and where.phase.get(g) == "bwd":
            pgrads.append((fqn, g))
    return pgrads, extra_adds


def _stage_program(
    gm: fx.GraphModule,
    prog: _Program,
    traced: TracedProgram,
    where: _StageMap,
    *,
    s: int,
    last: int,
    params: Sequence[str],
    buffers: Sequence[str],
    fwd_out: Sequence[list[fx.Node]],
    grad_slot: Sequence[Mapping[fx.Node, fx.Node]],
    tied_leaves: Mapping[str, list[fx.Node]],
    describe: _Describer,
) -> StageProgram:
    """Stage ``s``'s ops, boundary values and gradients -> its forward and backward programs."""
    nodes, stage, phase = prog.nodes, where.stage, where.phase
    fwd_in: list[fx.Node] = prog.roots if s == 0 else fwd_out[s - 1]
    targets: list[fx.Node] = prog.targets if s == last else []
    body_f = [n for n in nodes if stage.get(n) == s and phase.get(n) == "fwd" and n.op != "placeholder"]
    body_b = [n for n in nodes if stage.get(n) == s and phase.get(n) == "bwd"]
    outs: list[fx.Node] = [prog.loss] if s == last else fwd_out[s]
    fwd_values = set(fwd_in) | set(targets) | set(body_f)
    body_b_set = set(body_b)
    saved = [x for x in nodes if x in fwd_values and any(u in body_b_set for u in x.users)]
    out_grad_nodes = [None if s == last else grad_slot[s].get(v) for v in outs]
    in_grad_nodes = [None if s == 0 else grad_slot[s - 1].get(v) for v in fwd_in]
    pgrads, extra_adds = _stage_param_grads(prog, traced, where, tied_leaves, s)
    accumulated = [a for a in prog.accumulated if any(stage.get(u) == s for u in a.users)]
    fwd_gm = _build(
        gm,
        inputs=[
            *(prog.ph_by_name[param_node_name(f)] for f in params),
            *(_buffer_node(prog.ph_by_name, f) for f in buffers),
            *fwd_in,
            *targets,
        ],
        input_names=None,
        body=body_f,
        outputs=[*outs, *saved],
        const=prog.const,
    )
    grads_in_ph = [g for g in out_grad_nodes if g is not None]
    bwd_gm, pgrad_infos = _build_backward(
        gm,
        params=[prog.ph_by_name[param_node_name(f)] for f in params],
        buffers=[_buffer_node(prog.ph_by_name, f) for f in buffers],
        saved=saved,
        grads_in=grads_in_ph,
        accumulated=accumulated,
        body=body_b,
        input_grads=[g for g in in_grad_nodes if g is not None],
        param_grads=pgrads,
        extra_adds=extra_adds,
        const=prog.const,
        info=describe,
    )
    return StageProgram(
        index=s,
        param_names=tuple(params),
        buffer_names=tuple(buffers),
        inputs=tuple(describe(x) for x in fwd_in),
        outputs=tuple(describe(x) for x in outs),
        saved=tuple(x.name for x in saved),
        output_grads=tuple(None if g is None else describe(g) for g in out_grad_nodes),
        input_grads=tuple(None if g is None else describe(g) for g in in_grad_nodes),
        targets=tuple(describe(t) for t in targets),
        param_grads=tuple(pgrad_infos),
        forward=fwd_gm,
        backward=bwd_gm,
        accumulated_grads=tuple(a.meta[ACCUMULATED_GRAD_META] for a in accumulated),
    )


def _chain(a: fx.Node, src: fx.Node) -> list[fx.Node]:
    out = []
    while a is not src:
        out.append(a)
        a = a.all_input_nodes[0]
    return out


def _buffer_node(ph_by_name: Mapping[str, fx.Node], fqn: str) -> fx.Node:
    return ph_by_name["b_" + fqn.replace(".", "_")]


class _Copier:
    """Copies nodes of the generated program into a new graph, recomputing constants on demand."""

    def __init__(self, src: fx.GraphModule, const: set[fx.Node]) -> None:
        self.src = src
        self.const = const
        self.graph = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}

    def placeholder(self, n: fx.Node, name: str | None = None) -> fx.Node:
        ph = self.graph.placeholder(name or n.name)
        ph.meta = dict(n.meta)
        self.env[n] = ph
        return ph

    def lookup(self, a: fx.Node) -> fx.Node:
        if a not in self.env:
            if a not in self.const:
                raise AssertionError(f"stage program reads {a.name}, which it neither computes nor receives")
            self.copy(a)
        return self.env[a]

    def copy(self, n: fx.Node) -> fx.Node:
        if n.op == "get_attr":
            new = self.graph.get_attr(str(n.target))
        else:
            new = self.graph.node_copy(n, self.lookup)
        self.env[n] = new
        return new

    def finish(self, outputs: Sequence[fx.Node], class_name: str) -> fx.GraphModule:
        self.graph.output(tuple(self.env[o] if o in self.env else self.lookup(o) for o in outputs))
        root = torch.nn.Module()
        for n in self.graph.nodes:
            if n.op == "get_attr":
                setattr(root, str(n.target), getattr(self.src, str(n.target)))
        gm = fx.GraphModule(root, self.graph, class_name=class_name)
        gm.recompile()
        return gm


def _build(
    src: fx.GraphModule,
    *,
    inputs: Sequence[fx.Node],
    input_names: Sequence[str] | None,
    body: Sequence[fx.Node],
    outputs: Sequence[fx.Node],
    const: set[fx.Node],
) -> fx.GraphModule:
    c = _Copier(src, const)
    for i, n in enumerate(inputs):
        c.placeholder(n, input_names[i] if input_names else None)
    for n in body:
        c.copy(n)
    return c.finish(outputs, "AutoplanStageForward")


def _build_backward(
    src: fx.GraphModule,
    *,
    params: Sequence[fx.Node],
    buffers: Sequence[fx.Node],
    saved: Sequence[fx.Node],
    grads_in: Sequence[fx.Node],
    accumulated: Sequence[fx.Node],
    body: Sequence[fx.Node],
    input_grads: Sequence[fx.Node],
    param_grads: Sequence[tuple[str, fx.Node]],
    extra_adds: Mapping[str, Sequence[fx.Node]],
    const: set[fx.Node],
    info: Callable[[fx.Node], ValueInfo],
) -> tuple[fx.GraphModule, list[tuple[str, ValueInfo]]]:
    c = _Copier(src, const)
    for n in [*params, *buffers, *saved]:
        c.placeholder(n)
    for g in grads_in:
        c.placeholder(g, f"grad_{g.name}")
    for a in accumulated:
        c.placeholder(a)
    for n in body:
        c.copy(n)
    outs = [c.env[g] for g in input_grads]
    infos = []
    for fqn, g in param_grads:
        leaves = extra_adds.get(fqn)
        if leaves:  # a tied parameter: this stage's contributions only
            specs = {info(x).spec for x in leaves}
            if len(specs) != 1:
                raise UnsupportedModelError(f"the gradient contributions of {fqn} in one stage differ in placement")
            acc = c.env[leaves[0]]
            for x in leaves[1:]:
                acc = c.graph.call_function(torch.ops.aten.add.Tensor, (acc, c.env[x]))
            outs.append(acc)
        else:
            outs.append(c.env[g])
        infos.append((fqn, info(g)))
    c.graph.output(tuple(outs))
    root = torch.nn.Module()
    for n in c.graph.nodes:
        if n.op == "get_attr":
            setattr(root, str(n.target), getattr(src, str(n.target)))
    gm = fx.GraphModule(root, c.graph, class_name="AutoplanStageBackward")
    gm.recompile()
    return gm, infos


def split_backward(gm: fx.GraphModule, num_input_grads: int) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Split a stage's backward program into its input-gradient part and its weight-gradient part
    (the B and W of zero-bubble schedules).

    ``gm`` returns ``(*input_grads, *param_grads)`` with ``num_input_grads`` input gradients. The
    B program holds every op the input gradients depend on and returns ``(*input_grads,
    *carry)``; the W program takes ``carry`` (the B values and placeholders the remaining ops
    read) and returns the parameter gradients. Running B then W computes exactly what ``gm``
    does; each op runs in exactly one of them. Forward ops a selective backward re-runs
    (``meta["autoplan.recomputed"]``, :mod:`autoplan.passes.recompute`) run in B, where the step
    model prices recomputation."""
    graph = gm.graph
    out = next(n for n in graph.nodes if n.op == "output")
    outs = list(out.args[0])
    in_outs, w_outs = outs[:num_input_grads], outs[num_input_grads:]

    def ancestors(roots: Sequence[object]) -> set[fx.Node]:
        seen: set[fx.Node] = set()
        stack = [r for r in roots if isinstance(r, fx.Node)]
        while stack:
            n = stack.pop()
            if n not in seen:
                seen.add(n)
                stack.extend(n.all_input_nodes)
        return seen

    need_b = ancestors([*in_outs, *(n for n in graph.nodes if n.meta.get(RECOMPUTED_META))])
    need_w = {n for n in ancestors(w_outs) if n not in need_b and n.op != "placeholder"}
    carry = [
        n
        for n in graph.nodes
        if (n in need_b or n.op == "placeholder") and (n in w_outs or any(u in need_w for u in n.users))
    ]

    b_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        if n.op == "placeholder" or (n in need_b and n.op != "output"):
            env[n] = b_graph.node_copy(n, lambda a: env[a])
    b_graph.output((*(env[o] if isinstance(o, fx.Node) else o for o in in_outs), *(env[c] for c in carry)))

    w_graph = fx.Graph()
    wenv: dict[fx.Node, fx.Node] = {}
    for c in carry:
        wenv[c] = w_graph.placeholder(f"carry_{c.name}")
    for n in graph.nodes:
        if n in need_w:
            wenv[n] = w_graph.node_copy(n, lambda a: wenv[a])
    w_graph.output(tuple(wenv[o] if isinstance(o, fx.Node) else o for o in w_outs))
    b_gm = fx.GraphModule(gm, b_graph, class_name="StageBackwardInput")
    w_gm = fx.GraphModule(gm, w_graph, class_name="StageBackwardWeight")
    return b_gm, w_gm
