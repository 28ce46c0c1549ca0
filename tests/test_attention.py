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
