"""Serving with sequence scheduling: an OpenAI-compatible server and batch inference on one engine core (a
model-free `Scheduler` run on the model by a `ModelRunner`, or on a cost-model clock by a `SimulatedRunner`),
length predictors, and the static-batch policies of Zheng et al. (NeurIPS 2023).

Layers, lowest first (each imports only lower ones): `sched/` the model-free scheduler and policy names,
`engine/` running on a model, `sim/` the simulated runner and cost model, `predict/` length predictors,
`entrypoints/` the CLI, HTTP server and batch runner; `prompts` and `workload` are the prompt sources.

The public names load lazily (PEP 562), so `ecru --help`, which imports `ecru.serve.entrypoints.cli`, does not
import torch.
"""

from __future__ import annotations

from ecru.plugins import lazy_exports

_EXPORTS = {
    "ecru.serve.engine.background": ("EngineThread",),
    "ecru.serve.sim.cost": (
        "CostModel",
        "SMOLLM2_CPU",
        "StepWork",
        "fit_cost_model",
        "measure_cost_model",
        "record_forwards",
    ),
    "ecru.serve.engine.static": (
        "BatchResult",
        "GenerationConfig",
        "generate_static",
        "left_pad",
        "resume_static",
    ),
    "ecru.serve.entrypoints.setup": ("EngineSetup", "ReplaySetup"),
    "ecru.serve.predict.labels": (
        "LengthLabel",
        "label_prompts",
        "read_labels",
    ),
    "ecru.serve.engine.models": ("ServedModel",),
    "ecru.serve.entrypoints.openai_api": ("APIConfig", "create_app"),
    "ecru.serve.engine.packed": (
        "PackedLinear",
        "pack_linears_",
        "unpack_linears_",
    ),
    "ecru.serve.sched.policies": (
        "Batch",
        "PlanConfig",
        "STATIC_POLICIES",
        "plan_batches",
        "rerun_batches",
        "run_plan",
        "BatchRunner",
    ),
    "ecru.serve.predict.predictors": (
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
    "ecru.serve.sched.queues": (
        "DEFAULT_AGING",
        "FCFSQueue",
        "RequestQueue",
        "SJFQueue",
        "make_queue",
    ),
    "ecru.serve.predict.remaining": ("RemainingProbe",),
    "ecru.serve.engine.request_engine": (
        "ModelRunner",
        "Request",
        "RequestEngine",
    ),
    "ecru.serve.engine.policy_runs": (
        "ContinuousResult",
        "POLICIES",
        "PolicyRun",
        "generate_continuous",
        "run_policy",
    ),
    "ecru.serve.engine.sampling": ("SamplingParams",),
    "ecru.serve.sched.scheduler": (
        "EngineConfig",
        "Scheduler",
    ),
    "ecru.serve.predict.self_predict": (
        "PiAPredictor",
        "SelfLoRAConfig",
        "SelfLoRAPredictor",
    ),
    "ecru.serve.sim.simulator": (
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
