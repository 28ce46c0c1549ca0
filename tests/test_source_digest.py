"""The plan cache's source digest covers every source file of autoplan: a plan cached by other
code (an edit anywhere in the planner, the passes, the cost models or the runtime) must be a miss.
After the move into subpackages the digest once read only ``<folder>/*.py`` of a wrong root, so a
change in ``autoplan/planner/`` left cached plans valid."""

import os
from pathlib import Path

import autoplan
from autoplan.planner import plan_cache


def _all_sources() -> set[Path]:
    root = Path(autoplan.__file__).resolve().parent
    found = set()
    for folder, _, names in os.walk(root, followlinks=True):  # through the links autoplan/passes, autoplan/cost_models
        found.update(Path(folder, n).resolve() for n in names if n.endswith(".py"))
    return found


def test_source_digest_reads_every_source_file_of_every_room_once() -> None:
    files = plan_cache.source_files()
    assert len(files) == len(set(files))
    assert set(files) == _all_sources()
    names = {f.relative_to(f.parents[1]).as_posix() for f in files}
    for expected in ("planner/joint.py", "planner/solver.py", "runtime/codegen.py", "tools/cli.py",
                     "passes/trace.py", "cost_models/cluster.py", "autoplan/api.py"):  # fmt: skip
        assert expected in names, expected
