"""The command line's stdout belongs to autoplan alone.

``autoplan plan --json`` and ``autoplan estimate --json`` write JSON to stdout that scripts parse,
so nothing a third-party library prints may land there: not a C++ banner (highspy >= 1.12 prints
one to file descriptor 1 when a solver is constructed), not a Python ``print`` inside a
dependency, not a child process's chatter. :func:`owned_stdout` sets that up for the duration of
one command:

* file descriptor 1 and ``sys.stdout`` point at stderr, so whatever anyone else writes to
  "stdout" is shown on stderr;
* :func:`stdout` returns a handle on the original stdout, and autoplan's own output (plans,
  tables, JSON, the ranks' loss lines) is written there explicitly.

Outside :func:`owned_stdout` (the Python API), :func:`stdout` is ``sys.stdout``.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from typing import TextIO

_owned: list[TextIO] = []
"""The stack of handles on the original stdout, one per active :func:`owned_stdout` (a scoped
switch: pushed on entry, popped in ``finally``)."""


def stdout() -> TextIO:
    """Where autoplan's own command output goes (the original stdout inside :func:`owned_stdout`)."""
    return _owned[-1] if _owned else sys.stdout


def _fileno(stream: TextIO) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None  # e.g. pytest's capsys, or a StringIO


@contextlib.contextmanager
def owned_stdout() -> Iterator[TextIO]:
    """Route everyone's stdout to stderr and yield a handle on the original stdout for ours."""
    real_out, real_err = sys.stdout, sys.stderr
    out_fd, err_fd = _fileno(real_out), _fileno(real_err)
    real_out.flush()
    saved_fd: int | None = None
    ours: TextIO = real_out
    if out_fd is not None and err_fd is not None:
        saved_fd = os.dup(out_fd)
        ours = os.fdopen(os.dup(saved_fd), "w", encoding=getattr(real_out, "encoding", None) or "utf-8",
                         errors="backslashreplace", buffering=1)  # fmt: skip
        os.dup2(err_fd, out_fd)
    _owned.append(ours)
    sys.stdout = real_err
    try:
        yield ours
    finally:
        sys.stdout = real_out
        _owned.pop()
        ours.flush()
        if saved_fd is not None:
            ours.close()
            os.dup2(saved_fd, out_fd)
            os.close(saved_fd)


def subprocess_stdout() -> int | None:
    """The ``stdout=`` for a child process whose output is ours (the ranks' loss lines): the
    original stdout's file descriptor, or ``None`` (inherit) when it has none."""
    out = stdout()
    out.flush()
    return _fileno(out)
