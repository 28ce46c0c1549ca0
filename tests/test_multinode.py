"""``autoplan run`` on several nodes: torchrun's c10d rendezvous (``autoplan/tools/nodes.py``).

* the torchrun command: one node meets at ``127.0.0.1:--master-port`` as before; ``--nnodes 2``
  joins through ``--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID`` with
  ``--nproc-per-node`` = world size / nodes, and never passes ``--node-rank`` (c10d ranks the nodes);
* flags absent inside an ``srun`` step are read from SLURM (nodes, node id, job id, the first host
  of the nodelist, expanded by ``scontrol`` when it is a range), the endpoint from ``MASTER_ADDR``;
* bad input (a world size the nodes cannot launch, a node rank out of range, a malformed endpoint,
  several srun tasks per node) is one ``autoplan: error:`` line, exit 2, before anything runs;
* two "nodes" of 2 ranks each on this machine (two ``autoplan run`` processes started together)
  train ``cli_models.py:mlp`` on a 2x2 mesh (data-parallel across the nodes, tensor-parallel within)
  like the single-device model; given two different plans they both stop with one line; with a
  rank killed on one node, ``--max-restarts 1`` restarts both nodes from the last checkpoint.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import autoplan
from autoplan.cost_models.errors import PlanError, PlanMismatchError
from autoplan.tools import run
from autoplan.tools.cli import build_parser
from autoplan.tools.loader import build_workload
from autoplan.tools.nodes import DEFAULT_RDZV_PORT, Nodes, nodes_from_args, parse_endpoint
from tests.harness import free_port
from tests.test_bad_inputs import assert_bad_input
from tests.test_bad_inputs import cli as cli_main
from tests.test_cli import run_cli, target

MLP = target("mlp")
TWO_BY_TWO_PINS = ("input_0=S(0),R", "0.weight=R,S(0)", "0.bias=R,S(0)", "2.weight=R,S(1)")
"""Data-parallel across the nodes (mesh axis ``inter``), Megatron-style tensor-parallel within."""
LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "SLURM_STEP_ID", "SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NODEID")


def parse_run(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["run", MLP, *argv])


def nodes_of(*argv: str, env: dict[str, str] | None = None) -> Nodes:
    return nodes_from_args(parse_run("--plan", "p.json", *argv), env or {})


@pytest.fixture()
def no_launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No SLURM or MASTER_ADDR of the machine running the tests leaks into an in-process run."""
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)


# --- the torchrun command --------------------------------------------------------------------------


def test_two_nodes_meet_through_c10d_with_half_the_ranks_each_and_no_node_rank(tmp_path):
    args = parse_run("--plan", "p.json", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "node1:29555")
    spans = nodes_from_args(args, {})
    nproc = spans.ranks_per_node(4, what="the plan")

    cmd = run._torchrun_command(
        args, "p.json", spans.torchrun_args(nproc_per_node=nproc, master_port=None), tmp_path / "bad"
    )

    launcher = cmd[: cmd.index("-m", 3)]
    assert launcher[1:3] == ["-m", "torch.distributed.run"]
    assert launcher[3:] == ["--nproc-per-node", "2", "--nnodes", "2", "--rdzv-backend", "c10d",
                            "--rdzv-endpoint", "node1:29555", "--rdzv-id", "autoplan",
                            "--rdzv-conf", "join_timeout=600"]  # fmt: skip
    assert "--node-rank" not in cmd and "--master-port" not in cmd
    assert spans.torchrun_env() == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # a fresh store per round
    assert cmd[cmd.index("--bad-input-file") + 1] == str(tmp_path / "bad")


def test_one_node_meets_on_localhost_at_the_master_port():
    spans = nodes_of()

    assert spans.torchrun_args(nproc_per_node=spans.ranks_per_node(2, what="the plan"), master_port=29601) == [
        "--nproc-per-node", "2", "--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", "29601",
    ]  # fmt: skip
    assert spans.torchrun_env() == {}


def test_ranks_per_node_must_make_the_plans_world_size():
    assert nodes_of("--nnodes", "2", "--rdzv-endpoint", "h", "--nproc-per-node", "2").ranks_per_node(4, what="x") == 2
    with pytest.raises(
        PlanMismatchError, match=r"has 4 devices but --nnodes 2 x --nproc-per-node 3 = 6 ranks: give --nproc-per-node 2"
    ):
        nodes_of("--nnodes", "2", "--rdzv-endpoint", "h", "--nproc-per-node", "3").ranks_per_node(4, what="the plan")
    with pytest.raises(PlanMismatchError, match="--nnodes 3 cannot share them equally: give --nnodes dividing 4"):
        nodes_of("--nnodes", "3", "--rdzv-endpoint", "h").ranks_per_node(4, what="the plan")


# --- SLURM and MASTER_ADDR -------------------------------------------------------------------------

SRUN_STEP = {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
             "SLURM_STEP_NUM_TASKS": "2"}  # fmt: skip


def test_srun_step_gives_nodes_node_id_job_id_and_the_first_host():
    spans = nodes_of(env={**SRUN_STEP, "SLURM_JOB_NODELIST": "gpu-a,gpu-b"})

    assert (spans.num_nodes, spans.node_rank, spans.rdzv_id) == (2, 1, "4242")
    assert spans.rdzv_endpoint == f"gpu-a:{DEFAULT_RDZV_PORT}"


def test_flags_win_over_slurm_and_master_addr_over_the_nodelist():
    env = {**SRUN_STEP, "SLURM_JOB_NODELIST": "gpu-a,gpu-b", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29511"}

    assert nodes_of(env=env).rdzv_endpoint == "10.0.0.7:29511"
    assert nodes_of("--rdzv-endpoint", "gpu-b:1234", "--rdzv-id", "mine", env=env).rdzv_endpoint == "gpu-b:1234"
    assert nodes_of("--rdzv-id", "mine", env=env).rdzv_id == "mine"


def test_batch_script_outside_srun_is_one_node():
    env = {k: v for k, v in SRUN_STEP.items() if k != "SLURM_STEP_ID"}

    assert nodes_of(env={**env, "SLURM_JOB_NODELIST": "gpu-a,gpu-b"}).num_nodes == 1


def test_nodelist_range_is_expanded_by_scontrol_when_it_is_on_path(tmp_path, monkeypatch):
    env = {**SRUN_STEP, "SLURM_JOB_NODELIST": "gpu[07-08]"}
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(PlanError, match=r"'gpu\[07-08\]' is a range and `scontrol` is not on PATH.*--rdzv-endpoint"):
        nodes_of(env=env)

    scontrol = tmp_path / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "gpu07\\ngpu08\\n"\n')
    scontrol.chmod(0o755)
    assert nodes_of(env=env).rdzv_endpoint == f"gpu07:{DEFAULT_RDZV_PORT}"


def test_srun_with_several_tasks_per_node_is_refused():
    with pytest.raises(PlanError, match="srun started 4 tasks on 2 nodes.*--ntasks-per-node=1"):
        nodes_of(env={**SRUN_STEP, "SLURM_STEP_NUM_TASKS": "4", "SLURM_JOB_NODELIST": "a,b"})


@pytest.mark.parametrize(
    ("text", "expected"),
    [("node1", f"node1:{DEFAULT_RDZV_PORT}"), ("node1:29500", "node1:29500"), ("[::1]:29500", "[::1]:29500"),
     ("[fe80::1]", f"[fe80::1]:{DEFAULT_RDZV_PORT}")],
)  # fmt: skip
def test_endpoint_is_host_and_port_with_torchruns_default_port(text, expected):
    assert parse_endpoint(text) == expected


@pytest.mark.parametrize(
    "text", ["", ":29500", "node1:", "node1:http", "node1:70000", "a b:1", "[::1", "[::1]x", "::1"]
)
def test_malformed_endpoint_is_a_plan_error(text):
    with pytest.raises(PlanError, match="--rdzv-endpoint"):
        parse_endpoint(text)


# --- bad input on the command line: one line, exit 2, nothing launched -----------------------------


def save_two_device_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-device plan of MLP (no calibration), saved in a fresh temporary folder."""
    wl = build_workload(MLP, device="meta")
    plan = autoplan.plan(wl.model, "2xCPU", example_inputs=wl.example_inputs, loss_fn=wl.loss_fn,
                         example_targets=wl.example_targets, profile=None)  # fmt: skip
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.save(path)
    return path


@pytest.fixture(scope="module")
def two_device_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_two_device_plan(tmp_path_factory)


def test_plan_world_size_other_than_nodes_times_ranks_is_one_line(two_device_plan, no_launch_env, capfd):
    result = cli_main(capfd, "run", MLP, "--plan", two_device_plan, "--nnodes", "2", "--nproc-per-node", "2",
                      "--rdzv-endpoint", "127.0.0.1:29500")  # fmt: skip

    assert_bad_input(
        result, "the plan has 2 devices", "--nnodes 2 x --nproc-per-node 2 = 4 ranks", "--nproc-per-node 1"
    )
    assert result[1] == ""


def test_cluster_the_nodes_cannot_share_is_refused_before_planning(no_launch_env, capfd):
    result = cli_main(capfd, "run", MLP, "--cluster", "2x2xCPU", "--nnodes", "3", "--rdzv-endpoint", "h:1")

    assert_bad_input(result, "--cluster 2x2xCPU has 4 devices", "--nnodes dividing 4")
    assert result[1] == ""


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (("--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"), "--node-rank 2 is out of range for --nnodes 2"),
        (("--node-rank", "1",), "--node-rank 1 is out of range for --nnodes 1: give a node rank in 0..0"),
        (("--nnodes", "2", "--rdzv-endpoint", "node1:http"), "--rdzv-endpoint 'node1:http': port 'http'"),
        (("--nnodes", "2", "--rdzv-endpoint", ":29500"), "--rdzv-endpoint ':29500' is malformed"),
        (("--nnodes", "2",), "--nnodes 2 needs --rdzv-endpoint HOST[:PORT]"),
        (("--nnodes", "2", "--rdzv-endpoint", "h:1", "--master-port", "29500"), "give --rdzv-endpoint HOST:PORT instead"),
        (("--rdzv-endpoint", "h:1",), "--rdzv-endpoint joins several nodes: give --nnodes N > 1"),
    ],
)  # fmt: skip
def test_bad_node_options_are_one_line_before_anything_runs(argv, said, no_launch_env, capfd):
    result = cli_main(capfd, "run", MLP, "--cluster", "2x2xCPU", *argv)

    assert_bad_input(result, said)
    assert result[1] == ""


# --- two nodes on this machine ---------------------------------------------------------------------


def run_nodes(cwd: Path, per_node: list[list[str]]) -> list[subprocess.CompletedProcess[str]]:
    """One ``autoplan ARGS`` process per node, started together (``tests/test_cli.py``'s ``run_cli``)."""
    with ThreadPoolExecutor(len(per_node)) as pool:
        return list(pool.map(lambda argv: run_cli(cwd, *argv, timeout_s=300), per_node))


@pytest.mark.slow  # 4 ranks and 2 planners on 2 cores: 20-40 s
def test_two_nodes_of_two_ranks_train_like_one_device(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    pins = [arg for pin in TWO_BY_TWO_PINS for arg in ("--pin", pin)]
    common = ["run", MLP, "--cluster", "2x2xCPU", *pins, "--steps", "3", "--compare", "--nnodes", "2",
              "--rdzv-endpoint", endpoint]  # fmt: skip

    results = run_nodes(tmp_path, [[*common, "--node-rank", str(k)] for k in (0, 1)])

    for r in results:
        assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
        assert "Traceback" not in r.stderr and "all_reduce@inter" in r.stdout  # the gradient crosses the nodes
    out = "".join(r.stdout for r in results)
    print(out)
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 3  # global rank 0 prints, on whichever node the rendezvous put first
    assert all(float(re.search(r"rel\.diff (\S+)", s)[1]) <= 1e-6 for s in steps), steps
    worst = re.search(r"max relative error vs single device (\S+)", out)
    assert worst is not None and float(worst[1]) <= 1e-5, out


@pytest.mark.slow  # two torchrun jobs of 2 ranks meeting: 10-20 s
def test_nodes_holding_different_plans_stop_with_one_line_each(tmp_path):
    wl = build_workload(MLP, device="meta")
    for name, pin in (("a.json", "S(0),R"), ("b.json", "S(0),S(0)")):
        autoplan.plan(wl.model, "2x2xCPU", example_inputs=wl.example_inputs, loss_fn=wl.loss_fn,
                      example_targets=wl.example_targets, pins={"input_0": pin}, profile=None).save(tmp_path / name)  # fmt: skip
    endpoint = f"127.0.0.1:{free_port()}"

    results = run_nodes(tmp_path, [["run", MLP, "--plan", name, "--steps", "1", "-q", "--nnodes", "2",
                                    "--rdzv-endpoint", endpoint] for name in ("a.json", "b.json")])  # fmt: skip

    for r in results:
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and len(lines) == 1, f"exit {r.returncode}\nstderr:\n{r.stderr}"
        assert lines[0].startswith("autoplan: error: the ranks hold 2 different plans (ranks 0,1 on"), lines[0]
        assert "--plan plan.json" in lines[0] and r.stdout == ""


@pytest.mark.slow  # two attempts of 4 ranks: 40-60 s
def test_rank_killed_on_one_node_restarts_both_nodes_from_the_last_checkpoint(tmp_path):
    wl = build_workload(MLP, device="meta")
    autoplan.plan(wl.model, "2x2xCPU", example_inputs=wl.example_inputs, loss_fn=wl.loss_fn,
                  example_targets=wl.example_targets, pins={"input_0": "S(0),R"}, profile=None).save(tmp_path / "p.json")  # fmt: skip
    argv = ["run", MLP, "--plan", "p.json", "--steps", "4", "--compare", "-q", "--checkpoint-dir", "ckpt",
            "--checkpoint-every", "1", "--max-restarts", "1", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]  # fmt: skip

    with ThreadPoolExecutor(2) as pool:  # the last rank exits after step 2, before that step's checkpoint
        results = list(
            pool.map(lambda _: run_cli(tmp_path, *argv, timeout_s=400, env={"AUTOPLAN_FAULT_AT_STEP": "2"}), (0, 1))
        )

    assert [r.returncode for r in results] == [0, 0], "\n".join(r.stderr for r in results)
    out = "".join(r.stdout for r in results)
    assert "injected fault after step 2" in "".join(r.stderr for r in results)
    resumed = out.split(f"resumed from checkpoint {tmp_path / 'ckpt' / 'step_1'} (step 1)")[1]
    assert [line.split()[1] for line in resumed.splitlines() if line.startswith("step ")] == ["2", "3", "4"]
    worst = re.search(r"max relative error vs single device (\S+)", resumed)
    assert worst is not None and float(worst[1]) <= 1e-5, out
