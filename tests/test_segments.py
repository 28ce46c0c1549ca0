"""Segment shards ``S(d)/k`` (autoplan.passes.segments): a fused projection split by heads/segments.

Unit tests on a fake 2-rank mesh (no communication): the placement text, the transitions the
planner prices, the DTensor rules for ``split``/``cat`` (values on the local shard), and the
strategy table of a fused-QKV GPT-2 (offered) and of an unfused Llama (absent).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import autoplan
from autoplan.cost_models.comm import plan_transition
from autoplan.passes.placement import is_shardable, parse_placement, pin_admits, placement_str
from autoplan.passes.segments import _merged_groups, merged_dim_counts
from autoplan.passes.strategies import build_strategy_table
from autoplan.passes.trace import trace_training_step
from autoplan.planner.mesh import planning_mesh
from tests import zoo

SEG3 = _StridedShard(1, split_factor=3)


def test_segment_shard_text_round_trips_and_rejects_one_segment():
    assert placement_str(SEG3) == "S(1)/3"
    assert parse_placement("S(1)/3") == SEG3
    assert parse_placement("S(1)") == Shard(1)
    with pytest.raises(ValueError, match="malformed"):
        parse_placement("S(1)/1")


def test_segment_shard_needs_segments_that_divide_evenly():
    assert is_shardable((SEG3,), (32, 96), (2,))  # 3 segments of 32, 16 per rank
    assert is_shardable((SEG3,), (32, 90), (2,))  # 3 segments of 30, 15 per rank
    assert not is_shardable((SEG3,), (32, 99), (2,))  # 3 segments of 33: not split evenly by 2
    assert not is_shardable((SEG3, Shard(1)), (32, 96), (2, 2))  # no segment shard nested in a shard


def test_pinned_shard_admits_its_segment_shard_only_on_the_same_dim():
    assert pin_admits((Shard(1),), (SEG3,))
    assert not pin_admits((Shard(0),), (SEG3,))
    assert not pin_admits((SEG3,), (Shard(1),))


def test_segment_shard_is_gathered_never_exchanged_by_all_to_all():
    kinds = lambda src, dst: [s.kind for s in plan_transition(src, dst)]  # noqa: E731
    assert kinds((SEG3,), (Replicate(),)) == ["all_gather"]
    assert kinds((Replicate(),), (SEG3,)) == ["shard"]
    assert kinds((SEG3,), (Shard(1),)) == ["all_gather", "shard"]
    assert kinds((Shard(0),), (SEG3,)) == ["all_gather", "shard"]
    assert kinds((Partial(),), (SEG3,)) == ["all_reduce", "shard"]


def test_split_of_a_segment_shard_gives_each_rank_its_rows_of_every_piece():
    """Rank 0 of 2 holds columns [0:4] of each 8-wide segment; the split's pieces are S(1) and
    hold exactly those columns, and cat of the pieces gives the segment layout back."""
    x = torch.arange(4 * 24.0).view(4, 24)  # (rows, 3 segments of 8)
    with planning_mesh(autoplan.Cluster.preset("2xCPU")) as mesh:
        fused = distribute_tensor(x, mesh, [SEG3])
        assert torch.equal(fused.to_local(), torch.cat([x[:, 0:4], x[:, 8:12], x[:, 16:20]], dim=1))
        for op_pieces in (torch.split(fused, 8, dim=1), torch.ops.aten.split_with_sizes.default(fused, [8, 8, 8], 1)):
            for i, piece in enumerate(op_pieces):
                assert tuple(piece.placements) == (Shard(1),)
                assert torch.equal(piece.to_local(), x[:, 8 * i : 8 * i + 4])
        joined = torch.cat(list(torch.split(fused, 8, dim=1)), dim=1)
        assert tuple(joined.placements) == (SEG3,)
        assert torch.equal(joined.to_local(), fused.to_local())
        # uneven pieces are not segments: PyTorch's rule (gather, then split) stays
        uneven = torch.ops.aten.split_with_sizes.default(fused, [16, 8], 1)
        assert all(tuple(p.placements) == (Replicate(),) for p in uneven)


def _table(build):  # noqa: ANN001, ANN202 - a model builder; returns (TracedProgram, StrategyTable)
    with torch.device("meta"):
        model = build()
    ids, labels = (t.to("meta") for t in zoo.token_batch())
    traced = trace_training_step(model, (ids,), loss_fn=zoo.lm_loss, example_targets=(labels,))
    with planning_mesh(autoplan.Cluster.preset("2xCPU")) as mesh:
        return traced, build_strategy_table(traced, mesh)


def test_fused_qkv_weight_may_be_split_by_heads_through_matmul_split_and_backward_cat():
    traced, table = _table(zoo.gpt2_tiny)
    specs = lambda name: {str(s) for s in table.nodes[name].strategies}  # noqa: E731
    assert "S(1)/3<-()" in specs("p_transformer_h_0_attn_c_attn_weight")  # Conv1D (in, 3C)
    assert "S(0)/3<-()" in specs("p_transformer_h_0_attn_c_attn_bias")
    assert "S(1)/3<-(S(0)/3,R,S(1)/3)" in specs("addmm")  # bias, x, weight -> q|k|v by heads
    split = next(n for n in traced.graph_module.graph.nodes if n.target is torch.ops.aten.split.Tensor)
    assert "S(2),S(2),S(2)<-(S(2)/3)" in specs(split.name)
    cats = [n.name for n in traced.graph_module.graph.nodes if n.target is torch.ops.aten.cat.default]
    assert any("S(2)/3<-(S(2),S(2),S(2))" in specs(c) for c in cats)  # the split's backward


def test_models_without_fused_splits_get_no_segment_shards():
    _, table = _table(zoo.llama_tiny)
    assert not [str(s) for ns in table.nodes.values() for s in ns.strategies if "/" in str(s)]


def test_views_that_merge_dims_name_the_segment_shards_of_the_merged_dim():
    assert _merged_groups((2, 4, 16, 8), (8, 16, 8)) == [(0, 8, (2, 4))]  # (B, H, T, D) -> (B * H, T, D)
    assert _merged_groups((8, 16, 8), (2, 4, 16, 8)) == []  # unflattening merges nothing
    assert _merged_groups((2, 16, 4, 8), (2, 16, 32)) == [(2, 32, (4, 8))]  # heads merged into features
    assert _merged_groups((2, 1, 6), (2, 6)) == []  # a unit dim dropped merges nothing
    assert _merged_groups((6, 4), (4, 6)) == []  # not a merge: 6 * 4 regrouped

    class Heads(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B=2, H=4, T=16, D=8)
            scores = torch.bmm(x.reshape(8, 16, 8), x.reshape(8, 16, 8).transpose(1, 2))
            return scores.view(2, 4, 16, 16).sum()

    gm = torch.export.export(Heads(), (torch.randn(2, 4, 16, 8),), strict=False).module()
    # a shard of H (after B = 2 rows) in B * H = 8 is S(0)/2; the (2, 4, 16, 16) view is no merge
    assert merged_dim_counts(gm) == {(8, 2)}

    class Tokens(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B * T, C) before a linear layer
            return (x.reshape(32, 8) @ torch.ones(8, 8)).sum()

    gm = torch.export.export(Tokens(), (torch.randn(2, 16, 8),), strict=False).module()
    assert merged_dim_counts(gm) == set()


def test_bloom_eager_attention_may_run_on_sharded_heads():
    from tests.test_fused_projections import bloom_tiny

    _, table = _table(bloom_tiny)
    bmms = [ns for ns in table.nodes.values() if ns.node.startswith(("bmm", "baddbmm"))]
    assert bmms and all(any("S(0)/8" in str(s) for s in ns.strategies) for ns in bmms)  # B = 8 sequences
