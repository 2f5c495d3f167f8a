"""Continual-learning methods behind one protocol (`Method`)."""

from ecru.lifelong.methods.adapters import AdapterConfig, Adapters
from ecru.lifelong.methods.base import Method, TaskCost, TrainConfig
from ecru.lifelong.methods.finetune import Finetune, FinetuneConfig
from ecru.lifelong.methods.ncm import NearestClassMean
from ecru.lifelong.methods.registry import (
    ADAPTERS,
    ALIASES,
    DISTILLING,
    FINETUNE,
    METHODS,
    ROUTED,
    ZeroShot,
    make_method,
    needs_teacher,
)
from ecru.lifelong.methods.routed import RoutedAdapters, RoutedConfig, RoutedEncoder

__all__ = [
    "ADAPTERS",
    "ALIASES",
    "DISTILLING",
    "FINETUNE",
    "METHODS",
    "ROUTED",
    "AdapterConfig",
    "Adapters",
    "Finetune",
    "FinetuneConfig",
    "Method",
    "NearestClassMean",
    "RoutedAdapters",
    "RoutedConfig",
    "RoutedEncoder",
    "TaskCost",
    "TrainConfig",
    "ZeroShot",
    "make_method",
    "needs_teacher",
]
