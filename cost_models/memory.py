"""Memory per device: parameters, gradients, optimizer state and saved activations.

One model of the bytes a parameter element costs, used by every memory estimate (the
per-operator ILP and its plan, the joint search, ``autoplan.estimate`` and the review tools that
print them). By optimizer and training precision (Rajbhandari et al., "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", SC 2020, section 3.1)::

    weights    = w                                 w = 4 (fp32), 2 (bf16, fp16)
    gradients  = w                                 (gradients live in the parameter's layout)
    optimizer  = 4 * states(optimizer) + master    fp32 states: adam, adamw 2 (exp_avg, exp_avg_sq),
                                                   sgd_momentum 1 (momentum_buffer), sgd 0;
                                                   master = 4 (fp32 copy) when w < 4, else 0

so fp32 Adam costs 4 + 4 + 8 bytes, mixed-precision Adam 2 + 2 + 12 (the paper's K = 12), fp32
SGD 4 + 4 + 0. A frozen parameter (``requires_grad=False``) is never updated: weights only.

Activations saved for backward are forward values read by the backward; each costs its local
bytes (elements x item size, :func:`tensor_bytes` at full size; ``P`` keeps a full-size buffer).
Both memory measures are one liveness model: the per-operator peak of the ILP and its plan
(:mod:`autoplan.passes.liveness` times the values' lifetimes) and the per-stage peak of the
joint search and ``autoplan.estimate`` (:func:`stage_memory_parts`, over the per-segment numbers
:mod:`autoplan.planner.segment_costs` reads off the same lifetimes; a pipeline rank's stages
combined by :func:`rank_memory_parts`). Both add :func:`allocator_margin_bytes` and compare with
:func:`usable_memory_bytes`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING, Any, Literal, Protocol

from autoplan.cost_models.comm_schedule import DEFAULT_POLICY, OverlapPolicy

if TYPE_CHECKING:  # annotations only: this module stays torch-free (plan review tools load it)
    import torch

    from autoplan.cost_models.hardware import DeviceSpec

OptimizerName = Literal["adam", "adamw", "sgd", "sgd_momentum"]

OPTIMIZER_STATES: dict[str, int] = {
    "adam": 2,  # exp_avg, exp_avg_sq
    "adamw": 2,
    "sgd_momentum": 1,  # momentum_buffer
    "sgd": 0,
}
"""fp32 tensors of the parameter's shape the optimizer keeps (``torch.optim`` state)."""

STATE_ITEMSIZE = 4
"""Bytes per element of an optimizer state and of the master copy (fp32)."""

PRECISION_ITEMSIZE: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of weights and gradients by training precision (bf16, fp16: mixed precision)."""

OPTIMIZERS: tuple[str, ...] = tuple(OPTIMIZER_STATES)
"""Optimizer names the memory and time model knows."""


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a full-size (unsharded) tensor: its elements times its dtype's item size, the rule
    every activation and transfer byte count uses (:mod:`autoplan.passes.liveness`, the
    communication edges of :mod:`autoplan.passes.costing`, :mod:`autoplan.cost_models.compute`)."""
    return prod(t.shape) * t.element_size()


@dataclass(frozen=True, slots=True)
class ElementBytes:
    """Bytes one parameter element costs for its weights, gradient and optimizer state."""

    weights: int
    grads: int
    optimizer: int
    optimizer_name: str = "sgd"
    """The optimizer these bytes are for (its step's temporaries: :func:`optimizer_temp_bytes`)."""
    state_itemsize: int = STATE_ITEMSIZE
    """Bytes per element of the optimizer's states and of the copy it steps: fp32 (the master
    copy of mixed precision, or the fp32 weights), or the weights' own where no master is kept."""

    def __str__(self) -> str:
        return f"{self.weights}+{self.grads}+{self.optimizer} B"


def element_bytes(
    optimizer: str, itemsize: int, *, trainable: bool = True, master_weights: bool = True
) -> ElementBytes:
    """The module docstring's formula for a parameter stored with ``itemsize`` bytes per element.
    Below fp32, ``master_weights`` (mixed precision) keeps an fp32 master copy and fp32 states;
    without it the parameter is kept in its own dtype, and ``torch.optim``'s states, made
    ``zeros_like`` the parameter, are in that dtype too (a model given in bf16:
    :mod:`autoplan.runtime.precision`)."""
    if not trainable:
        return ElementBytes(weights=itemsize, grads=0, optimizer=0, optimizer_name=optimizer)
    below = itemsize < STATE_ITEMSIZE
    state = itemsize if below and not master_weights else STATE_ITEMSIZE
    master = STATE_ITEMSIZE if below and master_weights else 0
    return ElementBytes(
        weights=itemsize,
        grads=itemsize,
        optimizer=state * OPTIMIZER_STATES[optimizer] + master,
        optimizer_name=optimizer,
        state_itemsize=state,
    )


def precision_bytes(optimizer: str, precision: str, *, master_weights: bool = True) -> ElementBytes:
    """:func:`element_bytes` of a parameter trained in ``precision`` (``fp32``, ``bf16``, ``fp16``;
    ``master_weights``: an fp32 master copy, :func:`keeps_master_weights`)."""
    return element_bytes(optimizer, PRECISION_ITEMSIZE[precision], master_weights=master_weights)


def keeps_master_weights(param_itemsizes: Iterable[int], precision: str) -> bool:
    """Whether a step in ``precision`` of a model whose trained floating-point parameters have
    ``param_itemsizes`` keeps fp32 master weights: some trained parameter is kept at more bytes
    than the step reads it in (an fp32 model under a bf16 plan; :mod:`autoplan.runtime.precision`).
    A model given in the plan's dtype trains in it: no master copy, states in that dtype (what
    ``torch.optim`` makes for it). A model mixing both is priced with masters throughout (an
    upper bound)."""
    return any(size > PRECISION_ITEMSIZE[precision] for size in param_itemsizes)


OPTIMIZER_STATE_BYTES_PER_ELEMENT: dict[str, int] = {name: element_bytes(name, 4).optimizer for name in OPTIMIZERS}
"""Optimizer state of one fp32 parameter element: adam 8, adamw 8, sgd_momentum 4, sgd 0."""

OPTIMIZER_STEP_BYTES_PER_ELEMENT: dict[str, int] = {
    # bytes read + written per element by one fp32 optimizer step: param r/w, grad r, states r/w
    name: 4 * 2 + 4 + OPTIMIZER_STATE_BYTES_PER_ELEMENT[name] * 2
    for name in OPTIMIZERS
}


def offload_host_bytes_per_element(optimizer: str, itemsize: int) -> int:
    """Host bytes per trainable element of the rank's shard when the optimizer state is offloaded
    (``ParallelConfig.offload_optimizer``; what ``autoplan.runtime.optimizers.OffloadedOptimizer``
    allocates), ``w`` the weights' item size::

        host = 4 * states(optimizer)     the optimizer state (fp32)
             + 4                         fp32 master weights (a distinct copy, also of fp32 weights)
             + 4                         fp32 gradient the host step reads
             + (w if w < 4 else 0)       staging copy in the weights' dtype (gradients in, weights out)

    In :func:`stage_memory_parts` the device then holds no optimizer state and no master copy,
    and the step's temporaries are the host's::

        O        = 0,   opt_step = 0
        host_is_device (CPU ranks: the host's memory is the rank's):
        O        = sum_j T'_j host / (dp if zero_stage >= 1),   opt_step as without offload

    fp32 Adam moves 8 B per element off the device and uses 16 on the host; mixed-precision Adam
    moves 12 and uses 18."""
    staging = itemsize if itemsize < STATE_ITEMSIZE else 0
    return STATE_ITEMSIZE * (OPTIMIZER_STATES[optimizer] + 2) + staging


def param_training_bytes_by_part(
    numel: int, itemsize: int, optimizer: str, *, trainable: bool = True
) -> dict[str, int]:
    """Bytes of ``numel`` parameter elements split into ``params``, ``grads`` and ``optimizer``
    (:func:`element_bytes`; a frozen parameter, ``trainable=False``, has weights only)."""
    b = element_bytes(optimizer, itemsize, trainable=trainable)
    return {"params": numel * b.weights, "grads": numel * b.grads, "optimizer": numel * b.optimizer}


def param_training_bytes(numel: int, itemsize: int, optimizer: str) -> int:
    """Bytes of one (unsharded) trainable parameter with its gradient and optimizer state."""
    return sum(param_training_bytes_by_part(numel, itemsize, optimizer).values())


class SegmentMemory(Protocol):
    """What one layer segment of a micro-batch holds (:class:`autoplan.cost_models.step.SegmentCost`
    has these fields; :mod:`autoplan.planner.segment_costs` gives their formulas). Bytes are local
    to one device of the tensor-parallel group, per micro-batch."""

    @property
    def param_numel(self) -> int: ...
    @property
    def trainable_numel(self) -> int: ...
    @property
    def saved_bytes(self) -> float: ...
    @property
    def selective_kept_bytes(self) -> float: ...
    @property
    def selective_bwd_transient_bytes(self) -> float: ...
    @property
    def full_kept_bytes(self) -> float: ...
    @property
    def full_bwd_transient_bytes(self) -> float: ...
    @property
    def input_bytes(self) -> float: ...
    @property
    def shared_input_bytes(self) -> float: ...
    @property
    def fwd_transient_bytes(self) -> float: ...
    @property
    def bwd_transient_bytes(self) -> float: ...
    @property
    def tied_param_numel(self) -> int: ...
    @property
    def tied_trainable_numel(self) -> int: ...
    @property
    def tied_param_owner(self) -> int: ...
    @property
    def grad_sync_bytes(self) -> float: ...
    @property
    def param_itemsize(self) -> int: ...
    @property
    def dp_split_numel(self) -> int: ...
    @property
    def dp_split_trainable_numel(self) -> int: ...


def segment_activation_bytes(seg: SegmentMemory, recompute: str) -> tuple[float, float, float]:
    """``(kept, shared, transient)`` bytes of one segment of a micro-batch under ``recompute``: ``kept``
    from its forward to its backward, ``shared`` kept too but read by other segments as well (a
    causal mask: held once per stage), ``transient`` on top of them while the segment runs::

        none       kept = saved                                  shared = 0
                   transient = max(fwd_T, bwd_T)
        selective  kept = selective_kept                         shared = 0
                   transient = max(fwd_T, selective_bwd_T)
        full       kept = full_kept                              shared = 0
                   transient = max(fwd_T, full_bwd_T)

    (``fwd_T``/``bwd_T`` the segment's forward/backward transient peaks; ``selective_kept`` and
    ``full_kept`` the storages of ``K`` of that policy, :mod:`autoplan.passes.recompute`;
    ``selective_bwd_T``/``full_bwd_T`` the backward's peak with the storages the policy
    re-creates, each alive from where the runtime re-runs it to its last reader,
    :mod:`autoplan.planner.segment_costs`): a recomputed segment's backward re-creates what it did
    not keep as its ops need it (under ``full``: nearly the whole block when its backward starts,
    one block at a time, as Megatron and torchtitan checkpoint per block). A value several later
    segments read (a causal mask) is kept once, in the segment that makes it, as under ``none``."""
    fwd_t, bwd_t = seg.fwd_transient_bytes, seg.bwd_transient_bytes
    if recompute == "selective":
        return seg.selective_kept_bytes, 0.0, max(fwd_t, seg.selective_bwd_transient_bytes)
    if recompute == "full":
        return seg.full_kept_bytes, 0.0, max(fwd_t, seg.full_bwd_transient_bytes)
    return seg.saved_bytes, 0.0, max(fwd_t, bwd_t)


ALLOCATOR_MARGIN_FRACTION = 0.05
"""Bytes PyTorch's CUDA caching allocator reserves beyond the allocated peak (fragmentation: freed
blocks kept in its pools that a later request of another size cannot use), as a fraction of the
allocated peak. Source: an out-of-memory report of a 80 GB training run (A800-80G, PB-LLM,
github.com/hahnyuan/PB-LLM issue #3: "74.53 GiB is allocated by PyTorch, and 4.23 GiB is reserved
by PyTorch but unallocated", 5.7 %); the allocator and its statistics: PyTorch docs, "CUDA
semantics - Memory management" (``memory_reserved`` vs ``memory_allocated``). CPU ranks have no
caching allocator (the system ``malloc`` returns freed memory): no margin there."""

DRIVER_VISIBLE_FRACTION = 79.25 / 80
"""Of a GPU's memory, the part the CUDA driver hands to the process (``cudaMemGetInfo`` total): an
"80 GB" A100 carries 80 GiB of HBM2e (``nvidia-smi``: 81,920 MiB) and PyTorch reports "79.25 GiB
total capacity" (github.com/levihsu/OOTDiffusion issue #235, an A100 80GB out-of-memory message)."""

CUDA_CONTEXT_BYTES = 0.51 * 2**30
"""Device memory a process holds outside PyTorch's allocator before any communicator: the CUDA
context and cuBLAS workspaces. Source: the PB-LLM out-of-memory report above (one A800-80G,
no process group): 79.27 GiB in use, of which PyTorch's 74.53 + 4.23 GiB."""

NCCL_COMMUNICATOR_BYTES = {2: 544e6, 3: 688e6}
"""Device memory one NCCL communicator holds once it has run a collective, by its number of
ranks (the ``3`` entry for every size above 2): its channels' send and receive buffers
(``NCCL_BUFFSIZE`` per protocol, channel and peer) for the ring and, beyond two ranks, the tree.
Measured per process group on 4 A100 with NVLink through PyTorch, a 4 MB all-reduce in each
group (github.com/NVIDIA/nccl issue #964: "for group with only 2 devices, it requires 544 MB.
And for group with more than 2 devices, it requires 688 MB"; the maintainer's answer in #986:
memory grows with every communicator not split with shared resources, linearly with its
channels, and no further past two nodes). Used for every catalog GPU: the one per-communicator
measurement found (an assumption on H100/H200/B200, whose NVLink runs as many channels or more).
A one-rank group has no peer: nothing."""

NCCL_P2P_PEER_BYTES = (4.34e9 - 1.06e9) / 7
"""Device memory a communicator adds for each peer it exchanges point-to-point sends with (a
pipeline stage's neighbours): NCCL connects separate peer-to-peer channels per pair of ranks.
Measured on 8 H100 through PyTorch (github.com/NVIDIA/nccl issue #1685: memory outside PyTorch
1.06 GB before the first ``all_to_all_single``, 4.34 GB after it, which connected 32 channels to
each of the 7 peers): 469 MB per peer."""


NVLS_BYTES_PER_LOCAL_RANK = 16 * 2 * (4 * 2**20 + 2 * 2**20)
"""Device memory NCCL's NVLink SHARP (NVLS) buffers take per communicator, for each of its ranks
on the node, on a device whose NVLink supports multicast (:data:`NVLINK_MULTICAST_DEVICES`) when
the communicator has more than two ranks on the node. NCCL v2.19.4 ``src/transport/nvls.cc``:
``ncclNvlsInit`` turns NVLS on where the node has more than 2 of the communicator's GPUs and
``CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED`` (``NCCL_NVLS_ENABLE`` default 2: where supported);
``ncclNvlsSetup`` allocates ``nvlsPerRankSize = nChannels * 2 * (buffSize + NVLS_MEM_ALIGN_SIZE)``
times ``nHeads`` (``NCCL_NVLS_NCHANNELS`` 16 channels, the 4 MiB Simple buffer, 2 MiB
alignment; one head per local GPU, ``graph/connect.cc`` ``connectNvls``): 1.5 GiB for a
communicator over 8 GPUs of a node, 0.75 GiB over 4 (vllm issue #9699 logs 2.25 GiB with 24
channels on 8 GPUs: the same formula). NeMo's launcher sets ``NCCL_NVLS_ENABLE=0`` to save this
memory (NVIDIA/NeMo-Framework-Launcher pull request #127)."""

NVLINK_MULTICAST_DEVICES = frozenset({"H100", "H200", "B200"})
"""Catalog GPUs whose NVSwitch fabric supports NVLink multicast (NVLink SHARP: third-generation
NVSwitch on HGX H100/H200, NVLink 5 switches on HGX B200), so NCCL allocates
:data:`NVLS_BYTES_PER_LOCAL_RANK`; not the A100 (second-generation NVSwitch, no multicast)."""


def nvlink_multicast(device: DeviceSpec) -> bool:
    """Whether ``device``'s NVLink supports multicast (:data:`NVLINK_MULTICAST_DEVICES`)."""
    return device.name in NVLINK_MULTICAST_DEVICES


def nccl_communicator_bytes(num_ranks: int, local_ranks: int = 1, *, multicast: bool = False) -> float:
    """Device memory of one NCCL communicator over ``num_ranks`` ranks, ``local_ranks`` of them on
    this rank's node: :data:`NCCL_COMMUNICATOR_BYTES` (0 for one rank), plus the NVLS buffers
    where the device supports multicast and more than two of its ranks share the node."""
    if num_ranks <= 1:
        return 0.0
    nvls = NVLS_BYTES_PER_LOCAL_RANK * local_ranks if multicast and local_ranks > 2 else 0.0
    return NCCL_COMMUNICATOR_BYTES[min(num_ranks, 3)] + nvls


def non_pytorch_bytes(
    device_kind: str, groups: Iterable[tuple[int, int]] = (), p2p_peers: int = 0, *, multicast: bool = False
) -> float:
    """Device memory a training process holds outside PyTorch's allocator on a rank whose program
    runs collectives in process groups ``groups`` (``(ranks, ranks on this node)`` each, each
    its own NCCL communicator; PyTorch creates one per group at the group's first collective)
    and point-to-point sends with ``p2p_peers`` other ranks; ``multicast``: the device's NVLink
    supports it (:data:`NVLINK_MULTICAST_DEVICES`)::

        cuda:  CUDA_CONTEXT_BYTES + sum(nccl_communicator_bytes(n, local)) + p2p_peers * NCCL_P2P_PEER_BYTES
        cpu:   0 (gloo's buffers are allocations of the process, counted where they run)"""
    if device_kind != "cuda":
        return 0.0
    comms = sum(nccl_communicator_bytes(n, local, multicast=multicast) for n, local in groups)
    return CUDA_CONTEXT_BYTES + comms + p2p_peers * NCCL_P2P_PEER_BYTES


def mesh_groups(mesh_shape: Sequence[int], devices_per_node: int) -> tuple[tuple[int, int], ...]:
    """The process groups a rank of a program on a device mesh of ``mesh_shape`` runs collectives
    in, as ``(ranks, ranks on the rank's node)``: the world (the default group) and one group per
    mesh axis, except an axis that spans the world (``DeviceMesh`` reuses the default group for
    it) or has one rank. Ranks are laid out with the last axis innermost, ``devices_per_node``
    consecutive ranks to a node."""
    world = prod(mesh_shape)
    if world <= 1:
        return ()
    out = [(world, min(world, devices_per_node))]
    for i, n in enumerate(mesh_shape):
        stride = prod(mesh_shape[i + 1 :])
        if 1 < n < world:
            out.append((n, max(1, min(n, devices_per_node // stride))))
    return tuple(out)


GB = 10**9
GiB = 2**30


def device_kind(device: DeviceSpec) -> str:
    """``cpu`` for CPU ranks, ``cuda`` for the catalog's GPUs (the allocator and the optimizer
    kernels that run there)."""
    return "cpu" if device.name == "CPU" else "cuda"


def usable_memory_bytes(
    capacity_bytes: float,
    device_kind: str,
    groups: Iterable[tuple[int, int]] = (),
    p2p_peers: int = 0,
    *,
    multicast: bool = False,
) -> float:
    """Bytes a training process can allocate through PyTorch on a device of marketed capacity
    ``capacity_bytes`` (:attr:`autoplan.cost_models.hardware.DeviceSpec.mem_capacity_bytes`, the
    decimal "80 GB"), on a rank with the process groups and peers of :func:`non_pytorch_bytes`::

        cuda:  capacity / GB * GiB * DRIVER_VISIBLE_FRACTION - non_pytorch_bytes(...)
        cpu:   capacity (a rank's share of host memory, as configured)

    GPU memory is sold in binary units under a decimal name (80 GB = 80 GiB of HBM); an A100
    80GB gives 79.25 GiB, less 0.51 GiB of context and its communicators (78.74 GiB on one
    device), against 74.5 GiB if "80 GB" were read as 80e9 bytes. The caching allocator's fragmentation is charged on the peak instead
    (:func:`allocator_margin_bytes`)."""
    if device_kind != "cuda":
        return float(capacity_bytes)
    outside = non_pytorch_bytes(device_kind, groups, p2p_peers, multicast=multicast)
    return capacity_bytes / GB * GiB * DRIVER_VISIBLE_FRACTION - outside


def allocatable_bytes(
    capacity_bytes: float, device_kind: str, groups: Iterable[tuple[int, int]] = (), *, multicast: bool = False
) -> float:
    """The largest allocated peak whose peak with the allocator margin fits
    :func:`usable_memory_bytes` (the ILP's memory bound, which counts allocated bytes)."""
    margin = ALLOCATOR_MARGIN_FRACTION if device_kind == "cuda" else 0.0
    return usable_memory_bytes(capacity_bytes, device_kind, groups, multicast=multicast) / (1 + margin)


def allocator_margin_bytes(allocated_peak_bytes: float, device_kind: str) -> float:
    """What the allocator reserves beyond ``allocated_peak_bytes`` (:data:`ALLOCATOR_MARGIN_FRACTION`
    on CUDA, 0 on CPU)."""
    return ALLOCATOR_MARGIN_FRACTION * allocated_peak_bytes if device_kind == "cuda" else 0.0


GLOO_FLAT_COPY_COLLECTIVES = ("all_gather", "reduce_scatter")
"""Collectives for which gloo (CPU ranks) allocates, while one runs, a buffer of the collective's
full (unsharded) size beside its input and output: ProcessGroupGloo runs an all-gather into one
flat buffer of the gathered size and copies it out, and a reduce-scatter as an all-reduce of a
full-size copy of the input. Measured on 2 and 4 gloo ranks with torch 2.13 (profiler memory
events, ``all_gather_into_tensor``/``reduce_scatter_tensor`` and their functional twins, 1 to 64
MiB): all-gather peaks at twice the gathered size, reduce-scatter at the input plus the output;
all-reduce and all-to-all allocate only their output. NCCL reduces and gathers in the caller's
buffers (its channel buffers are :func:`non_pytorch_bytes`): nothing on CUDA."""


def collective_scratch_bytes(collective: str, full_bytes: float, device_kind: str) -> float:
    """Bytes ``collective`` (``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``) of
    ``full_bytes`` (the gathered output, the unreduced input) allocates beyond its input and output
    while it runs: ``full_bytes`` for gloo's flat copies (:data:`GLOO_FLAT_COPY_COLLECTIVES`, CPU
    ranks), 0 otherwise."""
    return float(full_bytes) if device_kind == "cpu" and collective in GLOO_FLAT_COPY_COLLECTIVES else 0.0


def collective_peak_bytes(
    collective: str, *, full_bytes: float, out_bytes: float, device_kind: str, relayout: bool = False
) -> float:
    """The most bytes one DTensor redistribution step allocates at once (its output included,
    its input not): ``collective`` of ``full_bytes`` (the gathered size along its mesh axis, the
    unreduced input) into ``out_bytes``; ``relayout``: the gathered / scattered tensor dim has
    non-trivial dims before it, so the collective (which runs on dim 0) needs a re-laid copy::

        all_gather      out + (F on CPU or with relayout; not at once)   gloo's flat copy; funcol.all_gather_single's chunk-cat
        reduce_scatter  out + (F on CPU) + (F with relayout)             gloo's full copy; funcol.reduce_scatter_single's narrow-cat of the input
        all_to_all      CPU: 2F (gloo has none: DTensor's shard_dim_alltoall gathers, then chunks)   CUDA: 2 x out (permuted input + output)
        all_reduce      out

    Measured on 2 gloo ranks with torch 2.13 (profiler memory events of
    ``DTensor.redistribute`` on a [8, 64, 2048] fp32 tensor, F = 4 MiB): S(0)/S(1)/S(2) -> R peak
    2F; S(1) -> S(2) and S(0) -> S(1) 2F; P -> S(0) F + F/2, P -> S(1) 2F + F/2; P -> R F;
    R -> S(d) F/2 (out only). The CUDA rows follow the code of torch 2.13
    (``torch/_utils.py::_maybe_view_chunk_cat``, ``_functional_collectives.reduce_scatter_single``);
    NCCL's own buffers are :func:`non_pytorch_bytes`."""
    full, cpu = float(full_bytes), device_kind == "cpu"
    copy = full if relayout else 0.0
    if collective == "all_gather":
        return out_bytes + max(collective_scratch_bytes(collective, full, device_kind), copy)
    if collective == "reduce_scatter":
        return out_bytes + collective_scratch_bytes(collective, full, device_kind) + copy
    if collective == "all_to_all":
        return 2.0 * full if cpu else 2.0 * out_bytes
    return float(out_bytes)


def stage_memory_parts(
    *,
    segments: Sequence[SegmentMemory],
    recompute: str,
    element: ElementBytes,
    zero_stage: int,
    dp: int,
    inflight: int,
    num_microbatches: int,
    device_kind: str,
    first_segment: int = 0,
    policy: OverlapPolicy = DEFAULT_POLICY,
    reduced_in_backward: bool = False,
    converting_backwards: int = 1,
    offload_optimizer: bool = False,
    host_is_device: bool = False,
    ep: int | None = None,
    last_stage: bool = True,
) -> dict[str, float]:
    """Peak bytes per device of one pipeline stage (:mod:`autoplan.cost_models.step`), by part:
    the liveness peak of the step as it runs. Per segment ``j`` of the stage (in order):
    ``kept_j, shared_j, T_j`` from :func:`segment_activation_bytes`, ``P_j`` parameter elements,
    ``T'_j`` trainable; w, g, o bytes per element of weights, grads and optimizer state
    (:func:`precision_bytes`)::

        weights  W = sum_j P_j w / (dp if zero_stage >= 3)     optimizer  O = sum_j T'_j o / (dp if zero_stage >= 1)
        grads    g_j = T'_j g / (dp if zero_stage >= 2)      raw  r_j = T'_j g   (the backward's output,
                 not yet reduced: the runtime converts a stage's gradients after the schedule)
        A        = inflight * (sum_j kept_j + max_j shared_j)            (micro-batches in flight)
        backward of j:  A - K_j + T_j + gathered_j + R_j            (the first micro-batch)
                        A min(f, m - 1) / f - K_j + T_j + gathered_j + R + R_j  (a later one, m > 1:
                                          the sum of the earlier ones is alive, at most m - 1 in flight)
                 R_j = sum_{i > j} r_i   (the stage's later segments made theirs first; T_j holds
                 j's own as its backward makes them, segment_costs' G_k), R = sum_i r_i;
                 plus a later reader's contribution to a tied parameter of a segment <= j held in
                 the stage, until the owner's backward sums it (_tied_partials_held)
                 K_j = sum_{i > j} kept_i  (the micro-batch's activations of the later segments,
                 freed as their backward read them: gradients replace activations as it runs)
                 f = inflight, m = micro-batches per step
        reductions:     R + bucket + reduced     (after the schedule; activations freed)
        reduced_in_backward (comm_schedule.gradients_reduced_in_backward: not zero-bubble; with
        m > 1 the last micro-batch's backward) with ZeRO >= 1: the backward reduce-scatters
        its buckets as they fill, at most ``reduce_scatters_in_flight`` unwaited, so
                 R_j -> G_j + min(R_j, (in_flight + 1) bucket)    and no reductions after it
                 (G_j = sum_{i > j} g_i, the reduced shards of the later segments)
        sharded accumulation (converting_backwards = m > 1: comm_schedule.converting_backwards,
        ``ParallelConfig.sharded_grad_accumulation``): every micro-batch's backward reduces as
        above and its shards are added to the sharded accumulators once it returns, so in a later
        micro-batch's backward the sum alive is the accumulators', not the raw one:
                 R -> G    (backward of j, a later one: A min(f, m - 1) / f + T_j + gathered_j + G
                            + G_j + min(R_j, (in_flight + 1) bucket))
                 and a later micro-batch's forward holds the previous backward's buckets in
                 flight: A (f - 1) / f + sum_{i <= j} kept_i + fwd_T_j + gathered_j + G
                            + min(R, (in_flight + 1) bucket)       (_later_forward_peak)
        optimizer step: G + opt_step                 (G = sum_j g_j; activations all freed)
        peak     = W + O + max( max_j backward of j, reductions, optimizer step ) + allocator margin
        gathered (gathered_j in the backward of j) = ZeRO-3, reshard_after_forward:
                   (1 + full) Q_j w + sum_{j-prefetch <= i < j} Q_i w + S_g
                   (Q_j: the elements j reads, its own and a tied copy; the i < j are the next in
                   backward order, prefetched while j runs, none for the last segment of the last
                   stage, whose backward runs before they are issued; S_g: the running gather's
                   flat input (its shards, max Q_i w / dp) and scratch,
                   collective_scratch_bytes(max of those Q_i w); the segment before the last of
                   the last stage gathers its own while the next one's runs, both issued once
                   the last segment's run ended: S_g of both; full = 1 under full
                   recomputation: the re-run forward's own gather of the block, beside the
                   backward's); without resharding sum_j P_j w
        bucket   = min(max(sum_j T'_j g if dp > 1, sum_j M_j g), bucket_cap)    (M_j: the
                   elements of j's gradients converted on tp/cp, grad_sync_bytes; the flat copy of one gradient bucket:
                   :mod:`autoplan.runtime.pipeline` converts a stage's gradients once per step,
                   after the schedule, bucket by bucket)
        reduced  = 0 for ZeRO 0 (the bucket is all-reduced in place, as DDP's), bucket / dp for
                   ZeRO >= 1 (the reduce-scatter's result beside the bucket), plus the running
                   reduce-scatter's scratch S = collective_scratch_bytes(bucket) (gloo's full-size
                   copy on CPU ranks, 0 on CUDA; in the backward too once a bucket is issued)
        opt_step = optimizer_temp_bytes(the trained weights' fp32 copies / (dp if zero_stage >= 1))

    Transients of different segments never coexist (a max, not a sum). ``gathered``: FSDP2's
    gathered weights (:class:`~autoplan.cost_models.comm_schedule.OverlapPolicy`), the block in
    use and the ``prefetch_blocks`` gathered ahead, or the whole stage kept from forward to
    backward. ``num_microbatches``: with several per step, the gradients of the first stay alive
    (summed) through the next ones' backward; ``converting_backwards``
    (:func:`~autoplan.cost_models.comm_schedule.converting_backwards`): how many of them reduce
    their own gradients (1: the last one's, on the raw sum). Parts, adding up to the peak: weights,
    optimizer, grads (``G_j`` of the peak, all at the optimizer step), activations ``A``,
    transient (the rest), allocator. A pipeline rank's stages combine with :func:`rank_memory_parts`.
    A segment reading a tied parameter held before ``first_segment`` (the stage's first segment)
    adds the stage's own copy of it (``tied_param_numel``) to ``P_j`` and ``T'_j``.
    Recomputation (selective or full, per block as :mod:`autoplan.runtime.pipeline` executes it)
    enters only through ``kept_j`` and ``T_j``. ``offload_optimizer``: ``O`` and ``opt_step`` as
    :func:`offload_host_bytes_per_element` says (``host_is_device``: CPU ranks). ``ep``: ``dp_split_numel``
    (experts) is split over ``ep`` ranks (``None``: dp), ``1/ep`` of it in ``W`` below ZeRO 3 and in
    ``O`` under ZeRO 0; with ``ep < dp`` ZeRO 3 gathers and the buckets reduce that shard too. (long: the docstring states the whole formula the body computes, term by term)"""
    st = _stage_state(
        segments=segments, recompute=recompute, element=element, zero_stage=zero_stage, dp=dp, inflight=inflight,
        device_kind=device_kind, first_segment=first_segment, policy=policy, reduced_in_backward=reduced_in_backward,
        converting_backwards=converting_backwards, offload_optimizer=offload_optimizer,
        host_is_device=host_is_device, ep=ep, last_stage=last_stage,
    )  # fmt: skip
    activations, grads, raw, bucket = st.activations, st.grads, st.raw, st.bucket
    at_peak, grads_at_peak = _backward_peak(
        activations, st.transients, st.held, st.summed, gathered=st.gathered, reduction=st.reduction,
        inflight=inflight, num_microbatches=num_microbatches, done=st.done,
    )
    if converting_backwards > 1 and st.in_backward:
        in_forward = st.gathered_in(backward=False)
        later_forward = _later_forward_peak(
            segments, recompute, activations, inflight, in_forward, sum(grads),
            min(sum(raw), (policy.reduce_scatters_in_flight + 1) * bucket),
        )  # fmt: skip
        if later_forward > at_peak:
            at_peak, grads_at_peak = later_forward, sum(grads)
    optimizer_step = sum(grads) + st.step_temp
    if optimizer_step > at_peak:
        at_peak, grads_at_peak = optimizer_step, sum(grads)
    parts = {"weights": st.weights, "grads": grads_at_peak, "optimizer": st.optimizer, "activations": activations,
             "transient": at_peak - activations - grads_at_peak}  # fmt: skip
    return _with_allocator(parts, device_kind)


@dataclass(frozen=True, slots=True)
class _StageState:
    """The terms of :func:`stage_memory_parts` before its maxima (its docstring's names)."""

    weights: float  # W
    optimizer: float  # O
    step_temp: float  # opt_step
    raw: list[float]  # r_j
    grads: list[float]  # g_j
    gathered: list[float]  # gathered_j in a backward
    gathered_in: Callable[..., list[float]]  # gathered_j (backward=False: in a forward)
    activations: float  # A
    transients: list[float]  # T_j
    done: list[float]  # K_j
    held: list[float]  # R_j (or its reduced form) plus the tied partials held
    reduction: float  # what the reductions after the schedule add
    summed: float  # R (raw) or G (sharded accumulation): the gradients summed over micro-batches
    in_backward: bool  # reduced in the backward
    bucket: float


def _stage_state(
    *,
    segments: Sequence[SegmentMemory],
    recompute: str,
    element: ElementBytes,
    zero_stage: int,
    dp: int,
    inflight: int,
    device_kind: str,
    first_segment: int,
    policy: OverlapPolicy,
    reduced_in_backward: bool,
    converting_backwards: int,
    offload_optimizer: bool,
    host_is_device: bool,
    ep: int | None,
    last_stage: bool,
) -> _StageState:
    """:func:`stage_memory_parts`'s terms (its arguments; ``num_microbatches`` enters only its maxima)."""
    tied = _tied_copies(segments, first_segment)
    param_numel, trainable = stage_numels(segments, first_segment)
    # split over ep ranks of dp (experts): 1/ep held below ZeRO 3, so only the unsharded parts
    # change; with ep < dp their shards are gathered (ZeRO 3) and reduced over the dp/ep replicas
    e = ep or dp
    split_p = sum(s.dp_split_numel for s in segments)
    split_t = sum(s.dp_split_trainable_numel for s in segments)
    not_held = 1 - 1 / e
    w = param_numel * element.weights / dp if zero_stage >= 3 else (param_numel - split_p * not_held) * element.weights
    largest_trained = max((s.trainable_numel for s in segments), default=0)
    o, step_temp = _optimizer_bytes(
        element, trainable if zero_stage >= 1 else trainable - split_t * not_held, largest_trained,
        shards=dp if zero_stage >= 1 else 1, device_kind=device_kind, offload=offload_optimizer,
        host_is_device=host_is_device,
    )  # fmt: skip
    raw, grads = _gradient_bytes(segments, tied.values(), dp=dp, ep=e, zero_stage=zero_stage, element=element)
    shard_gathered = 1 / e if e < dp else 0.0  # of the experts, gathered over their replicas
    gathered_in = functools.partial(
        _zero3_gathered_bytes, segments, param_numel, split_p * (1 - shard_gathered), shard_gathered,
        zero_stage=zero_stage, recompute=recompute, policy=policy, element=element, device_kind=device_kind,
        last_stage=last_stage, dp=dp,
    )  # fmt: skip
    gathered = gathered_in()
    activations, transients, done = _activations_and_transients(segments, recompute, inflight)
    reduced_numel = trainable - split_t * (1 - shard_gathered)
    # one flat bucket per mesh axis at a time: the data-parallel one (every trained gradient) and
    # the stage mesh's (the gradients converted on tp/cp: grad_sync_bytes, in the gradient dtype)
    mesh_synced = sum(s.grad_sync_bytes / max(s.param_itemsize, 1) for s in segments) * element.grads
    bucket = min(max(reduced_numel * element.grads if dp > 1 else 0.0, mesh_synced), policy.bucket_cap_bytes)
    scattered = zero_stage >= 1 and dp > 1  # reduce-scattered over dp; else all-reduced in place
    reduced = bucket / dp if scattered else 0.0
    # the reduce-scatter running (one at a time per group) and its backend's copy of the bucket
    scratch = collective_scratch_bytes("reduce_scatter", bucket, device_kind) if scattered else 0.0
    in_backward = reduced_in_backward and zero_stage >= 1 and dp > 1
    held, reduction = _gradients_held(raw, grads, bucket, reduced, in_backward=in_backward, policy=policy,
                                      scratch=scratch)
    held = [h + p for h, p in zip(held, _tied_partials_held(segments, first_segment, element), strict=True)]
    assert converting_backwards == 1 or reduced_in_backward, "several converting backwards reduce in the backward"
    summed = sum(grads) if converting_backwards > 1 else sum(raw)  # across micro-batches: G (sharded) or R
    return _StageState(
        weights=w, optimizer=o, step_temp=step_temp, raw=raw, grads=grads, gathered=gathered,
        gathered_in=gathered_in, activations=activations, transients=transients, done=done, held=held,
        reduction=reduction, summed=summed, in_backward=in_backward, bucket=bucket,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class BackwardTerms:
    """One stage's backward on a pipeline rank as :func:`rank_memory_parts` combines it with the
    rank's other stages at any point of the schedule (:func:`stage_backward_terms`): bytes on top
    of weights and optimizer state, with the micro-batches' activations counted apart."""

    per_microbatch: float
    """One micro-batch's activations, ``A / inflight`` (``kept + max shared``)."""
    first: float
    """The stage's first backward of the step: ``max_j (T_j - K_j + gathered_j + R_j)``."""
    first_grads: float
    """Gradient bytes among ``first`` (``R_j`` of that ``j``)."""
    later: float
    """A later micro-batch's backward: ``max_j (T_j - K_j + gathered_j + summed + R_j)``."""
    later_grads: float
    summed: float
    """The gradients the stage holds from its first backward to the reductions after the
    schedule (``R``, the raw sum; ``G`` under sharded accumulation)."""


def stage_backward_terms(**kwargs: Any) -> BackwardTerms:
    """:class:`BackwardTerms` of the stage :func:`stage_memory_parts` prices with the same keywords."""
    kwargs.pop("num_microbatches", None)
    st = _stage_state(**{"first_segment": 0, "policy": DEFAULT_POLICY, "reduced_in_backward": False,
                         "converting_backwards": 1, "offload_optimizer": False, "host_is_device": False,
                         "ep": None, "last_stage": True, **kwargs})  # fmt: skip
    rows = list(zip(st.transients, st.held, st.done, st.gathered, strict=True))
    first = max(((t - k + g + h, h) for t, h, k, g in rows), default=(0.0, 0.0))
    later = max(((t - k + g + st.summed + h, st.summed + h) for t, h, k, g in rows), default=(0.0, 0.0))
    inflight = kwargs["inflight"]
    return BackwardTerms(
        per_microbatch=st.activations / inflight if inflight > 0 else 0.0, first=first[0], first_grads=first[1],
        later=later[0], later_grads=later[1], summed=st.summed,
    )


def _zero3_gathered_bytes(
    segments: Sequence[SegmentMemory], param_numel: int, never_gathered: float, shard_gathered: float, *,
    zero_stage: int, recompute: str, policy: OverlapPolicy, element: ElementBytes, device_kind: str,
    last_stage: bool = True, dp: int = 1, backward: bool = True,
) -> list[float]:
    """``gathered_j`` of :func:`stage_memory_parts`: ZeRO-3's gathered weights alive in segment
    ``j``'s backward (0 below ZeRO 3), of the stage's parameters less the ``never_gathered``
    elements (the experts' other shards; each segment gathers ``shard_gathered`` of its experts).
    With ``reshard_after_forward`` (FSDP2's default) the weights ``j`` reads (its own and a tied
    copy it reads, ``tied_param_numel``) are gathered for its backward, and the
    ``prefetch_blocks`` segments before it (the next ones in backward order) are gathered while it
    runs, with what the running gather allocates beside them (:func:`collective_scratch_bytes`).
    The last segment of the ``last_stage`` runs its forward and backward as one run of the program
    (:mod:`autoplan.passes.comm_order`): its weights stay gathered from its forward, and the
    gathers for the next segments are issued once its backward ran (measured on gloo ranks,
    ``benchmarks/memory_peak.py``: at the loss's backward peak only the lm_head's weight is
    gathered), so the segment before it gathers its own weights while the next one's are
    gathered too (zero3_ga, 2 ranks: at the last block's backward two coalesced gathers in flight,
    each its ``cat`` of shards, output and gloo's flat copy: 3.76 MiB where one running gather
    priced 2.26). A gather in flight holds its flat input (the shards, ``1/dp``: FSDP2's
    all-gather input as well) beside its output. Without resharding the stage's weights stay
    gathered from forward to backward. ``backward=False``: those alive in a forward (the same,
    less the concurrent gather of the segment before the last, a backward's)."""
    n = len(segments)
    if zero_stage < 3:
        return [0.0] * n
    unsplit = param_numel - never_gathered
    if not policy.reshard_after_forward:
        return [unsplit * element.weights] * n
    reads = [s.param_numel + s.tied_param_numel - s.dp_split_numel * (1 - shard_gathered) for s in segments]
    regather = recompute == "full"  # the re-run forward gathers its block's weights once more

    def running(numel: float) -> float:  # a gather in flight: its flat input of shards and the backend's scratch
        full = numel * element.weights
        return full / dp + collective_scratch_bytes("all_gather", full, device_kind) if numel > 0 else 0.0

    out = []
    for j in range(n):
        ahead = reads[max(0, j - policy.prefetch_blocks) : j] if j < n - 1 or not last_stage else []
        # the last stage's last run ends before the next gathers are issued: j = n - 2's and its next one's at once
        own_running = running(reads[j]) if backward and last_stage and j == n - 2 else 0.0
        numel = min((1 + regather) * reads[j] + sum(ahead), unsplit)
        out.append(numel * element.weights + running(max(ahead, default=0)) + own_running)
    return out


def _tied_partials_held(segments: Sequence[SegmentMemory], first_segment: int, element: ElementBytes) -> list[float]:
    """Per segment ``j`` of the stage, the bytes of a later segment's contribution to the
    gradient of a tied parameter the stage holds in an earlier segment (``P_j`` of
    :func:`stage_memory_parts`): made by the reader's backward and summed into the owner's
    gradient in the owner's backward, so alive through the backward of the segments from the
    owner to the one before the reader (``tied_trainable_numel`` of the reader; a stage without
    the owner keeps its own copy's gradient instead, in ``r_j``;
    :func:`autoplan.planner.segment_costs._tied_gradient_partials`)."""
    out = [0.0] * len(segments)
    for r, s in enumerate(segments):
        if s.tied_param_owner < first_segment:  # none (-1), or before the stage: its copy
            continue
        for j in range(s.tied_param_owner - first_segment, r):
            out[j] += s.tied_trainable_numel * element.grads
    return out


def _later_forward_peak(
    segments: Sequence[SegmentMemory], recompute: str, activations: float, inflight: int,
    gathered: Sequence[float], accumulated: float, flight: float,
) -> float:
    """The forward of a later micro-batch under sharded accumulation (:func:`stage_memory_parts`):
    the previous converting backward left its last buckets in flight (``flight`` bytes: each
    reduce-scatter holds its full-size input, or gloo's copy of it, until the stage's next
    backward waits for it, :meth:`autoplan.runtime.pipeline.StageModule.finish_conversions`)
    beside the sharded accumulators (``accumulated``, their shards included). At segment ``j``::

        A (f - 1) / f + sum_{i <= j} kept_i + fwd_T_j + gathered_j + G + flight

    (the other micro-batches in flight, this one's activations so far and its forward transient;
    measured on gloo ranks, ``benchmarks/memory_peak.py`` zero3_ga_sharded: the step's peak is the
    second micro-batch's log-softmax, with the first one's two buckets in flight)."""
    kept = [segment_activation_bytes(s, recompute)[0] for s in segments]
    others = activations * (inflight - 1) / inflight if inflight > 0 else 0.0
    peak = max(
        (sum(kept[: j + 1]) + s.fwd_transient_bytes + g for j, (s, g) in enumerate(zip(segments, gathered, strict=True))),
        default=0.0,
    )
    return others + peak + accumulated + flight


def _gradient_bytes(
    segments: Sequence[SegmentMemory], tied: Iterable[SegmentMemory], *, dp: int, zero_stage: int,
    element: ElementBytes, ep: int | None = None,
) -> tuple[list[float], list[float]]:
    """Per segment, ``(R_j, g_j)`` of :func:`stage_memory_parts`: its raw gradient bytes (with the
    stage's copies of tied parameters) and what is left after the reductions (``1/dp`` under ZeRO
    >= 2). Gradients of parameters split over ``ep`` ranks of dp (``dp_split_trainable_numel``;
    ``ep`` None: over all of dp) are ``1/ep`` of them raw, reduced over the ``dp / ep`` replicas
    (``1/dp`` kept under ZeRO >= 2)."""
    e = ep or dp
    tied_grads = {id(s) for s in tied}
    reduced = [
        float((s.trainable_numel - s.dp_split_trainable_numel + (s.tied_trainable_numel if id(s) in tied_grads else 0))
              * element.grads)
        for s in segments
    ]  # fmt: skip
    own = [s.dp_split_trainable_numel / e * element.grads for s in segments]
    raw = [r + x for r, x in zip(reduced, own, strict=True)]
    kept = dp / e if zero_stage >= 2 else 1  # of a rank's expert gradients, over their replicas
    return raw, [r / (dp if zero_stage >= 2 else 1) + x / kept for r, x in zip(reduced, own, strict=True)]


def _tied_copies(segments: Sequence[SegmentMemory], first_segment: int) -> dict[int, SegmentMemory]:
    """The segments reading a tied parameter held by a segment before the stage (``first_segment``),
    by owner: the stage keeps its own copy of it."""
    return {s.tied_param_owner: s for s in segments if 0 <= s.tied_param_owner < first_segment}


def stage_numels(segments: Sequence[SegmentMemory], first_segment: int) -> tuple[int, int]:
    """``(P, T')`` of a stage: its parameter elements and the trained ones among them, with its
    own copies of tied parameters (:func:`stage_memory_parts`)."""
    tied = _tied_copies(segments, first_segment).values()
    return (
        sum(s.param_numel for s in segments) + sum(s.tied_param_numel for s in tied),
        sum(s.trainable_numel for s in segments) + sum(s.tied_trainable_numel for s in tied),
    )


def _optimizer_bytes(
    element: ElementBytes,
    trainable: float,
    largest_trained: int,
    *,
    shards: int,
    device_kind: str,
    offload: bool,
    host_is_device: bool,
) -> tuple[float, float]:
    """``(O, opt_step's temporaries)`` of :func:`stage_memory_parts` for ``trainable`` elements
    (the largest segment's ``largest_trained``) sharded ``shards`` ways; with ``offload`` on the
    host (0, 0) unless the host's memory is the device's (:func:`offload_host_bytes_per_element`)."""
    master = max(element.weights, element.state_itemsize)  # the copy the step updates: fp32 master or the weights
    step_temp = optimizer_temp_bytes(
        element.optimizer_name, largest_trained * master, trainable * master / shards, device_kind
    )
    if not offload:
        return float(trainable * element.optimizer) / shards, step_temp
    if not host_is_device:
        return 0.0, 0.0
    return float(trainable * offload_host_bytes_per_element(element.optimizer_name, element.weights)) / shards, step_temp


def _activations_and_transients(
    segments: Sequence[SegmentMemory], recompute: str, inflight: int
) -> tuple[float, list[float], list[float]]:
    """``A`` (the activations of the ``inflight`` micro-batches), each segment's ``T_j`` and
    ``K_j`` (``sum_{i > j} kept_i``: one micro-batch's activations that its backward has freed
    by the time segment ``j``'s starts) of :func:`stage_memory_parts`."""
    per_segment = [segment_activation_bytes(s, recompute) for s in segments]
    kept = [k for k, _, _ in per_segment]
    activations = inflight * (sum(kept) + max((sh for _, sh, _ in per_segment), default=0.0))
    return activations, [t for _, _, t in per_segment], [sum(kept[j + 1 :]) for j in range(len(kept))]


def _gradients_held(
    raw: Sequence[float], grads: Sequence[float], bucket: float, reduced: float, *, in_backward: bool,
    policy: OverlapPolicy, scratch: float = 0.0,
) -> tuple[list[float], float]:
    """Per segment ``j``, the gradient bytes of the later segments alive in its backward (the
    first micro-batch; ``j``'s own, made as its backward runs, are in its transient ``T_j``), and
    the bytes the reductions after the schedule add (0: none; :func:`stage_memory_parts`).
    ``scratch``: what the running reduce-scatter allocates (:func:`collective_scratch_bytes`),
    alive in a backward once one of its buckets is issued, and after the schedule."""
    later = [sum(raw[j + 1 :]) for j in range(len(raw))]  # R_j
    if in_backward:
        # reduce-scattered as they exist: the reduced shards, plus the full-size buckets in flight
        # and the one filling (at most the raw gradients made so far)
        flight = (policy.reduce_scatters_in_flight + 1) * bucket
        return [
            sum(grads[j + 1 :]) + min(r, flight) + (scratch if r >= bucket > 0 else 0.0) for j, r in enumerate(later)
        ], 0.0
    return later, bucket + reduced + scratch


def _backward_peak(
    activations: float,
    transients: Sequence[float],
    held: Sequence[float],
    summed: float,
    *,
    gathered: Sequence[float],
    reduction: float,
    inflight: int,
    num_microbatches: int,
    done: Sequence[float],
) -> tuple[float, float]:
    """(bytes, gradient bytes among them) at the stage's peak from its backward passes to its
    gradient reductions, on top of weights and optimizer state (:func:`stage_memory_parts`):
    ``held[j]`` the gradient bytes alive in segment ``j``'s backward (the first micro-batch),
    ``summed`` the gradients summed over the earlier micro-batches, alive until after the schedule
    (``R``, the raw sum; ``G``, the sharded accumulators, under sharded accumulation);
    ``reduction`` the bytes the reductions after the schedule add to them (0: none); ``done[j]``
    (``K_j``) the micro-batch's own activations its backward freed before segment ``j``'s (the
    runtime's backward frees each saved value after its last reader,
    :meth:`~autoplan.runtime.lowering.LocalProgram.run_boxed`, as eager autograd does)."""
    # the first micro-batch's backward: every micro-batch in flight, no gradient sum yet
    rows = list(zip(transients, held, done, gathered, strict=True))
    backward = [(activations - k + t + g + h, h) for t, h, k, g in rows]
    if num_microbatches > 1 and inflight > 0:  # a later one's: the sum of the earlier ones is alive
        alive = activations * min(inflight, num_microbatches - 1) / inflight
        backward += [(alive - k + t + g + summed + h, summed + h) for t, h, k, g in rows]
    if reduction > 0:  # the reductions, after the schedule: gradients, one bucket's flat copy and its result
        backward.append((summed + reduction, summed))
    return max(backward, default=(activations, 0.0))


BackwardState = tuple[int, tuple[int, ...], bool, tuple[bool, ...], tuple[int, ...]]
"""A backward in a pipeline rank's schedule (:func:`~autoplan.cost_models.schedule.backward_states`):
the rank's stage running it, the micro-batches each of its stages holds then (the running one's
included), whether it is that stage's first backward of the step, which stages ran one before,
and how many B each stage has started (the running one's included)."""


def rank_memory_parts(
    stage_parts: Sequence[Mapping[str, float]],
    device_kind: str,
    *,
    backwards: Sequence[BackwardTerms] = (),
    states: Sequence[BackwardState] = (),
    sends: Sequence[tuple[float, float]] = (),
) -> dict[str, float]:
    """Peak bytes per device of a pipeline rank holding ``stage_parts`` (in stage order;
    interleaved schedules put several stages on a rank), by part. Weights, optimizer state and
    activations (each stage's micro-batches in flight at the rank's peak,
    :func:`~autoplan.cost_models.schedule.inflight_at_rank_peak`) add up; one stage runs at a time,
    so the rank peaks at one stage ``s``'s peak, with its own gradients and transient::

        peak = sum_t (W_t + O_t + A_t) + max_s ( grads_s + transient_s + sum_{t > s} grads_t )

    A micro-batch's backward runs through the rank's stages from the last to the first, so when
    ``s`` starts its first backward the later stages ``t > s`` hold gradients and the earlier ones
    none yet. With ``backwards`` (each stage's :class:`BackwardTerms`) and ``states`` (the rank's
    backwards in schedule order, :data:`BackwardState`), every backward of the schedule is a
    candidate too, with the activations the rank's stages hold at that moment, not at the
    activation peak: a later micro-batch's backward of ``s`` holds ``s``'s gradient sum, and every
    stage that ran a backward before holds its own (interleaved 1F1B, ``p = 2, v = 2, m = 4``:
    rank 0 peaks in stage 0's second backward, holding 3 micro-batches of stage 0, 2 of stage 2
    and both stages' gradients, above the activation peak's 4 and 1 with stage 2's gradients only)::

        peak_b = sum_t (W_t + O_t + n_t(b) a_t) + (first_s or later_s) + sum_{t != s, ran} summed_t
                 + sum_t (B_t(b) out_t + B'_t(b) in_t)                          (with ``sends``)

    ``sends``: per stage ``(out_t, in_t)``, the bytes of one micro-batch's forward send (its
    output, 0 on the last stage) and backward send (its input's gradient, 0 on the first), for
    schedules that keep every send until the step ends (torch's ``_PipelineScheduleRuntime``,
    which runs interleaved 1F1B and zero-bubble: "send ops should be waited on before step()
    exits"; its stage drops its own reference to the output when the micro-batch's B starts):
    ``B_t(b)`` the B stage ``t`` has started by then, ``B'_t(b)`` those that ended (measured,
    ``benchmarks/memory_peak.py`` pp2_v2_m4: at rank 0's peak in stage 0's second backward the
    outputs of 4 micro-batches and 2 input gradients, 64 KiB each, held by their sends).
    The allocator margin is that of the total. One stage: its own parts."""
    if len(stage_parts) == 1:
        return dict(stage_parts[0])
    out: dict[str, float] = {}
    for parts in stage_parts:
        for key in ("weights", "optimizer", "activations"):
            out[key] = out.get(key, 0.0) + parts.get(key, 0.0)
    grads = [parts.get("grads", 0.0) for parts in stage_parts]
    candidates = [
        (grads[s] + sum(grads[s + 1 :]), parts.get("transient", 0.0)) for s, parts in enumerate(stage_parts)
    ]
    out["grads"], out["transient"] = max(candidates, key=sum, default=(0.0, 0.0))
    if backwards:
        best = out["activations"] + out["grads"] + out["transient"]
        # the same sums recur from state to state: each computed once (the same expression, the same value)
        held: dict[tuple[int, ...], float] = {}
        summed: dict[tuple[int, tuple[bool, ...]], float] = {}
        for s, alive, first, ran, backs in states:
            term = backwards[s]
            if alive not in held:
                held[alive] = sum(n * b.per_microbatch for n, b in zip(alive, backwards, strict=True))
            activations = held[alive]
            if (s, ran) not in summed:
                summed[(s, ran)] = sum(b.summed for t, b in enumerate(backwards) if t != s and ran[t])
            others = summed[(s, ran)]
            own, own_grads = (term.first, term.first_grads) if first else (term.later, term.later_grads)
            # (under zero-bubble the state is the W: its B's input gradient, sent, counts as not yet)
            kept_sends = sum(
                n * o + (n - (t == s)) * i for t, (n, (o, i)) in enumerate(zip(backs, sends, strict=True))
            ) if sends else 0.0  # fmt: skip
            if activations + own + others + kept_sends > best:
                best = activations + own + others + kept_sends
                grads_b = own_grads + others
                out["activations"], out["grads"], out["transient"] = activations, grads_b, best - activations - grads_b
    return _with_allocator(out, device_kind)


def _with_allocator(parts: dict[str, float], device_kind: str) -> dict[str, float]:
    """``parts`` and, where the device has a caching allocator, its margin as part ``allocator``."""
    margin = allocator_margin_bytes(sum(parts.values()), device_kind)
    return {**parts, "allocator": margin} if margin else parts


def optimizer_temp_bytes(optimizer: str, max_param_bytes: float, total_param_bytes: float, device_kind: str) -> float:
    """Temporary bytes one optimizer step allocates on top of parameters, gradients and states.

    The runtime builds every optimizer with ``foreach=True`` on every device
    (``autoplan.runtime.optimizers.make_torch_optimizer``), so the step runs torch's multi-tensor
    kernels, which materialise whole lists of intermediates: one tensor per parameter of a
    (device, dtype) group, all alive at once. In ``torch.optim.adam._multi_tensor_adam`` (torch
    2.13, default arguments: not capturable, no amsgrad, a float beta2) the only list allocated is
    ``exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)``, then divided and offset in place and
    consumed by ``_foreach_addcdiv_`` (one parameter-sized temporary per parameter: the group's
    parameter bytes). Adam's coupled weight decay (``_foreach_add(grads, params)``) allocates a
    list of the same size, deleted (``del device_grads``) before the square root, so the two never
    coexist; AdamW decays in place. ``_multi_tensor_sgd`` updates in place (momentum buffers are
    state). One dtype group holds every trained parameter; with several groups a list outlives
    its group by one ``_foreach_sqrt`` call, bounded by the total::

        adam, adamw   total_param_bytes   (the single-tensor loop, foreach=False, kept 2 * max_param_bytes)
        sgd*          0

    ``max_param_bytes`` and ``device_kind`` are what the single-tensor loop's price depended on;
    both paths are priced alike on CPU and CUDA now.
    """
    del max_param_bytes, device_kind  # the foreach price depends on neither (docstring)
    if optimizer in ("adam", "adamw"):
        return float(total_param_bytes)
    return 0.0
