"""``autoplan::sdpa``: same values and gradients as PyTorch's attention, and a head-sharded rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autoplan.passes.attention  # noqa: F401 - registers the ops
from autoplan.passes.attention import attention_as_single_op


@pytest.mark.parametrize(
    ("gqa", "causal", "mask"),
    [(False, True, None), (True, False, "bool"), (False, False, "float"), (True, True, None)],
)
def test_attention_op_matches_torch_sdpa_values_and_gradients(gqa: bool, causal: bool, mask: str | None) -> None:
    g = torch.Generator().manual_seed(0)
    kv_heads = 2 if gqa else 4
    q = torch.randn(2, 4, 8, 16, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, kv_heads, 8, 16, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, kv_heads, 8, 16, dtype=torch.float64, generator=g, requires_grad=True)
    m = None
    if mask == "bool":
        m = torch.rand(2, 1, 8, 8, generator=g) > 0.3
        m[..., 0] = True  # every query sees at least one key
    elif mask == "float":
        m = torch.randn(2, 1, 8, 8, dtype=torch.float64, generator=g)
    ours = torch.ops.autoplan.sdpa(q, k, v, m, 0.0, causal, None, gqa)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, enable_gqa=gqa)
    grad = torch.randn(ref.shape, dtype=torch.float64, generator=g)
    ours_grads = torch.autograd.grad(ours, (q, k, v), grad)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(ours_grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_tracing_routes_sdpa_to_the_single_op_and_restores_torch() -> None:
    original = F.scaled_dot_product_attention
    with attention_as_single_op():
        assert F.scaled_dot_product_attention is not original
    assert F.scaled_dot_product_attention is original


def _traced_llama(*, heads: int, kv_heads: int) -> torch.fx.GraphModule:
    from autoplan.planner.tracing import trace_repeated
    from tests.zoo import llama_lm, lm_loss

    torch.manual_seed(0)
    model = llama_lm(layers=2, hidden=16 * heads, heads=heads, kv_heads=kv_heads, ffn=64, vocab=97, positions=16)
    ids = torch.randint(0, 97, (2, 16))
    traced, _, _ = trace_repeated(model, (ids,), (ids,), lm_loss, 2, reduce=False)
    return traced


def test_grouped_query_attention_is_traced_with_its_key_value_heads_unrepeated() -> None:
    """Hugging Face repeats a GQA model's key/value heads before SDPA under a mask; traced by
    autoplan they reach the single op as they are (``enable_gqa``), so the step saves, converts
    and sends ``H / G`` times less of them, and the traced step is still the model's."""
    import os

    from autoplan.passes.attention import GQA_SWITCH

    before = os.environ.get(GQA_SWITCH)
    traced = _traced_llama(heads=8, kv_heads=2)
    assert os.environ.get(GQA_SWITCH) == before  # restored
    calls = [n for n in traced.graph_module.graph.nodes if n.target == torch.ops.autoplan.sdpa.default]
    assert len(calls) == 2
    for n in calls:
        q, k, v = (a.meta["val"].shape for a in n.args[:3])
        assert (q[1], k[1], v[1]) == (8, 2, 2) and n.args[7] is True, n.args


@pytest.mark.parametrize(("heads", "kv_heads", "split"), [(8, 2, True), (12, 3, False), (6, 6, True)])
def test_heads_split_only_where_both_query_and_key_value_heads_divide(heads: int, kv_heads: int, split: bool) -> None:
    """On 2 ranks, GQA's heads split only where the key/value heads divide too (12 query heads
    and 3 key/value heads: rank 1's queries 6-11 read key/value heads 1 and 2, an uneven shard
    holds 2 alone); equal heads split as before (DTensor's uneven shards)."""
    from autoplan.cost_models.cluster import Cluster
    from autoplan.passes import pass_order
    from autoplan.planner.mesh import planning_mesh

    traced = _traced_llama(heads=heads, kv_heads=kv_heads)
    with planning_mesh(Cluster.preset("2xCPU")) as mesh:
        table = pass_order.STRATEGIES(traced, mesh)
    for name in ("sdpa", "sdpa_backward"):
        ns = table.nodes[name]
        first = 1 if name == "sdpa_backward" else 0
        heads_split = [s for s in ns.strategies if str(s.input_specs[first][0]) == "S(1)"]
        assert bool(heads_split) == split, [str(s.input_specs[first]) for s in ns.strategies]
