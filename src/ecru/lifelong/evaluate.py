"""Evaluation of an encoder on the whole stream: task-incremental, class-incremental and held-out.

Every evaluation encodes each test utterance and each intent name exactly once (one batched pass, sorted
by length so batches carry little padding), then scores subsets of the cached embeddings. An encoder with
`encode_labels` (`LabelAwareEncoder`) embeds the intent names with that instead.
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


@dataclass(frozen=True)
class EvalRow:
    """Accuracies (percent) of one model: per task, task- and class-incremental, and on the held-out set."""

    ti: list[float]
    ci: list[float]
    heldout: float


def encode_sorted(encoder: Encoder, texts: list[str], *, batch_size: int = 64) -> torch.Tensor:
    """`encoder.encode(texts)` in length order (less padding), returned in the original order."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    emb = encoder.encode([texts[i] for i in order], batch_size=batch_size)
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
        off = self.offsets
        if isinstance(encoder, LabelAwareEncoder):
            test, names = encode_sorted(encoder, self.texts), encoder.encode_labels(self.names)
        else:
            emb = encode_sorted(encoder, self.texts + self.names)
            test, names = emb[: len(self.texts)], emb[len(self.texts) :]
        ti, ci = [], []
        for j in range(len(self.stream.tasks)):
            utt = test[self.spans[j] : self.spans[j + 1]]
            ti.append(_accuracy(utt, names[off[j] : off[j + 1]], self.gold[j]))
            # class-incremental: all intents of the tasks seen so far, plus task j's own (zero-shot if unseen)
            cand = sorted(set(range(seen)) | {j})
            shift = sum(off[k + 1] - off[k] for k in cand if k < j)
            pool = torch.cat([names[off[k] : off[k + 1]] for k in cand])
            ci.append(_accuracy(utt, pool, self.gold[j] + shift))
        heldout = _accuracy(test[self.spans[-1] :], names[off[-1] :], self.heldout_gold)
        return EvalRow(ti, ci, heldout)
