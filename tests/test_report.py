"""``autoplan report``: the HTML page of a plan is self-contained, escaped, deterministic, has every
chart, and renders in headless Chromium without console errors or network requests.

Two plans are made once per module on the meta device: an ILP plan of the ``mlp`` of
``tests/cli_models.py`` on 2 CPUs, and a global-batch pipeline plan of ``gpt2_4_layers``
(dp=1, pp=2, 4 micro-batches, 1F1B). Other shapes (schedules, 2000 operators, hostile names) are
made from them with ``dataclasses.replace``. The browser test needs ``playwright`` (pip) and a
system Chromium (``apt-get install -y chromium``); it is skipped without them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.cost_models.errors import PlanFileError
from autoplan.planner.plan import CollectiveRecord, Plan
from autoplan.tools import report
from tests import zoo

REPO_ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("summary", "placements", "schedule", "memory", "time")
HOSTILE = '<script>alert("x")</script>'
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    return zoo.ilp_and_pipeline_plans()


def _with_schedule(plan: Plan, schedule: str, *, virtual_stages: int = 1, num_microbatches: int = 4) -> Plan:
    """The pipeline plan with another schedule (and chunks: one stage per block when v = 2)."""
    assert plan.config is not None and plan.pipeline is not None
    config = dataclasses.replace(
        plan.config, schedule=schedule, virtual_stages=virtual_stages, num_microbatches=num_microbatches
    )
    starts = (0, 2, 3, 4) if virtual_stages == 2 else plan.pipeline.stage_starts
    layout = dataclasses.replace(plan.pipeline, stage_starts=starts, stage_recompute=("none",) * len(starts))
    return dataclasses.replace(plan, config=config, pipeline=layout)


# --- the page ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ilp", "pipeline"])
def test_page_loads_nothing_from_the_network(plans, kind):  # noqa: ANN001
    page = report.render_html(plans[kind])

    assert not re.search(r"""(?:src|href|action|xlink:href)\s*=|url\(|@import""", page, re.IGNORECASE)
    assert "http://" not in page and "https://" not in page


@pytest.mark.parametrize("kind", ["ilp", "pipeline"])
def test_page_has_every_section_and_chart(plans, kind):  # noqa: ANN001
    page = report.render_html(plans[kind])

    for section in SECTIONS:
        assert f'id="{section}"' in page
    timeline = "compute and communication streams" if report.stream_timeline(plans[kind]) else "single-device timeline"
    for label in ("pipeline schedule" if kind == "pipeline" else timeline, "memory per device",
                  "time breakdown"):  # fmt: skip
        assert f'aria-label="{label}"' in page
    assert page.count('class="c p') == len(plans[kind].nodes)  # one cell per operator


def test_pipeline_page_shows_stages_segments_and_recomputation(plans):  # noqa: ANN001
    page = report.render_html(plans["pipeline"])

    assert page.count('class="stage"') == 2
    for segment in ("prologue", "transformer.h.0", "transformer.h.3", "epilogue"):
        assert f'<span class="seg">{segment}</span>' in page
    assert "recompute: none" in page


def test_no_caption_prints_an_unformatted_field(plans):  # noqa: ANN001
    """Every ``{...}`` of the page's text was formatted (a caption once printed the literal
    ``{fmt_s(e.compute_s)}``: a string missing its ``f`` prefix): both pages, and the schematic
    timeline's caption (plans whose collectives carry no issue times, as older plan files)."""
    unformatted = re.compile(r"\{[A-Za-z_][\w.]*(\(|\})")
    for plan in plans.values():
        page = re.sub(r"<style>.*?</style>|<script>.*?</script>", "", report.render_html(plan), flags=re.S)
        assert not unformatted.search(page)
    _, caption = report._single_device_chart(plans["ilp"])  # noqa: SLF001 - the caption of that path
    assert not unformatted.search(caption)
    assert f"the compute {report.fmt_s(plans['ilp'].estimate.compute_s)} is spread evenly over the" in caption


def test_strings_from_the_plan_are_escaped(plans):  # noqa: ANN001
    plan = plans["ilp"]
    nodes = {(HOSTILE if i == 0 else n): {**d, "op": HOSTILE} for i, (n, d) in enumerate(plan.nodes.items())}
    hostile = dataclasses.replace(plan, nodes=nodes, workload=HOSTILE, optimizer=HOSTILE)

    page = report.render_html(hostile)

    assert HOSTILE not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    assert page.count("<script>") == 1  # the page's own legend script


@pytest.mark.parametrize("kind", ["ilp", "pipeline"])
def test_two_renders_are_byte_identical(plans, kind):  # noqa: ANN001
    assert report.render_html(plans[kind]) == report.render_html(plans[kind])


def test_report_command_in_another_process_writes_the_same_bytes(plans, tmp_path):  # noqa: ANN001
    """Through ``add_parser`` as the CLI wires it, with another string-hash seed."""
    plans["pipeline"].save(tmp_path / "plan.json")
    script = (
        "import argparse, sys; from autoplan.tools import report; p = argparse.ArgumentParser(); "
        "report.add_parser(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script, "report", str(tmp_path / "plan.json"), "-o", str(tmp_path / "plan.html")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"wrote {tmp_path / 'plan.html'}"
    loaded = Plan.load(tmp_path / "plan.json")
    assert (tmp_path / "plan.html").read_text(encoding="utf-8") == report.render_html(loaded)


def test_report_command_quiet_prints_nothing_and_returns_zero(plans, tmp_path, capsys):  # noqa: ANN001
    plans["ilp"].save(tmp_path / "plan.json")
    parser = argparse.ArgumentParser(prog="autoplan")
    sub = parser.add_subparsers()
    report.add_parser(sub)
    args = parser.parse_args(["report", str(tmp_path / "plan.json"), "--out", str(tmp_path / "r.html"), "--quiet"])

    assert args.func(args) == 0
    assert capsys.readouterr().out == ""
    assert (tmp_path / "r.html").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert "loads nothing from the network" in " ".join(sub.choices["report"].format_help().split())


def test_write_report_names_the_file_and_the_fix(plans, tmp_path):  # noqa: ANN001
    target = tmp_path / "missing" / "plan.html"

    with pytest.raises(PlanFileError, match=r"cannot write report .*missing/plan\.html.*create the directory"):
        report.write_report(plans["ilp"], target)


def test_write_report_replaces_the_file_atomically(plans, tmp_path):  # noqa: ANN001
    (tmp_path / "plan.html").write_text("old")

    report.write_report(plans["ilp"], tmp_path / "plan.html")

    assert (tmp_path / "plan.html").read_text(encoding="utf-8") == report.render_html(plans["ilp"])
    assert [p.name for p in tmp_path.iterdir()] == ["plan.html"]  # no temporary file left


# --- the charts' data --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "virtual_stages", "actions_per_microbatch"),
    [("gpipe", 1, 2), ("1f1b", 1, 2), ("interleaved-1f1b", 2, 2), ("zero-bubble", 1, 3)],
)
def test_gantt_draws_every_action_of_the_schedule(plans, schedule, virtual_stages, actions_per_microbatch):  # noqa: ANN001
    plan = _with_schedule(plans["pipeline"], schedule, virtual_stages=virtual_stages)

    page = report.render_html(plan)

    # pp ranks x v chunks x m micro-batches x (F, B[, W])
    assert len(re.findall(r"<title>rank \d · stage \d · [FBW] micro-batch", page)) == 2 * virtual_stages * 4 * (
        actions_per_microbatch
    )
    timeline, how = report.pipeline_timeline(plan)
    assert timeline.bubble_s > 0  # fill and drain are visible
    assert "stores no per-stage times" in how


def test_pipeline_timeline_busiest_rank_matches_the_estimated_compute(plans):  # noqa: ANN001
    timeline, _ = report.pipeline_timeline(plans["pipeline"])

    assert max(timeline.busy_s) == pytest.approx(plans["pipeline"].estimate.compute_s)


def test_memory_has_one_bar_per_pipeline_rank_and_the_peak_parts(plans):  # noqa: ANN001
    plan = plans["pipeline"]
    bars = report.memory_bars(plan)

    assert [label for label, _ in bars] == ["rank 0", "rank 1"]
    totals = [sum(b for _, b in parts) for _, parts in bars]
    assert totals == pytest.approx(list(plan.estimate.memory_per_device_bytes))
    assert {p for p, _ in bars[0][1]} >= {"weights", "optimizer", "activations"}


def test_ilp_memory_bar_adds_up_to_the_peak(plans):  # noqa: ANN001
    ((label, parts),) = report.memory_bars(plans["ilp"])

    assert label == "every device"
    assert sum(b for _, b in parts) == pytest.approx(plans["ilp"].estimate.memory_bytes["total"])


def test_time_parts_of_an_ilp_plan_add_up_to_the_step(plans):  # noqa: ANN001
    e = plans["ilp"].estimate
    parts = dict(report.time_parts(plans["ilp"]))

    assert parts["compute"] == pytest.approx(e.compute_s)  # a per-operator plan: the compute stream's
    assert sum(parts.values()) == pytest.approx(e.step_time_s, rel=1e-12)


def test_device_timeline_stalls_compute_for_exactly_the_exposed_communication(plans):  # noqa: ANN001
    plan = plans["pipeline"]
    plan = dataclasses.replace(plan, config=dataclasses.replace(plan.config, pp=1), pipeline=None)
    tl = report.device_timeline(plan)

    exposed = sum(b - a for a, b, is_exposed, _ in tl.comm if is_exposed)
    assert exposed == pytest.approx(plan.estimate.exposed_comm_s)
    assert sum(b - a for a, b in tl.compute) == pytest.approx(plan.estimate.compute_s)


def test_collective_table_counts_a_gradient_bucket_once(plans):  # noqa: ANN001
    plan = plans["pipeline"]
    rows = report.collective_rows(plan)

    assert sum(n for _, n, _, _, _ in rows) <= len(plan.collectives)
    assert sum(t for _, _, t, _, _ in rows) == pytest.approx(sum(c.time_s for c in plan.collectives))


def test_nodes_group_by_repeated_block_prefix_when_names_carry_one():
    names = ["embed", *(f"layers_{i}_{op}" for i in range(3) for op in ("q", "k", "mlp_fc")), "head"]

    groups = report.group_nodes(names, ["aten.mm.default"] * len(names))

    assert groups == [("other", 0, 1), ("layers_0", 1, 4), ("layers_1", 4, 7), ("layers_2", 7, 10), ("other", 10, 11)]


def test_nodes_without_block_names_group_into_forward_and_backward():
    ops = ["aten.mm.default", "aten.gelu.default", "aten.mse_loss_backward.default", "aten.mm.default"]

    groups = report.group_nodes(["mm", "gelu", "mse_loss_backward", "mm_1"], ops)

    assert groups == [("forward", 0, 2), ("backward", 2, 4)]


def test_two_thousand_operators_stay_a_compact_page(plans):  # noqa: ANN001
    node = next(iter(plans["ilp"].nodes.values()))
    nodes = {f"layers_{i // 100}_op_{i}": node for i in range(2000)}

    page = report.render_html(dataclasses.replace(plans["ilp"], nodes=nodes, collectives=()))

    assert page.count('class="c p') == 2000
    assert page.count('<div class="group">layers_') == 20
    assert len(page.encode()) < 1_000_000


# --- headless Chromium -------------------------------------------------------------------------


def _chromium() -> str:
    path = shutil.which("chromium") or "/usr/bin/chromium"
    return path if os.path.exists(path) else ""


@pytest.fixture(scope="module")
def browser_context(tmp_path_factory):  # noqa: ANN001, ANN201
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("no headless Chromium: pip install playwright and apt-get install chromium")
    executable = _chromium()
    if not executable:
        pytest.skip(
            "no headless Chromium: apt-get install chromium (binary /usr/bin/chromium) and pip install playwright"
        )
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),  # a fresh user-data dir
            executable_path=executable,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1040, "height": 900},
        )
        try:
            yield context
        finally:
            context.close()


@pytest.mark.parametrize("kind", ["ilp", "pipeline"])
def test_report_renders_in_headless_chromium(browser_context, plans, kind, tmp_path):  # noqa: ANN001
    html_path = tmp_path / f"report_{kind}.html"
    report.write_report(plans[kind], html_path)
    messages: list[str] = []
    requests: list[str] = []
    page = browser_context.new_page()
    page.on("console", lambda m: messages.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda exc: messages.append(f"page error: {exc}"))
    page.on("request", lambda r: requests.append(r.url))
    browser_context.route(re.compile(r"^(?!file:|data:|about:)"), lambda route: route.abort())

    page.goto(html_path.as_uri())
    page.wait_for_load_state("load")

    assert messages == []
    assert [u for u in requests if not u.startswith("file:")] == []
    charts = page.locator("svg.chart")
    assert charts.count() == 3
    for i in range(charts.count()):
        box = charts.nth(i).bounding_box()
        assert box is not None and box["width"] > 300 and box["height"] > 40
    for section in SECTIONS:
        assert page.locator(f"#{section}").is_visible()
    cells = page.locator("#ops .c")
    assert cells.count() == len(plans[kind].nodes)
    box = cells.first.bounding_box()
    assert box is not None and box["width"] > 0 and box["height"] > 0
    page.locator(".legend [data-p]").first.click()  # the inline script highlights a placement
    assert page.locator("#ops").get_attribute("data-only") == "0"
    shot = tmp_path / f"report_{kind}.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000
    assert messages == []
    page.close()


# --- the timeline is the step replay: compute and communication streams (issue #19) --------------


def _replayed(plan: Plan) -> Plan:
    """The ILP plan with two collectives as the step replay would record them, 6 ms step, 4.5 ms
    compute: a gradient reduce-scatter issued at 1 ms that finishes at 3 ms while compute runs
    (hidden), and an operand all-gather on the link 4..5.5 ms that the compute stream waits for
    from 4 ms (exposed 1.5 ms)."""
    grad = CollectiveRecord(
        producer="mm", consumer="p_w", arg_index=-1, src=("P",), dst=("S(0)",), steps=(("reduce_scatter", 0),),
        time_s=2e-3, overlappable=True, exposed_s=0.0, issue_s=1e-3, finish_s=3e-3,
    )  # fmt: skip
    gather = CollectiveRecord(
        producer="p_v", consumer="mm_2", arg_index=1, src=("S(0)",), dst=("R",), steps=(("all_gather", 0),),
        time_s=1.5e-3, exposed_s=1.5e-3, issue_s=4e-3, finish_s=5.5e-3,
    )  # fmt: skip
    estimate = dataclasses.replace(
        plan.estimate, step_time_s=6e-3, compute_s=4.5e-3, comm_s=3.5e-3, exposed_comm_s=1.5e-3
    )
    return dataclasses.replace(plan, collectives=(grad, gather), estimate=estimate)


def test_timeline_draws_a_hidden_collective_under_compute_and_an_exposed_one_as_a_wait(plans):  # noqa: ANN001
    plan = _replayed(plans["ilp"])
    tl = report.stream_timeline(plan)

    assert tl is not None
    assert tl.compute == ((0.0, 4e-3), (5.5e-3, 6e-3))  # the compute stream waits 4..5.5 ms
    assert tl.waits == ((4e-3, 5.5e-3),)
    pieces = {what.split(":")[0]: report._split_by_waits(a, b, tl.waits) for a, b, _, what in tl.comm}  # noqa: SLF001
    assert pieces == {"reduce_scatter": [(1e-3, 3e-3, False)], "all_gather": [(4e-3, 5.5e-3, True)]}
    page = report.render_html(plan)
    assert "compute stream" in page and f"comm {plan.placement_axis_names[0]}" in page
    assert page.count('class="comm"') == 2
    assert "hidden 2 ms of reduce_scatter" in page and "exposed 1.5 ms of all_gather" in page


def test_timeline_of_a_planned_step_waits_exactly_the_exposed_communication():
    plan = zoo.plan_workload(zoo.on_meta(zoo.gpt2_4_layers), "4xCPU")
    e = plan.estimate
    tl = report.stream_timeline(plan)

    assert tl is not None and tl.comm
    assert sum(b - a for a, b in tl.waits) == pytest.approx(e.exposed_comm_s)
    assert sum(b - a for a, b in tl.compute) == pytest.approx(e.step_time_s - e.exposed_comm_s)
    assert "Timeline: compute and communication streams" in report.render_html(plan)


def test_a_plan_without_replay_times_gets_the_schematic_said_to_be_one(plans):  # noqa: ANN001
    old = dataclasses.replace(
        plans["ilp"],
        collectives=tuple(
            dataclasses.replace(c, issue_s=None, finish_s=None) for c in _replayed(plans["ilp"]).collectives
        ),
    )

    assert report.stream_timeline(old) is None
    assert "Timeline (schematic)" in report.render_html(old)


def test_report_has_the_whole_step_communication_per_kind_and_axis_with_its_sum(plans):  # noqa: ANN001
    plan = plans["pipeline"]
    e = plan.estimate
    page = report.render_html(plan)
    table = page.split('<table id="comm">')[1].split("</table>")[0]

    assert e.comm.rows and e.comm.total_s == pytest.approx(e.comm_s)
    assert table.count("<tr>") == 1 + len(e.comm.rows) + 1  # header, rows, sum
    assert "= the estimate&#x27;s communication" in page
    assert "per traced block and micro-batch" in page
