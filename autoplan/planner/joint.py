"""The joint search as a public API: ``autoplan.estimate`` (what-if) and the pipeline planner.

    est = autoplan.estimate(model, "4x8xH100", example_inputs=(ids,), loss_fn=lm_loss,
                            example_targets=(ids,), global_batch_size=512, precision="bf16",
                            config=autoplan.ParallelConfig(dp=8, tp=4, pp=1, microbatch_size=2,
                                                           num_microbatches=32))
    print(est.summary())

Both the what-if estimate and the planner's search price a configuration with the same function
(:func:`autoplan.planner.search.evaluate`) over the same per-segment costs: the intra-operator ILP
solved for one micro-batch on the tensor-parallel group (:mod:`autoplan.planner.segment_costs`), so the
planner's choice can be compared number for number with a hand-written configuration.

``example_inputs`` give the per-sample shapes; their batch dimension (dim 0) is resized to each
micro-batch size the search tries.
"""

from __future__ import annotations

import contextlib
import copy
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
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import Replicate, Shard

from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.config import PRECISIONS, SCHEDULES, ParallelConfig
from autoplan.cost_models.errors import ConfigError, PlanMismatchError
from autoplan.cost_models.profile_db import ProfileDB
from autoplan.passes.costing import CostProblem, build_cost_problem
from autoplan.passes.depth import KEPT_BLOCKS, reduce_depth
from autoplan.passes.expand import block_multiplicity, scale_problem, twins
from autoplan.passes.layers import Layering, find_layers
from autoplan.passes.rebatch import MIN_BASE_BATCH, rebatch
from autoplan.passes.strategies import NodeStrategies, StrategyTable, build_strategy_table
from autoplan.passes.trace import LossFn, TracedProgram, forward_fingerprint, param_node_name, trace_training_step
from autoplan.planner import plan_cache, progress
from autoplan.planner.estimate import TrainingEstimate, to_training_estimate
from autoplan.planner.ilp import plan_traced
from autoplan.planner.mesh import as_cluster, planning_mesh, stage_axes, stage_cluster
from autoplan.planner.plan import Estimate, PipelineLayout, Plan
from autoplan.planner.search import (
    Candidate,
    SearchSpace,
    evaluate,
    expand_blocks,
    search,
    tp_cluster,
)
from autoplan.planner.segment_costs import SegmentCosts, segment_costs
from autoplan.planner.solver import ShardingILP, SolverOptions

log = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def with_batch(t: torch.Tensor, batch: int) -> torch.Tensor:
    if t.dim() == 0:
        raise ConfigError("example inputs need a batch dimension (dim 0) to split into micro-batches")
    if t.device.type == "meta":
        return torch.empty((batch, *t.shape[1:]), dtype=t.dtype, device="meta")
    reps = math.ceil(batch / t.shape[0])
    return t.repeat(reps, *([1] * (t.dim() - 1)))[:batch].contiguous()


def trace_microbatch(
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    loss_fn: LossFn | None,
    batch: int,
) -> TracedProgram:
    """The training step of one micro-batch of ``batch`` samples (inputs resized along dim 0)."""
    return trace_training_step(
        model,
        tuple(with_batch(t, batch) for t in inputs),
        loss_fn=loss_fn,
        example_targets=tuple(with_batch(t, batch) for t in targets),
    )


def trace_repeated(
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    loss_fn: LossFn | None,
    batch: int,
    *,
    reduce: bool = True,
) -> tuple[TracedProgram, Layering, int]:
    """One micro-batch's step traced with the first :data:`~autoplan.passes.depth.KEPT_BLOCKS` repeated
    blocks (``reduce``; :mod:`autoplan.passes.depth`), its layering, and the model's real number of
    blocks. Falls back to the full depth when the layering does not see the kept blocks."""
    reduced = reduce_depth(model, KEPT_BLOCKS if reduce else sys.maxsize)
    traced = trace_microbatch(reduced.module, inputs, targets, loss_fn, batch)
    layering = find_layers(traced)
    if reduced.reduced and layering.num_blocks == reduced.kept:
        return traced, layering, reduced.num_blocks
    if reduced.reduced:  # blocks not where the layering sees them: full depth
        traced = trace_microbatch(model, inputs, targets, loss_fn, batch)
        layering = find_layers(traced)
    return traced, layering, layering.num_blocks


def trace_for_plan(
    plan: Plan,
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    loss_fn: LossFn | None,
) -> TracedProgram:
    """The micro-batch step a plan made for a global batch applies to (with the plan's number
    of blocks when it was planned on fewer, :mod:`autoplan.passes.depth`); ``inputs`` must be that global
    batch (:class:`PlanMismatchError` otherwise)."""
    layout = plan.pipeline
    assert layout is not None
    batch = int(inputs[0].shape[0]) if inputs and inputs[0].dim() else 0
    if batch != layout.global_batch_size:
        raise PlanMismatchError(
            f"the plan is for a global batch of {layout.global_batch_size} but the inputs have {batch} samples: "
            f"pass a global batch of {layout.global_batch_size} or re-plan with --global-batch-size {batch}"
        )
    return _trace_planned_step(plan, model, inputs, targets, loss_fn)


def _planned_step(plan: Plan, model: torch.nn.Module) -> tuple[torch.nn.Module, int]:
    """The model and micro-batch size of the step a global-batch plan's placements are for: one
    stage program's ``dp * microbatch_size`` samples, with the plan's number of blocks when it
    was planned on fewer (:mod:`autoplan.passes.depth`)."""
    cfg, layout = plan.config, plan.pipeline
    assert cfg is not None and layout is not None
    if layout.reduced:
        model = reduce_depth(model, layout.traced_blocks).module
    return model, cfg.microbatch_size * cfg.dp


def _trace_planned_step(
    plan: Plan,
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    loss_fn: LossFn | None,
) -> TracedProgram:
    """The step a global-batch plan is for, traced (``inputs`` resized to its micro-batch)."""
    model, batch = _planned_step(plan, model)
    return trace_microbatch(model, inputs, targets, loss_fn, batch)


def _forward_fingerprint(
    plan: Plan,
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    loss_fn: LossFn | None,
) -> str:
    """:func:`autoplan.passes.trace.forward_fingerprint` of the step a global-batch plan is for: what the
    plan cache checks a hit with (an export, without the backward graph a full trace builds)."""
    model, batch = _planned_step(plan, model)
    return forward_fingerprint(
        model,
        tuple(with_batch(t, batch) for t in inputs),
        loss_fn=loss_fn,
        example_targets=tuple(with_batch(t, batch) for t in targets),
    )


@dataclass(slots=True)
class SegmentCostModel:
    """``(tp, microbatch_size) -> SegmentCosts`` for a model: trace one micro-batch, solve the
    intra-operator ILP on a tensor-parallel group, sum per segment (memoised)."""

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
    num_blocks: int = 0
    _traces: dict[int, tuple[TracedProgram, Layering]] = field(default_factory=dict)
    _exported: set[int] = field(default_factory=set)
    """Micro-batch sizes in ``_traces`` that were traced (the others were derived from them)."""
    _costs: dict[tuple[int, int], SegmentCosts] = field(default_factory=dict)
    _linear: dict[tuple[int, int], bool] = field(default_factory=dict)

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
        traced = rebatch(first, second, bases[0], bases[1], batch)
        if traced is None:
            return None
        layering = find_layers(traced)
        if layering.num_blocks != layering2.num_blocks:
            return None
        return traced, layering

    def ready(self, tp: int, microbatch_size: int) -> bool:
        """Whether ``(tp, microbatch_size)`` is answered without solving another ILP."""
        return not self._missing(tp, microbatch_size)

    def prefetch(self, keys: Iterable[tuple[int, int]], *, while_waiting: Callable[[], bool] | None = None) -> None:
        """Solve the costs of every ``(tp, microbatch_size)`` in ``keys`` now, in forked worker
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
        Runs in this process
        when there is one worker, no ``fork`` start method (Windows), or a process group (inside
        a job)."""
        todo = sorted({k for k in keys if k not in self._costs})
        workers = self.workers or default_workers()
        # a forked copy of a process in a job would share its process group: solve here
        if (
            workers <= 1
            or not todo
            or "fork" not in multiprocessing.get_all_start_methods()
            or torch.distributed.is_initialized()
        ):
            for tp, b in todo:
                self(tp, b)
            return
        sizes = {b for _, b in todo}
        if self.extrapolate_batch and max(sizes) > MIN_BASE_BATCH:
            sizes |= {1, MIN_BASE_BATCH}  # the first linearity check (SegmentCostModel._missing)
        global _FORKED_MODEL  # noqa: PLW0603 - what a forked worker inherits (never pickled)
        _FORKED_MODEL = self
        done: queue.SimpleQueue[object] = queue.SimpleQueue()
        running: set[tuple[int, int]] = set()
        early: set[tuple[int, int]] = set()  # running in the first, one-process pool

        def needed() -> set[tuple[int, int]]:
            return {(tp, size) for tp, b in todo for size in self._missing(tp, b)} - running

        def start(pool: multiprocessing.pool.Pool, key: tuple[int, int]) -> None:
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
                    first = pools.enter_context(context.Pool(1, initializer=_quiet_on_signals))
                    for key in sorted(k for k in needed() if k[1] in self._traces):
                        start(first, key)
                        early.add(key)
                    for b in later:
                        self._traced(b)
                gc.freeze()
                pool = pools.enter_context(context.Pool(workers, initializer=_quiet_on_signals))
                while True:
                    # smallest micro-batch first: its candidates can be laid out while the rest solve
                    for key in sorted(needed(), key=lambda k: (k[1], -k[0]))[: workers - len(running - early)]:
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
                    solved: tuple[tuple[int, int], SegmentCosts] = result  # type: ignore[assignment]
                    running.discard(solved[0])
                    early.discard(solved[0])
                    self._costs[solved[0]] = solved[1]
        finally:
            _FORKED_MODEL = None
            gc.unfreeze()
        for tp, b in todo:  # every ILP is solved: the scaled sizes and linearity decisions
            self(tp, b)

    def _missing(self, tp: int, microbatch_size: int) -> set[int]:
        """The micro-batch sizes whose ILPs :meth:`__call__` still needs to answer
        ``(tp, microbatch_size)``, as far as the sizes solved so far decide; empty once it is
        answered (a size that scales linearly is scaled and stored here, see :meth:`__call__`)."""
        key = (tp, microbatch_size)
        if key in self._costs:
            return set()
        if self.extrapolate_batch:
            base = 2
            while base < microbatch_size:
                if (tp, base) not in self._linear:  # both sides solved exactly (bases below failed)
                    need = self._missing(tp, base // 2) | self._missing(tp, base)
                    if need:
                        return need
                    self._linear[(tp, base)] = _scales_linearly(self(tp, base // 2), self(tp, base), 2)
                if self._linear[(tp, base)]:
                    self._costs[key] = scale_costs(self(tp, base), microbatch_size / base)
                    return set()
                base *= 2
        return {microbatch_size}

    def __call__(self, tp: int, microbatch_size: int) -> SegmentCosts:
        """Costs of a micro-batch of ``microbatch_size`` samples on ``tp`` devices.

        Large models run at their roofline already with one sample (thousands of tokens): the
        costs of ``b`` samples are then ``b`` times those of one (times, activations, cuts and
        FLOPs; parameters, gradient sync and optimizer unchanged), and efficiency only grows
        with ``b``, so the scaled times are an upper bound. ``b`` samples are priced as
        ``b / b0`` times the solved costs of ``b0 < b`` samples for the smallest ``b0`` in
        2, 4, 8, ... whose solved costs are those of ``b0 / 2`` samples doubled within
        :data:`LINEAR_TOLERANCE` (checked per ``tp``); otherwise ``b`` is traced and solved.
        The ILPs :meth:`_missing` names are solved here, smallest first, until it has none left."""
        key = (tp, microbatch_size)
        while key not in self._costs:
            for size in sorted(self._missing(tp, microbatch_size)):
                self._costs[(tp, size)] = self._solve(tp, size)
        return self._costs[key]

    def _solve(self, tp: int, microbatch_size: int) -> SegmentCosts:
        """The intra-operator ILP of ``microbatch_size`` samples on ``tp`` devices, summed per
        segment and expanded to the model's depth."""
        traced, layering = self._traced(microbatch_size)
        progress.step(f"segment costs: ILP for tp={tp}, micro-batch {microbatch_size} ({len(self._costs) + 1} solved)")
        sub = tp_cluster(self.cluster, tp)
        with planning_mesh(sub) as mesh:
            table = build_strategy_table(traced, mesh)
            problem = build_cost_problem(traced, table, sub, optimizer=self.optimizer, profile=self.profile)
            # memory is the outer search's constraint (it depends on stages and schedule)
            problem.capacity_bytes = float("inf")
            problem.memory_points = []
            # the last traced block stands for all the later ones (autoplan.passes.expand)
            mult = block_multiplicity(layering, self.num_blocks)
            solution = ShardingILP(
                scale_problem(_memory_tie_break(problem), mult, twins(traced.graph_module, layering)),
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
        return expand_blocks(costs, self.num_blocks) if self.num_blocks > layering.num_blocks else costs


def default_workers() -> int:
    """Worker processes for :meth:`SegmentCostModel.prefetch`: ``AUTOPLAN_WORKERS`` if set (1:
    solve everything in the planning process), else the CPU cores this process may run on."""
    env = os.environ.get("AUTOPLAN_WORKERS", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ConfigError(f"AUTOPLAN_WORKERS={env!r} must be a positive integer (processes), e.g. 4")
        return int(env)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


_FORKED_MODEL: SegmentCostModel | None = None
"""The cost model a :meth:`SegmentCostModel.prefetch` worker inherits through ``fork``."""


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
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _solve_pair(key: tuple[int, int]) -> tuple[tuple[int, int], SegmentCosts]:
    """In a forked worker: the ILP of one ``(tp, microbatch_size)``."""
    model = _FORKED_MODEL
    assert model is not None, "prefetch workers are forked from SegmentCostModel.prefetch"
    # the parent's OpenMP threads are not in this process: an op that forks work to them would
    # wait forever (tracing a model on the CPU runs its ops); one thread runs them inline
    torch.set_num_threads(1)
    with progress.reporting(enabled=False):
        return key, model._solve(*key)  # noqa: SLF001 - the worker's copy of the cost model


LINEAR_TOLERANCE = 0.02
"""Largest relative difference between the solved costs of 2 samples and twice those of 1
sample (step time, saved activations, cut bytes; per segment for segments above 1% of the
step) for which larger micro-batches are priced by scaling (:meth:`SegmentCostModel.__call__`)."""


def scale_costs(costs: SegmentCosts, factor: float) -> SegmentCosts:
    """``costs`` of one sample as those of ``factor`` samples: per-sample work and activations
    scale, parameters, gradient synchronisation and the optimizer step do not."""
    per_sample = ("fwd_s", "bwd_s", "bwd_weight_s", "fwd_comm_s", "bwd_comm_s", "selective_recompute_s",
                  "saved_bytes", "saved_matmul_bytes", "input_bytes", "flops")  # fmt: skip
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


def _memory_tie_break(problem: CostProblem) -> CostProblem:
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


def prepare_for_precision(
    model: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    example_targets: Sequence[torch.Tensor],
    precision: str,
) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    dtype = _DTYPES[precision]
    if not example_inputs:
        raise ConfigError("example_inputs is empty: pass one example batch (its per-sample shapes are used)")
    if precision != "fp32" and any(p.dtype != dtype for p in model.parameters() if p.is_floating_point()):
        model = copy.deepcopy(model).to(dtype)  # the user's model is left as it is

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    return model, tuple(cast(t) for t in example_inputs), tuple(cast(t) for t in example_targets)


def _tokens_per_sample(example_inputs: Sequence[torch.Tensor]) -> int:
    first = example_inputs[0]
    return int(first.shape[1]) if first.dim() >= 2 and not first.is_floating_point() else 1


def _check_config(config: ParallelConfig, cluster: Cluster, num_blocks: int, global_batch_size: int) -> None:
    config.check_against(
        world_size=cluster.world_size,
        devices_per_node=cluster.devices_per_node,
        num_blocks=num_blocks,
        global_batch_size=global_batch_size,
    )


def estimate(
    model: torch.nn.Module,
    cluster: Cluster | str,
    example_inputs: Sequence[torch.Tensor],
    *,
    config: ParallelConfig,
    global_batch_size: int,
    loss_fn: LossFn | None = None,
    example_targets: Sequence[torch.Tensor] = (),
    precision: str = "fp32",
    optimizer: str = "adam",
    profile: ProfileDB | None = None,
) -> TrainingEstimate:
    """Price a hand-written configuration with the planner's cost model (see the module docstring)."""
    cluster = as_cluster(cluster)
    model, inputs, targets = prepare_for_precision(model, example_inputs, example_targets, precision)
    costs = SegmentCostModel(model, inputs, loss_fn, targets, cluster, optimizer=optimizer, profile=profile)
    costs._traced(config.microbatch_size)  # noqa: SLF001 - learn the number of blocks before any ILP
    _check_config(config, cluster, costs.num_blocks, global_batch_size)
    seg = costs(config.tp, config.microbatch_size)
    cand = Candidate(
        dp=config.dp, tp=config.tp, pp=config.pp, microbatch_size=config.microbatch_size,
        num_microbatches=config.num_microbatches, schedule=config.schedule if config.pp > 1 else "none",
        virtual_stages=config.virtual_stages, recompute=config.recompute, zero_stage=config.zero_stage,
        stage_dp=config.stage_dp,
    )  # fmt: skip
    samples = config.dp * config.microbatch_size
    stage_costs = [costs(config.tp, samples // d) for d in config.stage_dp] if config.stage_dp else None
    est = evaluate(
        cand, seg, cluster, precision=precision, tokens_per_sample=_tokens_per_sample(inputs), stage_costs=stage_costs
    )
    return to_training_estimate(est, precision=precision, num_blocks=costs.num_blocks)


def search_config(
    model: torch.nn.Module,
    cluster: Cluster | str,
    example_inputs: Sequence[torch.Tensor],
    *,
    global_batch_size: int,
    loss_fn: LossFn | None = None,
    example_targets: Sequence[torch.Tensor] = (),
    precision: str = "fp32",
    optimizer: str = "adam",
    profile: ProfileDB | None = None,
    space: SearchSpace | None = None,
    config: ParallelConfig | None = None,
    reduce_repeated: bool = True,
) -> tuple[TrainingEstimate, list[TrainingEstimate]]:
    """The planner's joint search: the fastest configuration that fits, and every one it priced
    (``config``: only that configuration, its stage boundaries searched)."""
    best, every, _ = _search(
        model, cluster, example_inputs, global_batch_size=global_batch_size, loss_fn=loss_fn,
        example_targets=example_targets, precision=precision, optimizer=optimizer, profile=profile, space=space,
        config=config, reduce_repeated=reduce_repeated,
    )  # fmt: skip
    return best, every


def _search(
    model: torch.nn.Module,
    cluster: Cluster | str,
    example_inputs: Sequence[torch.Tensor],
    *,
    global_batch_size: int,
    loss_fn: LossFn | None,
    example_targets: Sequence[torch.Tensor],
    precision: str,
    optimizer: str,
    profile: ProfileDB | None,
    space: SearchSpace | None,
    config: ParallelConfig | None,
    reduce_repeated: bool,
) -> tuple[TrainingEstimate, list[TrainingEstimate], SegmentCostModel]:
    """:func:`search_config`, and the cost model it priced with (its traces serve the stage ILP)."""
    cluster = as_cluster(cluster)
    if global_batch_size < 1:
        raise ConfigError(f"global_batch_size must be a positive integer, got {global_batch_size!r}")
    model, inputs, targets = prepare_for_precision(model, example_inputs, example_targets, precision)
    costs = SegmentCostModel(
        model, inputs, loss_fn, targets, cluster, optimizer=optimizer, profile=profile,
        reduce_repeated=reduce_repeated, extrapolate_batch=reduce_repeated,
    )  # fmt: skip
    costs._traced(MIN_BASE_BATCH)  # noqa: SLF001 - learn the number of blocks (and a base, autoplan.passes.rebatch)
    if config is not None:
        _check_config(config, cluster, costs.num_blocks, global_batch_size)
        if config.stage_dp is not None:
            raise ConfigError("a config with stage_dp fixes the stages: price it with autoplan.estimate")
        space = _space_for(config)
    progress.step(f"searching degrees, stages, schedules for {cluster.world_size} devices")
    best, every = search(
        costs,
        cluster,
        num_blocks=costs.num_blocks,
        global_batch_size=global_batch_size,
        space=space,
        precision=precision,
        tokens_per_sample=_tokens_per_sample(inputs),
    )
    conv = [to_training_estimate(e, precision=precision, num_blocks=costs.num_blocks) for e in every]
    return to_training_estimate(best, precision=precision, num_blocks=costs.num_blocks), conv, costs


__all__ = ["SegmentCostModel", "estimate", "plan_for_batch", "search_config"]


# --- plans made with a global batch -------------------------------------------------------------


def _restrict_for_config(table: StrategyTable, traced: TracedProgram, config: ParallelConfig) -> None:
    """Data parallelism as the search priced it: inputs and targets split along the batch on the
    ``dp`` axis; parameters replicated on ``dp`` (ZeRO 0-2) or sharded on it (ZeRO 3, where the
    shape allows)."""
    if config.dp == 1:
        return
    dp_axis = 0  # stage_axes puts dp first when it is larger than one
    for name, ns in list(table.nodes.items()):
        if ns.kind not in ("param", "input"):
            continue
        if name.startswith("p_"):
            if config.zero_stage >= 3:
                keep = tuple(s for s in ns.strategies if isinstance(s.output_specs[0][dp_axis], Shard))
            else:
                keep = tuple(s for s in ns.strategies if isinstance(s.output_specs[0][dp_axis], Replicate))
        elif name.startswith(("input_", "target_")):
            keep = tuple(s for s in ns.strategies if s.output_specs[0][dp_axis] == Shard(0))
        else:
            continue
        if keep:
            table.nodes[name] = NodeStrategies(node=ns.node, kind=ns.kind, strategies=keep, inputs=ns.inputs)


EXECUTABLE_SPACE = SearchSpace(
    schedules=SCHEDULES,
    recompute=("none", "full"),
    zero_stages=(0, 3),
    hetero_stages=False,
)
"""What ``autoplan.parallelize`` can run today: plans are searched in this space (the what-if
:func:`estimate` and :func:`search_config` also price selective recomputation, ZeRO 1-2 and
stages on sub-meshes of different sizes)."""


def _check_executable(config: ParallelConfig) -> None:
    bad = [
        f"{name}={value!r}"
        for name, value, allowed in (
            ("schedule", config.schedule, (*EXECUTABLE_SPACE.schedules, "none")),
            ("recompute", config.recompute, EXECUTABLE_SPACE.recompute),
            ("zero_stage", config.zero_stage, EXECUTABLE_SPACE.zero_stages),
        )
        if value not in allowed and not (name == "schedule" and config.pp == 1)
    ]
    if config.stage_dp is not None:
        bad.append(f"stage_dp={list(config.stage_dp)}")
    if bad:
        raise ConfigError(
            f"{', '.join(bad)} can be estimated (autoplan.estimate) but not run yet: plan with schedule in "
            f"{EXECUTABLE_SPACE.schedules}, recompute in {EXECUTABLE_SPACE.recompute}, zero_stage in "
            f"{EXECUTABLE_SPACE.zero_stages} and without stage_dp"
        )


def _space_for(config: ParallelConfig) -> SearchSpace:
    """A search space holding exactly ``config`` (stage boundaries still searched)."""
    schedule = config.schedule if config.pp > 1 else "none"
    return SearchSpace(
        schedules=(schedule,),
        virtual_stages=(config.virtual_stages,),
        recompute=(config.recompute,),
        zero_stages=(config.zero_stage,),
        microbatch_sizes=(config.microbatch_size,),
        per_stage_recompute=False,
        hetero_stages=False,
        fixed={"dp": config.dp, "tp": config.tp, "pp": config.pp, "num_microbatches": config.num_microbatches,
               "schedule": schedule, "virtual_stages": config.virtual_stages},
    )  # fmt: skip


def plan_for_batch(
    model: torch.nn.Module,
    cluster: Cluster,
    *,
    example_inputs: Sequence[torch.Tensor],
    loss_fn: LossFn | None,
    example_targets: Sequence[torch.Tensor],
    global_batch_size: int,
    precision: str = "fp32",
    optimizer: str = "adam",
    profile: ProfileDB | None = None,
    space: SearchSpace | None = None,
    time_limit_s: float = 120.0,
    solver: str = "auto",
    config: ParallelConfig | None = None,
    reduce_repeated: bool = True,
) -> Plan:
    """The joint search, then the placements of one stage's program for the chosen config.
    ``config`` fixes the degrees and knobs (the search then only places the stage boundaries).
    The search covers what the runtime executes (:data:`EXECUTABLE_SPACE`) unless ``space`` says
    otherwise. ``reduce_repeated``: plan on two traced blocks standing for all of them
    (:mod:`autoplan.passes.depth`, :mod:`autoplan.passes.expand`); False traces and solves the full depth."""
    if config is not None:
        _check_executable(config)
    space = space or EXECUTABLE_SPACE
    t0 = time.perf_counter()
    options = {
        "global_batch_size": global_batch_size, "precision": precision, "optimizer": optimizer, "space": repr(space),
        "time_limit_s": time_limit_s, "solver": solver, "config": config.to_dict() if config else None,
        "reduce_repeated": reduce_repeated,
    }  # fmt: skip
    key = plan_cache.plan_key(model, example_inputs, example_targets, loss_fn, cluster, options, profile)
    cached = plan_cache.load(key)
    if cached is not None and cached.plan.config is not None and cached.plan.pipeline is not None:
        # the key sees the forward of every module class, not the helpers they call: the entry
        # counts only if the model still exports to the graph the plan was made for
        now = _forward_fingerprint(cached.plan, model, example_inputs, example_targets, loss_fn)
        if now == cached.forward_fingerprint:
            log.info("plan cache hit (forward fingerprint %s)", now)
            return cached.plan
        log.info("stale plan cache entry (forward %s, now %s): re-planning", cached.forward_fingerprint, now)
    best, _, costs = _search(
        model, cluster, example_inputs, global_batch_size=global_batch_size, loss_fn=loss_fn,
        example_targets=example_targets, precision=precision, optimizer=optimizer, profile=profile, space=space,
        config=config, reduce_repeated=reduce_repeated,
    )  # fmt: skip
    cfg = best.config
    # the stage program with the repeated blocks traced once (autoplan.passes.depth), solved with the
    # copies' variables shared (autoplan.passes.expand); memory is the outer search's constraint. It must
    # be the graph parallelize traces (trace_for_plan): from 2 samples on, the cost model's
    # derived traces are that graph exactly (autoplan.passes.rebatch); one sample is traced on its own
    samples = cfg.microbatch_size * cfg.dp
    if samples >= MIN_BASE_BATCH:
        traced, layering = costs._traced(samples)  # noqa: SLF001
        num_blocks = costs.num_blocks
    else:
        traced, layering, num_blocks = trace_repeated(
            costs.model, costs.example_inputs, costs.example_targets, loss_fn, samples, reduce=reduce_repeated
        )
    mult = block_multiplicity(layering, num_blocks)
    twin = twins(traced.graph_module, layering)
    reduction: dict[str, int] = {}

    def adjust(problem: CostProblem) -> CostProblem:
        # decision variables (one per node and strategy) and edges, solved vs standing for
        reduction.update(
            traced_blocks=layering.num_blocks,
            num_blocks=num_blocks,
            nodes=len(problem.node_time_s),
            nodes_full_depth=sum(mult.get(n, 1) for n in problem.node_time_s),
            x_variables=sum(len(t) for t in problem.node_time_s.values()),
            x_variables_full_depth=sum(len(t) * mult.get(n, 1) for n, t in problem.node_time_s.items()),
            edges=len(problem.edges),
            edges_full_depth=sum(mult.get(e.consumer, 1) for e in problem.edges),
        )
        problem = scale_problem(_memory_tie_break(problem), mult, twin)
        return dataclasses.replace(problem, capacity_bytes=float("inf"), memory_points=[])

    sub = stage_cluster(cluster, cfg)
    with planning_mesh(sub) as mesh:
        stage = plan_traced(
            traced, sub, mesh=mesh, optimizer=optimizer, time_limit_s=time_limit_s, solver=solver, profile=profile,
            restrict=lambda table, tr: _restrict_for_config(table, tr, cfg), adjust=adjust,
        )  # fmt: skip
    worst = max(range(len(best.memory_parts_bytes)), key=lambda k: sum(best.memory_parts_bytes[k].values()))
    parts = dict(best.memory_parts_bytes[worst])
    estimate = Estimate(
        step_time_s=best.step_time_s,
        compute_s=best.compute_s,
        comm_s=best.exposed_comm_s,
        memory_bytes={**parts, "total": best.peak_memory_bytes},
        capacity_bytes=best.capacity_bytes,
        memory_peak_at=f"stage {worst}",
        compute_sources=stage.estimate.compute_sources,
        exposed_comm_s=best.exposed_comm_s,
        bubble_s=best.bubble_s,
        mfu=best.mfu,
        tokens_per_s=best.tokens_per_s,
        memory_per_device_bytes=best.memory_per_device_bytes,
    )
    layout = PipelineLayout(
        stage_starts=best.stage_starts,
        stage_recompute=best.stage_recompute,
        segment_names=("prologue", *(f"{layering.block_prefix}.{i}" for i in range(num_blocks)), "epilogue"),
        stage_mesh_shape=stage_axes(cfg)[0],
        stage_axis_names=stage_axes(cfg)[1],
        global_batch_size=global_batch_size,
        precision=precision,
        block_list=layering.block_prefix,
        traced_blocks=layering.num_blocks,
    )
    solver_info = {**stage.solver, "plan_time_s": round(time.perf_counter() - t0, 3), "reduction": reduction}
    result = dataclasses.replace(
        stage, cluster=cluster, estimate=estimate, config=cfg, pipeline=layout, solver=solver_info
    )
    if plan_cache.enabled():
        forward = _forward_fingerprint(result, model, example_inputs, example_targets, loss_fn)
        plan_cache.store(key, plan_cache.CacheEntry(plan=result, forward_fingerprint=forward))
    return result
