"""Compute cost: FLOPs and bytes per aten op, and a roofline time estimate per device.

Per-op knowledge sits in three registries, one small function per op family, so adding an op
never touches the solver::

    register_flops(*ops)          floating-point operations of one call
    register_bytes(*ops)          bytes one call reads from and writes to device memory
    register_matmul_shapes(*ops)  the GEMMs one call runs, ``Gemm(batch, M, K, N)`` each; this is
                                  what makes an op a matmul (``is_matmul``)

The registries are keyed by the op's qualified name (``str(op)``, e.g. ``"aten.mm.default"``), so
formulas for ops defined elsewhere (``autoplan.sdpa.default`` in ``passes/attention.py``) can be
registered here without importing them. Formula functions get the op's *tensor* arguments (the
positional ones, flattened, ``None`` dropped) and its tensor results; only shapes and dtypes are
read, so meta/fake tensors do. Defaults for an op no registry knows (elementwise-like)::

    flops = sum(2*B*M*K*N over its GEMMs)   if it is a matmul
          = numel(output)                   otherwise (one operation per output element)
    bytes = sum(bytes of tensor inputs) + sum(bytes of tensor outputs)   (each read/written once)

Time is a roofline (Williams, Waterman, Patterson, "Roofline: an insightful visual performance
model", CACM 2009) plus a per-op overhead::

    compute_s = flops / (peak_flops * efficiency)
    memory_s  = bytes / (mem_bw * MEMORY_EFFICIENCY)
    time_s    = max(compute_s, memory_s) + overhead

The efficiency numbers a device carries (``matmul_peak_fraction``, ``mem_bw_GBps``,
``op_overhead_us``) can be fitted to a profiler trace of a planned step: ``autoplan calibrate
--from-profile`` (``autoplan.cost_models.trace_calibration``).

Matmuls run at ``device.peak_flops_for(dtype)`` (tensor cores for 16-bit dtypes; float32 is the
non-TF32 rate) times the shape-dependent ``matmul_efficiency``: a per-device curve whose asymptote
is the measured large-GEMM fraction of peak (``DeviceSpec.matmul_peak_fraction``, e.g. 81.5%
on A100, its 86.9% burst measurement at the sustained clock, and 80.3% on H100 in bf16) and whose shape dependence is the tile/wave/K-loop model below
(small and skinny matmuls do not reach it); every other op runs on the vector units
(the float32 rate, efficiency 1) and is memory bound at a few FLOPs per element. An op whose
work is split ``work_divisor`` ways (sharded) has its flops and bytes divided, and its matmul
efficiency is that of the per-device GEMM (``local_gemm``). Measured (profiled) times replace
these estimates where a profile exists.

Some ops do different work for the same shapes depending on a non-tensor argument: causal fused
attention (``is_causal=True``) skips the score tiles above the diagonal. ``register_variant``
names such calls, ``cost_key(op, args, kwargs)`` gives the registry key of one call
(``"autoplan.sdpa.default[causal]"``), and the formulas are registered under that key.

Compute beside communication: ``concurrent_compute_factor(device)`` is how much longer compute
takes while a collective runs on the same device (``DeviceSpec.comm_compute_slowdown``).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from math import ceil, prod
from typing import TypeVar

import torch

from autoplan.cost_models.hardware import DeviceSpec
from autoplan.cost_models.memory import tensor_bytes

aten = torch.ops.aten

MATMUL_EFFICIENCY = 0.7
"""Default cap on ``matmul_efficiency`` for a device (or dtype) without a measured
``DeviceSpec.matmul_peak_fraction``: the fraction of the dense peak a large, well-shaped matmul
sustains. Assumption (the CPU preset and custom devices); catalog GPUs carry measured values
(A100 81.5%, H100 80.3%, B200 77.6% in bf16, see ``hardware._MAMF_TABLE`` and
``hardware._SUSTAINED_MATMUL``)."""
UTILIZATION_AT_CAP = 0.9
"""Modelled matmul utilisation at which the cap is reached (assumption). The large GEMMs that
define the cap (the best shapes of a benchmark sweep) lose a few percent to the effects modelled here themselves (8192^3 on an H100:
4096 tiles on 132 SMs = 31.03 waves, 97% wave utilisation), and cuBLAS recovers some
quantisation loss by picking other tile shapes, so utilisation within 10% of perfect counts as
the cap."""
MEMORY_EFFICIENCY = 0.8
"""Fraction of peak memory bandwidth a streaming kernel reaches (assumption, order of STREAM-like
copy benchmarks on HBM)."""
GPU_TILE_MN = 128
"""Output tile (M and N) of one thread block of a GPU GEMM: the 128x128 tile of NVIDIA's "Matrix
Multiplication Background User's Guide", https://docs.nvidia.com/deeplearning/performance/
dl-performance-matrix-multiplication/index.html (tile and wave quantisation sections)."""
GPU_TILE_FIXED_K_BYTES = 256
"""Fixed cost of one output tile (pipeline prologue + epilogue writing the C tile), in bytes of K:
about two main-loop iterations of a 128-byte K slice (typical CUTLASS tile shapes: 128x128x64 for
16-bit, 128x128x32 for 32-bit inputs). Assumption: the K term of ``matmul_efficiency``."""
GPU_MAX_SPLIT_K = 16
"""Largest split of the K loop considered for a GEMM whose output tiles cannot occupy every SM:
cuBLAS/CUTLASS then split K across thread blocks and add the partial tiles ("split-K", CUTLASS
docs, efficient_gemm.md, "Parallelized Reductions"). Assumption on the heuristic: the power of two
up to 16 with the best modelled utilisation; the extra traffic of the partial sums is not counted."""
CPU_REUSE_AT_HALF = 32.0
"""FLOPs per matrix element at which a CPU GEMM reaches half its utilisation: small GEMMs spend
their time packing operands into cache-blocked panels (assumption, order of oneDNN/MKL
small-matrix benchmarks)."""
GPU_KERNEL_OVERHEAD_US = 4.0
"""Launch + tail latency of one GPU kernel, order of magnitude from CUDA launch benchmarks."""
CPU_OP_OVERHEAD_US = 10.0
"""Per-op dispatch overhead of eager PyTorch on CPU (DTensor dispatch adds more)."""
ATTENTION_BLOCK = 128
"""Query and key block of a fused attention kernel: FlashAttention-2 (T. Dao, "FlashAttention-2:
Faster Attention with Better Parallelism and Work Partitioning", 2023, section 3.3) picks block
sizes in {64, 128} x {64, 128}; 128 for the head dims of large models. With ``is_causal`` a block
whose keys all lie after its queries is skipped (section 3.1.1, "Causal masking": about half of
the blocks for long sequences, a 1.7-1.8x speedup over non-causal attention), so causal attention
does ``causal_block_fraction(T, S)`` of the non-causal work."""


@dataclass(frozen=True, slots=True)
class Gemm:
    """One (batched) matrix multiplication: ``batch`` independent ``(M, K) @ (K, N)`` products."""

    batch: int
    m: int
    k: int
    n: int
    fraction: float = 1.0
    """Fraction of the (M, N) output tiles computed: 1 for a GEMM; causal attention skips the
    tiles above the diagonal (``causal_block_fraction``). Efficiency is that of the full shape."""

    @property
    def flops(self) -> float:
        """2*B*M*K*N * fraction: a multiply-accumulate is two FLOPs."""
        return 2.0 * self.batch * self.m * self.k * self.n * self.fraction

    def __str__(self) -> str:
        tiles = "" if self.fraction == 1.0 else f"[{self.fraction:.3g} of tiles]"
        return f"{self.batch}x({self.m},{self.k})@({self.k},{self.n}){tiles}"


Tensors = Sequence[torch.Tensor]
FlopFn = Callable[[Tensors, Tensors], float]
BytesFn = Callable[[Tensors, Tensors], float]
GemmFn = Callable[[Tensors, Tensors], tuple[Gemm, ...]]

VariantFn = Callable[[Sequence[object], Mapping[str, object]], str | None]

_FLOP_REGISTRY: dict[str, FlopFn] = {}
_BYTES_REGISTRY: dict[str, BytesFn] = {}
_GEMM_REGISTRY: dict[str, GemmFn] = {}
_VARIANT_REGISTRY: dict[str, VariantFn] = {}


def _op_key(op: object) -> str:
    """Registry key: the qualified name (``aten.mm.default``); a string is taken as the name."""
    return op if isinstance(op, str) else str(op)


def _base_key(key: str) -> str:
    """``"autoplan.sdpa.default[causal]"`` -> ``"autoplan.sdpa.default"``."""
    return key.split("[", 1)[0]


_Fn = TypeVar("_Fn")


def _register_in(registry: dict[str, _Fn], ops: tuple[object, ...]) -> Callable[[_Fn], _Fn]:
    def deco(fn: _Fn) -> _Fn:
        for op in ops:
            registry[_op_key(op)] = fn
        _cached_roofline_time_s.cache_clear()  # a new formula changes cached times
        return fn

    return deco


def register_flops(*ops: object) -> Callable[[FlopFn], FlopFn]:
    """Register ``fn(inputs, outputs) -> FLOPs`` for ``ops`` (op objects or qualified names)."""
    return _register_in(_FLOP_REGISTRY, ops)


def register_bytes(*ops: object) -> Callable[[BytesFn], BytesFn]:
    """Register ``fn(inputs, outputs) -> bytes moved`` for ``ops`` (op objects or qualified names)."""
    return _register_in(_BYTES_REGISTRY, ops)


def register_matmul_shapes(*ops: object) -> Callable[[GemmFn], GemmFn]:
    """Register ``fn(inputs, outputs) -> tuple[Gemm, ...]``: the GEMMs ``ops`` run (marks them matmuls)."""
    return _register_in(_GEMM_REGISTRY, ops)


def register_variant(*ops: object) -> Callable[[VariantFn], VariantFn]:
    """Register ``fn(args, kwargs) -> variant name or None`` for ``ops``: a call whose non-tensor
    arguments change its work (``is_causal``) is costed under the key ``"<op>[<variant>]"``."""
    return _register_in(_VARIANT_REGISTRY, ops)


def cost_key(op: object, args: Sequence[object] = (), kwargs: Mapping[str, object] | None = None) -> str:
    """Registry key of one call of ``op`` with these arguments (an FX node's ``args``/``kwargs``):
    the op's qualified name, plus ``[variant]`` when a registered variant function names one.
    Pass it to ``op_flops`` / ``roofline_time_s`` / ... in place of the op."""
    key = _op_key(op)
    fn = _VARIANT_REGISTRY.get(key)
    variant = fn(args, kwargs or {}) if fn is not None else None
    return key if variant is None else f"{key}[{variant}]"


def _sum_bytes(tensors: Tensors) -> int:
    return sum(tensor_bytes(t) for t in tensors)


# --------------------------------------------------------------------------------------------
# Lookups


def is_matmul(op: object) -> bool:
    """True for ops whose work is matrix multiplications (mm family, fused attention)."""
    return _op_key(op) in _GEMM_REGISTRY


def matmul_shapes(op: object, inputs: Tensors, outputs: Tensors) -> tuple[Gemm, ...]:
    """The GEMMs ``op`` runs; empty for ops that are not matmuls."""
    fn = _GEMM_REGISTRY.get(_op_key(op))
    return fn(inputs, outputs) if fn is not None else ()


def op_flops(op: object, inputs: Tensors, outputs: Tensors) -> float:
    """FLOPs of one call (see the module docstring for the defaults)."""
    key = _op_key(op)
    fn = _FLOP_REGISTRY.get(key)
    if fn is not None:
        return float(fn(inputs, outputs))
    gemms = matmul_shapes(key, inputs, outputs)
    if gemms:
        return sum(g.flops for g in gemms)
    return float(sum(t.numel() for t in outputs))


def op_bytes(op: object, inputs: Tensors, outputs: Tensors) -> float:
    """Bytes one call reads and writes in device memory (default: every input and output once);
    a variant (``cost_key``) moves the bytes of its base op."""
    key = _op_key(op)
    fn = _BYTES_REGISTRY.get(key, _BYTES_REGISTRY.get(_base_key(key)))
    if fn is not None:
        return float(fn(inputs, outputs))
    return float(_sum_bytes(inputs) + _sum_bytes(outputs))


# --------------------------------------------------------------------------------------------
# Efficiency


def _is_cpu(device: DeviceSpec) -> bool:
    return device.name == "CPU"


def matmul_asymptote(device: DeviceSpec, dtype: torch.dtype | str = torch.float32) -> float:
    """The efficiency a large, well-shaped ``dtype`` matmul reaches on ``device``: its measured
    ``matmul_peak_fraction`` (cited in the device's sources), else ``MATMUL_EFFICIENCY``."""
    fraction = device.matmul_peak_fraction_for(dtype)
    return MATMUL_EFFICIENCY if fraction is None else fraction


def concurrent_compute_factor(device: DeviceSpec) -> float:
    """How many times longer compute takes while a collective runs beside it on ``device``:
    ``1 + device.comm_compute_slowdown`` (communication kernels take SMs and memory bandwidth;
    18.9% on A100/H100, Lee et al. 2025, see ``hardware._OVERLAP_SLOWDOWN``); 1.0 where it is not
    known (a CPU rank until ``autoplan calibrate`` measures it).

    The step model multiplies the compute that overlaps a collective by this factor.
    """
    slowdown = device.comm_compute_slowdown
    return 1.0 if slowdown is None else 1.0 + slowdown


def causal_block_fraction(t: int, s: int, block: int = ATTENTION_BLOCK) -> float:
    """Fraction of the ``block`` x ``block`` tiles of a ``(T, S)`` score matrix that causal
    attention computes: query block i (queries [i*b, (i+1)*b)) needs key blocks 0..i, the causal
    mask being aligned top-left (query q sees keys k <= q, as ``is_causal`` in PyTorch)::

        nt, ns = ceil(T/b), ceil(S/b)
        kept   = sum over i < nt of min(i + 1, ns)
        fraction = kept / (nt * ns)          -> 1/2 + 1/(2 nt) for T = S
    """
    if t <= 0 or s <= 0:
        return 1.0
    nt, ns = ceil(t / block), ceil(s / block)
    if nt <= ns:
        kept = nt * (nt + 1) // 2
    else:
        kept = ns * (ns + 1) // 2 + (nt - ns) * ns
    return kept / (nt * ns)


def matmul_efficiency(
    m: int,
    k: int,
    n: int,
    device: DeviceSpec,
    dtype: torch.dtype = torch.float32,
    *,
    batch: int = 1,
) -> float:
    """Fraction of ``device``'s dense peak a ``batch`` x ``(M, K) @ (K, N)`` matmul reaches.

    GPU: tile and wave quantisation (NVIDIA, "Matrix Multiplication Background User's Guide", see
    ``GPU_TILE_MN``), a per-tile fixed cost amortised over the K loop, and split-K for GEMMs
    whose tiles cannot fill the SMs (``GPU_MAX_SPLIT_K``)::

        tiles     = batch * ceil(M/128) * ceil(N/128)
        tile_util = M*N / (ceil(M/128)*128 * ceil(N/128)*128)      padding of the edge tiles
        s         = 1, or if tiles < num_SMs the split of K in {1, 2, 4, 8, 16} with the best util
        wave_util = tiles*s / (ceil(tiles*s/num_SMs) * num_SMs)    idle SMs in the last wave
        k_util    = (K/s) / (K/s + 256 bytes / element_size)       prologue + epilogue per tile
        util      = tile_util * wave_util * k_util     (wave term and split-K left out if num_sms is None)

    CPU: no tile effects at this scale; operand packing is amortised over the work::

        reuse = 2*M*K*N / (M*K + K*N + M*N)                         FLOPs per matrix element
        util  = reuse / (reuse + 32)

    Both: ``efficiency = asymptote * min(1, util / UTILIZATION_AT_CAP)``, with ``asymptote`` the
    device's measured best large-GEMM fraction of peak for ``dtype`` (``matmul_asymptote``:
    A100 bf16 0.815 (sustained), H100 0.803, B200 0.776; ``MATMUL_EFFICIENCY`` where none is measured, e.g.
    the CPU preset). The curve therefore depends on the device through its asymptote and its SM
    count (wave size), and on the shape through the tile, wave and K terms.
    """
    asymptote = matmul_asymptote(device, dtype)
    if min(m, k, n, batch) <= 0:
        return asymptote
    if _is_cpu(device):
        reuse = 2.0 * m * k * n / (m * k + k * n + m * n)
        util = reuse / (reuse + CPU_REUSE_AT_HALF)
    else:
        tiles_m, tiles_n = ceil(m / GPU_TILE_MN), ceil(n / GPU_TILE_MN)
        tiles = batch * tiles_m * tiles_n
        tile_util = (m * n) / (tiles_m * tiles_n * GPU_TILE_MN**2)
        util = tile_util * max(_gpu_k_and_wave_util(tiles, k, s, device, dtype) for s in _splits(tiles, device))
    return asymptote * min(1.0, util / UTILIZATION_AT_CAP)


def _splits(tiles: int, device: DeviceSpec) -> list[int]:
    """Split-K candidates: powers of two up to GPU_MAX_SPLIT_K when the tiles leave SMs idle."""
    if device.num_sms is None or tiles >= device.num_sms:
        return [1]
    return [2**i for i in range(GPU_MAX_SPLIT_K.bit_length())]


def _gpu_k_and_wave_util(tiles: int, k: int, split: int, device: DeviceSpec, dtype: torch.dtype) -> float:
    """wave_util * k_util of ``tiles`` output tiles, each with its K loop split ``split`` ways."""
    wave_util = 1.0
    if device.num_sms is not None:
        blocks = tiles * split
        wave_util = blocks / (ceil(blocks / device.num_sms) * device.num_sms)
    k_local = ceil(k / split)
    return wave_util * k_local / (k_local + GPU_TILE_FIXED_K_BYTES / dtype.itemsize)


def local_gemm(gemm: Gemm, work_divisor: int) -> Gemm:
    """The per-device GEMM when ``gemm``'s work is split ``work_divisor`` ways.

    Assumption (the cost model knows the divisor, not the sharded dim): the batch is split first
    (data parallelism and head-parallel attention shard it), and what is left of the divisor
    splits the largest of M, N, K (ties in that order), rounding up.
    """
    if work_divisor <= 1:
        return gemm
    batch_split = min(work_divisor, gemm.batch)
    rest = ceil(work_divisor / batch_split)
    dims = {"m": gemm.m, "n": gemm.n, "k": gemm.k}
    if rest > 1:
        largest = max(dims, key=lambda name: dims[name])
        dims[largest] = ceil(dims[largest] / rest)
    return Gemm(ceil(gemm.batch / batch_split), dims["m"], dims["k"], dims["n"], gemm.fraction)


def gemms_efficiency(gemms: Sequence[Gemm], device: DeviceSpec, dtype: torch.dtype) -> float:
    """Efficiency of running ``gemms`` back to back: total FLOPs / sum(FLOPs_i / efficiency_i)."""
    total = sum(g.flops for g in gemms)
    if total == 0:
        return matmul_asymptote(device, dtype)
    time_units = sum(g.flops / matmul_efficiency(g.m, g.k, g.n, device, dtype, batch=g.batch) for g in gemms)
    return total / time_units


# --------------------------------------------------------------------------------------------
# Roofline


def op_overhead_s(device: DeviceSpec) -> float:
    """Fixed time of one op: the device's fitted ``op_overhead_us`` (``autoplan calibrate
    --from-profile``), else ``CPU_OP_OVERHEAD_US`` / ``GPU_KERNEL_OVERHEAD_US``."""
    if device.op_overhead_us is not None:
        return device.op_overhead_us * 1e-6
    return (CPU_OP_OVERHEAD_US if _is_cpu(device) else GPU_KERNEL_OVERHEAD_US) * 1e-6


def memory_time_s(nbytes: float, device: DeviceSpec) -> float:
    """Time of one copy-like kernel that moves ``nbytes`` (read + written) through ``device``
    memory, priced as ``roofline_time_s`` prices a memory-bound op::

        nbytes / (mem_bw * MEMORY_EFFICIENCY) + op_overhead_s(device)     (0 for nbytes <= 0)

    E.g. FSDP2's copy of a gathered block out of the all-gather buffer into its parameters."""
    if nbytes <= 0:
        return 0.0
    return nbytes / (device.mem_bw_GBps * 1e9 * MEMORY_EFFICIENCY) + op_overhead_s(device)


_TensorSig = tuple[tuple[torch.Size, torch.dtype], ...]


def _signature(tensors: Tensors) -> _TensorSig:
    return tuple((t.shape, t.dtype) for t in tensors)


def roofline_time_s(
    op: object,
    inputs: Tensors,
    outputs: Tensors,
    device: DeviceSpec,
    *,
    work_divisor: int = 1,
) -> float:
    """Estimated time of ``op`` on ``device`` when its work is split ``work_divisor`` ways.

    Cached per (op, input/output shapes and dtypes, device, divisor): the costing pass asks for
    every (node, strategy) pair and most of them repeat.
    """
    return _cached_roofline_time_s(op, _signature(inputs), _signature(outputs), device, work_divisor)


@functools.lru_cache(maxsize=1 << 16)
def _cached_roofline_time_s(
    op: object, in_sig: _TensorSig, out_sig: _TensorSig, device: DeviceSpec, work_divisor: int
) -> float:
    inputs = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in in_sig]
    outputs = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in out_sig]
    dtype = outputs[0].dtype if outputs else torch.float32
    flops = op_flops(op, inputs, outputs) / work_divisor
    nbytes = op_bytes(op, inputs, outputs) / work_divisor
    gemms = matmul_shapes(op, inputs, outputs)
    if gemms:
        local = [local_gemm(g, work_divisor) for g in gemms]
        flops_per_s = device.peak_flops_for(dtype) * gemms_efficiency(local, device, dtype)
    else:
        # vector units: never faster than the non-tensor-core float32 rate
        flops_per_s = min(device.peak_flops_for(dtype), device.peak_flops_for("float32"))
    compute_s = flops / flops_per_s
    memory_s = nbytes / (device.mem_bw_GBps * 1e9 * MEMORY_EFFICIENCY)
    return max(compute_s, memory_s) + op_overhead_s(device)


# ============================================================================================
# The formulas, one small function per op family (registered at import).

# --------------------------------------------------------------------------------------------
# Matmuls: (batched) GEMMs. Bytes are the default, A + B (+ bias) + C, each moved once.


def _gemm(a: torch.Tensor, b: torch.Tensor) -> Gemm:
    """``a (..., M, K) @ b (..., K, N)``; leading dims of ``a`` are the batch."""
    *batch, m, k = a.shape
    return Gemm(prod(batch), m, k, b.shape[-1])


@register_matmul_shapes(aten.mm.default, aten.bmm.default)
def _matmul_gemms(inputs: Tensors, outputs: Tensors) -> tuple[Gemm, ...]:
    """mm (M, K) @ (K, N); bmm (B, M, K) @ (B, K, N). FLOPs: the default 2*B*M*K*N."""
    return (_gemm(inputs[0], inputs[1]),)


@register_matmul_shapes(aten.addmm.default, aten.baddbmm.default)
def _addmm_gemms(inputs: Tensors, outputs: Tensors) -> tuple[Gemm, ...]:
    """addmm(bias, A (M, K), B (K, N)); baddbmm(self, A (B, M, K), B (B, K, N))."""
    return (_gemm(inputs[1], inputs[2]),)


@register_matmul_shapes(aten.linear.default)
def _linear_gemms(inputs: Tensors, outputs: Tensors) -> tuple[Gemm, ...]:
    """linear(x (..., K), weight (N, K), bias?) = x @ weight^T: M = numel(x) / K."""
    x, weight = inputs[0], inputs[1]
    k = x.shape[-1]
    return (Gemm(1, x.numel() // max(k, 1), k, weight.shape[0]),)


@register_flops(aten.addmm.default, aten.baddbmm.default)
def _addmm_flops(inputs: Tensors, outputs: Tensors) -> float:
    """2*B*M*K*N + B*M*N: the GEMM, then the bias/``self`` added once per output element."""
    return _addmm_gemms(inputs, outputs)[0].flops + outputs[0].numel()


@register_flops(aten.linear.default)
def _linear_flops(inputs: Tensors, outputs: Tensors) -> float:
    """2*M*K*N (+ M*N with a bias)."""
    bias_flops = outputs[0].numel() if len(inputs) > 2 else 0
    return _linear_gemms(inputs, outputs)[0].flops + bias_flops


# Convolutions as implicit GEMMs (what cuDNN and oneDNN run): with ``x (N, C_in, *spatial)``,
# ``weight (C_out, C_in / g, *kernel)``, ``y (N, C_out, *out)`` and ``g`` groups, each group is
#     forward      y      (N * prod(out), C_in/g * prod(kernel)) @ (.., C_out/g)
#     grad_input   dx     (N * prod(out), C_out/g) @ (C_out/g, C_in/g * prod(kernel))  (col2im after)
#     grad_weight  dw     (C_out/g, N * prod(out)) @ (N * prod(out), C_in/g * prod(kernel))
# so each is 2 * N * prod(out) * C_out * C_in/g * prod(kernel) FLOPs; bytes are the default.


def _conv_dims(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int, int, int]:
    """``(groups, C_in/g * prod(kernel), C_out/g, N)`` of a convolution of ``x`` by ``weight``."""
    groups = max(x.shape[1] // max(weight.shape[1], 1), 1)
    return groups, prod(weight.shape[1:]), weight.shape[0] // groups, x.shape[0]


@register_matmul_shapes(aten.convolution.default)
def _convolution_gemms(inputs: Tensors, outputs: Tensors) -> tuple[Gemm, ...]:
    """convolution(x, weight, bias?, ...) -> y: one GEMM per group (above); the bias add is
    left out (one addition per output element)."""
    x, weight, y = inputs[0], inputs[1], outputs[0]
    groups, k, c_out, _ = _conv_dims(x, weight)
    return (Gemm(groups, y.numel() // (groups * c_out), k, c_out),)


@register_matmul_shapes(aten.convolution_backward.default)
def _convolution_backward_gemms(inputs: Tensors, outputs: Tensors) -> tuple[Gemm, ...]:
    """convolution_backward(grad_y, x, weight, ...) -> the gradients its output mask asks for
    (told apart by shape: ``x``'s for grad_input, ``weight``'s for grad_weight; grad_bias is a
    sum over ``grad_y``, no GEMM)."""
    grad_y, x, weight = inputs[0], inputs[1], inputs[2]
    groups, k, c_out, _ = _conv_dims(x, weight)
    rows = grad_y.numel() // (groups * c_out)  # N * prod(out)
    shapes = [tuple(o.shape) for o in outputs]
    gemms = []
    if tuple(x.shape) in shapes:
        gemms.append(Gemm(groups, rows, c_out, k))
    if tuple(weight.shape) in shapes[1 if tuple(x.shape) in shapes[:1] else 0 :]:
        gemms.append(Gemm(groups, c_out, rows, k))
    return tuple(gemms)


# Fused attention (``autoplan::sdpa``, passes/attention.py; FLOPs are registered there). Its
# bytes are the default, which is the fused (flash) kernel's traffic: Q, K, V (+ mask) read and
# O written once; the (T, S) scores never reach memory. Efficiency comes from its GEMMs.


# Causal attention (``is_causal=True``) is the variant ``[causal]`` of these ops: the same GEMMs
# over ``causal_block_fraction(T, S)`` of the (T, S) score tiles (FlashAttention-2 skips the
# others, see ``ATTENTION_BLOCK``); its FLOPs are the default, the sum over its GEMMs.

_SDPA_IS_CAUSAL_ARG = {
    # op -> position of ``is_causal`` in its schema (passes/attention.py)
    "autoplan.sdpa.default": 5,  # (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    "autoplan.sdpa_backward.default": 6,  # (grad_out, query, key, value, attn_mask, dropout_p, is_causal, ...)
    "autoplan.sdpa_backward_with_mask.default": 6,
}


def _sdpa_causal_variant(position: int) -> VariantFn:
    def variant(args: Sequence[object], kwargs: Mapping[str, object]) -> str | None:
        causal = kwargs.get("is_causal", args[position] if len(args) > position else False)
        return "causal" if causal is True else None

    return variant


for _name, _position in _SDPA_IS_CAUSAL_ARG.items():
    register_variant(_name)(_sdpa_causal_variant(_position))


def _sdpa_forward_gemms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fraction: float) -> tuple[Gemm, ...]:
    *batch, t, d = q.shape
    bh, s, dv = prod(batch), k.shape[-2], v.shape[-1]
    return (Gemm(bh, t, d, s, fraction), Gemm(bh, t, s, dv, fraction))


def _sdpa_backward_only_gemms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fraction: float) -> tuple[Gemm, ...]:
    *batch, t, d = q.shape
    bh, s, dv = prod(batch), k.shape[-2], v.shape[-1]
    return (
        Gemm(bh, s, t, dv, fraction),
        Gemm(bh, t, dv, s, fraction),
        Gemm(bh, t, s, d, fraction),
        Gemm(bh, s, t, d, fraction),
    )


@register_matmul_shapes("autoplan.sdpa.default")
def _sdpa_gemms(inputs: Tensors, outputs: Tensors) -> tuple[Gemm, ...]:
    """q (B, H, T, D), k (B, H, S, D), v (B, H, S, Dv): S = Q K^T and O = P V per (batch, head)."""
    return _sdpa_forward_gemms(inputs[0], inputs[1], inputs[2], 1.0)


@register_matmul_shapes("autoplan.sdpa.default[causal]")
def _sdpa_causal_gemms(inputs: Tensors, outputs: Tensors) -> tuple[Gemm, ...]:
    """As ``_sdpa_gemms`` over the tiles on or below the diagonal (``causal_block_fraction``)."""
    q, k = inputs[0], inputs[1]
    return _sdpa_forward_gemms(q, k, inputs[2], causal_block_fraction(q.shape[-2], k.shape[-2]))


@register_matmul_shapes("autoplan.sdpa_backward.default", "autoplan.sdpa_backward_with_mask.default")
def _sdpa_backward_gemms(inputs: Tensors, outputs: Tensors) -> tuple[Gemm, ...]:
    """grad_out, q, k, v: the recomputed forward (2 GEMMs, as attention.py counts its FLOPs),
    dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q."""
    q, k, v = inputs[1], inputs[2], inputs[3]
    return (*_sdpa_forward_gemms(q, k, v, 1.0), *_sdpa_backward_only_gemms(q, k, v, 1.0))


@register_matmul_shapes("autoplan.sdpa_backward.default[causal]", "autoplan.sdpa_backward_with_mask.default[causal]")
def _sdpa_causal_backward_gemms(inputs: Tensors, outputs: Tensors) -> tuple[Gemm, ...]:
    """As ``_sdpa_backward_gemms`` over the tiles on or below the diagonal."""
    q, k, v = inputs[1], inputs[2], inputs[3]
    fraction = causal_block_fraction(q.shape[-2], k.shape[-2])
    return (*_sdpa_forward_gemms(q, k, v, fraction), *_sdpa_backward_only_gemms(q, k, v, fraction))


# --------------------------------------------------------------------------------------------
# Views, metadata and allocation: no kernel reads or writes data.

_NO_KERNEL_OPS = (
    aten.view.default,
    aten._unsafe_view.default,
    aten.expand.default,
    aten.transpose.int,
    aten.t.default,
    aten.permute.default,
    aten.alias.default,
    aten.detach.default,
    aten.unsqueeze.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.slice.Tensor,
    aten.select.int,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.unbind.int,
    aten.as_strided.default,
    aten.diagonal.default,
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.empty_strided.default,
    operator.getitem,  # picks one result of a multi-output op
)


@register_flops(*_NO_KERNEL_OPS)
@register_bytes(*_NO_KERNEL_OPS)
def _no_kernel_cost(inputs: Tensors, outputs: Tensors) -> float:
    """0 FLOPs, 0 bytes: a view writes new sizes/strides (metadata), an allocation touches no data.
    Its time is the per-op overhead alone."""
    return 0.0


_FILL_OPS = (
    aten.new_ones.default,
    aten.new_zeros.default,
    aten.new_full.default,
    aten.ones_like.default,
    aten.zeros_like.default,
    aten.full_like.default,
    aten.full.default,
    aten.zeros.default,
    aten.ones.default,
    aten.arange.default,
    aten.arange.start,
    aten.arange.start_step,
    aten.scalar_tensor.default,
)


@register_flops(*_FILL_OPS)
def _fill_flops(inputs: Tensors, outputs: Tensors) -> float:
    """0 FLOPs: a fill (or arange's index arithmetic) computes nothing from data."""
    return 0.0


@register_bytes(*_FILL_OPS)
def _fill_bytes(inputs: Tensors, outputs: Tensors) -> float:
    """bytes = output: written once; an input (``new_ones(x, ...)``) only supplies sizes/dtype."""
    return float(_sum_bytes(outputs))


# --------------------------------------------------------------------------------------------
# Gathers and scatters: only the addressed rows move, not the whole table.


@register_flops(aten.embedding.default, aten.index.Tensor, aten.index_select.default, aten.gather.default)
def _gather_flops(inputs: Tensors, outputs: Tensors) -> float:
    """0 FLOPs: pure data movement."""
    return 0.0


@register_bytes(aten.embedding.default, aten.index.Tensor, aten.index_select.default, aten.gather.default)
def _gather_bytes(inputs: Tensors, outputs: Tensors) -> float:
    """bytes = out (gathered rows read) + indices + out (written); the table (inputs[0]) is not read
    beyond the gathered rows. embedding(weight (V, D), ids (...)) -> (..., D)."""
    out = _sum_bytes(outputs)
    return float(out + _sum_bytes(inputs[1:]) + out)


@register_flops(aten.embedding_dense_backward.default)
def _embedding_backward_flops(inputs: Tensors, outputs: Tensors) -> float:
    """numel(grad_output): one add per gradient element accumulated into its row."""
    return float(inputs[0].numel())


@register_bytes(aten.embedding_dense_backward.default)
def _embedding_backward_bytes(inputs: Tensors, outputs: Tensors) -> float:
    """bytes = grad_output (..., D) + indices (...) + table (num_weights, D): the gradient rows are
    read and scattered into a zero-filled table, which is written in full."""
    return float(_sum_bytes(inputs) + _sum_bytes(outputs))


# --------------------------------------------------------------------------------------------
# Reductions and normalisations: FLOPs per *input* element; bytes are the default (in + out).

_REDUCTION_OPS = (
    aten.sum.default,
    aten.sum.dim_IntList,
    aten.mean.default,
    aten.mean.dim,
    aten.amax.default,
    aten.amin.default,
    aten.max.default,
    aten.min.default,
    aten.max.dim,
    aten.min.dim,
    aten.argmax.default,
    aten.argmin.default,
    aten.prod.default,
    aten.cumsum.default,
)


@register_flops(*_REDUCTION_OPS)
def _reduction_flops(inputs: Tensors, outputs: Tensors) -> float:
    """numel(input): one add/compare per input element (mean's final divide, numel(out), is not
    counted; cumsum is a scan with the same count)."""
    return float(inputs[0].numel())


@register_flops(aten._softmax.default, aten._log_softmax.default)
def _softmax_flops(inputs: Tensors, outputs: Tensors) -> float:
    """5 * numel: per element max, x - max, exp, sum, then divide (softmax) or - log(sum) (log_softmax)."""
    return 5.0 * inputs[0].numel()


@register_flops(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def _softmax_backward_flops(inputs: Tensors, outputs: Tensors) -> float:
    """4 * numel: softmax dx = y * (g - sum(g * y)) (mul, sum, sub, mul);
    log_softmax dx = g - exp(y) * sum(g) (sum, exp, mul, sub)."""
    return 4.0 * inputs[0].numel()


@register_flops(aten.native_layer_norm.default)
def _layer_norm_flops(inputs: Tensors, outputs: Tensors) -> float:
    """8 * numel: mean (add), variance (sub, square, add), normalise (sub, mul by rstd), affine (mul, add)."""
    return 8.0 * inputs[0].numel()


@register_flops(aten.native_layer_norm_backward.default)
def _layer_norm_backward_flops(inputs: Tensors, outputs: Tensors) -> float:
    """13 * numel: xhat = (x - mean) * rstd (2), g*w (1), row sums of g*w and g*w*xhat (3),
    dx = rstd * (g*w - mean1 - xhat * mean2) (4), dw += g * xhat (2), db += g (1)."""
    return 13.0 * inputs[0].numel()


@register_flops(aten._fused_rms_norm.default, "autoplan.rms_norm.default")
def _rms_norm_flops(inputs: Tensors, outputs: Tensors) -> float:
    """4 * numel: square, sum, mul by rstd, mul by weight (``autoplan::rms_norm``, passes/fused_norm.py,
    the same math; its bytes are its eager kernels', :func:`_eager_rms_norm_bytes`)."""
    return 4.0 * inputs[0].numel()


def _eager_rms_norm_bytes(x: torch.Tensor, *, backward: bool) -> float:
    """Bytes ``autoplan::rms_norm`` (or its backward) moves as it runs: the op keeps only ``x`` and
    ``rstd`` for the backward (its memory is a fused kernel's), but its body is Hugging Face's
    eager math, one elementwise kernel per line of ``passes/fused_norm.py`` (``n`` elements of
    item size ``s``; a cast between fp32 and ``s`` moves ``4 + s`` per element, none when
    ``s = 4``; row-sized values left out)::

        forward   c + 8 (pow) + 4 (mean) + 8 (z = h * rstd) + c + 2 s (weight * n)
        backward  c + 8 (z) + c + 3 s (grad_y * n) + s (sum) + 2 s (grad_y * w) + c
                  + 12 (grad_z * h) + 4 (sum) + 8 (grad_z * rstd) + 8 (h * 2) + 8 + 12 (add) + c
        c = 4 + s if s < 4 else 0

    so a bf16 norm moves 36 B per element forward and 96 backward, where a fused kernel moves 4
    and 8: priced as the program runs it, not as Transformer Engine would (with one kernel's
    launch overhead, not the eight or fourteen it launches)."""
    s, n = x.element_size(), x.numel()
    c = 4 + s if s < 4 else 0
    if not backward:
        return float(n * (2 * c + 20 + 2 * s))
    return float(n * (4 * c + 60 + 6 * s))


@register_bytes("autoplan.rms_norm.default")
def _rms_norm_bytes(inputs: Tensors, outputs: Tensors) -> float:
    """:func:`_eager_rms_norm_bytes` of the forward."""
    return _eager_rms_norm_bytes(inputs[0], backward=False)


@register_bytes("autoplan.rms_norm_backward.default")
def _rms_norm_backward_bytes(inputs: Tensors, outputs: Tensors) -> float:
    """:func:`_eager_rms_norm_bytes` of the backward (inputs: grad_y, x, rstd, weight)."""
    return _eager_rms_norm_bytes(inputs[1], backward=True)


@register_flops(aten._fused_rms_norm_backward.default, "autoplan.rms_norm_backward.default")
def _rms_norm_backward_flops(inputs: Tensors, outputs: Tensors) -> float:
    """9 * numel: xhat = x * rstd (1), g*w (1), row sum of g*w*xhat (2),
    dx = rstd * (g*w - xhat * mean) (3), dw += g * xhat (2)."""
    return 9.0 * inputs[0].numel()


# --------------------------------------------------------------------------------------------
# Losses


@register_flops(aten.nll_loss_forward.default)
def _nll_loss_flops(inputs: Tensors, outputs: Tensors) -> float:
    """N = numel(target): one add per picked log-probability."""
    return float(inputs[1].numel())


@register_bytes(aten.nll_loss_forward.default)
def _nll_loss_bytes(inputs: Tensors, outputs: Tensors) -> float:
    """bytes = N * elem(log_probs) + target (+ N * elem(weight)) + outputs: only the target class of
    each of the N rows of log_probs (N, C) is read, not the whole (N, C)."""
    log_probs, target, *weight = inputs
    n = target.numel()
    picked = n * log_probs.element_size() + sum(n * w.element_size() for w in weight)
    return float(picked + tensor_bytes(target) + _sum_bytes(outputs))


@register_flops(aten.nll_loss_backward.default)
def _nll_loss_backward_flops(inputs: Tensors, outputs: Tensors) -> float:
    """N = numel(target): one scaled gradient written per row."""
    return float(inputs[2].numel())


@register_bytes(aten.nll_loss_backward.default)
def _nll_loss_backward_bytes(inputs: Tensors, outputs: Tensors) -> float:
    """bytes = grad_input (N, C) written (zero fill + scatter) + every input except ``self``
    (inputs[1], whose values are never read: grad_output, target, weight?, total_weight)."""
    return float(_sum_bytes(outputs) + _sum_bytes(inputs) - tensor_bytes(inputs[1]))


@register_flops(aten.mse_loss.default, aten.mse_loss_backward.default)
def _mse_loss_flops(inputs: Tensors, outputs: Tensors) -> float:
    """3 * numel: forward sub, square, sum; backward sub, mul by 2/N, mul by grad_output."""
    return 3.0 * inputs[-1].numel()


# Elementwise default (flops = numel(out), bytes = in + out), seen in the joint graphs of the
# example GPT-2 / Llama / MLP models: add, sub, mul, div, pow, neg, rsqrt, tanh, tanh_backward,
# silu, silu_backward, gelu, gelu_backward, sin, cos, eq, ne, le, bitwise_and, clone, _to_copy,
# cat, slice_backward.
