"""The cluster a planning call is for, and the device meshes its strategies are enumerated on:
the cluster argument (:func:`as_cluster`), a mesh of the cluster's shape on a fake process group
(:func:`planning_mesh`; :func:`planning_alone` for one rank of a job planning for all of them),
and one pipeline stage's devices (:func:`stage_cluster`)."""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator, Sequence
from contextvars import ContextVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from autoplan.cost_models.calibration import local_cluster
from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.config import ParallelConfig
from autoplan.cost_models.echo import clip_text
from autoplan.cost_models.errors import ClusterSpecError, PlanMismatchError
from autoplan.passes.fused_norm import NORM_OPS
from autoplan.passes.liveness import is_view_op
from autoplan.passes.strategies import NodeStrategies, Strategy, StrategyTable, ValueRef, resolve_value
from autoplan.planner.plan import Plan


def as_cluster(cluster: Cluster | str) -> Cluster:
    """``cluster`` as a :class:`Cluster`: a preset string (``"2x8xH100"``) is looked up; the
    local machine (``NxCPU`` without links) gets its measured links
    (:func:`autoplan.cost_models.calibration.local_cluster`)."""
    if isinstance(cluster, str):
        cluster = Cluster.preset(cluster)
    if not isinstance(cluster, Cluster):
        what = type(cluster).__name__
        if isinstance(cluster, Plan):
            raise ClusterSpecError(
                "cluster must be an autoplan.Cluster or a preset string like '4xCPU', got a Plan: pass the plan as "
                "plan= and its cluster as the cluster (autoplan.parallelize(model, plan.cluster, plan=plan))"
            )
        raise ClusterSpecError(
            f"cluster must be an autoplan.Cluster or a preset string like '4xCPU' or '2x8xH100', "
            f"got {what} {clip_text(repr(cluster), 80)}"
        )
    return local_cluster(cluster)


_PLANNING_ALONE: ContextVar[bool] = ContextVar("autoplan_planning_alone", default=False)
"""Set by :func:`planning_alone` for its duration."""


@contextlib.contextmanager
def planning_alone() -> Iterator[None]:
    """Within: :func:`planning_mesh` gives a mesh of the cluster's shape with no process group
    behind it, even inside a job of another size, so that one rank of a job can plan for all of
    them while the others wait (``autoplan.parallelize(..., global_batch_size=...)``: the joint
    search plans stage meshes smaller than the job). Creating a process group is collective and
    would hang with one rank; the strategies read only the mesh's shape and communicate nothing."""
    token = _PLANNING_ALONE.set(True)
    try:
        yield
    finally:
        _PLANNING_ALONE.reset(token)


@contextlib.contextmanager
def planning_mesh(cluster: Cluster, *, device_type: str = "cpu") -> Iterator[DeviceMesh]:
    """A DeviceMesh of the cluster's shape for strategy enumeration.

    Inside a job of the right size the real mesh is used; otherwise a fake process group of
    ``cluster.world_size`` ranks is created for the duration (nothing is communicated); within
    :func:`planning_alone` a mesh without process groups, this process as its rank 0.
    ``device_type="cuda"`` gives a mesh whose DTensors live on the GPU (``autoplan profile``).
    """
    if _PLANNING_ALONE.get():
        # torch's private switches: no process group (_init_backend), this process is rank 0 (_rank)
        ranks = torch.arange(cluster.world_size).reshape(cluster.mesh_shape)
        yield DeviceMesh(device_type, ranks, mesh_dim_names=cluster.mesh_axis_names, _init_backend=False, _rank=0)
        return
    if dist.is_initialized():
        if dist.get_world_size() != cluster.world_size:
            raise PlanMismatchError(
                f"cannot plan for {cluster.world_size} devices inside a {dist.get_world_size()}-rank job: "
                "plan outside torchrun (autoplan plan ...) or use a cluster of the job's size"
            )
        yield init_device_mesh(device_type, cluster.mesh_shape, mesh_dim_names=cluster.mesh_axis_names)
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cluster.world_size)
    try:
        yield init_device_mesh(device_type, cluster.mesh_shape, mesh_dim_names=cluster.mesh_axis_names)
    finally:
        dist.destroy_process_group()


def data_parallel_axes(config: ParallelConfig) -> tuple[int, ...]:
    """The axes of :meth:`ParallelConfig.stage_mesh` that split the batch (``dp``, and ``ep`` when
    smaller than dp; none when ``dp`` is 1)."""
    if config.dp == 1:
        return ()
    return tuple(i for i, name in enumerate(config.stage_mesh()[1]) if name in ("dp", "ep"))


def context_parallel_axis(config: ParallelConfig) -> int | None:
    """The axis of :meth:`ParallelConfig.stage_mesh` that splits the sequence (``cp``), if any."""
    names = config.stage_mesh()[1]
    return names.index("cp") if "cp" in names else None


SEQUENCE_DIM = 1
"""The dim of a ``(batch, sequence, ...)`` input or target that context parallelism splits."""


def first_value(node: torch.fx.Node | None) -> torch.Tensor | None:
    """A node's (first) tensor value; ``None`` when it has none (a scalar or unknown)."""
    val = node.meta.get("val") if node is not None else None
    if isinstance(val, (tuple, list)):
        val = val[0] if val else None
    return val if isinstance(val, torch.Tensor) else None


def value_rank(node: torch.fx.Node | None) -> int:
    """Dimensions of a node's (first) tensor value; 0 when it has none (a scalar or unknown)."""
    val = first_value(node)
    return val.dim() if val is not None else 0


def gradient_values(graph: torch.fx.Graph) -> list[ValueRef]:
    """The values a traced joint step returns as its parameters' gradients (after the loss)."""
    out = next(n for n in graph.nodes if n.op == "output")
    _, *grads = out.args[0]
    return [resolve_value(g) for g in grads if isinstance(g, torch.fx.Node)]


def restrict_context_parallel(
    table: StrategyTable, gradients: Sequence[ValueRef], *, axis: int, zero3: bool = False
) -> None:
    """Context parallelism on mesh axis ``axis`` (``ParallelConfig.cp``), as the search prices it:
    inputs and targets of two or more dims split along the sequence (``S(1)``), parameters
    whole there (``zero3``: stored sharded, ZeRO-3 over ``dp x cp``, and gathered for use) and
    every op reads them whole (a weight is never used as a shard of the sequence axis: tensor
    parallelism is the ``tp`` axis's job). Every parameter's gradient (``gradients``) leaves the
    backward as a partial sum there (each rank's part of the sequence), reduced with the
    data-parallel ones as the step model prices it (:class:`autoplan.cost_models.step._DpGroups`).
    The activations are the ILP's to place (split along the sequence, or along the heads behind
    all-to-alls, or gathered; attention then runs as a ring over the shards or head-parallel).
    A node with no such strategy keeps all of its own."""
    params = {name for name, ns in table.nodes.items() if ns.kind == "param"}
    partial_out = {g.node: g.index for g in gradients}
    stored = Shard if zero3 else Replicate

    def allowed(s: Strategy, ns: NodeStrategies, name: str) -> bool:
        if name in partial_out and not isinstance(s.output_specs[partial_out[name]][axis], Partial):
            return False
        return all(
            isinstance(spec[axis], Replicate)
            for spec, ref in zip(s.input_specs, ns.inputs, strict=True)
            if ref.node in params
        )  # fmt: skip

    for name, ns in list(table.nodes.items()):
        if ns.kind == "param":
            keep = tuple(s for s in ns.strategies if isinstance(s.output_specs[0][axis], stored))
        elif ns.kind in ("input", "target"):
            keep = tuple(s for s in ns.strategies if s.output_specs[0][axis] == Shard(SEQUENCE_DIM))
        elif ns.kind in ("op", "fallback"):
            keep = tuple(s for s in ns.strategies if allowed(s, ns, name))
        else:
            continue
        if keep and len(keep) < len(ns.strategies):
            table.nodes[name] = NodeStrategies(node=ns.node, kind=ns.kind, strategies=keep, inputs=ns.inputs)


def tensor_parallel_axis(config: ParallelConfig) -> int | None:
    """The axis of :meth:`ParallelConfig.stage_mesh` of the tensor-parallel group (``tp``), if any."""
    names = config.stage_mesh()[1]
    return names.index("tp") if "tp" in names else None


def restrict_sequence_parallel(table: StrategyTable, graph: torch.fx.Graph, *, axis: int) -> None:
    """Megatron sequence parallelism on mesh axis ``axis`` (``ParallelConfig.sequence_parallel``):
    no activation a forward op makes outside the weight matmuls is held whole there. Every
    forward op computed from the batch (the inputs or targets, transitively) whose first output
    is a floating-point tensor of two or more dims keeps only the strategies that split that
    output on ``axis`` (``S(d)``, any dim: the tokens for norms, dropout and residual adds, the
    heads inside attention, the vocabulary or the tokens of the loss), except

    * the ops that contract or look up a weight (an input of two or more dims computed from
      parameters only: the matmuls, whose row-parallel outputs are partial sums, and the
      embedding), which stay the ILP's to place;
    * an op whose every reader is such a weight op, through views (a norm's last multiply read
      by the q, k and v projections): Megatron's all-gathered input of the column-parallel
      matmuls, gathered once there rather than once per projection (one conversion per edge).

    So the residual stream between the tensor-parallel regions is split and the ILP converts into
    and out of them (all-gather before the column-parallel matmuls, reduce-scatter after a
    row-parallel one: Korthikanti et al. 2022, section 4.2.2). A node with no such strategy keeps
    all of its own (one whose op cannot split its output there)."""
    nodes = {n.name: n for n in graph.nodes}
    weights = {name for name, ns in table.nodes.items() if ns.kind == "param"}
    data = {name for name, ns in table.nodes.items() if ns.kind in ("input", "target")}
    for name, ns in table.nodes.items():
        if ns.kind not in ("op", "fallback"):
            continue
        refs = [ref.node for ref in ns.inputs]
        if refs and all(r in weights for r in refs):
            weights.add(name)  # a weight's cast, view or transpose
        elif any(r in data for r in refs):
            data.add(name)

    def reads_weight(node: torch.fx.Node) -> bool:
        return any(a.name in weights and value_rank(a) >= 2 for a in node.all_input_nodes)

    def _norm_output(node: torch.fx.Node, user: torch.fx.Node) -> bool:
        """``user`` takes a fused norm's output (passes/fused_norm.py: the norm's last multiply)."""
        return node.target in NORM_OPS and user.target is operator.getitem

    def feeds_weight_ops(node: torch.fx.Node) -> bool:
        users = [u for u in node.users if u.meta.get("autoplan.phase") == "fwd"]
        return bool(users) and all(
            reads_weight(u) or ((is_view_op(u.target) or _norm_output(node, u)) and feeds_weight_ops(u)) for u in users
        )  # fmt: skip

    for name, ns in list(table.nodes.items()):
        node = nodes.get(name)
        if name not in data or node is None or node.meta.get("autoplan.phase") != "fwd":
            continue
        val = first_value(node)
        if (
            val is None
            or not val.is_floating_point()
            or val.dim() < 2
            or reads_weight(node)
            or feeds_weight_ops(node)
        ):
            continue
        keep = tuple(
            s for s in ns.strategies if s.output_specs and s.output_specs[0] is not None
            and isinstance(s.output_specs[0][axis], Shard)
        )  # fmt: skip
        if keep and len(keep) < len(ns.strategies):
            table.nodes[name] = NodeStrategies(node=ns.node, kind=ns.kind, strategies=keep, inputs=ns.inputs)


def stage_cluster(cluster: Cluster, config: ParallelConfig) -> Cluster:
    """The devices of one pipeline stage as a cluster with the mesh of
    :meth:`ParallelConfig.stage_mesh`: whole nodes when the stage spans nodes, else a part of
    one node."""
    shape, names = config.stage_mesh()
    n = config.dp * config.ranks_per_replica
    dpn = cluster.devices_per_node
    nodes, per_node = (n // dpn, dpn) if n > dpn and n % dpn == 0 else (1, n)
    try:
        return cluster.group(num_nodes=nodes, devices_per_node=per_node, mesh_shape=shape, mesh_axis_names=names)
    except ClusterSpecError:
        # a data-parallel group that straddles nodes: plan the placements on one "node" (the
        # search priced the real links already)
        return cluster.group(num_nodes=1, devices_per_node=n, mesh_shape=shape, mesh_axis_names=names)
