"""The local machine (``NxCPU``) is priced from a measurement: a profile measured once and cached
per machine and rank count, else a default measured on a reference machine and labelled as such,
else (``AUTOPLAN_LOCAL_LINKS=catalog``, the test suite's setting) the catalog."""

from __future__ import annotations

import dataclasses
import logging

import pytest

import autoplan.tools.local_links as calibrate_tool
from autoplan.cost_models import calibration
from autoplan.cost_models.calibration import (
    DEFAULT_CPU_LINK,
    LOCAL_LINKS_ENV,
    MachineKey,
    Sample,
    Sweep,
    build_profile,
    cache_profile,
    cached_profile_path,
    local_cluster,
    write_profile,
)
from autoplan.cost_models.cluster import COMM_KINDS, Cluster, current_device_model
from autoplan.cost_models.comm import collective_time_s, effective_collective
from autoplan.cost_models.errors import ConfigError
from autoplan.cost_models.step import group_link, replica_cluster
from autoplan.planner.mesh import as_cluster, stage_cluster


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty private cache and the production setting ``auto``."""
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(LOCAL_LINKS_ENV, "auto")
    return tmp_path


def measured_samples(world_size: int, *, bw_GBps: float = 0.5, latency_us: float = 3000.0) -> list[Sample]:
    """Timings of every collective of the sweep on ``world_size`` local ranks, made from known numbers."""
    samples = []
    for nbytes in Sweep().sizes_bytes():
        for kind in COMM_KINDS:
            run_kind, run_bytes = effective_collective(kind, nbytes, world_size, backend="gloo")
            t = collective_time_s(run_kind, run_bytes, world_size, bw_GBps, latency_us, algorithm="ring")
            samples.append(Sample(axis="intra", kind=kind, num_ranks=world_size, nbytes=nbytes, time_s=t))
    return samples


def measured_profile(world_size: int, *, bw_GBps: float = 0.5, latency_us: float = 3000.0) -> Cluster:
    """A profile of ``world_size`` local ranks fitted to timings made from known numbers."""
    return build_profile(
        Cluster.preset(f"{world_size}xCPU"),
        measured_samples(world_size, bw_GBps=bw_GBps, latency_us=latency_us),
        device_model=current_device_model("gloo") or "unknown",
        comm_compute_slowdown=0.25,
    )


def test_the_test_suite_prices_nxcpu_with_the_catalog():
    # tests/conftest.py: plans (golden snapshots included) must not depend on this machine
    cluster = Cluster.preset("2xCPU")
    assert local_cluster(cluster) is cluster
    assert as_cluster("2xCPU") == cluster and as_cluster("2xCPU").links_source == "catalog numbers"


def test_without_a_cached_profile_the_measured_default_is_used_and_a_warning_says_so(cache, caplog):
    with caplog.at_level(logging.WARNING, logger="autoplan.cost_models.calibration"):
        cluster = as_cluster("4xCPU")
    assert cluster.axis_link("intra") == DEFAULT_CPU_LINK  # ~2 ms and 0.7 GB/s, not the catalog's 30 us / 2 GB/s
    catalog = Cluster.preset("4xCPU").catalog_link(spans_nodes=False)
    assert cluster.axis_link("intra").latency_us > 50 * catalog.latency_us
    assert cluster.calibration is not None and cluster.calibration.origin == "default"
    assert cluster.calibration.world_size == 4
    assert cluster.links_source.startswith("measured default (AMD EPYC")
    assert cluster.device.comm_compute_slowdown == cluster.calibration.comm_compute_slowdown == 0.33
    assert "no calibration of this machine is cached" in caplog.text and "autoplan calibrate" in caplog.text
    assert not (cache / "clusters").exists()  # the library call measured nothing


def test_the_default_survives_a_plan_file_round_trip_and_loads_on_any_machine(cache, tmp_path):
    cluster = as_cluster("2xCPU")
    again = Cluster.from_dict(cluster.to_dict())
    assert again == cluster and again.to_dict()["calibration"]["origin"] == "default"
    path = write_profile(cluster, tmp_path / "default.yaml")
    assert Cluster.from_file(path) == cluster  # not rejected as "calibrated on another machine"


def test_a_cached_profile_of_this_machine_prices_every_axis_of_the_local_mesh(cache):
    profile = measured_profile(4)
    cache_profile(profile)
    cluster = as_cluster(Cluster.preset("4xCPU", mesh_shape=(2, 2)))
    link = profile.links["intra"]
    assert cluster.axis_link("intra0") == cluster.axis_link("intra1") == link
    assert cluster.calibration == profile.calibration and cluster.links_source == "calibrated"
    assert cluster.device.intra_node_latency_us == link.latency_us  # derived clusters keep the measurement
    assert cluster.device.comm_compute_slowdown == 0.25  # the cost model reads the measured slowdown here
    assert stage_cluster(cluster, _config(dp=2, tp=2)).catalog_link(spans_nodes=False).latency_us == link.latency_us
    # a stage prices each axis with the measured link, per-kind fits included, as the search's
    # groups do (replica_cluster): with the joint fit alone the stage's ILP chose another program
    for config in (_config(dp=2, tp=2), _config(dp=1, tp=2, cp=2)):
        stage = stage_cluster(cluster, config)
        assert link.collectives and all(stage.axis_link(a) == link for a in range(stage.mesh_ndim)), config
    # the search's data-parallel groups and pipeline sends too, whatever the mesh's axes are named
    assert cluster.mesh_axis_names == ("intra0", "intra1") and group_link(cluster, stride=2, size=2) == link
    group = replica_cluster(cluster, 2).axis_link(0)  # the joint search's tensor-parallel group: the device's numbers
    assert (group.bw_GBps, group.latency_us) == (link.bw_GBps, link.latency_us)
    assert replica_cluster(as_cluster("4xCPU"), 2).axis_link(0) == link  # a group of the calibrated ranks keeps the record
    # a cp x tp replica (ParallelConfig.cp) names its axes cp and tp: both keep the measured link
    # (the cluster's links are named by its own axes; a cp replica of a calibrated machine was rejected)
    replica = replica_cluster(as_cluster("4xCPU"), 2, cp=2)
    assert replica.mesh_axis_names == ("cp", "tp") and replica.axis_link(0) == replica.axis_link(1) == link
    assert as_cluster("2xCPU").calibration.origin == "default"  # another rank count: not this profile


def test_profiles_are_cached_per_machine_and_rank_count(cache):
    here = MachineKey.current()
    other = dataclasses.replace(here, num_cpus=here.num_cpus + 1)
    paths = {cached_profile_path(2), cached_profile_path(4), cached_profile_path(2, machine=other)}
    assert len(paths) == 3 and all(p.parent == cache / "clusters" for p in paths)
    assert cached_profile_path(2) == cached_profile_path(2, machine=here)


def test_clusters_that_are_not_the_local_machine_are_left_alone(cache):
    profile = measured_profile(2)
    for cluster in (Cluster.preset("2x4xCPU"), Cluster.preset("8xH100"), Cluster.preset("1xCPU"), profile):
        assert local_cluster(cluster) is cluster


def test_the_environment_chooses_default_or_catalog_and_refuses_anything_else(cache, monkeypatch):
    cache_profile(measured_profile(2))
    assert as_cluster("2xCPU").links_source == "calibrated"
    monkeypatch.setenv(LOCAL_LINKS_ENV, "default")  # deterministic: the cache is not read
    assert as_cluster("2xCPU").calibration.origin == "default"
    monkeypatch.setenv(LOCAL_LINKS_ENV, "catalog")
    assert as_cluster("2xCPU") == Cluster.preset("2xCPU")
    monkeypatch.setenv(LOCAL_LINKS_ENV, "measured")
    with pytest.raises(ConfigError, match="AUTOPLAN_LOCAL_LINKS='measured' is not one of auto, default, catalog"):
        as_cluster("2xCPU")


def test_a_damaged_cached_profile_is_a_warning_naming_it_and_a_library_call_leaves_it(cache, caplog):
    # issue #46: the cache is an optimisation; `autoplan plan` measures again (tests/test_cache_seams.py)
    path = _cache_file(2)
    path.parent.mkdir(parents=True)
    path.write_text("num_nodes: [\n")
    with caplog.at_level(logging.WARNING, logger="autoplan.cost_models.calibration"):
        assert as_cluster("2xCPU").calibration.origin == "default"
    assert path.name in caplog.text and "can be deleted" in caplog.text
    assert path.read_text() == "num_nodes: [\n"


def test_planning_measures_the_local_machine_once_then_reads_the_cache(cache, monkeypatch):
    calls = []
    profile = measured_profile(2)

    def fake_measure(cluster, sweep):
        calls.append((cluster.world_size, sweep))
        samples = [Sample(axis="intra", kind=k, num_ranks=2, nbytes=b, time_s=t) for k, b, t in _times(profile)]
        return samples, 0.3

    monkeypatch.setattr(calibrate_tool, "_measure_forked", fake_measure)
    cluster = Cluster.preset("2xCPU")
    calibrate_tool.ensure_local_calibration(cluster, quiet=True)
    calibrate_tool.ensure_local_calibration(cluster, quiet=True)
    assert calls == [(2, calibration.QUICK_SWEEP)]
    cached = Cluster.from_file(_cache_file(2))
    assert cached.calibration.comm_compute_slowdown == 0.3
    assert as_cluster(cluster).links == cached.links


def test_a_measured_slowdown_beyond_what_a_device_takes_is_capped_with_a_warning(caplog):
    profile = measured_profile(2)
    with caplog.at_level(logging.WARNING, logger="autoplan.cost_models.calibration"):
        device = calibration.measured_device(profile, dict(profile.links), 1.4, origin="test")
    assert device.comm_compute_slowdown == calibration.MAX_DEVICE_SLOWDOWN
    assert "140% slower" in caplog.text


@pytest.mark.parametrize("mode", ["catalog", "default"])
def test_planning_measures_nothing_unless_the_mode_is_auto(cache, monkeypatch, mode):
    monkeypatch.setenv(LOCAL_LINKS_ENV, mode)
    monkeypatch.setattr(calibrate_tool, "_measure_forked", _must_not_measure)
    calibrate_tool.ensure_local_calibration(Cluster.preset("2xCPU"), quiet=True)
    assert not (cache / "clusters").exists()


def test_a_failed_measurement_leaves_no_cache_and_planning_falls_back_to_the_default(cache, monkeypatch):
    monkeypatch.setattr(calibrate_tool, "_measure_forked", lambda cluster, sweep: None)
    calibrate_tool.ensure_local_calibration(Cluster.preset("2xCPU"), quiet=True)
    assert not _cache_file(2).exists()
    assert as_cluster("2xCPU").calibration.origin == "default"


def test_timings_that_cannot_be_fitted_leave_no_cache(cache, monkeypatch, caplog):
    flat = [Sample(axis="intra", kind="all_reduce", num_ranks=2, nbytes=b, time_s=1e-3) for b in (4096, 8192)]
    monkeypatch.setattr(calibrate_tool, "_measure_forked", lambda cluster, sweep: (flat, 0.1))
    calibrate_tool.ensure_local_calibration(Cluster.preset("2xCPU"), quiet=True)
    assert not _cache_file(2).exists() and "does not grow with message size" in caplog.text


@pytest.mark.slow  # forks 2 gloo ranks and times the quick sweep (~3 s idle, ~10-20 s on a loaded 2-core VM)
def test_the_quick_measurement_on_two_forked_gloo_ranks_is_cached(cache):
    calibrate_tool.ensure_local_calibration(Cluster.preset("2xCPU"), quiet=True)
    cluster = as_cluster("2xCPU")
    assert cluster.links_source == "calibrated" and set(cluster.axis_link("intra").collectives) <= set(COMM_KINDS)
    assert cluster.calibration.num_samples == len(COMM_KINDS) * len(calibration.QUICK_SWEEP.sizes_bytes())


def _must_not_measure(cluster, sweep):
    raise AssertionError(f"measured {cluster}")


def _cache_file(world_size: int):
    return cached_profile_path(world_size)


def _times(profile: Cluster):
    from autoplan.cost_models.calibration import fitted_time_s

    link = profile.links["intra"]
    for nbytes in Sweep().sizes_bytes():
        for kind in COMM_KINDS:
            s = Sample(axis="intra", kind=kind, num_ranks=2, nbytes=nbytes, time_s=1.0)
            yield kind, nbytes, fitted_time_s(s, link.params(kind), backend="gloo")


def _config(*, dp: int, tp: int, cp: int = 1):
    from autoplan.cost_models.config import ParallelConfig

    return ParallelConfig(dp=dp, tp=tp, cp=cp, pp=1, microbatch_size=1, num_microbatches=1)
