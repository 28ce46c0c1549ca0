"""The parts of a training step: one cut of the estimated step into parts that add up to it.

:class:`StepParts` is what every review output prints for the step (``autoplan show``,
``report``, ``explain``, ``Plan.summary()``, ``TrainingEstimate.summary()``) and what a plan file
saves as ``estimate.step_parts``. A configuration's parts are cut by
:func:`autoplan.cost_models.step.step_parts`, a per-operator plan's by :meth:`StepParts.of_program`.
Torch-free: loading and printing a plan imports it (``autoplan show`` starts fast).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class StepParts:
    """One training step cut into parts that add up to it, each at least 0: what every review
    output prints (``autoplan show``, ``report``, ``explain``, ``Plan.summary()``, the plan file's
    ``estimate.step_parts``).

    For a configuration (:func:`autoplan.cost_models.step.evaluate`) the step is ``makespan +
    drain + max_r after_r`` (:mod:`autoplan.cost_models.step`'s docstring), cut along that sum (by
    :func:`autoplan.cost_models.step.step_parts`): up to the makespan the busiest pipeline rank's
    compute stream (its compute, the collectives it blocks on and its waits for gathers), then
    its idle time in the schedule (the bubble, and the pipeline sends the schedule does not hide),
    then the last micro-batch's sends behind the reductions (``drain``), then what the rank that
    finishes last adds after the makespan: its gradient synchronisation, then its optimizer step
    (the part of them its slack hides before the makespan is in no part)::

        compute         = busiest rank's compute - its blocking collectives
        exposed_comm    = its blocking collectives + its gather waits + unhidden pipeline sends
                          + drain + the last rank's synchronisation after the makespan
        bubble          = the schedule's idle time of the busiest rank without transfers
        optimizer       = the last rank's optimizer step after the makespan

    For a per-operator plan (:meth:`of_program`) the step is the compute stream's end: compute
    (the optimizer step, the parameters' nodes, included) and the waits for collectives.

    The communication rows (``CommTotals``) add up every collective's exposed time on the pipeline
    rank with the most; where that differs from ``exposed_comm_s`` :meth:`comm_note` says by how
    much (it is never a part)."""

    compute_s: float
    exposed_comm_s: float
    """Communication the step's critical path waits for (collectives in the compute stream
    included: they block it)."""
    bubble_s: float = 0.0
    optimizer_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("compute_s", "exposed_comm_s", "bubble_s", "optimizer_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0.0):
                raise ValueError(f"step part {name} is {value!r}: every part of the step is a finite number >= 0")

    @staticmethod
    def of_program(*, step_time_s: float, exposed_comm_s: float) -> StepParts:
        """The parts of a per-operator plan's step (:mod:`autoplan.passes.overlap`: the compute
        stream's end, its compute and its waits for collectives)."""
        exposed = min(max(exposed_comm_s, 0.0), max(step_time_s, 0.0))
        return StepParts(compute_s=max(step_time_s, 0.0) - exposed, exposed_comm_s=exposed)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.bubble_s + self.optimizer_s

    def rows(self) -> tuple[tuple[str, float], ...]:
        """``(name, seconds)`` of the parts, in the order they are printed: compute and exposed
        communication always, the bubble and the optimizer step where not 0."""
        rows = [("compute", self.compute_s), ("exposed communication", self.exposed_comm_s)]
        if self.bubble_s > 0.0:
            rows.append(("pipeline bubble", self.bubble_s))
        if self.optimizer_s > 0.0:
            rows.append(("optimizer step", self.optimizer_s))
        return tuple(rows)

    def comm_note(self, rows_exposed_s: float) -> str:
        """How the communication rows' exposed sum (``rows_exposed_s``) relates to
        ``exposed_comm_s``, in one sentence ("" when they agree to the microsecond)."""
        diff = rows_exposed_s - self.exposed_comm_s
        if abs(diff) < 5e-7:
            return ""
        if diff > 0:
            return (
                f"{diff * 1e3:,.3f} ms of the communication rows' exposed time ({rows_exposed_s * 1e3:,.3f} ms) is off "
                "the step's critical path: it overlaps other stages' work or a longer wait"
            )
        return (
            f"the step's critical path waits {-diff * 1e3:,.3f} ms longer than the communication rows' exposed time "
            f"({rows_exposed_s * 1e3:,.3f} ms): the rows count the compute slowed beside the last backward's "
            "gradient reductions as compute, and are the pipeline rank with the most exposed"
        )

    def to_dict(self) -> dict[str, float]:
        return {
            "compute_s": self.compute_s,
            "exposed_comm_s": self.exposed_comm_s,
            "bubble_s": self.bubble_s,
            "optimizer_s": self.optimizer_s,
        }

    @staticmethod
    def from_dict(d: Any) -> StepParts:
        return StepParts(
            compute_s=float(d["compute_s"]),
            exposed_comm_s=float(d["exposed_comm_s"]),
            bubble_s=float(d.get("bubble_s", 0.0)),
            optimizer_s=float(d.get("optimizer_s", 0.0)),
        )


__all__ = ["StepParts"]
