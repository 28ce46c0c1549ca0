"""Pipeline-parallel step time and in-flight micro-batches.

DOCSTRING-PLACEHOLDER
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

ScheduleName = Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"]
SCHEDULES: tuple[str, ...] = get_args(ScheduleName)
"""Schedule names the model knows, in the order of torch.distributed.pipelining's classes."""

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


def _check_schedule(schedule: str, num_ranks: int, num_microbatches: int, virtual_stages: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    if num_ranks < 1:
        raise ValueError(f"num_ranks is {num_ranks}; a pipeline needs at least 1 rank")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches is {num_microbatches}; use at least 1 micro-batch")
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages is {virtual_stages}; use at least 1 chunk per rank")
    if schedule == "interleaved-1f1b":
        if num_microbatches % num_ranks != 0:
            raise ValueError(
                f"interleaved-1f1b needs num_microbatches divisible by the {num_ranks} pipeline ranks, "
                f"got {num_microbatches}; use a multiple of {num_ranks}"
            )
    elif virtual_stages != 1:
        raise ValueError(
            f"schedule {schedule!r} runs one stage per rank, got virtual_stages={virtual_stages}; "
            "use virtual_stages=1 or schedule 'interleaved-1f1b'"
        )


def _check_inputs(
    stages: Sequence[StageTimes],
    schedule: str,
    num_microbatches: int,
    num_ranks: int,
    virtual_stages: int,
    p2p_s: float | Sequence[float],
) -> list[float]:
    """Validate the arguments of :func:`simulate` and return the per-link transfer times."""
    _check_schedule(schedule, num_ranks, num_microbatches, virtual_stages)
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
    from op ``warmup + rank`` on, and the remaining W at the end (ZB-H1 for v = 1).
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
    b_kind: ActionKind = "B"
    for t in range(num_ops):
        if t < m * v:
            order.append(take("F", fwd_stage(t)))
        if t >= num_warmup:
            order.append(take(b_kind, bwd_stage(t)))
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
    _check_schedule(schedule, num_ranks, num_microbatches, virtual_stages)
    orders: list[list[Action]] = []
    for rank in range(num_ranks):
        if schedule == "gpipe":
            orders.append(_gpipe_order(rank, num_microbatches))
        elif schedule == "1f1b":
            orders.append(_one_f_one_b_order(rank, num_ranks, num_microbatches))
        else:
            zero_bubble = schedule == "zero-bubble"
            orders.append(_interleaved_order(rank, num_ranks, num_microbatches, virtual_stages, zero_bubble=zero_bubble))
    return tuple(tuple(order) for order in orders)


# --------------------------------------------------------------------------------------------
# Event-driven simulation
# --------------------------------------------------------------------------------------------


def _run(
    orders: tuple[tuple[Action, ...], ...],
    stages: Sequence[StageTimes],
    links_s: Sequence[float],
    num_microbatches: int,
    *,
    split_backward: bool,
) -> list[list[TimedAction]]:
    """Start every action as soon as its rank is free and its inputs have arrived.

    A rank runs its actions in order; a transfer occupies neither rank (asynchronous send/recv)::

        F(s,k) ready at  end F(s-1,k) + p2p[s-1]                          (s > 0; stage 0: 0)
        B(s,k) ready at  max(end F(s,k), end B(s+1,k) + p2p[s])           (last stage: end F(s,k))
        W(s,k) ready at  end B(s,k)
    """
    num_stages, m = len(stages), num_microbatches
    kind_index = {"F": 0, "B": 1, "W": 2}
    end_s: list[float | None] = [None] * (3 * num_stages * m)

    def done(kind: str, stage: int, k: int) -> float | None:
        return end_s[(kind_index[kind] * num_stages + stage) * m + k]

    def ready_at(a: Action) -> float | None:
        s, k = a.stage, a.microbatch
        if a.kind == "F":
            if s == 0:
                return 0.0
            prev = done("F", s - 1, k)
            return None if prev is None else prev + links_s[s - 1]
        if a.kind == "B":
            fwd = done("F", s, k)
            if s == num_stages - 1 or fwd is None:
                return fwd
            grad = done("B", s + 1, k)
            return None if grad is None else max(fwd, grad + links_s[s])
        return done("B", s, k)

    def duration(a: Action) -> float:
        t = stages[a.stage]
        if a.kind == "F":
            return t.fwd_s
        if a.kind == "W":
            return t.bwd_weight_s
        return t.bwd_input_s if split_backward else t.bwd_s

    timed: list[list[TimedAction]] = [[] for _ in orders]
    free_s = [0.0] * len(orders)
    next_index = [0] * len(orders)
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for rank, order in enumerate(orders):
            while next_index[rank] < len(order):
                a = order[next_index[rank]]
                ready = ready_at(a)
                if ready is None:
                    break
                start = max(free_s[rank], ready)
                end = start + duration(a)
                end_s[(kind_index[a.kind] * num_stages + a.stage) * m + a.microbatch] = end
                timed[rank].append(TimedAction(action=a, rank=rank, start_s=start, end_s=end))
                free_s[rank] = end
                next_index[rank] += 1
                remaining -= 1
                progressed = True
        assert progressed, f"pipeline order deadlocks at {[str(o[i]) for o, i in zip(orders, next_index) if i < len(o)]}"
    return timed


def _peak_inflight(
    orders: tuple[tuple[Action, ...], ...], num_stages: int, *, free_kind: ActionKind
) -> tuple[list[int], list[int]]:
    """Peak alive activations per stage and per rank, from the order alone.

    A stage's F, B and W all run on one rank, one at a time, so the count only changes at that
    rank's actions: +1 when F starts, -1 when ``free_kind`` ends. The peak is the largest count
    right after an F starts, whatever the timing.
    """
    per_stage = [0] * num_stages
    per_rank = [0] * len(orders)
    for rank, order in enumerate(orders):
        alive: dict[int, int] = {}
        for a in order:
            if a.kind == "F":
                alive[a.stage] = alive.get(a.stage, 0) + 1
                per_stage[a.stage] = max(per_stage[a.stage], alive[a.stage])
                per_rank[rank] = max(per_rank[rank], sum(alive.values()))
            elif a.kind == free_kind:
                alive[a.stage] -= 1
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
    back takes the same), one per boundary or one float for all. Raises ``ValueError`` for
    inputs the schedule cannot run.
    """
    links_s = _check_inputs(stages, schedule, num_microbatches, num_ranks, virtual_stages, p2p_s)
    orders = schedule_actions(
        schedule, num_ranks=num_ranks, num_microbatches=num_microbatches, virtual_stages=virtual_stages
    )
    split = schedule == "zero-bubble"
    timed = _run(orders, stages, links_s, num_microbatches, split_backward=split)
    step_s = max((ranks[-1].end_s for ranks in timed if ranks), default=0.0)
    busy_s = tuple(sum(t.end_s - t.start_s for t in ranks) for ranks in timed)
    if any(links_s):
        free = _run(orders, stages, [0.0] * len(links_s), num_microbatches, split_backward=split)
        p2p_exposed_s = max(0.0, step_s - max(ranks[-1].end_s for ranks in free))
    else:
        p2p_exposed_s = 0.0
    per_stage, per_rank = _peak_inflight(orders, len(stages), free_kind="W" if split else "B")
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
        actions=tuple(tuple(ranks) for ranks in timed),
    )
