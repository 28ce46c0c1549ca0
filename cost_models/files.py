"""Reading input files within bounds and writing output files so that a failure never leaves a
half-written, missing or clobbered file.

Writing: every file autoplan writes (plan, report, ONNX model, bench results, profile database,
cluster profile) goes through :func:`atomic_write`: a temporary file in the same directory,
flushed to disk and renamed over the target only once it is complete. The new file keeps the
permission bits of the file it replaces; a symbolic link is kept and its target replaced; a
device or FIFO (``--out /dev/null``) is written into, never replaced. A file that cannot be
written is a :class:`~autoplan.cost_models.errors.PlanFileError` (or the error type the caller names) with
one line naming the file and what to do; ``error=None`` lets the ``OSError`` through. A command
first calls :func:`refuse_overwriting_inputs`, so ``--out`` never names one of its own inputs.

Reading: plan, cluster, suite and results files are data from anywhere, so they are read within
bounds: :func:`read_limited` reads at most ``max_bytes`` (``/dev/zero`` or a 10 GB file is
refused after ``max_bytes + 1`` bytes, and a FIFO without a writer reads as empty instead of
blocking), :func:`parse_json` turns Python's ``RecursionError`` (deep nesting) and its refusal of
integers of more than 4,300 digits into :class:`InputLimitError`, and :func:`parse_yaml` is
``yaml.safe_load`` that refuses a document expanding to more than ``MAX_YAML_NODES`` values (a
"billion laughs" alias bomb) or nesting more than ``MAX_NESTING`` levels.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autoplan.cost_models.echo import clip
from autoplan.cost_models.errors import PlanError, PlanFileError

MiB = 1024**2
MAX_PLAN_FILE_BYTES = 64 * MiB
"""Largest plan (or bench results) file read: a 96-layer model planned at full depth writes about
10 MB."""
MAX_CLUSTER_FILE_BYTES = 1 * MiB
"""Largest cluster (or bench suite) file read: a calibrated cluster profile is about 2 KB."""
MAX_YAML_NODES = 100_000
"""Values (scalars, lists, mappings) of a YAML file once its aliases are expanded; a cluster file
has about 60."""
MAX_NESTING = 100
"""Nesting levels of a YAML file (a cluster file nests 4)."""


class InputLimitError(ValueError):
    """An input file exceeds a bound (size, nesting, aliases, digits); the message says which.
    Callers turn it into their typed error with the file named."""


def read_limited(path: str | os.PathLike[str], *, max_bytes: int) -> bytes:
    """The bytes of ``path``, at most ``max_bytes`` of them (:class:`InputLimitError` beyond).
    ``OSError`` (missing file, directory, no permission) is let through for the caller to word."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO without a writer must not block the open
    try:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        os.set_blocking(fd, True)
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, min(max_bytes + 1 - size, 1 * MiB))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > max_bytes:
        raise InputLimitError(f"is larger than the {max_bytes / MiB:g} MiB autoplan reads")
    return b"".join(chunks)


def parse_json(text: str | bytes) -> Any:
    """``json.loads`` whose limits raise :class:`InputLimitError`; a syntax error is still
    ``json.JSONDecodeError``."""
    try:
        return json.loads(text)
    except RecursionError:
        raise InputLimitError(f"nests too deeply to read (more than about {sys.getrecursionlimit()} levels)") from None
    except json.JSONDecodeError:
        raise
    except ValueError:  # "Exceeds the limit (4300 digits) for integer string conversion"
        raise InputLimitError(f"holds an integer of more than {sys.get_int_max_str_digits():,} digits") from None


def parse_yaml(text: str | bytes) -> Any:
    """``yaml.safe_load`` refusing a document of more than ``MAX_YAML_NODES`` values once its
    aliases are expanded, or of more than ``MAX_NESTING`` levels (:class:`InputLimitError`); a
    syntax error is still ``yaml.YAMLError``.

    Counting aliases is not enough: the classic "billion laughs" uses 72. Each composed node's
    expanded size (1 + its children's, an alias counting as the node it names) is summed as the
    document is composed, so a bomb is refused after a few thousand nodes, before anything walks
    the expanded structure."""
    import yaml

    class BoundedLoader(yaml.SafeLoader):
        def __init__(self, stream: str | bytes) -> None:
            super().__init__(stream)
            self.depth = 0
            self.sizes: dict[int, int] = {}

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                return super().compose_node(parent, index)  # sized when it was composed
            self.depth += 1
            if self.depth > MAX_NESTING:
                raise InputLimitError(f"nests deeper than {MAX_NESTING} levels")
            try:
                node = super().compose_node(parent, index)
            finally:
                self.depth -= 1
            if isinstance(node, yaml.SequenceNode):
                children = node.value
            elif isinstance(node, yaml.MappingNode):
                children = [n for pair in node.value for n in pair]
            else:
                children = []
            size = 1 + sum(self.sizes.get(id(c), 1) for c in children)
            if size > MAX_YAML_NODES:
                raise InputLimitError(
                    f"expands to more than {MAX_YAML_NODES:,} values (YAML aliases *name repeat what they name)"
                )
            self.sizes[id(node)] = size
            return node

    loader = BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def refuse_overwriting_inputs(
    out: str | os.PathLike[str],
    inputs: Mapping[str, str | os.PathLike[str] | None],
    *,
    option: str = "--out",
    error: type[PlanError] = PlanFileError,
) -> None:
    """Raise ``error`` when ``out`` is the same file as one of ``inputs`` (label -> path; ``None``
    skipped): the same path, a symbolic link to it or a hard link of it. Called before a command
    does any work, so ``autoplan plan model.py:build --out model.py`` destroys nothing."""
    try:
        out_stat = os.stat(out)
    except (OSError, ValueError):
        return  # nothing there (or no usable path): writing it cannot overwrite an input
    for label, path in inputs.items():
        if path is None:
            continue
        try:
            in_stat = os.stat(path)
        except (OSError, ValueError):
            continue
        if os.path.samestat(out_stat, in_stat):
            raise error(
                f"{option} {clip(str(out))} is the same file as the {label} {clip(str(path))}: writing it would "
                f"destroy that input; give {option} another path"
            )


def atomic_write(
    path: str | os.PathLike[str],
    data: str | bytes,
    *,
    what: str,
    error: type[PlanError] | None = PlanFileError,
) -> None:
    """Write ``data`` to ``path`` atomically. ``what`` names the file in errors ("plan file"). A
    file already at ``path`` keeps its permission bits (see the module docstring); a new file gets
    the bits ``open()`` would give it (0666 less the umask; ``mkstemp`` alone makes files 0600)."""
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))  # keep the link, replace what it points to
    try:
        mode: int | None = os.stat(path).st_mode
    except OSError:
        mode = None
    if mode is not None and stat.S_ISDIR(mode):
        if error is None:
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        raise error(f"cannot write {what} {str(path)!r}: it is a directory; give a file name")
    if mode is not None and not stat.S_ISREG(mode):  # /dev/null, a FIFO, a terminal: write into it
        _write_in_place(path, data, what=what, error=error)
        return
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        if error is None:
            raise
        raise error(
            f"cannot write {what} {str(path)!r}: {exc.strerror}; create the directory {str(path.parent)!r} first "
            "or write somewhere else"
        ) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, stat.S_IMODE(mode))
        else:
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        if error is None:
            raise
        raise error(f"cannot write {what} {str(path)!r}: {exc.strerror}; write somewhere else") from exc
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process's umask (read by setting it: there is no getter before Python 3.13's os.umask)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_in_place(path: Path, data: str | bytes, *, what: str, error: type[PlanError] | None) -> None:
    try:
        with open(path, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
    except OSError as exc:
        if error is None:
            raise
        raise error(f"cannot write {what} {str(path)!r}: {exc.strerror}; write somewhere else") from exc
