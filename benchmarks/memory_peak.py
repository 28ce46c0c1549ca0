"""Predicted vs measured peak memory per rank (issue #19, item 4: memory = the real peak).

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/memory_peak.py

Two gloo CPU ranks (one thread each; four for :data:`CONFIGS_4`), a GPT-2-shaped model from the
test zoo (``tests.zoo.gpt2_lm``: 4 layers, hidden 128, 4 heads, vocab 2048, 64 positions, the
zoo model's longest sequence; fp32, tied lm_head), one seeded batch of 8 sequences of 64 tokens, Adam. Plans (rank 0 plans on the ``2xCPU`` preset, hands them to rank 1):

* ``plain``: the per-operator ILP's plan pinned to pure data parallelism (inputs ``S(0)``, every
  parameter ``R``); predicted peak: the plan's liveness timeline (:func:`autoplan.passes.liveness.peak_memory`);
* every other case: a joint-search plan with the configuration fixed (``config=``, :data:`CONFIGS`);
  predicted peak: the joint search's per-rank memory
  (:func:`autoplan.cost_models.memory.stage_memory_parts`, combined per pipeline rank by
  :func:`autoplan.cost_models.memory.rank_memory_parts`; ``estimate.memory_per_device_bytes``):

  - ``dp``, ``selective``, ``recompute``: ``dp=2`` without recomputation, with selective and
    with full recomputation (one micro-batch of 4 per rank);
  - ``zero3``: ``dp=2`` with ZeRO-3 (FSDP2's gathered weights per segment, reduce-scattered gradients);
  - ``pp2``: ``pp=2``, 2 micro-batches, 1F1B (point-to-point activations, a stage per rank);
  - ``tp2_sp``: ``tp=2`` with sequence parallelism, one sample per micro-batch (8 of them), so the
    tensor-parallel axis splits the sequence between the blocks (the norms' and residuals'
    activations ``1/tp``), the blocks' all-gathers and reduce-scatters on it, and gradient
    accumulation over 8 micro-batches;
  - ``zero3_ga``, ``zero3_ga_sharded``: ``dp=2``, ZeRO-3, 2 micro-batches of 2, the gradients
    accumulated unsharded (summed raw over the micro-batches, reduce-scattered in the last one's
    backward) and sharded (every micro-batch's backward reduce-scatters; its last buckets still
    in flight in the next forward);
  - ``pp2_v2``, ``pp2_v2_m4``: interleaved 1F1B, ``pp=2`` with 2 virtual stages per rank (4
    stages of one block each, the embedding with the first, the tied lm_head and loss with the
    last), 2 micro-batches of 4 and 4 of 2: with 4 the two stages of a rank hold different counts
    of micro-batches when the rank peaks, which is in a later micro-batch's backward of one
    stage with the other's gradients alive and the sends torch's schedule keeps to the step's end;

  four ranks (``4xCPU``, :data:`CONFIGS_4`; a job of their own, started by rank 0 of the
  two-rank job after its cases, :func:`start_four_rank_job`; the launch command stays the two-rank one):

  - ``dp2_pp2_v2``, ``dp2_pp2_v2_m4``: the interleaved pipeline beside data parallelism
    (``dp=2, pp=2``, ``v=2``), 2 micro-batches of 2 and 4 of 1 per replica;
  - ``cp2_tp2_sp``: context parallelism, ``cp=2`` beside ``tp=2`` with sequence parallelism
    (``ParallelConfig`` takes ``cp > 1`` only beside ``tp > 1``, so it needs four ranks; GPT-2
    runs it, no Llama needed): every sample's sequence split over the ``cp`` axis.

Measured peak: CPU tensors have no caching allocator and no allocator statistics
(``torch.cuda.max_memory_allocated`` has no CPU twin), so each rank runs :data:`PROFILED_STEPS` training steps
(``forward_backward``, optimizer step, ``zero_grad``), each under ``torch.profiler`` with
``profile_memory=True``, after two warm-up steps, replays the profiler's allocation events (every
allocation and free of the CPU allocator with its address and byte count) in time order on top of
the bytes alive when the step starts (the rank's parameters, optimizer state and batch, counted
from the tensors themselves, each storage once), with the corrections of :func:`step_peak` for
what the profiler does not see (frees on gloo's worker threads, blocks of the previous step). The
rank's peak is the median of its steps' (the table shows the spread: a step where a free stays
unseen until after the peak reads high). Error = predicted / measured - 1, per rank; the table
shows the worse rank. Final line::

    memory_peak: cases=N err_max=X% target=3% met=yes|no
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import autoplan  # noqa: E402
from autoplan.cost_models.config import ParallelConfig  # noqa: E402
from tests.zoo import gpt2_lm, lm_loss, token_batch  # noqa: E402

LAYERS, HIDDEN, HEADS, VOCAB, SEQ, BATCH = 4, 128, 4, 2048, 64, 8
CLUSTER = "2xCPU"
CLUSTER_4 = "4xCPU"
OPTIMIZER = "adam"
TARGET = 0.03
"""Issue #41's target: every case within 3 %."""
PROFILED_STEPS = 5
"""Steps measured after the warm-up; the rank's peak is their median (:func:`measure`). With the
corrections of :func:`step_peak` most cases here repeat their peak step after step to the byte;
an unseen free whose address the allocator had not handed out again by the peak counts as alive,
so a step can read high (ZeRO-3 with two micro-batches, one run: median 22.11 MiB, steps
22.11-25.69)."""
DP_PINS = {"input_0": "S(0)", "target_0": "S(0)", "*": "R"}
_MB = BATCH // 2
CONFIGS = {
    "dp": ParallelConfig(dp=2, tp=1, pp=1, microbatch_size=_MB, num_microbatches=1),
    "selective": ParallelConfig(dp=2, tp=1, pp=1, microbatch_size=_MB, num_microbatches=1, recompute="selective"),
    "recompute": ParallelConfig(dp=2, tp=1, pp=1, microbatch_size=_MB, num_microbatches=1, recompute="full"),
    "zero3": ParallelConfig(dp=2, tp=1, pp=1, microbatch_size=_MB, num_microbatches=1, zero_stage=3),
    "pp2": ParallelConfig(dp=1, tp=1, pp=2, microbatch_size=_MB, num_microbatches=2),
    # issue #41 item 5: tensor parallelism with sequence parallelism, ZeRO-3 gradient accumulation
    # in both layouts, an interleaved pipeline, and (4 ranks, below) dp x interleaved pp and cp x tp
    # one sample per micro-batch: the tp axis cannot split the batch, so the rule splits the sequence
    "tp2_sp": ParallelConfig(dp=1, tp=2, pp=1, microbatch_size=1, num_microbatches=BATCH, sequence_parallel=True),
    "zero3_ga": ParallelConfig(dp=2, microbatch_size=2, num_microbatches=2, zero_stage=3),
    "zero3_ga_sharded": ParallelConfig(
        dp=2, microbatch_size=2, num_microbatches=2, zero_stage=3, sharded_grad_accumulation=True
    ),
    "pp2_v2": ParallelConfig(pp=2, microbatch_size=4, num_microbatches=2, schedule="interleaved-1f1b", virtual_stages=2),
    # four micro-batches: the rank's two stages reach their peaks at different steps of the schedule
    "pp2_v2_m4": ParallelConfig(pp=2, microbatch_size=2, num_microbatches=4, schedule="interleaved-1f1b", virtual_stages=2),
}
"""Two-rank cases (``2xCPU``)."""
CONFIGS_4 = {
    "dp2_pp2_v2": ParallelConfig(
        dp=2, pp=2, microbatch_size=2, num_microbatches=2, schedule="interleaved-1f1b", virtual_stages=2
    ),
    "dp2_pp2_v2_m4": ParallelConfig(
        dp=2, pp=2, microbatch_size=1, num_microbatches=4, schedule="interleaved-1f1b", virtual_stages=2
    ),
    "cp2_tp2_sp": ParallelConfig(cp=2, tp=2, microbatch_size=BATCH, num_microbatches=1, sequence_parallel=True),
}
"""Four-rank cases (``4xCPU``), run by rank 0 of the two-rank job as a job of their own
(``--four``; the summary covers both)."""
ONLY = next((a.split("=", 1)[1].split(",") for a in sys.argv[1:] if a.startswith("--cases=")), None)
"""``--cases=a,b``: run only these cases (a check while developing; the summary then covers them only)."""
ROW_PREFIX = "memory_peak_row\t"
"""Lines the four-rank job prints for the two-rank job to merge: name, plan, measured, predicted."""


def build_model() -> nn.Module:
    """The same weights on every rank (seeded)."""
    torch.manual_seed(0)
    return gpt2_lm(layers=LAYERS, hidden=HIDDEN, heads=HEADS, vocab=VOCAB, positions=SEQ).train()


def plans(ids: torch.Tensor, labels: torch.Tensor, *, four: bool = False) -> dict[str, dict | str]:
    """Rank 0 plans every case (``four``: the four-rank ones); a plan that fails is its reason (a string)."""
    kw = dict(example_inputs=(ids,), loss_fn=lm_loss, example_targets=(labels,), optimizer=OPTIMIZER)
    cluster = CLUSTER_4 if four else CLUSTER
    makers: dict[str, Callable[[], autoplan.Plan]] = (
        {} if four or (ONLY and "plain" not in ONLY) else {"plain": lambda: autoplan.plan(build_model(), CLUSTER, pins=DP_PINS, **kw)}
    )
    for name, config in (CONFIGS_4 if four else CONFIGS).items():
        if ONLY and name not in ONLY:
            continue
        makers[name] = lambda c=config: autoplan.plan(build_model(), cluster, global_batch_size=BATCH, config=c, **kw)
    out: dict[str, dict | str] = {}
    for name, make in makers.items():
        try:
            out[name] = make().to_dict()
        except Exception as e:  # noqa: BLE001 - reported as the case's n/a reason
            out[name] = f"planning failed: {type(e).__name__}: {str(e)[:200]}"
    return out


def _storages(tensors: Iterable[object]) -> dict[int, int]:
    """The distinct storages behind ``tensors`` (DTensors: their local shard): data pointer -> bytes."""
    seen: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        st = local.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return seen


def _alive_at_start(pm: nn.Module, opt: torch.optim.Optimizer, batch: Iterable[torch.Tensor]) -> dict[int, int]:
    state = [v for s in opt.state.values() for v in s.values()]
    grads = [p.grad for p in pm.parameters() if p.grad is not None]
    return _storages([*pm.parameters(), *pm.buffers(), *state, *grads, *batch])


Event = tuple[int, int, int]
"""``(time ns, data pointer, bytes)``: an allocation (bytes > 0) or a free (< 0)."""


def _tensor_ptrs(value: object) -> list[int]:
    """Storage pointers of a profiled op's tensor argument (a tensor or a list of them)."""
    if hasattr(value, "storage_data_ptr"):
        return [value.storage_data_ptr]  # type: ignore[attr-defined]
    if isinstance(value, list):
        return [p for v in value for p in _tensor_ptrs(v)]
    return []


def _allocation_events(prof: profile) -> tuple[list[Event], dict[tuple[int, int], int]]:
    """Every allocation and free the profiler recorded, in time order, and the blocks a
    collective holds: ``(pointer, allocation time) -> time its wait returned``, for the inputs of
    each functional collective (``_c10d_functional.*``: the flat ``cat`` of a coalesced gather,
    the flat bucket an in-place ``all_reduce_`` reduces and its wait awaits) and what it
    allocates inside (gloo's full-size copy of a reduce-scatter's input, and its output). The
    output is the caller's, but gloo's work object holds it too until the worker thread drops the
    work, right after running it: a caller that lets go of it right after its wait (a gathered
    flat buffer, once split; a bucket, once its results are copied out) leaves the last
    reference to the worker, whose free the profiler does not see (ZeRO-3 with sharded
    accumulation: 0.76-1.79 MiB of gathered outputs without a free, counted alive to the step's
    end on one rank and not the other; cp2_tp2_sp: a 3.05 MiB bucket reduced in place, alive at
    the optimizer step in 2 of 5 steps on 2 of 4 ranks); a caller that keeps it frees it on its
    own thread, a free that is seen, and :func:`step_peak` then keeps it. Needs
    ``record_shapes=True`` (the ops' tensor arguments)."""
    events: list[Event] = []
    issues: list[tuple[int, list[int], list[tuple[int, int]]]] = []  # (time, input ptrs, allocations inside)
    waits: list[tuple[int, int, int]] = []  # (start, end, the awaited tensor's pointer)

    def inside(e: Any, out: list[tuple[int, int]]) -> None:
        for c in e.children:
            if c.tag == _EventType.Allocation and c.extra_fields.alloc_size > 0:
                out.append((c.extra_fields.ptr, c.start_time_ns))
            inside(c, out)

    stack = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size))
        elif e.tag == _EventType.TorchOp and e.name.startswith("_c10d_functional::"):
            ptrs = [p for a in e.extra_fields.inputs for p in _tensor_ptrs(a)]
            if e.name.endswith("wait_tensor"):
                waits.extend((e.start_time_ns, e.end_time_ns, p) for p in ptrs[:1])
            else:
                made: list[tuple[int, int]] = []
                inside(e, made)
                issues.append((e.start_time_ns, ptrs, made))
        stack.extend(e.children)
    events.sort()
    allocated: dict[int, list[int]] = {}
    for t, ptr, nbytes in events:
        if nbytes > 0:
            allocated.setdefault(ptr, []).append(t)
    held: dict[tuple[int, int], int] = {}
    for t_issue, inputs, made in issues:
        # what its wait awaits: an output it made, or its input (an in-place all_reduce_)
        outputs = ({p for p, _ in made} | set(inputs)) & {p for _, _, p in waits}
        wait = min((end for start, end, p in waits if p in outputs and start >= t_issue), default=None)
        if wait is None:
            continue  # waited for after the step
        for ptr in inputs:  # the instance of the block alive when the collective was issued
            t_alloc = max((t for t in allocated.get(ptr, ()) if t <= t_issue), default=None)
            if t_alloc is not None:
                held[(ptr, t_alloc)] = wait
        for ptr, t_alloc in made:  # its output too: see the docstring
            held[(ptr, t_alloc)] = wait
    return events, held


_TIMELINES: list[tuple[list[Event], int, dict[int, int]]] = []
"""With ``MEMORY_PEAK_TIMELINE`` set: every measured step's corrected events (for a diagnosis)."""


def step_peak(
    events: Sequence[Event],
    at_start: Mapping[int, int],
    held: Mapping[tuple[int, int], int] | None = None,
    at_end: Mapping[int, int] | None = None,
) -> int:
    """A step's peak bytes from its allocation events (:func:`_allocation_events`) and the storages
    counted alive when it starts (``at_start``: pointer -> bytes), correcting two gaps in what the
    profiler records (measured on gloo ranks, torch 2.13):

    * it records the memory events of the threads it profiles, not gloo's worker threads; a
      buffer a collective's work object holds (a reduce-scatter's input copy, an all-gather's
      flat input) is freed on the worker when that thread drops the work last, and that free is
      missing. Such a block (``held``, from :func:`_allocation_events`) with no free recorded is
      freed when its collective's wait returns (the work is done by then; a block still alive
      when the next step starts, ``at_end``, is not). Any other block is known freed when the
      allocator hands its address out again (an upper bound, and only as far as the allocator's
      reuse: glibc hands a freed chunk of that size back first, but a large block is a mapping
      of its own and its address may not come back);
    * a free of a block made before the step (the previous step's last buffers, alive when this
      one starts and not among ``at_start``) counts that block alive from the step's start to its
      free.

    Without these the peak of one case moved by up to 8.5 MiB from step to step (ZeRO-3 with two
    micro-batches, before the backward freed its activations: 26.4 to 34.9 MiB over 10 steps of two
    ranks; with address reuse alone 28.42 MiB in 7 of 10, 29.2 to 31.0 in the others)."""
    held = held or {}
    at_end = at_end or {}
    earlier = 0  # blocks from before the step, freed in it
    instance: dict[int, tuple[int, int]] = {}  # ptr -> (allocation time, bytes) of its latest block
    freed: set[tuple[int, int]] = set()
    for t, ptr, nbytes in events:
        if nbytes > 0:
            instance[ptr] = (t, nbytes)
        elif ptr in instance:
            freed.add((ptr, instance[ptr][0]))
        elif ptr not in at_start:
            earlier -= nbytes
    # unseen frees of collective-held blocks: at the wait, unless the address came back before it
    timeline = list(events)
    by_ptr: dict[int, list[tuple[int, int]]] = {}
    for t, ptr, nbytes in events:
        if nbytes > 0:
            by_ptr.setdefault(ptr, []).append((t, nbytes))
    for ptr, blocks in by_ptr.items():
        for i, (t_alloc, nbytes) in enumerate(blocks):
            wait = held.get((ptr, t_alloc))
            if wait is None or (ptr, t_alloc) in freed:
                continue
            last = i == len(blocks) - 1
            if (last and ptr in at_end) or (not last and blocks[i + 1][0] <= wait):
                continue
            timeline.append((wait, ptr, -nbytes))
    timeline = sorted(timeline)
    if os.environ.get("MEMORY_PEAK_TIMELINE"):  # a diagnosis: the corrected events of every step
        _TIMELINES.append((timeline, sum(at_start.values()) + earlier, dict(at_start)))
    return replay(timeline, sum(at_start.values()) + earlier, at_start)[0]


def replay(timeline: Sequence[Event], base: int, at_start: Mapping[int, int]) -> tuple[int, int, dict[int, int]]:
    """``(peak bytes, its time, the blocks made in the step alive then: pointer -> bytes)`` of a
    corrected, time-ordered event list (:func:`step_peak`) on top of ``base`` bytes."""
    live: dict[int, int] = {}
    cur = peak = base
    when, at_peak = 0, {}
    for t, ptr, nbytes in timeline:
        if nbytes > 0:
            cur += nbytes - live.pop(ptr, 0)  # an address handed out again: its block was freed
            live[ptr] = nbytes
        elif ptr in live:
            cur -= live.pop(ptr)
        elif ptr not in at_start:
            cur += nbytes  # a block from before the step
        if cur > peak:
            peak, when, at_peak = cur, t, dict(live)
    return peak, when, at_peak


def measure(plan: autoplan.Plan, ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, float, float]:
    """This rank's peak bytes of one training step: (median, smallest, largest) over
    :data:`PROFILED_STEPS` steps (see the module docstring)."""
    pm = autoplan.parallelize(
        build_model(), plan.cluster, example_inputs=(ids,), loss_fn=lm_loss, example_targets=(labels,), plan=plan
    )
    opt = pm.make_optimizer(lr=1e-3)

    def step() -> None:
        pm.forward_backward(ids, targets=(labels,))
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step()
    steps = []
    for _ in range(PROFILED_STEPS):
        dist.barrier()
        at_start = _alive_at_start(pm, opt, (ids, labels))
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
            step()
        steps.append((*_allocation_events(prof), at_start))
    ends = [at_start for _, _, at_start in steps[1:]] + [_alive_at_start(pm, opt, (ids, labels))]
    peaks = [float(step_peak(ev, at_start, held, end)) for (ev, held, at_start), end in zip(steps, ends, strict=True)]
    return statistics.median(peaks), min(peaks), max(peaks)


def predicted(plan: autoplan.Plan, rank: int) -> float:
    """The plan's peak bytes for ``rank`` (pipeline plans: its pipeline rank's)."""
    e = plan.estimate
    if plan.config is not None and e.memory_per_device_bytes:
        per_stage_rank = plan.cluster.world_size // plan.config.pp
        return e.memory_per_device_bytes[rank // per_stage_rank]
    return e.memory_bytes["total"]


def start_four_rank_job() -> tuple[subprocess.Popen[str], Any, Any]:
    """On rank 0 of the two-rank job, once its own cases are measured (rank 1 waits): the
    four-rank cases as a job of their own (this script with ``--four`` under
    ``torch.distributed.run``); its output goes to temporary files, read by :func:`four_rank_rows`.
    Not beside the two-rank cases: six ranks on 2 cores delay gloo's worker threads, whose frees
    then come late and the measured peaks with them (zero3_ga_sharded: 22.31 MiB alone, steps
    22.31-24.86, median 24.10, beside the four-rank job), and one after the other is no slower
    (about 45 s and 23 s with the plans cached, 100 s cold, against 83 s side by side)."""
    with socket.socket() as s:  # a free port: another run of this benchmark may hold a fixed one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(port),
           os.path.abspath(__file__), "--four", *(a for a in sys.argv[1:] if a.startswith("--cases="))]  # fmt: skip
    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC", "GROUP_", "ROLE_", "LOCAL_WORLD")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    return subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env), out, err


Row = tuple[str, str, float, float, float, float, float]
"""(case, plan, measured median, predicted, error, smallest and largest step's peak)."""


def four_rank_rows(job: tuple[subprocess.Popen[str], Any, Any]) -> tuple[list[Row], list[str]]:
    """The four-rank job's rows (:func:`start_four_rank_job`), once it ends, and the reasons of
    the cases that gave none."""
    proc, out, err = job
    try:
        returncode = proc.wait(timeout=1500)
    except subprocess.TimeoutExpired:
        proc.kill()
        returncode = proc.wait()
    out.seek(0)
    err.seek(0)
    rows, missing = [], []
    for line in out.read().splitlines():
        if line.startswith(ROW_PREFIX):
            name, what, meas, pred, lo, hi = line[len(ROW_PREFIX) :].split("\t")
            rows.append((name, what, float(meas), float(pred), float(pred) / float(meas) - 1, float(lo), float(hi)))
        elif line.startswith("n/a "):
            missing.append(line[4:])
    if returncode != 0:
        missing.append(f"four-rank job: exit {returncode}: {err.read().strip().splitlines()[-1:]}")
    return rows, missing


def main() -> None:
    torch.set_num_threads(1)
    started = time.perf_counter()
    four = "--four" in sys.argv[1:]
    run_four = not four and int(os.environ["RANK"]) == 0 and (not ONLY or bool(set(ONLY) & set(CONFIGS_4)))
    ids, labels = token_batch(batch=BATCH, seq=SEQ, seed=1, vocab=VOCAB)
    planned_here = plans(ids, labels, four=four) if int(os.environ["RANK"]) == 0 else None
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    box: list[object] = [planned_here]
    dist.broadcast_object_list(box, src=0)
    planned: dict[str, dict | str] = box[0]  # type: ignore[assignment]
    rows: list[Row] = []
    missing: list[str] = []
    for name, plan_or_reason in planned.items():
        if isinstance(plan_or_reason, str):
            missing.append(f"{name}: {plan_or_reason}")
            continue
        plan = autoplan.Plan.from_dict(plan_or_reason)
        try:
            median, lo, hi = measure(plan, ids, labels)
            mine = [median, predicted(plan, rank), lo, hi]
        except Exception as e:  # noqa: BLE001 - reported as the case's n/a reason
            if rank == 0:
                traceback.print_exc()
            mine = [float("nan")] * 4
            missing.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
        both: list[list[float]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(both, mine)
        if any(m[0] != m[0] for m in both):  # NaN: a rank failed
            continue
        errs = [m[1] / m[0] - 1 for m in both]
        worst = max(range(len(both)), key=lambda r: abs(errs[r]))
        what = str(plan.config) if plan.config is not None else "ILP plan, dp pins"
        rows.append((name, what, both[worst][0], both[worst][1], errs[worst], both[worst][2], both[worst][3]))
    if four:
        if rank == 0:
            for name, what, meas, pred, _, lo, hi in rows:
                print(f"{ROW_PREFIX}{name}\t{what}\t{meas}\t{pred}\t{lo}\t{hi}")
            for m in missing:
                print(f"n/a {m}")
        from autoplan.runtime.teardown import destroy_process_groups

        destroy_process_groups()
        return
    if run_four:
        more, more_missing = four_rank_rows(start_four_rank_job())
        rows += more
        missing += more_missing
    dist.barrier()
    if rank == 0:
        mib = 2**20
        print(f"model: GPT-2 {LAYERS} layers, hidden {HIDDEN}, vocab {VOCAB}; batch {BATCH}x{SEQ}; fp32, {OPTIMIZER}; "
              f"2 (and 4) gloo CPU ranks; peak of a step, median of {PROFILED_STEPS} (torch.profiler allocation events "
              f"+ bytes alive at the start)")  # fmt: skip
        print(f"{'case':16} {'plan':58} {'measured MiB':>12} {'(steps min-max)':>15} {'predicted MiB':>13} {'error':>7}")
        for name, what, meas, pred, err, lo, hi in rows:
            spread = f"{lo / mib:.2f}-{hi / mib:.2f}"
            print(f"{name:16} {what:58} {meas / mib:12.2f} {spread:>15} {pred / mib:13.2f} {err:+7.1%}")
        for m in missing:
            print(f"n/a {m}")
        err_max = max((abs(r[4]) for r in rows), default=float("nan"))
        met = "yes" if rows and not missing and err_max <= TARGET else "no"
        print(f"(wall time {time.perf_counter() - started:.0f} s)", file=sys.stderr)
        print(f"memory_peak: cases={len(rows)} err_max={err_max:.1%} target={TARGET:.0%} met={met}")
    from autoplan.runtime.teardown import destroy_process_groups

    destroy_process_groups()


if __name__ == "__main__":
    main()
