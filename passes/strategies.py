"""Pass 2 — strategies: for every node of the joint graph, the shardings it can run with.

Contract
--------
Input: a :class:`~autoplan.passes.trace.TracedProgram` and a ``DeviceMesh`` (a fake process group is
enough: nothing is communicated). Output: a :class:`StrategyTable` with, for every value-producing
node, a tuple of :class:`Strategy` — the placement of each output and the placement each tensor
argument must arrive in.

The strategies of an operator are PyTorch's own DTensor op strategies (``register_op_strategy``
and single-mesh-dim strategies expanded over the mesh), so whatever the solver picks is what
DTensor executes. We keep the vocabulary ``R``, ``S(d)``, ``P`` (sum), drop shardings that
leave a device without data, and keep one strategy per input layout, the one DTensor's dispatcher
picks for those inputs (the first, unless the rule gives a later one a negative cost).

Special nodes:

* placeholders: parameters and inputs may be replicated or sharded along any dim on any axis;
  a parameter that feeds a split into ``k`` equal pieces (a fused projection) may also be
  ``S(d)/k`` (:mod:`autoplan.passes.segments`); buffers are replicated;
* *constant* nodes (depending on no placeholder, e.g. ``arange`` for positions, causal masks)
  run as plain replicated tensors; a consumer that needs one sharded slices it locally;
* ops with no DTensor strategy fall back to "replicate everything" and are listed in the plan
  (``StrategyTable.fallback_ops``);
* random ops keep only the strategies the runtime can draw exactly as one device does
  (:mod:`autoplan.passes.random_ops`: ``R``/``S(d)`` for an op that draws by position, replicated
  for the others);
* ``getitem`` on multi-output ops is an alias of the producer's output ``i`` (no decision).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, cast

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
from torch.distributed.tensor._ops import utils as _dtensor_op_utils
from torch.distributed.tensor._sharding_prop import _expand_single_dim_strategy_to_mesh
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils import _pytree as pytree

from autoplan.passes import attention, moe, random_ops
from autoplan.passes.placement import Spec, is_segment_shard, is_shardable, is_supported, replicated, spec_str
from autoplan.passes.segments import merged_dim_counts, segment_counts, segment_variants
from autoplan.passes.trace import TracedProgram, writes_an_argument, written_tensor_args

log = logging.getLogger(__name__)

NodeKind = Literal["param", "buffer", "input", "target", "op", "constant", "fallback"]


@dataclass(frozen=True, slots=True)
class ValueRef:
    """Output ``index`` of node ``node`` (``getitem`` nodes resolved away)."""

    node: str
    index: int = 0

    def __str__(self) -> str:
        return self.node if self.index == 0 else f"{self.node}[{self.index}]"


@dataclass(frozen=True, slots=True)
class Strategy:
    """One way to run a node: output placements and the placements its tensor args need."""

    output_specs: tuple[Spec | None, ...]
    """One spec per output (``None`` for outputs that are not tensors)."""
    input_specs: tuple[Spec, ...]
    """One spec per tensor argument, in :attr:`NodeStrategies.inputs` order."""

    def __str__(self) -> str:
        outs = ",".join(spec_str(s) if s is not None else "-" for s in self.output_specs)
        ins = ",".join(spec_str(s) for s in self.input_specs)
        return f"{outs}<-({ins})"


@dataclass(frozen=True, slots=True)
class NodeStrategies:
    """Decision domain of one node."""

    node: str
    kind: NodeKind
    strategies: tuple[Strategy, ...]
    inputs: tuple[ValueRef, ...]
    """Producer of each tensor argument, in flattened argument order."""


@dataclass(slots=True)
class StrategyTable:
    """Strategies of every value-producing node, in graph order."""

    mesh_shape: tuple[int, ...]
    nodes: dict[str, NodeStrategies] = field(default_factory=dict)
    fallback_ops: dict[str, str] = field(default_factory=dict)
    """node name -> op name of nodes with no DTensor strategy (run replicated)."""

    def num_strategies(self) -> int:
        return sum(len(n.strategies) for n in self.nodes.values())


# --------------------------------------------------------------------------------------------
# value references


def resolve_value(node: fx.Node) -> ValueRef:
    """Map a graph node to the value it denotes (``getitem(x, i)`` -> ``ValueRef(x, i)``)."""
    if node.op == "call_function" and node.target is operator.getitem:
        parent, idx = node.args
        assert isinstance(parent, fx.Node) and isinstance(idx, int)
        return ValueRef(resolve_value(parent).node, idx)
    return ValueRef(node.name, 0)


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """Tensor-valued node arguments of ``node`` in pytree flatten order (positional args only)."""
    leaves = pytree.tree_leaves(node.args)
    return [a for a in leaves if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def _has_tensor_kwargs(node: fx.Node) -> bool:
    return any(isinstance(a, fx.Node) for a in pytree.tree_leaves(node.kwargs))


# --------------------------------------------------------------------------------------------
# placeholder domains


def sharding_specs(shape: Sequence[int], mesh_shape: Sequence[int], *, max_dim: int | None = None) -> list[Spec]:
    """Every spec of ``R``/``S(d)`` per axis that gives each device data (``R`` first)."""
    ndim = len(shape) if max_dim is None else min(len(shape), max_dim)
    per_axis = [Replicate(), *[Shard(d) for d in range(ndim)]]
    out = []
    for combo in itertools.product(per_axis, repeat=len(mesh_shape)):
        if is_shardable(combo, shape, mesh_shape):
            out.append(tuple(combo))
    return out


# --------------------------------------------------------------------------------------------
# DTensor strategy enumeration


def _tensor_meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(t.shape, t.stride(), t.dtype)


def _output_meta(node: fx.Node) -> TensorMeta | Sequence[TensorMeta | None] | None:
    """The global output metadata of ``node`` as DTensor's sharding propagation computes it
    (``_propagate_tensor_meta_non_cached`` runs the op on fake inputs), read from the trace's
    ``val`` instead: the trace already ran the op on these shapes."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return _tensor_meta(val)
    if isinstance(val, (tuple, list)):
        metas = [_tensor_meta(v) if isinstance(v, torch.Tensor) else None for v in val]
        return tuple(metas) if isinstance(val, tuple) else metas
    return None


def _single(spec: Spec, mesh: DeviceMesh, t: torch.Tensor) -> DTensorSpec:
    return DTensorSpec(mesh, spec, tensor_meta=_tensor_meta(t))


class _Enumerator:
    """Calls DTensor's registered strategy functions with every candidate input spec."""

    def __init__(self, mesh: DeviceMesh, segment_sizes: frozenset[tuple[int, int]] = frozenset()) -> None:
        self.mesh = mesh
        self.mesh_shape = tuple(mesh.shape)
        self.segment_sizes = segment_sizes
        """(dim size, k) of the fused splits and of the dims views merge (a shard of an inner dim
        flattened into a larger one, :func:`autoplan.passes.segments.merged_dim_counts`): the only
        tensors ``S(d)/k`` may appear on."""
        self.prop = DTensor._op_dispatcher.sharding_propagator
        self._cache: dict[object, tuple[Strategy, ...] | None] = {}

    def has_strategy(self, op: object) -> bool:
        return op in self.prop.op_strategy_funcs or op in self.prop.op_single_dim_strategy_funcs

    def enumerate(self, node: fx.Node, candidates: Sequence[Sequence[Spec]]) -> tuple[Strategy, ...] | None:
        """Strategies of ``node`` given candidate specs for each tensor argument (None: no rule)."""
        op = node.target
        targs = tensor_args(node)
        key = (
            op,
            tuple(
                (tuple(a.meta["val"].shape), a.meta["val"].dtype, tuple(c))
                for a, c in zip(targs, candidates, strict=True)
            ),
            repr(
                fx.node.map_arg(
                    node.args, lambda n: n.meta["val"].shape if isinstance(n.meta.get("val"), torch.Tensor) else n.name
                )
            ),
            repr(node.kwargs),
        )
        if key not in self._cache:
            try:
                self._cache[key] = self._enumerate(node, candidates)
            except Exception as exc:  # noqa: BLE001 - a rule that cannot handle this case = no rule
                log.debug("strategy rule of %s failed on all candidates at once (%s); trying one by one", op, exc)
                self._cache[key] = self._enumerate_one_by_one(node, candidates)
        return self._cache[key]

    def _enumerate_one_by_one(self, node: fx.Node, candidates: Sequence[Sequence[Spec]]) -> tuple[Strategy, ...] | None:
        """Some rules assume one spec per input or reject some specs: ask per input combination."""
        combos = list(itertools.islice(itertools.product(*candidates), _MAX_COMBOS))
        if len(combos) == _MAX_COMBOS:
            log.warning(
                "strategies of %s: stopped after %d input-layout combinations; other layouts are not considered",
                node.name,
                _MAX_COMBOS,
            )
        found: dict[tuple[Spec, ...], Strategy] = {}
        for combo in combos:
            try:
                strategies = self._enumerate(node, [[c] for c in combo])
            except Exception as exc:  # noqa: BLE001
                log.debug("strategy rule of %s rejects %s: %s", node.target, combo, exc)
                continue
            for s in strategies or ():
                found.setdefault(s.input_specs, s)
        return tuple(found.values()) or None

    def _enumerate(self, node: fx.Node, candidates: Sequence[Sequence[Spec]]) -> tuple[Strategy, ...] | None:
        """One rule call; a single-dim rule is called again with the arguments' ``S(d)/k`` specs
        shown (it fills its shard placeholders with the kind of shard the inputs show)."""
        found = self._enumerate_showing(node, candidates, segments=False)
        op = node.target
        has_segments = any(is_segment_shard(p) for cands in candidates for c in cands for p in c)
        if found is None or not has_segments or op not in self.prop.op_single_dim_strategy_funcs:
            return found
        more = self._enumerate_showing(node, candidates, segments=True) or ()
        known = {s.input_specs for s in found}
        return found + tuple(s for s in more if s.input_specs not in known)

    def _enumerate_showing(
        self, node: fx.Node, candidates: Sequence[Sequence[Spec]], *, segments: bool
    ) -> tuple[Strategy, ...] | None:
        op = node.target
        assert isinstance(op, torch._ops.OpOverload), op
        prop, mesh = self.prop, self.mesh
        single_dim = prop.op_single_dim_strategy_funcs.get(op)
        it_strat = iter(candidates)

        def shows(c: Spec) -> bool:
            return any(is_segment_shard(p) for p in c) if segments else any(isinstance(p, Shard) for p in c)

        def to_strategy(a: object) -> object:
            if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
                cands = next(it_strat)
                t = a.meta["val"]
                if single_dim is not None:
                    # single-dim rules fill shard placeholders from the input's placements: show a Shard
                    # (or, for the second call, an S(d)/k where the argument has one, else R)
                    spec = next((c for c in cands if shows(c)), cands[0] if segments else None)
                    spec = spec or next((c for c in cands if any(isinstance(p, Shard) for p in c)), cands[0])
                    if not segments and not any(isinstance(p, Shard) for p in spec) and t.dim() > 0:
                        spec = (Shard(0), *spec[1:])
                    return OpStrategy([OpSpec(_single(spec, mesh, t))])
                return OpStrategy([OpSpec(_single(c, mesh, t)) for c in cands])
            return a.meta["val"] if isinstance(a, fx.Node) else a

        args_strat = pytree.tree_map(
            to_strategy,
            attention.planning_args(op, moe.planning_args(op, node.args)),
            is_leaf=lambda x: isinstance(x, fx.Node),
        )
        args_strat = tuple(_wrap_lists(a) for a in args_strat)
        schema_info = prop.op_to_schema_info.get(op) or prop.op_to_schema_info_for_single_dim_strategy.get(op)
        strat_schema = OpSchema(op, args_strat, dict(node.kwargs), schema_info=schema_info)
        if single_dim is not None:
            fn = _expand_single_dim_strategy_to_mesh(mesh, strat_schema, single_dim, _output_meta(node))
            result = fn(op, strat_schema.args_meta, strat_schema.kwargs_meta)
        elif op in prop.op_strategy_funcs:
            result = prop.op_strategy_funcs[op](strat_schema)
        else:
            return None
        if not isinstance(result, OpStrategy):
            return None
        return self._filter(node, result)

    def _supported(self, placements: Sequence[Placement], shape: Sequence[int]) -> bool:
        """In the vocabulary, and ``S(d)/k`` only on a dim of a fused split's (size, k)."""
        return all(
            is_supported(p)
            and (not isinstance(p, _StridedShard) or (int(shape[p.dim]), p.split_factor) in self.segment_sizes)
            for p in placements
        )

    def _filter(self, node: fx.Node, result: OpStrategy) -> tuple[Strategy, ...]:
        targs = tensor_args(node)
        val = node.meta["val"]
        out_vals = list(val) if isinstance(val, (tuple, list)) else [val]
        kept: dict[tuple[Spec, ...], tuple[float, int]] = {}  # input layout -> (rule's cost, index in out)
        out: list[Strategy] = []
        for s in result.strategies:
            outs = s.output_specs if isinstance(s.output_specs, (tuple, list)) else (s.output_specs,)
            out_specs: list[Spec | None] = []
            ok = len(outs) == len(out_vals)
            for o, v in zip(outs, out_vals, strict=False):
                if o is None or not isinstance(v, torch.Tensor):
                    out_specs.append(None)
                    continue
                if not self._supported(o.placements, v.shape) or not is_shardable(
                    o.placements, v.shape, self.mesh_shape
                ):
                    ok = False
                out_specs.append(tuple(o.placements))
            in_specs = s.input_specs if s.input_specs is not None else [outs[0]] * len(targs)
            if len(in_specs) != len(targs):
                ok = False
            ins: list[Spec] = []
            for spec, a in zip(in_specs, targs, strict=False):
                if not self._supported(spec.placements, a.meta["val"].shape) or not is_shardable(
                    spec.placements, a.meta["val"].shape, self.mesh_shape
                ):
                    ok = False
                ins.append(tuple(spec.placements))
            key = tuple(ins)
            if not ok:
                continue
            # DTensor's dispatcher prefers a negative cost a rule sets by hand (new_empty*: keep the
            # input's placement) over the first strategy; every other cost is 0 while enumerating
            cost = float(sum(itertools.chain.from_iterable(s.redistribute_cost or ())))
            strategy = Strategy(output_specs=tuple(out_specs), input_specs=tuple(ins))
            if key not in kept:
                kept[key] = (cost, len(out))
                out.append(strategy)
            elif cost < kept[key][0]:
                kept[key] = (cost, kept[key][1])
                out[kept[key][1]] = strategy
        return tuple(out)


_MAX_COMBOS = 512


def _wrap_lists(a: object) -> object:
    if isinstance(a, (list, tuple)) and a and all(isinstance(x, OpStrategy) for x in a):
        return TupleStrategy(list(a))
    return a


# --------------------------------------------------------------------------------------------
# the pass


def _strategy_key(s: Strategy) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (
        tuple("-" if spec is None else spec_str(spec) for spec in s.output_specs),
        tuple(spec_str(spec) for spec in s.input_specs),
    )


@contextlib.contextmanager
def _without_dtensor_redistribute_costs() -> Iterator[None]:
    """DTensor's strategy rules price every input redistribution of every strategy they return
    (``generate_redistribute_costs``, a third of the enumeration's time); the table keeps only
    the placements (:mod:`autoplan.passes.costing` prices transitions on the cluster), so the rules get a
    redistribution cost of 0 while enumerating. No rule filters on it: the tables of GPT-2,
    Llama and Llama-3-8B are identical with and without (tests/test_strategy_enumeration.py)."""
    real = _dtensor_op_utils.redistribute_cost
    _dtensor_op_utils.redistribute_cost = _free_redistribution
    try:
        yield
    finally:
        _dtensor_op_utils.redistribute_cost = real


def _free_redistribution(current_spec: DTensorSpec, target_spec: DTensorSpec) -> float:
    return 0.0


def build_strategy_table(traced: TracedProgram, mesh: DeviceMesh) -> StrategyTable:
    """Enumerate the strategies of every node (see the module docstring)."""
    with _without_dtensor_redistribute_costs():
        table = _build_strategy_table(traced, mesh)
    writers = frozenset(n.name for n in traced.graph_module.graph.nodes if writes_an_argument(n))
    _replicated_on_size_one_axes(table, writers)
    return table


def _replicated_on_size_one_axes(table: StrategyTable, writers: frozenset[str] = frozenset()) -> None:
    """On a mesh axis of one device every placement holds the whole tensor, so the strategies
    that differ only there are one layout; keep the replicated one. Left in, the ILP broke that
    tie with layouts that convert: a one-device stage of a ``pp=2`` GPT-2 plan ran 76
    all-gathers, 40 reduce-scatters, 31 all-to-alls and 23 all-reduces on one-rank groups, priced
    at 0 s by the search, each a copy in the program (and a collective call on a GPU), with a
    memory peak that moved by megabytes from step to step; a plan for ``1xCPU`` the same. A node
    with no such strategy keeps all of its own, except an op in ``writers`` (it writes into an
    argument, which must arrive unconverted): DTensor's rule of an in-place op shows only the
    argument's first shard (:class:`_Enumerator`), so its placements on those axes are read as
    ``R``, the same layout there (dropout's ``bernoulli_`` and ``div_`` on a one-device pipeline
    stage, whose producer ``empty_like`` keeps ``R``)."""
    ones = [i for i, n in enumerate(table.mesh_shape) if n == 1]
    if not ones:
        return
    for name, ns in list(table.nodes.items()):
        keep = tuple(
            s for s in ns.strategies
            if all(isinstance(spec[i], Replicate) for spec in (*s.input_specs, *s.output_specs) if spec is not None
                   for i in ones)
        )  # fmt: skip
        if not keep and name in writers:
            keep = tuple(dict.fromkeys(_replicated_on(s, ones) for s in ns.strategies))
        if keep and keep != ns.strategies:
            table.nodes[name] = NodeStrategies(node=ns.node, kind=ns.kind, strategies=keep, inputs=ns.inputs)


def _replicated_on(s: Strategy, axes: Sequence[int]) -> Strategy:
    """``s`` with every placement on mesh ``axes`` (of one device each) read as ``R``."""

    def rep(spec: Spec | None) -> Spec | None:
        return None if spec is None else tuple(Replicate() if i in axes else p for i, p in enumerate(spec))

    return Strategy(tuple(rep(o) for o in s.output_specs), tuple(cast(Spec, rep(i)) for i in s.input_specs))


def _writing_in_place(
    node: fx.Node, strategies: tuple[Strategy, ...], candidates: Sequence[Sequence[Spec]], n_out: int, rep: Spec
) -> tuple[Strategy, ...]:
    """Of the strategies of an op that writes into an argument, those that read that argument in
    a layout its producer can give it (any other converts it, and the write would land in the
    copy: ``redistribute.check_no_converted_writes`` refuses such a plan). DTensor's single-dim rule of
    ``copy_`` shows only a shard of its destination (:class:`_Enumerator`), so the update of a
    replicated buffer (batch norm's running statistics, :mod:`autoplan.passes.batch_norm`) gets
    none: it is given the all-replicated strategy, which every op computes."""
    written = written_tensor_args(node)
    kept = tuple(s for s in strategies if all(s.input_specs[i] in candidates[i] for i in written))
    if kept or not all(rep in candidates[i] for i in written):
        return kept or strategies
    val = node.meta["val"]
    outs = tuple(rep if isinstance(v, torch.Tensor) else None for v in (val if n_out > 1 else [val]))
    return (Strategy(outs, (rep,) * len(candidates)),)


REPLICABLE_FOLLOWERS: frozenset[object] = frozenset({torch.ops.aten.stack.default, torch.ops.aten.unbind.int})
"""Ops whose DTensor rule only follows the placement of its (first) input, given here the
all-replicated strategy too: on replicated inputs any op computes its replicated output. The loss
pass stacks a partial sum and its total weight and unbinds them (:mod:`autoplan.passes.losses`):
with ``unbind``'s input replicated the two numbers are summed by one all-reduce, not one per
reader of each."""


def _random_op_strategies(
    node: fx.Node, strategies: tuple[Strategy, ...], n_out: int, rep: Spec
) -> tuple[Strategy, ...]:
    """The rule of :mod:`autoplan.passes.random_ops`: an op that draws by position keeps DTensor's
    strategies in ``R``/``S(d)`` placements (the runtime draws the global tensor and keeps its
    shard; none left: the op falls back to replicated); any other random op runs replicated (its
    draws read the values it would need gathered)."""
    if random_ops.draws_by_position(node.target):
        return tuple(
            s for s in strategies
            if all(type(p) in (Replicate, Shard) for spec in (*s.input_specs, *s.output_specs) if spec is not None
                   for p in spec)
        )  # fmt: skip
    val = node.meta["val"]
    outs = tuple(rep if isinstance(v, torch.Tensor) else None for v in (val if n_out > 1 else [val]))
    return (Strategy(outs, (rep,) * len(tensor_args(node))),)


def input_dependent_nodes(gm: fx.GraphModule) -> frozenset[str]:
    """The placeholders, and the ``call_function`` nodes (``getitem`` aside) with a tensor argument
    computed from one: the ops the table gives strategies (kind ``op`` or ``fallback``); every
    other ``call_function`` node computes a constant (kind ``constant``: replicated, never priced)."""
    out: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            out.add(node.name)
        elif node.op == "call_function" and node.target is not operator.getitem:
            if any(resolve_value(a).node in out for a in tensor_args(node)):
                out.add(node.name)
    return frozenset(out)


def _build_strategy_table(traced: TracedProgram, mesh: DeviceMesh) -> StrategyTable:
    mesh_shape = tuple(mesh.shape)
    rep = replicated(len(mesh_shape))
    table = StrategyTable(mesh_shape=mesh_shape)
    segments = segment_counts(traced.graph_module)
    enum = _Enumerator(mesh, frozenset().union(*segments.values(), merged_dim_counts(traced.graph_module)))
    depends_on_input = input_dependent_nodes(traced.graph_module)

    def out_candidates(ref: ValueRef) -> list[Spec]:
        ns = table.nodes[ref.node]
        seen: dict[Spec, None] = {}
        for s in ns.strategies:
            spec = s.output_specs[ref.index]
            if spec is not None:
                seen.setdefault(spec, None)
        return list(seen) or [rep]

    for node in traced.graph_module.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder":
            kind: NodeKind = (
                "param"
                if node.name.startswith("p_")
                else "buffer"
                if node.name.startswith("b_")
                else "input"
                if node.name.startswith("input_")
                else "target"
            )
            specs = [rep] if kind == "buffer" else sharding_specs(val.shape, mesh_shape)
            if kind == "param" and node.name in segments:
                specs += segment_variants(specs, val.shape, segments[node.name], mesh_shape)
            table.nodes[node.name] = NodeStrategies(
                node=node.name, kind=kind, strategies=tuple(Strategy((s,), ()) for s in specs), inputs=()
            )
            continue
        if node.op == "get_attr":
            table.nodes[node.name] = NodeStrategies(
                node=node.name, kind="constant", strategies=(Strategy((rep,), ()),), inputs=()
            )
            continue
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        targs = tensor_args(node)
        refs = tuple(resolve_value(a) for a in targs)
        n_out = len(val) if isinstance(val, (tuple, list)) else 1
        if node.name not in depends_on_input:
            table.nodes[node.name] = NodeStrategies(
                node=node.name, kind="constant", strategies=(Strategy((rep,) * n_out, (rep,) * len(refs)),), inputs=refs
            )
            continue
        strategies = None
        if enum.has_strategy(node.target) and not _has_tensor_kwargs(node):
            cands = [out_candidates(r) for r in refs]
            strategies = enum.enumerate(node, cands)
            # canonical order: DTensor's strategy lists can come out in another order once its
            # caches are warm, and the ILP breaks ties by order (plans must not depend on that)
            strategies = tuple(sorted(strategies, key=_strategy_key)) if strategies else strategies
        if strategies and random_ops.draws(node):
            strategies = _random_op_strategies(node, strategies, n_out, rep)
        if strategies and writes_an_argument(node):
            strategies = _writing_in_place(node, strategies, [out_candidates(r) for r in refs], n_out, rep)
        if strategies and node.target in REPLICABLE_FOLLOWERS:
            everywhere = Strategy((rep,) * n_out, (rep,) * len(refs))
            if all(s.input_specs != everywhere.input_specs for s in strategies):
                strategies = (*strategies, everywhere)
        if not strategies:
            table.fallback_ops[node.name] = str(node.target)
            outs = tuple(rep if isinstance(v, torch.Tensor) else None for v in (val if n_out > 1 else [val]))
            table.nodes[node.name] = NodeStrategies(
                node=node.name, kind="fallback", strategies=(Strategy(outs, (rep,) * len(refs)),), inputs=refs
            )
            continue
        table.nodes[node.name] = NodeStrategies(node=node.name, kind="op", strategies=strategies, inputs=refs)
    log.info(
        "strategies: %d nodes, %d strategies, %d fallback ops",
        len(table.nodes),
        table.num_strategies(),
        len(table.fallback_ops),
    )
    return table
