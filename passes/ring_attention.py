"""Ring attention: attention over a sequence split across the ranks of one mesh axis.

Context parallelism has two layouts. DeepSpeed-Ulysses (all-to-alls around head-parallel
attention) the ILP reaches through ``autoplan::sdpa``'s heads strategy; its degree is bounded by
the key/value heads an axis can split. Ring attention (Liu et al., "Ring Attention with Blockwise
Transformers", arXiv:2310.01889; torch's ``context_parallel``, torchtitan's CP, Megatron-Core's
``cp_comm_type="p2p"``) has no such bound: every rank keeps its queries and the key/value blocks
travel around the ring, each rank merging the partial attention of every block it sees with the
log-sum-exp (online softmax). This module holds the kernels on local tensors (what
``autoplan::sdpa`` runs when its node names a context-parallel group, :mod:`.attention`) and their
price.

Layout. The op's inputs arrive split along the sequence (``S(2)`` of ``(B, H, T, D)``): rank ``r``
of ``n`` holds the contiguous tokens ``[r T/n, (r+1) T/n)``. Under a causal mask that layout is
unbalanced (the last rank attends to every block, the first to one), so the causal kernel first
moves to the *zigzag* layout of Megatron-Core and torchtitan's head-tail load balancer: the
sequence is cut into ``2n`` chunks of ``c = T/(2n)`` tokens and rank ``r`` holds chunks ``r`` and
``2n-1-r``. Chunk ``j`` is held by rank ``j // 2`` before and by ``j`` (``j < n``) or ``2n-1-j``
after; q, k and v move there point-to-point and the output moves back. torchtitan permutes the
tokens once, in the data loader; a plan's token shards are contiguous everywhere else, so here
each attention op pays the permutation (priced, :func:`ring_exchange`). In the zigzag layout
every ring step costs the same, two ``c x c`` blocks per rank::

    step 0 (own blocks)   q_r.k_r (causal), q_b.k_r, q_b.k_b (causal)      b = 2n-1-r
    block of src < r      (q_r, q_b) . k_src                               (k_b' is in the future)
    block of src > r      q_b . (k_src, k_b')                              (q_r sees nothing)

Communication per op on an axis of ``n`` ranks (``X``: one rank's k and v shards)::

    forward   n-1 sends of X to the next rank, each issued before the block it overlaps
    backward  the forward's ring again (the op saves only its inputs), then n-1 sends of X and
              n sends of dK/dV accumulators (fp32; the last one returns them to their owner)
    causal    + the zigzag permutation: q, k, v (backward: and dO) there, O (backward: dQ, dK,
              dV) back, blocking

Each block's partial output and log-sum-exp come from PyTorch's fused CPU kernel
(``_scaled_dot_product_flash_attention_for_cpu``; on CUDA cuDNN's (or flash without cuDNN) in
fp16/bf16, the memory-efficient one in fp32) and its backward, given the merged output
and log-sum-exp, gives that block's exact share of dQ, dK and dV (``P = exp(S - lse)``, ``dS = P
(dP - rowsum(dO O))``). Other devices run the explicit formulas (O(c^2) memory per block).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.tensor import Placement, Shard

from autoplan.cost_models.cluster import Cluster
from autoplan.cost_models.comm import link_time_s, overlaps_compute
from autoplan.cost_models.memory import tensor_bytes

SEQ_DIM = 2
"""The sequence dim of attention's ``(B, H, T, D)`` operands."""

UNDECIDED = "*"
"""``cp_group`` the strategy table asks the attention strategies with: any axis may run the ring."""

_aten = torch.ops.aten


# --------------------------------------------------------------------------------------------
# Blocks: one q chunk against one run of key/value tokens, with the log-sum-exp


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated for grouped-query attention (SDPA's ``enable_gqa``)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _fold_heads(dx: torch.Tensor, heads: int) -> torch.Tensor:
    """The gradient of :func:`_expand_heads`: summed over each key/value head's query group."""
    return dx if dx.shape[1] == heads else dx.unflatten(1, (heads, dx.shape[1] // heads)).sum(dim=2)


def _block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q (B, H, t, D)`` over ``k, v (B, H, s, D)``: output and log-sum-exp ``(B, H, t)``
    (fp32). ``causal`` only for a block on the diagonal (``t == s``, same positions)."""
    if q.device.type == "cpu":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    if q.device.type == "cuda" and q.dtype in _FLASH_DTYPES and torch.backends.cudnn.is_available():
        out, lse, *_ = _aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        return out, lse.reshape(q.shape[:-1])  # cuDNN's is (B, H, T, 1)
    if q.device.type == "cuda" and q.dtype in _FLASH_DTYPES:
        out, lse, *_ = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse
    if q.device.type == "cuda":  # memory-efficient attention (fp32): its lse is padded to 32 rows
        out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
        return out, lse[..., : q.shape[SEQ_DIM]]
    return _block_math(q, k, v, causal, scale)


_FLASH_DTYPES = (torch.float16, torch.bfloat16)
"""Dtypes of CUDA's cuDNN and flash attention kernels. On one H200 (torch 2.11, cuDNN 9.19; bf16,
8k queries x 16k keys, 32 heads of 128), forward / forward+backward: cuDNN (what
``F.scaled_dot_product_attention`` picks there) 667 / 544 TFLOP/s, flash 336 / 321, memory-efficient
175 / 148."""


def _bmhk(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, T, D)`` values stored as ``(B, T, H, D)``: the layout the memory-efficient kernel's
    backward reads its output and output gradient in (other strides gave wrong dQ/dK in bf16)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _block_math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_block` as explicit formulas (fp32 scores: O(t s) memory)."""
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float())
    return out.to(q.dtype), lse


def _block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of dQ, dK, dV given the *merged* output and log-sum-exp of ``q``'s rows."""
    if q.device.type == "cpu":
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
        return dq, dk, dv
    if q.device.type == "cuda" and q.dtype in _FLASH_DTYPES and torch.backends.cudnn.is_available():
        no_rng = torch.empty(0, dtype=torch.int64, device=q.device)  # no dropout: the kernel reads none
        dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.unsqueeze(-1).contiguous(), no_rng, no_rng, None, None, None,
            q.shape[SEQ_DIM], k.shape[SEQ_DIM], 0.0, causal, scale=scale,
        )  # fmt: skip
        return dq, dk, dv
    if q.device.type == "cuda" and q.dtype in _FLASH_DTYPES:
        no_rng = torch.empty(0, dtype=torch.int64, device=q.device)  # no dropout: the kernel reads none
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, q.shape[SEQ_DIM], k.shape[SEQ_DIM], 0.0, causal,
            no_rng, no_rng, scale=scale,
        )  # fmt: skip
        return dq, dk, dv
    if q.device.type == "cuda":
        meta = (x.to("meta") for x in (q, k, v))
        rows = _aten._scaled_dot_product_efficient_attention(*meta, None, True, 0.0, causal, scale=scale)[1].shape[-1]
        padded = torch.nn.functional.pad(lse, (0, rows - lse.shape[-1])).contiguous()
        no_dropout = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            _bmhk(dout), q, k, v, None, _bmhk(out), padded, no_dropout, no_dropout, 0.0, [True, True, True, False],
            causal, scale=scale,
        )  # fmt: skip
        return dq, dk, dv
    return _block_backward_math(dout, q, k, v, out, lse, causal, scale)


def _block_backward_math(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_block_backward` as explicit formulas."""
    qf, kf, vf, dof = q.float(), k.float(), v.float(), dout.float()
    scores = torch.matmul(qf, kf.transpose(-2, -1)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    probs = torch.exp(scores - lse.unsqueeze(-1))
    dv = torch.matmul(probs.transpose(-2, -1), dof)
    dprobs = torch.matmul(dof, vf.transpose(-2, -1))
    dscores = probs * (dprobs - (dof * out.float()).sum(dim=-1, keepdim=True))
    return torch.matmul(dscores, kf) * scale, torch.matmul(dscores.transpose(-2, -1), qf) * scale, dv


def _merge(
    acc: tuple[torch.Tensor, torch.Tensor] | None, block: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax: two partial attentions of the same rows over disjoint keys, as one."""
    out, lse = block[0].float(), block[1]
    if acc is None:
        return out, lse
    acc_out, acc_lse = acc
    new_lse = torch.logaddexp(acc_lse, lse)
    merged = acc_out * torch.exp(acc_lse - new_lse).unsqueeze(-1) + out * torch.exp(lse - new_lse).unsqueeze(-1)
    return merged, new_lse


# --------------------------------------------------------------------------------------------
# The ring on one process group


@dataclass(frozen=True, slots=True)
class _Pending:
    """Messages in flight, and the buffers they send (kept alive until they are done)."""

    works: list[dist.Work]
    buffers: list[torch.Tensor]

    def wait(self) -> None:
        for w in self.works:
            w.wait()


_DONE = _Pending([], [])


@dataclass(frozen=True, slots=True)
class _Ring:
    group: dist.ProcessGroup
    rank: int
    size: int

    @staticmethod
    def of(cp_group: str) -> _Ring:
        group = dist.distributed_c10d._resolve_process_group(cp_group)  # type: ignore[arg-type]
        return _Ring(group, dist.get_rank(group), dist.get_world_size(group))

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    def shift(self, tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], _Pending]:
        """Start sending ``tensors`` to the next rank and receiving the previous rank's."""
        nxt, prev = self._global((self.rank + 1) % self.size), self._global((self.rank - 1) % self.size)
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        works = [dist.isend(t, nxt, group=self.group) for t in sent]
        works += [dist.irecv(r, prev, group=self.group) for r in received]
        return received, _Pending([w for w in works if w is not None], sent)

    def zigzag(self, x: torch.Tensor, *, back: bool = False) -> torch.Tensor:
        """The contiguous shard ``x`` (chunks ``2r, 2r+1`` along ``SEQ_DIM``) in the zigzag layout
        (chunks ``r, 2n-1-r``), or with ``back`` the inverse."""
        n, r = self.size, self.rank
        zig = (r, 2 * n - 1 - r)
        held, wanted = ((2 * r, 2 * r + 1), zig) if not back else (zig, (2 * r, 2 * r + 1))

        def holder(j: int) -> int:  # the rank holding chunk j before the move
            return (j if j < n else 2 * n - 1 - j) if back else j // 2

        def owner(j: int) -> int:  # the rank holding chunk j after it
            return j // 2 if back else (j if j < n else 2 * n - 1 - j)

        mine = {j: piece.contiguous() for j, piece in zip(held, x.chunk(2, dim=SEQ_DIM), strict=True)}
        out = {j: mine[j] for j in wanted if holder(j) == r}
        works = []
        for j, piece in mine.items():
            if owner(j) != r:
                works.append(dist.isend(piece, self._global(owner(j)), group=self.group))
        for j in wanted:
            if j not in out:
                out[j] = torch.empty_like(mine[held[0]])
                works.append(dist.irecv(out[j], self._global(holder(j)), group=self.group))
        _Pending([w for w in works if w is not None], list(mine.values())).wait()
        return torch.cat([out[j] for j in wanted], dim=SEQ_DIM)


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _forward_balanced(
    ring: _Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged output (fp32) and log-sum-exp of the local queries, in the layout the ring runs in
    (zigzag when ``causal``)."""
    heads, n, r = q.shape[1], ring.size, ring.rank
    acc_a: tuple[torch.Tensor, torch.Tensor] | None = None
    acc_b: tuple[torch.Tensor, torch.Tensor] | None = None
    acc: tuple[torch.Tensor, torch.Tensor] | None = None
    q_a, q_b = q.chunk(2, dim=SEQ_DIM) if causal else (q, q)
    kv = (k, v)
    for step in range(n):
        src = (r - step) % n
        nxt, pending = ring.shift(kv) if step < n - 1 else (list(kv), _DONE)
        ke, ve = _expand_heads(kv[0], heads), _expand_heads(kv[1], heads)
        if not causal:
            acc = _merge(acc, _block(q, ke, ve, False, scale))
        else:
            k_a, k_b = ke.chunk(2, dim=SEQ_DIM)
            v_a, v_b = ve.chunk(2, dim=SEQ_DIM)
            if step == 0:
                acc_a = _merge(acc_a, _block(q_a, k_a, v_a, True, scale))
                acc_b = _merge(acc_b, _block(q_b, k_a, v_a, False, scale))
                acc_b = _merge(acc_b, _block(q_b, k_b, v_b, True, scale))
            elif src < r:
                acc_a = _merge(acc_a, _block(q_a, k_a, v_a, False, scale))
                acc_b = _merge(acc_b, _block(q_b, k_a, v_a, False, scale))
            else:
                acc_b = _merge(acc_b, _block(q_b, ke, ve, False, scale))
        pending.wait()
        kv = (nxt[0], nxt[1])
    if not causal:
        assert acc is not None
        return acc
    assert acc_a is not None and acc_b is not None
    return torch.cat([acc_a[0], acc_b[0]], dim=SEQ_DIM), torch.cat([acc_a[1], acc_b[1]], dim=SEQ_DIM)


def _forward_balanced_alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """A ring of one rank: one block over the whole sequence."""
    heads = q.shape[1]
    return _block(q, _expand_heads(k, heads), _expand_heads(v, heads), causal, scale)[0]


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float | None, cp_group: str
) -> torch.Tensor:
    """Attention of this rank's contiguous sequence shard over the whole sequence of the group
    ``cp_group`` (local ``(B, H, T/n, D)`` tensors; k, v may have fewer heads)."""
    ring = _Ring.of(cp_group)
    s = _scale(q, scale)
    if ring.size == 1:  # the whole sequence is here (gloo cannot send to its own rank)
        return _forward_balanced_alone(q, k, v, is_causal, s)
    if is_causal:
        q, k, v = (ring.zigzag(x) for x in (q, k, v))
    out, _ = _forward_balanced(ring, q, k, v, is_causal, s)
    out = out.to(q.dtype)
    return ring.zigzag(out, back=True) if is_causal else out


def ring_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    scale: float | None,
    cp_group: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of :func:`ring_attention` (the forward's ring again, then a ring carrying dK/dV)."""
    ring = _Ring.of(cp_group)
    s, heads, n, r = _scale(q, scale), q.shape[1], ring.size, ring.rank
    if n == 1:  # the whole sequence is here: one block
        out, lse = _block(q, _expand_heads(k, heads), _expand_heads(v, heads), is_causal, s)
        dq, dk, dv = _block_backward(dout, q, _expand_heads(k, heads), _expand_heads(v, heads), out, lse, is_causal, s)
        return dq, _fold_heads(dk, k.shape[1]), _fold_heads(dv, v.shape[1])
    if is_causal:
        q, k, v, dout = (ring.zigzag(x) for x in (q, k, v, dout))
    out32, lse = _forward_balanced(ring, q, k, v, is_causal, s)
    out = out32.to(q.dtype)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv, dkv = (
        (k, v),
        (
            torch.zeros(k.shape, dtype=torch.float32, device=k.device),
            torch.zeros(v.shape, dtype=torch.float32, device=v.device),
        ),
    )
    half = q.shape[SEQ_DIM] // 2

    def blocks(q_rows: slice, k_rows: slice, causal: bool) -> None:
        ke = _expand_heads(kv[0][:, :, k_rows], heads)
        ve = _expand_heads(kv[1][:, :, k_rows], heads)
        g = _block_backward(
            dout[:, :, q_rows], q[:, :, q_rows], ke, ve, out[:, :, q_rows], lse[:, :, q_rows], causal, s
        )
        dq[:, :, q_rows] += g[0]
        dkv[0][:, :, k_rows] += _fold_heads(g[1].float(), kv[0].shape[1])
        dkv[1][:, :, k_rows] += _fold_heads(g[2].float(), kv[1].shape[1])

    every, first, second = slice(None), slice(0, half), slice(half, None)
    for step in range(n):
        src = (r - step) % n
        nxt, pending = ring.shift(kv) if step < n - 1 else (list(kv), _DONE)
        if not is_causal:
            blocks(every, every, False)
        elif step == 0:
            blocks(first, first, True)
            blocks(second, first, False)
            blocks(second, second, True)
        elif src < r:
            blocks(every, first, False)
        else:
            blocks(second, every, False)
        moved, moving = ring.shift(dkv)  # the accumulators follow their block; the n-th returns them home
        pending.wait()
        moving.wait()
        kv, dkv = (nxt[0], nxt[1]), (moved[0], moved[1])
    grads = (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype))
    if is_causal:
        return tuple(ring.zigzag(g, back=True) for g in grads)  # type: ignore[return-value]
    return grads


# --------------------------------------------------------------------------------------------
# Strategies and price


def cp_axes(input_specs: Sequence[Sequence[Placement]], *, backward: bool) -> list[int]:
    """Mesh axes on which an attention strategy splits the query's sequence (the ring's axes)."""
    q = input_specs[1 if backward else 0]
    return [d for d, p in enumerate(q) if isinstance(p, Shard) and p.dim == SEQ_DIM]


@dataclass(frozen=True, slots=True)
class RingCost:
    """What a ring-attention op adds to its compute: the transfers, and the part left exposed."""

    axis: int
    """Mesh axis of the ring."""
    count: int
    """Point-to-point messages each rank sends (ring shifts and zigzag moves)."""
    bytes: float
    """Bytes each rank sends, all messages summed."""
    total_s: float
    """Time of every message on the axis's link."""
    exposed_s: float
    """What the op waits for: each ring shift beyond the block it overlaps (all of it where the
    device does not overlap communication with compute), the accumulators' last hop, the zigzag
    moves."""


def ring_cost(
    local: Sequence[torch.Tensor], *, causal: bool, backward: bool, axis: int, cluster: Cluster,
    step_compute_s: float,
) -> RingCost:  # fmt: skip
    """Price of the ring on mesh axis ``axis`` for this rank's ``q, k, v`` (``local``; see the
    module docstring). ``step_compute_s``: one ring step's compute (the op's local-shape time)."""
    q, k, v = local
    n, link = cluster.mesh_shape[axis], cluster.axis_link(axis)

    def send_s(nbytes: float) -> float:
        return link_time_s("send_recv", nbytes, 2, link, backend=cluster.backend)

    hidden_s = step_compute_s if overlaps_compute(cluster.device) else 0.0
    kv_bytes = float(tensor_bytes(k) + tensor_bytes(v))
    acc_bytes = 4.0 * (k.numel() + v.numel())  # fp32 dK/dV accumulators
    # (messages, bytes, seconds, exposed seconds) of one ring step, per pass
    passes = [(2, kv_bytes, 2 * send_s(kv_bytes / 2))]
    if backward:  # the forward's ring again, then the gradients' ring
        passes.append((4, kv_bytes + acc_bytes, 2 * send_s(kv_bytes / 2) + 2 * send_s(acc_bytes / 2)))
    count, sent, total, exposed = 0, 0.0, 0.0, 0.0
    for messages, nbytes, step_s in passes:
        count += (n - 1) * messages
        sent += (n - 1) * nbytes
        total += (n - 1) * step_s
        exposed += (n - 1) * max(0.0, step_s - hidden_s)
    if backward:  # the last hop returns the accumulators to their owners
        last = 2 * send_s(acc_bytes / 2)
        count, sent, total, exposed = count + 2, sent + acc_bytes, total + last, exposed + last
    if causal:
        moved = zigzag_moved_fraction(n)  # there and back, as the busiest rank moves them
        there = [q, k, v] + ([q] if backward else [])  # backward: dO too
        back = [q] if not backward else [q, k, v]  # O, or dQ, dK, dV
        sizes = [float(tensor_bytes(t)) for t in there + back]
        count += 2 * len(sizes)
        sent += moved * sum(sizes)
        zig_s = moved * sum(2 * send_s(b / 2) for b in sizes)
        total, exposed = total + zig_s, exposed + zig_s
    return RingCost(axis=axis, count=count, bytes=sent, total_s=total, exposed_s=exposed)


def zigzag_moved_fraction(n: int) -> float:
    """The largest share of its shard one rank of ``n`` sends (and receives) moving from the
    contiguous layout (chunks ``2r, 2r+1``) to the zigzag one (chunks ``r, 2n-1-r``): 1/2 for
    ``n = 2`` (chunks 0 and 2 stay), 1 for larger rings (some rank keeps neither chunk)."""

    def owner(j: int) -> int:
        return j if j < n else 2 * n - 1 - j

    sent = max(sum(owner(j) != r for j in (2 * r, 2 * r + 1)) for r in range(n))
    received = max(sum(j // 2 != r for j in (r, 2 * n - 1 - r)) for r in range(n))
    return max(sent, received) / 2


def ring_exchange(node: fx.Node, input_specs: Sequence[Sequence[Placement]], cluster: Cluster,
                  step_compute_s: float) -> RingCost | None:  # fmt: skip
    """:func:`ring_cost` of an ``autoplan::sdpa`` / ``sdpa_backward`` node under a strategy with
    these input specs (``None`` when no axis splits the sequence)."""
    backward = node.target is not torch.ops.autoplan.sdpa.default
    axes = cp_axes(input_specs, backward=backward)
    if not axes:
        return None
    first = 1 if backward else 0
    local = [
        _local(node.args[first + i].meta["val"], input_specs[first + i], cluster.mesh_shape)  # type: ignore[union-attr]
        for i in range(3)
    ]
    causal = bool(node.args[first + 5])
    return ring_cost(
        local, causal=causal, backward=backward, axis=axes[0], cluster=cluster, step_compute_s=step_compute_s
    )


def ring_size(node: fx.Node, input_specs: Sequence[Sequence[Placement]], mesh_shape: Sequence[int]) -> int:
    """Ranks of the ring an attention node runs under a strategy with these input specs (1: none).
    A rank attends its ``T/n`` queries to all ``T`` keys: ``n`` blocks of its local shape (causal:
    ``2n`` half-size blocks, balanced by the zigzag layout), its share ``1/n`` of the op's work."""
    axes = cp_axes(input_specs, backward=node.target is not torch.ops.autoplan.sdpa.default)
    return mesh_shape[axes[0]] if axes else 1


def _local(t: torch.Tensor, spec: Sequence[Placement], mesh_shape: Sequence[int]) -> torch.Tensor:
    shape = list(t.shape)
    for p, n in zip(spec, mesh_shape, strict=True):
        if isinstance(p, Shard):
            shape[p.dim] //= n
    return t.new_empty(shape, device="meta")
