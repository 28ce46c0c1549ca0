"""Reading plans: ``autoplan show`` (tables), ``explain`` (one op's alternatives) and ``diff``
(the commands and the functions behind them).

Everything here reads a :class:`~autoplan.planner.plan.Plan` and returns text (or a JSON-able dict for
``--json``); nothing is re-traced or re-solved. The text is terminal-safe: control characters in
names from a plan file are shown as escapes (``autoplan.cost_models.echo.terminal_safe``), never sent to
the terminal. The output holds no wall-clock values, so the
same plan file always prints the same bytes (golden tests rely on it).
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autoplan.cost_models.cluster import COLLECTIVE_KINDS
from autoplan.cost_models.echo import terminal_safe
from autoplan.cost_models.errors import PlanError
from autoplan.passes.explain import Alternative, NodeExplanation
from autoplan.passes.plan_text import param_node_name
from autoplan.planner.plan import ConfigOption, Plan, bytes_text, exposed_within_own_time
from autoplan.tools import common, console

_BLOCK_INDEX = re.compile(r"(?<=\.)(\d+)(?=\.)")


# -- tables -----------------------------------------------------------------------------------
def table(header: Sequence[str], rows: Iterable[Sequence[object]], *, align: str = "") -> list[str]:
    """Plain-text table: a header, a rule, one line per row. ``align``: one ``l``/``r`` per
    column (default: first column left, the others right)."""
    body = [[str(c) for c in r] for r in rows]
    cols = len(header)
    align = align or "l" + "r" * (cols - 1)
    widths = [max([len(header[i]), *(len(r[i]) for r in body)]) for i in range(cols)]

    def line(cells: Sequence[str]) -> str:
        out = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align, strict=True)]
        return "  ".join(out).rstrip()

    return [line(header), "  ".join("-" * w for w in widths), *(line(r) for r in body)]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


_bytes = bytes_text


def _spec(spec: Sequence[str] | None) -> str:
    return "-" if spec is None else ",".join(spec)


# -- show -------------------------------------------------------------------------------------
def show_text(plan: Plan) -> str:
    """The plan as review tables: header, mesh and stages, time, memory, placements, collectives."""
    sections = [
        _header(plan),
        _mesh_section(plan),
        _time_section(plan),
        _comm_section(plan),
        _memory_section(plan),
        _placements_section(plan),
        _collectives_section(plan),
    ]
    return terminal_safe("\n\n".join("\n".join(s) for s in sections if s) + "\n")


def _header(plan: Plan) -> list[str]:
    c, e, s = plan.cluster, plan.estimate, plan.solver
    lines = [f"plan {plan.fingerprint}  {plan.workload or '(made from Python)'}"]
    lines.append(f"cluster   {c.num_nodes} node(s) x {c.devices_per_node} {c.device.name} = {c.world_size} devices")
    if plan.config is not None:
        lines.append(f"config    {plan.config}")
    lines.append(f"step      {_ms(e.step_time_s)} ms estimated")
    if e.tokens_per_s is not None:
        lines.append(f"          {e.tokens_per_s:,.0f} tokens/s, MFU {(e.mfu or 0):.1%}")
    gap = s.get("gap")
    lines.append(
        f"solver    {s['status']}"
        + (f" ({s.get('method')})" if s.get("method") else "")
        + (f", gap {gap:.2e}" if isinstance(gap, float) and gap > 0 else "")
        + f", {s['num_variables']} variables, {s['num_constraints']} constraints"
    )
    src = e.compute_sources
    lines.append(
        f"costs     op times {src.get('profiled', 0)} profiled / {src.get('analytic', 0)} analytic; "
        f"links {c.links_source}"
    )
    if plan.fallback_ops:
        lines.append("fallback  replicated (no DTensor rule): " + ", ".join(sorted(set(plan.fallback_ops.values()))))
    return lines


def _mesh_section(plan: Plan) -> list[str]:
    c = plan.cluster
    if plan.pipeline is not None:
        return _stages_section(plan)
    use = plan.parallelism()
    rows = []
    for axis, (name, size) in enumerate(zip(c.mesh_axis_names, c.mesh_shape, strict=True)):
        link = c.axis_link(axis)
        rows.append(
            (
                axis,
                name,
                size,
                "inter-node" if link.spans_nodes else "intra-node",
                f"{link.bw_GBps:g}",
                f"{link.latency_us:g}",
                use[name],
            )
        )
    return ["Mesh", *table(("axis", "name", "size", "link", "GB/s", "latency us", "use"), rows, align="rlrlrrl")]


def _stages_section(plan: Plan) -> list[str]:
    p = plan.pipeline
    assert p is not None
    stage_size = 1
    for n in p.stage_mesh_shape:
        stage_size *= n
    use = plan.parallelism()
    rows = [
        (axis, name, size, use[name])
        for axis, (name, size) in enumerate(zip(p.stage_axis_names, p.stage_mesh_shape, strict=True))
    ]
    lines = [
        f"Stage mesh (each of the {len(p.stage_starts)} pipeline stages runs on {stage_size} devices)",
        *table(("axis", "name", "size", "use"), rows, align="rlrl"),
    ]
    stage_rows = [
        (k, _segments_text(segs, p.block_list), f"{k * stage_size}-{(k + 1) * stage_size - 1}", rc)
        for k, (segs, rc) in enumerate(zip(p.stage_segments(), p.stage_recompute, strict=True))
    ]
    lines += ["", "Pipeline stages"]
    lines += table(("stage", "segments", "devices", "recompute"), stage_rows, align="rlll")
    if p.reduced:
        lines.append(
            f"  (planned on {p.traced_blocks} traced blocks of {len(p.segment_names) - 2}: "
            f"the last traced block's placements repeat on every later block)"
        )
    return lines


def _segments_text(segments: Sequence[str], block_list: str) -> str:
    """``prologue, h.0..h.3`` style: consecutive blocks as one range."""
    out: list[str] = []
    blocks = [s for s in segments if s not in ("prologue", "epilogue")]
    if "prologue" in segments:
        out.append("prologue")
    if blocks:
        first, last = blocks[0], blocks[-1]
        short = lambda s: s[len(block_list) + 1 :] if block_list and s.startswith(block_list + ".") else s  # noqa: E731
        out.append(
            f"{block_list}.{short(first)}" + (f"..{short(last)}" if last != first else "")
            if block_list
            else first + (f"..{last}" if last != first else "")
        )
    if "epilogue" in segments:
        out.append("epilogue")
    return ", ".join(out)


def _time_section(plan: Plan) -> list[str]:
    """The step in parts that add up to it (``estimate.parts``: compute, exposed communication,
    bubble, optimizer step), with the communication that runs hidden beside them."""
    e = plan.estimate
    parts = e.parts
    if parts is None:
        return [
            f"Time per step: {_ms(e.step_time_s)} ms, not broken down in this plan file (written before autoplan "
            "recorded the parts); re-plan with `autoplan plan` to see them"
        ]
    rows = [(name, _ms(t), f"{t / e.step_time_s:.1%}" if e.step_time_s else "-") for name, t in parts.rows()]
    rows.append(("step", _ms(e.step_time_s), "100.0%"))
    lines = ["Time per step (on its critical path)", *table(("part", "ms", "share"), rows)]
    exposed = e.exposed_comm_s if e.exposed_comm_s is not None else e.comm_s
    if e.exposed_comm_s is not None and e.comm_s > exposed:
        lines.append(f"  ({_ms(e.comm_s - exposed)} ms of communication runs beside compute and is in no part)")
    note = parts.comm_note(e.comm.exposed_s) if e.comm.rows else ""
    if note:
        lines.append(f"  ({note})")
    return lines


def comm_sum_note(plan: Plan) -> str:
    """Whether the per kind and axis rows add up to the estimate's communication (they should:
    the rows are how the estimate was made), said with the numbers."""
    e = plan.estimate
    total, exposed = e.comm.total_s, e.comm.exposed_s
    estimate_exposed = e.exposed_comm_s if e.exposed_comm_s is not None else e.comm_s
    if _close(total, e.comm_s) and _close(exposed, estimate_exposed):
        return f"= the estimate's communication {_ms(e.comm_s)} ms, exposed {_ms(estimate_exposed)} ms"
    return (
        f"the estimate says communication {_ms(e.comm_s)} ms, exposed {_ms(estimate_exposed)} ms: the rows do not "
        "add up to it (a plan file edited by hand?); re-plan with `autoplan plan`"
    )


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(abs(a), abs(b)) + 1e-12


def _comm_section(plan: Plan) -> list[str]:
    """The whole step's communication per kind and mesh axis (``estimate.comm``), with its sum."""
    e = plan.estimate
    if not e.comm.rows:
        if e.comm_s > 0 or any(k in COLLECTIVE_KINDS for c in plan.collectives for k, _ in c.steps):
            return [
                "Communication per step: not recorded per kind in this plan file (written before autoplan "
                "recorded it); re-plan with `autoplan plan` to see it"
            ]
        return ["Communication per step: none"]
    rows = [
        (r.kind, r.axis, f"{r.count:,}", _bytes(r.bytes) if r.bytes else "-", _ms(r.total_s), _ms(r.exposed_s))
        for r in e.comm.rows
    ]
    rows.append(("sum", "", f"{sum(r.count for r in e.comm.rows):,}", _bytes(sum(r.bytes for r in e.comm.rows)),
                 _ms(e.comm.total_s), _ms(e.comm.exposed_s)))  # fmt: skip
    what = "every block, micro-batch and bucket" if plan.pipeline is not None else "every collective of the program"
    return [
        f"Communication per step (whole step, per device: {what})",
        *table(("kind", "axis", "count", "bytes", "ms", "exposed ms"), rows, align="llrrrr"),
        f"  ({comm_sum_note(plan)})",
    ]


def _memory_section(plan: Plan) -> list[str]:
    e = plan.estimate
    mem = e.memory_parts()
    parts = list(mem)
    cap = e.capacity_bytes
    header = ("device", *parts, "peak", "capacity", "headroom")
    rows: list[tuple[object, ...]] = []
    if e.memory_per_device_bytes and plan.pipeline is not None:
        worst = max(range(len(e.memory_per_device_bytes)), key=lambda k: e.memory_per_device_bytes[k])
        for k, total in enumerate(e.memory_per_device_bytes):
            cells = [_bytes(mem[p]) if k == worst else "" for p in parts]
            rows.append((f"stage {k}", *cells, _bytes(total), _bytes(cap), f"{1 - total / cap:.1%}"))
        note = "  (parts shown for the stage with the peak; every device of a stage holds the same)"
    else:
        total = e.memory_bytes["total"]
        rows.append(("each", *(_bytes(mem[p]) for p in parts), _bytes(total), _bytes(cap), f"{1 - total / cap:.1%}"))
        note = f"  (peak at {e.memory_peak_at}; every device holds the same)" if e.memory_peak_at else ""
    return ["Memory per device", *table(header, rows), *([note] if note else [])]


def group_by_block(names: Sequence[str], value: Mapping[str, str], *, stands_for: Mapping[str, str] | None = None):
    """Group ``names`` that differ only in a block index (``h.0.attn`` / ``h.1.attn``) and share
    ``value``: yields ``(template with {i..j}, value)`` in first-seen order. ``stands_for`` maps
    a block index to the range it stands for (reduced-depth plans)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name in names:
        m = _BLOCK_INDEX.search(name)
        key = (_BLOCK_INDEX.sub("{}", name, count=1) if m else name, value[name])
        groups.setdefault(key, []).append(m.group(1) if m else "")
    out = []
    for (template, val), idx in groups.items():
        if "{}" not in template:
            out.append((template, val))
            continue
        spans = [stands_for.get(i, i) if stands_for else i for i in idx]
        label = _index_ranges(spans)
        out.append((template.replace("{}", label if label.isdigit() else "{" + label + "}"), val))
    return out


def _index_ranges(items: Sequence[str]) -> str:
    """``['0','1','2','5']`` -> ``0..2,5``; items that are already ranges are kept."""
    nums: list[int] = []
    text: list[str] = []
    for it in items:
        lo, sep, hi = it.partition("..")
        if lo.isdigit() and (not sep or hi.isdigit()):
            nums.extend(range(int(lo), int(hi if sep else lo) + 1))
        else:
            text.append(it)
    nums = sorted(set(nums))
    spans: list[str] = []
    i = 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        spans.append(str(nums[i]) if i == j else f"{nums[i]}..{nums[j]}")
        i = j + 1
    return ",".join(spans + text)


def _stands_for(plan: Plan) -> dict[str, str] | None:
    p = plan.pipeline
    if p is None or not p.reduced:
        return None
    num_blocks = len(p.segment_names) - 2
    return {str(p.traced_blocks - 1): f"{p.traced_blocks - 1}..{num_blocks - 1}"}


def _placements_section(plan: Plan) -> list[str]:
    specs = {n: _spec(plan.param_specs[n]) for n in plan.param_names}
    rows = group_by_block(plan.param_names, specs, stands_for=_stands_for(plan))
    axes = ",".join(plan.placement_axis_names)
    if plan.pipeline is not None:
        axes += " of the stage mesh"
    lines = [f"Parameter placements (one entry per mesh axis: {axes}; repeated blocks grouped)"]
    lines += table(("parameter", "placement"), rows, align="ll")
    ins = ", ".join(_spec(s) for s in plan.input_specs) or "-"
    tgts = ", ".join(_spec(s) for s in plan.target_specs) or "-"
    lines += ["", f"inputs: {ins}   targets: {tgts}"]
    counts: dict[str, int] = {}
    for d in plan.nodes.values():
        out = d["out"][0] if d["out"] else None
        key = _spec(out)
        counts[key] = counts.get(key, 0) + 1
    hist = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    lines += ["", "Operator outputs by placement", *table(("placement", "ops"), hist, align="lr")]
    return lines


def _collectives_section(plan: Plan) -> list[str]:
    """The plan's redistributions by kind and mesh axes. On a fixed mesh they are the whole step
    and add up to the communication above; a pipeline plan's are those of one stage program
    (its traced blocks, one micro-batch), said so in the title. Exposure per row is at most its
    time (:func:`~autoplan.planner.plan.exposed_within_own_time`)."""
    axis_names = plan.placement_axis_names  # a pipeline plan's collectives run on the stage mesh
    by_kind: dict[str, list[float]] = {}
    seen: set[str] = set()
    for c, exposed in zip(plan.collectives, exposed_within_own_time(plan.collectives), strict=True):
        kinds = [k for k, _ in c.steps if k in COLLECTIVE_KINDS]
        kind = "+".join(kinds) or "local reshard (no communication)"
        axes = ",".join(sorted({axis_names[a] for k, a in c.steps if k in kinds}))
        key = f"{kind} [{axes}]" if axes else kind
        entry = by_kind.setdefault(key, [0, 0.0, 0.0])
        if c.bucket is None or c.bucket not in seen:  # a bucket is one collective; its members add time
            entry[0] += 1
        if c.bucket is not None:
            seen.add(c.bucket)
        entry[1] += c.time_s
        entry[2] += exposed
    if plan.pipeline is not None:
        p = plan.pipeline
        blocks = p.traced_blocks or len(p.segment_names) - 2
        title = (
            f"Collectives of one stage program, per traced block and micro-batch ({blocks} traced block(s) of "
            f"{len(p.segment_names) - 2}, one micro-batch; not the whole step: see Communication per step)"
        )
    else:
        title = "Collectives per step (each redistribution of the program)"
    if not by_kind:
        return [f"{title}: none"]
    rows = [(k, int(v[0]), _ms(v[1]), _ms(v[2])) for k, v in sorted(by_kind.items())]
    rows.append(("sum", sum(int(v[0]) for v in by_kind.values()), _ms(sum(v[1] for v in by_kind.values())),
                 _ms(sum(v[2] for v in by_kind.values()))))  # fmt: skip
    return [title, *table(("kind [mesh axes]", "count", "ms", "exposed ms"), rows)]


# -- explain ----------------------------------------------------------------------------------
def resolve_node(plan: Plan, *, op: str | None = None, param: str | None = None) -> str:
    """The plan node an ``--op`` / ``--param`` names (one-line error listing close names otherwise)."""
    if (op is None) == (param is None):
        raise PlanError("give exactly one of --op NAME or --param NAME")
    if param is not None:
        if param not in plan.param_specs:
            close = difflib.get_close_matches(param, plan.param_names, n=5, cutoff=0.6)
            raise PlanError(
                f"parameter {param!r} is not in the plan"
                + (
                    f": did you mean {', '.join(close)}?"
                    if close
                    else f" ({len(plan.param_names)} parameters; see `autoplan show`)"
                )
            )
        return param_node_name(param)
    assert op is not None
    if op in plan.nodes or op in plan.alternatives:
        return op
    close = difflib.get_close_matches(op, list(plan.alternatives) or list(plan.nodes), n=5, cutoff=0.6)
    raise PlanError(
        f"op {op!r} is not a node of the plan"
        + (f": did you mean {', '.join(close)}?" if close else ": see `autoplan show --json` for node names")
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Explanation:
    node: str
    op: str
    chosen: Alternative | None
    others: tuple[Alternative, ...]
    num_strategies: int
    follows: tuple[str, ...] = ()
    """Chain of producers this node follows (tied view/elementwise ops), nearest first."""
    gap: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "op": self.op,
            "num_strategies": self.num_strategies,
            "follows": list(self.follows),
            "chosen": None if self.chosen is None else self.chosen.to_dict(),
            "alternatives": [a.to_dict() for a in self.others],
            "reason": self.reason(),
        }

    def reason(self) -> str:
        """Why the chosen strategy won, from the numbers."""
        if self.chosen is None:
            if self.num_strategies <= 1:
                return "only one placement is possible for this node"
            return "the plan records no alternatives for this node (made by an older autoplan?)"
        if not self.others:
            return "only one placement is possible for this node"
        blocked = [a for a in self.others if a.over_capacity_bytes is not None and a.over_capacity_bytes > 0]
        cheaper = [a for a in self.others if a.delta_s < 0]
        parts = []
        for a in cheaper:
            if a in blocked:
                parts.append(
                    f"{_alt_spec(a)} would be {-a.delta_s * 1e3:.3f} ms faster but needs "
                    f"{_bytes(a.over_capacity_bytes or 0)} more than the device has at the memory peak"
                )
            else:
                parts.append(
                    f"{_alt_spec(a)} would be {-a.delta_s * 1e3:.3f} ms faster with the rest fixed: the solver stopped "
                    f"within its optimality gap{f' ({self.gap:.1e})' if self.gap else ''}"
                )
        fastest = min(self.others, key=lambda a: a.delta_s)
        if fastest.delta_s >= 0:
            d_compute = fastest.compute_s - self.chosen.compute_s
            d_comm = fastest.comm_s - self.chosen.comm_s
            if fastest.delta_s == 0:
                parts.append(
                    f"the next best ({_alt_spec(fastest)}) costs the same; the tie is broken by the solver's "
                    "deterministic order"
                )
            else:
                parts.append(
                    f"cheapest given its neighbours' placements: the next best ({_alt_spec(fastest)}) costs "
                    f"+{fastest.delta_s * 1e3:.3f} ms ({d_compute * 1e3:+.3f} ms compute, {d_comm * 1e3:+.3f} ms "
                    "communication)"
                )
        return "; ".join(parts)


def _alt_spec(a: Alternative) -> str:
    return " | ".join(_spec(s) for s in a.output_specs)


def explain(plan: Plan, *, op: str | None = None, param: str | None = None) -> Explanation:
    """The alternatives recorded for one node (``--op``) or a parameter's placement (``--param``)."""
    node = resolve_node(plan, op=op, param=param)
    chain: list[str] = []
    current = node
    ex: NodeExplanation | None = plan.alternatives.get(current)
    while ex is not None and ex.follows and ex.follows not in chain:
        chain.append(ex.follows)
        current = ex.follows
        ex = plan.alternatives.get(current)
    op_name = plan.nodes[node]["op"] if node in plan.nodes else ("parameter" if node.startswith("p_") else "input")
    if ex is None or not ex.alternatives:
        n = plan.alternatives[node].num_strategies if node in plan.alternatives else 1
        return Explanation(node=node, op=op_name, chosen=None, others=(), num_strategies=n, follows=tuple(chain))
    return Explanation(
        node=node,
        op=op_name,
        chosen=ex.alternatives[0],
        others=ex.alternatives[1:],
        num_strategies=ex.num_strategies,
        follows=tuple(chain),
        gap=plan.solver.get("gap") if isinstance(plan.solver.get("gap"), float) else None,
    )


def explain_text(ex: Explanation) -> str:
    lines = [f"{ex.node} ({ex.op}): {ex.num_strategies} candidate placement(s)"]
    if ex.follows:
        lines.append(
            f"  follows its producer {' -> '.join(ex.follows)} (view / elementwise op: converting before or after it "
            f"costs the same, so it takes its producer's layout); alternatives of {ex.follows[-1]}:"
        )
    if ex.chosen is None:
        lines.append(f"  {ex.reason()}")
        return terminal_safe("\n".join(lines) + "\n")
    rows = []
    for k, a in enumerate((ex.chosen, *ex.others)):
        fits = "-" if a.over_capacity_bytes is None else ("yes" if a.over_capacity_bytes <= 0 else "NO")
        rows.append(
            (
                "chosen" if k == 0 else f"#{k}",
                _alt_spec(a),
                " ; ".join(_spec(s) for s in a.input_specs),
                _ms(a.compute_s),
                _ms(a.comm_s),
                "-" if k == 0 else f"{a.delta_s * 1e3:+.3f}",
                fits,
            )
        )
    lines += table(
        ("", "output", "inputs", "compute ms", "comm ms", "vs chosen ms", "fits memory"), rows, align="lllrrrl"
    )
    lines.append("  comm: conversions on the edges into and out of this node, every other node as planned")
    lines.append(f"why: {ex.reason()}")
    return terminal_safe("\n".join(lines) + "\n")


# -- the configuration ----------------------------------------------------------------------------


def explain_configuration(plan: Plan) -> dict[str, Any]:
    """Why the joint search chose ``plan.config``: the configurations it weighed
    (``plan.configurations``: the best of each combination of degrees), each against the chosen one,
    and a reason from the numbers. Plans on a fixed mesh have no configuration to explain."""
    if plan.config is None:
        raise PlanError(
            "this plan was made on a fixed mesh (no global batch): there is no configuration to explain; "
            "give --op NAME or --param NAME"
        )
    if not plan.configurations:
        raise PlanError(
            "the plan records no configurations the search weighed (made by an older autoplan?): re-plan to explain "
            "its configuration, or give --op NAME or --param NAME"
        )
    chosen, others = plan.configurations[0], plan.configurations[1:]
    rows = [
        {
            **c.to_dict(),
            "config": str(c.config),
            "vs_chosen_s": c.step_time_s - chosen.step_time_s,
        }
        for c in plan.configurations
    ]  # (each row's step_parts add up to its step_time_s; compute_s is the busiest rank's busy time)
    return {
        "chosen": str(chosen.config),
        "capacity_bytes": plan.estimate.capacity_bytes,
        "priced": plan.solver.get("configurations_priced"),
        "configurations": rows,
        "reason": _configuration_reason(chosen, others, plan.estimate.capacity_bytes),
    }


def _configuration_reason(chosen: ConfigOption, others: Sequence[ConfigOption], capacity_bytes: float) -> str:
    parts = ["the fastest configuration that fits"]
    faster = [c for c in others if not c.feasible and c.step_time_s < chosen.step_time_s]
    if faster:
        f = min(faster, key=lambda c: c.step_time_s)
        parts.append(
            f"{f.config} would take {_ms(f.step_time_s)} ms but needs {_bytes(f.peak_memory_bytes)} per device "
            f"of {_bytes(capacity_bytes)}"
        )
    fitting = [c for c in others if c.feasible]
    if fitting:
        n = fitting[0]
        terms = ""
        if n.parts is not None and chosen.parts is not None:  # the parts' differences add up to the step's
            a, b = n.parts.to_dict(), chosen.parts.to_dict()
            terms = ": " + ", ".join(
                f"{name} {(a[key] - b[key]) * 1e3:+,.3f} ms" for name, key in _PART_KEYS if a[key] or b[key]
            )
        parts.append(
            f"the next best degrees ({n.config}) take +{_ms(n.step_time_s - chosen.step_time_s)} ms "
            f"({(n.step_time_s / chosen.step_time_s - 1):+.1%}{terms})"
        )
    return "; ".join(parts)


_PART_KEYS = (
    ("compute", "compute_s"), ("exposed communication", "exposed_comm_s"), ("bubble", "bubble_s"),
    ("optimizer", "optimizer_s"),
)  # fmt: skip
"""A configuration's step parts (``StepParts.to_dict``) as ``explain`` names them."""


def _part_cell(row: Mapping[str, Any], key: str) -> str:
    parts = row.get("step_parts")
    return "-" if parts is None else _ms(parts[key])


def explain_configuration_text(ex: Mapping[str, Any]) -> str:
    priced = ex["priced"]
    searched = (
        "the search priced 1 configuration (the one given with config=, or the only one that fits the cluster and batch):"
        if priced == 1
        else f"the search priced {priced if priced is not None else 'several'} configurations (every other one's "
        "compute alone exceeds the chosen step); the best of each combination of degrees:"
    )
    lines = [f"configuration: {ex['chosen']}", searched]
    rows = [
        (
            "chosen" if k == 0 else f"#{k}",
            r["config"],
            _ms(r["step_time_s"]),
            "-" if k == 0 else f"{r['vs_chosen_s'] * 1e3:+,.3f}",
            *(_part_cell(r, key) for _, key in _PART_KEYS),
            _bytes(r["peak_memory_bytes"]),
            "yes" if r["feasible"] else "NO",
        )
        for k, r in enumerate(ex["configurations"])
    ]
    lines += table(
        ("", "configuration", "step ms", "vs chosen ms", "compute ms", "exposed comm ms", "bubble ms",
         "optimizer ms", "peak/device", "fits"),
        rows,
        align="llrrrrrrrl",
    )  # fmt: skip
    lines.append(
        "  compute + exposed comm + bubble + optimizer = step, on the step's critical path (collectives that block "
        f"compute are exposed communication; '-': not recorded in this plan file); {_bytes(ex['capacity_bytes'])} of "
        "memory per device"
    )
    lines.append(f"why: {ex['reason']}")
    return terminal_safe("\n".join(lines) + "\n")


# -- diff -------------------------------------------------------------------------------------
def diff_plans(a: Plan, b: Plan) -> dict[str, Any]:
    """What changed from ``a`` to ``b``: estimate deltas, configuration, placements, collectives."""
    ea, eb = a.estimate, b.estimate

    def delta(x: float | None, y: float | None) -> dict[str, float | None]:
        # |x| below a femto-unit is rounding noise of a zero (e.g. 1.7e-18 s exposed): no ratio
        rel = None if x is None or abs(x) < 1e-15 or y is None else (y - x) / x
        return {"a": x, "b": y, "change": rel}

    estimate = {
        "step_time_s": delta(ea.step_time_s, eb.step_time_s),
        "compute_s": delta(ea.compute_s, eb.compute_s),
        "exposed_comm_s": delta(ea.exposed_comm_s, eb.exposed_comm_s),
        "bubble_s": delta(ea.bubble_s, eb.bubble_s),
        "peak_memory_bytes": delta(ea.memory_bytes["total"], eb.memory_bytes["total"]),
        "mfu": delta(ea.mfu, eb.mfu),
        "tokens_per_s": delta(ea.tokens_per_s, eb.tokens_per_s),
    }
    config = {}
    ca = a.config.to_dict() if a.config else {}
    cb = b.config.to_dict() if b.config else {}
    for k in sorted(set(ca) | set(cb)):
        if ca.get(k) != cb.get(k):
            config[k] = {"a": ca.get(k), "b": cb.get(k)}
    params = {
        n: {"a": _spec(a.param_specs.get(n)), "b": _spec(b.param_specs.get(n))}
        for n in sorted(set(a.param_specs) | set(b.param_specs))
        if a.param_specs.get(n) != b.param_specs.get(n)
    }
    common = [n for n in a.nodes if n in b.nodes]
    ops_changed = [n for n in common if a.nodes[n]["out"] != b.nodes[n]["out"] or a.nodes[n]["in"] != b.nodes[n]["in"]]
    ca_counts, cb_counts = a.collective_counts(), b.collective_counts()
    collectives = {
        k: {"a": ca_counts.get(k, 0), "b": cb_counts.get(k, 0)}
        for k in sorted(set(ca_counts) | set(cb_counts))
        if ca_counts.get(k, 0) != cb_counts.get(k, 0)
    }
    return {
        "same_model": a.fingerprint == b.fingerprint,
        "cluster": None if a.cluster == b.cluster else {"a": str(a.cluster), "b": str(b.cluster)},
        "estimate": estimate,
        "config": config,
        "params_changed": params,
        "ops_changed": {n: {"a": a.nodes[n]["out"], "b": b.nodes[n]["out"]} for n in ops_changed},
        "ops_only_in_a": sorted(set(a.nodes) - set(b.nodes)),
        "ops_only_in_b": sorted(set(b.nodes) - set(a.nodes)),
        "collectives": collectives,
    }


def diff_text(d: Mapping[str, Any], *, limit: int = 20) -> str:
    lines = []
    if not d["same_model"]:
        lines.append("models differ (graph fingerprints differ): placements are compared by node name only")
    if d["cluster"]:
        lines.append(f"cluster: {d['cluster']['a']} -> {d['cluster']['b']}")
    rows = []
    for key, label, fmt in (
        ("step_time_s", "step time (ms)", lambda v: _ms(v)),
        ("compute_s", "compute (ms)", lambda v: _ms(v)),
        ("exposed_comm_s", "exposed communication (ms)", lambda v: _ms(v)),
        ("bubble_s", "pipeline bubble (ms)", lambda v: _ms(v)),
        ("peak_memory_bytes", "peak memory per device", lambda v: "-" if v is None else _bytes(v)),
        ("mfu", "MFU", lambda v: "-" if v is None else f"{v:.1%}"),
        ("tokens_per_s", "tokens/s", lambda v: "-" if v is None else f"{v:,.0f}"),
    ):
        e = d["estimate"][key]
        if e["a"] is None and e["b"] is None:
            continue
        change = "-" if e["change"] is None else f"{e['change']:+.1%}"
        rows.append((label, fmt(e["a"]), fmt(e["b"]), change))
    lines += ["Estimate", *table(("", "a", "b", "change"), rows)]
    step = d["estimate"]["step_time_s"]["change"]
    if step is not None:
        verdict = "faster" if step < 0 else "slower"
        lines.append(f"  b is {abs(step):.1%} {verdict} than a" if step else "  same estimated step time")
    if d["config"]:
        lines += [
            "",
            "Configuration",
            *table(("knob", "a", "b"), [(k, v["a"], v["b"]) for k, v in d["config"].items()], align="lll"),
        ]
    if d["params_changed"]:
        items = list(d["params_changed"].items())
        lines += ["", f"Parameter placements changed: {len(items)}"]
        lines += table(("parameter", "a", "b"), [(n, v["a"], v["b"]) for n, v in items[:limit]], align="lll")
        if len(items) > limit:
            lines.append(f"  ... and {len(items) - limit} more (--json lists all)")
    else:
        lines += ["", "Parameter placements: unchanged"]
    ops = list(d["ops_changed"].items())
    lines.append(f"Operator placements changed: {len(ops)}")
    if ops:
        lines += table(
            ("op", "a output", "b output"),
            [(n, " | ".join(_spec(s) for s in v["a"]), " | ".join(_spec(s) for s in v["b"])) for n, v in ops[:limit]],
            align="lll",
        )
        if len(ops) > limit:
            lines.append(f"  ... and {len(ops) - limit} more (--json lists all)")
    if d["ops_only_in_a"] or d["ops_only_in_b"]:
        lines.append(f"ops only in a: {len(d['ops_only_in_a'])}, only in b: {len(d['ops_only_in_b'])}")
    if d["collectives"]:
        lines += [
            "",
            "Collectives per step",
            *table(("kind", "a", "b"), [(k, v["a"], v["b"]) for k, v in d["collectives"].items()]),
        ]
    return terminal_safe("\n".join(lines) + "\n")


# -- commands ---------------------------------------------------------------------------------
def add_parser(subparsers: Any) -> None:  # argparse._SubParsersAction has no public type
    """Register ``autoplan show``, ``explain`` and ``diff`` on the CLI's subparsers."""
    p_show = subparsers.add_parser(
        "show", help="print a plan file for review: mesh and stages, time, memory per device, placements, collectives"
    )
    p_show.add_argument("plan")
    p_show.add_argument("--json", action="store_true", help="print the whole plan as JSON")
    p_show.set_defaults(func=cmd_show)

    p_explain = subparsers.add_parser(
        "explain",
        help="why the plan's configuration won (the degrees the search weighed), or with --op/--param the placements "
        "the solver considered for one op or parameter, their costs, and why one won",
    )
    p_explain.add_argument("plan")
    p_explain.add_argument("--op", metavar="NAME", help="graph node name (see `autoplan show --json`, key nodes)")
    p_explain.add_argument("--param", metavar="NAME", help="parameter name, e.g. transformer.h.0.attn.c_attn.weight")
    p_explain.add_argument("--json", action="store_true", help="print the explanation as JSON")
    p_explain.set_defaults(func=cmd_explain)

    p_diff = subparsers.add_parser("diff", help="what changed between two plans, with the estimated effect")
    p_diff.add_argument("a", help="plan file (before)")
    p_diff.add_argument("b", help="plan file (after)")
    p_diff.add_argument("--json", action="store_true", help="print the whole difference as JSON")
    p_diff.add_argument("--limit", type=common.positive_int, default=20, help="changed placements listed (default 20)")
    p_diff.set_defaults(func=cmd_diff)


def cmd_show(args: argparse.Namespace) -> int:
    plan = Plan.load(args.plan)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1), file=console.stdout())
    else:
        console.stdout().write(show_text(plan))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    if args.op is None and args.param is None:
        cx = explain_configuration(Plan.load(args.plan))
        if args.json:
            print(json.dumps(cx, indent=1), file=console.stdout())
        else:
            console.stdout().write(explain_configuration_text(cx))
        return 0
    ex = explain(Plan.load(args.plan), op=args.op, param=args.param)
    if args.json:
        print(json.dumps(ex.to_dict(), indent=1), file=console.stdout())
    else:
        console.stdout().write(explain_text(ex))
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    d = diff_plans(Plan.load(args.a), Plan.load(args.b))
    if args.json:
        print(json.dumps(d, indent=1), file=console.stdout())
    else:
        console.stdout().write(diff_text(d, limit=args.limit))
    return 0
