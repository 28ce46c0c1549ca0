"""Pass 0 — depth reduction: the same model with fewer repeated blocks, for planning.

Contract
--------
Input: an ``nn.Module`` whose repeated layers are the children of one ``nn.ModuleList`` (the
list with the most children, all of one class: ``model.layers`` of Llama, ``transformer.h`` of
GPT-2).

Output: :class:`ReducedDepth`: a module that computes the same function with only the first
``kept`` blocks (the list is shortened; every other submodule, parameter and buffer is the
original object, nothing is copied), the list's FQN and the real number of blocks.

Why it is exact for planning: blocks ``1 .. L-1`` of a transformer read and write tensors of one
shape and run the same ops, so their traced sub-graphs, strategies, costs and solved placements
are identical. The first block may differ (it reads the prologue's outputs), so two blocks are
kept: block 0 stands for itself, block 1 for blocks ``1 .. L-1``. :func:`autoplan.passes.layers.find_layers`
finds the same segments in the reduced trace, :func:`autoplan.planner.search.expand_blocks`
prices the full depth from it, and the plan of the reduced program applies to the full one by
mapping every block ``i >= 1`` onto block 1 (:mod:`autoplan.passes.expand`). Tests compare both against
full-depth traces.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

KEPT_BLOCKS = 2
"""Blocks traced: the first (may read the prologue differently) and one standing for the rest."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReducedDepth:
    module: torch.nn.Module
    block_list: str
    """FQN of the shortened ``nn.ModuleList`` (``""`` if the model has none)."""
    num_blocks: int
    """Blocks of the original model."""
    kept: int
    """Blocks of ``module``."""

    @property
    def reduced(self) -> bool:
        return self.kept < self.num_blocks


def find_block_list(model: torch.nn.Module) -> tuple[str, int]:
    """FQN and length of the ``nn.ModuleList`` of the repeated blocks (most children, all of one
    class; the shallowest on ties); ``("", 0)`` when there is none."""
    best: tuple[int, int, str] | None = None
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.ModuleList) or len(mod) < 2:
            continue
        if len({type(c) for c in mod}) != 1:
            continue
        key = (len(mod), -name.count("."), name)
        if best is None or key[:2] > best[:2]:
            best = key
    return ("", 0) if best is None else (best[2], best[0])


def reduce_depth(model: torch.nn.Module, keep: int = KEPT_BLOCKS) -> ReducedDepth:
    """``model`` with its block list cut to the first ``keep`` blocks (see the module docstring).
    The original model is not modified; returns it unchanged when it has ``keep`` blocks or
    fewer."""
    prefix, num_blocks = find_block_list(model)
    if num_blocks <= keep:
        return ReducedDepth(module=model, block_list=prefix, num_blocks=num_blocks, kept=num_blocks)
    path = prefix.split(".")
    root = _shallow(model)
    parent = root
    for part in path[:-1]:
        child = _shallow(parent._modules[part])  # noqa: SLF001 - rebuilding the module path
        parent._modules[part] = child  # noqa: SLF001
        parent = child
    blocks = parent._modules[path[-1]]  # noqa: SLF001
    assert isinstance(blocks, torch.nn.ModuleList)
    parent._modules[path[-1]] = torch.nn.ModuleList(list(blocks)[:keep])  # noqa: SLF001
    return ReducedDepth(module=root, block_list=prefix, num_blocks=num_blocks, kept=keep)


def _shallow(mod: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``mod`` whose child table can change without touching ``mod`` (parameters,
    buffers and the children themselves are shared)."""
    new = copy.copy(mod)
    new._modules = dict(mod._modules)  # noqa: SLF001
    return new


__all__ = ["KEPT_BLOCKS", "ReducedDepth", "find_block_list", "reduce_depth"]
