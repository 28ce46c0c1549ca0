"""Launching local ranks through torchrun (``autoplan run``, ``autoplan calibrate``): the port of
its rendezvous store and the wait for it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

from autoplan.cost_models.errors import PlanError


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


def call_torchrun(cmd: list[str], **kwargs: Any) -> int:
    """Run torchrun and return its exit code. Interrupted (Ctrl-C, SIGTERM), this process
    asks torchrun to stop its ranks (SIGTERM) and waits for it, rather than leaving them running."""
    with subprocess.Popen(cmd, **kwargs) as proc:
        try:
            return proc.wait()
        except BaseException:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
