"""Plan quality: the planner's joint search against an exhaustive Megatron-style grid.

    python benchmarks/plan_quality.py            # all cases (a few minutes on 2 cores)
    python benchmarks/plan_quality.py --quick    # 1.3B / 7B on 8 and 64 GPUs only
    python benchmarks/plan_quality.py --models llama3-8b-128k   # some models only

For public transformer shapes (GPT-3 1.3B/13B/175B, Llama-2 7B, Llama-3 70B, Llama-3 8B at
128k tokens, the Mixtral 8x7B mixture of experts) on A100-80GB
and H100 clusters of 8 to 1024 GPUs, it prices

* **grid**: every Megatron-style configuration — dp x tp x pp (tp inside a node), micro-batch
  size, schedule (GPipe, 1F1B, interleaved 1F1B with 2 or 4 virtual stages, zero-bubble),
  recomputation (none / selective / full, the same on every stage), ZeRO 0-3, the experts split
  over groups of the data-parallel group (``ep`` dividing ``dp``, MoE shapes), a context-parallel
  axis beside tensor parallelism (``cp``, samples of 8,192 tokens or more) — with Megatron's
  uniform stage split (blocks divided evenly, embedding on the first stage, head on the last);
* **planner**: ``autoplan.planner.search.search`` — the same configurations plus balanced stage
  boundaries (min-max over measured stage times) and per-stage recomputation,

both with the same cost model (``autoplan.cost_models.step.evaluate`` over the ILP's per-segment
costs: one micro-batch traced on ``meta`` with two blocks, solved on the tensor-parallel group,
and expanded to the model's depth). It prints one row per case and the final line
``plan_quality: cases=N never_worse=M best_ratio_min=X`` (ratio = grid-best step time / planner
step time; >= 0.99 on every case is the target) and checks that every chosen plan fits memory.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from autoplan.cost_models.cluster import Cluster  # noqa: E402
from autoplan.planner.search import SearchSpace, search  # noqa: E402
from autoplan.planner.segment_model import SegmentCostModel  # noqa: E402
from autoplan.planner.tracing import prepare_for_precision  # noqa: E402
from tests import zoo  # noqa: E402

logging.getLogger("autoplan").setLevel(logging.WARNING)
TRACED_BLOCKS = 2


@dataclass(frozen=True)
class Shape:
    name: str
    family: str  # "gpt" | "llama" | "mixtral"
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    global_batch: int
    ffn: int = 0
    kv_heads: int = 0
    experts: int = 0
    top_k: int = 0


SHAPES = [
    # GPT-3 paper (Brown et al. 2020) table 2.1: layers, d_model, heads; batch in sequences of 2048
    Shape("gpt3-1.3b", "gpt", 24, 2048, 16, 2048, 50257, 512),
    Shape("gpt3-13b", "gpt", 40, 5120, 40, 2048, 50257, 1024),
    Shape("gpt3-175b", "gpt", 96, 12288, 96, 2048, 50257, 1536),
    # Llama 2 7B (Touvron et al. 2023): 4M-token batches of 4096; Llama 3 70B: GQA 8 kv heads
    Shape("llama2-7b", "llama", 32, 4096, 32, 4096, 32000, 1024, ffn=11008, kv_heads=32),
    Shape("llama3-70b", "llama", 80, 8192, 64, 8192, 128256, 512, ffn=28672, kv_heads=8),
    # long context: Llama 3 8B (Llama 3 paper, Dubey et al. 2024, section 3.4.2: pre-training extends
    # the context to 128K tokens); 16 sequences per step (2M tokens) is an assumption
    Shape("llama3-8b-128k", "llama", 32, 4096, 32, 131072, 128256, 16, ffn=14336, kv_heads=8),
    # mixture of experts: Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", table 1: 32 layers,
    # d_model 4096, 32 heads / 8 kv heads, FFN 14336, 8 experts, top 2, vocab 32000); 1,024 sequences
    # of 4,096 tokens per step (4M tokens) is an assumption
    Shape("mixtral-8x7b", "mixtral", 32, 4096, 32, 4096, 32000, 1024, ffn=14336, kv_heads=8, experts=8, top_k=2),
]

CLUSTERS = {  # model -> cluster sizes (GPUs) worth planning
    "gpt3-1.3b": (8, 64),
    "gpt3-13b": (64, 1024),
    "gpt3-175b": (1024,),
    "llama2-7b": (8, 64),
    "llama3-70b": (64, 1024),
    "llama3-8b-128k": (8, 64),
    "mixtral-8x7b": (64,),
}
QUICK = {"gpt3-1.3b": (8, 64), "llama2-7b": (8,)}


def build(shape: Shape) -> tuple[torch.nn.Module, torch.Tensor]:
    """``tests.zoo``'s GPT-2, Llama or Mixtral of the shape with TRACED_BLOCKS blocks on ``meta`` and one sample of token ids."""
    with torch.device("meta"):
        if shape.family == "gpt":
            model = zoo.gpt2_lm(layers=TRACED_BLOCKS, hidden=shape.hidden, heads=shape.heads, vocab=shape.vocab,
                                positions=shape.seq)  # fmt: skip
        elif shape.family == "mixtral":
            model = zoo.mixtral_lm(layers=TRACED_BLOCKS, hidden=shape.hidden, heads=shape.heads,
                                   kv_heads=shape.kv_heads, ffn=shape.ffn, vocab=shape.vocab, positions=shape.seq,
                                   experts=shape.experts, top_k=shape.top_k)  # fmt: skip
        else:
            model = zoo.llama_lm(layers=TRACED_BLOCKS, hidden=shape.hidden, heads=shape.heads,
                                 kv_heads=shape.kv_heads, ffn=shape.ffn, vocab=shape.vocab, positions=shape.seq)  # fmt: skip
    ids = torch.empty((1, shape.seq), dtype=torch.long, device="meta")
    return model, ids


GRID = SearchSpace(
    balanced_stages=False, per_stage_recompute=False, microbatch_sizes=(1, 2, 4, 8), virtual_stages=(2, 4)
)
PLANNER = SearchSpace(microbatch_sizes=(1, 2, 4, 8))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small cases only")
    parser.add_argument("--devices", default="A100-80GB,H100", help="comma-separated device names")
    parser.add_argument("--models", default=None, help="comma-separated model names (default: all)")
    args = parser.parse_args()
    cases = QUICK if args.quick else CLUSTERS
    if args.models is not None:
        cases = {name: sizes for name, sizes in cases.items() if name in args.models.split(",")}
    rows = []
    ok_memory = True
    for shape in SHAPES:
        if shape.name not in cases:
            continue
        model, ids = build(shape)
        model, inputs, targets = prepare_for_precision(model, (ids,), (ids,), "bf16")
        traces: dict = {}
        for device in args.devices.split(","):
            for gpus in cases[shape.name]:
                nodes = max(1, gpus // 8)
                cluster = Cluster(num_nodes=nodes, devices_per_node=min(8, gpus), device=device)
                costs = SegmentCostModel(model, inputs, zoo.lm_loss, targets, cluster, optimizer="adam")
                costs._traces = traces  # noqa: SLF001 - traces depend on the model only: share them
                t0 = time.perf_counter()
                kw = dict(num_blocks=TRACED_BLOCKS, global_batch_size=shape.global_batch, precision="bf16",
                          tokens_per_sample=shape.seq, expand_to_blocks=shape.layers,
                          experts=shape.experts)  # fmt: skip
                planner, _ = search(costs, cluster, space=PLANNER, **kw)  # type: ignore[arg-type]
                t_plan = time.perf_counter() - t0
                grid, _ = search(costs, cluster, space=GRID, **kw)  # type: ignore[arg-type]
                ratio = grid.step_time_s / planner.step_time_s
                ok_memory &= planner.peak_memory_bytes <= planner.capacity_bytes
                c = planner.config
                g = grid.config
                rows.append((shape.name, device, gpus, planner, grid, ratio, t_plan))
                print(
                    f"{shape.name:<11} {device:<9} {gpus:>5}  planner {planner.step_time_s:8.3f}s "
                    f"MFU {planner.mfu:5.1%} mem {planner.peak_memory_bytes / 2**30:5.1f}GiB "
                    f"[dp{c.dp}{f' cp{c.cp}' if c.cp > 1 else ''} tp{c.tp} pp{c.pp} mbs{c.microbatch_size}x{c.num_microbatches} "
                    f"{c.schedule if c.pp > 1 else 'none'}"
                    f"{'/v' + str(c.virtual_stages) if c.virtual_stages > 1 else ''} rc={c.recompute} z{c.zero_stage}"
                    f"{f' ep{c.ep}' if c.ep > 1 else ''}]"
                    f"  grid {grid.step_time_s:8.3f}s [dp{g.dp}{f' cp{g.cp}' if g.cp > 1 else ''} tp{g.tp} pp{g.pp} mbs{g.microbatch_size} "
                    f"{g.schedule if g.pp > 1 else 'none'} "
                    f"rc={g.recompute} z{g.zero_stage}{f' ep{g.ep}' if g.ep > 1 else ''}]  ratio {ratio:.3f}  search {t_plan:.1f}s",
                    flush=True,
                )
    never_worse = sum(1 for r in rows if r[5] >= 0.99)
    print(
        f"plan_quality: cases={len(rows)} never_worse={never_worse} best_ratio_min={min(r[5] for r in rows):.3f} "
        f"mfu_range={min(r[3].mfu for r in rows):.1%}..{max(r[3].mfu for r in rows):.1%} memory_ok={ok_memory}"
    )
    return 0 if never_worse == len(rows) and ok_memory else 1


if __name__ == "__main__":
    sys.exit(main())
