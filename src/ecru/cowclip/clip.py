"""Adaptive column-wise clipping (CowClip) of one embedding table's gradient, as a pure function.

For every id k looked up in the batch: cnt_k = number of samples containing k, threshold

    clip_k = cnt_k * r * max(||w_k||, r * sqrt(d) * zeta),

and the gradient row g_k is scaled by min(1, clip_k / ||g_k||). This is the reference code's form, in which
the paper's tables give zeta (1e-5 on Criteo), and the only form ecru uses: zeta is per coordinate of a
dimension-d row. The paper's Algorithm 1 writes the floor as cnt_k * max(r ||w_k||, zeta_paper); the two
agree for zeta_paper = r^2 sqrt(d) zeta (`zeta_from_paper` converts).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from ecru.cowclip.ids import UniqueIds

Threshold = Literal["code"]
"""The one form of zeta (named at call sites, `threshold="code"`, so that the form is never implicit)."""


def zeta_from_paper(zeta_paper: float, *, r: float, dim: int) -> float:
    """The zeta of ecru's (the reference code's) form for a floor given in the paper's form."""
    return zeta_paper / (r * r * math.sqrt(dim))


def check_threshold(threshold: str) -> None:
    if threshold != "code":
        raise ValueError(
            f"threshold {threshold!r}: zeta is given in the reference code's form only (threshold='code'); "
            "convert a floor in the paper's form with zeta_from_paper(zeta, r=r, dim=d)"
        )


def clip_scale(
    grad_rows: Tensor,
    weight_rows: Tensor,
    counts: Tensor,
    *,
    r: float = 1.0,
    zeta: float = 1e-5,
) -> tuple[Tensor, Tensor]:
    """Per-row scale min(1, clip / ||g||) and the ratio ||g|| / clip (0 where the count is 0).

    A row with count 0 (an id absent from the batch) or a zero gradient gets scale exactly 1.
    """
    gnorm = torch.linalg.vector_norm(grad_rows, dim=1)
    wnorm = torch.linalg.vector_norm(weight_rows, dim=1)
    cnt = counts.to(grad_rows.dtype)
    clip = cnt * r * torch.clamp(wnorm, min=r * math.sqrt(grad_rows.shape[1]) * zeta)
    active = (cnt > 0) & (gnorm > clip)
    ratio = torch.where(cnt > 0, gnorm / torch.where(cnt > 0, clip, 1.0), 0.0)
    scale = torch.where(active, clip / torch.where(active, gnorm, 1.0), 1.0)
    return scale, ratio


def _row_counts(rows: Tensor, uniq: Tensor, counts: Tensor) -> Tensor:
    """The sample count of each of `rows` (0 for rows whose id is not in `uniq`)."""
    if uniq.numel() == 0:
        return torch.zeros_like(rows)
    pos = torch.searchsorted(uniq, rows).clamp(max=uniq.numel() - 1)
    return torch.where(uniq[pos] == rows, counts[pos], 0)


def cowclip(
    grad: Tensor,
    weight: Tensor,
    ids: Tensor | UniqueIds,
    *,
    r: float = 1.0,
    zeta: float = 1e-5,
    threshold: Threshold = "code",
) -> Tensor:
    """The CowClip-clipped gradient of one embedding table (a new tensor).

    Args:
        grad: the batch-mean gradient, dense `[V, d]` or sparse COO `[V, d]` with one row per occurrence
            (as `nn.Embedding(sparse=True)` produces); a sparse input gives a coalesced sparse output.
        weight: the table `[V, d]`.
        ids: the ids looked up in this batch for this table, `[B]` or `[B, L]` padded with -1 (or their
            `UniqueIds`).
        r: the ratio of the threshold to the row's weight norm.
        zeta: the per-coordinate floor: clip = cnt * r * max(||w||, r sqrt(d) zeta) (module docstring).
        threshold: the form of zeta; "code" is the only one (the paper's converts with `zeta_from_paper`).

    Rows of ids absent from `ids` are returned unchanged; a zero row stays zero.
    """
    check_threshold(threshold)
    if grad.shape != weight.shape or grad.dim() != 2:
        raise ValueError(f"grad {tuple(grad.shape)} and weight {tuple(weight.shape)} must both be [V, d]")
    unique = (ids if isinstance(ids, UniqueIds) else UniqueIds.of(ids)).to(weight.device)
    unique.check(weight.shape[0])
    uniq, counts = unique.values, unique.counts
    if grad.is_sparse:
        g = grad.coalesce()
        rows, values = g.indices()[0], g.values()
        scale, _ = clip_scale(values, weight[rows], _row_counts(rows, uniq, counts), r=r, zeta=zeta)
        return torch.sparse_coo_tensor(
            g.indices(), values * scale[:, None], g.shape, is_coalesced=True, check_invariants=False
        )
    scale, _ = clip_scale(grad[uniq], weight[uniq], counts, r=r, zeta=zeta)
    out = grad.clone()
    out[uniq] = grad[uniq] * scale[:, None]
    return out
