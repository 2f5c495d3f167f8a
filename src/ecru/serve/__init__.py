"""Serving with sequence scheduling: an OpenAI-compatible server and batch inference on one engine core (a
model-free `Scheduler` run on the model by a `ModelRunner`, or on a cost-model clock by a `SimulatedRunner`),
length predictors, and the static-batch policies of Zheng et al. (NeurIPS 2023).

The public names load lazily (PEP 562), so `ecru --help`, which imports `ecru.serve.cli`, does not import
torch.
"""

from __future__ import annotations

from ecru.plugins import lazy_exports

_EXPORTS = {
    "ecru.serve.background": ("EngineThread",),
    "ecru.serve.cost": (
        "CostModel",
        "SMOLLM2_CPU",
        "StepWork",
        "fit_cost_model",
        "measure_cost_model",
        "record_forwards",
    ),
    "ecru.serve.engine": (
        "BatchResult",
        "GenerationConfig",
        "generate_static",
        "left_pad",
        "resume_static",
    ),
    "ecru.serve.entrypoints": ("EngineSetup", "ReplaySetup"),
    "ecru.serve.labels": (
        "LengthLabel",
        "label_prompts",
        "read_labels",
    ),
    "ecru.serve.models": ("ServedModel",),
    "ecru.serve.openai_api": ("APIConfig", "create_app"),
    "ecru.serve.packed": (
        "PackedLinear",
        "pack_linears_",
        "unpack_linears_",
    ),
    "ecru.serve.policies": (
        "Batch",
        "PlanConfig",
        "STATIC_POLICIES",
        "plan_batches",
        "rerun_batches",
        "run_plan",
        "BatchRunner",
    ),
    "ecru.serve.predictors": (
        "ConstantPredictor",
        "EmbeddingPredictor",
        "LengthPredictor",
        "MiniLMPredictor",
        "OraclePredictor",
        "ProbePredictor",
        "StatePredictor",
        "length_metrics",
        "ridge_cv",
        "ridge_fit",
        "timed_predict",
    ),
    "ecru.serve.queues": (
        "DEFAULT_AGING",
        "FCFSQueue",
        "RequestQueue",
        "SJFQueue",
        "make_queue",
    ),
    "ecru.serve.remaining": ("RemainingProbe",),
    "ecru.serve.request_engine": (
        "ModelRunner",
        "Request",
        "RequestEngine",
    ),
    "ecru.serve.runner": (
        "ContinuousResult",
        "POLICIES",
        "PolicyRun",
        "generate_continuous",
        "run_policy",
    ),
    "ecru.serve.sampling": ("SamplingParams",),
    "ecru.serve.scheduler": (
        "EngineConfig",
        "Scheduler",
    ),
    "ecru.serve.self_predict": (
        "PiAPredictor",
        "SelfLoRAConfig",
        "SelfLoRAPredictor",
    ),
    "ecru.serve.simulator": (
        "ONLINE_POLICIES",
        "OnlineRequest",
        "SimResult",
        "SimulatedRunner",
        "TraceRequest",
        "read_trace",
        "simulate",
        "simulate_continuous",
        "simulate_online",
        "simulate_policy",
    ),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
