"""A hand-written parallel configuration (what Megatron-style launch scripts set by hand).

``ParallelConfig`` is both what the planner reports as its choice (``plan.config``) and what a
user passes to :func:`autoplan.estimate` to price their own configuration with the planner's
cost model. Degrees multiply to the world size: ``dp * cp * tp * pp == cluster.world_size``;
tensor parallelism stays inside a node. The global batch is split as::

    global_batch_size = dp * microbatch_size * num_microbatches

so ``microbatch_size`` is per data-parallel replica (Megatron's ``--micro-batch-size``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal, cast, get_args

from autoplan.cost_models.errors import ConfigError

ScheduleName = Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"]
"""Pipeline schedules (``torch.distributed.pipelining``: ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble), the names the schedule simulator
(:mod:`autoplan.cost_models.schedule`), the search and the runtime share."""
Schedule = Literal["none"] | ScheduleName
"""A configuration's schedule: a pipeline schedule, or ``"none"`` when ``pp == 1``."""
Recompute = Literal["none", "selective", "full"]
Precision = Literal["fp32", "bf16", "fp16"]

SCHEDULES: tuple[ScheduleName, ...] = get_args(ScheduleName)
"""The pipeline schedules, in the order of ``torch.distributed.pipelining``'s classes."""
RECOMPUTE: tuple[Recompute, ...] = get_args(Recompute)
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")


_COUNT_HINTS = {
    "dp": "use 1 for no data parallelism",
    "tp": "use 1 for no tensor parallelism",
    "pp": "use 1 for no pipeline",
    "microbatch_size": "give the samples per micro-batch per data-parallel replica (>= 1)",
    "num_microbatches": "use 1 for no gradient accumulation",
    "virtual_stages": "use 1 unless schedule='interleaved-1f1b'",
    "cp": "use 1 for no context parallelism",
}
"""Fields that count something, with the fix a message suggests for a value below 1."""

REMOVED_FIELDS: dict[str, str] = {}
"""Fields older versions accepted, with why they are gone: naming one is an error, not ignored.
(``sequence_parallel`` was such a field, accepted and never applied, until plan version 2 made it
a real one: plans of version 1 that name it are refused by their version.)"""


def schedule_problem(
    schedule: str, *, pp: int, num_microbatches: int, virtual_stages: int, allow_none: bool = False
) -> str | None:
    """What is wrong with running ``schedule`` on ``pp`` pipeline ranks with ``num_microbatches``
    micro-batches and ``virtual_stages`` model chunks per rank (``None``: nothing). The one
    statement of the schedule rules: :class:`ParallelConfig`, the schedule simulator, the search
    and the runtime all ask here. ``allow_none``: ``"none"`` (no pipeline) is a valid name.

    interleaved-1f1b takes any number of chunks ``v`` (torch 2.13's ScheduleInterleaved1F1B
    bounds none) and ``m`` divisible by ``pp``: a subset of torch's rule ``m % max(1, m // pp)
    == 0`` (its rounds of ``m // max(1, m // pp)`` micro-batches), kept because the closed forms
    and in-flight counts of :mod:`autoplan.cost_models.schedule` assume rounds of ``pp``."""
    if schedule not in SCHEDULES and not (allow_none and schedule == "none"):
        return f"unknown schedule {schedule!r}: use one of {', '.join(SCHEDULES)}"
    if pp < 1:
        return f"num_ranks is {pp}; a pipeline needs at least 1 rank"
    if num_microbatches < 1:
        return f"num_microbatches is {num_microbatches}; use at least 1 micro-batch"
    if virtual_stages < 1:
        return f"virtual_stages is {virtual_stages}; use at least 1 chunk per rank"
    if schedule != "interleaved-1f1b" and virtual_stages != 1:
        return (
            f"schedule {schedule!r} runs one stage per rank, got virtual_stages={virtual_stages}; "
            "use virtual_stages=1 or schedule 'interleaved-1f1b'"
        )
    if schedule == "interleaved-1f1b" and num_microbatches % pp:
        return (
            f"interleaved-1f1b needs num_microbatches divisible by the {pp} pipeline ranks, "
            f"got {num_microbatches}; use a multiple of {pp}"
        )
    return None


def gradients_reduced_in_backward(*, num_stages: int, num_microbatches: int, schedule: str) -> bool:
    """Whether a pipeline plan's backward programs convert the parameter gradients themselves, in
    buckets issued as their gradients exist (DDP's all-reduces, FSDP2's reduce-scatters): every
    schedule but zero-bubble (its split weight-gradient programs). With several micro-batches the
    earlier ones' raw gradients are summed and each stage's last micro-batch's backward adds that
    sum to each of its gradients right before the gradient's bucket, as Megatron's gradient buffer
    does and as torch's pipelining runs FSDP2 (gradient sync on the last backward only), so
    ``num_microbatches`` does not change the rule. With several stages each stage's buckets hold
    its own gradients, issued in its last backward, and waited for before that backward hands its
    input gradient on; a parameter tied across stages is converted after the schedule. Zero-bubble
    converts the stages' raw gradients once per step, after the schedule. The runtime
    (:mod:`autoplan.runtime.pipeline`), the step model (:mod:`autoplan.cost_models.step`) and the
    memory model (:func:`autoplan.cost_models.memory.stage_memory_parts`) all read this rule (re-exported by
    :mod:`autoplan.cost_models.comm_schedule`, beside the overlap it decides);
    which of a stage's backwards convert is :func:`converting_backwards`."""
    del num_stages, num_microbatches  # every stage converts in its (last) backward whatever the counts
    return schedule != "zero-bubble"


def check_schedule(
    schedule: str,
    *,
    pp: int,
    num_microbatches: int,
    virtual_stages: int,
    allow_none: bool = False,
    executable: bool = False,
) -> None:
    """Raise :class:`ConfigError` with :func:`schedule_problem`'s message. ``executable`` adds the
    rule of ``torch.distributed.pipelining`` that the cost model does not need: Schedule1F1B
    runs at least as many micro-batches as stages."""
    problem = schedule_problem(
        schedule, pp=pp, num_microbatches=num_microbatches, virtual_stages=virtual_stages, allow_none=allow_none
    )
    if problem is None and executable and schedule == "1f1b" and num_microbatches < pp:
        problem = f"1f1b needs at least as many micro-batches as stages ({pp}), got {num_microbatches}"
    if problem is not None:
        raise ConfigError(problem)


def context_parallel_problem(cp: int, tp: int, *, devices_per_node: int, tokens: int | None = None) -> str | None:
    """What is wrong with a context-parallel axis of ``cp`` ranks beside ``tp`` (``None``:
    nothing). The one statement of where ``ParallelConfig.cp`` can run: :meth:`ParallelConfig.check_against`,
    the planner's config check (with the samples' ``tokens``), the cost model's replica cluster
    and the search all ask here. A ``cp x tp`` replica lies inside a node, or ``tp`` is a whole
    node so that the ``cp`` axis crosses nodes (with ``tp`` smaller than a node the axis would
    hold several ranks on each node: collectives partly inside nodes and partly across them,
    which one mesh axis cannot price); ``2 * cp`` divides the tokens (the causal ring's zigzag
    halves)."""
    n = cp * tp
    if cp > 1 and n > devices_per_node and tp != devices_per_node:
        return (
            f"cp*tp = {cp}*{tp} = {n} ranks span nodes of {devices_per_node} with {devices_per_node // tp} of the "
            "cp axis's ranks on each: its collectives would run partly inside nodes and partly across them, which "
            f"one mesh axis cannot price; use tp={devices_per_node} (the cp axis then crosses nodes) or "
            f"cp*tp <= {devices_per_node}"
        )
    if cp > 1 and tokens is not None and (tokens < 2 or tokens % (2 * cp)):
        return (
            f"cp={cp} splits each sample's sequence into 2*cp = {2 * cp} chunks (the causal ring's zigzag halves) "
            f"but the inputs have {tokens} tokens per sample: use a cp whose 2*cp divides {tokens}, or cp=1"
        )
    return None


def field_name_problem(names: Iterable[str]) -> str | None:
    """What is wrong with ``names`` as ``ParallelConfig`` field names (``None``: nothing)."""
    fields = [f.name for f in dataclasses.fields(ParallelConfig)]
    unknown = [n for n in names if n not in fields]
    removed = [n for n in unknown if n in REMOVED_FIELDS]
    if removed:
        return f"{removed[0]!r} was removed from ParallelConfig ({REMOVED_FIELDS[removed[0]]})"
    if unknown:
        shown = ", ".join(repr(n)[:40] for n in unknown[:3]) + (", ..." if len(unknown) > 3 else "")
        return f"unknown ParallelConfig field(s) {shown} (known: {', '.join(fields)})"
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    """Degrees and knobs of one training configuration (see the module docstring)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    microbatch_size: int = 1
    """Samples per micro-batch per data-parallel replica."""
    num_microbatches: int = 1
    schedule: Schedule = "1f1b"
    virtual_stages: int = 1
    """Model chunks per pipeline rank (``interleaved-1f1b`` only)."""
    recompute: Recompute = "none"
    """Activation recomputation: ``selective`` keeps matmul outputs and recomputes the cheap
    ops between them; ``full`` keeps only each block's input and recomputes the block."""
    zero_stage: int = 0
    """0: replicated; 1: optimizer state sharded over dp; 2: + gradients; 3: + parameters."""
    stage_dp: tuple[int, ...] | None = None
    """Heterogeneous sub-meshes: the data-parallel degree of each pipeline stage (one per stage,
    ``virtual_stages == 1``), so a heavy stage gets more devices. Stage ``k`` holds
    ``stage_dp[k] * tp`` devices and splits each micro-batch of ``dp * microbatch_size``
    samples ``stage_dp[k]`` ways; the devices add up to ``tp * sum(stage_dp)``. ``None``: ``dp``
    on every stage (estimated only, not executed yet)."""
    offload_optimizer: bool = False
    """Keep the optimizer state and the fp32 master weights in host memory and run the optimizer
    step there (ZeRO-Offload's placement): each step copies the gradients of the rank's shard to
    the host and the updated weights back (:func:`autoplan.cost_models.step.offload_time_s`,
    :func:`autoplan.cost_models.memory.offload_host_bytes_per_element`). Written in a config's
    dict and text only when set, so configurations without it read as before."""

    ep: int = 1
    """Expert parallelism: the routed experts of every MoE layer split over groups of ``ep``
    ranks of the data-parallel group (``1``: every rank holds every expert; else ``ep`` divides
    ``dp``, each rank holding ``experts / ep`` of them), each routed token sent to its expert's
    rank in its group and back with all-to-all (GShard; torchtitan's and Megatron-Core's expert
    parallel degree). With ``ep < dp`` the stage mesh has two data-parallel axes, ``dp`` (``dp /
    ep``: the replicas of each expert shard) and ``ep`` (the expert groups, consecutive ranks):
    the batch is split over both, the dense parameters' gradients are reduced over both and the
    experts' over ``dp`` only (ZeRO shards each over the ranks it is replicated on). With ``ep ==
    dp`` one axis, ``dp``, and the experts' gradients are never reduced. Needs ``tp == 1`` (the
    experts split over one mesh axis), one data-parallel degree on every stage and no optimizer
    offload. Written in a config's dict and text only when above 1."""

    cp: int = 1
    """Context parallelism beside tensor parallelism: each data-parallel replica of a stage is
    ``cp * tp`` ranks, a mesh axis ``cp`` (``tp`` ranks apart) that splits every sample's
    sequence (the inputs' and targets' dim 1) and holds the parameters whole, and the ``tp``
    axis (Megatron-Core's and the Llama 3 paper's CP x TP). The stage ILP places every op on
    both axes, so attention on ``cp`` runs as a ring over the sequence shards or head-parallel
    behind all-to-alls (:mod:`autoplan.passes.ring_attention`). Every parameter's gradient is
    a partial sum over ``cp``, reduced with the data-parallel ones, and ZeRO shards over the
    ``dp x cp`` ranks (torchtitan's FSDP over ``dp_shard x cp``, Megatron-Core's distributed
    optimizer; the step model's ``_DpGroups``). ``cp == 1``: the
    ``tp`` axis may still split the sequence on its own (one axis, either CP or TP per op).
    Needs ``tp > 1`` (with ``tp == 1`` the ``tp`` axis is that context-parallel axis), ``ep == 1``
    and no ``stage_dp``. Written in a config's dict and text only when above 1."""

    sequence_parallel: bool = False
    """Megatron sequence parallelism on the ``tp`` axis (Korthikanti et al. 2022, section 4.2.2):
    every activation the block's non-matmul ops make (norms, dropout, residual adds, activation
    functions, the loss) is held split on the ``tp`` axis, along the tokens (batch or sequence)
    where the op has no split of its own, instead of whole on every rank of the group; the
    column-parallel matmuls' inputs are all-gathered on ``tp`` and the row-parallel outputs
    reduce-scattered, where tensor parallelism alone all-reduces them and holds the region whole.
    The stage ILP places the ops under that rule (:func:`autoplan.planner.mesh.restrict_sequence_parallel`),
    so the saved activations, the conversions and the ops' times of the segment costs are the
    rule's. Needs ``tp > 1``. The joint search prices tensor-parallel candidates with it
    (``SearchSpace.sequence_parallel``). Written in a config's dict and text only when set."""

    sharded_grad_accumulation: bool = False
    """ZeRO >= 2 with several micro-batches: every micro-batch's backward reduce-scatters its own
    gradients in its buckets as they exist (as the last micro-batch's does by default) and adds
    the shards into sharded accumulators, ``1 / dp`` of the gradients (the ZeRO >= 2 layout;
    FSDP2's default), instead of summing the micro-batches' full-size raw gradients and
    converting the sums in the last micro-batch's backward (Megatron's gradient buffer, torch
    pipelining's FSDP2 with gradient sync on the last backward only). Memory against
    communication: the raw sum (``T' g`` bytes per stage) is never held, and the step runs
    ``num_microbatches`` times the gradient reduce-scatters
    (:func:`~autoplan.cost_models.comm_schedule.converting_backwards`, the rule the runtime, the
    step model and the memory model read). Needs ``zero_stage >= 2`` and a schedule that reduces
    in the backward (not ``zero-bubble``); with one micro-batch it is the default program. The
    joint search tries it where a configuration does not fit without it
    (``SearchSpace.sharded_grad_accumulation``). Written in a config's dict and text only when set."""

    def __post_init__(self) -> None:
        for name, hint in _COUNT_HINTS.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"ParallelConfig.{name} must be a positive integer, got {v!r}: {hint}")
        check_schedule(
            self.schedule,
            pp=self.pp,
            num_microbatches=self.num_microbatches,
            virtual_stages=self.virtual_stages,
            allow_none=True,
        )
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"unknown recompute {self.recompute!r}: use one of {', '.join(RECOMPUTE)}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if not isinstance(self.offload_optimizer, bool):
            raise ConfigError(
                f"offload_optimizer must be True or False, got {self.offload_optimizer!r}: "
                "True keeps the optimizer state in host memory"
            )
        self._check_ep()
        self._check_sharded_grad_accumulation()
        if not isinstance(self.sequence_parallel, bool):
            raise ConfigError(
                f"sequence_parallel must be True or False, got {self.sequence_parallel!r}: "
                "True splits the tensor-parallel group's norm/dropout/residual activations along the tokens"
            )
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError(
                "sequence_parallel=True needs tp > 1 (it splits the tensor-parallel group's activations): "
                "set tp > 1 or sequence_parallel=False"
            )
        if self.cp > 1 and (self.tp == 1 or self.ep > 1 or self.stage_dp is not None):
            raise ConfigError(
                f"cp={self.cp} (context parallelism beside tensor parallelism) needs tp > 1, ep=1 and no stage_dp: "
                "with tp=1 plan tp=cp instead (the tp axis then splits the sequence), or set cp=1"
            )
        if self.stage_dp is not None:
            object.__setattr__(self, "stage_dp", tuple(self.stage_dp))
            if len(self.stage_dp) != self.pp or any(
                isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in self.stage_dp
            ):
                raise ConfigError(
                    f"stage_dp must hold one positive degree per pipeline stage (pp={self.pp}), got {self.stage_dp!r}"
                )
            if self.virtual_stages > 1:
                raise ConfigError("stage_dp (per-stage sub-meshes) needs virtual_stages=1")
            samples = self.dp * self.microbatch_size
            if any(samples % d for d in self.stage_dp):
                raise ConfigError(
                    f"stage_dp {list(self.stage_dp)} must divide the {samples} samples of a micro-batch "
                    f"(dp*microbatch_size = {self.dp}*{self.microbatch_size})"
                )

    def _check_ep(self) -> None:
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1:
            raise ConfigError(
                f"ParallelConfig.ep must be a positive integer, got {self.ep!r}: use 1 for no expert parallelism"
            )
        if self.ep == 1:
            return
        if self.dp % self.ep:
            raise ConfigError(
                f"ep={self.ep} must divide the data-parallel degree dp={self.dp} (the experts split over groups of "
                f"ep ranks of the data-parallel group): use a divisor of {self.dp}"
            )
        if self.tp != 1 or self.stage_dp is not None or self.offload_optimizer:
            raise ConfigError(
                "expert parallelism (ep > 1) needs tp=1, no stage_dp and offload_optimizer=False: "
                "set ep=1 or drop the other option"
            )

    def _check_sharded_grad_accumulation(self) -> None:
        if not isinstance(self.sharded_grad_accumulation, bool):
            raise ConfigError(
                f"sharded_grad_accumulation must be True or False, got {self.sharded_grad_accumulation!r}: "
                "True reduce-scatters every micro-batch's gradients into sharded accumulators"
            )
        if not self.sharded_grad_accumulation:
            return
        if self.zero_stage < 2:
            raise ConfigError(
                "sharded_grad_accumulation=True keeps the accumulated gradients sharded over dp, the ZeRO >= 2 "
                f"gradient layout, but zero_stage={self.zero_stage}: set zero_stage=2 or 3, or "
                "sharded_grad_accumulation=False"
            )
        if self.pp > 1 and not gradients_reduced_in_backward(
            num_stages=self.pp * self.virtual_stages, num_microbatches=self.num_microbatches, schedule=self.schedule
        ):
            raise ConfigError(
                "sharded_grad_accumulation=True reduce-scatters in every micro-batch's backward, but schedule "
                f"{self.schedule!r} converts the gradients after the schedule: use another schedule or "
                "sharded_grad_accumulation=False"
            )

    def stage_mesh(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Shape and axis names of one pipeline stage's device mesh: the ``dp`` and ``tp`` axes
        larger than one (a size-one axis only multiplies the ILP's strategies by layouts that
        split nothing). Experts split over groups smaller than dp (``1 < ep < dp``) split the
        data-parallel ranks into two axes, ``dp`` of ``dp / ep`` (the replicas of an expert
        shard) and ``ep`` (an expert group: consecutive ranks, so that its all-to-alls stay
        within a node where they can); the batch is split over both. Context parallelism adds
        the ``cp`` axis before ``tp`` (:attr:`cp`)."""
        sizes = [(self.dp, "dp")]
        if 1 < self.ep < self.dp:
            sizes = [(self.dp // self.ep, "dp"), (self.ep, "ep")]
        sizes += [(self.cp, "cp"), (self.tp, "tp")]
        axes = [(size, name) for size, name in sizes if size > 1] or [(1, "dp")]
        return tuple(a[0] for a in axes), tuple(a[1] for a in axes)

    def dp_of(self, stage: int) -> int:
        """Data-parallel degree of pipeline stage ``stage``: ``stage_dp[stage]``, else ``dp``."""
        return self.stage_dp[stage] if self.stage_dp is not None else self.dp

    @property
    def pipeline_schedule(self) -> ScheduleName:
        """The schedule the step runs: ``schedule``, and without a pipeline (``pp == 1``) 1F1B on
        its one stage: gradient accumulation, each micro-batch's forward then its backward, one
        micro-batch's activations in flight (``torch.distributed.pipelining``'s ScheduleGPipe
        on one stage would run every forward first and hold all ``num_microbatches`` of them:
        measured on 2 gloo ranks, ZeRO-3 with 2 micro-batches peaked 24 % above the one
        in flight the memory model prices, ``benchmarks/memory_peak.py``; on one stage both
        orders take ``m (f + b)``). ``"none"`` with ``pp > 1`` is a :class:`ConfigError`
        (:func:`check_schedule`)."""
        if self.pp == 1:
            return "1f1b"
        check_schedule(
            self.schedule, pp=self.pp, num_microbatches=self.num_microbatches, virtual_stages=self.virtual_stages
        )
        return cast(ScheduleName, self.schedule)

    def canonical(self) -> ParallelConfig:
        """This configuration as the search writes it (a plan's ``config``, an estimate's):
        without a pipeline (``pp == 1``) the schedule is spelled ``"1f1b"``, the default."""
        return self if self.pp > 1 or self.schedule == "1f1b" else dataclasses.replace(self, schedule="1f1b")

    @property
    def ranks_per_replica(self) -> int:
        """Ranks of one data-parallel replica of a stage: ``cp * tp`` (the group the stage ILP
        places ops on; the data-parallel ranks of a stage are this far apart)."""
        return self.cp * self.tp

    @property
    def world_size(self) -> int:
        if self.stage_dp is not None:
            return self.tp * sum(self.stage_dp)
        return self.dp * self.cp * self.tp * self.pp

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def global_batch_size(self) -> int:
        return self.dp * self.microbatch_size * self.num_microbatches

    def check_against(self, *, world_size: int, devices_per_node: int, num_blocks: int, global_batch_size: int) -> None:
        """Raise :class:`ConfigError` naming the numbers when this config cannot run there."""
        if self.stage_dp is not None and self.world_size != world_size:
            raise ConfigError(
                f"tp*sum(stage_dp) = {self.tp}*{sum(self.stage_dp)} = {self.world_size} but the cluster has "
                f"{world_size} devices: choose per-stage degrees that add up to {world_size // self.tp}"
            )
        if self.world_size != world_size:
            names, values = ("dp*cp", f"{self.dp}*{self.cp}") if self.cp > 1 else ("dp", f"{self.dp}")
            raise ConfigError(
                f"{names}*tp*pp = {values}*{self.tp}*{self.pp} = {self.world_size} but the cluster has "
                f"{world_size} devices: choose degrees whose product is the device count"
            )
        if self.tp > devices_per_node or devices_per_node % self.tp:
            raise ConfigError(
                f"tp={self.tp} must divide the {devices_per_node} devices of a node (tensor parallelism stays in a node)"
            )
        problem = context_parallel_problem(self.cp, self.tp, devices_per_node=devices_per_node)
        if problem:
            raise ConfigError(problem)
        if self.num_stages > max(num_blocks, 1):
            raise ConfigError(
                f"pp*virtual_stages = {self.num_stages} stages but the model has {num_blocks} blocks: "
                f"use at most {max(num_blocks, 1)} stages"
            )
        if self.global_batch_size != global_batch_size:
            raise ConfigError(
                f"dp*microbatch_size*num_microbatches = {self.dp}*{self.microbatch_size}*{self.num_microbatches} = "
                f"{self.global_batch_size} but global_batch_size is {global_batch_size}: make them equal"
            )
        if self.pp == 1 and self.num_microbatches > 1 and self.schedule not in ("none", "gpipe", "1f1b"):
            raise ConfigError(f"schedule {self.schedule!r} needs pp > 1")

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values; ``offload_optimizer``, ``sequence_parallel`` and
        ``sharded_grad_accumulation`` only when set and ``ep`` and ``cp`` only above 1 (plans and estimates without them are written as before they existed)."""
        out = asdict(self)
        if not self.offload_optimizer:
            del out["offload_optimizer"]
        if self.ep == 1:
            del out["ep"]
        if self.cp == 1:
            del out["cp"]
        if not self.sequence_parallel:
            del out["sequence_parallel"]
        if not self.sharded_grad_accumulation:
            del out["sharded_grad_accumulation"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParallelConfig:
        """The config saved by :meth:`to_dict`; a key that is not a field is refused, named."""
        problem = field_name_problem(data)
        if problem:
            raise ConfigError(f"{problem}: remove it from the config")
        return cls(**data)

    def __str__(self) -> str:
        parts = [
            f"dp={self.dp}",
            *([f"cp={self.cp}"] if self.cp > 1 else []),
            f"tp={self.tp}" + ("+sp" if self.sequence_parallel else ""),
            f"pp={self.pp}",
            f"mbs={self.microbatch_size}x{self.num_microbatches}",
        ]
        if self.pp > 1:
            parts.append(self.schedule + (f"(v={self.virtual_stages})" if self.virtual_stages > 1 else ""))
        if self.stage_dp is not None:
            parts.append(f"stage_dp={list(self.stage_dp)}")
        parts += [f"recompute={self.recompute}", f"zero={self.zero_stage}"]
        if self.offload_optimizer:
            parts.append("offload=optimizer")
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.sharded_grad_accumulation:
            parts.append("grads=sharded")
        return " ".join(parts)


EXECUTABLE_ZERO_STAGES: tuple[int, ...] = (0, 3)
"""The ZeRO stages ``autoplan.parallelize`` runs (0: whole parameters on every data-parallel rank,
3: sharded); 1 and 2 are priced by ``autoplan.estimate`` only. The joint search's space
(``autoplan.planner.joint.EXECUTABLE_SPACE``) and loaded plans hold to these."""
EXECUTABLE_RECOMPUTE: tuple[Recompute, ...] = RECOMPUTE
"""The recomputation modes the runtime runs (every one)."""


def unexecutable_fields(config: ParallelConfig) -> list[tuple[str, str, str]]:
    """``(field, value, the values that run)`` of each of ``config``'s knobs the runtime cannot
    run yet (empty: it runs): a ZeRO stage outside :data:`EXECUTABLE_ZERO_STAGES`, per-stage
    sub-meshes (``stage_dp``), a schedule or recomputation mode it does not know."""
    bad: list[tuple[str, str, str]] = []
    if config.pp > 1 and config.schedule not in SCHEDULES:
        bad.append(("schedule", repr(config.schedule), ", ".join(SCHEDULES)))
    if config.recompute not in EXECUTABLE_RECOMPUTE:
        bad.append(("recompute", repr(config.recompute), ", ".join(EXECUTABLE_RECOMPUTE)))
    if config.zero_stage not in EXECUTABLE_ZERO_STAGES:
        bad.append(("zero_stage", repr(config.zero_stage), " or ".join(map(str, EXECUTABLE_ZERO_STAGES))))
    if config.stage_dp is not None:
        bad.append(("stage_dp", repr(list(config.stage_dp)), "none (every stage on dp*cp*tp devices)"))
    return bad
