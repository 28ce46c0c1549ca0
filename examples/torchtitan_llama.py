"""A torchtitan-shaped Llama planned on the mesh of torchtitan's ``ParallelDims``.

    torchrun --nproc-per-node 2 examples/torchtitan_llama.py [--tp 2 | --dp-shard 2] [--steps 3] [--out result.json]

``autoplan.integrations.torchtitan.parallelize_fn`` has the signature of torchtitan's
``parallelize_llama(model, parallel_dims, job_config)``: it plans the model on the world mesh of
``parallel_dims`` and returns the sharded model, whose ``forward`` is the training step (loss out).
The model is shaped as torchtitan's Llama 3 ``Transformer`` (``torchtitan/models/llama3/model/
model.py``: ``tok_embeddings``, ``layers`` by index, each with ``attention.wq/wk/wv/wo`` (grouped
query heads), ``feed_forward.w1/w2/w3`` (SwiGLU), ``attention_norm``/``ffn_norm`` (RMSNorm), then
``norm`` and ``output``), with the rotary embedding in its real (cos/sin) form where torchtitan
multiplies complex numbers (the same function). torchtitan itself does not install next to this
project's torch pin on CPU: without it, :class:`ParallelDims` below stands in for
``torchtitan.distributed.ParallelDims`` (the same fields, and a world mesh of the dimensions
above one in torchtitan's order and names). Rank 0 prints each step's loss beside the same model
trained on one device (``--out``: both and the largest parameter difference, as JSON).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoplan.integrations.torchtitan import parallelize_fn
from autoplan.runtime.teardown import destroy_process_groups


@dataclass
class ParallelDims:
    """torchtitan's ``ParallelDims`` fields (``torchtitan/distributed/parallel_dims.py``) and its
    world mesh: the dimensions of more than one rank, in the order ``pp, dp_replicate, dp_shard,
    cp, tp``, with those names."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    world_size: int = 1

    @property
    def world_mesh(self) -> DeviceMesh:
        dims = [("pp", self.pp), ("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard),
                ("cp", self.cp), ("tp", self.tp)]  # fmt: skip
        used = [(name, n) for name, n in dims if n > 1] or [("dp_shard", 1)]
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return init_device_mesh(device, tuple(n for _, n in used), mesh_dim_names=tuple(name for name, _ in used))


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """torchtitan's ``apply_rotary_emb`` on pairs ``(x[2i], x[2i+1])``, in real arithmetic."""
    pairs = x.unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    return torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.attention = Attention(dim, heads, kv_heads)
        self.feed_forward = FeedForward(dim, ffn)
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """torchtitan's Llama 3 ``Transformer`` in small: ``tokens -> logits``."""

    def __init__(self, *, dim: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, ffn: int = 160,
                 vocab: int = 256, max_seq_len: int = 32, rope_theta: float = 500000.0) -> None:  # fmt: skip
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dim, heads, kv_heads, ffn) for i in range(layers)})
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)
        half = dim // heads // 2
        freqs = 1.0 / rope_theta ** (torch.arange(half, dtype=torch.float32) / half)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)  # (seq, head_dim / 2)
        self.register_buffer("rope_cos", angles.cos()[:, None, :], persistent=False)
        self.register_buffer("rope_sin", angles.sin()[:, None, :], persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan's ``cross_entropy_loss`` (``torchtitan/components/loss.py``)."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dp-shard", type=int, default=-1, help="default: the ranks tp leaves")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:  # the real one where torchtitan is installed
        from torchtitan.distributed import ParallelDims as TitanDims  # type: ignore[import-not-found]
    except ImportError:
        TitanDims = ParallelDims  # noqa: N806
    dp_shard = args.dp_shard if args.dp_shard > 0 else world // args.tp
    parallel_dims = TitanDims(dp_replicate=1, dp_shard=dp_shard, cp=1, tp=args.tp, pp=1, ep=1, world_size=world)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    model = Transformer()  # every rank builds the same weights
    reference = copy.deepcopy(model)
    batches = [torch.randint(0, 256, (8, 33)) for _ in range(args.steps)]  # the same global batches on every rank
    tokens, labels = batches[0][:, :-1], batches[0][:, 1:]

    parallelize = parallelize_fn(example_inputs=(tokens,), loss_fn=cross_entropy_loss, example_targets=(labels,),
                                 optimizer="sgd")  # fmt: skip
    pmodel = parallelize(model, parallel_dims, None)  # rank 0 plans on the world mesh; each rank builds its program
    opt = torch.optim.SGD(pmodel.parameters(), lr=1e-2)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1e-2)
    rank0 = torch.distributed.get_rank() == 0
    losses, ref_losses = [], []
    for batch in batches:
        tokens, labels = batch[:, :-1], batch[:, 1:]
        loss = pmodel(tokens, targets=(labels,))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = cross_entropy_loss(reference(tokens), labels)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
        if rank0:
            print(f"loss {losses[-1]:.6f}  single-device {ref_losses[-1]:.6f}", flush=True)
    full = pmodel.full_parameters()  # collective: every rank gathers
    ref = dict(reference.named_parameters())
    diff = max((full[k].cpu() - ref[k].detach()).abs().max().item() for k in full)
    if rank0:
        print(f"mesh {dict(zip(pmodel.mesh.mesh_dim_names or (), pmodel.mesh.shape))}; plan: "
              f"{pmodel.plan.summary().splitlines()[0]}", flush=True)  # fmt: skip
        print(f"largest parameter difference after {args.steps} steps: {diff:.3g}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"losses": losses, "ref_losses": ref_losses, "max_param_diff": diff}, f)
    destroy_process_groups()


if __name__ == "__main__":
    main()
