"""Published large-scale training runs, priced with the planner's cost model (issue #19, item 6;
issue #41, item 4; the table of runs and of sources found but not encoded: ``docs/published-runs.md``).

    python benchmarks/published_runs.py [--only SUBSTR] [--breakdown]

Each run is a configuration someone ran and published, with its measured throughput: build the
model on ``meta`` (``tests.zoo.llama_lm`` / ``qwen3_moe_lm``, no weights) and price exactly that configuration with
``autoplan.estimate`` (no search). Prints per run: model, configuration, predicted and published
tokens/s per GPU and their error (predicted / published - 1), predicted and published MFU, the
predicted communication per step (all of it, and the part the compute stream waits for: ZeRO-3's
per-block gathers and per-bucket reduce-scatters as the program issues them), the predicted peak
memory per device beside the published one (and what that counts, ``PublishedRun.peak_memory_kind``)
and their error, the capacity the cost model lets a device use, and whether it calls the
configuration feasible; then, last,
``published: runs=N err_median=X% err_max=Y% mem_err_median=Z% mem_err_max=W% feasible=K/N
source_bias_max=B%`` (median and max of |error| over the runs that publish tokens/s; ``mem_err_*``
over the runs with a published peak memory, ``n/a`` when none has one; ``feasible``: the runs
priced as fitting, of all: every run here ran, so all should; ``source_bias_max``: the largest
|median signed time error| of one source, from the per-source table printed before it,
:func:`source_table`). ``--only SUBSTR`` prices only the runs whose model name or
source contains SUBSTR (case-insensitive); ``--breakdown`` adds, under each run, where its
predicted step goes (:func:`breakdown`).

Sources: the eight Llama rows, ``shared/published_runs.md`` (torchtitan, FSDP2 on 64 A100 80GB,
pytorch/torchtitan docs/performance.md, 2024); the mixture-of-experts row, NeMo AutoModel's
performance summary (Qwen3-30B-A3B, BF16, one DGX-H100, EP 8 priced as ``ep=8``; the row's comment in ``RUNS`` says
what is exact and what is approximated); the long-context row, the Llama 3 paper's 405B at
131,072 tokens on 16,384 H100 (TP 8, CP 16, PP 16, DP 8, priced as ``cp=16`` beside ``tp=8``; its
comment in ``RUNS`` likewise); issue #41 item 4, runs whose conditions matter for memory, each
with its comment in ``RUNS`` (exact / approximated) and its source constant:

- FlagPerf (FlagOpen/FlagPerf @ 1b5a0303, BAAI's vendor benchmark suite; per case the results
  README, the config and the launched script; published tokens/s, MFU and nvidia-smi memory):
  Llama 3 8B on Megatron-Core 0.6 with sequence parallelism, ten TP/PP/DP layouts on 8 A800
  (priced as A100-80GB), 8, 16 and 440 H100 (``FLAGPERF_LLAMA3_8B_RUNS``); Llama 3 70B, PP4 DP2
  TP8 + SP on 64 H100 (``FLAGPERF_LLAMA3_70B_RUN``); Llama 2 7B with Megatron-DeepSpeed ZeRO-1
  and with DeepSpeed ZeRO-3 (HF model) on 8 A800 (``FLAGPERF_LLAMA2_7B_MDS_RUNS``,
  ``FLAGPERF_LLAMA2_7B_DS_RUNS``); Aquila2-7B (a Llama) with FlagScale in four TP/PP/DP layouts
  (``FLAGPERF_AQUILA2_7B_RUNS``).
- fms-fsdp (foundation-model-stack/fms-fsdp README, commit 3d28d72): 34b and 70b, FSDP1 over 128
  A100 with full recomputation, throughput only (``FMS_FSDP_RUNS``, ``peak_memory_kind="ran"``).

Add runs as rows of ``RUNS`` with their source. The
corrections below (recomputation policies, FSDP2 copies, torchtitan's MFU) apply to the torchtitan
rows only (``PublishedRun.framework``). Two more price the program each framework ran where it
differs from autoplan's in what the step holds: the loss in fp32 where the framework upcasts the
logits (:data:`FP32_LOSS`), and Hugging Face's eager RMSNorm where the run used the HF model
(:data:`EAGER_HF_NORM`: autoplan's own programs run the fused norm, ``passes/fused_norm.py``).
Megatron's and FlagScale's peaks add what those programs hold and autoplan's does not, each kind
with its place in the framework's code (:data:`FRAMEWORK_HELD`, :func:`framework_held_bytes`:
the fp32 gradient buffer, dropout masks, the norm regions whole without sequence parallelism) and
take off what they do not keep (the ``silu`` output of a fused SwiGLU). A published ``nvidia-smi``
figure is compared with the reserved peak plus the memory outside PyTorch of the framework's
process groups (:data:`FRAMEWORK_GROUPS`, :func:`framework_communicators`: one NCCL communicator
each, ``autoplan.cost_models.memory.non_pytorch_bytes``), rank by rank.

Found, not priced (BF16 mixture-of-experts and long-context runs with a published configuration
that autoplan cannot express faithfully, issue #20 item 5):

- Megatron-Core MoE README (NVIDIA/Megatron-LM ``megatron/core/transformer/moe/README.md``):
  Mixtral 8x7B bf16 at 438 (MCore v0.8) and 468 (v0.9) TFLOP/s per GPU on H100, with no
  configuration (GPUs, TP/PP/EP, batch) given: nothing to price.
- NeMo AutoModel performance summary (as the row above): DeepSeek V3 671B (256 and 1,024 H100,
  PP 4 VP 8 EP 64, FSDP 64 and 256) and Kimi K2 (256 H100, PP 8 VP 4 EP 32, FSDP 32): the expert
  groups lie within each stage's data-parallel ranks (``ep = dp`` on 256 GPUs, ``ep = dp / 4``
  on 1,024, both expressible since ``ep`` may divide ``dp``), but MLA attention, the leading dense
  layers and the multi-token-prediction head have no zoo model; GPT-OSS 20B/120B (8/64 H100, FSDP, no EP): attention sinks,
  alternating sliding-window layers and clamped SwiGLU experts, not in the zoo.
- Megatron-Bridge performance summary (NVIDIA-NeMo/Megatron-Bridge ``docs/performance-summary.md``,
  25.11): GPT-OSS 120B BF16 on 64 H100 (PP 4, EP 8; same model gap, and EP with PP); every other
  H100 MoE row (Qwen3, DeepSeek V3) is FP8; Mixtral-8x7B/8x22B in the NeMo 25.02-25.04
  summaries (docs.nvidia.com/nemo-framework/user-guide/latest/performance/performance_summary.html)
  are FP8 (H100, B200, GB200): autoplan prices bf16 only.
- Long context: NeMo ``docs/source/performance/performance_long_sequence.md`` (Llama 2 7B on
  H100 and Llama 3 8B on B200, 4k-1M tokens, TP/PP/DP/CP tables) is FP8; torchtitan
  ``benchmarks/llama3_h100_202412_torchtitan.md`` (Llama 3.1 8B FSDP+CP 32k-262k on 8 H100, 405B
  4D with CP 1-8) runs Float8 and torch.compile on 96 GB 500 W H100s (not the catalog's H100);
  the Megatron-Core context-parallel docs give figures only. (The Llama 3 paper's CP 16 x TP 8
  row is priced: ``LLAMA3_405B_128K``.)

Recomputation, torchtitan's policies in autoplan's vocabulary (``ParallelConfig.recompute``):

- ``none`` -> ``none``: exact. ``full`` -> ``full`` (every block keeps only its input, its
  backward re-creates the block; ``autoplan/passes/recompute.py``): not exact in two ways.
  autoplan re-runs only what the backward reads, so not a block's last matmul (its output only
  feeds the residual add), where torchtitan's ``checkpoint_wrapper`` re-runs the whole block:
  priced from its parts, the w2 matmul and the residual add per block added to the step
  (:func:`full_ac_extra_recompute_s`); and under ZeRO-3 autoplan's re-run gathers the block's
  weights once more (a third gather pass, hidden behind compute here but slowing it by the
  contention factor), where FSDP2 reuses its backward gather: not corrected, an over-estimate.
- ``selective, per op`` -> ``selective`` plus the matmuls torchtitan recomputes and autoplan's
  ``selective`` keeps. torchtitan's op policy (``torchtitan/parallelisms/parallelize_llama.py``,
  ``_apply_ac_to_transformer_block``: ``_save_list`` = mm, SDPA (flash/efficient), reduce_scatter;
  "Saves output of all compute ops, except every second mm", a counter per block) saves the SDPA
  output and the 1st, 3rd, 5th and 7th ``mm`` of a block's forward (wq, wv, w1, w2) and recomputes
  the rest, the 2nd, 4th and 6th ``mm`` (wk, wo, w3) included; autoplan's ``selective``
  (``autoplan/passes/recompute.py``) keeps the matmul outputs the re-run ops need and recomputes
  only the ops between them. autoplan cannot express "every second
  mm", so the estimate is priced from its parts: autoplan's ``selective`` step time plus, per
  block, the forward time of the wk, wo and w3 matmuls (``compute.roofline_time_s`` of
  ``aten.mm`` with the block's shapes, as the cost model prices them in the trace), times the
  number of blocks (:func:`op_sac_extra_recompute_s`). Peak memory: autoplan's ``selective``
  one less those three outputs per block, which torchtitan does not keep
  (:func:`op_sac_unkept_bytes`, with the allocator margin on them).
- ``selective, per layer`` (full recomputation of every other block) has no single autoplan
  value: priced as the mean of the ``none`` and ``full`` estimates (step time and peak memory
  both linear in the number of recomputed blocks). Approximate: the peak is not exactly the mean.

FSDP2 as torchtitan runs it, which autoplan's ZeRO-3 does not: autoplan's runtime gathers and
reduce-scatters each parameter with functional collectives (``autoplan/runtime/lowering.py``),
while FSDP2 (``fully_shard`` per block and on the root, ``apply_fsdp``) gathers a block into one
flat buffer and reduce-scatters one, with copies on the compute stream
(``torch.distributed.fsdp._fully_shard._fsdp_collectives``): after each gather's wait,
``foreach_all_gather_copy_out`` copies the block out of the buffer into its parameters
(``split_with_sizes_copy``, bf16 read + write), in the forward and again in the backward
(``reshard_after_forward``); before each reduce-scatter, ``foreach_reduce_scatter_copy_in``
copies the block's bf16 gradients into the buffer in torchtitan's reduce dtype, fp32
(``training.mixed_precision_reduce = "float32"``: bf16 read + fp32 write). Priced from its parts
(:func:`fsdp2_copy_s`, ``compute.memory_time_s`` per copy) and added to the step. Not priced: the
fp32 reduce-scatter's doubled bytes on the wire (``autoplan.estimate`` has no reduce dtype; the
model shows the bf16 reduce-scatters hidden behind the backward with room to spare, ``pred comm
ms (exposed)``).

MFU: autoplan's (model FLOPs of its trace / step time / peak) against torchtitan's
(6·N·tokens + 12·L·H·Q·T attention FLOPs, non-causal, over 312 TFLOP/s); the two FLOP counts
need not agree, so compare the tokens/s error first.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import autoplan  # noqa: E402
from autoplan.cost_models.cluster import Cluster  # noqa: E402
from autoplan.cost_models.compute import memory_time_s, roofline_time_s  # noqa: E402
from autoplan.cost_models.memory import (  # noqa: E402
    ALLOCATOR_MARGIN_FRACTION,
    DRIVER_VISIBLE_FRACTION,
    non_pytorch_bytes,
    nvlink_multicast,
)
from autoplan.planner.mesh import as_cluster  # noqa: E402
from tests.zoo import llama_lm, lm_loss, qwen3_moe_lm  # noqa: E402

TORCHTITAN_A100 = "torchtitan docs/performance.md (2024), FSDP2 on 64 A100 80GB; shared/published_runs.md"
AUTOMODEL_H100 = (
    "NeMo AutoModel docs/performance-summary.md (2025-10-02), DGX-H100 BF16 pre-training; "
    "https://github.com/NVIDIA-NeMo/Automodel/blob/main/docs/performance-summary.md"
)
LLAMA3_PAPER = (
    "Llama 3 paper (Dubey et al. 2024, arXiv 2407.21783), Table 4: 405B pre-training, 16,384 H100, "
    "TP 8 CP 16 PP 16 DP 8, 131,072 tokens, 380 TFLOP/s per GPU"
)
GiB = 2**30


@dataclass(frozen=True, kw_only=True, slots=True)
class Shape:
    """A decoder's shape: a Llama (HF ``LlamaConfig`` fields) or, with ``experts``, a Qwen3-MoE
    (HF ``Qwen3MoeConfig``: every layer routed experts, no dense MLP)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    """Dense MLP width (0 for a model whose every layer is routed experts)."""
    vocab: int
    head_dim: int | None = None
    """Query/key/value head width; ``None``: ``hidden // heads``."""
    experts: int = 0
    """Routed experts per layer (0: a dense Llama)."""
    top_k: int = 0
    moe_ffn: int = 0
    """Width of one routed expert's SwiGLU."""


LLAMA3_8B = Shape(name="Llama 3 8B", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256)
LLAMA3_405B = Shape(name="Llama 3 405B", layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256)
LLAMA3_70B = Shape(name="Llama 3 70B", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256)
LLAMA2_13B = Shape(name="Llama 2 13B", layers=40, hidden=5120, heads=40, kv_heads=40, ffn=13824, vocab=32000)
LLAMA2_70B = Shape(name="Llama 2 70B", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000)
LLAMA2_7B = Shape(name="Llama 2 7B", layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000)
"""FlagPerf ``training/benchmarks/llama2_7b/deepspeed/llama2_7b_hf/config.json`` (HF ``LlamaForCausalLM``,
untied) and its Megatron-DeepSpeed script (``megatron-deepspeed_main.sh``: the same numbers)."""
AQUILA2_7B = Shape(name="Aquila2 7B", layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=100096)
"""FlagPerf ``training/benchmarks/aquila2_7b/flagscale/flagscale_main.sh``: 32 layers, hidden 4096, 32 heads
(no grouped-query flag), SwiGLU with ``--multiple-of 256`` (11,008), ``--vocab-size 100008`` padded by
Megatron to a multiple of 128 x tp (100,096 at tp 1 and 2)."""
AQUILA2_7B_TP8 = Shape(name="Aquila2 7B", layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=100352)
""":data:`AQUILA2_7B` at tp 8: the vocabulary padded to a multiple of 1,024 (100,352)."""
FMS_34B_MHA = Shape(name="fms llama2 34b (MHA)", layers=48, hidden=8192, heads=64, kv_heads=64, ffn=22016, vocab=32000)
"""fms-fsdp ``fms_fsdp/utils/config_utils.py`` ``"34b"`` at the README table's commit 3d28d72: no ``kvheads``
(FMS ``LLaMAConfig`` default 0: as many key/value heads as query heads), ``multiple_of=1``."""
FMS_70B_MHA = Shape(name="fms llama2 70b (MHA)", layers=80, hidden=8192, heads=64, kv_heads=64, ffn=28672, vocab=32000)
"""fms-fsdp ``"70b"`` at commit 3d28d72, as :data:`FMS_34B_MHA` (``kvheads=8`` came in 247f22c, after the table)."""
QWEN3_30B_A3B = Shape(
    name="Qwen3-30B-A3B", layers=48, hidden=2048, heads=32, kv_heads=4, ffn=0, vocab=151936, head_dim=128,
    experts=128, top_k=8, moe_ffn=768,
)  # fmt: skip
"""Qwen/Qwen3-30B-A3B ``config.json`` (the model the AutoModel row loads by name)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PublishedRun:
    """One published training run: its conditions and what it measured."""

    shape: Shape
    cluster: str
    """autoplan cluster preset of the machines it ran on."""
    seq_len: int
    local_batch: int
    """Samples per GPU per micro-batch as the source counts them (torchtitan: per GPU; the Llama 3
    row: per data-parallel replica)."""
    activation_checkpointing: str
    """As published: ``none``, ``full``, ``selective, per op``, ``selective, per layer``."""
    zero_stage: int
    dp: int
    tp: int = 1
    """autoplan's in-stage model-parallel axis (``ParallelConfig.tp``)."""
    cp: int = 1
    """Context-parallel degree (``ParallelConfig.cp``: the sequence split over a ``cp`` axis
    beside ``tp``)."""
    pp: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatch_size: int | None = None
    """Samples per micro-batch per data-parallel replica (``ParallelConfig.microbatch_size``);
    ``None``: ``local_batch * tp``."""
    ep: int = 1
    """Expert-parallel degree (``ParallelConfig.ep``: the experts split over groups of that many
    dp ranks)."""
    num_microbatches: int = 1
    """Gradient-accumulation steps per optimizer step."""
    sharded_grad_accumulation: bool = False
    """The gradients reduce-scattered in every micro-batch's backward into sharded accumulators
    (``ParallelConfig.sharded_grad_accumulation``): FSDP2's default (``set_requires_gradient_sync``
    left on) and DeepSpeed ZeRO-2/3's (partitioned gradients reduced as they are produced, every
    micro-batch); Megatron's distributed optimizer reduces its buffer after the last one."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism on the ``tp`` axis (``ParallelConfig.sequence_parallel``: the
    norms, dropouts and residual adds between the tensor-parallel matmuls run on ``S / tp``
    tokens, all-gather / reduce-scatter in place of the all-reduces)."""
    framework: str = "torchtitan"
    """``torchtitan`` rows get the torchtitan/FSDP2 corrections of the module docstring; others none."""
    tokens_per_s_per_gpu: float | None
    """Published tokens per second per GPU; ``None`` for a memory-only row (left out of
    ``err_median`` / ``err_max``, still checked for feasibility)."""
    mfu: float | None
    peak_memory_gib: float | None = None
    """Published peak memory per GPU in GiB; ``None`` where the source gives none."""
    peak_memory_kind: str = ""
    """What the published peak counts: ``reserved`` (``torch.cuda.max_memory_reserved``),
    ``allocated`` (``max_memory_allocated``), ``nvidia-smi`` (the device's used memory, CUDA context
    and NCCL buffers included); ``ran`` for a run that publishes no figure (it ran, so it fits)."""
    source: str

    @property
    def num_gpus(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def replica_batch(self) -> int:
        """Samples per micro-batch per data-parallel replica."""
        return self.microbatch_size if self.microbatch_size is not None else self.local_batch * self.tp

    @property
    def global_batch(self) -> int:
        return self.dp * self.replica_batch * self.num_microbatches


def _tt(shape: Shape, seq: int, batch: int, ac: str, wps: float, mfu: float) -> PublishedRun:
    """A torchtitan FSDP2 row: 8 nodes x 8 A100 80GB, FSDP2 (ZeRO-3) over all 64, no TP/PP."""
    return PublishedRun(
        shape=shape, cluster="8x8xA100-80GB", seq_len=seq, local_batch=batch, activation_checkpointing=ac,
        zero_stage=3, dp=64, tokens_per_s_per_gpu=wps, mfu=mfu, source=TORCHTITAN_A100,
    )  # fmt: skip


# NeMo AutoModel, Qwen3-30B-A3B on one DGX-H100 (8 GPUs), BF16: GBS 512, local batch 4, GA 16,
# sequence 4096, TP 1 PP 1 CP 1 EP 8, FSDP2 over 8; 21.773 s per step, 12,040 tokens/s/GPU,
# 277 model TFLOP/s/GPU (MFU over 989). Recipe examples/benchmark/configs/qwen3_moe_30b_te_deepep.yaml
# (GBS 512 version): activation_checkpointing true (checkpoint_wrapper on every block: full),
# torch.optim.Adam, TE attention/linear/RMSNorm, DeepEP dispatch, fake_balanced_gate (routing
# forced balanced). Exact: shape, GPUs, batch, sequence, EP 8, full recomputation, bf16, Adam.
# autoplan: exactly that layout, dp=8 ZeRO-3 (FSDP2 over the 8) with ep=8 (each rank 16 of the
# 128 experts of every layer, tokens exchanged with all-to-all; DeepEP's kernels are priced as
# all_to_all_single on NVLink). Approximated: autoplan prices routing at ROUTING_IMBALANCE 1.25
# (the run forces balance); autoplan's full recomputation does not re-run the experts' forward
# (checkpoint_wrapper does, dispatch included): not corrected.
# Error -35.5% (--breakdown; priced with tp=8 and the all-gather dispatcher before ep existed:
# -21.5%): of the predicted 33.7 s step, 10.0 s are the blocking all-to-alls (each token's 8
# routed rows sent one by one, as torchtitan's and Megatron-Core's alltoall dispatchers do; DeepEP
# sends a token once per destination rank, about 5.3 of 8 here, and the run forces balanced
# routing where autoplan prices 1.25x), and 8.3 s the non-matmul ops priced as HF eager runs them
# (fp32 RMSNorms with the per-head q/k norms, RoPE, routing softmax and top-k) where the run uses
# TE's fused kernels. The same layout without ep (experts ZeRO-3-sharded, gathered per block) is
# priced at 23.5 s.
AUTOMODEL_QWEN3_30B = PublishedRun(
    shape=QWEN3_30B_A3B, cluster="1x8xH100", seq_len=4096, local_batch=4, activation_checkpointing="full",
    zero_stage=3, dp=8, ep=8, num_microbatches=16, sharded_grad_accumulation=True, framework="automodel",
    tokens_per_s_per_gpu=12040,
    mfu=277 / 989, source=AUTOMODEL_H100,
)  # fmt: skip

LEAST_THAT_FITS = "not published"
"""``activation_checkpointing`` of a run whose source does not give it: priced with the least
recomputation that fits (:func:`_estimates`)."""


def llama_num_params(s: Shape) -> int:
    """Parameters of a Llama of shape ``s`` (untied output layer; HF ``LlamaForCausalLM``)."""
    d = s.hidden // s.heads
    block = 2 * s.hidden * s.heads * d + 2 * s.hidden * s.kv_heads * d + 3 * s.hidden * s.ffn + 2 * s.hidden
    return s.layers * block + 2 * s.vocab * s.hidden + s.hidden


def tokens_per_s_from_tflops(s: Shape, seq: int, tflops_per_gpu: float) -> float:
    """Tokens per second per GPU of a run that publishes model TFLOP/s per GPU, at
    ``6 * N + 12 * L * H * Q * T`` FLOPs per token (:func:`torchtitan_mfu`'s count: all parameters,
    attention non-causal); a source that counts causal attention as half would give more tokens."""
    flops_per_token = 6 * llama_num_params(s) + 12 * s.layers * s.hidden * seq
    return tflops_per_gpu * 1e12 / flops_per_token


# Llama 3 paper (Dubey et al., "The Llama 3 Herd of Models", arXiv 2407.21783, 2024), section 3.3.2,
# Table 4, the long-context row of the 405B pre-training: 16,384 H100 80GB (700 W, HBM3; 8 per
# server, NVLink inside, 400 Gb/s RoCE per GPU between servers), TP 8, CP 16, PP 16, DP 8, sequence
# 131,072, batch size per DP 16 (16M tokens per step), 380 TFLOP/s per GPU, BF16 MFU 38 %. The
# same table is on Pavan Balaji's SC'24 slide (glennklockwood.com/garden/llama-3.1). Exact: shape,
# GPUs, degrees, sequence, batch, bf16, AdamW. autoplan: dp=8 cp=16 tp=8 pp=16 (cp x tp = 128 ranks
# of one replica, the cp axis across 16 servers; ZeRO over dp x cp, autoplan's layout: the paper's FSDP
# shards over dp only), 16
# micro-batches of one sequence. Approximated: the pipeline schedule (the paper's interleaved 1F1B
# with first and last stages one layer short; the virtual-stage count is not published: priced with
# v=4, the largest autoplan's search tries for 16 stages and 16 micro-batches), the recomputation
# (not published: the least that fits), the paper's FSDP (shards weights, gradients and optimizer,
# no reshard after the forward: priced as ZeRO-3, which gathers again in the backward), its CP (an
# all-gather of the keys and values; autoplan: the ILP's ring or head-parallel attention on the cp
# axis), and the published tokens/s (from the TFLOP/s at torchtitan's FLOP count,
# :func:`tokens_per_s_from_tflops`). Error -16.1 % (56 vs 67 tokens/s/GPU; MFU 26.0 % vs 38 %,
# 16.2 GiB per device): of the 18.2 s step, 5.3 s is exposed communication (3.4 s ZeRO-3's
# per-micro-batch gathers of the stage's weights, 2.9 s of it over the 8 data-parallel servers and
# 0.4 s over cp, 1.1 s the cp x tp conversions, 0.7 s the ring), 3.1 s the bubble, and full
# recomputation re-runs each forward. The paper's FSDP gathers less often than ZeRO-3 (no reshard
# after the forward) and more than ZeRO-2 (never): priced as ZeRO-2 the step is 13.7 s, +11.4 %,
# so the published figure lies between the two. With ZeRO over dp only (before ZeRO covered cp)
# this row was -14.1 % at 22.0 GiB; before the key/value heads were traced unrepeated (README,
# grouped-query attention) -34.2 % (9.5 s exposed).
LLAMA3_405B_128K = PublishedRun(
    shape=LLAMA3_405B, cluster="2048x8xH100", seq_len=131072, local_batch=1, activation_checkpointing=LEAST_THAT_FITS,
    zero_stage=3, dp=8, cp=16, tp=8, pp=16, schedule="interleaved-1f1b", virtual_stages=4, microbatch_size=1,
    num_microbatches=16, framework="llama3", tokens_per_s_per_gpu=tokens_per_s_from_tflops(LLAMA3_405B, 131072, 380),
    mfu=0.38, source=LLAMA3_PAPER,
)  # fmt: skip

FLAGPERF = "FlagOpen/FlagPerf @ 1b5a030398ab719e406f77877eb34c9599b17fd2"
FLAGPERF_LLAMA3_8B = (
    f"{FLAGPERF}: training/nvidia/llama3_8B-megatron/README.md (results, last changed 93730d18, 2024-05-15), "
    "config/config_{A100,H100}x1x8.py, training/benchmarks/llama3_8B/megatron/pretrain_llama3.sh; "
    "https://github.com/FlagOpen/FlagPerf/blob/1b5a030398ab719e406f77877eb34c9599b17fd2/training/nvidia/llama3_8B-megatron/README.md"
)
FLAGPERF_LLAMA3_70B = (
    f"{FLAGPERF}: training/nvidia/llama3_70B-megatron/README.md (results, last changed ddd8f62a, 2024-06-14), "
    "config/config_H100x8x8.py, training/benchmarks/llama3_70B/megatron/pretrain_llama3.sh"
)
FLAGPERF_LLAMA2_7B_MDS = (
    f"{FLAGPERF}: training/nvidia/llama2_7b-megatron-deepspeed/README.md (results, last changed d1a078e0, "
    "2024-02-07), config/config_A100x1x8.py, config/ds_config.json, "
    "training/benchmarks/llama2_7b/megatron-deepspeed/megatron-deepspeed_main.sh"
)
FLAGPERF_LLAMA2_7B_DS = (
    f"{FLAGPERF}: training/nvidia/llama2_7b-deepspeed/README.md (results, last changed 6035339a, 2023-12-25), "
    "config/config_A100x1x8.py, training/benchmarks/llama2_7b/deepspeed/{ds_config.json,run_pretraining.py}"
)
FLAGPERF_AQUILA2_7B = (
    f"{FLAGPERF}: training/nvidia/aquila2_7b-flagscale/README.md (results, last changed cd568e3c, 2023-11-21), "
    "config/config_A100x1x8.py, training/benchmarks/aquila2_7b/flagscale/{flagscale_main.sh,run_pretraining.py}"
)
FMS_FSDP = (
    "foundation-model-stack/fms-fsdp README.md throughput table (commit 3d28d72 'update perf table', "
    "2024-02-21; unchanged at 5a296afe), scripts/{34b,70b}.sh and fms_fsdp/utils/config_utils.py at 3d28d72; "
    "https://github.com/foundation-model-stack/fms-fsdp/blob/3d28d72/README.md"
)


def _flagperf_megatron(
    shape: Shape, cluster: str, pp: int, dp: int, tp: int, gbs: int, wps: float, mfu: float, mem: float, source: str
) -> PublishedRun:
    """A FlagPerf Megatron-Core row (comment above): micro-batch 1 per replica, sequence 8192,
    ``--sequence-parallel`` (a no-op at ``tp`` 1), distributed optimizer, no recomputation."""
    return PublishedRun(
        shape=shape, cluster=cluster, seq_len=8192, local_batch=1, activation_checkpointing="none", zero_stage=1,
        dp=dp, tp=tp, pp=pp, microbatch_size=1, num_microbatches=gbs // dp, sequence_parallel=tp > 1,
        framework="megatron", tokens_per_s_per_gpu=wps, mfu=mfu, peak_memory_gib=mem, peak_memory_kind="nvidia-smi",
        source=source,
    )  # fmt: skip


# FlagPerf (FlagOpen/FlagPerf, BAAI's vendor benchmark suite), Llama 3 8B pre-training with
# Megatron-Core (tag core_v0.6.0, NGC PyTorch container; FLAGPERF_LLAMA3_8B). The launched command
# (pretrain_llama3.sh, unchanged since the results): --num-layers 32 --hidden-size 4096
# --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention --num-query-groups 8
# --seq-length 8192 --swiglu --normalization RMSNorm --global-batch-size 512 --micro-batch-size 1
# (config localbs) --tensor/pipeline-model-parallel-size from the config (the README's column)
# --sequence-parallel --bf16 --transformer-impl transformer_engine --use-distributed-optimizer
# --use-mcore-models --use-flash-attn, Llama3Tokenizer (vocab 128,256, a multiple of 128 x tp: no
# padding), Megatron's Adam (decoupled weight decay 0.1). Published per row: tokens/s per GPU,
# MFU (PaLM's definition over 312 or 989 TFLOP/s) and "mem" in GiB of 80: FlagPerf's monitor
# samples nvidia-smi's Memory-Usage during the run (training/nvidia/nvidia_monitor.py), so the
# figure includes the CUDA context, NCCL buffers and the allocator's cache (kind "nvidia-smi").
# Exact: the block's sizes, GPUs, TP/PP/DP, SP, micro-batch 1, global batch 512 (512 / dp
# micro-batches per replica), sequence 8192, bf16, non-interleaved 1F1B (no virtual stages), the
# distributed optimizer (fp32 master weights and Adam moments sharded over dp: autoplan's ZeRO-1).
# Recomputation: the script passes no --recompute-* flag (the README's optimisation list names
# "recompute-activations", the command does not; the table's PP1DP8TP1 OOM agrees with none):
# priced as none. Approximated (the model is Megatron's GPT under those flags and Megatron's
# defaults, not exactly the zoo's HF Llama): learned absolute position embeddings (no
# --position-embedding-type rope: 8192 x 4096 more weights on the first stage, no RoPE), biases
# in the linears (no --disable-bias-linear), the output layer tied to the input embedding (no
# --untie-embeddings-and-output-weights: with PP > 1 Megatron keeps a copy of the embedding on the
# last stage, so the memory is the untied model's; with PP 1 the zoo's untied output is 525M / tp
# weights more than ran), hidden and attention dropout 0.1 (Megatron's defaults; masks not in the
# zoo model), Megatron's fp32 gradient buffer (bf16 implies --accumulate-allreduce-grads-in-fp32).
# Hardware: the "A100" rows ran on a DGX A800 80GB (README hardware section; the A100's compute and
# HBM, NVLink 400 GB/s against the A100's 600 GB/s), priced on the catalog's A100-80GB; the H100
# rows on H100 SXM 80GB (config_H100x1x8.py), the 2- and 55-node rows over InfiniBand (not
# described for this case).
FLAGPERF_LLAMA3_8B_RUNS = [
    _flagperf_megatron(LLAMA3_8B, "1x8xA100-80GB", 2, 4, 1, 512, 3698.7, 0.569, 76, FLAGPERF_LLAMA3_8B),
    _flagperf_megatron(LLAMA3_8B, "1x8xA100-80GB", 4, 2, 1, 512, 3306.5, 0.500, 59, FLAGPERF_LLAMA3_8B),
    _flagperf_megatron(LLAMA3_8B, "1x8xA100-80GB", 2, 2, 2, 512, 3409.2, 0.524, 51, FLAGPERF_LLAMA3_8B),
    _flagperf_megatron(LLAMA3_8B, "1x8xA100-80GB", 2, 1, 4, 512, 3006.1, 0.462, 35, FLAGPERF_LLAMA3_8B),
    _flagperf_megatron(LLAMA3_8B, "1x8xA100-80GB", 8, 1, 1, 512, 2690.3, 0.414, 55, FLAGPERF_LLAMA3_8B),
    _flagperf_megatron(LLAMA3_8B, "1x8xA100-80GB", 1, 1, 8, 512, 2451.2, 0.377, 30, FLAGPERF_LLAMA3_8B),
    _flagperf_megatron(LLAMA3_8B, "1x8xA100-80GB", 4, 1, 2, 512, 3042.7, 0.468, 45, FLAGPERF_LLAMA3_8B),
    _flagperf_megatron(LLAMA3_8B, "1x8xH100", 1, 4, 2, 512, 8103, 0.393, 71, FLAGPERF_LLAMA3_8B),
    _flagperf_megatron(LLAMA3_8B, "2x8xH100", 1, 8, 2, 512, 7914, 0.384, 62, FLAGPERF_LLAMA3_8B),
    # "H100-55机440卡", fix_hp gbs=1760 (8 micro-batches per replica), marked "for performance reference only"
    _flagperf_megatron(LLAMA3_8B, "55x8xH100", 1, 220, 2, 1760, 7047, 0.342, 55, FLAGPERF_LLAMA3_8B),
]  # fmt: skip

# FlagPerf, Llama 3 70B pre-training with Megatron-Core core_v0.6.0 on 8 x 8 H100 SXM 80GB
# (InfiniBand 400 Gb/s; FLAGPERF_LLAMA3_70B): PP4 DP2 TP8, the same command as the 8B rows with
# --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64
# --num-query-groups 8, sequence 8192, micro-batch 1, global batch 512 (256 micro-batches per
# replica), --sequence-parallel, distributed optimizer, bf16, no --recompute-* flag (the README
# again lists recompute-activations): 851 tokens/s per GPU, MFU 36.1 %, mem 55/80 GiB (nvidia-smi).
# Exact and approximated as the 8B rows (learned absolute positions: 8192 x 8192 weights on the
# first stage; biases; tied embedding, a copy on the last stage; dropout 0.1).
FLAGPERF_LLAMA3_70B_RUN = _flagperf_megatron(
    LLAMA3_70B, "8x8xH100", 4, 2, 8, 512, 851, 0.361, 55, FLAGPERF_LLAMA3_70B
)  # fmt: skip

# FlagPerf, Llama 2 7B pre-training with Megatron-DeepSpeed (DeepSpeed 0.11.1) on one DGX A800
# 80GB (priced on A100-80GB, as above; FLAGPERF_LLAMA2_7B_MDS): TP1 PP1 DP8 (--no-pipeline-parallel),
# ds_config.json ZeRO stage 1 (grad_accum_dtype bf16), micro-batch 1, sequence 4096, gradient
# accumulation 32 (global batch 256; the second row: GAS 128, global batch 1024, labelled "A100"),
# bf16, Adam (0.9, 0.95, weight decay 0.1), --use-flash-attn-v2, no recomputation (the
# --recompute-activations line is commented out). 4047 / 3974 tokens/s per GPU, MFU 54.6 % / 53.5 %,
# mem 63/80 GiB both (nvidia-smi). Exact: GPUs, DP8, ZeRO-1, micro-batch, accumulation, sequence,
# bf16, no recomputation, and the flags before the comment: --num-layers 32 --hidden-size 4096
# --ffn-hidden-size 11008 --num-attention-heads 32 --swiglu --use-rotary-position-embeddings
# --untie-embeddings-and-output-weights, dropout 0. Approximated: the command is a double-quoted
# string run by ``eval``, and the commented-out ``#--recompute-activations`` sits mid-string (after
# the backslash-newlines are joined), so the shell drops every flag after it: --normalization
# rmsnorm, --disable-bias-linear, --num-key-value-heads 32 and ds_args. As written the model has
# Megatron-DeepSpeed's defaults there: LayerNorm and biased linears (32 key/value heads either way);
# priced as the zoo Llama (RMSNorm, no biases).
FLAGPERF_LLAMA2_7B_MDS_RUNS = [
    PublishedRun(
        shape=LLAMA2_7B, cluster="1x8xA100-80GB", seq_len=4096, local_batch=1, activation_checkpointing="none",
        zero_stage=1, dp=8, num_microbatches=gas, framework="megatron-deepspeed", tokens_per_s_per_gpu=wps, mfu=mfu,
        peak_memory_gib=63, peak_memory_kind="nvidia-smi", source=FLAGPERF_LLAMA2_7B_MDS,
    )
    for gas, wps, mfu in ((32, 4047, 0.546), (128, 3974, 0.535))
]  # fmt: skip

# FlagPerf, Llama 2 7B pre-training with DeepSpeed 0.11.1 ZeRO-3 over one DGX A800 80GB (priced on
# A100-80GB; FLAGPERF_LLAMA2_7B_DS): HF ``LlamaForCausalLM`` from llama2_7b_hf/config.json (exactly
# the zoo's Llama 2 7B, untied), built under ``deepspeed.zero.Init``, flash-attention 2
# (transformers 4.34.1), ds_config.json: ZeRO stage 3 (overlap_comm, max live parameters 1e9,
# prefetch bucket 1e7, reduce bucket 1e7), bf16, DeepSpeed AdamW (0.9, 0.95, weight decay 0.1),
# micro-batch 1 per GPU, gradient accumulation 1, sequence 4096; no activation checkpointing (the
# HF model never calls gradient_checkpointing_enable; ds_config's "activation_checkpointing"
# section only configures DeepSpeed's checkpoint API, which the model does not use). Rows: the
# default (3564 tokens/s per GPU, MFU 47.9 %, mem 57/80 GiB), fix_hp MPE=2048 LBS=3 (sequence 2048,
# micro-batch 3: 3917, 52.7 %, 70/80) and with GAS=64 (4062, 54.7 %, 70/80); mem from nvidia-smi.
# Exact: model, GPUs, ZeRO-3 over 8, batch, accumulation, sequence, bf16, AdamW, no recomputation.
# Approximated: DeepSpeed's bucketing (max live parameters, prefetch) against autoplan's per-block
# ZeRO-3 gathers.
FLAGPERF_LLAMA2_7B_DS_RUNS = [
    PublishedRun(
        shape=LLAMA2_7B, cluster="1x8xA100-80GB", seq_len=seq, local_batch=lbs, activation_checkpointing="none",
        zero_stage=3, dp=8, num_microbatches=gas, sharded_grad_accumulation=True, framework="deepspeed",
        tokens_per_s_per_gpu=wps, mfu=mfu,
        peak_memory_gib=mem, peak_memory_kind="nvidia-smi", source=FLAGPERF_LLAMA2_7B_DS,
    )
    for seq, lbs, gas, wps, mfu, mem in ((4096, 1, 1, 3564, 0.479, 57), (2048, 3, 1, 3917, 0.527, 70),
                                          (2048, 3, 64, 4062, 0.547, 70))
]  # fmt: skip

# FlagPerf, Aquila2-7B pre-training with FlagScale (BAAI's Megatron-LM fork, FlagScale.git@ed55532,
# which the README says does not overlap communication with computation yet) on one DGX A800 80GB
# (priced on A100-80GB, as above; FLAGPERF_AQUILA2_7B). flagscale_main.sh: a Llama in Megatron's
# flags (--use-rotary-position-embeddings --no-position-embedding --swiglu --apply-layernorm-rms
# --untie-embeddings-and-output-weights --disable-bias-linear, dropout 0; AQUILA2_7B), sequence 2048,
# bf16, --use-distributed-optimizer (ZeRO-1), --use-flash-attn, Adam (0.9, 0.95, weight decay 0.1),
# no --sequence-parallel, no recomputation flag; run_pretraining.py: global batch = micro-batch x
# world x 9 / (tp x pp), so 9 micro-batches per replica in every row (accumulate_steps 9; the rows'
# fix_hp changes only the micro-batch). Rows: TP1 PP1 DP8 micro-batch 1 (3936.8 tokens/s per GPU,
# MFU 53.0 %, mem 74/80 GiB), TP8 PP1 DP1 micro-batch 8 (2866.3, 38.6 %, 55/80), TP1 PP8 DP1
# micro-batch 4 (2093.5, 28.2 %, 57/80), TP2 PP2 DP2 micro-batch 4 (3468.3, 46.7 %, 52/80); mem
# from nvidia-smi. Exact: shape (vocabulary as Megatron pads it), GPUs, degrees, no SP, batches,
# sequence, bf16, ZeRO-1, no recomputation, 1F1B. Approximated: Megatron's fp32 gradient buffer;
# the interleaved-rotary patch (numerics only); the missing overlap is the framework's, not priced.
FLAGPERF_AQUILA2_7B_RUNS = [
    PublishedRun(
        shape=AQUILA2_7B_TP8 if tp == 8 else AQUILA2_7B, cluster="1x8xA100-80GB", seq_len=2048, local_batch=mbs,
        activation_checkpointing="none", zero_stage=1, dp=dp, tp=tp, pp=pp, microbatch_size=mbs, num_microbatches=9,
        framework="flagscale", tokens_per_s_per_gpu=wps, mfu=mfu, peak_memory_gib=mem, peak_memory_kind="nvidia-smi",
        source=FLAGPERF_AQUILA2_7B,
    )
    for tp, pp, dp, mbs, wps, mfu, mem in ((1, 1, 8, 1, 3936.8, 0.530, 74), (8, 1, 1, 8, 2866.3, 0.386, 55),
                                            (1, 8, 1, 4, 2093.5, 0.282, 57), (2, 2, 2, 4, 3468.3, 0.467, 52))
]  # fmt: skip

# fms-fsdp (IBM, FSDP1 pre-training of Llama 2 shapes; FMS_FSDP), README throughput table, 128 A100
# (16 nodes x 8): 34b, FULL_SHARD over 128 (sharding_strategy=fsdp), activation checkpointing on
# every block (fsdp_activation_checkpointing=True, selective_checkpointing=1: checkpoint_wrapper,
# NO_REENTRANT), batch 8 per GPU, no accumulation, sequence 4096 (train_config.seq_length), bf16
# (bfSixteen: bf16 parameters and reduce), AdamW, torch.compile off (scripts/34b.sh): 772 tokens/s
# per GPU; 70b, the same with batch 6: 380 tokens/s per GPU. No memory published (kind "ran": it
# ran, so it fits). Exact: the sharding, recomputation, batch, sequence, precision. Approximated
# or assumed: the A100's memory (not stated: 80 GB assumed, IBM's Vela A100s; the 70b's checkpoints
# alone, 80 x 6 x 4096 x 8192 bf16 = 30 GiB, rule out 40 GB); the shapes: at the table's commit
# config_utils.py gives 34b and 70b no ``kvheads`` (multi-head attention, FMS_34B_MHA / FMS_70B_MHA),
# the same day's later commit 247f22c "align with FMS config" sets kvheads=8: which one the table
# measured is not recorded (priced as committed with the table, the larger model); FSDP1's flat
# parameters and rate limiter against autoplan's ZeRO-3; full recomputation as in the module
# docstring (checkpoint_wrapper re-runs the whole block; not corrected for these rows).
FMS_FSDP_RUNS = [
    PublishedRun(
        shape=shape, cluster="16x8xA100-80GB", seq_len=4096, local_batch=batch, activation_checkpointing="full",
        zero_stage=3, dp=128, framework="fsdp", tokens_per_s_per_gpu=wps, mfu=None, peak_memory_kind="ran",
        source=FMS_FSDP,
    )
    for shape, batch, wps in ((FMS_34B_MHA, 8, 772), (FMS_70B_MHA, 6, 380))
]  # fmt: skip

RUNS = [
    _tt(LLAMA3_8B, 8192, 1, "selective, per layer", 2904, 0.568),
    _tt(LLAMA3_8B, 8192, 1, "selective, per op", 2973, 0.582),
    _tt(LLAMA3_70B, 8192, 1, "full", 331, 0.517),
    _tt(LLAMA2_13B, 4096, 2, "none", 2162, 0.611),
    _tt(LLAMA2_13B, 4096, 2, "selective, per layer", 1914, 0.541),
    _tt(LLAMA2_13B, 4096, 2, "selective, per op", 1904, 0.538),
    _tt(LLAMA2_70B, 4096, 1, "selective, per op", 355, 0.508),
    _tt(LLAMA2_70B, 4096, 2, "full", 353, 0.505),
    AUTOMODEL_QWEN3_30B,
    LLAMA3_405B_128K,
    *FLAGPERF_LLAMA3_8B_RUNS,
    FLAGPERF_LLAMA3_70B_RUN,
    *FLAGPERF_LLAMA2_7B_MDS_RUNS,
    *FLAGPERF_LLAMA2_7B_DS_RUNS,
    *FLAGPERF_AQUILA2_7B_RUNS,
    *FMS_FSDP_RUNS,
]

RECOMPUTE_MIX: dict[str, dict[str, float]] = {
    # published policy -> {autoplan recompute: weight}; see the module docstring for what is approximate
    "none": {"none": 1.0},
    "full": {"full": 1.0},
    "selective, per op": {"selective": 1.0},
    "selective, per layer": {"none": 0.5, "full": 0.5},
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Priced:
    """What the cost model predicts for one run."""

    config: str
    tokens_per_s_per_gpu: float
    mfu: float
    peak_memory_gib: float
    """The allocator's reserved peak (the rank with the highest)."""
    used_memory_gib: float
    """The device memory in use at the peak, outside PyTorch included (the context and the
    communicators of :func:`framework_communicators`, else of autoplan's program): the figure
    ``nvidia-smi`` shows."""
    feasible: bool
    comm_s: float
    """Communication per step (every collective, :attr:`TrainingEstimate.comm`)."""
    exposed_comm_s: float
    """Of which the compute stream waits for."""
    published_mfu_check: float | None
    """The published tokens/s through torchtitan's MFU formula: equals the published MFU when
    the row's shape and numbers are encoded as torchtitan ran them (torchtitan rows; others: the
    published MFU)."""
    capacity_gib: float
    """What the device leaves PyTorch once the memory outside it is held, at the rank whose
    device use peaks highest (``TrainingEstimate.capacity_bytes`` for autoplan's own program)."""


FP32_LOSS = {
    "torchtitan": "torchtitan torchtitan/components/loss.py cross_entropy_loss: pred.flatten(0, 1).float()",
    "megatron": "Megatron-Core megatron/core/tensor_parallel/cross_entropy.py calculate_logits_max: "
    "vocab_parallel_logits.float()",
    "flagscale": "FlagScale is Megatron-LM's fork: Megatron's vocab-parallel cross entropy on .float() logits",
    "megatron-deepspeed": "Megatron-DeepSpeed megatron/model/gpt_model.py post_language_model_processing: "
    "vocab_parallel_cross_entropy(output.float(), labels) unless --fp16-lm-cross-entropy",
    "deepspeed": "transformers 4.34.1 LlamaForCausalLM.forward: logits = logits.float() before the loss",
}
"""Frameworks whose loss upcasts the bf16 logits to fp32 before the cross entropy, each with
where it does: their runs are priced with :func:`fp32_lm_loss`, the fp32 logits and
log-softmax on the loss's stage as they ran. The others (fms-fsdp's
``CrossEntropyLoss()(output.view(-1, V), ...)`` on FSDP's bf16 output at 3d28d72
fms_fsdp/utils/train_utils.py; NeMo AutoModel and the Llama 3 paper, not published) keep
:func:`tests.zoo.lm_loss` on the model's dtype."""


EAGER_HF_NORM = {
    "deepspeed": "FlagPerf llama2_7b deepspeed: transformers 4.34.1 LlamaForCausalLM, whose LlamaRMSNorm.forward "
    "upcasts to fp32 and multiplies eagerly (its intermediates saved for the backward; no fused kernel)",
}
"""Frameworks whose runs used Hugging Face's eager ``LlamaRMSNorm``, with where: priced with the
norm traced as those ops (:func:`eager_hf_norms`), not as autoplan's fused ``autoplan::rms_norm``."""


BF16_PARAMS = {
    "automodel": "NVIDIA-NeMo/Automodel @ 36044ad3: nemo_automodel/_transformers/auto_model.py from_config: "
    "torch_dtype 'auto' -> torch.bfloat16 (the recipe sets none); components/moe/parallelizer.py "
    "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): FSDP2 keeps the bf16 parameters, and the recipe's "
    "torch.optim.Adam makes its states zeros_like them (bf16)",
}
"""Frameworks whose runs kept the model in bf16 (no fp32 master weights, optimizer states in bf16),
with where: their model is given to the estimate in bf16 (``autoplan.cost_models.memory.keeps_master_weights``).
The others keep fp32 masters (Megatron's and DeepSpeed's bf16 optimizers, torchtitan's FSDP2
``param_dtype=bf16`` over fp32 parameters)."""


FRAMEWORK_HELD = {
    "fp32_main_grads": {
        "megatron": "Megatron-Core core_v0.6.0 (cac60ce4): megatron/training/arguments.py:279-288 (--bf16 forces "
        "accumulate_allreduce_grads_in_fp32), megatron/core/distributed/distributed_data_parallel.py:105 (grad dtype "
        "fp32), param_and_grad_buffer.py:343 (grad_data = torch.zeros over every local parameter, never sharded, "
        "with or without the distributed optimizer)",
        "flagscale": "FlagScale @ ed555321: megatron/arguments.py:165-174 (--bf16 forces "
        "accumulate_allreduce_grads_in_fp32), megatron/model/distributed.py:15-24, 117-119, 140 (MemoryBuffer of "
        "torch.float over every local parameter, allocated at wrap, never sharded)",
    },
    "zero3_grad_partitions": {
        "deepspeed": "DeepSpeed v0.11.1 (e9503fe4): deepspeed/runtime/zero/stage3.py:472-482 "
        "(grad_partitions_flat_buffer = torch.zeros over every parameter's partition, in "
        "gradient_accumulation_dtype, the training dtype unless set, allocated when the optimizer is built; "
        "each parameter's reduced gradient partition is a view of it)",
    },
    "fused_swiglu": {
        "megatron": "Megatron-Core megatron/core/fusions/fused_bias_swiglu.py BiasSwiGLUFunction.forward: "
        "ctx.save_for_backward(input, bias), the backward recomputes silu (bias_activation_fusion, on by default; "
        "--swiglu with biased linears)",
    },
    "dropout_masks": {
        "megatron": "Megatron-Core core_v0.6.0: --hidden-dropout default 0.1 (the FlagPerf script sets none); "
        "megatron/core/fusions/fused_bias_dropout.py: F.dropout after the attention and after the MLP of every "
        "layer, its bool mask saved for the backward (attention dropout runs inside flash attention: no mask)",
    },
    "whole_norm_regions": {
        "flagscale": "FlagScale @ ed555321 without --sequence-parallel (Korthikanti et al. 2022, section 4.2.2): "
        "the two RMSNorms' inputs and outputs are held whole on every tensor-parallel rank, apex FusedRMSNorm "
        "saving its bf16 input (megatron/model/fused_layer_norm.py:96), dropout 0",
    },
}
"""What a framework's program holds at its peak that autoplan's program of the same configuration
does not, or does not hold, per kind, with where in the framework's code
(:func:`framework_held_bytes`; ``docs/framework-memory-notes.md``):

- ``fp32_main_grads``: the gradient buffer in fp32 over every local parameter (4 B each, where
  autoplan's bf16 step holds 2 B gradients);
- ``zero3_grad_partitions``: ZeRO-3's gradient partitions in one flat buffer in the training
  dtype (the size of the weights' shards), alive from the optimizer's construction on;
- ``fused_swiglu``: SwiGLU fused into one autograd function that saves its input only: the
  ``silu`` output autoplan's traced step saves for the ``mul``'s backward is not kept
  (``-2 B x tokens x ffn / tp`` per block and micro-batch in flight);
- ``dropout_masks``: two bool masks per block (``tokens x hidden / tp`` each with sequence
  parallelism), which the zoo's model has not (no dropout);
- ``whole_norm_regions``: tensor parallelism without sequence parallelism holds the norms'
  inputs and outputs whole on each rank of the group (``8 B x hidden`` per token and block),
  where autoplan's ILP keeps them split on ``tp`` (it places them so with or without the flag).

Every row keeps autoplan's own price for the rest; the bytes get the allocator margin."""


GRAD_BUFFER_PER_WEIGHT_BYTE = {"fp32_main_grads": 2.0, "zero3_grad_partitions": 1.0}
"""The :data:`FRAMEWORK_HELD` kinds that are a gradient buffer alive through the whole step, and
its bytes per byte of the stage's weights: fp32 over bf16 weights, and ZeRO-3's partitions in the
training dtype over the weights' shards (:func:`framework_held_bytes`)."""


def framework_held_bytes(run: PublishedRun, est: autoplan.TrainingEstimate) -> tuple[float, ...]:
    """Per pipeline rank (non-interleaved 1F1B: stage ``k`` on rank ``k`` with ``f = min(pp - k,
    micro-batches)`` micro-batches in flight at its peak), the bytes the run's framework holds at
    its peak beyond autoplan's priced peak (negative: less), from :data:`FRAMEWORK_HELD`. Per
    block and micro-batch in flight (``T``: tokens of one micro-batch per replica, ``replica_batch
    x seq_len / cp``; ``tp_sp``: tp with SP, else 1)::

        fused_swiglu        -2 x T x ffn / tp
        dropout_masks        2 x T x hidden / tp_sp
        whole_norm_regions   8 x T x hidden x (1 - 1/tp)

    and ``X = that x blocks x f`` (``blocks``: the repeated blocks on the stage,
    ``StageEstimate.segments``). With the stage's parts ``W, O, A, grads, transient`` and
    ``P = sum(parts) - allocator`` (autoplan's peak before the margin), the framework's peak is
    the larger of::

        at autoplan's peak            P - grads + B + (X if transient >= 0 else 0)
        at the start of a backward    W + O + A + B + X                    (a buffer kind only)

    ``B``: the gradient buffer, alive through every micro-batch's backward: ``2 x W`` with
    ``fp32_main_grads`` (fp32 over every local parameter), ``W`` with ``zero3_grad_partitions``
    (the shards in the training dtype; :data:`GRAD_BUFFER_PER_WEIGHT_BYTE`), else autoplan's
    ``grads`` (then only the first line). Autoplan's own program accumulates a later
    micro-batch's raw gradients beside the sum and frees activations as they are read, so its
    peak can be a late segment's backward with the activations gone (negative ``transient``:
    Aquila2 dp=8); a framework with the buffer peaks when the activations are all alive at the
    first backward op. The second line leaves out that op's temporaries (a lower bound)."""
    kinds = [k for k, by in FRAMEWORK_HELD.items() if run.framework in by]
    if not kinds:
        return tuple(0.0 for _ in est.memory_per_device_bytes)
    if run.virtual_stages != 1 or run.schedule != "1f1b":
        raise ValueError(f"framework_held_bytes prices non-interleaved 1F1B only, not {run.schedule} v={run.virtual_stages}")
    s = run.shape
    tokens = run.replica_batch * run.seq_len / run.cp
    tp_sp = run.tp if run.sequence_parallel else 1
    per_block = 0.0
    if "fused_swiglu" in kinds:
        per_block -= 2.0 * tokens * s.ffn / run.tp
    if "dropout_masks" in kinds:
        per_block += 2.0 * tokens * s.hidden / tp_sp
    if "whole_norm_regions" in kinds and run.tp > 1 and not run.sequence_parallel:
        per_block += 8.0 * tokens * s.hidden * (1 - 1 / run.tp)
    out = []
    for k, stage in enumerate(est.stages):
        first, last = stage.segments
        blocks = len(range(max(first, 1), min(last, est.num_blocks + 1)))
        parts = stage.memory_parts
        priced = sum(parts.values()) - parts["allocator"]
        x = per_block * blocks * min(run.pp - k, run.num_microbatches)
        factors = [f for kind, f in GRAD_BUFFER_PER_WEIGHT_BYTE.items() if kind in kinds]
        if factors:
            buffer = factors[0] * parts["weights"]
            at_backward_start = parts["weights"] + parts["optimizer"] + parts["activations"] + buffer + x
        else:
            buffer, at_backward_start = parts["grads"], -math.inf
        at_peak = priced - parts["grads"] + buffer + (x if parts["transient"] >= 0 else 0.0)
        out.append(max(at_peak, at_backward_start) - priced)
    return tuple(out)


FRAMEWORK_GROUPS = {
    "megatron": "Megatron-Core core_v0.6.0 (cac60ce4): megatron/core/parallel_state.py makes every group with "
    "torch.distributed.new_group (its own NCCL communicator, even over every rank); a step runs collectives on the "
    "world (training/training.py barriers, the timers' all_gather), the tensor group (sequence parallelism), the "
    "pipeline group (core/pipeline_parallel/p2p_communication.py batch_isend_irecv to the neighbours), the data "
    "group with context (training.py:415: the DDP's gradient reduce-scatter and the distributed optimizer's "
    "all-gather), the data group (pretrain_gpt.py:135 average_losses_across_data_parallel_group: the last stage "
    "only), the model-parallel group tp x pp (the optimizer's gradient-norm all-reduce) and the embedding group "
    "(first and last stage: core/distributed/finalize_model_grads.py, the tied embedding's gradients)",
    "flagscale": "FlagScale @ ed555321 (Megatron-LM before context parallelism): megatron/core/parallel_state.py "
    "new_group per group; a step uses the world, tensor, pipeline (batch_isend_irecv), data (gradients, the "
    "distributed optimizer, megatron/utils.py:76 the loss) and model-parallel (utils.py:67, the gradient norm) "
    "groups; the output layer is untied: no embedding all-reduce",
    "megatron-deepspeed": "Megatron-DeepSpeed with DeepSpeed 0.11.1, TP1 PP1: the world and Megatron's data group "
    "(new_group over the 8 ranks), which DeepSpeed's ZeRO-1 engine takes from mpu for its reductions and "
    "Megatron for the loss",
    "deepspeed": "DeepSpeed 0.11.1 without mpu: deepspeed/utils/groups.py _clone_world_group (new_group over every "
    "rank) is the ZeRO-3 engine's data-parallel group, beside the world's default group",
}
"""Frameworks whose process groups (each its own NCCL communicator, PyTorch creating it at the
group's first collective) are encoded, with where: a row of one of them holds outside PyTorch the
communicators of :func:`framework_communicators`
(:func:`autoplan.cost_models.memory.non_pytorch_bytes`); the others are priced with autoplan's
own program's (``TrainingEstimate.capacity_bytes``)."""


def framework_communicators(run: PublishedRun, rank: int) -> tuple[tuple[tuple[int, int], ...], int]:
    """The process groups pipeline rank ``rank`` of ``run``'s framework runs collectives in, as
    ``(ranks, ranks on its node)``, and its point-to-point neighbours (:data:`FRAMEWORK_GROUPS`).
    Megatron's rank order: tensor-parallel ranks consecutive, then data-parallel, pipeline
    stages outermost (``parallel_state.initialize_model_parallel``)."""
    world, pp, dpn, last = run.num_gpus, run.pp, as_cluster(run.cluster).devices_per_node, rank == run.pp - 1
    peers = (rank > 0) + (rank < pp - 1)

    def group(n: int, stride: int) -> tuple[int, int]:  # n ranks, ``stride`` apart
        return n, max(1, min(n, dpn // stride))

    tp, dp = run.tp, run.dp * run.cp
    if run.framework == "megatron":
        groups = [group(world, 1), group(tp, 1), group(pp, tp * dp), group(dp, tp), *([group(run.dp, tp)] if last else []),
                  (tp * pp, min(tp, dpn)), *([(2, 1)] if pp > 1 and rank in (0, pp - 1) else [])]  # fmt: skip
    elif run.framework == "flagscale":
        groups = [group(world, 1), group(tp, 1), group(pp, tp * dp), group(dp, tp), (tp * pp, min(tp, dpn))]
    elif run.framework == "megatron-deepspeed":
        groups = [group(world, 1), group(dp, tp)]
    elif run.framework == "deepspeed":
        groups = [group(world, 1), group(world, 1)]
    else:
        raise KeyError(f"no process groups encoded for {run.framework!r}: FRAMEWORK_GROUPS")
    return tuple(g for g in groups if g[0] > 1), peers


def device_visible_bytes(run: PublishedRun) -> float:
    """What the driver hands the process on the run's device (the capacity before anything outside
    PyTorch: ``autoplan.cost_models.memory.usable_memory_bytes`` without its subtraction)."""
    return as_cluster(run.cluster).device.mem_capacity_bytes / 1e9 * GiB * DRIVER_VISIBLE_FRACTION


@contextlib.contextmanager
def eager_hf_norms(run: PublishedRun):  # noqa: ANN201 - a context manager
    """While pricing ``run`` (:data:`EAGER_HF_NORM`), the tracer leaves RMSNorm modules as their
    eager ops (autoplan's fusion, ``autoplan.passes.trace.norms_as_single_op``, off)."""
    import autoplan.passes.trace as trace  # the tracer's fusion switch: only this benchmark turns it off

    if run.framework not in EAGER_HF_NORM:
        yield
        return
    fused = trace.norms_as_single_op
    trace.norms_as_single_op = contextlib.nullcontext  # type: ignore[assignment]
    try:
        yield
    finally:
        trace.norms_as_single_op = fused


def fp32_lm_loss(out: object, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of the logits upcast to fp32 (:data:`FP32_LOSS`)."""
    return F.cross_entropy(out.logits.flatten(0, 1).float(), labels.flatten())  # type: ignore[attr-defined]


def loss_of(run: PublishedRun):  # noqa: ANN201 - one of the two loss functions
    """The loss the run's framework computes (:data:`FP32_LOSS`)."""
    return fp32_lm_loss if run.framework in FP32_LOSS else lm_loss


def build(run: PublishedRun) -> tuple[torch.nn.Module, torch.Tensor]:
    """The run's model on ``meta`` (in bf16 where the framework kept it so, :data:`BF16_PARAMS`) and one
    sequence of token ids."""
    s = run.shape
    with torch.device("meta"):
        if s.experts:
            model = qwen3_moe_lm(layers=s.layers, hidden=s.hidden, heads=s.heads, kv_heads=s.kv_heads,
                                 head_dim=s.head_dim or s.hidden // s.heads, moe_ffn=s.moe_ffn, vocab=s.vocab,
                                 positions=run.seq_len, experts=s.experts, top_k=s.top_k)  # fmt: skip
        else:
            model = llama_lm(layers=s.layers, hidden=s.hidden, heads=s.heads, kv_heads=s.kv_heads, ffn=s.ffn,
                             vocab=s.vocab, positions=run.seq_len)  # fmt: skip
        ids = torch.randint(0, s.vocab, (1, run.seq_len))
    return (model.to(torch.bfloat16) if run.framework in BF16_PARAMS else model), ids


def parallel_config(run: PublishedRun, recompute: str) -> autoplan.ParallelConfig:
    """The run's configuration: a micro-batch is the ``local_batch`` of each of the ``tp`` ranks
    of the model-parallel axis (split over them when the ILP runs an op batch-parallel there)."""
    return autoplan.ParallelConfig(
        dp=run.dp, cp=run.cp, tp=run.tp, pp=run.pp, microbatch_size=run.replica_batch,
        num_microbatches=run.num_microbatches, schedule=run.schedule, virtual_stages=run.virtual_stages,
        recompute=recompute, zero_stage=run.zero_stage, ep=run.ep, sequence_parallel=run.sequence_parallel,
        sharded_grad_accumulation=run.sharded_grad_accumulation and run.num_microbatches > 1,
    )  # fmt: skip


def _estimates(
    run: PublishedRun, model: torch.nn.Module, ids: torch.Tensor
) -> list[tuple[float, autoplan.ParallelConfig, autoplan.TrainingEstimate]]:
    """``(weight, config, autoplan.estimate)`` of each recomputation the run's policy mixes
    (``RECOMPUTE_MIX``); for a run that does not publish its policy (:data:`LEAST_THAT_FITS`),
    the least of ``none``, ``selective``, ``full`` that fits."""

    def estimate(recompute: str) -> tuple[float, autoplan.ParallelConfig, autoplan.TrainingEstimate]:
        config = parallel_config(run, recompute)
        est = autoplan.estimate(
            model, run.cluster, (ids,), loss_fn=loss_of(run), example_targets=(ids,), config=config,
            global_batch_size=run.global_batch, precision="bf16", optimizer="adamw",
        )  # fmt: skip
        return 1.0, config, est

    if run.activation_checkpointing == LEAST_THAT_FITS:
        for recompute in ("none", "selective"):
            priced = estimate(recompute)
            if priced[2].feasible:
                return [priced]
        return [estimate("full")]
    return [
        (weight, *estimate(recompute)[1:]) for recompute, weight in RECOMPUTE_MIX[run.activation_checkpointing].items()
    ]


def price(run: PublishedRun) -> Priced:
    """``autoplan.estimate`` of the run's configuration (a weighted mean over ``RECOMPUTE_MIX``)."""
    model, ids = build(run)
    torchtitan = run.framework == "torchtitan"
    step_s = mfu_step = peak = used = comm_s = exposed_s = visible = 0.0
    configs = []
    for weight, config, est in _estimates(run, model, ids):
        recompute = config.recompute
        step_s += weight * est.step_time_s
        mfu_step += weight * est.mfu * est.step_time_s  # MFU x step time = FLOPs / peak: the same for both
        held = framework_held_bytes(run, est)
        reserved = [
            m + h * (1 + ALLOCATOR_MARGIN_FRACTION) for m, h in zip(est.memory_per_device_bytes, held, strict=True)
        ]
        visible = device_visible_bytes(run)
        if run.framework in FRAMEWORK_GROUPS:
            multicast = nvlink_multicast(as_cluster(run.cluster).device)
            outside = [
                non_pytorch_bytes("cuda", *framework_communicators(run, r), multicast=multicast) for r in range(run.pp)
            ]
        else:  # autoplan's own program's communicators, at its tightest rank
            outside = [visible - est.capacity_bytes] * run.pp
        peak += weight * max(reserved)
        used += weight * max(r + o for r, o in zip(reserved, outside, strict=True))
        comm_s += weight * est.comm.total_s
        exposed_s += weight * est.exposed_comm_s
        configs.append(str(config) if weight == 1.0 else f"{weight:g}x[{config}]")
        if recompute == "full" and torchtitan:
            step_s += weight * full_ac_extra_recompute_s(run)
    tokens = run.global_batch * run.seq_len
    num_params = sum(p.numel() for p in model.parameters())
    if torchtitan:
        if run.activation_checkpointing == "selective, per op":
            step_s += op_sac_extra_recompute_s(run)
            unkept = op_sac_unkept_bytes(run) * (1 + ALLOCATOR_MARGIN_FRACTION)
            peak, used = peak - unkept, used - unkept
            configs.append("torchtitan op-SAC matmul recompute")
        if "full" in RECOMPUTE_MIX[run.activation_checkpointing]:
            configs.append("torchtitan full-AC block re-run")
        step_s += fsdp2_copy_s(run, num_params)
        configs.append("FSDP2 copies")
    # what the device leaves PyTorch beside the bytes outside it at the rank that peaks highest
    capacity = visible - (used - peak)
    return Priced(
        config=" + ".join(configs), tokens_per_s_per_gpu=tokens / step_s / run.num_gpus, mfu=mfu_step / step_s,
        peak_memory_gib=peak / GiB, used_memory_gib=used / GiB, feasible=peak <= capacity, comm_s=comm_s,
        exposed_comm_s=exposed_s,
        published_mfu_check=torchtitan_mfu(run, num_params, run.tokens_per_s_per_gpu) if torchtitan else run.mfu,
        capacity_gib=capacity / GiB,
    )  # fmt: skip


def _mm_s(run: PublishedRun, k: int, n: int) -> float:
    """Time of one ``(T, k) @ (k, n)`` bf16 ``aten.mm`` of the run's block (T = local batch x
    sequence length), as the cost model prices it in the trace."""

    def meta(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.bfloat16, device="meta")

    tokens = run.local_batch * run.seq_len
    device = Cluster.preset(run.cluster).device
    return roofline_time_s(torch.ops.aten.mm.default, [meta(tokens, k), meta(k, n)], [meta(tokens, n)], device)


def op_sac_extra_recompute_s(run: PublishedRun) -> float:
    """Forward time of the matmuls torchtitan's per-op policy recomputes and autoplan's
    ``selective`` keeps (module docstring): per block, the 2nd, 4th and 6th ``mm`` of the Llama
    block's forward (torchtitan ``Attention.forward`` / ``FeedForward.forward`` order: wq, wk, wv,
    wo, w1, w3, w2), each ``(tokens, K) @ (K, N)`` priced as the cost model prices ``aten.mm``::

        extra_s = layers * (t(T, h, kv_heads * d) + t(T, heads * d, h) + t(T, h, ffn))
        T = local batch * sequence length, d = h / heads
    """
    s = run.shape
    head_dim = s.hidden // s.heads
    recomputed = ((s.hidden, s.kv_heads * head_dim), (s.heads * head_dim, s.hidden), (s.hidden, s.ffn))  # wk, wo, w3
    return s.layers * sum(_mm_s(run, k, n) for k, n in recomputed)


def op_sac_unkept_bytes(run: PublishedRun) -> float:
    """Activation bytes autoplan's ``selective`` keeps and torchtitan's per-op policy does not
    (module docstring): the outputs of the 2nd, 4th and 6th ``mm`` of each block (wk, wo, w3),
    which torchtitan recomputes in the backward, one block at a time, and autoplan keeps (matmul
    outputs the backward or a re-run op reads, ``autoplan/passes/recompute.py``); bf16, one
    micro-batch in flight (the op-SAC runs here have no pipeline)::

        unkept = layers * T * (kv_heads * d + h + ffn) * 2 bytes     T = local batch * sequence length
    """
    s = run.shape
    head_dim = s.hidden // s.heads
    tokens = run.local_batch * run.seq_len
    return float(s.layers * tokens * (s.kv_heads * head_dim + s.heads * head_dim + s.ffn) * 2)


def full_ac_extra_recompute_s(run: PublishedRun) -> float:
    """Forward time of what torchtitan's full activation checkpointing re-runs and autoplan's
    ``full`` does not (module docstring): ``checkpoint_wrapper`` re-runs the whole block, autoplan
    only what the backward reads, so not the block's last matmul (w2, whose output only feeds the
    residual add) nor that add (two ``T x h`` bf16 reads, one write)::

        extra_s = layers * (t(T, ffn, h) + memory_time_s(3 * T * h * 2 bytes))
    """
    s = run.shape
    tokens = run.local_batch * run.seq_len
    add_s = memory_time_s(3 * tokens * s.hidden * 2, Cluster.preset(run.cluster).device)
    return s.layers * (_mm_s(run, s.ffn, s.hidden) + add_s)


def fsdp2_copy_s(run: PublishedRun, num_params: int) -> float:
    """FSDP2's copies on the compute stream per step (module docstring), per FSDP unit (each block,
    and the root: embedding, final norm, output) of ``P_u`` parameters::

        copy_s = sum_u 2 * memory_time_s(2 * P_u * 2 bytes)      gather copy-out, forward + backward
                     + memory_time_s(P_u * (2 + 4) bytes)      reduce-scatter copy-in, bf16 -> fp32
    """
    s = run.shape
    device = Cluster.preset(run.cluster).device
    head_dim = s.hidden // s.heads
    block = (
        s.hidden * (s.heads * head_dim + 2 * s.kv_heads * head_dim)  # wq, wk, wv
        + s.heads * head_dim * s.hidden  # wo
        + 3 * s.hidden * s.ffn  # w1, w2, w3
        + 2 * s.hidden  # attention_norm, ffn_norm
    )
    units = [block] * s.layers + [num_params - s.layers * block]
    return sum(2 * memory_time_s(2 * p * 2, device) + memory_time_s(p * (2 + 4), device) for p in units)


def torchtitan_mfu(run: PublishedRun, num_params: int, tokens_per_s_per_gpu: float) -> float:
    """MFU as torchtitan computes it: (6·N + 12·L·H·Q·T) FLOPs per token (N all parameters,
    attention non-causal) over the A100's 312 TFLOP/s bf16 peak (A100 datasheet)."""
    s = run.shape
    flops_per_token = 6 * num_params + 12 * s.layers * s.heads * (s.hidden // s.heads) * run.seq_len
    return tokens_per_s_per_gpu * flops_per_token / 312e12


def breakdown(run: PublishedRun) -> list[str]:
    """Where the predicted step goes (``--breakdown``), per autoplan configuration of the run:
    the roofline time of the traced step's ops by kind (matmuls, fused attention, routed experts,
    the other ops; forward and backward, every block, every micro-batch), the recomputation the
    configuration adds (``full``: the forward but its random ops; ``selective``: the forward's
    non-matmul ops; plus torchtitan's per-op matmuls), FSDP2's copies (:func:`fsdp2_copy_s`, added
    to the step; torchtitan rows), and from the estimate the optimizer
    step, the compute stream's total (the slowdown beside communication included), the
    communication it waits for and the step (without the two benchmark-side terms). The op times
    and the recomputation are those of one device's ``local_batch`` traced unsharded (``tp=1``):
    with ``tp`` > 1, a device's share when the ILP splits the batch over the axis, and the routed
    experts' average share (no ``ROUTING_IMBALANCE``, no dispatch) when it splits the experts."""
    # the planner's tracing internals, imported here: only this diagnostic needs them
    from autoplan.cost_models.compute import cost_key, is_matmul
    from autoplan.passes.strategies import tensor_args
    from autoplan.planner.mesh import as_cluster
    from autoplan.planner.segment_model import SegmentCostModel
    from autoplan.planner.tracing import prepare_for_precision

    model, ids = build(run)
    cluster = as_cluster(run.cluster)
    model, inputs, targets = prepare_for_precision(model, (ids,), (ids,), "bf16")
    costs = SegmentCostModel(model, inputs, loss_of(run), targets, cluster, optimizer="adamw")
    seg = costs(1, run.local_batch)
    traced, layering = costs._traced(run.local_batch)  # noqa: SLF001 - the traced step, two blocks
    kept, blocks = layering.num_blocks, costs.num_blocks
    ms: dict[tuple[str, str], float] = {}
    for n in traced.graph_module.graph.nodes:
        k = layering.segment_of.get(n.name)
        if n.op != "call_function" or k is None or 1 <= k < kept:
            continue  # the last traced block stands for every block
        out = n.meta.get("val")
        outs = [v for v in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(v, torch.Tensor)]
        key = cost_key(n.target, n.args, n.kwargs)
        t = roofline_time_s(key, [a.meta["val"] for a in tensor_args(n)], outs, cluster.device)
        target = str(n.target)
        kind = "attention" if "sdpa" in target else "experts" if "moe" in target else "other"
        kind = "matmul" if kind == "other" and is_matmul(n.target) else kind
        where = (str(n.meta.get("autoplan.phase")), kind)
        ms[where] = ms.get(where, 0.0) + t * 1e3 * (blocks if k == kept else 1) * run.num_microbatches
    lines = []
    torchtitan = run.framework == "torchtitan"
    wps = run.tokens_per_s_per_gpu
    published_ms = "n/a" if wps is None else f"{run.global_batch * run.seq_len / run.num_gpus / wps * 1e3:,.0f}"
    for recompute in RECOMPUTE_MIX.get(run.activation_checkpointing, {"none": 1.0, "selective": 1.0, "full": 1.0}):
        config = parallel_config(run, recompute)
        est = autoplan.estimate(
            model, cluster, (ids,), loss_fn=loss_of(run), example_targets=(ids,), config=config,
            global_batch_size=run.global_batch, precision="bf16", optimizer="adamw",
        )  # fmt: skip
        redo = {"none": 0.0, "full": sum(x.full_recompute_s for x in seg.segments),
                "selective": sum(x.selective_recompute_s for x in seg.segments)}[recompute] * run.num_microbatches  # fmt: skip
        if run.activation_checkpointing == "selective, per op" and torchtitan:
            redo += op_sac_extra_recompute_s(run)
        if recompute == "full" and torchtitan:
            redo += full_ac_extra_recompute_s(run)
        copies_s = fsdp2_copy_s(run, sum(p.numel() for p in model.parameters())) if torchtitan else 0.0
        kinds = ("matmul", "attention", "experts", "other") if run.shape.experts else ("matmul", "attention", "other")
        passes = " | ".join(
            f"{phase} " + ", ".join(f"{kind} {ms.get((phase, kind), 0.0):,.0f}" for kind in kinds)
            for phase in ("fwd", "bwd")
        )
        lines.append(
            f"  [{recompute}] ms per step: {passes} | recompute {redo * 1e3:,.0f} | FSDP2 copies "
            f"{copies_s * 1e3:,.0f} | optimizer "
            f"{est.optimizer_s * 1e3:,.0f} | compute stream {est.compute_s * 1e3:,.0f} | exposed comm "
            f"{est.exposed_comm_s * 1e3:,.0f} | step {est.step_time_s * 1e3:,.0f} (published {published_ms})"
        )
    return lines


def _option(name: str) -> str | None:
    """The value after ``name`` on the command line (``--only SUBSTR``), ``None`` when absent."""
    argv = sys.argv[1:]
    if name not in argv:
        return None
    k = argv.index(name)
    if k + 1 >= len(argv):
        raise SystemExit(f"{name} needs a value")
    return argv[k + 1]


def _pct(values: list[float], f) -> str:  # noqa: ANN001 - statistics.median or max
    return f"{f(values):.1%}" if values else "n/a"


def source_label(source: str) -> str:
    """A short name of a run's source for the per-source table: a FlagPerf case by its
    directory (``FlagPerf llama3_8B-megatron``), any other by its text up to the first comma or
    parenthesis (``Llama 3 paper``)."""
    if source.startswith(FLAGPERF):
        case = source.split("training/nvidia/", 1)[-1].split("/", 1)[0]
        return f"FlagPerf {case}"
    head = source.split(",", 1)[0].split(";", 1)[0].split(" (", 1)[0]
    return head if len(head) <= 48 else head[:47] + "…"


def source_table(rows: list[tuple[str, float | None, float | None]]) -> tuple[list[str], float | None]:
    """Per source, from ``(source, time error, memory error)`` of each run (signed, ``None``: not
    published): the runs, the median signed time error (the source's bias: a model that leans
    one way on a source reads far from 0), the median |time error|, and the memory's median
    signed error. Returns the lines and the largest |median signed time error| over the sources."""
    by: dict[str, list[tuple[float | None, float | None]]] = {}
    for src, err, mem in rows:
        by.setdefault(source_label(src), []).append((err, mem))
    lines = ["source | runs | time bias (median signed) | time median |err| | memory bias (runs)"]
    worst: float | None = None
    for label in sorted(by):
        errs = [e for e, _ in by[label] if e is not None]
        mems = [m for _, m in by[label] if m is not None]
        bias = statistics.median(errs) if errs else None
        if bias is not None:
            worst = abs(bias) if worst is None else max(worst, abs(bias))
        lines.append(
            f"{label} | {len(by[label])} | {'n/a' if bias is None else f'{bias:+.1%}'} | "
            f"{_pct([abs(e) for e in errs], statistics.median)} | "
            f"{f'{statistics.median(mems):+.1%} ({len(mems)})' if mems else 'n/a'}"
        )
    return lines, worst


def comparable_peak_gib(run: PublishedRun, p: Priced) -> float:
    """The predicted figure that counts what the published peak counts: ``nvidia-smi`` (the
    device's used memory) is the reserved peak with the memory a training process holds outside
    PyTorch (CUDA context, cuBLAS workspaces, the framework's NCCL communicators:
    :attr:`Priced.used_memory_gib`, the same bytes the capacity leaves out);
    ``reserved``/``allocated`` and the rest compare with the reserved peak itself."""
    if run.peak_memory_kind == "nvidia-smi":
        return p.used_memory_gib
    return p.peak_memory_gib


def main() -> int:
    t0 = time.perf_counter()
    show_breakdown = "--breakdown" in sys.argv[1:]
    only = _option("--only")
    runs = [r for r in RUNS if only is None or only.lower() in f"{r.shape.name} {r.source}".lower()]
    if not runs:
        raise SystemExit(f"--only {only!r}: no run's model name or source contains it")
    head = ("model", "cluster", "seq", "local batch", "AC (published)", "autoplan config", "pred tok/s/GPU",
            "published", "error", "pred MFU", "pub MFU", "pred comm ms (exposed)", "pred peak GiB",
            "published peak GiB (kind)", "mem error", "capacity GiB", "feasible")  # fmt: skip
    print(" | ".join(head))
    errors, mem_errors, encoding, feasible = [], [], [], 0
    per_source: list[tuple[str, float | None, float | None]] = []
    for run in runs:
        with eager_hf_norms(run):  # the run's program as it ran, in the table and the breakdown
            p = price(run)
        feasible += p.feasible
        wps, pub_mfu = run.tokens_per_s_per_gpu, run.mfu
        err_s = "n/a"
        if wps is not None:
            err = p.tokens_per_s_per_gpu / wps - 1
            errors.append(abs(err))
            err_s = f"{err:+.1%}"
        if run.framework == "torchtitan" and p.published_mfu_check is not None and pub_mfu is not None:
            encoding.append(abs(p.published_mfu_check - pub_mfu))
        mem_s, pub_mem = "n/a", f"- ({run.peak_memory_kind or 'not published'})"
        if run.peak_memory_gib is not None:
            mem_err = comparable_peak_gib(run, p) / run.peak_memory_gib - 1
            mem_errors.append(abs(mem_err))
            mem_s, pub_mem = f"{mem_err:+.1%}", f"{run.peak_memory_gib:.1f} ({run.peak_memory_kind})"
        print(
            f"{run.shape.name} | {run.cluster} | {run.seq_len} | {run.local_batch} | {run.activation_checkpointing} | "
            f"{p.config} | {p.tokens_per_s_per_gpu:,.0f} | "
            f"{'n/a' if wps is None else f'{wps:,.0f}'} | {err_s} | {p.mfu:.1%} | "
            f"{'n/a' if pub_mfu is None else f'{pub_mfu:.1%}'} | {p.comm_s * 1e3:,.0f} ({p.exposed_comm_s * 1e3:,.0f}) | "
            f"{p.peak_memory_gib:.1f} | {pub_mem} | {mem_s} | {p.capacity_gib:.1f} | {'yes' if p.feasible else 'NO'}",
            flush=True,
        )  # fmt: skip
        per_source.append((run.source, None if wps is None else err, None if run.peak_memory_gib is None else mem_err))
        if show_breakdown:
            with eager_hf_norms(run):
                print("\n".join(breakdown(run)), flush=True)
    lines, worst_bias = source_table(per_source)
    print("\n".join(["", *lines, ""]))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if encoding:
        print(f"encoding check: published MFU vs torchtitan's formula on published tok/s, max |diff| "
              f"{max(encoding) * 100:.2f} points")  # fmt: skip
    print(f"sources: {'; '.join(sorted({r.source for r in runs}))}")
    print(f"time {time.perf_counter() - t0:.1f} s, peak RSS {rss:.0f} MiB")
    print(
        f"published: runs={len(runs)} err_median={_pct(errors, statistics.median)} err_max={_pct(errors, max)} "
        f"mem_err_median={_pct(mem_errors, statistics.median)} mem_err_max={_pct(mem_errors, max)} "
        f"feasible={feasible}/{len(runs)} source_bias_max={'n/a' if worst_bias is None else f'{worst_bias:.1%}'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
