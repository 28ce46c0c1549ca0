r"""Pass 4b — explain: what each node's other strategies would have cost, the rest of the plan fixed.

Contract: input a :class:`~autoplan.passes.costing.CostProblem` and the solver's choice (strategy index per
node); output, per node with more than one strategy, its alternatives priced against the chosen
neighbours. Nothing is re-solved and the graph is not touched.

For node :math:`v` with chosen strategy :math:`s^*` and any strategy :math:`s`, the other nodes
held at their chosen strategies::

    cost(v, s)  = t[v,s] + sum_{e into v} c[e, p_e, q_v(s)] + sum_{e out of v} c[e, p_v(s), q_e]
    delta(v, s) = cost(v, s) - cost(v, s*)

which is exactly how much the ILP objective would change if ``v`` alone switched (node times and
the edges touching ``v`` are the only terms of the objective that depend on ``x[v,.]``) -- except
that ``edge_tied`` makes ``v``'s *followers* (views and elementwise ops reading ``v``, and theirs)
switch with it: each follower ``f`` takes the cheapest of its strategies accepting the spec
``p_v(s)``, and its time and untied edges are added to ``cost(v, s)``::

    cost(v, s) += sum_{f follows v}  min_{s_f in S_f(p_v(s))}  cost(f, s_f)

At an optimum no feasible such switch lowers the objective, so an alternative with
``delta < 0`` is *blocked*:

    memory   the switch breaks ``memory_at`` at some checkpoint ``t``:
             M_t + bytes_t(v, s) - bytes_t(v, s*) > M   (``over_capacity_bytes > 0``; ``v``'s own
             storages, its followers' bytes left as planned)
    gap      the MIP stopped within its optimality gap (the plan's ``solver.gap``)

A node whose input edge is *tied* (``edge_tied``: a view or elementwise op that follows its
producer) has no choice of its own: it is recorded as following that producer.

When the problem was scaled for repeated blocks (:mod:`autoplan.passes.expand`), times are for all the
copies a node stands for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the records below are read from plan files by the review commands, without torch
    from autoplan.passes.costing import CostProblem, Edge
    from autoplan.passes.placement import Spec

KEEP_ALTERNATIVES = 3
"""Other strategies kept per node (the cheapest by ``delta``), besides the chosen one."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Alternative:
    """One strategy of a node, priced with every other node at its chosen strategy."""

    output_specs: tuple[tuple[str, ...] | None, ...]
    input_specs: tuple[tuple[str, ...], ...]
    compute_s: float
    """Node time (op, or optimizer step and gradient for a parameter)."""
    comm_s: float
    """Conversions on the edges touching the node (into it and out of it)."""
    delta_s: float
    """``compute_s + comm_s`` minus the chosen strategy's: the objective's change if only this
    node switched (0 for the chosen one)."""
    over_capacity_bytes: float | None
    """Worst memory checkpoint minus the capacity if this node switched (> 0: does not fit;
    ``None``: the problem had no memory constraint)."""

    def __str__(self) -> str:
        out = " | ".join(",".join(s) if s is not None else "-" for s in self.output_specs)
        return f"{out} ({self.delta_s * 1e3:+.3f} ms)"

    def to_dict(self) -> dict[str, object]:
        """Specs as one string each (``"S(0),R"``): keeps plan files short."""
        return {
            "out": [",".join(s) if s is not None else None for s in self.output_specs],
            "in": [",".join(s) for s in self.input_specs],
            "compute_s": self.compute_s,
            "comm_s": self.comm_s,
            "delta_s": self.delta_s,
            "over_capacity_bytes": self.over_capacity_bytes,
        }

    @staticmethod
    def from_dict(d: Mapping[str, object]) -> Alternative:
        outs = d["out"]
        ins = d["in"]
        assert isinstance(outs, list) and isinstance(ins, list)
        return Alternative(
            output_specs=tuple(tuple(s.split(",")) if s is not None else None for s in outs),
            input_specs=tuple(tuple(s.split(",")) for s in ins),
            compute_s=float(d["compute_s"]),  # type: ignore[arg-type]
            comm_s=float(d["comm_s"]),  # type: ignore[arg-type]
            delta_s=float(d["delta_s"]),  # type: ignore[arg-type]
            over_capacity_bytes=None if d.get("over_capacity_bytes") is None else float(d["over_capacity_bytes"]),  # type: ignore[arg-type]
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeExplanation:
    """The chosen strategy first, then up to :data:`KEEP_ALTERNATIVES` others by ``delta_s``;
    or, for a node tied to its producer, that producer's name."""

    num_strategies: int
    alternatives: tuple[Alternative, ...] = ()
    follows: str = ""

    def to_dict(self) -> dict[str, object]:
        if self.follows:
            return {"num_strategies": self.num_strategies, "follows": self.follows}
        return {"num_strategies": self.num_strategies, "alternatives": [a.to_dict() for a in self.alternatives]}

    @staticmethod
    def from_dict(d: Mapping[str, object]) -> NodeExplanation:
        alts = d.get("alternatives", [])
        assert isinstance(alts, list)
        return NodeExplanation(
            num_strategies=int(d["num_strategies"]),  # type: ignore[call-overload]
            alternatives=tuple(Alternative.from_dict(a) for a in alts),
            follows=str(d.get("follows", "")),
        )


class _MemoryIndex:
    """Chosen bytes at every memory checkpoint, and which checkpoints each node's storages touch."""

    def __init__(self, problem: CostProblem, choice: Mapping[str, int]) -> None:
        self.problem = problem
        self.choice = choice
        persistent = sum(sizes[choice[n]] for n, sizes in problem.persistent_bytes.items())
        self.totals: list[float] = []
        self.touching: dict[str, list[int]] = {}
        for i, point in enumerate(problem.memory_points):
            live = sum(problem.value_bytes[a][choice[a.node]] for a in point.storages)
            grads = sum(problem.grad_bytes[g][choice[g]] for g in point.grads_of)
            self.totals.append(persistent + live + grads)
            for node in {a.node for a in point.storages} | set(point.grads_of):
                self.touching.setdefault(node, []).append(i)
        self.order = sorted(range(len(self.totals)), key=lambda i: -self.totals[i])

    def over_capacity_bytes(self, node: str, s: int) -> float | None:
        """Worst checkpoint minus capacity with ``node`` switched to ``s`` (``None``: no checkpoints)."""
        p, c = self.problem, self.choice[node]
        if not self.totals:
            return None
        d_persistent = p.persistent_bytes[node][s] - p.persistent_bytes[node][c] if node in p.persistent_bytes else 0.0
        touched = self.touching.get(node, [])
        worst = next((self.totals[i] for i in self.order if i not in touched), float("-inf")) + d_persistent
        for i in touched:
            point = p.memory_points[i]
            d = d_persistent
            d += sum(p.value_bytes[a][s] - p.value_bytes[a][c] for a in point.storages if a.node == node)
            if node in point.grads_of:
                d += p.grad_bytes[node][s] - p.grad_bytes[node][c]
            worst = max(worst, self.totals[i] + d)
        return worst - p.capacity_bytes


def explain_choices(
    problem: CostProblem, choice: Mapping[str, int], *, keep: int = KEEP_ALTERNATIVES
) -> dict[str, NodeExplanation]:
    """Per node with more than one strategy: the chosen one and the ``keep`` next cheapest, with the
    formula of the module docstring (tied followers: the producer they follow)."""
    # both import torch; this module is imported without torch by the review commands (see above)
    from autoplan.passes.costing import OUTPUT_CONSUMER
    from autoplan.passes.placement import spec_strs

    into: dict[str, list[Edge]] = {}
    out_of: dict[str, list[Edge]] = {}
    follows: dict[str, str] = {}  # tied consumer -> the producer it follows
    followers: dict[str, list[Edge]] = {}  # producer -> its tied edges
    for e in problem.edges:
        out_of.setdefault(e.producer.node, []).append(e)
        if e.consumer != OUTPUT_CONSUMER and e.consumer in choice:
            into.setdefault(e.consumer, []).append(e)
        if e.tied:
            follows[e.consumer] = e.producer.node
            followers.setdefault(e.producer.node, []).append(e)
    memory = _MemoryIndex(problem, choice)

    def edge_cost(e: Edge, node: str, s: int) -> float:
        """Conversion on ``e`` with ``node`` at ``s`` and the other end as chosen."""
        src = s if e.producer.node == node else choice[e.producer.node]
        dst = s if e.consumer == node else choice.get(e.consumer)
        return e.cost_s[(e.src_spec(src), e.dst_spec(dst))]

    follower_memo: dict[tuple[str, object], tuple[float, float]] = {}

    def own(node: str, s: int) -> tuple[float, float]:
        """(compute, comm) of ``node`` at ``s`` plus its followers', each follower at its cheapest
        strategy taking the spec ``s`` gives it (the edge_tied constraint moves them together)."""
        t = problem.node_time_s[node][s]
        comm = sum(edge_cost(e, node, s) for e in into.get(node, []) + out_of.get(node, []) if not e.tied)
        for e in followers.get(node, []):
            ft, fc = follower(e, e.src_spec(s))
            t, comm = t + ft, comm + fc
        return t, comm

    def follower(e: Edge, spec: Spec) -> tuple[float, float]:
        key = (e.consumer, spec)
        if key not in follower_memo:
            # a tied edge whose consumer cannot take ``spec`` (an op writing into its argument
            # takes only what it can run on): the producer cannot output it
            follower_memo[key] = min(
                (own(e.consumer, fs) for fs in e.dst_groups.get(spec, ())),
                key=lambda tc: tc[0] + tc[1],
                default=(math.inf, 0.0),
            )
        return follower_memo[key]

    result: dict[str, NodeExplanation] = {}
    for node, times in problem.node_time_s.items():
        n = len(times)
        if n < 2:
            continue
        if node in follows:
            result[node] = NodeExplanation(num_strategies=n, follows=follows[node])
            continue
        strategies = problem.table.nodes[node].strategies
        priced = [(s, *own(node, s)) for s in range(n)]
        chosen = choice[node]
        base = priced[chosen][1] + priced[chosen][2]
        others = sorted(
            (q for q in priced if q[0] != chosen and math.isfinite(q[1] + q[2])),
            key=lambda q: (q[1] + q[2] - base, q[0]),
        )
        alts = []
        for s, t, comm in [priced[chosen], *others[:keep]]:
            strat = strategies[s]
            alts.append(
                Alternative(
                    output_specs=tuple(tuple(spec_strs(o)) if o is not None else None for o in strat.output_specs),
                    input_specs=tuple(tuple(spec_strs(i)) for i in strat.input_specs),
                    compute_s=t,
                    comm_s=comm,
                    delta_s=0.0 if s == chosen else t + comm - base,
                    over_capacity_bytes=memory.over_capacity_bytes(node, s),
                )
            )
        result[node] = NodeExplanation(num_strategies=n, alternatives=tuple(alts))
    return result
