"""One status line for long planning steps (tracing, costing, solving) on an interactive terminal.

Library code reports with :func:`step`; nothing is printed unless a caller turned reporting on
with :func:`reporting` (the CLI does, unless ``--quiet``) *and* the stream is a terminal, so
logs, CI output and piped ``--json`` never see it. The switch is a context variable restored on
exit (no global state outlives the ``with`` block)::

    with progress.reporting():
        plan = autoplan.plan(...)      # "autoplan: solving the ILP (197,257 variables) ... 3.2 s"
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TextIO


@dataclass(slots=True)
class _Status:
    stream: TextIO
    t0_s: float = field(default_factory=time.monotonic)
    shown: bool = False

    def show(self, label: str) -> None:
        elapsed = time.monotonic() - self.t0_s
        # \r + erase-line: the status replaces itself instead of scrolling
        self.stream.write(f"\r\033[Kautoplan: {label} ... {elapsed:.1f} s")
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()


_current: ContextVar[_Status | None] = ContextVar("autoplan_progress", default=None)


@contextlib.contextmanager
def reporting(enabled: bool = True, stream: TextIO | None = None) -> Iterator[None]:
    """Show :func:`step` labels on ``stream`` (stderr) while inside, if it is a terminal."""
    out = stream if stream is not None else sys.stderr
    status = _Status(out) if enabled and out.isatty() else None
    token = _current.set(status)
    try:
        yield
    finally:
        _current.reset(token)
        if status is not None:
            status.clear()


def step(label: str) -> None:
    """Report the step now running (no-op unless :func:`reporting` is on and on a terminal)."""
    status = _current.get()
    if status is not None:
        status.show(label)
