"""Tiny build functions for the CLI tests (``autoplan plan tests/cli_models.py:mlp ...``).

Each returns an ``autoplan.Workload``. The CLI calls them under ``torch.device("meta")`` to plan
(nothing is allocated, so ``huge`` costs nothing) and on CPU, with the same seed on every rank,
to run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import autoplan

BATCH = 8


def _mlp_workload(num_in: int, num_hidden: int, num_out: int) -> autoplan.Workload:
    model = nn.Sequential(nn.Linear(num_in, num_hidden), nn.GELU(), nn.Linear(num_hidden, num_out))
    x = torch.randn(BATCH, num_in)  # (B, num_in)
    y = torch.randn(BATCH, num_out)  # (B, num_out)
    return autoplan.Workload(
        model=model, example_inputs=(x,), loss_fn=F.mse_loss, example_targets=(y,), optimizer="sgd"
    )


def mlp() -> autoplan.Workload:
    """Linear(16, 32) -> GELU -> Linear(32, 8); input (8, 16), MSE against a (8, 8) target."""
    return _mlp_workload(16, 32, 8)


def mlp_wide() -> autoplan.Workload:
    """The structure of ``mlp`` with other sizes (Linear(16, 64) -> GELU -> Linear(64, 8)): another fingerprint."""
    return _mlp_workload(16, 64, 8)


class DataDependent(nn.Module):
    """Python control flow on a tensor value: ``torch.export`` cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent branch: the CLI error must point at this line
            return self.linear(x)
        return -self.linear(x)


def data_dependent() -> autoplan.Workload:
    x, y = torch.randn(BATCH, 16), torch.randn(BATCH, 8)
    return autoplan.Workload(model=DataDependent(), example_inputs=(x,), loss_fn=F.mse_loss, example_targets=(y,))


HUGE_WIDTH = 65536
HUGE_LAYERS = 4


def huge() -> autoplan.Workload:
    """4 x Linear(65536, 65536): 4 * 65536**2 ~= 17.2e9 parameters.

    With Adam (fp32 param + grad + 2 states = 16 bytes/param) that is ~275 GB, ~137 GB per device
    even fully sharded over 2 devices: far above the 24 GiB of a CPU rank. Build it on meta only.
    """
    model = nn.Sequential(*(nn.Linear(HUGE_WIDTH, HUGE_WIDTH) for _ in range(HUGE_LAYERS)))
    x, y = torch.randn(BATCH, HUGE_WIDTH), torch.randn(BATCH, HUGE_WIDTH)
    return autoplan.Workload(
        model=model, example_inputs=(x,), loss_fn=F.mse_loss, example_targets=(y,), optimizer="adam"
    )


def gpt2_4_layers() -> autoplan.Workload:
    """Hugging Face GPT-2 with 4 layers of width 32 (enough blocks for the repeated-block
    reduction of global-batch plans), batch 8 x 16 tokens, next-token loss."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=128, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)  # fmt: skip
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (8, 16))

    def loss(out, labels):  # noqa: ANN001, ANN202
        return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    return autoplan.Workload(model=GPT2LMHeadModel(cfg), example_inputs=(ids,), loss_fn=loss, example_targets=(ids,))


def plan_workload(wl: autoplan.Workload, cluster: object = "2xCPU", **kwargs: object) -> autoplan.Plan:
    """Plan a workload the way ``autoplan plan`` does (its optimizer unless one is given)."""
    kwargs.setdefault("optimizer", wl.optimizer)
    return autoplan.plan(
        wl.model,
        cluster,  # type: ignore[arg-type]
        example_inputs=wl.example_inputs,
        loss_fn=wl.loss_fn,
        example_targets=wl.example_targets,
        **kwargs,  # type: ignore[arg-type]
    )


def plan_on_meta(build, cluster: object = "2xCPU", **kwargs: object) -> autoplan.Plan:  # noqa: ANN001
    """Plan the workload a build function returns, built on ``meta`` (what ``autoplan plan`` does)."""
    with torch.device("meta"):
        wl = build()
    return plan_workload(wl, cluster, **kwargs)


def ilp_and_pipeline_plans() -> dict[str, autoplan.Plan]:
    """Two small plans of every kind a plan file holds: ``"ilp"`` (the MLP on 2 CPU ranks) and
    ``"pipeline"`` (GPT-2, 4 layers, 2 stages, 4 micro-batches of 2)."""
    pipeline = plan_on_meta(
        gpt2_4_layers,
        global_batch_size=8,
        config=autoplan.ParallelConfig(dp=1, pp=2, microbatch_size=2, num_microbatches=4),
    )
    return {"ilp": plan_on_meta(mlp), "pipeline": pipeline}
