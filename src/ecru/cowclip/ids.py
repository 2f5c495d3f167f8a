"""`UniqueIds`: a batch's distinct embedding ids, sorted once per step and shared by everything that needs them.

A CTR step needs the batch's distinct ids three times: `RowSparseAdam.catch_up` (the rows to bring up to
date), CowClip's merge of a sparse gradient into one row per id, and CowClip's per-id sample counts. Sorting
the ids is the costly part of each (~1 ms for 26K ids on a CPU core, against a ~20 ms step), so the step
builds one `UniqueIds` and passes it to both:

    ids = UniqueIds.of(model.tables.global_ids(cats))
    optimizer.catch_up(ids); loss.backward(); clipper.clip_(ids); optimizer.step()
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class UniqueIds:
    """The ids looked up by one batch (`[B]`, or `[B, L]` padded with -1) and their distinct values."""

    ids: Tensor
    """The ids >= 0, flattened in order `[N]`: the row indices of the tables' sparse gradients."""
    values: Tensor
    """The distinct ids, ascending `[U]`."""
    inverse: Tensor
    """The position in `values` of each of `ids` `[N]`."""
    counts: Tensor
    """The number of samples (rows of the batch) containing each value `[U]`; an id repeated inside one
    sample counts once."""

    @classmethod
    def of(cls, ids: Tensor) -> UniqueIds:
        """One sort of the batch's ids (`[B]`, or `[B, L]` with -1 for padding)."""
        if ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"ids must be an integer tensor, got {ids.dtype}")
        if ids.dim() not in (1, 2):
            raise ValueError(f"ids must have shape [B] or [B, L], got {tuple(ids.shape)}")
        rows = (ids if ids.dim() == 2 else ids[:, None]).long()
        low = int(rows.min()) if rows.numel() else 0
        if low < -1:
            raise ValueError(f"ids must be >= 0 (or -1 for padding); got {low}")
        flat, first = rows.reshape(-1), _first_in_sample(rows).reshape(-1)
        if low < 0:  # padding: left out (a masked copy, skipped when there is none)
            valid = flat >= 0
            flat, first = flat[valid], first[valid]
        values, inverse = torch.unique(flat, return_inverse=True)
        counts = torch.zeros_like(values).index_add_(0, inverse, first.long())  # ~5x a masked bincount
        return cls(flat, values, inverse, counts)

    def check(self, num_rows: int) -> None:
        """Refuse ids beyond a table of `num_rows` rows."""
        if self.values.numel() and int(self.values[-1]) >= num_rows:
            raise ValueError(f"ids must lie in [0, {num_rows}); got {int(self.values[-1])}")

    def positions(self, rows: Tensor) -> Tensor:
        """The position in `values` of each of `rows`, ids of this batch in any order: `inverse` when they are
        `ids` in order (a single-hot table's sparse gradient), else a binary search."""
        if rows.shape == self.ids.shape and torch.equal(rows, self.ids):
            return self.inverse
        pos = torch.searchsorted(self.values, rows).clamp_(max=max(self.values.numel() - 1, 0))
        if rows.numel() and not torch.equal(self.values[pos], rows):
            raise ValueError("the gradient has rows that are not among the batch's ids")
        return pos

    def to(self, device: torch.device | str) -> UniqueIds:
        return UniqueIds(*(t.to(device) for t in (self.ids, self.values, self.inverse, self.counts)))


def _first_in_sample(rows: Tensor) -> Tensor:
    """`[B, L]` mask of each id's first occurrence in its sample (the sample count counts it once)."""
    if rows.shape[1] == 1:
        return torch.ones_like(rows, dtype=torch.bool)
    # sort inside each sample (L ids, cheap) so repeats are adjacent, then map the mask back to its places
    srt, perm = rows.sort(dim=1)
    first = torch.ones_like(srt, dtype=torch.bool)
    first[:, 1:] = srt[:, 1:] != srt[:, :-1]
    return torch.empty_like(first).scatter_(1, perm, first)


def per_table(ids: Tensor | UniqueIds | Sequence[Tensor | UniqueIds], n: int) -> list[UniqueIds]:
    """One `UniqueIds` for each of `n` tables: `ids` shared by every table, or one entry per table (a tensor
    given for several tables is sorted once)."""
    entries = [ids] * n if isinstance(ids, Tensor | UniqueIds) else list(ids)
    if len(entries) != n:
        raise ValueError(f"got {len(entries)} id tensors for {n} tables")
    made: dict[int, UniqueIds] = {}
    for e in entries:
        if isinstance(e, Tensor) and id(e) not in made:
            made[id(e)] = UniqueIds.of(e)
    return [made[id(e)] if isinstance(e, Tensor) else e for e in entries]


def coalesce(grad: Tensor, ids: UniqueIds) -> Tensor:
    """A sparse gradient whose rows are ids of this batch, merged into one row per id (`ids.values`, in order)
    by an index_add over the shared sort: `grad.coalesce()` without sorting again."""
    values = grad._values()
    summed = values.new_zeros((ids.values.numel(), *values.shape[1:]))
    # accumulates in the rows' order, as index_add_ does, and is ~20% faster on [N, d] rows on a CPU
    summed.index_put_((ids.positions(grad._indices()[0]),), values, accumulate=True)
    return torch.sparse_coo_tensor(
        ids.values[None], summed, grad.shape, is_coalesced=True, check_invariants=False
    )
