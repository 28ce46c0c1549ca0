"""The step model's communication schedule (autoplan.cost_models.step, issue #19 "priced = executed").

Synthetic segment costs on a made-up GPU whose links inside and across nodes have the same numbers
(10 GB/s, 100 us per ring step, no NCCL efficiency applied), so that only the schedule differs
between the cases compared:

    segment: fwd = f, bwd = 2 f, params = P fp32 elements (gradient 4 P bytes), no TP collectives

Ring formulas (autoplan.cost_models.comm): reduce_scatter / all_gather of B bytes over n ranks
= (n - 1) * lat + (n - 1) / n * B / bw.
"""

from __future__ import annotations

import dataclasses

import pytest

from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.comm import ROUTING_IMBALANCE, expert_exchange_s, link_time_s
from autoplan.cost_models.comm_schedule import MiB, OverlapPolicy
from autoplan.cost_models.config import ParallelConfig
from autoplan.cost_models.hardware import DEVICE_CATALOG
from autoplan.cost_models.step import (
    SegmentCost,
    SegmentCosts,
    TrainingEstimate,
    _LastPass,
    _rank_in_backward_s,
    _run_pass,
    evaluate,
    group_link,
)

LAT_US = 100.0
GPU = dataclasses.replace(
    DEVICE_CATALOG["H100"],
    name="TESTGPU",
    intra_node_bw_GBps=10.0,
    inter_node_bw_GBps=10.0,
    intra_node_latency_us=LAT_US,
    inter_node_latency_us=LAT_US,
    sources=("test device: equal links inside and across nodes",),
)


def _seg(fwd_s: float, params: int, *, tp_comm_s: float = 0.0) -> SegmentCost:
    return SegmentCost(
        fwd_s=fwd_s + tp_comm_s, bwd_s=2 * fwd_s + tp_comm_s, bwd_weight_s=fwd_s, fwd_comm_s=tp_comm_s,
        bwd_comm_s=tp_comm_s, selective_recompute_s=fwd_s / 10, full_recompute_s=fwd_s + tp_comm_s, grad_sync_s=0.0, optimizer_s=1e-6,
        param_numel=params, trainable_numel=params, param_itemsize=4, saved_bytes=1e6, selective_kept_bytes=5e5,
        full_kept_bytes=1e5, input_bytes=1e5, flops=1e9,
    )  # fmt: skip


def _costs(
    num_blocks: int = 6, *, fwd_s: float = 1e-3, params: int = 4_000_000, tp_comm_s: float = 0.0
) -> SegmentCosts:
    segs = tuple(_seg(fwd_s, params, tp_comm_s=tp_comm_s) for _ in range(num_blocks + 2))
    return SegmentCosts(segments=segs, cut_bytes=tuple(4e6 for _ in segs[:-1]), optimizer="sgd")


def _config(**kw: object) -> ParallelConfig:
    base = dict(dp=8, tp=1, pp=1, microbatch_size=1, num_microbatches=2, schedule="1f1b", virtual_stages=1,
                recompute="none", zero_stage=0)  # fmt: skip
    return ParallelConfig(**{**base, **kw})  # type: ignore[arg-type]


def _row(est: TrainingEstimate, kind: str, axis: str = "dp"):  # noqa: ANN202
    (row,) = [r for r in est.comm.rows if r.kind == kind and r.axis == axis]
    return row


ONE_NODE = Cluster(num_nodes=1, devices_per_node=8, device=GPU)


def test_gradient_latency_is_paid_per_bucket():
    """Smaller buckets -> more reduce-scatters; the bytes are the same, so the link time grows by
    exactly the extra buckets' latency, (n - 1) * lat each, and with a backward too short to
    hide them the step grows too."""
    costs, cfg = _costs(fwd_s=1e-6), _config(zero_stage=1)
    few = evaluate(
        cfg, costs, ONE_NODE, policy=OverlapPolicy(bucket_cap_bytes=64 * MiB, first_bucket_cap_bytes=64 * MiB)
    )
    many = evaluate(
        cfg, costs, ONE_NODE, policy=OverlapPolicy(bucket_cap_bytes=1 * MiB, first_bucket_cap_bytes=1 * MiB)
    )
    rs_few, rs_many = _row(few, "reduce_scatter"), _row(many, "reduce_scatter")
    assert rs_many.count > rs_few.count >= 1
    assert rs_many.bytes == pytest.approx(rs_few.bytes) == pytest.approx(8 * 4 * 4_000_000)
    extra_latency = (rs_many.count - rs_few.count) * 7 * LAT_US * 1e-6
    assert rs_many.total_s - rs_few.total_s == pytest.approx(extra_latency, rel=1e-6)
    assert many.step_time_s > few.step_time_s


@pytest.mark.parametrize("num_microbatches", [1, 2, 4])
def test_gradient_reductions_hide_behind_a_long_backward_but_the_last_bucket_does_not(num_microbatches: int):
    """One stage: the program reduces in its backward (several micro-batches: the last one's
    backward, on its gradients plus the earlier ones' sum); with a long backward every bucket but
    the tail hides, and the buckets are the same whatever the number of micro-batches."""
    cfg = _config(zero_stage=0, num_microbatches=num_microbatches)
    short, long = evaluate(cfg, _costs(fwd_s=1e-6), ONE_NODE), evaluate(cfg, _costs(fwd_s=0.1), ONE_NODE)
    ar_short, ar_long = _row(short, "all_reduce"), _row(long, "all_reduce")
    assert ar_short.total_s == pytest.approx(ar_long.total_s)
    assert ar_short.exposed_s > 0.9 * ar_short.total_s
    assert 0 < ar_long.exposed_s < 0.5 * ar_long.total_s
    one = _row(evaluate(_config(zero_stage=0, num_microbatches=1), _costs(fwd_s=0.1), ONE_NODE), "all_reduce")
    assert ar_long.total_s == pytest.approx(one.total_s) and ar_long.count == one.count


def _without_gradients(costs: SegmentCosts) -> SegmentCosts:
    return dataclasses.replace(costs, segments=tuple(dataclasses.replace(s, trainable_numel=0) for s in costs.segments))


def test_pipelined_gradients_hide_behind_each_stages_last_backward():
    """Several stages (1F1B): each stage's last micro-batch's backward issues its own buckets and
    waits for them before it sends its input gradient on (comm_schedule.gradients_reduced_in_backward),
    so with a long backward the buckets hide but each stage's tail, and the step grows by those
    tails (and the contention), less than by one stage's buckets after the schedule."""
    cfg = _config(zero_stage=0, pp=2, dp=4, num_microbatches=2)
    est = evaluate(cfg, _costs(fwd_s=0.1), ONE_NODE)
    ar = _row(est, "all_reduce")
    assert 0 < ar.exposed_s < 0.5 * ar.total_s
    no_grads = evaluate(cfg, _without_gradients(_costs(fwd_s=0.1)), ONE_NODE)
    assert no_grads.step_time_s < est.step_time_s < no_grads.step_time_s + ar.total_s
    # the tails of both stages delay the step: more than one stage's exposed tail
    assert est.step_time_s - no_grads.step_time_s > ar.exposed_s


def test_zero_bubble_gradients_are_reduced_after_the_schedule_with_nothing_beside_them():
    """Zero-bubble (split weight-gradient programs): the runtime converts each stage's summed
    gradients after the schedule, so the estimate credits no overlap: every bucket is exposed,
    and the step is the schedule plus the buckets plus the optimizer, however long the backward."""
    cfg = _config(zero_stage=0, pp=2, dp=4, num_microbatches=2, schedule="zero-bubble")
    est = evaluate(cfg, _costs(fwd_s=0.1), ONE_NODE)
    ar = _row(est, "all_reduce")
    assert ar.exposed_s == pytest.approx(ar.total_s) and ar.total_s > 0
    no_grads = evaluate(cfg, _without_gradients(_costs(fwd_s=0.1)), ONE_NODE)
    assert est.step_time_s == pytest.approx(no_grads.step_time_s + ar.total_s)


def test_parameters_tied_across_stages_are_reduced_after_the_schedule():
    """A parameter of the prologue that the epilogue reads again (a tied embedding, P elements):
    with both segments in one stage it is reduced in the backward like any other; split across
    two stages, each stage's copy (P elements each) is reduced after the schedule, exposed."""
    tied_p = 1_000_000
    base = _costs(fwd_s=0.1)
    segs = list(base.segments)
    segs[-1] = dataclasses.replace(segs[-1], tied_param_numel=tied_p, tied_trainable_numel=tied_p, tied_param_owner=0)
    costs = dataclasses.replace(base, segments=tuple(segs))
    one = _row(evaluate(_config(zero_stage=0, pp=1, dp=4), costs, ONE_NODE), "all_reduce")
    two = evaluate(_config(zero_stage=0, pp=2, dp=4), costs, ONE_NODE)
    untied = evaluate(_config(zero_stage=0, pp=2, dp=4), base, ONE_NODE)
    link = group_link(ONE_NODE, stride=1, size=4)
    apart_s = link_time_s("all_reduce", 4 * tied_p, 4, link, backend="nccl")
    assert one.bytes == pytest.approx(4 * 4_000_000 * len(segs))  # one stage: the copy is the parameter
    # each pipeline rank reduces its stage's copy: the prologue's out of its buckets, the
    # epilogue's beside them; the reported rank's row holds one exposed collective more
    row, row_untied = _row(two, "all_reduce"), _row(untied, "all_reduce")
    assert row.count == row_untied.count + 1
    assert row.exposed_s >= apart_s * (1 - 1e-9)
    # (the prologue's stage reduces 1M elements fewer in its backward, so its tail shrinks)
    assert two.step_time_s > untied.step_time_s


def test_zero3_is_never_cheaper_than_its_exposed_first_gathers():
    """Each micro-batch's forward waits for the first segment's gather and its backward for the
    last segment's (nothing to hide behind), whatever the compute."""
    for fwd_s in (1e-6, 1e-3, 0.1):
        costs, cfg = _costs(fwd_s=fwd_s), _config(zero_stage=3, num_microbatches=2)
        est = evaluate(cfg, costs, ONE_NODE)
        first = link_time_s("all_gather", 4 * 4_000_000, 8, group_link(ONE_NODE, stride=1, size=8), backend="nccl")
        compute = sum(s.fwd_s + s.bwd_s for s in costs.segments)
        assert est.step_time_s >= 2 * (compute + 2 * first)
        gathers = _row(est, "all_gather")
        assert gathers.count == 2 * 2 * 8  # micro-batches x passes x segments
        assert gathers.exposed_s >= 2 * 2 * first * (1 - 1e-9)


def test_zero3_backward_gathers_wait_behind_the_reduce_scatters_on_the_same_link():
    """Blocks of 1 ms, gathers of 0.8 ms prefetched one block ahead: alone, only the first gather
    is exposed (0.8 + 4 x 1 ms). With a 0.5 ms reduce-scatter issued at each block's end, block
    0's reduce-scatter (1.8-2.3 ms) runs before block 2's gather (2.3-3.1 ms), so block 2 starts
    at 3.1 ms instead of 2.8 ms: a per-pass max() formula would not see it."""
    compute, gathers = [1e-3] * 4, [0.8e-3] * 4
    alone = _run_pass(compute, gathers, overlap=True, slow=0.0, prefetch=1)
    shared = _run_pass(compute, gathers, overlap=True, slow=0.0, prefetch=1,
                       reductions=[(j, 1.0, 0.5e-3) for j in range(4)])  # fmt: skip
    assert alone.end_s == pytest.approx(4.8e-3) and alone.gather_wait_s == pytest.approx(0.8e-3)
    assert shared.gather_wait_s == pytest.approx(0.8e-3 + 0.3e-3 + 0.3e-3)
    assert shared.end_s == pytest.approx(4.8e-3 + 0.6e-3)
    assert shared.done_s > shared.end_s  # the last reduce-scatter is the exposed tail
    slowed = _run_pass(compute, gathers, overlap=True, slow=0.5, prefetch=1)
    assert slowed.compute_s > alone.compute_s  # compute beside the link runs slower


def test_compute_slows_beside_the_reductions_its_own_backward_issues():
    """One 4 ms backward, no gathers, a 1 ms reduce-scatter issued when half of its compute is
    done, compute 1.5x slower while the link is busy: 2 ms, then 1 ms of the link at 1/1.5 the
    rate (0.667 ms of work), then the last 1.333 ms alone, 4.333 ms in all. The reduction runs
    beside the block that issued it, so it slows that block (before the fix the issuing block ran
    at full speed: 4 ms)."""
    slowed = _run_pass([4e-3], [0.0], overlap=True, slow=0.5, prefetch=1, reductions=[(0, 0.5, 1e-3)])
    assert slowed.end_s == pytest.approx(2e-3 + 1e-3 + (2e-3 - 1e-3 / 1.5))
    assert slowed.done_s == slowed.end_s  # issued at 2 ms on an idle link, done at 3 ms: no tail
    alone = _run_pass([4e-3], [0.0], overlap=True, slow=0.0, prefetch=1, reductions=[(0, 0.5, 1e-3)])
    assert alone.end_s == pytest.approx(4e-3) == alone.done_s


def test_zero3_reshard_after_forward_gathers_again_for_the_backward():
    costs = _costs(fwd_s=2e-3)
    z3 = evaluate(_config(zero_stage=3, num_microbatches=1), costs, ONE_NODE)
    kept = evaluate(
        _config(zero_stage=3, num_microbatches=1), costs, ONE_NODE, policy=OverlapPolicy(reshard_after_forward=False)
    )
    assert _row(z3, "all_gather").count == 2 * _row(kept, "all_gather").count
    assert z3.step_time_s > kept.step_time_s


@pytest.mark.parametrize(
    "kw",
    [
        dict(zero_stage=0),
        dict(zero_stage=1),
        dict(zero_stage=2),
        dict(zero_stage=3),
        dict(zero_stage=3, dp=4, pp=2, num_microbatches=4),
        dict(zero_stage=0, dp=2, tp=2, pp=2, num_microbatches=4, schedule="interleaved-1f1b", virtual_stages=2),
    ],
)
def test_rows_exposed_within_total_and_summing_to_the_estimate(kw: dict[str, object]):
    cfg = _config(**kw)
    costs = _costs(fwd_s=5e-4, tp_comm_s=1e-4 if cfg.tp > 1 else 0.0)
    est = evaluate(cfg, costs, Cluster(num_nodes=2, devices_per_node=4, device=GPU))
    assert est.comm.rows
    for r in est.comm.rows:
        assert 0.0 <= r.exposed_s <= r.total_s * (1 + 1e-12), r
    assert est.exposed_comm_s == pytest.approx(sum(r.exposed_s for r in est.comm.rows))
    assert est.comm.total_s >= est.exposed_comm_s
    kinds = {(r.kind, r.axis) for r in est.comm.rows}
    assert (("all_reduce" if cfg.zero_stage == 0 else "reduce_scatter"), "dp") in kinds
    assert (cfg.zero_stage == 3) == (("all_gather", "dp") in kinds and cfg.zero_stage != 1 and cfg.zero_stage != 2)
    assert (cfg.pp > 1) == (("send_recv", "pp") in kinds)
    assert (cfg.tp > 1) == (("redistribute", "tp") in kinds)
    if cfg.tp > 1:  # every segment's forward and backward collectives in every micro-batch, all exposed
        tp = _row(est, "redistribute", "tp")
        assert tp.total_s == pytest.approx(tp.exposed_s)
    assert est.to_dict()["comm"] == est.comm.to_list()


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_pipeline_sends_wait_behind_the_reductions_only_where_they_share_the_backward(schedule: str):
    """pp=2 x dp=2 on one node of 4 (the sends and the dp collectives share the intra-node link)
    against 2 nodes of 2 (dp inside a node, the sends across): same link numbers, so only the
    sharing differs. 1F1B reduces each stage's gradients in its last backward, so the last
    backward's send queues behind them on a shared link; zero-bubble reduces its accumulated
    gradients after the schedule, when no send is left, and sharing costs nothing."""
    cfg = _config(dp=2, pp=2, num_microbatches=4, zero_stage=0, schedule=schedule)
    costs = _costs(fwd_s=1e-5)
    shared = evaluate(cfg, costs, Cluster(num_nodes=1, devices_per_node=4, device=GPU))
    alone = evaluate(cfg, costs, Cluster(num_nodes=2, devices_per_node=2, device=GPU))
    if schedule == "zero-bubble":
        assert shared.step_time_s == pytest.approx(alone.step_time_s)
    else:
        assert shared.step_time_s > alone.step_time_s
    zero_dp = dataclasses.replace(cfg, dp=1, microbatch_size=2)  # no dp collectives: nothing to share
    one = evaluate(zero_dp, costs, Cluster(num_nodes=1, devices_per_node=2, device=GPU))
    two = evaluate(zero_dp, costs, Cluster(num_nodes=2, devices_per_node=1, device=GPU))
    assert one.step_time_s == pytest.approx(two.step_time_s)


def test_a_dp_group_across_nodes_runs_one_nic_per_rank_on_each_node():
    """NCCL's rings across nodes use every NIC of the node (nccl#812: 192 GB/s bus bandwidth over
    8 x 200 Gb/s): with tp=1 the 8 ranks of a node each drive a NIC, up to the NVLink bandwidth;
    with tp=8 one rank per node drives one NIC."""
    cluster = Cluster.preset("4x8xA100-80GB")
    nic = cluster.catalog_link(spans_nodes=True).bw_GBps
    nvlink = cluster.catalog_link(spans_nodes=False).bw_GBps
    assert group_link(cluster, stride=1, size=32).bw_GBps == pytest.approx(min(8 * nic, nvlink))
    assert group_link(cluster, stride=2, size=16).bw_GBps == pytest.approx(min(4 * nic, nvlink))
    assert group_link(cluster, stride=8, size=4).bw_GBps == pytest.approx(nic)
    assert nic == pytest.approx(25 * 24 / 25) and nvlink == pytest.approx(300 * 230 / 300)


def test_cpu_ranks_expose_every_collective():
    cfg = _config(dp=2, zero_stage=3)
    est = evaluate(cfg, _costs(fwd_s=0.1), Cluster.preset("2xCPU"))
    for r in est.comm.rows:
        assert r.exposed_s == pytest.approx(r.total_s), r


def test_interleaved_stages_reductions_queue_on_one_link_behind_all_their_last_backwards():
    """Two stages on one rank (interleaving), each a 10 ms last backward that issues a 6 ms
    bucket at its end: alone, each bucket is exposed (6 ms each, 12 ms); waited for only after
    the schedule, the first one runs beside the second stage's backward, so the rank waits for
    the second one only (6 ms)."""
    one = _LastPass(compute_s=(10e-3,), gather_s=(0.0,), reductions=((0, 1.0, 6e-3),), tp_sync_s=(0.0,))
    alone = _rank_in_backward_s((one,), overlap=True, slow=0.0, prefetch=1)
    together = _rank_in_backward_s((one, one), overlap=True, slow=0.0, prefetch=1)
    assert alone == pytest.approx(6e-3)
    assert together == pytest.approx(6e-3)


def test_a_later_stage_reduces_its_gradients_while_the_earlier_ones_finish_their_last_backward():
    """1F1B over 4 stages where only the last stage has gradients: its rank finishes the
    schedule while stages 2, 1, 0 still run their last backward, so its reductions (and its
    optimizer step) hide in that slack and the step grows by less than their exposed tail (the
    sends cross nodes: they do not queue behind the reductions)."""
    base = _costs(fwd_s=0.1)
    only_last = dataclasses.replace(base, segments=tuple(
        dataclasses.replace(s, trainable_numel=s.trainable_numel if i >= len(base.segments) - 2 else 0)
        for i, s in enumerate(base.segments)))  # fmt: skip
    cfg = _config(zero_stage=0, pp=4, dp=4, num_microbatches=4)
    nodes = Cluster(num_nodes=4, devices_per_node=4, device=GPU)  # dp in a node, the sends across
    est = evaluate(cfg, only_last, nodes)
    none = evaluate(cfg, _without_gradients(base), nodes)
    tail = _row(est, "all_reduce").exposed_s
    assert tail > 0
    assert est.step_time_s < none.step_time_s + tail


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_expert_parallel_all_to_alls_get_their_own_row(recompute: str):
    """A segment whose tensor-parallel communication is partly MoE all-to-alls: the all-to-alls
    are one ``all_to_all@tp`` row (every micro-batch's forward and backward, the forward's again
    under full recomputation, all exposed), the rest stays ``redistribute@tp``; together they are
    what the row was before the split."""
    a2a_f, a2a_b, tp_comm = 3e-5, 5e-5, 1e-4
    plain = _costs(fwd_s=5e-4, tp_comm_s=tp_comm)
    moe = dataclasses.replace(
        plain,
        segments=tuple(
            dataclasses.replace(
                s,
                fwd_all_to_all_s=a2a_f,
                bwd_all_to_all_s=a2a_b,
                all_to_alls=3,
                fwd_all_to_all_bytes=1e6,
                bwd_all_to_all_bytes=2e6,
            )  # fmt: skip
            for s in plain.segments
        ),
    )
    cfg, cluster = (
        _config(dp=4, tp=2, num_microbatches=4, recompute=recompute),
        Cluster(num_nodes=1, devices_per_node=8, device=GPU),
    )
    before, after = evaluate(cfg, plain, cluster), evaluate(cfg, moe, cluster)
    forwards, m, segs = (2 if recompute == "full" else 1), 4, len(plain.segments)
    a2a = _row(after, "all_to_all", "tp")
    assert a2a.total_s == pytest.approx(m * segs * (forwards * a2a_f + a2a_b))
    assert a2a.exposed_s == a2a.total_s
    assert a2a.count == m * segs * 3 * (forwards + 1)
    assert a2a.bytes == pytest.approx(m * segs * (forwards * 1e6 + 2e6))
    tp_before = sum(r.total_s for r in before.comm.rows if r.axis == "tp")
    tp_after = sum(r.total_s for r in after.comm.rows if r.axis == "tp")
    assert tp_after == pytest.approx(tp_before)
    assert after.step_time_s == pytest.approx(before.step_time_s)
    assert after.exposed_comm_s == pytest.approx(sum(r.exposed_s for r in after.comm.rows))


def _moe_costs(*, experts_numel: int, params: int = 4_000_000) -> SegmentCosts:
    """:func:`_costs` with one MoE layer per block: ``experts_numel`` of its ``params`` are the
    routed experts (8 of them), 1 MB of routed rows per micro-batch, the experts' GEMMs 40 % of
    the block's compute."""
    plain = _costs(fwd_s=5e-4, params=params)
    blocks = [
        dataclasses.replace(s, moe_ops=1, moe_routed_bytes=1e6, experts=8, moe_fwd_s=2e-4, moe_bwd_s=4e-4,
                            expert_numel=experts_numel, expert_trainable_numel=experts_numel)  # fmt: skip
        for s in plain.segments[1:-1]
    ]
    return dataclasses.replace(plain, segments=(plain.segments[0], *blocks, plain.segments[-1]))


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_experts_split_over_dp_exchange_tokens_and_are_never_reduced_or_gathered(zero_stage: int):
    """``ep = dp``: each block's MoE op adds its all-to-alls on the dp link (forward once,
    backward twice the bytes, an ``all_to_all@dp`` row, all exposed) and the busiest rank's
    imbalance on its experts' compute; the experts' gradients leave the dp reduction and their
    weights the ZeRO-3 gathers; each device holds 1/dp of them whatever the ZeRO stage."""
    experts, params, dp, m = 3_000_000, 4_000_000, 8, 2
    costs = _moe_costs(experts_numel=experts, params=params)
    base = _config(dp=dp, num_microbatches=m, zero_stage=zero_stage)
    replicated, split = evaluate(base, costs, ONE_NODE), evaluate(dataclasses.replace(base, ep=dp), costs, ONE_NODE)
    blocks = len(costs.segments) - 2
    link = group_link(ONE_NODE, stride=1, size=dp)
    a2a = blocks * m * sum(expert_exchange_s(1e6, 8, dp, link, backward=b) for b in (False, True))
    row = _row(split, "all_to_all", "dp")
    assert row.total_s == pytest.approx(a2a) and row.exposed_s == row.total_s
    assert row.count == blocks * m * 6
    assert not [r for r in replicated.comm.rows if r.kind == "all_to_all"]
    reduction = "all_reduce" if zero_stage == 0 else "reduce_scatter"
    kept = sum(s.trainable_numel - s.expert_trainable_numel for s in costs.segments)
    assert _row(split, reduction).bytes == pytest.approx(kept * 4)  # fp32 gradients, experts left out
    assert _row(replicated, reduction).bytes == pytest.approx(sum(s.trainable_numel for s in costs.segments) * 4)
    if zero_stage == 3:
        gathers = _row(split, "all_gather")
        assert gathers.bytes == pytest.approx(m * 2 * sum(s.param_numel - s.expert_numel for s in costs.segments) * 4)
    weights = [st.memory_parts["weights"] for st in (replicated.stages[0], split.stages[0])]
    total = sum(s.param_numel for s in costs.segments)
    if zero_stage == 0:  # replicated: the experts held whole, split: 1/dp of them
        assert weights == pytest.approx([total * 4, (total - blocks * experts * (1 - 1 / dp)) * 4])
    else:  # ZeRO-3 holds 1/dp of everything either way
        assert weights == pytest.approx([total * 4 / dp] * 2)
    slower = blocks * m * (ROUTING_IMBALANCE - 1) * (2e-4 + 4e-4)
    # the compute stream's time holds its blocking collectives (as the tensor-parallel ones); under
    # ZeRO-3 its slowdown beside the (fewer) gathers differs too
    if zero_stage == 0:
        assert split.compute_s == pytest.approx(replicated.compute_s + slower + a2a, rel=1e-6)


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_experts_split_over_groups_smaller_than_dp_reduce_their_shards_over_the_replicas(zero_stage: int):
    """``dp = 8, ep = 2``: the MoE all-to-alls run on the 2 ranks of an expert group (an
    ``all_to_all@ep`` row, on that group's link); each device holds 1/2 of the experts (1/8
    under ZeRO-3), whose gradients (and ZeRO-3 gathers) run over the 4 replicas only (axis
    ``dp``), while the dense parameters' run over both axes, one after the other: on ``dp``
    their whole bytes, on ``ep`` the whole bytes for an all-reduce and a quarter for a
    reduce-scatter or all-gather. The rows add up to the estimate's communication."""
    experts, params, dp, ep, m = 3_000_000, 4_000_000, 8, 2, 2
    costs = _moe_costs(experts_numel=experts, params=params)
    cfg = _config(dp=dp, num_microbatches=m, zero_stage=zero_stage, ep=ep)
    est = evaluate(cfg, costs, ONE_NODE)
    blocks, r = len(costs.segments) - 2, dp // ep
    link = group_link(ONE_NODE, stride=1, size=ep)
    a2a = _row(est, "all_to_all", "ep")
    assert a2a.total_s == pytest.approx(blocks * m * sum(expert_exchange_s(1e6, 8, ep, link, backward=b) for b in (False, True)))
    assert not [row for row in est.comm.rows if row.kind == "all_to_all" and row.axis == "dp"]
    reduction = "all_reduce" if zero_stage == 0 else "reduce_scatter"
    dense = sum(s.trainable_numel - s.expert_trainable_numel for s in costs.segments) * 4
    shards = blocks * experts / ep * 4
    assert _row(est, reduction, "dp").bytes == pytest.approx(dense + shards)
    assert _row(est, reduction, "ep").bytes == pytest.approx(dense if zero_stage == 0 else dense / r)
    # each axis's share of the reductions' time is its link time: the 4 replicas' ring of the
    # larger bytes takes longer than the pair's
    assert _row(est, reduction, "dp").total_s > _row(est, reduction, "ep").total_s > 0
    weights = est.stages[0].memory_parts["weights"]
    total = sum(s.param_numel for s in costs.segments)
    if zero_stage == 0:
        assert weights == pytest.approx((total - blocks * experts * (1 - 1 / ep)) * 4)
    else:
        assert weights == pytest.approx(total * 4 / dp)
        gathers = _row(est, "all_gather", "dp")  # forward and backward, each micro-batch: dense whole, experts 1/ep
        assert gathers.bytes == pytest.approx(m * 2 * (sum(s.param_numel - s.expert_numel for s in costs.segments)
                                                        + blocks * experts / ep) * 4)  # fmt: skip
        assert _row(est, "all_gather", "ep").bytes == pytest.approx(
            m * 2 * sum(s.param_numel - s.expert_numel for s in costs.segments) * 4 / r
        )
    assert est.comm.exposed_s == pytest.approx(est.exposed_comm_s)
    # more ranks per expert group: fewer expert bytes held, more all-to-all ranks
    wider = evaluate(dataclasses.replace(cfg, ep=4), costs, ONE_NODE)
    assert wider.stages[0].memory_parts["weights"] <= weights


def test_a_context_parallel_axis_puts_the_data_parallel_ranks_cp_times_tp_apart():
    """``ParallelConfig.cp``: a replica is ``cp x tp`` ranks, so the ``dp`` group's ranks are
    ``cp * tp`` apart. On 2 nodes of 4, ``dp=2, cp=2, tp=2`` fills a node per replica and reduces
    its gradients over the network, where ``dp=4, tp=2`` (ranks 2 apart) has two on each node; the
    rows of the replica's own collectives are named ``cp+tp`` and keep the segments' times."""
    fast_intra = dataclasses.replace(GPU, intra_node_bw_GBps=100.0)
    cluster = Cluster(num_nodes=2, devices_per_node=4, device=fast_intra)
    costs = _costs(tp_comm_s=1e-4)
    with_cp = evaluate(_config(dp=2, cp=2, tp=2, num_microbatches=1), costs, cluster)
    grads = sum(s.trainable_numel for s in costs.segments) * 4
    reduction = _row(with_cp, "all_reduce")
    assert reduction.bytes == pytest.approx(grads)
    assert group_link(cluster, stride=4, size=2).spans_nodes and not group_link(cluster, stride=1, size=4).spans_nodes
    alone = link_time_s("all_reduce", grads, 2, group_link(cluster, stride=4, size=2), backend=cluster.backend)
    assert reduction.total_s >= alone * (1 - 1e-9)  # one bucketed all-reduce over the network at least
    assert {r.axis for r in with_cp.comm.rows if r.kind == "redistribute"} == {"cp+tp"}
    blocks = len(costs.segments)
    assert _row(with_cp, "redistribute", "cp+tp").total_s == pytest.approx(blocks * 2 * 1e-4)
    assert with_cp.config.world_size == 8 and with_cp.tokens_per_s > 0


def test_a_context_parallel_axis_is_reduced_and_zero_sharded_with_the_data_parallel_ranks():
    """Every parameter is whole on ``cp`` and its gradient a partial sum there, so ZeRO shards
    over ``dp x cp`` (torchtitan's FSDP over ``dp_shard x cp``, Megatron-Core's distributed
    optimizer): ``dp=2, cp=2`` holds the weights and optimizer state of ``dp=4`` (ZeRO-3),
    reduce-scatters the full gradients over ``dp`` and half of them over ``cp`` (DTensor's two
    steps), gathers on both axes, and with ``dp=1`` shards over ``cp`` alone."""
    cluster = Cluster(num_nodes=2, devices_per_node=4, device=GPU)
    costs = _costs()
    grads = sum(s.trainable_numel for s in costs.segments) * 4
    with_cp = evaluate(_config(dp=2, cp=2, tp=2, num_microbatches=1, zero_stage=3), costs, cluster)
    dp_only = evaluate(_config(dp=4, tp=2, num_microbatches=1, zero_stage=3), costs, cluster)
    for part in ("weights", "optimizer"):
        assert with_cp.stages[0].memory_parts[part] == pytest.approx(dp_only.stages[0].memory_parts[part]), part
    assert _row(with_cp, "reduce_scatter", "dp").bytes == pytest.approx(grads)
    assert _row(with_cp, "reduce_scatter", "cp").bytes == pytest.approx(grads / 2)
    assert {r.axis for r in with_cp.comm.rows if r.kind == "all_gather"} == {"dp", "cp"}
    # zero 0: an all-reduce of the whole gradients on each axis
    plain = evaluate(_config(dp=2, cp=2, tp=2, num_microbatches=1), costs, cluster)
    assert _row(plain, "all_reduce", "dp").bytes == _row(plain, "all_reduce", "cp").bytes == pytest.approx(grads)
    # dp=1: the cp axis alone; ZeRO-3 halves the weights of the unsharded plan
    alone = evaluate(_config(dp=1, cp=2, tp=2, num_microbatches=1, zero_stage=3), costs, ONE_NODE)
    unsharded = evaluate(_config(dp=1, cp=2, tp=2, num_microbatches=1), costs, ONE_NODE)
    assert {r.axis for r in alone.comm.rows if r.kind in ("all_gather", "reduce_scatter")} == {"cp"}
    weights = alone.stages[0].memory_parts["weights"], unsharded.stages[0].memory_parts["weights"]
    assert weights[0] == pytest.approx(weights[1] / 2)
