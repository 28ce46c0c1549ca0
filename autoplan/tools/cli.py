"""``autoplan`` command line: a thin layer over the Python API.

    autoplan plan  my_models.py:build --cluster 4xCPU --out plan.json
    autoplan show  plan.json
    autoplan explain plan.json --op addmm_3           # the alternatives the solver weighed
    autoplan diff  old.json new.json
    autoplan report plan.json -o plan.html            # self-contained HTML review page
    autoplan export-onnx plan.json -o model.onnx      # the model with the plan as ONNX sharding annotations
    autoplan bench benchmarks/suite.yaml --baseline benchmarks/suite_baseline.json   # CI: estimate regressions
    autoplan run   my_models.py:build --plan plan.json --steps 10        # launches torchrun
    autoplan plan  my_models.py:build --cluster 4x8xH100 --global-batch-size 512 --out plan.json
    autoplan estimate my_models.py:build --cluster 4x8xH100 --global-batch-size 512 \
                   --config dp=8,tp=4,pp=1,microbatch_size=2,num_microbatches=32

Bad input (untraceable model, malformed cluster or plan file, plan for another model or world
size, model that cannot fit) prints one line ``autoplan: error: ...`` and exits with code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from autoplan.cost_models.memory import OPTIMIZERS
from autoplan.tools import bench, console, launch, report
from autoplan.tools import calibrate as calibrate_cmd
from autoplan.tools import profile as profile_cmd

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's bad-input contract: one line ``autoplan: error: ...``, exit code 2
    (argparse's default prints the whole usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"autoplan: error: {message}; see `{self.prog} --help`\n")


def _number(convert: Callable[[str], Any], what: str, ok: Callable[[Any], bool]) -> Callable[[str], Any]:
    """An argparse ``type=`` that converts with ``convert`` and accepts values where ``ok``."""

    def parse(text: str) -> Any:
        from autoplan.cost_models.echo import clip_text

        shown = clip_text(text, 40)
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {shown!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {shown}")
        return value

    return parse


_positive_int = _number(int, "a positive integer", lambda v: v >= 1)
_non_negative_int = _number(int, "an integer >= 0", lambda v: v >= 0)
_positive_float = _number(float, "a positive number", lambda v: 0 < v < float("inf"))
_seed = _number(int, "an integer seed in 0..2**63-1", lambda v: 0 <= v < 2**63)
_port = _number(int, "a TCP port in 1..65535", lambda v: 1 <= v <= 65535)
DEFAULT_MASTER_PORT = 29533


def _cluster(spec: str, mesh: str | None, *, recalibrate: bool = False):  # noqa: ANN202 - Cluster, lazily
    """``--cluster`` (preset or file) with ``--mesh``. ``recalibrate``: a file's links and
    calibration are dropped and its software versions not checked (``autoplan calibrate`` redoes them)."""
    from autoplan.cost_models.cluster import Cluster
    from autoplan.cost_models.errors import ClusterSpecError

    mesh_shape = None
    if mesh:
        try:
            mesh_shape = tuple(int(x) for x in mesh.split(","))
        except ValueError as exc:
            raise ClusterSpecError(f"--mesh {mesh!r} is malformed: expected sizes like 2,2") from exc
    if Path(spec).suffix.lower() in (".yaml", ".yml", ".json") or _names_a_file(spec):
        cluster = Cluster.from_file(spec, check_versions=not recalibrate)
        if recalibrate:
            cluster = dataclasses.replace(cluster, links={}, calibration=None)
        return cluster.with_mesh(mesh_shape) if mesh_shape else cluster
    return Cluster.preset(spec, mesh_shape=mesh_shape)


def _names_a_file(path: str) -> bool:
    """Something other than a directory is at ``path`` (a file, ``/dev/zero``, a FIFO: read as a
    cluster file, within bounds); False for a name the OS refuses (too long, a NUL byte)."""
    try:
        return Path(path).exists() and not Path(path).is_dir()
    except (OSError, ValueError):
        return False


def _pins(items: Sequence[str]) -> dict[str, str]:
    from autoplan.cost_models.errors import PlanError

    pins = {}
    for item in items:
        if "=" not in item:
            raise PlanError(f"--pin {item!r} is malformed: expected NAME=SPEC like 'input_0=S(0),R'")
        name, spec = item.split("=", 1)
        pins[name.strip()] = spec.strip()
    return pins


def _config(text: str | None):  # noqa: ANN202 - ParallelConfig | None, imported lazily
    """``--config dp=2,tp=2,pp=2,microbatch_size=1,num_microbatches=8,schedule=1f1b``
    (per-stage degrees as ``stage_dp=1/1/2/4``)."""
    if not text:
        return None
    from autoplan.cost_models.config import REMOVED_FIELDS, ParallelConfig, field_name_problem
    from autoplan.cost_models.errors import ConfigError

    fields = {f.name: f for f in dataclasses.fields(ParallelConfig)}
    values: dict[str, object] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if key in REMOVED_FIELDS:
            raise ConfigError(f"--config: {field_name_problem([key])}: remove it")
        if not sep or key not in fields:
            raise ConfigError(
                f"--config item {item!r} is malformed: expected KEY=VALUE with KEY one of {', '.join(fields)}"
            )
        if key in ("schedule", "recompute"):
            values[key] = value
        elif key == "stage_dp":
            try:
                values[key] = tuple(int(v) for v in value.split("/"))
            except ValueError as exc:
                raise ConfigError(f"--config stage_dp={value!r}: expected degrees like 1/1/2/4") from exc
        else:
            try:
                values[key] = int(value)
            except ValueError as exc:
                raise ConfigError(f"--config {key}={value!r}: expected an integer") from exc
    return ParallelConfig(**values)  # type: ignore[arg-type]


def _make_plan(args: argparse.Namespace):  # noqa: ANN202
    from autoplan.api import plan as make_plan
    from autoplan.cost_models.errors import ConfigError
    from autoplan.tools.loader import build_workload

    if args.config and args.global_batch_size is None:
        raise ConfigError("--config needs --global-batch-size N (the configuration splits a global batch)")
    cluster = _cluster(args.cluster, args.mesh)
    wl = build_workload(args.target, device="meta", seed=args.seed)
    return make_plan(
        wl.model,
        cluster,
        example_inputs=wl.example_inputs,
        loss_fn=wl.loss_fn,
        example_targets=wl.example_targets,
        optimizer=args.optimizer or wl.optimizer,
        pins=_pins(args.pin),
        time_limit_s=args.time_limit,
        profile=None if args.no_profile else (args.profile_db or "auto"),
        global_batch_size=args.global_batch_size,
        precision=args.precision,
        config=_config(args.config),
    )


def cmd_estimate(args: argparse.Namespace) -> int:
    from autoplan.cost_models.errors import ConfigError
    from autoplan.planner.joint import estimate
    from autoplan.tools.loader import build_workload

    config = _config(args.config)
    if config is None or args.global_batch_size is None:
        raise ConfigError("autoplan estimate needs --config KEY=VALUE,... and --global-batch-size N")
    wl = build_workload(args.target, device="meta", seed=args.seed)
    est = estimate(
        wl.model, _cluster(args.cluster, None), wl.example_inputs, config=config,
        global_batch_size=args.global_batch_size, loss_fn=wl.loss_fn, example_targets=wl.example_targets,
        precision=args.precision, optimizer=args.optimizer or wl.optimizer,
    )  # fmt: skip
    if args.json:
        d = dataclasses.asdict(est)
        d["config"] = config.to_dict()
        print(json.dumps(d), file=console.stdout())
    else:
        print(est.summary(), file=console.stdout())
    return 0


def _inputs(args: argparse.Namespace) -> dict[str, str | None]:
    """The files a planning command reads (label -> path), which no output may overwrite."""
    from autoplan.tools.loader import target_file

    return {
        "model file": target_file(args.target),
        "cluster file": getattr(args, "cluster", None),
        "profile database": getattr(args, "profile_db", None),
        "plan file": getattr(args, "plan", None),
    }


def cmd_plan(args: argparse.Namespace) -> int:
    from autoplan.cost_models.files import refuse_overwriting_inputs

    refuse_overwriting_inputs(args.out, _inputs(args))  # before planning, which may take long
    plan = dataclasses.replace(_make_plan(args), workload=args.target)
    plan.save(args.out, timings=args.timings)
    if args.json:
        print(json.dumps(plan.to_dict()["estimate"]), file=console.stdout())
    elif not args.quiet:
        print(plan.summary(), file=console.stdout())
        print(f"wrote {args.out}", file=console.stdout())
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from autoplan.planner.plan import Plan

    plan = Plan.load(args.plan)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1), file=console.stdout())
    else:
        from autoplan.tools.review import show_text

        console.stdout().write(show_text(plan))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from autoplan.planner.plan import Plan
    from autoplan.tools.review import explain, explain_text

    ex = explain(Plan.load(args.plan), op=args.op, param=args.param)
    if args.json:
        print(json.dumps(ex.to_dict(), indent=1), file=console.stdout())
    else:
        console.stdout().write(explain_text(ex))
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from autoplan.planner.plan import Plan
    from autoplan.tools.review import diff_plans, diff_text

    d = diff_plans(Plan.load(args.a), Plan.load(args.b))
    if args.json:
        print(json.dumps(d, indent=1), file=console.stdout())
    else:
        console.stdout().write(diff_text(d, limit=args.limit))
    return 0


def _check_writable(option: str, path: Path, *, is_dir: bool) -> None:
    """Refuse (PlanError) an output ``path`` the ranks could not write, before anything runs:
    ``is_dir``, a directory made if missing (its nearest existing ancestor must take a new
    entry); else a file whose directory exists. Writability is probed with a temporary file
    (permission bits do not stop root; a read-only filesystem stops everyone); nothing is left."""
    from autoplan.cost_models.errors import PlanError

    shown = str(path)[:200]
    try:
        _probe_writable(option, shown, path, is_dir=is_dir)
    except PlanError:
        raise
    except (OSError, ValueError) as exc:  # a name the OS refuses (too long, a NUL byte)
        raise PlanError(f"{option} {shown} cannot be used: {getattr(exc, 'strerror', None) or exc}") from None


def _probe_writable(option: str, shown: str, path: Path, *, is_dir: bool) -> None:
    from autoplan.cost_models.errors import PlanError

    if not is_dir and path.is_dir():
        raise PlanError(f"{option} {shown} is a directory: give a file name for the trained parameters")
    existing = path if is_dir else path.parent
    if not is_dir and not existing.exists():
        raise PlanError(f"{option} {shown}: directory {str(existing)[:200]} does not exist: create it first")
    while is_dir and not existing.exists() and existing != existing.parent:
        existing = existing.parent  # the directory is made if missing: its ancestor must be writable
    if not existing.is_dir():
        raise PlanError(f"{option} {shown}: {str(existing)[:200]} is not a directory: give a path in a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".autoplan-write-check-")
    except OSError as exc:
        raise PlanError(
            f"{option} {shown} cannot be written ({str(existing)[:200]}: {exc.strerror}): give a writable location"
        ) from None
    os.close(fd)
    os.unlink(probe)


def cmd_run(args: argparse.Namespace) -> int:
    from autoplan.cost_models.errors import PlanError, PlanMismatchError
    from autoplan.passes.trace import trace_training_step
    from autoplan.planner.ilp import check_plan_fits
    from autoplan.planner.plan import Plan
    from autoplan.tools.loader import build_workload

    if args.plan is None and args.cluster is None:
        raise PlanError("autoplan run needs --plan plan.json or --cluster SPEC to plan first")
    if args.save_final is not None:
        from autoplan.cost_models.files import refuse_overwriting_inputs

        refuse_overwriting_inputs(args.save_final, _inputs(args), option="--save-final")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise PlanError(f"--checkpoint-every {args.checkpoint_every}: give a number of steps >= 1")
    if args.checkpoint_every is not None and args.checkpoint_dir is None:
        raise PlanError("--checkpoint-every needs --checkpoint-dir DIR to write the checkpoints into")
    if args.checkpoint_dir is not None and Path(args.checkpoint_dir).is_file():
        raise PlanError(f"--checkpoint-dir {args.checkpoint_dir!r} is a file: give a directory (made if missing)")
    if args.max_restarts < 0:
        raise PlanError(f"--max-restarts {args.max_restarts}: give a number >= 0")
    # where the ranks write, and their port, are checked before any planning or training
    if args.checkpoint_dir is not None:
        _check_writable("--checkpoint-dir", Path(args.checkpoint_dir), is_dir=True)
    if args.save_final is not None:
        _check_writable("--save-final", Path(args.save_final), is_dir=False)
    master_port = launch.master_port(args.master_port, default=DEFAULT_MASTER_PORT)
    if args.plan is None and args.global_batch_size is not None:  # the ranks train on the workload's batch
        inputs = build_workload(args.target, device="meta", seed=args.seed).example_inputs
        batch = int(inputs[0].shape[0]) if inputs and inputs[0].dim() else 0
        if batch != args.global_batch_size:
            raise PlanMismatchError(
                f"--global-batch-size {args.global_batch_size} does not match the {batch} samples of the workload's "
                f"inputs, which `autoplan run` trains on: give --global-batch-size {batch} or change the workload"
            )
    if args.plan is None and args.nproc is not None:  # check before planning, which may take long
        cluster = _cluster(args.cluster, args.mesh)
        if args.nproc != cluster.world_size:
            raise PlanMismatchError(
                f"--nproc {args.nproc} does not match the {cluster.world_size} devices of --cluster {args.cluster}: "
                f"drop --nproc or plan for a cluster of {args.nproc} devices"
            )
    tmpdir = None
    if args.plan is not None:
        plan = Plan.load(args.plan)
        plan_path = args.plan
        if args.nproc is not None and args.nproc != plan.world_size:
            raise PlanMismatchError(
                f"--nproc {args.nproc} does not match the plan's {plan.world_size} devices: "
                f"drop --nproc or re-plan for {args.nproc} devices"
            )
        # check the plan fits this model before launching any rank (a meta trace is cheap)
        wl = build_workload(args.target, device="meta", seed=args.seed)
        if plan.config is not None:  # a plan for a global batch is made for one micro-batch's step
            from autoplan.planner.tracing import trace_for_plan

            traced = trace_for_plan(plan, wl.model, wl.example_inputs, wl.example_targets, wl.loss_fn)
        else:
            traced = trace_training_step(
                wl.model, wl.example_inputs, loss_fn=wl.loss_fn, example_targets=wl.example_targets
            )
        plan.check_applies_to(fingerprint=traced.fingerprint, world_size=plan.world_size)
        check_plan_fits(plan, traced)  # a hand-edited entry is named here, not in every rank
    else:
        plan = _make_plan(args)
        tmpdir = tempfile.mkdtemp(prefix="autoplan-")
        plan_path = os.path.join(tmpdir, "plan.json")
        plan.save(plan_path)
    if args.checkpoint_dir is not None:
        from autoplan.runtime.checkpoint import check_compatible, find_latest

        latest = find_latest(args.checkpoint_dir)
        if latest is not None:  # a checkpoint that cannot be resumed fails here, not in every rank
            model = build_workload(args.target, device="meta", seed=args.seed).model
            check_compatible(latest, plan, {n: tuple(p.shape) for n, p in model.named_parameters()})
    if not args.quiet:
        print(plan.summary(), file=console.stdout(), flush=True)
    restarts = ["--max-restarts", str(args.max_restarts)] if args.max_restarts else []
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(plan.world_size),
        "--nnodes",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(master_port),
        *restarts,
        "-m",
        "autoplan.tools.worker",
        args.target,
        "--plan",
        plan_path,
        "--steps",
        str(args.steps),
        "--seed",
        str(args.seed),
    ]
    if args.compare:
        cmd.append("--compare")
    if args.show_code:
        cmd.append("--show-code")
    if args.checkpoint_dir is not None:
        cmd += ["--checkpoint-dir", os.path.abspath(args.checkpoint_dir)]
    if args.checkpoint_every is not None:
        cmd += ["--checkpoint-every", str(args.checkpoint_every)]
    if args.save_final is not None:
        cmd += ["--save-final", os.path.abspath(args.save_final)]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if not args.verbose:
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        env.setdefault("LOGLEVEL", "ERROR")
        env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        rc = launch.call_torchrun(cmd, env=env, stdout=console.subprocess_stdout())
    finally:
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)
    return EXIT_BAD_INPUT if rc == EXIT_BAD_INPUT else rc


def _cmd_export_onnx(args: argparse.Namespace) -> int:
    from autoplan.tools.export_onnx import cmd_export_onnx  # imports torch: not for `autoplan --help`

    return cmd_export_onnx(args)


def _add_export_onnx_parser(subparsers: Any) -> None:  # argparse._SubParsersAction has no public type
    """Register ``autoplan export-onnx`` (``autoplan/tools/export_onnx.py``)."""
    p = subparsers.add_parser(
        "export-onnx", help="write the traced model as ONNX with the plan as multi-device sharding annotations"
    )
    p.add_argument("plan", help="plan file from `autoplan plan`")
    p.add_argument("--out", "-o", required=True, help="ONNX file to write")
    p.add_argument(
        "--model", metavar="FILE.py:FUNCTION", help="the model the plan is for (default: the plan's workload)"
    )
    p.add_argument("--seed", type=_seed, default=0, help=argparse.SUPPRESS)
    p.add_argument("--quiet", "-q", action="store_true", help="print nothing on success")
    p.set_defaults(func=_cmd_export_onnx)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autoplan", description="Automatic parallelism planner for PyTorch.")
    parser.add_argument("--verbose", "-v", action="store_true", help="log planner progress")
    sub = parser.add_subparsers(dest="command", required=True)

    def add_planning(p: argparse.ArgumentParser, *, cluster_required: bool) -> None:
        p.add_argument("target", help="FILE.py:FUNCTION returning autoplan.Workload")
        p.add_argument("--cluster", required=cluster_required, help="preset like 4xCPU, 2x8xH100, or a YAML/JSON file")
        p.add_argument("--mesh", help="logical mesh shape, e.g. 2,2 (default: nodes x devices)")
        p.add_argument("--optimizer", choices=OPTIMIZERS, help="default: the workload's optimizer")
        p.add_argument(
            "--pin", action="append", default=[], metavar="NAME=SPEC", help="fix a placement, e.g. input_0=S(0)"
        )
        p.add_argument("--time-limit", type=_positive_float, default=120.0, help="solver time limit in seconds")
        p.add_argument(
            "--profile-db",
            metavar="PATH",
            help="measured op times (`autoplan profile`); default: this machine's database when the cluster "
            "is made of this machine's device",
        )
        p.add_argument("--no-profile", action="store_true", help="use analytic op times only")
        p.add_argument("--seed", type=_seed, default=0, help="random seed of the model's weights (0..2**63-1)")
        p.add_argument("--quiet", "-q", action="store_true")
        p.add_argument(
            "--global-batch-size",
            type=_positive_int,
            help="plan data/tensor/pipeline degrees, micro-batches, schedule, recomputation and ZeRO for this "
            "global batch (joint search); the workload's inputs then give per-sample shapes",
        )
        p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"), help="training precision")
        p.add_argument(
            "--config",
            metavar="KEY=VALUE,...",
            help="fix the configuration, e.g. dp=2,tp=2,pp=2,microbatch_size=1,num_microbatches=8,schedule=1f1b",
        )

    p_plan = sub.add_parser("plan", help="plan a model for a cluster and write plan.json")
    add_planning(p_plan, cluster_required=True)
    p_plan.add_argument("--out", "-o", required=True, help="plan file to write (JSON)")
    p_plan.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p_plan.add_argument(
        "--timings",
        action="store_true",
        help="also write the solver's wall-clock times (the file then differs per run)",
    )
    p_plan.set_defaults(func=cmd_plan)

    p_est = sub.add_parser("estimate", help="price a hand-written configuration with the planner's cost model")
    add_planning(p_est, cluster_required=True)
    p_est.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p_est.set_defaults(func=cmd_estimate)

    p_show = sub.add_parser(
        "show", help="print a plan file for review: mesh and stages, time, memory per device, placements, collectives"
    )
    p_show.add_argument("plan")
    p_show.add_argument("--json", action="store_true", help="print the whole plan as JSON")
    p_show.set_defaults(func=cmd_show)

    p_explain = sub.add_parser(
        "explain", help="the placements the solver considered for one op or parameter, their costs, and why one won"
    )
    p_explain.add_argument("plan")
    p_explain.add_argument("--op", metavar="NAME", help="graph node name (see `autoplan show --json`, key nodes)")
    p_explain.add_argument("--param", metavar="NAME", help="parameter name, e.g. transformer.h.0.attn.c_attn.weight")
    p_explain.add_argument("--json", action="store_true", help="print the explanation as JSON")
    p_explain.set_defaults(func=cmd_explain)

    p_diff = sub.add_parser("diff", help="what changed between two plans, with the estimated effect")
    p_diff.add_argument("a", help="plan file (before)")
    p_diff.add_argument("b", help="plan file (after)")
    p_diff.add_argument("--json", action="store_true", help="print the whole difference as JSON")
    p_diff.add_argument("--limit", type=_positive_int, default=20, help="changed placements listed (default 20)")
    p_diff.set_defaults(func=cmd_diff)

    p_run = sub.add_parser("run", help="train with a plan under torchrun (plans first if --plan is not given)")
    add_planning(p_run, cluster_required=False)
    p_run.add_argument("--plan", help="plan file from `autoplan plan`")
    p_run.add_argument("--steps", type=_non_negative_int, default=10, help="training steps (from the start)")
    p_run.add_argument(
        "--nproc", type=_positive_int, help="check the plan's (or cluster's) world size against this number of ranks"
    )
    p_run.add_argument(
        "--compare", action="store_true", help="also train the single-device model and print both losses"
    )
    p_run.add_argument("--show-code", action="store_true", help="print the generated per-rank program")
    p_run.add_argument(
        "--master-port",
        type=_port,
        help=f"torchrun port on 127.0.0.1, refused if in use (default: {DEFAULT_MASTER_PORT}, or a free port if that is taken)",
    )
    p_run.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="resume from the newest complete checkpoint in DIR (any plan) and save one after the last step",
    )
    p_run.add_argument("--checkpoint-every", type=int, metavar="N", help="also save a checkpoint every N steps")
    p_run.add_argument(
        "--max-restarts", type=int, default=0, metavar="K", help="restart all ranks up to K times when one fails"
    )
    p_run.add_argument("--save-final", metavar="PATH", help="write the full trained parameters (torch.save) to PATH")
    p_run.set_defaults(func=cmd_run)
    calibrate_cmd.add_parser(sub)
    profile_cmd.add_parser(sub)
    report.add_parser(sub)
    _add_export_onnx_parser(sub)
    bench.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a malformed command line (2, one line printed)
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    if not args.verbose:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from autoplan.cost_models.errors import PlanError
    from autoplan.planner import progress

    previous_sigterm = _raise_on_sigterm()
    try:
        # a status line on long steps (tracing, solving) when stderr is a terminal; never with
        # --quiet or --json, never in logs or pipes
        # stdout is ours alone: what a library prints (highspy's C++ banner, a print in a
        # dependency) goes to stderr, our output to console.stdout()
        with (
            console.owned_stdout(),
            progress.reporting(enabled=not getattr(args, "quiet", False) and not getattr(args, "json", False)),
        ):
            return args.func(args)
    except PlanError as exc:
        from autoplan.cost_models.echo import terminal_safe

        # one line, whatever a quoted name holds (a newline, a terminal escape sequence)
        print(f"autoplan: error: {terminal_safe(' '.join(str(exc).splitlines()))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback (worker processes were stopped on the way out)
        print("autoplan: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except _Terminated:
        print("autoplan: terminated", file=sys.stderr)
        return EXIT_TERMINATED
    finally:
        if previous_sigterm is not None:
            import signal

            signal.signal(signal.SIGTERM, previous_sigterm)


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread (like ``KeyboardInterrupt`` for SIGINT) so that
    ``finally`` blocks and ``with`` exits run: worker pools are stopped, temporary files removed."""


def _raise_on_sigterm() -> Any:
    """Make SIGTERM raise :class:`_Terminated`; returns the previous handler (None when this is
    not the main thread, where handlers cannot be set)."""
    import signal

    def handler(signum: int, frame: object) -> None:
        raise _Terminated

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:
        return None


if __name__ == "__main__":
    sys.exit(main())
