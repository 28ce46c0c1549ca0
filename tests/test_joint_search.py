"""Joint search (autoplan.planner.search, autoplan.planner.joint): configuration checks, the what-if
estimate equals the planner's own pricing, block expansion equals a deeper trace, the planner is
never worse than the uniform Megatron grid, and memory-driven choices."""

from __future__ import annotations

import dataclasses

import pytest

import autoplan
from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.config import ParallelConfig
from autoplan.cost_models.errors import ConfigError, InfeasiblePlanError
from autoplan.cost_models.step import evaluate
from autoplan.planner.joint import estimate, search_config
from autoplan.planner.search import SearchSpace, candidates, expand_blocks, search, virtual_stage_counts
from autoplan.planner.segment_model import SegmentCostModel
from tests.zoo import gpt2_tiny, lm_loss, token_batch

CLUSTER = "2x4xA100-80GB"


@pytest.fixture(scope="module")
def costs() -> SegmentCostModel:
    ids, labels = token_batch()
    return SegmentCostModel(gpt2_tiny(num_layers=4), (ids,), lm_loss, (labels,), Cluster.preset(CLUSTER))


def test_config_errors_name_the_numbers():
    with pytest.raises(ConfigError, match="positive integer"):
        ParallelConfig(dp=0)
    with pytest.raises(ConfigError, match="num_microbatches divisible by the 4 pipeline ranks, got 6"):
        ParallelConfig(pp=4, num_microbatches=6, schedule="interleaved-1f1b", virtual_stages=2)
    cfg = ParallelConfig(dp=2, tp=2, pp=2, microbatch_size=2, num_microbatches=4)
    with pytest.raises(ConfigError, match=r"2\*2\*4 = 16 but global_batch_size is 20"):
        cfg.check_against(world_size=8, devices_per_node=4, num_blocks=4, global_batch_size=20)
    with pytest.raises(ConfigError, match=r"= 8 but the cluster has 16"):
        cfg.check_against(world_size=16, devices_per_node=8, num_blocks=4, global_batch_size=16)
    deep = ParallelConfig(dp=1, tp=1, pp=8, num_microbatches=8)
    with pytest.raises(ConfigError, match="8 stages but the model has 4 blocks"):
        deep.check_against(world_size=8, devices_per_node=8, num_blocks=4, global_batch_size=8)


def test_estimate_rejects_pipeline_deeper_than_model():
    ids, labels = token_batch()
    cfg = ParallelConfig(dp=1, tp=1, pp=8, microbatch_size=1, num_microbatches=8)
    with pytest.raises(ConfigError, match="8 stages but the model has 2 blocks"):
        estimate(
            gpt2_tiny(), CLUSTER, (ids,), loss_fn=lm_loss, example_targets=(labels,), config=cfg, global_batch_size=8
        )


def test_plan_with_a_global_batch_refuses_pins_it_would_not_apply():
    """The joint search places every op itself: pins given beside global_batch_size were dropped
    without a word; they are refused before anything is traced."""
    ids, labels = token_batch()
    with pytest.raises(autoplan.PlanError, match="drop pins or global_batch_size"):
        autoplan.plan(
            gpt2_tiny(), CLUSTER, example_inputs=(ids,), loss_fn=lm_loss, example_targets=(labels,),
            global_batch_size=8, pins={"input_0": "S(0)"},
        )  # fmt: skip


@pytest.mark.slow
def test_expanded_blocks_equal_a_deeper_trace():
    """The search's costs of a 4-block model from its 2-block trace (autoplan.passes.depth; the default)
    match those of the full 4-block trace: the repeated middle blocks exactly, the whole step's
    time within 0.5% and its saved activations within 10% (the two ILPs may pick different
    layouts of equal time next to the prologue and epilogue)."""
    ids, labels = token_batch()
    cluster = Cluster.preset(CLUSTER)
    model = gpt2_tiny(num_layers=4)
    reduced = SegmentCostModel(model, (ids,), lm_loss, (labels,), cluster)
    grown = reduced(2, 2)
    assert reduced._traced(2)[1].num_blocks == 2 and reduced.num_blocks == 4  # noqa: SLF001
    four = SegmentCostModel(model, (ids,), lm_loss, (labels,), cluster, reduce_repeated=False)(2, 2)
    assert len(grown.segments) == len(four.segments) == 6
    for a, b in zip(grown.segments[2:-1], four.segments[2:-1], strict=True):
        assert (a.fwd_s, a.bwd_s, a.saved_bytes, a.param_numel) == pytest.approx(
            (b.fwd_s, b.bwd_s, b.saved_bytes, b.param_numel), rel=1e-9
        )
    assert [s.param_numel for s in grown.segments] == [s.param_numel for s in four.segments]

    def total(c: object, field: str) -> float:
        return sum(getattr(s, field) for s in c.segments)  # type: ignore[attr-defined]

    for field in ("fwd_s", "bwd_s"):
        assert total(grown, field) == pytest.approx(total(four, field), rel=5e-3)
    assert total(grown, "saved_bytes") == pytest.approx(total(four, "saved_bytes"), rel=0.1)
    # cuts between repeated blocks equal; the cut out of the prologue may differ by an
    # equal-time layout choice (replicated or sequence-sharded embedding output)
    assert grown.cut_bytes[1:-1] == pytest.approx(four.cut_bytes[1:-1])


@pytest.mark.slow
def test_estimate_is_the_planners_own_price(costs):  # noqa: ANN001
    """autoplan.estimate of the planner's choice gives the planner's step time and memory."""
    cluster = Cluster.preset(CLUSTER)
    best, every = search(costs, cluster, num_blocks=4, global_batch_size=32, precision="fp32")
    c = best.config
    direct = evaluate(c, costs(c.tp, c.microbatch_size, c.cp, c.sequence_parallel), cluster, stage_starts=best.stage_starts,
                      stage_recompute=[s.recompute for s in best.stages])  # fmt: skip
    assert direct.step_time_s == pytest.approx(best.step_time_s, rel=1e-12)
    assert direct.peak_memory_bytes == pytest.approx(best.peak_memory_bytes, rel=1e-12)
    assert len(every) > 50
    assert all(best.step_time_s <= e.step_time_s * (1 + 1e-12) for e in every if e.feasible)
    assert c.global_batch_size == 32


def test_planner_never_worse_than_uniform_grid(costs):  # noqa: ANN001
    cluster = Cluster.preset(CLUSTER)
    grid_space = SearchSpace(balanced_stages=False, per_stage_recompute=False)
    planner, _ = search(costs, cluster, num_blocks=4, global_batch_size=32)
    grid, _ = search(costs, cluster, num_blocks=4, global_batch_size=32, space=grid_space)
    assert planner.step_time_s <= grid.step_time_s * (1 + 1e-12)


def test_pipeline_bubble_and_inflight_memory(costs):  # noqa: ANN001
    """GPipe keeps every micro-batch's activations, 1F1B at most pp: more memory for GPipe, and a
    bubble of (p-1)/(m+p-1) of the makespan for uniform stages."""
    cluster = Cluster.preset(CLUSTER)
    kw = dict(dp=2, tp=2, pp=2, microbatch_size=1, num_microbatches=8, virtual_stages=1, recompute="none", zero_stage=0)
    seg = costs(2, 1)
    gpipe = evaluate(ParallelConfig(schedule="gpipe", **kw), seg, cluster)
    ofob = evaluate(ParallelConfig(schedule="1f1b", **kw), seg, cluster)
    act = [s.memory_parts["activations"] for s in gpipe.stages]
    act_1f1b = [s.memory_parts["activations"] for s in ofob.stages]
    assert act[0] == pytest.approx(4 * act_1f1b[0])  # m=8 in flight vs p-rank=2 on rank 0
    assert gpipe.bubble_s > 0 and ofob.bubble_s > 0
    full = evaluate(ParallelConfig(schedule="1f1b", **{**kw, "recompute": "full"}), seg, cluster)
    assert full.peak_memory_bytes < ofob.peak_memory_bytes and full.compute_s > ofob.compute_s


@pytest.mark.slow
def test_memory_pressure_picks_sharding_or_recompute():
    """A device too small for plain data parallelism: the search shards or recomputes; far too
    small: a clear InfeasiblePlanError naming the memory needed."""
    ids, labels = token_batch()
    model = gpt2_tiny(num_layers=4)
    big, _ = search_config(
        model, "1x4xA100-80GB", (ids,), loss_fn=lm_loss, example_targets=(labels,), global_batch_size=16
    )
    assert big.feasible
    tiny_cluster = Cluster.from_dict(
        {"num_nodes": 1, "devices_per_node": 4,
         "device": {"name": "tiny", "peak_flops": {"float32": 1e12}, "mem_bw_GBps": 100, "mem_capacity_bytes": 2**16,
                    "intra_node_bw_GBps": 10, "intra_node_latency_us": 5, "inter_node_bw_GBps": 1,
                    "inter_node_latency_us": 10}}
    )  # fmt: skip
    with pytest.raises(InfeasiblePlanError, match="GiB per device"):
        search_config(model, tiny_cluster, (ids,), loss_fn=lm_loss, example_targets=(labels,), global_batch_size=16)


def test_public_api_exports():
    assert autoplan.ParallelConfig is ParallelConfig and autoplan.estimate is estimate


def test_plan_with_global_batch_records_config_and_stages(tmp_path):  # noqa: ANN001
    ids, labels = token_batch()
    space_kw = {"global_batch_size": 16}
    plan = autoplan.plan(gpt2_tiny(num_layers=4), "1x4xCPU", example_inputs=(ids,), loss_fn=lm_loss,
                         example_targets=(labels,), **space_kw)  # fmt: skip
    cfg = plan.config
    assert cfg is not None and cfg.world_size == 4 and cfg.global_batch_size == 16
    assert plan.pipeline is not None and len(plan.pipeline.stage_starts) == cfg.pp * cfg.virtual_stages
    assert plan.estimate.mfu is not None and plan.estimate.tokens_per_s > 0
    assert "configuration: dp=" in plan.summary()
    plan.save(tmp_path / "p.json")
    again = autoplan.Plan.load(tmp_path / "p.json")
    assert again.config == cfg and again.pipeline == plan.pipeline
    assert again.estimate == plan.estimate


@pytest.mark.slow
def test_parallel_prefetch_gives_the_costs_of_solving_one_by_one():
    """SegmentCostModel.prefetch solves each tensor-parallel degree's micro-batch sizes in a
    forked worker; the costs (and which sizes were scaled rather than solved) are exactly those
    of the same calls made one by one in this process."""
    ids, labels = token_batch()
    model, cluster = gpt2_tiny(num_layers=4), Cluster.preset(CLUSTER)
    keys = [(1, 1), (1, 4), (2, 1), (2, 2), (2, 4), (4, 2)]
    parallel = SegmentCostModel(model, (ids,), lm_loss, (labels,), cluster, workers=2)
    waits: list[int] = []  # the search lays out ready candidates here while the workers solve

    def while_waiting() -> bool:
        waits.append(len(parallel._costs))  # noqa: SLF001
        return False

    parallel.prefetch(keys, while_waiting=while_waiting)
    assert waits, "the planning process never had time to do other work"
    assert {(tp, b, 1, 0) for tp, b in keys} <= set(parallel._costs)  # noqa: SLF001 - filled by the workers (cp 1, no SP)
    serial = SegmentCostModel(model, (ids,), lm_loss, (labels,), cluster, workers=1)
    for tp, b in keys:
        assert parallel(tp, b) == serial(tp, b), (tp, b)
    assert parallel._linear == serial._linear  # noqa: SLF001
    assert parallel._costs == serial._costs  # noqa: SLF001


def test_workers_come_from_the_environment(monkeypatch):
    from autoplan.planner.segment_model import available_cores, default_workers

    monkeypatch.setenv("AUTOPLAN_WORKERS", "3")
    assert default_workers() == min(3, available_cores())  # capped at the cores (tests/test_cache_seams.py)
    monkeypatch.setenv("AUTOPLAN_WORKERS", "0")
    with pytest.raises(ConfigError, match="AUTOPLAN_WORKERS='0' must be a positive integer"):
        default_workers()
    monkeypatch.delenv("AUTOPLAN_WORKERS")
    assert default_workers() >= 1


def test_virtual_stage_counts_take_every_even_split_while_the_bubble_can_still_shrink():
    """2 and 4 chunks always (when every stage gets a block), larger counts when p v divides the
    blocks and the bubble (p - 1) / (u m) of the largest count u below them is still >= 1%."""
    # GPT-3 175B: 96 layers on pp=8 (Narayanan et al. 2021): 12 blocks per rank, every divisor
    assert virtual_stage_counts(pp=8, num_microbatches=48, num_blocks=96) == (2, 3, 4, 6, 12)
    # 12 blocks on pp=2: 6 per rank; v=5 does not divide, 6 does (one block per stage)
    assert virtual_stage_counts(pp=2, num_microbatches=4, num_blocks=12) == (2, 3, 4, 6)
    # 80 layers on pp=2, m=64: after v=4 the bubble is 1 / 256 < 1%, no larger count can gain 1%
    assert virtual_stage_counts(pp=2, num_microbatches=64, num_blocks=80) == (2, 4)
    # Llama-3 405B: 126 layers on pp=16 never split evenly (16 v does not divide 126): 2 and 4 chunks
    assert virtual_stage_counts(pp=16, num_microbatches=32, num_blocks=126) == (2, 4)
    assert virtual_stage_counts(pp=4, num_microbatches=8, num_blocks=6) == ()


def test_search_tries_six_chunks_per_rank_and_prices_a_smaller_bubble_than_two(costs):  # noqa: ANN001
    """On a 12-block model the search's candidates hold interleaved-1f1b with v=6 on pp=2, and the
    cost model gives it a smaller bubble than the same configuration with fewer chunks that split
    the blocks evenly (v=4 cuts them into chunks of 1 and 2 blocks, and its bubble is v=3's)."""
    cluster = Cluster.preset(CLUSTER)
    tried = candidates(cluster, num_blocks=12, global_batch_size=16, space=SearchSpace())
    assert {c.virtual_stages for c in tried if c.pp == 2 and c.schedule == "interleaved-1f1b"} == {2, 3, 4, 6}
    deep = expand_blocks(costs(4, 1), 12)
    bubble_s = [
        evaluate(
            ParallelConfig(tp=4, pp=2, num_microbatches=16, schedule="interleaved-1f1b", virtual_stages=v),
            deep,
            cluster,
        ).bubble_s
        for v in (2, 3, 6)
    ]
    assert all(later < earlier for earlier, later in zip(bubble_s, bubble_s[1:], strict=False))


def test_the_search_tries_a_context_parallel_axis_beside_tensor_parallelism_for_long_samples():
    """``cp > 1`` candidates (``ParallelConfig.cp``) come with ``tp > 1`` only, for samples of at
    least ``context_parallel_min_tokens`` tokens that ``2 * cp`` divides, and fill the cluster."""
    cluster = Cluster.preset("2x8xH100")
    space = SearchSpace(schedules=("1f1b",), recompute=("full",), zero_stages=(0, 3), microbatch_sizes=(1,))

    def of(tokens: int) -> list[ParallelConfig]:
        return candidates(cluster, num_blocks=8, global_batch_size=16, space=space, tokens_per_sample=tokens)

    short, long = of(4096), of(8200)  # 8,200 tokens: 2*cp divides it for cp in 2, 4 (not 8: 16 does not)
    assert {c.cp for c in short} == {1}
    with_cp = [c for c in long if c.cp > 1]
    assert {c.cp for c in with_cp} == {2, 4}
    assert all(c.tp > 1 and c.world_size == 16 for c in with_cp)
    assert [c for c in long if c.cp == 1] == short  # the rest of the space as before, in its order
    # cp x tp inside a node, or tp a whole node (4 x 4 would put 2 of cp's ranks on each node)
    assert {(c.cp, c.tp) for c in with_cp if c.pp == 1} == {(2, 2), (2, 4), (2, 8), (4, 2)}
    only = dataclasses.replace(space, context_parallel=(False,))
    assert candidates(cluster, num_blocks=8, global_batch_size=16, space=only, tokens_per_sample=8200) == short


def test_a_one_device_stage_runs_every_op_replicated_with_no_collectives():
    """``dp = tp = 1`` under a pipeline: each stage is one device, where every placement holds the
    whole tensor. The stage ILP used to break that tie with layouts that convert (76 all-gathers,
    40 reduce-scatters, 31 all-to-alls, 23 all-reduces on one-rank groups for this GPT-2, priced at
    0 s, each a copy in the program; the measured memory peak moved by megabytes from step to step
    and made ``test_selective_peak_lies_between_full_and_none_as_priced`` flaky)."""
    ids, labels = token_batch()
    cfg = ParallelConfig(dp=1, tp=1, pp=2, microbatch_size=1, num_microbatches=4, schedule="gpipe")
    plan = autoplan.plan(gpt2_tiny(), "2xCPU", example_inputs=(ids,), loss_fn=lm_loss, example_targets=(labels,),
                         global_batch_size=4, config=cfg)  # fmt: skip
    assert plan.config == cfg
    assert all(spec == ("R",) for spec in plan.param_specs.values()), plan.param_specs
    assert plan.collectives == (), plan.collective_counts()


def test_a_plan_for_one_device_runs_no_collectives():
    """The same rule where the whole cluster is one device (``1xCPU``, a fixed mesh): every
    parameter whole and no collective (it ran 76 all-gathers, 39 reduce-scatters, 34 all-reduces
    and 14 all-to-alls on a one-rank group for this GPT-2)."""
    ids, labels = token_batch()
    plan = autoplan.plan(gpt2_tiny(), "1xCPU", example_inputs=(ids,), loss_fn=lm_loss, example_targets=(labels,))
    assert all(spec == ("R",) for spec in plan.param_specs.values()), plan.param_specs
    assert plan.collectives == (), plan.collective_counts()
