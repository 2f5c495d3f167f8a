"""The engine core's scheduler: who waits, who runs, who is preempted, whose KV is kept. Model-free, torch-free.

One scheduler drives the real engine (`request_engine.RequestEngine`, run by `model_runner.ModelRunner`) and
every continuous-batching simulator (`sim_runner.SimulatedRunner`: a trace's lengths on a cost-model
clock), so the engine and the simulators decide alike by construction. `Scheduler.step(runner)` is
nano-vllm's `LLMEngine.step` / vLLM v1's EngineCore step, in three phases, each planned here and executed
by the runner:

1. prefill on arrival (`on_arrival`): arrived prompts are prefilled in `arrival_groups` once `refill_min`
   of them wait unprefilled or the batch could take them now; each gets its first token and a predicted
   length, and waits queued with its KV kept (at most `arrival_kv_requests` waiting requests keep KV:
   beyond, the longest-predicted one's is released and it is prefilled again at admission);
2. admission (`EngineConfig.policy`: cb, cb-sjf, cb-srpt, cb-kv; `continuous.Admitter` over a waiting
   queue, `admissions` decides how many): requests with kept KV rejoin without a forward, the others are
   prefilled (prompt plus the tokens a preempted request kept);
3. one decode step for every running row; then cb-kv's budget preempts the newest rows
   (`Admitter.preempt`) and cb-srpt swaps just re-predicted rows for waiting requests predicted shorter
   (`_srpt_preempt`), keeping or dropping their KV (`preempt_mode`).

The scheduler counts each request's tokens; the runner says which rows ended (EOS, a stop string, the
cap, a trace's length) and gives the predictions (a state predictor at arrival, a remaining-length
predictor at re-prediction points).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ecru.serve.continuous import (
    Admitter,
    ContinuousConfig,
    admissions,
    arrival_groups,
    arrival_prefill_due,
    kv_budget_config,
)
from ecru.serve.names import ENGINE_POLICIES, FCFS_SLACK, PREEMPT_MODES, SJF_POLICIES
from ecru.serve.queues import DEFAULT_AGING, FCFSQueue, RequestQueue, SJFQueue


@dataclass(frozen=True)
class EngineConfig:
    """Batching limits and the admission policy."""

    policy: str = "cb"
    """Admission: cb (first come first served), cb-sjf (shortest predicted first, aged), cb-srpt (cb-sjf,
    then shortest predicted remaining first: re-prediction while generating and preemption; needs a
    remaining-length predictor), cb-kv (KV reserved by predicted length)."""
    max_batch_size: int = 16
    """Rows decoded together at most (cb-kv: the rows whose cap-length KV memory is shared)."""
    max_new_tokens: int = 256
    """The largest max_tokens a request may ask for (and the default in the front ends)."""
    refill_min: int = 4
    """Admit only when this many rows are free (or the batch is empty, or fewer wait)."""
    aging: float | None = None
    """cb-sjf, cb-srpt: priority tokens gained per decode step waited (no starvation); None: 0 under an FCFS
    deadline (it bounds the wait instead), else `DEFAULT_AGING`."""
    fcfs_slack: float | None = None
    """cb-sjf, cb-srpt: admit the longest-waiting request first once it has waited (1 + fcfs_slack) x the wait
    first-come-first-served would now impose (predicted backlog / max_batch_size decode steps;
    `queues.SJFQueue`); inf: off, aging alone bounds the wait; None: the shipped default, `FCFS_SLACK` for
    cb-srpt, off for cb-sjf."""
    kv_prompt_tokens: int = 128
    """cb-kv: prompt tokens per row in the budget, max_batch_size x (max_new_tokens + this)."""
    kv_row_factor: int = 4
    """cb-kv: rows allowed, as a multiple of max_batch_size, when reservations are small."""
    prefix_cache: int = 16
    """Recently prefilled sequences whose KV is kept for prompts that start alike (`prefix_cache`
    module); 0 turns prefix caching off. The model runner's; the scheduler ignores it."""
    arrival_kv_requests: int = 256
    """Waiting requests whose KV is kept at most, prefilled on arrival or preempted by cb-srpt (beyond, the
    longest-predicted one's is dropped and it is prefilled again, prompt and tokens, at admission)."""
    repredict_every: int = 16
    """cb-srpt: generated tokens between re-predictions of a running row's remaining length."""
    preempt_margin: float = 64.0
    """cb-srpt: a full batch swaps a just re-predicted row for a waiting request predicted this many tokens
    shorter than the row's remainder (inf: never)."""
    preempt_mode: str = "keep"
    """cb-srpt: a preempted row's KV is kept while it waits (counted in `peak_kv_tokens`; it rejoins
    without a forward) or dropped and recomputed from its prompt and tokens ("recompute")."""

    def __post_init__(self):
        if self.policy not in ENGINE_POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {', '.join(ENGINE_POLICIES)}")
        ints = ("max_batch_size", "max_new_tokens", "refill_min", "kv_prompt_tokens", "kv_row_factor",
                "arrival_kv_requests", "repredict_every")  # fmt: skip
        for name in ints:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefix_cache < 0:
            raise ValueError(f"prefix_cache must be >= 0 (0 = off), got {self.prefix_cache}")
        if self.aging_per_step < 0:
            raise ValueError(f"aging must be >= 0, got {self.aging}")
        slack = self.fcfs_slack
        if (slack is not None and slack < 0) or (
            self.deadline is not None and self.policy not in SJF_POLICIES
        ):
            raise ValueError(f"fcfs_slack must be >= 0 and needs policy cb-sjf or cb-srpt (inf: off), got "
                             f"{slack} with {self.policy}")  # fmt: skip
        if self.preempt_margin < 0 or self.preempt_mode not in PREEMPT_MODES:
            raise ValueError(f"preempt_margin must be >= 0 and preempt_mode one of {PREEMPT_MODES}; got "
                             f"{self.preempt_margin}, {self.preempt_mode!r}")  # fmt: skip

    @property
    def deadline(self) -> float | None:
        """The FCFS deadline's slack, None when off (`fcfs_slack`, or the policy's shipped default)."""
        slack = (
            (FCFS_SLACK if self.policy == "cb-srpt" else math.inf)
            if self.fcfs_slack is None
            else self.fcfs_slack
        )
        return None if math.isinf(slack) else slack

    @property
    def aging_per_step(self) -> float:
        """The aging in force (`aging`, or the policy's default)."""
        if self.aging is not None:
            return self.aging
        return DEFAULT_AGING if self.deadline is None else 0.0

    def continuous(self) -> ContinuousConfig:
        """The admitter's limits."""
        if self.policy != "cb-kv":
            return ContinuousConfig(self.max_batch_size, self.max_new_tokens, self.refill_min)
        return kv_budget_config(self.max_batch_size, self.max_new_tokens, [self.kv_prompt_tokens],
                                refill_min=self.refill_min, row_factor=self.kv_row_factor, accounting="padded")  # fmt: skip


@dataclass
class Seq:
    """The scheduler's view of one request."""

    key: int
    prompt_len: int
    cap: int
    """Its max_tokens."""
    predicted: float | None = None
    """Its predicted answer length, at most `cap` (its queue key; cb-srpt: its tokens so far plus its latest
    predicted remainder)."""
    generated: int = 0
    """Answer tokens it holds (a preempted request keeps them unless the scheduler discards preempted work)."""


@dataclass
class Outcome:
    """What a runner reports after executing one phase of a step."""

    ended: set[int] = field(default_factory=set)
    """Rows whose answer ended with the token just computed."""
    predicted: Mapping[int, float] = field(default_factory=dict)
    """Prefill on arrival: each prefilled request's predicted answer length; decode: each re-predicted
    row's predicted remaining tokens (rows missing: not re-predicted)."""


class Runner(Protocol):
    """Executes the scheduler's plans: on the model (`model_runner.ModelRunner`) or on a cost-model clock
    (`sim_runner.SimulatedRunner`). Rows are request keys; the runner's batch holds the running rows in the
    order the scheduler's `running` lists them."""

    def prefill_arrivals(self, groups: list[list[int]]) -> Outcome:
        """Prefill each group in one forward (first token, predicted length); keep the KV of rows that go on."""
        ...

    def admit(self, kept: list[int], fresh: list[int]) -> Outcome:
        """Join the batch: `kept` rows with their kept KV (no forward), then `fresh` rows prefilled (prompt and
        the tokens they hold, one new token each; those that go on join in this order)."""
        ...

    def decode(self, rows: list[int], repredict: list[int]) -> Outcome:
        """One decode step of `rows`; predict the remaining tokens of `repredict` from this step's states."""
        ...

    def preempt(self, keys: list[int], *, keep_kv: bool, discard: bool) -> None:
        """Rows `keys` leave the batch, their KV kept (`keep_kv`) or dropped; `discard`: their tokens too."""
        ...

    def release(self, keys: list[int]) -> None:
        """Drop the kept KV of waiting requests `keys` (they are prefilled again at admission)."""
        ...


class Scheduler:
    """Waiting and running requests, admission, preemption, kept KV; `step(runner)` runs one iteration."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        queue: RequestQueue | None = None,
        limits: ContinuousConfig | None = None,
        discard_preempted: bool = False,
        srpt: bool = False,
        on_arrival: bool = False,
    ):
        """`queue` and `limits` replace the ones `config` implies (offline measurements bring their own);
        `discard_preempted`: a preempted request restarts from its prompt; `srpt`: cb-srpt's re-prediction
        (the runner predicts remaining lengths); `on_arrival`: prefill on arrival (the runner predicts each
        length from that prefill)."""
        self.config, self.srpt, self.on_arrival = config, srpt, on_arrival
        self.discard_preempted = discard_preempted
        self.seqs: dict[int, Seq] = {}
        self._predicted: dict[int, float] = {}
        if queue is None:
            queue = self._sjf_queue() if config.policy in SJF_POLICIES else FCFSQueue()
        self.admitter = Admitter(queue, [], limits or config.continuous(),
                                 generated=lambda i: self.seqs[i].generated)  # fmt: skip
        self.running: list[int] = []
        self.arrived: dict[int, None] = {}  # arrived, not yet prefilled (prefill on arrival), in order
        self.kept: dict[int, tuple[int, float]] = {}  # waiting with KV kept: (positions, predicted), in order
        self.steps = 0
        """Decode steps so far: the queues' clock."""
        self.upcoming = 0
        """Requests the caller will add later: admission waits for `refill_min` of them (offline runs)."""
        self.preemptions = 0
        self.admission_log: list[int] | None = None
        """When a list, the keys of admitted requests are appended in admission order."""
        self._swapped = False
        self._check()

    def _check(self) -> None:
        limits = self.admitter.config
        if self.on_arrival and limits.kv_budget is not None:
            raise ValueError("prefill on arrival (state_predictor) does not support a KV budget (cb-kv): "
                             "use policy cb or cb-sjf")  # fmt: skip
        if self.srpt != (self.config.policy == "cb-srpt"):
            raise ValueError("policy cb-srpt needs a remaining-length predictor (remaining=, e.g. a fitted "
                             "RemainingProbe), and only it takes one")  # fmt: skip
        if not self.srpt:
            return
        if not isinstance(self.admitter.queue, SJFQueue) or limits.kv_budget is not None:
            raise ValueError("cb-srpt preempts by priority in an SJFQueue, without a KV budget: give no queue "
                             "and no limits with a kv_budget")  # fmt: skip
        if self.discard_preempted:
            raise ValueError("cb-srpt's preempted rows keep their tokens: discard_preempted is for cb-kv")

    @property
    def limits(self) -> ContinuousConfig:
        return self.admitter.config

    @property
    def max_rows(self) -> int:
        return self.limits.max_batch_size

    @property
    def num_waiting(self) -> int:
        return len(self.seqs) - len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    # ---- requests come and go ------------------------------------------------------------------------
    def add(self, key: int, prompt_len: int, cap: int, predicted: float | None = None) -> Seq:
        """Register request `key` (its `predicted` length queues it; with prefill on arrival the runner's
        prediction does, at the arrival prefill)."""
        if key in self.seqs:
            raise ValueError(f"request key {key} is already in use")
        seq = self.seqs[key] = Seq(key, prompt_len, cap)
        if self.on_arrival:
            self.arrived[key] = None
        else:
            self._enqueue(seq, float(cap) if predicted is None else predicted)
        return seq

    def finish(self, key: int) -> None:
        """Request `key` is done (finished or cancelled): forget it everywhere."""
        self.admitter.forget(key)
        self.arrived.pop(key, None)
        self.kept.pop(key, None)
        if key in self.running:
            self.running.remove(key)
        self.seqs.pop(key, None)

    def _enqueue(self, seq: Seq, predicted: float) -> None:
        seq.predicted = min(float(seq.cap), predicted)
        self.admitter.add(seq.key, seq.prompt_len, seq.predicted, cap=seq.cap)
        self._push(seq.key, seq.predicted)

    def _push(self, key: int, value: float) -> None:
        """Queue request `key` with `value` as its predicted length (the queue reads it on push)."""
        self._predicted[key] = value
        self.admitter.queue.push(key, now=self.steps)
        del self._predicted[key]

    def _sjf_queue(self) -> SJFQueue:
        cfg = self.config
        return SJFQueue(self._predicted, aging=cfg.aging_per_step, fcfs_slack=cfg.deadline, rows=cfg.max_batch_size,
                        running_tokens=self._running_tokens)  # fmt: skip

    def _running_tokens(self) -> float:
        """The running rows' predicted remaining tokens (the FCFS deadline's share of the backlog)."""
        rows = (self.seqs[k] for k in self.running)
        return sum(max(0.0, s.predicted - s.generated) for s in rows if s.predicted is not None)

    # ---- one iteration ---------------------------------------------------------------------------------
    def step(self, runner: Runner) -> list[int]:
        """One iteration on `runner`; the keys of the requests that finished in it."""
        finished: list[int] = []
        if self._arrival_due():
            finished += self._prefill_arrivals(runner)
        kept, fresh = self._schedule()
        if kept or fresh:
            finished += self._admitted(kept, fresh, runner.admit(kept, fresh).ended)
        if self.running:
            finished += self._decode(runner)
        return finished

    def _arrival_due(self) -> bool:
        return arrival_prefill_due(arrived=len(self.arrived), running=len(self.running),
                                   waiting=self.num_waiting - len(self.arrived), max_batch_size=self.max_rows,
                                   refill_min=self.limits.refill_min)  # fmt: skip

    def _prefill_arrivals(self, runner: Runner) -> list[int]:
        """Prefill on arrival; the requests still running wait queued, in arrival order, with their KV."""
        arrived = list(self.arrived)
        self.arrived.clear()
        lengths = [self.seqs[k].prompt_len for k in arrived]
        out = runner.prefill_arrivals(
            [[arrived[i] for i in g] for g in arrival_groups(lengths, self.max_rows)]
        )
        finished = []
        for key in arrived:
            seq = self.seqs[key]
            seq.generated += 1
            seq.predicted = min(float(seq.cap), out.predicted[key])
            if key in out.ended:  # ended at its first token: never queued
                self.finish(key)
                finished.append(key)
            else:
                self.kept[key] = (seq.prompt_len, seq.predicted)
                self._enqueue(seq, seq.predicted)
        runner.release(self._drop_over_bound())
        return finished

    def _schedule(self) -> tuple[list[int], list[int]]:
        """The admitted requests: those whose KV is kept, then those to prefill."""
        free = self.max_rows - len(self.running)
        n = admissions(free=free, waiting=len(self.admitter), upcoming=self.upcoming,
                       running=len(self.running), refill_min=self.limits.refill_min)  # fmt: skip
        if self._swapped:  # rows cb-srpt freed for shorter requests are refilled at once
            n, self._swapped = min(free, len(self.admitter)), False
        keys = self.admitter.admit(n, now=self.steps)
        if self.admission_log is not None:
            self.admission_log += keys
        kept = [k for k in keys if self.kept.pop(k, None) is not None]
        return kept, [k for k in keys if k not in kept]

    def _admitted(self, kept: list[int], fresh: list[int], ended: set[int]) -> list[int]:
        self.running += kept
        for key in fresh:
            self.seqs[key].generated += 1
        self.running += [k for k in fresh if k not in ended]
        finished = [k for k in fresh if k in ended]
        for key in finished:
            self.finish(key)
        return finished

    def _decode(self, runner: Runner) -> list[int]:
        rows = list(self.running)
        due = self._repredict_due(rows)
        out = runner.decode(rows, due)
        self.steps += 1
        for key, left in out.predicted.items():  # the state read after `generated` tokens
            seq = self.seqs[key]
            seq.predicted = min(float(seq.cap), seq.generated + left)
        for key in rows:
            self.seqs[key].generated += 1
        finished = [k for k in rows if k in out.ended]
        for key in finished:
            self.finish(key)
        self._kv_preempt(runner)
        repredicted = [k for k in due if k in out.predicted and k not in out.ended]
        if repredicted:
            self._srpt_preempt(repredicted, runner)
        return finished

    def _repredict_due(self, rows: list[int]) -> list[int]:
        """cb-srpt: rows whose remaining length is predicted again at this decode step, every
        `repredict_every` generated tokens (the step's state is the one that emits the next token)."""
        if not self.srpt:
            return []
        k = self.config.repredict_every
        return [key for key in rows if self.seqs[key].generated and self.seqs[key].generated % k == 0]

    # ---- preemption --------------------------------------------------------------------------------------
    def _kv_preempt(self, runner: Runner) -> None:
        """cb-kv: reservations that outgrew the budget preempt the newest rows (`Admitter.preempt`)."""
        out = self.admitter.preempt(self.running, [self.seqs[k].generated for k in self.running])
        if not out:
            return
        runner.preempt(out, keep_kv=False, discard=self.discard_preempted)
        for key in out:
            self.running.remove(key)
            if self.discard_preempted:
                self.seqs[key].generated = 0
        self.preemptions += len(out)

    def _srpt_preempt(self, repredicted: list[int], runner: Runner) -> None:
        """A full batch swaps its just re-predicted rows, highest priority key first (predicted remainder
        less the aging it earned waiting), for waiting requests whose key is `preempt_margin` lower, one for
        one, at most `refill_min`. Rows admitted past their FCFS deadline stay, and so do rows that would be
        past it as soon as they waited again (the deadline would readmit them at once)."""
        queue, cfg = self.admitter.queue, self.config
        if len(self.running) < self.max_rows or not len(queue):
            return
        left = {k: self.seqs[k].predicted - self.seqs[k].generated for k in repredicted}
        key = {k: left[k] - cfg.aging_per_step * queue.waited(k) for k in repredicted}
        stay = queue.past_deadline | {k for k in repredicted if queue.would_be_overdue(queue.waited(k))}
        victims = sorted((k for k in repredicted if k not in stay), key=key.get, reverse=True)
        waiting = queue.smallest(self.limits.refill_min, now=self.steps)
        out = [v for v, w in zip(victims, waiting, strict=False) if key[v] - w > cfg.preempt_margin]
        if not out:
            return
        keep = cfg.preempt_mode == "keep"
        runner.preempt(out, keep_kv=keep, discard=False)
        for k in out:  # its newest token is pending: not in the kept cache
            seq = self.seqs[k]
            if keep:
                self.kept[k] = (seq.prompt_len + seq.generated - 1, left[k])
            self.admitter.leave(k)
            self.running.remove(k)
            self._push(k, left[k])
        self.preemptions += len(out)
        self._swapped = True
        runner.release(self._drop_over_bound())  # a dropped row is prefilled again (prompt and tokens)

    def _drop_over_bound(self) -> list[int]:
        """At most `arrival_kv_requests` waiting requests keep their KV: the longest-predicted ones (the
        newest among equals) lose it first; their keys."""
        dropped = []
        while len(self.kept) > self.config.arrival_kv_requests:
            key = max(reversed(self.kept), key=lambda k: self.kept[k][1])
            del self.kept[key]
            dropped.append(key)
        return dropped


def run_in_steps(
    scheduler: Scheduler, arrivals: Sequence[int], add: Callable[[int], None], step: Callable[[], object]
) -> None:
    """Drive `scheduler` until every request is served: request i is added (`add(i)`) before decode step
    `arrivals[i]`, `step()` runs one iteration; an idle gap before the next arrival is skipped."""
    incoming = deque(sorted(range(len(arrivals)), key=lambda i: arrivals[i]))
    while incoming or scheduler.has_unfinished():
        now = scheduler.steps
        while incoming and arrivals[incoming[0]] <= now:
            add(incoming.popleft())
        scheduler.upcoming = len(incoming)
        step()
        if scheduler.steps == now and incoming and not scheduler.has_unfinished():
            scheduler.steps = max(now + 1, arrivals[incoming[0]])
