"""The segment-cost oracle of the joint search: ``(tp, microbatch_size) -> SegmentCosts`` of a
model (:class:`SegmentCostModel`), traced once per micro-batch size (or derived,
:mod:`autoplan.passes.rebatch`), the intra-operator ILP solved on a tensor-parallel group and
summed per segment (:func:`autoplan.planner.segment_costs.segment_costs`); large micro-batches are
priced by scaling a smaller one once the costs grow linearly (:func:`scale_costs`), and the ILPs
the search will need are solved ahead in forked worker processes (:meth:`SegmentCostModel.prefetch`)."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import logging
import math
import multiprocessing
import multiprocessing.pool
import os
import queue
import signal
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.errors import ConfigError
from autoplan.cost_models.profile_db import ProfileDB
from autoplan.cost_models.step import SegmentCosts, replica_cluster
from autoplan.passes import pass_order
from autoplan.passes.costing import CostProblem, op_time_lower_bounds_s
from autoplan.passes.expand import block_multiplicity, twins
from autoplan.passes.layers import Layering
from autoplan.passes.moe import MOE_OPS, routed_experts
from autoplan.passes.rebatch import MIN_BASE_BATCH
from autoplan.passes.trace import LossFn, TracedProgram, param_node_name
from autoplan.planner import progress
from autoplan.planner.mesh import gradient_values, planning_mesh, restrict_context_parallel, restrict_sequence_parallel
from autoplan.planner.search import expand_blocks
from autoplan.planner.segment_costs import BoundedSegmentCostOracle, segment_costs
from autoplan.planner.solver import ShardingILP, SolverOptions
from autoplan.planner.tracing import trace_repeated

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SegmentCostModel(BoundedSegmentCostOracle):
    """``(tp, microbatch_size) -> SegmentCosts`` for a model: trace one micro-batch, solve the
    intra-operator ILP on a tensor-parallel group, sum per segment (memoised): the joint search's
    :class:`~autoplan.planner.segment_costs.SegmentCostOracle`."""

    model: torch.nn.Module
    example_inputs: Sequence[torch.Tensor]
    loss_fn: LossFn | None
    example_targets: Sequence[torch.Tensor]
    cluster: Cluster
    optimizer: str = "adam"
    profile: ProfileDB | None = None
    time_limit_s: float = 60.0
    reduce_repeated: bool = True
    """Trace two blocks and price the rest from the last (autoplan.passes.depth); False: full depth."""
    extrapolate_batch: bool = True
    """Price large micro-batches by scaling a smaller one once the costs are seen to grow
    linearly (see :meth:`__call__`); False: trace and solve every micro-batch size."""
    workers: int | None = None
    """Processes :meth:`prefetch` solves in (``None``: :func:`default_workers`; 1: this one)."""
    master_weights: bool = True
    """:attr:`SegmentCosts.master_weights` of the costs (the traced model is the step's, in its
    precision already: whether the model it was made from keeps fp32 masters is told here)."""
    num_blocks: int = 0
    _traces: dict[int, tuple[TracedProgram, Layering]] = field(default_factory=dict)
    _exported: set[int] = field(default_factory=set)
    """Micro-batch sizes in ``_traces`` that were traced (the others were derived from them)."""
    _costs: dict[tuple[int, int, int, bool], SegmentCosts] = field(default_factory=dict)
    """Solved and scaled costs by ``(tp, microbatch_size, cp, sequence_parallel)``."""
    _linear: dict[tuple[int, int, int, bool], bool] = field(default_factory=dict)
    _work_bounds: dict[tuple[int, int, int], float] = field(default_factory=dict)
    """:meth:`_traced_work_bound` by ``(tp, microbatch_size, cp)``."""

    def _traced(self, batch: int) -> tuple[TracedProgram, Layering]:
        """The step of one micro-batch of ``batch`` samples, traced with the first
        :data:`~autoplan.passes.depth.KEPT_BLOCKS` blocks only (:mod:`autoplan.passes.depth`; costs are expanded to
        the full depth in :meth:`__call__`); derived from two exported sizes when it can be
        (:mod:`autoplan.passes.rebatch`: the same graph, without another ``torch.export``).

        A batch of one is always derived from 2 and 4 samples (exported first if needed): traced
        on its own it gives a slightly different graph (a ``slice`` where larger batches
        ``expand``), while the runtime runs the graph of the whole global batch, sharded, on
        every device; the derived one is that graph at one sample. Traced directly only when it
        cannot be derived."""
        if batch not in self._traces:
            if batch < MIN_BASE_BATCH:
                for base in (MIN_BASE_BATCH, 2 * MIN_BASE_BATCH):
                    self._traced(base)
            derived = self._derived(batch)
            if derived is not None:
                self._traces[batch] = derived
                return derived
            progress.step(f"tracing the model for a micro-batch of {batch} (torch.export)")
            traced, layering, self.num_blocks = trace_repeated(
                self.model, self.example_inputs, self.example_targets, self.loss_fn, batch, reduce=self.reduce_repeated
            )
            self._traces[batch] = (traced, layering)
            self._exported.add(batch)
        return self._traces[batch]

    def _derived(self, batch: int) -> tuple[TracedProgram, Layering] | None:
        """The step of ``batch`` samples derived (:mod:`autoplan.passes.rebatch`, exact or ``None``) from
        the two largest exported sizes below it, else the two smallest others, with its layering."""
        exported = sorted(b for b in self._exported if b >= MIN_BASE_BATCH and b != batch)
        below = [b for b in exported if b < batch]
        bases = below[-2:] if len(below) >= 2 else exported[:2]
        if len(bases) < 2:
            return None
        (first, _), (second, layering2) = self._traces[bases[0]], self._traces[bases[1]]
        traced = pass_order.REBATCH(first, second, bases[0], bases[1], batch)
        if traced is None:
            return None
        layering = pass_order.LAYERS(traced)
        if layering.num_blocks != layering2.num_blocks:
            return None
        return traced, layering

    def routed_experts(self) -> int:
        """Routed experts per MoE layer of the model (the largest layer's; 0: no MoE layer), from a
        traced micro-batch."""
        traced, _ = self._traced(min(self._traces, default=MIN_BASE_BATCH))
        return max((routed_experts(n) for n in traced.graph_module.graph.nodes if n.target in MOE_OPS), default=0)

    def work_lower_bound_s(
        self, tp: int, microbatch_size: int, cp: int = 1, sequence_parallel: bool | int = False
    ) -> float:
        """A time ``sum(s.fwd_s + s.bwd_s for s in self(tp, microbatch_size, cp, sequence_parallel).segments)``
        is not below, found without an ILP (0 with a :attr:`profile`).

        :meth:`__call__` either solves ``b = microbatch_size`` samples, whose forward and backward
        sums hold every op's time under its chosen strategy plus conversion times (never negative):
        at least ``W(b)``, the sum of the ops' lowest times under any strategy
        (:func:`~autoplan.passes.costing.op_time_lower_bounds_s`, expanded to the model's depth
        like the solved costs), or scales the solved costs of a base ``b0`` in 2, 4, ... below
        ``b`` by ``b / b0`` (:meth:`_missing`). So the bound is::

            min(W(b), min_{b0} b / b0 * W(b0))   (times 1 - BOUND_ROUNDING: sums in another order)
        """
        if self.profile is not None:
            return 0.0
        sizes = [microbatch_size]
        base = 2
        while self.extrapolate_batch and base < microbatch_size:
            sizes.append(base)
            base *= 2
        bound = min(microbatch_size / b * self._traced_work_bound(tp, b, cp) for b in sizes)
        return bound * (1 - BOUND_ROUNDING)

    def _traced_work_bound(self, tp: int, microbatch_size: int, cp: int) -> float:
        """``W(microbatch_size)`` of :meth:`work_lower_bound_s` on the ``cp x tp`` group."""
        key = (tp, microbatch_size, cp)
        if key not in self._work_bounds:
            traced, layering = self._traced(microbatch_size)
            bounds = op_time_lower_bounds_s(traced, replica_cluster(self.cluster, tp, cp=cp))
            assert bounds is not None, "no profile here: op_time_lower_bounds_s has analytic bounds"
            per_segment = [0.0] * layering.num_segments
            for name, t in bounds.items():
                if name in layering.segment_of:
                    per_segment[layering.segment_of[name]] += t
            if self.num_blocks > layering.num_blocks:  # the last traced block stands for the others (_solve)
                per_segment += [per_segment[-2]] * (self.num_blocks - layering.num_blocks)
            self._work_bounds[key] = sum(per_segment)
        return self._work_bounds[key]

    def ready(self, tp: int, microbatch_size: int, cp: int = 1, sequence_parallel: bool | int = False) -> bool:
        """Whether ``(tp, microbatch_size, cp, sequence_parallel)`` is answered without solving another ILP."""
        return not self._missing(tp, microbatch_size, cp, bool(sequence_parallel))

    def prefetch(
        self,
        keys: Iterable[tuple[int, ...]],
        *,
        while_waiting: Callable[[], bool] | None = None,
        skip: Callable[[tuple[int, ...]], bool] | None = None,
        priority: Callable[[tuple[int, ...]], float] | None = None,
    ) -> None:
        """Solve the costs of every ``(tp, microbatch_size[, cp[, sequence_parallel]])`` in ``keys`` now, in forked worker
        processes, so the search's later calls are cache hits.

        The ILPs are independent; only *which* sizes need one depends on earlier results
        (:meth:`__call__` scales a size instead once the smaller ones grow linearly). This
        process keeps that decision (:meth:`_missing`): it hands out every ILP known to be
        needed, the smallest micro-batch first (its candidates can be laid out while the rest
        solve), at most one per worker, and decides again as results come in. The results are exactly those of calling :meth:`__call__` here, in any order.
        The traces every worker needs (2 and 4 samples, the bases the other sizes are derived from,
        :mod:`autoplan.passes.rebatch`, and 1 sample) are made here before forking; while this process
        traces 4 and derives 1, a first worker already solves the ILPs of 2 samples. While it waits
        for results, this process calls ``while_waiting()`` (the search lays out the candidates
        whose costs are :meth:`ready`), checking for results between calls, until it returns False.
        The objects alive at a fork are frozen out of the garbage collector (``gc.freeze``, as
        the ``gc`` docs advise before ``fork``): a worker's collections then neither rescan the
        model and traces nor copy their pages.

        ``skip(key)``: a key the caller no longer needs (asked again as results come in; once
        True it must stay True). Its ILPs are solved only where a key still needed asks for them,
        so it may be left not :meth:`ready`. ``priority(key)``: the ILPs of the keys with the
        smallest value are handed out first (ties: the smallest micro-batch first), and the first
        worker gets only :data:`FIRST_POOL_ILPS` of the ILPs of 2 samples; with both, the serial
        path calls ``while_waiting()`` after each key until it returns False, so ``skip`` can
        learn from the candidates laid out.
        Runs in this process
        when there is one worker, no ``fork`` start method (Windows), or a process group (inside
        a job)."""
        given = {_full_key(k): k for k in keys}
        todo = sorted(k3 for k3 in given if k3 not in self._costs)

        workers = self.workers or default_workers()
        # a forked copy of a process in a job would share its process group: solve here
        if (
            workers <= 1
            or not todo
            or "fork" not in multiprocessing.get_all_start_methods()
            or torch.distributed.is_initialized()
        ):
            self._prefetch_here([given[k] for k in todo], while_waiting=while_waiting, skip=skip, priority=priority)
            return
        self._prefetch_forked(todo, given, workers, while_waiting=while_waiting, skip=skip, priority=priority)

    def _prefetch_forked(
        self,
        todo: list[tuple[int, int, int, bool]],
        given: dict[tuple[int, int, int, bool], tuple[int, ...]],
        workers: int,
        *,
        while_waiting: Callable[[], bool] | None,
        skip: Callable[[tuple[int, ...]], bool] | None,
        priority: Callable[[tuple[int, ...]], float] | None,
    ) -> None:
        """:meth:`prefetch` in ``workers`` forked processes: ``todo`` (full keys; ``given``: as the
        caller wrote them), see there."""

        def live() -> list[tuple[int, int, int, bool]]:
            return [k for k in todo if skip is None or not skip(given[k])]

        sizes = {key[1] for key in todo}
        if self.extrapolate_batch and max(sizes) > MIN_BASE_BATCH:
            sizes |= {1, MIN_BASE_BATCH}  # the first linearity check (SegmentCostModel._missing)
        done: queue.SimpleQueue[object] = queue.SimpleQueue()
        running: set[tuple[int, int, int, bool]] = set()
        early: set[tuple[int, int, int, bool]] = set()  # running in the first, one-process pool
        first_of: dict[tuple[int, int, int, bool], float] = {}  # ILP -> priority of the first key it serves

        def needed() -> set[tuple[int, int, int, bool]]:
            first_of.clear()
            for tp, b, cp, sp in live():
                rank = priority(given[(tp, b, cp, sp)]) if priority is not None else 0.0
                for size in self._missing(tp, b, cp, sp):
                    ilp = (tp, size, cp, sp)
                    first_of[ilp] = min(first_of.get(ilp, rank), rank)
            return set(first_of) - running

        def start(pool: multiprocessing.pool.Pool, key: tuple[int, int, int, bool]) -> None:
            pool.apply_async(_solve_pair, (key,), callback=done.put, error_callback=done.put)
            running.add(key)

        context = multiprocessing.get_context("fork")
        try:
            with contextlib.ExitStack() as pools:
                self._traced(MIN_BASE_BATCH)  # every other size is derived with it (autoplan.passes.rebatch)
                later = [2 * MIN_BASE_BATCH] if sizes - {MIN_BASE_BATCH} else []  # the second base
                later += [1] if 1 in sizes else []  # derived from the two bases
                if later:  # the ILPs of 2 samples run in one worker while this process traces the bases
                    gc.freeze()
                    first = pools.enter_context(context.Pool(1, initializer=_start_worker, initargs=(self,)))
                    first_keys = {(tp, size, cp, sp) for tp, b, cp, sp in todo for size in self._missing(tp, b, cp, sp)}
                    first_keys = {k for k in first_keys if k[1] in self._traces}
                    if priority is not None:  # the most promising two (priced on the traced size alone)
                        ranked = sorted(first_keys, key=lambda k: priority(given[k]) if k in given else math.inf)
                        first_keys = set(ranked[:FIRST_POOL_ILPS])
                    for key in sorted(first_keys):
                        start(first, key)
                        early.add(key)
                    for b in later:
                        self._traced(b)
                if priority is not None:  # before the fork: the workers inherit what it traced and priced
                    for key in todo:
                        priority(given[key])
                gc.freeze()
                pool = pools.enter_context(context.Pool(workers, initializer=_start_worker, initargs=(self,)))
                while True:
                    # by priority, then smallest micro-batch first: its candidates can be laid out while the rest solve
                    order = sorted(needed(), key=lambda k: (first_of[k], k[1], -k[0]))
                    for key in order[: workers - len(running - early)]:
                        start(pool, key)
                    if not running:
                        break
                    try:
                        result = done.get_nowait()
                    except queue.Empty:
                        if while_waiting is not None and while_waiting():
                            continue
                        result = done.get()  # nothing to do meanwhile until the next result
                    if isinstance(result, BaseException):
                        raise result
                    solved: tuple[tuple[int, int, int, bool], SegmentCosts] = result  # type: ignore[assignment]
                    running.discard(solved[0])
                    early.discard(solved[0])
                    self._costs[solved[0]] = solved[1]
        finally:
            gc.unfreeze()
        for key in live():  # every ILP is solved: the scaled sizes and linearity decisions
            self(*key)

    def _prefetch_here(
        self,
        keys: list[tuple[int, ...]],
        *,
        while_waiting: Callable[[], bool] | None,
        skip: Callable[[tuple[int, ...]], bool] | None,
        priority: Callable[[tuple[int, ...]], float] | None,
    ) -> None:
        """:meth:`prefetch` in this process: ``keys`` by ``priority``, each unless ``skip`` says
        so, the ready candidates laid out after each (``while_waiting``, when skipping)."""
        for key in sorted(keys, key=priority) if priority is not None else keys:
            if skip is not None and skip(key):
                continue
            self(*key)
            while skip is not None and while_waiting is not None and while_waiting():
                pass

    def _missing(self, tp: int, microbatch_size: int, cp: int = 1, sp: bool = False) -> set[int]:
        """The micro-batch sizes whose ILPs :meth:`__call__` still needs to answer
        ``(tp, microbatch_size, cp, sp)``, as far as the sizes solved so far decide; empty once it is
        answered (a size that scales linearly is scaled and stored here, see :meth:`__call__`)."""
        key = (tp, microbatch_size, cp, bool(sp))
        if key in self._costs:
            return set()
        if self.extrapolate_batch:
            base = 2
            while base < microbatch_size:
                lin = (tp, base, cp, bool(sp))
                if lin not in self._linear:  # both sides solved exactly (bases below failed)
                    need = self._missing(tp, base // 2, cp, sp) | self._missing(tp, base, cp, sp)
                    if need:
                        return need
                    self._linear[lin] = _scales_linearly(self(tp, base // 2, cp, sp), self(tp, base, cp, sp), 2)
                if self._linear[lin]:
                    self._costs[key] = scale_costs(self(tp, base, cp, sp), microbatch_size / base)
                    return set()
                base *= 2
        return {microbatch_size}

    def __call__(self, tp: int, microbatch_size: int, cp: int = 1, sequence_parallel: bool | int = False) -> SegmentCosts:
        """Costs of a micro-batch of ``microbatch_size`` samples on ``tp`` devices (``cp x tp``
        with context parallelism, :attr:`ParallelConfig.cp`; with ``sequence_parallel`` the ILP
        placed under :func:`~autoplan.planner.mesh.restrict_sequence_parallel`).

        Large models run at their roofline already with one sample (thousands of tokens): the
        costs of ``b`` samples are then ``b`` times those of one (times, activations, cuts and
        FLOPs; parameters, gradient sync and optimizer unchanged), and efficiency only grows
        with ``b``, so the scaled times are an upper bound. ``b`` samples are priced as
        ``b / b0`` times the solved costs of ``b0 < b`` samples for the smallest ``b0`` in
        2, 4, 8, ... whose solved costs are those of ``b0 / 2`` samples doubled within
        :data:`LINEAR_TOLERANCE` (checked per ``tp``); otherwise ``b`` is traced and solved.
        The ILPs :meth:`_missing` names are solved here, smallest first, until it has none left."""
        sp = bool(sequence_parallel)
        key = (tp, microbatch_size, cp, sp)
        while key not in self._costs:
            for size in sorted(self._missing(tp, microbatch_size, cp, sp)):
                self._costs[(tp, size, cp, sp)] = self._solve(tp, size, cp, sp)
        return self._costs[key]

    def _solve(self, tp: int, microbatch_size: int, cp: int = 1, sp: bool = False) -> SegmentCosts:
        """The intra-operator ILP of ``microbatch_size`` samples on ``tp`` devices (on the ``cp x
        tp`` mesh, its ``cp`` axis splitting the sequence: :func:`restrict_context_parallel`),
        summed per segment and expanded to the model's depth."""
        traced, layering = self._traced(microbatch_size)
        group = (f"cp={cp} x tp={tp}" if cp > 1 else f"tp={tp}") + (" with sequence parallelism" if sp else "")
        progress.step(f"segment costs: ILP for {group}, micro-batch {microbatch_size} ({len(self._costs) + 1} solved)")
        sub = replica_cluster(self.cluster, tp, cp=cp)
        with planning_mesh(sub) as mesh:
            table = pass_order.STRATEGIES(traced, mesh)
            if cp > 1:
                restrict_context_parallel(table, gradient_values(traced.graph_module.graph), axis=0)
            if sp and tp > 1:
                restrict_sequence_parallel(table, traced.graph_module.graph, axis=sub.mesh_ndim - 1)
            # the parameters' gradients are reduced over cp with dp's (cost_models.step._DpGroups)
            problem = pass_order.COSTING(
                traced, table, sub, optimizer=self.optimizer, profile=self.profile,
                gradients_reduced_on=(0,) if cp > 1 else (),
            )  # fmt: skip
            # memory is the outer search's constraint (it depends on stages and schedule)
            problem.capacity_bytes = float("inf")
            problem.memory_points = []
            # the last traced block stands for all the later ones (autoplan.passes.expand)
            mult = block_multiplicity(layering, self.num_blocks)
            solution = ShardingILP(
                pass_order.EXPAND(memory_tie_break(problem), mult, twins(traced.graph_module, layering)),
                SolverOptions(time_limit_s=self.time_limit_s),
            ).solve()
        costs = segment_costs(
            traced.graph_module,
            layering,
            problem,
            solution.choice,
            param_nodes=[param_node_name(p) for p in traced.param_names],
            trainable_param_nodes=[param_node_name(p) for p in traced.trainable_names],
            optimizer=self.optimizer,
        )
        costs = dataclasses.replace(costs, master_weights=self.master_weights)
        return expand_blocks(costs, self.num_blocks) if self.num_blocks > layering.num_blocks else costs


def available_cores() -> int:
    """CPU cores this process may run on (``os.sched_getaffinity``, else ``os.cpu_count``)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


_CAPPED_WORKERS: set[str] = set()
"""``AUTOPLAN_WORKERS`` values :func:`default_workers` has warned about capping in this process."""


def default_workers() -> int:
    """Worker processes for :meth:`SegmentCostModel.prefetch`: ``AUTOPLAN_WORKERS`` if set (1:
    solve everything in the planning process), else the CPU cores this process may run on
    (:func:`available_cores`). That is also the maximum: each worker is a forked copy of the
    planning process solving CPU-bound ILPs, so more than the cores only costs memory; a larger
    value (``AUTOPLAN_WORKERS=100000000000000000000`` was handed to the process pool, which forked
    until the machine ran out) is capped there, with a warning. A value that is not a positive
    integer of ASCII digits is a ``ConfigError``."""
    cores = available_cores()
    env = os.environ.get("AUTOPLAN_WORKERS", "").strip()
    if not env:
        return cores
    digits = env.lstrip("0")
    if not env.isascii() or not env.isdigit() or not digits:
        shown = env if len(env) <= 40 else f"{env[:40]}...({len(env) - 40:,} more characters)"
        raise ConfigError(f"AUTOPLAN_WORKERS={shown!r} must be a positive integer (processes), e.g. 4")
    if len(digits) <= len(str(cores)) and int(digits) <= cores:  # a long value never reaches int()
        return int(digits)
    if env not in _CAPPED_WORKERS:
        _CAPPED_WORKERS.add(env)
        shown = env if len(env) <= 40 else f"{env[:40]}...({len(env):,} digits)"
        log.warning(
            "AUTOPLAN_WORKERS=%s is more than the %d CPU cores this process may run on: planning with %d workers",
            shown,
            cores,
            cores,
        )
    return cores


_WORKER_MODEL: SegmentCostModel | None = None
"""In a :meth:`SegmentCostModel.prefetch` worker process only (set by :func:`_start_worker`, never in
the planning process): the worker's copy of the cost model. A module global because a pool task
(:func:`_solve_pair`) receives nothing but its pickled arguments, and the model (graphs, traces) must
not be pickled: it reaches the worker through ``fork`` (a fork context's pool passes ``initargs``
to the new process without pickling) and the task finds it here."""


def _start_worker(model: SegmentCostModel) -> None:
    """Initialiser of a :meth:`SegmentCostModel.prefetch` worker: signals (:func:`_quiet_on_signals`)
    and the cost model its tasks solve with (:data:`_WORKER_MODEL`)."""
    global _WORKER_MODEL  # noqa: PLW0603 - this worker process's cost model, see _WORKER_MODEL
    _quiet_on_signals()
    _WORKER_MODEL = model


def _quiet_on_signals() -> None:
    """In a forked worker: only the planning process stops it. The worker leaves the job's
    process group, so a Ctrl-C (SIGINT) or a SIGTERM sent to the whole job reaches the planning
    process alone, which stops the pool (``Pool.terminate``, SIGTERM to each worker: a worker
    killed by the group signal itself could die holding the pool's queue lock, and the pool
    would then wait for it forever). SIGTERM kills the worker without a traceback (the
    inherited Python handlers would print one per worker); SIGINT is ignored; on Linux the
    worker also dies with the planning process (``PR_SET_PDEATHSIG``), so none is left behind."""
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # out of the foreground group, it may still write to the terminal
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _full_key(key: tuple[int, ...]) -> tuple[int, int, int, bool]:
    """``(tp, microbatch_size[, cp[, sequence_parallel]])`` as ``(tp, microbatch_size, cp, sequence_parallel)``."""
    tp, b, *rest = key
    return tp, b, rest[0] if rest else 1, bool(rest[1]) if len(rest) > 1 else False


def _solve_pair(key: tuple[int, int, int, bool]) -> tuple[tuple[int, int, int, bool], SegmentCosts]:
    """In a forked worker: the ILP of one ``(tp, microbatch_size, cp, sequence_parallel)``."""
    model = _WORKER_MODEL
    assert model is not None, "prefetch workers are started by SegmentCostModel.prefetch"
    # the parent's OpenMP threads are not in this process: an op that forks work to them would
    # wait forever (tracing a model on the CPU runs its ops); one thread runs them inline
    torch.set_num_threads(1)
    with progress.reporting(enabled=False):
        return key, model._solve(*key)  # noqa: SLF001 - the worker's copy of the cost model


FIRST_POOL_ILPS = 2
"""ILPs :meth:`SegmentCostModel.prefetch` gives its first worker, while it traces the other bases,
when told what to skip: the rest wait for the main pool, where what the search has laid out by
then may leave them out."""

BOUND_ROUNDING = 1e-9
"""Relative slack of :meth:`SegmentCostModel.work_lower_bound_s`: the bound and the costs it
bounds sum the same times in other orders (floating-point rounding, ~1e-16 per addition)."""

LINEAR_TOLERANCE = 0.02
"""Largest relative difference between the solved costs of 2 samples and twice those of 1
sample (step time, saved activations, cut bytes; per segment for segments above 1% of the
step) for which larger micro-batches are priced by scaling (:meth:`SegmentCostModel.__call__`)."""


def scale_costs(costs: SegmentCosts, factor: float) -> SegmentCosts:
    """``costs`` of one sample as those of ``factor`` samples: per-sample work and activations
    scale, parameters, gradient synchronisation and the optimizer step do not."""
    per_sample = ("fwd_s", "bwd_s", "bwd_weight_s", "fwd_comm_s", "bwd_comm_s", "selective_recompute_s",
                  "saved_bytes", "selective_kept_bytes", "input_bytes", "shared_input_bytes", "fwd_transient_bytes",
                  "bwd_transient_bytes", "selective_recomputed_bytes",
                  "selective_bwd_transient_bytes", "full_recompute_s", "full_kept_bytes", "full_recomputed_bytes",
                  "full_bwd_transient_bytes", "flops", "fwd_all_to_all_s", "bwd_all_to_all_s",
                  "fwd_all_to_all_bytes", "bwd_all_to_all_bytes", "fwd_ring_s", "bwd_ring_s", "fwd_ring_total_s",
                  "bwd_ring_total_s", "fwd_ring_bytes", "bwd_ring_bytes")  # fmt: skip
    return dataclasses.replace(
        costs,
        segments=tuple(
            dataclasses.replace(s, **{f: getattr(s, f) * factor for f in per_sample}) for s in costs.segments
        ),
        cut_bytes=tuple(c * factor for c in costs.cut_bytes),
    )


def _scales_linearly(one: SegmentCosts, many: SegmentCosts, factor: float) -> bool:
    scaled = scale_costs(one, factor)

    def close(a: float, b: float) -> bool:
        return abs(a - b) <= LINEAR_TOLERANCE * max(abs(b), 1e-30)

    totals = [
        (sum(s.fwd_s + s.bwd_s for s in c.segments), sum(s.saved_bytes for s in c.segments), sum(c.cut_bytes))
        for c in (scaled, many)
    ]
    step = totals[1][0]
    per_segment = all(
        close(a.fwd_s + a.bwd_s, b.fwd_s + b.bwd_s)
        for a, b in zip(scaled.segments, many.segments, strict=True)
        if b.fwd_s + b.bwd_s > 0.01 * step
    )
    return per_segment and all(close(a, b) for a, b in zip(*totals, strict=True))


TIE_BREAK_S_PER_BYTE = 1e-15
"""Seconds the ILP is charged per byte a layout keeps (1 GB -> 1 us): among layouts of equal time
it prefers the one with less memory, so equal problems (a deeper or shallower trace of the same
blocks) get the same answer; far too small to trade real time for memory."""


def memory_tie_break(problem: CostProblem) -> CostProblem:
    """A copy of ``problem`` whose node times carry :data:`TIE_BREAK_S_PER_BYTE` per byte of the
    node's outputs (and, for placeholders, of what they keep for the step)."""
    times = {name: list(ts) for name, ts in problem.node_time_s.items()}
    for ref, sizes in problem.value_bytes.items():
        if ref.node in times:
            times[ref.node] = [t + TIE_BREAK_S_PER_BYTE * b for t, b in zip(times[ref.node], sizes, strict=True)]
    for name, sizes in problem.persistent_bytes.items():
        if name in times:
            times[name] = [t + TIE_BREAK_S_PER_BYTE * b for t, b in zip(times[name], sizes, strict=True)]
    return dataclasses.replace(problem, node_time_s=times)
