"""Mixed precision: fp32 master parameters, a step computed in the plan's precision.

A plan made for a global batch with ``precision="bf16"`` (``plan.pipeline.precision``) is the
training step of the model converted to bf16 (:func:`autoplan.planner.tracing.prepare_for_precision`:
parameters, buffers, floating inputs and targets in bf16), and the cost model prices it per
trained parameter element as mixed precision (:func:`autoplan.cost_models.memory.precision_bytes`,
:func:`autoplan.cost_models.memory.stage_memory_parts`, :mod:`autoplan.cost_models.step`)::

    weights    W = 2 B     the bf16 copy the step reads (ZeRO-3: this rank's shard, all-gathered in bf16)
    gradients  G = 2 B     the step's gradients, reduced (all-reduce / reduce-scatter) in bf16
    optimizer  O = 4 B x states + 4 B    fp32 optimizer states (Adam: 2) + the fp32 master weights

What runs, for a model given in fp32 (FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` with the
gradients reduced in bf16, the dtype the step model prices them in):

* the parallel model's parameters are the model's own, fp32: the master weights (the 4 B of ``O``);
  the optimizer steps them, ``state_dict()`` and checkpoints hold them;
* at the step's first program call each stage casts its parameters' local shards to the dtype
  the program reads them in (:func:`compute_shards`; ``W``); the copies are dropped when the
  step's backward is done, before the gradients are converted, so they never coexist with the
  fp32 gradients (at the optimizer step the priced ``W + G = 2 + 2`` B is held as ``0 + 4``);
* the program computes in bf16; its gradients come out bf16, are summed over micro-batches and
  reduced in bf16, as priced; each reduced gradient is then cast to its parameter's dtype
  (:func:`grad_in_param_dtype`, fp32) and the micro-batch average is taken in fp32; ``.grad``
  holds fp32 DTensors in the parameter's placement (a parameter tied across pipeline stages sums
  its copies' gradients after the cast, in fp32: a transfer the step model does not price);
* buffers are cast once, when the stages are built, to the dtype the program reads them in;
  floating inputs and targets are cast when the step starts (:func:`cast_batch`);
* the loss is computed in bf16 (in the program) and returned as fp32 (the micro-batch mean).

A model already in bf16 runs as it always has: the program reads its parameters as they are, the
gradients and the optimizer state are bf16 and there is no master copy, and the plan is priced so
(``O = 2 B x states``: :func:`autoplan.cost_models.memory.keeps_master_weights`, recorded as
``plan.pipeline.master_weights = False``; such a plan refuses an fp32 model, whose masters it did
not price). A parameter may also be
kept in bf16 while others are fp32 (a frozen base model under fp32 adapters): it is read as it is
and its gradient stays bf16. :func:`check_model_precision` refuses the other combinations.

Not priced as run: a frozen parameter kept in fp32 holds 4 B plus its 2 B copy during the step
(priced 2 B); the casts (6 B of memory traffic per element each way) are priced only as the
optimizer step's ``precision_opt_factor``. Plans made without a global batch carry no precision:
their step is traced in the model's own dtype, and :class:`~autoplan.runtime.parallel.ParallelModel`
runs it as it is (``autoplan.plan`` refuses ``precision=`` without ``global_batch_size``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor

from autoplan.cost_models.errors import PlanMismatchError
from autoplan.passes.trace import TracedProgram
from autoplan.planner.tracing import torch_dtype

MASTER_DTYPE = torch.float32
"""The dtype of the master weights a mixed-precision step updates."""


def _precision_of(dtype: torch.dtype) -> str | None:
    """The plan precision that computes in ``dtype`` (``None``: none does)."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)


def check_model_precision(
    model: torch.nn.Module, precision: str, *, offload_optimizer: bool, master_weights: bool = True
) -> None:
    """Raises :class:`PlanMismatchError` unless ``model``'s floating-point parameters can run a plan
    made in ``precision``: every parameter in the plan's dtype, or (``bf16`` only) in fp32, the
    master weights of a bf16 step. fp16 with fp32 masters would need loss scaling, which the
    runtime does not run. With ``offload_optimizer`` the plan keeps bf16 weights on the device and
    the fp32 masters in the optimizer's host memory, so a trained fp32 parameter is refused. A
    plan priced without master weights (``master_weights=False``: made for the model in bf16,
    ``PipelineLayout.master_weights``) refuses a trained fp32 parameter too: its masters and fp32
    states would hold 8 B per element (Adam) more than the plan priced."""
    dtype = torch_dtype(precision)
    allowed = (dtype, MASTER_DTYPE) if precision == "bf16" else (dtype,)
    for name, p in model.named_parameters():
        if not p.is_floating_point() or p.dtype == dtype:
            continue
        if p.dtype not in allowed:
            raise PlanMismatchError(
                f"parameter {name!r} is {p.dtype} but the plan computes in {precision}: {_fix(p.dtype, precision)}"
            )
        if not master_weights and p.requires_grad:
            raise PlanMismatchError(
                f"parameter {name!r} is {p.dtype} but the plan was made for the model in {precision}, priced without "
                f"fp32 master weights: convert the model with model.to(torch.{str(dtype).removeprefix('torch.')}), "
                f"or re-plan with the model in {p.dtype} (fp32 master weights, priced)"
            )
        if offload_optimizer and p.requires_grad:
            raise PlanMismatchError(
                f"parameter {name!r} is {p.dtype} but the plan offloads the optimizer with {precision} weights on the "
                f"device and their fp32 master copies in host memory: convert the model with "
                f"model.to(torch.{str(dtype).removeprefix('torch.')}) (the offloaded optimizer keeps the fp32 masters) "
                "or re-plan without offload_optimizer"
            )


def _fix(param_dtype: torch.dtype, precision: str) -> str:
    """What to change when a parameter of ``param_dtype`` cannot run a ``precision`` plan."""
    own = _precision_of(param_dtype)
    replan = f", or re-plan with precision={own!r}" if own is not None else ""
    if precision == "bf16":
        return f"give the model in float32 (model.float(): fp32 master weights, bf16 compute) or in bfloat16{replan}"
    if precision == "fp16":
        return (
            "fp16 with fp32 master weights needs loss scaling, which autoplan does not run: re-plan with "
            "precision='bf16' (fp32 master weights, bf16 compute), or convert the model with model.half()"
        )
    return f"convert the model with model.float(){replan}"


def program_dtypes(traced: TracedProgram) -> dict[str, torch.dtype]:
    """FQN -> the dtype the traced step reads each parameter and buffer in (its placeholder's)."""
    placeholders = [n for n in traced.graph_module.graph.nodes if n.op == "placeholder"]
    names = (*traced.param_names, *traced.buffer_names)
    return {fqn: node.meta["val"].dtype for fqn, node in zip(names, placeholders, strict=False)}


def compute_shards(params: Sequence[torch.nn.Parameter], dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    """Each parameter's local shard, detached, in the dtype the program reads it in (a cast copy;
    the shard itself where the dtypes agree)."""
    out = []
    for p, dtype in zip(params, dtypes, strict=True):
        local = p.to_local() if isinstance(p, DTensor) else p
        out.append(local.detach().to(dtype))
    return out


def grad_in_param_dtype(local: torch.Tensor, dtype: torch.dtype, divide_by: int) -> torch.Tensor:
    """A reduced local gradient (summed over ``divide_by`` micro-batches) in its parameter's
    ``dtype``, divided by ``divide_by`` after the cast (in the parameter's precision)."""
    cast = local.to(dtype)
    if divide_by == 1:
        return cast
    return cast.div_(divide_by) if cast is not local else cast / divide_by


def cast_batch(fields: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]) -> tuple[torch.Tensor, ...]:
    """Floating batch fields in the dtypes the program reads them in (the others as they are;
    fields past ``dtypes`` untouched)."""
    return tuple(
        t.to(dtypes[i]) if i < len(dtypes) and t.is_floating_point() and dtypes[i].is_floating_point else t
        for i, t in enumerate(fields)
    )


__all__ = [
    "MASTER_DTYPE",
    "cast_batch",
    "check_model_precision",
    "compute_shards",
    "grad_in_param_dtype",
    "program_dtypes",
]
