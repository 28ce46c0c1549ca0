"""Model zoo: real Hugging Face architectures plan for 2 CPU ranks and train like one device.

Every architecture of ``examples/hf_models.py:ZOO`` (tiny config, random weights, nothing
downloaded) is planned as ``autoplan plan`` does it: built on the ``meta`` device, the parameters
its entry names frozen (``requires_grad_(False)``), ``plan = autoplan.plan(model, "2xCPU", ...)``.
Both ranks of a gloo job then build it on CPU with the same seed, freeze the same parameters, keep
a copy as the single-device reference, and::

    pm = autoplan.parallelize(model, "2xCPU", ..., plan=plan)    # the plan's trace must match
    for step in range(NUM_STEPS):                                # a new seeded batch per step
        loss = pm.forward_backward(*inputs, targets=targets, check=True); opt.step(); opt.zero_grad()
        ref_loss = loss_fn(reference(*inputs), *targets); ref_loss.backward(); ref_opt.step(); ...

The test then requires on every rank, with the tolerance of ``tests/harness.py``,

    |loss - ref_loss| <= REL_TOL * |ref_loss|                     at every step
    ||full(p) - p_ref|| / ||p_ref|| <= REL_TOL                    for every parameter after the last step
    full(p) == p_initial, bit for bit                              for every frozen parameter

Both sides train with the workload's optimizer (SGD with momentum; see ``test_equivalence.py`` for
why not Adam). One launch trains several models (:func:`train_zoo_models`: spawning two ranks costs
seconds of imports); the tests of one session share the launches of the models they select
(:class:`ZooRuns`). CI runs :data:`FAST`; ``pytest -m slow tests/test_model_zoo.py`` the rest.
``python benchmarks/model_zoo.py`` prints the zoo table.
"""

from __future__ import annotations

import copy
import fnmatch
import math
import os
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pytest
import torch

import autoplan
from examples.hf_models import ZOO
from tests import zoo
from tests.harness import mismatches, param_errors, run_ranks, train_both

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # spawned ranks inherit it: nothing is downloaded

WORLD_SIZE = 2
CLUSTER = "2xCPU"
FAST = ("mixtral", "bert")
"""The CI subset: a mixture of experts and an encoder (GPT-2's fused qkv trains on 2 ranks in CI in
tests/test_fused_projections.py; the other models run with -m slow: the suite's 15-minute budget)."""
KNOWN_BUGS: dict[str, str] = {}
"""Zoo models that fail today, with the bug (tests/test_model_zoo.py is where they were found).
Their tests are strict xfails: fixing the bug makes them XPASS, which fails until the entry goes."""
MODELS_PER_LAUNCH = 6
LAUNCH_TIMEOUT_S = 900.0


def freeze(model: torch.nn.Module, patterns: Sequence[str]) -> list[str]:
    """``requires_grad_(False)`` on every parameter whose name matches one of ``patterns``;
    returns the names of all frozen parameters (those the model froze itself included)."""
    named = dict(model.named_parameters())
    for pattern in patterns:
        matched = fnmatch.filter(named, pattern)
        assert matched, f"freeze pattern {pattern!r} matches no parameter"
        for name in matched:
            named[name].requires_grad_(False)
    return sorted(n for n, p in named.items() if not p.requires_grad)


def build(name: str, *, device: str) -> tuple[autoplan.Workload, list[str]]:
    """The zoo model ``name`` built with seed 0 on ``device``, its entry's parameters frozen;
    returns the workload and the names of the frozen parameters."""
    entry = ZOO[name]
    torch.manual_seed(0)
    with torch.device(device):
        wl = entry.build()
    return wl, freeze(wl.model, entry.frozen)


def plan_one(name: str) -> dict[str, Any]:
    """Plan zoo model ``name`` for :data:`CLUSTER` from its ``meta`` build (no weights), as the CLI
    does; the plan travels to the ranks as its JSON dict."""
    start = time.perf_counter()
    try:
        wl, _ = build(name, device="meta")
        plan = zoo.plan_workload(wl, CLUSTER)
    except Exception:  # noqa: BLE001 - a model the planner refuses is that model's result
        error = traceback.format_exc()
        return {"name": name, "failed_at": "plan", "error": error, "plan_seconds": time.perf_counter() - start}
    return {"name": name, "plan": plan.to_dict(), "plan_seconds": time.perf_counter() - start}


def train_one(name: str, plan: Mapping[str, Any]) -> dict[str, Any]:
    """Rank body for one zoo model: apply ``plan``, NUM_STEPS steps sharded and on the reference."""
    start = time.perf_counter()
    wl, frozen = build(name, device="cpu")
    assert wl.batches is not None
    initial = {n: p.detach().clone() for n, p in wl.model.named_parameters() if n in frozen}
    reference = copy.deepcopy(wl.model)
    pm = autoplan.parallelize(
        wl.model,
        CLUSTER,
        example_inputs=wl.example_inputs,
        loss_fn=wl.loss_fn,
        example_targets=wl.example_targets,
        plan=autoplan.Plan.from_dict(plan),
    )
    opt = pm.make_optimizer(lr=wl.lr)
    ref_opt = type(opt)(reference.parameters(), **opt.defaults)
    result = train_both(pm, reference, batches=wl.batches, loss_fn=wl.loss_fn, opt=opt, ref_opt=ref_opt)
    full, ref_params = result["params"], result["ref_params"]
    return result | {
        "name": name,
        "frozen": frozen,
        "frozen_identical": {
            n: torch.equal(full[n], initial[n]) and torch.equal(ref_params[n], initial[n]) for n in frozen
        },
        "num_params": sum(p.numel() for p in ref_params.values()),
        "num_ops": len(pm.plan.nodes),
        "parallelism": pm.plan.parallelism(),
        "collectives": pm.plan.collective_counts(),
        "seconds": time.perf_counter() - start,
    }


def train_zoo_models(
    rank: int, world_size: int, plans: Sequence[tuple[str, Mapping[str, Any]]]
) -> list[dict[str, Any]]:
    """Rank body of one launch: :func:`train_one` for each (model, plan) in turn. A model that
    raises (on both ranks alike: they trace the same) is reported with its traceback and the
    next one runs."""
    torch.set_num_threads(1)
    results = []
    for name, plan in plans:
        start = time.perf_counter()
        try:
            results.append(train_one(name, plan))
        except Exception:  # noqa: BLE001 - one model's failure is that model's result
            error = traceback.format_exc()
            results.append({"name": name, "failed_at": "train", "error": error, "seconds": time.perf_counter() - start})
    return results


def run_zoo(names: Sequence[str], *, per_launch: int = MODELS_PER_LAUNCH) -> dict[str, list[dict[str, Any]]]:
    """Plan ``names`` here, train those planned on 2 gloo ranks, ``per_launch`` models per launch;
    per model, each rank's result (the planning result twice if planning failed), with the
    planning time."""
    planned = [plan_one(name) for name in names]
    out: dict[str, list[dict[str, Any]]] = {p["name"]: [p, p] for p in planned if "error" in p}
    todo = [(p["name"], p["plan"]) for p in planned if "error" not in p]
    plan_seconds = {p["name"]: p["plan_seconds"] for p in planned}
    for i in range(0, len(todo), per_launch):
        chunk = todo[i : i + per_launch]
        per_rank = run_ranks(train_zoo_models, WORLD_SIZE, chunk, timeout_s=LAUNCH_TIMEOUT_S)
        for j, (name, _) in enumerate(chunk):
            out[name] = [rank_results[j] | {"plan_seconds": plan_seconds[name]} for rank_results in per_rank]
    return {name: out[name] for name in names}


def failures(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """What differs from the single-device run, on any rank (empty: the model trains alike)."""
    if results[0].get("failed_at") == "plan":
        return [f"autoplan.plan raised:\n{results[0]['error']}"]
    problems = [f"rank {rank} raised:\n{r['error']}" for rank, r in enumerate(results) if "error" in r]
    if problems:
        return problems
    problems = mismatches(results)
    for rank, r in enumerate(results):
        if not r["frozen"]:
            problems.append(f"rank {rank}: no parameter is frozen")
        moved = [n for n, same in r["frozen_identical"].items() if not same]
        if moved:
            problems.append(f"rank {rank}: frozen parameters changed: {moved}")
    return problems


def _worst(errors: Iterable[float]) -> float:
    """The largest error, NaN if any is NaN (``max`` would skip it or not, by position)."""
    values = list(errors)
    return math.nan if any(math.isnan(e) for e in values) else max(values)


def summary(results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One row of the zoo table from both ranks' results."""
    first = results[0]
    row: dict[str, Any] = {
        "name": first["name"],
        "planned": first.get("failed_at") != "plan",
        "plan_seconds": first["plan_seconds"],
        "seconds": max(r.get("seconds", 0.0) for r in results),
    }
    if any("error" in r for r in results):
        return row | {"error": next(r["error"] for r in results if "error" in r)}
    return row | {
        "num_params": first["num_params"],
        "num_ops": first["num_ops"],
        "parallelism": first["parallelism"],
        "collectives": first["collectives"],
        "max_loss_rel_err": _worst(
            abs(a - b) / abs(b) for r in results for a, b in zip(r["losses"], r["ref_losses"], strict=True)
        ),
        "max_param_rel_err": _worst(e for r in results for e in param_errors(r).values()),
        "num_frozen": len(first["frozen"]),
        "frozen_identical": all(all(r["frozen_identical"].values()) for r in results),
    }


# --- tests ---------------------------------------------------------------------------------------


class ZooRuns:
    """The zoo results of one test session. The first test that asks trains every zoo model the
    session selected that is not trained yet (so ``-k gpt2`` trains one model, the CI subset is one
    launch), in launches of :data:`MODELS_PER_LAUNCH`."""

    def __init__(self, selected: Iterable[str]) -> None:
        self.selected = list(dict.fromkeys(selected))
        self.results: dict[str, list[dict[str, Any]]] = {}

    def __getitem__(self, name: str) -> list[dict[str, Any]]:
        if name not in self.results:
            todo = [n for n in self.selected if n not in self.results]
            self.results |= run_zoo(todo if name in todo else [name])
        return self.results[name]


@pytest.fixture(scope="module")
def zoo_runs(request: pytest.FixtureRequest) -> ZooRuns:
    selected = [
        item.callspec.params["name"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec") and "name" in item.callspec.params
    ]
    return ZooRuns(selected)


def test_zoo_has_44_architectures_of_every_kind():
    assert len(ZOO) >= 44
    assert {e.kind for e in ZOO.values()} == {
        "decoder",
        "MoE decoder",
        "encoder",
        "encoder-decoder",
        "vision",
        "speech",
    }
    assert set(FAST) <= set(ZOO)


def _param(name: str) -> Any:
    marks = [] if name in FAST else [pytest.mark.slow]
    if name in KNOWN_BUGS:
        marks.append(pytest.mark.xfail(reason=KNOWN_BUGS[name], raises=AssertionError, strict=True))
    return pytest.param(name, marks=marks)


@pytest.mark.parametrize("name", [_param(n) for n in ZOO])
def test_zoo_model_plans_for_2_cpu_ranks_and_trains_like_single_device(zoo_runs: ZooRuns, name: str):
    results = zoo_runs[name]
    row = summary(results)
    print(f"\n[{name}] {row}")
    problems = failures(results)
    assert not problems, f"{name}:\n" + "\n".join(problems)
