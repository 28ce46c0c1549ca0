"""Strategy enumeration reads what the trace already knows: the output metadata DTensor's
single-dim strategy rules need is taken from the node's traced ``val``, and it must be what
DTensor's own sharding propagation computes by running the op on fake inputs."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import TensorMeta
from torch.distributed.tensor._op_schema import OpSchema
from torch.distributed.tensor._ops import utils as dtensor_op_utils

import autoplan.passes.strategies as strategies
from autoplan.cost_models.cluster import Cluster
from autoplan.passes.placement import replicated
from autoplan.passes.strategies import _output_meta, _single, _strategy_key, build_strategy_table, tensor_args
from autoplan.passes.trace import trace_training_step
from autoplan.planner.mesh import planning_mesh
from tests.zoo import gpt2_tiny, llama_tiny, lm_loss, token_batch


def _propagated_meta(node: fx.Node, mesh: DeviceMesh) -> object:
    """DTensor's own answer: run the op on fake tensors of the inputs' metadata."""
    prop = DTensor._op_dispatcher.sharding_propagator  # noqa: SLF001

    def to_meta(a: object) -> object:
        if isinstance(a, fx.Node):
            val = a.meta.get("val")
            return _single(replicated(mesh.ndim), mesh, val) if isinstance(val, torch.Tensor) else val
        return a

    args = pytree.tree_map(to_meta, node.args, is_leaf=lambda x: isinstance(x, fx.Node))
    kwargs = pytree.tree_map(to_meta, dict(node.kwargs), is_leaf=lambda x: isinstance(x, fx.Node))
    return prop._propagate_tensor_meta_non_cached(OpSchema(node.target, tuple(args), kwargs))  # noqa: SLF001


def _same(a: object, b: object) -> bool:
    if isinstance(a, TensorMeta) and isinstance(b, TensorMeta):
        return tuple(a.shape) == tuple(b.shape) and tuple(a.stride) == tuple(b.stride) and a.dtype == b.dtype
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a is None and b is None


@pytest.mark.parametrize("build", [gpt2_tiny, llama_tiny], ids=["gpt2", "llama"])
def test_output_meta_from_the_trace_is_what_dtensor_propagates(build) -> None:  # noqa: ANN001
    ids, labels = token_batch(batch=2, seq=8)
    traced = trace_training_step(build(), (ids,), loss_fn=lm_loss, example_targets=(labels,))
    with planning_mesh(Cluster.preset("1x4xA100-80GB")) as mesh:
        checked = 0
        for node in traced.graph_module.graph.nodes:
            if node.op != "call_function" or node.target is operator.getitem or not tensor_args(node):
                continue
            if not isinstance(node.target, torch._ops.OpOverload):  # noqa: SLF001
                continue
            expected = _propagated_meta(node, mesh)
            assert _same(_output_meta(node), expected), (node.name, node.target, _output_meta(node), expected)
            checked += 1
    assert checked > 100  # forward and backward ops of two blocks, the head and the loss


@pytest.mark.parametrize(
    "build", [pytest.param(gpt2_tiny, id="gpt2"), pytest.param(llama_tiny, id="llama", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("cluster", ["1x4xA100-80GB", pytest.param("2x4xA100-80GB", marks=pytest.mark.slow)])
def test_tables_do_not_depend_on_dtensor_redistribution_costs(build, cluster, monkeypatch) -> None:  # noqa: ANN001
    """The enumeration gives DTensor's rules a redistribution cost of 0 (it prices transitions
    itself): the strategies found are exactly those found with DTensor's own costs."""
    ids, labels = token_batch(batch=4, seq=8)
    traced = trace_training_step(build(), (ids,), loss_fn=lm_loss, example_targets=(labels,))

    def table() -> dict[str, list[object]]:
        with planning_mesh(Cluster.preset(cluster)) as mesh:
            built = build_strategy_table(traced, mesh)
        return {name: [_strategy_key(s) for s in ns.strategies] for name, ns in built.nodes.items()}

    fast = table()
    monkeypatch.setattr(strategies, "_free_redistribution", dtensor_op_utils.redistribute_cost)
    with_costs = table()
    assert sum(len(v) for v in fast.values()) > 2 * len(fast)  # nodes have several strategies
    assert fast == with_costs
