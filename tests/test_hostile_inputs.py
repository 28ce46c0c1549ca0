"""Hostile and careless input (issue 17, section 3; rows 70-87 of ``docs/errors.md``).

Every case is refused with a typed error (exit code 2 and exactly one ``autoplan: error:`` line
in the CLI, no traceback) before anything is written, launched or expanded, and leaves every file
as it was:

* an output path that is one of the command's inputs (the same path, a symbolic or a hard link),
  and writing over an existing file keeps its permission bits;
* resource bounds: a billion devices, a YAML alias bomb, 200,000-deep JSON, a 5,000-digit
  integer, ``/dev/zero``, a FIFO or a directory as a plan or cluster file;
* hand-edited plans that are well-formed JSON but do not fit the model (named before any rank
  starts: ``autoplan run`` exits before torchrun);
* plan strings holding terminal escape sequences are shown as escapes, never sent to the
  terminal, and HTML-escaped in reports.

CLI cases run ``autoplan.tools.cli.main`` in process on the tiny models of ``tests/cli_models.py``
built on ``meta``; the two plans are made once per module.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
import time
from pathlib import Path

import pytest
import torch

import autoplan
from autoplan.cost_models.cluster import MAX_WORLD_SIZE
from autoplan.cost_models.echo import MAX_MESSAGE_CHARS, terminal_safe
from autoplan.cost_models.files import (
    MAX_YAML_NODES,
    InputLimitError,
    atomic_write,
    parse_yaml,
    read_limited,
    refuse_overwriting_inputs,
)
from tests import zoo
from tests.test_bad_inputs import assert_bad_input as assert_one_error_line
from tests.test_bad_inputs import cli

MODELS = Path(__file__).resolve().with_name("cli_models.py")
ESC = "\x1b"

# --- helpers ---------------------------------------------------------------------------------------


def assert_bad_input(result: tuple[int, str, str], *fragments: str) -> str:
    """As :func:`tests.test_bad_inputs.assert_bad_input` (exit code 2, one ``autoplan: error:``
    line holding every fragment, no traceback), and the line is bounded and terminal-safe."""
    line = assert_one_error_line(result, *fragments)
    assert len(line) < MAX_MESSAGE_CHARS + 100, f"unbounded message of {len(line)} characters"
    assert ESC not in line
    return line


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Content and mode of every file in ``folder`` (symbolic links by their own name)."""
    return {
        p.name: (p.read_bytes() if p.is_file() else b"", p.lstat().st_mode)
        for p in sorted(folder.iterdir())
        if not p.is_fifo()
    }


@pytest.fixture(scope="module")
def mlp_plan() -> autoplan.Plan:
    """``zoo.cli_mlp`` on 2xCPU, its input pinned batch-sharded (so the plan has collectives)."""
    plan = zoo.plan_on_meta(zoo.cli_mlp, pins={"input_0": "S(0)"})
    assert plan.collectives, "the edits below need a plan with collectives"
    return plan


@pytest.fixture(scope="module")
def pipeline_plan() -> autoplan.Plan:
    """GPT-2 (4 layers) in 2 pipeline stages (``zoo.ilp_and_pipeline_plans``)."""
    return zoo.ilp_and_pipeline_plans()["pipeline"]


@pytest.fixture()
def workdir(tmp_path: Path, mlp_plan: autoplan.Plan) -> Path:
    """A folder with a copy of the model file (``m.py``) and the MLP's plan (``p.json``, mode 0640)."""
    shutil.copy(MODELS, tmp_path / "m.py")
    mlp_plan.save(tmp_path / "p.json")
    os.chmod(tmp_path / "p.json", 0o640)
    return tmp_path


# --- A. an output path equal to an input -------------------------------------------------------------


def _link(workdir: Path, how: str) -> Path:
    """``p.json`` itself, a symbolic link to it, or a hard link of it."""
    if how == "same":
        return workdir / "p.json"
    link = workdir / f"{how}.json"
    if how == "symlink":
        link.symlink_to("p.json")
    else:
        os.link(workdir / "p.json", link)
    return link


@pytest.mark.parametrize("how", ["same", "symlink", "hardlink"])
def test_report_over_its_own_plan_file_is_refused_and_the_plan_kept(how, workdir, capfd):
    out = _link(workdir, how)
    before = snapshot(workdir)

    result = cli(capfd, "report", workdir / "p.json", "-o", out)

    assert_bad_input(result, "--out", "is the same file as the plan file", "give --out another path")
    assert snapshot(workdir) == before


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["plan", "{d}/m.py:mlp", "--cluster", "2xCPU", "--out", "{d}/m.py"], "the model file"),
        (["plan", "{d}/m.py:mlp", "--cluster", "{d}/c.yaml", "--out", "{d}/c.yaml"], "the cluster file"),
        (["plan", "{d}/m.py:mlp", "--cluster", "2xCPU", "--profile-db", "{d}/p.json", "-o", "{d}/p.json"], "profile"),
        (["export-onnx", "{d}/p.json", "--model", "{d}/m.py:mlp", "-o", "{d}/m.py"], "the model file"),
        (["run", "{d}/m.py:mlp", "--plan", "{d}/p.json", "--save-final", "{d}/p.json", "--steps", "0"], "plan file"),
        (["bench", "{d}/suite.yaml", "--out", "{d}/suite.yaml"], "the suite file"),
        (["bench", "{d}/suite.yaml", "--baseline", "{d}/p.json", "--out", "{d}/p.json"], "the baseline"),
        (["calibrate", "--cluster", "{d}/c.yaml", "--out", "{d}/c.yaml"], "the cluster file"),
    ],
    ids=["plan_over_model", "plan_over_cluster", "plan_over_profile_db", "onnx_over_model", "save_final_over_plan",
         "bench_over_suite", "bench_over_baseline", "calibrate_over_cluster"],
)  # fmt: skip
def test_every_command_refuses_to_write_over_its_input_before_working(argv, fragment, workdir, capfd):
    (workdir / "c.yaml").write_text("num_nodes: 1\ndevices_per_node: 2\ndevice: CPU\n")
    (workdir / "suite.yaml").write_text(f"cases:\n  - name: mlp\n    model: {workdir}/m.py:mlp\n    cluster: 2xCPU\n")
    before = snapshot(workdir)
    t0 = time.perf_counter()

    result = cli(capfd, *(a.format(d=workdir) for a in argv))

    assert_bad_input(result, "is the same file as the", fragment)
    assert result[1] == "", "nothing planned, printed or launched"
    assert snapshot(workdir) == before
    assert time.perf_counter() - t0 < 30, "refused before planning (a generous guard)"


def test_refusing_overwrites_compares_files_not_names(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text("{}")
    b.write_text("{}")
    refuse_overwriting_inputs(b, {"plan file": a, "none": None, "absent": tmp_path / "absent"})  # distinct: fine
    refuse_overwriting_inputs(tmp_path / "new.json", {"plan file": a})  # a new file cannot be an input

    with pytest.raises(autoplan.PlanFileError, match="same file as the plan file"):
        refuse_overwriting_inputs(tmp_path / "." / "a.json", {"plan file": a})


def test_writing_over_an_existing_file_keeps_its_permission_bits(workdir, mlp_plan, capfd):
    report = workdir / "r.html"
    report.write_text("old")
    os.chmod(report, 0o600)

    mlp_plan.save(workdir / "p.json")  # Plan.save over a 0640 plan
    rc, _out, err = cli(capfd, "report", workdir / "p.json", "-o", report)

    assert rc == 0, err
    assert stat.S_IMODE((workdir / "p.json").stat().st_mode) == 0o640
    assert stat.S_IMODE(report.stat().st_mode) == 0o600
    assert report.read_text().startswith("<!DOCTYPE html>")
    assert not list(workdir.glob(".*.tmp")), "temporary file left behind"


def test_writing_through_a_symbolic_link_keeps_the_link_and_the_target_mode(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    os.chmod(target, 0o604)
    (tmp_path / "link.json").symlink_to("real.json")

    atomic_write(tmp_path / "link.json", "new", what="plan file")

    assert (tmp_path / "link.json").is_symlink()
    assert target.read_text() == "new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o604


def test_a_new_file_gets_the_mode_open_would_give_it(tmp_path):
    old = os.umask(0o027)
    try:
        atomic_write(tmp_path / "plan.json", "{}", what="plan file")
        atomic_write(tmp_path / "report.html", "<html>", what="report")
    finally:
        os.umask(old)

    assert stat.S_IMODE((tmp_path / "plan.json").stat().st_mode) == 0o640  # not mkstemp's 0600
    assert stat.S_IMODE((tmp_path / "report.html").stat().st_mode) == 0o640


def test_a_fifo_out_is_written_into_not_replaced(tmp_path):
    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()

    atomic_write(fifo, "{}", what="plan file")
    reader.join(timeout=10)

    assert received == [b"{}"]
    assert fifo.is_fifo(), "the FIFO was replaced by a regular file"


def test_a_directory_as_out_is_one_line_and_left_alone(workdir, capfd):
    (workdir / "out").mkdir()

    result = cli(capfd, "report", workdir / "p.json", "-o", workdir / "out")

    assert_bad_input(result, "it is a directory")
    assert list((workdir / "out").iterdir()) == []


# --- B. resource bounds ------------------------------------------------------------------------------


BILLION_LAUGHS = "".join(
    [
        "num_nodes: 1\ndevices_per_node: 2\ndevice: CPU\nmesh_axis_names: [",
        '&a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"], ',
        ", ".join(f"&{b} [{','.join([f'*{a}'] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi", strict=True)),
        "]\n",
    ]
)
"""9 levels of 9 aliases: 9**9 (387 million) strings once expanded, from 72 aliases."""


@pytest.mark.parametrize(
    ("cluster", "fragment"),
    [
        ("1000000000xH100", "1 nodes x 1000000000 devices is more than the 1,048,576 devices"),
        ("1000x1000000xH100", "1000 nodes x 1000000 devices is more than the 1,048,576 devices"),
        ("9" * 5000 + "xH100", "more than the 1,048,576 devices"),
        ("1048577xCPU", "more than the 1,048,576 devices"),
    ],
    ids=["billion", "thousand_by_million", "5000_digits", "one_over"],
)
def test_a_cluster_of_absurd_size_is_refused_at_once(cluster, fragment, capfd, tmp_path):
    t0 = time.perf_counter()

    result = cli(capfd, "plan", f"{MODELS}:mlp", "--cluster", cluster, "--out", tmp_path / "p.json")

    assert_bad_input(result, fragment)
    assert not (tmp_path / "p.json").exists()
    assert time.perf_counter() - t0 < 30  # a generous guard: it used to run out of memory


def test_the_largest_cluster_is_accepted():
    assert autoplan.Cluster.preset(f"{MAX_WORLD_SIZE // 8}x8xH100").world_size == MAX_WORLD_SIZE


CLUSTER_FILES = {
    "alias_bomb": ("c.yaml", BILLION_LAUGHS, f"expands to more than {MAX_YAML_NODES:,} values"),
    "deep_yaml": ("c.yaml", "num_nodes: " + "[" * 200_000 + "]" * 200_000 + "\n", "nests deeper than 100 levels"),
    "deep_json": ("c.json", '{"num_nodes": ' + "[" * 200_000 + "]" * 200_000 + "}", "nests too deeply"),
    "huge_yaml_int": ("c.yaml", f"num_nodes: {'9' * 4000}\ndevices_per_node: 2\ndevice: CPU\n", "integer of about"),
    "5000_digit_json": ("c.json", '{"num_nodes": ' + "9" * 5000 + "}", "integer of more than 4,300 digits"),
    "huge_mesh": ("c.yaml", f"num_nodes: 1\ndevices_per_node: 2\ndevice: CPU\nmesh_shape: [{'9' * 4000}]\n", "does not fit"),
    "huge_file": ("c.yaml", "# " + "x" * (2 * 1024**2) + "\n", "larger than the 1 MiB"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CLUSTER_FILES))
def test_a_hostile_cluster_file_is_refused_within_bounds(case, capfd, tmp_path):
    name, text, fragment = CLUSTER_FILES[case]
    (tmp_path / name).write_text(text)
    t0 = time.perf_counter()

    result = cli(capfd, "plan", f"{MODELS}:mlp", "--cluster", tmp_path / name, "--out", tmp_path / "p.json")

    assert_bad_input(result, f"cluster file '{tmp_path / name}'", fragment)
    assert not (tmp_path / "p.json").exists()
    assert time.perf_counter() - t0 < 30  # a generous guard: the bomb used to hang


@pytest.mark.parametrize("kind", ["dev_zero", "symlink_to_dev_zero", "fifo", "directory"])
def test_a_device_fifo_or_directory_as_cluster_file_is_one_line(kind, capfd, tmp_path):
    path = {"dev_zero": Path("/dev/zero")}.get(kind, tmp_path / "c.yaml")
    if kind == "symlink_to_dev_zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)  # no writer: must not block
    elif kind == "directory":
        path.mkdir()
    fragment = {"dev_zero": "has extension ''", "symlink_to_dev_zero": "larger than the 1 MiB",
                "fifo": "is empty", "directory": "Is a directory"}[kind]  # fmt: skip

    result = cli(capfd, "plan", f"{MODELS}:mlp", "--cluster", path, "--out", tmp_path / "p.json")

    assert_bad_input(result, fragment)


def _hostile_plan_file(path: Path, kind: str, plan_text: str) -> Path:
    if kind == "deep_json":
        path.write_text("[" * 200_000 + "]" * 200_000)
    elif kind == "5000_digit_int":
        path.write_text(plan_text.replace('"num_variables": ', '"num_variables": ' + "9" * 5000 + ', "x": '))
    elif kind == "4000_digit_int":
        data = json.loads(plan_text)
        data["cluster"]["num_nodes"] = int("9" * 4000)
        path.write_text(json.dumps(data))
    elif kind == "megabyte_placement":
        data = json.loads(plan_text)
        data["placements"]["inputs"] = [["S(" + "1" * 1_000_000 + ")"]]
        path.write_text(json.dumps(data))
    elif kind == "dev_zero":
        return Path("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    return path


PLAN_FILES = {
    "deep_json": "nests too deeply to read",
    "5000_digit_int": "integer of more than 4,300 digits",
    "4000_digit_int": "integer of about 4,000 digits",
    "megabyte_placement": "is malformed",
    "dev_zero": "is larger than the 64 MiB autoplan reads",
    "fifo": "is not valid JSON",
    "directory": "Is a directory",
}


@pytest.mark.parametrize("command", ["show", "run"])
@pytest.mark.parametrize("kind", list(PLAN_FILES))
def test_a_hostile_plan_file_is_refused_within_bounds(kind, command, workdir, capfd):
    path = _hostile_plan_file(workdir / "hostile.json", kind, (workdir / "p.json").read_text())
    argv = ["show", path] if command == "show" else ["run", workdir / "m.py:mlp", "--plan", path, "--steps", "0"]

    result = cli(capfd, *argv)

    assert_bad_input(result, "plan file", PLAN_FILES[kind])
    assert result[1] == ""


def test_read_limited_stops_after_the_limit_on_an_endless_file():
    with pytest.raises(InputLimitError, match="larger than the 1 MiB"):
        read_limited("/dev/zero", max_bytes=1024**2)


def test_parse_yaml_still_reads_anchors_and_merge_keys():
    text = "base: &b {device: CPU, num_nodes: 1}\nc: {<<: *b, devices_per_node: 2}\nd: [*b, *b]\n"

    doc = parse_yaml(text)

    assert doc["c"] == {"device": "CPU", "num_nodes": 1, "devices_per_node": 2}
    assert doc["d"] == [doc["base"], doc["base"]]


def test_the_cluster_api_names_the_bound():
    with pytest.raises(autoplan.ClusterSpecError, match="1,048,576 devices"):
        autoplan.Cluster(num_nodes=2**20, devices_per_node=2, device="CPU")


# --- C. hand-edited plans that do not fit the model --------------------------------------------------


def _edit(data: dict, case: str) -> None:
    params = data["placements"]["params"]
    if case == "shard_dim_beyond_rank":
        params["0.weight"] = ["S(5)"]
    elif case == "renamed_param":
        data["param_names"][0] = "0.wieght"
        params["0.wieght"] = params.pop("0.weight")
    elif case == "partial_param":
        params["0.bias"] = ["P"]
    elif case == "input_dim_beyond_rank":
        data["placements"]["inputs"] = [["S(3)"]]
    elif case == "node_dim_beyond_rank":
        data["nodes"]["addmm"]["out"] = [["S(2)"]]
    elif case == "renamed_node":
        data["nodes"]["addmm_x"] = data["nodes"].pop("addmm")
    elif case == "dropped_node":
        del data["nodes"]["gelu"]
    elif case == "changed_op":
        data["nodes"]["gelu"]["op"] = "aten.relu.default"
    elif case == "missing_argument":
        data["nodes"]["addmm"]["in"] = data["nodes"]["addmm"]["in"][:1]
    elif case == "impossible_combination":
        data["nodes"]["gelu"]["out"] = [["S(1)"]]  # gelu of a replicated input cannot come out sharded
    elif case == "sharded_fallback":
        data["fallback_ops"]["addmm"] = "aten.addmm.default"
    elif case == "extra_target":
        data["placements"]["targets"].append(["R"])


RUN_MISFITS = {
    "shard_dim_beyond_rank": "placements.params['0.weight'] shards dim 5 of a 2-D tensor (32, 16)",
    "renamed_param": "placements.params['0.wieght'] names no parameter of this model (close: 0.weight",
    "partial_param": "placements.params['0.bias'] is P: an input or parameter is R, S(d) or S(d)/k",
    "input_dim_beyond_rank": "placements.inputs[0] shards dim 3 of a 2-D tensor (8, 16)",
    "node_dim_beyond_rank": "nodes['addmm'].out[0] shards dim 2 of a 2-D tensor (8, 32)",
    "renamed_node": "nodes['addmm_x'] (op 'aten.addmm.default') is not an operator of this model's program",
    "dropped_node": "nodes has no entry for the operator 'gelu'",
    "changed_op": "nodes['gelu'] (op 'aten.relu.default') is not an operator",
    "missing_argument": "nodes['addmm'] has 1 output and 1 argument placement list(s)",
    "impossible_combination": "nodes['gelu']: S(1)<-(R) is not a way to run 'aten.gelu.default' on mesh (2,)",
    "sharded_fallback": "nodes['addmm'] runs replicated (fallback_ops) but its placements are not all R",
    "extra_target": "placements.targets has 2 placement list(s) but the model takes 1 targets",
}


@pytest.mark.parametrize("case", list(RUN_MISFITS))
def test_run_names_the_hand_edited_entry_that_does_not_fit_before_launching(case, workdir, capfd):
    data = json.loads((workdir / "p.json").read_text())
    _edit(data, case)
    (workdir / "p.json").write_text(json.dumps(data))

    result = cli(capfd, "run", workdir / "m.py:mlp", "--plan", workdir / "p.json", "--steps", "0")

    assert_bad_input(result, "plan entry", RUN_MISFITS[case], "undo the edit or re-plan")
    assert result[1] == "", "no summary, no torchrun"


def test_parallelize_names_a_hand_edited_entry_too(mlp_plan):
    data = mlp_plan.to_dict()
    _edit(data, "shard_dim_beyond_rank")
    plan = autoplan.Plan.from_dict(data)
    wl = zoo.cli_mlp()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(autoplan.PlanMismatchError, match=r"shards dim 5 of a 2-D tensor"):
            autoplan.parallelize(
                wl.model, None, example_inputs=wl.example_inputs, loss_fn=wl.loss_fn,
                example_targets=wl.example_targets, plan=plan,
            )  # fmt: skip
    finally:
        torch.distributed.destroy_process_group()


LOAD_MISFITS = {
    "collective_on_missing_axis": "collectives[0] ('addmm' -> 'gelu') has a step all_gather on mesh axis 3",
    "collective_of_unknown_kind": "collectives[0] has a step of unknown kind 'teleport'",
    "three_placements_on_one_axis": "placements.params['0.bias'] has 3 placement(s) for a 1-axis mesh",
    "params_and_names_disagree": "param_names and placements.params must name the same parameters",
}


@pytest.mark.parametrize("case", list(LOAD_MISFITS))
def test_a_plan_entry_against_its_own_mesh_is_refused_when_loaded(case, workdir, capfd):
    data = json.loads((workdir / "p.json").read_text())
    if case == "collective_on_missing_axis":
        data["collectives"][0]["steps"] = [["all_gather", 3]]
    elif case == "collective_of_unknown_kind":
        data["collectives"][0]["steps"] = [["teleport", 0]]
    elif case == "three_placements_on_one_axis":
        data["placements"]["params"]["0.bias"] = ["R", "R", "R"]
    else:
        data["placements"]["params"]["extra.weight"] = ["R"]
    (workdir / "p.json").write_text(json.dumps(data))

    result = cli(capfd, "show", workdir / "p.json")

    assert_bad_input(result, "is malformed", LOAD_MISFITS[case], "fix that entry")


PIPELINE_MISFITS = {
    "stage_starts_not_rising": ({"stage_starts": [0, 0]}, "must rise from 0"),
    "stage_beyond_the_segments": ({"stage_starts": [0, 9]}, "stay below the 6 segments"),
    "one_stage_too_many": ({"stage_starts": [0, 2, 4]}, "has 3 stage(s) but config has pp*virtual_stages = 2"),
    "recompute_per_stage_missing": ({"stage_recompute": ["none"]}, "pipeline.stage_recompute ['none'] must give"),
    "unknown_recompute": ({"stage_recompute": ["none", "most"]}, "must give one of none, selective, full"),
    "stage_mesh_of_other_size": ({"stage_mesh_shape": [4]}, "pipeline.stage_mesh_shape [4]"),
    "stage_mesh_axis_renamed": ({"stage_axis_names": ["ep"]}, "is not the stage mesh of config"),
    "traced_blocks_beyond_model": ({"traced_blocks": 7}, "pipeline.traced_blocks 7 must be 0..4"),
    "no_config": ({}, "KeyError: 'config'"),
}


@pytest.mark.parametrize("case", list(PIPELINE_MISFITS))
def test_a_hand_edited_pipeline_layout_is_refused_when_loaded(case, pipeline_plan, tmp_path, capfd):
    edit, fragment = PIPELINE_MISFITS[case]
    data = pipeline_plan.to_dict()
    data["pipeline"].update(edit)
    if case == "no_config":
        del data["config"]
    (tmp_path / "p.json").write_text(json.dumps(data))

    result = cli(capfd, "show", tmp_path / "p.json")

    assert_bad_input(result, "is malformed", fragment)


def test_the_plans_made_here_fit_their_models(mlp_plan, pipeline_plan):
    """The checks above refuse edits, not what the planner writes (both plans, through a file)."""
    from autoplan.passes.trace import trace_training_step
    from autoplan.planner.ilp import check_plan_fits
    from autoplan.planner.tracing import trace_for_plan

    with torch.device("meta"):
        mlp, gpt2 = zoo.cli_mlp(), zoo.gpt2_4_layers()
    traced = trace_training_step(
        mlp.model, mlp.example_inputs, loss_fn=mlp.loss_fn, example_targets=mlp.example_targets
    )
    check_plan_fits(autoplan.Plan.from_dict(mlp_plan.to_dict()), traced)
    planned = trace_for_plan(pipeline_plan, gpt2.model, gpt2.example_inputs, gpt2.example_targets, gpt2.loss_fn)
    check_plan_fits(autoplan.Plan.from_dict(pipeline_plan.to_dict()), planned)


# --- D. terminal escape sequences and HTML ----------------------------------------------------------

HOSTILE = "\x1b]0;pwned\x07\x1b[2J\x9b31m\u202e<script>alert(1)</script>"


def _hostile_strings(plan: autoplan.Plan) -> dict:
    """The plan with escape sequences (and markup) in every free-text field a hand edit can reach."""
    data = plan.to_dict()
    old = data["param_names"][0]
    data["param_names"][0] = new = old + HOSTILE
    data["placements"]["params"][new] = data["placements"]["params"].pop(old)
    data["nodes"]["gelu" + HOSTILE] = data["nodes"].pop("gelu")
    data["nodes"]["t"]["op"] = "aten.t.default" + HOSTILE
    data["fingerprint"] += HOSTILE
    data["workload"] = "m.py:mlp" + HOSTILE
    data["estimate"]["memory_peak_at"] = "addmm" + HOSTILE
    data["collectives"][0]["consumer"] += HOSTILE
    data["fallback_ops"] = {"gelu" + HOSTILE: "aten.gelu.default" + HOSTILE}
    data["cluster"]["mesh_axis_names"] = ["intra" + HOSTILE]
    return data


@pytest.mark.parametrize("command", ["show", "explain", "diff", "summary"])
def test_plan_strings_never_reach_the_terminal_as_escape_sequences(command, mlp_plan, tmp_path, capfd):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_hostile_strings(mlp_plan)))
    mlp_plan.save(tmp_path / "clean.json")
    if command == "summary":
        out = autoplan.Plan.load(path).summary()
    else:
        argv = {
            "show": ["show", path],
            "explain": ["explain", path, "--op", "gelu" + HOSTILE],
            "diff": ["diff", tmp_path / "clean.json", path],
        }[command]
        rc, out, err = cli(capfd, *argv)
        assert rc == 0, err

    assert ESC not in out and "\x07" not in out and "\x9b" not in out and "\u202e" not in out
    assert "\\x1b]0;pwned\\x07" in out, "the escapes are shown, not dropped"


def test_an_error_line_never_carries_an_escape_sequence_or_a_newline(capfd, tmp_path):
    path = tmp_path / f"p{HOSTILE}\nline2.json"

    result = cli(capfd, "show", path)

    assert_bad_input(result, "does not exist")


def test_terminal_safe_keeps_newlines_tabs_and_text():
    assert terminal_safe("a\tb\nc é 中") == "a\tb\nc é 中"
    assert terminal_safe("\x1b[31mred\x1b[0m") == "\\x1b[31mred\\x1b[0m"


def test_the_html_report_escapes_plan_strings(mlp_plan, tmp_path, capfd):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_hostile_strings(mlp_plan)))

    rc, _out, err = cli(capfd, "report", path, "-o", tmp_path / "r.html")

    assert rc == 0, err
    html = (tmp_path / "r.html").read_text()
    assert "<script>alert(1)</script>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html


# --- profile database: read within bounds like the plan and cluster files ------------------------------


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[" * 200_000 + "]" * 200_000, "nests too deeply"),
        ('{"format": "autoplan-profile-db", "version": ' + "9" * 5000 + "}", "more than 4,300 digits"),
        ('{"format": "' + "x" * 100_000 + '"}', "is not an autoplan profile database"),
    ],
    ids=["deep", "huge_integer", "huge_string"],
)
def test_hostile_profile_database_is_one_bounded_profile_error(tmp_path, content, message):
    from autoplan.cost_models.errors import ProfileError
    from autoplan.cost_models.profile_db import ProfileDB

    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(ProfileError, match=message) as info:
        ProfileDB.load(path)
    assert len(str(info.value)) < 500 and "\n" not in str(info.value)


def test_dev_zero_as_profile_database_is_refused_by_size(monkeypatch):
    from autoplan.cost_models import profile_db
    from autoplan.cost_models.errors import ProfileError

    monkeypatch.setattr(profile_db, "MAX_PROFILE_FILE_BYTES", 4 * 1024**2)  # the cap, not 256 MiB of zeros
    with pytest.raises(ProfileError, match="larger than the 4 MiB autoplan reads"):
        profile_db.ProfileDB.load("/dev/zero")
