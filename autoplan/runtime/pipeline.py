"""Pipeline-parallel execution of a plan with ``torch.distributed.pipelining``.

A pipeline plan is: stages as contiguous segment ranges of the :class:`~autoplan.passes.layers.Layering`
(``stage_starts``), a per-op sharding of the joint graph traced at the *micro-batch* size on the
stage sub-mesh (the same for every stage), a schedule and a number of micro-batches.
:func:`build_pipeline` generates the per-rank program on this rank's stage sub-mesh
(:func:`autoplan.runtime.codegen.generate_program`), cuts it into stage programs
(:func:`autoplan.passes.stages.split_stages`) and wraps each stage in a ``PipelineStage`` whose module runs
the stage's forward program and, in its autograd backward, the stage's backward program.
PipelineStage sends local tensors between ranks with the same stage-mesh coordinate; each end
rebuilds the DTensor from the placement the plan gives the value.

The loss: the model inputs enter stage 0 (``schedule.step(*inputs)`` on the first-stage ranks)
and the loss targets the last stage (``schedule.step(target=...)`` on the last-stage ranks: torch
cuts it into micro-batches and calls ``loss_fn(output, target_chunk)`` on the last stage only), so
the targets never travel between stages. The last stage's module hands the schedule the values it
received; the schedule's ``loss_fn`` (:meth:`StageModule.loss`) runs the stage's forward program on
them and that micro-batch's targets and returns the (per-micro-batch mean) loss, whose backward
seeds 1: the last stage's backward program starts from its own traced seed.

Every stage (not under zero-bubble) converts its gradients in its backward, bucket by bucket as
they exist (DDP/FSDP2; buckets hold one stage's gradients); with several micro-batches the
earlier ones' raw gradients are summed and the last one's backward
(:attr:`StageModule.last_microbatch`) adds that sum to each gradient before its bucket, as
Megatron's gradient buffer does and as torch's pipelining runs FSDP2 (gradient sync in the last
backward only). With ``sharded_grad_accumulation`` (ZeRO >= 2, FSDP2's default) every
micro-batch's backward converts its own gradients in its buckets instead and the shards are added
into sharded accumulators (:func:`~autoplan.cost_models.comm_schedule.converting_backwards`); the
buckets one backward leaves in flight are waited for before the stage's next backward. The last
buckets are still in flight when that backward returns: the stage hands
its input gradient on without waiting for them, and they are waited for after the schedule,
before the optimizer (:meth:`StageModule.finish_conversions`). A parameter tied across stages (and,
under zero-bubble, every parameter) keeps its raw gradient summed over micro-batches, converted
once per step after the schedule to the parameter placement (in backward order, in the buckets
of :func:`~autoplan.cost_models.comm_schedule.gradient_buckets`: one coalesced all-reduce or
reduce-scatter per bucket and mesh axis) and summed over the stages holding a copy. Every
gradient is divided by the number of micro-batches.
A frozen parameter (``requires_grad=False``) is held and read like the others but gets no
gradient and no optimizer state. Where the program reads a parameter in another dtype than the
model keeps it in (a bf16 plan of an fp32 model), the stages run in mixed precision: bf16 copies of
the fp32 shards for the step, gradients reduced in bf16 and handed to ``.grad`` in fp32
(:mod:`autoplan.runtime.precision`).

Recomputation, per stage (``stage_recompute``): ``none`` keeps what the stage's backward reads;
``selective`` and ``full`` run the stage program of
:func:`autoplan.passes.recompute.recompute_stage_program` under that policy, the rule
:mod:`autoplan.planner.segment_costs` prices: the forward keeps random-op outputs and block inputs
(``selective`` also matmul and collective outputs), the backward re-runs the ops between them,
each right before its first reader (``full``: one block's forward at a time, as Megatron and
torchtitan checkpoint per block; zero-bubble runs them in B).

Random ops: with several stages each stage draws from a generator state of its own
(:class:`~autoplan.runtime.random_ops.StageRandomStream`), the same on the ranks of the stage,
seeded at each step from one draw of the default generator; one stage draws from the default
generator, as the single-device model does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.modules.module import _IncompatibleKeys

from autoplan.cost_models.comm import bucket_kind, plan_transition
from autoplan.cost_models.comm_schedule import (
    DEFAULT_POLICY,
    converting_backwards,
    gradient_buckets,
    gradients_reduced_in_backward,
)
from autoplan.cost_models.config import ScheduleName, check_schedule
from autoplan.cost_models.errors import PlanError, PlanMismatchError
from autoplan.passes import kv_rows
from autoplan.passes.layers import Layering
from autoplan.passes.placement import spec_str
from autoplan.passes.recompute import POLICIES, recompute_stage_program
from autoplan.passes.stages import (
    StageProgram,
    StageSplit,
    ValueInfo,
    param_stages,
    split_backward,
    split_stages,
    stage_of_segment,
)
from autoplan.passes.strategies import Strategy
from autoplan.passes.trace import TracedProgram, param_node_name
from autoplan.planner.plan import Plan
from autoplan.runtime import collectives as runtime
from autoplan.runtime import precision, training
from autoplan.runtime.codegen import STEP_FN, generate_program
from autoplan.runtime.data import BatchLayout, LocalBatch, ShardedLoader, batch_mismatch, check_global_batch_size
from autoplan.runtime.lowering import DeferredWaits, LocalProgram, defer_output_waits, local_shard, lower_to_local
from autoplan.runtime.optimizers import make_optimizer
from autoplan.runtime.random_ops import StageRandomStream, step_seed


def _local_shape(v: ValueInfo, mesh: DeviceMesh) -> tuple[int, ...]:
    if v.spec is None:
        return v.shape
    shape, _ = compute_local_shape_and_global_offset(v.shape, mesh, list(v.spec))
    return tuple(shape)


def _wrap(local: torch.Tensor, v: ValueInfo, mesh: DeviceMesh) -> torch.Tensor:
    if v.spec is None:
        return local
    return runtime.segment_layout(
        DTensor.from_local(local, mesh, list(v.spec), run_check=False, shape=torch.Size(v.shape), stride=v.stride)
    )


def _unwrap(x: torch.Tensor) -> torch.Tensor:
    """The local tensor, with any pending collective finished: DTensor's redistribute returns
    functional-collective results that complete lazily, and a tensor handed to the pipeline's
    asynchronous send (or kept across micro-batches) must hold its final values."""
    local = x.to_local() if isinstance(x, DTensor) else x
    if isinstance(local, AsyncCollectiveTensor):
        local = local.wait()
    return local.contiguous()


EXECUTABLE_RECOMPUTE: tuple[str, ...] = ("none", "selective", "full")
"""Recomputation the stage runtime implements: ``selective`` and ``full`` run the stage program of
:func:`autoplan.passes.recompute.recompute_stage_program` under that policy (``selective``: the
forward keeps matmul outputs and block inputs, the backward re-runs the cheap ops between them;
``full``: each block keeps its input and the backward re-runs the block)."""


class _StageFunction(torch.autograd.Function):
    """Forward: the stage's forward program; backward: its backward program (local tensors in/out)."""

    @staticmethod
    def forward(ctx: Any, module: StageModule, anchor: torch.Tensor, *inputs: torch.Tensor) -> Any:  # noqa: ARG004
        outs, saved = module.run_forward(inputs)
        ctx.module = module
        ctx.saved_values = saved
        ctx.set_materialize_grads(False)
        ids = {id(x) for x in inputs}
        outs = [o.clone() if id(o) in ids else o for o in outs]
        no_grad = [
            o for o, g in zip(outs, module.program.output_grads, strict=True) if g is None and not module.is_last
        ]
        if no_grad:
            ctx.mark_non_differentiable(*no_grad)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> Any:
        saved, ctx.saved_values = ctx.saved_values, None  # the backward frees each once it is read
        grads = ctx.module.run_backward(saved, grad_outputs)
        return (None, None, *grads, *(None for _ in ctx.module.program.targets))  # no gradient for a target


class StageModule(torch.nn.Module):
    """One pipeline stage: its parameter copies (DTensors on the stage mesh) and programs."""

    def __init__(
        self,
        program: StageProgram,
        *,
        model: torch.nn.Module,
        assignment: Mapping[str, Strategy],
        mesh: DeviceMesh,
        num_stages: int,
        device: torch.device,
        split_weight_grads: bool = False,
        compute_dtypes: Mapping[str, torch.dtype] | None = None,
        last_microbatch: StageProgram | None = None,
        num_microbatches: int = 1,
        converts_grads: bool = False,
        deferred_grads: frozenset[str] = frozenset(),
        param_layouts: Mapping[str, kv_rows.KVGroupRows] | None = None,
    ) -> None:
        """The stage's programs and its parameter copies (long: each attribute is documented where
        it is set)."""
        super().__init__()
        self.program = program
        self.param_layouts = dict(param_layouts or {})
        """``TracedProgram.param_layouts``: parameters kept in another layout than the model's."""
        self.converted_in_program = frozenset(
            f for f, _ in program.param_grads if converts_grads and f not in deferred_grads
        )
        """FQNs whose gradients the (last micro-batch's, or with sharded accumulation every
        micro-batch's) backward program converts itself (``converts_grads``: DDP/FSDP2-style
        buckets issued during the backward; the shards are summed in ``grad_acc``); the others come
        out raw and :meth:`PipelineModel._finish_grads` converts them after the schedule
        (``deferred_grads``: a parameter tied across stages; every parameter of a zero-bubble
        schedule)."""
        if last_microbatch is not None and (
            last_microbatch.saved != program.saved
            or last_microbatch.accumulated_grads != tuple(f for f, _ in program.param_grads if f not in deferred_grads)
        ):
            raise AssertionError(f"stage {program.index}: the last micro-batch's backward reads other values")
        self.last_microbatch = last_microbatch
        """One stage, several micro-batches: the backward the step's last micro-batch runs, which
        adds the earlier ones' summed raw gradients (``accumulated_grads``) to its own and
        converts each sum in its bucket as it exists (``generate_program(accumulated_grad_inputs=True)``)."""
        self.num_microbatches = num_microbatches
        self.backwards_run = 0
        """Backward programs run this step (the ``num_microbatches``-th runs :attr:`last_microbatch`)."""
        self.split = (
            split_backward(program.backward, sum(1 for v in program.input_grads if v is not None))
            if split_weight_grads
            else None
        )
        """Zero-bubble schedules: the backward as an input-gradient (B) and a weight-gradient (W) program."""
        self.batch_is_local = False
        """Stage 0's inputs and the last stage's targets came from a sharded loader this step
        (already this rank's shard of each micro-batch); else each micro-batch is global and
        :meth:`run_forward` cuts it."""
        self.step_targets: tuple[torch.Tensor, ...] = ()
        """The last stage, a step with several targets (or none): this step's targets, whose rows
        :meth:`loss` picks by the positions the schedule hands it (:func:`_schedule_target`)."""
        self.pending_w: list[Callable[[], None]] = []
        """W work of backwards already run, newest last (handed to the schedule by ``dw_builder``)."""
        self.mesh = mesh
        self.is_last = program.index == num_stages - 1
        self.random = StageRandomStream(device, program.index) if num_stages > 1 else None
        """Several stages: the generator state this stage's random ops draw from (one stage: the
        default generator, as the single-device model draws; autoplan.runtime.random_ops)."""
        named = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        self.param_specs = {n: assignment[param_node_name(n)].output_specs[0] for n in program.param_names}
        self.params = torch.nn.ParameterList(
            training.sharded_parameter(
                n,
                named[n],
                self.param_layouts,
                mesh,
                self.param_specs[n],
                device=device,
                requires_grad=named[n].requires_grad,  # a frozen parameter stays frozen (autoplan.passes.trace)
            )  # fmt: skip
            for n in program.param_names
        )
        dtypes = dict(compute_dtypes or {})
        self.compute_dtypes = tuple(
            dtypes.get(n, p.dtype) for n, p in zip(program.param_names, self.params, strict=True)
        )
        """Per parameter, the dtype the programs read it in (``compute_dtypes``; default its own)."""
        self.mixed_precision = any(p.dtype != d for p, d in zip(self.params, self.compute_dtypes, strict=True))
        """Some parameter is read in another dtype than it is kept in (autoplan.runtime.precision)."""
        self._compute: list[torch.Tensor] | None = None
        """Mixed precision: this step's copies of the parameters' local shards in the dtypes the
        programs read, made at the step's first program call and dropped by
        :meth:`release_compute_copies` once its backward is done."""
        rep = runtime.replicate
        self._buffers_list = [
            rep(buffers[n].detach().to(device=device, dtype=dtypes.get(n, buffers[n].dtype)), mesh)
            for n in program.buffer_names
        ]
        persistent = training.persistent_buffer_names(model)
        self.persistent_buffers = {
            n: b for n, b in zip(program.buffer_names, self._buffers_list, strict=True) if n in persistent
        }
        """FQN -> the buffers of this stage that ``model.state_dict()`` holds, as its programs read them
        (replicated DTensors, written in place by a batch norm's running statistics): in the
        pipeline's state dict and checkpoints."""
        self.anchor = torch.ones((), device=device, requires_grad=True)
        self.lowered: dict[str, LocalProgram] = {}
        """The forward and backward programs lowered to local tensors (autoplan.runtime.lowering),
        traced at their first call."""
        self.grad_acc: dict[str, torch.Tensor] = {}
        """FQN -> local gradient summed over this step's micro-batches: raw, or converted (the
        shards of :attr:`converted_in_program` under sharded accumulation)."""
        self._owned: set[str] = set()
        """FQNs whose ``grad_acc`` tensor this module allocated (may be added to in place); the
        first micro-batch's gradient is the program's own output, kept without a copy."""
        self._local_params: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        """The parameters' local tensors when last detached, and those detached tensors."""
        self._waits: dict[str, DeferredWaits | None] = {}
        """Per converting program, its lowered form cut at its output waits (``None``: no cut)."""
        self._in_flight: list[tuple[DeferredWaits, list[Any], dict[int, str]]] = []
        """This step's converting backwards' buckets in flight: the cut program, what its finish
        reads, and output slot -> FQN."""

    def forward(self, *inputs: torch.Tensor) -> Any:
        """The stage's forward program on what it received; the last stage hands its inputs on
        unchanged to the schedule's ``loss_fn`` (:meth:`loss`), which alone has the targets."""
        if self.is_last:
            return inputs
        return _StageFunction.apply(self, self.anchor, *inputs)

    def loss(self, received: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        """The schedule's ``loss_fn`` on the last stage: the stage's forward program on the values
        it ``received`` and this micro-batch's targets (``target``: torch's chunk of what
        :func:`_schedule_target` made of the step's targets), returning the loss."""
        if len(self.program.targets) == 1:
            targets: tuple[torch.Tensor, ...] = (target,)
        else:  # the chunk holds the positions of this micro-batch's rows (contiguous: tensor_split)
            lo, hi = int(target[0]), int(target[-1]) + 1
            targets = tuple(t[lo:hi] for t in self.step_targets)
        (loss,) = _StageFunction.apply(self, self.anchor, *received, *targets)
        return loss

    def _args(self) -> list[Any]:
        """The programs' parameter and buffer arguments as DTensors (parameters in the dtypes the
        programs read: :attr:`compute_dtypes`)."""
        if not self.mixed_precision:
            return [p.detach() for p in self.params] + list(self._buffers_list)
        shards = self._compute_shards()
        params = [
            runtime.segment_layout(
                DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
            )
            for t, p in zip(shards, self.params, strict=True)
        ]
        return params + list(self._buffers_list)

    def _compute_shards(self) -> list[torch.Tensor]:
        """Mixed precision: the parameters' local shards in the programs' dtypes, cast once per step."""
        if self._compute is None:
            with torch.no_grad():
                self._compute = precision.compute_shards(list(self.params), self.compute_dtypes)
        return self._compute

    def release_compute_copies(self) -> None:
        """Drop this step's cast parameter copies (the next step casts the updated parameters)."""
        self._compute = None

    def _local_args(self) -> list[Any]:
        """:meth:`_args` as local tensors for the lowered programs. The parameters' detached local
        shards are kept between calls (the optimizer and checkpoint loading update them in place;
        a parameter whose local tensor was replaced is detached again): a DTensor ``detach`` per
        parameter and call cost ~2 ms a step on CPU ranks. Mixed precision: this step's cast copies."""
        buffers = [b.to_local() for b in self._buffers_list]
        if self.mixed_precision:
            return self._compute_shards() + buffers
        current = [p._local_tensor for p in self.params]
        if self._local_params is None or any(a is not b for a, b in zip(current, self._local_params[0], strict=True)):
            self._local_params = (current, [t.detach() for t in current])
        return self._local_params[1] + buffers

    def run_forward(self, inputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[Any]]:
        """The stage's forward program on local tensors: ``inputs`` as received, then the last
        stage's targets (stage 0's inputs and the targets: the micro-batch as given, of which
        this rank keeps its shard unless :attr:`batch_is_local`) -> (outputs, saved values), all
        local: DTensors are built only to lower the program at its first call."""
        prog = self.program
        values = (*prog.inputs, *prog.targets)
        global_batch = [
            not self.batch_is_local and v.spec is not None and (prog.index == 0 or i >= len(prog.inputs))
            for i, v in enumerate(values)
        ]  # the fields of the global batch this rank cuts its shard of
        args = [
            local_shard(x, self.mesh, list(v.spec)) if cut else x
            for x, v, cut in zip(inputs, values, global_batch, strict=True)
        ]

        def as_dtensors() -> list[Any]:
            return [
                runtime.segment_layout(distribute_tensor(x, self.mesh, list(v.spec), src_data_rank=None))
                if cut
                else _wrap(x, v, self.mesh)
                for x, v, cut in zip(inputs, values, global_batch, strict=True)
            ]

        res = self._run("forward", prog.forward, args, as_dtensors)
        n_out = len(prog.outputs)
        return [_unwrap(o) for o in res[:n_out]], list(res[n_out:])

    def run_backward(self, saved: list[Any], grad_outputs: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        prog = self.program
        grads = [
            g if g is not None else torch.zeros(_local_shape(v, self.mesh), dtype=v.dtype)
            for g, v in zip(grad_outputs, prog.output_grads, strict=True)
            if v is not None
        ]
        n_in = sum(1 for v in prog.input_grads if v is not None)
        if self._in_flight:  # sharded accumulation: the previous backward's last buckets, added to the shards
            self.finish_conversions()
        self.backwards_run += 1
        if self.last_microbatch is not None and self.backwards_run == self.num_microbatches:
            return self._run_last_backward(saved, grads, n_in)
        if self.split is None:
            converting = [f for f, _ in prog.param_grads] if self.last_microbatch is None else None
            res = self._run(
                "backward", prog.backward, [*saved, *grads], lambda: self._as_dtensors(saved, grads),
                grads_from=n_in, grad_names=converting, consumed=(saved, grads),
            )  # fmt: skip
            param_grads = res[n_in:]
        else:  # B now; W later, when the schedule calls the runner dw_builder hands it
            with torch.no_grad(), implicit_replication():
                res = self.split[0](*self._args(), *self._as_dtensors(saved, grads))
                carry = res[n_in:]
                self.pending_w.append(lambda: self._weight_grads(carry))
                param_grads = []
        it = iter(res[:n_in])
        in_grads = [_unwrap(next(it)) if v is not None else None for v in prog.input_grads]
        if self.split is None:
            self._accumulate(param_grads)
        return in_grads

    def _run_last_backward(self, saved: list[Any], grads: list[torch.Tensor], n_in: int) -> list[torch.Tensor | None]:
        """The step's last micro-batch: :attr:`last_microbatch`'s backward on the earlier
        micro-batches' summed raw gradients (taken out of ``grad_acc``, freed when it returns),
        which leaves each parameter's converted gradient in ``grad_acc`` (a parameter tied across
        stages: its raw gradient, added to the earlier ones')."""
        assert self.last_microbatch is not None
        fqns = self.last_microbatch.accumulated_grads
        accs = [self.grad_acc.pop(fqn) for fqn in fqns]
        self._owned.clear()
        raw = dict(self.program.param_grads)

        def as_dtensors() -> list[Any]:
            wrapped = [_wrap(a, raw[fqn], self.mesh) for fqn, a in zip(fqns, accs, strict=True)]
            return [*self._as_dtensors(saved, grads), *wrapped]

        names = [f for f, _ in self.last_microbatch.param_grads]
        res = self._run(
            "last_backward", self.last_microbatch.backward, [*saved, *grads, *accs], as_dtensors,
            grads_from=n_in, grad_names=names, consumed=(saved, grads, accs),
        )  # fmt: skip
        for fqn, g in zip(names, res[n_in:], strict=True):
            if g is None:  # its bucket is in flight: finish_conversions() waits for it
                continue
            if fqn in self.converted_in_program:
                self.grad_acc[fqn] = _unwrap(g)
            else:  # raw (a parameter tied across stages): added to the earlier micro-batches'
                self._add_raw(fqn, g)
        it = iter(res[:n_in])
        return [_unwrap(next(it)) if v is not None else None for v in self.program.input_grads]

    def start_step(self) -> None:
        """Forget the previous step's gradients, backward count and collectives in flight."""
        self.grad_acc.clear()
        self._owned.clear()
        self.backwards_run = 0
        self._in_flight.clear()

    def finish_conversions(self) -> None:
        """Wait for the gradient buckets the converting backward left in flight
        (:func:`~autoplan.runtime.lowering.defer_output_waits`) and add their gradients to
        ``grad_acc`` (where the earlier micro-batches' shards are, under sharded accumulation):
        before the optimizer step, after the schedule, and before a stage's next converting backward."""
        for waits, pending, names in self._in_flight:
            for slot, g in waits.run_finish(pending).items():
                self._add_raw(names[slot], g)
        self._in_flight.clear()

    def _as_dtensors(self, saved: Sequence[Any], grads: Sequence[torch.Tensor]) -> list[Any]:
        """The backward program's local arguments as the DTensors its DTensor form takes: saved
        values in the layouts the lowered forward gave them, output gradients in the plan's."""
        n_out = len(self.program.outputs)
        layouts = self.lowered["forward"].output_layouts[n_out:]
        out = [lay.wrap(x) if lay is not None else x for x, lay in zip(saved, layouts, strict=True)]
        specs = [v for v in self.program.output_grads if v is not None]
        return out + [_wrap(g, v, self.mesh) for g, v in zip(grads, specs, strict=True)]

    def _run(
        self,
        which: str,
        program: torch.fx.GraphModule,
        rest: list[Any],
        as_dtensors: Callable[[], list[Any]],
        *,
        grads_from: int = 0,
        grad_names: Sequence[str] | None = None,
        consumed: Sequence[list[Any]] = (),
    ) -> list[Any]:
        """Run a stage program lowered to local tensors on the parameters, the buffers and
        ``rest`` (local tensors); outputs stay local. At its first call the program is lowered
        from its DTensor arguments (``as_dtensors()``: ``rest`` as DTensors). A program that
        converts gradients (``grad_names``: the FQNs of its outputs from ``grads_from`` on) returns
        with its last buckets in flight, their outputs ``None``
        (:func:`~autoplan.runtime.lowering.defer_output_waits`; :meth:`finish_conversions`).
        ``rest`` and the caller's lists in ``consumed`` (the saved values, output gradients and
        accumulators it was built from) are emptied before the program runs, which then frees
        each argument after its last use (:meth:`~autoplan.runtime.lowering.LocalProgram.run_boxed`):
        a backward releases the activations of the blocks it is done with as eager autograd does."""
        local = self.lowered.get(which)
        if local is None:
            local = self.lowered[which] = lower_to_local(program, [*self._args(), *as_dtensors()])
            if grad_names is not None and self.converted_in_program:
                slots = [grads_from + i for i, f in enumerate(grad_names) if f in self.converted_in_program]
                self._waits[which] = defer_output_waits(local.graph_module, slots)
        with torch.no_grad():
            args = [*self._local_args(), *rest]
        rest.clear()
        for held in consumed:  # the caller's lists of the arguments: the program frees each after its last use
            held.clear()
        waits = self._waits.get(which)
        with self.random.drawing() if self.random is not None else contextlib.nullcontext():
            if waits is None:
                return local.run_boxed(args)
            outs, pending = waits.run_issue_boxed(args)
        assert grad_names is not None
        self._in_flight.append((waits, pending, {grads_from + i: f for i, f in enumerate(grad_names)}))
        return outs

    def _weight_grads(self, carry: Sequence[Any]) -> None:
        assert self.split is not None
        with torch.no_grad(), implicit_replication():
            self._accumulate(self.split[1](*carry))

    def _accumulate(self, param_grads: Sequence[Any]) -> None:
        """Add a micro-batch's raw gradients (``program.param_grads`` order) to ``grad_acc``
        (``None``: a converted gradient still in flight, :meth:`finish_conversions`)."""
        for (fqn, _), g in zip(self.program.param_grads, param_grads, strict=True):
            if g is not None:
                self._add_raw(fqn, g)

    def _add_raw(self, fqn: str, g: Any) -> None:
        local = _unwrap(g)
        acc = self.grad_acc.get(fqn)
        if acc is None:
            self.grad_acc[fqn] = local
        elif fqn in self._owned:
            acc.add_(local)
        else:
            self.grad_acc[fqn] = acc + local
            self._owned.add(fqn)


class PipelineModel(torch.nn.Module):
    """A model run as a pipeline of stages (this rank's stages only). :meth:`step` runs one
    training step (all micro-batches) and leaves each parameter's gradient in ``.grad``."""

    def __init__(
        self,
        *,
        stages: Sequence[StageModule],
        schedule: Any,
        mesh: DeviceMesh,
        stage_mesh: DeviceMesh,
        num_microbatches: int,
        tied_groups: Mapping[str, tuple[tuple[int, ...], dist.ProcessGroup | None]],
        optimizer: str,
        num_stages: int,
        batch_values: Sequence[ValueInfo],
        num_inputs: int,
        device: torch.device,
        tied_stages: Mapping[str, tuple[int, ...]] | None = None,
        offload_optimizer: bool = False,
        plan: Plan | None = None,
        param_layouts: Mapping[str, kv_rows.KVGroupRows] | None = None,
        batch_norm_training: bool | None = None,
    ) -> None:
        super().__init__()
        self.plan = plan
        """The plan this pipeline applies (``autoplan.parallelize``; ``None`` when built from its parts)."""
        self.param_layouts = dict(param_layouts or {})
        """FQN -> the layout the stages keep a parameter in where it is not the model's (every
        rank knows all of them; :attr:`ParallelModel.param_layouts <autoplan.runtime.parallel.ParallelModel.param_layouts>`)."""
        self.batch_values = tuple(batch_values)
        """Stage 0's inputs then the last stage's targets: one micro-batch's model inputs and loss
        targets, with their placements on the stage mesh (every rank knows them; first-stage ranks
        read the inputs, last-stage ranks the targets)."""
        self.num_inputs = num_inputs
        self.device = device
        self.stage_modules = torch.nn.ModuleList(stages)
        self._stages: list[StageModule] = list(stages)
        self.schedule = schedule
        self.mesh = mesh
        self.stage_mesh = stage_mesh
        self.num_microbatches = num_microbatches
        self._tied_groups = tied_groups
        self._optimizer = optimizer
        self.offload_optimizer = offload_optimizer
        """:meth:`make_optimizer` keeps the optimizer state in host memory (``OffloadedOptimizer``)."""
        self.num_stages = num_stages
        self._tied_stages = dict(tied_stages or {})
        """FQN -> the stages holding a copy of a parameter tied across stages (all ranks' view)."""
        self._anchor = torch.ones((), requires_grad=True)
        """Makes the loss :meth:`forward` returns require grad (autoplan.runtime.training)."""
        self._batch_norm_training = batch_norm_training
        """The mode the batch norms were planned in, as ``ParallelModel``'s (``None``: no batch norm)."""
        if batch_norm_training is not None:
            self.train(batch_norm_training)

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:  # noqa: ARG002
        for st in self._stages:
            yield from st.params

    def make_optimizer(self, **kwargs: Any) -> torch.optim.Optimizer:
        """The optimizer the plan was costed for over this rank's trained parameters, in host
        memory if the plan's configuration offloads it (``offload_optimizer``)."""
        params = [p for p in self.parameters() if p.requires_grad]  # frozen ones have no gradient
        return make_optimizer(self._optimizer, params, offload=self.offload_optimizer, **kwargs)

    def step(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """One training step on the *global* batch (the same on every rank); returns the loss
        (mean over micro-batches, on every rank); :class:`PlanMismatchError` for a batch of other
        shapes or dtypes than planned (the stages' programs are traced for them)."""
        self._check_batch(tuple(inputs), tuple(targets))
        return self._run_schedule(tuple(inputs), tuple(targets))

    def _check_batch(self, inputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...]) -> None:
        """The global batch's fields as planned: one micro-batch's :attr:`batch_values` with
        :attr:`num_microbatches` times its rows (the schedule cuts dimension 0), floating fields of
        any floating dtype (:func:`~autoplan.runtime.precision.cast_batch` casts them), the others of
        the planned dtype; else :class:`PlanMismatchError` naming both and the fix. Nothing is cast
        or copied here: the schedule casts once."""
        num_targets = len(self.batch_values) - self.num_inputs
        if (len(inputs), len(targets)) != (self.num_inputs, num_targets):
            raise PlanError(
                f"expected {self.num_inputs} inputs and {num_targets} targets as planned, "
                f"got {len(inputs)} and {len(targets)}"
            )
        fields = (*inputs, *targets)
        planned = [
            (
                (v.shape[0] * self.num_microbatches, *v.shape[1:]) if v.shape else v.shape,
                t.dtype if t.is_floating_point() and v.dtype.is_floating_point else v.dtype,  # cast_batch casts it
            )
            for v, t in zip(self.batch_values, fields, strict=True)
        ]
        problem = batch_mismatch(planned, fields, num_inputs=self.num_inputs)
        if problem is not None:
            raise PlanMismatchError(
                f"{problem} (the global batch of {self.num_microbatches} micro-batches it was planned with): the "
                "stages' programs run only on that batch shape and dtype; pad (or convert) the batch to it, or plan "
                "for this one (autoplan.parallelize with example_inputs= and global_batch_size= of this batch)"
            )

    def step_local(self, batch: LocalBatch) -> torch.Tensor:
        """One training step on this rank's :class:`~autoplan.runtime.data.LocalBatch` (from
        :meth:`data_loader`: on first-stage ranks its shard of every micro-batch's inputs, on
        last-stage ranks of its targets, elsewhere nothing); returns the loss (every rank)."""
        layout = self.batch_layout(batch.global_batch_size)
        read = (len(batch.inputs), len(batch.targets))
        expected = (layout.num_inputs if layout.reads_inputs else 0, layout.num_targets if layout.reads_targets else 0)
        if read != expected:
            raise PlanError(
                f"the batch holds {read[0]} inputs and {read[1]} targets; this rank's stages read {expected[0]} and "
                f"{expected[1]}: load it with this model's data_loader"
            )
        ends = [st for st in self._stages if st.program.index == 0 or st.is_last]
        for st in ends:
            st.batch_is_local = True
        try:
            return self._run_schedule(batch.inputs, batch.targets)
        finally:
            for st in ends:
                st.batch_is_local = False

    def _run_schedule(self, inputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Run the schedule, stage 0 on ``inputs`` and the last stage's loss on ``targets`` (the
        whole batch, or this rank's rows of it; each only where that stage runs; floating fields
        cast to the dtypes the program reads), convert the gradients, and broadcast the loss (the
        micro-batch mean, fp32) from the last stage."""
        training.check_batch_norm_mode(self._batch_norm_training, self.training)
        streams = [st.random for st in self._stages if st.random is not None]
        seed = step_seed(self.device) if streams else 0  # several stages: every rank draws it
        for st in self._stages:
            st.start_step()
        for stream in streams:
            stream.start_step(seed)
        losses: list[torch.Tensor] = []
        dtypes = [v.dtype for v in self.batch_values]
        inputs = precision.cast_batch(inputs, dtypes[: len(inputs)])
        targets = precision.cast_batch(targets, dtypes[len(dtypes) - len(targets) :] if targets else [])
        first = any(st.program.index == 0 for st in self._stages)
        last = next((st for st in self._stages if st.is_last), None)
        target = None
        if last is not None:
            last.step_targets = targets
            target = _schedule_target(targets, len(last.program.targets), self.num_microbatches)
        try:
            self.schedule.step(*(inputs if first else ()), target=target, losses=losses, return_outputs=False)
        finally:  # mixed precision: the cast parameter copies are dropped before the gradients are converted
            if last is not None:
                last.step_targets = ()
            for st in self._stages:
                st.release_compute_copies()
        self._finish_grads()
        pp_group = self.mesh.get_group("pp")
        holds_last = any(st.is_last for st in self._stages)
        loss = torch.stack([x.detach().float() for x in losses]).mean() if holds_last else torch.zeros(())
        last_rank = dist.get_global_rank(pp_group, (self.num_stages - 1) % self.mesh.size(0))
        dist.broadcast(loss, src=last_rank, group=pp_group)
        return loss

    def batch_layout(self, global_batch_size: int | None = None) -> BatchLayout:
        """What this rank reads of each global batch (:mod:`autoplan.runtime.data`): its shard of
        every micro-batch's inputs on first-stage ranks, of its targets on last-stage ranks;
        nothing on the others."""
        values = self.batch_values
        planned = values[0].shape[0] * self.num_microbatches if values and values[0].shape else 0
        coordinate = cast(list[int], self.mesh.get_coordinate())
        return BatchLayout(
            global_batch_size=check_global_batch_size(planned, global_batch_size),
            num_microbatches=self.num_microbatches,
            mesh_shape=tuple(self.stage_mesh.shape),
            coordinate=tuple(coordinate[1:]),
            specs=tuple(v.spec for v in values),
            num_inputs=self.num_inputs,
            sample_shapes=tuple(tuple(v.shape[1:]) for v in values),
            reads_inputs=coordinate[0] == 0,
            reads_targets=coordinate[0] == (self.num_stages - 1) % self.mesh.size(0),
        )

    def data_loader(
        self,
        dataset: Any,
        *,
        global_batch_size: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        collate_fn: Any = None,
    ) -> ShardedLoader:
        """As ``ParallelModel.data_loader``: this rank's :class:`~autoplan.runtime.data.LocalBatch`
        of each step (the inputs on first-stage ranks, the targets on last-stage ranks, nothing on
        the others); ``forward_backward(batch)``."""
        layout = self.batch_layout(global_batch_size)
        return ShardedLoader(dataset, layout, shuffle=shuffle, seed=seed, collate_fn=collate_fn, device=self.device)

    def _finish_grads(self) -> None:
        """Each stage's raw gradients (summed over micro-batches) -> the parameters' placements, in
        backward order and in the step model's buckets (one flat all-reduce or reduce-scatter per
        bucket and mesh axis: :func:`~autoplan.runtime.collectives.all_reduce_flat`,
        :func:`~autoplan.runtime.collectives.reduce_scatter_flat`, on local tensors), cast to the
        parameter's dtype (mixed precision: :func:`~autoplan.runtime.precision.grad_in_param_dtype`),
        divided by the number of micro-batches, summed over the stages holding a tied copy; then ``.grad``."""
        with torch.no_grad():
            tied_local: dict[str, torch.Tensor] = {}
            for st in self._stages:
                converted = self._converted_grads(st)
                for fqn, p in zip(st.program.param_names, st.params, strict=True):
                    if not p.requires_grad:  # frozen: no gradient, as on one device
                        p.grad = None
                        continue
                    local = converted.get(fqn)
                    if local is None:
                        local = torch.zeros_like(p.to_local())
                    else:
                        local = precision.grad_in_param_dtype(local, p.dtype, self.num_microbatches)
                    if fqn in self._tied_groups:
                        tied_local[fqn] = tied_local[fqn] + local if fqn in tied_local else local
                    p.grad = DTensor(local, p._spec, requires_grad=False)  # as FSDP2 sets its gradients
            for fqn in sorted(self._tied_groups):
                _, tied_group = self._tied_groups[fqn]
                total = tied_local[fqn].contiguous()
                if tied_group is not None:
                    dist.all_reduce(total, group=tied_group)
                for st in self._stages:
                    for name, p in zip(st.program.param_names, st.params, strict=True):
                        if name == fqn:
                            p.grad = DTensor(total.clone(), p._spec, requires_grad=False)

    def _converted_grads(self, st: StageModule) -> dict[str, torch.Tensor]:
        """FQN -> the stage's local gradient in the parameter's placement (summed over the step's
        micro-batches, not yet divided)."""
        st.finish_conversions()
        mesh = self.stage_mesh
        converted: dict[str, torch.Tensor] = {}
        groups: dict[tuple[str, ...], list[tuple[str, int | None, int]]] = {}  # (FQN, shard dim, bytes)
        specs: dict[tuple[str, ...], Any] = {}
        # backward order (the last parameters' gradients exist first), as the step model buckets
        for fqn, v in reversed(st.program.param_grads):
            local = st.grad_acc.get(fqn)
            dst = st.param_specs[fqn]
            assert local is not None, fqn
            if fqn in st.converted_in_program:  # the backward program reduced it already, bucket by bucket
                converted[fqn] = st.grad_acc.pop(fqn)  # out of grad_acc: its bucket is freed with the step's copies
                continue
            assert v.spec is not None, fqn
            steps = plan_transition(v.spec, dst) if v.spec != dst else ()
            kind = bucket_kind(steps)
            if kind == "all_reduce":
                key: tuple[str, ...] = ("all_reduce", spec_str(v.spec), spec_str(dst))
                dim = None
            elif kind == "reduce_scatter" and isinstance(steps[0].dst, Shard):
                key, dim = ("reduce_scatter", str(steps[0].axis), spec_str(v.spec)), steps[0].dst.dim
            else:
                converted[fqn] = _run_steps(_wrap(local, v, mesh), steps).to_local()  # type: ignore[attr-defined]
                continue
            key += (str(local.dtype),)  # one flat buffer per bucket: its members share a dtype
            groups.setdefault(key, []).append((fqn, dim, local.numel() * local.element_size()))
            specs[key] = v.spec
        # a bucket is issued before the previous one is waited for (its copy-in overlaps that
        # collective), at most two in flight as FSDP2 keeps its reduce-scatters; a raw gradient
        # leaves grad_acc as its bucket takes it, so it is freed once copied in (several Partial
        # axes: one after the other)
        pending: list[tuple[list[str], runtime.Finish]] = []
        for key, members in groups.items():
            spec = specs[key]
            for bucket in gradient_buckets([nbytes for _, _, nbytes in members], DEFAULT_POLICY):
                names = [members[i][0] for i in bucket]
                dims = tuple(d for i in bucket if (d := members[i][1]) is not None)
                out = [st.grad_acc.pop(name) for name in names]
                axes = (
                    [int(key[1])]
                    if key[0] == "reduce_scatter"
                    else [i for i, p in enumerate(spec) if isinstance(p, Partial)]
                )
                finish: runtime.Finish | None = None
                for axis in axes:
                    placement = spec[axis]
                    assert isinstance(placement, Partial) and placement.reduce_op in ("sum", "avg"), spec
                    average = placement.reduce_op == "avg"
                    out = finish() if finish is not None else out
                    group = mesh.get_group(axis)
                    if key[0] == "reduce_scatter":
                        finish = runtime.start_reduce_scatter_flat(
                            out, dims, group, mesh.get_local_rank(axis), average=average
                        )
                    else:
                        finish = runtime.start_all_reduce_flat(out, group, average=average)
                del out
                assert finish is not None, spec
                if len(pending) == 2:
                    done_names, done = pending.pop(0)
                    converted.update(zip(done_names, done(), strict=True))
                pending.append((names, finish))
        for names, finish_bucket in pending:
            converted.update(zip(names, finish_bucket(), strict=True))
        return converted

    def forward_backward(
        self, *inputs: torch.Tensor | LocalBatch, targets: Sequence[torch.Tensor] = ()
    ) -> torch.Tensor:
        """Same contract as ``ParallelModel.forward_backward``: one step on the global batch or
        on a :class:`~autoplan.runtime.data.LocalBatch` (``forward_backward(batch)``), gradients
        left in ``.grad``, the loss returned (every rank)."""
        if len(inputs) == 1 and isinstance(inputs[0], LocalBatch):
            if targets:
                raise PlanError("a LocalBatch holds its targets: call forward_backward(batch) without targets=")
            return self.step_local(inputs[0])
        return self.step(cast(tuple[torch.Tensor, ...], inputs), targets)

    def forward(self, *inputs: torch.Tensor | LocalBatch, targets: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """``loss = pmodel(*inputs, targets=...)`` (or ``pmodel(batch)`` with a
        :class:`~autoplan.runtime.data.LocalBatch`) in a standard loop: runs the step (every
        micro-batch) and returns the loss, whose ``backward()`` puts the gradients in ``.grad``
        (:mod:`autoplan.runtime.training`). Under ``torch.compile(pmodel)`` the step runs
        eagerly (:data:`~autoplan.runtime.training.COMPILED_CALL_NOTE`)."""
        if torch.compiler.is_compiling():
            training.note_compiled_call()
        return self._forward_eagerly(*inputs, targets=targets)

    @torch.compiler.disable
    def _forward_eagerly(self, *inputs: torch.Tensor | LocalBatch, targets: Sequence[torch.Tensor]) -> torch.Tensor:
        trainable = [p for p in self.parameters() if p.requires_grad]
        before = [p.grad for p in trainable]
        loss = self.forward_backward(*inputs, targets=targets)
        return training.loss_installing_grads(self._anchor, loss, trainable, before)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients by their global norm over every stage's shards (a parameter tied
        across stages counted once), as ``torch.nn.utils.clip_grad_norm_`` does on one device;
        returns the norm (collective: every rank)."""
        owned = [p for p in self.owned_parameters().values() if p.requires_grad]
        every = [p for _, _, p in self.parameter_copies() if p.requires_grad]
        return training.clip_grad_norm_(owned, every, max_norm, norm_type=norm_type)

    def parameter_copies(self) -> Iterator[tuple[str, int, torch.nn.Parameter]]:
        """``(fqn, stage, parameter)`` of every parameter copy this rank holds (a rank may hold
        several copies of a parameter tied across stages, one per stage)."""
        for st in self._stages:
            for fqn, p in zip(st.program.param_names, st.params, strict=True):
                yield fqn, st.program.index, p

    def owned_parameters(self) -> dict[str, torch.nn.Parameter]:
        """FQN -> the copy this rank speaks for (state dict, checkpoint, gradient norm): a
        parameter tied across stages only from the lowest stage holding it (its copies may be
        sharded differently); every rank knows those stages, no collective."""
        return {
            fqn: p for fqn, stage, p in self.parameter_copies() if stage == min(self._tied_stages.get(fqn, (stage,)))
        }

    def owned_buffers(self) -> dict[str, DTensor]:
        """FQN -> each persistent buffer this rank's stages read (replicated DTensors on the stage
        mesh), from the lowest stage holding it, as :meth:`owned_parameters`."""
        owned: dict[str, DTensor] = {}
        for st in sorted(self._stages, key=lambda st: st.program.index):
            for fqn, b in st.persistent_buffers.items():
                owned.setdefault(fqn, b)
        return owned

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]  # noqa: ARG002
        """This rank's parameters by the model's own names, as sharded DTensors (DCP saves and
        loads them in place), a parameter tied across stages from the lowest stage holding it, and
        its stages' persistent buffers (:meth:`owned_buffers`)."""
        return training.sharded_state_dict(self.owned_parameters()) | self.owned_buffers()

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:  # noqa: ARG002
        """Load full tensors or DTensors by the model's parameter and buffer names into every copy
        this rank holds; keys of parameters and buffers held only by other pipeline ranks are accepted."""
        missing: set[str] = set()
        for st in self._stages:
            named = dict(zip(st.program.param_names, st.params, strict=True))
            miss, _ = training.load_sharded_state_dict(
                named, state_dict, strict=strict, elsewhere=frozenset(state_dict), layouts=st.param_layouts,
                buffers=st.persistent_buffers,
            )  # fmt: skip
            missing.update(miss)
        return _IncompatibleKeys(sorted(missing), [])

    @property
    def code(self) -> str:
        """This rank's stage programs as readable Python."""
        parts = []
        for st in self._stages:
            parts.append(f"# --- stage {st.program.index}: forward ---\n{st.program.forward.code}")
            parts.append(f"# --- stage {st.program.index}: backward ---\n{st.program.backward.code}")
            if st.last_microbatch is not None:
                last = st.last_microbatch.backward.code
                parts.append(f"# --- stage {st.program.index}: the last micro-batch's backward ---\n{last}")
        return "\n".join(parts)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered to a full tensor by FQN (collective: call on all ranks)."""
        mine: dict[str, torch.Tensor] = {}
        for st in self._stages:
            for fqn, p in zip(st.program.param_names, st.params, strict=True):
                value = p.detach()
                assert isinstance(value, DTensor)
                full = kv_rows.to_model(st.param_layouts, fqn, value.full_tensor())
                mine.setdefault(fqn, full)
        gathered: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        out: dict[str, torch.Tensor] = {}
        for d in gathered:
            assert d is not None
            for k, t in d.items():
                out.setdefault(k, t)
        return out


def _run_steps(g: torch.Tensor, steps: Sequence[Any]) -> torch.Tensor:
    for st in steps:
        kwargs: dict[str, Any] = {"axis": st.axis}
        if st.kind in ("reduce_scatter", "all_to_all", "shard"):
            kwargs["dim"] = st.dst.dim
        g = STEP_FN[st.kind](g, **kwargs)
    return g


def _dw_builder(mod: StageModule) -> Callable[[], Callable[[], None]]:
    """``PipelineStage(dw_builder=...)``: called right after each B, it hands the schedule that
    backward's W work to run when the zero-bubble order says so."""
    return mod.pending_w.pop


def _reduces_in_backward(*, num_stages: int, num_microbatches: int, schedule: str) -> bool:
    """Whether the backward program converts the parameter gradients itself
    (:func:`~autoplan.cost_models.comm_schedule.gradients_reduced_in_backward`): DDP's
    all-reduce buckets or FSDP2's reduce-scatter buckets issued as their gradients exist,
    overlapping the rest of the backward, as the step model prices; at most
    ``reduce_scatters_in_flight`` reduce-scatters unwaited
    (:func:`~autoplan.runtime.lowering.bound_reduce_scatters`), so the unsharded gradients never
    all live at once (several micro-batches: the last one's backward, on its gradients plus the
    earlier ones' sum; several stages: each its own). Otherwise (zero-bubble) they are converted
    once per step after the schedule, on the gradients summed over micro-batches."""
    return gradients_reduced_in_backward(num_stages=num_stages, num_microbatches=num_microbatches, schedule=schedule)


def build_pipeline(
    model: torch.nn.Module,
    traced_mb: TracedProgram,
    assignment: Mapping[str, Strategy],
    layering: Layering,
    *,
    stage_starts: Sequence[int],
    mesh: DeviceMesh,
    axis_names: tuple[str, ...],
    schedule: ScheduleName,
    num_microbatches: int,
    virtual_stages: int = 1,
    fallback_nodes: frozenset[str] = frozenset(),
    device: torch.device,
    optimizer: str = "adam",
    stage_recompute: Sequence[str] | None = None,
    offload_optimizer: bool = False,
    sharded_grad_accumulation: bool = False,
    plan: Plan | None = None,
) -> PipelineModel:
    """Build this rank's stages and the schedule. ``mesh`` has shape ``(pp, *stage_mesh)`` and
    names ``("pp", *axis_names)``; ``stage_starts[k]`` is the first segment of stage ``k``
    (``len(stage_starts) == pp * virtual_stages``; stage ``k`` runs on pipeline rank ``k % pp``);
    ``plan`` is kept as :attr:`PipelineModel.plan`; ``sharded_grad_accumulation``: every
    micro-batch's backward converts its gradients (``ParallelConfig.sharded_grad_accumulation``).
    Where ``traced_mb`` reads a parameter in another dtype than ``model``'s (a bf16 step of an
    fp32 model) the stages run in mixed precision. (long: the build reads top to bottom, programs, stages, schedule, model; each part is a helper)"""
    pp = mesh.size(0)
    num_stages = len(stage_starts)
    _check_stage_count(num_stages, layering=layering, pp=pp, virtual_stages=virtual_stages)
    check_schedule(schedule, pp=pp, num_microbatches=num_microbatches, virtual_stages=virtual_stages, executable=True)
    recompute = _stage_recompute(stage_recompute, num_stages)
    stage_mesh = mesh[axis_names[0]] if len(axis_names) == 1 else mesh[axis_names]
    in_program = _reduces_in_backward(num_stages=num_stages, num_microbatches=num_microbatches, schedule=schedule)

    tied = _tied_across_stages(traced_mb, layering, stage_starts)  # converted after the schedule

    def split(*, defer: bool, accumulated: bool = False) -> StageSplit:
        return _split_program(
            traced_mb, assignment, layering, stage_starts=stage_starts, mesh=stage_mesh, axis_names=axis_names,
            fallback_nodes=fallback_nodes, device=device, defer=defer, accumulated=accumulated, deferred=tied,
        )  # fmt: skip

    # several micro-batches: the earlier ones keep their raw gradients, the last one's backward
    # adds their sum and converts each bucket as it exists; with sharded accumulation every
    # backward runs the converting program and the shards are summed (StageModule.finish_conversions)
    converting = converting_backwards(
        num_microbatches=num_microbatches, sharded_grad_accumulation=sharded_grad_accumulation
    )
    if sharded_grad_accumulation and not in_program:
        raise PlanError(f"sharded gradient accumulation needs gradients converted in the backward, not {schedule!r}")
    accumulates = in_program and num_microbatches > 1 and converting == 1
    programs = split(defer=accumulates or not in_program)
    last_mb = split(defer=False, accumulated=True).stages if accumulates else None
    if not set(programs.tied_params) <= tied | set(traced_mb.frozen_names):
        raise AssertionError(f"parameters shared by stages beyond the layering's: {sorted(programs.tied_params)}")
    pp_rank = mesh.get_local_rank("pp")
    pp_group = mesh.get_group("pp")
    mine = [s for s in range(num_stages) if s % pp == pp_rank]
    dtypes = precision.program_dtypes(traced_mb)  # mixed precision: what the programs read (autoplan.runtime.precision)
    mesh_shape = tuple(stage_mesh.shape)

    def recomputing(stage: StageProgram) -> StageProgram:
        last = stage.index == num_stages - 1
        return _recomputing(stage, recompute[stage.index], layering=layering, last=last, mesh_shape=mesh_shape)

    modules = [
        StageModule(
            recomputing(programs.stages[s]),
            model=model,
            assignment=assignment,
            mesh=stage_mesh,
            num_stages=num_stages,
            device=device,
            split_weight_grads=schedule == "zero-bubble",
            compute_dtypes=dtypes,
            last_microbatch=recomputing(last_mb[s]) if last_mb is not None else None,
            num_microbatches=num_microbatches,
            converts_grads=in_program,
            deferred_grads=tied,
            param_layouts=traced_mb.param_layouts,
        )  # fmt: skip
        for s in mine
    ]
    stages = [
        _pipeline_stage(
            mod,
            stage_mesh=stage_mesh,
            num_stages=num_stages,
            device=device,
            pp_group=pp_group,
            zero_bubble=schedule == "zero-bubble",
        )  # fmt: skip
        for mod in modules
    ]
    last = [mod for mod in modules if mod.is_last]
    sched = _make_schedule(schedule, stages, num_microbatches, loss_fn=last[0].loss if last else _no_loss)
    tied_groups = _tied_groups(programs.tied_params, traced_mb.trainable_names, mesh)
    return PipelineModel(
        stages=modules,
        schedule=sched,
        mesh=mesh,
        stage_mesh=stage_mesh,
        num_microbatches=num_microbatches,
        tied_groups=tied_groups,
        optimizer=optimizer,
        num_stages=num_stages,
        tied_stages=programs.tied_params,
        batch_values=(*programs.stages[0].inputs, *programs.stages[-1].targets),
        num_inputs=traced_mb.num_inputs,
        device=device,
        offload_optimizer=offload_optimizer,
        plan=plan,
        param_layouts=traced_mb.param_layouts,
        batch_norm_training=training.batch_norm_mode(model),
    )


def _split_program(
    traced_mb: TracedProgram,
    assignment: Mapping[str, Strategy],
    layering: Layering,
    *,
    stage_starts: Sequence[int],
    mesh: DeviceMesh,
    axis_names: tuple[str, ...],
    fallback_nodes: frozenset[str],
    device: torch.device,
    defer: bool,
    accumulated: bool,
    deferred: frozenset[str] = frozenset(),
) -> StageSplit:
    """The per-rank program (gradient conversions deferred, or in the backward, with the earlier
    micro-batches' summed gradients as arguments where ``accumulated``) cut into stage programs."""
    program = generate_program(
        traced_mb,
        assignment,
        fallback_nodes=fallback_nodes,
        axis_names=axis_names,
        device=device,
        mesh=mesh,
        defer_grad_conversions=defer,
        accumulated_grad_inputs=accumulated,
        layering=layering,
        # FSDP2's one-block-ahead gathers, windows and buckets within a stage (stage_starts), so
        # that each conversion lands in its consumer's stage program
        policy=DEFAULT_POLICY,
        stage_starts=stage_starts,
        deferred_grads=deferred,
    )
    return split_stages(
        program.graph_module, traced_mb, layering, assignment, stage_starts=stage_starts, mesh_ndim=len(axis_names)
    )


def _tied_across_stages(traced: TracedProgram, layering: Layering, stage_starts: Sequence[int]) -> frozenset[str]:
    """FQNs of the trained parameters that segments of several stages read (a tied embedding)."""
    stages = param_stages(layering, stage_of_segment(layering, stage_starts))
    return frozenset(fqn for fqn in traced.trainable_names if len(stages.get(param_node_name(fqn), ())) > 1)


def _check_stage_count(num_stages: int, *, layering: Layering, pp: int, virtual_stages: int) -> None:
    """Raises :class:`PlanError` unless there are ``pp * virtual_stages`` stages, at most one per segment."""
    if num_stages > layering.num_segments:
        raise PlanError(
            f"{num_stages} pipeline stages but the model has only {layering.num_segments} segments: "
            "lower pp or virtual_stages"
        )
    if num_stages != pp * virtual_stages:
        raise PlanError(
            f"{num_stages} stage starts for pp={pp} x virtual_stages={virtual_stages}: give {pp * virtual_stages}"
        )


def _recomputing(
    stage: StageProgram, recompute: str, *, layering: Layering, last: bool, mesh_shape: tuple[int, ...]
) -> StageProgram:
    """``stage`` as it runs under ``recompute`` (``none``: as split; a policy of
    :mod:`autoplan.passes.recompute`: :func:`~autoplan.passes.recompute.recompute_stage_program`)."""
    for policy in POLICIES:
        if recompute == policy:
            return recompute_stage_program(stage, layering.segment_of, last=last, mesh_shape=mesh_shape, policy=policy)
    return stage


def _stage_recompute(stage_recompute: Sequence[str] | None, num_stages: int) -> list[str]:
    """The plan's per-stage recomputation (``None``: none) -> one executable mode per stage, or
    :class:`PlanError`."""
    recompute = list(stage_recompute) if stage_recompute is not None else ["none"] * num_stages
    unsupported = sorted({r for r in recompute if r not in EXECUTABLE_RECOMPUTE})
    if len(recompute) != num_stages or unsupported:
        raise PlanError(
            f"stage recomputation {recompute} cannot run: give one of {', '.join(EXECUTABLE_RECOMPUTE)} per stage "
            f"({num_stages} stages)"
        )
    return recompute


def _pipeline_stage(
    mod: StageModule,
    *,
    stage_mesh: DeviceMesh,
    num_stages: int,
    device: torch.device,
    pp_group: dist.ProcessGroup,
    zero_bubble: bool,
) -> PipelineStage:
    """A stage module -> the ``PipelineStage`` that runs it, with example tensors of the local
    shapes its inputs, outputs and their gradients have on this rank (stage 0 receives the
    micro-batch unsharded; the last stage outputs its inputs, for the schedule's ``loss_fn``)."""
    prog = mod.program
    ins = tuple(
        torch.zeros(
            v.shape if prog.index == 0 else _local_shape(v, stage_mesh), dtype=v.dtype, device=device
        ).requires_grad_(v.requires_grad and prog.index > 0)
        for v in prog.inputs
    )
    outs = tuple(
        torch.zeros(_local_shape(v, stage_mesh), dtype=v.dtype, device=device).requires_grad_(
            v.requires_grad or mod.is_last
        )
        for v in prog.outputs
    )
    out_grads = tuple(
        None if g is None else torch.zeros(_local_shape(g, stage_mesh), dtype=g.dtype, device=device)
        for g in prog.output_grads
    )
    in_grads = tuple(
        None if g is None else torch.zeros(_local_shape(g, stage_mesh), dtype=g.dtype, device=device)
        for g in prog.input_grads
    )
    return PipelineStage(
        mod,
        prog.index,
        num_stages,
        device,
        input_args=ins,
        output_args=ins if mod.is_last else outs,
        output_grads=None if mod.is_last else out_grads,
        input_grads=in_grads,
        group=pp_group,
        dw_builder=_dw_builder(mod) if zero_bubble else None,
    )


def _schedule_target(targets: Sequence[torch.Tensor], num_targets: int, num_microbatches: int) -> torch.Tensor:
    """What the last stage hands ``schedule.step(target=...)``, which torch cuts into
    ``num_microbatches`` chunks along dim 0 (``tensor_split``: equal, in order) and passes to
    ``loss_fn`` one micro-batch at a time: the one target itself; with several targets (or
    none: one row per micro-batch) the positions ``0..n-1`` of their rows, whose chunk
    :meth:`StageModule.loss` reads each target's rows by."""
    if len(targets) != num_targets:
        raise PlanError(f"{len(targets)} loss targets given; the last stage reads {num_targets}: pass targets=(...)")
    if num_targets == 1:
        return targets[0]
    return torch.arange(int(targets[0].shape[0]) if targets else num_microbatches)


def _no_loss(output: Any, target: Any) -> torch.Tensor:  # noqa: ARG001
    """The schedule's ``loss_fn`` on a rank without the last stage (torch calls it on the last stage only)."""
    raise AssertionError("the pipeline schedule computed a loss on a rank without the last stage")


def _make_schedule(
    schedule: ScheduleName,
    stages: Sequence[PipelineStage],
    num_microbatches: int,
    *,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
) -> Any:
    """Schedule name, this rank's pipeline stages and the loss (:meth:`StageModule.loss` on the
    last-stage ranks) -> the ``torch.distributed.pipelining`` schedule."""
    kw: dict[str, Any] = {"loss_fn": loss_fn, "scale_grads": False}
    if schedule == "gpipe":
        return ScheduleGPipe(stages[0], num_microbatches, **kw)
    if schedule == "1f1b":
        return Schedule1F1B(stages[0], num_microbatches, **kw)
    if schedule == "zero-bubble":
        return ScheduleInterleavedZeroBubble(list[Any](stages), num_microbatches, **kw)
    return ScheduleInterleaved1F1B(list[Any](stages), num_microbatches, **kw)


def _tied_groups(
    tied_params: Mapping[str, tuple[int, ...]], trainable_names: Sequence[str], mesh: DeviceMesh
) -> dict[str, tuple[tuple[int, ...], dist.ProcessGroup | None]]:
    """Trainable tied parameters (FQN -> stages holding a copy) -> per FQN the pipeline ranks
    holding a copy and this rank's group summing their gradients: one group per stage-mesh
    coordinate over those pipeline ranks (``None``: a single rank holds every copy). A frozen
    tied parameter has no gradient to sum. Collective: every rank creates every group."""
    pp = mesh.size(0)
    tied_groups: dict[str, tuple[tuple[int, ...], dist.ProcessGroup | None]] = {}
    ranks_grid = mesh.mesh.reshape(pp, -1)
    for fqn in sorted(set(tied_params) & set(trainable_names)):
        pranks = tuple(sorted({s % pp for s in tied_params[fqn]}))
        group = None
        if len(pranks) > 1:
            for col in range(ranks_grid.shape[1]):
                ranks = [int(ranks_grid[r, col]) for r in pranks]
                g = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    group = g
        tied_groups[fqn] = (pranks, group)
    return tied_groups
