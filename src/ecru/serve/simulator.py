"""Replay a length trace through a policy: exact token-slot accounting plus modelled time.

Trace JSONL, one request per line: {"prompt_len": int, "output_len": int, "predicted_len": number}.
Static policies (`simulate`): each batch runs min(cap, longest output_len in it) steps and computes
rows x steps token slots (first attempts and FCR reruns alike). A resumed rerun (`PlanConfig.resume`)
prefills each row's prompt plus the tokens it had and runs until its longest row is done, each row
stopping at its answer's end or its own budget, max_new_tokens in all; with `PlanConfig.keep_kv` it has no
prefill, only its decode steps. A request's useful tokens, min(output_len, max_new_tokens), count once, on
the run that completes it.
Continuous batching (`simulate_continuous`): the engine's `Scheduler` on a `SimulatedRunner`, driven as
`generate_continuous` drives the engine, so its admission order, decode steps, prefills and slots are the
engine's by construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ecru.errors import EcruError
from ecru.io import BadLine, read_jsonl
from ecru.serve.cost import SMOLLM2_CPU, CostModel
from ecru.serve.policies import Batch, PlanConfig, plan_batches, run_plan
from ecru.serve.queues import RequestQueue
from ecru.serve.scheduler import ContinuousConfig, EngineConfig, Scheduler, run_in_steps
from ecru.serve.sim_runner import SimulatedRunner


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
    """Accounting of one policy over one trace (names as in the JSON)."""

    policy: str
    requests: int
    batches: int
    rerun_batches: int
    batch_steps: int
    padded_slots: int
    useful_tokens: int
    effective_token_ratio: float
    failures: int
    failure_ratio: float
    avg_padded_length: float
    time_s: float
    samples_per_s: float
    tokens_per_s: float
    mean_latency_s: float

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
) -> SimResult:
    """Execute `policy`'s plan (and FCR reruns) against the true lengths of `trace`."""
    if policy == "oracle":
        predicted = [r.output_len for r in trace]
    else:
        predicted = [r.predicted_len for r in trace]
        if policy != "fcfs" and any(p is None for p in predicted):
            raise EcruError(f"policy {policy!r} needs predicted_len on every trace line")
    plan = plan_batches(policy, predicted=predicted, prompt_lens=[r.prompt_len for r in trace], config=config)
    runner = TraceBatches(trace, config, cost, start_s=predict_s)
    failures = run_plan(plan, runner, config)
    useful = sum(min(r.output_len, config.max_new_tokens) for r in trace)
    return _result(policy, trace, runner.clock, runner.slots, useful, batches=runner.batches,
                   rerun_batches=runner.reruns, batch_steps=runner.steps, failures=len(failures),
                   latency=sum(runner.done_at.values()))  # fmt: skip


def _result(policy, trace, clock, slots, useful, *, batches, rerun_batches, batch_steps, failures, latency):
    n = len(trace)
    return SimResult(
        policy=policy,
        requests=n,
        batches=batches,
        rerun_batches=rerun_batches,
        batch_steps=batch_steps,
        padded_slots=slots,
        useful_tokens=useful,
        effective_token_ratio=useful / slots if slots else 1.0,
        failures=failures,
        failure_ratio=failures / n,
        avg_padded_length=slots / n,
        time_s=clock,
        samples_per_s=n / clock if clock else float("inf"),
        tokens_per_s=useful / clock if clock else float("inf"),
        mean_latency_s=latency / n,
    )


def simulate_continuous(
    trace: Sequence[TraceRequest],
    *,
    queue: RequestQueue,
    config: ContinuousConfig,
    cost: CostModel = SMOLLM2_CPU,
    arrivals: Sequence[int] | None = None,
    predict_s: float = 0.0,
    policy: str = "cb",
    reserve: Sequence[float] | None = None,
) -> tuple[SimResult, list[int]]:
    """Continuous batching over the true lengths of `trace`; returns the result and the admission order.

    Mirrors `generate_continuous`: request i joins `queue` at decode step `arrivals[i]`; when at least
    `refill_min` rows are free (or nothing else can come, or the batch is empty), waiting requests are
    prefilled together (one token each) and join the batch; every decode step gives each running row
    one token; a row leaves when it has min(output_len, max_new_tokens) tokens. Time: one prefill per
    admission, cost.step_time(rows, widest row) per decode step. Latency: finish minus arrival clock.
    With `config.kv_budget`, the same `Admitter` reserves `reserve[i]` answer tokens per request and
    preempts as the real loop does (either `kv_accounting`); a preempted request's tokens are computed again (slots count both
    attempts) and `failures` counts preemptions.
    """
    n, cap = len(trace), config.max_new_tokens
    target = [max(1, min(r.output_len, cap)) for r in trace]
    sched = Scheduler(EngineConfig(max_batch_size=config.max_batch_size, max_new_tokens=cap, prefix_cache=0),
                      queue=queue, limits=config, discard_preempted=True)  # fmt: skip
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
    result = _result(policy, trace, runner.clock, runner.slots, sum(target), batches=runner.prefills,
                     rerun_batches=0, batch_steps=sched.steps, failures=sched.preemptions, latency=latency)  # fmt: skip
    return result, sched.admission_log
