"""Ring attention's blocks on this machine's device (issue #20): the fused kernels the ring runs
against the explicit formulas, and one rank's measured block time against the analytic price.

    python benchmarks/ring_attention_blocks.py [--tokens 131072 --ranks 8 --heads 32 --kv-heads 8 --head-dim 128]

Part 1 (correctness): :func:`autoplan.passes.ring_attention._block` / ``_block_backward`` (PyTorch's
fused kernels: flash on CPU; on CUDA cuDNN (bf16) or memory-efficient (fp32)) against ``_block_math`` /
``_block_backward_math``, causal and not, grouped-query, in fp32 (and bf16 on CUDA).

Part 2 (time, CUDA only; skipped on CPU): the blocks one rank of a causal ring of ``--ranks``
computes in the zigzag layout (its ``2n`` half-size blocks: step 0 three ``c x c`` blocks, every
other step one ``c x 2c``; ``c = T / 2n``), merges included and transfers left out, forward and
backward, timed with CUDA events (median of 5) in bf16, against what the planner prices for that
rank: the analytic time of the whole causal ``autoplan::sdpa`` (and its backward) divided by ``n``
(:func:`autoplan.passes.costing.analytic_time_s`'s roofline; the backward price includes the
recomputed forward, as the ring's backward does). The final line::

    ring_attention_blocks: max_err_fp32=... max_err_bf16=... fwd_measured/predicted=... bwd_measured/predicted=...
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import autoplan  # noqa: E402
from autoplan.cost_models.compute import cost_key, roofline_time_s  # noqa: E402
from autoplan.passes import attention  # noqa: E402, F401  (registers autoplan::sdpa)
from autoplan.passes import ring_attention as ring  # noqa: E402


def _errors(device: str, dtype: torch.dtype) -> float:
    """Largest relative error of the fused blocks against the explicit formulas."""
    worst = 0.0
    torch.manual_seed(0)
    for causal, kv_heads in ((True, 4), (False, 4), (True, 1)):
        q = torch.randn(2, 4, 256, 64, device=device, dtype=dtype)
        k, v = (torch.randn(2, kv_heads, 256, 64, device=device, dtype=dtype) for _ in range(2))
        k, v = ring._expand_heads(k, 4), ring._expand_heads(v, 4)
        dout = torch.randn_like(q)
        scale = 64**-0.5
        fused, math = ring._block(q, k, v, causal, scale), ring._block_math(q, k, v, causal, scale)
        out, lse = math
        grads = ring._block_backward(dout, q, k, v, out, lse, causal, scale)
        ref = ring._block_backward_math(dout, q, k, v, out, lse, causal, scale)
        names = ("out", "lse", "dq", "dk", "dv")
        for name, a, b in zip(names, (*fused, *grads), (*math, *ref), strict=True):
            err = float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))
            if err > 1e-2:
                print(f"  {dtype} causal={causal} kv_heads={kv_heads} {name}: rel err {err:.2e}")
            worst = max(worst, err)
    return worst


def _time_ms(fn: object, reps: int = 5) -> float:
    times = []
    for _ in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()  # type: ignore[operator]
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def _rank_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, *, backward: bool) -> None:
    """Rank 0's blocks of a causal ring of ``n`` (zigzag: every step after the first is ``q_b``
    against a whole ``2c`` block), with the merges; the backward recomputes the forward first."""
    scale = q.shape[-1] ** -0.5
    heads = q.shape[1]
    q_a, q_b = q.chunk(2, dim=2)
    k_a, k_b = (ring._expand_heads(x, heads) for x in k.chunk(2, dim=2))
    v_a, v_b = (ring._expand_heads(x, heads) for x in v.chunk(2, dim=2))
    ke, ve = ring._expand_heads(k, heads), ring._expand_heads(v, heads)
    acc_a = ring._merge(None, ring._block(q_a, k_a, v_a, True, scale))
    acc_b = ring._merge(None, ring._block(q_b, k_a, v_a, False, scale))
    acc_b = ring._merge(acc_b, ring._block(q_b, k_b, v_b, True, scale))
    for _ in range(n - 1):
        acc_b = ring._merge(acc_b, ring._block(q_b, ke, ve, False, scale))
    if not backward:
        return
    out_a, out_b = acc_a[0].to(q.dtype), acc_b[0].to(q.dtype)
    d_a, d_b = torch.ones_like(out_a), torch.ones_like(out_b)
    ring._block_backward(d_a, q_a, k_a, v_a, out_a, acc_a[1], True, scale)
    ring._block_backward(d_b, q_b, k_a, v_a, out_b, acc_b[1], False, scale)
    ring._block_backward(d_b, q_b, k_b, v_b, out_b, acc_b[1], True, scale)
    for _ in range(n - 1):
        ring._block_backward(d_b, q_b, ke, ve, out_b, acc_b[1], False, scale)


def _predicted_s(tokens: int, heads: int, kv_heads: int, head_dim: int, n: int, device: object) -> tuple[float, float]:
    """The planner's analytic times of one rank's share of the causal op and its backward."""
    q = torch.empty(1, heads, tokens, head_dim, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(1, kv_heads, tokens, head_dim, dtype=torch.bfloat16, device="meta")
    gqa = kv_heads != heads
    fwd_key = cost_key(torch.ops.autoplan.sdpa.default, (q, kv, kv, None, 0.0, True, None, gqa))
    bwd_key = cost_key(torch.ops.autoplan.sdpa_backward.default, (q, q, kv, kv, None, 0.0, True, None, gqa))
    fwd = roofline_time_s(fwd_key, [q, kv, kv], [q], device, work_divisor=n)  # type: ignore[arg-type]
    bwd = roofline_time_s(bwd_key, [q, q, kv, kv], [q, kv, kv], device, work_divisor=n)  # type: ignore[arg-type]
    return fwd, bwd


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--cluster", default="8xH100", help="catalog device the prediction uses")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    err32 = _errors(device, torch.float32)
    err16 = _errors(device, torch.bfloat16) if cuda else float("nan")
    print(f"{'device':8s} {'fp32 max rel err':>18s} {'bf16 max rel err':>18s}")
    print(f"{device:8s} {err32:18.2e} {err16:18.2e}")
    summary = f"ring_attention_blocks: max_err_fp32={err32:.1e} max_err_bf16={err16:.1e}"
    if cuda:
        n, local = args.ranks, args.tokens // args.ranks
        q = torch.randn(1, args.heads, local, args.head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, args.kv_heads, local, args.head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        fwd_ms = _time_ms(lambda: _rank_blocks(q, k, v, n, backward=False))
        both_ms = _time_ms(lambda: _rank_blocks(q, k, v, n, backward=True))
        spec = autoplan.Cluster.preset(args.cluster).device
        fwd_s, bwd_s = _predicted_s(args.tokens, args.heads, args.kv_heads, args.head_dim, n, spec)
        bwd_ms = both_ms  # the ring's backward recomputes the forward: both passes are its time
        print(f"\n{torch.cuda.get_device_name()}: one rank of a causal ring of {n}, {args.tokens} tokens, "
              f"{args.heads}/{args.kv_heads} heads of {args.head_dim}, bf16 (transfers left out)")  # fmt: skip
        print(f"{'pass':10s} {'measured ms':>12s} {'predicted ms':>13s} {'ratio':>7s}")
        print(f"{'forward':10s} {fwd_ms:12.2f} {fwd_s * 1e3:13.2f} {fwd_ms / (fwd_s * 1e3):7.3f}")
        print(f"{'backward':10s} {bwd_ms:12.2f} {bwd_s * 1e3:13.2f} {bwd_ms / (bwd_s * 1e3):7.3f}")
        summary += (
            f" fwd_measured/predicted={fwd_ms / (fwd_s * 1e3):.3f} bwd_measured/predicted={bwd_ms / (bwd_s * 1e3):.3f}"
        )
    print(summary)


if __name__ == "__main__":
    main()
