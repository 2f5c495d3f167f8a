"""Sequence scheduling: predict each response's length, batch by it (Zheng et al., NeurIPS 2023).

Names are loaded on first use (PEP 562), so `ecru --help`, which imports `ecru.serve.cli`, does not import
torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_LAZY: dict[str, str] = {
    "EngineConfig": "ecru.serve.scheduler",
    "Scheduler": "ecru.serve.scheduler",
    "SimulatedRunner": "ecru.serve.sim_runner",
    "EngineThread": "ecru.serve.background",
    "Request": "ecru.serve.request_engine",
    "RequestEngine": "ecru.serve.request_engine",
    "SamplingParams": "ecru.serve.sampling",
    "ServedModel": "ecru.serve.models",
    "PackedLinear": "ecru.serve.packed",
    "pack_linears_": "ecru.serve.packed",
    "unpack_linears_": "ecru.serve.packed",
    "create_app": "ecru.serve.openai_api",
    "APIConfig": "ecru.serve.api_guard",
    "Batch": "ecru.serve.policies",
    "BatchResult": "ecru.serve.engine",
    "ConstantPredictor": "ecru.serve.predictors",
    "EmbeddingPredictor": "ecru.serve.predictors",
    "ContinuousConfig": "ecru.serve.continuous",
    "ContinuousResult": "ecru.serve.continuous",
    "kv_budget_config": "ecru.serve.continuous",
    "CostModel": "ecru.serve.cost",
    "FCFSQueue": "ecru.serve.queues",
    "GenerationConfig": "ecru.serve.engine",
    "LengthLabel": "ecru.serve.labels",
    "LengthPredictor": "ecru.serve.predictors",
    "MiniLMPredictor": "ecru.serve.predictors",
    "OraclePredictor": "ecru.serve.predictors",
    "POLICIES": "ecru.serve.runner",
    "PlanConfig": "ecru.serve.policies",
    "PolicyRun": "ecru.serve.runner",
    "ProbePredictor": "ecru.serve.predictors",
    "StatePredictor": "ecru.serve.predictors",
    "RequestQueue": "ecru.serve.queues",
    "SJFQueue": "ecru.serve.queues",
    "make_queue": "ecru.serve.queues",
    "SMOLLM2_CPU": "ecru.serve.cost",
    "STATIC_POLICIES": "ecru.serve.policies",
    "SelfLoRAConfig": "ecru.serve.self_predict",
    "SelfLoRAPredictor": "ecru.serve.self_predict",
    "SimResult": "ecru.serve.simulator",
    "TraceRequest": "ecru.serve.simulator",
    "generate_continuous": "ecru.serve.request_engine",
    "generate_static": "ecru.serve.engine",
    "resume_static": "ecru.serve.engine",
    "is_failure": "ecru.serve.policies",
    "label_prompts": "ecru.serve.labels",
    "left_pad": "ecru.serve.engine",
    "length_metrics": "ecru.serve.predictors",
    "measure_cost_model": "ecru.serve.cost",
    "fit_cost_model": "ecru.serve.cost",
    "record_forwards": "ecru.serve.cost",
    "StepWork": "ecru.serve.cost",
    "plan_batches": "ecru.serve.policies",
    "read_labels": "ecru.serve.labels",
    "read_trace": "ecru.serve.simulator",
    "rerun_batches": "ecru.serve.policies",
    "ridge_fit": "ecru.serve.predictors",
    "ridge_cv": "ecru.serve.predictors",
    "run_policy": "ecru.serve.runner",
    "simulate": "ecru.serve.simulator",
    "simulate_continuous": "ecru.serve.simulator",
    "timed_predict": "ecru.serve.predictors",
    "DEFAULT_AGING": "ecru.serve.queues",
    "ONLINE_POLICIES": "ecru.serve.online",
    "OnlineConfig": "ecru.serve.online",
    "OnlineRequest": "ecru.serve.online",
    "simulate_online": "ecru.serve.online",
    "RemainingProbe": "ecru.serve.remaining",
    "PiAPredictor": "ecru.serve.self_predict",
}

if TYPE_CHECKING:  # static analysers see the real imports
    from ecru.serve.api_guard import APIConfig
    from ecru.serve.background import EngineThread
    from ecru.serve.continuous import ContinuousConfig, ContinuousResult, kv_budget_config
    from ecru.serve.cost import (
        SMOLLM2_CPU,
        CostModel,
        StepWork,
        fit_cost_model,
        measure_cost_model,
        record_forwards,
    )
    from ecru.serve.engine import BatchResult, GenerationConfig, generate_static, left_pad, resume_static
    from ecru.serve.labels import LengthLabel, label_prompts, read_labels
    from ecru.serve.models import ServedModel
    from ecru.serve.online import ONLINE_POLICIES, OnlineConfig, OnlineRequest, simulate_online
    from ecru.serve.openai_api import create_app
    from ecru.serve.packed import PackedLinear, pack_linears_, unpack_linears_
    from ecru.serve.policies import (
        STATIC_POLICIES,
        Batch,
        PlanConfig,
        is_failure,
        plan_batches,
        rerun_batches,
    )
    from ecru.serve.predictors import (
        ConstantPredictor,
        EmbeddingPredictor,
        LengthPredictor,
        MiniLMPredictor,
        OraclePredictor,
        ProbePredictor,
        StatePredictor,
        length_metrics,
        ridge_cv,
        ridge_fit,
        timed_predict,
    )
    from ecru.serve.queues import DEFAULT_AGING, FCFSQueue, RequestQueue, SJFQueue, make_queue
    from ecru.serve.remaining import RemainingProbe
    from ecru.serve.request_engine import Request, RequestEngine, generate_continuous
    from ecru.serve.runner import POLICIES, PolicyRun, run_policy
    from ecru.serve.sampling import SamplingParams
    from ecru.serve.scheduler import EngineConfig, Scheduler
    from ecru.serve.self_predict import PiAPredictor, SelfLoRAConfig, SelfLoRAPredictor
    from ecru.serve.sim_runner import SimulatedRunner
    from ecru.serve.simulator import SimResult, TraceRequest, read_trace, simulate, simulate_continuous


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'ecru.serve' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "EngineConfig",
    "Scheduler",
    "SimulatedRunner",
    "EngineThread",
    "Request",
    "RequestEngine",
    "SamplingParams",
    "ServedModel",
    "PackedLinear",
    "pack_linears_",
    "unpack_linears_",
    "create_app",
    "APIConfig",
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
    "EmbeddingPredictor",
    "OraclePredictor",
    "PlanConfig",
    "PolicyRun",
    "ProbePredictor",
    "StatePredictor",
    "RequestQueue",
    "SJFQueue",
    "make_queue",
    "SelfLoRAConfig",
    "SelfLoRAPredictor",
    "SimResult",
    "TraceRequest",
    "generate_continuous",
    "generate_static",
    "resume_static",
    "is_failure",
    "kv_budget_config",
    "label_prompts",
    "left_pad",
    "length_metrics",
    "measure_cost_model",
    "fit_cost_model",
    "record_forwards",
    "StepWork",
    "plan_batches",
    "read_labels",
    "read_trace",
    "rerun_batches",
    "ridge_fit",
    "ridge_cv",
    "run_policy",
    "simulate",
    "simulate_continuous",
    "timed_predict",
    "DEFAULT_AGING",
    "ONLINE_POLICIES",
    "OnlineConfig",
    "OnlineRequest",
    "simulate_online",
    "RemainingProbe",
    "PiAPredictor",
]
