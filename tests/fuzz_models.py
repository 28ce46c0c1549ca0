"""Random models for the fuzzed equivalence test, built from a small picklable spec.

A :class:`ModelSpec` is a stem, a stack of blocks and a head::

    tokens (B, T) int64 --Embedding(+positions)--> (B, T, C)      or  features (B, [T,] C_in)
    blocks:  Dense       x -> act(x W^T + b)                        (changes the width)
             Norm        LayerNorm | torch RMSNorm | hand-written RMSNorm (x * rsqrt(mean(x^2) + eps) * w)
             MLP         [x +] down(act(up(norm(x))))
             Attention   [x +] o_proj(attn(q, k, v)) of norm(x), causal, H heads of size D
                         (H * D need not equal C); attn = F.scaled_dot_product_attention or
                         softmax((q k^T) / sqrt(D) masked) v, the mask a buffer or built inline
    head:    Linear(C, vocab) (optionally tied to the embedding) + cross entropy over tokens,
             or Linear(C, out) + MSE against regression targets

Sizes are whatever the spec says, so widths, heads, batch and sequence need not divide the mesh.
:func:`build_model` is deterministic (the spec carries the seed): every rank builds the same
weights, and the test keeps a deep copy as the single-device reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

Activation = Literal["none", "gelu", "relu", "tanh", "silu"]
NormKind = Literal["layernorm", "rmsnorm", "rmsnorm_manual"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Dense:
    """``act(x W^T + b)``: width ``C -> out_features``."""

    out_features: int
    bias: bool
    activation: Activation

    def __str__(self) -> str:
        return f"dense({self.out_features}{'' if self.bias else ',nobias'},{self.activation})"


@dataclass(frozen=True, kw_only=True, slots=True)
class Norm:
    kind: NormKind

    def __str__(self) -> str:
        return self.kind


@dataclass(frozen=True, kw_only=True, slots=True)
class MLP:
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
class Attention:
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


Block = Dense | Norm | MLP | Attention


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
    blocks: tuple[Block, ...]
    out_features: int
    """Features stem: regression width of the head."""
    tie_head: bool
    """Tokens stem: the head reuses the embedding matrix (needs the last width == ``width``)."""
    head_bias: bool
    reduction: Literal["mean", "sum"]
    seed: int

    def __post_init__(self) -> None:
        if self.seq is None and any(isinstance(b, Attention) for b in self.blocks):
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
        if isinstance(block, Dense):
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
    def __init__(self, block: Dense, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, block.out_features, bias=block.bias)
        self.act = _activation(block.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.proj(x))


class MLPLayer(nn.Module):
    def __init__(self, block: MLP, width: int) -> None:
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
    def __init__(self, block: Attention, width: int, seq: int) -> None:
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
            if isinstance(block, Dense):
                layers.append(DenseLayer(block, width))
                width = block.out_features
            elif isinstance(block, Norm):
                layers.append(_norm(block.kind, width))
            elif isinstance(block, MLP):
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


def build_model(spec: ModelSpec) -> FuzzModel:
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


def make_batch(spec: ModelSpec, step: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def loss_fn(spec: ModelSpec):  # noqa: ANN201 - one of the module-level losses above
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
        if isinstance(block, Dense):
            width = block.out_features
            continue
        norm = block.kind if isinstance(block, Norm) else block.norm
        if norm == "layernorm" and width <= 2:
            return False
        if isinstance(block, Attention) and (block.qkv_bias or spec.seq == 1):
            return False
    return True
