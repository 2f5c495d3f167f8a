"""`ecru`: one small LoRA adapter per task on the top layers, and a router that picks one per text.

- Each task trains a fresh adapter on its own utterances only (no distillation, no replay) and the adapter is
  never touched again, so later tasks cannot overwrite it.
- The frozen bottom layers' outputs are cached per text (`FrozenPrefix`): training and evaluation run only
  the adapted top layers.
- At inference a text goes through the adapter of the learned task it most resembles, or through the frozen
  model when it resembles none (`ecru.lifelong.router`): unseen domains and held-out datasets are scored by
  exactly the pretrained model, and each learned task by its own adapter.
- With `routing="labels"` the candidate labels a text is classified among decide first (`encode_among`,
  `predict_among`: a text routed to a task is classified among that task's labels only). The
  learned tasks that take part are those whose intent names are all among the labels, or that hold all the
  labels. None -> the frozen model; the labels are those tasks' names only -> the best of their adapters by
  the text router, no threshold; those tasks' names plus unlearned ones -> the text router among them, with
  thresholds (the text may belong to an unlearned label). A query about one learned task's intents thus
  always reaches that task's adapter, and a query about unseen labels gets exactly the pretrained model.
- Intent names are the classifier's weights and stay frozen (`frozen_labels`): the adapters learn to map
  utterances onto the pretrained model's name embeddings, so a name never depends on where it is routed.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch
from peft import get_peft_model

from ecru.datasets import humanize_intent
from ecru.errors import EcruError
from ecru.lifelong.losses import distill_loss, task_loss
from ecru.lifelong.methods.adapters import lora_config
from ecru.lifelong.methods.base import (
    TaskCost,
    TrainConfig,
    batches,
    fit,
    intent_batch,
    num_steps,
    reference_loss,
    seed_task,
    trainable,
)
from ecru.lifelong.prefix import FrozenPrefix, PrefixCachedEncoder
from ecru.lifelong.reference import TeacherCache
from ecru.lifelong.router import FROZEN, Router
from ecru.lifelong.stream import Task
from ecru.models import MiniLM


@dataclass(frozen=True)
class RoutedConfig:
    """Per-task LoRA adapters on the top layers and the router between them."""

    r: int = 8
    """LoRA rank of each task's adapter."""
    alpha: float = 16.0
    """LoRA alpha (the update is scaled by alpha / r)."""
    targets: tuple[str, ...] = ("query", "key", "value", "dense")
    """Names of the BERT linear layers that get an adapter."""
    layers: tuple[int, ...] = (2, 3, 4, 5)
    """Encoder layers (0..5) that get adapters; the layers below them are frozen and cached."""
    lr: float = 1e-3
    """AdamW learning rate of each adapter."""
    knn: int = 5
    """A text's score for a task: mean cosine similarity to its `knn` nearest training utterances."""
    percentile: float = 5.0
    """A task's threshold: this percentile of its training utterances' leave-one-out scores."""
    frozen_labels: bool = True
    """Intent names always go through the frozen model; False = names are routed and trained like utterances."""
    negative_quantile: float | None = None
    """If set, a task's threshold may go down to this quantile of the reference sentences' scores (texts of
    no task: CLINC out-of-scope queries, Wikipedia), so more of its own texts reach its adapter."""
    reference: float = 0.0
    """Weight of ZSCL's distillation on a batch of reference sentences through the task's adapter (teacher side
    from the cache): the adapter learns to leave texts of no task as the frozen model embeds them, so a
    text routed to it by mistake loses little and the router's threshold can be looser."""
    anchor: float = 0.0
    """Weight of distillation towards the frozen model on the batch's own utterances (ZSCL's two-way loss at
    T=2, their frozen embeddings reused from the router's fit: no extra forward pass); keeps the adapter from
    collapsing utterances onto the task's few names, which hurts texts of other label sets routed to it."""
    routing: Literal["text", "labels"] = "text"
    """"text": every text by the text router alone (task-agnostic); "labels": by the candidate labels a text is
    classified among first, the text router only to choose among the learned tasks those labels name."""

    def __post_init__(self) -> None:
        if self.r < 1 or self.alpha <= 0 or self.lr <= 0 or self.knn < 1:
            raise EcruError(
                f"need r >= 1, alpha > 0, lr > 0, knn >= 1; got {self.r}, {self.alpha}, {self.lr}, {self.knn}"
            )
        if not self.layers or any(not 0 <= i < 6 for i in self.layers):
            raise EcruError(f"layers must name MiniLM layers 0..5; got {self.layers}")
        if self.anchor < 0:
            raise EcruError(f"anchor must be >= 0; got {self.anchor}")
        if not 0 <= self.percentile <= 100:
            raise EcruError(f"percentile must be in [0, 100]; got {self.percentile}")
        if self.reference < 0:
            raise EcruError(f"reference must be >= 0; got {self.reference}")
        if self.routing not in ("text", "labels"):
            raise EcruError(f"routing must be 'text' or 'labels'; got {self.routing!r}")
        if self.routing == "labels" and not self.frozen_labels:
            raise EcruError(
                "routing='labels' needs frozen_labels=True: names routed like texts would not match"
            )
        if self.negative_quantile is not None and not 0 < self.negative_quantile <= 1:
            raise EcruError(f"negative_quantile must be in (0, 1] or None; got {self.negative_quantile}")


class RoutedEncoder:
    """Texts through the adapter of the task the router picks (or the frozen model); names per `frozen_labels`."""

    def __init__(self, method: RoutedAdapters):
        self.m = method
        self._memo: dict[tuple[int, str], torch.Tensor] = {}  # (route, text) -> embedding

    @torch.no_grad()
    def _embed(self, texts: list[str], route: int, *, batch_size: int) -> torch.Tensor:
        """`texts` through task `route`'s adapter (`FROZEN`: none), from the cached prefix; each (text, route)
        computed once per encoder, so take a new encoder after the method learns."""
        todo = list(dict.fromkeys(t for t in texts if (route, t) not in self._memo))
        if todo:
            if route == FROZEN:
                with self.m.peft.disable_adapter():
                    emb = self.m.student.encode(todo, batch_size=batch_size)
            else:
                self.m.peft.base_model.set_adapter(self.m.adapters[route])
                emb = self.m.student.encode(todo, batch_size=batch_size)
            self._memo.update(((route, t), e) for t, e in zip(todo, emb, strict=True))
        if not texts:
            return self.m.student.encode([])
        return torch.stack([self._memo[route, t] for t in texts])

    def frozen(self, texts: list[str], *, batch_size: int = 64) -> torch.Tensor:
        """The pretrained model's embeddings (adapters off)."""
        return self._embed(texts, FROZEN, batch_size=batch_size)

    def routes(self, texts: list[str]) -> torch.Tensor:
        """Each text's task index, or `FROZEN`, by the text router alone."""
        return self.m.router(self.frozen(texts))

    def routes_among(self, texts: list[str], labels: list[str]) -> torch.Tensor:
        """Each text's task index, or `FROZEN`, when it is to be classified among the class names `labels`."""
        if self.m.cfg.routing == "text":
            return self.routes(texts)
        if not labels:
            raise EcruError(
                "routing by labels needs the candidate labels the texts are classified among; got none"
            )
        wanted = set(labels)
        # a learned task takes part when the labels cover its whole label space or lie within it; a partial
        # overlap (one shared name among many foreign ones) is a question its adapter was not trained for
        tasks = [t for t, names in enumerate(self.m.names) if set(names) <= wanted or wanted <= set(names)]
        known = {n for t in tasks for n in self.m.names[t]}
        return self.m.router(self.frozen(texts), tasks=tasks, open_set=not wanted <= known)

    def _through(self, texts: list[str], routes: torch.Tensor, *, batch_size: int) -> torch.Tensor:
        out = self.frozen(texts, batch_size=batch_size)
        for task in routes.unique().tolist():
            if task != FROZEN:
                idx = (routes == task).nonzero().flatten()
                out[idx] = self._embed([texts[i] for i in idx.tolist()], task, batch_size=batch_size)
        return out

    def encode(self, texts: list[str], *, batch_size: int = 64) -> torch.Tensor:
        """Each text through the adapter the text router picks (or the frozen model)."""
        return self._through(texts, self.routes(texts), batch_size=batch_size)

    def encode_among(self, texts: list[str], labels: list[str], *, batch_size: int = 64) -> torch.Tensor:
        """Embeddings of `texts` to be classified among the class names `labels` (routing per `routing`)."""
        return self._through(texts, self.routes_among(texts, labels), batch_size=batch_size)

    @torch.no_grad()
    def predict_among(self, texts: list[str], labels: list[str], *, batch_size: int = 64) -> torch.Tensor:
        """Per text, the index into `labels` of its predicted class.

        With label routing the decision has two stages, task then class: a text routed to a learned task is
        classified by that task's adapter among that task's labels only, one routed to the frozen model among
        all `labels`. (An adapter learned to separate its own task's intents, not to stay clear of other tasks'
        names, so its embeddings must not be scored against those.) Text routing: each text's embedding
        against all `labels`.
        """
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # less padding per batch
        ordered = [texts[i] for i in order]
        routes = self.routes_among(ordered, labels)
        scores = self._through(ordered, routes, batch_size=batch_size) @ self.encode_labels(labels).T
        if self.m.cfg.routing == "labels":
            for task in routes.unique().tolist():
                if task != FROZEN:
                    own = set(self.m.names[task])
                    foreign = torch.tensor([label not in own for label in labels])
                    rows = routes == task
                    scores[rows] = scores[rows].masked_fill(foreign, float("-inf"))
        pred = torch.empty(len(texts), dtype=torch.long)
        pred[torch.tensor(order, dtype=torch.long)] = scores.argmax(-1)
        return pred

    def encode_labels(self, texts: list[str], *, batch_size: int = 64) -> torch.Tensor:
        """Class names (intent names): frozen, or routed like any text when `frozen_labels` is off."""
        return self.frozen(texts, batch_size=batch_size) if self.m.cfg.frozen_labels else self.encode(texts)


class RoutedAdapters:
    """A LoRA adapter per learned task, a router, and the frozen encoder under them (never stored)."""

    def __init__(self, name: str, model: MiniLM, train: TrainConfig, cfg: RoutedConfig,
                 *, teacher: TeacherCache | None = None):  # fmt: skip
        if (cfg.negative_quantile is not None or cfg.reference > 0) and teacher is None:
            raise EcruError(
                f"{name} with negative_quantile or reference needs the teacher cache of the reference sentences"
            )
        self.name, self.model, self.train, self.cfg, self.teacher = name, model, train, cfg, teacher
        self.adapters: list[str] = []
        self.names: list[list[str]] = []  # each learned task's intent names, as classified among
        self.router = Router(k=cfg.knn, percentile=cfg.percentile, negative_quantile=cfg.negative_quantile)
        # peft wraps the model around a first adapter: task 0's, unused until task 0 is learned
        self._add_adapter(0)
        self.prefix = FrozenPrefix(model, min(cfg.layers))
        self.student = PrefixCachedEncoder(model, self.prefix)

    @property
    def peft(self):
        return self.model.encoder

    def _add_adapter(self, index: int) -> None:
        # an adapter's random init depends on (seed, task) only, not on what ran before in this process
        with warnings.catch_warnings(), torch.random.fork_rng():
            warnings.simplefilter(
                "ignore", FutureWarning
            )  # transformers' deprecation notice, raised inside peft
            torch.manual_seed(self.train.seed * 10_007 + index)
            if index == 0:
                self.model.encoder = get_peft_model(self.model.encoder, self._lora(), adapter_name="task0")
            else:
                self.peft.add_adapter(f"task{index}", self._lora())
        self.adapters.append(f"task{index}")

    def _lora(self):
        c = self.cfg
        return lora_config(r=c.r, alpha=c.alpha, targets=c.targets, layers=c.layers)

    def _activate(self, adapter: str) -> None:
        self.peft.base_model.set_adapter(adapter)
        for n, p in self.peft.named_parameters():
            p.requires_grad_(f".{adapter}." in n and "lora_" in n)

    def encoder(self) -> RoutedEncoder:
        return RoutedEncoder(self)

    def learn(self, task: Task, *, index: int) -> TaskCost:
        if index != len(self.router.keys):
            raise EcruError(
                f"{self.name} learns tasks in order: expected task {len(self.router.keys)}, got {index}"
            )
        rng, enc = seed_task(self.train.seed, index), self.encoder()
        if index >= len(self.adapters):
            self._add_adapter(index)
        texts = [e.text for e in task.train]
        frozen = enc.frozen(texts)
        negatives = self.teacher.embeddings() if self.cfg.negative_quantile is not None else None
        self.router.add_task(frozen, negatives)
        teacher = dict(zip(texts, frozen, strict=True))
        self.names.append([humanize_intent(i) for i in task.intents])
        names = enc.frozen(self.names[-1]) if self.cfg.frozen_labels else None
        self._activate(self.adapters[index])
        items = [(e, task) for e in task.train]
        ref_rng = random.Random(self.train.seed * 7_919 + index)  # reference batches: apart from batch order
        self.model.train()

        def loss_fn(batch: list, step: int) -> torch.Tensor:
            if names is None:  # names trained through the adapter too
                emb, label_emb, labels, _ = intent_batch(self.student, batch)
            else:
                emb, label_emb = self.student([e.text for e, _ in batch]), names
                labels = torch.tensor([task.intents.index(e.label) for e, _ in batch], dtype=torch.long)
            loss = task_loss(
                emb, label_emb, labels, scale=self.train.scale, label_smoothing=self.train.label_smoothing
            )
            if self.cfg.anchor > 0:
                t = torch.stack([teacher[e.text] for e, _ in batch])
                loss = loss + self.cfg.anchor * distill_loss(
                    emb[: len(batch)], t, t, scale=self.train.scale, temperature=2.0
                )
            if self.cfg.reference > 0:
                loss = loss + self.cfg.reference * reference_loss(
                    self.student,
                    self.teacher,
                    ref_rng,
                    batch=len(batch),
                    scale=self.train.scale,
                    temperature=2.0,
                )
            return loss

        steps = batches(items, batch_size=self.train.batch_size, epochs=self.train.epochs, rng=rng)
        cost = fit(trainable(self.peft), steps, loss_fn, lr=self.cfg.lr, total=num_steps(len(items), self.train),
                   desc=f"{self.name} task {index + 1} ({task.name})", progress=self.train.progress)  # fmt: skip
        self.model.eval()
        self.prefix.drop(texts)  # this task's utterances will not come back
        return cost

    def state_dict(self) -> dict[str, Any]:
        learned = self.adapters[: len(self.router.keys)]
        weights = {k: v for k, v in self.peft.state_dict().items() if any(f".{a}." in k for a in learned)}
        return {
            "adapters": learned,
            "weights": weights,
            "router": self.router.state_dict(),
            "names": [list(n) for n in self.names],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = [list(n) for n in state.get("names", [])]  # checkpoints before label routing have none
        if self.cfg.routing == "labels" and len(names) != len(state["adapters"]):
            raise EcruError(
                f"{self.name} routes by labels but the checkpoint holds no intent names for its tasks; "
                "fix: start this method's run again (delete its checkpoint folder)"
            )
        for index in range(len(self.adapters), len(state["adapters"])):
            self._add_adapter(index)
        missing = set(state["weights"]) - set(self.peft.state_dict())
        if missing:
            raise EcruError(f"checkpoint holds adapter weights this method lacks: {sorted(missing)[:3]}")
        self.peft.load_state_dict(state["weights"], strict=False)
        self.router.load_state_dict(state["router"])
        self.names = names
