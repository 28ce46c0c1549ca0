"""Calibrated communication model: formulas restated, fits recovered, cluster profiles checked.

The formulas of ``autoplan.cost_models.comm`` are restated in a comment next to each check; the fit is
checked on synthetic timings made from known (latency, bandwidth); profiles are round-tripped
through files and rejected when they come from elsewhere; one real calibration runs on 2 gloo
ranks through the CLI.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import yaml
from torch.distributed.tensor import Partial, Replicate, Shard

import autoplan.tools.cli
from autoplan.cost_models.calibration import (
    CalibrationError,
    Sample,
    Sweep,
    build_profile,
    fit_samples,
    sample_time_s,
    write_profile,
)
from autoplan.cost_models.cluster import COMM_KINDS, Cluster, CollectiveFit, LinkSpec, current_device_model
from autoplan.cost_models.comm import collective_time_s, effective_collective, link_time_s, transition_cost_s
from autoplan.cost_models.errors import ClusterSpecError

R, P, S0 = Replicate(), Partial("sum"), Shard(0)
MiB = 1024**2

# --- Formulas -------------------------------------------------------------------------------------


def test_a_sample_is_the_mean_of_its_repetitions_late_rank_waits_included() -> None:
    # A step pays every collective's expected time: one wait of 10 ms for a late rank among
    # four 1 ms calls costs (4 * 1 + 10) / 5 = 2.8 ms on average, where the median says 1 ms.
    assert sample_time_s([1e-3, 1e-3, 10e-3, 1e-3, 1e-3]) == pytest.approx(2.8e-3)
    with pytest.raises(CalibrationError, match="at least one timed repetition"):
        sample_time_s([])


def test_ring_all_reduce_is_reduce_scatter_plus_all_gather() -> None:
    # all_reduce_ring(B) = 2 (n-1)/n * B / bw + 2 (n-1) * lat
    n, nbytes, bw_GBps, lat_us = 4, 8 * MiB, 100.0, 5.0
    expected = 2 * (n - 1) / n * nbytes / (bw_GBps * 1e9) + 2 * (n - 1) * lat_us * 1e-6
    assert collective_time_s("all_reduce", nbytes, n, bw_GBps, lat_us, algorithm="ring") == pytest.approx(expected)


@pytest.mark.parametrize("n", [2, 6, 8])
def test_tree_all_reduce_pays_log_latency_and_twice_the_bytes(n: int) -> None:
    # all_reduce_tree(B) = 2 * B / bw + 2 * ceil(log2 n) * lat   (NCCL double binary tree)
    nbytes, bw_GBps, lat_us = 1 * MiB, 50.0, 10.0
    expected = 2 * nbytes / (bw_GBps * 1e9) + 2 * math.ceil(math.log2(n)) * lat_us * 1e-6
    assert collective_time_s("all_reduce", nbytes, n, bw_GBps, lat_us, algorithm="tree") == pytest.approx(expected)


def test_send_recv_is_one_latency_plus_bytes_over_bandwidth() -> None:
    # send_recv(B) = lat + B / bw   (for any group size >= 2)
    nbytes, bw_GBps, lat_us = 3 * MiB, 25.0, 7.0
    expected = lat_us * 1e-6 + nbytes / (bw_GBps * 1e9)
    assert collective_time_s("send_recv", nbytes, 2, bw_GBps, lat_us) == pytest.approx(expected)
    assert collective_time_s("send_recv", nbytes, 8, bw_GBps, lat_us) == pytest.approx(expected)
    assert collective_time_s("send_recv", nbytes, 1, bw_GBps, lat_us) == 0.0


@pytest.mark.parametrize("nbytes", [4096, 64 * 1024, 1 * MiB, 64 * MiB, 1e9])
@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_auto_all_reduce_is_the_cheaper_of_ring_and_tree(n: int, nbytes: float) -> None:
    ring = collective_time_s("all_reduce", nbytes, n, 450.0, 3.0, algorithm="ring")
    tree = collective_time_s("all_reduce", nbytes, n, 450.0, 3.0, algorithm="tree")
    assert collective_time_s("all_reduce", nbytes, n, 450.0, 3.0) == pytest.approx(min(ring, tree))


def test_tree_wins_below_the_crossover_size_and_ring_above_it() -> None:
    # ring - tree = B * (2(n-1)/n - 2) / bw + lat * (2(n-1) - 2 log2 n)
    #             = -2 B / (n bw) + 2 lat (n - 1 - log2 n), so ring wins once
    # B > n * bw * lat * (n - 1 - log2 n) = 8 * 450e9 * 3e-6 * (7 - 3) = 43.2 MB for n = 8
    crossover = 8 * 450e9 * 3e-6 * (7 - 3)
    for nbytes, algorithm in [(crossover / 2, "tree"), (crossover * 2, "ring")]:
        expected = collective_time_s("all_reduce", nbytes, 8, 450.0, 3.0, algorithm=algorithm)
        assert collective_time_s("all_reduce", nbytes, 8, 450.0, 3.0) == pytest.approx(expected)
    ring = collective_time_s("all_reduce", crossover, 8, 450.0, 3.0, algorithm="ring")
    assert ring == pytest.approx(collective_time_s("all_reduce", crossover, 8, 450.0, 3.0, algorithm="tree"))


def test_tree_is_only_defined_for_all_reduce_and_unknown_kinds_raise() -> None:
    with pytest.raises(ValueError, match="all_reduce only"):
        collective_time_s("all_gather", 4096, 4, 1.0, 1.0, algorithm="tree")
    with pytest.raises(ValueError, match="unknown communication kind 'broadcast'"):
        collective_time_s("broadcast", 4096, 4, 1.0, 1.0)
    assert collective_time_s("shard", 4096, 4, 1.0, 1.0) == 0.0


def test_gloo_all_to_all_is_priced_as_an_all_gather_of_the_whole_axis() -> None:
    # gloo has no all_to_all: DTensor gathers n * B_local and keeps its chunk
    assert effective_collective("all_to_all", 1000, 4, backend="gloo") == ("all_gather", 4000)
    assert effective_collective("all_to_all", 1000, 4, backend="nccl") == ("all_to_all", 1000)


def test_link_prices_a_fitted_kind_with_its_own_numbers_in_the_ring_convention() -> None:
    fitted = CollectiveFit(bw_GBps=2.0, latency_us=50.0)
    link = LinkSpec(bw_GBps=10.0, latency_us=5.0, spans_nodes=False, collectives={"all_reduce": fitted})
    n, nbytes = 8, 1 * MiB
    # fitted all_reduce: 2 (n-1)/n * B / 2 GB/s + 2 (n-1) * 50 us, never re-priced as a tree
    expected = 2 * (n - 1) / n * nbytes / 2e9 + 2 * (n - 1) * 50e-6
    assert link_time_s("all_reduce", nbytes, n, link, backend="nccl") == pytest.approx(expected)
    # all_gather has no fit: generic link numbers, (n-1)/n * B / 10 GB/s + (n-1) * 5 us
    expected_ag = (n - 1) / n * nbytes / 10e9 + (n - 1) * 5e-6
    assert link_time_s("all_gather", nbytes, n, link, backend="nccl") == pytest.approx(expected_ag)
    assert link.params("all_gather") == CollectiveFit(bw_GBps=10.0, latency_us=5.0)


def test_cpu_clusters_price_all_reduce_as_a_ring_and_gpu_clusters_pick_the_cheaper() -> None:
    nbytes = 4096
    cpu = Cluster.preset("8xCPU")
    link = cpu.axis_link(0)
    ring = collective_time_s("all_reduce", nbytes, 8, link.bw_GBps, link.latency_us, algorithm="ring")
    assert transition_cost_s((P,), (R,), nbytes, cpu) == pytest.approx(ring)
    gpu = Cluster.preset("8xH100")
    link = gpu.axis_link(0)
    tree = collective_time_s("all_reduce", nbytes, 8, link.bw_GBps, link.latency_us, algorithm="tree")
    assert transition_cost_s((P,), (R,), nbytes, gpu) == pytest.approx(tree)


# --- Fit ------------------------------------------------------------------------------------------


def _synthetic(
    kinds: tuple[str, ...],
    *,
    n: int,
    bw_GBps: float,
    latency_us: float,
    backend: str = "gloo",
    axis: str = "intra",
    wobble: float = 0.01,
) -> list[Sample]:
    """Timings from the ring formulas with a deterministic +-``wobble`` relative error."""
    samples = []
    for i, nbytes in enumerate(Sweep().sizes_bytes()):
        for kind in kinds:
            run_kind, run_bytes = effective_collective(kind, nbytes, n, backend=backend)  # type: ignore[arg-type]
            t = collective_time_s(run_kind, run_bytes, n, bw_GBps, latency_us, algorithm="ring")
            samples.append(
                Sample(axis=axis, kind=kind, num_ranks=n, nbytes=nbytes, time_s=t * (1 + wobble * (-1) ** i))  # type: ignore[arg-type]
            )
    return samples


def test_sweep_doubles_from_4_kib_to_16_mib() -> None:
    sizes = Sweep().sizes_bytes()
    assert sizes[0] == 4096 and sizes[-1] == 16 * MiB and len(sizes) == 13
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:]))
    with pytest.raises(CalibrationError, match="at least 2 times"):
        Sweep(max_bytes=4096)


def test_a_sweep_can_step_by_a_larger_factor() -> None:
    sizes = Sweep(max_bytes=16 * MiB, size_factor=8).sizes_bytes()
    assert sizes == (4096, 32 * 1024, 256 * 1024, 2 * MiB, 16 * MiB)
    with pytest.raises(CalibrationError, match="at least 8 times"):
        Sweep(max_bytes=16 * 1024, size_factor=8)


@pytest.mark.parametrize("kind", COMM_KINDS)
def test_fit_recovers_the_latency_and_bandwidth_of_each_kind(kind: str) -> None:
    samples = _synthetic((kind,), n=4, bw_GBps=1.7, latency_us=45.0)
    fit = fit_samples(samples, backend="gloo")
    assert fit.bw_GBps == pytest.approx(1.7, rel=0.03)
    assert fit.latency_us == pytest.approx(45.0, rel=0.05)
    assert fit.fit_err == pytest.approx(0.01, abs=0.005)


def test_joint_fit_over_all_kinds_recovers_the_link() -> None:
    samples = _synthetic(COMM_KINDS, n=8, bw_GBps=120.0, latency_us=4.0, backend="nccl", wobble=0.0)
    fit = fit_samples(samples, backend="nccl")
    assert fit.bw_GBps == pytest.approx(120.0, rel=1e-3)
    assert fit.latency_us == pytest.approx(4.0, rel=1e-3)
    assert fit.fit_err == pytest.approx(0.0, abs=1e-6)


def test_negative_latency_is_clamped_to_zero_and_bandwidth_refitted() -> None:
    # times = B / bw - 20 us: the unconstrained fit would give a negative latency
    samples = [
        Sample(axis="intra", kind="send_recv", num_ranks=2, nbytes=b, time_s=b / 2e9 - 20e-6 * (b < 1e6))
        for b in Sweep(min_bytes=256 * 1024).sizes_bytes()
    ]
    fit = fit_samples(samples, backend="gloo")
    assert fit.latency_us == 0.0
    assert fit.bw_GBps > 0


def test_timings_that_do_not_grow_with_size_cannot_give_a_bandwidth() -> None:
    samples = [
        Sample(axis="intra", kind="all_gather", num_ranks=2, nbytes=b, time_s=1e-3 - 1e-12 * b)
        for b in Sweep().sizes_bytes()
    ]
    with pytest.raises(CalibrationError, match="does not grow with message size.*raise --max-bytes"):
        fit_samples(samples, backend="gloo")


# --- Profiles -------------------------------------------------------------------------------------


@pytest.fixture()
def profile() -> Cluster:
    """A 4-CPU (2, 2) mesh calibrated from synthetic timings: two axes, different links."""
    cluster = Cluster.preset("4xCPU", mesh_shape=(2, 2))
    samples = _synthetic(COMM_KINDS, n=2, bw_GBps=1.5, latency_us=40.0, axis="intra0")
    samples += _synthetic(COMM_KINDS, n=2, bw_GBps=3.0, latency_us=20.0, axis="intra1")
    return build_profile(cluster, samples, device_model=current_device_model("gloo") or "unknown")


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_profile_round_trips_through_a_file_with_its_links(tmp_path, profile: Cluster, suffix: str) -> None:
    path = write_profile(profile, tmp_path / f"profile{suffix}")
    loaded = Cluster.from_file(path)

    assert loaded == profile
    assert loaded.links == profile.links and loaded.calibration == profile.calibration
    assert set(loaded.links["intra0"].collectives) == set(COMM_KINDS)
    assert loaded.axis_link("intra1").bw_GBps == pytest.approx(3.0, rel=0.03)
    assert loaded.axis_link(0).params("all_reduce").latency_us == pytest.approx(40.0, rel=0.05)
    assert not list(tmp_path.glob(".*.tmp")), "the atomic write left its temporary file"


def test_transition_cost_uses_the_calibrated_all_reduce_of_the_axis(profile: Cluster) -> None:
    fit = profile.axis_link("intra1").params("all_reduce")
    nbytes = 4 * MiB
    # P -> R on axis 1 (2 ranks), ring with the fitted numbers: 2 (n-1)/n * B / bw + 2 (n-1) * lat
    expected = 2 * (1 / 2) * nbytes / (fit.bw_GBps * 1e9) + 2 * 1 * fit.latency_us * 1e-6
    assert transition_cost_s((R, P), (R, R), nbytes, profile) == pytest.approx(expected)
    catalog = Cluster.preset("4xCPU", mesh_shape=(2, 2))
    assert transition_cost_s((R, P), (R, R), nbytes, catalog) != pytest.approx(expected)


def test_calibration_record_says_where_the_profile_was_measured(profile: Cluster) -> None:
    info = profile.calibration
    assert info is not None
    assert (info.device, info.backend, info.world_size) == ("CPU", "gloo", 4)
    assert info.torch_version == torch.__version__
    assert info.num_samples == 2 * len(COMM_KINDS) * len(Sweep().sizes_bytes())
    assert info.fit_err_median == pytest.approx(0.01, abs=0.005)


def _edit(tmp_path, profile: Cluster, change) -> object:
    data = profile.to_dict()
    change(data)
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_profile_from_another_torch_version_is_rejected_unless_checks_are_off(tmp_path, profile: Cluster) -> None:
    path = _edit(tmp_path, profile, lambda d: d["calibration"].update(torch_version="1.13.1"))
    with pytest.raises(ClusterSpecError, match=r"edited\.yaml.*torch 1\.13\.1.*autoplan calibrate") as info:
        Cluster.from_file(path)
    assert "\n" not in str(info.value)
    assert Cluster.from_file(path, check_versions=False).calibration.torch_version == "1.13.1"


def test_profile_from_another_cpu_model_is_rejected(tmp_path, profile: Cluster) -> None:
    path = _edit(tmp_path, profile, lambda d: d["calibration"].update(device_model="Some Other CPU 9000"))
    with pytest.raises(ClusterSpecError, match=r"edited\.yaml.*'Some Other CPU 9000'.*autoplan calibrate"):
        Cluster.from_file(path)


def test_profile_calibrated_on_another_device_than_it_describes_is_rejected(tmp_path, profile: Cluster) -> None:
    path = _edit(tmp_path, profile, lambda d: d["calibration"].update(device="H100", backend="nccl"))
    with pytest.raises(ClusterSpecError, match=r"edited\.yaml.*calibrated on device 'H100'.*'CPU'"):
        Cluster.from_file(path, check_versions=False)


def test_gpu_profile_loads_on_a_machine_without_gpus(tmp_path) -> None:
    cluster = Cluster.preset("2xH100")
    samples = _synthetic(COMM_KINDS, n=2, bw_GBps=300.0, latency_us=8.0, backend="nccl")
    path = write_profile(build_profile(cluster, samples, device_model="NVIDIA H100 80GB HBM3"), tmp_path / "h100.yaml")
    if torch.cuda.is_available() and current_device_model("nccl") != "NVIDIA H100 80GB HBM3":
        with pytest.raises(ClusterSpecError, match="NVIDIA H100 80GB HBM3"):
            Cluster.from_file(path)
    else:
        assert Cluster.from_file(path).axis_link(0).is_calibrated


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda d: d["links"].update(tp=d["links"]["intra0"]), "no mesh axis named 'tp'"),
        (lambda d: d["links"]["intra0"].update(bw_GBps=-1.0), "bw_GBps must be a positive"),
        (lambda d: d["links"]["intra0"]["collectives"]["all_gather"].update(latency_us=-3), "latency_us"),
        (lambda d: d["links"]["intra0"]["collectives"].update(broadcast={"bw_GBps": 1, "latency_us": 1}), "broadcast"),
        (lambda d: d["calibration"].update(world_size=2), "calibrated on 2 ranks"),
        (lambda d: d["calibration"].pop("date"), "missing key date"),
    ],
    ids=["unknown-axis", "negative-bw", "negative-latency", "unknown-kind", "world-size", "missing-date"],
)
def test_malformed_profile_sections_raise_one_line_naming_the_file(tmp_path, profile: Cluster, change, fragment):
    path = _edit(tmp_path, profile, change)
    with pytest.raises(ClusterSpecError) as info:
        Cluster.from_file(path, check_versions=False)
    message = str(info.value)
    assert "edited.yaml" in message and fragment in message and "\n" not in message


def test_corrupted_profile_is_an_error_naming_the_file(tmp_path, profile: Cluster) -> None:
    path = write_profile(profile, tmp_path / "corrupt.yaml")
    text = path.read_text()
    path.write_text(text[: len(text) * 2 // 3] + "\n  links: [unclosed\n")
    with pytest.raises(ClusterSpecError, match=r"corrupt\.yaml.*(not valid YAML|links)") as info:
        Cluster.from_file(path)
    assert "\n" not in str(info.value)


def test_with_mesh_keeps_links_of_unchanged_axes_only(profile: Cluster) -> None:
    same = profile.with_mesh((2, 2))
    assert same.links == profile.links
    flat = profile.with_mesh((4,))
    assert flat.links == {} and not flat.axis_link(0).is_calibrated


def test_catalog_clusters_serialise_without_profile_sections() -> None:
    data = Cluster.preset("2x8xH100").to_dict()
    assert "links" not in data and "calibration" not in data
    bare = dataclasses.replace(Cluster.preset("2xCPU"), links={})
    assert bare == Cluster.preset("2xCPU")


# --- The command ----------------------------------------------------------------------------------


@pytest.mark.slow  # launches torchrun; one gloo rank aborted at teardown once under a full-suite load
def test_calibrate_on_two_gloo_ranks_writes_a_loadable_profile(tmp_path, capsys, caplog) -> None:
    out = tmp_path / "cpu2.yaml"
    with caplog.at_level("WARNING", logger="autoplan.cost_models.calibration"):
        rc = autoplan.tools.cli.main(
            ["calibrate", "--cluster", "2xCPU", "--out", str(out), "--max-bytes", str(4 * MiB), "--warmup", "2", "-q"]
        )
    stdout = capsys.readouterr().out
    assert rc == 0, stdout
    assert "calibrate: axes=intra(2) fit_err_median=" in stdout.splitlines()[-1]

    cluster = Cluster.from_file(out)
    link = cluster.axis_link("intra")
    assert link.bw_GBps > 0 and link.latency_us >= 0
    # a kind whose time does not grow with size on a loaded machine is priced with the joint fit,
    # with a warning naming it (cost_models.calibration.fit_links): never dropped silently
    unfitted = set(COMM_KINDS) - set(link.collectives)
    assert set(link.collectives) <= set(COMM_KINDS) and len(unfitted) <= 1, link.collectives
    for kind in unfitted:
        assert any(f"{kind} is priced with the joint fit" in r.getMessage() for r in caplog.records), kind
    assert all(fit.bw_GBps > 0 for fit in link.collectives.values())
    assert cluster.calibration is not None and cluster.calibration.num_samples == len(COMM_KINDS) * 11
    assert cluster.calibration.comm_compute_slowdown is not None and cluster.calibration.comm_compute_slowdown >= 0
    assert (cluster.device.intra_node_bw_GBps, cluster.device.intra_node_latency_us) == (link.bw_GBps, link.latency_us)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--cluster", "2x2xCPU"], "spans 2 nodes and one machine cannot calibrate it: run `torchrun --nnodes 2"),
        (["--cluster", "1xCPU"], "one device"),
        (["--cluster", "2xCPU", "--out", "profile.toml"], "use .yaml, .yml or .json"),
        (["--cluster", "2xCPU", "--max-bytes", "4096"], "raise --max-bytes"),
    ],
)
def test_calibrate_bad_input_is_one_error_line_and_exit_code_2(tmp_path, monkeypatch, capsys, argv, fragment):
    monkeypatch.chdir(tmp_path)
    rc = autoplan.tools.cli.main(["calibrate", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("autoplan: error: ") and fragment in err[0], err
