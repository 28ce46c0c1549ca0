"""Pass 1 — trace: ``nn.Module`` + loss -> joint forward/backward aten graph.

Contract
--------
Input: a module (on any device, ``meta`` included), example inputs and targets, a loss function
``loss_fn(model_output, *targets) -> scalar``.

Output: a :class:`TracedProgram` whose ``graph_module`` computes one training step's
forward *and* backward::

    step(*params, *buffers, *inputs, *targets) -> (loss, *grads)     # grads of the trainable params

* ``grads`` are those of the trainable parameters (``requires_grad=True``), in parameter order
  (``trainable_names``); a frozen parameter is a placeholder like any other but gets no gradient,
  so no backward op computes one, no collective reduces one and no optimizer state exists for it,
  exactly as in the single-device model;
* a buffer the forward updates (batch norm's running statistics and ``num_batches_tracked``
  in training mode) is written by a ``copy_`` into its placeholder, which the program runs in
  place on the replicated buffer; batch norm in training mode is written out in batch sums the
  plan can split (:mod:`autoplan.passes.batch_norm`);
* every node carries ``meta["val"]`` (shape and dtype), so later passes never run the model;
* placeholders are named ``p_<fqn>``, ``b_<fqn>``, ``input_<i>``, ``target_<i>``;
* nodes the loss depends on are the forward, the rest the backward
  (``meta["autoplan.phase"]`` is ``"fwd"`` or ``"bwd"``);
* ``fingerprint`` is a hash of ops, wiring, shapes and dtypes: equal fingerprints mean a plan
  made for one trace applies to the other;
* a parameter is read as the model holds it, except a fused grouped-query QKV projection, which
  the graph reads grouped by key/value head so tensor parallelism can split it by heads
  (``param_layouts``, :mod:`autoplan.passes.kv_groups`; the runtime converts at its boundary);
* the graph is the same whichever device the model was traced on (``meta``, CPU, CUDA): among
  others, layer-norm gradients are computed from a contiguous ``grad_out`` and ``as_strided``
  that only restates a dense layout is a view (:mod:`autoplan.passes.strided`).

The model is first exported with ``torch.export`` (non-strict), which is the supported way to
capture Hugging Face models; the joint graph is then built with ``make_fx`` over the exported
module and ``torch.autograd.grad``. Training is the workload: backward ops are ordinary nodes,
so their cost is counted like any other.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import io
import logging
import operator
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.nn.attention import SDPBackend, sdpa_kernel

from autoplan.cost_models.errors import UnsupportedModelError
from autoplan.passes.attention import attention_as_single_op, causal_masks_as_flag
from autoplan.passes.batch_norm import BATCH_NORM_DECOMPOSITIONS, check_batch_norm_momentum, is_training_batch_norm
from autoplan.passes.fused_norm import norms_as_single_op
from autoplan.passes.kv_groups import group_fused_qkv
from autoplan.passes.kv_rows import KVGroupRows
from autoplan.passes.losses import mean_losses_as_sums
from autoplan.passes.moe import experts_as_single_op
from autoplan.passes.plan_text import param_node_name, placeholder_name
from autoplan.passes.strided import contiguous_norm_grads, dense_layouts

log = logging.getLogger(__name__)

LossFn = Callable[..., torch.Tensor]

_DROP_TARGETS = {
    torch.ops.aten._assert_tensor_metadata.default,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class TracedProgram:
    """The joint training-step graph and how its placeholders map to the user's objects."""

    graph_module: fx.GraphModule
    """``step(*params, *buffers, *inputs, *targets) -> (loss, *grads)``."""
    param_names: tuple[str, ...]
    """Parameter FQNs, in placeholder order (tied parameters appear once)."""
    trainable_names: tuple[str, ...]
    """FQNs of the parameters that require grad, in ``param_names`` order: the step returns one
    gradient for each, in this order. The others are frozen: no gradient, no optimizer state."""
    buffer_names: tuple[str, ...]
    """Buffer FQNs, in placeholder order."""
    num_inputs: int
    """Number of model inputs (``input_<i>`` placeholders)."""
    num_targets: int
    """Number of loss targets (``target_<i>`` placeholders)."""
    fingerprint: str
    """sha256 of ops, wiring, shapes and dtypes (hex, 16 chars)."""
    trace_time_s: float
    """Wall time spent exporting and building the joint graph."""
    param_layouts: Mapping[str, KVGroupRows] = field(default_factory=dict)
    """FQN -> the layout the graph reads a parameter in where it is not the model's (a fused
    grouped-query QKV projection stored grouped by key/value head, :mod:`autoplan.passes.kv_groups`);
    the step's gradient of it is in that layout too. Every other parameter is read as the model holds it."""

    @property
    def num_nodes(self) -> int:
        return len(self.graph_module.graph.nodes)

    @property
    def frozen_names(self) -> tuple[str, ...]:
        """FQNs of the parameters that do not require grad (never updated), in placeholder order."""
        trainable = set(self.trainable_names)
        return tuple(n for n in self.param_names if n not in trainable)


class _LossWrapper(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, loss_fn: LossFn | None, num_inputs: int) -> None:
        super().__init__()
        self.model = model
        self._loss_fn = loss_fn
        self._num_inputs = num_inputs

    def forward(self, *args: Any) -> torch.Tensor:
        inputs, targets = args[: self._num_inputs], args[self._num_inputs :]
        out = self.model(*inputs)
        loss = self._loss_fn(out, *targets) if self._loss_fn is not None else out
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            source = "loss_fn returned" if self._loss_fn is not None else "the model returned (no loss_fn given)"
            raise UnsupportedModelError(
                f"the loss must be a scalar tensor but {source} {got}: pass loss_fn=(output, *targets) -> scalar "
                "(e.g. a mean), or make the model return its loss"
            )
        return loss


_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_OUR_DIRS = (
    str(Path(__file__).parent.parent.resolve()),  # the autoplan package (planner, runtime, tools, public API)
    str(Path(__file__).resolve().parent),  # passes/ (linked as, or installed as, autoplan/passes)
    str(Path(__file__).resolve().parent.parent / "cost_models"),  # cost_models/ beside it, likewise
)


def _user_frame(exc: BaseException) -> str | None:
    """The innermost traceback frame of the user's code (outside torch, autoplan and generated
    code such as ``<string>``), or ``None`` when the failure is entirely inside torch."""
    for fr in reversed(traceback.extract_tb(exc.__traceback__)):
        path = str(Path(fr.filename).resolve()) if not fr.filename.startswith("<") else ""
        if path and not path.startswith(_TORCH_DIR) and not path.startswith(_OUR_DIRS):
            return f"{fr.filename}:{fr.lineno} ({(fr.line or '').strip()})"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def _is_data_dependent(exc: BaseException) -> bool:
    """torch.export stopped on Python control flow or a conversion that reads a tensor's value."""
    return isinstance(exc, GuardOnDataDependentSymNode) or "data-dependent" in str(exc)


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """Silence torch's own logging while tracing: on a failure, export and fake tensors log
    partial graphs and full tracebacks at ERROR level; our one-line error replaces them."""
    torch_logger = logging.getLogger("torch")
    old_level = torch_logger.level
    torch_logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        torch_logger.setLevel(old_level)


def _export(wrapper: torch.nn.Module, args: tuple[Any, ...]) -> torch.fx.GraphModule:
    captured = io.StringIO()  # export also prints hints on failure
    try:
        with (
            contextlib.redirect_stderr(captured),
            _quiet_torch_logs(),
            attention_as_single_op(),
            experts_as_single_op(),
            norms_as_single_op(),
        ):
            ep = torch.export.export(wrapper, args, strict=False)
    except UnsupportedModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - every export failure becomes one clear message
        where = _user_frame(exc)
        at = f" at {where}" if where else ""
        if _is_data_dependent(exc):
            fix = (
                "remove data-dependent Python control flow there (if/while on a tensor value, .item(), .tolist(): "
                "use torch.where / torch.cond) or pass inputs that avoid it"
            )
        else:
            fix = (
                "check that loss_fn(model(*example_inputs), *example_targets) runs eagerly on these example "
                "tensors (shapes, dtypes, number of inputs and targets)"
            )
        raise UnsupportedModelError(
            f"torch.export could not trace the model: {type(exc).__name__}: {_first_line(exc)}{at}; {fix}"
        ) from exc
    finally:
        if captured.getvalue():
            log.debug("torch.export said:\n%s", captured.getvalue())
    if not any(writes_an_argument(n) or is_training_batch_norm(n) for n in ep.graph.nodes):
        return ep.module()  # already functional, no batch statistics: the graph is left exactly as exported
    with (
        _quiet_torch_logs(),
        attention_as_single_op(),
        experts_as_single_op(),
        norms_as_single_op(),
        warnings.catch_warnings(),
    ):
        # torch's own deepcopy of the module call graph warns that its LeafSpec check is deprecated
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        # functionalize, and write batch norm in training mode out in sums (passes/batch_norm.py)
        ep = ep.run_decompositions(dict(BATCH_NORM_DECOMPOSITIONS))
    module = ep.module()
    _differentiable_copies(module)
    return module


def writes_an_argument(node: fx.Node) -> bool:
    """``node`` is an op that writes into one of its arguments (``copy_``, ``mul_``,
    ``index_put_``, ``out=`` variants: an argument whose schema alias is ``(a!)``)."""
    target = node.target
    return (
        node.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments)
    )


def written_tensor_args(node: fx.Node) -> list[int]:
    """Indices, among ``node``'s tensor arguments (``strategies.tensor_args`` order: pytree
    leaves of the positional args), of the arguments it writes into (empty for a pure op)."""
    if not writes_an_argument(node):
        return []
    assert isinstance(node.target, torch._ops.OpOverload)
    schema = node.target._schema.arguments
    written = {k for k, a in enumerate(schema) if a.alias_info is not None and a.alias_info.is_write}
    out, i = [], 0
    for k, arg in enumerate(node.args):
        for leaf in torch.utils._pytree.tree_leaves(arg):
            if isinstance(leaf, fx.Node) and isinstance(leaf.meta.get("val"), torch.Tensor):
                if k in written:
                    out.append(i)
                i += 1
    return out


def _differentiable_copies(gm: fx.GraphModule) -> None:
    """Replace functionalization's ``aten.copy(dst, src)`` (the value ``dst`` holds after
    ``dst.copy_(src)``: ``src`` cast to ``dst``'s dtype and broadcast to its shape) by those two
    ops: ``aten.copy`` has no derivative, ``_to_copy`` and ``expand`` do."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.copy.default:
            continue
        dst, src = node.args[0], node.args[1]
        assert isinstance(dst, fx.Node) and isinstance(src, fx.Node)
        dst_val, src_val = dst.meta["val"], src.meta["val"]
        meta = {k: v for k, v in node.meta.items() if k != "val"}  # module stack and source, for _mark_modules
        value = src
        with graph.inserting_before(node):
            if src_val.dtype != dst_val.dtype:
                value = graph.call_function(torch.ops.aten._to_copy.default, (value,), {"dtype": dst_val.dtype})
                value.meta = dict(meta)
            if tuple(src_val.shape) != tuple(dst_val.shape):
                value = graph.call_function(torch.ops.aten.expand.default, (value, list(dst_val.shape)))
                value.meta = dict(meta)
        node.replace_all_uses_with(value)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()


def _distinct(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The same tensor passed twice (e.g. ids as input and target) must stay two graph inputs:
    later occurrences are cloned."""
    seen: set[int] = set()
    out = []
    for t in args:
        out.append(t.clone() if isinstance(t, torch.Tensor) and id(t) in seen else t)
        seen.add(id(t))
    return tuple(out)


def forward_fingerprint(
    model: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    loss_fn: LossFn | None,
    example_targets: Sequence[torch.Tensor] = (),
) -> str:
    """Fingerprint (as :func:`graph_fingerprint`) of the exported forward and loss alone, the
    graph :func:`trace_training_step` differentiates: equal when the model's Python code (every
    helper it calls) produces the same ops, shapes and dtypes. With the same parameters'
    ``requires_grad`` and the same torch and autoplan, equal forward fingerprints mean equal
    step fingerprints, for a fraction of a full trace's time (no backward graph is built)."""
    inputs, targets = tuple(example_inputs), tuple(example_targets)
    check_batch_norm_momentum(model)
    exported = _export(_LossWrapper(model, loss_fn, len(inputs)), _distinct(inputs + targets))
    return graph_fingerprint(exported)


def _check_callable_with(fn: Callable[..., Any], num_args: int, what: str, fix: str) -> None:
    """Raise if ``fn`` cannot take ``num_args`` positional arguments (checked on its signature
    before tracing, so the message names the arguments rather than a frame inside torch)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: let tracing decide
        return
    try:
        sig.bind(*range(num_args))
    except TypeError as exc:
        raise UnsupportedModelError(
            f"{what} cannot be called with {num_args} positional argument(s): {exc}; {fix}"
        ) from None


def trace_training_step(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    loss_fn: LossFn | None,
    example_targets: Sequence[Any] = (),
) -> TracedProgram:
    """Trace one training step of ``model`` (see the module docstring for the contract)."""
    t0 = time.perf_counter()
    inputs, targets = _check_example_args(model, example_inputs, example_targets)
    _check_callables(model, loss_fn, num_inputs=len(inputs), num_targets=len(targets))
    check_batch_norm_momentum(model)
    wrapper = _LossWrapper(model, loss_fn, len(inputs))
    exported = _export(wrapper, inputs + targets)
    param_layouts = group_fused_qkv(exported)  # before the joint graph: autograd differentiates the rewrite
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    param_names, buffer_names = tuple(params), tuple(buffers)
    trainable_names = _trainable_names(params)
    gm = _trace_joint(exported, params, buffers, inputs, targets, trainable_names)
    _check_grads(gm, trainable_names)
    dense_layouts(gm)  # before _clean_graph, whose dead-code elimination drops the replaced reads
    causal_masks_as_flag(gm)  # before _clean_graph, whose dead-code elimination drops the masks
    _clean_graph(gm)
    mean_losses_as_sums(gm)  # a sharded batch's mean loss is exact whatever the ignored targets
    _canonicalize(gm)
    _name_placeholders(gm, param_names, buffer_names, len(inputs), len(targets))
    _mark_phases(gm)
    _mark_modules(gm)
    fingerprint = graph_fingerprint(gm)
    dt = time.perf_counter() - t0
    log.info("traced %d nodes in %.2fs (fingerprint %s)", len(gm.graph.nodes), dt, fingerprint)
    return TracedProgram(
        graph_module=gm,
        param_names=param_names,
        trainable_names=trainable_names,
        buffer_names=buffer_names,
        num_inputs=len(inputs),
        num_targets=len(targets),
        fingerprint=fingerprint,
        trace_time_s=dt,
        param_layouts=param_layouts,
    )


def _check_example_args(
    model: object, example_inputs: object, example_targets: object
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The user's model, example inputs and targets -> the inputs and targets as tuples of
    distinct tensors, or :class:`UnsupportedModelError` naming what to pass instead."""
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedModelError(
            f"model must be a torch.nn.Module, got {type(model).__name__}: wrap the function in an nn.Module"
        )
    if not isinstance(example_inputs, (tuple, list)) or len(example_inputs) == 0:
        got = "an empty tuple" if isinstance(example_inputs, (tuple, list)) else type(example_inputs).__name__
        raise UnsupportedModelError(
            f"example_inputs is missing (got {got}): pass a tuple of example tensors, e.g. example_inputs=(ids,)"
        )
    if not isinstance(example_targets, (tuple, list)):
        raise UnsupportedModelError(
            f"example_targets must be a tuple of tensors, got {type(example_targets).__name__}: "
            "e.g. example_targets=(labels,)"
        )
    inputs, targets = tuple(example_inputs), tuple(example_targets)
    flat_user = _distinct(inputs + targets)
    inputs, targets = tuple(flat_user[: len(inputs)]), tuple(flat_user[len(inputs) :])
    for i, t in enumerate(inputs + targets):
        if not isinstance(t, torch.Tensor):
            raise UnsupportedModelError(
                f"example input/target #{i} has type {type(t).__name__}; autoplan needs tensors "
                "(wrap Python values in torch.tensor or bind them into the model)"
            )
    return inputs, targets


def _check_callables(model: torch.nn.Module, loss_fn: LossFn | None, *, num_inputs: int, num_targets: int) -> None:
    """Raises :class:`UnsupportedModelError` unless ``model.forward`` takes one argument per
    example input and ``loss_fn`` the output and one argument per target."""
    _check_callable_with(
        model.forward, num_inputs, f"{type(model).__name__}.forward", "pass one example tensor per forward argument"
    )
    if loss_fn is not None:
        _check_callable_with(
            loss_fn,
            1 + num_targets,
            f"loss_fn {getattr(loss_fn, '__name__', type(loss_fn).__name__)}",
            f"it is called as loss_fn(output, *example_targets) with {num_targets} target(s): "
            "pass the targets it needs in example_targets",
        )


def _trainable_names(params: dict[str, torch.nn.Parameter]) -> tuple[str, ...]:
    """Named parameters -> the FQNs of the trainable ones, or :class:`UnsupportedModelError` when none is."""
    trainable_names = tuple(n for n, p in params.items() if p.requires_grad)
    if not trainable_names:
        what = f"all {len(params)} have requires_grad=False" if params else "it has none"
        raise UnsupportedModelError(
            f"the model has no trainable parameters ({what}): there is nothing to train; "
            "unfreeze some with requires_grad_(True) or add trainable parameters"
        )
    return trainable_names


def _trace_joint(
    exported: fx.GraphModule,
    params: dict[str, torch.nn.Parameter],
    buffers: dict[str, torch.Tensor],
    inputs: tuple[torch.Tensor, ...],
    targets: tuple[torch.Tensor, ...],
    trainable_names: tuple[str, ...],
) -> fx.GraphModule:
    """The exported forward + loss -> the raw joint graph ``step(*params, *buffers, *inputs,
    *targets) -> (loss, *grads)`` built by ``make_fx`` over ``torch.autograd.grad``. A buffer the
    forward updates (batch norm's running statistics, :mod:`autoplan.passes.batch_norm`) is
    written in place by a ``copy_`` into its placeholder."""
    param_names, buffer_names = tuple(params), tuple(buffers)
    full_param_names = ["model." + n for n in param_names]
    full_buffer_names = ["model." + n for n in buffer_names]
    num_p, num_b = len(param_names), len(buffer_names)

    # The exported module runs through an Interpreter under preserve_node_meta, so every traced
    # forward op keeps its ``nn_module_stack`` and every op its autograd ``seq_nr`` (a backward
    # op has the seq_nr of the forward op it differentiates): :func:`_mark_modules` uses both.
    exported.forward = lambda *a: fx.Interpreter(exported).run(*a)

    def step(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        p = dict(zip(full_param_names, flat[:num_p], strict=True))
        b = dict(zip(full_buffer_names, flat[num_p : num_p + num_b], strict=True))
        loss = torch.func.functional_call(exported, {**p, **b}, tuple(flat[num_p + num_b :]))
        _link_backward_to_forward(loss)
        if not loss.requires_grad:  # the loss reads no trainable parameter
            return (loss, *(None for _ in trainable_names))
        trainable = [t for t in p.values() if t.requires_grad]
        with contiguous_norm_grads():  # the same gradient strides on every device
            grads = torch.autograd.grad(loss, trainable, allow_unused=True)
        return (loss, *grads)

    # frozen parameters enter the step as they are in the model: nothing differentiates them
    flat_args = [p.detach().requires_grad_(p.requires_grad) for p in params.values()]
    # buffers are copies: the step writes batch norm's running statistics, and tracing runs it
    flat_args += [b.detach().clone() for b in buffers.values()] + list(inputs) + list(targets)
    try:
        # Attention as plain matmul + softmax, so the graph is the same on meta, CPU and CUDA
        # (the fused kernels are device-specific and have no DTensor strategy on CPU).
        with (
            _quiet_torch_logs(),
            sdpa_kernel([SDPBackend.MATH]),
            attention_as_single_op(),
            experts_as_single_op(),
            norms_as_single_op(),
            fx_traceback.preserve_node_meta(),
        ):
            return make_fx(step)(*flat_args)
    except Exception as exc:  # noqa: BLE001
        where = _user_frame(exc)
        raise UnsupportedModelError(
            f"could not build the backward graph: {type(exc).__name__}: {_first_line(exc)}"
            f"{f' at {where}' if where else ''}; check that loss.backward() runs eagerly on this model "
            "(custom autograd Functions need a backward)"
        ) from exc


def _check_grads(gm: fx.GraphModule, trainable_names: Sequence[str]) -> None:
    """Every trainable parameter gets a gradient (a frozen one is not asked for one)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    grads = out.args[0][1:]
    unused = [name for name, g in zip(trainable_names, grads, strict=True) if g is None]
    if unused:
        raise UnsupportedModelError(
            f"{len(unused)} parameter(s) get no gradient from the loss (e.g. {unused[0]!r}); "
            "freeze them with requires_grad_(False) or remove them from the model"
        )


_CONSTANT_COPIES = (torch.ops.aten.clone.default, torch.ops.aten.lift_fresh_copy.default)


def _clean_graph(gm: fx.GraphModule) -> None:
    g = gm.graph
    for node in list(g.nodes):
        if node.op == "call_function" and node.target in _DROP_TARGETS and not node.users:
            g.erase_node(node)
        elif _is_scalar_constant_move(node):
            # a 0-dim constant moved to the model's device: tracing on meta or CUDA records the move,
            # tracing on CPU does not (DeBERTa-v2's ``torch.tensor(mid - 1).type_as(...)``); the
            # constant is stored on that device instead, so every trace reads it without a move
            const = node.args[0]
            value = getattr(gm, str(const.target))
            setattr(gm, str(const.target), value.to(node.kwargs.get("device", value.device)))
            node.replace_all_uses_with(const)
            g.erase_node(node)
        elif _is_constant_copy(node):
            # a copy of a tensor constant that nothing writes into is the constant: tracing on
            # CPU records one (``lift_fresh_copy`` of an index list such as Falcon's
            # ``fused_qkv[..., [-2], :]``), tracing on meta does not, and the two programs must match
            node.replace_all_uses_with(node.args[0])
            g.erase_node(node)
    _constant_per_reader(gm)
    g.eliminate_dead_code()
    for node in g.nodes:
        if (
            node.op in ("placeholder", "call_function")
            and not isinstance(node.meta.get("val"), (torch.Tensor, tuple, list, int, float, bool, torch.SymInt))
            and node.meta.get("val") is not None
        ):
            raise UnsupportedModelError(f"node {node.name} ({node.target}) has no tensor metadata")
    # no recompile: _canonicalize replaces the graph (which recompiles)


def _is_scalar_constant_move(node: fx.Node) -> bool:
    """``_to_copy`` of a 0-dim ``get_attr`` constant, its only reader, that changes nothing but
    its device."""
    if node.op != "call_function" or node.target is not torch.ops.aten._to_copy.default or len(node.args) != 1:
        return False
    src = node.args[0]
    if not isinstance(src, fx.Node) or src.op != "get_attr" or len(src.users) != 1:
        return False
    val = src.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 0:
        return False
    same_kind = node.kwargs.get("dtype", val.dtype) == val.dtype and node.kwargs.get("layout") in (None, torch.strided)
    return same_kind and set(node.kwargs) <= {"device", "dtype", "layout", "non_blocking", "pin_memory"}


def _is_constant_copy(node: fx.Node) -> bool:
    """``clone``/``lift_fresh_copy`` of a ``get_attr`` constant, no reader of which writes into it."""
    if node.op != "call_function" or node.target not in _CONSTANT_COPIES or node.kwargs.get("memory_format"):
        return False
    src = node.args[0]
    return isinstance(src, fx.Node) and src.op == "get_attr" and not any(writes_an_argument(u) for u in node.users)


def _constant_per_reader(gm: fx.GraphModule) -> None:
    """Every reader of a tensor constant reads its own ``get_attr``, placed right before it.
    Tracing on CPU shares one constant between readers where tracing on meta makes one per reader
    (Falcon's index lists, forward and backward), and puts it elsewhere in the graph; the two
    programs must match (``fingerprint``). Constants are never written into (the graph is
    functional), so a reader's own copy of the node reads the same tensor."""
    g = gm.graph
    for node in [n for n in g.nodes if n.op == "get_attr"]:
        for user in list(node.users):
            with g.inserting_before(user):
                mine = g.get_attr(str(node.target))
            mine.meta = dict(node.meta)
            user.replace_input_with(node, mine)
        g.erase_node(node)


_CANONICAL_TARGETS = {
    # reshape lowers to view or _unsafe_view depending on the device's stride bookkeeping; both
    # are the same operation for planning and for DTensor execution
    torch.ops.aten._unsafe_view.default: torch.ops.aten.view.default,
}


def _eval_batch_norm_saves_nothing(node: fx.Node) -> None:
    """Batch norm in eval mode saves no statistics for its backward (which reads the running
    ones): its CPU and CUDA kernels return empty ``save_mean``/``save_invstd``, its meta kernel
    ``(C,)`` ones. Both become empty, in the node's value and its readers', so a model traced on
    meta plans the program CPU and CUDA ranks trace (ResNet's plans were refused at run time)."""
    val = node.meta.get("val")
    if not isinstance(val, (tuple, list)) or len(val) != 3:
        return
    empty = [v.new_empty((0,)) if isinstance(v, torch.Tensor) else v for v in val[1:]]
    node.meta["val"] = (val[0], *empty)
    for user in node.users:
        index = user.args[1] if user.target is operator.getitem else None
        if isinstance(index, int) and index in (1, 2):
            user.meta["val"] = empty[index - 1]


def _canonicalize(gm: fx.GraphModule) -> None:
    """Make the graph identical whatever device the model was traced on (meta, CPU, CUDA):
    canonical targets and names ``<op>_<k>`` numbered in graph order."""
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "get_attr"):
            continue
        if node.target is torch.ops.aten._native_batch_norm_legit_no_training.default:
            _eval_batch_norm_saves_nothing(node)
        node.target = _CANONICAL_TARGETS.get(node.target, node.target)
        if node.target is torch.ops.aten.view.default and isinstance(node.meta.get("val"), torch.Tensor):
            node.args = (node.args[0], list(node.meta["val"].shape))  # resolve -1 the same way everywhere
        if node.op == "get_attr":
            base = "const"
        elif node.target is operator.getitem:
            base = "getitem"
        elif isinstance(node.target, torch._ops.OpOverload):
            base = node.target._schema.name.split("::")[-1]
        else:
            base = getattr(node.target, "__name__", "op")
        k = counts.get(base, 0)
        counts[base] = k + 1
        node.name = base if k == 0 else f"{base}_{k}"
    # copy into a fresh graph so the new names are the only ones registered
    fresh = fx.Graph()
    out = fresh.graph_copy(gm.graph, {})
    fresh.output(out)
    gm.graph = fresh  # recompiles


def _name_placeholders(
    gm: fx.GraphModule, param_names: Sequence[str], buffer_names: Sequence[str], num_inputs: int, num_targets: int
) -> None:
    names = [param_node_name(n) for n in param_names]
    names += [placeholder_name("b", n) for n in buffer_names]
    names += [f"input_{i}" for i in range(num_inputs)] + [f"target_{i}" for i in range(num_targets)]
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(phs) == len(names), (len(phs), len(names))
    for node, name in zip(phs, names, strict=True):
        node.name = name  # fx de-duplicates if needed
        node.target = node.name
    gm.recompile()


def _link_backward_to_forward(loss: torch.Tensor) -> None:
    """Autograd hooks that stamp each backward op with its forward op's ``seq_nr`` (AOTAutograd's
    own mechanism; private, so a torch without it only loses the backward ops' module names)."""
    try:
        from torch._functorch._aot_autograd.logging_utils import setup_stacktrace_preservation_hooks
    except ImportError:  # pragma: no cover - depends on the torch version
        return
    if loss.grad_fn is not None:
        setup_stacktrace_preservation_hooks([loss.grad_fn])


MODULE_KEY = "autoplan.module"
"""``node.meta[MODULE_KEY]``: FQN of the innermost module whose forward produced the op (for a
backward op: the module of the forward op it differentiates); ``""`` for top-level code (e.g.
the loss), absent where autograd gives no link (gradient accumulation of a reused value)."""


def _mark_modules(gm: fx.GraphModule) -> None:
    by_seq: dict[int, str] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        stack = n.meta.get("nn_module_stack")
        if n.meta.get("autoplan.phase") == "fwd" and stack:
            path = list(stack.values())[-1][0]
            path = path.removeprefix("model.") if path != "model" else ""
            n.meta[MODULE_KEY] = path
            if (seq := n.meta.get("seq_nr")) is not None:
                by_seq.setdefault(seq, path)
        elif n.meta.get("autoplan.phase") == "fwd":
            n.meta[MODULE_KEY] = ""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.meta.get("autoplan.phase") == "bwd":
            seq = n.meta.get("seq_nr")
            if seq is not None and seq in by_seq:
                n.meta[MODULE_KEY] = by_seq[seq]
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack", "seq_nr", "original_aten", "from_node"):
            n.meta.pop(key, None)


def _mark_phases(gm: fx.GraphModule) -> None:
    """Forward = ancestors of the loss; everything else computed is backward."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    loss = out.args[0][0]
    fwd: set[fx.Node] = set()
    stack = [loss]
    while stack:
        n = stack.pop()
        if n in fwd:
            continue
        fwd.add(n)
        stack.extend(n.all_input_nodes)
    for n in gm.graph.nodes:
        if n.op == "call_function":
            n.meta["autoplan.phase"] = "fwd" if n in fwd else "bwd"


def _val_sig(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        return f"{tuple(val.shape)}:{val.dtype}"
    if isinstance(val, (tuple, list)):
        return "(" + ",".join(_val_sig(v) for v in val) + ")"
    return repr(val)


def graph_fingerprint(gm: fx.GraphModule) -> str:
    """Stable hash of the graph's ops, wiring, shapes and dtypes (not of parameter values)."""
    h = hashlib.sha256()
    for node in gm.graph.nodes:
        kwargs = {k: v for k, v in node.kwargs.items() if k != "device"}  # meta vs cpu trace: same plan
        args = fx.node.map_arg((node.args, kwargs), lambda n: f"%{n.name}")
        h.update(f"{node.op}|{node.name}|{node.target}|{args}|{_val_sig(node.meta.get('val'))}\n".encode())
    return h.hexdigest()[:16]
