"""``as_strided`` that restates a dense layout, autograd's zero-buffer scatter and layer-norm
gradients of a transposed ``grad_out`` (:mod:`autoplan.passes.strided`): Swin's classifier head
(layer norm, transpose, ``AdaptiveAvgPool1d(1)``) traces to a graph without ``as_strided`` or
``copy_``, the same on ``meta`` and CPU, that computes the model's loss and gradients and plans
(Swin was a known zoo bug until these rewrites: its plan was refused). Also here: a 0-dim constant
moved to the model's device traces the same on ``meta`` and CPU (DeBERTa-v2's relative positions).
"""

from __future__ import annotations

import torch
import torch.fx as fx

import autoplan
from autoplan.passes.strided import dense_layouts
from autoplan.passes.trace import trace_training_step

aten = torch.ops.aten


class PooledHead(torch.nn.Module):
    """Swin's head: ``(B, L, C)`` tokens, layer norm, ``transpose(1, 2)``, ``AdaptiveAvgPool1d(1)``,
    flatten, linear classifier."""

    def __init__(self, channels: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(channels, channels)
        self.norm = torch.nn.LayerNorm(channels)
        self.pool = torch.nn.AdaptiveAvgPool1d(1)
        self.head = torch.nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.proj(x))
        return self.head(torch.flatten(self.pool(y.transpose(1, 2)), 1))


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits, labels)


def _example(device: str = "cpu"):  # noqa: ANN202
    torch.manual_seed(0)
    with torch.device(device):
        model = PooledHead()
    x = torch.randn(4, 5, 8, device=device)
    labels = torch.tensor([0, 2, 1, 0], device=device)
    return model, x, labels


def _targets(gm: fx.GraphModule) -> set[object]:
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


def test_pooled_head_traces_without_as_strided_or_in_place_writes_and_computes_the_models_step():
    model, x, labels = _example()
    traced = trace_training_step(model, (x,), loss_fn=_loss, example_targets=(labels,))
    found = _targets(traced.graph_module) & {aten.as_strided.default, aten.as_strided_.default, aten.copy_.default}
    assert not found, f"left in the graph: {found}"

    loss, *grads = traced.graph_module(*[p.detach() for p in model.parameters()], x, labels)
    reference = _loss(model(x), labels)
    reference.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=0)
    for (name, p), g in zip(model.named_parameters(), grads, strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_pooled_head_traces_the_same_on_meta_and_cpu_and_its_meta_plan_applies_on_cpu():
    """The layer-norm backward reads a transposed ``grad_out``: without a contiguous one the meta
    trace reshapes its gradient with ``clone`` + ``view`` and the CPU trace with ``view``."""
    meta_model, meta_x, meta_labels = _example("meta")
    meta = trace_training_step(meta_model, (meta_x,), loss_fn=_loss, example_targets=(meta_labels,))
    model, x, labels = _example()
    cpu = trace_training_step(model, (x,), loss_fn=_loss, example_targets=(labels,))
    assert meta.fingerprint == cpu.fingerprint

    norm_grads = [n for n in cpu.graph_module.graph.nodes if n.target is aten.native_layer_norm_backward.default]
    assert len(norm_grads) == 1
    assert norm_grads[0].args[0].target is aten.clone.default  # the transposed grad_out, made contiguous

    plan = autoplan.plan(
        meta_model, autoplan.Cluster.preset("2xCPU"), example_inputs=(meta_x,), loss_fn=_loss,
        example_targets=(meta_labels,),
    )  # fmt: skip
    plan.check_applies_to(fingerprint=cpu.fingerprint, world_size=2)


def _graph(build) -> fx.GraphModule:  # noqa: ANN001 - builds nodes on the graph it is given
    g = fx.Graph()
    build(g)
    gm = fx.GraphModule(torch.nn.Module(), g)
    for node in g.nodes:  # values on meta, as the trace records them
        if node.op == "placeholder":
            node.meta["val"] = torch.empty(node.meta.pop("shape"), device="meta")
        elif node.op == "call_function":
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
            node.meta["val"] = node.target(*args, **kwargs)
    return gm


def test_as_strided_that_moves_elements_and_a_read_of_the_zeros_before_their_write_are_kept():
    def moved(g: fx.Graph) -> None:
        x = g.placeholder("x")
        x.meta["shape"] = (4, 6)
        t = g.call_function(aten.as_strided.default, (x, [6, 4], [1, 6]))  # a transpose: other elements
        g.output(t)

    gm = _graph(moved)
    assert dense_layouts(gm) == 0 and aten.as_strided.default in _targets(gm)

    def read_before_write(g: fx.Graph) -> None:
        src = g.placeholder("src")
        src.meta["shape"] = (2, 3)
        buf = g.call_function(aten.new_zeros.default, (src, [6]))
        early = g.call_function(aten.as_strided.default, (buf, [2, 3], [3, 1], 0))
        dst = g.call_function(aten.as_strided.default, (buf, [2, 3], [3, 1], 0))
        g.call_function(aten.copy_.default, (dst, src))
        late = g.call_function(aten.as_strided.default, (buf, [3, 2], [2, 1], 0))
        g.output((early, late))

    gm = _graph(read_before_write)
    assert dense_layouts(gm) == 0 and aten.copy_.default in _targets(gm)


def test_a_zero_buffer_written_whole_then_read_is_a_copy_of_what_was_written():
    def scatter(g: fx.Graph) -> None:
        src = g.placeholder("src")
        src.meta["shape"] = (2, 3)
        buf = g.call_function(aten.new_zeros.default, (src, [6]))
        dst = g.call_function(aten.as_strided.default, (buf, [2, 3], [3, 1], 0))
        g.call_function(aten.copy_.default, (dst, src))
        read = g.call_function(aten.as_strided.default, (buf, [3, 1, 2], [2, 6, 1], 0))
        g.output(read)

    gm = _graph(scatter)
    src = torch.arange(6.0).reshape(2, 3)
    before = gm(src)
    assert dense_layouts(gm) == 2  # the buffer's write and its one read
    assert not _targets(gm) & {aten.as_strided.default, aten.copy_.default, aten.new_zeros.default}
    torch.testing.assert_close(gm(src), before, rtol=0, atol=0)


class ScalarConstant(torch.nn.Module):
    """DeBERTa-v2's bucketing: a 0-dim tensor made in ``forward`` and moved to the input's device."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        return torch.where(y.abs() < 0.5, torch.tensor(0.5).type_as(y), y)


def test_a_scalar_constant_moved_to_the_models_device_traces_the_same_on_meta_and_cpu():
    def traced(device: str):  # noqa: ANN202
        torch.manual_seed(0)
        with torch.device(device):
            model, x = ScalarConstant(), torch.randn(4, 8)
        return trace_training_step(model, (x,), loss_fn=lambda out: out.square().mean())

    meta, cpu = traced("meta"), traced("cpu")
    assert aten._to_copy.default not in _targets(meta.graph_module)
    assert meta.fingerprint == cpu.fingerprint
