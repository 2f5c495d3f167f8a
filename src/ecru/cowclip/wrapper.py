"""`CowClip`: applies L2 and the per-id clip to registered embedding tables between backward and step.

    loss.backward()
    clipper.clip_(ids)      # ids looked up in this batch (global ids of the tables), or their UniqueIds
    optimizer.step()

Two update modes:
- "full" (faithful to the reference code): the L2 gradient `weight_decay * W` of the whole table is added
  to the (dense) gradient before clipping, so every row decays every step and the optimizer touches the
  whole table.
- "sparse" (row-sparse, fast): the gradient must be sparse (`nn.Embedding(sparse=True)`); L2 is added to
  the rows present in the batch only, and a row-sparse optimizer (`ecru.cowclip.RowSparseAdam`) updates only
  those rows (and, with its catch-up, continues Adam's momentum on the absent ones as dense Adam does). Absent
  rows get no L2 term: the one change of semantics left, measured in bench/ctr_scaling.py.

First-order (dim-1) tables get the L2 term but are never clipped; dense layers are not registered here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from ecru.cowclip.clip import Threshold, check_threshold, clip_scale
from ecru.cowclip.ids import UniqueIds, coalesce, per_table

Mode = Literal["full", "sparse"]
# log10(||g|| / threshold) histogram: the clip fires above 0
_BINS = torch.linspace(-8.0, 4.0, 121)


@dataclass(frozen=True)
class ClipStats:
    """What the clip did since the last reset."""

    rows: int
    """Embedding rows (id, step) seen with a nonzero count."""
    clipped: int
    """Of those, rows whose gradient was scaled down."""
    ratio_quantiles: dict[str, float]
    """Quantiles (p50, p90, p99, max) of ||g|| / threshold; the clip fires where it exceeds 1."""

    @property
    def clipped_fraction(self) -> float:
        return self.clipped / self.rows if self.rows else 0.0


class CowClip:
    """Per-id adaptive clipping (plus the tables' L2 term) of registered embedding tables."""

    def __init__(
        self,
        tables: Iterable[nn.Parameter],
        *,
        weight_decay: float = 0.0,
        r: float = 1.0,
        zeta: float = 1e-5,
        mode: Mode = "full",
        clip: bool = True,
        threshold: Threshold = "code",
    ) -> None:
        """`weight_decay` is PyTorch's (Keras `l2(lambda)` is `weight_decay = 2 * lambda`); `clip=False` keeps
        only the L2 term (the unclipped baseline through the same code path)."""
        check_threshold(threshold)  # zeta has one form (ecru.cowclip.clip)
        self.tables = list(tables)
        if not self.tables or any(t.dim() != 2 for t in self.tables):
            raise ValueError("CowClip needs one or more embedding tables of shape [V, d]")
        if mode not in ("full", "sparse"):
            raise ValueError(f"mode must be 'full' or 'sparse', got {mode!r}")
        if weight_decay < 0 or r <= 0 or zeta < 0:
            raise ValueError("weight_decay and zeta must be >= 0 and r > 0")
        self.weight_decay, self.r, self.zeta = weight_decay, r, zeta
        self.mode, self.clip = mode, clip
        self.reset_stats()

    @property
    def needs_ids(self) -> bool:
        """Whether `clip_` reads the batch's ids (the sparse mode's merge, the clip's counts)."""
        return self.mode == "sparse" or self.clip

    def reset_stats(self) -> None:
        self._rows, self._clipped, self._max = 0, 0, 0.0
        self._hist = torch.zeros(len(_BINS) + 1, dtype=torch.long)

    def state_dict(self) -> dict:
        """The running statistics (what `stats` reports), for a checkpoint: a resumed run's `stats` then cover the
        whole run. The clip itself holds no state."""
        return {"rows": self._rows, "clipped": self._clipped, "max": self._max, "hist": self._hist.clone()}

    def load_state_dict(self, state: dict) -> None:
        hist = torch.as_tensor(state["hist"], dtype=torch.long)
        if hist.shape != self._hist.shape:
            raise ValueError(f"clip statistics of {hist.numel()} bins, not {self._hist.numel()}")
        self._rows, self._clipped, self._max = int(state["rows"]), int(state["clipped"]), float(state["max"])
        self._hist = hist.clone()

    @torch.no_grad()
    def clip_(self, ids: Tensor | UniqueIds | Sequence[Tensor | UniqueIds]) -> None:
        """Replace each table's `.grad` by its L2-augmented, clipped gradient (a dense `.grad` is changed in
        place: it is the backward's own buffer, and a full-table copy would cost more than the L2 add).

        `ids`: one tensor `[B]` or `[B, L]` (padded with -1) shared by every table, or one per table; or
        their `UniqueIds` (the training step sorts the batch's ids once for the optimizer and the clip).
        """
        if not self.needs_ids:  # the faithful L2 alone reads no ids: nothing to sort
            for table in self.tables:
                if table.grad is not None:
                    table.grad = self._full(table, None)
            return
        for table, table_ids in zip(self.tables, per_table(ids, len(self.tables)), strict=True):
            if table.grad is not None:
                table_ids = table_ids.to(table.device)
                table_ids.check(table.shape[0])
                table.grad = (
                    self._full(table, table_ids) if self.mode == "full" else self._sparse(table, table_ids)
                )

    def _full(self, table: nn.Parameter, ids: UniqueIds | None) -> Tensor:
        grad = table.grad.to_dense() if table.grad.is_sparse else table.grad
        if self.weight_decay:
            grad.add_(table, alpha=self.weight_decay)  # as torch.optim.Adam(weight_decay=...) does
        if not self.clip or table.shape[1] == 1:
            return grad
        uniq = ids.values
        scale = self._scale(grad[uniq], table[uniq], ids.counts)
        grad[uniq] = grad[uniq] * scale[:, None]
        return grad

    def _sparse(self, table: nn.Parameter, ids: UniqueIds) -> Tensor:
        if not table.grad.is_sparse:
            raise ValueError(
                "mode='sparse' needs sparse gradients: build the table with nn.Embedding(sparse=True)"
            )
        grad = coalesce(table.grad, ids)  # one row per id of the batch: ids.values, counted by ids.counts
        values = grad._values()
        weight = table.index_select(0, ids.values)
        if self.weight_decay:
            values = values.add(weight, alpha=self.weight_decay)
        if self.clip and table.shape[1] > 1:
            values = values * self._scale(values, weight, ids.counts)[:, None]
        return torch.sparse_coo_tensor(
            grad._indices(), values, grad.shape, is_coalesced=True, check_invariants=False
        )

    def _scale(self, grad_rows: Tensor, weight_rows: Tensor, counts: Tensor) -> Tensor:
        scale, ratio = clip_scale(grad_rows, weight_rows, counts, r=self.r, zeta=self.zeta)
        seen = ratio[counts > 0].float().cpu()
        self._rows += seen.numel()
        self._clipped += int((scale < 1).sum())
        if seen.numel():
            self._max = max(self._max, float(seen.max()))
            self._hist += torch.bincount(
                torch.bucketize(seen.clamp_min(1e-30).log10(), _BINS), minlength=len(_BINS) + 1
            )
        return scale

    def stats(self) -> ClipStats:
        """Clipped fraction and ||g|| / threshold quantiles (from a log10 histogram, 0.1-decade bins)."""
        quantiles = {"max": self._max}
        if self._rows:
            cum = self._hist.cumsum(0).double() / self._rows
            # bin i holds log10 ratios in (_BINS[i-1], _BINS[i]]: report its middle (the two open-ended
            # outer bins report their boundary), within half a bin (a factor 10**0.05) of the exact value
            mid = (torch.cat([_BINS[:1], _BINS]) + torch.cat([_BINS, _BINS[-1:]])) / 2
            for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
                quantiles[name] = float(10 ** mid[int(torch.searchsorted(cum, q))])
        return ClipStats(self._rows, self._clipped, quantiles)
