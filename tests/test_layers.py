"""Layer partition of the joint graph (autoplan.passes.layers): blocks found, every op placed, order kept."""

from __future__ import annotations

import pytest

from autoplan.passes.layers import find_layers
from autoplan.passes.trace import trace_training_step
from tests.zoo import gpt2_tiny, llama_tiny, lm_loss, mlp, mlp_batch, mse_loss, token_batch


@pytest.mark.parametrize(("build", "prefix"), [(gpt2_tiny, "transformer.h"), (llama_tiny, "model.layers")])
def test_blocks_found_and_every_op_placed(build, prefix):  # noqa: ANN001
    model = build()
    ids, labels = token_batch()
    traced = trace_training_step(model, (ids,), loss_fn=lm_loss, example_targets=(labels,))
    lay = find_layers(traced)
    n_blocks = sum(
        1
        for name, _ in model.named_modules()
        if name.startswith(prefix + ".") and name.count(".") == prefix.count(".") + 1
    )
    assert lay.block_prefix == prefix
    assert lay.num_blocks == n_blocks >= 2
    gm = traced.graph_module
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert all(n.name in lay.segment_of for n in ops)
    # the forward visits segments in non-decreasing order, the backward in non-increasing order
    fwd = [lay.segment_of[n.name] for n in ops if n.meta["autoplan.phase"] == "fwd"]
    assert fwd == sorted(fwd) and fwd[0] == 0 and fwd[-1] == lay.num_segments - 1
    # every block has forward and backward ops, the same number in each block
    counts = [sum(1 for n in ops if lay.segment_of[n.name] == s) for s in range(1, lay.num_segments - 1)]
    assert len(set(counts)) == 1 and counts[0] > 10
    # each block's weights are read by that block only
    for i in range(n_blocks):
        names = [p for p in lay.param_segments if p.startswith("p_" + prefix.replace(".", "_") + f"_{i}_")]
        assert names and all(lay.param_segments[p] == (i + 1,) for p in names)


def test_tied_embedding_is_in_prologue_and_epilogue():
    model = gpt2_tiny()
    ids, labels = token_batch()
    lay = find_layers(trace_training_step(model, (ids,), loss_fn=lm_loss, example_targets=(labels,)))
    assert lay.param_segments["p_transformer_wte_weight"] == (0, lay.num_segments - 1)
    assert lay.segment_name(0) == "prologue" and lay.segment_name(1) == "transformer.h.0"


def test_model_without_blocks_is_one_prologue_and_epilogue():
    x, y = mlp_batch()
    lay = find_layers(trace_training_step(mlp(), (x,), loss_fn=mse_loss, example_targets=(y,)))
    # nn.Sequential children are numbered: "0", "1", ... are the blocks
    assert lay.block_prefix == "" and lay.num_blocks >= 2
