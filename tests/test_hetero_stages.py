"""Stages on sub-meshes of different sizes (``stage_dp``): the heavy stage gets more devices.

Synthetic segment costs that scale linearly with the samples per device, so every number below
can be worked out by hand:

    segment time(b samples) = base_s * b,   saved bytes = 1 MB * b,   params = 1M elements

The model is ``prologue, 6 light blocks, 1 heavy epilogue (4x a block)`` on 8 devices with a
4-stage pipeline. Uniform stages (dp=2 each) cannot split the epilogue, so its stage sets the
pace: with b=2 per replica the last stage takes ``(1 + 4) * 2 = 10`` units per micro-batch while
the others take 2-4. Giving the epilogue's stage 4 replicas (and two light stages one each)
halves it.
"""

from __future__ import annotations

import dataclasses

import pytest

from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.config import ParallelConfig
from autoplan.cost_models.errors import ConfigError
from autoplan.cost_models.step import SegmentCost, SegmentCosts, evaluate
from autoplan.planner.search import SearchSpace, hetero_layout, hetero_split, search

UNIT_S = 1e-3


def _seg(weight: float, b: int, *, params: int = 1_000_000) -> SegmentCost:
    t = weight * b * UNIT_S
    return SegmentCost(
        fwd_s=t / 3, bwd_s=2 * t / 3, bwd_weight_s=t / 3, fwd_comm_s=0.0, bwd_comm_s=0.0,
        selective_recompute_s=t / 10, full_recompute_s=t / 3, grad_sync_s=0.0, optimizer_s=1e-6, param_numel=params,
        trainable_numel=params, param_itemsize=4,
        saved_bytes=1e6 * b, selective_kept_bytes=5e5 * b, full_kept_bytes=1e5 * b,
        input_bytes=1e5 * b, flops=1e9 * weight * b,
    )  # fmt: skip


def _costs(b: int, weights: tuple[float, ...] = (0.1, 1, 1, 1, 1, 1, 1, 4)) -> SegmentCosts:
    segs = tuple(_seg(w, b) for w in weights)
    return SegmentCosts(segments=segs, cut_bytes=tuple(1e5 * b for _ in segs), optimizer="adam")


CLUSTER = Cluster.preset("1x8xH100")


def _cand(**kw: object) -> ParallelConfig:
    base = dict(dp=2, tp=1, pp=4, microbatch_size=2, num_microbatches=8, schedule="1f1b", virtual_stages=1,
                recompute="none", zero_stage=0)  # fmt: skip
    return ParallelConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_split_gives_the_heavy_stage_more_devices():
    # per-micro-batch time of segment s on a stage of degree d: weight[s] * (S / d), S = 4 samples
    weights = (0.1, 1, 1, 1, 1, 1, 1, 4)
    split = hetero_split(
        lambda d: [w * 4 / d for w in weights], num_segments=8, num_stages=4, units=8, degrees=(1, 2, 4)
    )
    assert split is not None
    starts, stage_dp = split
    assert sum(stage_dp) == 8
    # the epilogue's stage is the one with the most replicas
    assert stage_dp[-1] == max(stage_dp) == 4
    # the slowest stage: recompute it from the split and compare with the uniform split (dp=2 each)
    bounds = [*starts, 8]
    slowest = max(sum(weights[bounds[k] : bounds[k + 1]]) * 4 / stage_dp[k] for k in range(4))
    # optimum by hand: every stage needs a block, so the epilogue shares its 4 replicas with 2
    # blocks ((1 + 1 + 4) * 4 / 4 = 6); the other 4 units hold prologue + 4 blocks as 1 | 1 | 2
    # blocks on degrees 1 | 1 | 2 (4.4, 4, 4). Uniform (dp=2 each) needs block + epilogue on one
    # stage: (1 + 4) * 4 / 2 = 10.
    assert slowest == pytest.approx(6.0)


def test_uniform_degrees_reproduce_the_uniform_estimate():
    """stage_dp = (dp,) * pp must price exactly like the uniform candidate."""
    cand = _cand()
    uniform = evaluate(cand, _costs(2), CLUSTER, stage_starts=(0, 3, 5, 7))
    same = evaluate(
        dataclasses.replace(cand, stage_dp=(2, 2, 2, 2)), _costs(2), CLUSTER, stage_starts=(0, 3, 5, 7),
        stage_costs=[_costs(2)] * 4,
    )  # fmt: skip
    assert same.step_time_s == pytest.approx(uniform.step_time_s, rel=1e-12)
    assert same.memory_per_device_bytes == pytest.approx(uniform.memory_per_device_bytes, rel=1e-12)
    assert same.mfu == pytest.approx(uniform.mfu, rel=1e-12)


def test_hetero_layout_beats_uniform_and_prices_each_stage_on_its_devices():
    cand = _cand()
    space = SearchSpace(microbatch_sizes=(1, 2, 4))
    hetero = hetero_layout(cand, _costs, CLUSTER, space=space, precision="fp32", tokens_per_sample=1)
    assert hetero is not None
    stage_dp = hetero.config.stage_dp
    assert stage_dp is not None and sum(stage_dp) == 8 and stage_dp[-1] == 4
    uniform = evaluate(cand, _costs(2), CLUSTER, stage_starts=(0, 3, 5, 7))
    assert hetero.step_time_s < 0.8 * uniform.step_time_s
    # each stage's memory is that of its own degree: the 1-replica stages hold 4 samples per
    # micro-batch, the epilogue's 4-replica stage 1 sample
    for st, d in zip(hetero.stages, stage_dp, strict=True):
        assert st.dp == d
        samples = 4 // d
        nseg = st.segments[1] - st.segments[0]
        inflight = st.memory_parts["activations"] / (1e6 * samples * nseg)
        assert inflight == pytest.approx(round(inflight))  # whole micro-batches of this stage's share
    # same work, same FLOPs
    assert hetero.flops_per_step == pytest.approx(uniform.flops_per_step)


def test_search_uses_hetero_stages_only_when_allowed():
    space = SearchSpace(schedules=("1f1b",), recompute=("none",), zero_stages=(0,), microbatch_sizes=(1, 2, 4))
    best, _ = search(lambda tp, b, *key: _costs(b), CLUSTER, num_blocks=6, global_batch_size=32, space=space)
    off = dataclasses.replace(space, hetero_stages=False)
    best_uniform, _ = search(lambda tp, b, *key: _costs(b), CLUSTER, num_blocks=6, global_batch_size=32, space=off)
    assert best_uniform.config.stage_dp is None
    assert best.step_time_s <= best_uniform.step_time_s
    # balanced model: no stage is heavier, so no sub-mesh differs from the uniform one
    flat = (1.0,) * 8
    even, _ = search(lambda tp, b, *key: _costs(b, flat), CLUSTER, num_blocks=6, global_batch_size=32, space=space)
    assert even.config.stage_dp is None or len(set(even.config.stage_dp)) == 1


class _ArrivingCosts:
    """A cost model whose (tp, b) costs come in one at a time, smallest b first, as from
    ``SegmentCostModel.prefetch``'s workers; between two arrivals the search's ``while_waiting``
    runs until it has nothing left to do."""

    def __init__(self) -> None:
        self.arrived: set[tuple[int, int]] = set()
        self.laid_out_early = 0

    def __call__(self, tp: int, b: int, *key: int) -> SegmentCosts:
        return _costs(b) if tp == 1 else _costs(b, (0.1, 2, 2, 2, 2, 2, 2, 8))

    def ready(self, tp: int, b: int, *key: int) -> bool:
        return (tp, b) in self.arrived

    def prefetch(self, keys, *, while_waiting=None) -> None:  # noqa: ANN001
        for key in sorted(keys, key=lambda k: (k[1], -k[0])):
            self.arrived.add(key[:2])  # (tp, b); a sequence-parallel key adds (cp, 1)
            while while_waiting is not None and while_waiting():
                self.laid_out_early += 1


def test_candidates_laid_out_while_costs_arrive_change_nothing():
    """The search lays out candidates whose costs are in while the others are solved; its best
    configuration and the list of candidates it evaluated are exactly those of the search that
    waits for every cost first (pruning included, heterogeneous splits over sizes not in yet
    left to the main loop)."""
    space = SearchSpace(schedules=("1f1b", "gpipe"), recompute=("none", "full"), zero_stages=(0, 1),
                        microbatch_sizes=(1, 2, 4))  # fmt: skip
    arriving = _ArrivingCosts()
    best, every = search(arriving, CLUSTER, num_blocks=6, global_batch_size=32, space=space)
    waited, every_waited = search(arriving.__call__, CLUSTER, num_blocks=6, global_batch_size=32, space=space)
    assert arriving.laid_out_early > 0
    assert best == waited
    assert every == every_waited


def test_config_stage_dp_checks_name_the_numbers():
    with pytest.raises(ConfigError, match="one positive degree per pipeline stage"):
        ParallelConfig(dp=2, pp=4, microbatch_size=2, num_microbatches=8, stage_dp=(1, 2))
    with pytest.raises(ConfigError, match="must divide the 4 samples"):
        ParallelConfig(dp=2, pp=2, microbatch_size=2, num_microbatches=8, stage_dp=(3, 1))
    cfg = ParallelConfig(dp=2, pp=4, microbatch_size=2, num_microbatches=8, stage_dp=[1, 1, 2, 4])  # type: ignore[arg-type]
    assert cfg.stage_dp == (1, 1, 2, 4) and cfg.world_size == 8
    assert ParallelConfig.from_dict(cfg.to_dict()) == cfg
    assert "stage_dp=[1, 1, 2, 4]" in str(cfg)
    with pytest.raises(ConfigError, match=r"tp\*sum\(stage_dp\) = 1\*8 = 8 but the cluster has 16"):
        cfg.check_against(world_size=16, devices_per_node=8, num_blocks=6, global_batch_size=32)


@pytest.mark.slow
def test_estimate_prices_stage_dp_on_a_real_model():
    """Through the public what-if API on a traced GPT-2: uniform degrees written as stage_dp price
    exactly like the uniform config; a heterogeneous config prices each stage on its own share;
    the planner refuses to run it (estimate only)."""
    import autoplan
    from tests.zoo import gpt2_tiny, lm_loss, token_batch

    ids, labels = token_batch()
    model = gpt2_tiny(num_layers=4)
    kw = dict(loss_fn=lm_loss, example_targets=(labels,), global_batch_size=16)
    base = dict(dp=2, pp=4, microbatch_size=2, num_microbatches=4, schedule="1f1b")
    uniform = autoplan.estimate(model, "2x4xA100-80GB", (ids,), config=ParallelConfig(**base), **kw)  # type: ignore[arg-type]
    same_cfg = ParallelConfig(**base, stage_dp=(2, 2, 2, 2))  # type: ignore[arg-type]
    same = autoplan.estimate(model, "2x4xA100-80GB", (ids,), config=same_cfg, **kw)  # type: ignore[arg-type]
    assert same.step_time_s == pytest.approx(uniform.step_time_s, rel=1e-9)
    assert same.memory_per_device_bytes == pytest.approx(uniform.memory_per_device_bytes, rel=1e-9)
    hetero_cfg = ParallelConfig(**base, stage_dp=(1, 1, 2, 4))  # type: ignore[arg-type]
    hetero = autoplan.estimate(model, "2x4xA100-80GB", (ids,), config=hetero_cfg, **kw)  # type: ignore[arg-type]
    assert hetero.config.stage_dp == (1, 1, 2, 4)
    # a stage with one replica keeps 4 samples per micro-batch in flight, four replicas 1 sample
    acts = [parts["activations"] for parts in hetero.memory_parts_bytes]
    assert acts[0] > acts[3]
    with pytest.raises(ConfigError, match=r"stage_dp=\[1, 1, 2, 4\] can be estimated"):
        autoplan.plan(model, "2x4xA100-80GB", example_inputs=(ids,), config=hetero_cfg, **kw)  # type: ignore[arg-type]
