"""Per-rank entry point of ``autoplan run`` (started by torchrun; not a public API).

torchrun --nproc-per-node=N -m autoplan._worker TARGET --plan plan.json --steps 10 [--compare]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist

from autoplan.api import parallelize
from autoplan.loader import build_workload
from autoplan.plan import Plan
from cost_models.errors import PlanError


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="autoplan._worker")
    p.add_argument("target")
    p.add_argument("--plan", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", action="store_true")
    p.add_argument("--show-code", action="store_true")
    args = p.parse_args(argv)

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    try:
        plan = Plan.load(args.plan)
        wl = build_workload(args.target, device="cpu", seed=args.seed)
        reference = copy.deepcopy(wl.model) if args.compare else None
        pm = parallelize(
            wl.model,
            plan.cluster,
            example_inputs=wl.example_inputs,
            loss_fn=wl.loss_fn,
            example_targets=wl.example_targets,
            plan=plan,
        )
        if rank == 0 and args.show_code:
            print(pm.code)
        opt = pm.make_optimizer(lr=wl.lr)
        ref_opt = None
        if reference is not None:
            ref_opt = type(opt)(reference.parameters(), **opt.defaults)
        for step in range(args.steps):
            inputs, targets = (wl.example_inputs, wl.example_targets) if wl.batches is None else wl.batches(step)
            loss = pm.forward_backward(*inputs, targets=tuple(targets))
            opt.step()
            opt.zero_grad()
            line = f"step {step + 1:>3}  loss {loss.item():.6f}"
            if reference is not None and ref_opt is not None:
                out = reference(*inputs)
                ref_loss = wl.loss_fn(out, *targets) if wl.loss_fn is not None else out
                ref_loss.backward()
                ref_opt.step()
                ref_opt.zero_grad()
                line += f"  single-device {ref_loss.item():.6f}  rel.diff {_rel(loss.item(), ref_loss.item()):.2e}"
            if rank == 0:
                print(line, flush=True)
        if reference is not None:
            full = pm.full_parameters()
            ref = dict(reference.named_parameters())
            worst = max(
                ((full[n] - ref[n].detach()).norm() / ref[n].detach().norm().clamp_min(1e-12)).item() for n in full
            )
            if rank == 0:
                print(
                    f"parameters after {args.steps} steps: max relative error vs single device {worst:.2e}", flush=True
                )
    except PlanError as exc:
        if rank == 0:
            print(f"autoplan: error: {exc}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        return 2
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
