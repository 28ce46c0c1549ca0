"""Launching local ranks through torchrun (``autoplan run``, ``autoplan calibrate``): the port of
its rendezvous store, the wait for it and the timeout of the ranks' collectives.

The port autoplan picks itself (no ``--master-port``) is free when checked but may be taken by
another job before torchrun binds it (``EADDRINUSE`` in torchrun's agent, before any rank
starts): :func:`call_torchrun` with ``retry_port`` then starts torchrun again on a fresh port, up
to :data:`PORT_ATTEMPTS` times, and drops the failed attempt's traceback."""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from autoplan.cost_models.errors import PlanError

COLLECTIVE_TIMEOUT_ENV = "AUTOPLAN_COLLECTIVE_TIMEOUT_S"
"""Seconds a rank waits in one collective (``init_process_group(timeout=...)``) before failing."""
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
"""5 minutes: far above a step of the workloads autoplan runs, far below gloo's 30-minute
default, so nodes that disagree (a rank stopped waiting for its peers) fail within minutes."""
JOIN_TIMEOUT_ENV = "AUTOPLAN_JOIN_TIMEOUT_S"
"""Seconds the nodes of a several-node run wait for each other at the rendezvous (torchrun's
``--rdzv-conf join_timeout=``) before the run stops with one line naming the missing nodes."""
DEFAULT_JOIN_TIMEOUT_S = 600.0
"""torchrun's own default ``join_timeout`` (``torch/distributed/elastic/rendezvous/dynamic_rendezvous.py``)."""
RENDEZVOUS_TIMED_OUT = b"RendezvousTimeoutError"
"""What torchrun's agent raises when the nodes did not all join within the join timeout."""
JOIN_POLL_S = 2.0
"""How often a waiting node reads how many nodes have joined (the rendezvous state in its store)."""
PORT_ATTEMPTS = 3
"""torchrun starts on ports autoplan picked, at most, when each is taken before torchrun binds it."""
PORT_IN_USE = b"EADDRINUSE"
"""What torchrun's agent prints when its store cannot bind the port."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Rendezvous:
    """Where the torchrun agents of a several-node run meet, and how long they wait for each other."""

    endpoint: str
    """``HOST:PORT`` of the c10d rendezvous store (served by the agent on that host)."""
    run_id: str
    num_nodes: int
    join_timeout_s: float


def collective_timeout_s(env: Mapping[str, str]) -> float:
    """The ranks' collective timeout: ``AUTOPLAN_COLLECTIVE_TIMEOUT_S`` (seconds > 0), else
    :data:`DEFAULT_COLLECTIVE_TIMEOUT_S`; PlanError naming the variable when malformed."""
    return _seconds(env, COLLECTIVE_TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT_S)


def join_timeout_s(env: Mapping[str, str]) -> float:
    """The nodes' rendezvous wait: ``AUTOPLAN_JOIN_TIMEOUT_S`` (seconds > 0), else
    :data:`DEFAULT_JOIN_TIMEOUT_S`; PlanError naming the variable when malformed."""
    return _seconds(env, JOIN_TIMEOUT_ENV, DEFAULT_JOIN_TIMEOUT_S)


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    text = env.get(name)
    if text is None or not text.strip():
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise PlanError(f"{name}={text[:40]!r} is not a number of seconds > 0: fix it or unset it (default {default:g})")
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
    cmd: list[str],
    *,
    retry_port: tuple[int, Callable[[int], list[str]]] | None = None,
    rendezvous: Rendezvous | None = None,
    **kwargs: Any,
) -> int:
    """Run torchrun and return its exit code. Interrupted (Ctrl-C, SIGTERM), this process
    asks torchrun to stop its ranks (SIGTERM) and waits for it, rather than leaving them running.
    ``retry_port`` (the port autoplan picked, and the command for another port): a port taken
    before torchrun bound it is replaced by a fresh one (module docstring). ``rendezvous`` (a
    several-node run): nodes that did not all join within its timeout are a PlanError naming the
    endpoint and how many nodes joined, instead of the agent's traceback."""
    if rendezvous is not None:
        return _torchrun_meeting(cmd, rendezvous, **kwargs)
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
    rc, held = _torchrun_holding_traceback(cmd, **kwargs)
    taken = rc != 0 and PORT_IN_USE in held
    if held and (last or not taken):
        _write_stderr(held)
    return rc, taken


def _torchrun_meeting(cmd: list[str], rendezvous: Rendezvous, **kwargs: Any) -> int:
    """torchrun of one node of several, its stderr forwarded as :func:`_torchrun_watching_port`
    does, while a thread counts the nodes that have joined the rendezvous; PlanError when the
    agent gave up waiting for the others (its traceback dropped)."""
    joined = _JoinCount(rendezvous)
    rc, held = _torchrun_holding_traceback(cmd, beside=joined.poll, **kwargs)
    joined.stop()
    if rc != 0 and RENDEZVOUS_TIMED_OUT in held:
        seen = (
            f"{joined.most} of {rendezvous.num_nodes} nodes joined, {rendezvous.num_nodes - joined.most} missing"
            if 0 < joined.most < rendezvous.num_nodes
            else f"the {rendezvous.num_nodes} nodes did not all join"
        )
        raise PlanError(
            f"the rendezvous at {rendezvous.endpoint} (--rdzv-id {rendezvous.run_id}) timed out after "
            f"{rendezvous.join_timeout_s:g} s: {seen}. Start the same autoplan run (--nnodes "
            f"{rendezvous.num_nodes}, --rdzv-endpoint {rendezvous.endpoint}, --rdzv-id {rendezvous.run_id}) on every "
            f"node, or give them longer with {JOIN_TIMEOUT_ENV}"
        )
    if held:
        _write_stderr(held)
    return rc


def _torchrun_holding_traceback(
    cmd: list[str], *, beside: Callable[[subprocess.Popen[bytes]], None] | None = None, **kwargs: Any
) -> tuple[int, bytearray]:
    """Run torchrun, forwarding its stderr unless it starts with a traceback (then held and
    returned: the agent's own failures come before any rank's line), with ``beside(proc)`` on a
    thread while it runs; ``(exit code, held output)``."""
    with subprocess.Popen(cmd, stderr=subprocess.PIPE, **kwargs) as proc:
        assert proc.stderr is not None
        watch = _StderrWatch(proc.stderr)
        reader = threading.Thread(target=watch.forward, daemon=True)
        reader.start()
        if beside is not None:
            threading.Thread(target=beside, args=(proc,), daemon=True).start()
        rc = _wait(proc)
        reader.join(timeout=10)  # a left-over grandchild may hold the pipe: do not wait on it
        return rc, watch.held


class _JoinCount:
    """The most nodes seen in the rendezvous at once, read by a child process
    (:func:`_print_joined`) with torch's C++ logging off,
    since a store client whose server goes away logs C++ tracebacks. ``most`` stays 0 when the
    count cannot be read."""

    def __init__(self, rendezvous: Rendezvous) -> None:
        self.rendezvous = rendezvous
        self.most = 0
        self._child: subprocess.Popen[bytes] | None = None

    def stop(self) -> None:
        if self._child is not None:
            self._child.kill()

    def poll(self, proc: subprocess.Popen[bytes]) -> None:
        host, _, port = self.rendezvous.endpoint.rpartition(":")
        key = "torch.rendezvous." + self.rendezvous.run_id
        child_main = f"import sys; from {__name__} import _print_joined; _print_joined(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])"
        cmd = [sys.executable, "-c", child_main, host.strip("[]"), port, key, str(self.rendezvous.num_nodes)]
        env = {**rank_environment(verbose=False), "TORCH_CPP_LOG_LEVEL": "FATAL"}
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env) as child:
            self._child = child
            assert child.stdout is not None
            try:
                for line in child.stdout:
                    if line.strip().isdigit():
                        self.most = max(self.most, int(line))
                    if proc.poll() is not None:
                        break
            finally:
                child.kill()


def _print_joined(host: str, port: int, key: str, nodes: str) -> None:
    """Print the nodes in the rendezvous whenever the count grows, until all ``num_nodes`` are in
    or the parent is gone. torch's c10d rendezvous keeps its state (``_RendezvousState``:
    ``participants``, ``wait_list``) pickled and base64-encoded under ``torch.rendezvous.<run
    id>`` in the endpoint's store (``c10d_rendezvous_backend.py``), as every agent reads it."""
    import base64
    import datetime
    import io

    import torch.distributed as dist

    num_nodes, parent, store, most = int(nodes), os.getppid(), None, 0
    while os.getppid() == parent and most < num_nodes:
        try:
            if store is None:
                with socket.create_connection((host, port), timeout=1.0):
                    pass  # a client connecting to nothing retries for its whole timeout
                store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=2),
                                      wait_for_workers=False)  # fmt: skip
            if store.check([key]):
                state = _RendezvousStateUnpickler(io.BytesIO(base64.b64decode(store.get(key)))).load()
                count = len(state.participants) + len(state.wait_list)
                if count > most:
                    most = count
                    print(count, flush=True)
        except Exception:  # noqa: BLE001  # not up yet, or gone: try again (the parent ends this process)
            store = None
        time.sleep(JOIN_POLL_S)


class _RendezvousStateUnpickler(pickle.Unpickler):
    """Reads torch's pickled rendezvous state and nothing else: only the classes that state is
    made of may be built (the "restricting globals" recipe of the ``pickle`` docs); any other
    global is an ``UnpicklingError``, so a hostile store cannot run code here."""

    ALLOWED = frozenset({
        ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState"),
        ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc"),
        ("datetime", "datetime"), ("datetime", "timezone"), ("datetime", "timedelta"),
        ("builtins", "set"), ("builtins", "dict"),
    })  # fmt: skip

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"the rendezvous state holds {module}.{name}: not read")
        return super().find_class(module, name)


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
