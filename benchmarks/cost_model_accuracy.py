"""Cost model against the hardware: predicted vs measured step time and peak memory per rank.

    python benchmarks/cost_model_accuracy.py                # calibrate, profile, plan, run, compare
    python benchmarks/cost_model_accuracy.py --cluster-profile cpu2.yaml   # reuse a calibration

On 2 CPU ranks (gloo, one thread each) it

1. calibrates the collectives (``autoplan calibrate --cluster 2xCPU``) unless a cluster profile
   is given,
2. profiles every (op, local shape) of a GPT-2-style model's training step on this CPU
   (``autoplan.runtime.op_timing``) into a fresh profile database, so that op times and step times are
   measured under the same load (``--profile-db`` reuses and extends a given one),
3. builds several plans for the same model (pure data parallel, tensor parallel, parameter
   sharded, mixes, and the solver's own choice), each costed with the profiled times and the
   calibrated links,
4. runs each plan for real under ``torchrun`` (``autoplan.runtime.step_timing``: median step time over timed
   steps, peak live tensor bytes counted by a dispatch mode — not process RSS), in ``--rounds``
   rounds that interleave the plans; a plan's measured time is its fastest round's median (on a
   shared machine a busy spell only adds time, and it would otherwise land on whichever plans ran
   during it: one plan measured 193 ms and 263 ms in two runs 20 minutes apart on this VM),

and prints a table and the final line
``cost_model: time_err_median=X% time_err_max=Y% kendall_tau=Z mem_err_median=W%``.

    python benchmarks/cost_model_accuracy.py --from-trace [--fit-plan data-parallel]

instead calibrates the compute model from a measured step (issue #42). In each round it runs the
``--fit-plan`` configuration (planned with the analytic compute model) under ``torch.profiler``,
fits the device to rank 0's trace with ``autoplan calibrate --from-profile``, plans every *other*
configuration with that calibrated cluster (analytic op times, no profile database) and runs them
at once (a round's calibration and measurements see the same load on a shared machine). A
configuration's error is the median over the rounds of its round's error. The summary line's keys
are those above (over the other configurations, each plan's quietest round), followed by
``from_trace=NAME trace_time_err_median=X% trace_time_err_max=Y% uncalibrated_time_err_median=Z%
within_5pct=K/N`` (the uncalibrated error: each configuration planned with the uncalibrated
device, analytic op times, against the same measurement).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"  # before torch: the ranks and the profile use one thread
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tests.zoo import gpt2_lm, lm_loss  # noqa: E402

VOCAB, BATCH, SEQ = 2048, 8, 128
MiB = 2**20
TRACE_STEPS = 5
"""Profiled steps of the ``--from-trace`` mode (after one profiled warm-up step)."""

PLANS: dict[str, dict[str, str]] = {
    "data-parallel": {"input_0": "S(0)", "target_0": "S(0)", "*": "R"},
    # Megatron tensor parallelism: column-parallel qkv/fc, row-parallel projections
    "tensor-parallel": {
        "input_0": "R",
        "target_0": "R",
        "*attn.c_attn.weight": "S(1)",
        "*attn.c_proj.weight": "S(0)",
        "*mlp.c_fc.weight": "S(1)",
        "*mlp.c_proj.weight": "S(0)",
    },
    "tensor-parallel-attention": {
        "input_0": "R",
        "target_0": "R",
        "*attn.c_attn.weight": "S(1)",
        "*attn.c_proj.weight": "S(0)",
    },
    "tensor-parallel-mlp": {
        "input_0": "R",
        "target_0": "R",
        "*mlp.c_fc.weight": "S(1)",
        "*mlp.c_proj.weight": "S(0)",
    },
    # ZeRO-3 style: weights sharded, gathered before use, gradients reduce-scattered
    "parameter-sharded": {"input_0": "S(0)", "target_0": "S(0)", "*.weight": "S(0)"},
    "sequence-parallel": {"input_0": "S(1)", "target_0": "S(1)", "*": "R"},
    "data-parallel+sharded-embeddings": {"input_0": "S(0)", "target_0": "S(0)", "*.wte.weight": "S(0)"},
    "data-parallel+sharded-mlp-weights": {"input_0": "S(0)", "target_0": "S(0)", "*mlp.*.weight": "S(0)"},
}
"""Pins of each plan; the solver chooses everything else (so each is the best plan of its kind).
Pins on parameters and inputs do not force the operators: a plan pinned "all replicated" is
still free to shard activations, which is why there is no separate replicated baseline."""


def workload():  # noqa: ANN201 - (model, ids)
    """``tests.zoo``'s GPT-2 (2 layers, 256 wide, 4 heads), seeded, and a (BATCH, SEQ) batch of token ids."""
    torch.manual_seed(0)
    model = gpt2_lm(layers=2, hidden=256, heads=4, vocab=VOCAB, positions=SEQ)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return model, ids


# --- one rank of one plan (under torchrun) ---------------------------------------------------


def worker(plan_path: str, out_path: str, steps: int, trace_path: str | None = None) -> None:
    import torch.distributed as dist

    import autoplan
    from autoplan.runtime.step_timing import measure_training_step

    dist.init_process_group("gloo")
    try:
        plan = autoplan.Plan.load(plan_path)
        model, ids = workload()
        pm = autoplan.parallelize(
            model, plan.cluster, example_inputs=(ids,), loss_fn=lm_loss, example_targets=(ids,), plan=plan
        )
        opt = pm.make_optimizer(lr=1e-3)
        m = measure_training_step(pm, opt, (ids,), (ids,), warmup=3, steps=steps)
        result = {"step_time_s": m.step_time_s, "times_s": m.step_times_s, "peak_bytes": m.peak_bytes}
        if trace_path:
            result["profiled_step_s"] = profile_steps(pm, opt, ids, trace_path)
        Path(f"{out_path}.{dist.get_rank()}").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def profile_steps(pm, opt, ids, trace_path: str, steps: int = TRACE_STEPS) -> float:  # noqa: ANN001
    """Run ``steps`` training steps (after one warm-up) under ``torch.profiler`` with shapes
    recorded, steps marked by ``prof.step()``, and write rank 0's Chrome trace to
    ``trace_path``; returns the median wall time of the profiled steps."""
    import time

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, schedule

    def export(prof) -> None:  # noqa: ANN001
        if dist.get_rank() == 0:
            prof.export_chrome_trace(trace_path)

    times = []
    sched = schedule(wait=0, warmup=1, active=steps)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, schedule=sched, on_trace_ready=export) as prof:
        for _ in range(steps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            pm.forward_backward(ids, targets=(ids,))
            opt.step()
            dist.barrier()
            times.append(time.perf_counter() - t0)
            prof.step()
    return statistics.median(times[1:])


# --- driver ----------------------------------------------------------------------------------


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a between two rankings (pairs tied in either count as discordant halves)."""
    concordant = discordant = 0.0
    for i, j in itertools.combinations(range(len(a)), 2):
        s = (a[i] - a[j]) * (b[i] - b[j])
        if s > 0:
            concordant += 1
        elif s < 0:
            discordant += 1
        else:
            concordant += 0.5
            discordant += 0.5
    pairs = len(a) * (len(a) - 1) / 2
    return (concordant - discordant) / pairs if pairs else 1.0


def calibrate(out: Path) -> None:
    cmd = [sys.executable, "-m", "autoplan.tools.cli", "calibrate", "--cluster", "2xCPU", "--out", str(out), "--quiet"]
    print("calibrating collectives:", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def bench_workload():  # noqa: ANN201
    """The benchmark's model as an ``autoplan.Workload`` (for ``autoplan profile``)."""
    import autoplan

    model, ids = workload()
    return autoplan.Workload(
        model=model, example_inputs=(ids,), loss_fn=lm_loss, example_targets=(ids,), optimizer="adam"
    )


def profile(cluster_file: Path, db_path: str | None):  # noqa: ANN201
    """``autoplan profile`` with 2 concurrent processes (the 2 ranks share this machine)."""
    from autoplan.cost_models.profile_db import ProfileDB

    cmd = [sys.executable, "-m", "autoplan.tools.cli", "profile", f"{Path(__file__).resolve()}:bench_workload"]
    cmd += ["--cluster", str(cluster_file), "--concurrent", "2", "--quiet"]
    cmd += ["--profile-db", db_path] if db_path else []
    print("profiling ops:", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return ProfileDB.open_path(db_path) if db_path else ProfileDB.open_for_current_device("cpu")


def make_plan(name: str, cluster, db):  # noqa: ANN001, ANN201 - (name, Cluster, ProfileDB | None) -> Plan
    """The plan of configuration ``name`` (its pins, the solver's choice of the rest) on ``cluster``,
    its op times from ``db`` (``None``: the analytic compute model)."""
    import autoplan

    with torch.device("meta"):
        model, ids = workload()
    return autoplan.plan(
        model,
        cluster,
        example_inputs=(ids,),
        loss_fn=lm_loss,
        example_targets=(ids,),
        optimizer="adam",
        pins=PLANS[name],
        profile=db,
    )


def run_plan(plan_file: Path, out: Path, steps: int, trace: Path | None = None) -> dict:
    """Run ``plan_file`` on 2 ranks under torchrun; the slowest rank's median step, each rank's
    peak bytes (and, with ``trace``, rank 0's profiler trace written there and the profiled step)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29561",
        str(Path(__file__).resolve()), "--steps", str(steps), "--worker", str(plan_file), str(out),
        *(["--trace-out", str(trace)] if trace is not None else []),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    result = {"step_s": max(r["step_time_s"] for r in ranks), "peak_bytes": [r["peak_bytes"] for r in ranks]}
    if trace is not None:
        result["profiled_step_s"] = max(r["profiled_step_s"] for r in ranks)
    return result


def run_rounds(plans: dict, tmpdir: Path, *, rounds: int, steps: int) -> dict[str, list[dict]]:
    """Every plan run ``rounds`` times, interleaved (module docstring, step 4)."""
    measured: dict[str, list[dict]] = {name: [] for name in plans}
    for round_ in range(rounds):
        for name in plans:
            measured[name].append(run_plan(tmpdir / f"{name}.json", tmpdir / f"{name}.{round_}.result", steps))
            print(
                f"  round {round_ + 1}/{rounds} {name}: predicted {plans[name].estimate.step_time_s * 1e3:.1f} "
                f"ms, measured {measured[name][-1]['step_s'] * 1e3:.1f} ms",
                flush=True,
            )
    return measured


def result_row(name: str, plan, measured: list[dict]) -> dict:  # noqa: ANN001
    e = plan.estimate
    return {
        "plan": name,
        "pred_ms": e.step_time_s * 1e3,
        # a busy machine only adds time: the quietest round's median
        "meas_ms": min(m["step_s"] for m in measured) * 1e3,
        "pred_mib": e.memory_bytes["total"] / MiB,
        "meas_mib": [b / MiB for b in measured[0]["peak_bytes"]],
        "sources": dict(e.compute_sources),
    }


def print_rows(rows: list[dict]) -> tuple[list[float], list[float]]:
    """The table of predicted against measured; returns the |time errors| and |memory errors|."""
    print()
    header = f"{'plan':<34} {'predicted ms':>12} {'measured ms':>11} {'err':>7}   {'pred MiB':>8} {'meas MiB (r0/r1)':>17} {'err':>6}"
    print(header)
    print("-" * len(header))
    time_errs, mem_errs = [], []
    for r in rows:
        terr = (r["pred_ms"] - r["meas_ms"]) / r["meas_ms"]
        merrs = [(r["pred_mib"] - m) / m for m in r["meas_mib"]]
        time_errs.append(abs(terr))
        mem_errs += [abs(m) for m in merrs]
        meas = "/".join(f"{m:.1f}" for m in r["meas_mib"])
        print(
            f"{r['plan']:<34} {r['pred_ms']:>12.1f} {r['meas_ms']:>11.1f} {terr:>+7.1%}   "
            f"{r['pred_mib']:>8.1f} {meas:>17} {max(merrs, key=abs):>+6.1%}"
        )
    return time_errs, mem_errs


def summary_line(rows: list[dict], time_errs: list[float], mem_errs: list[float], extra: str = "") -> str:
    tau = kendall_tau([r["pred_ms"] for r in rows], [r["meas_ms"] for r in rows])
    return (
        f"cost_model: time_err_median={statistics.median(time_errs):.1%} time_err_max={max(time_errs):.1%} "
        f"kendall_tau={tau:.2f} mem_err_median={statistics.median(mem_errs):.1%}{extra}"
    )


def from_trace(args: argparse.Namespace, cluster_file: Path, names: list[str], tmpdir: Path) -> int:
    """``--from-trace`` (module docstring): in each of ``--rounds`` rounds, run the ``--fit-plan``
    configuration with the profiler on, calibrate the compute model from rank 0's trace
    (``autoplan calibrate --from-profile``), plan every other configuration with that calibrated
    cluster (analytic op times: no profile database) and run them right after, so that a round's
    predictions and measurements see the same load. A configuration's error is the median over
    rounds of its round's error; the fitted configuration is shown for reference and left out of
    every error."""
    from autoplan.cost_models.cluster import Cluster

    fit_name = args.fit_plan
    others = [n for n in names if n != fit_name]
    if fit_name not in PLANS or not others:
        raise SystemExit(f"--fit-plan {fit_name!r} must be one of {', '.join(PLANS)} and --plans must name others")
    base = Cluster.from_file(cluster_file)
    make_plan(fit_name, base, None).save(tmpdir / "fit-plan.json")
    uncalibrated = {name: make_plan(name, base, None).estimate for name in others}
    rounds: list[dict] = []
    for round_ in range(args.rounds):
        trace = tmpdir / f"trace.{round_}.json"
        traced = run_plan(tmpdir / "fit-plan.json", tmpdir / f"fit.{round_}.result", args.steps, trace=trace)
        calibrated_file = tmpdir / f"calibrated.{round_}.yaml"
        cmd = [sys.executable, "-m", "autoplan.tools.cli", "calibrate", "--from-profile", str(trace)]
        cmd += ["--plan", str(tmpdir / "fit-plan.json"), "--out", str(calibrated_file), *(["--quiet"] if round_ else [])]
        print(f"round {round_ + 1}/{args.rounds}: calibrating from the trace:", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        if args.calibrated_out and round_ == 0:
            Path(args.calibrated_out).write_bytes(calibrated_file.read_bytes())
        calibrated = Cluster.from_file(calibrated_file)
        plans = {name: make_plan(name, calibrated, None) for name in [fit_name, *others]}
        result = {"fit": traced, "pred": {}, "meas": {}, "plans": plans}
        for name, plan in plans.items():
            plan.save(tmpdir / f"{name}.json")
            run = traced if name == fit_name else run_plan(tmpdir / f"{name}.json", tmpdir / f"{name}.{round_}.result", args.steps)
            result["pred"][name], result["meas"][name] = plan.estimate.step_time_s * 1e3, run
            print(
                f"  {name}: predicted {result['pred'][name]:.1f} ms, measured {run['step_s'] * 1e3:.1f} ms"
                + (f" ({traced['profiled_step_s'] * 1e3:.1f} ms profiled: the trace fitted)" if name == fit_name else ""),
                flush=True,
            )
        rounds.append(result)
    return _from_trace_report(fit_name, others, rounds, uncalibrated)


def _from_trace_report(fit_name: str, others: list[str], rounds: list[dict], uncalibrated: dict) -> int:
    """The table of the ``--from-trace`` mode and its summary line."""
    print(f"\nfitted on {fit_name}, predicted with the round's calibration, medians over {len(rounds)} rounds:")
    header = f"{'plan':<34} {'uncalibrated ms':>15} {'calibrated ms':>13} {'measured ms':>11} {'err':>7} {'uncal err':>9}"
    print(header)
    print("-" * len(header))
    errs, uncal, rows = [], [], []
    for name in [fit_name, *others]:
        pred = statistics.median(r["pred"][name] for r in rounds)
        meas = statistics.median(r["meas"][name]["step_s"] * 1e3 for r in rounds)
        err = statistics.median((r["pred"][name] - r["meas"][name]["step_s"] * 1e3) / (r["meas"][name]["step_s"] * 1e3) for r in rounds)
        if name == fit_name:
            print(f"{name + ' (fitted)':<34} {'':>15} {pred:>13.1f} {meas:>11.1f} {err:>+7.1%}")
            continue
        u_ms = uncalibrated[name].step_time_s * 1e3
        u = statistics.median((u_ms - r["meas"][name]["step_s"] * 1e3) / (r["meas"][name]["step_s"] * 1e3) for r in rounds)
        errs.append(abs(err))
        uncal.append(abs(u))
        print(f"{name:<34} {u_ms:>15.1f} {pred:>13.1f} {meas:>11.1f} {err:>+7.1%} {u:>+9.1%}")
        quietest = min(rounds, key=lambda r: r["meas"][name]["step_s"])
        rows.append(result_row(name, quietest["plans"][name], [quietest["meas"][name]]))
    time_errs, mem_errs = print_rows(rows)  # the quietest round of each plan, as the default mode
    extra = (
        f" from_trace={fit_name} trace_time_err_median={statistics.median(errs):.1%} "
        f"trace_time_err_max={max(errs):.1%} uncalibrated_time_err_median={statistics.median(uncal):.1%} "
        f"within_5pct={sum(e <= 0.05 for e in errs)}/{len(errs)}"
    )
    print(summary_line(rows, time_errs, mem_errs, extra))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cluster-profile", help="calibrated cluster file (calibrated now and written there if missing)"
    )
    parser.add_argument(
        "--profile-db",
        help="profile database to use and extend (default: a fresh one, profiled now, next to the runs it predicts)",
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per plan (after 3 warm-up steps)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="runs of every plan, interleaved (its time: the fastest round's median)"
    )
    parser.add_argument("--plans", help="comma-separated subset of: " + ", ".join(PLANS))
    parser.add_argument(
        "--from-trace",
        action="store_true",
        help="calibrate compute from a profiler trace of --fit-plan, predict the other plans analytically",
    )
    parser.add_argument("--fit-plan", default="data-parallel", help="with --from-trace: the configuration traced")
    parser.add_argument("--calibrated-out", help="with --from-trace: also keep the calibrated cluster file here")

    parser.add_argument("--worker", nargs=2, metavar=("PLAN", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--trace-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.steps, args.trace_out)
        return 0

    from autoplan.cost_models.cluster import Cluster

    with tempfile.TemporaryDirectory(prefix="autoplan-accuracy-") as tmp:
        tmpdir = Path(tmp)
        cluster_file = Path(args.cluster_profile) if args.cluster_profile else tmpdir / "cpu2.yaml"
        if not cluster_file.exists():
            calibrate(cluster_file)
        names = args.plans.split(",") if args.plans else list(PLANS)
        if args.from_trace:
            return from_trace(args, cluster_file, names, tmpdir)
        cluster = Cluster.from_file(cluster_file)
        # op times measured now, not in the cache from another day: this VM's speed drifts by as
        # much as the error measured (the same plan 193 and 263 ms 20 minutes apart)
        db = profile(cluster_file, args.profile_db or str(tmpdir / "profile.json"))
        plans = {}
        for name in names:
            plans[name] = make_plan(name, cluster, db)
            plans[name].save(tmpdir / f"{name}.json")
        measured = run_rounds(plans, tmpdir, rounds=args.rounds, steps=args.steps)
        rows = [result_row(name, plans[name], measured[name]) for name in names]

    time_errs, mem_errs = print_rows(rows)
    print(f"op times: {rows[0]['sources']} (profiled/analytic op and optimizer timings of the first plan)")
    print(summary_line(rows, time_errs, mem_errs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
