"""Fused projections run tensor-parallel on their shards (issue #20 item 1).

With Megatron pins (column-parallel fused/in projections, row-parallel out/down projections) on 2
CPU ranks, the planner splits a fused projection by segments (``S(d)/k``,
:mod:`autoplan.passes.segments`): GPT-2's ``c_attn`` by heads of q, k and v (attention runs
head-parallel), Phi-3's ``gate_up_proj`` by features of gate and up (the SwiGLU runs
feature-parallel); BLOOM's eager attention, which flattens the heads into the batch of its
``baddbmm``/``bmm``, runs on each rank's heads (``S(0)/B`` of ``B * H``). Each test asserts that every forward matmul of the named weights multiplies
its local shard, then that three SGD steps train like the single device (fp32, relative 1e-5;
tests/harness.py). The batch is pinned replicated and small (2 sequences of 16 tokens), so the
layout under test is tensor parallel (with 8 sequences, the planner splits the batch of the second
GPT-2 block instead: its activations then cost more to reduce than its weights to gather).

Before (same pins, ``python /work/notes/h20_fused_count.py``): GPT-2 ran 4 of its 9 forward
weight matmuls on sharded weights (``c_attn`` and, after the gathered heads, ``attn.c_proj``
gathered), Phi-3 0 of 9 (2 of 9 with segment shards only, its grouped-query QKV gathered; 8 of 9
with the QKV stored grouped by key/value head, :mod:`autoplan.passes.kv_groups`). BLOOM's attention matmuls ran on gathered heads (with the catalog's
links, 4 of its 9 forward weight matmuls on a sharded weight before, 8 of 9 after:
``benchmarks/tp_sharded_matmuls.py``). Falcon's multi-query ``query_key_value`` cannot be split by
heads; it runs on its plain row shards where its weight outweighs the activation it makes.
"""

from __future__ import annotations

import functools

import pytest

from tests import zoo
from tests.harness import Case, SeededBatches, assert_trains_like_reference
from tests.test_equivalence import assert_layers_use_sharded_weights, run_case

PHI3_MLP_TP_PINS = {
    # torch Linear weight is (out, in): gate_up column-parallel S(0), down row-parallel S(1).
    "*.gate_up_proj.weight": "S(0)",
    "*.down_proj.weight": "S(1)",
}


PHI3_TP_PINS = PHI3_MLP_TP_PINS | {"*.qkv_proj.weight": "S(0)", "*.o_proj.weight": "S(1)"}


def _tp_case(name: str, build, pins: dict[str, str]) -> Case:  # noqa: ANN001 - a model builder
    """2 CPU ranks, tensor-parallel ``pins`` on a replicated batch of 2 sequences, SGD momentum."""
    return Case(
        name=name,
        build_model=build,
        batches=SeededBatches(zoo.token_batch, {"batch": 2}),
        loss_fn=zoo.lm_loss,
        preset="2xCPU",
        pins={"input_0": "R", "target_0": "R"} | pins,
        optimizer="sgd_momentum",
        lr=0.1,
    )


def _trains_tensor_parallel(case: Case, *, param_specs: dict[str, tuple[str, ...]], weights: list[str]) -> dict:
    """Run ``case``; assert the plan gives the named parameters these placements, every forward
    matmul of ``weights`` multiplies its local shard (axis 0), and training matches one device.
    Returns rank 0's result."""
    results = run_case(case)
    plan = results[0]["plan"]
    assert {n: plan.param_specs[n] for n in param_specs} == param_specs
    assert_layers_use_sharded_weights(results[0], axis=0, weights=weights)
    assert_trains_like_reference(results)
    return results[0]


def phi3_tiny(seed: int = 0, kv_heads: int = 2, num_layers: int = 2):  # noqa: ANN201 - a transformers Phi3ForCausalLM
    """HF Phi-3 (fused ``qkv_proj`` and ``gate_up_proj``): ``num_layers`` layers, hidden 32, MLP 64, 4 heads of
    8 sharing ``kv_heads`` key/value heads (4: Phi-3-mini's layout), vocab 128, 64 positions, no
    dropout."""
    import torch
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        num_hidden_layers=num_layers, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=kv_heads,
        vocab_size=zoo.VOCAB, max_position_embeddings=zoo.MAX_POSITIONS, use_cache=False, pad_token_id=0,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return Phi3ForCausalLM(config).eval()


def test_gpt2_fused_qkv_runs_head_parallel_on_2_ranks_and_trains_like_single_device():
    _trains_tensor_parallel(
        _tp_case("gpt2-fused-qkv-tp-2", zoo.gpt2_tiny, zoo.GPT2_TP_PINS),
        param_specs={f"transformer.h.{i}.attn.c_attn.weight": ("S(1)/3",) for i in range(2)},
        weights=["*attn.c_attn.weight", "*attn.c_proj.weight", "*mlp.c_fc.weight", "*mlp.c_proj.weight"],
    )


@pytest.mark.slow
def test_phi3_fused_gate_up_runs_feature_parallel_on_2_ranks_and_trains_like_single_device():
    _trains_tensor_parallel(
        _tp_case("phi3-fused-gate-up-tp-2", phi3_tiny, PHI3_MLP_TP_PINS),
        param_specs={f"model.layers.{i}.mlp.gate_up_proj.weight": ("S(0)/2",) for i in range(2)},
        weights=["*.gate_up_proj.weight", "*.down_proj.weight"],
    )


def phi3_mini_tiny(seed: int = 0):  # noqa: ANN201 - a transformers Phi3ForCausalLM
    """:func:`phi3_tiny` with 4 key/value heads, Phi-3-mini's layout (q, k and v equally wide)."""
    return phi3_tiny(seed, kv_heads=4)


@pytest.mark.slow
def test_phi3_mini_layout_fused_qkv_slices_run_head_parallel_on_2_ranks_and_trains_like_single_device():
    """Phi-3 slices its fused QKV (``qkv[..., :q]``, ``qkv[..., q:q + kv]``, ``qkv[..., q + kv:]``);
    with as many key/value heads as heads the slices are the 3 equal segments of ``S(1)/3``, so the
    attention runs on each rank's heads and ``o_proj`` row-parallel (before: both gathered)."""
    result = _trains_tensor_parallel(
        _tp_case("phi3-mha-fused-qkv-tp-2", phi3_mini_tiny, PHI3_TP_PINS),
        param_specs={f"model.layers.{i}.self_attn.qkv_proj.weight": ("S(0)/3",) for i in range(2)},
        weights=["*.qkv_proj.weight", "*.o_proj.weight", "*.gate_up_proj.weight", "*.down_proj.weight"],
    )
    nodes = result["plan"].nodes
    slices = [r for r in nodes.values() if r["op"] == "aten.slice_backward.default" and r["out"] == [["S(2)/3"]]]
    assert len(slices) == 2 * 3, slices  # the q, k and v gradients land in their segments, in both layers


def test_phi3_gqa_fused_qkv_grouped_by_key_value_head_runs_head_parallel_on_2_ranks_and_trains_like_single_device():
    """Phi-3 with 4 query heads sharing 2 key/value heads: the slices of its fused QKV differ in
    size (16, 8, 8 features), so no segment shard holds a rank's query heads with the key/value
    head they read. The trace keeps the weight grouped by key/value head
    (:mod:`autoplan.passes.kv_groups`), a plain ``S(0)`` of it holds whole groups, and the
    attention runs on each rank's heads with ``o_proj`` row-parallel (before: both gathered, 2 of
    the 9 forward weight matmuls sharded). The reference compares the model's own layout."""
    _trains_tensor_parallel(
        _tp_case("phi3-gqa-fused-qkv-tp-2", phi3_tiny, PHI3_TP_PINS),
        param_specs={f"model.layers.{i}.self_attn.qkv_proj.weight": ("S(0)",) for i in range(2)},
        weights=["*.qkv_proj.weight", "*.o_proj.weight", "*.gate_up_proj.weight", "*.down_proj.weight"],
    )


BLOOM_TP_PINS = {
    # torch Linear weight is (out, in): query_key_value and dense_h_to_4h column-parallel, the
    # attention's dense and dense_4h_to_h row-parallel.
    "*.query_key_value.weight": "S(0)",
    "*.self_attention.dense.weight": "S(1)",
    "*.dense_h_to_4h.weight": "S(0)",
    "*.dense_4h_to_h.weight": "S(1)",
}


def bloom_tiny(seed: int = 0):  # noqa: ANN201 - a transformers BloomForCausalLM
    """HF BLOOM (fused ``query_key_value`` interleaved per head, ALiBi, eager attention through
    ``baddbmm``/``bmm`` on ``(B * H, T, D)``): 2 layers, hidden 32, 4 heads of 8, no dropout."""
    import torch
    from transformers import BloomConfig, BloomForCausalLM

    config = BloomConfig(
        n_layer=2, hidden_size=32, n_head=4, vocab_size=zoo.VOCAB, use_cache=False, bos_token_id=0,
        eos_token_id=0, pad_token_id=0, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return BloomForCausalLM(config).eval()


@pytest.mark.slow
def test_bloom_eager_attention_runs_head_parallel_on_2_ranks_and_trains_like_single_device():
    """BLOOM flattens ``(B, H, T, D)`` to ``(B * H, T, D)`` around its ``baddbmm``/``bmm``; with
    the heads sharded that is ``S(0)/B`` of the flattened dim (:func:`merged_dim_counts`), so the
    attention scores and context are computed on each rank's heads, forward and backward."""
    result = _trains_tensor_parallel(
        _tp_case("bloom-eager-attention-tp-2", bloom_tiny, BLOOM_TP_PINS),
        param_specs={},
        weights=["*.query_key_value.weight", "*.dense_h_to_4h.weight", "*.dense_4h_to_h.weight"],
    )
    nodes = result["plan"].nodes
    batched = {n: r["in"] for n, r in nodes.items() if r["op"] in ("aten.baddbmm.default", "aten.bmm.default")}
    assert len(batched) == 2 * 2 + 2 * 4  # per layer: forward baddbmm and bmm, backward 4 bmm
    gathered = {n: spec for n, spec in batched.items() if any(s != ["S(0)/2"] for s in spec[-2:])}
    assert not gathered, f"attention matmuls on gathered heads: {gathered}"


def gpt_neox_tiny(seed: int = 0):  # noqa: ANN201 - a transformers GPTNeoXForCausalLM
    """HF GPT-NeoX (Pythia): fused ``query_key_value`` laid out per head (``(H, 3 * D)``: each
    head's q, k and v rows together), partial rotary, parallel residual; 2 layers, hidden 32, 4
    heads, vocab 128, no dropout."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=zoo.VOCAB,
        max_position_embeddings=zoo.MAX_POSITIONS, use_cache=False, bos_token_id=0, eos_token_id=0,
        attention_dropout=0.0, hidden_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return GPTNeoXForCausalLM(config).eval()


@pytest.mark.slow
def test_gpt_neox_per_head_fused_qkv_runs_head_parallel_on_2_ranks_and_trains_like_single_device():
    """GPT-NeoX keeps each head's q, k and v rows together in its fused weight, so a plain ``S(0)``
    holds whole heads and the attention runs on them (no segment shard, no grouped layout)."""
    _trains_tensor_parallel(
        _tp_case("gpt-neox-per-head-qkv-tp-2", gpt_neox_tiny, {
            "*.query_key_value.weight": "S(0)", "*.attention.dense.weight": "S(1)",
            "*.dense_h_to_4h.weight": "S(0)", "*.dense_4h_to_h.weight": "S(1)"}),
        param_specs={f"gpt_neox.layers.{i}.attention.query_key_value.weight": ("S(0)",) for i in range(2)},
        weights=["*.query_key_value.weight", "*.attention.dense.weight", "*.dense_h_to_4h.weight",
                 "*.dense_4h_to_h.weight"],
    )  # fmt: skip


def _checkpoint_round_trip(rank: int, world_size: int, root: str) -> dict:
    import torch

    import autoplan
    from autoplan.runtime import checkpoint

    ids, _ = zoo.token_batch()
    cluster = autoplan.Cluster.preset(f"{world_size}xCPU")
    pins = {"input_0": "R", "target_0": "R", "*attn.c_attn.weight": "S(1)", "*attn.c_proj.weight": "S(0)"}

    def parallel(**kw):  # noqa: ANN202
        torch.manual_seed(0)
        return autoplan.parallelize(
            zoo.gpt2_tiny(), cluster, example_inputs=(ids,), loss_fn=zoo.lm_loss, example_targets=(ids,), **kw
        )

    pm = parallel(pins=pins)
    opt = pm.make_optimizer(lr=1e-2)
    for _ in range(2):
        pm.forward_backward(ids, targets=(ids,))
        opt.step()
        opt.zero_grad()
    path = checkpoint.save(root, 2, pm, opt, plan=pm.plan)
    resumed = parallel(plan=pm.plan)
    opt2 = resumed.make_optimizer(lr=1e-2)
    found = checkpoint.resume(root, resumed, opt2)
    for m, o in ((pm, opt), (resumed, opt2)):  # one more step each: the optimizer state came back too
        m.forward_backward(ids, targets=(ids,))
        o.step()
        o.zero_grad()
    a, b = pm.full_parameters(), resumed.full_parameters()
    on_disk = checkpoint.read_full_parameters(path) if rank == 0 else {}
    return {
        "segmented": sorted(k for k, v in pm.plan.param_specs.items() if any("/" in p for p in v)),
        "step": found[1] if found else None,
        "max_diff": max((a[k] - b[k]).abs().max().item() for k in a),
        "keys_on_disk": len(on_disk),
    }


@pytest.mark.slow
def test_checkpoint_of_segment_sharded_fused_weights_resumes_bit_identically(tmp_path) -> None:
    """DCP records a local shard as one contiguous chunk, which ``S(d)/k`` is not: the checkpoint
    holds such parameters (and their optimizer state) sharded plainly, and resuming restores them
    exactly (one more step on both sides gives identical parameters)."""
    from tests.harness import run_ranks

    results = run_ranks(_checkpoint_round_trip, 2, str(tmp_path / "ckpt"))
    r = results[0]
    assert r["segmented"], r  # the plan does split the fused c_attn weights segment by segment
    assert r["step"] == 2 and r["max_diff"] == 0.0 and r["keys_on_disk"] > 0, r


def falcon_wide_tiny(seed: int = 0):  # noqa: ANN201 - a transformers FalconForCausalLM
    """HF Falcon (7B layout: multi-query ``query_key_value`` of rows ``[q (H·D); k (D); v (D)]``,
    parallel attention and MLP), 2 layers, 4 heads of 64 (hidden 256), vocab 128, no dropout: its
    fused weight (384 x 256) outweighs the activation it makes for 2 sequences of 16 tokens (32 x 384)
    eight times over. (At hidden 128 the planner gathers the weight: moving the q, k and v segments
    forward and their gradients backward then costs more.)"""
    import torch
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(
        num_hidden_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=zoo.VOCAB, use_cache=False,
        bos_token_id=0, eos_token_id=0, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return FalconForCausalLM(config).eval()


def test_falcon_multi_query_fused_qkv_runs_on_its_row_shards_on_2_ranks_and_trains_like_single_device():
    """Multi-query attention's single key/value head cannot be split by heads (Megatron-Core needs
    the key/value heads to divide by the tensor-parallel degree; the grouped layout of
    :mod:`autoplan.passes.kv_groups` needs two or more). With weights that outweigh the tokens the
    planner still multiplies the plain ``S(0)`` rows of ``query_key_value`` on each rank (rank 1's
    rows straddle q, k and v) and gathers the smaller q/k/v output instead of the weight; the
    attention then runs whole on each rank. Every forward weight matmul of both blocks runs on a
    sharded weight and training matches one device. (On the zoo's hidden-32 Falcon the weight is the smaller operand and is gathered instead:
    6 of 9 in ``benchmarks/tp_sharded_matmuls.py``.)"""
    _trains_tensor_parallel(
        _tp_case("falcon-mqa-fused-qkv-tp-2", falcon_wide_tiny, BLOOM_TP_PINS),  # BLOOM's module names
        param_specs={f"transformer.h.{i}.self_attention.query_key_value.weight": ("S(0)",) for i in range(2)},
        weights=list(BLOOM_TP_PINS),
    )


def zoo_decoder(builder: str, seed: int = 0):  # noqa: ANN201 - a transformers model
    """The model of ``examples/hf_models.py``'s zoo ``builder`` (2 layers, hidden 32, 4 heads),
    seeded; ``functools.partial(zoo_decoder, name)`` is a picklable ``Case.build_model``."""
    import torch

    from examples import hf_models

    torch.manual_seed(seed)
    return getattr(hf_models, builder)().model


BLOCKED_QKV_CASES = {
    # CodeGen lays its qkv_proj out in 4 blocks, each holding q, v and k of a quarter of the heads:
    # a plain S(0) over 2 ranks holds 2 whole blocks (no segment shard, no grouped layout).
    "codegen": ("codegen_zoo", "transformer.h.{}.attn.qkv_proj.weight", "S(0)", {
        "*attn.qkv_proj.weight": "S(0)", "*attn.out_proj.weight": "S(1)",
        "*mlp.fc_in.weight": "S(0)", "*mlp.fc_out.weight": "S(1)"}),
    # MPT's Wqkv is [q; k; v] of equal widths (S(0)/3); its eager attention adds ALiBi per head.
    "mpt": ("mpt_zoo", "transformer.blocks.{}.attn.Wqkv.weight", "S(0)/3", {
        "*attn.Wqkv.weight": "S(0)", "*attn.out_proj.weight": "S(1)",
        "*ffn.up_proj.weight": "S(0)", "*ffn.down_proj.weight": "S(1)"}),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BLOCKED_QKV_CASES))
def test_codegen_blocked_and_mpt_equal_segment_fused_qkv_run_head_parallel_on_2_ranks_and_train_like_single_device(
    name: str,
):
    """The eager attention of both runs on each rank's heads, and every forward matmul of the
    pinned projections multiplies its local shard."""
    builder, qkv, spec, pins = BLOCKED_QKV_CASES[name]
    _trains_tensor_parallel(
        _tp_case(f"{name}-fused-qkv-tp-2", functools.partial(zoo_decoder, builder), pins),
        param_specs={qkv.format(i): (spec,) for i in range(2)},
        weights=list(pins),
    )
