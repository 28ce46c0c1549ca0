"""A learned additive attention mask (T5's relative position bias) gets its gradient.

``autoplan::sdpa`` (passes/attention.py) stands for ``F.scaled_dot_product_attention`` in every
traced graph. Its backward returns the float mask's gradient when the mask requires grad, summed
over the dims the mask broadcasts along; checked here in float64 against PyTorch's own attention
(the math backend) and by finite differences, then end to end: a T5-style model whose learned
bias is passed to SDPA as ``attn_mask`` is planned for 2 CPU ranks and trains like one device.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import autoplan
import autoplan.passes.attention  # noqa: F401 - registers the ops
from autoplan.cost_models.cluster import Cluster
from autoplan.passes.attention import _routed_sdpa
from autoplan.passes.placement import spec_str
from autoplan.passes.strategies import build_strategy_table
from autoplan.passes.trace import trace_training_step
from autoplan.planner.mesh import planning_mesh
from tests import zoo
from tests.harness import Case, SeededBatches, assert_trains_like_reference, run_case

B, H, T, D = 2, 4, 6, 8


def _reference_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """PyTorch's attention, math backend (its float64 kernel)."""
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _qkv_mask(mask_shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(3))
    mask = torch.randn(mask_shape, dtype=torch.float64, generator=g).requires_grad_(True)
    return q, k, v, mask


MASK_SHAPES = [(1, H, T, T), (B, 1, T, T), (B, H, T, T), (T, T), (B, 1, 1, T)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mask_shape", MASK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_mask_gradient_matches_torch_attention_in_float64(mask_shape: tuple[int, ...], causal: bool) -> None:
    """``causal``: the learned bias plus a -inf upper triangle, as T5's decoder builds its mask."""
    q, k, v, bias = _qkv_mask(mask_shape)
    mask = bias + torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1) if causal else bias
    ours = torch.ops.autoplan.sdpa(q, k, v, mask, 0.0, False, None, False)
    ref = _reference_sdpa(q, k, v, mask)
    grad = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ours_grads = torch.autograd.grad(ours, (q, k, v, bias), grad)
    ref_grads = torch.autograd.grad(ref, (q, k, v, bias), grad)

    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for name, a, b in zip("qkvm", ours_grads, ref_grads, strict=True):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"d{name}")
    assert ours_grads[3].abs().sum() > 0  # the mask's gradient is a real one, not zeros


@pytest.mark.parametrize("mask_shape", [(1, 2, 3, 3), (2, 1, 3, 3)], ids=["1xHxTxT", "Bx1xTxT"])
def test_mask_gradient_passes_gradcheck(mask_shape: tuple[int, ...]) -> None:
    """Finite differences (small sizes: gradcheck perturbs every element): B=2, H=2, T=3, D=4."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 3, 4, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(3))
    mask = torch.randn(mask_shape, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, m: torch.ops.autoplan.sdpa(q, k, v, m, 0.0, False, 0.5, False), (q, k, v, mask)
    )


def test_mask_gradient_with_grouped_query_attention() -> None:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, H, T, D, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(B, H // 2, T, D, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    mask = torch.randn(1, H, T, T, dtype=torch.float64, generator=g, requires_grad=True)
    ours = torch.ops.autoplan.sdpa(q, k, v, mask, 0.0, False, None, True)
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    for a, b in zip(torch.autograd.grad(ours.sum(), (q, k, v, mask)), torch.autograd.grad(ref.sum(), (q, k, v, mask))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_mask_without_grad_keeps_the_three_output_backward() -> None:
    """A constant mask (padding, causal) leaves the graph as before: no mask gradient computed."""
    q, k, v, mask = _qkv_mask((B, 1, T, T))
    mask = mask.detach()
    ours = torch.ops.autoplan.sdpa(q, k, v, mask, 0.0, False, None, False)
    grads = torch.autograd.grad(ours.sum(), (q, k, v))
    ref = torch.autograd.grad(_reference_sdpa(q, k, v, mask).sum(), (q, k, v))
    for a, b in zip(grads, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_attention_with_dropout_is_traced_as_torch_attention_with_exact_gradients() -> None:
    """The single op's backward has no dropout: with ``dropout_p > 0`` the routed call is
    PyTorch's own attention (same random mask for the same seed, so the same values and
    gradients), and the op itself refuses dropout instead of differentiating it wrongly."""
    q, k, v, mask = _qkv_mask((1, H, T, T))
    torch.manual_seed(5)
    ours = _routed_sdpa(q, k, v, attn_mask=mask, dropout_p=0.5)
    ours_grads = torch.autograd.grad(ours.sum(), (q, k, v, mask))
    torch.manual_seed(5)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.5)
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v, mask))
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    for a, b in zip(ours_grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="dropout"):
        torch.ops.autoplan.sdpa(q, k, v, mask, 0.5, False, None, False)


# --- T5-style model: learned relative position bias as the attention mask -------------------

VOCAB, WIDTH, SEQ, NUM_BUCKETS = 64, 32, 8, 9


class T5StyleAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(WIDTH, WIDTH, bias=False)
        self.k = nn.Linear(WIDTH, WIDTH, bias=False)
        self.v = nn.Linear(WIDTH, WIDTH, bias=False)
        self.o = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (p(x).view(b, t, H, c // H).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)  # T5: no 1/sqrt(d)
        return self.o(y.transpose(1, 2).reshape(b, t, c))


class T5StyleDecoder(nn.Module):
    """Token embedding, two attention + MLP blocks sharing one learned relative position bias
    (``nn.Embedding(num_buckets, heads)``, looked up by clipped relative distance, as T5), plus a
    causal -inf mask: ``attn_mask = bias (1, H, T, T) + causal (T, T)``, a float mask that
    requires grad."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.relative_attention_bias = nn.Embedding(NUM_BUCKETS, H)
        self.attn = nn.ModuleList(T5StyleAttention() for _ in range(2))
        self.mlp = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.ReLU(), nn.Linear(2 * WIDTH, WIDTH)) for _ in range(2)
        )
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        pos = torch.arange(t, device=ids.device)
        distance = (pos[None, :] - pos[:, None]).clamp(-(NUM_BUCKETS // 2), NUM_BUCKETS // 2) + NUM_BUCKETS // 2
        bias = self.relative_attention_bias(distance).permute(2, 0, 1).unsqueeze(0)  # (1, H, T, T)
        causal = torch.full((t, t), float("-inf"), device=ids.device).triu(1)
        mask = bias + causal
        x = self.embed(ids)
        for attn, mlp in zip(self.attn, self.mlp, strict=True):
            x = x + attn(x, mask)
            x = x + mlp(x)
        return self.head(x)


t5_batch = functools.partial(zoo.token_batch, seq=SEQ, vocab=VOCAB)
"""``t5_batch(batch=8, seed=1) -> (ids, labels)``: next-token pairs over the T5-style vocabulary."""
t5_loss = zoo.cross_entropy_mean


def _mask_grad_node(traced: autoplan.Plan | object) -> str:
    return next(
        n.name
        for n in traced.graph_module.graph.nodes  # type: ignore[attr-defined]
        if n.target is torch.ops.autoplan.sdpa_backward_with_mask.default
    )


def test_t5_style_model_traces_with_the_bias_gradient() -> None:
    """Was refused ("1 parameter(s) get no gradient from the loss (e.g.
    'relative_attention_bias.weight')"); now the bias gets its gradient through the mask."""
    model = T5StyleDecoder()
    ids, labels = t5_batch()
    traced = trace_training_step(model, (ids,), loss_fn=t5_loss, example_targets=(labels,))
    ops = [str(n.target) for n in traced.graph_module.graph.nodes]
    assert ops.count("autoplan.sdpa_backward_with_mask.default") == 2
    assert "aten.scaled_dot_product_attention.default" not in ops

    # the traced step's gradients are eager autograd's (float32)
    params = dict(model.named_parameters())
    flat = [p.detach() for p in params.values()] + [ids, labels]
    loss, *grads = traced.graph_module(*flat)
    ref_loss = t5_loss(model(ids), labels)
    ref_grads = torch.autograd.grad(ref_loss, list(params.values()))
    torch.testing.assert_close(loss, ref_loss)
    for name, g, r in zip(params, grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=name)
    assert grads[list(params).index("relative_attention_bias.weight")].abs().sum() > 0


def test_mask_gradient_strategies_split_or_sum_the_mask_gradient() -> None:
    """On a batch split the (1, H, T, T) mask is shared by every shard: it stays replicated and
    its gradient is a partial sum (P); on a heads split both are split on the heads dim."""
    ids, labels = t5_batch()
    traced = trace_training_step(T5StyleDecoder(), (ids,), loss_fn=t5_loss, example_targets=(labels,))
    name = _mask_grad_node(traced)
    with planning_mesh(Cluster.preset("2xCPU")) as mesh:
        table = build_strategy_table(traced, mesh)
    # outputs (dq, dk, dv, dmask); inputs (grad_out, q, k, v, mask)
    rows = {
        (spec_str(s.input_specs[1]), spec_str(s.input_specs[4]), spec_str(s.output_specs[3]))
        for s in table.nodes[name].strategies
    }
    assert ("S(0)", "R", "P") in rows, rows
    assert ("S(1)", "S(1)", "S(1)") in rows, rows
    assert ("R", "R", "R") in rows, rows
    assert not any(q_spec == "S(0)" and mask_grad != "P" for q_spec, _, mask_grad in rows), rows


class CausalBias2D(nn.Module):
    """Attention with a ``(T, T)`` float mask: a constant causal mask, or a learned one."""

    def __init__(self, *, learned: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        causal = torch.full((SEQ, SEQ), float("-inf")).triu(1)
        self.mask = nn.Parameter(causal) if learned else None
        self.register_buffer("causal", causal)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, H, c // H).permute(2, 0, 3, 1, 4)
        mask = self.mask if self.mask is not None else self.causal
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("learned", [False, True], ids=["constant", "learned"])
def test_a_mask_without_batch_or_heads_dims_is_never_split(learned: bool) -> None:
    """A ``(T, S)`` mask broadcasts over the batch and the heads: when q is split on either, the
    mask stays whole (it used to be split on its dim 0, which is T) and its gradient is a
    partial sum."""
    x, y = torch.randn(4, SEQ, WIDTH), torch.randn(4, H, SEQ, WIDTH // H)
    traced = trace_training_step(CausalBias2D(learned=learned), (x,), loss_fn=F.mse_loss, example_targets=(y,))
    with planning_mesh(Cluster.preset("2xCPU")) as mesh:
        table = build_strategy_table(traced, mesh)
    forward = next(n.name for n in traced.graph_module.graph.nodes if n.target is torch.ops.autoplan.sdpa.default)
    # sdpa: output O; inputs q, k, v, mask
    rows = {(spec_str(s.input_specs[0]), spec_str(s.input_specs[3])) for s in table.nodes[forward].strategies}
    assert rows == {("R", "R"), ("S(0)", "R"), ("S(1)", "R")}, rows
    if learned:
        backward = table.nodes[_mask_grad_node(traced)].strategies
        grads = {(spec_str(s.input_specs[1]), spec_str(s.output_specs[3])) for s in backward}
        assert grads == {("R", "R"), ("S(0)", "P"), ("S(1)", "P")}, grads


_t5_case = functools.partial(
    Case,
    build_model=T5StyleDecoder,
    batches=SeededBatches(t5_batch),
    loss_fn=t5_loss,
    preset="2xCPU",
    compute_slowdown=1e5,
    optimizer="sgd_momentum",
    lr=0.1,
)


def _attention_backward_layouts(plan: autoplan.Plan) -> list[dict[str, object]]:
    return [d for d in plan.nodes.values() if d["op"] == "autoplan.sdpa_backward_with_mask.default"]


@pytest.mark.slow
def test_t5_style_bias_data_parallel_on_2_ranks_trains_like_single_device() -> None:
    case = _t5_case(name="t5-bias-dp-2", pins={"input_0": "S(0)", "target_0": "S(0)", "*": "R"})
    results = run_case(case)
    plan = results[0]["plan"]
    layouts = _attention_backward_layouts(plan)
    # each rank's attention sees half the batch; the bias gradient is summed over the ranks
    assert layouts and all(d["out"][3] == ["P"] and d["in"][1] == ["S(0)"] for d in layouts), layouts
    assert_trains_like_reference(results)
    assert all(math.isfinite(x) for r in results for x in r["losses"])


@pytest.mark.slow
def test_t5_style_bias_head_parallel_on_2_ranks_trains_like_single_device() -> None:
    case = _t5_case(
        name="t5-bias-heads-2",
        pins={
            "input_0": "R",
            "target_0": "R",
            "attn.*.q.weight": "S(0)",
            "attn.*.k.weight": "S(0)",
            "attn.*.v.weight": "S(0)",
            "relative_attention_bias.weight": "S(1)",
        },
    )
    results = run_case(case)
    layouts = _attention_backward_layouts(results[0]["plan"])
    # each rank attends over its own 2 of the 4 heads with its 2 heads of the bias
    assert layouts and all(d["in"][1] == ["S(1)"] and d["in"][4] == ["S(1)"] for d in layouts), layouts
    assert_trains_like_reference(results)
