"""Attention as one operator: ``autoplan::sdpa`` and its backward, with DTensor strategies.

PyTorch lowers ``F.scaled_dot_product_attention`` to device-specific fused kernels (different on
meta, CPU and CUDA) or, in its math form, to ``bmm`` on ``(B*H, T, D)`` views. The flattened
form cannot keep the heads sharded (a view of ``(B, H)`` into ``B*H`` with ``H`` split is not a
plain shard), so tensor parallelism could not split attention by heads.

During tracing, :func:`attention_as_single_op` routes ``F.scaled_dot_product_attention`` to the
custom op ``autoplan::sdpa`` (and its backward ``autoplan::sdpa_backward``): the graph is the
same on every device, and the ops carry DTensor strategies that shard the batch dim (data
parallel) or the heads dim (tensor parallel, grouped-query attention included when the key/value
heads divide evenly). At run time each shard calls PyTorch's own fused attention on its heads.

FLOPs (queries T, keys S, head dim D, per batch element and head)::

    forward  = 4 * T * S * D          (Q K^T and P V, one multiply-add each)
    backward = 4 * T * S * D  (recomputed forward) + 8 * T * S * D  (dQ, dK, dV, dP)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, RuntimeSchemaInfo
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

from cost_models.compute import register_flops

_TORCH_SDPA = F.scaled_dot_product_attention


@torch.library.custom_op("autoplan::sdpa", mutates_args=())
def sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    out = _TORCH_SDPA(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )
    return out.contiguous()


@sdpa.register_fake
def _sdpa_fake(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):  # noqa: ANN001, ANN202
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


@torch.library.custom_op("autoplan::sdpa_backward", mutates_args=())
def sdpa_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Explicit formulas (a kernel runs below autograd, so it cannot call torch.autograd):
    #   S = scale * Q K^T (+ mask), P = softmax(S), O = P V
    #   dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dP * P)), dQ = scale * dS K, dK = scale * dS^T Q
    groups = query.shape[-3] // key.shape[-3] if enable_gqa else 1
    k = key.repeat_interleave(groups, dim=-3) if groups > 1 else key
    v = value.repeat_interleave(groups, dim=-3) if groups > 1 else value
    scale_f = scale if scale is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, k.transpose(-2, -1)) * scale_f
    t, s = scores.shape[-2], scores.shape[-1]
    if is_causal:
        keep = torch.ones(t, s, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    probs = torch.softmax(scores, dim=-1)
    dv = torch.matmul(probs.transpose(-2, -1), grad_out)
    dprobs = torch.matmul(grad_out, v.transpose(-2, -1))
    dscores = probs * (dprobs - (dprobs * probs).sum(dim=-1, keepdim=True))
    dq = torch.matmul(dscores, k) * scale_f
    dk = torch.matmul(dscores.transpose(-2, -1), query) * scale_f
    if groups > 1:
        dk = dk.unflatten(-3, (key.shape[-3], groups)).sum(dim=-3)
        dv = dv.unflatten(-3, (value.shape[-3], groups)).sum(dim=-3)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@sdpa_backward.register_fake
def _sdpa_backward_fake(grad_out, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):  # noqa: ANN001, ANN202
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa = inputs
    ctx.save_for_backward(query, key, value, attn_mask)
    ctx.params = (dropout_p, is_causal, scale, enable_gqa)


def _backward(ctx, grad_out):  # noqa: ANN001, ANN202
    query, key, value, attn_mask = ctx.saved_tensors
    dq, dk, dv = torch.ops.autoplan.sdpa_backward(grad_out, query, key, value, attn_mask, *ctx.params)
    return dq, dk, dv, None, None, None, None, None


sdpa.register_autograd(_backward, setup_context=_setup_context)


def _routed_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    return torch.ops.autoplan.sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


@contextlib.contextmanager
def attention_as_single_op() -> Iterator[None]:
    """Route ``F.scaled_dot_product_attention`` to ``autoplan::sdpa`` (restored on exit)."""
    F.scaled_dot_product_attention = _routed_sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = _TORCH_SDPA


# --------------------------------------------------------------------------------------------
# DTensor strategies: replicate, shard the batch (dim 0), or shard the heads (dim 1)


def _mask_placement(mask: object, dim: int) -> Placement:
    """A mask broadcast along ``dim`` (size 1) stays replicated; otherwise it is split like q."""
    assert isinstance(mask, OpStrategy)
    return Shard(dim) if mask.shape[dim] > 1 else Replicate()


def _single_dim_strategies(num_outputs: int, num_qkv_like: int, mask: object) -> list[list[Placement | None]]:
    width = num_outputs + num_qkv_like
    strategies: list[list[Placement | None]] = [[Replicate()] * (width + (mask is not None))]
    for dim in (0, 1):
        row: list[Placement | None] = [Shard(dim)] * width
        if mask is not None:
            row.append(_mask_placement(mask, dim))
        strategies.append(row)
    return strategies


def _sdpa_strategy(op_schema: OpSchema) -> OpStrategy:
    mesh = op_schema.get_mesh_from_args()
    mask = op_schema.args_schema[3]
    strategies = _single_dim_strategies(1, 3, mask)
    return expand_to_full_mesh_op_strategy(mesh, op_schema, strategies, input_index=1)


def _sdpa_backward_strategy(op_schema: OpSchema) -> OpStrategy:
    mesh = op_schema.get_mesh_from_args()
    mask = op_schema.args_schema[4]
    # outputs dq, dk, dv; inputs grad_out, q, k, v (+ mask)
    strategies = _single_dim_strategies(3, 4, mask)
    return expand_to_full_mesh_op_strategy(mesh, op_schema, strategies, input_index=3)


_PROP = DTensor._op_dispatcher.sharding_propagator
_PROP.register_op_strategy(torch.ops.autoplan.sdpa.default, _sdpa_strategy, schema_info=RuntimeSchemaInfo(4))
_PROP.register_op_strategy(
    torch.ops.autoplan.sdpa_backward.default, _sdpa_backward_strategy, schema_info=RuntimeSchemaInfo(5)
)


# --------------------------------------------------------------------------------------------
# FLOPs


def _attention_core(query: torch.Tensor, key: torch.Tensor) -> float:
    *batch, t, d = query.shape
    s = key.shape[-2]
    n = 1
    for b in batch:
        n *= b
    return float(n * t * s * d)


@register_flops(torch.ops.autoplan.sdpa.default)
def _sdpa_flops(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> float:
    return 4.0 * _attention_core(inputs[0], inputs[1])


@register_flops(torch.ops.autoplan.sdpa_backward.default)
def _sdpa_backward_flops(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> float:
    return 12.0 * _attention_core(inputs[1], inputs[2])
