"""The public pipeline: trace -> strategies -> cost -> solve -> plan, then apply.

``plan()`` decides and returns a :class:`~autoplan.planner.plan.Plan` (no process group needed: a fake
one stands in for big clusters). ``parallelize()`` applies a plan inside a ``torchrun`` job and
returns a :class:`ParallelModel` that trains exactly like the single-device model.
``estimate()`` prices a hand-written configuration with the planner's cost model. The planning
machinery they call lives in :mod:`autoplan.planner`.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import logging
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast, overload

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import autoplan.errors as errors
from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.config import PRECISIONS, ParallelConfig
from autoplan.cost_models.echo import clip
from autoplan.cost_models.errors import ConfigError, NotPlannedError, PlanError, PlanMismatchError
from autoplan.cost_models.memory import OPTIMIZERS
from autoplan.passes import pass_order
from autoplan.passes.expand import expand_assignment
from autoplan.passes.layers import find_layers
from autoplan.passes.trace import LossFn, trace_training_step
from autoplan.planner import progress
from autoplan.planner.ilp import Pins, ProfileChoice, open_profile, plan_traced
from autoplan.planner.joint import estimate, plan_for_batch
from autoplan.planner.mesh import as_cluster, planning_alone, planning_mesh
from autoplan.planner.plan import Plan
from autoplan.planner.tracing import prepare_for_precision, trace_for_plan, trace_microbatch
from autoplan.runtime.codegen import generate_program
from autoplan.runtime.data import FieldSpec, LocalBatch, batch_mismatch
from autoplan.runtime.optimizers import refuse_optimizers_of_the_module
from autoplan.runtime.parallel import ParallelModel
from autoplan.runtime.pipeline import PipelineModel, build_pipeline
from autoplan.runtime.precision import check_model_precision

log = logging.getLogger(__name__)


def _check_optimizer(optimizer: str) -> None:
    if optimizer not in OPTIMIZERS:
        raise PlanError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)}")


def _check_time_limit(time_limit_s: float) -> None:
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or not 0 < time_limit_s < math.inf:
        raise PlanError(f"time_limit_s must be a positive number of seconds, got {time_limit_s!r}: e.g. 120")


GC_GEN0_THRESHOLD = 100_000
"""Allocations between two young-generation garbage collections while planning (Python's default
is 700). Tracing and the ILPs allocate millions of short-lived objects next to a large live
model graph; each default collection cascade rescanned that graph and took 15-20% of the
planning time of Llama-3-8B (measured: 19.3 s -> 17.0 s end to end)."""


@contextlib.contextmanager
def _few_gc_passes() -> Iterator[None]:
    """Collect garbage less often while planning (:data:`GC_GEN0_THRESHOLD`; older generations
    every 50 and 1000 young collections); the caller's thresholds are restored afterwards."""
    old = gc.get_threshold()
    gc.set_threshold(max(old[0], GC_GEN0_THRESHOLD), max(old[1], 50), max(old[2], 1000))
    try:
        yield
    finally:
        gc.set_threshold(*old)


def plan(
    model: torch.nn.Module,
    cluster: Cluster | str,
    *,
    example_inputs: Sequence[torch.Tensor],
    loss_fn: LossFn | None = None,
    example_targets: Sequence[torch.Tensor] = (),
    optimizer: str = "adam",
    pins: Pins | None = None,
    time_limit_s: float = 120.0,
    solver: str = "auto",
    profile: ProfileChoice = "auto",
    global_batch_size: int | None = None,
    precision: str = "fp32",
    config: ParallelConfig | None = None,
    reduce_repeated: bool = True,
) -> Plan:
    """Plan data/tensor/sequence/parameter sharding of one training step of ``model``.

    With ``global_batch_size`` the plan comes from the joint search (:mod:`autoplan.planner.joint`):
    data/tensor/pipeline degrees, micro-batches, schedule, recomputation and ZeRO stage, with
    the per-operator ILP inside each stage; ``plan.config`` holds the chosen configuration and
    ``example_inputs`` only give the per-sample shapes. ``config`` fixes the configuration
    (degrees, micro-batches, schedule, recomputation, ZeRO); the search then places the stages.
    These plans trace two of the model's repeated blocks and solve one for all of them
    (``reduce_repeated``; :mod:`autoplan.passes.depth`); ``parallelize`` repeats the placements on every block.
    ``precision`` (``fp32``, ``bf16``, ``fp16``; plans with ``global_batch_size`` only) is the dtype
    the step is traced, priced and run in; a bf16 plan trains an fp32 model with fp32 master
    weights (:mod:`autoplan.runtime.precision`).

    ``model`` may live on the ``meta`` device. ``loss_fn(output, *example_targets)`` must return
    a scalar (omit it if the model returns its loss). ``pins`` fixes placements, e.g.
    ``{"layers.*.mlp.up.weight": "R,S(0)", "input_0": "S(0),R"}``. ``solver`` is ``"auto"``
    (HiGHS when installed, else PuLP's bundled CBC), ``"highs"`` or ``"cbc"``. ``profile``
    chooses measured op times (:func:`open_profile`); the plan's estimate says how many it used.
    """
    with _few_gc_passes():
        cluster = as_cluster(cluster)
        _check_optimizer(optimizer)
        _check_time_limit(time_limit_s)
        if precision not in PRECISIONS:
            raise ConfigError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
        if global_batch_size is None and precision != "fp32":
            raise ConfigError(
                f"precision={precision!r} needs global_batch_size= (--global-batch-size): only plans made for a global "
                "batch run in mixed precision; without it the step is planned in the model's own dtype (convert the "
                "model, e.g. model.to(torch.bfloat16), to plan pure bf16 training)"
            )
        if global_batch_size is not None:
            _check_joint_options(plan=None, pins=pins, global_batch_size=global_batch_size, config=config)
            return plan_for_batch(
                model, cluster, example_inputs=example_inputs, loss_fn=loss_fn, example_targets=example_targets,
                global_batch_size=global_batch_size, precision=precision, optimizer=optimizer,
                profile=open_profile(cluster, profile), time_limit_s=time_limit_s, solver=solver, config=config,
                reduce_repeated=reduce_repeated,
            )  # fmt: skip
        if config is not None:
            raise ConfigError(
                "config= needs global_batch_size= (the configuration splits a global batch): pass both, or neither"
            )
        progress.step("tracing the model (torch.export)")
        traced = pass_order.TRACE(model, example_inputs, loss_fn=loss_fn, example_targets=example_targets)
        db = open_profile(cluster, profile)
        with planning_mesh(cluster) as mesh:
            return plan_traced(
                traced,
                cluster,
                mesh=mesh,
                optimizer=optimizer,
                pins=pins,
                time_limit_s=time_limit_s,
                solver=solver,
                profile=db,
            )


def _plan_on_rank0(solve: Callable[[], Plan], *, device: torch.device) -> Plan:
    """Rank 0 runs ``solve``; every rank receives the same plan as JSON bytes (so all ranks run
    one plan), or the same :class:`PlanError`."""
    payload = b""
    if dist.get_rank() == 0:
        try:
            payload = json.dumps(solve().to_dict()).encode()
        except PlanError as exc:
            payload = json.dumps({"error": str(exc), "type": type(exc).__name__}).encode()
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if dist.get_rank() == 0:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buf, src=0)
    data = json.loads(buf.cpu().numpy().tobytes().decode())
    if "error" in data:
        raise getattr(errors, data["type"], PlanError)(data["error"])
    return Plan.from_dict(data)


def _runtime_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _parallelize_pipeline(
    model: torch.nn.Module,
    plan: Plan,
    inputs: tuple[torch.Tensor, ...],
    targets: tuple[torch.Tensor, ...],
    loss_fn: LossFn | None,
    device: torch.device,
) -> PipelineModel:
    """A plan made for a global batch: stages of one micro-batch's program, run by a
    ``torch.distributed.pipelining`` schedule (:mod:`autoplan.runtime.pipeline`). The program is
    the step in the plan's precision the planner traced (``prepare_for_precision``: for a bf16
    plan and an fp32 model, a bf16 copy, dropped once traced); ``model``'s own parameters are
    the ones trained (mixed precision: :mod:`autoplan.runtime.precision`)."""
    cfg, layout = plan.config, plan.pipeline
    assert cfg is not None and layout is not None
    check_model_precision(
        model, layout.precision, offload_optimizer=cfg.offload_optimizer, master_weights=layout.master_weights
    )
    step_model, inputs, targets = prepare_for_precision(model, inputs, targets, layout.precision)
    planned = trace_for_plan(plan, step_model, inputs, targets, loss_fn)  # in the plan's dtype already: no copy
    plan.check_applies_to(fingerprint=planned.fingerprint, world_size=dist.get_world_size())
    plan.check_fits(planned)
    traced, assignment = planned, plan.assignment()
    if layout.reduced:
        # placements of the program traced with fewer blocks: repeat its last block's
        # placements on every later block of the full program (autoplan.passes.expand)
        traced = trace_microbatch(step_model, inputs, targets, loss_fn, cfg.microbatch_size * cfg.dp)
        assignment = expand_assignment(
            assignment, (planned, find_layers(planned)), (traced, find_layers(traced)), block_list=layout.block_list
        )
    del step_model  # a converted copy is needed no longer
    layering = find_layers(traced)
    mesh = init_device_mesh(
        device.type, (cfg.pp, *layout.stage_mesh_shape), mesh_dim_names=("pp", *layout.stage_axis_names)
    )
    return build_pipeline(
        model,
        traced,
        assignment,
        layering,
        stage_starts=layout.stage_starts,
        mesh=mesh,
        axis_names=layout.stage_axis_names,
        schedule=cfg.pipeline_schedule,
        num_microbatches=cfg.num_microbatches,
        virtual_stages=cfg.virtual_stages,
        fallback_nodes=frozenset(plan.fallback_ops),
        device=device,
        optimizer=plan.optimizer,
        stage_recompute=layout.stage_recompute,
        offload_optimizer=cfg.offload_optimizer,
        sharded_grad_accumulation=cfg.sharded_grad_accumulation,
        plan=plan,
    )


BuiltModel = ParallelModel | PipelineModel
"""What :func:`parallelize` builds: a pipeline for a plan made for a global batch."""


_NOT_PLANNED = (
    "the model is not planned yet (parallelize() was called without example_inputs): call "
    "pmodel(inputs, targets=...) once before building the optimizer, or pass example_inputs= to parallelize"
)


class DeferredModel:
    """What :func:`parallelize` returns without ``example_inputs``: the model is planned and built
    at its first call, ``loss = pmodel(*inputs, targets=...)`` (or ``forward_backward``), with
    that call's global batch as the example; from then on every attribute is the built model's
    (the same parameter objects): a :class:`~autoplan.runtime.parallel.ParallelModel`, or a
    :class:`~autoplan.runtime.pipeline.PipelineModel` when planned with ``global_batch_size``.
    Before it, anything that needs the sharded model (``parameters()``, ``state_dict()``,
    ``data_loader()``, ...) raises :class:`PlanError`: the optimizer is built after the first call
    (one built over the original module's parameters is refused at its first ``step()``: they are
    not the ones trained).

    Type checks: ``pmodel.built`` is the built model itself (:class:`PlanError` before the first
    call): pass it where a ``ParallelModel`` or ``PipelineModel`` is expected. ``isinstance``
    answers as for the built model once it exists (``isinstance(pmodel, autoplan.PipelineModel)``,
    ``isinstance(pmodel, torch.nn.Module)``: ``__class__`` is the built model's, as
    ``unittest.mock`` objects made with a spec do), and ``isinstance(pmodel, DeferredModel)``
    stays true; before the first call only the latter holds: which model it becomes is decided by
    planning on that call's batch. ``type(pmodel)`` is always ``DeferredModel``."""

    def __init__(self, build: Callable[[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]], BuiltModel]) -> None:
        self._build = build
        """``(example_inputs, example_targets) -> the built model``: plans (rank 0) and applies."""
        self._built: BuiltModel | None = None
        self._planned: tuple[FieldSpec, ...] = ()
        """The first call's batch fields (inputs, then targets): what the model is planned for."""

    @property  # type: ignore[misc]  # isinstance() reads it: the built model's class once it exists
    def __class__(self) -> type:
        return type(self) if self._built is None else type(self._built)

    @property
    def built(self) -> BuiltModel:
        """The planned model (:class:`PlanError` before the first call)."""
        if self._built is None:
            raise PlanError(_NOT_PLANNED)
        return self._built

    def _built_for(self, inputs: tuple[torch.Tensor | LocalBatch, ...], targets: Sequence[torch.Tensor]) -> BuiltModel:
        """The built model; at the first call, plan and build it for this global batch."""
        if self._built is None:
            if any(isinstance(x, LocalBatch) for x in inputs):
                raise PlanError(
                    "a LocalBatch needs a plan (it comes from pmodel.data_loader): make the first call with a global "
                    "batch, pmodel(inputs, targets=...), or pass example_inputs= to parallelize"
                )
            self._built = self._build(cast(tuple[torch.Tensor, ...], inputs), tuple(targets))
            self._planned = tuple(
                (tuple(t.shape), t.dtype) for t in (*cast(tuple[torch.Tensor, ...], inputs), *targets)
            )
        elif not (len(inputs) == 1 and isinstance(inputs[0], LocalBatch)):
            fields = [*cast(tuple[torch.Tensor, ...], inputs), *targets]
            problem = batch_mismatch(self._planned, fields, num_inputs=len(inputs))
            if problem is not None:
                raise PlanMismatchError(
                    f"{problem} (the batch of the first call, which planned the model): the program runs only on "
                    "that batch shape and dtype; pad (or convert) the batch to it, or plan for this one: a new "
                    "autoplan.parallelize(...) planned at its first call on this batch, or example_inputs= of this shape"
                )
        return self._built

    def __call__(self, *inputs: torch.Tensor | LocalBatch, targets: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """``loss = pmodel(*inputs, targets=...)``: the first call plans on this batch, then every
        call is the built model's (:meth:`ParallelModel.forward`)."""
        return self._built_for(inputs, targets)(*inputs, targets=targets)

    def forward_backward(
        self, *inputs: torch.Tensor | LocalBatch, targets: Sequence[torch.Tensor] = (), check: bool = False
    ) -> torch.Tensor:
        """The built model's ``forward_backward``, planning at the first call like :meth:`__call__`
        (``check=True``: a ``ParallelModel``'s checked execution)."""
        built = self._built_for(inputs, targets)
        if not check:
            return built.forward_backward(*inputs, targets=targets)
        if not isinstance(built, ParallelModel):
            raise PlanError("check=True checks a ParallelModel's program; a pipeline has no checked mode: drop check=")
        return built.forward_backward(*inputs, targets=targets, check=True)

    def __getattr__(self, name: str) -> Any:
        """Every other attribute is the built model's; :class:`PlanError` before the first call."""
        if name.startswith("__") or name in (
            "_build",
            "_built",
            "_planned",
        ):  # copy/pickle protocols, a half-made object
            raise AttributeError(name)
        if self._built is None:  # hasattr() answers False, getattr(pmodel, name, default) the default
            raise NotPlannedError(f"pmodel.{name if name.isidentifier() else clip(name)}: {_NOT_PLANNED}")
        return getattr(self._built, name)


def _check_joint_options(
    *, plan: Plan | None, pins: Pins | None, global_batch_size: int | None, config: ParallelConfig | None
) -> None:
    """``global_batch_size`` (and ``config``) ask :func:`parallelize` for the joint search's plan:
    :class:`PlanError` for the options that do not go with it."""
    if config is not None and global_batch_size is None:
        raise ConfigError(
            "config= needs global_batch_size= (the configuration splits a global batch): pass both, or neither"
        )
    if global_batch_size is None:
        return
    if plan is not None:
        raise PlanError(
            "plan= and global_batch_size= both given: a plan made for a global batch holds it; pass one of them"
        )
    if pins:
        raise PlanError(
            "pins= fix placements of the per-operator plan; the joint search (global_batch_size=) takes none: "
            "drop pins or global_batch_size"
        )
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ConfigError(
            f"global_batch_size must be a positive integer (samples per optimizer step), got {global_batch_size!r}"
        )


def _check_batch_rows(inputs: Sequence[torch.Tensor], global_batch_size: int | None) -> None:
    """The example batch of a joint-search plan made in the job is the global batch the job trains on."""
    rows = int(inputs[0].shape[0]) if inputs and inputs[0].dim() else 0
    if global_batch_size is not None and rows != global_batch_size:
        raise PlanMismatchError(
            f"global_batch_size={global_batch_size} but the batch has {rows} samples: pass batches of "
            f"{global_batch_size} samples or parallelize with global_batch_size={rows}"
        )


def _check_job(cluster: Cluster | str | None, plan: Plan | None) -> Cluster:
    """The cluster the job runs on (the plan's, if given), checked against the process group."""
    if cluster is not None or plan is None:  # with a plan, the plan's cluster is used
        cluster = as_cluster(cluster)
    if not dist.is_initialized():
        raise PlanMismatchError(
            "parallelize() needs a process group: run under torchrun (autoplan run ...) "
            "or call torch.distributed.init_process_group first"
        )
    world = dist.get_world_size()
    if plan is not None:
        cluster = plan.cluster
    assert isinstance(cluster, Cluster)
    if world != cluster.world_size:
        raise PlanMismatchError(
            f"the job has {world} ranks but the {'plan' if plan else 'cluster'} is for {cluster.world_size} devices "
            f"({cluster}): launch with --nproc-per-node={cluster.world_size} or re-plan"
        )
    return cluster


@overload
def parallelize(
    model: torch.nn.Module,
    cluster: Cluster | str,
    *,
    example_inputs: Sequence[torch.Tensor],
    loss_fn: LossFn | None = None,
    example_targets: Sequence[torch.Tensor] = (),
    plan: Plan | None = None,
    optimizer: str = "adam",
    pins: Pins | None = None,
    profile: ProfileChoice = "auto",
    global_batch_size: int | None = None,
    config: ParallelConfig | None = None,
) -> ParallelModel | PipelineModel: ...


@overload
def parallelize(
    model: torch.nn.Module,
    cluster: Cluster | str,
    *,
    example_inputs: None = None,
    loss_fn: LossFn | None = None,
    example_targets: Sequence[torch.Tensor] = (),
    plan: None = None,
    optimizer: str = "adam",
    pins: Pins | None = None,
    profile: ProfileChoice = "auto",
    global_batch_size: int | None = None,
    config: ParallelConfig | None = None,
) -> DeferredModel: ...


def parallelize(
    model: torch.nn.Module,
    cluster: Cluster | str,
    *,
    example_inputs: Sequence[torch.Tensor] | None = None,
    loss_fn: LossFn | None = None,
    example_targets: Sequence[torch.Tensor] = (),
    plan: Plan | None = None,
    optimizer: str = "adam",
    pins: Pins | None = None,
    profile: ProfileChoice = "auto",
    global_batch_size: int | None = None,
    config: ParallelConfig | None = None,
) -> ParallelModel | PipelineModel | DeferredModel:
    """Apply ``plan`` (or plan now) to ``model`` inside a ``torchrun`` job.

    A plan made with a global batch (``plan.config`` set) runs as a pipeline of stages
    (:class:`~autoplan.runtime.pipeline.PipelineModel`, pipeline degree 1 included: micro-batches then
    accumulate gradients); ``example_inputs`` are then the global batch. Without a plan,
    ``global_batch_size`` (and ``config`` to fix the configuration) makes rank 0 plan with the
    joint search as :func:`plan` does, for a global batch of that many samples (the example batch
    must hold them), and the result is such a pipeline; otherwise rank 0 solves the per-operator
    plan (``pins`` apply) and the result is a :class:`~autoplan.runtime.parallel.ParallelModel`.

    Every rank must build the same model with the same weights. Returns a
    :class:`~autoplan.runtime.parallel.ParallelModel` whose parameters are DTensors in the planned
    placements and whose ``program`` is the generated per-rank step.

    Without ``example_inputs`` (and without a plan) planning waits for the first batch: the
    returned :class:`DeferredModel` plans and builds at its first call, so the order is *first
    call, then optimizer*::

        pmodel = autoplan.parallelize(model, cluster, loss_fn=loss_fn)   # or global_batch_size=1024
        loss = pmodel(ids, targets=(labels,))      # plans on this global batch, then runs the step
        opt = torch.optim.AdamW(pmodel.parameters(), lr=3e-4)
        loss.backward(); opt.step(); opt.zero_grad()

    Before that call ``parameters()``, ``state_dict()``, ``data_loader()`` and the rest raise
    :class:`PlanError`; after it ``pmodel.built`` is the ``ParallelModel`` or ``PipelineModel``
    (:class:`DeferredModel` says how ``isinstance`` answers).

    The parallelized model trains sharded copies of ``model``'s parameters: an optimizer built
    over ``model.parameters()`` (before this call or before a deferred model's first call) would
    step nothing, so its first ``step()`` raises :class:`PlanError` naming the fix
    (:func:`~autoplan.runtime.optimizers.refuse_optimizers_of_the_module`).
    """
    _check_joint_options(plan=plan, pins=pins, global_batch_size=global_batch_size, config=config)
    if example_inputs is None:
        if plan is not None or example_targets:
            raise PlanError(
                f"{'a plan' if plan is not None else 'example_targets'} without example_inputs: pass example_inputs= "
                "(a plan's program is traced from them), or neither, to plan at the first call pmodel(inputs, targets=...)"
            )
        job_cluster = _check_job(cluster, None)
        _check_optimizer(optimizer)
        build = functools.partial(
            _parallelize_now, model, job_cluster, loss_fn=loss_fn, optimizer=optimizer, pins=pins, profile=profile,
            global_batch_size=global_batch_size, config=config,
        )  # fmt: skip
        return DeferredModel(build)
    cluster = _check_job(cluster, plan)
    device = _runtime_device()
    model = model.to(device)
    inputs = tuple(t.to(device) for t in example_inputs)
    targets = tuple(t.to(device) for t in example_targets)
    if plan is None and global_batch_size is not None:
        _check_optimizer(optimizer)
        _check_batch_rows(inputs, global_batch_size)
        plan = _plan_on_rank0(
            lambda: _plan_alone(
                model, cluster, inputs, targets, loss_fn=loss_fn, optimizer=optimizer, profile=profile,
                global_batch_size=global_batch_size, config=config,
            ),
            device=device,
        )  # fmt: skip
    built: BuiltModel
    if plan is not None and plan.config is not None:
        built = _parallelize_pipeline(model, plan, inputs, targets, loss_fn, device)
    else:
        built = _parallelize_operators(
            model, cluster, plan, inputs, targets, loss_fn=loss_fn, optimizer=optimizer, pins=pins, profile=profile,
            device=device,
        )  # fmt: skip
    refuse_optimizers_of_the_module(model, built)  # an optimizer over model's own parameters would step nothing
    return built


def _plan_alone(
    model: torch.nn.Module,
    cluster: Cluster,
    inputs: tuple[torch.Tensor, ...],
    targets: tuple[torch.Tensor, ...],
    **kwargs: Any,
) -> Plan:
    """:func:`plan` on this rank alone inside the job (:func:`~autoplan.planner.mesh.planning_alone`:
    the joint search's stage meshes need no process group)."""
    with planning_alone():
        return plan(model, cluster, example_inputs=inputs, example_targets=targets, **kwargs)


def _parallelize_operators(
    model: torch.nn.Module,
    cluster: Cluster,
    plan: Plan | None,
    inputs: tuple[torch.Tensor, ...],
    targets: tuple[torch.Tensor, ...],
    *,
    loss_fn: LossFn | None,
    optimizer: str,
    pins: Pins | None,
    profile: ProfileChoice,
    device: torch.device,
) -> ParallelModel:
    """A per-operator plan (``None``: rank 0 solves it now) applied: the generated program of the
    whole step on the job's mesh."""
    traced = trace_training_step(model, inputs, loss_fn=loss_fn, example_targets=targets)
    mesh = init_device_mesh(device.type, cluster.mesh_shape, mesh_dim_names=cluster.mesh_axis_names)
    if plan is None:
        _check_optimizer(optimizer)
        plan = _plan_on_rank0(
            lambda: plan_traced(
                traced, cluster, mesh=mesh, optimizer=optimizer, pins=pins, profile=open_profile(cluster, profile)
            ),
            device=device,
        )
    plan.check_applies_to(fingerprint=traced.fingerprint, world_size=dist.get_world_size())
    plan.check_fits(traced)
    program = generate_program(
        traced,
        plan.assignment(),
        fallback_nodes=frozenset(plan.fallback_ops),
        axis_names=cluster.mesh_axis_names,
        device=device,
        mesh=mesh,
    )
    return ParallelModel(model=model, traced=traced, plan=plan, program=program, mesh=mesh, device=device)


def _parallelize_now(
    model: torch.nn.Module,
    cluster: Cluster,
    inputs: tuple[torch.Tensor, ...],
    targets: tuple[torch.Tensor, ...],
    **kwargs: Any,
) -> BuiltModel:
    """A :class:`DeferredModel`'s first call: plan and apply with its batch as the example."""
    return parallelize(model, cluster, example_inputs=inputs, example_targets=targets, **kwargs)


__all__ = ["DeferredModel", "estimate", "parallelize", "plan"]
