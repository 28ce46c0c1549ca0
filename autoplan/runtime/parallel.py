"""The applied plan: sharded parameters plus the generated per-rank training step."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.modules.module import _IncompatibleKeys

from autoplan.cost_models.errors import PlanError, PlanMismatchError
from autoplan.passes import kv_rows
from autoplan.passes.placement import parse_spec, spec_str
from autoplan.passes.trace import TracedProgram
from autoplan.planner.plan import Plan
from autoplan.runtime import training
from autoplan.runtime.codegen import GeneratedProgram, expected_output_placements
from autoplan.runtime.collectives import segment_layout
from autoplan.runtime.data import (
    BatchLayout,
    FieldSpec,
    LocalBatch,
    ShardedLoader,
    batch_mismatch,
    check_global_batch_size,
)
from autoplan.runtime.lowering import LocalProgram, local_shard, lower_to_local
from autoplan.runtime.optimizers import make_torch_optimizer


class PlacementMismatchError(AssertionError):
    """Checked execution found a value whose placement differs from the plan (an autoplan bug)."""


class _CheckedInterpreter(fx.Interpreter):
    """Runs the generated program and asserts every op output has its planned placement."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.expected = expected_output_placements(gm)

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        spec = self.expected.get(n.name)
        if spec is not None:
            first = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(first, DTensor) and tuple(first.placements) != tuple(spec):
                raise PlacementMismatchError(
                    f"{n.name} ({n.target}) produced {spec_str(first.placements)}, plan says {spec_str(spec)}"
                )
        return out


class ParallelModel(torch.nn.Module):
    """A model sharded by a plan. One call of :meth:`forward_backward` is one training step's
    forward and backward: it returns the loss and leaves each parameter's gradient (a DTensor in
    the parameter's placement) in ``.grad``; any ``torch.optim`` optimizer then steps locally.
    A frozen parameter (``requires_grad=False`` in the model) stays frozen: no ``.grad``, and
    :meth:`make_optimizer` leaves it out."""

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        traced: TracedProgram,
        plan: Plan,
        program: GeneratedProgram,
        mesh: DeviceMesh,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.plan = plan
        self.mesh = mesh
        self.device = device
        self.program = program.graph_module
        self.redistributions = program.redistributions
        self._traced = traced
        self.param_names = traced.param_names
        self.param_layouts = dict(traced.param_layouts)
        """FQN -> the layout the program keeps a parameter in where it is not the model's (a fused
        grouped-query QKV projection grouped by key/value head, :mod:`autoplan.passes.kv_groups`):
        its shards, gradient, optimizer state and :meth:`state_dict` entry are in that layout;
        :meth:`full_parameters` and :meth:`load_state_dict` of full tensors use the model's."""
        named = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        trainable = set(traced.trainable_names)
        self._params = torch.nn.ParameterList(
            training.sharded_parameter(
                n, named[n], self.param_layouts, mesh, parse_spec(plan.param_specs[n]), requires_grad=n in trainable
            )
            for n in self.param_names
        )
        self._trainable = [p for n, p in zip(self.param_names, self._params, strict=True) if n in trainable]
        """The parameters the program returns a gradient for, in its output order."""
        rep = [Replicate()] * mesh.ndim
        self._buffers_list = [
            distribute_tensor(buffers[n].detach(), mesh, rep, src_data_rank=None) for n in traced.buffer_names
        ]
        persistent = training.persistent_buffer_names(model)
        self._persistent_buffers = {
            n: b for n, b in zip(traced.buffer_names, self._buffers_list, strict=True) if n in persistent
        }
        """FQN -> the buffers ``model.state_dict()`` holds (not those registered ``persistent=False``), as
        the program reads them: in :meth:`state_dict`, :meth:`load_state_dict` and checkpoints."""
        self._aliases = training.state_dict_aliases(model)
        """A tied tensor's other names (a single-device state dict holds them too): alias -> FQN."""
        self._input_specs = [parse_spec(s) for s in plan.input_specs]
        self._target_specs = [parse_spec(s) for s in plan.target_specs]
        self.schedule = program.schedule
        self._local: LocalProgram | None = None
        """The program lowered to local tensors (autoplan.runtime.lowering), built at the first step."""
        self._anchor = torch.ones((), device=device, requires_grad=True)
        """Makes the loss :meth:`forward` returns require grad (autoplan.runtime.training)."""
        self._batch_norm_training = training.batch_norm_mode(model)
        """The mode the batch norms were planned in (``None``: no batch norm); the module starts in
        it, and :meth:`forward_backward` refuses the other (``training.check_batch_norm_mode``)."""
        if self._batch_norm_training is not None:
            self.train(self._batch_norm_training)

    # -- parameters -------------------------------------------------------------------------
    def named_sharded_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        yield from zip(self.param_names, self._params, strict=True)

    def parameter_copies(self) -> Iterator[tuple[str, int, torch.nn.Parameter]]:
        """``(fqn, stage, parameter)`` as ``PipelineModel.parameter_copies``: one stage, one copy each."""
        for fqn, p in self.named_sharded_parameters():
            yield fqn, 0, p

    def owned_parameters(self) -> dict[str, torch.nn.Parameter]:
        """FQN -> the parameter (one copy each), as ``PipelineModel.owned_parameters``."""
        return dict(self.named_sharded_parameters())

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:  # noqa: ARG002
        yield from self._params

    def sharded_buffers(self) -> Iterator[DTensor]:
        """The model's buffers as the program reads them (replicated DTensors)."""
        yield from self._buffers_list

    def owned_buffers(self) -> dict[str, DTensor]:
        """FQN -> each persistent buffer as the program reads it (replicated DTensors, loaded in
        place by :meth:`load_state_dict` and checkpoints)."""
        return dict(self._persistent_buffers)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered to a full tensor in the model's own layout (collective: call
        on all ranks)."""
        out = {}
        for n, p in self.named_sharded_parameters():
            value = p.detach()
            assert isinstance(value, DTensor)
            out[n] = kv_rows.to_model(self.param_layouts, n, value.full_tensor())
        return out

    @property
    def code(self) -> str:
        """The generated per-rank program as readable Python (over DTensors, with the plan's
        explicit collectives; :attr:`local_code` is what runs)."""
        return self.program.code

    @property
    def local_code(self) -> str:
        """The program that runs: local tensors, functional collectives and their waits."""
        return self.lowered().code

    def lowered(self) -> LocalProgram:
        """The program lowered to this rank's local tensors (traced once, on fake tensors)."""
        if self._local is None:
            self._local = lower_to_local(self.program, self._example_args())
        return self._local

    def _batch_values(self) -> list[torch.Tensor]:
        """The traced step's batch (inputs, then targets) as fake or meta values: shapes and dtypes."""
        placeholders = [n for n in self._traced.graph_module.graph.nodes if n.op == "placeholder"]
        batch = placeholders[len(placeholders) - len(self._input_specs) - len(self._target_specs) :]
        return [n.meta["val"] for n in batch]

    def _example_args(self) -> list[DTensor]:
        """Arguments shaped as the traced step's (the batch's values do not matter: the lowering
        traces on fake tensors)."""
        zeros = [torch.zeros(v.shape, dtype=v.dtype) for v in self._batch_values()]
        args = [p.detach() for p in self._params] + list(self._buffers_list)
        return args + self._distribute(zeros, [*self._input_specs, *self._target_specs])

    # -- data -------------------------------------------------------------------------------
    def batch_layout(self, global_batch_size: int | None = None) -> BatchLayout:
        """What this rank's program reads of each global batch (:mod:`autoplan.runtime.data`).
        Every field must be batched along dim 0 with the planned global batch."""
        values = self._batch_values()
        planned = int(values[0].shape[0]) if values and values[0].ndim else 0
        layout = BatchLayout(
            global_batch_size=check_global_batch_size(planned, global_batch_size),
            mesh_shape=tuple(self.mesh.shape),
            coordinate=tuple(cast(list[int], self.mesh.get_coordinate())),
            specs=(*self._input_specs, *self._target_specs),
            num_inputs=len(self._input_specs),
            sample_shapes=tuple(tuple(v.shape[1:]) for v in values),
        )
        for i, v in enumerate(values):
            if v.ndim == 0 or v.shape[0] != planned:
                raise PlanError(
                    f"{layout.field_name(i)} was traced with shape {list(v.shape)}, not batched along dim 0 like "
                    f"input 0 ({planned} samples): the sharded loader needs every field batched; feed global batches"
                )
        return layout

    def data_loader(
        self,
        dataset: Any,
        *,
        global_batch_size: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        collate_fn: Any = None,
    ) -> ShardedLoader:
        """A loader yielding this rank's :class:`~autoplan.runtime.data.LocalBatch` of each step
        of ``dataset`` (a ``Dataset`` or ``IterableDataset`` of ``(*inputs, *targets)`` samples):
        ``for batch in loader: loss = pmodel.forward_backward(batch)``."""
        layout = self.batch_layout(global_batch_size)
        return ShardedLoader(dataset, layout, shuffle=shuffle, seed=seed, collate_fn=collate_fn, device=self.device)

    def _local_fields(self, batch: LocalBatch) -> list[torch.Tensor]:
        """A loaded batch's tensors, checked against the local shapes this rank's program reads."""
        specs = [*self._input_specs, *self._target_specs]
        tensors = [*batch.inputs, *batch.targets]
        values = self._batch_values()
        if len(batch.inputs) != len(self._input_specs) or len(batch.targets) != len(self._target_specs):
            raise PlanError(
                f"the batch holds {len(batch.inputs)} inputs and {len(batch.targets)} targets; the plan reads "
                f"{len(self._input_specs)} and {len(self._target_specs)}: load it with this model's data_loader"
            )
        for i, (t, v, spec) in enumerate(zip(tensors, values, specs, strict=True)):
            expected, _ = compute_local_shape_and_global_offset(v.shape, self.mesh, list(spec))
            if tuple(t.shape) != tuple(expected):
                raise PlanError(
                    f"field {i} of the batch has local shape {list(t.shape)}; this rank reads {list(expected)} of a "
                    f"global {list(v.shape)}: load the batch with this model's data_loader (global batch "
                    f"{batch.global_batch_size})"
                )
        return [t.to(self.device) for t in tensors]

    def _from_local(self, tensors: Sequence[torch.Tensor]) -> list[DTensor]:
        """Local batch fields as the DTensors of the planned global batch (the checked path)."""
        specs = [*self._input_specs, *self._target_specs]
        return [
            segment_layout(
                DTensor.from_local(t, self.mesh, list(spec), run_check=False, shape=v.shape, stride=v.stride())
            )
            for t, v, spec in zip(tensors, self._batch_values(), specs, strict=True)
        ]

    def make_optimizer(self, **kwargs: Any) -> torch.optim.Optimizer:
        """The optimizer the plan was costed for, over the sharded trainable parameters."""
        name = self.plan.optimizer
        params = list(self._trainable)
        return make_torch_optimizer(name, params, **kwargs)

    # -- execution --------------------------------------------------------------------------
    def _distribute(self, tensors: Sequence[torch.Tensor], specs: Sequence[Any]) -> list[DTensor]:
        return [
            segment_layout(distribute_tensor(t.to(self.device), self.mesh, spec, src_data_rank=None))
            for t, spec in zip(tensors, specs, strict=True)
        ]

    def forward_backward(
        self, *inputs: torch.Tensor | LocalBatch, targets: Sequence[torch.Tensor] = (), check: bool = False
    ) -> torch.Tensor:
        """Run one step's forward and backward on the *global* batch (identical on every rank;
        each rank keeps its shard), or on a :class:`~autoplan.runtime.data.LocalBatch` from
        :meth:`data_loader` (already this rank's shard): ``forward_backward(batch)``. Returns the
        loss; gradients land in ``.grad``.

        ``check=True`` asserts every intermediate has its planned placement (slower)."""
        training.check_batch_norm_mode(self._batch_norm_training, self.training)
        specs = [*self._input_specs, *self._target_specs]
        local: list[torch.Tensor] | None = None
        if len(inputs) == 1 and isinstance(inputs[0], LocalBatch):
            if targets:
                raise PlanError("a LocalBatch holds its targets: call forward_backward(batch) without targets=")
            local = self._local_fields(inputs[0])
            self._check_batch(local, inputs[0])
        elif len(inputs) != len(self._input_specs) or len(targets) != len(self._target_specs):
            raise ValueError(
                f"expected {len(self._input_specs)} inputs and {len(self._target_specs)} targets as planned, "
                f"got {len(inputs)} and {len(targets)}"
            )
        else:
            self._check_batch([*cast(tuple[torch.Tensor, ...], inputs), *targets])
        batch = [] if local is not None else [*cast(tuple[torch.Tensor, ...], inputs), *targets]
        if check:
            args = [p.detach() for p in self._params] + list(self._buffers_list)
            args += self._distribute(batch, specs) if local is None else self._from_local(local)
            with torch.no_grad(), implicit_replication():
                outs = _CheckedInterpreter(self.program).run(*args)
        else:
            program = self.lowered()
            with torch.no_grad():  # the lowered program reads local tensors: no DTensor op runs here
                args = [p.to_local() for p in self._params] + [b.to_local() for b in self._buffers_list]
                if local is None:
                    local = [
                        local_shard(t.to(self.device), self.mesh, spec) for t, spec in zip(batch, specs, strict=True)
                    ]
                outs = program(*args, *local)
        loss, *grads = outs
        for p, g in zip(self._trainable, grads, strict=True):
            p.grad = g
        return loss.to_local() if isinstance(loss, DTensor) else loss

    def _check_batch(self, fields: Sequence[torch.Tensor], local: LocalBatch | None = None) -> None:
        """The global batch's fields of the planned shapes and dtypes (a ``local`` batch's: of
        the planned dtypes, its shapes checked by :meth:`_local_fields`), or
        :class:`PlanMismatchError` naming both and the fix: the program is traced for them."""
        planned: tuple[FieldSpec, ...] | None = self.__dict__.get("_planned_batch")
        if planned is None:
            planned = tuple((tuple(v.shape), v.dtype) for v in self._batch_values())
            self.__dict__["_planned_batch"] = planned
        problem = batch_mismatch(planned, fields, num_inputs=len(self._input_specs), shapes=local is None)
        if problem is None:
            return
        if local is not None:
            rows = next((r for r in local.sample_indices if r), ())
            raise PlanMismatchError(
                f"{problem} (step {local.step}, samples {', '.join(map(str, rows[:3]))}{', ...' if len(rows) > 3 else ''}"
                " of the dataset): give the dataset's samples that dtype or re-plan for this one"
            )
        raise PlanMismatchError(
            f"{problem} (the example batch it was traced with): the program runs only on that batch shape and "
            "dtype; pad (or convert) the batch to it, or plan for this one (autoplan.parallelize with "
            "example_inputs= of this shape)"
        )

    def forward(self, *inputs: torch.Tensor | LocalBatch, targets: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """``loss = pmodel(*inputs, targets=...)`` (or ``pmodel(batch)`` with a
        :class:`~autoplan.runtime.data.LocalBatch`) in a standard loop: runs the step (forward
        and backward) and returns the loss, whose ``backward()`` puts the gradients in ``.grad``
        (:mod:`autoplan.runtime.training`). Under ``torch.compile(pmodel)`` the step runs
        eagerly (:data:`~autoplan.runtime.training.COMPILED_CALL_NOTE`)."""
        if torch.compiler.is_compiling():
            training.note_compiled_call()
        return self._forward_eagerly(*inputs, targets=targets)

    @torch.compiler.disable
    def _forward_eagerly(self, *inputs: torch.Tensor | LocalBatch, targets: Sequence[torch.Tensor]) -> torch.Tensor:
        before = [p.grad for p in self._trainable]
        loss = self.forward_backward(*inputs, targets=targets)
        return training.loss_installing_grads(self._anchor, loss, self._trainable, before)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients by their global norm across every rank's shards, as
        ``torch.nn.utils.clip_grad_norm_`` does on one device; returns the norm (collective)."""
        return training.clip_grad_norm_(self._trainable, self._trainable, max_norm, norm_type=norm_type)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]  # noqa: ARG002
        """The parameters by the model's own names, as sharded DTensors (DCP saves and loads
        them in place), each in the layout the program keeps it in (:attr:`param_layouts`), and
        the persistent buffers (replicated DTensors), as ``model.state_dict()`` holds them."""
        return training.sharded_state_dict(self.owned_parameters()) | self.owned_buffers()

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:  # noqa: ARG002
        """Load full tensors (the model's layout: a single-device ``model.state_dict()``, with its
        persistent buffers and a tied tensor under each of its names) or DTensors
        (:meth:`state_dict`'s layout) into the shards and buffers."""
        missing, unexpected = training.load_sharded_state_dict(
            dict(self.named_sharded_parameters()),
            state_dict,
            strict=strict,
            layouts=self.param_layouts,
            buffers=self._persistent_buffers,
            aliases=self._aliases,
        )
        return _IncompatibleKeys(missing, unexpected)
