"""Load a user's build function (``path/to/models.py:build`` or ``package.module:build``)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from autoplan.cost_models.errors import PlanError
from autoplan.workload import Workload


class TargetError(PlanError):
    """The ``FILE.py:FUNCTION`` target cannot be loaded or does not return a Workload."""


def _where_in(exc: BaseException, path: Path) -> str:
    """``:<line>`` of the innermost frame of ``exc`` inside ``path`` (a syntax error's own line)."""
    if isinstance(exc, SyntaxError) and exc.lineno is not None:
        return f":{exc.lineno}"
    resolved = str(path.resolve())
    lines = [fr.lineno for fr in traceback.extract_tb(exc.__traceback__) if fr.filename == resolved]
    return f":{lines[-1]}" if lines else ""


def target_file(target: str) -> str | None:
    """The ``FILE.py`` of a ``FILE.py:FUNCTION`` target (``None`` for ``package.module:FUNCTION``):
    an input of the command, which its ``--out`` must not overwrite."""
    where = target.rsplit(":", 1)[0]
    return where if ":" in target and where.endswith(".py") else None


def load_build_fn(target: str) -> Callable[[], Workload]:
    if ":" not in target:
        raise TargetError(f"target {target!r} is malformed: expected FILE.py:FUNCTION or package.module:FUNCTION")
    where, func = target.rsplit(":", 1)
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise TargetError(
                    f"target file {where!r} does not exist (looked in {str(Path.cwd())!r}): check the path"
                )
            spec = importlib.util.spec_from_file_location(f"autoplan_target_{path.stem}", path.resolve())
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            sys.path.insert(0, str(path.parent.resolve()))
            try:
                spec.loader.exec_module(module)
            except (Exception, SystemExit, KeyboardInterrupt) as exc:  # noqa: BLE001 - reported in one line
                raise TargetError(
                    f"cannot import {where!r}: {_describe(exc)} at {where}"
                    f"{_where_in(exc, path)}: fix the error in that file"
                ) from exc
        else:
            module = importlib.import_module(where)
    except TargetError:
        raise
    except (Exception, SystemExit, KeyboardInterrupt) as exc:  # noqa: BLE001 - reported in one line
        raise TargetError(
            f"cannot import {where!r}: {_describe(exc)}: check the module name or give a path FILE.py:FUNCTION"
        ) from exc
    fn = getattr(module, func, None)
    if not callable(fn):
        what = f"no function {func!r}" if fn is None else f"{func!r} = a {type(fn).__name__}, not a function"
        raise TargetError(f"{where!r} has {what}: define def {func}() -> autoplan.Workload there or name another one")
    return fn


def _describe(exc: BaseException) -> str:
    """What user code raised, on one line; ``sys.exit()`` (``SystemExit``, even with code 0) and
    ``KeyboardInterrupt`` from a build function are failures too, never a successful exit."""
    if isinstance(exc, SystemExit):
        return f"it called sys.exit({repr(exc.code)[:80] if exc.code is not None else ''}) (SystemExit)"
    return f"{type(exc).__name__}: {_first_line(exc)}" if str(exc).strip() else type(exc).__name__


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def build_workload(target: str, *, device: str | torch.device, seed: int = 0) -> Workload:
    """Call the build function under ``device`` (``"meta"`` to plan without weights)."""
    fn = load_build_fn(target)
    torch.manual_seed(seed)
    try:
        with torch.device(device):
            wl = fn()
    except PlanError:
        raise
    except (Exception, SystemExit, KeyboardInterrupt) as exc:  # noqa: BLE001 - sys.exit(0) is not a model
        raise TargetError(
            f"{target} failed while building the model: {_describe(exc)}: "
            f"fix the build function (called with no arguments under torch.device({str(device)!r}))"
        ) from exc
    if not isinstance(wl, Workload):
        raise TargetError(
            f"{target} returned {type(wl).__name__}; it must return autoplan.Workload(model=..., example_inputs=...)"
        )
    return wl
