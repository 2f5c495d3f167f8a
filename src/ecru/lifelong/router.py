"""Which learned task a text resembles, if any: the routing of `ecru`'s per-task adapters.

The idea of MoE-Adapters' Distribution Discriminative Auto-Selector (Yu et al., CVPR 2024), made
non-parametric: a task is represented by the frozen model's normalised embeddings of its own training
utterances. A text's score for a task is its mean cosine similarity to its `k` nearest training
utterances of that task; it goes to the best-scoring task if that score reaches the task's threshold, and
to the frozen model otherwise (unseen domains, held-out datasets). Each threshold is a low percentile of
the task's own training utterances' leave-one-out scores, so fitting needs that task's training data only.
Given negatives (texts of no learned task, e.g. the reference sentences), the threshold may go lower:
down to a high quantile of the negatives' scores, so that nearly all of the task's own texts pass while
almost no negative does. A caller that knows more (the text's candidate labels are those of some learned
tasks only) restricts the choice to those tasks and drops the threshold.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

FROZEN = -1
"""The route of a text that resembles no learned task: the frozen pretrained model."""


def knn_scores(
    queries: torch.Tensor, keys: torch.Tensor, *, k: int, exclude_self: bool = False
) -> torch.Tensor:
    """Mean cosine similarity [Q] of each query [Q, D] to its `k` nearest keys [N, D] (all L2-normalised).

    `exclude_self` (queries == keys) leaves each key out of its own neighbours (leave-one-out scores).
    """
    if keys.shape[0] < 1 + int(exclude_self):
        raise ValueError(
            f"knn_scores needs at least {1 + int(exclude_self)} keys, got {keys.shape[0]}: "
            "a task needs two or more training utterances to set its routing threshold"
        )
    sim = queries @ keys.T
    if exclude_self:
        sim = sim.fill_diagonal_(float("-inf"))
    k = min(k, keys.shape[0] - int(exclude_self))
    return sim.topk(k, dim=-1).values.mean(-1)


def route(scores: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """Routes [Q] from task scores [Q, T] and per-task thresholds [T]: the best task, or `FROZEN` if its
    score is below that task's threshold."""
    best, task = scores.max(-1)
    return torch.where(best >= thresholds[task], task, torch.full_like(task, FROZEN))


class Router:
    """Per-task frozen embeddings of training utterances and a threshold per task."""

    def __init__(self, *, k: int, percentile: float, negative_quantile: float | None = None):
        self.k, self.percentile, self.negative_quantile = k, percentile, negative_quantile
        self.keys: list[torch.Tensor] = []
        self.thresholds: list[float] = []

    def add_task(self, train_emb: torch.Tensor, negatives: torch.Tensor | None = None) -> None:
        """Register the next task from the frozen embeddings [N, D] of its training utterances.

        Threshold: the `percentile` of their leave-one-out scores; with `negative_quantile` and
        `negatives` [M, D], the lower of that and the `negative_quantile` of the negatives' scores.
        """
        loo = knn_scores(train_emb, train_emb, k=self.k, exclude_self=True)
        threshold = torch.quantile(loo, self.percentile / 100).item()
        if self.negative_quantile is not None:
            if negatives is None:
                raise ValueError("negative_quantile is set: add_task needs the negatives' embeddings")
            neg = knn_scores(negatives.to(train_emb.dtype), train_emb, k=self.k)
            threshold = min(threshold, torch.quantile(neg, self.negative_quantile).item())
        self.keys.append(train_emb.detach().clone())
        self.thresholds.append(threshold)

    def scores(self, emb: torch.Tensor, tasks: Sequence[int]) -> torch.Tensor:
        """[Q, len(tasks)] scores of frozen embeddings `emb` [Q, D] for the learned `tasks`."""
        return torch.stack([knn_scores(emb, self.keys[t], k=self.k) for t in tasks], dim=-1)

    def __call__(
        self, emb: torch.Tensor, *, tasks: Sequence[int] | None = None, open_set: bool = True
    ) -> torch.Tensor:
        """Route [Q] (a task index or `FROZEN`) of each frozen embedding in `emb` [Q, D].

        `tasks`: the learned tasks to choose among (default: all). `open_set=False`: the text is known to
        belong to one of them, so it goes to the best-scoring one whatever its score (no threshold).
        """
        tasks = list(range(len(self.keys))) if tasks is None else list(tasks)
        if not tasks:
            return torch.full((emb.shape[0],), FROZEN, dtype=torch.long)
        if not all(0 <= t < len(self.keys) for t in tasks):
            raise ValueError(f"tasks {tasks} must be learned ones (0..{len(self.keys) - 1})")
        scores = self.scores(emb, tasks)
        if open_set:
            thresholds = torch.tensor([self.thresholds[t] for t in tasks], dtype=emb.dtype, device=emb.device)
        else:
            thresholds = torch.full((len(tasks),), float("-inf"), dtype=emb.dtype, device=emb.device)
        picked = route(scores, thresholds)
        index = torch.tensor(tasks, dtype=torch.long, device=emb.device)
        return torch.where(picked == FROZEN, picked, index[picked.clamp(min=0)])

    def state_dict(self) -> dict[str, Any]:
        return {"keys": list(self.keys), "thresholds": list(self.thresholds)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.keys, self.thresholds = list(state["keys"]), list(state["thresholds"])
