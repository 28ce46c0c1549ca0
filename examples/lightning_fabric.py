"""Lightning Fabric with an autoplan plan: ``ModelParallelStrategy(parallelize_fn=...)``.

    torchrun --nproc-per-node 2 examples/lightning_fabric.py [--steps 3] [--optimizer adamw|sgd] [--out result.json]

Fabric starts the process group and its device mesh; ``fabric.setup_module`` calls autoplan's
``parallelize_fn`` (``autoplan.integrations.lightning``), which plans the model on that mesh and
returns the sharded model. The loop is Fabric's: ``loss = model(...)``, ``fabric.backward(loss)``,
``opt.step()``. Rank 0 prints each step's loss beside the same model trained on one device (and
with ``--out`` writes both, and the largest parameter difference, as JSON).
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from transformers import LlamaConfig, LlamaForCausalLM

from autoplan.integrations.lightning import parallel_model, parallelize_fn
from autoplan.runtime.teardown import destroy_process_groups


def build() -> LlamaForCausalLM:
    cfg = LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def lm_loss(out, labels: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


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

    strategy = ModelParallelStrategy(parallelize_fn(example_inputs=(batches[0],), loss_fn=lm_loss,
                                                    example_targets=(batches[0],), optimizer=args.optimizer))  # fmt: skip
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's ranks on this node
    fabric = Fabric(
        accelerator="cuda" if torch.cuda.is_available() else "cpu", devices=per_node,
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // per_node, strategy=strategy,
    )  # fmt: skip
    fabric.launch()
    pmodel = fabric.setup_module(model)  # rank 0 plans on the strategy's mesh; each rank builds its program
    make = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.SGD
    opt = fabric.setup_optimizers(make(pmodel.parameters(), lr=1e-3))
    ref_opt = make(reference.parameters(), lr=1e-3)
    losses, ref_losses = [], []
    for ids in batches:
        loss = pmodel(ids.to(fabric.device), targets=(ids.to(fabric.device),))
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        ref_loss = lm_loss(reference(ids), ids)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
        fabric.print(f"loss {losses[-1]:.6f}  single-device {ref_losses[-1]:.6f}")
    full = parallel_model(pmodel).full_parameters()  # the trained model; collective: every rank gathers
    ref = dict(reference.named_parameters())
    diff = max((full[k].cpu() - ref[k].detach()).abs().max().item() for k in full)
    fabric.print(f"largest parameter difference after {args.steps} steps: {diff:.3g}")
    if args.out and fabric.global_rank == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "ref_losses": ref_losses, "max_param_diff": diff}, f)
    destroy_process_groups()


if __name__ == "__main__":
    main()
