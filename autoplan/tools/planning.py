"""``autoplan plan`` and ``autoplan estimate``: plan a workload for a cluster, or price a
hand-written configuration with the planner's cost model.

    autoplan plan  my_models.py:build --cluster 4xCPU --out plan.json
    autoplan estimate my_models.py:build --cluster 4x8xH100 --global-batch-size 512 \\
                   --config dp=8,tp=4,pp=1,microbatch_size=2,num_microbatches=32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from autoplan.cost_models.errors import ConfigError
from autoplan.cost_models.files import refuse_overwriting_inputs
from autoplan.tools import common, console


def add_parser(subparsers: Any) -> None:  # argparse._SubParsersAction has no public type
    """Register ``autoplan plan`` and ``autoplan estimate`` on the CLI's subparsers."""
    p_plan = subparsers.add_parser("plan", help="plan a model for a cluster and write plan.json")
    common.add_planning_arguments(p_plan, cluster_required=True)
    p_plan.add_argument("--out", "-o", required=True, help="plan file to write (JSON)")
    p_plan.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p_plan.add_argument(
        "--timings",
        action="store_true",
        help="also write the solver's wall-clock times (the file then differs per run)",
    )
    p_plan.set_defaults(func=cmd_plan)

    p_est = subparsers.add_parser("estimate", help="price a hand-written configuration with the planner's cost model")
    common.add_planning_arguments(p_est, cluster_required=True)
    p_est.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p_est.set_defaults(func=cmd_estimate)


def cmd_plan(args: argparse.Namespace) -> int:
    refuse_overwriting_inputs(args.out, common.planning_inputs(args))  # before planning, which may take long
    plan = dataclasses.replace(common.make_plan(args), workload=args.target)
    plan.save(args.out, timings=args.timings)
    if args.json:
        print(json.dumps(plan.to_dict()["estimate"]), file=console.stdout())
    elif not args.quiet:
        print(plan.summary(), file=console.stdout())
        print(f"wrote {args.out}", file=console.stdout())
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    # the planner and the workload loader import torch: loaded when the command runs, not at start-up
    from autoplan.planner.joint import estimate
    from autoplan.tools.loader import build_workload

    config = common.config_from_text(args.config)
    if config is None or args.global_batch_size is None:
        raise ConfigError("autoplan estimate needs --config KEY=VALUE,... and --global-batch-size N")
    wl = build_workload(args.target, device="meta", seed=args.seed)
    est = estimate(
        wl.model, common.cluster_from_args(args.cluster, None), wl.example_inputs, config=config,
        global_batch_size=args.global_batch_size, loss_fn=wl.loss_fn, example_targets=wl.example_targets,
        precision=args.precision, optimizer=args.optimizer or wl.optimizer,
    )  # fmt: skip
    if args.json:
        d = est.to_dict()
        d["config"] = config.to_dict()
        print(json.dumps(d), file=console.stdout())
    else:
        print(est.summary(), file=console.stdout())
    return 0
