"""Run a function on N local CPU ranks joined by a gloo process group.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes, each of which joins a gloo
group on a fresh localhost TCP port, calls ``fn(rank, world_size, *args)``, destroys the group
and sends the return value back. The test gets the per-rank return values in rank order, or a
failure carrying every failing rank's traceback text.

``fn`` must be a module-level function (it is pickled by reference into the spawned workers).
Return small picklable values (floats, dicts, tensors are fine: they travel as pickled bytes).
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankFailure", "free_port", "run_ranks"]


class RankFailure(AssertionError):
    """One or more ranks raised, crashed or timed out; the message holds their tracebacks."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle (not torch's shared-memory reductions): the bytes outlive this process.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the test with its traceback
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; return the
    per-rank results in rank order. Raises :class:`RankFailure` with each failing rank's
    traceback if any rank raises, exits without a result, or the whole run exceeds ``timeout_s``.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, timeout_s, fn, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()

    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    dead_since: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) + len(errors) < world_size:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                rank, status, payload = results.get(timeout=min(0.5, deadline - now))
            except queue.Empty:
                # A worker that exited without reporting crashed; allow its message 2 s to arrive.
                for r, p in enumerate(procs):
                    if r not in values and r not in errors and p.exitcode is not None:
                        if now - dead_since.setdefault(r, now) > 2.0:
                            errors[r] = f"rank {r} exited with code {p.exitcode} without a result"
                            deadline = min(deadline, now + 5.0)
                continue
            if status == "ok":
                values[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                # The other ranks may be blocked in a collective with this one: give them a short
                # grace period to report their own errors, then stop them.
                deadline = min(deadline, time.monotonic() + 5.0)
        for r in range(world_size):
            if r not in values and r not in errors:
                errors[r] = (
                    f"rank {r} gave no result within the time limit ({timeout_s:.0f} s, or 5 s after another rank failed)"
                )
    finally:
        for p in procs:
            p.join(timeout=0.5 if errors else 10.0)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
        results.close()

    if errors:
        text = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
        raise RankFailure(f"{len(errors)} of {world_size} ranks failed:\n{text}")
    return [values[r] for r in range(world_size)]
