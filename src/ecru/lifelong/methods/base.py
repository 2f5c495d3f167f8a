"""The method protocol and the training loop every method shares.

A method owns its model state. `learn(task, index=i)` trains on one task and returns what it cost;
`encoder()` is the model to evaluate now; `state_dict` / `load_state_dict` make per-task checkpoints.
Randomness (batch order, dropout) is seeded per task from `TrainConfig.seed` and the task index, so a run
resumed from a task checkpoint replays exactly the steps an uninterrupted run takes.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from ecru.datasets import Example, humanize_intent
from ecru.errors import EcruError
from ecru.lifelong.evaluate import Encoder
from ecru.lifelong.losses import distill_loss
from ecru.lifelong.stream import Task


@dataclass(frozen=True)
class TrainConfig:
    """Settings shared by every training method."""

    epochs: int = 2
    """Passes over a task's training utterances."""
    batch_size: int = 32
    """Utterances per step."""
    lr: float = 2e-5
    """AdamW learning rate for full fine-tuning (adapter methods use their own config's `lr` instead)."""
    scale: float = 30.0
    """Logit scale applied to cosine similarities (the classifier's inverse temperature)."""
    label_smoothing: float = 0.2
    """Label smoothing of the task cross-entropy (ZSCL uses 0.2)."""
    seed: int = 0
    """Training seed; each task reseeds from (seed, task index)."""
    progress: bool = True
    """Show a tqdm bar per task."""

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1:
            raise EcruError(f"epochs and batch_size must be >= 1; got {self.epochs}, {self.batch_size}")
        if not self.lr > 0 or not self.scale > 0:
            raise EcruError(f"lr and scale must be > 0; got {self.lr}, {self.scale}")
        if not 0 <= self.label_smoothing < 1:
            raise EcruError(f"label_smoothing must be in [0, 1); got {self.label_smoothing}")


@dataclass
class TaskCost:
    """What training one task cost (wall time and RSS are measured by the runner)."""

    trainable_params: int = 0
    optimizer_bytes: int = 0
    steps: int = 0


class Method(Protocol):
    """A continual-learning method: trains on tasks one after another."""

    name: str

    def learn(self, task: Task, *, index: int) -> TaskCost: ...

    def encoder(self) -> Encoder: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def seed_task(seed: int, index: int) -> random.Random:
    """Seed torch (dropout) for task `index` and return the batch-order RNG."""
    torch.manual_seed(seed * 10_007 + index)
    return random.Random(seed * 10_007 + index)


def batches(items: Sequence, *, batch_size: int, epochs: int, rng: random.Random) -> Iterator[list]:
    """Shuffled batches, `epochs` passes; the last batch of an epoch may be short."""
    for _ in range(epochs):
        order = list(items)
        rng.shuffle(order)
        for i in range(0, len(order), batch_size):
            yield order[i : i + batch_size]


def num_steps(n: int, cfg: TrainConfig) -> int:
    return cfg.epochs * -(-n // cfg.batch_size)


def snapshot_steps(total: int, snapshots: int) -> frozenset[int]:
    """Steps (1-based, of `total`) after which a weight-ensemble snapshot is taken: every
    `total // snapshots` steps (at least every step), so up to `snapshots` evenly spaced ones; none if 0."""
    if snapshots <= 0:
        return frozenset()
    every = max(1, total // snapshots)
    return frozenset(range(every, total + 1, every))


def optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
    )


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors and texts inside nested containers (what a checkpoint of `obj` stores)."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    if dataclasses.is_dataclass(obj):
        return sum(tensor_bytes(v) for v in vars(obj).values())
    return len(obj.encode()) if isinstance(obj, str) else 0


def fit(
    params: list[nn.Parameter],
    steps: Iterator[list],
    loss_fn: Callable[[list, int], torch.Tensor],
    *,
    lr: float,
    total: int,
    desc: str,
    progress: bool,
    after_step: Callable[[int], None] | None = None,
) -> TaskCost:
    """AdamW on `params`, one step per batch of `steps`; `loss_fn(batch, step)` builds the loss."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    bar = tqdm(steps, total=total, desc=desc, disable=not progress, leave=False)
    step = 0
    for step, batch in enumerate(bar, 1):
        loss = loss_fn(batch, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if after_step is not None:
            after_step(step)
    return TaskCost(sum(p.numel() for p in params), optimizer_bytes(opt), step)


def intent_batch(model: nn.Module, batch: list[tuple[Example, Task]]):
    """Student embeddings of the batch's utterances and of its tasks' intent names (one forward pass),
    the labels as indices into those names, and a candidate mask when the batch mixes tasks (else None).
    """
    tasks = list(dict.fromkeys(t for _, t in batch))
    offsets = {t: sum(len(u.intents) for u in tasks[:k]) for k, t in enumerate(tasks)}
    names = [humanize_intent(i) for t in tasks for i in t.intents]
    emb = model([e.text for e, _ in batch] + names)
    labels = torch.tensor([offsets[t] + t.intents.index(e.label) for e, t in batch], dtype=torch.long)
    if len(tasks) == 1:
        return emb[: len(batch)], emb[len(batch) :], labels, None
    cand = torch.zeros(len(batch), len(names), dtype=torch.bool)
    for row, (_, t) in enumerate(batch):
        cand[row, offsets[t] : offsets[t] + len(t.intents)] = True
    return emb[: len(batch)], emb[len(batch) :], labels, cand


def trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def reference_loss(model: nn.Module, teacher, rng: random.Random, *, batch: int, scale: float,
                   temperature: float) -> torch.Tensor:  # fmt: skip
    """ZSCL's distillation on a random reference batch; the teacher side comes from `teacher`'s cache."""
    ref = teacher.embeddings()
    idx = rng.sample(range(len(teacher.texts)), min(batch, len(teacher.texts)))
    t = ref[idx]
    return distill_loss(model([teacher.texts[i] for i in idx]), t, t, scale=scale, temperature=temperature)
