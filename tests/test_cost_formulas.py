"""Compute-cost formulas restated and checked: FLOPs and bytes per op family, matmul efficiency,
and the roofline (``autoplan.cost_models.compute``)."""

from __future__ import annotations

import math

import pytest
import torch

import autoplan.passes.attention  # noqa: F401 - registers the autoplan::sdpa ops and their FLOPs
from autoplan.cost_models.compute import (
    CPU_OP_OVERHEAD_US,
    GPU_KERNEL_OVERHEAD_US,
    MATMUL_EFFICIENCY,
    MEMORY_EFFICIENCY,
    Gemm,
    gemms_efficiency,
    is_matmul,
    local_gemm,
    matmul_asymptote,
    matmul_efficiency,
    matmul_shapes,
    op_bytes,
    op_flops,
    roofline_time_s,
)
from autoplan.cost_models.hardware import DeviceSpec, get_device_spec

aten = torch.ops.aten
H100 = get_device_spec("H100")
H100_CAP = matmul_asymptote(H100, torch.bfloat16)  # measured large-GEMM fraction of the bf16 peak
CPU = get_device_spec("CPU")
H100_BF16_PEAK = 989.4e12  # Hopper whitepaper, dense BF16
H100_MEM_BW = 3350e9  # H100 datasheet, SXM HBM3


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


# --- Matmuls ------------------------------------------------------------------------------------


def test_matmul_flops_count_two_per_multiply_accumulate_plus_the_bias() -> None:
    m, k, n, b = 64, 128, 32, 4
    a, w, out = meta(m, k), meta(k, n), meta(m, n)
    # mm (M,K)@(K,N): 2*M*K*N
    assert op_flops(aten.mm.default, [a, w], [out]) == pytest.approx(2 * m * k * n)
    # addmm(bias, A, B): 2*M*K*N + M*N (bias added once per output element)
    assert op_flops(aten.addmm.default, [meta(n), a, w], [out]) == pytest.approx(2 * m * k * n + m * n)
    # bmm (B,M,K)@(B,K,N): 2*B*M*K*N
    x, y, z = meta(b, m, k), meta(b, k, n), meta(b, m, n)
    assert op_flops(aten.bmm.default, [x, y], [z]) == pytest.approx(2 * b * m * k * n)
    # baddbmm(self, A, B): 2*B*M*K*N + B*M*N
    assert op_flops(aten.baddbmm.default, [z, x, y], [z]) == pytest.approx(2 * b * m * k * n + b * m * n)
    # linear(x (b, m, K), weight (N, K), bias): 2*(b*m)*K*N + (b*m)*N
    lin_out = meta(b, m, n)
    assert op_flops(aten.linear.default, [x, meta(n, k), meta(n)], [lin_out]) == pytest.approx(
        2 * b * m * k * n + b * m * n
    )
    assert op_flops(aten.linear.default, [x, meta(n, k)], [lin_out]) == pytest.approx(2 * b * m * k * n)


def test_matmul_bytes_are_both_operands_the_bias_and_the_result() -> None:
    m, k, n = 64, 128, 32
    a, w, out = meta(m, k, dtype=torch.bfloat16), meta(k, n, dtype=torch.bfloat16), meta(m, n, dtype=torch.bfloat16)
    # bytes = (M*K + K*N + M*N) * 2 (bf16); addmm adds the bias N * 2
    assert op_bytes(aten.mm.default, [a, w], [out]) == (m * k + k * n + m * n) * 2
    bias = meta(n, dtype=torch.bfloat16)
    assert op_bytes(aten.addmm.default, [bias, a, w], [out]) == (m * k + k * n + m * n + n) * 2


def test_is_matmul_means_matmul_and_fused_attention_only() -> None:
    for op in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.linear.default):
        assert is_matmul(op), op
    assert is_matmul(torch.ops.autoplan.sdpa.default) and is_matmul(torch.ops.autoplan.sdpa_backward.default)
    # ops with registered FLOP formulas are not matmuls for that
    for op in (aten._softmax.default, aten.native_layer_norm.default, aten.add.Tensor, aten.view.default):
        assert not is_matmul(op), op


# --- Attention (autoplan::sdpa, formulas in passes/attention.py) --------------------------------


def test_attention_flops_are_4_btsd_forward_and_12_btsd_backward() -> None:
    b, h, t, s, d = 2, 8, 128, 256, 64
    q, k, v, o = meta(b, h, t, d), meta(b, h, s, d), meta(b, h, s, d), meta(b, h, t, d)
    # forward: Q K^T and P V, 2*T*S*D each, per (batch, head): 4*B*H*T*S*D
    fwd = op_flops(torch.ops.autoplan.sdpa.default, [q, k, v], [o])
    assert fwd == pytest.approx(4 * b * h * t * s * d)
    # backward: recomputed forward 4*B*H*T*S*D + dQ, dK, dV, dP 8*B*H*T*S*D = 12*B*H*T*S*D
    bwd = op_flops(torch.ops.autoplan.sdpa_backward.default, [o, q, k, v], [q, k, v])
    assert bwd == pytest.approx(12 * b * h * t * s * d)
    # the GEMMs the efficiency is taken from carry the same FLOPs
    fwd_gemms = matmul_shapes(torch.ops.autoplan.sdpa.default, [q, k, v], [o])
    assert fwd_gemms == (Gemm(b * h, t, d, s), Gemm(b * h, t, s, d))
    assert sum(g.flops for g in fwd_gemms) == pytest.approx(fwd)
    bwd_gemms = matmul_shapes(torch.ops.autoplan.sdpa_backward.default, [o, q, k, v], [q, k, v])
    assert sum(g.flops for g in bwd_gemms) == pytest.approx(bwd)


def test_attention_moves_q_k_v_and_o_once_not_the_score_matrix() -> None:
    b, h, t, d = 2, 8, 1024, 64
    q = meta(b, h, t, d, dtype=torch.bfloat16)
    # flash-style traffic: (Q + K + V + O) * 2 bytes; the (T, T) scores stay on chip
    assert op_bytes(torch.ops.autoplan.sdpa.default, [q, q, q], [q]) == 4 * b * h * t * d * 2


def test_attention_time_uses_the_efficiency_of_its_gemms() -> None:
    b, h, t, d = 8, 16, 4096, 128
    q = meta(b, h, t, d, dtype=torch.bfloat16)
    time_s = roofline_time_s(torch.ops.autoplan.sdpa.default, [q, q, q], [q], H100)
    # S = Q K^T is (B*H) x (T,D)@(D,T): K = D = 128 is a short K loop; O = P V has K = T
    qk, pv = Gemm(b * h, t, d, t), Gemm(b * h, t, t, d)
    eff_qk = matmul_efficiency(t, d, t, H100, torch.bfloat16, batch=b * h)
    eff_pv = matmul_efficiency(t, t, d, H100, torch.bfloat16, batch=b * h)
    assert eff_qk < eff_pv == pytest.approx(H100_CAP)
    # efficiency of GEMMs run back to back: total FLOPs / sum(FLOPs_i / eff_i) (equal FLOPs here)
    eff = 2 / (1 / eff_qk + 1 / eff_pv)
    assert gemms_efficiency([qk, pv], H100, torch.bfloat16) == pytest.approx(eff)
    flops = 4 * b * h * t * t * d
    assert time_s == pytest.approx(flops / (H100_BF16_PEAK * eff) + GPU_KERNEL_OVERHEAD_US * 1e-6, rel=1e-6)


# --- Views, fills, gathers ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "op",
    [
        aten.view.default,
        aten._unsafe_view.default,
        aten.expand.default,
        aten.transpose.int,
        aten.t.default,
        aten.permute.default,
        aten.alias.default,
        aten.detach.default,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.slice.Tensor,
        aten.select.int,
        aten.split.Tensor,
    ],
)
def test_views_are_free_apart_from_the_per_op_overhead(op: object) -> None:
    x = meta(4096, 4096)
    # a view writes sizes/strides only: 0 FLOPs, 0 bytes, time = overhead
    assert op_flops(op, [x], [x]) == 0.0
    assert op_bytes(op, [x], [x]) == 0.0
    assert roofline_time_s(op, [x], [x], H100) == pytest.approx(GPU_KERNEL_OVERHEAD_US * 1e-6)
    assert roofline_time_s(op, [x], [x], CPU) == pytest.approx(CPU_OP_OVERHEAD_US * 1e-6)


def test_fills_write_their_output_and_do_not_read_their_template() -> None:
    x = meta(1024, 512)
    # ones_like(x): bytes = numel(out) * 4; x only supplies sizes and dtype
    assert op_bytes(aten.ones_like.default, [x], [x]) == 1024 * 512 * 4
    assert op_flops(aten.ones_like.default, [x], [x]) == 0.0


def test_embedding_reads_only_the_gathered_rows_not_the_table() -> None:
    vocab, dim, batch, seq = 50_000, 512, 8, 128
    table, ids, out = meta(vocab, dim), meta(batch, seq, dtype=torch.int64), meta(batch, seq, dim)
    # bytes = rows read (B*T*D*4) + ids (B*T*8) + rows written (B*T*D*4)
    expected = batch * seq * dim * 4 + batch * seq * 8 + batch * seq * dim * 4
    assert op_bytes(aten.embedding.default, [table, ids], [out]) == expected
    assert expected < vocab * dim * 4  # the 102 MB table is never streamed
    assert op_flops(aten.embedding.default, [table, ids], [out]) == 0.0


def test_embedding_backward_reads_the_gradient_and_writes_the_whole_table() -> None:
    vocab, dim, batch, seq = 50_000, 512, 8, 128
    grad, ids, table = meta(batch, seq, dim), meta(batch, seq, dtype=torch.int64), meta(vocab, dim)
    # bytes = grad (B*T*D*4) + ids (B*T*8) + zero-filled table written (V*D*4)
    expected = batch * seq * dim * 4 + batch * seq * 8 + vocab * dim * 4
    assert op_bytes(aten.embedding_dense_backward.default, [grad, ids], [table]) == expected
    # one add per gradient element
    assert op_flops(aten.embedding_dense_backward.default, [grad, ids], [table]) == batch * seq * dim


# --- Reductions, normalisations, losses ---------------------------------------------------------


def test_softmax_costs_5_flops_per_element_and_its_backward_4() -> None:
    x = meta(32, 1024)
    numel = 32 * 1024
    # softmax/log_softmax: max, x - max, exp, sum, divide (or - log(sum)) = 5 per element
    assert op_flops(aten._softmax.default, [x], [x]) == 5 * numel
    assert op_flops(aten._log_softmax.default, [x], [x]) == 5 * numel
    # backward: y * (g - sum(g*y)) / g - exp(y) * sum(g) = 4 per element
    assert op_flops(aten._softmax_backward_data.default, [x, x], [x]) == 4 * numel
    assert op_flops(aten._log_softmax_backward_data.default, [x, x], [x]) == 4 * numel
    # bytes: read x once, write y once
    assert op_bytes(aten._softmax.default, [x], [x]) == 2 * numel * 4


def test_layer_norm_costs_8_flops_per_element_forward_and_13_backward() -> None:
    rows, dim = 64, 768
    x, w, stat = meta(rows, dim), meta(dim), meta(rows, 1)
    # forward: mean (1), variance (3), normalise (2), affine (2) = 8 per element
    assert op_flops(aten.native_layer_norm.default, [x, w, w], [x, stat, stat]) == 8 * rows * dim
    # bytes: x, weight, bias read; y, mean, rstd written
    assert (
        op_bytes(aten.native_layer_norm.default, [x, w, w], [x, stat, stat])
        == (2 * rows * dim + 2 * dim + 2 * rows) * 4
    )
    # backward: xhat (2), g*w (1), two row sums (3), dx (4), dw (2), db (1) = 13 per element
    bwd_in = [x, x, stat, stat, w, w]
    assert op_flops(aten.native_layer_norm_backward.default, bwd_in, [x, w, w]) == 13 * rows * dim


def test_reductions_count_one_flop_per_input_element() -> None:
    x, out = meta(64, 1024), meta(64)
    # sum over dim 1: 64*1024 adds; bytes = in + out
    assert op_flops(aten.sum.dim_IntList, [x], [out]) == 64 * 1024
    assert op_flops(aten.mean.dim, [x], [out]) == 64 * 1024
    assert op_bytes(aten.sum.dim_IntList, [x], [out]) == (64 * 1024 + 64) * 4


def test_nll_loss_reads_one_log_probability_per_row() -> None:
    n, c = 4096, 50_000
    logp, target, loss = meta(n, c), meta(n, dtype=torch.int64), meta()
    # bytes = N picked log-probs * 4 + target N * 8 + (loss, total_weight) written
    assert op_bytes(aten.nll_loss_forward.default, [logp, target], [loss, loss]) == n * 4 + n * 8 + 2 * 4
    assert op_flops(aten.nll_loss_forward.default, [logp, target], [loss, loss]) == n
    # backward writes the full (N, C) gradient but never reads the log-probs: grad_input + grad_out
    # + target + total_weight
    bwd_bytes = op_bytes(aten.nll_loss_backward.default, [loss, logp, target, loss], [logp])
    assert bwd_bytes == n * c * 4 + 4 + n * 8 + 4


def test_unregistered_ops_are_elementwise_one_flop_per_output_element() -> None:
    x, bias = meta(256, 1024), meta(1024)
    # add(x, bias): flops = numel(out); bytes = x + bias + out
    assert op_flops(aten.add.Tensor, [x, bias], [x]) == 256 * 1024
    assert op_bytes(aten.add.Tensor, [x, bias], [x]) == (2 * 256 * 1024 + 1024) * 4


# --- Matmul efficiency --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_big_square_matmul_reaches_the_efficiency_cap_on_gpus(dtype: torch.dtype) -> None:
    # 8192^3: 64*64 = 4096 tiles of 128x128 on 132 SMs (31.03 waves: 97%), K = 8192 saturated
    # the cap is the device's measured asymptote for the dtype (bf16), the default for float32
    assert matmul_efficiency(8192, 8192, 8192, H100, dtype) == matmul_asymptote(H100, dtype)
    for name in ("A100-80GB", "H200", "B200"):
        device = get_device_spec(name)
        assert matmul_efficiency(8192, 8192, 8192, device, dtype) == matmul_asymptote(device, dtype)
    if dtype == torch.float32:
        assert matmul_asymptote(H100, dtype) == MATMUL_EFFICIENCY


def test_tiny_matmul_is_far_below_the_cap() -> None:
    # 64^3 on an H100: one quarter-filled tile (64*64 / 128^2 = 0.25) for 132 SMs. Split-K
    # helps most at s = 16: 16 blocks on 132 SMs, each with a K loop of 64/16 = 4 against a fixed
    # cost of 256 B / 2 B = 128 (bf16)
    eff = matmul_efficiency(64, 64, 64, H100, torch.bfloat16)
    tile_util, wave_util, k_util = 0.25, 16 / 132, 4 / (4 + 128)
    assert eff == pytest.approx(H100_CAP * tile_util * wave_util * k_util / 0.9)
    assert eff < 0.1 * H100_CAP
    # on a CPU only the size term applies: reuse = 2*64^3 / (3*64^2) = 42.7 FLOPs per element
    reuse = 2 * 64**3 / (3 * 64**2)
    assert matmul_efficiency(64, 64, 64, CPU) == pytest.approx(MATMUL_EFFICIENCY * reuse / (reuse + 32) / 0.9)


@pytest.mark.parametrize("device", [H100, CPU], ids=str)
def test_efficiency_grows_with_size_up_to_the_cap(device: DeviceSpec) -> None:
    # powers of two, where the tile count is a power of two: between them wave quantisation makes
    # the curve a sawtooth (see test_one_tile_more_than_sms_costs_a_second_wave)
    effs = [matmul_efficiency(n, n, n, device, torch.bfloat16) for n in (2**i for i in range(4, 14))]
    assert all(a <= b for a, b in zip(effs, effs[1:], strict=False)), effs
    assert effs[0] < effs[-1] == matmul_asymptote(device, torch.bfloat16)


def _compute_s(m: int, k: int, n: int) -> float:
    # compute time = 2*M*K*N / (peak * efficiency)
    return 2 * m * k * n / (H100_BF16_PEAK * matmul_efficiency(m, k, n, H100, torch.bfloat16))


def test_tile_quantisation_makes_m_129_cost_as_much_as_m_256_on_a_gpu() -> None:
    # M = 129 needs two 128-row tiles, like M = 256: the same tiles and waves, half of them padding
    assert _compute_s(129, 4096, 4096) == pytest.approx(_compute_s(256, 4096, 4096), rel=0.02)
    # on a CPU there are no tiles: the time grows with M
    cpu_129 = 2 * 129 * 4096**2 / matmul_efficiency(129, 4096, 4096, CPU)
    cpu_256 = 2 * 256 * 4096**2 / matmul_efficiency(256, 4096, 4096, CPU)
    assert cpu_129 < 0.6 * cpu_256


def test_one_tile_more_than_sms_costs_a_second_wave() -> None:
    # N = 132 tiles of 128 fill the 132 SMs once; 133 tiles need two waves, the second 1/132 full
    one_wave = _compute_s(128, 4096, 128 * 132)
    two_waves = _compute_s(128, 4096, 128 * 133)
    assert two_waves > 1.8 * one_wave


def test_sharded_work_is_costed_at_the_efficiency_of_the_local_gemm() -> None:
    # local GEMM: the batch is split first, the rest of the divisor splits the largest of M, N, K
    assert local_gemm(Gemm(16, 512, 64, 512), 4) == Gemm(4, 512, 64, 512)
    assert local_gemm(Gemm(2, 512, 64, 256), 8) == Gemm(1, 128, 64, 256)
    assert local_gemm(Gemm(1, 1024, 4096, 2048), 8) == Gemm(1, 1024, 512, 2048)
    # (2048, 1024) @ (1024, 1024) split 8 ways is (256, 1024) @ (1024, 1024) per device: 16 tiles
    # instead of 128 for 132 SMs, so the compute time drops by 8 * eff(local) / eff(full) (about
    # 4.5), not by 8
    a, b = meta(2048, 1024, dtype=torch.bfloat16), meta(1024, 1024, dtype=torch.bfloat16)
    out = meta(2048, 1024, dtype=torch.bfloat16)
    overhead_s = GPU_KERNEL_OVERHEAD_US * 1e-6
    full_s = roofline_time_s(aten.mm.default, [a, b], [out], H100) - overhead_s
    split_s = roofline_time_s(aten.mm.default, [a, b], [out], H100, work_divisor=8) - overhead_s
    eff_full = matmul_efficiency(2048, 1024, 1024, H100, torch.bfloat16)
    eff_local = matmul_efficiency(256, 1024, 1024, H100, torch.bfloat16)
    assert full_s / split_s == pytest.approx(8 * eff_local / eff_full)
    assert full_s / split_s < 5


def test_gemms_too_small_to_fill_the_sms_split_k() -> None:
    # (128, 16384) @ (16384, 128): a single output tile; split-K 16 runs 16 blocks of K = 1024
    # (the most split-K considers), each with the fixed cost of 128 (bf16)
    eff = matmul_efficiency(128, 16384, 128, H100, torch.bfloat16)
    assert eff == pytest.approx(H100_CAP * (16 / 132) * (1024 / (1024 + 128)) / 0.9)
    # no split-K once the tiles fill the SMs: 132 tiles run K = 16384 in one wave
    assert matmul_efficiency(128, 16384, 128 * 132, H100, torch.bfloat16) == H100_CAP


# --- Roofline -----------------------------------------------------------------------------------


def test_roofline_is_memory_bound_for_elementwise_ops() -> None:
    x = meta(4096, 4096, dtype=torch.bfloat16)
    time_s = roofline_time_s(aten.mul.Tensor, [x, x], [x], H100)
    # bytes = 3 * 4096^2 * 2 at 80% of 3.35 TB/s, + 4 us launch
    nbytes = 3 * 4096**2 * 2
    assert time_s == pytest.approx(nbytes / (H100_MEM_BW * MEMORY_EFFICIENCY) + 4e-6)


def test_roofline_is_compute_bound_for_big_matmuls() -> None:
    a = meta(8192, 8192, dtype=torch.bfloat16)
    time_s = roofline_time_s(aten.mm.default, [a, a], [a], H100)
    # 2*8192^3 / (989.4 TFLOP/s * 0.803) + 4 us, well above the 3 * 8192^2 * 2 bytes of traffic
    flops, nbytes = 2 * 8192**3, 3 * 8192**2 * 2
    assert time_s == pytest.approx(flops / (H100_BF16_PEAK * H100_CAP) + 4e-6)
    assert flops / (H100_BF16_PEAK * H100_CAP) > 5 * nbytes / (H100_MEM_BW * MEMORY_EFFICIENCY)


def test_roofline_caches_by_shape_and_dtype_not_by_tensor() -> None:
    a, b = meta(300, 200), meta(200, 100)
    first = roofline_time_s(aten.mm.default, [a, b], [meta(300, 100)], CPU)
    again = roofline_time_s(aten.mm.default, [meta(300, 200), meta(200, 100)], [meta(300, 100)], CPU)
    half = roofline_time_s(aten.mm.default, [a, b], [meta(300, 100, dtype=torch.bfloat16)], CPU)
    assert first == again and not math.isclose(first, half)


# --- Device constants ---------------------------------------------------------------------------


def test_gpu_sm_counts_come_from_the_catalog_and_devices_without_one_still_load() -> None:
    # A100 108, H100 SXM5 132, H200 132, B200 148 SMs (sources in cost_models/hardware.py)
    counts = {name: get_device_spec(name).num_sms for name in ("A100-80GB", "H100", "H200", "B200", "CPU")}
    assert counts == {"A100-80GB": 108, "H100": 132, "H200": 132, "B200": 148, "CPU": None}
    data = H100.to_dict()
    del data["num_sms"]
    custom = DeviceSpec.from_dict({**data, "name": "my-gpu"})
    assert custom.num_sms is None
    # without an SM count the wave term (and split-K) is left out: 8 tiles cost like a full wave
    assert matmul_efficiency(128, 8192, 1024, custom, torch.bfloat16) == H100_CAP
