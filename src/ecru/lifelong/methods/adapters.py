"""LoRA adapters (HF peft) on a frozen encoder: `seqlora`, `lora-per-task` (+ merging) and `shared-lora-zscl`.

`shared-lora-zscl` (formerly `ecru-shared`, a baseline) = one LoRA adapter on every linear layer of the top layers only, so the frozen bottom layers' outputs
are computed once per text and cached (training and evaluation run only the top layers), distilled towards
the frozen initial model on reference sentences whose teacher embeddings are cached once, with a weight
ensemble of the adapter tensors alone (a running mean of snapshots, starting from the pre-task adapter).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from peft import LoraConfig, get_peft_model

from ecru.errors import EcruError
from ecru.lifelong.evaluate import Encoder
from ecru.lifelong.losses import task_loss
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
    trainable,
)  # fmt: skip
from ecru.lifelong.prefix import FrozenPrefix, PrefixCachedEncoder
from ecru.lifelong.reference import TeacherCache
from ecru.lifelong.stream import Task
from ecru.models import MiniLM

MERGED = "merged"


@dataclass(frozen=True)
class AdapterConfig:
    """LoRA adapters and the regularisers around them."""

    r: int = 8
    """LoRA rank."""
    alpha: float = 16.0
    """LoRA alpha (the update is scaled by alpha / r)."""
    targets: tuple[str, ...] = ("query", "value")
    """Names of the BERT linear layers that get an adapter."""
    layers: tuple[int, ...] | None = None
    """Encoder layers (0..5) that get adapters; None = all. Top layers only = a shorter backward pass."""
    lr: float = 5e-4
    """AdamW learning rate of the adapter weights."""
    per_task: bool = False
    """A fresh adapter per task; evaluation uses their merge (peft `add_weighted_adapter`, 'cat')."""
    merge_weight: float | None = 1.0
    """Weight of each task's adapter in the merge (task arithmetic); None = 1/number of tasks."""
    distill: float = 0.0
    """Weight of distillation from the frozen initial model on reference sentences (cached teacher)."""
    ref_batch: int = 32
    """Reference sentences per step."""
    temperature: float = 2.0
    """Distillation temperature."""
    we_snapshots: int = 0
    """Adapter snapshots averaged per task, evenly spaced (0 = off)."""
    cache_prefix: bool = False
    """Cache the outputs of the frozen layers below the lowest adapted one (needs `layers`)."""

    def __post_init__(self) -> None:
        if self.r < 1 or self.alpha <= 0 or self.lr <= 0:
            raise EcruError(
                f"need r >= 1, alpha > 0, lr > 0; got r={self.r}, alpha={self.alpha}, lr={self.lr}"
            )
        if self.layers is not None and (not self.layers or any(not 0 <= i < 6 for i in self.layers)):
            raise EcruError(f"layers must name MiniLM layers 0..5 (or be None for all); got {self.layers}")
        if self.distill < 0 or self.we_snapshots < 0 or self.ref_batch < 1 or self.temperature <= 0:
            raise EcruError("need distill >= 0, we_snapshots >= 0, ref_batch >= 1, temperature > 0")
        if self.cache_prefix and (self.layers is None or self.per_task):
            raise EcruError("cache_prefix needs adapters on the top `layers` only, and a single adapter")
        if self.merge_weight is not None and self.merge_weight <= 0:
            raise EcruError(f"merge_weight must be > 0 or None; got {self.merge_weight}")

    def lora(self) -> LoraConfig:
        return lora_config(r=self.r, alpha=self.alpha, targets=self.targets, layers=self.layers)


def lora_config(
    *, r: int, alpha: float, targets: tuple[str, ...], layers: tuple[int, ...] | None
) -> LoraConfig:
    """peft's LoRA config: rank `r` on the `targets` linear layers of encoder `layers` (None = all), no dropout."""
    return LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                      layers_to_transform=list(layers) if layers is not None else None, lora_dropout=0.0)  # fmt: skip


class Adapters:
    """Trains LoRA adapters only; the pretrained weights stay frozen (and are never stored)."""

    def __init__(self, name: str, model: MiniLM, train: TrainConfig, cfg: AdapterConfig,
                 *, teacher: TeacherCache | None = None):  # fmt: skip
        if cfg.distill > 0 and teacher is None:
            raise EcruError(f"method {name!r} distils on reference sentences: pass a TeacherCache")
        self.name, self.model, self.train, self.cfg, self.teacher = name, model, train, cfg, teacher
        self.adapters: list[str] = [self._adapter_name(0)]
        # the adapter's random init must not depend on what ran before in this process
        with warnings.catch_warnings(), torch.random.fork_rng():
            warnings.simplefilter(
                "ignore", FutureWarning
            )  # transformers' deprecation notice, raised inside peft
            torch.manual_seed(train.seed)
            model.encoder = get_peft_model(model.encoder, cfg.lora(), adapter_name=self.adapters[0])
        self.prefix = FrozenPrefix(model, min(cfg.layers)) if cfg.cache_prefix else None
        # the student: the whole encoder, or only its adapted top layers on cached frozen-prefix states
        self.student = PrefixCachedEncoder(model, self.prefix) if self.prefix is not None else model

    def _adapter_name(self, index: int) -> str:
        return f"task{index}" if self.cfg.per_task else "default"

    @property
    def peft(self):
        return self.model.encoder

    def encoder(self) -> Encoder:
        return self.student

    def _activate(self, adapter: str) -> None:
        self.peft.base_model.set_adapter(adapter)
        for n, p in self.peft.named_parameters():
            p.requires_grad_(f".{adapter}." in n and "lora_" in n)

    def learn(self, task: Task, *, index: int) -> TaskCost:
        rng, cfg = seed_task(self.train.seed, index), self.cfg
        adapter = self._adapter_name(index)
        if adapter not in self.adapters:
            self.peft.add_adapter(adapter, cfg.lora())
            self.adapters.append(adapter)
        self._activate(adapter)
        params = trainable(self.peft)
        avg = [p.detach().clone() for p in params] if cfg.we_snapshots > 0 else None
        items = [(e, task) for e in task.train]
        self.model.train()

        def loss_fn(batch: list, step: int) -> torch.Tensor:
            emb, names, labels, _ = intent_batch(self.student, batch)
            loss = task_loss(
                emb, names, labels, scale=self.train.scale, label_smoothing=self.train.label_smoothing
            )
            if cfg.distill > 0:
                loss = loss + cfg.distill * reference_loss(self.student, self.teacher, rng, batch=cfg.ref_batch,
                                                           scale=self.train.scale, temperature=cfg.temperature)  # fmt: skip
            return loss

        snapshots = [1]
        total = num_steps(len(items), self.train)
        snapshot_at = snapshot_steps(total, cfg.we_snapshots)

        def after_step(step: int) -> None:
            if avg is not None and step in snapshot_at:
                snapshots[0] += 1
                with torch.no_grad():
                    for a, p in zip(avg, params, strict=True):
                        a.lerp_(p, 1.0 / snapshots[0])

        steps = batches(items, batch_size=self.train.batch_size, epochs=self.train.epochs, rng=rng)
        cost = fit(params, steps, loss_fn, lr=cfg.lr, total=total,
                   desc=f"{self.name} task {index + 1} ({task.name})", progress=self.train.progress, after_step=after_step)  # fmt: skip
        self.model.eval()
        if avg is not None:
            with torch.no_grad():
                for a, p in zip(avg, params, strict=True):
                    p.copy_(a)
        if cfg.per_task:
            self._merge()
        if self.prefix is not None:  # this task's utterances will not come back
            self.prefix.drop(e.text for e in task.train)
        return cost

    def _merge(self) -> None:
        """Evaluate with the merge of all task adapters: a weighted sum of their low-rank updates."""
        if MERGED in self.peft.peft_config:
            self.peft.delete_adapter(MERGED)
        w = self.cfg.merge_weight if self.cfg.merge_weight is not None else 1.0 / len(self.adapters)
        self.peft.add_weighted_adapter(
            self.adapters, [w] * len(self.adapters), MERGED, combination_type="cat"
        )
        self._activate(MERGED)

    def state_dict(self) -> dict[str, Any]:
        weights = {k: v for k, v in self.peft.state_dict().items() if "lora_" in k and f".{MERGED}." not in k}
        return {"adapters": list(self.adapters), "weights": weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for adapter in state["adapters"]:
            if adapter not in self.adapters:
                self.peft.add_adapter(adapter, self.cfg.lora())
                self.adapters.append(adapter)
        missing = set(state["weights"]) - set(self.peft.state_dict())
        if missing:
            raise EcruError(f"checkpoint holds adapter weights this method lacks: {sorted(missing)[:3]}")
        self.peft.load_state_dict(state["weights"], strict=False)
        if self.cfg.per_task:
            self._merge()
        else:
            self._activate(self.adapters[-1])
