"""The model zoo table: every architecture of ``examples/hf_models.py:ZOO`` planned for 2 CPU
ranks and trained 3 steps under gloo beside the single-device model.

    python benchmarks/model_zoo.py                 # the whole zoo (minutes on 2 cores)
    python benchmarks/model_zoo.py gpt2 t5 whisper # some of it

The work is ``tests/test_model_zoo.py``'s (the same planning, launches and checks): ``autoplan.plan``
of the ``meta`` build for the ``2xCPU`` preset, then 3 SGD-with-momentum steps of the CPU build on
2 gloo ranks and of a single-device copy. Columns: parameters, ops of the traced step, whether a
plan was found and its time, the parallelism of the plan, the largest relative loss difference
(any step, any rank), the largest relative parameter difference after the last step, whether every
frozen parameter is bit-identical to its initial value, the ranks' time (build, apply, train both)
and the verdict. The last line is ``model_zoo: equal=N/M ...``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from examples.hf_models import ZOO  # noqa: E402
from tests.test_model_zoo import failures, run_zoo, summary  # noqa: E402

HEADER = (
    f"{'architecture':<12} {'kind':<15} {'params':>7} {'ops':>5} {'plan':>4} {'plan_s':>6}  {'parallelism':<42}"
    f"{'loss_diff':>9} {'param_diff':>10} {'frozen':>8} {'train_s':>7}  verdict"
)


def _short_error(text: str) -> str:
    """The exception line of a traceback, cut to one table cell."""
    lines = [ln for ln in text.strip().splitlines() if ln and not ln.startswith(" ")]
    return (lines[-1] if lines else text)[:120]


def row_text(name: str, row: dict, problems: list[str]) -> str:
    kind = ZOO[name].kind
    head = f"{name:<12} {kind:<15}"
    if "error" in row:
        plan = "yes" if row["planned"] else "no"
        return (
            f"{head} {'':>7} {'':>5} {plan:>4} {row['plan_seconds']:>6.1f}  {'':<42}{'':>9} {'':>10} {'':>8} "
            f"{row['seconds']:>7.1f}  FAIL: {_short_error(row['error'])}"
        )
    verdict = "equal" if not problems else "DIFFERS: " + problems[0].splitlines()[0][:100]
    frozen = f"{'yes' if row['frozen_identical'] else 'NO'} ({row['num_frozen']})"
    return (
        f"{head} {row['num_params']:>7} {row['num_ops']:>5} {'yes':>4} {row['plan_seconds']:>6.1f}  "
        f"{row['parallelism'].get('intra', str(row['parallelism']))[:41]:<42}"
        f"{row['max_loss_rel_err']:>9.1e} {row['max_param_rel_err']:>10.1e} "
        f"{frozen:>8} {row['seconds']:>7.1f}  {verdict}"
    )


def main(argv: list[str]) -> int:
    names = argv or list(ZOO)
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        print(f"model_zoo: unknown architecture(s) {unknown}: choose from {', '.join(ZOO)}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    results = run_zoo(names)
    print(HEADER)
    equal = planned = 0
    for name in names:
        row, problems = summary(results[name]), failures(results[name])
        planned += bool(row["planned"])
        equal += not problems
        print(row_text(name, row, problems), flush=True)
    print(
        f"model_zoo: equal={equal}/{len(names)} planned={planned}/{len(names)} cluster=2xCPU steps=3 "
        f"wall_s={time.perf_counter() - start:.0f}"
    )
    return 0 if equal == len(names) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
