"""Named methods: each is a preset of one of three mechanisms (full fine-tuning, LoRA adapters, or routed
per-task adapters)."""

from __future__ import annotations

from typing import Any

from ecru.errors import EcruError
from ecru.lifelong.methods.adapters import AdapterConfig, Adapters
from ecru.lifelong.methods.base import Method, TaskCost, TrainConfig
from ecru.lifelong.methods.finetune import Finetune, FinetuneConfig
from ecru.lifelong.methods.routed import RoutedAdapters, RoutedConfig
from ecru.lifelong.reference import TeacherCache
from ecru.lifelong.stream import Task
from ecru.models import MiniLM


class ZeroShot:
    """The frozen pretrained encoder: learns nothing, forgets nothing (the reference row R0)."""

    def __init__(self, name: str, model: MiniLM):
        self.name, self.model = name, model

    def learn(self, task: Task, *, index: int) -> TaskCost:
        return TaskCost()

    def encoder(self) -> MiniLM:
        return self.model

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


FINETUNE: dict[str, FinetuneConfig] = {
    "seqft": FinetuneConfig(),
    "lwf": FinetuneConfig(lwf=1.0),
    "replay": FinetuneConfig(replay_per_intent=5),
    "wise-ft": FinetuneConfig(wise_alpha=0.5),
    "zscl": FinetuneConfig(distill=1.0, we_snapshots=10),
    "independent": FinetuneConfig(reset=True),
    "joint": FinetuneConfig(reset=True, joint=True),
}
ADAPTERS: dict[str, AdapterConfig] = {
    "seqlora": AdapterConfig(),
    "lora-per-task": AdapterConfig(per_task=True),
    # ecru's previous design, a baseline now. Chosen from a 5-variant sweep on the quick stream's TEST utterances
    # (so its quick numbers flatter it): all linear layers of the top 4 layers, lr 5e-4, cached-teacher
    # distillation on 16 reference sentences per step, a weight ensemble of 5 adapter snapshots
    "ecru-shared": AdapterConfig(
        targets=("query", "key", "value", "dense"),
        layers=(2, 3, 4, 5),
        lr=5e-4,
        distill=1.0,
        ref_batch=16,
        we_snapshots=5,
        cache_prefix=True,
    ),  # fmt: skip
}
ROUTED: dict[str, RoutedConfig] = {
    # Chosen on CLINC150's VALIDATION split (bench/lifelong.py --split val: CLINC val utterances, Banking77's
    # training set as the held-out probe; 4 domains, 16 train / 8 val per intent, seed 0, order 0), never on
    # test. Swept from r=8 on q/k/v/dense of layers 2-5, lr 1e-3, knn 5: percentile 5 / 10 / 20, anchor 0 / 1 / 3,
    # lr 1e-3 / 2e-3, layers 2-5 / 3-5, frozen vs routed intent names. Routed names lost 2.7 transfer points
    # and 8.3 on Banking77 (names of unseen tasks routed into adapters); anchor 3 and percentile 10 cut the
    # Banking77 drop from -5.8 to -2.1 for 0.6 points of avg (bench/results/lifelong_NOTES.md).
    "ecru-text": RoutedConfig(anchor=3.0, percentile=10.0),
    # routed by the candidate labels first (a query among one learned task's intents -> that task's adapter;
    # among unseen labels -> the frozen model), the text router only between learned tasks the labels name.
    # No anchor: it protected foreign texts that the text router sent to an adapter, which label routing does
    # not do. Validation split, full budget (4 domains, 100 per intent; bench/results/lifelong_NOTES.md):
    # anchor 0 / 1 / 3 -> last 96.1 / 93.8 / 92.3, class-incremental last 84.3 / 77.7 / 76.4 with one embedding
    # scored against all names (seqft: 95.6 / 91.9); ecru now decides task then class (`predict_among`).
    "ecru": RoutedConfig(percentile=10.0, routing="labels"),
}
METHODS: tuple[str, ...] = ("zeroshot", *FINETUNE, *ADAPTERS, *ROUTED)
DISTILLING = frozenset(n for n, c in {**FINETUNE, **ADAPTERS}.items() if c.distill > 0)
Config = FinetuneConfig | AdapterConfig | RoutedConfig


def make_method(name: str, model: MiniLM, *, train: TrainConfig, teacher: TeacherCache | None = None,
                config: Config | None = None) -> Method:  # fmt: skip
    """The method called `name`, owning `model` (a fresh `load_minilm()`); distilling ones need `teacher`.

    `config` replaces the method's preset (same config type), e.g. for a hyper-parameter sweep.
    """
    if name == "zeroshot":
        return ZeroShot(name, model)
    for presets, cls in ((FINETUNE, Finetune), (ADAPTERS, Adapters)):
        if name in presets:
            return cls(name, model, train, _config(name, presets[name], config), teacher=teacher)
    if name in ROUTED:
        return RoutedAdapters(name, model, train, _config(name, ROUTED[name], config), teacher=teacher)
    raise EcruError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")


def needs_teacher(name: str, config: Config | None = None) -> bool:
    """Whether method `name` (with `config`, else its preset) uses the reference sentences' teacher cache."""
    if name in ROUTED:
        cfg = config or ROUTED[name]
        return cfg.negative_quantile is not None or cfg.reference > 0
    return name in DISTILLING


def _config(name: str, preset: Config, config: Config | None) -> Config:
    if config is not None and type(config) is not type(preset):
        raise EcruError(f"method {name!r} takes a {type(preset).__name__}, not a {type(config).__name__}")
    return preset if config is None else config
