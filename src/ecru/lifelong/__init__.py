"""Lifelong knowledge injection: continual learning for a pretrained encoder that keeps its zero-shot
ability (ZSCL, Zheng et al., ICCV 2023): a knowledge store you teach your own tasks (`KnowledgeStore`),
and the benchmark stream, the methods and their costs.

The public names load on first use (PEP 562): `ecru --help` imports `ecru.lifelong.cli`, and that must
not import torch, transformers or peft.
"""

from __future__ import annotations

from ecru.plugins import lazy_exports

_EXPORTS = {
    "ecru.lifelong.evaluate": ("EvalRow", "Evaluator"),
    "ecru.lifelong.methods": (
        "METHODS",
        "AdapterConfig",
        "FinetuneConfig",
        "Method",
        "RoutedConfig",
        "TaskCost",
        "TrainConfig",
        "make_method",
    ),
    "ecru.lifelong.metrics": ("cl_metrics",),
    "ecru.lifelong.reference": ("TeacherCache",),
    "ecru.lifelong.runner": ("RunResult", "run_stream"),
    "ecru.lifelong.store": ("KnowledgeStore", "Prediction"),
    "ecru.lifelong.stream": ("ORDERS", "Stream", "StreamConfig", "Task", "build_clinc_stream"),
    "ecru.lifelong.userdata": ("Record", "label_name", "read_records"),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
