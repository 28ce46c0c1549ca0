"""RMS normalisation as one operator: ``autoplan::rms_norm`` and its backward, with DTensor strategies.

Hugging Face's ``LlamaRMSNorm`` (and every RMSNorm copied from it: Mistral, Qwen2/3, Mixtral, ...)
is written out in PyTorch ops, so a traced step holds it decomposed, and autograd saves what the
decomposition's backward reads: the fp32 copy of the input ``h`` (4 B per element), the normalised
value rounded to the input dtype ``n`` (the weight's gradient, 2 B in bf16) and the per-row
``rstd``. A fused kernel (Transformer Engine under Megatron/NeMo, apex's ``FusedRMSNorm``, what
``torch.compile`` generates) saves the input in its own dtype and ``rstd`` only: 4 B per element
less per norm, 8 B per token-hidden element per Llama block (two norms). Pricing the decomposed
form put published Megatron/NeMo runs 14-40 % above their measured memory (issue #41 item 3).

During tracing, :func:`norms_as_single_op` routes those modules' forward to ``autoplan::rms_norm``
(backward ``autoplan::rms_norm_backward``), whose kernels compute exactly the module's math::

    h = x.float();  rstd = rsqrt(mean(h^2, -1, keepdim) + eps)       (..., 1) fp32, saved with x
    z = h * rstd
    y = weight * z.to(x.dtype)            Hugging Face    (weight_in_fp32=False)
    y = (z * weight).to(x.dtype)          torch.nn.RMSNorm (weight_in_fp32=True: torch's own kernel)

    backward (z recomputed from x and rstd; g = the gradient reaching z, D = x.shape[-1]):
    grad_h = g * rstd + (sum(g * h, -1) * -0.5 * rstd^3 / D) * 2h      (autograd's order of ops)

The forward is bit-identical to the module's, the backward equal up to fp32 rounding (the same
ops as autograd of the decomposition, in the same order). Routed: the classes of an imported
``transformers.models.*`` module whose name ends in ``RMSNorm`` and whose ``forward`` is Llama's
(compared as syntax trees: a copy with other comments is the same; Gemma's ``(1 + weight)`` is
not), and ``torch.nn.RMSNorm`` over one dim with a weight. A norm without a weight, over several
dims, or of another class is traced as it is.

Strategies on one mesh axis (``y``/``rstd`` outputs, ``x``/``weight`` inputs; ``d`` any dim of
``x`` but the last, the normalised one)::

    forward   y, rstd, x = R,    weight R           backward  grad_x, x, rstd, grad_y = R, grad_w R
              y, rstd, x = S(d), weight R                     grad_x, x, rstd, grad_y = S(d), grad_w P

(the weight's gradient sums over rows, so a split row dim leaves each rank a partial sum). FLOPs
are ``aten._fused_rms_norm``'s (``cost_models/compute.py``); bytes the default, each tensor read
or written once, which is the fused kernel's traffic: a memory-bound op that ``selective``
recomputation re-runs (:mod:`autoplan.passes.recompute`).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, RuntimeSchemaInfo
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

# --------------------------------------------------------------------------------------------
# The ops


def _normalised(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``h = x.float()``, ``rstd`` (..., 1) and ``z = h * rstd``, as Hugging Face computes them."""
    h = x.to(torch.float32)
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h, rstd, h * rstd


def _output_dtype(x: torch.Tensor, weight: torch.Tensor, weight_in_fp32: bool) -> torch.dtype:
    return x.dtype if weight_in_fp32 else torch.promote_types(weight.dtype, x.dtype)


@torch.library.custom_op("autoplan::rms_norm", mutates_args=())
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)``: the normalised ``x`` (..., D) times ``weight`` (D,) and the per-row
    ``rstd`` (..., 1) fp32 (module docstring)."""
    _, rstd, z = _normalised(x, eps)
    y = (z * weight).to(x.dtype) if weight_in_fp32 else weight * z.to(x.dtype)
    return y.contiguous(), rstd


@rms_norm.register_fake
def _rms_norm_fake(x, weight, eps, weight_in_fp32):  # noqa: ANN001, ANN202
    y = x.new_empty(x.shape, dtype=_output_dtype(x, weight, weight_in_fp32))
    return y, x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.custom_op("autoplan::rms_norm_backward", mutates_args=())
def rms_norm_backward(
    grad_y: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, weight_in_fp32: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_x, grad_weight)`` from ``x`` and the forward's ``rstd`` (``z`` recomputed), with the
    ops autograd runs for the decomposed module, in its order (module docstring)."""
    h = x.to(torch.float32)
    z = h * rstd
    rows = tuple(range(x.dim() - 1))  # the weight's gradient sums over every leading dim
    if weight_in_fp32:  # y = (z * w).to(dtype)
        g = grad_y.to(torch.float32)
        grad_w = (g * z).sum(rows).to(weight.dtype)
        grad_z = g * weight
    else:  # y = w * n, n = z.to(dtype)
        grad_w = (grad_y * z.to(x.dtype)).sum(rows).to(weight.dtype)
        grad_z = (grad_y * weight).to(x.dtype).to(torch.float32)
    grad_var = (grad_z * h).sum(-1, keepdim=True) * -0.5 * rstd.pow(3)  # through rsqrt(var + eps)
    grad_h = grad_z * rstd + grad_var / x.shape[-1] * (h * 2.0)  # through z = h * rstd, var = mean(h^2)
    return grad_h.to(x.dtype).contiguous(), grad_w.contiguous()


@rms_norm_backward.register_fake
def _rms_norm_backward_fake(grad_y, x, rstd, weight, weight_in_fp32):  # noqa: ANN001, ANN202
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    x, weight, _eps, weight_in_fp32 = inputs
    _y, rstd = output
    ctx.save_for_backward(x, rstd, weight)  # what a fused kernel keeps: the input and rstd
    ctx.mark_non_differentiable(rstd)
    ctx.weight_in_fp32 = weight_in_fp32


def _backward(ctx, grad_y, _grad_rstd):  # noqa: ANN001, ANN202
    x, rstd, weight = ctx.saved_tensors
    grad_x, grad_w = torch.ops.autoplan.rms_norm_backward(grad_y, x, rstd, weight, ctx.weight_in_fp32)
    return grad_x, grad_w, None, None


rms_norm.register_autograd(_backward, setup_context=_setup_context)

NORM_OPS = frozenset({torch.ops.autoplan.rms_norm.default, torch.ops.autoplan.rms_norm_backward.default})


# --------------------------------------------------------------------------------------------
# Routing the modules to the op while tracing


def _routed_torch_forward(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``torch.nn.RMSNorm.forward`` through the op where it normalises one dim with a weight."""

    def forward(module: torch.nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
        weight = module.weight
        if weight is None or len(module.normalized_shape) != 1 or not x.is_floating_point():
            return original(module, x)
        eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
        y, _ = torch.ops.autoplan.rms_norm(x, weight, float(eps), True)
        return y

    return forward


def _forward_tree(fn: object) -> str | None:
    """``fn``'s body as a syntax tree dump, docstring left out (``None``: no source)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))  # type: ignore[arg-type]
    except (OSError, TypeError, SyntaxError):
        return None
    func = tree.body[0]
    if not isinstance(func, ast.FunctionDef):
        return None
    body = func.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return ast.dump(ast.Module(body=body, type_ignores=[]))


@functools.cache
def _is_llama_forward(fn: Callable[..., Any]) -> bool:
    """``fn`` computes Hugging Face ``LlamaRMSNorm``'s forward (the same statements)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return fn is LlamaRMSNorm.forward or _forward_tree(fn) == _forward_tree(LlamaRMSNorm.forward)


def hf_rms_norm_classes() -> list[type[torch.nn.Module]]:
    """The RMSNorm classes of imported ``transformers.models`` modules that define Llama's forward
    (a subclass inheriting it is covered by its parent)."""
    if "transformers" not in sys.modules:
        return []
    found = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers.models.") or module is None:
            continue
        for cls in list(vars(module).values()):
            if (
                isinstance(cls, type)
                and issubclass(cls, torch.nn.Module)
                and cls.__name__.endswith("RMSNorm")
                and cls.__module__ == name
                and "forward" in vars(cls)
                and _is_llama_forward(vars(cls)["forward"])
            ):
                found.append(cls)
    return found


def _routed_hf_forward(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def forward(module: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
        if args or kwargs or not isinstance(weight, torch.Tensor) or not isinstance(eps, (float, int)):
            return original(module, hidden_states, *args, **kwargs)
        y, _ = torch.ops.autoplan.rms_norm(hidden_states, weight, float(eps), False)
        return y

    return forward


@contextlib.contextmanager
def norms_as_single_op() -> Iterator[None]:
    """Route Hugging Face's Llama-style RMSNorm modules and ``torch.nn.RMSNorm`` to
    ``autoplan::rms_norm`` while tracing (every patched ``forward`` restored on exit)."""
    originals: dict[type[torch.nn.Module], Callable[..., torch.Tensor]] = {
        cls: vars(cls)["forward"] for cls in hf_rms_norm_classes()
    }
    originals[torch.nn.RMSNorm] = torch.nn.RMSNorm.forward
    try:
        for cls, original in originals.items():
            routed = _routed_torch_forward(original) if cls is torch.nn.RMSNorm else _routed_hf_forward(original)
            cls.forward = routed
        yield
    finally:
        for cls, original in originals.items():
            cls.forward = original


# --------------------------------------------------------------------------------------------
# DTensor strategies: replicated, or split on any dim but the normalised (last) one


def _rows(*, ndim: int, backward: bool) -> list[list[Placement | None]]:
    """Rows of (outputs, inputs) placements on one mesh axis (module docstring)."""
    if backward:  # grad_x, grad_w; grad_y, x, rstd, weight
        rows: list[list[Placement | None]] = [[Replicate()] * 6]
        rows += [[Shard(d), Partial(), Shard(d), Shard(d), Shard(d), Replicate()] for d in range(ndim - 1)]
        return rows
    rows = [[Replicate()] * 4]  # y, rstd; x, weight
    rows += [[Shard(d), Shard(d), Shard(d), Replicate()] for d in range(ndim - 1)]
    return rows


def _strategy(op_schema: OpSchema, *, backward: bool) -> OpStrategy:
    mesh = op_schema.get_mesh_from_args()
    x = op_schema.args_schema[1 if backward else 0]
    assert isinstance(x, OpStrategy)
    return expand_to_full_mesh_op_strategy(mesh, op_schema, _rows(ndim=x.ndim, backward=backward), input_index=2)


_PROP = DTensor._op_dispatcher.sharding_propagator
_PROP.register_op_strategy(
    torch.ops.autoplan.rms_norm.default,
    functools.partial(_strategy, backward=False),
    schema_info=RuntimeSchemaInfo(2),
)
_PROP.register_op_strategy(
    torch.ops.autoplan.rms_norm_backward.default,
    functools.partial(_strategy, backward=True),
    schema_info=RuntimeSchemaInfo(4),
)
