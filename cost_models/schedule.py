"""Pipeline-parallel step time and in-flight micro-batches.

Notation: ``p`` pipeline ranks, ``v`` chunks (virtual stages) per rank, ``S = p v`` stages with
stage ``i`` on rank ``i mod p`` (torch.distributed.pipelining's layout), ``m`` micro-batches.
Stage ``s`` costs, per micro-batch, ``f_s`` forward, ``b_s`` backward to its inputs (plus any
recomputation) and ``w_s`` backward to its weights; every schedule except zero-bubble runs the
full backward ``B_s = b_s + w_s`` as one action. ``c_s`` is the time to send one micro-batch's
activation across the boundary ``s -> s+1``; its gradient comes back in the same time.

Simulation (:func:`simulate`). Each rank runs its actions in the order torch's schedule class
runs them (:func:`schedule_actions`); an action starts when its rank is free and its input has
arrived; transfers occupy no rank (asynchronous send/recv)::

    F(s,k) starts >= end F(s-1,k) + c_{s-1}     B(s,k) starts >= end B(s+1,k) + c_s
    W(s,k) after B(s,k), B(s,k) after F(s,k)    (same rank, in its order)

    step    = end of the last action          bubble = step - max_r busy_r
    p2p exposed = step - step with every c = 0

In flight on stage ``s``: micro-batches ``k`` with F(s,k) started and B(s,k) not finished --
zero-bubble: W(s,k) not finished, since the weight gradient reads the saved inputs (the part only
B reads could be freed at B; this count is the upper one). A stage's F, B and W run on one rank,
so the peak follows from the order alone.

Uniform stages (the same ``f, b, w, c`` everywhere), makespan ``T``::

    gpipe             T = (m + p - 1)(f + B) + 2 (p - 1) c                                    exact
    1f1b              T = (m + p - 1)(f + B) + 2 c ((p - 1) + floor((m - 1)(p - 1) / p))      exact
    interleaved-1f1b  T = (m v + p - 1)(f + B) + 2 (p v - 1) c              exact if c <= min(f, B)
    zero-bubble       T = (m + p - 1)(f + b) + m w - (min(m, p) - 1) min(f, b, w)        exact if c = 0
                          + 2 c ((p - 1) + min(max(m - 2, 0), p - 1))       exact if f = b = w, c <= f/2

and the bubble fraction ``(T - m v (f + B)) / T`` with ``c = 0`` (:func:`bubble_fraction`)::

    gpipe, 1f1b       (p - 1) / (m + p - 1)
    interleaved-1f1b  (p - 1) / (m v + p - 1)
    zero-bubble       (p - 1) / (3 m + p - 1)                               f = b = w, m >= p

* GPipe: F(s,k) waits for F(s-1,k) and F(s,k-1), so the forwards end with the longest monotone
  path through the p x m grid: p + m - 1 forwards, each boundary crossed once; the backwards
  mirror it (Huang et al., "GPipe", NeurIPS 2019).
* 1F1B: rank r runs min(m, p - r) forwards, then alternates B and F (PipeDream-Flush:
  Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021); the fill and
  drain cost (p - 1)(f + B) as in GPipe. With transfers the steady state is the loop
  F(0,k) -> ... -> F(p-1,k) -> B(p-1,k) -> ... -> B(0,k) -> F(0,k+p): 2 (p - 1) transfers per p
  micro-batches; the floor is what the simulation gives (checked for p <= 8, m <= 32 and c up
  to 20 f). torch's Schedule1F1B refuses m < p; the model prices it anyway.
* Interleaved (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM", SC 2021, sec. 2.2.1): a rank's work is m v chunk passes and the fill and
  drain still cost p - 1 of them, so the bubble is 1/v of 1F1B's in units of a rank's work per
  micro-batch: T = (m + (p - 1)/v) v (f + B). The p2p term was checked for p <= 8, v <= 4,
  m <= 8p and for p <= 16, v <= 16, m <= 4p (c <= f); larger c also slows the steady state: simulate.
* Zero-bubble ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, sec. 3.1): B only
  computes input gradients, so fill and drain cost (p - 1)(f + b); rank r defers r W's into its
  drain, where they hide (min(m, p) - 1) min(f, b, w) of that idle time. With f = b = w and
  m >= p this is the paper's bubble (p - 1)(F + B - W). The min term was found with the
  simulator and checked against it for p <= 8, m <= 32, f, b, w in {0, 0.25, 0.5, 1, 1.5, 2, 3};
  the p2p term for p <= 8, m <= 40.

Peak in-flight micro-batches per rank, counted in chunk-micro-batches
(:func:`inflight_microbatches`, equal to the simulation's)::

    gpipe             m
    1f1b              min(m, p - r)
    interleaved-1f1b  min(2 (p - r - 1) + (v - 1) p + 1, m v)    (Megatron-LM's warm-up + 1)
    zero-bubble       min(m, p)          (freed at W; the maximum over ranks equals 1F1B's)

Non-uniform stages (:func:`fast_step_time` beyond ``max_simulated_actions``), with
``fb_s = f_s + B_s``, ``W_r`` the sum of ``fb_s`` over rank r's stages and ``*`` the stage with
the largest ``f + b + w``::

    gpipe             T = sum fb + (m - 1)(max_s f_s + max_s B_s) + 2 sum c                exact
    1f1b              T ~ sum fb + 2 sum c + (m - 1) P,
                      P = max over stage ranges r..j of (sum_{r..j} fb + 2 sum_{r..j-1} c) / (j - r + 1)
    interleaved-1f1b  T ~ m max_r W_r + (sum fb - max_r W_r) / v + 2 sum c
    zero-bubble       T ~ m (f+b+w)_* + sum (f+b) - (f+b)_* - (min(m,p) - 1) min_s min(f_s, b_s, w_s)
                          + 2 sum c (1 + min(max(m - 2, 0), p - 1) / (p - 1))

GPipe's longest path spends its m - 1 extra forwards on the slowest forward stage and its m - 1
extra backwards on the slowest backward stage. 1F1B's steady state is paced by its slowest loop:
ranks r..j hand a micro-batch down and its gradient back while each does one F and one B (the
single-stage ranges give max fb, the full range the round trip). The others reduce to the uniform
table (1f1b within 2c: P has no floor). Measured against the simulation, 6000 random cases,
stage times uniform within +-20% (+-50%) of their mean, c in [0, 0.3 f], p <= 10::

                         4p <= m <= 10p            p <= m <= 10p
    1f1b                 +0.0 .. +2.0% (+5.1%)     +0.0 .. +5.3% (+15%)     never below
    interleaved v >= 2   -1.8 .. +6.7% (-9.8/+6.1) -3.6 .. +7.2% (-12/+10%)
    interleaved v = 1    +0.0 .. +9.3% (+14%)      +0.0 .. +11% (+18%)
    zero-bubble          -0.4 .. +2.8% (-2.5/+4.7) -1.3 .. +8.2% (-3.7/+15%)

The simulation stays the reference: below ``max_simulated_actions`` fast_step_time runs it
(about 0.5 ms per 4096 actions once the order for (schedule, p, m, v) is cached).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from autoplan.cost_models.config import ScheduleName, check_schedule

ActionKind = Literal["F", "B", "W"]

MAX_SIMULATED_ACTIONS = 4096
"""``fast_step_time`` simulates when a schedule has at most this many F/B/W actions."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StageTimes:
    """Compute time of one micro-batch on one pipeline stage (one model chunk)."""

    fwd_s: float
    """Forward of one micro-batch."""
    bwd_input_s: float
    """Backward with respect to the stage's inputs (activation gradients); add the forward time
    here when the stage recomputes its activations."""
    bwd_weight_s: float
    """Backward with respect to the stage's weights."""

    def __post_init__(self) -> None:
        for name in ("fwd_s", "bwd_input_s", "bwd_weight_s"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"StageTimes.{name} is {getattr(self, name)}; stage times must be >= 0 seconds")

    @property
    def bwd_s(self) -> float:
        """Full backward (input and weight gradients) of one micro-batch."""
        return self.bwd_input_s + self.bwd_weight_s

    def __str__(self) -> str:
        return f"F{self.fwd_s:.3g}/B{self.bwd_input_s:.3g}/W{self.bwd_weight_s:.3g}s"


@dataclass(frozen=True, kw_only=True, slots=True)
class Action:
    """One computation of a schedule: ``F``, ``B`` or ``W`` of one micro-batch on one stage.

    ``B`` is the full backward except in the zero-bubble schedule, where it is the input-gradient
    half and ``W`` the weight-gradient half. Printed like torch.distributed.pipelining's
    ``_Action``: ``3F1`` is the forward of micro-batch 1 on stage 3.
    """

    kind: ActionKind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass(frozen=True, kw_only=True, slots=True)
class TimedAction:
    """An action with the times the simulation ran it."""

    action: Action
    rank: int
    start_s: float
    end_s: float

    def __str__(self) -> str:
        return f"{self.action}@[{self.start_s:.4g},{self.end_s:.4g}]"


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineTimeline:
    """Result of :func:`simulate`: one training step's pipeline timeline."""

    schedule: ScheduleName
    num_microbatches: int
    virtual_stages: int
    step_s: float
    """Makespan: the end of the last action on any rank (the first starts at 0)."""
    busy_s: tuple[float, ...]
    """Compute time per rank (sum of its actions' durations)."""
    bubble_s: float
    """``step_s - max(busy_s)``: idle time of the busiest rank."""
    p2p_exposed_s: float
    """``step_s`` minus the makespan of the same schedule with free transfers (>= 0)."""
    peak_inflight: tuple[int, ...]
    """Per stage: most micro-batches whose F has started and whose B (zero-bubble: W) has not
    finished, i.e. whose saved activations are alive."""
    peak_inflight_per_rank: tuple[int, ...]
    """Per rank: the same count summed over the rank's stages (chunk-micro-batches), at its peak."""
    actions: tuple[tuple[TimedAction, ...], ...]
    """Per rank, its actions in execution order."""

    @property
    def num_ranks(self) -> int:
        return len(self.busy_s)

    def __str__(self) -> str:
        return (
            f"{self.schedule} pp={self.num_ranks} v={self.virtual_stages} m={self.num_microbatches}: "
            f"step {self.step_s:.4g}s, bubble {self.bubble_s:.4g}s, p2p exposed {self.p2p_exposed_s:.4g}s, "
            f"peak in-flight {list(self.peak_inflight_per_rank)}"
        )


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _check_inputs(
    stages: Sequence[StageTimes],
    schedule: str,
    num_microbatches: int,
    num_ranks: int,
    virtual_stages: int,
    p2p_s: float | Sequence[float],
) -> list[float]:
    """Validate the arguments of :func:`simulate` and return the per-link transfer times."""
    check_schedule(schedule, pp=num_ranks, num_microbatches=num_microbatches, virtual_stages=virtual_stages)
    num_stages = num_ranks * virtual_stages
    if len(stages) != num_stages:
        raise ValueError(
            f"got {len(stages)} stage times for {num_ranks} ranks x {virtual_stages} virtual stages; "
            f"pass {num_stages} StageTimes (stage i runs on rank i % {num_ranks})"
        )
    if isinstance(p2p_s, (int, float)):
        links = [float(p2p_s)] * (num_stages - 1)
    else:
        links = [float(t) for t in p2p_s]
        if len(links) != num_stages - 1:
            raise ValueError(
                f"got {len(links)} p2p times for {num_stages} stages; pass {num_stages - 1} "
                "(one per boundary between stage i and i+1) or a single float"
            )
    if any(not t >= 0.0 for t in links):
        raise ValueError(f"p2p times must be >= 0 seconds, got {links}")
    return links


# --------------------------------------------------------------------------------------------
# Per-rank action orders (torch.distributed.pipelining, torch 2.13)
# --------------------------------------------------------------------------------------------


def _gpipe_order(rank: int, num_microbatches: int) -> list[Action]:
    """``ScheduleGPipe``: every forward, then every backward, both in micro-batch order."""
    forwards = [Action(kind="F", stage=rank, microbatch=k) for k in range(num_microbatches)]
    backwards = [Action(kind="B", stage=rank, microbatch=k) for k in range(num_microbatches)]
    return forwards + backwards


def _one_f_one_b_order(rank: int, num_ranks: int, num_microbatches: int) -> list[Action]:
    """``Schedule1F1B``: ``min(m, p - rank)`` forwards, then B,F pairs, then the remaining B."""
    num_warmup = min(num_microbatches, num_ranks - rank)
    order = [Action(kind="F", stage=rank, microbatch=k) for k in range(num_warmup)]
    next_fwd = num_warmup
    for k in range(num_microbatches):
        order.append(Action(kind="B", stage=rank, microbatch=k))
        if next_fwd < num_microbatches:
            order.append(Action(kind="F", stage=rank, microbatch=next_fwd))
            next_fwd += 1
    return order


def _interleaved_order(
    rank: int, num_ranks: int, num_microbatches: int, virtual_stages: int, *, zero_bubble: bool
) -> list[Action]:
    """``ScheduleInterleaved1F1B`` (``zero_bubble=False``) or ``ScheduleInterleavedZeroBubble``.

    A port of ``_get_warmup_ops`` and ``_get_1f1b_rank_ops`` without the ``None`` padding (idle
    slots, which an event-driven simulation finds by itself). Op ``t`` runs chunk
    ``(t // r) % v`` forward and chunk ``v - 1 - ((t - warmup) // r) % v`` backward, with
    ``r = m // max(1, m // p)`` micro-batches per round. Warm-up forwards::

        interleaved:  min((v - 1) r + 2 (p - 1 - rank), m v)       (Megatron-LM)
        zero-bubble:  min((v - 1) r + (p - 1 - rank), m v)

    then one F and one B per op; zero-bubble appends the W of the oldest pending B to each op
    from op ``warmup + rank`` on, and the remaining W at the end (ZB-H1 for v = 1). torch
    refuses ``m % max(1, m // p) != 0`` (e.g. p = 4, m = 9) for both; only interleaved's
    ``m % p == 0`` is enforced here, zero-bubble is priced for any m.
    """
    p, m, v = num_ranks, num_microbatches, virtual_stages
    per_round = m // max(1, m // p)
    factor = 1 if zero_bubble else 2
    num_warmup = min((v - 1) * per_round + factor * (p - 1 - rank), m * v)
    num_ops = m * v + num_warmup  # warm-up F, then (m v - warmup) F+B ops, then warm-up-many B

    def fwd_stage(t: int) -> int:
        return ((t // per_round) % v) * p + rank

    def bwd_stage(t: int) -> int:
        return (v - 1 - ((t - num_warmup) // per_round) % v) * p + rank

    next_mb: dict[tuple[str, int], int] = {}

    def take(kind: ActionKind, stage: int) -> Action:
        k = next_mb.get((kind, stage), 0)
        next_mb[(kind, stage)] = k + 1
        return Action(kind=kind, stage=stage, microbatch=k)

    order: list[Action] = []
    backward_ops: list[int] = []
    num_weight = 0
    for t in range(num_ops):
        if t < m * v:
            order.append(take("F", fwd_stage(t)))
        if t >= num_warmup:
            order.append(take("B", bwd_stage(t)))
            backward_ops.append(t)
            if zero_bubble and t - num_warmup >= rank:
                order.append(take("W", bwd_stage(backward_ops[num_weight])))
                num_weight += 1
    while zero_bubble and num_weight < len(backward_ops):
        order.append(take("W", bwd_stage(backward_ops[num_weight])))
        num_weight += 1
    return order


def schedule_actions(
    schedule: ScheduleName, *, num_ranks: int, num_microbatches: int, virtual_stages: int = 1
) -> tuple[tuple[Action, ...], ...]:
    """Each rank's ordered actions, as torch.distributed.pipelining's schedule runs them."""
    check_schedule(schedule, pp=num_ranks, num_microbatches=num_microbatches, virtual_stages=virtual_stages)
    return tuple(
        tuple(_rank_order(schedule, rank, num_ranks, num_microbatches, virtual_stages)) for rank in range(num_ranks)
    )


def _rank_order(
    schedule: ScheduleName, rank: int, num_ranks: int, num_microbatches: int, virtual_stages: int
) -> list[Action]:
    """Rank ``rank``'s ordered actions (one entry of :func:`schedule_actions`, checked there)."""
    if schedule == "gpipe":
        return _gpipe_order(rank, num_microbatches)
    if schedule == "1f1b":
        return _one_f_one_b_order(rank, num_ranks, num_microbatches)
    zero_bubble = schedule == "zero-bubble"
    return _interleaved_order(rank, num_ranks, num_microbatches, virtual_stages, zero_bubble=zero_bubble)


# --------------------------------------------------------------------------------------------
# Event-driven simulation
# --------------------------------------------------------------------------------------------

_KIND_INDEX = {"F": 0, "B": 1, "W": 2}


@dataclass(frozen=True, slots=True)
class _Program:
    """A schedule's actions in one dependency-respecting order, with their predecessors.

    Depends only on (schedule, p, m, v), so it is built once and cached; :func:`_end_times`
    then prices it for any stage times in one pass.
    """

    orders: tuple[tuple[Action, ...], ...]
    kind: tuple[int, ...]
    stage: tuple[int, ...]
    after: tuple[int, ...]
    """Index of the previous action on the same rank, -1 for a rank's first."""
    dep: tuple[int, ...]
    """Index of the cross-stage input (F(s-1,k) for F, B(s+1,k) for B), -1 if none."""
    link: tuple[int, ...]
    """Boundary crossed by ``dep`` (``stage - 1`` for F, ``stage`` for B), -1 if none."""
    position: tuple[tuple[int, ...], ...]
    """Per rank, the program index of each of its actions."""


@functools.lru_cache(maxsize=128)  # about 0.7 MB per 4096 actions
def _program(schedule: ScheduleName, num_ranks: int, num_microbatches: int, virtual_stages: int) -> _Program:
    orders = schedule_actions(
        schedule, num_ranks=num_ranks, num_microbatches=num_microbatches, virtual_stages=virtual_stages
    )
    num_stages = num_ranks * virtual_stages
    index: dict[tuple[str, int, int], int] = {}
    kinds: list[int] = []
    stages: list[int] = []
    after: list[int] = []
    dep: list[int] = []
    link: list[int] = []
    position: list[list[int]] = [[] for _ in orders]
    next_index = [0] * len(orders)
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for rank, order in enumerate(orders):
            while next_index[rank] < len(order):
                a = order[next_index[rank]]
                s, k = a.stage, a.microbatch
                if a.kind == "F" and s > 0:
                    needed, crossed = ("F", s - 1, k), s - 1
                elif a.kind == "B" and s < num_stages - 1:
                    needed, crossed = ("B", s + 1, k), s
                else:  # stage 0 F, last-stage B, W: only the rank's own earlier actions
                    needed, crossed = None, -1
                if needed is not None and needed not in index:
                    break
                i = len(kinds)
                index[(a.kind, s, k)] = i
                kinds.append(_KIND_INDEX[a.kind])
                stages.append(s)
                after.append(position[rank][-1] if position[rank] else -1)
                dep.append(index[needed] if needed is not None else -1)
                link.append(crossed)
                position[rank].append(i)
                next_index[rank] += 1
                remaining -= 1
                progressed = True
        assert progressed, f"{schedule} deadlocks at {[str(o[i]) for o, i in zip(orders, next_index) if i < len(o)]}"
    return _Program(
        orders=orders,
        kind=tuple(kinds),
        stage=tuple(stages),
        after=tuple(after),
        dep=tuple(dep),
        link=tuple(link),
        position=tuple(tuple(p) for p in position),
    )


def _end_times(
    program: _Program, stages: Sequence[StageTimes], links_s: Sequence[float], *, split_backward: bool
) -> tuple[list[float], list[float]]:
    """Start and end of every action: each starts once its rank is free and its input arrived.

    A rank runs its actions in order; a transfer occupies neither rank (asynchronous send/recv)::

        F(s,k) ready at  end F(s-1,k) + p2p[s-1]          (stage 0: at 0)
        B(s,k) ready at  end B(s+1,k) + p2p[s]            (last stage: at once)
        W(s,k) ready at  end B(s,k)

    and F(s,k) before B(s,k) before W(s,k) holds through the rank's order, which runs all three.
    """
    durations = [
        [t.fwd_s for t in stages],
        [t.bwd_input_s if split_backward else t.bwd_s for t in stages],
        [t.bwd_weight_s for t in stages],
    ]
    n = len(program.kind)
    start_s = [0.0] * n
    end_s = [0.0] * n
    kind, stage, after, dep, link = program.kind, program.stage, program.after, program.dep, program.link
    for i in range(n):
        prev = after[i]
        t = end_s[prev] if prev >= 0 else 0.0
        d = dep[i]
        if d >= 0:
            arrival = end_s[d] + links_s[link[i]]
            if arrival > t:
                t = arrival
        start_s[i] = t
        end_s[i] = t + durations[kind[i]][stage[i]]
    return start_s, end_s


def _alive_after_each_forward(order: Sequence[Action], *, free_kind: ActionKind) -> Iterator[dict[int, int]]:
    """A rank's alive activations per stage right after each of its F actions, from the order
    alone: a stage's F, B and W all run on one rank, one at a time, so the count only changes at
    that rank's actions, +1 when F starts, -1 when ``free_kind`` ends (the same dict, updated)."""
    alive: dict[int, int] = {}
    for a in order:
        if a.kind == "F":
            alive[a.stage] = alive.get(a.stage, 0) + 1
            yield alive
        elif a.kind == free_kind:
            alive[a.stage] -= 1


def _peak_inflight(
    orders: tuple[tuple[Action, ...], ...], num_stages: int, *, free_kind: ActionKind
) -> tuple[list[int], list[int]]:
    """Peak alive activations per stage and per rank, from the order alone
    (:func:`_alive_after_each_forward`): the largest count right after an F starts, whatever the
    timing.
    """
    per_stage = [0] * num_stages
    per_rank = [0] * len(orders)
    for rank, order in enumerate(orders):
        for alive in _alive_after_each_forward(order, free_kind=free_kind):
            for stage, n in alive.items():
                per_stage[stage] = max(per_stage[stage], n)
            per_rank[rank] = max(per_rank[rank], sum(alive.values()))
    return per_stage, per_rank


def simulate(
    stages: Sequence[StageTimes],
    schedule: ScheduleName,
    num_microbatches: int,
    *,
    num_ranks: int,
    p2p_s: float | Sequence[float],
    virtual_stages: int = 1,
) -> PipelineTimeline:
    """Simulate one step of ``schedule`` over ``stages`` (stage i on rank ``i % num_ranks``).

    ``p2p_s`` is the time to send one micro-batch's activation from stage i to i+1 (the gradient
    back takes the same), one per boundary or one float for all; a boundary between two chunks of
    one rank (p = 1) is charged too, so pass 0 there. Raises ``ValueError`` for inputs the
    schedule cannot run.
    """
    links_s = _check_inputs(stages, schedule, num_microbatches, num_ranks, virtual_stages, p2p_s)
    program = _program(schedule, num_ranks, num_microbatches, virtual_stages)
    split = schedule == "zero-bubble"
    start_s, end_s = _end_times(program, stages, links_s, split_backward=split)
    step_s = max(end_s)
    timed = tuple(
        tuple(
            TimedAction(action=a, rank=rank, start_s=start_s[i], end_s=end_s[i])
            for a, i in zip(order, program.position[rank])
        )
        for rank, order in enumerate(program.orders)
    )
    busy_s = tuple(sum(t.end_s - t.start_s for t in ranks) for ranks in timed)
    if any(links_s):
        _, free_end_s = _end_times(program, stages, [0.0] * len(links_s), split_backward=split)
        p2p_exposed_s = max(0.0, step_s - max(free_end_s))
    else:
        p2p_exposed_s = 0.0
    per_stage, per_rank = _peak_inflight(program.orders, len(stages), free_kind="W" if split else "B")
    return PipelineTimeline(
        schedule=schedule,
        num_microbatches=num_microbatches,
        virtual_stages=virtual_stages,
        step_s=step_s,
        busy_s=busy_s,
        bubble_s=step_s - max(busy_s),
        p2p_exposed_s=p2p_exposed_s,
        peak_inflight=tuple(per_stage),
        peak_inflight_per_rank=tuple(per_rank),
        actions=timed,
    )


# --------------------------------------------------------------------------------------------
# Closed forms
# --------------------------------------------------------------------------------------------


def uniform_step_time(
    stage: StageTimes,
    schedule: ScheduleName,
    num_ranks: int,
    num_microbatches: int,
    *,
    virtual_stages: int = 1,
    p2p_s: float = 0.0,
) -> float:
    """Makespan of ``schedule`` when every stage costs ``stage`` and every link ``p2p_s``.

    The module docstring's table; exact (equal to :func:`simulate`) where it says so.
    """
    check_schedule(schedule, pp=num_ranks, num_microbatches=num_microbatches, virtual_stages=virtual_stages)
    p, m, v, c = num_ranks, num_microbatches, virtual_stages, p2p_s
    f, b_in, w = stage.fwd_s, stage.bwd_input_s, stage.bwd_weight_s
    b = b_in + w
    if schedule == "gpipe":
        return (m + p - 1) * (f + b) + 2 * (p - 1) * c
    if schedule == "1f1b":
        return (m + p - 1) * (f + b) + 2 * c * ((p - 1) + (m - 1) * (p - 1) // p)
    if schedule == "interleaved-1f1b":
        return (m * v + p - 1) * (f + b) + 2 * (p * v - 1) * c
    hidden_w = (min(m, p) - 1) * min(f, b_in, w)
    return (m + p - 1) * (f + b_in) + m * w - hidden_w + 2 * c * ((p - 1) + min(max(m - 2, 0), p - 1))


def bubble_fraction(
    schedule: ScheduleName,
    num_ranks: int,
    num_microbatches: int,
    virtual_stages: int = 1,
    *,
    stage: StageTimes | None = None,
) -> float:
    """Idle fraction of the step on the busiest rank, uniform stages and free transfers.

    ``(T - m v (f + b + w)) / T`` with ``T`` from :func:`uniform_step_time`::

        gpipe, 1f1b        (p - 1) / (m + p - 1)
        interleaved-1f1b   (p - 1) / (m v + p - 1)
        zero-bubble        (p - 1) / (3 m + p - 1)      f = b = w, m >= p

    Only zero-bubble depends on the ratio of f, b and w: ``stage`` gives it (default f = b = w).
    """
    if stage is None:
        stage = StageTimes(fwd_s=1.0, bwd_input_s=1.0, bwd_weight_s=1.0)
    step_s = uniform_step_time(stage, schedule, num_ranks, num_microbatches, virtual_stages=virtual_stages)
    busy_s = num_microbatches * virtual_stages * (stage.fwd_s + stage.bwd_s)
    return (step_s - busy_s) / step_s if step_s > 0 else 0.0


def inflight_microbatches(
    schedule: ScheduleName, stage_rank: int, num_ranks: int, num_microbatches: int, virtual_stages: int = 1
) -> int:
    """Peak number of micro-batches whose activations rank ``stage_rank`` holds at once.

    Counted in chunk-micro-batches (one per chunk and micro-batch) for interleaved::

        gpipe              m
        1f1b               min(m, p - rank)
        interleaved-1f1b   min(2 (p - rank - 1) + (v - 1) p + 1, m v)
        zero-bubble        min(m, p)       (freed at W; rank r defers r W's)

    Equals :func:`simulate`'s ``peak_inflight_per_rank``.
    """
    check_schedule(schedule, pp=num_ranks, num_microbatches=num_microbatches, virtual_stages=virtual_stages)
    if not 0 <= stage_rank < num_ranks:
        raise ValueError(f"stage_rank is {stage_rank}; use a rank in 0..{num_ranks - 1}")
    p, m, v, r = num_ranks, num_microbatches, virtual_stages, stage_rank
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, p - r)
    if schedule == "interleaved-1f1b":
        return min(2 * (p - r - 1) + (v - 1) * p + 1, m * v)
    return min(m, p)


def inflight_at_rank_peak(
    schedule: ScheduleName,
    stage_rank: int,
    num_ranks: int,
    num_microbatches: int,
    virtual_stages: int,
    kept_bytes: Sequence[float],
) -> tuple[int, ...]:
    """Micro-batches each of rank ``stage_rank``'s stages holds (stage ``stage_rank + j * p``,
    ``j < v``) at the moment the rank's activations peak: with ``kept_bytes[j]`` the bytes one
    micro-batch leaves in stage ``j`` of the rank, the peak is the largest

        sum_j alive_j(t) * kept_bytes[j]      right after an F starts (alive: F started, not yet
                                              freed by its B; by its W under zero-bubble)

    over the rank's actions in the order torch runs them (:func:`schedule_actions`). One stage
    per rank: ``(inflight_microbatches(...),)``. With several, the stages' own peaks do not
    coincide: rank 1 of ``p = 2, v = 2, m = 2`` interleaved holds two micro-batches of its first
    chunk and one of its last at its peak (three chunk-micro-batches), not two of each."""
    p, v = num_ranks, virtual_stages
    if v == 1:
        return (inflight_microbatches(schedule, stage_rank, p, num_microbatches, v),)
    if len(kept_bytes) != v:
        raise ValueError(f"kept_bytes has {len(kept_bytes)} entries; rank {stage_rank} has {v} stages")
    states = _alive_after_forwards(schedule, stage_rank, p, num_microbatches, v)
    return max(states, key=lambda alive: sum(n * b for n, b in zip(alive, kept_bytes, strict=True)))


@functools.lru_cache(maxsize=1024)
def backward_states(
    schedule: ScheduleName, stage_rank: int, num_ranks: int, num_microbatches: int, virtual_stages: int
) -> tuple[tuple[int, tuple[int, ...], bool, tuple[bool, ...], tuple[int, ...]], ...]:
    """Rank ``stage_rank``'s backwards in the order torch runs them (:func:`schedule_actions`),
    each as ``(j, alive, first, ran)``: the rank's stage ``j`` running it (stage
    ``stage_rank + j * p``), the micro-batches each of the rank's stages holds then (started by
    an F, not yet freed by their B, by their W under zero-bubble; the running one's included),
    whether it is stage ``j``'s first, which of the rank's stages ran one before, and how many
    B each stage has started, the running one's included (the sends the schedule keeps:
    :data:`autoplan.cost_models.memory.BackwardState`; under zero-bubble the W that frees the
    activations stands for the backward). Distinct states only, in first-seen order; cached."""
    p, v = num_ranks, virtual_stages
    check_schedule(schedule, pp=p, num_microbatches=num_microbatches, virtual_stages=v)
    free_kind: ActionKind = "W" if schedule == "zero-bubble" else "B"
    alive, ran, backs = [0] * v, [False] * v, [0] * v
    seen: dict[tuple[int, tuple[int, ...], bool, tuple[bool, ...], tuple[int, ...]], None] = {}
    for a in _rank_order(schedule, stage_rank, p, num_microbatches, v):
        j = (a.stage - stage_rank) // p
        if a.kind == "F":
            alive[j] += 1
        if a.kind == "B":
            backs[j] += 1
        if a.kind == free_kind:
            seen.setdefault((j, tuple(alive), not ran[j], tuple(ran), tuple(backs)), None)
            alive[j] -= 1
            ran[j] = True
    return tuple(seen)


@functools.lru_cache(maxsize=1024)
def _alive_after_forwards(
    schedule: ScheduleName, stage_rank: int, num_ranks: int, num_microbatches: int, virtual_stages: int
) -> tuple[tuple[int, ...], ...]:
    """The per-stage alive counts of rank ``stage_rank`` right after each of its F actions
    (:func:`inflight_at_rank_peak`) that no other such count covers stage by stage (with
    non-negative bytes a covered one is never the peak), in first-seen order; cached, since the
    search asks for the same schedule with every candidate's bytes."""
    p, v = num_ranks, virtual_stages
    check_schedule(schedule, pp=p, num_microbatches=num_microbatches, virtual_stages=v)
    order = _rank_order(schedule, stage_rank, p, num_microbatches, v)  # schedule_actions(...)[stage_rank]
    free_kind: ActionKind = "W" if schedule == "zero-bubble" else "B"
    seen: dict[tuple[int, ...], None] = {}
    for alive in _alive_after_each_forward(order, free_kind=free_kind):
        seen.setdefault(tuple(alive.get(stage_rank + j * p, 0) for j in range(v)), None)
    # x is covered when another state is >= x everywhere; such a state has a larger sum, and some
    # uncovered state covers it in turn: test each against the uncovered ones found so far,
    # visited by decreasing sum
    uncovered: list[tuple[int, ...]] = []
    for x in sorted(seen, key=sum, reverse=True):
        if not any(all(a >= b for a, b in zip(y, x, strict=True)) for y in uncovered):
            uncovered.append(x)
    kept = set(uncovered)
    return tuple(x for x in seen if x in kept)


def _closed_form_step_time(
    stages: Sequence[StageTimes], schedule: ScheduleName, num_microbatches: int, num_ranks: int, links_s: list[float]
) -> float:
    """The non-uniform closed forms of the module docstring (GPipe exact, the others estimates)."""
    m, p = num_microbatches, num_ranks
    v = len(stages) // p
    fwd = [t.fwd_s for t in stages]
    if schedule == "gpipe":
        bwd = [t.bwd_s for t in stages]
        return sum(fwd) + sum(bwd) + (m - 1) * (max(fwd) + max(bwd)) + 2 * sum(links_s)
    if schedule == "1f1b":
        fb = [t.fwd_s + t.bwd_s for t in stages]
        # loop of stages r..j: prefix sums make it (work[j+1] - work[r]) over j - r + 1 micro-batches
        work = [0.0]
        for s, fb_s in enumerate(fb):
            work.append(work[-1] + fb_s + (2 * links_s[s - 1] if s > 0 else 0.0))
        period_s = max(
            (work[j + 1] - work[r] - (2 * links_s[r - 1] if r > 0 else 0.0)) / (j - r + 1)
            for r in range(p)
            for j in range(r, p)
        )
        return sum(fb) + 2 * sum(links_s) + (m - 1) * period_s
    if schedule == "interleaved-1f1b":
        fb = [t.fwd_s + t.bwd_s for t in stages]
        rank_work_s = max(sum(fb[r::p]) for r in range(p))
        return m * rank_work_s + (sum(fb) - rank_work_s) / v + 2 * sum(links_s)
    fb_in = [t.fwd_s + t.bwd_input_s for t in stages]
    fbw = [t.fwd_s + t.bwd_s for t in stages]
    slowest = max(range(p), key=fbw.__getitem__)
    hidden_w = (min(m, p) - 1) * min(min(t.fwd_s, t.bwd_input_s, t.bwd_weight_s) for t in stages)
    link_rounds = 1 + (min(max(m - 2, 0), p - 1) / (p - 1) if p > 1 else 0.0)
    return m * fbw[slowest] + sum(fb_in) - fb_in[slowest] - hidden_w + 2 * sum(links_s) * link_rounds


def fast_step_time(
    stages: Sequence[StageTimes],
    schedule: ScheduleName,
    num_microbatches: int,
    *,
    num_ranks: int,
    p2p_s: float | Sequence[float],
    virtual_stages: int = 1,
    max_simulated_actions: int = MAX_SIMULATED_ACTIONS,
) -> float:
    """Step time for the planner's inner loop: exact where cheap, a closed form otherwise.

    GPipe: its exact closed form. Other schedules: :func:`simulate`'s makespan when the schedule
    has at most ``max_simulated_actions`` F/B/W actions (about 0.5 ms per 4096 actions once the
    order for (schedule, p, m, v) is cached), else the module docstring's estimate.
    """
    links_s = _check_inputs(stages, schedule, num_microbatches, num_ranks, virtual_stages, p2p_s)
    if schedule == "gpipe" or (num_ranks == 1 and len(stages) == 1):
        # one stage: every schedule runs m forwards and backwards back to back, GPipe's form exactly
        return _closed_form_step_time(stages, "gpipe", num_microbatches, num_ranks, links_s)
    num_actions = len(stages) * num_microbatches * (3 if schedule == "zero-bubble" else 2)
    if num_actions > max_simulated_actions:
        return _closed_form_step_time(stages, schedule, num_microbatches, num_ranks, links_s)
    program = _program(schedule, num_ranks, num_microbatches, virtual_stages)
    _, end_s = _end_times(program, stages, links_s, split_backward=schedule == "zero-bubble")
    return max(end_s)
