"""Full fine-tuning of the encoder, with the regularisers of the baselines as options.

One mechanism, several named methods (see `ecru.lifelong.methods.registry`): `seqft` (none), `lwf`
(distil the previous model on the task's utterances), `replay` (a memory of past utterances), `wise-ft`
(interpolate with the initial weights after each task), `zscl` (distil the frozen initial model on
reference sentences + weight ensemble + optional L2 to the start-of-task weights), and the upper bounds
`independent` (each task from the initial weights) and `joint` (all tasks so far, from the initial weights).
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.swa_utils import AveragedModel

from ecru.datasets import Example
from ecru.errors import EcruError
from ecru.lifelong.losses import distill_loss, task_loss
from ecru.lifelong.methods.base import (
    TaskCost,
    TrainConfig,
    batches,
    fit,
    intent_batch,
    num_steps,
    reference_loss,
    seed_task,
    snapshot_steps,
)
from ecru.lifelong.reference import TeacherCache
from ecru.lifelong.stream import Task
from ecru.models import MiniLM


@dataclass(frozen=True)
class FinetuneConfig:
    """Which regularisers a full fine-tuning method uses (all off = sequential fine-tuning)."""

    lwf: float = 0.0
    """Weight of distillation from the previous-task model on the current task's utterances (LwF)."""
    replay_per_intent: int = 0
    """Utterances per intent kept in a replay memory after each task; each step adds a replay batch."""
    wise_alpha: float | None = None
    """WiSE-FT: after each task, weights = initial + alpha * (fine-tuned - initial)."""
    distill: float = 0.0
    """Weight of ZSCL's distillation from the frozen initial model on reference sentences."""
    ref_batch: int = 32
    """Reference sentences per step for that distillation."""
    temperature: float = 2.0
    """Distillation temperature (ZSCL: 2)."""
    we_snapshots: int = 0
    """Weight ensemble: snapshots averaged per task, evenly spaced (0 = off; ZSCL: every 100 of 1,000 steps)."""
    l2: float = 0.0
    """Weight of the L2 pull towards the start-of-task weights."""
    reset: bool = False
    """Start every task from the initial weights (the per-task independent upper bound)."""
    joint: bool = False
    """Train on all tasks seen so far (with `reset`: the joint-training upper bound)."""

    def __post_init__(self) -> None:
        if self.lwf < 0 or self.distill < 0 or self.l2 < 0:
            raise EcruError("lwf, distill and l2 weights must be >= 0")
        if self.replay_per_intent < 0 or self.we_snapshots < 0 or self.ref_batch < 1:
            raise EcruError("replay_per_intent and we_snapshots must be >= 0, ref_batch >= 1")
        if self.wise_alpha is not None and not 0 <= self.wise_alpha <= 1:
            raise EcruError(f"wise_alpha must be in [0, 1]; got {self.wise_alpha}")
        if self.temperature <= 0:
            raise EcruError(f"temperature must be > 0; got {self.temperature}")


class Finetune:
    """Trains every encoder weight; holds the model, the initial weights and any replay memory."""

    def __init__(self, name: str, model: MiniLM, train: TrainConfig, cfg: FinetuneConfig,
                 *, teacher: TeacherCache | None = None):  # fmt: skip
        if cfg.distill > 0 and teacher is None:
            raise EcruError(f"method {name!r} distils on reference sentences: pass a TeacherCache")
        self.name, self.model, self.train, self.cfg, self.teacher = name, model, train, cfg, teacher
        self.initial = copy.deepcopy(model.encoder.state_dict())
        self.memory: list[tuple[Example, Task]] = []
        self.seen: list[Task] = []

    def encoder(self) -> MiniLM:
        return self.model

    def learn(self, task: Task, *, index: int) -> TaskCost:
        rng, cfg = seed_task(self.train.seed, index), self.cfg
        self.seen.append(task)
        if cfg.reset:
            self.model.encoder.load_state_dict(self.initial)
        items = [(e, t) for t in (self.seen if cfg.joint else [task]) for e in t.train]
        prev = self._previous_embeddings(items) if cfg.lwf > 0 else None
        start = [p.detach().clone() for p in self.model.parameters()] if cfg.l2 > 0 else None
        avg = AveragedModel(self.model.encoder) if cfg.we_snapshots > 0 else None
        if avg is not None:  # the ensemble starts with the pre-task weights (ZSCL)
            avg.update_parameters(self.model.encoder)
        self.model.train()

        def loss_fn(batch: list, step: int) -> torch.Tensor:
            if self.memory and cfg.replay_per_intent > 0:
                batch = batch + rng.sample(self.memory, min(len(batch), len(self.memory)))
            emb, names, labels, cand = intent_batch(self.model, batch)
            loss = task_loss(emb, names, labels, scale=self.train.scale,
                             label_smoothing=self.train.label_smoothing, candidates=cand)  # fmt: skip
            if prev is not None:
                t = torch.stack([prev[e.text] for e, _ in batch])
                loss = loss + cfg.lwf * distill_loss(
                    emb, t, t, scale=self.train.scale, temperature=cfg.temperature
                )
            if cfg.distill > 0:
                loss = loss + cfg.distill * reference_loss(self.model, self.teacher, rng, batch=cfg.ref_batch,
                                                             scale=self.train.scale, temperature=cfg.temperature)  # fmt: skip
            if start is not None:
                loss = loss + cfg.l2 * sum(
                    ((p - s) ** 2).sum() for p, s in zip(self.model.parameters(), start, strict=True)
                )
            return loss

        total = num_steps(len(items), self.train)
        snapshot_at = snapshot_steps(total, cfg.we_snapshots)

        def after_step(step: int) -> None:
            if avg is not None and step in snapshot_at:
                avg.update_parameters(self.model.encoder)

        steps = batches(items, batch_size=self.train.batch_size, epochs=self.train.epochs, rng=rng)
        cost = fit(list(self.model.parameters()), steps, loss_fn, lr=self.train.lr, total=total,
                   desc=f"{self.name} task {index + 1} ({task.name})", progress=self.train.progress, after_step=after_step)  # fmt: skip
        self.model.eval()
        if avg is not None:
            self.model.encoder.load_state_dict(avg.module.state_dict())
        if cfg.wise_alpha is not None:
            self._interpolate_with_initial(cfg.wise_alpha)
        self._remember(task, rng)
        return cost

    def _previous_embeddings(self, items: list) -> dict[str, torch.Tensor]:
        """The previous-task model's embeddings of this task's utterances, encoded once (LwF's teacher)."""
        texts = list(dict.fromkeys(e.text for e, _ in items))
        return dict(zip(texts, self.model.encode(texts), strict=True))

    @torch.no_grad()
    def _interpolate_with_initial(self, alpha: float) -> None:
        state = self.model.encoder.state_dict()
        for k, v in state.items():
            if v.is_floating_point():
                v.copy_(self.initial[k].lerp(v, alpha))

    def _remember(self, task: Task, rng: random.Random) -> None:
        k = self.cfg.replay_per_intent
        for intent in task.intents if k > 0 else ():
            pool = [e for e in task.train if e.label == intent]
            self.memory += [(e, task) for e in rng.sample(pool, min(k, len(pool)))]

    def state_dict(self) -> dict[str, Any]:
        # only joint training needs past tasks' utterances; the others keep their intent names
        # plain containers only: a checkpoint loads with weights_only=True
        rows = lambda examples: [[e.text, e.label, e.domain] for e in examples]  # noqa: E731
        seen = [[t.name, list(t.intents), rows(t.train) if self.cfg.joint else []] for t in self.seen]
        memory = [(e.text, e.label, e.domain, t.name) for e, t in self.memory]
        return {"encoder": self.model.encoder.state_dict(), "seen": seen, "memory": memory}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.encoder.load_state_dict(state["encoder"])
        self.seen = [
            Task(name, tuple(intents), tuple(Example(*r) for r in train), ())
            for name, intents, train in state["seen"]
        ]
        by_name = {t.name: t for t in self.seen}
        self.memory = [
            (Example(text, label, domain), by_name[n]) for text, label, domain, n in state["memory"]
        ]
