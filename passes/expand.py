r"""Pass — repeated blocks: solve one block for all of its copies, then apply it to every copy.

Contract
--------
Input: the program traced with ``kept`` blocks (:mod:`autoplan.passes.depth`), its
:class:`~autoplan.passes.layers.Layering`, and the model's real number of blocks ``L``.

* :func:`block_multiplicity`: how many blocks of the full model each node stands for: the last
  traced block stands for blocks ``kept .. L`` (``m = L - kept + 1``), every other node for
  itself (``m = 1``).
* :func:`scale_problem`: the cost problem of the full model with the copies' decision variables
  shared (they are the representative's)::

      t'[v,s] = m(v) t[v,s]        c'[e,p,q] = m(consumer(e)) c[e,p,q]
      k'[v,s] = m(v) k[v,s]        b'[a,s] = m(u(a)) b[a,s]        g'[p,s] = m(p) g[p,s]

  An edge is counted once per copy of its consumer: the edges from the prologue into every
  block by those into the representative, the edge from the last block into the epilogue
  once. An edge from block 0 into the representative stands for block 0 -> 1 once and for
  the ``m - 1`` edges block ``i`` -> ``i+1`` (``i >= 1``) whose producer is itself a copy of
  the representative: those become a *twin* edge from the representative's own node at the
  same position (:func:`twins`). The objective of a plan that repeats the representative's
  placements on every copy is then exactly the full model's objective. Memory points keep their positions: a point after
  the representative's forward counts ``m`` blocks' saved activations, like the full model at
  the end of its forward.
* :func:`expand_assignment`: the placements of the reduced program applied to the full one:
  node ``j`` of segment ``s`` takes the strategy of node ``j`` of the representative of ``s``
  (prologue, block 0, block 1 for blocks ``1 .. L-1``, epilogue), after checking the two
  segments run the same ops; parameters map by name (``<blocks>.<i>.`` -> ``<blocks>.<rep>.``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch.fx as fx

from autoplan.cost_models.errors import PlanMismatchError
from autoplan.passes.costing import CostProblem, Edge
from autoplan.passes.layers import Layering
from autoplan.passes.strategies import Strategy
from autoplan.passes.trace import TracedProgram, param_node_name


def block_multiplicity(layering: Layering, num_blocks: int) -> dict[str, int]:
    """Node name -> number of full-model nodes it stands for (see the module docstring)."""
    rep = layering.num_blocks  # segment of the last traced block
    copies = num_blocks - layering.num_blocks + 1
    if copies <= 1 or rep < 1:
        return {}
    mult = {name: copies for name, seg in layering.segment_of.items() if seg == rep}
    mult.update({name: copies for name, segs in layering.param_segments.items() if segs == (rep,)})
    return mult


def twins(gm: fx.GraphModule, layering: Layering) -> dict[str, str]:
    """Node of block 0 -> the node at the same position of the representative (last traced)
    block, when the two blocks run the same ops (else ``{}``: edges keep their producer)."""
    rep = layering.num_blocks
    if rep < 2:
        return {}
    nodes = _segment_nodes(gm, layering)
    prev, last = nodes.get(rep - 1, []), nodes.get(rep, [])
    if len(prev) != len(last) or any(_op(a) != _op(b) for a, b in zip(prev, last, strict=False)):
        return {}
    return {a.name: b.name for a, b in zip(prev, last, strict=True)}


def _scaled(edge: Edge, weight: float) -> Edge:
    return edge if weight == 1 else dataclasses.replace(edge, cost_s=edge.cost_s.scaled(weight))


def scale_problem(problem: CostProblem, mult: Mapping[str, int], twin: Mapping[str, str] | None = None) -> CostProblem:
    """``problem`` with every term multiplied by the copies its node or edge stands for
    (``twin``: :func:`twins`, for the block-to-block edges)."""
    if not mult:
        return problem
    twin = twin or {}

    def m(node: str) -> int:
        return mult.get(node, 1)

    edges: list[Edge] = []
    for e in problem.edges:
        w, src = m(e.consumer), e.producer.node
        if w > 1 and m(src) == 1 and src in twin:
            edges.append(e)  # block 0 -> block 1, once
            edges.append(
                _scaled(dataclasses.replace(e, producer=dataclasses.replace(e.producer, node=twin[src])), w - 1)
            )
        else:
            edges.append(_scaled(e, w))
    return dataclasses.replace(
        problem,
        node_time_s={n: [t * m(n) for t in ts] for n, ts in problem.node_time_s.items()},
        persistent_bytes={n: [b * m(n) for b in bs] for n, bs in problem.persistent_bytes.items()},
        value_bytes={a: [b * m(a.node) for b in bs] for a, bs in problem.value_bytes.items()},
        grad_bytes={p: [b * m(p) for b in bs] for p, bs in problem.grad_bytes.items()},
        edges=edges,
    )


def _segment_nodes(gm: fx.GraphModule, layering: Layering) -> dict[int, list[fx.Node]]:
    out: dict[int, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.name in layering.segment_of and not n.name.startswith("p_"):
            out.setdefault(layering.segment_of[n.name], []).append(n)
    return out


def _representative(seg: int, full: Layering, reduced: Layering) -> int:
    if seg == full.num_segments - 1:
        return reduced.num_segments - 1
    return min(seg, reduced.num_blocks)


def _rep_param(fqn: str, block_list: str, kept: int) -> str:
    head = f"{block_list}."
    if not block_list or not fqn.startswith(head):
        return fqn
    idx, _, rest = fqn[len(head) :].partition(".")
    if idx.isdigit() and int(idx) >= kept:
        return f"{head}{kept - 1}.{rest}"
    return fqn


def expand_assignment(
    assignment: Mapping[str, Strategy],
    reduced: tuple[TracedProgram, Layering],
    full: tuple[TracedProgram, Layering],
    *,
    block_list: str,
) -> dict[str, Strategy]:
    """Strategies for every node of the full program from those of the reduced one."""
    (r_traced, r_lay), (f_traced, f_lay) = reduced, full
    r_nodes = _segment_nodes(r_traced.graph_module, r_lay)
    f_nodes = _segment_nodes(f_traced.graph_module, f_lay)
    out: dict[str, Strategy] = {}
    for seg, nodes in f_nodes.items():
        rep = r_nodes.get(_representative(seg, f_lay, r_lay), [])
        if len(rep) != len(nodes) or any(_op(a) != _op(b) for a, b in zip(nodes, rep, strict=False)):
            raise PlanMismatchError(
                f"the plan's repeated block does not match {f_lay.segment_name(seg)} of this model "
                f"({len(nodes)} ops vs {len(rep)} in the planned block): re-plan for this model"
            )
        for a, b in zip(nodes, rep, strict=True):
            if b.name in assignment:
                out[a.name] = assignment[b.name]
    for fqn in f_traced.param_names:
        src = param_node_name(_rep_param(fqn, block_list, r_lay.num_blocks))
        if src not in assignment:
            raise PlanMismatchError(f"the plan has no placement for parameter {fqn}: re-plan for this model")
        out[param_node_name(fqn)] = assignment[src]
    for n in f_traced.graph_module.graph.nodes:  # inputs, targets, buffers: same names
        if n.op == "placeholder" and n.name not in out and n.name in assignment:
            out[n.name] = assignment[n.name]
    return out


def _op(n: fx.Node) -> tuple[str, str]:
    val = n.meta.get("val")
    shape = str(tuple(val.shape)) if hasattr(val, "shape") else ""
    return str(n.target), shape


__all__ = ["block_multiplicity", "expand_assignment", "scale_problem", "twins"]
