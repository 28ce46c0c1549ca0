"""Small seeded models, batches and losses for CPU tests.

Every builder is deterministic: called twice (in two processes, too) it returns the same
weights, so each rank of a test job can build its own copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# --- MLP -----------------------------------------------------------------------------------------

MLP_IN = 16
MLP_HIDDEN = 32
MLP_OUT = 8


def mlp(seed: int = 0) -> nn.Sequential:
    """Linear(16, 32) -> GELU -> Linear(32, 8) -> LayerNorm(8); input (B, 16), output (B, 8).

    FQNs: ``0.weight`` (32, 16), ``0.bias``, ``2.weight`` (8, 32), ``2.bias``, ``3.weight``, ``3.bias``.
    """
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(MLP_IN, MLP_HIDDEN), nn.GELU(), nn.Linear(MLP_HIDDEN, MLP_OUT), nn.LayerNorm(MLP_OUT)
    )
    # A non-trivial LayerNorm affine, so its gradients are not all equal.
    with torch.no_grad():
        model[3].weight.uniform_(0.5, 1.5)
        model[3].bias.uniform_(-0.5, 0.5)
    return model


def mlp_batch(batch: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)``: inputs (B, 16) and regression targets (B, 8)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, MLP_IN, generator=g), torch.randn(batch, MLP_OUT, generator=g)


def mse_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


# --- Hugging Face language models ----------------------------------------------------------------

VOCAB = 128
MAX_POSITIONS = 64


def gpt2_tiny(seed: int = 0, num_layers: int = 2) -> nn.Module:
    """HF GPT-2: ``num_layers`` layers (2), n_embd 32, 4 heads, vocab 128, 64 positions, no dropout (tied lm_head)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=num_layers,
        n_embd=32,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=MAX_POSITIONS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).eval()


def llama_tiny(seed: int = 0, num_layers: int = 2) -> nn.Module:
    """HF Llama with grouped-query attention: ``num_layers`` layers (2), hidden 32, MLP 64, 4 query heads sharing
    2 key/value heads (head_dim 8), vocab 128, 64 positions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=num_layers,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=MAX_POSITIONS,
        attention_dropout=0.0,
        use_cache=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def token_batch(batch: int = 8, seq: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)``, both (B, T) int64 in [0, 128); labels are the next tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def lm_loss(out: object, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of an HF ``CausalLMOutput``: logits (B, T, V), labels (B, T)."""
    return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())
