"""Build functions for `autoplan plan/run`: tiny Hugging Face models with a language-model loss.

They train with SGD + momentum so that `--compare` can show parameters matching the
single-device run to rounding error: Adam divides by sqrt(v), so a parameter whose true gradient
is exactly zero (the attention key bias: softmax ignores a constant shift) moves by ~lr from
rounding noise, differently for every summation order. Pass ``--optimizer adam`` to train with Adam.

    autoplan run examples/hf_models.py:gpt2_tiny --cluster 4xCPU --steps 5 --compare

Each function returns an ``autoplan.Workload``. autoplan calls it on the ``meta`` device to
plan (no weights allocated) and on CPU, with the same seed on every rank, to train.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import autoplan

VOCAB = 512
BATCH, SEQ = 16, 64


def lm_loss(output, labels: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 - a transformers ModelOutput
    """Next-token cross entropy: logits (B, T, V) at position t predict labels[t + 1]."""
    logits = output.logits[:, :-1].flatten(0, 1)
    return F.cross_entropy(logits, labels[:, 1:].flatten())


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ))


def gpt2_tiny() -> autoplan.Workload:
    """GPT-2 architecture, 2 layers of width 128 (HF transformers, no pretrained weights)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=2,
        n_embd=128,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    ids = _batch()
    return autoplan.Workload(
        model=GPT2LMHeadModel(cfg),
        example_inputs=(ids,),
        loss_fn=lm_loss,
        example_targets=(ids,),
        optimizer="sgd_momentum",
        lr=0.05,
    )


def llama_tiny() -> autoplan.Workload:
    """Llama architecture with grouped-query attention (4 query heads, 2 key/value heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        use_cache=False,
    )
    ids = _batch()
    return autoplan.Workload(
        model=LlamaForCausalLM(cfg),
        example_inputs=(ids,),
        loss_fn=lm_loss,
        example_targets=(ids,),
        optimizer="sgd_momentum",
        lr=0.05,
    )
