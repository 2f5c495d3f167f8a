"""`routed-lora`: one small LoRA adapter per task on the top layers, and a router that picks one per text.

- Each task trains a fresh adapter on its own texts only (no distillation, no replay) and the adapter is never
  touched again, so later tasks cannot overwrite it.
- The frozen bottom layers' outputs are cached per text (`FrozenPrefix`): training and evaluation run only
  the adapted top layers.
- At inference a text goes through the adapter of the learned task it most resembles, or through the frozen
  model when it resembles none (`ecru.lifelong.router`): by default linear discriminant analysis over the
  frozen embeddings, with a prototype and a relative Mahalanobis test per task for "none". The route depends
  on the text alone, never on the labels it is classified among (task-agnostic).
- The decision is task then class (`RoutedEncoder.scores`): a text routed to task t is scored by t's adapter
  against t's labels; other learned tasks' labels get the frozen model's score minus `OFFSET`, so they only
  win when none of t's labels is a candidate; with a `margin`, labels no task learned keep their frozen score
  and win when the frozen model prefers them to t's names by more than the margin allows; a text routed to
  the frozen model is scored by the frozen model against every label. A label's score never depends on the
  other candidates, so one score matrix answers every candidate set.
- Intent names are the classifier's weights and stay frozen (`frozen_labels`): the adapters learn to map
  texts onto the pretrained model's name embeddings, so a name never depends on where it is routed."""

from __future__ import annotations

import random
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

from ecru.datasets import humanize_intent
from ecru.errors import EcruError
from ecru.lifelong.calibration import fit_scale, holdout_split
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
from ecru.lifelong.router import FROZEN, LDARouter, PrototypeRouter, Router, TaskRouter, class_prototypes
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
    """Encoder layers that get adapters (MiniLM has 0..5); the layers below them are frozen and cached."""
    lr: float = 1e-3
    """AdamW learning rate of each adapter."""
    label_smoothing: float | None = None
    """Label smoothing of each adapter's task loss; None: the run's `TrainConfig.label_smoothing`. An adapter
    only ever sees texts routed to its task, so it need not keep foreign labels' similarities up."""
    router: Literal["prototypes", "knn", "lda"] = "prototypes"
    """"prototypes": a text's score for a task is its best cosine similarity to the task's class means (stores
    C x D floats per task); "knn": the mean similarity to its `knn` nearest training texts (stores N x D);
    "lda": the task of the text's best class by linear discriminant analysis over every learned class (class
    means and a pooled, Ledoit-Wolf shrunk covariance of the frozen embeddings: stores C x D + D x D floats per
    task), with the prototype threshold of "prototypes" deciding whether it belongs to a learned task at all."""
    knn: int = 5
    """With the knn router: a text's score for a task is its mean cosine similarity to its `knn` nearest
    training texts."""
    percentile: float = 5.0
    """A task's threshold: this percentile of its training utterances' leave-one-out scores."""
    frozen_labels: bool = True
    """Intent names always go through the frozen model; False = names are routed and trained like utterances."""
    prototype_weight: float = 0.0
    """Among a routed task's labels, score = (1 - w) x the adapter's cosine + w x the frozen text embedding's
    cosine to the label's prototype (the router's class mean): nearest class mean and adapter as one
    classifier. Needs router="prototypes" or "lda"."""
    lda_weight: float = 0.0
    """With router="lda": among a routed task's labels, add lda_weight / scale x the text's LDA logit to the
    score; the order is that of the product of softmax(scale x score) and softmax(lda_weight x LDA logit)."""
    adapter_prototype_weight: float = 0.0
    """Among a routed task's labels, add w_c x the cosine of the text through the task's adapter to label c's
    adapter prototype: the normalised mean of c's training texts through the same adapter, computed once after
    training (C x D floats and C counts per task). The adapter was trained towards the label names; its own
    class means add what the names miss. w_c = this x n_c / (n_c + `adapter_prototype_support`) for a label
    with n_c training texts: a mean of few texts weighs less."""
    adapter_prototype_support: float = 8.0
    """Training texts at which a label's adapter prototype gets half of `adapter_prototype_weight`."""
    margin: float | None = None
    """None: a text routed to task t takes one of t's labels whenever one is a candidate. A number m >= -1 (a
    cosine difference): only if the frozen model's best score for any of t's labels plus m reaches
    its best score for the candidates no task learned; else the frozen model decides among the unlearned
    candidates. m = 0: the frozen model vetoes a route when it prefers an unlearned label; m < 0: also when
    an unlearned label comes within |m| of t's best (unlearned label sets keep more of their texts, learned
    tasks lose more of theirs to close unlearned names). Other learned tasks' labels lose to t's either way
    (the router chose between learned tasks)."""
    few_margin: float | None = None
    """With router="lda" and a `margin`: the margin of a task learned from fewer than `few_texts` training texts
    per label (on average); None: `margin` for every task. A task's thresholds are loose estimates when it has a
    few texts per label, so it claims more texts of labels no task learned; a stricter veto keeps them zero-shot."""
    few_texts: float = 8.0
    """Training texts per label below which a task's margin is `few_margin`."""
    reject_penalty: float = 0.0
    """0: a text below its best task's threshold goes to the frozen model. > 0 (with a `margin`): it still
    goes to its best task, but every learned label loses this much: the route's choice stands when every
    candidate is learned, and an unlearned candidate (an unseen task's, a held-out dataset's) wins otherwise. The price: a learned task's text that
    its router rejects (about `percentile`% of them, more with `rmd_percentile`) loses its label when unlearned
    labels are candidates."""
    rmd_percentile: float | None = None
    """With router="lda": a text routed to task t must also pass t's relative Mahalanobis test (the frozen
    embedding's background distance minus its nearest-class distance, from the LDA statistics; Ren et al.,
    2021) at this percentile of t's training texts' cross-fitted scores; None: the prototype test alone."""
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
    calibration: float = 0.0
    """Fraction of each task's training texts held out (per label, deterministic) to fit the task's score scale
    (`ecru.lifelong.calibration.fit_scale`), so that a routed text's softmax score is a probability; 0: none held
    out, scores use `TrainConfig.scale` as trained."""
    admit: float = 0.0
    """With `calibration`: each task's router thresholds go down (never up) to this quantile of its held-out
    texts' scores (`TaskRouter.admit`), so that about 1 - admit of a task's new texts are claimed by it."""
    score_scale: float | None = None
    """The scale of a task's probabilities (softmax(scale x scores)) when no scale was fitted for it
    (`calibration` 0); None: `TrainConfig.scale`, the training scale."""
    scale_prior: float = 0.0
    """With `calibration`: weight of the log-normal prior, centred on the unfitted scale (`score_scale`), on
    each task's fitted scale (`fit_scale`'s `strength`: MAP temperature scaling); 0: the held-out texts' maximum
    likelihood alone, which a held-out set answered all right sends to the top of `SCALE_RANGE`."""

    def __post_init__(self) -> None:
        if self.r < 1 or self.alpha <= 0 or self.lr <= 0 or self.knn < 1:
            raise EcruError(
                f"need r >= 1, alpha > 0, lr > 0, knn >= 1; got {self.r}, {self.alpha}, {self.lr}, {self.knn}"
            )
        if not self.layers or any(i < 0 for i in self.layers):
            raise EcruError(f"layers must name encoder layers (0..5 for MiniLM); got {self.layers}")
        if self.anchor < 0:
            raise EcruError(f"anchor must be >= 0; got {self.anchor}")
        if not 0 <= self.percentile <= 100:
            raise EcruError(f"percentile must be in [0, 100]; got {self.percentile}")
        if self.label_smoothing is not None and not 0 <= self.label_smoothing < 1:
            raise EcruError(f"label_smoothing must be in [0, 1) or None; got {self.label_smoothing}")
        if self.reference < 0:
            raise EcruError(f"reference must be >= 0; got {self.reference}")
        if not 0 <= self.prototype_weight <= 1:
            raise EcruError(f"prototype_weight must be in [0, 1]; got {self.prototype_weight}")
        if self.prototype_weight > 0 and self.router not in ("prototypes", "lda"):
            raise EcruError(
                "prototype_weight needs router='prototypes' or 'lda' (the class means it scores against)"
            )
        if not self.lda_weight >= 0:
            raise EcruError(f"lda_weight must be >= 0; got {self.lda_weight}")
        if self.rmd_percentile is not None and not (self.router == "lda" and 0 <= self.rmd_percentile <= 100):
            raise EcruError(
                f"rmd_percentile needs router='lda' and a value in [0, 100]; got {self.rmd_percentile}"
            )
        if self.lda_weight > 0 and self.router != "lda":
            raise EcruError("lda_weight needs router='lda' (the discriminant it adds)")
        if not (self.adapter_prototype_weight >= 0 and self.adapter_prototype_support > 0):
            raise EcruError("adapter_prototype_weight must be >= 0 and adapter_prototype_support > 0; got "
                            f"{self.adapter_prototype_weight}, {self.adapter_prototype_support}")  # fmt: skip
        if not self.reject_penalty >= 0:
            raise EcruError(f"reject_penalty must be >= 0; got {self.reject_penalty}")
        if self.reject_penalty > 0 and self.margin is None:
            raise EcruError("reject_penalty needs a margin (the rule that lets an unlearned label win)")
        if self.few_margin is not None and not (
            self.router == "lda" and self.margin is not None and self.few_margin >= -1 and self.few_texts > 0
        ):
            raise EcruError(
                f"few_margin needs router='lda', a margin, a value >= -1 and few_texts > 0; got "
                f"{self.few_margin}, {self.router!r}, {self.margin}, {self.few_texts}"
            )
        if self.margin is not None and not self.margin >= -1:
            raise EcruError(f"margin must be >= -1 (a cosine difference) or None; got {self.margin}")
        if self.router not in ("prototypes", "knn", "lda"):
            raise EcruError(f"router must be 'prototypes', 'knn' or 'lda'; got {self.router!r}")
        if self.score_scale is not None and not self.score_scale > 0:
            raise EcruError(f"score_scale must be > 0 or None; got {self.score_scale}")
        if not self.scale_prior >= 0:
            raise EcruError(f"scale_prior must be >= 0; got {self.scale_prior}")
        if not 0 <= self.admit <= 1:
            raise EcruError(f"admit must be a quantile in [0, 1]; got {self.admit}")
        if not 0 <= self.calibration < 1:
            raise EcruError(
                f"calibration must be in [0, 1) (a fraction of the training texts); got {self.calibration}"
            )
        if self.negative_quantile is not None and not 0 < self.negative_quantile <= 1:
            raise EcruError(f"negative_quantile must be in (0, 1] or None; got {self.negative_quantile}")


OFFSET = 2.0
"""Subtracted from the frozen score of a label foreign to the routed task (plus |margin| when the margin is
negative): cosines lie in [-1, 1], so the routed task's best label always beats another learned task's."""
MEMO_ITEMS = 32_768
"""Embeddings an encoder keeps (least recently used first out): predicting a long file stays bounded."""


OPEN_SET_WITHIN_WEIGHT = 0.4
"""Cosine of the claim per unit of the best within-task score in `RoutedEncoder.open_set_grades`. Chosen on the
full stream's VALIDATION split (`bench/experiments/lifelong_oos_grade.py`, seed 0 order 0, the adapters
trained): AUROC of the in-scope texts against `oos_val` 0.9796 for the claim alone, 0.9794 with 0.04 x ln p
(the grade before), 0.9813 / 0.9815 / 0.9816 / 0.9814 / 0.9812 with 0.2 / 0.3 / 0.4 / 0.5 / 0.6 x the best
within-task score (the adapter's cosine to its names, 0.9640 alone); with `oos_val` in halves, at the 80% /
84% quantiles it abstains 0.68 / 0.87 points of in-scope accuracy for 76 / 84% recall (0.58 / 1.55 for 76 / 85
with ln p)."""


class RoutedEncoder:
    """Texts through the adapter of the task the router picks (or the frozen model); names per `frozen_labels`."""

    def __init__(self, method: RoutedAdapters, *, memo_items: int = MEMO_ITEMS):
        self.m, self.memo_items = method, memo_items
        self._memo: OrderedDict[tuple[int, str], torch.Tensor] = OrderedDict()  # (route, text) -> embedding

    def _remember(self, key: tuple[int, str], emb: torch.Tensor) -> None:
        self._memo[key] = emb
        self._memo.move_to_end(key)
        while len(self._memo) > self.memo_items:
            self._memo.popitem(last=False)

    @torch.no_grad()
    def _embed(self, texts: list[str], route: int, *, batch_size: int) -> torch.Tensor:
        """`texts` through task `route`'s adapter (`FROZEN`: none), from the cached prefix; each (text, route)
        computed once while it stays in the memo, so take a new encoder after the method learns."""
        found = {t: self._memo[route, t] for t in texts if (route, t) in self._memo}
        todo = list(dict.fromkeys(t for t in texts if t not in found))
        if todo:
            if route == FROZEN:
                with self.m.peft.disable_adapter():
                    emb = self.m.student.encode(todo, batch_size=batch_size)
            else:
                self.m.peft.base_model.set_adapter(self.m.adapters[route])
                emb = self.m.student.encode(todo, batch_size=batch_size)
            found.update(zip(todo, emb, strict=True))
        for t in dict.fromkeys(texts):
            self._remember((route, t), found[t])
        if not texts:
            return self.m.student.encode([])
        return torch.stack([found[t] for t in texts])

    def frozen(self, texts: list[str], *, batch_size: int = 64) -> torch.Tensor:
        """The pretrained model's embeddings (adapters off)."""
        return self._embed(texts, FROZEN, batch_size=batch_size)

    def routes(self, texts: list[str]) -> torch.Tensor:
        """Each text's task index, or `FROZEN`, from the text alone."""
        return self.m.router(self.frozen(texts))

    def claim_scores(self, texts: list[str], *, standardise: bool = True) -> torch.Tensor:
        """[Q] how strongly the learned tasks claim each text: its best task's score standardised by that task's
        own texts' scores (`TaskRouter.claim_margin`, in standard deviations; `standardise=False`: minus their
        mean only, in cosine); -inf before any task is learned."""
        if not len(self.m.router):
            return torch.full((len(texts),), float("-inf"), dtype=torch.float64)
        return self.m.router.claim_margin(self.frozen(texts), standardise=standardise).double()

    def open_set_grades(self, texts: list[str]) -> torch.Tensor:
        """[Q] each text's in-scope grade for a threshold set on out-of-scope examples (`OpenSetEvaluator`): its
        claim in cosine (`claim_scores(standardise=False)`, the frozen model's view) plus
        `OPEN_SET_WITHIN_WEIGHT` x its best within-task score (`best_within_task`, the adapter's)."""
        within = self.best_within_task(texts)
        return self.claim_scores(texts, standardise=False) + OPEN_SET_WITHIN_WEIGHT * within

    @torch.no_grad()
    def best_within_task(self, texts: list[str], *, batch_size: int = 64) -> torch.Tensor:
        """[Q] each text's best within-task score (`_blend`: the adapter's cosine to the names as the preset
        blends it) in the task the router ranks first (no open-set veto); -inf before any task is learned."""
        out = torch.full((len(texts),), float("-inf"), dtype=torch.float64)
        if not len(self.m.router):
            return out
        frozen = self.frozen(texts, batch_size=batch_size)
        routes = self.m.router(frozen, open_set=False)
        for task in routes.unique().tolist():
            rows = (routes == task).nonzero().flatten()
            emb = self._embed([texts[i] for i in rows.tolist()], task, batch_size=batch_size)
            blend = self._blend(frozen[rows], emb, self.encode_labels(self.m.names[task]), task)
            out[rows] = blend.max(-1).values.double()
        return out

    @torch.no_grad()
    def probabilities(self, texts: list[str], names: list[str]) -> torch.Tensor:
        """[Q, L] probabilities of the candidate `names` for `texts`: the softmax of the `scores` times the
        scale of the task whose labels scored each text (`RoutedAdapters.scale`)."""
        scores = self.scores(texts, names)
        # the task whose labels scored the text: with a reject penalty every text goes to its best task
        scored_by = self.m.router(self.frozen(texts), open_set=self.m.cfg.reject_penalty == 0)
        scale = torch.tensor([self.m.scale(r) for r in scored_by.tolist()], dtype=torch.float64)
        return torch.softmax(scale[:, None] * scores.double(), dim=-1)

    def _through(self, texts: list[str], routes: torch.Tensor, *, batch_size: int) -> torch.Tensor:
        out = self.frozen(texts, batch_size=batch_size)
        for task in routes.unique().tolist():
            if task != FROZEN:
                idx = (routes == task).nonzero().flatten()
                out[idx] = self._embed([texts[i] for i in idx.tolist()], task, batch_size=batch_size)
        return out

    def encode(self, texts: list[str], *, batch_size: int = 64) -> torch.Tensor:
        """Each text through the adapter the router picks (or the frozen model)."""
        return self._through(texts, self.routes(texts), batch_size=batch_size)

    def encode_labels(self, texts: list[str], *, batch_size: int = 64) -> torch.Tensor:
        """Class names (intent names): frozen, or routed like any text when `frozen_labels` is off."""
        return self.frozen(texts, batch_size=batch_size) if self.m.cfg.frozen_labels else self.encode(texts)

    @torch.no_grad()
    def scores(self, texts: Sequence[str], labels: Sequence[str], *, batch_size: int = 64) -> torch.Tensor:
        """[Q, L] cosine scores of `texts` for the class names `labels`, task then class (module docstring).

        Column l depends on texts and labels[l] alone: scoring against fewer labels gives the same columns.
        """
        if isinstance(texts, str) or isinstance(labels, str):
            raise TypeError("scores takes lists of strings, not one string: scores([text], [label, ...])")
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # less padding per batch
        ordered = [texts[i] for i in order]
        frozen = self.frozen(ordered, batch_size=batch_size)
        routes = self.m.router(frozen)
        names = self.encode_labels(list(labels), batch_size=batch_size)
        out = frozen @ names.T
        rejected = routes == FROZEN
        known = {n for names_t in self.m.names for n in names_t}
        learned = torch.tensor([label in known for label in labels], dtype=torch.bool)
        if self.m.cfg.reject_penalty > 0 and len(self.m.router):
            routes = self.m.router(
                frozen, open_set=False
            )  # every text to its best task; `rejected` penalised
        for task in routes.unique().tolist():
            if task == FROZEN:
                continue
            rows = (routes == task).nonzero().flatten()
            emb = self._embed([ordered[i] for i in rows.tolist()], task, batch_size=batch_size)
            block = self._task_then_class(out[rows], frozen[rows], emb, names, labels, task)
            block[:, learned] -= self.m.cfg.reject_penalty * rejected[rows].to(block.dtype)[:, None]
            out[rows] = block
        result = torch.empty_like(out)
        result[torch.tensor(order, dtype=torch.long)] = out
        return result

    def _task_then_class(self, block: torch.Tensor, frozen: torch.Tensor, emb: torch.Tensor, names: torch.Tensor,
                         labels: Sequence[str], task: int, *, gate: bool = True) -> torch.Tensor:  # fmt: skip
        """Scores of texts routed to `task`: `block` [R, L] frozen scores, `frozen` [R, D] and `emb` [R, D] the
        texts through the frozen model and the adapter, `names` [L, D] the candidate `labels`' embeddings.
        `gate=False`: the task is given, not inferred (no margin veto)."""
        task_names = self.m.names[task]
        own = torch.tensor([label in set(task_names) for label in labels], dtype=torch.bool)
        index = {n: k for k, n in enumerate(task_names)}
        cols = [index[n] for n, o in zip(labels, own.tolist(), strict=True) if o]
        name_emb = self.encode_labels(task_names)
        blend = self._blend(frozen, emb, name_emb, task)
        margin = self.m.margin(task)
        if margin is None or not gate:
            block = block - OFFSET
            block[:, own] = blend[:, cols]
            return block
        # other learned tasks' labels: the router already chose between learned tasks
        learned = {n for names_t in self.m.names for n in names_t}
        other = torch.tensor([label in learned for label in labels], dtype=torch.bool) & ~own
        block[:, other] -= OFFSET - min(margin, 0.0)
        # the task's best label scores as the frozen model's best cosine to any of the task's names (+ margin),
        # on the same scale as the unlearned candidates' frozen cosines; the others trail it by their blend gap
        best = (frozen @ name_emb.T).max(-1, keepdim=True).values
        block[:, own] = best + margin + blend[:, cols] - blend.max(-1, keepdim=True).values
        return block

    def _blend(
        self, frozen: torch.Tensor, emb: torch.Tensor, name_emb: torch.Tensor, task: int
    ) -> torch.Tensor:
        """[R, C_task] within-task scores of every label of `task` (candidate or not: column independence): the
        adapter's cosine to the names, blended with the frozen cosine to the labels' prototypes, plus the LDA
        logits and the adapter's cosine to its own class means, each as the config weighs them."""
        cfg, dtype = self.m.cfg, emb.dtype
        blend = emb @ name_emb.T
        if cfg.prototype_weight > 0:
            protos = self.m.router.prototypes[task].to(dtype)
            blend = (1 - cfg.prototype_weight) * blend + cfg.prototype_weight * frozen @ protos.T
        if cfg.lda_weight > 0:
            blend = blend + cfg.lda_weight / self.m.train.scale * self.m.router.logits(frozen, task)
        if cfg.adapter_prototype_weight > 0 and self.m.adapter_prototypes[task] is not None:
            protos, counts = self.m.adapter_prototypes[task]
            blend = blend + emb @ protos.to(dtype).T * self.m.adapter_prototype_weights(counts).to(dtype)
        return blend

    def for_task(self, task: int) -> TaskEncoder:
        """The encoder told the task (the label-gated protocol): every text through `task`'s adapter."""
        if not 0 <= task < len(self.m.router):
            raise EcruError(f"task {task} is not learned (0..{len(self.m.router) - 1})")
        return TaskEncoder(self, task)


class TaskEncoder:
    """A `RoutedEncoder` with the route fixed to one learned task (given, not inferred)."""

    def __init__(self, routed: RoutedEncoder, task: int):
        self.routed, self.task = routed, task

    def encode(self, texts: list[str], *, batch_size: int = 64) -> torch.Tensor:
        return self.routed._embed(list(texts), self.task, batch_size=batch_size)

    def encode_labels(self, texts: list[str], *, batch_size: int = 64) -> torch.Tensor:
        return self.routed.encode_labels(texts, batch_size=batch_size)

    @torch.no_grad()
    def scores(self, texts: Sequence[str], labels: Sequence[str], *, batch_size: int = 64) -> torch.Tensor:
        """[Q, L] scores with every text routed to the given task (its labels through the adapter)."""
        texts, labels = list(texts), list(labels)
        frozen, names = self.routed.frozen(texts), self.encode_labels(labels)
        emb = self.encode(texts, batch_size=batch_size)
        return self.routed._task_then_class(
            frozen @ names.T, frozen, emb, names, labels, self.task, gate=False
        )


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
        # each learned task's class means through its own adapter and their counts (None: not kept, as in stores
        # made before)
        self.adapter_prototypes: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self.scales: list[float | None] = []  # each task's fitted score scale (None: not calibrated)
        self.router: TaskRouter = _make_router(cfg)
        layers = len(self.prefix_model_layers(model))
        if max(cfg.layers) >= layers:
            raise EcruError(f"layers {cfg.layers} do not exist: the encoder has layers 0..{layers - 1}")
        # peft wraps the model around a first adapter: task 0's, unused until task 0 is learned
        self._add_adapter(0)
        self.prefix = FrozenPrefix(model, min(cfg.layers))
        self.student = PrefixCachedEncoder(model, self.prefix)

    @staticmethod
    def prefix_model_layers(model: MiniLM):
        enc = model.encoder
        bert = enc.get_base_model() if hasattr(enc, "get_base_model") else enc
        layers = getattr(getattr(bert, "encoder", None), "layer", None)
        if layers is None:
            raise EcruError("routed-lora needs a BERT-style encoder (encoder.layer); this model has none")
        return layers

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
        if index != len(self.router):
            raise EcruError(
                f"{self.name} learns tasks in order: expected task {len(self.router)}, got {index}"
            )
        rng, enc = seed_task(self.train.seed, index), self.encoder()
        if index >= len(self.adapters):
            self._add_adapter(index)
        kept, held = holdout_split([e.label for e in task.train], self.cfg.calibration,
                                   seed=self.train.seed * 7_927 + index)  # fmt: skip
        held = [task.train[i] for i in held]
        task = replace(task, train=tuple(task.train[i] for i in kept))
        texts = [e.text for e in task.train]
        frozen = enc.frozen(texts)
        negatives = self.teacher.embeddings() if self.cfg.negative_quantile is not None else None
        labels = torch.tensor([task.intents.index(e.label) for e in task.train], dtype=torch.long)
        self.router.add_task(frozen, labels=labels, negatives=negatives)
        teacher = dict(zip(texts, frozen, strict=True))
        self.names.append([humanize_intent(i) for i in task.intents])
        names = enc.frozen(self.names[-1]) if self.cfg.frozen_labels else None
        self._activate(self.adapters[index])
        items = [(e, task) for e in task.train]
        ref_rng = random.Random(self.train.seed * 7_919 + index)  # reference batches: apart from batch order
        self.model.train()
        smoothing = (
            self.train.label_smoothing if self.cfg.label_smoothing is None else self.cfg.label_smoothing
        )

        def loss_fn(batch: list, step: int) -> torch.Tensor:
            if names is None:  # names trained through the adapter too
                emb, label_emb, labels, _ = intent_batch(self.student, batch)
            else:
                emb, label_emb = self.student([e.text for e, _ in batch]), names
                labels = torch.tensor([task.intents.index(e.label) for e, _ in batch], dtype=torch.long)
            loss = task_loss(emb, label_emb, labels, scale=self.train.scale, label_smoothing=smoothing)
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
        self.adapter_prototypes.append(self._adapter_prototypes(texts, labels, index, len(task.intents)))
        self.scales.append(self._calibrate(held, task.intents, index))
        self.prefix.drop(texts + [e.text for e in held])  # this task's utterances will not come back
        return cost

    @torch.no_grad()
    def _calibrate(self, held: list, intents: tuple[str, ...], index: int) -> float | None:
        """Task `index`'s score scale fitted on its held-out examples `held` (None when none was held out); its
        router thresholds admit them (`RoutedConfig.admit`)."""
        if not held:
            return None
        self.router.admit(index, self.encoder().frozen([e.text for e in held]), quantile=self.cfg.admit)
        cosines = self.encoder().for_task(index).scores([e.text for e in held], self.names[index])
        labels = torch.tensor([intents.index(e.label) for e in held], dtype=torch.long)
        return fit_scale(cosines, labels, prior=self.scale(FROZEN), strength=self.cfg.scale_prior)

    def margin(self, task: int) -> float | None:
        """Task `task`'s margin: `RoutedConfig.few_margin` if it was learned from fewer than `few_texts` texts per
        label (the LDA router's count of its texts over its labels), else `RoutedConfig.margin`."""
        if self.cfg.few_margin is not None and self.router.counts[task] < self.cfg.few_texts * len(
            self.names[task]
        ):
            return self.cfg.few_margin
        return self.cfg.margin

    def scale(self, task: int) -> float:
        """The logit scale of texts routed to `task` (`FROZEN`: the frozen model, and the prior of a fitted
        scale): fitted, else the config's `score_scale`, else as trained."""
        fitted = self.scales[task] if task != FROZEN else None
        unfitted = self.train.scale if self.cfg.score_scale is None else self.cfg.score_scale
        return unfitted if fitted is None else fitted

    @torch.no_grad()
    def _adapter_prototypes(self, texts: list[str], labels: torch.Tensor, index: int, classes: int):
        """The normalised class means [classes, D] of `texts` through task `index`'s (trained) adapter and the
        texts per class [classes], or None when the preset does not score with them."""
        if self.cfg.adapter_prototype_weight == 0:
            return None
        emb = self.encoder()._embed(texts, index, batch_size=64)
        return class_prototypes(emb, labels, classes), torch.bincount(labels, minlength=classes).float()

    def adapter_prototype_weights(self, counts: torch.Tensor) -> torch.Tensor:
        """w_c of each label with `counts` training texts (`RoutedConfig.adapter_prototype_weight`)."""
        return self.cfg.adapter_prototype_weight * counts / (counts + self.cfg.adapter_prototype_support)

    def state_dict(self) -> dict[str, Any]:
        learned = self.adapters[: len(self.router)]
        weights = {k: v for k, v in self.peft.state_dict().items() if any(f".{a}." in k for a in learned)}
        return {
            "adapters": learned,
            "weights": weights,
            "router": self.router.state_dict(),
            "names": [list(n) for n in self.names],
            "adapter_prototypes": list(self.adapter_prototypes),
            "scales": list(self.scales),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = [list(n) for n in state.get("names", [])]
        if len(names) != len(state["adapters"]):
            raise EcruError(
                f"{self.name}: the checkpoint holds no intent names for its tasks (written before task-then-class "
                "scoring); fix: start this method's run again (delete its checkpoint folder)"
            )
        for index in range(len(self.adapters), len(state["adapters"])):
            self._add_adapter(index)
        missing = set(state["weights"]) - set(self.peft.state_dict())
        if missing:
            raise EcruError(f"checkpoint holds adapter weights this method lacks: {sorted(missing)[:3]}")
        self.peft.load_state_dict(state["weights"], strict=False)
        self.router.load_state_dict(state["router"])
        self.names = names
        kept = list(state.get("adapter_prototypes", [None] * len(names)))
        if len(kept) != len(names):
            raise EcruError(f"{self.name}: the checkpoint holds adapter prototypes for {len(kept)} tasks, not "
                            f"{len(names)}; fix: start this method's run again (delete its checkpoint folder)")  # fmt: skip
        self.adapter_prototypes = kept
        self.scales = list(state.get("scales", [None] * len(names)))

    def add_trained(self, weights: dict[str, torch.Tensor], router: dict[str, Any], names: list[str],
                    adapter_prototypes: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:  # fmt: skip
        """Append a task trained elsewhere: its adapter `weights` as peft saves them (`export_task`), its router
        state (one task's), its label names and its adapter prototypes with their counts (None: not kept)."""
        index = len(self.router)
        if index >= len(self.adapters):
            self._add_adapter(index)
        router = dict(router)
        scale = router.pop("scales", [None])[0]  # the task's fitted score scale travels with its router state
        result = set_peft_model_state_dict(self.peft, weights, adapter_name=self.adapters[index])
        if any(self.adapters[index] in k for k in getattr(result, "missing_keys", [])):
            raise EcruError("the stored adapter does not fit this model's layers; relearn the task")
        one = type(self.router)(**_router_args(self.router))
        one.load_state_dict(router)
        merged = {k: [*v, *one.state_dict()[k]] for k, v in self.router.state_dict().items()}
        self.router.load_state_dict(merged)
        self.names.append(list(names))
        self.adapter_prototypes.append(adapter_prototypes)
        self.scales.append(scale)
        self.peft.base_model.set_adapter(self.adapters[index])
        self.model.eval()

    def export_task(
        self, index: int
    ) -> tuple[dict[str, torch.Tensor], Any, dict[str, Any], tuple[torch.Tensor, torch.Tensor] | None]:
        """Task `index`'s adapter weights (peft's saved form), its peft config, its router state and its
        adapter prototypes with their counts (None: not kept)."""
        weights = get_peft_model_state_dict(self.peft, adapter_name=self.adapters[index])
        state = {k: v[index : index + 1] for k, v in self.router.state_dict().items()}
        if self.scales[index] is not None:
            state["scales"] = [self.scales[index]]
        return (
            weights,
            self.peft.peft_config[self.adapters[index]],
            state,
            self.adapter_prototypes[index],
        )


def _make_router(cfg: RoutedConfig) -> TaskRouter:
    if cfg.router == "knn":
        return Router(k=cfg.knn, percentile=cfg.percentile, negative_quantile=cfg.negative_quantile)
    if cfg.router == "lda":
        return LDARouter(percentile=cfg.percentile, negative_quantile=cfg.negative_quantile,
                         rmd_percentile=cfg.rmd_percentile)  # fmt: skip
    return PrototypeRouter(percentile=cfg.percentile, negative_quantile=cfg.negative_quantile)


def _router_args(router: TaskRouter) -> dict[str, Any]:
    if isinstance(router, LDARouter):
        return {"percentile": router.percentile, "negative_quantile": router.negative_quantile,
                "rmd_percentile": router.rmd_percentile}  # fmt: skip
    if isinstance(router, PrototypeRouter):
        return {"percentile": router.percentile, "negative_quantile": router.negative_quantile}
    return {"k": router.k, "percentile": router.percentile, "negative_quantile": router.negative_quantile}
