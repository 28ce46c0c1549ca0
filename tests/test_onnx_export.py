"""``autoplan export-onnx``: the traced step as ONNX with the plan as multi-device sharding annotations.

Two plans, made once on ``meta``: the ``mlp`` of ``tests/cli_models.py`` on a 2x2 mesh with
pins so that specs are sharded along both axes, and a pipeline plan of ``gpt2_4_layers``
(tp=2, pp=2, global batch 8, two traced blocks standing for four; its specs include ``P``).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

import autoplan
from autoplan.cost_models.config import ParallelConfig
from autoplan.passes.placement import parse_spec
from autoplan.tools import export_onnx as onnx_export
from tests import zoo

onnx = pytest.importorskip("onnx")

MODELS = Path(__file__).resolve().parent / "cli_models.py"
MLP_TARGET = f"{MODELS}:mlp"
GPT_TARGET = f"{MODELS}:gpt2_4_layers"


def _plan(build: object, cluster: autoplan.Cluster, target: str, **kwargs: object) -> autoplan.Plan:
    with torch.device("meta"):
        wl = build()
    plan = autoplan.plan(
        wl.model, cluster, example_inputs=wl.example_inputs, loss_fn=wl.loss_fn,
        example_targets=wl.example_targets, optimizer=wl.optimizer, profile=None, **kwargs,
    )  # fmt: skip
    return dataclasses.replace(plan, workload=target)


@pytest.fixture(scope="module")
def mlp_plan() -> autoplan.Plan:
    pins = {"input_0": "S(0),R", "0.weight": "S(0),S(1)"}
    return _plan(zoo.cli_mlp, autoplan.Cluster.preset("4xCPU", mesh_shape=(2, 2)), MLP_TARGET, pins=pins)


@pytest.fixture(scope="module")
def gpt_plan() -> autoplan.Plan:
    config = ParallelConfig(dp=1, tp=2, pp=2, microbatch_size=2, num_microbatches=4)
    return _plan(
        zoo.gpt2_4_layers, autoplan.Cluster.preset("4xCPU"), GPT_TARGET, global_batch_size=8, config=config
    )


@pytest.fixture(scope="module")
def exported(mlp_plan, gpt_plan, tmp_path_factory) -> dict[str, tuple[autoplan.Plan, onnx.ModelProto, Path]]:
    out = {}
    for name, plan in (("mlp", mlp_plan), ("gpt", gpt_plan)):
        path = tmp_path_factory.mktemp("onnx") / f"{name}.onnx"
        onnx_export.export_onnx(plan, onnx_export.trace_plan_model(plan, plan.workload), path)
        out[name] = (plan, onnx.load(path), path)
    return out


@pytest.fixture()
def cli_main(monkeypatch):
    """``autoplan.tools.cli.main`` (``export-onnx`` is registered by cli.py)."""
    from autoplan.tools import cli

    return cli.main


# --- validity ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_exported_model_passes_the_full_onnx_check(exported, name):
    _, model, _ = exported[name]

    onnx.checker.check_model(model, full_check=True)
    onnx_export.check_model(model)  # custom ops' schemas registered: strict inference on every standard op


def test_full_check_catches_a_wrong_shape_on_a_standard_op(exported):
    _, model, _ = exported["gpt"]
    bad = onnx.ModelProto()
    bad.CopyFrom(model)
    vi = next(v for v in bad.graph.value_info if v.name == "mm")
    vi.type.tensor_type.shape.dim[0].dim_value += 1

    with pytest.raises(onnx.shape_inference.InferenceError, match="node name: mm"):
        onnx_export.check_model(bad)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_every_plan_node_is_one_onnx_node_with_the_same_name(exported, name):
    plan, model, _ = exported[name]
    by_name = {n.name: n for n in model.graph.node}

    assert len(by_name) == len(model.graph.node)
    assert set(plan.nodes) <= set(by_name)
    assert all(len(by_name[n].device_configurations) == 1 for n in plan.nodes)
    assert {n.op_type for n in model.graph.node} >= {"MatMul", "Gemm", "Transpose"}  # standard ops where exact


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_parameters_are_typed_graph_inputs_without_weights(exported, name):
    plan, model, path = exported[name]
    inputs = {vi.name: vi for vi in model.graph.input}

    for fqn in plan.param_names:
        dims = inputs[f"p_{fqn.replace('.', '_')}"].type.tensor_type.shape.dim
        assert all(d.dim_value > 0 for d in dims)
    assert all(t.data_type == onnx.TensorProto.INT64 or math.prod(t.dims) <= 1 for t in model.graph.initializer)
    assert path.stat().st_size < 100_000


# --- annotations --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_annotations_round_trip_to_the_plans_placements(exported, name):
    plan, model, _ = exported[name]

    read = onnx_export.read_shardings(model)

    assert read == onnx_export.plan_shardings(plan)


def test_sharded_specs_give_sharded_dims_with_axis_and_num_shards(exported):
    plan, model, _ = exported["mlp"]
    values = [*model.graph.input, *model.graph.value_info, *model.graph.output]
    shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in values}
    seen = {}
    for node in (n for n in model.graph.node if n.name in plan.nodes):
        entry = plan.nodes[node.name]
        specs = [s for s in entry["out"] if s is not None] + entry["in"]
        for spec, proto in zip(specs, node.device_configurations[0].sharding_spec, strict=True):
            # num_shards of dim d = product of the sizes of the mesh axes holding S(d) (each 2 here)
            want = sorted({int(p[2:-1]): 2 ** spec.count(p) for p in spec if p.startswith("S(")}.items())
            got = [(d.axis, d.simple_sharding[0].num_shards) for d in proto.sharded_dim]
            assert got == want, (node.name, proto.tensor_name, spec)
            assert all(d.simple_sharding[0].dim_value == shapes[proto.tensor_name][d.axis] for d in proto.sharded_dim)
            seen.setdefault(tuple(spec), proto)

    assert {("S(0)", "R"), ("S(0)", "S(1)")} <= set(seen)  # from the pins
    x = seen["S(0)", "R"]
    groups = {e.key: list(e.value) for e in x.index_to_device_group_map}
    assert [groups[d] for d in x.device] == [[0, 1], [2, 3]]  # shard k on mesh row k, replicated along axis 1
    assert list(seen["S(0)", "S(1)"].device) == [0, 1, 2, 3]  # one device per shard, row-major


@pytest.mark.parametrize(
    ("spec", "sharded", "holders"),
    [
        (["S(0)", "R"], [(0, 2)], [[0, 1], [2, 3]]),
        (["R", "S(0)"], [(0, 2)], [[0, 2], [1, 3]]),
        (["S(0)", "S(1)"], [(0, 2), (1, 2)], [[0], [1], [2], [3]]),
        (["S(1)", "S(0)"], [(0, 2), (1, 2)], [[0], [2], [1], [3]]),
        (["S(0)", "S(0)"], [(0, 4)], [[0], [1], [2], [3]]),
        (["R", "R"], [], [[0, 1, 2, 3]]),
        (["P", "S(1)"], [(1, 2)], [[0, 2], [1, 3]]),
    ],
)
def test_sharding_spec_on_a_2x2_mesh_follows_dtensor_layout(spec, sharded, holders):
    proto = onnx_export.sharding_spec("x", parse_spec(spec), (8, 6), (2, 2))
    groups = {e.key: list(e.value) for e in proto.index_to_device_group_map}

    assert [(d.axis, d.simple_sharding[0].num_shards) for d in proto.sharded_dim] == sharded
    assert [groups.get(d, [d]) for d in proto.device] == holders
    assert onnx_export.decode_sharding_spec(proto, (2, 2)) == tuple(p if p != "P" else "R" for p in spec)


def test_partial_specs_are_replicated_in_onnx_and_kept_in_node_metadata(exported):
    plan, model, _ = exported["gpt"]
    node = next(n for n in model.graph.node if any(p.key.startswith("autoplan.spec.") for p in n.metadata_props))
    key, full = next((p.key, p.value) for p in node.metadata_props if p.key.startswith("autoplan.spec."))
    proto = node.device_configurations[0].sharding_spec[int(key.rsplit(".", 1)[1])]

    assert "P" in full.split(",")
    assert len(proto.device) == 1 and list(proto.index_to_device_group_map[0].value) in ([0, 1], [2, 3])


def test_shard_along_a_size_one_axis_round_trips_through_metadata():
    mesh = (1, 2)
    proto = onnx_export.sharding_spec("x", parse_spec(["S(0)", "S(1)"]), (4, 4), mesh)

    assert onnx_export.decode_sharding_spec(proto, mesh) == ("R", "S(1)")  # the ONNX part; the rest is metadata


def test_pipeline_plan_carries_stages_and_stage_devices(exported):
    plan, model, _ = exported["gpt"]
    props = {p.key: p.value for p in model.metadata_props}
    stages = {n.name: n.device_configurations[0].pipeline_stage for n in model.graph.node if n.device_configurations}

    assert props["autoplan.fingerprint"] == plan.fingerprint and props["autoplan.spec_mesh_shape"] == "2"
    assert (model.configuration[0].num_devices, len(model.configuration[0].device)) == (4, 4)
    assert set(stages.values()) == {0, 1} and stages["nll_loss_forward"] == 1  # the epilogue is on the last stage
    for n in model.graph.node:
        for s in n.device_configurations[0].sharding_spec if n.device_configurations else ():
            devices = {d for e in s.index_to_device_group_map for d in e.value} | {d for d in s.device if d >= 0}
            assert devices == ({0, 1} if stages[n.name] == 0 else {2, 3})
    stand_ins = [n for n in model.graph.node if any(p.key == "autoplan.stands_for" for p in n.metadata_props)]
    assert stand_ins and all(stages[n.name] == 0 for n in stand_ins)  # block 1 of the trace stands for h.1..h.3


# --- command line -----------------------------------------------------------------------------------


def test_cli_writes_the_model_and_exits_0(mlp_plan, tmp_path, cli_main, capsys):
    mlp_plan.save(tmp_path / "plan.json")

    rc = cli_main(["export-onnx", str(tmp_path / "plan.json"), "-o", str(tmp_path / "model.onnx")])

    assert rc == 0
    model = onnx.load(tmp_path / "model.onnx")
    assert onnx_export.read_shardings(model) == onnx_export.plan_shardings(mlp_plan)
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'model.onnx'}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "plan.json"]  # no temporary file left


def test_cli_without_model_or_workload_exits_2_with_one_error_line(mlp_plan, tmp_path, cli_main, capsys):
    dataclasses.replace(mlp_plan, workload="").save(tmp_path / "plan.json")

    rc = cli_main(["export-onnx", str(tmp_path / "plan.json"), "-o", str(tmp_path / "model.onnx"), "--quiet"])

    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("autoplan: error:") and "--model" in err[0]
    assert not (tmp_path / "model.onnx").exists()


def test_cli_with_another_model_exits_2_naming_both_fingerprints(mlp_plan, tmp_path, cli_main, capsys):
    mlp_plan.save(tmp_path / "plan.json")

    rc = cli_main(
        ["export-onnx", str(tmp_path / "plan.json"), "-o", str(tmp_path / "m.onnx"), "--model", f"{MODELS}:mlp_wide"]
    )

    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and mlp_plan.fingerprint in err[0]


def test_missing_onnx_gives_the_install_hint(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "onnx", None)

    with pytest.raises(onnx_export.OnnxMissingError, match=r'pip install "onnx>=1.16"'):
        onnx_export.to_onnx(None, None)  # type: ignore[arg-type]
