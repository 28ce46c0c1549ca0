"""Bytes of data each rank materialises per step, before and after sharded loading (issue #21).

    python benchmarks/data_volume.py [--batch 32] [--seq 1024]

A 4-rank job trains a language model on ``(input_ids, labels)`` samples of ``--seq`` int64 tokens
each, ``--batch`` samples per step. *Before*: every rank receives the whole global batch
(``forward_backward(*inputs, targets=...)`` cuts its shard afterwards), ``2 * batch * seq * 8``
bytes. *After*: ``ShardedLoader`` (:mod:`autoplan.runtime.data`) materialises only the rows the
rank's program reads; the bytes are those of the :class:`LocalBatch` it yields, computed from the
loader without training or a process group (rank ``r`` has the row-major mesh coordinate of
``init_device_mesh``). Layouts, with the placements the planner gives the batch:

* ``dp4``: mesh (4,), inputs and targets ``S(0)``;
* ``dp2xtp2``: mesh (2, 2), ``S(0)R`` (tensor-parallel peers load the same rows);
* ``pp2xdp2``: pipeline of 2 stages, stage mesh (2,), ``S(0)``, 4 micro-batches (first-stage
  ranks 0, 1 load the inputs of their shard of every micro-batch, last-stage ranks 2, 3 the
  targets: :mod:`autoplan.runtime.pipeline` feeds the loss its targets on the last stage).

Prints a row per layout and rank (the bytes after, split into the inputs and the targets the
rank keeps) and a final line::

    data_volume: dp4 524288->131072 B/rank (4.0x; job 2097152->524288 B) dp2xtp2 ... pp2xdp2 ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from autoplan.passes.placement import parse_spec  # noqa: E402
from autoplan.runtime.data import BatchLayout, ShardedLoader  # noqa: E402

WORLD = 4
LAYOUTS: dict[str, tuple[tuple[int, ...], tuple[str, ...], int, int]] = {
    # name: (mesh shape incl. pp, batch spec on the (stage) mesh, pp, micro-batches)
    "dp4": ((4,), ("S(0)",), 1, 1),
    "dp2xtp2": ((2, 2), ("S(0)", "R"), 1, 1),
    "pp2xdp2": ((2, 2), ("S(0)",), 2, 4),
}


class Tokens(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``num_samples`` windows of ``seq + 1`` tokens (zeros: only the shapes matter here)."""

    def __init__(self, num_samples: int, seq: int) -> None:
        self.num_samples, self.seq = num_samples, seq

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.full((self.seq + 1,), i, dtype=torch.int64)
        return tokens[:-1], tokens[1:]


def rank_layout(name: str, rank: int, *, batch: int, seq: int) -> BatchLayout:
    """Rank ``rank``'s :class:`BatchLayout` of layout ``name``."""
    mesh_shape, spec, pp, microbatches = LAYOUTS[name]
    coordinate = tuple(int(c) for c in torch.unravel_index(torch.tensor(rank), mesh_shape))
    stage_coordinate = coordinate[1:] if pp > 1 else coordinate
    return BatchLayout(
        global_batch_size=batch,
        num_microbatches=microbatches,
        mesh_shape=mesh_shape[1:] if pp > 1 else mesh_shape,
        coordinate=stage_coordinate,
        specs=(parse_spec(spec), parse_spec(spec)),
        num_inputs=1,
        sample_shapes=((seq,), (seq,)),
        reads_inputs=pp == 1 or coordinate[0] == 0,
        reads_targets=pp == 1 or coordinate[0] == pp - 1,
    )


def measure(*, batch: int, seq: int) -> dict[str, list[tuple[int, int]]]:
    """Per layout, the bytes of inputs and of targets each rank's first ``LocalBatch`` holds."""
    dataset = Tokens(batch, seq)
    out: dict[str, list[tuple[int, int]]] = {}
    for name in LAYOUTS:
        out[name] = []
        for r in range(WORLD):
            local = next(iter(ShardedLoader(dataset, rank_layout(name, r, batch=batch, seq=seq))))
            out[name].append((sum(t.nbytes for t in local.inputs), sum(t.nbytes for t in local.targets)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="global batch (samples per step)")
    parser.add_argument("--seq", type=int, default=1024, help="tokens per sample")
    args = parser.parse_args()
    before = 2 * args.batch * args.seq * 8  # input_ids and labels, int64, on every rank
    summary = []
    print(f"{WORLD} ranks, global batch {args.batch} x {args.seq} tokens (inputs + targets, int64)")
    print(f"{'layout':<9} {'rank':>4} {'before B':>10} {'after B':>10} {'inputs B':>10} {'targets B':>10}")
    for name, per_rank in measure(batch=args.batch, seq=args.seq).items():
        totals = [inputs + targets for inputs, targets in per_rank]
        for r, (inputs, targets) in enumerate(per_rank):
            print(f"{name:<9} {r:>4} {before:>10} {inputs + targets:>10} {inputs:>10} {targets:>10}")
        worst = max(totals)
        summary.append(
            f"{name} {before}->{worst} B/rank ({before / worst:.1f}x; job {WORLD * before}->{sum(totals)} B)"
        )
    print("data_volume: " + " ".join(summary))


if __name__ == "__main__":
    main()
