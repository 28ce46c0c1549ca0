"""Pass — step schedule: which collectives hide behind compute, and the exposed step time.

Contract
--------
Input: the traced graph, the compute time of every node under the chosen strategy, every
redistribution of the generated program with its time, and the program's
:class:`~autoplan.passes.comm_order.CommSchedule` (where codegen issues and waits for each one:
the same object :mod:`autoplan.runtime.codegen` follows). Output: a :class:`StepSchedule`, the
result of replaying the program on two streams, compute and one communication stream:

* at its issue point a collective is queued on the communication stream (collectives on one
  stream run in order: NCCL runs one communicator per group in order, gloo one queue per group),
  so it starts at ``max(issue time, end of the previous collective)``;
* at its wait point the compute stream waits until it has finished (exposed time);
* a coalesced collective (a gradient bucket, a block's parameter gathers) is one collective (its
  members' times, one latency); each member is waited for where its reader needs it;
* while a collective runs, compute runs slower by ``compute_slowdown`` (the device's
  ``concurrent_compute_factor``: NCCL kernels take SMs and memory bandwidth; gloo takes cores);
  that extra time is compute (``contention_s``), so the exposed time is only the waits;
* a device that cannot overlap (``device_overlaps=False``) runs each collective synchronously
  at its issue point.

So ``step = compute stream's end``, the exposed communication is ``step - compute`` and
``exposed_s`` of a collective is the time the compute stream waited for it (the sum over the
collectives is the step's exposed time).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch.fx as fx

from autoplan.passes.comm_order import START, CollectiveSlot, CommSchedule
from autoplan.passes.redistribute import OUTPUT


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduledCollective:
    """When one redistribution runs and how much of it the compute stream waits for."""

    index: int
    """Index into the redistributions given to :func:`schedule_step`."""
    overlappable: bool
    """True if the program issues it ahead of its first use (a gradient during the backward)."""
    exposed_s: float
    """Seconds the compute stream waits for it."""
    issue_s: float = 0.0
    """When it starts on the communication stream (seconds from the step's start; a bucket's
    members share their bucket's times)."""
    finish_s: float = 0.0
    """When it finishes."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepSchedule:
    step_time_s: float
    compute_s: float
    """Compute, including ``contention_s``."""
    comm_s: float
    """Sum of all collective times."""
    exposed_comm_s: float
    """``step_time_s - compute_s``: communication not hidden behind compute."""
    collectives: tuple[ScheduledCollective, ...]
    contention_s: float = 0.0
    """Compute time added by running beside collectives (the device's contention factor):
    counted as compute, so the exposed communication is exactly the compute stream's waits."""


def schedule_step(
    gm: fx.GraphModule,
    node_time_s: Mapping[str, float],
    redistributions: Sequence[object],
    comm_time_s: Sequence[float],
    *,
    schedule: CommSchedule,
    param_nodes: Sequence[str],
    device_overlaps: bool,
    compute_slowdown: float = 0.0,
) -> StepSchedule:
    """Replay the step on a compute and a communication stream (see the module docstring).

    ``comm_time_s[i]`` is the time of the ``i``-th redistribution (a bucket's members' times add
    up to the bucket's). Parameter nodes' times (their optimizer step) run after the graph."""
    params = set(param_nodes)
    issued_after = schedule.issued_after()
    members = {
        s.index: (schedule.buckets[s.bucket] if s.bucket is not None else (s.index,))
        for s in schedule.slots
        if _leader(schedule, s.index) == s.index
    }
    wait_before: dict[str, list[int]] = {}
    for slot in schedule.slots:  # every member waits where its own reader needs it
        wait_before.setdefault(slot.wait_before, []).append(slot.index)

    compute_t = 0.0
    comm_free = 0.0
    contention = 0.0  # compute time added by running beside a collective
    finish: dict[int, float] = {}  # issued collective (bucket leader) -> its finish time
    exposed: dict[int, float] = {}
    duration = {i: sum(comm_time_s[m] for m in ms) for i, ms in members.items()}

    def issue(i: int) -> None:
        nonlocal compute_t, comm_free
        start = max(compute_t, comm_free)
        comm_free = start + duration[i]
        finish[i] = comm_free
        if not device_overlaps:  # synchronous: the compute stream waits right away
            exposed[i] = comm_free - compute_t
            compute_t = comm_free

    def wait(i: int) -> None:
        nonlocal compute_t
        lead = _leader(schedule, i)  # a coalesced collective's members finish together
        exposed[lead] = exposed.get(lead, 0.0) + max(0.0, finish[lead] - compute_t)
        compute_t = max(compute_t, finish[lead])

    def run(seconds: float) -> None:
        """Compute for ``seconds``, slower while the communication stream is busy."""
        nonlocal compute_t, contention
        busy = max(0.0, min(comm_free - compute_t, seconds * (1 + compute_slowdown)))
        extra = compute_slowdown * busy / (1 + compute_slowdown)
        contention += extra
        compute_t += seconds + extra

    for slot in issued_after.get(START, ()):
        issue(slot.index)
    for node in gm.graph.nodes:
        for i in wait_before.get(node.name, ()):
            wait(i)
        if node.op == "output":
            for i in sorted(wait_before.get(OUTPUT, ()), key=lambda i: finish[_leader(schedule, i)]):
                wait(i)
            continue
        if node.name not in params:
            run(node_time_s.get(node.name, 0.0))
        for slot in issued_after.get(node.name, ()):
            issue(slot.index)
    step = compute_t + sum(node_time_s.get(p, 0.0) for p in params)
    compute_s = sum(node_time_s.values()) + contention
    comm_s = sum(comm_time_s)
    per_member: dict[int, float] = {}
    for leader, ms in members.items():
        if leader not in exposed:
            continue
        total = duration[leader]
        for m in ms:  # a bucket's wait, shared by its members in proportion to their time
            per_member[m] = exposed[leader] * (comm_time_s[m] / total if total > 0 else 1 / len(ms))
    return StepSchedule(
        step_time_s=step,
        compute_s=compute_s,
        comm_s=comm_s,
        exposed_comm_s=max(0.0, step - compute_s),  # (summation order leaves ~1e-20 s when none)
        contention_s=contention,
        collectives=tuple(
            ScheduledCollective(
                index=i,
                overlappable=device_overlaps and _slot_gap(schedule.slots[i]),
                exposed_s=per_member.get(i, 0.0),
                issue_s=finish.get(_leader(schedule, i), 0.0) - duration.get(_leader(schedule, i), 0.0),
                finish_s=finish.get(_leader(schedule, i), 0.0),
            )
            for i in range(len(redistributions))
        ),
    )


def _leader(schedule: CommSchedule, i: int) -> int:
    slot = schedule.slots[i]
    return schedule.buckets[slot.bucket][0] if slot.bucket is not None else i


def _slot_gap(slot: CollectiveSlot) -> bool:
    """Whether the program leaves room between issue and wait (anything to hide behind)."""
    return slot.wait_before == OUTPUT or slot.issue_after != slot.wait_before
