r"""Pass 4 — solve: pick one strategy per node with an integer linear program (HiGHS, or CBC).

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
(``autoplan.cost_models.comm``).

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
the checkpoints of :func:`autoplan.passes.liveness.memory_checkpoints` (the local maxima of the live
bytes and the end of the step): peak memory over the step, not a sum over it. ``edge_source`` and
``edge_target`` make ``y`` the joint choice of the two endpoints (the "local polytope"
linearisation of the quadratic term ``x_u^T C x_v``); when a side has a single spec the edge cost
is linear in the other side's ``x`` and no ``y`` is created. A *tied* edge feeds a
size-preserving single-input op (view, transpose, unary elementwise) that accepts every spec its
producer can give: the op follows its producer (no conversion, no ``y``), which loses nothing
since converting its input costs the same as converting its output.

Backends: the constraint families fill a :class:`LinearModel` (plain columns and rows); HiGHS
gets it as arrays through highspy, PuLP's bundled CBC where highspy is not installed. (Building
the model as PuLP objects and PuLP's conversion to HiGHS took 0.24-0.33 s of a segment-cost ILP
for Llama-3-8B, 11k variables; the arrays take 0.08-0.13 s, HiGHS's own run 0.05 s of it.)

User pins remove strategies before the model is built. An infeasible model raises
:class:`~autoplan.cost_models.errors.InfeasiblePlanError` with the memory needed against the capacity.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import pulp

from autoplan.cost_models.errors import InfeasiblePlanError, PlanError
from autoplan.passes.costing import CostProblem, Edge

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
    """"Optimal", "Infeasible", "Time limit (best feasible)" or "Not Solved"."""
    solve_time_s: float
    num_variables: int
    num_constraints: int
    gap: float | None = None
    """Relative optimality gap of the returned plan (0 when proven optimal; ``None`` when the
    backend does not report one)."""
    method: str = "mip"
    """``"lp"`` when the LP relaxation was already integral, else ``"mip"``."""


HIGHS_OPTIONS: dict[str, bool | int | float | str] = {
    "output_flag": False,
    "random_seed": 0,
    "mip_rel_gap": 1e-4,
    "mip_abs_gap": 1e-12,
    "simplex_dual_edge_weight_strategy": 2,
}
"""HiGHS settings. Objectives are seconds (a tiny model's step is ~1 ms): HiGHS's default absolute
gap of 1e-6 would stop at a relative gap of ~1e-3 there, so only the relative gap counts. Two
runs on the same model must return the same optimal vertex (ties are common: a tie broken
differently is a different plan file for the same input). HiGHS's defaults do not guarantee it:
its dual edge weights ("choose") and its presolve made the same LP end at different vertices run
to run (measured on GPT-2 4 layers, 2x2 mesh: 2 vertices in 8 solves). Fixed edge weights, and
no presolve for the LP relaxation (which also made it 2-4x faster there), gave one vertex in
every run; the MIP keeps its presolve."""


def _use_highs(options: SolverOptions) -> bool:
    if options.backend not in ("auto", "highs", "cbc"):
        raise PlanError(f"unknown solver backend {options.backend!r}: use 'auto', 'highs' or 'cbc'")
    if options.backend == "cbc":
        return False
    if importlib.util.find_spec("highspy") is not None:
        return True
    if options.backend == "highs":
        raise PlanError("solver backend 'highs' requested but highspy is not installed: pip install highspy")
    return False


@dataclass(frozen=True, slots=True)
class _Result:
    status: str
    """``"optimal"``, ``"infeasible"``, ``"time_limit"`` (stopped, maybe with a solution) or
    ``"not_solved"``."""
    values: list[float] | None
    """Value of every column (``None`` without a solution)."""
    gap: float | None = None


@dataclass(slots=True)
class LinearModel:
    """The ILP as plain columns and rows, in the order the constraint families add them; the
    backends (:func:`_solve_highs`, :func:`_solve_cbc`) take it as it is."""

    col_names: list[str] = field(default_factory=list)
    col_binary: list[bool] = field(default_factory=list)
    """True for ``x`` (0/1), False for ``y`` (continuous, >= 0)."""
    objective: dict[int, float] = field(default_factory=dict)
    """Column -> cost (repeated terms summed)."""
    row_names: list[str] = field(default_factory=list)
    row_lower: list[float] = field(default_factory=list)
    row_upper: list[float] = field(default_factory=list)
    row_terms: list[dict[int, float]] = field(default_factory=list)

    def add_col(self, name: str, *, binary: bool) -> int:
        self.col_names.append(name)
        self.col_binary.append(binary)
        return len(self.col_names) - 1

    def add_cols(self, names: Sequence[str], *, binary: bool) -> None:
        """:meth:`add_col` for each of ``names``, numbered on from :attr:`num_cols`."""
        self.col_names += names
        self.col_binary += [binary] * len(names)

    def add_row(self, name: str, terms: dict[int, float], lower: float, upper: float) -> None:
        self.row_names.append(name)
        self.row_terms.append(terms)
        self.row_lower.append(lower)
        self.row_upper.append(upper)

    @property
    def num_cols(self) -> int:
        return len(self.col_names)

    @property
    def num_rows(self) -> int:
        return len(self.row_names)

    def objective_value(self, values: Sequence[float]) -> float:
        total = 0.0
        for col, cost in self.objective.items():
            total += values[col] * cost
        return total


def _merge(terms: Iterable[tuple[int, float]]) -> dict[int, float]:
    """``coefficient * column`` terms with repeated columns added up, in first-seen order."""
    out: dict[int, float] = {}
    for col, c in terms:
        out[col] = out.get(col, 0.0) + c
    return out


@contextlib.contextmanager
def _native_stdout_discarded() -> Iterator[None]:
    """Point file descriptor 1 at ``/dev/null`` while a ``Highs`` object is constructed: highspy >=
    1.12 prints its banner to the process's stdout from C++ there, before ``output_flag`` can be
    set, and stdout belongs to the caller (``autoplan plan --json`` writes JSON there). The
    solve itself prints nothing (``output_flag`` off, :data:`HIGHS_OPTIONS`)."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):  # no fd 1 (embedded interpreters): nothing to guard
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _solve_highs(model: LinearModel, options: SolverOptions, *, relaxation: bool) -> _Result:
    """HiGHS through highspy, given the arrays directly. Columns are passed sorted by name and
    rows in order (the model PuLP's HiGHS interface built before: the same vertex on ties);
    ``relaxation``: every column continuous and no presolve (:data:`HIGHS_OPTIONS`)."""
    import highspy
    import numpy as np

    inf = highspy.kHighsInf
    with _native_stdout_discarded():
        h = highspy.Highs()
    for key, setting in HIGHS_OPTIONS.items():
        h.setOptionValue(key, setting)
    h.setOptionValue("threads", options.threads)
    h.setOptionValue("time_limit", float(options.time_limit_s))
    if relaxation:
        h.setOptionValue("presolve", "off")
    order = sorted(range(model.num_cols), key=model.col_names.__getitem__)
    pos = [0] * model.num_cols
    for p, col in enumerate(order):
        pos[col] = p
    n = model.num_cols
    cost = np.array([model.objective.get(c, 0.0) for c in order], dtype=np.float64)
    upper = np.array([1.0 if model.col_binary[c] else inf for c in order], dtype=np.float64)
    h.addCols(n, cost, np.zeros(n), upper, 0, np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0))
    starts: list[int] = []
    index: list[int] = []
    value: list[float] = []
    for terms in model.row_terms:
        starts.append(len(index))
        for col, c in terms.items():
            if c != 0:
                index.append(pos[col])
                value.append(c)
    lower = np.array([-inf if lo == -math.inf else lo for lo in model.row_lower], dtype=np.float64)
    upper_r = np.array([inf if up == math.inf else up for up in model.row_upper], dtype=np.float64)
    h.addRows(
        model.num_rows, lower, upper_r, len(index),
        np.array(starts, dtype=np.int32), np.array(index, dtype=np.int32), np.array(value, dtype=np.float64),
    )  # fmt: skip
    if not relaxation:
        binary = np.array([p for p, c in enumerate(order) if model.col_binary[c]], dtype=np.int32)
        if len(binary):
            kinds = np.array([highspy.HighsVarType.kInteger] * len(binary))
            h.changeColsIntegrality(len(binary), binary, kinds)
    h.run()
    status = h.getModelStatus()
    S = highspy.HighsModelStatus
    col_value = list(h.getSolution().col_value)
    values = [col_value[pos[c]] for c in range(n)] if len(col_value) == n else None
    gap = None
    if not relaxation:
        g = float(h.getInfo().mip_gap)
        gap = g if g == g and g < math.inf else None  # NaN / inf: not reported
    if status == S.kOptimal:
        return _Result("optimal", values, gap)
    if status in (S.kInfeasible, S.kUnboundedOrInfeasible):
        return _Result("infeasible", None)
    if status in (S.kTimeLimit, S.kInterrupt, S.kIterationLimit, S.kObjectiveBound, S.kObjectiveTarget):
        solved = h.getInfo().primal_solution_status == 2  # kSolutionStatusFeasible
        return _Result("time_limit", values if solved else None, gap)
    return _Result("not_solved", None)


def _solve_cbc(model: LinearModel, options: SolverOptions, *, relaxation: bool) -> _Result:
    """PuLP's bundled CBC, for machines without highspy (``relaxation``: continuous columns)."""
    lp = pulp.LpProblem("autoplan_sharding", pulp.LpMinimize)
    # PuLP >= 3.3 attaches variables to the model (constructing them directly is deprecated)
    new_var = lp.add_variable if hasattr(lp, "add_variable") else pulp.LpVariable
    cols = []
    for name, binary in zip(model.col_names, model.col_binary, strict=True):
        if binary and not relaxation:
            cols.append(new_var(name, cat=pulp.LpBinary))
        else:
            cols.append(new_var(name, lowBound=0, upBound=1 if binary else None))
    for name, terms, lo, up in zip(model.row_names, model.row_terms, model.row_lower, model.row_upper, strict=True):
        expr = pulp.LpAffineExpression([(cols[c], v) for c, v in terms.items()])
        if lo == up:
            lp += (expr == lo, name)
        elif lo == -math.inf:
            lp += (expr <= up, name)
        else:
            lp += (expr >= lo, name)
    lp += pulp.LpAffineExpression([(cols[c], v) for c, v in model.objective.items()])
    solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=options.time_limit_s, threads=options.threads)
    status = lp.solve(solver)
    values = [v.value() for v in cols]
    solved = all(v is not None for v in values)
    if status == pulp.LpStatusOptimal and lp.sol_status == pulp.LpSolutionOptimal:
        return _Result("optimal", values if solved else None)
    if status == pulp.LpStatusInfeasible:
        return _Result("infeasible", None)
    if solved and status == pulp.LpStatusOptimal:  # stopped by the time limit with a solution
        return _Result("time_limit", values)
    return _Result("not_solved", None)


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
        self.model = LinearModel()
        self.x: dict[str, list[int]] = {}
        """Node -> the columns of its ``x[v, s]``."""
        self._objective: list[tuple[int, float]] = []
        self._build()

    # -- variables --------------------------------------------------------------------------
    def _build(self) -> None:
        for i, (name, times) in enumerate(self.problem.node_time_s.items()):
            xs = [self.model.add_col(f"x_{i}_{s}", binary=True) for s in range(len(times))]
            self.x[name] = xs
            self._objective += [(v, t) for v, t in zip(xs, times, strict=True)]
        self.add_one_strategy_constraint()
        for k, edge in enumerate(self.problem.edges):
            self.add_edge_constraints(k, edge)
        self.add_memory_at_constraints()
        self.model.objective = _merge(self._objective)

    def _equal(self, name: str, lhs: list[tuple[int, float]], rhs: list[tuple[int, float]], const: float) -> None:
        """Row ``lhs == rhs + const``."""
        self.model.add_row(name, _merge([*lhs, *((c, -v) for c, v in rhs)]), const, const)

    def _sum_x(self, node: str, indices: tuple[int, ...]) -> list[tuple[int, float]]:
        xs = self.x[node]
        return [(xs[i], 1.0) for i in indices]

    # -- constraint families ----------------------------------------------------------------
    def add_one_strategy_constraint(self) -> None:
        """one_strategy: sum_s x[v,s] = 1 for every node v."""
        for i, (name, xs) in enumerate(self.x.items()):
            self._equal(f"one_strategy__{i}_{name}", [(v, 1.0) for v in xs], [], 1.0)

    def add_edge_constraints(self, k: int, edge: Edge) -> None:
        """edge_source / edge_target: y[e,p,q] is the joint choice of producer spec p and consumer spec q.

        sum_q y[e,p,q] = sum_{s in S_u(p)} x[u,s]   and   sum_p y[e,p,q] = sum_{s in S_v(q)} x[v,s]
        """
        u, v = edge.producer.node, edge.consumer
        P, Q = list(edge.src_groups), list(edge.dst_groups)
        if edge.tied:
            self.add_edge_tied_constraint(k, edge)
            return
        if edge.cost_s.all_zero():
            return
        cost = edge.cost_s.matrix  # cost[i][j]: P[i] -> Q[j] (PairCosts: rows and columns in the groups' order)
        if v not in self.x:  # loss -> output: a fixed requirement, linear in the producer
            (_,) = Q
            self._objective += [(self.x[u][s], cost[i][0]) for i, p in enumerate(P) for s in edge.src_groups[p]]
            return
        if len(P) == 1:
            self._objective += [(self.x[v][s], cost[0][j]) for j, q in enumerate(Q) for s in edge.dst_groups[q]]
            return
        if len(Q) == 1:
            self._objective += [(self.x[u][s], cost[i][0]) for i, p in enumerate(P) for s in edge.src_groups[p]]
            return
        first, n_q = self.model.num_cols, len(Q)
        self.model.add_cols([f"y_{k}_{i}_{j}" for i in range(len(P)) for j in range(n_q)], binary=False)
        # y[i, j] is column first + i * n_q + j
        for i, p in enumerate(P):
            lhs = [(first + i * n_q + j, 1.0) for j in range(n_q)]
            self._equal(f"edge_source__{k}_{i}", lhs, self._sum_x(u, edge.src_groups[p]), 0.0)
        for j, q in enumerate(Q):
            lhs = [(first + i * n_q + j, 1.0) for i in range(len(P))]
            self._equal(f"edge_target__{k}_{j}", lhs, self._sum_x(v, edge.dst_groups[q]), 0.0)
        self._objective += [(first + i * n_q + j, c) for i, row in enumerate(cost) for j, c in enumerate(row)]

    def add_edge_tied_constraint(self, k: int, edge: Edge) -> None:
        """edge_tied: sum_{s in S_v(q)} x[v,s] = sum_{s in S_u(q)} x[u,s] for every spec q."""
        u, v = edge.producer.node, edge.consumer
        for j, (q, consumer_strats) in enumerate(edge.dst_groups.items()):
            rhs = self._sum_x(u, edge.src_groups.get(q, ()))
            self._equal(f"edge_tied__{k}_{j}", self._sum_x(v, consumer_strats), rhs, 0.0)

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
            # a parameter's x carries its persistent bytes and its gradient: _merge sums them
            name = f"memory_at__{point.position}_{point.node}"
            self.model.add_row(name, _merge(terms), -math.inf, p.capacity_bytes)

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
    def _run(self, options: SolverOptions, *, relaxation: bool) -> _Result:
        backend = _solve_highs if _use_highs(options) else _solve_cbc
        return backend(self.model, options, relaxation=relaxation)

    def _integral(self, values: Sequence[float]) -> bool:
        return all(abs(values[c] - round(values[c])) <= 1e-6 for xs in self.x.values() for c in xs)

    def _solve_lp(self) -> _Result | None:
        """LP relaxation; its result when it is solved to optimality and integral, else None."""
        result = self._run(self.options, relaxation=True)
        if result.status == "optimal" and result.values is not None and self._integral(result.values):
            return result
        return None

    def solve(self) -> Solution:
        t0 = time.perf_counter()
        result = self._solve_lp() if self.options.lp_first else None
        method = "lp" if result is not None else "mip"
        if result is None:
            left_s = max(1.0, self.options.time_limit_s - (time.perf_counter() - t0))
            result = self._run(dataclasses.replace(self.options, time_limit_s=left_s), relaxation=False)
            gap = result.gap
        else:
            gap = 0.0
        status_text = {
            "optimal": "Optimal",
            "infeasible": "Infeasible",
            "time_limit": "Time limit (best feasible)",
            "not_solved": "Not Solved",
        }[result.status]
        dt = time.perf_counter() - t0
        n_vars, n_cons = self.model.num_cols, self.model.num_rows
        log.info("ILP %s (%s) in %.2fs: %d variables, %d constraints", status_text, method, dt, n_vars, n_cons)
        if result.status == "infeasible":
            raise self.infeasible_error()
        values = result.values
        if values is None or not all(any(values[c] > 0.5 for c in xs) for xs in self.x.values()):
            raise InfeasiblePlanError(
                f"the solver stopped after {dt:.1f} s ({status_text}) without a feasible plan ({n_vars} variables, "
                f"time limit {self.options.time_limit_s:g} s): raise time_limit_s / --time-limit or pin placements "
                "to shrink the problem"
            )
        choice = {name: max(range(len(xs)), key=lambda s: values[xs[s]]) for name, xs in self.x.items()}
        return Solution(
            choice=choice,
            objective_s=self.model.objective_value(values),
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
