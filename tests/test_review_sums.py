"""The numbers review outputs print add up (issue #43, item 5).

Every review output of a plan — ``autoplan show`` (:func:`show_text`), ``autoplan report`` (the
HTML page), ``autoplan explain`` (the configuration table of a global-batch plan, one op's
alternatives), ``Plan.summary()`` and the plan JSON — prints the step in one set of parts,
``estimate.parts`` (:class:`autoplan.cost_models.step.StepParts`: compute, exposed communication,
pipeline bubble, optimizer step on the step's critical path). Checked here on the golden plans
(``tests/golden/plans/*.plan.json``), a freshly planned pipeline plan with tensor parallelism
inside its stages (GPT-2 with 4 blocks, ``2x4xH100``, dp=2 tp=2 pp=2: the tensor-parallel
collectives run in the compute stream, which the old ``show`` counted twice) and a joint-search
plan (the search picks the configuration): the parts printed add up to the printed step within
the rounding of the printed digits, no part is negative, and no template text leaks (no
``{name}`` f-string remnant, no ``None``, ``nan`` or ``inf``). Below the outputs, the property
itself on every configuration the search prices: the parts add up to ``step_time_s`` and are >= 0.

Before the fix, for a Llama-3-8B-shaped plan on 8 H100 (dp=2 tp=4, 32 micro-batches) ``show``
printed compute 4,707.008 ms + exposed communication 661.393 ms against a 4,727.881 ms step and
an ``other`` row of -640.520 ms (the 660.7 ms of tensor-parallel conversions in both); now
4,046.329 + 663.093 + optimizer 18.459 = 4,727.881 ms.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import cli_models
import pytest

import autoplan
from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.step_parts import StepParts
from autoplan.planner.plan import Plan
from autoplan.planner.search import search
from autoplan.planner.segment_model import SegmentCostModel
from autoplan.tools.report import render_html, time_parts
from autoplan.tools.review import explain, explain_configuration, explain_configuration_text, explain_text, show_text
from tests.zoo import gpt2_tiny, lm_loss, on_meta, plan_workload, token_batch

GOLDEN_PLANS = sorted((Path(__file__).resolve().parent / "golden" / "plans").glob("*.plan.json"))
LEAKS = (
    # an f-string's field left as text ({fmt_s(e.compute_s)}); block ranges such as {0..3} are meant
    re.compile(r"\{[A-Za-z_][^{}]*\}"),
    re.compile(r"\bNone\b"),
    re.compile(r"\b(nan|NaN|inf)\b"),
)
MS = r"(-?[\d,]+\.\d{3}) ms"


def _ms(text: str) -> float:
    return float(text.replace(",", ""))


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    """The golden plans, a fresh pipeline plan and a fresh joint-search plan."""
    out = {p.name.removesuffix(".plan.json"): Plan.load(p) for p in GOLDEN_PLANS}
    config = autoplan.ParallelConfig(dp=2, tp=2, pp=2, microbatch_size=2, num_microbatches=8, schedule="1f1b")
    out["pipeline_tp"] = plan_workload(
        on_meta(cli_models.gpt2_4_layers), autoplan.Cluster.preset("2x4xH100"), profile=None, global_batch_size=32,
        config=config,
    )  # fmt: skip
    out["joint_search"] = plan_workload(
        on_meta(cli_models.gpt2_4_layers), autoplan.Cluster.preset("2x4xH100"), profile=None, global_batch_size=32
    )
    return out


def _assert_no_leak(text: str, what: str) -> None:
    for pattern in LEAKS:
        m = pattern.search(text)
        assert m is None, f"{what} leaks {m.group(0)!r}: ...{text[max(0, m.start() - 80) : m.end() + 80]}..."


def _assert_adds_up(parts: list[float], step: float, what: str) -> None:
    """Printed with 3 decimals: each part and the step are off by at most half a unit of the last digit."""
    assert parts and all(p >= 0 for p in parts), f"{what}: a negative part in {parts}"
    assert abs(sum(parts) - step) <= 0.0005 * (len(parts) + 1) + 1e-9, (
        f"{what}: {parts} add to {sum(parts)}, not {step}"
    )


def test_the_parts_of_every_plan_add_up_to_its_step_and_none_is_negative(plans):
    for name, plan in plans.items():
        e = plan.estimate
        parts = e.parts
        assert parts is not None, name
        assert abs(parts.total_s - e.step_time_s) <= 1e-9 * e.step_time_s, (name, parts, e.step_time_s)
        for c in plan.configurations:
            assert c.parts is not None and abs(c.parts.total_s - c.step_time_s) <= 1e-9 * c.step_time_s, (name, c)
    assert plans["pipeline_tp"].estimate.parts.bubble_s > 0  # a pipeline
    assert plans["joint_search"].configurations and plans["joint_search"].config is not None


def test_show_prints_parts_that_add_up_to_the_step(plans):
    for name, plan in plans.items():
        text = show_text(plan)
        _assert_no_leak(text, f"show {name}")
        section = text[text.index("Time per step") : text.index("Communication per step")]
        rows = dict(re.findall(r"^([a-z][a-z ]+?)\s+(-?[\d,]+\.\d{3})\s+-?[\d.]+%$", section, flags=re.M))
        step = _ms(rows.pop("step"))
        assert "other" not in " ".join(rows), f"show {name}: {section}"
        assert set(rows) <= {"compute", "exposed communication", "pipeline bubble", "optimizer step"}, rows
        _assert_adds_up([_ms(v) for v in rows.values()], step, f"show {name}")
        shares = [float(s) for s in re.findall(r"(-?[\d.]+)%$", section, flags=re.M)[:-1]]
        assert abs(sum(shares) - 100.0) <= 0.05 * len(shares) + 1e-9, f"show {name}: shares {shares}"


def test_summary_prints_the_same_parts_and_the_same_memory_parts_as_show(plans):
    for name, plan in plans.items():
        text = plan.summary()
        _assert_no_leak(text, f"summary {name}")
        line = next(line for line in text.splitlines() if line.startswith("  estimated step: "))
        numbers = [_ms(x) for x in re.findall(MS, line.split("(")[0])]
        _assert_adds_up(numbers[1:], numbers[0], f"summary {name}")
        assert [k for k, _ in plan.estimate.parts.rows()] == re.findall(
            r"\+? ?([a-z][a-z ]+?) [\d,.]+ ms", line.split(" = ")[1].split("(")[0]
        )
        memory = next(line for line in text.splitlines() if line.startswith("  peak memory per device: "))
        show_memory = show_text(plan).split("Memory per device\n")[1].splitlines()[0].split()
        listed = re.findall(r"([a-z]+) [\d.]+ [KMG]iB", memory.split("(", 1)[1])
        assert listed == show_memory[1 : 1 + len(listed)], (memory, show_memory)
        assert show_memory[1 + len(listed)] == "peak"


def test_report_bar_and_percentages_are_of_the_step(plans):
    for name, plan in plans.items():
        html = render_html(plan)
        text = re.sub(r"<style>.*?</style>|<script>.*?</script>", "", html, flags=re.S)
        _assert_no_leak(text, f"report {name}")
        assert "the bar adds to" not in text
        parts = time_parts(plan)
        assert abs(sum(v for _, v in parts) - plan.estimate.step_time_s) <= 1e-9 * plan.estimate.step_time_s, name
        assert all(v >= 0 for _, v in parts), (name, parts)
        legend = re.findall(
            r"(compute|exposed communication|pipeline bubble|optimizer step): [^(<]+ \((-?[\d.]+)%\)", text
        )
        shares = {k: float(v) for k, v in legend}
        assert set(shares) == {k for k, _ in parts}, (name, shares, parts)
        assert abs(sum(shares.values()) - 100.0) <= 0.05 * len(shares) + 1e-9, (name, shares)


def test_explain_rows_add_up_to_each_configurations_step(plans):
    for name, plan in plans.items():
        node = next((n for n, x in plan.alternatives.items() if len(x.alternatives) > 1), None)
        if node is not None:
            _assert_no_leak(explain_text(explain(plan, op=node)), f"explain --op {node} of {name}")
        if plan.config is None:
            continue
        ex = explain_configuration(plan)
        text = explain_configuration_text(ex)
        _assert_no_leak(text, f"explain {name}")
        rows = [line for line in text.splitlines() if re.match(r"(chosen|#\d+) ", line)]
        assert len(rows) == len(plan.configurations)
        for line in rows:
            cells = re.findall(r"(?<=\s)(-?[+\d,]*\.\d{3})(?=\s)", line + " ")
            step, _vs, *parts = cells if line.startswith("#") else [cells[0], "0", *cells[1:]]
            _assert_adds_up([_ms(p) for p in parts], _ms(step), f"explain {name}: {line}")
        why = ex["reason"]
        assert "None" not in why and "nan" not in why


def test_the_plan_json_records_the_parts_and_loads_without_them(plans):
    for name, plan in plans.items():
        d = json.loads(json.dumps(plan.to_dict()))
        est = d["estimate"]
        parts = est["step_parts"]
        assert set(parts) == {"compute_s", "exposed_comm_s", "bubble_s", "optimizer_s"}
        assert min(parts.values()) >= 0 and abs(sum(parts.values()) - est["step_time_s"]) <= 1e-9 * est["step_time_s"]
        for c in d.get("configurations", ()):
            assert abs(sum(c["step_parts"].values()) - c["step_time_s"]) <= 1e-9 * c["step_time_s"]
        assert Plan.from_dict(d).estimate.parts == plan.estimate.parts
        # a plan file written before the parts were recorded still loads and is shown
        del est["step_parts"]
        for c in d.get("configurations", ()):
            del c["step_parts"]
        old = Plan.from_dict(d)
        _assert_no_leak(show_text(old) + old.summary(), f"{name} without step_parts")
        if plan.config is None:  # a per-operator plan's parts follow from its fields
            assert old.estimate.parts == plan.estimate.parts
        else:
            assert old.estimate.parts is None and "not broken down" in show_text(old)
            if old.configurations:
                explain_configuration_text(explain_configuration(old))


def test_a_plan_file_whose_parts_do_not_add_up_is_refused(plans):
    d = json.loads(json.dumps(plans["pipeline_tp"].to_dict()))
    d["estimate"]["step_parts"]["compute_s"] *= 2
    with pytest.raises(autoplan.PlanFileError, match="step_parts add up to"):
        Plan.from_dict(d)
    d["estimate"]["step_parts"]["compute_s"] = -1.0
    with pytest.raises(autoplan.PlanFileError, match="finite number >= 0"):
        Plan.from_dict(d)


def test_every_configuration_the_search_prices_has_parts_that_add_up_to_its_step():
    ids, labels = token_batch()
    cluster = Cluster.preset("2x4xA100-80GB")
    costs = SegmentCostModel(gpt2_tiny(num_layers=4), (ids,), lm_loss, (labels,), cluster)
    best, every = search(costs, cluster, num_blocks=4, global_batch_size=32, precision="fp32")
    schedules = {e.config.schedule for e in every}
    assert len(every) > 50 and {"1f1b", "zero-bubble"} <= schedules, (len(every), schedules)
    for e in (best, *every):
        p = e.parts
        assert isinstance(p, StepParts) and min(p.compute_s, p.exposed_comm_s, p.bubble_s, p.optimizer_s) >= 0
        assert abs(p.total_s - e.step_time_s) <= 1e-9 * e.step_time_s, (e.config, p, e.step_time_s)
        assert p.bubble_s <= e.bubble_s + 1e-15
