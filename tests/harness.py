"""The one equivalence harness: a parallelized program trains exactly like the single-device model.

Every equivalence test (``test_equivalence``, ``test_pipeline_equivalence``, ``test_fuzz_equivalence``,
``test_model_zoo``, ``test_frozen_params``, ``test_attention_mask_grad``, ``test_inplace_ops``) runs
the same experiment on N CPU ranks joined by gloo: each rank builds the same seeded model, keeps a
deep copy as the single-device reference, parallelizes the original, then for K steps::

    sharded:   loss = pm.forward_backward(*inputs, targets=targets); opt.step(); opt.zero_grad()
    reference: loss = loss_fn(ref(*inputs), *targets); loss.backward(); ref_opt.step(); ref_opt.zero_grad()

and requires on every rank, in fp32 (:func:`assert_trains_like_reference`):

  * equal losses at every step:            |loss - ref_loss| <= rel_tol * |ref_loss|   (+ atol)
  * equal parameters after the last step:  ||full(p) - p_ref|| / ||p_ref|| <= rel_tol  for every p
    (or, with ``atol``, elementwise |full(p) - p_ref| <= atol + rel_tol * |p_ref|)

The pieces, each defined once:

  * :class:`Case` (what to train and how to plan it) and :func:`run_case` (N ranks, K steps);
  * :func:`cpu_cluster`: a CPU preset with compute made slower and memory made smaller, so that a
    pinned split is not undone by the planner (tiny models are so cheap to compute that the
    optimum often gathers everything) and the planner has to shard;
  * :func:`train_both` (the K steps on both sides) and :func:`reference_optimizer`;
  * :func:`mismatches` / :func:`assert_trains_like_reference` (the one comparison; the message
    names the worst parameter and its difference);
  * :class:`RankPool` / :func:`run_ranks`: run a function on N fresh gloo rank processes (a pool
    keeps its ranks for many jobs; ``run_ranks`` is a pool of one job). Ranks are forked from a
    forkserver that imported torch, transformers and autoplan once (:data:`RANK_PRELOAD`), with
    the test's environment: they start in 0.1 s instead of seconds.

Functions sent to ranks are pickled by reference: they must be module-level, and so must a
case's model builder, batch maker and loss.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import faulthandler
import json
import math
import os
import pickle
import queue
import re
import socket
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import autoplan

REL_TOL = 1e-5
"""Relative tolerance of losses and parameters (fp32, three steps)."""
NUM_STEPS = 3

Batch = tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]
"""``(inputs, targets)`` of one step."""


# --- clusters and optimizers ---------------------------------------------------------------------


def cpu_cluster(
    preset: str,
    *,
    mesh_shape: tuple[int, ...] | None = None,
    compute_slowdown: float = 1.0,
    capacity_bytes: int | None = None,
) -> autoplan.Cluster:
    """The CPU ``preset`` (``"2xCPU"``, ``"2x1xCPU"``, ...), its peak FLOP/s and memory bandwidth
    divided by ``compute_slowdown`` (links unchanged) and, if given, its per-device memory
    ``capacity_bytes``."""
    cluster = autoplan.Cluster.preset(preset, mesh_shape=mesh_shape)
    if compute_slowdown == 1.0 and capacity_bytes is None:
        return cluster
    cpu = cluster.device
    device = dataclasses.replace(
        cpu,
        peak_flops={k: v / compute_slowdown for k, v in cpu.peak_flops.items()},
        mem_bw_GBps=cpu.mem_bw_GBps / compute_slowdown,
        mem_capacity_bytes=cpu.mem_capacity_bytes if capacity_bytes is None else capacity_bytes,
        sources=(
            *cpu.sources,
            f"tests: compute {compute_slowdown:g}x slower than the CPU preset"
            + ("" if capacity_bytes is None else f", memory {capacity_bytes} B"),
        ),
    )
    return dataclasses.replace(cluster, device=device)


def reference_optimizer(name: str, params: Sequence[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """The single-device optimizer ``ParallelModel.make_optimizer(lr=lr)`` must match, written
    out here (not taken from autoplan) so the reference is independent of the code under test."""
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}")


# --- one case: what to train, how to plan it ------------------------------------------------------


@dataclass(frozen=True)
class SeededBatches:
    """``batches(step) = make(seed=step + 1, **kwargs)``: a picklable batch schedule for batch
    makers with a ``seed=`` keyword (step 0 uses seed 1, the example batch)."""

    make: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.make(seed=step + 1, **self.kwargs)


@dataclass(frozen=True, kw_only=True)
class Case:
    """One equivalence run: a model, its batches and loss, a cluster, the plan's constraints."""

    name: str
    build_model: Callable[[], torch.nn.Module]
    batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    """``batches(step) -> (input, target)``; step 0's batch is also the planning example."""
    loss_fn: Callable[..., torch.Tensor]
    preset: str
    """A CPU preset; its device count is the number of ranks."""
    mesh_shape: tuple[int, ...] | None = None
    """``None``: the preset's mesh."""
    compute_slowdown: float = 1.0
    capacity_bytes: int | None = None
    """Per-device memory; ``None``: the preset's. See :func:`cpu_cluster`."""
    pins: Mapping[str, str] = field(default_factory=dict)
    optimizer: str
    """What the plan is costed for and what both sides run (:func:`reference_optimizer`)."""
    lr: float
    profile: str | None = "auto"
    """``parallelize(profile=...)``: ``None`` plans from the analytic cost model only."""
    num_steps: int = NUM_STEPS

    @property
    def num_devices(self) -> int:
        return self.cluster().world_size

    def cluster(self) -> autoplan.Cluster:
        return cpu_cluster(
            self.preset,
            mesh_shape=self.mesh_shape,
            compute_slowdown=self.compute_slowdown,
            capacity_bytes=self.capacity_bytes,
        )


def _plan_key(plan: autoplan.Plan) -> str:
    d = plan.to_dict()
    return json.dumps({k: d[k] for k in ("placements", "nodes", "collectives")}, sort_keys=True)


def train_planned_lm(plan_json: str, model: torch.nn.Module, batches: SeededBatches, *, lr: float = 0.1) -> dict[str, Any]:
    """On a rank: the language model ``model`` parallelized by the plan saved as ``plan_json``
    (``Plan.to_dict``), trained :data:`NUM_STEPS` SGD-momentum steps on ``batches`` beside a
    single-device copy of it (``zoo.lm_loss``; :func:`train_both`)."""
    from tests import zoo

    plan = autoplan.Plan.from_dict(json.loads(plan_json))
    reference = copy.deepcopy(model)
    x, y = batches(0)
    pm = autoplan.parallelize(
        model, plan.cluster, example_inputs=(x,), loss_fn=zoo.lm_loss, example_targets=(y,), plan=plan
    )
    return train_both(
        pm, reference, batches=lambda step: ((batches(step)[0],), (batches(step)[1],)), loss_fn=zoo.lm_loss,
        opt=pm.make_optimizer(lr=lr), ref_opt=reference_optimizer("sgd_momentum", list(reference.parameters()), lr),
        check=False,
    )  # fmt: skip


def train_both(
    pm: Any,
    reference: torch.nn.Module,
    *,
    batches: Callable[[int], Batch],
    loss_fn: Callable[..., torch.Tensor],
    opt: torch.optim.Optimizer,
    ref_opt: torch.optim.Optimizer,
    num_steps: int = NUM_STEPS,
    check: bool = True,
    after_backward: Callable[[], None] | None = None,
    local_batches: Callable[[int], Any] | None = None,
) -> dict[str, Any]:
    """``num_steps`` steps of the parallel model ``pm`` (a ``ParallelModel`` or a pipeline) and of
    the single-device ``reference``, step ``k`` on ``batches(k) = (inputs, targets)``;
    ``check=True`` also asserts every op output has its planned placement (not for pipelines);
    ``after_backward()`` runs after each sharded backward, before the optimizer step;
    ``local_batches(k)`` (a sharded loader's ``LocalBatch`` of the same samples as ``batches(k)``)
    is what the parallel model gets instead of the global batch. Returns the losses of both sides
    and the full parameters after the last step."""
    losses, ref_losses = [], []
    for step in range(num_steps):
        inputs, targets = batches(step)
        kwargs = {"check": True} if check else {}
        if local_batches is not None:
            losses.append(pm.forward_backward(local_batches(step), **kwargs).item())
        else:
            losses.append(pm.forward_backward(*inputs, targets=tuple(targets), **kwargs).item())
        if after_backward is not None:
            after_backward()
        opt.step()
        opt.zero_grad()
        ref_loss = loss_fn(reference(*inputs), *targets)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "params": {n: p.detach() for n, p in pm.full_parameters().items()},
        "ref_params": {n: p.detach() for n, p in reference.named_parameters()},
    }


def _as_batch(pair: tuple[torch.Tensor, torch.Tensor]) -> Batch:
    x, y = pair
    return (x,), (y,)


def train_case(rank: int, world_size: int, case: Case) -> dict[str, Any]:
    """Rank body of :func:`run_case`: plan ``case`` (rank 0 solves), check every rank got the
    same plan, train both sides. Rank 0's result adds the plan."""
    model = case.build_model()
    reference = copy.deepcopy(model)
    x, y = case.batches(0)
    pm = autoplan.parallelize(
        model,
        case.cluster(),
        example_inputs=(x,),
        loss_fn=case.loss_fn,
        example_targets=(y,),
        pins=dict(case.pins),
        optimizer=case.optimizer,
        profile=case.profile,
    )
    # All ranks must run one plan: a disagreement should fail here, not hang in a collective.
    keys: list[str | None] = [None] * world_size
    dist.all_gather_object(keys, _plan_key(pm.plan))
    assert all(k == keys[0] for k in keys), f"ranks planned differently: {[hash(k) for k in keys]}"
    result = train_both(
        pm,
        reference,
        batches=lambda step: _as_batch(case.batches(step)),
        loss_fn=case.loss_fn,
        opt=pm.make_optimizer(lr=case.lr),
        ref_opt=reference_optimizer(case.optimizer, list(reference.parameters()), case.lr),
        num_steps=case.num_steps,
    )
    return result | {"rank": rank, "plan": pm.plan if rank == 0 else None}


def run_case(case: Case, *, timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Run ``case`` on its ranks (:func:`train_case`); return the per-rank results."""
    return run_ranks(train_case, case.num_devices, case, timeout_s=timeout_s)


# --- the comparison --------------------------------------------------------------------------------


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (absolute error if b is all zeros)."""
    a, b = a.detach().double(), b.detach().double()
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff / denom if denom > 0 else diff


def param_errors(result: Mapping[str, Any]) -> dict[str, float]:
    """Each parameter's relative error (:func:`rel_err`) after the last step, on one rank."""
    return {n: rel_err(p, result["ref_params"][n]) for n, p in result["params"].items()}


def _elementwise_excess(a: torch.Tensor, b: torch.Tensor, *, rel_tol: float, atol: float) -> float:
    """max(|a - b| - (atol + rel_tol * |b|)): positive where ``a`` and ``b`` differ by more."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs() - (atol + rel_tol * b.abs())).max().item() if a.numel() else -math.inf


def mismatches(
    results: Sequence[Mapping[str, Any]],
    *,
    rel_tol: float = REL_TOL,
    atol: float | None = None,
    loss_atol: float | None = None,
    param_rel_tol: Mapping[str, float] | None = None,
) -> list[str]:
    """What differs from the single-device run, on any rank (empty: it trains alike). Losses and
    parameters are compared as the module docstring says: relative to the reference's norm, or,
    with ``atol``, elementwise; a loss may differ by ``loss_atol`` more (default: ``atol``, or 0);
    ``param_rel_tol[name]`` replaces ``rel_tol`` for the relative check of that parameter
    (:func:`rounding_tolerances`). A failing rank's line names its worst parameter and the error."""
    loss_atol = (atol or 0.0) if loss_atol is None else loss_atol
    problems = []
    for rank, r in enumerate(results):
        if set(r["params"]) != set(r["ref_params"]):
            problems.append(f"rank {rank}: sharded and reference parameter sets differ")
            continue
        shapes = {n: (tuple(p.shape), tuple(r["ref_params"][n].shape)) for n, p in r["params"].items()}
        if any(a != b for a, b in shapes.values()):
            problems.append(
                f"rank {rank}: parameter shapes differ: { {n: s for n, s in shapes.items() if s[0] != s[1]} }"
            )
            continue
        for step, (loss, ref) in enumerate(zip(r["losses"], r["ref_losses"], strict=True)):
            bound = rel_tol * abs(ref) + loss_atol
            if not (math.isfinite(loss) and math.isfinite(ref) and abs(loss - ref) <= bound):
                problems.append(f"rank {rank} step {step}: loss {loss!r} != single device {ref!r}")
        if atol is None:
            errors = param_errors(r)
            tols = param_rel_tol or {}
            bad = {n: e for n, e in errors.items() if not e <= tols.get(n, rel_tol)}
            what = "relative error ||p - p_ref|| / ||p_ref||"
        else:
            errors = {
                n: _elementwise_excess(p, r["ref_params"][n], rel_tol=rel_tol, atol=atol)
                for n, p in r["params"].items()
            }
            bad = {n: e for n, e in errors.items() if not e <= 0.0}
            what = f"largest |p - p_ref| beyond {atol:g} + {rel_tol:g} * |p_ref|"
        if bad:
            worst = max(bad, key=lambda n: math.inf if math.isnan(bad[n]) else bad[n])
            problems.append(
                f"rank {rank}: {len(bad)} parameter(s) differ after {len(r['losses'])} steps, worst {worst!r} "
                f"({what}: {bad[worst]:.3e}); all: {', '.join(f'{n} {e:.2e}' for n, e in sorted(bad.items()))}"
            )
    return problems


ROUNDING_FACTOR = 4.0
"""How many times its own rounding sensitivity a difference may be (:func:`rounding_tolerances`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RoundingTolerances:
    """Tolerances of :func:`mismatches` widened to a model's own sensitivity to fp32 rounding."""

    param_rel_tol: dict[str, float]
    loss_atol: float


def rounding_tolerances(case: Case, *, num_starts: int = 4) -> RoundingTolerances:
    """How far the single-device result moves when the starting point is rounded differently.

    An ill-conditioned model amplifies rounding: a LayerNorm over 2 features (its output is +-1
    up to eps) passes back gradients that are differences of nearly equal numbers, and after three
    steps a parameter before it can move 2e-5 (relative) from one fp32 rounding of the start, more
    than :data:`REL_TOL`. Any program that sums in another order (a sharded one does) then differs
    from the single-device fp32 run by as much, while both are equally far from exact arithmetic.

    This trains ``case``'s single-device model in fp64 (no rounding of its own to speak of) from
    the seeded start and from ``num_starts`` starts perturbed elementwise by one fp32 rounding
    (relative 2**-24, random signs), and returns, per parameter, ``max(REL_TOL, ROUNDING_FACTOR *
    the largest relative move)``, and for the losses ``ROUNDING_FACTOR * the largest absolute move``.
    Well-conditioned parameters keep :data:`REL_TOL`: the widening is only where the model itself
    cannot say more (a bug moves parameters by far more than rounding does)."""

    def train(perturbation_seed: int | None) -> tuple[dict[str, torch.Tensor], list[float]]:
        model = case.build_model().double()
        if perturbation_seed is not None:
            g = torch.Generator().manual_seed(perturbation_seed)
            with torch.no_grad():
                for p in model.parameters():
                    signs = 2.0 * torch.randint(0, 2, p.shape, generator=g, dtype=torch.float64) - 1.0
                    p.mul_(1.0 + 2.0**-24 * signs)
        opt = reference_optimizer(case.optimizer, list(model.parameters()), case.lr)
        losses = []
        for step in range(case.num_steps):
            x, y = (t.double() if t.is_floating_point() else t for t in case.batches(step))
            loss = case.loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return {n: p.detach() for n, p in model.named_parameters()}, losses

    params, losses = train(None)
    moves = {n: 0.0 for n in params}
    loss_move = 0.0
    for seed in range(num_starts):
        other, other_losses = train(seed)
        moves = {n: max(m, rel_err(other[n], params[n])) for n, m in moves.items()}
        loss_move = max([loss_move, *(abs(a - b) for a, b in zip(other_losses, losses, strict=True))])
    return RoundingTolerances(
        param_rel_tol={n: max(REL_TOL, ROUNDING_FACTOR * m) for n, m in moves.items()},
        loss_atol=ROUNDING_FACTOR * loss_move,
    )


def assert_trains_like_reference(
    results: Sequence[Mapping[str, Any]],
    *,
    rel_tol: float = REL_TOL,
    atol: float | None = None,
    loss_atol: float | None = None,
) -> None:
    """On every rank: equal losses at every step, equal parameters after the last step
    (:func:`mismatches`)."""
    problems = mismatches(results, rel_tol=rel_tol, atol=atol, loss_atol=loss_atol)
    assert not problems, "\n".join(problems)


# --- N ranks -----------------------------------------------------------------------------------------


class RankFailure(AssertionError):
    """One or more ranks raised, crashed or timed out; the message holds their tracebacks."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RANK_PRELOAD = ("torch", "torch.distributed.tensor", "autoplan.api", "transformers", "tests.harness")
"""Modules a rank process starts with already imported. Ranks are forked from one forkserver that
imported these once (multiprocessing's ``forkserver`` start method): each rank is still a fresh
process holding nothing a test did, and starts in 0.1 s where a spawned interpreter spent 3-6 s
importing torch, transformers and autoplan (a 2-rank no-op job: 0.10 s against 4.0 s). What a
rank prints goes to the streams the forkserver was started with; its traceback comes back with
:class:`RankFailure`."""


def _rank_context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(RANK_PRELOAD))  # takes effect when the forkserver first starts
    return ctx


GLOO_WORKER_THREADS = 1
"""Worker threads of every gloo process group a rank creates (gloo's default: 2). With two, a
rank now and then aborts with heap corruption (:data:`ABORTED`): gdb caught both workers of one
group inside an all-gather at once, each with its free-list overwritten. With one, the loop that
aborted 4 times in 40 runs (the worst test, two worker threads) ran 50 times without an abort.
One thread serialises a group's collectives; ranks issue them in the same order, so nothing
waits on a later one."""


def _gloo_groups_with_one_worker_thread() -> None:
    """Make every gloo group this process creates run :data:`GLOO_WORKER_THREADS` worker threads.
    ``init_process_group``/``new_group`` ignore gloo options (torch 2.13,
    ``_new_process_group_helper``), so the class they construct is replaced by a subclass that
    passes them; DeviceMesh groups come through the same helper."""
    import torch.distributed.distributed_c10d as c10d

    gloo = dist.ProcessGroupGloo
    if getattr(c10d.ProcessGroupGloo, "worker_threads", None) == GLOO_WORKER_THREADS:
        return

    class _Gloo(gloo):  # type: ignore[misc,valid-type]
        worker_threads = GLOO_WORKER_THREADS

        def __init__(
            self, store: Any, rank: int, size: int, timeout: datetime.timedelta = datetime.timedelta(seconds=1800)
        ) -> None:
            opts = gloo._Options()
            opts._devices = [gloo.create_default_device()]
            opts._threads = GLOO_WORKER_THREADS
            opts._timeout = timeout
            gloo.__init__(self, store, rank, size, opts)

    c10d.ProcessGroupGloo = _Gloo  # type: ignore[misc]


def _rank_main(
    rank: int, world_size: int, port: int, timeout_s: float, jobs: Any, results: Any, environ: dict[str, str]
) -> None:
    """A pool rank: join the gloo group, then run ``fn(rank, world_size, *args)`` for each job
    until ``None`` arrives; every result or traceback goes back with its job id. ``environ``: the
    test's environment at the start (a forked rank has the forkserver's, from the first start)."""
    os.environ.clear()
    os.environ.update(environ)
    faulthandler.enable()  # a rank killed by a signal prints its Python stack (the test shows stderr)
    _gloo_groups_with_one_worker_thread()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except BaseException:  # noqa: BLE001 - the test gets the traceback
        results.put((None, rank, "error", traceback.format_exc()))
        return
    try:
        while (item := jobs.get()) is not None:
            job_id, fn, args = item
            try:
                # Plain pickle (not torch's shared-memory reductions): the bytes outlive this process.
                results.put((job_id, rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
            except BaseException:  # noqa: BLE001 - every failure goes back to the test with its traceback
                results.put((job_id, rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class RankPool:
    """``world_size`` gloo rank processes that run jobs ``fn(rank, world_size, *args)`` (a pool
    joins the process group once for all its jobs). A job that fails on any rank, or gives no
    result within ``timeout_s``, raises :class:`RankFailure` and stops the ranks (one may be left
    inside a collective); the next job starts fresh ones."""

    def __init__(self, world_size: int, *, timeout_s: float = 300.0) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.num_starts = 0
        self._ctx = _rank_context()
        self._procs: list[Any] = []
        self._next_id = 0

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self) -> None:
        port = free_port()
        self._jobs = [self._ctx.Queue() for _ in range(self.world_size)]
        self._results = self._ctx.Queue()
        self._procs = [
            self._ctx.Process(
                target=_rank_main,
                args=(r, self.world_size, port, self.timeout_s, self._jobs[r], self._results, dict(os.environ)),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self.num_starts += 1

    def stop(self, *, graceful: bool = True) -> None:
        """End the ranks: ask them to leave (``graceful``) or kill them, then release the queues."""
        if not self._procs:
            return
        if graceful:
            for q, p in zip(self._jobs, self._procs, strict=True):
                if p.is_alive():
                    q.put(None)
            for p in self._procs:
                p.join(timeout=10.0)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        for q in (*self._jobs, self._results):
            q.close()
            if not graceful:
                q.cancel_join_thread()  # a killed reader never drains its pipe
        self._procs = []

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on every rank; the per-rank results in rank order."""
        try:  # a Queue pickles in a feeder thread that only prints its error: the ranks would wait out the timeout
            pickle.dumps((fn, args))
        except Exception as exc:  # noqa: BLE001 - any pickling error, reported as one
            raise TypeError(
                f"{getattr(fn, '__qualname__', fn)!r} or its arguments cannot be sent to the ranks: {exc}; use "
                "module-level functions (no closures or lambdas) and picklable arguments"
            ) from exc
        if not self._procs:
            self._start()
        job_id, self._next_id = self._next_id, self._next_id + 1
        for q in self._jobs:
            q.put((job_id, fn, args))
        values, errors = self._collect(job_id)
        if errors:
            self.stop(graceful=False)
            text = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
            raise RankFailure(f"{len(errors)} of {self.world_size} ranks failed:\n{text}")
        return [values[r] for r in range(self.world_size)]

    def _collect(self, job_id: int) -> tuple[dict[int, Any], dict[int, str]]:
        """Wait for every rank's result of ``job_id``. A rank that exited without one is given
        2 s for its message to arrive; after a failure the others get 5 s to report theirs (they
        may be blocked in a collective with the failed rank)."""
        values: dict[int, Any] = {}
        errors: dict[int, str] = {}
        dead_since: dict[int, float] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(values) + len(errors) < self.world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                jid, rank, status, payload = self._results.get(timeout=min(0.5, deadline - now))
            except queue.Empty:
                for r, p in enumerate(self._procs):
                    if r not in values and r not in errors and p.exitcode is not None:
                        if now - dead_since.setdefault(r, now) > 2.0:
                            errors[r] = f"rank {r} exited with code {p.exitcode} without a result"
                            deadline = min(deadline, now + 5.0)
                continue
            assert jid in (job_id, None), f"result of job {jid} while running job {job_id}"  # each job is awaited
            if status == "ok":
                values[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                deadline = min(deadline, time.monotonic() + 5.0)
        for r in range(self.world_size):
            if r not in values and r not in errors:
                errors[r] = (
                    f"rank {r} gave no result within the time limit "
                    f"({self.timeout_s:.0f} s, or 5 s after another rank failed)"
                )
        return values, errors


ABORTED = re.compile(r"rank \d+ exited with code -(6|11) without a result")
"""A rank killed by SIGABRT or SIGSEGV before it reported: glibc's ``malloc(): unaligned tcache
chunk detected`` abort that gloo ranks hit now and then (README, known problems; cause not found).
Caught under gdb three times in a loop of one 2-rank test (36 runs, 3 aborts): each time in a gloo
worker thread (``pt_gloo_runloop``), in ``AsyncAllgatherCoalescedWork::allgather_coalesced``
allocating its flat output (``at::empty`` -> ``malloc`` -> ``tcache_get``): that thread's
free-list had been overwritten earlier, by code not on the stack."""

ABORT_ATTEMPTS = 3
"""Runs of a job :func:`run_ranks` gives before an abort (:data:`ABORTED`) fails it: an abort
hits one 2-rank run in about 12 of the worst test (above), so three in a row are about 1 in 1,700."""


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh gloo ranks; the per-rank results
    in rank order, or :class:`RankFailure` with each failing rank's traceback. A job whose rank was
    killed by a signal (:data:`ABORTED`) runs again on fresh ranks, with a warning naming the
    abort, up to :data:`ABORT_ATTEMPTS` runs in all: a wrong result, an exception or an abort in
    every run still fails."""
    for attempt in range(1, ABORT_ATTEMPTS + 1):
        try:
            with RankPool(world_size, timeout_s=timeout_s) as pool:
                return pool.run(fn, *args)
        except RankFailure as failure:
            aborted = ABORTED.search(str(failure))
            if attempt == ABORT_ATTEMPTS or aborted is None:
                raise
            warnings.warn(
                f"a gloo rank was killed by a signal ({aborted.group(0)}); running the job once more on fresh ranks",
                RuntimeWarning,
                stacklevel=2,
            )
    raise AssertionError("unreachable")


FORWARD_MATMULS = frozenset({"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.linear.default"})
"""The traced matmul ops whose weight operand the tensor-parallel checks follow."""
VIEW_LIKE = frozenset({
    "aten.t.default", "aten.view.default", "aten._unsafe_view.default", "aten.transpose.int",
    "aten.permute.default", "aten.expand.default", "aten.clone.default", "aten.reshape.default",
})  # fmt: skip
"""Ops a weight passes through unchanged in value on its way to a matmul."""


def forward_matmul_operands(traced: Any) -> list[tuple[torch.fx.Node, list[tuple[int, str | None, torch.fx.Node]]]]:
    """Every forward matmul of a traced step (``FORWARD_MATMULS``), with each tensor argument's
    index, the parameter it derives from through ``VIEW_LIKE`` ops (``None``: not a parameter)
    and the node it derives from."""
    from autoplan.passes.trace import param_node_name

    fqn_of = {param_node_name(n): n for n in traced.param_names}
    out = []
    for node in traced.graph_module.graph.nodes:
        if str(node.target) not in FORWARD_MATMULS or node.meta.get("autoplan.phase") != "fwd":
            continue
        operands = []
        for i, arg in enumerate(a for a in node.args if isinstance(a, torch.fx.Node)):
            src = arg
            while isinstance(src, torch.fx.Node) and str(src.target) in VIEW_LIKE:
                src = src.args[0]
            operands.append((i, fqn_of.get(src.name), src))
        out.append((node, operands))
    return out
