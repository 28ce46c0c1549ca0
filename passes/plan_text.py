"""The text a plan file holds, read without torch: placements and the traced step's placeholder names.

A placement is written ``R`` (replicated), ``S(d)`` (sharded along tensor dim ``d``), ``S(d)/k``
(dim ``d`` cut into ``k`` equal segments, each segment sharded: a rank holds its shard of every
segment, e.g. its heads of q, k and v of a fused projection; see :mod:`autoplan.passes.segments`),
``P`` (partial sums) or ``P(avg)`` (partial values to average); a spec is one placement per mesh axis
(``["S(0)", "R"]`` in plan files, ``S(0)R`` in logs). :mod:`autoplan.passes.placement` turns this text into
``torch.distributed.tensor`` placements; the review commands (``autoplan show``, ``explain``,
``diff``, ``report``) check and print plan files with this module alone, so they start without
importing torch.

Placeholders of the traced step (:mod:`autoplan.passes.trace`) are named ``p_<fqn>`` (parameters),
``b_<fqn>`` (buffers), ``input_<i>`` and ``target_<i>``, with the FQN's dots as underscores.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

PlacementKind = Literal["R", "S", "P", "P(avg)"]

_SHARD_RE = re.compile(r"^S\((\d+)\)(?:/(\d+))?$")


def parse_placement_text(text: str) -> tuple[PlacementKind, int | None]:
    """``("S", d)`` for ``S(d)`` and ``S(d)/k``, ``(text, None)`` for ``R``, ``P`` and ``P(avg)``;
    ``ValueError`` for anything else (:func:`segment_count` reads the ``k``)."""
    if text == "R":
        return "R", None
    if text == "P":
        return "P", None
    if text == "P(avg)":
        return "P(avg)", None
    m = _SHARD_RE.match(text)
    if m and (m.group(2) is None or int(m.group(2)) >= 2):
        return "S", int(m.group(1))
    raise ValueError(
        f"placement {text!r} is malformed: expected 'R', 'P', 'P(avg)', 'S(<dim>)' or 'S(<dim>)/<segments >= 2>'"
    )


def segment_count(text: str) -> int:
    """``k`` of ``S(d)/k``; 1 for every other (well-formed) placement."""
    parse_placement_text(text)
    m = _SHARD_RE.match(text)
    return int(m.group(2)) if m and m.group(2) else 1


def spec_text(texts: Sequence[str]) -> str:
    """``S(0)R`` for ``["S(0)", "R"]``: the terse text of a spec (the same as
    ``autoplan.passes.placement.spec_str(parse_spec(texts))``); ``ValueError`` for a malformed placement."""
    out = []
    for text in texts:
        kind, dim = parse_placement_text(text)
        k = segment_count(text)
        out.append(kind if kind != "S" else f"S({dim})" if k == 1 else f"S({dim})/{k}")
    return "".join(out)


def placeholder_name(kind: str, name: str) -> str:
    """``placeholder_name("p", "h.0.weight") == "p_h_0_weight"``."""
    return f"{kind}_{name.replace('.', '_')}"


def param_node_name(fqn: str) -> str:
    """Placeholder name of the parameter ``fqn`` in the traced step (``p_<fqn with _>``)."""
    return placeholder_name("p", fqn)
