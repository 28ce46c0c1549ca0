"""What the ``autoplan`` commands share: exit codes, the parser with the bad-input contract,
argument types, the planning options and their parsing (``--cluster``/``--mesh``, ``--config``,
``--pin``), and planning from parsed options (:func:`make_plan`).

Every command module (``planning``, ``run``, ``review``, ``report``, ``profile``, ``calibrate``,
``bench``) depends on this module and ``cli`` depends on the command modules, never the other way
round. Importing this module loads no torch (``autoplan --help`` and the review commands start
without it: ``tests/test_cli_startup.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.config import REMOVED_FIELDS, ParallelConfig, field_name_problem
from autoplan.cost_models.echo import clip_text
from autoplan.cost_models.errors import ClusterSpecError, ConfigError, PlanError
from autoplan.cost_models.memory import OPTIMIZERS
from autoplan.planner.plan import Plan
from autoplan.tools import local_links

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM


class BadInputParser(argparse.ArgumentParser):
    """argparse with the CLI's bad-input contract: one line ``autoplan: error: ...``, exit code 2
    (argparse's default prints the whole usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"autoplan: error: {message}; see `{self.prog} --help`\n")


def number_type(convert: Callable[[str], Any], what: str, ok: Callable[[Any], bool]) -> Callable[[str], Any]:
    """An argparse ``type=`` that converts with ``convert`` and accepts values where ``ok``."""

    def parse(text: str) -> Any:
        shown = clip_text(text, 40)
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {shown!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {shown}")
        return value

    return parse


positive_int = number_type(int, "a positive integer", lambda v: v >= 1)
non_negative_int = number_type(int, "an integer >= 0", lambda v: v >= 0)
positive_float = number_type(float, "a positive number", lambda v: 0 < v < float("inf"))
seed = number_type(int, "an integer seed in 0..2**63-1", lambda v: 0 <= v < 2**63)
port = number_type(int, "a TCP port in 1..65535", lambda v: 1 <= v <= 65535)


def cluster_from_args(spec: str, mesh: str | None, *, recalibrate: bool = False) -> Cluster:
    """``--cluster`` (preset or file) with ``--mesh``. ``recalibrate``: a file's links and
    calibration are dropped and its software versions not checked (``autoplan calibrate`` redoes them)."""
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


def pins_from_args(items: Sequence[str]) -> dict[str, str]:
    """``--pin NAME=SPEC`` (repeated) as a mapping."""
    pins = {}
    for item in items:
        if "=" not in item:
            raise PlanError(f"--pin {item!r} is malformed: expected NAME=SPEC like 'input_0=S(0),R'")
        name, spec = item.split("=", 1)
        pins[name.strip()] = spec.strip()
    return pins


def config_from_text(text: str | None) -> ParallelConfig | None:
    """``--config dp=2,tp=2,pp=2,microbatch_size=1,num_microbatches=8,schedule=1f1b``
    (per-stage degrees as ``stage_dp=1/1/2/4``; ``offload_optimizer``, ``sharded_grad_accumulation`` and
    ``sequence_parallel`` as ``1`` or ``true``)."""
    if not text:
        return None
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
        elif key in ("offload_optimizer", "sharded_grad_accumulation", "sequence_parallel"):
            if value.lower() not in ("0", "1", "true", "false"):
                raise ConfigError(f"--config {key}={value!r}: expected true or false")
            values[key] = value.lower() in ("1", "true")
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


def add_planning_arguments(p: argparse.ArgumentParser, *, cluster_required: bool) -> None:
    """The options of a command that plans (``plan``, ``estimate``, ``run``): the workload, the
    cluster, and what the planner may choose."""
    p.add_argument("target", help="FILE.py:FUNCTION returning autoplan.Workload")
    p.add_argument("--cluster", required=cluster_required, help="preset like 4xCPU, 2x8xH100, or a YAML/JSON file")
    p.add_argument("--mesh", help="logical mesh shape, e.g. 2,2 (default: nodes x devices)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, help="default: the workload's optimizer")
    p.add_argument("--pin", action="append", default=[], metavar="NAME=SPEC", help="fix a placement, e.g. input_0=S(0)")
    p.add_argument("--time-limit", type=positive_float, default=120.0, help="solver time limit in seconds")
    p.add_argument(
        "--profile-db",
        metavar="PATH",
        help="measured op times (`autoplan profile`); default: this machine's database when the cluster "
        "is made of this machine's device",
    )
    p.add_argument("--no-profile", action="store_true", help="use analytic op times only")
    p.add_argument("--seed", type=seed, default=0, help="random seed of the model's weights (0..2**63-1)")
    p.add_argument("--quiet", "-q", action="store_true")
    p.add_argument(
        "--global-batch-size",
        type=positive_int,
        help="plan data/tensor/pipeline degrees, micro-batches, schedule, recomputation and ZeRO for this "
        "global batch (joint search); the workload's inputs then give per-sample shapes",
    )
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"), help="training precision")
    p.add_argument(
        "--config",
        metavar="KEY=VALUE,...",
        help="fix the configuration, e.g. dp=2,tp=2,pp=2,microbatch_size=1,num_microbatches=8,schedule=1f1b",
    )


def planning_inputs(args: argparse.Namespace) -> dict[str, str | None]:
    """The files a planning command reads (label -> path), which no output may overwrite."""
    # loader imports torch: a planning command loads it anyway, `autoplan --help` must not
    from autoplan.tools.loader import target_file

    return {
        "model file": target_file(args.target),
        "cluster file": getattr(args, "cluster", None),
        "profile database": getattr(args, "profile_db", None),
        "plan file": getattr(args, "plan", None),
    }


def make_plan(args: argparse.Namespace) -> Plan:
    """Plan the workload of parsed planning options (:func:`add_planning_arguments`) as
    ``autoplan plan`` does."""
    # the options first: a mistyped one fails at once, before the model is built and traced
    config = config_from_text(args.config)
    if config is not None and args.global_batch_size is None:
        raise ConfigError("--config needs --global-batch-size N (the configuration splits a global batch)")
    pins = pins_from_args(args.pin)
    cluster = cluster_from_args(args.cluster, args.mesh)
    # the planner and the workload loader import torch: loaded when a command plans, not at start-up
    from autoplan.api import plan as plan_model
    from autoplan.tools.loader import build_workload

    local_links.ensure_local_calibration(cluster, quiet=bool(getattr(args, "quiet", False)))  # NxCPU: measured once
    wl = build_workload(args.target, device="meta", seed=args.seed)
    return plan_model(
        wl.model,
        cluster,
        example_inputs=wl.example_inputs,
        loss_fn=wl.loss_fn,
        example_targets=wl.example_targets,
        optimizer=args.optimizer or wl.optimizer,
        pins=pins,
        time_limit_s=args.time_limit,
        profile=None if args.no_profile else (args.profile_db or "auto"),
        global_batch_size=args.global_batch_size,
        precision=args.precision,
        config=config,
    )
