"""`ncm`: nearest class mean over the frozen encoder's embeddings of each task's training texts.

A training-free baseline (no parameter changes): a learned label is represented by the normalised mean of
the frozen embeddings of its training texts, an unlearned label by its name's embedding (zero-shot). It
stores one D-vector per learned label.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ecru.datasets import humanize_intent
from ecru.lifelong.evaluate import encode_sorted
from ecru.lifelong.methods.base import TaskCost
from ecru.lifelong.router import class_prototypes
from ecru.lifelong.stream import Task
from ecru.models import MiniLM


class NearestClassMean:
    """Class means of frozen embeddings, one per learned label name."""

    def __init__(self, name: str, model: MiniLM):
        self.name, self.model = name, model
        self.labels: list[str] = []
        self.means = torch.empty(0, 0)

    def learn(self, task: Task, *, index: int) -> TaskCost:
        names = [humanize_intent(i) for i in task.intents]
        labels = torch.tensor([task.intents.index(e.label) for e in task.train], dtype=torch.long)
        emb = encode_sorted(self.model, [e.text for e in task.train])
        means = class_prototypes(emb, labels, len(names))
        self.means = means if not self.labels else torch.cat([self.means, means])
        self.labels += names
        return TaskCost()

    def encoder(self) -> NearestClassMean:
        return self

    def encode(self, texts: list[str], *, batch_size: int = 64) -> torch.Tensor:
        """The frozen model's embeddings: ncm changes no parameter."""
        return self.model.encode(texts, batch_size=batch_size)

    @torch.no_grad()
    def scores(self, texts: Sequence[str], labels: Sequence[str], *, batch_size: int = 64) -> torch.Tensor:
        """[Q, L] cosine of each text to each label's class mean (its name's embedding if unlearned)."""
        names = encode_sorted(self.model, list(labels), batch_size=batch_size)
        row = {label: k for k, label in enumerate(self.labels)}  # a label learned twice: its latest mean
        for k, label in enumerate(labels):
            if label in row:
                names[k] = self.means[row[label]]
        return encode_sorted(self.model, list(texts), batch_size=batch_size) @ names.T

    def state_dict(self) -> dict[str, Any]:
        return {"labels": list(self.labels), "means": self.means}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.labels, self.means = list(state["labels"]), state["means"]
