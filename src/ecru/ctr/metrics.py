"""AUC, group AUC and logloss of predicted click probabilities."""

from __future__ import annotations

import torch
from torch import Tensor


def auc(labels: Tensor, scores: Tensor) -> float:
    """Area under the ROC curve (ties count one half), by the rank-sum (Mann-Whitney) formula."""
    labels, scores = labels.double().flatten(), scores.double().flatten()
    n_pos = labels.sum()
    n_neg = labels.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUC needs both positive and negative labels")
    order = scores.argsort()
    s = scores[order]
    ranks = torch.empty_like(s)
    ranks[order] = torch.arange(1, s.numel() + 1, dtype=torch.float64)
    # average the ranks of tied scores
    uniq, inverse, counts = torch.unique(s, return_inverse=True, return_counts=True)
    if uniq.numel() < s.numel():
        sums = torch.zeros_like(uniq).index_add_(
            0, inverse, torch.arange(1, s.numel() + 1, dtype=torch.float64)
        )
        ranks[order] = (sums / counts)[inverse]
    return float((ranks[labels > 0].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def logloss(labels: Tensor, probs: Tensor, *, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities (clamped to [eps, 1 - eps])."""
    p = probs.double().clamp(eps, 1 - eps)
    y = labels.double()
    return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())


def group_auc(labels: Tensor, scores: Tensor, groups: Tensor) -> float:
    """Group AUC (GAUC, as in DIN, Zhou et al. 2018): the AUC within each group (e.g. a user), averaged with
    weights = the group's number of rows, over the groups that have both a click and a non-click."""
    labels, scores, groups = labels.flatten(), scores.flatten(), groups.flatten()
    order = torch.argsort(groups, stable=True)
    _, counts = torch.unique_consecutive(groups[order], return_counts=True)
    total, weight = 0.0, 0
    for idx in torch.split(order, counts.tolist()):
        y = labels[idx]
        positives = int((y > 0).sum())
        if 0 < positives < len(idx):
            total += len(idx) * auc(y, scores[idx])
            weight += len(idx)
    if not weight:
        raise ValueError("group AUC needs a group with both positive and negative labels")
    return total / weight
