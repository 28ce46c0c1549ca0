"""Cluster description and device catalog: presets, meshes, files and catalog numbers."""

from __future__ import annotations

import copy
import json
import pickle

import pytest
import torch
import yaml

from autoplan.cost_models.cluster import Cluster, LinkSpec
from autoplan.cost_models.errors import ClusterSpecError, UnknownDeviceError
from autoplan.cost_models.hardware import DEVICE_CATALOG, DeviceSpec, get_device_spec

# --- Presets and meshes ---------------------------------------------------------------------------


def test_preset_2x8xh100_is_16_devices_on_a_2x8_mesh_with_catalog_links():
    """Catalog links at the bus bandwidth NCCL reaches: 370 of 450 GB/s over NVLink4, 48.5 of 50
    GB/s per NDR NIC (cluster.NCCL_BUS_EFFICIENCY, cited there)."""
    cluster = Cluster.preset("2x8xH100")
    h100 = DEVICE_CATALOG["H100"]

    assert cluster.world_size == 16
    assert cluster.mesh_shape == (2, 8)
    assert cluster.mesh_axis_names == ("inter", "intra")
    assert cluster.axis_spans_nodes(0)
    assert not cluster.axis_spans_nodes(1)
    assert cluster.axis_link(0) == LinkSpec(
        bw_GBps=h100.inter_node_bw_GBps * 48.5 / 50,
        latency_us=h100.inter_node_latency_us,
        spans_nodes=True,
    )
    assert cluster.axis_link("intra") == LinkSpec(
        bw_GBps=h100.intra_node_bw_GBps * 370 / 450,
        latency_us=h100.intra_node_latency_us,
        spans_nodes=False,
    )
    assert str(cluster) == "2x8xH100 mesh=(2, 8)[inter,intra]"


def test_preset_without_node_count_is_one_node_with_a_1d_intra_mesh():
    cluster = Cluster.preset("4xCPU")

    assert (cluster.num_nodes, cluster.devices_per_node) == (1, 4)
    assert cluster.mesh_shape == (4,)
    assert cluster.mesh_axis_names == ("intra",)
    assert not cluster.axis_spans_nodes(0)
    assert cluster.device is DEVICE_CATALOG["CPU"]


def test_preset_device_names_are_case_insensitive_and_accept_aliases():
    assert Cluster.preset("8xa100").device.name == "A100-80GB"
    assert Cluster.preset("2X8Xh100-sxm").device.name == "H100"


@pytest.mark.parametrize("spec", ["2x8", "H100", "x8xH100", "2x8x", "", "2 x 8 x H100"])
def test_malformed_preset_raises_with_the_expected_format(spec):
    with pytest.raises(ClusterSpecError, match="expected NODESxDEVICESxDEVICE"):
        Cluster.preset(spec)


def test_preset_with_unknown_device_or_zero_count_names_the_preset():
    with pytest.raises(UnknownDeviceError, match="preset '2x8xH100x': unknown device 'H100x'"):
        Cluster.preset("2x8xH100x")
    with pytest.raises(
        ClusterSpecError,
        match="preset '0x8xH100': num_nodes must be a positive integer",
    ):
        Cluster.preset("0x8xH100")


def test_one_device_per_node_gives_a_1d_inter_mesh():
    cluster = Cluster(num_nodes=4, devices_per_node=1, device="H100")

    assert cluster.mesh_shape == (4,)
    assert cluster.mesh_axis_names == ("inter",)
    assert cluster.axis_link(0).spans_nodes


def test_single_device_gives_a_unit_intra_mesh():
    cluster = Cluster(num_nodes=1, devices_per_node=1, device="CPU")

    assert cluster.mesh_shape == (1,)
    assert cluster.mesh_axis_names == ("intra",)


def test_custom_2x2_mesh_on_one_node_of_4_cpus_is_valid_and_intra_node():
    cluster = Cluster.preset("4xCPU", mesh_shape=(2, 2))

    assert cluster.mesh_shape == (2, 2)
    assert cluster.mesh_axis_names == ("intra0", "intra1")
    assert not cluster.axis_spans_nodes(0)
    assert not cluster.axis_spans_nodes(1)


def test_custom_mesh_names_follow_the_hierarchy():
    cluster = Cluster.preset("4x8xH100", mesh_shape=(2, 2, 2, 4))

    assert cluster.mesh_axis_names == ("inter0", "inter1", "intra0", "intra1")
    assert [cluster.axis_spans_nodes(i) for i in range(4)] == [True, True, False, False]


def test_mesh_that_splits_a_node_raises():
    # 2 nodes x 4 devices: trailing products of (4, 2) are 2 and 8, never 4, so the axis of
    # size 4 would hold 2 devices of each node.
    with pytest.raises(ClusterSpecError, match="splits a node"):
        Cluster.preset("2x4xCPU", mesh_shape=(4, 2))


def test_mesh_with_the_wrong_number_of_devices_raises():
    with pytest.raises(ClusterSpecError, match="product is 8"):
        Cluster.preset("2x4xCPU", mesh_shape=(2, 2))


def test_mesh_axis_names_must_be_unique_and_one_per_axis():
    with pytest.raises(ClusterSpecError, match="unique"):
        Cluster.preset("2x4xCPU", mesh_axis_names=("dp", "dp"))
    with pytest.raises(ClusterSpecError, match="one name per axis"):
        Cluster.preset("2x4xCPU", mesh_axis_names=("dp",))


@pytest.mark.parametrize("num_nodes", [0, -1, 1.5, True, "2"])
def test_non_positive_or_non_int_counts_raise(num_nodes):
    with pytest.raises(ClusterSpecError, match="num_nodes must be a positive integer"):
        Cluster(num_nodes=num_nodes, devices_per_node=8, device="H100")


def test_with_mesh_returns_a_new_cluster_with_derived_names():
    cluster = Cluster.preset("2x8xH100")
    reshaped = cluster.with_mesh((2, 2, 4))

    assert reshaped.mesh_shape == (2, 2, 4)
    assert reshaped.mesh_axis_names == ("inter", "intra0", "intra1")
    assert cluster.mesh_shape == (2, 8)
    assert cluster.with_mesh((2, 8), ("dp", "tp")).mesh_axis_names == ("dp", "tp")


def test_cluster_is_hashable_picklable_and_deep_copyable():
    cluster = Cluster.preset("2x8xH100", mesh_axis_names=("dp", "tp"))

    assert pickle.loads(pickle.dumps(cluster)) == cluster
    assert copy.deepcopy(cluster) == cluster
    assert hash(cluster) == hash(Cluster.preset("2x8xH100", mesh_axis_names=("dp", "tp")))


# --- Files and dictionaries -----------------------------------------------------------------------


def test_to_dict_from_dict_round_trips_a_custom_device():
    device = DeviceSpec(
        name="toy",
        peak_flops={"float32": 1e12},
        mem_bw_GBps=100.0,
        mem_capacity_bytes=8 * 2**30,
        intra_node_bw_GBps=10.0,
        intra_node_latency_us=5.0,
        inter_node_bw_GBps=1.0,
        inter_node_latency_us=20.0,
        sources=("made up for a test",),
    )
    cluster = Cluster(num_nodes=2, devices_per_node=2, device=device)

    data = json.loads(json.dumps(cluster.to_dict()))

    assert Cluster.from_dict(data) == cluster


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_from_file_round_trips_yaml_and_json(tmp_path, suffix):
    cluster = Cluster.preset("2x4xA100-40GB", mesh_shape=(2, 2, 2), mesh_axis_names=("a", "b", "c"))
    path = tmp_path / f"cluster{suffix}"
    text = json.dumps(cluster.to_dict()) if suffix == ".json" else yaml.safe_dump(cluster.to_dict())
    path.write_text(text)

    assert Cluster.from_file(path) == cluster


def test_from_file_accepts_a_device_name_and_overrides(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "num_nodes: 2\n"
        "devices_per_node: 8\n"
        "device:\n"
        "  name: h100\n"
        "  overrides: {inter_node_bw_GBps: 25, peak_flops: {bfloat16: 8.0e+14}}\n"
    )

    cluster = Cluster.from_file(path)

    assert cluster.device.inter_node_bw_GBps == 25.0
    assert cluster.device.peak_flops["bfloat16"] == 8e14
    assert cluster.device.peak_flops["float32"] == DEVICE_CATALOG["H100"].peak_flops["float32"]
    assert "cluster.yaml" in cluster.device.sources[-1]
    assert cluster.axis_link(0).bw_GBps == 25.0


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("truncated.yaml", "num_nodes: 2\ndevices_per_node: 8\ndevice: {name: H1"),
        ("broken.yml", "num_nodes: 2\n  devices_per_node: [8\n"),
        ("truncated.json", '{"num_nodes": 2, "devices_per_node": 8, "dev'),
        ("empty.yaml", ""),
        ("list.json", "[2, 8]"),
        (
            "unknown_key.yaml",
            "num_nodes: 2\ndevices_per_node: 8\ndevice: H100\ncolour: red\n",
        ),
        ("missing_key.yaml", "num_nodes: 2\ndevice: H100\n"),
        (
            "wrong_type.json",
            '{"num_nodes": "2", "devices_per_node": 8, "device": "H100"}',
        ),
        (
            "bad_device.yaml",
            "num_nodes: 1\ndevices_per_node: 8\ndevice: {name: X, mem_bw_GBps: 1}",
        ),
        (
            "bad_number.yaml",
            "num_nodes: 1\ndevices_per_node: 1\ndevice: {name: CPU, overrides: {mem_bw_GBps: 80e9}}",
        ),
        ("cluster.toml", "num_nodes = 2"),
    ],
)
def test_malformed_file_raises_one_line_error_naming_the_file(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)

    with pytest.raises(ClusterSpecError) as info:
        Cluster.from_file(path)

    message = str(info.value)
    assert name in message
    assert "\n" not in message


def test_missing_file_raises_cluster_spec_error_naming_the_file(tmp_path):
    with pytest.raises(ClusterSpecError, match="nowhere.yaml.*does not exist"):
        Cluster.from_file(tmp_path / "nowhere.yaml")


def test_unknown_key_error_names_the_key(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"num_nodes": 1, "devices_per_node": 2, "device": "CPU", "gpus": 2}')

    with pytest.raises(ClusterSpecError, match="unknown key 'gpus'"):
        Cluster.from_file(path)


def test_unknown_device_in_file_is_an_unknown_device_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("num_nodes: 1\ndevices_per_node: 2\ndevice: TPUv9\n")

    with pytest.raises(UnknownDeviceError, match="c.yaml.*unknown device 'TPUv9'"):
        Cluster.from_file(path)


# --- Device catalog -------------------------------------------------------------------------------


def test_unknown_device_message_lists_known_devices():
    with pytest.raises(UnknownDeviceError) as info:
        get_device_spec("V100")

    message = str(info.value)
    assert "unknown device 'V100'" in message
    for name in DEVICE_CATALOG:
        assert name in message
    assert "cost_models/hardware.py" in message


def test_device_lookup_is_case_insensitive_with_aliases():
    assert get_device_spec("h100") is DEVICE_CATALOG["H100"]
    assert get_device_spec("H100-80GB") is DEVICE_CATALOG["H100"]
    assert get_device_spec("H100-SXM") is DEVICE_CATALOG["H100"]
    assert get_device_spec("A100") is DEVICE_CATALOG["A100-80GB"]
    assert get_device_spec("h200-141gb") is DEVICE_CATALOG["H200"]


def test_catalog_has_the_expected_devices():
    assert set(DEVICE_CATALOG) == {
        "A100-40GB",
        "A100-80GB",
        "H100",
        "H200",
        "B200",
        "CPU",
    }


@pytest.mark.parametrize("name", list(DEVICE_CATALOG))
def test_every_catalog_entry_cites_sources_and_has_positive_numbers(name):
    spec = DEVICE_CATALOG[name]

    assert spec.sources and all(source.strip() for source in spec.sources)
    for key in ("float32", "tf32", "bfloat16", "float16"):
        assert spec.peak_flops[key] > 0
    assert spec.mem_bw_GBps > 0
    assert spec.mem_capacity_bytes > 0
    assert spec.intra_node_bw_GBps > 0
    assert spec.intra_node_latency_us > 0
    assert spec.inter_node_bw_GBps > 0
    assert spec.inter_node_latency_us > 0
    # The network is never faster than the in-node link.
    assert spec.inter_node_bw_GBps <= spec.intra_node_bw_GBps


def test_h100_bf16_dense_peak_is_989_tflops():
    # NVIDIA H100 datasheet, SXM: BF16 Tensor Core 1,979 TFLOPS with sparsity, i.e. ~989 dense;
    # the Hopper architecture whitepaper lists 989.4 TFLOPS dense.
    h100 = get_device_spec("H100")

    assert h100.peak_flops_for(torch.bfloat16) == pytest.approx(989e12, rel=1e-3)
    assert h100.peak_flops_for("bf16") == h100.peak_flops["bfloat16"]


def test_float32_matmul_uses_the_non_tf32_peak_and_missing_dtypes_fall_back_to_float32():
    a100 = get_device_spec("A100-80GB")

    # NVIDIA A100 datasheet: FP32 19.5 TFLOPS, TF32 Tensor Core 156 TFLOPS (dense).
    assert a100.peak_flops_for(torch.float32) == pytest.approx(19.5e12)
    assert a100.peak_flops_for("tf32") == pytest.approx(156e12)
    assert a100.peak_flops_for(torch.float8_e4m3fn) == a100.peak_flops["float32"]
    assert a100.peak_flops_for(torch.int8) == a100.peak_flops["float32"]


def test_device_spec_is_immutable():
    h100 = get_device_spec("H100")

    with pytest.raises(TypeError):
        h100.peak_flops["bfloat16"] = 1.0  # type: ignore[index]
    with pytest.raises(AttributeError):
        h100.mem_bw_GBps = 1.0  # type: ignore[misc]
