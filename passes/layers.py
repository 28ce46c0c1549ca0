"""Pass 2b — layers: cut the joint graph into prologue, repeated blocks and epilogue.

Contract
--------
Input: a :class:`~autoplan.passes.trace.TracedProgram` (its ops carry ``meta["autoplan.module"]``, the
module that produced them; backward ops carry the module of the forward op they differentiate).

Output: a :class:`Layering`: every op and placeholder gets a *segment*

    0            prologue   (embeddings, position ids, rotary tables, ... : before the blocks)
    1 .. L       block i-1  (``<prefix>.<i-1>``: the model's repeated layers, e.g. ``model.layers``)
    L + 1        epilogue   (final norm, head, loss)

The blocks are the children of the module list with the most numbered children (``h.0``,
``h.1``, ...). A forward op outside the blocks is prologue if it runs before the first block op,
else epilogue. A backward op belongs to the segment of its forward module; one with no forward
link (gradient accumulation of a value used twice, the loss seed) belongs to the lowest segment
among its inputs (the backward runs from the last segment to the first, so that is where all its
inputs exist), or the epilogue if it has none. A parameter belongs to every segment whose
forward ops read it (a tied embedding is in the prologue and the epilogue).

Pipeline stages are contiguous segment ranges; the stage split, the per-layer costs and the
repeated-structure reduction all read this partition.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import torch.fx as fx

from autoplan.passes.trace import MODULE_KEY, TracedProgram


@dataclass(frozen=True, kw_only=True, slots=True)
class Layering:
    """Segments of the joint graph (see the module docstring)."""

    block_prefix: str
    """FQN of the module list whose children are the blocks (``""`` when the model has none)."""
    num_blocks: int
    segment_of: Mapping[str, int]
    """Node name -> segment, for every ``call_function`` node and every non-parameter placeholder."""
    param_segments: Mapping[str, tuple[int, ...]]
    """Parameter placeholder name -> the segments whose forward reads it (sorted)."""

    @property
    def num_segments(self) -> int:
        return self.num_blocks + 2

    def segment_name(self, seg: int) -> str:
        if seg == 0:
            return "prologue"
        if seg == self.num_segments - 1:
            return "epilogue"
        return f"{self.block_prefix}.{seg - 1}"


def _block_prefix(modules: list[str]) -> tuple[str, int]:
    """The module list with the most numbered children, and how many it has."""
    children: dict[str, set[int]] = {}
    for m in modules:
        parts = m.split(".")
        for i, p in enumerate(parts):
            if p.isdigit():
                children.setdefault(".".join(parts[:i]), set()).add(int(p))
    if not children:
        return "", 0
    prefix, idx = max(children.items(), key=lambda kv: (len(kv[1]), -len(kv[0])))
    return prefix, max(idx) + 1


def _block_of(module: str, prefix: str) -> int | None:
    head = f"{prefix}." if prefix else ""
    if not module.startswith(head):
        return None
    rest = module[len(head) :].split(".", 1)[0]
    return int(rest) if rest.isdigit() else None


def find_layers(traced: TracedProgram) -> Layering:
    """Partition ``traced`` into prologue, blocks and epilogue (see the module docstring)."""
    gm = traced.graph_module
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    modules = sorted({n.meta[MODULE_KEY] for n in nodes if n.meta.get(MODULE_KEY)})
    prefix, num_blocks = _block_prefix(modules)
    last = num_blocks + 1
    seg: dict[str, int] = {}

    def by_module(module: str | None) -> int | None:
        if module is None:
            return None
        b = _block_of(module, prefix) if num_blocks else None
        return None if b is None else b + 1

    # forward: blocks by module, the rest by position relative to the first block op
    seen_block = False
    module_seg: dict[str, Counter[int]] = {}
    for n in nodes:
        if n.meta.get("autoplan.phase") != "fwd":
            continue
        module = n.meta.get(MODULE_KEY)
        s = by_module(module)
        if s is not None:
            seen_block = True
        else:
            s = last if seen_block else 0
        seg[n.name] = s
        module_seg.setdefault(module or "", Counter())[s] += 1

    # backward: the segment of the forward module, else the lowest segment among the inputs
    for n in nodes:
        if n.meta.get("autoplan.phase") != "bwd":
            continue
        module = n.meta.get(MODULE_KEY)
        s = by_module(module)
        if s is None and module and module in module_seg:  # "" (top-level code) says nothing
            s = module_seg[module].most_common(1)[0][0]
        if s is None:
            ins = [seg[a.name] for a in n.all_input_nodes if a.name in seg]
            s = min(ins) if ins else last
        seg[n.name] = s

    # placeholders: parameters belong to the segments that read them in the forward; other
    # placeholders (buffers, inputs, targets) to their first reader
    param_segments: dict[str, tuple[int, ...]] = {}
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        readers = sorted({seg[u.name] for u in n.users if u.name in seg and u.meta.get("autoplan.phase") == "fwd"})
        if n.name.startswith("p_"):
            param_segments[n.name] = tuple(readers) or (
                min((seg[u.name] for u in n.users if u.name in seg), default=0),
            )
        else:
            seg[n.name] = readers[0] if readers else min((seg[u.name] for u in n.users if u.name in seg), default=0)
    return Layering(block_prefix=prefix, num_blocks=num_blocks, segment_of=seg, param_segments=param_segments)


def segment_nodes(layering: Layering, gm: fx.GraphModule, segment: int) -> list[fx.Node]:
    """The ``call_function`` nodes of ``segment``, in program order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and layering.segment_of.get(n.name) == segment]
