"""Online serving in the simulator: requests arrive over time (seconds), a policy decides who runs.

Policies (`ONLINE_POLICIES`):
- `fcfs`: static batching on the static policies' executor; when the model is idle, up to `max_batch_size`
  waiting requests (arrival order) form one batch that runs until its longest answer ends (a row's answer is
  complete at its own last token);
- `cb`: continuous batching, first come first served;
- `cb-sjf`: continuous batching, shortest predicted (prompt-only) answer admitted first;
- `cb-srpt`: shortest predicted *remaining* answer first: every `repredict_every` tokens a running row's
  remaining length is predicted again (from its own hidden states) and a full batch swaps the row
  predicted to run longest for a waiting request predicted shorter by `preempt_margin`, keeping its KV;
  by default under the FCFS deadline `names.FCFS_SLACK` (the shipped configuration);
- `oracle-srpt`: `cb-srpt` on the true remaining lengths.

Every continuous policy is the engine's own `Scheduler` (`scheduler.py`) driven by a `SimulatedRunner`
(`sim_runner.py`: the trace's lengths on a cost-model clock), so admission, aging (tokens of priority per
decode step waited), the FCFS deadline (`fcfs_slack`), preemption and kept KV are the engine's by
construction. `oracle-srpt` is `cb-srpt` whose predictions are the true (remaining) lengths. With
`prefill_at_arrival` the prompt-only prediction rides on the prompt's own prefill, done when it arrives; its
KV (counted in `peak_kv_tokens`) waits with it and admission costs no forward.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from ecru.serve.cost import CostModel
from ecru.serve.names import ONLINE_POLICIES
from ecru.serve.policies import Batch, PlanConfig, run_plan
from ecru.serve.scheduler import EngineConfig, Scheduler
from ecru.serve.sim_runner import SimulatedRunner
from ecru.serve.simulator import TraceBatches, TraceRequest


@dataclass(frozen=True)
class OnlineRequest:
    """One request of an online trace."""

    arrival_s: float
    """When it arrives (seconds from the start)."""
    prompt_len: int
    """Prompt tokens (chat template included)."""
    output_len: int
    """True answer length in tokens (capped by `EngineConfig.max_new_tokens` when served)."""
    predicted: float = 0.0
    """Prompt-only predicted answer length (cb-sjf; cb-srpt before its first re-prediction)."""
    remaining: tuple[float, ...] = ()
    """cb-srpt: predicted remaining length after 0, k, 2k, ... generated tokens (k = repredict_every);
    entry 0 is unused (the prompt-only `predicted` stands there)."""
    max_tokens: int | None = None
    """Its own cap, as a client's max_tokens (None: `EngineConfig.max_new_tokens`)."""

    def cap(self, max_new_tokens: int) -> int:
        return max_new_tokens if self.max_tokens is None else min(self.max_tokens, max_new_tokens)


@dataclass
class OnlineResult:
    """One policy over one online trace (names as in the JSON)."""

    policy: str
    requests: int
    mean_latency_s: float
    p50_latency_s: float
    p99_latency_s: float
    max_latency_s: float
    tokens_per_s: float
    peak_kv_tokens: int
    time_s: float
    preemptions: int = 0
    latencies: list[float] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        out = asdict(self)
        out.pop("latencies")
        return out


def _result(policy, trace, finish, tokens, clock, peak_kv, preemptions) -> OnlineResult:
    lat = [f - r.arrival_s for f, r in zip(finish, trace, strict=True)]
    return OnlineResult(
        policy=policy,
        requests=len(trace),
        mean_latency_s=sum(lat) / len(lat),
        p50_latency_s=float(np.percentile(lat, 50)),
        p99_latency_s=float(np.percentile(lat, 99)),
        max_latency_s=max(lat),
        tokens_per_s=tokens / clock if clock else float("inf"),
        peak_kv_tokens=peak_kv,
        time_s=clock,
        preemptions=preemptions,
        latencies=lat,
    )


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """`n` arrival times (seconds) of a Poisson stream of `rate` requests per second."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def simulate_online(
    trace: Sequence[OnlineRequest],
    *,
    config: EngineConfig,
    cost: CostModel,
    policy: str | None = None,
    predict_s: float = 0.0,
    repredict_s: float = 0.0,
    prefill_at_arrival: bool = False,
) -> OnlineResult:
    """Serve `trace` (any order of arrivals) with `policy` (`ONLINE_POLICIES`; None: `config.policy`) under
    `config`'s limits and knobs; latency = finish - arrival per request. `predict_s`: seconds of prompt-only
    prediction per request (cb-sjf, cb-srpt), charged on arrival; `repredict_s`: seconds per row per
    re-prediction (cb-srpt); `prefill_at_arrival`: the engine's prefill on arrival
    (`RequestEngine(state_predictor=...)`, cb too), whose forward gives the prompt-only prediction, so
    `predict_s` must be 0."""
    policy = config.policy if policy is None else policy
    if policy not in ONLINE_POLICIES:
        raise ValueError(f"unknown online policy {policy!r}; choose from {', '.join(ONLINE_POLICIES)}")
    if not trace:
        raise ValueError("the trace is empty")
    if min(predict_s, repredict_s) < 0 or (prefill_at_arrival and predict_s):
        raise ValueError("predict_s and repredict_s must be >= 0, and predict_s 0 with prefill_at_arrival "
                         "(the prediction is read from the prefill)")  # fmt: skip
    if policy == "fcfs":
        if config.fcfs_slack not in (None, math.inf):
            raise ValueError("fcfs_slack orders predicted-shortest-first admission: not for policy 'fcfs'")
        return _simulate_static(trace, config, cost)
    engine = dataclasses.replace(
        config, policy="cb-srpt" if policy == "oracle-srpt" else policy, prefix_cache=0
    )
    charge = predict_s if policy in ("cb-sjf", "cb-srpt") else 0.0
    return _simulate_continuous(trace, policy, engine, cost, charge, repredict_s, prefill_at_arrival)


SIM_KNOBS = ("predict_s", "repredict_s", "prefill_at_arrival")
"""`simulate_online`'s own knobs, beside `EngineConfig`'s fields."""


def simulate_policy(
    trace: Sequence[OnlineRequest],
    policy: str,
    base: EngineConfig,
    cost: CostModel,
    overrides: Mapping | None = None,
) -> OnlineResult:
    """`simulate_online` of `policy` under `base` with `overrides` (`EngineConfig` fields and `SIM_KNOBS`):
    the benchmarks' tables of named configurations."""
    overrides = overrides or {}
    knobs = {k: v for k, v in overrides.items() if k in SIM_KNOBS}
    fields = {k: v for k, v in overrides.items() if k not in SIM_KNOBS}
    engine = {"fcfs": "cb", "oracle-srpt": "cb-srpt"}.get(policy, policy)
    config = dataclasses.replace(base, policy=engine, **fields)
    return simulate_online(trace, policy=policy, config=config, cost=cost, **knobs)


def _simulate_static(trace: Sequence[OnlineRequest], config: EngineConfig, cost: CostModel) -> OnlineResult:
    """Static batches on the static policies' executor (`policies.run_plan` on `simulator.TraceBatches`):
    when the model is idle, the requests that have arrived form batches of `max_batch_size`."""
    cap = config.max_new_tokens
    plan = PlanConfig(batch_size=config.max_batch_size, max_new_tokens=cap)
    lengths = [TraceRequest(r.prompt_len, max(1, min(r.output_len, cap))) for r in trace]
    runner = TraceBatches(lengths, plan, cost, start_s=0.0)
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival_s)
    pos = 0
    while pos < len(order):
        runner.clock = max(runner.clock, trace[order[pos]].arrival_s)
        rows = []
        while (
            pos < len(order) and len(rows) < plan.batch_size and trace[order[pos]].arrival_s <= runner.clock
        ):
            rows.append(order[pos])
            pos += 1
        run_plan([Batch(tuple(rows), cap)], runner, plan)
    finish = [runner.last_token[i] for i in range(len(trace))]
    return _result("fcfs", trace, finish, sum(r.output_len for r in lengths), runner.clock, runner.peak, 0)


def oracle(request: OnlineRequest, *, every: int, cap: int) -> OnlineRequest:
    """`request` with its true length as the prediction and its true remainder as every re-prediction."""
    n = max(1, min(request.output_len, request.cap(cap)))
    return dataclasses.replace(request, predicted=float(n), remaining=tuple(float(n - j * every) for j in
                                                                           range((n - 1) // every + 1)))  # fmt: skip


def _simulate_continuous(
    trace, policy, config: EngineConfig, cost, charge, repredict_s, at_arrival
) -> OnlineResult:
    """The engine's scheduler on a `SimulatedRunner`; requests join at their arrival second."""
    cap, every = config.max_new_tokens, config.repredict_every
    if policy == "oracle-srpt":
        trace = [oracle(r, every=every, cap=cap) for r in trace]
    sched = Scheduler(config, srpt=config.policy == "cb-srpt", on_arrival=at_arrival)
    runner = SimulatedRunner([r.prompt_len for r in trace], [max(1, min(r.output_len, r.cap(cap))) for r in trace],
                             cost=cost, predicted=[r.predicted for r in trace], remaining=[r.remaining for r in trace],
                             repredict_every=every, repredict_s=repredict_s)  # fmt: skip
    pending = sorted(range(len(trace)), key=lambda i: trace[i].arrival_s)
    pos = 0
    while pos < len(pending) or sched.has_unfinished():
        if not sched.has_unfinished():
            runner.clock = max(runner.clock, trace[pending[pos]].arrival_s)
        while pos < len(pending) and trace[pending[pos]].arrival_s <= runner.clock:
            i = pending[pos]
            runner.clock += charge
            predicted = None if at_arrival else trace[i].predicted
            sched.add(i, trace[i].prompt_len, trace[i].cap(cap), predicted)
            pos += 1
        sched.upcoming = len(pending) - pos
        sched.step(runner)
    tokens = sum(runner.targets)
    return _result(policy, trace, runner.finish, tokens, runner.clock, runner.peak, sched.preemptions)
