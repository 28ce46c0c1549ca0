"""RMS normalisation as one operator (``autoplan::rms_norm``, :mod:`autoplan.passes.fused_norm`).

The op computes Hugging Face ``LlamaRMSNorm``'s math (and ``torch.nn.RMSNorm``'s), saves only the
input and the per-row ``rstd`` as a fused kernel does, and carries DTensor strategies (rows split,
the weight's gradient a partial sum); tracing routes the modules to it, so a Llama block saves
8 B per token-hidden element less, and a planned program on 2 CPU ranks trains like one device.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from typing import Any

import pytest
import torch
from torch import nn

import autoplan
from autoplan.cost_models.compute import is_matmul, op_bytes, op_flops
from autoplan.cost_models.config import ParallelConfig
from autoplan.passes import fused_norm, trace
from autoplan.passes.fused_norm import hf_rms_norm_classes, norms_as_single_op
from autoplan.passes.recompute import keeps_op
from autoplan.passes.trace import trace_training_step
from autoplan.planner.mesh import as_cluster
from autoplan.planner.segment_model import SegmentCostModel
from tests import zoo
from tests.harness import SeededBatches, assert_trains_like_reference, run_ranks, train_planned_lm

RMS = torch.ops.autoplan.rms_norm.default
RMS_BACKWARD = torch.ops.autoplan.rms_norm_backward.default


def _grads(module: nn.Module, x: torch.Tensor, grad_y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.detach().requires_grad_()
    y = module(x)
    return (y, *torch.autograd.grad(y, (x, module.weight), grad_y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["llama", "torch"])
def test_the_op_computes_the_modules_forward_exactly_and_its_gradients_within_rounding(kind: str, dtype) -> None:  # noqa: ANN001
    """Forward bit-identical to the module; input and weight gradients within fp32 rounding of
    autograd through the module (1e-6 relative in fp32, one bf16 ulp in bf16)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    module = (LlamaRMSNorm(48, eps=1e-5) if kind == "llama" else nn.RMSNorm(48, eps=1e-5)).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(48))
    x, grad_y = torch.randn(3, 7, 48, dtype=dtype) * 3, torch.randn(3, 7, 48, dtype=dtype)
    y0, gx0, gw0 = _grads(module, x, grad_y)
    with norms_as_single_op():
        y1, gx1, gw1 = _grads(module, x, grad_y)
    assert torch.equal(y0, y1) and y0.dtype == y1.dtype
    rel = 1e-6 if dtype == torch.float32 else 8e-3
    for a, b in ((gx0, gx1), (gw0, gw1)):
        assert a.dtype == b.dtype
        assert (a.float() - b.float()).abs().max() <= rel * a.float().abs().max()


def test_routing_covers_llama_copies_leaves_other_math_alone_and_restores_every_forward() -> None:
    """Mistral's, Qwen2's and Qwen3's norms are Llama's (routed); Gemma's ``(1 + weight)`` and
    the hand-written zoo norm (computed in the input dtype) are not; every ``forward`` is the
    original again on exit."""
    names = ("llama", "mistral", "qwen2", "qwen3", "gemma")
    modules = {n: importlib.import_module(f"transformers.models.{n}.modeling_{n}") for n in names}
    routed = {cls.__name__ for cls in hf_rms_norm_classes()}
    assert {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"} <= routed
    assert "GemmaRMSNorm" not in routed
    mistral, gemma = modules["mistral"].MistralRMSNorm, modules["gemma"].GemmaRMSNorm
    before = {cls: cls.forward for cls in (*hf_rms_norm_classes(), nn.RMSNorm, gemma, zoo.ManualRMSNorm)}
    with norms_as_single_op():
        assert mistral.forward is not before[mistral] and nn.RMSNorm.forward is not before[nn.RMSNorm]
        assert gemma.forward is before[gemma] and zoo.ManualRMSNorm.forward is before[zoo.ManualRMSNorm]
    assert all(cls.forward is fn for cls, fn in before.items())


def test_the_op_is_a_cheap_memory_bound_op_priced_as_its_eager_kernels_run() -> None:
    """Not a matmul (``selective`` re-runs it); FLOPs 4 (forward) and 9 (backward) per element,
    as ``aten._fused_rms_norm``; bytes: the eager kernels its body runs (its memory is a fused
    kernel's, its time is not: compute._eager_rms_norm_bytes)."""
    x, w = (
        torch.empty(4, 8, 64, device="meta", dtype=torch.bfloat16),
        torch.empty(64, device="meta", dtype=torch.bfloat16),
    )
    y, rstd = RMS(x, w, 1e-6, False)
    gx, gw = RMS_BACKWARD(y, x, rstd, w, False)
    assert not is_matmul(RMS) and not is_matmul(RMS_BACKWARD)
    assert op_flops(RMS, [x, w], [y, rstd]) == 4 * x.numel()
    assert op_flops(RMS_BACKWARD, [y, x, rstd, w], [gx, gw]) == 9 * x.numel()
    # bf16: casts 6 + pow 8 + mean 4 + h * rstd 8 + cast 6 + weight * n 4 = 36 B per element forward;
    # backward 4 casts of 6, 60 B of fp32 work and 6 x 2 B of bf16 ones = 96 B
    assert op_bytes(RMS, [x, w], [y, rstd]) == 36 * x.numel()
    assert op_bytes(RMS_BACKWARD, [y, x, rstd, w], [gx, gw]) == 96 * x.numel()
    assert rstd.shape == (4, 8, 1) and rstd.dtype == torch.float32 and gw.shape == (64,)


@pytest.fixture(scope="module")
def llama_trace():  # noqa: ANN201
    ids = torch.randint(0, zoo.VOCAB, (2, 16))
    return trace_training_step(zoo.llama_tiny(), (ids,), loss_fn=zoo.lm_loss, example_targets=(ids,))


def test_a_traced_llama_step_holds_one_norm_op_per_norm_and_no_decomposition(llama_trace) -> None:  # noqa: ANN001
    """2 blocks x 2 norms + the final norm: 5 forward and 5 backward ops, no ``rsqrt``; under
    ``selective`` recomputation the norm is re-run (not kept like a matmul)."""
    nodes = list(llama_trace.graph_module.graph.nodes)
    targets = [n.target for n in nodes if n.op == "call_function"]
    assert targets.count(RMS) == 5 and targets.count(RMS_BACKWARD) == 5
    assert torch.ops.aten.rsqrt.default not in targets
    norm = next(n for n in nodes if n.target is RMS)
    assert not keeps_op(norm, (2,), "selective") and not keeps_op(norm, (2,), "full")


def _block_saved_bytes(monkeypatch: pytest.MonkeyPatch, *, routed: bool) -> list[float]:
    if not routed:
        monkeypatch.setattr(trace, "norms_as_single_op", contextlib.nullcontext)
    ids = torch.randint(0, zoo.VOCAB, (1, SEQ))
    costs = SegmentCostModel(
        zoo.llama_tiny(), (ids,), zoo.lm_loss, (ids,), as_cluster("1xCPU"), optimizer="sgd", workers=1
    )(1, BATCH)
    monkeypatch.undo()
    return [s.saved_bytes for s in costs.segments[1:-1]]


SEQ, BATCH, HIDDEN = 16, 2, 32


def test_a_block_saves_two_fewer_hidden_sized_floats_with_the_fused_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 Llama block (B=2, T=16, hidden 32), two norms. Decomposed, each norm saves x (its fp32
    copy h is x itself), rstd (B, T, 1) and z = h * rstd (B, T, hidden), the weight multiply's
    operand; fused, x (and rstd, which the fused op returns as its second output: read only by
    the backward through a getitem, it is priced with the backward's values, as native_layer_norm's
    statistics are). Per block: 2 * (B*T*hidden + B*T) * 4 B less. (In bf16 the decomposition saves
    the fp32 h and the bf16 n where the op saves the bf16 x: the same 8 B per element per block.)"""
    decomposed = _block_saved_bytes(monkeypatch, routed=False)
    fused = _block_saved_bytes(monkeypatch, routed=True)
    assert len(fused) == 2
    for before, after in zip(decomposed, fused, strict=True):
        assert before - after == 2 * (BATCH * SEQ * HIDDEN + BATCH * SEQ) * 4


# --- planned programs on 2 CPU ranks -------------------------------------------------------------------


def _batches(batch: int) -> SeededBatches:
    return SeededBatches(zoo.token_batch, {"batch": batch, "seq": SEQ})


def _model() -> nn.Module:
    return zoo.llama_lm(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=zoo.VOCAB, positions=64)


def _train(rank: int, world_size: int, plan_json: str, batch: int) -> dict[str, Any]:  # noqa: ARG001
    return train_planned_lm(plan_json, _model(), _batches(batch))


@pytest.mark.parametrize(
    "cfg",
    [
        ParallelConfig(dp=2, microbatch_size=2),
        ParallelConfig(tp=2, microbatch_size=2, sequence_parallel=True),
        pytest.param(ParallelConfig(tp=2, microbatch_size=2), marks=pytest.mark.slow),
    ],
    ids=["dp=2", "tp=2+sp", "tp=2"],
)
def test_a_plan_with_the_fused_norm_trains_like_single_device(cfg: ParallelConfig) -> None:
    """3 SGD-momentum steps, fp32, within the harness's 1e-5. Data parallel splits the norm's rows
    (the weight's gradient a partial sum, all-reduced with the others); sequence parallel splits
    the tokens of the norms that are not right before a weight."""
    x, y = _batches(cfg.global_batch_size)(0)
    plan = autoplan.plan(
        _model(), f"1x{cfg.world_size}xCPU", example_inputs=(x,), loss_fn=zoo.lm_loss, example_targets=(y,),
        optimizer="sgd_momentum", global_batch_size=cfg.global_batch_size, config=cfg,
    )  # fmt: skip
    norms = [d for d in plan.nodes.values() if d["op"] == "autoplan.rms_norm.default"]
    assert len(norms) == 5
    if cfg.dp > 1:
        assert all(d["out"][0][0] == "S(0)" for d in norms), norms
    results = run_ranks(_train, cfg.world_size, json.dumps(plan.to_dict()), cfg.global_batch_size, timeout_s=600)
    assert_trains_like_reference(results)


def test_the_strategies_split_every_dim_but_the_normalised_one() -> None:
    assert fused_norm._rows(ndim=3, backward=False)[1:] == [
        [torch.distributed.tensor.Shard(d)] * 3 + [torch.distributed.tensor.Replicate()] for d in (0, 1)
    ]
    backward = fused_norm._rows(ndim=3, backward=True)
    assert all(isinstance(row[1], torch.distributed.tensor.Partial) for row in backward[1:])
