"""Per-rank entry point of ``autoplan run`` (started by torchrun; not a public API).

torchrun --nproc-per-node=N -m autoplan.tools.worker TARGET --plan plan.json --steps 10 [--compare]
         [--checkpoint-dir DIR --checkpoint-every N] [--save-final params.pt] [--bad-input-file PATH]

Before building anything the ranks check that they all hold the same plan and were started
alike (:func:`_check_same_start`: each node of a multi-node run loads its own file, or planned for
itself, and got its own command line): the seed, the build function's source and the options
that decide the initial state or the collectives (``--steps``, ``--save-final``, checkpoints,
...), else nodes train apart or wait in a collective the others never enter. Every collective
times out after ``AUTOPLAN_COLLECTIVE_TIMEOUT_S`` seconds (default 300, :mod:`autoplan.tools.launch`). Bad input found in the
ranks (a ``PlanError``) is printed by each node's local rank 0; with ``--bad-input-file`` it is
written there instead and the ranks exit 0, for ``autoplan run`` to print and exit 2
(``autoplan/tools/run.py`` says why), else they exit 2.

A workload with a ``dataset`` (map-style, ``--shuffle`` reshuffling it every pass, or an
``IterableDataset``) trains from its sharded loader (each rank loads only the rows its program
reads; :mod:`autoplan.tools.training_data`); ``--compare`` feeds the single-device model the same
global batches.

With ``--checkpoint-dir`` the job resumes from the newest complete checkpoint there
(:mod:`autoplan.runtime.checkpoint`) and saves one every ``--checkpoint-every`` steps and after the last.

A NaN or infinite loss stops every rank before that step's optimizer step (a ``NonFiniteLossError``
naming the step, reported as bad input: ``autoplan run`` exits 2), unless ``--allow-nonfinite``:
then rank 0 warns once, at the first one, and training goes on.

Fault injection for tests: ``AUTOPLAN_FAULT_AT_STEP=n`` makes rank ``AUTOPLAN_FAULT_RANK``
(default: the last rank) exit with code 1 right after optimizer step ``n`` (counted from 1,
before that step's checkpoint), on torchrun's first attempt only (``TORCHELASTIC_RESTART_COUNT``
is 0), so an elastic restart (``torchrun --max-restarts``) must resume from a checkpoint.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import hashlib
import importlib.util
import io
import os
import socket
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from autoplan.api import parallelize
from autoplan.cost_models.errors import PlanError, PlanMismatchError
from autoplan.cost_models.files import atomic_write
from autoplan.planner.plan import Plan
from autoplan.runtime import checkpoint
from autoplan.runtime.checkpoint import ParallelizedModel
from autoplan.runtime.data import LocalBatch
from autoplan.runtime.teardown import destroy_process_groups
from autoplan.runtime.training import check_finite_loss
from autoplan.tools import console, launch
from autoplan.tools.loader import build_workload, target_file
from autoplan.tools.training_data import Batch, TrainingData, data_options
from autoplan.workload import Workload


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _reference_step(
    reference: torch.nn.Module,
    ref_opt: torch.optim.Optimizer,
    wl: Workload,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
) -> torch.Tensor:
    """One training step of the single-device model (``--compare``); returns its loss."""
    out = reference(*inputs)
    ref_loss = wl.loss_fn(out, *targets) if wl.loss_fn is not None else out
    ref_loss.backward()
    ref_opt.step()
    ref_opt.zero_grad()
    return ref_loss


def _inject_fault(step: int, rank: int) -> None:
    """Test hook (module docstring): exit hard after optimizer step ``AUTOPLAN_FAULT_AT_STEP``."""
    at = os.environ.get("AUTOPLAN_FAULT_AT_STEP")
    if at is None or int(at) != step or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if rank == int(os.environ.get("AUTOPLAN_FAULT_RANK", dist.get_world_size() - 1)):
        print(f"rank {rank}: injected fault after step {step}", file=sys.stderr, flush=True)
        os._exit(1)


def _init_process_group(backend: str) -> None:
    """``init_process_group`` from torchrun's environment, its collectives timing out after
    :func:`launch.collective_timeout_s` (not gloo's 30 minutes). Under ``torchrun --max-restarts`` the
    ranks of every attempt meet in the agent's store, which outlives the attempts: each attempt
    gets its own key prefix there, or a restarted rank would read a dead rank's address."""
    timeout = datetime.timedelta(seconds=launch.collective_timeout_s(os.environ))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if (
        os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") == "0"
        or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    ):
        dist.init_process_group(backend, timeout=timeout)
        return
    world_size = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"autoplan/attempt_{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=world_size,
        timeout=timeout,
    )


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="autoplan.tools.worker")
    p.add_argument("target")
    p.add_argument("--plan", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", action="store_true")
    p.add_argument("--show-code", action="store_true")
    p.add_argument("--checkpoint-dir")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--save-final", metavar="PATH")
    p.add_argument("--bad-input-file", metavar="PATH")
    p.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--data-seed", type=int)
    p.add_argument("--allow-nonfinite", action="store_true")
    return p.parse_args(argv)


_ended_on_bad_input = False
"""Whether :func:`main` ended on bad input (:class:`PlanError`): its groups were destroyed but not
released (``destroy_process_groups(failed=True)``: a peer may still wait in a collective), so the
rank process ends without interpreter teardown (``__main__`` below)."""


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    args.warned_nonfinite = False  # --allow-nonfinite: the first non-finite loss is named once
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(1)
    _init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    try:
        _train(args, rank)
    except PlanError as exc:
        _report_bad_input(exc, args.bad_input_file)
        destroy_process_groups(failed=True)
        global _ended_on_bad_input
        _ended_on_bad_input = True
        return 0 if args.bad_input_file is not None else 2
    # every rank past its last collective (and the pipeline's last sends) before the groups go:
    # a rank tearing gloo down while its peer still communicates aborts the job. The groups are
    # released here, not at interpreter exit (autoplan/runtime/teardown.py)
    destroy_process_groups()
    return 0


def _report_bad_input(exc: PlanError, bad_input_file: str | None) -> None:
    """Each node's local rank 0 reports: into ``bad_input_file`` (``autoplan run`` prints it) or
    as one line on stderr."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    if bad_input_file is not None:
        atomic_write(bad_input_file, str(exc), what="bad-input report")
    else:
        print(f"autoplan: error: {exc}", file=sys.stderr, flush=True)


START_FIELDS = (
    ("build", "the build function (target file and function)"),
    ("seed", "--seed"),
    ("steps", "--steps"),
    ("save_final", "--save-final (given or not)"),
    ("compare", "--compare"),
    ("checkpoint_dir", "--checkpoint-dir (given or not)"),
    ("checkpoint_every", "--checkpoint-every"),
    ("shuffle", "--shuffle"),
    ("data_seed", "--data-seed"),
    ("allow_nonfinite", "--allow-nonfinite"),
)
"""What every rank must agree on besides the plan, and how a mismatch names it: the initial state
(seed, build function), the data order and the collectives each rank enters (steps, checkpoints,
the final gathers)."""


def _target_digest(target: str) -> str:
    """The build function's identity across nodes: its function name and a hash of its file's
    bytes (``FILE.py`` or the module's source), not of the path, which may differ per node."""
    where, _, func = target.rpartition(":")
    path = target_file(target)
    try:
        if path is None:
            spec = importlib.util.find_spec(where)
            path = spec.origin if spec is not None else None
        source = open(path, "rb").read() if path else target.encode()  # noqa: SIM115 - read at once
    except (OSError, ImportError, ValueError):
        source = target.encode()
    return f"{func} {hashlib.sha256(source).hexdigest()[:16]}"


def start_fields(plan: Plan, args: argparse.Namespace) -> dict[str, object]:
    """This rank's plan digest and :data:`START_FIELDS`, compared by :func:`check_same_start`."""
    return {
        "plan": plan.digest(),
        "build": _target_digest(args.target),
        "seed": args.seed,
        "steps": args.steps,
        "save_final": args.save_final is not None,
        "compare": args.compare,
        "checkpoint_dir": args.checkpoint_dir is not None,
        "checkpoint_every": args.checkpoint_every,
        "shuffle": args.shuffle,
        "data_seed": args.data_seed,
        "allow_nonfinite": args.allow_nonfinite,
    }


def _check_same_start(plan: Plan, args: argparse.Namespace) -> None:
    """All-gather :func:`start_fields` with the host names and :func:`check_same_start` them:
    the same PlanMismatchError on every rank."""
    held: list[tuple[dict[str, object], str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(held, (start_fields(plan, args), socket.gethostname()))
    check_same_start(held)


def check_same_start(held: Sequence[tuple[dict[str, object], str] | None]) -> None:
    """``held[rank]`` = (that rank's :func:`start_fields`, its host). Every rank holds the same plan
    and was started alike; else PlanMismatchError naming which ranks hold which plan, or the
    first field that differs and which ranks (on which hosts) hold which value."""
    entries = []
    for entry in held:
        assert entry is not None, "all_gather_object fills every slot"
        entries.append(entry)
    for field, shown in (("plan", "plan"), *START_FIELDS):
        groups: dict[str, list[tuple[int, str]]] = {}
        for rank, (fields, host) in enumerate(entries):
            groups.setdefault(repr(fields.get(field)), []).append((rank, host))
        if len(groups) == 1:
            continue
        held_by = "; ".join(
            f"ranks {','.join(str(r) for r, _ in ranks)} on {','.join(sorted({h for _, h in ranks}))}: "
            + (f"plan {value.strip(chr(39))[:12]}" if field == "plan" else value)
            for value, ranks in groups.items()
        )
        if field == "plan":
            raise PlanMismatchError(
                f"the ranks hold {len(groups)} different plans ({held_by}): the nodes planned differently (other "
                "measured op times, links or versions) or were given different --plan files; plan once with "
                "`autoplan plan ... --out plan.json`, copy the file to every node and run with --plan plan.json"
            )
        raise PlanMismatchError(
            f"the nodes were started with different {shown} ({held_by}): run the same `autoplan run` command, "
            "with the same target file, on every node"
        )


def _train(args: argparse.Namespace, rank: int) -> None:
    """Parallelize the workload with the plan, resume from a checkpoint if asked, train, and
    report (``--compare``) and save (``--save-final``) the result."""
    plan = Plan.load(args.plan)
    _check_same_start(plan, args)
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
        print(pm.code, file=console.stdout())
    opt = pm.make_optimizer(lr=wl.lr)
    ref_opt = None
    if reference is not None:
        ref_opt = type(opt)(reference.parameters(), **opt.defaults)
    shuffle, data_seed = data_options(wl, shuffle=args.shuffle, data_seed=args.data_seed, seed=args.seed)
    data = TrainingData(wl, pm, shuffle=shuffle, data_seed=data_seed, compare=reference is not None)
    if rank == 0 and wl.dataset is not None:
        print(data.describe(), file=console.stdout(), flush=True)
    start = 0 if args.checkpoint_dir is None else _resume(args.checkpoint_dir, pm, opt, rank)
    rng = torch.get_rng_state() if start else None  # the checkpoint's, restored after the catch-up
    for step, local, batch in data.steps(start):
        if step >= max(start, args.steps):
            break
        if step < start:  # resumed: the single-device model catches up on the steps before
            if reference is not None and ref_opt is not None and batch is not None:
                _reference_step(reference, ref_opt, wl, *batch)
            continue
        if rng is not None:
            torch.set_rng_state(rng)
            rng = None
        _train_step(
            args, step, pm, opt, local, batch, rank=rank, plan=plan, reference=reference, ref_opt=ref_opt, wl=wl
        )
    if rng is not None:
        torch.set_rng_state(rng)
    if reference is not None:
        _print_comparison(pm, reference, args.steps, rank)
    if args.save_final is not None:
        _save_final(pm, args.save_final, rank)


def _train_step(
    args: argparse.Namespace,
    step: int,
    pm: ParallelizedModel,
    opt: torch.optim.Optimizer,
    local: LocalBatch | None,
    batch: Batch | None,
    *,
    rank: int,
    plan: Plan,
    reference: torch.nn.Module | None,
    ref_opt: torch.optim.Optimizer | None,
    wl: Workload,
) -> None:
    """Step ``step`` (counted from 0) on this rank's ``local`` rows of a dataset's step, else on
    the global ``batch``; with ``--compare`` the single-device model's step on ``batch``; the log
    line, the fault hook and the checkpoint."""
    if local is not None:  # this rank's rows only
        loss = pm.forward_backward(local)
    else:
        assert batch is not None, "TrainingData yields the global batch when there is no local one"
        loss = pm.forward_backward(*batch[0], targets=tuple(batch[1]))
    # before the optimizer applies its gradients: a stop leaves the previous step's parameters
    if not check_finite_loss(loss, step + 1, allow_nonfinite=args.allow_nonfinite) and not args.warned_nonfinite:
        args.warned_nonfinite = True
        if rank == 0:
            print(
                f"autoplan: warning: step {step + 1}: the loss is {loss.item()} (not finite); training on "
                "(--allow-nonfinite)",
                file=sys.stderr,
                flush=True,
            )
    opt.step()
    opt.zero_grad()
    line = f"step {step + 1:>3}  loss {loss.item():.6f}"
    if reference is not None and ref_opt is not None and batch is not None:
        ref_loss = _reference_step(reference, ref_opt, wl, *batch)
        line += f"  single-device {ref_loss.item():.6f}  rel.diff {_rel(loss.item(), ref_loss.item()):.2e}"
    if rank == 0:
        print(line, file=console.stdout(), flush=True)
    _inject_fault(step + 1, rank)
    done = step + 1
    if args.checkpoint_dir is not None and (
        done == args.steps or (args.checkpoint_every > 0 and done % args.checkpoint_every == 0)
    ):
        path = checkpoint.save(args.checkpoint_dir, done, pm, opt, plan=plan)
        if rank == 0:
            print(f"saved checkpoint {path}", file=console.stdout(), flush=True)


def _resume(checkpoint_dir: str, pm: ParallelizedModel, opt: torch.optim.Optimizer, rank: int) -> int:
    """Load the newest checkpoint that loads, the same on every rank (a damaged one is skipped,
    named); returns the first step to train (the single-device model catches up in the loop)."""
    resumed = checkpoint.resume(checkpoint_dir, pm, opt)
    if resumed is None:
        return 0
    latest, start = resumed
    if rank == 0:
        print(f"resumed from checkpoint {latest}", file=console.stdout(), flush=True)
    return start


def _print_comparison(pm: ParallelizedModel, reference: torch.nn.Module, steps: int, rank: int) -> None:
    """``--compare``: the largest relative error of the trained parameters against the
    single-device model's (every rank gathers; rank 0 prints)."""
    full = pm.full_parameters()
    ref = dict(reference.named_parameters())
    worst = max(((full[n] - ref[n].detach()).norm() / ref[n].detach().norm().clamp_min(1e-12)).item() for n in full)
    if rank == 0:
        print(
            f"parameters after {steps} steps: max relative error vs single device {worst:.2e}",
            file=console.stdout(),
            flush=True,
        )


def _save_final(pm: ParallelizedModel, path: str, rank: int) -> None:
    """``--save-final``: the full trained parameters (every rank gathers; rank 0 writes them
    whole or not at all: an existing file stays until the new one is complete)."""
    final = pm.full_parameters()
    if rank == 0:
        buffer = io.BytesIO()
        torch.save({n: t.detach().cpu() for n, t in final.items()}, buffer)
        atomic_write(path, buffer.getvalue(), what="trained parameters")


if __name__ == "__main__":
    with console.owned_stdout():  # a library's prints go to stderr, the loss lines to stdout
        code = main()
    if _ended_on_bad_input:
        # The unreleased gloo groups' threads would be destroyed while joinable at interpreter exit:
        # std::terminate, SIGABRT, and torchrun would report a crashed rank with its traceback instead
        # of the one line (docs/crashes.md; seen in a fresh-check run of
        # test_run_on_a_dataset_sample_of_another_shape_prints_one_line_and_exits_2). The report is
        # written (atomically) and the streams are flushed: nothing is left for the teardown to do.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
