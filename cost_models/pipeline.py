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
