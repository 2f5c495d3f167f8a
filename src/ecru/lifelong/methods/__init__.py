"""Continual-learning methods behind one protocol (`Method`)."""

from ecru.lifelong.methods.adapters import AdapterConfig, Adapters
from ecru.lifelong.methods.base import Method, TaskCost, TrainConfig
from ecru.lifelong.methods.finetune import Finetune, FinetuneConfig
from ecru.lifelong.methods.registry import ADAPTERS, DISTILLING, FINETUNE, METHODS, ZeroShot, make_method

__all__ = [
    "ADAPTERS",
    "DISTILLING",
    "FINETUNE",
    "METHODS",
    "AdapterConfig",
    "Adapters",
    "Finetune",
    "FinetuneConfig",
    "Method",
    "TaskCost",
    "TrainConfig",
    "ZeroShot",
    "make_method",
]
