"""Load a user's build function (``path/to/models.py:build`` or ``package.module:build``)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from autoplan.workload import Workload
from cost_models.errors import PlanError


class TargetError(PlanError):
    """The ``FILE.py:FUNCTION`` target cannot be loaded or does not return a Workload."""


def load_build_fn(target: str) -> Callable[[], Workload]:
    if ":" not in target:
        raise TargetError(f"target {target!r} is malformed: expected FILE.py:FUNCTION or package.module:FUNCTION")
    where, func = target.rsplit(":", 1)
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise TargetError(f"target file {where!r} does not exist")
            spec = importlib.util.spec_from_file_location(f"autoplan_target_{path.stem}", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            sys.path.insert(0, str(path.parent.resolve()))
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except TargetError:
        raise
    except Exception as exc:  # noqa: BLE001 - user code failing at import is reported in one line
        raise TargetError(f"cannot import {where!r}: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, func, None)
    if not callable(fn):
        raise TargetError(f"{where!r} has no function {func!r}")
    return fn


def build_workload(target: str, *, device: str | torch.device, seed: int = 0) -> Workload:
    """Call the build function under ``device`` (``"meta"`` to plan without weights)."""
    fn = load_build_fn(target)
    torch.manual_seed(seed)
    try:
        with torch.device(device):
            wl = fn()
    except PlanError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise TargetError(f"{target} failed while building the model: {type(exc).__name__}: {exc}") from exc
    if not isinstance(wl, Workload):
        raise TargetError(
            f"{target} returned {type(wl).__name__}; it must return autoplan.Workload(model=..., example_inputs=...)"
        )
    return wl
