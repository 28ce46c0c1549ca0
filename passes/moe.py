"""Routed experts as one operator: ``autoplan::moe_experts`` and its backward, with expert parallelism.

Hugging Face mixture-of-experts decoders (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-style ones with
shared experts, ...) keep a layer's routed experts as two stacked parameters, ``gate_up_proj``
``(E, 2I, H)`` and ``down_proj`` ``(E, H, I)``, and call them as ``experts(x, top_k_index,
top_k_weights)`` on the flattened tokens ``x (N, H)`` and the router's choice ``(N, k)``. How that
call runs is pluggable (``experts_implementation``): ``eager`` loops over the experts a batch
happens to hit (data-dependent: ``torch.export`` cannot trace it), ``batched_mm`` gathers each
token's expert weights (an ``(N*k, 2I, H)`` copy of the weights per layer: no sharding rule can
make that cheap), ``grouped_mm`` sorts tokens with data-dependent offsets.

During tracing, :func:`experts_as_single_op` routes every such call (for the experts classes with
the standard layout: concatenated gate/up, no bias, not transposed, an activation listed in
``ACTIVATIONS``) to the custom op ``autoplan::moe_experts`` and its backward
``autoplan::moe_experts_backward``: the same values (each token's output is the routing-weighted
sum of its ``k`` experts' SwiGLU outputs), one node per layer with a DTensor strategy per mesh
axis (:func:`_strategy`), and FLOPs that count the ``N*k`` routed rows only.

Strategies on one mesh axis of ``n`` ranks (``x``: tokens, ``idx``/``w``: routing, ``ids``: the
expert ids ``arange(E)``, ``gu``/``down``: the expert weights)::

    replicate          everything R
    data               x, idx, w S(0) (tokens split), experts R            -> y S(0)
    experts            tokens R, ids/gu/down S(0) (E/n experts per rank)   -> y P(sum)
    expert_parallel    tokens S(0) and ids/gu/down S(0) on the same axis   -> y S(0)

``experts`` is Megatron-Core's "allgather" token dispatcher when the tokens arrive split (the ILP
prices the all-gather of the tokens and the reduce-scatter of ``P``). ``expert_parallel`` is the
"alltoall" dispatcher (GShard, Lepikhin et al. 2020; DeepSpeed-MoE; torchtitan's
``ExpertParallel``): each rank sends each routed row to the rank holding its expert
(``all_to_all_single`` with the per-expert row counts exchanged first), runs its experts, and sends
the results back; the backward sends the rows and their output gradients together and gets the
input gradients and expert outputs back. These collectives run *inside* the op (their sizes depend
on the routing, which a static graph cannot show), so the op needs its axis's process group: the
traced graph carries ``ep_group=""`` (no exchange; with every expert local, the single-device
values), the strategy table asks the strategies with ``"*"`` (:func:`planning_args`: expert
parallel may be on any axis), and code generation writes the chosen axis's group name into the node
(:func:`with_ep_group`; ``""`` for none). A node whose ``ep_group`` names a group offers only
strategies with ``expert_parallel`` on that group's axis, and one with ``""`` none, so DTensor can
never run the op's exchange under another layout, or skip it under this one; a kernel that meets
``"*"`` raises. ``expert_parallel``
on one axis combines with ``replicate`` or ``data`` on the others. Because the ILP chooses per op
and per axis, attention can be head-parallel and the experts expert-parallel over the same ranks
(Megatron-Core's "MoE parallel folding", Liu et al. 2025).

Pricing (:func:`moe_comm_time_s`, added to the op's time by the costing pass; the collectives are
blocking inside the op, so nothing is credited as overlapped): three all-to-alls each way, as
``_Dispatch`` runs them: the per-expert row counts, then the rank's ``N/n * k`` routed rows of
``H`` elements out and the results back (backward: ``2H``, rows with their gradients out,
input gradients with expert outputs back).
A rank holding ``E/n`` experts computes (and receives) the rows routed to them: on average ``1/n``
of all routed rows, priced at ``ROUTING_IMBALANCE`` times that for the busiest rank.

FLOPs (``S = N*k`` routed rows, per expert row a ``(H -> 2I)`` and an ``(I -> H)`` GEMM)::

    forward  = 2*S*H*2I + 2*S*I*H                         = 6 S H I
    backward = 4 S H I  (the gate/up GEMM recomputed: the op saves only its inputs)
             + 2 S H I (dH) + 2 S H I (d down) + 4 S H I (dX) + 4 S H I (d gate_up) = 16 S H I
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, RuntimeSchemaInfo
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.comm import ROUTING_IMBALANCE, expert_exchange_bytes, expert_exchange_s
from autoplan.cost_models.compute import Gemm, register_flops, register_matmul_shapes
from autoplan.cost_models.memory import tensor_bytes
from autoplan.passes.placement import mesh_axes_of_group

UNDECIDED = "*"
"""``ep_group`` the strategy table asks the op's strategies with (:func:`planning_args`): every
axis may be expert-parallel. A traced node carries ``""`` (no exchange: the single-device values)."""

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}
"""``config.hidden_act`` names the op computes (the gate's activation of a SwiGLU-style expert)."""

_aten = torch.ops.aten


def _activation_backward(act: str, grad: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    if act in ("silu", "swish"):
        return _aten.silu_backward(grad, g)
    if act == "gelu":
        return _aten.gelu_backward(grad, g)
    if act == "gelu_pytorch_tanh":
        return _aten.gelu_backward(grad, g, approximate="tanh")
    return _aten.threshold_backward(grad, g, 0)


# --------------------------------------------------------------------------------------------
# Kernels on local tensors


def _expert_rows(rows: torch.Tensor, gu: torch.Tensor, down: torch.Tensor, act: str) -> torch.Tensor:
    """One expert on its rows: ``down(act(gate x) * up x)``."""
    g, u = (rows @ gu.t()).chunk(2, dim=-1)
    return (ACTIVATIONS[act](g) * u) @ down.t()


def _expert_rows_backward(
    rows: torch.Tensor, dy: torch.Tensor, gu: torch.Tensor, down: torch.Tensor, act: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One expert's output ``y``, and the gradients of its rows, ``gu`` and ``down`` given ``dy``."""
    g, u = (rows @ gu.t()).chunk(2, dim=-1)
    a = ACTIVATIONS[act](g)
    hidden = a * u
    y = hidden @ down.t()
    d_down = dy.t() @ hidden
    d_hidden = dy @ down
    dgu = torch.cat([_activation_backward(act, d_hidden * u, g), d_hidden * a], dim=-1)
    return y, dgu @ gu, dgu.t() @ rows, d_down


def _slots(idx: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routed rows ``(token, slot)`` flattened: their expert, their token, their weight."""
    n, k = idx.shape
    token = torch.arange(n, device=idx.device).repeat_interleave(k)
    return idx.reshape(-1), token, w.reshape(-1)


def _rows_by_expert(expert: torch.Tensor, ids: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """``(j, rows)`` for each local expert ``ids[j]`` that rows are routed to: the indices of those rows."""
    for j, e in enumerate(ids.tolist()):
        sel = (expert == e).nonzero().squeeze(1)
        if sel.numel():
            yield j, sel


def _apply_experts(
    rows: torch.Tensor, expert: torch.Tensor, ids: torch.Tensor, gu: torch.Tensor, down: torch.Tensor, act: str
) -> torch.Tensor:
    """Each row through its expert, for the rows whose expert is one of ``ids`` (others: 0)."""
    out = rows.new_zeros(rows.shape[0], down.shape[1])
    for j, sel in _rows_by_expert(expert, ids):
        out[sel] = _expert_rows(rows[sel], gu[j], down[j], act)
    return out


def _combine(n: int, token: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    acc_dtype = torch.promote_types(y.dtype, weight.dtype)
    out = torch.zeros(n, y.shape[1], dtype=acc_dtype, device=y.device)
    out.index_add_(0, token, y.to(acc_dtype) * weight[:, None].to(acc_dtype))
    return out.to(dtype)


def _owners(ids: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Per expert id: the group rank holding it (-1: none) and its index among that rank's
    experts, from every rank's ``ids`` (all-gathered once per group and layout)."""
    key = (group.group_name, tuple(ids.tolist()))
    if key not in _OWNERS:
        gathered = [torch.empty_like(ids) for _ in range(group.size())]
        dist.all_gather(gathered, ids.contiguous(), group=group)
        num_experts = int(max(int(g.max()) for g in gathered)) + 1
        owner = torch.full((num_experts,), -1, dtype=torch.int64)
        position = torch.zeros(num_experts, dtype=torch.int64)
        for r, g in enumerate(gathered):
            owner[g] = r
            position[g] = torch.arange(g.numel())
        _OWNERS[key] = (owner, position)
    owner, position = _OWNERS[key]
    return owner.to(ids.device), position.to(ids.device)


_OWNERS: dict[tuple[str, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]] = {}


def _exchange(t: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    out = t.new_empty((sum(recv), *t.shape[1:]))
    dist.all_to_all_single(out, t.contiguous(), recv, send, group=group)
    return out


class _Dispatch:
    """Where each routed row of this rank goes: to the group rank holding its expert, sorted by
    (rank, that rank's expert) so that one exchange of per-expert counts tells every receiver
    which of its experts each row it gets is for (torchtitan's token dispatch: no expert ids sent)."""

    def __init__(self, expert: torch.Tensor, ids: torch.Tensor, group: dist.ProcessGroup) -> None:
        owner, position = _owners(ids, group)
        if int(expert.max()) >= owner.numel() or bool((owner[expert] < 0).any()):
            raise RuntimeError(
                "expert-parallel experts: a token is routed to an expert no rank of the group holds; "
                "the expert weights must be split over exactly the expert-parallel axis"
            )
        n, local = group.size(), ids.numel()
        key = owner[expert] * local + position[expert]
        self.group = group
        self.order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=n * local)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)  # [source rank, my expert] row counts
        self.send = counts.view(n, local).sum(1).tolist()
        self.recv = received.view(n, local).sum(1).tolist()
        self.expert = torch.repeat_interleave(ids.repeat(n), received)
        """The expert of each row this rank receives, in the order :meth:`out` gives them."""

    def out(self, t: torch.Tensor) -> torch.Tensor:
        """Rows in slot order -> the rows this rank's experts receive."""
        return _exchange(t[self.order], self.recv, self.send, self.group)

    def back(self, t: torch.Tensor) -> torch.Tensor:
        """Received rows' results -> back on their source rank, in slot order."""
        returned = _exchange(t, self.send, self.recv, self.group)
        unsorted = torch.empty_like(returned)
        unsorted[self.order] = returned
        return unsorted


def _group(ep_group: str) -> dist.ProcessGroup | None:
    if ep_group == UNDECIDED:
        raise RuntimeError(
            "autoplan::moe_experts ran with an undecided expert-parallel axis: run the generated program, "
            "which writes the plan's choice into the op (passes.moe.with_ep_group)"
        )
    if not ep_group:
        return None
    return dist.distributed_c10d._resolve_process_group(ep_group)  # type: ignore[arg-type]


@torch.library.custom_op("autoplan::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    expert_ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act: str,
    ep_group: str,
) -> torch.Tensor:
    """Routed experts: ``y[t] = sum_j w[t, j] * expert_{idx[t, j]}(x[t])`` over the experts in
    ``expert_ids`` (``gate_up_proj[i]``/``down_proj[i]`` are expert ``expert_ids[i]``)."""
    group = _group(ep_group)
    expert, token, weight = _slots(top_k_index, top_k_weights)
    if group is None:
        y = _apply_experts(x[token], expert, expert_ids, gate_up_proj, down_proj, act)
    else:
        dispatch = _Dispatch(expert, expert_ids, group)
        received = _apply_experts(dispatch.out(x[token]), dispatch.expert, expert_ids, gate_up_proj, down_proj, act)
        y = dispatch.back(received)
    return _combine(x.shape[0], token, y, weight, x.dtype)


@moe_experts.register_fake
def _moe_experts_fake(x, top_k_index, top_k_weights, expert_ids, gate_up_proj, down_proj, act, ep_group):  # noqa: ANN001, ANN202
    return x.new_empty(x.shape)


def _backward_rows(
    rows: torch.Tensor, dy: torch.Tensor, expert: torch.Tensor, ids: torch.Tensor, gu: torch.Tensor,
    down: torch.Tensor, act: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per row: expert output and input gradient; per local expert: weight gradients."""
    y = rows.new_zeros(rows.shape[0], down.shape[1])
    d_rows = torch.zeros_like(rows)
    dgu, ddown = torch.zeros_like(gu), torch.zeros_like(down)
    for j, sel in _rows_by_expert(expert, ids):
        y[sel], d_rows[sel], dgu[j], ddown[j] = _expert_rows_backward(rows[sel], dy[sel], gu[j], down[j], act)
    return y, d_rows, dgu, ddown


@torch.library.custom_op("autoplan::moe_experts_backward", mutates_args=())
def moe_experts_backward(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    expert_ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act: str,
    ep_group: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`moe_experts` w.r.t. ``x``, ``top_k_weights``, ``gate_up_proj``, ``down_proj``."""
    group = _group(ep_group)
    expert, token, weight = _slots(top_k_index, top_k_weights)
    acc = torch.promote_types(grad_y.dtype, weight.dtype)
    g_rows = grad_y[token].to(acc)
    dy = (g_rows * weight[:, None].to(acc)).to(x.dtype)
    rows = x[token]
    if group is None:
        y, d_rows, dgu, ddown = _backward_rows(rows, dy, expert, expert_ids, gate_up_proj, down_proj, act)
    else:
        dispatch = _Dispatch(expert, expert_ids, group)
        h = x.shape[1]
        received = dispatch.out(torch.cat([rows, dy], dim=1))
        y_r, d_r, dgu, ddown = _backward_rows(
            received[:, :h], received[:, h:], dispatch.expert, expert_ids, gate_up_proj, down_proj, act
        )
        back = dispatch.back(torch.cat([d_r, y_r], dim=1))
        d_rows, y = back[:, :h], back[:, h:]
    dx = torch.zeros_like(x).index_add_(0, token, d_rows)
    dw = (g_rows * y.to(acc)).sum(-1).to(top_k_weights.dtype).view(top_k_weights.shape)
    return dx, dw, dgu, ddown


@moe_experts_backward.register_fake
def _moe_experts_backward_fake(
    grad_y, x, top_k_index, top_k_weights, expert_ids, gate_up_proj, down_proj, act, ep_group
):  # noqa: ANN001, ANN202, E501
    return (
        x.new_empty(x.shape),
        top_k_weights.new_empty(top_k_weights.shape),
        gate_up_proj.new_empty(gate_up_proj.shape),
        down_proj.new_empty(down_proj.shape),
    )


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    x, idx, w, ids, gu, down, act, ep_group = inputs
    ctx.save_for_backward(x, idx, w, ids, gu, down)
    ctx.params = (act, ep_group)


def _backward(ctx, grad_y):  # noqa: ANN001, ANN202
    x, idx, w, ids, gu, down = ctx.saved_tensors
    dx, dw, dgu, ddown = torch.ops.autoplan.moe_experts_backward(grad_y, x, idx, w, ids, gu, down, *ctx.params)
    return dx, None, dw, None, dgu, ddown, None, None


moe_experts.register_autograd(_backward, setup_context=_setup_context)

MOE_OPS = frozenset({torch.ops.autoplan.moe_experts.default, torch.ops.autoplan.moe_experts_backward.default})


# --------------------------------------------------------------------------------------------
# Routing Hugging Face experts to the op while tracing


def _routable(module: torch.nn.Module, default_gate: object) -> str | None:
    """The activation name if ``module`` is a standard-layout experts module the op computes
    (``default_gate``: transformers' own ``act(gate) * up``, which a model may override)."""
    config = getattr(module, "config", None)
    act = getattr(config, "hidden_act", None)
    standard = (
        getattr(module, "has_gate", False)
        and not getattr(module, "has_bias", True)
        and not getattr(module, "is_transposed", True)
        and getattr(module, "is_concatenated", False)
        and not getattr(module, "has_post_expert_norm", True)
        and getattr(type(module), "_apply_gate", None) is default_gate
        and isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
        and isinstance(getattr(module, "down_proj", None), torch.Tensor)
    )
    return act if standard and act in ACTIVATIONS else None


def _routed(implementation: Callable[..., torch.Tensor], default_gate: object) -> Callable[..., torch.Tensor]:
    def forward(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:  # fmt: skip
        act = _routable(module, default_gate)
        if act is None or args or kwargs:
            return implementation(module, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        gu, down = module.gate_up_proj, module.down_proj
        assert isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor)
        ids = torch.arange(gu.shape[0], device=hidden_states.device)
        return torch.ops.autoplan.moe_experts(hidden_states, top_k_index, top_k_weights, ids, gu, down, act, "")

    return forward


@contextlib.contextmanager
def experts_as_single_op() -> Iterator[None]:
    """Route Hugging Face experts calls (any ``experts_implementation``) to ``autoplan::moe_experts``
    while tracing (restored on exit); a no-op without ``transformers``."""
    try:
        from transformers.integrations.moe import ExpertsInterface, _default_apply_gate
    except ImportError:
        yield
        return
    original = ExpertsInterface.get_interface

    def get_interface(self: Any, experts_implementation: str, default: Callable[..., Any]) -> Callable[..., Any]:
        return _routed(original(self, experts_implementation, default), _default_apply_gate)

    ExpertsInterface.get_interface = get_interface  # type: ignore[method-assign]
    try:
        yield
    finally:
        ExpertsInterface.get_interface = original  # type: ignore[method-assign]


# --------------------------------------------------------------------------------------------
# Strategies

_R, _S0, _P = Replicate(), Shard(0), Partial()
_FORWARD_ROWS: list[list[Placement | None]] = [
    # y, x, idx, w, ids, gate_up, down
    [_R, _R, _R, _R, _R, _R, _R],  # replicate
    [_S0, _S0, _S0, _S0, _R, _R, _R],  # data
    [_P, _R, _R, _R, _S0, _S0, _S0],  # experts
    [_S0, _S0, _S0, _S0, _S0, _S0, _S0],  # expert_parallel
]
_BACKWARD_ROWS: list[list[Placement | None]] = [
    # dx, dw, d_gate_up, d_down, grad_y, x, idx, w, ids, gate_up, down
    [_R, _R, _R, _R, _R, _R, _R, _R, _R, _R, _R],
    [_S0, _S0, _P, _P, _S0, _S0, _S0, _S0, _R, _R, _R],
    [_P, _P, _S0, _S0, _R, _R, _R, _R, _S0, _S0, _S0],
    [_S0, _S0, _S0, _S0, _S0, _S0, _S0, _S0, _S0, _S0, _S0],
]


_X, _INDEX, _GATE_UP, _DOWN = 0, 1, 4, 5
"""Positions of the forward op's tensor inputs ``x, top_k_index, top_k_weights, expert_ids,
gate_up_proj, down_proj``; the backward's are one later (``grad_y`` comes first)."""


def _first(backward: bool) -> int:
    """Offset of the forward inputs among the op's tensor inputs."""
    return int(backward)


def is_moe_backward(op: object) -> bool:
    return op is torch.ops.autoplan.moe_experts_backward.default


def ep_axes(input_specs: Sequence[Sequence[Placement]], *, backward: bool) -> list[int]:
    """Mesh axes on which a strategy of a MoE op is ``expert_parallel`` (tokens and experts split)."""
    first = _first(backward)
    return [
        d
        for d, (px, pg) in enumerate(zip(input_specs[first + _X], input_specs[first + _GATE_UP], strict=True))
        if isinstance(px, Shard) and isinstance(pg, Shard)
    ]


def _allowed_ep_axes(mesh: DeviceMesh, ep_group: str) -> frozenset[int]:
    if ep_group == UNDECIDED:
        return frozenset(range(mesh.ndim))
    if not ep_group:
        return frozenset()
    return mesh_axes_of_group(mesh, ep_group)


def _strategy(op_schema: OpSchema, *, backward: bool) -> OpStrategy:
    mesh = op_schema.get_mesh_from_args()
    ep_group = op_schema.args_schema[-1]
    assert isinstance(ep_group, str), ep_group
    allowed = _allowed_ep_axes(mesh, ep_group)
    must = ep_group not in ("", UNDECIDED)  # a named group: expert parallel on its axis only
    gu = _first(backward) + _GATE_UP

    def valid(input_specs: list[DTensorSpec], output_spec: object) -> bool:
        on = ep_axes([s.placements for s in input_specs], backward=backward)
        if len(on) > 1 or not set(on) <= allowed or (must and not on):
            return False
        # beside an expert-parallel axis the experts are whole on every other axis
        return not on or all(not isinstance(p, Shard) for d, p in enumerate(input_specs[gu].placements) if d != on[0])

    rows = _BACKWARD_ROWS if backward else _FORWARD_ROWS
    return expand_to_full_mesh_op_strategy(
        mesh, op_schema, rows, input_index=4 if backward else 1, is_valid_strategy_cb=valid
    )


_PROP = DTensor._op_dispatcher.sharding_propagator
_PROP.register_op_strategy(
    torch.ops.autoplan.moe_experts.default,
    functools.partial(_strategy, backward=False),
    schema_info=RuntimeSchemaInfo(6),
)
_PROP.register_op_strategy(
    torch.ops.autoplan.moe_experts_backward.default,
    functools.partial(_strategy, backward=True),
    schema_info=RuntimeSchemaInfo(7),
)


def planning_args(op: object, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The arguments the strategy table calls a MoE op's strategy function with: ``ep_group``
    undecided, so ``expert_parallel`` is offered on every axis (other ops: ``args`` as they are)."""
    return (*args[:-1], UNDECIDED) if op in MOE_OPS else args


def with_ep_group(node: fx.Node, args: tuple[Any, ...], input_specs: Sequence[Sequence[Placement]],
                  mesh: DeviceMesh) -> tuple[Any, ...]:  # fmt: skip
    """``args`` of a generated MoE node with the plan's expert-parallel group written in (the
    group of the axis its strategy splits both tokens and experts on; ``""`` for none)."""
    if node.target not in MOE_OPS:
        return args
    axes = ep_axes(input_specs, backward=is_moe_backward(node.target))
    return (*args[:-1], mesh.get_group(axes[0]).group_name if axes else "")


# --------------------------------------------------------------------------------------------
# Cost


def _dims(inputs: Sequence[torch.Tensor], *, backward: bool) -> tuple[int, int, int, int]:
    """Routed rows S = N*k, hidden H, expert hidden I, experts E of a MoE op's tensor inputs."""
    first = _first(backward)
    x, idx, down = inputs[first + _X], inputs[first + _INDEX], inputs[first + _DOWN]
    return idx.numel(), x.shape[-1], down.shape[-1], down.shape[0]


@register_flops(torch.ops.autoplan.moe_experts.default)
def _forward_flops(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> float:
    s, h, i, _ = _dims(inputs, backward=False)
    return 6.0 * s * h * i


@register_flops(torch.ops.autoplan.moe_experts_backward.default)
def _backward_flops(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> float:
    s, h, i, _ = _dims(inputs, backward=True)
    return 16.0 * s * h * i


def _per_expert(s: int, e: int) -> int:
    return max(1, -(-s // e))


@register_matmul_shapes(torch.ops.autoplan.moe_experts.default)
def _forward_gemms(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> tuple[Gemm, ...]:
    """Per expert, its ``S/E`` rows (balanced routing): gate/up then down."""
    s, h, i, e = _dims(inputs, backward=False)
    m = _per_expert(s, e)
    return Gemm(e, m, h, 2 * i), Gemm(e, m, i, h)


@register_matmul_shapes(torch.ops.autoplan.moe_experts_backward.default)
def _backward_gemms(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> tuple[Gemm, ...]:
    """Recomputed gate/up, dH = dY down, d down = dY^T H, dX = dGU gate_up, d gate_up = dGU^T X."""
    s, h, i, e = _dims(inputs, backward=True)
    m = _per_expert(s, e)
    return Gemm(e, m, h, 2 * i), Gemm(e, m, h, i), Gemm(e, h, m, i), Gemm(e, m, 2 * i, h), Gemm(e, 2 * i, m, h)


@dataclass(frozen=True, slots=True)
class InOpExchange:
    """The all-to-alls an expert-parallel MoE op runs inside (:func:`moe_exchanges`)."""

    axis: int
    """Mesh axis of the exchange (the strategy's ``expert_parallel`` axis)."""
    count: int
    """Collectives issued: the per-expert row counts, the rows out, the results back."""
    bytes: float
    """Bytes each rank sends, summed over the ``count`` exchanges (full-size, the ring convention
    of :mod:`autoplan.cost_models.comm`)."""
    time_s: float


def moe_exchanges(node: fx.Node, input_specs: Sequence[Sequence[Placement]], cluster: Cluster) -> InOpExchange | None:
    """The all-to-alls ``node`` runs inside under a strategy with these input specs (``None`` for
    other ops and strategies without ``expert_parallel``): see the module docstring."""
    if node.target not in MOE_OPS:
        return None
    backward = is_moe_backward(node.target)
    axes = ep_axes(input_specs, backward=backward)
    if not axes:
        return None
    routed_bytes, experts = moe_routing(node, input_specs, cluster.mesh_shape)
    n = cluster.mesh_shape[axes[0]]
    link = cluster.axis_link(axes[0])
    exchanged = expert_exchange_bytes(routed_bytes, experts, backward=backward)
    time_s = expert_exchange_s(routed_bytes, experts, n, link, backward=backward)
    return InOpExchange(axis=axes[0], count=len(exchanged), bytes=sum(exchanged), time_s=time_s)


def moe_routing(
    node: fx.Node, input_specs: Sequence[Sequence[Placement]], mesh_shape: Sequence[int]
) -> tuple[float, int]:
    """``(routed_bytes, experts)`` of a MoE op under a strategy with these input specs on a mesh of
    ``mesh_shape``: the bytes of the rows one rank routes (its share of the tokens times top-k,
    a row of the hidden size) and the op's number of experts."""
    first = _first(is_moe_backward(node.target))
    x, idx, down = (node.args[first + i].meta["val"] for i in (_X, _INDEX, _DOWN))  # type: ignore[union-attr]
    token_shards = 1
    for p, n in zip(input_specs[first + _X], mesh_shape, strict=True):
        if isinstance(p, Shard):
            token_shards *= n
    return idx.numel() / token_shards * tensor_bytes(x) / x.shape[0], int(down.shape[0])


def routed_experts(node: fx.Node) -> int:
    """The number of experts of a MoE op."""
    down = node.args[_first(is_moe_backward(node.target)) + _DOWN]
    assert isinstance(down, fx.Node)
    return int(down.meta["val"].shape[0])


def expert_weights(node: fx.Node) -> tuple[fx.Node, fx.Node]:
    """The stacked expert weights a MoE op reads: ``gate_up_proj`` and ``down_proj``."""
    first = _first(is_moe_backward(node.target))
    gate_up, down = node.args[first + _GATE_UP], node.args[first + _DOWN]
    assert isinstance(gate_up, fx.Node) and isinstance(down, fx.Node)
    return gate_up, down


def moe_comm_time_s(node: fx.Node, input_specs: Sequence[Sequence[Placement]], cluster: Cluster) -> float:
    """Time of :func:`moe_exchanges` (0 without any)."""
    exchange = moe_exchanges(node, input_specs, cluster)
    return exchange.time_s if exchange is not None else 0.0


def moe_time_factor(node: fx.Node, input_specs: Sequence[Sequence[Placement]]) -> float:
    """``ROUTING_IMBALANCE`` for a MoE op whose experts are split (the busiest shard sets the
    time), else 1."""
    if node.target not in MOE_OPS:
        return 1.0
    gu = _first(is_moe_backward(node.target)) + _GATE_UP
    return ROUTING_IMBALANCE if any(isinstance(p, Shard) for p in input_specs[gu]) else 1.0
