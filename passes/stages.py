"""Pass 6 — stages: cut the generated per-rank program into pipeline-stage programs.

Contract
--------
Input: the per-rank program of :func:`autoplan.runtime.codegen.generate_program` built with
``defer_grad_conversions=True`` (parameter gradients leave raw), the traced step it came from,
its :class:`~autoplan.passes.layers.Layering`, the assignment, and ``stage_starts`` (``stage_starts[k]``
is the first segment of stage ``k``; stages are contiguous segment ranges, ``stage_starts[0] == 0``).

Output: a :class:`StageSplit` with, per stage ``s``, a :class:`StageProgram`:

* ``forward(*params, *buffers, *inputs) -> (*outputs, *saved)``: ``inputs`` are the boundary
  values of earlier stages this stage or a later one needs (stage 0: the model inputs and the
  loss targets, which are passed on like any value), ``outputs`` the values later stages need
  (the last stage: the loss), ``saved`` what its own backward reads;
* ``backward(*params, *buffers, *saved, *output_grads) -> (*input_grads, *param_grads)``:
  ``output_grads`` are the gradients of its outputs that later stages produce, ``input_grads``
  the gradients of its inputs (``None`` slots are left out of both signatures), ``param_grads``
  this stage's raw parameter gradients (in the producer's placement; the caller converts them to
  the parameter's placement after the last micro-batch, which is exact because every
  conversion is linear).

Where each node goes:

* forward ops: the stage of their segment; ``getitem`` follows its producer;
* backward ops that read a forward value or a single-stage parameter ("anchored"): the stage of
  their segment, raised to the latest stage among those forward inputs;
* other backward ops (views of gradients, gradient accumulation): a single-input one runs where
  its consumers are (the latest of their stages), a multi-input one where its inputs all exist
  (the earliest of their stages), so a gradient crosses a stage boundary once, summed;
* collectives inserted before a consumer: the consumer's stage; constants (nodes depending on
  no placeholder) are recomputed by every program that reads them.

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
    param_grads: tuple[tuple[str, ValueInfo], ...]
    """FQN -> raw gradient (partial for a tied parameter), in backward output order."""
    forward: fx.GraphModule
    backward: fx.GraphModule


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
    last = num_stages - 1
    graph = gm.graph
    nodes = list(graph.nodes)
    output = next(n for n in nodes if n.op == "output")
    loss_node, *grad_nodes = output.args[0]
    pname_of = {param_node_name(f): f for f in traced.param_names}
    bname_of = {"b_" + f.replace(".", "_"): f for f in traced.buffer_names}
    roots = [n for n in nodes if n.op == "placeholder" and n.name not in pname_of and n.name not in bname_of]

    # --- constants ---------------------------------------------------------------------------
    const: set[fx.Node] = set()
    for n in nodes:
        if n.op == "get_attr" or (n.op == "call_function" and all(a in const for a in n.all_input_nodes)):
            const.add(n)

    def source(a: fx.Node) -> fx.Node:
        """Look through inserted collectives to the value they convert."""
        while a.op == "call_function" and not _is_original(a) and a not in const and a.all_input_nodes:
            a = a.all_input_nodes[0]
        return a

    # --- parameters: single-stage ones anchor backward ops -----------------------------------
    layer_param_stages = {
        pname_of[p]: tuple(sorted({stage_of_seg(s) for s in segs}))
        for p, segs in layering.param_segments.items()
        if p in pname_of
    }

    stage: dict[fx.Node, int] = {}
    phase: dict[fx.Node, Phase] = {}
    for r in roots:
        stage[r], phase[r] = 0, "fwd"
    anchored: set[fx.Node] = set()
    avail: dict[fx.Node, int] = {}

    # tied parameters: split the gradient-accumulation add tree into per-stage contributions
    removed: set[fx.Node] = set()
    tied_leaves: dict[str, list[fx.Node]] = {}
    for fqn, g in zip(traced.trainable_names, grad_nodes, strict=True):
        if len(layer_param_stages.get(fqn, ())) < 2 or not isinstance(g, fx.Node):
            continue
        leaves: list[fx.Node] = []

        def expand(x: fx.Node, leaves: list[fx.Node] = leaves) -> None:
            if _is_original(x) and x.target is torch.ops.aten.add.Tensor and x.meta["autoplan.phase"] == "bwd":
                removed.add(x)
                for a in x.args[:2]:
                    if isinstance(a, fx.Node):
                        src = source(a)
                        removed.update(_chain(a, src))
                        expand(src)
            else:
                leaves.append(x)

        expand(g)
        tied_leaves[fqn] = leaves

    # pass 1 (program order): forward ops, anchored backward ops, availability of the rest
    for n in nodes:
        if not _is_original(n) or n in const or n in removed:
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
            src = source(a)
            if src in const:
                continue
            if src.name in pname_of:
                ps = layer_param_stages.get(pname_of[src.name], ())
                if len(ps) == 1:
                    fwd_stages.append(ps[0])
            elif src.op == "placeholder":
                if src.name not in bname_of:
                    fwd_stages.append(0)
            elif phase.get(src) == "fwd":
                fwd_stages.append(stage[src])
            else:
                bwd_in.append(avail[src])
        if fwd_stages:
            stage[n] = avail[n] = max(seg_stage, *fwd_stages)
            anchored.add(n)
        else:
            avail[n] = min(bwd_in) if bwd_in else seg_stage

    # pass 2 (reverse): unanchored backward ops and inserted collectives
    param_grad_stage: dict[fx.Node, int] = {}
    for fqn, g in zip(traced.trainable_names, grad_nodes, strict=True):
        ps = layer_param_stages.get(fqn, ())
        if isinstance(g, fx.Node) and len(ps) == 1:
            param_grad_stage[g] = ps[0]
    for n in reversed(nodes):
        if n.op != "call_function" or n in const or n in removed or n in anchored:
            continue
        user_stages = [stage[u] for u in n.users if u in stage]
        if n in param_grad_stage:
            user_stages.append(param_grad_stage[n])
        if not _is_original(n):  # an inserted collective: its consumer's stage and phase
            if output in n.users:
                stage[n], phase[n] = last, "fwd"
            else:
                u = next(iter(n.users))
                stage[n], phase[n] = stage[u], phase[u]
            continue
        if n.target is operator.getitem:
            parent = n.args[0]
            assert isinstance(parent, fx.Node)
            continue  # resolved below with its parent
        n_inputs = len({source(a) for a in n.all_input_nodes if source(a) not in const})
        if n_inputs >= 2 or not user_stages:
            stage[n] = avail[n]
        else:
            stage[n] = max(user_stages)
        phase[n] = "bwd"
    for n in nodes:  # getitems of unanchored multi-output backward ops
        if _is_original(n) and n.target is operator.getitem and n not in stage and n not in removed:
            parent = n.args[0]
            assert isinstance(parent, fx.Node)
            stage[n], phase[n] = stage[parent], phase[parent]

    # --- parameters and buffers per stage ------------------------------------------------------
    def readers_stages(p: fx.Node) -> set[int]:
        return {stage[u] for u in p.users if u in stage and u not in removed}

    params_of: list[list[str]] = [[] for _ in range(num_stages)]
    buffers_of: list[list[str]] = [[] for _ in range(num_stages)]
    tied: dict[str, tuple[int, ...]] = {}
    ph_by_name = {n.name: n for n in nodes if n.op == "placeholder"}
    for fqn in traced.param_names:
        ss = sorted(readers_stages(ph_by_name[param_node_name(fqn)]))
        for s in ss:
            params_of[s].append(fqn)
        if len(ss) > 1:
            tied[fqn] = tuple(ss)
    for bname, fqn in bname_of.items():
        for s in sorted(readers_stages(ph_by_name[bname])):
            buffers_of[s].append(fqn)

    # --- check: every value read where it exists ----------------------------------------------
    for n in nodes:
        if n not in stage or n in const:
            continue
        for a in n.all_input_nodes:
            if a in const or a.op == "placeholder" and a not in stage:
                continue
            if a in removed:
                raise UnsupportedModelError(f"{n.name} reads {a.name}, a split gradient accumulation")
            if phase[a] == "fwd" and stage[n] < stage[a]:
                raise UnsupportedModelError(
                    f"{n.name} (stage {stage[n]}) reads {a.name} of the later stage {stage[a]}: choose other stage starts"
                )
            if phase[a] == "bwd" and (phase[n] == "fwd" or stage[n] > stage[a]):
                raise UnsupportedModelError(
                    f"{n.name} (stage {stage[n]}, {phase[n]}) reads the gradient {a.name} of stage {stage[a]}"
                )

    # --- boundary values ------------------------------------------------------------------------
    requires_grad: set[fx.Node] = {ph_by_name[param_node_name(f)] for f in traced.trainable_names}
    for n in nodes:
        if n.op == "call_function" and any(a in requires_grad for a in n.all_input_nodes):
            requires_grad.add(n)

    def val(n: fx.Node) -> torch.Tensor:
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor):
            raise UnsupportedModelError(f"{n.name} crosses a stage boundary but is not a tensor")
        return v

    def spec_of(n: fx.Node) -> Spec | None:
        if n.op == "placeholder":
            strat = assignment.get(n.name)
            return strat.output_specs[0] if strat is not None else replicated(mesh_ndim)
        if n.target is operator.getitem:
            parent, idx = n.args
            assert isinstance(parent, fx.Node) and isinstance(idx, int)
            specs = parent.meta.get("autoplan.output_specs")
            return specs[idx] if specs else None
        specs = n.meta.get("autoplan.output_specs")
        return specs[0] if specs else None

    def info(n: fx.Node) -> ValueInfo:
        # the loss after its conversion to replicated is the only inserted node that crosses
        v = val(source(n))
        spec = replicated(mesh_ndim) if n is loss_node and source(n) is not n else spec_of(n)
        return ValueInfo(
            name=n.name,
            spec=spec,
            shape=tuple(v.shape),
            stride=tuple(v.stride()),
            dtype=v.dtype,
            requires_grad=n in requires_grad and v.dtype.is_floating_point,
        )

    fwd_out: list[list[fx.Node]] = [[] for _ in range(num_stages)]
    for x in nodes:
        if x not in stage or phase[x] != "fwd" or x in const:
            continue
        far = max((stage[u] for u in x.users if u in stage), default=stage[x])
        for k in range(stage[x], far):
            fwd_out[k].append(x)
    # a gradient crossing boundary k (stage k+1 -> k) rides with the boundary value it belongs to
    grad_slot: list[dict[fx.Node, fx.Node]] = [{} for _ in range(num_stages)]
    for g in nodes:
        if g not in stage or phase[g] != "bwd":
            continue
        near = min((stage[u] for u in g.users if u in stage), default=stage[g])
        for k in range(near, stage[g]):
            gv = val(g)
            cands = [
                v
                for v in fwd_out[k]
                if v in requires_grad and tuple(val(v).shape) == tuple(gv.shape) and val(v).dtype == gv.dtype
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

    # --- programs -----------------------------------------------------------------------------------
    stages_out = []
    for s in range(num_stages):
        fwd_in: list[fx.Node] = roots if s == 0 else fwd_out[s - 1]
        body_f = [n for n in nodes if stage.get(n) == s and phase.get(n) == "fwd" and n.op != "placeholder"]
        body_b = [n for n in nodes if stage.get(n) == s and phase.get(n) == "bwd"]
        outs: list[fx.Node] = [loss_node] if s == last else fwd_out[s]
        fwd_values = set(fwd_in) | set(body_f)
        body_b_set = set(body_b)
        saved = [x for x in nodes if x in fwd_values and any(u in body_b_set for u in x.users)]
        out_grad_nodes = [None if s == last else grad_slot[s].get(v) for v in outs]
        in_grad_nodes = [None if s == 0 else grad_slot[s - 1].get(v) for v in fwd_in]
        pgrads: list[tuple[str, fx.Node]] = []
        extra_adds: dict[str, list[fx.Node]] = {}
        for fqn, g in zip(traced.trainable_names, grad_nodes, strict=True):
            if not isinstance(g, fx.Node):
                continue
            if fqn in tied_leaves:
                mine = [leaf for leaf in tied_leaves[fqn] if stage[leaf] == s]
                if mine:
                    extra_adds[fqn] = mine
                    pgrads.append((fqn, mine[0]))
            elif stage.get(g) == s and phase.get(g) == "bwd":
                pgrads.append((fqn, g))
        fwd_gm = _build(
            gm,
            inputs=[
                *(ph_by_name[param_node_name(f)] for f in params_of[s]),
                *(_buffer_node(ph_by_name, f) for f in buffers_of[s]),
                *fwd_in,
            ],
            input_names=None,
            body=body_f,
            outputs=[*outs, *saved],
            const=const,
        )
        grads_in_ph = [g for g in out_grad_nodes if g is not None]
        bwd_gm, pgrad_infos = _build_backward(
            gm,
            params=[ph_by_name[param_node_name(f)] for f in params_of[s]],
            buffers=[_buffer_node(ph_by_name, f) for f in buffers_of[s]],
            saved=saved,
            grads_in=grads_in_ph,
            body=body_b,
            input_grads=[g for g in in_grad_nodes if g is not None],
            param_grads=pgrads,
            extra_adds=extra_adds,
            const=const,
            info=info,
        )
        stages_out.append(
            StageProgram(
                index=s,
                param_names=tuple(params_of[s]),
                buffer_names=tuple(buffers_of[s]),
                inputs=tuple(info(x) for x in fwd_in),
                outputs=tuple(info(x) for x in outs),
                saved=tuple(x.name for x in saved),
                output_grads=tuple(None if g is None else info(g) for g in out_grad_nodes),
                input_grads=tuple(None if g is None else info(g) for g in in_grad_nodes),
                param_grads=tuple(pgrad_infos),
                forward=fwd_gm,
                backward=bwd_gm,
            )
        )
    return StageSplit(
        stages=tuple(stages_out),
        tied_params=tied,
        stage_of={n.name: s for n, s in stage.items() if n.op != "placeholder"},
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
    does; each op runs in exactly one of them."""
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

    need_b = ancestors(in_outs)
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
