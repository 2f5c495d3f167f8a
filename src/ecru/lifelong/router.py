"""Which learned task a text resembles, if any: the routing of `routed-lora`'s per-task adapters.

Two routers behind one protocol (`TaskRouter`). `PrototypeRouter` (the default) keeps one prototype per
class: the normalised mean of the frozen embeddings of that class's training texts; a text's score for a
task is its best cosine similarity to that task's prototypes (nearest class mean, per task), and its
threshold a low percentile of the task's own training texts' leave-one-out scores. It stores C x D floats
per task instead of N x D. `Router` (k nearest training texts) is the earlier design, kept as a baseline.

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
from typing import Any, Protocol

import torch

from ecru.errors import EcruError

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


def class_prototypes(emb: torch.Tensor, labels: torch.Tensor, classes: int) -> torch.Tensor:
    """Normalised mean [classes, D] of the embeddings `emb` [N, D] of each class (`labels` [N] in 0..classes-1)."""
    sums = torch.zeros(classes, emb.shape[1], dtype=emb.dtype).index_add_(0, labels, emb)
    return torch.nn.functional.normalize(sums, dim=-1)


def prototype_scores(queries: torch.Tensor, prototypes: torch.Tensor) -> torch.Tensor:
    """Best cosine similarity [Q] of each query [Q, D] to the prototypes [C, D] (all L2-normalised)."""
    return (queries @ prototypes.T).max(-1).values


def loo_prototype_scores(emb: torch.Tensor, labels: torch.Tensor, classes: int) -> torch.Tensor:
    """Each training text's score [N] against its task's prototypes, its own class's mean taken without it
    (leave-one-out; a class of one text leaves only the other classes)."""
    sums = torch.zeros(classes, emb.shape[1], dtype=emb.dtype).index_add_(0, labels, emb)
    counts = torch.bincount(labels, minlength=classes)
    sim = emb @ torch.nn.functional.normalize(sums, dim=-1).T
    own = (emb * torch.nn.functional.normalize(sums[labels] - emb, dim=-1)).sum(-1)
    own = torch.where(counts[labels] > 1, own, torch.full_like(own, float("-inf")))
    return sim.scatter(1, labels[:, None], own[:, None]).max(-1).values


class TaskRouter(Protocol):
    """Routes frozen embeddings to a learned task or `FROZEN`; tasks are added one at a time."""

    def add_task(
        self, train_emb: torch.Tensor, *, labels: torch.Tensor, negatives: torch.Tensor | None = None
    ) -> None: ...

    def __call__(
        self, emb: torch.Tensor, *, tasks: Sequence[int] | None = None, open_set: bool = True
    ) -> torch.Tensor: ...

    def admit(self, task: int, emb: torch.Tensor, *, quantile: float) -> None: ...

    def claim_margin(self, emb: torch.Tensor, *, standardise: bool = True) -> torch.Tensor: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def routing_threshold(
    own: torch.Tensor, neg: torch.Tensor | None, *, percentile: float, negative_quantile: float | None
) -> float:
    """The `percentile` of a task's own leave-one-out scores; with negatives' scores `neg`, the lower of
    that and their `negative_quantile`."""
    own = own[torch.isfinite(own)]
    if own.numel() == 0:
        raise ValueError("a task needs two or more training texts of one label to set its routing threshold")
    threshold = torch.quantile(own, percentile / 100).item()
    if negative_quantile is not None:
        if neg is None:
            raise ValueError("negative_quantile is set: add_task needs the negatives' embeddings")
        threshold = min(threshold, torch.quantile(neg, negative_quantile).item())
    return threshold


LEGACY_CLAIM_SD = 0.02
"""The claim unit of a task saved before claim statistics (`_Routing.claim_counts`), its mean being its threshold:
`claim_margin` >= -2 then claims a text when such a task's score reaches its threshold - 0.04, the former rule
(which asked it of the routed task only)."""


def pooled_stats(count: float, mean: float, sd: float, new: torch.Tensor) -> tuple[float, float, float]:
    """(count, mean, sd) of a sample of `count` values with that `mean` and (unbiased) `sd` joined by the
    finite values of `new` (Chan et al.'s pairwise update)."""
    new = new[torch.isfinite(new)].double()
    n = new.numel()
    if n == 0:
        return count, mean, sd
    m2 = sd**2 * max(count - 1, 0) + ((new - new.mean()) ** 2).sum().item()
    delta, total = new.mean().item() - mean, count + n
    m2 += delta**2 * count * n / total
    return total, mean + delta * n / total, (m2 / max(total - 1, 1)) ** 0.5


class _Routing:
    """What both routers share: a score per (text, task), a threshold per task, and per task the count, mean
    and sd of its own texts' scores (training texts' leave-one-out scores plus, after `admit`, the held-out
    texts'): the units of `claim_margin`."""

    thresholds: list[float]
    claim_counts: list[float]
    claim_means: list[float]
    claim_sds: list[float]

    def _add_claim(self, own: torch.Tensor) -> None:
        count, mean, sd = pooled_stats(0, 0.0, 0.0, own)
        self.claim_counts.append(count), self.claim_means.append(mean), self.claim_sds.append(sd)

    def _claim_state(self) -> dict[str, list[float]]:
        return {"claim_counts": list(self.claim_counts), "claim_means": list(self.claim_means),
                "claim_sds": list(self.claim_sds)}  # fmt: skip

    def _load_claim(self, state: dict[str, Any]) -> None:
        """The claim statistics of `state`; a state saved without them keeps its old claim (`LEGACY_CLAIM_SD`)."""
        n = len(self.thresholds)
        legacy = ([0.0] * n, list(self.thresholds), [LEGACY_CLAIM_SD] * n)
        keys = ("claim_counts", "claim_means", "claim_sds")
        got = [
            [float(v) for v in state[k]] if k in state else old for k, old in zip(keys, legacy, strict=True)
        ]
        self.claim_counts, self.claim_means, self.claim_sds = got

    def scores(self, emb: torch.Tensor, tasks: Sequence[int]) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.thresholds)

    def admit(self, task: int, emb: torch.Tensor, *, quantile: float) -> None:
        """Lower (never raise) `task`'s threshold to the `quantile` of its scores for the frozen embeddings
        `emb` [N, D] of its held-out texts: texts the router has not seen score lower than its own
        leave-one-out texts, so a percentile of those rejects more new texts than it says."""
        own = self.scores(emb, [task])[:, 0]
        self.thresholds[task] = min(self.thresholds[task], torch.quantile(own.double(), quantile).item())
        if self.claim_counts[task] > 0:  # a legacy task's claim stays as it was saved
            stats = (self.claim_counts[task], self.claim_means[task], self.claim_sds[task])
            self.claim_counts[task], self.claim_means[task], self.claim_sds[task] = pooled_stats(*stats, own)

    def claim_margin(self, emb: torch.Tensor, *, standardise: bool = True) -> torch.Tensor:
        """[Q] how strongly the learned tasks claim each frozen embedding: the largest over tasks of its score
        standardised by the task's own texts' scores, (score - mean) / sd (graded, so a caller can set its own
        threshold; standardised, so that one threshold means the same for a task of 40 texts and of 300).
        `standardise=False`: score - mean, in the scores' units (for a threshold set on examples instead).
        Needs a learned task."""
        scores = self.scores(emb, range(len(self))).double()
        mean, sd = (
            torch.tensor(self.claim_means, dtype=scores.dtype),
            torch.tensor(self.claim_sds, dtype=scores.dtype),
        )
        centred = scores - mean
        return (centred / sd.clamp(min=1e-6) if standardise else centred).max(-1).values

    def __call__(
        self, emb: torch.Tensor, *, tasks: Sequence[int] | None = None, open_set: bool = True
    ) -> torch.Tensor:
        """Route [Q] (a task index or `FROZEN`) of each frozen embedding in `emb` [Q, D].

        `tasks`: the learned tasks to choose among (default: all). `open_set=False`: the text is known to
        belong to one of them, so it goes to the best-scoring one whatever its score (no threshold).
        """
        tasks = list(range(len(self))) if tasks is None else list(tasks)
        if not tasks:
            return torch.full((emb.shape[0],), FROZEN, dtype=torch.long)
        if not all(0 <= t < len(self) for t in tasks):
            raise ValueError(f"tasks {tasks} must be learned ones (0..{len(self) - 1})")
        scores = self.scores(emb, tasks)
        if open_set:
            thresholds = torch.tensor([self.thresholds[t] for t in tasks], dtype=emb.dtype, device=emb.device)
        else:
            thresholds = torch.full((len(tasks),), float("-inf"), dtype=emb.dtype, device=emb.device)
        picked = route(scores, thresholds)
        index = torch.tensor(tasks, dtype=torch.long, device=emb.device)
        return torch.where(picked == FROZEN, picked, index[picked.clamp(min=0)])


class PrototypeRouter(_Routing):
    """Per-task class prototypes of the frozen embeddings and a threshold per task."""

    def __init__(self, *, percentile: float, negative_quantile: float | None = None):
        self.percentile, self.negative_quantile = percentile, negative_quantile
        self.prototypes: list[torch.Tensor] = []
        self.thresholds: list[float] = []
        self.claim_counts, self.claim_means, self.claim_sds = [], [], []

    def add_task(
        self, train_emb: torch.Tensor, *, labels: torch.Tensor, negatives: torch.Tensor | None = None
    ) -> None:
        """Register the next task from the frozen embeddings [N, D] of its training texts and their class
        indices `labels` [N]; `negatives` [M, D] (texts of no task) only with `negative_quantile`."""
        classes = int(labels.max()) + 1
        protos = class_prototypes(train_emb, labels, classes)
        own = loo_prototype_scores(train_emb, labels, classes)
        neg = None if negatives is None else prototype_scores(negatives.to(train_emb.dtype), protos)
        self.thresholds.append(
            routing_threshold(own, neg, percentile=self.percentile, negative_quantile=self.negative_quantile)
        )
        self._add_claim(own)
        self.prototypes.append(protos.detach().clone())

    def scores(self, emb: torch.Tensor, tasks: Sequence[int]) -> torch.Tensor:
        """[Q, len(tasks)] scores of frozen embeddings `emb` [Q, D] for the learned `tasks`."""
        return torch.stack([prototype_scores(emb, self.prototypes[t].to(emb.dtype)) for t in tasks], dim=-1)

    def state_dict(self) -> dict[str, Any]:
        return {
            "prototypes": list(self.prototypes),
            "thresholds": list(self.thresholds),
            **self._claim_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prototypes, self.thresholds = list(state["prototypes"]), [float(t) for t in state["thresholds"]]
        self._load_claim(state)


def ledoit_wolf(scatter: torch.Tensor, n: int, fourth: float) -> torch.Tensor:
    """Ledoit-Wolf shrunk covariance [D, D] of centred samples x_i from their scatter sum_i x_i x_i^T [D, D],
    their number `n` and `fourth` = sum_i |x_i|^4: (1 - a) S + a (tr S / D) I with S = scatter / n and
    a = min(1, b2 / d2), b2 = (sum_i |x_i x_i^T - S|_F^2) / n^2 = (fourth - n |S|_F^2) / n^2, d2 = |S - (tr S / D) I|_F^2
    (Ledoit and Wolf, 2004; sklearn.covariance.LedoitWolf on the same samples, centred)."""
    dim = scatter.shape[0]
    cov = scatter / n
    target = torch.eye(dim, dtype=cov.dtype) * cov.trace() / dim
    d2 = ((cov - target) ** 2).sum()
    b2 = ((fourth - n * (cov**2).sum()) / n**2).clamp(min=0)
    a = torch.clamp(b2 / d2, max=1.0) if d2 > 0 else torch.tensor(1.0, dtype=cov.dtype)
    return (1 - a) * cov + a * target


def lda_head(means: torch.Tensor, cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [C, D] and biases [C] of linear discriminant analysis with class means [C, D] and a shared
    covariance [D, D] (equal priors): logit_c(x) = x . S^-1 mu_c - mu_c . S^-1 mu_c / 2."""
    weight = torch.linalg.solve(cov, means.T).T
    return weight, -0.5 * (weight * means).sum(-1)


RIDGE = 1e-6
"""Added to the shrunk covariance's diagonal so that it stays invertible when every class's texts coincide
(unit-norm embeddings spread about 1 / D = 2.6e-3 per dimension for MiniLM)."""


def class_statistics(
    emb: torch.Tensor, labels: torch.Tensor, classes: int
) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """What streaming LDA keeps of one task's embeddings `emb` [N, D] with class indices `labels` [N]: the class
    means [classes, D] and the within-class scatter sum_i x_i x_i^T [D, D] of the centred x_i = emb_i - mu_label
    (float32, computed in float64), their number N and sum_i |x_i|^4 (the Ledoit-Wolf shrinkage needs it)."""
    emb = emb.detach().double()
    sums = torch.zeros(classes, emb.shape[1], dtype=emb.dtype).index_add_(0, labels, emb)
    means = sums / torch.bincount(labels, minlength=classes).clamp(min=1)[:, None]
    centred = emb - means[labels]
    return (
        means.float(),
        (centred.T @ centred).float(),
        int(emb.shape[0]),
        float((centred.norm(dim=-1) ** 4).sum()),
    )


def pooled_lda_head(
    means: Sequence[torch.Tensor],
    scatters: Sequence[torch.Tensor],
    counts: Sequence[int],
    fourths: Sequence[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """LDA weights [C, D] and biases [C] (float64) over every task's classes (`means` concatenated in order)
    from the tasks' `class_statistics`: the scatter pooled over tasks, shrunk (`ledoit_wolf`), plus `RIDGE` on
    the diagonal (texts repeated verbatim have no spread), then `lda_head`."""
    cov = shrunk_covariance(sum(s.double() for s in scatters), sum(counts), sum(fourths))
    return lda_head(torch.cat(list(means)).double(), cov)


def shrunk_covariance(scatter: torch.Tensor, n: int, fourth: float) -> torch.Tensor:
    """`ledoit_wolf` of a float64 scatter plus `RIDGE` on the diagonal: always invertible."""
    cov = ledoit_wolf(scatter, n, fourth)
    return cov + RIDGE * torch.eye(cov.shape[0], dtype=cov.dtype)


def relative_mahalanobis_head(
    means: torch.Tensor, scatter: torch.Tensor, n: int, fourth: float, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One task's relative Mahalanobis detector (Ren et al., 2021) from its `class_statistics` and texts per
    class `counts` [C]: the class means [C, D] with the precision [D, D] of the shrunk within-class covariance
    (`ledoit_wolf` + `RIDGE`), and the task's background Gaussian: the mean [1, D] of its texts with the
    precision of the within-class plus between-class covariance (float64)."""
    means, counts = means.double(), counts.double()
    within = shrunk_covariance(scatter.double(), n, fourth)
    centre = (counts[:, None] * means).sum(0, keepdim=True) / counts.sum()
    spread = means - centre
    between = (spread.T * counts) @ spread / counts.sum()
    return means, torch.linalg.inv(within), centre, torch.linalg.inv(within + between)


def squared_mahalanobis(emb: torch.Tensor, means: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    """[Q, C] squared Mahalanobis distances of `emb` [Q, D] to `means` [C, D] under `precision` [D, D]."""
    xp = emb @ precision
    return (xp * emb).sum(-1, keepdim=True) - 2 * xp @ means.T + ((means @ precision) * means).sum(-1)[None]


def relative_mahalanobis(emb: torch.Tensor, head: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """[Q] how much closer each text is to its nearest class of the task than to the task's background:
    the background's squared Mahalanobis distance minus the nearest class's (higher = more the task's own)."""
    means, precision, centre, background = head
    emb = emb.double()
    nearest = squared_mahalanobis(emb, means, precision).min(-1).values
    return squared_mahalanobis(emb, centre, background)[:, 0] - nearest


def halves(emb: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[N] fold 0 or 1 of each text: within each class, the texts in the order of a fixed random projection of
    their embeddings, alternately (stratified by class, and the same whatever order the texts come in)."""
    direction = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    order = torch.argsort(emb.double() @ direction, stable=True)
    fold = torch.empty(len(emb), dtype=torch.long)
    for c in labels.unique():
        members = order[labels[order] == c]
        fold[members] = torch.arange(len(members)) % 2
    return fold


def cross_fitted_relative_mahalanobis(emb: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[N] each training text's `relative_mahalanobis` under a detector fitted on the other half of the task's
    texts (`halves`), over the classes present there: scores of texts the detector has not seen (in-sample
    scores are far too optimistic in 384-d). A half-size detector is the weaker one, so a percentile of these
    scores rejects fewer new texts than it says, the fewer texts per class the fewer: with a handful per
    class the test rejects nothing. A text whose other half is empty (a task of one text per class) scores -inf."""
    fold = halves(emb, labels)
    out = torch.full((len(emb),), float("-inf"), dtype=torch.float64)
    for f in (0, 1):
        fit, held = fold != f, fold == f
        if fit.any() and held.any():
            present, local = labels[fit].unique(return_inverse=True)
            stats = class_statistics(emb[fit], local, len(present))
            head = relative_mahalanobis_head(*stats, torch.bincount(local, minlength=len(present)))
            out[held] = relative_mahalanobis(emb[held], head)
    return out


def rmd_threshold(own: torch.Tensor, percentile: float) -> float:
    """The `percentile` of cross-fitted scores `own`, over the finite ones; -inf (never rejects) if none is."""
    own = own[torch.isfinite(own)]
    return torch.quantile(own, percentile / 100).item() if own.numel() else float("-inf")


class LDARouter(PrototypeRouter):
    """Streaming LDA over the frozen embeddings (as SLDA, Hayes and Kanan, CVPR-W 2020): per task the class
    means, the within-class scatter and its count; the covariance is pooled over every learned task and shrunk
    (Ledoit-Wolf), so the decision between tasks sees how all of them spread. A text goes to the task of its
    best class by LDA logit. Whether it belongs to any learned task at all is the prototype test of
    `PrototypeRouter` (that task's best prototype cosine against that task's threshold) and, with
    `rmd_percentile`, also that task's relative Mahalanobis test: its `relative_mahalanobis` score against
    the `rmd_percentile` of its training texts' cross-fitted scores (both must pass). The detector comes from
    the statistics LDA keeps plus the texts per class (`class_counts`), so it costs C floats per task."""

    def __init__(
        self,
        *,
        percentile: float,
        negative_quantile: float | None = None,
        rmd_percentile: float | None = None,
    ):
        super().__init__(percentile=percentile, negative_quantile=negative_quantile)
        self.rmd_percentile = rmd_percentile
        self.means: list[torch.Tensor] = []
        self.scatters: list[torch.Tensor] = []
        self.counts: list[int] = []
        self.fourths: list[float] = []
        self.class_counts: list[torch.Tensor] = []
        self.rmd_thresholds: list[float] = []
        self._head: tuple[torch.Tensor, torch.Tensor, list[int]] | None = None
        self._rmd: dict[int, tuple[torch.Tensor, ...]] = {}

    def add_task(
        self, train_emb: torch.Tensor, *, labels: torch.Tensor, negatives: torch.Tensor | None = None
    ) -> None:
        super().add_task(train_emb, labels=labels, negatives=negatives)
        means, scatter, count, fourth = class_statistics(train_emb, labels, int(labels.max()) + 1)
        self.means.append(means)
        self.scatters.append(scatter)
        self.counts.append(count)
        self.fourths.append(fourth)
        self._head = None
        if self.rmd_percentile is not None:
            own = cross_fitted_relative_mahalanobis(train_emb, labels)
            self.class_counts.append(torch.bincount(labels, minlength=means.shape[0]).float())
            self.rmd_thresholds.append(rmd_threshold(own, self.rmd_percentile))

    def admit(self, task: int, emb: torch.Tensor, *, quantile: float) -> None:
        """`_Routing.admit` for the prototype test and, with `rmd_percentile`, the relative Mahalanobis test."""
        super().admit(task, emb, quantile=quantile)
        if self.rmd_percentile is not None:
            own = torch.quantile(self.rmd_scores(emb, task), quantile).item()
            self.rmd_thresholds[task] = min(self.rmd_thresholds[task], own)

    def rmd_scores(self, emb: torch.Tensor, task: int) -> torch.Tensor:
        """[Q] task `task`'s relative Mahalanobis scores of frozen embeddings `emb` [Q, D] (detector cached)."""
        if task not in self._rmd:
            stats = (self.means[task], self.scatters[task], self.counts[task], self.fourths[task])
            self._rmd[task] = relative_mahalanobis_head(*stats, self.class_counts[task])
        return relative_mahalanobis(emb, self._rmd[task])

    def head(self) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """LDA weights [C, D] and biases [C] over every learned class, and each class's task (cached)."""
        if self._head is None:
            weight, bias = pooled_lda_head(self.means, self.scatters, self.counts, self.fourths)
            owner = [t for t, m in enumerate(self.means) for _ in range(m.shape[0])]
            self._head = (weight.float(), bias.float(), owner)
        return self._head

    def logits(self, emb: torch.Tensor, task: int) -> torch.Tensor:
        """[Q, C_task] LDA logits of frozen embeddings `emb` [Q, D] for task `task`'s classes."""
        weight, bias, owner = self.head()
        cols = [c for c, t in enumerate(owner) if t == task]
        return emb @ weight[cols].T.to(emb.dtype) + bias[cols].to(emb.dtype)

    def __call__(
        self, emb: torch.Tensor, *, tasks: Sequence[int] | None = None, open_set: bool = True
    ) -> torch.Tensor:
        """Route [Q]: the task of the best LDA class among `tasks` (default all), or `FROZEN` when
        `open_set` and that task's best prototype cosine is below its threshold or, with `rmd_percentile`, its
        relative Mahalanobis score below its `rmd_thresholds` entry."""
        tasks = list(range(len(self))) if tasks is None else list(tasks)
        if not tasks:
            return torch.full((emb.shape[0],), FROZEN, dtype=torch.long)
        if not all(0 <= t < len(self) for t in tasks):
            raise ValueError(f"tasks {tasks} must be learned ones (0..{len(self) - 1})")
        picked, margin = self._picked(emb, tasks)
        if not open_set:
            return picked
        accepted = margin >= 0
        if self.rmd_percentile is not None:
            for t in picked.unique().tolist():
                rows = picked == t
                accepted[rows] &= self.rmd_scores(emb[rows], t) >= self.rmd_thresholds[t]
        return torch.where(accepted, picked, torch.full_like(picked, FROZEN))

    def _picked(self, emb: torch.Tensor, tasks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """[Q] the task of each text's best LDA class among `tasks`, and [Q] that task's prototype score minus its
        threshold."""
        best = torch.stack([self.logits(emb, t).max(-1).values for t in tasks], dim=-1).argmax(-1)
        picked = torch.tensor(tasks, dtype=torch.long)[best]
        proto = self.scores(emb, tasks).gather(1, best[:, None])[:, 0]
        return picked, proto - torch.tensor(self.thresholds, dtype=emb.dtype)[picked]

    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), "means": list(self.means), "scatters": list(self.scatters),
                 "counts": list(self.counts), "fourths": list(self.fourths)}  # fmt: skip
        if self.rmd_percentile is not None:
            state |= {"class_counts": list(self.class_counts), "rmd_thresholds": list(self.rmd_thresholds)}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.means, self.scatters = list(state["means"]), list(state["scatters"])
        self.counts, self.fourths = [int(c) for c in state["counts"]], [float(f) for f in state["fourths"]]
        if self.rmd_percentile is not None:
            if any(len(state.get(k, [])) != len(self.thresholds) for k in ("class_counts", "rmd_thresholds")):
                raise EcruError(
                    "this router state lacks the relative Mahalanobis test for some of its tasks (saved before "
                    "rmd_percentile); fix: start the run again (delete its checkpoint folder)"
                )
            self.class_counts = list(state["class_counts"])
            self.rmd_thresholds = [float(t) for t in state["rmd_thresholds"]]
        self._head, self._rmd = None, {}


class Router(_Routing):
    """Per-task frozen embeddings of training utterances and a threshold per task (k nearest neighbours)."""

    def __init__(self, *, k: int, percentile: float, negative_quantile: float | None = None):
        self.k, self.percentile, self.negative_quantile = k, percentile, negative_quantile
        self.keys: list[torch.Tensor] = []
        self.thresholds: list[float] = []
        self.claim_counts, self.claim_means, self.claim_sds = [], [], []

    def add_task(
        self,
        train_emb: torch.Tensor,
        negatives: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
    ) -> None:
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
        self._add_claim(loo)

    def scores(self, emb: torch.Tensor, tasks: Sequence[int]) -> torch.Tensor:
        """[Q, len(tasks)] scores of frozen embeddings `emb` [Q, D] for the learned `tasks`."""
        return torch.stack([knn_scores(emb, self.keys[t], k=self.k) for t in tasks], dim=-1)

    def state_dict(self) -> dict[str, Any]:
        return {"keys": list(self.keys), "thresholds": list(self.thresholds), **self._claim_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.keys, self.thresholds = list(state["keys"]), [float(t) for t in state["thresholds"]]
        self._load_claim(state)
