"""Pass — communication order: where the generated program issues each collective and where it
waits for it. The one schedule that :mod:`autoplan.runtime.codegen` emits and
:mod:`autoplan.passes.overlap` prices (issue #19, "priced = executed").

Contract
--------
Input: the traced joint graph, the program's :class:`~autoplan.passes.redistribute.Redistribution`
list (graph order), the segment of every node (:class:`~autoplan.passes.layers.Layering`), the
mesh shape and the :class:`~autoplan.cost_models.comm_schedule.OverlapPolicy`.
Output: a :class:`CommSchedule`: for every redistribution the node after which it is issued and
the node before which its result must have arrived, and the gradient buckets.

Rules (the policy's DDP / FSDP2 behaviour, :mod:`autoplan.cost_models.comm_schedule`):

* **Windows.** The graph's ops, in program order, form *runs* of consecutive ops of one segment
  (a block's forward, a block's backward, ...). An operand conversion of a consumer in run ``r``
  is issued as early as its value exists, but not before run ``r - prefetch_blocks`` starts:
  a sharded parameter (ZeRO-3) is gathered while the previous block computes (FSDP2's forward
  and backward prefetch), a tensor-parallel conversion right after its producer. It is waited
  for right before its consumer. The window bounds memory: a gathered copy lives at most
  ``prefetch_blocks + 1`` runs.
* **Gradients.** A gradient conversion is issued right after the gradient exists and waited for
  before the optimizer step (the program's output). Gradients whose conversion is a plain
  all-reduce (``Redistribution.bucket``: same transition) are grouped, in the order the backward
  produces them, by :func:`~autoplan.cost_models.comm_schedule.gradient_buckets`; a bucket is
  one coalesced all-reduce issued after its last gradient.
* **Parameter gathers** issued at the same point on the same mesh axis (a block's sharded
  parameters, ZeRO-3) are one coalesced all-gather, as FSDP2 gathers a block's parameters in one
  collective: one latency per block and pass.
* **The loss** is reduced after it is computed and waited for at the output.
* **Pipeline stages** (``stage_of_segment``): a window never reaches back into another stage's
  run, and a gradient bucket holds gradients of one stage only, so that every issue lands in the
  stage program that consumes it and each stage's buckets are the step model's buckets of that
  stage (:func:`autoplan.cost_models.step._bucket_plan` buckets a stage's segments). Gradients in
  ``deferred_grads`` (a parameter tied across stages) get no bucket: the caller converts them
  after the schedule.

``issue_after`` is never before the value's producer nor before the last placeholder (so the
program's inputs stay first), and never after ``wait_before``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from autoplan.cost_models.comm_schedule import DEFAULT_POLICY, OverlapPolicy, gradient_buckets
from autoplan.passes.placement import Spec, shard_dim
from autoplan.passes.redistribute import OUTPUT, Redistribution
from autoplan.passes.strategies import resolve_value, tensor_args

START = "<start>"
"""``issue_after`` of a conversion issued before the first op."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveSlot:
    """Where one redistribution (or gradient bucket) is issued and waited for."""

    index: int
    """Index into the redistributions the schedule was made for."""
    issue_after: str
    """Node after which the program issues it (:data:`START`: before the first op)."""
    wait_before: str
    """Node before which its result is needed (:data:`~autoplan.passes.redistribute.OUTPUT`:
    the step's output, i.e. before the optimizer step)."""
    bucket: int | None = None
    """Index into :attr:`CommSchedule.buckets` for a member of a coalesced collective."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CommSchedule:
    slots: tuple[CollectiveSlot, ...]
    """One per redistribution, same order."""
    buckets: tuple[tuple[int, ...], ...]
    """Redistribution indices of each coalesced collective, in issue order: a gradient bucket
    (one all-reduce, waited for at the output) or a block's parameter gathers (one all-gather,
    each member waited for at its own consumer)."""
    policy: OverlapPolicy

    def issued_after(self) -> dict[str, list[CollectiveSlot]]:
        """Node name -> slots issued right after it (bucket members: only the bucket's first
        member's slot stands for the bucket), in issue order."""
        out: dict[str, list[CollectiveSlot]] = {}
        for s in self.slots:
            if s.bucket is not None and self.buckets[s.bucket][0] != s.index:
                continue
            out.setdefault(s.issue_after, []).append(s)
        return out


def _local_bytes(node: fx.Node, spec: Spec, mesh_shape: Sequence[int]) -> float:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0.0
    nbytes = float(val.numel() * val.element_size())
    for axis, p in enumerate(spec):
        if shard_dim(p) is not None and axis < len(mesh_shape):
            nbytes /= mesh_shape[axis]
    return nbytes


def _dtype(r: Redistribution, by_name: Mapping[str, fx.Node]) -> str:
    """The dtype of the value ``r`` converts (collectives that share a flat buffer need one)."""
    val = by_name[r.producer.node].meta.get("val")
    if isinstance(val, (tuple, list)):
        val = val[r.producer.index]
    return str(val.dtype) if isinstance(val, torch.Tensor) else "?"


def _is_param_gather(r: Redistribution, by_name: Mapping[str, fx.Node]) -> bool:
    """A parameter (placeholder) all-gathered on one mesh axis along a dim no other axis splits."""
    if by_name[r.producer.node].op != "placeholder" or len(r.steps) != 1 or r.steps[0].kind != "all_gather":
        return False
    axis = r.steps[0].axis
    src = r.src[axis]
    if not isinstance(src, Shard):
        return False
    dim = src.dim
    return all(
        not (isinstance(p, Shard) and p.dim == dim) for a, p in enumerate(r.src) if a != axis
    )


def _runs(nodes: Sequence[fx.Node], segment_of: Mapping[str, int]) -> tuple[dict[str, int], list[int | None]]:
    """Op name -> index of its run of consecutive same-segment ops, and each run's segment."""
    run_of: dict[str, int] = {}
    run_segment: list[int | None] = []
    run, last = -1, None
    for n in nodes:
        if n.op in ("placeholder", "output"):
            continue
        seg = segment_of.get(n.name, last)
        if seg != last or run < 0:
            run += 1
            last = seg
            run_segment.append(seg)
        run_of[n.name] = run
    return run_of, run_segment


def _window_start(run: int, run_stage: Sequence[int | None], prefetch_blocks: int) -> int:
    """The first run of a consumer's window: ``prefetch_blocks`` runs back, within its stage."""
    lo = run
    while lo > 0 and run - lo < prefetch_blocks and run_stage[lo - 1] == run_stage[run]:
        lo -= 1
    return lo


def schedule_collectives(
    gm: fx.GraphModule,
    redistributions: Sequence[Redistribution],
    segment_of: Mapping[str, int],
    *,
    mesh_shape: Sequence[int],
    policy: OverlapPolicy = DEFAULT_POLICY,
    stage_of_segment: Callable[[int], int] | None = None,
    deferred_grads: frozenset[str] = frozenset(),
) -> CommSchedule:
    """The program's communication order (see the module docstring). ``stage_of_segment``: the
    pipeline stage of each segment (``None``: one stage); ``deferred_grads``: parameter node
    names whose gradients are left to the caller (no bucket)."""
    nodes = list(gm.graph.nodes)
    pos = {n.name: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    last_placeholder = max((i for i, n in enumerate(nodes) if n.op == "placeholder"), default=-1)
    output = next(n for n in nodes if n.op == "output")
    run_of, run_segment = _runs(nodes, segment_of)
    run_stage = [None if stage_of_segment is None or seg is None else stage_of_segment(seg) for seg in run_segment]
    run_start: dict[int, int] = {}
    for name, run in run_of.items():
        run_start.setdefault(run, pos[name])

    def after(index: int) -> str:
        return START if index < 0 else nodes[index].name

    # the output's own argument nodes (a ``getitem`` of a multi-output producer: the value exists
    # once that node has run)
    out_node = {resolve_value(a): a.name for a in output.args[0] if isinstance(a, fx.Node)}
    slots: list[CollectiveSlot | None] = [None] * len(redistributions)
    groups: dict[tuple[str, str, int | None], list[int]] = {}
    for i, r in enumerate(redistributions):
        if r.consumer == OUTPUT:
            slots[i] = CollectiveSlot(index=i, issue_after=out_node[r.producer], wait_before=OUTPUT)
        elif r.arg_index == -1:
            if r.bucket is not None and r.consumer not in deferred_grads:
                # one flat buffer per bucket: its members share a dtype (and a stage)
                stage = run_stage[run_of[out_node[r.producer]]] if out_node[r.producer] in run_of else None
                groups.setdefault((r.bucket, _dtype(r, by_name), stage), []).append(i)
            else:
                slots[i] = CollectiveSlot(index=i, issue_after=out_node[r.producer], wait_before=OUTPUT)
        else:
            consumer = by_name[r.consumer]
            arg = tensor_args(consumer)[r.arg_index]
            first_run = _window_start(run_of[r.consumer], run_stage, policy.prefetch_blocks)
            earliest = run_start.get(first_run, pos[r.consumer]) - 1
            issue = max(pos[arg.name], earliest, last_placeholder)
            issue = min(issue, pos[r.consumer] - 1)
            slots[i] = CollectiveSlot(index=i, issue_after=after(issue), wait_before=r.consumer)
    buckets: list[tuple[int, ...]] = []
    # parameter gathers issued at one point on one axis: one coalesced all-gather (FSDP2's
    # per-block gather), each member still waited for at its own consumer
    gathers: dict[tuple[str, int, str], list[int]] = {}
    for i, r in enumerate(redistributions):
        slot = slots[i]
        if policy.coalesce_gathers and slot is not None and r.arg_index >= 0 and _is_param_gather(r, by_name):
            # one flat buffer: only tensors of one dtype (an int64 target beside a float
            # parameter would be promoted to float by the concatenation)
            gathers.setdefault((slot.issue_after, r.steps[0].axis, _dtype(r, by_name)), []).append(i)
    for members in gathers.values():
        if len(members) > 1:
            for i in members:
                old = slots[i]
                assert old is not None
                slots[i] = CollectiveSlot(
                    index=i, issue_after=old.issue_after, wait_before=old.wait_before, bucket=len(buckets)
                )
            buckets.append(tuple(members))
    for members in groups.values():
        ordered = sorted(members, key=lambda i: pos[out_node[redistributions[i].producer]])
        sizes = [
            _local_bytes(by_name[redistributions[i].producer.node], redistributions[i].src, mesh_shape)
            for i in ordered
        ]
        for b in gradient_buckets(sizes, policy):
            members_b = tuple(ordered[k] for k in b)
            last = max(pos[out_node[redistributions[i].producer]] for i in members_b)
            for i in members_b:
                slots[i] = CollectiveSlot(index=i, issue_after=nodes[last].name, wait_before=OUTPUT, bucket=len(buckets))
            buckets.append(members_b)
    # buckets in issue order (the program emits them as their last gradient appears)
    order = sorted(range(len(buckets)), key=lambda b: pos[slots[buckets[b][0]].issue_after])
    renumber = {old: new for new, old in enumerate(order)}
    final = tuple(
        s if s is None or s.bucket is None else CollectiveSlot(
            index=s.index, issue_after=s.issue_after, wait_before=s.wait_before, bucket=renumber[s.bucket]
        )
        for s in slots
    )
    assert all(s is not None for s in final)
    return CommSchedule(
        slots=tuple(s for s in final if s is not None),
        buckets=tuple(buckets[b] for b in order),
        policy=policy,
    )
