"""Tracing the training step the planner prices and plans: one micro-batch of a given size
(:func:`trace_microbatch`), with the repeated blocks reduced to the first few
(:func:`trace_repeated`, :mod:`autoplan.passes.depth`), the step a global-batch plan was made for
(:func:`trace_for_plan`) and its forward fingerprint (:func:`plan_forward_fingerprint`, what the
plan cache checks a hit with); the model and inputs in the planned precision
(:func:`prepare_for_precision`)."""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Sequence
from typing import Any, cast

import torch

from autoplan.cost_models.config import PRECISIONS
from autoplan.cost_models.errors import ConfigError, PlanMismatchError
from autoplan.cost_models.step import precision_dtype
from autoplan.passes import pass_order
from autoplan.passes.depth import KEPT_BLOCKS
from autoplan.passes.layers import Layering
from autoplan.passes.trace import LossFn, TracedProgram, forward_fingerprint
from autoplan.planner.plan import Plan


def torch_dtype(precision: str) -> torch.dtype:
    """The dtype a step planned in ``precision`` computes in (``bf16`` -> ``torch.bfloat16``)."""
    if precision not in PRECISIONS:
        raise ConfigError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    return cast(torch.dtype, getattr(torch, precision_dtype(precision)))


def with_batch(t: torch.Tensor, batch: int) -> torch.Tensor:
    if t.dim() == 0:
        raise ConfigError("example inputs need a batch dimension (dim 0) to split into micro-batches")
    if t.device.type == "meta":
        return torch.empty((batch, *t.shape[1:]), dtype=t.dtype, device="meta")
    reps = math.ceil(batch / t.shape[0])
    return t.repeat(reps, *([1] * (t.dim() - 1)))[:batch].contiguous()


def trace_microbatch(
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    loss_fn: LossFn | None,
    batch: int,
) -> TracedProgram:
    """The training step of one micro-batch of ``batch`` samples (inputs resized along dim 0)."""
    return pass_order.TRACE(
        model,
        tuple(with_batch(t, batch) for t in inputs),
        loss_fn=loss_fn,
        example_targets=tuple(with_batch(t, batch) for t in targets),
    )


def trace_repeated(
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    loss_fn: LossFn | None,
    batch: int,
    *,
    reduce: bool = True,
) -> tuple[TracedProgram, Layering, int]:
    """One micro-batch's step traced with the first :data:`~autoplan.passes.depth.KEPT_BLOCKS` repeated
    blocks (``reduce``; :mod:`autoplan.passes.depth`), its layering, and the model's real number of
    blocks. Falls back to the full depth when the layering does not see the kept blocks."""
    reduced = pass_order.DEPTH(model, KEPT_BLOCKS if reduce else sys.maxsize)
    traced = trace_microbatch(reduced.module, inputs, targets, loss_fn, batch)
    layering = pass_order.LAYERS(traced)
    if reduced.reduced and layering.num_blocks == reduced.kept:
        return traced, layering, reduced.num_blocks
    if reduced.reduced:  # blocks not where the layering sees them: full depth
        traced = trace_microbatch(model, inputs, targets, loss_fn, batch)
        layering = pass_order.LAYERS(traced)
    return traced, layering, layering.num_blocks


def trace_for_plan(
    plan: Plan,
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    loss_fn: LossFn | None,
) -> TracedProgram:
    """The micro-batch step a plan made for a global batch applies to, in the plan's precision
    (:func:`prepare_for_precision`: a bf16 plan of an fp32 model traces a bf16 copy) and with the
    plan's number of blocks when it was planned on fewer (:mod:`autoplan.passes.depth`);
    ``inputs`` must be that global batch (:class:`PlanMismatchError` otherwise)."""
    layout = plan.pipeline
    assert layout is not None
    batch = int(inputs[0].shape[0]) if inputs and inputs[0].dim() else 0
    if batch != layout.global_batch_size:
        raise PlanMismatchError(
            f"the plan is for a global batch of {layout.global_batch_size} but the inputs have {batch} samples: "
            f"pass a global batch of {layout.global_batch_size} or re-plan with --global-batch-size {batch}"
        )
    model, inputs, targets = prepare_for_precision(model, inputs, targets, layout.precision)
    return _trace_planned_step(plan, model, inputs, targets, loss_fn)


def _planned_step(plan: Plan, model: torch.nn.Module) -> tuple[torch.nn.Module, int]:
    """The model and micro-batch size of the step a global-batch plan's placements are for: one
    stage program's ``dp * microbatch_size`` samples, with the plan's number of blocks when it
    was planned on fewer (:mod:`autoplan.passes.depth`)."""
    cfg, layout = plan.config, plan.pipeline
    assert cfg is not None and layout is not None
    if layout.reduced:
        model = pass_order.DEPTH(model, layout.traced_blocks).module
    return model, cfg.microbatch_size * cfg.dp


def _trace_planned_step(
    plan: Plan,
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    loss_fn: LossFn | None,
) -> TracedProgram:
    """The step a global-batch plan is for, traced (``inputs`` resized to its micro-batch)."""
    model, batch = _planned_step(plan, model)
    return trace_microbatch(model, inputs, targets, loss_fn, batch)


def plan_forward_fingerprint(
    plan: Plan,
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    loss_fn: LossFn | None,
) -> str:
    """:func:`autoplan.passes.trace.forward_fingerprint` of the step a global-batch plan is for: what the
    plan cache checks a hit with (an export, without the backward graph a full trace builds)."""
    model, batch = _planned_step(plan, model)
    return forward_fingerprint(
        model,
        tuple(with_batch(t, batch) for t in inputs),
        loss_fn=loss_fn,
        example_targets=tuple(with_batch(t, batch) for t in targets),
    )


def prepare_for_precision(
    model: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    example_targets: Sequence[torch.Tensor],
    precision: str,
) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The model and batch of the step a plan made in ``precision`` is for: ``model`` itself when
    its floating-point parameters already have that dtype, else a copy converted as
    ``copy.deepcopy(model).to(dtype)`` converts it (the user's model is left as it is); floating
    inputs and targets cast to the dtype. The planner traces and prices this step, and
    ``autoplan.parallelize`` traces it again to run it (:mod:`autoplan.runtime.precision`).

    The copy's parameters are made in ``dtype`` directly (no full-precision duplicate of the
    model is allocated); ``.to(dtype)`` then converts the buffers as it always has."""
    dtype = torch_dtype(precision)
    if not example_inputs:
        raise ConfigError("example_inputs is empty: pass one example batch (its per-sample shapes are used)")
    if precision != "fp32" and any(p.dtype != dtype for p in model.parameters() if p.is_floating_point()):
        memo: dict[int, Any] = {
            id(p): torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            for p in model.parameters()
            if p.is_floating_point()
        }
        model = copy.deepcopy(model, memo).to(dtype)

    def cast_floating(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    return model, tuple(cast_floating(t) for t in example_inputs), tuple(cast_floating(t) for t in example_targets)
