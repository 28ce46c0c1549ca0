"""How many forward weight matmuls run on a sharded weight under tensor-parallel pins (issue #20).

    AUTOPLAN_LOCAL_LINKS=catalog AUTOPLAN_NO_PLAN_CACHE=1 python benchmarks/tp_sharded_matmuls.py [-v]

(``AUTOPLAN_LOCAL_LINKS=catalog``: the 2xCPU links from the catalog, not this machine's measured
ones, whose latency decides ties on tiny models; without it BLOOM's attention ``dense`` ties within
a microsecond and may be gathered.)

For tiny Hugging Face decoders (``examples/hf_models.py`` zoo configs) planned for ``2xCPU`` with
Megatron pins on the projection weights (column-parallel fused/in projections, row-parallel
out/down projections), count the forward mm/addmm/bmm/linear nodes whose weight operand derives
(through views/transposes) from a 2-D parameter, and how many of them get that operand sharded
(``S(d)`` or a fused projection's ``S(d)/k``). The tied ``lm_head`` is not pinned and stays
replicated in every family. Prints a row per family and a final line::

    tp_sharded_matmuls: gpt2=8/9 phi3=8/9 phi3-mha=8/9 falcon=6/9 falcon-wide=8/9 bloom=8/9 gpt_neox=8/9
    gptj=12/13 codegen=8/9 mpt=8/9 gpt_bigcode=6/9 llama=14/15

(The multi-query rows, Falcon and GPTBigCode at hidden 32, gather their small fused weight: see
``falcon_wide``.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import autoplan  # noqa: E402
from autoplan.passes.trace import trace_training_step  # noqa: E402
from examples import hf_models  # noqa: E402
from tests.harness import cpu_cluster, forward_matmul_operands  # noqa: E402


def falcon_wide() -> autoplan.Workload:
    """:func:`hf_models.falcon_zoo` with 8 heads of 64 (hidden 512): its fused multi-query weight
    (640 x 512) is 8 times the q/k/v activation of the zoo batch (64 tokens x 640), so the planner
    multiplies its row shards and gathers the activation; on the hidden-32 zoo config the weight is
    the smaller operand and the planner gathers it (at hidden 256, ratio 4, it still does)."""
    from transformers import FalconConfig, FalconForCausalLM

    cfg = FalconConfig(
        num_hidden_layers=2, hidden_size=512, num_attention_heads=8, vocab_size=hf_models.ZOO_VOCAB,
        use_cache=False, bos_token_id=0, eos_token_id=0, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    return hf_models._causal_lm(FalconForCausalLM(cfg))


FALCON_BLOOM_PINS = {
    "*query_key_value.weight": "S(0)", "*self_attention.dense.weight": "S(1)",
    "*dense_h_to_4h.weight": "S(0)", "*dense_4h_to_h.weight": "S(1)",
}  # fmt: skip
"""Megatron pins for Falcon's and BLOOM's module names (the same in both)."""
PHI3_PINS = {
    "*qkv_proj.weight": "S(0)", "*o_proj.weight": "S(1)", "*gate_up_proj.weight": "S(0)", "*down_proj.weight": "S(1)",
}  # fmt: skip
"""Megatron pins for Phi-3's fused projections (both of its layouts)."""

# torch Linear weight is (out, in): column-parallel S(0), row-parallel S(1); HF Conv1D is (in, out).
FAMILIES = {
    "gpt2 (c_attn, Conv1D)": (hf_models.gpt2_zoo, {
        "*attn.c_attn.weight": "S(1)", "*attn.c_proj.weight": "S(0)",
        "*mlp.c_fc.weight": "S(1)", "*mlp.c_proj.weight": "S(0)"}),
    "phi3 (qkv_proj, gate_up_proj)": (hf_models.phi3_zoo, PHI3_PINS),
    "phi3-mha (Phi-3-mini layout)": (hf_models.phi3_mha_zoo, PHI3_PINS),
    "falcon (query_key_value, MQA)": (hf_models.falcon_zoo, FALCON_BLOOM_PINS),
    "falcon-wide (MQA, hidden 512)": (falcon_wide, FALCON_BLOOM_PINS),
    "bloom (query_key_value)": (hf_models.bloom_zoo, FALCON_BLOOM_PINS),
    "gpt_neox (query_key_value per head)": (hf_models.gpt_neox_zoo, {
        "*query_key_value.weight": "S(0)", "*attention.dense.weight": "S(1)",
        "*dense_h_to_4h.weight": "S(0)", "*dense_4h_to_h.weight": "S(1)"}),
    "gptj (eager attention, parallel block)": (hf_models.gptj_zoo, {
        "*attn.q_proj.weight": "S(0)", "*attn.k_proj.weight": "S(0)", "*attn.v_proj.weight": "S(0)",
        "*attn.out_proj.weight": "S(1)", "*mlp.fc_in.weight": "S(0)", "*mlp.fc_out.weight": "S(1)"}),
    "codegen (qkv_proj in 4 blocks, eager)": (hf_models.codegen_zoo, {
        "*attn.qkv_proj.weight": "S(0)", "*attn.out_proj.weight": "S(1)",
        "*mlp.fc_in.weight": "S(0)", "*mlp.fc_out.weight": "S(1)"}),
    "mpt (Wqkv, ALiBi, eager)": (hf_models.mpt_zoo, {
        "*attn.Wqkv.weight": "S(0)", "*attn.out_proj.weight": "S(1)",
        "*ffn.up_proj.weight": "S(0)", "*ffn.down_proj.weight": "S(1)"}),
    "gpt_bigcode (c_attn, MQA)": (hf_models.gpt_bigcode_zoo, {
        "*attn.c_attn.weight": "S(0)", "*attn.c_proj.weight": "S(1)",
        "*mlp.c_fc.weight": "S(0)", "*mlp.c_proj.weight": "S(1)"}),
    "llama (control, unfused)": (hf_models.llama_zoo, {
        "*q_proj.weight": "S(0)", "*k_proj.weight": "S(0)", "*v_proj.weight": "S(0)",
        "*o_proj.weight": "S(1)", "*gate_proj.weight": "S(0)", "*up_proj.weight": "S(0)",
        "*down_proj.weight": "S(1)"}),
}  # fmt: skip


def weight_matmuls(wl: autoplan.Workload, plan: autoplan.Plan) -> list[tuple[str, str, str]]:
    """(node, parameter, planned spec of the weight operand) of every forward weight matmul."""
    traced = trace_training_step(wl.model, wl.example_inputs, loss_fn=wl.loss_fn, example_targets=wl.example_targets)
    rows = []
    for node, operands in forward_matmul_operands(traced):
        layout = plan.nodes[node.name]
        for i, fqn, src in operands:
            if fqn is not None and src.meta["val"].dim() == 2:
                rows.append((node.name, fqn, "".join(layout["in"][i])))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slowdown", type=float, default=1.0, help="compute slowdown of the 2xCPU preset")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    cluster = cpu_cluster("2xCPU", compute_slowdown=args.slowdown)
    summary = []
    for family, (build, pins) in FAMILIES.items():
        if args.only and args.only not in family:
            continue
        torch.manual_seed(0)
        wl = build()
        plan = autoplan.plan(
            wl.model, cluster, example_inputs=wl.example_inputs, loss_fn=wl.loss_fn,
            example_targets=wl.example_targets, optimizer=wl.optimizer, pins=pins,
        )  # fmt: skip
        rows = weight_matmuls(wl, plan)
        sharded = [r for r in rows if "S" in r[2]]
        print(f"{family:34s} sharded {len(sharded)}/{len(rows)}", flush=True)
        summary.append(f"{family.split()[0]}={len(sharded)}/{len(rows)}")
        if args.verbose:
            for r in rows:
                print("   ", *r)
    print("tp_sharded_matmuls: " + " ".join(summary))


if __name__ == "__main__":
    main()
