"""Memory = the real peak (issue #19, item 4): the joint search's per-stage memory is the liveness
peak of the step as it runs (:func:`autoplan.cost_models.memory.stage_memory_parts` over the
per-segment numbers of :mod:`autoplan.planner.segment_costs`), checked against Korthikanti et al.
2022 on a traced GPT-2 block and against its own formula on hand-made segments."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from autoplan.cost_models.comm_schedule import OverlapPolicy
from autoplan.cost_models.memory import (
    BackwardTerms,
    GiB,
    collective_scratch_bytes,
    mesh_groups,
    non_pytorch_bytes,
    precision_bytes,
    rank_memory_parts,
    stage_backward_terms,
    stage_memory_parts,
    usable_memory_bytes,
)
from autoplan.cost_models.schedule import backward_states
from autoplan.cost_models.step import SegmentCost
from autoplan.planner.mesh import as_cluster
from autoplan.planner.segment_model import SegmentCostModel
from tests.zoo import gpt2_lm, lm_loss

SEQ, BATCH, HIDDEN, HEADS, VOCAB = 64, 2, 128, 4, 512


@pytest.fixture(scope="module")
def gpt2_costs():
    """Segment costs of a 2-block GPT-2 (fp32, no dropout) for a micro-batch of 2 x 64 tokens,
    its MLPs' tanh-approximated GeLU replaced by the exact one (``nn.GELU``: saves its input only,
    as Korthikanti et al. assume; the tanh form's decomposed ops keep three more 4h tensors)."""
    torch.manual_seed(0)
    model = gpt2_lm(layers=2, hidden=HIDDEN, heads=HEADS, vocab=VOCAB, positions=SEQ)
    for block in model.transformer.h:
        block.mlp.act = nn.GELU()
    ids = torch.randint(0, VOCAB, (1, SEQ))
    costs = SegmentCostModel(model, (ids,), lm_loss, (ids,), as_cluster("1xCPU"), optimizer="sgd", workers=1)
    return costs(1, BATCH)


def test_block_saves_what_korthikanti_counts_without_dropout_masks_and_softmax(gpt2_costs) -> None:
    """Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    section 4.1: a block keeps s*b*h*(34 + 5*a*s/h) bytes of 16-bit activations without
    recomputation: attention 11sbh + 5as^2b (QKV input 2sbh, Q and K 4sbh, V 2sbh, output
    projection input 2sbh, its dropout mask sbh; softmax output 2as^2b, its dropout mask as^2b,
    dropout output 2as^2b), MLP 19sbh (input 2sbh, GeLU input 8sbh, GeLU output 8sbh, dropout
    mask sbh), two LayerNorm inputs 4sbh. The traced block differs in three ways:

    * fp32: 4 bytes per element instead of 2 (masks are 1 byte either way);
    * no dropout (the zoo's GPT-2 sets every p to 0): no masks, -2sbh - as^2b;
    * attention is ``scaled_dot_product_attention``, whose fused kernels recompute the softmax in
      the backward: none of the s^2 terms, -2as^2b - 2as^2b.

    Left: 16 sbh elements (34 - 2 = 32 bytes at 2 bytes each), 64 sbh bytes in fp32. The small
    extras (LayerNorm mean and rstd, the attention's log-sum-exp: b*s and b*a*s floats) are
    within the tolerance."""
    s, b, h, a = SEQ, BATCH, HIDDEN, HEADS
    paper_bytes = s * b * h * (34 + 5 * a * s / h)
    masks = 2 * s * b * h + a * s * s * b  # 1 byte per element: attention-output and MLP dropout, softmax dropout
    softmax = 2 * a * s * s * b + 2 * a * s * s * b  # softmax output and its dropout's output, 16-bit
    expected_fp32 = 2 * (paper_bytes - masks - softmax)
    assert expected_fp32 == 64 * s * b * h
    for block in gpt2_costs.segments[1:-1]:
        assert block.saved_bytes == pytest.approx(expected_fp32, rel=0.02)


def test_loss_backward_transient_holds_two_fp32_logits(gpt2_costs) -> None:
    """The log-softmax backward holds the incoming gradient and its own output, both
    tokens x vocab fp32 (the issue's missing ~16 GiB at 8k tokens and a 128k vocabulary)."""
    logits_bytes = SEQ * BATCH * VOCAB * 4
    epilogue = gpt2_costs.segments[-1]
    assert epilogue.bwd_transient_bytes >= 2 * logits_bytes
    parts = stage_memory_parts(
        segments=gpt2_costs.segments, recompute="none", element=precision_bytes("sgd", "fp32"), zero_stage=0,
        dp=1, inflight=1, num_microbatches=1, device_kind="cpu",
    )  # fmt: skip
    saved = sum(s.saved_bytes for s in gpt2_costs.segments)
    assert parts["activations"] == saved
    assert parts["transient"] >= 2 * logits_bytes


def _seg(saved: float, fwd_t: float, bwd_t: float, *, numel: int = 1000, inputs: float = 10.0) -> SegmentCost:
    return SegmentCost(
        fwd_s=1e-3, bwd_s=2e-3, bwd_weight_s=1e-3, fwd_comm_s=0.0, bwd_comm_s=0.0, selective_recompute_s=0.0,
        full_recompute_s=1e-3, full_kept_bytes=inputs, full_bwd_transient_bytes=saved + bwd_t,
        grad_sync_s=0.0, optimizer_s=0.0, param_numel=numel, trainable_numel=numel, param_itemsize=4,
        saved_bytes=saved, selective_kept_bytes=saved / 2, input_bytes=inputs, flops=1.0,
        fwd_transient_bytes=fwd_t, bwd_transient_bytes=bwd_t,
    )  # fmt: skip


def _parts(segs, **kw) -> dict[str, float]:
    args = dict(recompute="none", element=precision_bytes("sgd", "fp32"), zero_stage=0, dp=1, inflight=1,
                num_microbatches=1, device_kind="cpu")  # fmt: skip
    return stage_memory_parts(segments=segs, **{**args, **kw})


def test_segment_transients_are_a_max_not_a_sum() -> None:
    """Transients of different segments never coexist, and a segment's backward runs once the
    later segments' backward freed their activations (``K_j``): the middle segment's 170 peaks
    beside 200 of activations, not 300."""
    segs = [_seg(100, 5, 50, numel=0), _seg(100, 5, 170, numel=0), _seg(100, 5, 30, numel=0)]
    parts = _parts(segs)
    assert parts["activations"] == 300
    assert parts["transient"] == 170 - 100
    assert sum(parts.values()) == 200 + 170
    # the last segment's backward (the first to run) sees every activation
    late = _parts([_seg(100, 5, 50, numel=0), _seg(100, 5, 70, numel=0), _seg(100, 5, 90, numel=0)])
    assert late["transient"] == 90 and sum(late.values()) == 390


def test_full_recompute_keeps_block_inputs_and_rebuilds_one_block_at_a_time() -> None:
    """Full recomputation per block (autoplan.passes.recompute, policy ``full``): each segment
    keeps ``full_kept`` per micro-batch in flight, and its backward re-creates its own activations
    only (here ``full_bwd_transient = saved + bwd_T``): the transients are a max, not a sum."""
    segs = [_seg(100, 5, 50, numel=0, inputs=7), _seg(100, 5, 70, numel=0, inputs=9)]
    parts = _parts(segs, recompute="full", inflight=3)
    assert parts["activations"] == 3 * (7 + 9)
    assert parts["transient"] == 100 + 70


def test_gradients_alive_at_a_segments_backward_are_those_of_later_segments() -> None:
    """A segment's transient ``bwd_transient_bytes`` holds the gradients its own backward has made
    so far (segment_costs' ``G_k``); the memory model adds those of the later segments, made
    before it. With accumulation the earlier micro-batches' sum is alive beside them."""
    g = 4.0  # fp32
    # the first segment's backward peaks (transient 100) beside the second segment's gradients
    once = _parts([_seg(0, 0, 100, numel=10), _seg(0, 0, 1, numel=1000)])
    assert once["grads"] == 1000 * g and once["transient"] == 100
    # the last segment's backward (made first) holds only its transient: its own gradients are in it
    late = _parts([_seg(0, 0, 1, numel=10), _seg(0, 0, 5000, numel=1000)])
    assert late["grads"] == 0 and late["transient"] == 5000
    accumulated = _parts([_seg(0, 0, 1, numel=10), _seg(0, 0, 5000, numel=1000)], num_microbatches=2)
    assert accumulated["grads"] == 1010 * g  # the first micro-batch's sum beside the second's transient
    assert accumulated["transient"] == 5000


def test_a_later_micro_batch_runs_beside_the_gradient_sum_with_fewer_activations_in_flight() -> None:
    """1F1B with 2 micro-batches both in flight: the first one's backward holds both micro-batches'
    activations and no sum; the second's holds one micro-batch's activations and the sum (the
    segment's own new gradients are in its transient, 10 here)."""
    segs = [_seg(100, 0, 10, numel=5)]
    g = 4.0
    two = _parts(segs, inflight=2, num_microbatches=2)
    first = 2 * 100 + 10
    second = 100 + 10 + 5 * g
    assert sum(two.values()) == max(first, second) + 5 * g  # + the weights
    many = _parts(segs, inflight=2, num_microbatches=8)  # steady state: 2 in flight beside the sum
    assert sum(many.values()) == 2 * 100 + 10 + 5 * g + 5 * g


def test_gradient_reductions_after_the_schedule_hold_one_bucket_and_its_result() -> None:
    """ZeRO 0 all-reduces the flat bucket in place (one copy); ZeRO >= 1 reduce-scatters it, the
    result (1/dp of the bucket) beside it (autoplan.runtime.collectives), and on CPU ranks gloo's
    full-size copy of the bucket while it runs (memory.GLOO_FLAT_COPY_COLLECTIVES); NCCL has none."""
    segs = [_seg(0, 0, 0, numel=1000)]
    g = 4.0
    ddp = _parts(segs, dp=2)
    assert ddp["grads"] == 1000 * g and ddp["transient"] == 1000 * g  # the bucket under its cap
    zero1 = _parts(segs, dp=2, zero_stage=1)
    assert zero1["grads"] == 1000 * g and zero1["transient"] == 1000 * g * (1 + 1 / 2 + 1)
    on_gpu = _parts(segs, dp=2, zero_stage=1, device_kind="cuda")
    assert on_gpu["grads"] == 1000 * g and on_gpu["transient"] == 1000 * g * (1 + 1 / 2)


def test_gloo_collectives_hold_a_full_size_copy_while_they_run() -> None:
    """Measured on gloo ranks (memory.GLOO_FLAT_COPY_COLLECTIVES): all-gather and reduce-scatter
    allocate their full size beside input and output; all-reduce and all-to-all nothing; NCCL nothing."""
    assert collective_scratch_bytes("all_gather", 8.0, "cpu") == 8.0
    assert collective_scratch_bytes("reduce_scatter", 8.0, "cpu") == 8.0
    assert collective_scratch_bytes("all_reduce", 8.0, "cpu") == 0.0
    assert collective_scratch_bytes("all_to_all", 8.0, "cpu") == 0.0
    assert collective_scratch_bytes("all_gather", 8.0, "cuda") == 0.0


@pytest.mark.parametrize(
    ("src", "dst", "peak_in_f"),
    [
        ("S(0)", "R", 2.0), ("S(1)", "R", 2.0), ("S(2)", "R", 2.0),  # the gathered copy beside gloo's flat copy
        ("S(1)", "S(2)", 2.0), ("S(0)", "S(1)", 2.0),  # gloo has no all-to-all: DTensor gathers, then chunks
        ("P", "S(0)", 1.5), ("P", "S(1)", 2.5),  # the shard, gloo's full copy (+ the narrow-cat on an inner dim)
        ("P", "R", 1.0), ("R", "S(1)", 0.5),
    ],
)
def test_a_conversion_allocates_what_dtensor_measured_on_gloo(src: str, dst: str, peak_in_f: float) -> None:
    """liveness.conversion_bytes against the peaks measured on 2 gloo ranks (torch 2.13, profiler
    memory events of DTensor.redistribute on an [8, 64, 2048] fp32 tensor, F = 4 MiB; the rows of
    memory.collective_peak_bytes): ``peak`` in units of F, the operand it converts not counted;
    ``held``, the converted copy alone."""
    from autoplan.passes.liveness import conversion_bytes
    from autoplan.passes.placement import parse_spec

    t = torch.empty(8, 64, 2048, device="meta")
    f = t.numel() * 4
    held, peak = conversion_bytes(parse_spec([src]), parse_spec([dst]), t, (2,), "cpu")
    assert peak == peak_in_f * f
    assert held == (f if dst in ("R", "P") else f / 2)
    # NCCL: no flat copy; an all-gather on dim 0 writes its output in place
    assert conversion_bytes(parse_spec(["S(0)"]), parse_spec(["R"]), t, (2,), "cuda") == (f, f)


def test_zero3_gathered_weights_follow_the_reshard_policy() -> None:
    """ZeRO-3's gathered weights in segment j's backward: the weights it reads, the segment before
    it (the next in backward order, prefetched while it runs), the running gather's flat input
    and, on gloo, its flat copy; the last segment of the last stage keeps its forward's gather
    and runs its backward before the next gathers are issued, so the segment before it gathers
    its own beside the next one's (measured, benchmarks/memory_peak.py zero3, zero3_ga)."""
    sizes = (100, 200, 150, 300, 250)
    segs = [dataclasses.replace(_seg(0, 0, 0, numel=n), trainable_numel=0) for n in sizes]  # no gradients
    w = 4.0
    reshard = _parts(segs, zero_stage=3, dp=4, policy=OverlapPolicy(reshard_after_forward=True))
    keep = _parts(segs, zero_stage=3, dp=4, policy=OverlapPolicy(reshard_after_forward=False))
    assert reshard["weights"] == 1000 * w / 4
    # segment 3, the one before the last: its 300 and segment 2's 150, both gathered at once once
    # the last segment's run ended, each gather with its flat input (the shards, 1/dp) and, on
    # gloo (CPU ranks), its flat copy of the output
    assert reshard["transient"] == (300 + 150 + (150 + 150 / 4) + (300 + 300 / 4)) * w
    on_gpu = _parts(segs, zero_stage=3, dp=4, device_kind="cuda", policy=OverlapPolicy(reshard_after_forward=True))
    assert on_gpu["transient"] == (300 + 150 + 150 / 4 + 300 / 4) * w  # NCCL gathers into the caller's buffer
    # in an earlier pipeline stage the last segment's backward prefetches: 250 + 300 + 300's gather
    earlier = _parts(segs, zero_stage=3, dp=4, last_stage=False, policy=OverlapPolicy(reshard_after_forward=True))
    assert earlier["transient"] == (250 + 300 + (300 + 300 / 4)) * w
    assert keep["transient"] == 1000 * w  # every block kept from forward to backward
    # a segment reading a tied weight held by an earlier one gathers it too
    tied = [*segs[:-1], dataclasses.replace(segs[-1], tied_param_numel=400, tied_param_owner=0)]
    assert _parts(tied, zero_stage=3, dp=4, device_kind="cuda")["transient"] == (250 + 400) * w


def test_sharded_accumulation_holds_the_buckets_in_flight_through_the_next_forward() -> None:
    """Under sharded accumulation a micro-batch's backward leaves its last buckets in flight until
    the next backward (StageModule.finish_conversions): the next forward peaks with them beside the
    sharded accumulators (measured, benchmarks/memory_peak.py zero3_ga_sharded)."""
    segs = [_seg(100, 50, 10, numel=1000)]  # 4000 B of raw gradients: one bucket
    kw = dict(zero_stage=2, dp=2, num_microbatches=2, reduced_in_backward=True)
    sharded = _parts(segs, converting_backwards=2, **kw)
    # weights 4000 + this forward's 100 kept + 50 transient + accumulators 4000 / 2 + the bucket 4000
    assert sum(sharded.values()) == 4000 + 100 + 50 + 2000 + 4000
    assert sharded["grads"] == 2000
    raw = _parts(segs, converting_backwards=1, **kw)  # the raw sum, reduced once: no bucket in flight
    assert sum(raw.values()) == 4000 + 100 + 50 + 4000


def test_interleaved_stages_of_a_rank_add_activations_and_take_the_largest_transient() -> None:
    a = _parts([_seg(100, 0, 40, numel=0)])
    b = _parts([_seg(200, 0, 90, numel=0)])
    rank = rank_memory_parts([a, b], "cpu")
    assert rank["activations"] == 300
    assert rank["transient"] == 90


def test_a_rank_peaks_at_one_stage_with_the_later_stages_gradients_only() -> None:
    """A micro-batch's backward runs through a rank's stages from the last to the first: at the
    later stage's peak the earlier one has made no gradients yet; at the earlier one's the later
    one's are held (measured, benchmarks/memory_peak.py dp2_pp2_v2: the stage-0 gradients counted
    at stage 2's peak were 0.76 MiB too many)."""
    early = {"weights": 10.0, "optimizer": 20.0, "activations": 30.0, "grads": 8.0, "transient": 1.0}
    late = {"weights": 1.0, "optimizer": 2.0, "activations": 3.0, "grads": 0.0, "transient": 12.0}
    rank = rank_memory_parts([early, late], "cpu")
    assert (rank["weights"], rank["optimizer"], rank["activations"]) == (11.0, 22.0, 33.0)
    assert (rank["grads"], rank["transient"]) == (0.0, 12.0)  # late's peak 12 beats early's 8 + 1 + 0
    held = {**late, "grads": 4.0, "transient": 2.0}
    rank = rank_memory_parts([early, held], "cpu")
    assert (rank["grads"], rank["transient"]) == (8.0 + 4.0, 1.0)  # early's peak with late's gradients


def test_a_stages_backward_terms_are_its_peaks_less_the_micro_batches_activations() -> None:
    """stage_backward_terms splits a stage's backward peaks (stage_memory_parts) into one
    micro-batch's activations and what its first and a later backward add (the later one with
    the gradients summed over the earlier micro-batches)."""
    segs = [_seg(100, 5, 50, numel=10), _seg(60, 5, 170, numel=20)]
    kw = dict(recompute="none", element=precision_bytes("sgd", "fp32"), zero_stage=0, dp=1, inflight=3,
              num_microbatches=4, device_kind="cpu")  # fmt: skip
    parts = stage_memory_parts(segments=segs, **kw)
    terms = stage_backward_terms(segments=segs, **kw)
    assert terms.per_microbatch == parts["activations"] / 3 == 160
    assert terms.summed == 30 * 4.0  # the raw gradients of both segments
    # a later backward (1F1B's steady state: 3 in flight) holds the sum: the stage's peak here
    assert 3 * terms.per_microbatch + terms.later == sum(parts.values()) - parts["weights"] - parts["optimizer"]
    assert terms.later - terms.first == terms.summed


def test_a_rank_with_several_stages_peaks_where_the_schedule_puts_their_backwards() -> None:
    """Interleaved 1F1B, p = 2, v = 2, m = 4 (torch's order on rank 0: 0F0 0F1 2F0 2F1 0F2 2B0
    0F3 2B1 2F2 0B0 2F3 0B1 ...): stage 0's second backward runs with 3 micro-batches of stage 0
    and 2 of stage 2 alive and both stages' gradients, above the activation peak's 4 and 1 with
    stage 2's gradients only (measured, benchmarks/memory_peak.py pp2_v2_m4: rank 0 20.49 MiB,
    priced 18.36 at the activation peak, 20.09 with the schedule's backwards, 20.46 with the
    sends the schedule keeps)."""
    states = backward_states("interleaved-1f1b", 0, 2, 4, 2)
    assert states[0] == (1, (3, 2), True, (False, False), (0, 1))  # 2B0: stage 2's first
    assert (0, (4, 1), True, (False, True), (1, 2)) in states  # 0B0: stage 0's first, stage 2's gradients held
    assert (0, (3, 2), False, (True, True), (2, 2)) in states  # 0B1
    first = {"weights": 1.0, "optimizer": 2.0, "activations": 4 * 10.0, "grads": 0.0, "transient": 3.0}
    last = {"weights": 1.0, "optimizer": 2.0, "activations": 1 * 9.0, "grads": 0.0, "transient": 3.0}
    assert sum(rank_memory_parts([first, last], "cpu").values()) == 6.0 + 49.0 + 3.0
    terms = [
        BackwardTerms(per_microbatch=10.0, first=3.0, first_grads=0.0, later=8.0, later_grads=5.0, summed=5.0),
        BackwardTerms(per_microbatch=9.0, first=3.0, first_grads=0.0, later=7.0, later_grads=4.0, summed=4.0),
    ]
    rank = rank_memory_parts([first, last], "cpu", backwards=terms, states=states)
    # 0B1: 3 x 10 + 2 x 9 alive, stage 0's later backward (8, its sum 5 among it) and stage 2's sum 4
    assert sum(rank.values()) == 6.0 + 30.0 + 18.0 + 8.0 + 4.0
    assert (rank["activations"], rank["grads"], rank["transient"]) == (48.0, 9.0, 3.0)
    # the schedule keeps every send to the step's end: at 0B1 the outputs of stage 0's
    # micro-batches 0 and 1 (1's B running) and stage 2's 0 and 1, and stage 2's 2 input gradients
    sent = rank_memory_parts([first, last], "cpu", backwards=terms, states=states, sends=[(0.5, 0.0), (0.25, 0.125)])
    assert sum(sent.values()) == sum(rank.values()) + 2 * 0.5 + 2 * 0.25 + 2 * 0.125
    # no state above the activation peak's: its price stands
    small = [dataclasses.replace(t, later=t.first, later_grads=0.0, summed=0.0) for t in terms]
    assert rank_memory_parts([first, last], "cpu", backwards=small, states=states) == rank_memory_parts(
        [first, last], "cpu"
    )


def test_tied_parameter_copy_is_held_by_a_later_stage() -> None:
    """A pipeline stage holding the lm_head but not the embedding keeps its own copy of the tied
    weight (its optimizer state and gradient too)."""
    head = dataclasses.replace(
        _seg(0, 0, 0, numel=10), tied_param_numel=500, tied_trainable_numel=500, tied_param_owner=0
    )
    alone = _parts([head], first_segment=3)
    with_owner = _parts([_seg(0, 0, 0, numel=500), head], first_segment=0)
    assert alone["weights"] == 510 * 4.0
    assert with_owner["weights"] == 510 * 4.0


def test_a_tied_lm_heads_gradient_is_held_from_its_backward_to_the_embeddings_on_a_stage_with_both() -> None:
    """The lm_head's contribution to the tied embedding's gradient (500 elements) is made by the
    head's backward and summed in the embedding's: a stage holding both holds it through the
    blocks' backward between (the block's transient 3000 peaks beside it); a stage holding the
    blocks and the head keeps its own copy's gradient instead; a stage holding the embedding
    and the blocks has none of it."""
    embedding, block = _seg(0, 0, 10, numel=500), _seg(0, 0, 3000, numel=0)
    head = dataclasses.replace(_seg(0, 0, 1, numel=0), tied_param_numel=500, tied_trainable_numel=500,
                               tied_param_owner=0)  # fmt: skip
    g = 4.0
    both = _parts([embedding, block, head])
    assert sum(both.values()) - both["weights"] == 3000 + 500 * g  # the block's peak beside the head's gradient
    later = _parts([block, head], first_segment=1)
    assert sum(later.values()) - later["weights"] == 3000 + 500 * g  # its copy's gradient, in r_head
    earlier = _parts([embedding, block], first_segment=0)
    assert sum(earlier.values()) - earlier["weights"] == 3000


def test_segment_costs_leave_the_tied_heads_gradient_out_of_the_blocks_transients(gpt2_costs) -> None:
    """The traced GPT-2 ties lm_head to the embedding: the head's ``mm`` (vocab x hidden fp32) is
    added into the embedding's gradient in the embedding's backward. It is a gradient (the memory
    model holds it, ``_tied_partials_held``), not a transient of the blocks' backward between:
    the blocks' backward transients are those of the same model with the tie cut."""
    head = gpt2_costs.segments[-1]
    assert head.tied_param_owner == 0 and head.tied_trainable_numel == VOCAB * HIDDEN
    torch.manual_seed(0)
    untied = gpt2_lm(layers=2, hidden=HIDDEN, heads=HEADS, vocab=VOCAB, positions=SEQ)
    for block in untied.transformer.h:
        block.mlp.act = nn.GELU()
    untied.lm_head.weight = nn.Parameter(untied.transformer.wte.weight.detach().clone())
    ids = torch.randint(0, VOCAB, (1, SEQ))
    costs = SegmentCostModel(untied, (ids,), lm_loss, (ids,), as_cluster("1xCPU"), optimizer="sgd", workers=1)
    apart = costs(1, BATCH)
    assert apart.segments[-1].tied_param_owner == -1
    tied_t = [s.bwd_transient_bytes for s in gpt2_costs.segments[1:-1]]
    assert tied_t == [s.bwd_transient_bytes for s in apart.segments[1:-1]]


def test_usable_memory_of_an_80_gb_gpu() -> None:
    """80 GB (decimal, the catalog) = 80 GiB of HBM; the driver hands out 79.25 GiB, the CUDA
    context takes 0.51 GiB, and each NCCL communicator the rank's program runs collectives on
    takes its buffers (544 MB with two ranks, 688 MB with more), each pipeline neighbour 469 MB;
    on NVLink with multicast a communicator with more than two ranks on the node adds its NVLS
    buffers (192 MiB per rank there). CPU ranks: as configured, whatever their groups."""
    alone = usable_memory_bytes(80e9, "cuda")
    assert alone == pytest.approx(78.74 * GiB)
    # dp=8 on one node: the world's communicator only (the mesh's one axis is the world)
    assert mesh_groups((8,), 8) == ((8, 8),)
    assert usable_memory_bytes(80e9, "cuda", mesh_groups((8,), 8)) == pytest.approx(alone - 688e6)
    nvls = 16 * 2 * 6 * 2**20 * 8
    assert nvls == 1.5 * GiB
    assert usable_memory_bytes(80e9, "cuda", ((8, 8),), multicast=True) == pytest.approx(alone - 688e6 - nvls)
    # pp=2 x dp=2 x tp=2 on 8 GPUs of one node: the world, pp, dp and tp groups, one neighbour;
    # no group but the world has more than two ranks on the node
    assert mesh_groups((2, 2, 2), 8) == ((8, 8), (2, 2), (2, 2), (2, 2))
    assert usable_memory_bytes(80e9, "cuda", mesh_groups((2, 2, 2), 8), p2p_peers=1) == pytest.approx(
        alone - 688e6 - 3 * 544e6 - (4.34e9 - 1.06e9) / 7
    )
    # dp=4 x tp=4 on 2 nodes of 8: a dp group has 2 ranks on each node, a tp group 4
    assert mesh_groups((4, 4), 8) == ((16, 8), (4, 2), (4, 4))
    assert mesh_groups((1,), 8) == () and non_pytorch_bytes("cpu", ((8, 8), (2, 2)), 2) == 0.0
    assert usable_memory_bytes(24 * GiB, "cpu", ((8, 8), (2, 2)), 2) == 24 * GiB


def test_a_stage_peaking_at_its_optimizer_step_keeps_its_negative_transient() -> None:
    """A stage whose peak is its optimizer step has freed its activations: its ``transient`` part is
    negative and the parts still add up to the peak; combining a rank's stages must not clip it to
    0 (that added the freed activations back: Aquila2 dp=8 in benchmarks/published_runs.py, 9.4 GiB)."""
    at_step = {"weights": 10.0, "optimizer": 20.0, "activations": 30.0, "grads": 40.0, "transient": -25.0}
    assert sum(rank_memory_parts([at_step], "cpu").values()) == 75.0
    other = {"weights": 1.0, "optimizer": 1.0, "activations": 1.0, "grads": 0.0, "transient": 1.0}
    both = rank_memory_parts([at_step, other], "cpu")
    assert sum(both.values()) == 10 + 20 + 30 + 1 + 1 + 1 + max(40 - 25 + 0, 0 + 1)


def test_each_pipeline_rank_leaves_out_its_own_communicators() -> None:
    """``evaluate`` checks every pipeline rank against what its device leaves PyTorch beside the
    context and that rank's NCCL communicators: the mesh's groups (world 8, pp 4, dp 2; on H100 the
    world's has NVLS buffers, 8 ranks on the node) and one pipeline neighbour at either end, two in
    the middle; the capacity it reports is the tightest rank's. Without a pipeline (dp=8), the one
    group is the world."""
    from autoplan.cost_models.cluster import Cluster
    from autoplan.cost_models.config import ParallelConfig
    from autoplan.cost_models.hardware import DEVICE_CATALOG
    from autoplan.cost_models.step import SegmentCosts, evaluate

    seg = SegmentCost(
        fwd_s=1e-3, bwd_s=2e-3, bwd_weight_s=1e-3, fwd_comm_s=0.0, bwd_comm_s=0.0, selective_recompute_s=1e-4,
        full_recompute_s=1e-3, grad_sync_s=0.0, optimizer_s=1e-4, param_numel=10**8, trainable_numel=10**8,
        param_itemsize=4, saved_bytes=4e9, selective_kept_bytes=2e9, full_kept_bytes=1e8, input_bytes=1e8, flops=1e12,
    )  # fmt: skip
    costs = SegmentCosts(segments=(seg,) * 6, cut_bytes=(1e8,) * 5, optimizer="adam")
    h100 = DEVICE_CATALOG["H100"]
    cluster = Cluster(num_nodes=1, devices_per_node=8, device=h100)
    cfg = ParallelConfig(dp=2, pp=4, num_microbatches=8, schedule="1f1b")
    est = evaluate(cfg, costs, cluster)
    groups = ((8, 8), (4, 4), (2, 2))  # world, pp (every other rank: 4 on the node), dp (2 consecutive ranks)
    assert mesh_groups((4, 2), 8) == groups
    room = [
        usable_memory_bytes(h100.mem_capacity_bytes, "cuda", groups, peers, multicast=True) for peers in (1, 2, 2, 1)
    ]
    tightest = min(range(4), key=lambda r: room[r] - est.memory_per_device_bytes[r])
    assert est.capacity_bytes == pytest.approx(room[tightest])
    assert est.feasible == all(m <= c for m, c in zip(est.memory_per_device_bytes, room, strict=True))
    flat = evaluate(ParallelConfig(dp=8), costs, cluster)
    assert flat.capacity_bytes == pytest.approx(
        usable_memory_bytes(h100.mem_capacity_bytes, "cuda", ((8, 8),), multicast=True)
    )
