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

A learned additive float mask (a relative position bias, as T5 adds) gets its gradient from
``autoplan::sdpa_backward_with_mask``: the scores' gradient summed over the dims the mask
broadcasts along (its strategy makes that a partial sum when the heads or the batch are split and
the mask is shared by them). Attention with dropout is not routed to the single op: its backward
would need the forward's random mask, so PyTorch's own attention is traced as its decomposition.

A constant mask that is exactly causal (Hugging Face models build ``tril`` masks from ``arange``
when traced, since they skip ``is_causal`` under tracing) is replaced after tracing by
``is_causal=True`` (:func:`causal_masks_as_flag`): the same values, the fused kernel skips the
blocks above the diagonal, and the cost model prices the causal call (``compute.cost_key``).

FLOPs (queries T, keys S, head dim D, per batch element and head)::

    forward  = 4 * T * S * D          (Q K^T and P V, one multiply-add each)
    backward = 4 * T * S * D  (recomputed forward) + 8 * T * S * D  (dQ, dK, dV, dP)
    (the mask's gradient is a sum of dS over broadcast dims: no multiply-adds)
    causal   = the above times compute.causal_block_fraction(T, S) (~1/2; FlashAttention-2 skips
               the key blocks after the query block), registered in cost_models/compute.py
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, RuntimeSchemaInfo
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

from autoplan.cost_models.compute import register_flops
from autoplan.passes.placement import mesh_axes_of_group
from autoplan.passes.ring_attention import SEQ_DIM, UNDECIDED, cp_axes, ring_attention, ring_attention_backward

_TORCH_SDPA = F.scaled_dot_product_attention
logger = logging.getLogger(__name__)


def _check_ring_call(attn_mask: torch.Tensor | None, cp_group: str) -> None:
    """A kernel only runs the ring for a named group, without a mask (the strategies offer no other)."""
    if cp_group == UNDECIDED or attn_mask is not None:
        raise ValueError(
            f"autoplan::sdpa: ring attention needs a process group name and no mask (got cp_group={cp_group!r}, "
            f"mask {'given' if attn_mask is not None else 'none'}); code generation writes the plan's group"
        )


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
    cp_group: str = "",
) -> torch.Tensor:
    if dropout_p > 0.0:
        raise ValueError(
            f"autoplan::sdpa has no dropout (got dropout_p={dropout_p}); _routed_sdpa keeps it off this op"
        )
    if cp_group:  # the plan's context-parallel group: this rank's sequence shard, ring attention
        _check_ring_call(attn_mask, cp_group)
        return ring_attention(query, key, value, is_causal, scale, cp_group).contiguous()
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
def _sdpa_fake(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, cp_group=""):  # noqa: ANN001, ANN202
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


def _sdpa_grads(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV and dS (the scores' gradient, ``(B, H, T, S)``; an additive mask's gradient
    before it is summed over the dims the mask broadcasts along)."""
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
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dscores


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
    cp_group: str = "",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if cp_group:
        _check_ring_call(attn_mask, cp_group)
        dq, dk, dv = ring_attention_backward(grad_out, query, key, value, is_causal, scale, cp_group)
        return _input_shaped(dq, dk, dv, query, key, value)
    if query.device.type == "cpu" and attn_mask is None and not enable_gqa:
        # PyTorch's own fused CPU kernels (what autograd runs for F.scaled_dot_product_attention on
        # CPU, so the gradients are bitwise those of the single-device model): the forward again
        # for its log-sum-exp, then the fused backward (~2x faster than the explicit formulas)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, scale=scale
        )
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, lse, 0.0, is_causal, scale=scale
        )
        return _input_shaped(dq, dk, dv, query, key, value)
    dq, dk, dv, _ = _sdpa_grads(grad_out, query, key, value, attn_mask, is_causal, scale, enable_gqa)
    return _input_shaped(dq, dk, dv, query, key, value)


def _input_shaped(
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each gradient in its input's shape, as the fake kernel promises: an input that broadcasts
    along a dim (multi-query attention's one key/value head, ``(B, 1, S, D)`` beside ``H`` query
    heads, as Falcon-7B passes it) gets its gradient summed over that dim. The kernels give the
    broadcast shape there, so the CPU trace had an extra sum the meta trace lacked and the two
    programs differed (Falcon's plans were refused at run time)."""
    return tuple(g.sum_to_size(x.shape).contiguous() for g, x in ((dq, query), (dk, key), (dv, value)))  # type: ignore[return-value]


@sdpa_backward.register_fake
def _sdpa_backward_fake(grad_out, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, cp_group=""):  # noqa: ANN001, ANN202, E501
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


@torch.library.custom_op("autoplan::sdpa_backward_with_mask", mutates_args=())
def sdpa_backward_with_mask(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sdpa_backward`` plus the gradient of a learned additive float mask (a relative position
    bias): dMask = dS summed over the dims the mask broadcasts along, in the mask's shape."""
    dq, dk, dv, dscores = _sdpa_grads(grad_out, query, key, value, attn_mask, is_causal, scale, enable_gqa)
    return dq, dk, dv, dscores.sum_to_size(attn_mask.shape).to(attn_mask.dtype).contiguous()


@sdpa_backward_with_mask.register_fake
def _sdpa_backward_with_mask_fake(grad_out, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):  # noqa: ANN001, ANN202
    return (
        query.new_empty(query.shape),
        key.new_empty(key.shape),
        value.new_empty(value.shape),
        attn_mask.new_empty(attn_mask.shape),
    )


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, *cp_group = inputs
    ctx.save_for_backward(query, key, value, attn_mask)
    # a context-parallel group only where the forward had one (traced graphs keep 9 arguments)
    ctx.params = (dropout_p, is_causal, scale, enable_gqa, *[g for g in cp_group if g])


def _backward(ctx, grad_out):  # noqa: ANN001, ANN202
    query, key, value, attn_mask = ctx.saved_tensors
    if attn_mask is not None and ctx.needs_input_grad[3]:
        dq, dk, dv, dmask = torch.ops.autoplan.sdpa_backward_with_mask(
            grad_out, query, key, value, attn_mask, *ctx.params
        )
        return dq, dk, dv, dmask, None, None, None, None, None
    dq, dk, dv = torch.ops.autoplan.sdpa_backward(grad_out, query, key, value, attn_mask, *ctx.params)
    return dq, dk, dv, None, None, None, None, None, None


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
    if dropout_p > 0.0:
        # The single op's backward has no dropout (it would need the forward's random mask):
        # PyTorch's own attention, traced as its math decomposition, differentiates it exactly.
        return _TORCH_SDPA(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    return torch.ops.autoplan.sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


GQA_SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"
"""Hugging Face's switch (``transformers.integrations.sdpa_attention.use_gqa_in_sdpa``) that passes
grouped-query attention's key/value heads to SDPA as they are, with ``enable_gqa=True``, instead of
repeating each ``H / G`` times first (``repeat_kv``), which it does by default under a mask (a
traced model has one until :func:`causal_masks_as_flag`) and on devices whose fused kernels lack
GQA. The single op takes them either way (``_sdpa_grads``, the ring's ``_expand_heads``), so the
traced step keeps ``G`` heads: its saved keys and values, their conversions and a ring's messages
are ``H / G`` times smaller."""


@contextlib.contextmanager
def attention_as_single_op() -> Iterator[None]:
    """Route ``F.scaled_dot_product_attention`` to ``autoplan::sdpa`` (restored on exit), with
    grouped-query key/value heads unrepeated (:data:`GQA_SWITCH`)."""
    F.scaled_dot_product_attention = _routed_sdpa
    before = os.environ.get(GQA_SWITCH)
    os.environ[GQA_SWITCH] = "1"
    try:
        yield
    finally:
        F.scaled_dot_product_attention = _TORCH_SDPA
        if before is None:
            del os.environ[GQA_SWITCH]
        else:
            os.environ[GQA_SWITCH] = before


# --------------------------------------------------------------------------------------------
# Constant causal masks -> is_causal

MAX_MASK_EVAL_BYTES = 1 << 30
"""Largest sum of the bytes of a constant mask's values that are not ``(T, S)``-sized (the
``arange`` vectors and their comparisons' operands) :func:`causal_masks_as_flag` evaluates; a
bigger subgraph keeps its mask (priced and run as non-causal)."""
MASK_BLOCK_BYTES = 1 << 26
"""Bytes of one block of query rows of a ``(T, S)``-sized mask value, as evaluated (int64)."""
MAX_MASK_CHECK_ELEMENTS = 1 << 35
"""Most mask elements (all leading dims x T x S) checked against the causal mask: 2^34 is a
128k x 128k mask, measured 54-60 s on 2 CPU cores busy with other work (a 32k one 1.1 s, 64k 4.8 s). A larger mask stays (priced and run as non-causal)."""

_aten = torch.ops.aten
_ROWWISE_OPS = frozenset(
    getattr(getattr(_aten, name), overload)
    for name, overloads in {
        "eq": ("Tensor", "Scalar"), "ne": ("Tensor", "Scalar"), "le": ("Tensor", "Scalar"),
        "lt": ("Tensor", "Scalar"), "ge": ("Tensor", "Scalar"), "gt": ("Tensor", "Scalar"),
        "bitwise_and": ("Tensor", "Scalar"), "bitwise_or": ("Tensor", "Scalar"),
        "bitwise_xor": ("Tensor", "Scalar"), "bitwise_not": ("default",), "logical_and": ("default",),
        "logical_or": ("default",), "logical_xor": ("default",), "logical_not": ("default",),
        "where": ("self", "ScalarOther", "ScalarSelf", "Scalar"), "masked_fill": ("Scalar", "Tensor"),
        "mul": ("Tensor", "Scalar"), "add": ("Tensor", "Scalar"), "sub": ("Tensor", "Scalar"),
        "expand": ("default",), "_to_copy": ("default",), "clone": ("default",), "alias": ("default",),
        "detach": ("default",), "unsqueeze": ("default",),
    }.items()
    for overload in overloads
)  # fmt: skip
"""Ops a ``(T, S)``-sized mask value may come from for :func:`causal_masks_as_flag` to evaluate it
in blocks of query rows: elementwise with broadcasting (a row of the output depends on that row
of each operand only), ``expand`` and ``unsqueeze`` of a leading dim."""


def causal_masks_as_flag(gm: fx.GraphModule) -> int:
    """Replace every constant ``attn_mask`` of ``autoplan::sdpa`` / ``sdpa_backward`` that equals
    the causal mask (query t sees keys s <= t, aligned top-left as ``is_causal``) by ``None`` with
    ``is_causal=True``; returns how many calls changed. The mask's nodes are left to dead-code
    elimination. A mask is constant when it depends on no placeholder (``arange`` comparisons, as
    Hugging Face builds it); bool (keep = True) or additive float (0 kept, -inf or the dtype's
    lowest value masked: both give probability 0). A mask that depends on the inputs (padding),
    a learned mask (its gradient uses ``sdpa_backward_with_mask``) or a sliding window stays as
    it is.

    The check is exact and bounded in memory at any length (:func:`_is_causal_constant`): the
    small values are evaluated once, the ``(T, S)``-sized ones in blocks of query rows, each
    block compared with the causal rows and freed."""
    positions = {
        torch.ops.autoplan.sdpa.default: (0, 3, 5),  # query, attn_mask, is_causal
        torch.ops.autoplan.sdpa_backward.default: (1, 4, 6),
    }
    verdicts: dict[fx.Node, bool] = {}
    changed = 0
    for node in gm.graph.nodes:
        where = positions.get(node.target)
        if where is None:
            continue
        q_pos, mask_pos, causal_pos = where
        mask, query, key = node.args[mask_pos], node.args[q_pos], node.args[q_pos + 1]
        if not isinstance(mask, fx.Node) or node.args[causal_pos] is True:
            continue
        if mask not in verdicts:
            t, s = query.meta["val"].shape[-2], key.meta["val"].shape[-2]
            verdicts[mask] = _is_causal_constant(mask, t, s)
        if verdicts[mask]:
            node.update_arg(mask_pos, None)
            node.update_arg(causal_pos, True)
            changed += 1
    return changed


def _is_rows_value(node: fx.Node, t: int, s: int) -> bool:
    """Whether ``node``'s value is ``(..., T, S)``-sized (evaluated in blocks of query rows)."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() >= 2 and tuple(val.shape[-2:]) == (t, s)


def _constant_subgraph(node: fx.Node) -> list[fx.Node] | None:
    """The ``call_function`` nodes ``node`` is computed from, in graph order; ``None`` when it
    depends on a placeholder (an input, parameter, buffer) or an attribute."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        if n.op != "call_function":
            return None
        seen.add(n)
        stack.extend(n.all_input_nodes)
    index = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(seen, key=index.__getitem__)


def _arguments(n: fx.Node, value: Callable[[fx.Node], Any]) -> tuple[Any, dict[str, Any]]:
    """``n``'s arguments with each node replaced by ``value(node)``, any ``device`` set to CPU."""
    kwargs = fx.node.map_arg(n.kwargs, value)
    return fx.node.map_arg(n.args, value), {k: torch.device("cpu") if k == "device" else v for k, v in kwargs.items()}


def _run(n: fx.Node, env: dict[fx.Node, Any]) -> Any:
    """``n``'s op on its arguments' values in ``env``, on CPU."""
    args, kwargs = _arguments(n, env.__getitem__)
    return n.target(*args, **kwargs)  # type: ignore[operator]


_VERDICTS: dict[tuple[Any, ...], bool] = {}
"""Verdicts of :func:`_is_causal_constant` by what decides them (:func:`_verdict_key`): the
planner traces a model several times (per micro-batch size, per block count), and a 128k mask
takes seconds to check."""


def _is_causal_constant(mask: fx.Node, t: int, s: int) -> bool:
    """True if ``mask`` is a constant that equals the top-left causal mask of (T, S) (broadcast over
    its leading dims). Its small values (at most ``MAX_MASK_EVAL_BYTES``) are evaluated once on
    CPU; its ``(T, S)``-sized values must come from ``_ROWWISE_OPS`` and feed only each other, and
    are evaluated ``rows`` query rows at a time (``MASK_BLOCK_BYTES``), each block compared with
    the causal rows. Anything else (an op that cannot run on CPU, a reduction over the mask, too
    large a mask) answers False: the mask stays, priced and run as non-causal."""
    order = _constant_subgraph(mask)
    if order is None or not _is_rows_value(mask, t, s) or mask.target not in _ROWWISE_OPS:
        return False
    # the (T, S)-sized values: the mask and, back from it, the (T, S)-sized arguments of rowwise
    # ops (by dataflow, not by shape alone: a (B, T) position table with B == T is a small value)
    rows_set, stack = {mask}, [mask]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in rows_set and a.target in _ROWWISE_OPS and _is_rows_value(a, t, s):
                rows_set.add(a)
                stack.append(a)
    rows_nodes = [n for n in order if n in rows_set]
    in_subgraph = set(order)
    if any(user in in_subgraph and user not in rows_set for n in rows_nodes for user in n.users):
        return False  # a small value computed from a (T, S) one: not row-separable
    small = [n for n in order if n not in rows_set]
    small_bytes = sum(v.numel() * v.element_size() for n in small if isinstance(v := n.meta.get("val"), torch.Tensor))
    if small_bytes > MAX_MASK_EVAL_BYTES or t * s > MAX_MASK_CHECK_ELEMENTS:
        return False
    env: dict[fx.Node, Any] = {}
    try:
        for n in small:
            env[n] = _run(n, env)
        for n in small:  # what the (T, S) values read, without the leading dims it repeats
            if any(u in rows_set for u in n.users) and isinstance(env[n], torch.Tensor):
                env[n] = _without_repeated_leading_dims(env[n])
        key = _verdict_key(rows_nodes, env, t, s)
        if key in _VERDICTS:
            return _VERDICTS[key]
        if len(_VERDICTS) >= 64:
            _VERDICTS.clear()
        _VERDICTS[key] = False  # until every block matched
        rows = max(1, MASK_BLOCK_BYTES // (8 * s))
        for start in range(0, t, rows):
            stop = min(t, start + rows)
            block = _rows_block(rows_nodes, env, t, start, stop)
            if block.numel() // (stop - start) * t > MAX_MASK_CHECK_ELEMENTS:
                return False  # leading dims that differ (a mask per batch element) and too many
            if not _block_is_causal(block, start, stop, s):
                return False
    except (RuntimeError, TypeError, ValueError, NotImplementedError, IndexError) as exc:
        logger.debug("constant mask %s not evaluated: %s", mask.name, exc)
        return False
    _VERDICTS[key] = True
    return True


def _verdict_key(rows_nodes: Sequence[fx.Node], env: dict[fx.Node, Any], t: int, s: int) -> tuple[Any, ...]:
    """What decides a mask's verdict: the ``(T, S)``-sized values' ops and arguments, and the
    values of the small ones they read (after :func:`_without_repeated_leading_dims`, so the
    same mask traced for another batch size has the same key). ``expand``'s leading sizes are
    left out: :func:`_rows_block` does not compute them."""
    where = {n: i for i, n in enumerate(rows_nodes)}

    def describe(a: Any) -> Any:
        if not isinstance(a, fx.Node):
            return repr(a)
        if a in where:
            return ("rows", where[a])
        v = env[a]
        if not isinstance(v, torch.Tensor):
            return repr(v)
        data = v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return (tuple(v.shape), str(v.dtype), hashlib.sha256(data).hexdigest())

    ops = []
    for n in rows_nodes:
        args: Any = n.args if n.target is not _aten.expand.default else (n.args[0], list(n.args[1])[-2:])  # type: ignore[arg-type]
        ops.append((str(n.target), fx.node.map_aggregate(args, describe), fx.node.map_aggregate(n.kwargs, describe)))
    return (t, s, tuple(ops))


def _without_repeated_leading_dims(v: torch.Tensor) -> torch.Tensor:
    """``v`` with each leading dim (all but the last two) along which every slice equals the
    first cut to size 1: elementwise ops then compute one slice for all of them (a mask built per
    batch element from positions expanded over the batch is checked once, not per element)."""
    for d in range(v.dim() - 2):
        if v.shape[d] > 1 and bool((v == v.narrow(d, 0, 1)).all()):
            v = v.narrow(d, 0, 1)
    return v


def _rows_block(rows_nodes: Sequence[fx.Node], env: dict[fx.Node, Any], t: int, start: int, stop: int) -> torch.Tensor:
    """Query rows ``[start, stop)`` of the last of ``rows_nodes`` (the mask), up to leading dims
    that only repeat (:func:`_without_repeated_leading_dims`; ``expand`` keeps them at the
    input's size): every ``(T, S)``-sized value on those rows, from the small values in ``env``
    cut to the rows where they have T of them."""
    block: dict[fx.Node, Any] = {}
    rows_set = set(rows_nodes)

    def arg(a: fx.Node) -> Any:
        if a in block:
            return block[a]
        v = env[a]
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[-2] == t:
            return v[..., start:stop, :]
        return v

    for n in rows_nodes:
        args, kwargs = _arguments(n, arg)
        if n.target is _aten.expand.default:
            x, sizes = args[0], list(args[1])
            new = len(sizes) - x.dim()  # leading dims expand adds
            lead = [1] * new + [-1] * (len(sizes) - 2 - new)  # repeats of a leading dim are not computed
            args = (x, [*lead, stop - start if sizes[-2] == t else sizes[-2], sizes[-1]], *args[2:])
        elif n.target is _aten.unsqueeze.default and args[1] % (args[0].dim() + 1) >= args[0].dim() - 1:
            raise ValueError("unsqueeze inside the (T, S) dims")
        block[n] = n.target(*args, **kwargs)  # type: ignore[operator]
        for a in n.all_input_nodes:
            if a in block and all(u in block or u not in rows_set for u in a.users):
                del block[a]  # every reader ran: free the block
    return block[rows_nodes[-1]]


def _block_is_causal(block: torch.Tensor, start: int, stop: int, s: int) -> bool:
    """True if ``block`` (..., stop - start, S) equals rows ``[start, stop)`` of the causal mask:
    bool keep = (key <= query), or float 0 where kept and -inf / the dtype's lowest where not."""
    if block.dtype != torch.bool and not block.is_floating_point():
        return False
    keep = torch.arange(s).unsqueeze(0) <= torch.arange(start, stop).unsqueeze(1)
    for rows in block.reshape(-1, stop - start, s):  # one slice of the leading dims at a time
        if rows.dtype == torch.bool:
            if not torch.equal(rows, keep):
                return False
            continue
        masked = (rows == float("-inf")) | (rows <= torch.finfo(rows.dtype).min)
        if not (torch.equal(rows == 0, keep) and torch.equal(masked, ~keep)):
            return False
    return True


# --------------------------------------------------------------------------------------------
# DTensor strategies: replicate, shard the batch (dim 0), or shard the heads (dim 1)


def _mask_dim(mask: OpStrategy, query_ndim: int, dim: int) -> int | None:
    """The mask's dim that lines up with the query's ``dim`` (a mask broadcasts from the right:
    ``(T, S)``, ``(B, 1, T, S)``, ...), or ``None`` where the mask broadcasts along ``dim``."""
    mask_dim = dim - (query_ndim - mask.ndim)
    return mask_dim if mask_dim >= 0 and mask.shape[mask_dim] > 1 else None


def _single_dim_strategies(
    *, num_outputs: int, num_inputs: int, query: object, mask: object, mask_grad: bool
) -> list[list[Placement | None]]:
    """Rows of (outputs, inputs) placements on one mesh axis: everything replicated, or q/k/v
    (their gradients and grad_out) split on the batch (dim 0) or the heads (dim 1). The mask is
    split along that dim where it has it, else replicated; its gradient (``mask_grad``: the last
    output) is then split the same way, or a partial sum of every shard's contribution."""
    assert isinstance(query, OpStrategy)
    has_mask = isinstance(mask, OpStrategy)
    mask_in: list[Placement | None] = [Replicate()] if has_mask else []
    mask_out: list[Placement | None] = [Replicate()] if mask_grad else []
    strategies = [[Replicate()] * num_outputs + mask_out + [Replicate()] * num_inputs + mask_in]
    for dim in (0, 1):
        mask_dim = _mask_dim(mask, query.ndim, dim) if isinstance(mask, OpStrategy) else None
        if has_mask:
            mask_in = [Shard(mask_dim) if mask_dim is not None else Replicate()]
        if mask_grad:
            mask_out = [Shard(mask_dim) if mask_dim is not None else Partial()]
        strategies.append([Shard(dim)] * num_outputs + mask_out + [Shard(dim)] * num_inputs + mask_in)
    return strategies


def _sequence_row(num_outputs: int, num_inputs: int) -> list[Placement | None]:
    """Ring attention on one axis: q, k, v (their gradients and grad_out) split along the sequence."""
    return [Shard(SEQ_DIM)] * (num_outputs + num_inputs)


def _cp_group(op_schema: OpSchema, index: int) -> str:
    """The op's ``cp_group`` argument (``""`` where the node has none: no ring)."""
    args = op_schema.args_schema
    group = args[index] if len(args) > index else ""
    assert isinstance(group, str), group
    return group


def _ring_valid(op_schema: OpSchema, *, first: int, cp_group: str) -> Callable[..., bool]:
    """Strategies a ring may run: the sequence split on at most one axis of two or more ranks, that
    axis the named group's (``UNDECIDED``: any axis), the sequence cut into ``2n`` chunks (causal: the zigzag
    layout) or ``n`` blocks, and queries and keys of one length (self-attention)."""
    mesh = op_schema.get_mesh_from_args()
    query, key = op_schema.args_schema[first], op_schema.args_schema[first + 1]
    assert isinstance(query, OpStrategy) and isinstance(key, OpStrategy)
    causal = bool(op_schema.args_schema[first + 5])
    named = cp_group not in ("", UNDECIDED)
    allowed = mesh_axes_of_group(mesh, cp_group) if named else frozenset(range(mesh.ndim))

    def valid(input_specs: list[Any], output_spec: object) -> bool:
        axes = cp_axes([spec.placements for spec in input_specs], backward=first == 1)
        if not axes:
            return not named
        if len(axes) > 1 or axes[0] not in allowed or query.shape[SEQ_DIM] != key.shape[SEQ_DIM]:
            return False
        if mesh.size(axes[0]) < 2:  # a ring of one rank is local attention: no second strategy for it
            return False
        chunks = mesh.size(axes[0]) * (2 if causal else 1)
        return query.shape[SEQ_DIM] % chunks == 0

    return valid


def _heads_valid(op_schema: OpSchema, *, first: int) -> Callable[..., bool]:
    """Strategies that split grouped-query heads evenly: where the key/value heads ``G`` are fewer
    than the query heads ``H`` (``enable_gqa``: query head ``h`` reads key/value head ``h // (H /
    G)``), the heads dim split ``n`` ways holds whole groups on every rank only if ``n`` divides
    both (DTensor also offers uneven shards, which would pair a rank's queries with another's
    keys)."""
    mesh = op_schema.get_mesh_from_args()
    query, key = op_schema.args_schema[first], op_schema.args_schema[first + 1]
    assert isinstance(query, OpStrategy) and isinstance(key, OpStrategy)
    heads = (query.shape[1], key.shape[1])

    def valid(input_specs: list[Any], output_spec: object) -> bool:
        for spec, n_heads in zip(input_specs[first : first + 2], heads, strict=True):
            ways = 1
            for axis, p in enumerate(spec.placements):
                if isinstance(p, Shard) and p.dim == 1:
                    ways *= mesh.size(axis)
            if n_heads % ways:
                return False
        return True

    return valid


def _both(*checks: Callable[..., bool] | None) -> Callable[..., bool] | None:
    """A strategy check that passes where every given one does (``None``: no check)."""
    given = [c for c in checks if c is not None]
    if not given:
        return None
    return lambda input_specs, output_spec: all(c(input_specs, output_spec) for c in given)


def _sdpa_strategy(op_schema: OpSchema) -> OpStrategy:
    mesh = op_schema.get_mesh_from_args()
    query, key, mask = op_schema.args_schema[0], op_schema.args_schema[1], op_schema.args_schema[3]
    # output O; inputs q, k, v (+ mask)
    strategies = _single_dim_strategies(num_outputs=1, num_inputs=3, query=query, mask=mask, mask_grad=False)
    assert isinstance(query, OpStrategy) and isinstance(key, OpStrategy)
    heads = _heads_valid(op_schema, first=0) if key.shape[1] != query.shape[1] else None
    cp_group = _cp_group(op_schema, 8)
    if not cp_group or mask is not None:
        return expand_to_full_mesh_op_strategy(mesh, op_schema, strategies, input_index=1, is_valid_strategy_cb=heads)
    strategies.append(_sequence_row(1, 3))
    valid = _both(heads, _ring_valid(op_schema, first=0, cp_group=cp_group))
    return expand_to_full_mesh_op_strategy(mesh, op_schema, strategies, input_index=1, is_valid_strategy_cb=valid)


def _sdpa_backward_strategy(op_schema: OpSchema, *, mask_grad: bool) -> OpStrategy:
    mesh = op_schema.get_mesh_from_args()
    query, key, mask = op_schema.args_schema[1], op_schema.args_schema[2], op_schema.args_schema[4]
    # outputs dq, dk, dv (+ dmask); inputs grad_out, q, k, v (+ mask)
    strategies = _single_dim_strategies(num_outputs=3, num_inputs=4, query=query, mask=mask, mask_grad=mask_grad)
    assert isinstance(query, OpStrategy) and isinstance(key, OpStrategy)
    heads = _heads_valid(op_schema, first=1) if key.shape[1] != query.shape[1] else None
    cp_group = "" if mask_grad else _cp_group(op_schema, 9)
    if not cp_group or mask is not None:
        return expand_to_full_mesh_op_strategy(
            mesh, op_schema, strategies, input_index=3 + mask_grad, is_valid_strategy_cb=heads
        )
    strategies.append(_sequence_row(3, 4))
    valid = _both(heads, _ring_valid(op_schema, first=1, cp_group=cp_group))
    return expand_to_full_mesh_op_strategy(mesh, op_schema, strategies, input_index=3, is_valid_strategy_cb=valid)


RING_OPS = frozenset({torch.ops.autoplan.sdpa.default, torch.ops.autoplan.sdpa_backward.default})
"""The attention ops that run a ring when their node names a context-parallel group."""


def planning_args(op: object, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The arguments the strategy table calls an attention op's strategy function with:
    ``cp_group`` undecided, so ring attention is offered on every axis (other ops: ``args``)."""
    if op not in RING_OPS:
        return args
    return (*args[: _CP_GROUP_INDEX[op]], UNDECIDED)


_CP_GROUP_INDEX = {torch.ops.autoplan.sdpa.default: 8, torch.ops.autoplan.sdpa_backward.default: 9}


def with_cp_group(node: fx.Node, args: tuple[Any, ...], input_specs: Sequence[Sequence[Placement]],
                  mesh: DeviceMesh | None) -> tuple[Any, ...]:  # fmt: skip
    """``args`` of a generated attention node with the plan's context-parallel group written in
    where its strategy splits the sequence (unchanged otherwise: the single-device kernel)."""
    if node.target not in RING_OPS:
        return args
    axes = cp_axes(input_specs, backward=node.target is not torch.ops.autoplan.sdpa.default)
    if not axes:
        return args
    if mesh is None:
        raise ValueError(f"{node.name}: ring attention needs the mesh: pass mesh= to generate_program")
    return (*args[: _CP_GROUP_INDEX[node.target]], mesh.get_group(axes[0]).group_name)


_PROP = DTensor._op_dispatcher.sharding_propagator
_PROP.register_op_strategy(torch.ops.autoplan.sdpa.default, _sdpa_strategy, schema_info=RuntimeSchemaInfo(4))
_PROP.register_op_strategy(
    torch.ops.autoplan.sdpa_backward.default,
    functools.partial(_sdpa_backward_strategy, mask_grad=False),
    schema_info=RuntimeSchemaInfo(5),
)
_PROP.register_op_strategy(
    torch.ops.autoplan.sdpa_backward_with_mask.default,
    functools.partial(_sdpa_backward_strategy, mask_grad=True),
    schema_info=RuntimeSchemaInfo(5),
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


@register_flops(torch.ops.autoplan.sdpa_backward.default, torch.ops.autoplan.sdpa_backward_with_mask.default)
def _sdpa_backward_flops(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> float:
    return 12.0 * _attention_core(inputs[1], inputs[2])
