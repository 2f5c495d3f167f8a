"""Every serving policy name, preemption mode and shipped queue default, defined once. Torch-free: `ecru --help`
imports it.

A policy name means the same thing wherever it appears: `ecru serve api/run/bench/simulate`, the
simulators and the benchmarks' JSON."""

STATIC_POLICIES = ("fcfs", "sorted", "fcr", "fcr+vbs", "fcr+vbs+bins", "oracle")
"""Whole batches, planned before they run (`ecru.serve.sched.policies.plan_batches`)."""
CONTINUOUS_POLICIES = ("cb", "cb-sjf", "cb-ljf", "cb-kv")
"""Continuous batching in the batch runner and its simulator (`ecru.serve.sched.queues.make_queue`)."""
POLICIES = (*STATIC_POLICIES, *CONTINUOUS_POLICIES)
"""What `ecru serve simulate` and the static batching benchmark (`bench/serve.py`) run."""
ENGINE_POLICIES = ("cb", "cb-sjf", "cb-srpt", "cb-kv")
"""The request engine's (`ecru serve api`, `ecru serve run`)."""
SJF_POLICIES = ("cb-sjf", "cb-srpt")
"""The engine's policies that queue requests by a predicted length."""
ONLINE_POLICIES = ("fcfs", "cb", "cb-sjf", "cb-srpt", "oracle-srpt")
"""The online (Poisson arrivals) simulator's."""
ENGINE_POLICY = {"fcfs": "cb", "cb": "cb", "cb-sjf": "cb-sjf", "cb-ljf": "cb", "cb-kv": "cb-kv",
                 "cb-srpt": "cb-srpt", "oracle-srpt": "cb-srpt"}  # fmt: skip
"""The engine policy (`EngineConfig.policy`) whose limits and knobs each continuous or online policy runs
under: online `fcfs` takes cb's batch size and cap, `cb-ljf` cb's limits with its own queue, `oracle-srpt`
is cb-srpt on the true lengths."""
PREEMPT_MODES = ("keep", "recompute")
"""What happens to a preempted request's KV: kept, or dropped and recomputed."""
DEFAULT_AGING = 0.1
"""Priority tokens per decode step waited. The old 0.5 made `cb-sjf` FCFS under any backlog: once requests
wait a few hundred steps, 0.5 x the arrival gap outweighs predictions of at most the cap. 0.1 keeps most of
shortest-first's mean-latency gain while bounding a long request's wait behind later arrivals to
prediction / 0.1 steps (`bench/serve_online.py`'s aging sweep, mixed workload, load 1.2)."""
FCFS_SLACK = 0.15
"""The FCFS deadline plain `cb-srpt` ships with (aging 0 then): the best measured (docs/serve.md). With the
length predictor `ecru serve probe` fits and kept KV, it is the configuration the name `cb-srpt` means in
`ecru serve api/run`, the simulators and the benchmarks; other settings are study variants, named as such."""

__all__ = [
    "CONTINUOUS_POLICIES",
    "DEFAULT_AGING",
    "ENGINE_POLICIES",
    "ENGINE_POLICY",
    "FCFS_SLACK",
    "ONLINE_POLICIES",
    "POLICIES",
    "PREEMPT_MODES",
    "SJF_POLICIES",
    "STATIC_POLICIES",
]
