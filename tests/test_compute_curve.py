"""The matmul efficiency curve per device, causal attention, and compute beside communication.

Cost formulas restated from their sources (cost_models/compute.py and hardware.py cite them):
the asymptote of the curve is the device's measured best large-GEMM fraction of peak (MAMF table),
its shape the tile/wave/K-loop model; causal attention does the FlashAttention-2 block fraction of
the work; compute overlapped with a collective is 18.9% slower on catalog GPUs (Lee et al. 2025).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoplan.passes.attention  # noqa: F401 - registers the autoplan::sdpa ops and their FLOPs
from autoplan.cost_models.compute import (
    MATMUL_EFFICIENCY,
    causal_block_fraction,
    concurrent_compute_factor,
    cost_key,
    is_matmul,
    matmul_asymptote,
    matmul_efficiency,
    op_bytes,
    op_flops,
    op_overhead_s,
    roofline_time_s,
)
from autoplan.cost_models.errors import ClusterSpecError
from autoplan.cost_models.hardware import DeviceSpec, get_device_spec
from autoplan.passes.trace import trace_training_step

aten = torch.ops.aten
SDPA = torch.ops.autoplan.sdpa.default
SDPA_BWD = torch.ops.autoplan.sdpa_backward.default
GPUS = ("A100-80GB", "H100", "H200", "B200")


def meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


# --- The curve ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "bf16"),
    # MAMF table (S. Bekman, ml-engineering): A100 SXM 271.2/312, H100 SXM 794.5/989 ("H200 is the
    # same"), B200 SXM 1745.0/2250 TFLOPS; the A100's burst row times the sustained/burst ratio
    # measured on Hopper (H200 MSMF 743-746 over 794.5, hardware._SUSTAINED_MATMUL)
    [
        ("A100-80GB", 0.869 * 745.0 / 794.5),
        ("A100-40GB", 0.869 * 745.0 / 794.5),
        ("H100", 0.803),
        ("H200", 0.803),
        ("B200", 0.776),
    ],
)
def test_large_matmul_reaches_the_measured_fraction_of_peak_of_its_device(name: str, bf16: float) -> None:
    device = get_device_spec(name)
    assert matmul_asymptote(device, torch.bfloat16) == pytest.approx(bf16, rel=1e-12)
    assert matmul_asymptote(device, torch.float16) == pytest.approx(bf16, rel=1e-12)
    assert matmul_efficiency(8192, 8192, 8192, device, torch.bfloat16) == pytest.approx(bf16)
    # a dtype without a measurement keeps the default assumption
    assert matmul_asymptote(device, torch.float32) == MATMUL_EFFICIENCY


def test_fp8_asymptotes_are_their_own_measurements() -> None:
    # MAMF fp8 rows: H100 1402.6/1979, H200 1453.4/1979, B200 3432.5/4500
    assert matmul_asymptote(get_device_spec("H100"), "float8_e4m3fn") == 0.709
    assert matmul_asymptote(get_device_spec("H200"), "float8_e4m3fn") == 0.734
    assert matmul_asymptote(get_device_spec("B200"), "float8_e4m3fn") == 0.763


@pytest.mark.parametrize("name", GPUS)
def test_efficiency_curve_is_monotone_in_size_and_saturates_at_the_asymptote(name: str) -> None:
    device = get_device_spec(name)
    sizes = [2**i for i in range(5, 15)]  # 32 .. 16384, powers of two (no quantisation sawtooth)
    effs = [matmul_efficiency(n, n, n, device, torch.bfloat16) for n in sizes]
    assert all(a <= b for a, b in zip(effs, effs[1:], strict=False)), effs
    assert effs[0] < 0.1 * effs[-1]
    assert effs[-1] == pytest.approx(matmul_asymptote(device, torch.bfloat16))


def test_skinny_matmul_is_below_a_square_one_of_the_same_work() -> None:
    h100 = get_device_spec("H100")
    # 2*64*8192*8192 = 2*2048*2048*1024 FLOPs: M = 64 fills half of each 128-row output tile
    square = matmul_efficiency(2048, 1024, 2048, h100, torch.bfloat16)
    skinny = matmul_efficiency(64, 8192, 8192, h100, torch.bfloat16)
    assert skinny < 0.6 * square


# (batch, M, N, K, measured bf16 FLOP/s) on an H100 (sm_90): XLA's default matmul performance
# table, openxla/xla xla/service/gpu/model/matmul_interpolator_data.h (copied in
# tensorflow/tensorflow third_party/xla), kDefaultMatmulPTable, key "sm_90", "bf16xbf16->bf16".
XLA_H100_BF16 = [
    (1, 4096, 4096, 4096, 783328793548203),
    (2, 4096, 4096, 4096, 807671014191940),
    (4, 4096, 4096, 4096, 793131337247852),
    (1, 4096, 4096, 2048, 738736406437117),
    (2, 2048, 2048, 4096, 756697425931839),
    (1, 4096, 1024, 4096, 738474431911967),
    (1, 2048, 2048, 2048, 631984593290170),
    (1, 4096, 512, 4096, 649964784503632),
    (1, 1024, 2048, 2048, 524288000000000),
    (1, 2048, 2048, 1024, 493901482980680),
    (1, 256, 4096, 4096, 412026793553338),
    (1, 1024, 1024, 2048, 349981037809648),
]


@pytest.mark.parametrize(("batch", "m", "n", "k", "measured_flops_per_s"), XLA_H100_BF16)
def test_h100_matmul_time_matches_xla_measured_table(
    batch: int, m: int, n: int, k: int, measured_flops_per_s: float
) -> None:
    """Predicted time (curve + 4 us launch) against a measured GEMM table: within 5% from 3e10
    FLOPs up (where the asymptote rules), within 25% below (the launch and ramp-up of small GEMMs).
    The former flat 70% cap was 14% too slow on the largest of these."""
    a, b, c = meta(batch, m, k), meta(batch, k, n), meta(batch, m, n)
    op = aten.bmm.default
    if batch == 1:
        a, b, c, op = a[0], b[0], c[0], aten.mm.default
    flops = 2 * batch * m * n * k
    predicted_s = roofline_time_s(op, [a, b], [c], get_device_spec("H100"))
    measured_s = flops / measured_flops_per_s
    tolerance = 0.05 if flops >= 3e10 else 0.25
    assert predicted_s == pytest.approx(measured_s, rel=tolerance)


def test_cpu_curve_is_unchanged_and_has_no_measured_asymptote() -> None:
    cpu = get_device_spec("CPU")
    assert cpu.matmul_peak_fraction is None and cpu.comm_compute_slowdown is None
    # the CPU formula as before: reuse = 2MKN / (MK + KN + MN), util = reuse / (reuse + 32), cap 0.7
    m = k = n = 512
    reuse = 2 * m * k * n / (m * k + k * n + m * n)
    expected = MATMUL_EFFICIENCY * min(1.0, reuse / (reuse + 32) / 0.9)
    assert matmul_efficiency(m, k, n, cpu) == pytest.approx(expected)


def test_device_spec_checks_and_round_trips_the_new_fields() -> None:
    h100 = get_device_spec("H100")
    again = DeviceSpec.from_dict(h100.to_dict())
    assert again == h100 and hash(again) == hash(h100)
    with pytest.raises(ClusterSpecError, match="more than the dense peak"):
        h100.with_overrides({"matmul_peak_fraction": {"bfloat16": 80.3}})
    with pytest.raises(ClusterSpecError, match="unknown matmul_peak_fraction dtype"):
        h100.with_overrides({"matmul_peak_fraction": {"bf17": 0.8}})
    with pytest.raises(ClusterSpecError, match=r"comm_compute_slowdown must be a fraction in \[0, 1\)"):
        h100.with_overrides({"comm_compute_slowdown": 1.5})
    custom = h100.with_overrides({"matmul_peak_fraction": None, "comm_compute_slowdown": None})
    assert matmul_asymptote(custom, torch.bfloat16) == MATMUL_EFFICIENCY
    assert concurrent_compute_factor(custom) == 1.0


# --- Compute beside communication ---------------------------------------------------------------


@pytest.mark.parametrize("name", GPUS)
def test_compute_beside_a_collective_is_slower_by_the_cited_fraction(name: str) -> None:
    # Lee et al. 2025 (arXiv:2507.03114): 18.9% average compute slowdown under overlap
    assert concurrent_compute_factor(get_device_spec(name)) == pytest.approx(1.189)


def test_cpu_has_no_slowdown_until_calibrated() -> None:
    cpu = get_device_spec("CPU")
    assert concurrent_compute_factor(cpu) == 1.0
    assert concurrent_compute_factor(cpu.with_overrides({"comm_compute_slowdown": 0.25})) == 1.25


# --- Causal attention ---------------------------------------------------------------------------


def test_causal_block_fraction_counts_the_tiles_on_and_below_the_diagonal() -> None:
    # T = S = 4 blocks: 1 + 2 + 3 + 4 = 10 of 16 tiles
    assert causal_block_fraction(512, 512, 128) == 10 / 16
    # -> 1/2 + 1/(2 nt) for long sequences
    assert causal_block_fraction(8192, 8192) == pytest.approx(0.5 + 1 / (2 * 64))
    # one block (short sequences): nothing to skip
    assert causal_block_fraction(64, 64) == 1.0
    # more queries than keys (top-left aligned): the last query blocks see every key block
    assert causal_block_fraction(1024, 512, 128) == (1 + 2 + 3 + 4 + 4 * 4) / 32


def _sdpa_args(causal: bool) -> tuple[object, ...]:
    # (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa); tensors stand in as None
    return (None, None, None, None, 0.0, causal, None, False)


def test_cost_key_names_the_causal_call() -> None:
    assert cost_key(SDPA, _sdpa_args(True)) == "autoplan.sdpa.default[causal]"
    assert cost_key(SDPA, _sdpa_args(False)) == "autoplan.sdpa.default"
    assert cost_key(SDPA, _sdpa_args(False)[:5], {"is_causal": True}) == "autoplan.sdpa.default[causal]"
    bwd_args = (None, *_sdpa_args(True))  # grad_out first
    assert cost_key(SDPA_BWD, bwd_args) == "autoplan.sdpa_backward.default[causal]"
    assert cost_key(aten.mm.default, (None, None)) == "aten.mm.default"
    assert is_matmul("autoplan.sdpa.default[causal]")


@pytest.mark.parametrize("t", [2048, 8192])
def test_causal_attention_is_priced_at_about_half_the_flops_and_time(t: int) -> None:
    b, h, d = 1, 32, 128
    q = meta(b, h, t, d)
    causal, full = cost_key(SDPA, _sdpa_args(True)), cost_key(SDPA, _sdpa_args(False))
    fraction = causal_block_fraction(t, t)
    assert 0.5 < fraction < 0.54
    assert op_flops(full, [q, q, q], [q]) == 4 * b * h * t * t * d
    assert op_flops(causal, [q, q, q], [q]) == pytest.approx(fraction * 4 * b * h * t * t * d)
    bwd_causal = cost_key(SDPA_BWD, (None, *_sdpa_args(True)))
    assert op_flops(bwd_causal, [q, q, q, q], [q, q, q]) == pytest.approx(fraction * 12 * b * h * t * t * d)
    # the bytes (Q, K, V read, O written) do not shrink
    assert op_bytes(causal, [q, q, q], [q]) == op_bytes(full, [q, q, q], [q])
    for device in (get_device_spec("A100-80GB"), get_device_spec("H100")):
        # compute bound: the time without the kernel launch scales with the FLOPs
        causal_s = roofline_time_s(causal, [q, q, q], [q], device) - op_overhead_s(device)
        full_s = roofline_time_s(full, [q, q, q], [q], device) - op_overhead_s(device)
        assert causal_s / full_s == pytest.approx(fraction)


# --- Traced masks -------------------------------------------------------------------------------

SEQ, HEADS, DIM = 16, 2, 8


class _MaskedAttention(nn.Module):
    """Attention with a mask built from ``arange`` in ``forward``, as Hugging Face builds it when
    traced: causal, or a sliding window of 4 keys (not causal)."""

    def __init__(self, window: int | None) -> None:
        super().__init__()
        self.proj = nn.Linear(HEADS * DIM, 3 * HEADS * DIM)
        self.window = window

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, HEADS, DIM).transpose(1, 2) for z in self.proj(x).chunk(3, dim=-1))
        pos = torch.arange(t, device=x.device)
        mask = pos[None, :] <= pos[:, None]  # (T, S): key s visible to query t when s <= t
        if self.window is not None:
            mask = mask & (pos[:, None] - pos[None, :] < self.window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None].expand(b, 1, t, t))


def _sdpa_nodes(window: int | None) -> list[tuple[object, ...]]:
    traced = trace_training_step(
        _MaskedAttention(window), (torch.randn(2, SEQ, HEADS * DIM),), loss_fn=lambda out: out.square().mean()
    )
    targets = (SDPA, SDPA_BWD)
    return [tuple(n.args) for n in traced.graph_module.graph.nodes if n.target in targets]


def test_traced_constant_causal_mask_becomes_is_causal() -> None:
    nodes = _sdpa_nodes(window=None)
    assert len(nodes) == 2
    fwd, bwd = nodes
    assert fwd[3] is None and fwd[5] is True  # attn_mask, is_causal
    assert bwd[4] is None and bwd[6] is True
    assert cost_key(SDPA, fwd) == "autoplan.sdpa.default[causal]"


def test_traced_sliding_window_mask_is_kept() -> None:
    fwd, bwd = _sdpa_nodes(window=4)
    assert fwd[3] is not None and fwd[5] is False
    assert cost_key(SDPA, fwd) == "autoplan.sdpa.default"


@pytest.mark.parametrize("window", [None, SEQ - 1])
def test_mask_checked_in_blocks_of_rows_sees_every_row(monkeypatch: pytest.MonkeyPatch, window: int | None) -> None:
    """One query row per block (the block size made tiny): the causal mask still becomes the flag,
    and a window of SEQ - 1 keys, which differs from causal in the last row only (query 15 does
    not see key 0), is kept."""
    monkeypatch.setattr(autoplan.passes.attention, "MASK_BLOCK_BYTES", 1)
    monkeypatch.setattr(autoplan.passes.attention, "_VERDICTS", {})
    fwd, _ = _sdpa_nodes(window=window)
    assert (fwd[3] is None and fwd[5] is True) == (window is None)


def test_long_context_hugging_face_mask_becomes_is_causal() -> None:
    """A Hugging Face Llama traced at 16k tokens on meta: its mask (16k x 16k, built per batch
    element) is checked in blocks of rows, never whole (the former check evaluated the mask's
    subgraph at once and gave up past 1 GiB, so long sequences were priced as non-causal
    attention, twice the FLOPs, with a T x T mask held on every device)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    seq = 16384
    config = LlamaConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=seq, use_cache=False,
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        ids = torch.zeros(2, seq, dtype=torch.long)
    traced = trace_training_step(
        model, (ids,), loss_fn=lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten()), example_targets=(ids,)
    )
    calls = [n for n in traced.graph_module.graph.nodes if n.target in (SDPA, SDPA_BWD)]
    assert len(calls) == 2
    assert all(n.kwargs.get("is_causal", n.args[5 if n.target is SDPA else 6]) is True for n in calls)
    assert all(n.args[3 if n.target is SDPA else 4] is None for n in calls)
