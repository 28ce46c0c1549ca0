"""In-place ops that write through views train like the single-device model.

Hugging Face DeepSeek-V3 assembles its attention key in place::

    key = kv.new_empty(...); key[..., :d].copy_(k_nope); key[..., d:].copy_(k_rot)

The traced graph used to keep those writes (``copy_`` into a ``slice`` of a ``new_empty``
buffer). A plan may convert an op's input (``R -> S(0)``), which makes a new tensor: a write
into a converted view lands in that temporary, and the buffer read later stays uninitialised
(wrong loss or NaN, exit 0). The trace now functionalizes the forward (the write becomes
``slice_scatter`` into a new value, later uses read that value), so no plan can lose a write;
the program generator refuses any plan that would still convert a mutated argument.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from autoplan.errors import PlanError
from autoplan.passes.strategies import Strategy
from autoplan.passes.trace import TracedProgram, trace_training_step
from autoplan.runtime.codegen import generate_program
from tests.harness import Case, SeededBatches, assert_trains_like_reference, run_case

WIDTH = 8
HALF = WIDTH // 2


class InPlaceAssembly(nn.Module):
    """DeepSeek-V3's key assembly in miniature: a buffer filled through two ``copy_`` into slices
    (the second one broadcasts a ``(B, 1)`` value), then scaled in place through a third slice."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Linear(WIDTH, HALF)
        self.right = nn.Linear(WIDTH, 1)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, WIDTH)
        left, right = self.left(x), self.right(x)  # (B, HALF), (B, 1)
        buf = left.new_empty(x.shape[0], WIDTH)
        buf[:, :HALF].copy_(left)
        buf[:, HALF:].copy_(right)  # broadcast (B, 1) -> (B, HALF)
        buf[:, :2].mul_(2.0)
        return self.out(torch.tanh(buf))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return InPlaceAssembly()


def make_batch(batch: int = 32, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, WIDTH, generator=g), torch.randn(batch, WIDTH, generator=g)


def _writes(node: torch.fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and any(
        a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments
    )


def test_trace_of_in_place_writes_through_views_is_functional_and_exact():
    model = build_model()
    x, y = make_batch()
    traced = trace_training_step(model, (x,), loss_fn=F.mse_loss, example_targets=(y,))

    mutating = [f"{n.name}: {n.target}" for n in traced.graph_module.graph.nodes if _writes(n)]
    assert not mutating, f"in-place ops left in the traced step: {mutating}"
    params = dict(model.named_parameters())
    loss, *grads = traced.graph_module(*params.values(), x, y)
    ref_loss = F.mse_loss(model(x), y)
    ref_grads = torch.autograd.grad(ref_loss, list(params.values()))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0.0)
    for name, g, ref in zip(params, grads, ref_grads, strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-6, atol=1e-7, msg=name)


def test_a_plan_that_converts_a_mutated_argument_is_refused_naming_the_op():
    """The generator's safety net: a graph that still writes into a view (built here by hand,
    the trace no longer makes one) and a plan that converts the written view."""

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor]:
        buf = x.new_empty(4, 8)
        buf[:, :4].copy_(x)
        buf[:, 4:].copy_(y)
        return (buf.sum(),)

    gm = make_fx(step)(torch.randn(4, 4), torch.randn(4, 4))
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.name = node.target = {"x_1": "input_0", "y_1": "input_1"}[node.name]
    gm.recompile()
    traced = TracedProgram(
        graph_module=gm, param_names=(), trainable_names=(), buffer_names=(), num_inputs=2, num_targets=0,
        fingerprint="test", trace_time_s=0.0,
    )  # fmt: skip
    r, s0 = (Replicate(),), (Shard(0),)
    assignment: dict[str, Strategy] = {"input_0": Strategy((s0,), ()), "input_1": Strategy((s0,), ())}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        if name == "aten.copy_.default":  # the written view arrives R and is converted to S(0)
            assignment[node.name] = Strategy((s0,), (s0, s0))
        elif name == "aten.sum.default":
            assignment[node.name] = Strategy((r,), (r,))
        else:  # new_empty, slice
            assignment[node.name] = Strategy((r,), (r,) if node.args and isinstance(node.args[0], torch.fx.Node) else ())
    with pytest.raises(PlanError, match=r"copy_.*writes into.*converted copy"):
        generate_program(traced, assignment, fallback_nodes=frozenset(), axis_names=("dp",), device=torch.device("cpu"))


@pytest.mark.slow
def test_in_place_assembly_trains_like_single_device_on_2_ranks():
    # a batch split makes the planner convert the replicated buffer's slices to S(0) before the
    # copies (the bug); with the functional trace there is nothing to convert wrongly
    case = Case(
        name="inplace-assembly-dp-2",
        build_model=build_model,
        batches=SeededBatches(make_batch, {"batch": 32}),
        loss_fn=F.mse_loss,
        preset="2xCPU",
        compute_slowdown=1e5,
        pins={"input_0": "S(0)", "target_0": "S(0)"},
        optimizer="sgd_momentum",
        lr=1e-2,
    )
    results = run_case(case)

    assert_trains_like_reference(results)
