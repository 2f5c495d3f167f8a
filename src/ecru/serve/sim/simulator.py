"""The simulators: a policy replayed over a trace's known lengths on a cost-model clock (`cost.CostModel`).
Torch-free: a benchmark's tables come from here without loading a model.

Offline traces, JSONL, one request per line: {"prompt_len": int, "output_len": int, "predicted_len": number}.
`simulate` replays any policy of `POLICIES`, as `policy_runs.run_policy` runs it for real. Static policies: each
batch runs min(cap, longest output_len in it) steps and computes rows x steps token slots (first attempts and
FCR reruns alike). A resumed rerun (`PlanConfig.resume`) prefills each row's prompt plus the tokens it had and
runs until its longest row is done, each row stopping at its answer's end or its own budget, max_new_tokens in
all; with `PlanConfig.keep_kv` it has no prefill, only its decode steps. A request's useful tokens,
min(output_len, max_new_tokens), count once, on the run that completes it. Continuous batching
(`simulate_continuous`) is driven as `generate_continuous` drives the engine.

Online serving (`simulate_online`): requests arrive over time (seconds), a policy decides who runs.
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

Every continuous policy, offline or online, is the engine's own `Scheduler` (`scheduler.py`) driven by a
`SimulatedRunner`, so admission, aging, the FCFS deadline (`fcfs_slack`), preemption, kept KV, decode steps,
prefills and slots are the engine's by construction. With `prefill_at_arrival` the prompt-only prediction
rides on the prompt's own prefill, done when it arrives; its KV (counted in `peak_kv_tokens`) waits with it
and admission costs no forward.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ecru.errors import EcruError
from ecru.io import BadLine, read_jsonl
from ecru.serve.sched.names import CONTINUOUS_POLICIES, ENGINE_POLICY, ONLINE_POLICIES, POLICIES, SJF_POLICIES
from ecru.serve.sched.policies import (
    Batch,
    PlanConfig,
    continuous_config,
    plan_batches,
    reservations,
    run_plan,
)
from ecru.serve.sched.queues import DEFAULT_AGING, RequestQueue, make_queue
from ecru.serve.sched.scheduler import EngineConfig, Outcome, Scheduler, run_in_steps
from ecru.serve.sim.cost import SMOLLM2_CPU, CostModel


@dataclass(frozen=True)
class TraceRequest:
    """One request of a length trace."""

    prompt_len: int
    """Prompt tokens (chat template included)."""
    output_len: int
    """True response length in tokens (uncapped when known)."""
    predicted_len: float | None = None
    """A predictor's estimate of output_len (needed by every policy but fcfs)."""


@dataclass
class SimResult:
    """Accounting of one policy over one trace (names as in the JSON); ratios and rates are derived."""

    policy: str
    requests: int
    batches: int
    rerun_batches: int
    batch_steps: int
    padded_slots: int
    useful_tokens: int
    effective_token_ratio: float = field(init=False)
    failures: int
    failure_ratio: float = field(init=False)
    avg_padded_length: float = field(init=False)
    time_s: float
    samples_per_s: float = field(init=False)
    tokens_per_s: float = field(init=False)
    mean_latency_s: float

    def __post_init__(self):
        n, slots, useful, clock = self.requests, self.padded_slots, self.useful_tokens, self.time_s
        self.effective_token_ratio = useful / slots if slots else 1.0
        self.failure_ratio = self.failures / n
        self.avg_padded_length = slots / n
        self.samples_per_s = n / clock if clock else float("inf")
        self.tokens_per_s = useful / clock if clock else float("inf")

    def to_json(self) -> dict:
        return asdict(self)


def read_trace(path: str | Path) -> list[TraceRequest]:
    """A JSONL trace of prompt_len, output_len and an optional predicted_len; a bad line is one `EcruError`."""
    path = Path(path)
    if not path.is_file():
        raise EcruError(f"trace {path} not found (JSONL lines of prompt_len, output_len, predicted_len)")
    out = read_jsonl(path, _trace_request, expected="{'prompt_len', 'output_len', 'predicted_len'}")
    if not out:
        raise EcruError(f"trace {path} is empty")
    return out


def _trace_request(row: dict) -> TraceRequest:
    predicted = row.get("predicted_len")
    req = TraceRequest(
        int(row["prompt_len"]), int(row["output_len"]), None if predicted is None else float(predicted)
    )
    if req.prompt_len < 0 or req.output_len < 0:
        raise BadLine("lengths must be >= 0")
    if req.predicted_len is not None and not 0 <= req.predicted_len < float("inf"):
        raise BadLine(f"predicted_len must be a finite number >= 0, got {req.predicted_len}")
    return req


class SimulatedRunner:
    """The scheduler's plans (`scheduler.Runner`) executed on a cost-model clock with a trace's known lengths:
    `finish[i]` is when request i's last token came out.

    Costs (`CostModel`): a prefill forward over its widest row (prompt plus the tokens a preempted row kept), a
    decode step over the padded cache (rows x widest row, the engine's left-padded layout, also `peak`);
    joining with kept KV costs nothing (the engine merges kept rows as it merges any admission). A row ends at
    its trace length; predictions come from the trace (`predicted` at arrival, `remaining[j]` after
    j x `repredict_every` tokens), each re-prediction charged `repredict_s`."""

    def __init__(
        self,
        prompt_lens: Sequence[int],
        targets: Sequence[int],
        *,
        cost: CostModel,
        predicted: Sequence[float] = (),
        remaining: Sequence[Sequence[float]] = (),
        repredict_every: int = 16,
        repredict_s: float = 0.0,
        start_s: float = 0.0,
    ):
        self.prompt_lens, self.targets, self.cost = prompt_lens, targets, cost
        self.predicted, self.remaining = predicted, remaining
        self.every, self.repredict_s = repredict_every, repredict_s
        self.done = [0] * len(targets)
        self.finish = [0.0] * len(targets)
        self.clock, self.peak, self.slots, self.prefills = start_s, 0, 0, 0
        self.running: list[int] = []
        self.kept: dict[int, int] = {}  # waiting requests' KV positions

    def skip_to(self, clock: float) -> None:
        """Nothing runs until `clock` seconds (an idle gap before the next arrival)."""
        self.clock = max(self.clock, clock)

    def _width(self, rows: Sequence[int]) -> int:
        return max((self.prompt_lens[i] + self.done[i] for i in rows), default=0)

    def _grow(self, rows: Sequence[int]) -> set[int]:
        """One more token for each row; the rows that reached their length (their finish time recorded)."""
        ended = set()
        for i in rows:
            self.done[i] += 1
            if self.done[i] >= self.targets[i]:
                self.finish[i] = self.clock
                ended.add(i)
        self.slots += len(rows)
        return ended

    def prefill_arrivals(self, groups: list[list[int]]) -> Outcome:
        ended = set()
        for rows in groups:
            self.clock += self.cost.prefill_time(len(rows), self._width(rows))
            held = len(self.running) * self._width(self.running) + sum(self.kept.values())
            self.peak = max(self.peak, held + len(rows) * self._width(rows))
            ended |= self._grow(rows)
        arrived = [i for rows in groups for i in rows]
        self.kept |= {i: self.prompt_lens[i] for i in arrived if i not in ended}
        return Outcome(ended, {i: float(self.predicted[i]) for i in arrived})

    def admit(self, kept: list[int], fresh: list[int]) -> Outcome:
        for i in kept:
            del self.kept[i]
        self.running += kept
        if not fresh:
            return Outcome()
        self.clock += self.cost.prefill_time(len(fresh), self._width(fresh))
        self.prefills += 1
        ended = self._grow(fresh)
        self.running += [i for i in fresh if i not in ended]
        return Outcome(ended)

    def decode(self, rows: list[int], repredict: list[int]) -> Outcome:
        width = self._width(rows)
        self.peak = max(self.peak, len(rows) * width + sum(self.kept.values()))
        self.clock += self.cost.step_time(len(rows), width)
        predicted = {}
        for i in repredict:  # the state after done[i] tokens: the trace's prediction there, if it has one
            j = self.done[i] // self.every
            if j < len(self.remaining[i]):
                predicted[i] = float(self.remaining[i][j])
        ended = self._grow(rows)
        self.clock += sum(i not in ended for i in predicted) * self.repredict_s  # a row that ended needs none
        self.running = [i for i in rows if i not in ended]
        return Outcome(ended, predicted)

    def preempt(self, keys: list[int], *, keep_kv: bool, discard: bool) -> None:
        for i in keys:
            self.running.remove(i)
            if keep_kv:  # its newest token is pending, not cached (as in the engine)
                self.kept[i] = self.prompt_lens[i] + self.done[i] - 1
            if discard:
                self.done[i] = 0

    def release(self, keys: list[int]) -> None:
        for i in keys:
            del self.kept[i]


class TraceBatches:
    """Static batches on a cost-model clock with a trace's lengths (`policies.BatchRunner`): a batch runs
    until its longest row is done, each row stopping at its answer's end or its own budget (its cap, and
    max_new_tokens in all), and computes rows x steps token slots."""

    def __init__(self, trace: Sequence[TraceRequest], config: PlanConfig, cost: CostModel, *, start_s: float):
        self.trace, self.config, self.cost = trace, config, cost
        self.clock, self.slots, self.steps, self.batches, self.reruns, self.peak = start_s, 0, 0, 0, 0, 0
        self.generated: dict[int, int] = {}
        """Tokens a cut row keeps for its resumed rerun (they join its prompt)."""
        self.done_at: dict[int, float] = {}
        """When the batch that completed each row returned."""
        self.last_token: dict[int, float] = {}
        """When each row's last token came out (a streaming client's latency)."""

    def run(self, batch: Batch) -> set[int]:
        had, trace, rows = self.generated, self.trace, batch.rows
        own = {r: min(trace[r].output_len - had.get(r, 0), batch.cap, self.config.max_new_tokens - had.get(r, 0))
               for r in rows}  # fmt: skip
        steps, prompt = max(own.values()), max(trace[r].prompt_len + had.get(r, 0) for r in rows)
        # a rerun whose every row kept its KV (a row cut at cap 0 has none): no prefill, prompt - 1 cached
        kept = batch.rerun and self.config.keep_kv and all(had.get(r, 0) for r in rows)

        def seconds(n: int) -> float:
            time = self.cost.decode_time if kept else self.cost.batch_time
            return time(len(rows), prompt - kept, n)

        self.last_token |= {r: self.clock + seconds(n) for r, n in own.items()}
        self.clock += seconds(steps)
        self.peak = max(self.peak, len(rows) * (prompt + steps - 1))
        self.slots += len(rows) * steps
        self.steps += steps
        return {r for r in rows if trace[r].output_len <= batch.cap}

    def collect(self, batch: Batch, cut: list[int]) -> None:
        if self.config.resume:
            self.generated |= {r: batch.cap for r in cut}
        self.done_at |= {r: self.clock for r in batch.rows if r not in cut}
        self.batches += 1
        self.reruns += batch.rerun


def simulate(
    trace: Sequence[TraceRequest],
    *,
    policy: str,
    config: PlanConfig,
    cost: CostModel = SMOLLM2_CPU,
    predict_s: float = 0.0,
    aging: float = DEFAULT_AGING,
    refill_min: int = 4,
) -> SimResult:
    """Any policy of `POLICIES` against the true lengths of `trace`, as `policy_runs.run_policy` runs it for real: a
    static policy's plan (and FCR reruns), or a continuous one on the engine's scheduler (`simulate_continuous`
    under `continuous_config`; `aging`: cb-sjf's and cb-ljf's, `refill_min`: every continuous policy's)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    if policy == "oracle":
        predicted = [r.output_len for r in trace]
    else:
        predicted = [r.predicted_len for r in trace]
        if policy not in ("fcfs", "cb") and any(p is None for p in predicted):
            raise EcruError(f"policy {policy!r} needs predicted_len on every trace line")
    if policy in CONTINUOUS_POLICIES:
        engine = continuous_config(policy, config, [r.prompt_len for r in trace], refill_min=refill_min)
        result, _ = simulate_continuous(trace, queue=make_queue(policy, predicted, aging=aging), config=engine,
                                        cost=cost, predict_s=predict_s, policy=policy,
                                        reserve=reservations(policy, predicted))  # fmt: skip
        return result
    plan = plan_batches(policy, predicted=predicted, prompt_lens=[r.prompt_len for r in trace], config=config)
    runner = TraceBatches(trace, config, cost, start_s=predict_s)
    failures = run_plan(plan, runner, config)
    useful = sum(min(r.output_len, config.max_new_tokens) for r in trace)
    return SimResult(policy, len(trace), batches=runner.batches, rerun_batches=runner.reruns,
                     batch_steps=runner.steps, padded_slots=runner.slots, useful_tokens=useful,
                     failures=len(failures), time_s=runner.clock,
                     mean_latency_s=sum(runner.done_at.values()) / len(trace))  # fmt: skip


def simulate_continuous(
    trace: Sequence[TraceRequest],
    *,
    queue: RequestQueue,
    config: EngineConfig,
    cost: CostModel = SMOLLM2_CPU,
    arrivals: Sequence[int] | None = None,
    predict_s: float = 0.0,
    policy: str = "cb",
    reserve: Sequence[float] | None = None,
) -> tuple[SimResult, list[int]]:
    """Continuous batching over the true lengths of `trace`; returns the result and the admission order.

    Mirrors `generate_continuous`: request i joins `queue` at decode step `arrivals[i]` and leaves with
    min(output_len, max_new_tokens) tokens (at least 1); admission, and under cb-kv's `config.kv_budget` the
    reservation of `reserve[i]` answer tokens and preemption, are the `Scheduler`'s, the time the
    `SimulatedRunner`'s. Latency: finish minus arrival clock. A preempted request's tokens are computed again
    (slots count both attempts); `failures` counts preemptions.
    """
    n, cap = len(trace), config.max_new_tokens
    target = [max(1, min(r.output_len, cap)) for r in trace]
    sched = Scheduler(config, queue=queue, discard_preempted=True)
    sched.admission_log = []
    runner = SimulatedRunner([r.prompt_len for r in trace], target, cost=cost, start_s=predict_s)
    arrived_at = [0.0] * n

    def add(i: int) -> None:
        arrived_at[i] = runner.clock
        sched.add(i, trace[i].prompt_len, cap, None if reserve is None else reserve[i])

    if reserve is not None and len(reserve) != n:
        raise ValueError(f"reserve has {len(reserve)} entries for {n} prompts")
    run_in_steps(sched, [0] * n if arrivals is None else arrivals, add, lambda: sched.step(runner))
    latency = sum(f - a for f, a in zip(runner.finish, arrived_at, strict=True))
    result = SimResult(policy, n, batches=runner.prefills, rerun_batches=0, batch_steps=sched.steps,
                       padded_slots=runner.slots, useful_tokens=sum(target), failures=sched.preemptions,
                       time_s=runner.clock, mean_latency_s=latency / n)  # fmt: skip
    return result, sched.admission_log


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


def _online_result(policy, trace, finish, tokens, clock, peak_kv, preemptions) -> OnlineResult:
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
    engine = dataclasses.replace(config, policy=ENGINE_POLICY[policy])  # fcfs: cb's (no fcfs_slack)
    if policy == "fcfs":
        return _simulate_static(trace, engine, cost)
    charge = predict_s if policy in SJF_POLICIES else 0.0
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
    config = dataclasses.replace(base, policy=ENGINE_POLICY.get(policy, policy), **fields)
    return simulate_online(trace, policy=policy, config=config, cost=cost, **knobs)


def _simulate_static(trace: Sequence[OnlineRequest], config: EngineConfig, cost: CostModel) -> OnlineResult:
    """Static batches on the static policies' executor (`policies.run_plan` on `simulator.TraceBatches`):
    when the model is idle, the requests that have arrived form batches of `max_batch_size`."""
    cap = config.max_new_tokens
    plan = PlanConfig(batch_size=config.max_batch_size, max_new_tokens=cap)
    lengths = [TraceRequest(r.prompt_len, max(1, min(r.output_len, cap))) for r in trace]
    runner = TraceBatches(lengths, plan, cost, start_s=0.0)
    waiting = deque(sorted(range(len(trace)), key=lambda i: trace[i].arrival_s))
    while waiting:
        runner.clock = max(runner.clock, trace[waiting[0]].arrival_s)
        rows = []
        while waiting and len(rows) < plan.batch_size and trace[waiting[0]].arrival_s <= runner.clock:
            rows.append(waiting.popleft())
        run_plan([Batch(tuple(rows), cap)], runner, plan)
    finish = [runner.last_token[i] for i in range(len(trace))]
    tokens = sum(r.output_len for r in lengths)
    return _online_result("fcfs", trace, finish, tokens, runner.clock, runner.peak, 0)


def oracle(request: OnlineRequest, *, every: int, cap: int) -> OnlineRequest:
    """`request` with its true length as the prediction and its true remainder as every re-prediction."""
    n = max(1, min(request.output_len, request.cap(cap)))
    remaining = tuple(float(n - j * every) for j in range((n - 1) // every + 1))
    return dataclasses.replace(request, predicted=float(n), remaining=remaining)


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

    def add(i: int) -> None:
        runner.clock += charge
        sched.add(i, trace[i].prompt_len, trace[i].cap(cap), None if at_arrival else trace[i].predicted)

    run_in_steps(sched, [r.arrival_s for r in trace], add, lambda: sched.step(runner), clock=lambda: runner.clock,
                 wait=runner.skip_to)  # fmt: skip
    tokens = sum(runner.targets)
    return _online_result(policy, trace, runner.finish, tokens, runner.clock, runner.peak, sched.preemptions)
