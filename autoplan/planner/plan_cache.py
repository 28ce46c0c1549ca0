"""Plan cache: re-planning an unchanged (model, inputs, cluster, options) returns the stored plan.

    <cache>/plans/<key>.json        <cache> = $AUTOPLAN_CACHE_DIR | $XDG_CACHE_HOME/autoplan | ~/.cache/autoplan

The key is a SHA-256 over everything the plan depends on, computed without tracing:

* the model: its module tree (``repr``), every parameter's and buffer's name, shape and dtype
  (and whether the parameter is trained: freezing one changes the traced step),
  and the bytecode of the ``forward`` of every module class it uses;
* the example inputs' and targets' shapes and dtypes, the loss function's bytecode;
* the cluster (``Cluster.to_dict``, calibrated links included), the planning options, the
  profile database's measured times;
* autoplan's own source files and torch's version (a new version never reuses an old plan).

The key cannot see the helpers ``forward`` calls (a module-level function, a config module read
at import, a monkeypatched library function), so a hit is proven before it is used: each entry
holds the fingerprint of the exported forward and loss of the step the plan is for
(:func:`autoplan.passes.trace.forward_fingerprint`), and :func:`autoplan.planner.joint.plan_for_batch` exports
the model again and uses the entry only if the fingerprints are equal. With the key's parameters
(their ``requires_grad`` included), torch and autoplan unchanged, that graph determines the
traced step, so a hit is a plan whose fingerprint is the model's. A stale entry is a miss and is
replaced.

A corrupted or unreadable entry is a miss (and is replaced); entries are written atomically.
Each entry also holds the key it was stored under, compared on a hit: a file copied or renamed
over another key's (a 16-device plan where a 32-device request's entry belongs) is a miss, with a
warning, and is replaced. A cache folder that cannot be written (``$AUTOPLAN_CACHE_DIR`` a regular
file) stores nothing, with one warning (``autoplan.cost_models.profile_db.cache_subdir``).
Set ``AUTOPLAN_NO_PLAN_CACHE=1`` to disable.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import autoplan.cost_models as _cost_models_pkg
import autoplan.passes as _passes_pkg
from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.echo import clip
from autoplan.cost_models.errors import PlanError
from autoplan.cost_models.files import MAX_PLAN_FILE_BYTES, atomic_write, parse_json, read_limited
from autoplan.cost_models.profile_db import ProfileDB, cache_subdir, default_cache_dir
from autoplan.planner.plan import Plan

log = logging.getLogger(__name__)

_PACKAGE_DIRS = (
    Path(__file__).resolve().parent.parent,  # autoplan/ (its subpackages planner, runtime, tools included)
    Path(_passes_pkg.__file__).resolve().parent,  # passes/ (autoplan/passes is a link to it in a checkout)
    Path(_cost_models_pkg.__file__).resolve().parent,  # cost_models/
)


def source_files() -> list[Path]:
    """Every source file of autoplan, each once. ``rglob`` does not follow the checkout's links
    autoplan/passes and autoplan/cost_models: those folders are listed themselves (an installed
    wheel holds them as real folders; resolving counts a file once either way)."""
    return sorted({f.resolve() for root in _PACKAGE_DIRS for f in root.rglob("*.py")})


@functools.cache
def _source_digest() -> str:
    """A digest of every source file of autoplan, so a cached plan made by other code is a miss."""
    h = hashlib.sha256()
    for f in source_files():
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _code_digest(fn: Callable[..., Any] | None) -> str:
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "forward", None), "__code__", None)
    if code is None:
        return repr(fn)
    parts = [code.co_code, repr(code.co_consts).encode(), repr(code.co_names).encode()]
    return hashlib.sha256(b"".join(parts)).hexdigest()


def _tensor_sig(t: torch.Tensor) -> list[Any]:
    return [list(t.shape), str(t.dtype)]


def plan_key(
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    loss_fn: Callable[..., Any] | None,
    cluster: Cluster,
    options: Mapping[str, Any],
    profile: ProfileDB | None,
) -> str:
    """The cache key (see the module docstring)."""
    classes = sorted({type(m) for m in model.modules()}, key=lambda c: f"{c.__module__}.{c.__qualname__}")
    doc = {
        "model": repr(model),
        "params": [[n, *_tensor_sig(p), p.requires_grad] for n, p in model.named_parameters()],
        "buffers": [[n, *_tensor_sig(b)] for n, b in model.named_buffers()],
        "forward": [[f"{c.__module__}.{c.__qualname__}", _code_digest(c.forward)] for c in classes],
        "inputs": [_tensor_sig(t) for t in inputs],
        "targets": [_tensor_sig(t) for t in targets],
        "loss": _code_digest(loss_fn) if loss_fn is not None else None,
        "cluster": cluster.to_dict(),
        "options": dict(options),
        "profile": sorted((k, profile.lookup(k)) for k in profile) if profile is not None else None,
        "source": _source_digest(),
        "torch": torch.__version__,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _path(key: str) -> Path:
    return default_cache_dir() / "plans" / f"{key}.json"


def enabled() -> bool:
    return os.environ.get("AUTOPLAN_NO_PLAN_CACHE", "") in ("", "0")


ENTRY_FORMAT = "autoplan.plan-cache-entry"


@dataclass(frozen=True, slots=True)
class CacheEntry:
    plan: Plan
    forward_fingerprint: str
    """:func:`autoplan.passes.trace.forward_fingerprint` of the step the plan is for, when it was made."""


def load(key: str) -> CacheEntry | None:
    """The cached entry, or ``None`` (missing, unreadable, corrupted, of an older format or stored
    under another key: a miss)."""
    path = _path(key)
    if not enabled() or not path.exists():
        return None

    try:
        data = parse_json(read_limited(path, max_bytes=MAX_PLAN_FILE_BYTES))
        if not isinstance(data, dict) or data.get("format") != ENTRY_FORMAT:
            raise PlanError(f"not a {ENTRY_FORMAT} (an older cache format)")
        if data.get("key") != key:  # copied or renamed from another request's entry
            raise PlanError(f"it was stored for another request (key {clip(data.get('key'), 40)}, not {key!r})")
        entry = CacheEntry(
            plan=Plan.from_dict(data["plan"], where=f"plan cache entry {str(path)!r}"),
            forward_fingerprint=str(data["forward_fingerprint"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:  # PlanError is a ValueError
        log.warning("ignoring plan cache entry %s: %s", path, exc)
        return None
    log.info("plan cache entry found: %s", path)
    return entry


def store(key: str, entry: CacheEntry) -> None:
    if not enabled():
        return

    if cache_subdir("plans") is None:  # warned there: plan without the cache
        return
    path = _path(key)
    data = {
        "format": ENTRY_FORMAT,
        "key": key,
        "forward_fingerprint": entry.forward_fingerprint,
        "plan": entry.plan.to_dict(),
    }
    try:
        atomic_write(path, json.dumps(data, indent=1) + "\n", what="plan cache entry")
    except (OSError, PlanError) as exc:  # a read-only cache never fails planning
        log.warning("could not write plan cache entry %s: %s", path, exc)


__all__ = ["CacheEntry", "enabled", "load", "plan_key", "store"]
