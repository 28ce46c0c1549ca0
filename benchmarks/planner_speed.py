"""Planner speed on large models, end to end on this machine.

    python benchmarks/planner_speed.py                 # the three target cases + a reduction check
    python benchmarks/planner_speed.py --case llama3-8b

Each case runs in its own process (so its peak RSS is its own): build the model on ``meta``,
``autoplan.plan(..., global_batch_size=, precision="bf16")`` (trace, per-segment ILPs, the joint
search over dp/tp/pp/micro-batches/schedule/recompute/ZeRO, the stage ILP) and write the plan
file. Prints per case: layers, nodes and ILP decision variables / edges of the solved program
against the full-depth program they stand for; trace s and ILP solve s spent in the planning
process; the wall time of the per-(tp, micro-batch) segment costs, which forked workers solve in
parallel (``AUTOPLAN_WORKERS``, default: the CPU cores; their traces and ILPs are inside this
column, not in the two before it); the segment-cost keys ``(tp, micro-batch, cp, sequence
parallel)`` the search asked to solve (those with a ``cp`` axis in brackets); total s; peak RSS of the planner and of the largest worker;
the chosen configuration; then ``planner_speed: worst_ratio_to_target=X`` (largest total /
target) and ``peak_rss_MiB`` (planner + workers x largest worker, an upper bound).

The plan cache is off (``AUTOPLAN_NO_PLAN_CACHE=1`` unless set): a second run would time a hit.

``--check-reduction`` also plans mid-size models with and without the repeated-block reduction
and prints both step times (the reduction must not be worse).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("AUTOPLAN_NO_PLAN_CACHE", "1")  # time the planning, not a cache hit of the last run

import torch  # noqa: E402

from tests.zoo import gpt2_lm, llama_lm, lm_loss  # noqa: E402 - lm_loss: also read as planner_speed.lm_loss


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    cluster: str
    global_batch: int
    target_s: float
    kv_heads: int = 8


CASES = [
    Case("llama3-8b", "llama", 32, 4096, 32, 14336, 128256, 8192, "8x8xH100", 512, 10.0),
    Case("llama3-70b", "llama", 80, 8192, 64, 28672, 128256, 8192, "128x8xH100", 2048, 60.0),
    Case("gpt3-175b", "gpt", 96, 12288, 96, 4 * 12288, 50257, 2048, "128x8xA100-80GB", 1536, 60.0),
]
MID_CASES = [  # small enough to plan at full depth too
    Case("llama-1b-16L", "llama", 16, 2048, 16, 8192, 32000, 2048, "2x8xH100", 256, 0.0),
    Case("gpt-350m-24L", "gpt", 24, 1024, 16, 4096, 50257, 1024, "1x8xA100-80GB", 128, 0.0),
]


def build(case: Case):  # noqa: ANN201 - (model, ids)
    """The case's model (``tests.zoo``'s GPT-2 or Llama) and one sample of token ids, on ``meta``."""
    with torch.device("meta"):
        ids = torch.randint(0, case.vocab, (1, case.seq))
        if case.family == "llama":
            model = llama_lm(layers=case.layers, hidden=case.hidden, heads=case.heads, kv_heads=case.kv_heads,
                             ffn=case.ffn, vocab=case.vocab, positions=case.seq)  # fmt: skip
        else:
            model = gpt2_lm(layers=case.layers, hidden=case.hidden, heads=case.heads, ffn=case.ffn,
                            vocab=case.vocab, positions=case.seq)  # fmt: skip
        return model, ids


PHASES = ("trace", "rebatch", "layers", "strategies", "costing", "ilp_build", "ilp_solve", "segment_sums", "search",
          "stage")  # fmt: skip
"""The phases of a plan, in CPU seconds summed over the planning process and its segment-cost
workers (``time.process_time``: what a quiet machine's cores spend, whatever else runs): the
passes (trace, rebatch, layers, strategies, costing), the segment ILPs' build and solve, the
per-segment sums of each solved plan (``segment_costs``), the search's layouts of candidates
(``best_layout``, ``hetero_layout``) and everything after the search (``stage``: the stage ILP
and the passes of the chosen plan, in wall seconds)."""


class _PhaseClock:
    """CPU seconds per phase of this process (a phase inside another is charged to the inner one
    alone) and the segment ILPs it solved (``segment_ilps``); a forked segment-cost worker
    writes its own to ``<folder>/<pid>.json`` after each ILP (:meth:`dump`), summed by :meth:`total`."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.pid = self.planner_pid = os.getpid()
        self.spent = dict.fromkeys((*PHASES, "segment_ilps"), 0.0)
        self.stack: list[list] = []  # [phase, CPU clock when it last started running]

    def timed(self, phase: str, fn):  # noqa: ANN001, ANN202 - wraps any callable
        def run(*a, **k):  # noqa: ANN002, ANN003, ANN202
            if self.pid != os.getpid():  # a forked worker: its own clock from zero
                self.pid, self.spent, self.stack = os.getpid(), dict.fromkeys(self.spent, 0.0), []
            now = time.process_time()
            if self.stack:  # the outer phase pauses
                self.spent[self.stack[-1][0]] += now - self.stack[-1][1]
            self.stack.append([phase, now])
            try:
                return fn(*a, **k)
            finally:
                now = time.process_time()
                self.spent[phase] += now - self.stack.pop()[1]
                if self.stack:
                    self.stack[-1][1] = now

        return run

    def count(self, fn):  # noqa: ANN001, ANN202
        def run(*a, **k):  # noqa: ANN002, ANN003, ANN202
            if self.pid != os.getpid():
                self.pid, self.spent, self.stack = os.getpid(), dict.fromkeys(self.spent, 0.0), []
            self.spent["segment_ilps"] += 1
            try:
                return fn(*a, **k)
            finally:
                if self.pid != self.planner_pid:  # a worker: its clock so far, for the planner to read
                    self.dump()

        return run

    def dump(self) -> None:
        Path(self.folder, f"{os.getpid()}.json").write_text(json.dumps(self.spent))

    def total(self) -> dict[str, float]:
        out = dict.fromkeys(self.spent, 0.0)
        own = self.spent if self.pid == os.getpid() else {}
        files = [json.loads(f.read_text()) for f in Path(self.folder).glob("*.json") if f.stem != str(os.getpid())]
        for spent in [own, *files]:
            for k, v in spent.items():
                out[k] += v
        return out


def run_case(case: Case, *, reduce_repeated: bool = True) -> dict:
    """One case in this process; returns the row as a dict."""
    import autoplan
    import autoplan.passes.pass_order as pass_order
    import autoplan.planner.joint as joint
    import autoplan.planner.search as search
    import autoplan.planner.segment_model as segment_model
    from autoplan.planner.solver import ShardingILP

    timers = {"trace_s": 0.0, "solve_s": 0.0, "ilps": 0, "prefetch_s": 0.0, "search_end": 0.0}
    asked: set[tuple[int, int, int, bool]] = set()  # the segment-cost keys the search asked to solve
    real_trace, real_solve, real_prefetch = (
        pass_order.TRACE.run,
        ShardingILP.solve,
        segment_model.SegmentCostModel.prefetch,
    )
    folder = tempfile.mkdtemp(prefix="planner_speed_phases_")
    clock = _PhaseClock(folder)

    def timed_prefetch(self, keys, **kwargs):  # noqa: ANN001, ANN003, ANN202
        t = time.perf_counter()
        keys_asked = list(keys)
        asked.update(segment_model._full_key(k) for k in keys_asked)  # noqa: SLF001
        try:
            return real_prefetch(self, keys_asked, **kwargs)
        finally:
            timers["prefetch_s"] += time.perf_counter() - t

    def timed_trace(*a, **k):  # noqa: ANN002, ANN003, ANN202
        t = time.perf_counter()
        try:
            return real_trace(*a, **k)
        finally:
            timers["trace_s"] += time.perf_counter() - t

    def timed_solve(self):  # noqa: ANN001, ANN202
        t = time.perf_counter()
        try:
            return real_solve(self)
        finally:
            timers["solve_s"] += time.perf_counter() - t
            timers["ilps"] += 1

    real_search = joint._search  # noqa: SLF001

    def timed_search(*a, **k):  # noqa: ANN002, ANN003, ANN202
        try:
            return real_search(*a, **k)
        finally:
            timers["search_end"] = time.perf_counter()

    pass_order.TRACE = dataclasses.replace(pass_order.TRACE, run=clock.timed("trace", timed_trace))
    for name in ("REBATCH", "LAYERS", "STRATEGIES", "COSTING"):
        entry = getattr(pass_order, name)
        setattr(pass_order, name, dataclasses.replace(entry, run=clock.timed(entry.name, entry.run)))
    segment_model.SegmentCostModel.prefetch = timed_prefetch  # type: ignore[method-assign]
    ShardingILP.solve = clock.timed("ilp_solve", timed_solve)  # type: ignore[method-assign]
    ShardingILP._build = clock.timed("ilp_build", ShardingILP._build)  # type: ignore[method-assign]  # noqa: SLF001
    segment_model.segment_costs = clock.timed("segment_sums", segment_model.segment_costs)
    search.best_layout = clock.timed("search", search.best_layout)
    search.hetero_layout = clock.timed("search", search.hetero_layout)
    joint._search = timed_search  # noqa: SLF001
    segment_model.SegmentCostModel._solve = clock.count(segment_model.SegmentCostModel._solve)  # type: ignore[method-assign]  # noqa: SLF001
    t0 = time.perf_counter()
    model, ids = build(case)
    plan = autoplan.plan(
        model, case.cluster, example_inputs=(ids,), loss_fn=lm_loss, example_targets=(ids,),
        global_batch_size=case.global_batch, precision="bf16", reduce_repeated=reduce_repeated,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        plan.save(Path(d) / "plan.json")
    total = time.perf_counter() - t0
    phases = clock.total()
    segment_ilps = int(phases.pop("segment_ilps"))
    phases["stage"] = time.perf_counter() - timers["search_end"] if timers["search_end"] else 0.0
    shutil.rmtree(folder, ignore_errors=True)
    red = plan.solver.get("reduction", {})
    return {
        "case": case.name,
        "layers": case.layers,
        "devices": plan.cluster.world_size,
        "nodes": red.get("nodes"),
        "nodes_full": red.get("nodes_full_depth"),
        "x_vars": red.get("x_variables"),
        "x_vars_full": red.get("x_variables_full_depth"),
        "edges": red.get("edges"),
        "edges_full": red.get("edges_full_depth"),
        "ilp_vars": plan.solver.get("num_variables"),
        "ilp_cons": plan.solver.get("num_constraints"),
        "ilps": timers["ilps"],
        "segment_ilps": segment_ilps,
        "trace_s": timers["trace_s"],
        "solve_s": timers["solve_s"],
        "total_s": total,
        "prefetch_s": timers["prefetch_s"],
        "phases_cpu_s": phases,
        "cpu_s": resource.getrusage(resource.RUSAGE_SELF).ru_utime
        + resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime,
        "segment_keys": len(asked),
        "cp_keys": sum(k[2] > 1 for k in asked),
        "workers": segment_model.default_workers(),
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "worker_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "config": str(plan.config),
        "step_s": plan.estimate.step_time_s,
        "mfu": plan.estimate.mfu,
        "target_s": case.target_s,
    }


def _in_subprocess(name: str, *, reduce_repeated: bool = True) -> dict:
    cmd = [sys.executable, __file__, "--case", name, "--json"] + ([] if reduce_repeated else ["--no-reduction"])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", help="run one case in this process")
    ap.add_argument("--json", action="store_true", help="print the row as JSON (with --case)")
    ap.add_argument("--no-reduction", action="store_true", help="trace and solve the full depth")
    ap.add_argument(
        "--check-reduction", action="store_true", help="also compare with/without reduction on mid-size models"
    )
    args = ap.parse_args()
    by_name = {c.name: c for c in CASES + MID_CASES}
    if args.case:
        row = run_case(by_name[args.case], reduce_repeated=not args.no_reduction)
        print(json.dumps(row) if args.json else row)
        return 0
    rows = [_in_subprocess(c.name) for c in CASES]
    head = ("case", "layers", "GPUs", "nodes solved/full", "x vars solved/full", "edges solved/full", "ILPs",
            "trace s", "solve s", "segment costs s (workers)", "keys (cp)", "total s", "target s", "peak RSS MiB (worker)",
            "config", "step s", "MFU")  # fmt: skip
    print(" | ".join(head))
    for r in rows:
        print(
            f"{r['case']} | {r['layers']} | {r['devices']} | {r['nodes']}/{r['nodes_full']} | "
            f"{r['x_vars']}/{r['x_vars_full']} | {r['edges']}/{r['edges_full']} | {r['ilps']} | {r['trace_s']:.1f} | "
            f"{r['solve_s']:.1f} | {r['prefetch_s']:.1f} ({r['workers']}) | {r['segment_keys']} ({r['cp_keys']}) | "
            f"{r['total_s']:.1f} | {r['target_s']:.0f} | "
            f"{r['rss_mib']:.0f} ({r['worker_rss_mib']:.0f}) | {r['config']} | "
            f"{r['step_s']:.3f} | {r['mfu']:.1%}"
        )
    print("\nphases, CPU s summed over the planner and its workers (stage: wall s after the search)")
    print(" | ".join(("case", "segment ILPs", *PHASES, "CPU s", "wall s")))
    for r in rows:
        phases = " | ".join(f"{r['phases_cpu_s'][p]:.1f}" for p in PHASES)
        print(f"{r['case']} | {r['segment_ilps']} | {phases} | {r['cpu_s']:.1f} | {r['total_s']:.1f}")
    if args.check_reduction:
        print("\nreduction check: step time with / without the repeated-block reduction")
        for c in MID_CASES:
            a, b = _in_subprocess(c.name), _in_subprocess(c.name, reduce_repeated=False)
            verdict = "same or better" if a["step_s"] <= b["step_s"] * 1.0001 else "WORSE"
            print(
                f"{c.name}: reduced {a['step_s']:.4f}s [{a['config']}] in {a['total_s']:.1f}s | full depth "
                f"{b['step_s']:.4f}s [{b['config']}] in {b['total_s']:.1f}s | {verdict}"
            )
    worst = max(r["total_s"] / r["target_s"] for r in rows)
    # the planner's memory: its own peak plus every worker's (a bound: their peaks need not coincide)
    peak = max(r["rss_mib"] + r["workers"] * r["worker_rss_mib"] for r in rows)
    print(f"planner_speed: worst_ratio_to_target={worst:.2f} peak_rss_MiB={peak:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
