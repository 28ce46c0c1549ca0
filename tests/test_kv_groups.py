"""A fused grouped-query QKV projection is stored grouped by key/value head (autoplan.passes.kv_groups).

The trace reads Phi-3's fused ``qkv_proj`` (4 query heads sharing 2 key/value heads) in Megatron's
grouped layout ``[q_0 k_0 v_0 | q_1 k_1 v_1]``; the step it computes must be the model's exactly,
and the user must only ever see the model's own layout: ``full_parameters``, ``load_state_dict``
of full tensors, a checkpoint's full read. The 2-rank tensor-parallel run is in
tests/test_fused_projections.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
import torch.distributed as dist

from autoplan.errors import CheckpointError
from autoplan.passes.kv_rows import KVGroupRows
from autoplan.passes.trace import trace_training_step
from autoplan.runtime import checkpoint
from tests import zoo
from tests.test_fused_projections import phi3_tiny

QKV = [f"model.layers.{i}.self_attn.qkv_proj.weight" for i in range(2)]
ROOT = Path(__file__).resolve().parent.parent


def test_grouped_rows_put_each_key_value_head_after_the_query_heads_that_read_it():
    heads, kv_heads, head_dim = 6, 2, 2  # query heads 0-2 read key/value head 0, 3-5 read head 1
    rows = KVGroupRows(num_kv_heads=kv_heads, q_rows_per_group=3 * head_dim, kv_rows_per_group=head_dim)
    labels = [f"q{h}" for h in range(heads) for _ in range(head_dim)]
    labels += [f"k{j}" for j in range(kv_heads) for _ in range(head_dim)]
    labels += [f"v{j}" for j in range(kv_heads) for _ in range(head_dim)]
    model = torch.arange(len(labels), dtype=torch.float32).unsqueeze(1).expand(-1, 3).contiguous()

    stored = rows.to_stored(model)

    got = [labels[int(i)] for i in stored[:, 0]][::head_dim]
    assert got == ["q0", "q1", "q2", "k0", "v0", "q3", "q4", "q5", "k1", "v1"]
    assert torch.equal(rows.to_model(stored), model)
    assert torch.equal(rows.to_model(rows.to_stored(model[:, 0])), model[:, 0])  # a bias
    with pytest.raises(ValueError, match="20 rows"):
        rows.to_stored(model[:-1])


def _traced_step(model: torch.nn.Module):
    ids, labels = zoo.token_batch(batch=2)
    traced = trace_training_step(model, (ids,), loss_fn=zoo.lm_loss, example_targets=(labels,))
    return traced, ids, labels


def test_phi3_gqa_trace_reads_qkv_grouped_and_computes_the_models_loss_and_gradients():
    model = phi3_tiny()
    traced, ids, labels = _traced_step(model)
    assert sorted(traced.param_layouts) == QKV
    assert set(traced.param_layouts.values()) == {KVGroupRows(num_kv_heads=2, q_rows_per_group=16, kv_rows_per_group=8)}

    params = dict(model.named_parameters())
    args = [
        traced.param_layouts[n].to_stored(p.detach()) if n in traced.param_layouts else p.detach()
        for n, p in params.items()
    ]
    loss, *grads = traced.graph_module(*args, *model.buffers(), ids, labels)
    model.zero_grad()
    reference = zoo.lm_loss(model(ids), labels)
    reference.backward()

    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=0)
    for (name, p), g in zip(params.items(), grads, strict=True):
        if name in traced.param_layouts:
            g = traced.param_layouts[name].to_model(g)
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7, msg=name)


class SplitQKV(torch.nn.Module):
    """A decoder layer whose fused grouped-query QKV (with a bias) is cut by ``split`` rather than
    slices: ``qkv(x).split([H*D, G*D, G*D], dim=-1)`` (DBRX's ``Wqkv`` cut), 4 heads on 2 key/value
    heads, then causal SDPA and a tied-free LM head."""

    def __init__(self, vocab: int = zoo.VOCAB, hidden: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.qkv = torch.nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim)
        self.out = torch.nn.Linear(heads * self.head_dim, hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        (b, t, _), h, g, d = x.shape, self.heads, self.kv_heads, self.head_dim
        q, k, v = self.qkv(x).split([h * d, g * d, g * d], dim=-1)
        q = q.view(b, t, h, d).transpose(1, 2)
        k = k.view(b, t, g, d).transpose(1, 2).repeat_interleave(h // g, dim=1)
        v = v.view(b, t, g, d).transpose(1, 2).repeat_interleave(h // g, dim=1)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.lm_head(x + self.out(a.transpose(1, 2).reshape(b, t, h * d)))


def _logits_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_a_fused_qkv_cut_by_split_with_a_bias_is_grouped_too_and_computes_the_models_step():
    model = SplitQKV()
    ids, labels = zoo.token_batch(batch=2)
    traced = trace_training_step(model, (ids,), loss_fn=_logits_loss, example_targets=(labels,))
    assert dict(traced.param_layouts) == {n: KVGroupRows(2, 16, 8) for n in ("qkv.weight", "qkv.bias")}
    assert not any(n.target is torch.ops.aten.split_with_sizes.default for n in traced.graph_module.graph.nodes)

    params = dict(model.named_parameters())
    args = [
        traced.param_layouts[n].to_stored(p.detach()) if n in traced.param_layouts else p.detach()
        for n, p in params.items()
    ]
    loss, *grads = traced.graph_module(*args, ids, labels)
    model.zero_grad()
    reference = _logits_loss(model(ids), labels)
    reference.backward()

    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=0)
    for (name, p), g in zip(params.items(), grads, strict=True):
        got = traced.param_layouts[name].to_model(g) if name in traced.param_layouts else g
        torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda: phi3_tiny(kv_heads=4), id="phi3-equal-segments"),
        pytest.param(lambda: phi3_tiny(kv_heads=1), id="phi3-multi-query"),
        pytest.param(zoo.llama_tiny, id="llama-unfused"),
    ],
)
def test_equal_segments_multi_query_and_unfused_projections_keep_the_models_layout(build):
    traced, _, _ = _traced_step(build())
    assert dict(traced.param_layouts) == {}


@pytest.fixture(scope="module")
def one_rank_phi3(tmp_path_factory: pytest.TempPathFactory):
    """GQA Phi-3 parallelized on a one-rank gloo group in this process, one Adam step taken and
    checkpointed: ``(model, parallel model, optimizer, plan, checkpoint root)``."""
    from autoplan.api import parallelize
    from autoplan.api import plan as make_plan

    model = phi3_tiny()
    ids, labels = zoo.token_batch(batch=2)
    kwargs = {"example_inputs": (ids,), "loss_fn": zoo.lm_loss, "example_targets": (labels,)}
    plan = make_plan(model, "1xCPU", optimizer="adam", profile=None, **kwargs)
    root = tmp_path_factory.mktemp("kv_groups") / "ckpt"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        pm = parallelize(model, plan.cluster, plan=plan, **kwargs)
        opt = pm.make_optimizer(lr=1e-2)
        pm.forward_backward(ids, targets=(labels,))
        opt.step()
        checkpoint.save(root, 1, pm, opt, plan=plan)
        yield model, pm, opt, plan, root
    finally:
        dist.destroy_process_group()


def test_the_user_sees_the_models_layout_while_the_program_keeps_the_grouped_one(one_rank_phi3):
    model, pm, _, _, _ = one_rank_phi3
    rows = pm.param_layouts[QKV[0]]
    stored = pm.state_dict()[QKV[0]].full_tensor()
    full = pm.full_parameters()

    torch.testing.assert_close(stored, rows.to_stored(full[QKV[0]]), rtol=0, atol=0)
    assert not torch.equal(stored, full[QKV[0]])
    before = {n: t.clone() for n, t in full.items()}
    pm.load_state_dict(model.state_dict())  # full tensors in the model's layout: the untrained model
    loaded = pm.full_parameters()
    assert all(torch.equal(loaded[n], p.detach()) for n, p in model.named_parameters())
    pm.load_state_dict(before)
    assert all(torch.equal(pm.full_parameters()[n], t) for n, t in before.items())


def test_checkpoint_records_the_layout_and_reads_back_the_models(one_rank_phi3):
    _, pm, _, _, root = one_rank_phi3
    marker = json.loads((root / "step_1" / checkpoint.COMPLETE_MARKER).read_text())
    assert marker["param_layouts"] == {name: [2, 16, 8] for name in QKV}

    saved = checkpoint.read_full_parameters(root / "step_1")

    full = pm.full_parameters()
    assert saved.keys() == full.keys()
    assert all(torch.equal(saved[n], full[n]) for n in full)


def _without_layouts(root: Path, tmp_path: Path) -> checkpoint.Checkpoint:
    """A copy of ``root``'s newest checkpoint whose marker records no layout, as a checkpoint
    written before autoplan grouped the fused QKV reads."""
    import shutil

    shutil.copytree(root, tmp_path / "ckpt")
    latest = checkpoint.find_latest(tmp_path / "ckpt")
    assert latest is not None
    marker_path = latest.path / checkpoint.COMPLETE_MARKER
    marker = json.loads(marker_path.read_text())
    del marker["param_layouts"]
    marker_path.write_text(json.dumps(marker))
    found = checkpoint.find_latest(tmp_path / "ckpt")
    assert found is not None and not found.param_layouts
    return found


def test_checkpoint_in_another_layout_is_refused_naming_the_parameter(one_rank_phi3, tmp_path):
    _, pm, opt, plan, root = one_rank_phi3
    old = _without_layouts(root, tmp_path)
    shapes = {n: tuple(t.shape) for n, t in pm.full_parameters().items()}
    checkpoint.check_compatible(checkpoint.find_latest(root), plan, shapes)  # as written: compatible

    refused = r"stores model\.layers\.0\.self_attn\.qkv_proj\.weight with its rows in the model's order"
    with pytest.raises(CheckpointError, match=refused):  # before any rank starts (autoplan run)
        checkpoint.check_compatible(old, plan, shapes)
    with pytest.raises(CheckpointError, match=refused):  # and when loading
        checkpoint.load(old, pm, opt)


def test_plan_records_the_grouped_layout_and_a_plan_without_it_is_refused(one_rank_phi3):
    from autoplan.errors import PlanFileError, PlanMismatchError
    from autoplan.planner.plan import Plan

    model, _, _, plan, _ = one_rank_phi3
    assert dict(plan.param_layouts) == {n: KVGroupRows(2, 16, 8) for n in QKV}
    saved = plan.to_dict()
    assert saved["placements"]["param_layouts"] == {n: [2, 16, 8] for n in QKV}
    jsonschema.validate(saved, json.loads((ROOT / "docs" / "plan.schema.json").read_text()))
    assert Plan.from_dict(json.loads(json.dumps(saved))).param_layouts == plan.param_layouts
    assert "(rows grouped by key/value head)" in plan.summary()

    bad = json.loads(json.dumps(saved))
    bad["placements"]["param_layouts"][QKV[0]] = [0, 16, 8]
    with pytest.raises(PlanFileError, match="positive sizes"):
        Plan.from_dict(bad)

    old = json.loads(json.dumps(saved))
    del old["placements"]["param_layouts"]  # as a plan made before the grouped layout reads
    traced, _, _ = _traced_step(model)
    Plan.from_dict(saved).check_fits(traced)  # the plan as made fits its program

    with pytest.raises(PlanMismatchError, match="rows in the model's order, but the program reads them grouped"):
        Plan.from_dict(old).check_fits(traced)


def test_with_tensor_parallel_pins_the_split_qkv_and_its_attention_run_on_each_ranks_groups():
    import autoplan
    from autoplan.planner.mesh import planning_alone
    from tests.harness import cpu_cluster, forward_matmul_operands

    model = SplitQKV()
    ids, labels = zoo.token_batch(batch=2)
    pins = {"input_0": "R", "target_0": "R", "qkv.weight": "S(0)", "qkv.bias": "S(0)", "out.weight": "S(1)"}
    with planning_alone():  # whether or not this module's one-rank group is up (no collective is run)
        plan = autoplan.plan(
            model, cpu_cluster("2xCPU"), example_inputs=(ids,), loss_fn=_logits_loss,
            example_targets=(labels,), optimizer="sgd", pins=pins, profile=None,
        )  # fmt: skip
    traced = trace_training_step(model, (ids,), loss_fn=_logits_loss, example_targets=(labels,))

    weights = {
        fqn: "".join(plan.nodes[node.name]["in"][i])
        for node, operands in forward_matmul_operands(traced)
        for i, fqn, _ in operands
        if fqn in ("qkv.weight", "out.weight")
    }
    assert weights == {"qkv.weight": "S(1)", "out.weight": "S(0)"}, weights  # transposed: column, row parallel
    attention = [r for r in plan.nodes.values() if "sdpa" in r["op"] and "backward" not in r["op"]]
    assert attention and all(r["in"][0] == ["S(1)"] for r in attention), attention  # (B, H, T, D) by heads
