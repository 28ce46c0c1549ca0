"""Cost formulas restated and checked, and the placement-transition table."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.comm import collective_time_s, plan_transition, transition_cost_s
from autoplan.cost_models.compute import op_flops, roofline_time_s
from autoplan.cost_models.hardware import get_device_spec
from autoplan.cost_models.memory import param_training_bytes
from autoplan.passes.placement import local_numel, parse_spec, placement_str, spec_str

aten = torch.ops.aten
R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial("sum")


def test_matmul_flops_are_two_per_multiply_accumulate() -> None:
    a, b = torch.empty(64, 128, device="meta"), torch.empty(128, 32, device="meta")
    out = torch.empty(64, 32, device="meta")
    # (M,K)@(K,N): 2*M*K*N
    assert op_flops(aten.mm.default, [a, b], [out]) == pytest.approx(2 * 64 * 128 * 32)
    # addmm adds the bias once per output element: + M*N
    bias = torch.empty(32, device="meta")
    assert op_flops(aten.addmm.default, [bias, a, b], [out]) == pytest.approx(2 * 64 * 128 * 32 + 64 * 32)
    # bmm (B,M,K)@(B,K,N): 2*B*M*K*N
    x, y = torch.empty(4, 16, 8, device="meta"), torch.empty(4, 8, 2, device="meta")
    assert op_flops(aten.bmm.default, [x, y], [torch.empty(4, 16, 2, device="meta")]) == pytest.approx(
        2 * 4 * 16 * 8 * 2
    )


def test_roofline_is_compute_bound_for_big_matmuls_and_divides_with_sharding() -> None:
    h100 = get_device_spec("H100")
    a, b = torch.empty(8192, 8192, device="meta"), torch.empty(8192, 8192, device="meta")
    out = torch.empty(8192, 8192, device="meta")
    t1 = roofline_time_s(aten.mm.default, [a, b], [out], h100)
    t8 = roofline_time_s(aten.mm.default, [a, b], [out], h100, work_divisor=8)
    # fp32: 2*8192^3 / (66.9e12 * 0.7) + 4 us launch overhead
    assert t1 == pytest.approx(2 * 8192**3 / (66.9e12 * 0.7) + 4e-6, rel=1e-3)
    assert t8 == pytest.approx((t1 - 4e-6) / 8 + 4e-6, rel=1e-6)


def test_ring_all_reduce_time() -> None:
    # all_reduce(B) on n ranks = 2 (n-1)/n * B / bw + 2 (n-1) * latency
    n, nbytes, bw, lat = 8, 1e9, 450.0, 3.0
    expected = 2 * (n - 1) / n * nbytes / (bw * 1e9) + 2 * (n - 1) * lat * 1e-6
    assert collective_time_s("all_reduce", nbytes, n, bw, lat) == pytest.approx(expected)


def test_all_gather_and_reduce_scatter_cost_half_an_all_reduce() -> None:
    ag = collective_time_s("all_gather", 1e9, 8, 450.0, 3.0)
    rs = collective_time_s("reduce_scatter", 1e9, 8, 450.0, 3.0)
    ar = collective_time_s("all_reduce", 1e9, 8, 450.0, 3.0)
    assert ag == pytest.approx(rs) and ag + rs == pytest.approx(ar)
    assert collective_time_s("all_reduce", 1e9, 1, 450.0, 3.0) == 0.0


def test_adam_keeps_16_bytes_per_fp32_parameter() -> None:
    # fp32 param (4) + grad (4) + exp_avg (4) + exp_avg_sq (4) = 16 bytes per element
    assert param_training_bytes(1000, 4, "adam") == 16_000
    assert param_training_bytes(1000, 4, "sgd") == 8_000


@pytest.mark.parametrize(
    ("src", "dst", "steps"),
    [
        ("S(0),R", "R,R", ["all_gather@0"]),
        ("P,R", "R,R", ["all_reduce@0"]),
        ("P,R", "S(0),R", ["reduce_scatter@0"]),
        ("R,R", "R,S(1)", ["shard@1"]),
        ("S(0),R", "S(1),R", ["all_to_all@0"]),
        ("R,R", "P,R", ["to_partial@0"]),
        # the batch dim sharded on both axes: the inner axis is gathered first
        ("S(0),S(0)", "R,S(0)", ["all_gather@1", "all_gather@0", "shard@1"]),
        ("P,S(1)", "R,S(1)", ["all_reduce@0"]),
        ("R,R", "S(0),S(0)", ["shard@0", "shard@1"]),
    ],
)
def test_transition_steps_follow_the_redistribute_table(src: str, dst: str, steps: list[str]) -> None:
    got = plan_transition(parse_spec(src.split(",")), parse_spec(dst.split(",")))
    assert [str(s) for s in got] == steps


def test_transition_cost_uses_the_link_of_each_axis() -> None:
    cluster = Cluster.preset("2x8xH100")
    nbytes = 8 * 1024**2
    inter = transition_cost_s((P, R), (R, R), nbytes, cluster)
    intra = transition_cost_s((R, P), (R, R), nbytes, cluster)
    link0, link1 = cluster.axis_link(0), cluster.axis_link(1)
    assert inter == pytest.approx(collective_time_s("all_reduce", nbytes, 2, link0.bw_GBps, link0.latency_us))
    assert intra == pytest.approx(collective_time_s("all_reduce", nbytes, 8, link1.bw_GBps, link1.latency_us))
    assert transition_cost_s((R, R), (R, S1), nbytes, cluster) == 0.0


def test_placement_text_round_trips() -> None:
    for text in ["R", "P", "P(avg)", "S(0)", "S(3)"]:
        from autoplan.passes.placement import parse_placement

        assert placement_str(parse_placement(text)) == text
    assert spec_str((S0, R)) == "S(0)R"
    assert local_numel((S0, S1), (10, 6), (4, 2)) == 3 * 3  # ceil(10/4) * ceil(6/2)
    with pytest.raises(ValueError, match="malformed"):
        parse_spec(["S(x)"])
