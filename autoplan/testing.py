"""pytest support: plan a model inside a test and assert what its plan must look like.

    # as a plugin: `pytest -p autoplan.testing`, or installed through the `pytest11` entry point
    def test_wide_mlp_is_tensor_parallel(autoplan_plan):
        plan = autoplan_plan(model, (x,), cluster="8xH100", loss_fn=F.mse_loss, example_targets=(y,))
        assert_plan(plan, max_step_time_s=1e-3, max_memory_fraction=0.5, parallelism={"intra": "tensor"},
                    no_fallback_ops=True, max_collectives=4)

    # without the plugin, on any plan
    from autoplan.testing import assert_plan

``autoplan_plan(model, inputs, cluster="4xCPU", **options)`` calls :func:`autoplan.plan` with
the plan cache (and profile databases) in a directory private to the test session, so a test
never reads or writes the user's cache and repeated plans of one session are cached.
:func:`assert_plan` checks every expectation and fails once, listing each unmet one with the
plan's value and the limit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import autoplan

if TYPE_CHECKING:
    import torch

    from autoplan.cost_models.cluster import Cluster
    from autoplan.planner.plan import Plan
    from autoplan.workload import Workload

AXIS_KINDS = ("data", "tensor", "data+tensor", "replicated")
"""What a mesh axis can be asked to do in ``parallelism=`` (see :meth:`Plan.parallelism`)."""
CONFIG_DEGREES = ("dp", "cp", "tp", "pp", "ep", "microbatch_size", "num_microbatches", "virtual_stages", "zero_stage")
"""Configuration fields ``parallelism=`` can pin for plans made with a global batch (an integer;
a mesh axis of the same name, such as a stage mesh's ``dp``, is asked with a kind, a string)."""


def _axis_kind(description: str) -> str:
    """``Plan.parallelism()`` text -> one of :data:`AXIS_KINDS`."""
    parts = {p.split("/")[0].split(" ")[0] for p in description.split(" + ")}
    if parts == {"replicated"}:
        return "replicated"
    return "+".join(k for k in ("data", "tensor") if k in parts)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g} ms"


def _gib(n: float) -> str:
    return f"{n / 1024**3:.4g} GiB"


def assert_plan(
    plan: Plan,
    *,
    max_step_time_s: float | None = None,
    max_memory_fraction: float | None = None,
    max_memory_bytes: float | None = None,
    min_mfu: float | None = None,
    parallelism: Mapping[str, str | int] | None = None,
    no_fallback_ops: bool = False,
    max_collectives: int | Mapping[str, int] | None = None,
) -> None:
    """Raise ``AssertionError`` listing every expectation ``plan`` does not meet.

    * ``max_step_time_s``, ``min_mfu``: the estimate (MFU exists for plans with a global batch);
    * ``max_memory_fraction`` / ``max_memory_bytes``: peak memory per device, as a fraction of
      the device's capacity / in bytes;
    * ``parallelism``: per mesh axis name, what the axis does (``data``, ``tensor``,
      ``data+tensor``, ``replicated``), e.g. ``{"intra": "tensor"}``; or, for plans with a
      global batch, configuration degrees, e.g. ``{"dp": 4, "pp": 2, "ep": 2}`` (an integer
      names a degree, a string an axis's kind: ``{"dp": "data"}`` asks the stage mesh's axis);
    * ``no_fallback_ops``: every operator has a sharding strategy (none is run replicated);
    * ``max_collectives``: collectives per step, in all (an int) or per kind
      (``{"all_reduce": 1, "all_gather": 0}``).
    """
    __tracebackhide__ = True
    e = plan.estimate
    peak = float(e.memory_bytes["total"])
    unmet: list[str] = []
    if max_step_time_s is not None and e.step_time_s > max_step_time_s:
        unmet.append(f"estimated step time {_ms(e.step_time_s)} > max_step_time_s {_ms(max_step_time_s)}")
    if max_memory_fraction is not None and peak > max_memory_fraction * e.capacity_bytes:
        unmet.append(
            f"peak memory per device {_gib(peak)} = {peak / e.capacity_bytes:.2%} of {_gib(e.capacity_bytes)} "
            f"> max_memory_fraction {max_memory_fraction:.2%}"
        )
    if max_memory_bytes is not None and peak > max_memory_bytes:
        unmet.append(f"peak memory per device {peak:,.0f} B > max_memory_bytes {max_memory_bytes:,.0f} B")
    if min_mfu is not None:
        if e.mfu is None:
            unmet.append("min_mfu: the plan has no MFU estimate (plan with global_batch_size=... to get one)")
        elif e.mfu < min_mfu:
            unmet.append(f"estimated MFU {e.mfu:.2%} < min_mfu {min_mfu:.2%}")
    for key, expected in (parallelism or {}).items():
        unmet.extend(_check_parallelism(plan, key, expected))
    if no_fallback_ops and plan.fallback_ops:
        ops = ", ".join(sorted(set(plan.fallback_ops.values())))
        unmet.append(f"{len(plan.fallback_ops)} op(s) run replicated for lack of a sharding strategy: {ops}")
    if max_collectives is not None:
        counts = plan.collective_counts()
        limits = {"collectives": max_collectives} if isinstance(max_collectives, int) else dict(max_collectives)
        for kind, limit in limits.items():
            n = sum(counts.values()) if kind == "collectives" else counts.get(kind, 0)
            if n > limit:
                shown = ", ".join(f"{k} x{v}" for k, v in counts.items()) or "none"
                unmet.append(f"{n} {kind} per step > max_collectives {limit} ({shown})")
    if unmet:
        head = f"plan {plan.fingerprint} for {plan.cluster} does not meet {len(unmet)} expectation(s):"
        raise AssertionError("\n".join([head, *(f"  - {u}" for u in unmet)]))


def _check_parallelism(plan: Plan, key: str, expected: str | int) -> list[str]:
    axes = plan.parallelism()
    if key in axes and not (key in CONFIG_DEGREES and isinstance(expected, int)):
        if expected not in AXIS_KINDS:
            raise ValueError(f"parallelism[{key!r}] = {expected!r}: expected one of {', '.join(AXIS_KINDS)}")
        actual = _axis_kind(axes[key])
        if actual == expected:
            return []
        detail = f" ({axes[key]})" if axes[key] != actual else ""
        return [f"mesh axis {key!r} is {actual}{detail}, expected {expected}"]
    if key in CONFIG_DEGREES:
        if plan.config is None:
            return [f"parallelism[{key!r}]: the plan has no configuration (plan with global_batch_size=... to get one)"]
        actual_degree = getattr(plan.config, key)
        return (
            [] if actual_degree == expected else [f"{key}={actual_degree} in {plan.config}, expected {key}={expected}"]
        )
    raise ValueError(
        f"parallelism key {key!r} is neither a mesh axis of {plan.cluster} ({', '.join(axes)}) "
        f"nor a configuration field ({', '.join(CONFIG_DEGREES)})"
    )


PlanFn = Callable[..., "Plan"]


@pytest.fixture(scope="session")
def autoplan_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's private plan cache (and profile database) directory."""
    return tmp_path_factory.mktemp("autoplan-cache")


@pytest.fixture
def autoplan_plan(autoplan_cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> PlanFn:
    """``autoplan_plan(model, inputs, cluster="4xCPU", **options) -> Plan``: :func:`autoplan.plan`
    with ``inputs`` (a tensor or a sequence of them) as ``example_inputs`` and the plan cache in
    :func:`autoplan_cache_dir`; ``options`` are :func:`autoplan.plan`'s keywords."""
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(autoplan_cache_dir))
    monkeypatch.delenv("AUTOPLAN_NO_PLAN_CACHE", raising=False)

    def plan(
        model: torch.nn.Module,
        inputs: torch.Tensor | Sequence[torch.Tensor],
        cluster: Cluster | str = "4xCPU",
        **options: Any,
    ) -> Plan:
        import torch  # heavy: the plugin is loaded by every pytest run, torch only when a test plans

        example_inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        return autoplan.plan(model, cluster, example_inputs=example_inputs, **options)

    return plan


def generated_program(workload: Workload, cluster: Cluster, plan: Plan, *, rank: int) -> str:
    """The per-rank program :func:`autoplan.parallelize` generates from ``plan`` for ``rank``,
    built on a fake process group of the cluster's size (nothing is communicated while the program
    is generated), which is destroyed afterwards. For snapshots of generated code without ranks."""
    import torch.distributed as dist  # heavy: the plugin is loaded by every pytest run
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cluster.world_size)
    try:
        model = autoplan.parallelize(
            workload.model,
            cluster,
            example_inputs=workload.example_inputs,
            loss_fn=workload.loss_fn,
            example_targets=workload.example_targets,
            plan=plan,
        )
        return model.code
    finally:
        dist.destroy_process_group()


__all__ = ["assert_plan", "autoplan_cache_dir", "autoplan_plan", "generated_program"]
