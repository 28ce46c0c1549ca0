"""Build functions for the plan benchmark suite (``benchmarks/suite.yaml``, ``autoplan bench``).

    autoplan bench benchmarks/suite.yaml --baseline benchmarks/suite_baseline.json

Each returns an ``autoplan.Workload`` and is built on the ``meta`` device (nothing is
allocated), so the shapes cost planning time only, not memory. The GPT-2 model is written out
here (nanoGPT layout: ``transformer.h.<i>`` blocks, tied ``lm_head``) so the suite needs no
Hugging Face download or import.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import autoplan

# -- MLPs --------------------------------------------------------------------------------------


def _mlp(num_in: int, num_hidden: int, num_out: int, batch: int) -> autoplan.Workload:
    model = nn.Sequential(nn.Linear(num_in, num_hidden), nn.GELU(), nn.Linear(num_hidden, num_out))
    x = torch.randn(batch, num_in)  # (B, num_in)
    y = torch.randn(batch, num_out)  # (B, num_out)
    return autoplan.Workload(model=model, example_inputs=(x,), loss_fn=F.mse_loss, example_targets=(y,))


def mlp_small() -> autoplan.Workload:
    """Linear(64, 256) -> GELU -> Linear(256, 64), batch 32: activations and weights of similar size."""
    return _mlp(64, 256, 64, batch=32)


def mlp_wide() -> autoplan.Workload:
    """Linear(1024, 16384) -> GELU -> Linear(16384, 1024), batch 8: 33.6M parameters (134 MB
    fp32) against 0.5 MB of activations, so gradient reductions dominate a data-parallel plan and
    sharding the weights (Megatron column/row split) is cheaper."""
    return _mlp(1024, 16384, 1024, batch=8)


# -- GPT-2 -------------------------------------------------------------------------------------


class _Attention(nn.Module):
    def __init__(self, num_embd: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.c_attn = nn.Linear(num_embd, 3 * num_embd)
        self.c_proj = nn.Linear(num_embd, num_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape  # (B, T, C)
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.num_heads, c // self.num_heads).transpose(1, 2) for z in (q, k, v))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class _Block(nn.Module):
    def __init__(self, num_embd: int, num_heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(num_embd)
        self.attn = _Attention(num_embd, num_heads)
        self.ln_2 = nn.LayerNorm(num_embd)
        self.mlp = nn.Sequential(nn.Linear(num_embd, 4 * num_embd), nn.GELU(), nn.Linear(4 * num_embd, num_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """GPT-2 (Radford et al. 2019) in nanoGPT's layout: token + position embeddings, ``num_layers``
    pre-norm blocks, final LayerNorm, language-model head tied to the token embedding."""

    def __init__(self, *, num_layers: int, num_embd: int, num_heads: int, vocab_size: int, max_seq: int) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab_size, num_embd),
                "wpe": nn.Embedding(max_seq, num_embd),
                "h": nn.ModuleList(_Block(num_embd, num_heads) for _ in range(num_layers)),
                "ln_f": nn.LayerNorm(num_embd),
            }
        )
        self.lm_head = nn.Linear(num_embd, vocab_size, bias=False)
        self.lm_head.weight = self.transformer["wte"].weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]  # ids (B, T)
        pos = torch.arange(t, device=ids.device)
        x = self.transformer["wte"](ids) + self.transformer["wpe"](pos)  # (B, T, C)
        for block in self.transformer["h"]:
            x = block(x)
        return self.lm_head(self.transformer["ln_f"](x))  # (B, T, V)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy: logits (B, T, V) at position t predict labels[t + 1]."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def gpt2_small_4_layers() -> autoplan.Workload:
    """GPT-2 small's widths (768 wide, 12 heads, vocab 50257, 1024 positions) with 4 layers; one
    sample of 1024 tokens (``global_batch_size`` in the suite sets the batch). 67.7M parameters:
    38.6M tied embedding + 0.8M positions + 4 x 7.1M blocks."""
    model = GPT2(num_layers=4, num_embd=768, num_heads=12, vocab_size=50257, max_seq=1024)
    ids = torch.randint(0, 50257, (1, 1024))  # (B, T)
    return autoplan.Workload(model=model, example_inputs=(ids,), loss_fn=lm_loss, example_targets=(ids,))
