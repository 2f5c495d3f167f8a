"""The losses, as pure functions of L2-normalised embeddings.

The zero-shot classifier scores an utterance against its candidate intents' name embeddings by cosine
similarity times a fixed `scale` (the text analogue of CLIP's logit scale).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def intent_logits(emb: torch.Tensor, names: torch.Tensor, *, scale: float) -> torch.Tensor:
    """[B, C] scaled cosine similarities of utterance embeddings [B, D] and intent-name embeddings [C, D]."""
    return scale * emb @ names.T


def task_loss(
    emb: torch.Tensor,
    names: torch.Tensor,
    labels: torch.Tensor,
    *,
    scale: float,
    label_smoothing: float,
    candidates: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy over intent names; `candidates` [B, C] (bool) restricts each row's classes."""
    logits = intent_logits(emb, names, scale=scale)
    if candidates is not None:
        logits = logits.masked_fill(~candidates, float("-inf"))
        # label smoothing must not put mass on masked classes: renormalise over each row's candidates
        k = candidates.sum(-1, keepdim=True).to(logits.dtype)
        target = candidates.to(logits.dtype) * (label_smoothing / k)
        target = target.scatter_add(-1, labels[:, None], torch.full_like(target[:, :1], 1 - label_smoothing))
        return -(target * logits.log_softmax(-1).masked_fill(~candidates, 0.0)).sum(-1).mean()
    return F.cross_entropy(logits, labels, label_smoothing=label_smoothing)


def soft_cross_entropy(teacher: torch.Tensor, student: torch.Tensor, *, temperature: float) -> torch.Tensor:
    """T^2 * CE(softmax(teacher/T), log_softmax(student/T)), averaged over rows (Hinton et al.)."""
    p = (teacher / temperature).softmax(-1)
    return -(p * (student / temperature).log_softmax(-1)).sum(-1).mean() * temperature**2


def distill_loss(
    student: torch.Tensor, teacher: torch.Tensor, anchors: torch.Tensor, *, scale: float, temperature: float
) -> torch.Tensor:
    """ZSCL's feature distillation in both directions.

    `student` and `teacher` [B, D] embed the same reference batch; both are scored against `anchors` [A, D]
    (the teacher's embeddings of reference texts). Rows: each input's distribution over anchors; columns:
    each anchor's distribution over inputs.
    """
    s = intent_logits(student, anchors, scale=scale)
    t = intent_logits(teacher, anchors, scale=scale)
    rows = soft_cross_entropy(t, s, temperature=temperature)
    cols = soft_cross_entropy(t.T, s.T, temperature=temperature)
    return rows + cols
