"""A mean loss over a batch split across ranks is the single-device loss, whatever targets are
ignored (``autoplan/passes/losses.py``).

Before: ``cross_entropy(reduction="mean")`` on a batch split two ways was planned as the mean of
the two ranks' means (DTensor's ``P(avg)``). With ``-100`` labels (padding) unevenly spread, a
GPT-2 with a 8,192-token vocabulary on 2 gloo ranks reported loss 9.0177 where one device
computes 9.0197, every step, with exit 0; a rank whose targets are all ignored gives nan.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autoplan.passes.losses import MEAN, SUM
from autoplan.passes.trace import trace_training_step
from tests import zoo
from tests.harness import Case, assert_trains_like_reference, run_case

VOCAB, SEQ = 32768, 64


def padded_batch(seed: int = 1, *, vocab: int = VOCAB, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    """8 sequences; the first 4 (rank 0's half on a 2-way batch split) have every target
    ignored, the 5th its first 20: rank 0 holds no target, rank 1 most of them."""
    ids, labels = zoo.token_batch(batch=8, seq=seq, seed=seed, vocab=vocab)
    labels = labels.clone()
    labels[:4] = -100
    labels[4, :20] = -100
    return ids, labels


def _nll_nodes(traced: object) -> list[torch.fx.Node]:
    gm = traced.graph_module  # type: ignore[attr-defined]
    return [n for n in gm.graph.nodes if n.target is torch.ops.aten.nll_loss_forward.default]


def test_traced_mean_loss_is_a_sum_over_the_total_weight_and_equals_eager() -> None:
    model = zoo.gpt2_tiny()
    ids, labels = padded_batch(vocab=128, seq=16)
    traced = trace_training_step(model, (ids,), loss_fn=zoo.lm_loss, example_targets=(labels,))
    (nll,) = _nll_nodes(traced)
    assert nll.args[3] == SUM != MEAN
    # loss = s' / w' with (s', w') = unbind(stack([s, w])); the backward divides by w' too
    (stack,) = {u for n in nll.users for u in n.users if u.target is torch.ops.aten.stack.default}
    assert [a.args[1] for a in stack.args[0]] == [0, 1]
    (unbind,) = stack.users
    summed, weight = sorted(unbind.users, key=lambda n: n.args[1])
    (div,) = [u for u in summed.users if u.target is torch.ops.aten.div.Tensor]
    assert div.args == (summed, weight)
    (backward,) = [u for u in weight.users if u.target is torch.ops.aten.nll_loss_backward.default]
    assert backward.args[-1] is weight

    params = [p.detach() for p in model.parameters()]
    loss, *grads = traced.graph_module(*params, *model.buffers(), ids, labels)
    ref = zoo.lm_loss(model(ids), labels)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


def test_class_weights_and_all_ignored_targets_keep_eager_semantics() -> None:
    """Class weights divide by the weights' sum; a batch with every target ignored is nan, as eager."""
    weight = torch.rand(128, generator=torch.Generator().manual_seed(3)) + 0.5

    def weighted(out: object, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), weight=weight)  # type: ignore[attr-defined]

    model = zoo.gpt2_tiny()
    ids, labels = padded_batch(vocab=128, seq=16)
    traced = trace_training_step(model, (ids,), loss_fn=weighted, example_targets=(labels,))
    args = [*(p.detach() for p in model.parameters()), *model.buffers()]
    torch.testing.assert_close(
        traced.graph_module(*args, ids, labels)[0], weighted(model(ids), labels), rtol=1e-6, atol=0
    )
    ignored = torch.full_like(labels, -100)
    assert torch.isnan(traced.graph_module(*args, ids, ignored)[0])
    assert torch.isnan(weighted(model(ids), ignored))


def _wide_vocab_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return zoo.gpt2_lm(layers=1, hidden=32, heads=2, vocab=VOCAB, positions=SEQ)


def _padded_step_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return padded_batch(seed=step + 1)


@pytest.mark.slow
def test_padded_labels_on_a_split_batch_train_like_single_device() -> None:
    """Rank 0's half of every batch has no target at all. The vocabulary is wide enough that the
    plan splits the loss over the batch (gathering the log-probabilities would move 32 MiB)
    rather than gathering it, with one all-reduce of the stacked sum and total weight: the test
    checks that it does, so it keeps covering the split."""
    case = Case(
        name="padded-labels",
        build_model=_wide_vocab_gpt2,
        batches=_padded_step_batch,
        loss_fn=zoo.lm_loss,
        preset="2xCPU",
        pins={"input_0": "S(0)", "target_0": "S(0)", "transformer.*": "R"},
        optimizer="sgd_momentum",
        lr=0.1,
        profile=None,
        num_steps=2,
    )
    results = run_case(case)
    loss_collectives = {
        (c.producer, c.consumer, c.steps)
        for c in results[0]["plan"].collectives
        if c.producer.startswith(("nll_loss_forward", "stack", "unbind", "div"))
    }
    # the sum and the total weight, stacked, summed by one all-reduce
    assert loss_collectives == {("stack", "unbind", (("all_reduce", 0),))}, loss_collectives
    assert_trains_like_reference(results)
