"""The caches autoplan keeps between commands never give a silent wrong result (issue #46).

* the local machine's cached calibration: only what a calibration measures (the link, the compute
  slowdown) is read back, checked against the plausible ranges; an implausible or unreadable file
  is ignored with a warning naming it and measured again;
* the plan cache: an entry holds its key, so a file copied over another key's is a miss;
* ``AUTOPLAN_WORKERS``: capped at the cores this process may run on;
* ``AUTOPLAN_CACHE_DIR`` naming a regular file: planning goes on without the cache, one warning.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

import autoplan.tools.local_links as local_links
from autoplan.cost_models import calibration
from autoplan.cost_models.calibration import (
    DEFAULT_CPU_LINK,
    LOCAL_LINKS_ENV,
    PLAUSIBLE_LATENCY_US,
    CalibrationError,
    build_profile,
    cache_profile,
    cached_profile_path,
)
from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.errors import ConfigError
from autoplan.planner import plan_cache
from autoplan.planner.mesh import as_cluster
from autoplan.planner.plan import Plan
from autoplan.planner.segment_model import available_cores, default_workers
from autoplan.tools.cli import main
from tests.test_local_calibration import measured_profile, measured_samples

GOLDEN_PLAN = Path(__file__).resolve().parent / "golden" / "plans" / "mlp.4xcpu.plan.json"
MODELS = Path(__file__).resolve().with_name("cli_models.py")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty private cache and the production setting ``auto``."""
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(LOCAL_LINKS_ENV, "auto")
    return tmp_path / "cache"


def _edit_cached(edit: Callable[[dict], object]) -> Path:
    """Cache a good profile of 2 ranks, then change its YAML with ``edit``."""
    path = cache_profile(measured_profile(2))
    assert path is not None
    data = yaml.safe_load(path.read_text())
    edit(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _absurd_latency(data: dict) -> None:
    data["links"]["intra"]["latency_us"] = 1e12
    for fit in data["links"]["intra"]["collectives"].values():
        fit["latency_us"] = 1e12


# --- 1. the cached calibration --------------------------------------------------------------------


def test_a_cached_calibration_with_an_absurd_latency_is_ignored_with_a_warning_and_measured_again(
    cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = _edit_cached(_absurd_latency)  # priced a CPU plan at "23 days per step", exit 0
    with caplog.at_level(logging.WARNING, logger="autoplan.cost_models.calibration"):
        cluster = as_cluster("2xCPU")
    assert cluster.axis_link("intra") == DEFAULT_CPU_LINK and cluster.calibration.origin == "default"
    warning = next(r.getMessage() for r in caplog.records if "ignoring the cached calibration" in r.getMessage())
    assert str(path) in warning and "can be deleted" in warning and "\n" not in warning
    assert "latency 1e+12 us is outside the plausible" in warning
    # `autoplan plan` measures again and replaces the file (atomically)
    measured = []
    monkeypatch.setattr(local_links, "_measure_forked", lambda c, s: measured.append(c) or (measured_samples(2), 0.2))
    local_links.ensure_local_calibration(Cluster.preset("2xCPU"), quiet=True)
    assert len(measured) == 1
    link = as_cluster("2xCPU").axis_link("intra")
    assert link.latency_us <= PLAUSIBLE_LATENCY_US[1] and Cluster.from_file(path).links["intra"] == link


def test_a_cached_device_section_is_never_read_only_the_measured_link_and_slowdown(cache: Path) -> None:
    def edit(data: dict) -> None:  # let a 17B model "fit" at 160 GiB per CPU rank
        data["device"]["mem_capacity_bytes"] = 1e18
        data["device"]["peak_flops"]["float32"] = 1e20

    _edit_cached(edit)
    cluster = as_cluster("2xCPU")
    preset = Cluster.preset("2xCPU").device
    assert cluster.device.mem_capacity_bytes == preset.mem_capacity_bytes
    assert cluster.device.peak_flops == preset.peak_flops
    assert cluster.links_source == "calibrated"  # the measured link is still used
    assert cluster.device.comm_compute_slowdown == 0.25
    assert cluster.device.intra_node_latency_us == cluster.axis_link("intra").latency_us


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda d: d["calibration"].update(comm_compute_slowdown=1e6), "comm_compute_slowdown 1e+06"),
        (lambda d: d["links"]["intra"]["collectives"]["send_recv"].update(bw_GBps=1e9), "send_recv fit: bandwidth"),
        (lambda d: d["calibration"].update(world_size=4), "not a calibration of 2 CPU ranks"),
        (lambda d: d.pop("calibration"), "no calibration record"),
    ],
    ids=["slowdown", "bandwidth", "world-size", "no-record"],
)
def test_an_implausible_cached_calibration_is_ignored_naming_the_file(
    cache: Path, caplog: pytest.LogCaptureFixture, edit: Callable[[dict], object], fragment: str
) -> None:
    path = _edit_cached(edit)
    with caplog.at_level(logging.WARNING, logger="autoplan.cost_models.calibration"):
        cluster = as_cluster("2xCPU")
    assert cluster.calibration.origin == "default"
    assert str(path) in caplog.text and fragment in caplog.text and "can be deleted" in caplog.text


def test_an_unreadable_cached_calibration_is_a_warning_not_an_error(
    cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = cached_profile_path(2)
    path.parent.mkdir(parents=True)
    path.write_text("num_nodes: [\n")
    with caplog.at_level(logging.WARNING, logger="autoplan.cost_models.calibration"):
        assert as_cluster("2xCPU").calibration.origin == "default"
        as_cluster("2xCPU")  # read again (as `autoplan plan` does): not warned twice
    warnings = [r for r in caplog.records if "ignoring the cached calibration" in r.getMessage()]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage()
    assert path.read_text() == "num_nodes: [\n"  # a library call measures nothing and writes nothing


def test_a_measurement_outside_the_plausible_ranges_is_refused_and_not_cached(
    cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(CalibrationError, match="implausible"):
        build_profile(Cluster.preset("2xCPU"), measured_samples(2, latency_us=1e9), device_model="x")
    slow = measured_samples(2, latency_us=1e9)
    monkeypatch.setattr(local_links, "_measure_forked", lambda c, s: (slow, 0.1))
    with caplog.at_level(logging.WARNING):
        local_links.ensure_local_calibration(Cluster.preset("2xCPU"), quiet=True)
    assert not cached_profile_path(2).exists() and "implausible" in caplog.text
    profile = measured_profile(2)
    assert calibration.cached_profile_problem(profile, 2) is None
    assert calibration.cached_profile_problem(profile, 4) is not None


# --- 2. the plan cache ----------------------------------------------------------------------------


def test_a_plan_cache_entry_copied_over_another_key_is_a_miss_and_is_replaced(
    cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    entry = plan_cache.CacheEntry(plan=Plan.load(GOLDEN_PLAN), forward_fingerprint="f")
    mine, other = "a" * 32, "b" * 32
    plan_cache.store(mine, entry)
    shutil.copyfile(cache / "plans" / f"{mine}.json", cache / "plans" / f"{other}.json")
    assert plan_cache.load(mine) is not None
    with caplog.at_level(logging.WARNING, logger="autoplan.planner.plan_cache"):
        assert plan_cache.load(other) is None  # was: the 4-device plan of another request, exit 0
    assert "stored for another request" in caplog.text and other in caplog.text
    plan_cache.store(other, entry)  # the planner stores its own plan over the bad entry
    assert plan_cache.load(other) is not None


# --- 3. AUTOPLAN_WORKERS --------------------------------------------------------------------------


def test_autoplan_workers_is_capped_at_the_cores_this_process_may_run_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cores = available_cores()
    with caplog.at_level(logging.WARNING, logger="autoplan.planner.segment_model"):
        monkeypatch.setenv("AUTOPLAN_WORKERS", str(10**20))  # was handed to the process pool as is
        assert default_workers() == cores
        assert f"more than the {cores} CPU cores" in caplog.text
        monkeypatch.setenv("AUTOPLAN_WORKERS", "9" * 5000)  # was int()'s ValueError traceback
        assert default_workers() == cores
    monkeypatch.setenv("AUTOPLAN_WORKERS", "1")
    assert default_workers() == 1
    monkeypatch.setenv("AUTOPLAN_WORKERS", "²")  # str.isdigit() but not int(): was a ValueError traceback
    with pytest.raises(ConfigError, match="must be a positive integer"):
        default_workers()


# --- 4. AUTOPLAN_CACHE_DIR naming a regular file ----------------------------------------------------


def test_a_cache_dir_that_is_a_regular_file_plans_without_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    not_a_dir = tmp_path / "cache-file"
    not_a_dir.write_text("x")
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(not_a_dir))
    monkeypatch.setenv(LOCAL_LINKS_ENV, "auto")
    monkeypatch.delenv("AUTOPLAN_NO_PLAN_CACHE", raising=False)
    # the measurement could not be kept: it is not made (was: measured, then a NotADirectoryError traceback)
    monkeypatch.setattr(local_links, "_measure_forked", lambda c, s: (measured_samples(2), 0.2))
    out = tmp_path / "p.json"
    with caplog.at_level(logging.WARNING):
        rc = main(["plan", f"{MODELS}:mlp", "--cluster", "2xCPU", "--out", str(out), "--quiet"])
        err = capfd.readouterr().err
        assert rc == 0 and out.is_file() and "Traceback" not in err, err
        cache_lines = [r.getMessage() for r in caplog.records if "cannot use the cache folder" in r.getMessage()]
        assert len(cache_lines) == 1 and str(not_a_dir) in cache_lines[0], caplog.text
        assert not_a_dir.read_text() == "x"
        assert cache_profile(measured_profile(2)) is None  # `autoplan calibrate` writes --out, caches nothing
        plan_cache.store("c" * 32, plan_cache.CacheEntry(plan=Plan.load(GOLDEN_PLAN), forward_fingerprint="f"))
    assert len([r for r in caplog.records if "cannot use the cache folder" in r.getMessage()]) == 1
