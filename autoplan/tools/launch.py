"""Launching local ranks through torchrun (``autoplan run``, ``autoplan calibrate``): the port of
its rendezvous store, the wait for it and the timeout of the ranks' collectives.

The port autoplan picks itself (no ``--master-port``) is free when checked but may be taken by
another job before torchrun binds it (``EADDRINUSE`` in torchrun's agent, before any rank
starts): :func:`call_torchrun` with ``retry_port`` then starts torchrun again on a fresh port, up
to :data:`PORT_ATTEMPTS` times, and drops the failed attempt's traceback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from autoplan.cost_models.errors import PlanError

COLLECTIVE_TIMEOUT_ENV = "AUTOPLAN_COLLECTIVE_TIMEOUT_S"
"""Seconds a rank waits in one collective (``init_process_group(timeout=...)``) before failing."""
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
"""5 minutes: far above a step of the workloads autoplan runs, far below gloo's 30-minute
default, so nodes that disagree (a rank stopped waiting for its peers) fail within minutes."""
PORT_ATTEMPTS = 3
"""torchrun starts on ports autoplan picked, at most, when each is taken before torchrun binds it."""
PORT_IN_USE = b"EADDRINUSE"
"""What torchrun's agent prints when its store cannot bind the port."""


def collective_timeout_s(env: Mapping[str, str]) -> float:
    """The ranks' collective timeout: ``AUTOPLAN_COLLECTIVE_TIMEOUT_S`` (seconds > 0), else
    :data:`DEFAULT_COLLECTIVE_TIMEOUT_S`; PlanError naming the variable when malformed."""
    text = env.get(COLLECTIVE_TIMEOUT_ENV)
    if text is None or not text.strip():
        return DEFAULT_COLLECTIVE_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise PlanError(
            f"{COLLECTIVE_TIMEOUT_ENV}={text[:40]!r} is not a number of seconds > 0: fix it or unset it "
            f"(default {DEFAULT_COLLECTIVE_TIMEOUT_S:g})"
        )
    return value


def _is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torchrun's store binds it
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A port on 127.0.0.1 that the OS reports free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def master_port(requested: int | None, *, default: int | None = None) -> int:
    """The torchrun port: ``requested`` if free (PlanError naming it if not), else ``default``
    if given and free, else one the OS picks."""
    if requested is not None:
        if not _is_free(requested):
            raise PlanError(
                f"--master-port {requested} is in use (another run or program listens on it): "
                "give a free port, or drop --master-port to pick one"
            )
        return requested
    if default is not None and _is_free(default):
        return default
    return free_port()


def rank_environment(*, verbose: bool) -> dict[str, str]:
    """This process's environment for the ranks: one thread per CPU rank, torch's C++ and
    torchrun's logging quiet (unless ``verbose``) and the folder holding this autoplan package
    first on ``PYTHONPATH``, so the ranks import the same autoplan as the command."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if not verbose:
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        env.setdefault("LOGLEVEL", "ERROR")
    root = str(Path(__file__).resolve().parents[2])  # autoplan/tools/launch.py -> the folder holding autoplan
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def call_torchrun(
    cmd: list[str], *, retry_port: tuple[int, Callable[[int], list[str]]] | None = None, **kwargs: Any
) -> int:
    """Run torchrun and return its exit code. Interrupted (Ctrl-C, SIGTERM), this process
    asks torchrun to stop its ranks (SIGTERM) and waits for it, rather than leaving them running.
    ``retry_port`` (the port autoplan picked, and the command for another port): a port taken
    before torchrun bound it is replaced by a fresh one (module docstring)."""
    if retry_port is None:
        return _wait_torchrun(cmd, **kwargs)
    port, command_for = retry_port
    for attempt in range(1, PORT_ATTEMPTS + 1):
        rc, port_taken = _torchrun_watching_port(command_for(port), last=attempt == PORT_ATTEMPTS, **kwargs)
        if not port_taken or attempt == PORT_ATTEMPTS:
            return rc
        port = free_port()
    raise AssertionError("unreachable")


def _wait_torchrun(cmd: list[str], **kwargs: Any) -> int:
    with subprocess.Popen(cmd, **kwargs) as proc:
        return _wait(proc)


def _wait(proc: subprocess.Popen[bytes]) -> int:
    try:
        return proc.wait()
    except BaseException:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise


def _torchrun_watching_port(cmd: list[str], *, last: bool, **kwargs: Any) -> tuple[int, bool]:
    """torchrun with its stderr forwarded to ours; ``(exit code, whether its store found the
    port taken)``. Output that starts with a traceback (the agent's bind failure comes before any
    rank's line) is held until torchrun exits, then dropped if it was the port, unless ``last``."""
    with subprocess.Popen(cmd, stderr=subprocess.PIPE, **kwargs) as proc:
        assert proc.stderr is not None
        watch = _StderrWatch(proc.stderr)
        reader = threading.Thread(target=watch.forward, daemon=True)
        reader.start()
        rc = _wait(proc)
        reader.join(timeout=10)  # a left-over grandchild may hold the pipe: do not wait on it
        taken = rc != 0 and PORT_IN_USE in watch.held
        if watch.held and (last or not taken):
            _write_stderr(watch.held)
        return rc, taken


class _StderrWatch:
    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.held = bytearray()
        """Output held back: it started with a traceback (maybe the agent's bind failure)."""

    def forward(self) -> None:
        first = self.stream.readline()
        hold = first.startswith(b"Traceback")
        if hold:
            self.held += first
        else:
            _write_stderr(first)
        while chunk := self.stream.read1(65536):  # type: ignore[attr-defined]  # a BufferedReader
            if hold:
                self.held += chunk
            else:
                _write_stderr(chunk)


def _write_stderr(data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(2, view) :]
