"""Profiled compute times: run every distinct op of the training step on the real device.

Contract
--------
Input: a :class:`~autoplan.passes.trace.TracedProgram`, its :class:`~autoplan.passes.strategies.StrategyTable`, the
``DeviceMesh`` the table was built on (a fake process group is enough: nothing is communicated)
and a :class:`~autoplan.cost_models.profile_db.ProfileDB`. Output: the database filled with the measured
seconds of every key not already in it, and a :class:`ProfileReport`.

A *key* names one local computation, whatever node or strategy it comes from::

    op_key        = "<op>(<args with each tensor as its rank-0 local shard>)"
                    e.g. "aten.addmm.default(f32[384], f32[512,128], f32[128,384])"
    optimizer_key = "optim.<name>(<local param>)"          e.g. "optim.adam(f32[64,128])"

A tensor is written ``<dtype>[<local shape>]`` plus ``@<dims, outermost first>`` when it is not
contiguous (``t()`` of an ``(N, K)`` tensor is ``f32[K,N]@10``; ``b`` lists broadcast dims).
Local shapes are DTensor's: ``S(d)`` on an axis of size ``n`` leaves ``ceil(size / n)`` on rank 0,
nested over axes; ``R`` and ``P`` keep the full size. Non-tensor arguments appear as written in
the graph (``device=`` dropped, so meta, CPU and CUDA traces give the same keys). Placements
themselves are not part of a key: two strategies with equal local shapes run the same kernel.

Measurement
-----------
Each key is timed as the lowered program (:mod:`autoplan.runtime.lowering`) runs it: on local
tensors, with no DTensor dispatch at run time. The op's call is built as the generated program
makes it, ``node.target(*args)`` on DTensors in the strategy's input placements (random floats
in [0.5, 1.5), integer tensors zero so they are valid indices, boolean tensors true; ops
without a DTensor strategy via :func:`autoplan.runtime.collectives.replicated_call`), and traced
through DTensor by :func:`~autoplan.runtime.lowering.lower_to_local`, the function that lowers
the program; the resulting graph of local ``aten`` ops (the op itself, plus whatever local
reshaping DTensor's rule adds, e.g. the ``view`` of ``replicated_call``'s output) is what is
timed, on the rank-0 local tensors. DTensor's sharding propagation runs once, at trace time,
as it does for the program. Until issue #19 it was timed with every op (profile version 3):
on the GPT-2 of ``benchmarks/runtime_overhead.py`` (2 CPU ranks, one thread) the dp plan's
431 timed op nodes summed to 78.5 ms through DTensor against 67.3 ms lowered (medians of 6
interleaved profiles each), 26 µs a node; its 130 ``view`` nodes cost 46 µs each through
DTensor, 7 µs lowered (one profile). Two nodes of a one-op trace are not the op's computation
and are removed before timing: the identity ``view`` that wrapping each input as a DTensor
adds (the program wraps its inputs once, not per op), and any collective DTensor issues inside the call because the given input
placements need a redistribution (the communication model prices collectives; the wait's
result becomes one more input, a random tensor of its shape). The table's strategies are
DTensor's own, so their calls need no redistribution (none of the GPT-2's 255 op keys has a
collective): the second case guards input placements DTensor would not run as given.

*In program order on CPU.* A CPU runs the program's ops one after the other on the same core:
each op finds the caches as the previous, different ops left them (its inputs and the
interpreter's own data partly evicted), not as a second call of itself would.
So on CPU the keys are timed *interleaved*: in chunks of :data:`INTERLEAVE_KEYS` keys (and at
most :data:`INTERLEAVE_BYTES` of inputs), every key is called once per round, in turn, each
call timed on its own; a key's time is its median over ``repeats`` rounds (after ``warmup``
rounds). Measured on the GPT-2 model of ``benchmarks/cost_model_accuracy.py`` (timed through
DTensor, profile version 3): the same 283 keys sum to 17% more than timed in a tight loop
(matmuls +7%, elementwise ops +50-80%, views and DTensor dispatch several times), which is the
step time the planner under-predicted. On CUDA the host queues kernels ahead of the device,
so back-to-back calls are what the program sees: per key, ``warmup`` calls, then ``repeats``
rounds of enough calls to last about :data:`ROUND_TARGET_S`; the time is the median round
divided by its calls (``torch.cuda.synchronize`` brackets each round). An optimizer
key times ``step()`` of the real ``torch.optim`` optimizer, built as the runtime builds it
(:func:`autoplan.runtime.optimizers.make_torch_optimizer`), over one DTensor parameter with a
gradient, after one warm-up step: the runtime's optimizer still steps DTensor parameters.
An op that raises, or whose trace fails, is counted as failed (logged at debug level) and
left to the analytic model.
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.experimental import implicit_replication
from torch.utils import _pytree as pytree

from autoplan.cost_models.errors import ProfileError
from autoplan.cost_models.memory import OPTIMIZERS
from autoplan.cost_models.profile_db import ProfileDB
from autoplan.passes.op_keys import OpTemplate, TensorArg, local_shard_shape, op_key, op_template, optimizer_key
from autoplan.passes.placement import Spec, local_numel
from autoplan.passes.strategies import Strategy, StrategyTable
from autoplan.passes.trace import TracedProgram, param_node_name
from autoplan.runtime.collectives import replicated_call, segment_layout
from autoplan.runtime.lowering import WAIT, lower_to_local
from autoplan.runtime.optimizers import make_torch_optimizer

log = logging.getLogger(__name__)

ROUND_TARGET_S = 2e-3
"""Aim for timed rounds of about this long (many calls of a tiny op, one of a big one)."""
MAX_CALLS_PER_ROUND = 50
INTERLEAVE_KEYS = 64
"""Keys timed together, interleaved, on CPU (their inputs are alive at once: a bound on memory).
Each has one set of inputs; the other keys' calls spill it from the cache between two of its
calls (64 keys of the benchmark's GPT-2 hold about 80 MB, more than this CPU's 32 MiB last-level
cache), so the input copies of :data:`COLD_FOOTPRINT_BYTES` are not needed."""
INTERLEAVE_BYTES = 2**30
"""At most this many bytes of inputs alive in one interleaved chunk (a larger key is timed alone)."""

KeyKind = Literal["op", "fallback", "optimizer"]
KeySource = Literal["measured", "cached", "failed"]

# --------------------------------------------------------------------------------------------
# report


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfiledKey:
    """One distinct key of a program and where its time comes from."""

    key: str
    node: str
    """First node with this key (a parameter placeholder for optimizer keys)."""
    strategy_index: int
    """Index into that node's strategies."""
    kind: KeyKind
    source: KeySource
    time_s: float | None
    """Profiled seconds (``None`` when the measurement failed)."""

    def __str__(self) -> str:
        t = f"{self.time_s * 1e6:.1f}us" if self.time_s is not None else "failed"
        return f"{self.key}: {t} ({self.source})"


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileReport:
    """Outcome of :func:`profile_program`."""

    num_keys: int
    """Distinct keys of the program (ops under every strategy, plus optimizer steps)."""
    num_measured: int
    num_cached: int
    """Keys already in the database (not measured again)."""
    num_failed: int
    """Keys whose op raised; the planner uses the analytic model for them."""
    wall_s: float
    entries: tuple[ProfiledKey, ...]

    def __str__(self) -> str:
        return (
            f"{self.num_keys} keys: {self.num_measured} measured, {self.num_cached} cached, "
            f"{self.num_failed} failed in {self.wall_s:.1f}s"
        )


# --------------------------------------------------------------------------------------------
# measurement


def _random_local(arg: TensorArg, shape: tuple[int, ...], device: str, gen: torch.Generator) -> torch.Tensor:
    """A dense tensor of ``shape`` with ``arg``'s dim order and broadcast dims."""
    base = [1 if d in arg.broadcast else shape[d] for d in arg.order]
    if arg.dtype.is_floating_point or arg.dtype.is_complex:
        t = torch.rand(base, dtype=arg.dtype, device=device, generator=gen) + 0.5
    elif arg.dtype == torch.bool:
        t = torch.ones(base, dtype=arg.dtype, device=device)
    else:
        t = torch.zeros(base, dtype=arg.dtype, device=device)
    inverse = [0] * len(arg.order)
    for i, d in enumerate(arg.order):
        inverse[d] = i
    t = t.permute(inverse)
    return t.expand(shape) if arg.broadcast else t


def _dtensor(arg: TensorArg, spec: Spec, mesh: DeviceMesh, gen: torch.Generator) -> DTensor:
    local = _random_local(arg, local_shard_shape(arg.shape, spec, tuple(mesh.shape)), mesh.device_type, gen)
    return segment_layout(
        DTensor.from_local(local, mesh, spec, run_check=False, shape=torch.Size(arg.shape), stride=arg.stride)
    )


COLD_FOOTPRINT_BYTES = 64 * 2**20
"""Bytes of input copies an op's timed calls cycle through (:func:`_op_call`): twice a 32 MiB
last-level cache, so an op whose inputs are large reads them from memory as it does in a step,
where they were written long before, instead of from the cache a tight loop keeps them in."""
MAX_INPUT_COPIES = 16


def _input_bytes(tmpl: OpTemplate, strategy: Strategy, mesh_shape: tuple[int, ...]) -> int:
    """Bytes of an op's local (sharded) tensor inputs under ``strategy``."""
    return sum(
        local_numel(spec, a.shape, mesh_shape) * a.dtype.itemsize
        for a, spec in zip(tmpl.args, strategy.input_specs, strict=True)
    )


def _op_call(
    node: fx.Node, strategy: Strategy, kind: KeyKind, mesh: DeviceMesh, gen: torch.Generator, *, copies: bool = True
) -> Callable[[], object]:
    """The op's local computation as the lowered program runs it (:func:`_lower_op`), on local
    inputs in the strategy's input placements; calls cycle through enough copies of the inputs
    to spill them from the cache (:data:`COLD_FOOTPRINT_BYTES`; ``copies=False``: one set, for
    interleaved timing, where the other keys' calls spill it)."""
    tmpl = op_template(node)
    assert tmpl is not None
    forward, inputs = _lower_op(node, strategy, kind, mesh, gen, tmpl)
    first = _bind(forward, inputs)
    if not copies:
        return first
    local_bytes = _input_bytes(tmpl, strategy, tuple(mesh.shape))
    sets = min(MAX_INPUT_COPIES, max(1, math.ceil(COLD_FOOTPRINT_BYTES / max(local_bytes, 1))))
    if sets == 1:
        return first
    calls = [first] + [_bind(forward, [_like(x, gen) for x in inputs]) for _ in range(sets - 1)]
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def _bind(forward: Callable[..., object], inputs: Sequence[torch.Tensor]) -> Callable[[], object]:
    return lambda: forward(*inputs)


def _like(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A fresh tensor with ``x``'s shape, strides and dtype, filled as :func:`_random_local` fills."""
    out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    if x.dtype.is_floating_point or x.dtype.is_complex:
        out.copy_(torch.rand(x.shape, dtype=x.dtype, device=x.device, generator=gen) + 0.5)
    elif x.dtype == torch.bool:
        out.fill_(True)
    else:
        out.zero_()
    return out


def _lower_op(
    node: fx.Node, strategy: Strategy, kind: KeyKind, mesh: DeviceMesh, gen: torch.Generator, tmpl: OpTemplate
) -> tuple[Callable[..., object], list[torch.Tensor]]:
    """The op's DTensor call, ``node.target(*args)`` on DTensors in the strategy's input
    placements exactly as the generated program makes it (ops without a DTensor strategy via
    :func:`autoplan.runtime.collectives.replicated_call`), lowered to local tensors by
    :func:`autoplan.runtime.lowering.lower_to_local` as the program is, and the lowered graph's
    ``forward`` with the local inputs it takes.

    Two things of the one-op trace are not the op's local computation and are dropped: the
    ``view`` that wrapping each input as a DTensor adds (the lowered program pays it once per
    program input, not per op), and any collective DTensor issues inside the call (its result
    becomes one more input, a random tensor of its shape: a collective is priced by the
    communication model, never as compute)."""
    arg_iter = iter(tmpl.args)
    spec_iter = iter(strategy.input_specs)
    rep = (Replicate(),) * mesh.ndim

    def positional(a: object) -> object:
        if isinstance(a, fx.Node):
            val = a.meta.get("val")
            return _dtensor(next(arg_iter), next(spec_iter), mesh, gen) if isinstance(val, torch.Tensor) else val
        return a

    def keyword(a: fx.Node) -> Any:  # a DTensor or the traced scalar
        val = a.meta.get("val")
        return _dtensor(TensorArg.of(val), rep, mesh, gen) if isinstance(val, torch.Tensor) else val

    args = pytree.tree_map(positional, node.args, is_leaf=lambda a: isinstance(a, fx.Node))
    kwargs = dict(fx.node.map_arg(node.kwargs, keyword))
    if "device" in kwargs:
        kwargs["device"] = torch.device(mesh.device_type)
    target = node.target
    assert callable(target), node.target
    leaves, tree = pytree.tree_flatten((args, kwargs))
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, DTensor)]

    def program(*xs: DTensor) -> list[Any]:
        filled = list(leaves)
        for i, x in zip(slots, xs, strict=True):
            filled[i] = x
        a, kw = pytree.tree_unflatten(filled, tree)
        out = replicated_call(target, *a, **kw) if kind == "fallback" else target(*a, **kw)
        return pytree.tree_leaves(out)

    ordered = [leaves[i] for i in slots]
    gm = lower_to_local(program, ordered).graph_module
    extra = _drop_input_views_and_collectives(gm)
    inputs = [x.to_local() for x in ordered] + [_like(v, gen) for v in extra]
    return gm.forward, inputs


def _drop_input_views_and_collectives(gm: fx.GraphModule) -> list[torch.Tensor]:
    """Remove from a one-op lowered graph the identity ``view`` of each input that
    ``DTensor.from_local`` adds, and every collective (issue and wait): the wait's result becomes
    a new trailing input. Returns the fake values of those new inputs (their shapes)."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for p in placeholders:
        users = list(p.users)
        val = p.meta.get("val")
        if len(users) != 1 or not isinstance(val, torch.Tensor):
            continue
        (view,) = users
        if view.target is torch.ops.aten.view.default and list(view.args[1]) == list(val.shape):
            view.replace_all_uses_with(p)
            graph.erase_node(view)
    extra: list[torch.Tensor] = []
    for wait in [n for n in graph.nodes if n.op == "call_function" and n.target is WAIT]:
        issue = wait.args[0]
        assert isinstance(issue, fx.Node), wait.args
        first_op = next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(first_op):  # after the other inputs
            new = graph.placeholder(f"collective_{len(extra)}")
        new.meta["val"] = wait.meta["val"]
        extra.append(wait.meta["val"])
        wait.replace_all_uses_with(new)
        graph.erase_node(wait)
        if not issue.users:
            graph.erase_node(issue)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return extra


def _optimizer_call(
    name: str, arg: TensorArg, spec: Spec, mesh: DeviceMesh, gen: torch.Generator
) -> Callable[[], object]:
    contiguous = TensorArg.of(torch.empty(arg.shape, dtype=arg.dtype, device="meta"))
    param = torch.nn.Parameter(_dtensor(contiguous, spec, mesh, gen))
    param.grad = _dtensor(contiguous, spec, mesh, gen)
    opt = make_torch_optimizer(name, [param])
    opt.step()  # creates the optimizer state: later steps are the steady state
    return opt.step


def _key_bytes(w: _Work, table: StrategyTable) -> int:
    """Bytes of one key's local inputs (for an optimizer key: parameter, gradient and two states)."""
    strategy = table.nodes[w.node.name].strategies[w.strategy_index]
    mesh_shape = tuple(table.mesh_shape)
    if w.kind == "optimizer":
        arg = TensorArg.of(w.node.meta["val"])
        return 4 * local_numel(strategy.output_specs[0], arg.shape, mesh_shape) * arg.dtype.itemsize
    tmpl = op_template(w.node)
    return 0 if tmpl is None else _input_bytes(tmpl, strategy, mesh_shape)


def _interleave_chunks(todo: Sequence[_Work], table: StrategyTable) -> list[list[_Work]]:
    """Consecutive keys, at most :data:`INTERLEAVE_KEYS` and :data:`INTERLEAVE_BYTES` of inputs
    a chunk (a larger key alone)."""
    chunks: list[list[_Work]] = []
    held = 0
    for w in todo:
        nbytes = _key_bytes(w, table)
        if not chunks or len(chunks[-1]) >= INTERLEAVE_KEYS or held + nbytes > INTERLEAVE_BYTES:
            chunks.append([])
            held = 0
        chunks[-1].append(w)
        held += nbytes
    return chunks


def _key_call(
    w: _Work, table: StrategyTable, mesh: DeviceMesh, optimizer: str, gen: torch.Generator, *, interleaved: bool
) -> Callable[[], object]:
    strategy = table.nodes[w.node.name].strategies[w.strategy_index]
    if w.kind == "optimizer":
        return _optimizer_call(optimizer, TensorArg.of(w.node.meta["val"]), strategy.output_specs[0], mesh, gen)
    return _op_call(w.node, strategy, w.kind, mesh, gen, copies=not interleaved)


def _interleaved_times_s(fns: Sequence[Callable[[], object]], *, warmup: int, repeats: int) -> list[float | None]:
    """Per function: the median over ``repeats`` rounds of one call timed alone, every round
    calling each function once, in turn (CPU; see the module docstring). A function that raises
    is not called again and gets ``None``."""
    failed: set[int] = set()

    def call(i: int, fn: Callable[[], object]) -> float | None:
        if i in failed:
            return None
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - that key is left to the analytic model
            log.debug("profiled call failed after its first run: %s: %s", type(exc).__name__, exc)
            failed.add(i)
            return None
        return time.perf_counter() - t0

    for _ in range(warmup):
        for i, fn in enumerate(fns):
            call(i, fn)
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t = call(i, fn)
            if t is not None:
                samples[i].append(t)
    return [None if i in failed else statistics.median(t) for i, t in enumerate(samples)]


def _median_or_none(fn: Callable[[], object], *, device: str, warmup: int, repeats: int) -> float | None:
    try:
        return _median_time_s(fn, device=device, warmup=warmup, repeats=repeats)
    except Exception as exc:  # noqa: BLE001 - that key is left to the analytic model
        log.debug("profiled call failed after its first run: %s: %s", type(exc).__name__, exc)
        return None


def _median_time_s(fn: Callable[[], object], *, device: str, warmup: int, repeats: int) -> float:
    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    estimate_s = time.perf_counter() - t0
    calls = max(1, min(MAX_CALLS_PER_ROUND, int(ROUND_TARGET_S / max(estimate_s, 1e-9))))
    samples = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


class _Progress:
    """``\\r[####    ] 120/800 ops`` on an interactive stderr; silent otherwise."""

    def __init__(self, total: int, enabled: bool | None) -> None:
        self.total = total
        self.enabled = enabled is not False and total > 0 and sys.stderr.isatty()
        self._last = 0.0

    def update(self, done: int) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self._last < 0.1 and done < self.total):
            return
        self._last = now
        width = 30
        filled = width * done // self.total
        sys.stderr.write(f"\r[{'#' * filled}{' ' * (width - filled)}] {done}/{self.total} ops")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


@dataclass(frozen=True, slots=True)
class _Work:
    key: str
    node: fx.Node
    strategy_index: int
    kind: KeyKind


def _distinct_keys(traced: TracedProgram, table: StrategyTable, optimizer: str) -> list[_Work]:
    mesh_shape = tuple(table.mesh_shape)
    node_by_name = {n.name: n for n in traced.graph_module.graph.nodes}
    trainable = {param_node_name(p) for p in traced.trainable_names}
    seen: dict[str, _Work] = {}
    for name, ns in table.nodes.items():
        node = node_by_name[name]
        for si, s in enumerate(ns.strategies):
            if ns.kind in ("op", "fallback"):
                key = op_key(node, s, mesh_shape)
                kind: KeyKind = ns.kind
            elif ns.kind == "param" and name in trainable:  # a frozen parameter has no optimizer step
                val = node.meta["val"]
                key = optimizer_key(
                    optimizer, local_shard_shape(tuple(val.shape), s.output_specs[0], mesh_shape), val.dtype
                )
                kind = "optimizer"
            else:
                continue
            if key is not None and key not in seen:
                seen[key] = _Work(key, node, si, kind)
    return list(seen.values())


def profile_program(
    traced: TracedProgram,
    table: StrategyTable,
    mesh: DeviceMesh,
    db: ProfileDB,
    *,
    device: str = "cpu",
    optimizer: str = "adam",
    warmup: int = 3,
    repeats: int = 5,
    progress: bool | None = None,
) -> ProfileReport:
    """Measure every key of ``traced`` under ``table`` that ``db`` lacks and record it in ``db``.

    ``mesh`` must be the table's mesh, of device type ``device``. ``progress=None`` or ``True``
    shows a bar when stderr is a terminal, ``False`` never. The caller saves ``db``.
    """
    t0 = time.perf_counter()
    if mesh.device_type != device:
        raise ProfileError(
            f"profiling on {device} needs a mesh of device type {device}, got {mesh.device_type!r}: "
            f"build it with planning_mesh(cluster, device_type={device!r})"
        )
    if tuple(mesh.shape) != tuple(table.mesh_shape):
        raise ProfileError(f"mesh shape {tuple(mesh.shape)} differs from the strategy table's {table.mesh_shape}")
    if optimizer not in OPTIMIZERS:
        raise ProfileError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    if warmup < 0 or repeats < 1:
        raise ProfileError(f"warmup must be >= 0 and repeats >= 1, got warmup={warmup} repeats={repeats}")
    work = _distinct_keys(traced, table, optimizer)
    todo = [w for w in work if db.lookup(w.key) is None]
    bar = _Progress(len(todo), progress)
    gen = torch.Generator(device=device).manual_seed(0)
    outcome: dict[str, tuple[KeySource, float | None]] = {}
    chunks = _interleave_chunks(todo, table) if device == "cpu" else [[w] for w in todo]
    done = 0
    try:
        for chunk in chunks:
            with torch.no_grad(), implicit_replication():
                calls: dict[str, Callable[[], object]] = {}
                for w in chunk:
                    try:
                        fn = _key_call(w, table, mesh, optimizer, gen, interleaved=device == "cpu")
                        fn()  # an op that cannot run here fails now, before timing
                        calls[w.key] = fn
                    except Exception as exc:  # noqa: BLE001 - an op that cannot run here is left to the analytic model
                        log.debug("profiling %s (%s) failed: %s: %s", w.key, w.node.name, type(exc).__name__, exc)
                        outcome[w.key] = ("failed", None)
                if device == "cpu":
                    times = _interleaved_times_s(list(calls.values()), warmup=warmup, repeats=repeats)
                else:
                    times = [
                        _median_or_none(fn, device=device, warmup=warmup, repeats=repeats) for fn in calls.values()
                    ]
                keys = list(calls)
                del calls  # the inputs of this chunk
            for key, t in zip(keys, times, strict=True):
                if t is None:
                    outcome[key] = ("failed", None)
                    continue
                db.record(key, t)
                outcome[key] = ("measured", t)
            done += len(chunk)
            bar.update(done)
    finally:
        bar.close()
    entries = []
    for w in work:
        source, t = outcome.get(w.key, ("cached", db.lookup(w.key)))
        entries.append(
            ProfiledKey(
                key=w.key, node=w.node.name, strategy_index=w.strategy_index, kind=w.kind, source=source, time_s=t
            )
        )
    report = ProfileReport(
        num_keys=len(work),
        num_measured=sum(1 for e in entries if e.source == "measured"),
        num_cached=sum(1 for e in entries if e.source == "cached"),
        num_failed=sum(1 for e in entries if e.source == "failed"),
        wall_s=time.perf_counter() - t0,
        entries=tuple(entries),
    )
    log.info("profiled %s", report)
    return report
