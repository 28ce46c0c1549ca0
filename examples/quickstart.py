"""The Python API end to end: plan on the meta device, then train the sharded model.

    torchrun --nproc-per-node 4 examples/quickstart.py

Rank 0 prints the plan, the generated per-rank program's first lines and, for each step, the
sharded loss beside the loss of the same model trained on one device.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import autoplan
from autoplan.runtime.teardown import destroy_process_groups


def build() -> LlamaForCausalLM:
    cfg = LlamaConfig(
        num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=64, use_cache=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def lm_loss(out, labels: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank, world = dist.get_rank(), dist.get_world_size()
    cluster = autoplan.Cluster.preset(f"{world}x{'H100' if torch.cuda.is_available() else 'CPU'}")

    # 1. plan without weights: the model and batch live on the meta device
    with torch.device("meta"):
        meta_model, meta_ids = build(), torch.randint(0, 512, (16, 64))
    plan = autoplan.plan(meta_model, cluster, example_inputs=(meta_ids,), loss_fn=lm_loss, example_targets=(meta_ids,))
    if rank == 0:
        print(plan.summary())

    # 2. apply it: every rank builds the same weights (same seed) and keeps its shards
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 512, (16, 64))
    pmodel = autoplan.parallelize(
        model, cluster, example_inputs=(ids,), loss_fn=lm_loss, example_targets=(ids,), plan=plan
    )
    if rank == 0:
        print("\n".join(pmodel.code.strip().splitlines()[:12]), "\n    ...")

    opt = pmodel.make_optimizer(lr=1e-3)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-3)
    for step in range(3):
        loss = pmodel.forward_backward(ids, targets=(ids,))
        opt.step()
        opt.zero_grad()
        ref_loss = lm_loss(reference(ids), ids)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if rank == 0:
            print(f"step {step + 1}: loss {loss.item():.6f}  single-device {ref_loss.item():.6f}")
    destroy_process_groups()  # barrier, destroy, and join gloo's threads now (autoplan/runtime/teardown.py)


if __name__ == "__main__":
    main()
