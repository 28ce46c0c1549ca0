"""Writing output files so that a failure never leaves a half-written or missing file.

Every file autoplan writes (plan, report, ONNX model, bench results, profile database, cluster
profile) goes through :func:`atomic_write`: a temporary file in the same directory, flushed to
disk and renamed over the target only once it is complete. A file that cannot be written is a
:class:`~cost_models.errors.PlanFileError` (or the error type the caller names) with one line
naming the file and what to do; ``error=None`` lets the ``OSError`` through.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from cost_models.errors import PlanError, PlanFileError


def atomic_write(
    path: str | os.PathLike[str],
    data: str | bytes,
    *,
    what: str,
    public: bool = False,
    error: type[PlanError] | None = PlanFileError,
) -> None:
    """Write ``data`` to ``path`` atomically. ``what`` names the file in errors ("plan file");
    ``public``: readable by others (0644; ``mkstemp`` makes files private)."""
    path = Path(path)
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
        if public:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        if error is None:
            raise
        raise error(f"cannot write {what} {str(path)!r}: {exc.strerror}; write somewhere else") from exc
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
