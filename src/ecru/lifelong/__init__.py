"""Lifelong knowledge injection: continual learning for a pretrained encoder that keeps its zero-shot
ability (ZSCL, Zheng et al., ICCV 2023), with the benchmark stream, the methods and their costs."""

from ecru.lifelong.evaluate import EvalRow, Evaluator
from ecru.lifelong.methods import (
    METHODS,
    AdapterConfig,
    FinetuneConfig,
    Method,
    TaskCost,
    TrainConfig,
    make_method,
)  # fmt: skip
from ecru.lifelong.metrics import cl_metrics
from ecru.lifelong.reference import TeacherCache
from ecru.lifelong.runner import RunResult, run_stream
from ecru.lifelong.stream import ORDERS, Stream, StreamConfig, Task, build_clinc_stream

__all__ = [
    "METHODS",
    "ORDERS",
    "AdapterConfig",
    "EvalRow",
    "Evaluator",
    "FinetuneConfig",
    "Method",
    "RunResult",
    "Stream",
    "StreamConfig",
    "Task",
    "TaskCost",
    "TeacherCache",
    "TrainConfig",
    "build_clinc_stream",
    "cl_metrics",
    "make_method",
    "run_stream",
]
