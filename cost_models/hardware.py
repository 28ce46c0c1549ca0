"""Device catalog: peak compute, memory and interconnect numbers per accelerator.

Every number is the vendor's published *dense* (non-sparse) figure and cites its datasheet or
whitepaper in ``DeviceSpec.sources``. Latencies are not published by vendors; they are modelling
assumptions (stated as such in ``sources``) until ``autoplan calibrate`` measures them.

Units follow the names: ``*_GBps`` is 1e9 bytes per second, ``*_us`` microseconds, FLOP/s is
floating-point operations per second (a multiply-add counts as 2). Interconnect bandwidths are
*per device and unidirectional*: NVIDIA quotes NVLink as the bidirectional total (e.g. 900 GB/s
on H100), so the catalog stores half of it.

Memory capacities are the marketed decimal capacity (80 GB = 80e9 bytes). The card carries
more (an A100 80GB has 80 GiB of HBM2e, 81,920 MiB in ``nvidia-smi``; an H100 80GB shows
81,559 MiB), the driver keeps some and the CUDA context and NCCL take some: the memory model
derives what PyTorch can allocate from these numbers
(:func:`autoplan.cost_models.memory.usable_memory_bytes`, with its sources).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar

from autoplan.cost_models.echo import clip
from autoplan.cost_models.errors import ClusterSpecError, UnknownDeviceError

if TYPE_CHECKING:  # device specs are read from plan files by the review commands, without torch
    import torch

logger = logging.getLogger(__name__)

PEAK_FLOPS_KEYS: tuple[str, ...] = (
    "float64",
    "float32",
    "tf32",
    "bfloat16",
    "float16",
    "float8_e4m3fn",
    "float8_e5m2",
)
"""Dtype names allowed as keys of ``DeviceSpec.peak_flops`` ("tf32" is float32 on tensor cores)."""

_DTYPE_ALIASES: Mapping[str, str] = {
    "float": "float32",
    "fp32": "float32",
    "double": "float64",
    "fp64": "float64",
    "bf16": "bfloat16",
    "half": "float16",
    "fp16": "float16",
    "fp8": "float8_e4m3fn",
}


_K = TypeVar("_K")
_V = TypeVar("_V")


class _ReadOnlyMapping(Mapping[_K, _V]):
    """An immutable, hashable, picklable ``dict`` copy, so a frozen ``DeviceSpec`` stays frozen."""

    __slots__ = ("_data", "_hash")

    def __init__(self, data: Mapping[_K, _V]) -> None:
        self._data = dict(data)
        self._hash: int | None = None

    def __getitem__(self, key: _K) -> _V:
        return self._data[key]

    def __iter__(self) -> Iterator[_K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:  # immutable: hashed once (clusters key the planner's caches)
        if self._hash is None:
            self._hash = hash(tuple(sorted(self._data.items())))
        return self._hash

    def __repr__(self) -> str:
        return repr(self._data)

    def __reduce__(self) -> tuple[type, tuple[dict[_K, _V]]]:
        return (type(self), (self._data,))


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSpec:
    """Published performance numbers of one accelerator (or one CPU rank)."""

    name: str
    """Canonical catalog name, e.g. ``"H100"``; custom devices may use any non-empty name."""
    peak_flops: Mapping[str, float]
    """Dense peak FLOP/s per dtype name (keys from ``PEAK_FLOPS_KEYS``; "float32" is required)."""
    mem_bw_GBps: float
    """Device memory (HBM/DRAM) bandwidth in GB/s (1e9 bytes/s)."""
    mem_capacity_bytes: int
    """Device memory capacity in bytes (marketed decimal capacity, see the module docstring)."""
    intra_node_bw_GBps: float
    """Per-device unidirectional bandwidth to peers in the same node (NVLink), GB/s."""
    intra_node_latency_us: float
    """Per-message latency of a collective step between peers in the same node, microseconds."""
    inter_node_bw_GBps: float
    """Per-device unidirectional network bandwidth across nodes (400 Gb/s NIC = 50 GB/s), GB/s."""
    inter_node_latency_us: float
    """Per-message latency of a collective step across nodes, microseconds."""
    sources: tuple[str, ...]
    """Citations (datasheet name + URL, or a stated assumption) for every number above."""
    num_sms: int | None = None
    """Streaming multiprocessors of a GPU: how many matmul output tiles run at once (the wave
    size of ``autoplan.cost_models.compute.matmul_efficiency``). ``None`` for CPUs and for GPUs whose count
    is not given; the wave term is then left out. Optional so older cluster files still load."""
    matmul_peak_fraction: Mapping[str, float] | None = None
    """Fraction of the dense peak (``peak_flops``) that the best-shaped large matmul reaches, per
    dtype name (keys from ``PEAK_FLOPS_KEYS``): the asymptote of the efficiency curve of
    ``autoplan.cost_models.compute.matmul_efficiency``, whose tile/wave terms give the shape
    dependence below it. A measured GEMM benchmark, cited in ``sources``. ``None`` (or a dtype
    without an entry): the compute model's default assumption, ``compute.MATMUL_EFFICIENCY``."""
    comm_compute_slowdown: float | None = None
    """Fraction by which compute slows down while a collective runs beside it on the same device
    (communication kernels take SMs and memory bandwidth): compute time is multiplied by
    ``1 + comm_compute_slowdown`` while overlapped. In [0, 1). A cited measurement for catalog
    GPUs; ``None`` where unknown (CPU ranks): ``autoplan calibrate`` measures it, and
    ``compute.concurrent_compute_factor`` treats ``None`` as no slowdown."""
    host_link_GBps: float | None = None
    """Achievable per-direction bandwidth between the device and host memory (PCIe), GB/s: what
    optimizer-state offload copies gradients and weights over. ``None``: the device's memory is
    the host's (CPU ranks), copies run at ``mem_bw_GBps``. Left out of :meth:`to_dict` when
    ``None``."""
    host_mem_bw_GBps: float | None = None
    """Host DRAM bandwidth one device's offloaded optimizer step gets, GB/s (the node's CPU memory
    bandwidth over its devices). ``None``: ``mem_bw_GBps`` (the device is the host). Left out of
    :meth:`to_dict` when ``None``."""
    op_overhead_us: float | None = None
    """Fixed time every op of the step adds beyond its roofline, microseconds (dispatch, kernel
    launch, the program's own interpreter time between ops): ``compute.op_overhead_s``. ``None``:
    the compute model's assumption (``compute.CPU_OP_OVERHEAD_US`` / ``GPU_KERNEL_OVERHEAD_US``);
    ``autoplan calibrate --from-profile`` fits it from a profiler trace. Left out of
    :meth:`to_dict` when ``None``."""

    def __post_init__(self) -> None:
        where = f"device {clip(self.name)}"
        if not isinstance(self.name, str) or not self.name.strip():
            raise ClusterSpecError(f"device name must be a non-empty string, got {clip(self.name)}")
        if not isinstance(self.peak_flops, Mapping) or "float32" not in self.peak_flops:
            raise ClusterSpecError(
                f"{where}: peak_flops must be a mapping with at least a 'float32' entry "
                f"(FLOP/s per dtype name), got {clip(self.peak_flops)}"
            )
        flops: dict[str, float] = {}
        for key, value in self.peak_flops.items():
            if key not in PEAK_FLOPS_KEYS:
                raise ClusterSpecError(
                    f"{where}: unknown peak_flops dtype {clip(key)}; use one of {', '.join(PEAK_FLOPS_KEYS)}"
                )
            flops[key] = _positive_float(value, f"{where}: peak_flops[{clip(key)}]")
        object.__setattr__(self, "peak_flops", _ReadOnlyMapping(flops))
        for name in (
            "mem_bw_GBps",
            "intra_node_bw_GBps",
            "intra_node_latency_us",
            "inter_node_bw_GBps",
            "inter_node_latency_us",
        ):
            object.__setattr__(self, name, _positive_float(getattr(self, name), f"{where}: {name}"))
        for name in ("host_link_GBps", "host_mem_bw_GBps"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _positive_float(getattr(self, name), f"{where}: {name}"))
        overhead: object = self.op_overhead_us
        if overhead is not None:
            if isinstance(overhead, bool) or not isinstance(overhead, (int, float)) or not 0.0 <= overhead < 1e6:
                raise ClusterSpecError(
                    f"{where}: op_overhead_us must be a non-negative number of microseconds below 1e6 "
                    f"(fixed time per op) or null, got {clip(overhead)}"
                )
            object.__setattr__(self, "op_overhead_us", float(overhead))
        capacity: object = self.mem_capacity_bytes
        if isinstance(capacity, float) and capacity.is_integer():
            capacity = int(capacity)
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
            raise ClusterSpecError(
                f"{where}: mem_capacity_bytes must be a positive integer number of bytes, "
                f"got {clip(self.mem_capacity_bytes)}"
            )
        object.__setattr__(self, "mem_capacity_bytes", capacity)
        num_sms: object = self.num_sms
        if isinstance(num_sms, float) and num_sms.is_integer():
            num_sms = int(num_sms)
        if num_sms is not None and (not isinstance(num_sms, int) or isinstance(num_sms, bool) or num_sms <= 0):
            raise ClusterSpecError(
                f"{where}: num_sms must be a positive integer (SMs per GPU) or null, got {clip(self.num_sms)}"
            )
        object.__setattr__(self, "num_sms", num_sms)
        if self.matmul_peak_fraction is not None:
            if not isinstance(self.matmul_peak_fraction, Mapping):
                raise ClusterSpecError(
                    f"{where}: matmul_peak_fraction must be a mapping of dtype name to a fraction of the "
                    f"dense peak in (0, 1], or null, got {clip(self.matmul_peak_fraction)}"
                )
            fractions: dict[str, float] = {}
            for key, value in self.matmul_peak_fraction.items():
                if key not in PEAK_FLOPS_KEYS:
                    raise ClusterSpecError(
                        f"{where}: unknown matmul_peak_fraction dtype {clip(key)}; use one of {', '.join(PEAK_FLOPS_KEYS)}"
                    )
                fraction = _positive_float(value, f"{where}: matmul_peak_fraction[{clip(key)}]")
                if fraction > 1.0:
                    raise ClusterSpecError(
                        f"{where}: matmul_peak_fraction[{clip(key)}] is {fraction:g}, more than the dense peak; "
                        "give the achieved fraction of peak_flops (e.g. 0.8 for 80%)"
                    )
                fractions[key] = fraction
            object.__setattr__(self, "matmul_peak_fraction", _ReadOnlyMapping(fractions))
        slowdown: object = self.comm_compute_slowdown
        if slowdown is not None:
            if isinstance(slowdown, bool) or not isinstance(slowdown, (int, float)) or not 0.0 <= slowdown < 1.0:
                raise ClusterSpecError(
                    f"{where}: comm_compute_slowdown must be a fraction in [0, 1) (0.1 = compute 10% slower "
                    f"while a collective runs beside it) or null, got {clip(slowdown)}"
                )
            object.__setattr__(self, "comm_compute_slowdown", float(slowdown))
        if isinstance(self.sources, str) or not isinstance(self.sources, (tuple, list)):
            raise ClusterSpecError(f"{where}: sources must be a list of citations, got {clip(self.sources)}")
        sources = tuple(self.sources)
        if not sources or not all(isinstance(s, str) and s.strip() for s in sources):
            raise ClusterSpecError(
                f"{where}: sources must cite at least one datasheet or state the assumption, got {clip(self.sources)}"
            )
        object.__setattr__(self, "sources", sources)

    def __str__(self) -> str:
        return self.name

    def peak_flops_for(self, dtype: torch.dtype | str) -> float:
        """Dense peak FLOP/s for matmuls in ``dtype``.

        ``torch.float32`` maps to "float32" (TF32 off); ask for "tf32" explicitly to get the
        tensor-core rate. A dtype the device has no entry for falls back to "float32".
        """
        key = _dtype_key(dtype)
        if key in self.peak_flops:
            return self.peak_flops[key]
        logger.debug("device %s has no peak_flops for %s; using float32", self.name, key)
        return self.peak_flops["float32"]

    def matmul_peak_fraction_for(self, dtype: torch.dtype | str) -> float | None:
        """``matmul_peak_fraction`` for matmuls in ``dtype`` (``None`` where none is given)."""
        if self.matmul_peak_fraction is None:
            return None
        return self.matmul_peak_fraction.get(_dtype_key(dtype))

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form; ``DeviceSpec.from_dict`` reads it back."""
        out: dict[str, Any] = {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None or f.name not in _HOST_FIELDS
        }
        out["peak_flops"] = dict(self.peak_flops)
        if self.matmul_peak_fraction is not None:
            out["matmul_peak_fraction"] = dict(self.matmul_peak_fraction)
        out["sources"] = list(self.sources)
        return out

    @classmethod
    def from_dict(
        cls,
        data: Mapping[str, Any],
        *,
        where: str = "device",
        origin: str | None = None,
    ) -> DeviceSpec:
        """Build a custom device from a mapping of all ``DeviceSpec`` fields.

        ``where`` prefixes every error message. ``sources`` may be omitted; it then cites
        ``origin`` (the file the numbers came from; defaults to ``where``).
        """
        if not isinstance(data, Mapping):
            raise ClusterSpecError(f"{where}: expected a mapping of DeviceSpec fields, got {clip(data)}")
        _check_keys(data, where=where)
        required = [name for name in DEVICE_SPEC_FIELDS if name != "sources" and name not in _OPTIONAL_FIELDS]
        missing = [name for name in required if name not in data]
        if missing:
            raise ClusterSpecError(
                f"{where}: custom device is missing {', '.join(missing)}; give every DeviceSpec "
                f"field ({', '.join(required)}) or use a catalog name with 'overrides'"
            )
        kwargs = dict(data)
        kwargs.setdefault("sources", (f"user-supplied numbers in {origin or where}",))
        return cls(**kwargs)

    def with_overrides(
        self,
        overrides: Mapping[str, Any],
        *,
        where: str = "overrides",
        origin: str | None = None,
    ) -> DeviceSpec:
        """Copy of this spec with some fields replaced.

        ``peak_flops`` overrides are merged per dtype; ``sources`` gains a line naming the
        overridden fields and ``origin`` (defaults to ``where``) unless ``sources`` itself is
        overridden. ``where`` prefixes every error message.
        """
        if not isinstance(overrides, Mapping):
            raise ClusterSpecError(
                f"{where}: expected a mapping of DeviceSpec fields to override, got {clip(overrides)}"
            )
        _check_keys(overrides, where=where)
        kwargs = self.to_dict()
        for key, value in overrides.items():
            if key == "peak_flops":
                if not isinstance(value, Mapping):
                    raise ClusterSpecError(
                        f"{where}: peak_flops must be a mapping of dtype name to FLOP/s, got {clip(value)}"
                    )
                kwargs["peak_flops"] = {**kwargs["peak_flops"], **value}
            else:
                kwargs[key] = value
        if "sources" not in overrides:
            changed = ", ".join(sorted(overrides))
            kwargs["sources"] = [
                *self.sources,
                f"{changed} overridden in {origin or where}",
            ]
        return DeviceSpec(**kwargs)


DEVICE_SPEC_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(DeviceSpec))
"""Names of the ``DeviceSpec`` fields, in declaration order (the keys of a device mapping)."""
_OPTIONAL_FIELDS: frozenset[str] = frozenset(f.name for f in fields(DeviceSpec) if f.default is not MISSING)
_HOST_FIELDS = frozenset({"host_link_GBps", "host_mem_bw_GBps", "op_overhead_us"})
"""Fields :meth:`DeviceSpec.to_dict` leaves out when ``None`` (device files and plans written
before they existed stay byte-identical)."""


def _check_keys(data: Mapping[str, Any], *, where: str) -> None:
    for key in data:
        if key not in DEVICE_SPEC_FIELDS:
            raise ClusterSpecError(
                f"{where}: unknown device key {clip(key)}; known keys: {', '.join(DEVICE_SPEC_FIELDS)}"
            )


def _positive_float(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        hint = ""
        if isinstance(value, str):
            hint = " (YAML reads '80e9' as a string: write 80000000000 or 8.0e+10)"
        raise ClusterSpecError(f"{what} must be a positive number, got {clip(value)}{hint}")
    return float(value)


def _dtype_key(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16``, ``"torch.bfloat16"``, ``"bf16"`` -> ``"bfloat16"`` (a ``torch.dtype``'s text
    is ``torch.<name>``, lower case, and no alias is such a name)."""
    key = str(dtype).strip().lower().removeprefix("torch.")
    return _DTYPE_ALIASES.get(key, key)


# --- Sources -------------------------------------------------------------------------------------

_A100_DATASHEET = (
    "NVIDIA A100 Tensor Core GPU datasheet (SXM column), "
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
_AMPERE_WHITEPAPER = (
    "NVIDIA A100 Tensor Core GPU Architecture whitepaper: the A100 (SXM4) has 108 SMs, "
    "https://images.nvidia.com/aem-dam/en-zz/Solutions/data-center/nvidia-ampere-architecture-whitepaper.pdf"
)
_DGX_A100_DATASHEET = (
    "NVIDIA DGX A100 datasheet: 8x single-port ConnectX-6 200 Gb/s HDR InfiniBand for compute, "
    "one per GPU, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/"
    "nvidia-dgx-a100-datasheet.pdf"
)
_H100_DATASHEET = (
    "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column; tensor-core numbers there are "
    "with sparsity), https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
)
_HOPPER_WHITEPAPER = (
    "NVIDIA H100 Tensor Core GPU Architecture whitepaper (Hopper), dense H100 SXM5 peak table, "
    "https://resources.nvidia.com/en-us-tensor-core/gtc22-whitepaper-hopper"
)
_HOPPER_SM_COUNT = (
    "Hopper whitepaper: the H100 SXM5 has 132 SMs; the H200 is the same GH100 SXM5 GPU with HBM3e "
    "(same peaks in its datasheet), so it has 132 SMs too"
)
_DGX_H100_H200_GUIDE = (
    "NVIDIA DGX H100/H200 User Guide, hardware overview: 8x ConnectX-7 400 Gb/s compute NICs, "
    "one per GPU, https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html"
)
_H200_DATASHEET = (
    "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column; tensor-core numbers there are with "
    "sparsity), https://www.nvidia.com/en-us/data-center/h200/"
)
_DGX_B200_DATASHEET = (
    "NVIDIA DGX B200 datasheet: 8x B200, 1,440 GB total GPU memory, 64 TB/s HBM3e, 14.4 TB/s "
    "aggregate NVLink, 8x ConnectX-7 400 Gb/s, https://resources.nvidia.com/en-us-dgx-systems/"
    "dgx-b200-datasheet"
)
_HGX_B200_SPECS = (
    "NVIDIA HGX platform page, HGX B200 specifications (8-GPU totals, tensor-core numbers with "
    "sparsity; dense is half), https://www.nvidia.com/en-us/data-center/hgx/"
)
_B200_SM_COUNT = (
    "B200 SM count 148 (2 dies x 74 SMs) is the multiProcessorCount CUDA reports for a B200; "
    "NVIDIA's B200 datasheets do not list it"
)
_GPU_LATENCY_ASSUMPTION = (
    "latencies are modelling assumptions, not vendor numbers: ~3 us per NCCL step over NVLink "
    "and ~10 us over InfiniBand/RoCE (order of nccl-tests small-message times); replace with "
    "`autoplan calibrate`"
)
_CPU_ASSUMPTION = (
    "conservative assumptions for one gloo rank on a 2-core VM, not measured: ~100 GFLOP/s "
    "fp32, 20 GB/s DRAM, 24 GiB, shared-memory/loopback gloo ~2 GB/s and 30 us, 10GbE "
    "(1.25 GB/s) and 50 us across nodes; replace with `autoplan calibrate`"
)

_MAMF_TABLE = (
    "S. Bekman, Machine Learning Engineering, compute/accelerator/README.md, 'Maximum Achievable "
    "Matmul FLOPS comparison table' (mamf-finder.py, bf16 and fp8 matmul, mean of 100 iterations, "
    "best shape of a sweep): A100 SXM 271.2 of 312 TFLOPS bf16 (86.9%); H100 SXM 794.5 of 989 "
    "(80.3%, 'H200 is the same'), fp8 1402.6 of 1979 (70.9%); H200 SXM fp8 1453.4 of 1979 (73.4%); "
    "B200 SXM 1745.0 of 2250 (77.6%), fp8 3432.5 of 4500 (76.3%), "
    "https://github.com/stas00/ml-engineering/tree/master/compute/accelerator; float16 is taken "
    "equal to bfloat16 (same tensor-core rate), an assumption"
)
_OVERLAP_SLOWDOWN = (
    "S. Lee et al., 'Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed "
    "Deep Learning: Performance and Power Implications', arXiv:2507.03114 (2025), abstract: compute "
    "overlapped with collectives slows down by 18.9% on average (max 40.0%) over GPT and Llama "
    "training on 4x A100 and 4x H100 (and MI250/MI210); B200 is not measured there, the same value "
    "is assumed"
)
_COMM_COMPUTE_SLOWDOWN = 0.189  # Lee et al. 2025, see _OVERLAP_SLOWDOWN

_PCIE_ACHIEVABLE_FRACTION = 0.8
"""Of a PCIe x16 link's theoretical per-direction rate, the part a pinned-memory copy reaches
(assumption, see ``_HOST_LINK``)."""
_HOST_LINK = (
    "host link (PCIe x16, per direction): A100 datasheet 'PCIe Gen4: 64 GB/s' and H100/H200 "
    "datasheets 'PCIe Gen5: 128 GB/s' (both directions together) -> 32 and 64 GB/s per way; B200: "
    "PCIe Gen5 x16 as the Hopper parts, 64 GB/s per way (assumption: the B200 pages cited here give "
    "no host-link figure). "
    "Achievable: 0.8 of that is an assumption (128b/130b encoding and TLP headers at a 256-byte "
    "payload leave ~86%; pinned cudaMemcpy is commonly measured near 80%); replace with a measurement"
)
_HOST_DRAM = (
    "host DRAM bandwidth per GPU: theoretical bandwidth of the DGX's CPUs over its 8 GPUs, times an "
    "assumed 0.8 achievable (STREAM-like) fraction: DGX A100 2x AMD EPYC 7742, 8 channels DDR4-3200 "
    "each (2 x 204.8 GB/s) -> 41 GB/s; DGX H100/H200 2x Intel Xeon Platinum 8480C, 8 channels "
    "DDR5-4800 each (2 x 307.2 GB/s) -> 61 GB/s; DGX B200 2x Intel Xeon Platinum 8570, 8 channels "
    "DDR5-5600 each (2 x 358.4 GB/s) -> 72 GB/s (DGX A100/H100/B200 datasheets for the CPUs; "
    "channel counts and DIMM speeds from the CPU vendors' product pages)"
)
_HOST_DRAM_FRACTION = 0.8  # assumption, see _HOST_DRAM
_A100_HOST_MEM_BW_GBPS = 2 * 204.8 / 8 * _HOST_DRAM_FRACTION  # see _HOST_DRAM
_HOPPER_HOST_MEM_BW_GBPS = 2 * 307.2 / 8 * _HOST_DRAM_FRACTION  # see _HOST_DRAM
_B200_HOST_MEM_BW_GBPS = 2 * 358.4 / 8 * _HOST_DRAM_FRACTION  # see _HOST_DRAM
_PCIE4_X16_GBPS = 32.0 * _PCIE_ACHIEVABLE_FRACTION  # A100 datasheet: PCIe Gen4 64 GB/s both ways
_PCIE5_X16_GBPS = 64.0 * _PCIE_ACHIEVABLE_FRACTION  # H100/H200 datasheets: PCIe Gen5 128 GB/s both ways

_NVLINK_LATENCY_US = 3.0  # assumption, see _GPU_LATENCY_ASSUMPTION
_NETWORK_LATENCY_US = 10.0  # assumption, see _GPU_LATENCY_ASSUMPTION

_A100_PEAK_FLOPS: Mapping[str, float] = {
    "float64": 19.5e12,  # A100 datasheet: FP64 Tensor Core 19.5 TFLOPS
    "float32": 19.5e12,  # A100 datasheet: FP32 19.5 TFLOPS
    "tf32": 156e12,  # A100 datasheet: TF32 Tensor Core 156 TFLOPS (312 with sparsity)
    "bfloat16": 312e12,  # A100 datasheet: BFLOAT16 Tensor Core 312 TFLOPS (624 with sparsity)
    "float16": 312e12,  # A100 datasheet: FP16 Tensor Core 312 TFLOPS (624 with sparsity)
}

_SUSTAINED_MATMUL = (
    "S. Bekman, Machine Learning Engineering, compute/accelerator/benchmarks/README.md, 'How MAMF "
    "and MSMF are defined': the MAMF table's rows are short bursts at the boost clock, while a "
    "training job runs at the clock its power limit allows under full load ('MSMF ... the steady "
    "rate under full load, which matches real training throughput'); 'How close it gets': five "
    "--search auto runs on an H200 gave MSMF 743-746 bf16 TFLOPS, against the MAMF table's 794.5 "
    "for H100 ('H200 is the same'): 0.938; B200 MSMF 1421-1428 against its 1745.0: 0.816. No A100 "
    "MSMF is published: the A100's matmul_peak_fraction is its MAMF row times Hopper's 0.938, the "
    "smaller of the two measured reductions (assumption)"
)
_HOPPER_SUSTAINED_OVER_MAMF = 745.0 / 794.5
"""Sustained (MSMF, H200, midpoint of 743-746) over burst (MAMF table, H100 = H200) bf16 matmul
rate: see ``_SUSTAINED_MATMUL``."""

_A100_MATMUL_PEAK_FRACTION: Mapping[str, float] = {
    # MAMF table: A100 SXM 271.2 / 312 TFLOPS (burst), sustained as _SUSTAINED_MATMUL says
    "bfloat16": 0.869 * _HOPPER_SUSTAINED_OVER_MAMF,
    "float16": 0.869 * _HOPPER_SUSTAINED_OVER_MAMF,  # assumption: as bfloat16 (same tensor-core rate)
}

_HOPPER_MATMUL_PEAK_FRACTION: Mapping[str, float] = {
    "bfloat16": 0.803,  # MAMF table: H100 SXM 794.5 / 989 TFLOPS ("H200 is the same")
    "float16": 0.803,  # assumption: as bfloat16 (same tensor-core rate)
    "float8_e4m3fn": 0.709,  # MAMF table: H100 SXM fp8 1402.6 / 1979 TFLOPS
}

_B200_MATMUL_PEAK_FRACTION: Mapping[str, float] = {
    "bfloat16": 0.776,  # MAMF table: B200 SXM 1745.0 / 2250 TFLOPS
    "float16": 0.776,  # assumption: as bfloat16 (same tensor-core rate)
    "float8_e4m3fn": 0.763,  # MAMF table: B200 SXM fp8 3432.5 / 4500 TFLOPS
}

_HOPPER_SXM_PEAK_FLOPS: Mapping[str, float] = {
    "float64": 66.9e12,  # Hopper whitepaper: FP64 Tensor Core 66.9 TFLOPS (datasheet: 67)
    "float32": 66.9e12,  # Hopper whitepaper: FP32 66.9 TFLOPS (datasheet: 67)
    "tf32": 494.7e12,  # Hopper whitepaper: TF32 494.7 dense (datasheet: 989 with sparsity)
    "bfloat16": 989.4e12,  # Hopper whitepaper: BF16 989.4 dense (datasheet: 1,979 with sparsity)
    "float16": 989.4e12,  # Hopper whitepaper: FP16 989.4 dense (datasheet: 1,979 with sparsity)
    "float8_e4m3fn": 1978.9e12,  # Hopper whitepaper: FP8 1,978.9 dense (datasheet: 3,958 sparse)
    "float8_e5m2": 1978.9e12,  # Hopper whitepaper: both FP8 formats run at the same rate
}

_B200_PEAK_FLOPS: Mapping[str, float] = {
    "float64": 37e12,  # HGX B200: FP64 Tensor Core 296 TFLOPS per 8 GPUs
    "float32": 75e12,  # HGX B200: FP32 600 TFLOPS per 8 GPUs
    "tf32": 1.125e15,  # HGX B200: TF32 18 PFLOPS per 8 GPUs with sparsity -> 2.25 / 2 dense
    "bfloat16": 2.25e15,  # HGX B200: FP16/BF16 36 PFLOPS per 8 GPUs with sparsity -> 4.5 / 2
    "float16": 2.25e15,  # HGX B200: FP16/BF16 36 PFLOPS per 8 GPUs with sparsity -> 4.5 / 2
    "float8_e4m3fn": 4.5e15,  # HGX B200: FP8 72 PFLOPS per 8 GPUs with sparsity -> 9 / 2 dense
    "float8_e5m2": 4.5e15,  # HGX B200: both FP8 formats run at the same rate
}

# --- Catalog -------------------------------------------------------------------------------------

_CATALOG_ENTRIES: tuple[DeviceSpec, ...] = (
    DeviceSpec(
        name="A100-40GB",
        peak_flops=_A100_PEAK_FLOPS,
        mem_bw_GBps=1555.0,  # A100 datasheet: 40GB HBM2, 1,555 GB/s
        mem_capacity_bytes=40 * 10**9,  # A100 datasheet: 40 GB HBM2
        intra_node_bw_GBps=300.0,  # A100 datasheet: NVLink 600 GB/s bidirectional -> 300 per way
        intra_node_latency_us=_NVLINK_LATENCY_US,
        inter_node_bw_GBps=25.0,  # DGX A100 datasheet: one 200 Gb/s HDR NIC per GPU = 25 GB/s
        inter_node_latency_us=_NETWORK_LATENCY_US,
        num_sms=108,  # Ampere whitepaper: A100 has 108 SMs
        matmul_peak_fraction=_A100_MATMUL_PEAK_FRACTION,
        comm_compute_slowdown=_COMM_COMPUTE_SLOWDOWN,
        host_link_GBps=_PCIE4_X16_GBPS,
        host_mem_bw_GBps=_A100_HOST_MEM_BW_GBPS,
        sources=(
            _A100_DATASHEET,
            _AMPERE_WHITEPAPER,
            _DGX_A100_DATASHEET,
            _GPU_LATENCY_ASSUMPTION,
            _MAMF_TABLE,
            _SUSTAINED_MATMUL,
            _OVERLAP_SLOWDOWN,
            _HOST_LINK,
            _HOST_DRAM,
        ),
    ),
    DeviceSpec(
        name="A100-80GB",
        peak_flops=_A100_PEAK_FLOPS,
        mem_bw_GBps=2039.0,  # A100 datasheet: 80GB HBM2e SXM, 2,039 GB/s
        mem_capacity_bytes=80 * 10**9,  # A100 datasheet: 80 GB HBM2e
        intra_node_bw_GBps=300.0,  # A100 datasheet: NVLink 600 GB/s bidirectional -> 300 per way
        intra_node_latency_us=_NVLINK_LATENCY_US,
        inter_node_bw_GBps=25.0,  # DGX A100 datasheet: one 200 Gb/s HDR NIC per GPU = 25 GB/s
        inter_node_latency_us=_NETWORK_LATENCY_US,
        num_sms=108,  # Ampere whitepaper: A100 has 108 SMs
        matmul_peak_fraction=_A100_MATMUL_PEAK_FRACTION,
        comm_compute_slowdown=_COMM_COMPUTE_SLOWDOWN,
        host_link_GBps=_PCIE4_X16_GBPS,
        host_mem_bw_GBps=_A100_HOST_MEM_BW_GBPS,
        sources=(
            _A100_DATASHEET,
            _AMPERE_WHITEPAPER,
            _DGX_A100_DATASHEET,
            _GPU_LATENCY_ASSUMPTION,
            _MAMF_TABLE,
            _SUSTAINED_MATMUL,
            _OVERLAP_SLOWDOWN,
            _HOST_LINK,
            _HOST_DRAM,
        ),
    ),
    DeviceSpec(
        name="H100",
        peak_flops=_HOPPER_SXM_PEAK_FLOPS,
        mem_bw_GBps=3350.0,  # H100 datasheet: SXM 3.35 TB/s HBM3
        mem_capacity_bytes=80 * 10**9,  # H100 datasheet: SXM 80 GB
        intra_node_bw_GBps=450.0,  # H100 datasheet: NVLink 900 GB/s bidirectional -> 450 per way
        intra_node_latency_us=_NVLINK_LATENCY_US,
        inter_node_bw_GBps=50.0,  # DGX H100 guide: one 400 Gb/s ConnectX-7 per GPU = 50 GB/s
        inter_node_latency_us=_NETWORK_LATENCY_US,
        num_sms=132,  # Hopper whitepaper: H100 SXM5 has 132 SMs
        matmul_peak_fraction=_HOPPER_MATMUL_PEAK_FRACTION,
        comm_compute_slowdown=_COMM_COMPUTE_SLOWDOWN,
        host_link_GBps=_PCIE5_X16_GBPS,
        host_mem_bw_GBps=_HOPPER_HOST_MEM_BW_GBPS,
        sources=(
            _H100_DATASHEET,
            _HOPPER_WHITEPAPER,
            _HOPPER_SM_COUNT,
            _DGX_H100_H200_GUIDE,
            _GPU_LATENCY_ASSUMPTION,
            _MAMF_TABLE,
            _OVERLAP_SLOWDOWN,
            _HOST_LINK,
            _HOST_DRAM,
        ),
    ),
    DeviceSpec(
        name="H200",
        # H200 datasheet lists the same SXM tensor-core peaks as H100 (1,979 TFLOPS BF16 with
        # sparsity), so the dense numbers are the Hopper whitepaper's.
        peak_flops=_HOPPER_SXM_PEAK_FLOPS,
        mem_bw_GBps=4800.0,  # H200 datasheet: SXM 4.8 TB/s HBM3e
        mem_capacity_bytes=141 * 10**9,  # H200 datasheet: SXM 141 GB HBM3e
        intra_node_bw_GBps=450.0,  # H200 datasheet: NVLink 900 GB/s bidirectional -> 450 per way
        intra_node_latency_us=_NVLINK_LATENCY_US,
        inter_node_bw_GBps=50.0,  # DGX H200 guide: one 400 Gb/s ConnectX-7 per GPU = 50 GB/s
        inter_node_latency_us=_NETWORK_LATENCY_US,
        num_sms=132,  # same GH100 SXM5 GPU as the H100, see _HOPPER_SM_COUNT
        # MAMF table: 'H200 is the same' in bf16; its fp8 row is 1453.4 / 1979 TFLOPS
        matmul_peak_fraction={**_HOPPER_MATMUL_PEAK_FRACTION, "float8_e4m3fn": 0.734},
        comm_compute_slowdown=_COMM_COMPUTE_SLOWDOWN,
        host_link_GBps=_PCIE5_X16_GBPS,
        host_mem_bw_GBps=_HOPPER_HOST_MEM_BW_GBPS,
        sources=(
            _H200_DATASHEET,
            _HOPPER_WHITEPAPER,
            _HOPPER_SM_COUNT,
            _DGX_H100_H200_GUIDE,
            _GPU_LATENCY_ASSUMPTION,
            _MAMF_TABLE,
            _OVERLAP_SLOWDOWN,
            _HOST_LINK,
            _HOST_DRAM,
        ),
    ),
    DeviceSpec(
        name="B200",
        peak_flops=_B200_PEAK_FLOPS,
        mem_bw_GBps=8000.0,  # DGX B200 datasheet: 64 TB/s HBM3e over 8 GPUs
        mem_capacity_bytes=180 * 10**9,  # DGX B200 datasheet: 1,440 GB over 8 GPUs
        intra_node_bw_GBps=900.0,  # DGX B200: 14.4 TB/s NVLink over 8 GPUs = 1.8 TB/s bidir
        intra_node_latency_us=_NVLINK_LATENCY_US,
        inter_node_bw_GBps=50.0,  # DGX B200 datasheet: one 400 Gb/s ConnectX-7 per GPU = 50 GB/s
        inter_node_latency_us=_NETWORK_LATENCY_US,
        num_sms=148,  # see _B200_SM_COUNT
        matmul_peak_fraction=_B200_MATMUL_PEAK_FRACTION,
        comm_compute_slowdown=_COMM_COMPUTE_SLOWDOWN,
        host_link_GBps=_PCIE5_X16_GBPS,
        host_mem_bw_GBps=_B200_HOST_MEM_BW_GBPS,
        sources=(
            _DGX_B200_DATASHEET,
            _HGX_B200_SPECS,
            _B200_SM_COUNT,
            _GPU_LATENCY_ASSUMPTION,
            _MAMF_TABLE,
            _OVERLAP_SLOWDOWN,
            _HOST_LINK,
            _HOST_DRAM,
        ),
    ),
    DeviceSpec(
        name="CPU",
        peak_flops={
            "float64": 50e9,  # assumption: half the fp32 rate
            "float32": 100e9,  # assumption: ~100 GFLOP/s fp32 GEMM per rank
            "tf32": 100e9,  # no TF32 on CPUs: same as float32
            "bfloat16": 50e9,  # assumption: no AMX, half-precision GEMM slower than fp32
            "float16": 50e9,  # assumption: as bfloat16
        },
        mem_bw_GBps=20.0,  # assumption: DRAM bandwidth available to one rank
        mem_capacity_bytes=24 * 2**30,  # assumption: 24 GiB per rank
        intra_node_bw_GBps=2.0,  # assumption: gloo over shared memory / loopback
        intra_node_latency_us=30.0,  # assumption: gloo per-message latency on loopback
        inter_node_bw_GBps=1.25,  # assumption: 10GbE = 1.25 GB/s
        inter_node_latency_us=50.0,  # assumption: TCP over 10GbE per-message latency
        sources=(_CPU_ASSUMPTION,),
    ),
)

DEVICE_CATALOG: Mapping[str, DeviceSpec] = _ReadOnlyMapping({spec.name: spec for spec in _CATALOG_ENTRIES})
"""Catalog devices by canonical name. Look names up with ``get_device_spec`` (aliases, any case)."""

DEVICE_ALIASES: Mapping[str, str] = {
    "H100-80GB": "H100",
    "H100-SXM": "H100",
    "A100": "A100-80GB",
    "H200-141GB": "H200",
}
"""Other names accepted by ``get_device_spec``, mapped to canonical catalog names."""

_LOOKUP: Mapping[str, str] = {
    **{name.lower(): name for name in DEVICE_CATALOG},
    **{alias.lower(): name for alias, name in DEVICE_ALIASES.items()},
}


def get_device_spec(name: str) -> DeviceSpec:
    """Catalog entry for ``name`` (case-insensitive; aliases such as "H100-SXM" accepted)."""
    canonical = _LOOKUP.get(str(name).strip().lower())
    if canonical is None:
        raise UnknownDeviceError(
            f"unknown device {clip(name)}; known devices: {', '.join(DEVICE_CATALOG)}; "
            "add an entry to cost_models/hardware.py or pass a DeviceSpec"
        )
    return DEVICE_CATALOG[canonical]
