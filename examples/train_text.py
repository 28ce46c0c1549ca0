"""Train a small GPT-2 on a real text file through the sharded data loader.

    python -m torch.distributed.run --nproc-per-node 2 examples/train_text.py [--epochs 3]

The text is Python's own ``LICENSE.txt`` (it ships with every CPython install; ``--text`` names
another file), tokenised with a byte-level BPE tokenizer (``tokenizers``) trained on that file on
rank 0, so nothing is downloaded. The token stream is cut into windows of ``SEQ + 1`` tokens;
``pmodel.data_loader`` shuffles them alike on every rank and each rank materialises only the rows
its program reads (:mod:`autoplan.runtime.data`). Rank 0 prints the loss of every step.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel

import autoplan
from autoplan.runtime.teardown import destroy_process_groups

VOCAB = 512
SEQ = 32
GLOBAL_BATCH = 16
DATA_PARALLEL = {"input_0": "S(0)", "target_0": "S(0)", "*": "R"}
"""Pins: the batch split over the ranks, every weight replicated (a tiny model on CPU ranks
would otherwise be planned unsplit, and every rank would load the whole batch)."""


def default_text() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"


def tokenize(path: Path) -> list[int]:
    """The file's token ids under a byte-level BPE of ``VOCAB`` tokens trained on the file itself."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(path)], trainer)
    return tokenizer.encode(path.read_text()).ids


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of ``seq + 1`` tokens: ``(input_ids, next tokens)``, each ``(seq,)``."""

    def __init__(self, tokens: torch.Tensor, seq: int) -> None:
        self.tokens, self.seq = tokens, seq

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[i * self.seq : (i + 1) * self.seq + 1]
        return window[:-1], window[1:]


def build() -> GPT2LMHeadModel:
    cfg = GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, use_cache=False,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


def lm_loss(out, labels: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    return F.cross_entropy(out.logits.flatten(0, 1), labels.flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", type=Path, default=default_text(), help="a UTF-8 text file")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank, world = dist.get_rank(), dist.get_world_size()
    cluster = autoplan.Cluster.preset(f"{world}x{'H100' if torch.cuda.is_available() else 'CPU'}")

    # the same token stream on every rank: rank 0 trains the tokenizer and tokenises the file
    box: list[list[int] | None] = [tokenize(args.text) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    dataset = TokenWindows(torch.tensor(box[0]), SEQ)

    torch.manual_seed(0)
    model = build()
    example = torch.zeros(GLOBAL_BATCH, SEQ, dtype=torch.int64)
    pmodel = autoplan.parallelize(
        model, cluster, example_inputs=(example,), loss_fn=lm_loss, example_targets=(example,), optimizer="adamw",
        pins=DATA_PARALLEL,
    )  # fmt: skip
    loader = pmodel.data_loader(dataset, shuffle=True, seed=0)
    if rank == 0:
        print(f"{args.text}: {len(box[0])} tokens, {len(dataset)} windows, {len(loader)} steps per epoch")
        print(f"plan: {pmodel.plan.parallelism()}")
    opt = pmodel.make_optimizer(lr=3e-3)
    start, step = time.perf_counter(), 0
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            loss = pmodel.forward_backward(batch)
            opt.step()
            opt.zero_grad()
            step += 1
            if rank == 0:
                print(f"epoch {epoch} step {step}: loss {loss.item():.4f}  ({batch})")
    if rank == 0:
        print(f"{step} steps in {time.perf_counter() - start:.1f} s")
    destroy_process_groups()


if __name__ == "__main__":
    main()
