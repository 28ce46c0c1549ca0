"""autoplan.passes.rebatch: the step of a larger micro-batch derived from two traces is the step tracing
gives (same graph, same shapes and strides), and the planner's costs do not change with it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import autoplan.passes.rebatch as rebatch_pass
from autoplan.cost_models.cluster import Cluster
from autoplan.passes.rebatch import rebatch
from autoplan.passes.trace import TracedProgram, trace_training_step
from autoplan.planner import tracing
from autoplan.planner.segment_model import SegmentCostModel
from tests.zoo import gpt2_tiny, llama_tiny, lm_loss, token_batch


def _trace(model: torch.nn.Module, batch: int) -> TracedProgram:
    ids, labels = token_batch(batch=batch, seq=8)
    return trace_training_step(model, (ids,), loss_fn=lm_loss, example_targets=(labels,))


def _vals(node: torch.fx.Node) -> list[Any]:
    val = node.meta.get("val")
    return list(val) if isinstance(val, (tuple, list)) else [val]


# CI derives gpt2 at 3 samples on meta kernels (llama, 8 samples and fake kernels with -m slow: the
# suite is at its 15-minute budget)
@pytest.mark.parametrize(
    "build", [pytest.param(gpt2_tiny, id="gpt2"), pytest.param(llama_tiny, id="llama", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("batch", [3, pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kernels", ["meta", pytest.param("fake", marks=pytest.mark.slow)])
def test_derived_step_is_the_traced_step(build, batch, kernels, monkeypatch) -> None:  # noqa: ANN001
    """``kernels``: the values come from the ops' meta kernels, or (an op without one) from
    running the graph on fake tensors."""
    if kernels == "fake":

        def no_meta_kernel(self: Any, target: Any, args: Any, kwargs: Any) -> Any:
            raise NotImplementedError(f"{target} has no meta kernel")

        monkeypatch.setattr(rebatch_pass._OnMeta, "__call__", no_meta_kernel)
    model = build()
    derived = rebatch(_trace(model, 2), _trace(model, 4), 2, 4, batch)
    traced = _trace(model, batch)
    assert derived is not None
    # ops, names, wiring, every argument, shapes and dtypes
    assert derived.fingerprint == traced.fingerprint
    for d, t in zip(derived.graph_module.graph.nodes, traced.graph_module.graph.nodes, strict=True):
        for dv, tv in zip(_vals(d), _vals(t), strict=True):
            if isinstance(tv, torch.Tensor):
                assert (dv.shape, dv.stride(), dv.dtype) == (tv.shape, tv.stride(), tv.dtype), d.name
                assert (type(dv), dv.device) == (type(tv), tv.device), d.name
        for key in ("autoplan.phase", "autoplan.module"):
            assert d.meta.get(key) == t.meta.get(key), (d.name, key)
    assert (derived.param_names, derived.num_inputs, derived.num_targets) == (
        traced.param_names,
        traced.num_inputs,
        traced.num_targets,
    )
    # the derived module runs: same loss as the traced one on the same weights and batch
    ids, labels = token_batch(batch=batch, seq=8)
    args = [*(p.detach() for p in model.parameters()), *model.buffers(), ids, labels]
    assert torch.equal(derived.graph_module(*args)[0], traced.graph_module(*args)[0])


@pytest.mark.slow
def test_different_programs_are_not_derived() -> None:
    gpt2, llama = gpt2_tiny(), llama_tiny()
    assert rebatch(_trace(gpt2, 2), _trace(llama, 4), 2, 4, 8) is None
    with pytest.raises(ValueError, match="b1"):
        rebatch(_trace(gpt2, 1), _trace(gpt2, 2), 1, 2, 4)  # a batch of one traces another graph


def test_a_size_the_ops_reject_is_not_derived() -> None:
    model = gpt2_tiny()
    two, four = _trace(model, 2), _trace(model, 4)
    # a view whose size does not scale with the batch: extrapolated to 8 it no longer fits
    view = next(n for n in four.graph_module.graph.nodes if n.target is torch.ops.aten.view.default)
    view.args = (view.args[0], [view.args[1][0] + 1, *view.args[1][1:]])
    assert rebatch(two, four, 2, 4, 8) is None


@pytest.mark.slow
def test_segment_costs_with_derived_traces_are_those_of_traced_ones(monkeypatch) -> None:  # noqa: ANN001
    ids, labels = token_batch()
    model, cluster = gpt2_tiny(num_layers=4), Cluster.preset("1x4xA100-80GB")
    keys = [(2, 2), (2, 4), (2, 8), (4, 8)]
    derived = SegmentCostModel(model, (ids,), lm_loss, (labels,), cluster, workers=1, extrapolate_batch=False)
    exports: list[int] = []
    real = tracing.trace_microbatch

    def counted(*args: Any, **kwargs: Any) -> TracedProgram:
        exports.append(args[-1])
        return real(*args, **kwargs)

    monkeypatch.setattr(tracing, "trace_microbatch", counted)
    got = {k: derived(*k) for k in keys}
    assert exports == [2, 4]  # 8 samples: derived from 2 and 4
    monkeypatch.setattr(SegmentCostModel, "_derived", lambda self, batch: None)
    traced = SegmentCostModel(model, (ids,), lm_loss, (labels,), cluster, workers=1, extrapolate_batch=False)
    assert got == {k: traced(*k) for k in keys}
    assert exports == [2, 4, 2, 4, 8]


@pytest.mark.slow
@pytest.mark.parametrize("build", [gpt2_tiny, llama_tiny], ids=["gpt2", "llama"])
def test_one_sample_derived_from_larger_batches_computes_the_same_step(build) -> None:  # noqa: ANN001
    """A batch of one traces to a slightly different graph; the one derived from 2 and 4 samples
    (what the cost model prices, SegmentCostModel._traced) computes the same loss and gradients."""
    model = build()
    derived = rebatch(_trace(model, 2), _trace(model, 4), 2, 4, 1)
    traced = _trace(model, 1)
    assert derived is not None
    ids, labels = token_batch(batch=1, seq=8)
    args = [*(p.detach() for p in model.parameters()), *model.buffers(), ids, labels]
    for got, want in zip(derived.graph_module(*args), traced.graph_module(*args), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_a_one_sample_plan_is_made_on_the_graph_parallelize_traces() -> None:
    """Costs price one sample with the derived graph, but the stage program of a plan whose
    data-parallel micro-batch is one sample must be the traced one (parallelize checks the
    fingerprint)."""
    import autoplan
    from autoplan.planner.tracing import trace_for_plan

    ids, labels = token_batch(batch=1)
    model = gpt2_tiny()
    plan = autoplan.plan(
        model, Cluster.preset("2xCPU"), example_inputs=(ids,), loss_fn=lm_loss, example_targets=(labels,),
        global_batch_size=1,
    )  # fmt: skip
    assert plan.config.dp * plan.config.microbatch_size == 1
    assert plan.fingerprint == trace_for_plan(plan, model, (ids,), (labels,), lm_loss).fingerprint
