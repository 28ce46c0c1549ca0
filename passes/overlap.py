"""Pass — step schedule: which collectives hide behind compute, and the exposed step time.

Contract
--------
Input: the traced graph, the compute time of every node under the chosen strategy, and every
redistribution of the generated program with its time. Output: a :class:`StepSchedule`, the
result of replaying the program on two streams — compute, and one communication stream — as
the generated program issues them:

* an operand conversion is needed by the very next op: the compute stream waits for it
  (exposed);
* a gradient conversion that is not bucketed is issued right after the gradient is produced
  (``autoplan.runtime.codegen``); DTensor's functional collectives return at once and are waited on only
  where the result is used — the optimizer step — so it runs during the rest of the backward;
* coalesced gradient buckets and the loss are reduced at the end (exposed).

So ``step = max(compute stream, communication stream)`` at each wait, and the exposed
communication is ``step - compute``. Collectives queue on the one communication stream (NCCL
runs one communicator per group in order). A device that cannot overlap (CPU ranks: gloo
reduces on the same cores that compute) runs every collective synchronously.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch.fx as fx


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduledCollective:
    """When one redistribution runs and how much of it the compute stream waits for."""

    index: int
    """Index into the redistributions given to :func:`schedule_step`."""
    overlappable: bool
    """True if the program issues it ahead of its first use (a gradient during the backward)."""
    exposed_s: float
    """Seconds the compute stream waits for it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepSchedule:
    step_time_s: float
    compute_s: float
    comm_s: float
    """Sum of all collective times."""
    exposed_comm_s: float
    """``step_time_s - compute_s``: communication not hidden behind compute."""
    collectives: tuple[ScheduledCollective, ...]


def schedule_step(
    gm: fx.GraphModule,
    node_time_s: Mapping[str, float],
    redistributions: Sequence[object],
    comm_time_s: Sequence[float],
    *,
    param_nodes: Sequence[str],
    device_overlaps: bool,
) -> StepSchedule:
    """Replay the step on a compute and a communication stream (see the module docstring).

    ``redistributions`` are :class:`autoplan.passes.redistribute.Redistribution` values (duck-typed: ``apply``
    depends on this module's package, not the reverse); ``comm_time_s[i]`` is the time of the
    ``i``-th. Parameter nodes' times (their optimizer step) run after the graph."""
    params = set(param_nodes)
    before: dict[str, list[int]] = {}  # consumer -> conversions of its operands
    after: dict[str, list[int]] = {}  # producer -> gradient conversions issued after it
    at_end: list[int] = []
    for i, r in enumerate(redistributions):
        consumer, arg_index, producer = r.consumer, r.arg_index, r.producer  # type: ignore[attr-defined]
        if consumer in params and arg_index == -1 and r.bucket is None and device_overlaps:  # type: ignore[attr-defined]
            after.setdefault(producer.node, []).append(i)
        elif consumer in params or arg_index == -1:
            at_end.append(i)
        else:
            before.setdefault(consumer, []).append(i)

    compute_t = 0.0
    comm_free = 0.0
    exposed: dict[int, float] = {}

    def run_sync(i: int) -> None:
        nonlocal compute_t, comm_free
        start = max(compute_t, comm_free)
        end = start + comm_time_s[i]
        exposed[i] = end - compute_t
        compute_t = comm_free = end

    issued: dict[int, float] = {}  # async collective -> its finish time
    for node in gm.graph.nodes:
        for i in before.get(node.name, ()):
            run_sync(i)
        if node.name not in params:
            compute_t += node_time_s.get(node.name, 0.0)
        for i in after.get(node.name, ()):
            start = max(compute_t, comm_free)
            comm_free = start + comm_time_s[i]
            issued[i] = comm_free
    # the optimizer reads every gradient: wait for the asynchronous ones
    wait_from = compute_t
    compute_t = max(compute_t, comm_free)
    waited_until = wait_from
    for i, finish in sorted(issued.items(), key=lambda item: item[1]):
        exposed[i] = max(0.0, finish - waited_until)
        waited_until = max(waited_until, finish)
    for i in at_end:
        run_sync(i)
    compute_t += sum(node_time_s.get(p, 0.0) for p in params)
    compute_s = sum(node_time_s.values())
    comm_s = sum(comm_time_s)
    return StepSchedule(
        step_time_s=compute_t,
        compute_s=compute_s,
        comm_s=comm_s,
        exposed_comm_s=max(0.0, compute_t - compute_s),  # (summation order leaves ~1e-20 s when none)
        collectives=tuple(
            ScheduledCollective(index=i, overlappable=i in issued, exposed_s=exposed.get(i, 0.0))
            for i in range(len(redistributions))
        ),
    )
