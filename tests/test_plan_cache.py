"""Plan cache: an unchanged (model, inputs, cluster, options) re-plans from the cache; any change
misses; a corrupted entry is a miss that gets replaced."""

from __future__ import annotations

import time

from autoplan.api import plan
from autoplan.cost_models.cluster import Cluster
from autoplan.planner import plan_cache
from tests.zoo import gpt2_tiny, lm_loss, token_batch


def _plan(model, **kw):  # noqa: ANN001, ANN003, ANN202
    ids, labels = token_batch()
    return plan(model, "1x2xCPU", example_inputs=(ids,), loss_fn=lm_loss, example_targets=(labels,),
                global_batch_size=8, **kw)  # fmt: skip


def test_replanning_an_unchanged_model_hits_the_cache(tmp_path, monkeypatch):  # noqa: ANN001
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path))
    model = gpt2_tiny(num_layers=3)
    t0 = time.perf_counter()
    first = _plan(model)
    cold_s = time.perf_counter() - t0
    entries = list((tmp_path / "plans").glob("*.json"))
    assert len(entries) == 1
    t0 = time.perf_counter()
    again = _plan(gpt2_tiny(num_layers=3))  # an equal model built again
    warm_s = time.perf_counter() - t0
    assert again.to_dict() == first.to_dict()
    assert warm_s < cold_s / 3, (warm_s, cold_s)
    # a different option or model misses
    ids, labels = token_batch()
    k = lambda m, **o: plan_cache.plan_key(m, (ids,), (labels,), lm_loss, Cluster.preset("1x2xCPU"), o, None)  # noqa: E731
    assert k(model, precision="fp32") != k(model, precision="bf16")
    assert k(model) != k(gpt2_tiny(num_layers=4))
    assert k(model) == k(gpt2_tiny(num_layers=3))
    # a corrupted entry is a miss, and is replaced by a good one
    entries[0].write_text("{ not json")
    replanned = _plan(model)
    assert replanned.config == first.config
    assert plan_cache.load(entries[0].stem) is not None
    monkeypatch.setenv("AUTOPLAN_NO_PLAN_CACHE", "1")
    assert plan_cache.load(entries[0].stem) is None
