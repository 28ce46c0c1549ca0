"""Lightning's ``Trainer`` with an autoplan plan: ``ModelParallelStrategy`` and ``configure_model``.

    torchrun --nproc-per-node 2 examples/lightning_trainer.py [--steps 3] [--optimizer adamw|sgd] [--out result.json]

``Trainer(strategy=ModelParallelStrategy())`` starts the process group and its device mesh, then
calls the ``LightningModule``'s ``configure_model`` hook, where ``self.device_mesh`` is that mesh:
there ``parallelize_fn(...)(self.model, self.device_mesh)`` (``autoplan.integrations.lightning``)
plans the model on the mesh and the module keeps the sharded model in its place. ``training_step``
returns the loss of the planned step (``self.model(ids, targets=(ids,))``), which Lightning
back-propagates and steps with ``configure_optimizers``'s optimizer over ``self.parameters()``.
Rank 0 prints each step's loss beside the same model trained on one device (and with ``--out``
writes both, and the largest parameter difference, as JSON).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from transformers import LlamaConfig, LlamaForCausalLM

from autoplan.integrations.lightning import parallelize_fn
from autoplan.runtime.teardown import destroy_process_groups


def build() -> LlamaForCausalLM:
    cfg = LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def lm_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


class LanguageModel(pl.LightningModule):
    """The user's module: ``self.model`` is planned in ``configure_model`` on the strategy's mesh."""

    def __init__(self, model: torch.nn.Module, example: torch.Tensor, optimizer: str) -> None:
        super().__init__()
        self.model = model
        self.example = example
        self.optimizer = optimizer
        self.losses: list[float] = []

    def configure_model(self) -> None:
        plan_on = parallelize_fn(example_inputs=(self.example,), loss_fn=lm_loss, example_targets=(self.example,),
                                 optimizer=self.optimizer)  # fmt: skip
        self.model = plan_on(self.model, self.device_mesh)  # rank 0 plans; every rank builds its program

    def training_step(self, ids: torch.Tensor, batch_idx: int) -> torch.Tensor:  # noqa: ARG002
        loss = self.model(ids, targets=(ids,))  # the planned step: forward and backward, loss out
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        make = torch.optim.AdamW if self.optimizer == "adamw" else torch.optim.SGD
        return make(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build()  # every rank builds the same weights
    reference = copy.deepcopy(model)
    batches = [torch.randint(0, 256, (8, 32)) for _ in range(args.steps)]  # the same global batches on every rank
    module = LanguageModel(model, batches[0], args.optimizer)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's ranks on this node
    trainer = pl.Trainer(
        accelerator="cuda" if torch.cuda.is_available() else "cpu", devices=per_node,
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // per_node, strategy=ModelParallelStrategy(),
        max_steps=args.steps, use_distributed_sampler=False,  # the program reads the global batch on every rank
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))

    make = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.SGD
    ref_opt = make(reference.parameters(), lr=1e-3)
    ref_losses = []
    for ids in batches:
        ref_loss = lm_loss(reference(ids), ids)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    for loss, ref_loss in zip(module.losses, ref_losses, strict=True):
        if trainer.global_rank == 0:
            print(f"loss {loss:.6f}  single-device {ref_loss:.6f}", flush=True)
    full = module.model.full_parameters()  # the trained model; collective: every rank gathers
    ref = dict(reference.named_parameters())
    diff = max((full[k].cpu() - ref[k].detach()).abs().max().item() for k in full)
    if trainer.global_rank == 0:
        print(f"largest parameter difference after {args.steps} steps: {diff:.3g}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"losses": module.losses, "ref_losses": ref_losses, "max_param_diff": diff}, f)
    destroy_process_groups()


if __name__ == "__main__":
    main()
