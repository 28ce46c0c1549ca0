"""Planning time and plan choice for the example models and two large fake clusters.

    python benchmarks/planning_time.py            # prints a table and a final summary line

Every case builds its model on ``meta``, traces it, enumerates DTensor strategies on a fake
process group of the cluster's size, costs and solves the ILP. Times are wall-clock seconds on
this machine; the last line is ``planning_time: cases=N max_total_s=X``.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import autoplan  # noqa: E402
from autoplan.tools.loader import build_workload  # noqa: E402
from tests import zoo  # noqa: E402


def _gpt2(n_embd: int, n_layer: int, batch: int, seq: int) -> autoplan.Workload:
    """``tests.zoo``'s GPT-2 with 32 heads and a 1024-token vocabulary, on ``meta``."""
    with torch.device("meta"):
        ids = torch.randint(0, 1024, (batch, seq))
        model = zoo.gpt2_lm(layers=n_layer, hidden=n_embd, heads=32, vocab=1024, positions=seq)
    return autoplan.Workload(model=model, example_inputs=(ids,), loss_fn=zoo.lm_loss, example_targets=(ids,))


def cases() -> list[tuple[str, autoplan.Workload, autoplan.Cluster]]:
    ex = str(Path(__file__).resolve().parent.parent / "examples" / "hf_models.py")
    gpt2 = build_workload(ex + ":gpt2_tiny", device="meta")
    llama = build_workload(ex + ":llama_tiny", device="meta")
    return [
        ("gpt2_tiny", gpt2, autoplan.Cluster.preset("4xCPU")),
        ("gpt2_tiny", gpt2, autoplan.Cluster.preset("4xCPU", mesh_shape=(2, 2))),
        ("llama_tiny", llama, autoplan.Cluster.preset("4xCPU")),
        ("llama_tiny", llama, autoplan.Cluster.preset("4xCPU", mesh_shape=(2, 2))),
        ("gpt2 h=256 L=2 (small)", _gpt2(256, 2, 256, 128), autoplan.Cluster.preset("8x8xH100")),
        ("gpt2 h=12288 L=3 (5.4B)", _gpt2(12288, 3, 64, 256), autoplan.Cluster.preset("8x8xH100")),
        ("gpt2 h=1024 L=1", _gpt2(1024, 1, 1024, 64), autoplan.Cluster.preset("128x8xH100")),
    ]


def main() -> None:
    rows = []
    for name, wl, cluster in cases():
        t0 = time.perf_counter()
        plan = autoplan.plan(
            wl.model, cluster, example_inputs=wl.example_inputs, loss_fn=wl.loss_fn, example_targets=wl.example_targets
        )
        total = time.perf_counter() - t0
        axes = "; ".join(f"{k}: {v}" for k, v in plan.parallelism().items())
        rows.append((name, str(cluster.mesh_shape), cluster.device.name, plan.solver["num_variables"],
                     plan.solver["solve_time_s"], total, plan.estimate.step_time_s * 1e3, axes))  # fmt: skip
    header = ("model", "mesh", "device", "ILP vars", "solve s", "total s", "est. step ms", "choice per mesh axis")
    print(" | ".join(header))
    for r in rows:
        print(f"{r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.2f} | {r[5]:.2f} | {r[6]:.3f} | {r[7]}")
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"planning_time: cases={len(rows)} max_total_s={max(r[5] for r in rows):.2f} peak_rss_MiB={peak_mib:.0f}")


if __name__ == "__main__":
    main()
