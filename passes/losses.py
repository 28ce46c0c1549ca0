r"""Part of pass 1 (trace) — mean losses as a sum over a total weight, so that a sharded batch
gives the single-device loss.

``cross_entropy`` / ``nll_loss`` with ``reduction="mean"`` trace to
``(loss, total_weight) = nll_loss_forward(logp, target, weight, MEAN, ignore_index)``, with
``loss = sum_i w_i * -logp[i, t_i] / total_weight`` and ``total_weight = sum_i w_i`` over the
targets that are not ``ignore_index`` (``w_i = 1`` without class weights). On a batch split over
``n`` ranks the only sharded strategy DTensor offers for it is the mean of the per-rank means
(output ``P(avg)``), which equals the loss only if every rank holds the same total weight: a
padded batch (``-100`` labels, the Hugging Face convention) gives a different loss on every
split, and a rank whose targets are all ignored gives ``0 / 0 = nan``. The weight is data: no
plan can know it. So the trace computes the same loss in the form that splits exactly::

    (s, total_weight) = nll_loss_forward(logp, target, weight, SUM, ignore_index)   # P, P on a split batch
    (s', total_weight') = unbind(stack([s, total_weight]))                          # one all-reduce of both
    loss              = s' / total_weight'                                         # after both are summed

``nll_loss_forward`` with ``SUM`` returns the same ``total_weight``, and the backward is
unchanged: ``nll_loss_backward(grad, ..., MEAN, ignore_index, total_weight')`` divides by the
``total_weight'`` it is given, the global one once it is summed, so each rank's gradient slice
is the single-device one. On one device ``s / total_weight`` is what ``MEAN`` computes.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

MEAN, SUM = 1, 2
"""``torch.nn._reduction`` codes of ``nll_loss_forward``'s ``reduction`` argument."""

_NLL_FORWARD = (torch.ops.aten.nll_loss_forward.default, torch.ops.aten.nll_loss2d_forward.default)


def mean_losses_as_sums(gm: fx.GraphModule) -> int:
    """Rewrite every mean-reduced ``nll_loss_forward`` (and ``nll_loss2d_forward``) of ``gm`` as
    its sum divided by its total weight (module docstring), in place; ``meta["val"]`` is set on
    the new division. Returns the number of losses rewritten."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _NLL_FORWARD or _reduction(node) != MEAN:
            continue
        items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        loss = items.get(0)
        if loss is None:  # the loss value is not read (only its total weight): nothing to divide
            continue
        total = items.get(1)
        if total is None:
            with gm.graph.inserting_after(loss):
                total = gm.graph.call_function(operator.getitem, (node, 1))
            total.meta = {k: v for k, v in loss.meta.items() if k != "val"}
            total.meta["val"] = node.meta["val"][1]
        else:
            loss.append(total)  # right after the loss (it reads only the loss op), before the division
        args = list(node.args)
        if len(args) > 3:
            args[3] = SUM
            node.args = tuple(args)
        else:
            node.kwargs = {**node.kwargs, "reduction": SUM}
        _divide_once_summed(gm, loss, total)
        rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten


def _divide_once_summed(gm: fx.GraphModule, loss: fx.Node, total: fx.Node) -> None:
    """After ``loss`` (the sum) and ``total`` (the total weight), adjacent: ``pair = stack([loss,
    total])``, ``(s, w) = unbind(pair)``, ``s / w`` replaces the loss and ``w`` the total weight
    in every other reader (the backward's ``nll_loss_backward``). One tensor carries both
    numbers, so a split batch sums them with one all-reduce at ``unbind``'s input, not one per
    reader of each."""
    graph = gm.graph
    fake = loss.meta["val"]
    base = {k: v for k, v in loss.meta.items() if k != "val"}

    def add(after: fx.Node, target: object, args: tuple[object, ...], val: object) -> fx.Node:
        with graph.inserting_after(after):
            n = graph.call_function(target, args)  # type: ignore[arg-type]
        n.meta = {**base, "val": val}
        return n

    pair = add(total, torch.ops.aten.stack.default, ([loss, total],), fake.new_empty((2,)))
    parts = add(pair, torch.ops.aten.unbind.int, (pair,), [fake.new_empty(()), fake.new_empty(())])
    summed = add(parts, operator.getitem, (parts, 0), fake.new_empty(()))
    weight = add(summed, operator.getitem, (parts, 1), fake.new_empty(()))
    div = add(weight, torch.ops.aten.div.Tensor, (summed, weight), fake.new_empty(()))
    loss.replace_all_uses_with(div, delete_user_cb=lambda user: user is not pair)
    total.replace_all_uses_with(weight, delete_user_cb=lambda user: user is not pair)


def _reduction(node: fx.Node) -> object:
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", MEAN)
