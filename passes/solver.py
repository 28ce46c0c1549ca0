r"""Pass 4 — solve: pick one strategy per node with an integer linear program (PuLP + CBC).

Formulation
-----------
Sets: nodes :math:`V`; strategies :math:`S_v` of node :math:`v`; edges :math:`E` (producer value
-> consumer argument, gradient -> parameter, loss -> output). For an edge :math:`e=(u\to v)`,
:math:`P_e` are the distinct output specs of :math:`u` and :math:`Q_e` the distinct specs
:math:`v` may require; :math:`S_u(p)` / :math:`S_v(q)` are the strategies with that spec.

Variables::

    x[v,s] in {0,1}         node v runs strategy s
    y[e,p,q] >= 0           edge e converts spec p to spec q   (continuous; integral once x is)

Objective (seconds of one training step, all nodes and edges)::

    min  sum_v sum_s  t[v,s] x[v,s]  +  sum_e sum_{p,q}  c[e,p,q] y[e,p,q]

with ``t`` the compute time (plus optimizer step for parameters) and ``c`` the transition time
(``cost_models.comm``).

Constraint families (one method each, every constraint named ``<family>__<node/edge>``)::

    one_strategy        sum_s x[v,s] = 1                                   for all v
    edge_source         sum_q y[e,p,q] = sum_{s in S_u(p)} x[u,s]          for all e, p
    edge_target         sum_p y[e,p,q] = sum_{s in S_v(q)} x[v,s]          for all e, q
    edge_tied           sum_{s in S_v(q)} x[v,s] = sum_{s in S_u(q)} x[u,s]  for tied e, all q
    memory_at           sum_{v placeholder} sum_s k[v,s] x[v,s]
                          + sum_{a alive at t} sum_s b[a,s] x[u(a),s]
                          + sum_{p: grad born <= t} sum_s g[p,s] x[p,s]  <= M   for t in T

where ``k`` are the bytes a placeholder keeps for the whole step (parameter + optimizer state,
input shards), ``b[a,s]`` the local bytes of storage ``a`` when its producer ``u(a)`` runs
``s``, ``g`` the gradient of parameter ``p`` in its layout, ``M`` the device capacity and ``T``
the checkpoints of :func:`passes.liveness.memory_checkpoints` (the local maxima of the live
bytes and the end of the step): peak memory over the step, not a sum over it. ``edge_source`` and
``edge_target`` make ``y`` the joint choice of the two endpoints (the "local polytope"
linearisation of the quadratic term ``x_u^T C x_v``); when a side has a single spec the edge cost
is linear in the other side's ``x`` and no ``y`` is created. A *tied* edge feeds a
size-preserving single-input op (view, transpose, unary elementwise) that accepts every spec its
producer can give: the op follows its producer (no conversion, no ``y``), which loses nothing
since converting its input costs the same as converting its output.

User pins remove strategies before the model is built. An infeasible model raises
:class:`~cost_models.errors.InfeasiblePlanError` with the memory needed against the capacity.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import pulp

from cost_models.errors import InfeasiblePlanError, PlanError
from passes.costing import CostProblem, Edge

log = logging.getLogger(__name__)

GiB = 1024**3


@dataclass(frozen=True, kw_only=True, slots=True)
class SolverOptions:
    time_limit_s: float = 120.0
    """Wall-clock limit given to CBC; the best feasible solution found is returned with its gap."""
    threads: int = 1
    """Solver threads (1 keeps results deterministic)."""
    backend: str = "auto"
    """``"auto"`` (HiGHS if installed, else CBC), ``"highs"`` or ``"cbc"``."""
    lp_first: bool = True
    """Solve the LP relaxation first and keep it when every ``x`` is integral (the local
    polytope is often tight for these problems): no branch and bound at all."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Solution:
    choice: Mapping[str, int]
    """Node name -> index of the chosen strategy."""
    objective_s: float
    status: str
    """PuLP status text ("Optimal", "Not Solved" when stopped by the time limit...)."""
    solve_time_s: float
    num_variables: int
    num_constraints: int
    gap: float | None = None
    """Relative optimality gap of the returned plan (0 when proven optimal; ``None`` when the
    backend does not report one)."""
    method: str = "mip"
    """``"lp"`` when the LP relaxation was already integral, else ``"mip"``."""


def _make_solver(options: SolverOptions, *, relaxation: bool = False) -> pulp.LpSolver:
    """HiGHS (via highspy) when installed and allowed, else the CBC binary bundled with PuLP.
    ``relaxation``: settings for the LP relaxation (no presolve, see below)."""
    if options.backend in ("auto", "highs") and "HiGHS" in pulp.listSolvers(onlyAvailable=True):
        # objectives are seconds (a tiny model's step is ~1 ms): HiGHS's default absolute gap of
        # 1e-6 would stop at a relative gap of ~1e-3 there, so only the relative gap counts.
        # Two runs on the same model must return the same optimal vertex (ties are common: a tie
        # broken differently is a different plan file for the same input). HiGHS's defaults do not
        # guarantee it: its dual edge weights ("choose") and its presolve made the same LP end at
        # different vertices run to run (measured on GPT-2 4 layers, 2x2 mesh: 2 vertices in 8
        # solves). Fixed edge weights, and no presolve for the LP relaxation (which also made it
        # 2-4x faster there), gave one vertex in every run; the MIP keeps its presolve.
        extra = {"presolve": "off"} if relaxation else {}
        return pulp.HiGHS(
            msg=False,
            timeLimit=options.time_limit_s,
            threads=options.threads,
            random_seed=0,
            gapRel=1e-4,
            gapAbs=1e-12,
            simplex_dual_edge_weight_strategy=2,
            **extra,
        )
    if options.backend not in ("auto", "highs", "cbc"):
        raise PlanError(f"unknown solver backend {options.backend!r}: use 'auto', 'highs' or 'cbc'")
    if options.backend == "highs":
        raise PlanError("solver backend 'highs' requested but highspy is not installed: pip install highspy")
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=options.time_limit_s, threads=options.threads)


def _affine(terms: list[tuple[pulp.LpVariable, float]]) -> pulp.LpAffineExpression:
    """Sum of ``coefficient * variable`` with repeated variables added up (``LpAffineExpression``
    built from a list keeps only the last coefficient of a repeated variable)."""
    coeffs: dict[pulp.LpVariable, float] = {}
    for var, c in terms:
        coeffs[var] = coeffs.get(var, 0.0) + c
    return pulp.LpAffineExpression(list(coeffs.items()))


def objective_of(problem: CostProblem, choice: Mapping[str, int]) -> float:
    """The ILP's objective (seconds) of a given strategy per node: node times plus the edge
    conversions the chosen endpoints imply (tied edges cost nothing)."""
    total = sum(problem.node_time_s[n][s] for n, s in choice.items())
    for e in problem.edges:
        if not e.tied:
            total += e.cost_s[(e.src_spec(choice[e.producer.node]), e.dst_spec(choice.get(e.consumer)))]
    return total


class ShardingILP:
    """Builds and solves the ILP of the module docstring for one :class:`CostProblem`."""

    def __init__(self, problem: CostProblem, options: SolverOptions | None = None) -> None:
        self.problem = problem
        self.options = options or SolverOptions()
        self.model = pulp.LpProblem("autoplan_sharding", pulp.LpMinimize)
        self.x: dict[str, list[pulp.LpVariable]] = {}
        self._objective: list[tuple[pulp.LpVariable, float]] = []
        self._build()

    # -- variables --------------------------------------------------------------------------
    def _build(self) -> None:
        for i, (name, times) in enumerate(self.problem.node_time_s.items()):
            xs = [self._var(f"x_{i}_{s}", binary=True) for s in range(len(times))]
            self.x[name] = xs
            self._objective += [(v, t) for v, t in zip(xs, times, strict=True)]
        self.add_one_strategy_constraint()
        for k, edge in enumerate(self.problem.edges):
            self.add_edge_constraints(k, edge)
        self.add_memory_at_constraints()
        self.model += _affine(self._objective)

    def _var(self, name: str, *, binary: bool) -> pulp.LpVariable:
        if hasattr(self.model, "add_variable"):  # PuLP >= 3.3 attaches variables to the model
            if binary:
                return self.model.add_variable(name, cat=pulp.LpBinary)
            return self.model.add_variable(name, lowBound=0)
        if binary:
            return pulp.LpVariable(name, cat=pulp.LpBinary)
        return pulp.LpVariable(name, lowBound=0)

    def _sum_x(self, node: str, indices: tuple[int, ...]) -> pulp.LpAffineExpression:
        xs = self.x[node]
        return pulp.LpAffineExpression([(xs[i], 1.0) for i in indices])

    # -- constraint families ----------------------------------------------------------------
    def add_one_strategy_constraint(self) -> None:
        """one_strategy: sum_s x[v,s] = 1 for every node v."""
        for i, (name, xs) in enumerate(self.x.items()):
            self.model += (pulp.LpAffineExpression([(v, 1.0) for v in xs]) == 1, f"one_strategy__{i}_{name}")

    def add_edge_constraints(self, k: int, edge: Edge) -> None:
        """edge_source / edge_target: y[e,p,q] is the joint choice of producer spec p and consumer spec q.

        sum_q y[e,p,q] = sum_{s in S_u(p)} x[u,s]   and   sum_p y[e,p,q] = sum_{s in S_v(q)} x[v,s]
        """
        u, v = edge.producer.node, edge.consumer
        P, Q = list(edge.src_groups), list(edge.dst_groups)
        if edge.tied:
            self.add_edge_tied_constraint(k, edge)
            return
        if all(c == 0.0 for c in edge.cost_s.values()):
            return
        if v not in self.x:  # loss -> output: a fixed requirement, linear in the producer
            (q,) = Q
            self._objective += [(self.x[u][s], edge.cost_s[(p, q)]) for p in P for s in edge.src_groups[p]]
            return
        if len(P) == 1:
            (p,) = P
            self._objective += [(self.x[v][s], edge.cost_s[(p, q)]) for q in Q for s in edge.dst_groups[q]]
            return
        if len(Q) == 1:
            (q,) = Q
            self._objective += [(self.x[u][s], edge.cost_s[(p, q)]) for p in P for s in edge.src_groups[p]]
            return
        y = {(i, j): self._var(f"y_{k}_{i}_{j}", binary=False) for i in range(len(P)) for j in range(len(Q))}
        for i, p in enumerate(P):
            lhs = pulp.LpAffineExpression([(y[i, j], 1.0) for j in range(len(Q))])
            self.model += (lhs == self._sum_x(u, edge.src_groups[p]), f"edge_source__{k}_{i}")
        for j, q in enumerate(Q):
            lhs = pulp.LpAffineExpression([(y[i, j], 1.0) for i in range(len(P))])
            self.model += (lhs == self._sum_x(v, edge.dst_groups[q]), f"edge_target__{k}_{j}")
        self._objective += [(y[i, j], edge.cost_s[(p, q)]) for i, p in enumerate(P) for j, q in enumerate(Q)]

    def add_edge_tied_constraint(self, k: int, edge: Edge) -> None:
        """edge_tied: sum_{s in S_v(q)} x[v,s] = sum_{s in S_u(q)} x[u,s] for every spec q."""
        u, v = edge.producer.node, edge.consumer
        for j, (q, consumer_strats) in enumerate(edge.dst_groups.items()):
            rhs = self._sum_x(u, edge.src_groups.get(q, ()))
            self.model += (self._sum_x(v, consumer_strats) == rhs, f"edge_tied__{k}_{j}")

    def add_memory_at_constraints(self) -> None:
        """memory_at: persistent + live storages + produced gradients <= M at every checkpoint t."""
        p = self.problem
        persistent = [
            (xv, b) for name, sizes in p.persistent_bytes.items() for xv, b in zip(self.x[name], sizes, strict=True)
        ]
        for point in p.memory_points:
            terms = list(persistent)
            for a in point.storages:
                terms += [(xv, b) for xv, b in zip(self.x[a.node], p.value_bytes[a], strict=True) if b > 0]
            for param in point.grads_of:
                terms += [(xv, b) for xv, b in zip(self.x[param], p.grad_bytes[param], strict=True)]
            # a parameter's x carries its persistent bytes and its gradient: _affine sums them
            self.model += (_affine(terms) <= p.capacity_bytes, f"memory_at__{point.position}_{point.node}")

    def min_bytes_needed(self) -> float:
        """Lower bound of the peak: every term at its smallest, at the worst checkpoint."""
        p = self.problem
        persistent = sum(min(b) for b in p.persistent_bytes.values())
        worst = 0.0
        for point in p.memory_points:
            live = sum(min(p.value_bytes[a]) for a in point.storages)
            grads = sum(min(p.grad_bytes[g]) for g in point.grads_of)
            worst = max(worst, live + grads)
        return persistent + worst

    # -- solve ------------------------------------------------------------------------------
    def _integral(self) -> bool:
        return all(
            abs(v.value() - round(v.value())) <= 1e-6 for xs in self.x.values() for v in xs if v.value() is not None
        )

    def _solve_lp(self) -> bool:
        """LP relaxation; True (and the values kept) when it is solved to optimality and integral."""
        binaries = [v for xs in self.x.values() for v in xs]
        saved = [(v.cat, v.lowBound, v.upBound) for v in binaries]  # PuLP stores binaries as 0/1 integers
        for v in binaries:
            v.cat, v.lowBound, v.upBound = pulp.LpContinuous, 0, 1
        try:
            status = self.model.solve(_make_solver(self.options, relaxation=True))
            return status == pulp.LpStatusOptimal and self._status_text(status) == "Optimal" and self._integral()
        finally:
            for v, (cat, lo, hi) in zip(binaries, saved, strict=True):
                v.cat, v.lowBound, v.upBound = cat, lo, hi

    def _status_text(self, status: int) -> str:
        """PuLP's status, except that HiGHS stopped by the time limit says so (PuLP reports
        "Optimal" for any solution HiGHS returns)."""
        highs = getattr(self.model, "solverModel", None)
        if highs is not None and hasattr(highs, "getModelStatus"):
            name = str(highs.getModelStatus()).rsplit(".", 1)[-1]
            if name == "kTimeLimit":
                return "Time limit (best feasible)"
        return pulp.LpStatus[status]

    def _gap(self) -> float | None:
        highs = getattr(self.model, "solverModel", None)
        if highs is None or not hasattr(highs, "getInfo"):
            return None
        gap = float(highs.getInfo().mip_gap)
        return gap if gap == gap and gap < float("inf") else None  # NaN / inf: not reported

    def solve(self) -> Solution:
        t0 = time.perf_counter()
        method = "lp" if self.options.lp_first and self._solve_lp() else "mip"
        if method == "lp":
            status, gap, status_text = pulp.LpStatusOptimal, 0.0, "Optimal"
        else:
            left_s = max(1.0, self.options.time_limit_s - (time.perf_counter() - t0))
            status = self.model.solve(_make_solver(dataclasses.replace(self.options, time_limit_s=left_s)))
            gap = self._gap()
            status_text = self._status_text(status)
        dt = time.perf_counter() - t0
        n_vars, n_cons = self.model.numVariables(), self.model.numConstraints()
        log.info("ILP %s (%s) in %.2fs: %d variables, %d constraints", status_text, method, dt, n_vars, n_cons)
        has_solution = all(any((v.value() or 0) > 0.5 for v in xs) for xs in self.x.values())
        if status == pulp.LpStatusInfeasible:
            raise self.infeasible_error()
        if not has_solution:
            raise InfeasiblePlanError(
                f"the solver stopped after {dt:.1f} s ({status_text}) without a feasible plan ({n_vars} variables, "
                f"time limit {self.options.time_limit_s:g} s): raise time_limit_s / --time-limit or pin placements "
                "to shrink the problem"
            )
        choice = {name: max(range(len(xs)), key=lambda s: xs[s].value() or 0.0) for name, xs in self.x.items()}
        return Solution(
            choice=choice,
            objective_s=float(pulp.value(self.model.objective) or 0.0),
            status=status_text,
            solve_time_s=dt,
            num_variables=n_vars,
            num_constraints=n_cons,
            gap=gap,
            method=method,
        )

    def infeasible_error(self) -> InfeasiblePlanError:
        """Name the memory needed (with every node at its smallest footprint) against the capacity."""
        need = self.min_bytes_needed()
        cap = self.problem.capacity_bytes
        cluster = self.problem.cluster
        return InfeasiblePlanError(
            f"no sharding fits: the smallest layout still needs {need / GiB:.2f} GiB per device at the peak of "
            f"the step (parameters, gradients, optimizer state, live activations); {cluster.device.name} has {cap / GiB:.2f} GiB "
            f"({cluster.world_size} devices, mesh {cluster.mesh_shape}): add devices, lower the batch size, "
            "or relax pinned placements"
        )
