"""The strategy the table keeps for an input layout is the one DTensor's dispatcher runs.

The planner keeps one strategy per input layout of an op; the generated program then runs the op
on DTensors, whose dispatcher picks its own strategy for the inputs it is given. If the two
disagree, the program's values have other placements than the plan says (``check=True`` stops
with ``PlacementMismatchError``; the zoo's DeepSeek-V3 did, at the ``new_empty_strided`` of
autograd's ``clone_obey_contract`` in the attention backward). DTensor's rule for
``new_empty``/``new_empty_strided`` offers two outputs for a sharded input, replicated (first)
and the input's placement (a negative redistribution cost, which the dispatcher prefers).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._op_schema import OpSchema

from autoplan.cost_models.cluster import Cluster
from autoplan.passes.strategies import _single, build_strategy_table
from autoplan.passes.trace import trace_training_step
from autoplan.planner.mesh import planning_mesh


class _UninitializedBuffers(nn.Module):
    """``new_empty`` and ``new_empty_strided`` of an activation, then filled. (A buffer filled by
    ``copy_`` from a whole tensor, DeepSeek's forward pattern, is traced away since forward writes
    are functionalized; ``fill_`` keeps the factory in the graph, as autograd's backward does.)"""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        a = h.new_empty(h.shape).fill_(2.0)
        b = h.new_empty_strided(h.shape, h.stride()).fill_(1.0)
        return h * a + b


def _dispatcher_output(node: fx.Node, input_specs: tuple, mesh: object) -> tuple:  # noqa: ANN001
    """The output placements DTensor's dispatcher gives ``node`` for inputs in ``input_specs``."""
    prop = DTensor._op_dispatcher.sharding_propagator  # noqa: SLF001
    specs = iter(input_specs)

    def to_spec(a: object) -> object:
        if isinstance(a, fx.Node):
            val = a.meta["val"]
            return _single(next(specs), mesh, val) if isinstance(val, torch.Tensor) else val
        return a

    args = pytree.tree_map(to_spec, node.args, is_leaf=lambda x: isinstance(x, fx.Node))
    schema = OpSchema(node.target, tuple(args), dict(node.kwargs), schema_info=prop.op_to_schema_info.get(node.target))
    out = prop.propagate_op_sharding_non_cached(schema).output_spec
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return tuple(None if o is None else tuple(o.placements) for o in outs)


def test_kept_strategy_of_every_op_is_what_dtensor_dispatches() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    traced = trace_training_step(
        _UninitializedBuffers(), (x,), loss_fn=lambda out, y: (out - y).pow(2).mean(), example_targets=(x.clone(),)
    )
    nodes = {n.name: n for n in traced.graph_module.graph.nodes}
    factories = {"aten.new_empty.default": 0, "aten.new_empty_strided.default": 0}
    with planning_mesh(Cluster.preset("2xCPU")) as mesh:
        table = build_strategy_table(traced, mesh)
        for name, ns in table.nodes.items():
            if ns.kind != "op":
                continue
            node = nodes[name]
            for s in ns.strategies:
                got = _dispatcher_output(node, s.input_specs, mesh)
                assert got[: len(s.output_specs)] == s.output_specs, (name, str(node.target), str(s), got)
                if str(node.target) in factories and s.input_specs[0] != ("R",):
                    factories[str(node.target)] += 1
    assert all(factories.values()), f"the factories were not planned with a sharded input: {factories}"
