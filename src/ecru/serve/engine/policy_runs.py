"""Run a scheduling policy for real on a model: wall time, latencies, token slots, outputs in input order.

Static policies run their plan on `ModelBatches` (`policies.run_plan`); continuous ones serve the group on the
request engine (`generate_continuous`), as the simulator replays them (`simulator.simulate_continuous`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ecru.serve.engine.request_engine import RequestEngine
from ecru.serve.engine.sampling import SamplingParams
from ecru.serve.engine.static import GenerationConfig, generate_static, resume_static
from ecru.serve.sched.names import CONTINUOUS_POLICIES, DEFAULT_AGING, POLICIES
from ecru.serve.sched.policies import PlanConfig, continuous_config, plan_batches, reservations, run_plan
from ecru.serve.sched.queues import RequestQueue, make_queue
from ecru.serve.sched.scheduler import EngineConfig, run_in_steps


@dataclass
class PolicyRun:
    """One policy's run over a group of prompts (all arriving at time 0)."""

    policy: str
    tokens: list[list[int]]
    """Generated tokens per request, in input order."""
    finish_s: list[float]
    """Completion time of each request from the start (prediction time included)."""
    wall_s: float
    """Prediction plus generation seconds."""
    slots: int
    """Token slots computed, first attempts and reruns included."""
    failures: int
    """Rows recomputed: FCR rows cut at their batch's cap (rerun from scratch, or resumed with
    `PlanConfig.resume`), cb-kv rows preempted."""
    peak_kv_tokens: int | None = None
    """Most KV-cache positions held at once, padding included (continuous policies; None: not measured)."""

    @property
    def useful(self) -> int:
        return sum(len(t) for t in self.tokens)

    def metrics(self) -> dict[str, float]:
        """The benchmark JSON's per-policy fields."""
        n, lat = len(self.tokens), sorted(self.finish_s)
        return {
            "samples_per_s": n / self.wall_s,
            "tokens_per_s": self.useful / self.wall_s,
            "effective_token_ratio": self.useful / self.slots,
            "failure_ratio": self.failures / n,
            "mean_latency_s": sum(lat) / n,
            "p99_latency_s": lat[min(n - 1, int(round(0.99 * (n - 1))))],
            "wall_s": self.wall_s,
            "peak_kv_tokens": self.peak_kv_tokens,
        }


def run_static(
    model,
    prompts,
    *,
    policy: str,
    predicted,
    gen: GenerationConfig,
    plan: PlanConfig,
    predict_s: float = 0.0,
    progress: bool = False,
) -> PolicyRun:
    """Execute a static policy's plan, then FCR reruns of the rows cut at a predicted cap (`run_plan`)."""
    from tqdm.auto import tqdm

    batches = plan_batches(policy, predicted=predicted, prompt_lens=[len(p) for p in prompts], config=plan)
    with tqdm(total=len(prompts), desc=policy, unit="req", disable=not progress, leave=False) as bar:
        runner = ModelBatches(model, prompts, gen, plan, start_s=predict_s, done=bar.update)
        failed = run_plan(batches, runner, plan)
    return PolicyRun(policy, runner.tokens, runner.finish, runner.clock(), runner.slots, len(failed))


class ModelBatches:
    """Static batches on the model (`policies.BatchRunner`): each batch generates until every row has an EOS
    or its budget; a cut row keeps its tokens (`plan.resume`) and its KV (`plan.keep_kv`) for its rerun."""

    def __init__(self, model, prompts, gen: GenerationConfig, plan: PlanConfig, *, start_s: float, done=None):
        self.model, self.prompts, self.gen, self.plan, self.done = model, prompts, gen, plan, done
        self.tokens: list = [None] * len(prompts)
        self.finish, self.slots = [0.0] * len(prompts), 0
        self.partial: dict[int, list[int]] = {}
        self.kept: dict = {}
        self._last: dict = {}
        self._start = time.perf_counter() - start_s

    def clock(self) -> float:
        """Seconds since the start, prediction time included."""
        return time.perf_counter() - self._start

    def run(self, batch) -> set[int]:
        had = [self.partial.pop(r, []) for r in batch.rows]
        kv = [self.kept.pop(r, None) for r in batch.rows]
        used, rows = self._generate(batch, had, kv)
        self.slots += used
        self._last = dict(zip(batch.rows, rows, strict=True))
        return {r for r, (_, ended, _) in self._last.items() if ended}

    def collect(self, batch, cut: list[int]) -> None:
        now = self.clock()
        for r, (toks, _, kv) in self._last.items():
            if r not in cut:
                self.tokens[r], self.finish[r] = toks, now
            elif self.plan.resume:  # rerun from the tokens it had (else from scratch)
                self.partial[r] = toks
                if kv is not None:
                    self.kept[r] = kv
        if self.done is not None:
            self.done(len(batch.rows) - len(cut))

    def _generate(self, batch, had, kv):
        """One batch: the token slots it computed, and per row its answer (the tokens it `had`, then the new
        ones, each row stopping at an EOS or at its own budget, max_new_tokens in all), whether it ended with an
        EOS and, with `plan.keep_kv`, the KV of a row cut at the cap. A rerun whose rows all have their KV
        (`kv`) continues them without a prefill. A batch capped at 0 (every prediction 0) computes nothing."""
        if batch.cap == 0:
            return 0, [(h, False, None) for h in had]
        plan, gen = self.plan, self.gen
        budgets = [min(batch.cap, plan.max_new_tokens - len(h)) for h in had]
        if batch.rerun and all(v is not None for v in kv):
            result = resume_static(self.model, kv, [h[-1] for h in had], max_new_tokens=batch.cap, config=gen,
                                   budgets=budgets)  # fmt: skip
        else:
            seqs = [list(self.prompts[r]) + h for r, h in zip(batch.rows, had, strict=True)]
            keep = plan.keep_kv and not batch.rerun and batch.cap < plan.max_new_tokens  # FCR cuts only
            result = generate_static(self.model, seqs, max_new_tokens=batch.cap, config=gen, budgets=budgets,
                                     keep_cut=keep)  # fmt: skip
        kept = result.kept or [None] * len(had)
        return result.slots, [
            (h + t, e, k) for h, t, e, k in zip(had, result.tokens, result.ended, kept, strict=True)
        ]


@dataclass
class ContinuousResult:
    """Outputs in request order, with slot accounting and per-request completion times."""

    tokens: list[list[int]]
    finish_s: list[float]
    """Seconds from the start of the run to each request's last token."""
    decode_steps: int
    slots: int
    """Token slots computed: one per row per decode step, plus the prefill's first token per request."""
    prefills: int
    admitted_order: list[int] = field(default_factory=list)
    """Requests in the order they were admitted (a preempted one appears again when readmitted)."""
    preemptions: int = 0
    peak_kv_tokens: int = 0
    """Most KV-cache positions held at once, padding included (`EngineStats.peak_kv_tokens`)."""


def generate_continuous(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    queue: RequestQueue,
    gen: GenerationConfig,
    config: EngineConfig,
    arrivals: Sequence[int] | None = None,
    reserve: Sequence[float] | None = None,
) -> ContinuousResult:
    """Serve every prompt on the request engine; request i joins `queue` at decode step `arrivals[i]` (all
    at 0 by default). Under cb-kv's `config.kv_budget`, requests reserve `reserve[i]` answer tokens (default: the
    cap; see `Admitter`); a preempted request restarts from its prompt, as the simulator models it."""
    if reserve is not None and len(reserve) != len(prompts):
        raise ValueError(f"reserve has {len(reserve)} entries for {len(prompts)} prompts")
    # no prefix caching: the static baselines and the simulator this front end is compared with have none
    engine = RequestEngine(model, eos_token_ids=gen.eos_token_ids, pad_token_id=gen.pad_token_id,
                           config=replace(config, prefix_cache=0), context_len=10**9, queue=queue,
                           discard_preempted=True)  # fmt: skip
    sched = engine.scheduler
    sched.admission_log = []
    params, requests = SamplingParams(max_tokens=config.max_new_tokens), {}

    def add(i: int) -> None:
        requests[i] = engine.add_request(
            prompts[i], params, key=i, reserve=None if reserve is None else reserve[i]
        )

    start = time.perf_counter()
    run_in_steps(sched, [0] * len(prompts) if arrivals is None else arrivals, add, engine.step)
    reqs = [requests[i] for i in range(len(prompts))]
    s = engine.stats
    return ContinuousResult([r.output for r in reqs], [r.finish_s - start for r in reqs], sched.steps, s.tokens,
                            s.prefills, sched.admission_log, s.preemptions, s.peak_kv_tokens)  # fmt: skip


def run_policy(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    policy: str,
    predicted: Sequence[float] | None,
    gen: GenerationConfig,
    plan: PlanConfig,
    aging: float = DEFAULT_AGING,
    refill_min: int = 4,
    predict_s: float = 0.0,
    progress: bool = False,
) -> PolicyRun:
    """Run any policy of `POLICIES`; `predicted` is unused by fcfs and cb (pass the true lengths for oracle)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    if policy not in CONTINUOUS_POLICIES:
        return run_static(model, prompts, policy=policy, predicted=predicted, gen=gen, plan=plan,
                          predict_s=predict_s, progress=progress)  # fmt: skip
    # cb (FCFS admission), cb-sjf (shortest predicted first), cb-ljf (longest first), aged; cb-kv (FCFS, KV
    # reserved by predicted length under the budget; preemptions count as failures)
    config = continuous_config(policy, plan, [len(p) for p in prompts], refill_min=refill_min)
    queue, reserve = make_queue(policy, predicted, aging=aging), reservations(policy, predicted)
    start = time.perf_counter()
    result = generate_continuous(model, prompts, queue=queue, gen=gen, config=config, reserve=reserve)
    wall, finish = predict_s + time.perf_counter() - start, [predict_s + t for t in result.finish_s]
    return PolicyRun(
        policy, result.tokens, finish, wall, result.slots, result.preemptions, result.peak_kv_tokens
    )
