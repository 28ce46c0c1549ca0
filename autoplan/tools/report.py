"""``autoplan report``: one self-contained HTML page that shows a plan for review.

    autoplan plan my_models.py:build --cluster 4x8xH100 --global-batch-size 512 -o plan.json
    autoplan report plan.json -o plan.html

The page loads nothing: inline CSS, inline SVG and a few lines of inline script (clicking a
placement in the legend dims the other operators). Every string taken from the plan is escaped,
and the output is deterministic: the same plan gives the same bytes (no timestamps, no set
iteration). Sections, top to bottom:

1. **Summary**: fingerprint, cluster, devices, configuration, estimated step, MFU, tokens/s, solver.
2. **Placements**: the pipeline stages with their segments and recomputation (pipeline plans),
   and every operator of ``plan.nodes`` in program order as a cell coloured by the placement of
   its first tensor output, grouped by repeated-block prefix when the node names carry one, else
   by forward / backward.
3. **Schedule**: pipeline plans get a Gantt chart per pipeline rank from
   :func:`autoplan.cost_models.schedule.simulate`; other plans a single-device timeline of compute and
   communication.
4. **Memory**: peak bytes per device by part against the capacity, one bar per pipeline rank.
5. **Time**: compute / exposed communication / bubble of the step, and the collectives by kind.

The plan does not store per-operator or per-stage times nor a memory timeline (that needs the
traced graph, ``autoplan.passes.liveness``); what the charts approximate is said in each caption.
"""

from __future__ import annotations

import argparse
import html
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from autoplan.cost_models.cluster import COLLECTIVE_KINDS
from autoplan.cost_models.config import SCHEDULES, ScheduleName
from autoplan.cost_models.files import atomic_write, refuse_overwriting_inputs
from autoplan.cost_models.schedule import PipelineTimeline, StageTimes, simulate
from autoplan.planner.plan import CollectiveRecord, Plan, exposed_within_own_time
from autoplan.tools import console
from autoplan.tools.review import comm_sum_note

CHART_WIDTH_PX = 960
LABEL_WIDTH_PX = 110
MAX_TITLED_BARS = 3000
"""Bars beyond this count get no hover title (keeps very long schedules to a few MB)."""
BACKWARD_TO_FORWARD = 2.0
"""Backward / forward time of one micro-batch when the plan has no per-stage times (a matmul's
backward is two matmuls of the forward's size: Narayanan et al., SC 2021, sec. 3.5)."""

_PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f")
"""Tableau 10 without its grey (kept for non-tensor outputs); more placements get golden-angle hues."""
_NONE_COLOUR = "#d0d0d0"
_ACTION_COLOURS = {"F": ("#4e79a7", "#a0cbe8"), "B": ("#f28e2b", "#ffbe7d"), "W": ("#59a14f", "#8cd17d")}
"""Per action kind: colour of chunk 0, 1 (alternating) on a pipeline rank."""
_IDLE_COLOUR = "#f3d3d3"
_TAIL_COLOUR = "#bab0ac"
_HIDDEN_COLOUR = "#f1a7a9"
_MEMORY_COLOURS = {
    "params": "#4e79a7", "weights": "#4e79a7", "grads": "#f28e2b", "optimizer": "#b07aa1", "buffers": "#9c755f",
    "inputs": "#76b7b2", "activations": "#59a14f", "transient": "#ff9da7", "allocator": "#edc948", "other": "#d7ccc8",
}  # fmt: skip
_TIME_COLOURS = {
    "compute": "#4e79a7", "exposed communication": "#e15759", "pipeline bubble": "#f3a3a3", "optimizer step": "#bab0ac",
    "step (not broken down)": "#d0d0d0",
}  # fmt: skip
"""Per part of the step (``StepParts.rows``)."""
_BLOCK_PREFIX = re.compile(r"^(.*?[._]\d+)[._]")
"""A node name inside a repeated block, e.g. ``layers_3_mlp_fc1`` -> ``layers_3``."""

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#222;margin:0;background:#fafafa}
main{max-width:1000px;margin:0 auto;padding:16px 20px 40px}
h1{font-size:22px;margin:8px 0 4px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd}
h3{font-size:15px;margin:16px 0 6px}.sub{color:#666;margin:0 0 12px}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:12px 0}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 12px;flex:1 1 auto;min-width:110px}
.card b{display:block;font-size:18px}.card span{color:#666;font-size:12px}
table{border-collapse:collapse;background:#fff;margin:6px 0;font-size:13px}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
figure{margin:10px 0 18px;background:#fff;border:1px solid #ddd;border-radius:6px;padding:10px}
figcaption{color:#555;font-size:12.5px;margin-top:6px}svg{display:block;max-width:100%;height:auto}
svg text{font:11px system-ui,sans-serif;fill:#333}
.stages{display:flex;flex-wrap:wrap;gap:8px}
.stage{background:#fff;border:2px solid #999;border-radius:6px;padding:6px 8px;min-width:150px}
.stage .seg{display:inline-block;background:#eef2f7;border-radius:3px;padding:0 5px;margin:2px 2px 0 0;font-size:12px}
.stage .rc{font-size:12px;color:#a33}
.legend{display:flex;flex-wrap:wrap;gap:6px 14px;margin:6px 0;font-size:12.5px}
.legend [data-p]{cursor:pointer}.key{display:inline-block;width:12px;height:12px;border-radius:2px;
vertical-align:-2px;margin-right:4px;border:1px solid rgba(0,0,0,.15)}
.group{margin:6px 0 2px;font-size:12px;color:#555}
.cells{display:flex;flex-wrap:wrap;gap:1px}.c{display:block;width:9px;height:13px;border-radius:1px}
details{margin:6px 0}summary{cursor:pointer;color:#444}code{font-size:12.5px}
"""
_SCRIPT = """
document.querySelectorAll('.legend [data-p]').forEach(function (item) {
  item.addEventListener('click', function () {
    var ops = document.getElementById('ops');
    var p = item.getAttribute('data-p');
    ops.setAttribute('data-only', ops.getAttribute('data-only') === p ? '' : p);
  });
});
"""


# --------------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------------


def _e(value: object) -> str:
    """Escaped text for HTML content and attribute values."""
    return html.escape(str(value), quote=True)


def _px(x: float) -> str:
    """An SVG coordinate: two decimals at most, no trailing zeros."""
    text = f"{x:.2f}".rstrip("0").rstrip(".")
    return "0" if text in ("", "-0") else text


def fmt_s(seconds: float) -> str:
    """Seconds with a readable unit: ``1.23 s``, ``12.3 ms``, ``123 us``."""
    a = abs(seconds)
    if a >= 1.0:
        return f"{seconds:.3g} s"
    if a >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    if a >= 1e-6 or a == 0.0:
        return f"{seconds * 1e6:.3g} µs"
    return f"{seconds * 1e9:.3g} ns"


def fmt_bytes(num_bytes: float) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.3g} {unit}"
    return f"{num_bytes:.0f} B"


def _percent(fraction: float) -> str:
    return "< 0.001%" if 0 < fraction < 1e-5 else f"{100 * fraction:.3g}%"


def _ticks(vmax: float, count: int = 5) -> list[float]:
    """Round tick values 0, step, 2 step, ... <= vmax (step 1, 2 or 5 times a power of ten)."""
    if vmax <= 0:
        return [0.0]
    raw = vmax / count
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [i * step for i in range(int(vmax / step + 1e-9) + 1)]


def _colour(index: int) -> str:
    if index < len(_PALETTE):
        return _PALETTE[index]
    return f"hsl({(index * 137.5) % 360:.0f},55%,58%)"


def _rect(x: float, y: float, w: float, h: float, fill: str, title: str = "", extra: str = "") -> str:
    tip = f"<title>{_e(title)}</title>" if title else ""
    return (
        f'<rect x="{_px(x)}" y="{_px(y)}" width="{_px(max(w, 0.0))}" height="{_px(h)}" fill="{fill}"{extra}>'
        f"{tip}</rect>"
    )


def _text(x: float, y: float, text: str, anchor: str = "start", extra: str = "") -> str:
    return f'<text x="{_px(x)}" y="{_px(y)}" text-anchor="{anchor}"{extra}>{_e(text)}</text>'


def _svg(width: float, height: float, body: Sequence[str], label: str) -> str:
    return (
        f'<svg class="chart" width="{_px(width)}" height="{_px(height)}" viewBox="0 0 {_px(width)} {_px(height)}" '
        f'role="img" aria-label="{_e(label)}">' + "".join(body) + "</svg>"
    )


def _figure(section_id: str, title: str, body: str, caption: str) -> str:
    return f'<section id="{section_id}"><h2>{_e(title)}</h2><figure>{body}<figcaption>{caption}</figcaption></figure></section>'


def _legend(items: Sequence[tuple[str, str]]) -> str:
    return (
        '<div class="legend">'
        + "".join(f'<span><i class="key" style="background:{c}"></i>{_e(label)}</span>' for label, c in items)
        + "</div>"
    )


def _time_axis(total_s: float, x0: float, width: float, y: float) -> list[str]:
    out = [f'<line x1="{_px(x0)}" y1="{_px(y)}" x2="{_px(x0 + width)}" y2="{_px(y)}" stroke="#999"/>']
    for t in _ticks(total_s, 8):
        x = x0 + width * t / total_s
        out.append(f'<line x1="{_px(x)}" y1="{_px(y)}" x2="{_px(x)}" y2="{_px(y + 4)}" stroke="#999"/>')
        out.append(_text(x, y + 15, fmt_s(t), "middle"))
    return out


# --------------------------------------------------------------------------------------------
# 1. Summary
# --------------------------------------------------------------------------------------------


def _summary_section(plan: Plan) -> str:
    c, e = plan.cluster, plan.estimate
    cards = [("estimated step", fmt_s(e.step_time_s))]
    if e.mfu is not None:
        cards.append(("MFU", f"{e.mfu:.1%}"))
    if e.tokens_per_s is not None:
        cards.append(("tokens/s", f"{e.tokens_per_s:,.0f}"))
    cards += [
        ("peak memory / device", f"{fmt_bytes(e.memory_bytes['total'])} of {fmt_bytes(e.capacity_bytes)}"),
        ("devices", f"{c.world_size} × {c.device.name}"),
        ("solver", str(plan.solver["status"])),
    ]
    solver = plan.solver
    facts: list[tuple[str, str]] = [
        ("model fingerprint", plan.fingerprint),
        ("workload", plan.workload or "(planned from Python)"),
        ("cluster", f"{c} — {c.num_nodes} node(s) × {c.devices_per_node} {c.device.name}"),
        ("mesh", ", ".join(f"{n}={s}" for n, s in zip(c.mesh_axis_names, c.mesh_shape, strict=True))),
        ("configuration", str(plan.config) if plan.config is not None else "ILP placement over the whole mesh"),
        ("optimizer", plan.optimizer),
        (
            "estimate",
            f"step {fmt_s(e.step_time_s)}"
            + (
                " = " + " + ".join(f"{name} {fmt_s(t)}" for name, t in e.parts.rows())
                if e.parts is not None
                else " (not broken down in this plan file: re-plan to see its parts)"
            )
            + f"; communication {fmt_s(e.comm_s)}"
            + (f", of which exposed {fmt_s(e.exposed_comm_s)} in its rows" if e.exposed_comm_s is not None else ""),
        ),
        ("op times", ", ".join(f"{v} {k}" for k, v in e.compute_sources.items()) or "analytic"),
        ("links", c.links_source),
        (
            "solver",
            f"{solver['status']}"
            + (f", {solver['method']}" if "method" in solver else "")
            + (f", gap {solver['gap']:.3g}" if isinstance(solver.get("gap"), (int, float)) else "")
            + f", {solver['num_variables']} variables, {solver['num_constraints']} constraints",
        ),
        ("versions", ", ".join(f"{k} {v}" for k, v in plan.versions.items()) or "unknown"),
    ]
    if plan.fallback_ops:
        facts.append(("replicated fallback ops", ", ".join(sorted(dict.fromkeys(plan.fallback_ops.values())))))
    params = "".join(
        f"<tr><td><code>{_e(n)}</code></td><td><code>{_e(','.join(plan.param_specs[n]))}</code></td></tr>"
        for n in plan.param_names
    )
    sources = "".join(f"<li>{_e(s)}</li>" for s in c.device.sources)
    return (
        f'<header id="summary"><h1>autoplan plan <code>{_e(plan.fingerprint)}</code></h1>'
        f'<p class="sub">{_e(c)} · {c.world_size} devices · '
        f"{_e(plan.config) if plan.config is not None else 'ILP plan'}</p>"
        '<div class="cards">'
        + "".join(f"<div class=card><b>{_e(v)}</b><span>{_e(k)}</span></div>" for k, v in cards)
        + "</div><table>"
        + "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in facts)
        + f"</table><details><summary>parameter placements ({len(plan.param_names)})</summary>"
        f"<table><tr><th>parameter</th><th>placement</th></tr>{params}</table></details>"
        f"<details><summary>device numbers: sources</summary><ul>{sources}</ul></details></header>"
    )


# --------------------------------------------------------------------------------------------
# 2. Placements: pipeline stages and operators
# --------------------------------------------------------------------------------------------


def output_placement(node: Mapping[str, Any]) -> str:
    """Placement of a node's first tensor output, e.g. ``S(0),R`` (``none``: no tensor output)."""
    return next((",".join(spec) for spec in node["out"] if spec is not None), "none")


def group_nodes(names: Sequence[str], ops: Sequence[str]) -> list[tuple[str, int, int]]:
    """Contiguous ``(label, start, stop)`` runs of nodes: by repeated-block prefix when most names
    carry one (``layers_3_mlp`` -> ``layers_3``), else forward / backward (the backward starts at
    the first op whose name contains ``backward``)."""
    keys = [(m.group(1) if (m := _BLOCK_PREFIX.match(n)) else "") for n in names]
    if len(dict.fromkeys(k for k in keys if k)) >= 2 and sum(1 for k in keys if k) >= 0.3 * len(names):
        runs: list[tuple[str, int, int]] = []
        for i, key in enumerate(keys):
            if runs and runs[-1][0] == (key or "other"):
                runs[-1] = (runs[-1][0], runs[-1][1], i + 1)
            else:
                runs.append((key or "other", i, i + 1))
        if len(runs) <= 200:
            return runs
    first_bwd = next((i for i, op in enumerate(ops) if "backward" in op), len(names))
    groups = [("forward", 0, first_bwd), ("backward", first_bwd, len(names))]
    return [g for g in groups if g[2] > g[1]]


def _stage_view(plan: Plan) -> str:
    layout, cfg = plan.pipeline, plan.config
    if layout is None or cfg is None:
        axes = "; ".join(
            f"{_e(name)}={size}: {_e(kind)}"
            for (name, kind), size in zip(plan.parallelism().items(), plan.cluster.mesh_shape, strict=True)
        )
        return f"<h3>Mesh</h3><p>{axes}</p>"
    boxes = []
    mesh = ", ".join(f"{n}={s}" for n, s in zip(layout.stage_axis_names, layout.stage_mesh_shape, strict=True))
    for k, (segments, recompute) in enumerate(zip(layout.stage_segments(), layout.stage_recompute, strict=True)):
        rank = k % cfg.pp
        dp = f" · dp={cfg.stage_dp[k]}" if cfg.stage_dp is not None and k < len(cfg.stage_dp) else ""
        boxes.append(
            f'<div class="stage" style="border-color:{_colour(rank)}"><b>stage {k}</b> · rank {rank}{dp}<br>'
            + "".join(f'<span class="seg">{_e(s)}</span>' for s in segments)
            + f'<br><span class="rc">recompute: {_e(recompute)}</span></div>'
        )
    reduced = (
        f" Placements were solved on {layout.traced_blocks} traced blocks; the last stands for the others."
        if layout.reduced
        else ""
    )
    return (
        f"<h3>Pipeline stages</h3><div class=stages>{''.join(boxes)}</div>"
        f'<p class="sub">{cfg.pp} pipeline ranks × {cfg.virtual_stages} chunk(s); each stage runs on a stage '
        f"mesh ({_e(mesh)}), global batch {layout.global_batch_size}, {_e(layout.precision)}.{_e(reduced)} "
        "Box border: pipeline rank (colours as in the schedule rows).</p>"
    )


def _placement_section(plan: Plan) -> tuple[str, str]:
    """The section and its CSS (a colour class per placement, and the legend's highlight rules)."""
    names = list(plan.nodes)
    placements = [output_placement(plan.nodes[n]) for n in names]
    counts: dict[str, int] = {}
    for p in placements:
        counts[p] = counts.get(p, 0) + 1
    order = sorted((p for p in counts if p != "none"), key=lambda p: (-counts[p], p))
    if "none" in counts:
        order.append("none")
    index = {p: i for i, p in enumerate(order)}
    colours = {p: (_NONE_COLOUR if p == "none" else _colour(i)) for i, p in enumerate(order)}
    css = "".join(f".p{i}{{background:{colours[p]}}}" for p, i in index.items())
    css += "".join(f'#ops[data-only="{i}"] .c:not(.p{i}){{opacity:.12}}' for i in index.values())
    legend = (
        '<div class="legend">'
        + "".join(
            f'<span data-p="{index[p]}" title="click to highlight"><i class="key p{index[p]}"></i>'
            f"<code>{_e(p)}</code> ×{counts[p]}</span>"
            for p in order
        )
        + "</div>"
    )
    groups = []
    for label, start, stop in group_nodes(names, [str(plan.nodes[n]["op"]) for n in names]):
        cells = []
        for i in range(start, stop):
            d = plan.nodes[names[i]]
            tip = (
                f"{names[i]}\nop: {d['op']}\nout: "
                + "; ".join("-" if s is None else ",".join(s) for s in d["out"])
                + "\nin: "
                + "; ".join(",".join(s) for s in d["in"])
            )
            cells.append(f'<i class="c p{index[placements[i]]}" title="{_e(tip)}"></i>')
        groups.append(
            f'<div class="group">{_e(label)} · nodes {start}–{stop - 1} ({stop - start})</div>'
            f'<div class="cells">{"".join(cells)}</div>'
        )
    mesh = plan.placement_axis_names
    body = (
        f"{_stage_view(plan)}<h3>Operators ({len(names)})</h3>{legend}"
        f'<div id="ops" data-only="">{"".join(groups)}</div>'
    )
    caption = (
        f"Each cell is one operator of the training step in program order, coloured by the placement of its "
        f"first tensor output, one entry per mesh axis ({_e(', '.join(mesh))}): R replicated, S(d) sharded "
        "along tensor dim d, P partial sum. Hover a cell for its name, op and input/output placements; click a "
        "legend entry to highlight its operators."
    )
    return _figure("placements", "Placements", body, caption), css


# --------------------------------------------------------------------------------------------
# 3. Schedule
# --------------------------------------------------------------------------------------------


def pipeline_timeline(plan: Plan) -> tuple[PipelineTimeline, str]:
    """Simulate the plan's schedule (``autoplan.cost_models.schedule.simulate``) with uniform stages sized
    from the estimate, and say how in one sentence (the plan stores no per-stage times).

    Every stage gets ``f + B = compute_s / (m v)`` (``compute_s`` is the busiest rank's compute:
    m micro-batches over its v chunks) with ``B = 2 f``; zero-bubble splits B evenly into input
    and weight gradients. Transfers are left out (they are in the exposed communication)."""
    cfg = plan.config
    assert cfg is not None and cfg.pp > 1, "pipeline_timeline needs a pipeline plan"
    m, v = cfg.num_microbatches, cfg.virtual_stages
    name = cfg.schedule.replace("_", "-")
    schedule = cast(ScheduleName, name if name in SCHEDULES else "1f1b")
    per_stage_s = plan.estimate.compute_s / (m * v)
    fwd_s = per_stage_s / (1.0 + BACKWARD_TO_FORWARD)
    bwd_s = per_stage_s - fwd_s
    stage = StageTimes(fwd_s=fwd_s, bwd_input_s=bwd_s / 2, bwd_weight_s=bwd_s / 2)
    timeline = simulate([stage] * (cfg.pp * v), schedule, m, num_ranks=cfg.pp, p2p_s=0.0, virtual_stages=v)
    how = (
        f"The plan stores no per-stage times: every stage is drawn with forward {fmt_s(fwd_s)} and backward "
        f"{fmt_s(bwd_s)} per micro-batch (the busiest rank's compute {fmt_s(plan.estimate.compute_s)} over "
        f"{m} micro-batches × {v} chunk(s), backward = {BACKWARD_TO_FORWARD:g} × forward, recomputation inside "
        "the backward); activation transfers are not drawn."
    )
    return timeline, how


def _gantt(plan: Plan) -> tuple[str, str]:
    cfg, e = plan.config, plan.estimate
    assert cfg is not None
    timeline, how = pipeline_timeline(plan)
    tail_s = max(0.0, e.step_time_s - timeline.step_s)
    total_s = timeline.step_s + tail_s
    row_h, gap, top = 24.0, 6.0, 4.0
    x0, width = LABEL_WIDTH_PX, CHART_WIDTH_PX - LABEL_WIDTH_PX - 10
    scale = width / total_s if total_s > 0 else 0.0
    titled = sum(len(r) for r in timeline.actions) <= MAX_TITLED_BARS
    body: list[str] = []
    for rank, actions in enumerate(timeline.actions):
        y = top + rank * (row_h + gap)
        body.append(_text(x0 - 8, y + row_h / 2 + 4, f"rank {rank}", "end", f' style="fill:{_colour(rank)}"'))
        body.append(_rect(x0, y, timeline.step_s * scale, row_h, _IDLE_COLOUR, "idle (bubble)"))
        for ta in actions:
            a = ta.action
            chunk = a.stage // cfg.pp
            fill = _ACTION_COLOURS[a.kind][chunk % 2]
            w = (ta.end_s - ta.start_s) * scale
            tip = (
                f"rank {rank} · stage {a.stage} · {a.kind} micro-batch {a.microbatch} · "
                f"{fmt_s(ta.start_s)}–{fmt_s(ta.end_s)}"
                if titled
                else ""
            )
            body.append(_rect(x0 + ta.start_s * scale, y, w, row_h, fill, tip, ' stroke="#fff" stroke-width="0.5"'))
            if w >= 14:
                colour = ' style="fill:#fff"' if chunk % 2 == 0 else ""
                mid = x0 + (ta.start_s + ta.end_s) / 2 * scale
                body.append(_text(mid, y + row_h / 2 + 4, str(a.microbatch), "middle", colour))
        if tail_s > 0:
            body.append(_rect(x0 + timeline.step_s * scale, y, tail_s * scale, row_h, _TAIL_COLOUR, "rest of the step"))
    axis_y = top + cfg.pp * (row_h + gap)
    body += _time_axis(total_s, x0, width, axis_y)
    svg = _svg(CHART_WIDTH_PX, axis_y + 24, body, "pipeline schedule")
    legend_items = [("forward (F)", _ACTION_COLOURS["F"][0]), ("backward (B)", _ACTION_COLOURS["B"][0])]
    if timeline.schedule == "zero-bubble":
        legend_items = [("forward (F)", _ACTION_COLOURS["F"][0]), ("input grad (B)", _ACTION_COLOURS["B"][0]),
                        ("weight grad (W)", _ACTION_COLOURS["W"][0])]  # fmt: skip
    if cfg.virtual_stages > 1:
        legend_items.append(("odd chunks: lighter", _ACTION_COLOURS["F"][1]))
    legend_items.append(("idle (bubble)", _IDLE_COLOUR))
    if tail_s > 0:
        legend_items.append(("grad sync, optimizer, rest of the step", _TAIL_COLOUR))
    end = (
        f"The grey tail fills up to the estimated step {fmt_s(e.step_time_s)}."
        if tail_s > 0
        else f"The estimated step is {fmt_s(e.step_time_s)} (the planner prices each stage on its own)."
    )
    bubble = f"plan's bubble {fmt_s(e.bubble_s)}" if e.bubble_s is not None else "the plan has no bubble estimate"
    caption = (
        f"{_e(timeline.schedule)} schedule, {cfg.pp} ranks, {cfg.num_microbatches} micro-batches"
        f"{f', {cfg.virtual_stages} chunks per rank' if cfg.virtual_stages > 1 else ''}, simulated with "
        f"<code>autoplan.cost_models.schedule.simulate</code>: simulated makespan {fmt_s(timeline.step_s)}, bubble "
        f"{fmt_s(timeline.bubble_s)} ({_e(bubble)}); numbers in bars are micro-batches. {_e(how)} {end}"
    )
    return _legend(legend_items) + svg, caption


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceTimeline:
    """One device's step without a pipeline, as drawn: compute and communication intervals (s)."""

    compute: tuple[tuple[float, float], ...]
    comm: tuple[tuple[float, float, bool, str], ...]
    """(start, end, exposed, what) per collective."""
    end_s: float
    comm_scale: float
    """Factor applied to the collectives' times so their exposed part adds up to the estimate's."""


def device_timeline(plan: Plan) -> DeviceTimeline:
    """Compute spread evenly over the operators (the plan stores no per-operator times), repeated
    per micro-batch; each operand conversion just before its consumer, gradient reductions (and
    buckets) at the end. The exposed part of a collective stalls compute, the hidden part runs
    alongside the compute before it. Collective times are scaled so that the exposed parts add up
    to the estimate's exposed communication; a shortfall is drawn at the end."""
    e = plan.estimate
    names = list(plan.nodes)
    m = plan.config.num_microbatches if plan.config is not None else 1
    by_consumer: dict[str, list[CollectiveRecord]] = {}
    at_end: list[CollectiveRecord] = []
    for c in plan.collectives:
        (by_consumer.setdefault(c.consumer, []) if c.consumer in plan.nodes and c.bucket is None else at_end).append(c)

    def exposed_of(c: CollectiveRecord) -> float:
        return c.time_s if c.exposed_s is None else min(c.exposed_s, c.time_s)

    exposed_total = e.exposed_comm_s if e.exposed_comm_s is not None else e.comm_s
    listed = m * sum(exposed_of(c) for cs in by_consumer.values() for c in cs) + sum(map(exposed_of, at_end))
    k = exposed_total / listed if listed > exposed_total > 0 else 1.0
    compute: list[tuple[float, float]] = []
    comm: list[tuple[float, float, bool, str]] = []
    t = seg_start = 0.0

    def stall(duration: float, what: str) -> None:
        nonlocal t, seg_start
        if t > seg_start:
            compute.append((seg_start, t))
        comm.append((t, t + duration, True, what))
        t = seg_start = t + duration

    def run(c: CollectiveRecord) -> None:
        exposed, hidden = k * exposed_of(c), k * (c.time_s - exposed_of(c))
        what = (
            f"{'+'.join(s for s, _ in c.steps)}: {c.producer} -> {c.consumer} ({','.join(c.src)} -> {','.join(c.dst)})"
        )
        if hidden > 0:
            comm.append((max(0.0, t - hidden), t, False, what))
        if exposed > 0:
            stall(exposed, what)

    dt = e.compute_s / (m * max(len(names), 1))
    for _ in range(m):
        for n in names:
            for c in by_consumer.get(n, ()):
                run(c)
            t += dt
    for c in at_end:
        run(c)
    rest = exposed_total - sum(b - a for a, b, exposed, _ in comm if exposed)
    if rest > 1e-3 * e.step_time_s:
        stall(rest, "other exposed communication")
    if t > seg_start:
        compute.append((seg_start, t))
    return DeviceTimeline(compute=tuple(compute), comm=tuple(comm), end_s=t, comm_scale=k)


def _single_device_chart(plan: Plan) -> tuple[str, str]:
    e = plan.estimate
    tl = device_timeline(plan)
    total_s = max(tl.end_s, e.step_time_s)
    row_h, gap, top = 24.0, 6.0, 4.0
    x0, width = LABEL_WIDTH_PX, CHART_WIDTH_PX - LABEL_WIDTH_PX - 10
    scale = width / total_s if total_s > 0 else 0.0
    titled = len(tl.comm) <= MAX_TITLED_BARS
    body = [
        _text(x0 - 8, top + row_h / 2 + 4, "compute", "end"),
        _text(x0 - 8, top + row_h * 1.5 + gap + 4, "communication", "end"),
        _rect(x0, top, tl.end_s * scale, row_h, _IDLE_COLOUR, "compute waits for communication"),
    ]
    for a, b in tl.compute:
        tip = f"compute {fmt_s(a)}–{fmt_s(b)}"
        body.append(_rect(x0 + a * scale, top, (b - a) * scale, row_h, _TIME_COLOURS["compute"], tip))
    for a, b, exposed, what in tl.comm:
        fill = _TIME_COLOURS["exposed communication"] if exposed else _HIDDEN_COLOUR
        tip = f"{'exposed' if exposed else 'hidden'} {fmt_s(b - a)}: {what}" if titled else ""
        body.append(_rect(x0 + a * scale, top + row_h + gap, max((b - a) * scale, 0.75), row_h, fill, tip))
    axis_y = top + 2 * (row_h + gap)
    body += _time_axis(total_s, x0, width, axis_y)
    svg = _svg(CHART_WIDTH_PX, axis_y + 24, body, "single-device timeline")
    legend = _legend([("compute", _TIME_COLOURS["compute"]), ("exposed communication (compute waits)",
                      _TIME_COLOURS["exposed communication"]), ("communication hidden behind compute", _HIDDEN_COLOUR),
                      ("compute waiting", _IDLE_COLOUR)])  # fmt: skip
    m = plan.config.num_microbatches if plan.config is not None else 1
    scaled = (
        f" Collective times are scaled by {tl.comm_scale:.3g} to add up to the estimate's exposed communication."
        if tl.comm_scale != 1.0
        else ""
    )
    caption = (
        f"No pipeline: one device's step of {fmt_s(e.step_time_s)}"
        f"{f' ({m} micro-batches, gradient accumulation)' if m > 1 else ''}. Schematic, not the replay: this plan "
        "records no issue and finish time per collective (a joint-search plan's collectives are one stage program's; "
        f"older plan files have none) and no per-operator times, so the compute {fmt_s(e.compute_s)} is spread evenly "
        f"over the {len(plan.nodes)} operators; each operand conversion runs just before its consumer and the gradient reductions at the end; "
        f"their exposed part stalls compute.{scaled}"
    )
    return legend + svg, caption


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamTimeline:
    """One device's step as the step replay (:mod:`autoplan.passes.overlap`) ran it."""

    compute: tuple[tuple[float, float], ...]
    """When the compute stream computes (s)."""
    waits: tuple[tuple[float, float], ...]
    """When it waits for communication: ``[finish - exposed, finish]`` of each collective waited for."""
    comm: tuple[tuple[float, float, str, str], ...]
    """``(issue, finish, mesh axis, what)`` of each collective on the communication stream
    (a gradient bucket once)."""
    end_s: float


def stream_timeline(plan: Plan) -> StreamTimeline | None:
    """The replayed step of a plan on a fixed mesh whose collectives carry their issue and finish
    times (``None`` for pipeline plans, whose collectives are one stage program's, and for plan
    files from before the times were recorded)."""
    recs = plan.collectives
    if plan.pipeline is not None or any(c.issue_s is None or c.finish_s is None for c in recs):
        return None
    axes = plan.placement_axis_names
    waited: dict[str | int, tuple[float, float]] = {}  # collective (a bucket once) -> (finish, wait)
    for j, c in enumerate(recs):
        if c.exposed_s and c.finish_s is not None:
            key = c.bucket if c.bucket is not None else j
            waited[key] = (c.finish_s, waited.get(key, (0.0, 0.0))[1] + c.exposed_s)  # members share the wait
    waits = [(max(0.0, finish - wait), finish) for finish, wait in waited.values()]
    merged: list[tuple[float, float]] = []
    for a, b in sorted(waits):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    end = plan.estimate.step_time_s
    compute, t = [], 0.0
    for a, b in merged:
        if a > t:
            compute.append((t, a))
        t = max(t, b)
    if end > t:
        compute.append((t, end))
    comm, seen = [], set()
    for c in recs:
        assert c.issue_s is not None and c.finish_s is not None  # checked above
        if c.finish_s <= c.issue_s or (c.bucket is not None and c.bucket in seen):
            continue
        if c.bucket is not None:
            seen.add(c.bucket)
        names = sorted({axes[a] for k, a in c.steps if 0 <= a < len(axes) and k in COLLECTIVE_KINDS}) or ["local"]
        what = f"{'+'.join(k for k, _ in c.steps)}: {c.producer} -> {c.consumer}" + (
            f" (bucket {c.bucket})" if c.bucket else ""
        )
        comm.append((c.issue_s, c.finish_s, ",".join(names), what))
    return StreamTimeline(compute=tuple(compute), waits=tuple(merged), comm=tuple(comm), end_s=max(end, t))


def _split_by_waits(a: float, b: float, waits: Sequence[tuple[float, float]]) -> list[tuple[float, float, bool]]:
    """``[a, b]`` cut into pieces during a wait of the compute stream (exposed) and not (hidden)."""
    out, t = [], a
    for wa, wb in waits:
        if wb <= t or wa >= b:
            continue
        if wa > t:
            out.append((t, wa, False))
        out.append((max(t, wa), min(b, wb), True))
        t = min(b, wb)
    if t < b:
        out.append((t, b, False))
    return out


def _stream_chart(plan: Plan, tl: StreamTimeline) -> tuple[str, str]:
    e = plan.estimate
    streams = sorted({axis for _, _, axis, _ in tl.comm})
    row_h, gap, top = 24.0, 6.0, 4.0
    x0, width = LABEL_WIDTH_PX, CHART_WIDTH_PX - LABEL_WIDTH_PX - 10
    scale = width / tl.end_s if tl.end_s > 0 else 0.0
    titled = len(tl.comm) <= MAX_TITLED_BARS
    body = [_text(x0 - 8, top + row_h / 2 + 4, "compute stream", "end")]
    for a, b in tl.compute:
        body.append(
            _rect(
                x0 + a * scale, top, (b - a) * scale, row_h, _TIME_COLOURS["compute"], f"compute {fmt_s(a)}–{fmt_s(b)}"
            )
        )
    for a, b in tl.waits:
        tip = f"compute waits for communication {fmt_s(a)}–{fmt_s(b)}"
        body.append(_rect(x0 + a * scale, top, max((b - a) * scale, 0.75), row_h, _IDLE_COLOUR, tip))
    for r, axis in enumerate(streams):
        y = top + (r + 1) * (row_h + gap)
        body.append(_text(x0 - 8, y + row_h / 2 + 4, f"comm {axis}", "end"))
        for a, b, ax, what in tl.comm:
            if ax != axis:
                continue
            for pa, pb, exposed in _split_by_waits(a, b, tl.waits):
                fill = _TIME_COLOURS["exposed communication"] if exposed else _HIDDEN_COLOUR
                tip = (
                    f"{'exposed' if exposed else 'hidden'} {fmt_s(pb - pa)} of {what}, on the link "
                    f"{fmt_s(a)}–{fmt_s(b)}"
                    if titled
                    else ""
                )
                body.append(_rect(x0 + pa * scale, y, max((pb - pa) * scale, 0.75), row_h, fill, tip, ' class="comm"'))
    axis_y = top + (len(streams) + 1) * (row_h + gap)
    body += _time_axis(tl.end_s, x0, width, axis_y)
    svg = _svg(CHART_WIDTH_PX, axis_y + 24, body, "compute and communication streams")
    legend = _legend([("compute", _TIME_COLOURS["compute"]), ("compute waits for communication", _IDLE_COLOUR),
                      ("communication the compute stream waits for (exposed)", _TIME_COLOURS["exposed communication"]),
                      ("communication hidden under compute", _HIDDEN_COLOUR)])  # fmt: skip
    caption = (
        f"One device's step of {fmt_s(e.step_time_s)} as the step replay (<code>autoplan.passes.overlap</code>) "
        "ran it: each collective from when it starts on the communication stream to when it finishes (one "
        "stream per mesh axis; the replay queues them on one link), the compute stream busy except where it "
        f"waits. Exposed {fmt_s(sum(b - a for a, b in tl.waits))} of {fmt_s(e.comm_s)} communication."
    )
    return legend + svg, caption


def _schedule_section(plan: Plan) -> str:
    if plan.config is not None and plan.config.pp > 1:
        body, caption = _gantt(plan)
        return _figure("schedule", "Pipeline schedule", body, caption)
    tl = stream_timeline(plan)
    if tl is not None:
        body, caption = _stream_chart(plan, tl)
        return _figure("schedule", "Timeline: compute and communication streams", body, caption)
    body, caption = _single_device_chart(plan)
    return _figure("schedule", "Timeline (schematic)", body, caption)


# --------------------------------------------------------------------------------------------
# 4. Memory
# --------------------------------------------------------------------------------------------


def memory_bars(plan: Plan) -> list[tuple[str, list[tuple[str, float]]]]:
    """One bar per pipeline rank (one for every device without a pipeline): ``(label, [(part,
    bytes)])``. The plan has the parts of the peak stage only; the rank holding it shows them
    (plus ``other`` for its other chunks), the other ranks their total."""
    e = plan.estimate
    peak_parts = [(p, float(b)) for p, b in e.memory_parts().items() if b > 0]

    def with_other(items: list[tuple[str, float]], total: float) -> list[tuple[str, float]]:
        rest = total - sum(b for _, b in items)
        return items + [("other", rest)] if rest > 1e-6 * max(total, 1.0) else items

    per_rank = e.memory_per_device_bytes
    if not per_rank or plan.config is None or len(per_rank) != plan.config.pp:
        return [("every device", with_other(peak_parts, float(e.memory_bytes["total"])))]
    match = re.fullmatch(r"stage (\d+)", e.memory_peak_at)
    peak_rank = int(match.group(1)) % plan.config.pp if match else max(range(len(per_rank)), key=per_rank.__getitem__)
    return [
        (f"rank {r}", with_other(peak_parts, total) if r == peak_rank else [("total", total)])
        for r, total in enumerate(per_rank)
    ]


def _memory_section(plan: Plan) -> str:
    e = plan.estimate
    bars = memory_bars(plan)
    peak = max(sum(b for _, b in parts) for _, parts in bars)
    capacity = e.capacity_bytes
    on_scale = peak >= 0.1 * capacity
    vmax = max(capacity, peak) * 1.05 if on_scale else peak * 1.15
    height, top, bottom, left = 240.0, 14.0, 28.0, 80.0
    bar_w = min(90.0, (CHART_WIDTH_PX - left - 20) / len(bars) * 0.6)
    step = (CHART_WIDTH_PX - left - 20) / len(bars)
    y_of = lambda b: top + height * (1 - b / vmax)  # noqa: E731
    body: list[str] = []
    for tick in _ticks(vmax, 5):
        y = y_of(tick)
        body.append(f'<line x1="{_px(left)}" y1="{_px(y)}" x2="{CHART_WIDTH_PX - 10}" y2="{_px(y)}" stroke="#eee"/>')
        body.append(_text(left - 6, y + 4, fmt_bytes(tick), "end"))
    seen: dict[str, str] = {}
    for i, (label, parts) in enumerate(bars):
        x = left + step * i + (step - bar_w) / 2
        acc = 0.0
        for part, b in parts:
            colour = "#8c8c8c" if part == "total" else _MEMORY_COLOURS.get(part, _colour(len(_PALETTE) + len(seen)))
            if part != "total":
                seen.setdefault(part, colour)
            body.append(
                _rect(x, y_of(acc + b), bar_w, y_of(acc) - y_of(acc + b), colour, f"{label}: {part} {fmt_bytes(b)}")
            )
            acc += b
        body.append(_text(x + bar_w / 2, y_of(acc) - 4, fmt_bytes(acc), "middle"))
        body.append(_text(x + bar_w / 2, top + height + 16, label, "middle"))
    if on_scale:
        y = y_of(capacity)
        body.append(
            f'<line x1="{_px(left)}" y1="{_px(y)}" x2="{CHART_WIDTH_PX - 10}" y2="{_px(y)}" stroke="#d62728" stroke-dasharray="6 4" stroke-width="1.5"/>'
        )
        body.append(
            _text(CHART_WIDTH_PX - 12, y - 4, f"capacity {fmt_bytes(capacity)}", "end", ' style="fill:#d62728"')
        )
    else:
        body.append(
            _text(
                CHART_WIDTH_PX - 12,
                top + 2,
                f"capacity {fmt_bytes(capacity)}: off the scale (peak uses {_percent(peak / capacity)} of it)",
                "end",
                ' style="fill:#d62728"',
            )
        )
    body.append(
        f'<line x1="{_px(left)}" y1="{_px(top + height)}" x2="{CHART_WIDTH_PX - 10}" y2="{_px(top + height)}" stroke="#999"/>'
    )
    svg = _svg(CHART_WIDTH_PX, top + height + bottom, body, "memory per device")
    legend_items = [("other chunks on the rank" if p == "other" and len(bars) > 1 else p, c) for p, c in seen.items()]
    if any(p == "total" for _, parts in bars for p, _ in parts):
        legend_items.append(("total (parts not in the plan)", "#8c8c8c"))
    where = f" The peak is at {_e(e.memory_peak_at)}." if e.memory_peak_at else ""
    caption = (
        "Peak bytes per device by part (stacked) against the device capacity"
        + (
            ", one bar per pipeline rank; the plan keeps the parts of the peak stage only, so the other ranks show "
            "their total and <i>other</i> is the rank's other chunks."
            if len(bars) > 1
            else "."
        )
        + where
        + " A memory-over-time curve needs the traced graph (<code>autoplan.passes.liveness</code>), which the plan file "
        "does not hold."
    )
    return _figure("memory", "Memory per device", _legend(legend_items) + svg, caption)


# --------------------------------------------------------------------------------------------
# 5. Time breakdown and collectives
# --------------------------------------------------------------------------------------------


def time_parts(plan: Plan) -> list[tuple[str, float]]:
    """The estimated step's parts (seconds; ``estimate.parts``, adding up to the step), or the
    whole step where a plan file records none."""
    e = plan.estimate
    if e.parts is None:
        return [("step (not broken down)", e.step_time_s)]
    return [(k, v) for k, v in e.parts.rows() if v > 0 or k == "compute"]


def collective_rows(plan: Plan) -> list[tuple[str, int, float, float, int]]:
    """Per kind of redistribution (its steps and mesh axes): count (a bucket once), total and
    exposed seconds (at most the total: :func:`~autoplan.planner.plan.exposed_within_own_time`),
    and how many are overlappable; most exposed first."""
    axes = plan.placement_axis_names
    rows: dict[str, list[float]] = {}
    seen_buckets: set[tuple[str, str]] = set()
    for c, exposed in zip(plan.collectives, exposed_within_own_time(plan.collectives), strict=True):
        key = " + ".join(f"{k}@{axes[a] if 0 <= a < len(axes) else a}" for k, a in c.steps) or "(no step)"
        row = rows.setdefault(key, [0, 0.0, 0.0, 0])
        if c.bucket is None or (c.bucket, key) not in seen_buckets:
            row[0] += 1
            if c.bucket is not None:
                seen_buckets.add((c.bucket, key))
        row[1] += c.time_s
        row[2] += exposed
        row[3] += int(c.overlappable)
    out = [(k, int(r[0]), r[1], r[2], int(r[3])) for k, r in rows.items()]
    return sorted(out, key=lambda r: (-r[2], -r[3], r[0]))


def _time_section(plan: Plan) -> str:
    parts = time_parts(plan)
    total = sum(v for _, v in parts)
    x0, width, y, h = 24.0, CHART_WIDTH_PX - 48.0, 6.0, 34.0
    body: list[str] = []
    x = x0
    for name, v in parts:
        w = width * v / total if total > 0 else 0.0
        body.append(_rect(x, y, w, h, _TIME_COLOURS[name], f"{name}: {fmt_s(v)} ({v / total:.1%})"))
        if w > 70:
            body.append(_text(x + w / 2, y + h / 2 + 4, f"{name} {v / total:.0%}", "middle", ' style="fill:#fff"'))
        x += w
    body += _time_axis(total, x0, width, y + h + 4)
    svg = _svg(CHART_WIDTH_PX, y + h + 30, body, "time breakdown")
    legend = _legend([(f"{name}: {fmt_s(v)} ({v / total:.1%})", _TIME_COLOURS[name]) for name, v in parts])
    e = plan.estimate
    hidden = e.comm_s - (e.exposed_comm_s if e.exposed_comm_s is not None else e.comm_s)
    rows = collective_rows(plan)
    if plan.pipeline is not None:
        p = plan.pipeline
        blocks = p.traced_blocks or len(p.segment_names) - 2
        heading = (
            f"<h3>Collectives of one stage program, per traced block and micro-batch</h3><p>The redistributions "
            f"of the program planned for one stage: {blocks} traced block(s) of {len(p.segment_names) - 2}, one "
            "micro-batch. Not the whole step (that is the table above).</p>"
        )
    else:
        heading = "<h3>Collectives per step</h3><p>Each redistribution of the program, by kind.</p>"
    table = (
        heading + "<table><tr><th>steps @ mesh axis</th><th class=n>count</th><th class=n>total time</th>"
        "<th class=n>exposed</th><th class=n>overlappable</th></tr>"
        + "".join(
            f"<tr><td><code>{_e(k)}</code></td><td class=n>{n}</td><td class=n>{fmt_s(t)}</td>"
            f"<td class=n>{fmt_s(x)}</td><td class=n>{o}</td></tr>"
            for k, n, t, x, o in rows
        )
        + f"<tr><th>sum</th><th class=n>{sum(r[1] for r in rows)}</th><th class=n>{fmt_s(sum(r[2] for r in rows))}</th>"
        f"<th class=n>{fmt_s(sum(r[3] for r in rows))}</th><th class=n>{sum(r[4] for r in rows)}</th></tr></table>"
        if rows
        else heading
        + "<p>The plan has no redistribution: every operand already has the placement its consumer needs.</p>"
    )
    counts = ", ".join(f"{k} ×{v}" for k, v in plan.step_collective_counts().items()) or "none"
    exposed = exposed_within_own_time(plan.collectives)
    top = sorted(range(len(plan.collectives)), key=lambda j: -plan.collectives[j].time_s)[:10]
    top_rows = "".join(
        f"<tr><td><code>{_e(c.producer)}</code> → <code>{_e(c.consumer)}</code>[{c.arg_index}]</td>"
        f"<td><code>{_e(','.join(c.src))} → {_e(','.join(c.dst))}</code></td>"
        f"<td>{_e(' + '.join(k for k, _ in c.steps))}</td><td class=n>{fmt_s(c.time_s)}</td>"
        f"<td class=n>{fmt_s(exposed[j])}</td><td>{_e(c.bucket or '')}</td></tr>"
        for j in top
        if (c := plan.collectives[j]).time_s > 0
    )
    largest = (
        "<details><summary>largest redistributions</summary><table><tr><th>value → consumer[arg]</th>"
        f"<th>placement</th><th>steps</th><th class=n>time</th><th class=n>exposed</th><th>bucket</th></tr>{top_rows}"
        "</table></details>"
        if top_rows
        else ""
    )
    note = e.parts.comm_note(e.comm.exposed_s) if e.parts is not None and e.comm.rows else ""
    what = (
        "The estimated step by part, on its critical path (the parts add up to the estimated step)"
        if e.parts is not None
        else "The estimated step (this plan file records no parts: re-plan with <code>autoplan plan</code> to see them)"
    )
    caption = (
        f"{what}: {fmt_s(e.step_time_s)}.{f' {_e(note[0].upper() + note[1:])}.' if note else ''} "
        f"Communication hidden behind compute: {fmt_s(max(hidden, 0.0))}. Collectives per step: {_e(counts)}; "
        "in the table a coalesced gradient bucket counts once, and times add up its members."
    )
    return _figure("time", "Where the step goes", legend + svg + comm_table(plan) + table + largest, caption)


def comm_table(plan: Plan) -> str:
    """The whole step's communication per kind and mesh axis (``estimate.comm``) with its sum."""
    e = plan.estimate
    head = "<h3>Communication per step</h3>"
    if not e.comm.rows:
        if e.comm_s > 0 or plan.collectives:
            return head + (
                "<p>Not recorded per kind and axis in this plan file (written before autoplan recorded it): "
                "re-plan with <code>autoplan plan</code> to see it.</p>"
            )
        return head + "<p>No communication: the program runs no collective.</p>"
    what = "every block, micro-batch and bucket" if plan.pipeline is not None else "every collective of the program"
    cells = "".join(
        f"<tr><td><code>{_e(r.kind)}</code></td><td>{_e(r.axis)}</td><td class=n>{r.count:,}</td>"
        f"<td class=n>{fmt_bytes(r.bytes) if r.bytes else '-'}</td><td class=n>{fmt_s(r.total_s)}</td>"
        f"<td class=n>{fmt_s(r.exposed_s)}</td></tr>"
        for r in e.comm.rows
    )
    total = (
        f"<tr><th>sum</th><th></th><th class=n>{sum(r.count for r in e.comm.rows):,}</th>"
        f"<th class=n>{fmt_bytes(sum(r.bytes for r in e.comm.rows))}</th><th class=n>{fmt_s(e.comm.total_s)}</th>"
        f"<th class=n>{fmt_s(e.comm.exposed_s)}</th></tr>"
    )
    return (
        f"{head}<p>The whole step, per device ({what}): total link time and the part the compute stream "
        f'waits for.</p><table id="comm"><tr><th>kind</th><th>mesh axis</th><th class=n>count</th><th class=n>bytes</th>'
        f"<th class=n>total</th><th class=n>exposed</th></tr>{cells}{total}</table><p>{_e(comm_sum_note(plan))}.</p>"
    )


# --------------------------------------------------------------------------------------------
# Page, file, command
# --------------------------------------------------------------------------------------------


def render_html(plan: Plan) -> str:
    """The whole report as one self-contained HTML page (see the module docstring)."""
    placements, placement_css = _placement_section(plan)
    sections = [
        _summary_section(plan),
        placements,
        _schedule_section(plan),
        _memory_section(plan),
        _time_section(plan),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>autoplan plan {_e(plan.fingerprint)}</title><style>{_CSS}{placement_css}</style></head>\n"
        "<body><main>" + "\n".join(sections) + f"</main><script>{_SCRIPT}</script></body></html>\n"
    )


def write_report(plan: Plan, path: str | os.PathLike[str]) -> None:
    """Write :func:`render_html` of ``plan`` to ``path`` atomically (a temporary file renamed
    into place); raises :class:`PlanFileError` naming the file when it cannot be written."""
    atomic_write(path, render_html(plan), what="report")


def add_parser(subparsers: Any) -> None:  # argparse._SubParsersAction has no public type
    """Register ``autoplan report`` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "report",
        help="write a self-contained HTML report of a plan file",
        description="Render a plan file as one HTML page that loads nothing from the network: summary, "
        "placements per operator, pipeline schedule (or single-device timeline), memory per device, "
        "time breakdown and collectives.",
    )
    p.add_argument("plan", help="plan file from `autoplan plan` (JSON)")
    p.add_argument("--out", "-o", required=True, help="HTML file to write, e.g. plan.html")
    p.add_argument("--quiet", "-q", action="store_true", help="print nothing on success")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    refuse_overwriting_inputs(args.out, {"plan file": args.plan})
    plan = Plan.load(args.plan)
    write_report(plan, args.out)
    if not args.quiet:
        print(f"wrote {args.out}", file=console.stdout())
    return 0
