"""Sequence scheduling: predict each response's length, batch by it (Zheng et al., NeurIPS 2023)."""

from ecru.serve.continuous import ContinuousConfig, ContinuousResult, generate_continuous
from ecru.serve.cost import SMOLLM2_CPU, CostModel, measure_cost_model
from ecru.serve.engine import BatchResult, GenerationConfig, generate_static, left_pad
from ecru.serve.labels import LengthLabel, label_prompts, read_labels
from ecru.serve.policies import STATIC_POLICIES, Batch, PlanConfig, is_failure, plan_batches, rerun_batches
from ecru.serve.predictors import (
    ConstantPredictor,
    LengthPredictor,
    MiniLMPredictor,
    OraclePredictor,
    ProbePredictor,
    length_metrics,
    ridge_fit,
    timed_predict,
)
from ecru.serve.queues import FCFSQueue, RequestQueue, SJFQueue
from ecru.serve.runner import POLICIES, PolicyRun, run_policy
from ecru.serve.self_predict import SelfLoRAConfig, SelfLoRAPredictor
from ecru.serve.simulator import SimResult, TraceRequest, read_trace, simulate

__all__ = [
    "POLICIES",
    "SMOLLM2_CPU",
    "STATIC_POLICIES",
    "Batch",
    "BatchResult",
    "ConstantPredictor",
    "ContinuousConfig",
    "ContinuousResult",
    "CostModel",
    "FCFSQueue",
    "GenerationConfig",
    "LengthLabel",
    "LengthPredictor",
    "MiniLMPredictor",
    "OraclePredictor",
    "PlanConfig",
    "PolicyRun",
    "ProbePredictor",
    "RequestQueue",
    "SJFQueue",
    "SelfLoRAConfig",
    "SelfLoRAPredictor",
    "SimResult",
    "TraceRequest",
    "generate_continuous",
    "generate_static",
    "is_failure",
    "label_prompts",
    "left_pad",
    "length_metrics",
    "measure_cost_model",
    "plan_batches",
    "read_labels",
    "read_trace",
    "rerun_batches",
    "ridge_fit",
    "run_policy",
    "simulate",
    "timed_predict",
]
