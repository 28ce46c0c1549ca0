"""``autoplan calibrate --from-profile``: a profiler trace of a planned step mapped to the plan, the
compute model's device numbers fitted to it, the cluster file written and read back, and the
traces that are refused (``autoplan.cost_models.trace_calibration``).

The synthetic traces are Kineto's Chrome format as ``torch.profiler`` writes it on CPU
(``ProfilerStep#N`` annotations, ``cpu_op`` events with ``Input Dims``/``Input type``/``Concrete
Inputs``), their op times made by the cost model itself from a chosen device, so the fit must
find that device's numbers again. The slow test profiles a real run on 2 gloo ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.compute import MEMORY_EFFICIENCY, matmul_asymptote, roofline_time_s
from autoplan.cost_models.trace_calibration import (
    TraceCalibrationError,
    TraceMismatchError,
    calibrate_from_trace,
    match_plan,
    read_trace,
)

ROOT = Path(__file__).resolve().parent.parent

# (plan op, event name, input dims, input types, concrete inputs, meta call giving its outputs)
MM_SHAPES = [(256, 256, 256), (512, 256, 768), (128, 1024, 256), (512, 512, 512), (64, 256, 2048), (256, 768, 256)]
ADD_SIZES = [2**14, 2**16, 2**18, 2**20, 3 * 2**18, 2**19]
VIEW_SHAPES = [(64, 64), (128, 32)]


def _ops() -> list[dict]:
    """One step's top-level ops: matmuls (compute-bound), adds (memory-bound), views (overhead)."""
    ops = []
    for m, k, n in MM_SHAPES:
        a, b = torch.empty(m, k, device="meta"), torch.empty(k, n, device="meta")
        ops.append(
            {"plan": "aten.mm.default", "name": "aten::mm", "dims": [[m, k], [k, n]], "types": ["float", "float"],
             "concrete": ["", ""], "ins": [a, b], "outs": [torch.mm(a, b)]}
        )  # fmt: skip
    for size in ADD_SIZES:
        x = torch.empty(size, device="meta")
        ops.append(
            {"plan": "aten.add.Tensor", "name": "aten::add", "dims": [[size], [size], []],
             "types": ["float", "float", "Scalar"], "concrete": ["", "", "1"], "ins": [x, x], "outs": [x + x]}
        )  # fmt: skip
    for rows, cols in VIEW_SHAPES:
        x = torch.empty(rows * cols, device="meta")
        ops.append(
            {"plan": "aten.view.default", "name": "aten::view", "dims": [[rows * cols], []],
             "types": ["float", "ScalarList"], "concrete": ["", f"[{rows}, {cols}]"], "ins": [x],
             "outs": [x.view(rows, cols)]}
        )  # fmt: skip
    return ops


def _device(cluster: Cluster, *, fraction: float, mem_bw: float, overhead_us: float):  # noqa: ANN202
    return cluster.device.with_overrides(
        {"matmul_peak_fraction": {"float32": fraction}, "mem_bw_GBps": mem_bw, "op_overhead_us": overhead_us},
        where="test",
    )


def _event(name: str, ts: float, dur: float, *, cat: str = "cpu_op", tid: int = 1, args: dict | None = None) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur, "args": args or {}}


def write_trace(
    path: Path,
    device,  # noqa: ANN001 - the DeviceSpec the op times come from
    *,
    steps: int = 3,
    comm_us: float = 3000.0,
    optimizer_us: float = 2000.0,
    world_size: int = 2,
    collectives: int = 1,
    extra_ops: tuple[str, ...] = ("aten::view",),
    ops: list[dict] | None = None,
) -> list[dict]:
    """A trace of ``steps`` steps: every op of :func:`_ops` timed by the roofline on ``device``,
    a nested ``aten::copy_`` inside the first matmul, glue ops the plan does not have, an
    optimizer annotation with ops inside, and ``collectives`` all-reduces with their waits."""
    ops = _ops() if ops is None else ops
    events, ts = [], 1000.0
    for step in range(steps):
        start = ts
        for i, op in enumerate(ops):
            dur = roofline_time_s(op["plan"], op["ins"], op["outs"], device) * 1e6
            args = {"Input Dims": op["dims"], "Input type": op["types"], "Concrete Inputs": op["concrete"],
                    "Input Strides": [[] for _ in op["dims"]]}  # fmt: skip
            events.append(_event(op["name"], ts, dur, args=args))
            if i == 0:  # an op the first one calls: not a top-level op
                events.append(_event("aten::copy_", ts + 0.1, dur / 4, args={"Input Dims": [[4], [4]]}))
            ts += dur
        for name in extra_ops:  # the runtime's glue: more events than the plan has nodes
            events.append(_event(name, ts, 1.0, args={"Input Dims": [[4], []], "Input type": ["float", "ScalarList"],
                                                      "Concrete Inputs": ["", "[2, 2]"]}))  # fmt: skip
            ts += 1.0
        for _ in range(collectives):
            args = {"Input Dims": [[1024], [], []], "Input type": ["float", "", ""]}
            events.append(_event("_c10d_functional::all_reduce", ts, 50.0, args=args))
            events.append(_event("c10d::allreduce_", ts + 1, 40.0))  # called by the one above
            events.append(_event("_c10d_functional::wait_tensor", ts + 50, comm_us / collectives - 50.0))
            ts += comm_us / collectives
        events.append(_event("Optimizer.step#Adam.step", ts, optimizer_us, cat="user_annotation"))
        events.append(_event("aten::_foreach_add_", ts + 1, optimizer_us / 2))
        ts += optimizer_us
        events.append(_event(f"ProfilerStep#{step + 1}", start, ts - start, cat="user_annotation"))
        events.append(_event("gloo:all_reduce", start + 5, 100.0, cat="user_annotation", tid=2))
        ts += 10.0
    trace = {
        "schemaVersion": 1,
        "record_shapes": 1,
        "distributedInfo": {"backend": "gloo", "rank": 0, "world_size": world_size},
        "traceEvents": events,
    }
    path.write_text(json.dumps(trace))
    return ops


def plan_ops(ops: list[dict]) -> list[str]:
    return [op["plan"] for op in ops]


@pytest.fixture
def cluster() -> Cluster:
    return Cluster.preset("2xCPU")


@pytest.fixture
def true_device(cluster: Cluster):  # noqa: ANN201
    """A device unlike the preset's: the fit must move every number towards it."""
    return _device(cluster, fraction=0.37, mem_bw=7.5, overhead_us=42.0)


def _calibrate(tmp_path: Path, cluster: Cluster, ops: list[dict], **kwargs):  # noqa: ANN003, ANN202
    return calibrate_from_trace(
        tmp_path / "trace.json",
        cluster=cluster,
        plan_ops=plan_ops(ops),
        plan_collectives={"all_reduce": 1},
        plan_fingerprint="0123456789abcdef",
        **kwargs,
    )


def test_read_trace_keeps_top_level_ops_and_splits_communication_and_optimizer(tmp_path, true_device):
    ops = write_trace(tmp_path / "trace.json", true_device, steps=2, comm_us=3000.0, optimizer_us=2000.0)
    trace = read_trace(tmp_path / "trace.json")
    assert trace.world_size == 2 and trace.backend == "gloo" and len(trace.steps) == 2
    step = trace.steps[0]
    names = [op.name for op in step.ops]
    assert names == [op["name"] for op in ops] + ["aten::view"]  # nested copy_ and optimizer ops left out
    assert step.collectives == {"all_reduce": 1}
    assert step.comm_s == pytest.approx(3000e-6)
    assert step.optimizer_s == pytest.approx(2000e-6)
    assert step.wall_s == pytest.approx(sum(op.time_s for op in step.ops) + 5000e-6)


def test_a_gpu_trace_times_ops_by_the_kernels_they_launch(tmp_path):
    """Host events of a GPU trace only queue work: an op's time is its kernels' (its own and
    those of the ops it calls, linked by ``External id``)."""
    args = {"Input Dims": [[8, 8], [8, 8]], "Input type": ["float", "float"], "Concrete Inputs": ["", ""]}
    events = [
        _event("ProfilerStep#1", 0.0, 1000.0, cat="user_annotation"),
        _event("aten::linear", 10.0, 30.0, args={**args, "External id": 1}),
        _event("aten::addmm", 15.0, 20.0, args={**args, "External id": 2}),  # called by linear
        _event("aten::add", 50.0, 5.0, args={**args, "External id": 3}),
        _event("gemm_kernel", 100.0, 400.0, cat="kernel", tid=9, args={"External id": 2}),
        _event("bias_kernel", 500.0, 25.0, cat="kernel", tid=9, args={"External id": 1}),
        _event("add_kernel", 530.0, 60.0, cat="kernel", tid=9, args={"External id": 3}),
    ]
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    (step,) = read_trace(tmp_path / "trace.json").steps
    assert [(op.name, op.time_s) for op in step.ops] == [
        ("aten::linear", pytest.approx(425e-6)),
        ("aten::add", pytest.approx(60e-6)),
    ]


def test_match_maps_one_event_per_plan_node_and_leaves_the_glue(tmp_path, true_device):
    ops = write_trace(tmp_path / "trace.json", true_device, extra_ops=("aten::view", "aten::cat"))
    trace = read_trace(tmp_path / "trace.json")
    match = match_plan(trace, plan_ops=plan_ops(ops), plan_collectives={"all_reduce": 1}, world_size=2)
    assert match.matched_fraction == 1.0
    assert match.num_plan_nodes == len(ops)
    for step in match.mapped:
        assert [m.key for m in step] == plan_ops(ops)  # the extra view and the cat are not mapped
        flops = [m.flops for m in step if m.key == "aten.mm.default"]
        assert flops == [2.0 * m * k * n for m, k, n in MM_SHAPES]
        adds = [m.nbytes for m in step if m.key == "aten.add.Tensor"]
        assert adds == [3 * 4 * size for size in ADD_SIZES]


def test_fit_recovers_the_device_the_times_came_from(tmp_path, cluster, true_device):
    ops = write_trace(tmp_path / "trace.json", true_device, extra_ops=())
    result = _calibrate(tmp_path, cluster, ops, modelled_comm_s=None)
    fit, device = result.fit, result.profile.device
    rate = true_device.peak_flops_for("float32") * matmul_asymptote(true_device, torch.float32)
    assert fit.matmul_rate_flops["float32"] == pytest.approx(rate, rel=0.07)
    assert device.matmul_peak_fraction_for("float32") == pytest.approx(0.37, rel=0.07)
    assert fit.effective_mem_bw_GBps == pytest.approx(true_device.mem_bw_GBps * MEMORY_EFFICIENCY, rel=0.07)
    assert device.mem_bw_GBps == pytest.approx(true_device.mem_bw_GBps, rel=0.07)
    assert device.op_overhead_us == pytest.approx(true_device.op_overhead_us, rel=0.1)
    assert fit.ops_predicted_s == pytest.approx(fit.ops_measured_s, rel=0.02)
    assert fit.op_err_median < 0.1
    # the fitted device prices the trace's step as measured
    step = result.trace.steps[0]
    priced = sum(roofline_time_s(op["plan"], op["ins"], op["outs"], device) for op in ops)
    assert priced + step.comm_s + step.optimizer_s == pytest.approx(step.wall_s, rel=0.02)


def test_a_priced_communication_moves_the_waits_into_the_overhead(tmp_path, cluster, true_device):
    ops = write_trace(tmp_path / "trace.json", true_device, extra_ops=(), comm_us=3000.0)
    measured = _calibrate(tmp_path, cluster, ops, modelled_comm_s=None).fit
    priced = _calibrate(tmp_path, cluster, ops, modelled_comm_s=1e-3).fit
    # the 2 ms of waiting beyond the priced 1 ms are paid by the plan's nodes
    extra_us = (priced.op_overhead_us - measured.op_overhead_us) * len(ops)
    assert extra_us == pytest.approx(2000.0, rel=0.01)


def test_the_written_cluster_file_reads_back_with_the_fit(tmp_path, cluster, true_device):
    ops = write_trace(tmp_path / "trace.json", true_device)
    out = tmp_path / "fitted.yaml"
    result = _calibrate(tmp_path, cluster, ops, out=out)
    loaded = Cluster.from_file(out)
    assert loaded == result.profile
    assert loaded.device.op_overhead_us == result.fit.op_overhead_us
    info = loaded.calibration
    assert info is not None and info.compute is not None
    assert info.compute["plan"] == "0123456789abcdef" and info.compute["steps"] == 3
    assert set(info.compute["fitted"].split(",")) == {"matmul_peak_fraction", "mem_bw_GBps", "op_overhead_us"}
    # a view costs the fitted overhead alone
    x = torch.empty(64, device="meta")
    assert roofline_time_s("aten.view.default", [x], [x.view(8, 8)], loaded.device) == pytest.approx(
        result.fit.op_overhead_us * 1e-6
    )
    assert Cluster.from_file(out).to_dict() == loaded.to_dict()


def test_only_what_the_trace_determines_is_fitted(tmp_path, cluster, true_device):
    no_matmuls = [op for op in _ops() if op["plan"] != "aten.mm.default"]
    write_trace(tmp_path / "trace.json", true_device, ops=no_matmuls)
    result = _calibrate(tmp_path, cluster, no_matmuls)
    assert result.fit.matmul_rate_flops == {}
    assert result.profile.device.matmul_peak_fraction == cluster.device.matmul_peak_fraction
    assert result.profile.device.peak_flops == cluster.device.peak_flops
    assert result.fit.effective_mem_bw_GBps is not None


def test_a_trace_without_the_plans_ops_is_refused(tmp_path, cluster, true_device):
    write_trace(tmp_path / "trace.json", true_device)
    with pytest.raises(TraceMismatchError, match="runs 0% of the ops"):
        calibrate_from_trace(
            tmp_path / "trace.json",
            cluster=cluster,
            plan_ops=["aten.bmm.default", "aten.native_layer_norm.default"],
            plan_collectives={"all_reduce": 1},
            plan_fingerprint="x",
        )


@pytest.mark.parametrize(
    ("trace_kwargs", "plan_collectives", "message"),
    [
        ({"world_size": 4}, {"all_reduce": 1}, "ran on 4 ranks"),
        ({"collectives": 3}, {"all_reduce": 1}, "issues collectives {all_reduce: 3}"),
        ({}, {"all_gather": 2}, "but the plan issues {all_gather: 2}"),
    ],
)
def test_a_trace_of_another_plan_is_refused(tmp_path, cluster, true_device, trace_kwargs, plan_collectives, message):
    ops = write_trace(tmp_path / "trace.json", true_device, **trace_kwargs)
    out = tmp_path / "fitted.yaml"
    with pytest.raises(TraceMismatchError, match=message.replace("{", r"\{").replace("}", r"\}")):
        calibrate_from_trace(
            tmp_path / "trace.json",
            cluster=cluster,
            plan_ops=plan_ops(ops),
            plan_collectives=plan_collectives,
            plan_fingerprint="x",
            out=out,
        )
    assert not out.exists()


def test_on_gloo_a_plans_all_to_all_is_issued_as_an_all_gather(tmp_path, true_device):
    ops = write_trace(tmp_path / "trace.json", true_device)
    data = json.loads((tmp_path / "trace.json").read_text())
    for e in data["traceEvents"]:
        if e["name"] == "_c10d_functional::all_reduce":
            e["name"] = "_c10d_functional::all_gather_into_tensor"
    (tmp_path / "trace.json").write_text(json.dumps(data))
    trace = read_trace(tmp_path / "trace.json")
    match = match_plan(trace, plan_ops=plan_ops(ops), plan_collectives={"all_to_all": 1}, world_size=2)
    assert match.matched_fraction == 1.0
    data["distributedInfo"]["backend"] = "nccl"
    (tmp_path / "trace.json").write_text(json.dumps(data))
    with pytest.raises(TraceMismatchError, match="all_to_all: 1"):
        match_plan(read_trace(tmp_path / "trace.json"), plan_ops=plan_ops(ops), plan_collectives={"all_to_all": 1}, world_size=2)


def test_another_count_of_matmuls_is_refused(tmp_path, cluster, true_device):
    ops = write_trace(tmp_path / "trace.json", true_device)
    with pytest.raises(TraceMismatchError, match="aten::mm"):
        match_plan(
            read_trace(tmp_path / "trace.json"),
            plan_ops=[*plan_ops(ops), "aten.mm.default"],
            plan_collectives={"all_reduce": 1},
            world_size=2,
        )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "does not exist"),
        ("{not json", "is not a JSON profiler trace"),
        ('{"traceEvents": 3}', "has no traceEvents"),
        ('{"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 1, "dur": 2}]}', "no ProfilerStep#N events"),
    ],
)
def test_unreadable_traces_are_refused(tmp_path, content, message):
    path = tmp_path / "trace.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(TraceCalibrationError, match=message):
        read_trace(path)


def test_a_trace_without_shapes_is_refused(tmp_path, true_device):
    write_trace(tmp_path / "trace.json", true_device)
    data = json.loads((tmp_path / "trace.json").read_text())
    for e in data["traceEvents"]:
        e["args"] = {}
    data["record_shapes"] = 0
    (tmp_path / "trace.json").write_text(json.dumps(data))
    with pytest.raises(TraceCalibrationError, match="record_shapes=True"):
        match_plan(read_trace(tmp_path / "trace.json"), plan_ops=["aten.mm.default"], plan_collectives={}, world_size=2)


# --- the command line -----------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AUTOPLAN_LOCAL_LINKS": "catalog"}
    return subprocess.run(
        [sys.executable, "-m", "autoplan.tools.cli", "calibrate", *args], capture_output=True, text=True, env=env, cwd=ROOT
    )


@pytest.fixture(scope="module")
def mlp_plan(tmp_path_factory) -> Path:  # noqa: ANN001
    """A data-parallel plan of a small MLP on 2 CPU ranks, saved."""
    import autoplan

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    plan = autoplan.plan(
        model, "2xCPU", example_inputs=(x,), loss_fn=torch.nn.functional.mse_loss, example_targets=(y,),
        pins={"input_0": "S(0)", "target_0": "S(0)", "*": "R"}, profile=None,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.save(path)
    return path


def test_cli_refuses_a_trace_of_another_plan_in_one_line_and_keeps_the_output(tmp_path, true_device, mlp_plan):
    write_trace(tmp_path / "trace.json", true_device)  # ops of the synthetic step, not of the MLP
    out = tmp_path / "cluster.yaml"
    out.write_text("previous: file\n")
    r = _cli("--from-profile", str(tmp_path / "trace.json"), "--plan", str(mlp_plan), "--out", str(out))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert "plan plan.json" in lines[0] and "profile a run of" in lines[0]
    assert out.read_text() == "previous: file\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--from-profile", "missing.json", "--plan", "PLAN"], "does not exist"),
        (["--from-profile", "TRACE"], "needs --plan"),
        (["--from-profile", "TRACE", "--plan", "PLAN", "--cluster", "2xCPU"], "drop --cluster"),
        (["--from-profile", "TRACE", "--plan", "PLAN", "--out", "x.txt"], "use .yaml"),
        (["--from-profile", "TRACE", "--plan", "TRACE"], "plan file"),
    ],
)
def test_cli_errors_are_one_line(tmp_path, true_device, mlp_plan, args, message):
    write_trace(tmp_path / "trace.json", true_device)
    args = [str(tmp_path / "trace.json") if a == "TRACE" else str(mlp_plan) if a == "PLAN" else a for a in args]
    r = _cli(*args, *([] if "--out" in args else ["--out", str(tmp_path / "c.yaml")]))
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "c.yaml").exists()


@pytest.mark.slow
def test_a_real_trace_of_two_gloo_ranks_maps_and_fits(tmp_path):
    """The benchmark's GPT-2, data parallel on 2 gloo ranks, 3 profiled steps: every kernel node
    of the plan is found, the fit writes a file that plans read."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.cost_model_accuracy import make_plan, run_plan

    plan = make_plan("data-parallel", Cluster.preset("2xCPU"), None)
    plan.save(tmp_path / "plan.json")
    run_plan(tmp_path / "plan.json", tmp_path / "run", steps=2, trace=tmp_path / "trace.json")
    out = tmp_path / "fitted.yaml"
    r = _cli("--from-profile", str(tmp_path / "trace.json"), "--plan", str(tmp_path / "plan.json"), "--out", str(out))
    assert r.returncode == 0, r.stderr
    summary = r.stdout.strip().splitlines()[-1]
    assert summary.startswith("calibrate: from_profile=trace.json steps=5")
    fitted = Cluster.from_file(out)
    assert fitted.calibration is not None and fitted.calibration.compute is not None
    assert fitted.calibration.compute["plan"] == plan.fingerprint
    assert fitted.device.op_overhead_us is not None and fitted.device.op_overhead_us > 0
    again = make_plan("data-parallel", fitted, None)
    assert again.estimate.step_time_s > 0
