"""Evaluation of a method on the whole stream, in two protocols.

- **Task-agnostic** (the headline, X-TAIL-like): every test text is classified among the union of the
  labels of all tasks learned so far, plus its own task's labels when that task is not learned yet (its
  zero-shot transfer); Banking77's texts among the learned labels plus Banking77's. The method is never
  told which task a text comes from.
- **Label-gated** (MTIL as ZSCL runs it): a task's texts among that task's own labels, and the method is
  told the task (`TaskGatedEncoder.for_task`): a method with per-task parameters uses that task's. Unseen
  tasks and Banking77 get the frozen model under the gate, so their values hold by construction; the
  runner fills them in from the pretrained row (`gated` in `RunResult`).

Every evaluation scores each test text against each label name once (`Scorer.scores`, one [texts, labels]
matrix) and reads any candidate set as a subset of its columns: a scorer's column for a label must not
depend on the other candidates (checked in the tests for the routed method).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ecru.datasets import humanize_intent
from ecru.lifelong.stream import Stream


class Encoder(Protocol):
    """Anything that maps texts to L2-normalised embeddings without autograd (e.g. `ecru.models.MiniLM`)."""

    def encode(self, texts: list[str], *, batch_size: int = 64) -> torch.Tensor: ...


@runtime_checkable
class LabelAwareEncoder(Protocol):
    """An encoder that embeds class names differently from queries (e.g. always with the frozen model)."""

    def encode(self, texts: list[str], *, batch_size: int = 64) -> torch.Tensor: ...

    def encode_labels(self, texts: list[str], *, batch_size: int = 64) -> torch.Tensor: ...


@runtime_checkable
class Scorer(Protocol):
    """Scores [Q, L] of texts for class names; column l depends on the texts and labels[l] only."""

    def scores(
        self, texts: Sequence[str], labels: Sequence[str], *, batch_size: int = 64
    ) -> torch.Tensor: ...


@runtime_checkable
class TaskGatedEncoder(Protocol):
    """An encoder with per-task parameters that can be told the task (the label-gated protocol)."""

    def encode(self, texts: list[str], *, batch_size: int = 64) -> torch.Tensor: ...

    def for_task(self, task: int) -> LabelAwareEncoder: ...


@dataclass(frozen=True)
class EvalRow:
    """Accuracies (percent) of one model after some tasks."""

    ti: list[float]
    """Per task, among its own labels; learned tasks with the task given (gate), unseen ones without."""
    agnostic: list[float]
    """Per task, among the learned labels plus its own (task-agnostic)."""
    heldout: float
    """Banking77 among its own 77 labels."""
    heldout_agnostic: float
    """Banking77 among the learned labels plus its own 77."""
    distractor: float | None = None
    """The learned tasks' texts among the learned labels plus Banking77's 77 (labels no task taught as
    distractors): what an open-set rule that sends texts to unlearned labels costs the learned tasks.
    None before any task is learned or without a held-out probe."""


def encode_sorted(encoder: Encoder, texts: list[str], *, batch_size: int = 64) -> torch.Tensor:
    """`encoder.encode(texts)` in length order (less padding), returned in the original order."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    emb = encoder.encode([texts[i] for i in order], batch_size=batch_size)
    out = torch.empty_like(emb)
    out[torch.tensor(order, dtype=torch.long)] = emb
    return out


def cosine_scores(encoder: Encoder, texts: list[str], labels: list[str]) -> torch.Tensor:
    """[Q, L] cosine similarities: the encoder's `scores` if it has one, else embeddings of texts and names
    (names through `encode_labels` if it has that)."""
    if isinstance(encoder, Scorer):
        return encoder.scores(texts, labels)
    if isinstance(encoder, LabelAwareEncoder):
        return encode_sorted(encoder, texts) @ encoder.encode_labels(labels).T
    emb = encode_sorted(encoder, texts + labels)
    return emb[: len(texts)] @ emb[len(texts) :].T


def _accuracy(scores: torch.Tensor, candidates: list[str], gold: list[str]) -> float:
    """Percent of rows whose best candidate (columns of `scores`, named `candidates`) is the gold name."""
    if not gold:
        return float("nan")
    pred = scores.argmax(-1).tolist()
    return 100.0 * sum(candidates[p] == g for p, g in zip(pred, gold, strict=True)) / len(gold)


class Evaluator:
    """Scores encoders on a fixed stream; `evaluate(encoder, seen=k)` after training k tasks."""

    def __init__(self, stream: Stream):
        self.stream = stream
        self.task_names = [[humanize_intent(i) for i in t.intents] for t in stream.tasks]
        self.heldout_names = [humanize_intent(label) for label in stream.heldout_labels]
        self.names = list(dict.fromkeys([n for names in self.task_names for n in names] + self.heldout_names))
        self.column = {n: k for k, n in enumerate(self.names)}
        self.texts = [e.text for t in stream.tasks for e in t.test] + [e.text for e in stream.heldout]
        self.spans = [sum(len(t.test) for t in stream.tasks[:j]) for j in range(len(stream.tasks) + 1)]
        self.gold = [humanize_intent(e.label) for t in stream.tasks for e in t.test] + [
            humanize_intent(e.label) for e in stream.heldout
        ]

    def _acc(self, scores: torch.Tensor, lo: int, hi: int, candidates: list[str]) -> float:
        cols = [self.column[n] for n in candidates]
        return _accuracy(scores[lo:hi][:, cols], candidates, self.gold[lo:hi])

    def _gated(self, encoder: TaskGatedEncoder, j: int) -> float:
        lo, hi = self.spans[j], self.spans[j + 1]
        names = self.task_names[j]
        scores = cosine_scores(encoder.for_task(j), self.texts[lo:hi], names)
        return _accuracy(scores, names, self.gold[lo:hi])

    def evaluate(self, encoder: Encoder, *, seen: int) -> EvalRow:
        """Accuracies after training the first `seen` tasks (0 = before training)."""
        scores = cosine_scores(encoder, self.texts, self.names)
        learned = list(dict.fromkeys(n for names in self.task_names[:seen] for n in names))
        ti, agnostic = [], []
        for j, own in enumerate(self.task_names):
            lo, hi = self.spans[j], self.spans[j + 1]
            gated = j < seen and isinstance(encoder, TaskGatedEncoder)
            ti.append(self._gated(encoder, j) if gated else self._acc(scores, lo, hi, own))
            agnostic.append(self._acc(scores, lo, hi, list(dict.fromkeys(learned + own))))
        lo, hi = self.spans[-1], len(self.texts)
        held = self._acc(scores, lo, hi, self.heldout_names)
        with_heldout = list(dict.fromkeys(learned + self.heldout_names))
        held_agnostic = self._acc(scores, lo, hi, with_heldout)
        distractor = None
        if seen and self.heldout_names:
            distractor = self._acc(scores, 0, self.spans[seen], with_heldout)
        return EvalRow(ti, agnostic, held, held_agnostic, distractor)


@runtime_checkable
class Claimer(Protocol):
    """An encoder that grades [Q] how strongly its learned tasks claim each text (`routed-lora`:
    `RoutedEncoder.open_set_grades`); for others the best label's probability is the grade."""

    def open_set_grades(self, texts: list[str]) -> torch.Tensor: ...


@runtime_checkable
class Calibrated(Protocol):
    """An encoder with its own probabilities of candidate labels (`routed-lora`: each task's scale)."""

    def probabilities(self, texts: list[str], names: list[str]) -> torch.Tensor: ...


OOS_RECALL = 0.8
"""The open-set rule, the same for every method: abstain on a text whose in-scope grade (`Claimer`'s open-set
grade, else its best learned label's probability) is at most the `OOS_RECALL` quantile of CLINC's `oos_val`
texts' grades, so that this share of them is abstained. 0.8, chosen on 4 quick validation streams
(bench/experiments/lifelong_abstain_val.py: CLINC val texts, `oos_val` in halves, one half setting the
threshold): routed-lora's mean in-scope cost against Last 0.14 / 0.50 / 1.53 points at 0.7 / 0.8 / 0.9, the
other half's recall 70.0 / 81.0 / 89.0: the largest quantile costing at most 1 point. Still the largest on the
full stream's validation split with routed-lora's current grade (bench/experiments/lifelong_oos_grade.py): cost
0.58 / 1.58 at 0.8 / 0.85."""


def open_set_metrics(right: torch.Tensor, abstained: torch.Tensor, oos_abstained: torch.Tensor) -> dict:
    """Out-of-scope recall and precision and in-scope accuracy (percent; abstentions counted wrong) from the
    in-scope texts' `right` and `abstained` [N] and the out-of-scope texts' `oos_abstained` [M] (booleans)."""
    caught, false = oos_abstained.sum().item(), abstained.sum().item()
    return {
        "oos_recall": 100.0 * caught / max(1, oos_abstained.numel()),
        "oos_precision": 100.0 * caught / max(1, caught + false),
        "in_scope_accuracy": 100.0 * (right & ~abstained).double().mean().item(),
        "in_scope_accuracy_no_abstention": 100.0 * right.double().mean().item(),
        "in_scope_abstained": 100.0 * abstained.double().mean().item(),
    }


def confidences(encoder: Encoder, texts: list[str], names: list[str], *, scale: float):
    """[Q] the best label's index among `names`, [Q] its probability (the encoder's own when `Calibrated`,
    else softmax(scale x cosines)) and [Q] the text's in-scope grade (`Claimer.open_set_grades`, else that
    probability)."""
    if isinstance(encoder, Calibrated):
        prob = encoder.probabilities(texts, names).double()
    else:
        prob = torch.softmax(scale * cosine_scores(encoder, texts, names).double(), dim=-1)
    conf, best = prob.max(-1)
    grade = encoder.open_set_grades(texts).double() if isinstance(encoder, Claimer) else conf
    return best, conf, grade


class OpenSetEvaluator(Evaluator):
    """`Evaluator` plus, after each learned task, CLINC's out-of-scope texts (`oos_val` to set the threshold,
    `oos_test` to measure; Larson et al., 2019): `open_set_metrics` and the ECE of the answered in-scope
    texts, appended to `open_set` (one dict per evaluation with `seen` >= 1)."""

    def __init__(self, stream: Stream, *, scale: float, oos_val: list[str], oos_test: list[str]):
        super().__init__(stream)
        self.scale, self.oos_val, self.oos_test = scale, oos_val, oos_test
        self.open_set: list[dict] = []

    def evaluate(self, encoder: Encoder, *, seen: int) -> EvalRow:
        row = super().evaluate(encoder, seen=seen)
        if seen:
            self.open_set.append({"seen": seen, **self.open_set_row(encoder, seen)})
        return row

    def take_open_set(self) -> list[dict]:
        """The open-set rows measured since the last call (one run's), and forget them."""
        rows, self.open_set = self.open_set, []
        return rows

    def open_set_row(self, encoder: Encoder, seen: int) -> dict:
        from ecru.lifelong.calibration import expected_calibration_error

        names = list(dict.fromkeys(n for task in self.task_names[:seen] for n in task))
        texts = self.texts[: self.spans[seen]]
        best, conf, grade = confidences(
            encoder, texts + self.oos_val + self.oos_test, names, scale=self.scale
        )
        n, v = len(texts), len(self.oos_val)
        threshold = torch.quantile(grade[n : n + v], OOS_RECALL).item()
        abstained = grade <= threshold
        right = torch.tensor([names[b] == g for b, g in zip(best[:n].tolist(), self.gold[:n], strict=True)])
        answered = ~abstained[:n]
        ece = expected_calibration_error(conf[:n][answered], right[answered])
        return {**open_set_metrics(right, abstained[:n], abstained[n + v :]), "threshold": threshold,
                "oos_val_recall": 100.0 * abstained[n : n + v].double().mean().item(), "ece": ece}  # fmt: skip
