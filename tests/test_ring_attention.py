"""Ring attention's kernels and price (:mod:`autoplan.passes.ring_attention`).

The kernels run on gloo ranks against PyTorch's own ``F.scaled_dot_product_attention`` on the whole
sequence (fp32, 1e-5); the price restates the module docstring's message and byte counts. The
planner choosing the ring and the whole model training like one device are in
``tests/test_context_parallel.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autoplan
from autoplan.passes import ring_attention as ring
from autoplan.passes.ring_attention import ring_attention, ring_attention_backward, ring_cost, zigzag_moved_fraction
from tests import zoo
from tests.harness import run_ranks

_CASES = [(True, 4, 4), (True, 4, 2), (False, 4, 4), (False, 4, 1)]
"""(causal, query heads, key/value heads): multi-head, grouped-query and multi-query attention."""


def _ring_errors(rank: int, world_size: int) -> list[tuple[bool, int, int, float]]:
    """Largest error of the output, dQ, dK and dV of each case against the whole-sequence op."""
    group = dist.group.WORLD.group_name
    errors = []
    for causal, hq, hk in _CASES:
        torch.manual_seed(0)
        t = 8 * world_size
        q, do = torch.randn(2, hq, t, 8), torch.randn(2, hq, t, 8)
        k, v = torch.randn(2, hk, t, 8), torch.randn(2, hk, t, 8)
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        ref = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, enable_gqa=hq != hk)
        ref.backward(do)

        def mine(x: torch.Tensor) -> torch.Tensor:
            return x.chunk(world_size, dim=2)[rank].contiguous()

        out = ring_attention(mine(q), mine(k), mine(v), causal, None, group)
        grads = ring_attention_backward(mine(do), mine(q), mine(k), mine(v), causal, None, group)
        pairs = zip((out, *grads), (ref, qq.grad, kk.grad, vv.grad), strict=True)
        err = max(float((a - mine(b.detach())).abs().max()) for a, b in pairs)
        errors.append((causal, hq, hk, err))
    return errors


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_ring_kernels_equal_attention_over_the_whole_sequence(world_size: int):
    for errors in run_ranks(_ring_errors, world_size, timeout_s=300):
        assert [e[:3] for e in errors] == _CASES
        assert all(e[3] < 1e-5 for e in errors), errors


def test_zigzag_moves_half_a_shard_on_2_ranks_and_all_of_one_beyond():
    assert zigzag_moved_fraction(1) == 0.0
    assert zigzag_moved_fraction(2) == 0.5  # rank 0 keeps chunk 0, rank 1 keeps chunk 2
    assert [zigzag_moved_fraction(n) for n in (3, 4, 8, 16)] == [1.0] * 4


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(shape, device="meta")


@pytest.mark.parametrize("causal", [True, False])
def test_ring_price_counts_the_shifts_the_accumulators_and_the_zigzag_moves(causal: bool):
    cluster = autoplan.Cluster.preset("4xH100")
    n = 4
    q, k, v = _meta(1, 8, 1024, 128), _meta(1, 2, 1024, 128), _meta(1, 2, 1024, 128)
    kv_bytes = 2 * 2 * 1024 * 128 * 4.0  # k and v, fp32
    q_bytes = 8 * 1024 * 128 * 4.0
    fwd = ring_cost((q, k, v), causal=causal, backward=False, axis=0, cluster=cluster, step_compute_s=1.0)
    bwd = ring_cost((q, k, v), causal=causal, backward=True, axis=0, cluster=cluster, step_compute_s=1.0)
    moved = 1.0 if causal else 0.0  # of 4 ranks, rank 1 sends both its chunks (2 -> rank 2, 3 -> rank 3)
    # forward: n-1 shifts of k and v; causal: q, k, v there and the output back
    assert fwd.count == (n - 1) * 2 + (2 * 4 if causal else 0)
    assert fwd.bytes == pytest.approx((n - 1) * kv_bytes + moved * (2 * q_bytes + kv_bytes))
    # backward: the forward's ring again, n-1 shifts of k, v and their fp32 accumulators, the last
    # hop home; causal: q, k, v, dO there and dQ, dK, dV back
    acc_bytes = kv_bytes  # fp32 inputs: the accumulators are as large as k and v
    assert bwd.count == (n - 1) * 2 + (n - 1) * 4 + 2 + (2 * 7 if causal else 0)
    assert bwd.bytes == pytest.approx(2 * (n - 1) * kv_bytes + n * acc_bytes + moved * (3 * q_bytes + 2 * kv_bytes))
    # a second of compute per step hides every shift: only the last hop and the zigzag moves wait
    assert (fwd.exposed_s > 0) == causal and fwd.exposed_s < fwd.total_s
    assert 0 < bwd.exposed_s < bwd.total_s
    shifts_hidden = ring_cost((q, k, v), causal=False, backward=False, axis=0, cluster=cluster, step_compute_s=1.0)
    assert shifts_hidden.exposed_s == 0.0 < shifts_hidden.total_s
    no_compute = ring_cost((q, k, v), causal=False, backward=False, axis=0, cluster=cluster, step_compute_s=0.0)
    assert no_compute.exposed_s == pytest.approx(no_compute.total_s)


def test_ring_price_on_cpu_ranks_credits_no_overlap():
    """CPU ranks are priced with no collective overlapping compute (``comm.overlaps_compute``)."""
    cluster = autoplan.Cluster.preset("2xCPU")
    q = _meta(1, 1, 256, 16)
    cost = ring_cost((q, q, q), causal=True, backward=True, axis=0, cluster=cluster, step_compute_s=10.0)
    assert cost.exposed_s == pytest.approx(cost.total_s) and cost.total_s > 0


@pytest.mark.slow
def test_joint_search_runs_a_ring_where_the_heads_run_out_and_lists_its_transfers():
    """Two heads on 4 H100 with one sequence of 4,096 tokens: the 4-way axis cannot split the heads
    (Ulysses), so attention splits the sequence and runs the ring; the estimate lists its
    point-to-point messages on that axis (2 layers x (forward 3 shifts of k, v + 8 zigzag
    messages, backward 3 + 3 shifts of k, v and their accumulators, the last hop, 14 zigzag)), part
    of them hidden behind the ring's blocks."""
    with torch.device("meta"):
        model = zoo.llama_lm(layers=2, hidden=512, heads=2, kv_heads=2, ffn=1024, vocab=1024, positions=4096)
    ids = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    plan = autoplan.plan(model, "4xH100", example_inputs=(ids,), loss_fn=zoo.lm_loss, example_targets=(ids,),
                         global_batch_size=1, optimizer="adamw")  # fmt: skip

    assert plan.config is not None and plan.config.tp == 4
    attention = [d for d in plan.nodes.values() if d["op"].startswith("autoplan.sdpa")]
    assert attention and all(d["in"][0] == ["S(2)"] for d in attention), attention
    assert "context" in plan.parallelism()["tp"]
    rings = [r for r in plan.estimate.comm.rows if r.kind == "send_recv"]
    assert [r.axis for r in rings] == ["tp"], plan.estimate.comm.rows
    assert rings[0].count == 2 * ((3 * 2 + 8) + (3 * 2 + 3 * 4 + 2 + 14))
    assert 0 < rings[0].exposed_s < rings[0].total_s


@pytest.mark.parametrize("causal", [True, False])
def test_fused_blocks_equal_the_explicit_formulas(causal: bool):
    """The blocks the ring runs (PyTorch's fused kernel and its backward, given the merged output
    and log-sum-exp) against ``_block_math`` / ``_block_backward_math`` (the path of devices with
    no fused kernel wired), on this machine's CPU; ``benchmarks/ring_attention_blocks.py`` checks
    CUDA's kernels the same way."""
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(2, 4, 32, 16) for _ in range(4))
    scale = 0.25
    fused, math = ring._block(q, k, v, causal, scale), ring._block_math(q, k, v, causal, scale)
    grads = ring._block_backward(dout, q, k, v, *math, causal, scale)
    ref = ring._block_backward_math(dout, q, k, v, *math, causal, scale)
    for a, b in zip((*fused, *grads), (*math, *ref), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
