"""Echoing user-provided text (file contents, names from a plan, command-line values) safely.

A plan or cluster file is data from anywhere: a hand-edited plan may name a parameter
``"\\x1b]0;pwned\\x07"`` or hold a 60 MB string where a placement belongs. Two rules keep such
values from doing harm when autoplan repeats them:

* :func:`clip` bounds what an error message quotes (``MAX_ECHO_CHARS``), so a message stays one
  readable line whatever the input;
* :func:`terminal_safe` writes C0/C1 control characters (ESC, CSI, BEL, ...; newline and tab
  excepted) and Unicode bidirectional overrides as visible ``\\x1b``/``\\u202e`` escapes, so text
  printed to a terminal cannot move the cursor, retitle the window or reorder what is shown.

``PlanError`` messages are clipped to ``MAX_MESSAGE_CHARS`` as a whole (``autoplan.cost_models.errors``).
"""

from __future__ import annotations

import re
import reprlib

MAX_ECHO_CHARS = 120
"""Characters of one user value an error message quotes; the rest is elided."""
MAX_MESSAGE_CHARS = 2000
"""Characters of one error message; the middle of a longer one is elided (its end, which says
what to do, is kept)."""

_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def terminal_safe(text: str) -> str:
    """``text`` with every control character but newline and tab (and every bidirectional
    override) replaced by its visible escape: ``"a\\x1b[2Jb"`` -> ``"a\\\\x1b[2Jb"``."""
    return _UNSAFE.sub(_escape, text)


class _BoundedRepr(reprlib.Repr):
    """``reprlib`` with autoplan's bounds; an integer of hundreds of digits is named by its size
    (Python refuses to print one of more than 4,300 digits, so ``reprlib`` alone would raise)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother, self.maxlong = 3, MAX_ECHO_CHARS, MAX_ECHO_CHARS, 40
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = self.maxdeque = 8

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 4 * self.maxlong:
            return f"<an integer of about {int(x.bit_length() * 0.30103):,} digits>"
        return super().repr_int(x, level)


_REPR = _BoundedRepr()


def clip(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """A ``repr`` of ``value`` of at most about ``limit`` characters, built without ever making
    the full one (``reprlib``: long strings, long lists, deep nesting and huge integers are elided)."""
    return clip_text(_REPR.repr(value), limit)


def clip_text(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """``text`` cut to ``limit`` characters with a note of how many were dropped."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...({len(text) - limit:,} more characters)"


def clip_message(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``message`` with its middle elided when longer than ``limit``: the head (what failed) and
    the tail (what to do) are kept."""
    if len(message) <= limit:
        return message
    head, tail = limit * 2 // 3, limit // 3
    return f"{message[:head]} ...({len(message) - head - tail:,} characters elided)... {message[-tail:]}"
