"""Seams of ``autoplan run``'s launch (issue #46): nodes started alike, the collective timeout,
links in the checkpoint directory, the rendezvous host and a port taken before torchrun binds it."""

from __future__ import annotations

import argparse
import datetime
import socket
import sys
from pathlib import Path

import pytest

import autoplan
from autoplan.cost_models.errors import PlanError, PlanMismatchError
from autoplan.runtime import checkpoint
from autoplan.tools import launch, run, worker
from autoplan.tools.nodes import Nodes
from tests.harness import free_port
from tests.test_bad_inputs import assert_bad_input
from tests.test_bad_inputs import cli as cli_main
from tests.test_cli import run_cli, target
from tests.test_multinode import no_launch_env, run_nodes, save_two_device_plan  # noqa: F401 - a fixture

MLP = target("mlp")


def worker_args(*argv: str, target_: str = MLP) -> argparse.Namespace:
    return worker._parse_args([target_, "--plan", "p.json", *argv])


def held(*per_rank: tuple[argparse.Namespace, str]) -> list[tuple[dict[str, object], str] | None]:
    plan = autoplan.Plan.load(PLAN[0])
    return [(worker.start_fields(plan, args), host) for args, host in per_rank]


PLAN: list[Path] = []
"""The module's 2-device plan of MLP (made once, by the fixture)."""


@pytest.fixture(scope="module", autouse=True)
def two_device_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = save_two_device_plan(tmp_path_factory)
    PLAN[:] = [path]
    return path


# --- 1. the nodes started alike ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("other", "said"),
    [
        (("--seed", "1"), "different --seed (ranks 0 on a: 0; ranks 1 on b: 1)"),
        (("--steps", "3"), "different --steps (ranks 0 on a: 10; ranks 1 on b: 3)"),
        (("--save-final", "x.pt"), "different --save-final (given or not) (ranks 0 on a: False; ranks 1 on b: True)"),
        (("--checkpoint-dir", "c", "--checkpoint-every", "2"), "different --checkpoint-dir (given or not)"),
    ],
)
def test_ranks_started_with_other_options_are_refused_naming_rank_and_field(other, said):
    with pytest.raises(PlanMismatchError) as err:
        worker.check_same_start(held((worker_args(), "a"), (worker_args(*other), "b")))
    assert said in str(err.value) and "\n" not in str(err.value)


def test_same_start_passes_and_the_build_function_source_is_compared(tmp_path):
    worker.check_same_start(held((worker_args(), "a"), (worker_args(), "b")))
    src = Path(MLP.rsplit(":", 1)[0]).read_text()
    (tmp_path / "m.py").write_text(src + "\n# edited on one node\n")
    edited = worker_args(target_=f"{tmp_path / 'm.py'}:mlp")
    with pytest.raises(PlanMismatchError, match="different the build function"):
        worker.check_same_start(held((worker_args(), "a"), (edited, "b")))


@pytest.mark.slow  # two torchrun jobs of 1 rank meeting: 10-20 s
def test_nodes_started_with_different_seeds_stop_with_one_line_each(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    results = run_nodes(tmp_path, [["run", MLP, "--plan", str(PLAN[0]), "--steps", "1", "-q", "--nnodes", "2",
                                    "--rdzv-endpoint", endpoint, "--seed", seed] for seed in ("0", "1")])  # fmt: skip
    for r in results:
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and len(lines) == 1, f"exit {r.returncode}\nstderr:\n{r.stderr}"
        assert "different --seed" in lines[0], lines[0]


# --- 2. the collective timeout -----------------------------------------------------------------------


def test_process_group_gets_the_collective_timeout(monkeypatch):
    seen = []
    monkeypatch.setattr(worker.dist, "init_process_group", lambda *a, **kw: seen.append(kw.get("timeout")))
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS", raising=False)
    monkeypatch.delenv(launch.COLLECTIVE_TIMEOUT_ENV, raising=False)
    worker._init_process_group("gloo")
    monkeypatch.setenv(launch.COLLECTIVE_TIMEOUT_ENV, "42")
    worker._init_process_group("gloo")
    assert seen == [datetime.timedelta(seconds=launch.DEFAULT_COLLECTIVE_TIMEOUT_S), datetime.timedelta(seconds=42)]


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf"])
def test_malformed_collective_timeout_is_one_line_before_anything_runs(value, monkeypatch, capfd):
    monkeypatch.setenv(launch.COLLECTIVE_TIMEOUT_ENV, value)
    with pytest.raises(PlanError, match=launch.COLLECTIVE_TIMEOUT_ENV):
        launch.collective_timeout_s({launch.COLLECTIVE_TIMEOUT_ENV: value})
    assert_bad_input(cli_main(capfd, "run", MLP, "--cluster", "2xCPU", "--steps", "1"), launch.COLLECTIVE_TIMEOUT_ENV)


# --- 3. links in the checkpoint directory --------------------------------------------------------------


def test_symlinked_temp_checkpoint_is_removed_not_its_target(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("x")
    root = tmp_path / "ckpt"
    root.mkdir()
    tmp = root / "step_2.tmp"
    tmp.symlink_to(elsewhere, target_is_directory=True)
    checkpoint._remove_entry(tmp)
    assert not tmp.exists() and not tmp.is_symlink()
    assert (elsewhere / "keep").read_text() == "x"


def test_checkpoint_dir_symlink_loop_is_one_line_before_planning(tmp_path, capfd):
    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(loop)
    result = cli_main(capfd, "run", MLP, "--cluster", "2xCPU", "--steps", "1", "--checkpoint-dir", loop)
    assert_bad_input(result, "--checkpoint-dir", "symlink loop")
    assert result[1] == ""


@pytest.mark.slow  # one torchrun job of 2 ranks: 10-20 s
def test_planted_tmp_link_is_not_written_through(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "step_1.tmp").symlink_to(elsewhere, target_is_directory=True)
    r = run_cli(tmp_path, "run", MLP, "--plan", str(PLAN[0]), "--steps", "1", "-q", "--checkpoint-dir", str(ckpt),
                "--master-port", str(free_port()))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert list(elsewhere.iterdir()) == [] and (ckpt / "step_1" / "COMPLETE").is_file()


# --- 4. the rendezvous host ----------------------------------------------------------------------------


def test_unresolvable_rendezvous_host_is_named():
    layout = Nodes(num_nodes=2, node_rank=0, nproc_per_node=None, rdzv_endpoint="no-such-host.invalid:29400",
                   rdzv_id="x")  # fmt: skip
    with pytest.raises(PlanError, match="rendezvous host 'no-such-host.invalid'"):
        layout.check_endpoint_resolves()
    Nodes(num_nodes=2, node_rank=0, nproc_per_node=None, rdzv_endpoint="127.0.0.1:29400",
          rdzv_id="x").check_endpoint_resolves()  # fmt: skip


def test_unresolvable_rendezvous_host_is_one_line_before_planning(no_launch_env, capfd):  # noqa: F811
    result = cli_main(capfd, "run", MLP, "--cluster", "2x2xCPU", "--nnodes", "2",
                      "--rdzv-endpoint", "no-such-host.invalid:29400")  # fmt: skip
    assert_bad_input(result, "no-such-host.invalid", "does not resolve")
    assert result[1] == ""


def test_a_node_that_never_joins_is_one_line_naming_the_endpoint_and_the_missing_node(monkeypatch, capfd):
    """Once: torchrun's 42-line RendezvousTimeoutError traceback after its 600 s join timeout.
    One node of ``--nnodes 2`` alone at the endpoint waits AUTOPLAN_JOIN_TIMEOUT_S, then one line."""
    monkeypatch.setenv(launch.JOIN_TIMEOUT_ENV, "10")
    endpoint = f"127.0.0.1:{free_port()}"
    result = cli_main(capfd, "run", MLP, "--plan", PLAN[0], "--nnodes", "2", "--nproc-per-node", "1",
                      "--rdzv-endpoint", endpoint, "--steps", "1", "-q")  # fmt: skip
    assert_bad_input(result, f"the rendezvous at {endpoint} (--rdzv-id autoplan) timed out after 10 s",
                     "1 of 2 nodes joined, 1 missing", f"--rdzv-endpoint {endpoint}", launch.JOIN_TIMEOUT_ENV)  # fmt: skip
    assert "Traceback" not in result[2] and "TCPStore" not in result[2], result[2]


def test_the_join_timeout_reaches_torchrun_and_a_malformed_one_is_named(capfd):
    layout = Nodes(num_nodes=2, node_rank=0, nproc_per_node=None, rdzv_endpoint="h:1", rdzv_id="x")
    assert layout.torchrun_args(nproc_per_node=1, master_port=None, join_timeout_s=30)[-2:] == [
        "--rdzv-conf", "join_timeout=30"]  # fmt: skip
    assert launch.join_timeout_s({}) == 600
    with pytest.raises(PlanError, match=rf"^{launch.JOIN_TIMEOUT_ENV}='soon' is not a number of seconds > 0"):
        launch.join_timeout_s({launch.JOIN_TIMEOUT_ENV: "soon"})


# --- 5. a port taken before torchrun binds it ---------------------------------------------------------


FAKE_TORCHRUN = """
import sys
if sys.argv[1] == sys.argv[2]:
    sys.stderr.write("Traceback (most recent call last):\\n  ...\\nDistNetworkError: port: " + sys.argv[1]
                     + ", code: -98, name: EADDRINUSE, message: address already in use\\n")
    sys.exit(1)
sys.stderr.write("ranks ran on " + sys.argv[1] + "\\n")
"""


def test_port_taken_before_torchrun_binds_it_is_replaced(capfd):
    ports = []

    def command(port: int) -> list[str]:
        ports.append(port)
        return [sys.executable, "-c", FAKE_TORCHRUN, str(port), "1"]

    rc = launch.call_torchrun(command(1), retry_port=(1, command))
    err = capfd.readouterr().err
    assert rc == 0 and ports[1:2] == [1] and len(ports) == 3 and ports[2] != 1
    assert "EADDRINUSE" not in err and f"ranks ran on {ports[2]}" in err


def test_port_always_taken_gives_up_and_shows_torchruns_error(capfd):
    rc = launch.call_torchrun(["x"], retry_port=(1, lambda port: [sys.executable, "-c", FAKE_TORCHRUN, "1", "1"]))
    assert rc == 1 and capfd.readouterr().err.count("EADDRINUSE") == 1


def test_other_failure_is_not_retried(capfd):
    calls = []

    def command(port: int) -> list[str]:
        calls.append(port)
        return [sys.executable, "-c", "import sys; sys.stderr.write('Traceback (most recent call last):\\nboom\\n'); "
                "sys.exit(3)"]  # fmt: skip

    assert launch.call_torchrun(["x"], retry_port=(1, command)) == 3
    assert calls == [1] and "boom" in capfd.readouterr().err


@pytest.mark.slow  # one torchrun job of 2 ranks after a refused one: 10-20 s
def test_run_retries_when_the_picked_port_is_taken(monkeypatch, capfd):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held_socket:
        held_socket.bind(("", 0))
        held_socket.listen()
        taken = held_socket.getsockname()[1]
        monkeypatch.setattr(run, "DEFAULT_MASTER_PORT", taken)
        monkeypatch.setattr(launch, "_is_free", lambda port: True)  # taken after the check
        rc, out, err = cli_main(capfd, "run", MLP, "--plan", PLAN[0], "--steps", "1", "-q")
    assert rc == 0 and "Traceback" not in err and "EADDRINUSE" not in err, err



def test_the_rendezvous_state_reader_builds_only_the_states_classes():
    """The join count unpickles torch's rendezvous state from the endpoint's store: only the
    classes that state is made of may be built (a hostile store cannot run code)."""
    import base64
    import io
    import pickle

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    state = _RendezvousState()
    state.participants[_NodeDesc("host", 1, 0)] = 0
    state.wait_list.add(_NodeDesc("other", 2, 0))
    raw = base64.b64encode(pickle.dumps(state))
    read = launch._RendezvousStateUnpickler(io.BytesIO(base64.b64decode(raw))).load()
    assert len(read.participants) + len(read.wait_list) == 2
    with pytest.raises(pickle.UnpicklingError, match="holds posix.system: not read"):
        launch._RendezvousStateUnpickler(io.BytesIO(b"cposix\nsystem\n(S'true'\ntR.")).load()
