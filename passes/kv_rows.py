"""How a fused grouped-query QKV parameter is stored, read without torch (plan files, checkpoints).

:class:`KVGroupRows` is the layout :mod:`autoplan.passes.kv_groups` gives such a parameter: its rows
grouped by key/value head, ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``, where the model holds
``[q; k; v]``. This module holds the type, its JSON form and the conversions; the review commands
(``autoplan show``, ``explain``, ``report``) read plan files with it without importing torch (the
conversions import it when they run, on tensors).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class KVGroupRows:
    """A fused ``[q; k; v]`` parameter (weight rows or bias) stored grouped by key/value head:
    ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` with ``q_rows_per_group`` query rows and
    ``kv_rows_per_group`` key (and value) rows per group."""

    num_kv_heads: int
    q_rows_per_group: int
    """``g * D``: the rows of the ``g`` query heads that read one key/value head."""
    kv_rows_per_group: int
    """``D``: one key (or value) head's rows."""

    def __post_init__(self) -> None:
        if min(self.num_kv_heads, self.q_rows_per_group, self.kv_rows_per_group) < 1:
            raise ValueError(f"a key/value group layout needs positive sizes, got {self}")

    @property
    def num_rows(self) -> int:
        return self.num_kv_heads * (self.q_rows_per_group + 2 * self.kv_rows_per_group)

    def _check(self, t: torch.Tensor) -> None:
        if t.dim() == 0 or t.shape[0] != self.num_rows:
            raise ValueError(f"a fused q/k/v parameter of {self.num_rows} rows expected, got shape {tuple(t.shape)}")

    def to_stored(self, t: torch.Tensor) -> torch.Tensor:
        """The model's ``[q; k; v]`` rows -> the stored ``[q_0 k_0 v_0 | ...]`` (a new tensor)."""
        import torch

        self._check(t)
        groups, qr, kr, rest = self.num_kv_heads, self.q_rows_per_group, self.kv_rows_per_group, tuple(t.shape[1:])
        q, k, v = t.split([groups * qr, groups * kr, groups * kr], 0)
        grouped = torch.cat(
            [q.reshape(groups, qr, *rest), k.reshape(groups, kr, *rest), v.reshape(groups, kr, *rest)], 1
        )
        return grouped.reshape(t.shape)

    def to_model(self, t: torch.Tensor) -> torch.Tensor:
        """The stored ``[q_0 k_0 v_0 | ...]`` rows -> the model's ``[q; k; v]`` (a new tensor)."""
        import torch

        self._check(t)
        groups, qr, kr, rest = self.num_kv_heads, self.q_rows_per_group, self.kv_rows_per_group, tuple(t.shape[1:])
        q, k, v = t.reshape(groups, qr + 2 * kr, *rest).split([qr, kr, kr], 1)
        return torch.cat(
            [q.reshape(groups * qr, *rest), k.reshape(groups * kr, *rest), v.reshape(groups * kr, *rest)], 0
        )


def to_stored(layouts: Mapping[str, KVGroupRows], fqn: str, value: torch.Tensor) -> torch.Tensor:
    """Parameter ``fqn``'s value in the model's layout -> the layout the program reads it in."""
    rows = layouts.get(fqn)
    return value if rows is None else rows.to_stored(value)


def to_model(layouts: Mapping[str, KVGroupRows], fqn: str, value: torch.Tensor) -> torch.Tensor:
    """Parameter ``fqn``'s value in the program's layout -> the model's own layout."""
    rows = layouts.get(fqn)
    return value if rows is None else rows.to_model(value)


def layout_text(rows: KVGroupRows | None) -> str:
    """How a parameter's rows are ordered, in words (messages, plan text)."""
    if rows is None:
        return "in the model's order"
    return f"grouped by key/value head ({rows.num_kv_heads} groups of {rows.q_rows_per_group} query + 2x{rows.kv_rows_per_group} key/value rows)"


def layouts_to_json(layouts: Mapping[str, KVGroupRows]) -> dict[str, list[int]]:
    """``{fqn: [num_kv_heads, q_rows_per_group, kv_rows_per_group]}`` (a checkpoint records it)."""
    return {fqn: [r.num_kv_heads, r.q_rows_per_group, r.kv_rows_per_group] for fqn, r in sorted(layouts.items())}


def layouts_from_json(data: Mapping[str, Sequence[int]]) -> dict[str, KVGroupRows]:
    """The inverse of :func:`layouts_to_json`."""
    return {str(fqn): KVGroupRows(*(int(x) for x in v)) for fqn, v in data.items()}
