"""Build functions for `autoplan plan/run`: tiny Hugging Face models with a language-model loss.

They train with SGD + momentum so that `--compare` can show parameters matching the
single-device run to rounding error: Adam divides by sqrt(v), so a parameter whose true gradient
is exactly zero (the attention key bias: softmax ignores a constant shift) moves by ~lr from
rounding noise, differently for every summation order. Pass ``--optimizer adam`` to train with Adam.

    autoplan run examples/hf_models.py:gpt2_tiny --cluster 4xCPU --steps 5 --compare

Each function returns an ``autoplan.Workload``. autoplan calls it on the ``meta`` device to
plan (no weights allocated) and on CPU, with the same seed on every rank, to train.

``ZOO`` (the end of the file) indexes one tiny configuration per architecture, 27 of them:
decoders (fused-projection and mixture-of-experts ones included), encoders, encoder-decoders,
vision and speech models, each with the loss of its task (``tests/test_model_zoo.py``,
``benchmarks/model_zoo.py``):

    autoplan run examples/hf_models.py:t5_zoo --cluster 2xCPU --steps 3 --compare
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

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


def mixtral_8x7b() -> autoplan.Workload:
    """Mixtral 8x7B's shape (Jiang et al. 2024, table 1: 32 layers, width 4096, 32 heads with 8
    key/value heads, 8 SwiGLU experts of 14336, top 2, vocabulary 32000) on sequences of 4096
    tokens, for planning only: build it on ``meta`` (``autoplan plan`` does), e.g.
    ``autoplan plan examples/hf_models.py:mixtral_8x7b --cluster 8x8xH100 --global-batch-size 1024
    --precision bf16 --out mixtral.json``."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=4096, router_jitter_noise=0.0, use_cache=False,
    )  # fmt: skip
    ids = torch.randint(0, 32000, (1, 4096))
    return autoplan.Workload(
        model=MixtralForCausalLM(cfg), example_inputs=(ids,), loss_fn=lm_loss, example_targets=(ids,), optimizer="adamw"
    )


def llama3_8b_128k() -> autoplan.Workload:
    """Llama 3 8B's shape (Grattafiori et al. 2024, table 3: 32 layers, width 4096, 32 heads with 8
    key/value heads, SwiGLU of 14336, vocabulary 128256, RoPE base 500000) on sequences of 131,072
    tokens, for planning only: build it on ``meta``, e.g. ``autoplan plan
    examples/hf_models.py:llama3_8b_128k --cluster 1x8xH100 --global-batch-size 16 --precision bf16
    --out llama8b-128k.json``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    seq = 131072
    cfg = LlamaConfig(
        num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=seq, rope_theta=500000.0,
        use_cache=False,
    )  # fmt: skip
    ids = torch.randint(0, 128256, (1, seq))
    return autoplan.Workload(
        model=LlamaForCausalLM(cfg), example_inputs=(ids,), loss_fn=lm_loss, example_targets=(ids,), optimizer="adamw"
    )


def falcon_7b_32k() -> autoplan.Workload:
    """Falcon-7B's shape (Almazrouei et al. 2023, "The Falcon Series of Open Language Models",
    table 1 / its Hugging Face config: 32 layers, width 4544, 71 heads of 64 with one key/value
    head (multi-query), parallel attention and MLP, vocabulary 65024) on sequences of 32,768 tokens,
    for planning only: 71 heads split over no tensor-parallel degree, so a long sequence is split
    by ring attention (``passes/ring_attention.py``), e.g. ``autoplan plan
    examples/hf_models.py:falcon_7b_32k --cluster 1x8xH100 --global-batch-size 8 --precision bf16
    --out falcon-32k.json``."""
    from transformers import FalconConfig, FalconForCausalLM

    seq = 32768
    cfg = FalconConfig(
        vocab_size=65024, hidden_size=4544, num_hidden_layers=32, num_attention_heads=71, multi_query=True,
        new_decoder_architecture=False, parallel_attn=True, bias=False, max_position_embeddings=seq,
        attention_dropout=0.0, hidden_dropout=0.0, use_cache=False,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    ids = torch.randint(0, 65024, (1, seq))
    return autoplan.Workload(
        model=FalconForCausalLM(cfg), example_inputs=(ids,), loss_fn=lm_loss, example_targets=(ids,), optimizer="adamw"
    )


# --- the model zoo: one tiny configuration per architecture --------------------------------------
#
# Random weights from the `transformers` config classes (nothing is downloaded): 2 layers of width
# 32 (4 heads of 8, 2 key/value heads where the architecture has grouped-query attention), MLPs of
# 64, vocabulary 128, batches of 4 sequences of 16 tokens (16x16 images, 400 audio samples), no
# dropout. Every builder returns a Workload whose `batches(step)` draws a new seeded batch per
# step (the same on every rank). `ZOO` names each one with the parameters the zoo test freezes
# (tests/test_model_zoo.py, benchmarks/model_zoo.py).

ZOO_VOCAB = 128
ZOO_BATCH, ZOO_SEQ = 4, 16
ZOO_IMAGE, ZOO_LABELS = 16, 10
ZOO_AUDIO_SAMPLES = 400
_NO_DROPOUT = dict(attention_dropout=0.0, hidden_dropout=0.0)
_DECODER = dict(
    num_hidden_layers=2,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=ZOO_VOCAB,
    max_position_embeddings=64,
    use_cache=False,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=0,
)
_ENCODER = dict(
    num_hidden_layers=2,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    vocab_size=ZOO_VOCAB,
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
_MOE = dict(num_experts_per_tok=2, experts_implementation="batched_mm")
"""``batched_mm`` gathers each token's expert weights and multiplies them in one bmm: static shapes
(the eager implementation loops over the experts a batch happens to hit, which export cannot
capture)."""


def _generator(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + step)


def _ids(step: int, *shape: int, high: int = ZOO_VOCAB) -> torch.Tensor:
    """Seeded int64 token ids in [0, high) on the default device (``meta`` while planning)."""
    return torch.randint(0, high, shape, generator=_generator(step)).to(torch.get_default_device())


def _floats(step: int, *shape: int) -> torch.Tensor:
    """Seeded standard-normal floats (pixels, audio, log-mel features) on the default device."""
    return torch.randn(shape, generator=_generator(step)).to(torch.get_default_device())


def token_loss(output, labels: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 - a transformers ModelOutput
    """Per-token cross entropy: logits (B, T, V) against labels (B, T) (masked LM, seq2seq)."""
    return F.cross_entropy(output.logits.flatten(0, 1), labels.flatten())


def class_loss(output, labels: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 - a transformers ModelOutput
    """Classification cross entropy: logits (B, C) against labels (B,)."""
    return F.cross_entropy(output.logits, labels)


Batches = Callable[[int], tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]


def _nonzero_biases(model: torch.nn.Module) -> torch.nn.Module:
    """Biases uniform in [-0.1, 0.1] instead of transformers' zeros. An attention key bias gets an
    exactly zero gradient (softmax ignores a shift shared by all keys): started at zero it only
    ever holds rounding noise, which differs with the summation order and no relative tolerance
    can compare; started elsewhere it stays there, up to that noise."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit(".", 1)[-1] == "bias":
                p.uniform_(-0.1, 0.1)
    return model


def _workload(model: torch.nn.Module, batches: Batches, loss_fn: Callable[..., torch.Tensor]) -> autoplan.Workload:
    model = _nonzero_biases(model)
    inputs, targets = batches(0)
    return autoplan.Workload(
        model=model.eval(),  # no dropout; gradients flow all the same
        example_inputs=inputs,
        loss_fn=loss_fn,
        example_targets=targets,
        optimizer="sgd_momentum",
        lr=0.05,
        batches=batches,
    )


def _causal_lm(model: torch.nn.Module) -> autoplan.Workload:
    """Next-token prediction on (B, T) token ids."""

    def batches(step: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        ids = _ids(step, ZOO_BATCH, ZOO_SEQ)
        return (ids,), (ids,)

    return _workload(model, batches, lm_loss)


def _masked_lm(model: torch.nn.Module) -> autoplan.Workload:
    """Token ids in, a label per position out (B, T)."""

    def batches(step: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        return (_ids(step, ZOO_BATCH, ZOO_SEQ),), (_ids(step + 500, ZOO_BATCH, ZOO_SEQ),)

    return _workload(model, batches, token_loss)


def _seq2seq(model: torch.nn.Module, source: Callable[[int], torch.Tensor]) -> autoplan.Workload:
    """``model(source, attention_mask, decoder_input_ids)`` (the HF positional order; the mask is
    all ones), labels are the decoder inputs shifted by one."""

    def batches(step: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        src = source(step)
        mask = torch.ones(src.shape[0], src.shape[-1], dtype=torch.int64, device=src.device)
        tokens = _ids(step + 500, ZOO_BATCH, ZOO_SEQ + 1)
        return (src, mask, tokens[:, :-1].contiguous()), (tokens[:, 1:].contiguous(),)

    return _workload(model, batches, token_loss)


def _classifier(model: torch.nn.Module, inputs: Callable[[int], torch.Tensor]) -> autoplan.Workload:
    def batches(step: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        x = inputs(step)
        return (x,), (_ids(step + 500, x.shape[0], high=model.config.num_labels),)

    return _workload(model, batches, class_loss)


def _images(step: int) -> torch.Tensor:
    return _floats(step, ZOO_BATCH, 3, ZOO_IMAGE, ZOO_IMAGE)


# decoders ----------------------------------------------------------------------------------------


def gpt2_zoo() -> autoplan.Workload:
    """GPT-2: fused ``c_attn`` (q, k, v in one Conv1D), learned position table, tied lm_head."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=ZOO_VOCAB, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return _causal_lm(GPT2LMHeadModel(cfg))


def llama_zoo() -> autoplan.Workload:
    """Llama: RoPE, RMSNorm, SwiGLU, grouped-query attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _causal_lm(LlamaForCausalLM(LlamaConfig(**_DECODER, attention_dropout=0.0)))


def mistral_zoo() -> autoplan.Workload:
    """Mistral: Llama with a sliding attention window (8 < sequence 16, so it bites)."""
    from transformers import MistralConfig, MistralForCausalLM

    return _causal_lm(MistralForCausalLM(MistralConfig(**_DECODER, head_dim=8, sliding_window=8)))


def qwen2_zoo() -> autoplan.Workload:
    """Qwen2: Llama with q/k/v biases."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _causal_lm(Qwen2ForCausalLM(Qwen2Config(**_DECODER)))


def gemma_zoo() -> autoplan.Workload:
    """Gemma: scaled embeddings, (1 + w) RMSNorm, GeGLU, tied lm_head."""
    from transformers import GemmaConfig, GemmaForCausalLM

    return _causal_lm(GemmaForCausalLM(GemmaConfig(**_DECODER, head_dim=8)))


def phi3_zoo() -> autoplan.Workload:
    """Phi-3: fused ``qkv_proj`` and ``gate_up_proj``."""
    from transformers import Phi3Config, Phi3ForCausalLM

    return _causal_lm(Phi3ForCausalLM(Phi3Config(**_DECODER, resid_pdrop=0.0, embd_pdrop=0.0)))


def phi3_mha_zoo() -> autoplan.Workload:
    """Phi-3-mini's layout: fused ``qkv_proj`` with as many key/value heads as query heads (its
    q, k and v slices are equal segments) and fused ``gate_up_proj``."""
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg = Phi3Config(**{**_DECODER, "num_key_value_heads": _DECODER["num_attention_heads"]}, resid_pdrop=0.0, embd_pdrop=0.0)
    return _causal_lm(Phi3ForCausalLM(cfg))


def falcon_zoo() -> autoplan.Workload:
    """Falcon (7B layout): fused multi-query ``query_key_value``, parallel attention and MLP."""
    from transformers import FalconConfig, FalconForCausalLM

    cfg = FalconConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=ZOO_VOCAB, use_cache=False,
        bos_token_id=0, eos_token_id=0, **_NO_DROPOUT,
    )  # fmt: skip
    return _causal_lm(FalconForCausalLM(cfg))


def bloom_zoo() -> autoplan.Workload:
    """BLOOM: fused ``query_key_value``, ALiBi position bias, embedding LayerNorm."""
    from transformers import BloomConfig, BloomForCausalLM

    cfg = BloomConfig(
        n_layer=2, hidden_size=32, n_head=4, vocab_size=ZOO_VOCAB, use_cache=False, bos_token_id=0,
        eos_token_id=0, pad_token_id=0, **_NO_DROPOUT,
    )  # fmt: skip
    return _causal_lm(BloomForCausalLM(cfg))


def gpt_neox_zoo() -> autoplan.Workload:
    """GPT-NeoX (Pythia): fused ``query_key_value``, partial rotary, parallel residual."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=ZOO_VOCAB,
        max_position_embeddings=64, use_cache=False, bos_token_id=0, eos_token_id=0, **_NO_DROPOUT,
    )  # fmt: skip
    return _causal_lm(GPTNeoXForCausalLM(cfg))


def opt_zoo() -> autoplan.Workload:
    """OPT: learned positions with an offset of 2, ReLU MLP."""
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(
        num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=4, vocab_size=ZOO_VOCAB,
        max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, layerdrop=0.0, use_cache=False, pad_token_id=1, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return _causal_lm(OPTForCausalLM(cfg))


def gemma2_zoo() -> autoplan.Workload:
    """Gemma 2: attention and final logit soft-capping, sliding-window layers alternating with
    global ones, norms before and after the attention and the MLP."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return _causal_lm(Gemma2ForCausalLM(Gemma2Config(**_DECODER, head_dim=8, sliding_window=8, attention_dropout=0.0)))


def gemma3_zoo() -> autoplan.Workload:
    """Gemma 3 (text): query/key RMSNorm, local sliding-window layers with their own RoPE base."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(**_DECODER, head_dim=8, sliding_window=8, attention_dropout=0.0)
    return _causal_lm(Gemma3ForCausalLM(cfg))


def qwen3_zoo() -> autoplan.Workload:
    """Qwen3: Llama with query/key RMSNorm per head."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _causal_lm(Qwen3ForCausalLM(Qwen3Config(**_DECODER, head_dim=8, attention_dropout=0.0)))


def olmo2_zoo() -> autoplan.Workload:
    """OLMo 2: norms after the attention and the MLP (not before), query/key RMSNorm over all heads."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    return _causal_lm(Olmo2ForCausalLM(Olmo2Config(**_DECODER, attention_dropout=0.0)))


def granite_zoo() -> autoplan.Workload:
    """Granite: Llama with embedding, residual, attention and logit multipliers."""
    from transformers import GraniteConfig, GraniteForCausalLM

    cfg = GraniteConfig(
        **_DECODER, attention_dropout=0.0, embedding_multiplier=2.0, residual_multiplier=0.5,
        attention_multiplier=0.25, logits_scaling=2.0,
    )  # fmt: skip
    return _causal_lm(GraniteForCausalLM(cfg))


def cohere_zoo() -> autoplan.Workload:
    """Command-R (Cohere): attention and MLP in parallel off one bias-free LayerNorm, scaled
    logits, tied lm_head."""
    from transformers import CohereConfig, CohereForCausalLM

    return _causal_lm(CohereForCausalLM(CohereConfig(**_DECODER, attention_dropout=0.0)))


def stablelm_zoo() -> autoplan.Workload:
    """StableLM: LayerNorm with biases, rotary embedding on a quarter of each head."""
    from transformers import StableLmConfig, StableLmForCausalLM

    cfg = StableLmConfig(**_DECODER, attention_dropout=0.0, hidden_dropout=0.0)
    return _causal_lm(StableLmForCausalLM(cfg))


def starcoder2_zoo() -> autoplan.Workload:
    """StarCoder2: biases everywhere, LayerNorm, GELU MLP (``c_fc``/``c_proj``), sliding window."""
    from transformers import Starcoder2Config, Starcoder2ForCausalLM

    cfg = Starcoder2Config(
        **_DECODER, sliding_window=8, attention_dropout=0.0, residual_dropout=0.0, embedding_dropout=0.0
    )
    return _causal_lm(Starcoder2ForCausalLM(cfg))


def phi_zoo() -> autoplan.Workload:
    """Phi-1/2: attention and MLP in parallel, partial rotary embedding, ``dense`` output projection."""
    from transformers import PhiConfig, PhiForCausalLM

    cfg = PhiConfig(**_DECODER, attention_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    return _causal_lm(PhiForCausalLM(cfg))


_GPT_STYLE = dict(
    n_layer=2, n_embd=32, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    vocab_size=ZOO_VOCAB, use_cache=False, bos_token_id=0, eos_token_id=0,
)  # fmt: skip


def gptj_zoo() -> autoplan.Workload:
    """GPT-J: attention and MLP in parallel, interleaved (every-other-element) rotary embedding on
    the first dims of each head, bias-free q/k/v."""
    from transformers import GPTJConfig, GPTJForCausalLM

    return _causal_lm(GPTJForCausalLM(GPTJConfig(**_GPT_STYLE, rotary_dim=4)))


def codegen_zoo() -> autoplan.Workload:
    """CodeGen: one fused ``qkv_proj`` laid out in 4 model-parallel blocks (q, v, k inside each),
    GPT-J's rotary embedding and parallel block, lm_head with a bias."""
    from transformers import CodeGenConfig, CodeGenForCausalLM

    return _causal_lm(CodeGenForCausalLM(CodeGenConfig(**_GPT_STYLE, n_ctx=64, rotary_dim=4)))


def gpt_bigcode_zoo() -> autoplan.Workload:
    """GPTBigCode (StarCoder 1, SantaCoder): GPT-2 with multi-query attention, one fused
    ``c_attn`` Linear of rows ``[q (H·D); k (D); v (D)]``."""
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    return _causal_lm(GPTBigCodeForCausalLM(GPTBigCodeConfig(**_GPT_STYLE, multi_query=True)))


def mpt_zoo() -> autoplan.Workload:
    """MPT: ALiBi position bias (no position embedding), fused ``Wqkv``, bias-free LayerNorm and
    linears."""
    from transformers import MptConfig, MptForCausalLM

    cfg = MptConfig(
        n_layers=2, d_model=32, n_heads=4, max_seq_len=64, vocab_size=ZOO_VOCAB, use_cache=False,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return _causal_lm(MptForCausalLM(cfg))


def mamba_zoo() -> autoplan.Workload:
    """Mamba: selective state-space layers (causal depthwise convolution, input-dependent scan), no
    attention."""
    from transformers import MambaConfig, MambaForCausalLM

    cfg = MambaConfig(
        vocab_size=ZOO_VOCAB, hidden_size=32, state_size=4, num_hidden_layers=2, use_cache=False, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return _causal_lm(MambaForCausalLM(cfg))


# mixture-of-experts decoders (4 experts, top 2) --------------------------------------------------


def mixtral_zoo() -> autoplan.Workload:
    """Mixtral: top-2 of 4 SwiGLU experts (fused ``gate_up_proj`` per expert) per layer."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(**_DECODER, **_MOE, num_local_experts=4, head_dim=8, router_jitter_noise=0.0)
    return _causal_lm(MixtralForCausalLM(cfg))


def qwen2_moe_zoo() -> autoplan.Workload:
    """Qwen2-MoE: routed experts plus a gated shared expert."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        **_DECODER, **_MOE, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        decoder_sparse_step=1,
    )  # fmt: skip
    return _causal_lm(Qwen2MoeForCausalLM(cfg))


def qwen3_moe_zoo() -> autoplan.Workload:
    """Qwen3-MoE: routed experts, q/k RMSNorm."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**_DECODER, **_MOE, num_experts=4, moe_intermediate_size=32, head_dim=8)
    return _causal_lm(Qwen3MoeForCausalLM(cfg))


def olmoe_zoo() -> autoplan.Workload:
    """OLMoE: routed experts, q/k RMSNorm over all heads."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    cfg = OlmoeConfig(**_DECODER, **_MOE, num_experts=4)
    return _causal_lm(OlmoeForCausalLM(cfg))


def deepseek_v3_zoo() -> autoplan.Workload:
    """DeepSeek-V3: multi-head latent attention (low-rank q and kv), one dense layer, then routed
    plus shared experts with grouped sigmoid routing."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        **{**_DECODER, "num_key_value_heads": 4}, **_MOE, n_routed_experts=4, n_shared_experts=1,
        moe_intermediate_size=32, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1,
    )  # fmt: skip
    return _causal_lm(DeepseekV3ForCausalLM(cfg))


# encoders (masked language modelling) ------------------------------------------------------------


def bert_zoo() -> autoplan.Workload:
    from transformers import BertConfig, BertForMaskedLM

    return _masked_lm(BertForMaskedLM(BertConfig(**_ENCODER)))


def roberta_zoo() -> autoplan.Workload:
    """RoBERTa: positions start after the padding index."""
    from transformers import RobertaConfig, RobertaForMaskedLM

    return _masked_lm(RobertaForMaskedLM(RobertaConfig(**_ENCODER, pad_token_id=1)))


def distilbert_zoo() -> autoplan.Workload:
    from transformers import DistilBertConfig, DistilBertForMaskedLM

    cfg = DistilBertConfig(
        n_layers=2, dim=32, hidden_dim=64, n_heads=4, vocab_size=ZOO_VOCAB, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    return _masked_lm(DistilBertForMaskedLM(cfg))


def electra_zoo() -> autoplan.Workload:
    """ELECTRA generator: embeddings of 16 projected to the hidden width 32."""
    from transformers import ElectraConfig, ElectraForMaskedLM

    return _masked_lm(ElectraForMaskedLM(ElectraConfig(**_ENCODER, embedding_size=16)))


# encoder-decoders --------------------------------------------------------------------------------


def albert_zoo() -> autoplan.Workload:
    """ALBERT: factorized embedding (16 -> 32), one layer's weights shared by every layer."""
    from transformers import AlbertConfig, AlbertForMaskedLM

    return _masked_lm(AlbertForMaskedLM(AlbertConfig(**_ENCODER, embedding_size=16)))


def deberta_v2_zoo() -> autoplan.Workload:
    """DeBERTa-v2: disentangled attention (content-to-position and position-to-content terms over
    log-bucketed relative positions)."""
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM

    cfg = DebertaV2Config(**_ENCODER, relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"])
    return _masked_lm(DebertaV2ForMaskedLM(cfg))


def t5_zoo() -> autoplan.Workload:
    """T5: learned relative position bias added to the attention scores."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        num_layers=2, d_model=32, d_kv=8, d_ff=64, num_heads=4, vocab_size=ZOO_VOCAB, dropout_rate=0.0,
        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, use_cache=False,
    )  # fmt: skip
    return _seq2seq(T5ForConditionalGeneration(cfg), lambda step: _ids(step, ZOO_BATCH, ZOO_SEQ))


def bart_zoo() -> autoplan.Workload:
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(
        encoder_layers=2, decoder_layers=2, d_model=32, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=ZOO_VOCAB, max_position_embeddings=64, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, use_cache=False, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
    )  # fmt: skip
    return _seq2seq(BartForConditionalGeneration(cfg), lambda step: _ids(step, ZOO_BATCH, ZOO_SEQ))


# vision (image classification, 16x16 RGB, 10 classes) --------------------------------------------


def vit_zoo() -> autoplan.Workload:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(**{**_ENCODER, "vocab_size": None}, image_size=ZOO_IMAGE, patch_size=4, num_labels=ZOO_LABELS)
    return _classifier(ViTForImageClassification(cfg), _images)


def dinov2_zoo() -> autoplan.Workload:
    """DINOv2: ViT with layer scale and an interpolated position table (its ``mask_token`` is read
    only when masking patches, so the zoo freezes it)."""
    from transformers import Dinov2Config, Dinov2ForImageClassification

    encoder = {
        k: v for k, v in _ENCODER.items() if k not in ("vocab_size", "max_position_embeddings", "intermediate_size")
    }
    cfg = Dinov2Config(**encoder, mlp_ratio=2, image_size=ZOO_IMAGE, patch_size=4, num_labels=ZOO_LABELS)
    return _classifier(Dinov2ForImageClassification(cfg), _images)


def convnext_zoo() -> autoplan.Workload:
    """ConvNeXt: depthwise 7x7 convolutions, LayerNorm over channels, layer scale."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    cfg = ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], patch_size=2, num_labels=ZOO_LABELS)
    return _classifier(ConvNextForImageClassification(cfg), _images)


def resnet_zoo() -> autoplan.Workload:
    """ResNet (basic blocks): BatchNorm with running statistics (eval mode)."""
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=ZOO_LABELS)
    return _classifier(ResNetForImageClassification(cfg), _images)


def swin_zoo() -> autoplan.Workload:
    """Swin: shifted-window attention with a learned relative position bias table."""
    from transformers import SwinConfig, SwinForImageClassification

    cfg = SwinConfig(
        image_size=ZOO_IMAGE, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4,
        num_labels=ZOO_LABELS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0,
    )  # fmt: skip
    return _classifier(SwinForImageClassification(cfg), _images)


# speech ------------------------------------------------------------------------------------------


def wav2vec2_zoo() -> autoplan.Workload:
    """wav2vec 2.0: convolutional feature encoder, weight-normed convolutional positions,
    utterance classification (mean-pooled)."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    cfg = Wav2Vec2Config(
        **{**_ENCODER, "vocab_size": 32}, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, num_labels=4, hidden_dropout=0.0,
        activation_dropout=0.0, attention_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0,
        mask_time_prob=0.0, classifier_proj_size=16,
    )  # fmt: skip
    return _classifier(
        Wav2Vec2ForSequenceClassification(cfg), lambda step: _floats(step, ZOO_BATCH, ZOO_AUDIO_SAMPLES)
    )


def whisper_zoo() -> autoplan.Workload:
    """Whisper: convolutional stem over 8 log-mel bins x 32 frames, fixed sinusoidal encoder
    positions (frozen by transformers), decoder with learned positions."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(
        encoder_layers=2, decoder_layers=2, d_model=32, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16, max_target_positions=32,
        vocab_size=ZOO_VOCAB, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, use_cache=False,
        pad_token_id=0, bos_token_id=0, eos_token_id=1, decoder_start_token_id=2, suppress_tokens=[],
        begin_suppress_tokens=[],
    )  # fmt: skip
    return _seq2seq(WhisperForConditionalGeneration(cfg), lambda step: _floats(step, ZOO_BATCH, 8, 32))


# --- the zoo's index ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ZooModel:
    """One architecture of the zoo: its build function, what it is, what the zoo test freezes."""

    build: Callable[[], autoplan.Workload]
    kind: Literal["decoder", "MoE decoder", "encoder", "encoder-decoder", "vision", "speech"]
    frozen: tuple[str, ...]
    """``fnmatch`` patterns of parameter names the zoo test freezes (``requires_grad_(False)``):
    an embedding or position table, an embedding norm, the routers, a convolutional stem."""


ZOO: dict[str, ZooModel] = {
    "gpt2": ZooModel(build=gpt2_zoo, kind="decoder", frozen=("transformer.wpe.weight",)),
    "llama": ZooModel(build=llama_zoo, kind="decoder", frozen=("model.embed_tokens.weight",)),
    "mistral": ZooModel(build=mistral_zoo, kind="decoder", frozen=("model.embed_tokens.weight",)),
    "qwen2": ZooModel(build=qwen2_zoo, kind="decoder", frozen=("model.layers.0.input_layernorm.weight",)),
    "gemma": ZooModel(build=gemma_zoo, kind="decoder", frozen=("model.norm.weight",)),
    "phi3": ZooModel(build=phi3_zoo, kind="decoder", frozen=("model.embed_tokens.weight",)),
    "falcon": ZooModel(build=falcon_zoo, kind="decoder", frozen=("transformer.ln_f.*",)),
    "bloom": ZooModel(build=bloom_zoo, kind="decoder", frozen=("transformer.word_embeddings_layernorm.*",)),
    "gpt_neox": ZooModel(build=gpt_neox_zoo, kind="decoder", frozen=("gpt_neox.embed_in.weight",)),
    "opt": ZooModel(build=opt_zoo, kind="decoder", frozen=("model.decoder.embed_positions.weight",)),
    "gemma2": ZooModel(build=gemma2_zoo, kind="decoder", frozen=("model.layers.0.pre_feedforward_layernorm.weight",)),
    "gemma3": ZooModel(build=gemma3_zoo, kind="decoder", frozen=("model.layers.*.self_attn.q_norm.weight",)),
    "qwen3": ZooModel(build=qwen3_zoo, kind="decoder", frozen=("model.layers.*.self_attn.k_norm.weight",)),
    "olmo2": ZooModel(build=olmo2_zoo, kind="decoder", frozen=("model.layers.0.post_attention_layernorm.weight",)),
    "granite": ZooModel(build=granite_zoo, kind="decoder", frozen=("model.embed_tokens.weight",)),
    "cohere": ZooModel(build=cohere_zoo, kind="decoder", frozen=("model.layers.0.input_layernorm.weight",)),
    "stablelm": ZooModel(build=stablelm_zoo, kind="decoder", frozen=("model.layers.0.input_layernorm.*",)),
    "starcoder2": ZooModel(build=starcoder2_zoo, kind="decoder", frozen=("model.embed_tokens.weight",)),
    "phi": ZooModel(build=phi_zoo, kind="decoder", frozen=("model.final_layernorm.*",)),
    "gptj": ZooModel(build=gptj_zoo, kind="decoder", frozen=("transformer.ln_f.*",)),
    "codegen": ZooModel(build=codegen_zoo, kind="decoder", frozen=("transformer.wte.weight",)),
    "gpt_bigcode": ZooModel(build=gpt_bigcode_zoo, kind="decoder", frozen=("transformer.wpe.weight",)),
    "mpt": ZooModel(build=mpt_zoo, kind="decoder", frozen=("transformer.norm_f.weight",)),
    "mamba": ZooModel(build=mamba_zoo, kind="decoder", frozen=("backbone.norm_f.weight",)),
    "mixtral": ZooModel(build=mixtral_zoo, kind="MoE decoder", frozen=("model.layers.*.mlp.gate.weight",)),
    "qwen2_moe": ZooModel(build=qwen2_moe_zoo, kind="MoE decoder", frozen=("model.embed_tokens.weight",)),
    "qwen3_moe": ZooModel(build=qwen3_moe_zoo, kind="MoE decoder", frozen=("model.embed_tokens.weight",)),
    "olmoe": ZooModel(build=olmoe_zoo, kind="MoE decoder", frozen=("model.layers.*.self_attn.k_norm.weight",)),
    "deepseek_v3": ZooModel(build=deepseek_v3_zoo, kind="MoE decoder", frozen=("model.embed_tokens.weight",)),
    "bert": ZooModel(build=bert_zoo, kind="encoder", frozen=("bert.embeddings.position_embeddings.weight",)),
    "roberta": ZooModel(build=roberta_zoo, kind="encoder", frozen=("roberta.embeddings.word_embeddings.weight",)),
    "distilbert": ZooModel(
        build=distilbert_zoo, kind="encoder", frozen=("distilbert.embeddings.position_embeddings.weight",)
    ),
    "electra": ZooModel(build=electra_zoo, kind="encoder", frozen=("electra.embeddings.*",)),
    "albert": ZooModel(build=albert_zoo, kind="encoder", frozen=("albert.embeddings.position_embeddings.weight",)),
    "deberta_v2": ZooModel(build=deberta_v2_zoo, kind="encoder", frozen=("deberta.embeddings.word_embeddings.weight",)),
    "t5": ZooModel(build=t5_zoo, kind="encoder-decoder", frozen=("shared.weight",)),
    "bart": ZooModel(build=bart_zoo, kind="encoder-decoder", frozen=("model.*.embed_positions.weight",)),
    "vit": ZooModel(build=vit_zoo, kind="vision", frozen=("vit.embeddings.position_embeddings",)),
    "dinov2": ZooModel(build=dinov2_zoo, kind="vision", frozen=("dinov2.embeddings.mask_token",)),
    "convnext": ZooModel(build=convnext_zoo, kind="vision", frozen=("convnext.embeddings.*",)),
    "resnet": ZooModel(build=resnet_zoo, kind="vision", frozen=("resnet.embedder.*",)),
    "swin": ZooModel(build=swin_zoo, kind="vision", frozen=("swin.embeddings.patch_embeddings.*",)),
    "wav2vec2": ZooModel(build=wav2vec2_zoo, kind="speech", frozen=("wav2vec2.feature_extractor.*",)),
    "whisper": ZooModel(build=whisper_zoo, kind="speech", frozen=("model.*.embed_positions.weight",)),
}
"""Every zoo architecture by name. Whisper's encoder position table is frozen by transformers
itself; wav2vec 2.0's pattern freezes its convolutional feature encoder, as fine-tuning does."""
