"""What the generated program overlaps, as data: the one description that the runtime's code
generator follows and the cost models price (issue #19, "priced = executed").

The program's communication schedule follows torch's own data-parallel engines:

* **Gradient buckets (DDP).** Data-parallel gradient all-reduces are grouped, in the order the
  backward produces the gradients, into buckets of at most :attr:`OverlapPolicy.bucket_cap_bytes`
  (the first one :attr:`OverlapPolicy.first_bucket_cap_bytes`), exactly DDP's ``bucket_cap_mb``
  and first-bucket rule. A bucket's all-reduce is issued as soon as its last gradient exists and
  waited on only before the optimizer step, so all buckets but the last hide behind the rest of
  the backward. Latency is paid once per bucket.
* **Parameter gathers (FSDP2 / ZeRO-3).** A parameter sharded on a data-parallel axis is
  all-gathered :attr:`OverlapPolicy.prefetch_blocks` block ahead of its use (the next block's
  gather is issued when the current block starts, forward and backward alike), and the gathered
  copy is freed after its last use in the pass (``reshard_after_forward``). Latency is paid once
  per block and pass.
* **Gradient reduce-scatters (FSDP2 / ZeRO).** Issued when the gradient exists, waited on before
  the optimizer step; they share the link with the backward's own all-gathers.
* **Tensor-parallel collectives.** Issued right after their producer, waited on right before
  their first consumer (as early and as late as the graph allows).

:func:`gradient_buckets` is the single bucketing rule (codegen builds its buckets with it, the
step model counts buckets with it). :class:`CommTotals` is the per-kind, per-axis account of a
whole step's communication that estimates, ``show``, ``report`` and the JSON print.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from autoplan.cost_models.config import (
    gradients_reduced_in_backward as gradients_reduced_in_backward,  # the rule, re-exported
)

MiB = 2**20


@dataclass(frozen=True, kw_only=True, slots=True)
class OverlapPolicy:
    """How the generated program overlaps communication with compute (see the module docstring)."""

    bucket_cap_bytes: int = 25 * MiB
    """Gradient bucket size: DDP's default ``bucket_cap_mb=25``."""
    first_bucket_cap_bytes: int = 1 * MiB
    """The first bucket (the last layers' gradients): DDP's ``_DEFAULT_FIRST_BUCKET_BYTES``."""
    prefetch_blocks: int = 1
    """Blocks ahead a sharded parameter's all-gather is issued (FSDP2 prefetches one)."""
    coalesce_gathers: bool = True
    """Gather a block's sharded parameters in one collective (FSDP2)."""
    reshard_after_forward: bool = True
    """Free gathered parameters after the forward and gather them again for the backward
    (FSDP2's default; pipelined FSDP keeps them: ``False``)."""
    reduce_scatters_in_flight: int = 2
    """Gradient reduce-scatters issued and not yet waited for, at most: each holds a full-size
    bucket until its wait (FSDP2 waits for one before issuing the one two after it)."""


DEFAULT_POLICY = OverlapPolicy()


def converting_backwards(*, num_microbatches: int, sharded_grad_accumulation: bool) -> int:
    """How many of a stage's backward passes per step convert its parameter gradients in buckets
    as they exist, where :func:`gradients_reduced_in_backward` holds::

        n_c = 1    the last micro-batch's, on the raw gradients summed over the micro-batches (default)
        n_c = m    every micro-batch's (``ParallelConfig.sharded_grad_accumulation``, FSDP2's default)

    With ``n_c = m`` each backward reduce-scatters its own gradients bucket by bucket (at most
    :attr:`OverlapPolicy.reduce_scatters_in_flight` unwaited) and the runtime adds the shards,
    ``1 / dp`` of the gradients, into sharded accumulators: no full-size sum is ever held, and
    the step carries ``m`` times the reductions. The buckets a backward leaves in flight are
    waited for before the stage's next backward starts (the last micro-batch's: after the
    schedule, before the optimizer), so at most one backward's buckets are in flight. A parameter
    tied across stages is still summed raw and converted after the schedule. The runtime
    (:func:`autoplan.runtime.pipeline.build_pipeline`), the step model
    (:func:`autoplan.cost_models.step.evaluate`: ``n_c`` times each backward's contention and
    exposed tail) and the memory model (:func:`autoplan.cost_models.memory.stage_memory_parts`:
    the sharded accumulators ``G`` instead of the raw sum ``R`` across micro-batches) read it."""
    return num_microbatches if sharded_grad_accumulation else 1


def gradient_buckets(sizes_bytes: Sequence[float], policy: OverlapPolicy = DEFAULT_POLICY) -> tuple[tuple[int, ...], ...]:
    """Group gradients, given in the order the backward produces them, into buckets.

    Greedy in production order: a bucket closes once it holds at least its cap (the first one
    ``first_bucket_cap_bytes``, later ones ``bucket_cap_bytes``); a gradient larger than the cap
    gets a bucket of its own. Returns the indices of ``sizes_bytes`` per bucket, in issue order.

    >>> gradient_buckets([0.5 * MiB, 0.6 * MiB, 10 * MiB, 20 * MiB, 30 * MiB])
    ((0, 1), (2, 3), (4,))
    """
    buckets: list[tuple[int, ...]] = []
    current: list[int] = []
    filled = 0.0
    for i, size in enumerate(sizes_bytes):
        current.append(i)
        filled += size
        cap = policy.first_bucket_cap_bytes if not buckets else policy.bucket_cap_bytes
        if filled >= cap:
            buckets.append(tuple(current))
            current, filled = [], 0.0
    if current:
        buckets.append(tuple(current))
    return tuple(buckets)


@dataclass(frozen=True, kw_only=True, slots=True)
class CommRow:
    """One kind of collective on one mesh axis over a whole training step, per device."""

    kind: str
    """``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all`` or ``send_recv``."""
    axis: str
    """Mesh axis name (``dp``, ``tp``, ``pp`` for configurations; the plan's axis names otherwise)."""
    count: int
    """Collectives issued per step (per bucket, block, micro-batch as the program issues them)."""
    bytes: float
    """Bytes per device per step (full-size convention of :mod:`autoplan.cost_models.comm`)."""
    total_s: float
    """Link time of all of them."""
    exposed_s: float
    """The part the compute stream waits for (``0 <= exposed_s <= total_s``)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.exposed_s <= self.total_s * (1 + 1e-9) + 1e-15:
            raise ValueError(f"{self.kind} on {self.axis}: exposed {self.exposed_s} s not in [0, total {self.total_s} s]")

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "axis": self.axis,
            "count": self.count,
            "bytes": self.bytes,
            "total_s": self.total_s,
            "exposed_s": self.exposed_s,
        }


@dataclass(frozen=True, slots=True)
class CommTotals:
    """A whole step's communication per kind and axis; ``total_s`` and ``exposed_s`` are the sums
    of the rows, so a table of the rows sums to the estimate."""

    rows: tuple[CommRow, ...] = ()

    @property
    def total_s(self) -> float:
        return sum(r.total_s for r in self.rows)

    @property
    def exposed_s(self) -> float:
        return sum(r.exposed_s for r in self.rows)

    @staticmethod
    def merge(rows: Iterable[CommRow]) -> CommTotals:
        """Rows of the same (kind, axis) added up, sorted by kind then axis."""
        acc: dict[tuple[str, str], list[float]] = {}
        for r in rows:
            a = acc.setdefault((r.kind, r.axis), [0, 0.0, 0.0, 0.0])
            a[0] += r.count
            a[1] += r.bytes
            a[2] += r.total_s
            a[3] += r.exposed_s
        return CommTotals(
            tuple(
                CommRow(kind=k, axis=ax, count=int(c), bytes=b, total_s=t, exposed_s=min(e, t))
                for (k, ax), (c, b, t, e) in sorted(acc.items())
            )
        )

    def to_list(self) -> list[dict[str, Any]]:
        return [r.to_dict() for r in self.rows]
