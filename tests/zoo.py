"""The one model zoo of the tests, the examples' tests and the benchmarks: every small torch model,
its batches and its loss, deterministic (seeded) so each rank of a job builds the same weights.

Sections:
  * modules: an MLP, Hugging Face GPT-2 and Llama (grouped-query attention) of a few layers, their
    batches and losses (what the equivalence tests train); GPT-2 and Llama of any shape
    (:func:`gpt2_lm`, :func:`llama_lm`: the benchmarks' models, up to 175B parameters, on ``meta`` to plan);
  * workloads: ``autoplan.Workload`` build functions, what ``autoplan plan FILE.py:FUNCTION``
    calls (on ``meta`` to plan, on CPU to run): MLPs, a model ``torch.export`` cannot trace, a
    17e9-parameter MLP (meta only), a 4-layer HF GPT-2, GPT-2 small's widths in nanoGPT's layout;
    plus :func:`plan_workload` / :func:`plan_on_meta` (plan one as the CLI does);
  * random models: :class:`ModelSpec` and :func:`build_random_model` (the fuzzed equivalence test).

Where it lives, and why here: ``tests/zoo.py`` is importable as ``tests.zoo`` wherever the
repository root is on ``sys.path``: in pytest (run from the root), in every benchmark (each puts
the root on ``sys.path``), and in the CLI target files named by path in plan files, the golden
snapshots and ``benchmarks/suite.yaml`` (``tests/cli_models.py``, ``benchmarks/suite_models.py``):
those stay where they are, as thin files whose functions come from here, and put the root on
``sys.path`` themselves (the CLI loads a target file with only its own folder on the path).
The Hugging Face architecture zoo stays in ``examples/hf_models.py`` (``ZOO``): it is the file the
README tells users to run, from a checkout or not, so it cannot import the tests; tests and
benchmarks import it from there.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

import autoplan

# === modules ==================================================================================

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


LONG_CONTEXT = 1024
"""Sequence length of :func:`llama_long_context`."""


def llama_long_context(seed: int = 0, heads: int = 4) -> nn.Module:
    """HF Llama for context-parallel tests: 2 layers of ``heads`` heads (4 by default, so a 2 x 2
    mesh can split them over both axes; 1 leaves no heads to split: Ulysses cannot run, ring
    attention can), hidden 64, MLP 128, over ``LONG_CONTEXT`` positions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=heads, num_key_value_heads=heads,
        vocab_size=VOCAB, max_position_embeddings=LONG_CONTEXT, attention_dropout=0.0, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


MOE_EXPERTS = 4


def mixtral_tiny(
    seed: int = 0, experts_implementation: str = "eager", top_k: int = 2, hidden: int = 32, expert_hidden: int = 48
) -> nn.Module:
    """HF Mixtral for expert-parallel tests: 2 layers of ``MOE_EXPERTS`` SwiGLU experts of
    ``expert_hidden``, ``top_k`` of them per token, ``hidden`` wide, 4 heads. ``eager`` (transformers' default loop over the experts a batch hits)
    traces too: tracing routes every implementation to ``autoplan::moe_experts``."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        num_hidden_layers=2, hidden_size=hidden, intermediate_size=expert_hidden, num_attention_heads=4,
        num_key_value_heads=4, head_dim=hidden // 4, num_local_experts=MOE_EXPERTS, num_experts_per_tok=top_k, vocab_size=VOCAB,
        max_position_embeddings=MAX_POSITIONS, router_jitter_noise=0.0, attention_dropout=0.0, use_cache=False,
        experts_implementation=experts_implementation,
    )  # fmt: skip
    torch.manual_seed(seed)
    return MixtralForCausalLM(config).eval()


def qwen2_moe_tiny(seed: int = 0) -> nn.Module:
    """HF Qwen2-MoE (DeepSeek-style: routed experts plus a gated shared expert), 2 layers of
    ``MOE_EXPERTS`` routed experts, top 2, hidden 32."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
        shared_expert_intermediate_size=48, num_attention_heads=4, num_key_value_heads=4, num_experts=MOE_EXPERTS,
        num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS, attention_dropout=0.0,
        use_cache=False, norm_topk_prob=True,
    )  # fmt: skip
    torch.manual_seed(seed)
    return Qwen2MoeForCausalLM(config).eval()


def gpt2_lm(*, layers: int, hidden: int, heads: int, vocab: int, positions: int, ffn: int | None = None) -> nn.Module:
    """HF GPT-2 (``GPT2LMHeadModel``, tied lm_head) of any shape (the benchmarks' GPT-2 and GPT-3
    shapes), no dropout, no KV cache; ``ffn`` None is 4 x ``hidden``. Unseeded: build it on
    ``meta`` to plan, or seed first."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=layers, n_embd=hidden, n_head=heads, n_inner=ffn, vocab_size=vocab, n_positions=positions,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def llama_lm(*, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, positions: int) -> nn.Module:
    """HF Llama (``LlamaForCausalLM``, ``kv_heads`` key/value heads) of any shape (the benchmarks'
    Llama 2/3 shapes), no KV cache. Unseeded: build it on ``meta`` to plan."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=positions, use_cache=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def mixtral_lm(
    *, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, positions: int, experts: int, top_k: int
) -> nn.Module:
    """HF Mixtral (``MixtralForCausalLM``: ``experts`` SwiGLU experts of ``ffn`` per layer, ``top_k``
    per token) of any shape (the benchmarks' Mixtral 8x7B), no KV cache. Unseeded: build it on
    ``meta`` to plan."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=positions, use_cache=False,
        num_local_experts=experts, num_experts_per_tok=top_k, router_jitter_noise=0.0,
    )  # fmt: skip
    return MixtralForCausalLM(config)


def qwen3_moe_lm(
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    moe_ffn: int,
    vocab: int,
    positions: int,
    experts: int,
    top_k: int,
) -> nn.Module:
    """HF Qwen3-MoE (``Qwen3MoeForCausalLM``: every layer ``experts`` SwiGLU experts of ``moe_ffn``,
    ``top_k`` per token with renormalised weights, per-head RMSNorm on queries and keys, untied
    lm_head) of any shape (the benchmarks' Qwen3-30B-A3B), no KV cache. Unseeded: build it on
    ``meta`` to plan."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        num_hidden_layers=layers, hidden_size=hidden, moe_intermediate_size=moe_ffn, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, num_experts=experts, num_experts_per_tok=top_k,
        norm_topk_prob=True, vocab_size=vocab, max_position_embeddings=positions, use_cache=False,
        tie_word_embeddings=False,
    )  # fmt: skip
    return Qwen3MoeForCausalLM(config)


GPT2_TP_PINS = {
    # HF Conv1D weight is (in, out): column-parallel is S(1), row-parallel S(0).
    "*mlp.c_fc.weight": "S(1)",
    "*mlp.c_proj.weight": "S(0)",
    "*attn.c_attn.weight": "S(1)",
    "*attn.c_proj.weight": "S(0)",
}
"""Megatron tensor parallelism of :func:`gpt2_tiny` as ``parallelize`` pins (weights only)."""
LLAMA_TP_PINS = {
    # torch Linear weight is (out, in): q/k/v/gate/up column-parallel S(0), o/down row-parallel S(1).
    # 4 query heads and 2 key/value heads split evenly over 2 tensor-parallel ranks.
    "*.q_proj.weight": "S(0)",
    "*.k_proj.weight": "S(0)",
    "*.v_proj.weight": "S(0)",
    "*.gate_proj.weight": "S(0)",
    "*.up_proj.weight": "S(0)",
    "*.o_proj.weight": "S(1)",
    "*.down_proj.weight": "S(1)",
}
"""Megatron tensor parallelism of :func:`llama_tiny` as ``parallelize`` pins (weights only)."""


def token_batch(batch: int = 8, seq: int = 16, seed: int = 1, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)``, both (B, T) int64 in [0, vocab); labels are the next tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def lm_loss(out: object, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of an HF ``CausalLMOutput``: logits (B, T, V), labels (B, T)."""
    return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())


# === workloads ================================================================================


def mlp_workload(
    num_in: int, num_hidden: int, num_out: int, *, batch: int, optimizer: str = "adam"
) -> autoplan.Workload:
    """``Linear(num_in, num_hidden) -> GELU -> Linear(num_hidden, num_out)``, unseeded weights, a
    random ``(batch, num_in)`` input and MSE against a random ``(batch, num_out)`` target."""
    model = nn.Sequential(nn.Linear(num_in, num_hidden), nn.GELU(), nn.Linear(num_hidden, num_out))
    x = torch.randn(batch, num_in)  # (B, num_in)
    y = torch.randn(batch, num_out)  # (B, num_out)
    return autoplan.Workload(
        model=model, example_inputs=(x,), loss_fn=F.mse_loss, example_targets=(y,), optimizer=optimizer
    )


# --- the CLI tests' workloads (``tests/cli_models.py`` names them for ``autoplan plan``) ------------

CLI_BATCH = 8


def cli_mlp() -> autoplan.Workload:
    """Linear(16, 32) -> GELU -> Linear(32, 8); input (8, 16), MSE against a (8, 8) target; SGD."""
    return mlp_workload(16, 32, 8, batch=CLI_BATCH, optimizer="sgd")


def cli_mlp_wide() -> autoplan.Workload:
    """The structure of ``cli_mlp`` with other sizes (Linear(16, 64) -> GELU -> Linear(64, 8)): another fingerprint."""
    return mlp_workload(16, 64, 8, batch=CLI_BATCH, optimizer="sgd")


def cli_mlp_nonfinite() -> autoplan.Workload:
    """``cli_mlp`` whose second step's target holds a NaN (``batches``): that step's loss is NaN."""
    wl = cli_mlp()
    bad = (torch.full_like(wl.example_targets[0], float("nan")),)

    def batches(step: int) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]:
        return wl.example_inputs, bad if step == 1 else wl.example_targets

    return replace(wl, batches=batches)


def cli_mlp_dataset() -> autoplan.Workload:
    """``cli_mlp`` trained from a dataset of 3 global batches (24 ``(x, y)`` samples) by ``autoplan run``."""
    wl = cli_mlp()
    x, y = torch.randn(3 * CLI_BATCH, 16), torch.randn(3 * CLI_BATCH, 8)
    return replace(wl, dataset=torch.utils.data.TensorDataset(x, y))


class SampleStream(torch.utils.data.IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """The samples of a ``TensorDataset`` as a stream, in order; :attr:`epochs` records every
    ``set_epoch`` call (a stream is told the pass before it is read)."""

    def __init__(self, data: torch.utils.data.TensorDataset) -> None:
        self.data = data
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return ((x, y) for x, y in self.data)


def cli_mlp_stream() -> autoplan.Workload:
    """``cli_mlp_dataset``'s 24 samples as an ``IterableDataset`` (3 global batches per pass)."""
    wl = cli_mlp_dataset()
    assert isinstance(wl.dataset, torch.utils.data.TensorDataset)
    return replace(wl, dataset=SampleStream(wl.dataset))


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
    x, y = torch.randn(CLI_BATCH, 16), torch.randn(CLI_BATCH, 8)
    return autoplan.Workload(model=DataDependent(), example_inputs=(x,), loss_fn=F.mse_loss, example_targets=(y,))


HUGE_WIDTH = 65536
HUGE_LAYERS = 4


def huge() -> autoplan.Workload:
    """4 x Linear(65536, 65536): 4 * 65536**2 ~= 17.2e9 parameters.

    With Adam (fp32 param + grad + 2 states = 16 bytes/param) that is ~275 GB, ~137 GB per device
    even fully sharded over 2 devices: far above the 24 GiB of a CPU rank. Build it on meta only.
    """
    model = nn.Sequential(*(nn.Linear(HUGE_WIDTH, HUGE_WIDTH) for _ in range(HUGE_LAYERS)))
    x, y = torch.randn(CLI_BATCH, HUGE_WIDTH), torch.randn(CLI_BATCH, HUGE_WIDTH)
    return autoplan.Workload(
        model=model, example_inputs=(x,), loss_fn=F.mse_loss, example_targets=(y,), optimizer="adam"
    )


def gpt2_4_layers() -> autoplan.Workload:
    """Hugging Face GPT-2 with 4 layers of width 32 (enough blocks for the repeated-block
    reduction of global-batch plans), batch 8 x 16 tokens, next-token loss."""
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (8, 16))

    def loss(out, labels):  # noqa: ANN001, ANN202
        return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    model = gpt2_lm(layers=4, hidden=32, heads=4, vocab=128, positions=32)
    return autoplan.Workload(model=model, example_inputs=(ids,), loss_fn=loss, example_targets=(ids,))


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


def on_meta(build) -> autoplan.Workload:  # noqa: ANN001 - a build function, () -> Workload
    """The workload ``build()`` returns, built on the ``meta`` device (no weights allocated)."""
    with torch.device("meta"):
        return build()


def plan_on_meta(build, cluster: object = "2xCPU", **kwargs: object) -> autoplan.Plan:  # noqa: ANN001
    """Plan the workload a build function returns, built on ``meta`` (what ``autoplan plan`` does)."""
    return plan_workload(on_meta(build), cluster, **kwargs)


def ilp_and_pipeline_plans() -> dict[str, autoplan.Plan]:
    """Two small plans of every kind a plan file holds: ``"ilp"`` (the MLP on 2 CPU ranks) and
    ``"pipeline"`` (GPT-2, 4 layers, 2 stages of 2 data-parallel ranks, 4 micro-batches of 1 per
    rank: a stage of one device has nothing to choose, so its ops would list no alternatives)."""
    pipeline = plan_on_meta(
        gpt2_4_layers,
        "4xCPU",
        global_batch_size=8,
        config=autoplan.ParallelConfig(dp=2, pp=2, microbatch_size=1, num_microbatches=4),
    )
    return {"ilp": plan_on_meta(cli_mlp), "pipeline": pipeline}


# --- the plan benchmark suite's workloads (``benchmarks/suite_models.py`` names them) ------------


def suite_mlp_small() -> autoplan.Workload:
    """Linear(64, 256) -> GELU -> Linear(256, 64), batch 32: activations and weights of similar size."""
    return mlp_workload(64, 256, 64, batch=32)


def suite_mlp_wide() -> autoplan.Workload:
    """Linear(1024, 16384) -> GELU -> Linear(16384, 1024), batch 8: 33.6M parameters (134 MB
    fp32) against 0.5 MB of activations, so gradient reductions dominate a data-parallel plan and
    sharding the weights (Megatron column/row split) is cheaper."""
    return mlp_workload(1024, 16384, 1024, batch=8)


# --- GPT-2 in nanoGPT's layout (the plan benchmark suite: no Hugging Face import) ----------------


class _NanoAttention(nn.Module):
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


class _NanoBlock(nn.Module):
    def __init__(self, num_embd: int, num_heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(num_embd)
        self.attn = _NanoAttention(num_embd, num_heads)
        self.ln_2 = nn.LayerNorm(num_embd)
        self.mlp = nn.Sequential(nn.Linear(num_embd, 4 * num_embd), nn.GELU(), nn.Linear(4 * num_embd, num_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT2(nn.Module):
    """GPT-2 (Radford et al. 2019) in nanoGPT's layout: token + position embeddings, ``num_layers``
    pre-norm blocks, final LayerNorm, language-model head tied to the token embedding."""

    def __init__(self, *, num_layers: int, num_embd: int, num_heads: int, vocab_size: int, max_seq: int) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab_size, num_embd),
                "wpe": nn.Embedding(max_seq, num_embd),
                "h": nn.ModuleList(_NanoBlock(num_embd, num_heads) for _ in range(num_layers)),
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


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy: logits (B, T, V) at position t predict labels[t + 1]."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def gpt2_small_4_layers() -> autoplan.Workload:
    """GPT-2 small's widths (768 wide, 12 heads, vocab 50257, 1024 positions) with 4 layers; one
    sample of 1024 tokens (``global_batch_size`` in the suite sets the batch). 67.7M parameters:
    38.6M tied embedding + 0.8M positions + 4 x 7.1M blocks."""
    model = NanoGPT2(num_layers=4, num_embd=768, num_heads=12, vocab_size=50257, max_seq=1024)
    ids = torch.randint(0, 50257, (1, 1024))  # (B, T)
    return autoplan.Workload(model=model, example_inputs=(ids,), loss_fn=next_token_loss, example_targets=(ids,))


# === random models ============================================================================
#
# Random models for the fuzzed equivalence test, built from a small picklable spec.
#
# A :class:`ModelSpec` is a stem, a stack of blocks and a head::
#
#     tokens (B, T) int64 --Embedding(+positions)--> (B, T, C)      or  features (B, [T,] C_in)
#     blocks:  Dense       x -> act(x W^T + b)                        (changes the width)
#              Norm        LayerNorm | torch RMSNorm | hand-written RMSNorm (x * rsqrt(mean(x^2) + eps) * w)
#              MLP         [x +] down(act(up(norm(x))))
#              Attention   [x +] o_proj(attn(q, k, v)) of norm(x), causal, H heads of size D
#                          (H * D need not equal C); attn = F.scaled_dot_product_attention or
#                          softmax((q k^T) / sqrt(D) masked) v, the mask a buffer or built inline
#     head:    Linear(C, vocab) (optionally tied to the embedding) + cross entropy over tokens,
#              or Linear(C, out) + MSE against regression targets
#
# Sizes are whatever the spec says, so widths, heads, batch and sequence need not divide the mesh.
# :func:`build_random_model` is deterministic (the spec carries the seed): every rank builds the same
# weights, and the test keeps a deep copy as the single-device reference.

Activation = Literal["none", "gelu", "relu", "tanh", "silu"]
NormKind = Literal["layernorm", "rmsnorm", "rmsnorm_manual"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DenseSpec:
    """``act(x W^T + b)``: width ``C -> out_features``."""

    out_features: int
    bias: bool
    activation: Activation

    def __str__(self) -> str:
        return f"dense({self.out_features}{'' if self.bias else ',nobias'},{self.activation})"


@dataclass(frozen=True, kw_only=True, slots=True)
class NormSpec:
    kind: NormKind

    def __str__(self) -> str:
        return self.kind


@dataclass(frozen=True, kw_only=True, slots=True)
class MLPSpec:
    """``[x +] down(act(up(norm(x))))``: width ``C -> inner -> C``."""

    inner: int
    bias: bool
    activation: Activation
    residual: bool
    norm: NormKind | None

    def __str__(self) -> str:
        return (
            f"mlp({self.inner}{'' if self.bias else ',nobias'},{self.activation}"
            f"{',res' if self.residual else ''}{',' + self.norm if self.norm else ''})"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionSpec:
    """Causal self-attention, ``[x +] o_proj(attn(norm(x)))`` with ``num_heads`` heads of ``head_dim``."""

    num_heads: int
    head_dim: int
    fused_qkv: bool
    """One ``Linear(C, 3 * H * D)`` (GPT-2 style) or separate q/k/v projections (Llama style)."""
    qkv_bias: bool
    """A key bias gets an analytically zero gradient (softmax is shift invariant): see :func:`adam_safe`."""
    impl: Literal["sdpa", "softmax"]
    mask: Literal["buffer", "inline"]
    """``softmax`` only: the causal mask is a registered buffer or built in ``forward``."""
    residual: bool
    norm: NormKind | None

    def __str__(self) -> str:
        return (
            f"attn(h{self.num_heads}xd{self.head_dim},{'fused' if self.fused_qkv else 'qkv'}"
            f"{',bias' if self.qkv_bias else ''},{self.impl}{'/' + self.mask if self.impl == 'softmax' else ''}"
            f"{',res' if self.residual else ''}{',' + self.norm if self.norm else ''})"
        )


BlockSpec = DenseSpec | NormSpec | MLPSpec | AttentionSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """One random model, its batch shape and its loss (see the module docstring)."""

    stem: Literal["tokens", "features"]
    batch: int
    seq: int | None
    """Sequence length ``T``; ``None``: 2-D features ``(B, C_in)`` (no attention blocks then)."""
    width: int
    """Embedding width (tokens) or input features ``C_in`` (features)."""
    vocab: int
    """Token vocabulary (tokens stem; also the classes of the cross entropy)."""
    positions: bool
    """Tokens stem: add a learned position embedding indexed by an inline ``arange``."""
    blocks: tuple[BlockSpec, ...]
    out_features: int
    """Features stem: regression width of the head."""
    tie_head: bool
    """Tokens stem: the head reuses the embedding matrix (needs the last width == ``width``)."""
    head_bias: bool
    reduction: Literal["mean", "sum"]
    seed: int

    def __post_init__(self) -> None:
        if self.seq is None and any(isinstance(b, AttentionSpec) for b in self.blocks):
            raise ValueError("attention needs a sequence dim")
        if self.stem == "tokens" and self.seq is None:
            raise ValueError("the tokens stem needs a sequence length")
        if self.tie_head and (self.stem != "tokens" or final_width(self) != self.width):
            raise ValueError("a tied head needs the tokens stem and the embedding width at the end")

    def __str__(self) -> str:
        shape = f"B{self.batch}" + (f",T{self.seq}" if self.seq is not None else "")
        stem = (
            f"embed(V{self.vocab},C{self.width}{',pos' if self.positions else ''})"
            if self.stem == "tokens"
            else f"features(C{self.width})"
        )
        head = (
            f"lm_head({'tied' if self.tie_head else 'bias' if self.head_bias else 'nobias'})"
            if self.stem == "tokens"
            else f"linear({self.out_features})"
        )
        return f"{shape} {stem} -> " + " -> ".join([*(str(b) for b in self.blocks), head]) + f" [{self.reduction}]"


def final_width(spec: ModelSpec) -> int:
    width = spec.width
    for block in spec.blocks:
        if isinstance(block, DenseSpec):
            width = block.out_features
    return width


# --- layers ---------------------------------------------------------------------------------------


def _activation(kind: Activation) -> nn.Module:
    return {"none": nn.Identity, "gelu": nn.GELU, "relu": nn.ReLU, "tanh": nn.Tanh, "silu": nn.SiLU}[kind]()


class ManualRMSNorm(nn.Module):
    """Llama's RMSNorm written out: ``x * rsqrt(mean(x^2, -1) + eps) * weight``."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _norm(kind: NormKind, width: int) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(width)
    if kind == "rmsnorm":
        return nn.RMSNorm(width, eps=1e-6)
    return ManualRMSNorm(width)


class DenseLayer(nn.Module):
    def __init__(self, block: DenseSpec, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, block.out_features, bias=block.bias)
        self.act = _activation(block.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.proj(x))


class MLPLayer(nn.Module):
    def __init__(self, block: MLPSpec, width: int) -> None:
        super().__init__()
        self.norm = _norm(block.norm, width) if block.norm else nn.Identity()
        self.up = nn.Linear(width, block.inner, bias=block.bias)
        self.act = _activation(block.activation)
        self.down = nn.Linear(block.inner, width, bias=block.bias)
        self.residual = block.residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(self.act(self.up(self.norm(x))))
        return x + y if self.residual else y


class AttentionLayer(nn.Module):
    def __init__(self, block: AttentionSpec, width: int, seq: int) -> None:
        super().__init__()
        self.block = block
        inner = block.num_heads * block.head_dim
        self.norm = _norm(block.norm, width) if block.norm else nn.Identity()
        if block.fused_qkv:
            self.qkv = nn.Linear(width, 3 * inner, bias=block.qkv_bias)
        else:
            self.q_proj = nn.Linear(width, inner, bias=block.qkv_bias)
            self.k_proj = nn.Linear(width, inner, bias=block.qkv_bias)
            self.v_proj = nn.Linear(width, inner, bias=block.qkv_bias)
        self.o_proj = nn.Linear(inner, width, bias=True)
        if block.impl == "softmax" and block.mask == "buffer":
            self.register_buffer("causal", torch.ones(seq, seq, dtype=torch.bool).tril(), persistent=False)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, s, _ = t.shape
        return t.view(b, s, self.block.num_heads, self.block.head_dim).transpose(1, 2)  # (B, H, T, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm(x)
        if self.block.fused_qkv:
            q, k, v = self.qkv(h).chunk(3, dim=-1)
        else:
            q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        q, k, v = self._heads(q), self._heads(k), self._heads(v)
        if self.block.impl == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.block.head_dim)  # (B, H, T, T)
            if self.block.mask == "buffer":
                mask = self.causal
            else:
                mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
            out = scores.softmax(dim=-1) @ v
        y = self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
        return x + y if self.block.residual else y


class FuzzModel(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        if spec.stem == "tokens":
            self.embed = nn.Embedding(spec.vocab, spec.width)
            if spec.positions:
                assert spec.seq is not None
                self.pos = nn.Embedding(spec.seq, spec.width)
        width = spec.width
        layers: list[nn.Module] = []
        for block in spec.blocks:
            if isinstance(block, DenseSpec):
                layers.append(DenseLayer(block, width))
                width = block.out_features
            elif isinstance(block, NormSpec):
                layers.append(_norm(block.kind, width))
            elif isinstance(block, MLPSpec):
                layers.append(MLPLayer(block, width))
            else:
                assert spec.seq is not None
                layers.append(AttentionLayer(block, width, spec.seq))
        self.layers = nn.Sequential(*layers)
        if spec.stem == "tokens":
            self.head = nn.Linear(width, spec.vocab, bias=spec.head_bias and not spec.tie_head)
            if spec.tie_head:
                self.head.weight = self.embed.weight
        else:
            self.head = nn.Linear(width, spec.out_features, bias=spec.head_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.stem == "tokens":
            h = self.embed(x)
            if self.spec.positions:
                h = h + self.pos(torch.arange(x.shape[1], device=x.device))
        else:
            h = x
        return self.head(self.layers(h))


def build_random_model(spec: ModelSpec) -> FuzzModel:
    """The model of ``spec`` with seeded weights (identical in every process)."""
    torch.manual_seed(spec.seed)
    model = FuzzModel(spec)
    with torch.no_grad():  # non-trivial norm affines, so their gradients are not all alike
        for module in model.modules():
            if isinstance(module, (nn.LayerNorm, nn.RMSNorm, ManualRMSNorm)) and module.weight is not None:
                module.weight.uniform_(0.5, 1.5)
            if isinstance(module, nn.LayerNorm) and module.bias is not None:
                module.bias.uniform_(-0.5, 0.5)
    return model


def random_batch(spec: ModelSpec, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input, target)`` of training step ``step`` (seeded by the spec's seed and the step)."""
    g = torch.Generator().manual_seed(1000 * spec.seed + step)
    if spec.stem == "tokens":
        assert spec.seq is not None
        tokens = torch.randint(0, spec.vocab, (spec.batch, spec.seq + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    lead = (spec.batch,) if spec.seq is None else (spec.batch, spec.seq)
    return torch.randn(*lead, spec.width, generator=g), torch.randn(*lead, spec.out_features, generator=g)


def cross_entropy_mean(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy: logits (B, T, V), labels (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def mse_mean(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def mse_sum(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target, reduction="sum")


def random_loss(spec: ModelSpec):  # noqa: ANN201 - one of the module-level losses above
    """The loss of ``spec``: cross entropy over tokens or MSE over features, mean or sum."""
    if spec.stem == "tokens":
        return cross_entropy_mean if spec.reduction == "mean" else cross_entropy_sum
    return mse_mean if spec.reduction == "mean" else mse_sum


def adam_safe(spec: ModelSpec) -> bool:
    """Whether no parameter's exact gradient is (nearly) zero by symmetry, so Adam's update is
    not driven by rounding noise (see the fuzz test's docstring). The cases are a key bias
    (softmax is invariant to a shift shared by all keys), attention over one position (the
    softmax of one score is 1 whatever the queries and keys), and a LayerNorm over 2 features
    (its output is +-1 up to eps, whatever its input)."""
    width = spec.width
    for block in spec.blocks:
        if isinstance(block, DenseSpec):
            width = block.out_features
            continue
        norm = block.kind if isinstance(block, NormSpec) else block.norm
        if norm == "layernorm" and width <= 2:
            return False
        if isinstance(block, AttentionSpec) and (block.qkv_bias or spec.seq == 1):
            return False
    return True
