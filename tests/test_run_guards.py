"""Careless and hostile input to ``autoplan run`` and ``autoplan plan`` (issue 17, section 3).

Each case ends with a typed error (exit code 2, one ``autoplan: error:`` line naming the problem
and the fix, no traceback) *before* any rank starts or any file is written:

* a build function that calls ``sys.exit()`` (even ``sys.exit(0)``) or raises ``SystemExit`` /
  ``KeyboardInterrupt`` is a failed build, never a successful exit;
* malformed numbers (``--seed 1e23``, ``--seed -1``, a seed beyond 2**63, ``--master-port 0``)
  are argument errors;
* a ``--master-port`` in use is named (without the option, a free port is picked);
* ``run --cluster C --global-batch-size N`` for a batch the workload does not have;
* ``--save-final`` into a missing directory, onto a directory, under a file, and
  ``--checkpoint-dir`` where nothing can be written;
* a profile database with an absurd time (1e300 s, a 400-digit integer) names the entry
  instead of the solver failing on it.

``autoplan plan`` interrupted by SIGINT or SIGTERM while its joint search runs forked workers
prints one line, exits 130 / 143 and leaves no worker behind.

Most run in process (``autoplan.tools.cli.main``); the interrupt tests start the CLI as a subprocess.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autoplan.cost_models.errors import ProfileError
from autoplan.cost_models.profile_db import MAX_OP_TIME_S, DeviceKey, ProfileDB
from autoplan.tools import launch, run
from autoplan.tools.loader import TargetError, build_workload
from tests.test_bad_inputs import assert_bad_input
from tests.test_bad_inputs import cli as cli_main

REPO_ROOT = Path(__file__).resolve().parent.parent
MLP = f"{Path(__file__).resolve().with_name('cli_models.py')}:mlp"

BAD_BUILDS = """
import sys


def exits():
    sys.exit(0)


def exits_with_code():
    raise SystemExit(3)


def interrupts():
    raise KeyboardInterrupt
"""


# --- build functions that exit --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("function", "said"),
    [
        ("exits", "it called sys.exit(0) (SystemExit)"),
        ("exits_with_code", "it called sys.exit(3) (SystemExit)"),
        ("interrupts", "KeyboardInterrupt"),
    ],
)
def test_build_function_that_exits_or_is_interrupted_is_a_failed_build(function, said, tmp_path):
    (tmp_path / "bad_builds.py").write_text(BAD_BUILDS)

    with pytest.raises(TargetError, match="failed while building the model") as info:
        build_workload(f"{tmp_path / 'bad_builds.py'}:{function}", device="meta")

    assert said in str(info.value) and "fix the build function" in str(info.value)


def test_plan_of_a_build_function_calling_sys_exit_0_exits_2_and_writes_nothing(tmp_path, capfd):
    (tmp_path / "bad_builds.py").write_text(BAD_BUILDS)
    out = tmp_path / "plan.json"

    result = cli_main(capfd, "plan", f"{tmp_path / 'bad_builds.py'}:exits", "--cluster", "2xCPU", "--out", out)

    assert_bad_input(result, "bad_builds.py:exits failed while building the model", "sys.exit(0)")
    assert not out.exists()


def test_module_calling_sys_exit_at_import_is_a_failed_import(tmp_path):
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(0)\n")

    with pytest.raises(TargetError, match=r"cannot import .*it called sys.exit\(0\)"):
        build_workload(f"{tmp_path / 'exits_on_import.py'}:build", device="meta")


# --- malformed numbers ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", ["1e23", "1.5", "nan", "-1", str(2**63), "9" * 5000])
def test_malformed_seed_is_an_argument_error(seed, tmp_path, capfd):
    result = cli_main(capfd, "plan", MLP, "--cluster", "2xCPU", "--out", tmp_path / "p.json", "--seed", seed)

    line = assert_bad_input(result, "argument --seed", "an integer seed in 0..2**63-1")
    assert len(line) < 300  # a 5,000-digit value is not echoed whole
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("command", ["profile", "export-onnx"])
def test_every_command_taking_a_seed_checks_it(command, tmp_path, capfd):
    args = [MLP, "--cluster", "2xCPU"] if command == "profile" else ["unused.json", "-o", tmp_path / "m.onnx"]
    result = cli_main(capfd, command, *args, "--seed", "1e23")

    assert_bad_input(result, "argument --seed", "an integer seed in 0..2**63-1")


@pytest.mark.parametrize("port", ["0", "70000", "-5", "http"])
def test_malformed_master_port_is_an_argument_error(port, capfd):
    result = cli_main(capfd, "run", MLP, "--plan", "unused.json", "--master-port", port)

    assert_bad_input(result, "argument --master-port", "a TCP port in 1..65535")


# --- the launch: port, batch, output paths --------------------------------------------------------


@pytest.fixture()
def listening_port():
    """A port on which this process listens (as another job's torchrun store would)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_busy_master_port_is_named_before_any_rank_starts(listening_port, tmp_path, capfd):
    result = cli_main(capfd, "run", MLP, "--cluster", "2xCPU", "--steps", "1", "--master-port", listening_port)

    assert_bad_input(result, f"--master-port {listening_port} is in use", "give a free port")
    assert result[1] == ""  # nothing planned, no rank started


def test_busy_master_port_of_calibrate_is_named_before_any_rank_starts(listening_port, tmp_path, capfd):
    result = cli_main(
        capfd, "calibrate", "--cluster", "2xCPU", "--out", tmp_path / "c.yaml", "--master-port", listening_port
    )

    assert_bad_input(result, f"--master-port {listening_port} is in use", "give a free port")
    assert not (tmp_path / "c.yaml").exists()


def test_busy_default_master_port_is_replaced_by_a_free_one():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        try:
            held.bind(("", run.DEFAULT_MASTER_PORT))
            held.listen()
        except OSError:
            pass  # something else holds it already: busy either way
        port = launch.master_port(None, default=run.DEFAULT_MASTER_PORT)

        assert port != run.DEFAULT_MASTER_PORT
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", port))  # free


def test_run_with_a_global_batch_the_workload_does_not_have_is_refused_before_planning(capfd):
    result = cli_main(
        capfd, "run", MLP, "--cluster", "2xCPU", "--global-batch-size", "3", "--steps", "1", "--no-profile"
    )

    assert_bad_input(result, "--global-batch-size 3 does not match the 8 samples", "give --global-batch-size 8")
    assert result[1] == ""


@pytest.mark.parametrize(
    ("option", "where", "said"),
    [
        ("--save-final", "missing/final.pt", "directory {tmp}/missing does not exist: create it first"),
        ("--save-final", ".", "is a directory: give a file name"),
        ("--save-final", "a_file/final.pt", "{tmp}/a_file is not a directory"),
        ("--checkpoint-dir", "a_file/ckpt", "{tmp}/a_file is not a directory"),
        ("--checkpoint-dir", "a_file", "is a file: give a directory"),
    ],
)
def test_unusable_output_path_of_run_is_refused_before_any_rank_starts(option, where, said, tmp_path, capfd):
    (tmp_path / "a_file").write_text("keep me\n")
    before = sorted(p.name for p in tmp_path.iterdir())

    result = cli_main(capfd, "run", MLP, "--cluster", "2xCPU", "--steps", "1", option, tmp_path / where)

    assert_bad_input(result, option, said.format(tmp=tmp_path))
    assert result[1] == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing made, nothing left
    assert (tmp_path / "a_file").read_text() == "keep me\n"


@pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0,
    reason="root writes into a 0o555 directory: permission bits cannot make one unwritable for root "
    "(the probe-write behind this check is exercised by the cases above)",
)
@pytest.mark.parametrize("option", ["--checkpoint-dir", "--save-final"])
def test_output_path_in_a_read_only_directory_is_refused(option, tmp_path, capfd):
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        result = cli_main(capfd, "run", MLP, "--cluster", "2xCPU", "--steps", "1", option, read_only / "out")
    finally:
        read_only.chmod(0o755)

    assert_bad_input(result, option, "cannot be written", "Permission denied", "give a writable location")
    assert list(read_only.iterdir()) == []


# --- profile database with an absurd time ----------------------------------------------------------


@pytest.mark.parametrize(
    ("time_s", "shown"),
    [("1e300", "1e+300 s"), (str(10**400), "an integer of 1329 bits"), ("-0.5", "-0.5 s"), ("1e999", "inf s")],
)
def test_profile_database_with_an_absurd_time_names_the_entry(time_s, shown, tmp_path, capfd):
    db = ProfileDB(tmp_path / "db.json", DeviceKey.current("cpu"), {"aten.mm.default(f32[8,16], f32[16,32])": 4e-6})
    db.save()
    text = (tmp_path / "db.json").read_text().replace("4e-06", time_s)
    (tmp_path / "db.json").write_text(text)

    with pytest.raises(ProfileError, match="has an absurd time") as info:
        ProfileDB.load(tmp_path / "db.json")
    result = cli_main(
        capfd, "plan", MLP, "--cluster", "2xCPU", "--profile-db", tmp_path / "db.json", "--out", tmp_path / "p.json"
    )

    for message in (str(info.value), result[2]):
        assert f"absurd time, {shown}, for 'aten.mm.default(f32[8,16], f32[16,32])'" in message
        assert f"expected finite seconds in 0..{MAX_OP_TIME_S:g}" in message
    assert_bad_input(result, "delete the file and re-profile")
    assert "solver" not in result[2]
    assert not (tmp_path / "p.json").exists()


def test_profile_database_times_up_to_an_hour_are_accepted(tmp_path):
    db = ProfileDB(tmp_path / "db.json", DeviceKey.current("cpu"), {"k": MAX_OP_TIME_S})
    db.save()

    assert ProfileDB.load(tmp_path / "db.json").lookup("k") == MAX_OP_TIME_S


# --- SIGINT / SIGTERM of a joint search with forked workers ---------------------------------------


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "zombie" not in status


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the worker processes in /proc (Linux)")
@pytest.mark.parametrize(
    ("signum", "to_group"),
    [(signal.SIGINT, True), (signal.SIGTERM, False), (signal.SIGTERM, True)],
    ids=["ctrl-c", "kill-planner", "kill-process-group"],  # a terminal's Ctrl-C reaches the whole job
)
def test_interrupted_joint_search_prints_one_line_and_leaves_no_worker(signum, to_group, tmp_path):
    pytest.importorskip("transformers")
    code, line = (130, "interrupted") if signum == signal.SIGINT else (143, "terminated")
    env = dict(os.environ, AUTOPLAN_WORKERS="2", AUTOPLAN_NO_PLAN_CACHE="1", TRANSFORMERS_VERBOSITY="error")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen(
        [sys.executable, "-m", "autoplan.tools.cli", "plan", f"{REPO_ROOT / 'examples' / 'hf_models.py'}:gpt2_tiny",
         "--cluster", "2x8xH100", "--global-batch-size", "64", "--out", str(tmp_path / "plan.json"), "-q"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not _children(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = _children(proc.pid)
        assert workers, f"no worker was forked (exit code {proc.poll()})"
        time.sleep(0.5)  # the workers are solving
        if to_group:  # as a terminal's Ctrl-C, or `kill -- -PGID`, reaches every process of the job
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()

    assert proc.returncode == code, err
    assert err.splitlines() == [f"autoplan: {line}"]
    assert out == "" and not (tmp_path / "plan.json").exists()
    time.sleep(0.5)
    assert [pid for pid in workers if _alive(pid)] == []
