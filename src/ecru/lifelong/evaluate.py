"""Evaluation of an encoder on the whole stream: task-incremental, class-incremental and held-out.

Every evaluation encodes each test utterance and each intent name exactly once (one batched pass, sorted
by length so batches carry little padding), then scores subsets of the cached embeddings. An encoder with
`encode_labels` (`LabelAwareEncoder`) embeds the intent names with that instead; one that also has
`encode_among` (`CandidateAwareEncoder`) embeds each group of utterances knowing the intent names it is
classified among (a task's own names; all seen tasks' names; Banking77's); one with `predict_among`
(`PredictingEncoder`) returns its predicted classes directly.
"""

from __future__ import annotations

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
    """An encoder that embeds class names (intent names) differently from queries, e.g. always with the
    frozen pretrained model while queries go through adapters (`ecru`)."""

    def encode(self, texts: list[str], *, batch_size: int = 64) -> torch.Tensor: ...

    def encode_labels(self, texts: list[str], *, batch_size: int = 64) -> torch.Tensor: ...


@runtime_checkable
class CandidateAwareEncoder(Protocol):
    """A `LabelAwareEncoder` whose query embeddings may depend on the class names they are classified among,
    e.g. `ecru` choosing an adapter by the label set (`routing="labels"`)."""

    def encode(self, texts: list[str], *, batch_size: int = 64) -> torch.Tensor: ...

    def encode_labels(self, texts: list[str], *, batch_size: int = 64) -> torch.Tensor: ...

    def encode_among(self, texts: list[str], labels: list[str], *, batch_size: int = 64) -> torch.Tensor: ...


@runtime_checkable
class PredictingEncoder(Protocol):
    """A `CandidateAwareEncoder` that also makes the decision itself: `predict_among` returns, per text, the
    index into `labels` of its predicted class (e.g. `ecru` with label routing: the routed task's adapter
    picks among that task's labels only)."""

    def encode(self, texts: list[str], *, batch_size: int = 64) -> torch.Tensor: ...

    def encode_labels(self, texts: list[str], *, batch_size: int = 64) -> torch.Tensor: ...

    def encode_among(self, texts: list[str], labels: list[str], *, batch_size: int = 64) -> torch.Tensor: ...

    def predict_among(self, texts: list[str], labels: list[str], *, batch_size: int = 64) -> torch.Tensor: ...


@dataclass(frozen=True)
class EvalRow:
    """Accuracies (percent) of one model: per task, task- and class-incremental, and on the held-out set."""

    ti: list[float]
    ci: list[float]
    heldout: float


def encode_sorted(
    encoder: Encoder, texts: list[str], *, batch_size: int = 64, labels: list[str] | None = None
) -> torch.Tensor:
    """`encoder.encode(texts)` (with `labels`: `encoder.encode_among(texts, labels)`) in length order (less
    padding), returned in the original order."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    ordered = [texts[i] for i in order]
    if labels is None:
        emb = encoder.encode(ordered, batch_size=batch_size)
    else:
        emb = encoder.encode_among(ordered, labels, batch_size=batch_size)
    out = torch.empty_like(emb)
    out[torch.tensor(order, dtype=torch.long)] = emb
    return out


def _accuracy(emb: torch.Tensor, names: torch.Tensor, gold: torch.Tensor) -> float:
    if emb.shape[0] == 0:
        return float("nan")
    return 100.0 * ((emb @ names.T).argmax(-1) == gold).double().mean().item()


class Evaluator:
    """Scores encoders on a fixed stream; `evaluate(encoder, seen=k)` after training k tasks."""

    def __init__(self, stream: Stream):
        self.stream = stream
        tasks = stream.tasks
        self.names = [humanize_intent(i) for t in tasks for i in t.intents] + [
            humanize_intent(label) for label in stream.heldout_labels
        ]
        self.offsets = [sum(len(t.intents) for t in tasks[:j]) for j in range(len(tasks) + 1)]
        self.texts = [e.text for t in tasks for e in t.test] + [e.text for e in stream.heldout]
        self.spans = [sum(len(t.test) for t in tasks[:j]) for j in range(len(tasks) + 1)]
        self.gold = [torch.tensor([t.intents.index(e.label) for e in t.test]) for t in tasks]
        index = {label: k for k, label in enumerate(stream.heldout_labels)}
        self.heldout_gold = torch.tensor([index[e.label] for e in stream.heldout], dtype=torch.long)

    def evaluate(self, encoder: Encoder, *, seen: int) -> EvalRow:
        """Accuracies after training the first `seen` tasks (0 = before training)."""
        off, spans = self.offsets, self.spans
        among = isinstance(encoder, CandidateAwareEncoder)
        if isinstance(encoder, PredictingEncoder):  # it makes each decision itself
            test, names = None, None
        elif among:  # the texts are embedded group by group, knowing their candidate names
            test, names = None, encoder.encode_labels(self.names)
        elif isinstance(encoder, LabelAwareEncoder):
            test, names = encode_sorted(encoder, self.texts), encoder.encode_labels(self.names)
        else:
            emb = encode_sorted(encoder, self.texts + self.names)
            test, names = emb[: len(self.texts)], emb[len(self.texts) :]

        def acc(lo: int, hi: int, label_ids: list[int], gold: torch.Tensor) -> float:
            """Accuracy (percent) on test texts lo..hi classified among the names `label_ids`."""
            labels = [self.names[k] for k in label_ids]
            if isinstance(encoder, PredictingEncoder):
                if hi == lo:
                    return float("nan")
                pred = encoder.predict_among(self.texts[lo:hi], labels)
                return 100.0 * (pred == gold).double().mean().item()
            emb = encode_sorted(encoder, self.texts[lo:hi], labels=labels) if among else test[lo:hi]
            return _accuracy(emb, names[label_ids], gold)

        ti, ci = [], []
        for j in range(len(self.stream.tasks)):
            own = list(range(off[j], off[j + 1]))
            ti.append(acc(spans[j], spans[j + 1], own, self.gold[j]))
            # class-incremental: all intents of the tasks seen so far, plus task j's own (zero-shot if unseen)
            cand = sorted(set(range(seen)) | {j})
            shift = sum(off[k + 1] - off[k] for k in cand if k < j)
            pool = [i for k in cand for i in range(off[k], off[k + 1])]
            ci.append(acc(spans[j], spans[j + 1], pool, self.gold[j] + shift))
        held = list(range(off[-1], len(self.names)))
        heldout = acc(spans[-1], len(self.texts), held, self.heldout_gold)
        return EvalRow(ti, ci, heldout)
